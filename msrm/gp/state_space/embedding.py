r"""Response embeddings: how the state carries what a node's response window reads from the latent grid.

A node whose window covers grid points ``s .. s + w - 1`` sees ``x = sum_p a_p z_{s+p}``; it is absorbed at the
step ``j = s + w - 1`` where its window ends, as the filter ``x = sum_q h_q z_{j-q}`` with ``h_q = a_{w-1-q}``.

* **exact** (default): a delay line. The grid values ``z_j`` the windows can reach live in a ring of ``N`` slots
  per factor (slot ``j mod N``; :mod:`.prepare` sizes it for every window that ends inside a block of steps),
  so moving forward writes new slots instead of shifting the whole line. Every window the bounds allow is read
  exactly: the density equals the grouped one up to rounding.
* **laguerre** / **rational**: a bank of ``n`` states per factor driven by the grid values,
  ``xi_j = M xi_{j-1} + v z_j`` (a generalised orthonormal basis: first-order all-pass sections with poles
  ``p_0 .. p_{n-1}``; ``xi_j[i] = sum_q g_i[q] z_{j-q}``). A Gaussian node reads ``x ≈ c^T xi_j`` with ``c`` the
  least-squares projection of its window filter ``h`` on the basis impulse responses ``g_i`` (over a horizon of
  several windows, so the bank's tail is penalised). ``laguerre`` repeats one pole, tuned once in NumPy to the
  responses the bounds allow; ``rational`` uses ``n`` distinct real poles ``exp(-Δ/τ_i)`` with time constants
  spread geometrically from Δ/2 to the widest window (a fixed-pole rational approximation of each window's
  transfer function, the Kautz/Takenaka-Malmquist construction; not a Padé approximant, whose poles would move
  with the lag). Both approximate the *discrete* response filter of the exact density, not a continuous
  convolution; two-tap responses (Identity, :attr:`~msrm.responses.Response.two_tap`) stay exact through a one-slot ring. With pole 0 the basis is the
  unit delays, so a Laguerre bank with ``n >= w`` and ``p = 0`` is again exact.
"""
from __future__ import annotations

import math

import numpy as np

from ...operators import window_layout, window_weights
from ...responses import Response

__all__ = ["EMBEDDINGS", "bank_realisation", "bank_impulse", "projection", "laguerre_pole", "rational_poles",
           "design_bank"]

EMBEDDINGS = ("exact", "rational", "laguerre")


def bank_realisation(poles) -> tuple[np.ndarray, np.ndarray]:
    """State-space form ``xi_j = M xi_{j-1} + v z_j`` of the orthonormal basis with the given poles.

    Section i has the internal state ``s_i`` with ``s_i[j] = p_i s_i[j-1] + u_i[j]``, input ``u_0 = z`` and
    ``u_{i+1}[j] = s_i[j-1] - p_i s_i[j]`` (the all-pass ``(ζ - p_i)/(1 - p_i ζ)``, ζ = unit delay); the
    basis output is ``xi_i = sqrt(1 - p_i^2) s_i``.

    Returns:
        M (n, n), v (n,).
    """
    p = np.asarray(poles, dtype=np.float64)
    n = p.size
    if n < 1 or np.any(np.abs(p) >= 1.0):
        raise ValueError(f"bank poles must be a non-empty set inside (-1, 1), got {p}")
    prev = np.diag(p)
    cur = np.zeros((n, n))
    for i in range(1, n):
        prev[i, i - 1] = 1.0
        cur[i, i - 1] = -p[i - 1]
    lhs = np.eye(n) - cur  # lower triangular
    M = np.linalg.solve(lhs, prev)
    e0 = np.zeros(n)
    e0[0] = 1.0
    v = np.linalg.solve(lhs, e0)
    scale = np.sqrt(1.0 - p * p)
    return scale[:, None] * M / scale[None, :], scale * v


def bank_impulse(M: np.ndarray, v: np.ndarray, horizon: int) -> np.ndarray:
    """Impulse responses ``G[q, i] = g_i[q]`` of the bank, q = 0 .. horizon - 1."""
    G = np.zeros((horizon, v.size))
    xi = v.copy()
    for q in range(horizon):
        G[q] = xi
        xi = M @ xi
    return G


def projection(G: np.ndarray, width: int) -> np.ndarray:
    """Least-squares readout ``c = P h`` for window filters ``h`` of length ``width`` (P: (n, width))."""
    return np.linalg.pinv(G)[:, :width]


def _probe_filters(response: Response, grid_step: float, width_cap: int) -> np.ndarray:
    """Window filters ``h`` (rows, reversed windows) over the response's probe parameters
    (:meth:`~msrm.responses.Response.probe_thetas`) and sub-grid offsets."""
    grid = np.arange(max(4 * width_cap, 64), dtype=np.float64) * grid_step
    times = grid[2 * width_cap] + grid_step * np.array([0.0, 0.25, 0.5, 0.75])
    layout = window_layout(times, response, grid)
    rows = [window_weights(response, theta, layout)[:, ::-1] for theta in response.probe_thetas()]
    return np.concatenate(rows)


def _worst_residual(G: np.ndarray, H: list[np.ndarray]) -> float:
    Pfull = np.linalg.pinv(G)
    worst = 0.0
    for h in H:
        hp = np.zeros((h.shape[0], G.shape[0]))
        hp[:, : h.shape[1]] = h
        res = hp - (hp @ Pfull.T) @ G.T
        worst = max(worst, float(np.max(np.linalg.norm(res, axis=1) / np.linalg.norm(hp, axis=1))))
    return worst


def laguerre_pole(n: int, probes: list[np.ndarray], horizon: int) -> float:
    """The single pole in [0, 0.97] whose n-state Laguerre basis fits the probe filters best (worst case)."""
    best, best_err = 0.0, math.inf
    for a in np.linspace(0.0, 0.97, 98):
        G = bank_impulse(*bank_realisation(np.full(n, a)), horizon)
        err = _worst_residual(G, probes)
        if err < best_err:
            best, best_err = float(a), err
    return best


def rational_poles(n: int, grid_step: float, widest: int) -> np.ndarray:
    """n distinct real poles ``exp(-Δ/τ_i)``, τ geometric from Δ/2 to the widest window (seconds)."""
    taus = np.geomspace(grid_step / 2.0, max(widest, 2) * grid_step, n) if n > 1 else np.array([grid_step])
    return np.exp(-grid_step / taus)


def design_bank(kind: str, n: int, responses: list[Response], widths: list[int], grid_step: float):
    """Poles, realisation and horizon of a bank serving the given Gaussian responses.

    Returns:
        dict with ``poles`` (n,), ``M`` (n, n), ``v`` (n,), ``horizon`` int, ``G`` (horizon, n).
    """
    widest = max(widths)
    horizon = 4 * widest
    if kind == "laguerre":
        probes = [_probe_filters(r, grid_step, w) for r, w in zip(responses, widths) if not r.two_tap]
        poles = np.full(n, laguerre_pole(n, probes, horizon))
    elif kind == "rational":
        poles = rational_poles(n, grid_step, widest)
    else:
        raise ValueError(f"response_embedding must be one of {EMBEDDINGS}, got {kind!r}")
    M, v = bank_realisation(poles)
    return {"poles": poles, "M": M, "v": v, "horizon": horizon, "G": bank_impulse(M, v, horizon)}
