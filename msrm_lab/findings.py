"""The research note's seven summary findings, each answered by this project's results rows.

:func:`findings_table` gives one row per finding: a paraphrase, the note's own figure (from
:func:`msrm_lab.book.reference_rows`, with its device), this project's figure on every device label present
(with no ``cuda-*`` label, ``attrs["unmeasured"]`` names the GPU instead of a column of placeholders), a
verdict and the chapter that holds the evidence.
:func:`decision_table` answers "which backend, which method, which device" per problem size from the rows.

A finding holds one or more :class:`Check` s. The first is the finding's primary check: it decides the verdict.
The others are shown beside it as context, with their own verdict in brackets when it differs.

Verdict rules (``NOISE = 2``: the factor within which two timings on different machines count as the same):

* ``cost`` (lower is better; the note's figure is a value or a range ``lo-hi``, converted to SI units):
  **improved** when this project's value is below ``lo / NOISE``; **contradicted** when it is above
  ``hi * NOISE`` (costlier than the note says); **confirmed** otherwise. The note's figure used is the one of
  the same device class (a CPU row for a CPU label, a GPU row for a ``cuda-*`` label, the best of them when
  several; a figure for ``any`` device applies to both). Without such a figure the check has no verdict.
* ``gain`` (higher is better): the mirror image: improved above ``hi * NOISE``, contradicted below
  ``lo / NOISE``, confirmed otherwise.
* ``pathology`` (the note reports a cost as a failure mode, e.g. oversubscribed threads): confirmed when this
  project's value is at least ``lo / NOISE``, contradicted below.
* ``runs_on_gpu``: confirmed when a ``cuda-*`` label has a measured row; contradicted when its rows are all
  errors; otherwise not measured on this build.
* ``gpu_float64``: on a ``cuda-*`` label only: confirmed when its float64 matmul peak is at most ``NOISE``
  times the best GPU peak the note measured (float64 limited as on the note's cards), improved above that.
* A check evaluated on no device (no row, or only rows that are not measured) reads "not measured on this
  build"; a GPU-only check reads so unless a ``cuda-*`` label has rows.

Across devices, the verdict is the common one when every device that measured the primary check agrees, else
``device: verdict`` for each.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Callable

import pandas as pd

from . import book as mb

__all__ = [
    "NOISE", "NOT_ON_BUILD", "GPU_COLUMN", "Check", "Finding", "FINDINGS", "is_gpu", "reference_range",
    "verdict", "check_value", "findings_table", "DecisionCase", "DECISIONS", "decision_table", "devices_title",
]

NOISE = 2.0
NOT_ON_BUILD = "not measured on this build"
GPU_COLUMN = getattr(mb, "GPU_COLUMN", "GPU")
VERDICTS = ("confirmed", "improved", "contradicted", NOT_ON_BUILD)
_SI = {"ms": 1e-3, "s": 1.0, "min": 60.0, "day": 86400.0, "bytes": 1.0, "MB": 1e6, "GB": 1e9, "TB": 1e12,
       "TFLOPS": 1e12, "GFLOP/s": 1e9, "x": 1.0, "": 1.0, "1": 1.0, "fraction": 1.0, "count": 1.0,
       "dim": 1.0, "steps": 1.0}


def is_gpu(device: str) -> bool:
    """True for a device label of this project that names a CUDA device (``cuda-*``)."""
    return str(device).startswith("cuda")


def _ref_class(device: str) -> str:
    d = str(device or "").lower()
    if d in ("", "any", "nan"):
        return "any"
    if "cpu" in d:
        return "cpu"
    return "gpu"


def reference_range(value: str, unit: str) -> tuple[float, float]:
    """A reference cell (``"60-120"``, ``"~7"``, ``"0.55"``) as ``(lo, hi)`` in SI units."""
    text = str(value).replace("~", "").replace(",", "").strip()
    parts = [p for p in re.split(r"(?<=\d)-(?=\d)", text) if p]
    try:
        nums = [float(p) for p in parts]
    except ValueError as exc:
        raise ValueError(f"reference value {value!r} is not a number or a range lo-hi") from exc
    if unit not in _SI:
        raise ValueError(f"reference unit {unit!r} has no SI factor")
    f = _SI[unit]
    return min(nums) * f, max(nums) * f


def verdict(rule: str, value: float | None, lo: float | None, hi: float | None) -> str | None:
    """One check's verdict from its rule (see the module docstring); ``None`` when it has no note figure."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return NOT_ON_BUILD
    if lo is None or hi is None:
        return None
    if rule == "cost":
        return "improved" if value < lo / NOISE else "contradicted" if value > hi * NOISE else "confirmed"
    if rule == "gain":
        return "improved" if value > hi * NOISE else "contradicted" if value < lo / NOISE else "confirmed"
    if rule == "pathology":
        return "confirmed" if value >= lo / NOISE else "contradicted"
    if rule == "gpu_float64":
        return "confirmed" if value <= hi * NOISE else "improved"
    raise ValueError(f"rule {rule!r} is not one of cost, gain, pathology, gpu_float64, runs_on_gpu")


