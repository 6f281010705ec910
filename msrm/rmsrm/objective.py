"""The R-MSRM objective, two ways: from per-stream sufficient statistics (``reuse``) and from the explicit
residual (``dense``, the reference).

Objective (summed over runs r, streams s, observed (i, f)):

    J = 1/2 sum_obs [ (y - b_f - w_f^T x_i)^2 / sigma_f^2 + log sigma_f^2 ] + lambda/2 tr(P S),
    P = sum_r [ Z_r^T D2^T D2 Z_r + rho sum_{j in pad_r} (z_rj - m_r)(z_rj - m_r)^T ]

with ``x_i = A_s(theta) Z_r`` (rows of the response operator), D2 the second-difference matrix on the grid and
``S = (1/F_tot) sum_s W_s^T Sigma_s^-1 W_s`` the noise-weighted loading Gram averaged over all F_tot features.

The second term of P is the *pad tie*: ``pad_r`` are the grid points outside the run's span [0, T] and m_r the
mean of Z_r over the points inside it. Second differences do not see a linear trend, so without the tie the
latents extrapolate the run's edge linearly into the pad, where only the tails of lagged responses reach; the tie
(weight ``rho = prepare.pad_tie_weight``) makes the pad decay to the run's level instead, like a stationary
prior would. In matrix form the tie is ``rho Z_r^T T_r Z_r`` with
``T_r = diag(u) - u o^T - o u^T + |pad_r| o o^T`` (u the pad indicator, o the span indicator / |span|): a
diagonal plus a rank-2 term (latent.py solves it by Woodbury).

Under the convention S = I the penalty is lambda/2 sum_k P_kk; written with S it is invariant to
``Z -> Z T, W -> W T^-T`` (any invertible T) and to ``Z -> Z + 1 m^T, b -> b - W m`` (rows of A sum to one, D2
kills constants, the tie is relative to the span's mean), so the convention of ``convention.py`` is an exact
reparametrisation of the whole objective.

Sufficient statistics per stream (W, b, sigma fixed; ``y0 = y - b``, zero where missing, m = mask):

    G_s = (m * y0) (W / sigma^2)                   (n, K)
    M_s,i = sum_f m_if w_f w_f^T / sigma_f^2       (n, K, K)  (one K x K matrix when the stream is complete)
    c_s = sum_obs y0^2 / sigma^2                   (from per-feature sums of y and y^2: O(F), not O(n F))

so the data term is ``1/2 [sum_s c_s - 2 sum_i x_i^T g_i + sum_i x_i^T M_i x_i + sum_f n_f log sigma_f^2]``;
per slot (streams sharing response and sample times) G and M are summed before they meet x.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..operators import response_weights_and_derivs_csr, response_weights_csr, window_weights
from .prepare import Prepared

__all__ = [
    "RState",
    "Stats",
    "compute_stats",
    "slot_weights",
    "gather",
    "slot_latents",
    "roughness_gram",
    "penalty_metric",
    "objective_reuse",
    "objective_dense",
    "theta_value_and_grad_reuse",
    "theta_value_and_grad_dense",
]


class RState(NamedTuple):
    """Parameters of one fit in progress.

    Fields:
        Z: per run (J, K) latents.
        W: key -> (F, K) loadings.
        b: key -> (F,) intercepts.
        var: key -> (F,) noise variances sigma^2.
        theta: response param key -> {name: value}.
    """

    Z: tuple
    W: dict
    b: dict
    var: dict
    theta: dict


class Stats(NamedTuple):
    """Sufficient statistics of (W, b, sigma) for the latent and response steps.

    Fields:
        M: per run, per slot: (n, K, K) summed over the slot's streams.
        G: per run, per slot: (n, K) summed over the slot's streams.
        c: sum over streams of c_s.
        logdet: sum over features of n_f log sigma_f^2.
        S: (K, K) penalty metric.
    """

    M: tuple
    G: tuple
    c: float
    logdet: float
    S: np.ndarray


def group_theta(prep: Prepared, state: RState, g: int) -> dict:
    """Response parameters of group g ({} for a response without parameters)."""
    pk = prep.groups[g].param_key
    return {} if pk is None else state.theta[pk]


def slot_weights(prep: Prepared, slot, theta: dict, derivs: bool = False):
    """Window weights (n, w) of a slot (and their derivatives {name: (n, w)} when ``derivs``)."""
    return window_weights(prep.groups[slot.group].response, theta, slot.layout, derivs=derivs)


def gather(a: np.ndarray, layout, Z: np.ndarray) -> np.ndarray:
    """x_i = sum_p a_ip Z[start_i + p]: (n, w) weights, (J, K) latents -> (n, K)."""
    idx = layout.start[:, None] + np.arange(layout.width)[None, :]
    return np.einsum("nw,nwk->nk", a, Z[idx])


def slot_latents(prep: Prepared, state: RState) -> list[list[np.ndarray]]:
    """Per run, per slot: (n, K) latent values seen by the slot's streams."""
    out = []
    for r, run in enumerate(prep.runs):
        out.append([gather(slot_weights(prep, sl, group_theta(prep, state, sl.group)), sl.layout, state.Z[r])
                    for sl in run.slots])
    return out


