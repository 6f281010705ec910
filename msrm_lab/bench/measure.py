"""Timing and memory measurement shared by every benchmark.

- :func:`warm_median`: run once (or more) to compile, then time repeats, synchronising JAX outputs
  (``jax.block_until_ready``) before each timer stops; returns the median and every sample.
- :func:`side_by_side`: several functions called in turn, so that the two sides of a ratio are timed under the
  same state of the machine.
- :class:`PeakMemory`: peak resident memory of this process during a block (Linux: the kernel's high-water mark
  ``VmHWM`` after resetting it through ``/proc/self/clear_refs``; elsewhere a sampling thread), plus the JAX
  device allocator's peak where the device reports one (GPU). Free heap memory the process keeps for reuse is
  returned to the system first (:func:`msrm.runtime.release_host_memory`), so the peak counts what the block
  itself touches.
- :func:`compile_seconds`: the JAX compile events (tracing, lowering to MLIR, XLA compile) reported through
  ``jax.monitoring`` while a block runs, each with the moment it ended, so that a caller can place them in the
  phases of what the block timed (:func:`msrm_lab.bench.nuts.timed_sample` takes them out of NUTS warm-up and
  sampling).
"""
from __future__ import annotations

import contextlib
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

__all__ = ["warm_median", "side_by_side", "PeakMemory", "block", "current_rss_bytes", "compile_seconds",
           "CompileEvents", "COMPILE_EVENTS"]

#: the ``jax.monitoring`` duration events that together make up one compilation: tracing to a jaxpr, lowering it to
#: an MLIR module, and the backend (XLA) compile
COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def block(x: Any) -> Any:
    """Wait for JAX computations in ``x`` (any pytree) to finish; a no-op for NumPy values."""
    if "jax" in sys.modules:
        import jax

        return jax.block_until_ready(x)
    return x


def warm_median(fn: Callable[[], Any], *, repeats: int = 3, warmup: int = 1) -> tuple[float, list[float]]:
    """Median wall seconds of ``fn()`` after ``warmup`` untimed calls (compilation), outputs synchronised."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        block(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        block(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def side_by_side(fns: dict[Any, Callable[[], Any]], repeats: int) -> dict[Any, list[float]]:
    """Wall seconds of every function in ``fns``, called in turn ``repeats`` times (one warm-up call each), so
    that every side of a ratio sees the same state of the machine; outputs synchronised."""
    for fn in fns.values():
        block(fn())
    times: dict[Any, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            block(fn())
            times[name].append(time.perf_counter() - t0)
    return times


def _status_kb(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def current_rss_bytes() -> int | None:
    kb = _status_kb("VmRSS")
    return None if kb is None else kb * 1024


def _device_peak() -> int | None:
    if "jax" not in sys.modules:
        return None
    import jax

    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:
        return None
    if not stats:
        return None
    return stats.get("peak_bytes_in_use")


class PeakMemory:
    """Context manager measuring the peak memory of a block.

    Attributes after exit:
        peak_rss_bytes: highest resident set size reached during the block.
        baseline_rss_bytes: resident set size when the block started.
        delta_bytes: ``peak_rss_bytes - baseline_rss_bytes`` (what the block added at its peak).
        device_peak_bytes: the JAX device allocator's peak (GPU), else None.
        method: "vmhwm" (kernel high-water mark) or "sampling".
    """

    def __init__(self, interval: float = 0.002):
        self.interval = interval
        self.peak_rss_bytes = self.baseline_rss_bytes = self.delta_bytes = None
        self.device_peak_bytes = None
        self.method = None

    def __enter__(self) -> "PeakMemory":
        # free heap memory kept for reuse (msrm.runtime host_memory="reuse") would hide what the block needs
        from msrm.runtime import release_host_memory

        release_host_memory()
        self.baseline_rss_bytes = current_rss_bytes()
        self._device_before = _device_peak()
        try:
            _CLEAR_REFS.write_text("5")  # reset VmHWM to the current RSS
            self.method = "vmhwm"
        except OSError:
            self.method = "sampling"
            self._stop = threading.Event()
            self._peak = self.baseline_rss_bytes or 0
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            rss = current_rss_bytes() or 0
            self._peak = max(self._peak, rss)
            time.sleep(self.interval)

    def __exit__(self, *exc) -> None:
        if self.method == "vmhwm":
            hwm = _status_kb("VmHWM")
            self.peak_rss_bytes = None if hwm is None else hwm * 1024
        else:
            self._stop.set()
            self._thread.join()
            self.peak_rss_bytes = max(self._peak, current_rss_bytes() or 0)
        if self.peak_rss_bytes is not None and self.baseline_rss_bytes is not None:
            self.delta_bytes = max(0, self.peak_rss_bytes - self.baseline_rss_bytes)
        self.device_peak_bytes = _device_peak()


@dataclass
class CompileEvents:
    """The compile events seen inside a :func:`compile_seconds` block.

    Attributes:
        events: ``(end, seconds)`` per event, ``end`` on the ``time.perf_counter`` clock (the moment JAX reported
            the event, which is when it finished), in the order they ended.
    """

    events: list = field(default_factory=list)

    @property
    def seconds(self) -> float:
        """Seconds of every event of the block."""
        return float(sum(d for _, d in self.events))

    def between(self, start: float, stop: float) -> float:
        """Seconds of the events that ended in ``(start, stop]`` (``time.perf_counter`` times), at most
        ``stop - start``: the compilation inside a window that a caller timed."""
        inside = sum(d for end, d in self.events if start < end <= stop)
        return float(min(inside, max(stop - start, 0.0)))


@contextlib.contextmanager
def compile_seconds() -> Iterator[CompileEvents]:
    """Collect JAX's compile events (:data:`COMPILE_EVENTS`) while the block runs.

    A listener is registered with ``jax.monitoring.register_event_duration_secs_listener`` for the block and removed
    after it. Yields a :class:`CompileEvents`, complete once the block has ended.
    """
    import jax.monitoring as monitoring

    out = CompileEvents()

    def listener(name, duration, **kwargs):
        if name in COMPILE_EVENTS:
            out.events.append((time.perf_counter(), float(duration)))

    monitoring.register_event_duration_secs_listener(listener)
    try:
        yield out
    finally:
        monitoring.unregister_event_duration_listener(listener)
