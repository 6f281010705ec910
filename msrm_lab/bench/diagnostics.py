"""Posterior diagnostics at the note's scale: msrm.diagnostics beside ArviZ on the same draws, in one process.

The note's diagnostics phase ran ArviZ on 15 draws of 57,757 parameters. Here the implementations see identical
seeded draws (AR(1) chains whose autocorrelation varies by parameter, so ESS and
R-hat are not trivial): ``msrm.diagnostics.summarize`` on every parameter, ``arviz.summary`` on every parameter or,
where that would take too long for the profile, on a leading subset, reported per parameter. The subset also yields
the largest relative difference between the two (an agreement fingerprint, expected <= 1e-8). The first call of
``msrm.diagnostics``, which compiles its Numba kernels or loads them from Numba's cache, is recorded on its own
(``msrm_first_call_seconds``).

ArviZ 0.23 and 1.x both work. ArviZ 1.x's ``summary`` computes its tail ESS at other quantiles than the usual
5%/95% (Vehtari et al. 2021, ArviZ 0.23, ``msrm.diagnostics``); under 1.x the agreement fingerprint therefore
compares the tail ESS with ``arviz.ess(method="tail", prob=(0.05, 0.95))``, computed after the timed summary.

Slowly mixing chains make Geyer's autocorrelation sequence run long; case ``poor_mixing`` times the target shape on
the draw kinds of :data:`DRAW_KINDS` (``draw_kind``): AR(1) with coefficient 0.99, a random walk plus noise, and a
mixture of those with well mixed parameters. Case ``first_call`` times the very first call after installation in
fresh processes with an empty ``NUMBA_CACHE_DIR``: with the cache left empty (the kernels compiled inside the
call, ``msrm_first_call_cold_cache_seconds``), and after the install step's
``msrm.diagnostics.compile_kernels()`` (``install_compile_seconds``, then ``msrm_first_call_after_install_seconds``).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from msrm_lab.budget import skip_reason, skipped_rows
from .measure import PeakMemory
from .rows import make_row

__all__ = ["SIZES", "DRAW_KINDS", "ar1_draws", "draws_of_kind", "diagnostics_rows"]

NOTEBOOK = "gradient_nuts"

#: cases: (label, chains, draws); n_params parameters each; ArviZ on ``arviz_params`` of them (None: all)
SIZES: dict[str, dict[str, Any]] = {
    "smoke": dict(n_params=2_000, cases=[("target", 4, 100), ("note_case", 1, 15)], arviz_params=20),
    "quick": dict(n_params=57_757, cases=[("target", 4, 1000), ("note_case", 1, 15)], arviz_params=100),
    "note": dict(n_params=57_757, cases=[("target", 4, 1000), ("note_case", 1, 15)], arviz_params=1000),
    "full": dict(n_params=57_757, cases=[("target", 4, 1000), ("note_case", 1, 15)], arviz_params=None),
}
TARGET_S = 5.0  # the target: 57,757 parameters x 4 chains x 1000 draws in <= 5 s on the 2-core machine
FIRST_CALL_TARGET_S = 10.0  # the first call after installation, same size
#: the target shape again, on slowly mixing draws (case "poor_mixing"), and the first call (case "first_call");
#: per profile: (chains, draws), the number of parameters and whether case "first_call" runs (two fresh processes
#: that compile the kernels with an empty cache: the note's profiles only, the smoke and quick ones stay within
#: the notebook limits; quick times the slowly mixing kinds on fewer parameters, the rows say how many)
POOR_SIZES: dict[str, dict[str, Any]] = {
    "smoke": dict(n_params=2_000, chains=4, draws=100, arviz_params=20, first_call=False),
    "quick": dict(n_params=8_000, chains=4, draws=1000, arviz_params=50, first_call=False),
    "note": dict(n_params=57_757, chains=4, draws=1000, arviz_params=300, first_call=True),
    "full": dict(n_params=57_757, chains=4, draws=1000, arviz_params=None, first_call=True),
}
#: draw kinds of case "poor_mixing" (see :func:`draws_of_kind`); the first-call case uses the mixture
DRAW_KINDS = ("ar1_0.99", "random_walk_noise", "mixture")


def ar1_draws(chains: int, draws: int, n_params: int, seed: int = 0) -> np.ndarray:
    """(chains, draws, n_params) AR(1) draws, coefficient phi_p uniform in [0, 0.9] per parameter, unit variance."""
    rng = np.random.default_rng(seed)
    phi = rng.uniform(0.0, 0.9, n_params)
    scale = np.sqrt(1.0 - phi**2)
    x = np.empty((chains, draws, n_params))
    x[:, 0] = rng.standard_normal((chains, n_params))
    for t in range(1, draws):
        x[:, t] = phi * x[:, t - 1] + scale * rng.standard_normal((chains, n_params))
    return x


def _random_walk_noise(chains: int, draws: int, n_params: int, rng) -> np.ndarray:
    walk = np.cumsum(rng.standard_normal((chains, draws, n_params)), axis=1)
    walk *= 0.1
    walk += rng.standard_normal((chains, draws, n_params))
    return walk


def draws_of_kind(kind: str, chains: int, draws: int, n_params: int, seed: int = 0) -> np.ndarray:
    """(chains, draws, n_params) seeded draws of one kind.

    ``ar1_mixed``: :func:`ar1_draws` (well mixed); ``ar1_0.99``: AR(1) with coefficient 0.99, unit variance;
    ``random_walk_noise``: a Gaussian random walk with steps of sd 0.1 plus unit Gaussian noise; ``mixture``: a
    third of the parameters of each of these three, at shuffled positions.
    """
    if kind == "ar1_mixed":
        return ar1_draws(chains, draws, n_params, seed=seed)
    rng = np.random.default_rng([seed, 99])
    if kind == "ar1_0.99":
        phi = 0.99
        x = np.empty((chains, draws, n_params))
        x[:, 0] = rng.standard_normal((chains, n_params))
        for t in range(1, draws):
            x[:, t] = phi * x[:, t - 1] + np.sqrt(1.0 - phi**2) * rng.standard_normal((chains, n_params))
        return x
    if kind == "random_walk_noise":
        return _random_walk_noise(chains, draws, n_params, rng)
    if kind == "mixture":
        k = n_params // 3
        parts = [draws_of_kind("ar1_0.99", chains, draws, k, seed),
                 draws_of_kind("random_walk_noise", chains, draws, k, seed),
                 ar1_draws(chains, draws, n_params - 2 * k, seed=seed)]
        x = np.concatenate(parts, axis=2)
        return np.ascontiguousarray(x[:, :, rng.permutation(n_params)])
    raise ValueError(f"kind must be one of {('ar1_mixed',) + DRAW_KINDS}, got {kind!r}")


_FIRST_CALL = """
import json, sys, time
from msrm_lab.bench.diagnostics import draws_of_kind
kind, chains, draws, n_params, seed = sys.argv[1], *map(int, sys.argv[2:6])
x = draws_of_kind(kind, chains, draws, n_params, seed)
t0 = time.perf_counter()
import msrm.diagnostics as d
t1 = time.perf_counter()
c1 = time.process_time()
d.summarize(x)
c2 = time.process_time()
t2 = time.perf_counter()
print(json.dumps({"import_seconds": t1 - t0, "seconds": t2 - t1, "cpu_seconds": c2 - c1}))
"""
_COMPILE = "import msrm.diagnostics as d; d.compile_kernels()"


def _subprocess(args: list[str], cache_dir: str) -> tuple[float, str]:
    """Run ``python args`` with ``NUMBA_CACHE_DIR=cache_dir`` and this checkout importable: (wall seconds, stdout)."""
    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir, PYTHONPATH=path)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, check=True)
    return time.perf_counter() - t0, out.stdout


def first_call_seconds(kind: str, chains: int, draws: int, n_params: int, *, seed: int = 0,
                       install: bool) -> dict[str, float]:
    """The first ``summarize`` of a fresh process on draws of ``kind`` with an empty Numba cache: compiled inside
    the call (``install=False``), or after the install step ``compile_kernels()`` ran in another fresh process
    (``install=True``, whose wall time is ``install_compile_seconds``). Returns the seconds of the call and of
    ``import msrm.diagnostics``, and the process's CPU seconds in the call (``cpu_seconds``, which a shared
    machine's load inflates less than the wall time)."""
    with tempfile.TemporaryDirectory(prefix="msrm-numba-cache-") as cache:
        res: dict[str, float] = {}
        if install:
            res["install_compile_seconds"], _ = _subprocess(["-c", _COMPILE], cache)
        _, out = _subprocess(["-c", _FIRST_CALL, kind, str(chains), str(draws), str(n_params), str(seed)], cache)
        res.update(json.loads(out.strip().splitlines()[-1]))
        return res


