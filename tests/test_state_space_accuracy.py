"""State-space backend in numerical corners, against a 50-digit mpmath oracle (:mod:`mp_oracle`).

The corners: a smooth prior observed with little noise (Matérn-5/2, lengthscale 100 grid steps, noise sd 1e-4),
large loadings against the noise (1e3 and 1e4 over sd 0.5, Matérn-3/2), and a sweep over kernels. Checked:

* the discretised process noise ``Q(τ) = P∞ − Φ P∞ Φᵀ`` entry by entry against mpmath for ``λτ`` from 1e-4 to 1e3,
  and its lengthscale derivative where the two forms it is computed by meet;
* the log density (within ``max(1e-6 |ref|, 1e-3)`` nats), its gradient in the lengthscale, noise sd and loading
  (each within 1e-5 of itself, against central differences of the oracle) and the latent posterior mean and sd
  (within 1e-6 of the sd) for ``method="native"`` and ``"callback"``;
* the guards: an ill-conditioned block, node information beyond what float64 covariances resolve and the
  associative scan's data term each warn with :class:`msrm.gp.accuracy.NumericalAccuracyWarning` naming the cause
  and the remedy, and the brute-force reference density raises a ValueError naming its cause.

The oracle is pure Python and O(n^3): every case here has at most 80 values.
"""
from __future__ import annotations

import copy
import warnings

import jax
import jax.numpy as jnp
import mpmath as mp
import numpy as np
import pytest

import msrm
from msrm.gp.accuracy import NumericalAccuracyWarning
from msrm.gp.model import params_to_theta
from msrm.gp.reference import brute_force_loglik
from msrm.gp.state_space import loglik, prepare, sde
from mp_oracle import MATERN_P, mp_latent_posterior, mp_loglik

KERNELS = tuple(msrm.kernels.KERNELS)
KEY = "p0/brain"


def corner(w, sd, ell, kernel="matern32", n=70, dt=1.0, seed=0, b=0.0):
    """One factor, one one-feature stream sampled on the latent grid (Identity response), the latent drawn from
    its prior: ``y = b + w z(t) + sd ε``. Returns (data, spec, params)."""
    msrm.runtime.enable_x64()
    rng = np.random.default_rng(seed)
    T = (n - 1) * dt
    spec = msrm.ModelSpec(n_factors=1, latent_dt=dt, kernel=kernel, pooling="shared", latent_pad=0.0,
                          responses={"brain": msrm.Identity()})
    grid = msrm.latent_grid(T, spec)
    r = np.abs(grid[:, None] - grid[None, :])
    ev, evec = np.linalg.eigh(msrm.kernels.get_kernel(kernel).correlation(r, ell, np))
    z = evec @ (np.sqrt(np.clip(ev, 0, None)) * rng.standard_normal(ev.size))
    t = np.arange(n) * dt
    Y = b + w * np.interp(t, grid, z)[:, None] + sd * rng.standard_normal((n, 1))
    data = msrm.Dataset([msrm.Run(duration=T, streams=[msrm.Stream(participant="p0", modality="brain", dt=dt,
                                                                    values=Y, offset=0.0)])])
    params = msrm.Params(loadings={KEY: np.array([[w]])}, intercepts={KEY: np.array([b])},
                         noise_sd={KEY: np.array([sd])}, lengthscales=np.array([ell]), response={})
    return data, spec, params


CORNERS = {
    "smooth": dict(w=1.0, sd=1e-4, ell=50.0, kernel="matern52", n=80, dt=0.5),
    "w1e3": dict(w=1e3, sd=0.5, ell=4.0),
    "w1e4": dict(w=1e4, sd=0.5, ell=4.0),
}


@pytest.fixture(scope="module")
def oracle():
    """The oracle's density and latent posterior of each corner, computed once."""
    out = {}
    for name, cfg in CORNERS.items():
        data, spec, params = corner(**cfg)
        _, mean, sd = mp_latent_posterior(data, spec, params)[0]
        out[name] = (data, spec, params, float(mp_loglik(data, spec, params)), mean, sd)
    return out


def density_ok(value, ref):
    return abs(value - ref) <= max(1e-6 * abs(ref), 1e-3)


def model(data, spec, **options):
    return msrm.GPMSRM(data, spec, linear_algebra="state_space", **options)


# ------------------------------------------------------------------------------------------ process noise


