"""R-MSRM driver: one restart (alternating steps until the objective stops moving) and ``fit_rmsrm`` (restarts).

Each iteration runs four exact block steps, each of which cannot raise J (objective.py):

1. latent normal equations per run (latent.py), then centring/whitening of Z (convention.py; exact);
2. loadings + intercepts (loadings.py);
3. noise variances (closed form);
4. response parameters by bounded L-BFGS-B (response.py): by default on the marginal criterion (the latents
   integrated out under the roughness prior), else on J itself.

The objective J after every step is kept in ``step_objectives`` (n_iter, 4). Steps 1 to 3 never raise J; with
the joint response criterion step 4 does not either, with the marginal one it never raises that criterion (J
may rise there and falls again at the next latent step). The fit stops when the relative change of J over an
iteration is below ``tol`` (converged) or after ``max_iter`` iterations.

BLAS threads: every step runs on the count ``msrm.runtime.step_blas_threads`` chooses for it (the banded latent
solves and the marginal step on one thread, dense steps by the size of their products and the idle cores), unless
``msrm.runtime.configure(blas_threads=...)`` fixed one.
"""
from __future__ import annotations

import math
import time
from functools import partial
from typing import NamedTuple

import numpy as np

from ..data import Dataset
from ..params import Params
from ..runtime import step_blas_limit
from ..spec import ModelSpec
from . import convention
from .archive import PHASES, RFit
from .latent import solve_latents
from .loadings import dense_flops, residual_sum_squares, update_loadings, update_noise
from .objective import (RState, compute_stats, objective_dense, objective_reuse, penalty_metric, roughness_gram,
                        slot_latents)
from .prepare import Prepared, default_roughness, prepare_rmsrm
from .response import RESPONSE_OBJECTIVES, update_response, update_response_marginal

__all__ = ["RFit", "RestartResult", "fit_rmsrm", "fit_restart", "restart_tasks", "PHASES", "OBJECTIVES",
           "LATENT_SOLVERS", "RESPONSE_OBJECTIVES"]

OBJECTIVES = ("reuse", "dense")
LATENT_SOLVERS = ("banded", "superlu")


class RestartResult(NamedTuple):
    """What one restart returns (plain arrays and dicts: cheap to send between processes).

    ``selection`` is J at the end of the joint phase (every restart shares lambda there, so restarts compare on
    it); ``roughness`` the lambda the restart ended with; ``marginal`` what the marginal step did (None without
    one): theta and lambda before and after, M, latent factorizations per run (``evaluations``), seconds.
    """

    state: RState
    objective_history: np.ndarray
    step_objectives: np.ndarray
    timings: dict
    converged: bool
    n_iter: int
    diagnostics: list
    selection: float = float("nan")
    roughness: float = float("nan")
    marginal: dict | None = None


def restart_tasks(seed: int, restarts: int) -> list[dict]:
    """Seed descriptions of the restarts: restart i draws from ``SeedSequence(seed).spawn(restarts)[i]``."""
    return [{"seed": int(seed), "restart": i} for i in range(restarts)]


def _rng(task: dict) -> np.random.Generator:
    """The generator of one restart: child ``task["restart"]`` of ``SeedSequence(task["seed"])``."""
    child = np.random.SeedSequence(task["seed"]).spawn(task["restart"] + 1)[task["restart"]]
    return np.random.default_rng(child)


def _objective(prep: Prepared, state: RState, stats, mode: str) -> float:
    """J by the chosen objective: from ``stats`` (reuse) or from explicit residuals (dense)."""
    return objective_reuse(prep, state, stats) if mode == "reuse" else objective_dense(prep, state)


