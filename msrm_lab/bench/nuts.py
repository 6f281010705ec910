"""Objective, gradient and a short NUTS run on the synthetic study, with the time of every phase.

The note's settings: one-eighth scale, K = 3, 15 warm-up iterations, 15 draws, diagonal mass, tree depth <= 5.
Measured side by side in one process:

* ``objective_gradient``: the log density and gradient norm at the model's data-driven start (a fingerprint
  to compare devices), compile time and warm median of ``model.value_and_grad`` (the API: NumPy in and out) and
  of ``jax.jit(jax.value_and_grad(model.log_density))`` on a device array (exactly what NUTS differentiates; the
  leapfrog ratio divides by this one);
* ``nuts``: every phase of :func:`msrm.gp.posterior.sample` (compilation separated from warm-up and sampling by
  :func:`timed_sample`), leapfrog counts, seconds per leapfrog and its ratio to the bare gradient;
* ``nuts_vectorized``: the same run with two vectorised chains; throughput (leapfrog steps per sampling second,
  both chains) relative to one chain;
* ``projection``: wall time of one full chain (1000 warm-up + 1200 draws) from the measured seconds per leapfrog
  at the measured trajectory length (a lower bound: the depth cap of the short run keeps trees small), at 255
  steps (depth 8, "a few hundred") and at 1023 steps (the depth-10 cap).

:func:`chain_rows` measures a longer chain (``nuts_chain``, sizes in :data:`CHAIN_SIZES`) on the state-space
backend, started from a short MAP, at NUTS's own tree-depth cap: the wall of every phase, the bare gradient timed
before and after the chain in the same process and seconds per leapfrog against it, the tree depths
(:func:`tree_depths` of NumPyro's ``num_steps``: their mean, median, maximum and a count per depth, in warm-up and
in sampling), the adapted step size, divergences, the bulk ESS of the slowest parameter and of each variable, ESS per
hour, and the full chain (1000 + 1200) projected from the measured seconds per leapfrog at the measured trajectory
lengths (rows with status ``"projected"``).

The phases of both experiments are those of :func:`timed_sample`: the library's wall seconds per phase, with JAX's
compile events (``jax.monitoring``, :func:`msrm_lab.bench.measure.compile_seconds`) that fell inside warm-up and
sampling taken out of them and booked as ``compilation``; seconds per leapfrog count the sampling seconds left.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from msrm_lab.budget import skip_reason, skipped_rows
from .measure import CompileEvents, PeakMemory, compile_seconds, warm_median
from .rows import make_row

__all__ = ["SIZES", "CHAIN_SIZES", "nuts_rows", "chain_rows", "chain_statistics", "tree_depths", "timed_sample",
           "compile_free_phases"]

NOTEBOOK = "gradient_nuts"

SIZES: dict[str, dict[str, Any]] = {
    "smoke": dict(profile="tiny", n_features=4, n_runs=1, n_factors=1, num_warmup=3, num_samples=3,
                  max_tree_depth=3, repeats=2, vectorized=False, method="native", compare_methods=False),
    # quick: the one-eighth design at a quarter of its length (about 235 nodes) with the native factorization, no
    # vectorised pair and ten iterations of each phase at depth 4, so that make book's quick sitting stays within
    # its ten minutes (the LAPACK callback is timed beside it in objective_gradient; the note profile runs the
    # vectorised pair at the note's settings)
    "quick": dict(profile="one-eighth", n_features=36, n_runs=1, n_factors=3, num_warmup=10, num_samples=10,
                  max_tree_depth=4, repeats=7, vectorized=False, duration_scale=0.25, method="native"),
    "note": dict(profile="one-eighth", n_features=3600, n_runs=1, n_factors=3, num_warmup=15, num_samples=15,
                 max_tree_depth=5, repeats=3, vectorized=True),
    "full": dict(profile="one-eighth", n_features=3600, n_runs=8, n_factors=3, num_warmup=15, num_samples=15,
                 max_tree_depth=5, repeats=3, vectorized=True),
    # the device run (msrm_lab.device) on one GPU: the note's case with one and two vectorised chains; the native
    # factorization only (the LAPACK callback is a CPU path)
    "device": dict(profile="one-eighth", n_features=3600, n_runs=1, n_factors=3, num_warmup=15, num_samples=15,
                   max_tree_depth=5, repeats=3, vectorized=True, method="native", compare_methods=False),
}
# the nuts_chain experiment: the state-space backend, a MAP of map_maxiter L-BFGS-B iterations as the start, then
# num_warmup + num_samples NUTS iterations at max_tree_depth (NumPyro's default cap of 10 in the note)
CHAIN_SIZES: dict[str, dict[str, Any]] = {
    "smoke": dict(profile="tiny", n_features=4, n_runs=1, n_factors=1, num_warmup=8, num_samples=8,
                  max_tree_depth=4, map_maxiter=5, repeats=3),
    # quick: the quick profile's quarter-length one-eighth design, short enough for the runner's quick limit
    "quick": dict(profile="one-eighth", n_features=36, n_runs=1, n_factors=3, duration_scale=0.25, num_warmup=10,
                  num_samples=10, max_tree_depth=4, map_maxiter=20, repeats=3),
    "note": dict(profile="one-eighth", n_features=3600, n_runs=1, n_factors=3, num_warmup=200, num_samples=200,
                 max_tree_depth=10, map_maxiter=50, repeats=5),
    "full": dict(profile="one-eighth", n_features=3600, n_runs=1, n_factors=3, num_warmup=200, num_samples=200,
                 max_tree_depth=10, map_maxiter=50, repeats=5),
    "device": dict(profile="one-eighth", n_features=3600, n_runs=1, n_factors=3, num_warmup=200, num_samples=200,
                   max_tree_depth=10, map_maxiter=50, repeats=5),
}
FULL_CHAIN = (1000, 1200)  # warm-up, draws
PHASES = ("initialisation", "compilation", "warmup", "sampling", "draw_conversion", "pointwise_loglik",
          "diagnostics", "total")


def timed_sample(model, **kwargs):
    """:func:`msrm.gp.posterior.sample` of ``model`` (keywords ``kwargs``) with compilation apart: the call runs under
    :func:`msrm_lab.bench.measure.compile_seconds`, and :func:`compile_free_phases` places the compile events in
    its phases.

    Returns the Posterior with those ``timings`` (``compilation`` added, warm-up and sampling without it) and
    ``seconds_per_leapfrog`` (rescaled to the sampling seconds left); its InferenceData keeps the library's wall
    seconds. Refuses (ValueError) a ``record`` with an archive, whose writing after ``total`` would shift the phases.
    """
    from msrm.gp.posterior import sample

    if getattr(kwargs.get("record"), "archive", None) is not None:
        raise ValueError("record: timed_sample places compile events by the time the call returns, so it writes no "
                         "archive; save the InferenceData afterwards")
    with compile_seconds() as compiled:
        post = sample(model, **kwargs)
    returned = time.perf_counter()
    timings, per_leapfrog = compile_free_phases(post.timings, post.seconds_per_leapfrog, compiled, returned)
    return dataclasses.replace(post, timings=timings, seconds_per_leapfrog=per_leapfrog)


def compile_free_phases(timings: dict, seconds_per_leapfrog: float | None, compiled: CompileEvents,
                        returned: float) -> tuple[dict, float | None]:
    """(``timings`` with compilation taken out of ``warmup`` and ``sampling`` and booked as ``compilation``,
    ``seconds_per_leapfrog`` rescaled to the sampling seconds left).

    ``msrm.gp.posterior.sample`` runs ``initialisation``, ``warmup``, ``checkpoint`` (when there is one) and
    ``sampling`` back to back from the start of its ``total``, which ends just before the call returns at
    ``returned`` (a ``time.perf_counter`` time), so the windows of warm-up and sampling follow from the phases'
    seconds; the compile events of ``compiled`` that ended inside each window (:meth:`CompileEvents.between`) are
    that phase's compilation.
    """
    out = dict(timings)
    warm_start = returned - timings["total"] + timings["initialisation"]
    warm_stop = warm_start + timings["warmup"]
    sampling_start = warm_stop + timings.get("checkpoint", 0.0)
    sampling_stop = sampling_start + timings["sampling"]
    warm_c = compiled.between(warm_start, warm_stop)
    sampling_c = compiled.between(sampling_start, sampling_stop)
    out["warmup"] = timings["warmup"] - warm_c
    out["sampling"] = timings["sampling"] - sampling_c
    out["compilation"] = warm_c + sampling_c
    if seconds_per_leapfrog is not None and timings["sampling"] > 0:
        seconds_per_leapfrog = seconds_per_leapfrog * out["sampling"] / timings["sampling"]
    return out, seconds_per_leapfrog


def _model(cfg: dict, linear_algebra: str, method: str):
    import data_synth

    from msrm.gp.model import GPMSRM

    data, truth = data_synth.synthetic_dataset(profile=cfg["profile"], n_features=cfg["n_features"],
                                               n_runs=cfg["n_runs"], n_factors=cfg["n_factors"], seed=0,
                                               duration_scale=cfg.get("duration_scale", 1.0))
    return GPMSRM(data, truth.spec, linear_algebra=linear_algebra, method=method)


def _not_yet(info: dict, reason: str, **params) -> list[dict]:
    return [make_row(NOTEBOOK, exp, metric, None, unit, status="not_yet_measured", info=info, reason=reason, **params)
            for exp, metric, unit in (("objective_gradient", "value_and_grad_median_s", "s"),
                                      ("nuts", "seconds_per_leapfrog", "s"),
                                      ("nuts_vectorized", "throughput_ratio_2_vs_1", "x"),
                                      ("projection", "full_chain_seconds", "s"))]


def nuts_rows(profile: str = "quick", *, info: dict | None = None, linear_algebra: str = "grouped",
              method: str | None = None, seed: int = 0) -> list[dict]:
    """All rows of the objective/gradient, NUTS, vectorised-chains and projection experiments.

    Args:
        method: factorization path of the model NUTS runs on (``"auto"``, ``"callback"``, ``"native"``);
            ``None`` takes the profile's choice (``"native"`` for smoke/quick, ``"auto"`` otherwise). The other
            path's ``value_and_grad`` is timed beside it.
    """
    from msrm_lab.provenance import execution_info

    if profile not in SIZES:
        raise ValueError(f"profile must be one of {sorted(SIZES)}, got {profile!r}")
    cfg = SIZES[profile]
    method = method if method is not None else cfg.get("method", "auto")
    from msrm.gp.linalg import METHODS

    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    info = info if info is not None else execution_info(include_jax=True)
    common = dict(data_profile=cfg["profile"], n_features=cfg["n_features"], n_runs=cfg["n_runs"],
                  duration_scale=cfg.get("duration_scale", 1.0),
                  K=cfg["n_factors"], linear_algebra=linear_algebra, method=method, profile=profile)
    try:
        model = _model(cfg, linear_algebra, method)
    except (ImportError, NotImplementedError) as exc:
        return _not_yet(info, f"GPMSRM unavailable: {exc}", **common)
    rows: list[dict] = []
    common["num_params"] = model.num_params
    common["factorization_dims"] = model.factorization_dims

    def row(exp, metric, value, unit, status="measured", **extra):
        rows.append(make_row(NOTEBOOK, exp, metric, value, unit, status=status, info=info, **common, **extra))

    # ---- bare objective and gradient
    u0 = model.unconstrain(model.initial_params(seed=seed))
    t0 = time.perf_counter()
    value, grad = model.value_and_grad(u0)
    row("objective_gradient", "compile_and_first_call_s", time.perf_counter() - t0, "s")
    vg_s, samples = warm_median(lambda: model.value_and_grad(u0), repeats=cfg["repeats"], warmup=0)
    row("objective_gradient", "value_and_grad_median_s", vg_s, "s", samples=samples)
    # the function NUTS differentiates: jax.value_and_grad of log_density, jitted, called on a device array
    import jax
    import jax.numpy as jnp

    potential_vg = jax.jit(jax.value_and_grad(model.log_density))
    u_dev = jnp.asarray(u0)
    t0 = time.perf_counter()
    jax.block_until_ready(potential_vg(u_dev))
    pot_compile_s = time.perf_counter() - t0
    row("objective_gradient", "potential_compile_s", pot_compile_s, "s")
    pot_s, pot_samples = warm_median(lambda: potential_vg(u_dev), repeats=cfg["repeats"], warmup=0)
    row("objective_gradient", "potential_value_and_grad_median_s", pot_s, "s", samples=pot_samples)
    row("objective_gradient", "log_density", value, "", point="initial_params(seed=0)")
    row("objective_gradient", "grad_norm", float(np.linalg.norm(grad)), "", point="initial_params(seed=0)")
    other = "native" if method != "native" else "callback"
    reason = skip_reason() if cfg.get("compare_methods", True) else None
    if reason is not None:
        rows += skipped_rows(NOTEBOOK, "objective_gradient", reason, info=info,
                             metrics=(("value_and_grad_median_s", "s"),), **{**common, "method": other})
    elif cfg.get("compare_methods", True):
        alt = _model(cfg, linear_algebra, other)
        t0 = time.perf_counter()
        alt_value, alt_grad = alt.value_and_grad(u0)
        compile_alt = time.perf_counter() - t0
        alt_s, alt_samples = warm_median(lambda: alt.value_and_grad(u0), repeats=cfg["repeats"], warmup=0)
        extra = {"method": other}
        rows.append(make_row(NOTEBOOK, "objective_gradient", "compile_and_first_call_s", compile_alt, "s", info=info,
                             **{**common, **extra}))
        rows.append(make_row(NOTEBOOK, "objective_gradient", "value_and_grad_median_s", alt_s, "s", info=info,
                             samples=alt_samples, **{**common, **extra}))
        rel = abs(alt_value - value) / max(abs(value), 1e-300)
        grel = float(np.max(np.abs(alt_grad - grad)) / max(float(np.max(np.abs(grad))), 1e-300))
        row("objective_gradient", "log_density_rel_diff_between_methods", rel, "", other_method=other)
        row("objective_gradient", "grad_max_rel_diff_between_methods", grel, "", other_method=other)
        del alt

    settings = dict(num_warmup=cfg["num_warmup"], num_samples=cfg["num_samples"],
                    max_tree_depth=cfg["max_tree_depth"], seed=seed, init=u0, progress=False)
    nuts_params = {k: v for k, v in settings.items() if k not in ("init", "progress")}
    nuts_params["init"] = "initial_params"

    # ---- one chain. Predicted cost: NUTS's initialisation and compilation take several times the potential's
    # compilation, and every iteration at most 2**max_tree_depth - 1 leapfrog steps of about one bare gradient
    iterations = cfg["num_warmup"] + cfg["num_samples"]
    predicted = 6.0 * pot_compile_s + iterations * (2 ** cfg["max_tree_depth"] - 1) * pot_s
    reason = skip_reason(predicted_s=predicted)
    if reason is not None:
        return rows + skipped_rows(NOTEBOOK, "nuts", reason, info=info, chains=1,
                                   metrics=(("seconds_per_leapfrog", "s"), ("phase_seconds", "s")),
                                   **common, **nuts_params)
    with PeakMemory() as mem:
        one = timed_sample(model, num_chains=1, pointwise_loglik=True, **settings)
    for phase in PHASES:
        row("nuts", "phase_seconds", one.timings[phase], "s", phase=phase, chains=1, **nuts_params)
    ll = getattr(one.inference_data, "log_likelihood", None)
    n_points = sum(int(np.prod(ll[v].shape[2:])) for v in ll.data_vars) if ll is not None else 0
    row("nuts", "pointwise_terms", n_points, "count", chains=1, by="(stream, node)", **nuts_params)
    steps = one.sample_stats["n_steps"]
    row("nuts", "num_leapfrog_sampling", one.num_leapfrog, "steps", chains=1, **nuts_params)
    if one.num_leapfrog_warmup is not None:
        row("nuts", "num_leapfrog_warmup", one.num_leapfrog_warmup, "steps", chains=1, **nuts_params)
    row("nuts", "mean_steps_per_draw", float(steps.mean()), "steps", chains=1, **nuts_params)
    row("nuts", "mean_tree_depth", float(one.sample_stats["tree_depth"].mean()), "", chains=1, **nuts_params)
    row("nuts", "divergences", int(one.sample_stats["diverging"].sum()), "count", chains=1, **nuts_params)
    if one.seconds_per_leapfrog:
        row("nuts", "seconds_per_leapfrog", one.seconds_per_leapfrog, "s", chains=1, **nuts_params)
        row("nuts", "leapfrog_over_bare_gradient", one.seconds_per_leapfrog / pot_s, "x", chains=1,
            target=1.3, bare="jax.jit(jax.value_and_grad(model.log_density))", **nuts_params)
        row("nuts", "leapfrog_over_model_value_and_grad", one.seconds_per_leapfrog / vg_s, "x", chains=1,
            bare="model.value_and_grad", **nuts_params)
    if mem.delta_bytes is not None:
        row("nuts", "peak_memory_delta", mem.delta_bytes, "bytes", chains=1, memory_method=mem.method,
            **nuts_params)

    # ---- two vectorised chains
    if cfg["vectorized"]:
        two = timed_sample(model, num_chains=2, chain_method="vectorized", **settings)
        for phase in ("compilation", "warmup", "sampling", "total"):
            row("nuts_vectorized", "phase_seconds", two.timings[phase], "s", phase=phase, chains=2, **nuts_params)
        if one.num_leapfrog and two.num_leapfrog and one.timings["sampling"] > 0 and two.timings["sampling"] > 0:
            thr1 = one.num_leapfrog / one.timings["sampling"]
            thr2 = two.num_leapfrog / two.timings["sampling"]
            row("nuts_vectorized", "leapfrog_per_second", thr2, "1/s", chains=2, **nuts_params)
            row("nuts_vectorized", "throughput_ratio_2_vs_1", thr2 / thr1, "x", chains=2, **nuts_params)

    # ---- projection of a full chain
    if one.seconds_per_leapfrog:
        n_draws = sum(FULL_CHAIN)
        for label, spd in (("measured", float(steps.mean())), ("depth8", 255.0), ("depth10_cap", 1023.0)):
            secs = one.seconds_per_leapfrog * spd * n_draws
            row("projection", "full_chain_seconds", secs, "s", steps_per_draw=spd, basis=label,
                num_warmup_full=FULL_CHAIN[0], num_samples_full=FULL_CHAIN[1], **nuts_params)
            row("projection", "full_chain_days", secs / 86400.0, "day", steps_per_draw=spd, basis=label,
                num_warmup_full=FULL_CHAIN[0], num_samples_full=FULL_CHAIN[1], **nuts_params)
    return rows


# ------------------------------------------------------------------------------------------ a measured chain


def tree_depths(n_steps) -> np.ndarray:
    """NUTS tree depth of every iteration from its leapfrog count: ``floor(log2(n)) + 1`` for ``n >= 1``.

    NumPyro doubles the trajectory until it turns, diverges or reaches ``max_tree_depth``; after ``d`` doublings it
    has taken between ``2**(d - 1)`` and ``2**d - 1`` steps (a subtree stopped part-way still counts as a doubling),
    so the depth is the bit length of ``num_steps``. Computed on integers, so no rounding of ``log2`` enters.
    """
    n = np.asarray(n_steps)
    if n.size and (not np.issubdtype(n.dtype, np.integer) or int(n.min()) < 1):
        raise ValueError("n_steps must be positive integers (NumPyro's num_steps of every iteration)")
    return np.vectorize(lambda v: int(v).bit_length(), otypes=[np.int64])(n) if n.size else n.astype(np.int64)


def _depth_summary(n_steps: np.ndarray, max_tree_depth: int) -> dict[str, Any]:
    depth = tree_depths(n_steps).ravel()
    steps = np.asarray(n_steps).ravel()
    return {
        "mean_steps": float(steps.mean()), "median_steps": float(np.median(steps)), "max_steps": int(steps.max()),
        "total_steps": int(steps.sum()), "mean_depth": float(depth.mean()), "median_depth": float(np.median(depth)),
        "max_depth": int(depth.max()), "fraction_at_cap": float(np.mean(depth >= max_tree_depth)),
        "histogram": {d: int(np.sum(depth == d)) for d in range(1, max_tree_depth + 1)},
    }


def chain_statistics(post, max_tree_depth: int) -> dict[str, Any]:
    """What the ``nuts_chain`` rows report of one :class:`msrm.gp.posterior.Posterior` (any number of chains).

    Returns a dict: ``sampling`` and ``warmup`` (None without warm-up tree sizes) tree summaries (mean, median and
    maximum of steps and of :func:`tree_depths`, the fraction at the cap, a count per depth 1..max_tree_depth),
    ``step_size`` (the adapted one, per chain), ``divergences``, ``accept_mean``, ``ess_bulk_min`` with its
    ``slowest_parameter``, ``ess_bulk_min_by_variable``, ``r_hat_max``, ``unconstrained_sd`` (min and max over
    parameters of the draws' sd on the sampler's scale), and the seconds per leapfrog of warm-up and sampling.
    """
    stats = post.sample_stats
    out: dict[str, Any] = {"sampling": _depth_summary(stats["n_steps"], max_tree_depth)}
    warm = post.warmup_n_steps
    out["warmup"] = _depth_summary(warm, max_tree_depth) if warm is not None and np.size(warm) else None
    out["step_size"] = [float(v) for v in np.asarray(stats["step_size"])[:, -1]]
    out["divergences"] = int(np.asarray(stats["diverging"]).sum())
    out["accept_mean"] = float(np.mean(stats["acceptance_rate"]))
    summary = post.summary
    ess = summary["ess_bulk"].astype(float).dropna() if summary is not None and len(summary) else ()
    if len(ess):  # a parameter with constant draws has no ESS (NaN) and is left out
        out["ess_bulk_min"] = float(ess.min())
        out["slowest_parameter"] = str(ess.idxmin())
        variable = [str(label).split("[")[0] for label in ess.index]
        out["ess_bulk_min_by_variable"] = {k: float(v) for k, v in ess.groupby(variable).min().items()}
        r_hat = summary["r_hat"].astype(float).dropna()
        if len(r_hat):
            out["r_hat_max"] = float(r_hat.max())
    sd = post.draws_u.reshape(-1, post.draws_u.shape[-1]).std(axis=0)
    out["unconstrained_sd"] = {"min": float(sd.min()), "max": float(sd.max())}
    out["seconds_per_leapfrog"] = post.seconds_per_leapfrog
    warm_steps = post.num_leapfrog_warmup
    out["seconds_per_leapfrog_warmup"] = (post.timings["warmup"] / warm_steps) if warm_steps else None
    return out


def chain_rows(profile: str = "quick", *, info: dict | None = None, linear_algebra: str = "state_space",
               method: str = "auto", seed: int = 0) -> list[dict]:
    """Rows of the ``nuts_chain`` experiment (see the module docstring; sizes in :data:`CHAIN_SIZES`).

    The bare gradient is ``jax.jit(jax.value_and_grad(model.log_density))``, timed ``repeats`` times at the model's
    data-driven start before the chain and ``repeats`` times at its last draw after it; its median over both
    divides the seconds per leapfrog of sampling.
    """
    from msrm_lab.provenance import execution_info

    if profile not in CHAIN_SIZES:
        raise ValueError(f"profile must be one of {sorted(CHAIN_SIZES)}, got {profile!r}")
    from msrm.gp.linalg import METHODS

    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    cfg = CHAIN_SIZES[profile]
    info = info if info is not None else execution_info(include_jax=True)
    settings = dict(num_warmup=cfg["num_warmup"], num_samples=cfg["num_samples"],
                    max_tree_depth=cfg["max_tree_depth"], seed=seed)
    common = dict(data_profile=cfg["profile"], n_features=cfg["n_features"], n_runs=cfg["n_runs"],
                  duration_scale=cfg.get("duration_scale", 1.0), K=cfg["n_factors"], linear_algebra=linear_algebra,
                  method=method, profile=profile, init="map", map_maxiter=cfg["map_maxiter"], **settings)
    reason = skip_reason()
    if reason is not None:
        return skipped_rows(NOTEBOOK, "nuts_chain", reason, info=info, metrics=(("seconds_per_leapfrog", "s"),),
                            **common)
    try:
        model = _model(cfg, linear_algebra, method)
    except (ImportError, NotImplementedError) as exc:
        return [make_row(NOTEBOOK, "nuts_chain", "seconds_per_leapfrog", None, "s", status="not_yet_measured",
                         info=info, reason=f"GPMSRM unavailable: {exc}", **common)]
    import jax
    import jax.numpy as jnp

    common["num_params"] = model.num_params
    rows: list[dict] = []

    def row(metric, value, unit, status="measured", **extra):
        rows.append(make_row(NOTEBOOK, "nuts_chain", metric, value, unit, status=status, info=info,
                             **{**common, **extra}))

    potential_vg = jax.jit(jax.value_and_grad(model.log_density))
    u0 = jnp.asarray(model.unconstrain(model.initial_params(seed=seed)))
    t0 = time.perf_counter()
    jax.block_until_ready(potential_vg(u0))
    compile_s = time.perf_counter() - t0
    row("potential_compile_s", compile_s, "s")
    _, before = warm_median(lambda: potential_vg(u0), repeats=cfg["repeats"], warmup=0)
    # predicted cost, as for the short chain of nuts_rows, plus the MAP start (about two gradients an iteration)
    pot_s = float(np.median(before))
    predicted = (6.0 * compile_s + 2 * cfg["map_maxiter"] * pot_s
                 + (cfg["num_warmup"] + cfg["num_samples"]) * (2 ** cfg["max_tree_depth"] - 1) * pot_s)
    reason = skip_reason(predicted_s=predicted)
    if reason is not None:
        return rows + skipped_rows(NOTEBOOK, "nuts_chain", reason, info=info,
                                   metrics=(("seconds_per_leapfrog", "s"),), **common)

    with PeakMemory() as mem:
        post = timed_sample(model, init="map", map_options={"maxiter": cfg["map_maxiter"]}, progress=False,
                            diagnostics=True, **settings)
    u_last = jnp.asarray(post.draws_u[0, -1])
    jax.block_until_ready(potential_vg(u_last))
    _, after = warm_median(lambda: potential_vg(u_last), repeats=cfg["repeats"], warmup=0)
    bare = float(np.median(before + after))
    row("potential_value_and_grad_median_s", bare, "s", samples=before + after, points="start, last draw")

    for phase in (p for p in PHASES if p != "pointwise_loglik"):  # not asked of this chain
        row("phase_seconds", post.timings[phase], "s", phase=phase)
    if post.map_result is not None:
        row("map_iterations", post.map_result.diagnostics.get("iterations", 0), "count")
    st = chain_statistics(post, cfg["max_tree_depth"])
    for phase, summ in (("sampling", st["sampling"]), ("warmup", st["warmup"])):
        if summ is None:
            continue
        for metric, key, unit in (("num_leapfrog", "total_steps", "steps"), ("mean_steps", "mean_steps", "steps"),
                                  ("median_steps", "median_steps", "steps"), ("max_steps", "max_steps", "steps"),
                                  ("mean_tree_depth", "mean_depth", ""), ("median_tree_depth", "median_depth", ""),
                                  ("max_tree_depth_reached", "max_depth", ""),
                                  ("fraction_at_depth_cap", "fraction_at_cap", "")):
            row(metric, summ[key], unit, nuts_phase=phase)
        for depth, count in summ["histogram"].items():
            row("iterations_at_tree_depth", count, "count", nuts_phase=phase, depth=depth)
    row("step_size_after_adaptation", st["step_size"][0], "")
    row("divergences", st["divergences"], "count", nuts_phase="sampling")
    row("mean_accept_prob", st["accept_mean"], "", nuts_phase="sampling")
    row("unconstrained_sd_min", st["unconstrained_sd"]["min"], "")
    row("unconstrained_sd_max", st["unconstrained_sd"]["max"], "")
    if st["seconds_per_leapfrog"]:
        row("seconds_per_leapfrog", st["seconds_per_leapfrog"], "s", nuts_phase="sampling")
        row("leapfrog_over_bare_gradient", st["seconds_per_leapfrog"] / bare, "x", nuts_phase="sampling",
            target=1.3, bare="jax.jit(jax.value_and_grad(model.log_density))")
    if st["seconds_per_leapfrog_warmup"]:
        row("seconds_per_leapfrog", st["seconds_per_leapfrog_warmup"], "s", nuts_phase="warmup")
    if "ess_bulk_min" in st:
        row("ess_bulk_min", st["ess_bulk_min"], "", parameter=st["slowest_parameter"])
        for variable, ess in st["ess_bulk_min_by_variable"].items():
            row("ess_bulk_min_by_variable", ess, "", variable=variable)
        if "r_hat_max" in st:
            row("r_hat_max", st["r_hat_max"], "")
        for basis, secs in (("sampling", post.timings["sampling"]),
                            ("warmup_and_sampling", post.timings["warmup"] + post.timings["sampling"])):
            if secs > 0:
                row("ess_bulk_min_per_hour", st["ess_bulk_min"] / (secs / 3600.0), "1/h", basis=basis,
                    parameter=st["slowest_parameter"])
    if mem.delta_bytes is not None:
        row("peak_memory_delta", mem.delta_bytes, "bytes", memory_method=mem.method)

    # ---- the full chain (1000 + 1200) at the measured seconds per leapfrog and trajectory lengths
    spl = st["seconds_per_leapfrog"]
    if spl:
        warm_mean = st["warmup"]["mean_steps"] if st["warmup"] is not None else st["sampling"]["mean_steps"]
        bases = (("measured_trajectories", warm_mean, st["sampling"]["mean_steps"]),
                 ("sampling_trajectories", st["sampling"]["mean_steps"], st["sampling"]["mean_steps"]),
                 ("depth_cap", 2.0 ** cfg["max_tree_depth"] - 1, 2.0 ** cfg["max_tree_depth"] - 1))
        for basis, warm_steps, draw_steps in bases:
            secs = spl * (warm_steps * FULL_CHAIN[0] + draw_steps * FULL_CHAIN[1])
            extra = dict(basis=basis, warmup_steps_per_iteration=warm_steps, steps_per_draw=draw_steps,
                         num_warmup_full=FULL_CHAIN[0], num_samples_full=FULL_CHAIN[1], target_hours=8.0)
            row("full_chain_seconds", secs, "s", status="projected", **extra)
            row("full_chain_hours", secs / 3600.0, "h", status="projected", **extra)
    return rows
