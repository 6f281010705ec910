r"""LAPACK host-callback path of the guarded factorization (SciPy ``dpotrf``/``dpotrs``/``dpotri``).

:func:`callback_quad_logdet` computes what :func:`msrm.gp.linalg.quad_logdet` returns inside
``jax.pure_callback``: the value from ``dpotrf`` and ``dpotrs`` with the jitter ladder of :mod:`.ladder` on the
host. Under differentiation the forward pass also inverts the factor in place (``dpotri``) and keeps ``M^{-1}``
as the residual, so the backward pass is one elementwise XLA expression,

.. math::

    \bar M = G_l\, M^{-1} - G_q\, A A^\top, \qquad \bar V = 2\, G_q\, A,

and the factor never travels back to the host. The callback uses ``vmap_method="broadcast_all"`` and loops over
a batch on the host.

**BLAS threads.** Each execution of the callback chooses its count afresh
(:func:`msrm.runtime.callback_blas_limit`), from the work of one factorization, :math:`f = n^3/3` for an
:math:`n \times n` matrix, by :func:`msrm.runtime.callback_thread_count`: an explicit count
(:func:`msrm.runtime.fixed_step_threads`, :func:`msrm.runtime.callback_threads`, ``configure(blas_threads=)``)
as given, else one thread for :math:`f < F_0` (:data:`msrm.runtime.DENSE_THREAD_MIN_FLOPS`) and the idle cores
at that moment otherwise (:func:`msrm.runtime.idle_cores`: the usable cores less the threads other processes
are running). A count above the physical cores warns. POTRF, POTRS and POTRI give the same
result to rounding at every count.

On the host, factors are kept as ``U = L^T`` in Fortran order so that ``L = U.T`` is a C-contiguous view handed
back to JAX without a copy.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ... import runtime
from .ladder import EVENT_EIGH_FALLBACK, EVENT_NONFINITE, EVENT_PLAIN, jitter_levels

__all__ = ["callback_quad_logdet", "fill_lower_from_upper"]


def _scale(diag: np.ndarray) -> float:
    s = float(np.mean(diag))
    return s if np.isfinite(s) and s > 0 else 1.0


def _symmetrised_fortran(M: np.ndarray) -> np.ndarray:
    """``(M + M^T)/2`` as a new Fortran-ordered array (the only (n, n) allocation of the forward pass)."""
    S = np.add(M, M.T, order="F")
    S *= 0.5
    return S


def _host_factor(M: np.ndarray, symmetric: bool = False) -> tuple[np.ndarray | None, int]:
    """Guarded factorization of ``(M + M^T)/2`` (of ``M`` itself when the caller built it exactly symmetric).

    Returns (U in Fortran order, its strict lower triangle left as garbage, or None; event).
    """
    from scipy.linalg import lapack

    # exactly symmetric: M^T is M in Fortran order (a view); POTRF copies it once
    Ms = M.T if symmetric else _symmetrised_fortran(M)
    diag = np.diag(Ms).copy()
    U, info = lapack.dpotrf(Ms, lower=0, clean=0, overwrite_a=0 if symmetric else 1)
    # A NaN or infinity in the triangle POTRF reads reaches a pivot (NaN or <= 0: info > 0) except an infinite
    # diagonal entry, whose pivot is infinite; so the whole matrix is checked only when POTRF did not succeed.
    if info == 0 and np.all(np.isfinite(np.diag(U))):
        return U, EVENT_PLAIN
    if not np.all(np.isfinite(M)):
        return None, EVENT_NONFINITE
    Ms = _symmetrised_fortran(M)  # dpotrf overwrote the failed attempt
    scale = _scale(diag)
    n = Ms.shape[0]
    for k, rel in enumerate(jitter_levels(), start=1):
        Mj = np.array(Ms, order="F", copy=True)
        Mj[np.diag_indices(n)] += rel * scale
        U, info = lapack.dpotrf(Mj, lower=0, clean=0, overwrite_a=1)
        if info == 0:
            return U, k
    w, Q = np.linalg.eigh(Ms)
    w = np.maximum(w, jitter_levels()[-1] * scale)
    Mc = (Q * w) @ Q.T
    Mc = 0.5 * (Mc + Mc.T)
    U, info = lapack.dpotrf(Mc, lower=0, clean=0, overwrite_a=1)
    if info != 0:  # pragma: no cover - clipped spectrum is PD by construction
        return None, EVENT_NONFINITE
    return U, EVENT_EIGH_FALLBACK


def _host_solve(U: np.ndarray, V: np.ndarray) -> tuple[float, float, np.ndarray]:
    from scipy.linalg import lapack

    A, info = lapack.dpotrs(U, V, lower=0, overwrite_b=0)
    if info != 0:  # pragma: no cover - arguments are checked before
        raise RuntimeError(f"dpotrs failed with info={info}")
    quad = float(np.sum(V * A))
    logdet = 2.0 * float(np.sum(np.log(np.diag(U))))
    return quad, logdet, A


def _host_one(M: np.ndarray, V: np.ndarray, want_residuals: bool, symmetric: bool = False):
    """(quad, logdet, event) and, with ``want_residuals``, the reverse pass's residuals ``(M^{-1}, A)``."""
    n, r = V.shape
    U, event = _host_factor(M, symmetric)
    if U is None:
        nan = np.float64(np.nan)
        return nan, nan, np.int32(event), np.full((n, n), np.nan), np.full((n, r), np.nan)
    if not np.all(np.isfinite(V)):
        event = EVENT_NONFINITE
    quad, logdet, A = _host_solve(U, V)
    if event == EVENT_NONFINITE:
        quad = logdet = np.nan
    Minv = _inverse_from_factor(U) if want_residuals else None
    return np.float64(quad), np.float64(logdet), np.int32(event), Minv, np.ascontiguousarray(A)


