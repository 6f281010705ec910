"""GPMSRM: gradient against finite differences and check_grads, compiled once, bad input before numerics."""
from __future__ import annotations

import numpy as np
import pytest

import msrm
import data_synth

msrm.runtime.enable_x64()

import jax  # noqa: E402
from jax.test_util import check_grads  # noqa: E402

from msrm.gp import likelihood as L  # noqa: E402
from msrm.gp.model import GPMSRM  # noqa: E402


@pytest.fixture(scope="module")
def small():
    data, truth = data_synth.synthetic_dataset("tiny", n_features=3, seed=2, pooling="individual",
                                               missing_fraction=0.1)
    return data, truth, GPMSRM(data, truth.spec, "grouped")


def test_value_and_grad_matches_central_differences(small):
    data, truth, model = small
    u = model.prior_draw(seed=3)
    value, grad = model.value_and_grad(u)
    assert np.isfinite(value) and grad.shape == (model.num_params,)
    names = model.param_names
    pick = [names.index("lengthscales[0]"), names.index("response/p3/physio/width"),
            names.index("response/p4/rating/lag"), names.index("noise_sd/p1/brain[2]"),
            names.index("loadings/p3/rating[0,1]"), names.index("intercepts/p2/brain[0]")]
    # The value carries ~1e-13 relative rounding (large cancelling terms), so steps are not tiny; Richardson
    # extrapolation of two central differences removes the O(h^2) truncation error.
    def central(i, h):
        e = np.zeros_like(u)
        e[i] = h
        return (model.value_and_grad(u + e)[0] - model.value_and_grad(u - e)[0]) / (2 * h)

    for i in pick:
        fd = (4 * central(i, 1e-3) - central(i, 2e-3)) / 3
        assert grad[i] == pytest.approx(fd, rel=2e-6, abs=1e-6), names[i]


def test_check_grads_on_log_density(small):
    data, truth, model = small
    u = jax.numpy.asarray(model.prior_draw(seed=4))
    check_grads(jax.jit(model.log_density), (u,), order=1, modes=("rev",), eps=1e-6, atol=1e-4, rtol=1e-4)


def test_compiled_once_per_model(likelihood_traces):
    # Each jitted function traces at most once per model; an earlier test may already have compiled a model of
    # the same shape signature, in which case JAX reuses that compilation and nothing is traced at all.
    data, truth = data_synth.synthetic_dataset("tiny", n_features=3, seed=6)
    model = GPMSRM(data, truth.spec, "grouped")
    start = likelihood_traces[0]
    u = model.unconstrain(truth.params)
    for shift in (0.0, 0.01, -0.02):
        model.value_and_grad(u + shift)
    after_grad = likelihood_traces[0]
    assert after_grad - start <= 1
    for seed in (0, 1):
        model.log_likelihood(model.constrain(model.prior_draw(seed)))
    assert likelihood_traces[0] - after_grad <= 1
    # new parameter values never trace again
    before = likelihood_traces[0]
    model.value_and_grad(u - 0.05)
    model.log_likelihood(model.constrain(model.prior_draw(2)))
    assert likelihood_traces[0] == before
    assert model.guard_events() == {0: 7}


def test_log_density_is_likelihood_plus_prior_plus_jacobian(small):
    from msrm.gp import transforms as tf

    data, truth, model = small
    u = model.prior_draw(seed=5)
    theta, log_jac = tf.constrain(u, model.blocks)
    expected = (model.log_likelihood(model.constrain(u)) + float(tf.log_prior(theta, model.priors, model.blocks))
                + float(log_jac))
    assert float(model.log_density(u)) == pytest.approx(expected, rel=1e-12)
    assert model.value_and_grad(u)[0] == pytest.approx(expected, rel=1e-12)


def test_bad_params_raise_before_numerics(small, likelihood_traces):
    data, truth, model = small
    start = likelihood_traces[0]
    p = truth.params
    with pytest.raises(KeyError, match="nobody/brain"):
        model.log_likelihood(p.replace(loadings={**p.loadings, "nobody/brain": np.zeros((3, 3))}))
    with pytest.raises(ValueError, match=r"loadings\['p1/brain'\]"):
        model.log_likelihood(p.replace(loadings={**p.loadings, "p1/brain": np.zeros((3, 2))}))
    with pytest.raises(ValueError, match="noise_sd"):
        model.log_likelihood(p.replace(noise_sd={**p.noise_sd, "p1/brain": -np.ones(3)}))
    with pytest.raises(ValueError, match="lag"):
        model.unconstrain(p.replace(response={**p.response, "p3/rating": {"lag": 99.0}}))
    with pytest.raises(ValueError, match="shape"):
        model.value_and_grad(np.zeros(model.num_params + 1))
    with pytest.raises(ValueError, match="non-finite"):
        model.value_and_grad(np.full(model.num_params, np.nan))
    assert likelihood_traces[0] == start


def test_bad_construction_arguments():
    data, truth = data_synth.synthetic_dataset("tiny", n_features=3, seed=0)
    with pytest.raises(ValueError, match="linear_algebra"):
        GPMSRM(data, truth.spec, "cholesky")
    with pytest.raises(ValueError, match="method"):
        GPMSRM(data, truth.spec, method="gpu")
    spec = msrm.ModelSpec(n_factors=3, latent_dt=1.0, responses={"brain": msrm.Identity()})
    with pytest.raises(KeyError, match="rating"):
        GPMSRM(data, spec)
    with pytest.raises(KeyError, match="unknown hyperparameter"):
        GPMSRM(data, truth.spec, priors={"lenghtscale_steps": 3.0})
    with pytest.raises(ValueError, match="state_space"):
        GPMSRM(data, truth.spec, "grouped", n_states=4)
    with pytest.raises(ValueError, match="state_space"):
        GPMSRM(data, truth.spec, "grouped", block=3)
    with pytest.raises(ValueError, match="block must be a positive integer"):
        GPMSRM(data, truth.spec, "state_space", block=0)


def test_float32_is_refused():
    data, truth = data_synth.synthetic_dataset("tiny", n_features=3, seed=0)
    jax.config.update("jax_enable_x64", False)
    try:
        with pytest.raises(RuntimeError, match="enable_x64"):
            GPMSRM(data, truth.spec)
    finally:
        msrm.runtime.enable_x64()


def test_starts_names_and_dims(small):
    data, truth, model = small
    p0 = model.initial_params(seed=0)
    p0.validate(data, truth.spec)
    assert np.isfinite(model.log_likelihood(p0))
    u0 = model.unconstrain(p0)
    assert np.isfinite(model.value_and_grad(u0)[0])
    names = model.param_names
    assert len(names) == model.num_params == len(set(names))
    blocks = model.constrained_blocks(u0)
    dims = model.param_dims()
    assert list(blocks) == list(dims)
    for name, values in blocks.items():
        d, coords = dims[name]
        assert len(d) == np.ndim(values)
        for dim, size in zip(d, np.shape(values)):
            assert "/" not in dim and len(coords[dim]) == size
    per_run = model.pointwise_log_likelihood(u0, by="run")["run"]
    assert per_run.shape == (1,) and per_run[0] == pytest.approx(model.log_likelihood(p0), rel=1e-12)
    info = model.execution_info()
    assert info["linear_algebra"] == "grouped" and info["num_params"] == model.num_params
    assert info["x64"] is True and info["node_counts"] == model.node_counts
