"""R-MSRM benchmarks (notebook stem ``rmsrm``): where one alternating iteration spends its time, what residual
reuse and the banded latent solve buy, the cost of a 100-iteration restart, and growth with recording length.

Experiments (each returns results rows, ``msrm_lab.bench.rows.make_row``):

- ``phase_profile``: one restart for three alternating iterations under cProfile at each length of the profile
  (the note's two cases: one-eighth and twice its length): per-phase seconds per iteration, the one-time
  preparation, and per-call times of the dense reconstruction residual, the sufficient statistics that replace it,
  response-operator construction and the latent solve.
- ``ablation``: the same iterations side by side in one process for reuse/dense objective x banded/SuperLU latent
  solver, seconds per iteration (median over iterations after the first), and the dense+SuperLU / reuse+banded
  ratio. The four paths must reach the same objective (the relative spread is recorded).
- ``restart``: one restart of exactly ``restart_iter`` iterations (tolerance off), wall seconds and peak memory.
- ``growth``: seconds per iteration at lengths x1, x2, x4 and the fitted log-log slope (1 = linear).

Everything is NumPy/SciPy (no JAX); timers are wall-clock ``perf_counter``; peak memory is the process's
high-water mark (``measure.PeakMemory``).
"""
from __future__ import annotations

import cProfile
import pstats
import time

import numpy as np

import data_synth

from msrm.rmsrm import convention
from msrm.rmsrm.fit import PHASES, fit_restart, initial_signal
from msrm.rmsrm.loadings import residual_sum_squares
from msrm.rmsrm.objective import compute_stats, slot_latents
from msrm.rmsrm.prepare import default_roughness, prepare_rmsrm
from .measure import PeakMemory, warm_median
from msrm_lab.budget import skip_reason, skippable, skipped_rows
from .rows import make_row

__all__ = ["SIZES", "NOTEBOOK", "prepare_case", "phase_profile_rows", "ablation_rows", "restart_rows",
           "growth_rows", "all_rows"]

NOTEBOOK = "rmsrm"

SIZES = {
    "smoke": dict(profile="tiny", n_features=8, profile_scales=(1.0,), iterations=3, ablation_iter=3,
                  restart_iter=10, growth_scales=(1.0, 2.0), growth_iter=3),
    "quick": dict(profile="one-eighth", n_features=360, profile_scales=(1.0, 2.0), iterations=3, ablation_iter=3,
                  restart_iter=100, growth_scales=(1.0, 2.0, 4.0), growth_iter=4),
    "note": dict(profile="one-eighth", n_features=3600, profile_scales=(1.0, 2.0), iterations=3, ablation_iter=3,
                 restart_iter=100, growth_scales=(1.0, 2.0, 4.0), growth_iter=4),
}
SIZES["full"] = SIZES["note"]

# Functions whose per-call times the phase profile reports: (label, module suffix, function name).
PROFILED = (
    ("sufficient statistics (reuse)", "rmsrm/objective.py", "compute_stats"),
    ("response operator (window weights)", "msrm/operators.py", "window_weights"),
    ("latent block assembly", "rmsrm/latent.py", "latent_blocks"),
    ("latent banded solve", "rmsrm/latent.py", "solve_latent_banded"),
    ("loadings solve", "rmsrm/loadings.py", "update_loadings"),
    ("response objective + gradient (reuse)", "rmsrm/objective.py", "theta_value_and_grad_reuse"),
)


def _size(profile: str) -> dict:
    if profile not in SIZES:
        raise ValueError(f"profile must be one of {sorted(SIZES)}, got {profile!r}")
    return SIZES[profile]


def prepare_case(profile: str, scale: float = 1.0, seed: int = 0):
    """(data, spec, prep, base latents, seconds of one-time preparation) for one benchmark case."""
    sz = _size(profile)
    data, truth = data_synth.synthetic_dataset(sz["profile"], n_features=sz["n_features"], duration_scale=scale,
                                               seed=seed)
    t0 = time.perf_counter()
    prep = prepare_rmsrm(data, truth.spec)
    base = convention.pca_init(prep)
    prep = prep._replace(roughness=default_roughness(truth.spec, initial_signal(prep, base)))  # as fit_rmsrm
    prep_s = time.perf_counter() - t0
    return data, truth.spec, prep, base, prep_s


def _run(prep, base, iters: int, objective="reuse", solver="banded"):
    # the cost of one alternating iteration (the four block steps); the one-off marginal step that follows the
    # joint phase in fit_rmsrm is timed end to end by the recovery benchmark's wall seconds
    return fit_restart(prep, base, {"seed": 0, "restart": 0}, max_iter=iters, tol=-1.0, objective=objective,
                       latent_solver=solver, response_objective="joint")


def _per_iter(res) -> float:
    total = sum(res.timings[p] for p in PHASES)
    return float(np.median(total[1:] if total.size > 1 else total))


def _params(profile, prep, scale, **kw):
    sz = _size(profile)
    J = prep.runs[0].grid.size
    n_obs = int(sum(c.sum() for c in prep.count.values()))
    return dict(profile=profile, n_features=sz["n_features"], scale=scale, K=prep.n_factors, grid_points=J,
                n_observed=n_obs, **kw)


