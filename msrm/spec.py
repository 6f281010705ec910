"""Model specification and the latent grid."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from .kernels import KERNELS, Kernel, get_kernel
from .responses import Response, response_from_dict

__all__ = ["ModelSpec", "latent_grid", "KERNELS", "POOLINGS", "AUTO_KERNEL"]

POOLINGS = ("shared", "individual")
#: ``ModelSpec(kernel=AUTO_KERNEL)``: the kernel is chosen from the data when a GP model is built (msrm.select).
AUTO_KERNEL = "auto"


@dataclass(frozen=True)
class ModelSpec:
    """What the models estimate.

    Args:
        n_factors: K >= 1 latent factors.
        latent_dt: grid step Delta in seconds (> 0).
        kernel: GP prior kernel, a name in :data:`msrm.kernels.KERNELS` (e.g. ``"matern32"``), or ``"auto"``:
            ``msrm.GPMSRM`` then chooses it by the marginal likelihood (:func:`msrm.select.select_kernel`, recorded
            as ``model.selection``); ``msrm.fit_rmsrm`` has no GP prior to choose with and refuses it.
        pooling: ``"shared"`` (one response theta per modality) or ``"individual"`` (one per stream).
        latent_pad: seconds of grid before t = 0; ``None`` = the largest response support the bounds allow
            (the largest ``Response.max_support``: lag_max + 4 width_max for a Gaussian response, delay_max +
            dispersion_max x ``HRF_SUPPORT`` for the HRF). Rounded up to a multiple of ``latent_dt``.
        responses: modality name -> Response.
    """

    n_factors: int
    latent_dt: float
    kernel: str = "matern32"
    pooling: str = "shared"
    latent_pad: float | None = None
    responses: Mapping[str, Response] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.n_factors, bool) or not isinstance(self.n_factors, (int, np.integer)) or self.n_factors < 1:
            raise ValueError(f"n_factors must be an integer >= 1, got {self.n_factors!r}")
        object.__setattr__(self, "n_factors", int(self.n_factors))
        try:
            dt = float(self.latent_dt)
        except (TypeError, ValueError):
            raise ValueError(f"latent_dt must be a number, got {self.latent_dt!r}") from None
        if not math.isfinite(dt) or dt <= 0:
            raise ValueError(f"latent_dt must be finite and > 0, got {self.latent_dt!r}")
        object.__setattr__(self, "latent_dt", dt)
        if self.kernel != AUTO_KERNEL and (not isinstance(self.kernel, str) or self.kernel not in KERNELS):
            raise ValueError(f"kernel must be one of {tuple(KERNELS)} or {AUTO_KERNEL!r}, got {self.kernel!r}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {self.pooling!r}")
        if self.latent_pad is not None:
            try:
                pad = float(self.latent_pad)
            except (TypeError, ValueError):
                raise ValueError(f"latent_pad must be a number or None, got {self.latent_pad!r}") from None
            if not math.isfinite(pad) or pad < 0:
                raise ValueError(f"latent_pad must be finite and >= 0, got {self.latent_pad!r}")
        responses = dict(self.responses)
        if not responses:
            raise ValueError("responses must map at least one modality to a response")
        for m, r in responses.items():
            if not isinstance(m, str) or not m or "/" in m:
                raise ValueError(f"response modality names must be non-empty strings without '/', got {m!r}")
            if not isinstance(r, Response):
                raise ValueError(f"response for modality {m!r} must be an msrm.responses.Response (Identity, "
                                 f"GaussianLag, ...), got {type(r).__name__}")
        object.__setattr__(self, "responses", responses)

    @property
    def prior(self) -> Kernel:
        """The kernel object named by ``kernel`` (:data:`msrm.kernels.KERNELS`); ValueError for ``"auto"``."""
        if self.kernel == AUTO_KERNEL:
            raise ValueError("spec.kernel is 'auto', which names no kernel yet: build msrm.GPMSRM (it chooses one) "
                             "or call msrm.select(data, spec) and use its .spec")
        return get_kernel(self.kernel)

    def response(self, modality: str) -> Response:
        try:
            return self.responses[modality]
        except KeyError:
            raise KeyError(
                f"modality {modality!r} has no response in the spec; responses are given for {sorted(self.responses)}"
            ) from None

    @property
    def pad(self) -> float:
        """Grid padding before t = 0 in seconds, a whole number of grid steps."""
        raw = self.latent_pad
        if raw is None:
            raw = max((r.max_support for r in self.responses.values()), default=0.0)
        steps = math.ceil(raw / self.latent_dt - 1e-9)
        return max(0, steps) * self.latent_dt

    @property
    def pad_steps(self) -> int:
        return int(round(self.pad / self.latent_dt))

    def to_dict(self) -> dict:
        """JSON-ready description (archives)."""
        return {
            "n_factors": self.n_factors,
            "latent_dt": self.latent_dt,
            "kernel": self.kernel,
            "pooling": self.pooling,
            "latent_pad": self.latent_pad,
            "responses": {m: r.to_dict() for m, r in self.responses.items()},
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> "ModelSpec":
        resp = {}
        for m, rd in d["responses"].items():
            try:
                resp[m] = response_from_dict(rd)
            except ValueError as exc:
                raise ValueError(f"modality {m!r}: {exc}") from None
        return cls(
            n_factors=int(d["n_factors"]),
            latent_dt=float(d["latent_dt"]),
            kernel=d["kernel"],
            pooling=d["pooling"],
            latent_pad=d.get("latent_pad"),
            responses=resp,
        )


def latent_grid(duration: float, spec: ModelSpec) -> np.ndarray:
    """The latent grid of one run: ``tau_j = -pad + j * latent_dt``, the last point the first ``tau_j >= duration``.

    Returns:
        (J,) float64 array.
    """
    try:
        T = float(duration)
    except (TypeError, ValueError):
        raise ValueError(f"duration must be a number, got {duration!r}") from None
    if not math.isfinite(T) or T <= 0:
        raise ValueError(f"duration must be finite and > 0, got {duration!r}")
    d = spec.latent_dt
    p = spec.pad_steps
    # number of steps from 0 to the first grid point >= T (tolerant to floating error)
    steps_after = math.ceil(T / d - 1e-9)
    j = np.arange(p + steps_after + 1, dtype=np.float64)
    return (j - p) * d
