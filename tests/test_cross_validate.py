"""msrm.validation.cross_validate: fold masks, scores against brute force and by hand, choice of K, GP-MAP,
convergence, bad input."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from scipy.stats import norm

import data_synth
import msrm
from msrm.validation import NotConvergedError, _scores, cross_validate, fold_masks, masked


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
    fit = msrm.fit_rmsrm(masked(data, held), truth.spec, restarts=1, n_jobs=1, max_iter=40, progress=False)
    y, mu, sd = [], [], []
    for r, run in enumerate(data.runs):
        m = held[r][key]
        y.append(run.stream(key).values[m])
        mu.append(fit.predict(data)[r][key].mean[m])
        sd.append(np.broadcast_to(fit.params.noise_sd[key], m.shape)[m])
    y, mu, sd = map(np.concatenate, (y, mu, sd))
    cols = [np.flatnonzero(held[r][key].any(axis=0)) for r in range(2)]
    assert all((c == cols[0]).all() for c in cols)
    yy = np.concatenate([run.stream(key).values[held[r][key].any(axis=1)][:, cols[0]] for r, run in
                         enumerate(data.runs)])
    # SST about each held-out feature's in-fold mean: its values outside the held-out window, pooled over runs
    infold = np.concatenate([run.stream(key).values[~held[r][key].any(axis=1)][:, cols[0]] for r, run in
                             enumerate(data.runs)])
    sst = float(np.sum((yy - infold.mean(axis=0)) ** 2))
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
                             max_iter=100)
        assert res.folds.converged.all()
        assert np.isfinite(res.folds[["lpd", "sse", "sst", "r2"]].to_numpy()).all()
        scores[K] = (res.lpd, res.r2)
    assert max(scores, key=lambda k: scores[k][0]) == 2, scores
    assert max(scores, key=lambda k: scores[k][1]) == 2, scores


def test_map_cross_validation_runs_and_gives_finite_scores():
    msrm.runtime.enable_x64()
    data, truth = data_synth.synthetic_dataset("tiny", n_features=4, seed=0, n_runs=1, n_factors=1)
    res = cross_validate(data, truth.spec, method="map", folds=2, mask="features", maxiter=5,
                         model_kwargs={"method": "native"}, require_converged=False)
    assert res.method == "map" and len(res.fit_seconds) == 2
    assert not res.converged.any() and not res.folds.converged.any()  # 5 iterations: stopped by the limit
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
        fold_data = masked(data, fold_masks(data, 3, mask)[1])
        assert fold_data.n_observed == data.n_observed - sum(int(h.sum()) for h in
                                                          (m for held in fold_masks(data, 3, mask)[1]
                                                           for m in held.values()))


# ------------------------------------------------------------------------------------ scores computed by hand
def _pred(mean, sd):
    return msrm.Prediction(np.asarray(mean, dtype=float), np.asarray(sd, dtype=float))


def test_scores_of_one_feature_by_hand():
    """One rating feature, values (1, 2.5, 3, 4, 0); samples 1, 3, 4 held out; in-fold values (1, 3): mean 2, sd 1.

    Predictions m = (2, 4, 2), sd v = (1, 2, 1): z = (0.5, 0, -2); naive z = (0.5, 2, -2).
    """
    y = np.array([[1.0], [2.5], [3.0], [4.0], [0.0]])
    data = msrm.Dataset([msrm.Run(5.0, [msrm.Stream("p", "rating", 1.0, y)])])
    held = [{"p/rating": np.array([[False], [True], [False], [True], [True]])}]
    mean = np.array([[9.0], [2.0], [9.0], [4.0], [2.0]])  # in-fold samples' predictions are never read
    sd = np.array([[1.0], [1.0], [1.0], [2.0], [1.0]])
    rows, pit = _scores(data, held, [{"p/rating": _pred(mean, sd)}], fold=3, converged=False)
    (row,) = rows
    c = -0.5 * math.log(2 * math.pi)
    assert (row["fold"], row["stream"], row["modality"], row["n_heldout"], row["converged"]) == \
        (3, "p/rating", "rating", 3, False)
    assert row["sse"] == pytest.approx(0.25 + 0.0 + 4.0)
    assert row["sst"] == pytest.approx(0.25 + 4.0 + 4.0)  # about the in-fold mean 2, not the held-out mean 2.1667
    assert row["r2"] == pytest.approx(1 - 4.25 / 8.25)
    assert row["lpd"] == pytest.approx(3 * c - 0.125 - math.log(2.0) - 0.0 - 2.0)
    assert row["lpd_per_value"] == pytest.approx(row["lpd"] / 3)
    assert row["lpd_naive"] == pytest.approx(3 * c - 0.125 - 2.0 - 2.0)
    assert row["lpd_naive_per_value"] == pytest.approx(row["lpd_naive"] / 3)
    assert row["coverage_50"] == pytest.approx(2 / 3)  # |z| <= 0.674: 0.5 and 0 in, -2 out
    assert row["coverage_90"] == pytest.approx(2 / 3)  # |z| <= 1.645: -2 still out
    (part,) = pit
    assert (part["fold"], part["run"], part["stream"], part["modality"]) == (3, 0, "p/rating", "rating")
    np.testing.assert_array_equal(part["feature"], [0, 0, 0])
    np.testing.assert_allclose(part["pit"], [0.6914624612740131, 0.5, 0.022750131948179195], rtol=1e-12)


def _hand_study():
    """Two runs of a 3-feature brain stream (one value missing) and a 1-feature rating stream, with one fold's
    mask and predictions drawn at random: every score is then recomputed with plain NumPy / SciPy."""
    rng = np.random.default_rng(7)
    runs, held, preds = [], [], []
    for r in range(2):
        brain = rng.normal(size=(8, 3)) + np.array([0.0, 5.0, -2.0])
        if r == 0:
            brain[6, 1] = np.nan  # missing: neither held out nor in-fold
        rating = rng.normal(size=(4, 1)) * 3.0 + 1.0
        runs.append(msrm.Run(8.0, [msrm.Stream("a", "brain", 1.0, brain), msrm.Stream("a", "rating", 2.0, rating)]))
        hb = np.zeros((8, 3), dtype=bool)
        hr = np.zeros((4, 1), dtype=bool)
        if r == 0:
            hb[2:5] = True
            hr[1] = True
        else:
            hb[0:2, [0, 2]] = True  # run 1 holds out no rating value: all of them are in-fold
        held.append({"a/brain": hb, "a/rating": hr})
        preds.append({"a/brain": _pred(brain + rng.normal(size=brain.shape), rng.uniform(0.5, 2.0, brain.shape)),
                      "a/rating": _pred(rating + rng.normal(size=rating.shape), rng.uniform(0.5, 2.0, (4, 1)))})
    return msrm.Dataset(runs), held, preds


def _expected(data, held, preds, key):
    """The scores of one stream over the runs, from the definitions (module docstring of msrm.validation)."""
    F = data.runs[0].stream(key).n_features
    infold = [np.concatenate([run.stream(key).values[:, j][~h[key][:, j] & ~np.isnan(run.stream(key).values[:, j])]
                              for run, h in zip(data.runs, held)]) for j in range(F)]
    mu = np.array([v.mean() for v in infold])
    sd = np.array([v.std() for v in infold])  # divisor n: the maximum-likelihood sd
    y, m, v, cols = [], [], [], []
    for run, h, p in zip(data.runs, held, preds):
        mask = h[key]
        y.append(run.stream(key).values[mask])
        m.append(p[key].mean[mask])
        v.append(p[key].sd[mask])
        cols.append(np.nonzero(mask)[1])
    y, m, v, cols = map(np.concatenate, (y, m, v, cols))
    sse, sst = np.sum((y - m) ** 2), np.sum((y - mu[cols]) ** 2)
    lo50, hi50 = norm.ppf(0.25, m, v), norm.ppf(0.75, m, v)
    lo90, hi90 = norm.ppf(0.05, m, v), norm.ppf(0.95, m, v)
    return {"n_heldout": y.size, "lpd": norm.logpdf(y, m, v).sum(),
            "lpd_naive": norm.logpdf(y, mu[cols], sd[cols]).sum(), "sse": sse, "sst": sst, "r2": 1 - sse / sst,
            "in50": np.sum((y >= lo50) & (y <= hi50)), "in90": np.sum((y >= lo90) & (y <= hi90)),
            "pit": norm.cdf(y, m, v)}


def test_scores_of_a_hand_made_fold_match_numpy():
    data, held, preds = _hand_study()
    rows, pit = _scores(data, held, preds, fold=0)
    assert [r["stream"] for r in rows] == ["a/brain", "a/rating"]
    for row in rows:
        e = _expected(data, held, preds, row["stream"])
        assert row["n_heldout"] == e["n_heldout"] and row["converged"] is True
        for name in ("lpd", "lpd_naive", "sse", "sst", "r2"):
            np.testing.assert_allclose(row[name], e[name], rtol=1e-12, err_msg=name)
        np.testing.assert_allclose(row["coverage_50"], e["in50"] / e["n_heldout"], rtol=1e-12)
        np.testing.assert_allclose(row["coverage_90"], e["in90"] / e["n_heldout"], rtol=1e-12)
        got = np.concatenate([p["pit"] for p in pit if p["stream"] == row["stream"]])
        np.testing.assert_allclose(got, e["pit"], rtol=1e-12)
    # held-out brain values: run 0 samples 2-4 x 3 features (9), run 1 samples 0-1 x features 0 and 2 (4)
    assert rows[0]["n_heldout"] == 9 + 4 and rows[1]["n_heldout"] == 1


def test_cross_validate_pools_per_modality_and_keeps_every_pit(monkeypatch):
    """cross_validate over two hand-made folds (fold_masks and the fit replaced): pooled per stream and modality."""
    import msrm.validation as v

    data, held0, preds = _hand_study()
    # a second fold: the first one's samples moved 4 later (wrapping), observed values only
    held1 = [{k: np.roll(m, 4, axis=0) & ~np.isnan(run.stream(k).values) for k, m in h.items()}
             for run, h in zip(data.runs, held0)]
    held1[1]["a/rating"][3] = True
    monkeypatch.setattr(v, "fold_masks", lambda data, folds, mask, seed: [held0, held1])
    monkeypatch.setattr(v, "_fit_predict", lambda *a, **k: (preds, True, "hand-made"))
    spec = msrm.ModelSpec(n_factors=1, latent_dt=1.0,
                          responses={"brain": msrm.Identity(), "rating": msrm.Identity()})
    res = cross_validate(data, spec, folds=2)
    assert list(res.folds.columns) == list(v.FOLD_COLUMNS)
    assert res.folds.converged.all() and res.converged.tolist() == [True, True]
    for modality, key in (("brain", "a/brain"), ("rating", "a/rating")):
        e = [_expected(data, h, preds, key) for h in (held0, held1)]
        got = res.by_modality.loc[modality]
        n = sum(x["n_heldout"] for x in e)
        assert got.n_heldout == n and got.n_streams == 1 and got.converged
        np.testing.assert_allclose(got.lpd, sum(x["lpd"] for x in e), rtol=1e-12)
        np.testing.assert_allclose(got.lpd_naive, sum(x["lpd_naive"] for x in e), rtol=1e-12)
        np.testing.assert_allclose(got.lpd_naive_per_value, got.lpd_naive / n, rtol=1e-12)
        np.testing.assert_allclose(got.r2, 1 - sum(x["sse"] for x in e) / sum(x["sst"] for x in e), rtol=1e-12)
        np.testing.assert_allclose(got.coverage_50, sum(x["in50"] for x in e) / n, rtol=1e-12)
        np.testing.assert_allclose(got.coverage_90, sum(x["in90"] for x in e) / n, rtol=1e-12)
        np.testing.assert_allclose(res.summary.loc[key, "r2"], got.r2, rtol=1e-12)  # one stream per modality
        pit = res.pit[res.pit.modality == modality]
        assert len(pit) == n and set(pit.stream) == {key}
        np.testing.assert_allclose(pit.pit.to_numpy(), np.concatenate([x["pit"] for x in e]), rtol=1e-12)
    assert list(res.pit.columns) == ["fold", "run", "stream", "modality", "feature", "pit"]
    with pytest.raises(ValueError, match=r"2 modalities \(brain, rating\).*CVResult.by_modality"):
        res.r2  # one number over brain and rating would mix their units
    with pytest.raises(ValueError, match="by_modality"):
        res.lpd
    assert "brain: r2=" in repr(res) and "rating: r2=" in repr(res)


def test_the_true_signal_scores_its_explained_fraction(monkeypatch):
    """Design "small": the noise-free true signal (intercept + loadings x true response of the true latents), with
    the true noise sd, is scored by cross_validate with the time-block mask: per modality its R^2 is near the
    fraction of variance the signal explains, its 90% intervals cover about 90%, and it beats the naive baseline;
    the true intercept alone scores near 0 (the in-fold mean is no better a level than the intercept)."""
    import msrm.validation as v
    from data_synth.designs import make_design

    data, spec, truth = make_design("small", 0)

    def truth_predictions(signal: bool):
        out = []
        for r, run in enumerate(data.runs):
            p = {}
            for s in run.streams:
                mean = np.broadcast_to(truth.intercepts[s.key], s.values.shape)
                if signal:
                    mean = mean + truth.seen(r, s.modality, s.times) @ truth.loadings[s.key].T
                p[s.key] = _pred(mean, np.broadcast_to(truth.noise_sd[s.key], s.values.shape))
            out.append(p)
        return out

    explained_num, explained_den = {}, {}
    for r, run in enumerate(data.runs):
        for s in run.streams:
            var = (truth.seen(r, s.modality, s.times) @ truth.loadings[s.key].T).var(axis=0)
            explained_num[s.modality] = explained_num.get(s.modality, 0.0) + var.sum()
            explained_den[s.modality] = explained_den.get(s.modality, 0.0) + (var + truth.noise_sd[s.key] ** 2).sum()
    scores = {}
    for signal in (True, False):
        preds = truth_predictions(signal)
        monkeypatch.setattr(v, "_fit_predict", lambda *a, preds=preds, **k: (preds, True, "truth"))
        scores[signal] = cross_validate(data, spec, folds=3, mask="time_blocks").by_modality
    assert set(scores[True].index) == {"brain", "rating", "physio"}
    for modality, row in scores[True].iterrows():
        explained = explained_num[modality] / explained_den[modality]  # brain 0.56, rating 0.95, physio 0.88
        assert 0.0 < row.r2 and abs(row.r2 - explained) < 0.1, (modality, row.r2, explained)
        assert abs(row.coverage_90 - 0.9) < 0.08 and abs(row.coverage_50 - 0.5) < 0.15, (modality, row)
        assert row.lpd > row.lpd_naive
        intercept = scores[False].loc[modality]
        assert -0.05 < intercept.r2 < row.r2 - 0.3, (modality, intercept.r2)


# ------------------------------------------------------------------------------------------------ convergence
def test_a_fold_whose_fit_did_not_converge_is_refused_unless_asked(study, monkeypatch):
    """R-MSRM's fit reports non-convergence on its second call (fold 1): refused by default, naming the fold and
    the method; scored with require_converged=False, where its rows say converged=False."""
    import msrm.rmsrm

    data, truth = study
    real = msrm.rmsrm.fit_rmsrm
    calls = []

    def fit(*args, **kwargs):
        result = real(*args, **kwargs)
        calls.append(1)
        return dataclasses.replace(result, converged=False) if len(calls) % 4 == 2 else result

    monkeypatch.setattr(msrm.rmsrm, "fit_rmsrm", fit)
    kw = dict(folds=4, mask="features", restarts=1, n_jobs=1, max_iter=40)
    with pytest.raises(NotConvergedError, match=r"R-MSRM \(fit_rmsrm\) fit of fold 1 of 4 did not converge"):
        cross_validate(data, truth.spec, **kw)
    assert len(calls) == 2  # refused as soon as fold 1 was fitted
    calls.clear()
    res = cross_validate(data, truth.spec, require_converged=False, **kw)
    assert res.converged.tolist() == [True, False, True, True]
    np.testing.assert_array_equal(res.folds.converged, res.folds.fold != 1)
    assert not res.summary.converged.any() and not res.by_modality.converged.any()
    assert np.isfinite(res.folds.r2).all()
    with pytest.raises(ValueError, match="require_converged must be True or False"):
        cross_validate(data, truth.spec, require_converged="yes", **kw)


def test_a_map_fit_stopped_by_maxiter_is_refused():
    msrm.runtime.enable_x64()
    data, truth = data_synth.synthetic_dataset("tiny", n_features=4, seed=0, n_runs=1, n_factors=1)
    with pytest.raises(NotConvergedError, match=r"GP-MAP \(fit_map\) fit of fold 0 of 2 did not converge .*maxiter=5"):
        cross_validate(data, truth.spec, method="map", folds=2, mask="features", maxiter=5,
                       model_kwargs={"method": "native"})


# ------------------------------------------------------------------------- fixed parameters and the Laplace predictive
def _scored_by_hand(data, held, preds):
    """Per stream key: (summed log N(y; m, v^2), count) of the held-out values of one fold."""
    out = {}
    for run, h, pred in zip(data.runs, held, preds):
        for key, m in h.items():
            y = run.stream(key).values[m]
            lp = norm.logpdf(y, np.asarray(pred[key].mean)[m], np.asarray(pred[key].sd)[m]).sum()
            a, n = out.get(key, (0.0, 0))
            out[key] = (a + lp, n + y.size)
    return out


@pytest.fixture(scope="module")
def gp_study():
    msrm.runtime.enable_x64()
    return data_synth.synthetic_dataset("tiny", n_features=5, seed=2, n_runs=1, n_factors=1)


def test_fixed_parameters_score_the_predictions_of_those_parameters(gp_study):
    """params=: each fold's held-out values, set to NaN by hand, predicted by GPMSRM at the given parameters and
    scored with scipy equal the table's lpd; nothing is fitted (every fold 'converged')."""
    data, truth = gp_study
    res = cross_validate(data, truth.spec, method="map", folds=3, mask="time_blocks", params=truth.params,
                         model_kwargs={"linear_algebra": "state_space"})
    assert res.predictive == "fixed" and res.converged.all()
    for f, held in enumerate(fold_masks(data, 3, "time_blocks")):
        runs = []
        for run, h in zip(data.runs, held):
            streams = []
            for st in run.streams:
                values = np.array(st.values)
                if st.key in h:
                    values[h[st.key]] = np.nan
                streams.append(msrm.Stream(st.participant, st.modality, st.dt, values, offset=st.offset))
            runs.append(msrm.Run(run.duration, streams))
        preds = msrm.GPMSRM(msrm.Dataset(runs), truth.spec, linear_algebra="dense").predict(truth.params)
        table = res.folds[res.folds.fold == f].set_index("stream")
        for key, (lp, n) in _scored_by_hand(data, held, preds).items():
            assert table.loc[key, "n_heldout"] == n
            assert table.loc[key, "lpd"] == pytest.approx(lp, rel=1e-9)


