"""Are a notebook's results rows newer than the code they measure?

Every row records the commit it was measured at (``execution_info()["git_commit"]``, with ``-dirty`` when
``msrm/`` or ``data_synth/`` had uncommitted changes). :data:`MEASURED_PATHS` names, per notebook, the code whose
change can change its numbers: the ``msrm`` modules its benchmark calls (read from each ``msrm_lab/bench``
module's imports and the ``msrm`` entry points it calls), the benchmark module itself and the bench helpers it
imports (``measure.py`` holds the timing), and ``data_synth/`` where the data are synthesised. The rows of a
notebook are fresh when every row's commit is at or after the newest commit touching those paths (``git log -1
-- paths``, then ``git merge-base --is-ancestor``); a row whose commit is missing or unknown to git counts as
stale. Chapters call:

    notice = freshness_notice("state_space")     # Markdown of a {warning} admonition, or "" when fresh
    show_notices(["state_space"], df)            # displays each stale notebook's notice, nothing when fresh

:func:`freshness_notice` also reports a stale notebook outside the page: a :class:`StaleResultsWarning`
(``warnings.warn``) and one line on the process's own standard error (``sys.__stderr__``). In a book build the
chapter runs in a Jupyter kernel, where a Python warning is cell output on the stderr stream, which the book's
configuration drops (``stderr_output: remove``: no Sphinx warning, so ``-W`` does not fail on it, and no line in
the log either); the kernel's own standard error is the build's terminal, so that line is what the build log
shows.
"""
from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any, Iterable, Mapping

import pandas as pd

__all__ = ["MEASURED_PATHS", "StaleResultsWarning", "stale_notebooks", "freshness_notice", "show_notices"]


class StaleResultsWarning(UserWarning):
    """A notebook's results rows are older than the code they measure (or their commit is unknown)."""


# The model core every fit goes through (data model, model forms, services they import).
_CORE = ("msrm/data.py", "msrm/spec.py", "msrm/params.py", "msrm/nodes.py", "msrm/operators.py",
         "msrm/kernels.py", "msrm/responses.py", "msrm/runtime.py", "msrm/parallel.py", "msrm/latent.py")
# GP-MSRM: the model, its backends (dense, grouped, state space), MAP, NUTS and the linear algebra under them.
_GP = _CORE + ("msrm/gp/",)
# R-MSRM (msrm.fit_rmsrm and its steps).
_RMSRM = _CORE + ("msrm/rmsrm/",)
_BENCH = "msrm_lab/bench/"
_MEASURE = _BENCH + "measure.py"

