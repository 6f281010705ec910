"""msrm.variance_explained, msrm.explain.to_xarray and msrm.plot.variance_explained.

Variance explained is checked against a computation written here with NumPy alone (dense response rows,
``nansum`` over the observed values); the total R2 against the model's own predictions; with the true parameters
and latents of a synthetic study, against the signal fraction the generating model implies. The xarray objects
are checked for their dims, coords and values; bad input must raise ValueError naming the problem.
"""
from __future__ import annotations

import numpy as np
import pytest

xr = pytest.importorskip("xarray")
matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import data_synth  # noqa: E402
import msrm  # noqa: E402
from msrm import explain, plot  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


@pytest.fixture(scope="module")
def study():
    """Two runs of the tiny study with missing values, an R-MSRM fit and a GP model at the true parameters."""
    data, truth = data_synth.synthetic_dataset("tiny", n_features=6, n_runs=2, seed=1, missing_fraction=0.05)
    fit = msrm.fit_rmsrm(data, truth.spec, restarts=1, n_jobs=1, progress=False, max_iter=30)
    model = msrm.GPMSRM(data, truth.spec, linear_algebra="grouped")
    posterior = model.latent_posterior(truth.params)
    return data, truth, fit, model, posterior


def by_hand(data, spec, params, latents, key, k=None, feature=None):
    """R2 of factor k (all factors when k is None) in stream ``key``: dense response rows, NumPy sums over the
    observed values of every run (of one feature when given)."""
    ss_res = ss_tot = 0.0
    for run, z in zip(data.runs, latents):
        if key not in run.keys:
            continue
        s = run.stream(key)
        grid = msrm.latent_grid(run.duration, spec)
        response = spec.response(s.modality)
        theta = params.response[s.modality] if response.param_names else {}
        x = msrm.response_weights(s.times, response, theta, grid) @ np.asarray(z)
        W, b = params.loadings[key], params.intercepts[key]
        signal = x @ W.T if k is None else np.outer(x[:, k], W[:, k])
        y = s.values - b
        if feature is not None:
            y, signal = y[:, feature], signal[:, feature]
        ss_res += np.nansum((y - signal) ** 2)
        ss_tot += np.nansum(y ** 2)
    return 1.0 - ss_res / ss_tot


# ------------------------------------------------------------------------------------------ variance explained


def test_rmsrm_matches_a_computation_by_hand(study):
    data, truth, fit, _, _ = study
    da = msrm.variance_explained(fit, data=data)
    assert isinstance(da, xr.DataArray) and da.dims == ("factor", "participant", "modality")
    assert list(da["factor"].values) == ["factor_0", "factor_1", "factor_2"]
    assert list(da["participant"].values) == list(data.participants)
    assert list(da["modality"].values) == list(data.modalities)
    assert da.coords["total"].dims == ("participant", "modality")
    for key, k in (("p3/physio", 1), ("p1/brain", 0), ("p4/rating", 2)):
        p, m = key.split("/")
        expected = by_hand(data, fit.spec, fit.params, fit.latents, key, k)
        assert abs(float(da.sel(factor=f"factor_{k}", participant=p, modality=m)) - expected) < 1e-12
        total = by_hand(data, fit.spec, fit.params, fit.latents, key)
        assert abs(float(da.coords["total"].sel(participant=p, modality=m)) - total) < 1e-12
    # a participant without a stream of a modality is NaN there; every stream has a value
    assert np.isnan(float(da.sel(factor="factor_0", participant="p1", modality="rating")))
    assert int(np.isfinite(da.coords["total"].values).sum()) == len(data.stream_keys)


def test_total_is_the_r2_of_the_models_own_prediction(study):
    data, truth, fit, model, _ = study
    cases = ((msrm.variance_explained(fit, data=data), fit.predict(data), fit.params),
             (msrm.variance_explained(model, truth.params), model.predict(truth.params), truth.params))
    for da, pred, params in cases:
        for key in data.stream_keys:
            p, m = key.split("/")
            res = sum(np.nansum((run.stream(key).values - pr[key].mean) ** 2) for run, pr in zip(data.runs, pred))
            tot = sum(np.nansum((run.stream(key).values - params.intercepts[key]) ** 2) for run in data.runs)
            assert abs(float(da.coords["total"].sel(participant=p, modality=m)) - (1 - res / tot)) < 1e-9


