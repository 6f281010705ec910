"""The nuts_chain benchmark rows: tree depths from NumPyro's num_steps, and a tiny state-space chain's rows agree
with its own draws and sample stats."""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

import msrm.runtime
from msrm.gp.posterior import Record
from msrm_lab.bench import nuts as bench
from msrm_lab.bench.measure import CompileEvents

pytest.importorskip("numpyro")


def test_tree_depth_is_the_number_of_doublings():
    # NumPyro (numpyro/infer/hmc_util.py, build_tree): depth d after d doublings of 1, 2, 4, ... steps, the last
    # possibly stopped part-way, so 2**(d-1) <= num_steps <= 2**d - 1
    n = np.arange(1, 2**12, dtype=np.int64)
    np.testing.assert_array_equal(bench.tree_depths(n), np.floor(np.log2(n)).astype(int) + 1)
    np.testing.assert_array_equal(bench.tree_depths([1, 2, 3, 4, 7, 8, 1023]), [1, 2, 2, 3, 3, 4, 10])
    assert bench.tree_depths(np.array([[31, 63]])).shape == (1, 2)
    for bad in ([0, 3], [1.5], [-1]):
        with pytest.raises(ValueError, match="n_steps must be positive integers"):
            bench.tree_depths(np.asarray(bad))


def test_chain_statistics_of_known_sample_stats():
    n_steps = np.array([[1, 3, 7, 7, 15, 8]])
    warm = np.array([[1, 1, 3, 63, 31]])
    post = SimpleNamespace(
        sample_stats={"n_steps": n_steps, "step_size": np.full((1, 6), 0.25), "diverging": np.array([[0, 1, 0, 0, 0, 0]]),
                      "acceptance_rate": np.full((1, 6), 0.8)},
        warmup_n_steps=warm, summary=None, draws_u=np.arange(12.0).reshape(1, 6, 2),
        seconds_per_leapfrog=0.5, num_leapfrog_warmup=int(warm.sum()), timings={"warmup": 9.9})
    st = bench.chain_statistics(post, max_tree_depth=4)
    s = st["sampling"]
    assert s["histogram"] == {1: 1, 2: 1, 3: 2, 4: 2} and s["max_depth"] == 4
    assert s["mean_depth"] == pytest.approx(17 / 6) and s["median_depth"] == 3.0
    assert s["mean_steps"] == pytest.approx(41 / 6) and s["median_steps"] == 7.0 and s["total_steps"] == 41
    assert s["fraction_at_cap"] == pytest.approx(2 / 6)
    w = st["warmup"]
    assert w["histogram"] == {1: 2, 2: 1, 3: 0, 4: 0} and w["max_depth"] == 6  # a warm-up depth over this cap
    assert st["divergences"] == 1 and st["step_size"] == [0.25]
    assert st["seconds_per_leapfrog_warmup"] == pytest.approx(9.9 / 99)
    assert "ess_bulk_min" not in st


def test_compile_events_leave_warm_up_and_sampling_by_their_windows():
    # sample returned at 100 with total 10: initialisation (90, 91], warm-up (91, 93], sampling (93, 96]
    timings = {"initialisation": 1.0, "warmup": 2.0, "sampling": 3.0, "draw_conversion": 0.5, "total": 10.0}
    ev = CompileEvents(events=[(90.5, 0.3), (91.5, 0.4), (93.2, 0.5), (95.0, 0.25), (97.0, 1.0)])
    out, spl = bench.compile_free_phases(timings, 0.3, ev, returned=100.0)
    assert out["warmup"] == pytest.approx(1.6) and out["sampling"] == pytest.approx(2.25)
    assert out["compilation"] == pytest.approx(1.15)
    assert out["initialisation"] == 1.0 and out["total"] == 10.0 and timings["warmup"] == 2.0
    assert spl == pytest.approx(0.3 * 2.25 / 3.0)
    # a checkpoint between them moves the sampling window to (93.5, 96.5]
    out, _ = bench.compile_free_phases({**timings, "checkpoint": 0.5}, None, ev, returned=100.0)
    assert out["sampling"] == pytest.approx(2.75) and out["compilation"] == pytest.approx(0.65)


