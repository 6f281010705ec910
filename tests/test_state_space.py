"""State-space backend: every fast path against an obviously correct slow one.

* the discretised Matérn SDEs reproduce the kernel matrix on a grid;
* the exact filter equals the brute-force density (full observation covariance + SciPy) and the grouped backend,
  for every kernel, both poolings, missing values and two runs;
* gradients equal central finite differences; the hand-written reverse mode (:mod:`.adjoint` in XLA and
  :mod:`.host` on the host, what ``loglik`` uses) equals JAX's autodiff of the block scan; the associative scan
  equals the sequential scan (value and gradient); checkpointed equals unchecked; the block length changes
  nothing; the approximate banks converge toward the exact density.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import data_synth
import msrm
from msrm.gp import likelihood as gl
from msrm.gp.reference import brute_force_loglik, matern_numpy
from msrm.gp.state_space import loglik, prepare
from msrm.gp.state_space import embedding, sde
from msrm.gp.state_space.adjoint import run_loglik_adjoint
from sde_oracle import implied_grid_cov
from ss_autodiff_oracle import run_loglik_sequential

KERNELS = tuple(msrm.kernels.KERNELS)  # every registered kernel


def theta_of(p: msrm.Params) -> dict:
    return {
        "loadings": {k: jnp.asarray(v) for k, v in p.loadings.items()},
        "intercepts": {k: jnp.asarray(v) for k, v in p.intercepts.items()},
        "noise_sd": {k: jnp.asarray(v) for k, v in p.noise_sd.items()},
        "lengthscales": jnp.asarray(p.lengthscales),
        "response": {k: {n: jnp.asarray(x) for n, x in d.items()} for k, d in p.response.items()},
    }


def tiny(kernel="matern32", pooling="shared", missing=0.2, n_runs=2, seed=1):
    return data_synth.synthetic_dataset("tiny", n_features=3, n_runs=n_runs, seed=seed, kernel=kernel,
                                        pooling=pooling, missing_fraction=missing)


def value(prepared, theta):
    return float(jax.jit(lambda th, p: loglik(th, p)[0])(theta, prepared))


@pytest.mark.parametrize("kernel", KERNELS)
def test_sde_grid_covariance_is_the_kernel(kernel):
    step, ell, n = 0.9, 3.7, 25
    implied = implied_grid_cov(kernel, ell, step, n)
    r = step * np.abs(np.arange(n)[:, None] - np.arange(n)[None, :])
    np.testing.assert_allclose(implied, matern_numpy(r, ell, kernel), rtol=0, atol=1e-12)


@pytest.mark.parametrize("kernel", KERNELS)
def test_jax_discretisation_matches_numpy(kernel):
    msrm.runtime.enable_x64()
    Phi, Q, Pinf = sde.discretise(kernel, 2.3, 0.7)
    PhiJ, QJ, PinfJ = sde.discretise(kernel, jnp.asarray(2.3), 0.7, jnp)
    np.testing.assert_allclose(np.asarray(PhiJ), Phi, atol=1e-13)
    np.testing.assert_allclose(np.asarray(QJ), Q, atol=1e-13)
    np.testing.assert_allclose(np.asarray(PinfJ), Pinf, atol=1e-13)


@pytest.mark.parametrize("kernel,pooling", [(k, "shared") for k in KERNELS] + [("matern32", "individual")])
def test_exact_equals_brute_force_and_grouped(kernel, pooling):
    data, truth = tiny(kernel, pooling)
    theta = theta_of(truth.params)
    ref = brute_force_loglik(data, truth.spec, truth.params)
    grouped = float(gl.grouped_loglik(theta, gl.prepare(data, truth.spec))[0])
    for method in ("native", "callback"):
        ss = value(prepare(data, truth.spec, method=method), theta)
        assert abs(ss - ref) <= 1e-8 * abs(ref), method
        assert abs(ss - grouped) <= 1e-8 * abs(grouped), method


@pytest.mark.parametrize("block", [1, 3, 7, None])
def test_block_length_does_not_change_the_density(block):
    data, truth = tiny("matern52", "individual")
    theta = theta_of(truth.params)
    ref = value(prepare(data, truth.spec, block=4, method="native"), theta)
    p = prepare(data, truth.spec, block=block, method="native")
    t = p.runs[0].tables
    if block is None:  # chosen per run by the cost model
        assert t.block_source in ("measured", "measured_busy", "cached", "default", "override")
        assert t.block_predicted_s > 0
        block = t.block
    else:
        assert t.block_source == "option" and t.block_predicted_s is None
    assert t.block == block and t.n_ring % block == 0 and t.n_ring >= t.L + block
    assert abs(value(p, theta) - ref) <= 1e-10 * abs(ref)


def test_auto_chunk_keeps_what_fits():
    import math

    from msrm.gp.state_space.prepare import KEEP_BYTES, auto_chunk

    for n_sub, S in ((63, 222), (115, 335), (460, 335), (5000, 335), (7, 3), (1, 1000), (400, 40)):
        c = auto_chunk(n_sub, S)
        if (n_sub + 1) * 8 * S * S <= KEEP_BYTES:
            assert c == n_sub  # one chunk: every state kept
        else:
            assert c == math.ceil(math.sqrt(n_sub))
    assert auto_chunk(63, 222) == 63  # one-eighth, K = 3: 25 MB of states
    assert auto_chunk(115, 335) == 11  # x1, K = 5: 104 MB
    assert auto_chunk(10, 100, keep_bytes=8 * 100 * 100 * 11) == 10
    assert auto_chunk(10, 100, keep_bytes=8 * 100 * 100 * 11 - 1) == 4
    # the default in prepare: one chunk on a tiny run
    data, truth = tiny("matern32", "shared", n_runs=1)
    assert prepare(data, truth.spec).runs[0].tables.n_chunks == 1


def test_events_are_zero_and_one_per_run():
    data, truth = tiny(n_runs=2)
    _, events = loglik(theta_of(truth.params), prepare(data, truth.spec))
    assert events.dtype == jnp.int32 and events.shape == (2,)
    assert np.all(np.asarray(events) == 0)


def test_every_node_is_absorbed_once():
    data, truth = data_synth.synthetic_dataset("tiny", n_features=2, seed=0)
    run = prepare(data, truth.spec, checkpoint_every=5).runs[0]
    t = run.tables
    for g in t.groups:
        filled = g.slot_local[g.slot_local < g.n_g]
        assert np.array_equal(np.sort(filled), np.arange(g.n_g))
        # a node is absorbed on a sub-step of the block where its window ends
        blocks = np.broadcast_to(t.block_index[:, None], g.slot_local.shape)[g.slot_local < g.n_g]
        ends = g.window.start + g.window.width - 1
        assert np.array_equal(blocks, ends[filled] // t.block)
        # and reads ring slots that hold its window's steps while the block is absorbed
        steps = g.window.start[:, None] + np.arange(g.width)
        assert np.array_equal(g.ring_pos[:-1], steps % t.n_ring)
        assert np.all(steps >= (ends // t.block * t.block - t.L)[:, None])
    assert t.block_index.size == t.chunk * t.n_chunks
    assert t.predict.sum() == t.n_blocks  # one prediction per block


def _fd_check(prepared, theta, paths, h=1e-5, rtol=2e-6):
    f = jax.jit(lambda th: loglik(th, prepared)[0])
    grad = jax.jit(jax.grad(lambda th: loglik(th, prepared)[0]))(theta)

    def get(tree, path):
        for p in path[:-1]:
            tree = tree[p]
        return tree[path[-1]]

    for path, index in paths:
        def shifted(delta):
            th = jax.tree_util.tree_map(lambda x: x, theta)
            node = th
            for p in path[:-1]:
                node = node[p]
            node[path[-1]] = jnp.asarray(get(theta, path)).at[index].add(delta) if index is not None else get(theta, path) + delta
            return float(f(th))

        fd = (shifted(h) - shifted(-h)) / (2 * h)
        g = float(get(grad, path)[index] if index is not None else get(grad, path))
        assert abs(g - fd) <= rtol * max(1.0, abs(fd)), (path, index, g, fd)


def test_gradient_matches_finite_differences():
    data, truth = tiny("matern32", "shared", n_runs=1)
    theta = theta_of(truth.params)
    paths = [
        (("lengthscales",), 0),
        (("lengthscales",), 2),
        (("response", "rating", "lag"), None),
        (("response", "physio", "lag"), None),
        (("response", "physio", "width"), None),
        (("loadings", "p1/brain"), (1, 2)),
        (("loadings", "p3/rating"), (0, 0)),
        (("noise_sd", "p4/physio"), 0),
        (("intercepts", "p2/brain"), 2),
    ]
    _fd_check(prepare(data, truth.spec, checkpoint_every=4), theta, paths)


@pytest.mark.parametrize("kernel", KERNELS)
def test_closed_form_transition_equals_expm(kernel):
    from scipy.linalg import expm

    msrm.runtime.enable_x64()
    taus = np.array([0.0, 0.05, 0.7, 3.0, 25.0])
    for ell in (0.3, 2.3, 40.0):
        F = sde.companion(kernel, ell)
        ref = np.stack([expm(F * t) for t in taus])
        atol = 1e-14 * np.abs(ref).max()
        np.testing.assert_allclose(sde.transition(kernel, ell, taus), ref, rtol=1e-12, atol=atol)
        got = sde.transition(kernel, jnp.asarray(ell), taus, jnp)
        np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-12, atol=atol)


@pytest.mark.parametrize("kernel", KERNELS)
def test_block_transition_is_the_stacked_one_step_recursion(kernel):
    # y = (z_{j+1}, .., z_{j+C}, s_{j+C}) given s_j, built the slow way: s_{j+i} = Φ^i s_j + Σ_l Φ^{i-l} ε_l with
    # ε_l ~ N(0, Q) independent, as one (C d) x (C d) lower block-triangular map applied to blockdiag(Q)
    from types import SimpleNamespace

    from msrm.gp.state_space.filter import block_transition

    msrm.runtime.enable_x64()
    C, step, ells = 5, 0.7, (2.3, 0.9)
    d = sde.n_states(kernel)
    t = SimpleNamespace(block=C, d=d, K=len(ells), kernel=kernel, step=step)
    T, Qb, Pinf = (np.asarray(x) for x in block_transition({"lengthscales": jnp.asarray(ells)}, t))
    for k, ell in enumerate(ells):
        Phi, Q, P = sde.discretise(kernel, ell, step)
        pw = [np.linalg.matrix_power(Phi, i) for i in range(C + 1)]
        L = np.zeros((C * d, C * d))
        for i in range(C):
            for l in range(i + 1):
                L[i * d:(i + 1) * d, l * d:(l + 1) * d] = pw[i - l]
        N = L @ np.kron(np.eye(C), Q) @ L.T
        rows = list(np.arange(C) * d) + list((C - 1) * d + np.arange(d))
        mean = np.concatenate([np.stack([p[0] for p in pw[1:]]), pw[C]])
        np.testing.assert_allclose(T[k], mean, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(Qb[k], N[np.ix_(rows, rows)], rtol=1e-10, atol=1e-13)
        np.testing.assert_allclose(Pinf[k], P, rtol=1e-14)


def _runs_total(fn):
    return lambda th, p: sum(fn(th, r)[0] for r in p.runs)


@pytest.mark.parametrize(
    "kernel,pooling,missing,options",
    # the default suite keeps one case per pooling and one filter bank; the rest (each compiles an XLA scan and
    # its reverse) run with the slow tests. The default cases fix the block length: the one tuned for the machine
    # may make every sub-step predict, and these cases must keep sub-steps that do not
    [
        ("matern12", "shared", 0.2, {"checkpoint_every": 2, "block": 4}),
        pytest.param("matern32", "shared", 0.2, {"checkpoint_every": 4, "block": 3}, marks=pytest.mark.slow),
        pytest.param("matern52", "shared", 0.0, {"checkpoint_every": 0, "block": 3}, marks=pytest.mark.slow),
        ("matern32", "individual", 0.2, {"checkpoint_every": 7, "block": 2}),
        pytest.param("matern52", "individual", 0.3, {}, marks=pytest.mark.slow),
        pytest.param("matern32", "shared", 0.2, {"response_embedding": "laguerre", "n_states": 4,
                                                 "checkpoint_every": 2}, marks=pytest.mark.slow),
        ("matern12", "individual", 0.2, {"response_embedding": "rational", "n_states": 3, "checkpoint_every": 5,
                                         "block": 3}),
    ],
)
def test_adjoint_gradient_equals_autodiff(kernel, pooling, missing, options):
    # two runs, missing values, every kernel and both poolings, checkpointing on and off, banks, blocks split into
    # sub-steps that do not predict; the reverse pass in XLA and on the host
    data, truth = tiny(kernel, pooling, missing=missing, n_runs=2)
    theta = theta_of(truth.params)
    reference = prepare(data, truth.spec, method="native", **options)
    assert not reference.runs[0].tables.predict.all()
    v_ad, g_ad = jax.jit(jax.value_and_grad(_runs_total(run_loglik_sequential)))(theta, reference)
    flat_ad, tree_ad = jax.tree_util.tree_flatten(g_ad)
    scale = max(float(np.max(np.abs(x))) for x in flat_ad)
    for method in ("native", "callback"):
        prepared = prepare(data, truth.spec, method=method, **options)
        assert prepared.runs[0].tables.method == method
        v_adj, g_adj = jax.jit(jax.value_and_grad(_runs_total(run_loglik_adjoint)))(theta, prepared)
        assert abs(float(v_adj) - float(v_ad)) <= 1e-12 * abs(float(v_ad)), method
        flat_adj, tree_adj = jax.tree_util.tree_flatten(g_adj)
        assert tree_ad == tree_adj
        for x, y in zip(flat_ad, flat_adj):
            np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-9, atol=1e-10 * scale, err_msg=method)


def test_host_reverse_pass_pipelined_equals_one_thread():
    # the recomputation on a second thread gives the same adjoints to the last bit; the run has sub-steps with
    # empty slots and with nothing to absorb (skipped by the host filter; exactness: the autodiff test above)
    from msrm.gp.state_space.filter import block_transition, initial_state, step_tables
    from msrm.gp.state_space.host import HostFilter

    data, truth = tiny("matern32", "shared", n_runs=1)
    theta = theta_of(truth.params)
    run = prepare(data, truth.spec, method="callback", block=3, checkpoint_every=4).runs[0]
    t = run.tables
    hf = HostFilter(t)
    assert t.n_chunks > 2
    assert not hf.pipeline_pays  # a tiny state: the one-thread pass is used by default
    assert any(o is not None and o.size == 0 for o in hf._occupied)
    assert any(o is not None and o.size > 0 for o in hf._occupied)
    A, Ls, e, _ = step_tables(theta, run)
    T, Qb, Pinf = block_transition(theta, t)
    m0, P0 = initial_state(t, T, Qb, Pinf)
    args = [np.asarray(x) for x in (A, Ls, e, T, Qb, m0, P0)]
    ll, bad, sm, sP = hf.forward(*args, keep_starts=True)
    one = hf.backward(*args[:5], sm, sP, 0.7, pipeline=False)
    two = hf.backward(*args[:5], sm, sP, 0.7, pipeline=True)
    for a, b in zip(one, two):
        np.testing.assert_array_equal(a, b)
    # value and adjoints in one call (the last chunk kept from the forward pass, not recomputed): the same bits
    unit = hf.backward(*args[:5], sm, sP, 1.0)
    for pipeline in (False, True):
        ll2, bad2, grads = hf.value_and_grad(*args, pipeline=pipeline)
        assert (ll2, bad2) == (ll, bad)
        for a, b in zip(unit, grads):
            np.testing.assert_array_equal(a, b)


def test_host_gradient_is_scaled_by_the_cotangent():
    # the host's forward rule returns the adjoints at cotangent 1 and the backward rule scales them
    data, truth = tiny("matern32", "individual", missing=0.2, n_runs=1)
    theta = theta_of(truth.params)
    for options in ({}, {"checkpoint_every": 3, "block": 2}):
        runs = [prepare(data, truth.spec, method=m, **options).runs[0] for m in ("native", "callback")]
        (v0, pull0), (v1, pull1) = (jax.vjp(lambda th, r=r: run_loglik_adjoint(th, r)[0], theta) for r in runs)
        assert abs(float(v1) - float(v0)) <= 1e-12 * abs(float(v0))
        for ct in (0.7, -2.5):
            for x, y in zip(jax.tree_util.tree_leaves(pull0(jnp.float64(ct))),
                            jax.tree_util.tree_leaves(pull1(jnp.float64(ct)))):
                np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-9, atol=1e-9)


def test_gemm_acc_adds_the_product_in_place():
    from msrm.gp.state_space.host import gemm_acc

    rng = np.random.default_rng(0)
    a, b, c = (np.asfortranarray(rng.standard_normal(s)) for s in ((7, 3), (3, 5), (7, 5)))
    ref = c + 0.5 * a @ b
    gemm_acc(0.5, a, b, c)
    np.testing.assert_allclose(c, ref, rtol=1e-14, atol=1e-14)
    P = rng.standard_normal((6, 6))
    U = rng.standard_normal((6, 2))
    ref = P - U @ U.T
    gemm_acc(-1.0, U.T.T.copy(order="F"), np.asfortranarray(U.T), P.T)  # C-order P through its transpose
    np.testing.assert_allclose(P, ref, rtol=1e-14, atol=1e-14)
    with pytest.raises(ValueError, match="a must be Fortran-contiguous"):
        gemm_acc(1.0, np.ones((7, 3)), b, c)
    with pytest.raises(ValueError, match="do not match"):
        gemm_acc(1.0, a, np.asfortranarray(np.ones((2, 5))), c)


def test_small_part_reverse_mode_equals_autodiff():
    # absorb_small_vjp (hand-written, from G^-1) against JAX's reverse mode of absorb_small, with a singular block
    from msrm.gp.state_space.filter import blockdiag
    from ss_autodiff_oracle import absorb_small, absorb_small_vjp

    msrm.runtime.enable_x64()
    rng = np.random.default_rng(3)
    M, K = 3, 2
    Bm = rng.standard_normal((M * K, 9))
    C = jnp.asarray(Bm @ Bm.T)
    F = rng.standard_normal((M, K, 1))
    Ls = jnp.asarray(np.einsum("mki,mli->mkl", F, F))  # rank one blocks: Λ singular
    Lb, mu, e = blockdiag(Ls), jnp.asarray(rng.standard_normal(M * K)), jnp.asarray(rng.standard_normal(M * K))
    (Giv, GiL, _), _, Z = absorb_small(mu, C, Lb, e)
    cts = (jnp.asarray(rng.standard_normal(M * K)), jnp.asarray(rng.standard_normal((M * K, M * K))), 0.7)
    _, vjp = jax.vjp(lambda *a: absorb_small(*a)[0], mu, C, Lb, e)
    ref = vjp(cts)
    got = absorb_small_vjp(mu, C, Lb, e, Z, Giv, cts)
    for r, g, sym in zip(ref, got, (False, True, True, False)):
        r, g = np.asarray(r), np.asarray(g)
        if sym:  # C and Λ are symmetric inputs: only the symmetric part of their cotangent is defined
            r, g = 0.5 * (r + r.T), 0.5 * (g + g.T)
        np.testing.assert_allclose(g, r, rtol=1e-10, atol=1e-12)


def test_auto_method_is_native_with_one_cpu(monkeypatch):
    from msrm import runtime

    data, truth = tiny(n_runs=1)
    monkeypatch.setattr(runtime, "physical_cores", lambda: 1)
    assert prepare(data, truth.spec).runs[0].tables.method == "native"
    monkeypatch.setattr(runtime, "physical_cores", lambda: 2)
    assert prepare(data, truth.spec).runs[0].tables.method == "callback"
    assert prepare(data, truth.spec, parallel=True).runs[0].tables.method == "native"


def test_host_filter_runs_one_blas_thread_after_configured_blas_threads():
    # configure(blas_threads=2) holds a process-wide limit from the main thread; inside JAX's callback thread the
    # host filter must still get one BLAS thread (before runtime.blas_limit it kept two and ran 10-20x slower)
    code = """
