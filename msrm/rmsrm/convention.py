"""Initialisation, the scale/rotation convention and the lengthscale estimate.

Convention. J is invariant to ``Z_r -> (Z_r - 1 m^T) T, W -> W T^-T, b -> b + W m`` (objective.py), so the fit
fixes it without changing J:

- during the fit, right after each latent step, the latents are centred and whitened over the grid points inside
  the runs' spans [0, T] (``sum_r Z_r[span]^T Z_r[span] / sum_r |span_r| = I``), keeping the numbers well scaled;
- the returned fit is *canonical*: latents centred, unit variance and uncorrelated over the spans; then rotated
  so the penalty metric ``S = (1/F_tot) sum_s W_s^T Sigma_s^-1 W_s`` is diagonal with decreasing entries (factor
  1 carries the most noise-weighted signal); each factor's sign makes its largest-magnitude value in the spans
  positive. W and b are transformed to compensate, so J and every prediction are unchanged.

The pad before the run (and the grid point past T) is left out of every statistic: only the tails of lagged
responses reach it, and the pad tie (objective.py) keeps it near the run's level rather than letting it set the
scale. The lengthscale estimate uses the spans too.

Initialisation. The principal components of the large streams (F >= K; every stream if none is that large),
standardised per feature and linearly interpolated to the grid, computed once by a seeded randomised range
finder. Restart 0 starts from them with response parameters at the middle of their bounds; restart i > 0 adds
N(0, 0.5^2) noise to every grid value and draws each response parameter uniformly within its bounds.
"""
from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from ..kernels import get_kernel
from .objective import RState, penalty_metric
from .prepare import Prepared

__all__ = ["pca_init", "initial_latents", "initial_theta", "spans", "whiten", "canonical",
           "estimate_lengthscales", "INIT_NOISE"]

INIT_NOISE = 0.5


def _interp_matrix(grid: np.ndarray, times: np.ndarray) -> sp.csr_matrix:
    """(J, n) linear interpolation of a regularly sampled series at the grid points (clamped at the ends)."""
    n = times.size
    if n == 1:
        return sp.csr_matrix(np.ones((grid.size, 1)))
    u = np.clip((grid - times[0]) / (times[1] - times[0]), 0.0, n - 1.0)
    i0 = np.minimum(np.floor(u).astype(np.int64), n - 2)
    frac = u - i0
    J = grid.size
    rows = np.repeat(np.arange(J), 2)
    cols = np.stack([i0, i0 + 1], axis=1).ravel()
    vals = np.stack([1.0 - frac, frac], axis=1).ravel()
    return sp.csr_matrix((vals, (rows, cols)), shape=(J, n))


def pca_init(prep: Prepared, oversample: int = 8, power_iters: int = 3) -> tuple:
    """Leading K principal-component scores of the standardised large streams on each run's grid.

    Returns:
        tuple over runs of (J, K), whitened (``whiten``).
    """
    K = prep.n_factors
    big = [k for k in prep.keys if prep.n_features[k] >= K] or list(prep.keys)
    mean = {k: prep.sum_y[k] / prep.count[k] for k in big}
    sd = {k: np.sqrt(np.maximum(prep.sum_y2[k] / prep.count[k] - mean[k] ** 2, 1e-300)) for k in big}
    offsets = np.cumsum([0] + [prep.n_features[k] for k in big])
    col = dict(zip(big, offsets[:-1]))
    F_all = int(offsets[-1])
    blocks = []  # (run, B (J, n), key, standardised values)
    for r, run in enumerate(prep.runs):
        for st in run.streams:
            if st.key not in col:
                continue
            Ys = st.values - (mean[st.key][None, :] if st.mask is None else st.mask * mean[st.key][None, :])
            Ys = Ys / sd[st.key][None, :]
            blocks.append((r, _interp_matrix(run.grid, run.slots[st.slot].times), st.key, Ys))
    sizes = [run.grid.size for run in prep.runs]
    starts = np.cumsum([0] + sizes)
    N = int(starts[-1])
    L = min(K + oversample, F_all, N)

    def apply(Om):  # Y_grid @ Om: (N, L)
        out = np.zeros((N, Om.shape[1]))
        for r, B, key, Ys in blocks:
            c = col[key]
            out[starts[r] : starts[r + 1]] += B @ (Ys @ Om[c : c + Ys.shape[1]])
        return out

    def apply_t(Q):  # Y_grid^T @ Q: (F_all, L)
        out = np.zeros((F_all, Q.shape[1]))
        for r, B, key, Ys in blocks:
            c = col[key]
            out[c : c + Ys.shape[1]] += Ys.T @ (B.T @ Q[starts[r] : starts[r + 1]])
        return out

    rng = np.random.default_rng(0)
    Q, _ = np.linalg.qr(apply(rng.standard_normal((F_all, L))))
    for _ in range(power_iters):
        Q, _ = np.linalg.qr(apply(apply_t(Q)))
    U, s, _ = np.linalg.svd(apply_t(Q).T, full_matrices=False)
    scores = Q @ U[:, :K]
    if scores.shape[1] < K:  # fewer features than factors: pad with seeded noise
        scores = np.concatenate([scores, rng.standard_normal((N, K - scores.shape[1]))], axis=1)
    Z = tuple(scores[starts[r] : starts[r + 1]] for r in range(len(prep.runs)))
    return whiten(Z, spans(prep))[0]


