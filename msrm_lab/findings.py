"""The research note's seven findings beside this project's figures, and the backend to choose per problem.

:data:`FINDINGS` is a data table: per finding, the finding in plain words, the quantity compared, the note's figure
(a row of :func:`msrm_lab.book.reference_rows`, or the ratio of two), the results rows that measure the same
quantity here and the chapter that holds the evidence. :func:`findings_table` reads both figures in SI units and
gives each finding one verdict:

* **agrees** when this build's figure lies within a factor :data:`FACTOR` of the note's (of its range ``lo-hi``:
  ``lo / FACTOR <= value <= hi * FACTOR``);
* **lower here** or **higher here** otherwise, by the direction of the difference (the ``this build / note``
  column says by how much; for a time, lower is faster);
* **not measured here** when no row of the note's scale (the ``note`` or ``full`` profile) holds the figure.

This build's figure comes from the device that measured it most recently at the most preferred profile
(:func:`msrm_lab.book.pick`), among the device labels that start with the finding's ``devices`` prefix (a CPU
figure of the note is compared with ``cpu-*`` rows, a GPU figure with ``cuda-*`` rows).

:func:`decision_table` reads the same rows per problem class: on each device, the best measured candidate and the
other candidates' figures or the reason recorded for not measuring them.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import pandas as pd

from . import book as mb

__all__ = ["FACTOR", "AGREES", "LOWER", "HIGHER", "DIFFERS", "NOT_HERE", "GPU_COLUMN", "Finding", "FINDINGS", "reference_range",
           "verdict", "findings_table", "DecisionCase", "DECISIONS", "decision_table", "devices_title"]

FACTOR = 2.0
AGREES, LOWER, HIGHER, NOT_HERE = "agrees", "lower here", "higher here", "not measured here"
DIFFERS = (LOWER, HIGHER)  # the two verdicts of a figure outside the factor
GPU_COLUMN = mb.GPU_COLUMN
PROFILES = ("note", "full")          # rows at the note's scale; a quick profile's smaller problem is not compared
_MEASURED = ("measured", "projected")
_SI = {"ms": 1e-3, "s": 1.0, "min": 60.0, "day": 86400.0, "bytes": 1.0, "MB": 1e6, "GB": 1e9, "TB": 1e12,
       "TFLOPS": 1e12, "GFLOP/s": 1e9, "x": 1.0, "": 1.0}


def reference_range(value: str, unit: str) -> tuple[float, float]:
    """A reference cell (``"60-120"``, ``"~7"``, ``"0.55"``) as ``(lo, hi)`` in SI units."""
    parts = [p for p in re.split(r"(?<=\d)-(?=\d)", str(value).replace("~", "").replace(",", "").strip()) if p]
    try:
        nums = [float(p) for p in parts]
    except ValueError as exc:
        raise ValueError(f"reference value {value!r} is not a number or a range lo-hi") from exc
    if unit not in _SI:
        raise ValueError(f"reference unit {unit!r} has no SI factor")
    return min(nums) * _SI[unit], max(nums) * _SI[unit]


def verdict(value: float | None, lo: float, hi: float, factor: float = FACTOR) -> str:
    """:data:`AGREES` when ``lo / factor <= value <= hi * factor``, else :data:`LOWER` below that range and
    :data:`HIGHER` above it; :data:`NOT_HERE` without a value (all in the same units)."""
    if value is None or not math.isfinite(value):
        return NOT_HERE
    if value < lo / factor:
        return LOWER
    return HIGHER if value > hi * factor else AGREES


@dataclass(frozen=True)
class Finding:
    """One finding of the note: ``note`` names one reference row ``(section, metric, device)``, or two whose
    ratio is the note's figure; ``notebook/experiment/metric`` and ``params`` select this project's rows;
    ``agg`` reduces the chosen device's rows (``latest``, ``min`` or ``max``)."""
    finding: str
    quantity: str
    note: tuple
    notebook: str
    experiment: str
    metric: str
    params: dict = field(default_factory=dict)
    devices: str = "cpu"
    agg: str = "latest"
    chapters: tuple = ()


def _note_figure(ref: pd.DataFrame, f: Finding) -> tuple[float, float, str]:
    """The note's ``(lo, hi)`` in SI units and its text."""
    found = []
    for section, metric, device in f.note:
        row = ref[(ref["section"] == section) & (ref["metric"] == metric) & (ref["device"] == device)]
        if row.empty:
            raise KeyError(f"finding {f.finding!r}: no reference row ({section!r}, {metric!r}, {device!r})")
        found.append(row.iloc[0])
    lo, hi = reference_range(found[0]["value"], found[0]["unit"])
    text = " / ".join(f"{r['value']} {r['unit']}" for r in found)
    if len(found) == 2:
        den = reference_range(found[1]["value"], found[1]["unit"])
        lo, hi = lo / den[1], hi / den[0]
        text += f" = {mb.fmt(math.sqrt(lo * hi), 'x')}"
    return lo, hi, f"{text} ({found[0]['device']})"


