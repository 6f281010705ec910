"""Model parameters in physical (constrained) units, and their validation against data and spec."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from .data import Dataset
from .responses import Response
from .spec import ModelSpec

__all__ = ["Params", "expected_response_keys"]


def expected_response_keys(data: Dataset, spec: ModelSpec) -> dict[str, Response]:
    """Keys of ``Params.response``: modality (shared) or "participant/modality" (individual), parametrised only."""
    from .nodes import response_groups

    return {g.param_key: g.response for g in response_groups(data, spec) if g.param_key is not None}


def _freeze(a) -> np.ndarray:
    arr = np.array(a, dtype=np.float64, copy=True)
    arr.setflags(write=False)
    return arr


@dataclass(frozen=True, eq=False)
class Params:
    """Physical parameter values.

    Fields:
        loadings: stream key -> W (n_features, K).
        intercepts: stream key -> b (n_features,).
        noise_sd: stream key -> sigma (n_features,), > 0.
        lengthscales: (K,) GP lengthscales in seconds (> 0; R-MSRM ignores them).
        response: response key -> {"lag": ..., "width": ...}; keys are modalities (shared pooling) or
            "participant/modality" (individual pooling), for parametrised responses only.
    """

    loadings: Mapping[str, np.ndarray]
    intercepts: Mapping[str, np.ndarray]
    noise_sd: Mapping[str, np.ndarray]
    lengthscales: np.ndarray = field(default_factory=lambda: np.zeros(0))
    response: Mapping[str, Mapping[str, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("loadings", "intercepts", "noise_sd"):
            d = getattr(self, name)
            if not isinstance(d, Mapping):
                raise ValueError(f"Params.{name} must be a dict keyed by 'participant/modality'")
            object.__setattr__(self, name, {str(k): _freeze(v) for k, v in d.items()})
        object.__setattr__(self, "lengthscales", _freeze(np.atleast_1d(self.lengthscales)))
        if not isinstance(self.response, Mapping):
            raise ValueError("Params.response must be a dict of {name: value} dicts")
        resp = {}
        for k, v in self.response.items():
            if not isinstance(v, Mapping):
                raise ValueError(f"Params.response[{k!r}] must be a dict like {{'lag': 3.0}}")
            resp[str(k)] = {str(n): float(x) for n, x in v.items()}
        object.__setattr__(self, "response", resp)

    # ------------------------------------------------------------------ validation
    def validate(self, data: Dataset, spec: ModelSpec, *, require_lengthscales: bool = True) -> "Params":
        """Check keys, shapes and ranges against data and spec; raise KeyError/ValueError naming the entry."""
        K = spec.n_factors
        keys = set(data.stream_keys)
        for name in ("loadings", "intercepts", "noise_sd"):
            d = getattr(self, name)
            unknown = sorted(set(d) - keys)
            if unknown:
                raise KeyError(f"Params.{name}: unknown stream key(s) {unknown}; streams are {list(data.stream_keys)}")
            missing = [k for k in data.stream_keys if k not in d]
            if missing:
                raise KeyError(f"Params.{name}: missing stream key(s) {missing}")
        for key in data.stream_keys:
            F = data.n_features[key]
            W = self.loadings[key]
            if W.shape != (F, K):
                raise ValueError(f"Params.loadings[{key!r}]: shape {W.shape}, expected (n_features, K) = {(F, K)}")
            for name in ("intercepts", "noise_sd"):
                v = getattr(self, name)[key]
                if v.shape != (F,):
                    raise ValueError(f"Params.{name}[{key!r}]: shape {v.shape}, expected (n_features,) = {(F,)}")
            for name, arr in (("loadings", W), ("intercepts", self.intercepts[key]), ("noise_sd", self.noise_sd[key])):
                if not np.isfinite(arr).all():
                    raise ValueError(f"Params.{name}[{key!r}]: contains non-finite values")
            if (self.noise_sd[key] <= 0).any():
                bad = np.flatnonzero(self.noise_sd[key] <= 0)[:10].tolist()
                raise ValueError(f"Params.noise_sd[{key!r}]: must be > 0 (features {bad})")
        if require_lengthscales or self.lengthscales.size:
            if self.lengthscales.shape != (K,):
                raise ValueError(f"Params.lengthscales: shape {self.lengthscales.shape}, expected (K,) = {(K,)}")
            if not np.isfinite(self.lengthscales).all() or (self.lengthscales <= 0).any():
                raise ValueError(f"Params.lengthscales: must be finite and > 0, got {self.lengthscales.tolist()}")
        expected = expected_response_keys(data, spec)
        unknown = sorted(set(self.response) - set(expected))
        if unknown:
            raise KeyError(
                f"Params.response: unknown key(s) {unknown}; expected {sorted(expected)} (pooling={spec.pooling!r})"
            )
        missing = sorted(set(expected) - set(self.response))
        if missing:
            raise KeyError(f"Params.response: missing key(s) {missing} (pooling={spec.pooling!r})")
        for k, resp in expected.items():
            resp.check_theta(self.response[k], where=f"Params.response[{k!r}]")
        return self

    # ------------------------------------------------------------------ archives
    def flatten(self) -> dict[str, np.ndarray]:
        """Flat name -> array dict (for .npz archives): "loadings/<key>", "response/<key>/<name>", ..."""
        out: dict[str, np.ndarray] = {}
        for name in ("loadings", "intercepts", "noise_sd"):
            for k, v in getattr(self, name).items():
                out[f"{name}/{k}"] = np.asarray(v)
        out["lengthscales"] = np.asarray(self.lengthscales)
        for k, theta in self.response.items():
            for n, v in theta.items():
                out[f"response/{k}/{n}"] = np.asarray(v, dtype=np.float64)
        return out

    @classmethod
    def unflatten(cls, flat: Mapping[str, np.ndarray]) -> "Params":
        parts: dict[str, dict] = {"loadings": {}, "intercepts": {}, "noise_sd": {}}
        response: dict[str, dict[str, float]] = {}
        lengthscales = np.zeros(0)
        for name, v in flat.items():
            if name == "lengthscales":
                lengthscales = np.asarray(v)
                continue
            head, _, rest = name.partition("/")
            if head in parts:
                parts[head][rest] = np.asarray(v)
            elif head == "response":
                key, _, pname = rest.rpartition("/")
                response.setdefault(key, {})[pname] = float(np.asarray(v))
            else:
                raise KeyError(f"unknown parameter entry {name!r} in archive")
        return cls(lengthscales=lengthscales, response=response, **parts)

    def allclose(self, other: "Params", rtol: float = 1e-12, atol: float = 0.0) -> bool:
        a, b = self.flatten(), other.flatten()
        return a.keys() == b.keys() and all(np.allclose(a[k], b[k], rtol=rtol, atol=atol) for k in a)

    def replace(self, **changes) -> "Params":
        kw = {n: getattr(self, n) for n in ("loadings", "intercepts", "noise_sd", "lengthscales", "response")}
        kw.update(changes)
        return Params(**kw)

    def __repr__(self) -> str:
        return (
            f"Params(streams={list(self.loadings)}, lengthscales={np.round(self.lengthscales, 4).tolist()}, "
            f"response={self.response})"
        )


