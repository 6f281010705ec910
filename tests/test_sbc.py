"""Simulation-based calibration: rank and uniformity statistics against hand computations, a conjugate
normal-normal model calibrated and miscalibrated, the simulator's marginal moments, and one replication end to end."""
from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

import msrm
from data_synth.simulate_params import simulate_from_params
from msrm.operators import response_weights
from msrm.spec import latent_grid
from msrm_lab.bench import sbc


# ------------------------------------------------------------------------------------------ ranks and tests


def test_ranks_of_counts_draws_below_and_breaks_ties_at_random():
    rng = np.random.default_rng(0)
    truth = np.array([2.5, 0.0, 10.0])
    draws = np.array([[1.0, 1.0, 1.0], [3.0, 2.0, 2.0], [2.0, 3.0, 3.0], [0.0, 4.0, 4.0]])
    assert sbc.ranks_of(truth, draws, rng).tolist() == [3, 0, 4]
    # one tie: the rank is #below (1) or #below + 1, each about half the time
    tied = [int(sbc.ranks_of([2.0], np.array([[1.0], [2.0], [3.0]]), rng)[0]) for _ in range(2000)]
    assert set(tied) == {1, 2}
    assert abs(np.mean(tied) - 1.5) < 0.05
    with pytest.raises(ValueError, match="draws must be"):
        sbc.ranks_of([1.0, 2.0], np.zeros((4, 3)), rng)


def test_rank_histogram_and_chi_square_match_hand_computation():
    ranks = np.array([0, 1, 2, 3, 4, 5, 6, 7, 7, 7, 0, 4])  # L = 7, 4 bins of width 2
    counts = sbc.rank_histogram(ranks, 7, 4)
    assert counts.tolist() == [3, 2, 3, 4]
    stat, p = sbc.chi_square_uniform(counts)
    e = 12 / 4
    hand = sum((c - e) ** 2 / e for c in [3, 2, 3, 4])
    assert stat == pytest.approx(hand)
    assert p == pytest.approx(stats.chi2.sf(hand, 3))
    ref = stats.chisquare([3, 2, 3, 4])
    assert (stat, p) == pytest.approx((ref.statistic, ref.pvalue))
    with pytest.raises(ValueError, match="divisible"):
        sbc.rank_histogram(ranks, 7, 3)
    with pytest.raises(ValueError, match="must lie"):
        sbc.rank_histogram([8], 7, 4)


def test_ks_uniform_is_the_kstest_of_randomised_normalised_ranks():
    ranks = np.array([0, 3, 5, 9, 9, 1])
    stat, p = sbc.ks_uniform(ranks, 9, np.random.default_rng(5))
    u = (ranks + np.random.default_rng(5).random(6)) / 10
    ref = stats.kstest(u, "uniform")
    assert (stat, p) == pytest.approx((ref.statistic, ref.pvalue))


def test_uniform_band_is_the_binomial_interval():
    lo, hi = sbc.uniform_band(200, 10, 0.99)
    assert (lo, hi) == (stats.binom.ppf(0.005, 200, 0.1), stats.binom.ppf(0.995, 200, 0.1))


def _normal_normal_ranks(n: int, L: int, sd_factor: float, seed: int) -> np.ndarray:
    """theta ~ N(0, 1), y ~ N(theta, 1): the posterior is N(y / 2, 1 / 2); draws with sd scaled by sd_factor."""
    rng = np.random.default_rng(seed)
    ranks = np.empty(n, dtype=np.int64)
    for r in range(n):
        theta = rng.standard_normal()
        y = theta + rng.standard_normal()
        draws = y / 2 + sd_factor * math.sqrt(0.5) * rng.standard_normal((L, 1))
        ranks[r] = sbc.ranks_of([theta], draws, rng)[0]
    return ranks


