"""Transforms to unconstrained space: round trip, log-Jacobian against an autodiff/finite-difference Jacobian,
priors against SciPy densities, prior draws inside the bounds."""
from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

import msrm
import data_synth

msrm.runtime.enable_x64()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from msrm.gp import transforms as tf  # noqa: E402


@pytest.fixture(scope="module")
def setup():
    data, truth = data_synth.synthetic_dataset("tiny", n_features=2, seed=1, n_factors=2)
    blocks = tf.param_blocks(data, truth.spec)
    return data, truth, blocks


def _flat_theta(theta, blocks):
    out = []
    for b in blocks:
        if b.field == "lengthscales":
            out.append(jnp.ravel(theta["lengthscales"]))
        elif b.field == "response":
            out.append(jnp.ravel(theta["response"][b.key][b.pname]))
        else:
            out.append(jnp.ravel(theta[b.field][b.key]))
    return jnp.concatenate(out)


def test_round_trip(setup):
    data, truth, blocks = setup
    u = tf.unconstrain(truth.params, blocks)
    theta, _ = tf.constrain(u, blocks)
    back = tf.theta_to_params(theta)
    assert back.allclose(truth.params, rtol=1e-12)
    np.testing.assert_allclose(tf.unconstrain(back, blocks), u, rtol=1e-11, atol=1e-12)
    names = [b.name for b in blocks]
    assert names[-3:] == ["response/rating/lag", "response/physio/lag", "response/physio/width"]


def test_log_jacobian_matches_jacobian_determinant(setup):
    data, truth, blocks = setup
    u = np.random.default_rng(0).normal(size=blocks[-1].start + blocks[-1].size)
    flat = lambda v: _flat_theta(tf.constrain(v, blocks)[0], blocks)  # noqa: E731
    J = np.asarray(jax.jacfwd(flat)(jnp.asarray(u)))
    sign, logdet = np.linalg.slogdet(J)
    assert sign > 0
    assert float(tf.constrain(u, blocks)[1]) == pytest.approx(logdet, rel=1e-12)
    # and the diagonal against central finite differences
    h = 1e-6
    for i in range(0, u.size, 3):
        e = np.zeros_like(u)
        e[i] = h
        fd = (np.asarray(flat(u + e)) - np.asarray(flat(u - e)))[i] / (2 * h)
        assert J[i, i] == pytest.approx(fd, rel=1e-7)


def test_constrain_gradient_and_errors(setup):
    # the vector is split once; its gradient (a concatenation) equals the reverse Jacobian built from jacfwd
    data, truth, blocks = setup
    u = jnp.asarray(np.random.default_rng(1).normal(size=blocks[-1].start + blocks[-1].size))
    w = jnp.asarray(np.random.default_rng(2).normal(size=u.size))
    f = lambda v: jnp.dot(w, _flat_theta(tf.constrain(v, blocks)[0], blocks)) + tf.constrain(v, blocks)[1]  # noqa
    np.testing.assert_allclose(np.asarray(jax.grad(f)(u)), np.asarray(jax.jacfwd(f)(u)), rtol=1e-13, atol=1e-14)
    with pytest.raises(ValueError, match=r"u must have shape"):
        tf.constrain(u[:-1], blocks)
    with pytest.raises(ValueError, match="tile"):
        tf.constrain(u, blocks[1:])


def test_bounded_transform_stays_inside_and_rejects_bounds(setup):
    data, truth, blocks = setup
    b = next(b for b in blocks if b.transform == "logit")
    for x in (-40.0, 0.0, 40.0):
        u = np.zeros(blocks[-1].start + blocks[-1].size)
        u[b.start] = x
        theta, logdet = tf.constrain(u, blocks)
        v = float(theta["response"][b.key][b.pname])
        assert b.bounds[0] <= v <= b.bounds[1] and np.isfinite(float(logdet))
    lo = b.bounds[0]
    bad = truth.params.replace(response={**truth.params.response, b.key: {**truth.params.response[b.key], b.pname: lo}})
    with pytest.raises(ValueError, match=f"{b.name}.*bound"):
        tf.unconstrain(bad, blocks)


def test_log_prior_matches_scipy(setup):
    data, truth, blocks = setup
    pri = tf.default_priors(data, truth.spec)
    p = truth.params
    theta = {"loadings": p.loadings, "intercepts": p.intercepts, "noise_sd": p.noise_sd,
             "lengthscales": p.lengthscales, "response": p.response}
    ref = 0.0
    for key in data.stream_keys:
        ref += stats.norm.logpdf(p.loadings[key], 0.0, pri.loading_sd[key][:, None]).sum()
        ref += stats.norm.logpdf(p.intercepts[key], pri.intercept_loc[key], pri.intercept_sd[key]).sum()
        ref += stats.lognorm.logpdf(p.noise_sd[key], s=pri.log_noise_sd, scale=np.exp(pri.log_noise_loc[key])).sum()
    ref += stats.lognorm.logpdf(p.lengthscales, s=pri.log_lengthscale_sd, scale=np.exp(pri.log_lengthscale_loc)).sum()
    for b in blocks:
        if b.transform == "logit":
            ref += stats.uniform.logpdf(p.response[b.key][b.pname], b.bounds[0], b.bounds[1] - b.bounds[0])
    assert float(tf.log_prior(theta, pri, blocks)) == pytest.approx(ref, rel=1e-12)
    # the data scale sets the priors
    Y = data.runs[0].stream("p1/brain").values
    np.testing.assert_allclose(pri.intercept_loc["p1/brain"], np.nanmean(Y, axis=0))
    np.testing.assert_allclose(pri.loading_sd["p1/brain"], np.nanstd(Y, axis=0))
    assert pri.log_lengthscale_loc == pytest.approx(np.log(10 * truth.spec.latent_dt))


def test_prior_draws_follow_the_priors(setup):
    data, truth, blocks = setup
    pri = tf.default_priors(data, truth.spec, {"lengthscale_log_sd": 0.5})
    draws = np.stack([tf.prior_draw(s, pri, blocks) for s in range(400)])
    lag = next(b for b in blocks if b.name == "response/physio/lag")
    x = np.stack([float(tf.constrain(d, blocks)[0]["response"]["physio"]["lag"]) for d in draws[:200]])
    lo, hi = lag.bounds
    assert stats.kstest((x - lo) / (hi - lo), "uniform").pvalue > 1e-3
    ell = next(b for b in blocks if b.name == "lengthscales")
    logs = draws[:, ell.start]
    assert abs(logs.mean() - pri.log_lengthscale_loc) < 4 * 0.5 / np.sqrt(400)
    assert logs.std() == pytest.approx(0.5, rel=0.15)


def test_prior_overrides_are_checked(setup):
    data, truth, blocks = setup
    with pytest.raises(KeyError, match="unknown hyperparameter"):
        tf.default_priors(data, truth.spec, {"loading": 1.0})
    with pytest.raises(ValueError, match="noise_log_sd"):
        tf.default_priors(data, truth.spec, {"noise_log_sd": -1.0})
