"""msrm_lab.book (results loading and device tables) and the built book checked in headless Chromium."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import msrm_lab.book as mb
from msrm_lab.bench.rows import make_row, write_rows
from msrm_lab.notebooks import run_notebook

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
needs_chromium = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"no Chromium at {CHROMIUM}")
INFO = {"backend": "cpu", "cpu_model": "Test CPU", "physical_cores": 2, "timestamp": "2026-01-01T00:00:00+00:00"}


def _rows(root: Path, device: str, profile: str, notebook: str, rows: list[dict]) -> Path:
    folder = root / device / profile / notebook
    write_rows(folder / "rows.jsonl", rows, append=False)
    return folder


@pytest.fixture
def results(tmp_path) -> Path:
    root = tmp_path / "results"
    _rows(root, "cpu-a-2c", "quick", "linalg", [
        make_row("linalg", "matmul", "median_s", 2.0, "s", info=INFO, n=512),
        make_row("linalg", "matmul", "median_s", 9.0, "s", info=INFO, n=1024),
    ])
    _rows(root, "cpu-a-2c", "note", "linalg", [make_row("linalg", "matmul", "median_s", 1.5, "s", info=INFO, n=512)])
    _rows(root, "cuda-h200", "quick", "linalg", [
        make_row("linalg", "matmul", "median_s", 0.1, "s", info=INFO, n=512),
        make_row("linalg", "matmul", "median_s", None, "s", status="not_yet_measured", info=INFO, n=1024),
    ])
    failed = _rows(root, "cuda-h200", "quick", "linalg.failed", [make_row("linalg", "matmul", "median_s", 99.0, "s",
                                                                          info=INFO, n=512)])
    (failed.parent / ".linalg.tmp-x").mkdir()
    with open(root / "cpu-a-2c" / "quick" / "linalg" / "rows.jsonl", "a") as fh:
        fh.write('{"torn": \n')
    return root


def test_load_results_flattens_rows_and_skips_failed_and_torn(results):
    df = mb.load_results(results)
    assert len(df) == 5
    assert {"device", "profile", "notebook", "experiment", "metric", "value", "unit", "status", "n",
            "info_cpu_model"} <= set(df.columns)
    assert 99.0 not in set(df["value"].dropna())
    assert mb.devices_in(df) == ["cpu-a-2c", "cuda-h200"]
    assert mb.load_results(results.parent / "nothing-here").empty


def test_device_table_side_by_side_prefers_note_and_names_unmeasured_devices(results):
    df = mb.load_results(results)
    t = mb.device_table(df, "linalg", metric="median_s", index=["experiment", "n"], devices=["cpu-b-4c"])
    # cpu-b-4c has no row: no column, named once as unmeasured; the GPU has rows, so no GPU stand-in
    assert list(t.columns) == ["cpu-a-2c", "cuda-h200"]
    assert t.attrs["unmeasured"] == ["cpu-b-4c"]
    assert t.loc[("matmul", 512), "cpu-a-2c"] == 1.5          # note profile wins over quick
    assert t.loc[("matmul", 512), "cuda-h200"] == 0.1
    # n=1024: only quick measured it on cpu-a (note preferred) and cuda said not_yet_measured: nothing measured
    assert ("matmul", 1024) not in t.index
    both = mb.device_table(df, "linalg", index=["n"], all_profiles=True)
    assert both.loc[512, "cpu-a-2c (quick)"] == 2.0 and both.loc[512, "cpu-a-2c (note)"] == 1.5
    assert both.loc[1024, "cpu-a-2c (quick)"] == 9.0
    assert both.loc[1024, "cpu-a-2c (note)"] == mb.MISSING and both.loc[1024, "cuda-h200 (quick)"] == mb.NOT_MEASURED
    empty = mb.device_table(df, "state_space")
    assert empty.empty and empty.attrs["unmeasured"] == ["cpu-a-2c", "cuda-h200"]
    with pytest.raises(KeyError, match="width"):
        mb.device_table(df, "linalg", index=["width"])
    assert mb.pick(df, "linalg", "matmul", "median_s", n=512)[1:] == ("cpu-a-2c", "note")
    assert mb.pick(df, "linalg", "matmul", "median_s", n=4096) == (None, None, None)


def test_pick_quotes_the_most_recent_device_of_the_preferred_profile(tmp_path):
    older, newer = dict(INFO, timestamp="2026-01-01T00:00:00+00:00"), dict(INFO, timestamp="2026-02-01T00:00:00+00:00")
    _rows(tmp_path, "cpu-a-2c", "note", "linalg", [make_row("linalg", "matmul", "median_s", 1.5, "s", info=older, n=1)])
    _rows(tmp_path, "cpu-b-2c", "note", "linalg", [make_row("linalg", "matmul", "median_s", 2.5, "s", info=newer, n=1)])
    _rows(tmp_path, "cpu-c-2c", "quick", "linalg", [make_row("linalg", "matmul", "median_s", 9.0, "s",
                                                             info=dict(INFO, timestamp="2026-03-01T00:00:00+00:00"),
                                                             n=1)])
    df = mb.load_results(tmp_path)
    assert mb.pick(df, "linalg", "matmul", "median_s") == (2.5, "cpu-b-2c", "note")  # newest note sitting
    assert mb.pick(df[df.device != "cpu-b-2c"], "linalg", "matmul", "median_s") == (1.5, "cpu-a-2c", "note")


def test_device_table_names_the_gpu_and_silent_devices_in_one_line_and_scales_bytes(tmp_path):
    _rows(tmp_path, "cpu-a-avx2-2c", "note", "linalg", [
        make_row("linalg", "matmul", "median_s", 1.5, "s", info=INFO, n=512),
        make_row("linalg", "matmul", "peak", 1_312_779_600, "bytes", info=INFO, n=512),
        make_row("linalg", "matmul", "peak", 2048, "bytes", info=INFO, n=4)])
    _rows(tmp_path, "cpu-a-avx512-2c", "note", "state_space", [make_row("state_space", "speed", "median_s", 0.2,
                                                                        "s", info=INFO)])
    df = mb.load_results(tmp_path)
    t = mb.device_table(df, "linalg", index=["metric", "n"])
    assert list(t.columns) == ["cpu-a-avx2-2c"]
    assert t.attrs["unmeasured"] == ["cpu-a-avx512-2c", mb.GPU_COLUMN]
    assert t.loc[("peak", 512), "cpu-a-avx2-2c"] == "1.31 GB" and t.loc[("peak", 4), "cpu-a-avx2-2c"] == "2.05 kB"
    assert mb.device_table(df, "linalg", index=["n"], gpu_column=False).attrs["unmeasured"] == ["cpu-a-avx512-2c"]
    assert mb.bytes_text(999) == "999 B" and mb.bytes_text(6.7e12) == "6.7 TB"
    shown = []
    import IPython.display as ipd
    real = ipd.display
    ipd.display = shown.append
    try:
        mb.show_table(t, caption="peaks")
        mb.show_table(mb.device_table(df, "gp_grouped"), caption="nothing")
    finally:
        ipd.display = real
    assert "Not measured on: cpu-a-avx512-2c, a GPU." in shown[0].data and "<caption>peaks</caption>" in shown[0].data
    assert "<table" not in shown[1].data and "No rows measured yet (nothing)" in shown[1].data



def test_show_measured_at_names_device_profile_and_commits_from_the_rows(tmp_path):
    at = dict(INFO, git_commit="abc1234def5678")
    _rows(tmp_path, "cpu-a-2c", "quick", "linalg", [make_row("linalg", "matmul", "median_s", 2.0, "s", info=INFO)])
    _rows(tmp_path, "cpu-a-2c", "note", "linalg", [
        make_row("linalg", "matmul", "median_s", 1.5, "s", info=at, n=1),
        make_row("linalg", "matmul", "median_s", 1.6, "s", info=dict(at, git_commit="fedcba987654-dirty"), n=2)])
    _rows(tmp_path, "cpu-b-2c", "quick", "linalg", [make_row("linalg", "matmul", "median_s", 3.0, "s", info=at)])
    df = mb.load_results(tmp_path)
    shown = []
    import IPython.display as ipd
    real = ipd.display
    ipd.display = shown.append
    try:
        text = mb.show_measured_at(df, ["linalg", "state_space"])
    finally:
        ipd.display = real
    assert text == ("*Rows of `linalg` on cpu-a-2c (note profile) at commit abc1234, fedcba9-dirty; cpu-b-2c "
                    "(quick profile) at commit abc1234. Rows of `state_space`: not yet measured.*")
    assert shown[0].data == text

def _status(folder: Path, notebook: str, status: str, wall: float, commit: str = "abc1234def") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "status.json").write_text(json.dumps({
        "notebook": notebook, "status": status, "wall_s": wall, "started": "2026-01-01T00:00:00+0000",
        "error": None if status == "ok" else "boom", "execution_info": {"git_commit": commit}}))


def test_run_statuses_and_sittings_sum_ok_runs_only(tmp_path):
    root = tmp_path / "results"
    for nb, wall in (("a", 600.0), ("b", 1500.0)):
        _status(root / "cpu-x" / "note" / nb, nb, "ok", wall)
    _status(root / "cpu-x" / "note" / "c.failed", "c", "failed", 50.0, commit="fff0000aaa")
    _status(root / "cpu-x" / "note" / ".c.tmp-1", "c", "ok", 1.0)  # a run in progress is not a result
    _status(root / "cpu-x" / "quick" / "a", "a", "ok", 30.0)
    runs = mb.run_statuses(root)
    assert sorted(runs["notebook"]) == ["a", "a", "b", "c"]
    assert set(runs["commit"]) == {"abc1234", "fff0000"}
    sit = mb.profile_sittings(runs, expected=3).set_index(["device", "profile"])
    note = sit.loc[("cpu-x", "note")]
    assert note["notebooks_ok"] == 2 and not note["complete"] and note["total_min"] == pytest.approx(35.0)
    assert note["longest"] == "b" and note["commits"] == "abc1234"
    assert sit.loc[("cpu-x", "quick")]["total_min"] == pytest.approx(0.5)
    assert bool(mb.profile_sittings(runs, expected=2).set_index(["device", "profile"]).loc[("cpu-x", "note"),
                                                                                          "complete"])
    assert mb.run_statuses(tmp_path / "none").empty and mb.profile_sittings(mb.run_statuses(tmp_path / "none")).empty


def test_reference_rows_are_labelled(results):
    ref = mb.reference_rows("linalg")
    assert len(ref) > 0 and set(ref["source"]) == {"note, 2026-09-21"} and set(ref["section"]) == {"linalg"}
    with pytest.raises(KeyError, match="no_such_section"):
        mb.reference_rows("no_such_section")


def test_figures_and_formatting(results, tmp_path):
    from PIL import Image

    for profile in ("quick", "note"):
        Image.new("RGB", (4, 3)).save(results / "cpu-a-2c" / profile / "linalg" / "fig.png")
    Image.new("RGB", (4, 3)).save(results / "cuda-h200" / "quick" / "linalg.failed" / "fig.png")
    figs = mb.figure_paths("linalg", results)
    assert [(d, p) for d, p, _ in figs] == [("cpu-a-2c", "note")]
    assert len(mb.figure_paths("linalg", results, all_profiles=True)) == 2
    md = mb.figure_markdown(figs[0][2], "fig-x", "A caption.", base=tmp_path)
    assert md.startswith("```{figure} results/cpu-a-2c/note/linalg/fig.png\n:name: fig-x")
    assert mb.fmt(0.001234, "s") == "0.00123 s"
    assert mb.fmt(3640000) == "3,640,000"
    assert mb.fmt(None) == mb.NOT_MEASURED
    assert mb.fmt(float("nan"), "s") == mb.NOT_MEASURED
    assert mb.fmt(2.5e-7) == "2.50e-07"


@needs_chromium
def test_book_check_catches_broken_pages(tmp_path):
    from msrm_lab.notebooks.check_book import check_book

    html = tmp_path / "html"
    html.mkdir()
    (html / "index.html").write_text(
        "<html><body><img src='missing.png'><img src='http://example.invalid/x.png'>"
        "<span class='math'>\\(x^2\\)</span>"
        "<table class='msrm-device-table'><thead><tr><th>cpu-other-1c</th></tr></thead></table></body></html>")
    res = tmp_path / "results"
    _rows(res, "cpu-a-2c", "quick", "linalg", [make_row("linalg", "m", "x", 1.0, "s", info=INFO)])
    report = check_book(html, results=[res], chromium=CHROMIUM)
    text = "\n".join(report.failures)
    assert not report.ok
    assert "image did not load" in text and "missing.png" in text
    assert "request left 127.0.0.1: http://example.invalid/x.png" in text
    assert "no MathJax output" in text
    assert "device cpu-a-2c has results but is a column of no device table" in text


def test_static_check_holds_pages_to_what_a_reader_should_see(tmp_path):
    from msrm_lab.notebooks.check_book import MAX_TABLE_CELLS, page_failures, static_check

    wide = "<tr>" + "<td>1</td>" * (MAX_TABLE_CELLS + 1) + "</tr>"
    bad = ("<html><body><nav><img src='logo.png'></nav><article role='main'>"
           f"<table><caption>Wide one</caption>{wide}</table>"
           "<table><caption>Holes</caption><tr><th>n</th><td>not yet measured</td><td>Not measured in this build</td>"
           "</tr></table>"
           "<table><caption>Memory</caption><tr><th>peak</th><th>bytes</th><td>1,312,779,600</td></tr></table>"
           "<img src='bare.png'>"
           "<figure><img src='empty.png'><figcaption> </figcaption></figure>"
           "<div class='output text_plain'><pre>[]</pre></div>"
           "</article></body></html>")
    text = "\n".join(page_failures(bad, "p.html"))
    assert f"'Wide one' is {MAX_TABLE_CELLS + 1} cells wide" in text
    assert "'Holes' shows 2 placeholder cell(s), 2 column(s) of nothing else" in text
    assert "'Memory' shows raw byte counts, e.g. 1,312,779,600" in text
    assert "bare.png has no caption" in text and "empty.png has no caption" in text
    assert "logo.png" not in text  # outside the main content
    assert "stray output '[]'" in text
    good = ("<html><body><article role='main'><table><caption>Memory</caption><tr><th>peak</th><th>bytes</th>"
            "<td>1.31 GB</td><td>3,640,000 draws</td></tr>"
            "<tr><th>gpu</th><th>x</th><th>1</th><td>not yet measured</td><td>2</td></tr></table>"
            "<figure><img src='a.png'><figcaption><p>Latents against time (s).</p></figcaption></figure>"
            "<div class='output text_html'><p>a long enough HTML output that is not a stray repr</p></div>"
            "</article></body></html>")
    assert page_failures(good, "p.html") == []
    (tmp_path / "index.html").write_text(good)
    (tmp_path / "bad.html").write_text(bad)
    assert len(static_check(tmp_path)) == 6 and all(f.startswith("bad.html: ") for f in static_check(tmp_path))
    with pytest.raises(ValueError, match="holds no index.html"):
        static_check(tmp_path / "nowhere")


@pytest.fixture(scope="module")
def built_book(tmp_path_factory):
    """The book built from the committed results plus fresh smoke results of the two set-up notebooks."""
    tmp = tmp_path_factory.mktemp("book")
    for name in ("00_inventory.ipynb", "01_synthetic_study.ipynb"):
        res = run_notebook(ROOT / "notebooks" / name, profile="smoke", platform="cpu", label="cpu-smoke-book",
                           results=tmp / "results")
        assert res.status == "ok", res.error
    roots = os.pathsep.join([str(ROOT / "results"), str(tmp / "results")])
    env = dict(os.environ, MSRM_RESULTS=roots)
    jb = Path(sys.executable).with_name("jupyter-book")
    out = subprocess.run([str(jb), "build", "--all", "-W", "-n", "--keep-going", "--path-output", str(tmp), str(ROOT)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, (out.stdout + out.stderr)[-6000:]
    return tmp / "_build" / "html", [Path(r) for r in roots.split(os.pathsep)]


def test_book_builds_with_every_chapter(built_book):
    html, _ = built_book
    for chapter in ("intro", "inventory", "synthetic", "linalg", "rmsrm", "gp_grouped", "threads", "gradient_nuts",
                    "state_space", "scaling", "gpu_support", "reliability", "limits", "reproduce"):
        assert (html / "book" / f"{chapter}.html").is_file(), chapter
    synthetic = (html / "book" / "synthetic.html").read_text()
    assert "cpu-smoke-book" in synthetic and "streams_and_latents" in synthetic
    assert "note, 2026-09-21" in (html / "book" / "intro.html").read_text()
    assert not list(html.rglob("*.ipynb_checkpoints"))


@needs_chromium
def test_built_book_in_headless_chromium(built_book):
    from msrm_lab.notebooks.check_book import check_book

    html, roots = built_book
    report = check_book(html, results=roots, chromium=CHROMIUM)
    assert report.ok, report.summary()
    assert "cpu-smoke-book" in report.devices
    assert report.images >= 1 and report.math_pages >= 1 and report.device_tables >= 1
    assert all(r.startswith(("http://127.0.0.1", "data:", "blob:", "about:")) for r in report.requests)


def test_spread_is_over_processes_for_merged_rows_and_over_repeats_otherwise():
    import pandas as pd

    merged = pd.Series({"value": 15.8, "min": 14.5, "max": 15.6, "process_repeats": 3, "process_min": 15.1,
                        "process_max": 17.9})
    assert mb.spread(merged) == (15.1, 17.9, "processes")  # the median's own spread, not one process's repeats
    one = {"value": 1.0, "min_s": 0.9, "max_s": 1.2, "process_repeats": 1, "process_min": 1.0, "process_max": 1.0}
    assert mb.spread(one, "min_s", "max_s") == (0.9, 1.2, "repeats")
    assert mb.spread({"value": 1.0, "min": float("nan"), "max": 2.0}) == (None, None, "repeats")
    assert mb.spread(pd.Series({"process_repeats": 2, "process_min": None, "process_max": 3.0})) == (
        None, None, "processes")


def test_preferred_profile_keeps_one_profile_per_group(results):
    df = mb.load_results(results)
    kept = mb.preferred_profile(df)
    # the device with a note sitting keeps only it; the device with a quick sitting alone keeps that
    assert set(kept[kept.device == "cpu-a-2c"]["profile"]) == {"note"}
    assert set(kept[kept.device == "cuda-h200"]["profile"]) == {"quick"}
    assert len(kept[kept.device == "cpu-a-2c"]) == 1
    # grouped by device alone, each device keeps one profile across all its notebooks
    for _, g in mb.preferred_profile(df, by=["device"]).groupby("device"):
        assert g["profile"].nunique() == 1
    assert mb.preferred_profile(df.iloc[0:0]).empty
