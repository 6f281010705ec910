"""XLA's backend optimisation level for GP-MSRM programs on a CPU: the setting, each backend's choice, and that a
program compiled at level 0 gives the density and gradient of one compiled at XLA's default."""
from __future__ import annotations

import numpy as np
import pytest

import data_synth
import msrm
from msrm import runtime


@pytest.fixture
def setting(monkeypatch):
    """Set ``xla_cpu_optimization`` for one test (restored afterwards)."""
    def set_(value):
        monkeypatch.setitem(runtime._STATE, "xla_cpu_optimization", value)
    return set_


def test_compiler_options_follow_the_setting(setting):
    setting("auto")
    assert runtime.compiler_options("cpu", 0) == {"xla_backend_optimization_level": 0}
    assert runtime.compiler_options("cpu", None) is None
    assert runtime.compiler_options("cuda", 0) is None  # never on an accelerator
    setting("default")
    assert runtime.compiler_options("cpu", 0) is None
    setting(2)
    assert runtime.compiler_options("cpu", None) == {"xla_backend_optimization_level": 2}
    assert runtime.execution_info()["xla_cpu_optimization"] == 2


@pytest.mark.parametrize("bad", ["fast", 4, -1, 1.0, True, None])
def test_bad_setting_is_named_before_anything_changes(bad):
    before = runtime.xla_cpu_optimization()
    with pytest.raises(ValueError, match="xla_cpu_optimization"):
        runtime.configure(xla_cpu_optimization=bad)
    assert runtime.xla_cpu_optimization() == before


def _models(**kw):
    data, truth = data_synth.synthetic_dataset("tiny", n_features=3, n_runs=2, seed=1)
    return data, truth, msrm.GPMSRM(data, truth.spec, **kw)


def test_each_backend_chooses_its_level(setting):
    setting("auto")
    _, _, host = _models(linear_algebra="state_space", method="callback")
    assert host.compiler_options == {"xla_backend_optimization_level": 0}
    _, _, scan = _models(linear_algebra="state_space", method="native")
    assert scan.compiler_options is None  # the scan itself is compiled: XLA's default
    _, _, grouped = _models(linear_algebra="grouped")
    assert grouped.compiler_options is None
    setting("default")
    assert _models(linear_algebra="state_space", method="callback")[2].compiler_options is None


@pytest.mark.parametrize("kw", [dict(linear_algebra="state_space", method="callback"),
                                dict(linear_algebra="grouped")])
def test_level_zero_keeps_the_density_and_gradient(setting, kw):
    setting(0)
    data, truth, fast = _models(**kw)
    assert fast.compiler_options == {"xla_backend_optimization_level": 0}
    setting("default")
    slow = msrm.GPMSRM(data, truth.spec, **kw)
    assert slow.compiler_options is None
    u = slow.unconstrain(truth.params) + 0.05 * np.random.default_rng(0).standard_normal(slow.num_params)
    v0, g0 = slow.value_and_grad(u)
    v1, g1 = fast.value_and_grad(u)
    assert abs(v1 - v0) <= 1e-12 * abs(v0)
    np.testing.assert_allclose(g1, g0, rtol=1e-10, atol=1e-10 * np.max(np.abs(g0)))
