"""The data model: streams on their own clocks, grouped into independent runs.

A :class:`Stream` is one participant's recording of one modality on a regular clock
(sample ``i`` at ``offset + i * dt``) with values ``Y`` of shape ``(n_samples, n_features)``; NaN marks a
missing value. A :class:`Run` is a span ``[0, duration]`` holding streams; a :class:`Dataset` is a list of
independent runs. All three are immutable and validated on construction: bad input raises ``ValueError`` whose
message names the stream and the problem, before any numerics.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

__all__ = ["Stream", "Run", "Dataset", "stream_key"]

# Sample times may overshoot the run's end by this much (floating error of offset + i * dt).
_TIME_TOL = 1e-9


def stream_key(participant: str, modality: str) -> str:
    """The key ``"participant/modality"`` that names a stream in Params and results."""
    return f"{participant}/{modality}"


@dataclass(frozen=True, eq=False)
class Stream:
    """One participant's recording of one modality.

    Args:
        participant: participant label (no ``/``).
        modality: modality name (``"brain"``, ``"rating"``, ``"physio"`` or any other; no ``/``).
        dt: sampling interval in seconds (finite, > 0).
        values: (n_samples, n_features) array; NaN = missing. Copied to a read-only float64 array.
        offset: time of the first sample in seconds (>= 0).
    """

    participant: str
    modality: str
    dt: float
    values: np.ndarray = field(repr=False)
    offset: float = 0.0

    def __post_init__(self) -> None:
        for name in ("participant", "modality"):
            v = getattr(self, name)
            if not isinstance(v, str) or not v or "/" in v:
                raise ValueError(f"stream {name} must be a non-empty string without '/', got {v!r}")
        key = self.key
        try:
            dt = float(self.dt)
        except (TypeError, ValueError):
            raise ValueError(f"stream {key}: dt must be a number, got {self.dt!r}") from None
        if not math.isfinite(dt) or dt <= 0:
            raise ValueError(f"stream {key}: dt must be finite and > 0, got {self.dt!r}")
        try:
            offset = float(self.offset)
        except (TypeError, ValueError):
            raise ValueError(f"stream {key}: offset must be a number, got {self.offset!r}") from None
        if not math.isfinite(offset) or offset < 0:
            raise ValueError(f"stream {key}: offset must be finite and >= 0, got {self.offset!r}")
        values = np.asarray(self.values)
        if values.dtype == object or not np.issubdtype(values.dtype, np.number) or np.issubdtype(values.dtype, np.complexfloating):
            raise ValueError(f"stream {key}: values must be a real numeric array, got dtype {values.dtype}")
        if values.ndim != 2:
            raise ValueError(
                f"stream {key}: values must be 2-D (n_samples, n_features), got shape {values.shape}"
            )
        if values.shape[0] == 0 or values.shape[1] == 0:
            raise ValueError(f"stream {key}: empty stream, values have shape {values.shape}")
        values = np.array(values, dtype=np.float64, copy=True)
        if np.isinf(values).any():
            i, f = np.argwhere(np.isinf(values))[0]
            raise ValueError(
                f"stream {key}: values contain +/-inf (first at sample {i}, feature {f}); use NaN for missing"
            )
        observed = ~np.isnan(values)
        empty_features = np.flatnonzero(~observed.any(axis=0))
        if empty_features.size:
            raise ValueError(
                f"stream {key}: feature(s) {empty_features[:10].tolist()} are all NaN (no observed value)"
            )
        values.setflags(write=False)
        object.__setattr__(self, "dt", dt)
        object.__setattr__(self, "offset", offset)
        object.__setattr__(self, "values", values)

    @property
    def key(self) -> str:
        return stream_key(self.participant, self.modality)

    @property
    def n_samples(self) -> int:
        return int(self.values.shape[0])

    @property
    def n_features(self) -> int:
        return int(self.values.shape[1])

    @property
    def times(self) -> np.ndarray:
        """(n_samples,) sample times ``offset + i * dt`` in seconds."""
        return self.offset + self.dt * np.arange(self.n_samples, dtype=np.float64)

    @property
    def mask(self) -> np.ndarray:
        """(n_samples, n_features) True where a value is observed."""
        return ~np.isnan(self.values)

    @property
    def n_observed(self) -> int:
        return int(self.mask.sum())

    def __repr__(self) -> str:
        return (
            f"Stream({self.key!r}, dt={self.dt}, offset={self.offset}, "
            f"n_samples={self.n_samples}, n_features={self.n_features})"
        )


@dataclass(frozen=True, eq=False)
class Run:
    """An independent recording span ``[0, duration]`` seconds holding streams.

    Args:
        duration: run length T in seconds (finite, > 0).
        streams: streams of this run; at most one per (participant, modality); every sample inside [0, T].
    """

    duration: float
    streams: tuple[Stream, ...]

    def __post_init__(self) -> None:
        try:
            duration = float(self.duration)
        except (TypeError, ValueError):
            raise ValueError(f"run duration must be a number, got {self.duration!r}") from None
        if not math.isfinite(duration) or duration <= 0:
            raise ValueError(f"run duration must be finite and > 0, got {self.duration!r}")
        streams = tuple(self.streams)
        if not streams:
            raise ValueError("a run needs at least one stream")
        seen: set[str] = set()
        for s in streams:
            if not isinstance(s, Stream):
                raise ValueError(f"run streams must be msrm.Stream objects, got {type(s).__name__}")
            if s.key in seen:
                raise ValueError(f"stream {s.key}: duplicate (participant, modality) in one run")
            seen.add(s.key)
            last = s.offset + (s.n_samples - 1) * s.dt
            if last > duration + _TIME_TOL * max(1.0, duration):
                raise ValueError(
                    f"stream {s.key}: samples beyond the run's duration (last sample at {last:.6g} s, "
                    f"duration {duration:.6g} s)"
                )
        object.__setattr__(self, "duration", duration)
        object.__setattr__(self, "streams", streams)

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(s.key for s in self.streams)

    def stream(self, key: str) -> Stream:
        for s in self.streams:
            if s.key == key:
                return s
        raise KeyError(f"run has no stream {key!r}; streams are {list(self.keys)}")

    def __repr__(self) -> str:
        return f"Run(duration={self.duration}, streams={list(self.keys)})"


@dataclass(frozen=True, eq=False)
class Dataset:
    """Independent runs. A stream key present in several runs must have the same feature count in each."""

    runs: tuple[Run, ...]

    def __init__(self, runs: Iterable[Run] | Run):
        if isinstance(runs, Run):
            runs = [runs]
        runs = tuple(runs)
        if not runs:
            raise ValueError("a dataset needs at least one run")
        n_features: dict[str, int] = {}
        for r_i, run in enumerate(runs):
            if not isinstance(run, Run):
                raise ValueError(f"dataset runs must be msrm.Run objects, got {type(run).__name__} at {r_i}")
            for s in run.streams:
                if s.key in n_features and n_features[s.key] != s.n_features:
                    raise ValueError(
                        f"stream {s.key}: {s.n_features} features in run {r_i} but {n_features[s.key]} in an "
                        f"earlier run; a stream's features must be the same in every run"
                    )
                n_features.setdefault(s.key, s.n_features)
        object.__setattr__(self, "runs", runs)
        object.__setattr__(self, "_n_features", n_features)

    @property
    def stream_keys(self) -> tuple[str, ...]:
        """Stream keys in first-appearance order across runs."""
        return tuple(self._n_features)

    @property
    def n_features(self) -> dict[str, int]:
        return dict(self._n_features)

    @property
    def modalities(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(k.split("/", 1)[1] for k in self.stream_keys))

    @property
    def participants(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(k.split("/", 1)[0] for k in self.stream_keys))

    def modality_of(self, key: str) -> str:
        if key not in self._n_features:
            raise KeyError(f"dataset has no stream {key!r}")
        return key.split("/", 1)[1]

    @property
    def n_observed(self) -> int:
        return sum(s.n_observed for run in self.runs for s in run.streams)

    def __len__(self) -> int:
        return len(self.runs)

    def __iter__(self):
        return iter(self.runs)

    def __repr__(self) -> str:
        return f"Dataset(runs={len(self.runs)}, streams={list(self.stream_keys)})"




def split_run(run: Run, n_pieces: int) -> list[Run]:
    """Cut one run into ``n_pieces`` consecutive runs of equal duration (recordings split at their boundaries).

    Each stream's samples are assigned to the piece whose span ``[t0, t1)`` holds them (the last piece includes
    its end); the stream keeps its clock (``dt``), and its offset becomes the first sample's time minus ``t0``.

    Args:
        run: the run to cut.
        n_pieces: number of pieces (>= 1).
    Returns:
        list of Runs, each of duration ``run.duration / n_pieces``.
    """
    if isinstance(n_pieces, bool) or not isinstance(n_pieces, (int, np.integer)) or n_pieces < 1:
        raise ValueError(f"n_pieces must be a positive integer, got {n_pieces!r}")
    piece = run.duration / n_pieces
    out = []
    for p in range(n_pieces):
        t0, t1 = p * piece, (p + 1) * piece
        streams = []
        for s in run.streams:
            t = s.times
            inside = (t >= t0 - _TIME_TOL) & ((t < t1 - _TIME_TOL) | (p == n_pieces - 1))
            idx = np.flatnonzero(inside)
            if idx.size == 0:
                continue
            values = s.values[idx]
            observed = ~np.isnan(values)
            if not observed.any(axis=0).all():
                raise ValueError(
                    f"stream {s.key}: a feature has no observed value in piece {p} of the split; "
                    f"use fewer pieces"
                )
            streams.append(
                Stream(s.participant, s.modality, s.dt, values, offset=max(0.0, float(t[idx[0]] - t0)))
            )
        out.append(Run(duration=piece, streams=streams))
    return out
