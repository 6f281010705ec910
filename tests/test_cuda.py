"""CUDA qualification: the GPU computes what the CPU computes, in float64, with the same guards.

Every test runs in one process that sees both platforms (``jax.devices("cpu")`` and ``jax.devices("cuda")``):
the same model is built twice, once committed to each device (``GPMSRM(devices=...)``), and the two answers are
compared. The CPU is the reference: its paths are tested against brute force elsewhere in the suite. Marked
``cuda``; ``tests/conftest.py`` skips them when JAX sees no CUDA device, so on a CPU-only machine they are
collected and skipped. ``python -m msrm_lab.device`` runs them on the GPU machine (``pytest -m cuda``).

What is qualified:

* objective and gradient of ``dense``, ``grouped`` and ``state_space`` (native XLA factorization and scan) at
  the same parameters agree to 1e-12 relative;
* the MAP endpoint of a small case (the tolerance is justified in the test);
* the guarded factorization on the GPU: value, gradient and event against NumPy; its device peak memory
  (``device.memory_stats()``) against :func:`msrm.gp.memory.predict_peak_bytes`; the memory guard reading free
  device memory and refusing;
* the associative (parallel-in-time) scan against the sequential scan on the GPU;
* float32 refused (``GPMSRM`` raises with x64 off) and TF32 off (matmul precision ``highest``).
"""
from __future__ import annotations

import numpy as np
import pytest

import data_synth
import msrm
from msrm.gp import memory

pytestmark = pytest.mark.cuda

BACKENDS = ("dense", "grouped", "state_space")
REL = 1e-12  # GPU against CPU, objective and gradient


@pytest.fixture(scope="module")
def jax_x64():
    import jax

    msrm.runtime.enable_x64()
    return jax


@pytest.fixture(scope="module")
def gpu(jax_x64):
    return jax_x64.devices("cuda")[0]


@pytest.fixture(scope="module")
def cpu(jax_x64):
    return jax_x64.devices("cpu")[0]


@pytest.fixture(scope="module")
def case():
    """A small study (two runs, three modalities, K = 3) shared by the tests."""
    return data_synth.synthetic_dataset("tiny", n_features=3, n_runs=2, seed=0)


def _on(model, device) -> bool:
    """Every prepared array of ``model`` lives on ``device`` (the model was really placed there)."""
    import jax

    leaves = [x for x in jax.tree_util.tree_leaves(model.prepared) if isinstance(x, jax.Array)]
    return bool(leaves) and all(x.devices() == {device} for x in leaves)


