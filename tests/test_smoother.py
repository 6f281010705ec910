"""The state-space backend's latent posterior and predictions (the RTS smoother of msrm.gp.state_space.smoother)
against the brute-force oracle (tests/latent_oracle.py: the dense joint Gaussian of vec Z and the observed values
of one run), against the grouped backend, and across the filter's own options (checkpointing, block length, the
associative-scan tables).

Cases are tiny (two runs of 30 and 34 s, or one of 32 s, 1.5 s grid, K = 2) with about 20% of the values missing: random single
values, two samples of every stream entirely missing, one stream offset from the others' clock. Every kernel of
``msrm.kernels.KERNELS`` and every response of ``msrm.responses.RESPONSES`` (each from its class with its default
bounds, rotated over the three modalities) is covered, under both poolings.
"""
from __future__ import annotations

import numpy as np
import pytest

import msrm

msrm.runtime.enable_x64()

from latent_oracle import (brute_latent_posterior, brute_marginal_loglik, brute_predict,  # noqa: E402
                           prior_covariance, stream_rows)
from msrm.gp.state_space import prepare  # noqa: E402
from msrm.gp.state_space.smoother import smooth_run  # noqa: E402
from msrm.kernels import KERNELS  # noqa: E402
from msrm.nodes import response_groups  # noqa: E402
from msrm.responses import RESPONSES  # noqa: E402

# (participant, modality, dt, offset, n_features)
STREAMS = (("p1", "brain", 2.0, 0.0, 3), ("p2", "brain", 2.0, 0.0, 2), ("p3", "rating", 1.5, 0.0, 1),
           ("p4", "rating", 1.5, 0.7, 1), ("p3", "physio", 2.5, 0.0, 2))
MODALITIES = ("brain", "rating", "physio")
TOL = 1e-8


def responses_for(case: int) -> dict:
    """{modality: response}: the registered responses rotated over the modalities, shifted by ``case`` so that
    across the cases each response meets each modality."""
    names = list(RESPONSES)
    return {m: RESPONSES[names[(case + i) % len(names)]]() for i, m in enumerate(MODALITIES)}


def make_case(kernel: str, pooling: str, responses: dict, seed: int = 0, K: int = 2, durations=(30.0, 34.0),
              missing: float = 0.2):
    """A tiny two-run dataset drawn from the model, its spec and the parameters it was drawn with; about
    ``missing`` of the values NaN plus two whole samples of every stream (every feature keeps an observed value)."""
    rng = np.random.default_rng(seed)
    spec = msrm.ModelSpec(n_factors=K, latent_dt=1.5, kernel=kernel, pooling=pooling, responses=dict(responses))

    def n_samples(T, dt, off):
        return int(np.floor((T - off) / dt + 1e-9)) + 1

    skeleton = msrm.Dataset([msrm.Run(duration=durations[0], streams=[
        msrm.Stream(participant=p, modality=m, dt=dt, offset=off, values=np.zeros((n_samples(durations[0], dt, off), F)))
        for p, m, dt, off, F in STREAMS])])
    groups = response_groups(skeleton, spec)
    response_theta = {g.param_key: {n: lo + rng.uniform(0.25, 0.6) * (hi - lo)
                                    for n, (lo, hi) in g.response.bounds.items()}
                      for g in groups if g.param_key is not None}
    keys = [f"{p}/{m}" for p, m, *_ in STREAMS]
    params = msrm.Params(
        loadings={k: rng.normal(0.0, 0.8, (F, K)) for k, (*_, F) in zip(keys, STREAMS)},
        intercepts={k: rng.normal(0.0, 1.0, F) for k, (*_, F) in zip(keys, STREAMS)},
        noise_sd={k: rng.uniform(0.3, 0.8, F) for k, (*_, F) in zip(keys, STREAMS)},
        lengthscales=np.geomspace(2.0, 6.0, K), response=response_theta)
    by_key = {g.key: g for g in groups}
    runs = []
    for T in durations:
        grid = msrm.latent_grid(T, spec)
        P = prior_covariance(grid, params.lengthscales, kernel)
        Z = (np.linalg.cholesky(P + 1e-10 * np.eye(P.shape[0])) @ rng.standard_normal(P.shape[0])).reshape(grid.size, K)
        streams = []
        for key, (p, m, dt, off, F) in zip(keys, STREAMS):
            n = n_samples(T, dt, off)
            s0 = msrm.Stream(participant=p, modality=m, dt=dt, offset=off, values=np.zeros((n, F)))
            A = stream_rows(s0, by_key.get(key, by_key.get(m)), params, grid)
            Y = params.intercepts[key] + (A @ Z) @ params.loadings[key].T + params.noise_sd[key] * rng.standard_normal((n, F))
            drop = rng.random((n, F)) < missing
            full = rng.choice(n, 2, replace=False)
            drop[full] = True
            keep = np.setdiff1d(np.arange(n), full)[0]
            drop[keep, drop.all(axis=0)] = False
            Y[drop] = np.nan
            streams.append(msrm.Stream(participant=p, modality=m, dt=dt, offset=off, values=Y))
        runs.append(msrm.Run(duration=T, streams=streams))
    return msrm.Dataset(runs), spec, params


