"""The notebook runner: isolation, time limit, results never erased by a failed run, device labels."""
from __future__ import annotations

import json
import re
from pathlib import Path

import nbformat
import pytest

import msrm

from msrm_lab.notebooks import __main__ as cli
from msrm_lab.notebooks import cpu_label, cuda_label, device_label, discover, notebook_stem, resolve_device, run_notebook
from msrm_lab.notebooks.runner import run_notebooks
from notebook_helpers import toy_notebook

LABEL = "cpu-test-1c"


_notebook = toy_notebook


def _writes_rows(marker: str) -> str:
    return ("import json, pathlib\n"
            "out = pathlib.Path(out_dir); out.mkdir(parents=True, exist_ok=True)\n"
            f"(out / 'rows.jsonl').write_text(json.dumps({{'marker': {marker!r}, 'profile': profile, "
            "'device': device}) + '\\n')\n")


FAILS = "raise RuntimeError('deliberate failure for the isolation test')"


def test_one_failing_notebook_is_recorded_and_the_next_still_runs(tmp_path):
    nbs = tmp_path / "nbs"
    _notebook(nbs / "00_broken.ipynb", FAILS)
    _notebook(nbs / "01_fine.ipynb", _writes_rows("fine"))
    results = run_notebooks(profile="smoke", device="cpu", notebooks_dir=nbs, results=tmp_path / "res",
                            progress=False)
    assert [(r.stem, r.status) for r in results] == [("broken", "failed"), ("fine", "ok")]
    base = tmp_path / "res" / device_label("cpu") / "smoke"
    failed = json.loads((base / "broken.failed" / "status.json").read_text())
    assert failed["status"] == "failed" and "deliberate failure" in failed["error"]
    assert failed["execution_info"]["cpu_model"]
    assert (base / "broken.failed" / "executed.ipynb").exists()
    assert not (base / "broken").exists()
    ok = json.loads((base / "fine" / "status.json").read_text())
    assert ok["status"] == "ok" and ok["error"] is None and ok["wall_s"] > 0
    row = json.loads((base / "fine" / "rows.jsonl").read_text())
    assert row == {"marker": "fine", "profile": "smoke", "device": "cpu"}
    executed = nbformat.read(base / "fine" / "executed.ipynb", as_version=4)
    assert any("injected-parameters" in c.metadata.get("tags", []) for c in executed.cells)
    assert not [p for p in base.iterdir() if p.name.startswith(".")], "temporary folders were left behind"
    # the command line says whether everything passed
    assert cli.main(["run", "--profile", "smoke", "--device", "cpu", "--notebooks", str(nbs), "--results",
                     str(tmp_path / "res"), "--only", "fine", "--no-progress"]) == 0
    assert cli.main(["run", "--profile", "smoke", "--device", "cpu", "--notebooks", str(nbs), "--results",
                     str(tmp_path / "res"), "--only", "broken", "--no-progress"]) == 1


def test_a_failed_rerun_keeps_the_earlier_results(tmp_path):
    nb = tmp_path / "nbs" / "03_study.ipynb"
    kw = dict(profile="smoke", platform="cpu", label=LABEL, results=tmp_path / "res")
    _notebook(nb, _writes_rows("first"))
    assert run_notebook(nb, **kw).status == "ok"
    final = tmp_path / "res" / LABEL / "smoke" / "study"
    _notebook(nb, FAILS)
    res = run_notebook(nb, **kw)
    assert res.status == "failed" and res.folder.name == "study.failed"
    assert json.loads((final / "rows.jsonl").read_text())["marker"] == "first"
    assert json.loads((final / "status.json").read_text())["status"] == "ok"
    failed = json.loads((res.folder / "status.json").read_text())
    assert failed["previous_results_kept"] is True
    # a later success replaces the results and clears the failure record
    _notebook(nb, _writes_rows("second"))
    assert run_notebook(nb, **kw).status == "ok"
    assert json.loads((final / "rows.jsonl").read_text())["marker"] == "second"
    assert not res.folder.exists()


