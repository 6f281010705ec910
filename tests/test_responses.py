"""Every registered response against its own slow forms: the windowed rows against the dense rows over the whole
grid, the analytic derivatives against central differences, JAX against NumPy, the archive form round trip.

The tests iterate over :data:`msrm.responses.RESPONSES` with each class's default settings (plus the settings in
``MORE`` that switch on further parameters), so a response added to the registry is tested by them. The grid's
padding covers the largest ``max_support`` of these instances, as the spec's default padding does."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import msrm
from msrm.operators import (jax_window_weights, response_weights, response_weights_and_derivs_csr,
                            response_weights_csr, window_layout)
from msrm.responses import HRF, RESPONSES, Response, get_response, register_response, response_from_dict

NAMES = tuple(RESPONSES)
# non-default settings that add parameters (HRF: the dispersion)
MORE = {"hrf-dispersion": HRF(dispersion_bounds=(0.8, 1.25))}
INSTANCES = {**{n: RESPONSES[n]() for n in NAMES}, **MORE}
PAD = max(r.max_support for r in INSTANCES.values())
GRID = np.arange(-0.8 * np.ceil(PAD / 0.8), 40.0, 0.8)
TIMES = np.array([0.0, 0.3, 1.7, 5.55, 12.0, 20.4, 31.9])


def instances():
    return [pytest.param(r, id=n) for n, r in INSTANCES.items()]


@pytest.mark.parametrize("response", instances())
def test_windowed_rows_hold_the_dense_rows(response):
    for theta in response.probe_thetas():
        dense = response_weights(TIMES, response, theta, GRID)
        windowed = response_weights_csr(TIMES, response, theta, GRID).toarray()
        # a window drops only weights below 1e-12 of the row's largest
        np.testing.assert_allclose(windowed, dense, rtol=0, atol=1e-12 * np.abs(dense).max())
        assert np.all(dense >= 0) or not response.nonnegative
        np.testing.assert_allclose(dense.sum(axis=1), 1.0, rtol=0, atol=1e-12)


@pytest.mark.parametrize("response", instances())
def test_derivatives_equal_central_differences(response):
    inner = [{n: lo + f * (hi - lo) for n, (lo, hi) in response.bounds.items()} for f in (0.3, 0.7)]
    for theta in inner:
        _, derivs = response_weights_and_derivs_csr(TIMES, response, theta, GRID)
        assert set(derivs) == set(response.param_names)
        for name in response.param_names:
            h = 1e-5
            up = response_weights_csr(TIMES, response, {**theta, name: theta[name] + h}, GRID).toarray()
            dn = response_weights_csr(TIMES, response, {**theta, name: theta[name] - h}, GRID).toarray()
            np.testing.assert_allclose(derivs[name].toarray(), (up - dn) / (2 * h), rtol=0, atol=1e-7)


@pytest.mark.parametrize("response", instances())
def test_jax_weights_equal_numpy(response):
    import jax.numpy as jnp

    msrm.runtime.enable_x64()
    layout = window_layout(TIMES, response, GRID)
    for theta in response.probe_thetas():
        jtheta = {k: jnp.asarray(v) for k, v in theta.items()}
        got = np.asarray(jax_window_weights(jtheta, response, layout))
        ref = response.weights(layout.delta, layout.valid, theta, layout.grid_step)
        np.testing.assert_allclose(got, ref, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("response", instances())
def test_parameters_bounds_and_archive_form(response):
    assert response.name in RESPONSES and get_response(response.name) is type(response)
    assert set(response.to_dict()) == {"type"} | {f.name for f in dataclasses.fields(response)}
    assert set(response.bounds) == set(response.param_names)
    for theta in response.probe_thetas():
        assert set(theta) == set(response.param_names)
        assert all(response.bounds[k][0] <= v <= response.bounds[k][1] for k, v in theta.items())
        assert response.check_theta(theta, where="test") == theta
    with pytest.raises(KeyError, match="unknown response parameter"):
        response.check_theta({"no_such": 1.0}, where="test")
    assert response_from_dict(response.to_dict()) == response
    assert response.max_support >= 0


def test_unknown_response_types_raise():
    with pytest.raises(ValueError, match="unknown response type"):
        get_response("HRF2")
    spec = {"n_factors": 1, "latent_dt": 1.0, "kernel": "matern32", "pooling": "shared", "latent_pad": None,
            "responses": {"x": {"type": "Boxcar"}}}
    with pytest.raises(ValueError, match="unknown response type 'Boxcar'"):
        msrm.ModelSpec.from_dict(spec)
    with pytest.raises(ValueError, match="already registered"):
        register_response(msrm.Identity)
    with pytest.raises(ValueError, match="Response subclass"):
        register_response(object)


def test_a_response_without_weights_is_refused_clearly():
    class Unfinished(Response):
        pass

    with pytest.raises(NotImplementedError):
        window_layout(TIMES, Unfinished(), GRID)
