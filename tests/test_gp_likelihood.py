"""Dense and grouped GP-MSRM likelihoods against the brute-force density (full covariance + SciPy).

Every fast path is compared with an obviously correct slow one: ``scipy.stats.multivariate_normal.logpdf`` of the
full covariance of every observed scalar (msrm.gp.reference), on tiny datasets for all three kernels, both poolings,
missing values and two runs; node sufficient statistics against a direct per-observation sum; the LAPACK callback
against the native factorization.
"""
from __future__ import annotations

import numpy as np
import pytest

import msrm
import data_synth

msrm.runtime.enable_x64()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from msrm.gp import likelihood as L  # noqa: E402
from msrm.gp import prepare as P  # noqa: E402
from msrm.gp.memory import MemoryGuardError  # noqa: E402
from msrm.gp.model import GPMSRM, params_to_theta  # noqa: E402
from msrm.gp.reference import brute_force_loglik  # noqa: E402
from msrm.operators import response_weights  # noqa: E402

REL = 1e-9


def _perturbed(truth, seed):
    """Truth with moved lags/widths and lengthscales, so nothing sits at a special value."""
    rng = np.random.default_rng(seed)
    resp = {}
    for k, d in truth.params.response.items():
        r = truth.spec.response(k.split("/")[-1])
        resp[k] = {n: float(np.clip(v + rng.uniform(-0.3, 0.3), *r.bounds[n])) for n, v in d.items()}
    return truth.params.replace(response=resp, lengthscales=truth.params.lengthscales * rng.uniform(0.7, 1.4))


CASES = [
    (kernel, pooling, missing, runs)
    for kernel in ("matern12", "matern32", "matern52")
    for pooling in ("shared", "individual")
    for missing, runs in ((0.0, 1), (0.2, 2))
]


@pytest.mark.parametrize("kernel,pooling,missing,runs", CASES)
def test_dense_grouped_and_brute_force_agree(kernel, pooling, missing, runs):
    data, truth = data_synth.synthetic_dataset(
        "tiny", n_features=4, n_runs=runs, seed=3, kernel=kernel, pooling=pooling, missing_fraction=missing
    )
    params = _perturbed(truth, seed=7)
    ref = brute_force_loglik(data, truth.spec, params)
    values = {}
    for la in ("grouped", "dense"):
        model = GPMSRM(data, truth.spec, la)
        values[la] = model.log_likelihood(params)
        assert model.guard_events() == {0: runs}
    assert values["grouped"] == pytest.approx(ref, rel=REL)
    assert values["dense"] == pytest.approx(ref, rel=REL)
    assert values["grouped"] == pytest.approx(values["dense"], rel=REL)


def _crowded_dataset():
    """More nodes than grid points (C_k singular), low-count nodes (one-feature streams) and Cholesky nodes."""
    rng = np.random.default_rng(11)
    T = 12.0
    streams = []
    for i, off in enumerate((0.0, 0.13, 0.37, 0.61)):
        n = int((T - off) / 0.5) + 1
        streams.append(msrm.Stream(f"r{i}", "rating", 0.5, rng.normal(size=(n, 1)), offset=off))
    streams.append(msrm.Stream("b0", "brain", 1.0, rng.normal(size=(13, 5))))
    spec = msrm.ModelSpec(n_factors=2, latent_dt=1.0, kernel="matern32", pooling="shared",
                          responses={"rating": msrm.GaussianLag(width=0.8, lag_bounds=(0.0, 2.0)),
                                     "brain": msrm.Identity()})
    data = msrm.Dataset([msrm.Run(T, streams)])
    K = spec.n_factors
    params = msrm.Params(
        loadings={s.key: rng.normal(size=(s.n_features, K)) for s in streams},
        intercepts={s.key: rng.normal(size=s.n_features) for s in streams},
        noise_sd={s.key: rng.uniform(0.5, 1.0, s.n_features) for s in streams},
        lengthscales=np.array([2.0, 4.5]),
        response={"rating": {"lag": 0.9}},
    )
    return data, spec, params


def test_singular_node_covariance_regime():
    data, spec, params = _crowded_dataset()
    run = P.prepare(data, spec).runs[0]
    N, J = run.layout.n_nodes, run.layout.n_grid
    assert N > J  # C_k = A K A^T has rank <= J < N: singular
    C = np.asarray(L.node_covariance(params_to_theta(params), run.layout))
    assert np.linalg.matrix_rank(C[0]) <= J
    assert 0 < run.layout.chol_nodes.size < N  # both factor kinds present
    model = GPMSRM(data, spec, "grouped")
    assert model.log_likelihood(params) == pytest.approx(brute_force_loglik(data, spec, params), rel=REL)