def test_timed_sample_books_the_compilation_of_a_first_run():
    from toy_model import ToyModel

    msrm.runtime.enable_x64()
    post = bench.timed_sample(ToyModel(seed=2), num_warmup=20, num_samples=20, max_tree_depth=3, seed=0,
                              init="prior", progress=False, diagnostics=False)
    t = post.timings
    assert t["compilation"] > 0 and t["warmup"] >= 0 and t["sampling"] >= 0
    wall = post.inference_data.posterior.attrs["timings"]
    wall = json.loads(wall) if isinstance(wall, str) else wall
    assert t["warmup"] + t["sampling"] + t["compilation"] == pytest.approx(wall["warmup"] + wall["sampling"])
    assert post.seconds_per_leapfrog == pytest.approx(t["sampling"] / post.num_leapfrog)
    with pytest.raises(ValueError, match="record: timed_sample"):
        bench.timed_sample(ToyModel(), record=Record(archive="x.nc"))


@pytest.fixture(scope="module")
def smoke_rows():
    msrm.runtime.enable_x64()
    return bench.chain_rows("smoke")


def _one(rows, metric, **params):
    got = [r for r in rows if r["metric"] == metric and all(r["params"].get(k) == v for k, v in params.items())]
    assert len(got) == 1, (metric, params, len(got))
    return got[0]


def test_smoke_chain_rows_are_consistent(smoke_rows):
    rows = smoke_rows
    cfg = bench.CHAIN_SIZES["smoke"]
    assert all(r["experiment"] == "nuts_chain" and r["params"]["linear_algebra"] == "state_space" for r in rows)
    assert all(r["status"] == "measured" for r in rows if not r["metric"].startswith("full_chain"))
    value = {(r["metric"], r["params"].get("nuts_phase"), r["params"].get("phase")): r["value"] for r in rows}
    for phase, n in (("sampling", cfg["num_samples"]), ("warmup", cfg["num_warmup"])):
        counts = [_one(rows, "iterations_at_tree_depth", nuts_phase=phase, depth=d)["value"]
                  for d in range(1, cfg["max_tree_depth"] + 1)]
        assert sum(counts) == n, phase
        depths = np.repeat(np.arange(1, cfg["max_tree_depth"] + 1), np.asarray(counts, dtype=int))
        assert value[("mean_tree_depth", phase, None)] == pytest.approx(depths.mean())
        assert value[("max_tree_depth_reached", phase, None)] == depths.max() <= cfg["max_tree_depth"]
        assert value[("num_leapfrog", phase, None)] == pytest.approx(value[("mean_steps", phase, None)] * n)
        assert 2 ** (depths.max() - 1) <= value[("max_steps", phase, None)] <= 2 ** depths.max() - 1
    spl = value[("seconds_per_leapfrog", "sampling", None)]
    assert spl == pytest.approx(value[("phase_seconds", None, "sampling")] / value[("num_leapfrog", "sampling", None)])
    bare = _one(rows, "potential_value_and_grad_median_s")
    assert len(bare["params"]["samples"]) == 2 * cfg["repeats"]
    assert _one(rows, "leapfrog_over_bare_gradient")["value"] == pytest.approx(spl / bare["value"])
    assert _one(rows, "step_size_after_adaptation")["value"] > 0
    ess = _one(rows, "ess_bulk_min")
    per_var = [r["value"] for r in rows if r["metric"] == "ess_bulk_min_by_variable"]
    assert per_var and min(per_var) == pytest.approx(ess["value"])
    per_hour = _one(rows, "ess_bulk_min_per_hour", basis="sampling")
    assert per_hour["value"] == pytest.approx(ess["value"] * 3600 / value[("phase_seconds", None, "sampling")])
    # the projection: measured seconds per leapfrog at the measured warm-up and sampling trajectory lengths
    proj = [r for r in rows if r["metric"].startswith("full_chain")]
    assert proj and all(r["status"] == "projected" for r in proj)
    secs = _one(rows, "full_chain_seconds", basis="measured_trajectories")
    want = spl * (value[("mean_steps", "warmup", None)] * 1000 + value[("mean_steps", "sampling", None)] * 1200)
    assert secs["value"] == pytest.approx(want)
    assert _one(rows, "full_chain_hours", basis="measured_trajectories")["value"] == pytest.approx(want / 3600)


def test_chain_rows_refuse_a_bad_profile_or_method():
    with pytest.raises(ValueError, match="profile must be one of"):
        bench.chain_rows("huge")
    with pytest.raises(ValueError, match="method must be"):
        bench.chain_rows("smoke", method="lapack")