MEASURED_PATHS: dict[str, tuple[str, ...]] = {
    # msrm.runtime.execution_info and configure only
    "inventory": ("msrm/runtime.py",),
    # data_synth.synthetic_dataset, msrm.nodes (prepare_nodes, response_groups), msrm.latent_grid
    "synthetic_study": ("data_synth/", "msrm/data.py", "msrm/spec.py", "msrm/nodes.py", "msrm/operators.py",
                        "msrm/responses.py", "msrm/kernels.py"),
    # bench/linalg.py: msrm.gp.linalg (quad_logdet, the LAPACK callback), msrm.gp.memory, msrm.runtime
    "linalg": (_BENCH + "linalg.py", _MEASURE, "msrm/gp/linalg/", "msrm/gp/memory.py", "msrm/runtime.py"),
    # bench/gp.py: GPMSRM (grouped), msrm.gp.likelihood, linalg, prepare; bench/linalg.spd_matrix; data_synth
    "gp_grouped": (_BENCH + "gp.py", _BENCH + "linalg.py", _MEASURE, "data_synth/") + _GP,
    # bench/threads.py: msrm.gp.linalg, msrm.fit_rmsrm and its loadings/prepare steps, the BLAS thread settings
    "threads": (_BENCH + "threads.py", _BENCH + "linalg.py", _MEASURE, "data_synth/", "msrm/gp/linalg/")
    + _RMSRM,
    # bench/rmsrm.py: msrm.rmsrm (convention, fit, loadings, objective, prepare)
    "rmsrm": (_BENCH + "rmsrm.py", _MEASURE, "data_synth/") + _RMSRM,
    # bench/nuts.py (GPMSRM, msrm.gp.posterior.sample) and bench/diagnostics.py (msrm.diagnostics, ArviZ)
    "gradient_nuts": (_BENCH + "nuts.py", _BENCH + "diagnostics.py", _MEASURE, "data_synth/",
                      "msrm/diagnostics.py", "msrm/diagnostics_kernels.py") + _GP,
    # bench/state_space.py: GPMSRM both backends, msrm.gp.state_space (loglik, prepare, tuning), msrm.gp.memory;
    # bench/gp.floor_function, bench/scaling.fit_exponent; bench/commit_cost times the same cases at the commit
    # before the accuracy guards
    "state_space": (_BENCH + "state_space.py", _BENCH + "gp.py", _BENCH + "scaling.py", _BENCH + "commit_cost.py",
                    _MEASURE, "data_synth/") + _GP,
    # bench/scaling.py: GPMSRM both backends, msrm.fit_rmsrm, msrm.data.split_run, msrm.gp.memory
    "scaling": (_BENCH + "scaling.py", _MEASURE, "data_synth/") + _GP + ("msrm/rmsrm/",),
    # bench/reliability.py: the fault catalogue over the whole library, atomic archives, crash tests;
    # bench/accuracy.py: every backend against the 50-digit reference of msrm_lab/precision.py
    "reliability": (_BENCH + "reliability.py", _BENCH + "accuracy.py", "msrm_lab/precision.py",
                    "msrm_lab/reliability/", "data_synth/", "msrm/"),
    # bench/latent.py: GPMSRM latent posteriors (conditional, RTS smoother)
    "latent": (_BENCH + "latent.py", _MEASURE, "data_synth/") + _GP,
    # bench/model_checking.py: msrm.validation.cross_validate over msrm.fit_rmsrm (and GP-MAP)
    "model_checking": (_BENCH + "model_checking.py", "data_synth/", "msrm/validation.py") + _GP
    + ("msrm/rmsrm/",),
    # bench/recovery.py: peers, R-MSRM, GP-MAP and NUTS (state space), cross_validate, the recovery metrics
    "recovery": (_BENCH + "recovery.py", "msrm_lab/recovery/", "msrm_lab/peers.py", "data_synth/",
                 "msrm/validation.py", "msrm/align.py", "msrm/diagnostics.py", "msrm/diagnostics_kernels.py")
    + _GP + ("msrm/rmsrm/",),
    # bench/time_to_result.py and bench/warm_start.py: GPMSRM, msrm.fit_rmsrm, the compilation cache
    "time_to_result": (_BENCH + "time_to_result.py", _BENCH + "warm_start.py", "data_synth/") + _GP
    + ("msrm/rmsrm/",),
    # the notebook itself (no bench module): data_synth.bids, msrm.bids.load, msrm.select, GP-MAP from R-MSRM,
    # msrm.variance_explained, msrm.align, msrm.project_participant, the MAP archive
    "own_data": ("notebooks/14_own_data.ipynb", "data_synth/bids.py", "msrm/bids.py", "msrm/select.py",
                 "msrm/newcomer.py", "msrm/explain.py", "msrm/align.py", "msrm/validation.py") + _GP
    + ("msrm/rmsrm/",),
}
MEASURED_PATHS = {k: tuple(dict.fromkeys(v)) for k, v in MEASURED_PATHS.items()}


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=30)


