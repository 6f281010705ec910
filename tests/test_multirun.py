"""Multi-run GP likelihoods: stacked (vmapped) runs and runs sharded over devices equal the per-run loop.

The per-run loop (``batch_runs=False``) is the reference: it is tested against the brute-force density in
tests/test_gp_likelihood.py. Here the batched path must give the same value, gradient, per-run values and guard
events to 1e-12 on runs cut from one recording (equal and padded shapes), on runs of different structure, and,
in a subprocess with two forced host devices, with the run axis sharded over them. The trace counter shows that a
stack is traced once whatever the number of runs it holds.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import msrm
import data_synth

msrm.runtime.enable_x64()

import jax  # noqa: E402

from msrm.data import split_run  # noqa: E402
from msrm.gp import likelihood as L  # noqa: E402
from msrm.gp import multirun as MR  # noqa: E402
from msrm.gp import prepare as P  # noqa: E402
from msrm.gp.model import GPMSRM, params_to_theta  # noqa: E402

REL = 1e-12


def _long(seed=1, missing=0.1, pooling="shared", scale=4.0):
    return data_synth.synthetic_dataset("tiny", n_features=3, seed=seed, duration_scale=scale,
                                        missing_fraction=missing, pooling=pooling)


def _evaluate(model, params):
    u = model.unconstrain(params)
    v, g = model.value_and_grad(u)
    return v, g, model.pointwise_log_likelihood(u, by="run")["run"], model.guard_events()


def _compare(data, spec, params, la="grouped", ref=None, **kwargs):
    """The batched model's value, gradient, per-run values and guard events against the per-run loop's."""
    if ref is None:
        ref = _evaluate(GPMSRM(data, spec, la, batch_runs=False), params)
    batched = GPMSRM(data, spec, la, **kwargs)
    v1, g1, r1, e1 = _evaluate(batched, params)
    v0, g0, r0, e0 = ref
    assert v1 == pytest.approx(v0, rel=REL)
    np.testing.assert_allclose(g1, g0, rtol=0, atol=REL * np.max(np.abs(g0)))
    np.testing.assert_allclose(r1, r0, rtol=REL)
    assert e1 == e0
    return ref, batched


# four pieces trace and compile the same stack as two; it runs with the slow tests
@pytest.mark.parametrize("n_pieces", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_runs_cut_from_one_recording_equal_the_loop_and_trace_once(n_pieces, stack_traces):
    data, truth = _long()
    data = msrm.Dataset(split_run(data.runs[0], n_pieces))
    start = stack_traces[0]
    _, batched = _compare(data, truth.spec, truth.params)
    # one stack; value_and_grad and the per-run values each traced the per-run function once
    assert len(batched.run_stacks) == 1 and batched.run_stacks[0]["runs"] == list(range(n_pieces))
    assert stack_traces[0] - start == 2
    assert batched.log_likelihood(truth.params) == pytest.approx(sum(batched.pointwise_log_likelihood(
        batched.unconstrain(truth.params), by="run")["run"]), rel=1e-13)
    # the pieces differ by a node or so: each group padded to its largest, within the default 10 %
    counts = batched.node_counts
    assert max(counts) <= batched.run_stacks[0]["n_nodes"] <= 1.1 * min(counts)


def test_compiled_graph_does_not_grow_with_equal_runs():
    """Lowered programs: the stacked one has the same number of operations for 2 and 4 runs, the loop grows."""
    data, truth = _long(missing=0.0)
    theta = params_to_theta(truth.params)
    lines = {}
    for n in (2, 4):
        runs = [data.runs[0]] * n  # identical runs: identical signatures, no padding
        per_run = P.prepare(msrm.Dataset(runs), truth.spec)
        stacked = MR.stack_runs(per_run)
        assert [b.run_index for b in stacked.buckets] == [tuple(range(n))]
        lines[("loop", n)] = len(jax.jit(L.grouped_loglik).lower(theta, per_run).as_text().splitlines())
        lines[("stack", n)] = len(jax.jit(L.grouped_loglik).lower(theta, stacked).as_text().splitlines())
        values = [float(jax.jit(L.grouped_loglik)(theta, p)[0]) for p in (per_run, stacked)]
        assert values[1] == pytest.approx(values[0], rel=REL)
    assert lines[("stack", 2)] == lines[("stack", 4)]
    assert lines[("loop", 4)] > 1.5 * lines[("loop", 2)]


@pytest.mark.slow  # four runs in three stacks, each compiled twice (two pad tolerances)
def test_runs_of_different_structure_form_separate_stacks():
    """A run without one stream, a run twice as long and two equal runs: three stacks, returned in run order."""
    data, truth = data_synth.synthetic_dataset("tiny", n_features=3, seed=4, n_runs=3, missing_fraction=0.1,
                                               pooling="individual")
    longer, _ = data_synth.synthetic_dataset("tiny", n_features=3, seed=5, duration_scale=2.0, pooling="individual")
    r0, r1, r2 = data.runs
    short = msrm.Run(r1.duration, [s for s in r1.streams if s.key != "p4/rating"])
    mixed = msrm.Dataset([r0, short, longer.runs[0], r2])
    ref, batched = _compare(mixed, truth.spec, truth.params)
    stacks = sorted(tuple(s["runs"]) for s in batched.run_stacks)
    assert stacks == [(0, 3), (1,), (2,)]
    # pad_tolerance=0 stacks only runs of identical size; the value does not change
    _, exact = _compare(mixed, truth.spec, truth.params, ref=ref, pad_tolerance=0.0)
    assert sorted(tuple(s["runs"]) for s in exact.run_stacks) == [(0, 3), (1,), (2,)]


@pytest.mark.slow  # compiles the dense backend as well as grouped
def test_dense_backend_and_missing_structure_promotion():
    """Dense (ungrouped) table; one piece with missing values stacked with one without (mask of ones)."""
    data, truth = _long(seed=2, missing=0.0, scale=2.0)
    a, b = split_run(data.runs[0], 2)
    Y = b.streams[0].values.copy()
    Y[1, 0] = np.nan
    b = msrm.Run(b.duration, [msrm.Stream(b.streams[0].participant, b.streams[0].modality, b.streams[0].dt, Y,
                                          offset=b.streams[0].offset)] + list(b.streams[1:]))
    mixed = msrm.Dataset([a, b])
    for la in ("grouped", "dense"):
        _, batched = _compare(mixed, truth.spec, truth.params, la=la, pad_tolerance=0.5)
        assert len(batched.run_stacks) == 1
        sig = batched.prepared.buckets[0].signature
        assert any(s.has_missing for s in sig.streams)


def test_padding_adds_nothing():
    """Dummy nodes: zero response rows, zero statistics and factors; real nodes equal the per-run quantities."""
    data, truth = _long(seed=3, missing=0.2)
    pieces = split_run(data.runs[0], 2)
    per_run = P.prepare(msrm.Dataset(pieces), truth.spec)
    stacked = MR.stack_runs(per_run)
    (bucket,) = stacked.buckets
    sig = bucket.signature
    theta = params_to_theta(truth.params)
    padded_any = False
    for i, run in enumerate(per_run.runs):
        arrays = jax.tree_util.tree_map(lambda x: x[i], bucket.arrays)
        Lam_p, eta_p, R_p, c_p = (np.asarray(x) for x in MR.node_information_arrays(theta, sig, arrays))
        A_p = np.asarray(MR.response_matrix_arrays(theta, sig, arrays))
        Lam, eta, R, c = (np.asarray(x) for x in L.node_information(theta, run))
        A = np.asarray(L.response_matrix(theta, run.layout))
        real = np.zeros(sig.n_nodes, bool)
        for gs, gl in zip(sig.groups, run.layout.groups):
            n_g = gl.node_stop - gl.node_start
            new = slice(gs.node_start, gs.node_start + n_g)
            old = slice(gl.node_start, gl.node_stop)
            real[new] = True
            np.testing.assert_allclose(Lam_p[new], Lam[old], rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(eta_p[new], eta[old], rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(R_p[new], R[old], rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(A_p[new, :A.shape[1]], A[old], atol=1e-15)
        assert c_p == pytest.approx(c, rel=1e-13)
        padded_any |= (~real).any() or A_p.shape[1] > A.shape[1]
        for x in (Lam_p, eta_p, R_p, A_p):
            assert not np.any(x[~real])
        assert not np.any(A_p[:, A.shape[1]:])
    assert padded_any  # the two pieces differ in size, so one of them was padded


def test_bad_arguments_raise_before_numerics(likelihood_traces):
    data, truth = data_synth.synthetic_dataset("tiny", n_features=3, seed=0)
    start = likelihood_traces[0]
    bad = [dict(devices=[]), dict(devices="gpu"), dict(devices=[99]), dict(devices=[0, 0]), dict(devices=3.5),
           dict(pad_tolerance=-0.1), dict(pad_tolerance=float("nan")), dict(batch_runs="yes")]
    for kwargs in bad:
        name = next(iter(kwargs))
        with pytest.raises(ValueError, match=name):
            GPMSRM(data, truth.spec, "grouped", **kwargs)
    assert likelihood_traces[0] == start
    # one named device is fine (data committed there)
    m = GPMSRM(data, truth.spec, "grouped", devices=[0])
    assert m.devices == [jax.devices()[0]]


_SHARDED = textwrap.dedent(r"""
    import json, os, sys
    import numpy as np
    import msrm, data_synth
    msrm.runtime.enable_x64()
    import jax
    from msrm.data import split_run
    from msrm.gp import likelihood as L
    from msrm.gp.model import GPMSRM

    stack_traces = [0]
    bucket_logliks = L._bucket_logliks

    def counted(*args):  # one call per trace of a stack of runs
        stack_traces[0] += 1
        return bucket_logliks(*args)

    L._bucket_logliks = counted

    assert len(jax.devices()) == 2, jax.devices()
    data, truth = data_synth.synthetic_dataset("tiny", n_features=3, seed=1, duration_scale=3.0,
                                               missing_fraction=0.1)
    other, _ = data_synth.synthetic_dataset("tiny", n_features=3, seed=6, missing_fraction=0.1)
    # three pieces of one recording (odd: one dummy slot) and a run of another structure (one run: replicated)
    runs = split_run(data.runs[0], 3) + [msrm.Run(other.runs[0].duration, other.runs[0].streams[1:])]
    data = msrm.Dataset(runs)
    out = {}
    # the reference: the per-run loop on one device with the LAPACK callback; then the same runs stacked on one
    # device, and sharded over both (default devices=None takes every local device; native factorization there)
    models = {"loop": GPMSRM(data, truth.spec, batch_runs=False, method="callback"),
              "single": GPMSRM(data, truth.spec, devices=[0]),
              "sharded": GPMSRM(data, truth.spec)}
    u = models["loop"].unconstrain(truth.params)
    for name, m in models.items():
        start = stack_traces[0]
        v, g = m.value_and_grad(u)
        traces = stack_traces[0] - start
        out[name] = dict(value=v, grad=g.tolist(), runs=m.pointwise_log_likelihood(u, by="run")["run"].tolist(),
                         traces=traces, events=m.guard_events(), stacks=m.run_stacks, devices=len(m.devices))
    b = models["sharded"].prepared.buckets
    out["shardings"] = [sorted(str(d) for d in x.arrays.n_obs.sharding.device_set) for x in b]
    out["spec"] = [str(x.arrays.streams[0].Y0.sharding.spec) for x in b]
    # refused with the argument named: the callback on several devices, sharding without batching
    out["refused"] = []
    for kwargs in (dict(method="callback"), dict(devices="all", batch_runs=False)):
        try:
            GPMSRM(data, truth.spec, "grouped", **kwargs)
            out["refused"].append(None)
        except ValueError as exc:
            out["refused"].append(str(exc))
    print("RESULT" + json.dumps(out, default=str))
