r"""NumPy preparation of the state-space backend: step tables, state layout and banks, once per model.

Everything data-dependent that the likelihood needs is reused from :func:`msrm.gp.prepare.prepare_run` (node
table, response windows, per-stream data arrays and constant terms), so the sufficient statistics have one
implementation (:func:`msrm.gp.likelihood.node_information`). This module adds, per run:

* the step at which each node is absorbed (the end of its response window) and, per response group, a
  ``(steps, M_g)`` slot table of the nodes absorbed at each step (padding points at an all-zero node);
* the state layout: ``[SDE states (K d) | ring buffer (K L) | bank (K n)]``, factor-major inside each block;
* the chunking of the scan (``checkpoint_every`` steps per checkpointed chunk).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import jax
import numpy as np

from ...data import Dataset
from ...nodes import response_groups
from ...operators import WindowLayout
from ...responses import Identity, Response
from ...spec import ModelSpec
from ..prepare import RunPrepared, prepare_run
from .embedding import EMBEDDINGS, design_bank, projection
from .sde import n_states as sde_states

# Buffer slots beyond the delay line in the sequential scan: the buffer is rebased (one O(S^2) copy) every
# REBASE grid steps, so window reads are contiguous slices without a per-step shift.
REBASE = 4

__all__ = ["REBASE", "GroupTable", "RunTables", "SSRun", "StateSpacePrepared", "prepare"]


@dataclass(frozen=True, eq=False)
class GroupTable:
    """One response group's part of a run's step tables.

    Fields:
        key, response, param_key: as :class:`msrm.nodes.ResponseGroup`.
        mode: ``"ring"`` (exact delay line) or ``"bank"`` (filter-bank readout).
        window: WindowLayout of the group's nodes (static widths).
        node_start: first node index of the group in the run's node table; n_g: its node count.
        slot_local: (steps_padded, M_g) group-local node absorbed in each slot (``n_g`` = empty).
        slot_global: (steps_padded, M_g) the same as run-wide node index (``N`` = empty).
        proj: (n, w) least-squares readout for bank mode, else None.
    """

    key: str
    response: Response
    param_key: str | None
    mode: str
    window: WindowLayout
    node_start: int
    n_g: int
    slot_local: np.ndarray
    slot_global: np.ndarray
    proj: np.ndarray | None

    @property
    def width(self) -> int:
        return int(self.window.width)

    @property
    def n_slots(self) -> int:
        return int(self.slot_local.shape[1])


@dataclass(frozen=True, eq=False)
class RunTables:
    """Static description of one run's scan (a leafless pytree node).

    Fields:
        K, kernel, step: factors, Matérn name, grid step Δ.
        d: SDE states per factor; L: delay slots per factor (the widest ring-mode window minus one);
        rebase: C, extra buffer slots of the sequential scan (the buffer is rebased every C grid steps; 0 in
        the parallel layout, a plain shift register); n_bank: bank states per factor.
        grid_index: (T,) grid step of each sub-step (a step whose nodes exceed the slots is split into
            several sub-steps); predict: (T,) True on the last sub-step of each grid step.
        n_steps: grid points J; chunk: sub-steps per checkpointed chunk; n_chunks; checkpoint: bool.
        embedding: ``"exact"``, ``"rational"`` or ``"laguerre"``; parallel: use the associative scan.
        groups: tuple of GroupTable; bank_M (n, n), bank_v (n,) or None.
    """

    grid_index: np.ndarray
    predict: np.ndarray
    K: int
    kernel: str
    step: float
    d: int
    L: int
    rebase: int
    n_bank: int
    n_steps: int
    chunk: int
    n_chunks: int
    checkpoint: bool
    embedding: str
    parallel: bool
    groups: tuple
    bank_M: np.ndarray | None
    bank_v: np.ndarray | None

    @property
    def ring_offset(self) -> int:
        return self.K * self.d

    @property
    def bank_offset(self) -> int:
        return self.K * (self.d + self.L + self.rebase)

    @property
    def n_states(self) -> int:
        """S, the state dimension."""
        return self.K * (self.d + self.L + self.rebase + self.n_bank)

    @property
    def n_slots(self) -> int:
        return sum(g.n_slots for g in self.groups)


jax.tree_util.register_pytree_node(RunTables, lambda t: ((), t), lambda t, _: t)


class SSRun(NamedTuple):
    """One prepared run: the shared grouped preparation (data arrays traced) and the static step tables."""

    gp: RunPrepared
    tables: RunTables


class StateSpacePrepared(NamedTuple):
    """The state-space backend's prepared dataset (a pytree: pass it to ``jax.jit`` as an argument or close over it)."""

    runs: tuple


