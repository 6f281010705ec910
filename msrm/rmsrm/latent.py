"""The latent step: for fixed W, b, sigma, theta, minimise J over Z_r (one linear system per run).

Setting dJ/dZ = 0 gives, with z = vec(Z) in the interleaved order ``z[j K + k] = Z[j, k]``,

    H z = h,   H = sum_slots sum_i (a_i a_i^T) (x) M_i + lambda (D2^T D2) (x) S,   h = vec(sum_slots A^T G)

(``(x)`` the Kronecker product, a_i the response row of sample i, M_i and G from ``objective.compute_stats``).
plus the pad tie ``lambda rho T (x) S`` (objective.py), ``T = diag(u) + V C_m V^T`` with V = [u, o] (J, 2) and
``C_m = [[0, -1], [-1, |pad|]]``. Every a_i spans one window of w consecutive grid points, so H without the tie's
rank-2K part is block-banded with block bandwidth w - 1 and scalar bandwidth ``w K - 1``.
``solve_latent_banded`` stores that lower band (LAPACK layout), factorises it once by banded Cholesky
(``scipy.linalg.cholesky_banded``, O(J K (w K)^2)) and adds the rank-2K part by Woodbury:

    H = B + U C U^T,  U = V (x) I_K (J K, 2K),  C = lambda rho C_m (x) S,
    H^-1 h = y - Y (I + C U^T Y)^-1 C U^T y,  [y, Y] = B^-1 [h, U],
    log det H = log det B + log det(I + C U^T Y)     (the matrix determinant lemma).

``solve_latent_superlu`` builds H, tie included, as a sparse matrix from the canonical CSR operators with
``scipy.sparse.kron`` (an independent assembly) and factorises it with SuperLU: the reference.
"""
from __future__ import annotations

import numpy as np
import scipy.linalg as sla
import scipy.sparse as sp
import scipy.sparse.linalg as spla

from ..operators import response_weights_csr
from ..runtime import step_blas_limit
from .objective import RState, Stats, group_theta, slot_weights
from .prepare import Prepared

__all__ = ["latent_blocks", "blocks_to_lower_band", "cholesky_band", "pad_tie_lowrank", "solve_latent_banded",
           "latent_sparse_system", "solve_latent_superlu", "solve_latents", "solve_latents_logdet"]


def latent_blocks(prep: Prepared, state: RState, stats: Stats, r: int):
    """Block bands of H and the right-hand side for run r.

    Returns:
        B: (J, nb, K, K) with B[j, d] = H block (j, j + d) (zero where j + d >= J); nb = prep.band_blocks.
        h: (J, K).
    """
    run = prep.runs[r]
    J, K, nb = run.grid.size, prep.n_factors, prep.band_blocks
    B = np.zeros((nb, J, K, K))
    h = np.zeros((J, K))
    for sl_i, sl in enumerate(run.slots):
        a = slot_weights(prep, sl, group_theta(prep, state, sl.group))
        n, w = a.shape
        start = sl.layout.start
        M = stats.M[r][sl_i]
        G = stats.G[r][sl_i]
        # Block (start_i + p, start_i + p + d) gets a_ip a_i,p+d M_i. Pair products ordered like sl.pair_rows
        # (d, then p); a complete slot has one M, so the scatter is one bincount, else one sparse product.
        vals = np.concatenate([a[:, : w - d] * a[:, d:] for d in range(w)], axis=1)
        if sl.complete:
            sums = np.bincount(sl.pair_rows.ravel(), weights=vals.ravel(), minlength=w * J)
            B[:w] += sums.reshape(w, J)[:, :, None, None] * M[0][None, None]
        else:
            npairs = vals.shape[1]
            T = sp.csc_matrix((vals.ravel(), sl.pair_rows.ravel(), np.arange(0, n * npairs + 1, npairs)),
                              shape=(w * J, n))
            B[:w] += (T @ M.reshape(n, K * K)).reshape(w, J, K, K)
        # h = A^T G
        hrows = (start[:, None] + np.arange(w)[None, :]).ravel()
        for k in range(K):
            h[:, k] += np.bincount(hrows, weights=(a * G[:, k : k + 1]).ravel(), minlength=J)
    lam = prep.roughness
    for d in range(3):
        B[d] += lam * run.dtd[d][:, None, None] * stats.S[None]
    B[0, ~run.observed] += lam * prep.pad_tie * stats.S[None]  # the diagonal part of the pad tie
    return B.transpose(1, 0, 2, 3), h


