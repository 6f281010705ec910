"""R-MSRM building blocks against their references: reuse vs dense objective, banded vs SuperLU, analytic vs
finite-difference theta gradients, closed-form steps, the exact reparametrisation of the convention."""
from __future__ import annotations

import numpy as np
import pytest

import data_synth
from msrm.rmsrm import convention
from msrm.rmsrm.latent import (latent_blocks, latent_sparse_system, pad_tie_lowrank, solve_latent_banded,
                               solve_latent_superlu)
from msrm.rmsrm.loadings import residual_sum_squares, update_loadings, update_noise
from msrm.rmsrm.objective import (RState, compute_stats, objective_dense, objective_reuse, penalty_metric,
                                  slot_latents, theta_value_and_grad_dense, theta_value_and_grad_reuse)
from msrm.rmsrm.prepare import prepare_rmsrm


def _problem(pooling="shared", missing=0.0, seed=0, n_runs=1):
    data, truth = data_synth.synthetic_dataset("tiny", n_features=12, seed=seed, pooling=pooling,
                                               missing_fraction=missing, n_runs=n_runs)
    prep = prepare_rmsrm(data, truth.spec, roughness=3.0)
    rng = np.random.default_rng(seed + 100)
    # a generic state away from the truth: perturbed latents, loadings, intercepts, noise and theta
    Z = tuple(z + 0.3 * rng.standard_normal(z.shape) for z in truth.latents)
    tp = truth.params
    W = {k: v + 0.2 * rng.standard_normal(v.shape) for k, v in tp.loadings.items()}
    b = {k: v + 0.1 * rng.standard_normal(v.shape) for k, v in tp.intercepts.items()}
    var = {k: (v * rng.uniform(0.8, 1.2, v.shape)) ** 2 for k, v in tp.noise_sd.items()}
    theta = {}
    for k, t in tp.response.items():
        theta[k] = {}
        for n, v in t.items():
            resp = truth.spec.response(k.split("/")[-1])
            lo, hi = resp.bounds[n]
            theta[k][n] = float(np.clip(v + rng.uniform(-0.2, 0.2), lo + 0.01, hi - 0.01))
    return data, truth, prep, RState(Z=Z, W=W, b=b, var=var, theta=theta)


CASES = [("shared", 0.0, 1), ("individual", 0.0, 1), ("shared", 0.15, 2), ("individual", 0.15, 1)]


@pytest.mark.parametrize("pooling,missing,n_runs", CASES)
def test_reuse_objective_equals_dense(pooling, missing, n_runs):
    _, _, prep, state = _problem(pooling, missing, n_runs=n_runs)
    stats = compute_stats(prep, state)
    dense = objective_dense(prep, state)
    reuse = objective_reuse(prep, state, stats)
    assert reuse == pytest.approx(dense, rel=1e-10)


@pytest.mark.parametrize("pooling,missing,n_runs", CASES)
def test_reuse_theta_gradient_equals_dense(pooling, missing, n_runs):
    _, _, prep, state = _problem(pooling, missing, n_runs=n_runs)
    stats = compute_stats(prep, state)
    J0 = objective_dense(prep, state)
    for g in prep.theta_groups:
        pk = prep.groups[g].param_key
        f0, _ = theta_value_and_grad_reuse(prep, state, stats, g, state.theta[pk])
        moved = {n: v + 0.05 for n, v in state.theta[pk].items()}
        f, grad_r = theta_value_and_grad_reuse(prep, state, stats, g, moved)
        J, grad_d = theta_value_and_grad_dense(prep, state, g, moved)
        assert J0 - f0 + f == pytest.approx(J, rel=1e-10)
        np.testing.assert_allclose(grad_r, grad_d, rtol=1e-10, atol=1e-10 * np.abs(grad_d).max())


@pytest.mark.parametrize("pooling,missing", [("shared", 0.0), ("individual", 0.15)])
def test_theta_gradient_matches_central_differences(pooling, missing):
    _, _, prep, state = _problem(pooling, missing)
    stats = compute_stats(prep, state)
    h = 1e-5
    for g in prep.theta_groups:
        pk = prep.groups[g].param_key
        names = prep.groups[g].response.param_names
        _, grad = theta_value_and_grad_reuse(prep, state, stats, g, state.theta[pk])
        for j, n in enumerate(names):
            up = dict(state.theta[pk]); up[n] += h
            dn = dict(state.theta[pk]); dn[n] -= h
            fd = (theta_value_and_grad_reuse(prep, state, stats, g, up)[0]
                  - theta_value_and_grad_reuse(prep, state, stats, g, dn)[0]) / (2 * h)
            assert grad[j] == pytest.approx(fd, rel=1e-6, abs=1e-7)


