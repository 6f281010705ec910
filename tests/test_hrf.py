"""The HRF response (SPM's canonical double gamma) against its slow forms: the raw curve against
scipy.stats.gamma, the windowed weights against a brute-force evaluation of the formula on the whole grid, the
density of a tiny study with an HRF brain stream in every backend against the brute-force Gaussian density, the
log density's gradient in delay and dispersion against central differences, R-MSRM's response gradient against
central differences, and the bad inputs."""
from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.integrate import quad
from scipy.stats import gamma

import data_synth
import msrm
from msrm.gp.reference import brute_force_loglik
from msrm.operators import response_weights, response_weights_and_derivs_csr, response_weights_csr, window_layout
from msrm.responses import HRF, HRF_LEAD, HRF_STEP, HRF_SUPPORT, get_response, response_from_dict
from msrm.rmsrm.objective import RState, compute_stats, theta_value_and_grad_dense, theta_value_and_grad_reuse
from msrm.rmsrm.prepare import prepare_rmsrm

DISPERSION = (0.8, 1.25)


def spm_double_gamma(s):
    """h(s) written out from scipy.stats.gamma: peak shape 6, undershoot shape 16, ratio 1/6, scale 1."""
    s = np.asarray(s, dtype=np.float64)
    return np.where(s > 0, gamma.pdf(s, 6.0, scale=1.0) - gamma.pdf(s, 16.0, scale=1.0) / 6.0, 0.0)


def brute_rows(times, grid, delay, dispersion):
    """a_ij = h((t_i - tau_j - d) / c) / sum_l h((t_i - tau_l - d) / c), every grid point, no window."""
    g = spm_double_gamma((times[:, None] - grid[None, :] - delay) / dispersion)
    return g / g.sum(axis=1, keepdims=True)


def padded_grid(response, step, duration):
    """A grid like msrm.latent_grid: padding of max_support rounded up to the step, last point >= duration."""
    pad = math.ceil(response.max_support / step - 1e-9) * step
    return np.arange(-pad, duration + step - 1e-9, step)


def test_raw_curve_is_the_spm_double_gamma():
    s = np.linspace(-5.0, 80.0, 85001)
    h = HRF.curve(s)
    np.testing.assert_allclose(h, spm_double_gamma(s), rtol=0, atol=1e-15)
    assert np.all(h[s <= 0] == 0)
    peak, dip = s[np.argmax(h)], s[np.argmin(h)]
    assert 4.9 < peak < 5.1  # the mode of g(s; 6, 1) is 5; the undershoot moves it 1.5 ms earlier
    assert 15.0 < dip < 16.5
    # the undershoot is the shape-16 gamma with 1/6 of the mass of the peak's: the integral is 1 - 1/6
    assert quad(HRF.curve, 0.0, 200.0, limit=200)[0] == pytest.approx(5.0 / 6.0, rel=1e-12)
    # the NumPy derivative against central differences (away from s = 0, where h is C^4)
    x = np.linspace(0.05, 70.0, 700)
    fd = (HRF.curve(x + 1e-6) - HRF.curve(x - 1e-6)) / 2e-6
    np.testing.assert_allclose(HRF.curve_deriv(x), fd, rtol=0, atol=1e-9)
    # C^4 at 0: h(s) = s^5 / 120 + O(s^6)
    assert HRF.curve(np.array([1e-3]))[0] == pytest.approx(1e-15 / 120, rel=2e-3)


def test_truncation_at_the_support_is_below_the_1e12_rule():
    s = np.linspace(HRF_SUPPORT, 300.0, 200001)
    peak = HRF.curve(np.linspace(4.0, 6.0, 20001)).max()
    assert np.abs(HRF.curve(s)).max() <= 1.5e-13 * peak
    # on the coarsest grid the response accepts (HRF_STEP canonical seconds between samples of the curve), every
    # row's largest weight is >= 0.9 of the curve's peak and the row sum is positive for every phase, also for a
    # row at the end of a run that loses the first HRF_LEAD seconds of the curve (the rise to the peak)
    offsets = HRF_STEP * np.arange(0, 60)
    for phase in np.linspace(0.0, HRF_STEP, 81, endpoint=False):
        samples = HRF.curve(phase + offsets)
        assert samples.max() >= 0.9 * peak
        assert samples.sum() > 0.9 * (5.0 / 6.0) / HRF_STEP
        assert HRF.curve(HRF_LEAD + phase + offsets).sum() > 0.25 / HRF_STEP
        assert HRF.curve(HRF_LEAD + phase + offsets).max() >= 0.7 * peak


