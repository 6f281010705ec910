"""Guarded symmetric factorization: value, gradient, ladder, fallback, paths, jit and vmap.

References: NumPy slogdet/solve for the value, central finite differences and ``jax.test_util.check_grads`` for
the gradient, and the native path against the LAPACK callback.
"""
from __future__ import annotations

import re

import warnings

import numpy as np
import pytest

import msrm.runtime

msrm.runtime.enable_x64()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.test_util import check_grads  # noqa: E402

from msrm.gp import linalg  # noqa: E402
from msrm.gp.linalg import quad_logdet  # noqa: E402
from msrm_lab.bench.linalg import potrf_potri_callback  # noqa: E402

METHODS = ["callback", "native"]


@pytest.fixture(autouse=True, scope="module")
def _x64():
    msrm.runtime.enable_x64()


def spd(n, seed=0, cond_shift=1.0):
    rng = np.random.default_rng(seed)
    B = rng.normal(size=(n, n))
    return B @ B.T / n + cond_shift * np.eye(n)


def with_min_eigenvalue(n, lam_min, seed=0):
    """Symmetric matrix with mean diagonal 1 and smallest eigenvalue lam_min (others in [0.5, 1.5])."""
    rng = np.random.default_rng(seed)
    Q, _ = np.linalg.qr(rng.normal(size=(n, n)))
    w = rng.uniform(0.5, 1.5, size=n)
    w[0] = lam_min
    w *= n / w.sum() if lam_min >= 0 else 1.0
    M = (Q * w) @ Q.T
    return 0.5 * (M + M.T)


def reference(M, V):
    V2 = V[:, None] if V.ndim == 1 else V
    sign, logdet = np.linalg.slogdet(M)
    assert sign > 0
    return float(np.sum(V2 * np.linalg.solve(M, V2))), float(logdet)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("rhs", [None, 1, 3])
def test_value_matches_numpy(method, rhs):
    n = 40
    M = spd(n, seed=1)
    rng = np.random.default_rng(2)
    V = rng.normal(size=n) if rhs is None else rng.normal(size=(n, rhs))
    quad, logdet, event = quad_logdet(jnp.asarray(M), jnp.asarray(V), method=method)
    q_ref, l_ref = reference(M, V)
    assert int(event) == 0
    assert event.dtype == jnp.int32
    np.testing.assert_allclose(float(quad), q_ref, rtol=1e-12)
    np.testing.assert_allclose(float(logdet), l_ref, rtol=1e-12)


def objective(method, cq=1.0, cl=0.5):
    def f(M, V):
        q, ld, _ = quad_logdet(M, V, method=method)
        return cq * q + cl * ld

    return f


@pytest.mark.parametrize("method", METHODS)
def test_gradient_matches_central_differences(method):
    n, r = 8, 2
    rng = np.random.default_rng(3)
    M = spd(n, seed=3)
    V = rng.normal(size=(n, r))
    f = objective(method, cq=-0.7, cl=1.3)
    gM, gV = jax.grad(f, argnums=(0, 1))(jnp.asarray(M), jnp.asarray(V))
    gM, gV = np.asarray(gM), np.asarray(gV)
    # symmetric cotangent: d f / d M as a function of (M + M^T)/2
    np.testing.assert_allclose(gM, gM.T, rtol=0, atol=1e-14)

    def fd(x0, direction, fn, h=1e-6):
        return (fn(x0 + h * direction) - fn(x0 - h * direction)) / (2 * h)

    fj = jax.jit(f)
    fnum = lambda Mx, Vx: float(fj(jnp.asarray(Mx), jnp.asarray(Vx)))  # noqa: E731
    for i, j in [(0, 0), (2, 5), (7, 1)]:
        D = np.zeros((n, n))
        D[i, j] = 1.0  # non-symmetric direction: checks the symmetrised-input convention
        num = fd(M, D, lambda Mx: fnum(Mx, V))
        np.testing.assert_allclose(gM[i, j], num, rtol=1e-7, atol=1e-9)
    for i, j in [(0, 0), (5, 1)]:
        D = np.zeros((n, r))
        D[i, j] = 1.0
        num = fd(V, D, lambda Vx: fnum(M, Vx))
        np.testing.assert_allclose(gV[i, j], num, rtol=1e-7, atol=1e-9)
    # closed form: cl * M^-1 - cq * A A^T and 2 cq A
    Minv = np.linalg.inv(M)
    A = Minv @ V
    np.testing.assert_allclose(gM, 1.3 * Minv + 0.7 * A @ A.T, rtol=1e-11, atol=1e-13)
    np.testing.assert_allclose(gV, -1.4 * A, rtol=1e-11, atol=1e-13)