def _check_options(response_embedding, n_states, parallel, checkpoint_every) -> None:
    if response_embedding not in EMBEDDINGS:
        raise ValueError(f"response_embedding must be one of {EMBEDDINGS}, got {response_embedding!r}")
    if response_embedding != "exact":
        if isinstance(n_states, bool) or not isinstance(n_states, (int, np.integer)) or n_states < 1:
            raise ValueError(
                f"n_states must be a positive integer for response_embedding={response_embedding!r}, got {n_states!r}"
            )
    elif n_states is not None:
        raise ValueError("n_states applies to the 'rational' and 'laguerre' embeddings only; leave it None for 'exact'")
    if not isinstance(parallel, (bool, np.bool_)):
        raise ValueError(f"parallel must be True or False, got {parallel!r}")
    if checkpoint_every is not None and (
        isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, (int, np.integer)) or checkpoint_every < 0
    ):
        raise ValueError(f"checkpoint_every must be None (about sqrt(steps)), 0 (off) or a positive integer, got {checkpoint_every!r}")


def _group_counts(ends: np.ndarray, n_steps: int, width: int) -> tuple[np.ndarray, int]:
    """Nodes absorbed per step and the slots per sub-step: the largest count away from the two steps where
    windows clipped at the run's ends pile up (``width - 1`` and ``J - 1``); a pile-up is spread over extra
    sub-steps instead of widening every step."""
    counts = np.bincount(ends, minlength=n_steps)
    inner = counts.copy()
    inner[[min(width - 1, n_steps - 1), n_steps - 1]] = 0
    M = int(inner.max()) if inner.max() > 0 else int(counts.max())
    return counts, max(M, 1)