@pytest.mark.parametrize("dispersion_bounds", [None, DISPERSION], ids=["fixed", "dispersion"])
@pytest.mark.parametrize("step", [0.7, 1.6])
def test_windowed_weights_equal_brute_force_on_the_whole_grid(dispersion_bounds, step):
    r = HRF(delay_bounds=(-2.0, 3.0), dispersion_bounds=dispersion_bounds)
    duration = 30.0
    grid = padded_grid(r, step, duration)
    # samples from the start to the end of the run: rows near the end reach past the grid's last point
    times = np.array([0.0, 0.35, 7.9, 15.0, 28.8, 29.5, 30.0])
    for theta in r.probe_thetas():
        c = theta.get("dispersion", 1.0)
        ref = brute_rows(times, grid, theta["delay"], c)
        windowed = response_weights_csr(times, r, theta, grid).toarray()
        np.testing.assert_allclose(windowed, ref, rtol=0, atol=1e-12 * np.abs(ref).max())
        np.testing.assert_allclose(response_weights(times, r, theta, grid), ref, rtol=0, atol=1e-13)
        np.testing.assert_allclose(windowed.sum(axis=1), 1.0, rtol=0, atol=1e-12)
        assert ref.min() < 0  # the undershoot
    layout = window_layout(times, r, grid)
    assert layout.width < grid.size  # the window is a real window, not the whole grid


def test_weights_move_smoothly_with_delay_and_dispersion():
    """No hard cut: sweeping a parameter finely, no weight jumps by more than its largest derivative allows."""
    r = HRF(delay_bounds=(-2.0, 3.0), dispersion_bounds=DISPERSION)
    grid = padded_grid(r, 0.9, 20.0)
    times = np.array([3.3, 19.7])
    for name, (lo, hi) in r.bounds.items():
        values = np.linspace(lo, hi, 1201)
        h = values[1] - values[0]
        rows, slopes = [], []
        for v in values:
            theta = {"delay": 0.4, "dispersion": 1.05, name: v}
            a, da = response_weights_and_derivs_csr(times, r, theta, grid)
            rows.append(a.toarray())
            slopes.append(np.abs(da[name].toarray()).max())
        jumps = np.abs(np.diff(np.array(rows), axis=0)).max()
        assert jumps <= 1.01 * max(slopes) * h


def _study(pooling, dispersion_bounds, n_runs=1, missing=0.1):
    """The brain streams of the tiny study seen through an HRF (values from data_synth; the density does not
    depend on how they were drawn), and parameters with a brain delay (and dispersion); under individual pooling
    the second participant's delay is negative, so its rows at the end of the run reach past the grid."""
    data, truth = data_synth.synthetic_dataset("tiny", n_features=3, n_factors=2, n_runs=n_runs, seed=7,
                                               pooling=pooling, missing_fraction=missing)
    data = msrm.Dataset([msrm.Run(duration=run.duration, streams=[s for s in run.streams if s.modality == "brain"])
                         for run in data.runs])
    hrf = HRF(delay_bounds=(-2.0, 3.0), dispersion_bounds=dispersion_bounds)
    spec = msrm.ModelSpec(n_factors=2, latent_dt=1.0, kernel="matern32", pooling=pooling, responses={"brain": hrf})
    values = [{"delay": 1.3, "dispersion": 1.1}, {"delay": -1.2, "dispersion": 0.9}]
    keys = ["brain"] if pooling == "shared" else ["p1/brain", "p2/brain"]
    tp = truth.params

    def brain(d):
        return {k: v for k, v in d.items() if k.endswith("/brain")}

    params = msrm.Params(brain(tp.loadings), brain(tp.intercepts), brain(tp.noise_sd), tp.lengthscales,
                         {k: {n: v[n] for n in hrf.param_names} for k, v in zip(keys, values)})
    return data, spec, params


