"""Explicit runtime configuration and execution evidence.

Nothing here runs at import time. Call :func:`enable_x64` (or :func:`configure`) before building models:

    import msrm
    msrm.runtime.configure(platform="cpu", blas_threads=2)   # also enables float64
    msrm.runtime.configure(compilation_cache="~/.cache/msrm-jax")   # warm starts: compiled programs kept on disk
    info = msrm.runtime.execution_info()

``execution_info()`` is recorded in every archive and results row. It never imports JAX by itself: a
NumPy-only process (R-MSRM) reports ``backend="numpy"``.
"""
from __future__ import annotations

import contextlib
import ctypes
import datetime as _dt
import functools
import math
import os
import platform as _platform
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
    "step_blas_threads",
    "dense_blas_threads",
    "step_blas_limit",
    "fixed_step_threads",
    "STEP_KINDS",
    "DENSE_THREAD_MIN_FLOPS",
    "idle_cores",
    "compilation_cache",
    "xla_cpu_optimization",
    "compiler_options",
    "callback_threads",
    "callback_thread_count",
    "callback_blas_limit",
    "filter_thread_count",
    "physical_cores",
    "cpu_model",
    "cpu_vector_level",
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
                          "callback_threads": None, "compilation_cache": None, "step_threads": None,
                          "fixed_threads": None,
                          "xla_cpu_optimization": "auto"}

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
              host_memory: str = "reuse", compilation_cache: str | os.PathLike | None = None,
              xla_cpu_optimization: str | int = "auto") -> None:
    """Configure the process explicitly.

    Args:
        platform: ``"cpu"``, ``"cuda"``/``"gpu"`` or ``None`` (JAX's own choice). Must be called before JAX
            initialises its backends.
        blas_threads: threads for BLAS/LAPACK in this process. When given, the limit is applied process-wide
            through threadpoolctl (JAX's CPU Cholesky, LU and triangular solves call the same OpenBLAS as SciPy),
            and msrm's own choices use it as given: R-MSRM's steps (:func:`step_blas_threads`), the LAPACK
            callback (:func:`callback_thread_count`) and the state-space host filter when its largest product
            reaches :data:`DENSE_THREAD_MIN_FLOPS` (:func:`filter_thread_count`). ``None`` leaves the libraries'
            defaults, and msrm chooses a count per call from the size of the work and the cores other processes
            leave idle at that moment (:func:`dense_blas_threads`, :func:`idle_cores`). A value above the physical cores warns.
        preallocate: GPU memory preallocation (``XLA_PYTHON_CLIENT_PREALLOCATE``); off by default so peak
            memory can be measured and shared cards are not grabbed whole.
        host_memory: ``"reuse"`` (default) keeps large host buffers in the heap between calls, ``"system"``
            restores glibc's policy; see :func:`set_host_memory`.
        compilation_cache: a directory for JAX's persistent compilation cache, or ``None`` (default: off, JAX's
            own setting left as it is). With a directory, every program XLA compiles is written there and a later
            process that builds the same model with the same shapes, JAX version and CPU loads it instead of
            compiling again (warm start). The directory is created if missing and must be writable; entries of any
            size and compile time are kept (``jax_persistent_cache_min_entry_size_bytes=-1``,
            ``jax_persistent_cache_min_compile_time_secs=0``). JAX treats the cache as trusted code: do not
            point it at a directory others can write. JAX before 0.12 does not write programs that contain a host
            callback (the CPU LAPACK callback of ``method="callback"``), so those still compile in every process;
            ``method="native"`` programs are cached on every version. Must be set before the first compilation to
            cover it; set later, it covers the compilations that follow. :func:`execution_info` records it.
        xla_cpu_optimization: XLA's backend optimisation level for GP-MSRM's programs on a CPU: ``"auto"``
            (default: each backend's choice, :meth:`msrm.gp.backends.Backend.compile_level`; the state-space
            host filter compiles at level 0, every other backend at XLA's default), ``"default"`` (XLA's default
            everywhere) or an integer 0 to 3 for every backend. It changes compile time and the order of
            floating-point operations inside fused loops (results agree to rounding), never the model. Models
            built afterwards use it; :func:`execution_info` records it.
    """
    if not (xla_cpu_optimization in ("auto", "default")
            or (isinstance(xla_cpu_optimization, int) and not isinstance(xla_cpu_optimization, bool)
                and 0 <= xla_cpu_optimization <= 3)):
        raise ValueError(f"xla_cpu_optimization must be 'auto', 'default' or an integer 0 to 3, "
                         f"got {xla_cpu_optimization!r}")
    if blas_threads is not None:
        if not isinstance(blas_threads, int) or blas_threads < 1:
            raise ValueError(f"blas_threads must be a positive integer, got {blas_threads!r}")
    if host_memory not in HOST_MEMORY_MODES:
        raise ValueError(f"host_memory must be one of {HOST_MEMORY_MODES}, got {host_memory!r}")
    cache_dir = _cache_directory(compilation_cache) if compilation_cache is not None else None
    set_host_memory(host_memory)
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "true" if preallocate else "false"
    _STATE["preallocate"] = bool(preallocate)
    _STATE["xla_cpu_optimization"] = xla_cpu_optimization
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
    if cache_dir is not None:
        _enable_compilation_cache(cache_dir)


