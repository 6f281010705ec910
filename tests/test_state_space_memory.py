"""State-space memory: preparing a long single-stream run is linear in the grid, the guard's predicted peak
(:func:`msrm.gp.memory.state_space_peak_bytes`) agrees with a measured one, and the guard refuses a model that
will not fit with a message naming the sizes and a remedy."""
from __future__ import annotations

import inspect
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import msrm
from msrm.gp import memory
from msrm.gp.state_space import prepare, run_sizes


def case(n):
    """The simplest model (one factor, one one-feature stream sampled on the latent grid, Identity response,
    Matérn-3/2) on n grid points, built without the O(J^2) prior draw of a small test case: the values are noise,
    which changes nothing the memory depends on. Returns (data, spec, params)."""
    msrm.runtime.enable_x64()
    spec = msrm.ModelSpec(n_factors=1, latent_dt=1.0, kernel="matern32", pooling="shared", latent_pad=0.0,
                          responses={"brain": msrm.Identity()})
    Y = np.random.default_rng(0).standard_normal((n, 1))
    stream = msrm.Stream(participant="p0", modality="brain", dt=1.0, values=Y, offset=0.0)
    data = msrm.Dataset([msrm.Run(duration=float(n - 1), streams=[stream])])
    params = msrm.Params(loadings={"p0/brain": np.array([[1.0]])}, intercepts={"p0/brain": np.array([0.0])},
                         noise_sd={"p0/brain": np.array([0.5])}, lengthscales=np.array([4.0]), response={})
    return data, spec, params


# what a measuring subprocess runs before its own code: the imports and case()
CASE = "import numpy as np\nimport msrm\n" + inspect.getsource(case)


