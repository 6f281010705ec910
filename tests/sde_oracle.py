"""The grid covariance a discretised SDE implies, by running its recursion on the joint state (NumPy; an oracle
for the state-space kernels, compared with the kernels' closed-form correlation)."""
from __future__ import annotations

import numpy as np

from msrm.gp.state_space.sde import discretise


def implied_grid_cov(kernel: str, lengthscale: float, step: float, n: int) -> np.ndarray:
    """Covariance (n, n) of ``z`` on ``n`` grid points ``step`` apart implied by the discretised SDE.

    With a stationary start, ``Cov(s_i, s_j) = Φ^{j-i} P_i`` for ``j ≥ i``, where ``P_{i+1} = Φ P_i Φᵀ + Q`` from
    ``P_0 = P∞``; ``z`` is the first state."""
    Phi, Q, Pinf = discretise(kernel, float(lengthscale), float(step))
    d = Phi.shape[0]
    cov = np.zeros((n, n))
    P = Pinf.copy()
    powers = [np.eye(d)]
    for _ in range(n - 1):
        powers.append(Phi @ powers[-1])
    for i in range(n):
        for j in range(i, n):
            cov[i, j] = cov[j, i] = (powers[j - i] @ P)[0, 0]
        P = Phi @ P @ Phi.T + Q
    return cov