def xla_cpu_optimization() -> str | int:
    """The ``xla_cpu_optimization`` setting of :func:`configure` (``"auto"`` until it is called)."""
    return _STATE["xla_cpu_optimization"]


def compiler_options(platform: str, backend_level: int | None) -> dict | None:
    """``jax.jit``'s ``compiler_options`` for a GP-MSRM program on ``platform`` whose backend asks for
    ``backend_level`` (see :func:`configure`'s ``xla_cpu_optimization``); None: XLA's defaults."""
    if platform != "cpu":
        return None
    setting = _STATE["xla_cpu_optimization"]
    level = backend_level if setting == "auto" else None if setting == "default" else setting
    return None if level is None else {"xla_backend_optimization_level": int(level)}


def _cache_directory(path) -> str:
    """``configure``'s ``compilation_cache`` as an absolute, existing, writable directory (created if missing)."""
    if isinstance(path, bool) or not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"compilation_cache must be a directory path (str or os.PathLike) or None, "
                         f"got {type(path).__name__}")
    raw = os.fspath(path)
    if isinstance(raw, bytes) or not raw.strip():
        raise ValueError(f"compilation_cache must be a non-empty directory path, got {path!r}")
    d = Path(raw).expanduser().resolve()
    if d.exists() and not d.is_dir():
        raise ValueError(f"compilation_cache must be a directory, but {str(d)!r} is a file")
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"compilation_cache: cannot create the directory {str(d)!r}: {exc}") from None
    if not os.access(d, os.W_OK | os.X_OK):
        raise ValueError(f"compilation_cache: the directory {str(d)!r} is not writable")
    return str(d)


def _enable_compilation_cache(cache_dir: str) -> None:
    import jax
    from jax.experimental.compilation_cache import compilation_cache as cc

    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    # JAX initialises its cache once, at the first compilation: start it again so the directory counts from now
    cc.reset_cache()
    _STATE["compilation_cache"] = cache_dir


def compilation_cache() -> str | None:
    """The directory of JAX's persistent compilation cache: the one :func:`configure` set, else JAX's own setting
    (``JAX_COMPILATION_CACHE_DIR``) when JAX is imported, else None (off)."""
    if _STATE["compilation_cache"] is not None:
        return _STATE["compilation_cache"]
    if "jax" in sys.modules:
        value = getattr(sys.modules["jax"].config, "jax_compilation_cache_dir", None)
        return str(value) if value else None
    return os.environ.get("JAX_COMPILATION_CACHE_DIR") or None


def blas_threads() -> int:
    """Threads msrm gives BLAS/LAPACK calls: a :func:`fixed_step_threads` count, else the configured value, else the
    physical core count."""
    n = _explicit_threads()
    return n if n is not None else physical_cores()


def _explicit_threads() -> int | None:
    """The count set for every step: a :func:`fixed_step_threads` block's, else :func:`configure`'s, else None."""
    n = _STATE["fixed_threads"]
    if n is None:
        n = _STATE["blas_threads"]
    return None if n is None else int(n)


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


