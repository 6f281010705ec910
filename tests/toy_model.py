"""A conjugate-Gaussian model with the GPMSRM protocol, for testing MAP, NUTS, archives and diagnostics.

Unconstrained vector ``u`` (d,) = (beta (F*K,), log_scale (1,)). Prior ``u ~ N(0, tau^2 I)``; data
``y = A u + eps``, ``eps ~ N(0, s^2 I)``. The posterior is exactly Gaussian:
``Sigma = (A^T A / s^2 + I / tau^2)^{-1}``, ``mu = Sigma A^T y / s^2``. Physical parameters are
``beta`` reshaped (F, K) and ``scale = exp(log_scale)`` (log-normal marginal: mean ``exp(mu + v/2)``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ToyParams:
    """Stand-in for msrm.Params: beta (F, K) and scale > 0."""

    beta: np.ndarray
    scale: float

    def flatten(self) -> dict[str, np.ndarray]:
        return {"beta": np.asarray(self.beta, dtype=float), "scale": np.asarray(self.scale, dtype=float)}

    @classmethod
    def unflatten(cls, flat) -> "ToyParams":
        return cls(beta=np.asarray(flat["beta"]), scale=float(np.asarray(flat["scale"])))


class ToyModel:
    """Protocol: num_params, log_density, value_and_grad, constrain, unconstrain, initial_params, prior_draw,
    param_dims, guard_events, execution_info, data, spec, linear_algebra (and pointwise_log_likelihood)."""

    linear_algebra = "toy"
    spec = None

    def __init__(self, n_obs: int = 40, F: int = 2, K: int = 2, tau: float = 2.0, noise: float = 0.5, seed: int = 0,
                 nonfinite_beyond: float | None = None):
        import jax
        import jax.numpy as jnp

        rng = np.random.default_rng(seed)
        self.F, self.K = F, K
        self.num_params = F * K + 1
        self.tau, self.noise = tau, noise
        self.A = rng.standard_normal((n_obs, self.num_params))
        self.u_true = rng.normal(0.0, 1.0, self.num_params)
        self.y = self.A @ self.u_true + noise * rng.standard_normal(n_obs)
        self.data = {"y": self.y}
        self.nonfinite_beyond = nonfinite_beyond
        prec = self.A.T @ self.A / noise**2 + np.eye(self.num_params) / tau**2
        self.post_cov = np.linalg.inv(prec)
        self.post_mean = self.post_cov @ self.A.T @ self.y / noise**2
        self._events = {"jitter": 0, "fallback": 0}
        A, y = jnp.asarray(self.A), jnp.asarray(self.y)

        def log_density(u):
            r = y - A @ u
            ld = -0.5 * jnp.sum(r**2) / noise**2 - 0.5 * jnp.sum(u**2) / tau**2
            if nonfinite_beyond is not None:  # a region where the density cannot be evaluated
                ld = jnp.where(jnp.max(jnp.abs(u)) > nonfinite_beyond, jnp.nan, ld)
            return ld

        def pointwise(u):
            r = y - A @ u
            return {"y": -0.5 * r**2 / noise**2 - 0.5 * jnp.log(2 * jnp.pi * noise**2)}

        self.log_density = log_density
        self._vg = jax.jit(jax.value_and_grad(log_density))
        self._pointwise = jax.jit(pointwise)
        self.num_value_and_grad = 0

    def value_and_grad(self, u):
        self.num_value_and_grad += 1
        v, g = self._vg(np.asarray(u, dtype=float))
        return float(v), np.asarray(g)

    def pointwise_log_likelihood(self, u):
        return {k: np.asarray(v) for k, v in self._pointwise(np.asarray(u, dtype=float)).items()}

    def constrain(self, u) -> ToyParams:
        u = np.asarray(u, dtype=float)
        return ToyParams(beta=u[:-1].reshape(self.F, self.K), scale=float(np.exp(u[-1])))

    def unconstrain(self, params: ToyParams) -> np.ndarray:
        return np.concatenate([np.ravel(params.beta), [np.log(params.scale)]])

    def initial_params(self, seed: int = 0) -> ToyParams:
        return self.constrain(np.zeros(self.num_params))

    def prior_draw(self, seed: int) -> np.ndarray:
        return np.random.default_rng(seed).normal(0.0, self.tau, self.num_params)

    def param_dims(self) -> dict:
        return {
            "beta": (("feature", "factor"), {"feature": [f"f{i}" for i in range(self.F)], "factor": list(range(self.K))}),
            "scale": ((), {}),
        }

    def guard_events(self) -> dict:
        return dict(self._events)

    def observed_summary(self) -> dict:
        return {"y": self.y}

    def execution_info(self) -> dict:
        from msrm.runtime import execution_info

        return execution_info()

    # exact posterior in physical units
    def posterior_mean_physical(self) -> dict[str, np.ndarray]:
        m, v = self.post_mean, np.diag(self.post_cov)
        return {"beta": m[:-1].reshape(self.F, self.K), "scale": np.exp(m[-1] + v[-1] / 2)}
