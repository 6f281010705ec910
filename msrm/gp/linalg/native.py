r"""Native JAX path of the guarded factorization (``lax`` control flow) and the unrolled small Cholesky.

:func:`native_quad_logdet` computes what :func:`msrm.gp.linalg.quad_logdet` returns with
``jnp.linalg.cholesky`` and triangular solves, the jitter ladder of :mod:`.ladder` as a ``lax.while_loop`` and
the eigenvalue fallback as a ``lax.cond``. Its reverse rule forms ``M^{-1} = L^{-T} L^{-1}`` in the backward
pass from one triangular inverse and returns

.. math::

    \bar M = G_l\, M^{-1} - G_q\, A A^\top, \qquad \bar V = 2\, G_q\, A,

with ``A = M_s^{-1} V`` and ``G_q``, ``G_l`` the cotangents of the quadratic form and the log determinant. Both
terms of ``\bar M`` are evaluated as ``(X + X^T)/2``, so the cotangent is symmetric in floating point too.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .ladder import EVENT_EIGH_FALLBACK, EVENT_NONFINITE, N_JITTER, jitter_levels

__all__ = ["SMALL_CHOLESKY_MAX", "small_cholesky", "small_lower_solve", "small_upper_solve", "native_factor",
           "native_quad_logdet"]

#: Largest K for which :func:`small_cholesky` unrolls the factorization into elementwise operations.
SMALL_CHOLESKY_MAX = 12


def small_cholesky(A):
    """Lower Cholesky factors of a batch of small symmetric matrices ``A`` (..., K, K), as ``jnp.linalg.cholesky``
    (of the symmetrised input; NaN where a matrix is not positive definite).

    For ``K <= SMALL_CHOLESKY_MAX`` the column algorithm is unrolled into elementwise operations over the batch:
    no LAPACK call at all. For the node factors (K x K, K the number of factors) this is cheaper than a LAPACK
    call per node, and on XLA:CPU it also avoids the batched LAPACK kernels that can leave every thread of
    XLA's pool waiting (:mod:`.compat`). Larger K falls back to ``jnp.linalg.cholesky``.
    """
    K = A.shape[-1]
    if A.shape[-2] != K:
        raise ValueError(f"small_cholesky: expected square matrices, got shape {A.shape}")
    if K > SMALL_CHOLESKY_MAX:
        return jnp.linalg.cholesky(A)
    A = 0.5 * (A + jnp.swapaxes(A, -1, -2))
    L = [[None] * K for _ in range(K)]
    for j in range(K):
        d2 = A[..., j, j]
        for k in range(j):
            d2 = d2 - L[j][k] * L[j][k]
        d = jnp.sqrt(d2)
        L[j][j] = d
        for i in range(j + 1, K):
            t = A[..., i, j]
            for k in range(j):
                t = t - L[i][k] * L[j][k]
            L[i][j] = t / d
    zero = jnp.zeros_like(A[..., 0, 0])
    return jnp.stack([jnp.stack([L[i][j] if j <= i else zero for j in range(K)], axis=-1) for i in range(K)],
                     axis=-2)


def small_lower_solve(L, b):
    """``x = L^{-1} b`` for a batch of small lower-triangular ``L`` (..., K, K) and ``b`` (..., K).

    Forward substitution unrolled into elementwise operations over the batch for ``K <= SMALL_CHOLESKY_MAX``
    (as :func:`small_cholesky`, no LAPACK call); larger K uses ``jax.lax.linalg.triangular_solve``.
    """
    K = L.shape[-1]
    if K > SMALL_CHOLESKY_MAX:
        return lax.linalg.triangular_solve(L, b[..., None], left_side=True, lower=True)[..., 0]
    x = []
    for i in range(K):
        t = b[..., i]
        for k in range(i):
            t = t - L[..., i, k] * x[k]
        x.append(t / L[..., i, i])
    return jnp.stack(x, axis=-1)


def small_upper_solve(U, b):
    """``x = U^{-1} b`` for a batch of small upper-triangular ``U`` (..., K, K) and ``b`` (..., K) (back
    substitution, unrolled like :func:`small_lower_solve`)."""
    K = U.shape[-1]
    if K > SMALL_CHOLESKY_MAX:
        return lax.linalg.triangular_solve(U, b[..., None], left_side=True, lower=False)[..., 0]
    x = [None] * K
    for i in range(K - 1, -1, -1):
        t = b[..., i]
        for k in range(i + 1, K):
            t = t - U[..., i, k] * x[k]
        x[i] = t / U[..., i, i]
    return jnp.stack(x, axis=-1)


def _chol_ok(L):
    return jnp.all(jnp.isfinite(jnp.diagonal(L)))


def native_factor(Ms):
    """Guarded lower Cholesky factor of a symmetric ``Ms`` (n, n): plain, then the jitter ladder, then the
    eigenvalue fallback (:mod:`.ladder`).

    ``Ms`` is used as given (the caller symmetrises it). Returns ``(L, event)``: L (n, n) float64, event ()
    int32 (:data:`~.ladder.EVENT_NONFINITE` when ``Ms`` holds a non-finite entry).
    """
    n = Ms.shape[0]
    eye = jnp.eye(n, dtype=Ms.dtype)
    diag = jnp.diagonal(Ms)
    s = jnp.mean(diag)
    scale = jnp.where(jnp.isfinite(s) & (s > 0), s, 1.0)
    levels = jnp.asarray(np.concatenate([[0.0], jitter_levels()]))

    L0 = jnp.linalg.cholesky(Ms)
    state0 = (jnp.int32(0), L0, _chol_ok(L0))

    def cond(state):
        k, _, ok = state
        return jnp.logical_and(~ok, k < N_JITTER)

    def body(state):
        k, _, _ = state
        k = k + 1
        L = jnp.linalg.cholesky(Ms + levels[k] * scale * eye)
        return k, L, _chol_ok(L)

    k, L, ok = lax.while_loop(cond, body, state0)

    def fallback(_):
        w, Q = jnp.linalg.eigh(Ms)
        w = jnp.maximum(w, levels[-1] * scale)
        Mc = (Q * w) @ Q.T
        return jnp.linalg.cholesky(0.5 * (Mc + Mc.T))

    L = lax.cond(ok, lambda _: L, fallback, None)
    finite = jnp.all(jnp.isfinite(Ms))
    event = jnp.where(ok, k, jnp.int32(EVENT_EIGH_FALLBACK))
    event = jnp.where(finite, event, jnp.int32(EVENT_NONFINITE)).astype(jnp.int32)
    return L, event


def _native_forward(M, V, symmetric: bool = False):
    L, event = native_factor(M if symmetric else 0.5 * (M + M.T))
    B = jax.scipy.linalg.solve_triangular(L, V, lower=True)
    A = jax.scipy.linalg.solve_triangular(L, B, lower=True, trans=1)
    quad = jnp.sum(V * A)
    logdet = 2.0 * jnp.sum(jnp.log(jnp.diagonal(L)))
    event = jnp.where(jnp.all(jnp.isfinite(V)), event, jnp.int32(EVENT_NONFINITE)).astype(jnp.int32)
    quad = jnp.where(event == EVENT_NONFINITE, jnp.nan, quad)
    logdet = jnp.where(event == EVENT_NONFINITE, jnp.nan, logdet)
    return (quad, logdet, event), (L, A)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def native_quad_logdet(M, V, symmetric=False):
    """``(quad, logdet, event)`` of ``M`` (n, n) and ``V`` (n, r), native path (inputs checked by the caller).

    ``symmetric=True`` promises ``M`` is bitwise symmetric and skips the symmetrisation.
    """
    return _native_forward(M, V, symmetric)[0]


def _native_bwd(symmetric, res, cts):
    L, A = res
    gq, gl, _ = cts
    n = L.shape[0]
    Linv = jax.scipy.linalg.solve_triangular(L, jnp.eye(n, dtype=L.dtype), lower=True)
    Minv = Linv.T @ Linv
    AAt = A @ A.T
    # one elementwise fusion: symmetrised cotangent without materialising the unsymmetrised one
    dM = (0.5 * gl) * (Minv + Minv.T) - (0.5 * gq) * (AAt + AAt.T)
    return dM, 2.0 * gq * A


native_quad_logdet.defvjp(lambda M, V, symmetric: _native_forward(M, V, symmetric), _native_bwd)
