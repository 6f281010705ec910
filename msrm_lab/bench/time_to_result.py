r"""Time to result (notebook stem ``time_to_result``): from a ``Dataset`` to a converged GP-MAP, started from R-MSRM.

``gp_map_rows(profile)`` runs, for every case of ``SIZES[profile]``, the path a user takes:

1. ``rmsrm``: ``msrm.fit_rmsrm(data, spec, n_jobs=1, progress=False, **sizes["rmsrm"])`` (one restart: the MAP
   only needs a start);
2. ``build``: ``msrm.GPMSRM(data, spec, linear_algebra=case["linear_algebra"])`` (the backend's NumPy preparation
   and the jitted closures, nothing compiled yet);
3. ``first_evaluation``: the first ``value_and_grad`` inside ``fit_map``, which compiles it;
4. ``optimiser``: L-BFGS-B from the R-MSRM fit (``fit_map(model, init=rfit)``, its lags and widths moved just
   inside their bounds) to its stop;

and ``total`` = the sum. The data are ``data_synth.synthetic_dataset(profile=..., n_features=..., n_runs=1,
n_factors=K, seed=0, duration_scale=...)``; making them is not timed (a user starts from a loaded ``Dataset``).

**Repeats.** ``repeats`` per case, each in a fresh process when ``isolate`` (compilation and JAX's caches start
cold every time, as for a user's new session; the persistent compilation cache is whatever
``msrm.runtime.compilation_cache()`` says, recorded in the rows); the value of a row is the median over the
repeats, with ``min``, ``max`` and every value in its params.

**Rows** (``msrm_lab.bench.rows.make_row``, notebook ``time_to_result``, experiment ``gp_map``, status
``measured``), one per (case, metric), params ``profile, case, data_profile, n_features, K, duration_scale,
linear_algebra, target_s, repeats, min, max, values, maxiter, num_params, n_observed``, the case's ``fit_map``
settings (``map_settings``: the profile's, overridden by the case's ``map`` entries; ``maxcor``, L-BFGS-B's stored
correction pairs, ``None`` for SciPy's default of 10) and the 1-minute load
average at the end of each repeat (``loadavg_1min_after``):

- ``rmsrm_s``, ``build_s``, ``first_evaluation_s``, ``optimiser_s``, ``total_s`` (s);
- ``iterations``, ``function_evaluations``, ``seconds_per_evaluation`` (s, the evaluations after the first, which
  compiles), ``grad_norm`` (Euclidean norm of
  the final gradient of the log density in ``u``), ``projected_grad_max_abs`` (its sup norm, what ``gtol`` is
  compared with), ``log_density``;
- ``converged`` (1 if every repeat's optimiser reported success), ``met_target`` (1 if the median total is under
  ``target_s`` and every repeat converged).

A case whose optimiser is capped (``maxiter`` in the case, for a run that would not fit a benchmark's time) says
so in params ``capped``; it cannot converge within the cap, and its ``seconds_per_evaluation`` is the figure to
read. A case that fails gives one ``error`` row with the reason.
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Any

from msrm_lab.budget import skip_reason, skipped_rows
from .rows import make_row

__all__ = ["NOTEBOOK", "SIZES", "case_map_settings", "gp_map_rows", "time_case"]

NOTEBOOK = "time_to_result"
EXPERIMENT = "gp_map"

_RMSRM = dict(restarts=1)
_MAP: dict[str, Any] = dict(maxiter=1000)
# L-BFGS-B keeping 20 correction pairs instead of SciPy's 10: on these posteriors it stops in fewer iterations at a
# log density within about a nat of the default's. Each note case with it has a twin with SciPy's default
# (``map=dict(maxcor=None)``), run beside it, so the rows show what the setting buys and what it costs.
_MAP_NOTE: dict[str, Any] = dict(maxiter=1000, maxcor=20)
_SCIPY_MEMORY = dict(maxcor=None)

SIZES: dict[str, dict[str, Any]] = {
    "smoke": dict(repeats=1, isolate=False, rmsrm=dict(restarts=1, max_iter=20), map=dict(maxiter=100), cases=[
        dict(case="tiny_K1_state_space", data_profile="tiny", n_features=4, K=1, duration_scale=1.0,
             linear_algebra="state_space", target_s=60.0),
    ]),
    # one-eighth design at a tenth of its features and a quarter of its length: minutes here, both backends
    "quick": dict(repeats=1, isolate=True, rmsrm=_RMSRM, map=_MAP, cases=[
        dict(case="eighth_K3_F360_quarter_state_space", data_profile="one-eighth", n_features=360, K=3,
             duration_scale=0.25, linear_algebra="state_space", target_s=60.0),
        dict(case="eighth_K3_F360_quarter_grouped", data_profile="one-eighth", n_features=360, K=3,
             duration_scale=0.25, linear_algebra="grouped", target_s=60.0),
    ]),
    # the targets: 60 s at one-eighth, K = 3, 3,600 features, both backends run to convergence (grouped beside the
    # state space, once per process: its evaluations cost several times more); 5 min at 8x length, K = 5 (state
    # space only: the grouped factorization of that many nodes does not fit memory)
    "note": dict(repeats=3, isolate=True, rmsrm=_RMSRM, map=_MAP_NOTE, cases=[
        dict(case="eighth_K3_F3600_state_space", data_profile="one-eighth", n_features=3600, K=3,
             duration_scale=1.0, linear_algebra="state_space", target_s=60.0),
        dict(case="eighth_K3_F3600_state_space_scipy_maxcor", data_profile="one-eighth", n_features=3600, K=3,
             duration_scale=1.0, linear_algebra="state_space", target_s=60.0, map=_SCIPY_MEMORY),
        dict(case="eighth_K3_F3600_grouped", data_profile="one-eighth", n_features=3600, K=3,
             duration_scale=1.0, linear_algebra="grouped", target_s=60.0, repeats=1),
        dict(case="eighth_8x_K5_F3600_state_space", data_profile="one-eighth", n_features=3600, K=5,
             duration_scale=8.0, linear_algebra="state_space", target_s=300.0, repeats=1),
        dict(case="eighth_8x_K5_F3600_state_space_scipy_maxcor", data_profile="one-eighth", n_features=3600,
             K=5, duration_scale=8.0, linear_algebra="state_space", target_s=300.0, repeats=1,
             map=_SCIPY_MEMORY),
    ]),
}
SIZES["full"] = SIZES["note"]

TIME_METRICS = ("rmsrm_s", "build_s", "first_evaluation_s", "optimiser_s", "total_s")
FIT_METRICS = ("iterations", "function_evaluations", "seconds_per_evaluation", "grad_norm",
               "projected_grad_max_abs", "log_density")
_UNITS = {"iterations": "count", "function_evaluations": "count", "log_density": "nats", "grad_norm": "1",
          "projected_grad_max_abs": "1", "converged": "bool", "met_target": "bool"}


def case_map_settings(case: dict, map_settings: dict) -> dict[str, Any]:
    """The ``fit_map`` settings of a case: the profile's, then the case's own ``map`` entries (``None`` meaning
    SciPy's default), then the case's ``maxiter`` cap."""
    settings = {**map_settings, **case.get("map", {})}
    if "maxiter" in case:
        settings["maxiter"] = case["maxiter"]
    return settings


def time_case(case: dict, rmsrm: dict, map_settings: dict) -> dict[str, Any]:
    """One timed run of a case in this process: the phase walls, the fit's diagnostics and sizes (a dict of
    plain numbers, so it crosses a process boundary)."""
    import data_synth
    import msrm

    msrm.runtime.enable_x64()
    data, truth = data_synth.synthetic_dataset(profile=case["data_profile"], n_features=case["n_features"],
                                               n_runs=1, n_factors=case["K"], seed=0,
                                               duration_scale=case["duration_scale"])
    spec = truth.spec
    t0 = time.perf_counter()
    rfit = msrm.fit_rmsrm(data, spec, seed=0, n_jobs=1, progress=False, **rmsrm)
    t1 = time.perf_counter()
    model = msrm.GPMSRM(data, spec, linear_algebra=case["linear_algebra"])
    t2 = time.perf_counter()
    settings = case_map_settings(case, map_settings)
    fit = model.fit_map(init=rfit, seed=0, progress=False, **settings)
    t3 = time.perf_counter()
    d = fit.diagnostics
    phases = d["phase_seconds"]
    return {
        "rmsrm_s": t1 - t0, "build_s": t2 - t1,
        "first_evaluation_s": phases["first_evaluation"], "optimiser_s": (t3 - t2) - phases["first_evaluation"],
        "total_s": t3 - t0,
        "iterations": d["iterations"], "function_evaluations": d["function_evaluations"],
        "seconds_per_evaluation": d["seconds_per_warm_evaluation"], "grad_norm": d["grad_norm"],
        "projected_grad_max_abs": d["projected_grad_max_abs"], "log_density": fit.log_density,
        "converged": bool(fit.converged), "message": d["message"], "maxiter": settings.get("maxiter"),
        "rmsrm_iterations": int(rfit.n_iter), "rmsrm_converged": bool(rfit.converged),
        "num_params": int(model.num_params), "n_observed": int(data.n_observed),
        "history_length": int(len(fit.history)),
        "loadavg_1min": os.getloadavg()[0],
    }


def _run_isolated(case: dict, rmsrm: dict, map_settings: dict) -> dict[str, Any]:
    """:func:`time_case` in a fresh (spawned) process."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(time_case, case, rmsrm, map_settings).result()