def _sub_steps(all_ends: list[np.ndarray], widths: list[int], n_steps: int, chunk: int | None):
    """Sub-step schedule: grid index, whether to predict after it, and each group's slot table.

    Step j gets ``max_g ceil(count_gj / M_g)`` sub-steps (at least one); only the last one predicts.
    Returns (grid_index (T,), predict (T,) bool, [(T, M_g) local slot tables], chunk, n_chunks).
    """
    counts, Ms = zip(*[_group_counts(e, n_steps, w) for e, w in zip(all_ends, widths)]) if all_ends else ((), ())
    reps = np.ones(n_steps, dtype=np.int64)
    for c, M in zip(counts, Ms):
        reps = np.maximum(reps, -(-c // M))
    T = int(reps.sum())
    if chunk is None:
        chunk, n_chunks = T, 1
    else:
        chunk = min(chunk, T)
        n_chunks = -(-T // chunk)
    T_pad = chunk * n_chunks
    grid_index = np.full(T_pad, n_steps - 1, dtype=np.int32)
    grid_index[:T] = np.repeat(np.arange(n_steps), reps)
    first_sub = np.concatenate([[0], np.cumsum(reps)[:-1]])
    predict = np.zeros(T_pad, dtype=bool)
    predict[np.cumsum(reps) - 1] = True
    tables = []
    for ends, M in zip(all_ends, Ms):
        n_g = ends.size
        local = np.full((T_pad, M), n_g, dtype=np.int32)
        fill = np.zeros(n_steps, dtype=np.int64)
        for u in np.argsort(ends, kind="stable"):
            e = ends[u]
            local[first_sub[e] + fill[e] // M, fill[e] % M] = u
            fill[e] += 1
        tables.append(local)
    return grid_index, predict, tables, chunk, n_chunks


def prepare(
    data: Dataset,
    spec: ModelSpec,
    *,
    response_embedding: str = "exact",
    n_states: int | None = None,
    parallel: bool = False,
    checkpoint_every: int | None = None,
) -> StateSpacePrepared:
    """Prepare a dataset for :func:`msrm.gp.state_space.loglik` (NumPy, once).

    Args:
        data: the dataset.
        spec: the model spec.
        response_embedding: ``"exact"`` (delay line), ``"rational"`` or ``"laguerre"`` (approximate banks).
        n_states: bank states per factor (banks only).
        parallel: True for the associative (log-depth) scan.
        checkpoint_every: steps per checkpointed chunk of the sequential scan; None = ceil(sqrt(steps)),
            0 = no checkpointing.
    Raises:
        ValueError: a bad option (named); KeyError: a modality without a response.
    """
    _check_options(response_embedding, n_states, parallel, checkpoint_every)
    groups = response_groups(data, spec)
    K, d = spec.n_factors, sde_states(spec.kernel)
    runs = []
    for run in data.runs:
        gp = prepare_run(run, spec, groups, grouped=True)
        lay = gp.layout
        J = lay.n_grid
        bank_mode = response_embedding != "exact"
        modes = ["bank" if bank_mode and not isinstance(g.response, Identity) else "ring" for g in lay.groups]
        ring_w = [g.window.width for g, m in zip(lay.groups, modes) if m == "ring"]
        L = max(1, max(ring_w, default=2) - 1)
        bank = None
        if bank_mode and "bank" in modes:
            bank_groups = [g for g, m in zip(lay.groups, modes) if m == "bank"]
            bank = design_bank(response_embedding, int(n_states), [g.response for g in bank_groups],
                               [g.window.width for g in bank_groups], float(lay.grid[1] - lay.grid[0]))
        widths = [g.window.width for g in lay.groups]
        ends = [(g.window.start + g.window.width - 1).astype(np.int64) for g in lay.groups]
        checkpoint = not parallel and checkpoint_every != 0
        grid_index, predict, locals_, chunk, n_chunks = _sub_steps(ends, widths, J, None)
        if checkpoint:
            every = int(checkpoint_every) if checkpoint_every else max(1, math.ceil(math.sqrt(grid_index.size)))
            grid_index, predict, locals_, chunk, n_chunks = _sub_steps(ends, widths, J, every)
        tables = []
        for g, mode, local in zip(lay.groups, modes, locals_):
            n_g = g.node_stop - g.node_start
            glob = np.where(local == n_g, lay.n_nodes, local + g.node_start).astype(np.int32)
            proj = projection(bank["G"], g.window.width) if mode == "bank" else None
            tables.append(GroupTable(g.key, g.response, g.param_key, mode, g.window, g.node_start, n_g,
                                     local, glob, proj))
        runs.append(SSRun(gp, RunTables(
            grid_index=grid_index, predict=predict, K=K, kernel=spec.kernel, step=float(lay.grid[1] - lay.grid[0]), d=d, L=L,
            rebase=0 if parallel else REBASE,
            n_bank=int(n_states) if bank is not None else 0, n_steps=J, chunk=chunk, n_chunks=n_chunks,
            checkpoint=checkpoint, embedding=response_embedding, parallel=bool(parallel), groups=tuple(tables),
            bank_M=None if bank is None else bank["M"], bank_v=None if bank is None else bank["v"],
        )))
    return StateSpacePrepared(runs=tuple(runs))
