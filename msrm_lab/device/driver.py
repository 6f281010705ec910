"""Run the parts of the device run one at a time, each in its own child process, within a time budget.

Layout (``<label>`` from :func:`msrm_lab.notebooks.device.resolve_device`, e.g. ``cuda-h200``)::

    <results>/<label>/<profile>/status.json          every part: done / failed / not_run, wall time, error
    <results>/<label>/<profile>/<part>/rows.jsonl     the rows of a part that finished
    <results>/<label>/<profile>/<part>.failed/        what a failed or stopped part wrote before it ended

A part runs as ``python -m msrm_lab.device _part NAME ...`` in a new process group, writing into a temporary
folder beside its destination (rows appended atomically batch by batch); on success the folder replaces
``<part>/``, otherwise it becomes ``<part>.failed/`` and an earlier ``<part>/`` is removed, so that no rows of an
older run sit beside this run's status. A part is stopped (SIGTERM, then SIGKILL, to its whole group) at its
share of the budget or at what is left of it; a part that cannot get :data:`MIN_PART_S` seconds is not started and
is marked ``not_run``. ``status.json`` is rewritten atomically after every part, so a run killed from outside
still says which parts were done. One process per part keeps the parts independent: a crash, a hang or device
memory left behind by one does not reach the next.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

from msrm import atomic
from msrm_lab.provenance import execution_info

from ..processes import kill_group
from .parts import FAIL_ENV, PARTS, PROFILES

__all__ = ["MIN_PART_S", "STATUS_FILE", "run_device", "child_env", "part_folder"]

MIN_PART_S = 10.0
STATUS_FILE = "status.json"


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def child_env(platform: str, root: Path, fail: Sequence[str] = ()) -> dict[str, str]:
    """Environment of a part's process: the platform pinned (``JAX_PLATFORMS=cpu`` for the CPU; unset for CUDA,
    so the CPU stays visible beside the GPU for the qualification tests), no GPU preallocation, this checkout
    first on the path, and the failure injection when asked."""
    env = dict(os.environ)
    if platform == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
    else:
        env.pop("JAX_PLATFORMS", None)
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    env["PYTHONUNBUFFERED"] = "1"
    env["MSRM_REPO"] = str(root)
    env["PYTHONPATH"] = os.pathsep.join([str(root)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    if fail:
        env[FAIL_ENV] = ",".join(fail)
    return env


def part_folder(base: Path, name: str, failed: bool = False) -> Path:
    return base / (f"{name}.failed" if failed else name)


def _count_rows(path: Path) -> int:
    if not path.is_file():
        return 0
    return sum(1 for line in path.read_text().splitlines() if line.strip())


def _settle(tmp: Path, base: Path, name: str, ok: bool) -> Path:
    """Move a part's temporary folder to ``<part>/`` (ok) or ``<part>.failed/``, removing the other one."""
    final, other = part_folder(base, name, not ok), part_folder(base, name, ok)
    for old in (final, other):
        if old.exists():
            shutil.rmtree(old)
    os.replace(tmp, final)
    return final


