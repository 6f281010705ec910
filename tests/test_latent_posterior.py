"""The latent posterior and posterior predictions of the dense and grouped backends against the brute-force
oracle (tests/latent_oracle.py: the dense joint Gaussian of vec Z and the observed values of one run).

Cases are tiny (one or two runs of 36-42 s, 1.5 s grid, K = 2) with about 20% of the values missing: random values, some
samples entirely missing, one stream offset from the others' clock. Every kernel of ``msrm.kernels.KERNELS`` and
every response of ``msrm.responses.RESPONSES`` (each built from its class with its default bounds) is covered, under
both poolings.
"""
from __future__ import annotations

import numpy as np
import pytest

import msrm

msrm.runtime.enable_x64()

from latent_oracle import (brute_latent_posterior, brute_marginal_loglik, brute_predict,  # noqa: E402
                           prior_covariance, stream_rows)
from msrm.gp.reference import brute_force_loglik  # noqa: E402
from msrm.kernels import KERNELS  # noqa: E402
from msrm.nodes import response_groups  # noqa: E402
from msrm.responses import RESPONSES  # noqa: E402

# (participant, modality, dt, offset, n_features)
STREAMS = (("p1", "brain", 2.0, 0.0, 3), ("p2", "brain", 2.0, 0.0, 3), ("p3", "rating", 1.5, 0.0, 1),
           ("p4", "rating", 1.5, 0.7, 1), ("p3", "physio", 2.5, 0.0, 2), ("p4", "physio", 2.5, 0.0, 2))


def make_case(kernel: str, pooling: str, responses: dict, seed: int = 0, K: int = 2, durations=(36.0, 42.0),
              missing: float = 0.2):
    """A tiny dataset (one run per duration) drawn from the model, its spec and the parameters it was drawn with.

    About ``missing`` of the values are NaN, plus two samples of every stream entirely NaN; every feature keeps at
    least one observed value."""
    rng = np.random.default_rng(seed)
    spec = msrm.ModelSpec(n_factors=K, latent_dt=1.5, kernel=kernel, pooling=pooling, responses=dict(responses))
    skeleton = msrm.Dataset([msrm.Run(duration=durations[0], streams=[
        msrm.Stream(participant=p, modality=m, dt=dt, offset=off,
                    values=np.zeros((int(np.floor((durations[0] - off) / dt + 1e-9)) + 1, F)))
        for p, m, dt, off, F in STREAMS])])
    groups = response_groups(skeleton, spec)
    theta = {}
    for g in groups:
        if g.param_key is not None:
            theta[g.param_key] = {n: lo + rng.uniform(0.25, 0.6) * (hi - lo)
                                  for n, (lo, hi) in g.response.bounds.items()}
    keys = [f"{p}/{m}" for p, m, *_ in STREAMS]
    params = msrm.Params(
        loadings={k: rng.normal(0.0, 0.8, (F, K)) for k, (*_, F) in zip(keys, STREAMS)},
        intercepts={k: rng.normal(0.0, 1.0, F) for k, (*_, F) in zip(keys, STREAMS)},
        noise_sd={k: rng.uniform(0.3, 0.8, F) for k, (*_, F) in zip(keys, STREAMS)},
        lengthscales=np.geomspace(2.0, 6.0, K), response=theta)
    by_key = {g.key: g for g in groups}
    runs = []
    for T in durations:
        grid = msrm.latent_grid(T, spec)
        P = prior_covariance(grid, params.lengthscales, kernel)
        z = np.linalg.cholesky(P + 1e-10 * np.eye(P.shape[0])) @ rng.standard_normal(P.shape[0])
        Z = z.reshape(grid.size, K)
        streams = []
        for key, (p, m, dt, off, F) in zip(keys, STREAMS):
            n = int(np.floor((T - off) / dt + 1e-9)) + 1
            s0 = msrm.Stream(participant=p, modality=m, dt=dt, offset=off, values=np.zeros((n, F)))
            A = stream_rows(s0, by_key.get(key, by_key.get(m)), params, grid)
            Y = (params.intercepts[key] + (A @ Z) @ params.loadings[key].T
                 + params.noise_sd[key] * rng.standard_normal((n, F)))
            drop = rng.random((n, F)) < missing
            full = rng.choice(n, 2, replace=False)
            drop[full] = True  # two samples entirely missing
            keep = np.setdiff1d(np.arange(n), full)[0]
            drop[keep, drop.all(axis=0)] = False  # every feature keeps an observed value
            Y[drop] = np.nan
            streams.append(msrm.Stream(participant=p, modality=m, dt=dt, offset=off, values=Y))
        runs.append(msrm.Run(duration=T, streams=streams))
    return msrm.Dataset(runs), spec, params


