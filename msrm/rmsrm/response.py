"""The response step: bounded L-BFGS-B over the response parameters theta, W, b, sigma fixed. Two criteria:

``"marginal"`` (the default of ``fit_rmsrm``) integrates the latents out under the Gaussian prior that the
roughness penalty and pad tie define, ``p(Z) ~ exp(-lambda/2 tr(P S))`` (objective.py). The model is linear and
Gaussian in Z, so with W, b, sigma fixed

    -log p(y | theta, lambda) = M(theta, lambda) + const,
    M = min_Z J(Z; theta, lambda) + 1/2 sum_r log det H_r(theta, lambda) - 1/2 n_prior log lambda,

H_r the Hessian of J in Z_r (latent.py) and ``n_prior = K sum_r (J_r - 1)`` the rank of the prior precision
(second differences plus the pad tie leave only the constant free; ``J_r - 2`` without a pad). This is the
restricted likelihood that selects a smoothing parameter for penalised splines, extended to the response
parameters. Minimising J jointly in Z and theta is biased for a response that blurs (a Gaussian width): a
sharper theta lets the latents take the blurred shape themselves, which the roughness penalty prefers, so the
width runs to its lower bound; the log-determinant is the Occam factor that removes this. One evaluation of M is
one latent step (banded Cholesky) per run; its gradient is ``dJ/dtheta`` and ``dJ/dlog lambda = lambda/2 tr(P S)``
at ``Z*`` (the envelope theorem: analytic) plus the gradient of the log-determinant: analytic for the banded
solver (logdet.py: one selected inverse of each H_r), central differences (one-sided at a bound) for the SuperLU
reference. All parameters are optimised together, because Z* couples them. A result that does not lower M is
discarded. ``fit.py`` takes this step once, from the converged joint fit (its docstring says why).

``"joint"`` minimises J itself with Z fixed. J is separable over response groups (a group's theta moves only the
rows of its own streams), so each group with parameters gets its own small L-BFGS-B problem (1 or 2 variables;
one per modality under shared pooling, one per stream under individual pooling), with the analytic gradient from
dA/dtheta. ``objective="reuse"`` evaluates it from the sufficient statistics of ``objective.compute_stats``
(O(n w K) per call); ``"dense"`` recomputes the full objective from explicit residuals at every call (the
reference). A result that does not lower J is discarded, so this step never increases the objective.
"""
from __future__ import annotations

import numpy as np
from scipy.optimize import minimize

from ..runtime import step_blas_limit

from .objective import (RState, Stats, objective_dense, objective_reuse, theta_value_and_grad_dense,
                        theta_value_and_grad_reuse)
from .prepare import Prepared

__all__ = ["update_response", "update_response_marginal", "marginal_criterion", "marginal_value_and_grad",
           "prior_rank",
           "RESPONSE_OBJECTIVES", "THETA_MAXITER", "MARGINAL_MAXITER", "LOGDET_STEP", "LOG_ROUGHNESS_RANGE"]

RESPONSE_OBJECTIVES = ("marginal", "joint")
THETA_MAXITER = 30
MARGINAL_MAXITER = 30
# central-difference step of the log-determinant, as a fraction of the parameter's bound interval
LOGDET_STEP = 1e-5


