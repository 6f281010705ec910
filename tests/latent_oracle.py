r"""Brute-force oracle of the GP-MSRM latent posterior and posterior predictive (NumPy/SciPy, tiny data only).

For one run with grid ``tau`` (J,) and K factors, stack the latent values as ``z = vec Z`` in **grid-major
order**: ``z[j * K + k] = Z[j, k]`` (the row-major flattening of the (J, K) array). The prior is

.. math::

    \mathrm{Cov}(z_{jk}, z_{j'k'}) = \delta_{kk'}\, K_k[j, j'], \qquad K_k[j, j'] = k(|\tau_j - \tau_{j'}|; \ell_k),

with ``k`` the kernel's own correlation (:meth:`msrm.kernels.Kernel.correlation`). Every observed value
``o = (stream s, sample i, feature f)`` is ``y_o = b_{sf} + h_o^T z + eps_o``, ``eps_o ~ N(0, sigma_{sf}^2)``,
with ``h_o[j * K + k] = W_{sfk} a_{si}[j]`` and ``a_si`` the canonical dense response row of the sample
(:func:`msrm.operators.response_weights` over the whole grid). With ``H`` the (n_obs, J K) matrix of those rows,
``P`` the prior covariance and ``D`` the noise variances, (z, y) is jointly Gaussian and

.. math::

    S = H P H^\top + D, \qquad E[z \mid y] = P H^\top S^{-1} (y - b), \qquad
    \mathrm{Cov}[z \mid y] = P - P H^\top S^{-1} H P.

The predictive of any (stream, sample, feature), observed or missing, is ``y | Y ~ N(b + h^T E[z|y],
h^T Cov[z|y] h + sigma^2)``; the signal sd is the same without ``sigma^2``. ``log N(y; b, S)`` is the run's
marginal density (tests check it against :func:`msrm.gp.reference.brute_force_loglik`).

Every matrix here is dense, O(n_obs^3 + (J K)^3): for tests on tiny data. Nothing is shared with the fast paths
except the definitions (the kernel's correlation, the canonical response rows, the data model).
"""
from __future__ import annotations

import numpy as np
from scipy.linalg import cho_factor, cho_solve
from scipy.stats import multivariate_normal

from msrm.kernels import get_kernel
from msrm.nodes import response_groups
from msrm.operators import response_weights
from msrm.spec import latent_grid

__all__ = ["prior_covariance", "stream_rows", "run_joint", "brute_latent_posterior", "brute_predict",
           "brute_marginal_loglik"]


def prior_covariance(grid: np.ndarray, lengthscales, kernel: str) -> np.ndarray:
    """Prior covariance (J K, J K) of ``vec Z`` in grid-major order (``index = j * K + k``)."""
    grid = np.asarray(grid, dtype=np.float64)
    ell = np.asarray(lengthscales, dtype=np.float64)
    K = ell.size
    J = grid.size
    r = np.abs(grid[:, None] - grid[None, :])
    kern = get_kernel(kernel)
    P = np.zeros((J, K, J, K))
    for k in range(K):
        P[:, k, :, k] = kern.correlation(r, float(ell[k]), np)
    return P.reshape(J * K, J * K)


def stream_rows(stream, group, params, grid: np.ndarray) -> np.ndarray:
    """Response rows (n_samples, J) of every sample of one stream (canonical dense definition)."""
    theta = {} if group.param_key is None else params.response[group.param_key]
    return response_weights(stream.times, group.response, theta, grid)


def _group_of(run, groups):
    by_key = {g.key: g for g in groups}
    return {s.key: by_key.get(s.key, by_key.get(s.modality)) for s in run.streams}


