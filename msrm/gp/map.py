"""GP-MAP: maximise the log density over the unconstrained parameter vector with SciPy's L-BFGS-B.

The model supplies ``value_and_grad(u) -> (log p(y, u), d/du)`` through one jitted JAX function; the optimiser
minimises ``-log p``. A point where the value or the gradient is not finite is *rejected*: the optimiser is given
``+inf`` (so its line search backs off) and the rejection is counted, never hidden. ``restarts > 1`` adds
independent starts ``u0 + perturb * N(0, I)`` (seeded); the best final log density wins.

**Starts.** ``init`` may be an R-MSRM fit (``msrm.fit_rmsrm``'s ``RFit``), a :class:`MAPResult` or anything
else with a ``params`` attribute, a Params-like object, or an unconstrained vector. A bounded response parameter
(lag, width: logit transform) exactly on a bound has no finite unconstrained value, and R-MSRM's bounded
response step often ends on one; :func:`start_inside_bounds` moves every such value ``bound_margin`` of its range
inside the bounds before transforming (values strictly inside are unchanged, values outside still fail
validation).

**Threads.** SciPy's L-BFGS-B does BLAS level-1 work on ``num_params``-long vectors each iteration, too small
to split over threads: with OpenBLAS's workers awake (and waiting for cores on a busy machine) that overhead
exceeds the objective itself at tens of thousands of parameters. The optimiser therefore runs under
``msrm.runtime.blas_limit(1)``; the model's host callbacks set their own BLAS counts inside it.

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

__all__ = ["fit_map", "MAPResult", "load_map", "start_inside_bounds", "LengthscaleProfile", "lengthscale_profile"]

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
        diagnostics: gradient norms (``grad_norm`` Euclidean, ``projected_grad_max_abs`` the sup norm of the
            projected gradient that ``gtol`` is compared with; no bounds in ``u``, so it is the gradient's),
            ``converged``, guard events, ``iterations`` (``len(history) - 1``), ``function_evaluations``,
            seconds per evaluation (``seconds_per_warm_evaluation``: without the first, which may compile),
            rejected non-finite evaluations, the optimiser message and settings
            (``ftol``, ``gtol``, ``maxcor``), per-phase walls ``phase_seconds`` (``first_evaluation``: the
            first ``value_and_grad`` of the fit, compilation included when the model had not been evaluated
            before; ``optimiser``: the optimiser runs after it, of which ``in_value_and_grad`` inside the model;
            ``total``), and one summary per restart.
        execution_info: where it ran (backend, devices, dtype, versions, commit).
        selection: the model's :class:`msrm.select.Selection` when its spec said ``kernel="auto"`` (the chosen
            spec and the candidates' table), else None; not archived by :meth:`save`.
    """

    params: Any
    u: np.ndarray
    log_density: float
    history: np.ndarray
    converged: bool
    diagnostics: dict = field(default_factory=dict)
    execution_info: dict = field(default_factory=dict)
    selection: Any = None

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
        self._recent: dict[bytes, tuple[float, np.ndarray]] = {}

    def evaluated(self, u: np.ndarray) -> tuple[float, np.ndarray]:
        """``(log density, gradient)`` at ``u``, from the recent evaluations (evaluated only if absent)."""
        key = np.asarray(u, dtype=np.float64).tobytes()
        if key not in self._recent:
            self._evaluate(u)
        return self._recent[key]

    def log_density_at(self, u: np.ndarray) -> float:
        """The log density at an accepted iterate, from the recent evaluations (evaluated only if absent)."""
        return self.evaluated(u)[0]

    def _evaluate(self, u: np.ndarray) -> None:
        t0 = time.perf_counter()
        value, grad = self.model.value_and_grad(u)
        grad = np.asarray(grad, dtype=np.float64)
        self.seconds += time.perf_counter() - t0
        self.num_evaluations += 1
        if len(self._recent) > 16:
            self._recent.pop(next(iter(self._recent)))
        self._recent[np.asarray(u, dtype=np.float64).tobytes()] = (float(value), grad)

    def __call__(self, u: np.ndarray) -> tuple[float, np.ndarray]:
        """``(-log p, -gradient)`` for the optimiser (a point evaluated recently is not evaluated again)."""
        value, grad = self.evaluated(u)
        if not (np.isfinite(value) and np.isfinite(grad).all()):
            self.num_rejected += 1
            return np.inf, np.zeros_like(grad)
        return -value, -grad


