"""Explicit runtime configuration and execution evidence.

Nothing here runs at import time. Call :func:`enable_x64` (or :func:`configure`) before building models:

    import msrm
    msrm.runtime.configure(platform="cpu", blas_threads=2)   # also enables float64
    info = msrm.runtime.execution_info()

``execution_info()`` is recorded in every archive and results row. It never imports JAX by itself: a
NumPy-only process (R-MSRM) reports ``backend="numpy"``.
"""
from __future__ import annotations

import contextlib
import ctypes
import datetime as _dt
import functools
import os
import platform as _platform
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any, Iterator

__all__ = [
    "enable_x64",
    "configure",
    "execution_info",
    "blas_threads",
    "blas_limit",
    "callback_threads",
    "callback_thread_count",
    "callback_blas_limit",
    "physical_cores",
    "cpu_model",
    "blas_info",
    "check_oversubscription",
    "OversubscriptionWarning",
    "HOST_MEMORY_MODES",
    "set_host_memory",
    "host_memory",
    "release_host_memory",
]


class OversubscriptionWarning(RuntimeWarning):
    """BLAS threads exceed the physical cores, or a CPU callback runs on an oversubscribed pool."""


_STATE: dict[str, Any] = {"blas_threads": None, "platform": None, "preallocate": None, "host_memory": None,
                          "callback_threads": None}

HOST_MEMORY_MODES = ("reuse", "system")

# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4
_INT_MAX = 2**31 - 1


@functools.lru_cache(maxsize=1)
def _glibc():
    """The C library when it is glibc (``mallopt``/``malloc_trim`` available), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018  (present only in glibc)
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):
        return None


def set_host_memory(mode: str) -> bool:
    """Choose how the C allocator serves large host buffers (XLA:CPU arrays, LAPACK callback copies).

    ``"reuse"``: large blocks come from the heap and freed ones are kept for the next call
    (``mallopt(M_MMAP_MAX, 0)``, trim threshold at its maximum). A jitted likelihood allocates the same
    (NK)^2 buffers on every call; glibc's own policy maps every block above 32 MiB freshly and returns it on
    free, so each call page-faults those buffers in again (``msrm_lab.bench.gp`` measures the difference,
    rows ``experiment="host_memory"``). The cost: memory freed by a call stays in the process until
    :func:`release_host_memory` (the benchmarks' peak-memory probe calls it first).

    ``"system"``: glibc's steady-state policy restored explicitly (blocks above 32 MiB mapped per allocation,
    trim above 128 KiB).

    Returns False (and changes nothing) where the C library is not glibc.
    """
    if mode not in HOST_MEMORY_MODES:
        raise ValueError(f"host_memory must be one of {HOST_MEMORY_MODES}, got {mode!r}")
    libc = _glibc()
    if libc is None:
        _STATE["host_memory"] = "unavailable"
        return False
    if mode == "reuse":
        ok = libc.mallopt(_M_MMAP_MAX, 0) and libc.mallopt(_M_TRIM_THRESHOLD, _INT_MAX)
    else:
        ok = (libc.mallopt(_M_MMAP_MAX, 65536) and libc.mallopt(_M_MMAP_THRESHOLD, 32 * 1024 * 1024)
              and libc.mallopt(_M_TRIM_THRESHOLD, 128 * 1024))
    _STATE["host_memory"] = mode if ok else "unavailable"
    return bool(ok)


def host_memory() -> str | None:
    """The host allocator mode set through :func:`configure`/:func:`set_host_memory` (None: never set)."""
    return _STATE["host_memory"]


def release_host_memory() -> None:
    """Return free heap memory to the operating system (``malloc_trim(0)``); a no-op outside glibc."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def enable_x64() -> None:
    """Turn on float64 in JAX (the numerical contract) and pin matmul precision to ``highest``."""
    import jax

    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_default_matmul_precision", "highest")