def pad_tie_lowrank(prep: Prepared, r: int, S: np.ndarray):
    """The rank-2K part of the pad tie in H for run r (module docstring): (U (J K, 2K), C (2K, 2K)), or None when
    the run has no pad or the tie is off."""
    run = prep.runs[r]
    pad = ~run.observed
    if prep.pad_tie <= 0 or not pad.any():
        return None
    K = prep.n_factors
    V = np.stack([pad.astype(np.float64), run.observed / run.observed.sum()], axis=1)
    Cm = np.array([[0.0, -1.0], [-1.0, float(pad.sum())]])
    return np.kron(V, np.eye(K)), prep.roughness * prep.pad_tie * np.kron(Cm, S)


def blocks_to_lower_band(B: np.ndarray) -> np.ndarray:
    """Lower band storage of H for LAPACK: ab[u, c] = H[c + u, c], u = 0 .. nb K - 1."""
    J, nb, K, _ = B.shape
    N = J * K
    ab = np.zeros((nb * K, N))
    j = np.arange(J)
    for d in range(nb):
        jj = j[: J - d]
        for k in range(K):
            for l in range(K):
                if d == 0 and l < k:
                    continue
                # H[(j + d) K + l, j K + k] = B[j, d, k, l]
                ab[d * K + l - k, jj * K + k] = B[: J - d, d, k, l]
    return ab


def cholesky_band(ab: np.ndarray, diagnostics: list | None = None) -> np.ndarray:
    """Lower banded Cholesky factor of ``ab`` (LAPACK storage, modified in place on failure): if the band is
    numerically not positive definite (a factor with no information anywhere), a ridge of 1e-10 times the mean
    diagonal is added and the event appended to ``diagnostics``."""
    try:
        return sla.cholesky_banded(ab, lower=True, check_finite=False)
    except np.linalg.LinAlgError:
        ridge = 1e-10 * float(np.mean(ab[0]))
        ab[0] += ridge
        if diagnostics is not None:
            diagnostics.append(f"latent system not positive definite; ridge {ridge:.3g} added")
        return sla.cholesky_banded(ab, lower=True, check_finite=False)


def solve_latent_banded(B: np.ndarray, h: np.ndarray, diagnostics: list | None = None, lowrank=None,
                        logdet: bool = False):
    """Solve ``(band(B) + U C U^T) z = h`` by banded Cholesky and Woodbury (module docstring).

    Args:
        B, h: from :func:`latent_blocks`.
        lowrank: ``(U, C)`` from :func:`pad_tie_lowrank`, or None.
        logdet: also return log det H.

    If the band is numerically not positive definite (a factor with no information anywhere), a ridge of 1e-10
    times the mean diagonal is added and the event is appended to ``diagnostics``; it is never silent.

    Returns:
        (J, K) latents, or ((J, K), log det H) when ``logdet``.
    """
    J, nb, K, _ = B.shape
    rhs = h.reshape(-1, 1) if lowrank is None else np.concatenate([h.reshape(-1, 1), lowrank[0]], axis=1)
    cb = cholesky_band(blocks_to_lower_band(B), diagnostics)
    Y = sla.cho_solve_banded((cb, True), rhs, check_finite=False)
    z = Y[:, 0]
    ld = 2.0 * float(np.sum(np.log(cb[0]))) if logdet else None
    if lowrank is not None:
        U, C = lowrank
        cap = np.eye(C.shape[0]) + C @ (U.T @ Y[:, 1:])  # I + C U^T B^-1 U
        z = z - Y[:, 1:] @ np.linalg.solve(cap, C @ (U.T @ z))
        if logdet:
            sign, ldc = np.linalg.slogdet(cap)
            if sign <= 0:
                raise FloatingPointError("the latent system with the pad tie is not positive definite")
            ld += float(ldc)
    z = z.reshape(J, K)
    return (z, ld) if logdet else z


