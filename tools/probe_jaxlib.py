"""Check whether the installed jaxlib still has the CPU-runtime problems that ``msrm.gp.linalg.compat`` works around.

Each probe is a small program run in its own subprocess under ``timeout`` (a stall or deadlock never returns, so
the only way to see it is a process that does not finish in time). A probe reports

- ``ok``: the program finished every repetition (the problem did not show),
- ``stalled``: it had compiled its program but was still running it after the time limit (the problem is
  there: one execution takes well under a second),
- ``slow_compile``: the time limit passed before the program had compiled (inconclusive: raise ``--timeout``),
- ``error``: it failed for another reason (its stderr tail is printed).

The probes, keyed like :data:`msrm.gp.linalg.compat.AFFECTED`:

``batched_cpu_lapack``
    Two forced host devices; ``jax.pmap`` of batched Cholesky and LU (slogdet) calls, so that both device threads
    are inside a batched LAPACK kernel at once (the kernel splits its batch over XLA's intra-op pool and waits).
``associative_scan``
    One device; ``lax.associative_scan`` whose combine is a batched dense solve (the parallel-in-time filter's
    pattern, :mod:`msrm.gp.state_space.parallel`): the scan's independent branches each enter batched LAPACK.
    This is the same workaround as ``batched_cpu_lapack`` (``compat.per_item_on_cpu``); it is probed on its own
    because it is the other program shape where the stall was seen.
``callback_one_cpu``
    The process pinned to one CPU (``taskset -c 0``); value and gradient of the LAPACK host callback
    (``quad_logdet(method="callback")``) under ``jax.jit`` and ``jax.vmap``.
``callback_across_devices``
    Two forced host devices; the LAPACK host callback inside ``jax.shard_map`` over a two-device mesh.
``state_space_parallel``
    The library's own parallel-in-time filter (``msrm.gp.state_space`` with ``parallel=True``) on a tiny
    dataset, with ``compat.BATCHED_CPU_LAPACK_CAN_DEADLOCK`` switched off so that every solve is batched: the
    program in which the ``associative_scan`` stall was seen.

A probe that does not stall on a jaxlib where the problem was seen proves nothing about the probe; run it on
both (e.g. ``.venv`` with jaxlib 0.10 and ``.venv312`` with the current jaxlib)::

    .venv/bin/python tools/probe_jaxlib.py [--timeout 180] [--only NAME ...] [--json out.json]

A jaxlib on which a probe reports ``ok`` (and the test suite passes with the workaround off) is the fixed version
to write into ``compat.AFFECTED``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

_PRELUDE = """
import time
import numpy as np
import jax
import jax.numpy as jnp
from jax import lax
jax.config.update("jax_enable_x64", True)
rng = np.random.default_rng(0)

def compiled():
    print("PROBE_COMPILED", flush=True)  # what follows is execution only: a kill after this line is a stall

def spd(*shape):
    n = shape[-1]
    a = rng.standard_normal(shape)
    return a @ np.swapaxes(a, -1, -2) / n + 2.0 * np.eye(n)
"""

PROBES = {
    "batched_cpu_lapack": dict(
        devices=2,
        pin_one_cpu=False,
        code="""
assert len(jax.devices()) == 2, jax.devices()
A = spd(2, 64, 24, 24)
f = jax.pmap(lambda a: jnp.linalg.slogdet(a)[1].sum() + jnp.linalg.cholesky(a).sum())
f(A).block_until_ready()
compiled()
for _ in range(30):
    f(A).block_until_ready()
""",
    ),
    "associative_scan": dict(
        devices=1,
        pin_one_cpu=False,
        code="""
S, N = 8, 128
A = jnp.asarray(0.3 * rng.standard_normal((N, S, S)))
C = jnp.asarray(spd(N, S, S))
eye = jnp.eye(S)

def combine(i, j):
    Ai, Ci = i
    Aj, Cj = j
    D = eye + Ci @ Cj
    return jnp.linalg.solve(D, Ai) @ Aj, Aj @ jnp.linalg.solve(D, Ci) @ jnp.swapaxes(Aj, -1, -2) + Cj

f = jax.jit(lambda a, c: lax.associative_scan(combine, (a, c))).lower(A, C).compile()
compiled()
for _ in range(20):
    jax.block_until_ready(f(A, C))
""",
    ),
    "callback_one_cpu": dict(
        devices=1,
        pin_one_cpu=True,
        code="""
from msrm.gp.linalg import quad_logdet
M = jnp.asarray(spd(16, 40, 40))
V = jnp.asarray(rng.standard_normal((16, 40, 3)))
def loss(m, v):
    q, ld, _ = jax.vmap(lambda a, b: quad_logdet(a, b, method="callback", guard_memory=False))(m, v)
    return (q + ld).sum()
vg = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(M, V).compile()
compiled()
for _ in range(30):
    jax.block_until_ready(vg(M, V))
