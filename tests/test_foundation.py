"""Foundation: grid rule, canonical operators, node tables, Params round trip, synthetic study."""
import json
import math
import subprocess
import sys

import numpy as np
import pytest

import data_synth
import msrm
from msrm import operators as ops
from msrm.nodes import prepare_nodes, response_groups


def spec_for(**kw):
    base = dict(
        n_factors=2,
        latent_dt=0.9,
        responses={
            "brain": msrm.Identity(),
            "rating": msrm.GaussianLag(width=1.5, lag_bounds=(0.0, 8.0)),
            "physio": msrm.GaussianWidthLag(lag_bounds=(0.0, 8.0), width_bounds=(0.5, 3.0)),
        },
    )
    base.update(kw)
    return msrm.ModelSpec(**base)


# ---------------------------------------------------------------- grid
def test_grid_rule_start_step_last():
    spec = spec_for()
    # default pad = lag_max + 4 width_max = 8 + 12 = 20 s, rounded up to a multiple of 0.9 -> 23 steps = 20.7 s
    assert spec.pad == pytest.approx(23 * 0.9)
    tau = msrm.latent_grid(454.0, spec)
    assert tau[0] == pytest.approx(-20.7)
    np.testing.assert_allclose(np.diff(tau), 0.9, rtol=0, atol=1e-12)
    assert tau[-1] >= 454.0 and tau[-2] < 454.0  # the last point is the first >= T


def test_grid_exact_multiple_and_explicit_pad():
    spec = spec_for(latent_pad=1.0, latent_dt=0.5)
    assert spec.pad == pytest.approx(1.0)
    tau = msrm.latent_grid(10.0, spec)
    assert tau[0] == pytest.approx(-1.0) and tau[-1] == pytest.approx(10.0)
    assert tau.size == 23


def test_identity_only_spec_has_no_pad():
    spec = msrm.ModelSpec(n_factors=1, latent_dt=1.0, responses={"brain": msrm.Identity()})
    assert spec.pad == 0.0
    assert msrm.latent_grid(5.0, spec)[0] == 0.0


# ---------------------------------------------------------------- operators
@pytest.fixture
def grid():
    return msrm.latent_grid(60.0, spec_for())


def test_identity_rows_interpolate_exactly(grid):
    t = np.array([0.0, 0.45, 13.3, 59.99, 60.0])
    A = ops.response_weights(t, msrm.Identity(), {}, grid)
    np.testing.assert_allclose(A.sum(1), 1.0, atol=1e-14)
    np.testing.assert_allclose(A @ grid, t, atol=1e-12)  # linear functions are reproduced exactly
    f = np.sin(grid / 7.0)
    # between grid points the row is the linear interpolant
    np.testing.assert_allclose(A @ f, np.interp(t, grid, f), atol=1e-14)


@pytest.mark.parametrize("resp, theta", [
    (msrm.GaussianLag(width=1.5, lag_bounds=(0.0, 8.0)), {"lag": 3.0}),
    (msrm.GaussianWidthLag(lag_bounds=(0.0, 8.0), width_bounds=(0.5, 3.0)), {"lag": 2.0, "width": 0.7}),
])
def test_gaussian_rows_sum_to_one_and_move_with_lag(grid, resp, theta):
    t = np.array([0.0, 10.0, 33.3, 60.0])
    A = ops.response_weights(t, resp, theta, grid)
    np.testing.assert_allclose(A.sum(1), 1.0, atol=1e-14)
    centre = A @ grid
    # interior rows centred at t - lag (a Gaussian sampled on a coarse grid aliases its mean slightly)
    np.testing.assert_allclose(centre[1:3], t[1:3] - theta["lag"], atol=1e-3)
    later = dict(theta, lag=theta["lag"] + 1.0)
    centre2 = ops.response_weights(t, resp, later, grid) @ grid
    np.testing.assert_allclose(centre2[1:3], centre[1:3] - 1.0, atol=1e-3)


def test_gaussian_row_matches_formula(grid):
    resp = msrm.GaussianWidthLag(lag_bounds=(0.0, 8.0), width_bounds=(0.5, 3.0))
    t, mu, s = 20.0, 2.5, 1.1
    g = np.exp(-((t - mu - grid) ** 2) / (2 * s * s))
    np.testing.assert_allclose(ops.response_weights([t], resp, {"lag": mu, "width": s}, grid)[0], g / g.sum(), rtol=1e-13)


