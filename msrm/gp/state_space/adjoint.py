r"""Hand-written reverse mode of the sequential filter (the adjoint form of the Kalman-filter gradient).

Reverse-mode autodiff through ``lax.scan`` differentiates every S x S operation of a step, stores or recomputes
the intermediates of all of them and transposes the slice updates of the delay line into full-size copies.
Here the scan has a ``jax.custom_vjp`` whose backward pass carries only the adjoints ``(m̄, P̄)`` of the
filtered mean and covariance, step by step in reverse:

* **absorb** ``m' = m + U G⁻¹v``, ``P' = P − U W Uᵀ`` with ``U = P Bᵀ``, ``W = sym(G⁻¹Λ)``: with
  ``Y = P̄' U`` (the one dense S x S x MK product of the step),

  .. math::

      Ū = m̄' (G^{-1}v)^\top - 2 Y W + B^\top \bar C, \qquad \bar W = -U^\top Y, \qquad
      \bar P = \bar P' + \mathrm{sym}(B^\top Ū^\top),\qquad \bar m = \bar m' + B^\top \bar μ,

  where ``(μ̄, C̄, Λ̄, η̄)`` come from the small (MK x MK) part of the step (``G``, its solve and log
  determinant), differentiated by JAX. ``B`` is never formed: the step's ring-mode nodes read the delay line
  through one (M, L + C) weight matrix over the buffer's slots (a product with a static row block of the
  state), so ``Bᵀ Ūᵀ`` is that weight matrix's transpose times ``Ūᵀ`` added to those rows (and, symmetrised,
  columns), and the weights' adjoint is ``Ūᵀ`` against the same rows of ``P``.
* **predict** is linear in ``(m, P)`` (the delay-line write is a row/column copy, the SDE step touches ``K d``
  rows, the rebase is a copy): its transpose maps ``P̄ ↦ Tᵀ P̄ T`` by slices, and ``Φ̄, Q̄`` need only the
  ``K d`` SDE rows of the filtered state. (With a filter bank the prediction's transpose is left to JAX.)

Memory: the forward pass keeps the state ``(m, P)`` at the start of each checkpointed chunk; the backward pass
recomputes one chunk at a time (keeping that chunk's per-step states) and runs the adjoint over it, so
residual memory grows with ``n_chunks + chunk`` (≈ 2 sqrt(steps)) S x S matrices, as in the autodiff path.
With ``checkpoint_every=0`` there is one chunk (every step's state is kept). The result equals the autodiff
gradient to rounding (tested).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .filter import (group_readouts, initial_state, node_arrays, predict, slot_information, transition_blocks)
from .prepare import RunTables

__all__ = ["run_loglik_adjoint"]


def _sym(X):
    return 0.5 * (X + X.T)


def _weights(t: RunTables, j, a_groups):
    """The step's readout as dense weights: ``(A_ring (M_r, L + C), a_cur (M_r,), a_bank tuple)``.

    A ring-mode node of width w ending at step j weighs the current values (rows 0..K-1) by its last weight and
    buffer slots ``L - w + 1 + j mod C ..`` by the others; all ring nodes share one (M_r, L + C) weight matrix
    over the whole buffer, so reading is one matrix product with a static row block of the state.
    """
    n_slots = t.L + t.rebase
    ring, cur, bank = [], [], []
    for g, a in zip(t.groups, a_groups):
        if g.mode == "bank":
            bank.append(a)
            continue
        w = g.width
        cur.append(a[:, w - 1])
        row = jnp.zeros((a.shape[0], n_slots))
        if w > 1:
            s0 = (t.L - w + 1 + j % t.rebase).astype(jnp.int32)
            row = lax.dynamic_update_slice(row, a[:, : w - 1], (jnp.zeros((), jnp.int32), s0))
        ring.append(row)
    if not ring:
        return jnp.zeros((0, n_slots)), jnp.zeros(0), tuple(bank)
    return jnp.concatenate(ring), jnp.concatenate(cur), tuple(bank)


def _apply_B(t: RunTables, X, wts):
    """Stacked node map ``B X`` (M K, r), nodes in group order (ring groups first as in the slot tables)."""
    Aring, acur, abank = wts
    K, r0, nS = t.K, t.ring_offset, t.L + t.rebase
    r = X.shape[1]
    out, i = [], 0
    ring = (Aring @ X[r0 : r0 + nS * K].reshape(nS, K * r)).reshape(-1, K, r) + acur[:, None, None] * X[None, :K]
    bank_iter = iter(abank)
    for g in t.groups:
        if g.mode == "bank":
            a = next(bank_iter)
            b0, n = t.bank_offset, t.n_bank
            out.append(jnp.einsum("ikx,mi->mkx", X[b0 : b0 + n * K].reshape(n, K, r), a).reshape(-1, r))
        else:
            Mg = g.n_slots
            out.append(ring[i : i + Mg].reshape(-1, r))
            i += Mg
    return jnp.concatenate(out)


def _small(mu, C, Lb, e):
    """The MK x MK part of an absorb: (G⁻¹v, sym(G⁻¹Λ), log Z) and the sign of |G|."""
    G = jnp.eye(C.shape[0]) + Lb @ C
    v = e - Lb @ mu
    X = jnp.linalg.solve(G, jnp.concatenate([Lb, v[:, None]], axis=1))
    GiL, Giv = _sym(X[:, :-1]), X[:, -1]
    sign, logdet = jnp.linalg.slogdet(G)
    logZ = -0.5 * mu @ (Lb @ mu) + e @ mu + 0.5 * v @ (C @ Giv) - 0.5 * logdet
    return (Giv, GiL, logZ), sign


def _step_inputs(x, readouts, Lam, eta):
    j, move, slots = x
    a_groups = [R[loc] for R, (loc, _) in zip(readouts, slots)]
    Lb, e = slot_information(Lam, eta, jnp.concatenate([gl for _, gl in slots]))
    return j, move, a_groups, Lb, e


def _forward_step(t: RunTables, m, P, x, readouts, Lam, eta, blocks):
    """One sub-step (absorb, then predict on the last sub-step of a grid step): (m, P, log Z, bad)."""
    j, move, a_groups, Lb, e = _step_inputs(x, readouts, Lam, eta)
    wts = _weights(t, j, a_groups)
    U = _apply_B(t, P, wts).T
    mu = _apply_B(t, m[:, None], wts)[:, 0]
    C = _sym(_apply_B(t, U, wts))
    (Giv, GiL, logZ), sign = _small(mu, C, Lb, e)
    m = m + U @ Giv
    P = P - U @ (GiL @ U.T)
    m, P = lax.cond(move, lambda mp: predict(mp[0], mp[1], j, t, blocks), lambda mp: mp, (m, P))
    return m, P, logZ, (sign <= 0).astype(jnp.int32)


def _read_transpose(t: RunTables, wts, Ubt, P):
    """For the readout ``Uᵀ = B P`` and its cotangent ``Ūᵀ`` (n, S): the row blocks of ``Bᵀ Ūᵀ`` (current
    rows (K, S), ring buffer ((L + C) K, S), bank rows (n_bank K, S) or None) and the adjoint of the weights."""
    Aring, acur, abank = wts
    K, S, r0, nS = t.K, Ubt.shape[1], t.ring_offset, t.L + t.rebase
    Mr = Aring.shape[0]
    U3 = Ubt.reshape(-1, K, S)
    ring_idx, bank_parts, i, k = [], [], 0, 0
    for g in t.groups:
        Mg = g.n_slots
        if g.mode == "bank":
            bank_parts.append((U3[i : i + Mg], abank[k]))
            k += 1
        else:
            ring_idx.append(U3[i : i + Mg])
        i += Mg
    Ur = jnp.concatenate(ring_idx) if ring_idx else jnp.zeros((0, K, S))  # (Mr, K, S)
    Pring = P[r0 : r0 + nS * K].reshape(nS, K * S)
    Zring = (Aring.T @ Ur.reshape(Mr, K * S)).reshape(nS * K, S)
    Zcur = jnp.einsum("m,mkx->kx", acur, Ur)
    Aring_b = jnp.einsum("mkx,pkx->mp", Ur, Pring.reshape(nS, K, S))  # (a matmul with Pring.T copies it)
    acur_b = jnp.einsum("mkx,kx->m", Ur, P[:K])
    Zbank, abank_b = None, []
    if bank_parts:
        b0, n = t.bank_offset, t.n_bank
        Pbank = P[b0 : b0 + n * K].reshape(n, K, S)
        Zbank = sum(jnp.einsum("mi,mkx->ikx", a, Ug) for Ug, a in bank_parts).reshape(n * K, S)
        abank_b = [jnp.einsum("mkx,ikx->mi", Ug, Pbank) for Ug, _ in bank_parts]
    return Zcur, Zring, Zbank, (Aring_b, acur_b, tuple(abank_b))


def _add_sym_rows(Pb, r, Z):
    """Pb += ½ (E_rᵀ Z + Zᵀ E_r) for the row block Z starting at row r (in place on the carry)."""
    n, S = Z.shape
    zero = jnp.zeros((), jnp.int32)
    Pb = lax.dynamic_update_slice(Pb, lax.dynamic_slice(Pb, (r, zero), (n, S)) + 0.5 * Z, (r, zero))
    Pb = lax.dynamic_update_slice(Pb, lax.dynamic_slice(Pb, (zero, r), (S, n)) + 0.5 * Z.T, (zero, r))
    return Pb


def _predict_transpose(t: RunTables, j, mb, Pb, Phi, m_rows, A_rows):
    """Adjoint of :func:`msrm.gp.state_space.filter.predict` (delay-line layout without a bank), by slices.

    Args:
        mb, Pb: adjoints after the prediction; m_rows (K d,), A_rows (K d, S): the SDE rows of the mean and
            covariance just before the SDE step (after the delay-line write).
    Returns:
        (mb, Pb) before the prediction, Φ̄, Q̄.
    """
    K, Kd, L, C, r0 = t.K, t.K * t.d, t.L, t.rebase, t.ring_offset
    S = Pb.shape[0]

    def unrebase(mp):
        mb, Pb = mp
        LK, CK = L * K, C * K

        def tr(X, axis):  # the rebase's transpose along one axis (buffer rows r0 .. r0 + (L + C) K)
            block = lax.slice_in_dim(X, r0, r0 + (L + C) * K, axis=axis)
            low = lax.slice_in_dim(block, 0, LK, axis=axis)
            top = lax.slice_in_dim(block, LK, (L + C) * K, axis=axis)
            shape = list(block.shape)
            shape[axis] = CK
            new = jnp.concatenate([jnp.zeros(shape), low], axis=axis)
            new = new + jnp.concatenate([jnp.zeros_like(low), top], axis=axis)
            return lax.dynamic_update_slice_in_dim(X, new, r0, axis=axis)

        return tr(mb, 0), tr(tr(Pb, 0), 1)

    mb, Pb = lax.cond((j + 1) % C == 0, unrebase, lambda mp: mp, (mb, Pb))
    # SDE step: rows P[:Kd] <- Phi P[:Kd], then columns P[:, :Kd] <- P[:, :Kd] Phi^T, then + Q
    Qb = Pb[:Kd, :Kd]
    cols_T = A_rows.at[:, :Kd].set(A_rows[:, :Kd] @ Phi.T)  # Pint[:, :Kd]^T, Pint = after the row step
    colsb = Pb[:, :Kd]
    Phib = colsb.T @ cols_T.T
    Pb = Pb.at[:, :Kd].set(colsb @ Phi)
    rowsb = Pb[:Kd, :]
    Phib = Phib + rowsb @ A_rows.T
    Pb = Pb.at[:Kd, :].set(Phi.T @ rowsb)
    Phib = Phib + jnp.outer(mb[:Kd], m_rows)
    mb = mb.at[:Kd].set(Phi.T @ mb[:Kd])
    # delay-line write: rows r <- rows :K, then columns r <- columns :K
    r = (r0 + (L + j % C) * K).astype(jnp.int32)
    zero = jnp.zeros((), jnp.int32)
    colr = lax.dynamic_slice(Pb, (zero, r), (S, K))
    Pb = Pb.at[:, :K].add(colr)
    Pb = lax.dynamic_update_slice(Pb, jnp.zeros((S, K)), (zero, r))
    rowr = lax.dynamic_slice(Pb, (r, zero), (K, S))
    Pb = Pb.at[:K, :].add(rowr)
    Pb = lax.dynamic_update_slice(Pb, jnp.zeros((K, S)), (r, zero))
    mr = lax.dynamic_slice(mb, (r,), (K,))
    mb = lax.dynamic_update_slice(mb.at[:K].add(mr), jnp.zeros(K), (r,))
    return mb, Pb, Phib, Qb


def _backward_step(t: RunTables, m, P, mb, Pb, gll, x, readouts, Lam, eta, blocks):
    """Adjoint of one sub-step.

    Args:
        m, P: the state before the sub-step (primal); mb, Pb: adjoints of the state after it; gll: adjoint of
            the log likelihood.
    Returns:
        (mb, Pb) before the sub-step, per-group readout-weight adjoints, (Λ̄ blocks (M, K, K), η̄ (M, K)),
        (Φ̄, Q̄).
    """
    j, move, a_groups, Lb, e = _step_inputs(x, readouts, Lam, eta)
    wts, wts_vjp = jax.vjp(lambda a: _weights(t, j, a), a_groups)
    K, Kd, S = t.K, t.K * t.d, P.shape[0]
    Phi, Q, Pinf = blocks
    U = _apply_B(t, P, wts).T  # (S, n)
    mu = _apply_B(t, m[:, None], wts)[:, 0]
    C = _sym(_apply_B(t, U, wts))
    (Giv, GiL, _), small_vjp, _ = jax.vjp(_small, mu, C, Lb, e, has_aux=True)
    rows = P[:Kd] - (U[:Kd] @ GiL) @ U.T  # SDE rows of the absorbed covariance
    m_rows = m[:Kd] + U[:Kd] @ Giv

    if t.n_bank:
        # banks: the prediction's transpose by JAX (the primal handed over is P with its SDE rows and columns
        # replaced by the absorbed ones; nothing else of it is read)
        P_sde = P.at[:Kd, :].set(rows).at[:, :Kd].set(rows.T)
        m_sde = m.at[:Kd].set(m_rows)

        def through(args):
            _, vjp = jax.vjp(lambda m_, P_, Phi_, Q_: predict(m_, P_, j, t, (Phi_, Q_, Pinf)), m_sde, P_sde, Phi, Q)
            return vjp(args)
    else:
        r = (t.ring_offset + (t.L + j % t.rebase) * K).astype(jnp.int32)
        A_rows = lax.dynamic_update_slice(rows, rows[:, :K], (jnp.zeros((), jnp.int32), r))

        def through(args):
            return _predict_transpose(t, j, args[0], args[1], Phi, m_rows, A_rows)

    def skip(args):
        return args[0], args[1], jnp.zeros_like(Phi), jnp.zeros_like(Q)

    mb, Pb, Phib, Qb = lax.cond(move, through, skip, (mb, Pb))

    # absorb
    Y = Pb @ U  # the dense product of the step
    Ub = mb[:, None] * Giv[None, :] - 2.0 * Y @ GiL
    GiLb = -(U.T @ Y)
    Givb = U.T @ mb
    mub, Cb, Lbb, eb = small_vjp((Givb, GiLb, gll))
    Cb = _sym(Cb)
    # C = B U and mu = B m: the readers' VJPs on small arguments
    _, vjp_C = jax.vjp(lambda X, w: _apply_B(t, X, w), U, wts)
    UbC, wb_C = vjp_C(Cb)
    Ub = Ub + UbC
    _, vjp_mu = jax.vjp(lambda X, w: _apply_B(t, X, w), m[:, None], wts)
    mb_mu, wb_mu = vjp_mu(mub[:, None])
    mb = mb + mb_mu[:, 0]
    # U^T = B P: scatter B^T Ub^T into the rows (and, symmetrised, the columns) the nodes read
    Zcur, Zring, Zbank, wb_P = _read_transpose(t, wts, Ub.T, P)
    zero = jnp.zeros((), jnp.int32)
    Pb = _add_sym_rows(Pb, zero, Zcur)
    Pb = _add_sym_rows(Pb, jnp.asarray(t.ring_offset, jnp.int32), Zring)
    if Zbank is not None:
        Pb = _add_sym_rows(Pb, jnp.asarray(t.bank_offset, jnp.int32), Zbank)
    wb = jax.tree_util.tree_map(lambda x, y, z: x + y + z, wb_C, wb_mu, wb_P)
    (ab,) = wts_vjp(wb)
    M = Lbb.shape[0] // K
    Lam_b = jnp.einsum("minj,mn->mij", Lbb.reshape(M, K, M, K), jnp.eye(M))
    return mb, Pb, ab, (Lam_b, eb.reshape(M, K)), (Phib, Qb)


def _make_core(t: RunTables, xs):
    """The chunked scan as a custom-VJP function of (readouts, Lam, eta, Phi, Q, Pinf) -> (log Z sum, bad)."""

    def chunk_forward(carry, xc, consts, keep):
        readouts, Lam, eta, blocks = consts

        def body(c, x):
            m, P, ll, bad = c
            m2, P2, logZ, b = _forward_step(t, m, P, x, readouts, Lam, eta, blocks)
            return (m2, P2, ll + logZ, bad + b), ((m, P) if keep else None)

        return lax.scan(body, carry, xc)

    def run(readouts, Lam, eta, Phi, Q, Pinf):
        blocks = (Phi, Q, Pinf)
        m0, P0 = initial_state(None, t, blocks)
        consts = (readouts, Lam, eta, blocks)
        carry0 = (m0, P0, jnp.zeros(()), jnp.zeros((), jnp.int32))

        def outer(c, xc):
            c2, _ = chunk_forward(c, xc, consts, False)
            return c2, (c[0], c[1])

        (_, _, ll, bad), starts = lax.scan(outer, carry0, xs)
        return ll, bad, starts

    @jax.custom_vjp
    def core(readouts, Lam, eta, Phi, Q, Pinf):
        ll, bad, _ = run(readouts, Lam, eta, Phi, Q, Pinf)
        return ll, bad.astype(jnp.float64)

    def core_fwd(readouts, Lam, eta, Phi, Q, Pinf):
        ll, bad, starts = run(readouts, Lam, eta, Phi, Q, Pinf)
        return (ll, bad.astype(jnp.float64)), (starts, readouts, Lam, eta, Phi, Q, Pinf)

    def core_bwd(res, cts):
        starts, readouts, Lam, eta, Phi, Q, Pinf = res
        gll = cts[0]
        blocks = (Phi, Q, Pinf)
        consts = (readouts, Lam, eta, blocks)
        S = starts[1].shape[-1]

        def outer(c, inp):
            mb, Pb, Phib, Qb = c
            start_m, start_P, xc = inp
            zero = (jnp.zeros(()), jnp.zeros((), jnp.int32))
            _, (ms, Ps) = chunk_forward((start_m, start_P) + zero, xc, consts, True)

            def body(c2, item):
                mb, Pb, Phib, Qb = c2
                m, P, x = item
                mb, Pb, ab, lam_eta, (dPhi, dQ) = _backward_step(t, m, P, mb, Pb, gll, x, readouts, Lam, eta,
                                                                 blocks)
                return (mb, Pb, Phib + dPhi, Qb + dQ), (ab, lam_eta)

            c2, per_step = lax.scan(body, (mb, Pb, Phib, Qb), (ms, Ps, xc), reverse=True)
            return c2, per_step

        c0 = (jnp.zeros(S), jnp.zeros((S, S)), jnp.zeros_like(Phi), jnp.zeros_like(Q))
        (mb, Pb, Phib, Qb), (ab, (Lam_bs, eta_bs)) = lax.scan(outer, c0, (starts[0], starts[1], xs), reverse=True)
        # scatter the per-step adjoints onto readouts and nodes
        slots = xs[2]
        readouts_b = []
        for R, (loc, _), a in zip(readouts, slots, ab):
            readouts_b.append(jnp.zeros_like(R).at[loc.reshape(-1)].add(a.reshape(-1, a.shape[-1])))
        glob = jnp.concatenate([gl for _, gl in slots], axis=-1).reshape(-1)
        K = Lam.shape[-1]
        Lam_b = jnp.zeros_like(Lam).at[glob].add(Lam_bs.reshape(-1, K, K))
        eta_b = jnp.zeros_like(eta).at[glob].add(eta_bs.reshape(-1, K))
        _, init_vjp = jax.vjp(lambda Pinf_: initial_state(None, t, (Phi, Q, Pinf_)), Pinf)
        (Pinfb,) = init_vjp((mb, Pb))
        return tuple(readouts_b), Lam_b, eta_b, Phib, Qb, Pinfb

    core.defvjp(core_fwd, core_bwd)
    return core


def run_loglik_adjoint(theta, run):
    """Log likelihood of one run by the chunked sequential scan with the hand-written reverse mode; (value,
    bad-step count). Same value as :func:`msrm.gp.state_space.filter.run_loglik_sequential`."""
    t: RunTables = run.tables
    Lam, eta, const = node_arrays(theta, run)
    readouts = group_readouts(theta, t)
    Phi, Q, Pinf = transition_blocks(theta, t)
    slot_xs = tuple((jnp.asarray(g.slot_local), jnp.asarray(g.slot_global)) for g in t.groups)
    xs = (jnp.asarray(t.grid_index), jnp.asarray(t.predict), slot_xs)
    xs = jax.tree_util.tree_map(lambda a: a.reshape((t.n_chunks, t.chunk) + a.shape[1:]), xs)
    ll, bad = _make_core(t, xs)(readouts, Lam, eta, Phi, Q, Pinf)
    return -0.5 * const + ll, lax.stop_gradient(bad).astype(jnp.int32)