def configure(platform: str | None = None, blas_threads: int | None = None, preallocate: bool = False,
              host_memory: str = "reuse") -> None:
    """Configure the process explicitly.

    Args:
        platform: ``"cpu"``, ``"cuda"``/``"gpu"`` or ``None`` (JAX's own choice). Must be called before JAX
            initialises its backends.
        blas_threads: threads for BLAS/LAPACK in this process. When given, the limit is applied process-wide
            through threadpoolctl (JAX's CPU Cholesky, LU and triangular solves call the same OpenBLAS as SciPy),
            and msrm's LAPACK callbacks use it too. ``None`` leaves the libraries' defaults and gives msrm's
            callbacks the physical core count. A value above the physical cores warns.
        preallocate: GPU memory preallocation (``XLA_PYTHON_CLIENT_PREALLOCATE``); off by default so peak
            memory can be measured and shared cards are not grabbed whole.
        host_memory: ``"reuse"`` (default) keeps large host buffers in the heap between calls, ``"system"``
            restores glibc's policy; see :func:`set_host_memory`.
    """
    if blas_threads is not None:
        if not isinstance(blas_threads, int) or blas_threads < 1:
            raise ValueError(f"blas_threads must be a positive integer, got {blas_threads!r}")
    if host_memory not in HOST_MEMORY_MODES:
        raise ValueError(f"host_memory must be one of {HOST_MEMORY_MODES}, got {host_memory!r}")
    set_host_memory(host_memory)
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "true" if preallocate else "false"
    _STATE["preallocate"] = bool(preallocate)
    _STATE["blas_threads"] = blas_threads
    if blas_threads is not None:
        from threadpoolctl import threadpool_limits

        _STATE["limiter"] = threadpool_limits(limits=blas_threads, user_api="blas")
    check_oversubscription(blas_threads if blas_threads is not None else None)
    import jax

    if platform is not None:
        name = {"gpu": "cuda"}.get(platform, platform)
        if name not in ("cpu", "cuda", "tpu"):
            raise ValueError(f"platform must be 'cpu', 'cuda' or None, got {platform!r}")
        jax.config.update("jax_platforms", name)
        _STATE["platform"] = name
    enable_x64()


def blas_threads() -> int:
    """Threads msrm gives BLAS/LAPACK calls: the configured value, else the physical core count."""
    n = _STATE["blas_threads"]
    return int(n) if n is not None else physical_cores()


@functools.lru_cache(maxsize=1)
def _blas_controller():
    import threadpoolctl
    from scipy.linalg import blas, lapack  # noqa: F401  (load SciPy's BLAS before listing the pools)

    return threadpoolctl.ThreadpoolController()


def blas_limit(n: int):
    """Context: BLAS/LAPACK on at most ``n`` threads while it is open, set from whichever thread calls it.

    OpenBLAS built with pthreads has one process-wide thread count. threadpoolctl (3.7 and later) lets only one
    thread change it, the first that set a limit, and silently ignores the others. After
    :func:`configure` with ``blas_threads`` that thread is the main one for good, while JAX runs host callbacks
    on threads of its own, where a limit would otherwise do nothing (and small products, such as the
    state-space host filter's, would run on several OpenBLAS threads, which is slower for them). So control is
    handed to the calling thread first; leaving the context restores the previous count.
    """
    import threadpoolctl

    controller = _blas_controller()
    clear = getattr(getattr(threadpoolctl, "OpenBLASController", None), "clear_controlling_thread", None)
    if clear is not None:
        clear(force=True)
    return controller.limit(limits=int(n), user_api="blas")


