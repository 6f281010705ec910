r"""Brute-force GP-MSRM density: the full covariance of every observed scalar, then SciPy.

For one run, list every observed value ``y_o`` (stream ``s``, sample ``i``, feature ``f``). With ``a_si`` the
canonical dense response row (:func:`msrm.operators.response_weights`) and ``K_k`` the Matérn matrices,

.. math::

    \mathrm{Cov}(y_o, y_{o'}) = \sum_k W_{s f k} W_{s' f' k}\, a_{si}^\top K_k a_{s'i'} + \delta_{oo'} \sigma_{sf}^2,

and ``log p(y) = sum over runs of log N(y; b, Cov)`` from a Cholesky factor of ``Cov`` (:func:`gaussian_logpdf`).
NumPy/SciPy only and O(n_obs^3): for tiny datasets in tests. It shares no code with the fast paths except the definitions (the
kernel's correlation, the canonical response rows) and the data model.
"""
from __future__ import annotations

import numpy as np
from scipy.linalg import cho_factor, solve_triangular

from ..data import Dataset
from ..kernels import get_kernel
from ..nodes import response_groups
from ..operators import response_weights
from ..params import Params
from ..spec import ModelSpec, latent_grid

__all__ = ["matern_numpy", "run_covariance", "gaussian_logpdf", "brute_force_loglik"]


def matern_numpy(r: np.ndarray, lengthscale: float, kernel: str) -> np.ndarray:
    """Unit-variance kernel correlation in NumPy, ``k(|r|; l)`` (the kernel class's own definition)."""
    return get_kernel(kernel).correlation(np.abs(np.asarray(r, dtype=np.float64)), float(lengthscale), np)


def run_covariance(run, spec: ModelSpec, params: Params, groups) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Observed values, their means and their full covariance for one run.

    Returns:
        y (n_obs,), mean (n_obs,), cov (n_obs, n_obs).
    """
    grid = latent_grid(run.duration, spec)
    by_key = {g.key: g for g in groups}
    group_of = {s.key: by_key.get(s.key, by_key.get(s.modality)) for s in run.streams}
    rows, ys, means, sds, loads = [], [], [], [], []
    for s in run.streams:
        g = group_of[s.key]
        theta = {} if g.param_key is None else params.response[g.param_key]
        A = response_weights(s.times, g.response, theta, grid)  # (n_s, J)
        i_idx, f_idx = np.nonzero(s.mask)
        rows.append(A[i_idx])
        ys.append(s.values[i_idx, f_idx])
        means.append(params.intercepts[s.key][f_idx])
        sds.append(params.noise_sd[s.key][f_idx])
        loads.append(params.loadings[s.key][f_idx])
    A = np.concatenate(rows)  # (n_obs, J)
    Wo = np.concatenate(loads)  # (n_obs, K)
    r = grid[:, None] - grid[None, :]
    cov = np.zeros((A.shape[0], A.shape[0]))
    for k, ell in enumerate(params.lengthscales):
        Xk = A @ matern_numpy(r, float(ell), spec.kernel) @ A.T
        cov += np.outer(Wo[:, k], Wo[:, k]) * Xk
    cov[np.diag_indices_from(cov)] += np.concatenate(sds) ** 2
    return np.concatenate(ys), np.concatenate(means), cov


def gaussian_logpdf(y: np.ndarray, mean: np.ndarray, cov: np.ndarray) -> float:
    """``log N(y; mean, cov)`` from the Cholesky factor of ``cov`` (``cov = L Lᵀ``):
    ``-½ (n log 2π + 2 Σ log L_ii + |L⁻¹(y − mean)|²)``.

    A Cholesky factor exists for every covariance that is positive definite in float64, however ill-conditioned
    (a smooth prior observed with little noise: condition ``10¹⁰`` and more), and its rounding is that of the
    covariance itself; an eigenvalue test of definiteness (what ``scipy.stats.multivariate_normal`` applies) calls
    such a covariance singular. Raises ValueError naming the cause when the factorization fails."""
    try:
        L, _ = cho_factor(cov, lower=True, check_finite=True)
    except np.linalg.LinAlgError as err:
        scale = float(np.max(np.abs(np.diag(cov))))
        raise ValueError(
            f"brute-force density: the observation covariance ({cov.shape[0]} values) is not positive definite in "
            f"float64 ({err}): its entries, up to {scale:.3g}, are rounded by about {2.2e-16 * scale:.1e}, more than "
            "the noise variance adds along the prior's near-singular directions (a lengthscale far longer than the "
            "grid step observed with very little noise); use noise sds further from zero, a shorter lengthscale or "
            "a coarser latent_dt") from None
    n = y.size
    u = solve_triangular(L, y - mean, lower=True)
    return float(-0.5 * (n * np.log(2.0 * np.pi) + 2.0 * np.sum(np.log(np.diag(L))) + u @ u))


def brute_force_loglik(data: Dataset, spec: ModelSpec, params: Params) -> float:
    """``log p(Y | params)`` by the full observation covariance (:func:`gaussian_logpdf`), summed over runs."""
    params.validate(data, spec)
    groups = response_groups(data, spec)
    total = 0.0
    for run in data.runs:
        y, mean, cov = run_covariance(run, spec, params, groups)
        total += gaussian_logpdf(y, mean, cov)
    return total