""")


def test_sharded_over_two_host_devices_equals_single_device_sum(tmp_path):
    """Two forced host devices in a subprocess. This used to hang on the 2-core machine: jaxlib 0.10's batched
    CPU LAPACK kernels split their batch over XLA's intra-op pool from inside a pool thread and wait, and with
    both device programs in such a kernel no thread was left to do the work. The likelihood now makes no batched
    LAPACK call on XLA:CPU (``linalg.small_cholesky``, ``linalg.per_item_on_cpu``)."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", OMP_NUM_THREADS="1",
               OPENBLAS_NUM_THREADS="1", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _SHARDED], env=env, capture_output=True, text=True, timeout=400,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
    out = json.loads(line[len("RESULT"):])
    ref = out["loop"]
    for name in ("single", "sharded"):
        got = out[name]
        assert got["value"] == pytest.approx(ref["value"], rel=REL), name
        g, g0 = np.asarray(got["grad"]), np.asarray(ref["grad"])
        np.testing.assert_allclose(g, g0, rtol=0, atol=REL * np.abs(g0).max())
        np.testing.assert_allclose(got["runs"], ref["runs"], rtol=REL)
        assert got["events"] == ref["events"]
        assert got["traces"] == 2  # value_and_grad traced the per-run function once per stack
    sharded = out["sharded"]
    assert sharded["devices"] == 2 and out["single"]["devices"] == 1
    assert {s["method"] for s in sharded["stacks"]} == {"native"}
    assert {s["method"] for s in out["single"]["stacks"]} == {"auto"}  # the callback on one CPU device
    # the three pieces fill four slots (one dummy), the single run fills two (replicated)
    assert sorted((len(s["runs"]), s["slots"]) for s in sharded["stacks"]) == [(1, 2), (3, 4)]
    assert all(len(d) == 2 for d in out["shardings"])
    assert all("runs" in s for s in out["spec"])
    assert "method='callback'" in out["refused"][0]
    assert out["refused"][1].startswith("devices:")