def phase_profile_rows(profile: str, *, info=None) -> list[dict]:
    """cProfile-backed phase table of three iterations at each length of the profile."""
    sz = _size(profile)
    rows = []
    for scale in sz["profile_scales"]:
        data, spec, prep, base, prep_s = prepare_case(profile, scale)
        p = _params(profile, prep, scale)
        rows.append(make_row(NOTEBOOK, "phase_profile", "prepare_s", prep_s, "s", info=info, phase="prepare", **p))
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        res = _run(prep, base, sz["iterations"])
        prof.disable()
        wall = time.perf_counter() - t0
        rows.append(make_row(NOTEBOOK, "phase_profile", "wall_s", wall, "s", info=info, phase="all iterations",
                             iterations=res.n_iter, **p))
        for phase in PHASES:
            rows.append(make_row(NOTEBOOK, "phase_profile", "s_per_iter", float(np.median(res.timings[phase])), "s",
                                 info=info, phase=phase, iterations=res.n_iter, **p))
        stats = pstats.Stats(prof).stats
        for label, mod, name in PROFILED:
            hits = [(v[1], v[3]) for (f, _, fn), v in stats.items() if fn == name and f.endswith(mod)]
            calls = sum(h[0] for h in hits)
            cum = sum(h[1] for h in hits)
            if calls:
                rows.append(make_row(NOTEBOOK, "phase_profile", "per_call_ms", 1e3 * cum / calls, "ms", info=info,
                                     phase=label, calls=int(calls), iterations=res.n_iter, **p))
        # the dense reconstruction residual (the note's largest single operation), timed per call
        state = res.state
        latents = slot_latents(prep, state)
        med, _ = warm_median(lambda: residual_sum_squares(prep, state, latents), repeats=5)
        rows.append(make_row(NOTEBOOK, "phase_profile", "per_call_ms", 1e3 * med, "ms", info=info,
                             phase="dense reconstruction residual", calls=5, **p))
        med, _ = warm_median(lambda: compute_stats(prep, state), repeats=5)
        rows.append(make_row(NOTEBOOK, "phase_profile", "per_call_ms", 1e3 * med, "ms", info=info,
                             phase="sufficient statistics (timed)", calls=5, **p))
    return rows


@skippable(NOTEBOOK, "ablation", (("s_per_iter", "s"),))
def ablation_rows(profile: str, *, info=None) -> list[dict]:
    """reuse/dense x banded/SuperLU, side by side in this process on the same case and start."""
    sz = _size(profile)
    data, spec, prep, base, _ = prepare_case(profile, 1.0)
    p = _params(profile, prep, 1.0)
    rows, per, finals = [], {}, {}
    for objective in ("reuse", "dense"):
        for solver in ("banded", "superlu"):
            res = _run(prep, base, sz["ablation_iter"], objective, solver)
            per[(objective, solver)] = _per_iter(res)
            finals[(objective, solver)] = float(res.objective_history[-1])
            rows_p = dict(objective=objective, latent_solver=solver, iterations=res.n_iter, **p)
            rows_p["latent_s_per_iter"] = float(np.median(res.timings["latent"]))
            rows_p["response_s_per_iter"] = float(np.median(res.timings["response"]))
            rows.append(make_row(NOTEBOOK, "ablation", "s_per_iter", per[(objective, solver)], "s", info=info,
                                 final_objective=finals[(objective, solver)], **rows_p))
    ratio = per[("dense", "superlu")] / per[("reuse", "banded")]
    rows.append(make_row(NOTEBOOK, "ablation", "speedup", ratio, "x", info=info,
                         comparison="dense+superlu / reuse+banded", target=5.0, **p))
    vals = np.array(list(finals.values()))
    rows.append(make_row(NOTEBOOK, "ablation", "objective_rel_spread", float(np.ptp(vals) / abs(vals.mean())), "1",
                         info=info, comparison="final objective over the four paths", **p))
    return rows


@skippable(NOTEBOOK, "restart", (("wall_s", "s"),))
def restart_rows(profile: str, *, info=None) -> list[dict]:
    """One restart of exactly restart_iter iterations (reuse + banded)."""
    sz = _size(profile)
    data, spec, prep, base, prep_s = prepare_case(profile, 1.0)
    p = _params(profile, prep, 1.0, iterations=sz["restart_iter"])
    with PeakMemory() as mem:
        t0 = time.perf_counter()
        res = _run(prep, base, sz["restart_iter"])
        wall = time.perf_counter() - t0
    rows = [make_row(NOTEBOOK, "restart", "wall_s", wall, "s", info=info, target_s=20.0, prepare_s=prep_s, **p),
            make_row(NOTEBOOK, "restart", "s_per_iter", wall / res.n_iter, "s", info=info, **p)]
    if mem.delta_bytes is not None:
        rows.append(make_row(NOTEBOOK, "restart", "peak_rss_delta", float(mem.delta_bytes), "bytes", info=info,
                             method=mem.method, **p))
    return rows


@skippable(NOTEBOOK, "growth", (("s_per_iter", "s"),))
def growth_rows(profile: str, *, info=None) -> list[dict]:
    """Seconds per iteration against recording length, and the log-log slope."""
    sz = _size(profile)
    rows, xs, ys = [], [], []
    for scale in sz["growth_scales"]:
        data, spec, prep, base, _ = prepare_case(profile, scale)
        res = _run(prep, base, sz["growth_iter"])
        s = _per_iter(res)
        xs.append(scale)
        ys.append(s)
        rows.append(make_row(NOTEBOOK, "growth", "s_per_iter", s, "s", info=info, iterations=res.n_iter,
                             **_params(profile, prep, scale)))
    if len(xs) > 1:
        slope = float(np.polyfit(np.log(xs), np.log(ys), 1)[0])
        rows.append(make_row(NOTEBOOK, "growth", "loglog_slope", slope, "1", info=info, profile=profile,
                             n_features=sz["n_features"], scales=list(xs)))
    return rows


def all_rows(profile: str, *, info=None) -> list[dict]:
    """Every R-MSRM experiment for one profile."""
    return (phase_profile_rows(profile, info=info) + ablation_rows(profile, info=info)
            + restart_rows(profile, info=info) + growth_rows(profile, info=info))