def _inverse_from_factor(U: np.ndarray) -> np.ndarray:
    """``M^{-1}`` (C order, both triangles) from the upper factor ``U`` (Fortran order), in U's own buffer."""
    from scipy.linalg import lapack

    Minv, info = lapack.dpotri(U, lower=0, overwrite_c=1)  # upper triangle of M^{-1}, in place
    if info != 0:  # pragma: no cover - a factor from POTRF is nonsingular
        raise RuntimeError(f"dpotri failed with info={info}")
    return fill_lower_from_upper(Minv).T  # symmetric, so the transpose view is the same matrix in C order


def _host_batched(M, V, want_residuals: bool, symmetric: bool = False):
    """Loop over leading batch dims (``vmap_method='broadcast_all'``)."""
    M = np.asarray(M, dtype=np.float64)
    V = np.asarray(V, dtype=np.float64)
    batch = M.shape[:-2]
    n, r = V.shape[-2:]
    flops = n**3 / 3.0  # one POTRF: the size the thread count is chosen by
    if not batch:  # no vmap: hand M^{-1} back without an extra (n, n) copy
        with runtime.callback_blas_limit(flops=flops):
            out = _host_one(M, V, want_residuals, symmetric)
        return out if want_residuals else out[:3]
    quad = np.empty(batch)
    logdet = np.empty(batch)
    event = np.empty(batch, dtype=np.int32)
    Minv = np.empty(batch + (n, n)) if want_residuals else None
    A = np.empty(batch + (n, r)) if want_residuals else None
    with runtime.callback_blas_limit(flops=flops):
        for idx in np.ndindex(*batch):
            q, ld, ev, Mi, Ai = _host_one(M[idx], V[idx], want_residuals, symmetric)
            quad[idx], logdet[idx], event[idx] = q, ld, ev
            if want_residuals:
                Minv[idx] = Mi
                A[idx] = Ai
    if want_residuals:
        return quad, logdet, event, Minv, A
    return quad, logdet, event


def fill_lower_from_upper(G: np.ndarray, block: int = 128) -> np.ndarray:
    """Copy the upper triangle of square ``G`` into its lower triangle in place (temporaries of block x n).

    Completes the symmetric result of LAPACK routines that write one triangle (``dpotri``). Returns ``G``.
    """
    n = G.shape[0]
    for r0 in range(0, n, block):
        r1 = min(n, r0 + block)
        G[r0:r1, :r0] = G[:r0, r0:r1].T
        D = G[r0:r1, r0:r1]
        G[r0:r1, r0:r1] = np.triu(D) + np.triu(D, 1).T
    return G


def _shapes(n: int, r: int, residuals: bool):
    f64 = jnp.float64
    out = (jax.ShapeDtypeStruct((), f64), jax.ShapeDtypeStruct((), f64), jax.ShapeDtypeStruct((), jnp.int32))
    if residuals:
        out = out + (jax.ShapeDtypeStruct((n, n), f64), jax.ShapeDtypeStruct((n, r), f64))
    return out


def _outer_sum(A):
    """``A A^T`` for ``A`` (n, r): for a few columns as broadcast products, which XLA fuses with the consumer
    (one pass over the (n, n) result instead of a matrix product and a second pass)."""
    r = A.shape[-1]
    if r > 8:
        return A @ A.T
    return sum(A[:, i, None] * A[None, :, i] for i in range(r))


def _make_callback(symmetric: bool):
    """The callback path as a ``jax.custom_vjp`` function of (M, V); ``symmetric`` skips the symmetrisation."""
    value_host = functools.partial(_host_batched, want_residuals=False, symmetric=symmetric)
    forward_host = functools.partial(_host_batched, want_residuals=True, symmetric=symmetric)

    @jax.custom_vjp
    def fn(M, V):
        n, r = V.shape
        return jax.pure_callback(value_host, _shapes(n, r, False), M, V, vmap_method="broadcast_all")

    def fwd(M, V):
        n, r = V.shape
        quad, logdet, event, Minv, A = jax.pure_callback(
            forward_host, _shapes(n, r, True), M, V, vmap_method="broadcast_all"
        )
        return (quad, logdet, event), (Minv, A)

    def bwd(res, cts):
        Minv, A = res
        gq, gl, _ = cts
        return gl * Minv - gq * _outer_sum(A), 2.0 * gq * A

    fn.defvjp(fwd, bwd)
    return fn


_CALLBACK = {False: _make_callback(False), True: _make_callback(True)}


def callback_quad_logdet(M, V, symmetric: bool = False):
    """``(quad, logdet, event)`` of ``M`` (n, n) and ``V`` (n, r), LAPACK callback path (inputs checked by the
    caller). ``symmetric=True`` promises ``M`` is bitwise symmetric and skips the symmetrisation."""
    return _CALLBACK[bool(symmetric)](M, V)