def test_node_information_matches_direct_sums():
    data, truth = data_synth.synthetic_dataset("tiny", n_features=4, seed=5, pooling="individual",
                                               missing_fraction=0.2)
    params = truth.params
    run_prep = P.prepare(data, truth.spec).runs[0]
    Lam, eta, R, const = (np.asarray(x) for x in L.node_information(params_to_theta(params), run_prep))
    N, K = run_prep.layout.n_nodes, truth.spec.n_factors
    Lam_ref = np.zeros((N, K, K))
    eta_ref = np.zeros((N, K))
    quad = logdet = n_obs = 0.0
    for s, sl in zip(data.runs[0].streams, run_prep.layout.streams):
        W, b, sd = params.loadings[s.key], params.intercepts[s.key], params.noise_sd[s.key]
        for i, f in zip(*np.nonzero(s.mask)):  # one observation at a time
            u = sl.sample_nodes[i]
            Lam_ref[u] += np.outer(W[f], W[f]) / sd[f] ** 2
            eta_ref[u] += W[f] * (s.values[i, f] - b[f]) / sd[f] ** 2
            quad += (s.values[i, f] - b[f]) ** 2 / sd[f] ** 2
            logdet += np.log(sd[f] ** 2)
            n_obs += 1
    np.testing.assert_allclose(Lam, Lam_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(eta, eta_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.einsum("uak,ual->ukl", R, R), Lam_ref, rtol=1e-10, atol=1e-12)
    assert const == pytest.approx(n_obs * np.log(2 * np.pi) + logdet + quad, rel=1e-12)
    low = np.setdiff1d(np.arange(N), run_prep.layout.chol_nodes)
    assert low.size and np.all(run_prep.layout.node_rows[low] <= K)


def test_response_matrix_matches_canonical_rows():
    data, truth = data_synth.synthetic_dataset("tiny", n_features=3, seed=2)
    run_prep = P.prepare(data, truth.spec).runs[0]
    lay = run_prep.layout
    A = np.asarray(L.response_matrix(params_to_theta(truth.params), lay))
    for g in lay.groups:
        theta = {} if g.param_key is None else truth.params.response[g.param_key]
        ref = response_weights(lay.node_time[g.node_start:g.node_stop], g.response, theta, lay.grid)
        np.testing.assert_allclose(A[g.node_start:g.node_stop], ref, atol=1e-12)


def test_callback_and_native_agree():
    data, truth = data_synth.synthetic_dataset("tiny", n_features=4, seed=4, missing_fraction=0.1)
    out = {}
    for method in ("callback", "native"):
        model = GPMSRM(data, truth.spec, "grouped", method=method)
        u = model.unconstrain(_perturbed(truth, 1))
        out[method] = model.value_and_grad(u)
    assert out["callback"][0] == pytest.approx(out["native"][0], rel=1e-12)
    np.testing.assert_allclose(out["callback"][1], out["native"][1], rtol=1e-9, atol=1e-9)


def test_near_singular_case_records_guard_event():
    """Duplicated streams, huge lengthscales, huge (nearly equal) loadings and tiny noise: M = I + R C R^T has
    eigenvalues around 1e26 next to 1, beyond what a plain float64 Cholesky resolves; the guard records it."""
    rng = np.random.default_rng(0)
    T = 20.0
    y = rng.normal(size=(21, 1))
    streams = [msrm.Stream(p, "rating", 1.0, y) for p in ("a", "b", "c", "d", "e")]
    spec = msrm.ModelSpec(n_factors=2, latent_dt=1.0, responses={"rating": msrm.Identity()})
    data = msrm.Dataset([msrm.Run(T, streams)])
    params = msrm.Params(
        loadings={s.key: np.array([[1e6, 1e6]]) + rng.normal(0.0, 1e3, (1, 2)) for s in streams}, intercepts={s.key: np.zeros(1) for s in streams},
        noise_sd={s.key: np.full(1, 1e-7) for s in streams}, lengthscales=np.array([1e9, 1e9]))
    model = GPMSRM(data, spec, "grouped")
    value = model.log_likelihood(params)
    events = model.guard_events()
    assert 0 not in events and sum(events.values()) == 1
    (code,) = events
    assert code > 0 or code == -1
    assert np.isfinite(value)


def test_memory_guard_refuses_before_numerics(monkeypatch, likelihood_traces):
    data, truth = data_synth.synthetic_dataset("tiny", n_features=3, seed=0)
    monkeypatch.setenv("MSRM_MEMORY_LIMIT_BYTES", "1000")
    before = likelihood_traces[0]
    with pytest.raises(MemoryGuardError, match="state_space"):
        GPMSRM(data, truth.spec, "grouped")
    assert likelihood_traces[0] == before


def test_loglik_is_pure_and_jittable_with_prepared_as_argument():
    data, truth = data_synth.synthetic_dataset("tiny", n_features=3, seed=0, n_runs=2)
    prepared = P.prepare(data, truth.spec)
    theta = params_to_theta(truth.params)
    f = jax.jit(L.grouped_loglik)
    v1, ev = f(theta, prepared)
    v2, _ = f(theta, jax.device_put(prepared))
    per_run, _ = L.run_logliks(theta, prepared)
    assert float(v1) == float(v2)
    assert float(jnp.sum(per_run)) == pytest.approx(float(v1), rel=1e-14)
    assert ev.shape == (2,) and ev.dtype == jnp.int32
