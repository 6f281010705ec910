r"""Kernel matrices of the GP prior on the latent grid, in JAX.

Each factor ``k`` has a unit-variance prior over the grid, ``K_k[j, j'] = k(|tau_j - tau_j'|; l_k)`` with the
correlation of the spec's kernel (:mod:`msrm.kernels`, which defines every kernel's forms).

Distances ``r >= 0`` are static (prepared once from the grid), so every function here is smooth in ``l`` and
safe to differentiate (no ``sqrt`` of a squared distance at ``r = 0``).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ..kernels import get_kernel

__all__ = ["matern", "kernel_matrices", "grid_distances"]


def matern(r, lengthscale, kernel: str):
    """Unit-variance correlation ``k(r; l)`` of a registered kernel, in JAX.

    Args:
        r: (...) non-negative distances in seconds (any array shape).
        lengthscale: scalar (or broadcastable) lengthscale ``l > 0`` in seconds.
        kernel: a name in :data:`msrm.kernels.KERNELS`.
    Returns:
        array of ``r``'s broadcast shape.
    """
    return get_kernel(kernel).correlation(r, lengthscale, jnp)


def kernel_matrices(dist, lengthscales, kernel: str):
    """The K prior correlation matrices over the grid.

    Args:
        dist: (J, J) static distances ``|tau_j - tau_j'|``.
        lengthscales: (K,) lengthscales.
        kernel: kernel name.
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
