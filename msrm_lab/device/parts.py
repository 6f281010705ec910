"""The parts of the device run and their sizes per profile.

Each part is a generator: it yields lists of results rows (:func:`msrm_lab.bench.rows.make_row`, each carrying
``execution_info``) as it finishes them, and the child process that runs it appends every batch to the part's
``rows.jsonl`` at once (atomically), so a part stopped by its time budget keeps the rows it finished. A part that
finds a problem yields its rows first, then raises :class:`PartFailed`.

==============  =================================================================================================
part            what it measures (the benchmark functions of :mod:`msrm_lab.bench`, called directly)
==============  =================================================================================================
environment     the platform JAX runs on against the one asked for, float64, matmul precision, the packages the
                other parts import (a missing one fails the part, the others still run)
cuda_tests      ``pytest -m cuda tests/test_cuda.py`` (junit XML and the pytest log beside the rows)
linalg          float64 matmul, Cholesky, LU, Cholesky-inverse sweep; float32 matmul at precision ``highest``
                and ``default`` beside it (measured on a GPU only)
grouped         grouped ``value_and_grad`` against its floor at each K of the profile
feature_sweep   grouped ``value_and_grad`` against the brain feature count
state_space     sequential against parallel (associative) scan, both XLA, at each length of the profile
nuts            objective, gradient and a short NUTS run with one chain and with two vectorised chains
==============  =================================================================================================
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

__all__ = ["PARTS", "PROFILES", "PartFailed", "run_part", "FAIL_ENV"]

# comma-separated part names that raise at their start, or ``NAME:hang`` for one that never finishes (the
# driver's failure and time-budget paths are tested with them)
FAIL_ENV = "MSRM_DEVICE_FAIL"

PARTS = ("environment", "cuda_tests", "linalg", "grouped", "feature_sweep", "state_space", "nuts")

# Per profile: which table of each benchmark module a part uses, the state-space comparison's sizes, the total
# time budget and each part's share of it (seconds; a part is stopped at its share or at what is left).
PROFILES: dict[str, dict[str, Any]] = {
    # every part at the smallest sizes, on the CPU, to check the whole run before it meets a GPU
    "smoke": dict(linalg="smoke", gp="smoke", nuts="smoke",
                  state_space=dict(profile="tiny", n_features=2, K=1, lengths=(0.5,), repeats=1),
                  budget_s=1500.0,
                  part_budget_s=dict(environment=60, cuda_tests=120, linalg=120, grouped=200, feature_sweep=200,
                                     state_space=400, nuts=400)),
    # one H200 in at most 8 minutes: the note's one-eighth case (3600 features)
    "device": dict(linalg="device", gp="device", nuts="device",
                   state_space=dict(profile="one-eighth", n_features=3600, K=3, lengths=(1.0, 8.0), repeats=3),
                   budget_s=480.0,
                   part_budget_s=dict(environment=20, cuda_tests=150, linalg=30, grouped=60, feature_sweep=40,
                                      state_space=90, nuts=90)),
}

# modules the parts import: the environment part checks them (name -> what needs it)
REQUIRED_MODULES = {"jax": "every part", "numpyro": "nuts", "arviz": "nuts (InferenceData)",
                    "xarray": "nuts (InferenceData)", "scipy": "every part", "pandas": "diagnostics",
                    "threadpoolctl": "execution_info", "pytest": "cuda_tests"}


class PartFailed(RuntimeError):
    """A part ran but found a problem (its rows are already written); the message says what."""


def _injected(name: str) -> None:
    wanted = {p.strip() for p in os.environ.get(FAIL_ENV, "").split(",") if p.strip()}
    if f"{name}:hang" in wanted:
        while True:  # stopped by the driver at the part's budget
            time.sleep(1.0)
    if name in wanted:
        raise PartFailed(f"failure injected through {FAIL_ENV}={os.environ[FAIL_ENV]!r}")


def _info():
    from msrm_lab.provenance import execution_info

    return execution_info(include_jax=True)


# ---------------------------------------------------------------------------------------------------- parts
def environment(profile: str, platform: str, **_) -> Iterator[list[dict]]:
    """Checks, one row each (value 1 = passed), then :class:`PartFailed` naming the failed ones."""
    import importlib.util

    import jax

    from msrm_lab.bench.rows import make_row

    info = _info()
    backend = jax.default_backend()
    checks = {
        "platform": (backend == ("gpu" if platform == "cuda" else "cpu"), f"asked {platform}, JAX runs {backend}"),
        "float64": (bool(jax.config.jax_enable_x64), "jax_enable_x64"),
        "matmul_precision_highest": (jax.config.jax_default_matmul_precision == "highest",
                                     f"jax_default_matmul_precision={jax.config.jax_default_matmul_precision!r}"),
    }
    if platform == "cuda":
        gpus = [d for d in jax.devices() if d.platform == "gpu"]
        checks["one_gpu"] = (len(gpus) >= 1, f"{len(gpus)} GPU device(s): {[d.device_kind for d in gpus]}")
        stats = gpus[0].memory_stats() if gpus else None
        checks["device_memory_stats"] = (bool(stats) and "bytes_limit" in stats, "device.memory_stats() limit")
    for mod, why in REQUIRED_MODULES.items():
        checks[f"module_{mod}"] = (importlib.util.find_spec(mod) is not None, f"import {mod} (needed by {why})")
    rows = [make_row("device", "environment", name, float(ok), "pass", info=info, check=name, detail=detail,
                     profile=profile) for name, (ok, detail) in checks.items()]
    yield rows
    failed = [f"{name} ({detail})" for name, (ok, detail) in checks.items() if not ok]
    if failed:
        raise PartFailed("environment checks failed: " + "; ".join(failed))


def cuda_tests(profile: str, platform: str, folder: Path, timeout_s: float, **_) -> Iterator[list[dict]]:
    """``pytest -m cuda`` in a child process; junit XML and log into ``folder``; one row per count."""
    from msrm_lab.bench.rows import make_row
    from msrm_lab.paths import repo_root

    root = repo_root()
    junit = folder / "junit.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", f"--junitxml={junit}",
           str(root / "tests" / "test_cuda.py")]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=max(timeout_s - 5.0, 5.0))
        rc, log = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, log = None, f"{exc.stdout or ''}{exc.stderr or ''}\npytest stopped after {exc.timeout:.0f} s"
        log = log if isinstance(log, str) else str(log)
    wall = time.perf_counter() - t0
    from msrm import atomic

    atomic.write_text(folder / "pytest.log", log)
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    if junit.is_file():
        suites = ET.parse(junit).getroot()
        for suite in ([suites] if suites.tag == "testsuite" else list(suites)):
            for key in counts:
                counts[key] += int(suite.get(key, 0))
    info = _info()
    common = dict(profile=profile, command=" ".join(cmd[1:]), returncode=rc, wall_s=wall)
    yield [make_row("device", "cuda_tests", key, float(n), "count", info=info, **common) for key, n in counts.items()]
    if rc != 0:
        tail = log.strip().splitlines()[-1] if log.strip() else ""
        raise PartFailed(f"pytest -m cuda exited with {rc}: {tail}")


def linalg(profile: str, cfg: dict, **_) -> Iterator[list[dict]]:
    from msrm_lab.bench import linalg as bench

    table = bench.PROFILES[cfg["linalg"]]
    for n in table["sizes"]:
        yield (bench.raw_linalg_rows([n], table["repeats"], profile=profile)
               + bench.float32_rows([n], table["repeats"], profile=profile))


def grouped(profile: str, cfg: dict, **_) -> Iterator[list[dict]]:
    from msrm_lab.bench import gp

    table = gp.PROFILES[cfg["gp"]]
    info = _info()
    for K in table["factors"]:
        yield gp.value_and_grad_rows(dict(table, factors=(K,)), profile, info, table["repeats"])


def feature_sweep(profile: str, cfg: dict, **_) -> Iterator[list[dict]]:
    from msrm_lab.bench import gp

    table = gp.PROFILES[cfg["gp"]]
    yield gp.feature_sweep_rows(table, profile, _info(), table["repeats"])


def state_space(profile: str, cfg: dict, **_) -> Iterator[list[dict]]:
    """Sequential against associative scan (both XLA, ``method="native"``) at each length; value+grad medians,
    their ratio and the two scans' agreement (value and gradient, relative)."""
    import data_synth
    import msrm
    from msrm_lab.bench.measure import warm_median
    from msrm_lab.bench.rows import make_row

    sz = cfg["state_space"]
    info = _info()
    for scale in sz["lengths"]:
        data, truth = data_synth.synthetic_dataset(sz["profile"], n_features=sz["n_features"], n_factors=sz["K"],
                                                   duration_scale=float(scale), seed=0)
        base = dict(K=sz["K"], duration_scale=float(scale), n_features=sz["n_features"], data_profile=sz["profile"],
                    profile=profile)
        rows, med, out = [], {}, {}
        for parallel in (False, True):
            model = msrm.GPMSRM(data, truth.spec, "state_space", method="native", parallel=parallel)
            u = model.unconstrain(truth.params)
            t0 = time.perf_counter()
            out[parallel] = model.value_and_grad(u)
            first = time.perf_counter() - t0
            med[parallel], samples = warm_median(lambda: model.value_and_grad(u), repeats=sz["repeats"], warmup=0)
            extra = dict(base, parallel=parallel)
            rows.append(make_row("state_space", "parallel", "median_s", med[parallel], "s", info=info,
                                 samples=samples, **extra))
            rows.append(make_row("state_space", "parallel", "first_call_s", first, "s", info=info, **extra))
            del model
        (v0, g0), (v1, g1) = out[False], out[True]
        rows.append(make_row("state_space", "parallel", "parallel_over_sequential", med[True] / med[False], "x",
                             info=info, **base))
        rows.append(make_row("state_space", "parallel", "relative_difference", abs(v1 - v0) / abs(v0), "",
                             info=info, **base))
        rows.append(make_row("state_space", "parallel", "grad_max_rel_difference",
                             float(np.max(np.abs(g1 - g0)) / max(float(np.max(np.abs(g0))), 1e-300)), "",
                             info=info, **base))
        yield rows


def nuts(profile: str, cfg: dict, **_) -> Iterator[list[dict]]:
    from msrm_lab.bench import nuts as bench

    yield bench.nuts_rows(cfg["nuts"], info=_info())


_FUNCTIONS: dict[str, Callable[..., Iterator[list[dict]]]] = {
    "environment": environment, "cuda_tests": cuda_tests, "linalg": linalg, "grouped": grouped,
    "feature_sweep": feature_sweep, "state_space": state_space, "nuts": nuts,
}


def run_part(name: str, profile: str, platform: str, folder: Path, timeout_s: float,
             write: Callable[[list[dict]], None]) -> int:
    """Run part ``name`` of ``profile`` in this process (JAX already configured), handing each batch of rows to
    ``write`` as soon as it is finished. Returns the number of rows; raises what the part raises."""
    if name not in _FUNCTIONS:
        raise ValueError(f"unknown part {name!r}; parts are {list(PARTS)}")
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; profiles are {sorted(PROFILES)}")
    _injected(name)
    count = 0
    for rows in _FUNCTIONS[name](profile=profile, platform=platform, cfg=PROFILES[profile], folder=folder,
                                 timeout_s=timeout_s):
        write(rows)
        count += len(rows)
    return count
