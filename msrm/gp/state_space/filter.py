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
   ``Rb`` = blockdiag of the nodes' information factors (``R_uᵀR_u = Λ_u``), ``ỹ`` their whitened data
   (``R_uᵀỹ_u = η_u``, :func:`node_aux`), ``μ = B m``, ``U = P Bᵀ``, ``C = B U``,
   ``G_s = I + Rb C Rbᵀ = L Lᵀ``, ``W = L⁻¹Rb``, ``u = L⁻¹(ỹ − Rb μ)``, ``V = W Uᵀ``
   (:func:`white_values`, :func:`absorb_state`):

   .. math::

       m \leftarrow m + V^\top u, \qquad P \leftarrow P - V^\top V, \qquad
       \log Z' = -\tfrac12 |u|^2 - \sum_i \log L_{ii},

   the log of ``E[exp(-|ỹ − Rb x|² / 2)]`` under the filtered law (the Kalman update ``m + U G⁻¹v``,
   ``P − U G⁻¹Λ Uᵀ`` with ``G = I + ΛC``, ``v = η − Λμ``, written so that every product rounds at the size of
   the posterior: see :func:`absorb_state` for what the information form lost). Absorbing nodes of several steps
   at once is exact because every value they read is a state variable; ``Rb`` may be singular (a one-feature
   stream at K > 1) since nothing inverts it. Padding slots have ``R = 0, ỹ = 0`` and change nothing.
2. **predict** to block ``b + 1`` (on the block's last sub-step; the other sub-steps write back what is there,
   so the scan has no branch): the bank moves ``C`` steps,
   ``xi ← M^C xi + Σ_l M^{C-1-l} v z_{bC+l}`` (a linear map of state variables, no noise), then the ``C`` new
   ring slots and the new SDE state are written as ``y = T s + ε``, ``ε ~ N(0, Q_b)`` (per factor,
   :func:`block_transition`): rows and columns ``O(S C K)``, nothing shifted.

A bank-mode node ending at step ``bC + i`` reads ``c^T xi_{bC+i} = c^T M^{i+1} xi_{bC-1} + Σ_{l ≤ i} c^T M^{i-l} v
z_{bC+l}``: the bank rows and the block's ring slots. The density is
``log p(y) = -½ data_term + Σ log Z'`` with ``data_term = n_obs log 2π + log|D| + rᵀD⁻¹r − Σ_u |ỹ_u|²`` (the
residual of the nodes' own least-squares fits, :func:`node_aux`). Per-step matrices are built inside the scan
(nothing steps x S x S is staged; the per-sub-step weights and node blocks, a few numbers per node, are built
before the scan by :func:`step_tables`). The scan runs over chunks of ``chunk`` sub-steps, each under
``jax.checkpoint``: reverse mode keeps one state per chunk and recomputes inside a chunk.
:func:`msrm.gp.state_space.loglik` runs this filter with the hand-written reverse mode of :mod:`.adjoint`, in XLA
or on the host (:mod:`.host`); the absorb's pieces are written once for both array libraries (the nodes' moments
:func:`node_moments`, the small part :func:`white_values` and its reverse :func:`white_vjp`, the reverse over the
state :func:`absorb_vjp` and :func:`weight_vjp`).

**Accuracy.** The process noise is formed without cancellation (:func:`.sde.process_noise`), the absorb in the
whitened form above, the data term by :func:`node_aux`. What float64 covariances cannot resolve is reported in
each run's event code (:func:`event_code`): a block whose nodes are far better predicted by the block's earlier
nodes than by their prior (:func:`block_conditioning`: a smooth prior against precise data, where the reverse
pass and the smoother lose ``ε κ²``), and steps whose covariance lost definiteness.

Clipped windows at the two ends of a run pile many nodes onto one block; such a block is split into sub-steps of
``M_g`` slots per group (only the last one predicts), so the slot count stays that of a typical block.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from scipy.linalg import lapack

from ...operators import jax_window_weights
from ..likelihood import group_theta, node_data, node_information, node_least_squares
from .prepare import RunTables
from .sde import discretise, process_noise, stationary_cov, transition

