"""The recovery benchmark (msrm_lab.bench.recovery): the smoke profile end to end, failures kept as rows."""
from __future__ import annotations

import math

import numpy as np
import pytest

from msrm_lab.bench import recovery as bench


def _by(rows, **want):
    return [r for r in rows if all((r["params"].get(k) if k != "metric" else r["metric"]) == v
                                   for k, v in want.items())]


def _one(rows, **want):
    found = _by(rows, **want)
    assert len(found) == 1, (want, found)
    return found[0]


def test_unknown_profile_is_refused():
    with pytest.raises(ValueError, match="profile"):
        bench.recovery_rows("huge")


def test_map_start_moves_lags_and_widths_inside_their_bounds():
    import msrm

    spec = msrm.ModelSpec(n_factors=1, latent_dt=1.0, responses={
        "brain": msrm.Identity(), "rating": msrm.GaussianLag(width=1.0, lag_bounds=(0.0, 6.0)),
        "physio": msrm.GaussianWidthLag(lag_bounds=(0.0, 6.0), width_bounds=(0.3, 3.0))})
    W = {"p/brain": np.ones((2, 1)), "p/rating": np.ones((1, 1)), "p/physio": np.ones((1, 1))}
    params = msrm.Params(loadings=W, intercepts={k: np.zeros(len(w)) for k, w in W.items()},
                         noise_sd={k: np.ones(len(w)) for k, w in W.items()}, lengthscales=np.array([3.0]),
                         response={"rating": {"lag": 0.0}, "physio": {"lag": 2.0, "width": 0.3}})
    moved = bench.map_start(params, spec).response
    assert moved["rating"]["lag"] == pytest.approx(6e-6) and moved["physio"]["lag"] == 2.0
    assert moved["physio"]["width"] == pytest.approx(0.3 + 2.7e-6)


def test_a_failed_peer_gives_a_row_and_the_rest_runs(monkeypatch):
    """One peer unavailable, one raising, one working with NaN beyond its span: three rows, no exception."""
    import msrm_lab.peers as peers

    def fake(name, data, spec, seed=0):
        import msrm

        if name == "srm":
            return peers.PeerResult(name, False, "not installed: brainiak", [], 0.0, {})
        if name == "gpfa":
            raise RuntimeError("peer crashed")
        rng = np.random.default_rng(seed)
        lat = []
        for run in data.runs:
            z = rng.normal(size=(msrm.latent_grid(run.duration, spec).size, spec.n_factors))
            z[:3] = np.nan  # undefined before the first sample, as a peer reports it
            lat.append(z)
        return peers.PeerResult(name, True, None, lat, 0.1, {})

    monkeypatch.setattr(peers, "run_peer", fake)
    monkeypatch.setitem(bench.SIZES, "unit", dict(bench.SIZES["smoke"], methods=("srm", "gpfa", "pca_spline"),
                                                  cv_seeds=(0,)))
    rows = bench.recovery_rows("unit", info={})
    assert _one(rows, metric="ok", method="srm")["value"] == 0.0
    assert "brainiak" in _one(rows, metric="ok", method="srm")["params"]["error"]
    gpfa = _one(rows, metric="ok", method="gpfa")
    assert gpfa["value"] == 0.0 and "peer crashed" in gpfa["params"]["error"]
    err = _one(rows, metric="subspace_error", method="pca_spline")["value"]
    assert 0.0 < err <= 1.0  # random latents: far from the truth, but a finite score
    for r in _by(rows, metric="heldout_r2"):
        assert r["status"] == "not_yet_measured" and "peer" in r["params"]["reason"]
    assert not _by(rows, metric="subspace_error", method="srm")


def test_a_method_restricted_to_some_seeds_says_so(monkeypatch):
    import msrm_lab.peers as peers

    monkeypatch.setattr(peers, "run_peer", lambda name, data, spec, seed=0: peers.PeerResult(name, False, "x"))
    monkeypatch.setitem(bench.SIZES, "unit", dict(bench.SIZES["smoke"], methods=("fa_spline", "mefisto"),
                                                  seeds=(0, 1), cv_seeds=(), method_seeds={"mefisto": (1,)}))
    rows = bench.recovery_rows("unit", info={})
    skip = _one(rows, metric="ok", method="mefisto", seed=0)
    assert skip["status"] == "not_yet_measured" and "seeds [1]" in skip["params"]["reason"]
    assert _one(rows, metric="ok", method="mefisto", seed=1)["value"] == 0.0
    assert len(_by(rows, metric="ok", method="fa_spline")) == 2