@dataclass(frozen=True)
class Check:
    """One quantity of a finding: this project's rows against the note's reference rows.

    ``params`` filter rows by value; ``agg`` is ``"pick"`` (:func:`msrm_lab.book.pick` on the device's rows),
    ``"min"`` or ``"max"`` (over the device's matching rows of its preferred profile); ``minus`` or ``over``
    name a second row set (same notebook/experiment/metric, other params) whose value is subtracted or divided
    by. ``refs`` are ``(section, metric)`` pairs of reference rows compared with the value (same quantity, SI
    units); ``context_refs`` are shown only. ``unit`` is the unit of the rows' values. Only rows of
    ``profiles`` count (the note's scale: a quick profile's smaller problem is not compared with the note).
    """
    label: str
    notebook: str
    experiment: str
    metric: str
    unit: str
    rule: str = "cost"
    params: dict = field(default_factory=dict)
    agg: str = "pick"
    minus: dict | None = None
    over: dict | None = None
    refs: tuple = ()
    ref_ratio: tuple | None = None   # ((section, metric), (section, metric)): the note's figure is a / b
    gpu_only: bool = False
    ref_any: bool = False            # the note's figure applies to every device class
    context_refs: tuple = ()         # reference rows shown beside the check, never compared
    profiles: tuple = ("note", "full")
    ref_label: str | None = None     # what the note's figure measures, when it is not the check's own quantity


@dataclass(frozen=True)
class Finding:
    key: str
    finding: str
    checks: tuple
    chapters: tuple


def _filtered(df: pd.DataFrame, notebook, experiment, metric, params: dict) -> pd.DataFrame:
    sub = df[(df["notebook"] == notebook) & (df["experiment"] == experiment) & (df["metric"] == metric)]
    for k, v in params.items():
        if k not in sub.columns:
            return sub.iloc[0:0]
        sub = sub[sub[k] == v]
    return sub


def _one(df: pd.DataFrame, check: Check, params: dict) -> tuple[float | None, str | None]:
    """``(value, reason)`` of one row set on one device's rows: reason is the refusal text of a row that was
    not measured (its ``reason`` param), when no measured row exists."""
    sub = _filtered(df, check.notebook, check.experiment, check.metric, params)
    measured = sub[sub["status"].isin(("measured", "projected")) & sub["value"].notna()]
    if measured.empty:
        reason = None
        if "reason" in sub.columns and sub["reason"].notna().any():
            reason = str(sub["reason"].dropna().iloc[0])
        return None, reason
    if check.agg == "pick":
        value, _, _ = mb.pick(measured, check.notebook, check.experiment, check.metric, **params)
        return float(value), None
    rank = {p: i for i, p in enumerate(mb.PROFILE_ORDER)}
    best = min(rank.get(p, len(rank)) for p in measured["profile"])
    vals = measured[measured["profile"].map(lambda p: rank.get(p, len(rank))) == best]["value"].astype(float)
    return float(vals.min() if check.agg == "min" else vals.max()), None


def check_value(df: pd.DataFrame, check: Check) -> tuple[float | None, str | None]:
    """This check's value on ``df`` (one device's rows), in the rows' unit, and a refusal reason if any."""
    df = df[df["profile"].isin(check.profiles)]
    value, reason = _one(df, check, check.params)
    if value is None:
        return None, reason
    for other, op in ((check.minus, "minus"), (check.over, "over")):
        if other is None:
            continue
        second, reason2 = _one(df, check, other)
        if second is None:
            return None, reason2
        value = value - second if op == "minus" else (value / second if second else None)
    return value, None