def fit_restart(prep: Prepared, base_latents: tuple, task: dict, *, max_iter: int, tol: float, objective: str,
                latent_solver: str, progress: bool = False, response_objective: str = "marginal",
                marginal_roughness: bool = False) -> RestartResult:
    """Run one restart from its seeded initial point (convention.py) to convergence or max_iter.

    Joint phase: the four block steps with the joint response step (J minimised). With
    ``response_objective="marginal"`` one marginal step follows (theta and lambda by the restricted likelihood of
    the roughness prior at the joint phase's loadings and noise; response.py), then a fixed-response phase: steps
    1 to 3 with theta and lambda held, to convergence. The marginal step is taken once, not iterated with the
    loadings and noise steps: those fit the loadings to point estimates of the latents, and alternating them with
    the marginal step moves a blurring response's width steadily away from the first step's value (the roughness
    prior's spectrum does not match band-limited latents), so no fixed point of that iteration is a better
    estimate. With ``marginal_roughness`` the step chooses lambda as well (the restricted likelihood of the
    smoothing parameter); otherwise lambda keeps its value: the likelihood's lambda tracks the prior's fit to
    the latents' spectrum, not how well the point estimate recovers them. ``max_iter`` bounds each phase.
    """
    # BLAS threads (msrm.runtime.step_blas_threads): the dense steps' count for the restart; the latent solves
    # and the marginal step set the banded count inside it
    with step_blas_limit("dense", dense_flops(prep)):
        return _fit_restart(prep, base_latents, task, max_iter=max_iter, tol=tol, objective=objective,
                            latent_solver=latent_solver, progress=progress, response_objective=response_objective,
                            marginal_roughness=marginal_roughness)


def _fit_restart(prep: Prepared, base_latents: tuple, task: dict, *, max_iter: int, tol: float, objective: str,
                 latent_solver: str, progress: bool, response_objective: str,
                 marginal_roughness: bool) -> RestartResult:
    state = _initial_state(prep, base_latents, task, objective)
    stats = compute_stats(prep, state)
    history = [_objective(prep, state, stats, objective)]
    steps: list = []
    timings = {p: [] for p in PHASES}
    diagnostics: list = []
    from tqdm.auto import tqdm

    bar = tqdm(total=max_iter, desc=f"restart {task['restart']}", disable=not progress, leave=False)
    try:
        state, stats, converged = _phase(prep, state, stats, objective, latent_solver, "joint", max_iter, tol,
                                         history, steps, timings, diagnostics, bar, history[-1])
        selection = history[-1]
        marginal = None
        if response_objective == "marginal" and (prep.theta_groups or marginal_roughness):
            t0 = time.perf_counter()
            theta, lam, M, n_eval = update_response_marginal(prep, state, stats, objective, latent_solver,
                                                             diagnostics, roughness=marginal_roughness)
            marginal = {"theta_before": {k: dict(v) for k, v in state.theta.items()}, "theta": theta,
                        "roughness_before": float(prep.roughness), "roughness": float(lam), "criterion": M,
                        "evaluations": int(n_eval), "seconds": time.perf_counter() - t0}
            prep = prep._replace(roughness=lam)
            state = state._replace(theta=theta)
            stats = compute_stats(prep, state)
            n_before = len(steps)
            marginal["iteration"] = n_before  # step row of the first fixed-response iteration
            # the first fixed-response iteration is compared with J at the new theta and lambda
            state, stats, converged2 = _phase(prep, state, stats, objective, latent_solver, "fixed", max_iter, tol,
                                              history, steps, timings, diagnostics, bar,
                                              _objective(prep, state, stats, objective))
            converged = converged and converged2
            if len(steps) > n_before:
                timings["response"][n_before] += marginal["seconds"]
    finally:
        bar.close()
    return RestartResult(
        state=state,
        objective_history=np.array(history),
        step_objectives=np.array(steps).reshape(-1, 4),
        timings={p: np.array(v) for p, v in timings.items()},
        converged=converged,
        n_iter=len(steps),
        diagnostics=diagnostics,
        selection=float(selection),
        roughness=float(prep.roughness),
        marginal=marginal,
    )


def _phase(prep, state, stats, objective, latent_solver, response, max_iter, tol, history, steps, timings,
           diagnostics, bar, J_prev: float):
    """Iterate :func:`_iteration` until the relative change of J is below tol or max_iter; appends to history,
    steps and timings in place. Returns (state, stats, converged)."""
    for it in range(max_iter):
        state, stats, row, t = _iteration(prep, state, stats, objective, latent_solver, diagnostics, response)
        for p in PHASES:
            timings[p].append(t[p])
        steps.append(row)
        J_new = row[-1]
        history.append(J_new)
        bar.update(1)
        if not math.isfinite(J_new):
            raise FloatingPointError(f"objective became non-finite at iteration {len(steps)}")
        if abs(J_prev - J_new) <= tol * max(abs(J_new), 1.0):
            return state, stats, True
        J_prev = J_new
    return state, stats, False