def _resolve(repo: Path, commit: str) -> str | None:
    out = _git(repo, "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}")
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def _row_commits(rows) -> dict[str, list[str]]:
    """notebook -> the commits of its rows (None as "")."""
    if isinstance(rows, pd.DataFrame):
        if "notebook" not in rows or "info_git_commit" not in rows:
            raise ValueError("df_or_rows: a DataFrame needs the columns 'notebook' and 'info_git_commit' "
                             "(msrm_lab.book.load_results())")
        pairs: Iterable = zip(rows["notebook"], rows["info_git_commit"])
    else:
        try:
            pairs = [(r["notebook"], (r.get("execution_info") or {}).get("git_commit")) for r in rows]
        except (TypeError, KeyError, AttributeError):
            raise ValueError("df_or_rows: expected a DataFrame from load_results() or result rows (dicts with "
                             "'notebook' and 'execution_info')") from None
    out: dict[str, list[str]] = {}
    for nb, c in pairs:
        out.setdefault(str(nb), []).append("" if c is None or (isinstance(c, float) and c != c) else str(c))
    return out


def stale_notebooks(df_or_rows, repo: str | Path | None = None, *,
                    paths: Mapping[str, Iterable[str]] | None = None) -> dict[str, dict[str, Any]]:
    """Per notebook, whether its rows are at or after the newest commit touching the code they measure.

    Args:
        df_or_rows: a DataFrame from :func:`msrm_lab.book.load_results` or a list of result rows.
        repo: the git checkout (default :func:`msrm_lab.paths.repo_root`).
        paths: notebook -> measured paths (default :data:`MEASURED_PATHS`); a notebook of the rows that is not
            in it is reported with ``stale=None`` and the reason.
    Returns:
        notebook -> dict: ``paths``; ``code_commit`` (newest commit touching them, None if none does);
        ``code_subject``, ``code_date``; ``stale`` (True, False, or None when unknown); ``commits`` (row
        commit -> ``{"rows": n, "fresh": bool, "known": bool, "behind": commits from it to the code commit,
        "changes_since": commits since it touching the paths}``); ``reason``.
    Raises:
        ValueError: ``repo`` is not a git checkout, or the rows are not rows.
    """
    if repo is None:
        from .paths import repo_root

        repo = repo_root()
    repo = Path(repo)
    if _git(repo, "rev-parse", "--git-dir").returncode != 0:
        raise ValueError(f"repo: {repo} is not a git checkout")
    table = MEASURED_PATHS if paths is None else {k: tuple(v) for k, v in paths.items()}
    out: dict[str, dict[str, Any]] = {}
    for nb, commits in sorted(_row_commits(df_or_rows).items()):
        if nb not in table:
            out[nb] = dict(paths=(), code_commit=None, code_subject=None, code_date=None, stale=None,
                           commits={}, reason=f"no measured paths listed for notebook {nb!r}")
            continue
        nb_paths = table[nb]
        last = _git(repo, "log", "-1", "--format=%H%x00%cs%x00%s", "--", *nb_paths)
        code, date, subject = (last.stdout.strip().split("\x00") + [None, None, None])[:3] \
            if last.returncode == 0 and last.stdout.strip() else (None, None, None)
        info: dict[str, dict[str, Any]] = {}
        for c in commits:
            if c in info:
                info[c]["rows"] += 1
                continue
            base = c.removesuffix("-dirty")
            full = _resolve(repo, base) if base else None
            entry: dict[str, Any] = dict(rows=1, known=full is not None, fresh=False, behind=None,
                                         changes_since=None, dirty=c.endswith("-dirty"))
            if full is not None:
                entry["fresh"] = code is None or _git(repo, "merge-base", "--is-ancestor", code, full).returncode == 0
                if code is not None and not entry["fresh"]:
                    n = _git(repo, "rev-list", "--count", f"{full}..{code}")
                    entry["behind"] = int(n.stdout.strip()) if n.returncode == 0 else None
                    n = _git(repo, "rev-list", "--count", f"{full}..HEAD", "--", *nb_paths)
                    entry["changes_since"] = int(n.stdout.strip()) if n.returncode == 0 else None
            info[c] = entry
        stale = not all(e["fresh"] for e in info.values())
        unknown = sorted(c or "(none)" for c, e in info.items() if not e["known"])
        reason = ("unknown commits: " + ", ".join(unknown)) if unknown else ("" if not stale else "rows older "
                                                                              "than the measured code")
        out[nb] = dict(paths=nb_paths, code_commit=code, code_subject=subject, code_date=date, stale=stale,
                       commits=info, reason=reason)
    return out