def _refs(check: Check, ref: pd.DataFrame) -> pd.DataFrame:
    parts = [ref[(ref["section"] == s) & (ref["metric"] == m)] for s, m in check.refs]
    return pd.concat(parts) if parts else ref.iloc[0:0]


def _ref_bounds(check: Check, ref: pd.DataFrame, device_class: str) -> tuple[float | None, float | None, str]:
    """The note's ``(lo, hi)`` in SI units for a device class, and the text of the figures used."""
    if check.ref_ratio is not None:
        (s1, m1), (s2, m2) = check.ref_ratio
        a = ref[(ref["section"] == s1) & (ref["metric"] == m1)]
        b = ref[(ref["section"] == s2) & (ref["metric"] == m2)]
        if a.empty or b.empty:
            return None, None, ""
        ra = reference_range(a.iloc[0]["value"], a.iloc[0]["unit"])
        rb = reference_range(b.iloc[0]["value"], b.iloc[0]["unit"])
        r = ra[0] / rb[0]
        cls = _ref_class(a.iloc[0]["device"])
        text = (f"{a.iloc[0]['value']} {a.iloc[0]['unit']} / {b.iloc[0]['value']} {b.iloc[0]['unit']} = "
                f"{mb.fmt(r, 'x')} ({a.iloc[0]['device']})")
        return (r, r, text) if cls in (device_class, "any") else (None, None, text)
    rows = _refs(check, ref)
    usable = [(reference_range(r["value"], r["unit"]), r) for _, r in rows.iterrows()
              if check.ref_any or _ref_class(r["device"]) in (device_class, "any")]
    if not usable:
        return None, None, ""
    if check.rule == "gain" or check.rule == "gpu_float64":
        (lo, hi), _ = max(usable, key=lambda u: u[0][1])
    else:
        (lo, hi), _ = min(usable, key=lambda u: u[0][0])
    return lo, hi, ""


def _ref_text(check: Check, ref: pd.DataFrame) -> str:
    if check.ref_ratio is not None:
        return _ref_bounds(check, ref, "cpu")[2] or _ref_bounds(check, ref, "gpu")[2]
    rows = pd.concat([_refs(check, ref), _refs(Check("", "", "", "", "", refs=check.context_refs), ref)])
    figs = []
    for _, r in rows.iterrows():
        where = r["device"] if str(r["device"]) not in ("", "nan") else "any device"
        figs.append(f"{r['value']} {r['unit']} ({where})")
    return ", ".join(figs)


def _fmt_value(value: float, unit: str) -> str:
    if unit == "bytes":
        for f, u in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
            if abs(value) >= f:
                return mb.fmt(value / f, u)
        return mb.fmt(value, "bytes")
    if unit in ("fraction",):
        return f"{100 * value:.3g} %"
    return mb.fmt(value, unit if unit not in ("1", "") else None)


def _check_on_device(df: pd.DataFrame, device: str, check: Check, ref: pd.DataFrame) -> tuple[str, str | None]:
    """``(cell text, verdict)`` of one check on one device's rows."""
    rows = df[df["device"] == device]
    value, reason = check_value(rows, check)
    if value is None:
        text = f"not measured: {reason}" if reason else NOT_ON_BUILD
        return text, (NOT_ON_BUILD if not (check.gpu_only and not is_gpu(device)) else None)
    text = _fmt_value(value, check.unit)
    if check.gpu_only and not is_gpu(device):
        return text, None
    if check.rule == "runs_on_gpu":
        return text, "confirmed" if is_gpu(device) else None
    lo, hi, _ = _ref_bounds(check, ref, "gpu" if is_gpu(device) else "cpu")
    return text, verdict(check.rule, value * _SI.get(check.unit, 1.0), lo, hi)


def _combine(per_device: dict[str, str | None]) -> str:
    measured = {d: v for d, v in per_device.items() if v not in (None, NOT_ON_BUILD)}
    if not measured:
        return NOT_ON_BUILD
    kinds = set(measured.values())
    if len(kinds) == 1:
        return kinds.pop()
    return "; ".join(f"{d}: {v}" for d, v in measured.items())


def _gpu_rows_state(df: pd.DataFrame, check: Check) -> str:
    gpu = df[df["device"].map(is_gpu)]
    sub = _filtered(gpu, check.notebook, check.experiment, check.metric, check.params)
    if sub.empty:
        return NOT_ON_BUILD
    if (sub["status"] == "error").all():
        return "contradicted"
    return "confirmed" if sub["status"].isin(("measured", "projected")).any() else NOT_ON_BUILD