def roughness_gram(prep: Prepared, Z) -> np.ndarray:
    """P = sum_r (D2 Z_r)^T (D2 Z_r) + rho (Z_r - m_r)_pad^T (Z_r - m_r)_pad: (K, K) (module docstring)."""
    K = prep.n_factors
    P = np.zeros((K, K))
    for run, Zr in zip(prep.runs, Z):
        d2 = Zr[2:] - 2.0 * Zr[1:-1] + Zr[:-2]
        P += d2.T @ d2
        if prep.pad_tie > 0:
            pad = Zr[~run.observed] - Zr[run.observed].mean(axis=0)
            P += prep.pad_tie * (pad.T @ pad)
    return P


def penalty_metric(prep: Prepared, W: dict, var: dict) -> np.ndarray:
    """S = (1/F_tot) sum_s W_s^T Sigma_s^-1 W_s: (K, K)."""
    K = prep.n_factors
    S = np.zeros((K, K))
    for k in prep.keys:
        S += W[k].T @ (W[k] / var[k][:, None])
    return S / prep.n_total_features


def compute_stats(prep: Prepared, state: RState) -> Stats:
    """Per-slot sufficient statistics (one GEMM per stream and run: O(n F K))."""
    K = prep.n_factors
    Wt = {k: state.W[k] / state.var[k][:, None] for k in prep.keys}
    Mfull = {k: state.W[k].T @ Wt[k] for k in prep.keys}
    c = 0.0
    logdet = 0.0
    for k in prep.keys:
        b, inv = state.b[k], 1.0 / state.var[k]
        c += float(np.sum((prep.sum_y2[k] - 2.0 * b * prep.sum_y[k] + prep.count[k] * b * b) * inv))
        logdet += float(np.sum(prep.count[k] * np.log(state.var[k])))
    Ms, Gs = [], []
    for run in prep.runs:
        M_run, G_run = [], []
        for sl in run.slots:
            n = sl.times.size
            M = np.zeros((n, K, K))
            G = np.zeros((n, K))
            for s_i in sl.streams:
                st = run.streams[s_i]
                k = st.key
                bW = state.b[k] @ Wt[k]  # (K,)
                G += st.values @ Wt[k]
                if st.mask is None:
                    G -= bW[None, :]
                    M += Mfull[k][None]
                else:
                    G -= st.mask @ (state.b[k][:, None] * Wt[k])
                    WW = (state.W[k][:, :, None] * Wt[k][:, None, :]).reshape(-1, K * K)
                    M += (st.mask @ WW).reshape(n, K, K)
            M_run.append(M)
            G_run.append(G)
        Ms.append(tuple(M_run))
        Gs.append(tuple(G_run))
    S = sum(Mfull.values()) / prep.n_total_features
    return Stats(tuple(Ms), tuple(Gs), c, logdet, S)


def _quad(x: np.ndarray, M: np.ndarray, G: np.ndarray) -> float:
    """sum_i x_i^T M_i x_i - 2 x_i^T g_i."""
    return float(np.einsum("nk,nkl,nl->", x, M, x) - 2.0 * np.sum(x * G))