def _case_rows(profile: str, case: dict, runs: list[dict], sz: dict, info: dict) -> list[dict]:
    """Rows of one case from its repeats (median value; min, max and every value in params)."""
    first = runs[0]
    common = dict(profile=profile, case=case["case"], data_profile=case["data_profile"],
                  n_features=case["n_features"], K=case["K"], duration_scale=case["duration_scale"],
                  linear_algebra=case["linear_algebra"], target_s=case["target_s"], repeats=len(runs),
                  maxiter=first["maxiter"], capped="maxiter" in case, num_params=first["num_params"],
                  n_observed=first["n_observed"], rmsrm_settings=dict(sz["rmsrm"]),
                  map_settings=case_map_settings(case, sz["map"]),
                  maxcor=case_map_settings(case, sz["map"]).get("maxcor"), messages=[r["message"] for r in runs],
                  rmsrm_iterations=[r["rmsrm_iterations"] for r in runs],
                  loadavg_1min_after=[r["loadavg_1min"] for r in runs])
    rows = []
    for metric in TIME_METRICS + FIT_METRICS:
        values = [float(r[metric]) for r in runs]
        rows.append(make_row(NOTEBOOK, EXPERIMENT, metric, statistics.median(values), _UNITS.get(metric, "s"),
                             info=info, min=min(values), max=max(values), values=values, **common))
    converged = all(r["converged"] for r in runs)
    total = statistics.median(float(r["total_s"]) for r in runs)
    rows.append(make_row(NOTEBOOK, EXPERIMENT, "converged", float(converged), "bool", info=info,
                         values=[r["converged"] for r in runs], **common))
    rows.append(make_row(NOTEBOOK, EXPERIMENT, "met_target", float(converged and total < case["target_s"]),
                         "bool", info=info, **common))
    return rows


