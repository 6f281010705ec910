r"""Matérn priors as exact linear SDEs, discretised exactly on the latent grid.

A unit-variance Matérn-ν factor with ν = p + 1/2 is the first component of a (p+1)-state linear SDE
``ds = F s dt + L dβ`` in companion form, ``s = (z, z', z'', ...)``, with ``λ = sqrt(2ν) / ℓ``:

* ν = 1/2 (1 state):  ``F = [-λ]``, ``P∞ = [1]``;
* ν = 3/2 (2 states): ``F = [[0, 1], [-λ², -2λ]]``, ``P∞ = diag(1, λ²)``;
* ν = 5/2 (3 states): ``F = [[0, 1, 0], [0, 0, 1], [-λ³, -3λ², -3λ]]``,
  ``P∞ = [[1, 0, -λ²/3], [0, λ²/3, 0], [-λ²/3, 0, λ⁴]]``.

``P∞`` is the stationary covariance (``F P∞ + P∞ Fᵀ + L q Lᵀ = 0``). On a grid of step Δ the exact
discretisation is

.. math::

    s_{j+1} = Φ s_j + ε_j, \qquad Φ = e^{FΔ}, \qquad ε_j \sim N(0, Q_d), \qquad Q_d = P_∞ - Φ P_∞ Φ^\top,

so ``Cov(z(τ_i), z(τ_j)) = e_1ᵀ Φ^{|i-j|} P∞ e_1 = k_ν(|τ_i − τ_j|; ℓ)`` exactly (tested to 1e-12).

The characteristic polynomial of each ``F`` is ``(x + λ)^d``, so ``N = F + λI`` is nilpotent (``N^d = 0``,
Cayley–Hamilton) and commutes with ``λI``: ``e^{Fτ} = e^{-λτ} Σ_{j<d} (Nτ)^j / j!``, a closed form with no
matrix exponential (:func:`transition`; equal to ``scipy.linalg.expm`` to rounding, tested). It is a few
elementwise operations for any number of lags at once, so a jitted gradient through it compiles small.
"""
from __future__ import annotations

import math

import numpy as np

__all__ = ["N_STATES", "n_states", "companion", "stationary_cov", "transition", "discretise", "implied_grid_cov"]

N_STATES = {"matern12": 1, "matern32": 2, "matern52": 3}


def n_states(kernel: str) -> int:
    """SDE states per factor for a Matérn kernel name."""
    try:
        return N_STATES[kernel]
    except KeyError:
        raise ValueError(f"kernel must be one of {tuple(N_STATES)}, got {kernel!r}") from None


def _lam(kernel: str, lengthscale, xp):
    nu2 = {"matern12": 1.0, "matern32": 3.0, "matern52": 5.0}[kernel]
    return math.sqrt(nu2) / lengthscale


def companion(kernel: str, lengthscale, xp=np):
    """Feedback matrix ``F`` (d, d) of the Matérn SDE (``xp`` = numpy or jax.numpy)."""
    d = n_states(kernel)
    lam = _lam(kernel, lengthscale, xp)
    if d == 1:
        return xp.reshape(-lam, (1, 1))
    if d == 2:
        return xp.stack([xp.stack([0.0 * lam, 1.0 + 0.0 * lam]), xp.stack([-lam**2, -2.0 * lam])])
    zero, one = 0.0 * lam, 1.0 + 0.0 * lam
    return xp.stack([xp.stack([zero, one, zero]), xp.stack([zero, zero, one]), xp.stack([-lam**3, -3.0 * lam**2, -3.0 * lam])])


def stationary_cov(kernel: str, lengthscale, xp=np):
    """Stationary covariance ``P∞`` (d, d) of the unit-variance Matérn SDE."""
    d = n_states(kernel)
    lam = _lam(kernel, lengthscale, xp)
    one, zero = 1.0 + 0.0 * lam, 0.0 * lam
    if d == 1:
        return xp.reshape(one, (1, 1))
    if d == 2:
        return xp.stack([xp.stack([one, zero]), xp.stack([zero, lam**2])])
    return xp.stack([
        xp.stack([one, zero, -lam**2 / 3.0]),
        xp.stack([zero, lam**2 / 3.0, zero]),
        xp.stack([-lam**2 / 3.0, zero, lam**4]),
    ])


def transition(kernel: str, lengthscale, tau, xp=np):
    """``Φ(τ) = e^{Fτ}`` for every lag in ``tau`` at once, in closed form (see the module docstring).

    Args:
        kernel: Matérn name; lengthscale: scalar (traced under JAX); tau: (n,) lags (NumPy, static).
    Returns:
        (n, d, d).
    """
    d = n_states(kernel)
    lam = _lam(kernel, lengthscale, xp)
    N = companion(kernel, lengthscale, xp) + lam * xp.eye(d)
    tau = np.asarray(tau, dtype=np.float64).reshape(-1, 1, 1)
    out, term = xp.eye(d) + 0.0 * tau, xp.eye(d)
    for j in range(1, d):
        term = term @ N
        out = out + term * (tau**j / math.factorial(j))
    return xp.exp(-lam * tau) * out


def discretise(kernel: str, lengthscale, step: float, xp=np):
    """Exact one-step transition on the grid.

    Returns:
        (Phi, Q, Pinf), each (d, d): ``Phi = expm(F step)`` (:func:`transition`), ``Q = Pinf - Phi Pinf Phi^T``.
    """
    Phi = transition(kernel, lengthscale, [step], xp)[0]
    Pinf = stationary_cov(kernel, lengthscale, xp)
    Q = Pinf - Phi @ Pinf @ Phi.T
    return Phi, 0.5 * (Q + Q.T), Pinf


def implied_grid_cov(kernel: str, lengthscale: float, step: float, n: int) -> np.ndarray:
    """Covariance of ``z`` on ``n`` grid points implied by the discretised SDE (NumPy; for tests).

    Runs the recursion ``P_{j+1} = Phi P_j Phi^T + Q`` on the joint state of all grid points.
    """
    Phi, Q, Pinf = discretise(kernel, float(lengthscale), float(step))
    d = Phi.shape[0]
    cov = np.zeros((n, n))
    # Cov(s_i, s_j) = Phi^{j-i} Pinf for j >= i (stationary start)
    P = Pinf.copy()
    powers = [np.eye(d)]
    for _ in range(n - 1):
        powers.append(Phi @ powers[-1])
    for i in range(n):
        for j in range(i, n):
            cov[i, j] = cov[j, i] = (powers[j - i] @ P)[0, 0]
        P = Phi @ P @ Phi.T + Q
    return cov
