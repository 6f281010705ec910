"""The Laplace approximation N(u*, H^{-1}) at the MAP: its Hessian against exact and finite-difference references,
its draws' moments, agreement with NUTS on a tiny GP design, the Posterior interface, and its refusals."""
from __future__ import annotations

import numpy as np
import pytest

import msrm.runtime
from msrm.gp import idata as idata_mod
from msrm.gp.laplace import LaplacePosterior, NotPositiveDefiniteError, approximate_posterior, laplace_hessian
from msrm.gp.posterior import Posterior

from toy_model import ToyModel

# lengthscales and response parameters: invariant under the factors' sign flip, so NUTS and Laplace compare directly
SHARED = ("lengthscales[0]", "response|rating|lag", "response|physio|lag", "response|physio|width")


@pytest.fixture(scope="module")
def tiny():
    """A one-factor tiny GP design (28 parameters), its converged MAP and a Laplace approximation there."""
    import data_synth

    msrm.runtime.enable_x64()
    data, truth = data_synth.synthetic_dataset("tiny", n_features=2, seed=0, n_factors=1)
    model = msrm.GPMSRM(data, truth.spec, linear_algebra="grouped", method="native")
    fit = model.fit_map(seed=0, progress=False)
    assert fit.converged
    post = model.approximate_posterior(init=fit, method="laplace", num_samples=1000, seed=0)
    return model, fit, post


def _central_differences(model, u, h):
    """(d, d) -(g(u + h e_j) - g(u - h e_j)) / 2h with one absolute step h, from value_and_grad."""
    d = u.size
    H = np.empty((d, d))
    for j in range(d):
        e = np.zeros(d)
        e[j] = h
        H[:, j] = -(model.value_and_grad(u + e)[1] - model.value_and_grad(u - e)[1]) / (2 * h)
    return H


# ------------------------------------------------------------------------------------------ (1) the Hessian


def test_gaussian_model_is_exact_for_both_hessians():
    # log density quadratic in u: H is the posterior precision A^T A / s^2 + I / tau^2 and N(u*, H^-1) the posterior
    model = ToyModel(seed=2)
    precision = np.linalg.inv(model.post_cov)
    for method, rtol in (("autodiff", 1e-12), ("finite_difference", 1e-8)):
        H, used, asym, fallback = laplace_hessian(model, model.post_mean, method)
        assert used == method and fallback is None
        assert np.max(np.abs(H - precision)) <= rtol * np.max(np.abs(precision)), method
    post = approximate_posterior(model, init=model.post_mean, num_samples=10, seed=0, hessian="autodiff")
    np.testing.assert_allclose(post.covariance_u, model.post_cov, rtol=1e-10, atol=1e-14)
    np.testing.assert_array_equal(post.mode_u, model.post_mean)


def test_gp_hessian_matches_central_differences_of_value_and_grad(tiny):
    # the implementation's relative step eps^(1/3) ~ 6e-6 against an independent absolute step 1e-4, and against
    # the state-space backend's gradient (an independent implementation of the same density)
    model, fit, post = tiny
    H = post.hessian
    assert post.hessian_method == "finite_difference"
    ref = _central_differences(model, fit.u, 1e-4)
    ref = 0.5 * (ref + ref.T)
    assert np.max(np.abs(H - ref)) <= 1e-6 * np.max(np.abs(ref))
    state_space = msrm.GPMSRM(model.data, model.spec, linear_algebra="state_space", method="native")
    H_ss, used, _, _ = laplace_hessian(state_space, fit.u)
    assert used == "finite_difference"
    assert np.max(np.abs(0.5 * (H_ss + H_ss.T) - H)) <= 1e-6 * np.max(np.abs(H))
    assert post.inference_data.posterior.attrs["sampler"]  # recorded (JSON) with asymmetry and eigenvalues
    sampler = _sampler(post)
    assert sampler["hessian_asymmetry"] < 1e-8 and sampler["eigenvalue_min"] > 0
    np.testing.assert_allclose(sampler["eigenvalue_max"], np.linalg.eigvalsh(H)[-1], rtol=1e-12)


