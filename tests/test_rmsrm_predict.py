"""R-MSRM predictions (RFit.predict) and projection of new runs (msrm.rmsrm.project), against brute force."""
from __future__ import annotations

import numpy as np
import pytest

import data_synth
import msrm
from msrm.rmsrm import project
from msrm.rmsrm.predict import stream_theta


@pytest.fixture(scope="module")
def fitted():
    """A fit on two runs of a synthetic study; a third run of the same study is held back as a new run."""
    full, truth = data_synth.synthetic_dataset("tiny", n_features=10, seed=1, n_runs=3, missing_fraction=0.05)
    data = msrm.Dataset(full.runs[:2])
    fit = msrm.fit_rmsrm(data, truth.spec, restarts=1, n_jobs=1, progress=False, max_iter=300, tol=1e-11)
    return data, truth, fit, full.runs[2]


def test_predict_equals_the_dense_product_at_every_sample(fitted):
    data, truth, fit, held_back = fitted
    pred = fit.predict(data)
    assert len(pred) == len(data.runs)
    n_missing = 0
    for run, z, p in zip(data.runs, fit.latents, pred):
        grid = msrm.latent_grid(run.duration, truth.spec)
        assert set(p) == set(run.keys)
        for s in run.streams:
            A = msrm.response_weights(s.times, truth.spec.response(s.modality), stream_theta(fit.spec, fit.params, s),
                                      grid)
            W, b, sd = fit.params.loadings[s.key], fit.params.intercepts[s.key], fit.params.noise_sd[s.key]
            expected = b[None, :] + (A @ z) @ W.T
            got = p[s.key]
            assert got.mean.shape == s.values.shape and np.isfinite(got.mean).all()  # NaN samples predicted too
            np.testing.assert_allclose(got.mean, expected, rtol=1e-12, atol=1e-12)
            np.testing.assert_array_equal(got.sd, np.broadcast_to(sd, s.values.shape))
            assert got.signal_sd is None
            np.testing.assert_array_equal(got.times, s.times)
            n_missing += int(np.isnan(s.values).sum())
    assert n_missing > 0
    # the fit explains the observed values: residual sd near the fitted noise sd for a brain stream
    s = data.runs[0].streams[0]
    resid = (s.values - pred[0][s.key].mean) / fit.params.noise_sd[s.key]
    assert 0.5 < np.nanstd(resid) < 1.5


def test_project_on_the_training_data_gives_the_fitted_latents(fitted):
    data, _, fit, _ = fitted
    Z = project(fit, data)
    for z, zf in zip(Z, fit.latents):
        assert z.shape == zf.shape
        np.testing.assert_allclose(z, zf, atol=1e-4 * np.abs(zf).max())


def _brute_force_latents(fit, run):
    """argmin_Z of the R-MSRM objective of one run with W, b, sigma, theta fixed: dense Kronecker least squares."""
    spec, params, K = fit.spec, fit.params, fit.spec.n_factors
    grid = msrm.latent_grid(run.duration, spec)
    J = grid.size
    rows, rhs = [], []
    for s in run.streams:
        A = msrm.response_weights(s.times, spec.response(s.modality), stream_theta(spec, params, s), grid)
        W, b, sd = params.loadings[s.key], params.intercepts[s.key], params.noise_sd[s.key]
        for i in range(s.n_samples):
            for f in range(s.n_features):
                if np.isnan(s.values[i, f]):
                    continue
                rows.append(np.kron(A[i], W[f]) / sd[f])  # z[j K + k] = Z[j, k]
                rhs.append((s.values[i, f] - b[f]) / sd[f])
    X, y = np.array(rows), np.array(rhs)
    D = np.diff(np.eye(J), n=2, axis=0)
    F_tot = sum(W.shape[0] for W in params.loadings.values())
    S = sum(W.T @ (W / params.noise_sd[k][:, None] ** 2) for k, W in params.loadings.items()) / F_tot
    # the pad tie: rho sum_{j outside [0, T]} (z_j - mean of z over [0, T])^2, written out densely
    span = (grid >= 0) & (grid <= run.duration)
    Dt = np.eye(J)[~span] - np.where(span, 1.0 / span.sum(), 0.0)[None, :]
    rho = (spec.latent_dt / 2.0) ** 4
    H = X.T @ X + fit.roughness * np.kron(D.T @ D + rho * Dt.T @ Dt, S)
    return np.linalg.solve(H, X.T @ y).reshape(J, K)


def test_project_equals_brute_force_on_new_runs_with_fewer_streams(fitted):
    data, truth, fit, held_back = fitted
    # a new run of the same study, and the same run keeping only the brain streams and one rating: projection
    # works on any subset of the fitted streams
    run1 = msrm.Run(held_back.duration, [s for s in held_back.streams if s.modality == "brain"]
                    + [held_back.stream("p3/rating")])
    new = msrm.Dataset([held_back, run1])
    Z = project(fit, new)
    for r, run in enumerate(new.runs):
        np.testing.assert_allclose(Z[r], _brute_force_latents(fit, run), rtol=1e-8, atol=1e-8)
    # runs are independent: projecting one run alone gives the same latents
    np.testing.assert_allclose(project(fit, msrm.Dataset([run1]))[0], Z[1], rtol=1e-12, atol=1e-12)
    # and the projected latents predict the new runs' observed values about as well as the fit predicts its own
    pred = fit.predict(new, latents=Z)
    s = new.runs[0].stream("p1/brain")
    resid = (s.values - pred[0]["p1/brain"].mean) / fit.params.noise_sd["p1/brain"]
    assert np.nanstd(resid) < 1.5


def test_bad_input_is_refused(fitted):
    data, truth, fit, held_back = fitted
    longer, _ = data_synth.synthetic_dataset("tiny", n_features=10, seed=1, n_runs=2, duration_scale=1.5)
    with pytest.raises(ValueError, match="grid of"):
        fit.predict(longer)  # another dataset's runs: durations differ from the fit's
    with pytest.raises(ValueError, match="runs but there are latents"):
        fit.predict(msrm.Dataset(data.runs[:1]))
    wide, _ = data_synth.synthetic_dataset("tiny", n_features=12, seed=1, n_runs=2)
    with pytest.raises(ValueError, match="p1/brain.*12 features"):
        fit.predict(wide)
    with pytest.raises(ValueError, match="p1/brain.*12 features"):
        project(fit, wide)
    stranger = msrm.Run(data.runs[0].duration, [msrm.Stream("p9", "brain", 2.0, np.zeros((5, 10)))])
    with pytest.raises(KeyError, match="p9/brain"):
        project(fit, msrm.Dataset([stranger]))
    with pytest.raises(ValueError, match="non-finite"):
        fit.predict(data, latents=[np.full_like(z, np.nan) for z in fit.latents])
    with pytest.raises(ValueError, match="msrm.Dataset"):
        project(fit, data.runs[0])
