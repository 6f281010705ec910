"""State-space backend benchmarks: memory against the note's staging, speed against ``grouped``, the duration
ladder, exactness, bank error against state count, and the parallel scan against the sequential one.

Every function returns results rows (:func:`msrm_lab.bench.rows.make_row`, notebook ``"state_space"``); timings are
warm medians of ``GPMSRM.value_and_grad`` after compilation (outputs synchronised), peak memory is the process
high-water mark added by the timed block (:class:`msrm_lab.bench.measure.PeakMemory`), and ratios are measured side
by side in one process.

The note's as-written staging held one transition and one process-noise matrix per scalar observation:
``n_obs x S_note^2 x 2 x 8`` bytes with ``S_note = 50 K`` states (two Gaussian responses on 25-state banks
per factor); :func:`note_staging_bytes` computes it, and the same per unique node.
"""
from __future__ import annotations

import time
from typing import Any

from msrm_lab.budget import skip_reason, skippable, skipped_rows
from .measure import PeakMemory, warm_median
from .rows import make_row

__all__ = ["SIZES", "NOTEBOOK", "NOTE_STATES_PER_FACTOR", "TARGETS", "note_staging_bytes", "memory_rows",
           "speed_rows", "ladder_rows", "bank_row", "bank_rows", "block_rows", "parallel_rows", "target_rows",
           "factorization_function", "grouped_parts", "accuracy_cost_rows", "ACCURACY_BASE", "all_rows"]

NOTEBOOK = "state_space"
NOTE_STATES_PER_FACTOR = 50

SIZES: dict[str, dict[str, Any]] = {
    # smoke exercises every experiment's code path at the smallest size (each state-space model compiles in tens
    # of seconds on two cores, so it builds few of them and leaves the associative scan to the slow tests)
    "smoke": dict(profile="tiny", n_features=3, K=2, ladder_K=2, scales=[1], grouped_scales=[1],
                  block_cases=[dict(K=2, scale=1, blocks=[2, None])], speed_repeats=1,
                  targets=dict(long_K=2, long_scale=1.0, rival_blocks=[], ratio_K=2, repeats=1),
                  bank_states=[4], parallel=None, parallel_cpu=None, repeats=1, time_budget_s=30.0),
    "quick": dict(profile="one-eighth", n_features=36, K=3, ladder_K=5, scales=[1, 2, 4], grouped_scales=[1, 2],
                  block_cases=[dict(K=3, scale=1, blocks=[2, 4, 8, 16, None])], speed_repeats=3,
                  targets=dict(long_K=5, long_scale=2.0, rival_blocks=[5, 8], ratio_K=3, repeats=3),
                  bank_states=[2, 8, 32], parallel=dict(duration_scale=0.25, K=2),
                  parallel_cpu=dict(duration_scale=0.25, K=2), repeats=2, time_budget_s=60.0),
    "note": dict(profile="one-eighth", n_features=3600, K=3, ladder_K=5, scales=[1, 2, 4, 8],
                 block_cases=[dict(K=3, scale=1, blocks=[2, 4, 6, 8, 12, 16, None]),
                              dict(K=5, scale=8, blocks=[2, 4, 6, 8, 12, None])], speed_repeats=7,
                 # the three gradient targets (TARGETS); rival_blocks: fixed block lengths timed beside the tuned one
                 targets=dict(long_K=5, long_scale=8.0, rival_blocks=[5, 8], ratio_K=3, repeats=5),
                 grouped_scales=[1, 2, 4, 8], bank_states=[2, 4, 8, 16, 24, 32, 48],
                 # the log-depth scan does a dense S x S solve per element and level: on a CPU, where nothing
                 # runs the elements side by side, it is measured on a quarter of the length
                 parallel=dict(duration_scale=1.0, K=3), parallel_cpu=dict(duration_scale=0.25, K=3), repeats=3,
                 time_budget_s=300.0,
                 # this code against ACCURACY_BASE on the cases of the speed targets, a fresh process per tree and
                 # round (msrm_lab.bench.commit_cost)
                 accuracy_cost=dict(rounds=2, repeats=3, pairs=[("one-eighth-K3", "grouped"),
                                                                ("one-eighth-K3", "state_space"),
                                                                ("x8-K5", "state_space")])),
}

