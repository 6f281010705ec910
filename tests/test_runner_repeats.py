"""Repeated executions of a notebook: the merge of their rows, and the runner that executes and merges them."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from msrm_lab.bench.rows import make_row, read_rows
from msrm_lab.notebooks import __main__ as cli
from msrm_lab.notebooks import run_notebook
from msrm_lab.notebooks.repeats import merge_rows
from msrm_lab.notebooks.runner import run_notebooks
from notebook_helpers import toy_notebook

LABEL = "cpu-test-1c"


def _row(metric, value, *, status="measured", load=0.5, experiment="exp", unit="s", **params):
    info = {"load_average_1m": load, "git_commit": "abc"}
    return make_row("toy", experiment, metric, value, unit, status=status, info=info, **params)


def test_numeric_values_merge_to_median_min_max_and_loads():
    repeats = [[_row("a", 3.0, load=1.0, K=2), _row("b", 10.0, load=1.0)],
               [_row("a", 1.0, load=2.5, K=99), _row("b", 30.0, load=2.5)],
               [_row("a", 2.0, load=0.5, K=99), _row("b", 20.0, load=0.5)]]
    a, b = merge_rows(repeats)
    assert a["value"] == 2.0 and b["value"] == 20.0
    assert a["params"] == {"K": 2, "process_repeats": 3, "process_values": [3.0, 1.0, 2.0], "process_min": 1.0,
                           "process_max": 3.0, "process_load_average_1m": [1.0, 2.5, 0.5]}
    assert a["execution_info"] == {"load_average_1m": 2.5, "git_commit": "abc"}
    assert (b["params"]["process_min"], b["params"]["process_max"]) == (10.0, 30.0)
    # an even count takes the mean of the middle two, as statistics.median does
    (even,) = merge_rows([[_row("a", 1.0)], [_row("a", 4.0)]])
    assert even["value"] == 2.5 == statistics.median([1.0, 4.0])
    # the inputs are not modified
    assert repeats[0][0]["params"] == {"K": 2} and repeats[0][0]["execution_info"]["load_average_1m"] == 1.0


def test_mismatched_repeats_are_refused_naming_the_first_mismatch():
    with pytest.raises(ValueError, match=r"row 1: repeat 0 and repeat 2 differ in metric 'b' vs 'c'"):
        merge_rows([[_row("a", 1.0), _row("b", 1.0)], [_row("a", 1.0), _row("b", 1.0)],
                    [_row("a", 1.0), _row("c", 1.0)]])
    with pytest.raises(ValueError, match=r"status 'measured' vs 'error'"):
        merge_rows([[_row("a", 1.0)], [_row("a", None, status="error")]])
    with pytest.raises(ValueError, match=r"row 1: repeat 0 wrote 2 rows, repeat 1 wrote 1"):
        merge_rows([[_row("a", 1.0), _row("b", 1.0)], [_row("a", 1.0)]])
    with pytest.raises(ValueError, match="at least one"):
        merge_rows([])


def test_none_values_all_none_kept_mixed_become_an_error():
    (all_none,) = merge_rows([[_row("a", None, status="error", reason="boom")],
                              [_row("a", None, status="error", reason="bang")]])
    assert all_none["value"] is None and all_none["status"] == "error"
    assert all_none["params"]["reason"] == "boom" and all_none["params"]["process_values"] == [None, None]
    assert all_none["params"]["process_min"] is None and all_none["params"]["process_max"] is None
    (mixed,) = merge_rows([[_row("a", None, status="error")], [_row("a", 0.25, status="error")],
                           [_row("a", None, status="error")]])
    assert mixed["value"] is None and mixed["status"] == "error"
    assert "repeat(s) [0, 2] of 3" in mixed["params"]["reason"]
    assert mixed["params"]["process_values"] == [None, 0.25, None]


def test_rows_without_a_measurement_stay_as_the_first_repeat_wrote_them():
    first = [_row("a", None, status="not_yet_measured", reason="later"), _row("b", None, status="refused", n=1),
             _row("c", 5.0, status="projected")]
    second = [_row("a", None, status="not_yet_measured", reason="other", load=9.0),
              _row("b", None, status="refused", n=2, load=9.0), _row("c", 7.0, status="projected", load=9.0)]
    a, b, c = merge_rows([first, second])
    assert a == first[0] and b == first[1]
    assert c["status"] == "projected" and c["value"] == 6.0 and c["params"]["process_values"] == [5.0, 7.0]


def test_a_size_skipped_in_one_repeat_and_refused_in_another_merges_with_both_reasons():
    skipped = [_row("a", 1.0), _row("m", None, status="not_yet_measured", reason="over the time budget")]
    refused = [_row("a", 3.0), _row("m", None, status="refused", reason="memory guard", load=4.0)]
    a, m = merge_rows([skipped, refused, skipped])
    assert a["value"] == 1.0
    assert m["status"] == "not_yet_measured" and m["value"] is None
    assert m["params"]["reason"] == "over the time budget"
    assert m["params"]["process_statuses"] == ["not_yet_measured", "refused", "not_yet_measured"]
    assert m["params"]["process_reasons"] == ["over the time budget", "memory guard", "over the time budget"]
    # a row without a measurement still does not match a measured one
    with pytest.raises(ValueError, match=r"status 'refused' vs 'measured'"):
        merge_rows([[_row("m", None, status="refused")], [_row("m", 2.0)]])


# --- the runner -----------------------------------------------------------------------------------------------------

_notebook = toy_notebook


RANDOM_ROWS = ("import os, pathlib, random\n"
               "from msrm_lab.bench.rows import make_row, write_rows\n"
               "out = pathlib.Path(out_dir); out.mkdir(parents=True, exist_ok=True)\n"
               "rows = [make_row('toy', 'draw', 'value', random.SystemRandom().random() + 1.0, 's', pid=os.getpid()),\n"
               "        make_row('toy', 'later', 'value', None, 's', status='not_yet_measured', pid=os.getpid())]\n"
               "write_rows(out / 'rows.jsonl', rows)\n"
               "(out / 'figure.txt').write_text(str(os.getpid()))\n")


def test_two_repeats_run_in_two_processes_and_the_row_holds_their_median(tmp_path):
    nb = _notebook(tmp_path / "nbs" / "00_toy.ipynb", RANDOM_ROWS)
    res = run_notebook(nb, profile="smoke", platform="cpu", label=LABEL, results=tmp_path / "res", repeats=2)
    assert res.status == "ok", res.error
    folder = tmp_path / "res" / LABEL / "smoke" / "toy"
    draw, later = read_rows(folder / "rows.jsonl")
    values = draw["params"]["process_values"]
    assert len(values) == 2 and values[0] != values[1]
    assert draw["value"] == pytest.approx(statistics.median(values))
    assert draw["params"]["process_repeats"] == 2
    assert (draw["params"]["process_min"], draw["params"]["process_max"]) == (min(values), max(values))
    assert len(draw["params"]["process_load_average_1m"]) == 2
    assert draw["execution_info"]["load_average_1m"] == max(draw["params"]["process_load_average_1m"])
    # the figure and the unmerged row are the first execution's, from the same process
    assert (folder / "figure.txt").read_text() == str(draw["params"]["pid"]) == str(later["params"]["pid"])
    assert "process_repeats" not in later["params"]
    status = json.loads((folder / "status.json").read_text())
    assert status["status"] == "ok" and status["repeats"] == 2 and len(status["repeat_runs"]) == 2
    assert all(r["wall_s"] > 0 and "load_average_1m" in r for r in status["repeat_runs"])
    assert status["wall_s"] == pytest.approx(sum(r["wall_s"] for r in status["repeat_runs"]), abs=0.01)
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")], "temporary folders were left behind"


FAILS_SECOND_TIME = ("import json, os, pathlib\n"
                     "out = pathlib.Path(out_dir); out.mkdir(parents=True, exist_ok=True)\n"
                     "count = pathlib.Path(os.environ['REPEATS_TEST_COUNTER'])\n"
                     "n = int(count.read_text()) if count.exists() else 0\n"
                     "count.write_text(str(n + 1))\n"
                     "if n % 2 == 1:\n"
                     "    raise RuntimeError('deliberate failure of the second repeat')\n"
                     "(out / 'rows.jsonl').write_text(json.dumps({'marker': 'new'}) + '\\n')\n")


def test_a_failed_repeat_fails_the_run_and_keeps_the_earlier_results(tmp_path, monkeypatch):
    monkeypatch.setenv("REPEATS_TEST_COUNTER", str(tmp_path / "counter"))
    nb = tmp_path / "nbs" / "00_study.ipynb"
    kw = dict(profile="smoke", platform="cpu", label=LABEL, results=tmp_path / "res")
    _notebook(nb, "import json, pathlib\nout = pathlib.Path(out_dir); out.mkdir(parents=True, exist_ok=True)\n"
                  "(out / 'rows.jsonl').write_text(json.dumps({'marker': 'first'}) + '\\n')\n")
    assert run_notebook(nb, **kw).status == "ok"
    final = tmp_path / "res" / LABEL / "smoke" / "study"
    _notebook(nb, FAILS_SECOND_TIME)
    res = run_notebook(nb, repeats=3, **kw)
    assert res.status == "failed" and "second repeat" in res.error and res.folder.name == "study.failed"
    assert json.loads((final / "rows.jsonl").read_text())["marker"] == "first"
    failed = json.loads((res.folder / "status.json").read_text())
    assert failed["previous_results_kept"] is True and failed["repeats"] == 3
    assert [r["status"] for r in failed["repeat_runs"]] == ["ok", "failed"]
    assert (res.folder / "executed.ipynb").exists()
    assert not [p for p in final.parent.iterdir() if p.name.startswith(".")], "temporary folders were left behind"


def test_repeats_whose_rows_disagree_fail_the_run(tmp_path):
    body = ("import pathlib, random\nfrom msrm_lab.bench.rows import make_row, write_rows\n"
            "out = pathlib.Path(out_dir); out.mkdir(parents=True, exist_ok=True)\n"
            "write_rows(out / 'rows.jsonl', [make_row('toy', 'draw', random.SystemRandom().choice('ab' * 8) + "
            "str(random.SystemRandom().random()), 1.0, 's')])\n")
    nb = _notebook(tmp_path / "nbs" / "00_toy.ipynb", body)
    res = run_notebook(nb, profile="smoke", platform="cpu", label=LABEL, results=tmp_path / "res", repeats=2)
    assert res.status == "failed" and "cannot be merged" in res.error and "metric" in res.error
    assert not (tmp_path / "res" / LABEL / "smoke" / "toy").exists()


@pytest.mark.parametrize("repeats", [0, -1, 1.5, True])
def test_repeats_below_one_are_refused(tmp_path, repeats):
    nb = _notebook(tmp_path / "nbs" / "00_a.ipynb", "x = 1")
    with pytest.raises(ValueError, match="repeats"):
        run_notebook(nb, profile="smoke", platform="cpu", label=LABEL, results=tmp_path, repeats=repeats)
    with pytest.raises(ValueError, match="repeats"):
        run_notebooks(profile="smoke", device="cpu", notebooks_dir=tmp_path / "nbs", results=tmp_path,
                      progress=False, repeats=repeats)


def test_the_command_line_refuses_repeats_below_one(tmp_path, capsys):
    _notebook(tmp_path / "nbs" / "00_a.ipynb", "x = 1")
    for n in ("0", "-2"):
        assert cli.main(["run", "--profile", "smoke", "--device", "cpu", "--notebooks", str(tmp_path / "nbs"),
                         "--results", str(tmp_path / "res"), "--no-progress", "--repeats", n]) == 2
        assert "repeats" in capsys.readouterr().err
    assert not (tmp_path / "res").exists()
