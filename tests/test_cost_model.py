"""The cost model: the relative-error NNLS fit, leave-one-out errors, the configuration -> size mapping against
the package, and argument checks."""
import math

import numpy as np
import pytest

import data_synth
import msrm
from msrm.data import split_run
from msrm_lab import cost_model as cm


def _rows(key, backend, terms, coef, const=0.0):
    return [cm.CostRow(key, backend, tuple(t), float(np.dot(t, coef) + const), "synthetic", 3, 1.0) for t in terms]


def test_fit_recovers_known_grouped_coefficients():
    terms = [(1e9, 1e5), (8e9, 3e5), (2.7e10, 1e6), (6.4e10, 2e5), (1.25e11, 4e6)]
    a, b, c = 1.6e-11, 3e-8, 0.12
    rows = _rows("dev", "grouped", terms, (a, b), c)
    fit = cm.fit_backend(rows, "dev", "grouped", constant=True)
    np.testing.assert_allclose(fit.coef, (a, b, c), rtol=1e-8)
    np.testing.assert_allclose(fit.loo, 0.0, atol=1e-8)
    fit0 = cm.fit_backend(_rows("dev", "grouped", terms, (a, b)), "dev", "grouped")
    np.testing.assert_allclose(fit0.coef[:2], (a, b), rtol=1e-8)
    assert fit0.names[:2] == ("a", "b")


def test_fit_recovers_known_state_space_coefficient():
    rows = _rows("dev", "state_space", [(1e7,), (3e7,), (2e8,), (5e8,)], (3.7e-9,))
    fit = cm.fit_backend(rows, "dev", "state_space", constant=False)
    np.testing.assert_allclose(fit.coef, (3.7e-9,), rtol=1e-10)
    assert fit.predict_terms((1e9,)) == pytest.approx(3.7, rel=1e-10)
    assert cm.fit_backend(rows, "other", "state_space") is None  # no rows for that key


def test_leave_one_out_relative_error():
    # y = 2 x for the first two rows, the third measured at twice that: the fit without it predicts half
    X = np.array([[1.0], [2.0], [3.0]])
    y = np.array([2.0, 4.0, 12.0])
    err = cm.leave_one_out(X, y)
    assert err[2] == pytest.approx(-0.5, rel=1e-12)
    # held back row 0: fit to rows 1 and 2 by relative error, c minimises (2c/4 - 1)^2 + (3c/12 - 1)^2
    c = (0.5 + 0.25) / (0.5**2 + 0.25**2)
    assert err[0] == pytest.approx(c * 1.0 / 2.0 - 1.0, rel=1e-10)
    assert err[1] == pytest.approx(cm.fit_nnls(X[[0, 2]], y[[0, 2]])[0] * 2.0 / 4.0 - 1.0, rel=1e-12)


def test_fit_minimises_relative_error():
    X = np.array([[1.0], [10.0]])
    y = np.array([1.0, 20.0])
    # relative errors (c - 1) and (10 c / 20 - 1): the minimiser is c = (1 + 0.5) / (1 + 0.25)
    assert cm.fit_nnls(X, y)[0] == pytest.approx(1.5 / 1.25, rel=1e-12)


@pytest.mark.parametrize("split", [False, True])
def test_sizes_match_the_package_on_a_small_study(split):
    K, F, scale, n_runs = 2, 3, 0.25, 2
    data, truth = data_synth.synthetic_dataset("one-eighth", n_features=F, duration_scale=scale, n_factors=K,
                                               n_runs=1 if split else n_runs, seed=1)
    if split:
        data = msrm.Dataset(split_run(data.runs[0], n_runs))
    length = data_synth.PROFILES["one-eighth"].duration * scale
    sizes = cm.study_sizes(9, K, length / n_runs if split else length, n_runs, F, split=split)
    counts = msrm.count_nodes(data, truth.spec)
    assert sizes.node_counts == tuple(counts)
    assert sizes.nk_cubed == sum(float(n * K) ** 3 for n in counts)
    observed = sum(int(np.isfinite(s.values).sum()) for r in data.runs for s in r.streams)
    assert sizes.observations == observed
    from msrm.gp.state_space.prepare import prepare

    tables = [r.tables for r in prepare(data, truth.spec, method="callback").runs]
    assert sizes.grid_steps == tuple(t.n_steps for t in tables)
    assert sizes.state_dims == tuple(t.n_states for t in tables)
    assert sizes.ts2 == sum(t.n_steps * t.n_states**2 for t in tables)


def test_profile_participants_reproduce_the_profile():
    prof = data_synth.PROFILES["one-eighth"]
    who = cm._participants(9, prof)
    for m in prof.modalities:
        assert who[m.name] == m.participants
    assert len(cm._participants(1, prof)["brain"]) == 1


def test_grouped_memory_is_the_guards_prediction():
    fits = {"dev": {"grouped": cm.fit_backend(_rows("dev", "grouped", [(1e9, 1e5), (8e9, 3e5), (2e10, 1e6),
                                                                         (6e10, 2e5)], (1e-11, 1e-8)),
                                                  "dev", "grouped")}}
    out = cm.predict(3, 2, 60.0, 1, 4, fits=fits, limit_bytes=1)
    sizes = out.attrs["sizes"]
    expected, _ = msrm.gp.memory.likelihood_peak_bytes(list(sizes.node_counts), 2)
    g = out[out.backend == "grouped"].iloc[0]
    assert g.memory_bytes == expected and bool(g.refused)
    assert g.seconds == pytest.approx(1e-11 * sizes.nk_cubed + 1e-8 * sizes.observations, rel=1e-6)
    assert math.isnan(out[out.backend == "state_space"].iloc[0].seconds)  # no state-space fit for "dev"
    assert not cm.predict(3, 2, 60.0, 1, 4, fits=fits, limit_bytes=10**15).refused.iloc[0]


@pytest.mark.parametrize("kwargs, name", [
    (dict(K=-1), "K"), (dict(K=0), "K"), (dict(duration_s=0.0), "duration_s"),
    (dict(duration_s=float("nan")), "duration_s"), (dict(N_participants=0), "N_participants"),
    (dict(runs=1.5), "runs"), (dict(features=0), "features"), (dict(device="no-such-device"), "device"),
])
def test_bad_input_names_the_parameter(kwargs, name):
    args = dict(N_participants=9, K=3, duration_s=454.0, runs=1, features=36)
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        cm.predict(**args, fits={"dev": {}})


def test_bad_fit_input():
    with pytest.raises(ValueError, match="y"):
        cm.fit_nnls(np.ones((2, 1)), np.array([1.0, 0.0]))
