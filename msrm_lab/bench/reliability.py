"""The reliability appendix's rows: bad inputs tried, errors raised, faults injected and recovered, files lost."""
from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from msrm_lab.budget import skip_reason, skipped_rows
from .rows import make_row

__all__ = ["SIZES", "reliability_rows"]

NOTEBOOK = "reliability"

SIZES = {
    "smoke": dict(kill_delays=[0.3], faults=False),
    "quick": dict(kill_delays=[0.2, 0.9], faults=True),
    "note": dict(kill_delays=[0.1, 0.25, 0.4, 0.6, 0.8, 1.0, 1.3, 1.7], faults=True),
    "full": dict(kill_delays=[0.1, 0.25, 0.4, 0.6, 0.8, 1.0, 1.3, 1.7], faults=True),
}


def reliability_rows(size: str, *, info=None) -> tuple[list[dict], dict]:
    """Run the catalogue, the fault injections and the SIGKILL trials; return (rows, details)."""
    from msrm import atomic
    from msrm_lab.reliability import all_cases, run_catalogue
    from msrm_lab.reliability.crash import kill_during_writes

    sz = SIZES[size]
    catalogue = run_catalogue(all_cases())
    rows = [
        make_row(NOTEBOOK, "bad_inputs", "tried", len(catalogue), "inputs", info=info),
        make_row(NOTEBOOK, "bad_inputs", "documented_error_raised", sum(r["ok"] for r in catalogue), "inputs",
                 info=info),
    ]
    faults = []
    reason = skip_reason()
    if reason is not None:
        rows += skipped_rows(NOTEBOOK, "faults", reason, info=info, metrics=(("injected", "faults"),), profile=size)
    elif sz["faults"]:
        from msrm_lab.reliability.faults import run_faults

        faults = run_faults()
        rows += [
            make_row(NOTEBOOK, "faults", "injected", len(faults), "faults", info=info),
            make_row(NOTEBOOK, "faults", "recovered", sum(f["outcome"] == "recovered" for f in faults), "faults",
                     info=info),
            make_row(NOTEBOOK, "faults", "refused", sum(f["outcome"] == "refused" for f in faults), "faults",
                     info=info),
            make_row(NOTEBOOK, "faults", "failed", sum(f["outcome"] == "failed" for f in faults), "faults",
                     info=info),
        ]
    else:
        rows.append(make_row(NOTEBOOK, "faults", "injected", None, "faults", status="not_yet_measured", info=info,
                             reason="fault injection is skipped in the smoke profile"))
    kills = []
    reason = skip_reason()
    if reason is not None:
        rows += skipped_rows(NOTEBOOK, "sigkill", reason, info=info, metrics=(("kills", "processes"),), profile=size)
        return rows, {"catalogue": catalogue, "faults": faults, "kills": kills}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("npz", "jsonl", "json"):
            path = Path(tmp) / f"target.{kind}"
            for delay in sz["kill_delays"]:
                if kind == "npz":
                    atomic.write_npz(path, {"x": np.arange(3.0), "i": np.array(0)})
                elif kind == "jsonl":
                    from .rows import write_rows

                    write_rows(path, [make_row("crash", "seed", "i", 0.0, "count", info={})], append=False)
                else:
                    atomic.write_json(path, {"i": 0})
                kills.append(kill_during_writes(kind, path, delay))
    rows += [
        make_row(NOTEBOOK, "sigkill", "kills", len(kills), "processes", info=info),
        make_row(NOTEBOOK, "sigkill", "files_lost", sum(not k["readable"] for k in kills), "files", info=info),
    ]
    return rows, {"catalogue": catalogue, "faults": faults, "kills": kills}