def run_joint(run, spec, params, groups):
    """The joint Gaussian pieces of one run.

    Returns:
        dict with ``grid`` (J,), ``P`` (J K, J K) prior covariance of vec Z, ``H`` (n_obs, J K) observation rows,
        ``y`` (n_obs,) observed values, ``b`` (n_obs,) their intercepts, ``noise_var`` (n_obs,), ``rows``
        {stream key: (n_s, J) response rows of every sample}.
    """
    grid = latent_grid(run.duration, spec)
    J, K = grid.size, spec.n_factors
    P = prior_covariance(grid, params.lengthscales, spec.kernel)
    group_of = _group_of(run, groups)
    H, y, b, nv, rows = [], [], [], [], {}
    for s in run.streams:
        A = stream_rows(s, group_of[s.key], params, grid)
        rows[s.key] = A
        W = np.asarray(params.loadings[s.key], dtype=np.float64)
        i_idx, f_idx = np.nonzero(s.mask)
        # h_o[j, k] = W[f, k] a_i[j]
        H.append((A[i_idx][:, :, None] * W[f_idx][:, None, :]).reshape(i_idx.size, J * K))
        y.append(s.values[i_idx, f_idx])
        b.append(np.asarray(params.intercepts[s.key], dtype=np.float64)[f_idx])
        nv.append(np.asarray(params.noise_sd[s.key], dtype=np.float64)[f_idx] ** 2)
    return {"grid": grid, "P": P, "H": np.concatenate(H), "y": np.concatenate(y), "b": np.concatenate(b),
            "noise_var": np.concatenate(nv), "rows": rows}


def _conditional(joint):
    """Posterior mean (J K,) and covariance (J K, J K) of vec Z given the observed values."""
    P, H = joint["P"], joint["H"]
    S = H @ P @ H.T + np.diag(joint["noise_var"])
    cf = cho_factor(S, lower=True)
    PHt = P @ H.T
    mean = PHt @ cho_solve(cf, joint["y"] - joint["b"])
    cov = P - PHt @ cho_solve(cf, PHt.T)
    return mean, 0.5 * (cov + cov.T)


def brute_latent_posterior(data, spec, params) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per run ``(grid (J,), mean (J, K), cov (J K, J K))``; ``cov`` in grid-major order (``j * K + k``), so the
    K x K block of grid point j is ``cov[j*K:(j+1)*K, j*K:(j+1)*K]`` and the marginal sd of ``Z[j, k]`` is
    ``sqrt(cov[j*K + k, j*K + k])``."""
    params.validate(data, spec)
    groups = response_groups(data, spec)
    out = []
    for run in data.runs:
        joint = run_joint(run, spec, params, groups)
        mean, cov = _conditional(joint)
        out.append((joint["grid"], mean.reshape(joint["grid"].size, spec.n_factors), cov))
    return out


def brute_predict(data, spec, params) -> list[dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]]:
    """Per run ``{stream key: (mean, predictive sd, signal sd)}``, each (n_samples, n_features), for every
    (sample, feature) of the stream, observed or missing."""
    params.validate(data, spec)
    groups = response_groups(data, spec)
    K = spec.n_factors
    out = []
    for run in data.runs:
        joint = run_joint(run, spec, params, groups)
        mean, cov = _conditional(joint)
        J = joint["grid"].size
        per = {}
        for s in run.streams:
            A = joint["rows"][s.key]  # (n_s, J)
            W = np.asarray(params.loadings[s.key], dtype=np.float64)  # (F, K)
            # h_{i f}[j, k] = W[f, k] A[i, j]: every (sample, feature) row, flattened (n_s * F, J K)
            Hs = (A[:, None, :, None] * W[None, :, None, :]).reshape(-1, J * K)
            m = np.asarray(params.intercepts[s.key], dtype=np.float64)[None, :] + (Hs @ mean).reshape(A.shape[0], -1)
            sig_var = np.einsum("ox,xy,oy->o", Hs, cov, Hs).reshape(A.shape[0], -1)
            noise = np.asarray(params.noise_sd[s.key], dtype=np.float64)[None, :] ** 2
            per[s.key] = (m, np.sqrt(sig_var + noise), np.sqrt(np.maximum(sig_var, 0.0)))
        out.append(per)
    return out


def brute_marginal_loglik(data, spec, params) -> float:
    """``sum over runs of log N(y; b, H P H^T + D)``: the oracle's own marginal density of the observed values."""
    params.validate(data, spec)
    groups = response_groups(data, spec)
    total = 0.0
    for run in data.runs:
        j = run_joint(run, spec, params, groups)
        S = j["H"] @ j["P"] @ j["H"].T + np.diag(j["noise_var"])
        total += float(multivariate_normal.logpdf(j["y"], mean=j["b"], cov=S))
    return total
