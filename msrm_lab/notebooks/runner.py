"""Execute the parameterised notebooks with papermill, one isolated child process per execution.

For each ``notebooks/NN_<stem>.ipynb`` (sorted) the runner, ``repeats`` times (one by default):

1. makes a hidden temporary folder ``results/<label>/<profile>/.<stem>.tmp-*`` (the book never reads it);
2. starts a child Python (``python -m msrm_lab.notebooks _execute``) that calls ``papermill.execute_notebook`` with
   ``kernel_name="python3"``, ``cwd`` = the repository root and the parameters ``profile``, ``device`` and
   ``out_dir`` (the temporary folder); each execution is a fresh process and kernel; in the short profiles the
   child gets a soft deadline (its share of :data:`SITTING_BUDGET_S`, :mod:`msrm_lab.budget`) after which its
   benchmarks start no new experiment or size and record what they skipped; the child is killed, with its process
   group, past the hard time limit; the first failed execution ends the notebook's run.

Then, when every execution succeeded (papermill finished and the notebook wrote ``rows.jsonl``), the rows of the
repeats are merged into the first one's folder (:func:`msrm_lab.notebooks.repeats.merge_rows`: median value,
spread in ``params``; figures and ``executed.ipynb`` are the first execution's) and that folder is swapped into
``results/<label>/<profile>/<stem>/``. On failure (an execution failed, or the repeats disagree) any earlier
``<stem>/`` is left untouched and the failing attempt moves to ``<stem>.failed/`` beside it.

Each folder gets a ``status.json`` (ok/failed, error text, total wall time, the budget and time limit, the rows
skipped for the budget, ``repeats`` and each execution's wall
time, load average and commit under ``repeat_runs``, ``execution_info``). One failing notebook never stops the
others; :func:`run_notebooks` returns every result and the CLI's exit code says whether all passed.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple, Sequence

from msrm import atomic
from msrm_lab.provenance import execution_info
from ..paths import repo_root
from ..processes import kill_group
from ..bench.rows import read_rows, write_rows
from ..budget import DEADLINE_ENV, load_average_1m
from .device import resolve_device
from .repeats import merge_rows

__all__ = ["PROFILES", "SITTING_BUDGET_S", "SHARE_WEIGHTS", "MIN_SHARE_S", "NotebookResult", "check_repeats",
           "discover", "notebook_stem", "run_notebook", "run_notebooks"]

PROFILES = ("smoke", "quick", "note", "full")
SITTING_BUDGET_S = {"smoke": 240.0, "quick": 330.0, "note": None, "full": None}
"""Soft time budget of a sitting (every notebook run once) per profile (:mod:`msrm_lab.budget`). Each notebook's
execution gets a share of what is left of the sitting's budget, in proportion to its weight among the notebooks
still to run (:data:`SHARE_WEIGHTS`), at least :data:`MIN_SHARE_S`; a notebook that finishes early leaves its time
to the ones after it; experiments and sizes that would start after its share are recorded as skipped. The note and
full profiles have none: their rows are complete or the notebook fails. The quick budget is below the ten minutes
``make book``'s sitting should take on an idle 2-core machine by about the work no notebook can skip (its kernel's
start, its imports and the first experiment it always runs)."""
SHARE_WEIGHTS = {"inventory": 0.2, "synthetic_study": 0.2, "linalg": 0.5, "gradient_nuts": 3.0, "state_space": 2.0}
"""Relative share of a sitting's budget per notebook (1 where not named): the notebooks that compile and sample
the most get more."""
MIN_SHARE_S = 20.0
"""The smallest soft budget a notebook gets, even when the sitting's budget is spent (its first experiment runs)."""
DEFAULT_TIMEOUT_S = {"smoke": 600.0, "quick": 900.0, "note": 5400.0, "full": 6 * 3600.0}
"""Hard limit of one execution per profile: the child is killed past it. For the short profiles it lies far beyond
the soft budget, so that work started just before the budget ran out can finish on a machine shared with other
busy processes."""


class NotebookResult(NamedTuple):
    """What happened to one notebook.

    Attributes:
        stem: notebook name without the number prefix (``"inventory"``), also the results folder name.
        status: ``"ok"`` or ``"failed"``.
        folder: where its results are now (``<stem>/`` on success, ``<stem>.failed/`` on failure).
        wall_s: seconds from start to finish of the child process.
        error: error text (``None`` when ok).
        skipped: ``experiment/metric`` of every row skipped for the time budget (as in ``status.json``).
    """

    stem: str
    status: str
    folder: Path
    wall_s: float
    error: str | None
    skipped: tuple[str, ...] = ()


