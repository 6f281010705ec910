"""BLAS threads and the CPU LAPACK callback (notebook ``04_threads``, stem ``threads``).

At one dimension n (2727 = the one-eighth grouped problem at K = 3 in the ``note`` profile), side by side in
one process, float64:

====================  =================================================================================
experiment            what runs
====================  =================================================================================
direct_potrf_potri    SciPy ``dpotrf`` + ``dpotri`` called directly under ``threadpool_limits``
callback_potrf_potri  the same two calls inside ``jax.pure_callback`` in a jitted JAX function
                      (:func:`msrm_lab.bench.linalg.potrf_potri_callback`)
quad_logdet_callback  ``msrm.gp.linalg.quad_logdet`` value + gradient in M, LAPACK callback path
quad_logdet_native    ``quad_logdet`` value + gradient, native path
native_chol_inverse   ``jnp.linalg.cholesky`` then ``cho_solve`` against the identity
plain_grad_logdet     plain JAX reverse mode through ``cholesky``: ``grad(2 sum log diag chol(M))``
====================  =================================================================================

On the CPU, jaxlib runs its own Cholesky, triangular solves and LU through SciPy's LAPACK (``cython_lapack``),
that is through the same OpenBLAS the callback uses, so the BLAS thread limit reaches the native rows too (XLA's
own pool, fixed at start-up, still runs the products and elementwise work). Every experiment is therefore timed
at each BLAS thread count from 1 to the physical cores and once oversubscribed (2 x cores,
``oversubscribed=True``; whether the runtime warned is recorded, not shown). Within one setting the functions
are timed round-robin, so a change in background load hits all of them alike. Ratio rows per setting: plain JAX
gradient / ``quad_logdet`` value+gradient (callback and native), ``quad_logdet`` value+gradient / direct
POTRF+POTRI (the floor), and callback / direct POTRF+POTRI. Every row carries ``execution_info`` (BLAS library,
kernel, version).

Two more experiments follow (:func:`run`): ``rmsrm_contention`` (:func:`contention_rows`, R-MSRM at OpenBLAS's
default count, one thread and the count of :func:`msrm.runtime.step_blas_threads`, idle and beside a competing
process) and ``gp_threads`` (:func:`gp_threads_rows`, GP-MSRM's value and gradient at K = 3, grouped and state
space, at the automatic count and at one and two threads, alternating calls, with the count the rule chose and the
load average at each call).
"""
from __future__ import annotations

import os
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from msrm.runtime import callback_threads, physical_cores

from msrm_lab.budget import seconds_left, skip_reason, skipped_rows
from msrm_lab.provenance import execution_info
from .linalg import peak_rss_delta, potrf_potri_callback, spd_matrix
from .measure import block
from .rows import make_row, write_rows

__all__ = ["NOTEBOOK", "PROFILES", "thread_settings", "threads_rows", "run", "contention_rows",
           "CONTENTION_PROFILES", "CONTENTION_EXPERIMENT", "CONTENTION_TARGET", "gp_threads_rows", "gp_threads_condition",
           "GP_PROFILES",
           "GP_EXPERIMENT", "GP_SETTINGS"]

NOTEBOOK = "threads"

PROFILES: dict[str, dict[str, Any]] = {
    "smoke": {"n": 200, "repeats": 3, "budget_s": 30.0},
    "quick": {"n": 1000, "repeats": 3, "budget_s": 60.0},
    "note": {"n": 2727, "repeats": 5, "budget_s": 400.0},
}
PROFILES["full"] = PROFILES["note"]


def thread_settings(cores: int | None = None) -> list[tuple[int, bool]]:
    """``[(threads, oversubscribed)]``: 1..cores, then 2 x cores marked oversubscribed."""
    cores = physical_cores() if cores is None else int(cores)
    return [(t, False) for t in range(1, cores + 1)] + [(2 * cores, True)]


