r"""Sequential Kalman filter over the latent grid with one information-form update per node, checkpointed.

State at step j (before absorbing): ``[s_j (K d SDE states) | ring (K L past grid values) | bank (K n)]`` with
mean ``m`` and covariance ``P`` (S x S), state-major inside each block (index ``i K + k`` for component i of
factor k), so the K current grid values are rows 0..K-1 and one ring slot is K contiguous rows. Each step:

1. **absorb** the nodes whose windows end at j. With ``B`` the (M K, S) map from the state to the stacked
   node values (``x_u = B_u s``: window weights on ring/SDE entries, or bank readouts), ``Λ`` = blockdiag of the
   nodes' ``Λ_u``, ``η`` stacked, ``μ = B m``, ``U = P Bᵀ``, ``C = B U``, ``G = I + Λ C``, ``v = η − Λ μ``:

   .. math::

       m \leftarrow m + U G^{-1} v, \qquad P \leftarrow P - U\, G^{-1}Λ\, U^\top,

       \log Z_j = -\tfrac12 μ^\top Λ μ + η^\top μ + \tfrac12 v^\top C G^{-1} v - \tfrac12 \log|G|,

   the log of ``E[exp(-x^T Λ x / 2 + η^T x)]`` under the filtered law; ``Λ`` may be singular (a one-feature
   stream at K > 1) since nothing inverts it. Padding slots have ``Λ = 0, η = 0`` and change nothing.
2. **predict** to j+1: copy ``z_j`` into ring slot ``j mod L`` (two K-wide slices of ``P``: O(S K)), step the SDE
   block with ``Φ`` and add ``Q_d`` (O(S K d)), then move the bank ``xi ← M xi + v z_{j+1}`` (O(S K n)).

``log p(y) = -½ (n_obs log 2π + log|D| + rᵀD⁻¹r) + Σ_j log Z_j``. The step tables, weights and node
information are the only per-step inputs (nothing steps x S x S is staged). The scan runs over chunks of
``chunk`` steps, each under ``jax.checkpoint``: reverse mode keeps one carry per chunk and recomputes inside a
chunk, so residual memory grows with ``n_chunks + chunk`` (≈ 2 sqrt(steps) by default).
:func:`run_loglik_sequential` is differentiated by JAX (kept as the reference and for forward mode);
:func:`msrm.gp.state_space.loglik` uses the same scan with the hand-written reverse mode of :mod:`.adjoint`.

Clipped windows at the two ends of a run pile many nodes onto one step; such a step is split into sub-steps of
``M_g`` slots per group (only the last one predicts), so the slot count stays that of a typical step.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.scipy.linalg import block_diag

from ...operators import jax_window_weights
from ..likelihood import group_theta, node_information
from .prepare import RunTables
from .sde import discretise

__all__ = ["transition_blocks", "bank_matrices", "initial_state", "predict", "group_readouts", "node_arrays",
           "slot_information", "absorb", "run_loglik_sequential"]


def _state_major(blocks_k):
    """(K, d, d) per-factor blocks -> (d K, d K) in state-major order (index i K + k)."""
    K, d, _ = blocks_k.shape
    return jnp.einsum("kij,kl->ikjl", blocks_k, jnp.eye(K)).reshape(d * K, d * K)


def transition_blocks(theta, t: RunTables):
    """SDE blocks over all factors in state-major order: Phi, Q, Pinf, each (K d, K d)."""
    parts = [discretise(t.kernel, theta["lengthscales"][k], t.step, jnp) for k in range(t.K)]
    return tuple(_state_major(jnp.stack([p[i] for p in parts])) for i in range(3))


def bank_matrices(t: RunTables):
    """Bank move ``xi <- Mk xi + Vk z`` in state-major order: Mk (n K, n K), Vk (n K, K)."""
    eye = jnp.eye(t.K)
    return jnp.kron(jnp.asarray(t.bank_M), eye), jnp.kron(jnp.asarray(t.bank_v)[:, None], eye)


def _move_bank(m, P, t: RunTables):
    """xi <- M xi + v z on the bank rows and columns (z = rows 0..K-1, the current grid values)."""
    Mk, Vk = bank_matrices(t)
    b0, K = t.bank_offset, t.K
    P = P.at[b0:, :].set(Mk @ P[b0:, :] + Vk @ P[:K, :])
    P = P.at[:, b0:].set(P[:, b0:] @ Mk.T + P[:, :K] @ Vk.T)
    m = m.at[b0:].set(Mk @ m[b0:] + Vk @ m[:K])
    return m, P


def initial_state(theta, t: RunTables, blocks):
    """Mean and covariance at step 0 (stationary SDE, empty delay line, bank fed with z_0)."""
    S, Kd = t.n_states, t.K * t.d
    m = jnp.zeros(S)
    P = jnp.zeros((S, S)).at[:Kd, :Kd].set(blocks[2])
    if t.n_bank:
        m, P = _move_bank(m, P, t)
    return m, P


def _rebase(mp, t: RunTables):
    """Move the newest L buffer slots down by C slots (every C grid steps; one O(S^2) copy)."""
    m, P = mp
    r0, LK, CK = t.ring_offset, t.L * t.K, t.rebase * t.K
    P = P.at[r0 : r0 + LK, :].set(P[r0 + CK : r0 + CK + LK, :])
    P = P.at[:, r0 : r0 + LK].set(P[:, r0 + CK : r0 + CK + LK])
    m = m.at[r0 : r0 + LK].set(m[r0 + CK : r0 + CK + LK])
    return m, P


def predict(m, P, j, t: RunTables, blocks):
    """One grid step j -> j+1: write z_j into buffer slot ``L + j mod C`` (two K-wide slices), SDE step, bank
    move, and every C steps the rebase."""
    Phi, Q, _ = blocks
    K, Kd = t.K, t.K * t.d
    r = (t.ring_offset + (t.L + j % t.rebase) * K).astype(jnp.int32)
    zero = jnp.zeros((), jnp.int32)
    P = lax.dynamic_update_slice(P, P[:K, :], (r, zero))
    P = lax.dynamic_update_slice(P, P[:, :K], (zero, r))
    m = lax.dynamic_update_slice(m, m[:K], (r,))
    P = P.at[:Kd, :].set(Phi @ P[:Kd, :])
    P = P.at[:, :Kd].set(P[:, :Kd] @ Phi.T)
    P = P.at[:Kd, :Kd].add(Q)
    m = m.at[:Kd].set(Phi @ m[:Kd])
    if t.n_bank:
        m, P = _move_bank(m, P, t)
    return lax.cond((j + 1) % t.rebase == 0, lambda mp: _rebase(mp, t), lambda mp: mp, (m, P))


def group_readouts(theta, t: RunTables):
    """Per group the readout rows of its nodes, plus an all-zero padding row.

    Returns:
        tuple of (n_g + 1, w') arrays: window weights in window order (ring mode) or bank readouts
        ``c = P_g h`` with ``h`` the reversed window (bank mode).
    """
    out = []
    for g in t.groups:
        a = jax_window_weights(group_theta(theta, g), g.response, g.window)  # (n_g, w)
        if g.mode == "bank":
            a = a[:, ::-1] @ jnp.asarray(g.proj).T  # (n_g, n)
        out.append(jnp.concatenate([a, jnp.zeros((1, a.shape[1]))]))
    return tuple(out)


def node_arrays(theta, run):
    """(Lam (N+1, K, K), eta (N+1, K), const) with an all-zero padding node N."""
    Lam, eta, _, const = node_information(theta, run.gp)
    K = run.tables.K
    return (jnp.concatenate([Lam, jnp.zeros((1, K, K))]), jnp.concatenate([eta, jnp.zeros((1, K))]), const)


def _readers(t: RunTables, j, a_groups):
    """Per group a function ``X (S, r) -> (M_g, K, r)``: ``B_g X`` for the nodes in the group's slots.

    A ring-mode node ending at step j reads the current values (rows 0..K-1) and the ``w - 1`` buffer slots
    from ``L - w + 1 + j mod C`` on (one contiguous dynamic slice); a bank-mode node reads the bank rows.
    """
    K, C = t.K, t.rebase
    out = []
    for g, a in zip(t.groups, a_groups):
        if g.mode == "bank":
            b0, n = t.bank_offset, t.n_bank

            def read(X, a=a, b0=b0, n=n):
                return jnp.einsum("ikx,mi->mkx", X[b0 : b0 + n * K].reshape(n, K, -1), a)
        else:
            w = g.width
            c0 = (t.ring_offset + (t.L - w + 1 + j % C) * K).astype(jnp.int32)

            def read(X, a=a, w=w, c0=c0):
                cur = a[:, w - 1, None, None] * X[None, :K]
                if w == 1:
                    return cur
                win = lax.dynamic_slice_in_dim(X, c0, (w - 1) * K, axis=0).reshape(w - 1, K, -1)
                return cur + jnp.einsum("pkx,mp->mkx", win, a[:, : w - 1])
        out.append(read)
    return out


def absorb(m, P, readers, Lb, e):
    """Absorb the stacked nodes ``x = B s`` (given by their readers) with information ``(Lb, e)`` in one update.

    Returns:
        (m, P, log Z, bad) with bad = 1 when ``|G|`` is not positive (lost definiteness).
    """
    S = P.shape[0]
    # U = P B^T (S, MK) through the transposed readers: B_g P = (P B_g^T)^T, P symmetric
    U = jnp.concatenate([rd(P).reshape(-1, S) for rd in readers]).T
    mu = jnp.concatenate([rd(m[:, None]).reshape(-1) for rd in readers])
    C = jnp.concatenate([rd(U).reshape(-1, U.shape[1]) for rd in readers])
    C = 0.5 * (C + C.T)
    G = jnp.eye(C.shape[0]) + Lb @ C
    v = e - Lb @ mu
    X = jnp.linalg.solve(G, jnp.concatenate([Lb, v[:, None]], axis=1))
    GiL, Giv = 0.5 * (X[:, :-1] + X[:, :-1].T), X[:, -1]
    sign, logdet = jnp.linalg.slogdet(G)
    logZ = -0.5 * mu @ (Lb @ mu) + e @ mu + 0.5 * v @ (C @ Giv) - 0.5 * logdet
    m = m + U @ Giv
    P = P - U @ GiL @ U.T
    return m, P, logZ, (sign <= 0).astype(jnp.int32)


def slot_information(Lam, eta, glob):
    """Blockdiag ``Λ`` (M K, M K) and stacked ``η`` (M K,) of the nodes ``glob`` (M,)."""
    Ls = Lam[glob]
    M, K = Ls.shape[0], Ls.shape[1]
    return jnp.einsum("mij,mn->minj", Ls, jnp.eye(M)).reshape(M * K, M * K), eta[glob].reshape(-1)


def run_loglik_sequential(theta, run):
    """Log likelihood of one run by the chunked sequential scan; (value, bad-step count)."""
    t: RunTables = run.tables
    Lam, eta, const = node_arrays(theta, run)
    readouts = group_readouts(theta, t)
    blocks = transition_blocks(theta, t)
    m0, P0 = initial_state(theta, t, blocks)
    slot_xs = tuple((jnp.asarray(g.slot_local), jnp.asarray(g.slot_global)) for g in t.groups)

    def step(carry, x, consts):
        m, P, ll, bad = carry
        readouts, Lam, eta, blocks = consts
        j, move, slots = x
        a_groups = [R[loc] for R, (loc, _) in zip(readouts, slots)]
        Lb, e = slot_information(Lam, eta, jnp.concatenate([gl for _, gl in slots]))
        m, P, logZ, b = absorb(m, P, _readers(t, j, a_groups), Lb, e)
        m, P = lax.cond(move, lambda mp: predict(mp[0], mp[1], j, t, blocks), lambda mp: mp, (m, P))
        return (m, P, ll + logZ, bad + b), None

    def chunk_fn(carry, xc, consts):
        return lax.scan(lambda c, x: step(c, x, consts), carry, xc)[0]

    if t.checkpoint:
        chunk_fn = jax.checkpoint(chunk_fn)
    xs = (jnp.asarray(t.grid_index), jnp.asarray(t.predict), slot_xs)
    xs = jax.tree_util.tree_map(lambda a: a.reshape((t.n_chunks, t.chunk) + a.shape[1:]), xs)
    consts = (readouts, Lam, eta, blocks)
    carry0 = (m0, P0, jnp.zeros(()), jnp.zeros((), jnp.int32))
    (_, _, ll, bad), _ = lax.scan(lambda c, xc: (chunk_fn(c, xc, consts), None), carry0, xs)
    return -0.5 * const + ll, bad
