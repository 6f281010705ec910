"""Host allocator mode of msrm.runtime (glibc mallopt): explicit, recorded, reversible, refuses bad values."""
import subprocess
import sys

import pytest

import msrm


def test_bad_mode_is_refused_before_anything_changes():
    before = msrm.runtime.host_memory()
    with pytest.raises(ValueError, match="host_memory must be one of"):
        msrm.runtime.set_host_memory("bigpages")
    with pytest.raises(ValueError, match="host_memory must be one of"):
        msrm.runtime.configure(host_memory="never")
    assert msrm.runtime.host_memory() == before


def test_modes_switch_and_are_recorded():
    code = (
        "import msrm, numpy as np\n"
        "assert msrm.runtime.host_memory() is None\n"
        "ok = msrm.runtime.set_host_memory('reuse')\n"
        "info = msrm.runtime.execution_info(include_jax=False)\n"
        "assert info['host_memory'] == ('reuse' if ok else 'unavailable'), info['host_memory']\n"
        "x = np.ones((3000, 3000)); s = float(x.sum()); del x\n"
        "msrm.runtime.release_host_memory()\n"
        "ok2 = msrm.runtime.set_host_memory('system')\n"
        "assert msrm.runtime.host_memory() == ('system' if ok2 else 'unavailable')\n"
        "assert s == 9e6\n"
        "print(ok, ok2)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    if sys.platform.startswith("linux"):
        assert out.stdout.split() == ["True", "True"]


def test_import_does_not_touch_the_allocator():
    code = "import msrm, msrm.runtime as r; assert r.host_memory() is None; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
