r"""Guarded symmetric factorization with a custom reverse-mode rule.

The GP likelihoods need, for a symmetric positive definite ``M`` (n, n) and right-hand sides ``V`` (n,) or
(n, r), the two numbers

.. math::

    q = \operatorname{tr}(V^\top M^{-1} V), \qquad \ell = \log\lvert M \rvert,

and their derivatives. :func:`quad_logdet` is the single entry point::

    quad, logdet, event = quad_logdet(M, V, method="auto")

**Forward.** ``M`` is symmetrised, ``M_s = (M + M^T)/2``, then factorised ``M_s = L L^T``; ``A = M_s^{-1} V``
comes from two triangular solves against ``L``; ``q = sum(V * A)`` and ``ell = 2 sum(log diag L)``.

**Guard (the jitter ladder).** If the plain Cholesky fails, rung k = 1..5 retries with
``M_s + eps_k I``, ``eps_k = 1e-10 * 10^k * mean(diag M_s)``: relative to the matrix's own scale, starting
about a hundred times above float64 rounding of an n ~ 10^3..10^4 factorization (n * 2.2e-16 ~ 1e-12) and
stopping at 1e-5, beyond which the jitter would change the likelihood by more than the noise floor the models
care about. If every rung fails, the **fallback** is an eigendecomposition ``M_s = Q diag(w) Q^T`` with the
eigenvalues clipped from below at the last rung's level, ``w_i <- max(w_i, 1e-5 mean(diag M_s))``; the clipped
matrix is positive definite by construction and is factorised again so the backward pass is uniform. What ran
is returned as ``event`` (int32):

====== ==========================================================================
event  meaning
====== ==========================================================================
0      plain Cholesky succeeded
k>0    jitter rung k was needed (``eps_k`` above)
-1     fallback: eigendecomposition with eigenvalue clipping (value finite)
-2     ``M`` or ``V`` held a non-finite entry; value is NaN for that stated reason
====== ==========================================================================

The value is never NaN without ``event == -2`` explaining why. Callers count events (the model's
diagnostics counter); nothing is printed.

**Reverse mode** (``jax.custom_vjp``), with ``G_q``, ``G_l`` the cotangents of ``q`` and ``ell``:

.. math::

    \bar M = G_l\, M^{-1} - G_q\, A A^\top, \qquad \bar V = 2\, G_q\, A.

``M^{-1}`` is formed once from the factor, and only when a derivative is taken: the callback path inverts the
factor in place (LAPACK POTRI) inside the forward pass of ``jax.vjp`` and keeps ``M^{-1}`` as the residual, so
the backward pass is one elementwise XLA expression and the factor never travels back to the host; the native
path forms it in the backward pass by two triangular inverses. The quadratic part needs only ``A``. ``\bar M`` is symmetric,
which is the derivative of the function of the symmetrised input (so finite differences in any direction
agree). When jitter or the fallback was used, the derivative is that of the regularised matrix with the
regularisation held fixed. ``event`` is an integer output and takes a ``float0`` cotangent.

**Platforms.** ``method="auto"`` picks ``"callback"`` when ``jax.default_backend() == "cpu"`` at trace time
and the process may use at least two CPUs, and ``"native"`` otherwise (with one CPU the callback can deadlock
in jaxlib 0.10's CPU runtime, see :func:`_resolve`). ``"callback"``: SciPy LAPACK ``dpotrf``/``dpotrs`` (value) and ``dpotri``
(differentiated forward pass) inside ``jax.pure_callback``, with BLAS threads limited by threadpoolctl to
:func:`msrm.runtime.blas_threads` (default: physical cores; a larger pool warns through
:func:`msrm.runtime.check_oversubscription`). ``"native"``: ``jnp.linalg.cholesky`` and triangular solves with
the same ladder as ``lax`` control flow. Both give the same value, event and gradient. Both work under
``jit`` and ``vmap`` (the callback uses ``vmap_method="broadcast_all"`` and loops over the batch on the host).

**Memory.** At trace time the peak bytes of one call are predicted (:func:`msrm.gp.memory.predict_peak_bytes`)
and checked against free memory (:func:`msrm.gp.memory.check_memory`), which refuses with a
:class:`~msrm.gp.memory.MemoryGuardError` suggesting ``linear_algebra='state_space'``.

Float64 only: both inputs must be float64 (call :func:`msrm.runtime.enable_x64` first).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import runtime
from . import memory

__all__ = [
    "quad_logdet",
    "jitter_levels",
    "describe_event",
    "potrf_potri_callback",
    "small_cholesky",
    "per_item_on_cpu",
    "SMALL_CHOLESKY_MAX",
    "callback_threads",
    "callback_thread_count",
    "N_JITTER",
    "JITTER_BASE",
    "EVENT_PLAIN",
    "EVENT_EIGH_FALLBACK",
    "EVENT_NONFINITE",
    "METHODS",
]

N_JITTER = 5
JITTER_BASE = 1e-10
EVENT_PLAIN = 0
EVENT_EIGH_FALLBACK = -1
EVENT_NONFINITE = -2
METHODS = ("auto", "callback", "native")

_THREAD_OVERRIDE: list[int] = []


def jitter_levels() -> np.ndarray:
    """Relative jitter of rungs 1..N_JITTER: ``1e-10 * 10^k`` (multiplied by ``mean(diag M)``). Shape (5,)."""
    return JITTER_BASE * 10.0 ** np.arange(1, N_JITTER + 1)


def describe_event(event: int) -> str:
    """A sentence saying what the guard did for one ``event`` code."""
    event = int(event)
    if event == EVENT_PLAIN:
        return "plain Cholesky"
    if 1 <= event <= N_JITTER:
        return f"jitter rung {event} (relative jitter {jitter_levels()[event - 1]:.0e} of mean diagonal)"
    if event == EVENT_EIGH_FALLBACK:
        return "eigendecomposition fallback with eigenvalue clipping"
    if event == EVENT_NONFINITE:
        return "non-finite input; value is NaN"
    raise ValueError(f"event must be in -2..{N_JITTER}, got {event}")


@contextlib.contextmanager
def callback_threads(n: int) -> Iterator[None]:
    """Temporarily give the LAPACK callback ``n`` BLAS threads (benchmarks sweep this).

    Process-wide, and read when the callback executes (JAX dispatch is asynchronous): block on the results
    inside the ``with`` block. Models use :func:`msrm.runtime.configure` (``blas_threads=``) instead.
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"callback_threads: n must be a positive integer, got {n!r}")
    _THREAD_OVERRIDE.append(n)
    try:
        yield
    finally:
        _THREAD_OVERRIDE.pop()


