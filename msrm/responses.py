"""How each modality sees the latent factors: response kernels over the latent grid.

``x_m(t) = a_m(t; theta_m)^T Z`` with weights ``a`` over grid points ``tau_j``:

- :class:`Identity`: linear interpolation, ``a_j = max(0, 1 - |t - tau_j| / Delta)``.
- :class:`GaussianLag`: ``a_j = g_j / sum_i g_i``, ``g_j = exp(-(t - mu - tau_j)^2 / (2 sigma^2))`` with the lag
  ``mu`` estimated in ``lag_bounds`` and the width ``sigma`` fixed.
- :class:`GaussianWidthLag`: the same with both ``mu`` and ``sigma`` estimated.

A positive lag means the modality responds later than the latent.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Response", "Identity", "GaussianLag", "GaussianWidthLag", "WINDOW_SIGMAS"]

# Fixed windows keep every grid point within WINDOW_SIGMAS widths of the centre: exp(-7.5^2 / 2) = 6.1e-13, so
# the weights a window drops are below 1e-12 of the row's largest weight for every allowed (lag, width).
WINDOW_SIGMAS = 7.5


def _check_bounds(name: str, bounds, *, positive: bool = False) -> tuple[float, float]:
    try:
        lo, hi = (float(b) for b in bounds)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a pair (low, high) of numbers, got {bounds!r}") from None
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError(f"{name} must be finite, got {bounds!r}")
    if lo >= hi:
        raise ValueError(f"{name} must have low < high, got {bounds!r}")
    if positive and lo <= 0:
        raise ValueError(f"{name} must be > 0, got {bounds!r}")
    return lo, hi


class Response:
    """Base class: a response kernel with named parameters and box bounds."""

    param_names: tuple[str, ...] = ()

    @property
    def bounds(self) -> dict[str, tuple[float, float]]:
        return {}

    @property
    def max_support(self) -> float:
        """Largest reach before the sample time that the bounds allow (seconds): lag_max + 4 * width_max."""
        return 0.0

    def width_range(self) -> tuple[float, float]:
        raise NotImplementedError

    def lag_range(self) -> tuple[float, float]:
        raise NotImplementedError

    def check_theta(self, theta: dict, where: str) -> dict[str, float]:
        """Validate a parameter dict for this response (names and bounds); return floats."""
        theta = dict(theta or {})
        unknown = set(theta) - set(self.param_names)
        if unknown:
            raise KeyError(f"{where}: unknown response parameter(s) {sorted(unknown)}; expected {list(self.param_names)}")
        missing = set(self.param_names) - set(theta)
        if missing:
            raise KeyError(f"{where}: missing response parameter(s) {sorted(missing)}")
        out = {}
        for name in self.param_names:
            try:
                v = float(theta[name])
            except (TypeError, ValueError):
                raise ValueError(f"{where}: {name} must be a number, got {theta[name]!r}") from None
            lo, hi = self.bounds[name]
            if not math.isfinite(v) or v < lo or v > hi:
                raise ValueError(f"{where}: {name}={v!r} is outside its bounds [{lo}, {hi}]")
            out[name] = v
        return out

    def fixed_theta(self, theta: dict) -> tuple[float, float]:
        """(lag, width) for a Gaussian response, from a checked theta dict."""
        raise NotImplementedError


@dataclass(frozen=True)
class Identity(Response):
    """Linear interpolation of the latent grid at the sample time (no parameters)."""

    param_names = ()


@dataclass(frozen=True)
class GaussianLag(Response):
    """Normalised discrete Gaussian centred at ``t - lag``; lag estimated, width fixed.

    Args:
        width: sigma in seconds (> 0).
        lag_bounds: (low, high) seconds.
    """

    width: float = 1.0
    lag_bounds: tuple[float, float] = (0.0, 10.0)
    param_names = ("lag",)

    def __post_init__(self) -> None:
        w = float(self.width) if isinstance(self.width, (int, float)) else float("nan")
        if not math.isfinite(w) or w <= 0:
            raise ValueError(f"GaussianLag width must be finite and > 0, got {self.width!r}")
        object.__setattr__(self, "width", w)
        object.__setattr__(self, "lag_bounds", _check_bounds("GaussianLag lag_bounds", self.lag_bounds))

    @property
    def bounds(self) -> dict[str, tuple[float, float]]:
        return {"lag": self.lag_bounds}

    @property
    def max_support(self) -> float:
        return max(0.0, self.lag_bounds[1] + 4.0 * self.width)

    def width_range(self) -> tuple[float, float]:
        return (self.width, self.width)

    def lag_range(self) -> tuple[float, float]:
        return self.lag_bounds

    def fixed_theta(self, theta: dict) -> tuple[float, float]:
        return float(theta["lag"]), self.width


@dataclass(frozen=True)
class GaussianWidthLag(Response):
    """Normalised discrete Gaussian centred at ``t - lag`` with lag and width both estimated."""

    lag_bounds: tuple[float, float] = (0.0, 10.0)
    width_bounds: tuple[float, float] = (0.5, 5.0)
    param_names = ("lag", "width")

    def __post_init__(self) -> None:
        object.__setattr__(self, "lag_bounds", _check_bounds("GaussianWidthLag lag_bounds", self.lag_bounds))
        object.__setattr__(
            self, "width_bounds", _check_bounds("GaussianWidthLag width_bounds", self.width_bounds, positive=True)
        )

    @property
    def bounds(self) -> dict[str, tuple[float, float]]:
        return {"lag": self.lag_bounds, "width": self.width_bounds}

    @property
    def max_support(self) -> float:
        return max(0.0, self.lag_bounds[1] + 4.0 * self.width_bounds[1])

    def width_range(self) -> tuple[float, float]:
        return self.width_bounds

    def lag_range(self) -> tuple[float, float]:
        return self.lag_bounds

    def fixed_theta(self, theta: dict) -> tuple[float, float]:
        return float(theta["lag"]), float(theta["width"])