def start_inside_bounds(params, spec, margin: float = 1e-6):
    """Params with each bounded response parameter moved ``margin`` of its range inside its bounds.

    A lag or width ``v`` with ``lo <= v <= hi`` becomes ``clip(v, lo + margin (hi - lo), hi - margin (hi - lo))``:
    a value on a bound (where the logit transform is infinite) moves just inside, a value already further inside
    is returned unchanged, and a value outside ``[lo, hi]`` is left as it is for validation to refuse.

    Args:
        params: a Params (``response`` maps a param key, ``"<modality>"`` or ``"<participant>/<modality>"``, to
            ``{name: value}``; ``replace(response=...)`` builds the copy).
        spec: the ModelSpec whose responses hold the bounds.
        margin: the fraction of each range, in (0, 0.5).
    Raises:
        ValueError: ``margin`` not in (0, 0.5).
    """
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0.0 < margin < 0.5:
        raise ValueError(f"margin must be a number in (0, 0.5), got {margin!r}")
    response = {}
    for key, theta in params.response.items():
        bounds = spec.response(str(key).split("/")[-1]).bounds
        moved = {}
        for name, v in theta.items():
            lo, hi = bounds[name]
            eps = margin * (hi - lo)
            x = float(v)
            moved[name] = float(np.clip(x, lo + eps, hi - eps)) if lo <= x <= hi else v
        response[key] = moved
    return params.replace(response=response)


def _initial_vector(model, init, seed: int, margin: float = 1e-6) -> np.ndarray:
    """The (num_params,) unconstrained start from ``init`` (see :func:`fit_map`), checked for shape and finiteness.

    An object with a ``u`` vector (a :class:`MAPResult`) starts there; one with ``params`` (an ``RFit``) from
    those; Params-like starts have their bounded response parameters moved inside the bounds
    (:func:`start_inside_bounds`, with the model's ``spec``) before ``model.unconstrain``.
    """
    if isinstance(init, MAPResult):
        init = init.u
    elif init is not None and not isinstance(init, (np.ndarray, list, tuple)) and hasattr(init, "params"):
        init = init.params
    if init is None:
        u0 = model.unconstrain(model.initial_params(seed=seed))
    elif isinstance(init, (np.ndarray, list, tuple)):
        u0 = np.asarray(init, dtype=np.float64)
    else:
        spec = getattr(model, "spec", None)
        if spec is not None and hasattr(init, "response") and hasattr(init, "replace"):
            init = start_inside_bounds(init, spec, margin)
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
    ftol: float | None = None,
    maxcor: int | None = None,
    bound_margin: float = 1e-6,
) -> MAPResult:
    """Maximum a posteriori fit on the unconstrained vector.

    Args:
        model: a model with the GPMSRM protocol.
        init: ``None`` (``model.initial_params(seed)``), an R-MSRM fit (``RFit``) or anything with ``params``, a
            :class:`MAPResult` (its ``u``), a Params-like object, or an unconstrained vector. Bounded response
            parameters of a Params start are moved ``bound_margin`` inside their bounds
            (:func:`start_inside_bounds`).
        seed: seeds the default start and the restart perturbations.
        maxiter: optimiser iterations per restart.
        method: ``"L-BFGS-B"`` (default) or another gradient-based ``scipy.optimize.minimize`` method
            (``"BFGS"``, ``"CG"``, ``"TNC"``, ``"SLSQP"``, ``"trust-constr"``).
        restarts: number of starts; start 0 is ``init``, start r >= 1 is ``init + perturb * N(0, I)``.
        progress: show a tqdm bar over iterations.
        archive: if given, :meth:`MAPResult.save` is called with it.
        perturb: standard deviation of the restart perturbation in unconstrained units.
        gtol: projected-gradient tolerance passed to the optimiser.
        ftol: L-BFGS-B's relative-reduction tolerance, stop when
            ``(f_k - f_{k+1}) / max(|f_k|, |f_{k+1}|, 1) <= ftol`` (``None``: SciPy's default).
        maxcor: L-BFGS-B's number of stored correction pairs (``None``: SciPy's default).
        bound_margin: fraction of a bounded parameter's range by which a start on a bound is moved inside.
    """
    _check_fit_args(method, restarts, maxiter)
    _check_tolerances(ftol, maxcor, method)
    u_init = _initial_vector(model, init, seed, bound_margin)
    starts = _restart_starts(u_init, restarts, perturb, seed)
    t_start = time.perf_counter()
    objective = _Objective(model)
    settings = {"gtol": gtol, "ftol": ftol, "maxcor": maxcor}
    runs = [_run_restart(model, objective, u0, r, restarts, method, maxiter, settings, progress)
            for r, u0 in enumerate(starts)]
    wall = time.perf_counter() - t_start
    best = max(range(len(runs)), key=lambda i: runs[i]["log_density"])
    b = runs[best]
    diagnostics = _diagnostics(model, runs, best, objective, method, wall, seed, maxiter, settings)
    info = _execution_info(model)
    result = MAPResult(
        params=model.constrain(b["u"]),
        u=b["u"],
        log_density=b["log_density"],
        history=b["history"],
        converged=b["success"],
        diagnostics=diagnostics,
        execution_info=info,
        selection=getattr(model, "selection", None),
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


def _check_tolerances(ftol, maxcor, method: str) -> None:
    """Raise ValueError for an ``ftol`` that is not a number >= 0, a ``maxcor`` that is not a positive integer,
    or either given with a method other than L-BFGS-B."""
    if ftol is not None and (isinstance(ftol, bool) or not isinstance(ftol, (int, float)) or not ftol >= 0):
        raise ValueError(f"ftol must be None or a number >= 0, got {ftol!r}")
    if maxcor is not None and (isinstance(maxcor, bool) or not isinstance(maxcor, (int, np.integer)) or maxcor < 1):
        raise ValueError(f"maxcor must be None or a positive integer, got {maxcor!r}")
    if (ftol is not None or maxcor is not None) and method != "L-BFGS-B":
        raise ValueError(f"ftol and maxcor are L-BFGS-B settings; method is {method!r}")


def _restart_starts(u_init: np.ndarray, restarts: int, perturb: float, seed: int) -> list[np.ndarray]:
    """Start vectors: ``u_init``, then ``u_init + perturb * N(0, I)`` per further restart (``default_rng(seed)``)."""
    rng = np.random.default_rng(seed)
    return [u_init] + [u_init + perturb * rng.standard_normal(u_init.shape) for _ in range(restarts - 1)]


def _run_restart(model, objective: _Objective, u0: np.ndarray, r: int, restarts: int, method: str, maxiter: int,
                 settings: dict, progress: bool) -> dict:
    """One optimiser run from ``u0`` (restart ``r`` of ``restarts``).

    Returns the final point, its log density (-inf where value or gradient is not finite) and gradient, the log
    density history (start, then each accepted iterate), success, message, iterations, the walls of its first
    evaluation and of the optimiser, and this run's share of the objective's evaluation, rejection and time
    counters. The final point's value and gradient come from the objective's recent evaluations (the optimiser
    evaluated it), not from a further evaluation.
    """
    from scipy.optimize import minimize

    from ..runtime import blas_limit

    history: list[float] = []
    evals0, rejected0, seconds0 = objective.num_evaluations, objective.num_rejected, objective.seconds
    t0 = time.perf_counter()
    f0, _ = objective(u0)
    history.append(-f0)
    first_seconds = time.perf_counter() - t0
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
        options["gtol"] = settings["gtol"]
    if settings.get("ftol") is not None:
        options["ftol"] = float(settings["ftol"])
    if settings.get("maxcor") is not None:
        options["maxcor"] = int(settings["maxcor"])
    seconds1 = objective.seconds
    t1 = time.perf_counter()
    with blas_limit(1):
        res = minimize(objective, u0, jac=True, method=method, callback=callback, options=options)
        value, grad = objective.evaluated(res.x)
    optimiser_seconds = time.perf_counter() - t1
    if bar is not None:
        bar.close()
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
        "first_evaluation_seconds": first_seconds,
        "optimiser_seconds": optimiser_seconds,
        "optimiser_seconds_in_value_and_grad": objective.seconds - seconds1,
    }


