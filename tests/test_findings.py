"""msrm_lab.findings: verdict rules, missing rows, device columns, and the table on the committed rows."""
from __future__ import annotations

import pandas as pd
import pytest

import msrm_lab.book as mb
from msrm_lab import findings as fz


def _row(device, notebook, experiment, metric, value, unit="s", status="measured", profile="note", **params):
    rec = {"device": device, "profile": profile, "notebook": notebook, "experiment": experiment, "metric": metric,
           "value": value, "unit": unit, "status": status, "info_timestamp": "2026-01-01T00:00:00+00:00"}
    rec.update(params)
    return rec


def _df(rows):
    return pd.DataFrame.from_records(rows)


REF = pd.DataFrame([
    {"source": mb.REFERENCE_LABEL, "section": "s", "metric": "restart", "device": "cpu-64core", "value": "60-120",
     "unit": "s", "context": ""},
    {"source": mb.REFERENCE_LABEL, "section": "s", "metric": "step", "device": "cpu-64core", "value": "2.0",
     "unit": "s", "context": ""},
    {"source": mb.REFERENCE_LABEL, "section": "s", "metric": "step", "device": "rtx-3090", "value": "370",
     "unit": "ms", "context": ""},
    {"source": mb.REFERENCE_LABEL, "section": "s", "metric": "peak", "device": "rtx-pro-6000", "value": "2.1",
     "unit": "TFLOPS", "context": ""},
])

RESTART = fz.Finding("restart", "a restart", (fz.Check("restart", "rmsrm", "restart", "wall_s", "s",
                                                       refs=(("s", "restart"),)),), ("rmsrm",))
STEP = fz.Finding("step", "a step", (fz.Check("step", "nuts", "nuts", "step_s", "s", params=dict(K=3),
                                              refs=(("s", "step"),)),), ("gradient_nuts",))
PEAK = fz.Finding("peak", "float64 peak", (fz.Check("peak", "linalg", "matmul", "gflops", "GFLOP/s",
                                                    rule="gpu_float64", agg="max", gpu_only=True,
                                                    refs=(("s", "peak"),)),), ("linalg",))


@pytest.mark.parametrize("rule,value,expected", [
    ("cost", 10.0, "improved"), ("cost", 29.0, "improved"), ("cost", 30.0, "confirmed"), ("cost", 240.0, "confirmed"),
    ("cost", 241.0, "contradicted"), ("gain", 241.0, "improved"), ("gain", 100.0, "confirmed"),
    ("gain", 29.0, "contradicted"), ("pathology", 30.0, "confirmed"), ("pathology", 29.0, "contradicted"),
    ("gpu_float64", 240.0, "confirmed"), ("gpu_float64", 241.0, "improved"),
])
def test_verdict_rules_use_the_noise_factor(rule, value, expected):
    assert fz.NOISE == 2.0
    assert fz.verdict(rule, value, 60.0, 120.0) == expected


def test_verdict_without_value_or_reference():
    assert fz.verdict("cost", None, 1.0, 2.0) == fz.NOT_ON_BUILD
    assert fz.verdict("cost", float("nan"), 1.0, 2.0) == fz.NOT_ON_BUILD
    assert fz.verdict("cost", 1.0, None, None) is None
    with pytest.raises(ValueError, match="rule 'faster'"):
        fz.verdict("faster", 1.0, 1.0, 1.0)


def test_reference_range_parses_ranges_and_units():
    assert fz.reference_range("60-120", "s") == (60.0, 120.0)
    assert fz.reference_range("~7", "day") == (7 * 86400.0, 7 * 86400.0)
    assert fz.reference_range("400-2900", "ms") == pytest.approx((0.4, 2.9))
    with pytest.raises(ValueError, match="reference unit"):
        fz.reference_range("1", "furlongs")
    with pytest.raises(ValueError, match="not a number"):
        fz.reference_range("many", "s")


def test_table_has_one_column_per_device_and_names_the_missing_gpu():
    df = _df([_row("cpu-a-2c", "rmsrm", "restart", "wall_s", 20.0),
              _row("cpu-b-2c", "rmsrm", "restart", "wall_s", 100.0)])
    t = fz.findings_table(df, REF, findings=(RESTART,))
    assert list(t.columns) == [f"note ({mb.REFERENCE_LABEL})", "cpu-a-2c", "cpu-b-2c", "verdict", "chapter"]
    assert t.attrs["unmeasured"] == [fz.GPU_COLUMN]
    row = t.loc["a restart"]
    assert row["cpu-a-2c"] == "restart: 20 s" and row["cpu-b-2c"] == "restart: 100 s"
    assert row["verdict"] == "cpu-a-2c: improved; cpu-b-2c: confirmed"
    assert row["chapter"] == "{doc}`rmsrm`"
    assert "60-120 s (cpu-64core)" in row[f"note ({mb.REFERENCE_LABEL})"]


