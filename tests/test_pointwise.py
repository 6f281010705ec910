"""Pointwise log likelihood by (stream, node) against the brute-force conditional densities.

For each run the full observation covariance (msrm.gp.reference) gives the precision P; the conditional density of
the block B of one stream sample given every other observed value is ``-1/2 [F log 2 pi - log|P_BB| + g_B^T
P_BB^-1 g_B]`` with ``g = P (y - mu)``. The node-space formulas must reproduce it for grouped and dense layouts,
all kernels, both poolings, missing values and two runs.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

import msrm
import data_synth

msrm.runtime.enable_x64()

from msrm.gp.model import GPMSRM  # noqa: E402
from msrm.gp.reference import run_covariance  # noqa: E402
from msrm.nodes import response_groups  # noqa: E402


def brute_force_pointwise(data, spec, params) -> dict[str, np.ndarray]:
    groups = response_groups(data, spec)
    out: dict[str, list] = {}
    for run in data.runs:
        y, mean, cov = run_covariance(run, spec, params, groups)
        P = np.linalg.inv(cov)
        g = P @ (y - mean)
        start = 0
        for s in run.streams:
            i_idx, _ = np.nonzero(s.mask)
            vals = np.zeros(s.values.shape[0])
            for i in range(s.values.shape[0]):
                B = start + np.flatnonzero(i_idx == i)
                if B.size:
                    PBB = P[np.ix_(B, B)]
                    _, logdet = np.linalg.slogdet(PBB)
                    vals[i] = -0.5 * (B.size * math.log(2 * math.pi) - logdet + g[B] @ np.linalg.solve(PBB, g[B]))
            start += i_idx.size
            out.setdefault(s.key, []).append(vals)
    return {k: np.concatenate(v) for k, v in out.items()}


CASES = [("matern32", "shared", 0.0, 1), ("matern12", "individual", 0.2, 2), ("matern52", "shared", 0.3, 2),
         ("matern52", "individual", 0.0, 1)]


@pytest.mark.parametrize("kernel,pooling,missing,runs", CASES)
def test_pointwise_equals_brute_force_conditionals(kernel, pooling, missing, runs):
    data, truth = data_synth.synthetic_dataset("tiny", n_features=4, n_runs=runs, seed=5, kernel=kernel,
                                               pooling=pooling, missing_fraction=missing)
    ref = brute_force_pointwise(data, truth.spec, truth.params)
    for la in ("grouped", "dense"):
        model = GPMSRM(data, truth.spec, la)
        got = model.pointwise_log_likelihood(model.unconstrain(truth.params))
        assert sorted(got) == sorted(ref)
        for key in ref:
            assert got[key].shape == ref[key].shape
            np.testing.assert_allclose(got[key], ref[key], rtol=1e-9, atol=1e-9, err_msg=f"{la} {key}")


def test_pointwise_by_run_and_bad_option():
    data, truth = data_synth.synthetic_dataset("tiny", n_features=3, n_runs=2, seed=1)
    model = GPMSRM(data, truth.spec, "grouped")
    u = model.unconstrain(truth.params)
    runs = model.pointwise_log_likelihood(u, by="run")["run"]
    assert runs.shape == (2,)
    assert math.isclose(float(runs.sum()), model.log_likelihood(truth.params), rel_tol=1e-12)
    with pytest.raises(ValueError, match="by must be 'node' or 'run'"):
        model.pointwise_log_likelihood(u, by="feature")


def test_state_space_model_gives_the_same_pointwise_terms():
    data, truth = data_synth.synthetic_dataset("tiny", n_features=3, n_runs=1, seed=2)
    u = GPMSRM(data, truth.spec, "grouped").unconstrain(truth.params)
    a = GPMSRM(data, truth.spec, "grouped").pointwise_log_likelihood(u)
    b = GPMSRM(data, truth.spec, "state_space").pointwise_log_likelihood(u)
    for key in a:
        np.testing.assert_allclose(b[key], a[key], rtol=1e-12)