def test_auto_falls_back_when_jax_cannot_differentiate_twice(tiny):
    # the grouped factorization is a custom_vjp function: no forward mode, so "auto" uses finite differences
    model, fit, post = tiny
    H, used, _, fallback = laplace_hessian(model, fit.u, "auto")
    assert used == "finite_difference" and "custom_vjp" in fallback
    np.testing.assert_array_equal(H, laplace_hessian(model, fit.u, "finite_difference")[0])


# ------------------------------------------------------------------------------------------ (2) the draws


def _check_moments(draws, mean, cov, k=5.0):
    """Sample mean within k standard errors sqrt(cov_ii / S) of ``mean``; sample covariance within k standard
    errors sqrt((cov_ii cov_jj + cov_ij^2) / S) (Gaussian draws) of ``cov``, entry by entry."""
    S = draws.shape[0]
    sd = np.sqrt(np.diag(cov))
    assert np.all(np.abs(draws.mean(axis=0) - mean) <= k * sd / np.sqrt(S))
    se_cov = np.sqrt((np.outer(sd**2, sd**2) + cov**2) / S)
    assert np.all(np.abs(np.cov(draws.T) - cov) <= k * se_cov)


def test_draws_have_the_mode_as_mean_and_the_inverse_hessian_as_covariance(tiny):
    toy = ToyModel(seed=2)
    post = approximate_posterior(toy, init=toy.post_mean, num_samples=4000, seed=3, hessian="autodiff",
                                 diagnostics=False)
    assert post.draws_u.shape == (1, 4000, toy.num_params)
    _check_moments(post.draws_u[0], toy.post_mean, toy.post_cov)
    model, fit, post = tiny  # 28 parameters, 1000 draws
    _check_moments(post.draws_u[0], fit.u, np.linalg.inv(post.hessian))
    # log q is the Gaussian's own log density at every draw
    from scipy.stats import multivariate_normal

    want = multivariate_normal(fit.u, np.linalg.inv(post.hessian)).logpdf(post.draws_u[0, :5])
    np.testing.assert_allclose(post.sample_stats["log_q"][0, :5], want, rtol=1e-9)


# ------------------------------------------------------------------------------------------ (3) against NUTS


@pytest.mark.slow
def test_laplace_agrees_with_nuts_on_a_tiny_design(tiny):
    # Tolerance: NUTS marginal means within 2 NUTS posterior sds and sds within a factor of 2. The posterior of
    # 28 parameters from two features per stream is not Gaussian (importance ESS of the Gaussian is small), so this
    # is the scale of agreement a Laplace approximation promises, not a Monte Carlo tolerance; 400 NUTS draws
    # (ESS ~100) add an MC error near 0.1 sd to the means and about 10% to the sds.
    model, fit, lap = tiny
    nuts = model.sample(num_warmup=300, num_samples=400, num_chains=1, seed=1, max_tree_depth=6, init=fit,
                        progress=False)
    assert nuts.summary.attrs["divergences"]["num_divergent"] == 0
    for name in SHARED:
        a, b = lap.summary.loc[name], nuts.summary.loc[name]
        assert abs(a["mean"] - b["mean"]) <= 2 * b["sd"], (name, a["mean"], b["mean"], b["sd"])
        assert 0.5 <= a["sd"] / b["sd"] <= 2.0, (name, a["sd"], b["sd"])


# ------------------------------------------------------------------------------------------ (4) the result


def _sampler(post):
    import json

    s = post.inference_data.posterior.attrs["sampler"]
    return json.loads(s) if isinstance(s, str) else s