def _close(actual, expected, tol=TOL, what=""):
    scale = max(1.0, float(np.max(np.abs(expected))))
    err = float(np.max(np.abs(np.asarray(actual) - np.asarray(expected))))
    assert err <= tol * scale, f"{what}: max abs error {err:.3e} > {tol:g} x {scale:g}"


def check_against_oracle(model, data, spec, params):
    """Latent posterior (mean, sd, K x K blocks) and predictions (mean, sd, signal sd, times) of ``model`` against
    the oracle, run by run."""
    K = spec.n_factors
    zs = model.latent_posterior(params, cov=True)
    preds = model.predict(params)
    oracle_z = brute_latent_posterior(data, spec, params)
    oracle_p = brute_predict(data, spec, params)
    assert len(zs) == len(preds) == len(data.runs)
    for r, (z, (grid, mean, cov), pred, opred, run) in enumerate(zip(zs, oracle_z, preds, oracle_p, data.runs)):
        J = grid.size
        blocks = cov.reshape(J, K, J, K)[np.arange(J), :, np.arange(J), :]
        np.testing.assert_array_equal(z.grid, grid)
        _close(z.mean, mean, what=f"run {r} latent mean")
        _close(z.sd, np.sqrt(np.diagonal(blocks, axis1=1, axis2=2)), what=f"run {r} latent sd")
        _close(z.cov, blocks, what=f"run {r} latent covariance")
        assert set(pred) == {s.key for s in run.streams}
        for s in run.streams:
            m, sd, sig = opred[s.key]
            p = pred[s.key]
            assert p.mean.shape == s.values.shape
            np.testing.assert_allclose(p.times, s.times, rtol=0, atol=1e-12)
            _close(p.mean, m, what=f"run {r} {s.key} mean")
            _close(p.sd, sd, what=f"run {r} {s.key} sd")
            _close(p.signal_sd, sig, what=f"run {r} {s.key} signal sd")
    return zs, preds


# ------------------------------------------------------------------------------------------ against the oracle