def test_gp_uses_the_posterior_mean_of_the_latents(study):
    data, truth, _, model, posterior = study
    da = msrm.variance_explained(model, truth.params)
    assert "GP-MSRM" in da.attrs["fit"] and "SS(y - b - W_k x_k)" in da.attrs["definition"]
    means = [lp.mean for lp in posterior]
    for key, k in (("p2/brain", 2), ("p4/physio", 0)):
        p, m = key.split("/")
        expected = by_hand(data, truth.spec, truth.params, means, key, k)
        assert abs(float(da.sel(factor=f"factor_{k}", participant=p, modality=m)) - expected) < 1e-12
    # a MAP-like result holding the params gives the same values
    holder = type("Result", (), {"params": truth.params})()
    xr.testing.assert_identical(msrm.variance_explained(model, holder), da)


def test_per_feature_matches_a_computation_by_hand(study):
    data, _, fit, _, _ = study
    per = explain.variance_explained_per_feature(fit, data=data)
    assert set(per) == set(data.stream_keys)
    da = per["p2/brain"]
    assert da.dims == ("factor", "feature") and da.attrs["participant"] == "p2" and da.attrs["modality"] == "brain"
    assert list(da["feature"].values) == [f"f{f}" for f in range(6)]
    for f, k in ((0, 0), (4, 2)):
        expected = by_hand(data, fit.spec, fit.params, fit.latents, "p2/brain", k, feature=f)
        assert abs(float(da.isel(feature=f).sel(factor=f"factor_{k}")) - expected) < 1e-12
        total = by_hand(data, fit.spec, fit.params, fit.latents, "p2/brain", feature=f)
        assert abs(float(da.coords["total"].isel(feature=f)) - total) < 1e-12


def test_true_parameters_and_latents_explain_the_known_signal_fraction():
    """With the generating parameters and latents the total R2 of a stream is its signal fraction
    E[SS signal] / (E[SS signal] + E[SS noise]): E[SS signal] = sum_i sum_k |W_k|^2 (A K_k A^T)_ii under the
    Matern prior of the latents, E[SS noise] = n sum_f sigma_f^2."""
    data, truth = data_synth.synthetic_dataset("tiny", n_features=20, n_runs=2, duration_scale=40.0, seed=0)
    spec, params = truth.spec, truth.params
    model = msrm.GPMSRM(data, spec, linear_algebra="grouped")
    da = msrm.variance_explained(model, params, latents=truth.latents)
    for key in data.stream_keys:
        signal = noise = 0.0
        for run in data.runs:
            s = run.stream(key)
            grid = msrm.latent_grid(run.duration, spec)
            response = spec.response(s.modality)
            A = msrm.response_weights(s.times, response, params.response[s.modality] if response.param_names else {},
                                      grid)
            lags = grid[:, None] - grid[None, :]
            for k, ell in enumerate(params.lengthscales):
                C = data_synth.matern_kernel(lags, ell, spec.kernel)
                signal += np.sum(params.loadings[key][:, k] ** 2) * np.sum((A @ C) * A)
            noise += s.n_samples * np.sum(params.noise_sd[key] ** 2)
        p, m = key.split("/")
        assert abs(float(da.coords["total"].sel(participant=p, modality=m)) - signal / (signal + noise)) < 0.05, key


