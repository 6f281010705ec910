"""Every registered kernel: its correlation against the closed forms written out here, its SDE form against its
correlation, and its density in every backend against the brute-force Gaussian density and finite differences.

The tests iterate over :data:`msrm.kernels.KERNELS`, so a kernel added to the registry is tested by them; one
without an entry in ``CLOSED_FORMS`` fails the first test until its formula is written out here."""
from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.linalg

import data_synth
import msrm
from msrm.gp.reference import brute_force_loglik
from msrm.gp.state_space import sde
from msrm.kernels import KERNELS, HalfIntegerMatern, Kernel, get_kernel, register_kernel
from sde_oracle import implied_grid_cov

NAMES = tuple(KERNELS)
S3, S5, S7 = math.sqrt(3.0), math.sqrt(5.0), math.sqrt(7.0)

# k(r; l), written out independently of msrm.kernels
CLOSED_FORMS = {
    "matern12": lambda r, l: np.exp(-r / l),
    "matern32": lambda r, l: (1 + S3 * r / l) * np.exp(-S3 * r / l),
    "matern52": lambda r, l: (1 + S5 * r / l + 5 * r**2 / (3 * l**2)) * np.exp(-S5 * r / l),
    "matern72": lambda r, l: (1 + S7 * r / l + 14 * r**2 / (5 * l**2) + 7 * S7 * r**3 / (15 * l**3))
    * np.exp(-S7 * r / l),
}


@pytest.mark.parametrize("name", NAMES)
def test_correlation_is_the_closed_form_in_numpy_and_jax(name):
    import jax.numpy as jnp

    msrm.runtime.enable_x64()
    r = np.linspace(0.0, 12.0, 97)
    k = get_kernel(name)
    assert k.name == name
    ref = CLOSED_FORMS[name](r, 1.7)
    np.testing.assert_allclose(k.correlation(r, 1.7), ref, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(np.asarray(k.correlation(jnp.asarray(r), jnp.asarray(1.7), jnp)), ref, rtol=1e-13,
                               atol=1e-15)
    assert float(k.correlation(np.float64(k.half_distance), 1.0)) == pytest.approx(0.5, abs=1e-12)


@pytest.mark.parametrize("name", NAMES)
def test_sde_form_is_a_stationary_sde_of_the_kernel(name):
    k = get_kernel(name)
    ell = 2.1
    F, P = k.companion(ell), k.stationary_cov(ell)
    d = k.n_states
    assert F.shape == P.shape == (d, d)
    # Lyapunov: F P + P F^T = -q L L^T with L the last unit vector (white noise drives the top derivative)
    lyap = F @ P + P @ F.T
    q = -lyap[-1, -1]
    expect = np.zeros((d, d))
    expect[-1, -1] = -q
    np.testing.assert_allclose(lyap, expect, atol=1e-10 * max(1.0, abs(q)))
    assert q > 0 and np.all(np.linalg.eigvalsh(P) > 0)
    # characteristic polynomial (x + rate)^d: what the closed-form transition relies on
    np.testing.assert_allclose(np.poly(F), np.poly(np.full(d, -k.rate(ell))), rtol=1e-10)
    # the first state's covariance over lags is the kernel, through the exact matrix exponential
    taus = np.array([0.0, 0.3, 1.0, 4.5])
    cov = [(scipy.linalg.expm(F * t) @ P)[0, 0] for t in taus]
    np.testing.assert_allclose(cov, CLOSED_FORMS[name](taus, ell), rtol=1e-11, atol=1e-13)
    np.testing.assert_allclose(implied_grid_cov(name, ell, 0.7, 12),
                               CLOSED_FORMS[name](0.7 * np.abs(np.subtract.outer(np.arange(12), np.arange(12))), ell),
                               atol=1e-12)


def test_unknown_kernel_names_raise():
    with pytest.raises(ValueError, match="kernel must be one of"):
        get_kernel("rbf")
    with pytest.raises(ValueError, match="kernel must be one of"):
        msrm.ModelSpec(n_factors=1, latent_dt=1.0, kernel="matern92", responses={"x": msrm.Identity()})
    with pytest.raises(ValueError, match="already registered"):
        register_kernel(get_kernel("matern32"))
    with pytest.raises(ValueError, match="Kernel instance"):
        register_kernel("matern32")
    with pytest.raises(NotImplementedError):
        Kernel().correlation(1.0, 1.0)


def test_half_integer_coefficients_are_the_matern_polynomials():
    assert get_kernel("matern72").coefficients == pytest.approx((1.0, 1.0, 2 / 5, 1 / 15), rel=1e-15)
    assert isinstance(get_kernel("matern72"), HalfIntegerMatern) and get_kernel("matern72").n_states == 4


def _fd_check(model, u, names, pick):
    value, grad = model.value_and_grad(u)

    def central(i, h):
        e = np.zeros_like(u)
        e[i] = h
        return (model.value_and_grad(u + e)[0] - model.value_and_grad(u - e)[0]) / (2 * h)

    for i in pick:
        fd = (4 * central(i, 1e-3) - central(i, 2e-3)) / 3  # Richardson: removes the O(h^2) term
        assert grad[i] == pytest.approx(fd, rel=2e-6, abs=1e-6), names[i]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("backend", ["dense", "grouped", "state_space"])
def test_every_backend_equals_brute_force_and_finite_differences(name, backend):
    msrm.runtime.enable_x64()
    data, truth = data_synth.synthetic_dataset("tiny", n_features=2, n_runs=2, seed=5, kernel=name,
                                               pooling="shared", missing_fraction=0.2)
    ref = brute_force_loglik(data, truth.spec, truth.params)
    model = msrm.GPMSRM(data, truth.spec, linear_algebra=backend)
    assert model.log_likelihood(truth.params) == pytest.approx(ref, rel=1e-9)
    u = model.unconstrain(truth.params)
    names = model.param_names
    pick = [names.index("lengthscales[0]"), names.index("response/rating/lag"),
            next(i for i, n in enumerate(names) if n.startswith("loadings/") and n.endswith("[0,0]"))]
    _fd_check(model, u, names, pick)


@pytest.mark.parametrize("name", NAMES)
def test_rmsrm_fits_and_estimates_lengthscales_with_every_kernel(name):
    data, truth = data_synth.synthetic_dataset("tiny", n_features=4, n_runs=1, seed=6, kernel=name)
    fit = msrm.fit_rmsrm(data, truth.spec, restarts=1, seed=0, n_jobs=1, progress=False)
    ell = fit.params.lengthscales
    assert ell.shape == (truth.spec.n_factors,) and np.all(np.isfinite(ell)) and np.all(ell > 0)
