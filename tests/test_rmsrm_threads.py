"""BLAS threads of R-MSRM's steps (``msrm.runtime.step_blas_threads``): the rule, that threadpoolctl reports its
count inside the banded latent solve and the loadings step, and that a fit is the same with and without it."""
from __future__ import annotations

import numpy as np
import pytest
import scipy.linalg as sla
from threadpoolctl import threadpool_info

import data_synth
import msrm
from msrm import runtime
from msrm.rmsrm import latent as latent_mod
from msrm.rmsrm import loadings as loadings_mod
from msrm.rmsrm.latent import solve_latents
from msrm.rmsrm.objective import RState, compute_stats, slot_latents
from msrm.rmsrm.prepare import prepare_rmsrm


def _blas_threads_now() -> int:
    return max(d["num_threads"] for d in threadpool_info() if d["user_api"] == "blas")


def _case():
    data, truth = data_synth.synthetic_dataset("tiny", n_features=5, seed=0)
    prep = prepare_rmsrm(data, truth.spec, roughness=2.0)
    tp = truth.params
    st = RState(Z=tuple(truth.latents), W=dict(tp.loadings), b=dict(tp.intercepts),
                var={k: v ** 2 for k, v in tp.noise_sd.items()}, theta={k: dict(v) for k, v in tp.response.items()})
    return data, truth, prep, st


def test_rule_banded_is_one_thread_dense_by_size_and_idle_cores(monkeypatch):
    assert runtime.step_blas_threads("banded") == 1
    assert runtime.step_blas_threads("dense", 0.0) == 1
    assert runtime.step_blas_threads("dense", runtime.DENSE_THREAD_MIN_FLOPS / 2) == 1
    big = 10 * runtime.DENSE_THREAD_MIN_FLOPS
    monkeypatch.setattr(runtime, "_running_elsewhere", lambda proc="/proc": 0)
    assert runtime.idle_cores() == runtime.physical_cores()
    assert runtime.step_blas_threads("dense", big) == runtime.physical_cores()
    monkeypatch.setattr(runtime, "_running_elsewhere", lambda proc="/proc": 50)
    assert runtime.idle_cores() == 1
    assert runtime.step_blas_threads("dense", big) == 1


def test_rule_respects_an_explicit_count():
    with runtime.fixed_step_threads(3):
        assert runtime.step_blas_threads("banded") == 3
        assert runtime.step_blas_threads("dense", 0.0) == 3
    assert runtime.step_blas_threads("banded") == 1


@pytest.mark.parametrize("kwargs, match", [({"kind": "sparse"}, "kind"), ({"kind": "dense", "flops": -1.0}, "flops"),
                                           ({"kind": "dense", "flops": "big"}, "flops")])
def test_rule_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        runtime.step_blas_threads(**kwargs)
    with pytest.raises(ValueError, match="n must be"):
        with runtime.fixed_step_threads(0):
            pass


def _recording(fn, seen):
    def wrapper(*a, **k):
        seen.append(_blas_threads_now())
        return fn(*a, **k)
    return wrapper


def test_threadpoolctl_reports_the_limit_inside_the_steps(monkeypatch):
    _, _, prep, st = _case()
    stats = compute_stats(prep, st)
    seen_banded: list[int] = []
    seen_dense: list[int] = []
    monkeypatch.setattr(latent_mod.sla, "cholesky_banded", _recording(sla.cholesky_banded, seen_banded))
    monkeypatch.setattr(loadings_mod.sla, "cho_factor", _recording(sla.cho_factor, seen_dense))
    outer = max(2, runtime.physical_cores())
    with runtime.blas_limit(outer):
        assert _blas_threads_now() == outer
        solve_latents(prep, st, stats, "banded")
        loadings_mod.update_loadings(prep, st, slot_latents(prep, st))
        assert _blas_threads_now() == outer  # restored after the steps
        with runtime.fixed_step_threads(outer):
            solve_latents(prep, st, stats, "banded")
    assert seen_banded[: len(prep.runs)] == [1] * len(prep.runs)
    assert seen_banded[len(prep.runs):] == [outer] * len(prep.runs)
    assert seen_dense and set(seen_dense) == {1}  # the tiny case is far below the dense threshold


def test_fit_is_the_same_with_and_without_the_limit():
    data, truth, _, _ = _case()
    kw = dict(restarts=1, max_iter=4, tol=0.0, n_jobs=1, progress=False)
    ruled = msrm.fit_rmsrm(data, truth.spec, **kw)
    with runtime.fixed_step_threads(max(2, runtime.physical_cores())):
        free = msrm.fit_rmsrm(data, truth.spec, **kw)
    for a, b in zip(ruled.latents, free.latents):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ruled.objective_history, free.objective_history, rtol=1e-12)
    for k in ruled.params.loadings:
        np.testing.assert_allclose(ruled.params.loadings[k], free.params.loadings[k], rtol=1e-12, atol=1e-12)
