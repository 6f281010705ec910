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
"""
from __future__ import annotations

import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from msrm.runtime import callback_threads, execution_info, physical_cores
from .linalg import peak_rss_delta, potrf_potri_callback, spd_matrix
from .measure import block
from .rows import make_row, write_rows

__all__ = ["NOTEBOOK", "PROFILES", "thread_settings", "threads_rows", "run"]

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
        repeats: int | None = None) -> list[dict]:
    """All rows of the ``threads`` notebook for one profile (written to ``out_dir/rows.jsonl`` if given)."""
    if profile not in PROFILES:
        raise ValueError(f"profile must be one of {sorted(PROFILES)}, got {profile!r}")
    cfg = PROFILES[profile]
    rows = threads_rows(cfg["n"] if n is None else int(n), cfg["repeats"] if repeats is None else int(repeats),
                        profile=profile, budget_s=cfg["budget_s"])
    if out_dir is not None:
        write_rows(Path(out_dir) / "rows.jsonl", rows, append=False)
    return rows