def _run(code: str, timeout: int = 300) -> dict:
    out = subprocess.run([sys.executable, "-c", CASE + textwrap.dedent(code)], capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss in kilobytes is Linux's")
def test_a_million_point_run_prepares_in_linear_memory():
    """1e6 grid points: preparing grows the peak resident memory by well under 1 GB (a dense J x J matrix alone
    would be 8 TB, an (n_obs x J) one as much), the grid distances are never built, and the NumPy peak of
    preparing grows in proportion to the grid (4x the points, at most 5x the memory)."""
    got = _run("""
        import gc, json, resource, tracemalloc
        from msrm.gp.state_space import prepare
        peaks = {}
        for n in (100_000, 400_000):
            data, spec, _ = case(n)
            gc.collect(); tracemalloc.start()
            p = prepare(data, spec)
            peaks[n] = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop(); del p, data
        data, spec, _ = case(1_000_000)
        gc.collect()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        p = prepare(data, spec)
        grow = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
        lay, t = p.runs[0].gp.layout, p.runs[0].tables
        print(json.dumps(dict(grow=grow, peaks=[peaks[100_000], peaks[400_000]], dist="dist" in vars(lay),
                              J=lay.n_grid, S=t.n_states, T=int(t.block_index.size))))
    """)
    assert got["J"] == 1_000_000 and not got["dist"]
    assert got["grow"] < 1e9, f"preparing 1e6 points grew the peak RSS by {got['grow'] / 1e9:.2f} GB"
    small, large = got["peaks"]
    assert large < 5.0 * small, f"NumPy peak {small / 1e6:.0f} MB at 1e5 points, {large / 1e6:.0f} MB at 4e5"


# the predicted peak is within this factor of the measured one, either way (measured/predicted was 0.8 to 1.0 on
# these cases)
AGREEMENT = 1.5


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/clear_refs and VmHWM are Linux's")
@pytest.mark.parametrize("n", [60_000, pytest.param(200_000, marks=pytest.mark.slow)])
def test_predicted_peak_agrees_with_the_measured_one(n):
    """6e4 grid points (every sub-step kept, one chunk) and 2e5 (checkpointed chunks, recomputed on a second
    thread where there are two cores): the resident memory one value+gradient adds (peak RSS reset after a first
    call, so the compiled program and the first call's leftovers are not counted) against the guard's
    prediction."""
    got = _run(f"n = {n}\n" + textwrap.dedent("""
        import ctypes, json
        from msrm.gp import memory
        from msrm.gp.state_space import run_sizes

        def status(k):
            for line in open("/proc/self/status"):
                if line.startswith(k):
                    return int(line.split()[1]) * 1024

        data, spec, params = case(n)
        m = msrm.GPMSRM(data, spec, linear_algebra="state_space")
        pred = memory.state_space_peak_bytes([run_sizes(r) for r in m.prepared.runs])[0]
        u = m.unconstrain(params)
        m.value_and_grad(u)  # compile, first call
        msrm.runtime.release_host_memory()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak RSS to the current RSS
        before = status("VmRSS:")
        m.value_and_grad(u)
        print(json.dumps(dict(pred=pred, measured=status("VmHWM:") - before)))
    """))
    ratio = got["measured"] / got["pred"]
    assert 1.0 / AGREEMENT <= ratio <= AGREEMENT, (
        f"measured {got['measured'] / 1e6:.0f} MB, predicted {got['pred'] / 1e6:.0f} MB")


def test_peak_formula_by_hand():
    z = memory.StateSpaceSizes(sub_steps=10, slots=3, n_states=8, n_factors=2, sde_states=2, n_nodes=25, chunk=4,
                               n_chunks=3, pipelined=False)
    Q, R = 4, 6
    tables = 5 * 8 * 10 * 3 * (Q + 4 + 2) + 4 * 8 * 25 * (4 + 2)
    kept = 64 + 8 * (2 * R + 4 + 2) + 6 * R * R
    assert memory.state_space_peak_bytes([z]) == (tables + 8 * 3 * (64 + 8) + 2 * 8 * 4 * kept, 8)
    piped = z._replace(pipelined=True)
    assert memory.state_space_peak_bytes([piped])[0] == tables + 8 * 3 * (64 + 8) + 3 * 8 * 4 * kept
    one = z._replace(chunk=10, n_chunks=1)
    assert memory.state_space_peak_bytes([one])[0] == tables + 8 * (64 + 8) + 8 * 10 * kept
    par = z._replace(parallel=True)
    assert memory.state_space_peak_bytes([par])[0] == tables + 4 * 8 * 10 * (3 * 64 + 16)
    # tables add over runs, the states are the largest run's
    two = memory.state_space_peak_bytes([z, z])[0]
    assert two == 2 * tables + 8 * 3 * (64 + 8) + 2 * 8 * 4 * kept
    with pytest.raises(ValueError, match="at least one run"):
        memory.state_space_peak_bytes([])
    with pytest.raises(ValueError, match="multiple of n_factors"):
        memory.state_space_peak_bytes([z._replace(n_states=9)])


def test_peak_is_linear_in_the_grid():
    """Doubling the run doubles the predicted peak, give or take the chunking (no J^2 term anywhere)."""
    preds = []
    for n in (20_000, 40_000, 80_000):
        data, spec, _ = case(n)
        preds.append(memory.state_space_peak_bytes([run_sizes(r) for r in prepare(data, spec, block=8).runs])[0])
    assert 1.5 < preds[1] / preds[0] < 2.5 and 1.5 < preds[2] / preds[1] < 2.5


def test_the_guard_refuses_naming_the_sizes_and_a_remedy(monkeypatch):
    """Free memory patched low: the model refuses before placing anything, naming the grid, the sub-steps, the
    slots and the state size, and a smaller block (its remedy) then fits."""
    monkeypatch.delenv(memory.ENV_LIMIT, raising=False)
    data, spec, params = case(30_000)
    sizes = run_sizes(prepare(data, spec).runs[0])
    need = memory.state_space_peak_bytes([sizes])[0]
    small = memory.state_space_peak_bytes([run_sizes(r) for r in prepare(data, spec, block=2).runs])[0]
    assert small < need
    free = (small + need) // 2
    monkeypatch.setattr(memory, "available_bytes", lambda device=None: free)
    with pytest.raises(memory.MemoryGuardError) as err:
        msrm.GPMSRM(data, spec, linear_algebra="state_space")
    text = str(err.value)
    for part in ("state_space", "J = 30000 grid points", f"T = {sizes.sub_steps} sub-steps",
                 f"M = {sizes.slots} node slots", f"S = {sizes.n_states} states", f"{need / 1e9:.2f} GB",
                 "available host memory", "block="):
        assert part in text, (part, text)
    model = msrm.GPMSRM(data, spec, linear_algebra="state_space", block=2)
    assert np.isfinite(model.log_likelihood(params))


def test_a_million_points_refused_under_a_limit(monkeypatch):
    monkeypatch.setenv(memory.ENV_LIMIT, str(int(0.5e9)))
    data, spec, _ = case(1_000_000)
    with pytest.raises(memory.MemoryGuardError, match=r"J = 1000000 grid points.*allowed \(MSRM_MEMORY_LIMIT_BYTES\)"):
        msrm.GPMSRM(data, spec, linear_algebra="state_space")