# The commit the accuracy rows compare this code with: the last one before the densities were written without
# cancellation (centred data, the whitened node form for dense/grouped, the whitened absorb and process noise for
# the state space), the deterministic block rule and the load-following BLAS threads.
ACCURACY_BASE = "bcd61a9"


# The gradient targets: one-run x8 K = 5 state-space value+grad (seconds, at most), grouped value+grad over its
# POTRF+POTRI floor at the same NK (at most), grouped over state space at one-eighth K = 3 (at least).
TARGETS = dict(long_value_and_grad_s=1.0, grouped_over_floor=1.5, grouped_over_state_space=5.0)


def note_staging_bytes(count: int, K: int, states_per_factor: int = NOTE_STATES_PER_FACTOR) -> int:
    """Bytes of the note's staged transition + process-noise arrays: ``count x (s K)^2 x 2 x 8``."""
    S = states_per_factor * K
    return int(count) * S * S * 2 * 8


def _case(sz: dict, *, K: int, duration_scale: float = 1.0, seed: int = 0):
    import data_synth

    return data_synth.synthetic_dataset(sz["profile"], n_features=sz["n_features"], duration_scale=duration_scale,
                                        n_factors=K, seed=seed)


def _n_obs(data) -> int:
    return int(sum(s.mask.sum() for r in data.runs for s in r.streams))


def _timed(model, u, repeats: int):
    """(first call s, warm median s, samples, PeakMemory) of value_and_grad."""
    t0 = time.perf_counter()
    model.value_and_grad(u)
    first = time.perf_counter() - t0
    with PeakMemory() as pm:
        med, samples = warm_median(lambda: model.value_and_grad(u), repeats=repeats, warmup=0)
    return first, med, samples, pm


def _model(data, spec, backend: str, **options):
    import msrm

    return msrm.GPMSRM(data, spec, linear_algebra=backend, **options)


def _ss_params(model) -> dict:
    t = model.prepared.runs[0].tables
    return dict(n_states=t.n_states, n_steps=t.n_steps, sub_steps=int(t.block_index.size), block=t.block,
                filter_method=t.method, chunk=t.chunk, n_chunks=t.n_chunks, slots=t.n_slots,
                block_source=t.block_source, block_predicted_s=t.block_predicted_s)


def _spread(samples) -> dict:
    import numpy as np

    return dict(min_s=float(np.min(samples)), max_s=float(np.max(samples)), samples=[float(x) for x in samples])


def memory_rows(size: str, *, info=None) -> list[dict]:
    """The note's staging (per observation and per node) beside this backend's measured value+grad peak."""
    import msrm

    sz = SIZES[size]
    data, truth = _case(sz, K=sz["K"])
    n_obs, n_nodes = _n_obs(data), sum(msrm.count_nodes(data, truth.spec))
    base = dict(K=sz["K"], n_features=sz["n_features"], profile=sz["profile"], n_obs=n_obs, n_nodes=n_nodes)
    rows = [
        make_row(NOTEBOOK, "memory", "note_staging_per_observation_bytes", note_staging_bytes(n_obs, sz["K"]),
                 "bytes", info=info, states=NOTE_STATES_PER_FACTOR * sz["K"], **base),
        make_row(NOTEBOOK, "memory", "note_staging_per_node_bytes", note_staging_bytes(n_nodes, sz["K"]), "bytes",
                 info=info, states=NOTE_STATES_PER_FACTOR * sz["K"], **base),
    ]
    model = _model(data, truth.spec, "state_space")
    u = model.unconstrain(truth.params)
    first, med, samples, pm = _timed(model, u, sz["repeats"])
    extra = dict(base, **_ss_params(model))
    if pm.delta_bytes is not None:
        rows.append(make_row(NOTEBOOK, "memory", "state_space_peak_rss_delta_bytes", pm.delta_bytes, "bytes",
                             info=info, method=pm.method, **extra))
    if pm.peak_rss_bytes is not None:
        rows.append(make_row(NOTEBOOK, "memory", "state_space_peak_rss_bytes", pm.peak_rss_bytes, "bytes",
                             info=info, method=pm.method, **extra))
    if pm.device_peak_bytes is not None:
        rows.append(make_row(NOTEBOOK, "memory", "state_space_device_peak_bytes", pm.device_peak_bytes, "bytes",
                             info=info, **extra))
    return rows


