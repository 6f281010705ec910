"""The state-space block length: a deterministic rule of the run's sizes and the core count (no timing, no cache),
monotone where the cost model says it must be, overridden by ``block=``, and every choice gives the same density."""
from __future__ import annotations

import importlib
import math

import numpy as np
import pytest

import data_synth
from msrm.gp.model import params_to_theta
from msrm.gp.reference import brute_force_loglik
from msrm.gp.state_space import loglik, prepare, tuning

spp = importlib.import_module("msrm.gp.state_space.prepare")


def _coeffs(call_s, gemm_per_rank):
    return tuning.Coefficients(call_s=call_s, pass_s=1e-9, gemm_s=tuple(gemm_per_rank * r + 1e-9 for r in tuning.RANKS))


def _shape(J=20000, K=6, per_step=8, L=40, d=2):
    """A synthetic schedule: ``per_step`` nodes end at every grid step, blocks of C steps, a ring of
    C (ceil(L / C) + 1) slots; large enough that its products are threaded at long blocks."""

    def shape_of(C):
        n_sub = -(-J // C)
        S = K * (d + C * (-(-L // C) + 1))
        return n_sub, n_sub, S, J * per_step, False

    return shape_of, J, K


def test_the_rule_is_deterministic_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("MSRM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    data, truth = data_synth.synthetic_dataset("tiny", n_features=3, n_factors=3, duration_scale=4.0, seed=0)
    tables = [prepare(data, truth.spec).runs[0].tables for _ in range(2)]
    assert tables[0].block == tables[1].block and tables[0].block_predicted_s == tables[1].block_predicted_s
    assert tables[0].block_source == "default"
    assert not any(tmp_path.iterdir())
    shape_of, J, K = _shape()
    first = tuning.choose_block(shape_of, J, K, cores=4)
    assert tuning.choose_block(shape_of, J, K, cores=4) == first
    assert first.predicted_s == min(first.candidates.values())
    assert 1 <= first.block <= tuning.MAX_BLOCK
    # nothing of the measurement machinery is left: the coefficients are the fixed ones
    assert tuning.machine_coefficients() is tuning.COEFFICIENTS
    for gone in ("measure", "cache_dir", "cache_path", "machine_key", "set_coefficients"):
        assert not hasattr(tuning, gone)


def test_fixed_coefficients_are_the_documented_ones():
    c = tuning.COEFFICIENTS
    assert (c.call_s, c.pass_s) == (1.5e-6, 1.0e-9)
    for r in (4, 16, 128):
        assert c.gemm(r) == pytest.approx(2.0 * r / 10e9 + 2.0e-9, rel=1e-12)


def test_dear_fixed_costs_favour_long_blocks_and_dear_products_short_ones():
    """The argmin of ``t(C) = f(C) + o n_sub(C)`` with ``n_sub`` falling in C cannot fall as the fixed cost ``o``
    rises, nor rise as the products' cost does."""
    shape_of, J, K = _shape(J=3000, K=2, per_step=1, L=4)
    by_call = [tuning.choose_block(shape_of, J, K, _coeffs(o, 1e-10), cores=1).block
               for o in (1e-9, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3)]
    assert by_call == sorted(by_call) and by_call[0] < by_call[-1]
    by_gemm = [tuning.choose_block(shape_of, J, K, _coeffs(1e-6, g), cores=1).block
               for g in (1e-13, 1e-11, 1e-10, 1e-9, 1e-8)]
    assert by_gemm == sorted(by_gemm, reverse=True) and by_gemm[0] > by_gemm[-1]


def test_cores_divide_only_the_threaded_products():
    """With h cores the choice is the argmin of the model with the dense products of threaded block lengths
    divided by h; a state too small to be threaded gets the same block on any core count."""
    shape_of, J, K = _shape(J=20000, K=10, per_step=1, L=100)
    for h in (1, 2, 8):
        got = tuning.choose_block(shape_of, J, K, cores=h)
        one = tuning.choose_block(shape_of, J, K, cores=1)
        for C, t in got.candidates.items():
            n_sub, n_occ, S, n_nodes, rec = shape_of(C)
            rank = K * n_nodes / n_occ
            assert t == pytest.approx(tuning.predicted_seconds(n_sub, n_occ, S, rank, K, rec, cores=h), rel=1e-12)
            if tuning.product_threads(S, rank, h) == 1:
                assert t == one.candidates[C]
            else:
                assert t < one.candidates[C]
    assert len({tuning.choose_block(shape_of, J, K, cores=h).block for h in (1, 2, 8, 64)}) > 1
    small, J2, K2 = _shape(J=2000, K=1, per_step=1, L=1)
    assert len({tuning.choose_block(small, J2, K2, cores=h).block for h in (1, 2, 64)}) == 1
    with pytest.raises(ValueError, match="cores"):
        tuning.choose_block(small, J2, K2, cores=0)


def test_product_threads_follow_the_host_filters_threshold():
    from msrm import runtime

    S = 100
    R_at = runtime.DENSE_THREAD_MIN_FLOPS / (2.0 * S * S)
    assert tuning.product_threads(S, R_at * 0.99, 8) == 1
    assert tuning.product_threads(S, R_at, 8) == 8
    assert tuning.product_threads(S, R_at, 1) == 1


def test_the_rule_does_not_read_features_only_the_scan_sizes():
    """Features are reduced to node statistics before the scan: the same grid and nodes with 1 or 40 features
    per stream get the same block."""
    blocks = []
    for F in (1, 40):
        data, truth = data_synth.synthetic_dataset("tiny", n_features=F, n_factors=2, duration_scale=2.0, seed=4)
        blocks.append(prepare(data, truth.spec).runs[0].tables.block)
    assert blocks[0] == blocks[1]


def test_block_option_wins():
    data, truth = data_synth.synthetic_dataset("tiny", n_features=3, n_factors=2, seed=5)
    J = prepare(data, truth.spec).runs[0].tables.n_steps
    for b in (1, 5, 10 * J):
        t = prepare(data, truth.spec, block=b).runs[0].tables
        assert t.block == min(b, J) and t.block_source == "option" and t.block_predicted_s is None
    with pytest.raises(ValueError, match="block"):
        prepare(data, truth.spec, block=0)


def test_bad_coefficients_are_named():
    with pytest.raises(ValueError, match="call_s"):
        tuning.Coefficients(call_s=-1.0, pass_s=1e-9, gemm_s=(1e-9,), ranks=(4,))
    with pytest.raises(ValueError, match="gemm_s"):
        tuning.Coefficients(call_s=1e-6, pass_s=1e-9, gemm_s=(1e-9,), ranks=(4, 8))
    with pytest.raises(ValueError, match="pass_s"):
        tuning.Coefficients(call_s=1e-6, pass_s=math.inf, gemm_s=(1e-9,), ranks=(4,))


def test_schedule_shape_matches_the_built_tables():
    data, truth = data_synth.synthetic_dataset("tiny", n_features=3, n_factors=2, duration_scale=2.0, seed=1)
    for C in (1, 3, 8):
        t = prepare(data, truth.spec, block=C, checkpoint_every=0).runs[0].tables
        lay = prepare(data, truth.spec, block=C).runs[0].gp.layout
        n_sub, n_occ, S, n_nodes, recompute = spp.schedule_shape(lay, spp._window_ends(lay), C, 0, t.L,
                                                                 spp.StateSpaceOptions(checkpoint_every=0))
        occupied = np.concatenate([g.slot_local != g.n_g for g in t.groups], axis=1).any(axis=1)
        assert (n_sub, S, n_nodes, recompute) == (t.block_index.size, t.n_states, lay.n_nodes, False)
        assert n_occ == int(occupied.sum())


def test_auto_block_reads_the_schedule():
    data, truth = data_synth.synthetic_dataset("tiny", n_features=3, n_factors=3, duration_scale=4.0, seed=0)
    p = prepare(data, truth.spec, block=1)
    lay, t = p.runs[0].gp.layout, p.runs[0].tables
    ends = spp._window_ends(lay)
    opts = spp.StateSpaceOptions()
    overhead = spp.auto_block(lay, ends, 0, t.L, opts, _coeffs(1e-3, 1e-12), cores=1)
    flops = spp.auto_block(lay, ends, 0, t.L, opts, _coeffs(1e-9, 1e-8), cores=1)
    assert overhead.block > flops.block
    chosen = prepare(data, truth.spec).runs[0].tables
    rule = spp.auto_block(lay, ends, 0, t.L, opts)
    assert (chosen.block, chosen.block_predicted_s) == (rule.block, rule.predicted_s)


@pytest.mark.parametrize("seed", [2, 6])
def test_the_chosen_block_keeps_the_density(seed):
    data, truth = data_synth.synthetic_dataset("tiny", n_features=3, seed=seed)
    theta = params_to_theta(truth.params)
    p = prepare(data, truth.spec, method="native")
    assert p.runs[0].tables.block_source == "default"
    ref = brute_force_loglik(data, truth.spec, truth.params)
    got = float(loglik(theta, p)[0])
    assert abs(got - ref) <= 1e-8 * abs(ref)


def test_pipeline_follows_the_cost_model(monkeypatch):
    from msrm.gp.state_space import host

    monkeypatch.setattr(host, "PIPELINE_MIN_WORK", None)
    dear_calls, dear_products = _coeffs(1e-3, 1e-12), _coeffs(1e-9, 1e-8)
    assert not host.pipeline_pays(335, 46.0, 5, dear_calls)
    assert host.pipeline_pays(335, 46.0, 5, dear_products)
    assert not host.pipeline_pays(335, 0.0, 5, dear_products)
    # without coefficients the fixed ones are read: the same answer on every machine
    assert host.pipeline_pays(335, 46.0, 5) == host.pipeline_pays(335, 46.0, 5, tuning.COEFFICIENTS)
    monkeypatch.setattr(host, "PIPELINE_MIN_WORK", 0.0)  # a fixed threshold overrides the model
    assert host.pipeline_pays(335, 46.0, 5, dear_calls)