def _direct(M: np.ndarray):
    from scipy.linalg import lapack

    U, info = lapack.dpotrf(M, lower=0, clean=1, overwrite_a=0)
    if info != 0:
        raise RuntimeError(f"dpotrf failed (info={info})")
    return lapack.dpotri(U, lower=0, overwrite_c=1)[0]


def _interleaved(fns: dict[str, Any], repeats: int, budget_s: float) -> dict[str, tuple[float, list[float]]]:
    """Warm every function once, then time them in turn for ``repeats`` rounds (so load changes hit all of them
    alike); stop after a round once ``budget_s`` seconds have passed. Returns ``{name: (median, times)}``."""
    for fn in fns.values():
        block(fn())
    times: dict[str, list[float]] = {k: [] for k in fns}
    start = time.perf_counter()
    for _ in range(max(1, repeats)):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            block(fn())
            times[name].append(time.perf_counter() - t0)
        if time.perf_counter() - start > budget_s:
            break
    return {k: (statistics.median(v), v) for k, v in times.items()}


def threads_rows(n: int, repeats: int = 3, *, settings=None, profile: str = "quick", seed: int = 0,
                 budget_s: float = 300.0) -> list[dict]:
    """All rows of the thread/callback comparison at dimension ``n`` (see the module docstring).

    Functions of one setting are timed round-robin (:func:`_interleaved`); a setting stops repeating after
    ``budget_s`` seconds (the oversubscribed one can be very slow on a loaded machine) and runs at most two
    rounds; its rows say how many samples they hold (``repeats``).
    """
    import jax
    import jax.numpy as jnp
    import jax.scipy.linalg as jsl
    from threadpoolctl import threadpool_limits

    from msrm.gp import linalg

    if not jax.config.jax_enable_x64:
        raise ValueError("threads_rows: float64 is the contract; call msrm.runtime.enable_x64() first")
    n = int(n)
    settings = thread_settings() if settings is None else list(settings)
    info = execution_info()
    M_np = np.asfortranarray(spd_matrix(n, seed))
    M = jnp.asarray(np.ascontiguousarray(M_np))
    V = jnp.asarray(np.random.default_rng(seed).normal(size=(n, 1)))

    def vg(method):
        return jax.jit(jax.value_and_grad(lambda Mx: sum(linalg.quad_logdet(Mx, V, method=method)[:2])))

    callback_pp = jax.jit(potrf_potri_callback)
    quad_cb = vg("callback")
    rows: list[dict] = []

    def emit(experiment, fn, med, times, *, peak=True, **params):
        rows.append(make_row(NOTEBOOK, experiment, "median_s", med, "s", info=info, n=n, repeats=len(times),
                             times=times, peak_rss_delta_bytes=peak_rss_delta(fn) if peak else None,
                             profile=profile, **params))

    native_inv = jax.jit(lambda A: jsl.cho_solve(jsl.cho_factor(A, lower=True), jnp.eye(n, dtype=A.dtype)))
    plain = jax.jit(jax.grad(lambda A: 2.0 * jnp.sum(jnp.log(jnp.diagonal(jnp.linalg.cholesky(A))))))
    quad_native = vg("native")
    fns = {
        "direct_potrf_potri": lambda: _direct(M_np),
        "callback_potrf_potri": lambda: callback_pp(M),
        "quad_logdet_callback": lambda: quad_cb(M),
        "quad_logdet_native": lambda: quad_native(M),
        "native_chol_inverse": lambda: native_inv(M),
        "plain_grad_logdet": lambda: plain(M),
    }
    by_threads: dict[int, dict[str, Any]] = {}
    for threads, over in settings:
        first = len(rows)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with threadpool_limits(limits=threads, user_api="blas"), callback_threads(threads):
                res = _interleaved(fns, min(repeats, 2) if over else repeats, budget_s)
                for name, fn in fns.items():
                    emit(name, fn, *res[name], peak=not over, threads=threads, oversubscribed=over)
        if over:
            warned = any("oversubscri" in str(w.message) for w in caught)
            for r in rows[first:]:
                r["params"]["oversubscription_warning"] = warned
        by_threads[threads] = {k: v[0] for k, v in res.items()} | {"oversubscribed": over}

    for t, v in by_threads.items():
        common = dict(info=info, n=n, threads=t, oversubscribed=v["oversubscribed"], profile=profile)
        rows.append(make_row(NOTEBOOK, "speedup_vs_plain_grad", "ratio",
                             v["plain_grad_logdet"] / v["quad_logdet_callback"], "x", **common,
                             definition="plain JAX grad(logdet via cholesky) / quad_logdet callback value+grad"))
        rows.append(make_row(NOTEBOOK, "speedup_vs_plain_grad_native", "ratio",
                             v["plain_grad_logdet"] / v["quad_logdet_native"], "x", **common,
                             definition="plain JAX grad(logdet via cholesky) / quad_logdet native value+grad"))
        rows.append(make_row(NOTEBOOK, "value_grad_over_floor", "ratio",
                             v["quad_logdet_callback"] / v["direct_potrf_potri"], "x", **common,
                             definition="quad_logdet callback value+grad / direct POTRF+POTRI, same threads"))
        rows.append(make_row(NOTEBOOK, "callback_overhead", "ratio",
                             v["callback_potrf_potri"] / v["direct_potrf_potri"], "x", **common,
                             definition="POTRF+POTRI through pure_callback / direct, same threads"))
    return rows