def test_rmsrm_and_pca_give_finite_metrics_on_the_small_design(monkeypatch):
    """The fast part of the smoke profile (no GP, no cross-validation): both methods scored against the truth."""
    monkeypatch.setitem(bench.SIZES, "unit", dict(bench.SIZES["smoke"], methods=("pca_spline", "rmsrm"),
                                                  cv_seeds=()))
    rows = bench.recovery_rows("unit", info={})
    for method in ("rmsrm", "pca_spline"):
        assert _one(rows, metric="ok", method=method)["value"] == 1.0, method
        err = _one(rows, metric="subspace_error", method=method)["value"]
        assert math.isfinite(err) and 0.0 <= err < 0.5, (method, err)  # the small design is easy
        r2 = _one(rows, metric="aligned_r2_mean", method=method)["value"]
        assert 0.5 < r2 <= 1.0, (method, r2)
    lag = _one(rows, metric="abs_error_rating_lag", method="rmsrm")
    assert math.isfinite(lag["value"]) and lag["params"]["modality"] == "rating"
    assert not _by(rows, metric="abs_error_rating_lag", method="pca_spline")  # a peer has no response


@pytest.fixture(scope="module")
def smoke_rows():
    keep = {}
    rows = bench.recovery_rows("smoke", info={}, keep=keep)
    return rows, keep


def test_smoke_profile_end_to_end(smoke_rows):
    rows, keep = smoke_rows
    assert {r["notebook"] for r in rows} == {"recovery"}
    for method in ("rmsrm", "pca_spline", "gp_map"):
        assert _one(rows, metric="ok", method=method)["value"] == 1.0, method
        err = _one(rows, metric="subspace_error", method=method)["value"]
        assert math.isfinite(err) and 0.0 <= err < 0.5, (method, err)  # the small design is easy
        r2 = _one(rows, metric="aligned_r2_min", method=method)["value"]
        assert 0.5 < r2 <= 1.0, (method, r2)
    for metric in ("abs_error_rating_lag", "abs_error_physio_lag", "abs_error_physio_width"):
        v = _one(rows, metric=metric, method="rmsrm")["value"]
        assert math.isfinite(v) and v >= 0.0
    cov = _one(rows, metric="band_coverage_90", method="gp_map")["value"]
    assert 0.0 <= cov <= 1.0
    frame = _one(rows, metric="band_coverage_90_frame", method="gp_map")
    assert 0.0 <= frame["value"] <= 1.0 and frame["params"]["alignment"] == "loadings"
    # the fusion check's brain-only R-MSRM fit is scored against the same truth on the same grid
    brain = _one(rows, metric="subspace_error", method="rmsrm_brain")["value"]
    assert math.isfinite(brain) and 0.0 <= brain < 0.5
    assert _one(rows, metric="converged", method="rmsrm_brain")["value"] == 1.0
    # GP-MAP took the default path: kernel="auto" chose one of the candidates
    from msrm.gp.kernel_choice import DEFAULT_KERNELS

    assert _one(rows, metric="kernel_chosen", method="gp_map")["params"]["kernel"] in DEFAULT_KERNELS
    held = [r for r in _by(rows, metric="heldout_r2", method="rmsrm") if r["status"] == "measured"]
    assert held and all(math.isfinite(r["value"]) for r in held)
    # held-out scores per modality (the features mask holds out brain features only), naive baseline beside
    assert [r["params"]["modality"] for r in held] == ["brain"]
    lpd = _one(rows, metric="heldout_lpd", method="rmsrm", modality="brain")
    naive = _one(rows, metric="heldout_lpd_naive", method="rmsrm", modality="brain")
    assert lpd["params"]["n_heldout"] == naive["params"]["n_heldout"] > 0 and math.isfinite(naive["value"])
    for metric in ("heldout_coverage_50", "heldout_coverage_90"):
        assert 0.0 <= _one(rows, metric=metric, method="rmsrm", modality="brain")["value"] <= 1.0
    # both MSRM fits ran to convergence, GP-MAP within fit_map's default iteration limit
    for method in ("rmsrm", "gp_map"):
        conv = _one(rows, metric="converged", method=method)
        assert conv["value"] == 1.0 and conv["params"]["iterations"] <= conv["params"]["iteration_limit"], conv
    assert _one(rows, metric="converged", method="gp_map")["params"]["iteration_limit"] == 500
    assert {r["status"] for r in _by(rows, metric="heldout_r2", method="pca_spline")} == {"not_yet_measured"}
    # the figure's fits are kept, GP-MAP with its band
    assert keep["truth"].name == "small" and keep["fits"]["gp_map"]["bands"]["procrustes"]["lower"]