@skippable(NOTEBOOK, "speed", (("median_s", "s"),))
def speed_rows(size: str, *, info=None) -> list[dict]:
    """value+grad of state_space and grouped on the same data in one process, timed side by side (the two calls
    alternate, ``speed_repeats`` times, after one compiling call each), their ratio and agreement."""
    import numpy as np

    from msrm.gp.memory import MemoryGuardError

    from .measure import side_by_side

    sz = SIZES[size]
    data, truth = _case(sz, K=sz["K"])
    base = dict(K=sz["K"], n_features=sz["n_features"], profile=sz["profile"])
    rows, models, first, values = [], {}, {}, {}
    for backend in ("state_space", "grouped"):
        try:
            models[backend] = _model(data, truth.spec, backend)
        except MemoryGuardError as exc:
            rows.append(make_row(NOTEBOOK, "speed", "median_s", None, "s", status="refused", info=info,
                                 reason=str(exc), backend=backend, **base))
    u = {b: m.unconstrain(truth.params) for b, m in models.items()}
    for backend, model in models.items():
        t0 = time.perf_counter()
        model.value_and_grad(u[backend])
        first[backend] = time.perf_counter() - t0
        values[backend] = model.log_likelihood(truth.params)
    times = side_by_side({b: (lambda m=m, x=u[b]: m.value_and_grad(x)) for b, m in models.items()},
                         repeats=sz["speed_repeats"])
    med = {b: float(np.median(t)) for b, t in times.items()}
    for backend, model in models.items():
        extra = dict(base, backend=backend, **(_ss_params(model) if backend == "state_space" else {}))
        rows.append(make_row(NOTEBOOK, "speed", "median_s", med[backend], "s", info=info, samples=times[backend],
                             **extra))
        rows.append(make_row(NOTEBOOK, "speed", "first_call_s", first[backend], "s", info=info, **extra))
    if len(med) == 2:
        rows.append(make_row(NOTEBOOK, "speed", "grouped_over_state_space", med["grouped"] / med["state_space"], "x",
                             info=info, **base))
        rel = abs(values["state_space"] - values["grouped"]) / abs(values["grouped"])
        rows.append(make_row(NOTEBOOK, "exactness", "relative_difference_to_grouped", rel, "", info=info,
                             loglik_grouped=values["grouped"], loglik_state_space=values["state_space"], **base))
    return rows


