"""Version gates of the jaxlib workarounds (msrm.gp.linalg.compat) and the per-item path they switch.

The gates are pure functions of a version triple, so each range is checked at its edges for versions other than
the installed one; the module flags must equal the gate at the installed version, and ``per_item_on_cpu`` must
take the loop exactly when the batched-LAPACK flag is on (and give the batched call's numbers either way).
"""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib.version
import numpy as np
import pytest

from msrm.gp.linalg import compat


def test_parse_version():
    assert compat.parse_version("0.10.2") == (0, 10, 2)
    assert compat.parse_version("0.12.0.1") == (0, 12, 0)
    assert compat.parse_version("0.11") == (0, 11, 0)
    assert compat.parse_version("0.10.3.dev20260101") == (0, 10, 3)
    with pytest.raises(ValueError, match="cannot read a jaxlib version"):
        compat.parse_version("unknown")
    assert compat.JAXLIB_VERSION == compat.parse_version(jaxlib.version.__version__)


def test_ranges_at_their_edges():
    # batched LAPACK: seen on 0.10.x, gone on 0.12.0 (0.11 unchecked, so still gated)
    assert compat.AFFECTED["batched_cpu_lapack"] == ((0, 10, 0), (0, 12, 0))
    for version, want in (((0, 9, 9), False), ((0, 10, 0), True), ((0, 10, 2), True), ((0, 11, 2), True),
                          ((0, 12, 0), False), ((0, 12, 1), False), ((1, 0, 0), False)):
        assert compat.affected("batched_cpu_lapack", version) is want, version
    # the two callback problems: no fixed version known, open above
    for name in ("callback_one_cpu", "callback_across_devices"):
        assert compat.AFFECTED[name][1] is None
        assert not compat.affected(name, (0, 9, 2))
        assert compat.affected(name, (0, 10, 0)) and compat.affected(name, (0, 12, 0)) and compat.affected(name, (2, 0, 0))
    with pytest.raises(KeyError):
        compat.affected("no_such_workaround")


def test_flags_are_the_gates_at_the_installed_version():
    v = compat.JAXLIB_VERSION
    assert compat.BATCHED_CPU_LAPACK_CAN_DEADLOCK == compat.affected("batched_cpu_lapack", v)
    assert compat.CALLBACK_NEEDS_TWO_CPUS == compat.affected("callback_one_cpu", v)
    assert compat.CALLBACK_ACROSS_DEVICES_CAN_DEADLOCK == compat.affected("callback_across_devices", v)


@pytest.mark.parametrize("flag", [True, False])
@pytest.mark.parametrize("batched", [True, False])
def test_per_item_loop_exactly_when_the_flag_is_on(monkeypatch, flag, batched):
    """Both settings of the flag, whatever jaxlib is installed: the same numbers; a loop only when on (CPU)."""
    monkeypatch.setattr(compat, "BATCHED_CPU_LAPACK_CAN_DEADLOCK", flag)
    rng = np.random.default_rng(5)
    A = jnp.asarray(rng.standard_normal((2, 3, 4, 4)) + 4 * np.eye(4))
    b = jnp.asarray(rng.standard_normal((2, 3, 4)))

    def fn(a, v):
        return jnp.linalg.solve(a, v[..., None])[..., 0]

    run = jax.jit(lambda a, v: compat.per_item_on_cpu(fn, a, v, batch_ndim=2, batched=batched))
    np.testing.assert_allclose(np.asarray(run(A, b)), np.asarray(fn(A, b)), rtol=1e-12)
    hlo = run.lower(A, b).as_text()
    if jax.default_backend() == "cpu":  # the LAPACK custom calls say how many batch axes they loop over
        assert batched_lapack_call(hlo) == (not flag)


def batched_lapack_call(hlo: str) -> bool:
    """Whether the lowered program holds a LAPACK custom call over leading batch axes (``num_batch_dims`` > 0)."""
    assert "lapack_" in hlo, "no LAPACK call in the program"
    return re.search(r'num_batch_dims = "[1-9]', hlo) is not None


def test_probe_tool_knows_every_gate_and_refuses_bad_arguments():
    """tools/probe_jaxlib.py has a probe for every gated workaround (the associative-scan and library probes on
    top), and rejects an unknown probe or a non-positive time limit before starting a subprocess."""
    path = Path(__file__).resolve().parent.parent / "tools" / "probe_jaxlib.py"
    spec = importlib.util.spec_from_file_location("probe_jaxlib", path)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    assert set(compat.AFFECTED) <= set(probe.PROBES)
    with pytest.raises(KeyError, match="unknown probe"):
        probe.run_probe("nothing", 10)
    with pytest.raises(ValueError, match="timeout"):
        probe.run_probe("batched_cpu_lapack", 0)
