"""Model checking (notebook stem ``model_checking``): choosing the number of factors K by cross-validation.

``choose_k_rows(profile)`` builds a synthetic study with a known K, runs ``cross_validate`` (msrm.validation) with
R-MSRM and the ``"features"`` mask (each fold holds out a group of brain features inside one time window; the
one-feature rating and physiology streams are never held out) for every candidate K, and returns results rows
(``msrm_lab.bench.rows.make_row``, param ``modality="brain"`` on the scores): per K the held-out log predictive
density of the brain features (summed over folds and streams), beside it the naive baseline's
(``heldout_lpd_naive``: each feature's in-fold mean and sd), the pooled held-out R^2 (about each feature's in-fold
mean), the coverage of the central 90% predictive intervals, whether every fold's fit converged
(``converged``, 1 or 0) and the wall seconds of the cross-validation; then the K with the largest held-out density
(``chosen_k``) next to the true K. A K with a fold whose fit did not converge is not scored: its score rows have
``status="refused"`` and the reason, and it is not a candidate for ``chosen_k``. A notebook cell is
``rows = choose_k_rows(profile)`` followed by a table of the rows.

``gap_rows(profile)`` asks whether GP-MAP's predictive distribution is calibrated across a gap in time. It
cross-validates GP-MAP (state space, ``"time_blocks"`` mask: every stream of a run held out in the same window)
on two 60 s studies of the same shape (2 brain participants x 20 features, 2 rating and 2 physiology
participants, 1 s latent grid): ``"gp_draws"``, whose latents are drawn from the Matern-3/2 prior the fit uses
(``data_synth.synthetic_dataset``, profile ``tiny`` stretched to 60 s), and ``"sinusoids"``, the recovery design
``small`` whose latents are sums of sinusoids (``data_synth.designs``), fitted with Matern-3/2 and with
Matern-7/2 (the kernel ``kernel="auto"`` picks there). Each held-out window is labelled by its position:
``edge`` (the first or last window of a run: the fit sees data on one side only and extrapolates) or
``interior`` (data on both sides: interpolation). Rows per (study, kernel, seed, modality, position): the
coverage of the central 50% and 90% predictive intervals, the held-out log predictive density per value beside
the naive predictive's (each feature's in-fold mean and sd), and the mean squared standardised error
``E[((y - m) / v)^2]`` (1 when the predictive sd is right on average, above 1 when it is too small); and per
(study, kernel, modality, position) the PIT histogram (``pit_fraction``, ten bins of width 0.1, pooled over
seeds). On the study drawn from the prior the same folds are also scored at the true parameters, with no fit
(``parameters="true"``, beside ``"map"``): a calibrated predictive there and a narrow one at the MAP place the
shortfall in the estimated parameters rather than in the predictive computation. Every study is also scored with
the parameters' uncertainty integrated (``parameters="laplace"``: cross_validate's ``predictive="laplace"``, draws
of the Laplace approximation at each fold's MAP), which says how much of that shortfall the parameters' local
Gaussian uncertainty accounts for.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np

import data_synth
from msrm.validation import NotConvergedError, cross_validate

from msrm_lab.budget import skip_reason, skippable, skipped_rows
from .rows import make_row

__all__ = ["SIZES", "GAP_SIZES", "NOTEBOOK", "choose_k_rows", "gap_rows", "gap_scores", "PARAMETER_SOURCES"]

NOTEBOOK = "model_checking"
# the modality the features mask holds out in these studies (the only one with at least ``folds`` features)
HELD_MODALITY = "brain"
# score rows per K: metric, unit and the column of CVResult.by_modality it reads
SCORES = (("heldout_lpd", "nats", "lpd"), ("heldout_lpd_naive", "nats", "lpd_naive"), ("heldout_r2", "1", "r2"),
          ("heldout_coverage_90", "1", "coverage_90"))

# the study (data_synth arguments), its true K, the candidate Ks and the cross-validation settings per profile
# (max_iter: fit_rmsrm's default, 100 per phase, so that the folds' fits converge)
SIZES = {
    "smoke": dict(study=dict(profile="tiny", n_features=20, n_runs=2, duration_scale=2.0, seed=3), true_k=2,
                  ks=(1, 2, 3), folds=4, fit=dict(restarts=1, max_iter=100)),
    "quick": dict(study=dict(profile="one-eighth", n_features=60, n_runs=1, duration_scale=0.5, seed=0), true_k=3,
                  ks=(1, 2, 3, 4), folds=4, fit=dict(restarts=1, max_iter=100)),
    "note": dict(study=dict(profile="one-eighth", n_features=360, n_runs=1, duration_scale=1.0, seed=0), true_k=3,
                 ks=(1, 2, 3, 4, 5, 6), folds=5, fit=dict(restarts=4, max_iter=100)),
}
SIZES["full"] = SIZES["note"]


def choose_k_rows(profile: str, *, info=None, n_jobs: int | None = 1) -> list[dict]:
    """Held-out scores of R-MSRM for each candidate K and the chosen K (module docstring).

    Args:
        profile: a key of :data:`SIZES` (``"smoke"``, ``"quick"``, ``"note"``, ``"full"``).
        info: ``execution_info()`` to attach to every row (computed once if omitted).
        n_jobs: worker processes for the restarts of each fold's fit (``msrm.fit_rmsrm``).
    """
    if profile not in SIZES:
        raise ValueError(f"profile must be one of {sorted(SIZES)}, got {profile!r}")
    sz = SIZES[profile]
    if info is None:
        from msrm_lab.provenance import execution_info

        info = execution_info()
    data, truth = data_synth.synthetic_dataset(n_factors=sz["true_k"], **sz["study"])
    common = dict(profile=profile, study=sz["study"]["profile"], n_features=sz["study"]["n_features"],
                  n_runs=sz["study"]["n_runs"], true_k=sz["true_k"], folds=sz["folds"], method="rmsrm",
                  mask="features", **sz["fit"])
    rows, lpd = [], {}
    for K in sz["ks"]:
        spec = dataclasses.replace(truth.spec, n_factors=K)
        t0 = time.perf_counter()
        try:
            res = cross_validate(data, spec, method="rmsrm", folds=sz["folds"], mask="features", seed=0,
                                 n_jobs=n_jobs, progress=False, **sz["fit"])
        except NotConvergedError as exc:
            res, refused = None, str(exc)
        wall = time.perf_counter() - t0
        rows.append(make_row(NOTEBOOK, "choose_k", "converged", 0.0 if res is None else 1.0, "1", info=info, K=K,
                             **common))
        for metric, unit, column in SCORES:
            if res is None:
                rows.append(make_row(NOTEBOOK, "choose_k", metric, None, unit, status="refused", info=info, K=K,
                                     modality=HELD_MODALITY, reason=refused, **common))
            else:
                scores = res.by_modality.loc[HELD_MODALITY]
                rows.append(make_row(NOTEBOOK, "choose_k", metric, float(scores[column]), unit, info=info, K=K,
                                     modality=HELD_MODALITY, n_heldout=int(scores["n_heldout"]), **common))
        if res is not None:
            lpd[K] = float(res.by_modality.loc[HELD_MODALITY, "lpd"])
        rows.append(make_row(NOTEBOOK, "choose_k", "wall_s", wall, "s", info=info, K=K, **common))
    scored = [K for K in sz["ks"] if K in lpd]
    if lpd:
        rows.append(make_row(NOTEBOOK, "choose_k", "chosen_k", max(lpd, key=lpd.get), "factors", info=info,
                             candidates=scored, **common))
    else:
        rows.append(make_row(NOTEBOOK, "choose_k", "chosen_k", None, "factors", status="refused", info=info,
                             candidates=scored, reason="no candidate K was scored: no fit converged", **common))
    return rows


# the gap-calibration studies per profile: seeds, folds (time windows per run) and the kernels fitted to the
# sinusoidal design (the GP-draw study is fitted with the kernel it was drawn from)
GAP_SIZES = {
    "smoke": dict(seeds=(0,), folds=3, kernels=("matern32",), studies=("sinusoids",), laplace_draws=20),
    "quick": dict(seeds=(0,), folds=4, kernels=("matern32",), studies=("gp_draws", "sinusoids"), laplace_draws=50),
    "note": dict(seeds=(0, 1, 2), folds=5, kernels=("matern32", "matern72"), studies=("gp_draws", "sinusoids"),
                 laplace_draws=100),
}
# the fitted predictives scored per study: (``parameters`` in the rows, cross_validate's ``predictive``)
PARAMETER_SOURCES = (("map", "plugin"), ("laplace", "laplace"))
GAP_SIZES["full"] = GAP_SIZES["note"]
PIT_BINS = 10


def _gap_study(study: str, seed: int):
    """(data, spec, true params or None) of a gap-calibration study (module docstring); the sinusoidal design was
    not drawn from the model, so it has no true parameters."""
    if study == "gp_draws":
        data, truth = data_synth.synthetic_dataset(profile="tiny", n_features=20, duration_scale=2.5, n_factors=2,
                                                   seed=seed, kernel="matern32")
        return data, truth.spec, truth.params
    if study == "sinusoids":
        from data_synth.designs import make_design

        data, spec, _ = make_design("small", seed)
        return data, spec, None
    raise ValueError(f"unknown gap-calibration study {study!r}")


def gap_scores(res, n_folds: int) -> tuple[dict, dict]:
    """Scores of one cross-validation by (modality, position) from its per-value table (``CVResult.pit``).

    A fold's window is ``edge`` when it is the first or last of the run, else ``interior``. With ``u = PIT``
    of a held-out value, its standardised error is ``Phi^-1(u)`` (a PIT that rounds to 0 or 1 in float64, ``|z|``
    beyond about 8.2, counts as ``|z| = 8.2``, so ``mean_sq_z`` is then a lower bound); coverage of the central
    interval of mass c is the fraction with ``|u - 1/2| < c / 2``.

    Returns:
        (scores, pit): ``scores[(modality, position)]`` a dict of ``n``, ``coverage_50``, ``coverage_90``,
        ``mean_sq_z``; ``pit[(modality, position)]`` the (n,) PIT values.
    """
    from scipy.stats import norm

    table = res.pit
    position = np.where(np.isin(table["fold"].to_numpy(), (0, n_folds - 1)), "edge", "interior")
    scores, pits = {}, {}
    for (modality, pos), g in table.assign(position=position).groupby(["modality", "position"]):
        u = g["pit"].to_numpy(dtype=np.float64)
        z = norm.ppf(np.clip(u, 1e-300, 1 - 1e-16))
        scores[(modality, pos)] = {"n": int(u.size), "coverage_50": float(np.mean(np.abs(u - 0.5) < 0.25)),
                                   "coverage_90": float(np.mean(np.abs(u - 0.5) < 0.45)),
                                   "mean_sq_z": float(np.mean(z * z))}
        pits[(modality, pos)] = u
    return scores, pits


def _lpd_by_position(res, n_folds: int) -> dict:
    """Per (modality, position): (lpd per value, naive lpd per value), summed over folds and streams."""
    f = res.folds
    pos = np.where(np.isin(f["fold"].to_numpy(), (0, n_folds - 1)), "edge", "interior")
    out = {}
    for (modality, p), g in f.assign(position=pos).groupby(["modality", "position"]):
        n = float(g["n_heldout"].sum())
        out[(modality, p)] = (float(g["lpd"].sum()) / n, float(g["lpd_naive"].sum()) / n)
    return out


def _score_rows(res, n_folds: int, common: dict, info, pooled: dict) -> list[dict]:
    """The score rows of one study, kernel, seed and parameter source (module docstring); collects the PIT
    values in ``pooled`` for the histograms."""
    scores, pits = gap_scores(res, n_folds)
    lpd = _lpd_by_position(res, n_folds)
    rows = []
    for (modality, pos), sc in scores.items():
        where = dict(modality=modality, position=pos, n_heldout=sc["n"], **common)
        for metric in ("coverage_50", "coverage_90", "mean_sq_z"):
            rows.append(make_row(NOTEBOOK, "gap_calibration", metric, sc[metric], "1", info=info, **where))
        model, naive = lpd[(modality, pos)]
        rows.append(make_row(NOTEBOOK, "gap_calibration", "lpd_per_value", model, "nats", info=info, **where))
        rows.append(make_row(NOTEBOOK, "gap_calibration", "lpd_naive_per_value", naive, "nats", info=info, **where))
        key = (common["study"], common["kernel"], common["parameters"], modality, pos)
        pooled.setdefault(key, []).append(pits[(modality, pos)])
    return rows


@skippable(NOTEBOOK, "gap_calibration", (("lpd_per_value", ""),))
def gap_rows(profile: str, *, info=None) -> list[dict]:
    """Calibration of GP-MAP's predictions across gaps in time, at the run edges and inside (module docstring);
    on the study drawn from the prior, also at the true parameters (``parameters="true"``: the same folds and
    predictions with no fit, which separates the predictive machinery from the estimation of the parameters)."""
    import msrm

    if profile not in GAP_SIZES:
        raise ValueError(f"profile must be one of {sorted(GAP_SIZES)}, got {profile!r}")
    sz = GAP_SIZES[profile]
    if info is None:
        from msrm_lab.provenance import execution_info

        info = execution_info()
    msrm.runtime.enable_x64()
    rows, pooled = [], {}
    for study in sz["studies"]:
        kernels = ("matern32",) if study == "gp_draws" else sz["kernels"]
        for kernel in kernels:
            for seed in sz["seeds"]:
                data, spec, true_params = _gap_study(study, seed)
                spec = dataclasses.replace(spec, kernel=kernel)
                common = dict(profile=profile, study=study, kernel=kernel, seed=seed, folds=sz["folds"],
                              mask="time_blocks", linear_algebra="state_space")
                cv = dict(method="map", folds=sz["folds"], mask="time_blocks", seed=seed,
                          model_kwargs=dict(linear_algebra="state_space"))
                if true_params is not None:
                    res = cross_validate(data, spec, params=true_params, **cv)
                    rows += _score_rows(res, sz["folds"], dict(common, parameters="true"), info, pooled)
                for parameters, predictive in PARAMETER_SOURCES:
                    common["parameters"] = parameters
                    t0 = time.perf_counter()
                    try:
                        res = cross_validate(data, spec, predictive=predictive,
                                             predictive_draws=sz["laplace_draws"], **cv)
                    except NotConvergedError as exc:
                        rows.append(make_row(NOTEBOOK, "gap_calibration", "converged", 0.0, "1", info=info,
                                             reason=str(exc), **common))
                        break
                    rows.append(make_row(NOTEBOOK, "gap_calibration", "converged", 1.0, "1", info=info, **common))
                    rows.append(make_row(NOTEBOOK, "gap_calibration", "wall_s", time.perf_counter() - t0, "s",
                                         info=info, **common))
                    rows += _score_rows(res, sz["folds"], common, info, pooled)
    edges = np.linspace(0.0, 1.0, PIT_BINS + 1)
    for (study, kernel, parameters, modality, pos), parts in pooled.items():
        u = np.concatenate(parts)
        counts, _ = np.histogram(u, bins=edges)
        for b, c in enumerate(counts):
            rows.append(make_row(NOTEBOOK, "gap_calibration", "pit_fraction", float(c) / u.size, "1", info=info,
                                 profile=profile, study=study, kernel=kernel, parameters=parameters,
                                 modality=modality, position=pos, bin=b, bin_lower=float(edges[b]),
                                 n_values=int(u.size), seeds=list(sz["seeds"])))
    return rows