@pytest.mark.parametrize("resp, theta", [
    (msrm.Identity(), {}),
    (msrm.GaussianLag(width=1.5, lag_bounds=(0.0, 8.0)), {"lag": 7.9}),
    (msrm.GaussianWidthLag(lag_bounds=(0.0, 8.0), width_bounds=(0.5, 3.0)), {"lag": 0.0, "width": 3.0}),
    (msrm.GaussianWidthLag(lag_bounds=(0.0, 8.0), width_bounds=(0.5, 3.0)), {"lag": 4.0, "width": 0.5}),
])
def test_csr_and_jax_match_dense(grid, resp, theta):
    import jax
    import jax.numpy as jnp

    msrm.runtime.enable_x64()
    t = np.arange(0.0, 60.0, 1.2)
    dense = ops.response_weights(t, resp, theta, grid)
    csr = ops.response_weights_csr(t, resp, theta, grid).toarray()
    np.testing.assert_allclose(csr, dense, rtol=0, atol=1e-12)
    layout = ops.window_layout(t, resp, grid)
    w = np.asarray(jax.jit(lambda th: ops.jax_window_weights(th, resp, layout))(
        {k: jnp.asarray(v) for k, v in theta.items()}))
    full = np.zeros_like(dense)
    for i in range(t.size):
        full[i, layout.start[i]: layout.start[i] + layout.width] = w[i]
    np.testing.assert_allclose(full, dense, rtol=0, atol=1e-12)


def test_csr_derivatives_match_finite_differences(grid):
    resp = msrm.GaussianWidthLag(lag_bounds=(0.0, 8.0), width_bounds=(0.5, 3.0))
    t = np.arange(0.0, 60.0, 1.5)
    theta = {"lag": 2.2, "width": 1.3}
    _, d = ops.response_weights_and_derivs_csr(t, resp, theta, grid)
    for name in ("lag", "width"):
        h = 1e-6
        up = ops.response_weights(t, resp, dict(theta, **{name: theta[name] + h}), grid)
        dn = ops.response_weights(t, resp, dict(theta, **{name: theta[name] - h}), grid)
        np.testing.assert_allclose(d[name].toarray(), (up - dn) / (2 * h), atol=1e-8)


def test_jax_weights_are_differentiable(grid):
    import jax
    import jax.numpy as jnp

    msrm.runtime.enable_x64()
    resp = msrm.GaussianWidthLag(lag_bounds=(0.0, 8.0), width_bounds=(0.5, 3.0))
    t = np.arange(0.0, 60.0, 1.5)
    layout = ops.window_layout(t, resp, grid)
    v = np.linspace(-1, 1, layout.width)

    def f(lag, width):
        return jnp.sum(ops.jax_window_weights({"lag": lag, "width": width}, resp, layout) @ v)

    g = jax.grad(f, argnums=(0, 1))(2.2, 1.3)
    h = 1e-6
    fd = ((f(2.2 + h, 1.3) - f(2.2 - h, 1.3)) / (2 * h), (f(2.2, 1.3 + h) - f(2.2, 1.3 - h)) / (2 * h))
    np.testing.assert_allclose(np.array(g), np.array(fd), rtol=1e-7, atol=1e-8)


def test_window_keeps_everything_above_1e12(grid):
    resp = msrm.GaussianWidthLag(lag_bounds=(0.0, 8.0), width_bounds=(0.5, 3.0))
    t = np.arange(0.0, 60.0, 0.7)
    layout = ops.window_layout(t, resp, grid)
    for theta in ({"lag": 0.0, "width": 3.0}, {"lag": 8.0, "width": 3.0}, {"lag": 4.0, "width": 0.5}):
        dense = ops.response_weights(t, resp, theta, grid)
        inside = np.zeros_like(dense, dtype=bool)
        for i in range(t.size):
            inside[i, layout.start[i]: layout.start[i] + layout.width] = True
        dropped = np.where(inside, 0.0, dense).max(axis=1)
        assert (dropped <= 1e-12 * dense.max(axis=1)).all()


