"""Write a notebook from a compact cell list (outputs empty): python tools/make_notebook.py spec.py out.ipynb.

The spec module defines CELLS = [("markdown"|"code"|"parameters", source), ...].
"""
import runpy
import sys

import nbformat


def build(cells):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    for kind, src in cells:
        src = src.strip("\n")
        if kind == "markdown":
            nb.cells.append(nbformat.v4.new_markdown_cell(src))
        else:
            cell = nbformat.v4.new_code_cell(src)
            if kind == "parameters":
                cell.metadata["tags"] = ["parameters"]
            nb.cells.append(cell)
    for i, c in enumerate(nb.cells):
        c["id"] = f"cell-{i}"
    return nb


if __name__ == "__main__":
    spec, out = sys.argv[1], sys.argv[2]
    nbformat.write(build(runpy.run_path(spec)["CELLS"]), out)
