"""The prepared device run (``python -m msrm_lab.device``), checked on the CPU.

* the dry run (``--device cpu --profile smoke``) runs every part at tiny sizes and writes, per part, rows that
  carry ``execution_info`` (float64 JAX on the CPU), plus a ``status.json`` marking every part done (``slow``:
  ``make test-slow``; the other tests here run the driver on the cheap parts);
* ``--device cuda`` without a visible GPU exits non-zero with one line on stderr, no traceback, nothing written;
* a part that fails (injected through ``--fail``) is marked failed, its folder moves to ``<part>.failed/``, and
  the other parts still run and keep their rows; parts that cannot get their minimum time are marked not run;
* bad arguments are refused by name before anything runs; the wheel list is pinned and fetched for Python 3.12.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from msrm_lab.bench.rows import read_rows
from msrm_lab.device import PARTS, PROFILES, STATUS_FILE
from msrm_lab.device.wheels import REQUIREMENTS, download_command
from msrm_lab.notebooks.device import cpu_label, gpu_kinds

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str, env: dict | None = None, timeout: float = 600.0) -> subprocess.CompletedProcess:
    full = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "msrm_lab.device", *args], cwd=ROOT, env=full,
                          capture_output=True, text=True, timeout=timeout)


def _status(results: Path, profile: str = "smoke") -> dict:
    return json.loads((results / cpu_label() / profile / STATUS_FILE).read_text())


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    results = tmp_path_factory.mktemp("device-results")
    proc = _run("--device", "cpu", "--profile", "smoke", "--results", str(results), timeout=1500.0)
    return proc, results


@pytest.mark.slow  # it compiles every part's programs on the CPU, the associative scan and NUTS among them
@pytest.mark.timeout(1600)
def test_dry_run_writes_every_part(dry_run):
    proc, results = dry_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    status = _status(results)
    assert status["done"] == list(PARTS) and status["failed"] == [] and status["not_run"] == []
    assert status["platform"] == "cpu" and status["profile"] == "smoke" and status["finished"]
    base = results / cpu_label() / "smoke"
    for part in status["parts"]:
        rows = read_rows(base / part["name"] / "rows.jsonl")
        assert rows and len(rows) == part["rows"], part
        for row in rows:
            info = row["execution_info"]
            assert info["backend"] == "cpu" and info["x64"] is True and info["matmul_precision"] == "highest"
            assert row["status"] in ("measured", "not_yet_measured")
        assert not (base / f"{part['name']}.failed").exists()
    # what each part is for is in its rows
    experiments = {p: {r["experiment"] for r in read_rows(base / p / "rows.jsonl")} for p in PARTS}
    assert {"matmul", "cholesky", "matmul_float32"} <= experiments["linalg"]
    assert experiments["grouped"] == {"value_and_grad"} and experiments["feature_sweep"] == {"feature_sweep"}
    assert {"nuts", "objective_gradient"} <= experiments["nuts"]
    ss = read_rows(base / "state_space" / "rows.jsonl")
    assert {r["params"]["parallel"] for r in ss if r["metric"] == "median_s"} == {False, True}
    agreement = [r["value"] for r in ss if r["metric"] == "relative_difference"]
    assert agreement and max(agreement) <= 1e-8  # the two scans compute one density
    env = read_rows(base / "environment" / "rows.jsonl")
    assert all(r["value"] == 1.0 for r in env), [r["params"] for r in env if r["value"] != 1.0]
    # on a CPU the CUDA tests are collected and all skipped; their junit sits beside the rows
    counts = {r["metric"]: r["value"] for r in read_rows(base / "cuda_tests" / "rows.jsonl")}
    assert counts["tests"] > 0 and counts["skipped"] == counts["tests"] and counts["failures"] == 0
    assert (base / "cuda_tests" / "junit.xml").is_file()


@pytest.mark.skipif(bool(gpu_kinds()), reason="a CUDA GPU is visible here")
def test_cuda_without_a_gpu_is_one_clear_line(tmp_path):
    proc = _run("--device", "cuda", "--results", str(tmp_path), env={"JAX_PLATFORMS": ""}, timeout=300.0)
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "CUDA GPU" in lines[0]
    assert not any(tmp_path.iterdir())


def test_a_failed_part_leaves_the_others(tmp_path):
    proc = _run("--device", "cpu", "--profile", "smoke", "--results", str(tmp_path), "--parts",
                "environment,linalg", "--fail", "environment")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    status = _status(tmp_path)
    assert status["failed"] == ["environment"] and status["done"] == ["linalg"]
    failed = next(p for p in status["parts"] if p["name"] == "environment")
    assert "injected" in failed["error"] and failed["folder"] == "environment.failed"
    base = tmp_path / cpu_label() / "smoke"
    assert (base / "environment.failed" / "part.log").is_file() and not (base / "environment").exists()
    assert read_rows(base / "linalg" / "rows.jsonl")
    # a later run in which it works replaces the failed folder
    proc = _run("--device", "cpu", "--profile", "smoke", "--results", str(tmp_path), "--parts", "environment")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (base / "environment" / "rows.jsonl").is_file() and not (base / "environment.failed").exists()


def test_a_part_past_its_budget_is_stopped(tmp_path):
    proc = _run("--device", "cpu", "--profile", "smoke", "--results", str(tmp_path), "--parts", "linalg",
                "--budget-s", "12", env={"MSRM_DEVICE_FAIL": "linalg:hang"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    part = _status(tmp_path)["parts"][0]
    assert part["status"] == "failed" and "budget" in part["error"] and part["folder"] == "linalg.failed"
    assert 12.0 <= part["wall_s"] < 40.0


def test_parts_out_of_time_are_marked_not_run(tmp_path):
    proc = _run("--device", "cpu", "--profile", "smoke", "--results", str(tmp_path), "--parts",
                "linalg,nuts", "--budget-s", "5")
    assert proc.returncode == 1
    status = _status(tmp_path)
    assert status["not_run"] == ["linalg", "nuts"] and status["done"] == []
    assert all("out of time" in p["reason"] for p in status["parts"])
    assert not (tmp_path / cpu_label() / "smoke" / "linalg").exists()


@pytest.mark.parametrize("args,match", [
    (("--parts", "linalg,warp"), "warp"),
    (("--fail", "nope"), "nope"),
    (("--budget-s", "-1"), "budget_s"),
])
def test_bad_arguments_are_named(tmp_path, args, match):
    proc = _run("--device", "cpu", "--profile", "smoke", "--results", str(tmp_path), *args)
    assert proc.returncode == 2
    assert match in proc.stderr and "Traceback" not in proc.stderr
    assert len([ln for ln in proc.stderr.splitlines() if ln.strip()]) == 1


def test_profiles_budget_every_part_within_eight_minutes():
    for name, cfg in PROFILES.items():
        assert set(cfg["part_budget_s"]) == set(PARTS), name
        assert sum(cfg["part_budget_s"].values()) <= cfg["budget_s"], name
    assert PROFILES["device"]["budget_s"] <= 480.0


def test_wheels_are_pinned_and_fetched_for_the_gpu_image(tmp_path):
    lines = [ln.strip() for ln in (ROOT / REQUIREMENTS).read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert lines and all("==" in ln for ln in lines)
    assert any(ln.startswith("arviz==") for ln in lines)
    cmd = download_command(tmp_path, ROOT / REQUIREMENTS)
    assert "--no-deps" in cmd and "--only-binary=:all:" in cmd
    assert cmd[cmd.index("--python-version") + 1] == "3.12"
    assert any(p.endswith("x86_64") for p in cmd[cmd.index("--platform") + 1:][:1])