def objective_reuse(prep: Prepared, state: RState, stats: Stats) -> float:
    """J from sufficient statistics (valid while W, b, sigma are those the stats were computed with)."""
    total = stats.c + stats.logdet
    for r, run in enumerate(prep.runs):
        for sl_i, sl in enumerate(run.slots):
            x = gather(slot_weights(prep, sl, group_theta(prep, state, sl.group)), sl.layout, state.Z[r])
            total += _quad(x, stats.M[r][sl_i], stats.G[r][sl_i])
    P = roughness_gram(prep, state.Z)
    return 0.5 * total + 0.5 * prep.roughness * float(np.sum(P * stats.S))


def _dense_parts(prep: Prepared, state: RState, derivs_group: int | None = None):
    """Explicit residuals with the canonical CSR operators; optionally d(data term)/d theta of one group."""
    total = 0.0
    grad: dict[str, float] = {}
    for r, run in enumerate(prep.runs):
        for sl in run.slots:
            grp = prep.groups[sl.group]
            theta = group_theta(prep, state, sl.group)
            want = derivs_group is not None and sl.group == derivs_group
            if want:
                A, dA = response_weights_and_derivs_csr(sl.times, grp.response, theta, run.grid)
            else:
                A, dA = response_weights_csr(sl.times, grp.response, theta, run.grid), {}
            X = A @ state.Z[r]
            dX = {name: D @ state.Z[r] for name, D in dA.items()}
            for s_i in sl.streams:
                st = run.streams[s_i]
                k = st.key
                R = st.values - state.b[k][None, :] - X @ state.W[k].T
                if st.mask is not None:
                    R *= st.mask
                Rw = R / state.var[k][None, :]
                total += float(np.sum(R * Rw))
                for name, dx in dX.items():
                    # d/dtheta 1/2 sum r^2/sigma^2 = - sum (r/sigma^2) (W dx)
                    grad[name] = grad.get(name, 0.0) - float(np.sum((Rw @ state.W[k]) * dx))
    for k in prep.keys:
        total += float(np.sum(prep.count[k] * np.log(state.var[k])))
    P = roughness_gram(prep, state.Z)
    S = penalty_metric(prep, state.W, state.var)
    value = 0.5 * total + 0.5 * prep.roughness * float(np.sum(P * S))
    return value, grad


def objective_dense(prep: Prepared, state: RState) -> float:
    """J from the explicit n x F residual of every stream (the reference path)."""
    return _dense_parts(prep, state)[0]


def theta_value_and_grad_dense(prep: Prepared, state: RState, g: int, theta: dict):
    """Full J and dJ/dtheta_g with theta of group g replaced, from explicit residuals (reference)."""
    pk = prep.groups[g].param_key
    st = state._replace(theta={**state.theta, pk: dict(theta)})
    value, grad = _dense_parts(prep, st, derivs_group=g)
    names = prep.groups[g].response.param_names
    return value, np.array([grad.get(n, 0.0) for n in names])


def theta_value_and_grad_reuse(prep: Prepared, state: RState, stats: Stats, g: int, theta: dict):
    """The part of J that depends on theta_g, and its gradient, from sufficient statistics.

    Returns (f, grad) with ``J = J_rest + f``: f = 1/2 sum over the group's slots of
    ``sum_i x_i^T M_i x_i - 2 x_i^T g_i``, and ``df/dtheta = sum_i dx_i^T (M_i x_i - g_i)``, dx = dA Z.
    O(n w K) per slot: no n x F array is touched.
    """
    names = prep.groups[g].response.param_names
    f = 0.0
    grad = np.zeros(len(names))
    for r, run in enumerate(prep.runs):
        for sl_i, sl in enumerate(run.slots):
            if sl.group != g:
                continue
            a, da = slot_weights(prep, sl, theta, derivs=True)
            idx = sl.layout.start[:, None] + np.arange(sl.layout.width)[None, :]
            Zw = state.Z[r][idx]  # (n, w, K)
            x = np.einsum("nw,nwk->nk", a, Zw)
            M, G = stats.M[r][sl_i], stats.G[r][sl_i]
            f += 0.5 * _quad(x, M, G)
            resid = np.einsum("nkl,nl->nk", M, x) - G
            for j, name in enumerate(names):
                dx = np.einsum("nw,nwk->nk", da[name], Zw)
                grad[j] += float(np.sum(dx * resid))
    return f, grad
