r"""Many runs in one GP likelihood: stacked by shape, evaluated with ``jax.vmap``, sharded over JAX devices.

Runs are independent given the parameters, so ``log p(Y) = sum_r log p(Y_r)``. The per-run loop of
:mod:`msrm.gp.likelihood` bakes each run's static layout into the trace, so ``n`` runs compile ``n`` copies of
the run's graph. Here one run is split in two parts:

* a static **shape signature** (:class:`Signature`): factor count, kernel, factorization method, grid length
  ``J``, node count ``N``, per response group its node range and window width, per stream its feature count,
  sample count, missing-value flag and low-count-row count, and whether any node needs a Cholesky factor;
* traced **per-run arrays** (:class:`RunArrays`): window offsets ``delta``, window starts, sample-to-node maps,
  per-node sample counts, the rows/features that fill low-count factors, the Cholesky-node mask, the data
  (``Y0``, mask, ``S1``, ``S2``, ``n_f``) and ``n_obs``.

Runs with one signature are stacked along a leading run axis and evaluated by ``jax.vmap`` of
:func:`run_loglik_arrays` (one trace for the whole stack, :data:`RUN_TRACE_COUNT`); runs with different
structure (other streams, groups or window widths) form separate stacks whose values are summed.

**Padding to a common shape (exact).** Runs cut from one recording at natural boundaries rarely have exactly
equal sizes (a node more here, a sample less there). Runs of one structure whose padded node count and grid
length stay within ``1 + pad_tolerance`` of the smallest run in the stack share one padded signature:

* dummy nodes at the end of each group get zero response rows (``A_u = 0``, so ``C_k`` has zero rows and
  columns there), no observations (``eta_u = 0``, ``Lambda_u = 0``) and ``R_u = 0``, so their block of
  ``M = I + R C R^T`` is the identity and they add exactly 0 to ``v^T M^{-1} v`` and to ``log|M|``;
* extra grid points beyond a run's end are reached by no response window (zero columns of ``A``), so
  ``C_k = A K_k A^T`` is unchanged: integrating out latent values nobody observes changes nothing;
* dummy samples point at node ``N`` (outside the table; ``segment_sum`` drops them) and have zero values and
  mask; dummy low-count rows point past the factor's last row (``mode="drop"``).

So padded and unpadded runs give the same value and gradient up to rounding (tested to 1e-12 against the loop).
``pad_tolerance=0`` stacks only runs of identical size.

**Devices.** With several devices the stacks' run axes are sharded over a one-axis ``Mesh(devices, ("runs",))``
(``NamedSharding(mesh, P("runs"))``) and evaluated inside ``jax.shard_map``: each device evaluates its own runs
(vmapped; one after another on XLA:CPU, see below) and the per-run values are summed across devices by XLA. A
stack whose run count is not a multiple of the device count is padded with copies of its last run that are
evaluated and then dropped (they never enter the sum or the gradient); a single run is therefore computed on every
device (replication): more runs than devices is where sharding pays. On a mesh the factorization is always the
native JAX one: with two host devices the LAPACK ``pure_callback`` of :func:`msrm.gp.linalg.quad_logdet`
deadlocked in testing (both device threads waiting inside the callback while their arguments were being
transferred), so ``method="auto"`` resolves to ``"native"`` there and ``method="callback"`` with several devices
is refused. ``shard_map`` runs with ``check_vma=False`` (values coming out of custom-derivative rules carry no
per-device type annotation).

**XLA:CPU.** jaxlib 0.10's batched CPU LAPACK kernels split their batch over XLA's intra-op thread pool from
inside a pool thread and wait for the pieces. Two host devices (``XLA_FLAGS=--xla_force_host_platform_device_
count=2``, how the tests get two devices on a CPU) on two cores each entered such a kernel and waited forever. So
on the CPU platform no batched LAPACK call is made: the per-node factors use
:func:`msrm.gp.linalg.small_cholesky` and the stacked runs go through :func:`msrm.gp.linalg.per_item_on_cpu`
(``lax.map``, one run at a time). Accelerators keep the vmapped batch.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..operators import WindowLayout, jax_window_weights
from ..responses import Response
from . import banded, linalg
from .kernels import grid_distances, kernel_matrices
from .likelihood import (StreamArrays, accumulate_node_statistics, covariance_from_response, group_theta,
                         woodbury_loglik)
from .prepare import Prepared, RunPrepared

__all__ = [
    "AXIS",
    "RUN_TRACE_COUNT",
    "GroupShape",
    "StreamShape",
    "Signature",
    "GroupArrays",
    "StreamArrays",
    "RunArrays",
    "Bucket",
    "MultiRunPrepared",
    "resolve_devices",
    "bucket_runs",
    "padded_node_counts",
    "stack_runs",
    "mesh_method",
    "prepare_multirun",
    "node_information_arrays",
    "response_matrix_arrays",
    "run_loglik_arrays",
    "run_logliks",
    "loglik",
]

AXIS = "runs"
# Incremented each time the per-run function is traced: once per stack, however many runs it holds.
RUN_TRACE_COUNT = [0]


class GroupShape(NamedTuple):
    """Static shape of one response group in a stack: nodes ``node_start .. node_start + n_nodes - 1``."""

    key: str
    response: Response
    param_key: str | None
    node_start: int
    n_nodes: int
    width: int
    chunks: Any = None  # msrm.gp.banded.ChunkShape for the chunked covariance products, or None


class StreamShape(NamedTuple):
    """Static shape of one stream in a stack (sample and low-row counts padded to the stack's largest)."""

    key: str
    n_features: int
    n_samples: int
    has_missing: bool
    n_low: int


@dataclass(frozen=True)
class Signature:
    """Everything static about the runs of one stack (hashable; equal signatures share one compiled graph).

    Fields:
        n_factors: K. kernel: Matérn name. method: quad_logdet method. grouped: node grouping or dense table.
        n_grid: J (padded). n_nodes: N (padded). grid_step: Delta. has_chol: some node needs ``chol(Lambda_u)``.
        groups: tuple of :class:`GroupShape`. streams: tuple of :class:`StreamShape` (sorted by key).
    """

    n_factors: int
    kernel: str
    method: str
    grouped: bool
    n_grid: int
    n_nodes: int
    grid_step: float
    has_chol: bool
    groups: tuple
    streams: tuple


class GroupArrays(NamedTuple):
    """Per-run window arrays of one group (leading run axis when stacked).

    Fields: start (n_g,) first grid index of each node's window; delta (n_g, w) ``t_u - tau``; valid (n_g, w);
    real (n_g,) 1.0 for a node of the run, 0.0 for padding.
    """

    start: Any
    delta: Any
    valid: Any
    real: Any


# StreamArrays (per-run arrays of one stream) is shared with the per-run likelihood: msrm.gp.likelihood


class RunArrays(NamedTuple):
    """The traced arrays of one run: n_obs (); chol_mask (N,); groups, streams (tuples in signature order)."""

    n_obs: Any
    chol_mask: Any
    groups: tuple
    streams: tuple


@dataclass(frozen=True, eq=False)
class Bucket:
    """One stack: a signature, the original indices of its runs, grid distances (J, J) and the stacked arrays
    (leading axis: the runs, then any dummy copies that pad the axis to a multiple of the device count)."""

    signature: Signature
    run_index: tuple
    dist: Any
    arrays: RunArrays

    @property
    def n_stacked(self) -> int:
        return int(np.shape(self.arrays.n_obs)[0])


jax.tree_util.register_pytree_node(
    Bucket,
    lambda b: ((b.dist, b.arrays), (b.signature, b.run_index)),
    lambda aux, ch: Bucket(aux[0], aux[1], ch[0], ch[1]),
)


@dataclass(frozen=True, eq=False)
class MultiRunPrepared:
    """A dataset prepared for the batched likelihood.

    Fields:
        buckets: tuple of :class:`Bucket`.
        n_runs: runs in the dataset (results come back in this order).
        mesh: the ``Mesh`` the run axes are sharded over, or None (one device).
        node_counts: nodes per run before padding.
    """

    buckets: tuple
    n_runs: int
    mesh: Any
    node_counts: tuple

    @property
    def padded_node_counts(self) -> list[int]:
        """Nodes per run after padding (the size each run's factorization actually has), in run order."""
        out = [0] * self.n_runs
        for b in self.buckets:
            for r in b.run_index:
                out[r] = b.signature.n_nodes
        return out


jax.tree_util.register_pytree_node(
    MultiRunPrepared,
    lambda p: ((p.buckets,), (p.n_runs, p.mesh, p.node_counts)),
    lambda aux, ch: MultiRunPrepared(ch[0], *aux),
)


# ------------------------------------------------------------------------------------------ devices


def resolve_devices(devices=None) -> list:
    """The devices to evaluate runs on.

    Args:
        devices: ``None`` or ``"all"`` (every local device), a ``jax.Device``, or a list of devices or of
            indices into ``jax.devices()``.
    Raises:
        ValueError: an empty list, an unknown name or index, or a device listed twice.
    """
    if devices is None or (isinstance(devices, str) and devices == "all"):
        return list(jax.local_devices())
    if isinstance(devices, str):
        raise ValueError(f"devices must be None, 'all', a jax.Device or a list of devices, got {devices!r}")
    if isinstance(devices, jax.Device):
        devices = [devices]
    try:
        items = list(devices)
    except TypeError:
        raise ValueError(f"devices must be None, 'all', a jax.Device or a list, got {type(devices).__name__}") from None
    if not items:
        raise ValueError("devices: the list is empty")
    known = jax.devices()
    out = []
    for d in items:
        if isinstance(d, (int, np.integer)) and not isinstance(d, bool):
            if not 0 <= int(d) < len(known):
                raise ValueError(f"devices: index {d} is out of range (this process has {len(known)} devices)")
            d = known[int(d)]
        if not isinstance(d, jax.Device):
            raise ValueError(f"devices: {d!r} is neither a jax.Device nor an index into jax.devices()")
        if d in out:
            raise ValueError(f"devices: {d} is listed twice")
        out.append(d)
    return out


# ------------------------------------------------------------------------------------------ signatures


def _structure(run: RunPrepared) -> tuple:
    """What must be equal for two runs to share a stack (sizes may differ and are padded)."""
    lay = run.layout
    groups = tuple((g.key, g.response, g.param_key, g.window.width) for g in lay.groups)
    streams = tuple(sorted((sl.key, sl.n_features) for sl in lay.streams))
    step = lay.groups[0].window.grid_step if lay.groups else 0.0
    return (lay.n_factors, lay.kernel, lay.method, lay.grouped, step, groups, streams)


def _group_sizes(run: RunPrepared) -> list[int]:
    return [g.node_stop - g.node_start for g in run.layout.groups]


def bucket_runs(runs: Sequence[RunPrepared], pad_tolerance: float = 0.1) -> list[list[int]]:
    """Partition runs into stacks: same structure, and padded node count and grid length at most
    ``(1 + pad_tolerance)`` times the smallest run's in the stack. Returns lists of run indices (ascending)."""
    if not (isinstance(pad_tolerance, (int, float)) and not isinstance(pad_tolerance, bool)
            and np.isfinite(pad_tolerance) and pad_tolerance >= 0):
        raise ValueError(f"pad_tolerance must be a finite number >= 0, got {pad_tolerance!r}")
    classes: dict[tuple, list[int]] = {}
    for i, r in enumerate(runs):
        classes.setdefault(_structure(r), []).append(i)
    out: list[list[int]] = []
    for members in classes.values():
        members = sorted(members, key=lambda i: (runs[i].layout.n_nodes, runs[i].layout.n_grid, i))
        current: list[int] = []
        for i in members:
            if current:
                cand = current + [i]
                n_pad = sum(max(s) for s in zip(*(_group_sizes(runs[j]) for j in cand)))
                j_pad = max(runs[j].layout.n_grid for j in cand)
                small = runs[current[0]].layout
                if n_pad <= (1 + pad_tolerance) * small.n_nodes and j_pad <= (1 + pad_tolerance) * small.n_grid:
                    current.append(i)
                    continue
                out.append(sorted(current))
            current = [i]
        out.append(sorted(current))
    return sorted(out, key=lambda b: b[0])


def padded_node_counts(runs: Sequence[RunPrepared], pad_tolerance: float = 0.1) -> list[int]:
    """Node count of each run after padding to its stack (:func:`bucket_runs`), in run order."""
    out = [0] * len(runs)
    for members in bucket_runs(runs, pad_tolerance):
        n_pad = sum(max(s) for s in zip(*(_group_sizes(runs[i]) for i in members)))
        for i in members:
            out[i] = int(n_pad)
    return out


def _signature(runs: Sequence[RunPrepared]) -> Signature:
    first = runs[0].layout
    n_g = [max(s) for s in zip(*(_group_sizes(r) for r in runs))]
    starts = np.concatenate([[0], np.cumsum(n_g)[:-1]]).astype(int)
    n_grid = max(r.layout.n_grid for r in runs)
    chunks = [banded.chunk_shape([r.layout.groups[i].window.start for r in runs], g.window.width, n_grid, int(n))
              for i, (g, n) in enumerate(zip(first.groups, n_g))]
    if not banded.worthwhile(chunks, n_grid):
        chunks = [None] * len(chunks)
    groups = tuple(GroupShape(g.key, g.response, g.param_key, int(s), int(n), g.window.width, c)
                   for g, s, n, c in zip(first.groups, starts, n_g, chunks))
    streams = []
    for key, F in sorted((sl.key, sl.n_features) for sl in first.streams):
        per = [next(sl for sl in r.layout.streams if sl.key == key) for r in runs]
        streams.append(StreamShape(key, F, max(sl.sample_nodes.size for sl in per),
                                   any(sl.has_missing for sl in per), max(sl.low_rows.size for sl in per)))
    return Signature(
        n_factors=first.n_factors, kernel=first.kernel, method=first.method, grouped=first.grouped,
        n_grid=n_grid, n_nodes=int(sum(n_g)),
        grid_step=float(first.groups[0].window.grid_step) if first.groups else 0.0,
        has_chol=any(r.layout.chol_nodes.size for r in runs), groups=groups, streams=tuple(streams),
    )


def _pad_rows(x: np.ndarray, n: int, fill) -> np.ndarray:
    """``x`` with rows appended up to ``n`` rows: copies of row 0 (``fill="first"``) or the value ``fill``."""
    pad = n - x.shape[0]
    if pad == 0:
        return np.ascontiguousarray(x)
    extra = np.repeat(x[:1], pad, axis=0) if isinstance(fill, str) else np.full((pad,) + x.shape[1:], fill, x.dtype)
    return np.concatenate([x, extra], axis=0)


def _run_arrays(run: RunPrepared, sig: Signature) -> RunArrays:
    """One run's arrays padded to ``sig`` (NumPy)."""
    lay = run.layout
    K, N = sig.n_factors, sig.n_nodes
    new_node = np.empty(lay.n_nodes, dtype=np.int64)  # node of the run -> node of the padded table
    groups = []
    for gs, gl in zip(sig.groups, lay.groups):
        n_g = gl.node_stop - gl.node_start
        new_node[gl.node_start:gl.node_stop] = gs.node_start + np.arange(n_g)
        w = gl.window
        groups.append(GroupArrays(
            start=_pad_rows(w.start.astype(np.int64), gs.n_nodes, "first"),
            delta=_pad_rows(w.delta, gs.n_nodes, "first"),
            valid=_pad_rows(w.valid, gs.n_nodes, "first"),
            real=_pad_rows(np.ones(n_g), gs.n_nodes, 0.0),
        ))
    chol_mask = np.zeros(N)
    chol_mask[new_node[lay.chol_nodes]] = 1.0
    by_key = {sl.key: (sl, st) for sl, st in zip(lay.streams, run.streams)}
    streams = []
    for ss in sig.streams:
        sl, st = by_key[ss.key]
        counts = np.zeros(N)
        counts[new_node] = sl.node_counts
        mask = None
        if ss.has_missing:
            mask = _pad_rows(st.mask if st.mask is not None else np.ones_like(st.Y0), ss.n_samples, 0.0)
        e = sl.low_rows.size
        low_rows = np.concatenate([new_node[sl.low_rows // K] * K + sl.low_rows % K,
                                   N * K + np.arange(ss.n_low - e)]).astype(np.int64)
        streams.append(StreamArrays(
            Y0=_pad_rows(st.Y0, ss.n_samples, 0.0), mask=mask, S1=st.S1, S2=st.S2, n_f=st.n_f,
            sample_nodes=_pad_rows(new_node[sl.sample_nodes], ss.n_samples, N),
            node_counts=counts, low_rows=low_rows,
            low_feats=_pad_rows(sl.low_feats.astype(np.int64), ss.n_low, 0),
        ))
    return RunArrays(n_obs=np.float64(lay.n_obs), chol_mask=chol_mask, groups=tuple(groups), streams=tuple(streams))


def stack_runs(prepared: Prepared, *, devices=None, pad_tolerance: float = 0.1) -> MultiRunPrepared:
    """Stack the runs of a per-run :class:`~msrm.gp.prepare.Prepared` by signature and place them on devices.

    Args:
        prepared: from :func:`msrm.gp.prepare.prepare`.
        devices: see :func:`resolve_devices`; with more than one device the run axes are sharded over them.
        pad_tolerance: how much larger (relative) a stack's padded node count and grid may be than its smallest
            run's (0: only runs of identical sizes share a stack).
    """
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    devs = resolve_devices(devices)
    mesh = Mesh(np.array(devs), (AXIS,)) if len(devs) > 1 else None
    runs = prepared.runs
    method = mesh_method(runs[0].layout.method if runs else "auto", len(devs))
    buckets = []
    for members in bucket_runs(runs, pad_tolerance):
        sig = dataclasses.replace(_signature([runs[i] for i in members]), method=method)
        per_run = [_run_arrays(runs[i], sig) for i in members]
        if mesh is not None:
            per_run += [per_run[-1]] * (-len(per_run) % len(devs))  # dummy copies, dropped after evaluation
        arrays = jax.tree_util.tree_map(lambda *xs: np.stack(xs), *per_run)
        longest = max(members, key=lambda i: runs[i].layout.n_grid)
        dist = grid_distances(runs[longest].layout.grid)
        if mesh is None:  # one device: committed there when named, else JAX's default placement
            dist, arrays = jax.device_put((dist, arrays), None if devices is None else devs[0])
        else:
            arrays = jax.device_put(arrays, NamedSharding(mesh, P(AXIS)))
            dist = jax.device_put(dist, NamedSharding(mesh, P()))
        buckets.append(Bucket(sig, tuple(members), dist, arrays))
    return MultiRunPrepared(tuple(buckets), len(runs), mesh, tuple(int(r.layout.n_nodes) for r in runs))


def mesh_method(method: str, n_devices: int) -> str:
    """The factorization method runs use on ``n_devices`` devices: ``"auto"`` becomes ``"native"`` on several.

    Raises:
        ValueError: ``method="callback"`` with several devices (see the module docstring).
    """
    if n_devices <= 1:
        return method
    if method == "callback":
        raise ValueError(f"method='callback' cannot run with runs sharded over {n_devices} devices (the LAPACK "
                         f"callback deadlocks across device threads); use method='auto' or 'native', or one device")
    return "native"


def prepare_multirun(data, spec, *, grouped: bool = True, method: str = "auto", devices=None,
                     pad_tolerance: float = 0.1) -> MultiRunPrepared:
    """Prepare a dataset for the batched likelihood: :func:`msrm.gp.prepare.prepare` then :func:`stack_runs`."""
    from .prepare import prepare

    return stack_runs(prepare(data, spec, grouped=grouped, method=method), devices=devices,
                      pad_tolerance=pad_tolerance)


# ------------------------------------------------------------------------------------------ likelihood


def node_information_arrays(theta, sig: Signature, arrays: RunArrays):
    """:func:`msrm.gp.likelihood.node_information` on traced per-run arrays (one run, padded to ``sig``).

    Returns:
        Lambda (N, K, K), eta (N, K), R (N, K, K), const (): as in the per-run function; dummy nodes have
        ``Lambda = 0``, ``eta = 0``, ``R = 0``.
    """
    N, K = sig.n_nodes, sig.n_factors
    terms = zip(sig.streams, arrays.streams)
    Lam, eta, R_rows, const = accumulate_node_statistics(theta, terms, N, K, arrays.n_obs)
    R = R_rows.reshape(N, K, K)
    if sig.has_chol:
        m = arrays.chol_mask[:, None, None]
        # identity where no Cholesky factor is wanted, so every factorization is finite (and its branch unused)
        L = linalg.small_cholesky(Lam + (1.0 - m) * jnp.eye(K))
        R = jnp.where(m > 0, jnp.swapaxes(L, -1, -2), R)
    return Lam, eta, R, const


def _group_weights(theta, sig: Signature, gs: GroupShape, ga: GroupArrays):
    """Window weights (n_g, w) of one group of a padded run; zero rows for dummy nodes."""
    layout = WindowLayout(start=ga.start, width=gs.width, delta=ga.delta, valid=ga.valid,
                          grid_step=sig.grid_step, n_grid=sig.n_grid)
    return jax_window_weights(group_theta(theta, gs), gs.response, layout) * ga.real[:, None]


def response_matrix_arrays(theta, sig: Signature, arrays: RunArrays):
    """Response rows ``A`` (N, J) of one padded run; rows of dummy nodes are zero."""
    A = jnp.zeros((sig.n_nodes, sig.n_grid))
    for gs, ga in zip(sig.groups, arrays.groups):
        a = _group_weights(theta, sig, gs, ga)
        rows = np.repeat(np.arange(gs.node_start, gs.node_start + gs.n_nodes), gs.width)
        cols = (ga.start[:, None] + jnp.arange(gs.width)[None, :]).reshape(-1)
        A = A.at[rows, cols].set(a.reshape(-1), unique_indices=True)
    return A


def run_loglik_arrays(theta, sig: Signature, dist, arrays: RunArrays):
    """Log likelihood and guard event of one run given its static signature and traced arrays.

    Args:
        theta: constrained parameter pytree. sig: the stack's signature. dist: (J, J) grid distances.
        arrays: one run's :class:`RunArrays` (no run axis).
    Returns:
        (value, event): float64 scalar, int32 scalar.
    """
    RUN_TRACE_COUNT[0] += 1
    _, eta, R, const = node_information_arrays(theta, sig, arrays)
    Kk = kernel_matrices(dist, theta["lengthscales"], sig.kernel)
    if sig.groups and all(gs.chunks is not None for gs in sig.groups):
        shapes = tuple(gs.chunks for gs in sig.groups)
        windows = tuple(banded.chunk_windows(_group_weights(theta, sig, gs, ga), ga.start, gs.chunks, sig.n_grid)
                        for gs, ga in zip(sig.groups, arrays.groups))
        C = banded.chunked_covariance(shapes, windows, Kk)
    else:
        C = covariance_from_response(response_matrix_arrays(theta, sig, arrays), Kk)
    return woodbury_loglik(eta, R, C, const, sig.method)


def _bucket_logliks(theta, bucket: Bucket, mesh):
    """(values, events) of every stacked run of one bucket, (n_stacked,) each."""
    sig = bucket.signature

    def stack(theta, dist, arrays):
        # vmapped over the stacked runs; on XLA:CPU one run after another (linalg.per_item_on_cpu), which keeps
        # every LAPACK call unbatched
        return linalg.per_item_on_cpu(lambda a: run_loglik_arrays(theta, sig, dist, a), arrays, batched=False)

    if mesh is None:
        if bucket.n_stacked == 1:  # no vmap: the callback hands its factor back without a batch copy
            value, event = run_loglik_arrays(theta, sig, bucket.dist,
                                             jax.tree_util.tree_map(lambda x: x[0], bucket.arrays))
            return value[None], event[None]
        return stack(theta, bucket.dist, bucket.arrays)
    from jax.sharding import PartitionSpec as P

    sharded = jax.shard_map(stack, mesh=mesh, in_specs=(P(), P(), P(AXIS)), out_specs=(P(AXIS), P(AXIS)),
                            check_vma=False)
    return sharded(theta, bucket.dist, bucket.arrays)


def run_logliks(theta, prepared: MultiRunPrepared):
    """Per-run log likelihoods (n_runs,) and int32 guard events (n_runs,), in the dataset's run order."""
    values, events, order = [], [], []
    for b in prepared.buckets:
        v, e = _bucket_logliks(theta, b, prepared.mesh)
        n = len(b.run_index)
        values.append(v[:n])  # dummy copies that padded the run axis are dropped here
        events.append(e[:n])
        order.extend(b.run_index)
    values = jnp.concatenate(values) if len(values) > 1 else values[0]
    events = jnp.concatenate(events) if len(events) > 1 else events[0]
    if order != sorted(order):
        inverse = np.argsort(np.asarray(order))
        values, events = values[inverse], events[inverse]
    return values, events.astype(jnp.int32)


def loglik(theta, prepared: MultiRunPrepared):
    """Sum over runs and per-run events (the backend interface ``loglik(theta, prepared)``)."""
    values, events = run_logliks(theta, prepared)
    return jnp.sum(values), events
