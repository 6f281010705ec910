"""BLAS threads of GP-MSRM's host work: the LAPACK callback (POTRF/POTRI) and the state-space host filter choose
their count per call from the size of the work and the cores other processes leave idle
(``msrm.runtime.dense_blas_threads``, the rule R-MSRM's dense steps use); explicit counts override it; the
callback's results do not depend on the count. threadpoolctl reports the count inside the callback and the filter.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from threadpoolctl import threadpool_info

import msrm
from msrm import runtime

msrm.runtime.enable_x64()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from msrm.gp.linalg import lapack as lapack_mod  # noqa: E402
from msrm.gp.linalg import quad_logdet  # noqa: E402
from msrm.gp.state_space import host as host_mod  # noqa: E402

BIG = 10 * runtime.DENSE_THREAD_MIN_FLOPS
SMALL = runtime.DENSE_THREAD_MIN_FLOPS / 2


def _blas_threads_now() -> int:
    return max(d["num_threads"] for d in threadpool_info() if d["user_api"] == "blas")


def _set_load(monkeypatch, others: int) -> None:
    """Pretend other processes are running ``others`` threads right now."""
    monkeypatch.setattr(runtime, "_running_elsewhere", lambda proc="/proc": int(others))


def _two_threads_possible() -> bool:
    with runtime.blas_limit(2):
        return _blas_threads_now() == 2


def spd(n, seed=0):
    rng = np.random.default_rng(seed)
    B = rng.normal(size=(n, n))
    return B @ B.T / n + np.eye(n)


# ---------------------------------------------------------------- the rule, with the other processes' threads monkeypatched

# (threads other processes are running, idle cores of 4): this process alone, one other busy thread, two, three,
# as many as the cores and more
LOADS = [(0, 4), (1, 3), (2, 2), (3, 1), (4, 1), (9, 1)]


@pytest.mark.parametrize("load, idle", LOADS)
def test_callback_and_filter_counts_follow_the_load(monkeypatch, load, idle):
    monkeypatch.setattr(runtime, "physical_cores", lambda: 4)
    _set_load(monkeypatch, load)
    # idle = max(1, min(C, C - R_other))
    assert idle == max(1, min(4, 4 - load))
    assert runtime.idle_cores() == idle
    assert runtime.dense_blas_threads(BIG) == idle
    assert runtime.callback_thread_count(BIG) == idle
    assert runtime.callback_thread_count() == idle  # no size given: large work
    assert runtime.filter_thread_count(BIG) == idle
    assert runtime.step_blas_threads("dense", BIG) == idle  # R-MSRM's dense steps: the same rule
    # below the size threshold one thread, whatever the load
    for fn in (runtime.dense_blas_threads, runtime.callback_thread_count, runtime.filter_thread_count):
        assert fn(SMALL) == 1
    assert runtime.step_blas_threads("dense", SMALL) == 1


def _fake_proc(root, running: int, states: list[str]) -> str:
    """A copy of the two /proc files the rule reads: /proc/loadavg and one stat file per thread of this process."""
    root.mkdir()
    (root / "loadavg").write_text(f"3.10 2.00 1.00 {running}/412 98765\n")
    for i, state in enumerate(states):
        task = root / "self" / "task" / str(1000 + i)
        task.mkdir(parents=True)
        # a command name with a parenthesis and a space, as threads may carry: the state follows the last ')'
        task.joinpath("stat").write_text(f"{1000 + i} (py (worker) R) {state} 1 1000 1000 0 -1\n")
    return str(root)


def test_running_elsewhere_subtracts_this_process_threads(tmp_path):
    # 5 runnable threads on the machine, 2 of them this process's (the reader and a spinning BLAS worker)
    assert runtime._running_elsewhere(_fake_proc(tmp_path / "a", 5, ["R", "R", "S", "S"])) == 3
    # the reading thread alone
    assert runtime._running_elsewhere(_fake_proc(tmp_path / "b", 1, ["R", "S"])) == 0
    # a thread that had not been seen as running yet still counts the reader once
    assert runtime._running_elsewhere(_fake_proc(tmp_path / "c", 3, ["S", "S"])) == 2
    assert runtime._running_elsewhere(str(tmp_path / "missing")) is None


def test_without_proc_the_load_average_stands_in(monkeypatch):
    monkeypatch.setattr(runtime, "physical_cores", lambda: 4)
    monkeypatch.setattr(runtime, "_running_elsewhere", lambda proc="/proc": None)
    # this process's own running thread is taken off the load average, the rest rounded to the nearest thread
    for load, idle in [(0.0, 4), (1.0, 4), (1.4, 4), (1.6, 3), (3.0, 2), (9.0, 1)]:
        monkeypatch.setattr(runtime.os, "getloadavg", lambda load=load: (load, load, load))
        assert runtime.idle_cores() == idle


@pytest.mark.skipif(not os.path.exists("/proc/loadavg"), reason="reads /proc (Linux)")
def test_a_busy_process_is_seen_and_this_process_own_threads_are_not():
    import threading

    def median(xs):
        return sorted(xs)[len(xs) // 2]

    def readings():
        out = []
        for _ in range(15):
            out.append(runtime._running_elsewhere())
            time.sleep(0.01)
        return out

    base = readings()
    # three threads of this process multiplying matrices on one BLAS thread each (NumPy releases the GIL there,
    # so all three are runnable at once): work of this process, not of others
    stop = threading.Event()
    a = np.random.default_rng(0).normal(size=(300, 300))

    def spin():
        while not stop.is_set():
            a @ a

    with runtime.blas_limit(1):
        mine = [threading.Thread(target=spin, daemon=True) for _ in range(3)]
        for t in mine:
            t.start()
        try:
            seen_mine = readings()
        finally:
            stop.set()
            for t in mine:
                t.join()
    # a spinning child process: always runnable, so always counted
    child = subprocess.Popen([sys.executable, "-c", "print('ready', flush=True)\nwhile True: pass"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert "ready" in child.stdout.readline()
        seen_child = readings()
    finally:
        child.kill()
        child.wait()
    assert min(seen_child) >= 1, seen_child
    # other work on the machine (a test runner beside this one) moves every reading alike; counted as other
    # work, this process's three busy threads would add about 3 to the median
    assert median(seen_mine) <= median(base) + 1, (base, seen_mine)


def test_the_load_is_read_per_call(monkeypatch):
    monkeypatch.setattr(runtime, "physical_cores", lambda: 4)
    seen = []
    for load, idle in LOADS:
        _set_load(monkeypatch, load)
        seen.append((runtime.callback_thread_count(BIG), runtime.filter_thread_count(BIG)))
    assert seen == [(idle, idle) for _, idle in LOADS]


def test_small_work_does_not_read_the_load(monkeypatch):
    def fail():
        raise AssertionError("the machine's load was read for work below the threshold")

    monkeypatch.setattr(runtime, "_running_elsewhere", fail)
    monkeypatch.setattr(runtime.os, "getloadavg", fail)
    assert runtime.callback_thread_count(SMALL) == 1 and runtime.filter_thread_count(SMALL) == 1


def test_explicit_counts_override_the_rule(monkeypatch):
    monkeypatch.setattr(runtime, "physical_cores", lambda: 4)
    _set_load(monkeypatch, 9)  # the rule alone: 1
    # configure(blas_threads=3): the callback takes it as given; the filter when its products reach the threshold
    monkeypatch.setitem(runtime._STATE, "blas_threads", 3)
    assert runtime.callback_thread_count(BIG) == runtime.callback_thread_count(SMALL) == 3
    assert runtime.filter_thread_count(BIG) == 3
    assert runtime.filter_thread_count(SMALL) == 1
    assert runtime.step_blas_threads("dense", SMALL) == 3  # R-MSRM's steps: unchanged
    # callback_threads beats configure
    with runtime.callback_threads(2):
        assert runtime.callback_thread_count(SMALL) == 2
        assert runtime.filter_thread_count(BIG) == 2
        assert runtime.filter_thread_count(SMALL) == 1
        # fixed_step_threads beats both, for every size
        with runtime.fixed_step_threads(4):
            assert runtime.callback_thread_count(SMALL) == 4
            assert runtime.filter_thread_count(SMALL) == 4
            assert runtime.step_blas_threads("banded") == 4
            assert runtime.blas_threads() == 4
        assert runtime.filter_thread_count(SMALL) == 1
    monkeypatch.setitem(runtime._STATE, "blas_threads", None)
    assert runtime.callback_thread_count(BIG) == runtime.filter_thread_count(BIG) == 1


def test_rule_rejects_bad_sizes():
    for fn in (runtime.dense_blas_threads, runtime.callback_thread_count, runtime.filter_thread_count):
        with pytest.raises(ValueError, match="flops"):
            fn(-1.0)
        with pytest.raises(ValueError, match="flops"):
            fn("big")


def test_host_filter_size_is_its_largest_product():
    # the covariance update 2 S^2 R against the bank move 2 n_b max(n_b, C) K S
    assert host_mod.largest_product_flops(100, 12, 3) == 2.0 * 100 * 100 * 12
    assert host_mod.largest_product_flops(100, 1, 3, n_bank=40, block=10) == 2.0 * 40 * 40 * 3 * 100
    assert host_mod.largest_product_flops(100, 0, 3) == 0.0


# ---------------------------------------------------------------- the LAPACK callback, observed with threadpoolctl

def _spy_callback(monkeypatch):
    seen: list[int] = []
    inner = lapack_mod._host_one

    def spy(*a, **k):
        seen.append(_blas_threads_now())
        return inner(*a, **k)

    monkeypatch.setattr(lapack_mod, "_host_one", spy)
    return seen


def test_callback_sets_the_rule_count_at_each_call(monkeypatch):
    if not _two_threads_possible():
        pytest.skip("OpenBLAS cannot run 2 threads here")
    cores = runtime.physical_cores()
    seen = _spy_callback(monkeypatch)
    monkeypatch.setattr(runtime, "DENSE_THREAD_MIN_FLOPS", 0.0)  # a toy matrix counts as large work
    M, V = jnp.asarray(spd(40)), jnp.ones((40, 2))
    f = jax.jit(lambda M, V: quad_logdet(M, V, method="callback")[:2])
    vg = jax.jit(jax.grad(lambda M: sum(quad_logdet(M, V, method="callback")[:2])))
    outer = _blas_threads_now()
    expected = []
    for load in (0, 50, 0):  # one compiled function, the count chosen afresh at every call
        _set_load(monkeypatch, load)
        jax.block_until_ready(f(M, V))
        jax.block_until_ready(vg(M))
        expected += [runtime.idle_cores()] * 2
    assert expected == [cores, cores, 1, 1, cores, cores]
    assert seen == expected
    assert _blas_threads_now() == outer  # restored after each call
    # an explicit count wins over the load
    seen.clear()
    _set_load(monkeypatch, 50)
    with runtime.callback_threads(2):
        jax.block_until_ready(f(M, V))
    with runtime.fixed_step_threads(2):
        jax.block_until_ready(vg(M))
    monkeypatch.setitem(runtime._STATE, "blas_threads", 2)
    jax.block_until_ready(f(M, V))
    assert seen == [2, 2, 2]


def test_callback_small_matrix_runs_one_thread(monkeypatch):
    seen = _spy_callback(monkeypatch)
    _set_load(monkeypatch, 0)
    quad_logdet(jnp.asarray(spd(30)), jnp.ones(30), method="callback")[0].block_until_ready()
    assert seen == [1]  # 30^3 / 3 flops: far below the threshold


def test_callback_result_does_not_depend_on_the_thread_count(monkeypatch):
    n = 600
    M_np, V_np = spd(n, seed=3), np.random.default_rng(4).normal(size=(n, 2))
    M, V = jnp.asarray(M_np), jnp.asarray(V_np)
    seen = _spy_callback(monkeypatch)
    vg = jax.jit(jax.value_and_grad(lambda M: sum(quad_logdet(M, V, method="callback")[:2])))
    val = jax.jit(lambda M: quad_logdet(M, V, method="callback")[:2])
    counts = sorted({1, min(2, runtime.physical_cores())})
    out = {}
    for k in counts:
        with runtime.fixed_step_threads(k):
            q, ld = (float(x) for x in val(M))
            v, g = vg(M)
            out[k] = (q, ld, float(v), np.asarray(g))
    assert seen == [k for k in counts for _ in range(2)]
    # against NumPy (LU-based slogdet, LAPACK gesv)
    sign, logdet = np.linalg.slogdet(M_np)
    quad = float(np.sum(V_np * np.linalg.solve(M_np, V_np)))
    Minv = np.linalg.inv(M_np)
    A = np.linalg.solve(M_np, V_np)
    grad = Minv - A @ A.T  # d(quad + logdet)/dM for symmetric M, as the callback's reverse rule gives it
    assert sign == 1.0
    for k, (q, ld, v, g) in out.items():
        np.testing.assert_allclose(q, quad, rtol=1e-12)
        np.testing.assert_allclose(ld, logdet, rtol=1e-12)
        np.testing.assert_allclose(v, quad + logdet, rtol=1e-12)
        np.testing.assert_allclose(g, grad, rtol=1e-9, atol=1e-12)
    # across thread counts: equal to 1e-14
    base = out[counts[0]]
    for k in counts[1:]:
        q, ld, v, g = out[k]
        np.testing.assert_allclose([q, ld, v], base[:3], rtol=1e-14, atol=0)
        np.testing.assert_allclose(g, base[3], rtol=0, atol=1e-14 * np.max(np.abs(base[3])))


# ---------------------------------------------------------------- the host filter, observed with threadpoolctl

@pytest.fixture(scope="module")
def ss_model():
    import data_synth

    data, truth = data_synth.synthetic_dataset("tiny", n_features=2, seed=0)
    model = msrm.GPMSRM(data, truth.spec, linear_algebra="state_space", method="callback")
    u = model.unconstrain(truth.params)
    jax.block_until_ready(model.value_and_grad(u))  # compiled once for the tests below
    return model, u


def _spy_filter(monkeypatch):
    seen: list[int] = []
    inner = host_mod.gemm_acc

    def spy(*a, **k):
        if len(seen) < 2:  # the count is fixed for the call; two samples of it are enough
            seen.append(_blas_threads_now())
        return inner(*a, **k)

    monkeypatch.setattr(host_mod, "gemm_acc", spy)
    return seen


def test_host_filter_sets_the_rule_count_at_each_call(monkeypatch, ss_model):
    if not _two_threads_possible():
        pytest.skip("OpenBLAS cannot run 2 threads here")
    model, u = ss_model
    cores = runtime.physical_cores()
    seen = _spy_filter(monkeypatch)
    outer = _blas_threads_now()

    def observe():
        seen.clear()
        jax.block_until_ready(model.value_and_grad(u))
        assert seen, "the host filter made no covariance update"
        assert len(set(seen)) == 1
        return seen[0]

    _set_load(monkeypatch, 0)
    assert observe() == 1  # the tiny model's products are far below the threshold
    monkeypatch.setattr(runtime, "DENSE_THREAD_MIN_FLOPS", 0.0)  # its products count as large work
    assert observe() == cores
    _set_load(monkeypatch, 50)
    assert observe() == 1
    _set_load(monkeypatch, 0)
    assert observe() == cores
    _set_load(monkeypatch, 50)
    monkeypatch.setitem(runtime._STATE, "blas_threads", 2)  # configure(blas_threads=2) wins over the load
    assert observe() == 2
    assert _blas_threads_now() == outer  # restored after each call


def test_host_filter_small_products_stay_on_one_thread_unless_fixed(monkeypatch, ss_model):
    if not _two_threads_possible():
        pytest.skip("OpenBLAS cannot run 2 threads here")
    model, u = ss_model
    seen = _spy_filter(monkeypatch)
    monkeypatch.setitem(runtime._STATE, "blas_threads", 2)
    with runtime.callback_threads(2):
        jax.block_until_ready(model.value_and_grad(u))
    assert set(seen) == {1}
    seen.clear()
    with runtime.fixed_step_threads(2):  # benchmarks force a count on every size
        jax.block_until_ready(model.value_and_grad(u))
    assert set(seen) == {2}


def test_configure_blas_threads_overrides_the_load_in_a_fresh_process():
    # configure() itself (its process-wide threadpoolctl limit held by the main thread), a busy machine
    # (50 threads running elsewhere) and work counted as large: the callback and the filter run on the configured count
    code = """