__all__ = ["transition_blocks", "block_transition", "bank_matrices", "bank_block", "group_readouts", "node_arrays",
           "DATA_TERM_SWITCH", "node_aux", "slot_information", "weights", "apply_B", "step_tables", "blockdiag",
           "white_values", "node_moments", "absorb_state", "white_vjp", "absorb_vjp", "weight_vjp",
           "CONDITIONING_LIMIT", "LEVEL_SHIFT", "ROUNDING_NATS", "DATA_LEVEL_SHIFT", "block_conditioning",
           "event_code", "describe_code", "bank_rows", "bank_move", "moved_transition", "sde_write", "initial_state",
           "predict", "forward_step", "scan_inputs"]


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
    ``Cov(n_i, n_{i'}) = Φ^{i-i'} Σ_{i'}`` (i ≥ i') with ``Σ_i = P∞ − Φ^i P∞ Φ^{iᵀ}`` (by
    :func:`.sde.process_noise`, which does not form that difference: it cancels when ``Δ ≪ ℓ``).

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
        Sig = process_noise(t.kernel, ell, t.step * np.arange(1, C + 1), jnp)  # Σ_1 .. Σ_C, without cancellation
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


#: mean squared standardised residual ``rᵀD⁻¹r / n_obs`` above which :func:`node_aux` forms the data term value by
#: value (:func:`msrm.gp.likelihood.node_data`) rather than as ``rᵀD⁻¹r − Σ|ỹ|²``
DATA_TERM_SWITCH = 1e4


def node_aux(theta, run):
    """What the filter reads of the data, per node: the whitened node data ``ỹ`` (N+1, K), the information
    factors ``R`` (N+1, K, K) (an all-zero padding node N; ``R_uᵀR_u = Λ_u``, ``R_uᵀỹ_u = η_u``,
    :func:`msrm.gp.likelihood.node_least_squares`), and the data term of the density without the nodes' own fit,
    ``data_term = n_obs log 2π + log|D| + rᵀD⁻¹r − Σ_u |ỹ_u|² = n_obs log 2π + log|D| + Σ (y − b − W x_u)² / σ²``
    (``x_u`` the node's least-squares fit, ``R_u x_u = ỹ_u``).

    Why this form. With ``Λ_u = R_uᵀR_u`` and ``η_u = R_uᵀỹ_u`` the node terms of the density are
    ``exp(−xᵀΛx/2 + ηᵀx) = exp(−|ỹ − Rx|²/2 + |ỹ|²/2)``, so the density is ``−data_term/2 + Σ log Z'`` with
    ``log Z' = log E[exp(−|ỹ − Rx|²/2)]`` (:func:`white_values`), and the filter never holds ``|ỹ|²/2``. The
    derivative reaches the parameters through ``R`` and ``ỹ`` (of the size of ``√Λ``) with adjoints built from
    the whitened innovation and the posterior mean; through ``Λ`` and ``η`` (of the size of ``Λ``) the adjoints
    hold ``±x δᵀ`` terms (``δ`` the posterior's small shift from the data's estimate) that must cancel to
    ``10⁻¹⁶`` of ``|δ|`` once multiplied by ``dΛ/dσ``: a noise sd's gradient was off by 10⁻⁴ of itself at noise
    ``10⁻⁴`` of the signal.

    The data term as ``rᵀD⁻¹r − Σ|ỹ|²`` cancels when the data are precise (``rᵀD⁻¹r`` is ``10¹³`` at noise
    ``10⁻⁶`` of the signal with 60 values: ``10⁻²`` nats of rounding, and its derivative in a noise sd
    ``ε rᵀD⁻¹r / σ``); summed value by value as a residual it does not, but that is a second pass over every
    observed value and its reverse (15% of a value+gradient at 1500 features per stream, K = 5). So the sum
    switches by ``lax.cond`` (one branch runs): value by value where ``rᵀD⁻¹r > DATA_TERM_SWITCH · n_obs`` (a
    mean standardised residual above 100 sds, where the difference's rounding ``ε rᵀD⁻¹r`` could reach 10⁻⁸ of the
    σ-gradient's scale ``n_obs/σ``), the difference below (where its rounding is under ``10⁻¹² n_obs`` nats).

    Cost: the per-node least squares for ``ỹ`` (K x K solves over the nodes, about 5 ms per value+gradient at 935
    nodes and K = 5 on one core, independent of the number of features) adds 5% to 10% to a value+gradient of the
    one-eighth profile (0.19 s -> 0.20 s at 1500 features per stream and K = 5; 0.061 s -> 0.068 s at 200 features
    and K = 3); it is what the whitened derivative needs, which keeps the gradient to 10⁻⁹ of itself at noise
    10⁻⁵ of the signal, where the information form was off by most of it."""
    Lam, eta, R, const = node_information(theta, run.gp)
    ytil, _ = node_least_squares(eta, R)
    data_term = _data_term(run.gp, max(int(run.gp.layout.n_obs), 1))(theta, const, ytil)
    pad = lambda a: jnp.concatenate([a, jnp.zeros((1,) + a.shape[1:])])
    return pad(ytil), pad(R), data_term


def _data_term(gp, n_obs: int):
    """``(theta, const, ỹ) -> data_term`` of :func:`node_aux` as a ``jax.custom_vjp``: both the value and the
    reverse pass take one branch by ``lax.cond`` (a plain ``lax.cond`` under differentiation allocates the
    residuals of both branches, here arrays of the size of the data, zero-filled in the branch not taken)."""

    def accurate(th):
        return node_data(th, gp)[2]

    def value(theta, const, ytil):
        return lax.cond(const > DATA_TERM_SWITCH * n_obs, lambda: accurate(theta),
                        lambda: const - jnp.sum(ytil * ytil))

    @jax.custom_vjp
    def term(theta, const, ytil):
        return value(theta, const, ytil)

    def fwd(theta, const, ytil):
        return value(theta, const, ytil), (theta, const, ytil)

    def bwd(res, g):
        theta, const, ytil = res
        zero_theta = jax.tree_util.tree_map(jnp.zeros_like, theta)

        def by_residuals():
            return jax.vjp(accurate, theta)[1](g)[0], jnp.zeros_like(const), jnp.zeros_like(ytil)

        return lax.cond(const > DATA_TERM_SWITCH * n_obs, by_residuals,
                        lambda: (zero_theta, g * jnp.ones_like(const), -2.0 * g * ytil))

    term.defvjp(fwd, bwd)
    return term


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
    ``A`` (T, M, N + n + d), the slots' information factors ``R`` (T, M, K, K) and whitened data ``ỹ`` (T, M K),
    and the data term of the density (:func:`node_aux`)."""
    t: RunTables = run.tables
    ytil, Rn, data_term = node_aux(theta, run)
    readouts = group_readouts(theta, t)
    slots = tuple((jnp.asarray(g.slot_local), jnp.asarray(g.slot_global)) for g in t.groups)

    def one(b, sl):
        A = weights(t, b, sl, [R[loc] for R, (loc, _) in zip(readouts, sl)])
        glob = jnp.concatenate([gl for _, gl in sl])
        return A, Rn[glob], ytil[glob].reshape(-1)

    A, Rs, ys = jax.vmap(one)(jnp.asarray(t.block_index), slots)
    return A, Rs, ys, data_term


def sym(X):
    """The symmetric part ``(X + Xᵀ) / 2`` of a square matrix."""
    return 0.5 * (X + X.T)


# ------------------------------------------------------------------------------------------ the absorb
#
# A sub-step's nodes are absorbed in the whitened form: the small (M K x M K) part by white_values and its reverse
# white_vjp, the state's update by absorb_state (XLA; the host filter updates in place), the reverse of the whole
# absorb by absorb_vjp and weight_vjp. Every function that takes ``xp`` serves both backends: the XLA scan
# (jax.numpy) and the host filter (numpy, :mod:`.host`).

def _tri(L, B, xp, trans=False):
    """``L⁻¹ B`` (``L⁻ᵀ B`` with ``trans``) for the lower-triangular ``L`` (R, R) and B (R, r)."""
    if xp is np:
        return lapack.dtrtrs(L, B, lower=1, trans=int(trans))[0]
    return lax.linalg.triangular_solve(L, B, left_side=True, lower=True, transpose_a=trans)


def white_values(mu, C, Rb, y, xp=jnp, value=True):
    r"""The small (R x R, R = M K) part of the filter's absorb in the whitened form.

    The sub-step's nodes ``x ~ N(μ, C)`` meet the data through ``exp(−|y − Rb x|²/2)`` (``Rb`` the blockdiag of
    the nodes' information factors, ``y`` their whitened data: :func:`node_aux`). With
    ``G_s = I + Rb C Rbᵀ = L Lᵀ`` (``G_s ⪰ I``: its Cholesky factor exists while ``C`` is positive
    semi-definite), ``W = L⁻¹Rb`` and the whitened innovation ``u = L⁻¹(y − Rb μ)``:

    .. math::

        \log Z' = -\tfrac12 |u|^2 - \sum_i \log L_{ii}, \qquad
        G^{-1}v = Rb^\top G_s^{-1}(y - Rbμ) = W^\top u, \qquad G^{-1}Λ = W^\top W,

    the log normaliser, the gain on the mean and on the covariance (``G = I + ΛC``, ``v = η − Λμ`` with
    ``Λ = RbᵀRb``, ``η = Rbᵀy``: the push-through identity ``(I + ΛC)⁻¹Rbᵀ = Rbᵀ G_s⁻¹``). Every quantity is of
    the size of the result: ``u`` is the innovation in units of its own sd, and nothing of the size of
    ``|Λ| |y|²`` is formed (see :func:`node_aux` for the large terms that moved into the data term). One Cholesky
    factorisation and one triangular solve (for ``[Rb | y − Rbμ]``) per sub-step, as the LU and inverse of the
    information form cost.

    Returns:
        dict with ``Giv``, ``GiL``, ``L``, ``W``, ``u`` and, with ``value``, ``logZ``, ``ok`` (``L`` is finite),
        ``kappa`` (:func:`block_conditioning`). A failed factorisation (the covariance lost definiteness) gives NaN
        throughout. On NumPy arrays (``xp=np``, the host filter) ``G_s`` is formed in place and factorised by
        LAPACK directly: these small calls are a sub-step's fixed cost there.
    """
    R = C.shape[0]
    Gs = Rb @ C @ Rb.T
    if xp is np:
        Gs += Gs.T
        Gs *= 0.5
        Gs.flat[:: R + 1] += 1.0
        L, info = lapack.dpotrf(Gs, lower=1, clean=1)
        ok = info == 0
        if not ok:
            L = np.full((R, R), np.nan)
    else:
        Gs = 0.5 * (Gs + Gs.T) + jnp.eye(R)
        L = jnp.linalg.cholesky(Gs)
        ok = None
    X = _tri(L, xp.concatenate([Rb, (y - Rb @ mu)[:, None]], axis=1), xp)
    W, u = X[:, :R], X[:, R]
    out = dict(Giv=W.T @ u, GiL=W.T @ W, L=L, W=W, u=u)
    if value:
        Ld = xp.diagonal(L)
        out.update(logZ=-0.5 * (u @ u) - xp.sum(xp.log(Ld)), ok=xp.all(xp.isfinite(Ld)) if ok is None else ok,
                   kappa=xp.max(block_conditioning(xp.diagonal(Gs), Ld)))
    return out


def node_moments(t: RunTables, A, m, P, xp=jnp):
    """The prior moments of a sub-step's nodes: ``U = P Bᵀ`` (S, R), ``μ = B m`` (R,), ``C = sym(B U)`` (R, R)
    (:func:`apply_B`). On NumPy arrays ``U`` is made C-contiguous once, so that ``C`` here and :func:`weight_vjp`
    in the reverse pass reshape it without a copy."""
    Ut = apply_B(t, P, A)
    U = np.ascontiguousarray(Ut.T) if xp is np else Ut.T
    return U, apply_B(t, m[:, None], A)[:, 0], sym(apply_B(t, U, A))


def absorb_state(m, P, U, mu, C, Rb, y):
    r"""The filter's absorb of one sub-step (XLA): ``(m', P', log Z', sign, L, κ)`` with ``m' = m + U G⁻¹v``,
    ``P' = P − U G⁻¹Λ Uᵀ`` (``U = P Bᵀ``, ``μ = B m``, ``C = B U``: :func:`node_moments`; :func:`white_values`),
    computed as ``m + Vᵀu`` and ``P − VᵀV`` with ``V = W Uᵀ``: forming ``U G⁻¹Λ Uᵀ`` or ``U G⁻¹v`` rounds with
    ``|G⁻¹Λ| |U|²`` (``|Λ|`` times the prior) against a posterior of the size of ``1/|Λ|`` (the filtered
    variances of a 16-step block came out with relative errors of order one at noise ``10⁻⁴``); these products
    round with ``|V|²`` and ``|V| |u|``, of the size of the posterior itself. ``sign`` is −1 when ``G_s`` has no
    Cholesky factor (the covariance lost definiteness; everything is then NaN); κ is :func:`block_conditioning`
    and ``L`` the Cholesky factor of ``G_s``, kept for the reverse pass. The host filter makes the same update in
    place (:class:`.host.HostFilter`)."""
    v = white_values(mu, C, Rb, y)
    V = v["W"] @ U.T
    return m + V.T @ v["u"], P - V.T @ V, v["logZ"], jnp.where(v["ok"], 1.0, -1.0), v["L"], v["kappa"]


def white_vjp(mu, C, Rb, y, L, cts, xp=jnp, W=None, u=None):
    r"""Reverse mode of :func:`white_values`: cotangents ``(g, S, l)`` of (G⁻¹v, G⁻¹Λ, log Z') ->
    (μ̄, C̄, Rb̄, ȳ) (C̄ unsymmetrised), from the Cholesky factor ``L`` of ``G_s`` (and ``W``, ``u`` when the
    forward pass kept them). With ``a = G_s⁻¹(y − Rbμ) = L⁻ᵀu``, ``G⁻¹v = Rbᵀa``, ``μ' = μ + C G⁻¹v`` (the nodes'
    posterior mean), ``N = G_s⁻¹Rb = L⁻ᵀW``, ``h = N g``, ``S = sym(S)``:

    .. math::

        \bar y = -l a + h, \quad \bar μ = l\, G^{-1}v - Rb^\top h, \quad
        \bar C = \tfrac l2 (G^{-1}v\, G^{-1}v^\top - G^{-1}Λ) - Rb^\top h\, G^{-1}v^\top - G^{-1}Λ\, S\, G^{-1}Λ,

        \bar{Rb} = l (a μ'^\top - N C) + a (g - C Rb^\top h)^\top - h μ'^\top + 2 N S - 2 N S N^\top Rb C,

    the transpose of the tangents of :func:`white_values`: ``a``, ``μ'``, ``N`` are of the size of the result
    (the whitened innovation, the posterior mean, a gain), so these products round at that size; the adjoints of
    the information form, in ``Λ = RbᵀRb`` and ``η = Rbᵀy``, pass through ``μ'μ'ᵀ`` and ``Λ`` and cancel there."""
    g, GiLb, lb = cts
    S = 0.5 * (GiLb + GiLb.T)
    R = C.shape[0]
    if W is None:
        X = _tri(L, xp.concatenate([Rb, (y - Rb @ mu)[:, None]], axis=1), xp)
        W, u = X[:, :R], X[:, R]
    X = _tri(L, xp.concatenate([W, u[:, None]], axis=1), xp, trans=True)
    N, a = X[:, :R], X[:, R]
    GiL = W.T @ W
    Giv = W.T @ u
    post = mu + C @ Giv
    h = N @ g
    Rth = Rb.T @ h
    yb = -lb * a + h
    mub = lb * Giv - Rth
    Cb = 0.5 * lb * (xp.outer(Giv, Giv) - GiL) - xp.outer(Rth, Giv) - GiL @ S @ GiL
    NS = N @ S
    Rbb = (lb * (xp.outer(a, post) - N @ C) + xp.outer(a, g - C @ Rth) - xp.outer(h, post) + 2.0 * NS
           - 2.0 * (NS @ N.T) @ (Rb @ C))
    return mub, Cb, Rbb, yb


def absorb_vjp(t: RunTables, k: dict, mb, Pb, gll, xp=jnp):
    r"""Reverse mode of a sub-step's absorb (:func:`node_moments`, :func:`white_values`, ``m + Vᵀu``,
    ``P − VᵀV``), the weights' adjoint left to :func:`weight_vjp`.

    ``k`` holds what the forward pass formed: ``A`` (M, Q), ``U``, ``mu``, ``Cm`` (:func:`node_moments`), ``Rb``,
    ``y``, and of :func:`white_values` ``L``, ``W``, ``u``, ``Giv``, ``GiL``. With ``Y = P̄ U`` (the one dense
    S x S x R product):

    .. math::

        Ū = m̄ (G^{-1}v)^\top - 2 Y G^{-1}Λ + B^\top \bar C, \qquad
        \bar P \mathrel{+}= \mathrm{sym}(B^\top Ū^\top), \qquad \bar m \mathrel{+}= B^\top \bar μ,

    with ``(μ̄, C̄, R̄b, ȳ)`` from :func:`white_vjp` at cotangents ``(Uᵀm̄, −UᵀY, gll)``.

    Returns:
        ``(m̄, P̄, parts, R̄b, ȳ)`` with ``parts = (C̄ (M, K R), μ̄ (M, K), Ūᵀ (M, K S))`` for :func:`weight_vjp`.
        NumPy arrays ``mb`` and ``Pb`` are updated in place (the host filter's accumulators; ``P̄`` is then
        symmetric to rounding) and returned; under JAX the results are new arrays.
    """
    K, A, U = t.K, k["A"], k["U"]
    (S, R), M = U.shape, A.shape[0]
    Y = Pb @ U
    Ub = xp.outer(mb, k["Giv"]) - 2.0 * Y @ k["GiL"]
    mub, Cb, Rbb, yb = white_vjp(k["mu"], k["Cm"], k["Rb"], k["y"], k["L"], (U.T @ mb, -(U.T @ Y), gll), xp=xp,
                                 W=k["W"], u=k["u"])
    Cb = sym(Cb).reshape(M, K * R)
    mub = mub.reshape(M, K)
    Ub += (A.T @ Cb).reshape(S, R)  # C = B U
    mb += (A.T @ mub).reshape(S)  # μ = B m
    U3 = Ub.T.reshape(M, K * S)  # Uᵀ = B P
    Zs = (A.T @ U3).reshape(S, S)
    Zs *= 0.5
    Pb += Zs
    Pb += Zs.T
    return mb, Pb, (Cb, mub, U3), Rbb, yb


def weight_vjp(t: RunTables, parts, U, m, P):
    """Ā (M, Q) of a sub-step's weights: ``C = B U``, ``μ = B m`` and ``Uᵀ = B P`` against the adjoints ``parts``
    of :func:`absorb_vjp`, with ``m``, ``P`` the state before the sub-step (NumPy or JAX arrays)."""
    Cb, mub, U3 = parts
    K, (S, R) = t.K, U.shape
    Q = S // K
    Ab = Cb @ U.reshape(Q, K * R).T
    Ab += mub @ m.reshape(Q, K).T
    Ab += U3 @ P.reshape(Q, K * S).T
    return Ab


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


#: :func:`block_conditioning` above which a run's events carry an accuracy level (:func:`event_code`)
CONDITIONING_LIMIT = 1e5
#: the accuracy level sits above this bit of a run's event code; the bits below count lost-definiteness steps
LEVEL_SHIFT = 16


def block_conditioning(Gs_diag, L_diag):
    r"""κ of one absorb: ``max_j G_s[j, j] / L[j, j]²`` over the whitened nodes of the sub-step.

    ``G_s[j, j] = 1 + (R C Rᵀ)[j, j]`` is what node j's information would make of its prior variance alone and
    ``L[j, j]²`` what is left of it once the sub-step's earlier nodes are known (the pivot of the Cholesky factor
    of ``G_s``): κ is how much better the earlier nodes of the block predict a node than its prior does, at the
    data's precision. A one-node sub-step has κ = 1; a block of a smooth prior against precise data has κ up to
    the information times the prior variance (``10⁹`` for a Matérn-5/2 at ``ℓ = 100 Δ`` with 40 steps per block
    and noise ``10⁻⁴``). The covariance filter's reverse pass forms the adjoint of such a block from its inverse
    covariance, and its rounding grows like ``ε κ²`` (measured against a 50-digit oracle over kernels,
    lengthscales, block lengths and noise levels: within 1e-6 where ``κ ≤ 10⁵``, up to 100% of a lengthscale's
    gradient at ``κ = 10⁸``), as does that of the smoother's small posterior variances."""
    return Gs_diag / L_diag**2


