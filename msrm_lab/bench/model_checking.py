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
"""
from __future__ import annotations

import dataclasses
import time

import data_synth
from msrm.validation import NotConvergedError, cross_validate

from .rows import make_row

__all__ = ["SIZES", "NOTEBOOK", "choose_k_rows"]

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
