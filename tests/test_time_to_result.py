"""GP-MAP from an R-MSRM fit: starts moved inside the bounds, the diagnostics of a fit, and the time-to-result
benchmark end to end at its smoke size."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import data_synth
import msrm
import msrm.runtime
from msrm.gp.map import fit_map, start_inside_bounds


@pytest.fixture(scope="module")
def tiny():
    msrm.runtime.enable_x64()
    data, truth = data_synth.synthetic_dataset("tiny", n_features=4, seed=0, n_runs=1, n_factors=1)
    model = msrm.GPMSRM(data, truth.spec, linear_algebra="grouped")  # starts are backend-independent
    return data, truth, model


def _on_bounds(params):
    """The truth with the rating lag on its lower bound and the physiology width on its upper one."""
    response = {"rating": {"lag": 0.0}, "physio": {"lag": params.response["physio"]["lag"], "width": 1.5}}
    return params.replace(response=response)


def test_start_inside_bounds_moves_only_values_on_a_bound(tiny):
    _, truth, _ = tiny
    moved = start_inside_bounds(_on_bounds(truth.params), truth.spec, margin=1e-6).response
    assert moved["rating"]["lag"] == pytest.approx(3e-6, rel=1e-12)
    assert moved["physio"]["width"] == pytest.approx(1.5 - 1e-6, rel=1e-12)
    assert moved["physio"]["lag"] == truth.params.response["physio"]["lag"]
    inside = start_inside_bounds(truth.params, truth.spec).response
    assert inside == {k: {n: float(v) for n, v in d.items()} for k, d in truth.params.response.items()}


@pytest.mark.parametrize("margin", [0.0, 0.5, -1e-3, True, "1e-6"])
def test_start_inside_bounds_refuses_a_bad_margin(tiny, margin):
    _, truth, _ = tiny
    with pytest.raises(ValueError, match="margin"):
        start_inside_bounds(truth.params, truth.spec, margin=margin)


def test_a_start_on_a_bound_gives_a_finite_fit(tiny):
    _, truth, model = tiny
    on = _on_bounds(truth.params)
    with pytest.raises(ValueError, match="bound"):
        model.unconstrain(on)  # what fit_map must avoid
    for init in (on, SimpleNamespace(params=on)):  # Params, or a fit holding them (an RFit)
        fit = fit_map(model, init=init, maxiter=2, progress=False)
        u0 = model.unconstrain(start_inside_bounds(on, truth.spec))
        assert np.isfinite(fit.log_density)
        assert fit.history[0] == pytest.approx(model.value_and_grad(u0)[0], rel=1e-12)


def test_a_start_inside_the_bounds_is_used_as_given(tiny):
    _, truth, model = tiny
    fit = fit_map(model, init=truth.params, maxiter=2, progress=False)
    assert fit.history[0] == pytest.approx(model.value_and_grad(model.unconstrain(truth.params))[0], rel=1e-12)
    again = fit_map(model, init=fit, maxiter=1, progress=False)  # a MAPResult starts at its u
    assert again.history[0] == pytest.approx(fit.log_density, rel=1e-12)


def test_a_start_outside_the_bounds_is_still_refused(tiny):
    _, truth, model = tiny
    outside = truth.params.replace(response={**truth.params.response, "rating": {"lag": -1.0}})
    with pytest.raises(ValueError, match="lag"):
        fit_map(model, init=outside, maxiter=2, progress=False)


def test_fit_from_an_rmsrm_fit_and_its_diagnostics(tiny):
    data, truth, model = tiny
    rfit = msrm.fit_rmsrm(data, truth.spec, restarts=1, max_iter=10, n_jobs=1, progress=False)
    fit = fit_map(model, init=rfit, progress=False)
    d = fit.diagnostics
    assert d["converged"] == fit.converged
    assert d["iterations"] == len(fit.history) - 1 >= 1
    assert d["function_evaluations"] >= d["iterations"]
    value, grad = model.value_and_grad(fit.u)
    assert value == pytest.approx(fit.log_density, rel=1e-12)
    assert d["projected_grad_max_abs"] == pytest.approx(np.max(np.abs(grad)), rel=1e-9)
    assert d["grad_norm"] == pytest.approx(np.linalg.norm(grad), rel=1e-9)
    if fit.converged and "PROJ" in d["message"]:
        assert d["projected_grad_max_abs"] <= 1e-6
    p = d["phase_seconds"]
    assert set(p) == {"first_evaluation", "optimiser", "in_value_and_grad", "total"}
    assert 0 < p["first_evaluation"] <= p["total"]
    assert p["optimiser"] == pytest.approx(p["total"] - p["first_evaluation"])
    assert 0 <= p["in_value_and_grad"] <= p["optimiser"]
    assert d["settings"] == {"gtol": 1e-6, "ftol": None, "maxcor": None}
    assert d["seconds_per_warm_evaluation"] > 0


def test_lbfgsb_settings_are_checked_and_passed(tiny):
    _, truth, model = tiny
    with pytest.raises(ValueError, match="ftol"):
        fit_map(model, init=truth.params, ftol=-1.0, progress=False)
    with pytest.raises(ValueError, match="maxcor"):
        fit_map(model, init=truth.params, maxcor=0, progress=False)
    with pytest.raises(ValueError, match="L-BFGS-B"):
        fit_map(model, init=truth.params, method="BFGS", maxcor=5, progress=False)
    loose = fit_map(model, init=truth.params, ftol=1e-3, maxcor=3, progress=False)
    tight = fit_map(model, init=truth.params, progress=False)
    assert loose.diagnostics["settings"]["maxcor"] == 3
    assert loose.diagnostics["iterations"] <= tight.diagnostics["iterations"]


def test_gp_map_rows_smoke():
    from msrm_lab.bench import time_to_result as ttr

    with pytest.raises(ValueError, match="profile"):
        ttr.gp_map_rows("huge")
    rows = ttr.gp_map_rows("smoke")
    metrics = {r["metric"] for r in rows}
    assert set(ttr.TIME_METRICS) | set(ttr.FIT_METRICS) | {"converged", "met_target"} == metrics
    assert all(r["notebook"] == "time_to_result" and r["experiment"] == "gp_map" for r in rows)
    assert all(r["status"] == "measured" for r in rows)
    by = {r["metric"]: r for r in rows}
    phases = sum(by[m]["value"] for m in ("rmsrm_s", "build_s", "first_evaluation_s", "optimiser_s"))
    assert by["total_s"]["value"] == pytest.approx(phases, rel=1e-9)
    assert by["iterations"]["value"] >= 1 and by["total_s"]["params"]["target_s"] == 60
    assert by["converged"]["value"] in (0.0, 1.0) and by["met_target"]["value"] in (0.0, 1.0)


def test_a_case_overrides_the_profile_map_settings_and_the_rows_say_which_ran(monkeypatch):
    from msrm_lab.bench import time_to_result as ttr

    profile = {"maxiter": 1000, "maxcor": 20}
    assert ttr.case_map_settings({}, profile) == profile
    assert ttr.case_map_settings({"map": {"maxcor": None}}, profile) == {"maxiter": 1000, "maxcor": None}
    assert ttr.case_map_settings({"map": {"maxcor": None}, "maxiter": 5}, profile) == {"maxiter": 5, "maxcor": None}
    assert profile == {"maxiter": 1000, "maxcor": 20}  # the profile's settings are not modified

    # two tiny cases, one with three correction pairs and one with SciPy's default: each is timed with its own
    # settings, and its rows record them
    base = ttr.SIZES["smoke"]["cases"][0]
    sizes = dict(ttr.SIZES["smoke"], map=dict(maxiter=100, maxcor=3),
                 cases=[dict(base, case="three"), dict(base, case="default", map=dict(maxcor=None))])
    monkeypatch.setitem(ttr.SIZES, "smoke", sizes)
    seen = []
    real = ttr.time_case

    def spy(case, rmsrm, map_settings):
        seen.append(ttr.case_map_settings(case, map_settings))
        return real(case, rmsrm, map_settings)

    monkeypatch.setattr(ttr, "time_case", spy)
    rows = ttr.gp_map_rows("smoke")
    assert seen == [{"maxiter": 100, "maxcor": 3}, {"maxiter": 100, "maxcor": None}]
    by = {(r["params"]["case"], r["metric"]): r for r in rows}
    assert by[("three", "total_s")]["params"]["maxcor"] == 3
    assert by[("default", "total_s")]["params"]["maxcor"] is None
    assert by[("default", "total_s")]["params"]["map_settings"] == {"maxiter": 100, "maxcor": None}