def _row(metric, value, unit, *, status="measured", **params):
    from msrm_lab.bench.rows import make_row

    return make_row(bench.NOTEBOOK, bench.EXPERIMENT, metric, value, unit, status=status, info={}, **params)


def test_a_fit_that_did_not_converge_is_reported_not_scored():
    """The rows of a GP-MAP fit stopped by its iteration limit: ok, converged = 0 with how it stopped, and every
    score refused with the reason (a converged fit of the same latents is scored)."""
    from data_synth.designs import make_design

    data, spec, truth = make_design("small", 0)
    masks = bench._masks(data, spec, truth, 8.0)
    for converged in (False, True):
        res = {"ok": True, "error": None, "wall_s": 1.0, "latents": list(truth.latents),
               "response": truth.spec_response(),
               "convergence": {"converged": converged, "iterations": 7, "iteration_limit": 7,
                               "stop": "STOP: TOTAL NO. OF ITERATIONS REACHED LIMIT"}}
        rows = bench._method_rows("gp_map", res, truth, masks, _row)
        assert _one(rows, metric="ok")["value"] == 1.0
        conv = _one(rows, metric="converged")
        assert conv["value"] == float(converged) and conv["params"]["stop"].startswith("STOP")
        scores = [r for r in rows if r["metric"] not in ("ok", "wall_s", "converged")]
        assert {r["metric"] for r in scores} >= {"subspace_error", "aligned_r2_min", "abs_error_rating_lag"}
        if converged:
            assert all(r["status"] == "measured" for r in scores)
            assert _one(rows, metric="subspace_error")["value"] < 1e-9  # the true latents themselves
        else:
            assert all(r["status"] == "refused" and r["value"] is None for r in scores)
            assert all("did not converge (7 iterations, limit 7" in r["params"]["reason"] for r in scores)


def test_a_cross_validation_refused_for_non_convergence_gives_refused_rows(monkeypatch):
    import msrm
    from data_synth.designs import make_design
    from msrm.validation import NotConvergedError

    def refuse(*args, **kwargs):
        raise NotConvergedError("the GP-MAP (fit_map) fit of fold 1 of 3 did not converge")

    monkeypatch.setattr(msrm, "cross_validate", refuse)
    data, spec, _ = make_design("small", 0)
    sz = dict(bench.SIZES["smoke"], cv=dict(bench.SIZES["smoke"]["cv"], methods=("map",), map_designs=("small",)))
    rows = bench._cv_rows(data, spec, sz, "small", 0, ["gp_map"], _row)
    assert {r["metric"] for r in rows} == {m for m, _, _ in bench.CV_METRICS}
    assert all(r["status"] == "refused" and "fold 1 of 3 did not converge" in r["params"]["reason"] for r in rows)


@pytest.mark.slow
def test_nuts_rows_on_the_small_design(monkeypatch):
    """A few NUTS draws on the small design: latent band coverage, lag intervals and their coverage over seeds."""
    monkeypatch.setitem(bench.SIZES, "unit", dict(bench.SIZES["smoke"], methods=("nuts",), cv_seeds=(),
                                                  nuts=dict(num_warmup=10, num_samples=10, num_chains=1, thin=5),
                                                  nuts_designs=("small",)))
    rows = bench.recovery_rows("unit", info={})
    assert _one(rows, metric="ok", method="nuts")["value"] == 1.0
    assert 0.0 <= _one(rows, metric="band_coverage_90", method="nuts")["value"] <= 1.0
    hits = _by(rows, metric="interval_hit_90", method="nuts")
    assert {r["params"]["modality"] for r in hits} == {"rating", "physio"}
    assert {r["params"]["parameter"] for r in hits} == {"lag", "width"}
    assert all(r["value"] in (0.0, 1.0) and r["params"]["lower"] <= r["params"]["upper"] for r in hits)
    assert math.isfinite(_one(rows, metric="abs_error_rating_lag", method="nuts")["value"])
    cov = _by(rows, metric="interval_coverage_90", method="nuts")
    assert len(cov) == len(hits) and all(r["params"]["n_seeds"] == 1 for r in cov)
