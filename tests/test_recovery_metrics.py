"""Recovery metrics (msrm_lab.recovery.metrics) on cases whose answer is known by hand."""
from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import ortho_group

from msrm_lab.recovery import metrics as rm


def _sin_cos(n=40):
    """sin and cos over one full period on n equally spaced points: both sum to 0 and are orthogonal."""
    t = 2 * np.pi * np.arange(n) / n
    return np.sin(t), np.cos(t)


def test_subspace_error_rotation_scaling_and_shift_give_zero():
    rng = np.random.default_rng(0)
    Z = rng.normal(size=(200, 3))
    A = rng.normal(size=(3, 3)) + 3 * np.eye(3)  # invertible mixing
    assert rm.subspace_error(Z, Z @ ortho_group.rvs(3, random_state=1) + 5.0) < 1e-12
    assert rm.subspace_error(Z, Z @ A - 2.0) < 1e-12
    # two runs share one map
    assert rm.subspace_error([Z[:120], Z[120:]], [Z[:120] @ A, Z[120:] @ A]) < 1e-12


def test_subspace_error_hand_cases():
    s, c = _sin_cos()
    assert rm.subspace_error(s, c) == pytest.approx(1.0, abs=1e-12)  # orthogonal latent
    # truth (s, c), estimate s only: the c half of ||Z||^2 is missed -> sqrt(1/2)
    assert rm.subspace_error(np.column_stack([s, c]), s) == pytest.approx(math.sqrt(0.5), abs=1e-12)
    # truth s, estimate (s + c)/sqrt(2): Q Q^T s = s/2 + c/2 (in units of the orthonormal s, c) -> residual
    # s/2 - c/2, relative norm sqrt(1/4 + 1/4) / 1 = sqrt(1/2)
    assert rm.subspace_error(s, s + c) == pytest.approx(math.sqrt(0.5), abs=1e-12)
    # a constant estimate spans nothing after centring
    assert rm.subspace_error(s, np.ones_like(s)) == pytest.approx(1.0)


def test_subspace_error_mask_ignores_points_outside():
    s, c = _sin_cos()
    z = np.concatenate([s, np.zeros(10)])
    e = np.concatenate([3 * s, np.random.default_rng(0).normal(size=10)])
    mask = np.arange(50) < 40
    assert rm.subspace_error(z, e, mask) < 1e-12
    assert rm.subspace_error(z, e) > 0.01
    with pytest.raises(ValueError, match="mask"):
        rm.subspace_error(z, e, np.zeros(50, dtype=bool))
    with pytest.raises(ValueError, match=r"mask\[0\]"):
        rm.subspace_error(z, e, np.ones(49, dtype=bool))
    with pytest.raises(ValueError, match="grid points"):
        rm.subspace_error(z, e[:-1])
    with pytest.raises(ValueError, match="non-finite"):
        rm.subspace_error(z, np.full(50, np.nan))
    # NaN outside the mask (a peer's undefined edge) is ignored
    e_nan = e.copy()
    e_nan[~mask] = np.nan
    assert rm.subspace_error(z, e_nan, mask) < 1e-12


def test_edge_mask():
    grid = np.arange(-4.0, 11.0)  # -4 .. 10
    m = rm.edge_mask(grid, (0.0, 10.0), drop=2.0)
    np.testing.assert_array_equal(grid[m], [2, 3, 4, 5, 6, 7, 8])
    np.testing.assert_array_equal(grid[rm.edge_mask(grid, (0.0, 10.0), drop=0.0)], np.arange(0.0, 11.0))
    with pytest.raises(ValueError, match="drop"):
        rm.edge_mask(grid, (0.0, 10.0), drop=6.0)
    with pytest.raises(ValueError, match="span"):
        rm.edge_mask(grid, (10.0, 0.0))
    with pytest.raises(ValueError, match="drop"):
        rm.edge_mask(grid, (0.0, 10.0), drop=-1.0)


