r"""Many runs in one GP likelihood: stacked by shape, evaluated with ``jax.vmap``, sharded over JAX devices.

Runs are independent given the parameters, so ``log p(Y) = sum_r log p(Y_r)``. The likelihood
(:mod:`msrm.gp.likelihood`) evaluates a run from a static shape signature (:class:`~msrm.gp.likelihood.Signature`)
and per-run arrays (:class:`~msrm.gp.likelihood.RunArrays`). A per-run :class:`~msrm.gp.prepare.Prepared` bakes
each run's arrays into the trace, so ``n`` runs compile ``n`` copies of the run's graph. This module builds the
stacked form (:class:`~msrm.gp.likelihood.MultiRunPrepared`): runs with one signature are stacked along a
leading run axis, their arrays become traced leaves, and the likelihood evaluates the stack with one ``jax.vmap``
of :func:`~msrm.gp.likelihood.run_loglik_arrays` (one trace for the whole stack); runs
with different structure (other streams, groups or window widths) form separate stacks whose values are summed.

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
can deadlock (both device threads waiting inside the callback while their arguments are being
transferred), so ``method="auto"`` resolves to ``"native"`` there and ``method="callback"`` with several devices
is refused. ``shard_map`` runs with ``check_vma=False`` (values coming out of custom-derivative rules carry no
per-device type annotation).

**XLA:CPU.** The batched CPU LAPACK kernels of jaxlib split their batch over XLA's intra-op thread pool from
inside a pool thread and wait for the pieces. Two host devices (``XLA_FLAGS=--xla_force_host_platform_device_
count=2``, how the tests get two devices on a CPU) on two cores can each enter such a kernel and wait forever. So
on the CPU platform no batched LAPACK call is made: the per-node factors use
:func:`msrm.gp.linalg.small_cholesky` and the stacked runs go through :func:`msrm.gp.linalg.per_item_on_cpu`
(``lax.map``, one run at a time). Accelerators keep the vmapped batch.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np

from .kernels import grid_distances
from .likelihood import (AXIS, Bucket, GroupArrays, GroupShape, MultiRunPrepared, RunArrays,
                         Signature, StreamArrays, StreamShape, node_information_arrays, response_matrix_arrays,
                         run_arrays, run_loglik_arrays, signature)
from .prepare import Prepared, RunPrepared

__all__ = [
    "AXIS",
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
    "node_information_arrays",
    "response_matrix_arrays",
    "run_loglik_arrays",
]

# The stack form and its evaluation live in msrm.gp.likelihood; the names above are re-exported from there.


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



# ------------------------------------------------------------------------------------------ stacks


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
        sig = dataclasses.replace(signature([runs[i].layout for i in members]), method=method)
        per_run = [run_arrays(runs[i], sig) for i in members]
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
