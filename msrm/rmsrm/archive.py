"""The R-MSRM fit result (:class:`RFit`) and its archive: one ``.npz`` written atomically (msrm.atomic), read
without pickle.

The result type and its on-disk form live together so that the driver (fit.py) imports this module and nothing
here imports the driver.

Entries: ``latents/<r>`` (J, K) per run; ``params/<name>`` from ``Params.flatten``; ``objective_history``;
``step_objectives``; ``restarts``; ``timings/<phase>``; and ``meta``, a JSON text (format, spec via
``ModelSpec.to_dict``, execution_info, settings, roughness, converged, n_iter, restart errors and seeds,
diagnostics). Loading checks the format tag, that every entry is present with the shapes the spec and the
latents imply, and that the parameters are finite; it raises ValueError naming what is wrong.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import atomic
from ..params import Params
from ..spec import ModelSpec

__all__ = ["RFit", "PHASES", "save_rfit", "load_rfit", "FORMAT"]

FORMAT = "msrm.rfit/1"
# Timed phases of one iteration (the keys of RFit.timings): the four block steps and the objective evaluations.
PHASES = ("latent", "loadings", "noise", "response", "objective")


@dataclass(frozen=True, eq=False)
class RFit:
    """The best restart of an R-MSRM fit.

    Fields:
        latents: list over runs of (J, K) latents on each run's grid (canonical convention, convention.py).
        params: msrm.Params (loadings, intercepts, noise_sd, response theta); ``lengthscales`` holds the
            half-correlation estimate of ``convention.estimate_lengthscales`` (R-MSRM has no GP prior).
        objective_history: (n_iter + 1,) J at the start and after each iteration.
        step_objectives: (n_iter, 4) J after the latent, loadings, noise and response steps of each iteration.
        converged: True if the relative decrease fell below tol before max_iter.
        n_iter: iterations run.
        timings: phase -> (n_iter,) seconds per iteration; phases ``PHASES``.
        restarts: (restarts,) J of each restart at the end of its joint phase (the restarts share lambda there;
            the lowest wins), NaN for a restart that failed.
        restart_errors: per restart, the traceback text of its failure or None.
        restart_seeds: per restart, the seed description ``{"seed": s, "restart": i}``.
        execution_info: ``msrm.runtime.execution_info()`` of the process that ran the fit.
        spec: the ModelSpec.
        roughness: lambda of the returned latents (the marginal step's, when there was one).
        settings: the fit's arguments (objective, latent_solver, response_objective, max_iter, tol, seed,
            restarts, backend, n_jobs).
        diagnostics: events worth knowing (ridge fallbacks in the latent solve), never silent.
        marginal: what the marginal step did (theta and lambda before and after it, the criterion, evaluations,
            seconds; fit.py), or None (``response_objective="joint"``).
    """

    latents: list
    params: Params
    objective_history: np.ndarray
    step_objectives: np.ndarray
    converged: bool
    n_iter: int
    timings: dict
    restarts: np.ndarray
    restart_errors: list
    restart_seeds: list
    execution_info: dict
    spec: ModelSpec
    roughness: float
    settings: dict = field(default_factory=dict)
    diagnostics: list = field(default_factory=list)
    marginal: dict | None = None

    @property
    def objective(self) -> float:
        """Final J of the best restart."""
        return float(self.objective_history[-1])

    @property
    def best_restart(self) -> int:
        return int(np.nanargmin(self.restarts))

    def predict(self, data, latents=None) -> list:
        """Fitted means ``b + W x(t)`` of every stream at every sample of ``data``, per run
        (:func:`msrm.rmsrm.predict.predict`): ``{"participant/modality": msrm.Prediction}`` with sd the fitted
        noise sd and signal_sd None (a point estimate). ``data`` is the fit's data (held-out NaN values are
        predicted), or new runs with ``latents=msrm.rmsrm.project(self, data)``."""
        from .predict import predict

        return predict(self, data, latents)

    def save(self, path) -> None:
        """Write an atomic ``.npz`` archive (arrays + a JSON entry; loaded by ``msrm.rmsrm.load_rfit``)."""
        save_rfit(self, path)


def save_rfit(fit, path) -> None:
    """Write ``fit`` (an RFit) to ``path`` (``.npz``) atomically."""
    arrays: dict[str, np.ndarray] = {}
    for r, z in enumerate(fit.latents):
        arrays[f"latents/{r}"] = np.asarray(z, dtype=np.float64)
    for name, v in fit.params.flatten().items():
        arrays[f"params/{name}"] = np.asarray(v, dtype=np.float64)
    arrays["objective_history"] = np.asarray(fit.objective_history, dtype=np.float64)
    arrays["step_objectives"] = np.asarray(fit.step_objectives, dtype=np.float64).reshape(-1, 4)
    arrays["restarts"] = np.asarray(fit.restarts, dtype=np.float64)
    for phase, v in fit.timings.items():
        arrays[f"timings/{phase}"] = np.asarray(v, dtype=np.float64)
    meta = {
        "format": FORMAT,
        "spec": fit.spec.to_dict(),
        "execution_info": fit.execution_info,
        "settings": fit.settings,
        "roughness": float(fit.roughness),
        "converged": bool(fit.converged),
        "n_iter": int(fit.n_iter),
        "n_runs": len(fit.latents),
        "restart_errors": list(fit.restart_errors),
        "restart_seeds": list(fit.restart_seeds),
        "diagnostics": list(fit.diagnostics),
        "marginal": fit.marginal,
    }
    arrays["meta"] = np.array(json.dumps(meta, sort_keys=True, default=atomic.json_default))
    atomic.write_npz(path, arrays)


def load_rfit(path):
    """Read an archive written by ``RFit.save``; validate it; return an RFit."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"load_rfit: no archive at {str(path)!r}")
    try:
        arrays = atomic.read_npz(path)
    except Exception as err:  # noqa: BLE001 - any unreadable file is a bad archive
        raise ValueError(f"load_rfit: {str(path)!r} is not a readable .npz archive ({err})") from None
    if "meta" not in arrays:
        raise ValueError(f"load_rfit: {str(path)!r} has no 'meta' entry (not an R-MSRM archive)")
    try:
        meta = json.loads(str(arrays["meta"]))
    except json.JSONDecodeError as err:
        raise ValueError(f"load_rfit: 'meta' is not valid JSON ({err})") from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"load_rfit: archive format {meta.get('format')!r}, expected {FORMAT!r}")
    spec = ModelSpec.from_dict(meta["spec"])
    K = spec.n_factors
    n_runs = int(meta["n_runs"])
    latents = []
    for r in range(n_runs):
        z = arrays.get(f"latents/{r}")
        if z is None:
            raise ValueError(f"load_rfit: missing entry 'latents/{r}'")
        if z.ndim != 2 or z.shape[1] != K or not np.isfinite(z).all():
            raise ValueError(f"load_rfit: 'latents/{r}' must be finite (J, {K}), got shape {z.shape}")
        latents.append(z)
    flat = {k[len("params/"):]: v for k, v in arrays.items() if k.startswith("params/")}
    params = Params.unflatten(flat)
    for key, W in params.loadings.items():
        F = W.shape[0]
        if W.ndim != 2 or W.shape[1] != K:
            raise ValueError(f"load_rfit: loadings[{key!r}] shape {W.shape}, expected (n_features, {K})")
        for name in ("intercepts", "noise_sd"):
            v = getattr(params, name).get(key)
            if v is None or v.shape != (F,):
                raise ValueError(f"load_rfit: {name}[{key!r}] missing or not of shape ({F},)")
        for name, arr in (("loadings", W), ("intercepts", params.intercepts[key]), ("noise_sd", params.noise_sd[key])):
            if not np.isfinite(arr).all():
                raise ValueError(f"load_rfit: {name}[{key!r}] contains non-finite values")
        if (params.noise_sd[key] <= 0).any():
            raise ValueError(f"load_rfit: noise_sd[{key!r}] must be > 0")
    if set(params.intercepts) != set(params.loadings) or set(params.noise_sd) != set(params.loadings):
        raise ValueError("load_rfit: loadings, intercepts and noise_sd have different stream keys")
    for key, theta in params.response.items():
        modality = key.split("/")[-1]
        spec.response(modality).check_theta(theta, where=f"load_rfit: response[{key!r}]")
    for name in ("objective_history", "step_objectives", "restarts"):
        if name not in arrays:
            raise ValueError(f"load_rfit: missing entry {name!r}")
    timings = {}
    for phase in PHASES:
        if f"timings/{phase}" not in arrays:
            raise ValueError(f"load_rfit: missing entry 'timings/{phase}'")
        timings[phase] = arrays[f"timings/{phase}"]
    return RFit(
        latents=latents,
        params=params,
        objective_history=arrays["objective_history"],
        step_objectives=arrays["step_objectives"],
        converged=bool(meta["converged"]),
        n_iter=int(meta["n_iter"]),
        timings=timings,
        restarts=arrays["restarts"],
        restart_errors=list(meta["restart_errors"]),
        restart_seeds=list(meta["restart_seeds"]),
        execution_info=meta["execution_info"],
        spec=spec,
        roughness=float(meta["roughness"]),
        settings=dict(meta["settings"]),
        diagnostics=list(meta.get("diagnostics", [])),
        marginal=meta.get("marginal"),
    )