""",
    ),
    "callback_across_devices": dict(
        devices=2,
        pin_one_cpu=False,
        code="""
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from msrm.gp.linalg import quad_logdet
assert len(jax.devices()) == 2, jax.devices()
mesh = Mesh(np.array(jax.devices()), ("runs",))
M = jax.device_put(jnp.asarray(spd(8, 40, 40)), NamedSharding(mesh, P("runs")))
V = jax.device_put(jnp.asarray(rng.standard_normal((8, 40, 3))), NamedSharding(mesh, P("runs")))
def local(m, v):
    q, ld, _ = jax.vmap(lambda a, b: quad_logdet(a, b, method="callback", guard_memory=False))(m, v)
    return jax.lax.psum((q + ld).sum(), "runs")
def loss(m, v):
    return jax.shard_map(local, mesh=mesh, in_specs=(P("runs"), P("runs")), out_specs=P(), check_vma=False)(m, v)
vg = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(M, V).compile()
compiled()
for _ in range(30):
    jax.block_until_ready(vg(M, V))
""",
    ),
    "state_space_parallel": dict(
        devices=1,
        pin_one_cpu=False,
        code="""
# the library's parallel-in-time filter with the per-item workaround switched off (every solve batched)
import data_synth
from msrm.gp.linalg import compat
from msrm.gp.state_space import loglik, prepare
compat.BATCHED_CPU_LAPACK_CAN_DEADLOCK = False
data, truth = data_synth.synthetic_dataset("tiny", n_features=3, n_runs=2, seed=1, kernel="matern52",
                                           pooling="individual", missing_fraction=0.2)
p = truth.params
theta = jax.tree_util.tree_map(jnp.asarray, {"loadings": p.loadings, "intercepts": p.intercepts,
                                             "noise_sd": p.noise_sd, "lengthscales": p.lengthscales,
                                             "response": p.response})
prepared = prepare(data, truth.spec, parallel=True)
f = jax.jit(lambda th, pr: loglik(th, pr)[0]).lower(theta, prepared).compile()
compiled()
for _ in range(20):
    jax.block_until_ready(f(theta, prepared))
""",
    ),
}


def run_probe(name: str, timeout_s: float, python: str = sys.executable) -> dict:
    """Run probe ``name`` in a subprocess; ``{"probe", "status", "seconds", "detail"}``."""
    if name not in PROBES:
        raise KeyError(f"probe: unknown probe {name!r}; known are {sorted(PROBES)}")
    if not timeout_s > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout_s!r}")
    p = PROBES[name]
    env = dict(os.environ, JAX_PLATFORMS="cpu", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("XLA_FLAGS", None)
    if p["devices"] > 1:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={p['devices']}"
    code = _PRELUDE + textwrap.dedent(p["code"]) + "\nprint('PROBE_DONE')\n"
    cmd = [python, "-c", code]
    if p["pin_one_cpu"]:
        if shutil.which("taskset") is None:
            return {"probe": name, "status": "error", "seconds": 0.0, "detail": "taskset is not installed"}
        cmd = ["taskset", "-c", "0"] + cmd
    # `timeout -s KILL` ends a deadlocked process that ignores SIGTERM; the Python timeout is a backstop
    cmd = ["timeout", "-s", "KILL", str(int(timeout_s))] + cmd
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s + 30)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        status = "stalled" if "PROBE_COMPILED" in out else "slow_compile"
        return {"probe": name, "status": status, "seconds": round(time.perf_counter() - t0, 2), "detail": ""}
    seconds = time.perf_counter() - t0
    if proc.returncode == 0 and "PROBE_DONE" in proc.stdout:
        status, detail = "ok", ""
    elif proc.returncode in (124, 137, -9):
        status, detail = ("stalled" if "PROBE_COMPILED" in proc.stdout else "slow_compile"), ""
    else:
        status, detail = "error", proc.stderr[-2000:]
    return {"probe": name, "status": status, "seconds": round(seconds, 2), "detail": detail}


def versions(python: str = sys.executable) -> dict:
    out = subprocess.run([python, "-c", "import jax, jaxlib.version, sys; print(jax.__version__, "
                          "jaxlib.version.__version__, sys.version.split()[0])"], capture_output=True, text=True)
    jax_v, jaxlib_v, py = out.stdout.split()
    return {"jax": jax_v, "jaxlib": jaxlib_v, "python": py}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--timeout", type=float, default=180.0,
                    help="seconds a probe may take, compilation included (default 180)")
    ap.add_argument("--only", nargs="+", choices=sorted(PROBES), help="run only these probes")
    ap.add_argument("--json", type=Path, help="also write the results to this file")
    args = ap.parse_args(argv)
    info = versions()
    results = []
    for name in args.only or list(PROBES):
        r = run_probe(name, args.timeout)
        results.append(r)
        print(f"{name:26s} {r['status']:8s} {r['seconds']:7.1f} s", flush=True)
        if r["detail"]:
            print(textwrap.indent(r["detail"], "    "), flush=True)
    report = {**info, "timeout_s": args.timeout, "results": results}
    print(json.dumps({k: v for k, v in report.items() if k != "results"}))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return 1 if any(r["status"] == "error" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
