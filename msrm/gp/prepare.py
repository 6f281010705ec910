r"""NumPy preparation of the dense and grouped GP-MSRM likelihoods: once per model, static shapes.

A prepared run is a :class:`RunPrepared` NamedTuple with two parts:

* ``layout`` (:class:`RunLayout`): everything static - node table, grid distances, response windows, the
  sample-to-node maps and the per-node choice of the factor ``R_u`` (below). It is a JAX pytree node **without
  leaves**, compared by identity, so a whole prepared object can be handed to ``jax.jit`` as an argument: only
  the data arrays are traced, the layout travels in the tree structure.
* ``streams`` (tuple of :class:`StreamStats`): the data arrays of each stream and its constant data terms,
  computed once. Every feature is first **centred** on its observed mean ``c_f`` (a constant of the data, not a
  parameter): ``Y0 = m (y - c)`` with NaN -> 0, and

  .. math::

      S_{1,f} = \sum_i m_{if} (y_{if} - c_f), \qquad S_{2,f} = \sum_i m_{if} (y_{if} - c_f)^2,
      \qquad n_f = \sum_i m_{if},

  so that with ``d_f = b_f - c_f``, ``r^T D^-1 r = sum_f (S2_f - 2 d_f S1_f + n_f d_f^2) / sigma_f^2`` needs no
  pass over the data. Centring is what keeps this sum accurate: raw scanner values of 1e3-1e8 would make
  ``S2``, ``2 b S1`` and ``n b^2`` agree in their leading digits and cancel (an error of ``eps n b^2 / sigma^2``
  nats); about the mean ``S1`` is zero to rounding and the three terms are non-negative or negligible, so the
  sum is accurate to ``eps`` times itself whatever the offset.

**The factor R_u** (``Lambda_u = R_u^T R_u``, K x K). A node's information matrix
``Lambda_u = sum W^T diag(m / sigma^2) W`` sums one rank-one term ``w_f w_f^T / sigma_f^2`` per observed feature
row at the node. It is singular when the node sees at most K observed rows (e.g. a node reached only by
one-feature streams, or a sample whose features are mostly missing), where a Cholesky factor would be NaN.
The choice is made here, statically, per node: if the node's observed-row count is ``<= K``, ``R_u`` is the
stacked rows ``w_f / sigma_f`` (zero-padded to K rows; exact, since their Gram matrix is ``Lambda_u``);
otherwise ``R_u = chol(Lambda_u)^T``, computed in JAX (``Lambda_u`` is then generically positive definite).
``low_rows``/``low_feats`` of each :class:`StreamLayout` say which row of the flattened (N K, K) factor each
observed value of a low-count node fills.

``dense`` is the same preparation on the ungrouped node table (every (stream, sample) its own node).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import jax
import numpy as np

from ..data import Dataset, Run, Stream
from ..nodes import ResponseGroup, prepare_nodes, response_groups
from ..operators import WindowLayout, window_layout
from ..responses import Response
from ..spec import ModelSpec
from .kernels import grid_distances

__all__ = ["Prepared", "RunPrepared", "RunLayout", "prepare_run", "prepare"]


class StreamStats(NamedTuple):
    """Data arrays of one stream with ``n_s`` samples of ``F`` features, centred per feature (module docstring);
    every field float64 (the traced leaves of a prepared run).

    Fields:
        Y0: (n_s, F) ``y - c`` where observed, 0.0 where missing.
        mask: (n_s, F) 1.0 where observed, 0.0 where missing; ``None`` when nothing is missing.
        S1: (F,) ``sum_i m (y - c)`` (zero to rounding).
        S2: (F,) ``sum_i m (y - c)^2``.
        n_f: (F,) observed count per feature.
        centre: (F,) ``c``, the observed mean of each feature.
    """

    Y0: np.ndarray
    mask: np.ndarray | None
    S1: np.ndarray
    S2: np.ndarray
    n_f: np.ndarray
    centre: np.ndarray


def prepare_stream_stats(stream: Stream) -> StreamStats:
    """Per-stream centred data arrays and constant data terms (shared by every backend)."""
    observed = stream.mask
    m = observed.astype(np.float64)
    n_f = m.sum(axis=0)
    centre = np.where(observed, stream.values, 0.0).sum(axis=0) / np.maximum(n_f, 1.0)
    Y0 = np.where(observed, stream.values - centre, 0.0)
    return StreamStats(
        Y0=Y0,
        mask=None if observed.all() else m,
        S1=Y0.sum(axis=0),
        S2=(Y0 * Y0).sum(axis=0),
        n_f=n_f,
        centre=centre,
    )


@dataclass(frozen=True, eq=False)
class StreamLayout:
    """Static placement of one stream's samples in the node table of its run (N nodes, K factors).

    Fields:
        key: stream key ``"participant/modality"``.
        group: index of its response group.
        n_features: F.
        sample_nodes: (n_s,) int64 node index of each sample.
        node_counts: (N,) float64 number of this stream's samples at each node (0 or 1 in practice).
        has_missing: whether ``StreamStats.mask`` is present.
        low_rows: (e,) int64 row of the flattened (N K, K) factor ``R`` filled by each observed value at a
            low-count node (``u * K + slot``).
        low_feats: (e,) int64 feature index of that value.
    """

    key: str
    group: int
    n_features: int
    sample_nodes: np.ndarray
    node_counts: np.ndarray
    has_missing: bool
    low_rows: np.ndarray
    low_feats: np.ndarray


@dataclass(frozen=True, eq=False)
class GroupLayout:
    """Static response windows of one response group's ``n_g`` nodes in one run.

    Fields:
        key: group key; response: the Response; param_key: key into ``theta["response"]`` or None.
        node_start, node_stop: the group's nodes are ``node_start .. node_stop - 1`` (contiguous, ``n_g`` of them).
        window: :class:`msrm.operators.WindowLayout` of the nodes' times on the grid (width ``w``).
        rows, cols: (n_g * w,) int64 positions of the window weights in the dense (N, J) response matrix.
    """

    key: str
    response: Response
    param_key: str | None
    node_start: int
    node_stop: int
    window: WindowLayout
    rows: np.ndarray
    cols: np.ndarray


@dataclass(frozen=True, eq=False)
class RunLayout:
    """Everything static about one run (a leafless pytree node, hashed by identity).

    Fields:
        n_nodes: N. n_grid: J. n_factors: K. n_obs: observed scalars. kernel: Matérn name.
        grid: (J,) float64 latent grid in seconds. dist: (J, J) float64 grid distances, computed on first use and
        kept (the dense and grouped covariances read them; the state-space backend never does, so a long grid
        costs it O(J)).
        node_group: (N,) int64 response group of each node. node_time: (N,) float64 its sample time in seconds.
        node_rows: (N,) int64 observed feature rows per node.
        groups: one :class:`GroupLayout` per response group present in the run. streams: one
        :class:`StreamLayout` per stream (same order as ``RunPrepared.streams``).
        chol_nodes: (n_c,) int64 nodes whose factor is ``chol(Lambda_u)^T`` (observed rows > K).
        method: quad_logdet method, one of :data:`msrm.gp.linalg.METHODS`.
        grouped: False for the ungrouped dense reference table.
    """

    n_nodes: int
    n_grid: int
    n_factors: int
    n_obs: int
    kernel: str
    grid: np.ndarray
    node_group: np.ndarray
    node_time: np.ndarray
    node_rows: np.ndarray
    groups: tuple[GroupLayout, ...]
    streams: tuple[StreamLayout, ...]
    chol_nodes: np.ndarray
    method: str
    grouped: bool

    @functools.cached_property
    def dist(self) -> np.ndarray:
        """(J, J) ``|tau_i - tau_j|`` (O(J^2) memory: built only by the backends that read it)."""
        return grid_distances(self.grid)


jax.tree_util.register_pytree_node(RunLayout, lambda layout: ((), layout), lambda layout, _: layout)


class RunPrepared(NamedTuple):
    """One prepared run (a pytree whose leaves are the arrays of ``streams``).

    Fields:
        layout: the static :class:`RunLayout` (no leaves).
        streams: one :class:`StreamStats` per stream, same order as ``layout.streams``: (n_s, F) and (F,) float64.
    """

    layout: RunLayout
    streams: tuple[StreamStats, ...]


class Prepared(NamedTuple):
    """A prepared dataset for the dense/grouped backends (a pytree).

    Fields:
        runs: one :class:`RunPrepared` per run of the dataset, in its order.
    """

    runs: tuple[RunPrepared, ...]


def _group_layout(g: ResponseGroup, start: int, stop: int, node_time: np.ndarray, grid: np.ndarray) -> GroupLayout:
    window = window_layout(node_time[start:stop], g.response, grid)
    n_g, w = window.delta.shape
    rows = np.repeat(np.arange(start, stop), w)
    cols = (window.start[:, None] + np.arange(w)[None, :]).ravel()
    return GroupLayout(g.key, g.response, g.param_key, start, stop, window, rows, cols)


def _low_rows(sample_nodes: np.ndarray, observed: np.ndarray, low: np.ndarray, slot: np.ndarray,
              K: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows of the flattened (N K, K) factor filled by one stream's observed values at low-count nodes.

    The observed values at a low node take its next free rows in (sample, feature) order: the e-th such value
    of this stream at node u fills row ``u K + slot[u] + e``. ``slot`` (N,) is advanced in place past them, so
    the streams of a run fill each node's rows one after another. Vectorised (O(observed values) memory, no
    per-sample arrays).

    Args:
        sample_nodes: (n_s,) node of each sample. observed: (n_s, F) bool. low: (N,) bool, low-count nodes.
        slot: (N,) int64 next free row of each node's factor (updated). K: factors.
    Returns:
        (rows, feats): (e,) int64 factor rows and feature indices.
    """
    at_low = np.flatnonzero(low[sample_nodes])
    if at_low.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    i, feats = np.nonzero(observed[at_low])  # row-major: samples in order, features ascending
    u = sample_nodes[at_low][i]
    order = np.argsort(u, kind="stable")
    first = np.searchsorted(u[order], u[order], side="left")  # first position of each value's node in order
    rank = np.empty_like(u)
    rank[order] = np.arange(u.size) - first  # the value's place among this stream's values at its node
    rows = u * K + slot[u] + rank
    slot += np.bincount(u, minlength=slot.size)
    return rows.astype(np.int64), feats.astype(np.int64)


