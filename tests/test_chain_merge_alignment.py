"""Merged chains are aligned (factor sign and order) before they are pooled, and the transform is recorded."""
from __future__ import annotations

import json

import numpy as np
import pytest

import data_synth
import msrm
from msrm.gp.align_chains import apply_signed_permutation
from msrm.gp.chains import align_merged, merge_chains
from msrm.gp.idata import build_inference_data, group_dataset


@pytest.fixture(scope="module")
def model_and_truth():
    msrm.runtime.enable_x64()
    data, truth = data_synth.synthetic_dataset("tiny", n_features=6, seed=2, n_factors=3)
    return msrm.GPMSRM(data, truth.spec, method="native"), truth


def _chain_idata(model, draws, seed):
    stats = {"diverging": np.zeros(draws.shape[:2], dtype=bool)}
    return build_inference_data(model, draws, stats, attrs={"sampler": {"seed": seed}})


def test_a_flipped_and_permuted_chain_is_aligned_before_pooling(model_and_truth):
    model, truth = model_and_truth
    rng = np.random.default_rng(0)
    u0 = model.unconstrain(truth.params)
    d0 = u0 + 0.05 * rng.standard_normal((1, 20, u0.size))
    d1 = u0 + 0.05 * rng.standard_normal((1, 20, u0.size))
    perm, signs = np.array([2, 0, 1]), np.array([-1.0, 1.0, -1.0])
    flipped = apply_signed_permutation(d1, model.blocks, perm, signs)
    merged = merge_chains([_chain_idata(model, d0, 0), _chain_idata(model, flipped, 1)])
    # unaligned, the pooled loadings of a flipped factor shrink toward zero
    key = next(iter(truth.params.loadings))
    name = next(v for v in group_dataset(merged, "posterior").data_vars
                if group_dataset(merged, "posterior")[v].attrs.get("msrm_name") == f"loadings/{key}")
    raw_mean = group_dataset(merged, "posterior")[name].values.mean(axis=(0, 1))
    aligned = align_merged(model, merged)
    post = group_dataset(aligned, "posterior")
    np.testing.assert_allclose(group_dataset(aligned, "unconstrained_posterior")["u"].values[1], d1[0], atol=1e-15)
    # the posterior group is recomputed from the aligned draws: chain 1 now equals the unflipped draws
    expect = np.stack([model.constrain(u).loadings[key] for u in d1[0]])
    np.testing.assert_allclose(post[name].values[1], expect, atol=1e-12)
    W = truth.params.loadings[key]
    pooled = post[name].values.mean(axis=(0, 1))
    assert np.abs(pooled - W).max() < 0.1 < np.abs(raw_mean - W).max()
    record = json.loads(post.attrs["factor_alignment"])
    assert record["reference"] == 0
    assert record["permutations"][0] == [0, 1, 2]
    # chain 1 was made by factor l <- signs[l] * factor perm[l]; its alignment undoes that
    inv = np.argsort(perm)
    assert record["permutations"][1] == inv.tolist()
    assert record["signs"][1] == signs[inv].astype(int).tolist()
    assert group_dataset(aligned, "sample_stats").attrs["factor_alignment"] == post.attrs["factor_alignment"]


def test_chains_whose_factors_cannot_be_told_apart_are_refused(model_and_truth):
    model, truth = model_and_truth
    rng = np.random.default_rng(1)
    u0 = model.unconstrain(truth.params)
    d0 = u0 + 0.05 * rng.standard_normal((1, 10, u0.size))
    d1 = np.zeros_like(d0)
    d1[...] = u0
    # chain 1: every loading at zero mean, nothing to match on
    for b in model.blocks:
        if b.field == "loadings":
            d1[..., b.start:b.start + b.size] = 0.01 * rng.standard_normal(d1.shape[:2] + (b.size,))
    merged = merge_chains([_chain_idata(model, d0, 0), _chain_idata(model, d1, 1)])
    with pytest.raises(ValueError, match="cannot be matched"):
        align_merged(model, merged)