# ---------------------------------------------------------------- nodes
def test_node_counts_one_eighth():
    data, truth = data_synth.synthetic_dataset("one-eighth", n_features=8)
    counts = msrm.count_nodes(data, truth.spec)
    # brain 253 samples (dt 1.8), ratings 379 (dt 1.2), physiology 303 (dt 1.5), shared across participants
    assert counts == [253 + 379 + 303]
    assert 850 <= counts[0] <= 950
    dense = msrm.count_nodes(data, truth.spec, grouped=False)
    assert dense == [4 * 253 + 5 * 379 + 5 * 303]
    grid = msrm.latent_grid(data.runs[0].duration, truth.spec)
    assert 500 <= grid.size <= 560  # fewer grid points than nodes: node covariances are singular


def test_node_tables_shared_and_individual():
    data, truth = data_synth.synthetic_dataset("tiny", n_features=3)
    for pooling, n_groups in (("shared", 3), ("individual", 1 + 2 + 2)):
        spec = spec_for(pooling=pooling, latent_dt=1.0, n_factors=2)
        groups = response_groups(data, spec)
        assert len(groups) == n_groups
        nodes = prepare_nodes(data.runs[0], spec, groups)
        for s in data.runs[0].streams:
            idx = nodes.stream_nodes[s.key]
            np.testing.assert_allclose(nodes.node_time[idx], s.times, atol=1e-9)
            assert (nodes.node_group[idx] == nodes.stream_group[s.key]).all()
        # Identity never needs per-participant groups
        assert sum(g.modality == "brain" for g in groups) == 1
        if pooling == "individual":
            assert {g.param_key for g in groups if g.modality == "rating"} == {"p3/rating", "p4/rating"}


def test_dense_table_gives_every_sample_a_node():
    data, truth = data_synth.synthetic_dataset("tiny", n_features=3)
    groups = response_groups(data, truth.spec)
    nodes = prepare_nodes(data.runs[0], truth.spec, groups, grouped=False)
    assert nodes.n_nodes == sum(s.n_samples for s in data.runs[0].streams)
    allidx = np.concatenate(list(nodes.stream_nodes.values()))
    assert np.unique(allidx).size == allidx.size


# ---------------------------------------------------------------- params
def test_params_round_trip_and_validate(tmp_path):
    from msrm import atomic

    data, truth = data_synth.synthetic_dataset("tiny", n_features=3, pooling="individual")
    p = truth.params.validate(data, truth.spec)
    atomic.write_npz(tmp_path / "p.npz", p.flatten())
    q = msrm.Params.unflatten(atomic.read_npz(tmp_path / "p.npz")).validate(data, truth.spec)
    assert q.allclose(p, rtol=0)
    assert q.response == p.response
    with pytest.raises(ValueError):
        q.loadings["p1/brain"][0, 0] = 1.0  # read-only


# ---------------------------------------------------------------- synthetic study
def test_synthetic_is_deterministic_and_shaped():
    d1, t1 = data_synth.synthetic_dataset("tiny", n_features=4, n_runs=2, seed=3)
    d2, t2 = data_synth.synthetic_dataset("tiny", n_features=4, n_runs=2, seed=3)
    d3, _ = data_synth.synthetic_dataset("tiny", n_features=4, n_runs=2, seed=4)
    for r1, r2, r3 in zip(d1.runs, d2.runs, d3.runs):
        for a, b, c in zip(r1.streams, r2.streams, r3.streams):
            np.testing.assert_array_equal(a.values, b.values)
            assert not np.array_equal(a.values, c.values)
    assert len(t1.latents) == 2 and t1.latents[0].shape == (msrm.latent_grid(24.0, t1.spec).size, 3)


def test_one_eighth_profile_matches_design():
    data, truth = data_synth.synthetic_dataset("one-eighth", n_features=3600)
    spec = truth.spec
    assert spec.n_factors == 3 and spec.latent_dt == 0.9 and spec.kernel == "matern32" and spec.pooling == "shared"
    assert spec.responses["brain"] == msrm.Identity()
    assert spec.responses["rating"] == msrm.GaussianLag(width=1.5, lag_bounds=(0, 8))
    assert spec.responses["physio"] == msrm.GaussianWidthLag(lag_bounds=(0, 8), width_bounds=(0.5, 3))
    run = data.runs[0]
    assert abs(run.duration - 454.0) < 1.0
    dts = {s.modality: s.dt for s in run.streams}
    assert dts == {"brain": 1.8, "rating": 1.2, "physio": 1.5}
    assert sum(s.modality == "brain" for s in run.streams) == 4
    assert sum(s.modality == "rating" for s in run.streams) == 5
    assert 3.6e6 <= data.n_observed <= 3.7e6


