"""msrm.select: the kernel by the marginal likelihood (rough data -> Matérn-1/2, smooth data -> a smooth kernel;
kernel="auto" in GPMSRM), K by co-smoothing (the true K; the one-standard-error rule on a hand-made table; the
scores against a hand computation), and refusals of bad candidates."""
from __future__ import annotations

import dataclasses
import importlib
import math

import numpy as np
import pytest
from scipy.stats import norm

import data_synth
import msrm
from msrm.validation import fold_masks

sel_mod = importlib.import_module("msrm.select")  # msrm.select is the function


def _study(kernel: str, *, n_factors: int = 1, duration: float = 200.0, n_features: int = 20, n_runs: int = 1,
           lengthscales=(6.0,), snr: float = 2.0, seed: int = 0, extra: int = 0):
    """Latents drawn from a Matérn prior on a 1 s grid, seen without lag by two "brain" participants (sampled on the
    grid, ``n_features`` features, signal variance ``snr`` per feature, unit noise) and, with ``extra > 0``, a
    third participant's "eye" stream of ``extra`` features."""
    rng = np.random.default_rng(seed)
    spec = msrm.ModelSpec(n_factors=n_factors, latent_dt=1.0, kernel="matern32",
                          responses={"brain": msrm.Identity(), "eye": msrm.Identity()})
    streams_of = {"p1/brain": n_features, "p2/brain": n_features}
    if extra:
        streams_of["p3/eye"] = extra
    loadings = {}
    for key, F in streams_of.items():
        W = rng.standard_normal((F, n_factors))
        loadings[key] = W * math.sqrt(snr) / np.linalg.norm(W, axis=1, keepdims=True)
    intercepts = {key: rng.normal(0.0, 1.0, F) for key, F in streams_of.items()}
    runs = []
    for _ in range(n_runs):
        grid = msrm.latent_grid(duration, spec)
        r = np.abs(grid[:, None] - grid[None, :])
        Z = np.stack([np.linalg.cholesky(data_synth.matern_kernel(r, ell, kernel) + 1e-9 * np.eye(grid.size))
                      @ rng.standard_normal(grid.size) for ell in lengthscales], axis=1)
        X = Z[grid >= 0]  # the samples at t = 0, 1, ..., duration
        streams = []
        for key, F in streams_of.items():
            p, m = key.split("/")
            Y = X @ loadings[key].T + intercepts[key] + rng.standard_normal((X.shape[0], F))
            streams.append(msrm.Stream(participant=p, modality=m, dt=1.0, values=Y))
        runs.append(msrm.Run(duration=duration, streams=streams))
    return msrm.Dataset(runs), spec


# ---------------------------------------------------------------------------------------------- the rule
def test_one_standard_error_rule_on_a_hand_made_table():
    scores = np.array([
        [0.10, 0.20, 0.15, 0.25],  # K=1: far below
        [0.50, 0.60, 0.40, 0.58],  # K=2: mean 0.52
        [0.52, 0.61, 0.41, 0.56],  # K=3: mean 0.525, the best
        [0.49, 0.60, 0.39, 0.55],  # K=4
    ])
    chosen, mean, se = sel_mod.one_standard_error_rule(scores)
    # K=2 - K=3 per fold: (-0.02, -0.01, -0.01, 0.02), mean -0.005; deviations (-0.015, -0.005, -0.005, 0.025):
    # sum of squares 9e-4, sd sqrt(9e-4 / 3), se sd / 2 = 0.00866 > 0.005, so K=2 is within one se of the best
    np.testing.assert_allclose(mean[1], -0.005, atol=1e-15)
    np.testing.assert_allclose(se[1], math.sqrt(9e-4 / 3) / 2, rtol=1e-12)
    assert mean[2] == 0 and se[2] == 0
    assert chosen == 1
    # the same K=2 consistently 0.03 below the best (se small): no longer within one se, so the best is chosen
    scores[1] = scores[2] - 0.03 + np.array([0.001, -0.001, 0.0, 0.0])
    chosen, mean, se = sel_mod.one_standard_error_rule(scores)
    assert mean[1] == pytest.approx(-0.03) and se[1] < 0.001 and chosen == 2
    # paired: a difference that is small against the folds' spread but the same in every fold is not noise
    spread = np.array([[0.1, 0.9, 0.3, 0.7], [0.12, 0.92, 0.32, 0.72]])
    assert sel_mod.one_standard_error_rule(spread)[0] == 1
    with pytest.raises(ValueError, match="n_folds >= 2"):
        sel_mod.one_standard_error_rule(np.ones((3, 1)))
    with pytest.raises(ValueError, match=r"row\(s\) \[1\]"):
        sel_mod.one_standard_error_rule(np.array([[0.1, 0.2], [np.nan, 0.3]]))


