"""The accuracy contract in the numerical corners, against a 50-digit reference (:mod:`mp_oracle`).

One factor seen by one stream on the latent grid (Identity response), parameters at the values that drew the data:
high signal-to-noise (loading 1e3 and 1e4 over noise 0.5), a smooth nearly noise-free latent (Matérn-5/2 with
lengthscale 50 s on a 0.5 s grid, noise 1e-4) and large offsets (intercepts 1e6 and 1e8, as raw scanner units).
The contract: log density within max(1e-6 relative, 1e-3 nats); gradient within 1e-5 of central differences of
the reference, relative to the largest gradient component; latent posterior mean within 1e-6 of the posterior
sd and sd within 1e-6 relative.
"""
from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest

import msrm

pytest.importorskip("mpmath")
from mp_oracle import corner_case, mp_latent_posterior, mp_loglik

jax = pytest.importorskip("jax")

CASES = {
    "loading_1e3": dict(loading=1e3, offset=0.0, noise_sd=0.5, lengthscale=4.0),
    "loading_1e4": dict(loading=1e4, offset=0.0, noise_sd=0.5, lengthscale=4.0),
    "smooth_prior": dict(loading=1.0, offset=0.0, noise_sd=1e-4, lengthscale=50.0, kernel="matern52", dt=0.5, n=80),
    "offset_1e6": dict(loading=1.0, offset=1e6, noise_sd=0.5, lengthscale=4.0),
    "offset_1e8": dict(loading=1.0, offset=1e8, noise_sd=0.5, lengthscale=4.0),
}
NODE_SPACE = ("dense", "grouped")


def _within_contract(value, ref):
    return abs(value - ref) <= max(1e-6 * abs(ref), 1e-3)


@pytest.fixture(scope="module")
def references():
    out = {}
    for name, kw in CASES.items():
        data, spec, params = corner_case(**kw)
        out[name] = (data, spec, params, float(mp_loglik(data, spec, params)))
    return out


@pytest.mark.parametrize("backend", NODE_SPACE)
@pytest.mark.parametrize("name", list(CASES))
def test_density_in_the_corners_matches_the_50_digit_reference(references, name, backend):
    data, spec, params, ref = references[name]
    model = msrm.GPMSRM(data, spec, linear_algebra=backend)
    value = model.log_likelihood(params)
    assert _within_contract(value, ref), (name, backend, value - ref)
    assert set(model.guard_events()) <= {0}, model.guard_events()


def _perturbed(params, leaf, h):
    if leaf == "lengthscales":
        return dataclasses.replace(params, lengthscales=params.lengthscales + h)
    block = {k: v + h for k, v in getattr(params, leaf).items()}
    return dataclasses.replace(params, **{leaf: block})


@pytest.mark.parametrize("backend", NODE_SPACE)
@pytest.mark.parametrize("name", ["loading_1e4", "smooth_prior", "offset_1e8"])
def test_gradient_in_the_corners_matches_central_differences_of_the_reference(references, name, backend):
    from msrm.gp.model import params_to_theta

    data, spec, params, _ = references[name]
    model = msrm.GPMSRM(data, spec, linear_algebra=backend)
    grad = jax.grad(lambda th: model.backend.loglik(th, model.prepared)[0])(params_to_theta(params))
    got, want = [], []
    for leaf in ("loadings", "intercepts", "noise_sd", "lengthscales"):
        value = float(np.ravel(params.lengthscales if leaf == "lengthscales" else getattr(params, leaf)["p0/brain"])[0])
        h = float((value + 1e-7 * max(abs(value), 1e-3)) - value)  # a step that float64 represents exactly
        fp = mp_loglik(data, spec, _perturbed(params, leaf, h))
        fm = mp_loglik(data, spec, _perturbed(params, leaf, -h))
        want.append(float((fp - fm) / (2 * h)))
        g = grad[leaf] if leaf == "lengthscales" else grad[leaf]["p0/brain"]
        got.append(float(np.ravel(g)[0]))
    got, want = np.array(got), np.array(want)
    # central differences of a 50-digit function: truncation error ~ h^2 f''' (relative 1e-14 here)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.max(np.abs(want)))


