"""The notebooks' soft time budget: skipped work is recorded in rows, the runner passes the deadline, nothing is cut."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from msrm_lab import budget
from msrm_lab.notebooks.runner import run_notebook
from notebook_helpers import toy_notebook

INFO = {"backend": "test"}


def test_no_budget_never_skips(monkeypatch):
    monkeypatch.delenv(budget.DEADLINE_ENV, raising=False)
    assert budget.deadline() is None and budget.seconds_left() is None
    assert budget.skip_reason(1e9) is None
    calls = []
    rows_fn = budget.skippable("nb", "exp")(lambda size, info=None: calls.append(size) or [{"size": size}])
    assert rows_fn("quick", info=INFO) == [{"size": "quick"}] and calls == ["quick"]


def test_time_left_allows_work_that_fits(monkeypatch):
    monkeypatch.setenv(budget.DEADLINE_ENV, repr(time.time() + 100.0))
    assert 90 < budget.seconds_left() <= 100
    assert budget.skip_reason() is None and budget.skip_reason(50.0) is None
    reason = budget.skip_reason(500.0)
    assert reason.startswith("skipped: predicted 500 s") and "left" in reason


def test_a_spent_budget_records_the_skipped_work(monkeypatch):
    monkeypatch.setenv(budget.DEADLINE_ENV, repr(time.time() - 5.0))
    assert "spent" in budget.skip_reason()

    def never(*a, **k):
        raise AssertionError("a skipped experiment must not run")

    rows = budget.skippable("nb", "ladder", metrics=(("median_s", "s"), ("peak_bytes", "bytes")))(never)(
        "quick", info=INFO, backend="grouped")
    assert [(r["experiment"], r["metric"], r["status"], r["value"]) for r in rows] == [
        ("ladder", "median_s", "not_yet_measured", None), ("ladder", "peak_bytes", "not_yet_measured", None)]
    assert all(r["params"]["skipped_for"] == "time_budget" and r["params"]["profile"] == "quick"
               and "spent" in r["params"]["reason"] for r in rows)
    rows = budget.skipped_rows("nb", "ladder", "why", info=INFO, scale=8)
    assert rows[0]["params"] == {"reason": "why", "skipped_for": "time_budget", "scale": 8}


def test_the_accuracy_sweep_checks_cases_until_the_budget_is_spent_and_names_the_rest(monkeypatch):
    from msrm_lab.bench import accuracy

    cases = accuracy.sweep_cases(accuracy.SIZES["quick"]["axes"], accuracy.SIZES["quick"]["kernels"])
    answers = iter([None, None] + ["skipped: spent"] * len(cases))
    monkeypatch.setattr(accuracy, "skip_reason", lambda predicted=0.0: next(answers))
    monkeypatch.setattr(accuracy, "reference", lambda case, **kw: {"loglik": -1.0})
    monkeypatch.setattr(accuracy, "check_case", lambda ref, backend, **kw: {
        "backend": backend, "outcome": "within", "message": "", "density_error_nats": 0.0, "gradient_error": None,
        "latent_mean_error": None, "latent_sd_error": None})
    rows, details = accuracy.accuracy_rows("quick", info=INFO)
    n_backends = len(accuracy.SIZES["quick"]["backends"])
    assert len(details) == 2 * n_backends
    assert [(d["axis"], d["ratio"]) for d in details[::n_backends]] == [(c["axis"], c["ratio"]) for c in cases[:2]]
    skipped = [r for r in rows if r["status"] == "not_yet_measured"]
    assert [(r["params"]["axis"], r["params"]["ratio"]) for r in skipped] == [
        (c["axis"], c["ratio"]) for c in cases[2:]]
    assert all(r["params"]["skipped_for"] == "time_budget" and r["params"]["reason"] == "skipped: spent"
               for r in skipped)
    summary = {(r["metric"], r["params"].get("backend")): r["value"] for r in rows
               if r["experiment"] == "accuracy_summary"}
    assert summary[("cases_skipped_for_budget", None)] == len(cases) - 2
    assert all(summary[("within_cases", b)] == 2 and summary[("silent_cases", b)] == 0
               for b in accuracy.SIZES["quick"]["backends"])


def test_the_accuracy_sweep_without_a_budget_checks_every_case_and_reports_no_skip(monkeypatch):
    from msrm_lab.bench import accuracy

    monkeypatch.delenv(budget.DEADLINE_ENV, raising=False)
    monkeypatch.setattr(accuracy, "reference", lambda case, **kw: {"loglik": -1.0})
    monkeypatch.setattr(accuracy, "check_case", lambda ref, backend, **kw: {
        "backend": backend, "outcome": "within", "message": "", "density_error_nats": 0.0, "gradient_error": None,
        "latent_mean_error": None, "latent_sd_error": None})
    rows, details = accuracy.accuracy_rows("smoke", info=INFO)
    smoke = accuracy.SIZES["smoke"]
    assert len(details) == len(accuracy.sweep_cases(smoke["axes"], smoke["kernels"])) * len(smoke["backends"])
    assert not [r for r in rows if r["status"] != "measured" or r["metric"] == "cases_skipped_for_budget"]


@pytest.mark.parametrize("raw", ["soon", "nan", "inf"])
def test_a_bad_deadline_names_the_variable(monkeypatch, raw):
    monkeypatch.setenv(budget.DEADLINE_ENV, raw)
    with pytest.raises(ValueError, match=budget.DEADLINE_ENV):
        budget.skip_reason()


SEES_DEADLINE = ("import json, os, pathlib, time\n"
                 "from msrm_lab import budget\n"
                 "out = pathlib.Path(out_dir); out.mkdir(parents=True, exist_ok=True)\n"
                 "left = budget.seconds_left()\n"
                 "ran = [{'experiment': 'ran', 'params': {}}]\n"
                 "late = budget.skippable('nb', 'late')(lambda size, info=None: ran)\n"
                 "rows = late('quick', info={}) if budget.skip_reason(30.0) is None else budget.skipped_rows(\n"
                 "    'nb', 'late', budget.skip_reason(30.0), info={})\n"
                 "rows.append({'experiment': 'left', 'value': left, 'params': {}})\n"
                 "(out / 'rows.jsonl').write_text(''.join(json.dumps(r) + '\\n' for r in rows))\n")


def test_the_runner_gives_the_notebook_its_deadline_and_lists_what_it_skipped(tmp_path):
    toy_notebook(tmp_path / "nbs" / "00_late.ipynb", SEES_DEADLINE)
    res = run_notebook(tmp_path / "nbs" / "00_late.ipynb", profile="smoke", platform="cpu", label="cpu-test-1c",
                       results=tmp_path / "res", budget=10.0, timeout=300.0)
    assert res.status == "ok", res.error
    rows = [json.loads(line) for line in (res.folder / "rows.jsonl").read_text().splitlines()]
    left = next(r["value"] for r in rows if r["experiment"] == "left")
    assert 0 < left <= 10.0
    assert rows[0]["experiment"] == "late" and rows[0]["params"]["skipped_for"] == "time_budget"
    status = json.loads((res.folder / "status.json").read_text())
    assert status["budget_s"] == 10.0 and status["timeout_s"] == 300.0
    assert status["skipped_for_budget"] == ["late/median_s"]

    res = run_notebook(tmp_path / "nbs" / "00_late.ipynb", profile="smoke", platform="cpu", label="cpu-test-1c",
                       results=tmp_path / "res", budget=None, timeout=300.0)
    rows = [json.loads(line) for line in (res.folder / "rows.jsonl").read_text().splitlines()]
    assert [r["experiment"] for r in rows] == ["ran", "left"] and rows[1]["value"] is None
    assert json.loads((res.folder / "status.json").read_text())["skipped_for_budget"] == []


def test_a_budget_beyond_the_time_limit_is_refused(tmp_path):
    toy_notebook(tmp_path / "00_x.ipynb", "pass")
    with pytest.raises(ValueError, match="budget must be positive seconds below the time limit"):
        run_notebook(tmp_path / "00_x.ipynb", profile="smoke", platform="cpu", label="cpu-test-1c",
                     results=tmp_path / "res", budget=400.0, timeout=300.0)


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting for its reaper counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_a_competing_busy_process_ends_with_a_killed_notebook():
    # the threads benchmark's competitors run in their own sessions, so killing the notebook's process group does
    # not reach them: they must notice that the process that started them is gone
    code = ("import os\nfrom msrm_lab.bench import threads\np = threads._start_busy(0.0)\n"
            "print(p.pid, flush=True)\nos._exit(0)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    pid = int(out.stdout.split()[-1])
    end = time.time() + 30.0
    while _running(pid) and time.time() < end:
        time.sleep(0.2)
    alive = _running(pid)
    if alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive, "the busy process outlived the process that started it"
