"""Latents and predictions per posterior draw (Posterior.latent_posterior / Posterior.predict): the kept draws,
the pooled mean and sd against the law of total variance computed by hand from per-draw model results, dims,
coords and bad input.

The NUTS chains are the conjugate toy model's (tests/toy_model.py, fast to compile), extended with a
latent_posterior and a predict that are smooth functions of the draw, so each draw gives different conditional
moments and pooling has something to pool. A tiny GPMSRM checks the same methods on the real model's result types.
"""
from __future__ import annotations

import numpy as np
import pytest

import msrm
import msrm.runtime
from msrm.gp.posterior import Posterior, sample

from toy_model import ToyModel

pytest.importorskip("numpyro")
xr = pytest.importorskip("xarray")

NUM_SAMPLES = 14


class LatentToy(ToyModel):
    """ToyModel with two runs of latent factors and one predicted stream per run, functions of (beta, scale).

    Run r has grid ``tau = 0.5 j`` (J_r points). Conditional mean ``m[j, k] = sum_f beta[f, k] sin((f + 1 + r)
    tau_j + 0.3)``, sd ``0.1 scale (1 + 0.1 j)`` for every factor; the stream "p/x" has 3 samples and 2 features
    with mean ``m @ beta.T`` on the first grid points, signal sd ``scale`` and noise sd 0.3.
    """

    grids = (np.arange(5) * 0.5, np.arange(4) * 0.5)
    noise_sd = 0.3

    def latent_posterior(self, params, cov=False):
        out = []
        for r, grid in enumerate(self.grids):
            mean, sd = self._moments(params, r)
            c = None
            if cov:
                c = np.einsum("jk,jl->jkl", sd, sd) * (0.5 + 0.5 * np.eye(self.K))
            out.append(msrm.LatentPosterior(grid, mean, sd, c))
        return out

    def predict(self, params):
        out = []
        for r, grid in enumerate(self.grids):
            mean, _ = self._moments(params, r)
            m = mean[:3] @ np.asarray(params.beta).T
            signal = np.full_like(m, params.scale)
            out.append({"p/x": msrm.Prediction(m, np.sqrt(signal**2 + self.noise_sd**2), signal, grid[:3] + 1.0)})
        return out

    def _moments(self, params, r):
        grid = self.grids[r]
        beta = np.asarray(params.beta)
        basis = np.sin(np.outer(grid, np.arange(1, self.F + 1) + r) + 0.3)  # (J, F)
        mean = basis @ beta
        sd = 0.1 * params.scale * np.repeat((1.0 + 0.1 * np.arange(grid.size))[:, None], self.K, axis=1)
        return mean, sd


@pytest.fixture(scope="module")
def toy_post():
    msrm.runtime.enable_x64()
    model = LatentToy(seed=4)
    post = sample(model, num_warmup=40, num_samples=NUM_SAMPLES, num_chains=2, seed=3, max_tree_depth=4,
                  init="prior", progress=False, diagnostics=False)
    return model, post


def _by_hand(model, post, thin, what):
    """(C, S, ...) stacks of the model's own per-draw results at draws 0, thin, 2 thin, ... of every chain."""
    kept = np.arange(0, post.draws_u.shape[1], thin)
    per = [[what(model.constrain(post.draws_u[c, s])) for s in kept] for c in range(post.draws_u.shape[0])]
    return kept, per