def test_laplace_predictive_pools_the_laplace_draws_by_the_law_of_total_variance(gp_study):
    """predictive="laplace": the same MAP fit per fold (same start), the Laplace draws of approximate_posterior
    with the same seed, each draw's prediction by GPMSRM.predict, pooled by hand (mean of means; mean variance plus
    the variance of the means, divisor S) and scored with scipy, equal the table's lpd. The pooled sd is never
    below the plug-in sd's mean-square (the added variance of the means is >= 0)."""
    from msrm.gp.laplace import approximate_posterior

    data, truth = gp_study
    kw = dict(method="map", folds=2, mask="time_blocks", seed=4, init=truth.params,
              model_kwargs={"linear_algebra": "state_space"})
    res = cross_validate(data, truth.spec, predictive="laplace", predictive_draws=6, **kw)
    plug = cross_validate(data, truth.spec, **kw)
    assert res.predictive == "laplace" and plug.predictive == "plugin"
    for f, held in enumerate(fold_masks(data, 2, "time_blocks", 4)):
        model = msrm.GPMSRM(masked(data, held), truth.spec, linear_algebra="state_space")
        mode = model.fit_map(init=truth.params, seed=4, progress=False)
        post = approximate_posterior(model, init=mode, num_samples=6, seed=4, log_density_draws=False,
                                     diagnostics=False)
        draws = [model.predict(model.constrain(u)) for u in np.asarray(post.draws_u)[0]]
        pooled = []
        for r, run in enumerate(draws[0]):
            out = {}
            for key in run:
                means = np.stack([d[r][key].mean for d in draws])
                var = np.mean(np.stack([d[r][key].sd for d in draws]) ** 2, axis=0) + means.var(axis=0)
                out[key] = type("P", (), {"mean": means.mean(axis=0), "sd": np.sqrt(var)})
            pooled.append(out)
        table = res.folds[res.folds.fold == f].set_index("stream")
        for key, (lp, n) in _scored_by_hand(data, held, pooled).items():
            assert table.loc[key, "lpd"] == pytest.approx(lp, rel=1e-9)
    assert np.isfinite(res.folds.lpd).all() and not res.folds.lpd.equals(plug.folds.lpd)


def test_predictive_settings_are_checked_before_any_fit(gp_study):
    data, truth = gp_study
    with pytest.raises(ValueError, match="predictive must be one of"):
        cross_validate(data, truth.spec, method="map", predictive="nuts")
    with pytest.raises(ValueError, match="predictive_draws must be an integer >= 2"):
        cross_validate(data, truth.spec, method="map", predictive="laplace", predictive_draws=1)
    with pytest.raises(ValueError, match="predictive='laplace' needs method='map'"):
        cross_validate(data, truth.spec, method="rmsrm", predictive="laplace")
    with pytest.raises(ValueError, match="params needs method='map'"):
        cross_validate(data, truth.spec, method="rmsrm", params=truth.params)
    with pytest.raises(ValueError, match="params must be msrm.Params"):
        cross_validate(data, truth.spec, method="map", params={"loadings": 1})
    with pytest.raises(ValueError, match="no parameter uncertainty to integrate"):
        cross_validate(data, truth.spec, method="map", params=truth.params, predictive="laplace")
