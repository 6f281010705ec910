r"""The Laplace approximation of the GP posterior at the MAP, in the model's unconstrained space.

The model's log density of the unconstrained vector already holds the transforms' Jacobian,
``log p(u | y) = log p(y | theta(u)) + log p(theta(u)) + log|d theta/d u| + const``, so its second-order Taylor
expansion at the mode ``u*`` (gradient zero) is a Gaussian in ``u``:

.. math::

    p(u \mid y) \approx \mathcal{N}(u;\ u^*,\ H^{-1}), \qquad H = -\nabla^2 \log p(u^* \mid y),

exact when the log density is quadratic in ``u``. Physical parameters are ``theta(u)`` of each draw, so the
approximation in physical units is the push-forward of that Gaussian (log-normal for scales, logit-normal for
bounded lags and widths).

**Hessian.** ``hessian="finite_difference"`` (the default) takes central differences of the model's exact JAX
gradient, ``H e_j = -(g(u* + h_j e_j) - g(u* - h_j e_j)) / (2 h_j)`` with ``h_j = step * max(1, |u*_j|)`` and
``step = eps^(1/3)`` (about 6e-6; truncation ``O(h^2)`` and rounding ``O(eps / h)`` balance there): 2 d evaluations
of the model's jitted ``value_and_grad``, one column at a time. ``hessian="autodiff"`` takes forward-over-reverse
derivatives, ``H e_j = -d/d eps grad(u* + eps e_j)`` (``jax.jvp`` of ``jax.grad(model.log_density)``), also one
column per call. It is not the default because GP-MSRM's backends define first derivatives only: the dense and
grouped factorizations are ``custom_vjp`` functions (no forward mode; their reverse rules run a ``while_loop``
that reverse mode cannot differentiate), host callbacks have no derivative rules at all, and the state-space
filter's ``custom_jvp`` rules trace but give a second derivative that is not symmetric (wrong) — while central
differences of the exact gradient agree across backends to rounding. ``"auto"`` tries autodiff and falls back
to finite differences when JAX refuses (recorded as ``hessian_fallback`` in the ``sampler`` attribute) or, with
a warning, when the autodiff Hessian is not symmetric to ``1e-8`` relative; it suits models whose log density
JAX can differentiate twice.

**Checks.** The Hessian is symmetrised, ``H <- (H + H^T)/2``, after its asymmetry ``max|H - H^T| / max|H|`` is
recorded (a warning above ``symmetry_tol``: a noisy gradient). It must be positive definite: its eigenvalues
``H = V diag(lambda) V^T`` are computed, and any ``lambda_i <= eigen_tol * max(lambda)`` refuses the
approximation (:class:`NotPositiveDefiniteError`) naming the parameters with the largest weights in the
eigenvectors ``V[:, i]`` of those directions: the mode is then a saddle or a flat ridge (an unconverged MAP,
or a direction the data do not determine), for which NUTS is the tool.

**Draws.** With ``H = L L^T`` (Cholesky) and ``eps ~ N(0, I_d)``, ``u = u* + L^{-T} eps`` has covariance
``L^{-T} L^{-1} = (L L^T)^{-1} = H^{-1}``. Each draw's approximate log density is
``log q(u) = -d/2 log(2 pi) + sum_i log L_ii - |eps|^2 / 2``; with ``log_density_draws`` the model's own log
density ``lp(u)`` is evaluated too, and the importance weights ``w = exp(lp - log q)`` give the effective sample
size ``(sum w)^2 / sum w^2`` (in ``(0, S]``; near ``S`` when the Gaussian is close to the posterior) in the
``sampler`` attribute.

**Result.** A :class:`LaplacePosterior`, the :class:`msrm.gp.posterior.Posterior` of :func:`sample` with one
chain of ``num_samples`` draws, the same ``posterior`` and ``unconstrained_posterior`` groups (same variable names
and dims), a ``sample_stats`` group holding only ``lp`` and ``log_q`` (chain, draw), and ``observed_data``; so
:func:`msrm.diagnostics.summarize`, :meth:`~msrm.gp.posterior.Posterior.latent_posterior` and
:meth:`~msrm.gp.posterior.Posterior.predict` work on it unchanged. Timings (seconds): ``mode`` (the MAP fit when
``init`` is None, else checking the given mode), ``hessian``, ``draws``, ``log_density_draws``,
``draw_conversion``, ``diagnostics``, ``total``.
"""
from __future__ import annotations

