"""The project's set-up files: environment.yml delegates to pyproject, the README has exactly two set-up commands,
the Makefile has its targets, and .ci/run runs the README's test command and fails when no test ran."""
from __future__ import annotations

import os
import re
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent


def _extras() -> set[str]:
    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])


def test_environment_yml_delegates_to_pyproject():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    deps = env["dependencies"]
    conda = [d for d in deps if isinstance(d, str)]
    assert conda == ["python=3.12", "pip"], f"environment.yml may list only python=3.12 and pip, got {conda}"
    pip_lists = [d["pip"] for d in deps if isinstance(d, dict)]
    assert len(pip_lists) == 1 and len(pip_lists[0]) == 1, f"expected one pip entry, got {pip_lists}"
    m = re.fullmatch(r"-e \.\[([a-z0-9_,-]+)\]", pip_lists[0][0])
    assert m, f"the pip entry must be '-e .[extras]', got {pip_lists[0][0]!r}"
    named = set(m.group(1).split(","))
    assert named <= _extras(), f"environment.yml names extras missing from pyproject: {named - _extras()}"
    assert {"bayes", "dask", "book", "test"} <= named


def test_extras_the_makefile_installs_exist():
    text = (ROOT / "Makefile").read_text()
    extras = set(re.search(r"^EXTRAS\s*\?=\s*(\S+)", text, re.M).group(1).split(","))
    assert extras <= _extras()
    assert "cuda" not in extras, "the CUDA extra is documented, never installed by default"


def _setup_commands(readme: str) -> list[str]:
    section = re.search(r"^## Set-up\n(.*?)(?=^## )", readme, re.M | re.S)
    assert section, "README needs a '## Set-up' section"
    blocks = re.findall(r"```(?:bash|sh)?\n(.*?)```", section.group(1), re.S)
    lines = [ln.split("#")[0].strip() for b in blocks for ln in b.splitlines()]
    return [ln for ln in lines if ln]


def test_readme_has_exactly_two_setup_commands_and_a_picture():
    readme = (ROOT / "README.md").read_text()
    assert _setup_commands(readme) == ["make book", "make test"]
    pictures = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", readme)
    assert pictures, "README must show a picture of the book"
    for pic in pictures:
        data = (ROOT / pic).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{pic} is not a PNG"
    for word in ("'.[cuda]'", "JAX_PLATFORMS", "XLA_PYTHON_CLIENT_PREALLOCATE", "CUDA_VISIBLE_DEVICES",
                 "OMP_NUM_THREADS"):
        assert word in readme, f"README's GPU recipe must mention {word}"
    for extra in _extras() - {"all"}:
        assert f"`{extra}`" in readme, f"README must say what the {extra!r} extra brings"


def _dry_run(target: str) -> str:
    env = dict(os.environ, MAKEFLAGS="")
    out = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_makefile_targets():
    book = _dry_run("book")
    assert "msrm_lab.notebooks run --profile quick" in book and "jupyter-book build" in book
    rules = (ROOT / "Makefile").read_text()
    for target in ("book", "test", "test-slow", "notes", "install", "chromium"):
        assert re.search(rf"^{re.escape(target)}:", rules, re.M), f"Makefile lacks target {target}"
    assert "-m msrm_lab.notebooks run --profile quick" in rules
    assert "jupyter-book build --all -W -n --keep-going ." in rules
    assert "-m msrm_lab.notebooks run --profile note" in rules
    assert "-m msrm_lab.notebooks check-book" in rules
    assert "venv" in rules and "pyproject.toml" in rules, "install must be keyed on pyproject.toml"
    test = _dry_run("test")
    assert re.search(r"-m pytest -q -m \"?not slow\"?", test), test
    assert "pytest -q -m slow" in _dry_run("test-slow")


def test_ci_runs_the_readme_test_command_and_fails_without_tests(tmp_path):
    ci = ROOT / ".ci" / "run"
    text = ci.read_text()
    assert text.startswith("#!/usr/bin/env bash") and "set -euo pipefail" in text
    assert os.access(ci, os.X_OK)
    assert re.search(r"^make test\b", text, re.M)
    # the no-test guard: replay it on pytest's closing lines
    guard = re.search(r"grep -Eq '([^']+)'", text).group(1)
    for line, ran in (("12 passed, 3 deselected in 4.5s", True), ("no tests ran in 0.01s", False),
                      ("1 failed, 0 passed", False), ("3 passed", True)):
        assert bool(re.search(guard.replace("[^0-9]", r"[^0-9]"), line)) is ran, line


def test_gitignore_keeps_local_quick_results_out():
    ignored = subprocess.run(["git", "check-ignore", "-q", "results/some-device/quick/x/rows.jsonl"], cwd=ROOT)
    assert ignored.returncode == 0