KERNEL_NAMES = list(KERNELS)
#: (kernel, pooling) per case: every kernel, both poolings, and as many cases as responses, so that the rotation
#: of :func:`responses_for` puts every response on every modality
CASES = [(KERNEL_NAMES[c % len(KERNEL_NAMES)], ("shared", "individual")[c % 2])
         for c in range(max(len(KERNEL_NAMES), len(RESPONSES), 2))]


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{k}-{p}" for k, p in CASES])
def test_state_space_posterior_and_predictions_equal_the_oracle(case):
    kernel, pooling = CASES[case]
    data, spec, params = make_case(kernel, pooling, responses_for(case), seed=case)
    # whole samples missing are predicted too (they are nodes with no information)
    assert sum(np.isnan(s.values).all(axis=1).sum() for r in data.runs for s in r.streams) >= 10
    model = msrm.GPMSRM(data, spec, linear_algebra="state_space")
    zs, _ = check_against_oracle(model, data, spec, params)
    assert zs[0].cov.shape == (zs[0].grid.size, spec.n_factors, spec.n_factors)
    assert model.latent_posterior(params)[0].cov is None
    # the smoother's forward pass is the density's filter: its log likelihood is the oracle's
    theta = model._theta_of(params)
    values = [smooth_run(theta, run, nodes=False, grid=False).loglik for run in model.prepared.runs]
    np.testing.assert_allclose(sum(values), brute_marginal_loglik(data, spec, params), rtol=1e-10)


def test_cases_cover_every_kernel_pooling_and_response_on_every_modality():
    assert {k for k, _ in CASES} == set(KERNELS) and {p for _, p in CASES} == {"shared", "individual"}
    seen = {(m, type(r)) for case in range(len(CASES)) for m, r in responses_for(case).items()}
    assert seen == {(m, cls) for m in MODALITIES for cls in RESPONSES.values()}


# ------------------------------------------------------------------------------------------ one-run case


@pytest.fixture(scope="module")
def one_run():
    """A one-run case (Matérn-5/2, individual pooling) and its default state-space model."""
    data, spec, params = make_case("matern52", "individual", responses_for(2), seed=5, durations=(32.0,))
    return data, spec, params, msrm.GPMSRM(data, spec, linear_algebra="state_space")


CHUNKED = {"checkpoint_every": 2, "block": 2}


@pytest.fixture(scope="module")
def chunked(one_run):
    """The one-run case's model with blocks of 2 grid steps in checkpointed chunks of 2 sub-steps."""
    data, spec, _, _ = one_run
    return msrm.GPMSRM(data, spec, linear_algebra="state_space", **CHUNKED)


@pytest.mark.parametrize("options", [CHUNKED, {"block": 1}, {"parallel": True},
                                     {"method": "native", "checkpoint_every": 5, "block": 3}])
def test_options_do_not_change_the_posterior(one_run, chunked, options):
    """Several checkpointed chunks (the reverse pass recomputes each), other block lengths, the associative
    scan's preparation and the native method all give the default's posterior."""
    data, spec, params, base = one_run
    other = chunked if options is CHUNKED else msrm.GPMSRM(data, spec, linear_algebra="state_space", **options)
    if "checkpoint_every" in options:
        assert all(run.tables.n_chunks > 1 for run in other.prepared.runs)
    for a, b in zip(base.latent_posterior(params, cov=True), other.latent_posterior(params, cov=True)):
        _close(b.mean, a.mean, 1e-10, "mean")
        _close(b.cov, a.cov, 1e-10, "cov")
    for pa, pb in zip(base.predict(params), other.predict(params)):
        for key in pa:
            _close(pb[key].mean, pa[key].mean, 1e-10, key)
            _close(pb[key].sd, pa[key].sd, 1e-10, key)


def test_held_out_value_is_predicted_from_the_rest(one_run):
    """A value masked with NaN is predicted as the oracle's held-out predictive, from the other values."""
    data, spec, params, base = one_run
    run = data.runs[0]
    s = run.streams[0]
    i, f = np.argwhere(~np.isnan(s.values))[3]
    Y = s.values.copy()
    Y[i, f] = np.nan
    streams = [msrm.Stream(participant=s.participant, modality=s.modality, dt=s.dt, offset=s.offset, values=Y)]
    held = msrm.Dataset([msrm.Run(duration=run.duration, streams=streams + list(run.streams[1:]))])
    pred = msrm.GPMSRM(held, spec, linear_algebra="state_space").predict(params)[0][s.key]
    m, sd, _ = brute_predict(held, spec, params)[0][s.key]
    _close(pred.mean[i, f], m[i, f], what="held-out mean")
    _close(pred.sd[i, f], sd[i, f], what="held-out sd")
    full = base.predict(params)[0][s.key]
    assert abs(full.mean[i, f] - pred.mean[i, f]) > 1e-6  # the value itself informs the unmasked prediction
    assert full.sd[i, f] < pred.sd[i, f]