def _initial_state(prep: Prepared, base_latents: tuple, task: dict, objective: str) -> RState:
    """The restart's seeded whitened latents and theta (convention.py), with loadings, intercepts and noise fitted
    to them."""
    rng = _rng(task)
    Z = convention.whiten(convention.initial_latents(base_latents, rng, task["restart"]), convention.spans(prep))[0]
    theta = convention.initial_theta(prep, rng, task["restart"])
    state = RState(Z=Z, W={}, b={}, var={}, theta=theta)
    latents = slot_latents(prep, state)
    W, b, q = update_loadings(prep, state, latents)
    state = state._replace(W=W, b=b)
    if objective == "dense":
        q = residual_sum_squares(prep, state, latents)
    return state._replace(var=update_noise(prep, state, q))


def _iteration(prep: Prepared, state: RState, stats, objective: str, latent_solver: str, diagnostics: list,
               response: str = "joint"):
    """One iteration of the four block steps (module docstring), starting from ``stats`` of ``state``.

    ``response``: ``"joint"`` (the response step minimises J) or ``"fixed"`` (theta held; the step's J is the
    noise step's). Returns (state, its stats, the four step objectives [latent, loadings, noise, response],
    seconds per phase).
    Objective evaluations between the steps are booked under "objective", not under the step they follow.
    """
    t = {p: 0.0 for p in PHASES}
    row = []
    # 1. latents
    t0 = time.perf_counter()
    Znew = solve_latents(prep, state, stats, latent_solver, diagnostics)
    state = state._replace(Z=Znew)
    t1 = time.perf_counter()
    row.append(_objective(prep, state, stats, objective))
    t2 = time.perf_counter()
    state = state._replace(Z=convention.whiten(state.Z, convention.spans(prep))[0])
    latents = slot_latents(prep, state)
    t3 = time.perf_counter()
    t["latent"] += (t1 - t0) + (t3 - t2)
    t["objective"] += t2 - t1
    # 2. loadings and intercepts
    W, b, q = update_loadings(prep, state, latents)
    state = state._replace(W=W, b=b)
    t4 = time.perf_counter()
    t["loadings"] += t4 - t3
    if objective == "dense":
        q = residual_sum_squares(prep, state, latents)
        row.append(objective_dense(prep, state))
    else:
        row.append(_feature_objective(prep, state, q))
    t5 = time.perf_counter()
    t["objective"] += t5 - t4
    # 3. noise
    state = state._replace(var=update_noise(prep, state, q))
    t6 = time.perf_counter()
    t["noise"] += t6 - t5
    stats = compute_stats(prep, state)
    J_noise = _objective(prep, state, stats, objective)
    row.append(J_noise)
    t7 = time.perf_counter()
    t["objective"] += t7 - t6
    # 4. response parameters
    if response == "joint":
        theta, J_new, _ = update_response(prep, state, stats, J_noise, objective)
        state = state._replace(theta=theta)
    else:  # theta held (the fixed-response phase)
        J_new = J_noise
    row.append(J_new)
    t["response"] += time.perf_counter() - t7
    return state, stats, row, t


def initial_signal(prep: Prepared, base: tuple) -> float:
    """tr(S0) / K: the mean noise-weighted signal per feature and factor at the PCA initialisation
    (loadings, intercepts and noise fitted to the whitened PCA latents with ``prep.roughness``)."""
    state = RState(Z=base, W={}, b={}, var={}, theta=convention.initial_theta(prep, None, 0))
    W, b, q = update_loadings(prep, state, slot_latents(prep, state))
    state = state._replace(W=W, b=b)
    S0 = penalty_metric(prep, W, update_noise(prep, state, q))
    return float(np.trace(S0)) / prep.n_factors


def _feature_objective(prep: Prepared, state: RState, q: dict) -> float:
    """J from per-feature residual sums of squares (after the loadings step, before the noise step).

    J = 1/2 sum_f [(q_f + (lambda/F_tot) w_f^T P w_f) / sigma_f^2 + n_f log sigma_f^2].
    """
    P = roughness_gram(prep, state.Z)
    scale = prep.roughness / prep.n_total_features
    total = 0.0
    for k in prep.keys:
        pen = scale * np.einsum("fk,kl,fl->f", state.W[k], P, state.W[k])
        total += float(np.sum((q[k] + pen) / state.var[k] + prep.count[k] * np.log(state.var[k])))
    return 0.5 * total


