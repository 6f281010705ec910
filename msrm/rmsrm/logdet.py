"""Analytic gradient of ``sum_r log det H_r`` in the response parameters and log lambda (the marginal step).

H (latent.py) is ``B + U C U^T``: a block-banded part B (J x J blocks of K x K, block bandwidth nb - 1) and the
pad tie's rank-2K part. The response parameters theta_g move only the rows a_i of the group's slots, so

    d log det H / d theta = tr(H^-1 dH),   dH = sum_i (da_i a_i^T + a_i da_i^T) (x) M_i,

and, H^-1 and M_i being symmetric, ``tr(H^-1 (x y^T (x) M)) = sum_pq x_p y_q tr(Sigma[q, p] M)`` with Sigma[q, p]
the K x K block of H^-1. Every a_i spans one window of w <= nb grid points, so only the blocks of H^-1 within
the band are needed: its *selected inverse*. For log lambda, ``dH / d log lambda = lambda dH / d lambda`` is the
roughness part (second differences and the pad tie, both proportional to lambda).

The selected inverse comes from the banded Cholesky factor L of B by the block form of Takahashi's recurrence.
With L cut into consecutive diagonal blocks of size s >= the scalar bandwidth, L is block lower bidiagonal, and
``Sigma L = L^-T`` read block column by block column, last first, gives

    Sigma[I+1, I] = -Sigma[I+1, I+1] L[I+1, I] L[I, I]^-1,
    Sigma[I, I]   = (L[I, I]^-T - Sigma[I, I+1] L[I+1, I]) L[I, I]^-1,

dense s x s products on n / s blocks: O(n s^2), the cost of the factorization itself. The tie's part enters by
Woodbury, ``H^-1 = B^-1 - Y Q Y^T`` with ``Y = B^-1 U`` and ``Q = (I + C U^T Y)^-1 C``; within the band only
``(Y Q)[a] . Y[b]`` is needed.

This replaces two log-determinants per parameter (central differences) by one factorization and one selected
inverse per run; ``tests/test_rmsrm_logdet.py`` checks it against a dense inverse and central differences.
"""
from __future__ import annotations

import numpy as np
import scipy.linalg as sla

from .latent import blocks_to_lower_band, cholesky_band, latent_blocks, pad_tie_lowrank
from .objective import RState, Stats, slot_weights
from .prepare import Prepared

__all__ = ["selected_inverse_banded", "band_to_blocks", "run_selected_inverse", "logdet_gradient"]


