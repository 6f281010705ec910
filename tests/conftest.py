"""Test session set-up: float64 is the numerical contract, so it is switched on once, explicitly, here
(``import msrm`` never does it), with JAX's matmul precision pinned to ``highest``."""
from __future__ import annotations

from pathlib import Path

import pytest

import msrm.runtime

ROOT = Path(__file__).resolve().parent.parent


def pytest_sessionstart(session):
    msrm.runtime.enable_x64()


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "cuda: qualification on a CUDA GPU visible to JAX (tests/test_cuda.py); skipped without one")


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


def _count_calls(monkeypatch, module, name: str) -> list[int]:
    """Replace ``module.name`` for one test by a wrapper that counts its calls; returns the one-element counter.
    A function called inside a jitted program runs only while JAX traces it, so its call count is the number of
    traces (the callers look it up in the module at trace time)."""
    original = getattr(module, name)
    count = [0]

    def counted(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return count


@pytest.fixture
def likelihood_traces(monkeypatch) -> list[int]:
    """Traces of the summed GP likelihood (:func:`msrm.gp.likelihood.run_logliks`, what every dense/grouped
    evaluation of the density traces)."""
    from msrm.gp import likelihood

    return _count_calls(monkeypatch, likelihood, "run_logliks")


@pytest.fixture
def stack_traces(monkeypatch) -> list[int]:
    """Traces of one stack of runs (:func:`msrm.gp.likelihood._bucket_logliks`: once per stack, however many
    runs it holds)."""
    from msrm.gp import likelihood

    return _count_calls(monkeypatch, likelihood, "_bucket_logliks")


@pytest.fixture
def posterior_traces(monkeypatch) -> list[int]:
    """Traces of the grid posterior and predictions of one run (:func:`msrm.gp.conditional.posterior_arrays`)."""
    from msrm.gp import conditional

    return _count_calls(monkeypatch, conditional, "posterior_arrays")