# ------------------------------------------------------------------------------------------ against grouped


def test_state_space_equals_grouped(one_run):
    data, spec, params, ss = one_run
    grouped = msrm.GPMSRM(data, spec, linear_algebra="grouped")
    try:
        gz = grouped.latent_posterior(params, cov=True)
        gp = grouped.predict(params)
    except NotImplementedError as exc:
        pytest.skip(f"grouped backend: {exc}")
    for a, b in zip(gz, ss.latent_posterior(params, cov=True)):
        _close(b.mean, a.mean, what="mean")
        _close(b.sd, a.sd, what="sd")
        if a.cov is not None:
            _close(b.cov, a.cov, what="cov")
    for pa, pb in zip(gp, ss.predict(params)):
        assert set(pa) == set(pb)
        for key in pa:
            _close(pb[key].mean, pa[key].mean, what=key)
            _close(pb[key].sd, pa[key].sd, what=key)
            if pa[key].signal_sd is not None:
                _close(pb[key].signal_sd, pa[key].signal_sd, what=key)


# ------------------------------------------------------------------------------------------ approximate embeddings


def _effective_rows(model, theta, r: int) -> np.ndarray:
    """(N, J) rows ``x_u = ã_u^T Z`` of the approximate model a bank embedding computes, for run r: a bank node
    ending at step e reads ``c_u^T xi_e`` with ``xi_e = sum_{l <= e} g[e - l] z_l`` (the bank starts at zero), so
    ``ã_u[l] = c_u^T g[e - l]``; ring nodes read their window weights."""
    from msrm.gp.state_space.embedding import bank_impulse
    from msrm.gp.state_space.filter import group_readouts

    run = model.prepared.runs[r]
    t, lay = run.tables, run.gp.layout
    G = bank_impulse(np.asarray(t.bank_M), np.asarray(t.bank_v), lay.n_grid)
    rows = np.zeros((lay.n_nodes, lay.n_grid))
    for g, c in zip(t.groups, group_readouts(theta, t)):
        c = np.asarray(c)[: g.n_g]
        start, w = np.asarray(g.window.start), g.width
        for u in range(g.n_g):
            if g.mode == "ring":
                np.add.at(rows[g.node_start + u], start[u] + np.arange(w), c[u])
            else:
                e = start[u] + w - 1
                rows[g.node_start + u, : e + 1] = G[e::-1] @ c[u]
    return rows