STEP_KINDS = ("banded", "dense")

# Flops (2 m n k for a product) from which a dense step may use more than one BLAS thread. Below it a product
# takes about a millisecond or less on one core, and waking OpenBLAS's workers (which spin while they wait, and
# on a busy machine wait for a core) costs as much as the product.
DENSE_THREAD_MIN_FLOPS = 1.0e8


def _running_elsewhere(proc: str = "/proc") -> int | None:
    """Threads running or runnable right now in other processes: the kernel's count of runnable threads (the
    fourth field of ``/proc/loadavg``, ``running/total``, which includes the thread reading it) less this
    process's own threads in state ``R`` (``/proc/self/task/*/stat``). None where ``/proc`` cannot be read;
    ``proc`` is the directory to read (a copy of its layout in tests).

    Subtracting the process's own threads matters: OpenBLAS workers keep spinning for a moment after a
    multi-threaded call, and JAX runs threads of its own; counted as other work they would make the rule lower
    the count after every call that used more than one thread."""
    try:
        with open(os.path.join(proc, "loadavg")) as f:
            running = int(f.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return None
    if running <= 1:  # the reading thread alone
        return 0
    own = 0
    try:
        tasks = os.listdir(os.path.join(proc, "self", "task"))
    except OSError:  # pragma: no cover - /proc/loadavg readable but not /proc/self
        return None
    for tid in tasks:
        try:
            with open(os.path.join(proc, "self", "task", tid, "stat")) as f:
                stat = f.read()
        except OSError:  # the thread ended while the list was read
            continue
        # the state letter follows the command name, which is in parentheses and may itself contain spaces
        if stat[stat.rindex(")") + 2] == "R":
            own += 1
    return max(0, running - max(own, 1))


def idle_cores() -> int:
    r"""Cores not busy with other work now: the usable cores (:func:`physical_cores`, within this process's
    affinity) less the threads other processes are running, at least 1:

    .. math::

        \mathrm{idle} = \max\bigl(1,\ \min(C,\ C - R_\mathrm{other})\bigr),

    with ``C`` the usable cores and ``R_other`` the runnable threads of other processes at the moment of the
    call (:func:`_running_elsewhere`, read from ``/proc`` on Linux, once per call).

    An instantaneous count, not the load average: the load average trails the machine by about a minute and
    counts this process's own threads, so after a call on two threads it reads as if another process were busy
    and the rule would halve the count it had just found useful. Where ``/proc`` is missing (macOS, Windows)
    the 1-minute load average less this process's one running thread stands in for ``R_other``, rounded to the
    nearest integer."""
    cores = physical_cores()
    others = _running_elsewhere()
    if others is None:
        try:
            others = int(round(max(0.0, os.getloadavg()[0] - 1.0)))
        except OSError:  # pragma: no cover - not available on every platform
            return cores
    return max(1, min(cores, cores - others))


def _check_flops(flops) -> float:
    if isinstance(flops, bool) or not isinstance(flops, (int, float)) or not flops >= 0:
        raise ValueError(f"flops must be a number >= 0, got {flops!r}")
    return float(flops)


def dense_blas_threads(flops: float) -> int:
    r"""The automatic BLAS thread count for dense work whose largest BLAS call takes ``flops`` floating-point
    operations (``2 m n k`` for a product):

    .. math::

        n(f) = \begin{cases} 1 & f < F_0 \\ \mathrm{idle} & f \ge F_0 \end{cases}

    with ``F_0`` = :data:`DENSE_THREAD_MIN_FLOPS` and ``idle`` = :func:`idle_cores`. The machine's load is read only
    when ``f >= F_0``. Explicit counts (:func:`configure`, :func:`fixed_step_threads`, :func:`callback_threads`)
    are applied by the callers: :func:`step_blas_threads` (R-MSRM's steps), :func:`callback_thread_count` (the
    LAPACK callback) and :func:`filter_thread_count` (the state-space host filter)."""
    if _check_flops(flops) < DENSE_THREAD_MIN_FLOPS:
        return 1
    return idle_cores()


def step_blas_threads(kind: str, flops: float = 0.0) -> int:
    """BLAS/LAPACK threads for one numerical step of a fit (R-MSRM's latent, loadings and response steps).

    The rule:

    * an explicit count (:func:`fixed_step_threads`, else :func:`configure` ``blas_threads=n``) is used as given,
      for every step;
    * ``"banded"`` (banded Cholesky and solves, ``scipy.linalg.cholesky_banded``/``solveh_banded``): one
      thread. LAPACK's banded factorization works in blocks of the bandwidth, tens of rows for R-MSRM, and each
      block calls BLAS on products too small to split: extra OpenBLAS threads add only wake-ups, and on a
      machine busy with other work they wait for cores, so the step slows down many times instead of speeding
      up;
    * ``"dense"`` (products and small dense solves) with ``flops`` the size of its largest product:
      :func:`dense_blas_threads` (one thread below :data:`DENSE_THREAD_MIN_FLOPS`, else the cores not busy now,
      :func:`idle_cores`).

    Args:
        kind: one of :data:`STEP_KINDS`.
        flops: for ``"dense"``, the floating-point operations of the step's largest product (``2 m n k``).
    """
    if kind not in STEP_KINDS:
        raise ValueError(f"kind must be one of {STEP_KINDS}, got {kind!r}")
    _check_flops(flops)
    explicit = _explicit_threads()
    if explicit is not None:
        return explicit
    if kind == "banded":
        return 1
    return dense_blas_threads(flops)


@contextlib.contextmanager
def fixed_step_threads(n: int | None) -> Iterator[None]:
    """While open, every BLAS thread count msrm chooses is ``n``: R-MSRM's steps (:func:`step_blas_threads`), the
    LAPACK callback (:func:`callback_thread_count`) and the state-space host filter (:func:`filter_thread_count`),
    whatever the size of their work; with ``n`` None the counts follow their rules (and :func:`configure`).
    Leaving restores the previous setting. For benchmarks that compare the rules with fixed counts in one
    process; models use :func:`configure`."""
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"fixed_step_threads: n must be None or a positive integer, got {n!r}")
    previous = _STATE["fixed_threads"]
    _STATE["fixed_threads"] = n
    try:
        yield
    finally:
        _STATE["fixed_threads"] = previous


