"""R-MSRM's marginal response step and pad tie against slow references: the criterion against the dense Gaussian
marginal likelihood, its gradient against central differences, the recovered width against the joint fit's
bias, and the pad and convention over the run's span."""
from __future__ import annotations

import numpy as np
import pytest

import data_synth
import msrm
from msrm.operators import response_weights
from msrm.rmsrm import convention
from msrm.rmsrm.objective import RState, compute_stats
from msrm.rmsrm.prepare import prepare_rmsrm
from msrm.rmsrm.response import _theta_layout, marginal_criterion, marginal_value_and_grad


def _state(seed=0, missing=0.0):
    data, truth = data_synth.synthetic_dataset("tiny", n_features=6, seed=seed, missing_fraction=missing)
    prep = prepare_rmsrm(data, truth.spec, roughness=2.0)
    tp = truth.params
    rng = np.random.default_rng(seed)
    Z = tuple(z + 0.2 * rng.standard_normal(z.shape) for z in truth.latents)
    st = RState(Z=Z, W=dict(tp.loadings), b=dict(tp.intercepts), var={k: v ** 2 for k, v in tp.noise_sd.items()},
                theta={k: dict(v) for k, v in tp.response.items()})
    return data, truth, prep, st


def _dense_nll(data, spec, st, theta, lam, prep, eps):
    """-log N(y; b, Sigma + G Q^-1 G^T) with Q = lam (Omega (x) S + eps I): the marginal likelihood of the
    roughness prior made proper along its flat (constant) directions, plus K/2 log lam. As eps -> 0 this is M plus
    a constant: the flat directions' density (lam eps / 2 pi)^(K/2) is what the K/2 log lam removes, and with
    eps scaled by lam the remaining O(eps) terms do not depend on lam or theta."""
    run = data.runs[0]
    grid = msrm.latent_grid(run.duration, spec)
    J, K = grid.size, spec.n_factors
    rows, y, noise = [], [], []
    for s in run.streams:
        resp = spec.response(s.modality)
        th = theta[s.modality] if resp.param_names else {}
        A = response_weights(s.times, resp, th, grid)
        W, b, var = st.W[s.key], st.b[s.key], st.var[s.key]
        for i in range(s.n_samples):
            for f in range(s.n_features):
                if np.isnan(s.values[i, f]):
                    continue
                rows.append(np.kron(A[i], W[f]))
                y.append(s.values[i, f] - b[f])
                noise.append(var[f])
    G, y = np.array(rows), np.array(y)
    D = np.diff(np.eye(J), n=2, axis=0)
    span = (grid >= 0) & (grid <= run.duration)
    Dt = np.eye(J)[~span] - np.where(span, 1.0 / span.sum(), 0.0)[None, :]
    S = compute_stats(prep, st).S
    Q = lam * (np.kron(D.T @ D + prep.pad_tie * Dt.T @ Dt, S) + eps * np.eye(J * K))
    C = np.diag(noise) + G @ np.linalg.solve(Q, G.T)
    _, ld = np.linalg.slogdet(C)
    return 0.5 * (y @ np.linalg.solve(C, y) + ld) + 0.5 * K * np.log(lam)


def test_marginal_criterion_equals_the_dense_marginal_likelihood_up_to_a_constant():
    data, truth, prep, st = _state(missing=0.1)
    stats = compute_stats(prep, st)
    pairs = [({"rating": {"lag": 1.2}, "physio": {"lag": 0.8, "width": 0.9}}, 2.0),
             ({"rating": {"lag": 0.7}, "physio": {"lag": 1.5, "width": 0.6}}, 2.0),
             ({"rating": {"lag": 1.2}, "physio": {"lag": 0.8, "width": 1.3}}, 11.0)]
    M = [marginal_criterion(prep, st, stats, th, lam)[0] for th, lam in pairs]
    nll = [_dense_nll(data, truth.spec, st, th, lam, prep, 1e-8) for th, lam in pairs]
    # differences are free of the constant; a wrong log-determinant or prior rank is off by O(1)
    np.testing.assert_allclose(np.diff(M), np.diff(nll), rtol=1e-5, atol=1e-4)
    assert abs(M[1] - M[0]) > 1e-2 and abs(M[2] - M[0]) > 1e-2  # the pairs really differ


def test_marginal_gradient_matches_central_differences():
    _, _, prep, st = _state(seed=1)
    stats = compute_stats(prep, st)
    layout = _theta_layout(prep)
    x = np.array([st.theta[pk][n] for _, pk, n, _ in layout] + [np.log(prep.roughness)])
    x[0] += 0.1
    _, g, _ = marginal_value_and_grad(prep, st, stats, x)

    def M(v):
        th = {k: dict(t) for k, t in st.theta.items()}
        for (_, pk, n, _), val in zip(layout, v[:-1]):
            th[pk][n] = float(val)
        return marginal_criterion(prep, st, stats, th, float(np.exp(v[-1])))[0]

    h = 1e-5
    fd = np.array([(M(x + h * e) - M(x - h * e)) / (2 * h) for e in np.eye(x.size)])
    np.testing.assert_allclose(g, fd, rtol=1e-4, atol=1e-4 * np.abs(fd).max())