import json
import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .idata import build_inference_data, group_names, physical_draws
from .posterior import Posterior, as_vector, observed_group, diagnostics_summary, timed_phase

__all__ = ["approximate_posterior", "laplace_hessian", "LaplacePosterior", "NotPositiveDefiniteError", "METHODS",
           "HESSIAN_METHODS"]

#: Approximations :func:`approximate_posterior` offers.
METHODS = ("laplace",)
#: How the Hessian is computed (see the module docstring).
HESSIAN_METHODS = ("auto", "autodiff", "finite_difference")
#: Relative asymmetry above which an autodiff Hessian is taken to be wrong (exact arithmetic gives rounding only).
AUTODIFF_SYMMETRY_TOL = 1e-8


class NotPositiveDefiniteError(ValueError):
    """The negative log density's Hessian at the given point is not positive definite (no Gaussian there)."""


@dataclass
class LaplacePosterior(Posterior):
    """Result of :func:`approximate_posterior`: a :class:`~msrm.gp.posterior.Posterior` with one chain of draws
    from ``N(u*, H^{-1})`` (``num_leapfrog`` 0, no warm-up), plus the Gaussian itself.

    Extra fields:
        mode_u: (num_params,) the mode ``u*``.
        hessian: (num_params, num_params) symmetrised ``H``, the negative log density's Hessian at ``u*``.
        hessian_method: ``"autodiff"`` or ``"finite_difference"`` (what ran).
    """

    mode_u: np.ndarray | None = None
    hessian: np.ndarray | None = field(default=None, repr=False)
    hessian_method: str = ""

    @property
    def covariance_u(self) -> np.ndarray:
        """(num_params, num_params) ``H^{-1}``, the approximation's covariance of ``u``."""
        L = np.linalg.cholesky(self.hessian)
        Linv = np.linalg.inv(L)
        return Linv.T @ Linv


# ------------------------------------------------------------------------------------------ Hessian


def _autodiff_hessian(model, u: np.ndarray) -> np.ndarray:
    """(d, d) ``-d^2 log p / du^2`` by forward-over-reverse JAX derivatives, one column per jitted call."""
    import jax
    import jax.numpy as jnp

    grad = jax.grad(model.log_density)
    column = jax.jit(lambda x, v: jax.jvp(grad, (x,), (v,))[1])
    d = u.size
    x = jnp.asarray(u)
    H = np.empty((d, d))
    for j in range(d):
        H[:, j] = -np.asarray(column(x, jnp.zeros(d).at[j].set(1.0)))
    return H


def _finite_difference_hessian(model, u: np.ndarray, step: float) -> np.ndarray:
    """(d, d) ``-d^2 log p / du^2`` by central differences of ``model.value_and_grad``'s exact gradient."""
    d = u.size
    H = np.empty((d, d))
    for j in range(d):
        h = step * max(1.0, abs(float(u[j])))
        up, down = u.copy(), u.copy()
        up[j] += h
        down[j] -= h
        H[:, j] = -(model.value_and_grad(up)[1] - model.value_and_grad(down)[1]) / (2.0 * h)
    return H