@contextlib.contextmanager
def step_blas_limit(kind: str, flops: float = 0.0) -> Iterator[int]:
    """Context: BLAS on :func:`step_blas_threads` threads (:func:`blas_limit`) while a step runs; yields the count.

    Steps nest; a step whose count is already in force (set by an enclosing step) changes nothing, so a solve
    called many times inside a step of the same count costs no threadpoolctl call."""
    n = step_blas_threads(kind, flops)
    if _STATE["step_threads"] == n:
        yield n
        return
    previous = _STATE["step_threads"]
    with blas_limit(n):
        _STATE["step_threads"] = n
        try:
            yield n
        finally:
            _STATE["step_threads"] = previous


@contextlib.contextmanager
def callback_threads(n: int) -> Iterator[None]:
    """Give msrm's host callbacks ``n`` BLAS threads while the ``with`` block is open (benchmarks sweep it;
    :func:`msrm.gp.chains.sample_chains` gives each worker its share of the cores this way).

    The LAPACK callback then runs on ``n`` threads; the state-space host filter does when its largest product
    reaches :data:`DENSE_THREAD_MIN_FLOPS` (:func:`filter_thread_count`). The count is process-wide and read when
    a callback executes, on one of JAX's threads; JAX dispatches asynchronously, so block on the results inside
    the block. Blocks nest: leaving one restores the count that was in force when it was entered. They are not
    meant to be entered from several threads at once. Models use :func:`configure` (``blas_threads=``) instead.
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"callback_threads: n must be a positive integer, got {n!r}")
    previous = _STATE["callback_threads"]
    _STATE["callback_threads"] = n
    try:
        yield
    finally:
        _STATE["callback_threads"] = previous


def callback_thread_count(flops: float | None = None) -> int:
    """BLAS threads for the LAPACK callback's dense work of ``flops`` floating-point operations (one
    factorization: ``n^3 / 3`` for POTRF of an n x n matrix), chosen when the callback runs:

    * a :func:`fixed_step_threads` count, else a :func:`callback_threads` count, else the :func:`configure`
      ``blas_threads`` count, used as given;
    * otherwise :func:`dense_blas_threads` of ``flops``: one thread below :data:`DENSE_THREAD_MIN_FLOPS`, else
      :func:`idle_cores`. ``flops=None`` counts as large work (the idle cores).
    """
    n = _STATE["fixed_threads"]
    if n is None:
        n = _STATE["callback_threads"]
    if n is None:
        n = _STATE["blas_threads"]
    if n is not None:
        return int(n)
    return dense_blas_threads(math.inf if flops is None else flops)


def filter_thread_count(flops: float) -> int:
    """BLAS threads for one call of the state-space host filter whose largest product takes ``flops``
    floating-point operations (``2 S^2 R``: the covariance update of S states at update rank R):

    * a :func:`fixed_step_threads` count, used as given;
    * one thread when ``flops`` is below :data:`DENSE_THREAD_MIN_FLOPS`, whatever :func:`callback_threads` or
      :func:`configure` say: every BLAS call of the filter is then too small to split, and the filter makes
      thousands of them per call;
    * otherwise :func:`callback_thread_count` (an explicit count as given, else :func:`idle_cores`).
    """
    n = _STATE["fixed_threads"]
    if n is not None:
        return int(n)
    if _check_flops(flops) < DENSE_THREAD_MIN_FLOPS:
        return 1
    return callback_thread_count(flops)


@contextlib.contextmanager
def callback_blas_limit(context: str = "LAPACK callback", flops: float | None = None,
                        threads: int | None = None) -> Iterator[int]:
    """Context for a host callback's dense work: BLAS on ``threads`` threads, by default
    :func:`callback_thread_count` of ``flops`` (:func:`blas_limit`), with an :class:`OversubscriptionWarning`
    naming ``context`` when that exceeds the physical cores. Yields the count."""
    n = callback_thread_count(flops) if threads is None else int(threads)
    if n > physical_cores():
        check_oversubscription(n, context=context)
    with blas_limit(n):
        yield n


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


# Widest vector extension first: the first flag the CPU reports names its level. The level decides which BLAS
# kernel OpenBLAS picks and roughly halves or doubles dense float64 throughput, so two CPUs with the same model
# string (virtual machines often report only "AMD EPYC") but different levels are different devices.
_VECTOR_FLAGS = (("avx512f", "avx512"), ("avx2", "avx2"), ("avx", "avx"), ("sve", "sve"), ("asimd", "neon"),
                 ("neon", "neon"), ("sse2", "sse2"))


def cpu_vector_level(flags: str | None = None) -> str | None:
    """The widest SIMD extension the CPU reports: ``"avx512"``, ``"avx2"``, ``"avx"``, ``"sve"``, ``"neon"``,
    ``"sse2"``, or None when it cannot be read.

    ``flags`` is the space-separated flag list (``flags`` or ``Features`` line of ``/proc/cpuinfo``); by default
    it is read from ``/proc/cpuinfo``. On macOS the Apple cores report ``neon``.
    """
    if flags is None:
        flags = ""
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith(("flags", "Features")):
                    flags = line.split(":", 1)[1]
                    break
        except OSError:
            pass
        if not flags and _platform.system() == "Darwin" and _platform.machine() == "arm64":
            flags = "neon"
    have = set(flags.lower().split())
    for flag, level in _VECTOR_FLAGS:
        if flag in have:
            return level
    return None


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
    """Where and how a computation ran: backend, devices, dtype, versions, threads, BLAS kernel, load.

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
        "ducc0": _version("ducc0"),
        "cpu_model": cpu_model(),
        "cpu_vector_level": cpu_vector_level(),
        "physical_cores": physical_cores(),
        "logical_cpus": os.cpu_count(),
        "blas": blas,
        "blas_kernel": kernel,
        "blas_threads": blas_threads(),
        "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE"),
        "xla_preallocate": os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE"),
        "host_memory": _STATE["host_memory"],
        "compilation_cache": compilation_cache(),
        "xla_cpu_optimization": xla_cpu_optimization(),
        "hostname": _platform.node(),
        # background load when the evidence was recorded: timings taken under load are upper bounds
        "load_average_1m": _loadavg(),
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
