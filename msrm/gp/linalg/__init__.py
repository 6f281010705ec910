r"""Guarded symmetric factorization with a custom reverse-mode rule.

The GP likelihoods need, for a symmetric positive definite ``M`` (n, n) and right-hand sides ``V`` (n,) or
(n, r), the two numbers

.. math::

    q = \operatorname{tr}(V^\top M^{-1} V), \qquad \ell = \log\lvert M \rvert,

and their derivatives. :func:`quad_logdet` is the single entry point::

    quad, logdet, event = quad_logdet(M, V, method="auto")

**Forward.** ``M`` is symmetrised, ``M_s = (M + M^T)/2``, then factorised ``M_s = L L^T``; ``A = M_s^{-1} V``
comes from two triangular solves against ``L``; ``q = sum(V * A)`` and ``ell = 2 sum(log diag L)``. A failed
Cholesky climbs the jitter ladder and, past its last rung, falls back to a clipped eigendecomposition; what ran
is returned as ``event`` (:mod:`.ladder`). The value is never NaN without ``event == -2`` (non-finite input)
saying why. Callers count events (the model's diagnostics counter); nothing is printed.

**Reverse mode** (``jax.custom_vjp``), with ``G_q``, ``G_l`` the cotangents of ``q`` and ``ell``:

.. math::

    \bar M = G_l\, M^{-1} - G_q\, A A^\top, \qquad \bar V = 2\, G_q\, A.

``M^{-1}`` is formed once from the factor, and only when a derivative is taken. ``\bar M`` is symmetric, which
is the derivative of the function of the symmetrised input (so finite differences in any direction agree). When
jitter or the fallback was used, the derivative is that of the regularised matrix with the regularisation held
fixed. ``event`` is an integer output and takes a ``float0`` cotangent.

Float64 only: both inputs must be float64 (call :func:`msrm.runtime.enable_x64` first).

Modules, by job:

* :mod:`.ladder`: the jitter ladder (:func:`jitter_levels`), the event codes and :func:`describe_event`
  (NumPy only);
* :mod:`.guard`: :func:`quad_logdet`, the method choice (:func:`resolve_method`) and the memory check;
* :mod:`.lapack`: the LAPACK host callback (``"callback"``);
* :mod:`.native`: the native JAX path (``"native"``, :func:`native_factor`) and :func:`small_cholesky`;
* :mod:`.compat`: workarounds for jaxlib's CPU runtime, gated on its version (:func:`per_item_on_cpu`).

:func:`callback_threads` and :func:`callback_thread_count` (the LAPACK callback's BLAS threads) live in
:mod:`msrm.runtime` and are re-exported here.

Names are resolved lazily (PEP 562): importing :mod:`msrm.gp.linalg.ladder` does not import JAX.
"""
from __future__ import annotations

import importlib

_LAZY = {
    # name: (module relative to this package, attribute)
    "quad_logdet": (".guard", "quad_logdet"),
    "resolve_method": (".guard", "resolve_method"),
    "METHODS": (".guard", "METHODS"),
    "jitter_levels": (".ladder", "jitter_levels"),
    "describe_event": (".ladder", "describe_event"),
    "N_JITTER": (".ladder", "N_JITTER"),
    "JITTER_BASE": (".ladder", "JITTER_BASE"),
    "EVENT_PLAIN": (".ladder", "EVENT_PLAIN"),
    "EVENT_EIGH_FALLBACK": (".ladder", "EVENT_EIGH_FALLBACK"),
    "EVENT_NONFINITE": (".ladder", "EVENT_NONFINITE"),
    "native_factor": (".native", "native_factor"),
    "small_cholesky": (".native", "small_cholesky"),
    "small_lower_solve": (".native", "small_lower_solve"),
    "small_upper_solve": (".native", "small_upper_solve"),
    "SMALL_CHOLESKY_MAX": (".native", "SMALL_CHOLESKY_MAX"),
    "per_item_on_cpu": (".compat", "per_item_on_cpu"),
    "callback_threads": ("msrm.runtime", "callback_threads"),
    "callback_thread_count": ("msrm.runtime", "callback_thread_count"),
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    mod = importlib.import_module(module, __name__ if module.startswith(".") else None)
    value = getattr(mod, attr)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