def _link(chapter: str) -> str:
    return f"{{doc}}`{chapter}`"


def findings_table(df: pd.DataFrame, ref: pd.DataFrame | None = None,
                   findings: tuple | None = None) -> pd.DataFrame:
    """One row per finding of the note (see the module docstring for the columns and the verdict rules).

    Args:
        df: rows as from :func:`msrm_lab.book.load_results`.
        ref: the note's reference rows (:func:`msrm_lab.book.reference_rows` of every section when None).
        findings: the findings to tabulate (:data:`FINDINGS` when None).
    """
    if ref is None:
        ref = mb.reference_rows()
    findings = FINDINGS if findings is None else findings
    devices = mb.devices_in(df) if not df.empty else []
    out = []
    for f in findings:
        row = {"finding": f.finding}
        # each note figure under the name of what it measures (a check compared with another quantity of the
        # note, such as the dense factorization a state-space run avoids, names that quantity, once)
        named: dict[str, list[str]] = {}
        for c in f.checks:
            text = _ref_text(c, ref)
            if text:
                figures = named.setdefault(c.ref_label or c.label, [])
                figures.extend(part for part in text.split(", ") if part not in figures)
        row[f"note ({mb.REFERENCE_LABEL})"] = "; ".join(f"{name}: {', '.join(figs)}" for name, figs in named.items())
        primary: dict[str, str | None] = {}
        secondary_verdicts: list[tuple[str, str]] = []
        for device in devices:
            cells = []
            for i, c in enumerate(f.checks):
                text, v = _check_on_device(df, device, c, ref)
                cells.append(f"{c.label}: {text}")
                if i == 0:
                    primary[device] = v
                elif v not in (None, NOT_ON_BUILD):
                    secondary_verdicts.append((c.label, v))
            row[device] = "; ".join(cells)
        first = f.checks[0]
        if first.rule == "runs_on_gpu":
            v = _gpu_rows_state(df, first)
        elif first.gpu_only and not any(is_gpu(d) for d in devices):
            v = NOT_ON_BUILD
        else:
            v = _combine({d: primary.get(d) for d in devices if not first.gpu_only or is_gpu(d)})
        others = [f"{label}: {sv}" for label, sv in secondary_verdicts if sv != v]
        row["verdict"] = v + (f" ({'; '.join(dict.fromkeys(others))})" if others else "")
        row["chapter"] = ", ".join(_link(c) for c in f.chapters)
        out.append(row)
    table = pd.DataFrame(out).set_index("finding")
    # a device none of whose checks was measured gets no column (named in attrs["unmeasured"] instead)
    silent = [d for d in devices
              if all(part.endswith(NOT_ON_BUILD) for cell in table[d] for part in str(cell).split("; "))]
    table = table.drop(columns=silent)
    table.attrs["unmeasured"] = silent + ([] if any(is_gpu(d) for d in devices) else [GPU_COLUMN])
    return table


# --- the seven findings -------------------------------------------------------------------------------------

