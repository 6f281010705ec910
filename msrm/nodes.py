"""Node tables: the distinct (response group, sample time) pairs of each run.

Every stream observed at a node sees the same K-vector ``x(node) = A(node)^T Z``, so likelihoods work per node
with sufficient statistics instead of per observation.

A *response group* is the set of streams that share a response and its parameters: one per modality under
``pooling="shared"``, one per (participant, modality) stream under ``pooling="individual"``. A response without
parameters (Identity) gives the same rows to every stream of its modality, so it always forms a single group.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .data import Dataset, Run
from .responses import Response
from .spec import ModelSpec, latent_grid

__all__ = ["ResponseGroup", "RunNodes", "response_groups", "prepare_nodes", "count_nodes"]

# Sample times closer than this (seconds) are the same node.
_TIME_DECIMALS = 9


class ResponseGroup(NamedTuple):
    """Streams sharing a response and its parameters.

    Fields:
        key: modality (shared, or parameter-free response) or "participant/modality" (individual).
        modality: the modality.
        response: the Response.
        param_key: key into ``Params.response``, or None for a response without parameters.
    """

    key: str
    modality: str
    response: Response
    param_key: str | None


class RunNodes(NamedTuple):
    """Node table of one run.

    Fields:
        grid: (J,) latent grid.
        groups: the dataset's response groups (same tuple for every run).
        node_group: (N,) group index of each node.
        node_time: (N,) sample time of each node in seconds.
        stream_nodes: stream key -> (n_samples,) node index of each sample.
        stream_group: stream key -> group index.
    """

    grid: np.ndarray
    groups: tuple[ResponseGroup, ...]
    node_group: np.ndarray
    node_time: np.ndarray
    stream_nodes: dict[str, np.ndarray]
    stream_group: dict[str, int]

    @property
    def n_nodes(self) -> int:
        return int(self.node_group.size)

    def group_nodes(self, g: int) -> np.ndarray:
        """Node indices of group ``g`` (ascending time)."""
        return np.flatnonzero(self.node_group == g)


def _group_key(spec: ModelSpec, key: str, modality: str) -> tuple[str, str | None]:
    response = spec.response(modality)
    if not response.param_names:
        return modality, None
    if spec.pooling == "shared":
        return modality, modality
    return key, key


def response_groups(data: Dataset, spec: ModelSpec) -> tuple[ResponseGroup, ...]:
    """The response groups of a dataset under a spec, in first-appearance order of their streams.

    Raises:
        KeyError: a modality in the data has no response in the spec.
    """
    groups: dict[str, ResponseGroup] = {}
    for key in data.stream_keys:
        modality = data.modality_of(key)
        if modality not in spec.responses:
            raise KeyError(
                f"stream {key}: modality {modality!r} has no response in the spec "
                f"(responses are given for {sorted(spec.responses)})"
            )
        gkey, pkey = _group_key(spec, key, modality)
        if gkey not in groups:
            groups[gkey] = ResponseGroup(gkey, modality, spec.response(modality), pkey)
    return tuple(groups.values())


def prepare_nodes(
    run: Run, spec: ModelSpec, groups: tuple[ResponseGroup, ...], *, grouped: bool = True
) -> RunNodes:
    """Build the node table of one run.

    Args:
        run: the run.
        spec: the model spec (grid and pooling).
        groups: from :func:`response_groups` on the whole dataset.
        grouped: True merges samples of one group at the same time into one node; False makes every
            (stream, sample) its own node (the ungrouped ``dense`` reference).
    """
    node_group: list[np.ndarray] = []
    node_time: list[np.ndarray] = []
    stream_nodes: dict[str, np.ndarray] = {}
    stream_group: dict[str, int] = {}
    n = 0
    for g_i, g in enumerate(groups):
        members = [s for s in run.streams if _group_key(spec, s.key, s.modality)[0] == g.key]
        if not members:
            continue
        for s in members:
            stream_group[s.key] = g_i
        if grouped:
            times = np.concatenate([s.times for s in members])
            keys = np.round(times, _TIME_DECIMALS)
            uniq, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
            node_group.append(np.full(uniq.size, g_i, dtype=np.int64))
            node_time.append(times[first])
            pos = 0
            for s in members:
                stream_nodes[s.key] = n + inverse[pos : pos + s.n_samples].astype(np.int64)
                pos += s.n_samples
            n += uniq.size
        else:
            for s in members:
                node_group.append(np.full(s.n_samples, g_i, dtype=np.int64))
                node_time.append(s.times)
                stream_nodes[s.key] = n + np.arange(s.n_samples, dtype=np.int64)
                n += s.n_samples
    for s in run.streams:
        if s.key not in stream_group:
            raise KeyError(f"stream {s.key}: not in the dataset's response groups")
    return RunNodes(
        grid=latent_grid(run.duration, spec),
        groups=groups,
        node_group=np.concatenate(node_group) if node_group else np.zeros(0, np.int64),
        node_time=np.concatenate(node_time) if node_time else np.zeros(0),
        stream_nodes=stream_nodes,
        stream_group=stream_group,
    )


def count_nodes(data: Dataset, spec: ModelSpec, *, grouped: bool = True) -> list[int]:
    """Number of nodes per run."""
    groups = response_groups(data, spec)
    return [prepare_nodes(run, spec, groups, grouped=grouped).n_nodes for run in data.runs]