def test_bad_input_is_refused_naming_the_problem(study):
    data, truth, fit, model, _ = study
    with pytest.raises(ValueError, match="fit_or_model.*dict"):
        msrm.variance_explained({"latents": []}, data=data)
    with pytest.raises(ValueError, match="fit_or_model.*Truth"):
        msrm.variance_explained(truth, data=data)
    other, other_truth = data_synth.synthetic_dataset("tiny", n_features=4, n_runs=1, seed=2)
    with pytest.raises(ValueError, match=r"params do not match the data.*p1/brain.*\(6, 3\)"):
        msrm.variance_explained(model, other_truth.params)
    with pytest.raises(ValueError, match=r"params do not match the data.*p1/brain.*4 features"):
        msrm.variance_explained(fit, data=other)
    with pytest.raises(ValueError, match="needs parameters"):
        msrm.variance_explained(model)
    with pytest.raises(ValueError, match="holds its own parameters"):
        msrm.variance_explained(fit, truth.params, data=data)
    with pytest.raises(ValueError, match="does not hold its data"):
        msrm.variance_explained(fit)
    with pytest.raises(ValueError, match="model.data"):
        msrm.variance_explained(model, truth.params, data=other)
    with pytest.raises(ValueError, match="params must be an msrm.Params"):
        msrm.variance_explained(model, {"loadings": {}})
    with pytest.raises(ValueError, match="latents.*2 runs.*1"):
        msrm.variance_explained(fit, data=data, latents=fit.latents[:1])
    with pytest.raises(ValueError, match=r"latents: run 1 .*shape \(5, 3\)"):
        msrm.variance_explained(model, truth.params, latents=[truth.latents[0], np.zeros((5, 3))])


# ------------------------------------------------------------------------------------------ labelled outputs


def test_latents_to_xarray_pads_shorter_runs(study):
    data, truth, _, _, posterior = study
    ds = explain.to_xarray(posterior)
    J, K = posterior[0].mean.shape
    assert ds["mean"].dims == ("run", "time", "factor") and ds["sd"].dims == ("run", "time", "factor")
    assert ds.sizes == {"run": 2, "time": J, "factor": K}
    np.testing.assert_array_equal(ds["time"].values, posterior[0].grid)
    assert list(ds["factor"].values) == ["factor_0", "factor_1", "factor_2"] and ds["time"].attrs["units"] == "s"
    for r, lp in enumerate(posterior):
        np.testing.assert_array_equal(ds["mean"].sel(run=r).values, lp.mean)
        np.testing.assert_array_equal(ds["sd"].sel(run=r).values, lp.sd)
    # a shorter run's grid is the start of the longer one's: NaN past its end
    rng = np.random.default_rng(0)
    grids = [msrm.latent_grid(T, truth.spec) for T in (20.0, 12.0)]
    lps = [msrm.LatentPosterior(g, rng.normal(size=(g.size, 2)), rng.random((g.size, 2)),
                                cov=np.tile(np.eye(2), (g.size, 1, 1))) for g in grids]
    ds = explain.latents_to_xarray(lps)
    n = grids[1].size
    assert ds.sizes["time"] == grids[0].size and ds["cov"].dims == ("run", "time", "factor", "factor2")
    np.testing.assert_array_equal(ds["mean"].sel(run=1).values[:n], lps[1].mean)
    assert np.isnan(ds["mean"].sel(run=1).values[n:]).all() and np.isnan(ds["cov"].sel(run=1).values[n:]).all()
    shifted = msrm.LatentPosterior(grids[1] + 0.5, lps[1].mean, lps[1].sd)
    with pytest.raises(ValueError, match="grid is not the start"):
        explain.latents_to_xarray([lps[0], shifted])