#: rounding (nats) of a data term formed as a difference above which the associative scan reports it
ROUNDING_NATS = 1e-4
#: the data-term rounding level sits above this bit of a run's event code (the associative scan)
DATA_LEVEL_SHIFT = 20


def event_code(bad, kappa, xp=jnp, rounding=None):
    """A run's event code: the count of steps that lost definiteness (``bad``, below bit :data:`LEVEL_SHIFT`)
    plus ``level << LEVEL_SHIFT`` with level ``ceil(log10(κ / CONDITIONING_LIMIT))`` clipped to 0..15 (0: κ within
    the limit), plus, with ``rounding`` (the estimated rounding in nats of a data term formed as a difference),
    ``ceil(log10(rounding / ROUNDING_NATS))`` clipped to 0..15 at bit :data:`DATA_LEVEL_SHIFT`. Decoded by
    :func:`describe_code`."""
    level = xp.clip(xp.ceil(xp.log10(xp.maximum(kappa, 1.0) / CONDITIONING_LIMIT)), 0, 15)
    dlevel = 0 if rounding is None else xp.clip(xp.ceil(xp.log10(xp.maximum(rounding, 1e-300) / ROUNDING_NATS)),
                                                0, 15)
    if xp is np:
        return int(bad) + (int(level) << LEVEL_SHIFT) + (int(dlevel) << DATA_LEVEL_SHIFT)
    code = bad.astype(jnp.int32) + (level.astype(jnp.int32) << LEVEL_SHIFT)
    if rounding is not None:
        code = code + (dlevel.astype(jnp.int32) << DATA_LEVEL_SHIFT)
    return code