def test_synthetic_signal_to_noise_is_realistic():
    data, truth = data_synth.synthetic_dataset("one-eighth", n_features=200, seed=1)
    for s in data.runs[0].streams:
        resid_var = np.nanvar(s.values - s.values.mean(0), axis=0).mean()
        noise_var = (truth.params.noise_sd[s.key] ** 2).mean()
        snr = resid_var / noise_var - 1.0
        expected = {"brain": 0.5, "rating": 4.0, "physio": 2.0}[s.modality]
        assert 0.3 * expected < snr < 3.0 * expected, (s.key, snr)


def test_missing_fraction_keeps_every_feature():
    data, _ = data_synth.synthetic_dataset("tiny", n_features=6, missing_fraction=0.5, seed=2)
    frac = 1 - data.n_observed / sum(s.values.size for s in data.runs[0].streams)
    assert 0.3 < frac < 0.6  # constructing the Stream would have raised on an all-NaN feature


def test_import_msrm_does_not_import_jax():
    code = "import sys, msrm, data_synth; data_synth.synthetic_dataset('tiny', n_features=2); " \
           "print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_execution_info_fields():
    info = msrm.runtime.execution_info(include_jax=False)
    for key in ("backend", "devices", "dtype", "numpy", "blas", "blas_threads", "cpu_model", "physical_cores",
                "openblas_coretype", "load_average_1m"):
        assert key in info
    assert "git_commit" not in info  # checkout bookkeeping is msrm_lab.provenance's
    assert info["backend"] == "numpy"
    info = msrm.runtime.execution_info(include_jax=True)
    assert info["backend"] == "cpu" and info["devices"]


def test_oversubscription_warning():
    cores = msrm.runtime.physical_cores()
    with pytest.warns(msrm.runtime.OversubscriptionWarning, match="physical cores"):
        assert msrm.runtime.check_oversubscription(cores + 1)
    assert not msrm.runtime.check_oversubscription(cores)


def test_blas_limit_holds_in_other_threads():
    # configure(blas_threads=2) leaves the main thread holding a threadpoolctl limit for good; JAX runs host
    # callbacks on other threads, where blas_limit must still set (and then restore) OpenBLAS's thread count
    code = """
import json, threading, threadpoolctl, msrm
from scipy.linalg import blas
def n():
    return sorted({i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"})
held = threadpoolctl.threadpool_limits(limits=2, user_api="blas")
out = {"held": n()}
def worker():
    with msrm.runtime.blas_limit(1):
        out["inside"] = n()
    out["after"] = n()
t = threading.Thread(target=worker)
t.start()
t.join()
print(json.dumps(out))
"""
    out = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                    check=True).stdout)
    if 2 not in out["held"]:
        pytest.skip(f"OpenBLAS cannot run 2 threads here: {out}")
    assert out["inside"] == [1] and out["after"] == out["held"], out


def test_window_rule_constant():
    # the window reaches 7.5 sigma: what it can drop is below 1e-12 of a row's largest weight
    assert math.exp(-msrm.responses.WINDOW_SIGMAS ** 2 / 2) < 1e-12


def test_split_run_partitions_samples():
    from msrm.data import split_run

    data, _ = data_synth.synthetic_dataset("tiny", n_features=3, duration_scale=4.0)
    run = data.runs[0]
    pieces = split_run(run, 4)
    assert len(pieces) == 4 and all(p.duration == pytest.approx(run.duration / 4) for p in pieces)
    for s in run.streams:
        parts = [p.stream(s.key) for p in pieces if s.key in p.keys]
        np.testing.assert_array_equal(np.concatenate([q.values for q in parts]), s.values)
        times = np.concatenate([q.times + i * run.duration / 4 for i, q in enumerate(parts)])
        np.testing.assert_allclose(times, s.times, atol=1e-9)
    msrm.Dataset(pieces)  # same streams, same features: a valid multi-run dataset
    with pytest.raises(ValueError, match="n_pieces"):
        split_run(run, 0)