def _rows(df: pd.DataFrame, notebook: str, experiment: str, metric: str, params: dict) -> pd.DataFrame:
    sub = df[(df["notebook"] == notebook) & (df["experiment"] == experiment) & (df["metric"] == metric)]
    for k, v in params.items():
        sub = sub[sub[k] == v] if k in sub else sub.iloc[0:0]
    return sub


def this_build(df: pd.DataFrame, f: Finding) -> tuple[float | None, str]:
    """This build's figure for a finding in SI units (None when not measured) and its text."""
    sub = _rows(df[df["profile"].isin(PROFILES) & df["device"].astype(str).str.startswith(f.devices)],
                f.notebook, f.experiment, f.metric, f.params)
    _, device, profile = mb.pick(sub, f.notebook, f.experiment, f.metric)
    if device is None:
        refused = sub[sub["reason"].notna()].sort_values("info_timestamp") if "reason" in sub else sub.iloc[0:0]
        if refused.empty:
            return None, f"no {f.devices}-* row"
        last = refused.iloc[-1]
        return None, f"not measured: {last['reason']} ({last['device']}, {last['profile']})"
    rows = sub[(sub["device"] == device) & (sub["profile"] == profile) & sub["status"].isin(_MEASURED)]
    values = rows.sort_values("info_timestamp", kind="stable")["value"].astype(float)
    value = values.min() if f.agg == "min" else values.max() if f.agg == "max" else values.iloc[-1]
    unit = str(rows["unit"].iloc[0])
    text = mb.bytes_text(value) if unit == "bytes" else mb.fmt(value, unit)
    return value * _SI[unit], f"{text} ({device}, {profile})"


def findings_table(df: pd.DataFrame, ref: pd.DataFrame | None = None, findings: tuple | None = None) -> pd.DataFrame:
    """One row per finding (module docstring): quantity, the note's figure, this build's, their ratio, the
    verdict and the chapter; ``ref`` defaults to every section of :func:`msrm_lab.book.reference_rows`."""
    ref = mb.reference_rows() if ref is None else ref
    out = []
    for f in FINDINGS if findings is None else findings:
        lo, hi, note = _note_figure(ref, f)
        value, text = this_build(df, f)
        out.append({"finding": f.finding, "quantity": f.quantity, f"note ({mb.REFERENCE_LABEL})": note,
                    "this build": text,
                    "this build / note": mb.fmt(value / math.sqrt(lo * hi), "x") if value is not None else "",
                    "verdict": verdict(value, lo, hi), "chapter": ", ".join(f"{{doc}}`{c}`" for c in f.chapters)})
    return pd.DataFrame(out).set_index("finding")


_CPU, _ANY = "cpu-64core", "any"
FINDINGS = (
    Finding("R-MSRM is CPU work: a restart takes minutes on cores alone", "100-iteration restart, one-eighth, K=3",
            (("rmsrm", "100-iteration restart at one-eighth", _CPU),), "rmsrm", "restart", "wall_s",
            chapters=("rmsrm",)),
    Finding("the GP code runs on a CUDA device with only an install and a platform switch",
            "GP value and gradient, one-eighth, K=3, on a GPU",
            (("summary", "GP objective-and-gradient K=3 one-eighth", "rtx-pro-6000"),), "gradient_nuts",
            "objective_gradient", "value_and_grad_median_s", dict(K=3, n_features=3600), devices="cuda",
            chapters=("gpu_support",)),
    Finding("consumer GPUs run float64 at a small fraction of float32; a workstation card is the useful one",
            "float64 matrix-product peak on a GPU", (("summary", "float64 matmul peak", "rtx-pro-6000"),), "linalg",
            "matmul", "gflops", dict(dtype="float64"), devices="cuda", agg="max", chapters=("linalg",)),
    Finding("the CPU factorization callback carried an avoidable cost that thread settings remove",
            "POTRF+POTRI through the callback over direct, same threads",
            (("gp_parts", "callback POTRF+POTRI 16 threads load 42", _CPU),
             ("summary", "direct POTRF+POTRI n=2727 16 threads", _CPU)), "threads", "callback_overhead", "ratio",
            dict(oversubscribed=False), agg="min", chapters=("threads", "gp_grouped")),
    Finding("for one long recording the dense grouped algebra, not the device, is the limit",
            "dense value and gradient, one run at 8x length, K=5 (the note: its factorization and inverse on a GPU, "
            "extrapolated)", (("linalg", "factorization-plus-inverse at n=36000 (extrapolated)", "rtx-pro-6000"),),
            "state_space", "ladder", "median_s", dict(backend="grouped", scale=8.0, K=5), devices="",
            chapters=("state_space", "scaling")),
    Finding("the posterior is the expensive part, where a GPU would pay", "NUTS leapfrog step, one-eighth, K=3",
            (("summary", "NUTS leapfrog step K=3 one-eighth", _CPU),), "gradient_nuts", "nuts",
            "seconds_per_leapfrog", dict(K=3), chapters=("gradient_nuts",)),
    Finding("the state-space backend could not run at the study's size as first written",
            "memory of a state-space value and gradient, one-eighth, K=3",
            (("summary", "state-space staged transition arrays K=3 (48000 observations)", _ANY),), "state_space",
            "memory", "state_space_peak_rss_delta_bytes", devices="", chapters=("state_space",)),
)


