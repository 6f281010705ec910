r"""The dense and grouped GP-MSRM log likelihoods (pure JAX, float64).

Per run, nodes ``u = 1..N`` (one per distinct (response group, sample time); ``dense`` makes every
(stream, sample) its own node), grid ``tau_1..tau_J`` and factors ``k = 1..K``. Node ``u`` sees
``x_u = (a_u^T z_k)_k`` with ``a_u`` its response row, and the prior ``z_k ~ N(0, K_k)`` gives
``x_k = A z_k ~ N(0, C_k)``, ``C_k = A K_k A^T`` (N x N, rank <= J: singular whenever N > J, so it is never
inverted). Observations are ``y = b + W x_u + eps``, ``eps ~ N(0, sigma^2)``.

**Sufficient statistics** (:func:`node_information`), per stream ``s`` with ``P_s = diag(1 / sigma_s^2)``:

.. math::

    E_s = Y^0_s (P_s W_s) - M_s (P_s\, b_s \odot W_s)  \quad (n_s, K), \qquad
    \eta_u = \sum_{(s,i) \to u} E_{s,i}, \qquad
    \Lambda_u = \sum_{(s,i) \to u} W_s^\top \mathrm{diag}(m_{si}) P_s W_s,

matrix products over features then a sum of *samples* into nodes (never a scatter per observation). Without
missing values every sample of a stream adds the same ``W^T P W``, so ``Lambda = sum_s counts_s ⊗ W_s^T P_s W_s``.
The constant data terms are ``r^T D^-1 r = sum_f (S2_f - 2 b_f S1_f + n_f b_f^2) / sigma_f^2`` and
``log|D| = sum_f n_f log sigma_f^2``.

**Woodbury in node space** with ``Lambda_u = R_u^T R_u`` (see :mod:`msrm.gp.prepare` for the static choice of
``R_u``), ``R = blockdiag(R_u)``, ``C = blockdiag_k(C_k)`` in (u, k) order:

.. math::

    M = I + R C R^\top, \quad v = R C \eta, \quad
    \log p(y) = -\tfrac12\big[n_{obs}\log 2\pi + \log|D| + r^\top D^{-1} r - \eta^\top C \eta
    + v^\top M^{-1} v + \log|M|\big],

from ``(C^-1 + Lambda)^-1 = C - C R^T M^-1 R C`` and ``|D + H C H^T| = |D| |M|``; ``M`` has eigenvalues
``>= 1``. ``(R C R^T)[(u,a),(v,b)] = sum_k R_u[a,k] C_k[u,v] R_v[b,k]``. ``v^T M^-1 v`` and ``log|M|`` come
from :func:`msrm.gp.linalg.quad_logdet` (guarded Cholesky, custom reverse rule), whose event code is returned.

Backend interface: ``loglik(theta, prepared) -> (value, events)`` with ``theta`` the constrained pytree
``{"loadings": {key: (F, K)}, "intercepts": {key: (F,)}, "noise_sd": {key: (F,)}, "lengthscales": (K,),
"response": {param_key: {"lag": ..., "width": ...}}}`` and ``events`` (n_runs,) int32.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from ..operators import jax_window_weights
from . import banded, linalg
from .kernels import kernel_matrices
from .prepare import Prepared, RunPrepared, prepare

__all__ = [
    "TRACE_COUNT",
    "group_theta",
    "response_matrix",
    "node_covariance",
    "banded_shapes",
    "covariance_from_response",
    "woodbury_system",
    "woodbury_loglik",
    "StreamArrays",
    "accumulate_node_statistics",
    "node_information",
    "node_woodbury_matrix",
    "run_loglik",
    "grouped_loglik",
    "run_logliks",
    "prepare",
    "loglik",
]

# Incremented each time grouped_loglik is traced (tests check that a model compiles once).
TRACE_COUNT = [0]

_LOG_2PI = math.log(2.0 * math.pi)


def group_theta(theta, group) -> dict:
    """The response parameters of one group (``{}`` for a parameter-free response)."""
    if group.param_key is None:
        return {}
    return theta["response"][group.param_key]


def response_matrix(theta, layout):
    """Dense response rows of every node, ``A`` (N, J), assembled from the static windows of each group."""
    A = jnp.zeros((layout.n_nodes, layout.n_grid))
    for g in layout.groups:
        a = jax_window_weights(group_theta(theta, g), g.response, g.window)  # (n_g, w)
        A = A.at[g.rows, g.cols].set(a.reshape(-1), unique_indices=True)
    return A


def node_covariance(theta, layout):
    """Node covariances ``C_k = A K_k A^T``, (K, N, N).

    Where every response group's nodes are ordered in time and their windows are narrow against the grid (the
    grouped layout of a recording), by chunked window products (:mod:`msrm.gp.banded`, a fraction of the
    flops, no dense response matrix); otherwise by dense products (``T = A K_k`` then ``T A^T``). Both agree to
    rounding (tested).
    """
    Kk = kernel_matrices(layout.dist, theta["lengthscales"], layout.kernel)
    shapes = banded_shapes(layout)
    if shapes is None:
        return covariance_from_response(response_matrix(theta, layout), Kk)
    windows = tuple(banded.chunk_windows(jax_window_weights(group_theta(theta, g), g.response, g.window),
                                         g.window.start, sh, layout.n_grid) for g, sh in zip(layout.groups, shapes))
    return banded.chunked_covariance(shapes, windows, Kk)


def banded_shapes(layout) -> tuple | None:
    """The chunking of every group of a per-run layout (trace time, NumPy), or None: use the dense products."""
    shapes = tuple(banded.chunk_shape([g.window.start], g.window.width, layout.n_grid, g.node_stop - g.node_start)
                   for g in layout.groups)
    return shapes if banded.worthwhile(shapes, layout.n_grid) else None


@jax.custom_vjp
def covariance_from_response(A, Kk):
    """``C_k = A K_k A^T``: (K, N, N) from response rows ``A`` (N, J) and prior correlations ``Kk`` (K, J, J).

    ``Kk`` must be symmetric (kernel matrices are). The reverse rule is that of ``A sym(K_k) A^T`` and uses the
    symmetry to need three products per factor instead of four: with ``S_k = (Cbar_k + Cbar_k^T)/2`` and
    ``U_k = S_k A``, ``Kbar_k = A^T U_k`` and ``Abar = 2 sum_k U_k K_k``.
    """
    T = jnp.einsum("uj,kji->kui", A, Kk)
    return jnp.einsum("kui,vi->kuv", T, A)


def _cov_fwd(A, Kk):
    return covariance_from_response(A, Kk), (A, Kk)


def _cov_bwd(res, Cbar):
    A, Kk = res
    S = 0.5 * (Cbar + jnp.swapaxes(Cbar, -1, -2))
    U = jnp.einsum("kuv,vj->kuj", S, A)  # (K, N, J)
    Kbar = jnp.einsum("uj,kui->kji", A, U)
    Abar = 2.0 * jnp.einsum("kui,kij->uj", U, Kk)
    return Abar, Kbar


covariance_from_response.defvjp(_cov_fwd, _cov_bwd)


class StreamArrays(NamedTuple):
    """The arrays of one stream that the node statistics read (static NumPy or traced; one run).

    Fields: ``Y0`` (n_s, F) values with NaN -> 0; ``mask`` (n_s, F) or None; ``S1``, ``S2``, ``n_f`` (F,) data
    sums; ``sample_nodes`` (n_s,) node of each sample (``N`` for padding: dropped); ``node_counts`` (N,) samples
    per node; ``low_rows`` (e,) rows of the flattened (N K, K) factor filled by low-count values (past the end for
    padding: dropped); ``low_feats`` (e,) their features. The stacked likelihood (:mod:`msrm.gp.multirun`) keeps
    these per run with a leading run axis.
    """

    Y0: Any
    mask: Any
    S1: Any
    S2: Any
    n_f: Any
    sample_nodes: Any
    node_counts: Any
    low_rows: Any
    low_feats: Any


def accumulate_node_statistics(theta, streams, n_nodes: int, n_factors: int, n_obs):
    """The sums behind every grouped likelihood: ``Lambda``, ``eta``, the low-count rows of ``R`` and ``const``.

    Args:
        theta: constrained parameter pytree.
        streams: iterable of ``(static, arrays)``: ``static`` has ``key``, ``has_missing`` and ``n_features``
            (a :class:`~msrm.gp.prepare.StreamLayout` or a stacked stream shape), ``arrays`` a
            :class:`StreamArrays`.
        n_nodes, n_factors: N and K. n_obs: observed value count (int or traced).
    Returns:
        Lambda (N, K, K), eta (N, K), R_rows (N K, K) filled at low-count nodes only, const ().
    """
    N, K = n_nodes, n_factors
    Lam = jnp.zeros((N, K, K))
    eta = jnp.zeros((N, K))
    R_rows = jnp.zeros((N * K, K))
    const = n_obs * _LOG_2PI
    for ss, st in streams:
        W = theta["loadings"][ss.key]
        b = theta["intercepts"][ss.key]
        sd = theta["noise_sd"][ss.key]
        prec = 1.0 / (sd * sd)
        WP = W * prec[:, None]  # (F, K)
        if ss.has_missing:
            E = st.Y0 @ WP - st.mask @ (b[:, None] * WP)
            outer = (W[:, :, None] * WP[:, None, :]).reshape(ss.n_features, K * K)
            Lam = Lam + jax.ops.segment_sum(st.mask @ outer, st.sample_nodes, num_segments=N).reshape(N, K, K)
        else:
            E = st.Y0 @ WP - (b @ WP)[None, :]
            Lam = Lam + jnp.asarray(st.node_counts)[:, None, None] * (W.T @ WP)[None, :, :]
        eta = eta + jax.ops.segment_sum(E, st.sample_nodes, num_segments=N)  # samples at node >= N dropped
        const = const + jnp.sum((st.S2 - 2.0 * b * st.S1 + st.n_f * b * b) * prec) + jnp.sum(st.n_f * jnp.log(sd * sd))
        if st.low_rows.size:
            R_rows = R_rows.at[st.low_rows].set(W[st.low_feats] / sd[st.low_feats, None], unique_indices=True,
                                                mode="drop")
    return Lam, eta, R_rows, const


def node_information(theta, run: RunPrepared):
    """Per-node sufficient statistics of one run.

    Args:
        theta: constrained parameter pytree.
        run: a prepared run.
    Returns:
        Lambda: (N, K, K) node information matrices ``sum W^T diag(m / sigma^2) W``.
        eta: (N, K) ``sum W^T diag(m / sigma^2) (y - b)``.
        R: (N, K, K) factors with ``R_u^T R_u = Lambda_u`` (rows ``w_f / sigma_f`` at low-count nodes,
            ``chol(Lambda_u)^T`` elsewhere).
        const: scalar ``n_obs log 2 pi + log|D| + r^T D^-1 r``.
    """
    layout = run.layout
    N, K = layout.n_nodes, layout.n_factors
    terms = ((sl, StreamArrays(st.Y0, st.mask, st.S1, st.S2, st.n_f, sl.sample_nodes, sl.node_counts, sl.low_rows,
                               sl.low_feats)) for sl, st in zip(layout.streams, run.streams))
    Lam, eta, R_rows, const = accumulate_node_statistics(theta, terms, N, K, layout.n_obs)
    R = R_rows.reshape(N, K, K)
    if layout.chol_nodes.size:
        L = linalg.small_cholesky(Lam[layout.chol_nodes])
        R = R.at[layout.chol_nodes].set(jnp.swapaxes(L, -1, -2), unique_indices=True)
    return Lam, eta, R, const


@jax.custom_vjp
def node_woodbury_matrix(R, C):
    r"""``(R C R^T)[(u,a),(v,b)] = sum_k R_u[a,k] C_k[u,v] R_v[b,k]`` as (N, K, N, K), for symmetric ``C_k``.

    Forward: K fused elementwise outer products ``(r_k r_k^T) * (C_k ⊗ 1)`` (an einsum lowers to N batched
    K x K products with transposes of (NK)^2 arrays on XLA:CPU, several times slower).

    Reverse rule (hand-written: autodiff of the broadcasts reduces the (NK)^2 cotangent over strided axes once
    per factor and operand). It requires a **symmetric** cotangent ``G`` - the only one it receives: ``M``
    feeds :func:`msrm.gp.linalg.quad_logdet`, whose cotangent is symmetric by construction - which halves the
    work (the row and column contractions coincide). With ``Y[k,u,a,v] = sum_b G[u,a,v,b] R_v[b,k]`` (one pass
    over ``G`` for every factor, written with ``v`` innermost so that both reductions run along contiguous
    rows):

    .. math::

        \bar C_k[u,v] = \sum_a R_u[a,k] Y[k,u,a,v], \qquad \bar R_u[a,k] = 2 \sum_v C_k[u,v] Y[k,u,a,v].

    ``C_k`` symmetric is required for the second formula (the model's ``A K_k A^T`` is, to rounding).
    """
    out = 0.0
    for k in range(R.shape[-1]):
        r = R[:, :, k]
        # C * (r r^T): the product commutes exactly, so a bitwise-symmetric C gives a bitwise-symmetric result
        out = out + C[k][:, None, :, None] * (r[:, :, None, None] * r[None, None, :, :])
    return out


def _woodbury_fwd(R, C):
    return node_woodbury_matrix(R, C), (R, C)


def _woodbury_bwd(res, G):
    R, C = res
    Rt = jnp.transpose(R, (2, 0, 1))  # Rt[k, u, a] = R_u[a, k]
    # the sum over b as K strided slices of G (a reduction over an axis of length K is several times slower)
    Y = sum(G[None, :, :, :, b] * Rt[:, None, None, :, b] for b in range(R.shape[-1]))  # (K, N, K, N)
    Cbar = jnp.sum(Rt[:, :, :, None] * Y, axis=2)
    Rbar = 2.0 * jnp.sum(C[:, :, None, :] * Y, axis=-1)  # (K, N, K): [k, u, a]
    return jnp.transpose(Rbar, (1, 2, 0)), Cbar


node_woodbury_matrix.defvjp(_woodbury_fwd, _woodbury_bwd)


def run_loglik(theta, run: RunPrepared):
    """Log likelihood of one run and its guard event code.

    Returns:
        (value, event): float64 scalar, int32 scalar.
    """
    layout = run.layout
    _, eta, R, const = node_information(theta, run)
    C = node_covariance(theta, layout)  # (K, N, N)
    return woodbury_loglik(eta, R, C, const, layout.method)


def woodbury_system(eta, R, C):
    """The node-space pieces shared by the density and the pointwise terms: ``(C, C eta, v, M)``.

    ``C`` (K, N, N) is returned exactly symmetric (``A K_k A^T`` is symmetric only to rounding), so that
    ``M = I + R C R^T`` (NK, NK) is bitwise symmetric and the factorization can skip its own symmetrisation;
    ``C eta`` is (N, K) in (node, factor) order and ``v = R C eta`` is (NK,).
    """
    N, K = eta.shape
    C = 0.5 * (C + jnp.swapaxes(C, -1, -2))
    Ce = jnp.einsum("kuv,vk->uk", C, eta)
    v = jnp.einsum("uak,uk->ua", R, Ce).reshape(N * K)
    M = jnp.eye(N * K) + node_woodbury_matrix(R, C).reshape(N * K, N * K)
    return C, Ce, v, M


def woodbury_loglik(eta, R, C, const, method: str):
    """The node-space Woodbury log density of one run from its node quantities (module docstring).

    Args:
        eta: (N, K) node statistics. R: (N, K, K) factors of ``Lambda_u``. C: (K, N, N) node covariances.
        const: scalar ``n_obs log 2 pi + log|D| + r^T D^-1 r``. method: quad_logdet method.
    Returns:
        (value, event): float64 scalar, int32 scalar.
    """
    C, Ce, v, M = woodbury_system(eta, R, C)
    eta_C_eta = jnp.sum(eta * Ce)
    quad, logdet, event = linalg.quad_logdet(M, v, method=method, symmetric=True)
    return -0.5 * (const - eta_C_eta + quad + logdet), event


def grouped_loglik(theta, prepared: Prepared):
    """Log likelihood summed over runs (dense or grouped, as prepared), with guard events.

    Args:
        theta: constrained parameter pytree (see the module docstring).
        prepared: from :func:`msrm.gp.prepare.prepare` (per-run loop) or
            :func:`msrm.gp.multirun.prepare_multirun` (batched and sharded runs).
    Returns:
        (value, events): float64 scalar, (n_runs,) int32 event codes of the factorizations.
    """
    TRACE_COUNT[0] += 1
    values, events = run_logliks(theta, prepared)
    return jnp.sum(values), events


def run_logliks(theta, prepared):
    """Per-run log likelihoods ``(n_runs,)`` and event codes ``(n_runs,)`` int32.

    ``prepared`` is a :class:`~msrm.gp.prepare.Prepared` (one traced copy of :func:`run_loglik` per run, the
    reference loop) or a :class:`~msrm.gp.multirun.MultiRunPrepared` (runs stacked by shape signature, one
    vmapped trace per signature, sharded over devices when the prepared object holds a mesh).
    """
    if not isinstance(prepared, Prepared):
        from . import multirun

        return multirun.run_logliks(theta, prepared)
    out = [run_loglik(theta, run) for run in prepared.runs]
    return jnp.stack([v for v, _ in out]), jnp.stack([e for _, e in out]).astype(jnp.int32)


loglik = grouped_loglik
