"""Raw dense linear algebra benchmarks (notebook ``02_linalg``, stem ``linalg``).

Measures, with JAX on the default device in float64: a square matrix product, Cholesky, LU and the
Cholesky-inverse (Cholesky then ``cho_solve`` against the identity, the pattern a native symmetric solve uses).
On the CPU, jaxlib's factorizations and triangular solves call SciPy's LAPACK/OpenBLAS, so they run under a
BLAS thread limit of :func:`msrm.runtime.blas_threads` (recorded as ``blas_threads``); the matrix product runs
in XLA's own pool.
Each is compiled once, then timed over warm repeats with ``block_until_ready`` before the timer stops; rows
carry the median seconds and GFLOP/s (nominal flop counts below) and the process's resident-memory peak
during the repeats. Float32 rows (matmul precision ``"highest"`` against ``"default"``) are measured only on a
GPU; elsewhere they are recorded as ``not_yet_measured`` with the reason.

Also here: :func:`potrf_potri_floor`, the median seconds of SciPy POTRF+POTRI under a BLAS thread limit (the
floor a GP value+gradient is compared with); :func:`potrf_potri_callback`, the same two calls inside
``jax.pure_callback`` (the ``threads`` notebook times it against the direct calls); and
:func:`memory_prediction_rows`, which checks the library's memory model (:func:`msrm.gp.memory.predict_peak_bytes`,
the function the guard calls) against a measured peak.

Nominal flops: matmul 2n^3, Cholesky n^3/3, LU 2n^3/3, Cholesky-inverse n^3/3 + 2n^3 (two triangular solves
with n right-hand sides).
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np

from msrm_lab.provenance import execution_info
from .measure import PeakMemory, block, warm_median
from .rows import make_row

__all__ = [
    "NOTEBOOK",
    "PROFILES",
    "FLOPS",
    "spd_matrix",
    "peak_rss_delta",
    "raw_linalg_rows",
    "float32_rows",
    "potrf_potri_floor",
    "potrf_potri_callback",
    "memory_prediction_rows",
    "run",
]

NOTEBOOK = "linalg"

PROFILES: dict[str, dict[str, Any]] = {
    "smoke": {"sizes": [128, 256], "repeats": 3, "memory_dim": 256},
    "quick": {"sizes": [256, 512, 1024, 1500], "repeats": 3, "memory_dim": 1024},
    "note": {"sizes": [512, 1024, 2048, 2727, 4096, 8192], "repeats": 3, "memory_dim": 2727},
}
PROFILES["full"] = PROFILES["note"]  # full recordings change the models' sizes, not these
# the device run (msrm_lab.device) on one GPU: the sweep up to 8192 within its time budget
PROFILES["device"] = {"sizes": [1024, 2048, 4096, 8192], "repeats": 3, "memory_dim": 2727}

FLOPS: dict[str, Callable[[int], float]] = {
    "matmul": lambda n: 2.0 * n**3,
    "cholesky": lambda n: n**3 / 3.0,
    "lu": lambda n: 2.0 * n**3 / 3.0,
    "cho_inverse": lambda n: n**3 / 3.0 + 2.0 * n**3,
}


def spd_matrix(n: int, seed: int = 0) -> np.ndarray:
    """A well-conditioned (n, n) SPD test matrix built in O(n^2): exponential kernel on sorted random points + I.

    Dense factorization cost does not depend on the values, so no O(n^3) construction is needed.
    """
    if n < 1:
        raise ValueError(f"n must be positive, got {n}")
    rng = np.random.default_rng(seed)
    t = np.sort(rng.uniform(0.0, n / 10.0, size=n))
    M = np.exp(-np.abs(t[:, None] - t[None, :]))
    M[np.diag_indices(n)] += 1.0
    return M


def _malloc_trim() -> None:
    """Hand freed heap memory back to the system (glibc), so memory kept from earlier calls does not hide a rise."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def peak_rss_delta(fn: Callable[[], Any]) -> int | None:
    """Bytes by which the resident peak rose above the resident size while ``fn()`` ran (synchronised).

    Uses :class:`msrm_lab.bench.measure.PeakMemory` after ``malloc_trim``; ``None`` where unavailable.
    """
    _malloc_trim()
    with PeakMemory() as pm:
        block(fn())
    return pm.delta_bytes


def _jax_ops():
    import jax
    import jax.numpy as jnp
    import jax.scipy.linalg as jsl

    def cho_inverse(M):
        c = jsl.cho_factor(M, lower=True)
        return jsl.cho_solve(c, jnp.eye(M.shape[0], dtype=M.dtype))

    return {
        "matmul": jax.jit(lambda A: A @ A),
        "cholesky": jax.jit(jnp.linalg.cholesky),
        "lu": jax.jit(lambda A: jsl.lu_factor(A)),
        "cho_inverse": jax.jit(cho_inverse),
    }