_LEAPFROG = dict(K=3)
# the note figure both dense-wall checks are compared with
_DENSE_8X = "dense factorization plus inverse at the 8x K=5 dimension (extrapolated)"
FINDINGS = (
    Finding(
        "rmsrm_cpu",
        "R-MSRM is CPU work: a restart takes minutes on cores alone",
        (Check("100-iteration restart", "rmsrm", "restart", "wall_s", "s",
               refs=(("rmsrm", "100-iteration restart at one-eighth"),)),
         Check("dense residual per call", "rmsrm", "phase_profile", "per_call_ms", "ms",
               params=dict(phase="dense reconstruction residual", scale=1.0),
               refs=(("summary", "largest single R-MSRM operation (dense reconstruction residual)"),))),
        ("rmsrm",)),
    Finding(
        "gp_on_cuda",
        "the GP code runs on a CUDA device with only an install and a platform switch",
        (Check("value+grad K=3 one-eighth", "gradient_nuts", "objective_gradient", "value_and_grad_median_s", "s",
               rule="runs_on_gpu", params=dict(K=3, n_features=3600), gpu_only=True,
               refs=(("summary", "GP objective-and-gradient K=3 one-eighth"),)),),
        ("gpu_support",)),
    Finding(
        "float64_gpu",
        "consumer GPUs run float64 at a small fraction of float32; a workstation card is the useful one",
        (Check("float64 matmul peak", "linalg", "matmul", "gflops", "GFLOP/s", rule="gpu_float64",
               params=dict(dtype="float64"), agg="max", gpu_only=True,
               refs=(("summary", "float64 matmul peak"),
                     ("summary", "float64 matmul throughput (day's background load)"))),
         Check("value+grad K=3 one-eighth", "gp_grouped", "value_and_grad", "median_s", "s",
               params=dict(K=3, n_features=3600),
               refs=(("summary", "GP objective-and-gradient K=3 one-eighth"),))),
        ("linalg", "gp_grouped")),
    Finding(
        "cpu_callback",
        "the CPU factorization callback carried an avoidable cost that thread settings remove",
        (Check("callback / direct POTRF+POTRI, same threads", "threads", "callback_overhead", "ratio", "x",
               params=dict(oversubscribed=False), agg="min",
               ref_ratio=(("gp_parts", "callback POTRF+POTRI 16 threads load 42"),
                          ("summary", "direct POTRF+POTRI n=2727 16 threads"))),
         Check("callback POTRF+POTRI, oversubscribed", "threads", "callback_potrf_potri", "median_s", "s",
               rule="pathology", params=dict(oversubscribed=True), agg="max",
               refs=(("gp_parts", "callback POTRF+POTRI 64 threads load 36"),)),
         Check("gradient time added 360 to 3600 features", "gp_grouped", "feature_sweep", "median_s", "s",
               params=dict(n_features=3600), minus=dict(n_features=360),
               refs=(("gp_parts", "added gradient time 360->3600 brain features"),))),
        ("threads", "gp_grouped")),
    Finding(
        "dense_wall",
        "for one long recording the dense grouped algebra, not the device, is the limit",
        (Check("state space value+grad, 8x one run K=5", "state_space", "targets", "long_value_and_grad_s", "s",
               params=dict(requested="auto"), ref_any=True,
               ref_label=_DENSE_8X,
               refs=(("linalg", "factorization-plus-inverse at n=36000 (extrapolated)"),),
               context_refs=(("summary", "dense factorization dimension for 8x one run at K=5"),)),
         Check("grouped value+grad, 8x one run K=5", "state_space", "ladder", "median_s", "s",
               params=dict(backend="grouped", scale=8.0), rule="pathology", ref_any=True,
               ref_label=_DENSE_8X,
               refs=(("linalg", "factorization-plus-inverse at n=36000 (extrapolated)"),)),
         Check("grouped duration exponent", "state_space", "ladder", "duration_exponent", "",
               params=dict(backend="grouped"))),
        ("state_space", "scaling")),
    Finding(
        "posterior",
        "the posterior is the expensive part, where a GPU would pay",
        (Check("NUTS leapfrog step K=3", "gradient_nuts", "nuts", "seconds_per_leapfrog", "s", params=_LEAPFROG,
               refs=(("summary", "NUTS leapfrog step K=3 one-eighth"),)),
         Check("leapfrog / bare gradient", "gradient_nuts", "nuts", "leapfrog_over_bare_gradient", "x",
               params=_LEAPFROG, refs=(("nuts", "leapfrog cost / bare gradient"),)),
         Check("two chains vectorized, throughput over one", "gradient_nuts", "nuts_vectorized",
               "throughput_ratio_2_vs_1", "x", rule="gain", params=_LEAPFROG,
               refs=(("summary", "two vectorized chains throughput gain"),)),
         Check("one full chain", "gradient_nuts", "projection", "full_chain_days", "day",
               params=dict(K=3, basis="measured"),
               refs=(("summary", "one chain 1000 warmup + 1200 draws one-eighth"),)),
         Check("diagnostics, 15 draws", "gradient_nuts", "diagnostics", "msrm_seconds", "s",
               params=dict(case="note_case"),
               refs=(("summary", "ArviZ diagnostics 15 draws 57757 parameters"),))),
        ("gradient_nuts",)),
    Finding(
        "state_space_scale",
        "the state-space backend could not run at the study's size as first written",
        (Check("state space value+grad memory K=3", "state_space", "memory", "state_space_peak_rss_delta_bytes",
               "bytes", refs=(("summary", "state-space staged transition arrays K=3 (48000 observations)"),)),
         Check("state space value+grad K=3", "state_space", "speed", "median_s", "s",
               params=dict(backend="state_space"))),
        ("state_space",)),
)


