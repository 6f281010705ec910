"""Load measured results and render them for the book's chapters.

Results live in ``results/<device>/<profile>/<notebook>/rows.jsonl`` (rows from :func:`msrm_lab.bench.rows.make_row`),
with PNG figures beside them. Chapters call:

    df = load_results()                                   # every row of every device and profile
    show_table(device_table(df, "linalg", metric="median_s", index=["experiment", "n"]))
    show_figures("linalg", caption="Cholesky time against size")
    glue("chol_cpu", fmt(value, "s"))                     # prose numbers through myst_nb.glue

Which results roots are read: the ``root`` argument, else the ``MSRM_RESULTS`` environment variable
(``os.pathsep``-separated folders; the book test uses it to add smoke results from a temporary folder), else
``<repo>/results``. The note's own published figures come only from :func:`reference_rows`, labelled
"note, 2026-09-21". Nothing here imports JAX.
"""
from __future__ import annotations

import json
import math
import os
from html import escape as html_escape
from pathlib import Path
from typing import Iterable, Sequence

import pandas as pd

from .paths import repo_root

__all__ = [
    "REFERENCE_LABEL", "NOT_MEASURED", "GPU_COLUMN", "NOT_IN_BUILD", "MISSING", "bytes_text", "PROFILE_ORDER",
    "results_roots", "load_results", "device_table",
    "device_summary", "reference_rows", "figure_paths", "fmt", "show_table", "figure_markdown", "show_figures",
    "devices_in", "preferred_profile", "param_columns", "pick", "run_statuses", "profile_sittings", "spread",
    "show_measured_at",
]

REFERENCE_LABEL = "note, 2026-09-21"
NOT_MEASURED = "not yet measured"
# A device table's stand-in column when this build holds no GPU row at all: a reader must see that the GPU was
# not measured, not infer it from a missing column.
GPU_COLUMN = "GPU"
NOT_IN_BUILD = "not measured in this build"
# a cell of a measured device's column that has no row (another device measured that size or case)
MISSING = "–"
# byte counts are shown in decimal units: (threshold, divisor, unit), largest first
_BYTE_UNITS = ((1e12, 1e12, "TB"), (1e9, 1e9, "GB"), (1e6, 1e6, "MB"), (1e3, 1e3, "kB"))
# Preferred profile when a device has several: the note's scale first, then full recordings, then quick.
PROFILE_ORDER = ("note", "full", "quick", "smoke")
BASE_COLUMNS = ("device", "profile", "notebook", "experiment", "metric", "value", "unit", "status")
INFO_COLUMNS = ("backend", "device_kind", "cpu_model", "physical_cores", "blas_kernel", "blas_threads", "jax",
                "git_commit", "timestamp", "load_average_1m")
_STATUS_TEXT = {"not_yet_measured": NOT_MEASURED, "refused": "refused", "error": "error"}


def results_roots(root: str | Path | Sequence[str | Path] | None = None) -> list[Path]:
    """The results folders to read (see the module docstring for the order of precedence)."""
    if root is None:
        env = os.environ.get("MSRM_RESULTS")
        roots: Iterable = env.split(os.pathsep) if env else [repo_root() / "results"]
    elif isinstance(root, (str, Path)):
        roots = [root]
    else:
        roots = root
    return [Path(r) for r in roots if str(r)]


def _result_folders(roots: list[Path]):
    for r in roots:
        if not r.is_dir():
            continue
        for rows in sorted(r.glob("*/*/*/rows.jsonl")):
            folder = rows.parent
            if any(p.startswith(".") for p in folder.relative_to(r).parts) or folder.name.endswith(".failed"):
                continue
            yield folder.parent.parent.name, folder.parent.name, folder