def notebook_stem(path: str | Path) -> str:
    """``00_inventory.ipynb`` -> ``inventory`` (the number prefix orders notebooks, the rest names the chapter)."""
    return re.sub(r"^\d+[_-]", "", Path(path).stem)


def discover(notebooks_dir: str | Path, only: Sequence[str] | None = None) -> list[Path]:
    """The notebooks to run, sorted by file name; ``only`` filters by stem (``inventory``) or file stem.

    Raises:
        ValueError: the folder is missing, holds no notebook, or a name in ``only`` matches none.
    """
    folder = Path(notebooks_dir)
    if not folder.is_dir():
        raise ValueError(f"notebooks folder {str(folder)!r} does not exist")
    paths = sorted(p for p in folder.glob("*.ipynb") if not p.name.startswith("."))
    if not paths:
        raise ValueError(f"notebooks folder {str(folder)!r} holds no .ipynb file")
    if not only:
        return paths
    names = {p: {p.stem, notebook_stem(p)} for p in paths}
    unknown = [n for n in only if not any(n in v for v in names.values())]
    if unknown:
        avail = ", ".join(notebook_stem(p) for p in paths)
        raise ValueError(f"--only {', '.join(unknown)}: no such notebook (available: {avail})")
    return [p for p in paths if names[p] & set(only)]