@pytest.mark.parametrize("kernel", KERNELS)
def test_process_noise_matches_mpmath_without_cancellation(kernel):
    form = msrm.kernels.get_kernel(kernel)
    p, d = MATERN_P[kernel], form.n_states
    mp.mp.dps = 40
    lam = mp.sqrt(2 * p + 1)  # lengthscale 1
    F = mp.matrix(d, d)
    for i in range(d - 1):
        F[i, i + 1] = 1
    for j in range(d):
        F[d - 1, j] = -mp.binomial(d, j) * lam ** (d - j)
    Pinf = mp.matrix(np.asarray(form.stationary_cov(1.0)).tolist())  # rationals times powers of λ, to 1e-16
    for x in (1e-4, 1e-2, 0.3, 1.9, 2.0, 2.1, 30.0, 1e3):
        tau = x / float(lam)
        Phi = mp.expm(F * mp.mpf(tau))
        Q = np.array((Pinf - Phi * Pinf * Phi.T).tolist(), dtype=np.float64)
        for xp in (np, jnp):
            got = np.asarray(sde.process_noise(kernel, 1.0 if xp is np else jnp.asarray(1.0), [tau], xp)[0])
            scale = np.sqrt(np.outer(np.diag(Q), np.diag(Q)))  # an entry's size is that of its variances
            # the reference takes P∞ as a float64 input: its own rounding, relative to Q, is ε |P∞| / |Q|
            assert np.max(np.abs(got - Q) / scale) <= 1e-12 + 4e-16 * np.max(np.abs(np.diag(Pinf.tolist()))) / np.min(np.diag(Q)), (kernel, x)


@pytest.mark.parametrize("kernel", ["matern12", "matern52"])
def test_process_noise_derivative_is_continuous_where_the_forms_meet(kernel):
    msrm.runtime.enable_x64()
    lam1 = msrm.kernels.get_kernel(kernel).rate(1.0)
    tau = np.array([sde.SERIES_SWITCH / lam1])  # λτ exactly at the switch (ℓ = 1)
    f = lambda ell: sde.process_noise(kernel, ell, tau, jnp)[0]
    g = np.asarray(jax.jacfwd(f)(jnp.asarray(1.0)))
    h = 1e-6
    fd = (np.asarray(f(1.0 + h)) - np.asarray(f(1.0 - h))) / (2 * h)
    np.testing.assert_allclose(g, fd, rtol=1e-6, atol=1e-9 * np.abs(fd).max())


# ------------------------------------------------------------------------------------------ corners


@pytest.mark.parametrize("method", ["native", "callback"])
@pytest.mark.parametrize("name", list(CORNERS))
def test_corner_density_and_latent_posterior_match_the_oracle(oracle, name, method):
    data, spec, params, ref, mean, sd = oracle[name]
    # the smooth corner's automatic blocks are ill-conditioned there (the guard below): one-step blocks
    options = dict(method=method, block=1 if name == "smooth" else None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NumericalAccuracyWarning)
        m = model(data, spec, **options)
        value = m.log_likelihood(params)
        post = m.latent_posterior(params)[0]
    assert density_ok(value, ref), (value - ref)
    assert np.max(np.abs(post.mean - mean) / sd) <= 1e-6
    assert np.max(np.abs(post.sd - sd) / sd) <= 1e-6
    assert np.all(post.sd > 0)


def with_param(params, field, value):
    p = copy.deepcopy(params)
    if field == "ell":
        return msrm.Params(loadings=p.loadings, intercepts=p.intercepts, noise_sd=p.noise_sd,
                           lengthscales=np.array([value]), response={})
    if field == "sd":
        return msrm.Params(loadings=p.loadings, intercepts=p.intercepts, noise_sd={KEY: np.array([value])},
                           lengthscales=p.lengthscales, response={})
    return msrm.Params(loadings={KEY: np.array([[value]])}, intercepts=p.intercepts, noise_sd=p.noise_sd,
                       lengthscales=p.lengthscales, response={})


def oracle_gradient(data, spec, params):
    """Central differences of the 50-digit oracle in the lengthscale, noise sd and loading (step 1e-7 relative:
    the oracle's own rounding is 1e-50, the truncation 1e-14 relative)."""
    out = {}
    for field, x0 in (("ell", params.lengthscales[0]), ("sd", params.noise_sd[KEY][0]),
                      ("w", params.loadings[KEY][0, 0])):
        h = 1e-7 * abs(x0)
        up, down = x0 + h, x0 - h
        out[field] = float((mp_loglik(data, spec, with_param(params, field, up))
                            - mp_loglik(data, spec, with_param(params, field, down))) / (mp.mpf(up) - mp.mpf(down)))
    return out


