r"""Result types of the latent posterior and of posterior predictions (NumPy only; shared by every model).

:class:`LatentPosterior` is the Gaussian ``p(Z | Y, theta)`` of one run's latent factors on its grid, summarised
by its mean and marginal standard deviations (and, when asked for, the K x K covariance of the factors at each grid
point). :class:`Prediction` is the posterior predictive of one stream at every one of its samples, observed or
missing: ``y_{s,f}(t_i) | Y, theta`` is Gaussian with mean ``b_f + W_f^T E[x(t_i) | Y]`` and variance
``W_f^T Cov[x(t_i) | Y] W_f + sigma_f^2``; ``signal_sd`` is the same without the noise term (the uncertainty of
the model's mean response, what a band around a fitted curve shows).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["LatentPosterior", "Prediction"]


def _frozen(a, name: str, ndim: int | None = None) -> np.ndarray:
    arr = np.array(a, dtype=np.float64, copy=True)
    if ndim is not None and arr.ndim != ndim:
        raise ValueError(f"{name}: expected a {ndim}-d array, got shape {arr.shape}")
    arr.setflags(write=False)
    return arr


@dataclass(frozen=True, eq=False)
class LatentPosterior:
    """Posterior of one run's latent factors on its grid.

    Fields:
        grid: (J,) grid times in seconds (``msrm.latent_grid``).
        mean: (J, K) posterior mean ``E[Z | Y, theta]``.
        sd: (J, K) posterior marginal standard deviations.
        cov: (J, K, K) posterior covariance of the K factors at each grid point, or None when not requested.
    """

    grid: np.ndarray
    mean: np.ndarray
    sd: np.ndarray
    cov: np.ndarray | None = None

    def __post_init__(self):
        object.__setattr__(self, "grid", _frozen(self.grid, "LatentPosterior.grid", 1))
        object.__setattr__(self, "mean", _frozen(self.mean, "LatentPosterior.mean", 2))
        object.__setattr__(self, "sd", _frozen(self.sd, "LatentPosterior.sd", 2))
        J = self.grid.shape[0]
        if self.mean.shape[0] != J or self.sd.shape != self.mean.shape:
            raise ValueError(f"LatentPosterior: grid {self.grid.shape}, mean {self.mean.shape} and sd "
                             f"{self.sd.shape} must be (J,), (J, K), (J, K)")
        if self.cov is not None:
            cov = _frozen(self.cov, "LatentPosterior.cov", 3)
            if cov.shape != self.mean.shape + (self.mean.shape[1],):
                raise ValueError(f"LatentPosterior.cov: shape {cov.shape}, expected (J, K, K) = "
                                 f"{self.mean.shape + (self.mean.shape[1],)}")
            object.__setattr__(self, "cov", cov)

    @property
    def n_factors(self) -> int:
        return int(self.mean.shape[1])

    def __repr__(self) -> str:
        J, K = self.mean.shape
        return f"LatentPosterior(J={J}, K={K}, grid=[{self.grid[0]:g}, {self.grid[-1]:g}] s, cov={self.cov is not None})"


@dataclass(frozen=True, eq=False)
class Prediction:
    """Posterior predictive of one stream at every sample (missing samples included).

    Fields:
        mean: (n_samples, n_features) predictive mean.
        sd: (n_samples, n_features) predictive sd of a new observation (signal and noise).
        signal_sd: (n_samples, n_features) sd of the noiseless mean response ``b + W^T x(t)``, or None.
        times: (n_samples,) sample times in seconds, or None.
    """

    mean: np.ndarray
    sd: np.ndarray
    signal_sd: np.ndarray | None = None
    times: np.ndarray | None = None

    def __post_init__(self):
        object.__setattr__(self, "mean", _frozen(self.mean, "Prediction.mean", 2))
        object.__setattr__(self, "sd", _frozen(self.sd, "Prediction.sd", 2))
        if self.sd.shape != self.mean.shape:
            raise ValueError(f"Prediction: mean {self.mean.shape} and sd {self.sd.shape} differ in shape")
        if self.signal_sd is not None:
            s = _frozen(self.signal_sd, "Prediction.signal_sd", 2)
            if s.shape != self.mean.shape:
                raise ValueError(f"Prediction.signal_sd: shape {s.shape}, expected {self.mean.shape}")
            object.__setattr__(self, "signal_sd", s)
        if self.times is not None:
            t = _frozen(self.times, "Prediction.times", 1)
            if t.shape[0] != self.mean.shape[0]:
                raise ValueError(f"Prediction.times: {t.shape[0]} times for {self.mean.shape[0]} samples")
            object.__setattr__(self, "times", t)

    def __repr__(self) -> str:
        return f"Prediction(n_samples={self.mean.shape[0]}, n_features={self.mean.shape[1]})"