def prepare_run(
    run: Run,
    spec: ModelSpec,
    groups: tuple[ResponseGroup, ...],
    *,
    grouped: bool = True,
    method: str = "auto",
) -> RunPrepared:
    """Prepare one run (NumPy, once).

    Args:
        run: the run.
        spec: model spec.
        groups: response groups of the whole dataset (:func:`msrm.nodes.response_groups`).
        grouped: True for node grouping, False for the ungrouped dense reference.
        method: quad_logdet method recorded in the layout.
    """
    K = spec.n_factors
    nodes = prepare_nodes(run, spec, groups, grouped=grouped)
    N = nodes.n_nodes
    grid = nodes.grid
    group_layouts = []
    for g_i, g in enumerate(groups):
        idx = nodes.group_nodes(g_i)
        if idx.size == 0:
            continue
        start, stop = int(idx[0]), int(idx[-1]) + 1
        if not np.array_equal(idx, np.arange(start, stop)):  # pragma: no cover - prepare_nodes guarantees this
            raise ValueError(f"group {g.key}: nodes are not contiguous in the node table")
        group_layouts.append(_group_layout(g, start, stop, nodes.node_time, grid))

    stats = tuple(prepare_stream_stats(s) for s in run.streams)
    node_rows = np.zeros(N, dtype=np.int64)
    for s, st in zip(run.streams, stats):
        np.add.at(node_rows, nodes.stream_nodes[s.key], st.n_f.size if st.mask is None else st.mask.sum(axis=1).astype(np.int64))
    low = node_rows <= K
    slot = np.zeros(N, dtype=np.int64)  # next free row of each low node's factor
    stream_layouts = []
    for s, st in zip(run.streams, stats):
        sample_nodes = nodes.stream_nodes[s.key]
        counts = np.bincount(sample_nodes, minlength=N).astype(np.float64)
        low_rows, low_feats = _low_rows(sample_nodes, s.mask, low, slot, K)
        stream_layouts.append(
            StreamLayout(
                key=s.key,
                group=nodes.stream_group[s.key],
                n_features=s.n_features,
                sample_nodes=sample_nodes,
                node_counts=counts,
                has_missing=st.mask is not None,
                low_rows=low_rows,
                low_feats=low_feats,
            )
        )
    layout = RunLayout(
        n_nodes=N,
        n_grid=int(grid.size),
        n_factors=K,
        n_obs=int(sum(st.n_f.sum() for st in stats)),
        kernel=spec.kernel,
        grid=grid,
        node_group=nodes.node_group,
        node_time=nodes.node_time,
        node_rows=node_rows,
        groups=tuple(group_layouts),
        streams=tuple(stream_layouts),
        chol_nodes=np.flatnonzero(~low),
        method=method,
        grouped=grouped,
    )
    return RunPrepared(layout=layout, streams=stats)


def prepare(data: Dataset, spec: ModelSpec, *, grouped: bool = True, method: str = "auto") -> Prepared:
    """Prepare a dataset for :func:`msrm.gp.likelihood.grouped_loglik` (the backend ``prepare``).

    Args:
        data: the dataset.
        spec: the model spec.
        grouped: True (``"grouped"``) or False (``"dense"``, the ungrouped reference).
        method: quad_logdet method, one of :data:`msrm.gp.linalg.METHODS` (recorded in each layout; checked where
            the options are made, :func:`msrm.gp.backends.make_options`, and by :func:`msrm.gp.linalg.quad_logdet`
            when the likelihood is traced).
    Raises:
        KeyError: a modality of the data has no response in the spec.
    """
    groups = response_groups(data, spec)
    return Prepared(runs=tuple(prepare_run(run, spec, groups, grouped=grouped, method=method) for run in data.runs))