def test_calibrated_posterior_passes_and_too_narrow_one_fails():
    L, B, n = 19, 10, 300
    good = _normal_normal_ranks(n, L, 1.0, seed=1)
    _, p_good = sbc.chi_square_uniform(sbc.rank_histogram(good, L, B))
    _, ks_good = sbc.ks_uniform(good, L, np.random.default_rng(2))
    assert p_good > 0.01 and ks_good > 0.01
    bad = _normal_normal_ranks(n, L, 0.5, seed=1)  # posterior sd too small by 2x: ranks pile up at both ends
    counts = sbc.rank_histogram(bad, L, B)
    _, p_bad = sbc.chi_square_uniform(counts)
    _, ks_bad = sbc.ks_uniform(bad, L, np.random.default_rng(2))
    assert p_bad < 1e-6 and ks_bad < 1e-3
    assert counts[0] + counts[-1] > 3 * n / B


# ------------------------------------------------------------------------------------------ the simulator


def test_simulator_has_the_model_marginal_moments():
    cfg = dict(sbc.SIZES["smoke"], duration=30.0, participants=1)
    template, spec = sbc.sbc_design(cfg)
    K = spec.n_factors
    W = {"p0/brain": np.array([[1.5], [-0.5], [0.0]]), "p0/rating": np.array([[0.8]])}
    b = {"p0/brain": np.array([1.0, -2.0, 0.5]), "p0/rating": np.array([3.0])}
    sd = {"p0/brain": np.array([0.5, 1.0, 2.0]), "p0/rating": np.array([0.3])}
    params = msrm.Params(W, b, sd, np.array([4.0] * K), {"rating": {"lag": 2.0}})
    N = 1500
    i_brain, i_rating = 7, 11  # brain samples sit on grid points (brain_dt is a multiple of latent_dt)
    yb = np.empty((N, 3))
    yr = np.empty(N)
    for s in range(N):
        data, latents = simulate_from_params(template, spec, params, seed=s)
        yb[s] = data.runs[0].stream("p0/brain").values[i_brain]
        yr[s] = data.runs[0].stream("p0/rating").values[i_rating, 0]
    grid = latent_grid(template.runs[0].duration, spec)
    assert latents[0].shape == (grid.size, K)
    var_b = (W["p0/brain"] ** 2).sum(1) + sd["p0/brain"] ** 2
    t_r = template.runs[0].stream("p0/rating").times[i_rating]
    a = response_weights([t_r], spec.response("rating"), {"lag": 2.0}, grid)[0]
    Kmat = msrm.kernels.get_kernel(spec.kernel).correlation(np.abs(grid[:, None] - grid[None, :]), 4.0, np)
    var_r = 0.8 ** 2 * a @ Kmat @ a + 0.3 ** 2
    # sample variance has sd var * sqrt(2 / N); the mean sd(y) / sqrt(N)
    np.testing.assert_array_less(np.abs(yb.var(0, ddof=1) - var_b), 4 * var_b * math.sqrt(2 / N))
    np.testing.assert_array_less(np.abs(yb.mean(0) - b["p0/brain"]), 4 * np.sqrt(var_b / N))
    assert abs(yr.var(ddof=1) - var_r) < 4 * var_r * math.sqrt(2 / N)
    assert abs(yr.mean() - 3.0) < 4 * math.sqrt(var_r / N)


def test_simulator_is_seeded_and_keeps_the_missing_pattern():
    cfg = dict(sbc.SIZES["smoke"], duration=20.0, participants=1)
    template, spec = sbc.sbc_design(cfg)
    vals = template.runs[0].stream("p0/brain").values.copy()
    vals[3, 1] = np.nan
    streams = [msrm.Stream("p0", "brain", 2.0, vals), template.runs[0].stream("p0/rating")]
    template = msrm.Dataset([msrm.Run(duration=20.0, streams=streams)])
    model = msrm.GPMSRM(template, spec, linear_algebra="state_space", priors=sbc.sbc_priors(template, spec))
    params = model.constrain(model.prior_draw(3))
    d1, z1 = simulate_from_params(template, spec, params, seed=4)
    d2, z2 = simulate_from_params(template, spec, params, seed=4)
    y1 = d1.runs[0].stream("p0/brain").values
    np.testing.assert_array_equal(y1, d2.runs[0].stream("p0/brain").values)
    np.testing.assert_array_equal(z1[0], z2[0])
    assert np.isnan(y1[3, 1]) and np.isfinite(np.delete(y1.ravel(), 3 * 3 + 1)).all()


