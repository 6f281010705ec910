"""Model checking (notebook stem ``model_checking``): choosing the number of factors K by cross-validation.

``choose_k_rows(profile)`` builds a synthetic study with a known K, runs ``cross_validate`` (msrm.validation) with R-MSRM and
the ``"features"`` mask (each fold holds out a group of brain features inside one time window; msrm.validation)
for every candidate K, and returns results rows (``msrm_lab.bench.rows.make_row``): per K the held-out log
predictive density (summed over folds and streams), the pooled held-out R^2 and the wall seconds of the
cross-validation; then the K with the largest held-out density (``chosen_k``) next to the true K. A notebook cell
is ``rows = choose_k_rows(profile)`` followed by a table of the rows.
"""
from __future__ import annotations

import dataclasses
import time

import data_synth
from msrm.validation import cross_validate

from .rows import make_row

__all__ = ["SIZES", "NOTEBOOK", "choose_k_rows"]

NOTEBOOK = "model_checking"

# the study (data_synth arguments), its true K, the candidate Ks and the cross-validation settings per profile
SIZES = {
    "smoke": dict(study=dict(profile="tiny", n_features=20, n_runs=2, duration_scale=2.0, seed=3), true_k=2,
                  ks=(1, 2, 3), folds=4, fit=dict(restarts=1, max_iter=40)),
    "quick": dict(study=dict(profile="one-eighth", n_features=60, n_runs=1, duration_scale=0.5, seed=0), true_k=3,
                  ks=(1, 2, 3, 4), folds=4, fit=dict(restarts=1, max_iter=60)),
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
        from msrm.runtime import execution_info

        info = execution_info()
    data, truth = data_synth.synthetic_dataset(n_factors=sz["true_k"], **sz["study"])
    common = dict(profile=profile, study=sz["study"]["profile"], n_features=sz["study"]["n_features"],
                  n_runs=sz["study"]["n_runs"], true_k=sz["true_k"], folds=sz["folds"], method="rmsrm",
                  mask="features", **sz["fit"])
    rows, lpd = [], {}
    for K in sz["ks"]:
        spec = dataclasses.replace(truth.spec, n_factors=K)
        t0 = time.perf_counter()
        res = cross_validate(data, spec, method="rmsrm", folds=sz["folds"], mask="features", seed=0,
                                  n_jobs=n_jobs, progress=False, **sz["fit"])
        wall = time.perf_counter() - t0
        lpd[K] = res.lpd
        rows.append(make_row(NOTEBOOK, "choose_k", "heldout_lpd", res.lpd, "nats", info=info, K=K, **common))
        rows.append(make_row(NOTEBOOK, "choose_k", "heldout_r2", res.r2, "1", info=info, K=K, **common))
        rows.append(make_row(NOTEBOOK, "choose_k", "wall_s", wall, "s", info=info, K=K, **common))
    best = max(lpd, key=lpd.get)
    rows.append(make_row(NOTEBOOK, "choose_k", "chosen_k", best, "factors", info=info, candidates=list(sz["ks"]),
                         **common))
    return rows