@dataclass(frozen=True)
class DecisionCase:
    """One problem class: the candidates are the values of column ``by`` among the matching rows; the best is the
    lowest ``metric`` (the highest when ``higher_better``); with ``qualifier`` (a 0/1 metric such as
    ``converged``), qualified candidates rank before the others."""
    problem: str
    question: str
    notebook: str
    experiment: str
    metric: str
    unit: str
    by: str
    params: dict = field(default_factory=dict)
    higher_better: bool = False
    qualifier: str | None = None


DECISIONS = (
    DecisionCase("one-eighth, one run, K=3", "backend for one value+grad", "state_space", "speed", "median_s", "s",
                 "backend", dict(K=3)),
    DecisionCase("one-eighth, one run, K=3", "backend for a GP-MAP fit from data", "time_to_result", "gp_map",
                 "total_s", "s", "linear_algebra", dict(K=3, duration_scale=1.0), qualifier="converged"),
    DecisionCase("8x long run, K=5", "backend for one value+grad", "state_space", "ladder", "median_s", "s",
                 "backend", dict(K=5, scale=8.0)),
    DecisionCase("8x as eight runs, K=5", "backend for one value+grad", "scaling", "value_and_grad", "median_s",
                 "s", "backend", dict(K=5, scale=8.0, layout="runs")),
    DecisionCase("many R-MSRM restarts", "parallel scheduler", "scaling", "restarts", "restarts_per_min",
                 "1/min", "backend", {}, higher_better=True),
    DecisionCase("one-eighth, posterior, K=3", "one NUTS chain, at the measured and at deeper trees", "gradient_nuts",
                 "projection", "full_chain_days", "day", "basis", dict(K=3)),
)


def _decide(rows: pd.DataFrame, case: DecisionCase) -> str | None:
    """One device's cell: the best candidate and its figure, then the others'; None when it ran no such case."""
    sub = _rows(rows[rows["profile"].isin(PROFILES)], case.notebook, case.experiment, case.metric, case.params)
    if sub.empty or case.by not in sub.columns:
        return None
    rank = sub["profile"].map(PROFILES.index)
    sub = sub[rank == rank.min()]
    cands, refused = [], []
    for name, g in sub.groupby(case.by, sort=True):
        m = g[g["status"].isin(_MEASURED) & g["value"].notna()]
        if m.empty:
            reasons = g["reason"].dropna() if "reason" in g else ()
            refused.append(f"{name} not measured: {reasons.iloc[0] if len(reasons) else mb.NOT_MEASURED}")
            continue
        value = float(m["value"].max() if case.higher_better else
                      m.sort_values("info_timestamp", ascending=False)["value"].iloc[0])
        q = _rows(rows, case.notebook, case.experiment, case.qualifier, {**case.params, case.by: name}) \
            if case.qualifier else None
        cands.append((name, value, q is None or (not q.empty and float(q["value"].iloc[0]) >= 1.0)))
    cands.sort(key=lambda c: (not c[2], -c[1] if case.higher_better else c[1]))
    texts = [f"{n}{':' if i == 0 else ''} {mb.fmt(v, case.unit)}" + ("" if ok else f" (not {case.qualifier})")
             for i, (n, v, ok) in enumerate(cands)]
    return "; ".join(texts[:1] + ([f"against {', '.join(texts[1:])}"] if texts[1:] else []) + refused)


def decision_table(df: pd.DataFrame, cases: tuple | None = None) -> pd.DataFrame:
    """Per problem class and device label, :func:`_decide`'s cell, or :data:`msrm_lab.book.MISSING` for a case
    the device did not run. A device that ran none of the cases has no column, and with no ``cuda-*`` label there
    is no GPU column: ``attrs["unmeasured"]`` names them (the GPU as :data:`GPU_COLUMN`)."""
    cases = DECISIONS if cases is None else cases
    devices = mb.devices_in(df) if not df.empty else []
    table = pd.DataFrame([{"problem": c.problem, "question": c.question,
                           **{d: _decide(df[df["device"] == d], c) for d in devices}} for c in cases])
    table = table.set_index(["problem", "question"])
    silent = [d for d in devices if table[d].isna().all()]
    table = table.drop(columns=silent).fillna(mb.MISSING)
    table.attrs["unmeasured"] = silent + ([] if any(str(d).startswith("cuda") for d in devices) else [GPU_COLUMN])
    return table


def devices_title(df: pd.DataFrame) -> str:
    """The device labels of a build joined for a title (``"a and b"``), or "no device yet"."""
    devices = mb.devices_in(df) if not df.empty else []
    if not devices:
        return "no device yet"
    return devices[0] if len(devices) == 1 else ", ".join(devices[:-1]) + " and " + devices[-1]
