"""Merge the results rows of one notebook executed several times, each in its own process.

A notebook's timing from one process is one draw: the machine's load, the kernel's start-up and the allocator's
state all move it. The runner executes a notebook ``N`` times (``run --repeats N``) and :func:`merge_rows` turns
the ``N`` row lists into one: each row's value is the median of its repeats, with the spread beside it in the
row's ``params``:

``process_repeats``
    ``N``, the number of processes the value is the median of.
``process_values``
    every repeat's value, in execution order.
``process_min``, ``process_max``
    the smallest and largest of them (the spread a chapter shows next to the median).
``process_load_average_1m``
    every repeat's ``execution_info.load_average_1m``.
"""
from __future__ import annotations

import copy
import math
import statistics
from typing import Any, Sequence

__all__ = ["KEY_FIELDS", "UNMERGED_STATUSES", "merge_rows"]

KEY_FIELDS = ("experiment", "metric", "unit", "status")
"""What must agree, position by position, between the repeats of one notebook (the two statuses of
:data:`UNMERGED_STATUSES` count as one)."""

UNMERGED_STATUSES = ("not_yet_measured", "refused")
"""Rows that hold no measurement: kept as the first repeat wrote them. Which of the two a repeat writes can
depend on the machine's state at the time (a size skipped because its predicted time exceeds the budget in one
process is tried and refused by the memory guard in another), so a row of either status matches a row of the
other; the merged row lists every repeat's status in ``params["process_statuses"]`` when they differ."""


def _key(row: dict) -> tuple:
    return tuple("unmeasured" if k == "status" and row.get(k) in UNMERGED_STATUSES else row.get(k)
                 for k in KEY_FIELDS)


def _check_same_shape(repeats: Sequence[Sequence[dict]]) -> None:
    first = repeats[0]
    for r, rows in enumerate(repeats[1:], start=1):
        for i, (a, b) in enumerate(zip(first, rows)):
            if _key(a) != _key(b):
                diff = ", ".join(f"{k} {a.get(k)!r} vs {b.get(k)!r}" for k in KEY_FIELDS if a.get(k) != b.get(k))
                raise ValueError(f"repeats disagree at row {i}: repeat 0 and repeat {r} differ in {diff} "
                                 f"(rows are matched by position; each repeat must write the same sequence of "
                                 f"{', '.join(KEY_FIELDS)})")
        if len(rows) != len(first):
            i = min(len(rows), len(first))
            longer, extra = (0, first[i]) if len(first) > len(rows) else (r, rows[i])
            raise ValueError(f"repeats disagree at row {i}: repeat 0 wrote {len(first)} rows, repeat {r} wrote "
                             f"{len(rows)}; the first row only repeat {longer} has is "
                             f"{extra.get('experiment')!r}/{extra.get('metric')!r}")


def _number(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"a row's value must be a number or None, got {value!r}")
    return float(value)


def _load(row: dict) -> float | None:
    info = row.get("execution_info")
    return info.get("load_average_1m") if isinstance(info, dict) else None


def _merge_one(rows: Sequence[dict]) -> dict:
    first = rows[0]
    if first.get("status") in UNMERGED_STATUSES:
        out = copy.deepcopy(first)
        statuses = [r.get("status") for r in rows]
        if len(set(statuses)) > 1:
            out["params"] = dict(out.get("params") or {}, process_statuses=statuses,
                                 process_reasons=[(r.get("params") or {}).get("reason") for r in rows])
        return out
    values = [_number(r.get("value")) for r in rows]
    loads = [_load(r) for r in rows]
    out = copy.deepcopy(first)
    params = dict(out.get("params") or {})
    present = [v for v in values if v is not None and math.isfinite(v)]
    missing = [i for i, v in enumerate(values) if v is None or not math.isfinite(v)]
    if not missing:
        out["value"] = float(statistics.median(present))
    elif len(missing) == len(values):
        out["value"] = None
    else:
        out["value"] = None
        out["status"] = "error"
        params["reason"] = (f"the value is missing (or not finite) in repeat(s) {missing} of {len(values)} and "
                            f"present in the others, so no median is given")
    params.update({
        "process_repeats": len(rows),
        "process_values": values,
        "process_min": min(present) if present and not missing else None,
        "process_max": max(present) if present and not missing else None,
        "process_load_average_1m": loads,
    })
    out["params"] = params
    info = out.get("execution_info")
    if isinstance(info, dict):
        known = [x for x in loads if x is not None]
        info["load_average_1m"] = max(known) if known else info.get("load_average_1m")
    return out


def merge_rows(repeats: Sequence[Sequence[dict]]) -> list[dict]:
    """One row list from the row lists of ``N`` executions of the same notebook.

    Rows are matched by position. For each position the merged row is the first repeat's row with:

    - ``value``: the median of the repeats' values. If every repeat's value is ``None`` it stays ``None``; if some
      are ``None`` (or not finite) and others are numbers, the row becomes ``status="error"``, ``value=None``,
      with ``params["reason"]`` naming the repeats that lack it.
    - ``params``: the first repeat's, plus ``process_repeats`` (``N``), ``process_values`` (the list),
      ``process_min``, ``process_max`` (``None`` unless every repeat has a value) and
      ``process_load_average_1m`` (each repeat's ``execution_info.load_average_1m``).
    - ``execution_info``: the first repeat's, except ``load_average_1m``, which is the **largest** of the
      repeats' (the merged value is only as clean as the busiest process it came from).

    Rows with status ``not_yet_measured`` or ``refused`` carry no measurement and are kept as the first repeat
    wrote them; the two statuses match each other, and where the repeats wrote different ones the merged row's
    ``params`` gains ``process_statuses`` and ``process_reasons`` (each repeat's). With one repeat the rows gain the ``process_*`` fields and are otherwise unchanged.

    Args:
        repeats: ``N >= 1`` lists of rows (``msrm_lab.bench.rows.make_row`` dicts), one per execution.

    Raises:
        ValueError: no repeats, or the repeats do not share the same sequence of
            ``(experiment, metric, unit, status)`` (the message names the first mismatch), or a value is not a
            number.
    """
    repeats = [list(r) for r in repeats]
    if not repeats:
        raise ValueError("repeats must hold at least one list of rows, got none")
    _check_same_shape(repeats)
    return [_merge_one([rows[i] for rows in repeats]) for i in range(len(repeats[0]))]
