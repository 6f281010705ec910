"""Test session set-up: float64 is the numerical contract, so it is switched on once, explicitly, here
(``import msrm`` never does it), with JAX's matmul precision pinned to ``highest``."""
from __future__ import annotations

from pathlib import Path

import pytest

import msrm.runtime

ROOT = Path(__file__).resolve().parent.parent


def pytest_sessionstart(session):
    msrm.runtime.enable_x64()


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