def load_results(root: str | Path | Sequence[str | Path] | None = None) -> pd.DataFrame:
    """Every results row as a DataFrame.

    Columns: ``device, profile, notebook, experiment, metric, value, unit, status``, then each row's params
    flattened to its own column (``param_<name>`` if the name clashes with a base column), then
    ``info_<name>`` for a few ``execution_info`` fields (backend, device_kind, cpu_model, physical_cores,
    blas_kernel, blas_threads, jax, git_commit, timestamp, load_average_1m). Torn or foreign lines are skipped.
    """
    records = []
    for device, profile, folder in _result_folders(results_roots(root)):
        for line in (folder / "rows.jsonl").read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(row, dict) or "metric" not in row:
                continue
            rec = {
                "device": device, "profile": profile, "notebook": row.get("notebook", folder.name),
                "experiment": row.get("experiment"), "metric": row.get("metric"), "value": row.get("value"),
                "unit": row.get("unit"), "status": row.get("status", "measured"),
            }
            for k, v in (row.get("params") or {}).items():
                rec[f"param_{k}" if k in BASE_COLUMNS or k.startswith("info_") else k] = v
            info = row.get("execution_info") or {}
            for k in INFO_COLUMNS:
                rec[f"info_{k}"] = info.get(k)
            records.append(rec)
    if not records:
        return pd.DataFrame(columns=list(BASE_COLUMNS) + [f"info_{k}" for k in INFO_COLUMNS])
    return pd.DataFrame.from_records(records)


def devices_in(df: pd.DataFrame, notebook: str | None = None) -> list[str]:
    """Sorted device labels present in ``df`` (for one notebook if given)."""
    if notebook is not None:
        df = df[df["notebook"] == notebook]
    return sorted(df["device"].dropna().unique().tolist())


def preferred_profile(df: pd.DataFrame, by: Sequence[str] = ("device", "notebook")) -> pd.DataFrame:
    """Keep, per group of ``by`` (default: device and notebook), only the rows of the most preferred profile the
    group has (note > full > quick > smoke; an unknown profile ranks last), so a chapter never mixes two sittings
    of different profiles on one device."""
    if df.empty:
        return df
    rank = {p: i for i, p in enumerate(PROFILE_ORDER)}
    r = df["profile"].map(lambda p: rank.get(p, len(rank)))
    best = r.groupby([df[c] for c in by]).transform("min")
    return df[r == best]


def bytes_text(value) -> str:
    """A byte count in decimal units with 3 significant digits: ``1312779600`` -> ``"1.31 GB"``."""
    v = float(value)
    for threshold, divisor, unit in _BYTE_UNITS:
        if abs(v) >= threshold:
            return f"{v / divisor:.3g} {unit}"
    return f"{v:.0f} B"


def _cell(status: str, value, unit=None) -> object:
    shown = status in ("measured", "projected")
    if shown and value is not None and not (isinstance(value, float) and math.isnan(value)):
        return bytes_text(value) if unit == "bytes" and isinstance(value, (int, float)) else value
    return _STATUS_TEXT.get(status, NOT_MEASURED)