def latent_sparse_system(prep: Prepared, state: RState, stats: Stats, r: int):
    """(H as CSC, h (J K,)) assembled from canonical CSR operators with Kronecker products (reference)."""
    run = prep.runs[r]
    J, K = run.grid.size, prep.n_factors
    H = sp.csr_matrix((J * K, J * K))
    h = np.zeros((J, K))
    for sl_i, sl in enumerate(run.slots):
        A = response_weights_csr(sl.times, prep.groups[sl.group].response, group_theta(prep, state, sl.group),
                                 run.grid)
        M = stats.M[r][sl_i]
        for k in range(K):
            for l in range(K):
                E = np.zeros((K, K))
                E[k, l] = 1.0
                H = H + sp.kron((A.T @ sp.diags(M[:, k, l]) @ A), E, format="csr")
        h += A.T @ stats.G[r][sl_i]
    D = sp.diags([np.ones(J - 2), -2.0 * np.ones(J - 2), np.ones(J - 2)], [0, 1, 2], shape=(J - 2, J))
    Omega = D.T @ D
    pad = ~run.observed
    if prep.pad_tie > 0 and pad.any():
        # sum_{j in pad} (z_j - o^T z)^2 written out: (E_pad - 1 o^T)^T (E_pad - 1 o^T)
        o = run.observed / run.observed.sum()
        E = sp.eye(J, format="csr")[np.flatnonzero(pad)]
        Dt = E - sp.csr_matrix(np.ones((int(pad.sum()), 1)) * o[None, :])
        Omega = Omega + prep.pad_tie * (Dt.T @ Dt)
    H = H + prep.roughness * sp.kron(Omega, sp.csr_matrix(stats.S), format="csr")
    return H.tocsc(), h.ravel()


def solve_latent_superlu(prep: Prepared, state: RState, stats: Stats, r: int, logdet: bool = False):
    """Reference latent solve: sparse assembly + SuperLU (and log det H = sum log |U_ii|, H being positive
    definite, when ``logdet``)."""
    H, h = latent_sparse_system(prep, state, stats, r)
    lu = spla.splu(H)
    z = lu.solve(h).reshape(-1, prep.n_factors)
    return (z, float(np.sum(np.log(np.abs(lu.U.diagonal()))))) if logdet else z


def _solve_run(prep, state, stats, r, solver, diagnostics, logdet):
    if solver == "banded":
        B, h = latent_blocks(prep, state, stats, r)
        return solve_latent_banded(B, h, diagnostics, pad_tie_lowrank(prep, r, stats.S), logdet=logdet)
    return solve_latent_superlu(prep, state, stats, r, logdet=logdet)


def solve_latents(prep: Prepared, state: RState, stats: Stats, solver: str, diagnostics: list | None = None):
    """The latent step for every run: tuple of (J, K). BLAS threads: ``msrm.runtime.step_blas_threads("banded")``
    (one, unless ``configure(blas_threads=...)`` says otherwise)."""
    with step_blas_limit("banded"):
        return tuple(_solve_run(prep, state, stats, r, solver, diagnostics, False) for r in range(len(prep.runs)))


def solve_latents_logdet(prep: Prepared, state: RState, stats: Stats, solver: str,
                         diagnostics: list | None = None) -> tuple[tuple, float]:
    """The latent step and ``sum_r log det H_r`` (the Hessian of J in Z; response.py's marginal criterion), with
    the thread count of :func:`solve_latents`."""
    with step_blas_limit("banded"):
        out = [_solve_run(prep, state, stats, r, solver, diagnostics, True) for r in range(len(prep.runs))]
    return tuple(z for z, _ in out), float(sum(ld for _, ld in out))