# ------------------------------------------------------------------------------------------ end to end


def test_sbc_priors_are_the_defaults_at_unit_scale():
    template, spec = sbc.sbc_design(sbc.SIZES["smoke"])
    pr = sbc.sbc_priors(template, spec)
    for k in template.stream_keys:
        np.testing.assert_array_equal(pr.loading_sd[k], 1.0)
        np.testing.assert_array_equal(pr.intercept_sd[k], 2.0)
        np.testing.assert_array_equal(pr.log_noise_loc[k], 0.0)
    assert pr.log_lengthscale_loc == pytest.approx(math.log(10 * spec.latent_dt))


def test_smoke_laplace_end_to_end_with_a_failed_replication_recorded(monkeypatch):
    keep: dict = {}
    rows = sbc.sbc_rows("smoke", n_replications=1, methods=("laplace",), n_jobs=1, keep=keep, info={})
    (res,) = keep["replications"]
    assert res["error"] is None, res["error"]
    p_rows = [r for r in rows if r["metric"] == "chi_square_p"]
    names = {r["params"]["quantity"] for r in p_rows}
    assert {"lag/rating", "lengthscale[0]", "abs_loading/p0/brain[0]", "signed_latent[q2]"} <= names
    L, B = sbc.SIZES["smoke"]["num_draws"], sbc.SIZES["smoke"]["num_bins"]
    for r in p_rows:
        assert r["params"]["n_replications"] == 1 and sum(r["params"]["rank_counts"]) == 1
        assert len(r["params"]["rank_counts"]) == B and 0 <= res["ranks"][r["params"]["quantity"]] <= L
    (wall,) = [r for r in rows if r["metric"] == "wall_s_per_replication"]
    assert wall["value"] > 0 and wall["params"]["n_failed"] == 0
    fig = sbc.sbc_histograms(rows)
    assert len([a for a in fig.axes if a.has_data()]) == len(p_rows)

    broken = dict(sbc.SIZES["smoke"], kernel="no_such_kernel")
    monkeypatch.setitem(sbc.SIZES, "broken", broken)
    rows = sbc.sbc_rows("broken", n_replications=2, methods=("laplace",), n_jobs=1, info={})
    failed = [r for r in rows if r["metric"] == "replication_failed"]
    assert [r["params"]["replication"] for r in failed] == [0, 1]
    assert all(r["status"] == "error" and "no_such_kernel" in r["params"]["error"] for r in failed)
    assert not [r for r in rows if r["metric"] == "chi_square_p"]


def test_smoke_replications_in_parallel_processes_are_seeded_apart():
    keep: dict = {}
    rows = sbc.sbc_rows("smoke", n_replications=2, methods=("laplace",), n_jobs=2, keep=keep, info={})
    res = keep["replications"]
    assert [x["error"] for x in res] == [None, None], [x["error"] for x in res]
    assert [x["seed"] for x in res] == [0, 1]
    assert all(r["params"]["n_replications"] == 2 for r in rows if r["metric"] == "chi_square_p")


def test_a_spent_budget_stops_between_rounds_and_records_what_it_skipped(monkeypatch):
    import time

    from msrm_lab.budget import DEADLINE_ENV

    monkeypatch.setenv(DEADLINE_ENV, str(time.time() - 1.0))  # spent before the first round: that one still runs
    keep: dict = {}
    rows = sbc.sbc_rows("smoke", n_replications=3, methods=("laplace",), n_jobs=1, keep=keep, info={})
    assert [x["r"] for x in keep["replications"]] == [0]
    measured = [r for r in rows if r["metric"] == "chi_square_p" and r["status"] == "measured"]
    assert measured and all(r["params"]["n_replications"] == 1 and r["params"]["n_planned"] == 3 for r in measured)
    (skip,) = [r for r in rows if r["status"] == "not_yet_measured"]
    assert skip["metric"] == "chi_square_p" and skip["params"]["replications_skipped"] == 2
    assert skip["params"]["skipped_for"] == "time_budget" and "spent" in skip["params"]["reason"]