def test_latent_posterior_pools_by_the_law_of_total_variance(toy_post):
    model, post = toy_post
    assert post.model is model and post.progress is False
    thin = 3
    got = post.latent_posterior(thin=thin, progress=False)
    kept, per = _by_hand(model, post, thin, model.latent_posterior)
    assert len(got) == len(model.grids)
    for r, ds in enumerate(got):
        means = np.array([[p[r].mean for p in chain] for chain in per])  # (C, S, J, K)
        sds = np.array([[p[r].sd for p in chain] for chain in per])
        S = means.shape[0] * means.shape[1]
        flat_m, flat_v = means.reshape(S, -1), (sds**2).reshape(S, -1)
        mean = flat_m.sum(axis=0) / S
        var = flat_v.sum(axis=0) / S + ((flat_m - mean) ** 2).sum(axis=0) / S
        np.testing.assert_allclose(ds["mean"].values, mean.reshape(means.shape[2:]), rtol=1e-13, atol=1e-14)
        np.testing.assert_allclose(ds["sd"].values, np.sqrt(var).reshape(means.shape[2:]), rtol=1e-13)
        np.testing.assert_array_equal(ds["draws"].values, means)
        np.testing.assert_array_equal(ds["draw_sd"].values, sds)
        # the draws really differ, so the variance of the means is part of the pooled sd
        assert np.all(ds["sd"].values > np.sqrt(flat_v.sum(axis=0) / S).reshape(means.shape[2:]) + 1e-6)
        J, K = means.shape[2:]
        assert ds["draws"].dims == ("chain", "draw", "time", "factor")
        assert ds["mean"].dims == ("time", "factor") and ds["sd"].dims == ("time", "factor")
        np.testing.assert_array_equal(ds["draw"].values, kept)
        np.testing.assert_array_equal(ds["chain"].values, [0, 1])
        np.testing.assert_array_equal(ds["time"].values, model.grids[r])
        np.testing.assert_array_equal(ds["factor"].values, np.arange(K))
        assert ds.attrs["thin"] == thin and ds.attrs["run"] == r and ds.attrs["num_pooled"] == 2 * kept.size
        assert "cov" not in ds and "draw_cov" not in ds


def test_thin_keeps_every_thin_th_draw(toy_post):
    model, post = toy_post
    for thin, kept in ((1, np.arange(NUM_SAMPLES)), (5, [0, 5, 10]), (NUM_SAMPLES, [0])):
        ds = post.latent_posterior(thin=thin, progress=False)[1]
        np.testing.assert_array_equal(ds["draw"].values, kept)
        for c in range(2):
            for i, s in enumerate(kept):
                want = model.latent_posterior(model.constrain(post.draws_u[c, s]))[1]
                np.testing.assert_array_equal(ds["draws"].values[c, i], want.mean)
                np.testing.assert_array_equal(ds["draw_sd"].values[c, i], want.sd)


def test_pooled_covariance_is_mean_covariance_plus_covariance_of_means(toy_post):
    model, post = toy_post
    ds = post.latent_posterior(thin=4, cov=True, progress=False)[0]
    kept, per = _by_hand(model, post, 4, lambda p: model.latent_posterior(p, cov=True))
    means = np.array([[p[0].mean for p in chain] for chain in per]).reshape(-1, *ds["mean"].shape)
    covs = np.array([[p[0].cov for p in chain] for chain in per]).reshape(means.shape + (model.K,))
    S, J, K = means.shape
    want = np.zeros((J, K, K))
    for s in range(S):
        d = means[s] - means.mean(axis=0)
        want += covs[s] / S + np.einsum("jk,jl->jkl", d, d) / S
    np.testing.assert_allclose(ds["cov"].values, want, rtol=1e-12, atol=1e-14)
    assert ds["draw_cov"].dims == ("chain", "draw", "time", "factor", "factor2")
    # its diagonal is the pooled variance
    np.testing.assert_allclose(np.einsum("jkk->jk", ds["cov"].values), ds["sd"].values ** 2, rtol=1e-12)


def test_predict_pools_with_the_noise_variance(toy_post):
    model, post = toy_post
    got = post.predict(thin=2, progress=False)
    kept, per = _by_hand(model, post, 2, model.predict)
    assert len(got) == 2
    for r, streams in enumerate(got):
        assert list(streams) == ["p/x"]
        ds = streams["p/x"]
        preds = [p[r]["p/x"] for chain in per for p in chain]
        m = np.array([p.mean for p in preds])
        total_var = np.array([p.sd**2 for p in preds])  # noise included
        signal_var = np.array([p.signal_sd**2 for p in preds])
        spread = ((m - m.mean(axis=0)) ** 2).mean(axis=0)
        np.testing.assert_allclose(ds["mean"].values, m.mean(axis=0), rtol=1e-13, atol=1e-14)
        np.testing.assert_allclose(ds["sd"].values, np.sqrt(total_var.mean(axis=0) + spread), rtol=1e-13)
        np.testing.assert_allclose(ds["signal_sd"].values, np.sqrt(signal_var.mean(axis=0) + spread), rtol=1e-13)
        assert np.all(ds["sd"].values > ds["signal_sd"].values)
        assert ds["draws"].dims == ("chain", "draw", "sample", "feature")
        assert ds["draws"].shape == (2, kept.size, 3, 2)
        assert ds["mean"].dims == ("sample", "feature")
        assert ds["time"].dims == ("sample",)
        np.testing.assert_array_equal(ds["time"].values, model.grids[r][:3] + 1.0)
        np.testing.assert_array_equal(ds["draw"].values, kept)
        assert ds.attrs == {"thin": 2, "run": r, "key": "p/x", "num_pooled": 2 * kept.size}