@pytest.mark.parametrize("backend", ["dense", "grouped", "state_space"])
@pytest.mark.parametrize("pooling,dispersion_bounds", [("shared", None), ("individual", DISPERSION)],
                         ids=["shared-fixed", "individual-dispersion"])
def test_every_backend_equals_the_brute_force_density(backend, pooling, dispersion_bounds):
    data, spec, params = _study(pooling, dispersion_bounds)
    ref = brute_force_loglik(data, spec, params)
    model = msrm.GPMSRM(data, spec, linear_algebra=backend)
    assert model.log_likelihood(params) == pytest.approx(ref, rel=1e-9)


def test_log_density_gradient_equals_central_differences():
    data, spec, params = _study("individual", DISPERSION)
    model = msrm.GPMSRM(data, spec, linear_algebra="grouped")
    u = model.unconstrain(params)
    names = model.param_names
    pick = [i for i, n in enumerate(names) if n.startswith("response/")]
    assert sorted(names[i] for i in pick) == ["response/p1/brain/delay", "response/p1/brain/dispersion",
                                              "response/p2/brain/delay", "response/p2/brain/dispersion"]
    _, grad = model.value_and_grad(u)

    def central(i, h):
        e = np.zeros_like(u)
        e[i] = h
        return (model.value_and_grad(u + e)[0] - model.value_and_grad(u - e)[0]) / (2 * h)

    for i in pick:
        fd = (4 * central(i, 1e-3) - central(i, 2e-3)) / 3  # Richardson: removes the O(h^2) term
        assert grad[i] == pytest.approx(fd, rel=2e-6, abs=1e-6), names[i]


def _rstate(prep, data, spec, params, seed=0):
    rng = np.random.default_rng(seed)
    Z = tuple(rng.standard_normal((run.grid.size, spec.n_factors)) for run in prep.runs)
    var = {k: v**2 for k, v in params.noise_sd.items()}
    return RState(Z=Z, W=dict(params.loadings), b=dict(params.intercepts), var=var,
                  theta={k: dict(v) for k, v in params.response.items()})


@pytest.mark.parametrize("pooling", ["shared", "individual"])
def test_rmsrm_response_gradient_equals_central_differences(pooling):
    data, spec, params = _study(pooling, DISPERSION, n_runs=2)
    prep = prepare_rmsrm(data, spec, roughness=3.0)
    state = _rstate(prep, data, spec, params)
    stats = compute_stats(prep, state)
    h = 1e-5
    checked = 0
    for g in prep.theta_groups:
        grp = prep.groups[g]
        if not isinstance(grp.response, HRF):
            continue
        pk = grp.param_key
        _, grad = theta_value_and_grad_reuse(prep, state, stats, g, state.theta[pk])
        _, grad_dense = theta_value_and_grad_dense(prep, state, g, state.theta[pk])
        np.testing.assert_allclose(grad, grad_dense, rtol=1e-9, atol=1e-9 * np.abs(grad_dense).max())
        for j, n in enumerate(grp.response.param_names):
            up = dict(state.theta[pk]); up[n] += h
            dn = dict(state.theta[pk]); dn[n] -= h
            fd = (theta_value_and_grad_reuse(prep, state, stats, g, up)[0]
                  - theta_value_and_grad_reuse(prep, state, stats, g, dn)[0]) / (2 * h)
            assert grad[j] == pytest.approx(fd, rel=1e-6, abs=1e-7), (pk, n)
            checked += 1
    assert checked == (2 if pooling == "shared" else 4)


def test_fit_rmsrm_runs_with_an_hrf_stream():
    data, spec, _ = _study("shared", DISPERSION, missing=0.0)
    fit = msrm.fit_rmsrm(data, spec, restarts=1, max_iter=4, seed=0, n_jobs=1, backend="sequential",
                         progress=False)
    hist = np.asarray(fit.objective_history)
    assert np.all(np.isfinite(hist)) and np.all(np.diff(hist) <= 1e-9 * np.abs(hist[:-1]))
    brain = fit.params.response["brain"]
    assert set(brain) == {"delay", "dispersion"}
    for n, v in brain.items():
        lo, hi = spec.response("brain").bounds[n]
        assert lo <= v <= hi