def _run_one(name: str, *, profile: str, platform: str, base: Path, root: Path, timeout_s: float,
             fail: Sequence[str]) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=base))
    cmd = [sys.executable, "-m", "msrm_lab.device", "_part", name, "--profile", profile, "--platform", platform,
           "--folder", str(tmp), "--timeout-s", f"{timeout_s:.1f}"]
    log_path = tmp / "part.log"
    t0 = time.perf_counter()
    timed_out = False
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=root, env=child_env(platform, root, fail), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            kill_group(proc, term_grace=5.0)
            rc = proc.returncode
        except BaseException:
            kill_group(proc, term_grace=5.0)
            raise
    wall = time.perf_counter() - t0
    ok = rc == 0 and not timed_out
    error = None
    if timed_out:
        error = f"stopped after its budget of {timeout_s:.0f} s"
    elif not ok:
        lines = [ln for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
        error = next((ln for ln in reversed(lines) if ln.startswith("part failed: ")), None)
        error = error[len("part failed: "):] if error else (lines[-1] if lines else f"exit status {rc}")
    rows = _count_rows(tmp / "rows.jsonl")
    folder = _settle(tmp, base, name, ok)
    return {"name": name, "status": "done" if ok else "failed", "wall_s": round(wall, 2), "rows": rows,
            "error": error, "returncode": rc, "budget_s": round(timeout_s, 1),
            "folder": str(folder.relative_to(base))}


def _write_status(base: Path, status: dict) -> None:
    parts = status["parts"]
    for key in ("done", "failed", "not_run"):
        status[key] = [p["name"] for p in parts if p["status"] == key]
    atomic.write_json(base / STATUS_FILE, status)


def run_device(*, profile: str, platform: str, label: str, results: Path, root: Path,
               parts: Sequence[str] | None = None, budget_s: float | None = None, fail: Sequence[str] = (),
               progress=print) -> dict:
    """Run ``parts`` (default: all, in :data:`~msrm_lab.device.parts.PARTS` order) of ``profile``.

    Args:
        profile: a key of :data:`~msrm_lab.device.parts.PROFILES` (``"device"``, ``"smoke"``).
        platform: ``"cuda"`` or ``"cpu"``, what the parts' processes run JAX on.
        label: the device label of the results folder.
        results: the results root; rows go to ``results/<label>/<profile>/``.
        root: the checkout (working directory of the parts).
        parts: part names to run, in the standard order.
        budget_s: the total time budget (default: the profile's); each part gets at most its share.
        fail: parts made to fail at their start (through :data:`~msrm_lab.device.parts.FAIL_ENV`).
    Returns:
        the status written to ``status.json``.
    Raises:
        ValueError: an unknown profile, part or platform, or a budget that is not positive.
    """
    if profile not in PROFILES:
        raise ValueError(f"profile must be one of {sorted(PROFILES)}, got {profile!r}")
    if platform not in ("cpu", "cuda"):
        raise ValueError(f"platform must be 'cpu' or 'cuda', got {platform!r}")
    wanted = list(PARTS) if not parts else list(parts)
    unknown = [p for p in list(wanted) + list(fail) if p not in PARTS]
    if unknown:
        raise ValueError(f"unknown part(s) {unknown}; parts are {list(PARTS)}")
    wanted = [p for p in PARTS if p in wanted]
    cfg = PROFILES[profile]
    budget = float(cfg["budget_s"] if budget_s is None else budget_s)
    if not budget > 0:
        raise ValueError(f"budget_s must be positive, got {budget_s!r}")
    base = Path(results) / label / profile
    base.mkdir(parents=True, exist_ok=True)
    status = {"profile": profile, "platform": platform, "label": label, "budget_s": budget, "started": _now(),
              "finished": None, "execution_info": execution_info(include_jax=False),
              "parts": [{"name": p, "status": "not_run", "reason": "not reached yet"} for p in wanted]}
    _write_status(base, status)
    t_start = time.perf_counter()
    for i, name in enumerate(wanted):
        left = budget - (time.perf_counter() - t_start)
        share = float(cfg["part_budget_s"][name])
        if left < MIN_PART_S:
            status["parts"][i] = {"name": name, "status": "not_run",
                                  "reason": f"out of time: {max(left, 0.0):.0f} s of the {budget:.0f} s budget left"}
            progress(f"[device] {name}: not run (out of time)")
            _write_status(base, status)
            continue
        progress(f"[device] {name}: running (at most {min(share, left):.0f} s)")
        result = _run_one(name, profile=profile, platform=platform, base=base, root=root,
                          timeout_s=min(share, left), fail=fail)
        status["parts"][i] = result
        progress(f"[device] {name}: {result['status']} in {result['wall_s']:.1f} s, {result['rows']} rows"
                 + (f" ({result['error']})" if result["error"] else ""))
        _write_status(base, status)
    status["finished"] = _now()
    status["wall_s"] = round(time.perf_counter() - t_start, 2)
    _write_status(base, status)
    return status


def load_status(base: Path) -> dict:
    """The ``status.json`` of a results folder ``<results>/<label>/<profile>/``."""
    return json.loads((Path(base) / STATUS_FILE).read_text())
