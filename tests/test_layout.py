"""The package layout: ``msrm`` is the library, ``msrm_lab`` the research tooling on top of it.

Read from the source with :mod:`ast` (nothing is imported): every import statement of every module, at module
level or inside a function, is an edge of the import graph.

* no import cycle among ``msrm``'s modules;
* ``msrm`` never imports ``msrm_lab`` (the tooling imports the library, never the reverse);
* no private name (one leading underscore) of one module is used by another, by ``from m import _x`` or by
  ``m._x`` on an imported module, in ``msrm`` or ``msrm_lab``; such a name is made public or its code moved;
* no function or method of ``msrm`` is longer than :data:`MAX_FUNCTION_LINES` lines;
* the built wheel holds the library without the tooling inside it, and that ``msrm`` imports and computes from
  the unpacked wheel alone.
"""
from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("msrm", "msrm_lab")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules(package: str) -> dict[str, Path]:
    return {module_name(p): p for p in sorted((ROOT / package).rglob("*.py"))}


ALL = {**modules("msrm"), **modules("msrm_lab")}


def is_package(name: str) -> bool:
    return ALL.get(name, Path()).name == "__init__.py"


def resolve(importer: str, level: int, module: str | None) -> str:
    """Absolute name of ``from <level dots><module> import ...`` written in ``importer``."""
    if level == 0:
        return module or ""
    base = importer.split(".")
    if not is_package(importer):
        base = base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def imports(name: str, path: Path):
    """(target module, imported names or None, alias bindings) of every import statement in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, None, {(a.asname or a.name.split(".")[0]): a.name if a.asname else a.name.split(".")[0]}
        elif isinstance(node, ast.ImportFrom):
            base = resolve(name, node.level, node.module)
            for a in node.names:
                full = f"{base}.{a.name}"
                if full in ALL:  # `from pkg import submodule`
                    yield full, None, {a.asname or a.name: full}
                else:
                    yield base, a.name, {}


def graph(package: str) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for name, path in modules(package).items():
        out = edges.setdefault(name, set())
        for target, _, _ in imports(name, path):
            # an import of a.b.c runs a and a.b first: an edge to each package on the way
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                t = ".".join(parts[:i])
                if t in ALL and t != name and t.split(".")[0] == package:
                    out.add(t)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_inside_msrm():
    edges = graph("msrm")
    # a package's __init__ that re-exports its submodules is not a cycle with them: drop edges into a package
    # from its own submodules (`from . import x` inside the package resolves to the submodule anyway)
    for name in edges:
        edges[name] = {t for t in edges[name] if not (is_package(t) and name.startswith(t + "."))}
    found = cycles(edges)
    assert not found, f"import cycles inside msrm: {found}"


def test_cycle_detector_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_msrm_never_imports_the_tooling():
    bad = [(name, target) for name, path in modules("msrm").items()
           for target, _, _ in imports(name, path) if target.split(".")[0] == "msrm_lab"]
    assert not bad, f"msrm imports msrm_lab: {bad}"


def private_uses(name: str, path: Path) -> list[str]:
    out = []
    aliases: dict[str, str] = {}
    for target, imported, bound in imports(name, path):
        if imported and imported.startswith("_") and not imported.startswith("__") and target in ALL \
                and target != name:
            out.append(f"from {target} import {imported}")
        aliases.update({k: v for k, v in bound.items() if v in ALL and v != name})
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            if node.attr.startswith("_") and not node.attr.startswith("__"):
                out.append(f"{aliases[node.value.id]}.{node.attr} (line {node.lineno})")
    return out


def test_no_private_name_is_used_across_modules():
    bad = {name: uses for name, path in ALL.items() if (uses := private_uses(name, path))}
    assert not bad, f"private names used from another module: {bad}"


def test_private_use_detector(tmp_path):
    assert resolve("msrm.gp.model", 1, "linalg") == "msrm.gp.linalg"
    assert resolve("msrm.gp", 1, "model") == "msrm.gp.model"
    assert resolve("msrm.gp.state_space.host", 3, None) == "msrm"
    src = tmp_path / "m.py"
    src.write_text("from msrm import atomic\nfrom msrm.runtime import _x\natomic._helper()\n")
    assert private_uses("msrm.probe", src) == ["from msrm.runtime import _x", "msrm.atomic._helper (line 3)"]


MAX_FUNCTION_LINES = 80


def long_functions(path: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``file:function (lines)`` of every function or method in the file longer than ``limit`` lines (its
    decorators excluded; signature, docstring and body counted)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [f"{path.name}:{n.name} ({n.end_lineno - n.lineno + 1})" for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > limit]


def test_no_library_function_is_longer_than_a_screen():
    long = [f"{path.parent.relative_to(ROOT)}/{f}" for path in modules("msrm").values()
            for f in long_functions(path)]
    assert not long, f"functions in msrm over {MAX_FUNCTION_LINES} lines: {long}"


def test_long_function_detector(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    path = tmp_path / "probe.py"
    path.write_text(f"def short():\n    return 1\n\n\ndef long():\n{body}\n")
    assert long_functions(path) == [f"probe.py:long ({MAX_FUNCTION_LINES + 1})"]


@pytest.mark.timeout(600)
def test_wheel_holds_a_working_library(tmp_path):
    """Build the wheel (no editable install) from the tracked files, unpack it, and import msrm from there alone."""
    src = tmp_path / "src"  # a copy, so no build/ folder is left in (or reused from) the checkout
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for rel in filter(None, files.decode().split("\0")):
        if (ROOT / rel).is_file() and not rel.startswith(("results/", "notebooks/", "book/")):
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("msrm-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "msrm/__init__.py" in names and "msrm/gp/state_space/host.py" in names
    assert not [n for n in names if n.startswith(("msrm/bench", "msrm/notebooks", "msrm/reliability", "msrm/book"))]
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import msrm, data_synth\n"
            "assert msrm.__file__.startswith(sys.argv[1]), msrm.__file__\n"
            "msrm.runtime.enable_x64()\n"
            "data, truth = data_synth.synthetic_dataset('tiny', n_features=2, n_runs=1, seed=0)\n"
            "m = msrm.GPMSRM(data, truth.spec, linear_algebra='grouped')\n"
            "print(m.log_likelihood(truth.params))\n")
    # -I: isolated (no working directory, no PYTHONPATH, no user site) so the checkout cannot leak in
    res = subprocess.run([sys.executable, "-I", "-c", code, str(site)], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert float(res.stdout.strip().splitlines()[-1]) < 0