_GRADIENTS: dict = {}


@pytest.mark.parametrize("method", ["native", "callback"])
@pytest.mark.parametrize("name", list(CORNERS))
def test_corner_gradient_matches_central_differences_of_the_oracle(oracle, name, method):
    data, spec, params, *_ = oracle[name]
    if name not in _GRADIENTS:
        _GRADIENTS[name] = oracle_gradient(data, spec, params)
    ref = _GRADIENTS[name]
    prepared = prepare(data, spec, method=method, block=1 if name == "smooth" else None)
    g = jax.jit(jax.grad(lambda th: loglik(th, prepared)[0]))(params_to_theta(params))
    got = {"ell": float(g["lengthscales"][0]), "sd": float(g["noise_sd"][KEY][0]),
           "w": float(g["loadings"][KEY][0, 0])}
    for field in ref:
        assert abs(got[field] - ref[field]) <= 1e-5 * abs(ref[field]), (field, got[field], ref[field])


@pytest.mark.parametrize("kernel", KERNELS)
def test_every_kernel_with_a_long_lengthscale_and_precise_data(kernel):
    # lengthscale 50 grid steps, loading 1e4 times the noise: one-step blocks meet the tolerance for every kernel
    data, spec, params = corner(w=1.0, sd=1e-4, ell=50.0, kernel=kernel, n=40)
    ref = float(mp_loglik(data, spec, params))
    _, mean, sd = mp_latent_posterior(data, spec, params)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error", NumericalAccuracyWarning)
        m = model(data, spec, method="callback", block=1)
        assert density_ok(m.log_likelihood(params), ref)
        post = m.latent_posterior(params)[0]
    assert np.max(np.abs(post.mean - mean) / sd) <= 1e-6
    assert np.max(np.abs(post.sd - sd) / sd) <= 1e-6


# ------------------------------------------------------------------------------------------ guards


def test_ill_conditioned_blocks_warn_with_cause_and_remedy_and_the_smoother_switches(oracle):
    data, spec, params, ref, mean, sd = oracle["smooth"]
    m = model(data, spec, method="callback", block=16)
    with pytest.warns(NumericalAccuracyWarning, match=r"ill-conditioned.*block=1"):
        m.log_likelihood(params)
    code = max(m.guard_events())
    assert code >> msrm.gp.state_space.filter.LEVEL_SHIFT > 0
    # the latent posterior falls back to one-step blocks by itself: accurate, and no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error", NumericalAccuracyWarning)
        post = m.latent_posterior(params)[0]
    assert np.max(np.abs(post.sd - sd) / sd) <= 1e-6


def test_information_beyond_float64_covariances_warns_in_the_latent_posterior():
    # noise 1e-6 of the signal: posterior variances carry relative rounding near 1e-4 in any covariance filter
    data, spec, params = corner(w=1.0, sd=1e-6, ell=5.0, n=30)
    m = model(data, spec, method="callback")
    with pytest.warns(NumericalAccuracyWarning, match=r"information is up to .* noise floor"):
        m.latent_posterior(params)


def test_associative_scan_warns_about_its_data_term():
    data, spec, params = corner(w=1.0, sd=1e-6, ell=5.0, n=30)
    m = model(data, spec, parallel=True)
    with pytest.warns(NumericalAccuracyWarning, match=r"associative scan.*parallel=False"):
        m.log_likelihood(params)
    # the sequential scan, on the same data, meets the tolerance without a warning
    ref = float(mp_loglik(data, spec, params))
    with warnings.catch_warnings():
        warnings.simplefilter("error", NumericalAccuracyWarning)
        assert density_ok(model(data, spec, method="callback").log_likelihood(params), ref)


def test_brute_force_reference_survives_the_smooth_corner_and_names_what_it_cannot_do(oracle):
    data, spec, params, ref, *_ = oracle["smooth"]
    assert density_ok(brute_force_loglik(data, spec, params), ref)
    data, spec, params = corner(w=1.0, sd=1e-9, ell=1000.0, kernel="matern72", n=80, dt=0.5)
    with pytest.raises(ValueError, match=r"not positive definite in float64.*noise sds"):
        brute_force_loglik(data, spec, params)
