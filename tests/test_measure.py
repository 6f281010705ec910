"""The measurement helpers measure what they claim (no timing assertions, only memory accounting)."""
import numpy as np

from msrm_lab.bench.measure import PeakMemory, warm_median


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