def _rel(a, b) -> float:
    """max |a - b| / max |b| (norm-wise relative difference; b is the CPU reference)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-300))


@pytest.mark.parametrize("backend", BACKENDS)
def test_objective_and_gradient_gpu_equal_cpu(backend, case, cpu, gpu):
    data, truth = case
    models = {d: msrm.GPMSRM(data, truth.spec, backend, method="native", devices=[d]) for d in (cpu, gpu)}
    for d, model in models.items():
        assert _on(model, d), f"{backend}: the prepared data are not on {d}"
    for point in ("truth", "start"):
        params = truth.params if point == "truth" else models[cpu].initial_params(seed=1)
        u = models[cpu].unconstrain(params)
        v_cpu, g_cpu = models[cpu].value_and_grad(u)
        v_gpu, g_gpu = models[gpu].value_and_grad(u)
        assert np.isfinite(v_cpu) and np.isfinite(g_cpu).all()
        assert abs(v_gpu - v_cpu) <= REL * abs(v_cpu), (backend, point, v_gpu, v_cpu)
        assert _rel(g_gpu, g_cpu) <= REL, (backend, point, _rel(g_gpu, g_cpu))
        ll_cpu = models[cpu].log_likelihood(params)
        assert abs(models[gpu].log_likelihood(params) - ll_cpu) <= REL * abs(ll_cpu)
    assert models[gpu].guard_events() == models[cpu].guard_events()


def test_map_endpoint_gpu_close_to_cpu(case, cpu, gpu):
    """MAP on each device from the same start.

    Every evaluation agrees to ~1e-13 (the test above), so L-BFGS-B takes the same steps until a line-search
    or stopping decision meets a difference of that size; after that the two runs still stop at the same mode
    within the optimiser's own tolerance. The checks follow from that, not from the device: (1) each endpoint's
    log density, re-evaluated on the other device, agrees to 1e-12 (the evaluations, again); (2) the two
    endpoints' log densities differ by at most 1e-7 relative, far above L-BFGS-B's stopping change
    (``ftol`` ~2.2e-9 relative per iteration, a few iterations of it) and far below any real disagreement;
    (3) the endpoints are within 1e-3 in every unconstrained coordinate, which a flat direction of the
    posterior could reach at a gradient norm under ``gtol`` times a small curvature, and a different mode
    could not.
    """
    data, truth = case
    fits = {}
    for d in (cpu, gpu):
        model = msrm.GPMSRM(data, truth.spec, "grouped", method="native", devices=[d])
        fits[d] = (model, model.fit_map(seed=0, maxiter=300, progress=False))
    (m_cpu, f_cpu), (m_gpu, f_gpu) = fits[cpu], fits[gpu]
    assert np.isfinite(f_cpu.log_density) and np.isfinite(f_gpu.log_density)
    for m_a, f_b in ((m_cpu, f_gpu), (m_gpu, f_cpu)):
        again = m_a.value_and_grad(f_b.u)[0]
        assert abs(again - f_b.log_density) <= REL * abs(f_b.log_density)
    assert abs(f_gpu.log_density - f_cpu.log_density) <= 1e-7 * abs(f_cpu.log_density)
    np.testing.assert_allclose(f_gpu.u, f_cpu.u, rtol=0, atol=1e-3)
    assert str(gpu) in f_gpu.execution_info["model_devices"]


def _spd(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    A = rng.standard_normal((n, n)) / np.sqrt(n)
    return A @ A.T + np.eye(n)


def test_guarded_factorization_on_gpu_equals_numpy(gpu):
    import jax
    import jax.numpy as jnp

    from msrm.gp.linalg import quad_logdet

    n = 200
    M, V = _spd(n), np.random.default_rng(1).standard_normal((n, 2))
    Mg, Vg = jax.device_put(jnp.asarray(M), gpu), jax.device_put(jnp.asarray(V), gpu)
    q, ld, event = quad_logdet(Mg, Vg, method="native")
    assert q.devices() == {gpu}
    A = np.linalg.solve(M, V)
    assert int(event) == 0
    assert abs(float(q) - float(np.sum(V * A))) <= 1e-12 * abs(float(np.sum(V * A)))
    ref_ld = np.linalg.slogdet(M)[1]
    assert abs(float(ld) - ref_ld) <= 1e-12 * abs(ref_ld)
    # reverse mode: dM = G_l M^-1 - G_q A A^T with G_q = G_l = 1, dV = 2 A
    f = jax.jit(jax.grad(lambda M_, V_: sum(quad_logdet(M_, V_, method="native")[:2]), argnums=(0, 1)))
    dM, dV = f(Mg, Vg)
    assert _rel(dM, np.linalg.inv(M) - A @ A.T) <= 1e-11
    assert _rel(dV, 2 * A) <= 1e-12
    # an indefinite matrix climbs the jitter ladder or falls back to the clipped eigendecomposition: finite, flagged
    B = M.copy()
    B[0, 0] = -1.0
    qb, ldb, eb = quad_logdet(jax.device_put(jnp.asarray(B), gpu), Vg, method="native")
    assert int(eb) != 0 and np.isfinite(float(qb)) and np.isfinite(float(ldb))


def test_factorization_peak_memory_within_prediction(gpu):
    """Device peak of one value+gradient of the guarded factorization against the guard's prediction.

    The program is compiled ahead (so compilation's scratch does not enter the window), then run once; the
    allocator's lifetime peak after the run, less what was in use before it, plus the resident inputs (which the
    prediction counts), is the call's peak. The dimension is large enough (3 GiB predicted) that the call sets a
    new process peak; a smaller peak would measure nothing and fails the test.
    """
    import jax
    import jax.numpy as jnp

    from msrm.gp.linalg import quad_logdet

    n = 8192
    predicted = memory.predict_peak_bytes(n, 1)
    # built on the GPU itself, in O(n^2): an exponential kernel on sorted points plus the identity
    t = jnp.sort(jax.random.uniform(jax.random.PRNGKey(0), (n,), dtype=jnp.float64, maxval=n / 10.0))
    M = jax.device_put(jnp.exp(-jnp.abs(t[:, None] - t[None, :])) + jnp.eye(n), gpu)
    V = jax.device_put(jnp.ones((n, 1)), gpu)
    f = jax.jit(jax.value_and_grad(lambda M_, V_: sum(quad_logdet(M_, V_, method="native")[:2])))
    compiled = f.lower(M, V).compile()
    jax.block_until_ready((M, V))
    before = gpu.memory_stats()
    value, dM = compiled(M, V)
    jax.block_until_ready((value, dM))
    after = gpu.memory_stats()
    assert np.isfinite(float(value))
    assert after["peak_bytes_in_use"] > before["peak_bytes_in_use"], \
        "the call did not set a new device peak; run this test in a fresh process"
    resident = memory.dense_bytes(n, n) + memory.dense_bytes(n, 1)
    measured = after["peak_bytes_in_use"] - before["bytes_in_use"] + resident
    assert measured <= predicted, (measured, predicted)
    # M and its gradient dM are both alive at the end: the measurement is not vacuous
    assert measured >= 2 * memory.dense_bytes(n, n), (measured, predicted)


def test_memory_guard_reads_the_gpu_and_refuses(gpu, monkeypatch):
    import jax
    import jax.numpy as jnp

    from msrm.gp.linalg import quad_logdet

    free = memory.available_bytes(gpu)
    stats = gpu.memory_stats()
    assert free is not None and 0 < free <= stats["bytes_limit"]
    monkeypatch.delenv(memory.ENV_LIMIT, raising=False)
    too_big = 1 + int(np.sqrt(free / (8 * memory.PEAK_MATRICES)))  # 6 (n, n) float64 matrices exceed free memory
    with pytest.raises(memory.MemoryGuardError, match="free device memory"):
        memory.check_factorization(too_big, device=gpu)
    n = 64
    M, V = jax.device_put(jnp.asarray(_spd(n)), gpu), jax.device_put(jnp.ones(n), gpu)
    monkeypatch.setenv(memory.ENV_LIMIT, str(memory.predict_peak_bytes(n, 1) - 1))
    with pytest.raises(memory.MemoryGuardError, match=f"dimension {n}"):
        quad_logdet(M, V, method="native")
    monkeypatch.setenv(memory.ENV_LIMIT, str(memory.predict_peak_bytes(n, 1)))
    assert np.isfinite(float(quad_logdet(M, V, method="native")[0]))


def test_parallel_scan_equals_sequential_on_gpu(case, gpu):
    data, truth = case
    seq = msrm.GPMSRM(data, truth.spec, "state_space", method="native", devices=[gpu])
    par = msrm.GPMSRM(data, truth.spec, "state_space", method="native", devices=[gpu], parallel=True)
    assert _on(par, gpu)
    u = seq.unconstrain(truth.params)
    (v1, g1), (v2, g2) = seq.value_and_grad(u), par.value_and_grad(u)
    # the associative scan combines the same Gaussian elements in another order (log-depth tree): the
    # agreement the CPU test of the two scans asks for
    assert abs(v2 - v1) <= 1e-8 * abs(v1)
    np.testing.assert_allclose(g2, g1, rtol=1e-7, atol=1e-8)


def test_float32_is_refused(case, jax_x64):
    jax = jax_x64
    data, truth = case
    jax.config.update("jax_enable_x64", False)
    try:
        with pytest.raises(RuntimeError, match="float64"):
            msrm.GPMSRM(data, truth.spec, "grouped", method="native")
    finally:
        msrm.runtime.enable_x64()
    assert jax.config.jax_enable_x64


def test_tf32_is_off(gpu, jax_x64):
    """Matmul precision is ``highest`` (set by ``msrm.runtime.enable_x64``/``configure``), so a float32 product
    on the GPU is a true float32 product (relative error ~1e-7), not TF32 (10-bit mantissa, ~1e-3)."""
    import jax
    import jax.numpy as jnp

    assert jax.config.jax_default_matmul_precision == "highest"
    assert msrm.runtime.execution_info(include_jax=True)["matmul_precision"] == "highest"
    rng = np.random.default_rng(0)
    A, B = rng.standard_normal((512, 512)), rng.standard_normal((512, 512))
    ref = A @ B
    A32, B32 = (jax.device_put(jnp.asarray(x, dtype=jnp.float32), gpu) for x in (A, B))
    err = _rel(jax.jit(jnp.matmul)(A32, B32), ref)
    assert err < 1e-5, f"float32 matmul error {err:.1e}: TF32 (or bf16) is in use"
    # float64 products are exact to rounding
    A64, B64 = (jax.device_put(jnp.asarray(x), gpu) for x in (A, B))
    assert _rel(jax.jit(jnp.matmul)(A64, B64), ref) < 1e-13