def test_rank_shape_reads_u_hump_and_shift():
    flat, u, hump = [10] * 5, [30, 5, 5, 5, 30], [2, 15, 36, 15, 2]
    high, low = [2, 4, 8, 16, 30], [30, 16, 8, 4, 2]
    assert sbc.rank_shape(u, 0.5) == "uniform"  # the test decides whether there is a departure at all
    assert sbc.rank_shape(flat, 0.001) == "non-uniform"
    assert sbc.rank_shape(u, 1e-6) == "too narrow" and sbc.rank_shape(hump, 1e-6) == "too wide"
    assert sbc.rank_shape(high, 1e-6) == "draws below the truth"
    assert sbc.rank_shape(low, 1e-6) == "draws above the truth"
    with pytest.raises(ValueError, match="histogram"):
        sbc.rank_shape([0, 0], 0.0)
    # two replications in twenty bins: the test's p-value is not read at all
    assert sbc.rank_shape([2] + [0] * 19, 1e-3) == "too few replications"
    assert sbc.rank_shape([5] * 4, 0.5) == "uniform" and sbc.rank_shape([4] * 4, 0.5) == "too few replications"


# ------------------------------------------------------------------------------------------ replication store


def test_a_store_continues_where_the_last_sitting_stopped(tmp_path):
    store = tmp_path / "results" / "here" / "note" / "calibration.replications"
    first: dict = {}
    sbc.sbc_rows("smoke", n_replications=2, methods=("laplace",), n_jobs=1, keep=first, info={}, store=store)
    key = sbc.store_key(sbc.SIZES["smoke"], "laplace", 0)
    assert sorted(p.name for p in (store / key).iterdir()) == ["laplace-00000.json", "laplace-00001.json"]

    again: dict = {}
    rows = sbc.sbc_rows("smoke", n_replications=3, methods=("laplace",), n_jobs=1, keep=again, info={},
                        store=store)
    res = {x["r"]: x for x in again["replications"]}
    assert sorted(res) == [0, 1, 2] and "store" not in res[2] and "store" in res[0]
    assert [res[r]["ranks"] for r in (0, 1)] == [x["ranks"] for x in first["replications"]]
    p_rows = [r for r in rows if r["metric"] == "chi_square_p"]
    assert p_rows and all(r["params"]["replications_by_origin"] == {"this machine's store": 2, "this sitting": 1}
                          and r["params"]["n_replications"] == 3 for r in p_rows)
    (wall,) = [r for r in rows if r["metric"] == "wall_s_per_replication"]
    assert len(wall["params"]["walls"]) == 3  # the store is this machine's: its walls count


def test_the_key_names_the_recipe_and_the_code_and_other_keys_are_pruned_from_the_own_store(tmp_path):
    cfg = sbc.SIZES["smoke"]
    key = sbc.store_key(cfg, "laplace", 0)
    assert sbc.store_key(dict(cfg, n_replications=999, num_bins=2, n_jobs=7), "laplace", 0) == key
    assert len({key, sbc.store_key(dict(cfg, num_warmup=31), "laplace", 0), sbc.store_key(cfg, "nuts", 0),
                sbc.store_key(cfg, "laplace", 1)}) == 4

    other = tmp_path / "results" / "there" / "note" / "calibration.replications"
    mine = tmp_path / "results" / "here" / "note" / "calibration.replications"
    sbc.sbc_rows("smoke", n_replications=1, methods=("laplace",), n_jobs=1, info={}, store=other)
    stale = mine / ("0" * 16)
    stale.mkdir(parents=True)
    (stale / "laplace-00000.json").write_text("{}")
    (other / ("f" * 16)).mkdir()
    keep: dict = {}
    rows = sbc.sbc_rows("smoke", n_replications=2, methods=("laplace",), n_jobs=1, keep=keep, info={}, store=mine,
                        reuse=(other, mine))
    assert not stale.exists() and (other / ("f" * 16)).is_dir()  # only this machine's store is pruned
    # a call for the other method keeps this method's replications of the same code
    sbc.sbc_rows("smoke", n_replications=0, methods=("nuts",), n_jobs=1, info={}, store=mine)
    assert (mine / key / "laplace-00001.json").is_file()
    assert sorted(p.name for p in (mine / key).iterdir()) == ["laplace-00001.json"]  # reused ones are not copied
    p_rows = [r for r in rows if r["metric"] == "chi_square_p"]
    assert all(r["params"]["replications_by_origin"] == {"there": 1, "this sitting": 1} for r in p_rows)
    (wall,) = [r for r in rows if r["metric"] == "wall_s_per_replication"]
    assert len(wall["params"]["walls"]) == 1  # another machine's wall time is not this one's


