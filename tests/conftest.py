"""Test session set-up: float64 is the numerical contract, so it is switched on once, explicitly, here
(``import msrm`` never does it), with JAX's matmul precision pinned to ``highest``."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

import msrm.runtime

ROOT = Path(__file__).resolve().parent.parent


def pytest_sessionstart(session):
    msrm.runtime.enable_x64()


_OWN_CACHE_DIR: list[str] = []


def pytest_configure(config):
    # The state-space tuning cache (msrm.gp.state_space.tuning.cache_dir) lives in the user's cache folder; the
    # suite gets an empty one of its own, so that no test reads coefficients or block choices that an earlier
    # benchmark stored there (and no test writes into the user's). Subprocesses started by tests inherit it.
    # A caller who sets MSRM_CACHE_DIR keeps theirs.
    if "MSRM_CACHE_DIR" not in os.environ:
        path = tempfile.mkdtemp(prefix="msrm-test-cache-")
        _OWN_CACHE_DIR.append(path)
        os.environ["MSRM_CACHE_DIR"] = path
    config.addinivalue_line(
        "markers", "cuda: qualification on a CUDA GPU visible to JAX (tests/test_cuda.py); skipped without one")


def pytest_unconfigure(config):
    for path in _OWN_CACHE_DIR:
        shutil.rmtree(path, ignore_errors=True)
        if os.environ.get("MSRM_CACHE_DIR") == path:
            del os.environ["MSRM_CACHE_DIR"]
    _OWN_CACHE_DIR.clear()


def _cuda_devices() -> list:
    """The CUDA devices JAX sees (``[]`` when none, or when ``JAX_PLATFORMS`` leaves CUDA out)."""
    import jax

    try:
        return list(jax.devices("cuda"))
    except RuntimeError:
        return []


def pytest_collection_modifyitems(config, items):
    """Skip the ``cuda``-marked tests when JAX sees no CUDA device (JAX is asked only when such a test exists)."""
    marked = [item for item in items if item.get_closest_marker("cuda") is not None]
    if marked and not _cuda_devices():
        skip = pytest.mark.skip(reason="no CUDA device visible to JAX")
        for item in marked:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _float64_contract():
    """Fail loudly if something in the suite switched float64 off."""
    import jax

    msrm.runtime.enable_x64()
    assert jax.config.jax_enable_x64
    assert jax.config.jax_default_matmul_precision == "highest"
    yield


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT
