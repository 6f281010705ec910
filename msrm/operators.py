"""The canonical response operator: weight rows over the latent grid.

For sample times ``t`` (n,), a response and its parameters ``theta``, the operator ``A`` (n, J) has the rows
the response defines as a function of ``t_i - tau_j`` (:meth:`msrm.responses.Response.weights`), e.g.

- Identity: ``A[i, j] = max(0, 1 - |t_i - tau_j| / Delta)`` (exact linear interpolation);
- Gaussian: ``A[i, j] = g_ij / sum_l g_il``, ``g_ij = exp(-(t_i - mu - tau_j)^2 / (2 sigma^2))`` normalised over
  the whole grid (computed as a softmax, so it never underflows to 0/0).

Nothing here depends on which response it is: the functions below lay out grid windows and ask the response.

Three forms, one definition:

- :func:`response_weights` - dense NumPy over the whole grid (the reference);
- :func:`response_weights_csr` / :func:`response_weights_and_derivs_csr` - SciPy CSR on a fixed window
  (R-MSRM), with analytic derivatives in theta;
- :func:`window_layout` + :func:`jax_window_weights` - static-shape windows for JAX, differentiable in theta.

Each response fixes its window from its bounds (:meth:`msrm.responses.Response.window`). A Gaussian's covers
``[t - lag_max - 7.5 sigma_max, t - lag_min + 7.5 sigma_max]``, so for every allowed (lag, width) it holds every
grid point within 7.5 sigma of the centre; what it drops is below ``exp(-7.5^2/2) = 6.1e-13`` of the row's
largest weight. The density stays smooth in theta (no hard cut-off that moves with theta).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import scipy.sparse as sp

from .responses import Response, grid_step

__all__ = [
    "response_weights",
    "response_weights_csr",
    "response_weights_and_derivs_csr",
    "WindowLayout",
    "window_layout",
    "window_weights",
    "jax_window_weights",
]


def _checked(response: Response, theta: dict | None) -> dict[str, float]:
    return response.check_theta(theta or {}, where=response.name)


def response_weights(times, response: Response, theta: dict | None, grid) -> np.ndarray:
    """Dense weight rows over the whole grid (the canonical definition).

    Args:
        times: (n,) sample times in seconds.
        response: a :class:`~msrm.responses.Response`.
        theta: its parameters, e.g. {"lag": ..., "width": ...} (unknown keys are an error).
        grid: (J,) latent grid.
    Returns:
        (n, J) float64 rows.
    """
    d = grid_step(grid)
    theta = _checked(response, theta)
    delta = np.asarray(times, dtype=np.float64)[:, None] - np.asarray(grid, dtype=np.float64)[None, :]
    return response.weights(delta, np.ones(delta.shape, dtype=bool), theta, d)


class WindowLayout(NamedTuple):
    """Static-shape windows of a response over the grid.

    Fields:
        start: (n,) first grid index of each row's window.
        width: window length w (static; the same for every row).
        delta: (n, w) ``t_i - tau[start_i + p]`` in seconds.
        valid: (n, w) True where the window position exists on the grid.
        grid_step: Delta in seconds.
        n_grid: J.
    """

    start: np.ndarray
    width: int
    delta: np.ndarray
    valid: np.ndarray
    grid_step: float
    n_grid: int


def window_layout(times, response: Response, grid) -> WindowLayout:
    """Fixed windows wide enough for every parameter value the response's bounds allow, clipped to the grid."""
    t = np.asarray(times, dtype=np.float64)
    grid = np.asarray(grid, dtype=np.float64)
    d = grid_step(grid)
    J = grid.size
    first, w = response.window(t, grid)
    w = min(int(w), J)
    start = np.clip(first, 0, J - w)
    idx = start[:, None] + np.arange(w)[None, :]
    delta = t[:, None] - grid[idx]
    valid = np.ones_like(delta, dtype=bool)
    return WindowLayout(start=start, width=w, delta=delta, valid=valid, grid_step=d, n_grid=J)


def window_weights(response: Response, theta: dict | None, layout: WindowLayout, *, derivs: bool = False):
    """NumPy weights on a window layout: (n, w), and optionally {name: d weights / d name}."""
    theta = _checked(response, theta)
    if derivs:
        return response.weight_derivs(layout.delta, layout.valid, theta, layout.grid_step)
    return response.weights(layout.delta, layout.valid, theta, layout.grid_step)


def _csr(layout: WindowLayout, vals: np.ndarray) -> sp.csr_matrix:
    n, w = vals.shape
    cols = (layout.start[:, None] + np.arange(w)[None, :]).ravel()
    indptr = np.arange(0, n * w + 1, w)
    return sp.csr_matrix((vals.ravel(), cols, indptr), shape=(n, layout.n_grid))


def response_weights_csr(times, response: Response, theta: dict | None, grid) -> sp.csr_matrix:
    """Weight rows as a SciPy CSR matrix (n, J) on the fixed window."""
    layout = window_layout(times, response, grid)
    return _csr(layout, window_weights(response, theta, layout))


def response_weights_and_derivs_csr(times, response: Response, theta: dict | None, grid):
    """CSR weights and their analytic derivatives in each response parameter.

    Returns:
        (A, {name: dA/dname}) with every matrix (n, J) CSR on the same sparsity pattern.
    """
    layout = window_layout(times, response, grid)
    a, da = window_weights(response, theta, layout, derivs=True)
    return _csr(layout, a), {k: _csr(layout, v) for k, v in da.items()}


def jax_window_weights(theta, response: Response, layout: WindowLayout):
    """JAX weights (n, w) on a static layout, differentiable in theta.

    Args:
        theta: dict with the response's parameters as JAX scalars (empty for a response without parameters).
        response: the response.
        layout: from :func:`window_layout` (NumPy, prepared once).
    """
    import jax.numpy as jnp

    return response.weights(jnp.asarray(layout.delta), jnp.asarray(layout.valid), theta, layout.grid_step, jnp)