def selected_inverse_banded(cb: np.ndarray) -> np.ndarray:
    """The band of ``(L L^T)^-1`` from the lower banded Cholesky factor.

    Args:
        cb: (b + 1, n) lower band of L in LAPACK storage, ``cb[u, c] = L[c + u, c]`` (scipy's
            ``cholesky_banded(..., lower=True)``).

    Returns:
        (b + 1, n) the same band of the inverse: ``out[u, c] = Sigma[c + u, c]`` (zero where c + u >= n).
    """
    b1, n = cb.shape
    b = b1 - 1
    s = max(b, 1)
    nblk = -(-n // s)
    npad = nblk * s
    # Dense (2 s, s) panels of L per block column: P[r, i] = L[c0 + r, c0 + i]; padded columns get L = I so
    # the padded matrix stays triangular and its inverse's real part is unchanged.
    cbp = np.zeros((b1, npad + s))
    cbp[:, :n] = cb
    for du in range(1, b1):  # LAPACK leaves the corner beyond row n - 1 unreferenced
        cbp[du, n - du:n] = 0.0
    cbp[0, n:] = 1.0
    u = np.arange(b1)
    i = np.arange(s)
    rows = (i[None, :] + u[:, None]).ravel()  # (b1 * s,)
    cols = np.broadcast_to(i[None, :], (b1, s)).ravel()
    keep = rows < 2 * s
    rows, cols, uu = rows[keep], cols[keep], np.broadcast_to(u[:, None], (b1, s)).ravel()[keep]
    out = np.zeros((b1, npad))
    band_rows = u[:, None] + i[None, :]  # (b1, s): row i + u of the (2 s, s) panel, column i
    band_cols = np.broadcast_to(i[None, :], (b1, s))
    sig_next = None  # Sigma[I+1, I+1]
    for blk in range(nblk - 1, -1, -1):
        c0 = blk * s
        P = np.zeros((2 * s, s))
        P[rows, cols] = cbp[uu, c0 + cols]
        Ld = np.tril(P[:s])  # L[I, I]
        Lo = P[s:]           # L[I+1, I] (zero below the band)
        inv_Ld = sla.solve_triangular(Ld, np.eye(s), lower=True, check_finite=False)
        if sig_next is None or blk == nblk - 1:
            sig_off = None
            sig_d = inv_Ld.T @ inv_Ld
        else:
            sig_off = -(sig_next @ Lo) @ inv_Ld            # Sigma[I+1, I]
            sig_d = inv_Ld.T @ inv_Ld - sig_off.T @ Lo @ inv_Ld
            sig_d = 0.5 * (sig_d + sig_d.T)
        # the band of columns c0 .. c0 + s - 1: out[u, c0 + i] = [Sigma[I, I]; Sigma[I+1, I]][i + u, i]
        panel = np.vstack([sig_d, sig_off if sig_off is not None else np.zeros((s, s))])
        out[:, c0:c0 + s] = panel[band_rows, band_cols]
        sig_next = sig_d
    out = out[:, :n]
    for du in range(1, b1):
        out[du, n - du:] = 0.0
    return out


def band_to_blocks(band: np.ndarray, J: int, nb: int, K: int) -> np.ndarray:
    """Lower band (as :func:`latent.blocks_to_lower_band` lays it out) back to blocks.

    Returns:
        (J, nb, K, K) with ``Sig[j, d, k, l] = Sigma[(j + d) K + l, j K + k]`` (the K x K block (j + d, j) read
        as (column factor k, row factor l), the layout of ``latent_blocks``; zero where j + d >= J).
    """
    out = np.zeros((J, nb, K, K))
    j = np.arange(J)
    for d in range(nb):
        jj = j[: J - d]
        for k in range(K):
            for l in range(K):
                u = d * K + l - k
                if u < 0:  # above the diagonal inside the diagonal block: symmetric entry
                    out[jj, d, k, l] = band[-u, jj * K + l]
                elif u < band.shape[0]:
                    out[jj, d, k, l] = band[u, jj * K + k]
    return out


def run_selected_inverse(prep: Prepared, state: RState, stats: Stats, r: int):
    """Blocks of H_r^-1 within the band, tie included, and what the log-lambda derivative needs.

    Returns:
        (Sig (J, nb, K, K) as :func:`band_to_blocks`, tie_trace): ``tie_trace = tr(H^-1 U C U^T)`` (zero without
        a pad tie), the trace of the rank-2K part of the roughness term against H^-1.
    """
    run = prep.runs[r]
    J, K, nb = run.grid.size, prep.n_factors, prep.band_blocks
    B, _ = latent_blocks(prep, state, stats, r)
    cb = cholesky_band(blocks_to_lower_band(B))
    band = selected_inverse_banded(cb)
    lowrank = pad_tie_lowrank(prep, r, stats.S)
    tie_trace = 0.0
    if lowrank is not None:
        U, C = lowrank
        Y = sla.cho_solve_banded((cb, True), U, check_finite=False)   # B^-1 U
        UY = U.T @ Y
        Q = np.linalg.solve(np.eye(C.shape[0]) + C @ UY, C)            # (I + C U^T Y)^-1 C
        YQ = Y @ Q
        n = J * K
        for u in range(band.shape[0]):
            c = np.arange(n - u)
            band[u, c] -= np.einsum("ij,ij->i", YQ[c + u], Y[c])
        # tr(H^-1 U C U^T) = tr(U^T H^-1 U C),  U^T H^-1 U = U^T Y - U^T Y Q U^T Y
        tie_trace = float(np.trace((UY - UY @ Q @ UY) @ C))
    return band_to_blocks(band, J, nb, K), tie_trace


def _slot_logdet_grad(Sig: np.ndarray, slot, M: np.ndarray, a: np.ndarray, da: dict) -> dict:
    """{name: sum_i sum_pq da_ip a_iq T_i(p, q)} with ``T_i(p, q) = tr(Sigma[start_i + q, start_i + p] M_i)``.

    T_i(p, q) depends on the block ``(start_i + p + d, start_i + p)``, d = |q - p|, so the sum runs over the
    pairs p <= p + d of ``slot.pair_rows``: ``X[i, (d, p)] = da_ip a_i,p+d + a_ip da_i,p+d`` (once for d = 0).
    A complete slot has one M: X is summed onto the grid by one bincount, the way latent.latent_blocks sums
    a_ip a_i,p+d, and contracted with ``t[d, j] = tr(Sigma[j + d, j] M)``. Otherwise M_i differs by sample and
    T is taken diagonal by diagonal, O(n w^2 K^2) without an (n, w, w, K, K) array.
    """
    n, w = a.shape
    J = Sig.shape[0]
    start = slot.layout.start
    out = {}
    if M.shape[0] == 1:
        t = np.einsum("jdkl,lk->dj", Sig[:, :w], M[0]).ravel()        # (w J,): row d J + j
        for name, g in da.items():
            X = np.concatenate([g[:, : w - d] * a[:, d:] + (a[:, : w - d] * g[:, d:] if d else 0.0)
                                for d in range(w)], axis=1)
            out[name] = float(np.bincount(slot.pair_rows.ravel(), weights=X.ravel(), minlength=w * J) @ t)
        return out
    out = {name: 0.0 for name in da}
    for d in range(w):
        idx = start[:, None] + np.arange(w - d)[None, :]              # (n, w - d): block rows start + p
        t = np.einsum("npkl,nlk->np", Sig[idx, d], M)
        for name, g in da.items():
            pair = g[:, : w - d] * a[:, d:]
            if d:
                pair = pair + a[:, : w - d] * g[:, d:]
            out[name] += float(np.sum(pair * t))
    return out


def logdet_gradient(prep: Prepared, state: RState, stats: Stats, layout, roughness: bool) -> np.ndarray:
    """Gradient of ``1/2 sum_r log det H_r`` in x = (theta in ``layout`` order, then log lambda if ``roughness``).

    Args:
        layout: ``response._theta_layout(prep)``: [(group, param key, name, bounds)].
        state: theta and lambda (``prep.roughness``) at which to differentiate; Z is not used.
    """
    position = {(g, name): i for i, (g, _, name, _) in enumerate(layout)}
    grad = np.zeros(len(layout) + (1 if roughness else 0))
    lam = float(prep.roughness)
    for r, run in enumerate(prep.runs):
        Sig, tie_trace = run_selected_inverse(prep, state, stats, r)
        for sl_i, sl in enumerate(run.slots):
            pk = prep.groups[sl.group].param_key
            if pk is None:
                continue
            a, da = slot_weights(prep, sl, state.theta[pk], derivs=True)
            # 1/2 tr(H^-1 dH) = sum_i sum_pq da_ip a_iq T_i(p, q)
            for name, v in _slot_logdet_grad(Sig, sl, stats.M[r][sl_i], a, da).items():
                grad[position[(sl.group, name)]] += v
        if roughness:
            # lambda dH/dlambda = lambda [(D2^T D2 + rho diag(pad)) (x) S] + U C U^T
            trS = np.einsum("jdkl,lk->jd", Sig[:, :3], stats.S)   # tr(Sigma block (j + d, j) S)
            t = float(np.sum(run.dtd[0] * trS[:, 0]) + 2.0 * np.sum(run.dtd[1] * trS[:, 1])
                      + 2.0 * np.sum(run.dtd[2] * trS[:, 2]))
            t += prep.pad_tie * float(np.sum(trS[~run.observed, 0]))
            grad[-1] += 0.5 * (lam * t + tie_trace)
    return grad