# --- which backend, which method, which device ------------------------------------------------------------

@dataclass(frozen=True)
class DecisionCase:
    """One problem class: candidates are the values of column ``by`` among the matching rows; the best is the
    lowest ``metric`` (highest when ``higher_better``); with ``qualifier`` (a 0/1 metric such as
    ``converged``), qualified candidates rank before the others. Only rows of ``profiles`` count."""
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
    profiles: tuple = ("note", "full")


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


def _decide(rows: pd.DataFrame, case: DecisionCase) -> str:
    rows = rows[rows["profile"].isin(case.profiles)]
    sub = _filtered(rows, case.notebook, case.experiment, case.metric, case.params)
    if sub.empty or case.by not in sub.columns:
        return NOT_ON_BUILD
    rank = {p: i for i, p in enumerate(mb.PROFILE_ORDER)}
    best_profile = min(rank.get(p, len(rank)) for p in sub["profile"])
    sub = sub[sub["profile"].map(lambda p: rank.get(p, len(rank))) == best_profile]
    cands, refused = [], []
    for name, g in sub.groupby(case.by, sort=True):
        m = g[g["status"].isin(("measured", "projected")) & g["value"].notna()]
        if m.empty:
            reason = g["reason"].dropna().iloc[0] if "reason" in g.columns and g["reason"].notna().any() else \
                mb.NOT_MEASURED
            refused.append(f"{name} not measured: {reason}")
            continue
        value = float(m.sort_values("info_timestamp", ascending=False)["value"].iloc[0]) if case.metric != \
            "restarts_per_min" else float(m["value"].max())
        ok = True
        if case.qualifier:
            q = _filtered(rows, case.notebook, case.experiment, case.qualifier, {**case.params, case.by: name})
            ok = bool(not q.empty and float(q["value"].iloc[0]) >= 1.0)
        cands.append((name, value, ok))
    if not cands:
        return "; ".join(refused) or NOT_ON_BUILD
    key = (lambda c: (not c[2], -c[1])) if case.higher_better else (lambda c: (not c[2], c[1]))
    cands.sort(key=key)
    name, value, ok = cands[0]
    text = f"{name}: {mb.fmt(value, case.unit)}" + ("" if ok or not case.qualifier else f" (not {case.qualifier})")
    others = [f"{n} {mb.fmt(v, case.unit)}" + ("" if o or not case.qualifier else f" (not {case.qualifier})")
              for n, v, o in cands[1:]]
    return "; ".join([text] + ([f"against {', '.join(others)}"] if others else []) + refused)


def decision_table(df: pd.DataFrame, cases: tuple | None = None) -> pd.DataFrame:
    """Which backend, method and device per problem class, from the rows: per device label, the best measured
    candidate and its value, then the other candidates' values or the reason they were not measured (a
    budget or memory-guard refusal recorded in the row), or :data:`msrm_lab.book.MISSING` for a case the device did
    not run. A device that ran none of the cases has no column, and with no ``cuda-*`` label there is no GPU
    column: ``attrs["unmeasured"]`` names them (the GPU as :data:`GPU_COLUMN`)."""
    cases = DECISIONS if cases is None else cases
    devices = mb.devices_in(df) if not df.empty else []
    out = []
    for case in cases:
        row = {"problem": case.problem, "question": case.question}
        for device in devices:
            row[device] = _decide(df[df["device"] == device], case)
        out.append(row)
    table = pd.DataFrame(out).set_index(["problem", "question"])
    # a device that measured none of the cases gets no column; in the others a case it did not run reads MISSING
    silent = [d for d in devices if (table[d] == NOT_ON_BUILD).all()]
    table = table.drop(columns=silent).replace(NOT_ON_BUILD, mb.MISSING)
    table.attrs["unmeasured"] = silent + ([] if any(is_gpu(d) for d in devices) else [GPU_COLUMN])
    return table


def devices_title(df: pd.DataFrame) -> str:
    """The device labels of a build joined for a title (``"a and b"``), or "no device yet"."""
    devices = mb.devices_in(df) if not df.empty else []
    if not devices:
        return "no device yet"
    return devices[0] if len(devices) == 1 else ", ".join(devices[:-1]) + " and " + devices[-1]
