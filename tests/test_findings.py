"""msrm_lab.findings: the verdict rule on a hand-made frame, the decision table, and both on the committed rows."""
from __future__ import annotations

import pandas as pd
import pytest

import msrm_lab.book as mb
from msrm_lab import findings as fz


def _row(device, notebook, experiment, metric, value, unit="s", status="measured", profile="note",
         stamp="2026-01-01T00:00:00+00:00", **params):
    return {"device": device, "profile": profile, "notebook": notebook, "experiment": experiment, "metric": metric,
            "value": value, "unit": unit, "status": status, "info_timestamp": stamp, **params}


def _df(rows):
    return pd.DataFrame.from_records(rows)


REF = pd.DataFrame([
    {"section": "s", "metric": "restart", "device": "cpu-64core", "value": "60-120", "unit": "s"},
    {"section": "s", "metric": "direct", "device": "cpu-64core", "value": "60", "unit": "ms"},
    {"section": "s", "metric": "peak", "device": "rtx-pro-6000", "value": "2.1", "unit": "TFLOPS"},
])
RESTART = fz.Finding("a restart", "restart", (("s", "restart", "cpu-64core"),), "rmsrm", "restart", "wall_s",
                     chapters=("rmsrm",))
RATIO = fz.Finding("a ratio", "restart over direct", (("s", "restart", "cpu-64core"), ("s", "direct", "cpu-64core")),
                   "threads", "overhead", "ratio", agg="min")
PEAK = fz.Finding("a GPU peak", "peak", (("s", "peak", "rtx-pro-6000"),), "linalg", "matmul", "gflops",
                  devices="cuda", agg="max")


@pytest.mark.parametrize("value, expected", [
    (29.0, fz.LOWER), (30.0, fz.AGREES), (90.0, fz.AGREES), (240.0, fz.AGREES), (241.0, fz.HIGHER),
    (None, fz.NOT_HERE), (float("nan"), fz.NOT_HERE),
])
def test_verdict_is_within_a_factor_of_the_notes_range(value, expected):
    assert fz.FACTOR == 2.0
    assert fz.verdict(value, 60.0, 120.0) == expected


def test_reference_range_parses_ranges_and_units():
    assert fz.reference_range("60-120", "s") == (60.0, 120.0)
    assert fz.reference_range("~7", "day") == (7 * 86400.0, 7 * 86400.0)
    assert fz.reference_range("400-2900", "ms") == pytest.approx((0.4, 2.9))
    with pytest.raises(ValueError, match="reference unit"):
        fz.reference_range("1", "furlongs")
    with pytest.raises(ValueError, match="not a number"):
        fz.reference_range("many", "s")


def test_table_on_a_hand_made_frame():
    df = _df([
        _row("cpu-a-2c", "rmsrm", "restart", "wall_s", 100.0, stamp="2026-01-01"),
        _row("cpu-b-2c", "rmsrm", "restart", "wall_s", 20.0, stamp="2026-02-01"),       # the most recent device
        _row("cpu-c-2c", "rmsrm", "restart", "wall_s", 90.0, profile="quick", stamp="2026-03-01"),  # not compared
        _row("cpu-a-2c", "threads", "overhead", "ratio", 1.5, "x"), _row("cpu-a-2c", "threads", "overhead", "ratio",
                                                                         3.0, "x"),
        _row("cpu-a-2c", "linalg", "matmul", "gflops", 80.0, "GFLOP/s"),             # a CPU row: not a GPU figure
    ])
    t = fz.findings_table(df, REF, findings=(RESTART, RATIO, PEAK))
    assert list(t.columns) == ["quantity", f"note ({mb.REFERENCE_LABEL})", "this build", "this build / note",
                               "verdict", "chapter"]
    r = t.loc["a restart"]
    assert (r["this build"], r["verdict"], r["chapter"]) == ("20 s (cpu-b-2c, note)", fz.LOWER, "{doc}`rmsrm`")
    assert r[f"note ({mb.REFERENCE_LABEL})"] == "60-120 s (cpu-64core)" and r["this build / note"] == "0.236 x"
    r = t.loc["a ratio"]  # the note's figure is 60-120 s / 60 ms = 1000-2000; this build's the smaller ratio
    assert r[f"note ({mb.REFERENCE_LABEL})"] == "60-120 s / 60 ms = 1,414 x (cpu-64core)"
    assert r["this build"] == "1.5 x (cpu-a-2c, note)" and r["verdict"] == fz.LOWER
    r = t.loc["a GPU peak"]
    assert (r["this build"], r["this build / note"], r["verdict"]) == ("no cuda-* row", "", fz.NOT_HERE)
    gpu = _df([_row("cuda-h200", "linalg", "matmul", "gflops", g, "GFLOP/s", n=n) for n, g in ((1, 900.0),
                                                                                               (2, 1500.0))])
    r = fz.findings_table(pd.concat([df, gpu]), REF, findings=(PEAK,)).loc["a GPU peak"]
    assert r["this build"] == "1,500 GFLOP/s (cuda-h200, note)" and r["verdict"] == fz.AGREES  # max over n