def raw_linalg_rows(sizes, repeats: int = 3, *, profile: str = "quick", seed: int = 0) -> list[dict]:
    """Float64 matmul, Cholesky, LU and Cholesky-inverse on the default JAX device, one pair of rows each.

    Returns rows ``experiment=<op>``, metrics ``median_s`` and ``gflops`` with params n, repeats, times, peak.
    """
    import jax

    if not jax.config.jax_enable_x64:
        raise ValueError("raw_linalg_rows: float64 is the contract; call msrm.runtime.enable_x64() first")
    from threadpoolctl import threadpool_limits

    from msrm.runtime import blas_threads

    info = execution_info()
    ops = _jax_ops()
    rows = []
    threads = blas_threads()
    with threadpool_limits(limits=threads, user_api="blas"):
        for n in sizes:
            rows += _raw_rows_one(int(n), ops, repeats, info, profile, seed, threads)
    return rows


def _raw_rows_one(n: int, ops, repeats: int, info, profile: str, seed: int, threads: int) -> list[dict]:
    import jax
    import jax.numpy as jnp

    rows = []
    M = jax.device_put(jnp.asarray(spd_matrix(n, seed)))
    for name, fn in ops.items():
        med, times = warm_median(lambda: fn(M), repeats=repeats)
        peak = peak_rss_delta(lambda: fn(M))
        common = dict(n=n, dtype="float64", repeats=repeats, times=times, peak_rss_delta_bytes=peak,
                      device=str(jax.devices()[0]), profile=profile, blas_threads=threads)
        rows.append(make_row(NOTEBOOK, name, "median_s", med, "s", info=info, **common))
        rows.append(make_row(NOTEBOOK, name, "gflops", FLOPS[name](n) / med / 1e9, "GFLOP/s", info=info, **common))
    return rows


def float32_rows(sizes, repeats: int = 3, *, profile: str = "quick", seed: int = 0) -> list[dict]:
    """Float32 matmul with precision ``highest`` vs ``default`` (TF32 on recent NVIDIA cards): GPU only.

    Without a GPU each row is ``not_yet_measured`` with ``reason``.
    """
    import jax
    import jax.numpy as jnp

    info = execution_info()
    gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
    rows = []
    for n in sizes:
        for precision in ("highest", "default"):
            common = dict(n=int(n), dtype="float32", precision=precision, profile=profile)
            if not gpu:
                rows.append(make_row(NOTEBOOK, "matmul_float32", "gflops", None, "GFLOP/s", status="not_yet_measured",
                                     info=info, reason="float32 precision rows are measured only on a GPU",
                                     **common))
                continue
            A = jax.device_put(jnp.asarray(spd_matrix(int(n), seed), dtype=jnp.float32))
            fn = jax.jit(lambda X, p=precision: jnp.matmul(X, X, precision=p))
            med, times = warm_median(lambda: fn(A), repeats=repeats)
            ref = np.asarray(A, dtype=np.float64) @ np.asarray(A, dtype=np.float64)
            rel = float(np.max(np.abs(np.asarray(fn(A), dtype=np.float64) - ref)) / np.max(np.abs(ref)))
            rows.append(make_row(NOTEBOOK, "matmul_float32", "gflops", FLOPS["matmul"](n) / med / 1e9, "GFLOP/s",
                                 info=info, times=times, max_rel_error=rel, repeats=repeats, **common))
    return rows


def potrf_potri_floor(n: int, threads: int | None = None, repeats: int = 5, seed: int = 0) -> float:
    """Median seconds of direct SciPy LAPACK POTRF+POTRI on an (n, n) SPD matrix under a BLAS thread limit.

    Args:
        n: dimension (e.g. N*K of the grouped likelihood).
        threads: BLAS threads (``None``: :func:`msrm.runtime.blas_threads`).
        repeats: warm repeats (one untimed call first).
    """
    from scipy.linalg import lapack
    from threadpoolctl import threadpool_limits

    from msrm.runtime import blas_threads

    threads = blas_threads() if threads is None else int(threads)
    M = np.asfortranarray(spd_matrix(int(n), seed))

    def once():
        U, info = lapack.dpotrf(M, lower=0, clean=1, overwrite_a=0)
        if info != 0:
            raise RuntimeError(f"dpotrf failed (info={info})")
        return lapack.dpotri(U, lower=0, overwrite_c=1)[0]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with threadpool_limits(limits=threads, user_api="blas"):
            med, _ = warm_median(once, repeats=repeats)
    return med