def test_result_has_the_layout_of_sample(tiny):
    model, fit, post = tiny
    assert isinstance(post, LaplacePosterior) and isinstance(post, Posterior)
    idata = post.inference_data
    assert {"posterior", "unconstrained_posterior", "sample_stats", "observed_data"} <= set(
        idata_mod.group_names(idata))
    # the same variables and dims as sample(): build_inference_data of the same draws
    ref = idata_mod.build_inference_data(model, post.draws_u[:, :3])
    for name, var in ref.posterior.data_vars.items():
        assert idata.posterior[name].dims == var.dims, name
        np.testing.assert_array_equal(idata.posterior[name].values[:, :3], var.values)
    assert idata.posterior["loadings|p1|brain"].dims == ("chain", "draw", "p1_brain_feature", "factor")
    assert idata.posterior.sizes["chain"] == 1 and idata.posterior.sizes["draw"] == 1000
    assert set(idata.sample_stats.data_vars) == {"lp", "log_q"} and post.num_leapfrog == 0
    for phase in ("mode", "hessian", "draws", "draw_conversion", "diagnostics", "total"):
        assert post.timings[phase] >= 0, phase
    assert post.execution_info["linear_algebra"] == "grouped" and post.map_result is fit
    sampler = _sampler(post)
    assert sampler["method"] == "laplace" and sampler["num_samples"] == 1000
    assert 0 < sampler["importance_ess"] <= 1000
    s = post.summary
    assert np.isfinite(s.loc[list(SHARED), "ess_bulk"]).all()
    np.testing.assert_allclose(post.sample_stats["lp"][0, 0], model.value_and_grad(post.draws_u[0, 0])[0],
                               rtol=1e-10)


def test_latent_posterior_and_predict_with_thin(tiny):
    model, fit, post = tiny
    (z,) = post.latent_posterior(thin=250)
    assert z["draws"].shape[:2] == (1, 4) and list(z["draw"].values) == [0, 250, 500, 750]
    one = model.latent_posterior(model.constrain(post.draws_u[0, 250]))[0]
    np.testing.assert_allclose(z["draws"].values[0, 1], one.mean, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(z["mean"].values, z["draws"].values.mean(axis=(0, 1)), rtol=1e-12)
    (pred,) = post.predict(thin=500)
    p = pred["p1/brain"]
    assert p["draws"].shape[:2] == (1, 2) and p["mean"].shape == model.data.runs[0].stream("p1/brain").values.shape
    assert np.all(p["sd"].values >= p["draw_sd"].values.min(axis=(0, 1)) - 1e-12)
    with pytest.raises(ValueError, match="thin"):
        post.predict(thin=0)


# ------------------------------------------------------------------------------------------ (5) refusals


class _Saddle:
    """log p(u) = -u0^2 / 2 + u1^2 / 2: a stationary point at 0 that is no maximum (negative curvature along b)."""

    num_params = 2
    param_names = ("a", "b")

    def log_density(self, u):
        return -0.5 * u[0] ** 2 + 0.5 * u[1] ** 2

    def value_and_grad(self, u):
        u = np.asarray(u, dtype=float)
        return float(-0.5 * u[0] ** 2 + 0.5 * u[1] ** 2), np.array([-u[0], u[1]])

    def constrain(self, u):
        return u


def test_refusals(tiny):
    model, fit, _ = tiny
    with pytest.raises(ValueError, match=r"method must be one of \('laplace',\).*pathfinder"):
        model.approximate_posterior(init=fit, method="pathfinder")
    for bad in (0, -3, 2.5, True, "10"):
        with pytest.raises(ValueError, match="num_samples must be an integer >= 1"):
            model.approximate_posterior(init=fit, num_samples=bad)
    with pytest.raises(ValueError, match=rf"shape \({model.num_params - 1},\), expected \({model.num_params},\)"):
        model.approximate_posterior(init=fit.u[:-1])
    with pytest.raises(ValueError, match="hessian must be one of"):
        model.approximate_posterior(init=fit, hessian="bfgs")
    with pytest.raises(NotPositiveDefiniteError, match=r"1 of 2 eigenvalues(.|\n)*along b \([+-]1\.00\)(.|\n)*NUTS"):
        approximate_posterior(_Saddle(), init=np.zeros(2), hessian="autodiff")
