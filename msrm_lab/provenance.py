"""Where a result came from: the library's :func:`msrm.runtime.execution_info` plus the checkout it was measured at.

The library reports what it can know about itself (versions, devices, dtype, threads, BLAS kernel, load); which
commit of this repository produced a row is bookkeeping of the checkout, so it is added here. ``git_commit`` is
``HEAD`` with ``-dirty`` appended when files under ``msrm/`` or ``data_synth/`` (the code the rows measure) differ
from it, or None outside a git checkout. Each chapter of the book names it under its tables
(:func:`msrm_lab.book.show_measured_at`).
"""
from __future__ import annotations

import functools
import hashlib
import subprocess
from pathlib import Path
from typing import Any

__all__ = ["MEASURED_CODE", "checkout_commit", "code_digest", "execution_info"]

#: the folders whose uncommitted changes mark a row's commit ``-dirty`` (relative to the repository root)
MEASURED_CODE = ("msrm", "data_synth")

_ROOT = Path(__file__).resolve().parent.parent


@functools.lru_cache(maxsize=1)
def checkout_commit() -> str | None:
    """``HEAD`` of the checkout holding this package, ``-dirty`` when :data:`MEASURED_CODE` has uncommitted
    changes to tracked files; None when git or the repository is not there. Read once per process."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=_ROOT, capture_output=True, text=True, timeout=5)
        if out.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", *MEASURED_CODE],
                               cwd=_ROOT, capture_output=True, text=True, timeout=5)
        return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def code_digest(*extra: str | Path) -> str:
    """SHA-256 (hex) of the Python sources of :data:`MEASURED_CODE` and of the ``extra`` files, by content.

    Unlike :func:`checkout_commit` it needs no git and sees uncommitted edits: two checkouts share a digest exactly
    when every ``.py`` file under those folders (and every extra file) has the same path and bytes. Any edit, a
    comment included, changes it, which is what a result that must measure the code as it is needs.
    """
    files = sorted(f for d in MEASURED_CODE for f in (_ROOT / d).rglob("*.py") if "__pycache__" not in f.parts)
    files += [Path(e).resolve() for e in extra]
    h = hashlib.sha256()
    for f in files:  # named relative to the checkout, so that copies of it at other paths agree
        name = f.relative_to(_ROOT) if f.is_relative_to(_ROOT) else f
        h.update(str(name).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def execution_info(include_jax: bool | None = None) -> dict[str, Any]:
    """:func:`msrm.runtime.execution_info` with ``git_commit`` (:func:`checkout_commit`) added."""
    from msrm.runtime import execution_info as library_info

    info = library_info(include_jax=include_jax)
    info["git_commit"] = checkout_commit()
    return info
