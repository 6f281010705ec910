"""Everything R-MSRM needs from the data, computed once in NumPy before any iteration.

A *slot* is a set of streams of one run that share a response group and the same sample times (for example the
four brain streams of the one-eighth study, or the five rating streams): they see the same latent values
``x_i = A(theta) Z``, so operators and response derivatives are computed once per slot, and the per-stream
sufficient statistics are summed per slot before they meet the latent grid (the node grouping of ``msrm.nodes``).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import scipy.sparse as sp

from ..data import Dataset
from ..nodes import ResponseGroup, response_groups
from ..operators import WindowLayout, window_layout
from ..spec import ModelSpec, latent_grid

__all__ = [
    "Slot",
    "StreamData",
    "RunData",
    "Prepared",
    "prepare_rmsrm",
    "default_roughness",
    "second_difference_bands",
    "pad_tie_weight",
    "ROUGHNESS_TIMESCALE",
    "PAD_TIE_TIMESCALE",
]

# The default roughness penalty: lambda = (ROUGHNESS_TIMESCALE / latent_dt)^3 / s0 (see default_roughness).
ROUGHNESS_TIMESCALE = 2.0
# The pad tie (objective.py): rho = (latent_dt / PAD_TIE_TIMESCALE)^4 (see pad_tie_weight).
PAD_TIE_TIMESCALE = 2.0


class Slot(NamedTuple):
    """Streams of one run with one response group and identical sample times.

    Fields:
        group: index into ``Prepared.groups``.
        times: (n,) sample times in seconds.
        layout: static response windows of these times on the run's grid (``msrm.operators.window_layout``).
        streams: indices into ``RunData.streams`` of the member streams.
        pair_rows: (n, w (w + 1) / 2) int64: for sample i and window positions p <= q = p + d (ordered by d, then
            p), the row ``d J + start_i + p`` of block band d at grid point start_i + p (latent.latent_blocks).
        complete: True if every member stream is observed everywhere in this run (then M_i is one K x K matrix).
    """

    group: int
    times: np.ndarray
    layout: WindowLayout
    streams: tuple[int, ...]
    pair_rows: np.ndarray
    complete: bool


class StreamData(NamedTuple):
    """One stream of one run.

    Fields:
        key: "participant/modality".
        slot: index into ``RunData.slots``.
        values: (n, F) observations with missing values set to 0.
        mask: (n, F) float64 1.0 where observed, or None when the stream is complete in this run.
    """

    key: str
    slot: int
    values: np.ndarray
    mask: np.ndarray | None


class RunData(NamedTuple):
    """Fields: grid (J,); slots; streams; dtd: the three bands (d = 0, 1, 2) of D2^T D2, each (J,) zero-padded;
    observed: (J,) bool, the grid points inside the run's span [0, T] (the rest is the pad, objective.py)."""

    grid: np.ndarray
    slots: tuple[Slot, ...]
    streams: tuple[StreamData, ...]
    dtd: np.ndarray
    observed: np.ndarray


class Prepared(NamedTuple):
    """The fit's static inputs.

    Fields:
        spec: the ModelSpec.
        keys: stream keys (dataset order).
        n_features: key -> F.
        n_total_features: F_tot = sum of F over stream keys (normalises the penalty metric S).
        groups: response groups (``msrm.nodes.response_groups``).
        theta_groups: indices of groups with response parameters (the L-BFGS-B blocks).
        runs: per-run data.
        count: key -> (F,) observed values per feature over all runs (n_f).
        sum_y: key -> (F,) sum of observed values per feature over all runs.
        sum_y2: key -> (F,) sum of squared observed values per feature over all runs.
        roughness: lambda.
        band_blocks: block bandwidth + 1 of the latent normal equations (largest window, at least 3).
        any_missing: key -> True if the stream has a missing value in some run.
        pad_tie: rho, the weight of the pad tie relative to the roughness penalty (objective.py).
    """

    spec: ModelSpec
    keys: tuple[str, ...]
    n_features: dict
    n_total_features: int
    groups: tuple[ResponseGroup, ...]
    theta_groups: tuple[int, ...]
    runs: tuple[RunData, ...]
    count: dict
    sum_y: dict
    sum_y2: dict
    roughness: float
    band_blocks: int
    any_missing: dict
    pad_tie: float

    @property
    def n_factors(self) -> int:
        return self.spec.n_factors