def ladder_rows(size: str, *, info=None, progress=None) -> list[dict]:
    """Duration ladder (one long run) at K = ladder_K: time and peak memory of value+grad per backend, the fitted
    duration exponent, and the memory guard's refusal (or a predicted-time skip) where grouped does not fit."""
    import msrm
    from msrm.gp.memory import MemoryGuardError

    from .scaling import fit_exponent

    sz = SIZES[size]
    rows: list[dict] = []
    for backend, scales in (("state_space", sz["scales"]), ("grouped", sz["grouped_scales"])):
        past: list[tuple[float, float]] = []
        for scale in scales:
            params = dict(backend=backend, scale=scale, K=sz["ladder_K"], n_features=sz["n_features"],
                          profile=sz["profile"])
            reason = skip_reason()
            if reason is not None:
                rows += skipped_rows(NOTEBOOK, "ladder", reason, info=info, **params)
                continue
            if len(past) >= 2:
                slope = fit_exponent([p[0] for p in past], [p[1] for p in past])
                predicted = past[-1][1] * (scale / past[-1][0]) ** max(slope, 1.0)
                if predicted * (sz["repeats"] + 2) > sz["time_budget_s"]:
                    rows.append(make_row(NOTEBOOK, "ladder", "median_s", None, "s", status="not_yet_measured",
                                         info=info, reason=f"predicted {predicted:.0f} s per call exceeds the "
                                                           f"profile's budget of {sz['time_budget_s']:.0f} s", **params))
                    continue
            data, truth = _case(sz, K=sz["ladder_K"], duration_scale=float(scale))
            try:
                model = _model(data, truth.spec, backend)
            except MemoryGuardError as exc:
                rows.append(make_row(NOTEBOOK, "ladder", "median_s", None, "s", status="refused", info=info,
                                     reason=str(exc), **params))
                continue
            u = model.unconstrain(truth.params)
            first, med, samples, pm = _timed(model, u, sz["repeats"])
            past.append((scale, med))
            extra = dict(params, n_nodes=sum(msrm.count_nodes(data, truth.spec)),
                         **(_ss_params(model) if backend == "state_space" else {}))
            rows.append(make_row(NOTEBOOK, "ladder", "median_s", med, "s", info=info, samples=samples, **extra))
            rows.append(make_row(NOTEBOOK, "ladder", "first_call_s", first, "s", info=info, **extra))
            if pm.delta_bytes is not None:
                rows.append(make_row(NOTEBOOK, "ladder", "peak_rss_delta_bytes", pm.delta_bytes, "bytes", info=info,
                                     method=pm.method, **extra))
            if pm.device_peak_bytes is not None:
                rows.append(make_row(NOTEBOOK, "ladder", "device_peak_bytes", pm.device_peak_bytes, "bytes",
                                     info=info, **extra))
            if progress is not None:
                progress(backend, scale, med)
            del model
        if len(past) >= 2:
            rows.append(make_row(NOTEBOOK, "ladder", "duration_exponent", fit_exponent(*zip(*past)), "", info=info,
                                 backend=backend, K=sz["ladder_K"], scales=[p[0] for p in past]))
    return rows


def bank_row(value: float, event: int, exact: float, *, info=None, **params) -> dict:
    """The row of one bank: its relative error against the exact density ``exact``, or, where the bank's filter
    returned no finite density, an ``error`` row naming the factorization guard event instead of a number."""
    import math

    if math.isfinite(value):
        return make_row(NOTEBOOK, "banks", "relative_error", abs(value - exact) / abs(exact), "", info=info,
                        guard_event=event, **params)
    return make_row(NOTEBOOK, "banks", "relative_error", None, "", status="error", info=info, guard_event=event,
                    reason=f"log likelihood not finite ({value}), factorization guard event {event}", **params)


@skippable(NOTEBOOK, "banks", (("relative_error", ""),))
def bank_rows(size: str, *, info=None) -> list[dict]:
    """Relative error of the Laguerre and rational banks against the exact density, per state count (an
    ``error`` row where a bank's filter returns no finite density)."""
    import jax
    import numpy as np

    from msrm.gp.model import params_to_theta
    from msrm.gp.state_space import loglik, prepare

    sz = SIZES[size]
    data, truth = _case(sz, K=sz["K"])
    theta = params_to_theta(truth.params)
    f = jax.jit(lambda th, p: loglik(th, p))
    exact = float(f(theta, prepare(data, truth.spec))[0])
    rows = []
    for kind in ("laguerre", "rational"):
        for n in sz["bank_states"]:
            reason = skip_reason()  # each state count compiles its own filter
            if reason is not None:
                rows += skipped_rows(NOTEBOOK, "banks", reason, info=info, metrics=(("relative_error", ""),),
                                     embedding=kind, n_states_per_factor=n, K=sz["K"], profile=size)
                continue
            prepared = prepare(data, truth.spec, response_embedding=kind, n_states=n)
            v, event = f(theta, prepared)
            rows.append(bank_row(float(v), int(np.max(np.asarray(event))), exact, info=info, embedding=kind,
                                 n_states_per_factor=n, K=sz["K"], n_features=sz["n_features"],
                                 profile=sz["profile"], state_dim=prepared.runs[0].tables.n_states))
    return rows


