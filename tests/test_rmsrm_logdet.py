"""The analytic log-determinant gradient of R-MSRM's marginal step (msrm.rmsrm.logdet) against slow references:
the selected inverse against a dense inverse, and the gradient against central differences of log det H computed
by SuperLU and by the banded solver, under shared and individual pooling, with missing values and the pad tie."""
from __future__ import annotations

import numpy as np
import pytest
import scipy.linalg as sla

import data_synth
from msrm.rmsrm.latent import blocks_to_lower_band, latent_blocks, latent_sparse_system, solve_latents_logdet
from msrm.rmsrm.logdet import logdet_gradient, run_selected_inverse, selected_inverse_banded
from msrm.rmsrm.objective import RState, compute_stats
from msrm.rmsrm.prepare import prepare_rmsrm
from msrm.rmsrm.response import _theta_layout, _unpack


def _case(seed=0, missing=0.0, pooling="shared"):
    data, truth = data_synth.synthetic_dataset("tiny", n_features=5, seed=seed, missing_fraction=missing,
                                               pooling=pooling)
    prep = prepare_rmsrm(data, truth.spec, roughness=2.0)
    tp = truth.params
    st = RState(Z=tuple(truth.latents), W=dict(tp.loadings), b=dict(tp.intercepts),
                var={k: v ** 2 for k, v in tp.noise_sd.items()}, theta={k: dict(v) for k, v in tp.response.items()})
    return prep, st, compute_stats(prep, st)


@pytest.mark.parametrize("n,b", [(1, 0), (7, 0), (9, 2), (40, 5), (41, 7), (23, 22), (30, 12)])
def test_selected_inverse_equals_the_dense_inverse_in_the_band(n, b):
    rng = np.random.default_rng(n + b)
    A = np.zeros((n, n))
    for u in range(b + 1):
        v = rng.standard_normal(n - u)
        A += np.diag(v, -u) + (np.diag(v, u) if u else 0)
    A = A @ A.T if b == 0 else A
    A = A + (np.abs(A).sum(axis=1).max() + 1.0) * np.eye(n)  # diagonally dominant: positive definite
    A[np.abs(np.subtract.outer(np.arange(n), np.arange(n))) > b] = 0.0
    ab = np.array([np.concatenate([np.diag(A, -u), np.zeros(u)]) for u in range(b + 1)])
    cb = sla.cholesky_banded(ab, lower=True)
    band = selected_inverse_banded(cb)
    inv = np.linalg.inv(A)
    for u in range(b + 1):
        np.testing.assert_allclose(band[u, : n - u], np.diag(inv, -u), rtol=1e-10, atol=1e-13)
        assert not band[u, n - u:].any()


@pytest.mark.parametrize("missing", [0.0, 0.15])
def test_run_selected_inverse_with_the_pad_tie_equals_the_dense_inverse(missing):
    prep, st, stats = _case(seed=1, missing=missing)
    assert prep.pad_tie > 0 and (~prep.runs[0].observed).any()
    H, _ = latent_sparse_system(prep, st, stats, 0)
    inv = np.linalg.inv(H.toarray())
    Sig, tie_trace = run_selected_inverse(prep, st, stats, 0)
    J, nb, K, _ = Sig.shape
    for j in range(J):
        for d in range(nb):
            if j + d >= J:
                assert not Sig[j, d].any()
                continue
            # Sig[j, d, k, l] = H^-1[(j + d) K + l, j K + k]
            dense = inv[(j + d) * K:(j + d + 1) * K, j * K:(j + 1) * K].T
            np.testing.assert_allclose(Sig[j, d], dense, rtol=1e-9, atol=1e-12 * np.abs(inv).max())
    # the tie's trace term against tr(H^-1 (H - B)) with B the band alone
    B, _ = latent_blocks(prep, st, stats, 0)
    ab = blocks_to_lower_band(B)
    Bd = np.zeros_like(inv)
    for u in range(ab.shape[0]):
        Bd += np.diag(ab[u, : Bd.shape[0] - u], -u) + (np.diag(ab[u, : Bd.shape[0] - u], u) if u else 0)
    assert tie_trace == pytest.approx(float(np.trace(inv @ (H.toarray() - Bd))), rel=1e-9)


def _fd_logdet_grad(prep, st, stats, layout, solver, step=1e-5):
    x = np.array([st.theta[pk][name] for _, pk, name, _ in layout] + [np.log(prep.roughness)])
    out = np.zeros(x.size)
    for i in range(x.size):
        lds = []
        for v in (x[i] + step, x[i] - step):
            xv = x.copy()
            xv[i] = v
            theta = _unpack(layout, st.theta, xv[:-1])
            p = prep._replace(roughness=float(np.exp(xv[-1])))
            lds.append(solve_latents_logdet(p, st._replace(theta=theta), stats, solver)[1])
        out[i] = 0.5 * (lds[0] - lds[1]) / (2 * step)
    return out


@pytest.mark.parametrize("pooling,missing", [("shared", 0.0), ("shared", 0.2), ("individual", 0.1)])
def test_logdet_gradient_equals_central_differences(pooling, missing):
    prep, st, stats = _case(seed=2, missing=missing, pooling=pooling)
    layout = _theta_layout(prep)
    assert len(layout) >= 2
    g = logdet_gradient(prep, st, stats, layout, roughness=True)
    ref = _fd_logdet_grad(prep, st, stats, layout, "superlu")
    np.testing.assert_allclose(g, ref, rtol=2e-5, atol=2e-6 * np.abs(ref).max())
    np.testing.assert_allclose(g[:-1], logdet_gradient(prep, st, stats, layout, roughness=False), rtol=0, atol=0)
    np.testing.assert_allclose(g, _fd_logdet_grad(prep, st, stats, layout, "banded"), rtol=2e-5,
                               atol=2e-6 * np.abs(ref).max())
