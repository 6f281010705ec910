"""Where the repository is: the tooling works on a checkout (notebooks, results, the book), found from the
working directory or named explicitly, never from where the installed package happens to live."""
from __future__ import annotations

import os
from pathlib import Path

__all__ = ["repo_root", "MARKERS"]

# A checkout is the folder that holds the notebooks and the book's table of contents.
MARKERS = ("notebooks", "_toc.yml")


def _is_root(path: Path) -> bool:
    return (path / MARKERS[0]).is_dir() and (path / MARKERS[1]).is_file()


def repo_root(start: str | Path | None = None) -> Path:
    """The repository root.

    Args:
        start: a folder inside the checkout; ``None`` takes ``$MSRM_REPO`` when set, else the working directory.
    Returns:
        the nearest folder at or above ``start`` holding ``notebooks/`` and ``_toc.yml``.
    Raises:
        FileNotFoundError: no such folder (names where the search started).
    """
    if start is None:
        start = os.environ.get("MSRM_REPO") or Path.cwd()
    here = Path(start).resolve()
    for path in (here, *here.parents):
        if _is_root(path):
            return path
    raise FileNotFoundError(
        f"no MSRM checkout at or above {here} (a folder with notebooks/ and _toc.yml); run from inside the "
        f"repository or set MSRM_REPO")
