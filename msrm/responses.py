r"""How each modality sees the latent factors: response kernels over the latent grid.

``x_m(t) = a_m(t; theta_m)^T Z`` with weights ``a`` over grid points ``tau_j``. A response class owns every
form of its weights that the models use:

* its parameter names and box bounds (:attr:`Response.param_names`, :attr:`Response.bounds`) and the grid
  padding its bounds need (:attr:`Response.max_support`);
* the weights as a function of ``delta = t - tau`` on a window of grid points, in NumPy or JAX
  (:meth:`Response.weights`), and their analytic derivatives in each parameter (:meth:`Response.weight_derivs`);
* the fixed window that holds every weight the bounds allow (:meth:`Response.window`);
* what the state-space backend needs: whether its rows are two-tap interpolation (:attr:`Response.two_tap`,
  read exactly from a one-slot ring) and a probe set of parameters spanning the bounds
  (:meth:`Response.probe_thetas`, used to design a filter-bank embedding).

The responses:

- :class:`Identity`: linear interpolation, ``a_j = max(0, 1 - |t - tau_j| / Delta)``.
- :class:`GaussianLag`: ``a_j = g_j / sum_i g_i``, ``g_j = exp(-(t - mu - tau_j)^2 / (2 sigma^2))`` with the lag
  ``mu`` estimated in ``lag_bounds`` and the width ``sigma`` fixed.
- :class:`GaussianWidthLag`: the same with both ``mu`` and ``sigma`` estimated.

A positive lag means the modality responds later than the latent. :data:`RESPONSES` maps each class's name (the
``"type"`` of :meth:`msrm.ModelSpec.to_dict`) to the class; a new response is a subclass plus one registry line.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, fields

import numpy as np

__all__ = ["Response", "Identity", "GaussianLag", "GaussianWidthLag", "WINDOW_SIGMAS", "RESPONSES",
           "register_response", "get_response", "response_from_dict", "check_bounds", "grid_step"]

# Fixed windows keep every grid point within WINDOW_SIGMAS widths of the centre: exp(-7.5^2 / 2) = 6.1e-13, so
# the weights a window drops are below 1e-12 of the row's largest weight for every allowed (lag, width).
WINDOW_SIGMAS = 7.5


def check_bounds(name: str, bounds, *, positive: bool = False) -> tuple[float, float]:
    """A (low, high) pair of finite numbers with low < high (and low > 0 when ``positive``); ValueError naming
    ``name`` otherwise."""
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


def grid_step(grid) -> float:
    """Delta of a regular grid (1-D, at least two points)."""
    grid = np.asarray(grid, dtype=np.float64)
    if grid.ndim != 1 or grid.size < 2:
        raise ValueError(f"grid must be 1-D with at least 2 points, got shape {grid.shape}")
    return float(grid[1] - grid[0])


class Response:
    """Base class: a response kernel with named parameters and box bounds (see the module docstring).

    Subclasses are frozen dataclasses whose fields are their fixed settings (serialised by
    :meth:`to_dict`); they implement :meth:`weights`, :meth:`weight_derivs` and either :meth:`support` or
    :meth:`window`.
    """

    param_names: tuple[str, ...] = ()
    #: rows touch two adjacent grid points (linear interpolation): the state space reads them exactly from a
    #: one-slot ring, whatever embedding it uses for the other responses
    two_tap: bool = False

    @property
    def name(self) -> str:
        """The registry name, ``type(self).__name__``."""
        return type(self).__name__

    @property
    def bounds(self) -> dict[str, tuple[float, float]]:
        return {}

    @property
    def max_support(self) -> float:
        """Largest reach before the sample time that the bounds allow (seconds), for the grid's padding."""
        return 0.0

    # ---------------------------------------------------------------- parameters
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

    def probe_thetas(self) -> list[dict[str, float]]:
        """Parameter values spanning the bounds: 5 values of the first parameter by 3 of each other one, in
        ``param_names`` order (the first varies slowest)."""
        axes = [np.linspace(*self.bounds[n], 5 if i == 0 else 3) for i, n in enumerate(self.param_names)]
        return [dict(zip(self.param_names, (float(v) for v in vals))) for vals in itertools.product(*axes)]

    # ---------------------------------------------------------------- weights
    def support(self) -> tuple[float, float]:
        """``(before, after)``: every weight the bounds allow lies on grid points in ``[t - before, t + after]``."""
        raise NotImplementedError(f"{self.name} defines neither support() nor window()")

    def window(self, times: np.ndarray, grid: np.ndarray) -> tuple[np.ndarray, int]:
        """First grid index of each sample's window (before clipping to the grid) and the window length ``w``.

        The default covers :meth:`support`: ``w = floor((before + after) / Delta) + 2`` points starting at the
        first grid point at or after ``t - before``.
        """
        before, after = self.support()
        d = grid_step(grid)
        w = int(math.floor((before + after) / d + 1e-9)) + 2
        first = np.ceil((np.asarray(times, dtype=np.float64) - before - grid[0]) / d - 1e-9).astype(np.int64)
        return first, w

    def weights(self, delta, valid, theta, step: float, xp=np):
        """Weights (n, w) of the rows on their windows.

        Args:
            delta: (n, w) ``t_i - tau`` at each window position (seconds).
            valid: (n, w) True where the position is on the grid (the weights are 0 elsewhere).
            theta: the parameters as a dict of scalars (NumPy floats or traced JAX scalars); not checked here.
            step: the grid step Delta.
            xp: ``numpy`` or ``jax.numpy``.
        """
        raise NotImplementedError

    def weight_derivs(self, delta, valid, theta, step: float) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """NumPy weights (n, w) and ``{name: d weights / d name}`` for every parameter."""
        raise NotImplementedError

    # ---------------------------------------------------------------- serialisation
    def to_dict(self) -> dict:
        """``{"type": name, <field>: value, ...}`` (tuples as lists), the archive form."""
        d = {"type": self.name}
        for f in fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            d[f.name] = list(v) if isinstance(v, tuple) else v
        return d


