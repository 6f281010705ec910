"""``quad_logdet``: the entry point of the guarded factorization, its method choice and its memory check.

:func:`quad_logdet` checks shapes and dtypes, resolves ``method`` (:func:`resolve_method`), checks memory on an
eager call, and hands the work to the LAPACK callback (:mod:`.lapack`) or the native JAX path (:mod:`.native`).
Both give the same value, event (:mod:`.ladder`) and gradient, under ``jit`` and ``vmap`` too.

**Methods.** ``"auto"`` picks ``"callback"`` when ``jax.default_backend() == "cpu"`` at trace time, and
``"native"`` otherwise; on a CPU with one usable core it picks ``"native"`` where the installed jaxlib's
callback needs two (:data:`.compat.CALLBACK_NEEDS_TWO_CPUS`).

**Memory.** On an eager call (no input is a ``jax.core.Tracer``) the peak bytes of one value+gradient,
:func:`msrm.gp.memory.predict_peak_bytes`, are checked against the memory free now
(:func:`msrm.gp.memory.check_factorization`), which refuses with a :class:`~msrm.gp.memory.MemoryGuardError`
suggesting ``linear_algebra='state_space'``. Inside a transformation (``jit``, ``grad``, ``vmap``) nothing is
read: free memory at trace time says nothing about the moment the compiled program runs. A caller that traces
``quad_logdet`` checks first, where it knows the sizes, with the same model (``GPMSRM`` does so at construction
through :func:`msrm.gp.memory.likelihood_peak_bytes`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ... import runtime
from .. import memory
from . import compat
from .lapack import callback_quad_logdet
from .native import native_quad_logdet

__all__ = ["METHODS", "resolve_method", "quad_logdet"]

METHODS = ("auto", "callback", "native")


def resolve_method(method: str) -> str:
    """The path ``method`` means here: ``"auto"`` becomes ``"callback"`` or ``"native"`` (module docstring).

    Raises:
        ValueError: ``method`` is not one of :data:`METHODS`.
    """
    if method not in METHODS:
        raise ValueError(f"quad_logdet: method must be one of {METHODS}, got {method!r}")
    if method == "auto":
        one_cpu = compat.CALLBACK_NEEDS_TWO_CPUS and runtime.physical_cores() < 2
        return "callback" if jax.default_backend() == "cpu" and not one_cpu else "native"
    return method


def _traced(*xs) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in xs)


def quad_logdet(M, V, *, method: str = "auto", guard_memory: bool = True, symmetric: bool = False):
    """Guarded ``(tr(V^T M^-1 V), log|M|, event)`` for symmetric positive definite ``M``.

    Args:
        M: (n, n) symmetric positive definite, float64 (read as ``(M + M^T)/2``).
        V: (n,) or (n, r) float64 right-hand sides.
        method: ``"auto"`` (callback on the CPU platform, native elsewhere), ``"callback"`` or ``"native"``.
        guard_memory: on an eager call, predict the peak bytes and refuse (``MemoryGuardError``) when they exceed
            free memory (or ``MSRM_MEMORY_LIMIT_BYTES``) before any numerics. Traced calls are the tracing
            caller's to check (module docstring).
        symmetric: the caller promises ``M`` is exactly (bitwise) symmetric, so ``(M + M^T)/2 == M`` and the
            symmetrisation pass is skipped (one (n, n) write less). The value, event and gradient are those of
            the default path for such an ``M``; for any other ``M`` the result is undefined.
    Returns:
        quad: () float64, ``sum(V * M^{-1} V)``.
        logdet: () float64, ``log|M|``.
        event: () int32 guard code (0 plain, k>0 jitter rung, -1 eigen fallback, -2 non-finite input).
    Raises:
        ValueError: wrong rank, shapes or dtype (checked before any numerics).
        MemoryGuardError: see ``guard_memory``.
    """
    method = resolve_method(method)
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
    if guard_memory and not _traced(M, V):
        memory.check_factorization(n, Vm.shape[1], device=None if method == "callback" else jax.devices()[0])
    if method == "callback":
        return callback_quad_logdet(M, Vm, bool(symmetric))
    return native_quad_logdet(M, Vm, bool(symmetric))
