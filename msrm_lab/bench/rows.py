"""Benchmark results rows: one JSON object per measurement, written atomically.

Layout on disk: ``results/<device-label>/<profile>/<notebook>/rows.jsonl`` (plus figures and the executed
notebook beside it). Every row carries ``execution_info``. A capability that is not built yet is recorded with
``status="not_yet_measured"`` and ``value=None``: the book renders that as "not yet measured", never a number.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable

from msrm import atomic
from msrm_lab.provenance import execution_info

__all__ = ["make_row", "write_rows", "read_rows", "STATUSES"]

STATUSES = ("measured", "projected", "not_yet_measured", "refused", "error")


def make_row(
    notebook: str,
    experiment: str,
    metric: str,
    value: float | None,
    unit: str,
    *,
    status: str = "measured",
    info: dict | None = None,
    **params: Any,
) -> dict[str, Any]:
    """One results row.

    Args:
        notebook: the notebook (and book chapter) the row belongs to, e.g. ``"gp_grouped"``.
        experiment: a short name for the measurement, e.g. ``"value_and_grad"``.
        metric: what ``value`` is, e.g. ``"median_s"``.
        value: the measured number (``None`` unless ``status`` is ``"measured"``, or ``"projected"`` for a number
            computed from measured ones, such as a full chain's wall time from a short chain's cost per step).
        unit: ``"s"``, ``"bytes"``, ``"x"``, ...
        status: one of :data:`STATUSES`.
        info: ``execution_info()`` to attach (computed if omitted).
        **params: the sizes and settings of the measurement (K, n_features, threads, ...).
    """
    if status not in STATUSES:
        raise ValueError(f"status must be one of {STATUSES}, got {status!r}")
    if status in ("measured", "projected"):
        if value is None or not math.isfinite(float(value)):
            raise ValueError(f"row {notebook}/{experiment}/{metric}: a {status} value must be finite, got {value!r}")
        value = float(value)
    return {
        "notebook": notebook,
        "experiment": experiment,
        "metric": metric,
        "value": value,
        "unit": unit,
        "status": status,
        "params": params,
        "execution_info": info if info is not None else execution_info(),
    }


def write_rows(path: str | Path, rows: Iterable[dict], *, append: bool = True) -> Path:
    """Write rows to a JSON-lines file atomically (appending to what is there unless ``append=False``)."""
    path = Path(path)
    rows = list(rows)
    if append:
        atomic.append_jsonl(path, rows)
    else:
        atomic.write_bytes(path, b"")
        atomic.append_jsonl(path, rows)
    return path


def read_rows(path: str | Path) -> list[dict]:
    """Read a JSON-lines results file (a torn last line from an old crash is skipped, never fatal)."""
    out = []
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
