r"""Sequential Kalman filter over the latent grid, a block of ``C`` grid steps at a time, checkpointed.

State while block ``b`` (grid steps ``bC .. bC + C - 1``) is absorbed, in the layout of :mod:`.prepare`:

* ring: ``N`` slots per factor, slot ``s mod N`` holding ``z_s`` for the steps ``bC - L .. bC + C - 1`` (every
  window that ends inside the block; ``N = C (ceil(L / C) + 1)``, so a block's slots are contiguous);
* bank (filter-bank embeddings only): ``xi`` at the last step of block ``b - 1``;
* SDE: ``s_{bC + C - 1}``, the Matérn state at the block's last step (its first component duplicates the
  block's last ring slot; the covariance is singular there, and nothing inverts it).

Each sub-step:

1. **absorb** every node whose window ends inside the block, in one update. With ``B`` the (M K, S) map from
   the state to the stacked node values (``x_u = B_u x``: window weights on ring slots, or bank readouts),
   ``Λ`` = blockdiag of the nodes' ``Λ_u``, ``η`` stacked, ``μ = B m``, ``U = P Bᵀ``, ``C = B U``,
   ``G = I + Λ C``, ``v = η − Λ μ``:

   .. math::

       m \leftarrow m + U G^{-1} v, \qquad P \leftarrow P - U\, G^{-1}Λ\, U^\top,

       \log Z = -\tfrac12 μ^\top Λ μ + η^\top μ + \tfrac12 v^\top C G^{-1} v - \tfrac12 \log|G|,

   the log of ``E[exp(-x^T Λ x / 2 + η^T x)]`` under the filtered law. Absorbing nodes of several steps at once
   is exact because every value they read is a state variable; ``Λ`` may be singular (a one-feature stream at
   K > 1) since nothing inverts it. Padding slots have ``Λ = 0, η = 0`` and change nothing.
2. **predict** to block ``b + 1`` (on the block's last sub-step; the other sub-steps write back what is there,
   so the scan has no branch): the bank moves ``C`` steps,
   ``xi ← M^C xi + Σ_l M^{C-1-l} v z_{bC+l}`` (a linear map of state variables, no noise), then the ``C`` new
   ring slots and the new SDE state are written as ``y = T s + ε``, ``ε ~ N(0, Q_b)`` (per factor,
   :func:`block_transition`): rows and columns ``O(S C K)``, nothing shifted.

A bank-mode node ending at step ``bC + i`` reads ``c^T xi_{bC+i} = c^T M^{i+1} xi_{bC-1} + Σ_{l ≤ i} c^T M^{i-l} v
z_{bC+l}``: the bank rows and the block's ring slots. The density is
``log p(y) = -½ (n_obs log 2π + log|D| + rᵀD⁻¹r) + Σ log Z``. Per-step matrices are built inside the scan
(nothing steps x S x S is staged; the per-sub-step weights and node blocks, a few numbers per node, are built
before the scan by :func:`step_tables`). The scan runs over chunks of ``chunk`` sub-steps, each under
``jax.checkpoint``: reverse mode keeps one state per chunk and recomputes inside a chunk.
:func:`run_loglik_sequential` is differentiated by JAX (the reference, and forward mode);
:func:`msrm.gp.state_space.loglik` runs the same filter with the hand-written reverse mode of :mod:`.adjoint`,
in XLA or on the host (:mod:`.host`).

Clipped windows at the two ends of a run pile many nodes onto one block; such a block is split into sub-steps of
``M_g`` slots per group (only the last one predicts), so the slot count stays that of a typical block.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ...operators import jax_window_weights
from ..likelihood import group_theta, node_information
from .prepare import RunTables
from .sde import discretise, stationary_cov, transition

__all__ = ["transition_blocks", "block_transition", "bank_matrices", "bank_block", "group_readouts", "node_arrays",
           "slot_information", "weights", "apply_B", "step_tables", "blockdiag", "absorb_small", "absorb_small_vjp",
           "bank_rows", "bank_move", "moved_transition", "sde_write", "initial_state", "predict", "forward_step", "scan_inputs",
           "run_loglik_sequential"]


def _state_major(blocks_k):
    """(K, d, d) per-factor blocks -> (d K, d K) in state-major order (index i K + k)."""
    K, d, _ = blocks_k.shape
    return jnp.einsum("kij,kl->ikjl", blocks_k, jnp.eye(K)).reshape(d * K, d * K)


def transition_blocks(theta, t: RunTables):
    """One-step SDE blocks over all factors in state-major order: Phi, Q, Pinf, each (K d, K d)."""
    parts = [discretise(t.kernel, theta["lengthscales"][k], t.step, jnp) for k in range(t.K)]
    return tuple(_state_major(jnp.stack([p[i] for p in parts])) for i in range(3))


def block_transition(theta, t: RunTables):
    """The move from one block's last step to the next block's ``C`` steps, per factor.

    With ``s`` the SDE state at step ``j`` and ``y = (z_{j+1}, .., z_{j+C}, s_{j+C})``: ``y = T s + ε``,
    ``ε ~ N(0, Q_b)``. The noise of ``s_{j+i}`` is ``n_i = Σ_{l ≤ i} Φ^{i-l} ε_l``, so
    ``Cov(n_i, n_{i'}) = Φ^{i-i'} Σ_{i'}`` (i ≥ i') with ``Σ_i = P∞ − Φ^i P∞ Φ^{iᵀ}``.

    Returns:
        T (K, C + d, d), Q_b (K, C + d, C + d), P∞ (K, d, d).
    """
    C, d = t.block, t.d
    # block (i, i') of the joint noise of n_1 .. n_C is B[i - i', i'] for i >= i' and B[i' - i, i]ᵀ above,
    # with B[a, b] = Φ^a Σ_b; only the rows of y are kept (the first component of s_1 .. s_C, then all of s_C)
    i, ii = np.meshgrid(np.arange(1, C + 1), np.arange(1, C + 1), indexing="ij")
    lag, base, upper = np.abs(i - ii), np.minimum(i, ii) - 1, i < ii
    pick = np.concatenate([np.arange(C) * d, (C - 1) * d + np.arange(d)])
    Ts, Qs, Ps = [], [], []
    for k in range(t.K):
        ell = theta["lengthscales"][k]
        pw = transition(t.kernel, ell, t.step * np.arange(C + 1), jnp)  # Φ^0 .. Φ^C
        Pinf = stationary_cov(t.kernel, ell, jnp)
        Sig = Pinf - jnp.einsum("iab,bc,idc->iad", pw[1:], Pinf, pw[1:])  # Σ_1 .. Σ_C
        B = jnp.einsum("iab,jbc->ijac", pw[:C], Sig)[lag, base]  # (C, C, d, d)
        blocks = jnp.where(upper[:, :, None, None], jnp.swapaxes(B, -1, -2), B)
        N = jnp.transpose(blocks, (0, 2, 1, 3)).reshape(C * d, C * d)
        Qb = N[pick][:, pick]
        Ts.append(jnp.concatenate([pw[1:, 0, :], pw[C]]))
        Qs.append(0.5 * (Qb + Qb.T))
        Ps.append(Pinf)
    return jnp.stack(Ts), jnp.stack(Qs), jnp.stack(Ps)


def bank_matrices(t: RunTables):
    """One-step bank move ``xi <- Mk xi + Vk z`` in state-major order: Mk (n K, n K), Vk (n K, K)."""
    eye = jnp.eye(t.K)
    return jnp.kron(jnp.asarray(t.bank_M), eye), jnp.kron(jnp.asarray(t.bank_v)[:, None], eye)


def bank_block(t: RunTables) -> dict:
    """Bank matrices over a block (NumPy constants): the move ``xi <- Mc xi + Vc z_block`` (Mc (n, n), Vc (n, C)
    with column l = M^{C-1-l} v) and the readouts at step i of a block (``Mr[i] = M^{i+1}`` (C, n, n);
    ``Vr[i][:, l] = M^{i-l} v`` for l ≤ i, else 0 (C, n, C))."""
    M, v, C = np.asarray(t.bank_M), np.asarray(t.bank_v), t.block
    pw = [np.eye(M.shape[0])]
    for _ in range(C):
        pw.append(M @ pw[-1])
    Vc = np.stack([pw[C - 1 - l] @ v for l in range(C)], axis=1)
    Mr = np.stack(pw[1:])
    Vr = np.zeros((C, M.shape[0], C))
    for i in range(C):
        for l in range(i + 1):
            Vr[i, :, l] = pw[i - l] @ v
    return dict(Mc=pw[C], Vc=Vc, Mr=Mr, Vr=Vr)


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


def slot_information(Lam, eta, glob):
    """Blockdiag ``Λ`` (M K, M K) and stacked ``η`` (M K,) of the nodes ``glob`` (M,)."""
    Ls = Lam[glob]
    M, K = Ls.shape[0], Ls.shape[1]
    return jnp.einsum("mij,mn->minj", Ls, jnp.eye(M)).reshape(M * K, M * K), eta[glob].reshape(-1)


def ring_base(t: RunTables, b):
    """First ring slot of block b."""
    return ((b % (t.n_ring // t.block)) * t.block).astype(jnp.int32)


def weights(t: RunTables, b, slots, a_groups):
    """The sub-step's readout as one dense weight matrix ``A`` (M, N + n + d) over the state's slots (ring
    slots, bank states, SDE components; the SDE columns are zero).

    Args:
        b: the block; slots: per group (local slot indices (M_g,), global (M_g,)); a_groups: per group the
            readouts of the nodes in its slots (window weights, or bank readouts ``c``).
    Every factor reads the same weights: ``x_{u,k} = Σ_q A[u, q] X[q K + k]``.
    """
    N, n, d = t.n_ring, t.n_bank, t.d
    rows = []
    for g, (loc, _), a in zip(t.groups, slots, a_groups):
        Mg = a.shape[0]
        if g.mode == "ring":
            pos = jnp.asarray(g.ring_pos)[loc]  # (M_g, w)
            ring = jnp.zeros((Mg, N)).at[jnp.arange(Mg)[:, None], pos].add(a)
            bank = jnp.zeros((Mg, n))
        else:
            bb = bank_block(t)
            off = jnp.asarray(g.offset)[loc]
            bank = jnp.einsum("mj,mji->mi", a, jnp.asarray(bb["Mr"])[off])
            cur = jnp.einsum("mj,mjl->ml", a, jnp.asarray(bb["Vr"])[off])
            ring = lax.dynamic_update_slice(jnp.zeros((Mg, N)), cur, (jnp.zeros((), jnp.int32), ring_base(t, b)))
        rows.append(jnp.concatenate([ring, bank, jnp.zeros((Mg, d))], axis=1))
    return jnp.concatenate(rows)


def apply_B(t: RunTables, X, A):
    """Stacked node map ``B X`` (M K, r) for X (S, r) (a reshape of X, no copy)."""
    r = X.shape[1]
    return (A @ X.reshape(A.shape[1], t.K * r)).reshape(-1, r)


def step_tables(theta, run):
    """Everything a sub-step reads besides the state, for all sub-steps at once (built outside the scan):
    ``A`` (T, M, N + n + d), the slots' ``Λ`` blocks (T, M, K, K) and stacked ``η`` (T, M K), and the constant
    term of the density."""
    t: RunTables = run.tables
    Lam, eta, const = node_arrays(theta, run)
    readouts = group_readouts(theta, t)
    slots = tuple((jnp.asarray(g.slot_local), jnp.asarray(g.slot_global)) for g in t.groups)

    def one(b, sl):
        A = weights(t, b, sl, [R[loc] for R, (loc, _) in zip(readouts, sl)])
        glob = jnp.concatenate([gl for _, gl in sl])
        return A, Lam[glob], eta[glob].reshape(-1)

    A, Ls, e = jax.vmap(one)(jnp.asarray(t.block_index), slots)
    return A, Ls, e, const


def sym(X):
    """The symmetric part ``(X + Xᵀ) / 2`` of a square matrix."""
    return 0.5 * (X + X.T)


def absorb_small(mu, C, Lb, e):
    """The M K x M K part of an absorb from one LU of ``G = I + Λ C``.

    Returns:
        (G⁻¹v, sym(G⁻¹Λ), log Z), the sign of |G|, and ``Z = G⁻¹`` (kept for the reverse pass).
    """
    R = C.shape[0]
    G = jnp.eye(R) + Lb @ C
    lu, pivots, _ = lax.linalg.lu(G)
    Z = jax.scipy.linalg.lu_solve((lu, pivots), jnp.eye(R))
    v = e - Lb @ mu
    Giv = Z @ v
    GiL = sym(Z @ Lb)
    d = jnp.diagonal(lu)
    swaps = jnp.sum(pivots != jnp.arange(R, dtype=pivots.dtype))
    sign = jnp.prod(jnp.sign(d)) * (1 - 2 * (swaps % 2))
    logZ = -0.5 * mu @ (Lb @ mu) + e @ mu + 0.5 * v @ (C @ Giv) - 0.5 * jnp.sum(jnp.log(jnp.abs(d)))
    return (Giv, GiL, logZ), sign, Z


def absorb_small_vjp(mu, C, Lb, e, Z, Giv, cts, xp=jnp):
    """Reverse mode of :func:`absorb_small` from its ``Z = G⁻¹`` (no factorisation): cotangents of
    (G⁻¹v, sym(G⁻¹Λ), log Z) -> (μ̄, C̄, Λ̄, η̄) (C̄ and Λ̄ unsymmetrised). ``xp``: jax.numpy, or numpy on the
    host (:mod:`.host`)."""
    Givb, GiLb, lb = cts
    Sb = sym(GiLb)
    v = e - Lb @ mu
    Cv = C @ v
    Zb = xp.outer(Givb, v) + Sb @ Lb + 0.5 * lb * xp.outer(Cv, v)
    vb = Z.T @ Givb + 0.5 * lb * (C @ Giv + Z.T @ Cv)
    Gb = -0.5 * lb * Z.T - Z.T @ Zb @ Z.T
    Lbb = Z.T @ Sb - 0.5 * lb * xp.outer(mu, mu) - xp.outer(vb, mu) + Gb @ C
    mub = lb * v - Lb @ vb
    eb = lb * mu + vb
    Cb = 0.5 * lb * xp.outer(v, Giv) + Lb.T @ Gb
    return mub, Cb, Lbb, eb


def row_block(X, r0, n):
    """Rows ``r0 .. r0 + n - 1`` of X (``r0`` traced, ``n`` static)."""
    return lax.dynamic_slice_in_dim(X, r0, n, axis=0)


def col_block(X, c0, n):
    """Columns ``c0 .. c0 + n - 1`` of X (``c0`` traced, ``n`` static)."""
    return lax.dynamic_slice_in_dim(X, c0, n, axis=1)


def bank_block_moved(t: RunTables, move):
    """(Mc, Vc) of the bank move, or the identity (I, 0) on a sub-step that does not predict."""
    bb = bank_block(t)
    return (jnp.where(move, jnp.asarray(bb["Mc"]), jnp.eye(t.n_bank)),
            jnp.where(move, jnp.asarray(bb["Vc"]), 0.0))


def bank_rows(t: RunTables, b, move, X):
    """The bank move applied to the rows of X (S, r): bank rows <- Mc bank + Vc block(b) (identity unless
    ``move``)."""
    Mc, Vc = bank_block_moved(t, move)
    K, n, C, r = t.K, t.n_bank, t.block, X.shape[1]
    b0, rb = jnp.asarray(t.bank_offset, jnp.int32), ring_base(t, b) * K
    R = (jnp.einsum("ij,jkr->ikr", Mc, row_block(X, b0, n * K).reshape(n, K, r))
         + jnp.einsum("il,lkr->ikr", Vc, row_block(X, rb, C * K).reshape(C, K, r)))
    return lax.dynamic_update_slice(X, R.reshape(n * K, r), (b0, jnp.zeros((), jnp.int32)))


def bank_move(m, P, b, move, t: RunTables):
    """``xi ← Mc xi + Vc z_block(b)`` on the bank rows, then columns, of the covariance and on the mean."""
    P = bank_rows(t, b, move, P)
    P = bank_rows(t, b, move, P.T).T
    return bank_rows(t, b, move, m[:, None])[:, 0], P


def qy(Qb, xp=jnp):
    """Q_b (K, Y, Y) -> (Y K, Y K) state-major (``xp``: jax.numpy, or numpy on the host)."""
    K, Y, _ = Qb.shape
    return xp.einsum("kyz,kl->ykzl", Qb, xp.eye(K)).reshape(Y * K, Y * K)


def moved_transition(t: RunTables, move, T, Qb):
    """(T, Q_b) on a sub-step that predicts; otherwise the identity on the SDE state with no noise (the ring
    rows it would write are kept by the caller)."""
    C, d = t.block, t.d
    T_id = jnp.zeros_like(T).at[:, C:, :].set(jnp.eye(d))
    return jnp.where(move, T, T_id), jnp.where(move, Qb, 0.0)


def sde_write(m, P, b, move, t: RunTables, T, Qb):
    """Write block ``b + 1``'s ring slots and the new SDE state: rows ``y = T s``, then columns, plus ``Q_b``.

    Without ``move`` (a block split into sub-steps, before its last one) every write puts back what is there, so
    the scan has no branch and every write stays in place.
    """
    K, C, d, S = t.K, t.block, t.d, P.shape[0]
    T, Qb = moved_transition(t, move, T, Qb)
    s0, r1 = jnp.asarray(t.sde_offset, jnp.int32), ring_base(t, b + 1) * K
    zero = jnp.zeros((), jnp.int32)
    R = jnp.einsum("kyi,iks->yks", T, row_block(P, s0, d * K).reshape(d, K, S))
    P = lax.dynamic_update_slice(P, jnp.where(move, R[:C].reshape(C * K, S), row_block(P, r1, C * K)), (r1, zero))
    P = lax.dynamic_update_slice(P, R[C:].reshape(d * K, S), (s0, zero))
    cols = jnp.einsum("sik,kyi->syk", col_block(P, s0, d * K).reshape(S, d, K), T).reshape(S, -1)
    Qy = qy(Qb)
    cols = lax.dynamic_update_slice(cols, row_block(cols, r1, C * K) + Qy[: C * K], (r1, zero))
    cols = lax.dynamic_update_slice(cols, row_block(cols, s0, d * K) + Qy[C * K :], (s0, zero))
    P = lax.dynamic_update_slice(P, jnp.where(move, cols[:, : C * K], col_block(P, r1, C * K)), (zero, r1))
    P = lax.dynamic_update_slice(P, cols[:, C * K :], (zero, s0))
    y = jnp.einsum("kyi,ik->yk", T, row_block(m, s0, d * K).reshape(d, K))
    m = lax.dynamic_update_slice(m, jnp.where(move, y[:C].reshape(-1), row_block(m, r1, C * K)), (r1,))
    return lax.dynamic_update_slice(m, y[C:].reshape(-1), (s0,)), P


def initial_state(t: RunTables, T, Qb, Pinf):
    """Mean and covariance while block 0 is absorbed: the stationary SDE one block before, moved to block 0
    (the bank starts at zero)."""
    S, Kd, s0 = t.n_states, t.K * t.d, t.sde_offset
    P = jnp.zeros((S, S)).at[s0 : s0 + Kd, s0 : s0 + Kd].set(_state_major(Pinf))
    return sde_write(jnp.zeros(S), P, jnp.asarray(-1, jnp.int32), True, t, T, Qb)


def predict(m, P, b, move, t: RunTables, T, Qb):
    """Block b -> b + 1 when ``move`` (the bank move, if any, then the SDE write); else the identity."""
    if t.n_bank:
        m, P = bank_move(m, P, b, move, t)
    return sde_write(m, P, b, move, t, T, Qb)


def blockdiag(Ls):
    """Blockdiag ``Λ`` (M K, M K) of the slots' blocks (M, K, K)."""
    M, K = Ls.shape[0], Ls.shape[1]
    return jnp.einsum("mij,mn->minj", Ls, jnp.eye(M)).reshape(M * K, M * K)


def forward_step(t: RunTables, m, P, x, T, Qb):
    """One sub-step (absorb, then predict on the block's last sub-step): (m, P, log Z, bad, G⁻¹) with bad = 1
    when ``|G|`` is not positive (lost definiteness). ``x = (block, predict, A, Λ blocks, η)``."""
    b, move, A, Ls, e = x
    U = apply_B(t, P, A).T
    mu = apply_B(t, m[:, None], A)[:, 0]
    C = sym(apply_B(t, U, A))
    (Giv, GiL, logZ), sign, Z = absorb_small(mu, C, blockdiag(Ls), e)
    m = m + U @ Giv
    P = P - U @ (GiL @ U.T)
    m, P = predict(m, P, b, move, t, T, Qb)
    return m, P, logZ, (sign <= 0).astype(jnp.int32), Z


def scan_inputs(t: RunTables, A, Ls, e):
    """The scan's per-sub-step inputs, chunked: (block, predict, A, Λ blocks, η), each (n_chunks, chunk, ...)."""
    xs = (jnp.asarray(t.block_index), jnp.asarray(t.predict), A, Ls, e)
    return jax.tree_util.tree_map(lambda a: a.reshape((t.n_chunks, t.chunk) + a.shape[1:]), xs)


def run_loglik_sequential(theta, run):
    """Log likelihood of one run by the chunked block scan, differentiated by JAX; (value, bad-step count)."""
    t: RunTables = run.tables
    A, Ls, e, const = step_tables(theta, run)
    T, Qb, Pinf = block_transition(theta, t)
    m0, P0 = initial_state(t, T, Qb, Pinf)

    def chunk_fn(carry, xc, T, Qb):
        def body(c, x):
            m, P, ll, bad = c
            m, P, logZ, b, _ = forward_step(t, m, P, x, T, Qb)
            return (m, P, ll + logZ, bad + b), None

        return lax.scan(body, carry, xc)[0]

    if t.checkpoint:
        chunk_fn = jax.checkpoint(chunk_fn)
    carry0 = (m0, P0, jnp.zeros(()), jnp.zeros((), jnp.int32))
    (_, _, ll, bad), _ = lax.scan(lambda c, xc: (chunk_fn(c, xc, T, Qb), None), carry0, scan_inputs(t, A, Ls, e))
    return -0.5 * const + ll, bad
