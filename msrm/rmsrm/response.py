"""The response step: bounded L-BFGS-B over theta of each response group, Z, W, b, sigma fixed.

J is separable over response groups (a group's theta moves only the rows of its own streams), so each group with
parameters gets its own small L-BFGS-B problem (1 or 2 variables; one per modality under shared pooling, one per
stream under individual pooling), with the analytic gradient from dA/dtheta. ``objective="reuse"`` evaluates it
from the sufficient statistics of ``objective.compute_stats`` (O(n w K) per call); ``"dense"`` recomputes the full
objective from explicit residuals at every call (the reference). A result that does not lower J is discarded, so
the step never increases the objective.
"""
from __future__ import annotations

import numpy as np
from scipy.optimize import minimize

from .objective import (RState, Stats, theta_value_and_grad_dense, theta_value_and_grad_reuse)
from .prepare import Prepared

__all__ = ["update_response", "THETA_MAXITER"]

THETA_MAXITER = 30


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