def callback_thread_count() -> int:
    """BLAS threads the LAPACK callback uses now: a :func:`callback_threads` override, else the runtime's."""
    return _THREAD_OVERRIDE[-1] if _THREAD_OVERRIDE else runtime.blas_threads()


@contextlib.contextmanager
def _blas_limit() -> Iterator[None]:
    n = callback_thread_count()
    if n > runtime.physical_cores():
        runtime.check_oversubscription(n, context="LAPACK callback")
    with runtime.blas_limit(n):
        yield


# ---------------------------------------------------------------------------------------------------------
# Host side (NumPy / SciPy LAPACK). Factors are kept as U = L^T in Fortran order so that L = U.T is a
# C-contiguous view handed back to JAX without a copy.
# ---------------------------------------------------------------------------------------------------------


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
    return _fill_lower_from_upper(Minv).T  # symmetric, so the transpose view is the same matrix in C order


def _host_batched(M, V, want_residuals: bool, symmetric: bool = False):
    """Loop over leading batch dims (``vmap_method='broadcast_all'``)."""
    M = np.asarray(M, dtype=np.float64)
    V = np.asarray(V, dtype=np.float64)
    batch = M.shape[:-2]
    n, r = V.shape[-2:]
    if not batch:  # no vmap: hand M^{-1} back without an extra (n, n) copy
        with _blas_limit():
            out = _host_one(M, V, want_residuals, symmetric)
        return out if want_residuals else out[:3]
    quad = np.empty(batch)
    logdet = np.empty(batch)
    event = np.empty(batch, dtype=np.int32)
    Minv = np.empty(batch + (n, n)) if want_residuals else None
    A = np.empty(batch + (n, r)) if want_residuals else None
    with _blas_limit():
        for idx in np.ndindex(*batch):
            q, ld, ev, Mi, Ai = _host_one(M[idx], V[idx], want_residuals, symmetric)
            quad[idx], logdet[idx], event[idx] = q, ld, ev
            if want_residuals:
                Minv[idx] = Mi
                A[idx] = Ai
    if want_residuals:
        return quad, logdet, event, Minv, A
    return quad, logdet, event