# ---------------------------------------------------------------------------------------------- K
def test_cosmoothing_picks_the_true_number_of_factors():
    data, spec = _study("matern32", n_factors=2, duration=120.0, n_features=20, lengthscales=(3.0, 6.0), snr=1.0)
    sel = msrm.select(data, dataclasses.replace(spec, n_factors=3), kernels=None, n_factors=(3, 1, 4, 2), folds=4,
                      restarts=1, n_jobs=1, max_iter=200)
    t = sel.table
    assert list(t["stage"]) == ["n_factors"] * 4 and list(t["n_factors"]) == [1, 2, 3, 4]
    assert sel.n_factors == 2 and sel.spec.n_factors == 2 and list(t["chosen"]) == [False, True, False, False]
    assert sel.kernel == "matern32" and sel.spec == dataclasses.replace(spec, n_factors=2)
    assert t["r2"][0] < t["r2"][1] - t["r2_se"][0] and not t["within_one_se"][0]  # K=1 clearly worse
    assert (t["fit_seconds"] > 0).all() and t["converged"].all()
    assert set(sel.fold_scores) == {1, 2, 3, 4} and all(v.shape == (4,) for v in sel.fold_scores.values())


def test_cosmoothing_scores_equal_a_hand_computation():
    data, spec = _study("matern32", n_factors=1, duration=40.0, n_features=6, n_runs=2, lengthscales=(4.0,),
                        extra=3, seed=5)
    kw = {"restarts": 1, "n_jobs": 1, "max_iter": 60}
    sel = msrm.select(data, spec, kernels=None, n_factors=(1, 2), folds=2, seed=3, require_converged=False, **kw)
    masks = fold_masks(data, 2, "features", seed=3)
    r2 = np.empty((2, 2))
    lpd = np.empty((2, 2))
    for i, K in enumerate((1, 2)):
        for f, held in enumerate(masks):
            runs = []
            for run, h in zip(data.runs, held):
                runs.append(msrm.Run(run.duration, [
                    msrm.Stream(s.participant, s.modality, s.dt, np.where(h[s.key], np.nan, s.values))
                    if s.key in h else s for s in run.streams]))
            fit = msrm.fit_rmsrm(msrm.Dataset(runs), dataclasses.replace(spec, n_factors=K), seed=3,
                                 progress=False, **kw)
            pred = fit.predict(msrm.Dataset(runs))
            sse = {"brain": 0.0, "eye": 0.0}
            sst = {"brain": 0.0, "eye": 0.0}
            total, count = 0.0, 0
            for key in ("p1/brain", "p2/brain", "p3/eye"):
                # in-fold mean of each feature: its values this fold does not hold out, both runs pooled
                kept = np.concatenate([np.where(h[key], np.nan, run.stream(key).values)
                                       for run, h in zip(data.runs, held)])
                mu = np.nanmean(kept, axis=0)
                for r, (run, h) in enumerate(zip(data.runs, held)):
                    y = run.stream(key).values
                    m = h[key]
                    yhat = pred[r][key].mean
                    sse[key.split("/")[1]] += np.sum((y - yhat)[m] ** 2)
                    sst[key.split("/")[1]] += np.sum((y - mu[None, :])[m] ** 2)
                    total += np.sum(norm.logpdf(y[m], yhat[m], np.broadcast_to(fit.params.noise_sd[key], y.shape)[m]))
                    count += int(m.sum())
            r2[i, f] = 0.5 * ((1 - sse["brain"] / sst["brain"]) + (1 - sse["eye"] / sst["eye"]))
            lpd[i, f] = total / count
    t = sel.table
    np.testing.assert_allclose(t["r2"], r2.mean(axis=1), rtol=1e-9)
    np.testing.assert_allclose(t["lpd_per_value"], lpd.mean(axis=1), rtol=1e-9)
    np.testing.assert_allclose(np.stack([sel.fold_scores[1], sel.fold_scores[2]]), r2, rtol=1e-9)
    best = int(np.argmax(r2.mean(axis=1)))
    np.testing.assert_allclose(t["r2_se"], np.std(r2 - r2[best], axis=1, ddof=1) / math.sqrt(2), atol=1e-12)


