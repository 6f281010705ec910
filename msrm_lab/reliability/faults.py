"""Numerical fault injection: each fault is either recovered (and recorded) or refused with a clear error.

A fault *fails* when it produces a silent non-finite objective or gradient, or an unexplained exception.
Every function here returns one record ``{"area", "name", "outcome", "detail"}`` with ``outcome`` in
``"recovered"``, ``"refused"`` or ``"failed"``.
"""
from __future__ import annotations

import functools
import traceback
from typing import Callable

import numpy as np

__all__ = ["FAULTS", "run_faults"]


def _tiny(**kw):
    import data_synth

    base = dict(n_features=3, seed=0)
    base.update(kw)
    return data_synth.synthetic_dataset("tiny", **base)


def _finite_vg(model, u) -> tuple[bool, str]:
    value, grad = model.value_and_grad(u)
    ok = bool(np.isfinite(value) and np.isfinite(grad).all())
    return ok, f"value={value:.6g}, finite gradient={bool(np.isfinite(grad).all())}, events={model.guard_events()}"


@functools.lru_cache(maxsize=None)
def _tiny_model(backend: str):
    import msrm

    data, truth = _tiny()
    return msrm.GPMSRM(data, truth.spec, linear_algebra=backend), truth.params


def _gp(backend: str, params_change: Callable | None = None):
    """The tiny model of ``backend`` (compiled once per process) and its true params, optionally changed."""
    model, params = _tiny_model(backend)
    return model, (params if params_change is None else params_change(params))


def gp_huge_lengthscales(backend: str = "grouped") -> dict:
    model, params = _gp(backend, lambda p: p.replace(lengthscales=np.full_like(p.lengthscales, 1e6)))
    ok, detail = _finite_vg(model, model.unconstrain(params))
    return {"outcome": "recovered" if ok else "failed", "detail": detail}


def gp_tiny_noise(backend: str = "grouped") -> dict:
    model, params = _gp(backend, lambda p: p.replace(noise_sd={k: np.full_like(v, 1e-5) for k, v in p.noise_sd.items()}))
    ok, detail = _finite_vg(model, model.unconstrain(params))
    return {"outcome": "recovered" if ok else "failed", "detail": detail}


def gp_huge_noise(backend: str = "grouped") -> dict:
    model, params = _gp(backend, lambda p: p.replace(noise_sd={k: np.full_like(v, 1e5) for k, v in p.noise_sd.items()}))
    ok, detail = _finite_vg(model, model.unconstrain(params))
    return {"outcome": "recovered" if ok else "failed", "detail": detail}


def _duplicate_participant(data):
    import msrm

    runs = []
    for run in data.runs:
        extra = [msrm.Stream("dup", s.modality, s.dt, s.values, s.offset) for s in run.streams if s.participant == "p1"]
        runs.append(msrm.Run(run.duration, list(run.streams) + extra))
    return msrm.Dataset(runs)


def gp_duplicated_stream(backend: str = "grouped") -> dict:
    import msrm

    data, truth = _tiny()
    data = _duplicate_participant(data)
    p = truth.params
    extra = {f: dict(getattr(p, f), **{"dup/brain": getattr(p, f)["p1/brain"]}) for f in ("loadings", "intercepts", "noise_sd")}
    params = p.replace(**extra)
    model = msrm.GPMSRM(data, truth.spec, linear_algebra=backend)
    ok, detail = _finite_vg(model, model.unconstrain(params))
    return {"outcome": "recovered" if ok else "failed", "detail": detail}


def gp_nan_parameter(backend: str = "grouped") -> dict:
    model, params = _gp(backend)
    u = model.unconstrain(params)
    u[0] = np.nan
    try:
        model.value_and_grad(u)
    except ValueError as exc:
        return {"outcome": "refused", "detail": str(exc)}
    return {"outcome": "failed", "detail": "a NaN parameter vector was evaluated without an error"}


def gp_inf_params(backend: str = "grouped") -> dict:
    model, params = _gp(backend)
    bad = params.replace(intercepts=dict(params.intercepts, **{"p1/brain": np.full(3, np.inf)}))
    try:
        model.log_likelihood(bad)
    except ValueError as exc:
        return {"outcome": "refused", "detail": str(exc)}
    return {"outcome": "failed", "detail": "infinite intercepts were accepted"}


