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
- :class:`HRF`: SPM's canonical double-gamma haemodynamic response ``h(s) = g(s; 6, 1) - g(s; 16, 1) / 6``
  sampled at ``s = (t - tau_j - delay) / dispersion`` and normalised over the grid; ``delay`` estimated,
  ``dispersion`` estimated or fixed at 1. Its weights are negative in the undershoot.

A positive lag (delay) means the modality responds later than the latent. :data:`RESPONSES` maps each class's
registry name (:attr:`Response.type_name`, by default the class name; the ``"type"`` of
:meth:`msrm.ModelSpec.to_dict`) to the class; a new response is a subclass plus one registry line.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, fields
from typing import ClassVar

import numpy as np

__all__ = ["Response", "Identity", "GaussianLag", "GaussianWidthLag", "HRF", "WINDOW_SIGMAS", "HRF_SUPPORT",
           "HRF_LEAD", "HRF_STEP", "RESPONSES", "register_response", "get_response", "response_from_dict",
           "check_bounds", "grid_step", "registry_name"]

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
    #: the registry name and the ``"type"`` of :meth:`to_dict`; None means the class name
    type_name: ClassVar[str | None] = None
    #: every weight is >= 0 (each row is a weighted average of the grid values)
    nonnegative: ClassVar[bool] = True
    #: rows touch two adjacent grid points (linear interpolation): the state space reads them exactly from a
    #: one-slot ring, whatever embedding it uses for the other responses
    two_tap: bool = False

    @property
    def name(self) -> str:
        """The registry name: :attr:`type_name`, or the class name when that is None."""
        return registry_name(type(self))

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


def registry_name(cls: type[Response]) -> str:
    """The name a response class is registered under: its ``type_name``, else its class name."""
    return cls.type_name or cls.__name__


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


# The double gamma's constants: a gamma density of shape a and scale 1 is s^(a-1) e^(-s) / (a-1)!, so the peak
# (shape 6) is s^5 e^-s / 5! and the undershoot (shape 16, ratio 1/6) is s^15 e^-s / (6 * 15!).
_C_PEAK = 1.0 / math.factorial(5)
_C_UNDER = 1.0 / (6.0 * math.factorial(15))

#: canonical seconds after which the double gamma is dropped: for s >= 64, |h(s)| <= 1.5e-13 max h (the tail is the
#: undershoot's, decreasing monotonically). On the grids the HRF accepts (HRF_STEP) a row's largest weight is at
#: least 0.9 max h (0.7 max h for a row at a run's end that loses the rise, HRF_LEAD), so a window ending there
#: drops less than 1e-12 of the row's largest weight
HRF_SUPPORT = 64.0
#: the largest reach past the sample time, -delay_min, in units of the smallest dispersion: the mode of
#: g(s; 6, 1) is at s = 5, so at most the rise to the peak falls beyond a run's last grid point and the row's
#: normaliser keeps at least the falling half of the main lobe (0.45 of the continuous integral's 5/6)
HRF_LEAD = 5.0
#: the largest grid step, in units of the smallest dispersion (canonical seconds between grid samples of the
#: curve); there the row's largest weight is >= 0.9 max h and the row sum stays positive for every phase
HRF_STEP = 2.0


