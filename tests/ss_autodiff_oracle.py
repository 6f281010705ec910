"""The state-space filter differentiated by JAX, and the absorb's small part in the (Λ, η) form: oracles for the
hand-written reverse modes of :mod:`msrm.gp.state_space.adjoint` and :mod:`msrm.gp.state_space.host`.

:func:`run_loglik_sequential` runs the block scan of :mod:`msrm.gp.state_space.filter` with :func:`absorb_state`, the
filter's absorb (:func:`msrm.gp.state_space.filter.absorb_state`) under a ``jax.custom_jvp`` whose tangents
(:func:`white_tangents`) are those of the whitened expressions, and lets ``jax.grad`` build the reverse pass.
:func:`absorb_small` is the same small part in the (Λ, η) form: it takes information matrices and vectors, as the
grouped likelihood's sufficient statistics are; :func:`absorb_small_vjp` is its reverse mode from ``G⁻¹``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from msrm.gp.state_space import filter as ssf
from msrm.gp.state_space.filter import (block_transition, blockdiag, event_code, initial_state, predict,
                                        scan_inputs, step_tables, sym, white_values)
from msrm.gp.state_space.prepare import RunTables


def _tri(L, B, trans=False):
    """``L⁻¹ B`` (``L⁻ᵀ B`` with ``trans``) for the lower-triangular ``L`` (R, R) and B (R, r)."""
    return lax.linalg.triangular_solve(L, B, left_side=True, lower=True, transpose_a=trans)


#: relative damping of the solve for the node estimates (:func:`node_estimates`)
ESTIMATE_RIDGE = 1e-6
#: pivots of a node's information below this fraction of its largest diagonal are dropped (:func:`psd_factor`)
PIVOT_TOL = 1e-13


def _cholesky_solver(A, xp):
    """A solve with the symmetric positive definite ``A`` (..., K, K), batched over the leading axes: the column
    Cholesky algorithm unrolled into elementwise operations over the batch (no LAPACK call, so no batched LAPACK
    kernel on XLA:CPU); ``b (..., K) -> A⁻¹ b``."""
    K = A.shape[-1]
    L = [[None] * K for _ in range(K)]
    for j in range(K):
        d2 = A[..., j, j]
        for k in range(j):
            d2 = d2 - L[j][k] * L[j][k]
        L[j][j] = xp.sqrt(d2)
        for i in range(j + 1, K):
            t = A[..., i, j]
            for k in range(j):
                t = t - L[i][k] * L[j][k]
            L[i][j] = t / L[j][j]

    def solve(b):
        y = []
        for i in range(K):
            t = b[..., i]
            for k in range(i):
                t = t - L[i][k] * y[k]
            y.append(t / L[i][i])
        x = [None] * K
        for i in reversed(range(K)):
            t = y[i]
            for k in range(i + 1, K):
                t = t - L[k][i] * x[k]
            x[i] = t / L[i][i]
        return xp.stack(x, axis=-1)

    return solve


def node_estimates(Lam, eta, xp=jnp):
    r"""Per node a point ``ŷ`` (..., K) with ``Λ ŷ = η`` to rounding along every direction that carries
    information (``Λ`` (..., K, K) positive semi-definite, ``η`` (..., K)).

    The damped normal equations ``(Λ² + δ² I) ŷ = Λ η``, ``δ = 10⁻⁶ max diag Λ + 10⁻¹⁵⁰`` (``δ²`` is then far above
    the rounding of ``Λ²``, so the Cholesky factor exists for a singular ``Λ``; an all-zero node gives ``ŷ = 0``,
    and ``δ²`` stays a normal number, which XLA:CPU does not flush to zero), refined twice on the residual: along
    an eigenvalue ``s`` of ``Λ`` the residual ``η − Λŷ`` shrinks by ``(δ² / (s² + δ²))³``, and a component of
    ``η`` outside the range of ``Λ`` is never amplified (it is multiplied by ``Λ`` first). :func:`absorb_small` is
    exact for any ``ŷ``; ``ŷ`` only decides which large terms it never forms. Unrolled for ``K <= 12``
    (elementwise operations over the nodes), a batched solve above."""
    K = Lam.shape[-1]
    delta = ESTIMATE_RIDGE * xp.max(xp.diagonal(Lam, axis1=-2, axis2=-1), axis=-1) + 1e-150
    L2 = xp.einsum("...ij,...jk->...ik", Lam, Lam)
    A = L2 + (delta * delta)[..., None, None] * xp.eye(K)
    if K <= 12:
        solve = _cholesky_solver(A, xp)
    else:
        solve = lambda b: xp.linalg.solve(A, b[..., None])[..., 0]
    mv = lambda M, v: xp.einsum("...ij,...j->...i", M, v)
    y = solve(mv(Lam, eta))
    for _ in range(2):
        y = y + solve(mv(Lam, eta - mv(Lam, y)))
    return y


def psd_factor(Lam, xp=jnp):
    r"""A factor ``R`` (..., K, K) with ``RᵀR = Λ`` to rounding, for positive semi-definite ``Λ`` (..., K, K),
    singular ones included.

    Cholesky with complete (diagonal) pivoting, unrolled over the K steps with elementwise operations over the
    batch: step j takes the largest remaining diagonal ``p`` of the Schur complement ``S``, writes row
    ``r_j = S[p, :] / sqrt(S[p, p])`` and subtracts ``r_j r_jᵀ``; a pivot at most :data:`PIVOT_TOL` times the
    largest diagonal of ``Λ`` ends the factor (its row is zero). ``S`` stays positive semi-definite, so
    ``|S_ab| ≤ max diag S`` and what is dropped is at most ``10⁻¹³ |Λ|`` in every entry, below the rounding that
    formed ``Λ``. The rows are in pivot order; any factor serves :func:`absorb_small`."""
    K = Lam.shape[-1]
    S = 0.5 * (Lam + xp.swapaxes(Lam, -1, -2))
    tol = PIVOT_TOL * xp.max(xp.diagonal(S, axis1=-2, axis2=-1), axis=-1)
    chosen = xp.zeros(S.shape[:-1], dtype=bool)
    idx = xp.arange(K)
    rows = []
    for _ in range(K):
        d = xp.where(chosen, -xp.inf, xp.diagonal(S, axis1=-2, axis2=-1))
        onehot = idx == xp.argmax(d, axis=-1)[..., None]
        piv = xp.sum(xp.where(onehot, d, 0.0), axis=-1)
        row = xp.einsum("...k,...kl->...l", onehot.astype(S.dtype), S)
        ok = piv > tol
        r = xp.where(ok[..., None], row / xp.sqrt(xp.where(ok, piv, 1.0))[..., None], 0.0)
        S = S - r[..., :, None] * r[..., None, :]
        chosen = chosen | onehot
        rows.append(r)
    return xp.stack(rows, axis=-2)


def absorb_values(mu, C, Lb, e, yh, Rb):
    r"""The small (R x R, R = M K) part of an absorb in the (Λ, η) form (see :func:`absorb_small`).

    Args:
        mu (R,), C (R, R): the nodes' prior mean and covariance; Lb (R, R): blockdiag ``Λ``; e (R,): ``η``;
        yh (R,): a point (:func:`node_estimates`); Rb (R, R): a factor with ``RbᵀRb = Λ`` (:func:`psd_factor`).
    Returns:
        dict with ``Giv`` = G⁻¹v, ``GiL`` = G⁻¹Λ (= WᵀW), ``logZ``, ``ok`` (the Cholesky factor of ``G_s`` is
        finite), ``Z`` = G⁻¹, ``post`` (the nodes' posterior mean), ``Cpost`` (their posterior covariance).
    """
    R = C.shape[0]
    eye = jnp.eye(R)
    L = jnp.linalg.cholesky(sym(eye + Rb @ C @ Rb.T))
    W = lax.linalg.triangular_solve(L, Rb, left_side=True, lower=True)
    WC = W @ C
    r = e - Rb.T @ (Rb @ yh)
    eps = yh - mu
    We = W @ eps
    Zr = r - W.T @ (WC @ r)
    GiL = W.T @ W
    Giv = W.T @ We + Zr
    Z = eye - W.T @ WC
    ty = Rb @ yh
    logdet = 2.0 * jnp.sum(jnp.log(jnp.diagonal(L)))
    logZ = 0.5 * ty @ ty + r @ yh - 0.5 * We @ We - eps @ Zr + 0.5 * r @ (C @ Zr) - 0.5 * logdet
    post = yh + C @ Zr - Z.T @ eps
    Cpost = sym(C - WC.T @ WC)
    ok = jnp.all(jnp.isfinite(jnp.diagonal(L)))
    return dict(Giv=Giv, GiL=GiL, logZ=logZ, ok=ok, Z=Z, post=post, Cpost=Cpost)


def absorb_tangents(vals, C, Lb, mu_dot, C_dot, Lb_dot, e_dot):
    r"""Tangents of (G⁻¹v, G⁻¹Λ, log Z) along (μ̇, Ċ, Λ̇, η̇) (of the function of the symmetric parts of C and Λ):

    .. math::

        \dot{\log Z} = (G^{-1}v)^\top \dot μ + μ'^\top \dot η + \tfrac12 (G^{-1}v)^\top \dot C\, G^{-1}v
            - \tfrac12 \langle G^{-1}Λ, \dot C\rangle - \tfrac12 \langle μ'μ'^\top + C', \dot Λ\rangle,

        \dot{G^{-1}v} = G^{-1}(\dot η - \dot Λ μ' - Λ \dot μ - Λ \dot C\, G^{-1}v), \qquad
        \dot{G^{-1}Λ} = G^{-1} \dot Λ G^{-\top} - G^{-1}Λ\, \dot C\, G^{-1}Λ,

    with ``μ'``, ``C'`` the nodes' posterior mean and covariance (``∂ log Z/∂Λ = −E'[x xᵀ]/2``,
    ``∂ log Z/∂η = E'[x]``, ``∂ log Z/∂μ = G⁻¹v``, ``∂ log Z/∂C = (G⁻¹v G⁻¹vᵀ − G⁻¹Λ)/2``; ``d(G⁻¹Λ)`` uses
    ``I − C G⁻¹Λ = G⁻ᵀ``). Returns (Ġiv, ĠiL, l̇og Z, Ż)."""
    Cd, Ld = sym(C_dot), sym(Lb_dot)
    Giv, GiL, Z, post, Cpost = vals["Giv"], vals["GiL"], vals["Z"], vals["post"], vals["Cpost"]
    dlogZ = (Giv @ mu_dot + post @ e_dot + 0.5 * Giv @ (Cd @ Giv) - 0.5 * jnp.sum(GiL * Cd)
             - 0.5 * post @ (Ld @ post) - 0.5 * jnp.sum(Cpost * Ld))
    dGiv = Z @ (e_dot - Ld @ post - Lb @ mu_dot - Lb @ (Cd @ Giv))
    dGiL = sym(Z @ Ld @ Z.T - GiL @ Cd @ GiL)
    dZ = -Z @ (Ld @ C + Lb @ Cd) @ Z
    return dGiv, dGiL, dlogZ, dZ


@jax.custom_jvp
def _absorb_small(mu, C, Lb, e, yh, Rb):
    v = absorb_values(mu, C, Lb, e, yh, Rb)
    return v["Giv"], v["GiL"], v["logZ"], jnp.where(v["ok"], 1.0, -1.0), v["Z"]


@_absorb_small.defjvp
def _absorb_small_jvp(primals, tangents):
    mu, C, Lb, e, yh, Rb = primals
    v = absorb_values(mu, C, Lb, e, yh, Rb)
    dGiv, dGiL, dlogZ, dZ = absorb_tangents(v, C, Lb, *tangents[:4])
    sign = jnp.where(v["ok"], 1.0, -1.0)
    return (v["Giv"], v["GiL"], v["logZ"], sign, v["Z"]), (dGiv, dGiL, dlogZ, jnp.zeros_like(sign), dZ)


def absorb_small(mu, C, Lb, e, yh=None, Rb=None):
    r"""The R x R part of an absorb in the (Λ, η) form: (G⁻¹v, G⁻¹Λ, log Z), a sign (1, or −1 when the
    factorisation failed), and ``Z = G⁻¹``; ``G = I + ΛC``, ``v = η − Λμ``. The filter uses the whitened form of
    the same computation (:func:`absorb_state`); this one takes the information matrices and vectors.

    With ``x ~ N(μ, C)`` the nodes' prior, ``log Z = log E[exp(-xᵀΛx/2 + ηᵀx)]`` equals, for any point ``ŷ``
    (``r = η − Λŷ``, ``ε = ŷ − μ``) and any factor ``Λ = RᵀR``,

    .. math::

        \log Z = \tfrac12 |Rŷ|^2 + r^\top ŷ - \tfrac12 |Wε|^2 - ε^\top G^{-1} r
                 + \tfrac12 r^\top C G^{-1} r - \tfrac12 \log|G_s|,

        G_s = I + R C R^\top = L L^\top, \quad W = L^{-1} R, \quad G^{-1}Λ = W^\top W, \quad
        G^{-1} = I - W^\top W C, \quad G^{-1}v = W^\top W ε + G^{-1} r,

    from ``v = r + Λε``, ``Λ C G⁻¹ Λ = Λ − G⁻¹Λ``, ``C G⁻¹ Λ = I − G⁻ᵀ``, the push-through identity
    ``(I + ΛC)⁻¹Rᵀ = Rᵀ G_s⁻¹`` and ``|G| = |G_s|``. The form in ``v``, ``−μᵀΛμ/2 + ηᵀμ + vᵀCG⁻¹v/2``, holds
    terms of size ``|Λ| |y|²`` whose rounding the conditioning of ``G`` amplifies (hundreds of nats off with noise
    sd ``10⁻⁴`` on a smooth latent and 16 grid steps per block), and ``G⁻¹`` from an LU of the unsymmetric ``G``
    carries errors of that relative size into ``C G⁻¹Λ C``; here ``G_s ⪰ I`` is factorised by Cholesky and the
    only large term is ``|Rŷ|²/2``, exact to rounding. ``ŷ`` (:func:`node_estimates`) and ``R``
    (:func:`psd_factor`) are solved from ``Λ`` and ``η`` when not given and held fixed: the derivative (a
    ``jax.custom_jvp``, :func:`absorb_tangents`) is that of the function of ``(μ, C, Λ, η)``.
    """
    if yh is None:
        yh = node_estimates(Lb[None], e[None])[0]
    if Rb is None:
        Rb = psd_factor(Lb[None])[0]
    (Giv, GiL, logZ, sign, Z) = _absorb_small(mu, C, Lb, e, lax.stop_gradient(yh), lax.stop_gradient(Rb))
    return (Giv, GiL, logZ), sign, Z


def absorb_small_vjp(mu, C, Lb, e, Z, Giv, cts, xp=jnp, GiL=None):
    r"""Reverse mode of :func:`absorb_small` from its ``Z = G⁻¹`` (no factorisation): cotangents
    ``(a, S, l)`` of (G⁻¹v, G⁻¹Λ, log Z) -> (μ̄, C̄, Λ̄, η̄) (C̄ and Λ̄ unsymmetrised). ``xp``: jax.numpy or numpy.
    ``GiL``: ``G⁻¹Λ`` as the forward pass formed it, else ``sym(Z Λ)``.

    The transpose of :func:`absorb_tangents`, with ``μ' = μ + C G⁻¹v``, ``C' = G⁻ᵀ C``, ``w = G⁻ᵀ a`` and
    ``W = G⁻¹Λ``:

    .. math::

        \bar μ = l\, G^{-1}v - Λ w, \quad \bar η = l\, μ' + w, \quad
        \bar C = \tfrac l2 \bigl(G^{-1}v\, (G^{-1}v)^\top - W\bigr) - Λ w\, (G^{-1}v)^\top - W S W, \quad
        \bar Λ = -\tfrac l2 (μ' μ'^\top + C') - w μ'^\top + G^{-\top} S G^{-1}

    (``S = sym(S)``)."""
    a, GiLb, lb = cts
    S = sym(GiLb)
    if GiL is None:
        GiL = sym(Z @ Lb)
    post = mu + C @ Giv
    w = Z.T @ a
    Lw = Lb @ w
    mub = lb * Giv - Lw
    eb = lb * post + w
    Cb = 0.5 * lb * (xp.outer(Giv, Giv) - GiL) - xp.outer(Lw, Giv) - GiL @ S @ GiL
    Lbb = -0.5 * lb * (xp.outer(post, post) + Z.T @ C) - xp.outer(w, post) + Z.T @ S @ Z
    return mub, Cb, Lbb, eb



def white_tangents(v, mu, C, Rb, mu_dot, C_dot, Rb_dot, y_dot):
    r"""Tangents of (G⁻¹v, G⁻¹Λ, log Z') of :func:`white_values` along (μ̇, Ċ, Ṙb, ẏ) (Ċ symmetrised): with
    ``e = y − Rb μ``, ``a = G_s⁻¹ e``, ``Ġ_s = Ṙb C Rbᵀ + Rb Ċ Rbᵀ + Rb C Ṙbᵀ``, ``N = G_s⁻¹ Rb``,

    .. math::

        \dot{\log Z'} = -a^\top \dot e + \tfrac12 a^\top \dot G_s a - \tfrac12 \langle G_s^{-1}, \dot G_s\rangle,
        \quad \dot a = G_s^{-1}(\dot e - \dot G_s a), \quad
        \dot{G^{-1}v} = \dot{Rb}^\top a + Rb^\top \dot a, \quad
        \dot{G^{-1}Λ} = \dot{Rb}^\top N + N^\top \dot{Rb} - N^\top \dot G_s N."""
    Cd = sym(C_dot)
    L, W, u = v["L"], v["W"], v["u"]
    R = C.shape[0]
    X = _tri(L, jnp.concatenate([W, u[:, None], _tri(L, jnp.eye(R))], axis=1), trans=True)
    N, a, Ginv = X[:, :R], X[:, R], X[:, R + 1:]
    de = y_dot - Rb_dot @ mu - Rb @ mu_dot
    dG = Rb_dot @ C @ Rb.T + Rb @ Cd @ Rb.T + Rb @ C @ Rb_dot.T
    dlogZ = -a @ de + 0.5 * a @ (dG @ a) - 0.5 * jnp.sum(Ginv * dG)
    da = Ginv @ (de - dG @ a)
    dGiv = Rb_dot.T @ a + Rb.T @ da
    dGiL = Rb_dot.T @ N + N.T @ Rb_dot - N.T @ dG @ N
    return dGiv, dGiL, dlogZ


@jax.custom_jvp
def absorb_state(m, P, U, mu, C, Rb, y):
    r""":func:`msrm.gp.state_space.filter.absorb_state` (``(m', P', log Z', sign, L, κ)``, ``m' = m + Vᵀu``,
    ``P' = P − VᵀV``) with the derivative of the same expressions (``ṁ + U̇ G⁻¹v + U (G⁻¹v)˙``,
    ``Ṗ − U̇ G⁻¹Λ Uᵀ − U (G⁻¹Λ)˙ Uᵀ − U G⁻¹Λ U̇ᵀ``, :func:`white_tangents`); κ and ``L`` are not
    differentiated."""
    return ssf.absorb_state(m, P, U, mu, C, Rb, y)


@absorb_state.defjvp
def _absorb_state_jvp(primals, tangents):
    m, P, U, mu, C, Rb, y = primals
    md, Pd, Ud, mud, Cd, Rbd, yd = tangents
    out = absorb_state(m, P, U, mu, C, Rb, y)
    v = white_values(mu, C, Rb, y)
    dGiv, dGiL, dlogZ = white_tangents(v, mu, C, Rb, mud, Cd, Rbd, yd)
    GiL = v["GiL"]
    dm = md + Ud @ v["Giv"] + U @ dGiv
    UGd = Ud @ GiL @ U.T
    dP = Pd - UGd - UGd.T - U @ dGiL @ U.T
    zero = jnp.zeros_like
    return out, (dm, dP, dlogZ, zero(out[3]), zero(out[4]), zero(out[5]))


def forward_step(t: RunTables, m, P, x, T, Qb):
    """:func:`msrm.gp.state_space.filter.forward_step` with :func:`absorb_state` (its custom derivative)."""
    b, move, A, Rs, ys = x
    U, mu, C = ssf.node_moments(t, A, m, P)
    m, P, logZ, sign, _, kappa = absorb_state(m, P, U, mu, C, blockdiag(Rs), ys)
    m, P = predict(m, P, b, move, t, T, Qb)
    return m, P, logZ, (sign <= 0).astype(jnp.int32), kappa


def run_loglik_sequential(theta, run):
    """Log likelihood of one run by the chunked block scan, differentiated by JAX; (value, bad-step count)."""
    t: RunTables = run.tables
    A, Rs, ys, data_term = step_tables(theta, run)
    T, Qb, Pinf = block_transition(theta, t)
    m0, P0 = initial_state(t, T, Qb, Pinf)

    def chunk_fn(carry, xc, T, Qb):
        def body(c, x):
            m, P, ll, bad, kap = c
            m, P, logZ, b, k = forward_step(t, m, P, x, T, Qb)
            return (m, P, ll + logZ, bad + b, jnp.maximum(kap, k)), None

        return lax.scan(body, carry, xc)[0]

    if t.checkpoint:
        chunk_fn = jax.checkpoint(chunk_fn)
    carry0 = (m0, P0, jnp.zeros(()), jnp.zeros((), jnp.int32), jnp.ones(()))
    (_, _, ll, bad, kap), _ = lax.scan(lambda c, xc: (chunk_fn(c, xc, T, Qb), None), carry0,
                                       scan_inputs(t, A, Rs, ys))
    return -0.5 * data_term + ll, event_code(bad, lax.stop_gradient(kap))