def _check_args(data, spec, restarts, max_iter, tol, seed, objective, latent_solver, progress, backend, client,
                response_objective="marginal"):
    """Raise ValueError naming the first argument of :func:`fit_rmsrm` of the wrong type or out of range."""
    from ..parallel import BACKENDS

    if not isinstance(data, Dataset):
        raise ValueError(f"data must be an msrm.Dataset, got {type(data).__name__}")
    if not isinstance(spec, ModelSpec):
        raise ValueError(f"spec must be an msrm.ModelSpec, got {type(spec).__name__}")
    if spec.kernel == "auto":
        # choosing a kernel needs the GP marginal likelihood (JAX); R-MSRM has no GP prior and never imports JAX
        raise ValueError("fit_rmsrm: spec.kernel='auto' cannot be resolved by R-MSRM, whose objective has no GP "
                         "prior to compare kernels with; call msrm.select(data, spec) and fit its .spec, or give "
                         "a kernel name (it only sets the lengthscale estimate of an R-MSRM fit)")
    for name, v, lo in (("restarts", restarts, 1), ("max_iter", max_iter, 1), ("seed", seed, 0)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
            raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not math.isfinite(tol) or tol < 0:
        raise ValueError(f"tol must be a finite number >= 0, got {tol!r}")
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    if response_objective not in RESPONSE_OBJECTIVES:
        raise ValueError(f"response_objective must be one of {RESPONSE_OBJECTIVES}, got {response_objective!r}")
    if latent_solver not in LATENT_SOLVERS:
        raise ValueError(f"latent_solver must be one of {LATENT_SOLVERS}, got {latent_solver!r}")
    if not isinstance(progress, bool):
        raise ValueError(f"progress must be True or False, got {progress!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if client is not None and backend != "dask":
        raise ValueError(f"client is only used with backend='dask', got backend={backend!r}")


def fit_rmsrm(
    data: Dataset,
    spec: ModelSpec,
    restarts: int = 8,
    max_iter: int = 100,
    tol: float = 1e-6,
    seed: int = 0,
    n_jobs: int | None = None,
    backend: str = "loky",
    roughness: float | str | None = None,
    objective: str = "reuse",
    latent_solver: str = "banded",
    progress: bool = True,
    client=None,
    response_objective: str = "marginal",
) -> RFit:
    """Fit R-MSRM with independent seeded restarts; the lowest final objective wins.

    Args:
        data: the Dataset.
        spec: the ModelSpec (``kernel`` only affects the lengthscale estimate).
        restarts: independent starts (restart 0 from the PCA initialisation, others perturbed; convention.py).
        max_iter: iterations per restart.
        tol: stop when |J_prev - J| <= tol * max(|J|, 1).
        seed: seed of the restart seed sequence.
        n_jobs: worker processes (``None``: min(restarts, physical cores)); 1 runs in this process.
        backend: ``"loky"`` (local processes), ``"dask"`` (a running dask.distributed Client) or
            ``"sequential"``; see ``msrm.parallel.run_tasks``.
        roughness: lambda; None = ``prepare.default_roughness(spec, initial_signal(...))``:
            (2 s / latent_dt)^3 divided by the mean noise-weighted signal of the PCA initialisation;
            ``"marginal"``: that default for the joint phase, then chosen with the response parameters by the
            restricted likelihood in the marginal step (needs ``response_objective="marginal"``).
        objective: ``"reuse"`` (sufficient statistics) or ``"dense"`` (explicit residuals, the reference).
        latent_solver: ``"banded"`` (banded Cholesky) or ``"superlu"`` (sparse LU, the reference).
        progress: tqdm bars over restarts (and iterations when restarts run in this process).
        client: a dask.distributed.Client for ``backend="dask"``.
        response_objective: ``"marginal"`` (response parameters by the marginal likelihood of the roughness
            prior, the latents integrated out; response.py) or ``"joint"`` (minimise J jointly with the latents,
            which lets the latents absorb a response's blur).

    Returns:
        RFit. Raises RuntimeError (with every restart's traceback) only if all restarts fail.
    """
    _check_args(data, spec, restarts, max_iter, tol, seed, objective, latent_solver, progress, backend, client,
                response_objective)
    marginal_roughness = isinstance(roughness, str) and roughness == "marginal"
    if marginal_roughness:
        if response_objective != "marginal":
            raise ValueError("roughness='marginal' needs response_objective='marginal'")
        roughness = None
    from ..parallel import resolve_n_jobs, run_tasks

    jobs = resolve_n_jobs(n_jobs, restarts)
    prep, base = _prepare_start(data, spec, roughness)
    if backend == "loky" and jobs == 1:
        backend = "sequential"
    inner = progress and backend == "sequential"
    fn = partial(_restart_task, prep, base, max_iter=max_iter, tol=float(tol), objective=objective,
                 latent_solver=latent_solver, progress=inner, response_objective=response_objective,
                 marginal_roughness=marginal_roughness)
    tasks = restart_tasks(seed, restarts)
    results = run_tasks(fn, tasks, n_jobs=None if backend == "dask" and n_jobs is None else jobs,
                        backend=backend, client=client, progress=progress, desc="R-MSRM restarts")
    finals, errors, best = _best_restart(results)
    settings = {"objective": objective, "latent_solver": latent_solver, "response_objective": response_objective,
                "marginal_roughness": marginal_roughness,
                "max_iter": int(max_iter), "tol": float(tol),
                "seed": int(seed), "restarts": int(restarts), "backend": backend, "n_jobs": int(jobs)}
    return _assemble_fit(data, spec, prep, best, finals, errors, tasks, settings)


def _prepare_start(data: Dataset, spec: ModelSpec, roughness: float | None) -> tuple[Prepared, tuple]:
    """The prepared problem and the PCA initialisation every restart starts from.

    Returns ``(prep, base)``: ``base`` the whitened PCA latents, a tuple of one (J, K) array per run. With
    ``roughness`` None, ``prep.roughness`` is set to :func:`.prepare.default_roughness` of the initial signal at
    ``base``. The PCA and the initial-signal fit are dense steps, so they run under the dense BLAS thread limit.
    """
    prep = prepare_rmsrm(data, spec, roughness)
    with step_blas_limit("dense", dense_flops(prep)):
        base = convention.pca_init(prep)
        if roughness is None:
            prep = prep._replace(roughness=default_roughness(spec, initial_signal(prep, base)))
    return prep, base


def _best_restart(results: list) -> tuple[np.ndarray, list, RestartResult]:
    """The restarts' selection objectives, their errors and the best restart.

    ``results`` are ``run_tasks`` results (``.ok``, ``.value``, ``.error``), one per restart. Returns
    ``(finals, errors, best)``: ``finals`` (restarts,) the selection J of each restart (NaN where it failed),
    ``errors`` the traceback text or None per restart, ``best`` the :class:`RestartResult` of lowest J. Raises
    RuntimeError with every restart's traceback when none has a finite J.
    """
    finals = np.array([r.value.selection if r.ok else np.nan for r in results])
    errors = [r.error for r in results]
    if not np.isfinite(finals).any():
        raise RuntimeError("every R-MSRM restart failed:\n" + "\n".join(e or "non-finite objective" for e in errors))
    return finals, errors, results[int(np.nanargmin(finals))].value


def _assemble_fit(data: Dataset, spec: ModelSpec, prep: Prepared, best: RestartResult, finals: np.ndarray,
                  errors: list, tasks: list[dict], settings: dict) -> RFit:
    """The :class:`RFit` of the best restart.

    The best state is put in the canonical convention (:func:`.convention.canonical`), its parameters are
    validated against ``data`` and ``spec``, and the lengthscales are estimated from the latents over each run's
    span. ``finals`` (restarts,) and ``errors`` come from :func:`_best_restart`, ``tasks`` from
    :func:`restart_tasks`; ``settings`` is stored as given.
    """
    from ..runtime import execution_info

    state = convention.canonical(prep, best.state)
    params = Params(
        loadings=state.W,
        intercepts=state.b,
        noise_sd={k: np.sqrt(v) for k, v in state.var.items()},
        lengthscales=convention.estimate_lengthscales(
            [z[o] for z, o in zip(state.Z, convention.spans(prep))], spec.latent_dt, spec.kernel),
        response=state.theta,
    )
    params.validate(data, spec)
    return RFit(
        latents=[np.array(z) for z in state.Z],
        params=params,
        objective_history=best.objective_history,
        step_objectives=best.step_objectives,
        converged=bool(best.converged),
        n_iter=int(best.n_iter),
        timings=best.timings,
        restarts=finals,
        restart_errors=errors,
        restart_seeds=tasks,
        execution_info=execution_info(),
        spec=spec,
        roughness=best.roughness,
        settings=settings,
        diagnostics=list(best.diagnostics),
        marginal=best.marginal,
    )


def _restart_task(prep, base, task, **kw) -> RestartResult:
    """:func:`fit_restart` with the task last, the one argument ``run_tasks`` passes."""
    return fit_restart(prep, base, task, **kw)
