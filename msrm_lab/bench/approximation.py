"""The Laplace approximation beside NUTS on one dataset, and what the approximation costs beside GP-MAP.

In one process, float64, on the state-space backend, for one dataset of a ``data_synth`` design (``small``: one
60 s run, two brain participants of 20 features and two rating + physiology participants):

1. GP-MAP: :func:`msrm.gp.map.fit_map` from the model's data-driven start, timed (``wall_s``, ``fit="gp_map"``).
2. The approximation: ``model.approximate_posterior(init=<that MAP>)`` with the library's defaults, timed; with
   the mode given, its wall time is the Hessian (``2 d`` gradient calls for ``d`` unconstrained parameters), the
   draws, the model's log density at every draw (the importance ESS that says how far the Gaussian is from the
   posterior) and the draws' conversion to physical units, each phase recorded. From scratch the approximation
   costs GP-MAP plus that, so ``approximation_over_gp_map = (t_map + t_laplace) / t_map``.
3. The reference: NUTS (``model.sample``) started from the same MAP, several chains, timed.
4. Per test quantity (every response parameter of every participant stream, every lengthscale, the noise sd of
   each rating and physiology stream's first feature; all sign-invariant, so label switching of the factors does
   not enter), from the draws of both in physical units:

   * ``mean_shift_in_nuts_sd``: ``(mean_laplace - mean_nuts) / sd_nuts``;
   * ``sd_ratio``: ``sd_laplace / sd_nuts`` (1 when the widths agree, below 1 when the approximation is too narrow);
   * ``nuts_mass_in_laplace_90``: the fraction of NUTS draws inside the approximation's central 90% interval
     (0.90 when the two marginals agree; lower when the approximation is narrow or shifted).

   NUTS is the reference, but a Monte Carlo one: every quantity's row carries NUTS's bulk ESS (ArviZ) and R-hat, and
   the standard error of the NUTS mean in NUTS sd units is ``1 / sqrt(ESS)``, the scale below which a mean shift is
   not resolved.
5. The one-eighth design (K = 3, 3,600 features; note profile): the model's seconds per
   ``value_and_grad`` (warm median) and its ``d``, from which the finite-difference Hessian's ``2 d`` calls are
   projected (status ``projected``): the approximation's cost where the note measures GP-MAP's time to result.

The notebook's time budget (:func:`msrm_lab.budget.skip_reason`) is asked three times: before anything (a spent
budget skips the whole experiment), before NUTS (predicted from the measured gradient time at the depth cap,
``chains x iterations x (2**max_tree_depth - 1)`` gradients, an upper bound) and before the one-eighth projection;
what it skips is recorded as ``not_yet_measured`` rows with the reason.
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np

from msrm_lab.budget import skip_reason, skipped_rows
from .measure import warm_median
from .rows import make_row

__all__ = ["SIZES", "posterior_quantities", "compare_marginals", "central_interval_mass",
           "approximation_rows"]

NOTEBOOK = "calibration"
EXPERIMENT = "approximation"

#: the settings per profile. ``nuts``: ``model.sample`` keywords; ``laplace_draws``: the approximation's draws;
#: ``projection``: the one-eighth case whose gradient is timed for the projected Hessian cost (None: not run).
SIZES: dict[str, dict[str, Any]] = {
    # smoke and quick: no NUTS (its compilation alone takes a minute, and the quick profile's budget goes to the SBC
    # replications); the comparison with NUTS runs in the note profile
    "smoke": dict(design="small", seed=0, duration=30.0, n_factors=1, laplace_draws=100, map_maxiter=200,
                  nuts=None, projection=None),
    "quick": dict(design="small", seed=0, duration=None, n_factors=None, laplace_draws=200, map_maxiter=500,
                  nuts=None, projection=None),
    "note": dict(design="small", seed=0, duration=None, n_factors=None, laplace_draws=2000, map_maxiter=500,
                 nuts=dict(num_warmup=300, num_samples=300, num_chains=2, max_tree_depth=6),
                 projection=dict(profile="one-eighth", n_features=3600, n_factors=3, repeats=3)),
}
SIZES["full"] = SIZES["note"]

def posterior_quantities(posterior) -> dict[str, np.ndarray]:
    """The test quantities (module docstring, step 4) of every draw, read from the physical ``posterior`` group.

    Args:
        posterior: a :class:`msrm.gp.posterior.Posterior` (NUTS or the approximation; the groups are the same).
    Returns:
        ``{name: (chains, draws) array}``; names are ``"<parameter>/<modality>"`` (response parameters, shared by
        the modality's participants), ``"lengthscale[k]"`` and ``"noise_sd/<participant>/<modality>[0]"``.
    """
    group = posterior.inference_data.posterior
    names = list(group.data_vars)
    out: dict[str, np.ndarray] = {}
    for var in names:
        parts = var.split("|")
        if parts[0] == "response":
            out[f"{parts[2]}/{parts[1]}"] = np.asarray(group[var].values, dtype=np.float64)
    lengthscales = np.asarray(group["lengthscales"].values, dtype=np.float64)
    for k in range(lengthscales.shape[2]):
        out[f"lengthscale[{k}]"] = lengthscales[:, :, k]
    for var in names:
        parts = var.split("|")
        if parts[0] == "noise_sd" and parts[2] != "brain":
            out[f"noise_sd/{parts[1]}/{parts[2]}[0]"] = np.asarray(group[var].values, dtype=np.float64)[:, :, 0]
    return out


def central_interval_mass(reference: np.ndarray, approximate: np.ndarray, level: float = 0.9) -> float:
    """The fraction of ``reference`` draws inside the central ``level`` interval of ``approximate``'s draws
    (empirical quantiles ``(1 - level)/2`` and ``(1 + level)/2``); ``level`` when the two distributions agree."""
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must lie in (0, 1), got {level}")
    reference = np.asarray(reference, dtype=np.float64).ravel()
    lo, hi = np.quantile(np.asarray(approximate, dtype=np.float64).ravel(), [(1 - level) / 2, (1 + level) / 2])
    return float(np.mean((reference >= lo) & (reference <= hi)))


def compare_marginals(reference: np.ndarray, approximate: np.ndarray) -> dict[str, float]:
    """One quantity's marginal under an approximation beside a reference sampler's.

    Args:
        reference: (chains, draws) draws of the reference (NUTS).
        approximate: draws of the approximation (any shape).
    Returns:
        ``mean_ref``, ``sd_ref``, ``mean_approx``, ``sd_approx``, ``mean_shift_in_nuts_sd`` (``(mean_approx -
        mean_ref) / sd_ref``), ``sd_ratio`` (``sd_approx / sd_ref``), ``nuts_mass_in_laplace_90`` (the
        reference's mass inside the approximation's central 90% interval), ``ess_bulk_ref`` and
        ``rhat_ref`` (rank-normalised, :func:`msrm.diagnostics.summarize`, equal to ArviZ's).
    """
    from msrm.diagnostics import summarize

    ref = np.asarray(reference, dtype=np.float64)
    if ref.ndim != 2:
        raise ValueError(f"reference must be (chains, draws), got shape {ref.shape}")
    app = np.asarray(approximate, dtype=np.float64).ravel()
    m_r, s_r = float(ref.mean()), float(ref.std(ddof=1))
    m_a, s_a = float(app.mean()), float(app.std(ddof=1))
    diag = summarize(ref).iloc[0]
    ess = float(diag["ess_bulk"])
    rhat = float(diag["r_hat"]) if ref.shape[0] > 1 else float("nan")
    return {"mean_ref": m_r, "sd_ref": s_r, "mean_approx": m_a, "sd_approx": s_a,
            "mean_shift_in_nuts_sd": (m_a - m_r) / s_r if s_r > 0 else float("nan"),
            "sd_ratio": s_a / s_r if s_r > 0 else float("nan"),
            "nuts_mass_in_laplace_90": central_interval_mass(ref, app, 0.9),
            "ess_bulk_ref": ess, "rhat_ref": rhat}


def _nuts_upper_s(nuts: dict, grad_s: float) -> float:
    """The longest a NUTS run can take: every iteration of every chain at the depth cap (``2**depth - 1``
    gradients), each gradient at its measured warm time ``grad_s``."""
    iterations = nuts["num_chains"] * (nuts["num_warmup"] + nuts["num_samples"])
    return iterations * (2 ** nuts["max_tree_depth"] - 1) * grad_s


def _sampler(posterior) -> dict:
    """The ``sampler`` attribute of a posterior's draws (stored as JSON text)."""
    import json

    raw = posterior.inference_data.posterior.attrs.get("sampler", {})
    return json.loads(raw) if isinstance(raw, str) else dict(raw)


def _kind(name: str) -> str:
    """A test quantity's kind for the rows: ``"lengthscale"``, ``"noise_sd"`` or ``"response"``."""
    if name.startswith("lengthscale"):
        return "lengthscale"
    if name.startswith("noise_sd"):
        return "noise_sd"
    return "response"


def approximation_rows(profile: str = "quick", *, info: dict | None = None, **overrides: Any) -> list[dict]:
    """Run ``SIZES[profile]`` (module docstring) and return its rows.

    Args:
        profile: a key of :data:`SIZES`.
        info: ``execution_info()`` for every row (computed once if omitted).
        overrides: replace entries of the profile's settings (e.g. ``nuts=dict(num_warmup=20, ...)``).
    """
    import data_synth.designs as designs

    from msrm.gp.model import GPMSRM
    from msrm_lab.provenance import execution_info

    if profile not in SIZES:
        raise ValueError(f"profile must be one of {sorted(SIZES)}, got {profile!r}")
    unknown = sorted(set(overrides) - set(SIZES[profile]))
    if unknown:
        raise ValueError(f"unknown setting(s) {unknown}; the settings are {sorted(SIZES[profile])}")
    cfg = {**SIZES[profile], **overrides}
    info = info if info is not None else execution_info(include_jax=True)
    design = {k: cfg[k] for k in ("duration", "n_factors") if cfg[k] is not None}
    common = dict(profile=profile, design=cfg["design"], seed=cfg["seed"], linear_algebra="state_space", **design)
    reason = skip_reason()
    if reason is not None:
        return skipped_rows(NOTEBOOK, EXPERIMENT, reason, info=info, metrics=(("wall_s", "s"), ("sd_ratio", "x")),
                            **common)
    data, spec, _ = designs.make_design(cfg["design"], cfg["seed"], **design)
    model = GPMSRM(data, spec, linear_algebra="state_space")
    common.update(K=spec.n_factors, num_params=model.num_params)
    rows: list[dict] = []

    def row(metric, value, unit, status="measured", **extra):
        rows.append(make_row(NOTEBOOK, EXPERIMENT, metric, value, unit, status=status, info=info, **common, **extra))

    # the gradient's warm time predicts the NUTS run (at most 2**depth - 1 steps per iteration) for the budget
    u0 = model.unconstrain(model.initial_params(seed=cfg["seed"]))
    model.value_and_grad(u0)
    grad_s, _ = warm_median(lambda: model.value_and_grad(u0), repeats=3, warmup=0)
    row("value_and_grad_median_s", grad_s, "s")

    t0 = time.perf_counter()
    fit = model.fit_map(seed=cfg["seed"], maxiter=cfg["map_maxiter"], progress=False)
    t_map = time.perf_counter() - t0
    row("wall_s", t_map, "s", fit="gp_map", converged=bool(fit.converged), iterations=len(fit.history) - 1)
    t0 = time.perf_counter()
    lap = model.approximate_posterior(init=fit, num_samples=cfg["laplace_draws"], seed=cfg["seed"],
                                      diagnostics=False)
    t_lap = time.perf_counter() - t0
    row("wall_s", t_lap, "s", fit="laplace_given_mode", laplace_draws=cfg["laplace_draws"],
        phases={k: float(v) for k, v in lap.timings.items()},
        importance_ess=_sampler(lap).get("importance_ess"))
    row("approximation_over_gp_map", (t_map + t_lap) / t_map, "x", target=2.0,
        basis="(GP-MAP + approximation given the mode) / GP-MAP, this design")

    nuts = dict(cfg["nuts"]) if cfg["nuts"] is not None else None
    if nuts is None:
        rows.append(make_row(NOTEBOOK, EXPERIMENT, "sd_ratio", None, "x", status="not_yet_measured", info=info,
                             reason=f"the {profile} profile runs no NUTS (the note profile does)",
                             fit="nuts", **common))
    else:
        predicted = _nuts_upper_s(nuts, grad_s)
        reason = skip_reason(predicted_s=predicted)
        if reason is not None:
            rows += skipped_rows(NOTEBOOK, EXPERIMENT, reason, info=info, metrics=(("sd_ratio", "x"),
                                 ("wall_s", "s")), fit="nuts", predicted_upper_s=predicted, **common, **nuts)
        else:
            t0 = time.perf_counter()
            ref = model.sample(init=fit, seed=cfg["seed"], progress=False, diagnostics=False, **nuts)
            t_nuts = time.perf_counter() - t0
            divergences = int(np.asarray(ref.sample_stats["diverging"]).sum())
            row("wall_s", t_nuts, "s", fit="nuts", divergences=divergences, **nuts)
            q_ref = posterior_quantities(ref)
            q_lap = posterior_quantities(lap)
            for name, ref_draws in q_ref.items():
                stats = compare_marginals(ref_draws, q_lap[name])
                for metric, unit in (("sd_ratio", "x"), ("mean_shift_in_nuts_sd", "sd"),
                                     ("nuts_mass_in_laplace_90", "1")):
                    row(metric, stats[metric], unit, quantity=name, kind=_kind(name), divergences=divergences,
                        **{k: v for k, v in stats.items() if k != metric}, **nuts)

    proj = cfg["projection"]
    if proj is None:
        return rows
    reason = skip_reason(predicted_s=60.0)
    pparams = dict(data_profile=proj["profile"], n_features=proj["n_features"], K_projection=proj["n_factors"])
    if reason is not None:
        return rows + skipped_rows(NOTEBOOK, EXPERIMENT, reason, info=info,
                                   metrics=(("laplace_hessian_s", "s"),), **common, **pparams)
    import data_synth

    big_data, truth = data_synth.synthetic_dataset(profile=proj["profile"], n_features=proj["n_features"],
                                                   n_factors=proj["n_factors"], seed=0)
    big = GPMSRM(big_data, truth.spec, linear_algebra="state_space")
    ub = big.unconstrain(big.initial_params(seed=0))
    big.value_and_grad(ub)
    g_s, samples = warm_median(lambda: big.value_and_grad(ub), repeats=proj["repeats"], warmup=0)
    row("value_and_grad_median_s", g_s, "s", samples=samples, projected_num_params=big.num_params, **pparams)
    row("laplace_hessian_s", 2 * big.num_params * g_s, "s", status="projected", projected_num_params=big.num_params,
        basis="2 d calls of value_and_grad at its measured warm median (central differences, one column each)",
        **pparams)
    return rows