def float32_input() -> dict:
    import msrm

    data, truth = _tiny()
    runs = [msrm.Run(r.duration, [msrm.Stream(s.participant, s.modality, s.dt, s.values.astype(np.float32), s.offset)
                                  for s in r.streams]) for r in data.runs]
    data32 = msrm.Dataset(runs)
    dtypes = {s.values.dtype.name for r in data32.runs for s in r.streams}
    model = msrm.GPMSRM(data32, truth.spec)
    value = model.log_likelihood(truth.params)
    ok = dtypes == {"float64"} and np.isfinite(value)
    return {"outcome": "recovered" if ok else "failed",
            "detail": f"float32 values stored as {sorted(dtypes)}; log likelihood {value:.6g}"}


def rmsrm_dead_stream() -> dict:
    """A stream with no signal (constant features) and more factors than the data support."""
    import msrm

    data, truth = _tiny(n_factors=2)
    runs = []
    for run in data.runs:
        streams = [msrm.Stream(s.participant, s.modality, s.dt, np.ones_like(s.values), s.offset)
                   if s.key == "p2/brain" else s for s in run.streams]
        runs.append(msrm.Run(run.duration, streams))
    spec = msrm.ModelSpec(4, truth.spec.latent_dt, responses=truth.spec.responses)
    fit = msrm.fit_rmsrm(msrm.Dataset(runs), spec, restarts=1, max_iter=10, n_jobs=1, progress=False)
    hist = np.asarray(fit.objective_history)
    ok = np.isfinite(hist).all() and all(np.isfinite(z).all() for z in fit.latents)
    return {"outcome": "recovered" if ok else "failed",
            "detail": f"final objective {hist[-1]:.6g}; latents finite={ok}"}


def map_rejects_nonfinite() -> dict:
    """A density that is NaN on part of the space: MAP treats those points as rejected and counts them."""
    model, params = _gp("grouped")
    u0 = model.unconstrain(params)

    class Holey:
        def __init__(self, inner):
            self._inner = inner

        def __getattr__(self, name):
            return getattr(self._inner, name)

        def value_and_grad(self, u):
            value, grad = self._inner.value_and_grad(u)
            if np.linalg.norm(np.asarray(u) - u0) > 0.05:
                return float("nan"), np.full_like(grad, np.nan)
            return value, grad

    from msrm.gp.map import fit_map

    res = fit_map(Holey(model), init=params, maxiter=30, progress=False)
    rejected = int(res.diagnostics["total_rejected_nonfinite"])
    ok = bool(np.isfinite(res.log_density)) and rejected > 0
    return {"outcome": "recovered" if ok else "failed",
            "detail": f"log density {res.log_density:.6g}; non-finite points rejected and counted: {rejected}"}


def guard_near_singular() -> dict:
    """A near-singular matrix given straight to the guarded factorization: jitter or fallback, recorded."""
    import jax.numpy as jnp

    from msrm.gp.linalg import quad_logdet

    rng = np.random.default_rng(0)
    B = rng.standard_normal((40, 3))
    M = B @ B.T  # rank 3 of 40: not positive definite
    quad, logdet, event = quad_logdet(jnp.asarray(M), jnp.ones(40))
    event = int(event)
    ok = event != 0 and np.isfinite(float(quad)) and np.isfinite(float(logdet))
    return {"outcome": "recovered" if ok else "failed",
            "detail": f"event code {event} (k>0 jitter rung, -1 eigenvalue fallback); logdet {float(logdet):.6g}"}


FAULTS: list[tuple[str, str, Callable[[], dict]]] = [
    ("linalg", "rank-deficient matrix into the guard", guard_near_singular),
    ("gp", "huge lengthscales (grouped)", gp_huge_lengthscales),
    ("gp", "huge lengthscales (state_space)", lambda: gp_huge_lengthscales("state_space")),
    ("gp", "tiny noise (grouped)", gp_tiny_noise),
    ("gp", "huge noise (grouped)", gp_huge_noise),
    ("gp", "tiny noise (state_space)", lambda: gp_tiny_noise("state_space")),
    ("gp", "duplicated stream (dense)", lambda: gp_duplicated_stream("dense")),
    ("gp", "duplicated stream (grouped)", gp_duplicated_stream),
    ("gp", "NaN parameter vector", gp_nan_parameter),
    ("gp", "infinite Params", gp_inf_params),
    ("data", "float32 input arrays", float32_input),
    ("rmsrm", "dead stream, excess factors", rmsrm_dead_stream),
    ("map", "non-finite density region", map_rejects_nonfinite),
]


def run_faults(faults=None) -> list[dict]:
    out = []
    for area, name, fn in faults or FAULTS:
        rec = {"area": area, "name": name}
        try:
            rec.update(fn())
        except Exception as exc:  # an unexplained exception is a failure
            rec.update(outcome="failed", detail=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
        out.append(rec)
    return out
