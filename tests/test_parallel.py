"""msrm.parallel: ordered results, reported failures, loky and Dask give the same answers as a plain loop."""
from __future__ import annotations

import os

import numpy as np
import pytest

import data_synth
from msrm.parallel import TaskResult, resolve_n_jobs, run_tasks
from msrm.rmsrm import fit_rmsrm


def _square_or_fail(task):
    if task["seed"] == 13:
        raise ValueError(f"bad seed {task['seed']}")
    return task["seed"] ** 2, os.getpid()


def _blas_threads(_task):
    from threadpoolctl import threadpool_info

    return max((d["num_threads"] for d in threadpool_info() if d.get("user_api") == "blas"), default=None)


TASKS = [{"seed": s} for s in (3, 13, 5, 7)]


@pytest.mark.parametrize("backend", ["sequential", "loky"])
def test_results_in_submission_order_with_failures_reported(backend):
    out = run_tasks(_square_or_fail, TASKS, n_jobs=2, backend=backend)
    assert [r.index for r in out] == [0, 1, 2, 3]
    assert [r.task for r in out] == TASKS
    assert [r.value[0] if r.ok else None for r in out] == [9, None, 25, 49]
    bad = out[1]
    assert isinstance(bad, TaskResult) and not bad.ok and bad.value is None
    assert "Traceback" in bad.error and "bad seed 13" in bad.error and bad.task == {"seed": 13}
    pids = {r.value[1] for r in out if r.ok}
    assert (os.getpid() in pids) == (backend == "sequential")


def test_loky_limits_blas_threads_in_workers():
    out = run_tasks(_blas_threads, [0, 1], n_jobs=2, backend="loky", blas_threads=1)
    assert [r.value for r in out] == [1, 1]


def test_bad_arguments():
    with pytest.raises(ValueError, match="backend"):
        run_tasks(_square_or_fail, TASKS, backend="threads")
    with pytest.raises(ValueError, match="client"):
        run_tasks(_square_or_fail, TASKS, backend="loky", client=object())
    with pytest.raises(ValueError, match="n_jobs"):
        run_tasks(_square_or_fail, TASKS, n_jobs=0)
    with pytest.raises(ValueError, match="blas_threads"):
        run_tasks(_square_or_fail, TASKS, blas_threads=0)
    with pytest.raises(ValueError, match="fn"):
        run_tasks(42, TASKS)
    assert run_tasks(_square_or_fail, []) == []
    assert resolve_n_jobs(None, 1) == 1 and resolve_n_jobs(5, 3) == 3


def test_dask_without_client_is_refused():
    pytest.importorskip("distributed")
    with pytest.raises(ValueError, match="Client"):
        run_tasks(_square_or_fail, TASKS, backend="dask")


def test_dask_cluster_runs_rmsrm_restarts_like_loky():
    distributed = pytest.importorskip("distributed")
    data, truth = data_synth.synthetic_dataset("tiny", n_features=8, seed=6)
    loky = fit_rmsrm(data, truth.spec, restarts=3, max_iter=5, seed=21, n_jobs=2, backend="loky", progress=False)
    with distributed.LocalCluster(n_workers=2, processes=True, threads_per_worker=1, dashboard_address=None) as cluster:
        with distributed.Client(cluster) as client:
            out = run_tasks(_square_or_fail, TASKS, backend="dask", client=client)
            dask_fit = fit_rmsrm(data, truth.spec, restarts=3, max_iter=5, seed=21, backend="dask", client=client,
                                 progress=False)
    assert [r.value[0] if r.ok else None for r in out] == [9, None, 25, 49]
    assert "bad seed 13" in out[1].error and out[1].task == {"seed": 13}
    assert dask_fit.settings["backend"] == "dask"
    assert np.array_equal(loky.restarts, dask_fit.restarts)
    assert np.array_equal(loky.objective_history, dask_fit.objective_history)
    for a, b in zip(loky.latents, dask_fit.latents):
        assert np.array_equal(a, b)
    fa, fb = loky.params.flatten(), dask_fit.params.flatten()
    assert all(np.array_equal(fa[k], fb[k]) for k in fa)