def run(profile: str = "quick", out_dir: str | Path | None = None, *, n: int | None = None,
        repeats: int | None = None, contention: bool = True, gp: bool = True,
        gp_pythons: tuple[str, ...] = ()) -> list[dict]:
    """All rows of the ``threads`` notebook for one profile (written to ``out_dir/rows.jsonl`` if given): the
    callback comparison, then (``contention``) R-MSRM under contention (:func:`contention_rows`), then (``gp``)
    GP-MSRM's value and gradient at the automatic and fixed BLAS counts (:func:`gp_threads_rows`), in this
    interpreter and then in each of ``gp_pythons`` (other environments, e.g. :func:`oldest_python`'s)."""
    if profile not in PROFILES:
        raise ValueError(f"profile must be one of {sorted(PROFILES)}, got {profile!r}")
    cfg = PROFILES[profile]
    rows = threads_rows(cfg["n"] if n is None else int(n), cfg["repeats"] if repeats is None else int(repeats),
                        profile=profile, budget_s=cfg["budget_s"])
    if contention:
        rows += contention_rows(profile)
    if gp:
        rows += gp_threads_rows(profile)
        for python in gp_pythons:
            rows += gp_threads_rows(profile, python=python)
    if out_dir is not None:
        write_rows(Path(out_dir) / "rows.jsonl", rows, append=False)
    return rows


# ---- R-MSRM under contention: BLAS default, one thread and the rule of msrm.runtime.step_blas_threads

CONTENTION_EXPERIMENT = "rmsrm_contention"
# the rule's target: under load the chosen setting within this factor of one thread
CONTENTION_TARGET = 1.5

CONTENTION_PROFILES: dict[str, dict[str, Any]] = {
    "smoke": {"data_profile": "tiny", "n_features": 8, "max_iter": 2, "repeats": 2, "settle_s": 1.0},
    "quick": {"data_profile": "one-eighth", "n_features": 360, "max_iter": 3, "repeats": 3, "settle_s": 5.0},
    "note": {"data_profile": "one-eighth", "n_features": 3600, "max_iter": 3, "repeats": 5, "settle_s": 10.0},
}
CONTENTION_PROFILES["full"] = CONTENTION_PROFILES["note"]