@pytest.mark.parametrize("pooling,missing,n_runs", CASES)
def test_banded_latent_solve_equals_superlu(pooling, missing, n_runs):
    _, _, prep, state = _problem(pooling, missing, n_runs=n_runs)
    stats = compute_stats(prep, state)
    for r in range(len(prep.runs)):
        B, h = latent_blocks(prep, state, stats, r)
        z_band, ld_band = solve_latent_banded(B, h, lowrank=pad_tie_lowrank(prep, r, stats.S), logdet=True)
        z_lu, ld_lu = solve_latent_superlu(prep, state, stats, r, logdet=True)
        np.testing.assert_allclose(z_band, z_lu, rtol=1e-10, atol=1e-10 * np.abs(z_lu).max())
        # and the solution is the minimiser: the latent gradient H z - h vanishes
        H, hv = latent_sparse_system(prep, state, stats, r)
        assert np.abs(H @ z_band.ravel() - hv).max() <= 1e-9 * np.abs(hv).max()
        # log det H (banded Cholesky + determinant lemma) against SuperLU and a dense slogdet
        sign, ld_dense = np.linalg.slogdet(H.toarray())
        assert sign > 0
        np.testing.assert_allclose([ld_band, ld_lu], ld_dense, rtol=1e-10)


def test_latent_step_minimises_the_objective_in_z():
    _, _, prep, state = _problem("shared", 0.1)
    stats = compute_stats(prep, state)
    Z = tuple(solve_latent_banded(*latent_blocks(prep, state, stats, r)) for r in range(len(prep.runs)))
    best = state._replace(Z=Z)
    J = objective_reuse(prep, best, stats)
    assert J < objective_reuse(prep, state, stats)
    rng = np.random.default_rng(3)
    for _ in range(5):
        moved = best._replace(Z=tuple(z + 1e-3 * rng.standard_normal(z.shape) for z in Z))
        assert objective_reuse(prep, moved, stats) > J


@pytest.mark.parametrize("missing", [0.0, 0.15])
def test_loading_step_and_noise_step_are_exact_minimisers(missing):
    _, _, prep, state = _problem("shared", missing)
    latents = slot_latents(prep, state)
    W, b, q = update_loadings(prep, state, latents)
    new = state._replace(W=W, b=b)
    q_dense = residual_sum_squares(prep, new, latents)
    for k in prep.keys:
        np.testing.assert_allclose(q[k], q_dense[k], rtol=1e-8)
    J_w = objective_dense(prep, new)
    assert J_w < objective_dense(prep, state)
    rng = np.random.default_rng(1)
    key = prep.keys[0]
    for _ in range(3):  # perturbing the solved loadings raises J
        Wp = dict(W); Wp[key] = W[key] + 1e-4 * rng.standard_normal(W[key].shape)
        assert objective_dense(prep, new._replace(W=Wp)) > J_w
    var = update_noise(prep, new, q)
    J_n = objective_dense(prep, new._replace(var=var))
    assert J_n <= J_w
    for scale in (0.99, 1.01):
        assert objective_dense(prep, new._replace(var={k: v * scale for k, v in var.items()})) > J_n


@pytest.mark.parametrize("pooling,n_runs", [("shared", 2), ("individual", 1)])
def test_convention_is_an_exact_reparametrisation(pooling, n_runs):
    _, _, prep, state = _problem(pooling, 0.1, n_runs=n_runs)
    canon = convention.canonical(prep, state)
    assert objective_dense(prep, canon) == pytest.approx(objective_dense(prep, state), rel=1e-11)
    # centred and whitened over the runs' spans [0, T], the pad left out
    allz = np.concatenate([z[run.observed] for z, run in zip(canon.Z, prep.runs)])
    assert allz.shape[0] < sum(z.shape[0] for z in canon.Z)
    np.testing.assert_allclose(allz.mean(axis=0), 0.0, atol=1e-12)
    np.testing.assert_allclose(allz.T @ allz / allz.shape[0], np.eye(prep.n_factors), atol=1e-12)
    S = penalty_metric(prep, canon.W, canon.var)
    np.testing.assert_allclose(S - np.diag(np.diag(S)), 0.0, atol=1e-12 * np.abs(S).max())
    assert np.all(np.diff(np.diag(S)) <= 0)
    # predictions are unchanged
    for r, (la, lb) in enumerate(zip(slot_latents(prep, state), slot_latents(prep, canon))):
        for st in prep.runs[r].streams:
            pa = state.b[st.key] + la[st.slot] @ state.W[st.key].T
            pb = canon.b[st.key] + lb[st.slot] @ canon.W[st.key].T
            np.testing.assert_allclose(pa, pb, rtol=1e-10, atol=1e-10)
