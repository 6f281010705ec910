"""Memory guard: prediction formula, free-memory sources, forced limits and the refusal message."""
from __future__ import annotations

import numpy as np
import pytest

from msrm.gp import memory
from msrm.gp.memory import MemoryGuardError, check_memory, predict_peak_bytes


def test_prediction_counts_matrices_and_panels():
    n, r = 2727, 3
    assert predict_peak_bytes(n, r) == 8 * (memory.PEAK_MATRICES * n * n + memory.PEAK_PANELS * n * r)
    assert predict_peak_bytes(n, r, extra=123) == predict_peak_bytes(n, r) + 123
    # quadratic in the dimension
    assert predict_peak_bytes(2000, 0) == 4 * predict_peak_bytes(1000, 0)
    for bad in (0, -3, 2.5, "10", True):
        with pytest.raises(ValueError, match="dim"):
            predict_peak_bytes(bad)
    with pytest.raises(ValueError, match="extra"):
        predict_peak_bytes(10, 1, extra=-1)


def test_available_bytes_host_matches_meminfo():
    avail = memory.available_bytes()
    assert avail is not None and avail > 0
    total = None
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemTotal:"):
                total = int(line.split()[1]) * 1024
    assert avail <= total


class _FakeGPU:
    platform = "gpu"

    def __init__(self, stats):
        self._stats = stats

    def memory_stats(self):
        return self._stats


def test_available_bytes_accelerator_uses_memory_stats():
    assert memory.available_bytes(_FakeGPU({"bytes_limit": 10_000, "bytes_in_use": 2_500})) == 7_500
    assert memory.available_bytes(_FakeGPU(None)) is None


def test_refuses_with_forced_limit_and_names_size_and_state_space():
    n = 20_000
    need = predict_peak_bytes(n, 3)
    with pytest.raises(MemoryGuardError) as err:
        check_memory(need, what="the grouped likelihood", dim=n, limit=10**6)
    msg = str(err.value)
    assert f"{need / 1e9:.2f} GB" in msg
    assert "20000" in msg and "state_space" in msg and "grouped likelihood" in msg
    assert isinstance(err.value, MemoryError) and isinstance(err.value, ValueError)
    # within the limit: returns the bytes
    assert check_memory(1000, what="x", limit=1000) == 1000


def test_environment_limit_and_precedence(monkeypatch):
    monkeypatch.setenv(memory.ENV_LIMIT, "5e5")
    with pytest.raises(MemoryGuardError, match=memory.ENV_LIMIT):
        check_memory(10**6, what="a dense solve", dim=300)
    # an explicit limit wins over the environment
    assert check_memory(10**6, what="a dense solve", limit=10**7) == 10**6
    monkeypatch.setenv(memory.ENV_LIMIT, "lots")
    with pytest.raises(ValueError, match=memory.ENV_LIMIT):
        check_memory(1, what="x")


def test_unknown_free_memory_does_not_refuse():
    assert check_memory(10**15, what="x", device=_FakeGPU(None)) == 10**15


def test_quad_logdet_refuses_before_numerics(monkeypatch):
    import msrm.runtime

    msrm.runtime.enable_x64()
    import jax.numpy as jnp

    from msrm.gp.linalg import quad_logdet

    monkeypatch.setenv(memory.ENV_LIMIT, "1000")
    M = jnp.asarray(np.eye(50))
    for method in ("callback", "native"):
        with pytest.raises(MemoryGuardError, match="dimension 50.*state_space"):
            quad_logdet(M, jnp.ones(50), method=method)
    # the guard can be switched off by the caller that has done its own accounting
    q, ld, ev = quad_logdet(M, jnp.ones(50), method="native", guard_memory=False)
    assert float(q) == pytest.approx(50.0) and int(ev) == 0


def test_prediction_covers_measured_peak_of_callback_value_and_grad():
    """The predicted peak bounds the measured resident peak of one warm value+gradient.

    n = 2048 makes every (n, n) buffer larger than glibc's largest mmap threshold (32 MiB), so each is its own
    mapping and the resident-size accounting is exact (smaller matrices come from the fragmented heap, where
    the resident peak also counts fragmentation)."""
    import msrm.runtime

    msrm.runtime.enable_x64()
    from msrm_lab.bench.linalg import memory_prediction_rows

    (row,) = memory_prediction_rows(2048, methods=("callback",))
    if row["status"] != "measured":
        pytest.skip(row["params"]["reason"])
    n = 2048
    assert row["value"] <= row["params"]["predicted_bytes"]
    # and it is not a vacuous bound: the factor and the inverse at least were really allocated
    assert row["value"] >= 3 * 8 * n * n


def test_check_peak_reads_the_backend_shape():
    peak = memory.PeakBytes(predict_peak_bytes(300), "the toy likelihood", dim=300)
    assert peak.suggestion == memory.SUGGESTION
    with pytest.raises(MemoryGuardError, match=r"toy likelihood \(dimension 300: .*state_space"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(memory.ENV_LIMIT, "1000")
            memory.check_peak(peak)
    no_dim = peak._replace(dim=None, suggestion="use a smaller toy")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(memory.ENV_LIMIT, "1000")
        with pytest.raises(MemoryGuardError, match=r"toy likelihood needs about .*smaller toy$"):
            memory.check_peak(no_dim)
    assert memory.check_peak(memory.PeakBytes(10, "x")) == 10
    with pytest.raises(ValueError, match="PeakBytes"):
        memory.check_peak((10, 3))