def gp_map_rows(profile: str = "quick", *, info: dict | None = None) -> list[dict]:
    """Rows of every case of ``SIZES[profile]`` (module docstring).

    Args:
        profile: a key of :data:`SIZES`.
        info: ``execution_info()`` for the rows (computed here if omitted).
    Raises:
        ValueError: an unknown profile.
    """
    if profile not in SIZES:
        raise ValueError(f"profile must be one of {sorted(SIZES)}, got {profile!r}")
    from msrm.runtime import compilation_cache
    from msrm_lab.provenance import execution_info

    info = info if info is not None else execution_info(include_jax=True)
    sz = SIZES[profile]
    rows: list[dict] = []
    for i, case in enumerate(sz["cases"]):
        reason = skip_reason() if i else None  # the first case always runs
        if reason is not None:
            rows += skipped_rows(NOTEBOOK, EXPERIMENT, reason, info=info, metrics=(("total_s", "s"),),
                                 profile=profile, case=case["case"], linear_algebra=case["linear_algebra"],
                                 target_s=case["target_s"])
            continue
        repeats = int(case.get("repeats", sz["repeats"]))
        runs = []
        try:
            for _ in range(repeats):
                if sz["isolate"]:
                    runs.append(_run_isolated(case, sz["rmsrm"], sz["map"]))
                else:
                    runs.append(time_case(case, sz["rmsrm"], sz["map"]))
        except Exception as exc:  # noqa: BLE001  (a failing case gives a row; the others still run)
            rows.append(make_row(NOTEBOOK, EXPERIMENT, "total_s", None, "s", status="error", info=info,
                                 profile=profile, case=case["case"], linear_algebra=case["linear_algebra"],
                                 target_s=case["target_s"], repeats_done=len(runs),
                                 reason=f"{type(exc).__name__}: {exc}"))
            continue
        rows.extend(_case_rows(profile, case, runs, sz, info))
    for r in rows:
        r["params"]["compilation_cache"] = compilation_cache()
    return rows
