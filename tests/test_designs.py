"""data_synth.designs: determinism, independent randomness, continuous-time responses and standardisation, every
design's data against its spec, missingness and override errors."""
import math
import pickle

import numpy as np
import pytest

import msrm
from data_synth import DESIGNS, design_names, make_design
from data_synth.designs import (BumpPath, LatentPath, OUPath, SinusoidPath, _gauss_legendre, _panels,
                                gaussian_response, hrf_response)
from msrm.operators import response_weights_csr


@pytest.fixture(scope="module")
def built():
    """Every design at seed 0, built once."""
    return {name: make_design(name, 0) for name in design_names()}


def _values(data):
    return [s.values for r in data.runs for s in r.streams]


def _same_arrays(a, b):
    return len(a) == len(b) and all(np.array_equal(x, y, equal_nan=True) for x, y in zip(a, b))


def test_names_and_docs():
    assert design_names() == list(DESIGNS)
    assert design_names()[0] == "baseline"
    assert {"baseline", "few_brain", "fast_dynamics", "missing_brain", "ou_latents", "bumps_hrf",
            "small"} <= set(design_names())
    for d in DESIGNS.values():
        assert d.doc and "\n" not in d.doc


def test_baseline_is_the_stated_specification(built):
    data, spec, truth = built["baseline"]
    (run,) = data.runs
    assert run.duration == 300.0 and spec.n_factors == 2 and spec.latent_dt == 0.5
    assert spec.kernel == "matern32" and spec.pooling == "shared" and spec.latent_pad is None
    assert isinstance(spec.response("brain"), msrm.Identity)
    assert spec.response("rating") == msrm.GaussianLag(width=1.2, lag_bounds=(0.0, 6.0))
    assert spec.response("physio") == msrm.GaussianWidthLag(lag_bounds=(0.0, 6.0), width_bounds=(0.3, 3.0))
    brain = [s for s in run.streams if s.modality == "brain"]
    assert len(brain) == 3 and all(s.n_features == 200 and s.dt == 2.0 for s in brain)
    for m, dt in (("rating", 1.0), ("physio", 1.3)):
        ss = [s for s in run.streams if s.modality == m]
        assert len(ss) == 4 and all(s.n_features == 1 and s.dt == dt and s.offset == 0.0 for s in ss)
    assert truth.response == {"rating": {"lag": 2.5, "width": 1.2}, "physio": {"lag": 1.5, "width": 0.8}}
    assert truth.spec_response() == {"rating": {"lag": 2.5}, "physio": {"lag": 1.5, "width": 0.8}}
    assert truth.observed_span == [(0.0, 300.0)]
    assert np.all(truth.noise_sd["b1/brain"] == 1.0) and np.all(truth.noise_sd["r1/rating"] == 0.3)
    assert truth.loadings["b1/brain"].shape == (200, 2) and truth.intercepts["r2/physio"].shape == (1,)
    assert not any(np.isnan(v).any() for v in _values(data))


def test_same_seed_same_data_different_seed_different():
    d1, _, t1 = make_design("small", 7)
    d2, _, t2 = make_design("small", 7)
    d3, _, t3 = make_design("small", 8)
    assert _same_arrays(_values(d1), _values(d2))
    assert _same_arrays(t1.latents, t2.latents)
    for k in t1.loadings:
        assert np.array_equal(t1.loadings[k], t2.loadings[k]) and np.array_equal(t1.intercepts[k], t2.intercepts[k])
    assert t1.response == t2.response
    assert not np.array_equal(t1.latents[0], t3.latents[0])
    assert all(not np.array_equal(a, b) for a, b in zip(_values(d1), _values(d3)))


def test_independent_randomness_streams():
    d0, _, t0 = make_design("small", 3)
    d1, _, t1 = make_design("small", 3, n_brain_features=7)
    assert _same_arrays(t0.latents, t1.latents)
    # non-brain streams, their loadings and intercepts do not move either
    for s0, s1 in zip(d0.runs[0].streams, d1.runs[0].streams):
        assert s0.key == s1.key
        if s0.modality != "brain":
            assert np.array_equal(s0.values, s1.values)
        else:
            assert s1.n_features == 7
    # one more run leaves run 0 alone; snr scales the loadings and nothing else
    _, _, t2 = make_design("small", 3, n_runs=2)
    assert np.array_equal(t2.latents[0], t0.latents[0]) and not np.array_equal(t2.latents[1], t0.latents[0])
    _, _, t3 = make_design("small", 3, snr=2.0)
    for k in t0.loadings:
        np.testing.assert_allclose(t3.loadings[k], 2.0 * t0.loadings[k], rtol=1e-15)
        assert np.array_equal(t3.intercepts[k], t0.intercepts[k])


def _brute_gaussian(path, t, lag, width, step=0.002, sigmas=10.0):
    """Riemann sum of int z(t - lag - s) N(s; 0, width^2) ds, the density not renormalised."""
    m = math.ceil(sigmas * width / step)
    s = step * np.arange(-m, m + 1)
    dens = np.exp(-0.5 * (s / width) ** 2) / (width * math.sqrt(2 * math.pi)) * step
    return np.stack([dens @ path(ti - lag - s) for ti in t])