def _child_env(platform: str, root: Path, deadline: float | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop(DEADLINE_ENV, None)
    if deadline is not None:
        env[DEADLINE_ENV] = repr(deadline)
    if platform == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
    else:
        env.pop("JAX_PLATFORMS", None)
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    env["PYTHONUNBUFFERED"] = "1"
    # the kernel imports this checkout's msrm and data_synth, installed or not
    env["PYTHONPATH"] = os.pathsep.join([str(root)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def _checkout(notebook: Path) -> Path:
    """The notebook's working directory: the checkout that holds it, else the working directory's checkout
    (a notebook kept elsewhere still imports this checkout's code and writes into its results)."""
    try:
        return repo_root(notebook.parent)
    except FileNotFoundError:
        return repo_root()


def _read_error(tmp: Path, stderr_tail: str) -> str:
    err_file = tmp / "error.json"
    if err_file.exists():
        with contextlib.suppress(ValueError, OSError):
            err = json.loads(err_file.read_text())
            return f"{err.get('type')}: {err.get('message')}".strip()
    return stderr_tail.strip()[-2000:] or "the notebook process failed without an error message"


def check_repeats(repeats: object) -> int:
    """``repeats`` as a whole number of executions, at least one.

    Raises:
        ValueError: ``repeats`` is not a whole number or is below one.
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a whole number of executions, at least 1, got {repeats!r}")
    return repeats


class _Execution(NamedTuple):
    """One papermill execution of a notebook into its own folder."""

    folder: Path
    error: str | None
    wall_s: float
    started: str
    load_average_1m: float | None
    git_commit: str | None


def _execute_once(path: Path, root: Path, stem: str, tmp: Path, *, profile: str, platform: str,
                  timeout: float, budget: float | None) -> _Execution:
    """Run the notebook once in a fresh child process (its own kernel) with ``out_dir=tmp``; with a ``budget`` the
    child's soft deadline is that many seconds after its start."""
    parameters = {"profile": profile, "device": platform, "out_dir": str(tmp)}
    cmd = [sys.executable, "-m", "msrm_lab.notebooks", "_execute", "--input", str(path),
           "--output", str(tmp / "executed.ipynb"), "--cwd", str(root), "--parameters", json.dumps(parameters),
           "--error-file", str(tmp / "error.json"), "--timeout", str(timeout)]
    commit = execution_info(include_jax=False).get("git_commit")
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime())
    t0 = time.perf_counter()
    deadline = None if budget is None else time.time() + budget
    with tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.Popen(cmd, cwd=root, env=_child_env(platform, root, deadline), stdout=log,
                                stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            rc = None
        except BaseException:
            kill_group(proc)
            raise
        log.seek(0)
        tail = log.read()[-4000:]
    wall = time.perf_counter() - t0
    error = None
    if rc is None:
        error = f"time limit: the notebook ran past {timeout:g} s and was stopped"
    elif rc != 0:
        error = _read_error(tmp, tail)
    elif not (tmp / "rows.jsonl").is_file():
        error = f"the notebook finished but wrote no rows.jsonl into out_dir ({stem})"
    return _Execution(tmp, error, wall, started, load_average_1m(), commit)


def _merge_into_first(runs: Sequence[_Execution]) -> str | None:
    """Write the merged rows of every run into the first run's ``rows.jsonl``; the error text, or ``None``."""
    commits = sorted({str(r.git_commit) for r in runs})
    if len(commits) > 1:
        return (f"the checkout changed between repeats (commits {', '.join(commits)}): a median over two "
                f"versions of the code is not a measurement of either")
    try:
        merged = merge_rows([read_rows(r.folder / "rows.jsonl") for r in runs])
    except ValueError as exc:
        return f"the repeats cannot be merged: {exc}"
    write_rows(runs[0].folder / "rows.jsonl", merged, append=False)
    return None


def run_notebook(
    path: str | Path,
    *,
    profile: str,
    platform: str,
    label: str,
    results: str | Path,
    timeout: float | None = None,
    repeats: int = 1,
    budget: float | None | str = "profile",
) -> NotebookResult:
    """Execute one notebook into ``results/<label>/<profile>/<stem>/`` (see the module docstring).

    Args:
        path: the ``.ipynb`` to run.
        profile: one of :data:`PROFILES`, passed to the notebook's ``profile`` parameter.
        platform: ``"cpu"`` or ``"cuda"``, passed as the ``device`` parameter (and ``JAX_PLATFORMS=cpu`` for CPU).
        label: the device label, the first folder level under ``results``.
        results: the results root.
        timeout: seconds for one execution of the notebook (the hard limit); ``None`` uses the profile's default.
        budget: the soft budget of one execution in seconds (:mod:`msrm_lab.budget`); ``"profile"`` takes the
            profile's sitting budget (:data:`SITTING_BUDGET_S`), as for a sitting of this notebook alone, but at
            most half of ``timeout``; ``None`` sets none. A budget given in seconds must lie below ``timeout``.
        repeats: how many times to execute it, each in its own process and hidden folder; with more than one the
            rows are merged by :func:`msrm_lab.notebooks.repeats.merge_rows` (median value, spread in ``params``)
            and the figures and ``executed.ipynb`` are the first execution's. The first failed execution stops
            the notebook and is recorded as a failed run.
    """
    path = Path(path).resolve()
    root = _checkout(path)
    if profile not in PROFILES:
        raise ValueError(f"profile must be one of {PROFILES}, got {profile!r}")
    if platform not in ("cpu", "cuda"):
        raise ValueError(f"platform must be 'cpu' or 'cuda', got {platform!r}")
    repeats = check_repeats(repeats)
    timeout = DEFAULT_TIMEOUT_S[profile] if timeout is None else float(timeout)
    if not timeout > 0:
        raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
    if budget == "profile":  # the profile's budget, within half of a shorter time limit given here
        budget = None if SITTING_BUDGET_S[profile] is None else min(SITTING_BUDGET_S[profile], 0.5 * timeout)
    budget = _check_budget(budget, timeout)
    stem = notebook_stem(path)
    base = Path(results).resolve() / label / profile
    base.mkdir(parents=True, exist_ok=True)
    final, failed = base / stem, base / f"{stem}.failed"
    runs: list[_Execution] = []
    folders: list[Path] = []
    try:
        error: str | None = None
        for _ in range(repeats):
            tmp = Path(tempfile.mkdtemp(prefix=f".{stem}.tmp-", dir=base))
            folders.append(tmp)
            runs.append(_execute_once(path, root, stem, tmp, profile=profile, platform=platform, timeout=timeout,
                                      budget=budget))
            error = runs[-1].error
            if error is not None:
                break
        if error is None and repeats > 1:
            error = _merge_into_first(runs)
        keep = runs[0] if error is None else next((r for r in runs if r.error is not None), runs[0])
        wall = sum(r.wall_s for r in runs)
        status = {
            "notebook": stem, "file": path.name, "profile": profile, "device": platform, "label": label,
            "status": "ok" if error is None else "failed", "error": error, "wall_s": round(wall, 3),
            "started": runs[0].started,
            "parameters": {"profile": profile, "device": platform},
            "budget_s": budget, "timeout_s": timeout,
            "skipped_for_budget": _skipped(keep.folder),
            "repeats": repeats,
            "repeat_runs": [{"wall_s": round(r.wall_s, 3), "started": r.started,
                             "load_average_1m": r.load_average_1m, "git_commit": r.git_commit,
                             "status": "ok" if r.error is None else "failed"} for r in runs],
            "previous_results_kept": error is not None and final.exists(),
            "execution_info": execution_info(include_jax=False),
        }
        atomic.write_json(keep.folder / "status.json", status)
        if error is None:
            _swap_in(keep.folder, final)
            shutil.rmtree(failed, ignore_errors=True)
            return NotebookResult(stem, "ok", final, wall, None, tuple(status["skipped_for_budget"]))
        shutil.rmtree(failed, ignore_errors=True)
        os.replace(keep.folder, failed)
        return NotebookResult(stem, "failed", failed, wall, error)
    finally:
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)


def _check_budget(budget: float | None, timeout: float) -> float | None:
    if budget is None:
        return None
    try:
        budget = float(budget)
    except (TypeError, ValueError):
        raise ValueError(f"budget must be seconds or None, got {budget!r}") from None
    if not 0 < budget < timeout:
        raise ValueError(f"budget must be positive seconds below the time limit of {timeout:g} s, got {budget!r}")
    return budget


def _skipped(folder: Path) -> list[str]:
    """``experiment/metric`` of every row the execution skipped for its time budget (empty when none)."""
    if not (folder / "rows.jsonl").is_file():
        return []
    return [f"{r.get('experiment')}/{r.get('metric')}" for r in read_rows(folder / "rows.jsonl")
            if (r.get("params") or {}).get("skipped_for") == "time_budget"]


def _swap_in(tmp: Path, final: Path) -> None:
    """Put ``tmp`` at ``final``; an existing ``final`` is renamed aside first and removed only after the swap."""
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}-{time.time_ns()}")
        os.replace(final, old)
    try:
        os.replace(tmp, final)
    except BaseException:
        if old is not None:
            os.replace(old, final)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def run_notebooks(
    *,
    profile: str = "quick",
    device: str = "auto",
    only: Sequence[str] | None = None,
    timeout: float | None = None,
    results: str | Path | None = None,
    notebooks_dir: str | Path | None = None,
    progress: bool = True,
    repeats: int = 1,
    budget: float | None | str = "profile",
) -> list[NotebookResult]:
    """Run every notebook (or those named in ``only``) for one profile on this machine's device, one after the
    other in one sitting, each ``repeats`` times (see :func:`run_notebook`).

    ``budget`` is the soft budget of the whole sitting in seconds (``"profile"``: :data:`SITTING_BUDGET_S`;
    ``None``: none), shared among the notebooks as :data:`SITTING_BUDGET_S` describes; each execution of a
    notebook with ``repeats`` gets that notebook's share. ``timeout`` is each execution's hard limit.

    Returns one :class:`NotebookResult` per notebook, in order; failures are recorded, never raised. When the
    checkout's commit differs between notebooks of the sitting a warning says so on stderr (each notebook's
    ``status.json`` records the commit of every execution).
    """
    from tqdm.auto import tqdm

    if profile not in PROFILES:
        raise ValueError(f"profile must be one of {PROFILES}, got {profile!r}")
    repeats = check_repeats(repeats)
    paths = discover(repo_root() / "notebooks" if notebooks_dir is None else notebooks_dir, only)
    platform, label = resolve_device(device)
    results = repo_root() / "results" if results is None else Path(results)
    out: list[NotebookResult] = []
    commits: set[str] = set()
    bar = tqdm(paths, desc=f"{label}/{profile}", unit="notebook", disable=not progress, file=sys.stderr)
    hard = DEFAULT_TIMEOUT_S[profile] if timeout is None else float(timeout)
    sitting = _check_budget(SITTING_BUDGET_S[profile] if budget == "profile" else budget, float("inf"))
    t_start = time.perf_counter()
    weights = [SHARE_WEIGHTS.get(notebook_stem(p), 1.0) for p in paths]
    for i, p in enumerate(bar):
        bar.set_postfix_str(notebook_stem(p))
        share = None
        if sitting is not None:
            left = float(sitting) - (time.perf_counter() - t_start)
            share = min(max(left * weights[i] / sum(weights[i:]), MIN_SHARE_S), 0.5 * hard)
        res = run_notebook(p, profile=profile, platform=platform, label=label, results=results, timeout=timeout,
                           repeats=repeats, budget=share)
        out.append(res)
        commits.update(_commits(res.folder))
        skipped = res.skipped
        bar.write(f"{res.status:6s} {res.stem:24s} {res.wall_s:8.1f} s  {res.folder}"
                  + (f"\n       {len(skipped)} rows skipped for the time budget" if skipped else "")
                  + (f"\n       {res.error.splitlines()[-1] if res.error else ''}" if res.error else ""),
                  file=sys.stderr)
    if len(commits) > 1:
        print(f"warning: the checkout changed during the sitting; the notebooks ran at commits "
              f"{', '.join(sorted(commits))}", file=sys.stderr)
    return out


def _commits(folder: Path) -> set[str]:
    """The commits of every execution recorded in a notebook folder's ``status.json``."""
    with contextlib.suppress(ValueError, OSError):
        status = json.loads((folder / "status.json").read_text())
        return {str(r.get("git_commit")) for r in status.get("repeat_runs", [])}
    return set()
