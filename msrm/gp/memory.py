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
likelihood's peak on it. These two functions are the one memory model of the node-space factorization: the guards
(:func:`check_factorization` for one factorization, the model's guard for the likelihood) and the benchmark that
measures the peak against the prediction (``msrm_lab.bench.linalg``, rows ``experiment="memory_prediction"``) all
call them.

The state-space backend has no factorization of the node space; its value+gradient holds (float64, per run with
``T`` sub-steps of ``M`` node slots, ``S = K Q`` states, ``N`` nodes, checkpointed chunks of ``c`` sub-steps)

* the step tables: the dense weights ``A`` (T, M, Q), the information factors (T, M, K, K) and the whitened data
  (T, M K), ``T M (Q + K^2 + K)`` numbers, in ``SS_TABLE_COPIES = 5`` copies: on the host the tables as the
  filter reads them and their adjoints, in XLA the tables, the adjoints handed back and the temporaries of
  building them (the weights are scattered into zeros and concatenated);
* the per-node arrays (information, factor, whitened data: ``N (K^2 + K)``) in ``SS_NODE_COPIES = 4`` copies;
* the scan's states: a mean and covariance at every chunk start (``n_chunks (S^2 + S)``) and, in the reverse
  pass, what each sub-step of a chunk kept (its covariance; the ``S x R`` products ``U`` and ``Uᵀ``'s adjoint
  at the update rank ``R = M K``; the ``S x d K`` SDE columns; six ``R x R`` factors of the absorb:
  ``S^2 + S (2 R + d K + 2) + 6 R^2``): every sub-step of a run scanned in one chunk, else two chunks at once
  (the one being reversed and the one recomputed next), three when the recomputation is pipelined on a second
  thread;
* in the associative scan instead of the states, every grid step's element (three S x S matrices) in
  ``SS_PARALLEL_COPIES = 4`` copies (the elements, the scan's partial combinations, and their adjoints).

:func:`state_space_peak_bytes` sums the tables and node arrays over runs (every run's adjoints live until the
gradient is assembled) and adds the largest run's states. Everything in it is linear in the grid length for the
sequential scan (``T M`` is about the node count; ``S`` and ``c`` do not grow with the run beyond ``sqrt(T)``
chunks), so a long single-stream run is bounded by its tables.

The guards run where the sizes are known, before JAX traces anything: the model at construction (on the
:class:`PeakBytes` its backend predicts, :func:`check_peak`), :func:`msrm.gp.linalg.quad_logdet` on an eager call.

Free memory is ``MemAvailable`` from ``/proc/meminfo`` on the CPU (psutil elsewhere) and ``bytes_limit -
bytes_in_use`` from ``device.memory_stats()`` on an accelerator. ``MSRM_MEMORY_LIMIT_BYTES`` (environment) or
``limit=`` forces a limit (tests use a small one). Nothing here imports JAX.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NamedTuple

__all__ = [
    "MemoryGuardError",
    "PEAK_MATRICES",
    "PEAK_PANELS",
    "ENV_LIMIT",
    "SUGGESTION",
    "dense_bytes",
    "predict_peak_bytes",
    "likelihood_peak_bytes",
    "SS_TABLE_COPIES",
    "SS_NODE_COPIES",
    "SS_PARALLEL_COPIES",
    "StateSpaceSizes",
    "state_space_peak_bytes",
    "check_factorization",
    "available_bytes",
    "memory_limit",
    "check_memory",
    "PeakBytes",
    "check_peak",
]

PEAK_MATRICES = 6
PEAK_PANELS = 3
SS_TABLE_COPIES = 5
SS_NODE_COPIES = 4
SS_PARALLEL_COPIES = 4
ENV_LIMIT = "MSRM_MEMORY_LIMIT_BYTES"
#: What the guard's refusal suggests when the caller names nothing better.
SUGGESTION = "use linear_algebra='state_space'"
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


class StateSpaceSizes(NamedTuple):
    """The sizes of one state-space run that its memory depends on (from its prepared tables).

    Fields:
        sub_steps: T, sub-steps of the scan (padded to whole chunks). slots: M, node slots per sub-step.
        n_states: S. n_factors: K. sde_states: d, SDE states per factor. n_nodes: N.
        chunk: sub-steps per checkpointed chunk. n_chunks: chunks.
        pipelined: the reverse pass recomputes the previous chunk on a second thread (two chunks held).
        parallel: the associative scan (every step's element held) instead of the sequential one.
    """

    sub_steps: int
    slots: int
    n_states: int
    n_factors: int
    sde_states: int
    n_nodes: int
    chunk: int
    n_chunks: int
    pipelined: bool = False
    parallel: bool = False


def state_space_peak_bytes(runs) -> tuple[int, int]:
    """Peak bytes of one value+gradient of the state-space likelihood over runs of these sizes.

    Per run (module docstring): ``8 (5 T M (Q + K^2 + K) + 4 N (K^2 + K))`` for the step tables and node
    arrays, summed over runs; plus the largest run's scan states, ``8 (n_chunks (S^2 + S) + h c (S^2 + S (2 R +
    d K + 2) + 6 R^2))`` with ``R = M K`` (``h`` = 1 for a single chunk, else 3 when pipelined and 2 when
    not) for the sequential scan,
    ``8 * 4 T (3 S^2 + 2 S)`` for the associative one.

    What it counts are the arrays (NumPy and XLA buffers); the process's resident memory adds the C
    allocator's slack and the compiled program, which the guard leaves to the margin of free memory.

    Args:
        runs: iterable of :class:`StateSpaceSizes`.
    Returns:
        (bytes, largest state dimension S).
    """
    tables, states, largest, count = 0, 0, 0, 0
    for r in runs:
        T = _check_count("sub_steps", r.sub_steps, 1)
        M = _check_count("slots", r.slots, 0)
        S = _check_count("n_states", r.n_states, 1)
        K = _check_count("n_factors", r.n_factors, 1)
        d = _check_count("sde_states", r.sde_states, 1)
        N = _check_count("n_nodes", r.n_nodes, 0)
        c = _check_count("chunk", r.chunk, 1)
        n_chunks = _check_count("n_chunks", r.n_chunks, 1)
        if S % K:
            raise ValueError(f"n_states ({S}) must be a multiple of n_factors ({K})")
        Q = S // K
        tables += SS_TABLE_COPIES * dense_bytes(T, M, Q + K * K + K) + SS_NODE_COPIES * dense_bytes(N, K * K + K)
        if r.parallel:
            held = SS_PARALLEL_COPIES * dense_bytes(T, 3 * S * S + 2 * S)
        else:
            R = M * K
            kept = S * S + S * (2 * R + d * K + 2) + 6 * R * R
            h = 1 if n_chunks == 1 else 3 if r.pipelined else 2
            held = dense_bytes(n_chunks, S * S + S) + h * dense_bytes(c, kept)
        states = max(states, held)
        largest = max(largest, S)
        count += 1
    if count == 0:
        raise ValueError("runs must name at least one run")
    return tables + states, largest


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
    suggestion: str = SUGGESTION,
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


class PeakBytes(NamedTuple):
    """A backend's predicted peak memory of one evaluation, the one shape the model's guard reads
    (:meth:`msrm.gp.backends.Backend.peak_bytes`, :meth:`~msrm.gp.backends.Backend.pointwise_peak_bytes`).

    Fields:
        nbytes: int, the predicted peak in bytes (e.g. :func:`likelihood_peak_bytes`,
            :func:`state_space_peak_bytes`).
        what: str, what would run and its sizes; the refusal message starts with it.
        dim: int or None, the largest dense factorization dimension (the message names its ``dim x dim``
            float64 matrices); None for a backend without one.
        suggestion: str, what to do instead; the refusal message ends with it.
    """

    nbytes: int
    what: str
    dim: int | None = None
    suggestion: str = SUGGESTION


def check_peak(peak: PeakBytes, *, device: Any = None) -> int:
    """:func:`check_memory` of a :class:`PeakBytes`: refuse (``MemoryGuardError``) when it does not fit, else
    return its bytes."""
    if not isinstance(peak, PeakBytes):
        raise ValueError(f"peak must be a msrm.gp.memory.PeakBytes, got {type(peak).__name__}")
    return check_memory(peak.nbytes, what=peak.what, suggestion=peak.suggestion, dim=peak.dim, device=device)