def test_aligned_r2_scaled_copy_and_orthogonal_factor():
    s, c = _sin_cos()
    np.testing.assert_allclose(rm.aligned_r2(s, 3.0 * s + 1.0), [1.0], atol=1e-12)
    # truth (s, c), estimate s: s is explained exactly, c (orthogonal to s and to the intercept) not at all
    np.testing.assert_allclose(rm.aligned_r2(np.column_stack([s, c]), s), [1.0, 0.0], atol=1e-12)
    # truth s, estimate s + c: the least-squares map is 1/2 (s + c) -> residual (s - c)/2, R^2 = 1 - 1/2
    np.testing.assert_allclose(rm.aligned_r2(s, s + c), [0.5], atol=1e-12)
    with pytest.raises(ValueError, match="constant"):
        rm.aligned_r2(np.ones(10), np.arange(10.0))
    # the affine map itself: 3 s + 1 maps back onto s exactly, NaN outside the mask stays NaN
    est = np.concatenate([3.0 * s + 1.0, [np.nan]])
    mask = np.arange(est.size) < s.size
    fit = rm.align_to_truth(np.concatenate([s, [0.0]]), est, mask)
    np.testing.assert_allclose(fit["latents"][0][:-1, 0], s, atol=1e-12)
    assert np.isnan(fit["latents"][0][-1, 0]) and fit["transform"][0, 0] == pytest.approx(1 / 3)


def test_best_shift_of_a_sinusoid_gives_the_known_lag():
    grid = np.arange(-10.0, 110.0, 0.5)
    true = np.sin(2 * np.pi * grid / 20.0)
    late = np.sin(2 * np.pi * (grid - 2.5) / 20.0)  # the estimate runs 2.5 s late
    mask = rm.edge_mask(grid, (0.0, 100.0), drop=12.0)
    shift, err = rm.best_shift(true, late, grid, mask, max_shift=6.0)
    assert shift == pytest.approx(2.5, abs=1e-9) and err < 1e-3
    early, _ = rm.best_shift(true, np.sin(2 * np.pi * (grid + 1.5) / 20.0), grid, mask, max_shift=6.0)
    assert early == pytest.approx(-1.5, abs=1e-9)
    # a model whose lag is too short by the shift sees its latent that much late: the lag error is the shift
    errs = rm.response_errors({"rating": {"lag": 3.0 - shift}}, {"rating": {"lag": 3.0}})
    assert errs["rating"]["lag"] == pytest.approx(2.5, abs=1e-9)


def test_response_errors_per_modality_and_parameter():
    truth = {"rating": {"lag": 3.0, "width": 1.5}, "physio": {"lag": 2.0, "width": 1.5}}
    fitted = {"rating": {"lag": 3.5}, "physio": {"lag": 1.0, "width": 2.25}, "brain": {}}
    errs = rm.response_errors(fitted, truth)
    assert errs == {"rating": {"lag": 0.5}, "physio": {"lag": 1.0, "width": 0.75}}
    assert rm.flat_response_errors(errs) == {"rating/lag": 0.5, "physio/lag": 1.0, "physio/width": 0.75}
    # individual pooling: keys participant/modality, truth per modality
    ind = rm.response_errors({"p0/rating": {"lag": 2.0}, "p1/rating": {"lag": 4.5}}, truth)
    assert ind == {"p0/rating": {"lag": 1.0}, "p1/rating": {"lag": 1.5}}
    # a true response of another form (no common parameter) is not scored
    assert rm.response_errors({"rating": {"delay": 1.0}}, truth) == {}
    with pytest.raises(ValueError, match="non-finite"):
        rm.response_errors({"rating": {"lag": float("nan")}}, truth)