def default_responses(names=None):
    """{modality: response} using the registered responses round-robin over the three modalities."""
    names = list(RESPONSES) if names is None else list(names)
    return {m: RESPONSES[names[i % len(names)]]() for i, m in enumerate(("brain", "rating", "physio"))}


def _scale(a):
    return max(1.0, float(np.max(np.abs(a), initial=0.0)))


# ------------------------------------------------------------------------------------------ the oracle itself


@pytest.mark.parametrize("pooling", ["shared", "individual"])
def test_oracle_marginal_density_equals_the_reference(pooling):
    data, spec, params = make_case("matern32", pooling, default_responses(), seed=1)
    assert sum(np.isnan(s.values).all(axis=1).sum() for r in data.runs for s in r.streams) >= 12
    ref = brute_force_loglik(data, spec, params)
    np.testing.assert_allclose(brute_marginal_loglik(data, spec, params), ref, rtol=1e-10)
    # and the posterior it gives is a proper one: covariances symmetric positive semi-definite, below the prior
    for (grid, mean, cov), run in zip(brute_latent_posterior(data, spec, params), data.runs):
        assert mean.shape == (grid.size, spec.n_factors)
        assert np.all(np.linalg.eigvalsh(cov) > -1e-10)
        assert np.all(np.diag(cov) <= 1.0 + 1e-12)


# ------------------------------------------------------------------------------------------ backends vs oracle

KERNEL_NAMES = tuple(KERNELS)
RESPONSE_NAMES = tuple(RESPONSES)


def _case_spec(i: int):
    """Case i: the i-th kernel, poolings alternating, the registered responses rotated over the modalities; the
    first case has two runs, the others one (each run is its own compiled graph)."""
    names = RESPONSE_NAMES[i % len(RESPONSE_NAMES):] + RESPONSE_NAMES[:i % len(RESPONSE_NAMES)]
    durations = (36.0, 42.0) if i == 0 else (39.0,)
    return KERNEL_NAMES[i], ("shared", "individual")[i % 2], default_responses(names), durations


