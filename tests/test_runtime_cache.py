"""``msrm.runtime.configure(compilation_cache=...)``: the directory is validated before anything is configured,
created when missing, recorded in ``execution_info()``, and a compilation in a fresh process writes entries there."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import msrm

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("bad", [123, b"/tmp/x", "", "   ", True])
def test_compilation_cache_rejects_what_is_not_a_path(bad):
    with pytest.raises(ValueError, match="compilation_cache"):
        msrm.runtime.configure(compilation_cache=bad)


def test_compilation_cache_rejects_a_file(tmp_path):
    f = tmp_path / "not_a_dir"
    f.write_text("x")
    with pytest.raises(ValueError, match="compilation_cache.*is a file"):
        msrm.runtime.configure(compilation_cache=f)


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root can write a read-only directory")
def test_compilation_cache_rejects_a_read_only_directory(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    try:
        with pytest.raises(ValueError, match="compilation_cache.*not writable"):
            msrm.runtime.configure(compilation_cache=d)
        with pytest.raises(ValueError, match="compilation_cache.*cannot create"):
            msrm.runtime.configure(compilation_cache=d / "inside")
    finally:
        d.chmod(0o700)


_CHILD = """
import json, os, sys
import msrm
msrm.runtime.configure(platform="cpu", compilation_cache=sys.argv[1])
import jax, jax.numpy as jnp
f = jax.jit(lambda x: jnp.sin(x) @ x.T)
f(jnp.ones((3, 3))).block_until_ready()
info = msrm.runtime.execution_info()
print(json.dumps({"cache": info["compilation_cache"], "entries": sorted(os.listdir(sys.argv[1])),
                  "x64": info["x64"]}))
"""


def test_compilation_cache_gets_entries_after_a_compile(tmp_path):
    cache = tmp_path / "new" / "cache"  # missing: configure creates it
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", _CHILD, str(cache)], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["cache"] == str(cache.resolve())
    assert res["x64"] is True
    assert any(e.startswith("jit_") for e in res["entries"]), res["entries"]


def test_execution_info_records_no_cache_by_default():
    info = msrm.runtime.execution_info(include_jax=False)
    assert "compilation_cache" in info
