"""The latent posterior and posterior predictions of the dense and grouped backends against the brute-force
oracle (tests/latent_oracle.py: the dense joint Gaussian of vec Z and the observed values of one run).

Cases are tiny (two runs of 36-42 s, 1.5 s grid, K = 2) with about 20% of the values missing: random values, some
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
    """A tiny two-run dataset drawn from the model, its spec and the parameters it was drawn with.

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
            theta[g.param_key] = {n: lo + rng.uniform(0.25, 0.6) * (hi - lo) for n, (lo, hi) in g.response.bounds.items()}
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
            Y = params.intercepts[key] + (A @ Z) @ params.loadings[key].T + params.noise_sd[key] * rng.standard_normal((n, F))
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
    return max(1.0, float(np.max(np.abs(a))))


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