def laplace_hessian(model, u, hessian: str = "finite_difference",
                    step: float | None = None) -> tuple[np.ndarray, str, float, str | None]:
    """The negative log density's Hessian at ``u``, not yet symmetrised.

    Args:
        model: supplies ``log_density`` (JAX-traceable) for autodiff and ``value_and_grad`` for finite differences.
        u: (num_params,) the point.
        hessian: ``"auto"``, ``"autodiff"`` or ``"finite_difference"`` (module docstring).
        step: relative finite-difference step (default ``eps^(1/3)``).
    Returns:
        (H (d, d), the method that ran, relative asymmetry ``max|H - H^T| / max|H|``, why ``"auto"`` fell back
        to finite differences or None).
    """
    if hessian not in HESSIAN_METHODS:
        raise ValueError(f"hessian must be one of {HESSIAN_METHODS}, got {hessian!r}")
    step = float(np.finfo(np.float64).eps ** (1.0 / 3.0)) if step is None else float(step)
    if not (step > 0 and math.isfinite(step)):
        raise ValueError(f"step must be a positive finite float, got {step!r}")
    u = np.asarray(u, dtype=np.float64)
    if hessian in ("auto", "autodiff"):
        try:
            H = _autodiff_hessian(model, u)
        except Exception as exc:  # JAX refuses a second derivative through custom_vjp rules or host callbacks
            if hessian == "autodiff":
                raise
            why = f"JAX cannot differentiate this log density twice ({type(exc).__name__}: {str(exc)[:160]})"
        else:
            asym = _asymmetry(H)
            if hessian == "autodiff" or asym <= AUTODIFF_SYMMETRY_TOL:
                return H, "autodiff", asym, None
            why = (f"the autodiff Hessian is not symmetric (relative asymmetry {asym:.2e}): the log density's "
                   f"custom derivative rules are exact to first order only")
            warnings.warn(f"Laplace Hessian: {why}; using central differences of the exact gradient instead",
                          RuntimeWarning, stacklevel=3)
    else:
        why = None
    H = _finite_difference_hessian(model, u, step)
    return H, "finite_difference", _asymmetry(H), why


def _asymmetry(H: np.ndarray) -> float:
    scale = float(np.max(np.abs(H))) if H.size else 0.0
    return float(np.max(np.abs(H - H.T)) / scale) if scale > 0 else 0.0


def _param_names(model) -> tuple[str, ...]:
    names = getattr(model, "param_names", None)
    if names is None or len(names) != model.num_params:
        return tuple(f"u[{i}]" for i in range(model.num_params))
    return tuple(names)


def _check_positive_definite(model, H: np.ndarray, eigen_tol: float) -> tuple[np.ndarray, float, float]:
    """The Cholesky factor of symmetric ``H``, its smallest and largest eigenvalues; raise
    :class:`NotPositiveDefiniteError` naming the parameters along every direction with ``lambda <= eigen_tol *
    max(lambda)``."""
    if not np.isfinite(H).all():
        bad = sorted({_param_names(model)[j] for j in np.flatnonzero(~np.isfinite(H).all(axis=0))})
        raise NotPositiveDefiniteError(f"the Hessian at the mode is not finite (columns of {bad[:5]}); the mode is "
                                       f"where the log density cannot be evaluated twice: use model.sample (NUTS)")
    lam, V = np.linalg.eigh(H)
    lam_max = float(lam[-1])
    bad = np.flatnonzero(lam <= eigen_tol * max(lam_max, 0.0))
    if bad.size:
        names = _param_names(model)
        lines = []
        for i in bad[:5]:
            top = np.argsort(-np.abs(V[:, i]))[:4]
            along = ", ".join(f"{names[j]} ({V[j, i]:+.2f})" for j in top)
            lines.append(f"eigenvalue {lam[i]:.3e} along {along}")
        more = f" (and {bad.size - 5} more)" if bad.size > 5 else ""
        raise NotPositiveDefiniteError(
            f"the negative log density's Hessian at the mode is not positive definite: {bad.size} of {lam.size} "
            f"eigenvalues <= {eigen_tol:g} x the largest ({lam_max:.3e}){more}:\n  " + "\n  ".join(lines)
            + "\nThe point is not a strict local maximum (an unconverged MAP, a saddle, or a direction the data do not "
              "determine). Run fit_map to convergence (more maxiter, a tighter gtol) and pass its result as init, or "
              "use model.sample (NUTS), which needs no Gaussian shape.")
    return np.linalg.cholesky(H), float(lam[0]), lam_max