def _arviz_1() -> bool:
    import arviz as az

    return int(az.__version__.split(".")[0]) >= 1


def _arviz_summary(x: np.ndarray):
    import logging

    import arviz as az

    idata = az.from_dict({"posterior": {"x": x}}) if _arviz_1() else az.from_dict(posterior={"x": x})
    log = logging.getLogger("arviz")
    level = log.level
    log.setLevel(logging.ERROR)  # one chain: ArviZ logs a shape warning per parameter (R-hat is NaN)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return az.summary(idata, round_to="none")
    finally:
        log.setLevel(level)


def _arviz_tail_ess(x: np.ndarray) -> np.ndarray:
    """ArviZ 1.x's tail ESS of every parameter at the 5% and 95% quantiles (the definition of the other columns)."""
    import arviz as az

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return np.asarray(az.ess(x, method="tail", prob=(0.05, 0.95)), dtype=float).reshape(-1)


def diagnostics_rows(profile: str = "quick", *, info: dict | None = None, seed: int = 0,
                     first_call: bool = True) -> list[dict]:
    """Rows of experiment ``diagnostics`` for every case of the profile: the well mixed cases of :data:`SIZES`,
    case ``poor_mixing`` for each of :data:`DRAW_KINDS` and, with ``first_call``, case ``first_call``."""
    from msrm import diagnostics as diag
    from msrm.runtime import blas_threads
    from msrm_lab.provenance import execution_info

    if profile not in SIZES:
        raise ValueError(f"profile must be one of {sorted(SIZES)}, got {profile!r}")
    cfg = SIZES[profile]
    poor = POOR_SIZES[profile]
    info = info if info is not None else execution_info()
    P = cfg["n_params"]
    rows: list[dict] = []
    cases = [(case, "ar1_mixed", chains, draws, P, cfg["arviz_params"]) for case, chains, draws in cfg["cases"]]
    cases += [("poor_mixing", kind, poor["chains"], poor["draws"], poor["n_params"], poor["arviz_params"])
              for kind in DRAW_KINDS]
    for case, kind, chains, draws, n_params, arviz_params in cases:
        common = dict(case=case, draw_kind=kind, n_params=n_params, chains=chains, draws=draws, profile=profile,
                      num_threads=blas_threads(), fft_library=diag.fft_library())
        reason = skip_reason()
        if reason is not None:
            rows += skipped_rows(NOTEBOOK, "diagnostics", reason, info=info,
                                 metrics=(("msrm_seconds", "s"), ("arviz_seconds", "s")), **common)
            continue
        x = draws_of_kind(kind, chains, draws, n_params, seed=seed)

        def row(metric, value, unit, **extra):
            rows.append(make_row(NOTEBOOK, "diagnostics", metric, value, unit, info=info, **common, **extra))

        def agreement(metric, got, want, **extra):
            """Largest relative difference of the ESS, MCSE and R-hat columns, or an error row when the two
            disagree on which entries are finite."""
            worst = 0.0
            for col in ("mcse_mean", "mcse_sd", "ess_bulk", "ess_tail", "r_hat"):
                a, b = got[col].to_numpy(dtype=float), want[col].to_numpy(dtype=float)
                ok = np.isfinite(a) & np.isfinite(b)
                if not np.array_equal(np.isfinite(a), np.isfinite(b)):
                    worst = np.inf
                elif ok.any():
                    worst = max(worst, float(np.max(np.abs(a[ok] - b[ok]) / np.abs(b[ok]))))
            if np.isfinite(worst):
                row(metric, worst, "", **extra)
            else:
                rows.append(make_row(NOTEBOOK, "diagnostics", metric, None, "", status="error", info=info,
                                     **common, **extra, error="NaN patterns differ"))

        impl = "msrm.diagnostics"
        t0 = time.perf_counter()
        diag.summarize(x[:, :, : min(n_params, 256)])  # warm the code paths (kernel compilation or cache, FFTs)
        row("msrm_first_call_seconds", time.perf_counter() - t0, "s", implementation=impl,
            warm_params=min(n_params, 256))
        with PeakMemory() as mem:
            t0 = time.perf_counter()
            ours = diag.summarize(x)
            ours_s = time.perf_counter() - t0
        row("msrm_seconds", ours_s, "s", implementation=impl)
        row("msrm_seconds_per_param", ours_s / n_params, "s", implementation=impl)
        if mem.delta_bytes is not None:
            row("msrm_peak_memory_delta", mem.delta_bytes, "bytes", implementation=impl, memory_method=mem.method)
        if case in ("target", "poor_mixing"):
            row("msrm_seconds_over_target", ours_s / TARGET_S, "x", target_s=TARGET_S)

        n_az = n_params if arviz_params is None else min(n_params, arviz_params)
        _arviz_summary(x[:, :, :2])  # warm ArviZ too (lazy imports, ufunc set-up)
        t0 = time.perf_counter()
        ref = _arviz_summary(x[:, :, :n_az])
        az_s = time.perf_counter() - t0
        if _arviz_1():
            ref["ess_tail"] = _arviz_tail_ess(x[:, :, :n_az])
        row("arviz_seconds", az_s, "s", implementation="arviz.summary", arviz_params=n_az)
        row("arviz_seconds_per_param", az_s / n_az, "s", implementation="arviz.summary", arviz_params=n_az)
        row("arviz_projected_seconds_all_params", az_s / n_az * n_params, "s", implementation="arviz.summary",
            arviz_params=n_az, projected=n_az < n_params)
        row("speedup_per_param", (az_s / n_az) / (ours_s / n_params), "x", arviz_params=n_az)
        agreement("max_rel_diff_vs_arviz", ours.iloc[:n_az], ref, arviz_params=n_az)
        del x, ours
    if first_call and poor["first_call"]:
        rows += _first_call_rows(profile, info, seed)
    return rows