def get_response(name: str) -> type[Response]:
    """The registered response class called ``name``; ValueError naming the known ones otherwise."""
    try:
        return RESPONSES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown response type {name!r}; known: {sorted(RESPONSES)}") from None


def response_from_dict(d: dict) -> Response:
    """Inverse of :meth:`Response.to_dict`."""
    d = dict(d)
    cls = get_response(d.pop("type", None))
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


@dataclass(frozen=True)
class Identity(Response):
    """Linear interpolation of the latent grid at the sample time (no parameters)."""

    param_names = ()
    two_tap = True

    def window(self, times, grid):
        d = grid_step(grid)
        return np.floor((np.asarray(times, dtype=np.float64) - grid[0]) / d + 1e-12).astype(np.int64), 2

    def weights(self, delta, valid, theta, step, xp=np):
        return xp.where(valid, xp.maximum(0.0, 1.0 - xp.abs(delta) / step), 0.0)

    def weight_derivs(self, delta, valid, theta, step):
        return self.weights(delta, valid, theta, step), {}


class _Gaussian(Response):
    """Normalised discrete Gaussian ``a_j = softmax_j(-(t - mu - tau_j)^2 / (2 sigma^2))`` over the window
    (a softmax, so it never underflows to 0/0)."""

    def lag_width(self, theta):
        """(mu, sigma) from a parameter dict."""
        raise NotImplementedError

    def width_max(self) -> float:
        raise NotImplementedError

    def support(self):
        lo, hi = self.lag_bounds  # type: ignore[attr-defined]
        reach = WINDOW_SIGMAS * self.width_max()
        return hi + reach, reach - lo

    @property
    def max_support(self) -> float:
        return max(0.0, self.lag_bounds[1] + 4.0 * self.width_max())  # type: ignore[attr-defined]

    def weights(self, delta, valid, theta, step, xp=np):
        mu, sigma = self.lag_width(theta)
        logits = xp.where(valid, -((delta - mu) ** 2) / (2.0 * sigma**2), -xp.inf)
        logits = logits - xp.max(logits, axis=1, keepdims=True)
        g = xp.exp(logits)
        return g / xp.sum(g, axis=1, keepdims=True)

    def weight_derivs(self, delta, valid, theta, step):
        mu, sigma = self.lag_width(theta)
        a = self.weights(delta, valid, theta, step)
        r = delta - mu  # t - mu - tau
        # a = softmax(l): da/dθ = a * (dl/dθ - sum_i a_i dl_i/dθ)
        dl = {"lag": np.where(valid, r / sigma**2, 0.0)}
        if "width" in self.param_names:
            dl["width"] = np.where(valid, r**2 / sigma**3, 0.0)
        return a, {name: a * (dln - (a * dln).sum(axis=1, keepdims=True)) for name, dln in dl.items()}


@dataclass(frozen=True)
class GaussianLag(_Gaussian):
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
        object.__setattr__(self, "lag_bounds", check_bounds("GaussianLag lag_bounds", self.lag_bounds))

    @property
    def bounds(self) -> dict[str, tuple[float, float]]:
        return {"lag": self.lag_bounds}

    def width_max(self) -> float:
        return self.width

    def lag_width(self, theta):
        return theta["lag"], self.width


@dataclass(frozen=True)
class GaussianWidthLag(_Gaussian):
    """Normalised discrete Gaussian centred at ``t - lag`` with lag and width both estimated."""

    lag_bounds: tuple[float, float] = (0.0, 10.0)
    width_bounds: tuple[float, float] = (0.5, 5.0)
    param_names = ("lag", "width")

    def __post_init__(self) -> None:
        object.__setattr__(self, "lag_bounds", check_bounds("GaussianWidthLag lag_bounds", self.lag_bounds))
        object.__setattr__(
            self, "width_bounds", check_bounds("GaussianWidthLag width_bounds", self.width_bounds, positive=True)
        )

    @property
    def bounds(self) -> dict[str, tuple[float, float]]:
        return {"lag": self.lag_bounds, "width": self.width_bounds}

    def width_max(self) -> float:
        return self.width_bounds[1]

    def lag_width(self, theta):
        return theta["lag"], theta["width"]


RESPONSES: dict[str, type[Response]] = {}


def register_response(cls: type[Response]) -> type[Response]:
    """Add a response class to the registry under its class name (an existing name is an error)."""
    if not (isinstance(cls, type) and issubclass(cls, Response)):
        raise ValueError(f"register_response takes a Response subclass, got {cls!r}")
    if cls.__name__ in RESPONSES:
        raise ValueError(f"response {cls.__name__!r} is already registered")
    RESPONSES[cls.__name__] = cls
    return cls


register_response(Identity)
register_response(GaussianLag)
register_response(GaussianWidthLag)