def _symmetrised_positive_definite(model, H: np.ndarray, used: str, asym: float, symmetry_tol: float,
                                   eigen_tol: float) -> tuple[np.ndarray, np.ndarray, float, float]:
    """(the symmetric part ``(H + H^T)/2`` of the (d, d) Hessian ``H``, its (d, d) lower Cholesky factor, its
    smallest and largest eigenvalues).

    Warns when the relative asymmetry ``asym`` of ``H`` (computed by the method ``used``) exceeds
    ``symmetry_tol``: the gradient is noisy at the finite-difference scale. The warning's stacklevel points at
    the caller of :func:`approximate_posterior`. Raises :class:`NotPositiveDefiniteError` as
    :func:`_check_positive_definite`.
    """
    if asym > symmetry_tol:
        warnings.warn(f"Laplace Hessian ({used}) has relative asymmetry {asym:.2e} > symmetry_tol={symmetry_tol:g}:"
                      f" the gradient is noisy at this scale; the symmetric part is used", RuntimeWarning,
                      stacklevel=3)
    H = 0.5 * (H + H.T)
    L, lam_min, lam_max = _check_positive_definite(model, H, eigen_tol)
    return H, L, lam_min, lam_max


# ------------------------------------------------------------------------------------------ driver


def _check_arguments(model, method, num_samples, seed, eigen_tol, symmetry_tol, hessian) -> None:
    """Raise ValueError for an unknown method, a bad ``num_samples``, ``seed`` or tolerance, JAX running without
    float64, or an unknown Hessian method (checked in that order, before any numerics)."""
    import jax

    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS} (pathfinder is not offered), got {method!r}")
    if isinstance(num_samples, (bool, np.bool_)) or not isinstance(num_samples, (int, np.integer)) or num_samples < 1:
        raise ValueError(f"num_samples must be an integer >= 1, got {num_samples!r}")
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    for name, v in (("eigen_tol", eigen_tol), ("symmetry_tol", symmetry_tol)):
        if not (isinstance(v, (int, float)) and 0 <= v < 1):
            raise ValueError(f"{name} must be a float in [0, 1), got {v!r}")
    if not jax.config.jax_enable_x64:
        raise ValueError("float64 is the numerical contract: call msrm.runtime.enable_x64() first")
    if hessian not in HESSIAN_METHODS:
        raise ValueError(f"hessian must be one of {HESSIAN_METHODS}, got {hessian!r}")


def _mode(model, init, seed: int, progress: bool, map_options: dict | None):
    """(u*, the MAP result or None, its log density, gradient norm at u*)."""
    map_result = None
    if init is None:
        from .map import fit_map

        options = dict(map_options or {})
        taken = sorted({"model", "seed", "progress", "init"} & set(options))
        if taken:
            raise ValueError(f"map_options: {taken} are set by approximate_posterior itself")
        map_result = fit_map(model, seed=seed, progress=progress, **options)
        u = np.asarray(map_result.u, dtype=np.float64)
    else:
        if isinstance(init, str):
            raise ValueError(f"init must be None (fit the MAP), a MAPResult, Params or an unconstrained vector; "
                             f"got {init!r}")
        if hasattr(init, "u") and not hasattr(init, "flatten"):
            map_result = init
        u = as_vector(model, init)
    if not np.isfinite(u).all():
        raise ValueError("init: the mode has non-finite entries")
    value, grad = model.value_and_grad(u)
    if not np.isfinite(value) or not np.isfinite(grad).all():
        raise ValueError(f"init: the log density or its gradient is not finite at the mode (log density {value})")
    if map_result is not None and getattr(map_result, "converged", True) is False:
        warnings.warn("Laplace approximation at a MAP fit that did not converge: the Gaussian is centred where the "
                      f"gradient is not zero (|grad| = {np.linalg.norm(grad):.3e}); fit the MAP to convergence or use "
                      "model.sample (NUTS)", RuntimeWarning, stacklevel=3)
    return u, map_result, float(value), float(np.linalg.norm(grad))