def test_predictions_and_loadings_to_xarray(study):
    data, truth, _, model, _ = study
    pred = model.predict(truth.params)
    out = explain.to_xarray(pred, data)
    assert len(out) == 2 and set(out[1]) == set(data.runs[1].keys)
    ds = out[1]["p3/rating"]
    s = data.runs[1].stream("p3/rating")
    assert ds["mean"].dims == ("time", "feature") and ds.sizes == {"time": s.n_samples, "feature": 1}
    assert ds.attrs == {"participant": "p3", "modality": "rating", "run": 1}
    np.testing.assert_array_equal(ds["time"].values, s.times)
    np.testing.assert_array_equal(ds["mean"].values, pred[1]["p3/rating"].mean)
    np.testing.assert_array_equal(ds["sd"].values, pred[1]["p3/rating"].sd)
    np.testing.assert_array_equal(ds["observed"].values, s.values)
    assert list(out[0]["p1/brain"]["feature"].values) == [f"f{f}" for f in range(6)]
    one = explain.predictions_to_xarray(pred[0])  # one run's dict, no data: no observed values
    assert set(one) == set(data.runs[0].keys) and "observed" not in one["p1/brain"]

    lo = explain.to_xarray(truth.params, data)
    assert set(lo) == set(data.stream_keys)
    W = lo["p2/brain"]
    assert W.dims == ("feature", "factor") and W.attrs == {"participant": "p2", "modality": "brain"}
    assert list(W["factor"].values) == ["factor_0", "factor_1", "factor_2"]
    assert list(W["feature"].values) == [f"f{f}" for f in range(6)]
    np.testing.assert_array_equal(W.values, truth.params.loadings["p2/brain"])

    with pytest.raises(ValueError, match="predictions has 1 runs, data has 2"):
        explain.predictions_to_xarray(pred[:1], data)
    with pytest.raises(ValueError, match=r"shape \(12, 6\), stream .p1/brain. of run 0 has \(13, 6\)"):
        explain.predictions_to_xarray([{"p1/brain": msrm.Prediction(np.zeros((12, 6)), np.ones((12, 6)))},
                                       pred[1]], data)
    with pytest.raises(ValueError, match="no sample times"):
        explain.predictions_to_xarray({"p1/brain": msrm.Prediction(np.zeros((3, 2)), np.ones((3, 2)))})
    with pytest.raises(ValueError, match="to_xarray.*int"):
        explain.to_xarray(3)


def test_feature_names_come_from_the_stream_when_it_has_them(study):
    data, truth, _, _, _ = study
    s = data.runs[0].stream("p1/brain")
    names = [f"voxel{f}" for f in range(s.n_features)]
    tagged = msrm.Stream(s.participant, s.modality, s.dt, s.values, offset=s.offset)
    object.__setattr__(tagged, "feature_names", names)
    d = msrm.Dataset([msrm.Run(data.runs[0].duration, [tagged])])
    assert explain.feature_names(d, "p1/brain", s.n_features) == names
    assert list(explain.loadings_to_xarray({"p1/brain": truth.params.loadings["p1/brain"]}, d)["p1/brain"]
                ["feature"].values) == names
    with pytest.raises(ValueError, match="6 feature names for 5 features"):
        explain.feature_names(d, "p1/brain", 5)


# ------------------------------------------------------------------------------------------ plot


def test_plot_has_one_panel_per_modality(study):
    data, _, fit, _, _ = study
    da = msrm.variance_explained(fit, data=data)
    fig = plot.variance_explained(da)
    assert isinstance(fig, matplotlib.figure.Figure)
    panels = [ax for ax in fig.axes if ax.images]
    assert [ax.get_title() for ax in panels] == list(data.modalities)
    # each panel: factors x the participants that have the modality; the shared colour bar is labelled
    brain = panels[0]
    assert brain.images[0].get_array().shape == (3, 2)
    assert [t.get_text() for t in brain.get_xticklabels()] == ["p1", "p2"]
    np.testing.assert_allclose(np.asarray(brain.images[0].get_array()), da.sel(modality="brain",
                                                                              participant=["p1", "p2"]).values)
    (bar,) = [ax for ax in fig.axes if not ax.images]
    assert bar.get_ylabel() == "variance explained (R²)"
    fig.canvas.draw()

    _, axes = plt.subplots(1, 3)
    assert plot.variance_explained(da, ax=axes) is axes[0].figure
    with pytest.raises(ValueError, match="2 axes given for 3 modalities"):
        plot.variance_explained(da, ax=axes[:2])
    with pytest.raises(ValueError, match="dims"):
        plot.variance_explained(da.coords["total"])
