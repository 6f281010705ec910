"""Crash safety: a process killed with SIGKILL mid-write leaves the previous file intact and readable."""
import json
from pathlib import Path

import numpy as np
import pytest

from msrm import atomic
from msrm_lab.bench.rows import make_row, read_rows, write_rows
from msrm_lab.reliability.crash import kill_during_writes


def _kill_mid_write(kind: str, path: Path, tmp_path: Path, delay: float) -> None:
    report = kill_during_writes(kind, path, delay)
    assert report["readable"], report


@pytest.mark.parametrize("delay", [0.3, 0.75, 1.3])
def test_npz_archive_survives_sigkill(tmp_path, delay):
    path = tmp_path / "fit.npz"
    atomic.write_npz(path, {"x": np.arange(3.0), "i": np.array(0)})
    _kill_mid_write("npz", path, tmp_path, delay)
    arrays = atomic.read_npz(path)  # must load: either the old file or a complete newer one
    assert set(arrays) == {"x", "i"}
    if int(arrays["i"]) > 0:
        assert arrays["x"].size == 4_000_000
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".fit.npz.")]
    assert len(leftovers) <= 1  # at most the killed write's temp file, never the target


@pytest.mark.parametrize("delay", [0.2, 0.6])
def test_results_rows_survive_sigkill(tmp_path, delay):
    path = tmp_path / "rows.jsonl"
    write_rows(path, [make_row("crash", "seed", "i", 0.0, "count")])
    _kill_mid_write("jsonl", path, tmp_path, delay)
    rows = read_rows(path)
    assert rows[0]["experiment"] == "seed"
    # every line is complete JSON: the file was replaced whole or not at all
    for line in path.read_text().splitlines():
        json.loads(line)
    values = [r["value"] for r in rows[1:]]
    assert values == list(range(1, len(values) + 1))


def test_json_archive_survives_sigkill(tmp_path):
    path = tmp_path / "meta.json"
    atomic.write_json(path, {"i": 0})
    _kill_mid_write("json", path, tmp_path, 0.4)
    assert "i" in json.loads(path.read_text())


def test_failed_write_keeps_old_file(tmp_path):
    path = tmp_path / "a.json"
    atomic.write_json(path, {"v": 1})
    with pytest.raises(TypeError):
        atomic.write_json(path, {"v": object()})
    assert json.loads(path.read_text()) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]


def test_archives_refuse_object_arrays(tmp_path):
    with pytest.raises(ValueError, match="pickle"):
        atomic.write_npz(tmp_path / "x.npz", {"bad": np.array([{"a": 1}], dtype=object)})
    assert not (tmp_path / "x.npz").exists()