def update_response(prep: Prepared, state: RState, stats: Stats, J0: float, mode: str) -> tuple[dict, float, int]:
    """One L-BFGS-B solve per parametrised response group.

    Args:
        J0: the objective at ``state`` (reuse needs it to turn the group's part into the full J).
        mode: ``"reuse"`` or ``"dense"``.

    Returns:
        (theta, J, n_evaluations): new theta dict, the objective there, objective evaluations used.
    """
    theta = {k: dict(v) for k, v in state.theta.items()}
    J = J0
    n_eval = 0
    for g in prep.theta_groups:
        grp = prep.groups[g]
        names = grp.response.param_names
        bounds = [grp.response.bounds[n] for n in names]
        current = state._replace(theta=theta)
        x0 = np.array([theta[grp.param_key][n] for n in names])

        if mode == "reuse":
            f0, _ = theta_value_and_grad_reuse(prep, current, stats, g, theta[grp.param_key])
            rest = J - f0

            def fun(v, g=g, names=names, current=current, rest=rest):
                f, grad = theta_value_and_grad_reuse(prep, current, stats, g, dict(zip(names, v)))
                return rest + f, grad
        else:

            def fun(v, g=g, names=names, current=current):
                return theta_value_and_grad_dense(prep, current, g, dict(zip(names, v)))

        res = minimize(fun, x0, jac=True, method="L-BFGS-B", bounds=bounds,
                       options={"maxiter": THETA_MAXITER})
        n_eval += int(res.nfev)
        if np.isfinite(res.fun) and res.fun < J:
            # clip: L-BFGS-B keeps iterates in the box, but guard against round-off at the bounds
            theta[grp.param_key] = {n: float(np.clip(v, lo, hi)) for n, v, (lo, hi) in zip(names, res.x, bounds)}
            J = float(res.fun)
    return theta, J, n_eval


def _theta_layout(prep: Prepared):
    """[(group index, param key, name, (lo, hi))] over the parameterised groups, in order."""
    out = []
    for g in prep.theta_groups:
        grp = prep.groups[g]
        for name in grp.response.param_names:
            out.append((g, grp.param_key, name, grp.response.bounds[name]))
    return out


def _unpack(layout, theta: dict, x: np.ndarray) -> dict:
    new = {k: dict(v) for k, v in theta.items()}
    for (_, pk, name, (lo, hi)), v in zip(layout, x):
        new[pk][name] = float(np.clip(v, lo, hi))
    return new


def prior_rank(prep: Prepared) -> int:
    """n_prior: the rank of the roughness prior's precision over all runs (module docstring): second differences
    leave constants and linear trends free, the pad tie (where a run has a pad) ties the trend."""
    total = 0
    for run in prep.runs:
        free = 1 if prep.pad_tie > 0 and (~run.observed).any() else 2
        total += run.grid.size - free
    return int(total * prep.n_factors)


def marginal_criterion(prep: Prepared, state: RState, stats: Stats, theta: dict, roughness: float | None = None,
                       mode: str = "reuse", solver: str = "banded", diagnostics: list | None = None):
    """M(theta, lambda) (module docstring) at W, b, sigma of ``state`` (``stats`` theirs); lambda defaults to
    ``prep.roughness``.

    Returns:
        (M, J at Z*, Z* (tuple over runs), sum_r log det H_r).
    """
    from .latent import solve_latents_logdet

    lam = prep.roughness if roughness is None else float(roughness)
    p = prep if roughness is None else prep._replace(roughness=lam)
    st = state._replace(theta=theta)
    Z, logdet = solve_latents_logdet(p, st, stats, solver, diagnostics)
    st = st._replace(Z=Z)
    J = objective_reuse(p, st, stats) if mode == "reuse" else objective_dense(p, st)
    return J + 0.5 * logdet - 0.5 * prior_rank(prep) * np.log(lam), J, Z, logdet


# log lambda may move this far (natural log) from its starting value in the marginal step
LOG_ROUGHNESS_RANGE = float(np.log(1e4))