@skippable(NOTEBOOK, "block", (("median_s", "s"),))
def block_rows(size: str, *, info=None) -> list[dict]:
    """value+grad against the block length C of the sequential scan, with the per-run choice
    (:func:`msrm.gp.state_space.prepare.auto_block`, ``block="auto"``) among them; the density is the same for
    every C (tested), only the cost changes."""
    sz = SIZES[size]
    rows = []
    for case in sz["block_cases"]:
        data, truth = _case(sz, K=case["K"], duration_scale=float(case["scale"]))
        base = dict(K=case["K"], scale=case["scale"], n_features=sz["n_features"], profile=sz["profile"])
        for block in case["blocks"]:
            model = _model(data, truth.spec, "state_space", **({} if block is None else {"block": block}))
            u = model.unconstrain(truth.params)
            first, med, samples, _ = _timed(model, u, sz["repeats"])
            extra = dict(base, requested="auto" if block is None else str(block), **_ss_params(model))
            rows.append(make_row(NOTEBOOK, "block", "median_s", med, "s", info=info, samples=samples, **extra))
            rows.append(make_row(NOTEBOOK, "block", "first_call_s", first, "s", info=info, **extra))
            del model
    return rows


@skippable(NOTEBOOK, "parallel", (("parallel_over_sequential", "x"),))
def parallel_rows(size: str, *, info=None) -> list[dict]:
    """value+grad of the associative scan against the sequential scan (same process), and their agreement."""
    import jax

    sz = SIZES[size]
    p = sz["parallel_cpu" if jax.default_backend() == "cpu" else "parallel"]
    if p is None:
        return [make_row(NOTEBOOK, "parallel", "parallel_over_sequential", None, "x", status="not_yet_measured",
                         info=info, profile=sz["profile"],
                         reason=f"the {size} profile does not run the parallel scan (its equality is tested)")]
    data, truth = _case(sz, K=p["K"], duration_scale=p["duration_scale"])
    base = dict(K=p["K"], duration_scale=p["duration_scale"], n_features=sz["n_features"], profile=sz["profile"])
    rows, med, values = [], {}, {}
    for parallel in (False, True):
        model = _model(data, truth.spec, "state_space", parallel=parallel)
        u = model.unconstrain(truth.params)
        first, med[parallel], samples, pm = _timed(model, u, sz["repeats"])
        values[parallel] = model.value_and_grad(u)[0]
        extra = dict(base, parallel=parallel, **_ss_params(model))
        rows.append(make_row(NOTEBOOK, "parallel", "median_s", med[parallel], "s", info=info, samples=samples,
                             **extra))
        if pm.delta_bytes is not None:
            rows.append(make_row(NOTEBOOK, "parallel", "peak_rss_delta_bytes", pm.delta_bytes, "bytes", info=info,
                                 method=pm.method, **extra))
        del model
    rows.append(make_row(NOTEBOOK, "parallel", "parallel_over_sequential", med[True] / med[False], "x", info=info,
                         **base))
    rows.append(make_row(NOTEBOOK, "parallel", "relative_difference", abs(values[True] - values[False]) /
                         abs(values[False]), "", info=info, **base))
    return rows


