"""Embarrassingly parallel tasks (restarts, chains, runs) through joblib, locally or on a Dask cluster.

One function, :func:`run_tasks`, maps ``fn`` over ``tasks`` and returns one :class:`TaskResult` per task in
submission order. A task that raises does not stop the others: its result carries ``error`` (the traceback text)
and ``value=None``. Three backends, nothing home-made:

- ``"loky"``: joblib's process pool on this machine. BLAS threads inside each worker are limited with
  threadpoolctl to ``physical_cores // n_jobs`` (at least 1) so that workers do not oversubscribe the cores;
- ``"dask"``: joblib's Dask backend on a running ``dask.distributed.Client`` (the ``client`` argument, else the
  current default client); BLAS threads are limited to 1 per task unless ``blas_threads`` says otherwise;
- ``"sequential"``: a plain loop in this process (BLAS threads untouched unless ``blas_threads`` is given).

Determinism: a task's result depends only on ``fn`` and the task (seeds travel inside the task), never on the
backend or on which worker ran it.
"""
from __future__ import annotations

import contextlib
import traceback
from typing import Any, Callable, NamedTuple, Sequence

__all__ = ["TaskResult", "run_tasks", "BACKENDS", "resolve_n_jobs"]

BACKENDS = ("loky", "dask", "sequential")


class TaskResult(NamedTuple):
    """The outcome of one task.

    Fields:
        index: position of the task in the submitted sequence.
        task: the task itself (for a restart: its seed description).
        value: what ``fn(task)`` returned, or None when it raised.
        error: the traceback text when ``fn(task)`` raised, else None.
    """

    index: int
    task: Any
    value: Any
    error: str | None

    @property
    def ok(self) -> bool:
        return self.error is None


def _run_one(fn: Callable, index: int, task: Any, threads: int | None) -> TaskResult:
    """Call ``fn(task)`` under a BLAS thread limit; turn an exception into a reported error."""
    try:
        if threads is None:
            ctx = contextlib.nullcontext()
        else:
            from threadpoolctl import threadpool_limits

            ctx = threadpool_limits(limits=int(threads))
        with ctx:
            value = fn(task)
        return TaskResult(index, task, value, None)
    except Exception:  # noqa: BLE001 - every failure is reported, none is fatal
        return TaskResult(index, task, None, traceback.format_exc())


def resolve_n_jobs(n_jobs: int | None, n_tasks: int) -> int:
    """Worker processes for ``n_tasks`` tasks: ``None`` = min(tasks, physical cores); ``-1`` = physical cores."""
    from .runtime import physical_cores

    if n_jobs is None:
        return max(1, min(n_tasks, physical_cores()))
    if isinstance(n_jobs, bool) or not isinstance(n_jobs, int) or n_jobs == 0 or n_jobs < -1:
        raise ValueError(f"n_jobs must be None, -1 or a positive integer, got {n_jobs!r}")
    if n_jobs == -1:
        return max(1, min(n_tasks, physical_cores()))
    return max(1, min(n_jobs, n_tasks))


def _check(backend: str, client, blas_threads, desc) -> None:
    """Raise ValueError for an unknown backend, a client without dask, a bad blas_threads or a non-string desc."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if client is not None and backend != "dask":
        raise ValueError(f"client is only used with backend='dask', got backend={backend!r}")
    if blas_threads is not None and (
        isinstance(blas_threads, bool) or not isinstance(blas_threads, int) or blas_threads < 1
    ):
        raise ValueError(f"blas_threads must be None or a positive integer, got {blas_threads!r}")
    if desc is not None and not isinstance(desc, str):
        raise ValueError(f"desc must be a string or None, got {desc!r}")


def _dask_client(client):
    """``client`` if given, else the current dask.distributed client; ValueError when dask or a client is missing."""
    try:
        from distributed import get_client
    except ImportError as err:  # pragma: no cover - dask is an optional extra
        raise ValueError("backend='dask' needs dask.distributed (pip install 'msrm[dask]')") from err
    if client is not None:
        return client
    try:
        return get_client()
    except ValueError:
        raise ValueError(
            "backend='dask' needs a running dask.distributed Client: pass client=Client(...) or create one first"
        ) from None


def run_tasks(
    fn: Callable[[Any], Any],
    tasks: Sequence[Any],
    *,
    n_jobs: int | None = None,
    backend: str = "loky",
    client=None,
    progress: bool = False,
    desc: str | None = None,
    blas_threads: int | None = None,
) -> list[TaskResult]:
    """Run ``fn(task)`` for every task; collect results (or errors) in submission order.

    Args:
        fn: a picklable callable of one argument (module-level function or ``functools.partial``).
        tasks: the tasks; each is passed to ``fn`` as is and returned in :attr:`TaskResult.task`.
        n_jobs: worker processes for ``"loky"`` (``None``: min(tasks, physical cores)); for ``"dask"`` the
            number of tasks in flight (``None``: all at once); ignored by ``"sequential"``.
        backend: ``"loky"``, ``"dask"`` or ``"sequential"``.
        client: a ``dask.distributed.Client`` (``backend="dask"`` only; default: the current client).
        progress: show a tqdm bar over tasks.
        desc: the bar's label.
        blas_threads: BLAS threads inside each task (threadpoolctl). Default: physical_cores // n_jobs for
            ``"loky"``, 1 for ``"dask"``, unchanged for ``"sequential"``.

    Returns:
        list of :class:`TaskResult`, one per task, in submission order.
    """
    if not callable(fn):
        raise ValueError(f"fn must be callable, got {type(fn).__name__}")
    _check(backend, client, blas_threads, desc)
    tasks = list(tasks)
    if not tasks:
        return []
    from tqdm.auto import tqdm

    bar = tqdm(total=len(tasks), desc=desc, disable=not progress, leave=False)
    try:
        if backend == "sequential":
            out = []
            for i, t in enumerate(tasks):
                out.append(_run_one(fn, i, t, blas_threads))
                bar.update(1)
            return out

        from joblib import Parallel, delayed, parallel_config

        if backend == "loky":
            jobs = resolve_n_jobs(n_jobs, len(tasks))
            if blas_threads is None:
                from .runtime import physical_cores

                blas_threads = max(1, physical_cores() // jobs)
            config = parallel_config(backend="loky", n_jobs=jobs)
        else:
            dask_client = _dask_client(client)
            jobs = -1 if n_jobs is None else resolve_n_jobs(n_jobs, len(tasks))
            if blas_threads is None:
                blas_threads = 1
            config = parallel_config(backend="dask", n_jobs=jobs, client=dask_client)
        with config:
            gen = Parallel(return_as="generator")(
                delayed(_run_one)(fn, i, t, blas_threads) for i, t in enumerate(tasks)
            )
            out = []
            for r in gen:
                out.append(r)
                bar.update(1)
        return out
    finally:
        bar.close()
