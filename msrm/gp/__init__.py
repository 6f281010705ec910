"""GP-MSRM: JAX marginal likelihoods and their linear algebra.

Names are resolved lazily (PEP 562) so ``import msrm.gp`` stays cheap; add new exports to ``_LAZY``.
"""
from __future__ import annotations

import importlib

_LAZY = {
    # name: (submodule, attribute or None for the submodule itself)
    "backends": ("backends", None),
    "BACKENDS": ("backends", "BACKENDS"),
    "Backend": ("backends", "Backend"),
    "register_backend": ("backends", "register_backend"),
    "linalg": ("linalg", None),
    "memory": ("memory", None),
    "quad_logdet": ("linalg", "quad_logdet"),
    "MemoryGuardError": ("memory", "MemoryGuardError"),
    "check_memory": ("memory", "check_memory"),
    "predict_peak_bytes": ("memory", "predict_peak_bytes"),
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'msrm.gp' has no attribute {name!r}") from None
    mod = importlib.import_module(f".{module}", __name__)
    value = mod if attr is None else getattr(mod, attr)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
