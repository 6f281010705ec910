"""The measurement helpers measure what they claim (no timing assertions, only memory accounting and where compile
events fall)."""
import time

import numpy as np

from msrm_lab.bench.measure import CompileEvents, PeakMemory, compile_seconds, warm_median


def test_peak_memory_sees_a_large_temporary():
    with PeakMemory() as pm:
        x = np.ones(50_000_000 // 8 * 4)  # 200 MB
        x[::4096] = 2.0
        del x
    assert pm.delta_bytes is not None and pm.delta_bytes > 150e6
    with PeakMemory() as small:
        y = np.ones(1000)
        del y
    assert small.delta_bytes < 50e6


def test_warm_median_runs_warmup_and_repeats():
    calls = []
    med, times = warm_median(lambda: calls.append(1), repeats=4, warmup=2)
    assert len(calls) == 6 and len(times) == 4 and med >= 0


def test_compile_events_are_placed_by_when_they_ended():
    ev = CompileEvents(events=[(10.5, 0.25), (11.0, 0.5), (12.0, 2.0), (13.5, 1.0)])
    assert ev.seconds == 3.75
    assert ev.between(10.0, 11.0) == 0.75  # (start, stop]: the event ending at 11.0 is inside
    assert ev.between(11.0, 12.5) == 1.5  # the 2 s event ending at 12.0, capped at the window's length
    assert ev.between(13.5, 20.0) == 0.0 and ev.between(5.0, 5.0) == 0.0


def test_compile_seconds_hears_a_jit_compilation_inside_the_block_only():
    import jax

    x = np.arange(7.0)
    t0 = time.perf_counter()
    with compile_seconds() as compiled:
        jax.block_until_ready(jax.jit(lambda v: v * 3.0 + 1.0)(x))
    t1 = time.perf_counter()
    assert compiled.seconds > 0 and all(t0 <= end <= t1 for end, _ in compiled.events)
    n = len(compiled.events)
    jax.block_until_ready(jax.jit(lambda v: v * 5.0 - 2.0)(x))  # after the block: the listener is gone
    assert len(compiled.events) == n