import json, sys, threadpoolctl
sys.path.insert(0, "tests")
import msrm
msrm.runtime.configure(platform="cpu", blas_threads=2)
import data_synth
from msrm.gp.state_space import host
def n():
    return sorted({i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"})
seen = {"main": n()}
inner = host.HostFilter.value_and_grad
def spy(self, *a, **k):
    seen["callback"] = n()
    return inner(self, *a, **k)
host.HostFilter.value_and_grad = spy
data, truth = data_synth.synthetic_dataset("tiny", n_features=2, seed=0)
model = msrm.GPMSRM(data, truth.spec, linear_algebra="state_space", method="callback")
model.value_and_grad(model.unconstrain(truth.params))
seen["after"] = n()
print(json.dumps(seen))
"""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    if 2 not in seen["main"]:
        pytest.skip(f"OpenBLAS cannot run 2 threads here: {seen}")
    assert seen["callback"] == [1] and seen["after"] == seen["main"], seen
    assert "OversubscriptionWarning" not in out.stderr


def test_bank_gradient_matches_finite_differences():
    data, truth = tiny("matern52", "individual", n_runs=1)
    theta = theta_of(truth.params)
    paths = [
        (("lengthscales",), 1),
        (("response", "p3/physio", "lag"), None),
        (("response", "p4/physio", "width"), None),
        (("loadings", "p1/brain"), (0, 1)),
        (("noise_sd", "p3/rating"), 0),
    ]
    prepared = prepare(data, truth.spec, response_embedding="laguerre", n_states=5, checkpoint_every=6)
    _fd_check(prepared, theta, paths)


@pytest.mark.timeout(600)
def test_parallel_equals_sequential_value():
    # on XLA:CPU the scan's solves run one element at a time (linalg.per_item_on_cpu): jaxlib 0.10's batched
    # CPU LAPACK kernels hung here before, waiting for pool threads that were all waiting themselves
    data, truth = tiny("matern52", "individual", n_runs=2)
    theta = theta_of(truth.params)
    seq = value(prepare(data, truth.spec), theta)
    par = value(prepare(data, truth.spec, parallel=True), theta)
    assert abs(seq - par) <= 1e-8 * abs(seq)


@pytest.mark.timeout(600)
def test_parallel_equals_sequential_gradient():
    # compiling reverse mode through the associative scan takes about 20 s on a 2-core CPU
    data, truth = tiny("matern32", "shared", n_runs=1)
    theta = theta_of(truth.params)
    seq, par = prepare(data, truth.spec), prepare(data, truth.spec, parallel=True)
    vg = jax.jit(jax.value_and_grad(lambda th, p: loglik(th, p)[0]))
    (v1, g1), (v2, g2) = vg(theta, seq), vg(theta, par)
    assert abs(float(v1) - float(v2)) <= 1e-8 * abs(float(v1))
    for a, b in zip(jax.tree_util.tree_leaves(g1), jax.tree_util.tree_leaves(g2)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-7, atol=1e-8)


def test_checkpointed_equals_unchecked():
    data, truth = tiny("matern32", "shared", n_runs=1)
    theta = theta_of(truth.params)
    vg = jax.jit(jax.value_and_grad(lambda th, p: loglik(th, p)[0]))
    a = prepare(data, truth.spec, checkpoint_every=3, block=2)
    b = prepare(data, truth.spec, checkpoint_every=0, block=2)
    assert a.runs[0].tables.checkpoint and a.runs[0].tables.n_chunks > 1
    assert not b.runs[0].tables.checkpoint and b.runs[0].tables.n_chunks == 1
    (v1, g1), (v2, g2) = vg(theta, a), vg(theta, b)
    assert abs(float(v1) - float(v2)) <= 1e-12 * abs(float(v1))
    for x, y in zip(jax.tree_util.tree_leaves(g1), jax.tree_util.tree_leaves(g2)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", ["laguerre", "rational"])
def test_banks_converge_to_the_exact_density(kind):
    data, truth = tiny("matern32", "shared", missing=0.0, n_runs=1)
    theta = theta_of(truth.params)
    exact = value(prepare(data, truth.spec), theta)
    err = {n: abs(value(prepare(data, truth.spec, response_embedding=kind, n_states=n), theta) - exact) / abs(exact)
           for n in (3, 32)}
    assert err[3] > 1e-3  # a small bank is a real approximation
    assert err[32] < err[3] / 20


def test_laguerre_pole_zero_is_the_delay_line():
    M, v = embedding.bank_realisation(np.zeros(6))
    np.testing.assert_allclose(embedding.bank_impulse(M, v, 10), np.eye(10)[:, :6], atol=1e-15)


def test_bank_basis_is_orthonormal():
    poles = embedding.rational_poles(5, 0.9, 20)
    G = embedding.bank_impulse(*embedding.bank_realisation(poles), 4000)
    np.testing.assert_allclose(G.T @ G, np.eye(5), atol=1e-10)
    G = embedding.bank_impulse(*embedding.bank_realisation(np.full(4, 0.6)), 400)
    np.testing.assert_allclose(G.T @ G, np.eye(4), atol=1e-10)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"response_embedding": "pade"}, "response_embedding"),
        ({"response_embedding": "laguerre"}, "n_states"),
        ({"response_embedding": "rational", "n_states": 0}, "n_states"),
        ({"n_states": 4}, "n_states"),
        ({"parallel": "yes"}, "parallel"),
        ({"checkpoint_every": -1}, "checkpoint_every"),
        ({"checkpoint_every": 2.5}, "checkpoint_every"),
        ({"block": 0}, "block"),
        ({"block": 2.0}, "block"),
        ({"method": "gpu"}, "method"),
    ],
)
def test_bad_options_raise_named_errors(kwargs, match):
    data, truth = tiny(n_runs=1)
    with pytest.raises(ValueError, match=match):
        prepare(data, truth.spec, **kwargs)


def test_gpmsrm_state_space_backend():
    data, truth = tiny("matern12", "shared", n_runs=2)
    model = msrm.GPMSRM(data, truth.spec, linear_algebra="state_space", checkpoint_every=4, block=3)
    assert all(r.tables.block == 3 for r in model.prepared.runs)
    ref = brute_force_loglik(data, truth.spec, truth.params)
    assert abs(model.log_likelihood(truth.params) - ref) <= 1e-8 * abs(ref)