def _diagnostics(model, runs: list[dict], best: int, objective: _Objective, method: str, wall: float, seed: int,
                 maxiter: int, settings: dict) -> dict:
    """``MAPResult.diagnostics``: the best run's gradient norms, iterations and counts, totals over all runs,
    per-phase walls over all runs, the model's guard events, and one summary per restart."""
    b = runs[best]
    evals = sum(r["function_evaluations"] for r in runs)
    guard = model.guard_events() if hasattr(model, "guard_events") else {}
    max_abs = float(np.max(np.abs(b["grad"]))) if b["grad"].size else 0.0
    first = runs[0]["first_evaluation_seconds"]
    return {
        "converged": bool(b["success"]),
        "grad_norm": float(np.linalg.norm(b["grad"])),
        "grad_max_abs": max_abs,
        "projected_grad_max_abs": max_abs,
        "phase_seconds": {
            "first_evaluation": first,
            "optimiser": wall - first,
            "in_value_and_grad": sum(r["optimiser_seconds_in_value_and_grad"] for r in runs),
            "total": wall,
        },
        "guard_events": guard,
        "iterations": b["iterations"],
        "function_evaluations": b["function_evaluations"],
        "total_function_evaluations": evals,
        "seconds_per_evaluation": (
            (objective.seconds / objective.num_evaluations) if objective.num_evaluations else None
        ),
        "seconds_per_warm_evaluation": (
            (objective.seconds - runs[0]["first_evaluation_seconds"]) / (objective.num_evaluations - 1)
            if objective.num_evaluations > 1 else None
        ),
        "rejected_nonfinite": b["rejected_nonfinite"],
        "total_rejected_nonfinite": objective.num_rejected,
        "message": b["message"],
        "method": method,
        "settings": dict(settings),
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
