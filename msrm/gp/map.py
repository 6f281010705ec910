"""GP-MAP: maximise the log density over the unconstrained parameter vector with SciPy's L-BFGS-B.

The model supplies ``value_and_grad(u) -> (log p(y, u), d/du)`` through one jitted JAX function; the optimiser
minimises ``-log p``. A point where the value or the gradient is not finite is *rejected*: the optimiser is given
``+inf`` (so its line search backs off) and the rejection is counted, never hidden. ``restarts > 1`` adds
independent starts ``u0 + perturb * N(0, I)`` (seeded); the best final log density wins.

Model protocol used here: ``num_params``, ``value_and_grad``, ``constrain``, ``unconstrain``,
``initial_params(seed)``, and optionally ``guard_events()`` and ``execution_info()``.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .. import atomic

__all__ = ["fit_map", "MAPResult", "load_map", "LengthscaleProfile", "lengthscale_profile"]

GRADIENT_METHODS = ("L-BFGS-B", "BFGS", "CG", "TNC", "SLSQP", "trust-constr")


@dataclass(frozen=True)
class MAPResult:
    """Result of :func:`fit_map`.

    Fields:
        params: physical parameters at the mode (``model.constrain(u)``).
        u: (num_params,) unconstrained mode.
        log_density: log density at the mode (likelihood + priors + Jacobians).
        history: (iterations + 1,) log density after each accepted iteration of the best restart (start first).
        converged: the best restart's optimiser reported success and its gradient is finite.
        diagnostics: gradient norms, guard events, iterations, function evaluations, seconds per evaluation,
            rejected non-finite evaluations, the optimiser message, and one summary per restart.
        execution_info: where it ran (backend, devices, dtype, versions, commit).
    """

    params: Any
    u: np.ndarray
    log_density: float
    history: np.ndarray
    converged: bool
    diagnostics: dict = field(default_factory=dict)
    execution_info: dict = field(default_factory=dict)

    def save(self, path: str | Path) -> Path:
        """Write ``<stem>.npz`` (u, history, flattened params) then ``<stem>.json`` (the rest + npz checksum).

        Both writes are atomic; the JSON is written last and names the npz's SHA-256, so a reader never pairs a
        JSON with a torn or foreign npz. Returns the JSON path.
        """
        stem = _stem(path)
        arrays = {"u": np.asarray(self.u), "history": np.asarray(self.history)}
        for name, value in self.params.flatten().items():
            arrays[f"params/{name}"] = np.asarray(value)
        npz = stem.with_suffix(".npz")
        atomic.write_npz(npz, arrays)
        meta = {
            "format": "msrm.map/1",
            "log_density": float(self.log_density),
            "converged": bool(self.converged),
            "diagnostics": self.diagnostics,
            "execution_info": self.execution_info,
            "npz": npz.name,
            "npz_sha256": _sha256(npz),
        }
        out = stem.with_suffix(".json")
        atomic.write_json(out, meta)
        return out


def _stem(path: str | Path) -> Path:
    """The archive stem: ``path`` without a ``.npz`` / ``.json`` suffix."""
    p = Path(path)
    return p.with_suffix("") if p.suffix in (".npz", ".json") else p


def _sha256(path: Path) -> str:
    """Hex SHA-256 of the file's bytes."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def load_map(path: str | Path, params_cls: type | None = None) -> MAPResult:
    """Load a :class:`MAPResult` written by :meth:`MAPResult.save` (no pickle; the npz checksum is verified).

    Args:
        path: the stem, or the ``.json`` / ``.npz`` path.
        params_cls: class with ``unflatten(dict)`` for the parameters (default :class:`msrm.Params`).
    """
    stem = _stem(path)
    meta_path = stem.with_suffix(".json")
    if not meta_path.exists():
        raise FileNotFoundError(f"MAP archive {meta_path} not found")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != "msrm.map/1":
        raise ValueError(f"{meta_path}: not an msrm MAP archive (format {meta.get('format')!r})")
    npz = meta_path.with_name(meta["npz"])
    if _sha256(npz) != meta["npz_sha256"]:
        raise ValueError(f"{npz}: checksum does not match {meta_path.name}; the archive is inconsistent")
    arrays = atomic.read_npz(npz)
    if params_cls is None:
        from ..params import Params as params_cls
    flat = {k[len("params/"):]: v for k, v in arrays.items() if k.startswith("params/")}
    return MAPResult(
        params=params_cls.unflatten(flat),
        u=arrays["u"],
        log_density=float(meta["log_density"]),
        history=arrays["history"],
        converged=bool(meta["converged"]),
        diagnostics=meta["diagnostics"],
        execution_info=meta["execution_info"],
    )