def test_bank_embedding_gives_the_approximate_models_exact_posterior(one_run):
    """Under a rational filter bank the smoother returns the exact posterior of the approximate model the bank's
    density describes (each node reading its bank readout ``ã_u^T Z``), by the same dense conditional as the
    oracle's; it is not the exact model's."""
    data, spec, params, exact = one_run
    bank = msrm.GPMSRM(data, spec, linear_algebra="state_space", response_embedding="rational", n_states=8)
    assert any(g.mode == "bank" for g in bank.prepared.runs[0].tables.groups)
    theta = bank._theta_of(params)
    K, run = spec.n_factors, data.runs[0]
    rows = _effective_rows(bank, theta, 0)
    lay = bank.prepared.runs[0].gp.layout
    grid = lay.grid
    J = grid.size
    P = prior_covariance(grid, params.lengthscales, spec.kernel)
    H, y, b, nv = [], [], [], []
    sample_rows = {}
    for s, sl in zip(run.streams, lay.streams):
        A = rows[sl.sample_nodes]
        sample_rows[s.key] = A
        W = params.loadings[s.key]
        i, f = np.nonzero(s.mask)
        H.append((A[i][:, :, None] * W[f][:, None, :]).reshape(i.size, J * K))
        y.append(s.values[i, f])
        b.append(params.intercepts[s.key][f])
        nv.append(params.noise_sd[s.key][f] ** 2)
    H, y, b, nv = map(np.concatenate, (H, y, b, nv))
    Sy = H @ P @ H.T + np.diag(nv)
    PHt = P @ H.T
    mean = PHt @ np.linalg.solve(Sy, y - b)
    cov = P - PHt @ np.linalg.solve(Sy, PHt.T)
    z = bank.latent_posterior(params, cov=True)[0]
    _close(z.mean, mean.reshape(J, K), what="bank latent mean")
    _close(z.cov, cov.reshape(J, K, J, K)[np.arange(J), :, np.arange(J), :], what="bank latent covariance")
    pred = bank.predict(params)[0]
    for s in run.streams:
        A, W = sample_rows[s.key], params.loadings[s.key]
        Hs = (A[:, None, :, None] * W[None, :, None, :]).reshape(-1, J * K)
        sig = np.einsum("ox,xy,oy->o", Hs, cov, Hs).reshape(A.shape[0], -1)
        _close(pred[s.key].mean, params.intercepts[s.key] + (Hs @ mean).reshape(A.shape[0], -1), what=s.key)
        _close(pred[s.key].sd, np.sqrt(sig + params.noise_sd[s.key] ** 2), what=s.key)
    ze = exact.latent_posterior(params)[0]
    assert np.max(np.abs(z.mean - ze.mean)) > 1e-6  # a different (approximate) model's posterior


def test_one_smoother_pass_is_shared_only_at_the_same_parameters_and_data(one_run, chunked):
    """latent_posterior and predict at the same parameters share a pass; other parameter values, or another model
    with the same parameters, are smoothed afresh."""
    from msrm.gp.state_space import smoother

    data, spec, params, model = one_run
    z1 = model.latent_posterior(params)[0]
    assert smoother._LAST.runs is not None
    first = smoother._LAST.runs
    model.predict(params)
    assert smoother._LAST.runs is first
    ell = np.asarray(params.lengthscales) * 1.5
    moved = msrm.Params(loadings=params.loadings, intercepts=params.intercepts, noise_sd=params.noise_sd,
                        lengthscales=ell, response=params.response)
    z2 = model.latent_posterior(moved)[0]
    assert smoother._LAST.runs is not first
    fresh = smoother.smooth_run(model._theta_of(moved), model.prepared.runs[0])
    _close(z2.mean, fresh.grid_mean, 1e-12, "fresh pass")
    assert np.max(np.abs(z2.mean - z1.mean)) > 1e-6
    second = smoother._LAST.runs
    chunked.latent_posterior(moved)
    assert smoother._LAST.runs is not second


def test_pipelined_recomputation_gives_the_same_posterior(one_run, chunked, monkeypatch):
    """Recomputing chunk c - 1 on a second thread while the reverse pass runs over chunk c changes nothing."""
    from msrm.gp.state_space import host

    params = one_run[2]
    theta, run = chunked._theta_of(params), chunked.prepared.runs[0]
    assert run.tables.n_chunks > 2
    plain = smooth_run(theta, run)
    monkeypatch.setattr(host, "PIPELINE_MIN_WORK", 0.0)
    monkeypatch.setattr(msrm.runtime, "physical_cores", lambda: 2)
    assert host.HostFilter(run.tables).pipeline_pays
    piped = smooth_run(theta, run)
    for name in ("grid_mean", "grid_cov", "node_mean", "node_cov"):
        np.testing.assert_array_equal(getattr(piped, name), getattr(plain, name))


def test_associative_scan_tables_are_converted_once(one_run):
    from msrm.gp.state_space.smoother import sequential_run

    data, spec, params, _ = one_run
    run = msrm.GPMSRM(data, spec, linear_algebra="state_space", parallel=True).prepared.runs[0]
    a, b = sequential_run(run), sequential_run(run)
    assert a.tables is b.tables and not a.tables.parallel and a.gp is run.gp
