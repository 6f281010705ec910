r"""Parallel-in-time filter: the same density by an associative (log-depth) scan.

The Särkkä & García-Fernández (2021) filtering elements, extended with a log-normaliser. The state is laid out
as a *shift register* ``[SDE | delay line | bank]`` (delay slot p holds ``z_{j-1-p}``) so one transition
``x_j = F x_{j-1} + ε``, ``ε ~ N(0, Q_a)``, serves every step (``F``, ``Q_a`` dense S x S, built once from θ).
Element j ≥ 1 represents ``f_j(x_j | x_{j-1}) ∝ N(x_j; F x_{j-1}, Q_a) exp(-½ x_jᵀ B_jᵀ Λ B_j x_j + ηᵀ B_j x_j)``
as ``(A, b, C, η̄, J, c)``: ``x_j | x_{j-1} ~ N(A x_{j-1} + b, C)`` and
``log ∫ f_j dx_j = c - ½ x_{j-1}ᵀ J x_{j-1} + η̄ᵀ x_{j-1}``. With ``C_q = B Q_a Bᵀ``, ``G = I + Λ C_q``
(small: M K x M K, by the push-through identity):

.. math::

    A = F - Q_a B^\top G^{-1} Λ B F,\; b = Q_a B^\top G^{-1} η,\; C = Q_a - Q_a B^\top G^{-1} Λ B Q_a,\;
    J = (BF)^\top G^{-1}Λ (BF),\; η̄ = (BF)^\top G^{-1} η,\; c = ½ η^\top C_q G^{-1} η - ½ \log|G|.

A sub-step that does not predict (a step split for a pile-up of nodes) uses ``F = I, Q_a = 0``.
Element 0 is the filtered initial state (A = 0, J = 0, η̄ = 0). Two elements combine (i before j) with
``D = I + C_i J_j``:

.. math::

    A = A_j D^{-1} A_i,\quad b = A_j D^{-1}(b_i + C_i η̄_j) + b_j,\quad C = A_j D^{-1} C_i A_j^\top + C_j,

    η̄ = A_i^\top D^{-\top}(η̄_j - J_j b_i) + η̄_i,\quad J = A_i^\top D^{-\top} J_j A_i + J_i,

    c = c_i + c_j - ½\log|D| + ½ η̄_j^\top C_i D^{-\top} η̄_j - ½ b_i^\top D^{-\top} J_j b_i + b_i^\top D^{-\top} η̄_j,

and the last prefix's ``c`` is ``Σ_j log Z_j``. Each combine is a dense S x S solve and every element is held
at once (steps x S x S memory): this is the accelerator variant; the sequential scan is the memory-lean one.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..linalg import per_item_on_cpu
from .filter import bank_matrices, event_code, group_readouts, node_arrays, slot_information, transition_blocks
from .prepare import RunTables

__all__ = ["shift_transition", "observation_map", "observation_matrices", "combine", "run_loglik_parallel"]


def _static_shift(t: RunTables) -> np.ndarray:
    """Shift-register move in state-major order: slot 0 <- z (rows 0..K-1), slot p <- slot p-1."""
    S, K, r0 = t.n_states, t.K, t.ring_offset
    T = np.eye(S)
    T[r0 : r0 + t.L * K] = 0.0
    T[r0 : r0 + K, :K] = np.eye(K)
    for p in range(1, t.L):
        T[r0 + p * K : r0 + (p + 1) * K, r0 + (p - 1) * K : r0 + p * K] = np.eye(K)
    return T


def shift_transition(theta, t: RunTables, blocks):
    """Dense ``F`` and ``Q_a`` (S, S) of one step in the shift-register layout."""
    Phi, Q, _ = blocks
    S, Kd = t.n_states, t.K * t.d
    T2 = jnp.eye(S).at[:Kd, :Kd].set(Phi)
    T3 = jnp.eye(S)
    if t.n_bank:
        Mk, Vk = bank_matrices(t)
        b0 = t.bank_offset
        T3 = T3.at[b0:, b0:].set(Mk).at[b0:, : t.K].set(Vk)
    F = T3 @ T2 @ jnp.asarray(_static_shift(t))
    Qa = T3[:, :Kd] @ Q @ T3[:, :Kd].T
    return F, 0.5 * (Qa + Qa.T)


def initial_state(t: RunTables, blocks):
    """Mean and covariance at step 0 in the shift-register layout (stationary SDE, empty delay line, bank fed
    with z_0)."""
    S, Kd, K, b0 = t.n_states, t.K * t.d, t.K, t.bank_offset
    m = jnp.zeros(S)
    P = jnp.zeros((S, S)).at[:Kd, :Kd].set(blocks[2])
    if t.n_bank:
        Mk, Vk = bank_matrices(t)
        P = P.at[b0:, :].set(Mk @ P[b0:, :] + Vk @ P[:K, :])
        P = P.at[:, b0:].set(P[:, b0:] @ Mk.T + P[:, :K] @ Vk.T)
    return m, P


def _shift_place(w: int, L: int):
    """Window weights (.., w) -> shift-register slots (.., L): slot p holds z_{j-1-p} = window position w-2-p."""

    def place(a):
        return jnp.zeros(a.shape[:-1] + (L,)).at[..., : w - 1].set(a[..., w - 2 :: -1] if w > 1 else a[..., :0])

    return place


def observation_map(t: RunTables, a_groups, ring_place):
    """Dense stacked node map ``B`` (M K, S) of one sub-step.

    Args:
        a_groups: per group (M_g, w') readouts of the nodes in its slots.
        ring_place: per group a function mapping (M_g, w) window weights to (M_g, L) delay-slot weights.
    """
    K, eye = t.K, jnp.eye(t.K)
    rows = []
    for g, a, place in zip(t.groups, a_groups, ring_place):
        Mg = a.shape[0]
        sde = jnp.zeros((Mg, K, t.K * t.d))
        ring = jnp.zeros((Mg, K, t.K * t.L))
        bank = jnp.zeros((Mg, K, t.K * t.n_bank))
        if g.mode == "bank":
            bank = jnp.einsum("mi,kl->mkil", a, eye).reshape(Mg, K, -1)
        else:
            sde = sde.at[:, :, :K].set(a[:, -1, None, None] * eye)
            ring = jnp.einsum("ms,kl->mksl", place(a), eye).reshape(Mg, K, -1)
        rows.append(jnp.concatenate([sde, ring, bank], axis=-1).reshape(Mg * K, -1))
    return jnp.concatenate(rows)


def observation_matrices(t: RunTables, readouts, Lam, eta):
    """Per sub-step the stacked node map ``B`` (T, M K, S), blockdiag ``Λ`` (T, M K, M K) and ``η`` (T, M K)."""
    places = [_shift_place(g.width, t.L) for g in t.groups]

    def one(locs, globs):
        B = observation_map(t, [R[loc] for R, loc in zip(readouts, locs)], places)
        Lb, e = slot_information(Lam, eta, jnp.concatenate(globs))
        return B, Lb, e

    locs = [jnp.asarray(g.slot_local) for g in t.groups]
    globs = [jnp.asarray(g.slot_global) for g in t.groups]
    return jax.vmap(one)(locs, globs)


def _element(F, Qa, B, Lb, e):
    """Filtering element of one step (see the module docstring)."""
    BF = B @ F
    QBt = Qa @ B.T
    Cq = B @ QBt
    G = jnp.eye(Cq.shape[0]) + Lb @ Cq
    GiL = jnp.linalg.solve(G, Lb)
    Gie = jnp.linalg.solve(G, e)
    A = F - QBt @ GiL @ BF
    C = Qa - QBt @ GiL @ QBt.T
    b = QBt @ Gie
    J = BF.T @ (0.5 * (GiL + GiL.T)) @ BF
    eta = BF.T @ Gie
    _, logdet = jnp.linalg.slogdet(G)
    c = 0.5 * e @ (Cq @ Gie) - 0.5 * logdet
    return A, b, 0.5 * (C + C.T), eta, J, c


def _first_element(m, P, B, Lb, e):
    """Element 0: the initial state filtered with step 0's nodes (A = 0, J = 0, η̄ = 0)."""
    S = P.shape[0]
    U = P @ B.T
    Cm = B @ U
    G = jnp.eye(Cm.shape[0]) + Lb @ Cm
    mu = B @ m
    v = e - Lb @ mu
    GiL = jnp.linalg.solve(G, Lb)
    Giv = jnp.linalg.solve(G, v)
    _, logdet = jnp.linalg.slogdet(G)
    c = -0.5 * mu @ (Lb @ mu) + e @ mu + 0.5 * v @ (Cm @ Giv) - 0.5 * logdet
    Pn = P - U @ (0.5 * (GiL + GiL.T)) @ U.T
    return jnp.zeros((S, S)), m + U @ Giv, Pn, jnp.zeros(S), jnp.zeros((S, S)), c


def _mv(M, v):
    return jnp.einsum("...ij,...j->...i", M, v)


def combine(ei, ej):
    """Associative combination of batched elements (i before j)."""
    Ai, bi, Ci, ni, Ji, ci = ei
    Aj, bj, Cj, nj, Jj, cj = ej
    S = Ai.shape[-1]
    eye = jnp.eye(S)
    D = eye + Ci @ Jj
    Dt = jnp.swapaxes(D, -1, -2)
    X = jnp.linalg.solve(D, jnp.concatenate([Ai, Ci, (bi + _mv(Ci, nj))[..., None]], axis=-1))
    DiA, DiC, Dib = X[..., :S], X[..., S : 2 * S], X[..., 2 * S]
    Jb = _mv(Jj, bi)
    Y = jnp.linalg.solve(Dt, jnp.concatenate([Jj @ Ai, (nj - Jb)[..., None], nj[..., None], Jb[..., None]], axis=-1))
    DtJA, Dtr, Dtn, DtJb = Y[..., :S], Y[..., S], Y[..., S + 1], Y[..., S + 2]
    A = Aj @ DiA
    b = _mv(Aj, Dib) + bj
    C = Aj @ DiC @ jnp.swapaxes(Aj, -1, -2) + Cj
    AiT = jnp.swapaxes(Ai, -1, -2)
    n = _mv(AiT, Dtr) + ni
    J = AiT @ DtJA + Ji
    _, logdet = jnp.linalg.slogdet(D)
    quad = 0.5 * jnp.sum(nj * _mv(Ci, Dtn), -1) - 0.5 * jnp.sum(bi * DtJb, -1) + jnp.sum(bi * Dtn, -1)
    c = ci + cj - 0.5 * logdet + quad
    sym = lambda M: 0.5 * (M + jnp.swapaxes(M, -1, -2))
    return A, b, sym(C), n, sym(J), c


def run_loglik_parallel(theta, run):
    """Log likelihood of one run by the associative scan; (value, event code: the count of non-finite combines,
    and the rounding level of the data term when the data are precise enough for it to matter,
    :func:`.filter.event_code`)."""
    t: RunTables = run.tables
    Lam, eta, const = node_arrays(theta, run)
    readouts = group_readouts(theta, t)
    blocks = transition_blocks(theta, t)
    F, Qa = shift_transition(theta, t, blocks)
    m0, P0 = initial_state(t, blocks)
    B, Lb, e = observation_matrices(t, readouts, Lam, eta)
    first = _first_element(m0, P0, B[0], Lb[0], e[0])
    move = jnp.asarray(t.predict[:-1])[:, None, None]  # sub-step t-1 predicts -> element t uses (F, Qa)
    Ft = jnp.where(move, F[None], jnp.eye(F.shape[0])[None])
    Qt = jnp.where(move, Qa[None], 0.0)
    rest = per_item_on_cpu(_element, Ft, Qt, B[1:], Lb[1:], e[1:], batched=False)
    elems = jax.tree_util.tree_map(lambda a, r: jnp.concatenate([a[None], r]), first, rest)
    out = lax.associative_scan(lambda ei, ej: per_item_on_cpu(combine, ei, ej), elems)
    total = out[5][-1]
    bad = jnp.sum(~jnp.isfinite(out[5])).astype(jnp.int32)
    # the density is −const/2 plus a sum of elements of the same size at precise data: report the rounding of that
    # difference (about ε |const|: 10⁻² nats at noise 10⁻⁶ of the signal with 60 values)
    rounding = lax.stop_gradient(jnp.finfo(jnp.float64).eps * jnp.abs(const))
    return -0.5 * const + total, event_code(bad, jnp.ones(()), rounding=rounding)
