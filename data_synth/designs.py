"""Recovery designs whose data are NOT drawn from the model.

A design generates K latent paths in continuous time (not a Gaussian process on the model's grid), passes them
through the true responses in continuous time (not the model's discrete grid weights) and observes them on each
stream's own clock:

    y_{s,f}(t_i) = b_{s,f} + sum_k W_{s,f,k} x_{m(s),k}(t_i) + eps,   eps ~ N(0, noise_sd_s^2),
    W ~ N(0, (snr * loading_sd_m)^2),  b ~ N(0, 1).

``make_design(name, seed, **overrides)`` returns ``(msrm.Dataset, msrm.ModelSpec, DesignTruth)``; the spec is what
the methods should fit (Matern-3/2 prior, shared pooling, default ``latent_pad``).

Latent paths (each factor standardised over the run, see "Standardisation"):

* ``"sinusoids"``: each factor ``sum_{i=1..3} A_i sin(omega_i t + phi_i)``, periods log-uniform in
  ``[period_min, period_max]``, phases uniform in [0, 2 pi), amplitudes uniform in [0.5, 1.5]. Exact at any time.
* ``"ou"``: an Ornstein-Uhlenbeck path (unit stationary variance, timescale ``ou_timescale``) simulated exactly as
  an AR(1) on a 0.05 s grid (:data:`OU_STEP`), then smoothed on that grid by a normalised discrete Gaussian of sd
  ``ou_smooth`` seconds (0: no smoothing); between grid points the path is the linear interpolation of the grid
  values (that interpolant *is* the path: every response and moment is computed from it).
* ``"bumps"``: events of a Poisson process of rate ``event_rate`` per second, each a Gaussian bump
  ``a_{e,k} exp(-(t - t_e)^2 / (2 bump_width^2))`` with ``a_{e,k} ~ N(0, 1)`` per factor, plus a slow sinusoid of
  amplitude ``slow_amplitude`` and period log-uniform in ``[period_min, period_max]``. Exact at any time.

Standardisation: with ``f_k`` the raw path, ``m_k = (1/T) int_0^T f_k dt`` and
``s_k^2 = (1/T) int_0^T (f_k - m_k)^2 dt`` (continuous-time moments over the run ``[0, T]``); the latent is
``z_k = (f_k - m_k) / s_k`` everywhere (also on the padding before 0). Sinusoids: closed-form integrals. OU: the
path is piecewise linear on the 0.05 s grid, so 2-point Gauss-Legendre per grid segment is exact. Bumps: composite
Gauss-Legendre, 12 nodes per 0.5 s panel.

Responses, in continuous time:

* ``brain`` with ``brain_response="identity"``: ``x(t) = z(t)``.
* Gaussian lag/width (rating, physiology): ``x(t) = int z(t - lag - s) N(s; 0, width^2) ds``. Sinusoids: exactly
  ``A sin(omega (t - lag) + phi) exp(-omega^2 width^2 / 2)``; bumps: exactly (a Gaussian bump convolved with a
  Gaussian is a Gaussian of variance ``bump_width^2 + width^2``, its height scaled by
  ``bump_width / sqrt(bump_width^2 + width^2)``); OU: trapezoid rule on a 0.01 s grid over ``s in [-8, 8] width``
  (weights renormalised to sum 1), :data:`GAUSS_QUAD_STEP`.
* ``brain`` with ``brain_response="hrf"`` (SPM double gamma, :meth:`msrm.HRF.curve`):
  ``x(t) = int_0^{64 c} h(s / c) z(t - d - s) ds / int_0^{64 c} h(s / c) ds`` (delay ``d``, dispersion ``c``),
  normalised to unit integral as :class:`msrm.HRF` normalises its weights to unit sum; composite Gauss-Legendre,
  :data:`HRF_QUAD_NODES` nodes per :data:`HRF_QUAD_PANEL` s panel (the same nodes give the normaliser).

Randomness: every component draws from its own generator ``default_rng(SeedSequence(seed, spawn_key=key))`` (the
``key``-th child that ``SeedSequence(seed).spawn`` would make, for a fixed key per component: latents per run,
loadings / intercepts per stream, noise and missingness per stream and run), so a knob that changes one
component (e.g. ``n_brain_features``) leaves every other draw unchanged.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np

import msrm
from msrm.responses import HRF_SUPPORT
from msrm.spec import ModelSpec, latent_grid

__all__ = ["Design", "DesignTruth", "DESIGNS", "design_names", "make_design", "LatentPath", "SinusoidPath",
           "OUPath", "BumpPath", "gaussian_response", "hrf_response", "OU_STEP", "GAUSS_QUAD_STEP",
           "HRF_QUAD_PANEL", "HRF_QUAD_NODES", "LATENT_KINDS"]

#: seconds between the grid points an OU path is simulated on (and linearly interpolated between)
OU_STEP = 0.05
#: trapezoid step (seconds) of the Gaussian-response quadrature for paths without a closed form (OU)
GAUSS_QUAD_STEP = 0.01
#: the Gaussian-response quadrature covers s in [-GAUSS_QUAD_SIGMAS, GAUSS_QUAD_SIGMAS] * width
GAUSS_QUAD_SIGMAS = 8.0
#: panel length (canonical seconds, scaled by the dispersion) and Gauss-Legendre nodes per panel of the HRF
HRF_QUAD_PANEL = 1.0
HRF_QUAD_NODES = 8
#: latent path families
LATENT_KINDS = ("sinusoids", "ou", "bumps")
BRAIN_RESPONSES = ("identity", "hrf")

# fixed spawn keys per random component (see the module docstring)
_LATENTS, _LOADINGS, _INTERCEPTS, _NOISE, _MISSING = range(5)
_MODALITY_CODE = {"brain": 0, "rating": 1, "physio": 2}


def _rng(seed: int, *key: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=tuple(int(k) for k in key)))


def _gauss_legendre(breaks: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Composite Gauss-Legendre nodes and weights, ``n`` per panel ``[breaks[i], breaks[i+1]]``."""
    x, w = np.polynomial.legendre.leggauss(n)
    a, b = breaks[:-1, None], breaks[1:, None]
    half = 0.5 * (b - a)
    return ((a + b) * 0.5 + half * x).ravel(), (half * w).ravel()


