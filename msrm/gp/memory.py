"""Memory guard for dense factorizations: predict the peak before running, refuse clearly when it will not fit.

A guarded factorization of dimension ``n`` with ``r`` right-hand sides holds, at its peak (the backward pass),

* ``PEAK_MATRICES = 6`` float64 (n, n) matrices: the input ``M``; its Cholesky factor ``L``; the inverse
  ``M^{-1}``; the runtime's copy of the residual when it leaves the LAPACK callback; the returned gradient
  buffer ``dM``; and one (n, n) temporary of the native path (``A A^T``, the symmetrised input, the
  triangular inverse). The callback path holds fewer: it inverts the factor in place, so its ``L`` and host
  ``M^{-1}`` share one buffer, and its backward pass is one elementwise expression;
* ``PEAK_PANELS = 3`` float64 (n, r) panels: ``V``, ``A = M^{-1} V`` and ``dV``;

so ``predict_peak_bytes(n, r) = 8 * (6 n^2 + 3 n r) + extra``. ``extra`` is for what the caller keeps alive
beside it (covariance assembly, sufficient statistics). :func:`likelihood_peak_bytes` builds the dense/grouped
likelihood's peak on it. These two functions are the one memory model: the guards (:func:`check_factorization`
for one factorization, the model's guard for the likelihood) and the benchmark that measures the peak against
the prediction (``msrm_lab.bench.linalg``, rows ``experiment="memory_prediction"``) all call them.

The guards run where the sizes are known, before JAX traces anything: the model at construction,
:func:`msrm.gp.linalg.quad_logdet` on an eager call.

Free memory is ``MemAvailable`` from ``/proc/meminfo`` on the CPU (psutil elsewhere) and ``bytes_limit -
bytes_in_use`` from ``device.memory_stats()`` on an accelerator. ``MSRM_MEMORY_LIMIT_BYTES`` (environment) or
``limit=`` forces a limit (tests use a small one). Nothing here imports JAX.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = [
    "MemoryGuardError",
    "PEAK_MATRICES",
    "PEAK_PANELS",
    "ENV_LIMIT",
    "dense_bytes",
    "predict_peak_bytes",
    "likelihood_peak_bytes",
    "check_factorization",
    "available_bytes",
    "memory_limit",
    "check_memory",
]

PEAK_MATRICES = 6
PEAK_PANELS = 3
ENV_LIMIT = "MSRM_MEMORY_LIMIT_BYTES"
_GB = 1e9
_FLOAT64_BYTES = 8


class MemoryGuardError(MemoryError, ValueError):
    """A computation would need more memory than is free; the message names the size and what to do instead."""


def _check_count(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int,)) and not hasattr(value, "__index__"):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def dense_bytes(*shape: int) -> int:
    """Bytes of one float64 array of ``shape``, e.g. ``dense_bytes(n, n)`` for an (n, n) matrix."""
    count = 1
    for d in shape:
        count *= _check_count("shape", d, 0)
    return _FLOAT64_BYTES * count


def predict_peak_bytes(dim: int, n_rhs: int = 1, extra: int = 0) -> int:
    """Peak bytes of one guarded factorization value+gradient: ``8 (6 dim^2 + 3 dim n_rhs) + extra``.

    Args:
        dim: matrix dimension n (e.g. nodes x factors).
        n_rhs: right-hand-side columns r.
        extra: bytes the caller holds alive at the same time.
    """
    dim = _check_count("dim", dim, 1)
    n_rhs = _check_count("n_rhs", n_rhs, 0)
    extra = _check_count("extra", extra, 0)
    return PEAK_MATRICES * dense_bytes(dim, dim) + PEAK_PANELS * dense_bytes(dim, n_rhs) + extra


def likelihood_peak_bytes(node_counts, n_factors: int) -> tuple[int, int]:
    """Peak bytes of one value+gradient of the dense/grouped GP likelihood over runs with these node counts.

    Every run keeps its factor of ``M`` (``(N K)^2``), the node covariances ``C_k`` (``K N^2``) and one
    temporary of each alive across the backward pass (``8 (2 (N K)^2 + 2 K N^2)`` bytes a run); on top of that
    the largest run's guarded factorization (:func:`predict_peak_bytes` with one right-hand side).

    Returns:
        (bytes, largest factorization dimension N K).
    """
    K = _check_count("n_factors", n_factors, 1)
    extra, largest = 0, 0
    for N in node_counts:
        N = _check_count("node count", N, 1)
        extra += 2 * dense_bytes(N * K, N * K) + 2 * dense_bytes(K, N, N)
        largest = max(largest, N * K)
    if largest == 0:
        raise ValueError("node_counts must name at least one run")
    return predict_peak_bytes(largest, 1, extra=extra), largest


def check_factorization(dim: int, n_rhs: int = 1, *, device: Any = None) -> int:
    """Refuse (``MemoryGuardError``) one guarded factorization of dimension ``dim`` that would not fit.

    :func:`check_memory` of :func:`predict_peak_bytes` ``(dim, n_rhs)``; returns the predicted bytes.

    Args:
        dim: matrix dimension n. n_rhs: right-hand-side columns r.
        device: where it would run (``None``: host).
    """
    return check_memory(predict_peak_bytes(dim, n_rhs), what=f"the guarded factorization of dimension {dim}",
                        dim=dim, device=device)


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # pragma: no cover - psutil absent
        return None


def available_bytes(device: Any = None) -> int | None:
    """Free bytes on ``device`` (``None`` or a CPU device: host memory), or ``None`` if unknown.

    Args:
        device: a ``jax.Device`` or ``None``. Accelerators report ``bytes_limit - bytes_in_use`` from
            ``device.memory_stats()``; a device without statistics gives ``None``.
    """
    if device is None or getattr(device, "platform", "cpu") == "cpu":
        return _meminfo_available()
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def memory_limit(limit: int | None = None, device: Any = None) -> tuple[int | None, str]:
    """The limit that applies and where it came from: ``limit=``, then ``MSRM_MEMORY_LIMIT_BYTES``, then free memory."""
    if limit is not None:
        return _check_count("limit", limit, 0), "limit argument"
    env = os.environ.get(ENV_LIMIT)
    if env not in (None, ""):
        try:
            return _check_count(ENV_LIMIT, int(float(env)), 0), ENV_LIMIT
        except ValueError as exc:
            raise ValueError(f"{ENV_LIMIT} must be a byte count, got {env!r}") from exc
    where = "free device memory" if device is not None and getattr(device, "platform", "cpu") != "cpu" else (
        "available host memory"
    )
    return available_bytes(device), where


def check_memory(
    nbytes: int,
    *,
    what: str,
    suggestion: str = "use linear_algebra='state_space'",
    limit: int | None = None,
    dim: int | None = None,
    device: Any = None,
) -> int:
    """Refuse (``MemoryGuardError``) when ``nbytes`` exceeds the limit; return ``nbytes`` otherwise.

    Args:
        nbytes: predicted peak bytes (:func:`predict_peak_bytes`).
        what: what would run, e.g. ``"the grouped likelihood"``; goes into the message.
        suggestion: what to do instead; goes into the message.
        limit: bytes; overrides ``MSRM_MEMORY_LIMIT_BYTES`` and free memory.
        dim: the requested factorization dimension, named in the message.
        device: where it would run (``None``: host).
    """
    nbytes = _check_count("nbytes", nbytes, 0)
    if not isinstance(what, str) or not what:
        raise ValueError("check_memory: what must be a non-empty string")
    cap, source = memory_limit(limit, device)
    if cap is None or nbytes <= cap:
        return nbytes
    if device is None and limit is None:
        # host memory kept by the allocator's reuse mode (msrm.runtime.set_host_memory) is free to this
        # process but not counted as available by the system: hand it back and look again before refusing
        from .. import runtime

        runtime.release_host_memory()
        cap, source = memory_limit(limit, device)
        if cap is None or nbytes <= cap:
            return nbytes
    dim_txt = f" (dimension {dim}: {dim} x {dim} float64 matrices)" if dim is not None else ""
    raise MemoryGuardError(
        f"{what}{dim_txt} needs about {nbytes / _GB:.2f} GB at its peak, but only {cap / _GB:.2f} GB is "
        f"allowed ({source}); {suggestion}"
    )
