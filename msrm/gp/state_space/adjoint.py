r"""Hand-written reverse mode of the block filter (the adjoint form of the Kalman-filter gradient).

Reverse-mode autodiff through ``lax.scan`` differentiates every S x S operation of a sub-step, stores or
recomputes the intermediates of all of them and transposes each row or column write into a full-size copy.
Here the scan has a ``jax.custom_vjp`` whose backward pass carries only the adjoints ``(m̄, P̄)`` of the
filtered mean and covariance (``P̄`` symmetric to rounding), sub-step by sub-step in reverse:

* **absorb** ``m' = m + U G⁻¹v``, ``P' = P − U W Uᵀ`` with ``U = P Bᵀ``, ``W = G⁻¹Λ`` (formed in the
  whitened form of :func:`.filter.absorb_state`): with ``Y = P̄' U`` (the one dense S x S x MK product of the
  sub-step),

  .. math::

      Ū = m̄' (G^{-1}v)^\top - 2 Y W + B^\top \bar C, \qquad \bar W = -U^\top Y, \qquad
      \bar P = \bar P' + \mathrm{sym}(B^\top Ū^\top),\qquad \bar m = \bar m' + B^\top \bar μ,

  where ``(μ̄, C̄, R̄, ỹ̄)`` come from the small (MK x MK) part (:func:`.filter.white_vjp`, in the nodes'
  information factors ``R`` and whitened data ``ỹ``, whose adjoints round at the size of the result). ``B`` is
  the sub-step's weight matrix ``A`` (M, N + n) over the ring and bank rows, so ``Bᵀ Ūᵀ`` is ``Aᵀ`` times
  ``Ūᵀ`` added to those rows (and, symmetrised, columns), and ``Ā`` is ``Ūᵀ`` against the same rows of ``P``
  (:func:`.filter.absorb_vjp`, :func:`.filter.weight_vjp`: the host filter runs the same functions on NumPy).
* **predict** is ``P ← F P Fᵀ + Q_f`` with ``F`` the identity except the rows it writes: the SDE write
  (``y = T s``) and, with a bank, the bank move. Its transpose ``P̄ ↦ Fᵀ P̄ F`` touches those rows and
  columns only, and ``T̄ = 2 (P̄' F P)[y, s] + m̄'_y m_sᵀ``, ``Q̄_b = P̄'[y, y]`` (per factor) need only
  ``P[:, s]``, the SDE columns of the absorbed covariance (formed as the forward pass forms them, ``P − VᵀV``).

Memory: the forward pass keeps the state ``(m, P)`` at the start of each checkpointed chunk; the backward pass
recomputes one chunk at a time (keeping that chunk's per-sub-step states) and runs the adjoint over it, so
residual memory grows with ``n_chunks + chunk`` S x S matrices (:func:`.prepare.auto_chunk` picks the chunks:
one, keeping every state, when they fit its budget, else about sqrt(sub-steps) of them). With
``checkpoint_every=0`` there is always one chunk. The result equals, to rounding, the gradient JAX's own reverse
mode takes through the same scan (the oracle of the tests).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .filter import (absorb_vjp, bank_block_moved, bank_rows, block_transition, blockdiag, col_block, event_code,
                     forward_step, initial_state, moved_transition, node_moments, ring_base, row_block, scan_inputs,
                     step_tables, weight_vjp)
from .prepare import RunTables

__all__ = ["run_loglik_adjoint"]


def _sde_write_transpose(t: RunTables, b, move, mb, Pb, T, Qb, Xs, ms):
    """Adjoint of :func:`msrm.gp.state_space.filter.sde_write`.

    Args:
        mb, Pb: adjoints after the write; T (K, Y, d), Q_b: as given to the write; Xs (S, d K), ms (d K,): the
            SDE columns of the covariance and the SDE mean just before the write.
    Returns:
        (mb, Pb) before the write, T̄ (K, Y, d), Q̄_b (K, Y, Y) (zero unless ``move``).
    """
    K, C, d, S = t.K, t.block, t.d, Pb.shape[0]
    T, _ = moved_transition(t, move, T, Qb)
    s0, r1 = jnp.asarray(t.sde_offset, jnp.int32), ring_base(t, b + 1) * K
    zero = jnp.zeros((), jnp.int32)
    Y = C + d
    # F P restricted to the SDE columns: rows y replaced by T P[s, s]
    FX = jnp.einsum("kyi,ikc->ykc", T, row_block(Xs, s0, d * K).reshape(d, K, d * K))
    FPs = lax.dynamic_update_slice(Xs, FX[:C].reshape(C * K, d * K), (r1, zero))
    FPs = lax.dynamic_update_slice(FPs, FX[C:].reshape(d * K, d * K), (s0, zero))
    Wr, Ws = row_block(Pb, r1, C * K), row_block(Pb, s0, d * K)
    Wy = jnp.concatenate([Wr, Ws]).reshape(Y, K, S)
    G = jnp.einsum("yks,sil->ykil", Wy, FPs.reshape(S, d, K))
    my = jnp.concatenate([row_block(mb, r1, C * K), row_block(mb, s0, d * K)]).reshape(Y, K)
    Tb = 2.0 * jnp.einsum("ykik->kyi", G) + jnp.einsum("yk,ik->kyi", my, ms.reshape(d, K))
    Wy2 = Wy.reshape(Y * K, S)
    Wyy = jnp.concatenate([col_block(Wy2, r1, C * K), col_block(Wy2, s0, d * K)], axis=1)
    Qbb = jnp.einsum("ykzl,kl->kyz", Wyy.reshape(Y, K, Y, K), jnp.eye(K))
    # Fᵀ P̄ F: rows, then columns (the ring rows are dropped by a write, kept otherwise)
    Pb = lax.dynamic_update_slice(Pb, jnp.where(move, 0.0, Wr), (r1, zero))
    Pb = lax.dynamic_update_slice(Pb, jnp.einsum("kyi,yks->iks", T, Wy).reshape(d * K, S), (s0, zero))
    Vr = col_block(Pb, r1, C * K)
    Vy = jnp.concatenate([Vr, col_block(Pb, s0, d * K)], axis=1).reshape(S, Y, K)
    Pb = lax.dynamic_update_slice(Pb, jnp.where(move, 0.0, Vr), (zero, r1))
    Pb = lax.dynamic_update_slice(Pb, jnp.einsum("syk,kyi->sik", Vy, T).reshape(S, d * K), (zero, s0))
    mb = lax.dynamic_update_slice(mb, jnp.where(move, 0.0, row_block(mb, r1, C * K)), (r1,))
    mb = lax.dynamic_update_slice(mb, jnp.einsum("kyi,yk->ik", T, my).reshape(-1), (s0,))
    return mb, Pb, jnp.where(move, Tb, 0.0), jnp.where(move, Qbb, 0.0)


def _bank_rows_transpose(t: RunTables, b, move, X):
    """Eᵀ X for the bank move E (rows of X (S, r))."""
    Mc, Vc = bank_block_moved(t, move)
    K, n, C, r = t.K, t.n_bank, t.block, X.shape[1]
    b0, rb = jnp.asarray(t.bank_offset, jnp.int32), ring_base(t, b) * K
    zero = jnp.zeros((), jnp.int32)
    Xb = row_block(X, b0, n * K).reshape(n, K, r)
    ring = row_block(X, rb, C * K) + jnp.einsum("il,ikr->lkr", Vc, Xb).reshape(C * K, r)
    X = lax.dynamic_update_slice(X, ring, (rb, zero))
    return lax.dynamic_update_slice(X, jnp.einsum("ij,ikr->jkr", Mc, Xb).reshape(n * K, r), (b0, zero))


def _backward_step(t: RunTables, m, P, L, mb, Pb, gll, x, T, Qb):
    """Adjoint of one sub-step.

    Args:
        m, P: the state before the sub-step (primal); L: its Cholesky factor of ``G_s``
            (:func:`.filter.absorb_state`); mb, Pb:
            adjoints of the state after it; gll: adjoint of the log likelihood; x: the sub-step's inputs (block,
            predict, A, R blocks, ỹ).
    Returns:
        (mb, Pb) before the sub-step, (Ā, R̄ blocks, ỹ̄) of the sub-step, (T̄, Q̄_b).
    """
    b, move, A, Rs, ys = x
    K, Kd, s0 = t.K, t.K * t.d, t.sde_offset
    Rb = blockdiag(Rs)
    U, mu, C = node_moments(t, A, m, P)
    X = lax.linalg.triangular_solve(L, jnp.concatenate([Rb, (ys - Rb @ mu)[:, None]], axis=1), left_side=True,
                                    lower=True)
    W, u = X[:, :-1], X[:, -1]
    GiL = W.T @ W
    Giv = W.T @ u

    # the prediction's transpose (the identity on a sub-step that does not predict), from the SDE columns and
    # mean of the absorbed state, formed as the forward pass forms them (P − VᵀV, m + Vᵀu)
    V = W @ U.T
    Vs = V[:, s0 : s0 + Kd]
    Xs = P[:, s0 : s0 + Kd] - V.T @ Vs
    ms = m[s0 : s0 + Kd] + Vs.T @ u
    if t.n_bank:
        Xs = bank_rows(t, b, move, Xs)
    mb, Pb, Tb, Qbb = _sde_write_transpose(t, b, move, mb, Pb, T, Qb, Xs, ms)
    if t.n_bank:
        Pb = _bank_rows_transpose(t, b, move, _bank_rows_transpose(t, b, move, Pb).T)
        mb = _bank_rows_transpose(t, b, move, mb[:, None])[:, 0]

    # absorb
    k = dict(A=A, U=U, mu=mu, Cm=C, Rb=Rb, y=ys, L=L, W=W, u=u, Giv=Giv, GiL=GiL)
    mb, Pb, parts, Rbb, yb = absorb_vjp(t, k, mb, Pb, gll)
    M = Rs.shape[0]
    Rs_b = jnp.einsum("minj,mn->mij", Rbb.reshape(M, K, M, K), jnp.eye(M))
    return mb, Pb, (weight_vjp(t, parts, U, m, P), Rs_b, yb), (Tb, Qbb)


def _make_core(t: RunTables):
    """The chunked scan as a custom-VJP function of (A, R blocks, ỹ, T, Q_b, P∞) -> (sum of log Z'
    (:func:`.filter.white_values`), event code (:func:`.filter.event_code`, as float64))."""

    def chunk_forward(carry, xc, T, Qb, keep):
        def body(c, x):
            m, P, ll, bad, kap = c
            m2, P2, logZ, b, k, Z = forward_step(t, m, P, x, T, Qb)
            return (m2, P2, ll + logZ, bad + b, jnp.maximum(kap, k)), ((m, P, Z) if keep else None)

        return lax.scan(body, carry, xc)

    def run(A, Rs, ys, T, Qb, Pinf):
        m0, P0 = initial_state(t, T, Qb, Pinf)
        carry0 = (m0, P0, jnp.zeros(()), jnp.zeros((), jnp.int32), jnp.ones(()))

        def outer(c, xc):
            c2, _ = chunk_forward(c, xc, T, Qb, False)
            return c2, (c[0], c[1])

        (_, _, ll, bad, kap), starts = lax.scan(outer, carry0, scan_inputs(t, A, Rs, ys))
        return ll, event_code(bad, kap), starts

    @jax.custom_vjp
    def core(A, Rs, ys, T, Qb, Pinf):
        ll, bad, _ = run(A, Rs, ys, T, Qb, Pinf)
        return ll, bad.astype(jnp.float64)

    def core_fwd(A, Rs, ys, T, Qb, Pinf):
        ll, bad, starts = run(A, Rs, ys, T, Qb, Pinf)
        return (ll, bad.astype(jnp.float64)), (starts, A, Rs, ys, T, Qb, Pinf)

    def core_bwd(res, cts):
        starts, A, Rs, ys, T, Qb, Pinf = res
        gll = cts[0]
        S = starts[1].shape[-1]

        def outer(c, inp):
            start_m, start_P, xc = inp
            zero = (jnp.zeros(()), jnp.zeros((), jnp.int32), jnp.ones(()))
            _, (ms, Ps, Zs) = chunk_forward((start_m, start_P) + zero, xc, T, Qb, True)

            def body(c2, item):
                mb, Pb, Tb, Qbb = c2
                m, P, Z, x = item
                mb, Pb, xb, (dT, dQ) = _backward_step(t, m, P, Z, mb, Pb, gll, x, T, Qb)
                return (mb, Pb, Tb + dT, Qbb + dQ), xb

            return lax.scan(body, c, (ms, Ps, Zs, xc), reverse=True)

        c0 = (jnp.zeros(S), jnp.zeros((S, S)), jnp.zeros_like(T), jnp.zeros_like(Qb))
        xs = scan_inputs(t, A, Rs, ys)
        (mb, Pb, Tb, Qbb), (Ab, Rsb, yb) = lax.scan(outer, c0, (starts[0], starts[1], xs), reverse=True)
        _, init_vjp = jax.vjp(lambda T_, Q_, P_: initial_state(t, T_, Q_, P_), T, Qb, Pinf)
        Tb0, Qb0, Pinfb = init_vjp((mb, Pb))
        flat = lambda x, like: x.reshape(like.shape)
        return flat(Ab, A), flat(Rsb, Rs), flat(yb, ys), Tb + Tb0, Qbb + Qb0, Pinfb

    core.defvjp(core_fwd, core_bwd)
    return core


def _make_core_host(t: RunTables):
    """The same custom-VJP function, computed on the host by :class:`.host.HostFilter` through
    ``jax.pure_callback`` (the initial state and its adjoint stay in JAX).

    The value alone is one callback. Under differentiation the forward rule makes one callback that returns the
    value and the adjoints at cotangent 1 (:meth:`.host.HostFilter.value_and_grad`): the reverse pass is linear
    in the cotangent, so the backward rule only scales them. The states the reverse pass reads are then still in
    memory when it starts; nothing crosses into XLA as residuals but the adjoints themselves."""
    from .host import HostFilter, one_blas_thread

    from ... import runtime

    hf = HostFilter(t)
    S, f64 = t.n_states, jnp.float64
    pipeline = runtime.physical_cores() >= 2 and hf.pipeline_pays

    def value(A, Rs, ys, T, Qb, m0, P0):
        with one_blas_thread():
            ll, bad = hf.forward(*(np.asarray(x) for x in (A, Rs, ys, T, Qb, m0, P0)), keep_starts=False)
        return np.float64(ll), np.float64(bad)

    def value_and_grad(A, Rs, ys, T, Qb, m0, P0):
        with one_blas_thread():
            ll, bad, grads = hf.value_and_grad(*(np.asarray(x) for x in (A, Rs, ys, T, Qb, m0, P0)),
                                               pipeline=pipeline)
        return (np.float64(ll), np.float64(bad)) + tuple(grads)

    scalar = jax.ShapeDtypeStruct((), f64)

    def call(fn, shapes, *args):
        return jax.pure_callback(fn, shapes, *args, vmap_method="sequential")

    @jax.custom_vjp
    def core(A, Rs, ys, T, Qb, Pinf):
        m0, P0 = initial_state(t, T, Qb, Pinf)
        return call(value, (scalar, scalar), A, Rs, ys, T, Qb, m0, P0)

    def core_fwd(A, Rs, ys, T, Qb, Pinf):
        m0, P0 = initial_state(t, T, Qb, Pinf)
        like = lambda x: jax.ShapeDtypeStruct(x.shape, f64)
        shapes = (scalar, scalar, like(A), like(Rs), like(ys), like(T), like(Qb), jax.ShapeDtypeStruct((S,), f64),
                  jax.ShapeDtypeStruct((S, S), f64))
        ll, bad, *grads = call(value_and_grad, shapes, A, Rs, ys, T, Qb, m0, P0)
        return (ll, bad), (grads, T, Qb, Pinf)

    def core_bwd(res, cts):
        (Ab, Rsb, yb, Tb, Qbb, mb, Pb), T, Qb, Pinf = res
        g = cts[0]
        _, init_vjp = jax.vjp(lambda T_, Q_, P_: initial_state(t, T_, Q_, P_), T, Qb, Pinf)
        Tb0, Qb0, Pinfb = init_vjp((g * mb, g * Pb))
        return g * Ab, g * Rsb, g * yb, g * Tb + Tb0, g * Qbb + Qb0, Pinfb

    core.defvjp(core_fwd, core_bwd)
    return core


def run_loglik_adjoint(theta, run):
    """Log likelihood of one run by the chunked block scan with the hand-written reverse mode (on the host with
    ``method="callback"``, in XLA otherwise); (value, bad-step count)."""
    t: RunTables = run.tables
    A, Rs, ys, data_term = step_tables(theta, run)
    T, Qb, Pinf = block_transition(theta, t)
    core = _make_core_host(t) if t.method == "callback" else _make_core(t)
    ll, bad = core(A, Rs, ys, T, Qb, Pinf)
    return -0.5 * data_term + ll, lax.stop_gradient(bad).astype(jnp.int32)