def test_note_figure_of_another_quantity_is_named_by_its_ref_label_once():
    """Two checks compared with the same note figure of another quantity (the dense factorization a state-space
    run avoids) show that figure once, under the name of what it measures, never under a check's label."""
    ref_label = "dense factorization at that size"
    wall = fz.Finding("wall", "the dense wall", (
        fz.Check("state space step", "state_space", "targets", "step_s", "s", ref_any=True, ref_label=ref_label,
                 refs=(("s", "restart"),), context_refs=(("s", "step"),)),
        fz.Check("grouped step", "state_space", "ladder", "step_s", "s", rule="pathology", ref_any=True,
                 ref_label=ref_label, refs=(("s", "restart"),))), ("state_space",))
    df = _df([_row("cpu-a-2c", "state_space", "targets", "step_s", 3.0),
              _row("cpu-a-2c", "state_space", "ladder", "step_s", 500.0)])
    note = fz.findings_table(df, REF, findings=(wall,)).loc["the dense wall", f"note ({mb.REFERENCE_LABEL})"]
    assert note == f"{ref_label}: 60-120 s (cpu-64core), 2.0 s (cpu-64core), 370 ms (rtx-3090)"
    assert "state space step" not in note


def test_missing_rows_and_quick_profile_are_not_measured():
    df = _df([_row("cpu-a-2c", "rmsrm", "restart", "wall_s", 20.0, profile="quick"),
              _row("cpu-a-2c", "other", "x", "y", 1.0)])
    t = fz.findings_table(df, REF, findings=(RESTART, STEP))
    # nothing measured on cpu-a-2c for these findings: no column, the device named once instead
    assert "cpu-a-2c" not in t.columns and t.attrs["unmeasured"] == ["cpu-a-2c", fz.GPU_COLUMN]
    assert t.loc["a restart", "verdict"] == fz.NOT_ON_BUILD
    assert t.loc["a step", "verdict"] == fz.NOT_ON_BUILD


def test_refused_row_shows_its_reason():
    df = _df([_row("cpu-a-2c", "rmsrm", "restart", "wall_s", None, status="not_yet_measured",
                   reason="predicted 701 s exceeds the budget")])
    t = fz.findings_table(df, REF, findings=(RESTART,))
    assert t.loc["a restart", "cpu-a-2c"] == "restart: not measured: predicted 701 s exceeds the budget"


def test_device_class_picks_the_matching_reference():
    # 0.5 s: improved against the note's CPU figure (2.0 s), confirmed against its GPU figure (0.37 s, within NOISE).
    df = _df([_row("cpu-a-2c", "nuts", "nuts", "step_s", 0.5, K=3),
              _row("cuda-h200", "nuts", "nuts", "step_s", 0.5, K=3)])
    t = fz.findings_table(df, REF, findings=(STEP,))
    assert fz.GPU_COLUMN not in t.columns and t.attrs["unmeasured"] == []
    assert t.loc["a step", "verdict"] == "cpu-a-2c: improved; cuda-h200: confirmed"


def test_gpu_only_finding_reads_not_measured_without_cuda_rows():
    df = _df([_row("cpu-a-2c", "linalg", "matmul", "gflops", 80.0, "GFLOP/s", n=1),
              _row("cpu-a-2c", "linalg", "matmul", "gflops", 50.0, "GFLOP/s", n=2)])
    t = fz.findings_table(df, REF, findings=(PEAK,))
    assert t.loc["float64 peak", "cpu-a-2c"] == "peak: 80 GFLOP/s"  # shown (max over n), no verdict from a CPU
    assert t.loc["float64 peak", "verdict"] == fz.NOT_ON_BUILD
    gpu = _df([_row("cuda-h200", "linalg", "matmul", "gflops", 40000.0, "GFLOP/s", n=1)])
    t = fz.findings_table(pd.concat([df, gpu]), REF, findings=(PEAK,))
    assert t.loc["float64 peak", "verdict"] == "improved"  # above NOISE x the note's best GPU peak