class _Objective:
    """``-log p`` and its gradient for SciPy, counting evaluations, time and rejected non-finite points."""

    def __init__(self, model):
        self.model = model
        self.num_evaluations = 0
        self.num_rejected = 0
        self.seconds = 0.0
        self._recent: dict[bytes, float] = {}

    def log_density_at(self, u: np.ndarray) -> float:
        """The log density at an accepted iterate, from the recent evaluations (evaluated only if absent)."""
        key = np.asarray(u, dtype=np.float64).tobytes()
        if key in self._recent:
            return self._recent[key]
        f, _ = self(u)
        return -f

    def __call__(self, u: np.ndarray) -> tuple[float, np.ndarray]:
        t0 = time.perf_counter()
        value, grad = self.model.value_and_grad(u)
        grad = np.asarray(grad, dtype=np.float64)
        self.seconds += time.perf_counter() - t0
        self.num_evaluations += 1
        value = float(value)
        if len(self._recent) > 16:
            self._recent.pop(next(iter(self._recent)))
        self._recent[np.asarray(u, dtype=np.float64).tobytes()] = value
        if not (np.isfinite(value) and np.isfinite(grad).all()):
            self.num_rejected += 1
            return np.inf, np.zeros_like(grad)
        return -value, -grad


def _initial_vector(model, init, seed: int) -> np.ndarray:
    """The (num_params,) unconstrained start from ``init`` (see :func:`fit_map`), checked for shape and finiteness."""
    if init is None:
        u0 = model.unconstrain(model.initial_params(seed=seed))
    elif isinstance(init, (np.ndarray, list, tuple)):
        u0 = np.asarray(init, dtype=np.float64)
    else:
        u0 = model.unconstrain(init)
    u0 = np.asarray(u0, dtype=np.float64)
    if u0.shape != (model.num_params,):
        raise ValueError(f"init: unconstrained vector has shape {u0.shape}, expected ({model.num_params},)")
    if not np.isfinite(u0).all():
        raise ValueError("init: the starting point has non-finite unconstrained values")
    return u0


def fit_map(
    model,
    init=None,
    seed: int = 0,
    maxiter: int = 500,
    method: str = "L-BFGS-B",
    restarts: int = 1,
    progress: bool = True,
    archive: str | Path | None = None,
    *,
    perturb: float = 0.5,
    gtol: float = 1e-6,
) -> MAPResult:
    """Maximum a posteriori fit on the unconstrained vector.

    Args:
        model: a model with the GPMSRM protocol.
        init: ``None`` (``model.initial_params(seed)``), a Params-like object, or an unconstrained vector.
        seed: seeds the default start and the restart perturbations.
        maxiter: optimiser iterations per restart.
        method: ``"L-BFGS-B"`` (default) or another gradient-based ``scipy.optimize.minimize`` method
            (``"BFGS"``, ``"CG"``, ``"TNC"``, ``"SLSQP"``, ``"trust-constr"``).
        restarts: number of starts; start 0 is ``init``, start r >= 1 is ``init + perturb * N(0, I)``.
        progress: show a tqdm bar over iterations.
        archive: if given, :meth:`MAPResult.save` is called with it.
        perturb: standard deviation of the restart perturbation in unconstrained units.
        gtol: projected-gradient tolerance passed to the optimiser.
    """
    _check_fit_args(method, restarts, maxiter)
    u_init = _initial_vector(model, init, seed)
    starts = _restart_starts(u_init, restarts, perturb, seed)
    t_start = time.perf_counter()
    objective = _Objective(model)
    runs = [_run_restart(model, objective, u0, r, restarts, method, maxiter, gtol, progress)
            for r, u0 in enumerate(starts)]
    wall = time.perf_counter() - t_start
    best = max(range(len(runs)), key=lambda i: runs[i]["log_density"])
    b = runs[best]
    diagnostics = _diagnostics(model, runs, best, objective, method, wall, seed, maxiter)
    info = _execution_info(model)
    result = MAPResult(
        params=model.constrain(b["u"]),
        u=b["u"],
        log_density=b["log_density"],
        history=b["history"],
        converged=b["success"],
        diagnostics=diagnostics,
        execution_info=info,
    )
    if archive is not None:
        result.save(archive)
    return result


def _check_fit_args(method: str, restarts, maxiter) -> None:
    """Raise ValueError for a method outside GRADIENT_METHODS or a non-positive-integer restarts / maxiter."""
    if method not in GRADIENT_METHODS:
        raise ValueError(f"method must be one of {GRADIENT_METHODS}, got {method!r}")
    if not isinstance(restarts, (int, np.integer)) or restarts < 1:
        raise ValueError(f"restarts must be a positive integer, got {restarts!r}")
    if not isinstance(maxiter, (int, np.integer)) or maxiter < 1:
        raise ValueError(f"maxiter must be a positive integer, got {maxiter!r}")