def test_progress_bar_over_draws(toy_post, capsys):
    _, post = toy_post
    post.latent_posterior(thin=7, progress=True)
    assert "latent posterior" in capsys.readouterr().err


@pytest.mark.parametrize("thin, match", [(0, "thin must be a positive int"), (-2, "thin must be a positive int"),
                                         (2.0, "thin must be a positive int"), (True, "thin must be a positive int"),
                                         ("3", "thin must be a positive int"),
                                         (NUM_SAMPLES + 1, f"more than the {NUM_SAMPLES} draws")])
def test_bad_thin(toy_post, thin, match):
    _, post = toy_post
    with pytest.raises(ValueError, match=match):
        post.latent_posterior(thin=thin)
    with pytest.raises(ValueError, match=match):
        post.predict(thin=thin)


def test_a_posterior_without_its_model_refuses(toy_post):
    _, post = toy_post
    bare = Posterior(inference_data=post.inference_data, timings={}, execution_info={}, num_leapfrog=0,
                     num_leapfrog_warmup=None, seconds_per_leapfrog=None, draws_u=post.draws_u)
    with pytest.raises(ValueError, match="holds no model"):
        bare.latent_posterior(thin=2)


def test_plot_latents_draws_the_pooled_posterior(toy_post):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from msrm import plot

    _, post = toy_post
    result = post.latent_posterior(thin=2, progress=False)
    fig = plot.latents(result, run=1)
    try:
        assert len(fig.axes) == 2
        for k, ax in enumerate(fig.axes):
            np.testing.assert_array_equal(ax.lines[0].get_ydata(), result[1]["mean"].values[:, k])
    finally:
        plt.close(fig)


def test_gpmsrm_draws_pool_the_models_own_results():
    """The real model's result types: Params from model.constrain, LatentPosterior and Prediction per run; the time
    coordinate of a stream's samples is the stream's own clock. Draws scattered around the true parameters stand in
    for a chain (NUTS on a GPMSRM compiles for minutes; the toy chains above cover the sampler's side)."""
    import data_synth

    msrm.runtime.enable_x64()
    data, truth = data_synth.synthetic_dataset("tiny", n_features=2, seed=3, missing_fraction=0.1)
    model = msrm.GPMSRM(data, truth.spec, linear_algebra="grouped")
    u0 = model.unconstrain(truth.params)
    draws_u = u0 + 0.05 * np.random.default_rng(1).normal(size=(2, 4, u0.size))
    post = Posterior(inference_data=None, timings={}, execution_info={}, num_leapfrog=0, num_leapfrog_warmup=None,
                     seconds_per_leapfrog=None, draws_u=draws_u, model=model)
    (ds,) = post.latent_posterior(thin=2)
    (streams,) = post.predict(thin=2)
    lat = [model.latent_posterior(model.constrain(draws_u[c, s]))[0] for c in range(2) for s in (0, 2)]
    means, sds = np.array([z.mean for z in lat]), np.array([z.sd for z in lat])
    np.testing.assert_allclose(ds["mean"].values, means.mean(axis=0), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(ds["sd"].values, np.sqrt((sds**2).mean(axis=0) + means.var(axis=0)), rtol=1e-12)
    np.testing.assert_array_equal(ds["time"].values, msrm.latent_grid(data.runs[0].duration, truth.spec))
    assert ds["draws"].shape == (2, 2) + means.shape[1:]
    preds = [model.predict(model.constrain(draws_u[c, s]))[0] for c in range(2) for s in (0, 2)]
    assert set(streams) == set(data.stream_keys)
    for key, sds_ in streams.items():
        stream = data.runs[0].stream(key)
        m = np.array([p[key].mean for p in preds])
        v = np.array([p[key].sd ** 2 for p in preds])
        assert sds_["draws"].shape == (2, 2) + stream.values.shape
        np.testing.assert_allclose(sds_["mean"].values, m.mean(axis=0), rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(sds_["sd"].values, np.sqrt(v.mean(axis=0) + m.var(axis=0)), rtol=1e-12)
        np.testing.assert_allclose(sds_["time"].values, stream.times, rtol=0, atol=1e-12)
        assert np.isfinite(sds_["mean"].values).all()  # missing samples are predicted too