@contextlib.contextmanager
def callback_threads(n: int) -> Iterator[None]:
    """Give msrm's host LAPACK callbacks ``n`` BLAS threads while the ``with`` block is open (benchmarks sweep it).

    The count is process-wide and read when a callback executes, on one of JAX's threads; JAX dispatches
    asynchronously, so block on the results inside the block. Blocks nest: leaving one restores the count that
    was in force when it was entered. They are not meant to be entered from several threads at once. Models use
    :func:`configure` (``blas_threads=``) instead.
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"callback_threads: n must be a positive integer, got {n!r}")
    previous = _STATE["callback_threads"]
    _STATE["callback_threads"] = n
    try:
        yield
    finally:
        _STATE["callback_threads"] = previous


def callback_thread_count() -> int:
    """BLAS threads the host LAPACK callbacks use now: a :func:`callback_threads` count, else :func:`blas_threads`."""
    n = _STATE["callback_threads"]
    return n if n is not None else blas_threads()


@contextlib.contextmanager
def callback_blas_limit(context: str = "LAPACK callback") -> Iterator[None]:
    """Context for a host callback's dense work: BLAS on :func:`callback_thread_count` threads
    (:func:`blas_limit`), with an :class:`OversubscriptionWarning` naming ``context`` when that exceeds the
    physical cores."""
    n = callback_thread_count()
    if n > physical_cores():
        check_oversubscription(n, context=context)
    with blas_limit(n):
        yield


@functools.lru_cache(maxsize=1)
def physical_cores() -> int:
    """Physical CPU cores (not hyper-threads) available to this process."""
    try:
        avail = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        avail = os.cpu_count() or 1
    cores: set[tuple[str, str]] = set()
    try:
        phys = core = None
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("physical id"):
                phys = line.split(":", 1)[1].strip()
            elif line.startswith("core id"):
                core = line.split(":", 1)[1].strip()
            elif not line.strip():
                if core is not None:
                    cores.add((phys or "0", core))
                phys = core = None
        if core is not None:
            cores.add((phys or "0", core))
    except OSError:
        pass
    n = len(cores) if cores else (os.cpu_count() or 1)
    return max(1, min(n, avail))


@functools.lru_cache(maxsize=1)
def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``, else the platform's processor or machine string)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return _platform.processor() or _platform.machine()


def blas_info() -> list[dict[str, Any]]:
    """The BLAS/OpenMP libraries loaded in this process, as threadpoolctl reports them."""
    from threadpoolctl import threadpool_info

    keep = ("user_api", "internal_api", "version", "num_threads", "architecture", "threading_layer", "prefix")
    return [{k: d.get(k) for k in keep if k in d} for d in threadpool_info()]


def check_oversubscription(threads: int | None = None, *, context: str = "BLAS") -> bool:
    """Warn (``OversubscriptionWarning``) when ``threads`` exceeds the physical cores. Returns True if it does."""
    cores = physical_cores()
    if threads is None:
        try:
            threads = max((d.get("num_threads") or 0) for d in blas_info()) or None
        except Exception:  # pragma: no cover - threadpoolctl failure is not fatal
            threads = None
    if threads is not None and threads > cores:
        warnings.warn(
            f"{context} uses {threads} threads but this machine has {cores} physical cores; "
            f"oversubscription slows dense algebra (set msrm.runtime.configure(blas_threads={cores}))",
            OversubscriptionWarning,
            stacklevel=2,
        )
        return True
    return False


@functools.lru_cache(maxsize=1)
def _git_commit() -> str | None:
    root = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
        if out.returncode != 0:
            return None
        commit = out.stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", "msrm", "data_synth"],
            cwd=root, capture_output=True, text=True, timeout=5,
        )
        return commit + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # pragma: no cover - not available on every platform
        return None


def _version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def execution_info(include_jax: bool | None = None) -> dict[str, Any]:
    """Where and how a computation ran: backend, devices, dtype, versions, threads, BLAS kernel, commit.

    Args:
        include_jax: query JAX for backend/devices/dtype. ``None`` (default) does so only if JAX is already
            imported, so NumPy-only code never pulls JAX in.
    """
    import numpy as np

    blas = blas_info()
    kernel = next((b.get("architecture") for b in blas if b.get("internal_api") in ("openblas", "mkl", "blis")), None)
    info: dict[str, Any] = {
        "backend": "numpy",
        "devices": ["cpu"],
        "device_kind": cpu_model(),
        "dtype": "float64",
        "x64": None,
        "python": _platform.python_version(),
        "numpy": np.__version__,
        "scipy": _version("scipy"),
        "jax": _version("jax"),
        "jaxlib": _version("jaxlib"),
        "numpyro": _version("numpyro"),
        "arviz": _version("arviz"),
        "numba": _version("numba"),
        "cpu_model": cpu_model(),
        "physical_cores": physical_cores(),
        "logical_cpus": os.cpu_count(),
        "blas": blas,
        "blas_kernel": kernel,
        "blas_threads": blas_threads(),
        "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE"),
        "xla_preallocate": os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE"),
        "host_memory": _STATE["host_memory"],
        "hostname": _platform.node(),
        # background load when the evidence was recorded: timings taken under load are upper bounds
        "load_average_1m": _loadavg(),
        "git_commit": _git_commit(),
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    if include_jax is None:
        include_jax = "jax" in sys.modules
    if include_jax:
        import jax

        devices = jax.devices()
        info["backend"] = jax.default_backend()
        info["devices"] = [str(d) for d in devices]
        info["device_kind"] = devices[0].device_kind if devices else None
        info["x64"] = bool(jax.config.jax_enable_x64)
        info["dtype"] = "float64" if info["x64"] else "float32"
        info["matmul_precision"] = jax.config.jax_default_matmul_precision
    return info