def _restart_starts(u_init: np.ndarray, restarts: int, perturb: float, seed: int) -> list[np.ndarray]:
    """Start vectors: ``u_init``, then ``u_init + perturb * N(0, I)`` per further restart (``default_rng(seed)``)."""
    rng = np.random.default_rng(seed)
    return [u_init] + [u_init + perturb * rng.standard_normal(u_init.shape) for _ in range(restarts - 1)]


def _run_restart(model, objective: _Objective, u0: np.ndarray, r: int, restarts: int, method: str, maxiter: int,
                 gtol: float, progress: bool) -> dict:
    """One optimiser run from ``u0`` (restart ``r`` of ``restarts``).

    Returns the final point, its log density (-inf where value or gradient is not finite) and gradient, the log
    density history (start, then each accepted iterate), success, message, iterations, and this run's share of
    the objective's evaluation, rejection and time counters.
    """
    from scipy.optimize import minimize

    history: list[float] = []
    f0, _ = objective(u0)
    history.append(-f0)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=maxiter, desc=f"MAP restart {r + 1}/{restarts}", leave=False)

    def callback(xk, *args):
        value = objective.log_density_at(xk)
        history.append(value)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(log_density=f"{value:.6g}")

    options = {"maxiter": int(maxiter)}
    if method in ("L-BFGS-B", "BFGS", "CG", "TNC"):
        options["gtol"] = gtol
    evals0, rejected0, seconds0 = objective.num_evaluations, objective.num_rejected, objective.seconds
    res = minimize(objective, u0, jac=True, method=method, callback=callback, options=options)
    if bar is not None:
        bar.close()
    value, grad = model.value_and_grad(res.x)
    grad = np.asarray(grad, dtype=np.float64)
    finite = bool(np.isfinite(value) and np.isfinite(grad).all())
    return {
        "u": np.asarray(res.x, dtype=np.float64),
        "log_density": float(value) if finite else -np.inf,
        "grad": grad,
        "history": np.asarray(history),
        "success": bool(res.success) and finite,
        "message": str(res.message),
        "iterations": int(getattr(res, "nit", len(history) - 1)),
        "function_evaluations": objective.num_evaluations - evals0,
        "rejected_nonfinite": objective.num_rejected - rejected0,
        "seconds_in_value_and_grad": objective.seconds - seconds0,
    }


def _diagnostics(model, runs: list[dict], best: int, objective: _Objective, method: str, wall: float, seed: int,
                 maxiter: int) -> dict:
    """``MAPResult.diagnostics``: the best run's gradient norms, iterations and counts, totals over all runs,
    the model's guard events, and one summary per restart."""
    b = runs[best]
    evals = sum(r["function_evaluations"] for r in runs)
    guard = model.guard_events() if hasattr(model, "guard_events") else {}
    return {
        "grad_norm": float(np.linalg.norm(b["grad"])),
        "grad_max_abs": float(np.max(np.abs(b["grad"]))) if b["grad"].size else 0.0,
        "guard_events": guard,
        "iterations": b["iterations"],
        "function_evaluations": b["function_evaluations"],
        "total_function_evaluations": evals,
        "seconds_per_evaluation": (
            (objective.seconds / objective.num_evaluations) if objective.num_evaluations else None
        ),
        "rejected_nonfinite": b["rejected_nonfinite"],
        "total_rejected_nonfinite": objective.num_rejected,
        "message": b["message"],
        "method": method,
        "best_restart": int(best),
        "restarts": [
            {k: r[k] for k in ("log_density", "success", "message", "iterations", "function_evaluations",
                               "rejected_nonfinite")}
            for r in runs
        ],
        "wall_seconds": wall,
        "seed": int(seed),
        "maxiter": int(maxiter),
    }


def _execution_info(model) -> dict:
    """``model.execution_info()`` when the model has one that is not None, else ``msrm.runtime.execution_info()``."""
    info = model.execution_info() if hasattr(model, "execution_info") else None
    if info is None:
        from ..runtime import execution_info

        info = execution_info()
    return info


# ------------------------------------------------------------------------------------------ lengthscale profile

