"""msrm.align: Procrustes and signed-permutation alignment of latents, loadings and latent posteriors."""
from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import special_ortho_group

from msrm.align import align
from msrm.latent import LatentPosterior


def _latents(seed=0, J=(60, 45), K=3):
    rng = np.random.default_rng(seed)
    t = [np.arange(j)[:, None] * 0.2 for j in J]
    return [np.sin(tt * np.array([1.0, 0.37, 0.11])[:K] + rng.uniform(0, 6, K)) + rng.normal(0, 0.05, (len(tt), K))
            for tt in t]


def test_procrustes_recovers_a_known_rotation_and_shift_over_several_runs():
    ref = _latents()
    Q = special_ortho_group.rvs(3, random_state=1)
    shift = np.array([0.5, -2.0, 1.0])
    est = [z @ Q.T + shift for z in ref]  # est @ Q = ref + shift @ Q: one transform for both runs
    res = align(est, ref)
    assert res.method == "procrustes"
    np.testing.assert_allclose(res.transform, Q, atol=1e-10)
    assert isinstance(res.latents, list) and len(res.latents) == 2
    for a, r in zip(res.latents, ref):
        np.testing.assert_allclose(a, r, atol=1e-10)
    # without centring the shift is not modelled and the fit is only approximate
    raw = align(est, ref, center=False)
    assert np.abs(raw.latents[0] - ref[0]).max() > 1e-3


def test_signed_permutation_recovers_order_and_signs():
    ref = _latents(seed=2)
    perm, signs = np.array([2, 0, 1]), np.array([-1.0, 1.0, -1.0])
    # est factor perm[l] carries sign_l * ref factor l, plus a little noise
    rng = np.random.default_rng(3)
    est = []
    for z in ref:
        e = np.empty_like(z)
        e[:, perm] = z * signs
        est.append(e + rng.normal(0, 0.01, e.shape))
    res = align(est, ref, method="signed_permutation")
    np.testing.assert_array_equal(res.permutation, perm)
    np.testing.assert_array_equal(res.signs, signs)
    assert set(np.unique(res.transform)) <= {-1.0, 0.0, 1.0}
    for a, r in zip(res.latents, ref):
        np.testing.assert_allclose(a, r, atol=0.05)
    np.testing.assert_allclose(res.center, 0.0)  # a signed permutation does not shift by default


def test_loadings_and_intercepts_keep_the_predictions():
    rng = np.random.default_rng(4)
    ref = _latents(seed=5)
    A = rng.standard_normal((3, 3)) + 2 * np.eye(3)  # a general (non-orthogonal) map: est = ref @ A^-1 + m
    est = [z @ np.linalg.inv(A) + np.array([1.0, 0.0, -1.0]) for z in ref]
    W = {"p1/brain": rng.standard_normal((7, 3)), "p2/rating": rng.standard_normal((1, 3))}
    b = {k: rng.standard_normal(v.shape[0]) for k, v in W.items()}
    res = align(est, ref, loadings=W)
    b2 = res.apply_intercepts(b, W)
    for k in W:
        np.testing.assert_allclose(res.loadings[k], W[k] @ res.transform, atol=1e-12)  # orthogonal: W T
        for z, z2 in zip(est, res.latents):
            np.testing.assert_allclose(b[k] + z @ W[k].T, b2[k] + z2 @ res.loadings[k].T, atol=1e-10)
    # the general rule W T^{-T} for a non-orthogonal transform, checked with a hand-made Alignment
    from msrm.align import Alignment

    T = rng.standard_normal((3, 3)) + 3 * np.eye(3)
    g = Alignment(latents=None, transform=T, method="procrustes", center=np.zeros(3), offset=np.zeros(3))
    np.testing.assert_allclose(g.apply_loadings(W["p1/brain"]), W["p1/brain"] @ np.linalg.inv(T).T, atol=1e-12)
    z = est[0]
    np.testing.assert_allclose(z @ W["p1/brain"].T, g.apply(z) @ g.apply_loadings(W["p1/brain"]).T, atol=1e-10)


def _posterior(mean, seed):
    rng = np.random.default_rng(seed)
    J, K = mean.shape
    L = rng.normal(0, 0.2, (J, K, K))
    cov = np.einsum("jkl,jml->jkm", L, L) + 0.01 * np.eye(K)
    sd = np.sqrt(np.einsum("jkk->jk", cov))
    return LatentPosterior(grid=np.arange(J, dtype=float), mean=mean, sd=sd, cov=cov)


def test_latent_posterior_transform():
    ref = _latents(seed=6, J=(40,))[0]
    perm, signs = np.array([1, 2, 0]), np.array([1.0, -1.0, -1.0])
    est_mean = np.empty_like(ref)
    est_mean[:, perm] = ref * signs
    post = _posterior(est_mean, 7)
    # auto picks a signed permutation for a posterior; the sd permutes, the covariance is T^T C T
    res = align(post, ref)
    assert res.method == "signed_permutation"
    out = res.latents
    np.testing.assert_allclose(out.mean, ref, atol=1e-12)
    np.testing.assert_allclose(out.sd, post.sd[:, perm], atol=1e-12)
    np.testing.assert_allclose(out.cov, post.cov[:, perm][:, :, perm] * np.outer(signs, signs), atol=1e-12)
    # a rotation: marginal sd from the covariance, checked against sampling-free brute force (x T, one grid point)
    rot = align(post, ref, method="procrustes")
    T = rot.transform
    j = 5
    C = post.cov[j]
    np.testing.assert_allclose(rot.latents.sd[j], np.sqrt(np.diag(T.T @ C @ T)), rtol=1e-12)
    no_cov = LatentPosterior(grid=post.grid, mean=post.mean, sd=post.sd)
    with pytest.raises(ValueError, match="covariance"):
        align(no_cov, ref, method="procrustes")
    # the signed permutation needs no covariance
    assert align(no_cov, ref).latents.cov is None


def test_bad_input():
    ref = _latents()
    with pytest.raises(ValueError, match="K = 2 factors but reference has K = 3"):
        align([z[:, :2] for z in ref], ref)
    with pytest.raises(ValueError, match="grid points"):
        align([ref[0][:-1], ref[1]], ref)
    with pytest.raises(ValueError, match="runs"):
        align(ref[:1], ref)
    bad = ref[0].copy()
    bad[3, 1] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        align([bad, ref[1]], ref)
    with pytest.raises(ValueError, match="method"):
        align(ref, ref, method="varimax")
    with pytest.raises(ValueError, match=r"\(J, K\)"):
        align(ref[0][:, 0], ref[0])
    res = align(ref, ref)
    with pytest.raises(ValueError, match="factors"):
        res.apply_loadings(np.zeros((4, 2)))
