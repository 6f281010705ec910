"""Crash safety: a process killed with SIGKILL mid-write leaves the previous file intact and readable."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from msrm import _atomic
from msrm.bench.rows import make_row, read_rows, write_rows

WRITER = textwrap.dedent(
    """
    import sys, time, numpy as np
    from msrm import _atomic
    from msrm.bench.rows import make_row, write_rows
    kind, path, flag = sys.argv[1], sys.argv[2], sys.argv[3]
    big = {"x": np.random.default_rng(1).standard_normal(4_000_000)}  # ~32 MB: a write takes a while
    open(flag, "w").close()
    i = 0
    while True:
        i += 1
        if kind == "npz":
            big["i"] = np.array(i)
            _atomic.write_npz(path, big)
        elif kind == "jsonl":
            write_rows(path, [make_row("crash", "loop", "i", float(i), "count", info={"pad": "x" * 200000})])
        else:
            _atomic.write_json(path, {"i": i, "pad": list(range(200000))})
    """
)


def _kill_mid_write(kind: str, path: Path, tmp_path: Path, delay: float) -> None:
    flag = tmp_path / f"started-{kind}"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, kind, str(path), str(flag)])
    try:
        t0 = time.time()
        while not flag.exists():
            assert time.time() - t0 < 60, "writer did not start"
            time.sleep(0.01)
        time.sleep(delay)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.parametrize("delay", [0.3, 0.75, 1.3])
def test_npz_archive_survives_sigkill(tmp_path, delay):
    path = tmp_path / "fit.npz"
    _atomic.write_npz(path, {"x": np.arange(3.0), "i": np.array(0)})
    _kill_mid_write("npz", path, tmp_path, delay)
    arrays = _atomic.read_npz(path)  # must load: either the old file or a complete newer one
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
    _atomic.write_json(path, {"i": 0})
    _kill_mid_write("json", path, tmp_path, 0.4)
    assert "i" in json.loads(path.read_text())


def test_failed_write_keeps_old_file(tmp_path):
    path = tmp_path / "a.json"
    _atomic.write_json(path, {"v": 1})
    with pytest.raises(TypeError):
        _atomic.write_json(path, {"v": object()})
    assert json.loads(path.read_text()) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]


def test_archives_refuse_object_arrays(tmp_path):
    with pytest.raises(ValueError, match="pickle"):
        _atomic.write_npz(tmp_path / "x.npz", {"bad": np.array([{"a": 1}], dtype=object)})
    assert not (tmp_path / "x.npz").exists()
