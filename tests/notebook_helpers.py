"""A throwaway notebook for the runner's tests: a ``parameters`` cell (profile, device, out_dir) and one body cell."""
from __future__ import annotations

from pathlib import Path

import nbformat


def toy_notebook(path: Path, body: str) -> Path:
    """Write a two-cell notebook to ``path``: the tagged parameters cell papermill fills in, then ``body``."""
    nb = nbformat.v4.new_notebook()
    params = nbformat.v4.new_code_cell('profile = "quick"\ndevice = "cpu"\nout_dir = "results/local/quick/x"')
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params, nbformat.v4.new_code_cell(body)]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path
