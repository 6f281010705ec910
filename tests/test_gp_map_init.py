"""GP-MAP's lengthscales: the lengthscale profile of the log density (msrm.gp.map.lengthscale_profile), checked
against direct evaluations of the model, and the MAP's lengthscale against the profile's maximum."""
from __future__ import annotations

import numpy as np
import pytest

import data_synth
import msrm
import msrm.runtime
from msrm.gp.map import LengthscaleProfile, fit_map, lengthscale_profile


@pytest.fixture(scope="module")
def tiny():
    msrm.runtime.enable_x64()
    data, truth = data_synth.synthetic_dataset("tiny", n_features=3, seed=1, n_runs=1, n_factors=2,
                                               duration_scale=1.0)
    model = msrm.GPMSRM(data, truth.spec, linear_algebra="grouped")
    fit = fit_map(model, init=truth.params, seed=0, maxiter=300, progress=False)
    return model, truth, fit


def _ls_slice(model):
    b = [b for b in model.blocks if b.field == "lengthscales"][0]
    return slice(b.start, b.start + b.size)


def test_slice_profile_is_the_density_with_only_the_lengthscales_moved(tiny):
    model, truth, fit = tiny
    sl = _ls_slice(model)
    ells = np.array([[1.5, 2.0], [3.0, 3.0], [6.0, 1.2]])
    prof = lengthscale_profile(model, fit, ells)
    assert isinstance(prof, LengthscaleProfile) and not prof.reoptimised and prof.converged.all()
    for i, row in enumerate(ells):
        u = fit.u.copy()
        u[sl] = np.log(row)
        np.testing.assert_array_equal(prof.u[i], u)
        assert prof.log_density[i] == pytest.approx(model.value_and_grad(u)[0], rel=1e-12)
        assert prof.log_likelihood[i] == pytest.approx(model.log_likelihood(model.constrain(u)), rel=1e-12)
        np.testing.assert_allclose(model.constrain(prof.u[i]).lengthscales, row, rtol=1e-12)
    # a Params start and a vector start give the same slice
    again = lengthscale_profile(model, fit.params, ells)
    np.testing.assert_allclose(again.log_density, prof.log_density, rtol=1e-10)


def test_one_column_sets_every_factor(tiny):
    model, truth, fit = tiny
    prof = lengthscale_profile(model, fit.u, [2.0, 4.0])
    np.testing.assert_array_equal(prof.lengthscales, [[2.0, 2.0], [4.0, 4.0]])


def test_reoptimised_profile_peaks_at_the_map_lengthscales(tiny):
    model, truth, fit = tiny
    assert fit.converged
    ell = np.asarray(fit.params.lengthscales)
    rows = np.stack([0.6 * ell, ell, 1.6 * ell])
    held = lengthscale_profile(model, fit, rows)
    prof = lengthscale_profile(model, fit, rows, reoptimise=True, maxiter=200)
    assert prof.reoptimised
    # maximising the other parameters can only raise the density of a row (warm start = the slice point)
    assert np.all(prof.log_density >= held.log_density - 1e-8)
    # at the MAP's own lengthscales nothing is left to gain, and moving them either way loses density
    assert prof.log_density[1] == pytest.approx(fit.log_density, abs=1e-4)
    assert prof.best == 1
    assert prof.log_density[0] < fit.log_density and prof.log_density[2] < fit.log_density
    # the lengthscales really were held fixed while the rest moved
    sl = _ls_slice(model)
    np.testing.assert_allclose(prof.u[:, sl], np.log(rows), rtol=0, atol=0)
    assert not np.allclose(prof.u[0], held.u[0])


@pytest.mark.parametrize("bad, match", [
    (np.ones((2, 3)), "shape"),
    (np.ones((1, 2, 2)), "shape"),
    (np.zeros((0, 2)), "shape"),
    ([1.0, -2.0], "> 0"),
    ([1.0, np.nan], "finite"),
])
def test_bad_lengthscales_are_refused(tiny, bad, match):
    model, truth, fit = tiny
    with pytest.raises(ValueError, match=match):
        lengthscale_profile(model, fit, bad)


def test_bad_maxiter_and_models_are_refused(tiny):
    model, truth, fit = tiny
    with pytest.raises(ValueError, match="maxiter"):
        lengthscale_profile(model, fit, [2.0], reoptimise=True, maxiter=0)

    class NoBlocks:
        num_params = 3

    with pytest.raises(ValueError, match="blocks"):
        lengthscale_profile(NoBlocks(), np.zeros(3), [1.0])
