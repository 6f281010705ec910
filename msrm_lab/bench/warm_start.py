"""Warm starts: the first value and gradient of a new process, with JAX's persistent compilation cache cold and
warm (notebook ``time_to_result``, experiment ``warm_start``).

Each measurement is a fresh Python process (``python -m msrm_lab.bench.warm_start``) that calls
``msrm.runtime.configure(platform="cpu", compilation_cache=DIR)``, builds the synthetic data, then times the first
call: the model build (``GPMSRM(...)``, NumPy preparation) and the first ``model.value_and_grad`` at the model's
start (tracing, compilation or loading from the cache, one evaluation). Per repeat, a new empty cache directory is
used by one process (``cache_state="cold"``: it compiles and writes the cache) and then by a second one
(``"warm"``: it loads what the first wrote). Cold and warm processes alternate, so a change in the machine's load
reaches both. The parent also times each process end to end (interpreter start, imports, data, first call).

Rows (``msrm_lab.bench.rows.make_row``): ``first_call_s``, ``first_call_cpu_s`` (the process's CPU seconds over
the first call, all its threads: less sensitive to other jobs than wall time), ``build_s``, ``value_and_grad_s``
and ``process_s`` (median over the repeats, with min, max and every time), ``cache_entries`` (files in the cache after the process), per linear algebra and factorization
method; ``warm_over_cold`` (median ratio). Target: the warm first call at most :data:`TARGET_WARM_S` seconds.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from msrm_lab.budget import skippable
from .rows import make_row

__all__ = ["NOTEBOOK", "EXPERIMENT", "PROFILES", "TARGET_WARM_S", "warm_start_rows", "first_call"]

NOTEBOOK = "time_to_result"
EXPERIMENT = "warm_start"
TARGET_WARM_S = 2.0

PROFILES: dict[str, dict[str, Any]] = {
    "smoke": dict(data_profile="tiny", n_features=4, n_factors=1, repeats=1, linear_algebras=("grouped",),
                  methods=("native",), timeout_s=300.0),
    # quick fits the book's per-notebook limit: the state-space model with the native factorization (cached on
    # every JAX version), two processes per cache state; the note profile runs every backend and method
    "quick": dict(data_profile="one-eighth", n_features=36, n_factors=3, repeats=2,
                  linear_algebras=("state_space",), methods=("native",), timeout_s=900.0),
    "note": dict(data_profile="one-eighth", n_features=3600, n_factors=3, repeats=3,
                 linear_algebras=("state_space", "grouped"), methods=("auto", "native"), timeout_s=1800.0),
}
PROFILES["full"] = PROFILES["note"]


def first_call(cfg: dict, linear_algebra: str, method: str, cache_dir: str | None) -> dict:
    """In this process: configure (CPU, float64, the cache), build the data, then time the model build and the
    first ``value_and_grad``. Returns seconds, the cache entries after, and the JAX version."""
    import msrm

    msrm.runtime.configure(platform="cpu", compilation_cache=cache_dir)
    import data_synth
    import jax

    from msrm.gp.model import GPMSRM

    data, truth = data_synth.synthetic_dataset(profile=cfg["data_profile"], n_features=cfg["n_features"], n_runs=1,
                                               n_factors=cfg["n_factors"], seed=0)
    before = len(os.listdir(cache_dir)) if cache_dir else 0
    c0, t0 = time.process_time(), time.perf_counter()
    model = GPMSRM(data, truth.spec, linear_algebra=linear_algebra, method=method)
    t1 = time.perf_counter()
    value, grad = model.value_and_grad(model.unconstrain(model.initial_params(seed=0)))
    t2, c2 = time.perf_counter(), time.process_time()
    return {"first_call_s": t2 - t0, "build_s": t1 - t0, "value_and_grad_s": t2 - t1, "value": float(value),
            "first_call_cpu_s": c2 - c0,
            "cache_entries_before": before, "cache_entries": len(os.listdir(cache_dir)) if cache_dir else 0,
            "jax": jax.__version__, "backend": jax.default_backend(), "num_params": int(model.num_params)}


def _child(cfg: dict, linear_algebra: str, method: str, cache_dir: str, timeout_s: float,
           python: str | None = None) -> dict:
    from msrm_lab.processes import kill_group

    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    arg = json.dumps({"cfg": {k: v for k, v in cfg.items() if isinstance(v, (str, int, float))},
                      "linear_algebra": linear_algebra, "method": method, "cache_dir": cache_dir})
    t0 = time.perf_counter()
    proc = subprocess.Popen([python or sys.executable, "-m", "msrm_lab.bench.warm_start", arg], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        raise RuntimeError(f"warm_start: the {linear_algebra}/{method} process ran past {timeout_s:.0f} s") from None
    wall = time.perf_counter() - t0
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"warm_start: the {linear_algebra}/{method} process failed (exit {proc.returncode}):\n"
                           + err[-2000:])
    return json.loads(lines[-1]) | {"process_s": wall}


@skippable(NOTEBOOK, EXPERIMENT, (("warm_over_cold", "x"),))
def warm_start_rows(profile: str = "quick", *, info: dict | None = None, repeats: int | None = None,
                    linear_algebras: tuple[str, ...] | None = None, methods: tuple[str, ...] | None = None,
                    python: str | None = None) -> list[dict]:
    """Rows of the warm-start experiment (module docstring) for one profile (``smoke``, ``quick``, ``note``).

    Args:
        info: ``execution_info()`` of this process for the rows (computed if omitted); each row also carries the
            child processes' JAX version and backend.
        repeats: processes per cache state and case (the profile's otherwise; the note's figures use 3 or more).
        linear_algebras, methods: override the profile's cases.
        python: the interpreter of the child processes (default: this one), e.g. an environment with another JAX
            version; the rows record the children's JAX version (``jax_child``).
    """
    from msrm_lab.provenance import execution_info

    if profile not in PROFILES:
        raise ValueError(f"profile must be one of {sorted(PROFILES)}, got {profile!r}")
    cfg = PROFILES[profile]
    reps = cfg["repeats"] if repeats is None else int(repeats)
    if reps < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats!r}")
    las = tuple(cfg["linear_algebras"] if linear_algebras is None else linear_algebras)
    meths = tuple(cfg["methods"] if methods is None else methods)
    info = info if info is not None else execution_info()
    rows: list[dict] = []
    for la in las:
        for method in meths:
            res: dict[str, list[dict]] = {"cold": [], "warm": []}
            with tempfile.TemporaryDirectory(prefix="msrm-warm-start-") as tmp:
                for i in range(reps):
                    cache = os.path.join(tmp, f"cache{i}")
                    for state in ("cold", "warm"):
                        res[state].append(_child(cfg, la, method, cache, cfg["timeout_s"], python))
            common = dict(profile=profile, data_profile=cfg["data_profile"], n_features=cfg["n_features"],
                          n_runs=1, K=cfg["n_factors"], linear_algebra=la, method=method, repeats=reps,
                          jax_child=res["cold"][0]["jax"], backend_child=res["cold"][0]["backend"],
                          num_params=res["cold"][0]["num_params"])
            med = {}
            for state, results in res.items():
                for metric in ("first_call_s", "first_call_cpu_s", "process_s", "build_s", "value_and_grad_s"):
                    v = [r[metric] for r in results]
                    if metric == "first_call_s":
                        med[state] = statistics.median(v)
                    rows.append(make_row(NOTEBOOK, EXPERIMENT, metric, statistics.median(v), "s", info=info,
                                         cache_state=state, min_s=min(v), max_s=max(v), times=v,
                                         target_s=TARGET_WARM_S if (state == "warm" and metric == "first_call_s")
                                         else None, **common))
                rows.append(make_row(NOTEBOOK, EXPERIMENT, "cache_entries",
                                     statistics.median([r["cache_entries"] for r in results]), "files", info=info,
                                     cache_state=state, **common))
            same = all(abs(r["value"] - res["cold"][0]["value"]) <= 1e-9 * max(1.0, abs(r["value"]))
                       for r in res["cold"] + res["warm"])
            rows.append(make_row(NOTEBOOK, EXPERIMENT, "warm_over_cold", med["warm"] / med["cold"], "x", info=info,
                                 same_value=bool(same), definition="median warm first call / median cold first call",
                                 **common))
    return rows


if __name__ == "__main__":
    _a = json.loads(sys.argv[1])
    print(json.dumps(first_call(_a["cfg"], _a["linear_algebra"], _a["method"], _a["cache_dir"])), flush=True)
