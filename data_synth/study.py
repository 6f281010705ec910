"""Synthetic studies with known truth.

``synthetic_dataset(profile="one-eighth")`` mirrors the note's recorded case: one run of about 454 s; four brain
participants (dt 1.8 s, ``n_features`` features each, Identity response); five participants with a continuous
rating (dt 1.2 s, GaussianLag width 1.5, lag in [0, 8]) and a physiology stream (dt 1.5 s, GaussianWidthLag with
lag in [0, 8] and width in [0.5, 3]); K = 3 factors on a 0.9 s grid with a Matern-3/2 prior. ``"tiny"`` is the
same design shrunk for tests.

Latents are drawn from the GP prior on the grid, observations from the model of DESIGN.md section 1 with
per-modality signal-to-noise ratios typical of each kind of recording (weak for brain features, strong for ratings).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

import msrm
from msrm.kernels import get_kernel
from msrm.operators import response_weights
from msrm.spec import ModelSpec, latent_grid

__all__ = ["synthetic_dataset", "Truth", "PROFILES", "StudyProfile", "matern_kernel"]


@dataclass(frozen=True)
class ModalityDesign:
    name: str
    participants: tuple[str, ...]
    dt: float
    n_features: int | None  # None: the n_features argument
    snr: float  # signal variance / noise variance per feature
    noise_sd: float


@dataclass(frozen=True)
class StudyProfile:
    duration: float
    latent_dt: float
    modalities: tuple[ModalityDesign, ...]
    responses: dict = field(default_factory=dict)
    lengthscale_range: tuple[float, float] = (3.0, 15.0)
    true_response: dict = field(default_factory=dict)


PROFILES: dict[str, StudyProfile] = {
    "one-eighth": StudyProfile(
        duration=454.0,
        latent_dt=0.9,
        modalities=(
            ModalityDesign("brain", ("p1", "p2", "p3", "p4"), 1.8, None, snr=0.5, noise_sd=1.0),
            ModalityDesign("rating", ("p5", "p6", "p7", "p8", "p9"), 1.2, 1, snr=4.0, noise_sd=0.5),
            ModalityDesign("physio", ("p5", "p6", "p7", "p8", "p9"), 1.5, 1, snr=2.0, noise_sd=0.7),
        ),
        responses={
            "brain": msrm.Identity(),
            "rating": msrm.GaussianLag(width=1.5, lag_bounds=(0.0, 8.0)),
            "physio": msrm.GaussianWidthLag(lag_bounds=(0.0, 8.0), width_bounds=(0.5, 3.0)),
        },
        lengthscale_range=(4.0, 16.0),
        true_response={"rating": {"lag": 3.0}, "physio": {"lag": 2.0, "width": 1.5}},
    ),
    "tiny": StudyProfile(
        duration=24.0,
        latent_dt=1.0,
        modalities=(
            ModalityDesign("brain", ("p1", "p2"), 2.0, None, snr=1.0, noise_sd=0.8),
            ModalityDesign("rating", ("p3", "p4"), 1.5, 1, snr=4.0, noise_sd=0.4),
            ModalityDesign("physio", ("p3", "p4"), 2.5, 1, snr=3.0, noise_sd=0.5),
        ),
        responses={
            "brain": msrm.Identity(),
            "rating": msrm.GaussianLag(width=1.0, lag_bounds=(0.0, 3.0)),
            "physio": msrm.GaussianWidthLag(lag_bounds=(0.0, 3.0), width_bounds=(0.5, 1.5)),
        },
        lengthscale_range=(2.0, 5.0),
        true_response={"rating": {"lag": 1.2}, "physio": {"lag": 0.8, "width": 0.9}},
    ),
}


@dataclass(frozen=True)
class Truth:
    """What generated a synthetic dataset.

    Fields:
        spec: the generating ModelSpec (as DESIGN.md states it for the profile).
        params: the true msrm.Params.
        latents: list over runs of (J, K) factor values on each run's grid.
        profile: profile name.
        seed: the seed.
    """

    spec: ModelSpec
    params: msrm.Params
    latents: list
    profile: str
    seed: int


def matern_kernel(r: np.ndarray, lengthscale: float, kernel: str) -> np.ndarray:
    """Unit-variance correlation ``k(|r|; l)`` of a registered kernel (:mod:`msrm.kernels`)."""
    return get_kernel(kernel).correlation(np.abs(np.asarray(r, dtype=np.float64)), float(lengthscale), np)


def _draw_latents(rng: np.random.Generator, grid: np.ndarray, lengthscales: np.ndarray, kernel: str) -> np.ndarray:
    J = grid.size
    Z = np.empty((J, lengthscales.size))
    r = grid[:, None] - grid[None, :]
    for k, ell in enumerate(lengthscales):
        C = matern_kernel(r, ell, kernel)
        C[np.diag_indices(J)] += 1e-9
        L = np.linalg.cholesky(C)
        Z[:, k] = L @ rng.standard_normal(J)
    return Z


def synthetic_dataset(
    profile: str = "one-eighth",
    n_features: int = 3600,
    duration_scale: float = 1.0,
    n_runs: int = 1,
    n_factors: int = 3,
    seed: int = 0,
    *,
    pooling: str = "shared",
    kernel: str = "matern32",
    missing_fraction: float = 0.0,
) -> tuple[msrm.Dataset, Truth]:
    """Build a seeded synthetic study.

    Args:
        profile: ``"one-eighth"`` (the note's recorded shape) or ``"tiny"`` (tests).
        n_features: brain features per brain participant.
        duration_scale: stretches each run's duration.
        n_runs: independent runs (same streams, new latents).
        n_factors: K.
        seed: everything is deterministic given the seed.
        pooling: ``"shared"`` or ``"individual"`` (then each stream gets its own true lag/width near the
            profile's values).
        kernel: GP prior the latents are drawn from (also the spec's kernel).
        missing_fraction: fraction of values set to NaN at random (no feature left empty).

    Returns:
        (Dataset, Truth).
    """
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; choose from {sorted(PROFILES)}")
    if not isinstance(n_features, (int, np.integer)) or n_features < 1:
        raise ValueError(f"n_features must be a positive integer, got {n_features!r}")
    if not (isinstance(n_runs, (int, np.integer)) and n_runs >= 1):
        raise ValueError(f"n_runs must be a positive integer, got {n_runs!r}")
    if not (math.isfinite(duration_scale) and duration_scale > 0):
        raise ValueError(f"duration_scale must be finite and > 0, got {duration_scale!r}")
    if not (0.0 <= missing_fraction < 1.0):
        raise ValueError(f"missing_fraction must be in [0, 1), got {missing_fraction!r}")
    prof = PROFILES[profile]
    spec = ModelSpec(
        n_factors=n_factors, latent_dt=prof.latent_dt, kernel=kernel, pooling=pooling, responses=dict(prof.responses)
    )
    rng = np.random.default_rng(seed)
    K = n_factors
    lo, hi = prof.lengthscale_range
    lengthscales = np.geomspace(lo, hi, K) if K > 1 else np.array([math.sqrt(lo * hi)])

    loadings, intercepts, noise_sd, feats = {}, {}, {}, {}
    for mod in prof.modalities:
        F = n_features if mod.n_features is None else mod.n_features
        for p in mod.participants:
            key = f"{p}/{mod.name}"
            # signal variance per feature = snr * noise^2; latents have unit variance, so |w|^2 = snr * noise^2
            W = rng.standard_normal((F, K))
            W *= math.sqrt(mod.snr) * mod.noise_sd / np.linalg.norm(W, axis=1, keepdims=True)
            loadings[key] = W
            intercepts[key] = rng.normal(0.0, 1.0, F)
            noise_sd[key] = mod.noise_sd * rng.uniform(0.8, 1.25, F)
            feats[key] = (mod, F)

    response = {}
    for m, theta in prof.true_response.items():
        if pooling == "shared":
            response[m] = dict(theta)
        else:
            mod = next(md for md in prof.modalities if md.name == m)
            r = prof.responses[m]
            for p in mod.participants:
                jittered = {}
                for name, v in theta.items():
                    b_lo, b_hi = r.bounds[name]
                    jittered[name] = float(np.clip(v + rng.uniform(-0.3, 0.3) * (1 if name == "lag" else 0.5),
                                                   b_lo + 0.05, b_hi - 0.05))
                response[f"{p}/{m}"] = jittered
    params = msrm.Params(loadings, intercepts, noise_sd, lengthscales, response)

    duration = prof.duration * duration_scale
    runs, latents = [], []
    for _ in range(n_runs):
        grid = latent_grid(duration, spec)
        Z = _draw_latents(rng, grid, lengthscales, kernel)
        latents.append(Z)
        streams = []
        for key, (mod, F) in feats.items():
            n = int(math.floor(duration / mod.dt + 1e-9)) + 1
            times = mod.dt * np.arange(n)
            r = spec.response(mod.name)
            theta = {} if not r.param_names else response[mod.name if pooling == "shared" else key]
            X = response_weights(times, r, theta, grid) @ Z  # (n, K)
            Y = rng.standard_normal((n, F))
            Y *= noise_sd[key]
            Y += intercepts[key]
            Y += X @ loadings[key].T
            if missing_fraction > 0:
                drop = rng.random((n, F)) < missing_fraction
                drop[rng.integers(0, n, F), np.arange(F)] = False  # keep one value per feature
                Y[drop] = np.nan
            p, m = key.split("/")
            streams.append(msrm.Stream(participant=p, modality=m, dt=mod.dt, values=Y, offset=0.0))
        runs.append(msrm.Run(duration=duration, streams=streams))
    data = msrm.Dataset(runs)
    return data, Truth(spec=spec, params=params, latents=latents, profile=profile, seed=seed)
