"""The gap-calibration scores of the model-checking benchmark against a direct computation from standardised
errors, and its rows on the smallest profile."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
from scipy.stats import norm

from msrm_lab.bench import model_checking as mc


def _fake_result(seed=0):
    """A CVResult stand-in: 5 folds, two modalities, standardised errors z of known scale per position."""
    rng = np.random.default_rng(seed)
    pit, folds = [], []
    for fold in range(5):
        for modality, scale in (("brain", 1.0), ("rating", 2.0)):
            s = scale if fold in (0, 4) else 1.0  # edges: sd too small by `scale`
            z = s * rng.standard_normal(400)
            pit.append(pd.DataFrame({"fold": fold, "run": 0, "stream": f"p/{modality}", "modality": modality,
                                     "feature": 0, "pit": norm.cdf(z), "z": z}))
            folds.append({"fold": fold, "modality": modality, "n_heldout": z.size, "lpd": float(fold + 1),
                          "lpd_naive": 0.5})
    return SimpleNamespace(pit=pd.concat(pit, ignore_index=True), folds=pd.DataFrame(folds))


def test_gap_scores_match_the_standardised_errors():
    res = _fake_result()
    scores, pits = mc.gap_scores(res, 5)
    table = res.pit
    for (modality, pos), sc in scores.items():
        edge = table["fold"].isin((0, 4))
        z = table[(table.modality == modality) & (edge if pos == "edge" else ~edge)]["z"].to_numpy()
        assert sc["n"] == z.size == pits[(modality, pos)].size
        assert sc["coverage_90"] == pytest.approx(np.mean(np.abs(z) < norm.ppf(0.95)))
        assert sc["coverage_50"] == pytest.approx(np.mean(np.abs(z) < norm.ppf(0.75)))
        assert sc["mean_sq_z"] == pytest.approx(np.mean(z * z), rel=1e-9)
    # the edge rating windows have twice the sd: about 4 times the squared error, far lower coverage
    assert scores[("rating", "edge")]["mean_sq_z"] > 3.0 > 1.3 > scores[("rating", "interior")]["mean_sq_z"]
    assert scores[("rating", "edge")]["coverage_90"] < 0.65 < 0.85 < scores[("brain", "edge")]["coverage_90"]


def test_lpd_by_position_sums_per_value():
    res = _fake_result()
    lpd = mc._lpd_by_position(res, 5)
    # edge folds 0 and 4 hold lpd 1 and 5 over 800 values; interior folds 1-3 hold 2 + 3 + 4 over 1200
    assert lpd[("brain", "edge")] == pytest.approx((6.0 / 800, 1.0 / 800))
    assert lpd[("brain", "interior")] == pytest.approx((9.0 / 1200, 1.5 / 1200))


def test_gap_rows_refuse_an_unknown_profile():
    with pytest.raises(ValueError, match="profile"):
        mc.gap_rows("huge", info={})