def test_time_limit_and_missing_rows_are_failures(tmp_path):
    kw = dict(profile="smoke", platform="cpu", label=LABEL, results=tmp_path / "res")
    slow = _notebook(tmp_path / "nbs" / "slow.ipynb", "import time\ntime.sleep(120)")
    res = run_notebook(slow, timeout=8, **kw)
    assert res.status == "failed" and "time limit" in res.error and res.wall_s < 60
    silent = _notebook(tmp_path / "nbs" / "silent.ipynb", "x = 1")
    res = run_notebook(silent, **kw)
    assert res.status == "failed" and "rows.jsonl" in res.error


def test_bad_arguments_are_refused(tmp_path):
    nb = _notebook(tmp_path / "nbs" / "00_a.ipynb", "x = 1")
    with pytest.raises(ValueError, match="profile"):
        run_notebook(nb, profile="huge", platform="cpu", label=LABEL, results=tmp_path)
    with pytest.raises(ValueError, match="timeout"):
        run_notebook(nb, profile="smoke", platform="cpu", label=LABEL, results=tmp_path, timeout=0)
    with pytest.raises(ValueError, match="nope"):
        discover(tmp_path / "nbs", only=["nope"])
    with pytest.raises(ValueError, match="does not exist"):
        discover(tmp_path / "missing")
    assert discover(tmp_path / "nbs", only=["a"]) == [nb]
    assert notebook_stem("notebooks/07_gradient_nuts.ipynb") == "gradient_nuts"
    with pytest.raises(ValueError, match="device"):
        resolve_device("tpu")


def test_cpu_vector_level_reads_the_widest_extension():
    from msrm.runtime import cpu_vector_level

    assert cpu_vector_level("fpu sse2 avx avx2 fma avx512f avx512dq") == "avx512"
    assert cpu_vector_level("fpu sse2 avx avx2 fma") == "avx2"
    assert cpu_vector_level("fp asimd evtstrm sve") == "sve"
    assert cpu_vector_level("fp asimd evtstrm") == "neon"
    assert cpu_vector_level("fpu") is None
    info = msrm.runtime.execution_info()
    assert info["cpu_vector_level"] == cpu_vector_level()


def test_device_labels():
    assert cpu_label("AMD EPYC 7763 64-Core Processor", 2, vector=None) == "cpu-amd-epyc-7763-2c"
    assert cpu_label("AMD EPYC", 2, vector="avx2") == "cpu-amd-epyc-avx2-2c"
    assert cpu_label("AMD EPYC", 2, vector="avx512") == "cpu-amd-epyc-avx512-2c"
    assert (cpu_label("Intel(R) Xeon(R) Platinum 8480+ CPU @ 2.00GHz", 56, vector="avx512")
            == "cpu-intel-xeon-platinum-8480-avx512-56c")
    level = msrm.runtime.cpu_vector_level()
    assert cpu_label("AMD EPYC", 2) == (f"cpu-amd-epyc-{level}-2c" if level else "cpu-amd-epyc-2c")
    with pytest.raises(ValueError, match="vector"):
        cpu_label("AMD EPYC", 2, vector="AVX 2")
    assert cuda_label("NVIDIA H200") == "cuda-h200"
    assert cuda_label("NVIDIA GeForce RTX 3090") == "cuda-rtx-3090"
    assert cuda_label("NVIDIA RTX PRO 6000 Blackwell Server Edition") == "cuda-rtx-pro-6000-blackwell-server-edition"
    assert re.fullmatch(r"cpu-[a-z0-9]+(-[a-z0-9]+)*-\d+c", device_label("cpu"))
    with pytest.raises(ValueError, match="cores"):
        cpu_label("AMD EPYC", 0)
    with pytest.raises(ValueError, match="device_kind"):
        cuda_label(" ")
