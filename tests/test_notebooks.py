"""Every notebook in notebooks/ runs through the runner with the smoke profile (tiny sizes) and writes rows.

Parametrised by file, so each engineer's notebook is picked up as soon as it is committed. Also checks that the
committed notebooks are stripped of outputs and start from a tagged parameters cell.
"""
from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest

from msrm_lab.notebooks import notebook_stem, run_notebook

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    stems = {notebook_stem(p) for p in NOTEBOOKS}
    assert {"inventory", "synthetic_study"} <= stems


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_stripped_and_parameterised(path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), f"{path.name}: outputs not stripped"
    # nbformat 4.5 requires an id on every cell (a cell without one is a validation warning today, an error later);
    # read from the file itself, since nbformat.read fills in missing ids
    cells = json.loads(path.read_text())["cells"]
    missing = [i for i, c in enumerate(cells) if not c.get("id")]
    assert not missing, f"{path.name}: cells {missing} have no id"
    params = [c for c in code if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1, f"{path.name}: needs exactly one cell tagged 'parameters'"
    for name in ("profile", "device", "out_dir"):
        assert f"{name} =" in params[0].source, f"{path.name}: parameters cell lacks {name}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_with_the_smoke_profile(path, tmp_path):
    res = run_notebook(path, profile="smoke", platform="cpu", label="cpu-smoke-test", results=tmp_path)
    assert res.status == "ok", f"{path.name} failed: {res.error}"
    status = json.loads((res.folder / "status.json").read_text())
    assert status["status"] == "ok"
    rows = [json.loads(line) for line in (res.folder / "rows.jsonl").read_text().splitlines() if line.strip()]
    assert rows, f"{path.name} wrote an empty rows.jsonl"
    for row in rows:
        assert row["notebook"] == notebook_stem(path), row
        assert {"experiment", "metric", "value", "unit", "status", "params", "execution_info"} <= set(row)
        if row["status"] == "measured":
            assert isinstance(row["value"], (int, float))


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_finishes_with_its_time_budget_spent(path, tmp_path):
    # on a loaded machine a notebook may reach its soft deadline before any experiment: every experiment it skips
    # is a row, and the tables and figures still build from whatever was measured
    res = run_notebook(path, profile="smoke", platform="cpu", label="cpu-budget-test", results=tmp_path, budget=0.001)
    assert res.status == "ok", f"{path.name} failed with its budget spent: {res.error}"
    status = json.loads((res.folder / "status.json").read_text())
    rows = [json.loads(line) for line in (res.folder / "rows.jsonl").read_text().splitlines() if line.strip()]
    skipped = [r for r in rows if r["params"].get("skipped_for") == "time_budget"]
    assert len(status["skipped_for_budget"]) == len(skipped)
    assert all(r["status"] == "not_yet_measured" and r["value"] is None and r["params"]["reason"] for r in skipped)
