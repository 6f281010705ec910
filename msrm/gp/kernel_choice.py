"""The kernel stage of model choice: every candidate kernel scored by the GP marginal likelihood from one shared
R-MSRM start (the rule and why it compares like with like: :mod:`msrm.select`).

It sits below :class:`msrm.GPMSRM` (which resolves ``kernel="auto"`` through :func:`resolve_auto_kernel`) and takes
the model class as an argument, so that nothing here imports the model that calls it; :func:`msrm.select` adds
the choice of K by co-smoothing on top.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np

from ..data import Dataset
from ..kernels import KERNELS, get_kernel
from ..spec import AUTO_KERNEL, ModelSpec

__all__ = ["Selection", "select_kernel", "resolve_auto_kernel", "METHODS", "SCORES", "TABLE_COLUMNS",
           "DEFAULT_KERNELS", "kernel_candidates"]

METHODS = ("rmsrm", "map")
SCORES = ("r2", "lpd")
DEFAULT_KERNELS = ("matern12", "matern32", "matern52", "matern72")
TABLE_COLUMNS = ("stage", "kernel", "n_factors", "log_likelihood", "log_density", "lengthscales", "r2", "r2_se",
                 "lpd_per_value", "lpd_per_value_se", "within_one_se", "converged", "chosen", "fit_seconds")



@dataclass(frozen=True, eq=False)
class Selection:
    """The result of :func:`select` (rules: module docstring).

    Fields:
        table: pandas DataFrame, one row per candidate, columns :data:`TABLE_COLUMNS`: ``stage`` (``"kernel"`` or
            ``"n_factors"``), ``kernel`` (None on the K rows of ``method="rmsrm"``, whose fits use no kernel),
            ``n_factors``; kernel rows: ``log_likelihood`` (the criterion L),
            ``log_density`` (``method="map"`` only), ``lengthscales`` (fitted, a tuple); K rows: ``r2``,
            ``lpd_per_value`` (co-smoothing, mean over folds), ``r2_se`` and ``lpd_per_value_se`` (standard
            errors of the paired differences from the best candidate, 0 for the best), ``within_one_se``;
            all rows: ``converged``, ``chosen``, ``fit_seconds`` (wall seconds of the candidate's fits; the
            shared R-MSRM start of the kernel stage is in ``start_seconds``).
        spec: the chosen ModelSpec.
        kernel: the chosen kernel name.
        n_factors: the chosen K.
        fold_scores: {K: (n_folds,) fold scores read by the rule} (empty without a K stage).
        method, score, folds, seed: the settings.
        start_seconds: {K: seconds of the shared R-MSRM start of each kernel stage}.
        params: {(kernel, K): the Params each kernel candidate was scored at} (a start for ``fit_map``).
    """

    table: object
    spec: ModelSpec
    kernel: str
    n_factors: int
    fold_scores: dict
    method: str
    score: str
    folds: int
    seed: int
    start_seconds: dict
    params: dict

    def __repr__(self) -> str:
        return (f"Selection(kernel={self.kernel!r}, n_factors={self.n_factors}, method={self.method!r}, "
                f"score={self.score!r}, candidates={len(self.table)})")



def kernel_candidates(kernels, spec: ModelSpec) -> tuple[str, ...]:
    """The candidate kernel names (``None``: the spec's kernel alone, which must then be a real kernel)."""
    if kernels is None:
        if spec.kernel == AUTO_KERNEL:
            raise ValueError(f"kernels=None keeps the spec's kernel, but the spec says kernel={AUTO_KERNEL!r}: give "
                             f"candidate kernels (e.g. {DEFAULT_KERNELS})")
        return (spec.kernel,)
    if isinstance(kernels, str):
        kernels = (kernels,)
    try:
        names = tuple(kernels)
    except TypeError:
        raise ValueError(f"kernels must be a sequence of kernel names, got {kernels!r}") from None
    if not names:
        raise ValueError(f"kernels must name at least one kernel of {tuple(KERNELS)}")
    for k in names:
        if not isinstance(k, str) or k not in KERNELS:
            raise ValueError(f"kernels: every candidate must be one of {tuple(KERNELS)}, got {k!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"kernels: candidates must be distinct, got {names}")
    return names


# ---------------------------------------------------------------------------------------------- kernel stage
def _shared_start(data: Dataset, spec: ModelSpec, seed: int, rmsrm_kwargs: dict):
    """The R-MSRM fit every kernel starts from (its spec's kernel only sets the lengthscale read-out)."""
    from ..rmsrm import fit_rmsrm

    kw = {"restarts": 2, "max_iter": 100, "n_jobs": 1, "progress": False, **rmsrm_kwargs, "seed": seed}
    return fit_rmsrm(data, spec, **kw)


def _start_lengthscales(rfit, from_kernel: str, to_kernel: str) -> np.ndarray:
    """Lengthscales of ``to_kernel`` with the same half-correlation distance as ``rfit``'s (read with
    ``from_kernel``): ``l_to = l_from c_from / c_to``."""
    ratio = get_kernel(from_kernel).half_distance / get_kernel(to_kernel).half_distance
    return np.asarray(rfit.params.lengthscales, dtype=np.float64) * ratio


def _inside_bounds(params, spec):
    from .map import start_inside_bounds

    return start_inside_bounds(params, spec)


def _log_likelihood(model, u: np.ndarray) -> float:
    """``log p(Y | theta(u))``: the model's log density at ``u`` less the log prior and the log-Jacobian
    (``msrm.gp.transforms``), so that no second function is compiled for it."""
    from . import transforms as tf

    value, _ = model.value_and_grad(u)
    theta, log_jac = tf.constrain(u, model.blocks)
    return float(value - tf.log_prior(theta, model.priors, model.blocks) - log_jac)


def _profile_lengthscales(model, params, maxiter: int) -> tuple[np.ndarray, bool]:
    """Maximise the marginal likelihood over the lengthscales alone, every other parameter held at ``params``.

    The model's log density in ``u`` is ``log p(Y | theta) + log prior + log Jacobian``; for the lengthscale
    block the prior plus Jacobian is ``N(u_l; loc, sd^2)`` (``msrm.gp.transforms``) and no other term depends on
    ``u_l``, so subtracting it leaves the log likelihood up to a constant.

    Returns:
        (the (num_params,) unconstrained vector at the maximum, whether L-BFGS-B reported success).
    """
    from scipy.optimize import minimize
    from scipy.stats import norm

    block = next(b for b in model.blocks if b.field == "lengthscales")
    sl = slice(block.start, block.start + block.size)
    loc, sd = model.priors.log_lengthscale_loc, model.priors.log_lengthscale_sd
    u0 = model.unconstrain(params)

    def objective(x):
        u = u0.copy()
        u[sl] = x
        value, grad = model.value_and_grad(u)
        value = value - float(np.sum(norm.logpdf(x, loc, sd)))
        g = np.asarray(grad[sl]) + (x - loc) / sd**2
        if not (np.isfinite(value) and np.isfinite(g).all()):
            return np.inf, np.zeros_like(x)
        return -value, -g

    res = minimize(objective, u0[sl], jac=True, method="L-BFGS-B", options={"maxiter": int(maxiter)})
    u = u0.copy()
    u[sl] = res.x
    return u, bool(res.success)


def select_kernel(data: Dataset, spec: ModelSpec, kernels=DEFAULT_KERNELS, *, method: str = "rmsrm", seed: int = 0,
                  model_kwargs: dict | None = None, rmsrm_kwargs: dict | None = None,
                  map_kwargs: dict | None = None, start=None, model_cls=None) -> tuple[ModelSpec, list[dict], float]:
    """The kernel stage (module docstring) at ``spec.n_factors``.

    Args:
        data, spec: the Dataset and the ModelSpec (its kernel may be ``"auto"``).
        kernels: candidate kernel names.
        method: ``"rmsrm"`` (lengthscales alone fitted at the shared R-MSRM start) or ``"map"`` (GP-MAP from it).
        seed: seeds the R-MSRM start and the MAP fits.
        model_kwargs: keywords of :class:`msrm.GPMSRM` (``linear_algebra``, ``priors``, ...).
        rmsrm_kwargs: keywords of :func:`msrm.fit_rmsrm` for the shared start (default ``restarts=2``,
            ``max_iter=100``, ``n_jobs=1``, no progress bar).
        map_kwargs: keywords of ``fit_map`` (``method="map"``; e.g. ``maxiter``), or of the lengthscale fit
            (``method="rmsrm"``: ``maxiter`` only).
        start: an R-MSRM fit of ``data`` at ``spec.n_factors`` to use as the shared start instead of fitting one.
        model_cls: the GP model class the candidates are built with (:class:`msrm.GPMSRM`).
    Returns:
        (the spec with the chosen kernel, one table row per candidate, seconds of the shared start,
        {kernel: fitted Params}).
    """
    if model_cls is None:
        raise ValueError("select_kernel: model_cls (the GP model class, msrm.GPMSRM) is required")
    GPMSRM = model_cls
    names = kernel_candidates(kernels, spec)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    model_kwargs = dict(model_kwargs or {})
    map_kwargs = dict(map_kwargs or {})
    if method == "rmsrm" and set(map_kwargs) - {"maxiter"}:
        raise ValueError(f"map_kwargs with method='rmsrm' takes only 'maxiter' (the lengthscale fit), got "
                         f"{sorted(set(map_kwargs) - {'maxiter'})}")
    read_kernel = names[0]
    t0 = time.perf_counter()
    if start is None:
        start = _shared_start(data, dataclasses.replace(spec, kernel=read_kernel), seed, dict(rmsrm_kwargs or {}))
    else:
        read_kernel = start.spec.kernel
    start_seconds = time.perf_counter() - t0
    rows, fitted = [], {}
    for name in names:
        t0 = time.perf_counter()
        spec_k = dataclasses.replace(spec, kernel=name)
        params0 = _inside_bounds(start.params.replace(lengthscales=_start_lengthscales(start, read_kernel, name)),
                                 spec_k)
        model = GPMSRM(data, spec_k, **model_kwargs)
        if method == "map":
            fit = model.fit_map(**{"init": params0, "seed": seed, "progress": False, **map_kwargs})
            u, converged, log_density = np.asarray(fit.u), bool(fit.converged), float(fit.log_density)
        else:
            u, converged = _profile_lengthscales(model, params0, map_kwargs.get("maxiter", 200))
            log_density = float("nan")
        params = model.constrain(u)
        fitted[name] = params
        rows.append({"stage": "kernel", "kernel": name, "n_factors": spec.n_factors,
                     "log_likelihood": _log_likelihood(model, u), "log_density": log_density,
                     "lengthscales": tuple(float(x) for x in np.asarray(params.lengthscales)),
                     "converged": converged, "fit_seconds": time.perf_counter() - t0})
    L = np.array([r["log_likelihood"] for r in rows])
    if not np.isfinite(L).any():
        raise FloatingPointError(f"select: no candidate kernel has a finite log likelihood ({dict(zip(names, L))})")
    best = int(np.nanargmax(L))
    for i, r in enumerate(rows):
        r["chosen"] = i == best
    return dataclasses.replace(spec, kernel=names[best]), rows, start_seconds, fitted


def resolve_auto_kernel(data: Dataset, spec: ModelSpec, model_cls, **model_kwargs) -> tuple[ModelSpec, Selection]:
    """What ``msrm.GPMSRM`` does with ``kernel="auto"``: the kernel stage with every kernel of
    :data:`DEFAULT_KERNELS`, ``method="rmsrm"`` (lengthscales fitted at one shared R-MSRM start, seed 0) and the
    model's own keywords (``linear_algebra``, ``method``, ``priors``, ...), each candidate built with
    ``model_cls``. For GP-MAP kernel fits, a choice of K or other candidates call :func:`msrm.select` and build
    the model with its ``.spec``.

    Returns:
        (the spec with the chosen kernel, the :class:`Selection`).
    """
    import pandas as pd

    chosen, rows, secs, fitted = select_kernel(data, spec, DEFAULT_KERNELS, method="rmsrm", seed=0,
                                               model_kwargs=model_kwargs, model_cls=model_cls)
    table = pd.DataFrame(rows, columns=list(TABLE_COLUMNS))
    return chosen, Selection(table=table, spec=chosen, kernel=chosen.kernel, n_factors=chosen.n_factors,
                             fold_scores={}, method="rmsrm", score="r2", folds=0, seed=0,
                             start_seconds={spec.n_factors: secs},
                             params={(k, spec.n_factors): p for k, p in fitted.items()})
