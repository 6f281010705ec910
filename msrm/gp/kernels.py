r"""Matérn correlations of the GP prior on the latent grid, in JAX.

Each factor ``k`` has a unit-variance Matérn prior over the grid, ``K_k[j, j'] = k_nu(|tau_j - tau_j'|; l_k)``:

.. math::

    k_{1/2}(r) = e^{-r/\ell}, \qquad
    k_{3/2}(r) = (1 + \sqrt3 r/\ell)\, e^{-\sqrt3 r/\ell}, \qquad
    k_{5/2}(r) = (1 + \sqrt5 r/\ell + 5 r^2 / (3 \ell^2))\, e^{-\sqrt5 r/\ell}.

Distances ``r >= 0`` are static (prepared once from the grid), so every function here is smooth in ``l`` and
safe to differentiate (no ``sqrt`` of a squared distance at ``r = 0``).
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from ..spec import KERNELS

__all__ = ["matern", "kernel_matrices", "grid_distances"]

_SQRT3 = math.sqrt(3.0)
_SQRT5 = math.sqrt(5.0)


def matern(r, lengthscale, kernel: str):
    """Unit-variance Matérn correlation ``k_nu(r; l)``.

    Args:
        r: (...) non-negative distances in seconds (any array shape).
        lengthscale: scalar (or broadcastable) lengthscale ``l > 0`` in seconds.
        kernel: ``"matern12"``, ``"matern32"`` or ``"matern52"``.
    Returns:
        array of ``r``'s broadcast shape.
    """
    if kernel == "matern12":
        return jnp.exp(-r / lengthscale)
    if kernel == "matern32":
        s = _SQRT3 * r / lengthscale
        return (1.0 + s) * jnp.exp(-s)
    if kernel == "matern52":
        s = _SQRT5 * r / lengthscale
        return (1.0 + s + s * s / 3.0) * jnp.exp(-s)
    raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")


def kernel_matrices(dist, lengthscales, kernel: str):
    """The K prior correlation matrices over the grid.

    Args:
        dist: (J, J) static distances ``|tau_j - tau_j'|``.
        lengthscales: (K,) lengthscales.
        kernel: Matérn name.
    Returns:
        (K, J, J) matrices ``K_k``.
    """
    return matern(jnp.asarray(dist)[None, :, :], jnp.asarray(lengthscales)[:, None, None], kernel)


def grid_distances(grid: np.ndarray) -> np.ndarray:
    """(J, J) NumPy distances ``|tau_j - tau_j'|`` computed from grid indices (exactly Toeplitz)."""
    grid = np.asarray(grid, dtype=np.float64)
    step = float(grid[1] - grid[0]) if grid.size > 1 else 1.0
    j = np.arange(grid.size)
    return np.abs(j[:, None] - j[None, :]).astype(np.float64) * step