def _label(v) -> object:
    """Index labels: NaN -> "", integral floats (pandas' upcast of int params) -> int."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


def device_table(
    df: pd.DataFrame,
    notebook: str,
    experiment: str | Sequence[str] | None = None,
    metric: str | Sequence[str] | None = None,
    index: Sequence[str] = ("experiment", "metric", "unit"),
    *,
    all_profiles: bool = False,
    devices: Sequence[str] | None = None,
    gpu_column: bool = True,
) -> pd.DataFrame:
    """Side-by-side table of one notebook's rows: one column per device (or device and profile) that has a row
    among the selected ones; a device that has none gets no column but a name in ``table.attrs["unmeasured"]``,
    which :func:`show_table` prints as one line under the table.

    Args:
        df: from :func:`load_results`.
        notebook: the notebook stem.
        experiment, metric: keep only these (a name or a list).
        index: row labels, any columns of ``df`` (params included).
        all_profiles: one column per (device, profile) instead of the preferred profile per device.
        devices: further devices the reader should hear about: each without a row is named as unmeasured.
        gpu_column: when no ``cuda-*`` device has a row or is named in ``devices``, name :data:`GPU_COLUMN` as
            unmeasured too.

    Returns:
        A DataFrame indexed by ``index``; cells hold the measured value (a byte count as text in kB/MB/GB/TB),
        "not yet measured" (status ``not_yet_measured``), "refused", "error" or :data:`MISSING` (no row for that
        device); rows with nothing measured on any device are left out. When one cell has several rows the latest
        (by ``info_timestamp``) wins. ``attrs["unmeasured"]``: the devices (and the GPU) without a column.
    """
    table = _device_table(df, notebook, experiment, metric, index, all_profiles=all_profiles)
    shown = {str(c).split(" (")[0] for c in table.columns}
    unmeasured = sorted((set(devices or ()) | set(devices_in(df))) - shown)
    if gpu_column and not any(str(d).startswith("cuda-") for d in shown | set(unmeasured)):
        unmeasured.append(GPU_COLUMN)
    table.attrs["unmeasured"] = unmeasured
    return table


def _device_table(df, notebook, experiment, metric, index, *, all_profiles) -> pd.DataFrame:
    sub = df[df["notebook"] == notebook] if "notebook" in df else df.iloc[0:0]
    for col, want in (("experiment", experiment), ("metric", metric)):
        if want is not None:
            sub = sub[sub[col].isin([want] if isinstance(want, str) else list(want))]
    index = list(index)
    if sub.empty:  # nothing measured yet for this notebook: no params columns to index by either
        return pd.DataFrame(index=pd.Index([], name="experiment"))
    missing = [c for c in index if c not in df.columns]
    if missing and (sub["status"] == "measured").any():
        raise KeyError(f"device_table({notebook!r}): index columns {missing} are not in the results "
                       f"(columns: {sorted(map(str, df.columns))})")
    # a parameter that only unmeasured rows lack (e.g. a not-yet-measured placeholder) labels as blank
    sub = sub.assign(**{c: "" for c in index if c not in sub.columns})
    if not all_profiles:
        sub = preferred_profile(sub)
    sub = sub.copy()
    sub["column"] = sub["device"] if not all_profiles else sub["device"] + " (" + sub["profile"] + ")"
    if "info_timestamp" in sub:
        sub = sub.sort_values("info_timestamp", na_position="first", kind="stable")
    sub["cell"] = [_cell(s, v, u) for s, v, u in zip(sub["status"], sub["value"], sub["unit"])]
    sub["measured"] = sub["status"].isin(("measured", "projected", "refused", "error"))
    if not sub["measured"].any():
        return pd.DataFrame(index=pd.Index([], name="experiment"))
    for c in index:
        sub[c] = [_label(v) for v in sub[c]]
    keys = index + ["column"]
    sub = sub.groupby(keys, sort=False, dropna=False)[["cell", "measured"]].last()
    measured = sub["measured"].groupby(level=index, sort=False, dropna=False).any()
    columns = sorted(set(sub.loc[sub["measured"]].index.get_level_values("column")))
    table = sub["cell"].unstack("column").reindex(columns=columns).astype(object)
    table = table.loc[measured.reindex(table.index).to_numpy()]
    table = table.where(table.notna(), MISSING)
    table.columns.name = None
    return table


def device_summary(df: pd.DataFrame) -> pd.DataFrame:
    """One row per device: profiles present, backend and device kind, CPU model, cores, BLAS kernel, JAX, the
    commit and date of its latest row."""
    if df.empty:
        return pd.DataFrame(columns=["device", "profiles", "backend"])
    out = []
    for device, g in df.groupby("device", sort=True):
        last = g.sort_values("info_timestamp", na_position="first").iloc[-1]
        out.append({
            "device": device,
            "profiles": ", ".join(p for p in PROFILE_ORDER if p in set(g["profile"])) or ", ".join(sorted(set(g["profile"]))),
            "backend": " ".join(str(v) for v in (last.get("info_backend"), last.get("info_device_kind"))
                                if v is not None and not (isinstance(v, float) and math.isnan(v))) or None,
            "CPU": last.get("info_cpu_model"), "physical cores": last.get("info_physical_cores"),
            "BLAS kernel": last.get("info_blas_kernel"), "jax": last.get("info_jax"),
            "commit": (str(last.get("info_git_commit") or "")[:12]) or None,
            "measured": str(last.get("info_timestamp") or "")[:10] or None,
        })
    return pd.DataFrame(out).set_index("device")


def reference_rows(section: str | None = None, path: str | Path | None = None) -> pd.DataFrame:
    """The note's published figures for a section (``summary``, ``linalg``, ``rmsrm``, ...), labelled as such.

    Columns: ``source`` ("note, 2026-09-21"), section, metric, device, value (as published, may be a range or
    "~1"), unit, context. Raises KeyError for a section the file does not have.
    """
    path = repo_root() / "note" / "reference_figures.csv" if path is None else Path(path)
    ref = pd.read_csv(path, dtype=str, keep_default_na=False)
    if section is not None:
        if section not in set(ref["section"]):
            raise KeyError(f"reference_rows: section {section!r} is not in {path.name} "
                           f"(sections: {sorted(set(ref['section']))})")
        ref = ref[ref["section"] == section]
    ref = ref.copy()
    ref.insert(0, "source", REFERENCE_LABEL)
    return ref.reset_index(drop=True)


def figure_paths(notebook: str, root=None, *, all_profiles: bool = False,
                 stems: tuple[str, ...] | None = None) -> list[tuple[str, str, Path]]:
    """PNG figures of a notebook: ``(device, profile, path)`` sorted by device then file name.

    Only the preferred profile per device unless ``all_profiles``; only the files named ``<stem>.png`` for a stem
    in ``stems`` when it is given (a notebook whose figures need captions of their own).
    """
    found: dict[str, list[tuple[str, Path]]] = {}
    for device, profile, folder in _result_folders(results_roots(root)):
        if folder.name != notebook:
            continue
        for png in sorted(folder.glob("*.png")):
            if stems is None or png.stem in stems:
                found.setdefault(device, []).append((profile, png))
    rank = {p: i for i, p in enumerate(PROFILE_ORDER)}
    out = []
    for device in sorted(found):
        items = found[device]
        if not all_profiles:
            best = min(rank.get(p, len(rank)) for p, _ in items)
            items = [(p, f) for p, f in items if rank.get(p, len(rank)) == best]
        out.extend((device, p, f) for p, f in items)
    return out


def fmt(value, unit: str | None = None, digits: int = 3) -> str:
    """A number for prose: 3 significant digits, thousands separators for large integers, the unit after a
    space; ``None``/NaN become "not yet measured". Use with ``myst_nb.glue(name, fmt(v, "s"), display=False)``.
    """
    if value is None or (isinstance(value, float) and math.isnan(value)) or isinstance(value, str):
        return value if isinstance(value, str) and value else NOT_MEASURED
    v = float(value)
    if v.is_integer() and abs(v) >= 1000:
        text = f"{int(v):,}"
    elif v == 0 or 1e-3 <= abs(v) < 1e6:
        text = f"{v:.{digits}g}"
        if "e" in text:
            text = f"{v:,.0f}"
    else:
        text = f"{v:.{digits - 1}e}"
    return f"{text} {unit}" if unit else text


def spread(row, lo: str = "min", hi: str = "max") -> tuple[float | None, float | None, str]:
    """``(low, high, over)``: the spread that belongs with a row's value, for prose beside it.

    A row merged from several executions of its notebook (``process_repeats`` > 1) holds the median of their
    values, so its spread is ``process_min``–``process_max`` (``over = "processes"``); a row from one execution
    gives the spread of its own repeats, the ``lo`` and ``hi`` columns (``over = "repeats"``). ``(None, None,
    over)`` when the row has no usable pair. ``row``: a pandas Series (a row of :func:`load_results`) or a dict.
    """
    def num(key):
        v = row.get(key) if hasattr(row, "get") else None
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None

    n = num("process_repeats")
    if n is not None and n > 1:
        a, b = num("process_min"), num("process_max")
        return (a, b, "processes") if a is not None and b is not None else (None, None, "processes")
    a, b = num(lo), num(hi)
    return (a, b, "repeats") if a is not None and b is not None else (None, None, "repeats")


def _format_cell(v) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, float):
        return fmt(v)
    return str(v)


def show_table(table: pd.DataFrame, caption: str | None = None, *, kind: str = "device"):
    """Display a table as HTML with the class ``msrm-<kind>-table`` (the rendered-book check looks for it), and
    under it one line naming the devices in ``table.attrs["unmeasured"]`` (see :func:`device_table`). A table
    with no rows is one line instead."""
    from IPython.display import HTML, display

    unmeasured = list(table.attrs.get("unmeasured", ()))
    note = ""
    if unmeasured:
        names = ", ".join("a GPU" if d == GPU_COLUMN else d for d in unmeasured)
        note = f'<p class="msrm-unmeasured">Not measured on: {html_escape(names)}.</p>'
    if table.empty:
        what = f" ({html_escape(caption)})" if caption else ""
        display(HTML(f'<p class="msrm-unmeasured">No rows measured yet{what}.</p>' + note))
        return
    html = table.map(_format_cell).to_html(classes=["msrm-table", f"msrm-{kind}-table"], na_rep=MISSING,
                                           escape=True, border=0)
    if caption:
        html = html.replace(">\n  <thead>", f">\n  <caption>{caption}</caption>\n  <thead>", 1)
    display(HTML(html + note))


def figure_markdown(path: Path, name: str, caption: str, base: Path | None = None, width: str = "90%") -> str:
    """A MyST ``{figure}`` directive for a saved PNG (numbered, referencable by ``name``)."""
    base = Path.cwd() if base is None else base
    rel = os.path.relpath(Path(path).resolve(), base.resolve())
    return f"```{{figure}} {rel}\n:name: {name}\n:width: {width}\n\n{caption}\n```\n"


def show_figures(notebook: str, caption: str, root=None, *, name: str | None = None, all_profiles: bool = False,
                 stems: tuple[str, ...] | None = None) -> int:
    """Display every PNG of a notebook (those named by ``stems`` when given), per device, as numbered MyST
    figures. Returns how many were shown.

    The markdown output is parsed as MyST by myst-nb (``nb_render_markdown_format: myst``), so the figures are
    numbered and copied into the built book like any other image.
    """
    from IPython.display import Markdown, display

    shown = 0
    for device, profile, png in figure_paths(notebook, root, all_profiles=all_profiles, stems=stems):
        label = f"fig-{name or notebook}-{device}-{profile}-{png.stem}".replace("_", "-")
        display(Markdown(figure_markdown(png, label, f"{caption} ({png.stem}; {device}, {profile} profile).")))
        shown += 1
    if not shown:
        display(Markdown(f"*No figure of `{notebook}` yet: {NOT_MEASURED} on any device.*"))
    return shown


def show_measured_at(df: pd.DataFrame, notebooks: Sequence[str]) -> str:
    """Display one line saying where a chapter's rows were measured, read from the rows alone: per notebook, each
    device with the profile the chapter shows (its most preferred) and the commits of those rows (``-dirty`` when
    the measured code had uncommitted changes). Returns the line."""
    from IPython.display import Markdown, display

    parts = []
    for notebook in notebooks:
        sub = preferred_profile(df[df["notebook"] == notebook])
        where = []
        for (device, profile), g in sub.groupby(["device", "profile"], sort=True):
            commits = sorted({str(c)[:7] + ("-dirty" if str(c).endswith("-dirty") else "") if isinstance(c, str)
                              and c else "unknown" for c in g["info_git_commit"]})
            where.append(f"{device} ({profile} profile) at commit {', '.join(commits)}")
        parts.append(f"`{notebook}` on " + "; ".join(where) if where else f"`{notebook}`: {NOT_MEASURED}")
    text = "*Rows of " + ". Rows of ".join(parts) + ".*"
    display(Markdown(text))
    return text


def param_columns(df: pd.DataFrame, notebook: str, experiment: str | None = None) -> list[str]:
    """The params columns that carry a value for a notebook's (experiment's) rows, in column order."""
    sub = df[df["notebook"] == notebook]
    if experiment is not None:
        sub = sub[sub["experiment"] == experiment]
    fixed = set(BASE_COLUMNS) | {c for c in df.columns if str(c).startswith("info_")}
    return [c for c in df.columns if c not in fixed and sub[c].notna().any()]


def pick(df: pd.DataFrame, notebook: str, experiment: str, metric: str, **params) -> tuple[object, str | None, str | None]:
    """One measured value for prose: ``(value, device, profile)`` from the most preferred profile present, then
    from the device that measured it most recently (its newest row; ties by device name), so that prose quotes the
    sitting closest to the code as it is; ``(None, None, None)`` when nothing was measured. ``params`` filter rows
    by value.
    """
    sub = df[(df["notebook"] == notebook) & (df["experiment"] == experiment) & (df["metric"] == metric)
             & df["status"].isin(("measured", "projected"))]
    for k, v in params.items():
        if k not in sub.columns:
            return None, None, None
        sub = sub[sub[k] == v]
    if sub.empty:
        return None, None, None
    rank = {p: i for i, p in enumerate(PROFILE_ORDER)}
    sub = sub.assign(_rank=sub["profile"].map(lambda p: rank.get(p, len(rank))))
    sub = sub[sub["_rank"] == sub["_rank"].min()]
    stamp = sub["info_timestamp"].astype(str)
    sub = sub.assign(_latest=stamp.groupby(sub["device"]).transform("max"), _stamp=stamp)
    sub = sub.sort_values(["_latest", "device", "_stamp"], ascending=[False, True, False], kind="stable")
    row = sub.iloc[0]
    return row["value"], row["device"], row["profile"]


def run_statuses(root: str | Path | Sequence[str | Path] | None = None) -> pd.DataFrame:
    """One row per notebook run found (``results/<device>/<profile>/<notebook>/status.json``): device, profile,
    notebook, status, wall seconds, start time, commit and error text. Hidden folders (a run in progress) are
    skipped; a failed run kept beside earlier results (``<notebook>.failed``) is listed with its own status."""
    rows = []
    for base in results_roots(root):
        for status in sorted(base.glob("*/*/*/status.json")):
            if any(part.startswith(".") for part in status.relative_to(base).parts):
                continue
            s = json.loads(status.read_text())
            info = s.get("execution_info") or {}
            rows.append({"device": status.parts[-4], "profile": status.parts[-3],
                         "notebook": s.get("notebook") or status.parts[-2], "status": s.get("status"),
                         "wall_s": s.get("wall_s"), "started": s.get("started"),
                         "commit": (info.get("git_commit") or "")[:7], "error": (s.get("error") or "")[:80]})
    cols = ["device", "profile", "notebook", "status", "wall_s", "started", "commit", "error"]
    return pd.DataFrame(rows, columns=cols)


def profile_sittings(runs: pd.DataFrame, expected: int | None = None) -> pd.DataFrame:
    """Per (device, profile): notebooks with an ``ok`` run, how many are expected, and the sum of their wall
    times in minutes, i.e. how long one sitting that runs them back to back takes (start-up between notebooks
    excluded). ``complete`` is True when every expected notebook has an ok run; ``expected`` defaults to the
    number of notebooks in ``notebooks/``."""
    if expected is None:
        expected = len(list((repo_root() / "notebooks").glob("*.ipynb")))
    ok = runs[runs["status"] == "ok"]
    out = []
    for (device, profile), g in ok.groupby(["device", "profile"], sort=True):
        out.append({"device": device, "profile": profile, "notebooks_ok": int(g["notebook"].nunique()),
                    "expected": expected, "complete": bool(g["notebook"].nunique() >= expected),
                    "total_min": float(g["wall_s"].astype(float).sum()) / 60.0,
                    "longest": str(g.loc[g["wall_s"].astype(float).idxmax(), "notebook"]),
                    "commits": ", ".join(sorted(set(c for c in g["commit"] if c)))})
    return pd.DataFrame(out, columns=["device", "profile", "notebooks_ok", "expected", "complete", "total_min",
                                      "longest", "commits"])