def _panels(lo: float, hi: float, step: float) -> np.ndarray:
    n = max(1, math.ceil((hi - lo) / step - 1e-9))
    return np.linspace(lo, hi, n + 1)


# ------------------------------------------------------------------------------------------------- latent paths
@dataclass(frozen=True, eq=False)
class LatentPath:
    """A K-factor path on ``[t_min, t_max]``, standardised: ``z(t) = (f(t) - mean) / sd`` (see module docstring).

    Subclasses define ``raw(t) -> (n, K)`` and ``raw_moments(T)``; ``mean``/``sd`` ((K,)) are the raw path's
    moments over ``[0, T]``, set when a design builds the path. Outside ``[t_min, t_max]`` evaluation is an error.
    """

    t_min: float
    t_max: float
    mean: np.ndarray
    sd: np.ndarray

    @property
    def n_factors(self) -> int:
        return int(self.mean.size)

    def raw(self, t: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def raw_moments(self, T: float) -> tuple[np.ndarray, np.ndarray]:
        """(mean, sd) of the raw path over [0, T], each (K,)."""
        raise NotImplementedError

    def _check(self, t) -> np.ndarray:
        t = np.asarray(t, dtype=np.float64)
        if t.size and (t.min() < self.t_min - 1e-9 or t.max() > self.t_max + 1e-9):
            raise ValueError(f"times: the latent path is defined on [{self.t_min}, {self.t_max}] s, got times in "
                             f"[{t.min()}, {t.max()}]")
        return t

    def __call__(self, t) -> np.ndarray:
        """(n, K) standardised latents at the times ``t`` ((n,) seconds)."""
        t = self._check(t).ravel()
        return (self.raw(t) - self.mean) / self.sd

    def gaussian(self, t, lag: float, width: float) -> np.ndarray:
        """(n, K) ``int z(t - lag - s) N(s; 0, width^2) ds``: trapezoid rule, step GAUSS_QUAD_STEP, over
        ``|s| <= GAUSS_QUAD_SIGMAS * width`` (weights renormalised to sum 1). Subclasses override with closed forms."""
        t = np.asarray(t, dtype=np.float64).ravel()
        m = math.ceil(GAUSS_QUAD_SIGMAS * width / GAUSS_QUAD_STEP)
        s = GAUSS_QUAD_STEP * np.arange(-m, m + 1)
        w = np.exp(-0.5 * (s / width) ** 2)
        w[[0, -1]] *= 0.5
        w /= w.sum()
        out = np.empty((t.size, self.n_factors))
        chunk = max(1, 200_000 // s.size)
        for i in range(0, t.size, chunk):
            tt = t[i:i + chunk]
            z = self((tt[:, None] - lag - s[None, :]).ravel()).reshape(tt.size, s.size, self.n_factors)
            out[i:i + chunk] = np.einsum("nsk,s->nk", z, w)
        return out


def _standardise(path: LatentPath, T: float) -> LatentPath:
    m, sd = path.raw_moments(T)
    if np.any(sd <= 0):
        raise ValueError("the latent path is constant over the run; cannot standardise")
    return dataclasses.replace(path, mean=m, sd=sd)


def _cos_integral(c: np.ndarray, r: np.ndarray, T: float) -> np.ndarray:
    """``int_0^T cos(c t + r) dt = T cos(c T / 2 + r) sinc(c T / 2)`` (exact also at c = 0)."""
    return T * np.cos(0.5 * c * T + r) * np.sinc(0.5 * c * T / np.pi)


@dataclass(frozen=True, eq=False)
class SinusoidPath(LatentPath):
    """``f_k(t) = sum_i A_ki sin(omega_ki t + phi_ki)``; arrays (K, n_components)."""

    amplitude: np.ndarray = field(default=None)
    omega: np.ndarray = field(default=None)
    phase: np.ndarray = field(default=None)

    def raw(self, t):
        arg = self.omega[None] * t[:, None, None] + self.phase[None]
        return (self.amplitude[None] * np.sin(arg)).sum(axis=2)

    def raw_moments(self, T):
        A, w, p = self.amplitude, self.omega, self.phase
        # int_0^T sin(w t + p) dt = int_0^T cos(w t + p - pi/2) dt
        mean = (A * _cos_integral(w, p - np.pi / 2, T)).sum(axis=1) / T
        # sin a sin b = (cos(a - b) - cos(a + b)) / 2
        dw = w[:, :, None] - w[:, None, :]
        sw = w[:, :, None] + w[:, None, :]
        dp = p[:, :, None] - p[:, None, :]
        sp = p[:, :, None] + p[:, None, :]
        cross = 0.5 * (_cos_integral(dw, dp, T) - _cos_integral(sw, sp, T))
        second = np.einsum("ki,kj,kij->k", A, A, cross) / T
        return mean, np.sqrt(second - mean**2)

    def gaussian(self, t, lag, width):
        """Exact: ``sin(omega (t - lag) + phi) exp(-omega^2 width^2 / 2)`` per component; the mean is unchanged."""
        t = np.asarray(t, dtype=np.float64).ravel()
        damp = self.amplitude * np.exp(-0.5 * (self.omega * width) ** 2)
        arg = self.omega[None] * (t[:, None, None] - lag) + self.phase[None]
        return ((damp[None] * np.sin(arg)).sum(axis=2) - self.mean) / self.sd


@dataclass(frozen=True, eq=False)
class OUPath(LatentPath):
    """Piecewise linear between ``values`` ((n_grid, K)) at ``t_min + i * step``."""

    step: float = OU_STEP
    values: np.ndarray = field(default=None)

    def raw(self, t):
        u = np.clip((t - self.t_min) / self.step, 0.0, self.values.shape[0] - 1.0)
        i = np.minimum(np.floor(u).astype(np.int64), self.values.shape[0] - 2)
        f = (u - i)[:, None]
        return (1.0 - f) * self.values[i] + f * self.values[i + 1]

    def raw_moments(self, T):
        # breakpoints: the grid points inside (0, T), plus 0 and T; 2-point Gauss-Legendre is exact for the
        # linear path and its square on each piece
        inner = self.t_min + self.step * np.arange(self.values.shape[0])
        inner = inner[(inner > 1e-12) & (inner < T - 1e-12)]
        x, w = _gauss_legendre(np.concatenate([[0.0], inner, [T]]), 2)
        f = self.raw(x)
        mean = w @ f / T
        return mean, np.sqrt(w @ (f - mean) ** 2 / T)


@dataclass(frozen=True, eq=False)
class BumpPath(LatentPath):
    """``f_k(t) = sum_e a_ek exp(-(t - t_e)^2 / (2 bw^2)) + B_k sin(omega_k t + phi_k)``."""

    event_times: np.ndarray = field(default=None)   # (E,)
    event_amplitude: np.ndarray = field(default=None)  # (E, K)
    bump_width: float = 2.0
    slow_amplitude: np.ndarray = field(default=None)  # (K,)
    slow_omega: np.ndarray = field(default=None)  # (K,)
    slow_phase: np.ndarray = field(default=None)  # (K,)

    def _raw(self, t, width):
        # (n, K) bumps of sd ``width`` with heights scaled by bump_width / width: the bumps themselves when
        # width = bump_width, the bumps convolved with N(0, w^2) when width = sqrt(bump_width^2 + w^2)
        out = np.zeros((t.size, self.event_amplitude.shape[1]))
        scale = self.bump_width / width
        for i in range(0, t.size, 20_000):
            d = t[i:i + 20_000, None] - self.event_times[None, :]
            out[i:i + 20_000] = scale * np.exp(-0.5 * (d / width) ** 2) @ self.event_amplitude
        return out

    def raw(self, t):
        return self._raw(t, self.bump_width) + self.slow_amplitude * np.sin(self.slow_omega * t[:, None]
                                                                             + self.slow_phase)

    def raw_moments(self, T):
        x, w = _gauss_legendre(_panels(0.0, T, 0.5), 12)
        f = self.raw(x)
        mean = w @ f / T
        return mean, np.sqrt(w @ (f - mean) ** 2 / T)

    def gaussian(self, t, lag, width):
        """Exact: each bump becomes a Gaussian of sd ``sqrt(bw^2 + width^2)``; the sinusoid is damped by
        ``exp(-omega^2 width^2 / 2)``."""
        t = np.asarray(t, dtype=np.float64).ravel() - lag
        wid = math.sqrt(self.bump_width**2 + width**2)
        slow = self.slow_amplitude * np.exp(-0.5 * (self.slow_omega * width) ** 2) * np.sin(
            self.slow_omega * t[:, None] + self.slow_phase)
        return (self._raw(t, wid) + slow - self.mean) / self.sd


# ------------------------------------------------------------------------------------------------- responses
def gaussian_response(path: LatentPath, times, lag: float, width: float) -> np.ndarray:
    """(n, K) ``x(t) = int z(t - lag - s) N(s; 0, width^2) ds`` (closed form where the path has one)."""
    return path.gaussian(times, lag, width)


def hrf_response(path: LatentPath, times, delay: float, dispersion: float = 1.0, *,
                 panel: float = HRF_QUAD_PANEL, nodes: int = HRF_QUAD_NODES) -> np.ndarray:
    """(n, K) ``x(t) = int_0^{64 c} h(s/c) z(t - d - s) ds / int_0^{64 c} h(s/c) ds`` with ``h`` =
    :meth:`msrm.HRF.curve`: composite Gauss-Legendre, ``nodes`` per panel of ``panel * c`` seconds (the normaliser
    uses the same nodes, so a constant path maps to itself)."""
    t = np.asarray(times, dtype=np.float64).ravel()
    c = float(dispersion)
    s, w = _gauss_legendre(_panels(0.0, HRF_SUPPORT * c, panel * c), nodes)
    hw = w * msrm.HRF.curve(s / c)
    hw /= hw.sum()
    out = np.empty((t.size, path.n_factors))
    chunk = max(1, 200_000 // s.size)
    for i in range(0, t.size, chunk):
        tt = t[i:i + chunk]
        z = path((tt[:, None] - delay - s[None, :]).ravel()).reshape(tt.size, s.size, path.n_factors)
        out[i:i + chunk] = np.einsum("nsk,s->nk", z, hw)
    return out


# ------------------------------------------------------------------------------------------------- designs
@dataclass(frozen=True)
class Design:
    """Knobs of a design (seconds for times). Every field can be overridden in :func:`make_design`.

    ``snr`` multiplies every stream's loading sd (an amplitude factor: the signal variance scales by snr^2).
    Brain participants are ``b1..bN`` (``n_brain_participants``); participants with a rating and a physiology
    stream are ``r1..rM`` (``n_behaviour_participants``); the override ``n_participants`` sets both N and M.
    Missingness: ``brain_missing_fraction`` of each brain participant's time points (all features) in contiguous
    blocks of ``brain_missing_block`` seconds at random places, different per participant and run;
    ``rating_missing_fraction`` of each rating stream's samples, scattered.
    """

    doc: str
    duration: float = 300.0
    n_runs: int = 1
    n_factors: int = 2
    latent_dt: float = 0.5
    latent: str = "sinusoids"
    n_sinusoids: int = 3
    period_min: float = 6.0
    period_max: float = 60.0
    ou_timescale: float = 8.0
    ou_smooth: float = 1.0
    event_rate: float = 0.05
    bump_width: float = 2.0
    slow_amplitude: float = 0.5
    n_brain_participants: int = 3
    n_brain_features: int = 200
    brain_dt: float = 2.0
    brain_offset: float = 0.0
    brain_noise_sd: float = 1.0
    brain_loading_sd: float = 0.8
    brain_response: str = "identity"
    hrf_delay: float = 1.0
    hrf_dispersion: float = 1.0
    n_behaviour_participants: int = 4
    rating_dt: float = 1.0
    rating_offset: float = 0.0
    rating_lag: float = 2.5
    rating_width: float = 1.2
    rating_noise_sd: float = 0.3
    rating_loading_sd: float = 0.8
    physio_dt: float = 1.3
    physio_offset: float = 0.0
    physio_lag: float = 1.5
    physio_width: float = 0.8
    physio_noise_sd: float = 0.3
    physio_loading_sd: float = 0.8
    lag_bounds: tuple[float, float] = (0.0, 6.0)
    physio_width_bounds: tuple[float, float] = (0.3, 3.0)
    brain_missing_fraction: float = 0.0
    brain_missing_block: float = 20.0
    rating_missing_fraction: float = 0.0
    snr: float = 1.0

    def spec(self) -> ModelSpec:
        """The ModelSpec the methods fit: Matern-3/2, shared pooling, default latent_pad."""
        brain = msrm.Identity() if self.brain_response == "identity" else msrm.HRF()
        return ModelSpec(
            n_factors=self.n_factors, latent_dt=self.latent_dt, kernel="matern32", pooling="shared",
            responses={"brain": brain,
                       "rating": msrm.GaussianLag(width=self.rating_width, lag_bounds=self.lag_bounds),
                       "physio": msrm.GaussianWidthLag(lag_bounds=self.lag_bounds,
                                                       width_bounds=self.physio_width_bounds)})

    def true_response(self) -> dict[str, dict[str, float]]:
        """True response parameters per modality (Identity brain has none; the HRF lists delay and dispersion)."""
        out = {}
        if self.n_brain_participants and self.brain_response == "hrf":
            out["brain"] = {"delay": self.hrf_delay, "dispersion": self.hrf_dispersion}
        if self.n_behaviour_participants:
            out["rating"] = {"lag": self.rating_lag, "width": self.rating_width}
            out["physio"] = {"lag": self.physio_lag, "width": self.physio_width}
        return out


_INT_FIELDS = ("n_runs", "n_factors", "n_sinusoids", "n_brain_participants", "n_brain_features",
               "n_behaviour_participants")
_POSITIVE = ("duration", "latent_dt", "period_min", "period_max", "ou_timescale", "event_rate", "bump_width",
             "brain_dt", "brain_noise_sd", "rating_dt", "rating_width", "rating_noise_sd", "physio_dt",
             "physio_width", "physio_noise_sd", "hrf_dispersion", "brain_missing_block", "snr")
_NONNEG = ("ou_smooth", "slow_amplitude", "brain_offset", "rating_offset", "physio_offset", "brain_loading_sd",
           "rating_loading_sd", "physio_loading_sd", "rating_lag", "physio_lag")
_FRACTIONS = ("brain_missing_fraction", "rating_missing_fraction")


def _check_design(d: Design) -> None:
    for name in _INT_FIELDS:
        v = getattr(d, name)
        low = 1 if name in ("n_runs", "n_factors", "n_sinusoids", "n_brain_features") else 0
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")
    for name in _POSITIVE + _NONNEG + _FRACTIONS + ("hrf_delay",):
        v = getattr(d, name)
        if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)) or not math.isfinite(v):
            raise ValueError(f"{name} must be a finite number, got {v!r}")
        if name in _POSITIVE and v <= 0:
            raise ValueError(f"{name} must be > 0, got {v!r}")
        if name in _NONNEG and v < 0:
            raise ValueError(f"{name} must be >= 0, got {v!r}")
        if name in _FRACTIONS and not 0 <= v < 1:
            raise ValueError(f"{name} must be in [0, 1), got {v!r}")
    if d.n_brain_participants + d.n_behaviour_participants < 1:
        raise ValueError("n_brain_participants + n_behaviour_participants must be >= 1 (no streams)")
    if d.period_min > d.period_max:
        raise ValueError(f"period_min ({d.period_min}) must be <= period_max ({d.period_max})")
    if d.latent not in LATENT_KINDS:
        raise ValueError(f"latent must be one of {LATENT_KINDS}, got {d.latent!r}")
    if d.brain_response not in BRAIN_RESPONSES:
        raise ValueError(f"brain_response must be one of {BRAIN_RESPONSES}, got {d.brain_response!r}")
    for m in ("brain", "rating", "physio"):
        off = getattr(d, f"{m}_offset")
        if off > d.duration:
            raise ValueError(f"{m}_offset ({off}) must be <= duration ({d.duration})")


DESIGNS: dict[str, Design] = {
    "baseline": Design(doc="the reference: 2 sinusoid factors, 3 brain x 200 features, 4 rating+physio "
                           "participants through continuous Gaussian lags"),
    "few_brain": Design(doc="few (20), noisy (sd 2) brain features: fusing ratings and physiology should matter",
                        n_brain_features=20, brain_noise_sd=2.0),
    "fast_dynamics": Design(doc="periods 2.5-20 s: the 2 s brain clock aliases the fast part, 1 s ratings "
                                "resolve it", period_min=2.5, period_max=20.0),
    "missing_brain": Design(doc="30% of brain time points missing in 20 s blocks per participant, 5% scattered "
                                "missing ratings", brain_missing_fraction=0.3, brain_missing_block=20.0,
                            rating_missing_fraction=0.05),
    "ou_latents": Design(doc="rough dynamics: smoothed OU latents (timescale 8 s) and clock offsets (rating "
                             "0.2 s, physio 0.4 s)", latent="ou", ou_timescale=8.0, ou_smooth=1.0,
                         rating_offset=0.2, physio_offset=0.4),
    "bumps_hrf": Design(doc="event-locked bumps seen by the brain through the continuous double-gamma HRF; two "
                            "200 s runs", latent="bumps", brain_response="hrf", duration=200.0, n_runs=2,
                        period_min=30.0, period_max=60.0),
    "small": Design(doc="small enough for NUTS and fast tests: one 60 s run, 2 brain x 20 features, 2 "
                        "rating+physio participants, latent_dt 1.0", duration=60.0, n_brain_participants=2,
                    n_brain_features=20, n_behaviour_participants=2, latent_dt=1.0),
}


def design_names() -> list[str]:
    """The design names in a stable order (that of :data:`DESIGNS`)."""
    return list(DESIGNS)


# ------------------------------------------------------------------------------------------------- truth
@dataclass(frozen=True, eq=False)
class DesignTruth:
    """What generated a design's data.

    Fields:
        name, seed: the design and seed.
        design: the :class:`Design` after overrides.
        spec: the ModelSpec the methods should fit.
        latents: per run, (J, K) true latents at that run's grid ``msrm.latent_grid(duration, spec)``.
        paths: per run, the :class:`LatentPath` (picklable); ``latent_at(run, times)`` evaluates it.
        response: true response parameters per modality (modalities with parameters only), e.g.
            ``{"rating": {"lag": 2.5, "width": 1.2}, "physio": {...}, "brain": {"delay": 1.0, "dispersion": 1.0}}``.
        loadings: key ``"participant/modality"`` -> (n_features, K); intercepts, noise_sd: key -> (n_features,).
        observed_span: per run, (0, duration).
    """

    name: str
    seed: int
    design: Design
    spec: ModelSpec
    latents: list
    paths: list
    response: dict
    loadings: dict
    intercepts: dict
    noise_sd: dict
    observed_span: list

    def latent_at(self, run: int, times) -> np.ndarray:
        """(n, K) true standardised latents of run ``run`` at the times ``times`` ((n,) seconds)."""
        return self.paths[run](times)

    def seen(self, run: int, modality: str, times) -> np.ndarray:
        """(n, K) what ``modality`` sees at ``times``: the true response applied in continuous time."""
        return _seen(self.paths[run], self.design, modality, times)

    def spec_response(self) -> dict[str, dict[str, float]]:
        """The true values of the parameters the spec estimates (e.g. no rating width: it is fixed in the spec)."""
        out = {}
        for m, theta in self.response.items():
            names = self.spec.response(m).param_names
            if names:
                out[m] = {n: theta[n] for n in names}
        return out


def _seen(path: LatentPath, d: Design, modality: str, times) -> np.ndarray:
    if modality == "brain":
        if d.brain_response == "identity":
            return path(times)
        return hrf_response(path, times, d.hrf_delay, d.hrf_dispersion)
    if modality in ("rating", "physio"):
        return gaussian_response(path, times, getattr(d, f"{modality}_lag"), getattr(d, f"{modality}_width"))
    raise ValueError(f"modality must be 'brain', 'rating' or 'physio', got {modality!r}")


def _path_span(d: Design, spec: ModelSpec) -> tuple[float, float]:
    """[t_min, t_max] a path must cover: the padded grid and every response's reach, with 5 s to spare."""
    reach = spec.pad_steps * spec.latent_dt
    reach = max(reach, d.rating_lag + GAUSS_QUAD_SIGMAS * d.rating_width,
                d.physio_lag + GAUSS_QUAD_SIGMAS * d.physio_width)
    ahead = max(spec.latent_dt, GAUSS_QUAD_SIGMAS * d.rating_width - d.rating_lag,
                GAUSS_QUAD_SIGMAS * d.physio_width - d.physio_lag)
    if d.brain_response == "hrf":
        reach = max(reach, d.hrf_delay + HRF_SUPPORT * d.hrf_dispersion)
        ahead = max(ahead, -d.hrf_delay)
    return -(reach + 5.0), d.duration + ahead + 5.0


def _make_path(d: Design, rng: np.random.Generator, t_min: float, t_max: float) -> LatentPath:
    K = d.n_factors
    empty = np.zeros(K)
    if d.latent == "sinusoids":
        n = d.n_sinusoids
        period = np.exp(rng.uniform(math.log(d.period_min), math.log(d.period_max), (K, n)))
        phase = rng.uniform(0.0, 2 * np.pi, (K, n))
        amp = rng.uniform(0.5, 1.5, (K, n))
        path = SinusoidPath(t_min, t_max, empty, empty + 1, amplitude=amp, omega=2 * np.pi / period, phase=phase)
    elif d.latent == "ou":
        # simulate 5 smoothing sds beyond the span on each side, then drop them: the smoothing has no edge
        margin = 5.0 * d.ou_smooth + OU_STEP
        i0 = math.floor((t_min - margin) / OU_STEP)
        i1 = math.ceil((t_max + margin) / OU_STEP)
        n = i1 - i0 + 1
        a = math.exp(-OU_STEP / d.ou_timescale)
        eps = rng.standard_normal((n, K))
        v = np.empty((n, K))
        v[0] = eps[0]  # stationary start (unit variance)
        q = math.sqrt(1.0 - a * a)
        for i in range(1, n):
            v[i] = a * v[i - 1] + q * eps[i]
        if d.ou_smooth > 0:
            m = math.ceil(4.0 * d.ou_smooth / OU_STEP)
            g = np.exp(-0.5 * (OU_STEP * np.arange(-m, m + 1) / d.ou_smooth) ** 2)
            g /= g.sum()
            v = np.stack([np.convolve(v[:, k], g, mode="same") for k in range(K)], axis=1)
        # keep the points whose smoothing window lies inside the simulation
        trim = math.ceil(5.0 * d.ou_smooth / OU_STEP)
        v = v[trim:n - trim] if trim else v
        start = (i0 + trim) * OU_STEP
        path = OUPath(start, start + OU_STEP * (v.shape[0] - 1), empty, empty + 1, step=OU_STEP, values=v)
    else:
        lo, hi = t_min - 8.0 * d.bump_width, t_max + 8.0 * d.bump_width
        n_events = int(rng.poisson(d.event_rate * (hi - lo)))
        times = np.sort(rng.uniform(lo, hi, n_events))
        amp = rng.standard_normal((n_events, K))
        period = np.exp(rng.uniform(math.log(d.period_min), math.log(d.period_max), K))
        path = BumpPath(t_min, t_max, empty, empty + 1, event_times=times, event_amplitude=amp,
                        bump_width=d.bump_width, slow_amplitude=np.full(K, d.slow_amplitude),
                        slow_omega=2 * np.pi / period, slow_phase=rng.uniform(0.0, 2 * np.pi, K))
    return _standardise(path, d.duration)


def _block_missing(rng: np.random.Generator, n: int, fraction: float, block: int) -> np.ndarray:
    """(n,) bool, True for missing: ``round(fraction n)`` samples in blocks of ``block`` samples (the last one
    shorter) placed uniformly at random without overlap (blocks may touch)."""
    m = int(round(fraction * n))
    miss = np.zeros(n, dtype=bool)
    if m == 0:
        return miss
    block = max(1, block)
    sizes = [block] * (m // block) + ([m % block] if m % block else [])
    rng.shuffle(sizes)
    # stars and bars: n - m observed samples split into len(sizes) + 1 gaps
    cuts = np.sort(rng.integers(0, n - m + 1, len(sizes)))
    pos = 0
    prev = 0
    for size, cut in zip(sizes, cuts):
        pos += cut - prev
        prev = cut
        miss[pos:pos + size] = True
        pos += size
    return miss


def make_design(name: str, seed: int, **overrides) -> tuple[msrm.Dataset, ModelSpec, DesignTruth]:
    """Build design ``name`` with seed ``seed``; ``overrides`` replace :class:`Design` fields (``n_participants``
    sets both ``n_brain_participants`` and ``n_behaviour_participants``).

    Returns:
        (Dataset, ModelSpec, DesignTruth).
    """
    if name not in DESIGNS:
        raise ValueError(f"unknown design {name!r}; known designs: {design_names()}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    seed = int(seed)
    fields = {f.name for f in dataclasses.fields(Design)} - {"doc"}
    if "n_participants" in overrides:
        n = overrides.pop("n_participants")
        for k in ("n_brain_participants", "n_behaviour_participants"):
            if k in overrides:
                raise ValueError(f"n_participants and {k} cannot both be given")
            overrides[k] = n
    bad = sorted(set(overrides) - fields)
    if bad:
        raise ValueError(f"unknown override(s) {bad}; design fields are {sorted(fields)} and n_participants")
    d = dataclasses.replace(DESIGNS[name], **overrides)
    _check_design(d)
    spec = d.spec()
    K, T = d.n_factors, float(d.duration)
    t_min, t_max = _path_span(d, spec)

    # streams: (participant, modality, participant index)
    streams = [(f"b{i + 1}", "brain", i) for i in range(d.n_brain_participants)]
    for i in range(d.n_behaviour_participants):
        streams += [(f"r{i + 1}", "rating", i), (f"r{i + 1}", "physio", i)]
    loadings, intercepts, noise_sd = {}, {}, {}
    for p, m, i in streams:
        key = f"{p}/{m}"
        code = _MODALITY_CODE[m]
        F = d.n_brain_features if m == "brain" else 1
        loadings[key] = _rng(seed, _LOADINGS, code, i).normal(0.0, d.snr * getattr(d, f"{m}_loading_sd"), (F, K))
        intercepts[key] = _rng(seed, _INTERCEPTS, code, i).normal(0.0, 1.0, F)
        noise_sd[key] = np.full(F, float(getattr(d, f"{m}_noise_sd")))

    runs, latents, paths = [], [], []
    for r in range(d.n_runs):
        path = _make_path(d, _rng(seed, _LATENTS, r), t_min, t_max)
        paths.append(path)
        latents.append(path(latent_grid(T, spec)))
        seen: dict[tuple, np.ndarray] = {}
        out = []
        for p, m, i in streams:
            key, code = f"{p}/{m}", _MODALITY_CODE[m]
            dt, off = float(getattr(d, f"{m}_dt")), float(getattr(d, f"{m}_offset"))
            n = int(math.floor((T - off) / dt + 1e-9)) + 1
            times = off + dt * np.arange(n)
            if (m, off, dt) not in seen:  # streams of one modality share their clock
                seen[(m, off, dt)] = _seen(path, d, m, times)
            x = seen[(m, off, dt)]
            F = loadings[key].shape[0]
            eps = _rng(seed, _NOISE, code, i, r).standard_normal((n, F))
            Y = intercepts[key] + x @ loadings[key].T + noise_sd[key] * eps
            if m == "brain" and d.brain_missing_fraction > 0:
                block = int(round(d.brain_missing_block / dt))
                Y[_block_missing(_rng(seed, _MISSING, code, i, r), n, d.brain_missing_fraction, block)] = np.nan
            if m == "rating" and d.rating_missing_fraction > 0:
                k = int(round(d.rating_missing_fraction * n))
                Y[_rng(seed, _MISSING, code, i, r).choice(n, k, replace=False)] = np.nan
            out.append(msrm.Stream(participant=p, modality=m, dt=dt, values=Y, offset=off))
        runs.append(msrm.Run(duration=T, streams=out))
    truth = DesignTruth(name=name, seed=seed, design=d, spec=spec, latents=latents, paths=paths,
                        response=d.true_response(), loadings=loadings, intercepts=intercepts, noise_sd=noise_sd,
                        observed_span=[(0.0, T)] * d.n_runs)
    return msrm.Dataset(runs), spec, truth