def test_refused_row_shows_its_reason_and_a_missing_reference_row_is_named():
    df = _df([_row("cpu-a-2c", "rmsrm", "restart", "wall_s", None, status="not_yet_measured",
                   reason="predicted 701 s exceeds the budget")])
    r = fz.findings_table(df, REF, findings=(RESTART,)).loc["a restart"]
    assert r["this build"] == "not measured: predicted 701 s exceeds the budget (cpu-a-2c, note)"
    assert r["verdict"] == fz.NOT_HERE
    with pytest.raises(KeyError, match="no reference row"):
        fz.findings_table(df, REF.iloc[1:], findings=(RESTART,))


def test_decision_table_names_best_candidate_and_refusals():
    case = fz.DecisionCase("long", "backend", "ss", "ladder", "median_s", "s", "backend", dict(scale=8))
    df = _df([_row("cpu-a-2c", "ss", "ladder", "median_s", 1.5, backend="state_space", scale=8),
              _row("cpu-a-2c", "ss", "ladder", "median_s", None, status="not_yet_measured", backend="grouped",
                   scale=8, reason="memory guard: 60 GB predicted"),
              _row("cpu-a-2c", "ss", "ladder", "median_s", 9.0, backend="dense", scale=8)])
    t = fz.decision_table(df, cases=(case,))
    assert t.loc[("long", "backend"), "cpu-a-2c"] == ("state_space: 1.5 s; against dense 9 s; "
                                                      "grouped not measured: memory guard: 60 GB predicted")
    assert fz.GPU_COLUMN not in t.columns and t.attrs["unmeasured"] == [fz.GPU_COLUMN]
    # a second case that cpu-a-2c did not run reads MISSING; a device that ran no case has no column
    other = fz.DecisionCase("short", "backend", "ss", "speed", "median_s", "s", "backend", {})
    t = fz.decision_table(pd.concat([df, _df([_row("cpu-z-2c", "linalg", "m", "x", 1.0)])]), cases=(case, other))
    assert list(t.columns) == ["cpu-a-2c"] and t.loc[("short", "backend"), "cpu-a-2c"] == mb.MISSING
    assert t.attrs["unmeasured"] == ["cpu-z-2c", fz.GPU_COLUMN]


def test_decision_qualifier_ranks_converged_first():
    case = fz.DecisionCase("p", "fit", "t", "g", "total_s", "s", "la", {}, qualifier="converged")
    df = _df([_row("c", "t", "g", "total_s", 100.0, la="grouped"), _row("c", "t", "g", "converged", 0.0,
                                                                     la="grouped"),
              _row("c", "t", "g", "total_s", 300.0, la="ss"), _row("c", "t", "g", "converged", 1.0, la="ss")])
    assert fz.decision_table(df, cases=(case,)).loc[("p", "fit"), "c"] == "ss: 300 s; against grouped 100 s " \
                                                                          "(not converged)"


def test_devices_title():
    assert fz.devices_title(_df([_row("b", "n", "e", "m", 1.0), _row("a", "n", "e", "m", 1.0)])) == "a and b"
    assert fz.devices_title(pd.DataFrame(columns=["device"])) == "no device yet"


def test_tables_on_the_committed_rows():
    df = mb.load_results()
    t = fz.findings_table(df)
    assert len(t) == len(fz.FINDINGS) == 7
    assert set(t["verdict"]) <= {fz.AGREES, *fz.DIFFERS, fz.NOT_HERE}
    assert all(c.startswith("{doc}`") for c in t["chapter"])
    assert len(fz.decision_table(df)) == len(fz.DECISIONS)
