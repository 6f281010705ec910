"""GP-MAP on the conjugate toy model (known mode) and archives; on GPMSRM when it exists."""
from __future__ import annotations

import json

import numpy as np
import pytest

import msrm.runtime
from msrm.gp.map import MAPResult, fit_map, load_map

from toy_model import ToyModel, ToyParams


@pytest.fixture(scope="module", autouse=True)
def _x64():
    msrm.runtime.enable_x64()


def test_map_hits_the_known_mode():
    m = ToyModel(seed=3)
    r = fit_map(m, progress=False)
    assert r.converged
    # Gaussian posterior: the mode is the posterior mean
    np.testing.assert_allclose(r.u, m.post_mean, atol=1e-6)
    np.testing.assert_allclose(r.params.beta, m.post_mean[:-1].reshape(m.F, m.K), atol=1e-6)
    assert r.log_density == pytest.approx(m.value_and_grad(m.post_mean)[0], abs=1e-9)
    d = r.diagnostics
    assert d["grad_norm"] < 1e-3
    assert d["iterations"] >= 1 and d["function_evaluations"] >= d["iterations"]
    assert d["rejected_nonfinite"] == 0 and d["guard_events"] == {"jitter": 0, "fallback": 0}
    assert d["seconds_per_evaluation"] > 0
    # history: start first, then one entry per iteration, non-decreasing for L-BFGS-B on a convex problem
    assert len(r.history) == d["iterations"] + 1
    assert np.all(np.diff(r.history) >= -1e-9)
    assert r.execution_info["dtype"] == "float64"


def test_restarts_pick_the_best_and_are_seeded():
    m = ToyModel(seed=4)
    a = fit_map(m, restarts=3, seed=5, progress=False, maxiter=3)  # few iterations: restarts end in different places
    b = fit_map(m, restarts=3, seed=5, progress=False, maxiter=3)
    lds = [r["log_density"] for r in a.diagnostics["restarts"]]
    assert len(lds) == 3 and a.log_density == max(lds)
    assert a.diagnostics["best_restart"] == int(np.argmax(lds))
    np.testing.assert_array_equal(a.u, b.u)


def test_nonfinite_points_are_rejected_and_counted():
    # the density is NaN where any |u_i| > limit. With the mode (max |u_i| = 1.64) inside, the fit still finds it;
    # with the mode outside, the optimiser keeps probing the NaN region: every probe is rejected and counted, and
    # the returned point is a finite one
    m = ToyModel(seed=3, nonfinite_beyond=1.7)
    assert np.max(np.abs(m.post_mean)) < 1.7
    r = fit_map(m, init=np.zeros(m.num_params), progress=False)
    np.testing.assert_allclose(r.u, m.post_mean, atol=1e-5)
    assert np.isfinite(r.log_density) and r.diagnostics["rejected_nonfinite"] >= 0
    counted = fit_map(ToyModel(seed=3, nonfinite_beyond=0.5), init=np.zeros(5), progress=False)
    assert counted.diagnostics["rejected_nonfinite"] > 0
    assert counted.diagnostics["total_rejected_nonfinite"] >= counted.diagnostics["rejected_nonfinite"]
    assert np.all(np.abs(counted.u) <= 0.5) and np.isfinite(counted.log_density)


def test_save_load_round_trip(tmp_path):
    m = ToyModel(seed=3)
    r = fit_map(m, progress=False, archive=tmp_path / "fit")
    back = load_map(tmp_path / "fit", params_cls=ToyParams)
    np.testing.assert_array_equal(back.u, r.u)
    np.testing.assert_array_equal(back.history, r.history)
    np.testing.assert_array_equal(back.params.beta, r.params.beta)
    assert back.log_density == r.log_density and back.converged == r.converged
    assert back.diagnostics["iterations"] == r.diagnostics["iterations"]
    assert back.execution_info["backend"] == r.execution_info["backend"]
    # a torn/foreign npz is refused
    (tmp_path / "fit.npz").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="checksum"):
        load_map(tmp_path / "fit.json", params_cls=ToyParams)
    meta = json.loads((tmp_path / "fit.json").read_text())
    assert meta["format"] == "msrm.map/1"


def test_bad_arguments_raise_before_numerics():
    m = ToyModel()
    with pytest.raises(ValueError, match="method must be one of"):
        fit_map(m, method="Nelder-Mead", progress=False)
    with pytest.raises(ValueError, match="restarts must be a positive integer"):
        fit_map(m, restarts=0, progress=False)
    with pytest.raises(ValueError, match=r"init: unconstrained vector has shape \(3,\)"):
        fit_map(m, init=np.zeros(3), progress=False)
    assert m.num_value_and_grad == 0
    with pytest.raises(FileNotFoundError):
        load_map("/nonexistent/fit")


# ------------------------------------------------------------------------------------------ GPMSRM


@pytest.mark.slow
def test_map_recovers_lengthscales_and_lags_on_tiny_synthetic_data():
    import data_synth

    import msrm

    data, truth = data_synth.synthetic_dataset(profile="tiny", n_features=8, seed=0, n_runs=8)
    model = msrm.GPMSRM(data, truth.spec, method="native")
    fit = model.fit_map(seed=0, maxiter=1000, progress=False)
    assert fit.converged, fit.diagnostics["message"]
    # factors are exchangeable, so lengthscales are compared in sorted order
    ell, ell_true = np.sort(fit.params.lengthscales), np.sort(truth.params.lengthscales)
    np.testing.assert_allclose(ell, ell_true, rtol=0.3)
    for key, theta in truth.params.response.items():
        assert abs(fit.params.response[key]["lag"] - theta["lag"]) < 0.3, key
    assert fit.execution_info["linear_algebra"] == "grouped"
    assert sum(fit.diagnostics["guard_events"].values()) > 0  # the guarded factorization reported its path
