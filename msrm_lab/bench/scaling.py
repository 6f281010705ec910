"""Scaling to full recordings, measured: one long run versus the same recording cut into runs.

The grouped likelihood factorises an (N K)-dimensional matrix per run, so one run k times longer costs about
k^3 in time and k^2 in memory, while k runs of the original length cost k times one run. The state-space backend
is linear in length either way. This module measures both on a duration ladder (x1, x2, x4, x8), side by side
in one process, and records the memory guard's refusal (or a predicted-time skip) where a case does not fit.
It also measures restart throughput of R-MSRM with 1 and 2 workers (loky and Dask).
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np

from .measure import PeakMemory, warm_median
from msrm_lab.budget import skip_reason, skippable, skipped_rows
from .rows import make_row

__all__ = ["SIZES", "ladder_rows", "restart_rows", "fit_exponent"]

NOTEBOOK = "scaling"

SIZES: dict[str, dict[str, Any]] = {
    # scales per backend: the grouped factorization grows with the cube of the length, so its ladder is shorter
    "smoke": dict(profile="tiny", n_features=3, n_factors=2, scales={"grouped": [1, 2], "state_space": [1]},
                  repeats=1, time_budget_s=30.0, restarts=2, restart_iter=3, restart_features=3,
                  restart_configs=[("loky", 1)]),
    "quick": dict(profile="one-eighth", n_features=36, n_factors=3,
                  scales={"grouped": [1, 2], "state_space": [1, 2]}, repeats=2, time_budget_s=60.0, restarts=2,
                  restart_iter=5, restart_features=36, restart_configs=[("loky", 1), ("loky", 2)]),
    "note": dict(profile="one-eighth", n_features=3600, n_factors=5,
                 scales={"grouped": [1, 2, 4, 8], "state_space": [1, 2, 4, 8]}, repeats=3, time_budget_s=240.0,
                 restarts=4, restart_iter=20, restart_features=360,
                 restart_configs=[("loky", 1), ("loky", 2), ("dask", 2)]),
    "full": dict(profile="one-eighth", n_features=3600, n_factors=5,
                 scales={"grouped": [1, 2, 4, 8], "state_space": [1, 2, 4, 8, 16]}, repeats=3,
                 time_budget_s=1200.0, restarts=8, restart_iter=100, restart_features=3600,
                 restart_configs=[("loky", 1), ("loky", 2), ("dask", 2)]),
}


def fit_exponent(scales, seconds) -> float:
    """Least-squares slope of log(time) against log(duration scale)."""
    x, y = np.log(np.asarray(scales, float)), np.log(np.asarray(seconds, float))
    if x.size < 2:
        return float("nan")
    return float(np.polyfit(x, y, 1)[0])


def _case(sz: dict, scale: int, layout: str, backend: str, seed: int = 0):
    import data_synth
    import msrm
    from msrm.data import split_run

    data, truth = data_synth.synthetic_dataset(
        sz["profile"], n_features=sz["n_features"], duration_scale=float(scale), n_factors=sz["n_factors"], seed=seed
    )
    if layout == "runs" and scale > 1:
        data = msrm.Dataset(split_run(data.runs[0], scale))
    return data, truth


def ladder_rows(size: str, *, backends=None, info=None, progress=None) -> list[dict]:
    """Time and peak memory of value+grad per duration scale, one long run vs runs at boundaries."""
    import msrm
    from msrm.gp.memory import MemoryGuardError

    sz = SIZES[size]
    rows: list[dict] = []
    history: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for backend in backends or list(sz["scales"]):
        for layout in ("one_run", "runs"):
            for scale in sz["scales"][backend]:
                if layout == "runs" and scale == 1:
                    continue  # identical to one_run at x1
                params = dict(backend=backend, layout=layout, scale=scale, n_features=sz["n_features"],
                              K=sz["n_factors"], profile=sz["profile"])
                past = history.get((backend, layout), [])
                reason = skip_reason()
                if reason is not None:
                    rows += skipped_rows(NOTEBOOK, "value_and_grad", reason, info=info, **params)
                    continue
                if len(past) >= 2:
                    slope = fit_exponent([p[0] for p in past], [p[1] for p in past])
                    predicted = past[-1][1] * (scale / past[-1][0]) ** max(slope, 1.0)
                    if predicted * (sz["repeats"] + 2) > sz["time_budget_s"]:
                        rows.append(make_row(NOTEBOOK, "value_and_grad", "median_s", None, "s",
                                             status="not_yet_measured", info=info,
                                             reason=f"predicted {predicted:.0f} s per call exceeds this profile's "
                                                    f"budget ({sz['time_budget_s']:.0f} s for the case)", **params))
                        continue
                data, truth = _case(sz, scale, layout, backend)
                try:
                    t0 = time.perf_counter()
                    model = msrm.GPMSRM(data, truth.spec, linear_algebra=backend)
                    u = model.unconstrain(truth.params)
                    model.value_and_grad(u)
                    first = time.perf_counter() - t0
                except MemoryGuardError as exc:
                    rows.append(make_row(NOTEBOOK, "value_and_grad", "median_s", None, "s", status="refused",
                                         info=info, reason=str(exc), **params))
                    continue
                with PeakMemory() as pm:
                    med, times = warm_median(lambda: model.value_and_grad(u), repeats=sz["repeats"], warmup=0)
                history.setdefault((backend, layout), []).append((scale, med))
                n_nodes = sum(msrm.count_nodes(data, truth.spec))
                extra = dict(n_runs=len(data.runs), n_nodes=n_nodes, n_grid=int(sum(
                    msrm.latent_grid(r.duration, truth.spec).size for r in data.runs)), **params)
                rows.append(make_row(NOTEBOOK, "value_and_grad", "median_s", med, "s", info=info,
                                     samples=times, **extra))
                rows.append(make_row(NOTEBOOK, "value_and_grad", "first_call_s", first, "s", info=info, **extra))
                if pm.delta_bytes is not None:
                    rows.append(make_row(NOTEBOOK, "value_and_grad", "peak_rss_delta_bytes", pm.delta_bytes,
                                         "bytes", info=info, method=pm.method, **extra))
                if pm.device_peak_bytes is not None:
                    rows.append(make_row(NOTEBOOK, "value_and_grad", "device_peak_bytes", pm.device_peak_bytes,
                                         "bytes", info=info, **extra))
                if progress is not None:
                    progress(backend, layout, scale, med)
                del model
    for (backend, layout), past in history.items():
        if layout == "runs" and history.get((backend, "one_run")):
            past = [history[(backend, "one_run")][0]] + past  # x1 is the same case in both layouts
        if len(past) >= 2:
            scales, secs = [p[0] for p in past], [p[1] for p in past]
            rows.append(make_row(NOTEBOOK, "duration_exponent", "slope", fit_exponent(scales, secs), "",
                                 info=info, backend=backend, layout=layout, scales=scales))
    return rows


@skippable(NOTEBOOK, "restarts", (("restarts_per_min", "1/min"),))
def restart_rows(size: str, *, info=None) -> list[dict]:
    """R-MSRM restart throughput with 1 and 2 workers through loky and Dask (restarts per minute)."""
    import data_synth
    import msrm

    sz = SIZES[size]
    data, truth = data_synth.synthetic_dataset(sz["profile"], n_features=sz["restart_features"], n_factors=3)
    rows = []
    for backend, workers in sz["restart_configs"]:
        client = cluster = None
        try:
            if backend == "dask":
                from dask.distributed import Client, LocalCluster

                cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                                       dashboard_address=None)
                client = Client(cluster)
            t0 = time.perf_counter()
            fit = msrm.fit_rmsrm(data, truth.spec, restarts=sz["restarts"], max_iter=sz["restart_iter"], seed=0,
                                 n_jobs=workers, backend=backend, progress=False, client=client)
            wall = time.perf_counter() - t0
        except Exception as exc:  # recorded, never hidden
            rows.append(make_row(NOTEBOOK, "restarts", "restarts_per_min", None, "1/min", status="error", info=info,
                                 backend=backend, workers=workers, reason=f"{type(exc).__name__}: {exc}"))
            continue
        finally:
            if client is not None:
                client.close()
            if cluster is not None:
                cluster.close()
        rows.append(make_row(NOTEBOOK, "restarts", "restarts_per_min", 60.0 * sz["restarts"] / wall, "1/min",
                             info=info, backend=backend, workers=workers, restarts=sz["restarts"],
                             max_iter=sz["restart_iter"], wall_s=wall, best_objective=float(np.nanmin(fit.restarts))))
    return rows