def _fill_lower_from_upper(G: np.ndarray, block: int = 128) -> np.ndarray:
    """Copy the upper triangle of square ``G`` into its lower triangle in place (temporaries of block x n)."""
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


# ---------------------------------------------------------------------------------------------------------
# Callback path
# ---------------------------------------------------------------------------------------------------------


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


_quad_logdet_callback = {False: _make_callback(False), True: _make_callback(True)}


def potrf_potri_callback(M: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(L, M^{-1})`` by LAPACK POTRF then POTRI inside ``jax.pure_callback`` (benchmarks and checks).

    Args:
        M: (n, n) symmetric positive definite float64.
    Returns:
        L (n, n) lower Cholesky factor (NaN if not positive definite), Minv (n, n) full symmetric inverse.
    """
    n = M.shape[-1]

    def one(Mi):
        from scipy.linalg import lapack

        U, info = lapack.dpotrf(Mi, lower=0, clean=1, overwrite_a=0)
        if info != 0:
            nan = np.full(Mi.shape, np.nan)
            return nan, nan
        Ui, _ = lapack.dpotri(U, lower=0, overwrite_c=0)
        return U.T, _fill_lower_from_upper(Ui).T

    def host(Mh):
        Mh = np.asarray(Mh, dtype=np.float64)
        with _blas_limit():
            if Mh.ndim == 2:
                return one(Mh)
            L = np.empty(Mh.shape)
            Minv = np.empty(Mh.shape)
            for idx in np.ndindex(*Mh.shape[:-2]):
                L[idx], Minv[idx] = one(Mh[idx])
        return L, Minv

    spec = jax.ShapeDtypeStruct((n, n), jnp.float64)
    return jax.pure_callback(host, (spec, spec), M, vmap_method="broadcast_all")


# ---------------------------------------------------------------------------------------------------------
# Native path (lax control flow, same ladder)
# ---------------------------------------------------------------------------------------------------------


#: Largest K for which :func:`small_cholesky` unrolls the factorization into elementwise operations.
SMALL_CHOLESKY_MAX = 12


def small_cholesky(A):
    """Lower Cholesky factors of a batch of small symmetric matrices ``A`` (..., K, K), as ``jnp.linalg.cholesky``
    (of the symmetrised input; NaN where a matrix is not positive definite).

    For ``K <= SMALL_CHOLESKY_MAX`` the column algorithm is unrolled into elementwise operations over the batch:
    no LAPACK call at all. This matters on XLA:CPU with jaxlib 0.10, whose batched LAPACK kernels split the batch
    over the intra-op thread pool from inside a pool thread and wait for the pieces: when as many such kernels run
    at once as the pool has threads (two host devices on two cores, or independent branches of one program), every
    thread waits for work only a waiting thread could do, and the program never finishes. For the node factors
    (K x K, K the number of factors) the unrolled form is also cheaper than a LAPACK call per node.
    Larger K falls back to ``jnp.linalg.cholesky``.
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


def per_item_on_cpu(fn, *args, batch_ndim: int = 1, batched: bool = True):
    """``fn`` over arrays whose leading ``batch_ndim`` axes are a batch.

    ``batched=True``: ``fn`` accepts any number of leading axes (``...`` broadcasting, batched ``jnp.linalg``
    calls); ``batched=False``: ``fn`` takes one item, and is vectorised with ``jax.vmap`` where that is wanted.
    On accelerators the whole batch goes through one call. On XLA:CPU the batch is flattened and ``fn`` runs on
    one item at a time (``lax.map``), so that every LAPACK call inside it is unbatched: jaxlib 0.10's batched CPU
    LAPACK kernels can deadlock the intra-op thread pool (see :func:`small_cholesky`). The platform is read at
    trace time (``jax.default_backend()``).
    """
    if batch_ndim == 0:
        return fn(*args)
    if jax.default_backend() != "cpu":
        if batched:
            return fn(*args)
        for _ in range(batch_ndim):
            fn = jax.vmap(fn)
        return fn(*args)
    leaves = jax.tree_util.tree_leaves(args)
    batch = leaves[0].shape[:batch_ndim]
    if any(x.shape[:batch_ndim] != batch for x in leaves):
        raise ValueError(f"per_item_on_cpu: every argument needs the batch shape {batch}")
    size = int(np.prod(batch)) if batch else 1
    flat = jax.tree_util.tree_map(lambda x: x.reshape((size,) + x.shape[batch_ndim:]), args)
    out = lax.map(lambda a: fn(*a), flat)
    return jax.tree_util.tree_map(lambda y: y.reshape(batch + y.shape[1:]), out)


def _chol_ok(L):
    return jnp.all(jnp.isfinite(jnp.diagonal(L)))


def _native_factor(Ms):
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
    L, event = _native_factor(M if symmetric else 0.5 * (M + M.T))
    B = jax.scipy.linalg.solve_triangular(L, V, lower=True)
    A = jax.scipy.linalg.solve_triangular(L, B, lower=True, trans=1)
    quad = jnp.sum(V * A)
    logdet = 2.0 * jnp.sum(jnp.log(jnp.diagonal(L)))
    event = jnp.where(jnp.all(jnp.isfinite(V)), event, jnp.int32(EVENT_NONFINITE)).astype(jnp.int32)
    quad = jnp.where(event == EVENT_NONFINITE, jnp.nan, quad)
    logdet = jnp.where(event == EVENT_NONFINITE, jnp.nan, logdet)
    return (quad, logdet, event), (L, A)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _quad_logdet_native(M, V, symmetric=False):
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


_quad_logdet_native.defvjp(lambda M, V, symmetric: _native_forward(M, V, symmetric), _native_bwd)


# ---------------------------------------------------------------------------------------------------------
# Public entry point
# ---------------------------------------------------------------------------------------------------------


def _resolve(method: str) -> str:
    if method not in METHODS:
        raise ValueError(f"quad_logdet: method must be one of {METHODS}, got {method!r}")
    if method == "auto":
        # One CPU: XLA's intra-op pool has a single worker, and the callback, which runs on it, can wait forever
        # for its own operands (seen with jaxlib 0.10 under ``taskset -c 0`` at the note's sizes); native JAX
        # has no callback.
        one_cpu = runtime.physical_cores() < 2
        return "callback" if jax.default_backend() == "cpu" and not one_cpu else "native"
    return method


def quad_logdet(M, V, *, method: str = "auto", guard_memory: bool = True, symmetric: bool = False):
    """Guarded ``(tr(V^T M^-1 V), log|M|, event)`` for symmetric positive definite ``M``.

    Args:
        M: (n, n) symmetric positive definite, float64 (read as ``(M + M^T)/2``).
        V: (n,) or (n, r) float64 right-hand sides.
        method: ``"auto"`` (callback on the CPU platform, native elsewhere), ``"callback"`` or ``"native"``.
        guard_memory: predict the peak bytes at trace time and refuse (``MemoryGuardError``) when they exceed
            free memory (or ``MSRM_MEMORY_LIMIT_BYTES``).
        symmetric: the caller promises ``M`` is exactly (bitwise) symmetric, so ``(M + M^T)/2 == M`` and the
            symmetrisation pass is skipped (one (n, n) write less). The value, event and gradient are those of
            the default path for such an ``M``; for any other ``M`` the result is undefined.
    Returns:
        quad: () float64, ``sum(V * M^{-1} V)``.
        logdet: () float64, ``log|M|``.
        event: () int32 guard code (0 plain, k>0 jitter rung, -1 eigen fallback, -2 non-finite input).
    Raises:
        ValueError: wrong rank, shapes or dtype (checked before any numerics).
    """
    method = _resolve(method)
    M = jnp.asarray(M)
    V = jnp.asarray(V)
    if M.ndim != 2 or M.shape[0] != M.shape[1]:
        raise ValueError(f"quad_logdet: M must be a square (n, n) matrix, got shape {M.shape}")
    if V.ndim not in (1, 2) or V.shape[0] != M.shape[0]:
        raise ValueError(f"quad_logdet: V must be (n,) or (n, r) with n = {M.shape[0]}, got shape {V.shape}")
    for name, x in (("M", M), ("V", V)):
        if x.dtype != jnp.float64:
            raise ValueError(
                f"quad_logdet: {name} must be float64 (call msrm.runtime.enable_x64() first), got {x.dtype}"
            )
    n = M.shape[0]
    Vm = V[:, None] if V.ndim == 1 else V
    if guard_memory:
        device = None if method == "callback" else jax.devices()[0]
        memory.check_memory(
            memory.predict_peak_bytes(n, Vm.shape[1]),
            what=f"the guarded factorization of dimension {n}",
            dim=n,
            device=device,
        )
    if method == "callback":
        return _quad_logdet_callback[bool(symmetric)](M, Vm)
    return _quad_logdet_native(M, Vm, bool(symmetric))