def test_runs_on_gpu_rule():
    f = fz.Finding("gpu", "runs on a GPU", (fz.Check("v", "g", "e", "m", "s", rule="runs_on_gpu", gpu_only=True),),
                   ("gpu_support",))
    cpu = [_row("cpu-a-2c", "g", "e", "m", 1.0)]
    assert fz.findings_table(_df(cpu), REF, findings=(f,)).loc["runs on a GPU", "verdict"] == fz.NOT_ON_BUILD
    ok = cpu + [_row("cuda-h200", "g", "e", "m", 0.1)]
    assert fz.findings_table(_df(ok), REF, findings=(f,)).loc["runs on a GPU", "verdict"] == "confirmed"
    bad = cpu + [_row("cuda-h200", "g", "e", "m", None, status="error")]
    assert fz.findings_table(_df(bad), REF, findings=(f,)).loc["runs on a GPU", "verdict"] == "contradicted"


def test_ratio_and_difference_checks_against_direct_computation():
    c_over = fz.Check("r", "n", "e", "m", "s", params=dict(k=1), over=dict(k=2))
    c_minus = fz.Check("d", "n", "e", "m", "s", params=dict(k=1), minus=dict(k=2))
    df = _df([_row("cpu", "n", "e", "m", 6.0, k=1), _row("cpu", "n", "e", "m", 2.0, k=2)])
    assert fz.check_value(df, c_over) == (3.0, None)
    assert fz.check_value(df, c_minus) == (4.0, None)


def test_decision_table_names_best_candidate_and_refusals():
    case = fz.DecisionCase("long", "backend", "ss", "ladder", "median_s", "s", "backend", dict(scale=8))
    df = _df([_row("cpu-a-2c", "ss", "ladder", "median_s", 1.5, backend="state_space", scale=8),
              _row("cpu-a-2c", "ss", "ladder", "median_s", None, status="not_yet_measured", backend="grouped",
                   scale=8, reason="memory guard: 60 GB predicted"),
              _row("cpu-a-2c", "ss", "ladder", "median_s", 9.0, backend="dense", scale=8)])
    t = fz.decision_table(df, cases=(case,))
    cell = t.loc[("long", "backend"), "cpu-a-2c"]
    assert cell.startswith("state_space: 1.5 s")
    assert "dense 9 s" in cell and "grouped not measured: memory guard: 60 GB predicted" in cell
    assert fz.GPU_COLUMN not in t.columns and t.attrs["unmeasured"] == [fz.GPU_COLUMN]
    # a second case that cpu-a-2c did not run reads MISSING; a device that ran no case has no column
    other = fz.DecisionCase("short", "backend", "ss", "speed", "median_s", "s", "backend", {})
    t = fz.decision_table(pd.concat([df, _df([_row("cpu-z-2c", "linalg", "m", "x", 1.0)])]), cases=(case, other))
    assert list(t.columns) == ["cpu-a-2c"] and t.loc[("short", "backend"), "cpu-a-2c"] == mb.MISSING
    assert t.attrs["unmeasured"] == ["cpu-z-2c", fz.GPU_COLUMN]


def test_decision_qualifier_ranks_converged_first():
    case = fz.DecisionCase("p", "fit", "t", "g", "total_s", "s", "la", {}, qualifier="converged")
    df = _df([_row("c", "t", "g", "total_s", 100.0, la="grouped"), _row("c", "t", "g", "converged", 0.0, la="grouped"),
              _row("c", "t", "g", "total_s", 300.0, la="ss"), _row("c", "t", "g", "converged", 1.0, la="ss")])
    cell = fz.decision_table(df, cases=(case,)).loc[("p", "fit"), "c"]
    assert cell.startswith("ss: 300 s") and "grouped 100 s (not converged)" in cell


def test_devices_title():
    assert fz.devices_title(_df([_row("b", "n", "e", "m", 1.0), _row("a", "n", "e", "m", 1.0)])) == "a and b"
    assert fz.devices_title(pd.DataFrame(columns=["device"])) == "no device yet"


def test_tables_on_the_committed_rows():
    df = mb.load_results()
    t = fz.findings_table(df)
    assert len(t) == len(fz.FINDINGS) == 7
    for v in t["verdict"]:
        assert any(v.startswith(k) or f": {k}" in v for k in fz.VERDICTS), v
    for device in mb.devices_in(df):
        assert (device in t.columns) != (device in t.attrs["unmeasured"])
    assert all(c.startswith("{doc}`") for c in t["chapter"])
    d = fz.decision_table(df)
    assert len(d) == len(fz.DECISIONS)