@pytest.mark.parametrize("method", METHODS)
def test_check_grads_reverse(method):
    n = 6
    M = jnp.asarray(spd(n, seed=4))
    V = jnp.asarray(np.random.default_rng(4).normal(size=(n, 2)))
    check_grads(objective(method), (M, V), order=1, modes=["rev"], atol=1e-6, rtol=1e-6)


def test_callback_equals_native_value_and_gradient():
    n, r = 30, 4
    M = jnp.asarray(spd(n, seed=5))
    V = jnp.asarray(np.random.default_rng(5).normal(size=(n, r)))
    out = {}
    for method in METHODS:
        val = quad_logdet(M, V, method=method)
        grads = jax.jit(jax.grad(objective(method, 0.9, -1.1), argnums=(0, 1)))(M, V)
        out[method] = (val, grads)
    (vc, gc), (vn, gn) = out["callback"], out["native"]
    np.testing.assert_allclose(float(vc[0]), float(vn[0]), rtol=1e-12)
    np.testing.assert_allclose(float(vc[1]), float(vn[1]), rtol=1e-12)
    assert int(vc[2]) == int(vn[2]) == 0
    np.testing.assert_allclose(np.asarray(gc[0]), np.asarray(gn[0]), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(np.asarray(gc[1]), np.asarray(gn[1]), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("method", METHODS)
def test_near_singular_triggers_jitter_ladder(method):
    # smallest eigenvalue -5e-9 (mean diagonal 1): plain Cholesky and rung 1 (1e-9) fail, rung 2 (1e-8) works
    n = 25
    M = with_min_eigenvalue(n, -5e-9, seed=6)
    V = np.random.default_rng(6).normal(size=n)
    quad, logdet, event = quad_logdet(jnp.asarray(M), jnp.asarray(V), method=method)
    assert int(event) == 2, linalg.describe_event(int(event))
    scale = np.mean(np.diag(M))
    q_ref, l_ref = reference(M + 1e-8 * scale * np.eye(n), V)
    # condition number ~1e9 after jitter: agreement is limited by conditioning, not by the method
    np.testing.assert_allclose(float(logdet), l_ref, rtol=1e-8)
    np.testing.assert_allclose(float(quad), q_ref, rtol=1e-6)
    g = jax.grad(lambda Mx: quad_logdet(Mx, jnp.asarray(V), method=method)[1])(jnp.asarray(M))
    assert np.all(np.isfinite(np.asarray(g)))


@pytest.mark.parametrize("method", METHODS)
def test_indefinite_matrix_uses_recorded_fallback(method):
    n = 20
    M = with_min_eigenvalue(n, -0.3, seed=7)
    V = np.random.default_rng(7).normal(size=(n, 2))
    quad, logdet, event = quad_logdet(jnp.asarray(M), jnp.asarray(V), method=method)
    assert int(event) == linalg.EVENT_EIGH_FALLBACK
    assert np.isfinite(float(quad)) and np.isfinite(float(logdet))
    # the fallback is the eigenvalue-clipped matrix
    w, Q = np.linalg.eigh(M)
    Mc = (Q * np.maximum(w, 1e-5 * np.mean(np.diag(M)))) @ Q.T
    q_ref, l_ref = reference(Mc, V)
    np.testing.assert_allclose(float(logdet), l_ref, rtol=1e-9)
    np.testing.assert_allclose(float(quad), q_ref, rtol=1e-6)
    g = jax.grad(objective(method), argnums=(0, 1))(jnp.asarray(M), jnp.asarray(V))
    assert all(np.all(np.isfinite(np.asarray(x))) for x in g)


def test_fallback_events_agree_between_paths():
    for lam, expected in [(1e-3, 0), (-5e-9, 2), (-5e-7, 4), (-0.3, -1)]:
        M = jnp.asarray(with_min_eigenvalue(15, lam, seed=8))
        V = jnp.ones(15)
        events = [int(quad_logdet(M, V, method=m)[2]) for m in METHODS]
        assert events == [expected, expected], (lam, events)


@pytest.mark.parametrize("method", METHODS)
def test_nonfinite_input_is_reported_not_silent(method):
    M = spd(5, seed=9)
    M[1, 2] = M[2, 1] = np.nan
    quad, logdet, event = quad_logdet(jnp.asarray(M), jnp.ones(5), method=method)
    assert int(event) == linalg.EVENT_NONFINITE
    assert np.isnan(float(quad))
    V = np.ones(5)
    V[0] = np.inf
    quad, logdet, event = quad_logdet(jnp.asarray(spd(5)), jnp.asarray(V), method=method)
    assert int(event) == linalg.EVENT_NONFINITE and np.isnan(float(quad)) and np.isnan(float(logdet))


@pytest.mark.parametrize("method", METHODS)
def test_jit_and_vmap(method):
    n, b = 12, 4
    Ms = np.stack([spd(n, seed=s) for s in range(b)])
    Ms[2] = with_min_eigenvalue(n, -5e-9, seed=2)  # one batch member needs jitter
    Vs = np.random.default_rng(10).normal(size=(b, n, 2))
    f = jax.jit(jax.vmap(lambda M, V: quad_logdet(M, V, method=method)))
    quad, logdet, event = f(jnp.asarray(Ms), jnp.asarray(Vs))
    assert quad.shape == (b,) and event.dtype == jnp.int32
    for i in range(b):
        q1, l1, e1 = quad_logdet(jnp.asarray(Ms[i]), jnp.asarray(Vs[i]), method=method)
        np.testing.assert_allclose(float(quad[i]), float(q1), rtol=1e-12)
        np.testing.assert_allclose(float(logdet[i]), float(l1), rtol=1e-12)
        assert int(event[i]) == int(e1)
    assert list(np.asarray(event)) == [0, 0, 2, 0]
    # vmap with an unbatched V and a gradient through the batch
    V0 = jnp.asarray(Vs[0])
    g = jax.jit(jax.grad(lambda Mb: jnp.sum(jax.vmap(lambda M: quad_logdet(M, V0, method=method)[1])(Mb))))
    gb = np.asarray(g(jnp.asarray(Ms[[0, 1, 3]])))
    np.testing.assert_allclose(gb, np.linalg.inv(Ms[[0, 1, 3]]), rtol=1e-10, atol=1e-12)


def test_auto_uses_callback_on_cpu():
    assert jax.default_backend() == "cpu"
    M = jnp.asarray(spd(10))
    jaxpr = str(jax.make_jaxpr(lambda M: quad_logdet(M, jnp.ones(10))[0])(M))
    assert "pure_callback" in jaxpr
    jaxpr_native = str(jax.make_jaxpr(lambda M: quad_logdet(M, jnp.ones(10), method="native")[0])(M))
    assert "pure_callback" not in jaxpr_native and "cholesky" in jaxpr_native


def test_callback_thread_limit_and_oversubscription_warning():
    M = jnp.asarray(spd(10))
    cores = msrm.runtime.physical_cores()
    with linalg.callback_threads(cores + 1), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quad_logdet(M, jnp.ones(10), method="callback")[0].block_until_ready()
    assert any(issubclass(w.category, msrm.runtime.OversubscriptionWarning) for w in caught)
    with pytest.raises(ValueError, match="positive integer"):
        with linalg.callback_threads(0):
            pass


def test_potrf_potri_callback_matches_numpy():
    M = spd(20, seed=11)
    L, Minv = jax.jit(potrf_potri_callback)(jnp.asarray(M))
    np.testing.assert_allclose(np.asarray(L), np.linalg.cholesky(M), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(np.asarray(Minv), np.linalg.inv(M), rtol=1e-10, atol=1e-13)


def test_bad_input_raises_before_numerics():
    M = jnp.asarray(spd(4))
    with pytest.raises(ValueError, match="M must be a square"):
        quad_logdet(jnp.ones((3, 4)), jnp.ones(3))
    with pytest.raises(ValueError, match="V must be"):
        quad_logdet(M, jnp.ones(5))
    with pytest.raises(ValueError, match="method must be one of"):
        quad_logdet(M, jnp.ones(4), method="lu")
    with pytest.raises(ValueError, match="M must be float64"):
        quad_logdet(M.astype(jnp.float32), jnp.ones(4))
    with pytest.raises(ValueError, match="event must be"):
        linalg.describe_event(7)
    assert "rung 3" in linalg.describe_event(3)


def test_benchmark_rows_are_well_formed():
    """The linalg and threads benchmarks run at a toy size and return complete rows (no timing asserted)."""
    from msrm_lab.bench import linalg as bench_linalg
    from msrm_lab.bench import threads as bench_threads

    rows = bench_linalg.raw_linalg_rows([48], repeats=1, profile="smoke")
    assert {(r["experiment"], r["metric"]) for r in rows} == {
        (op, m) for op in ("matmul", "cholesky", "lu", "cho_inverse") for m in ("median_s", "gflops")}
    assert all(r["status"] == "measured" and r["value"] > 0 and r["execution_info"]["x64"] for r in rows)
    f32 = bench_linalg.float32_rows([48], repeats=1)
    assert [r["status"] for r in f32] == ["not_yet_measured"] * 2 and "GPU" in f32[0]["params"]["reason"]
    assert bench_linalg.potrf_potri_floor(64, threads=1, repeats=1) > 0
    rows = bench_threads.threads_rows(64, repeats=1, settings=[(1, False)], profile="smoke")
    experiments = {r["experiment"] for r in rows}
    assert {"direct_potrf_potri", "callback_potrf_potri", "quad_logdet_callback", "native_chol_inverse",
            "plain_grad_logdet", "quad_logdet_native", "speedup_vs_plain_grad", "value_grad_over_floor"} <= experiments
    assert all(r["execution_info"]["blas"] for r in rows)
    assert bench_threads.thread_settings(2) == [(1, False), (2, False), (4, True)]


def test_the_benchmarked_factorization_alone_gives_the_density_and_gradient_of_numpy():
    """The state-space notebook times quad_logdet's value and gradient alone (reduced to a scalar) beside the
    grouped model; at a small size its two outputs equal NumPy's solve and slogdet and the closed-form gradient."""
    from msrm_lab.bench.linalg import spd_matrix
    from msrm_lab.bench.state_space import factorization_function

    n = 40
    fn, method = factorization_function(n, seed=3)
    value, grad_sum = (float(x) for x in fn())
    M = spd_matrix(n, 3)
    v = np.random.default_rng(4).normal(size=n)
    Minv = np.linalg.inv(M)
    a = Minv @ v
    np.testing.assert_allclose(value, v @ a + np.linalg.slogdet(M)[1], rtol=1e-12)
    # d/dM = M^-1 - a a^T, d/dv = 2 a
    np.testing.assert_allclose(grad_sum, np.sum(Minv - np.outer(a, a)) + np.sum(2.0 * a), rtol=1e-10)
    assert method.endswith(linalg.resolve_method("auto"))


def test_the_benchmarked_pieces_of_the_grouped_likelihood_are_those_of_the_model():
    """The pieces the state-space notebook times are the model's own: the Woodbury piece's value at the run's
    statistics and covariances is the model's log likelihood of that run, and every piece returns a finite value
    and a gradient of its inputs' shapes."""
    import msrm
    from msrm_lab.bench.state_space import SIZES, _case, grouped_parts

    data, truth = _case(SIZES["smoke"], K=2)
    model = msrm.GPMSRM(data, truth.spec, linear_algebra="grouped")
    u = model.unconstrain(truth.params)
    parts = grouped_parts(model, u)
    per_run = model.pointwise_log_likelihood(u, by="run")["run"]
    np.testing.assert_allclose(parts["loglik"], per_run[parts["run_index"]], rtol=1e-12)
    for name in ("statistics", "covariance", "woodbury"):
        value, grad = parts[name]()
        assert np.isfinite(float(value)), name
        assert all(np.all(np.isfinite(np.asarray(g))) for g in jax.tree_util.tree_leaves(grad)), name
    _, (g_eta, g_R, g_C) = parts["woodbury"]()
    assert g_C.shape[0] == 2 and g_R.shape[-1] == 2 and g_eta.shape[0] == parts["run_nodes"]


@pytest.mark.parametrize("K", [1, 2, 3, 5, linalg.SMALL_CHOLESKY_MAX, linalg.SMALL_CHOLESKY_MAX + 1])
def test_small_cholesky_equals_lapack_and_differentiates(K):
    rng = np.random.default_rng(K)
    X = rng.standard_normal((7, 4, K, K + 2))
    A = jnp.asarray(X @ np.swapaxes(X, -1, -2) + 0.1 * np.eye(K))
    L = linalg.small_cholesky(A)
    np.testing.assert_allclose(np.asarray(L), np.linalg.cholesky(np.asarray(A)), rtol=1e-11, atol=1e-12)
    assert np.all(np.triu(np.asarray(L)[0, 0], 1) == 0.0)
    # reverse mode of the unrolled form against finite differences, through a symmetric perturbation
    check_grads(lambda a: linalg.small_cholesky(0.5 * (a + jnp.swapaxes(a, -1, -2)))[..., -1, :].sum(), (A[0, :2],),
                order=1, modes=["rev"], eps=1e-6, atol=1e-6, rtol=1e-6)


def test_small_cholesky_not_positive_definite_is_nan_like_lapack():
    A = jnp.asarray([[[1.0, 2.0], [2.0, 1.0]], [[2.0, 0.5], [0.5, 1.0]]])
    L = np.asarray(linalg.small_cholesky(A))
    ref = np.asarray(jnp.linalg.cholesky(A))
    assert np.isnan(L[0]).any() and np.isnan(ref[0]).any()
    np.testing.assert_allclose(L[1], ref[1], rtol=1e-14)
    with pytest.raises(ValueError, match="square"):
        linalg.small_cholesky(jnp.ones((3, 2)))


@pytest.mark.parametrize("batched", [True, False])
def test_per_item_on_cpu_equals_the_batched_call(batched):
    rng = np.random.default_rng(3)
    A = jnp.asarray(rng.standard_normal((3, 4, 5, 5)) + 5 * np.eye(5))
    b = jnp.asarray(rng.standard_normal((3, 4, 5)))

    def fn(a, v):
        return jnp.linalg.slogdet(a)[1], jnp.linalg.solve(a, v[..., None])[..., 0]

    ref = fn(A, b)
    got = jax.jit(lambda a, v: linalg.per_item_on_cpu(fn, a, v, batch_ndim=2, batched=batched))(A, b)
    for x, y in zip(got, ref):
        assert x.shape == y.shape
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-12)
    # on XLA:CPU with an affected jaxlib the batch is a loop (no batched LAPACK call is left in the program);
    # elsewhere it is the batched (or vmapped) call itself
    from msrm.gp.linalg import compat

    hlo = jax.jit(lambda a, v: linalg.per_item_on_cpu(fn, a, v, batch_ndim=2, batched=batched)).lower(A, b).as_text()
    if jax.default_backend() == "cpu":  # LAPACK custom calls carry the number of batch axes they loop over
        looped = re.search(r'num_batch_dims = "[1-9]', hlo) is None
        assert looped == compat.BATCHED_CPU_LAPACK_CAN_DEADLOCK
    with pytest.raises(ValueError, match="batch shape"):
        linalg.per_item_on_cpu(fn, A, b[:2], batch_ndim=2)


def test_auto_method_avoids_the_callback_with_one_cpu(monkeypatch):
    """With one usable CPU, 'auto' takes the native path (the callback can deadlock XLA's one-worker pool)."""
    from msrm import runtime
    from msrm.gp import linalg

    monkeypatch.setattr(runtime, "physical_cores", lambda: 1)
    assert linalg.resolve_method("auto") == "native"
    assert linalg.resolve_method("callback") == "callback"  # asked for explicitly: kept
    monkeypatch.setattr(runtime, "physical_cores", lambda: 2)
    assert linalg.resolve_method("auto") == ("callback" if jax.default_backend() == "cpu" else "native")



def test_bank_row_records_a_non_finite_density_as_an_error_row():
    """A bank whose filter returns no finite density gets an ``error`` row naming the guard event (not a number and
    not a crash); a finite one its relative error against the exact density."""
    from msrm_lab.bench.state_space import bank_row

    info = {"git_commit": "x"}
    ok = bank_row(-101.0, 0, -100.0, info=info, embedding="laguerre", n_states_per_factor=4)
    assert ok["status"] == "measured" and ok["value"] == pytest.approx(0.01)
    assert ok["params"]["guard_event"] == 0
    bad = bank_row(float("nan"), 1, -100.0, info=info, embedding="rational", n_states_per_factor=48)
    assert bad["status"] == "error" and bad["value"] is None
    assert bad["params"]["guard_event"] == 1 and "not finite" in bad["params"]["reason"]
    assert bad["params"]["n_states_per_factor"] == 48
