r"""NumPy preparation of the state-space backend: step tables, state layout and banks, once per model.

Everything data-dependent that the likelihood needs is reused from :func:`msrm.gp.prepare.prepare_run` (node
table, response windows, per-stream data arrays and constant terms), so the sufficient statistics have one
implementation (:func:`msrm.gp.likelihood.node_information`). This module adds, per run:

* the unit of the scan: blocks of ``C`` grid steps in the sequential scan (every node whose window ends inside
  a block is absorbed in one update), single grid steps in the associative scan;
* per response group, a ``(sub-steps, M_g)`` slot table of the nodes absorbed at each sub-step (padding points
  at an all-zero node), and where each node reads the state (ring positions of its window, or its step inside
  the block for a bank readout);
* the state layout: ``[ring (N K) | bank (n K) | SDE (d K)]`` in the sequential scan (ring slot ``s`` holds
  ``z`` at grid step ``s mod N``), ``[SDE | delay line (L K) | bank]`` (a shift register) in the associative
  scan; state-major inside each block (index ``i K + k`` for component i of factor k);
* the chunking of the scan (``checkpoint_every`` sub-steps per checkpointed chunk).
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
from ...responses import Response
from ...spec import ModelSpec
from .. import linalg
from ..prepare import RunPrepared, prepare_run
from .embedding import EMBEDDINGS, design_bank, projection
from .sde import n_states as sde_states

# The sequential scan absorbs together every node whose window ends inside a block of C grid steps: one
# covariance update of rank (their count x K) per block. A sub-step has a fixed cost (tens of small operations,
# one small LU, the prediction's row and column writes) beside its S^2 x rank products, and a longer block also
# lengthens the ring (S grows by K per extra step). By default C is chosen per run by a deterministic rule of the
# run's sizes and the machine's core count (:mod:`.tuning`: the C a fixed-coefficient cost model predicts
# fastest); ``msrm_lab.bench.state_space.block_rows`` measures value+gradient against C (the state-space chapter's
# block table).

# The reverse pass reads each sub-step's state. By default (``checkpoint_every=None``) every state is kept, and
# nothing recomputed, when all the covariances fit in KEEP_BYTES; otherwise the scan is cut into about
# sqrt(sub-steps) checkpointed chunks, so memory grows with the square root of the length. Longer chunks are not
# used even where memory would allow them: a long chunk's kept states no longer stay in the cache while the
# reverse pass walks back through them.
KEEP_BYTES = 64 * 2**20

__all__ = ["KEEP_BYTES", "StateSpaceOptions", "auto_block", "schedule_shape", "auto_chunk", "RunTables", "SSRun",
           "StateSpacePrepared", "prepare_run_tables", "prepare_options", "prepare"]


@dataclass(frozen=True, eq=False)
class GroupTable:
    """One response group's part of a run's step tables (T sub-steps, N nodes in the run, ``n`` bank states per
    factor, window width ``w``).

    Fields:
        key, response, param_key: as :class:`msrm.nodes.ResponseGroup`.
        mode: ``"ring"`` (exact delay line) or ``"bank"`` (filter-bank readout).
        window: :class:`msrm.operators.WindowLayout` of the group's nodes (static width ``w``).
        node_start: first node index of the group in the run's node table; n_g: its node count.
        slot_local: (T, M_g) int32 group-local node absorbed in each slot (``n_g`` = empty).
        slot_global: (T, M_g) int32 the same as run-wide node index (``N`` = empty).
        proj: (n, w) float64 least-squares readout for bank mode, else None.
        ring_pos: (n_g + 1, w) int32 ring slot of each window step (sequential ring mode; padding row 0), else None.
        offset: (n_g + 1,) int32 step of each node's window end inside its block (sequential bank mode), else None.
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
    ring_pos: np.ndarray | None = None
    offset: np.ndarray | None = None

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
        block_index: (T,) int32 the block (sequential scan) or grid step (associative scan) of each sub-step; a
            unit whose nodes exceed the slots is split into several sub-steps. predict: (T,) bool, True on the
            last sub-step of each unit.
        K, kernel, step: factors, Matérn name, grid step Δ.
        d: SDE states per factor; L: the widest ring-mode window minus one; n_bank: bank states per factor.
        block: C, grid steps per block of the sequential scan (0 in the associative scan's shift register).
        n_ring: ring slots per factor, N = C (ceil(L / C) + 1) (sequential), or L delay slots (associative).
        n_steps: grid points J; chunk: sub-steps per checkpointed chunk; n_chunks; checkpoint: bool.
        embedding: ``"exact"``, ``"rational"`` or ``"laguerre"``; parallel: use the associative scan.
        groups: one :class:`GroupTable` per response group of the run; bank_M (n, n), bank_v (n,) float64 of
            the filter bank, or None without one.
        method: ``"callback"`` (the sequential scan on the host, :mod:`.host`) or ``"native"`` (XLA).
        block_source: where C came from: ``"option"`` (``block=``), ``"parallel"`` (the associative scan) or
            ``"default"`` (the rule of :mod:`.tuning`). block_predicted_s: the rule's modelled seconds for one
            value+gradient at C (None unless chosen by the rule).
    """

    block_index: np.ndarray
    predict: np.ndarray
    K: int
    kernel: str
    step: float
    d: int
    L: int
    block: int
    n_ring: int
    n_bank: int
    n_steps: int
    chunk: int
    n_chunks: int
    checkpoint: bool
    embedding: str
    parallel: bool
    groups: tuple[GroupTable, ...]
    bank_M: np.ndarray | None
    bank_v: np.ndarray | None
    method: str = "native"
    block_source: str = "option"
    block_predicted_s: float | None = None

    @property
    def ring_offset(self) -> int:
        return self.K * self.d if self.parallel else 0

    @property
    def bank_offset(self) -> int:
        return self.K * (self.d + self.n_ring) if self.parallel else self.K * self.n_ring

    @property
    def sde_offset(self) -> int:
        return 0 if self.parallel else self.K * (self.n_ring + self.n_bank)

    @property
    def n_states(self) -> int:
        """S, the state dimension."""
        return self.K * (self.d + self.n_ring + self.n_bank)

    @property
    def n_blocks(self) -> int:
        """Blocks of the sequential scan (grid steps in the associative scan)."""
        return -(-self.n_steps // self.block) if self.block else self.n_steps

    @property
    def n_slots(self) -> int:
        return sum(g.n_slots for g in self.groups)


jax.tree_util.register_pytree_node(RunTables, lambda t: ((), t), lambda t, _: t)


class SSRun(NamedTuple):
    """One prepared run (a pytree whose leaves are the data arrays of ``gp``).

    Fields:
        gp: the shared grouped preparation, :class:`msrm.gp.prepare.RunPrepared` (its ``streams`` are the traced
            (n_s, F) and (F,) float64 data arrays).
        tables: the static :class:`RunTables` of the scan (no leaves).
    """

    gp: RunPrepared
    tables: RunTables


class StateSpacePrepared(NamedTuple):
    """The state-space backend's prepared dataset (a pytree: pass it to ``jax.jit`` as an argument or close over
    it).

    Fields:
        runs: one :class:`SSRun` per run of the dataset, in its order.
    """

    runs: tuple[SSRun, ...]


EMBEDDING_DEFAULT = "exact"


@dataclass(frozen=True)
class StateSpaceOptions:
    """Options of the state-space backend (validated on construction; ``ValueError`` names the option).

    Fields:
        method: where the sequential scan runs: ``"callback"`` (NumPy and SciPy's BLAS on the host, called from
            JAX), ``"native"`` (an XLA scan) or ``"auto"`` (as :func:`msrm.gp.linalg.quad_logdet`: the callback on a
            CPU backend with at least two cores, native elsewhere). The associative scan is always native. Checked
            by :func:`msrm.gp.backends.make_options`, which :func:`prepare` and ``GPMSRM`` build options with.
        response_embedding: ``"exact"`` (delay line), ``"rational"`` or ``"laguerre"`` (approximate banks).
        n_states: bank states per factor (banks only; None for ``"exact"``).
        parallel: True for the associative (log-depth) scan.
        checkpoint_every: sub-steps per checkpointed chunk of the sequential scan; None chooses it with
            :func:`auto_chunk` (one chunk when every state fits :data:`KEEP_BYTES`, else about sqrt(sub-steps));
            0 = no checkpointing (every state kept).
        block: grid steps per block of the sequential scan; None chooses it per run with :func:`auto_block` (the
            deterministic rule of :mod:`.tuning`). The value does not change the density.
    """

    method: str = "auto"
    response_embedding: str = EMBEDDING_DEFAULT
    n_states: int | None = None
    parallel: bool = False
    checkpoint_every: int | None = None
    block: int | None = None

    def __post_init__(self):
        emb, n_states = self.response_embedding, self.n_states
        if emb not in EMBEDDINGS:
            raise ValueError(f"response_embedding must be one of {EMBEDDINGS}, got {emb!r}")
        if emb != "exact":
            if isinstance(n_states, bool) or not isinstance(n_states, (int, np.integer)) or n_states < 1:
                raise ValueError(f"n_states must be a positive integer for response_embedding={emb!r}, got {n_states!r}")
        elif n_states is not None:
            raise ValueError("n_states applies to the 'rational' and 'laguerre' embeddings only; leave it None for 'exact'")
        if not isinstance(self.parallel, (bool, np.bool_)):
            raise ValueError(f"parallel must be True or False, got {self.parallel!r}")
        every = self.checkpoint_every
        if every is not None and (isinstance(every, bool) or not isinstance(every, (int, np.integer)) or every < 0):
            raise ValueError(f"checkpoint_every must be None (chosen per run), 0 (off) or a positive integer, got {every!r}")
        block = self.block
        if block is not None and (isinstance(block, bool) or not isinstance(block, (int, np.integer)) or block < 1):
            raise ValueError(f"block must be a positive integer, got {block!r}")


def auto_chunk(n_sub: int, n_states: int, keep_bytes: int = KEEP_BYTES) -> int:
    """Sub-steps per checkpointed chunk for ``n_sub`` sub-steps of an ``n_states``-dimensional state: ``n_sub``
    (one chunk: every state kept, nothing recomputed) when all the covariances fit in ``keep_bytes``, else
    ceil(sqrt(n_sub))."""
    if (n_sub + 1) * 8 * n_states * n_states <= keep_bytes:
        return n_sub
    return max(1, math.ceil(math.sqrt(n_sub)))


def schedule_shape(lay, ends, C: int, n_bank: int, L: int, options: StateSpaceOptions) -> tuple:
    """What the cost model needs of a run's schedule at block length C, without building its tables:
    ``(sub-steps, sub-steps absorbing nodes, S, nodes, recompute)``; ``recompute``: the reverse pass recomputes
    checkpointed chunks."""
    J, K = lay.n_grid, lay.n_factors
    d = sde_states(lay.kernel)
    n_units = -(-J // C)
    units = [e // C for e in ends]
    piles = [(min(g.window.width - 1, J - 1) // C, (J - 1) // C) for g in lay.groups]
    reps = np.ones(n_units, dtype=np.int64)
    total = np.zeros(n_units, dtype=np.int64)
    for u, p in zip(units, piles):
        counts, M = _group_counts(u, n_units, p)
        reps = np.maximum(reps, -(-counts // M))
        total += counts
    n_sub = int(reps.sum())
    n_occ = int(reps[total > 0].sum())
    S = K * (d + C * (-(-L // C) + 1) + n_bank)
    every = options.checkpoint_every
    if every == 0:
        recompute = False
    elif every is None:
        recompute = auto_chunk(n_sub, S) < n_sub
    else:
        recompute = int(every) < n_sub
    return n_sub, n_occ, S, int(total.sum()), recompute


def auto_block(lay, ends, n_bank: int, L: int, options: StateSpaceOptions, coefficients=None, cores=None):
    """The block length of one run by the rule of :mod:`.tuning` (its
    :class:`~msrm.gp.state_space.tuning.BlockChoice`): the C its fixed-coefficient cost model predicts fastest
    for this run's schedule; ``coefficients`` default to :data:`~msrm.gp.state_space.tuning.COEFFICIENTS`,
    ``cores`` to the machine's physical cores."""
    from .tuning import choose_block

    return choose_block(lambda C: schedule_shape(lay, ends, C, n_bank, L, options), lay.n_grid, lay.n_factors,
                        coefficients, cores)