@pytest.mark.parametrize("name", ["baseline", "bumps_hrf"])
def test_closed_form_gaussian_response_matches_brute_force(built, name):
    path = built[name][2].paths[0]
    assert isinstance(path, SinusoidPath if name == "baseline" else BumpPath)
    t = np.linspace(10.0, built[name][0].runs[0].duration - 20.0, 23)  # inside the path span for width 3
    for lag, width in ((2.5, 1.2), (1.5, 0.8), (0.0, 3.0)):
        exact = gaussian_response(path, t, lag, width)
        np.testing.assert_allclose(exact, _brute_gaussian(path, t, lag, width), rtol=0, atol=1e-8)
        # the generic quadrature (what OU paths use) agrees with the closed form
        np.testing.assert_allclose(LatentPath.gaussian(path, t, lag, width), exact, rtol=0, atol=1e-10)
    # the response is not the identity: damping and the lag are visible
    assert np.abs(gaussian_response(path, t, 2.5, 1.2) - path(t)).max() > 0.05


def test_ou_gaussian_response_quadrature(built):
    path = built["ou_latents"][2].paths[0]
    assert isinstance(path, OUPath)
    t = np.linspace(0.2, 300.0, 17)
    np.testing.assert_allclose(gaussian_response(path, t, 1.5, 0.8), _brute_gaussian(path, t, 1.5, 0.8),
                               rtol=0, atol=1e-5)


def test_hrf_quadrature_converged_and_matches_closed_form(built):
    # the bumps path through the HRF: default quadrature against a 4x finer, higher-order one
    path = built["bumps_hrf"][2].paths[1]
    t = np.linspace(0.0, 200.0, 41)
    for delay, disp in ((1.0, 1.0), (-1.0, 0.9), (3.0, 0.8)):  # reach d + 64 c inside the path span
        coarse = hrf_response(path, t, delay, disp)
        fine = hrf_response(path, t, delay, disp, panel=0.25, nodes=16)
        np.testing.assert_allclose(coarse, fine, rtol=0, atol=1e-6)
    # a sinusoid through the (untruncated) double gamma, from the gamma characteristic functions:
    # int h~(s) e^{-i w s} ds = ((1 + i w)^-6 - (1 + i w)^-16 / 6) / (5 / 6)
    sp = make_design("baseline", 0, brain_response="hrf")[2].paths[0]  # a path span that holds the HRF's reach
    assert np.array_equal(sp.omega, built["baseline"][2].paths[0].omega)
    t = np.linspace(0.0, 300.0, 31)
    d = 1.0
    H = ((1 + 1j * sp.omega) ** -6 - (1 + 1j * sp.omega) ** -16 / 6) / (5 / 6)
    phasor = np.exp(1j * (sp.omega[None] * (t[:, None, None] - d) + sp.phase[None])) * H[None]
    closed = ((sp.amplitude[None] * phasor.imag).sum(axis=2) - sp.mean) / sp.sd
    np.testing.assert_allclose(hrf_response(sp, t, d, 1.0), closed, rtol=0, atol=1e-9)


def _moments(path, T, breaks, n):
    x, w = _gauss_legendre(breaks, n)
    z = path(x)
    m = w @ z / T
    return m, np.sqrt(w @ (z - m) ** 2 / T)


def test_latents_on_the_grid_and_standardised(built):
    for name, (data, spec, truth) in built.items():
        for r, run in enumerate(data.runs):
            grid = msrm.latent_grid(run.duration, spec)
            assert truth.latents[r].shape == (grid.size, spec.n_factors)
            np.testing.assert_array_equal(truth.latents[r], truth.latent_at(r, grid))
    # standardisation: (1/T) int_0^T z = 0 and (1/T) int_0^T z^2 = 1, checked by a quadrature independent of the
    # one that defined it (closed form for sinusoids; 2-point Gauss-Legendre on the OU knots; 12 nodes / 0.5 s
    # for bumps): composite Gauss-Legendre, 16 nodes per 0.25 s panel
    for name, tol in (("baseline", 1e-12), ("fast_dynamics", 1e-12), ("small", 1e-12), ("bumps_hrf", 1e-12)):
        data, _, truth = built[name]
        T = data.runs[0].duration
        m, sd = _moments(truth.paths[0], T, _panels(0.0, T, 0.25), 16)
        np.testing.assert_allclose(m, 0.0, atol=tol)
        np.testing.assert_allclose(sd, 1.0, atol=tol)
    # OU: piecewise linear; a quadrature on its own knots (finer, 5 nodes) is exact too
    path = built["ou_latents"][2].paths[0]
    knots = path.t_min + path.step * np.arange(path.values.shape[0])
    knots = np.concatenate([[0.0], knots[(knots > 1e-12) & (knots < 300.0 - 1e-12)], [300.0]])
    m, sd = _moments(path, 300.0, knots, 5)
    np.testing.assert_allclose(m, 0.0, atol=1e-12)
    np.testing.assert_allclose(sd, 1.0, atol=1e-12)
    # and the path is truly piecewise linear, not smooth: the sinusoid grid check above would fail for it
    assert not np.allclose(_moments(path, 300.0, _panels(0.0, 300.0, 0.37), 2)[1], 1.0, rtol=0, atol=1e-12)


