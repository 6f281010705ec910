"""A notebook's soft time budget: work that would start after it is skipped and recorded, never cut off half-done.

The notebook runner gives each execution of a short profile (``smoke``, ``quick``) a deadline, passed to the
kernel as the environment variable :data:`DEADLINE_ENV` (seconds since the epoch, ``time.time()``'s clock). A
benchmark asks :func:`skip_reason` before it starts an experiment or a size; once the deadline has passed (or the
work's predicted time would carry it past), the benchmark writes a ``not_yet_measured`` row with that reason
instead of measuring, so a notebook on a loaded machine still finishes and its rows say which sizes it skipped.
Work already started always finishes: the runner's hard time limit, well beyond the deadline, is only the last
resort for a notebook that hangs.

Without the variable (the ``note`` and ``full`` profiles, or a notebook run by hand) nothing is ever skipped, so
the rows of the research note are complete or the notebook fails loudly.
"""
from __future__ import annotations

import functools
import os
import time
from typing import Any, Callable

__all__ = ["DEADLINE_ENV", "deadline", "seconds_left", "load_average_1m", "skip_reason", "skippable",
           "skipped_rows"]

DEADLINE_ENV = "MSRM_LAB_NOTEBOOK_DEADLINE"
"""Environment variable holding the notebook's soft deadline (seconds since the epoch); unset means no budget."""


def deadline() -> float | None:
    """The notebook's soft deadline (``time.time()`` clock), or ``None`` when it has none.

    Raises:
        ValueError: the variable is set to something that is not a finite number of seconds.
    """
    raw = os.environ.get(DEADLINE_ENV, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{DEADLINE_ENV}={raw!r} is not a number of seconds since the epoch") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{DEADLINE_ENV}={raw!r} is not a finite number of seconds since the epoch")
    return value


def seconds_left() -> float | None:
    """Seconds until the soft deadline (negative once it has passed), or ``None`` without a budget."""
    end = deadline()
    return None if end is None else end - time.time()


def skip_reason(predicted_s: float = 0.0) -> str | None:
    """``None`` while work predicted to take ``predicted_s`` seconds fits before the deadline; else why it is skipped.

    With no budget the answer is always ``None``. ``predicted_s`` is the caller's estimate (0 when it has none: the
    work is then skipped only once the deadline has passed).
    """
    left = seconds_left()
    if left is None or left >= max(float(predicted_s), 0.0) and left > 0:
        return None
    if left <= 0:
        return f"skipped: the notebook's time budget was spent {-left:.0f} s before this work could start"
    return (f"skipped: predicted {predicted_s:.0f} s, but only {left:.0f} s of the notebook's time budget were left "
            f"(load average {load_average_1m()})")


def load_average_1m() -> float | None:
    """The one-minute load average, rounded to 0.01 (``None`` where the platform has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # pragma: no cover - not available on every platform
        return None


def skipped_rows(notebook: str, experiment: str, reason: str, *, info: dict | None,
                 metrics: tuple[tuple[str, str], ...] = (("median_s", "s"),), **params: Any) -> list[dict]:
    """``not_yet_measured`` rows, one per ``(metric, unit)``, recording work skipped for the time budget.

    ``params`` name what was skipped (the size, the backend, ...) so the book can say which sizes are missing.
    """
    from .bench.rows import make_row

    return [make_row(notebook, experiment, metric, None, unit, status="not_yet_measured", info=info, reason=reason,
                     skipped_for="time_budget", **params) for metric, unit in metrics]


def skippable(notebook: str, experiment: str, metrics: tuple[tuple[str, str], ...] = (("median_s", "s"),)):
    """Decorate a benchmark's ``rows(size, *, info=None, ...)`` function: once the budget is spent, a call returns
    the experiment's skipped rows (with ``profile=size``) instead of running it; without a budget it always runs.

    For an experiment that runs as a whole; one that loops over sizes asks :func:`skip_reason` per size instead.
    """
    def decorate(rows_fn: Callable[..., list[dict]]) -> Callable[..., list[dict]]:
        @functools.wraps(rows_fn)
        def rows_or_skipped(size: str, *args: Any, info: dict | None = None, **kwargs: Any) -> list[dict]:
            reason = skip_reason()
            if reason is None:
                return rows_fn(size, *args, info=info, **kwargs)
            return skipped_rows(notebook, experiment, reason, info=info, metrics=metrics, profile=size)

        return rows_or_skipped

    return decorate
