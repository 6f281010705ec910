"""msrm_lab.freshness on a git repository made here: rows at old and new commits, a dirty one, unknown ones."""
from __future__ import annotations

import os
import subprocess
import warnings
from pathlib import Path

import pandas as pd
import pytest

import msrm
from msrm_lab import freshness as fr
from msrm_lab.paths import repo_root

PATHS = {"nb": ("msrm/gp/", "msrm_lab/bench/nb.py")}


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.org", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@example.org"}
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          env=env).stdout.strip()


def _commit(repo: Path, path: str, text: str, message: str) -> str:
    f = repo / path
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(text)
    _git(repo, "add", path)
    _git(repo, "commit", "-q", "-m", message)
    return _git(repo, "rev-parse", "HEAD")


@pytest.fixture
def repo(tmp_path):
    """c1 code, c2 other, c3 code, c4 other (in this order)."""
    r = tmp_path / "repo"
    r.mkdir()
    _git(r, "init", "-q")
    c = {
        "c1": _commit(r, "msrm/gp/model.py", "a = 1\n", "first code"),
        "c2": _commit(r, "README.md", "readme\n", "docs"),
        "c3": _commit(r, "msrm_lab/bench/nb.py", "b = 2\n", "bench change"),
        "c4": _commit(r, "book/x.md", "text\n", "book"),
    }
    return r, c


def _row(commit, notebook="nb"):
    return {"notebook": notebook, "metric": "m", "value": 1.0, "execution_info": {"git_commit": commit}}


def test_rows_at_or_after_the_code_change_are_fresh(repo):
    r, c = repo
    res = fr.stale_notebooks([_row(c["c3"]), _row(c["c4"]), _row(c["c4"] + "-dirty")], r, paths=PATHS)["nb"]
    assert res["code_commit"] == c["c3"]
    assert res["code_subject"] == "bench change"
    assert res["stale"] is False
    assert res["commits"][c["c4"]]["rows"] == 1 and res["commits"][c["c4"] + "-dirty"]["dirty"]


def test_rows_before_the_code_change_are_stale(repo):
    r, c = repo
    res = fr.stale_notebooks([_row(c["c1"]), _row(c["c2"]), _row(c["c2"]), _row(c["c4"])], r, paths=PATHS)["nb"]
    assert res["stale"] is True
    old = res["commits"][c["c2"]]
    assert old == dict(rows=2, known=True, fresh=False, behind=1, changes_since=1, dirty=False)
    assert res["commits"][c["c1"]]["behind"] == 2 and res["commits"][c["c1"]]["changes_since"] == 1
    assert res["commits"][c["c4"]]["fresh"]


def test_unknown_or_missing_commits_are_stale(repo):
    r, c = repo
    rows = [_row(c["c4"]), _row("0123456789abcdef0123456789abcdef01234567"), _row(None)]
    res = fr.stale_notebooks(rows, r, paths=PATHS)["nb"]
    assert res["stale"] is True
    assert not res["commits"]["0123456789abcdef0123456789abcdef01234567"]["known"]
    assert not res["commits"][""]["known"]
    assert "unknown commits" in res["reason"]


def test_a_dataframe_of_rows_works_like_rows(repo):
    r, c = repo
    df = pd.DataFrame({"notebook": ["nb", "nb", "other"], "info_git_commit": [c["c2"], c["c4"], c["c4"]]})
    res = fr.stale_notebooks(df, r, paths=PATHS)
    assert res["nb"]["stale"] is True
    assert res["other"]["stale"] is None and "no measured paths" in res["other"]["reason"]


def test_paths_no_commit_touches_are_fresh(repo):
    r, c = repo
    res = fr.stale_notebooks([_row(c["c1"])], r, paths={"nb": ("nothing/here.py",)})["nb"]
    assert res["code_commit"] is None and res["stale"] is False


def test_notice_names_commits_and_warns(repo, monkeypatch):
    r, c = repo
    monkeypatch.setitem(fr.MEASURED_PATHS, "nb", PATHS["nb"])
    rows = [_row(c["c2"]), _row(c["c3"]), _row("f" * 40)]
    with pytest.warns(fr.StaleResultsWarning, match="notebook `nb`"):
        text = fr.freshness_notice("nb", rows, r)
    assert text.startswith("```{warning}\n") and text.endswith("\n```\n")
    assert c["c3"][:10] in text and c["c2"][:10] in text and "f" * 10 in text
    assert "1 commits later" in text and "Some results" in text
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fr.freshness_notice("nb", [_row(c["c3"])], r) == ""
        assert fr.freshness_notice("nb", [_row(c["c3"], notebook="elsewhere")], r) == ""


def test_bad_input_is_named(repo, tmp_path):
    r, _ = repo
    with pytest.raises(ValueError, match="repo"):
        fr.stale_notebooks([], tmp_path / "nowhere")
    with pytest.raises(ValueError, match="df_or_rows"):
        fr.stale_notebooks([1, 2], r)
    with pytest.raises(ValueError, match="notebook"):
        fr.freshness_notice("", [], r)


def test_every_notebook_has_measured_paths_that_exist():
    root = repo_root()
    stems = {p.stem.split("_", 1)[1] for p in (root / "notebooks").glob("[0-9][0-9]_*.ipynb")}
    assert stems <= set(fr.MEASURED_PATHS), sorted(stems - set(fr.MEASURED_PATHS))
    for nb, paths in fr.MEASURED_PATHS.items():
        assert paths, nb
        for p in paths:
            assert (root / p).exists(), f"{nb}: {p} does not exist"


def test_show_notices_displays_only_stale_notebooks(repo, monkeypatch):
    r, c = repo
    monkeypatch.setitem(fr.MEASURED_PATHS, "nb", PATHS["nb"])
    monkeypatch.setitem(fr.MEASURED_PATHS, "fresh", PATHS["nb"])
    shown = []
    import IPython.display

    monkeypatch.setattr(IPython.display, "display", lambda obj: shown.append(obj))
    rows = [_row(c["c2"]), _row(c["c3"], notebook="fresh")]
    with pytest.warns(fr.StaleResultsWarning):
        notices = fr.show_notices(["fresh", "nb"], rows, r)
    # the fresh notebook displays nothing at all: an empty Markdown output renders as its repr in the book
    assert len(notices) == 1 and notices[0].startswith("```{warning}")
    assert len(shown) == 1 and shown[0].data == notices[0]
    assert fr.show_notices(["fresh"], rows, r) == [] and len(shown) == 1


def test_provenance_adds_the_checkout_commit_to_the_library_info():
    from msrm_lab import provenance

    info = provenance.execution_info(include_jax=False)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=provenance._ROOT, capture_output=True, text=True)
    if head.returncode != 0:
        assert info["git_commit"] is None
    else:
        assert info["git_commit"].split("-")[0] == head.stdout.strip()
    assert {k: v for k, v in info.items() if k not in ("git_commit", "timestamp", "load_average_1m")} == {
        k: v for k, v in msrm.runtime.execution_info(include_jax=False).items()
        if k not in ("timestamp", "load_average_1m")}