def _width_fit(response_objective, roughness=None):
    from data_synth.designs import make_design

    # fast enough dynamics (periods 4-20 s) that the physiology stream's 0.8 s blur is visible in the data
    data, spec, truth = make_design("small", 1, n_participants=4, duration=150.0, n_brain_features=40,
                                    period_min=4.0, period_max=20.0)
    fit = msrm.fit_rmsrm(data, spec, restarts=1, max_iter=60, seed=0, n_jobs=1, progress=False,
                         response_objective=response_objective, roughness=roughness)
    return fit, truth, spec, data


@pytest.fixture(scope="module")
def width_fits():
    return _width_fit("joint"), _width_fit("marginal"), _width_fit("marginal", "marginal")


def test_marginal_step_removes_the_width_bias_of_the_joint_fit(width_fits):
    (joint, truth, spec, _), (marg, _, _, _), (reml, _, _, _) = width_fits
    true_w = truth.response["physio"]["width"]
    err = {name: abs(f.params.response["physio"]["width"] - true_w)
           for name, f in (("joint", joint), ("marginal", marg), ("reml", reml))}
    # the joint fit lets the latents absorb the blur (its width is far too small); the marginal step moves it
    # towards the truth, and recovers it when lambda is chosen with it (the prior's smoothness matters)
    assert err["joint"] > 0.3
    assert err["marginal"] < err["joint"] - 0.02
    assert err["reml"] < 0.2
    for m, lag in truth.response.items():
        assert abs(reml.params.response[m]["lag"] - lag["lag"]) < 0.3
        assert abs(marg.params.response[m]["lag"] - lag["lag"]) < 0.3
    assert marg.marginal["theta_before"]["physio"]["width"] == joint.params.response["physio"]["width"]
    assert marg.settings["response_objective"] == "marginal" and joint.marginal is None


def test_latents_are_centred_and_whitened_over_the_run_and_the_pad_does_not_drift(width_fits):
    fit, _, spec, data = width_fits[1]
    for z, run in zip(fit.latents, data.runs):
        grid = msrm.latent_grid(run.duration, spec)
        span = (grid >= 0) & (grid <= run.duration)
        assert (~span).sum() > 5
        np.testing.assert_allclose(z[span].mean(axis=0), 0.0, atol=1e-10)
        np.testing.assert_allclose(z[span].std(axis=0), 1.0, atol=1e-10)
        assert np.abs(z[~span]).max() <= np.abs(z[span]).max()


def test_rmsrm_beats_pca_and_spline_where_the_other_modalities_carry_signal():
    """Few, noisy brain features (data not drawn from the model): fusing the ratings and physiology recovers the
    latents far better than PCA of the brain streams with a cubic spline."""
    pytest.importorskip("sklearn")
    from data_synth.designs import make_design
    from msrm_lab.peers import run_peer
    from msrm_lab.recovery.metrics import subspace_error

    data, spec, truth = make_design("few_brain", 0, duration=100.0, latent_dt=1.0)
    grid = msrm.latent_grid(100.0, spec)
    inner = (grid >= 8.0) & (grid <= 92.0)
    fit = msrm.fit_rmsrm(data, spec, restarts=1, max_iter=60, seed=0, n_jobs=1, progress=False)
    pca = run_peer("pca_spline", data, spec, seed=0)
    assert pca.ok, pca.error
    e_rmsrm = subspace_error(truth.latents[0], fit.latents[0], inner)
    e_pca = subspace_error(truth.latents[0], pca.latents[0], inner)
    assert e_rmsrm < 0.6 * e_pca, (e_rmsrm, e_pca)


def test_roughness_chosen_by_the_marginal_step():
    data, truth = data_synth.synthetic_dataset("tiny", n_features=8, seed=2)
    fixed = msrm.fit_rmsrm(data, truth.spec, restarts=1, max_iter=30, seed=0, n_jobs=1, progress=False)
    chosen = msrm.fit_rmsrm(data, truth.spec, restarts=1, max_iter=30, seed=0, n_jobs=1, progress=False,
                            roughness="marginal")
    assert fixed.roughness == fixed.marginal["roughness"] == fixed.marginal["roughness_before"]
    assert chosen.marginal["roughness_before"] == fixed.roughness
    assert chosen.roughness == chosen.marginal["roughness"] != fixed.roughness
    assert chosen.settings["marginal_roughness"] is True
    with pytest.raises(ValueError, match="roughness='marginal' needs response_objective='marginal'"):
        msrm.fit_rmsrm(data, truth.spec, restarts=1, progress=False, roughness="marginal",
                       response_objective="joint")