# ---------------------------------------------------------------------------------------------- kernel
def test_rough_data_choose_matern12_through_gpmsrm_kernel_auto():
    data, spec = _study("matern12", seed=0)
    model = msrm.GPMSRM(data, dataclasses.replace(spec, kernel="auto"))
    sel = model.selection
    assert model.spec.kernel == "matern12" and sel.kernel == "matern12" and sel.spec == model.spec
    t = sel.table
    assert list(t["kernel"]) == ["matern12", "matern32", "matern52", "matern72"]
    assert list(t["stage"]) == ["kernel"] * 4 and list(t["chosen"]) == [True, False, False, False]
    L = t["log_likelihood"].to_numpy()
    assert L[0] > L[1] + 5 and np.all(np.diff(L) < 0)  # the rougher, the likelier
    # the table's criterion is the model's own marginal likelihood at the candidate's fitted parameters
    params = sel.params[("matern12", 1)]
    np.testing.assert_allclose(L[0], model.log_likelihood(params), rtol=1e-10)
    fit = model.fit_map(init=params, maxiter=3, progress=False)
    assert fit.selection is sel
    assert sel.method == "rmsrm" and sel.start_seconds[1] > 0


def test_smooth_data_choose_a_smooth_kernel_with_either_method():
    data, spec = _study("matern72", seed=1)
    sel = msrm.select(data, spec)  # method="rmsrm": lengthscales profiled at the shared R-MSRM start
    L = dict(zip(sel.table["kernel"], sel.table["log_likelihood"]))
    assert sel.kernel in ("matern52", "matern72") and L["matern12"] < L["matern32"] - 5
    assert sel.table["log_density"].isna().all()
    sel_map = msrm.select(data, spec, kernels=("matern12", "matern72"), method="map", map_kwargs={"maxiter": 200})
    t = sel_map.table
    assert sel_map.kernel == "matern72" and sel_map.spec.kernel == "matern72"
    assert t["log_likelihood"][1] > t["log_likelihood"][0] + 5 and np.isfinite(t["log_density"]).all()
    assert t["converged"].all() and set(sel_map.params) == {("matern12", 1), ("matern72", 1)}


def test_kernel_auto_in_the_spec_and_where_it_cannot_be_resolved():
    data, spec = _study("matern32", duration=30.0, n_features=4)
    auto = dataclasses.replace(spec, kernel="auto")
    assert auto.kernel == "auto" and msrm.ModelSpec.from_dict(auto.to_dict()) == auto
    with pytest.raises(ValueError, match=r"kernel must be one of \('matern12'.*'matern72'\) or 'auto', got 'rbf'"):
        dataclasses.replace(spec, kernel="rbf")
    with pytest.raises(ValueError, match="call msrm.select"):
        auto.prior
    with pytest.raises(ValueError, match=r"fit_rmsrm: spec.kernel='auto'.*call msrm.select"):
        msrm.fit_rmsrm(data, auto, restarts=1, progress=False)


def test_bad_candidates_are_refused_before_any_fit():
    data, spec = _study("matern32", duration=30.0, n_features=4)
    bad = [
        ({"kernels": ("rbf",)}, r"kernels: every candidate must be one of \('matern12'"),
        ({"kernels": ()}, "at least one kernel"),
        ({"kernels": ("matern12", "matern12")}, "distinct"),
        ({"kernels": 3}, "sequence of kernel names"),
        ({"n_factors": (0, 1)}, "n_factors: every candidate must be an integer >= 1, got 0"),
        ({"n_factors": (1, 2.5)}, "got 2.5"),
        ({"n_factors": (2, 2)}, "distinct"),
        ({"n_factors": ()}, "at least one candidate"),
        ({"method": "nuts"}, r"method must be one of \('rmsrm', 'map'\)"),
        ({"score": "bic"}, r"score must be one of \('r2', 'lpd'\)"),
        ({"folds": 1}, "folds must be an integer >= 2"),
        ({"seed": -1}, "seed must be an integer >= 0"),
        ({"n_factors": (1, 2), "folds": 5}, "no stream has at least 5 features"),
    ]
    for kwargs, message in bad:
        with pytest.raises(ValueError, match=message):
            msrm.select(data, spec, **kwargs)
    with pytest.raises(ValueError, match="kernels=None keeps the spec's kernel, but the spec says kernel='auto'"):
        msrm.select(data, dataclasses.replace(spec, kernel="auto"), kernels=None)
    with pytest.raises(ValueError, match="data must be an msrm.Dataset"):
        msrm.select(data.runs, spec)
    with pytest.raises(ValueError, match="map_kwargs with method='rmsrm' takes only 'maxiter'"):
        msrm.select(data, spec, kernels=("matern12", "matern32"), map_kwargs={"gtol": 1e-3})