def describe_code(code: int) -> str | None:
    """What a run's event code of the state-space backend means (None: a healthy evaluation)."""
    code = int(code)
    bad = code & ((1 << LEVEL_SHIFT) - 1)
    level = (code >> LEVEL_SHIFT) & ((1 << (DATA_LEVEL_SHIFT - LEVEL_SHIFT)) - 1)
    dlevel = code >> DATA_LEVEL_SHIFT
    said = []
    if bad:
        said.append(f"{bad} step(s) of the Kalman filter lost positive definiteness (the value is NaN); the "
                    "model's precision exceeds what float64 covariances hold: check for loadings far outside the "
                    "data's scale or a noise sd near zero")
    if level:
        kappa = CONDITIONING_LIMIT * 10.0**level
        said.append(f"the blocks of the sequential scan are ill-conditioned at these parameters: within a block, "
                    f"nodes are up to {kappa:.0e} times better predicted by the block's earlier nodes than by their "
                    f"prior (a smooth prior against precise data; limit {CONDITIONING_LIMIT:.0e}), so the gradient "
                    f"carries relative rounding up to about {min(1.0, 2.2e-16 * kappa**2):.0e} and the density "
                    "loses digits too (the latent posterior and predictions switch to one-step blocks on their "
                    "own); prepare with block=1 (GPMSRM(..., linear_algebra='state_space', block=1)), or use a "
                    "rougher kernel or a coarser latent_dt")
    if dlevel:
        said.append(f"the associative scan (parallel=True) forms the data term r^T D^-1 r of the density and "
                    f"cancels it against the nodes' own fit; at this precision of the data its rounding reaches "
                    f"about {ROUNDING_NATS * 10.0**dlevel:.0e} nats (noise sds far below the signal); the sequential "
                    f"scan (parallel=False) does not form it")
    return "; ".join(said) if said else None


def forward_step(t: RunTables, m, P, x, T, Qb):
    """One sub-step (absorb by :func:`absorb_state`, then predict on the block's last sub-step):
    (m, P, log Z', bad, κ, L) with bad = 1 when ``G_s`` has no Cholesky factor (the filter's
    covariance lost definiteness; log Z' is then NaN) and κ the sub-step's :func:`block_conditioning`.
    ``x = (block, predict, A, R blocks, ỹ)``."""
    b, move, A, Rs, ys = x
    U, mu, C = node_moments(t, A, m, P)
    m, P, logZ, sign, kept, kappa = absorb_state(m, P, U, mu, C, blockdiag(Rs), ys)
    m, P = predict(m, P, b, move, t, T, Qb)
    return m, P, logZ, (sign <= 0).astype(jnp.int32), kappa, kept


def scan_inputs(t: RunTables, A, Rs, ys):
    """The scan's per-sub-step inputs, chunked: (block, predict, A, R blocks, ỹ), each (n_chunks, chunk, ...)."""
    xs = (jnp.asarray(t.block_index), jnp.asarray(t.predict), A, Rs, ys)
    return jax.tree_util.tree_map(lambda a: a.reshape((t.n_chunks, t.chunk) + a.shape[1:]), xs)