def potrf_potri_callback(M):
    """``(L, M^{-1})`` by LAPACK POTRF then POTRI inside ``jax.pure_callback`` (benchmarks and checks).

    BLAS runs under :func:`msrm.runtime.callback_blas_limit`, as in the library's callback.

    Args:
        M: (n, n) symmetric positive definite float64, or a batch (..., n, n) under ``vmap``.
    Returns:
        L (n, n) lower Cholesky factor (NaN if not positive definite), Minv (n, n) full symmetric inverse.
    """
    import jax
    import jax.numpy as jnp

    from msrm.gp.linalg.lapack import fill_lower_from_upper
    from msrm.runtime import callback_blas_limit

    n = M.shape[-1]

    def one(Mi):
        from scipy.linalg import lapack

        U, info = lapack.dpotrf(Mi, lower=0, clean=1, overwrite_a=0)
        if info != 0:
            nan = np.full(Mi.shape, np.nan)
            return nan, nan
        Ui, _ = lapack.dpotri(U, lower=0, overwrite_c=0)
        return U.T, fill_lower_from_upper(Ui).T

    def host(Mh):
        Mh = np.asarray(Mh, dtype=np.float64)
        with callback_blas_limit():
            if Mh.ndim == 2:
                return one(Mh)
            L = np.empty(Mh.shape)
            Minv = np.empty(Mh.shape)
            for idx in np.ndindex(*Mh.shape[:-2]):
                L[idx], Minv[idx] = one(Mh[idx])
        return L, Minv

    spec = jax.ShapeDtypeStruct((n, n), jnp.float64)
    return jax.pure_callback(host, (spec, spec), M, vmap_method="broadcast_all")


def memory_prediction_rows(n: int, *, methods=("callback", "native"), profile: str = "quick",
                           seed: int = 0) -> list[dict]:
    """Measured resident peak of one ``quad_logdet`` value+gradient (both paths) beside the prediction.

    The prediction is :func:`msrm.gp.memory.predict_peak_bytes` of the call's own sizes, the model the guard
    uses; the measured value is the rise of the resident peak plus the resident input ``M``, which the
    prediction counts.
    """
    import jax
    import jax.numpy as jnp

    from msrm.gp.linalg import quad_logdet
    from msrm.gp.memory import PEAK_MATRICES, dense_bytes, predict_peak_bytes

    info = execution_info()
    n = int(n)
    M = jnp.asarray(spd_matrix(n, seed))
    V = jnp.ones((n, 1))
    predicted = predict_peak_bytes(*V.shape)
    resident = dense_bytes(*M.shape)  # M is resident before the call and counted by the prediction
    rows = []
    for method in methods:
        f = jax.jit(jax.value_and_grad(lambda Mx, m=method: sum(quad_logdet(Mx, V, method=m)[:2])))
        block(f(M))
        peak = peak_rss_delta(lambda: f(M))
        common = dict(n=n, method=method, predicted_bytes=predicted, matrices_counted=PEAK_MATRICES,
                      resident_input_bytes=resident, profile=profile,
                      definition="rise of the resident peak (VmHWM) during one warm value+gradient, plus the "
                                 "resident input M")
        if peak is None:
            rows.append(make_row(NOTEBOOK, "memory_prediction", "peak_bytes", None, "bytes", info=info,
                                 status="not_yet_measured", reason="VmHWM reset unavailable", **common))
        else:
            rows.append(make_row(NOTEBOOK, "memory_prediction", "peak_bytes", peak + resident, "bytes", info=info,
                                 **common))
    return rows


def run(profile: str = "quick", out_dir: str | Path | None = None, *, sizes=None, repeats: int | None = None,
        memory_dim: int | None = None) -> list[dict]:
    """All rows of the ``linalg`` notebook for one profile (written to ``out_dir/rows.jsonl`` if given)."""
    if profile not in PROFILES:
        raise ValueError(f"profile must be one of {sorted(PROFILES)}, got {profile!r}")
    cfg = PROFILES[profile]
    sizes = cfg["sizes"] if sizes is None else list(sizes)
    repeats = cfg["repeats"] if repeats is None else int(repeats)
    memory_dim = cfg["memory_dim"] if memory_dim is None else int(memory_dim)
    rows = raw_linalg_rows(sizes, repeats, profile=profile)
    rows += float32_rows(sizes, repeats, profile=profile)
    rows += memory_prediction_rows(memory_dim, profile=profile)
    if out_dir is not None:
        from .rows import write_rows

        write_rows(Path(out_dir) / "rows.jsonl", rows, append=False)
    return rows