def _first_call_rows(profile: str, info: dict, seed: int) -> list[dict]:
    """Case ``first_call``: fresh processes, empty Numba cache, the mixture at the target shape."""
    from msrm.runtime import blas_threads

    poor = POOR_SIZES[profile]
    shape = dict(chains=poor["chains"], draws=poor["draws"], n_params=poor["n_params"])
    common = dict(case="first_call", draw_kind="mixture", profile=profile, num_threads=blas_threads(), **shape,
                  implementation="msrm.diagnostics", numba_cache="empty NUMBA_CACHE_DIR")
    rows = []
    cold = first_call_seconds("mixture", seed=seed, install=False, **shape)
    rows.append(make_row(NOTEBOOK, "diagnostics", "msrm_first_call_cold_cache_seconds", cold["seconds"], "s",
                         info=info, import_seconds=cold["import_seconds"], cpu_seconds=cold["cpu_seconds"], **common))
    warm = first_call_seconds("mixture", seed=seed, install=True, **shape)
    rows.append(make_row(NOTEBOOK, "diagnostics", "install_compile_seconds", warm["install_compile_seconds"], "s",
                         info=info, command=f"python -c {_COMPILE!r}", **common))
    rows.append(make_row(NOTEBOOK, "diagnostics", "msrm_first_call_after_install_seconds", warm["seconds"], "s",
                         info=info, import_seconds=warm["import_seconds"], cpu_seconds=warm["cpu_seconds"],
                         target_s=FIRST_CALL_TARGET_S, **common))
    rows.append(make_row(NOTEBOOK, "diagnostics", "msrm_first_call_over_target",
                         warm["seconds"] / FIRST_CALL_TARGET_S, "x", info=info, target_s=FIRST_CALL_TARGET_S, **common))
    return rows