def test_registry_name_and_archive_form():
    r = HRF(delay_bounds=(-1.0, 4.0), dispersion_bounds=DISPERSION)
    assert r.name == "hrf" and get_response("hrf") is HRF
    assert r.to_dict() == {"type": "hrf", "delay_bounds": [-1.0, 4.0], "dispersion_bounds": [0.8, 1.25]}
    assert response_from_dict(r.to_dict()) == r
    assert response_from_dict(HRF().to_dict()) == HRF()
    spec = msrm.ModelSpec(n_factors=1, latent_dt=1.0, responses={"brain": r})
    assert msrm.ModelSpec.from_dict(spec.to_dict()) == spec
    assert HRF().param_names == ("delay",) and r.param_names == ("delay", "dispersion")
    assert r.max_support == pytest.approx(4.0 + 1.25 * HRF_SUPPORT)
    assert spec.pad >= r.max_support


@pytest.mark.parametrize("kwargs,match", [
    ({"delay_bounds": (0.0, math.inf)}, "HRF delay_bounds must be finite"),
    ({"delay_bounds": (float("nan"), 1.0)}, "HRF delay_bounds must be finite"),
    ({"delay_bounds": (3.0, 3.0)}, "HRF delay_bounds must have low < high"),
    ({"delay_bounds": (4.0, 1.0)}, "HRF delay_bounds must have low < high"),
    ({"delay_bounds": "soon"}, "HRF delay_bounds must be a pair"),
    ({"dispersion_bounds": (0.0, 2.0)}, "HRF dispersion_bounds must be > 0"),
    ({"dispersion_bounds": (-1.0, 2.0)}, "HRF dispersion_bounds must be > 0"),
    ({"dispersion_bounds": (1.5, 1.0)}, "HRF dispersion_bounds must have low < high"),
    ({"dispersion_bounds": (1.0, math.inf)}, "HRF dispersion_bounds must be finite"),
    ({"delay_bounds": (-HRF_LEAD - 0.5, 3.0)}, r"HRF delay_bounds=.*past its sample time"),
    ({"delay_bounds": (-4.5, 3.0), "dispersion_bounds": (0.5, 2.0)}, r"HRF delay_bounds=.*must be >= -2.5"),
])
def test_bad_bounds_raise_naming_them(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HRF(**kwargs)


def test_bad_grids_and_parameters_raise_before_any_numerics():
    data, spec, params = _study("shared", DISPERSION)
    # a padding shorter than the support the bounds allow
    short = msrm.ModelSpec(n_factors=2, latent_dt=1.0, latent_pad=20.0, responses=spec.responses)
    with pytest.raises(ValueError, match="cannot cover these bounds"):
        prepare_rmsrm(data, short, roughness=1.0)
    with pytest.raises(ValueError, match="cannot cover these bounds"):
        msrm.GPMSRM(data, short, linear_algebra="grouped")
    # a grid too coarse for the smallest dispersion
    coarse = msrm.ModelSpec(n_factors=2, latent_dt=HRF_STEP * DISPERSION[0] + 0.1, responses=spec.responses)
    with pytest.raises(ValueError, match="does not resolve the curve"):
        prepare_rmsrm(data, coarse, roughness=1.0)
    r = spec.response("brain")
    with pytest.raises(ValueError, match=r"delay=3.5 is outside its bounds"):
        r.check_theta({"delay": 3.5, "dispersion": 1.0}, where="brain")
    with pytest.raises(ValueError, match=r"dispersion=0.5 is outside its bounds"):
        r.check_theta({"delay": 0.0, "dispersion": 0.5}, where="brain")
    with pytest.raises(KeyError, match="missing response parameter"):
        r.check_theta({"delay": 0.0}, where="brain")
    with pytest.raises(KeyError, match="unknown response parameter"):
        HRF().check_theta({"delay": 0.0, "dispersion": 1.0}, where="brain")
    bad = msrm.Params(params.loadings, params.intercepts, params.noise_sd, params.lengthscales,
                      {**params.response, "brain": {"delay": 9.0, "dispersion": 1.0}})
    model = msrm.GPMSRM(data, spec, linear_algebra="grouped")
    with pytest.raises(ValueError, match="delay"):
        model.log_likelihood(bad)