def _short(c: str | None) -> str:
    if not c:
        return "(no commit recorded)"
    return c[:10] + ("-dirty" if c.endswith("-dirty") else "")


def freshness_notice(notebook: str, df_or_rows=None, repo: str | Path | None = None) -> str:
    """Markdown of a ``{warning}`` admonition when a notebook's rows are older than its code, else ``""``.

    Args:
        notebook: the notebook stem (e.g. ``"state_space"``).
        df_or_rows: rows to judge (default: :func:`msrm_lab.book.load_results`).
        repo: the git checkout (default :func:`msrm_lab.paths.repo_root`).
    Returns:
        the admonition (names the rows' commits and how many rows each holds, the newest change of the measured
        code with its date and subject, and how many commits apart they are), or ``""`` when every row is at or
        after that change or the notebook has no rows. A stale notebook also gets a :class:`StaleResultsWarning`
        and a line on ``sys.__stderr__`` (module docstring).
    """
    if not isinstance(notebook, str) or not notebook:
        raise ValueError(f"notebook must be a notebook stem such as 'state_space', got {notebook!r}")
    if df_or_rows is None:
        from .book import load_results

        df_or_rows = load_results()
    if isinstance(df_or_rows, pd.DataFrame):
        if "notebook" not in df_or_rows:
            raise ValueError("df_or_rows: a DataFrame needs the column 'notebook' (msrm_lab.book.load_results())")
        rows = df_or_rows[df_or_rows["notebook"] == notebook]
    else:
        rows = [r for r in df_or_rows if isinstance(r, Mapping) and r.get("notebook") == notebook]
    if len(rows) == 0:
        return ""
    res = stale_notebooks(rows, repo).get(notebook)
    if res is None or res["stale"] is False:
        return ""
    if res["stale"] is None:
        body = f"The rows of notebook `{notebook}` could not be checked against the code: {res['reason']}."
    else:
        code = res["code_commit"]
        parts = []
        for c, e in sorted(res["commits"].items(), key=lambda kv: -kv[1]["rows"]):
            if e["fresh"]:
                parts.append(f"`{_short(c)}` ({e['rows']} rows, current)")
            elif not e["known"]:
                parts.append(f"`{_short(c)}` ({e['rows']} rows, a commit this checkout does not have)")
            else:
                parts.append(f"`{_short(c)}` ({e['rows']} rows; that change came {e['behind']} commits later, "
                             f"and {e['changes_since']} commits since touch the measured code)")
        subject = res["code_subject"] or ""
        subject = subject if len(subject) <= 90 else subject[:87].rstrip() + "..."
        some = "Some results" if any(e["fresh"] for e in res["commits"].values()) else "The results"
        body = (f"{some} of notebook `{notebook}` are older than the code they measure. The measured code last "
                f"changed at `{_short(code)}` ({res['code_date']}: {subject}); the rows were measured at "
                + "; ".join(parts) + ". Rerun the notebook to refresh them.")
    warnings.warn(body, StaleResultsWarning, stacklevel=2)
    stream = sys.__stderr__ or sys.stderr
    if stream is not None:
        print(f"msrm_lab.freshness: stale results: {body}", file=stream, flush=True)
    return "```{warning}\n" + body + "\n```\n"


def show_notices(notebooks: Iterable[str], df_or_rows=None, repo: str | Path | None = None) -> list[str]:
    """Display, as Markdown cell output, the :func:`freshness_notice` of each of ``notebooks`` that is stale.

    A fresh notebook displays nothing: an empty Markdown output has no Markdown to render, and the book would show
    its plain-text form (the object's repr) instead. Returns the notices displayed, in order.
    """
    from IPython.display import Markdown, display

    shown = []
    for notebook in notebooks:
        notice = freshness_notice(notebook, df_or_rows, repo)
        if notice:
            display(Markdown(notice))
            shown.append(notice)
    return shown
