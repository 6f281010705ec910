"""Kill a writer process with SIGKILL in the middle of writing and check what is left on disk.

``kill_during_writes(kind, path, delay)`` starts a child process that rewrites ``path`` in a loop through msrm's
atomic writers (``npz`` archive, ``jsonl`` results rows or ``json``), kills it ``delay`` seconds after it starts
writing, and reports whether the file is still complete and readable.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

__all__ = ["WRITER", "kill_during_writes", "readable"]

WRITER = textwrap.dedent(
    """
    import sys, numpy as np
    from msrm import atomic
    from msrm_lab.bench.rows import make_row, write_rows
    kind, path, flag = sys.argv[1], sys.argv[2], sys.argv[3]
    big = {"x": np.random.default_rng(1).standard_normal(4_000_000)}  # ~32 MB: a write takes a while
    open(flag, "w").close()
    i = 0
    while True:
        i += 1
        if kind == "npz":
            big["i"] = np.array(i)
            atomic.write_npz(path, big)
        elif kind == "jsonl":
            write_rows(path, [make_row("crash", "loop", "i", float(i), "count", info={"pad": "x" * 200000})])
        else:
            atomic.write_json(path, {"i": i, "pad": list(range(200000))})
    """
)


def readable(kind: str, path: Path) -> bool:
    """True when ``path`` is a complete file of its kind."""
    from msrm import atomic
    from msrm_lab.bench.rows import read_rows

    try:
        if kind == "npz":
            arrays = atomic.read_npz(path)
            return {"x", "i"} <= set(arrays) or set(arrays) == {"x", "i"}
        if kind == "jsonl":
            for line in Path(path).read_text().splitlines():
                json.loads(line)
            return bool(read_rows(path))
        json.loads(Path(path).read_text())
        return True
    except Exception:
        return False


def kill_during_writes(kind: str, path: str | os.PathLike, delay: float, *, timeout: float = 60.0) -> dict:
    """Run the writer on ``path`` (which must already exist), SIGKILL it after ``delay`` s, inspect the result."""
    path = Path(path)
    flag = path.with_name(f".started-{kind}-{os.getpid()}-{time.time_ns()}")
    proc = subprocess.Popen([sys.executable, "-c", WRITER, kind, str(path), str(flag)])
    try:
        t0 = time.time()
        while not flag.exists():
            if time.time() - t0 > timeout:
                raise TimeoutError("writer did not start")
            time.sleep(0.01)
        time.sleep(delay)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        flag.unlink(missing_ok=True)
    temps = [p.name for p in path.parent.iterdir() if p.name.startswith(f".{path.name}.")]
    return {"kind": kind, "delay": delay, "readable": readable(kind, path), "temp_files_left": len(temps)}
