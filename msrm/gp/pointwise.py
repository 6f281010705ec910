r"""Pointwise log likelihood by (stream, node): each stream sample given every other observed value.

The GP-MSRM does not factorise over observations given the parameters (the latent factors are integrated
out), so the per-sample terms that leave-one-out tools (e.g. PSIS-LOO in ArviZ) need are the *conditional*
predictive densities of one block ``B`` (the observed features of one stream at one sample, i.e. one stream at
one node) given all other observed values of the run, ``log p(y_B | y_{-B}, theta)``. For a Gaussian these come
from the precision ``P = Sigma^{-1}`` of the run's observations: ``y_B | y_{-B} ~ N(y_B - P_BB^{-1} g_B,
P_BB^{-1})`` with ``g = P (y - mu)``.

Node space gives ``P_BB`` and ``g_B`` without the observation covariance. With ``Q = (C^{-1} + Lambda)^{-1} =
C - C R^T M^{-1} R C`` (the posterior covariance of the node values, never inverting ``C``) and ``m = Q eta``
(their posterior mean), for stream ``s`` at sample ``i`` on node ``u`` with loadings ``W``, noise ``D``
(observed features only), residual at the posterior mean ``e = y - b - W m_u``, ``Lambda_si = W^T D^-1 W``
and ``t = W^T D^-1 e``:

.. math::

    \log p(y_B \mid y_{-B}) = -\tfrac12\Big[F_B \log 2\pi + \log|D| - \log|I - Q_{uu}\Lambda_{si}|
      + e^\top D^{-1} e + t^\top (I - Q_{uu}\Lambda_{si})^{-1} Q_{uu}\, t\Big],

from ``P_BB = D^{-1}(D - W Q_uu W^T) D^{-1}``, ``g_B = D^{-1} e``, the determinant lemma and Woodbury on the
K x K block. Only the diagonal K x K blocks of ``Q`` are needed: with ``L L^T = M`` and ``X = L^{-1} R C``,
``Q_uu = diag(C_k[u,u]) - (X^T X)_uu`` (one triangular solve with NK right-hand sides, about the cost of one
factorization): :func:`msrm.gp.conditional.node_posterior`, the node-space conditional that also gives the
latent posterior and the predictions. A sample with every feature missing contributes an empty block (0).

This is evidence for model comparison, not part of the gradient path: it runs in native JAX (guarded Cholesky
of :mod:`msrm.gp.linalg`), on the per-run layout of :mod:`msrm.gp.prepare` (:func:`pointwise_prepare`), and its
sum is *not* the joint log likelihood. The dense and grouped backends compute it on their own node table, the
state-space backend on the grouped one (``pointwise_prepare``/``pointwise`` of :mod:`msrm.gp.backends`). Tested
against the conditional densities of the brute-force observation covariance.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from . import linalg
from .conditional import node_posterior
from .prepare import Prepared, RunPrepared, prepare

__all__ = ["pointwise_prepare", "run_pointwise", "pointwise_logliks"]

_LOG_2PI = math.log(2.0 * math.pi)


def pointwise_prepare(data, spec, *, grouped: bool = True) -> Prepared:
    """The per-run layout the pointwise terms are computed on: :func:`msrm.gp.prepare.prepare` of the grouped
    (``grouped=True``) or the ungrouped dense node table, with the native factorization."""
    return prepare(data, spec, grouped=grouped, method="native")


def _logdet_and_solve(A, b):
    """``(log|det A|, A^-1 b)`` for (..., K, K) and (..., K)."""
    return jnp.linalg.slogdet(A)[1], jnp.linalg.solve(A, b[..., None])[..., 0]


def run_pointwise(theta, run: RunPrepared) -> tuple[dict, jax.Array]:
    """``{stream key: (n_s,) log p(y_si | rest)}`` for one run, and the factorization's guard event."""
    layout = run.layout
    K = layout.n_factors
    m, Q, event = node_posterior(theta, run)
    eye = jnp.eye(K)
    out = {}
    for sl, st in zip(layout.streams, run.streams):
        W = theta["loadings"][sl.key]
        b = theta["intercepts"][sl.key]
        sd = theta["noise_sd"][sl.key]
        prec = 1.0 / (sd * sd)
        WP = W * prec[:, None]
        mi, Qi = m[sl.sample_nodes], Q[sl.sample_nodes]
        # the residual at the posterior mean, formed per value from the centred data (Y0 = y - c where observed):
        # e = (y - c) - (b - c) - W m_u, never expanded into sums of squares that cancel at high signal-to-noise
        e = st.Y0 - (b - st.centre)[None, :] - mi @ W.T  # (n_s, F)
        if sl.has_missing:
            e = e * st.mask
            outer = (W[:, :, None] * WP[:, None, :]).reshape(sl.n_features, K * K)
            Lam = (st.mask @ outer).reshape(-1, K, K)
            logD = st.mask @ jnp.log(sd * sd)
            F = jnp.sum(st.mask, axis=1)
        else:
            Lam = jnp.broadcast_to(W.T @ WP, (st.Y0.shape[0], K, K))
            logD = jnp.sum(jnp.log(sd * sd))
            F = sl.n_features
        eDe = (e * e) @ prec  # e^T D^-1 e
        t = e @ WP  # W^T D^-1 e
        IQL = eye - jnp.einsum("ikl,ilm->ikm", Qi, Lam)
        logdet, sol = linalg.per_item_on_cpu(_logdet_and_solve, IQL, jnp.einsum("ikl,il->ik", Qi, t))
        quad = eDe + jnp.sum(t * sol, axis=1)
        out[sl.key] = -0.5 * (F * _LOG_2PI + logD - logdet + quad)
    return out, event


def pointwise_logliks(theta, prepared: Prepared) -> tuple[dict, jax.Array]:
    """Per stream, the conditional log densities of its samples over all runs (run order, then sample order).

    Returns:
        ({stream key: (total samples of the stream,)}, (n_runs,) int32 guard events).
    """
    parts: dict[str, list] = {}
    events = []
    for run in prepared.runs:
        vals, ev = run_pointwise(theta, run)
        events.append(ev)
        for key, v in vals.items():
            parts.setdefault(key, []).append(v)
    return {k: jnp.concatenate(v) if len(v) > 1 else v[0] for k, v in parts.items()}, jnp.stack(events).astype(
        jnp.int32)
