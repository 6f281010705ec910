"""Crash-safe file writes: write a temporary file beside the target, fsync, then rename.

A process killed at any point leaves either the previous file or the new one, never a torn file.
Every archive and results file in msrm goes through these helpers.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator

import numpy as np

__all__ = ["atomic_path", "write_bytes", "write_text", "write_json", "write_npz", "read_npz", "append_jsonl", "json_default"]


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path in the target's folder; on success rename it over ``path``.

    The temporary file is removed if the body raises, so a failed write never replaces the target.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp" + suffix, dir=path.parent)
    os.close(fd)
    tmp = Path(tmp)
    try:
        yield tmp
        with open(tmp, "rb+") as fh:
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def write_text(path: str | os.PathLike, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def json_default(obj: Any) -> Any:
    """``json.dumps(default=...)`` for NumPy scalars and arrays and paths; TypeError for anything else."""
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"object of type {type(obj).__name__} is not JSON serialisable")


def write_json(path: str | os.PathLike, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=json_default, allow_nan=True))


def append_jsonl(path: str | os.PathLike, rows: list[dict]) -> None:
    """Append rows to a JSON-lines file by rewriting it atomically (old rows + new rows)."""
    path = Path(path)
    old = path.read_bytes() if path.exists() else b""
    if old and not old.endswith(b"\n"):
        old += b"\n"
    new = "".join(json.dumps(r, sort_keys=True, default=json_default, allow_nan=True) + "\n" for r in rows)
    write_bytes(path, old + new.encode("utf-8"))


def write_npz(path: str | os.PathLike, arrays: dict[str, np.ndarray]) -> None:
    """Write a compressed ``.npz`` atomically; object arrays are refused (they would need pickle)."""
    for name, arr in arrays.items():
        if np.asarray(arr).dtype == object:
            raise ValueError(f"array {name!r} has dtype object; archives never use pickle")
    buf = io.BytesIO()
    np.savez_compressed(buf, **{k: np.asarray(v) for k, v in arrays.items()})
    write_bytes(path, buf.getvalue())


def read_npz(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Read an ``.npz`` archive without pickle."""
    with np.load(path, allow_pickle=False) as f:
        return {k: f[k] for k in f.files}
