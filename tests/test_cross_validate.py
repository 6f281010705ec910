"""msrm.validation.cross_validate: fold masks, scores against brute force, choice of K, GP-MAP, bad input."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from scipy.stats import norm

import data_synth
import msrm
from msrm.validation import _masked, cross_validate, fold_masks


@pytest.fixture(scope="module")
def study():
    return data_synth.synthetic_dataset("tiny", n_features=20, seed=3, n_runs=2, n_factors=2, duration_scale=2.0)


def test_time_block_masks_are_one_window_of_every_stream_and_tile_the_data(study):
    data, _ = study
    masks = fold_masks(data, 4, "time_blocks")
    for r, run in enumerate(data.runs):
        for s in run.streams:
            held = np.stack([masks[f][r][s.key] for f in range(4)])  # (folds, n, F)
            np.testing.assert_array_equal(held.sum(axis=0), 1)  # every value held out exactly once
            for f in range(4):
                rows = held[f].any(axis=1)
                assert held[f][rows].all()  # whole samples: every feature of a held-out sample
                t = s.times[rows]
                lo, hi = f * run.duration / 4, (f + 1) * run.duration / 4
                assert t.min() >= lo and (t.max() < hi or f == 3)


def test_feature_masks_hold_out_one_feature_group_inside_one_window(study):
    data, _ = study
    masks = fold_masks(data, 4, "features", seed=1)
    for r, run in enumerate(data.runs):
        assert set(masks[0][r]) == {"p1/brain", "p2/brain"}  # one-feature streams stay observed
        for key in ("p1/brain", "p2/brain"):
            held = np.stack([masks[f][r][key] for f in range(4)])
            cols = held.any(axis=1)  # (folds, F): the features each fold holds out
            np.testing.assert_array_equal(cols.sum(axis=0), 1)  # each feature in exactly one group
            assert set(cols.sum(axis=1)) == {5}
            for f in range(4):
                # inside its window, a held-out feature is held out at every sample; others stay observed
                rows = held[f].any(axis=1)
                np.testing.assert_array_equal(held[f][rows], np.broadcast_to(cols[f], held[f][rows].shape))


def test_scores_equal_brute_force_from_the_fold_fits(study):
    data, truth = study
    res = cross_validate(data, truth.spec, folds=4, mask="features", restarts=1, n_jobs=1, max_iter=40)
    assert list(res.folds.columns[:4]) == ["fold", "stream", "modality", "n_heldout"]
    f, key = 2, "p2/brain"
    held = fold_masks(data, 4, "features")[f]
    fit = msrm.fit_rmsrm(_masked(data, held), truth.spec, restarts=1, n_jobs=1, max_iter=40, progress=False)
    y, mu, sd = [], [], []
    for r, run in enumerate(data.runs):
        m = held[r][key]
        y.append(run.stream(key).values[m])
        mu.append(fit.predict(data)[r][key].mean[m])
        sd.append(np.broadcast_to(fit.params.noise_sd[key], m.shape)[m])
        # each held-out feature is one column: its own mean for SST
    y, mu, sd = map(np.concatenate, (y, mu, sd))
    cols = [np.flatnonzero(held[r][key].any(axis=0)) for r in range(2)]
    assert all((c == cols[0]).all() for c in cols)
    yy = np.concatenate([run.stream(key).values[held[r][key].any(axis=1)][:, cols[0]] for r, run in
                         enumerate(data.runs)])
    sst = float(np.sum((yy - yy.mean(axis=0)) ** 2))
    row = res.folds[(res.folds.fold == f) & (res.folds.stream == key)].iloc[0]
    assert row.n_heldout == y.size
    np.testing.assert_allclose(row.lpd, norm.logpdf(y, mu, sd).sum(), rtol=1e-9)
    np.testing.assert_allclose(row.sse, np.sum((y - mu) ** 2), rtol=1e-9)
    np.testing.assert_allclose(row.sst, sst, rtol=1e-9)
    np.testing.assert_allclose(row.r2, 1 - row.sse / sst, rtol=1e-12)
    s = res.summary.loc[key]
    sub = res.folds[res.folds.stream == key]
    np.testing.assert_allclose(s.r2, 1 - sub.sse.sum() / sub.sst.sum(), rtol=1e-12)
    np.testing.assert_allclose(res.lpd, res.folds.lpd.sum(), rtol=1e-12)


def test_feature_cross_validation_picks_the_true_number_of_factors(study):
    data, truth = study  # K = 2
    scores = {}
    for K in (1, 2, 3):
        spec = dataclasses.replace(truth.spec, n_factors=K)
        res = cross_validate(data, spec, method="rmsrm", folds=4, mask="features", restarts=1, n_jobs=1,
                             max_iter=40)
        assert np.isfinite(res.folds[["lpd", "sse", "sst", "r2"]].to_numpy()).all()
        scores[K] = (res.lpd, res.r2)
    assert max(scores, key=lambda k: scores[k][0]) == 2, scores
    assert max(scores, key=lambda k: scores[k][1]) == 2, scores


def test_map_cross_validation_runs_and_gives_finite_scores():
    msrm.runtime.enable_x64()
    data, truth = data_synth.synthetic_dataset("tiny", n_features=4, seed=0, n_runs=1, n_factors=1)
    res = cross_validate(data, truth.spec, method="map", folds=2, mask="features", maxiter=5,
                         model_kwargs={"method": "native"})
    assert res.method == "map" and len(res.fit_seconds) == 2
    assert set(res.folds.stream) == {"p1/brain", "p2/brain"}
    assert np.isfinite(res.folds[["lpd", "sse", "sst", "r2"]].to_numpy()).all()
    assert (res.folds.n_heldout > 0).all()


def test_bad_input(study):
    data, truth = study
    with pytest.raises(ValueError, match="folds must be an integer >= 2"):
        cross_validate(data, truth.spec, folds=1)
    with pytest.raises(ValueError, match="method must be one of"):
        cross_validate(data, truth.spec, method="nuts")
    with pytest.raises(ValueError, match="mask must be one of"):
        cross_validate(data, truth.spec, mask="random")
    with pytest.raises(ValueError, match="use fewer folds"):
        cross_validate(data, truth.spec, folds=30)  # windows shorter than two samples of a stream
    with pytest.raises(ValueError, match="no stream has at least 25 features"):
        fold_masks(data, 25, "features")
    # a stream recorded only in the first half of the run: the first fold would leave it with nothing observed
    run = data.runs[0]
    short = msrm.Stream("p1", "brain", 2.0, run.stream("p1/brain").values[:10])
    other = [s for s in run.streams if s.key != "p1/brain"]
    with pytest.raises(ValueError, match="p1/brain of run 0 with nothing observed"):
        fold_masks(msrm.Dataset([msrm.Run(run.duration, [short] + other)]), 2, "time_blocks")
    with pytest.raises(ValueError, match="msrm.Dataset"):
        cross_validate(run, truth.spec)


def test_masks_hold_out_only_observed_values():
    data, _ = data_synth.synthetic_dataset("tiny", n_features=8, seed=5, n_runs=2, missing_fraction=0.2)
    for mask in ("time_blocks", "features"):
        for fold in fold_masks(data, 3, mask):
            for run, held in zip(data.runs, fold):
                for key, h in held.items():
                    s = run.stream(key)
                    assert not (h & np.isnan(s.values)).any()
                    assert h.any()
        masked = _masked(data, fold_masks(data, 3, mask)[1])
        assert masked.n_observed == data.n_observed - sum(int(h.sum()) for h in
                                                          (m for held in fold_masks(data, 3, mask)[1]
                                                           for m in held.values()))