def default_roughness(spec: ModelSpec, signal: float = 1.0) -> float:
    """Default lambda: ``(ROUGHNESS_TIMESCALE / latent_dt)^3 / signal`` with ROUGHNESS_TIMESCALE = 2 s.

    On a grid of step Delta, ``||D2 z||^2 ~ Delta^3 * integral z''(t)^2 dt``, so ``(2 s / Delta)^3`` gives the
    same continuous-time roughness penalty ``(2 s)^3 * integral z''^2 dt`` on unit-variance latents whatever the
    grid step. The objective's penalty is ``lambda/2 tr(Z^T D2^T D2 Z S)`` (objective.py); for unit-variance
    latents S is the mean noise-weighted signal per feature, so dividing by ``signal = tr(S0) / K`` (S0 of the
    PCA initialisation, measured by ``fit_rmsrm`` before any restart) keeps the penalty on unit-variance latents
    near ``(2 s / Delta)^3 / 2 sum_k ||D2 z_k||^2`` whatever the signal-to-noise ratio.
    """
    if not (math.isfinite(signal) and signal > 0):
        raise ValueError(f"signal must be finite and > 0, got {signal!r}")
    return float((ROUGHNESS_TIMESCALE / spec.latent_dt) ** 3 / signal)


def pad_tie_weight(spec: ModelSpec) -> float:
    """rho = (latent_dt / PAD_TIE_TIMESCALE)^4, the pad tie's weight relative to the roughness penalty.

    With rho the penalty on a pad that no observation reaches is ``||D2 z||^2 + rho ||z - m||^2``; its minimiser
    continues the run's edge as a damped oscillation ``exp(-u / l) cos(u / l)`` with ``l = sqrt(2) rho^(-1/4)``
    grid steps, i.e. sqrt(2) * PAD_TIE_TIMESCALE seconds whatever the grid step: ``||D2 z||^2 ~ Delta^3 int z''^2``
    and ``sum z^2 ~ Delta^-1 int z^2``, so their ratio scales as Delta^4.
    """
    return float((spec.latent_dt / PAD_TIE_TIMESCALE) ** 4)


def second_difference_bands(J: int) -> np.ndarray:
    """Bands of ``D2^T D2`` for second differences on J points.

    Returns:
        (3, J): row d holds entries (j, j + d) at column j (zero where j + d >= J).
    """
    if J < 3:
        raise ValueError(f"the latent grid needs at least 3 points for the roughness penalty, got {J}")
    D = sp.diags([np.ones(J - 2), -2.0 * np.ones(J - 2), np.ones(J - 2)], [0, 1, 2], shape=(J - 2, J))
    DtD = (D.T @ D).tocsr()
    out = np.zeros((3, J))
    for d in range(3):
        out[d, : J - d] = DtD.diagonal(d)
    return out


def prepare_rmsrm(data: Dataset, spec: ModelSpec, roughness: float | None = None) -> Prepared:
    """Validate data against the spec and build the static inputs of the fit.

    Raises:
        KeyError: a modality without a response in the spec.
        ValueError: bad roughness, or a run too short for its grid.
    """
    _check_inputs(data, spec)
    lam = _roughness_value(spec, roughness)
    groups = response_groups(data, spec)  # KeyError names a modality without a response
    group_of = {g.key: g_i for g_i, g in enumerate(groups)}
    keys, n_features = data.stream_keys, data.n_features
    runs = tuple(_prepare_run(run, spec, groups, group_of) for run in data.runs)
    count, sum_y, sum_y2, any_missing = _feature_totals(keys, n_features, runs)
    return Prepared(
        spec=spec,
        keys=keys,
        n_features=n_features,
        n_total_features=int(sum(n_features.values())),
        groups=groups,
        theta_groups=tuple(i for i, g in enumerate(groups) if g.param_key is not None),
        runs=runs,
        count=count,
        sum_y=sum_y,
        sum_y2=sum_y2,
        roughness=lam,
        band_blocks=max([3] + [sl.layout.width for run in runs for sl in run.slots]),
        any_missing=any_missing,
        pad_tie=pad_tie_weight(spec),
    )


def _check_inputs(data, spec) -> None:
    """Raise ValueError unless ``data`` is an msrm.Dataset and ``spec`` an msrm.ModelSpec."""
    if not isinstance(data, Dataset):
        raise ValueError(f"data must be an msrm.Dataset, got {type(data).__name__}")
    if not isinstance(spec, ModelSpec):
        raise ValueError(f"spec must be an msrm.ModelSpec, got {type(spec).__name__}")


