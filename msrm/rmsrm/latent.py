"""The latent step: for fixed W, b, sigma, theta, minimise J over Z_r (one linear system per run).

Setting dJ/dZ = 0 gives, with z = vec(Z) in the interleaved order ``z[j K + k] = Z[j, k]``,

    H z = h,   H = sum_slots sum_i (a_i a_i^T) (x) M_i + lambda (D2^T D2) (x) S,   h = vec(sum_slots A^T G)

(``(x)`` the Kronecker product, a_i the response row of sample i, M_i and G from ``objective.compute_stats``).
Every a_i spans one window of w consecutive grid points, so H is block-banded with block bandwidth w - 1 and
scalar bandwidth ``w K - 1``. ``solve_latent_banded`` stores the lower band (LAPACK layout) and calls
``scipy.linalg.solveh_banded`` (banded Cholesky, O(J K (w K)^2)); ``solve_latent_superlu`` builds H as a sparse
matrix from the canonical CSR operators with ``scipy.sparse.kron`` (an independent assembly) and factorises it
with SuperLU: the reference.
"""
from __future__ import annotations

import numpy as np
import scipy.linalg as sla
import scipy.sparse as sp
import scipy.sparse.linalg as spla

from ..operators import response_weights_csr
from .objective import RState, Stats, group_theta, slot_weights
from .prepare import Prepared

__all__ = ["latent_blocks", "blocks_to_lower_band", "solve_latent_banded", "latent_sparse_system",
           "solve_latent_superlu", "solve_latents"]


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
    return B.transpose(1, 0, 2, 3), h


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


def solve_latent_banded(B: np.ndarray, h: np.ndarray, diagnostics: list | None = None) -> np.ndarray:
    """Solve H z = h by banded Cholesky (LAPACK pbsv via scipy.linalg.solveh_banded).

    If H is numerically not positive definite (a factor with no information anywhere), a ridge of 1e-10 times
    the mean diagonal is added and the event is appended to ``diagnostics``; it is never silent.
    """
    J, nb, K, _ = B.shape
    ab = blocks_to_lower_band(B)
    try:
        z = sla.solveh_banded(ab, h.ravel(), lower=True, check_finite=False)
    except np.linalg.LinAlgError:
        ridge = 1e-10 * float(np.mean(ab[0]))
        ab[0] += ridge
        z = sla.solveh_banded(ab, h.ravel(), lower=True, check_finite=False)
        if diagnostics is not None:
            diagnostics.append(f"latent system not positive definite; ridge {ridge:.3g} added")
    return z.reshape(J, K)


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
    H = H + prep.roughness * sp.kron(D.T @ D, sp.csr_matrix(stats.S), format="csr")
    return H.tocsc(), h.ravel()


def solve_latent_superlu(prep: Prepared, state: RState, stats: Stats, r: int) -> np.ndarray:
    """Reference latent solve: sparse assembly + SuperLU."""
    H, h = latent_sparse_system(prep, state, stats, r)
    return spla.splu(H).solve(h).reshape(-1, prep.n_factors)


def solve_latents(prep: Prepared, state: RState, stats: Stats, solver: str, diagnostics: list | None = None):
    """The latent step for every run: tuple of (J, K)."""
    out = []
    for r in range(len(prep.runs)):
        if solver == "banded":
            B, h = latent_blocks(prep, state, stats, r)
            out.append(solve_latent_banded(B, h, diagnostics))
        else:
            out.append(solve_latent_superlu(prep, state, stats, r))
    return tuple(out)