def marginal_value_and_grad(prep: Prepared, state: RState, stats: Stats, x: np.ndarray, roughness: bool = True,
                            mode: str = "reuse", solver: str = "banded", diagnostics: list | None = None):
    """M and its gradient at ``x`` = the response parameters in ``_theta_layout`` order, then log lambda when
    ``roughness`` (module docstring: analytic envelope terms; the log-determinant's gradient analytic for
    ``solver="banded"``, central differences for ``"superlu"``).

    Returns:
        (M, gradient (x.size,), latent factorizations used per run: 2 for the banded solver (the criterion and
        the selected inverse), else 1 + 2 x.size).
    """
    from .latent import solve_latents_logdet
    from .logdet import logdet_gradient
    from .objective import roughness_gram

    layout = _theta_layout(prep)
    bounds = _marginal_bounds(prep, layout, roughness)
    n_theta = len(layout)

    def split(v):
        return _unpack(layout, state.theta, v[:n_theta]), (float(np.exp(v[n_theta])) if roughness
                                                            else float(prep.roughness))

    theta, lam = split(x)
    M, _, Z, _ = marginal_criterion(prep, state, stats, theta, lam, mode, solver, diagnostics)
    p = prep._replace(roughness=lam)
    st = state._replace(theta=theta, Z=Z)
    grad = np.zeros(x.size)
    for g in prep.theta_groups:
        idx = [i for i, item in enumerate(layout) if item[0] == g]
        pk = layout[idx[0]][1]
        if mode == "reuse":
            _, gJ = theta_value_and_grad_reuse(p, st, stats, g, theta[pk])
        else:
            _, gJ = theta_value_and_grad_dense(p, st, g, theta[pk])
        grad[idx] += gJ
    if roughness:
        grad[n_theta] = 0.5 * lam * float(np.sum(roughness_gram(p, Z) * stats.S)) - 0.5 * prior_rank(prep)
    if solver == "banded":
        grad += logdet_gradient(p, st, stats, layout, roughness)
        return M, grad, 2
    for i, (lo, hi) in enumerate(bounds):
        h = LOGDET_STEP * (hi - lo)
        up, down = min(x[i] + h, hi), max(x[i] - h, lo)
        lds = []
        for v in (up, down):
            xv = x.copy()
            xv[i] = v
            th, lm = split(xv)
            lds.append(solve_latents_logdet(prep._replace(roughness=lm), state._replace(theta=th), stats, solver,
                                            diagnostics)[1])
        grad[i] += 0.5 * (lds[0] - lds[1]) / (up - down)
    return M, grad, 1 + 2 * len(bounds)


def _marginal_bounds(prep: Prepared, layout, roughness: bool) -> list:
    """Box of the marginal step: the response bounds, then log lambda within LOG_ROUGHNESS_RANGE of its value."""
    out = [b for *_, b in layout]
    if roughness:
        c = float(np.log(prep.roughness))
        out.append((c - LOG_ROUGHNESS_RANGE, c + LOG_ROUGHNESS_RANGE))
    return out


def update_response_marginal(prep: Prepared, state: RState, stats: Stats, mode: str = "reuse",
                             solver: str = "banded", diagnostics: list | None = None,
                             roughness: bool = True) -> tuple[dict, float, float, int]:
    """One L-BFGS-B solve of M over every response parameter and, if ``roughness``, log lambda (module docstring).

    Returns:
        (theta, lambda, M at them, latent factorizations used per run).
    """
    layout = _theta_layout(prep)
    lam0 = float(prep.roughness)
    n_theta = len(layout)
    x0 = np.array([state.theta[pk][name] for _, pk, name, _ in layout] + ([np.log(lam0)] if roughness else []))
    if x0.size == 0:
        return {k: dict(v) for k, v in state.theta.items()}, lam0, float("nan"), 0
    bounds = _marginal_bounds(prep, layout, roughness)
    count = [0]

    def fun(x):
        M, grad, n = marginal_value_and_grad(prep, state, stats, x, roughness, mode, solver, diagnostics)
        count[0] += n
        return M, grad

    # the step is latent solves, many times over: their thread count for the whole of it (one threadpoolctl call)
    with step_blas_limit("banded"):
        M0 = marginal_criterion(prep, state, stats, state.theta, lam0, mode, solver, diagnostics)[0]
        count[0] += 1
        res = minimize(fun, x0, jac=True, method="L-BFGS-B", bounds=bounds, options={"maxiter": MARGINAL_MAXITER})
    if np.isfinite(res.fun) and res.fun < M0:
        theta = _unpack(layout, state.theta, res.x[:n_theta])
        lam = float(np.exp(res.x[n_theta])) if roughness else lam0
        return theta, lam, float(res.fun), count[0]
    return {k: dict(v) for k, v in state.theta.items()}, lam0, float(M0), count[0]
