"""PSIS-LOO (arviz.loo) on the pointwise log likelihood that ``sample(..., pointwise_loglik=True)`` stores in the
InferenceData's log_likelihood group: against the exact leave-one-out density of a conjugate Gaussian model, and
on a GP-MSRM posterior, with brute-force checks of ArviZ's lppd and of plain importance-sampling LOO."""
from __future__ import annotations

import numpy as np
import pytest
from scipy.special import logsumexp
from scipy.stats import norm

import msrm
from msrm.gp.posterior import sample

from toy_model import ToyModel

az = pytest.importorskip("arviz")
pytest.importorskip("numpyro")


def _log_mean_exp(ll: np.ndarray) -> np.ndarray:
    """(chains, draws, n) -> (n,): log of the mean over draws of exp(ll)."""
    flat = ll.reshape(-1, ll.shape[-1])
    return logsumexp(flat, axis=0) - np.log(flat.shape[0])


def _is_loo(ll: np.ndarray) -> np.ndarray:
    """Plain importance-sampling LOO per point: log 1 / mean_s exp(-ll_s) (weights 1/p(y_i | theta_s))."""
    flat = ll.reshape(-1, ll.shape[-1])
    return -(logsumexp(-flat, axis=0) - np.log(flat.shape[0]))


def _exact_loo(model: ToyModel) -> np.ndarray:
    """log p(y_i | y_-i) of the conjugate model: the posterior without point i, pushed through row a_i."""
    A, y, s2, tau2 = model.A, model.y, model.noise**2, model.tau**2
    out = np.empty(y.size)
    for i in range(y.size):
        keep = np.arange(y.size) != i
        prec = A[keep].T @ A[keep] / s2 + np.eye(A.shape[1]) / tau2
        cov = np.linalg.inv(prec)
        mu = cov @ A[keep].T @ y[keep] / s2
        out[i] = norm.logpdf(y[i], A[i] @ mu, np.sqrt(A[i] @ cov @ A[i] + s2))
    return out


def _loo(idata, name):
    """``(elpd, p_loo, pointwise elpd, pareto k)`` of ``arviz.loo`` under ArviZ 0.23 (``elpd_loo``, ``p_loo``,
    ``loo_i``) and 1.x (``elpd``, ``p``, ``elpd_i``)."""
    res = az.loo(idata, var_name=name, pointwise=True)
    if hasattr(res, "elpd_loo"):
        return float(res.elpd_loo), float(res.p_loo), res.loo_i.values, res.pareto_k.values
    return float(res.elpd), float(res.p), res.elpd_i.values, res.pareto_k.values


def test_psis_loo_matches_the_exact_leave_one_out_density():
    msrm.runtime.enable_x64()
    model = ToyModel(seed=3)
    post = sample(model, num_warmup=300, num_samples=1000, num_chains=2, seed=2, max_tree_depth=6, init="prior",
                  pointwise_loglik=True, progress=False, diagnostics=False)
    idata = post.inference_data
    ll = idata.log_likelihood["y"].values  # (chains, draws, n)
    elpd, p_loo, loo_i, pareto_k = _loo(idata, "y")
    assert np.isfinite(elpd) and (pareto_k < 0.7).all()
    exact = _exact_loo(model)
    np.testing.assert_allclose(loo_i, exact, atol=0.15)  # Monte Carlo error of 2000 draws
    assert abs(elpd - exact.sum()) < 0.4  # lppd (no leaving out) is p_loo ~ 5 away
    # ArviZ's effective number of parameters is lppd - elpd_loo with lppd the sum of log mean exp
    lppd = _log_mean_exp(ll).sum()
    np.testing.assert_allclose(p_loo, lppd - elpd, rtol=1e-10)
    assert 0 < p_loo < 2 * model.num_params


@pytest.mark.slow
def test_psis_loo_of_a_gp_msrm_posterior_is_finite_and_near_brute_force():
    import data_synth

    msrm.runtime.enable_x64()
    data, truth = data_synth.synthetic_dataset("tiny", n_features=3, seed=0, n_runs=1, n_factors=1)
    model = msrm.GPMSRM(data, truth.spec, method="native")
    post = model.sample(num_warmup=60, num_samples=80, num_chains=1, seed=1, max_tree_depth=4, init=truth.params,
                        progress=False, pointwise_loglik=True, diagnostics=False)
    idata = post.inference_data
    names = list(idata.log_likelihood.data_vars)  # a Dataset (0.23) or DataTree node (1.x): both list them
    assert sorted(n.replace("|", "/") for n in names) == sorted(data.stream_keys)
    elpd, lppd, is_loo = 0.0, 0.0, 0.0
    for name in names:
        e, p_loo, loo_i, _ = _loo(idata, name)
        assert np.isfinite(e) and np.isfinite(loo_i).all()
        ll = idata.log_likelihood[name].values
        np.testing.assert_allclose(p_loo, _log_mean_exp(ll).sum() - e, rtol=1e-10)
        elpd += e
        lppd += _log_mean_exp(ll).sum()
        is_loo += _is_loo(ll).sum()
    n_points = sum(idata.log_likelihood[n].shape[-1] for n in names)
    assert elpd <= lppd
    # PSIS smooths the largest importance weights; with few draws it stays near plain importance sampling
    assert abs(elpd - is_loo) < 0.1 * n_points
    assert lppd - elpd < 0.5 * n_points