N_CASES = max(len(KERNEL_NAMES), -(-len(RESPONSE_NAMES) // 3), 2)
_CACHE: dict = {}


def case(i: int):
    """(data, spec, params, oracle latents, oracle predictions, {backend: model}), built once per case."""
    if i not in _CACHE:
        kernel, pooling, responses, durations = _case_spec(i % len(KERNEL_NAMES))
        data, spec, params = make_case(kernel, pooling, responses, seed=10 + i, durations=durations)
        models = {"dense": msrm.GPMSRM(data, spec, "dense", batch_runs=bool(i % 2 == 0)),
                  "grouped": msrm.GPMSRM(data, spec, "grouped", batch_runs=bool(i % 2 == 1))}
        _CACHE[i] = (data, spec, params, brute_latent_posterior(data, spec, params),
                     brute_predict(data, spec, params), models)
    return _CACHE[i]


def test_the_cases_cover_every_kernel_response_and_pooling():
    used_k, used_r, used_p = set(), set(), set()
    for i in range(N_CASES):
        kernel, pooling, responses, _ = _case_spec(i % len(KERNEL_NAMES))
        used_k.add(kernel)
        used_p.add(pooling)
        used_r.update(r.name for r in responses.values())
    assert used_k == set(KERNELS) and used_r == set(RESPONSES) and used_p == {"shared", "individual"}


def _close(got, ref, what):
    err = float(np.max(np.abs(np.asarray(got) - ref))) if np.size(ref) else 0.0
    assert err <= 1e-8 * _scale(ref), f"{what}: max error {err:.3e} at scale {_scale(ref):.3g}"


@pytest.mark.parametrize("i", range(N_CASES))
def test_latent_posterior_equals_the_oracle(i):
    data, spec, params, ref, _, models = case(i)
    K = spec.n_factors
    got = {la: m.latent_posterior(params, cov=True) for la, m in models.items()}
    for la, runs in got.items():
        assert len(runs) == len(data.runs)
        for r, (lp, (grid, mean, cov)) in enumerate(zip(runs, ref)):
            J = grid.size
            assert isinstance(lp, msrm.LatentPosterior) and lp.mean.shape == (J, K) and lp.cov.shape == (J, K, K)
            np.testing.assert_array_equal(lp.grid, grid)
            blocks = np.stack([cov[j * K:(j + 1) * K, j * K:(j + 1) * K] for j in range(J)])
            _close(lp.mean, mean, f"{la} run {r} mean")
            _close(lp.sd, np.sqrt(np.diag(cov)).reshape(J, K), f"{la} run {r} sd")
            _close(lp.cov, blocks, f"{la} run {r} cov blocks")
            assert np.all(lp.sd <= 1.0 + 1e-12)  # never above the unit prior sd
    for a, b in zip(got["dense"], got["grouped"]):
        _close(a.mean, b.mean, "dense vs grouped mean")
        _close(a.sd, b.sd, "dense vs grouped sd")


@pytest.mark.parametrize("i", range(N_CASES))
def test_predictions_equal_the_oracle_at_every_sample(i):
    data, spec, params, _, ref, models = case(i)
    for la, m in models.items():
        pred = m.predict(params)
        assert len(pred) == len(data.runs)
        for r, (run, per, oracle) in enumerate(zip(data.runs, pred, ref)):
            assert sorted(per) == sorted(s.key for s in run.streams)
            full_seen = part_seen = 0
            for s in run.streams:
                p = per[s.key]
                mean, sd, signal_sd = oracle[s.key]
                assert isinstance(p, msrm.Prediction) and p.mean.shape == s.values.shape
                np.testing.assert_array_equal(p.times, s.times)
                _close(p.mean, mean, f"{la} run {r} {s.key} mean")
                _close(p.sd, sd, f"{la} run {r} {s.key} sd")
                _close(p.signal_sd, signal_sd, f"{la} run {r} {s.key} signal sd")
                missing = np.isnan(s.values)
                full = missing.all(axis=1)
                part = missing.any(axis=1) & ~full
                full_seen += int(full.sum())
                part_seen += int(part.sum())
                # held-out values: the samples entirely missing and the missing features of partly observed ones
                _close(p.mean[full], mean[full], f"{la} {s.key} fully missing samples")
                _close(p.mean[part][missing[part]], mean[part][missing[part]], f"{la} {s.key} partly missing")
                _close(p.sd[missing], sd[missing], f"{la} {s.key} sd of missing values")
                assert np.all(p.sd >= params.noise_sd[s.key][None, :] * (1 - 1e-12))
                assert np.all(p.signal_sd <= p.sd)
            assert full_seen >= 2 * len(run.streams) and part_seen >= 1


def test_cov_off_and_one_trace_per_run_across_parameter_draws(posterior_traces):
    from msrm.gp import conditional

    data, spec, params, ref, _, models = case(0)
    model = models["grouped"]
    a = model.latent_posterior(params, cov=True)
    b = model.latent_posterior(params)
    assert all(x.cov is None for x in b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.mean, y.mean)
        np.testing.assert_array_equal(x.sd, y.sd)
    # another draw of the parameters: no new trace, and the oracle's answer for that draw
    other = msrm.Params(loadings={k: 1.3 * v for k, v in params.loadings.items()}, intercepts=params.intercepts,
                        noise_sd={k: 0.9 * v for k, v in params.noise_sd.items()},
                        lengthscales=1.2 * params.lengthscales, response=params.response)
    before = posterior_traces[0]
    got = model.latent_posterior(other)
    pred = model.predict(other)
    assert posterior_traces[0] == before
    for lp, (grid, mean, cov) in zip(got, brute_latent_posterior(data, spec, other)):
        _close(lp.mean, mean, "second draw mean")
        _close(lp.sd, np.sqrt(np.diag(cov)).reshape(lp.mean.shape), "second draw sd")
    for per, oracle in zip(pred, brute_predict(data, spec, other)):
        for key, (mean, sd, _) in oracle.items():
            _close(per[key].mean, mean, f"second draw {key} mean")
            _close(per[key].sd, sd, f"second draw {key} sd")
    assert not np.allclose(got[0].mean, a[0].mean)


def test_the_cached_tables_go_with_the_model():
    import gc

    from msrm.gp import conditional

    data, spec, params, ref, _, _ = case(1)
    n0 = len(conditional.TABLES)
    for batch_runs in (False, True):  # a per-run Prepared and a stack of runs
        model = msrm.GPMSRM(data, spec, "grouped", batch_runs=batch_runs)
        if not batch_runs:  # evaluated once, so the entry holds a compiled graph too
            _close(model.latent_posterior(params)[0].mean, ref[0][1], "fresh model mean")
        else:
            conditional.run_tables(model.prepared, data, spec, grouped=True)
        assert len(conditional.TABLES) == n0 + 1
        del model
        gc.collect()
        assert len(conditional.TABLES) == n0


# ------------------------------------------------------------------------------------------ bad input


def test_params_of_another_spec_or_dataset_are_refused_before_numerics(posterior_traces):
    from msrm.gp import conditional
    from msrm.gp.model import params_to_theta

    data, spec, params, _, _, models = case(0)
    model = models["grouped"]
    before = posterior_traces[0]
    wrong_k = msrm.Params(loadings={k: np.hstack([v, v[:, :1]]) for k, v in params.loadings.items()},
                          intercepts=params.intercepts, noise_sd=params.noise_sd,
                          lengthscales=np.append(params.lengthscales, 3.0), response=params.response)
    with pytest.raises(ValueError, match="loadings|lengthscales"):
        model.latent_posterior(wrong_k)
    with pytest.raises(ValueError, match="loadings|lengthscales"):
        model.predict(wrong_k)
    renamed = {"p9/brain" if k == "p1/brain" else k: v for k, v in params.loadings.items()}
    other_data = msrm.Params(loadings=renamed, intercepts=params.intercepts, noise_sd=params.noise_sd,
                             lengthscales=params.lengthscales, response=params.response)
    with pytest.raises(KeyError, match="p9/brain|p1/brain"):
        model.predict(other_data)
    # the backend's own check of a parameter pytree (the model validates Params first)
    theta = params_to_theta(params)
    backend = model.backend
    bad = dict(theta, loadings={k: v for k, v in theta["loadings"].items() if k != "p1/brain"})
    with pytest.raises(KeyError, match="loadings: no entry for stream 'p1/brain'"):
        backend.latent_posterior(bad, model.prepared, data, spec)
    bad = dict(theta, lengthscales=theta["lengthscales"][:1])
    with pytest.raises(ValueError, match=r"lengthscales: shape \(1,\), expected \(2,\)"):
        backend.predict(bad, model.prepared, data, spec)
    bad = dict(theta, noise_sd=dict(theta["noise_sd"], **{"p3/rating": theta["noise_sd"]["p3/rating"][:0]}))
    with pytest.raises(ValueError, match=r"noise_sd\['p3/rating'\]: shape \(0,\), expected \(1,\)"):
        backend.predict(bad, model.prepared, data, spec)
    # data that are not the model's
    short = msrm.Dataset(data.runs[:1])
    with pytest.raises(ValueError, match="data: 1 runs, but the model was prepared with 2"):
        backend.latent_posterior(theta, model.prepared, short, spec)
    assert posterior_traces[0] == before
