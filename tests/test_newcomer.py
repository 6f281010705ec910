"""msrm.project_participant: a new participant's parameters with the fit's latents held fixed.

The estimates are checked against an independent computation (``numpy.linalg.lstsq`` on dense response rows when
the latents are known exactly; the same least squares on rows augmented with a square root of the posterior
covariance for the EM step), against a fit that saw the participant (R-MSRM), against a fit of the participant
alone (prediction of held-out time), and, for a GP-MSRM model at its MAP parameters, against the model's own
exact posterior predictive. Bad input must raise naming the stream, participant or run.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import data_synth
import msrm
from msrm.newcomer import m_step, posterior_bands, window_moments

KW = dict(restarts=1, n_jobs=1, progress=False, max_iter=200)


def _subset(data, keep):
    """The runs of ``data`` with only the streams ``keep(stream)`` accepts."""
    return msrm.Dataset([msrm.Run(run.duration, [s for s in run.streams if keep(s)]) for run in data.runs])


def _relabel(stream, participant, values=None):
    return msrm.Stream(participant, stream.modality, stream.dt, stream.values if values is None else values,
                       offset=stream.offset)


def _signal(truth, run, stream):
    """The noise-free truth ``b + W x(t)`` of a stream of run 0 of the synthetic study."""
    spec, params = truth.spec, truth.params
    grid = msrm.latent_grid(run.duration, spec)
    resp = spec.response(stream.modality)
    theta = {} if not resp.param_names else params.response[
        stream.modality if spec.pooling == "shared" else stream.key]
    x = msrm.response_weights(stream.times, resp, theta, grid) @ truth.latents[0]
    return params.intercepts[stream.key] + x @ params.loadings[stream.key].T


def _corr(a, b):
    """Per-column Pearson correlation."""
    a, b = a - a.mean(axis=0), b - b.mean(axis=0)
    return (a * b).sum(axis=0) / np.sqrt((a * a).sum(axis=0) * (b * b).sum(axis=0))


@pytest.fixture(scope="module")
def study():
    """Five participants of the one-eighth design (four brain participants p1-p4 with 24 features each, and p5 with a
    rating and a physiology stream), about 136 s; R-MSRM fits without p4, with everyone, and of p4 alone."""
    full, truth = data_synth.synthetic_dataset("one-eighth", n_features=24, duration_scale=0.3, seed=3)
    data = _subset(full, lambda s: s.participant in ("p1", "p2", "p3", "p4", "p5"))
    without = msrm.fit_rmsrm(_subset(data, lambda s: s.participant != "p4"), truth.spec, **KW)
    everyone = msrm.fit_rmsrm(data, truth.spec, **KW)
    return data, truth, without, everyone


# ------------------------------------------------------------------------------------------ R-MSRM


def test_projection_agrees_with_a_fit_that_saw_the_participant(study):
    data, truth, without, everyone = study
    proj = msrm.project_participant(without, data, participant="p4")
    key = "p4/brain"
    assert isinstance(proj, msrm.newcomer.ParticipantProjection)
    assert list(proj.params.loadings) == [key] and proj.params.loadings[key].shape == (24, 3)
    assert proj.runs == (0,) and proj.participant == "p4" and proj.fit == "R-MSRM"
    # Predictions are frame-free. p4 is one of five participants (a quarter of the brain features), so leaving it
    # out moves the latents a little; measured: minimum correlation over features 0.993.
    mine, theirs = proj.predictions[0][key].mean, everyone.predict(data)[0][key].mean
    assert _corr(mine, theirs).min() > 0.97
    # Loadings in the fit's frame: the fit without p4 mapped onto the fit with everyone by the orthogonal map between
    # their (whitened) latents; measured relative error 0.041, noise sd within 3.6 %.
    T = msrm.align(without.latents, everyone.latents, method="procrustes")
    W = T.apply_loadings(proj.params.loadings[key])
    W_all = everyone.params.loadings[key]
    assert np.linalg.norm(W - W_all) / np.linalg.norm(W_all) < 0.12
    np.testing.assert_allclose(proj.params.noise_sd[key], everyone.params.noise_sd[key], rtol=0.06)
    # R-MSRM is a point estimate: sd is the noise sd and there is no signal sd, as in RFit.predict
    pred = proj.predictions[0][key]
    np.testing.assert_array_equal(pred.sd, np.broadcast_to(proj.params.noise_sd[key], pred.mean.shape))
    assert pred.signal_sd is None
    # variance explained through msrm.explain, total = R2 of the projection's own predictions
    ve = proj.variance_explained
    assert ve.dims == ("factor", "participant", "modality") and list(ve.participant.values) == ["p4"]
    y = data.runs[0].stream(key).values
    b = proj.params.intercepts[key]
    expected = 1.0 - np.sum((y - mine) ** 2) / np.sum((y - b) ** 2)
    np.testing.assert_allclose(float(ve.total.sel(participant="p4", modality="brain")), expected, rtol=1e-10)


def test_projection_predicts_held_out_time_far_better_than_a_fit_of_the_participant_alone(study):
    data, truth, without, _ = study
    run = data.runs[0]
    s = run.stream("p4/brain")
    late = s.times > 0.5 * run.duration
    masked = np.where(late[:, None], np.nan, s.values)  # the second half of the run is held out
    new = msrm.Dataset([msrm.Run(run.duration, [_relabel(s, "p4", masked)])])
    proj = msrm.project_participant(without, new)
    alone = msrm.fit_rmsrm(new, truth.spec, **KW)
    signal = _signal(truth, run, s)[late]
    r_proj = np.median(_corr(proj.predictions[0]["p4/brain"].mean[late], signal))
    r_alone = np.median(_corr(alone.predict(new)[0]["p4/brain"].mean[late], signal))
    # the fixed latents carry the other participants' information about the held-out half; a fit of p4 alone has
    # only its roughness penalty there. Measured: median correlation with the noise-free signal 0.83 against 0.28.
    assert r_proj > 0.7
    assert r_alone < 0.5
    assert r_proj - r_alone > 0.4


def test_known_latents_give_ordinary_least_squares(study):
    """With the latents known exactly, loadings and intercepts are the least-squares solution of each feature on
    the dense response rows and a column of ones (numpy.linalg.lstsq), noise sd the root mean squared residual."""
    data, truth, without, _ = study
    rng = np.random.default_rng(0)
    run = data.runs[0]
    brain = run.stream("p4/brain")
    holes = np.where(rng.random(brain.values.shape) < 0.1, np.nan, brain.values)  # missing values, per feature
    streams = [_relabel(brain, "new", holes), _relabel(run.stream("p5/rating"), "new"),
               _relabel(run.stream("p5/physio"), "new")]
    new = msrm.Dataset([msrm.Run(run.duration, streams)])
    exact = dataclasses.replace(without, latents=[np.asarray(z) for z in truth.latents])
    proj = msrm.project_participant(exact, new)
    grid = msrm.latent_grid(run.duration, truth.spec)
    for s in streams:
        resp = truth.spec.response(s.modality)
        theta = without.params.response[s.modality] if resp.param_names else {}
        assert proj.params.response.get(s.modality, {}) == theta  # shared pooling: the fit's values
        X = np.column_stack([msrm.response_weights(s.times, resp, theta, grid) @ truth.latents[0],
                             np.ones(s.n_samples)])
        for f in range(s.n_features):
            ok = ~np.isnan(s.values[:, f])
            beta, *_ = np.linalg.lstsq(X[ok], s.values[ok, f], rcond=None)
            resid = s.values[ok, f] - X[ok] @ beta
            np.testing.assert_allclose(proj.params.loadings[s.key][f], beta[:3], rtol=1e-10, atol=1e-10)
            np.testing.assert_allclose(proj.params.intercepts[s.key][f], beta[3], rtol=1e-10, atol=1e-10)
            np.testing.assert_allclose(proj.params.noise_sd[s.key][f], np.sqrt(np.mean(resid ** 2)), rtol=1e-10)


def test_em_step_is_least_squares_on_rows_augmented_by_the_posterior_covariance():
    """sum_i E[x~ x~^T] = sum_i (x~ x~^T + [L_i; 0][L_i; 0]^T) for V_i = L_i L_i^T: the M-step equals lstsq on the
    rows [m_i, 1] (targets y) stacked over rows [L_i^T, 0] (targets 0), and the noise variance adds w^T V w."""
    rng = np.random.default_rng(1)
    n, K, F = 60, 3, 5
    m = rng.standard_normal((n, K))
    L = 0.3 * np.tril(rng.standard_normal((n, K, K)))
    V = L @ np.swapaxes(L, 1, 2)
    Y = m @ rng.standard_normal((K, F)) + 0.5 * rng.standard_normal((n, F)) + 2.0
    Y[rng.random((n, F)) < 0.15] = np.nan
    est = m_step(Y, m, V)
    for f in range(F):
        ok = ~np.isnan(Y[:, f])
        top = np.column_stack([m[ok], np.ones(ok.sum())])
        bottom = np.concatenate([np.column_stack([L[i].T, np.zeros(K)]) for i in np.flatnonzero(ok)])
        beta, *_ = np.linalg.lstsq(np.vstack([top, bottom]), np.concatenate([Y[ok, f], np.zeros(len(bottom))]),
                                   rcond=None)
        np.testing.assert_allclose(est.loadings[f], beta[:K], rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(est.intercepts[f], beta[K], rtol=1e-10)
        w = beta[:K]
        q = np.sum((Y[ok, f] - top @ beta) ** 2) + np.einsum("k,ikl,l->", w, V[ok], w)
        np.testing.assert_allclose(est.noise_var[f], q / ok.sum(), rtol=1e-10)
        assert est.n_observed[f] == ok.sum()


def test_individual_pooling_estimates_the_new_participants_lags():
    full, truth = data_synth.synthetic_dataset("one-eighth", n_features=24, duration_scale=0.3, seed=4,
                                               pooling="individual")
    data = _subset(full, lambda s: s.participant in ("p1", "p2", "p3", "p4", "p5", "p6"))
    fit = msrm.fit_rmsrm(_subset(data, lambda s: s.participant != "p6"), truth.spec, **KW)
    proj = msrm.project_participant(fit, data, participant="p6")
    assert set(proj.params.response) == {"p6/rating", "p6/physio"}
    run = data.runs[0]
    grid = msrm.latent_grid(run.duration, truth.spec)
    for key in ("p6/rating", "p6/physio"):
        search = proj.response_search[key]
        assert search["theta"] == proj.params.response[key]
        assert search["expected_loglik"] == pytest.approx(proj.expected_loglik[key], rel=1e-12)
        # a maximum: no better than the found value at the truth's parameters or at any other participant's
        s = run.stream(key)
        resp = truth.spec.response(s.modality)
        for theta in (truth.params.response[key], fit.params.response["p5/" + s.modality]):
            m, _ = window_moments(s.times, resp, theta, grid, fit.latents[0], None)
            assert m_step(s.values, m).expected_loglik <= search["expected_loglik"] + 1e-9
    # brain streams (Identity, no lag) anchor the latents' time, so the rating's lag is the truth's (measured error
    # 0.29 s; the latent step is 0.9 s). A one-feature stream with K = 3 free loadings identifies a lag only
    # weakly, and the physiology stream's lag trades off against its width (its fitted width sits on a
    # bound, for the fit's own participant as well), so only the rating's lag is compared with the truth.
    assert abs(proj.params.response["p6/rating"]["lag"] - truth.params.response["p6/rating"]["lag"]) < 0.6
    s = run.stream("p6/rating")
    assert _corr(proj.predictions[0]["p6/rating"].mean, _signal(truth, run, s))[0] > 0.9


# ------------------------------------------------------------------------------------------ GP-MSRM


@pytest.fixture(scope="module")
def gp_study():
    """The tiny design stretched to 72 s, 8 brain features, 5 % missing; a grouped GP model without p2 at its MAP
    parameters."""
    data, truth = data_synth.synthetic_dataset("tiny", n_features=8, duration_scale=3.0, seed=2,
                                               missing_fraction=0.05)
    model = msrm.GPMSRM(_subset(data, lambda s: s.participant != "p2"), truth.spec, linear_algebra="grouped")
    start = truth.params.replace(**{name: {k: v for k, v in getattr(truth.params, name).items() if k != "p2/brain"}
                                    for name in ("loadings", "intercepts", "noise_sd")})
    fit = model.fit_map(init=start, seed=0, maxiter=200, progress=False)  # started at the truth: fewer steps
    assert fit.converged
    return data, truth, model, fit


def test_gp_posterior_bands_give_the_models_exact_predictive(gp_study):
    """V_i from the banded grid covariance reproduces the model's own posterior predictive of its streams (every
    response type): the mean and the signal sd to rounding."""
    data, truth, model, fit = gp_study
    post = model.latent_posterior(fit.params, cov=True)[0]
    band = posterior_bands(model, fit.params, [0], 40)[0]
    np.testing.assert_allclose(band[:, 39], post.cov, atol=1e-12)  # the diagonal blocks are latent_posterior's
    pred = model.predict(fit.params)[0]
    for s in model.data.runs[0].streams:
        resp = model.spec.response(s.modality)
        theta = fit.params.response[s.modality] if resp.param_names else {}
        m, V = window_moments(s.times, resp, theta, post.grid, post.mean, band)
        W, b = fit.params.loadings[s.key], fit.params.intercepts[s.key]
        np.testing.assert_allclose(b + m @ W.T, pred[s.key].mean, atol=1e-10)
        np.testing.assert_allclose(np.sqrt(np.einsum("fk,ikl,fl->if", W, V, W)), pred[s.key].signal_sd, atol=1e-10)


def test_gp_projection_of_a_new_participant(gp_study):
    data, truth, model, fit = gp_study
    proj = msrm.project_participant(model, data, params=fit, participant="p2")
    key = "p2/brain"
    s = data.runs[0].stream(key)
    assert proj.fit == "GP-MSRM" and isinstance(proj.latents[0], msrm.LatentPosterior)
    assert proj.params.loadings[key].shape == (8, truth.spec.n_factors)
    pred = proj.predictions[0][key]
    assert np.isfinite(pred.mean).all() and (pred.signal_sd > 0).all()
    np.testing.assert_allclose(pred.sd ** 2, pred.signal_sd ** 2 + proj.params.noise_sd[key] ** 2, rtol=1e-12)
    # tiny study (8 features, 36 samples of a noisy brain stream): measured correlation with the noise-free signal
    # 0.68-0.92 per feature
    assert np.median(_corr(pred.mean, _signal(truth, data.runs[0], s))) > 0.7
    # the estimate is the EM step with the posterior's E[x] and Cov[x] (posterior_bands, checked above)
    post = proj.latents[0]
    band = posterior_bands(model, fit.params, [0], 10)[0]
    m, V = window_moments(s.times, msrm.Identity(), {}, post.grid, post.mean, band)
    est = m_step(s.values, m, V)
    np.testing.assert_allclose(proj.params.loadings[key], est.loadings, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(proj.params.noise_sd[key] ** 2, est.noise_var, rtol=1e-10)
    total = float(proj.variance_explained.total.sel(participant="p2", modality="brain"))
    assert 0.0 < total < 1.0


# ------------------------------------------------------------------------------------------ errors


def test_bad_input_is_refused_naming_the_problem(study, gp_study):
    data, truth, without, _ = study
    run = data.runs[0]
    brain = run.stream("p4/brain")
    one = lambda *streams: msrm.Dataset([msrm.Run(run.duration, list(streams))])  # noqa: E731
    with pytest.raises(KeyError, match=r"stream new/eeg.*no modality 'eeg'"):
        msrm.project_participant(without, one(msrm.Stream("new", "eeg", 1.0, np.ones((50, 2)))))
    with pytest.raises(ValueError, match=r"participant 'p1' is already a participant of the fit"):
        msrm.project_participant(without, one(_relabel(brain, "p1")))
    with pytest.raises(ValueError, match=r"participants \['p1', 'p4'\]; name the new one"):
        msrm.project_participant(without, one(run.stream("p1/brain"), brain))
    with pytest.raises(ValueError, match=r"participant 'p9' has no stream"):
        msrm.project_participant(without, data, participant="p9")
    with pytest.raises(ValueError, match=r"new_data has 2 runs and the fit has 1"):
        msrm.project_participant(without, msrm.Dataset([run, run]), participant="p4")
    with pytest.raises(ValueError, match=r"runs= \[1\]: the fit has runs 0 to 0"):
        msrm.project_participant(without, data, participant="p4", runs=[1])
    short = msrm.Run(60.0, [msrm.Stream("new", "brain", 1.8, brain.values[:30])])
    with pytest.raises(ValueError, match=r"run 0 of new_data \(stream new/brain.*latent grid of .* not the same run"):
        msrm.project_participant(without, short)
    sparse = np.full((brain.n_samples, 2), np.nan)
    sparse[:4, 0] = 1.0
    sparse[:, 1] = 0.0
    with pytest.raises(ValueError, match=r"stream new/brain: feature\(s\) \[0\] have 4 observed values"):
        msrm.project_participant(without, one(msrm.Stream("new", "brain", brain.dt, sparse)))
    with pytest.raises(ValueError, match=r"params: an R-MSRM fit holds its own parameters"):
        msrm.project_participant(without, data, participant="p4", params=without.params)
    with pytest.raises(ValueError, match=r"fit must be an R-MSRM fit .* got an object of type dict"):
        msrm.project_participant({}, data, participant="p4")
    with pytest.raises(ValueError, match=r"new_data must be an msrm.Dataset"):
        msrm.project_participant(without, [brain])
    gp_data, _, model, _ = gp_study
    with pytest.raises(ValueError, match=r"params: a GP-MSRM model needs its parameters"):
        msrm.project_participant(model, gp_data, participant="p2")