import json, os, sys, threadpoolctl
sys.path.insert(0, "tests")
import msrm
msrm.runtime.configure(platform="cpu", blas_threads=2)
from msrm import runtime
runtime._running_elsewhere = lambda proc="/proc": 50
runtime.DENSE_THREAD_MIN_FLOPS = 0.0
import jax, jax.numpy as jnp, numpy as np
import data_synth
from msrm.gp.linalg import lapack, quad_logdet
from msrm.gp.state_space import host
def n():
    return max(i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas")
seen = {"main": n(), "callback": [], "filter": []}
inner_one, inner_gemm = lapack._host_one, host.gemm_acc
def spy_one(*a, **k):
    seen["callback"].append(n())
    return inner_one(*a, **k)
def spy_gemm(*a, **k):
    if len(seen["filter"]) < 2:
        seen["filter"].append(n())
    return inner_gemm(*a, **k)
lapack._host_one, host.gemm_acc = spy_one, spy_gemm
B = np.random.default_rng(0).normal(size=(30, 30))
quad_logdet(jnp.asarray(B @ B.T + 30 * np.eye(30)), jnp.ones(30), method="callback")[0].block_until_ready()
data, truth = data_synth.synthetic_dataset("tiny", n_features=2, seed=0)
model = msrm.GPMSRM(data, truth.spec, linear_algebra="state_space", method="callback")
jax.block_until_ready(model.value_and_grad(model.unconstrain(truth.params)))
seen["rule_alone"] = runtime.dense_blas_threads(1.0)
seen["after"] = n()
print(json.dumps(seen))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    if seen["main"] != 2:
        pytest.skip(f"OpenBLAS cannot run 2 threads here: {seen}")
    assert seen["rule_alone"] == 1  # what the load alone would give
    assert seen["callback"] == [2] and set(seen["filter"]) == {2} and seen["after"] == 2, seen


# ---------------------------------------------------------------- the benchmark hook, at a toy size

def test_gp_threads_bench_rows_are_well_formed():
    from msrm_lab.bench import threads as bench_threads

    rows = bench_threads.gp_threads_rows("smoke", repeats=1)
    med = [r for r in rows if r["metric"] == "median_s"]
    assert {(r["params"]["path"], r["params"]["setting"]) for r in med} == {
        (p, s) for p in ("grouped", "state_space") for s in ("automatic", "one", "two", "default")}
    assert all(r["params"]["busy_processes"] == 0 for r in rows)
    assert all(r["status"] == "measured" and r["value"] > 0 and r["execution_info"]["blas"] for r in rows)
    assert all(r["experiment"] == bench_threads.GP_EXPERIMENT for r in rows)
    for r in med:
        p = r["params"]
        assert p["repeats"] == 1 and len(p["times"]) == 1 and p["K"] == 3 and "load_average_start" in p
        if p["setting"] == "automatic":
            assert p["threads"] == "automatic"
            assert len(p["chosen_threads"]) == 1 and p["chosen_threads"][0] >= 1 and len(p["load_average"]) == 1
        else:
            want = {"one": 1, "two": 2, "default": bench_threads._openblas_default_threads()}[p["setting"]]
            assert p["threads"] == want
    ratios = {(r["params"]["path"], r["metric"]) for r in rows if r["metric"] != "median_s"}
    assert ratios == {(p, m) for p in ("grouped", "state_space") for m in ("automatic_over_best_fixed",
                                                                            "two_over_one")}
    with pytest.raises(ValueError, match="profile"):
        bench_threads.gp_threads_rows("huge")
    with pytest.raises(ValueError, match="paths"):
        bench_threads.gp_threads_rows("smoke", paths=("dense",))


def test_gp_threads_rows_from_another_interpreter(tmp_path):
    # the notebook repeats the GP rows in the oldest supported environment; here the other interpreter is this
    # one, run as a separate process through the module's command line
    from msrm_lab.bench import threads as bench_threads

    rows = bench_threads.gp_threads_rows("smoke", repeats=1, paths=("grouped",), busy=(0,), python=sys.executable)
    med = [r for r in rows if r["metric"] == "median_s"]
    assert {r["params"]["setting"] for r in med} == {"automatic", "one", "two", "default"}
    assert all(r["params"]["path"] == "grouped" and r["params"]["busy_processes"] == 0 for r in rows)
    assert all(r["execution_info"]["jax"] == jax.__version__ for r in rows)
    with pytest.raises(RuntimeError, match="failed"):
        bench_threads.gp_threads_rows("smoke", repeats=1, python=str(tmp_path / "no-such-python"))
    with pytest.raises(ValueError, match="other interpreter"):
        bench_threads.gp_threads_rows("smoke", settings=(("one", 1),), python=sys.executable)
