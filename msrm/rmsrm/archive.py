"""R-MSRM fit archives: one ``.npz`` written atomically (msrm.atomic), read without pickle.

Entries: ``latents/<r>`` (J, K) per run; ``params/<name>`` from ``Params.flatten``; ``objective_history``;
``step_objectives``; ``restarts``; ``timings/<phase>``; and ``meta``, a JSON text (format, spec via
``ModelSpec.to_dict``, execution_info, settings, roughness, converged, n_iter, restart errors and seeds,
diagnostics). Loading checks the format tag, that every entry is present with the shapes the spec and the
latents imply, and that the parameters are finite; it raises ValueError naming what is wrong.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .. import atomic
from ..params import Params
from ..spec import ModelSpec

__all__ = ["save_rfit", "load_rfit", "FORMAT"]

FORMAT = "msrm.rfit/1"


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
    }
    arrays["meta"] = np.array(json.dumps(meta, sort_keys=True, default=atomic._json_default))
    atomic.write_npz(path, arrays)


def load_rfit(path):
    """Read an archive written by ``RFit.save``; validate it; return an RFit."""
    from .fit import PHASES, RFit

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
    )