def _draws(u_mode: np.ndarray, L: np.ndarray, num_samples: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(1, S, d) draws ``u* + L^{-T} eps`` and their (1, S) Gaussian log densities ``log q``."""
    from scipy.linalg import solve_triangular

    d = u_mode.size
    eps = np.random.default_rng([seed, 11]).standard_normal((num_samples, d))
    draws = u_mode + solve_triangular(L, eps.T, lower=True, trans="T").T
    log_q = -0.5 * d * math.log(2.0 * math.pi) + np.sum(np.log(np.diag(L))) - 0.5 * np.sum(eps**2, axis=1)
    return draws[None], log_q[None]


def _log_density_draws(model, draws_u: np.ndarray) -> np.ndarray:
    """(1, S) the model's log density at every draw (one jitted function of ``model.log_density``)."""
    import jax

    f = jax.jit(model.log_density)
    return np.asarray([[float(f(u)) for u in draws_u[0]]])


def _importance_ess(lp: np.ndarray, log_q: np.ndarray) -> float:
    """``(sum w)^2 / sum w^2`` with ``w = exp(lp - log q)`` (NaN when no weight is finite)."""
    log_w = np.ravel(lp - log_q)
    log_w = log_w[np.isfinite(log_w)]
    if log_w.size == 0:
        return float("nan")
    w = np.exp(log_w - log_w.max())
    return float(w.sum() ** 2 / np.sum(w**2))


def _drawn(model, u_mode: np.ndarray, L: np.ndarray, num_samples: int, seed: int, log_density_draws: bool,
           timings: dict) -> tuple[np.ndarray, dict]:
    """(1, S, d) draws from ``N(u*, (L L^T)^{-1})`` and their sample stats: ``log_q`` (1, S), and ``lp`` (1, S)
    when ``log_density_draws``; timed as ``draws`` and ``log_density_draws``."""
    with timed_phase(timings, "draws"):
        draws_u, log_q = _draws(u_mode, L, num_samples, seed)
    stats = {"log_q": log_q}
    if log_density_draws:
        with timed_phase(timings, "log_density_draws"):
            stats["lp"] = _log_density_draws(model, draws_u)
    return draws_u, stats


def _execution_info(model) -> dict:
    """``model.execution_info()``, or :func:`msrm.runtime.execution_info` for a model without one."""
    info = model.execution_info() if hasattr(model, "execution_info") else None
    if info is None:
        from ..runtime import execution_info

        info = execution_info(include_jax=True)
    return info


def _finished_idata(model, draws_u: np.ndarray, stats: dict, physical, info: dict, sampler: dict, timings: dict,
                    t_total: float, diagnostics: bool):
    """Build the InferenceData of the (1, S, d) ``draws_u`` and (1, S) ``stats`` (booked as ``draw_conversion``),
    run the diagnostics, and write every phase and the ``total`` seconds since ``t_total`` into each group's
    ``timings`` attribute. Returns (InferenceData, diagnostics table or None)."""
    with timed_phase(timings, "draw_conversion"):
        idata = build_inference_data(model, draws_u, stats, observed=observed_group(model),
                                     attrs={"execution_info": info, "sampler": sampler}, physical=physical)
    with timed_phase(timings, "diagnostics"):
        summary = diagnostics_summary(idata) if diagnostics else None
    timings["total"] = time.perf_counter() - t_total
    for group in group_names(idata):
        idata[group].attrs["timings"] = json.dumps(timings)
    return idata, summary


def approximate_posterior(
    model,
    init: Any = None,
    method: str = "laplace",
    num_samples: int = 1000,
    seed: int = 0,
    *,
    hessian: str = "finite_difference",
    step: float | None = None,
    eigen_tol: float = 1e-12,
    symmetry_tol: float = 1e-4,
    log_density_draws: bool = True,
    diagnostics: bool = True,
    progress: bool = False,
    map_options: dict | None = None,
) -> LaplacePosterior:
    """A Gaussian approximation of the posterior of ``u`` at its mode, drawn from like :func:`sample`'s output.

    Args:
        model: a GPMSRM (or any model with ``num_params``, ``log_density``, ``value_and_grad``, ``constrain``).
        init: the mode: a MAPResult (its ``u``), Params (``model.unconstrain``) or a (num_params,) unconstrained
            vector; None runs :func:`msrm.gp.map.fit_map` first (``seed``, ``progress`` and ``map_options``).
        method: ``"laplace"`` (the only one offered).
        num_samples: S, draws in the one chain.
        seed: seeds the draws ``eps`` (NumPy) and the MAP fit.
        hessian, step: how ``H`` is computed (module docstring).
        eigen_tol: eigenvalues at or below ``eigen_tol * max eigenvalue`` refuse the approximation.
        symmetry_tol: relative asymmetry of ``H`` above which a warning says the gradient is noisy.
        log_density_draws: evaluate the model's log density at each draw (``sample_stats.lp``, importance ESS).
        diagnostics: compute :func:`msrm.diagnostics.summarize` into ``summary``.
        progress: progress bars of the MAP fit and of ``latent_posterior``/``predict``.
        map_options: keywords of ``fit_map`` for ``init=None``.
    Returns:
        :class:`LaplacePosterior`: ``inference_data`` (posterior (1, S, ...) in physical units,
        unconstrained_posterior, sample_stats ``lp``/``log_q``, observed_data), ``draws_u`` (1, S, num_params),
        ``timings``, ``execution_info``, ``mode_u``, ``hessian``.
    Raises:
        ValueError: an unknown method or hessian, a bad ``num_samples`` or ``seed``, an init of the wrong shape or
            where the density is not finite.
        NotPositiveDefiniteError: ``H`` is not positive definite (message names the parameters along the
            offending directions).
    """
    _check_arguments(model, method, num_samples, seed, eigen_tol, symmetry_tol, hessian)
    timings: dict[str, float] = {}
    t_total = time.perf_counter()
    with timed_phase(timings, "mode"):
        u_mode, map_result, lp_mode, grad_norm = _mode(model, init, int(seed), bool(progress), map_options)
    with timed_phase(timings, "hessian"):
        H, used, asym, fallback = laplace_hessian(model, u_mode, hessian, step)
        H, L, lam_min, lam_max = _symmetrised_positive_definite(model, H, used, asym, symmetry_tol, eigen_tol)
    draws_u, stats = _drawn(model, u_mode, L, int(num_samples), int(seed), log_density_draws, timings)
    with timed_phase(timings, "draw_conversion"):
        physical = physical_draws(model, draws_u)
    info = _execution_info(model)
    sampler = {
        "method": method, "num_samples": int(num_samples), "num_chains": 1, "seed": int(seed),
        "num_params": int(model.num_params), "hessian": used, "hessian_fallback": fallback,
        "hessian_asymmetry": asym,
        "eigenvalue_min": lam_min, "eigenvalue_max": lam_max, "log_density_mode": lp_mode,
        "grad_norm_mode": grad_norm,
        "importance_ess": _importance_ess(stats["lp"], stats["log_q"]) if "lp" in stats else None,
    }
    idata, summary = _finished_idata(model, draws_u, stats, physical, info, sampler, timings, t_total, diagnostics)
    return LaplacePosterior(
        inference_data=idata, timings=timings, execution_info=info, num_leapfrog=0, num_leapfrog_warmup=None,
        seconds_per_leapfrog=None, draws_u=draws_u, summary=summary, chain_method="sequential", resumed=False,
        map_result=map_result, sample_stats=stats, warmup_n_steps=None, model=model, progress=bool(progress),
        mode_u=u_mode, hessian=H, hessian_method=used,
    )