def test_every_design_builds_and_fits_its_spec(built):
    for name, (data, spec, truth) in built.items():
        d = truth.design
        assert len(data.runs) == d.n_runs and len(truth.latents) == d.n_runs
        for r, run in enumerate(data.runs):
            grid = msrm.latent_grid(run.duration, spec)
            for s in run.streams:
                key = s.key
                assert truth.loadings[key].shape == (s.n_features, spec.n_factors)
                resp = spec.response(s.modality)
                theta = truth.spec_response().get(s.modality, {})
                A = response_weights_csr(s.times, resp, theta, grid)  # the spec accepts the stream (HRF windows)
                seen = truth.seen(r, s.modality, s.times)
                # the model's discrete response of the true grid latents approximates the continuous truth:
                # same lag sign, same normalisation
                np.testing.assert_allclose(A @ truth.latents[r], seen, rtol=0, atol=0.05)
                # the observation equation: residuals are the noise
                resid = s.values - truth.intercepts[key] - seen @ truth.loadings[key].T
                ok = ~np.isnan(resid)
                sd = truth.noise_sd[key][0]
                assert abs(np.std(resid[ok]) / sd - 1) < (0.1 if s.modality == "brain" else 0.35), (name, key)
    _, spec, _ = built["bumps_hrf"]
    assert isinstance(spec.response("brain"), msrm.HRF)
    assert built["bumps_hrf"][2].response["brain"] == {"delay": 1.0, "dispersion": 1.0}
    offsets = {s.modality: s.offset for s in built["ou_latents"][0].runs[0].streams}
    assert offsets == {"brain": 0.0, "rating": 0.2, "physio": 0.4}


def test_small_fits_with_rmsrm(built):
    data, spec, truth = built["small"]
    grid = msrm.latent_grid(60.0, spec)
    assert grid.size < 100 and sum(s.values.size for s in data.runs[0].streams) < 2000
    fit = msrm.fit_rmsrm(data, spec, restarts=1, max_iter=2, progress=False)
    assert fit.latents[0].shape == truth.latents[0].shape


def _runs_of_true(mask):
    edges = np.diff(np.concatenate([[0], mask.astype(int), [0]]))
    return np.flatnonzero(edges == -1) - np.flatnonzero(edges == 1)


def test_missing_pattern(built):
    data, _, truth = built["missing_brain"]
    run = data.runs[0]
    patterns = []
    for s in run.streams:
        nan = np.isnan(s.values)
        if s.modality == "brain":
            rows = nan.all(axis=1)
            assert np.array_equal(nan.any(axis=1), rows)  # whole time points are missing
            assert rows.sum() == round(0.3 * s.n_samples)
            lengths = _runs_of_true(rows)
            block = 10  # 20 s on a 2 s clock
            assert len(lengths) <= math.ceil(rows.sum() / block) and (lengths >= rows.sum() % block).all()
            assert (lengths >= block).sum() >= len(lengths) - 1
            patterns.append(rows)
        elif s.modality == "rating":
            assert nan.sum() == round(0.05 * s.n_samples)
        else:
            assert not nan.any()
    assert all(not np.array_equal(patterns[0], p) for p in patterns[1:])
    assert not any(np.isnan(v).any() for v in _values(built["baseline"][0]))


def test_overrides_and_errors():
    data, _, truth = make_design("small", 0, n_participants=3, duration=40.0)
    keys = set(data.runs[0].keys)
    assert {"b1/brain", "b3/brain", "r3/rating", "r3/physio"} <= keys and "b4/brain" not in keys
    assert data.runs[0].duration == 40.0
    with pytest.raises(ValueError, match="'nope'.*baseline"):
        make_design("nope", 0)
    with pytest.raises(ValueError, match="n_brain_feature"):
        make_design("baseline", 0, n_brain_feature=3)
    with pytest.raises(ValueError, match="n_brain_features"):
        make_design("baseline", 0, n_brain_features=0)
    with pytest.raises(ValueError, match="snr"):
        make_design("baseline", 0, snr=-1.0)
    with pytest.raises(ValueError, match="latent"):
        make_design("baseline", 0, latent="gp")
    with pytest.raises(ValueError, match="n_runs"):
        make_design("baseline", 0, n_runs=1.5)
    with pytest.raises(ValueError, match="times"):
        truth.latent_at(0, [1e6])


def test_truth_pickles(built):
    _, _, truth = built["ou_latents"]
    back = pickle.loads(pickle.dumps(truth))
    t = np.linspace(0, 300, 11)
    np.testing.assert_array_equal(back.latent_at(0, t), truth.latent_at(0, t))
    np.testing.assert_array_equal(back.seen(0, "physio", t), truth.seen(0, "physio", t))