def spans(prep: Prepared) -> tuple:
    """Per run, the (J,) bool mask of grid points inside the run's span [0, T]."""
    return tuple(run.observed for run in prep.runs)


def initial_latents(base: tuple, rng: np.random.Generator, restart: int) -> tuple:
    if restart == 0:
        return tuple(z.copy() for z in base)
    return tuple(z + INIT_NOISE * rng.standard_normal(z.shape) for z in base)


def initial_theta(prep: Prepared, rng: np.random.Generator, restart: int) -> dict:
    theta = {}
    for g in prep.theta_groups:
        grp = prep.groups[g]
        t = {}
        for name in grp.response.param_names:
            lo, hi = grp.response.bounds[name]
            t[name] = 0.5 * (lo + hi) if restart == 0 else float(rng.uniform(lo, hi))
        theta[grp.param_key] = t
    return theta


def whiten(Z: tuple, observed: tuple, rel_floor: float = 1e-12):
    """Centre and whiten latents over the grid points inside the runs' spans.

    Args:
        Z: per run (J_r, K).
        observed: per run (J_r,) bool, the points the statistics are taken over (:func:`spans`).

    Returns:
        (Z', m, T): ``Z'_r = (Z_r - m) T`` (every grid point transformed) with
        ``sum_r Z'_r[obs]^T Z'_r[obs] / sum_r |obs_r| = I`` and zero mean over the observed points;
        T = C^-1/2 (symmetric).

    Raises:
        FloatingPointError: the latents are (numerically) collinear, so no whitening exists.
    """
    allz = np.concatenate([z[o] for z, o in zip(Z, observed)], axis=0)
    m = allz.mean(axis=0)
    C = (allz - m).T @ (allz - m) / allz.shape[0]
    evals, evecs = np.linalg.eigh(C)
    if not np.all(np.isfinite(evals)) or evals[0] <= rel_floor * max(evals[-1], 1e-300):
        raise FloatingPointError(f"latent factors became collinear (covariance eigenvalues {evals.tolist()})")
    T = (evecs / np.sqrt(evals)) @ evecs.T
    return tuple((z - m) @ T for z in Z), m, T


def canonical(prep: Prepared, state: RState) -> RState:
    """The returned convention (module docstring); an exact reparametrisation (J unchanged)."""
    obs = spans(prep)
    Z, m, T = whiten(state.Z, obs)
    Tinv = np.linalg.inv(T)
    W = {k: state.W[k] @ Tinv.T for k in prep.keys}
    b = {k: state.b[k] + state.W[k] @ m for k in prep.keys}
    S = penalty_metric(prep, W, state.var)
    evals, Q = np.linalg.eigh(S)
    Q = Q[:, ::-1]
    Z = tuple(z @ Q for z in Z)
    allz = np.concatenate([z[o] for z, o in zip(Z, obs)], axis=0)
    signs = np.sign(allz[np.argmax(np.abs(allz), axis=0), np.arange(allz.shape[1])])
    signs[signs == 0] = 1.0
    Q = Q * signs[None, :]
    Z = tuple(z * signs[None, :] for z in Z)
    W = {k: W[k] @ Q for k in prep.keys}
    return state._replace(Z=Z, W=W, b=b)


def estimate_lengthscales(Z: tuple, latent_dt: float, kernel: str) -> np.ndarray:
    """Half-correlation estimate of each factor's kernel lengthscale (a starting value for GP fits).

    For each factor the pooled empirical autocorrelation of the (centred) latents on the grid is computed at
    lags 1, 2, ...; the first lag r where it falls to 0.5 (linearly interpolated) gives ``l = r / c`` with c
    solving ``k_nu(c) = 0.5`` for the spec's kernel. If it never falls to 0.5 within a quarter of the shortest
    run, that quarter is used as r. The roughness penalty smooths the latents, so this errs long.

    Returns:
        (K,) lengthscales in seconds.
    """
    c = get_kernel(kernel).half_distance
    allz = np.concatenate(Z, axis=0)
    m = allz.mean(axis=0)
    K = allz.shape[1]
    H = max(1, min(z.shape[0] for z in Z) // 4)
    out = np.empty(K)
    for k in range(K):
        var = sum(float(np.sum((z[:, k] - m[k]) ** 2)) for z in Z)
        prev = 1.0
        r_half = H * latent_dt
        for h in range(1, H + 1):
            num = sum(float(np.sum((z[h:, k] - m[k]) * (z[:-h, k] - m[k]))) for z in Z if z.shape[0] > h)
            rho = num / var
            if rho <= 0.5:
                r_half = latent_dt * (h - 1 + (prev - 0.5) / (prev - rho))
                break
            prev = rho
        out[k] = r_half / c
    return out