@dataclass(frozen=True)
class LengthscaleProfile:
    """Log density along a set of fixed lengthscale vectors (:func:`lengthscale_profile`).

    Fields:
        lengthscales: (n, K) the lengthscales held fixed, in seconds.
        log_density: (n,) log density (likelihood + priors + Jacobians) at each row.
        log_likelihood: (n,) ``log p(y | theta)`` at the same points.
        u: (n, num_params) the unconstrained points evaluated (the other entries as given or re-optimised).
        reoptimised: whether the other parameters were maximised at each row.
        converged: (n,) the optimiser's success flag per row (all True when nothing was re-optimised).
    """

    lengthscales: np.ndarray
    log_density: np.ndarray
    log_likelihood: np.ndarray
    u: np.ndarray
    reoptimised: bool
    converged: np.ndarray

    @property
    def best(self) -> int:
        """Index of the row with the largest log density."""
        return int(np.argmax(self.log_density))


def _lengthscale_block(model):
    """The ``lengthscales`` block of ``model.blocks`` (GPMSRM's parameter layout, msrm.gp.transforms)."""
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        raise ValueError("lengthscale_profile: the model has no parameter blocks (it needs a GPMSRM)")
    for b in blocks:
        if b.field == "lengthscales":
            return b
    raise ValueError("lengthscale_profile: the model has no lengthscales block")


def lengthscale_profile(model, at, lengthscales, *, reoptimise: bool = False, maxiter: int = 200,
                        gtol: float = 1e-6) -> LengthscaleProfile:
    """The log density as a function of the kernel lengthscales alone, at or around a fitted point.

    Row ``i`` sets ``log l = log lengthscales[i]`` in the unconstrained vector ``u`` of ``at`` and evaluates
    ``log p(y, u)``. With ``reoptimise=False`` every other entry stays at ``at`` (a slice through the density);
    with ``reoptimise=True`` they are maximised by L-BFGS-B with the lengthscales held fixed, each row warm-started
    from ``at`` (the profile density ``max_rest log p(y, l, rest)``, whose maximum over ``l`` is the MAP's ``l``
    when the MAP is the global mode). Comparing the rows tells whether a fitted lengthscale is where the density
    peaks or where an optimiser stopped.

    Args:
        model: a GPMSRM (needs ``blocks``, ``value_and_grad``, ``constrain``, ``unconstrain``,
            ``log_likelihood``).
        at: the point: a :class:`MAPResult`, a Params-like object or an unconstrained vector.
        lengthscales: (n, K) positive lengthscales in seconds, or (n,) to set all K factors to the same value.
        reoptimise: maximise the other parameters at each row.
        maxiter: L-BFGS-B iterations per row when re-optimising.
        gtol: projected-gradient tolerance when re-optimising.
    Raises:
        ValueError: ``lengthscales`` of the wrong shape, not finite or not positive; a model without lengthscales.
    """
    from scipy.optimize import minimize

    block = _lengthscale_block(model)
    K = block.size
    ells = np.asarray(lengthscales, dtype=np.float64)
    if ells.ndim == 1:
        ells = np.repeat(ells[:, None], K, axis=1)
    if ells.ndim != 2 or ells.shape[1] != K or ells.shape[0] < 1:
        raise ValueError(f"lengthscales must have shape (n,) or (n, {K}), got {np.shape(lengthscales)}")
    if not (np.isfinite(ells).all() and (ells > 0).all()):
        raise ValueError("lengthscales must be finite and > 0")
    if isinstance(at, MAPResult):
        at = at.u
    u_at = _initial_vector(model, at, 0)
    if not isinstance(maxiter, (int, np.integer)) or maxiter < 1:
        raise ValueError(f"maxiter must be a positive integer, got {maxiter!r}")
    sl = slice(block.start, block.start + K)
    free = np.ones(model.num_params, dtype=bool)
    free[sl] = False
    us, lds, lls, ok = [], [], [], []
    for row in ells:
        u = u_at.copy()
        u[sl] = np.log(row)
        success = True
        if reoptimise and free.any():
            def objective(x, u=u):
                v = u.copy()
                v[free] = x
                value, grad = model.value_and_grad(v)
                grad = np.asarray(grad, dtype=np.float64)
                if not (np.isfinite(value) and np.isfinite(grad).all()):
                    return np.inf, np.zeros(int(free.sum()))
                return -float(value), -grad[free]

            res = minimize(objective, u[free], jac=True, method="L-BFGS-B",
                           options={"maxiter": int(maxiter), "gtol": gtol})
            u[free] = res.x
            success = bool(res.success)
        us.append(u)
        lds.append(float(model.value_and_grad(u)[0]))
        lls.append(float(model.log_likelihood(model.constrain(u))))
        ok.append(success)
    return LengthscaleProfile(lengthscales=ells, log_density=np.asarray(lds), log_likelihood=np.asarray(lls),
                              u=np.stack(us), reoptimised=bool(reoptimise), converged=np.asarray(ok))