_COMPETITOR = """
import os
import data_synth, msrm
parent = os.getppid()
data, truth = data_synth.synthetic_dataset({data_profile!r}, n_features={n_features}, n_runs=1, n_factors=3, seed=0)
print("ready", flush=True)
while os.getppid() == parent:  # ends with the process that started it, even one killed before it could stop this
    msrm.fit_rmsrm(data, truth.spec, restarts=1, max_iter={max_iter}, tol=0.0, n_jobs=1, progress=False)
"""


def _openblas_default_threads() -> int:
    from msrm.runtime import blas_info

    counts = [b.get("num_threads") or 0 for b in blas_info() if b.get("user_api") == "blas"]
    return max(counts) if counts else 1


def _start_competitor(cfg: dict):
    """A second process fitting R-MSRM in a loop (the library's defaults), once it has built its data."""
    import os
    import subprocess
    import sys

    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.Popen([sys.executable, "-c", _COMPETITOR.format(**cfg)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env, start_new_session=True)
    line = proc.stdout.readline()
    if "ready" not in line:
        from msrm_lab.processes import kill_group

        kill_group(proc)
        raise RuntimeError("the competing R-MSRM process did not start")
    time.sleep(cfg["settle_s"])  # its first fit under way, and the load average moving
    return proc


def contention_rows(profile: str = "quick", *, info: dict | None = None, repeats: int | None = None,
                    conditions: tuple[str, ...] = ("idle", "loaded")) -> list[dict]:
    """The same short ``fit_rmsrm`` (one restart, ``max_iter`` iterations, tolerance off) at each BLAS setting,
    idle and beside a competing process that fits R-MSRM in a loop.

    Settings: ``"default"`` (every step on OpenBLAS's own thread count, as without msrm's rule), ``"one"`` (one
    thread) and ``"chosen"`` (:func:`msrm.runtime.step_blas_threads`). In each condition the three are called in
    turn for ``repeats`` rounds after one warm call each. Rows (metric ``median_s``, with min, max and every
    time, the load average at the start and end of the condition and the threads the rule chose), then
    per condition the ratios ``chosen_over_one`` and ``default_over_one`` (target: ``chosen_over_one`` at most
    :data:`CONTENTION_TARGET` under load).
    """
    import os

    import data_synth
    import msrm
    from msrm.rmsrm.loadings import dense_flops
    from msrm.rmsrm.prepare import prepare_rmsrm
    from msrm.runtime import fixed_step_threads, step_blas_threads

    from msrm_lab.processes import kill_group

    if profile not in CONTENTION_PROFILES:
        raise ValueError(f"profile must be one of {sorted(CONTENTION_PROFILES)}, got {profile!r}")
    unknown = set(conditions) - {"idle", "loaded"}
    if unknown:
        raise ValueError(f"conditions must be drawn from ('idle', 'loaded'), got {sorted(unknown)}")
    cfg = CONTENTION_PROFILES[profile]
    reps = cfg["repeats"] if repeats is None else int(repeats)
    data, truth = data_synth.synthetic_dataset(cfg["data_profile"], n_features=cfg["n_features"], n_runs=1,
                                               n_factors=3, seed=0)
    flops = dense_flops(prepare_rmsrm(data, truth.spec, 1.0))
    default_n = _openblas_default_threads()
    settings = {"default": default_n, "one": 1, "chosen": None}

    def fit():
        t0 = time.perf_counter()
        msrm.fit_rmsrm(data, truth.spec, restarts=1, max_iter=cfg["max_iter"], tol=0.0, n_jobs=1, progress=False)
        return time.perf_counter() - t0

    def load():
        try:
            return round(os.getloadavg()[0], 2)
        except OSError:  # pragma: no cover
            return None

    rows: list[dict] = []
    common = dict(profile=profile, data_profile=cfg["data_profile"], n_features=cfg["n_features"], K=3,
                  max_iter=cfg["max_iter"], restarts=1, openblas_default_threads=default_n,
                  dense_flops=flops, competitor="fit_rmsrm loop in a second process (library defaults)")
    for condition in conditions:
        reason = skip_reason()
        if reason is not None:
            rows += skipped_rows(NOTEBOOK, CONTENTION_EXPERIMENT, reason, info=info, condition=condition, **common)
            continue
        proc = _start_competitor(cfg) if condition == "loaded" else None
        try:
            load_start = load()
            chosen = {"banded": step_blas_threads("banded"), "dense": step_blas_threads("dense", flops)}
            for n in settings.values():
                with fixed_step_threads(n):
                    fit()
            times = {k: [] for k in settings}
            for _ in range(max(1, reps)):
                for name, n in settings.items():
                    with fixed_step_threads(n):
                        times[name].append(fit())
            load_end = load()
        finally:
            if proc is not None:
                kill_group(proc, term_grace=2.0)
        med = {k: statistics.median(v) for k, v in times.items()}
        for name, n in settings.items():
            threads = n if n is not None else f"banded {chosen['banded']}, dense {chosen['dense']}"
            rows.append(make_row(NOTEBOOK, CONTENTION_EXPERIMENT, "median_s", med[name], "s", info=info,
                                 setting=name, condition=condition, threads=str(threads), repeats=len(times[name]),
                                 min_s=min(times[name]), max_s=max(times[name]), times=times[name],
                                 load_average_start=load_start, load_average_end=load_end, **common))
        for metric, num in (("chosen_over_one", "chosen"), ("default_over_one", "default")):
            rows.append(make_row(NOTEBOOK, CONTENTION_EXPERIMENT, metric, med[num] / med["one"], "x", info=info,
                                 condition=condition, target=CONTENTION_TARGET if num == "chosen" else None,
                                 load_average_start=load_start, load_average_end=load_end,
                                 definition=f"median {num} / median one thread, alternating calls", **common))
    return rows


# ---- GP-MSRM: the automatic BLAS counts of the LAPACK callback and the host filter against fixed counts

GP_EXPERIMENT = "gp_threads"
# (setting, BLAS threads): None is the automatic choice (msrm.runtime.callback_thread_count for the grouped
# likelihood's LAPACK callback, msrm.runtime.filter_thread_count for the state-space host filter)
GP_SETTINGS: tuple[tuple[str, int | None], ...] = (("automatic", None), ("one", 1), ("two", 2))
GP_PATHS = ("grouped", "state_space")

GP_PROFILES: dict[str, dict[str, Any]] = {
    "smoke": {"data_profile": "tiny", "n_features": 4, "repeats": 2, "busy": (0,), "settle_s": 0.5},
    "quick": {"data_profile": "one-eighth", "n_features": 360, "repeats": 3, "busy": (0, 2), "settle_s": 3.0,
              "quiet_wait_s": 60.0},
    "note": {"data_profile": "one-eighth", "n_features": 3600, "repeats": 5, "busy": (0, 1, 2), "settle_s": 10.0,
             "quiet_wait_s": 240.0},
}
GP_PROFILES["full"] = GP_PROFILES["note"]


def _load_average() -> float | None:
    import os

    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # pragma: no cover - not available on every platform
        return None


def _gp_case(path: str, data, spec):
    """(model, u at the truth's parameters, the size the automatic rule reads, a zero-argument function giving the
    count the rule chooses now, sizes for the rows)."""
    from msrm import runtime
    from msrm.gp.model import GPMSRM

    if path == "grouped":
        model = GPMSRM(data, spec, "grouped")
        n = max(model.factorization_dims)
        flops = n**3 / 3.0

        def chosen():
            return runtime.callback_thread_count(flops)

        from msrm.gp.linalg import resolve_method

        sizes = {"NK": n, "method": resolve_method(model.method)}
    else:
        from msrm.gp.state_space.host import HostFilter

        model = GPMSRM(data, spec, linear_algebra="state_space")
        filters = [HostFilter(r.tables) for r in model.prepared.runs]
        flops = max(hf.blas_flops for hf in filters)

        def chosen():
            return runtime.filter_thread_count(flops)

        sizes = {"n_states": max(hf.S for hf in filters), "pipeline": any(hf.pipeline_pays for hf in filters),
                 "method": model.prepared.runs[0].tables.method}
    return model, chosen, dict(sizes, blas_flops=flops)


_BUSY = """
import os
import numpy as np
parent = os.getppid()
a = np.random.default_rng(0).standard_normal((600, 600))
print("ready", flush=True)
while os.getppid() == parent:  # ends with the process that started it, even one killed before it could stop this
    a = np.tanh(a @ a * 1e-3)
"""


def _start_busy(settle_s: float):
    """A competing process multiplying matrices in a loop with its BLAS library's default thread count (another
    user's NumPy job on a shared machine), once it is running."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", _BUSY], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, start_new_session=True)
    if "ready" not in proc.stdout.readline():
        from msrm_lab.processes import kill_group

        kill_group(proc)
        raise RuntimeError("the competing busy process did not start")
    time.sleep(settle_s)
    return proc


def _wait_for_quiet(limit: float, timeout_s: float) -> float:
    """Wait until the 1-minute load average is at most ``limit`` (or ``timeout_s`` has passed); return it.

    The idle condition follows conditions with busy processes, and the load average trails the machine by about
    a minute: waiting for it to fall means the idle rows' recorded load says what their name says, and that no
    competitor from the previous condition is still winding down."""
    start = time.monotonic()
    load = os.getloadavg()[0]
    while load > limit and time.monotonic() - start < timeout_s:
        time.sleep(5.0)
        load = os.getloadavg()[0]
    return load


def oldest_python() -> str | None:
    """The interpreter of the oldest supported environment (``.venv-oldest``, which ``make test-oldest`` installs:
    Python 3.11 with the lowest JAX, NumPyro and ArviZ that pyproject.toml admits), or None where it is not
    installed. The threads notebook repeats the GP rows there, since the thread behaviour of JAX's CPU runtime
    changes between versions."""
    from msrm_lab.paths import repo_root

    python = repo_root() / ".venv-oldest" / "bin" / "python"
    return str(python) if python.exists() else None


def _gp_rows_elsewhere(python: str, profile: str, repeats: int | None, paths: tuple[str, ...],
                       busy: tuple[int, ...] | None) -> list[dict]:
    """:func:`gp_threads_rows` run by another interpreter (``python -m msrm_lab.bench.threads``), its rows read
    back from a temporary file; the rows carry that interpreter's ``execution_info``."""
    import json
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.jsonl"
        cmd = [python, "-m", "msrm_lab.bench.threads", "--profile", profile, "--out", str(out)]
        if repeats is not None:
            cmd += ["--repeats", str(int(repeats))]
        cmd += ["--paths", *paths]
        if busy is not None:
            cmd += ["--busy", *(str(int(b)) for b in busy)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as err:
            raise RuntimeError(f"the GP threads rows under {python} failed: {err}") from err
        if done.returncode != 0:
            raise RuntimeError(f"the GP threads rows under {python} failed (exit {done.returncode}):\n"
                               f"{done.stderr[-4000:]}")
        return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def gp_threads_rows(profile: str = "quick", *, info: dict | None = None, repeats: int | None = None,
                    paths: tuple[str, ...] = GP_PATHS,
                    settings: tuple[tuple[str, int | None], ...] | None = None,
                    busy: tuple[int, ...] | None = None, python: str | None = None) -> list[dict]:
    """:func:`gp_threads_condition` idle and beside each number of competing busy processes in ``busy`` (default:
    the profile's, e.g. 0, 1 and 2), each a NumPy matrix-product loop at its BLAS library's default thread count.
    Settings (default): ``"automatic"``, ``"default"`` (OpenBLAS's own count, as without msrm's rule), one and
    two threads. Every row carries ``busy_processes``. Before the idle condition the 1-minute load average is
    allowed to fall to the profile's ``quiet_load`` (at most ``quiet_wait_s``, :func:`_wait_for_quiet`).
    With ``python`` (another interpreter, e.g. :func:`oldest_python`), the whole experiment runs there with the
    default settings instead (:func:`_gp_rows_elsewhere`)."""
    from msrm_lab.processes import kill_group

    if python is not None:
        if info is not None or settings is not None:
            raise ValueError("gp_threads_rows: info and settings are chosen by the other interpreter")
        return _gp_rows_elsewhere(python, profile, repeats, tuple(paths), busy)

    if profile not in GP_PROFILES:
        raise ValueError(f"profile must be one of {sorted(GP_PROFILES)}, got {profile!r}")
    cfg = GP_PROFILES[profile]
    settings = settings if settings is not None else GP_SETTINGS + (("default", _openblas_default_threads()),)
    busy = tuple(cfg.get("busy", (0,))) if busy is None else tuple(busy)
    rows: list[dict] = []
    for n_busy in busy:
        reason = skip_reason()
        if reason is not None:
            rows += skipped_rows(NOTEBOOK, GP_EXPERIMENT, reason, info=info, busy_processes=n_busy, profile=profile,
                                 paths=list(paths))
            continue
        procs = []
        if n_busy == 0:
            left = seconds_left()
            _wait_for_quiet(cfg.get("quiet_load", 1.5),
                            cfg.get("quiet_wait_s", 0.0) if left is None else min(cfg.get("quiet_wait_s", 0.0),
                                                                                  max(left / 4, 0.0)))
        try:
            for _ in range(n_busy):
                procs.append(_start_busy(cfg.get("settle_s", 2.0)))
            part = gp_threads_condition(profile, info=info, repeats=repeats, paths=paths, settings=settings)
        finally:
            for proc in procs:
                kill_group(proc)
        for r in part:
            r["params"]["busy_processes"] = n_busy
        rows += part
    return rows


def gp_threads_condition(profile: str = "quick", *, info: dict | None = None, repeats: int | None = None,
                         paths: tuple[str, ...] = GP_PATHS,
                         settings: tuple[tuple[str, int | None], ...] = GP_SETTINGS) -> list[dict]:
    """GP-MSRM's ``value_and_grad`` at K = 3 (grouped likelihood through the LAPACK callback, and the state-space
    likelihood through the host filter) at each BLAS setting of :data:`GP_SETTINGS`: ``"automatic"`` (the count
    msrm chooses per call from the work's size and the cores other processes leave idle), and fixed counts
    (:func:`msrm.runtime.fixed_step_threads`, which both paths take as given).

    Every (path, setting) is called once untimed (compilation), then all of them in turn for ``repeats`` rounds,
    so a change in background load hits each alike. Rows (metric ``median_s``, with min, max and every time): per
    path and setting; for ``"automatic"`` also the count the rule gave just before each timed call and the load
    average then. Then per path the ratios ``automatic_over_best_fixed`` (automatic / the faster fixed setting)
    and ``two_over_one``. The load average at the start and the end is on every row.
    """
    import jax

    import data_synth
    from msrm.runtime import fixed_step_threads

    if profile not in GP_PROFILES:
        raise ValueError(f"profile must be one of {sorted(GP_PROFILES)}, got {profile!r}")
    unknown = set(paths) - set(GP_PATHS)
    if unknown:
        raise ValueError(f"paths must be drawn from {GP_PATHS}, got {sorted(unknown)}")
    if not jax.config.jax_enable_x64:
        raise ValueError("gp_threads_rows: float64 is the contract; call msrm.runtime.enable_x64() first")
    cfg = GP_PROFILES[profile]
    reps = cfg["repeats"] if repeats is None else int(repeats)
    K = 3
    data, truth = data_synth.synthetic_dataset(cfg["data_profile"], n_features=cfg["n_features"], n_factors=K,
                                               seed=0)
    info = execution_info() if info is None else info
    if jax.default_backend() != "cpu":
        return [make_row(NOTEBOOK, GP_EXPERIMENT, "median_s", None, "s", status="not_yet_measured", info=info,
                         reason="the LAPACK callback and the host filter run on the CPU platform only",
                         profile=profile)]
    cases = {}
    for path in paths:
        model, chosen, sizes = _gp_case(path, data, truth.spec)
        u = model.unconstrain(truth.params)
        cases[path] = (lambda m=model, x=u: m.value_and_grad(x)), chosen, sizes

    load_start = _load_average()
    for fn, _, _ in cases.values():
        for _, n in settings:
            with fixed_step_threads(n):
                block(fn())
    times = {(p, s): [] for p in cases for s, _ in settings}
    picked = {p: [] for p in cases}
    loads = {p: [] for p in cases}
    for _ in range(max(1, reps)):
        for path, (fn, chosen, _) in cases.items():
            for name, n in settings:
                with fixed_step_threads(n):
                    if n is None:
                        picked[path].append(chosen())
                        loads[path].append(_load_average())
                    t0 = time.perf_counter()
                    block(fn())
                    times[(path, name)].append(time.perf_counter() - t0)
    load_end = _load_average()

    rows: list[dict] = []
    common = dict(profile=profile, data_profile=cfg["data_profile"], n_features=cfg["n_features"], K=K,
                  load_average_start=load_start, load_average_end=load_end, measured="alternating calls")
    for path, (_, _, sizes) in cases.items():
        med = {}
        for name, n in settings:
            ts = times[(path, name)]
            med[name] = statistics.median(ts)
            extra = {"chosen_threads": picked[path], "load_average": loads[path]} if n is None else {}
            rows.append(make_row(NOTEBOOK, GP_EXPERIMENT, "median_s", med[name], "s", info=info, path=path,
                                 setting=name, threads="automatic" if n is None else n, repeats=len(ts),
                                 min_s=min(ts), max_s=max(ts), times=ts, **extra, **sizes, **common))
        fixed = {name: med[name] for name, n in settings if n is not None}
        if "automatic" in med and fixed:
            best = min(fixed, key=fixed.get)
            rows.append(make_row(NOTEBOOK, GP_EXPERIMENT, "automatic_over_best_fixed", med["automatic"] / fixed[best],
                                 "x", info=info, path=path, best_fixed=best, chosen_threads=picked[path],
                                 definition="median automatic / median of the faster fixed setting, alternating "
                                            "calls", **sizes, **common))
        if "one" in med and "two" in med:
            rows.append(make_row(NOTEBOOK, GP_EXPERIMENT, "two_over_one", med["two"] / med["one"], "x", info=info,
                                 path=path, definition="median two threads / median one thread, alternating calls",
                                 **sizes, **common))
    return rows


def main(argv: list[str] | None = None) -> None:
    """``python -m msrm_lab.bench.threads``: the GP rows (:func:`gp_threads_rows`) of this interpreter, written to
    ``--out``; :func:`_gp_rows_elsewhere` calls it in another environment."""
    import argparse

    import msrm

    parser = argparse.ArgumentParser(prog="python -m msrm_lab.bench.threads")
    parser.add_argument("--profile", choices=sorted(GP_PROFILES), default="quick")
    parser.add_argument("--out", required=True, help="rows file (JSON lines), written atomically")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--paths", nargs="+", default=list(GP_PATHS), choices=GP_PATHS)
    parser.add_argument("--busy", nargs="+", type=int, default=None)
    args = parser.parse_args(argv)
    msrm.runtime.configure(platform="cpu")
    rows = gp_threads_rows(args.profile, repeats=args.repeats, paths=tuple(args.paths),
                           busy=None if args.busy is None else tuple(args.busy))
    write_rows(Path(args.out), rows, append=False)


if __name__ == "__main__":
    main()
