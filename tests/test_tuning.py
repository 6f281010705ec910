"""Per-machine choice of the state-space block length: the cost model, its coefficients (measured, cached, the
fallback, the override), the cache file and its key, and that every choice gives the same density."""
from __future__ import annotations

import importlib
import json

import numpy as np
import pytest

import data_synth
from msrm.gp.model import params_to_theta
from msrm.gp.reference import brute_force_loglik
from msrm.gp.state_space import loglik, prepare, tuning

spp = importlib.import_module("msrm.gp.state_space.prepare")


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty cache folder, measuring on, no override and no in-process memo."""
    monkeypatch.setenv("MSRM_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("MSRM_TUNING", raising=False)
    monkeypatch.setattr(tuning, "_MEMO", {})
    monkeypatch.setattr(tuning, "_machine_busy", lambda: False)
    tuning.set_coefficients(None)
    yield tmp_path
    tuning.set_coefficients(None)


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("MSRM_CACHE_DIR", str(tmp_path / "a"))
    assert tuning.cache_dir() == tmp_path / "a"
    monkeypatch.delenv("MSRM_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert tuning.cache_dir() == tmp_path / "x" / "msrm"


def test_machine_key_names_cpu_cores_blas_and_versions():
    key = tuning.machine_key()
    assert set(key) == {"cpu_model", "cpu_vector_level", "physical_cores", "blas", "msrm", "numpy"}
    assert key["physical_cores"] >= 1 and key["numpy"] == np.__version__


def test_measured_once_then_read_from_the_cache(fresh_cache):
    c = tuning.machine_coefficients()
    assert c.source == "measured" and len(c.gemm_s) == len(tuning.RANKS)
    path = tuning.cache_path()
    assert path.parent == fresh_cache and path.exists()
    obj = json.loads(path.read_text())
    assert obj["key"] == json.loads(json.dumps(tuning.machine_key()))
    tuning._MEMO.clear()  # a new process: read, not measured again
    cached = tuning.machine_coefficients()
    assert cached.source == "cached" and cached.gemm_s == pytest.approx(c.gemm_s)


def test_a_measurement_on_a_busy_machine_is_not_cached(fresh_cache, monkeypatch):
    monkeypatch.setattr(tuning, "_machine_busy", lambda: True)
    c = tuning.machine_coefficients()
    assert c.source == "measured_busy" and len(c.gemm_s) == len(tuning.RANKS)
    assert not tuning.cache_path().exists()
    assert tuning.machine_coefficients() is c  # measured once per process all the same
    monkeypatch.setattr(tuning, "_machine_busy", lambda: False)
    tuning._MEMO.clear()  # a later process on a quiet machine measures and caches
    assert tuning.machine_coefficients().source == "measured" and tuning.cache_path().exists()


def test_a_cache_file_of_another_machine_is_not_used(fresh_cache):
    path = tuning.cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    other = dict(tuning.machine_key(), cpu_model="another CPU")
    path.write_text(json.dumps(dict(key=other, coefficients=tuning.DEFAULT_COEFFICIENTS.as_dict())))
    assert tuning.machine_coefficients().source == "measured"


def test_tuning_off_uses_the_fallback_model_and_writes_nothing(fresh_cache, monkeypatch):
    monkeypatch.setenv("MSRM_TUNING", "off")
    assert tuning.machine_coefficients() is tuning.DEFAULT_COEFFICIENTS
    assert not any(fresh_cache.iterdir())
    monkeypatch.setenv("MSRM_TUNING", "sometimes")
    with pytest.raises(ValueError, match="MSRM_TUNING"):
        tuning.machine_coefficients()


def test_override_wins_and_is_recorded(fresh_cache):
    tuning.set_coefficients(tuning.DEFAULT_COEFFICIENTS)
    assert tuning.machine_coefficients().source == "override"
    data, truth = data_synth.synthetic_dataset("tiny", n_features=3, seed=3)
    assert prepare(data, truth.spec).runs[0].tables.block_source == "override"
    with pytest.raises(ValueError, match="coefficients"):
        tuning.set_coefficients({"call_s": 1.0})


def test_bad_coefficients_are_named():
    with pytest.raises(ValueError, match="call_s"):
        tuning.Coefficients(call_s=-1.0, pass_s=1e-9, gemm_s=(1e-9,), ranks=(4,))
    with pytest.raises(ValueError, match="gemm_s"):
        tuning.Coefficients(call_s=1e-6, pass_s=1e-9, gemm_s=(1e-9,), ranks=(4, 8))


def _coeffs(call_s, gemm_per_rank):
    return tuning.Coefficients(call_s=call_s, pass_s=1e-9, gemm_s=tuple(gemm_per_rank * r + 1e-9 for r in tuning.RANKS),
                               source="override")


def test_choice_follows_the_machine():
    """Dear fixed costs per sub-step favour long blocks, dear products favour short ones: the same run gets a
    different block length on a different machine."""
    data, truth = data_synth.synthetic_dataset("tiny", n_features=3, n_factors=3, duration_scale=4.0, seed=0)
    p = prepare(data, truth.spec, block=1)
    lay, t = p.runs[0].gp.layout, p.runs[0].tables
    ends = spp._window_ends(lay)
    opts = spp.StateSpaceOptions()
    overhead = spp.auto_block(lay, ends, 0, t.L, opts, _coeffs(1e-3, 1e-12))
    flops = spp.auto_block(lay, ends, 0, t.L, opts, _coeffs(1e-9, 1e-8))
    assert overhead.block > flops.block
    for choice in (overhead, flops):
        assert 1 <= choice.block <= min(tuning.MAX_BLOCK, lay.n_grid)
        assert choice.predicted_s == min(choice.candidates.values())


def test_schedule_shape_matches_the_built_tables():
    data, truth = data_synth.synthetic_dataset("tiny", n_features=3, n_factors=2, duration_scale=2.0, seed=1)
    for C in (1, 3, 8):
        t = prepare(data, truth.spec, block=C, checkpoint_every=0).runs[0].tables
        lay = prepare(data, truth.spec, block=C).runs[0].gp.layout
        n_sub, n_occ, S, n_nodes, recompute = spp.schedule_shape(lay, spp._window_ends(lay), C, 0, t.L,
                                                                 spp.StateSpaceOptions(checkpoint_every=0))
        occupied = np.concatenate([g.slot_local != g.n_g for g in t.groups], axis=1).any(axis=1)
        assert (n_sub, S, n_nodes, recompute) == (t.block_index.size, t.n_states, lay.n_nodes, False)
        assert n_occ == int(occupied.sum())


@pytest.mark.parametrize("source", ["default", "measured"])
def test_every_choice_keeps_the_density(source, fresh_cache, monkeypatch):
    if source == "default":
        monkeypatch.setenv("MSRM_TUNING", "off")
    data, truth = data_synth.synthetic_dataset("tiny", n_features=3, seed=2)
    theta = params_to_theta(truth.params)
    p = prepare(data, truth.spec, method="native")
    assert p.runs[0].tables.block_source == source
    ref = brute_force_loglik(data, truth.spec, truth.params)
    got = float(loglik(theta, p)[0])
    assert abs(got - ref) <= 1e-8 * abs(ref)


def test_pipeline_follows_the_machine(monkeypatch):
    from msrm.gp.state_space import host

    monkeypatch.setattr(host, "PIPELINE_MIN_WORK", None)
    dear_calls, dear_products = _coeffs(1e-3, 1e-12), _coeffs(1e-9, 1e-8)
    assert not host.pipeline_pays(335, 46.0, 5, dear_calls)
    assert host.pipeline_pays(335, 46.0, 5, dear_products)
    assert not host.pipeline_pays(335, 0.0, 5, dear_products)
    monkeypatch.setattr(host, "PIPELINE_MIN_WORK", 0.0)  # a fixed threshold overrides the model
    assert host.pipeline_pays(335, 46.0, 5, dear_calls)
