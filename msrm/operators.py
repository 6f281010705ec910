"""The canonical response operator: weight rows over the latent grid.

For sample times ``t`` (n,), a response and its parameters ``theta``, the operator ``A`` (n, J) has rows

- Identity: ``A[i, j] = max(0, 1 - |t_i - tau_j| / Delta)`` (exact linear interpolation);
- Gaussian: ``A[i, j] = g_ij / sum_l g_il``, ``g_ij = exp(-(t_i - mu - tau_j)^2 / (2 sigma^2))`` normalised over
  the whole grid (computed as a softmax, so it never underflows to 0/0).

Three forms, one definition:

- :func:`response_weights` - dense NumPy over the whole grid (the reference);
- :func:`response_weights_csr` / :func:`response_weights_and_derivs_csr` - SciPy CSR on a fixed window
  (R-MSRM), with analytic derivatives in theta;
- :func:`window_layout` + :func:`jax_window_weights` - static-shape windows for JAX, differentiable in theta.

The fixed window of a Gaussian response covers ``[t - lag_max - 7.5 sigma_max, t - lag_min + 7.5 sigma_max]``,
so for every allowed (lag, width) it holds every grid point within 7.5 sigma of the centre; what it drops is below
``exp(-7.5^2/2) = 6.1e-13`` of the row's largest weight. The density stays smooth in theta (no hard cut-off that
moves with theta).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import scipy.sparse as sp

from .responses import WINDOW_SIGMAS, GaussianWidthLag, Identity, Response

__all__ = [
    "response_weights",
    "response_weights_csr",
    "response_weights_and_derivs_csr",
    "WindowLayout",
    "window_layout",
    "window_weights",
    "jax_window_weights",
]


def _grid_step(grid: np.ndarray) -> float:
    grid = np.asarray(grid, dtype=np.float64)
    if grid.ndim != 1 or grid.size < 2:
        raise ValueError(f"grid must be 1-D with at least 2 points, got shape {grid.shape}")
    return float(grid[1] - grid[0])


def _theta(response: Response, theta: dict | None) -> tuple[float, float]:
    return response.fixed_theta(response.check_theta(theta or {}, where=type(response).__name__))


def response_weights(times, response: Response, theta: dict | None, grid) -> np.ndarray:
    """Dense weight rows over the whole grid (the canonical definition).

    Args:
        times: (n,) sample times in seconds.
        response: Identity, GaussianLag or GaussianWidthLag.
        theta: {"lag": ..., "width": ...} as the response needs (ignored keys are an error).
        grid: (J,) latent grid.
    Returns:
        (n, J) float64 rows.
    """
    t = np.asarray(times, dtype=np.float64)[:, None]
    tau = np.asarray(grid, dtype=np.float64)[None, :]
    delta_grid = _grid_step(grid)
    if isinstance(response, Identity):
        response.check_theta(theta or {}, where="Identity")
        return np.maximum(0.0, 1.0 - np.abs(t - tau) / delta_grid)
    mu, sigma = _theta(response, theta)
    logits = -((t - mu - tau) ** 2) / (2.0 * sigma**2)
    logits -= logits.max(axis=1, keepdims=True)
    g = np.exp(logits)
    return g / g.sum(axis=1, keepdims=True)


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
    """Fixed windows wide enough for every parameter value the response's bounds allow."""
    t = np.asarray(times, dtype=np.float64)
    grid = np.asarray(grid, dtype=np.float64)
    d = _grid_step(grid)
    J = grid.size
    if isinstance(response, Identity):
        w = 2
        first = np.floor((t - grid[0]) / d + 1e-12).astype(np.int64)
    else:
        lag_lo, lag_hi = response.lag_range()
        s_max = response.width_range()[1]
        reach = WINDOW_SIGMAS * s_max
        w = int(math.floor((lag_hi - lag_lo + 2 * reach) / d + 1e-9)) + 2
        first = np.ceil((t - lag_hi - reach - grid[0]) / d - 1e-9).astype(np.int64)
    w = min(w, J)
    start = np.clip(first, 0, J - w)
    idx = start[:, None] + np.arange(w)[None, :]
    delta = t[:, None] - grid[idx]
    valid = np.ones_like(delta, dtype=bool)
    return WindowLayout(start=start, width=w, delta=delta, valid=valid, grid_step=d, n_grid=J)


def window_weights(response: Response, theta: dict | None, layout: WindowLayout, *, derivs: bool = False):
    """NumPy weights on a window layout: (n, w), and optionally {name: d weights / d name}."""
    if isinstance(response, Identity):
        response.check_theta(theta or {}, where="Identity")
        a = np.where(layout.valid, np.maximum(0.0, 1.0 - np.abs(layout.delta) / layout.grid_step), 0.0)
        return (a, {}) if derivs else a
    mu, sigma = _theta(response, theta)
    r = layout.delta - mu  # t - mu - tau
    logits = np.where(layout.valid, -(r**2) / (2.0 * sigma**2), -np.inf)
    logits = logits - logits.max(axis=1, keepdims=True)
    g = np.exp(logits)
    a = g / g.sum(axis=1, keepdims=True)
    if not derivs:
        return a
    # a = softmax(l): da/dθ = a * (dl/dθ - sum_i a_i dl_i/dθ)
    out = {}
    dl = {"lag": np.where(layout.valid, r / sigma**2, 0.0)}
    if "width" in response.param_names:
        dl["width"] = np.where(layout.valid, r**2 / sigma**3, 0.0)
    for name, dln in dl.items():
        out[name] = a * (dln - (a * dln).sum(axis=1, keepdims=True))
    return a, out


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
        theta: dict with the response's parameters as JAX scalars; for GaussianLag the fixed width is taken
            from the response. Ignored for Identity.
        response: the response.
        layout: from :func:`window_layout` (NumPy, prepared once).
    """
    import jax.numpy as jnp

    delta = jnp.asarray(layout.delta)
    valid = jnp.asarray(layout.valid)
    if isinstance(response, Identity):
        return jnp.where(valid, jnp.maximum(0.0, 1.0 - jnp.abs(delta) / layout.grid_step), 0.0)
    mu = theta["lag"]
    sigma = theta["width"] if isinstance(response, GaussianWidthLag) else response.width
    logits = jnp.where(valid, -((delta - mu) ** 2) / (2.0 * sigma**2), -jnp.inf)
    logits = logits - jnp.max(logits, axis=1, keepdims=True)
    g = jnp.exp(logits)
    return g / jnp.sum(g, axis=1, keepdims=True)


