"""The Laplace-beside-NUTS comparison (msrm_lab.bench.approximation): its marginal statistics against closed forms
on Gaussian draws, the reading of a posterior's groups, and one end-to-end run (slow)."""
from __future__ import annotations

import numpy as np
import pytest
import xarray as xr
from scipy.stats import norm

from msrm_lab.bench import approximation as ap


def test_interval_mass_is_the_level_when_the_draws_agree_and_the_normal_mass_when_too_narrow():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal(200_000)
    assert ap.central_interval_mass(ref, rng.standard_normal(200_000)) == pytest.approx(0.9, abs=0.005)
    # an approximation with half the sd: its 90% interval is +-0.5 * 1.645, which holds 2 Phi(0.822) - 1 of N(0, 1)
    narrow = 0.5 * rng.standard_normal(200_000)
    expected = 2 * norm.cdf(0.5 * norm.ppf(0.95)) - 1
    assert ap.central_interval_mass(ref, narrow) == pytest.approx(expected, abs=0.005)
    # shifted by 3 sd: the interval [2.18, 3.82] holds 1.5% of N(0, 1)
    assert ap.central_interval_mass(ref, narrow + 3.0) == pytest.approx(norm.cdf(3.82) - norm.cdf(2.18), abs=0.002)
    with pytest.raises(ValueError, match="level"):
        ap.central_interval_mass(ref, narrow, level=1.0)


def test_compare_marginals_reads_shift_width_and_effective_size_of_iid_draws():
    rng = np.random.default_rng(1)
    ref = 3.0 + 2.0 * rng.standard_normal((2, 20_000))
    app = 4.0 + 1.0 * rng.standard_normal(40_000)
    out = ap.compare_marginals(ref, app)
    assert out["mean_shift_in_nuts_sd"] == pytest.approx(0.5, abs=0.02)
    assert out["sd_ratio"] == pytest.approx(0.5, abs=0.01)
    # independent draws: the bulk ESS is the number of draws, R-hat is 1
    assert 0.9 * 40_000 < out["ess_bulk_ref"] < 1.1 * 40_000
    assert out["rhat_ref"] == pytest.approx(1.0, abs=0.01)
    with pytest.raises(ValueError, match="chains, draws"):
        ap.compare_marginals(ref.ravel(), app)


class _Draws:
    """The part of a Posterior that posterior_quantities reads: ``inference_data.posterior``."""

    def __init__(self, group):
        self.inference_data = type("IData", (), {"posterior": group})()


def test_posterior_quantities_reads_response_lengthscales_and_behavioural_noise_only():
    C, S = 2, 3
    rng = np.random.default_rng(2)
    dims = ("chain", "draw")
    group = xr.Dataset({
        "response|rating|lag": (dims, rng.random((C, S))),
        "response|physio|width": (dims, rng.random((C, S))),
        "lengthscales": (dims + ("factor",), rng.random((C, S, 2))),
        "noise_sd|b1|brain": (dims + ("b1_brain_feature",), rng.random((C, S, 4))),
        "noise_sd|r1|rating": (dims + ("r1_rating_feature",), rng.random((C, S, 1))),
        "loadings|r1|rating": (dims + ("r1_rating_feature", "factor"), rng.random((C, S, 1, 2))),
    })
    q = ap.posterior_quantities(_Draws(group))
    assert list(q) == ["lag/rating", "width/physio", "lengthscale[0]", "lengthscale[1]", "noise_sd/r1/rating[0]"]
    np.testing.assert_array_equal(q["lengthscale[1]"], group["lengthscales"].values[:, :, 1])
    np.testing.assert_array_equal(q["noise_sd/r1/rating[0]"], group["noise_sd|r1|rating"].values[:, :, 0])
    assert all(v.shape == (C, S) for v in q.values())


def test_unknown_profile_is_refused_before_any_numerics():
    with pytest.raises(ValueError, match="profile must be one of"):
        ap.approximation_rows("huge")
    with pytest.raises(ValueError, match="unknown setting"):
        ap.approximation_rows("smoke", num_chains=2)


@pytest.mark.slow
def test_a_short_nuts_run_compares_every_quantity_and_times_the_three_fits():
    import msrm

    msrm.runtime.enable_x64()
    rows = ap.approximation_rows("smoke", info={},
                                 nuts=dict(num_warmup=20, num_samples=20, num_chains=1, max_tree_depth=4))
    by = {}
    for r in rows:
        assert r["status"] == "measured"
        by.setdefault(r["metric"], []).append(r)
    fits = {r["params"]["fit"] for r in by["wall_s"]}
    assert fits == {"gp_map", "laplace_given_mode", "nuts"}
    assert by["approximation_over_gp_map"][0]["value"] > 1.0
    quantities = {r["params"]["quantity"] for r in by["sd_ratio"]}
    assert {"lengthscale[0]", "lag/rating"} <= quantities
    for r in by["nuts_mass_in_laplace_90"]:
        assert 0.0 <= r["value"] <= 1.0
        assert r["params"]["ess_bulk_ref"] > 0