def _roughness_value(spec: ModelSpec, roughness) -> float:
    """lambda: ``default_roughness(spec)`` (signal 1) when ``roughness`` is None, else ``roughness`` checked to be a
    finite number > 0."""
    if roughness is None:
        return default_roughness(spec)
    try:
        lam = float(roughness)
    except (TypeError, ValueError):
        raise ValueError(f"roughness must be a positive number or None, got {roughness!r}") from None
    if not math.isfinite(lam) or lam <= 0:
        raise ValueError(f"roughness must be finite and > 0, got {roughness!r}")
    return lam


def _slot_signature(stream, spec: ModelSpec, group_of: dict) -> tuple:
    """(response group index, n samples, dt, offset): streams of one run with equal signatures form one slot.

    The group is the modality's under shared pooling or for a response without parameters, else the stream's own;
    dt and offset are rounded to 1e-12 s so that equal sample times compare equal.
    """
    resp = spec.response(stream.modality)
    gkey = stream.modality if not resp.param_names or spec.pooling == "shared" else stream.key
    return (group_of[gkey], stream.n_samples, round(stream.dt, 12), round(stream.offset, 12))


def _observed_values(stream) -> tuple[np.ndarray, np.ndarray | None]:
    """(values (n, F) with missing entries set to 0, float64 mask (n, F) or None when nothing is missing)."""
    mask = stream.mask
    values = np.where(mask, stream.values, 0.0)
    return values, None if bool(mask.all()) else mask.astype(np.float64)


def _pair_rows(layout: WindowLayout, J: int) -> np.ndarray:
    """(n, w (w + 1) / 2) rows ``d J + start_i + p`` of the block bands, pairs ordered by d then p (Slot.pair_rows)."""
    w = layout.width
    return np.concatenate([d * J + layout.start[:, None] + np.arange(w - d)[None, :] for d in range(w)], axis=1)


def _prepare_run(run, spec: ModelSpec, groups: tuple, group_of: dict) -> RunData:
    """One run's grid, slots (streams grouped by :func:`_slot_signature`, in order of first appearance), streams
    with their observed values, and the bands of D2^T D2 on the grid."""
    grid = latent_grid(run.duration, spec)
    members: dict[tuple, list[int]] = {}
    times: dict[tuple, np.ndarray] = {}
    for s_i, s in enumerate(run.streams):
        sig = _slot_signature(s, spec, group_of)
        members.setdefault(sig, []).append(s_i)
        times.setdefault(sig, s.times)
    observed = [_observed_values(s) for s in run.streams]
    slots = []
    slot_of = {}
    for sl_i, (sig, idx) in enumerate(members.items()):
        layout = window_layout(times[sig], groups[sig[0]].response, grid)
        complete = all(observed[s_i][1] is None for s_i in idx)
        slots.append(Slot(sig[0], times[sig], layout, tuple(idx), _pair_rows(layout, grid.size), complete))
        slot_of.update((s_i, sl_i) for s_i in idx)
    streams = tuple(StreamData(s.key, slot_of[s_i], *observed[s_i]) for s_i, s in enumerate(run.streams))
    in_span = (grid >= -1e-9) & (grid <= run.duration + 1e-9)
    return RunData(grid=grid, slots=tuple(slots), streams=streams, dtd=second_difference_bands(grid.size),
                   observed=in_span)


def _feature_totals(keys: tuple, n_features: dict, runs: tuple) -> tuple[dict, dict, dict, dict]:
    """Per stream key, over all runs: (count n_f, sum of y, sum of y^2, each (F,); any missing value)."""
    count = {k: np.zeros(F) for k, F in n_features.items()}
    sum_y = {k: np.zeros(F) for k, F in n_features.items()}
    sum_y2 = {k: np.zeros(F) for k, F in n_features.items()}
    any_missing = {k: False for k in keys}
    for run in runs:
        for st in run.streams:
            count[st.key] += st.values.shape[0] if st.mask is None else st.mask.sum(axis=0)
            sum_y[st.key] += st.values.sum(axis=0)
            sum_y2[st.key] += (st.values * st.values).sum(axis=0)
            any_missing[st.key] |= st.mask is not None
    return count, sum_y, sum_y2, any_missing
