"""Where a result came from: the library's :func:`msrm.runtime.execution_info` plus the checkout it was measured at.

The library reports what it can know about itself (versions, devices, dtype, threads, BLAS kernel, load); which
commit of this repository produced a row is bookkeeping of the checkout, so it is added here. ``git_commit`` is
``HEAD`` with ``-dirty`` appended when files under ``msrm/`` or ``data_synth/`` (the code the rows measure) differ
from it, or None outside a git checkout. Each chapter of the book names it under its tables
(:func:`msrm_lab.book.show_measured_at`).
"""
from __future__ import annotations

import functools
import subprocess
from pathlib import Path
from typing import Any

__all__ = ["MEASURED_CODE", "checkout_commit", "execution_info"]

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


def execution_info(include_jax: bool | None = None) -> dict[str, Any]:
    """:func:`msrm.runtime.execution_info` with ``git_commit`` (:func:`checkout_commit`) added."""
    from msrm.runtime import execution_info as library_info

    info = library_info(include_jax=include_jax)
    info["git_commit"] = checkout_commit()
    return info
