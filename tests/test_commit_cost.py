"""msrm_lab.bench.commit_cost: a base commit checked out and removed, and a comparison turned into rows."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from msrm_lab.bench import commit_cost


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path):
    root = tmp_path / "repo"
    root.mkdir()
    _git(root, "init", "-q")
    _git(root, "config", "user.email", "t@example.org")
    _git(root, "config", "user.name", "t")
    (root / "f.txt").write_text("first\n")
    _git(root, "add", "f.txt")
    _git(root, "commit", "-qm", "first")
    first = _git(root, "rev-parse", "HEAD")
    (root / "f.txt").write_text("second\n")
    _git(root, "commit", "-qam", "second")
    return root, first


def test_checkout_gives_the_commit_and_removes_it(repo):
    root, first = repo
    with commit_cost.checkout(first, root) as tree:
        assert (tree / "f.txt").read_text() == "first\n"
        assert _git(tree, "rev-parse", "HEAD") == first
    assert not tree.exists()
    assert (root / "f.txt").read_text() == "second\n"
    assert str(tree) not in _git(root, "worktree", "list")


def test_checkout_of_a_missing_commit_names_it(repo):
    root, _ = repo
    with pytest.raises(RuntimeError, match="cannot check out 0123abc"):
        with commit_cost.checkout("0123abc", root):
            pass


def test_cost_rows_from_a_comparison(repo, monkeypatch):
    root, first = repo
    report = {
        "x8-K5/state_space": {"value_rel_diff": 1e-16, "grad_rel_diff": 3e-12, "median_s": {"base": 1.0, "head": 1.2},
                              "per_round_s": {"base": [1.0, 1.1], "head": [1.2, 1.3]}, "head_over_base": 1.2,
                              "head_over_base_fastest": 1.2, "loadavg": [0.5, 1.5]},
        "one-eighth-K3/grouped": {"refused": {"base": "too big", "head": "too big"}},
    }
    seen = {}

    def fake_compare(base, head, rounds, repeats, pairs, work):
        seen["base_file"] = (base / "f.txt").read_text()
        return report

    monkeypatch.setattr(commit_cost, "compare", fake_compare)
    rows = commit_cost.cost_rows(first, [("x8-K5", "state_space"), ("one-eighth-K3", "grouped")], rounds=2,
                                 repeats=3, notebook="state_space", info={}, head=root)
    assert seen["base_file"] == "first\n"
    by = {r["params"]["case"]: r for r in rows}
    ok = by["x8-K5"]
    assert ok["status"] == "measured" and ok["value"] == pytest.approx(1.2)
    assert ok["params"]["base_median_s"] == 1.0 and ok["params"]["head_median_s"] == 1.2
    assert (ok["params"]["load_min"], ok["params"]["load_max"]) == (0.5, 1.5)
    assert by["one-eighth-K3"]["status"] == "refused" and "too big" in by["one-eighth-K3"]["params"]["reason"]


def test_cost_rows_say_why_when_the_base_is_missing(repo):
    root, _ = repo
    rows = commit_cost.cost_rows("0123abc", [("x8-K5", "state_space")], rounds=1, repeats=1,
                                 notebook="state_space", info={}, head=root)
    assert [r["status"] for r in rows] == ["error"]
    assert "cannot check out 0123abc" in rows[0]["params"]["reason"]