def test_a_damaged_store_file_is_skipped_by_name_and_run_again(tmp_path):
    key = sbc.store_key(sbc.SIZES["smoke"], "laplace", 0)
    (tmp_path / key).mkdir()
    bad = tmp_path / key / "laplace-00000.json"
    bad.write_text('{"r": 0, "method": "lap')
    with pytest.warns(RuntimeWarning, match="laplace-00000.json"):
        assert sbc.stored_replications([tmp_path], key, "laplace", 5) == {}
    bad.unlink()
    (tmp_path / key / "laplace-00007.json").write_text(
        '{"r": 7, "method": "laplace", "ranks": {"x": 1}, "wall_s": 1.0}')
    assert sbc.stored_replications([tmp_path], key, "laplace", 5) == {}  # beyond the replications asked for


def test_stored_walls_predict_the_first_round_under_a_spent_budget(tmp_path, monkeypatch):
    import time

    from msrm_lab.budget import DEADLINE_ENV

    store = tmp_path / "calibration.replications"
    sbc.sbc_rows("smoke", n_replications=1, methods=("laplace",), n_jobs=1, info={}, store=store)
    monkeypatch.setenv(DEADLINE_ENV, str(time.time() - 1.0))
    keep: dict = {}
    rows = sbc.sbc_rows("smoke", n_replications=3, methods=("laplace",), n_jobs=1, keep=keep, info={}, store=store)
    assert [x["r"] for x in keep["replications"]] == [0]  # a wall time is known, so no round starts
    (skip,) = [r for r in rows if r["status"] == "not_yet_measured"]
    assert skip["params"]["replications_skipped"] == 2


def test_code_digest_follows_the_bytes_of_every_file(tmp_path):
    from msrm_lab.provenance import code_digest

    f = tmp_path / "extra.py"
    f.write_text("a = 1\n")
    d1 = code_digest(f)
    assert code_digest(f) == d1 and len(d1) == 64
    f.write_text("a = 1  # a comment\n")
    assert code_digest(f) != d1


def test_the_command_line_reads_every_other_machines_store_and_writes_only_its_own(tmp_path, monkeypatch):
    from msrm_lab.notebooks.device import device_label

    own = tmp_path / device_label("cpu") / "smoke" / "calibration.replications"
    others = [tmp_path / label / "smoke" / "calibration.replications" for label in ("cpu-a-2c", "cpu-b-13c")]
    for folder in [own, *others, tmp_path / "cpu-c-4c" / "note" / "calibration.replications"]:
        folder.mkdir(parents=True)
    seen = {}

    def fake_rows(profile, *, store, reuse, keep, **kwargs):
        seen.update(profile=profile, store=store, reuse=reuse)
        keep["replications"] = []
        return []

    monkeypatch.setattr(sbc, "sbc_rows", fake_rows)
    assert sbc.main(["--profile", "smoke", "--results", str(tmp_path), "--methods", "laplace"]) == 0
    assert seen["store"] == own
    # every machine's store of the same profile, not another profile's; sbc_rows reads its own store first and
    # skips it among these
    assert list(seen["reuse"]) == sorted([own, *others])
    assert sbc.machine_stores(tmp_path, "note") == (tmp_path / "cpu-c-4c" / "note" / "calibration.replications",)