def _group_counts(units: np.ndarray, n_units: int, piles: tuple[int, ...]) -> tuple[np.ndarray, int]:
    """Nodes absorbed per unit and the slots per sub-step: the largest count away from the units where windows
    clipped at the run's ends pile up (``piles``); a pile-up is spread over extra sub-steps instead of widening
    every sub-step."""
    counts = np.bincount(units, minlength=n_units)
    inner = counts.copy()
    inner[list(piles)] = 0
    M = int(inner.max()) if inner.max() > 0 else int(counts.max())
    return counts, max(M, 1)


def _sub_steps(all_units: list[np.ndarray], all_piles: list[tuple], n_units: int, chunk: int | None):
    """Sub-step schedule: unit index, whether to predict after it, and each group's slot table.

    Unit j (a block or a grid step) gets ``max_g ceil(count_gj / M_g)`` sub-steps (at least one); only the last
    one predicts. Returns (unit index (T,), predict (T,) bool, [(T, M_g) local slot tables], chunk, n_chunks).
    """
    counts, Ms = zip(*[_group_counts(u, n_units, p) for u, p in zip(all_units, all_piles)]) if all_units else ((), ())
    reps = np.ones(n_units, dtype=np.int64)
    for c, M in zip(counts, Ms):
        reps = np.maximum(reps, -(-c // M))
    T = int(reps.sum())
    if chunk is None:
        chunk, n_chunks = T, 1
    else:
        chunk = min(chunk, T)
        n_chunks = -(-T // chunk)
    T_pad = chunk * n_chunks
    unit_index = np.full(T_pad, n_units - 1, dtype=np.int32)
    unit_index[:T] = np.repeat(np.arange(n_units), reps)
    first_sub = np.concatenate([[0], np.cumsum(reps)[:-1]])
    predict = np.zeros(T_pad, dtype=bool)
    predict[np.cumsum(reps) - 1] = True
    tables = []
    for units, M in zip(all_units, Ms):
        n_g = units.size
        local = np.full((T_pad, M), n_g, dtype=np.int32)
        # nodes in unit order (stable: ascending node index inside a unit); the r-th node of unit e fills slot
        # r mod M of the unit's sub-step r // M
        order = np.argsort(units, kind="stable")
        e = units[order]
        r = np.arange(n_g) - np.searchsorted(e, e, side="left")
        local[first_sub[e] + r // M, r % M] = order
        tables.append(local)
    return unit_index, predict, tables, chunk, n_chunks


def _ring_or_bank(lay, options: StateSpaceOptions):
    """Per group ``"ring"`` (exact delay line) or ``"bank"`` (filter-bank readout), the delay-line length L and the
    bank (None when no group uses one). Banks are the approximate embeddings; a two-tap response (rows touching two
    adjacent grid points) stays exact on a one-slot ring under every embedding."""
    bank_mode = options.response_embedding != "exact"
    modes = ["bank" if bank_mode and not g.response.two_tap else "ring" for g in lay.groups]
    ring_w = [g.window.width for g, m in zip(lay.groups, modes) if m == "ring"]
    L = max(1, max(ring_w, default=2) - 1)
    bank = None
    if bank_mode and "bank" in modes:
        bank_groups = [g for g, m in zip(lay.groups, modes) if m == "bank"]
        bank = design_bank(options.response_embedding, int(options.n_states), [g.response for g in bank_groups],
                           [g.window.width for g in bank_groups], float(lay.grid[1] - lay.grid[0]))
    return modes, L, bank


def _window_ends(lay) -> list[np.ndarray]:
    """Grid index of the last point of every node's window, per group (raises when a window leaves the grid)."""
    J = lay.n_grid
    ends = [(g.window.start + g.window.width - 1).astype(np.int64) for g in lay.groups]
    for g, e in zip(lay.groups, ends):
        if g.window.start.size and (g.window.start.min() < 0 or e.max() > J - 1):
            raise ValueError(f"response group {g.key!r}: a window leaves the run's grid")
    return ends


def _schedule(lay, ends, C: int, n_ring: int, n_bank: int, options: StateSpaceOptions):
    """The sub-step schedule of one run: ``(index, predict, local slot tables, chunk, n_chunks, checkpoint)``.

    Units are blocks of C grid steps; a node is absorbed in the unit holding its window's end. Checkpointing cuts
    the schedule into chunks of ``checkpoint_every`` sub-steps (chosen by :func:`auto_chunk` when None).
    """
    J, K = lay.n_grid, lay.n_factors
    d = sde_states(lay.kernel)
    n_units = -(-J // C)
    units = [e // C for e in ends]
    piles = [(min(g.window.width - 1, J - 1) // C, (J - 1) // C) for g in lay.groups]
    index, predict, locals_, chunk, n_chunks = _sub_steps(units, piles, n_units, None)
    if options.parallel or options.checkpoint_every == 0:
        every = None
    elif options.checkpoint_every is None:
        every = auto_chunk(index.size, K * (d + n_ring + n_bank))
    else:
        every = int(options.checkpoint_every)
    checkpoint = every is not None and every < index.size
    if checkpoint:
        index, predict, locals_, chunk, n_chunks = _sub_steps(units, piles, n_units, every)
    return index, predict, locals_, chunk, n_chunks, checkpoint


def _group_tables(lay, modes, locals_, ends, C: int, n_ring: int, bank, parallel: bool) -> tuple:
    """The :class:`GroupTable` of every response group: slot tables and where each node reads the state."""
    tables = []
    for g, mode, local, e in zip(lay.groups, modes, locals_, ends):
        n_g = g.node_stop - g.node_start
        glob = np.where(local == n_g, lay.n_nodes, local + g.node_start).astype(np.int32)
        proj = projection(bank["G"], g.window.width) if mode == "bank" else None
        ring_pos = offset = None
        if not parallel and mode == "ring":
            steps = g.window.start[:, None] + np.arange(g.window.width)[None, :]
            ring_pos = np.concatenate([steps % n_ring, np.zeros((1, g.window.width), np.int64)]).astype(np.int32)
        elif not parallel:
            offset = np.concatenate([e % C, [0]]).astype(np.int32)
        tables.append(GroupTable(g.key, g.response, g.param_key, mode, g.window, g.node_start, n_g,
                                 local, glob, proj, ring_pos, offset))
    return tuple(tables)


def prepare_run_tables(gp: RunPrepared, options: StateSpaceOptions, method: str) -> RunTables:
    """The static step tables of one run from its grouped preparation (NumPy)."""
    lay = gp.layout
    J, K = lay.n_grid, lay.n_factors
    parallel = bool(options.parallel)
    modes, L, bank = _ring_or_bank(lay, options)
    n_bank = int(options.n_states) if bank is not None else 0
    ends = _window_ends(lay)
    source, predicted = "option", None
    if parallel:
        C, source = 1, "parallel"
    elif options.block is not None:
        C = int(min(options.block, J))
    else:
        choice = auto_block(lay, ends, n_bank, L, options)
        C, source, predicted = choice.block, choice.source, choice.predicted_s
    n_ring = L if parallel else C * (-(-L // C) + 1)
    index, predict, locals_, chunk, n_chunks, checkpoint = _schedule(lay, ends, C, n_ring, n_bank, options)
    return RunTables(
        block_index=index, predict=predict, K=K, kernel=lay.kernel, step=float(lay.grid[1] - lay.grid[0]),
        d=sde_states(lay.kernel), L=L, block=0 if parallel else C, n_ring=n_ring, n_bank=n_bank, n_steps=J,
        chunk=chunk, n_chunks=n_chunks, checkpoint=checkpoint, embedding=options.response_embedding,
        parallel=parallel, groups=_group_tables(lay, modes, locals_, ends, C, n_ring, bank, parallel),
        bank_M=None if bank is None else bank["M"], bank_v=None if bank is None else bank["v"], method=method,
        block_source=source, block_predicted_s=predicted,
    )


def prepare_options(data: Dataset, spec: ModelSpec, options: StateSpaceOptions) -> StateSpacePrepared:
    """:func:`prepare` with its options as one :class:`StateSpaceOptions` (the backend ``prepare``)."""
    method = "native" if options.parallel else linalg.resolve_method(options.method)
    groups = response_groups(data, spec)
    runs = []
    for run in data.runs:
        gp = prepare_run(run, spec, groups, grouped=True)
        runs.append(SSRun(gp, prepare_run_tables(gp, options, method)))
    return StateSpacePrepared(runs=tuple(runs))


def prepare(data: Dataset, spec: ModelSpec, *, response_embedding: str = EMBEDDING_DEFAULT,
            n_states: int | None = None, parallel: bool = False, checkpoint_every: int | None = None,
            block: int | None = None, method: str = "auto") -> StateSpacePrepared:
    """Prepare a dataset for :func:`msrm.gp.state_space.loglik` (NumPy, once).

    Args:
        data: the dataset.
        spec: the model spec.
        response_embedding, n_states, parallel, checkpoint_every, block, method: the fields of
            :class:`StateSpaceOptions`.
    Raises:
        ValueError: a bad option (named); KeyError: a modality without a response.
    """
    from ..backends import get_backend, make_options

    options = make_options(get_backend("state_space"), method=method, response_embedding=response_embedding,
                           n_states=n_states, parallel=parallel, checkpoint_every=checkpoint_every, block=block)
    return prepare_options(data, spec, options)
