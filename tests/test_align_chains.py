"""Alignment of NUTS chains' factors (sign and order) on a GP-MSRM model's unconstrained draws."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

import data_synth
import msrm
from msrm.gp.align_chains import align_chain_draws, apply_signed_permutation, match_factors


@pytest.fixture(scope="module")
def model_and_truth():
    msrm.runtime.enable_x64()
    data, truth = data_synth.synthetic_dataset("tiny", n_features=6, seed=2, n_factors=3)
    return msrm.GPMSRM(data, truth.spec, method="native"), truth


def _chain(model, truth, seed, n=30):
    rng = np.random.default_rng(seed)
    u0 = model.unconstrain(truth.params)
    return u0 + 0.05 * rng.standard_normal((n, u0.size))


def test_match_factors_margin_equals_brute_force_over_signed_permutations():
    rng = np.random.default_rng(0)
    for _ in range(20):
        C = rng.uniform(-1, 1, (3, 3))
        scores = []
        for perm in itertools.permutations(range(3)):
            for signs in itertools.product((-1.0, 1.0), repeat=3):
                scores.append((sum(s * C[p, l] for l, (p, s) in enumerate(zip(perm, signs))), perm, signs))
        scores.sort(key=lambda t: -t[0])
        perm, signs, margin = match_factors(C)
        assert tuple(perm) == scores[0][1] and tuple(signs) == scores[0][2]
        np.testing.assert_allclose(margin, scores[0][0] - scores[1][0], atol=1e-12)
    # one factor: only the sign is in question
    perm, signs, margin = match_factors(np.array([[-0.8]]))
    assert perm.tolist() == [0] and signs.tolist() == [-1.0] and np.isclose(margin, 1.6)


def test_flipped_and_permuted_chains_come_out_aligned(model_and_truth):
    model, truth = model_and_truth
    d0, d1, d2 = (_chain(model, truth, s) for s in (0, 1, 2))
    # chain 1 holds the same posterior with factors reordered and two signs flipped; chain 2 is only reordered
    c1 = apply_signed_permutation(d1, model.blocks, np.array([2, 0, 1]), np.array([-1.0, 1.0, -1.0]))
    c2 = apply_signed_permutation(d2, model.blocks, np.array([1, 0, 2]), np.ones(3))
    res = align_chain_draws(model, np.stack([d0, c1, c2]))
    np.testing.assert_allclose(res.draws[0], d0, atol=0)
    np.testing.assert_allclose(res.draws[1], d1, atol=1e-15)
    np.testing.assert_allclose(res.draws[2], d2, atol=1e-15)
    assert np.isinf(res.margins[0]) and (res.margins[1:] > 1.0).all()
    # the per-chain transform maps the chain's loadings onto the aligned ones, and lengthscales follow the order
    for c, raw in ((1, c1), (2, c2)):
        p = model.constrain(raw[0])
        q = model.constrain(res.draws[c][0])
        for key, W in p.loadings.items():
            np.testing.assert_allclose(W @ res.transforms[c], q.loadings[key], atol=1e-12)
        np.testing.assert_allclose(p.lengthscales[res.permutations[c]], q.lengthscales, rtol=1e-12)
        for key in p.intercepts:  # nothing else moves
            np.testing.assert_array_equal(p.intercepts[key], q.intercepts[key])
            np.testing.assert_array_equal(p.noise_sd[key], q.noise_sd[key])
        assert p.response == q.response


def test_ambiguous_match_is_refused(model_and_truth):
    model, truth = model_and_truth
    d0, d1 = _chain(model, truth, 0), _chain(model, truth, 1)
    # chain 1: factors 0 and 1 carry the same loadings, so which one is the reference's factor 0 is undecidable
    for b in model.blocks:
        if b.field == "loadings":
            W = d1[:, b.start: b.start + b.size].reshape((-1,) + b.shape)
            W[..., 1] = W[..., 0]
            d1[:, b.start: b.start + b.size] = W.reshape(d1.shape[0], -1)
    with pytest.raises(ValueError, match="chain 1: .* unambiguously: margin"):
        align_chain_draws(model, np.stack([d0, d1]))


def test_bad_input(model_and_truth):
    model, truth = model_and_truth
    d0 = _chain(model, truth, 0)
    with pytest.raises(ValueError, match="shape"):
        align_chain_draws(model, d0)
    with pytest.raises(ValueError, match="reference"):
        align_chain_draws(model, np.stack([d0, d0]), reference=2)
    bad = np.stack([d0, d0])
    bad[1, 3, 0] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        align_chain_draws(model, bad)