@pytest.mark.parametrize("backend", NODE_SPACE)
@pytest.mark.parametrize("name", ["loading_1e3", "loading_1e4", "smooth_prior", "offset_1e8"])
def test_latent_posterior_in_the_corners_matches_the_reference(references, name, backend):
    data, spec, params, _ = references[name]
    (_, mean, sd), = mp_latent_posterior(data, spec, params)
    post, = msrm.GPMSRM(data, spec, linear_algebra=backend).latent_posterior(params)
    assert np.max(np.abs(post.mean - mean) / sd) < 1e-6
    assert np.max(np.abs(post.sd - sd) / sd) < 1e-6


def test_the_intercept_enters_about_the_data_centre():
    """Shifting the data and the intercepts by the same large constant leaves the density unchanged."""
    data, spec, params = corner_case(3.0, 0.0, 0.5, 4.0)
    shifted_data, _, shifted = corner_case(3.0, 1e8, 0.5, 4.0)
    for backend in ("grouped", "state_space"):
        a = msrm.GPMSRM(data, spec, linear_algebra=backend).log_likelihood(params)
        b = msrm.GPMSRM(shifted_data, spec, linear_algebra=backend).log_likelihood(shifted)
        assert abs(a - b) < 1e-8 * abs(a), (backend, a, b)


def test_a_regularised_factorization_warns_and_names_the_cause():
    """Duplicated one-feature streams with huge loadings and tiny noise make M numerically singular: the guard
    regularises it, and the model says so the first time (the count stays in guard_events)."""
    from msrm.gp.accuracy import NumericalAccuracyWarning

    rng = np.random.default_rng(0)
    y = rng.normal(size=(21, 1))
    streams = [msrm.Stream(p, "rating", 1.0, y) for p in ("a", "b", "c", "d", "e")]
    spec = msrm.ModelSpec(n_factors=2, latent_dt=1.0, responses={"rating": msrm.Identity()})
    data = msrm.Dataset([msrm.Run(20.0, streams)])
    params = msrm.Params(
        loadings={s.key: np.array([[1e6, 1e6]]) + rng.normal(0.0, 1e3, (1, 2)) for s in streams},
        intercepts={s.key: np.zeros(1) for s in streams}, noise_sd={s.key: np.full(1, 1e-7) for s in streams},
        lengthscales=np.array([1e9, 1e9]))
    model = msrm.GPMSRM(data, spec, "grouped")
    with pytest.warns(NumericalAccuracyWarning, match="regularised"):
        model.log_likelihood(params)
    assert 0 not in model.guard_events()


def test_a_healthy_evaluation_says_nothing(recwarn):
    from msrm.gp.accuracy import NumericalAccuracyWarning

    data, spec, params = corner_case(1.0, 0.0, 0.5, 4.0)
    msrm.GPMSRM(data, spec, "grouped").log_likelihood(params)
    assert not [w for w in recwarn if issubclass(w.category, NumericalAccuracyWarning)]


@pytest.mark.parametrize("backend", ["dense", "grouped"])
def test_latent_sd_pinned_far_below_its_prior_warns_and_a_well_scaled_one_does_not(backend):
    """A loading 1e5 times the noise sd pins the latent to a posterior sd of about 1e-5 of its prior's, where the
    variance (the prior's less the data's reduction) keeps about 1e-6 relative accuracy in the sd: the call says so.
    The warning's bound is checked against the 50-digit sd, and a well-scaled case stays silent."""
    from msrm.gp.accuracy import LATENT_SD_RTOL, NumericalAccuracyWarning, latent_sd_rounding

    data, spec, params = corner_case(5e4, 0.0, 0.5, 4.0, kernel="matern12", n=40)
    model = msrm.GPMSRM(data, spec, linear_algebra=backend)
    with pytest.warns(NumericalAccuracyWarning, match="posterior sd"):
        post, = model.latent_posterior(params)
    _, _, ref_sd = mp_latent_posterior(data, spec, params)[0]
    err = np.abs(post.sd - ref_sd) / ref_sd
    assert np.all(err <= latent_sd_rounding(ref_sd))  # the bound the warning states holds
    assert np.max(latent_sd_rounding(post.sd)) > LATENT_SD_RTOL
    data, spec, params = corner_case(1.0, 0.0, 0.5, 4.0, n=40)
    model = msrm.GPMSRM(data, spec, linear_algebra=backend)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NumericalAccuracyWarning)
        model.latent_posterior(params)