def factorization_function(n: int, seed: int = 0):
    """``(fn, method)``: one call of ``fn()`` is the value and gradient of the library's guarded factorization
    alone at dimension ``n``, as the grouped likelihood calls it.

    ``fn`` is a jitted ``jax.value_and_grad`` of ``quad + logdet`` from :func:`msrm.gp.linalg.quad_logdet` (the
    platform's method, ``symmetric=True``) at an exactly symmetric SPD ``M`` (:func:`msrm_lab.bench.linalg.spd_matrix`)
    and one right-hand side ``v``. It returns ``(value, sum of both gradients)``: the (n, n) gradient
    ``M^{-1} - A A^T`` is reduced inside the same computation, so XLA reads ``M^{-1}`` once and writes no (n, n)
    output, as the likelihood's Woodbury backward reads it once. On the CPU platform one call is therefore POTRF,
    POTRS and POTRI on the host, plus moving ``M`` to the host and ``M^{-1}`` back, plus that one pass: the
    POTRF+POTRI floor and what the callback path adds to it, without any of the model's own work.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    from msrm.gp import linalg

    from .linalg import spd_matrix

    M = jnp.asarray(spd_matrix(n, seed))
    v = jnp.asarray(np.random.default_rng(seed + 1).normal(size=n))
    method = linalg.resolve_method("auto")

    def density(M, v):
        quad, logdet, _ = linalg.quad_logdet(M, v, method=method, symmetric=True)
        return quad + logdet

    @jax.jit
    def fn(M, v):
        value, (gM, gv) = jax.value_and_grad(density, argnums=(0, 1))(M, v)
        return value, jnp.sum(gM) + jnp.sum(gv)

    return (lambda: fn(M, v)), f"quad_logdet value+grad, {method}"


def grouped_parts(model, u, seed: int = 0) -> dict:
    """The grouped likelihood of the model's largest run cut into the three pieces its value and gradient are made
    of, each a jitted ``jax.value_and_grad`` called with no arguments (outputs synchronised by the caller):

    * ``statistics``: the node data ``(y~, R, data_term)`` (:func:`msrm.gp.likelihood.node_data`: the node
      statistics, each node's least-squares fit and the residual sum of squares formed value by value);
    * ``covariance``: the node covariances ``C_k = A K_k A^T`` (:func:`msrm.gp.likelihood.node_covariance`,
      chunked window products where the layout allows);
    * ``woodbury``: :func:`msrm.gp.likelihood.woodbury_loglik` of the run's own ``(y~, R, C)``: symmetrising
      ``C``, building ``M = I + R C R^T``, the factorization and the Woodbury backward to ``(y~, R, C)``.

    The first two are differentiated from the constrained parameters ``theta`` through a fixed random cotangent of
    their outputs (a scalar ``sum(out * G)``), so each runs its forward and its reverse pass once, as inside the
    model; their sum with ``woodbury`` is the run's value and gradient less the parameter transforms and priors.
    Also returned: ``loglik``, the run's log likelihood from ``woodbury`` (for checks), ``run_index`` and
    ``run_nodes``.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    from msrm.gp import likelihood as lk
    from msrm.gp import transforms
    from msrm.gp.prepare import prepare

    runs = prepare(model.data, model.spec, grouped=True).runs
    index = max(range(len(runs)), key=lambda i: int(runs[i].layout.n_nodes))
    run = runs[index]
    theta = transforms.constrain(jnp.asarray(u), model.blocks)[0]
    y, R, data_term = lk.node_data(theta, run)
    C = lk.node_covariance(theta, run.layout)
    rng = np.random.default_rng(seed)
    g_y, g_R, g_C = (jnp.asarray(rng.normal(size=x.shape)) for x in (y, R, C))

    def statistics(th):
        e, r, c = lk.node_data(th, run)
        return jnp.sum(e * g_y) + jnp.sum(r * g_R) + c

    def covariance(th):
        return jnp.sum(lk.node_covariance(th, run.layout) * g_C)

    def woodbury(e, r, c):
        return lk.woodbury_loglik(e, r, c, data_term, run.layout.method)[0]

    stats_vg = jax.jit(jax.value_and_grad(statistics))
    cov_vg = jax.jit(jax.value_and_grad(covariance))
    wood_vg = jax.jit(jax.value_and_grad(woodbury, argnums=(0, 1, 2)))
    return dict(statistics=lambda: stats_vg(theta), covariance=lambda: cov_vg(theta),
                woodbury=lambda: wood_vg(y, R, C), loglik=float(wood_vg(y, R, C)[0]),
                run_index=index, run_nodes=int(run.layout.n_nodes))


@skippable(NOTEBOOK, "targets", (("grouped_over_state_space", "x"),))
def target_rows(size: str, *, info=None) -> list[dict]:
    """The three gradient targets (:data:`TARGETS`) beside their measured values, each timed by alternating calls
    in this process (median, min, max over ``repeats``):

    * ``long_value_and_grad_s``: one-run state-space value+grad at ``long_scale`` x the duration, K = ``long_K``,
      with the block length chosen for this machine (:mod:`msrm.gp.state_space.tuning`), alternating with the
      fixed ``rival_blocks`` (their rows say ``requested``);
    * ``grouped_over_floor``: grouped value+grad over POTRF+POTRI at its NK (:func:`msrm_lab.bench.gp.floor_function`),
      K = ``ratio_K``;
    * ``grouped_over_state_space``: grouped over state space (tuned block) on the same data, K = ``ratio_K``;

    and, timed in the same alternation, where grouped's time goes: ``factorization_median_s``, the library's
    factorization alone at the same NK (:func:`factorization_function`), ``factorization_over_floor`` (what the
    factorization's own path adds to POTRF+POTRI) and ``grouped_outside_factorization_s`` (grouped less the
    factorization, difference of medians: the model's own work around it, i.e. node statistics, node covariances,
    building ``M`` and the Woodbury backward), which the same alternation cuts into its pieces
    (:func:`grouped_parts`): ``statistics_median_s``, ``covariance_median_s``, ``woodbury_median_s`` and
    ``woodbury_outside_factorization_s`` (the Woodbury piece less the factorization: building ``M`` and its
    backward).

    Every row carries the block rule's coefficients."""
    import numpy as np

    from msrm.gp.state_space import tuning

    from .gp import floor_function
    from .measure import side_by_side

    sz = SIZES[size]
    tg = sz["targets"]
    coeffs = tuning.machine_coefficients()
    tune = dict(tuning=coeffs.as_dict(), profile=sz["profile"],
                n_features=sz["n_features"])
    rows: list[dict] = []

    # 1. the long run: tuned block against fixed ones
    data, truth = _case(sz, K=tg["long_K"], duration_scale=float(tg["long_scale"]))
    models = {"auto": _model(data, truth.spec, "state_space")}
    for b in tg["rival_blocks"]:
        if b != models["auto"].prepared.runs[0].tables.block:
            models[str(b)] = _model(data, truth.spec, "state_space", block=b)
    u = models["auto"].unconstrain(truth.params)
    times = side_by_side({k: (lambda m=m: m.value_and_grad(u)) for k, m in models.items()}, repeats=tg["repeats"])
    base = dict(tune, K=tg["long_K"], scale=tg["long_scale"])
    for k, m in models.items():
        rows.append(make_row(NOTEBOOK, "targets", "long_value_and_grad_s", float(np.median(times[k])), "s",
                             info=info, target=TARGETS["long_value_and_grad_s"], target_kind="at most",
                             requested=k, measured="alternating calls", **_spread(times[k]), **base,
                             **_ss_params(m)))
    del models, u

    # 2 and 3. one-eighth K = ratio_K: grouped, its floor, and the state space side by side
    data, truth = _case(sz, K=tg["ratio_K"])
    ss, gr = _model(data, truth.spec, "state_space"), _model(data, truth.spec, "grouped")
    u_ss, u_gr = ss.unconstrain(truth.params), gr.unconstrain(truth.params)
    NK = max(gr.factorization_dims)
    floor_fn, floor_method = floor_function(NK)
    fact_fn, fact_method = factorization_function(NK)
    parts = grouped_parts(gr, u_gr)
    times = side_by_side({"grouped": lambda: gr.value_and_grad(u_gr), "floor": floor_fn,
                          "factorization": fact_fn, "state_space": lambda: ss.value_and_grad(u_ss),
                          **{k: parts[k] for k in ("statistics", "covariance", "woodbury")}},
                         repeats=tg["repeats"])
    med = {k: float(np.median(v)) for k, v in times.items()}
    base = dict(tune, K=tg["ratio_K"], scale=1.0, NK=NK, measured="alternating calls")
    part = dict(run_nodes=parts["run_nodes"])
    extras = {"state_space": _ss_params(ss), "floor": dict(floor=floor_method),
              "factorization": dict(factorization=fact_method), "statistics": part, "covariance": part,
              "woodbury": part}
    for k in ("grouped", "floor", "factorization", "state_space", "statistics", "covariance", "woodbury"):
        rows.append(make_row(NOTEBOOK, "targets", f"{k}_median_s", med[k], "s", info=info, **_spread(times[k]),
                             **base, **extras.get(k, {})))
    rows.append(make_row(NOTEBOOK, "targets", "woodbury_outside_factorization_s",
                         med["woodbury"] - med["factorization"], "s", info=info, factorization=fact_method,
                         difference="of medians", **part, **base))
    rows.append(make_row(NOTEBOOK, "targets", "factorization_over_floor", med["factorization"] / med["floor"], "x",
                         info=info, floor=floor_method, factorization=fact_method, **base))
    rows.append(make_row(NOTEBOOK, "targets", "grouped_outside_factorization_s",
                         med["grouped"] - med["factorization"], "s", info=info, factorization=fact_method,
                         difference="of medians", **base))
    rows.append(make_row(NOTEBOOK, "targets", "grouped_over_floor", med["grouped"] / med["floor"], "x", info=info,
                         target=TARGETS["grouped_over_floor"], target_kind="at most", floor=floor_method, **base))
    rows.append(make_row(NOTEBOOK, "targets", "grouped_over_state_space", med["grouped"] / med["state_space"], "x",
                         info=info, target=TARGETS["grouped_over_state_space"], target_kind="at least", **base,
                         **_ss_params(ss)))
    return rows


@skippable(NOTEBOOK, "accuracy_cost", (("head_over_base", "x"),))
def accuracy_cost_rows(size: str, *, info=None) -> list[dict]:
    """What the numerically sound forms cost in time: value+grad of this code against :data:`ACCURACY_BASE` on
    the cases of the speed targets (:func:`msrm_lab.bench.commit_cost.cost_rows`: each tree in fresh processes,
    alternating round by round, on the same pickled data; ``head_over_base`` rows with each tree's median). A
    profile without ``accuracy_cost`` gives one ``not_yet_measured`` row saying so (checking out and timing a
    second tree takes minutes)."""
    from msrm_lab.provenance import execution_info

    from . import commit_cost

    info = execution_info() if info is None else info
    cfg = SIZES[size].get("accuracy_cost")
    if cfg is None:
        return [make_row(NOTEBOOK, "accuracy_cost", "head_over_base", None, "x", status="not_yet_measured",
                         info=info, base_commit=ACCURACY_BASE,
                         reason=f"the {size} profile does not time a second tree (the note profile does)")]
    return commit_cost.cost_rows(ACCURACY_BASE, cfg["pairs"], rounds=cfg["rounds"], repeats=cfg["repeats"],
                                 notebook=NOTEBOOK, info=info)


def all_rows(size: str, *, info=None, progress=None) -> list[dict]:
    """Every state-space measurement of a profile, in the order the chapter shows them."""
    rows = []
    for fn in (memory_rows, speed_rows, bank_rows, block_rows, parallel_rows, target_rows, accuracy_cost_rows):
        rows += fn(size, info=info)
        if progress is not None:
            progress(fn.__name__)
    rows += ladder_rows(size, info=info)
    return rows
