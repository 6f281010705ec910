"""BLAS threads and the CPU LAPACK callback (notebook ``04_threads``, stem ``threads``).

At one dimension n (2727 = the one-eighth grouped problem at K = 3 in the ``note`` profile), side by side in
one process, float64:

===================  ==================================================================================
experiment           what runs
===================  ==================================================================================
direct_potrf_potri   SciPy ``dpotrf`` + ``dpotri`` called directly under ``threadpool_limits``
callback_potrf_potri the same two calls inside ``jax.pure_callback`` in a jitted JAX function
quad_logdet_callback ``msrm.gp.linalg.quad_logdet`` value + gradient in M, LAPACK callback path
native_chol_inverse  ``jnp.linalg.cholesky`` then ``cho_solve`` against the identity (XLA's own threads)
plain_grad_logdet    plain JAX reverse mode through ``cholesky``: ``grad(2 sum log diag chol(M))``
quad_logdet_native   ``quad_logdet`` value + gradient, native path (XLA's own threads)
===================  ==================================================================================

The first three are repeated for BLAS thread counts 1..physical cores and once oversubscribed (2 x cores,
``oversubscribed=True``; the runtime's warning is recorded, not shown). XLA's CPU thread pool is fixed when
the process starts, so the native rows are measured once (``threads="xla"``). Ratio rows compare, at the best
thread count: plain JAX gradient / ``quad_logdet`` value+gradient, and ``quad_logdet`` value+gradient / the
direct POTRF+POTRI floor. Every row carries ``execution_info`` (BLAS library, kernel architecture, version).
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np

from ..runtime import execution_info, physical_cores
from .linalg import peak_rss_delta, spd_matrix
from .measure import warm_median
from .rows import make_row, write_rows

__all__ = ["NOTEBOOK", "PROFILES", "thread_settings", "threads_rows", "run"]

NOTEBOOK = "threads"

PROFILES: dict[str, dict[str, Any]] = {
    "smoke": {"n": 200, "repeats": 3},
    "quick": {"n": 1200, "repeats": 3},
    "note": {"n": 2727, "repeats": 5},
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


def threads_rows(n: int, repeats: int = 3, *, settings=None, profile: str = "quick", seed: int = 0) -> list[dict]:
    """All rows of the thread/callback comparison at dimension ``n`` (see the module docstring)."""
    import jax
    import jax.numpy as jnp
    import jax.scipy.linalg as jsl
    from threadpoolctl import threadpool_limits

    from ..gp import linalg

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

    callback_pp = jax.jit(linalg.potrf_potri_callback)
    quad_cb = vg("callback")
    rows: list[dict] = []

    def record(experiment, fn, **params):
        med, times = warm_median(fn, repeats=repeats)
        peak = peak_rss_delta(fn)
        rows.append(make_row(NOTEBOOK, experiment, "median_s", med, "s", info=info, n=n, repeats=repeats,
                             times=times, peak_rss_delta_bytes=peak, profile=profile, **params))
        return med

    by_threads: dict[int, dict[str, float]] = {}
    for threads, over in settings:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with threadpool_limits(limits=threads, user_api="blas"):
                d = record("direct_potrf_potri", lambda: _direct(M_np), threads=threads, oversubscribed=over)
            with linalg.callback_threads(threads):
                c = record("callback_potrf_potri", lambda: callback_pp(M), threads=threads, oversubscribed=over)
                q = record("quad_logdet_callback", lambda: quad_cb(M), threads=threads, oversubscribed=over)
        if over:
            warned = any("oversubscri" in str(w.message) for w in caught)
            for r in rows[-3:]:
                r["params"]["oversubscription_warning"] = warned
        by_threads[threads] = {"direct": d, "callback": c, "quad": q, "oversubscribed": over}

    native_inv = jax.jit(lambda A: jsl.cho_solve(jsl.cho_factor(A, lower=True), jnp.eye(n, dtype=A.dtype)))
    plain = jax.jit(jax.grad(lambda A: 2.0 * jnp.sum(jnp.log(jnp.diagonal(jnp.linalg.cholesky(A))))))
    record("native_chol_inverse", lambda: native_inv(M), threads="xla", oversubscribed=False)
    t_plain = record("plain_grad_logdet", lambda: plain(M), threads="xla", oversubscribed=False)
    quad_native = vg("native")
    t_native = record("quad_logdet_native", lambda: quad_native(M), threads="xla", oversubscribed=False)

    fair = {t: v for t, v in by_threads.items() if not v["oversubscribed"]}
    best_t = min(fair, key=lambda t: fair[t]["quad"])
    best = fair[best_t]
    rows.append(make_row(NOTEBOOK, "speedup_vs_plain_grad", "ratio", t_plain / best["quad"], "x", info=info, n=n,
                         threads=best_t, profile=profile,
                         definition="plain JAX grad(logdet via cholesky) / quad_logdet callback value+grad"))
    rows.append(make_row(NOTEBOOK, "speedup_vs_plain_grad_native", "ratio", t_plain / t_native, "x", info=info,
                         n=n, threads="xla", profile=profile,
                         definition="plain JAX grad(logdet via cholesky) / quad_logdet native value+grad"))
    for t, v in by_threads.items():
        rows.append(make_row(NOTEBOOK, "value_grad_over_floor", "ratio", v["quad"] / v["direct"], "x", info=info,
                             n=n, threads=t, oversubscribed=v["oversubscribed"], profile=profile,
                             definition="quad_logdet callback value+grad / direct POTRF+POTRI, same threads"))
        rows.append(make_row(NOTEBOOK, "callback_overhead", "ratio", v["callback"] / v["direct"], "x", info=info,
                             n=n, threads=t, oversubscribed=v["oversubscribed"], profile=profile,
                             definition="POTRF+POTRI through pure_callback / direct, same threads"))
    return rows


def run(profile: str = "quick", out_dir: str | Path | None = None, *, n: int | None = None,
        repeats: int | None = None) -> list[dict]:
    """All rows of the ``threads`` notebook for one profile (written to ``out_dir/rows.jsonl`` if given)."""
    if profile not in PROFILES:
        raise ValueError(f"profile must be one of {sorted(PROFILES)}, got {profile!r}")
    cfg = PROFILES[profile]
    rows = threads_rows(cfg["n"] if n is None else int(n), cfg["repeats"] if repeats is None else int(repeats),
                        profile=profile)
    if out_dir is not None:
        write_rows(Path(out_dir) / "rows.jsonl", rows, append=False)
    return rows