@dataclass(frozen=True)
class HRF(Response):
    r"""SPM's canonical double-gamma haemodynamic response, shifted by ``delay`` and stretched by ``dispersion``.

    ``h(s) = g(s; 6, 1) - g(s; 16, 1) / 6`` for ``s > 0`` and 0 for ``s <= 0``, with ``g(s; a, b)`` the gamma
    density of shape ``a`` and scale ``b``: a peak near 5 s, an undershoot near 15.7 s, zero crossing at 12.07 s.
    The raw weight of grid point j for a sample at ``t`` is ``g_j = h((t - tau_j - d) / c)`` (``d`` the delay,
    ``c`` the dispersion, 1 = canonical), and ``a_j = g_j / sum_i g_i`` over the whole grid, like the Gaussian
    responses. The sum is positive (the continuous integral is ``(1 - 1/6) c / Delta``; see :data:`HRF_STEP`
    and :data:`HRF_LEAD` for the discrete sum); the weights of the undershoot are negative
    (:attr:`nonnegative` is False).

    Smoothness: the support after the shift is ``[d, d + c * HRF_SUPPORT]`` seconds before the sample time. At
    the start, ``h`` behaves as ``s^5 / 120``, so it is C^4 at ``s = 0``: a grid point entering the support as
    ``d`` or ``c`` moves changes the weights and their first four derivatives continuously. At the far end the
    fixed window of the bounds (:meth:`support`) holds every point with ``s <= HRF_SUPPORT`` for every allowed
    ``(d, c)``, and points inside the window past that are computed, not cut; what the window leaves out is
    below 1e-12 of the row's largest weight.

    Args:
        delay_bounds: (low, high) seconds for ``d``. A negative low bound lets a row reach ``|low|`` seconds past
            its sample time; it may be at most ``HRF_LEAD * dispersion_min`` (the grid ends at the run's end, so
            rows near it are normalised over the grid points that exist).
        dispersion_bounds: (low, high) for ``c`` (> 0), estimated; None fixes ``c = 1``.
    """

    delay_bounds: tuple[float, float] = (-2.0, 3.0)
    dispersion_bounds: tuple[float, float] | None = None
    type_name = "hrf"
    nonnegative = False

    def __post_init__(self) -> None:
        lo, hi = check_bounds("HRF delay_bounds", self.delay_bounds)
        object.__setattr__(self, "delay_bounds", (lo, hi))
        if self.dispersion_bounds is not None:
            object.__setattr__(self, "dispersion_bounds",
                               check_bounds("HRF dispersion_bounds", self.dispersion_bounds, positive=True))
        c_lo = self.dispersion_range[0]
        if -lo > HRF_LEAD * c_lo:
            raise ValueError(
                f"HRF delay_bounds={self.delay_bounds!r}: a delay of {lo} lets a row reach {-lo} s past its sample "
                f"time, beyond the run's grid; at most HRF_LEAD * dispersion_min = {HRF_LEAD * c_lo} s is allowed "
                f"(the rise to the peak), so the lower bound must be >= {-HRF_LEAD * c_lo}")

    # ---------------------------------------------------------------- parameters
    @property
    def param_names(self) -> tuple[str, ...]:  # type: ignore[override]
        return ("delay",) if self.dispersion_bounds is None else ("delay", "dispersion")

    @property
    def dispersion_range(self) -> tuple[float, float]:
        """(c_min, c_max): the dispersion bounds, or (1, 1) when the dispersion is fixed."""
        return (1.0, 1.0) if self.dispersion_bounds is None else self.dispersion_bounds

    @property
    def bounds(self) -> dict[str, tuple[float, float]]:
        b = {"delay": self.delay_bounds}
        if self.dispersion_bounds is not None:
            b["dispersion"] = self.dispersion_bounds
        return b

    @property
    def max_support(self) -> float:
        """``delay_max + c_max * HRF_SUPPORT``: the whole support the bounds allow lies on the padded grid."""
        return max(0.0, self.delay_bounds[1] + self.dispersion_range[1] * HRF_SUPPORT)

    def _delay_dispersion(self, theta):
        return theta["delay"], (theta["dispersion"] if self.dispersion_bounds is not None else 1.0)

    # ---------------------------------------------------------------- the curve
    @staticmethod
    def curve(s, xp=np):
        """The double gamma ``h(s)`` (0 for ``s <= 0``), elementwise, in NumPy or JAX.

        ``h(s) = e^-s (s^5 / 5! - s^15 / (6 * 15!))``; negative ``s`` are mapped to 0 before the powers, so the
        value and its JAX gradient are exactly 0 there (no overflow of ``e^-s``, no 0 * inf).
        """
        sp = xp.where(s > 0, s, 0.0)
        s5 = sp**5
        return xp.exp(-sp) * s5 * (_C_PEAK - _C_UNDER * s5 * s5)

    @staticmethod
    def curve_deriv(s):
        """``h'(s)`` (NumPy): ``e^-s ((5 s^4 - s^5) / 5! - (15 s^14 - s^15) / (6 * 15!))``, 0 for ``s <= 0``."""
        sp = np.where(s > 0, s, 0.0)
        s4 = sp**4
        s14 = s4 * s4 * s4 * sp * sp
        return np.exp(-sp) * (_C_PEAK * s4 * (5.0 - sp) - _C_UNDER * s14 * (15.0 - sp))

    # ---------------------------------------------------------------- windows
    def support(self):
        """``(delay_max + c_max * HRF_SUPPORT, -delay_min)``: the window reaches ``-delay_min`` past the sample
        time (negative when the delay is bounded away from 0, which shortens it)."""
        lo, hi = self.delay_bounds
        return hi + self.dispersion_range[1] * HRF_SUPPORT, -lo

    def window(self, times, grid):
        """The :meth:`support` window, after checking that the grid resolves the curve (step at most
        ``HRF_STEP * c_min``) and that its padding holds the whole support before the first sample."""
        grid = np.asarray(grid, dtype=np.float64)
        times = np.asarray(times, dtype=np.float64)
        d = grid_step(grid)
        c_lo = self.dispersion_range[0]
        if d > HRF_STEP * c_lo * (1.0 + 1e-9):
            raise ValueError(
                f"HRF dispersion_bounds={self.dispersion_bounds!r}: a grid step of {d} s does not resolve the curve "
                f"at dispersion {c_lo}; the step must be <= HRF_STEP * dispersion_min = {HRF_STEP * c_lo} s "
                f"(lower latent_dt or raise the dispersion's lower bound)")
        before, _ = self.support()
        if times.size:
            have = float(times.min() - grid[0])
            if have < before - 1e-9 * max(1.0, before):
                raise ValueError(
                    f"HRF delay_bounds={self.delay_bounds!r}, dispersion_bounds={self.dispersion_bounds!r}: the "
                    f"response reaches {before} s before a sample (delay_max + c_max * HRF_SUPPORT) but the grid "
                    f"starts {have} s before the first sample; the grid padding (latent_pad; None sizes it from "
                    f"max_support) cannot cover these bounds")
        return super().window(times, grid)

    # ---------------------------------------------------------------- weights
    def weights(self, delta, valid, theta, step, xp=np):
        dly, c = self._delay_dispersion(theta)
        g = xp.where(valid, self.curve((delta - dly) / c, xp), 0.0)
        return g / xp.sum(g, axis=1, keepdims=True)

    def weight_derivs(self, delta, valid, theta, step):
        dly, c = self._delay_dispersion(theta)
        s = (delta - dly) / c
        g = np.where(valid, self.curve(s), 0.0)
        total = g.sum(axis=1, keepdims=True)
        a = g / total
        hp = np.where(valid, self.curve_deriv(s), 0.0)
        # ds/dd = -1/c, ds/dc = -s/c; a = g / sum g: da/dθ = (dg/dθ - a sum_i dg_i/dθ) / sum g
        dg = {"delay": -hp / c}
        if self.dispersion_bounds is not None:
            dg["dispersion"] = -hp * s / c
        return a, {name: (dgn - a * dgn.sum(axis=1, keepdims=True)) / total for name, dgn in dg.items()}


RESPONSES: dict[str, type[Response]] = {}


def register_response(cls: type[Response]) -> type[Response]:
    """Add a response class to the registry under :func:`registry_name` (an existing name is an error)."""
    if not (isinstance(cls, type) and issubclass(cls, Response)):
        raise ValueError(f"register_response takes a Response subclass, got {cls!r}")
    name = registry_name(cls)
    if name in RESPONSES:
        raise ValueError(f"response {name!r} is already registered")
    RESPONSES[name] = cls
    return cls


register_response(Identity)
register_response(GaussianLag)
register_response(GaussianWidthLag)
register_response(HRF)
