"""Loadings, intercepts and noise: closed-form steps for fixed Z and theta.

Loadings + intercepts. With ``X~ = [x_i^T, 1]`` (n, K + 1) and ``beta_f = [w_f; b_f]``, J restricted to one
feature f is ``1/(2 sigma_f^2) [sum_i m_if (y_if - X~_i beta_f)^2 + (lambda/F_tot) w_f^T P w_f] + const``
(P = sum_r Z_r^T D2^T D2 Z_r), so sigma_f cancels and

    (sum_i m_if X~_i^T X~_i + (lambda/F_tot) [[P, 0], [0, 0]]) beta_f = sum_i m_if X~_i^T y_if.

A stream observed everywhere shares the (K+1) x (K+1) matrix across features: one Cholesky, all F right-hand
sides at once. With missing values the per-feature matrices are built with one GEMM (mask^T times the products
of X~ columns) and solved batched.

Noise. ``sigma_f^2 = (q_f + (lambda/F_tot) w_f^T P w_f) / n_f`` where q_f is the residual sum of squares, the
exact minimiser of J over sigma_f, floored at 1e-12 times the feature's mean square.
"""
from __future__ import annotations

import numpy as np
import scipy.linalg as sla

from ..runtime import step_blas_limit
from .objective import RState, roughness_gram
from .prepare import Prepared

__all__ = ["update_loadings", "residual_sum_squares", "update_noise", "dense_flops", "VAR_FLOOR"]

VAR_FLOOR = 1e-12


def _design(x: np.ndarray) -> np.ndarray:
    return np.concatenate([x, np.ones((x.shape[0], 1))], axis=1)


def dense_flops(prep: Prepared) -> float:
    """Flops of the largest dense product of a fit's steps: ``X~^T Y`` of the largest stream of a run,
    2 (K + 1) n F (the size ``msrm.runtime.step_blas_threads("dense", ...)`` chooses the BLAS threads by)."""
    sizes = [st.values.size for run in prep.runs for st in run.streams]
    return 2.0 * (prep.n_factors + 1) * float(max(sizes, default=0))


def update_loadings(prep: Prepared, state: RState, latents) -> tuple[dict, dict, dict]:
    """Solve for W and b of every stream, BLAS on ``msrm.runtime.step_blas_threads("dense", dense_flops(prep))``
    threads.

    Args:
        latents: per run, per slot (n, K) latent values (``objective.slot_latents``).

    Returns:
        (W, b, q): key -> (F, K), (F,), and the residual sums of squares (F,) at the solution, computed from the
        normal equations (q = sum m y^2 - 2 beta^T r + beta^T C beta), no n x F residual formed.
    """
    with step_blas_limit("dense", dense_flops(prep)):
        return _update_loadings(prep, state, latents)


def _update_loadings(prep: Prepared, state: RState, latents) -> tuple[dict, dict, dict]:
    K = prep.n_factors
    pen = np.zeros((K + 1, K + 1))
    pen[:K, :K] = prep.roughness / prep.n_total_features * roughness_gram(prep, state.Z)
    C_common = {k: np.zeros((K + 1, K + 1)) for k in prep.keys}
    C_feat = {k: np.zeros((prep.n_features[k], (K + 1) ** 2)) for k in prep.keys if prep.any_missing[k]}
    rhs = {k: np.zeros((K + 1, prep.n_features[k])) for k in prep.keys}
    for r, run in enumerate(prep.runs):
        for st in run.streams:
            Xt = _design(latents[r][st.slot])
            rhs[st.key] += Xt.T @ st.values
            if st.mask is None:
                C_common[st.key] += Xt.T @ Xt
            else:
                outer = (Xt[:, :, None] * Xt[:, None, :]).reshape(Xt.shape[0], -1)
                C_feat[st.key] += st.mask.T @ outer
    W, b, q = {}, {}, {}
    for k in prep.keys:
        F = prep.n_features[k]
        if k in C_feat:
            C = C_feat[k].reshape(F, K + 1, K + 1) + C_common[k][None]
            beta = np.linalg.solve(C + pen[None], rhs[k].T[:, :, None])[:, :, 0].T  # (K+1, F)
            Cb = np.einsum("fkl,lf->kf", C, beta)
        else:
            C = C_common[k]
            beta = sla.cho_solve(sla.cho_factor(C + pen), rhs[k], check_finite=False)
            Cb = C @ beta
        W[k] = np.ascontiguousarray(beta[:K].T)
        b[k] = beta[K].copy()
        q[k] = np.maximum(prep.sum_y2[k] - 2.0 * np.sum(beta * rhs[k], axis=0) + np.sum(beta * Cb, axis=0), 0.0)
    return W, b, q


def residual_sum_squares(prep: Prepared, state: RState, latents) -> dict:
    """q_f = sum_i m_if (y_if - b_f - w_f^T x_i)^2 from the explicit residual (the dense reference)."""
    q = {k: np.zeros(prep.n_features[k]) for k in prep.keys}
    for r, run in enumerate(prep.runs):
        for st in run.streams:
            R = st.values - state.b[st.key][None, :] - latents[r][st.slot] @ state.W[st.key].T
            if st.mask is not None:
                R *= st.mask
            q[st.key] += np.sum(R * R, axis=0)
    return q


def update_noise(prep: Prepared, state: RState, q: dict) -> dict:
    """sigma_f^2 = (q_f + (lambda / F_tot) w_f^T P w_f) / n_f, floored."""
    P = roughness_gram(prep, state.Z)
    scale = prep.roughness / prep.n_total_features
    var = {}
    for k in prep.keys:
        pen = scale * np.einsum("fk,kl,fl->f", state.W[k], P, state.W[k])
        floor = VAR_FLOOR * prep.sum_y2[k] / prep.count[k]
        var[k] = np.maximum((q[k] + pen) / prep.count[k], np.maximum(floor, 1e-300))
    return var