def test_band_coverage_of_a_90_percent_band_is_about_90_percent():
    rng = np.random.default_rng(7)
    n, K, sd = 3000, 2, 0.4
    truth = rng.normal(size=(n, K))
    mean = truth + rng.normal(scale=sd, size=(n, K))
    cov = rm.band_coverage(truth, mean - rm.Z90 * sd, mean + rm.Z90 * sd)
    assert abs(cov - 0.9) < 4 * rm.binomial_sd(0.9, n * K)
    # a band half as wide covers about 2 Phi(0.8225) - 1 = 0.589
    cov_half = rm.band_coverage(truth, mean - rm.Z90 * sd / 2, mean + rm.Z90 * sd / 2)
    assert abs(cov_half - 0.5889) < 4 * rm.binomial_sd(0.589, n * K)
    m = np.zeros(n, dtype=bool)
    m[:10] = True
    exact = np.mean((truth[:10] >= mean[:10] - 0.1) & (truth[:10] <= mean[:10] + 0.1))
    assert rm.band_coverage(truth, mean - 0.1, mean + 0.1, m) == pytest.approx(exact)
    with pytest.raises(ValueError, match="lower"):
        rm.band_coverage(truth, mean + 1, mean - 1)


def test_aligned_band_moves_a_rotated_posterior_exactly():
    rng = np.random.default_rng(3)
    J, K = 80, 3
    Z = rng.normal(size=(J, K))
    Q = ortho_group.rvs(K, random_state=4)
    D = np.diag([0.1, 0.2, 0.3]) ** 2
    mean = (Z - 1.0) @ Q.T  # the estimate is the truth rotated by Q^T and shifted
    C = np.broadcast_to(Q @ D @ Q.T, (J, K, K))  # its covariance, so that rotating back gives diagonal D
    band = rm.aligned_band(Z, mean, cov=C)
    np.testing.assert_allclose(band["mean"][0], Z, atol=1e-10)
    np.testing.assert_allclose(band["sd"][0], np.broadcast_to([0.1, 0.2, 0.3], (J, K)), atol=1e-10)
    np.testing.assert_allclose(band["transform"], Q, atol=1e-10)
    assert band["exact_sd"]
    np.testing.assert_allclose(band["upper"][0] - band["lower"][0], 2 * rm.Z90 * band["sd"][0])
    # marginal sds only: exact under a signed permutation
    P = np.array([[0.0, -1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    sd = np.broadcast_to([0.1, 0.2, 0.3], (J, K)) @ np.abs(P).T
    approx = rm.aligned_band(Z, Z @ P.T, sd=sd)
    np.testing.assert_allclose(approx["sd"][0], np.broadcast_to([0.1, 0.2, 0.3], (J, K)), atol=1e-10)
    assert not approx["exact_sd"]
    # an estimate at twice the scale: Procrustes keeps the doubled band, the affine map undoes the scale exactly
    big = rm.aligned_band(Z, 2 * mean, cov=4 * C)
    np.testing.assert_allclose(big["sd"][0], 2 * band["sd"][0], atol=1e-10)
    aff = rm.aligned_band(Z, 2 * mean, cov=4 * C, map="affine")
    np.testing.assert_allclose(aff["mean"][0], Z, atol=1e-10)
    np.testing.assert_allclose(aff["sd"][0], band["sd"][0], atol=1e-10)
    np.testing.assert_allclose(aff["transform"], Q / 2, atol=1e-10)
    with pytest.raises(ValueError, match="map"):
        rm.aligned_band(Z, mean, cov=C, map="oblique")
    with pytest.raises(ValueError, match="exactly one"):
        rm.aligned_band(Z, mean)
    with pytest.raises(ValueError, match="same K"):
        rm.aligned_band(Z, mean[:, :2], sd=sd[:, :2])


def test_interval_coverage_and_central_interval():
    assert rm.interval_coverage(3.0, [2.0, 3.5, 2.9], [4.0, 5.0, 3.0]) == pytest.approx(2 / 3)
    assert rm.interval_coverage([1.0, 2.0], [0.0, 2.5], [1.0, 3.0]) == pytest.approx(0.5)
    draws = np.arange(1001.0)  # quantiles 0.05, 0.95 of 0..1000 are 50 and 950
    lo, hi = rm.central_interval(draws, 0.9)
    assert (lo, hi) == (pytest.approx(50.0), pytest.approx(950.0))
    with pytest.raises(ValueError, match="level"):
        rm.central_interval(draws, 1.5)
    with pytest.raises(ValueError, match="lower"):
        rm.interval_coverage(1.0, [2.0], [1.0])
    assert rm.binomial_sd(0.9, 100) == pytest.approx(0.03)


# ------------------------------------------------------------------------- the truth in the fitted frame
class _P:
    """The three parameter mappings truth_in_fitted_frame reads."""

    def __init__(self, loadings, intercepts, noise_sd=None):
        self.loadings, self.intercepts = loadings, intercepts
        self.noise_sd = noise_sd or {k: np.ones(len(v)) for k, v in intercepts.items()}


def test_truth_in_fitted_frame_by_hand():
    # one stream, one feature: W = 2, W_hat = 4, b = 1, b_hat = 3, sd 1 -> A = 8 / 16, a = 4 (1 - 3) / 16
    z = np.array([[0.0], [1.0], [-2.0]])
    out = rm.truth_in_fitted_frame(z, _P({"a/x": np.array([[2.0]])}, {"a/x": np.array([1.0])}),
                                   _P({"a/x": np.array([[4.0]])}, {"a/x": np.array([3.0])}))
    np.testing.assert_allclose(out["transform"], [[0.5]])
    np.testing.assert_allclose(out["offset"], [-0.5])
    np.testing.assert_allclose(out["latents"][0], 0.5 * z - 0.5)


def test_truth_in_fitted_frame_recovers_a_reparametrised_fit_exactly():
    # a fit that is the truth in another frame x = R z + c0 (W_hat = W R^-1, b_hat = b - W_hat c0) reproduces
    # every stream's signal exactly, so the map is R, c0 whatever the noise weights
    rng = np.random.default_rng(3)
    z = [rng.normal(size=(40, 2)), rng.normal(size=(25, 2))]
    R = np.array([[2.0, 0.5], [-1.0, 0.7]])
    c0 = np.array([0.3, -1.2])
    W = {"a/brain": rng.normal(size=(6, 2)), "a/rating": rng.normal(size=(1, 2)), "b/brain": rng.normal(size=(6, 2))}
    b = {k: rng.normal(size=len(v)) for k, v in W.items()}
    Wh = {k: v @ np.linalg.inv(R) for k, v in W.items()}
    bh = {k: b[k] - Wh[k] @ c0 for k in W}
    sd = {k: rng.uniform(0.2, 3.0, size=len(v)) for k, v in W.items()}
    out = rm.truth_in_fitted_frame(z, _P(W, b), _P(Wh, bh, sd))
    np.testing.assert_allclose(out["transform"], R, atol=1e-12)
    np.testing.assert_allclose(out["offset"], c0, atol=1e-12)
    for zr, xr in zip(z, out["latents"]):
        np.testing.assert_allclose(xr, zr @ R.T + c0, atol=1e-12)


def test_truth_in_fitted_frame_names_the_bad_stream():
    z = np.zeros((3, 1))
    with pytest.raises(ValueError, match="'a/x'"):
        rm.truth_in_fitted_frame(z, _P({"a/x": np.ones((2, 1))}, {"a/x": np.ones(2)}),
                                 _P({"a/x": np.ones((3, 1))}, {"a/x": np.ones(3)}))
    with pytest.raises(ValueError, match="no stream"):
        rm.truth_in_fitted_frame(z, _P({"a/x": np.ones((2, 1))}, {"a/x": np.ones(2)}),
                                 _P({"b/x": np.ones((2, 1))}, {"b/x": np.ones(2)}))
