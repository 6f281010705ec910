r"""Rauch-Tung-Striebel smoothing over the state-space model: the latent posterior and posterior predictions.

The smoother runs the block filter of :mod:`.filter` forward and its reverse pass of :mod:`.host` backward, on the
host, over exactly the transitions and node updates the density uses. It is the adjoint (Bryson-Frazier) form
of the RTS smoother, which needs no inverse of a predicted covariance (the filter's covariances are singular:
the SDE state's first component duplicates a ring slot, and the block noise ``Q_b`` is singular for the same
reason).

**Why the reverse pass smooths.** Let ``(m, P)`` be the filtered law of the state just before sub-step ``i`` and
``g(x) = p(Y_{\ge i} | x)`` the likelihood of every node absorbed from sub-step ``i`` on. The filter computes
``ℓ = log p(Y_{<i}) + log ∫ N(x; m, P) g(x) dx`` exactly for any Gaussian ``(m, P)``, and the reverse pass gives
the adjoints ``m̄ = ∂ℓ/∂m``, ``P̄ = ∂ℓ/∂P`` (symmetric) there. Differentiating the Gaussian integral,

.. math::

    \bar m = P^{-1}(m_s - m), \qquad
    2\bar P = P^{-1}\bigl(P_s + (m_s - m)(m_s - m)^\top\bigr)P^{-1} - P^{-1},

so the smoothed law ``N(m_s, P_s)`` of that state is

.. math::

    m_s = m + P\bar m, \qquad P_s = P + P\,(2\bar P - \bar m\bar m^\top)\,P,

with no inverse (the identities hold for singular ``P`` by continuity). Applied to a state whose rows of interest
are already filtered by their own data, the correction ``P (2P̄ − m̄m̄ᵀ) P`` is of the size of the posterior and
the identity keeps its accuracy; applied where they still hold the prior, it forms the posterior's small
variances as a difference of prior-sized terms.

**What is read where.**

* *Nodes* (``x_u = a_u^T Z`` for every distinct (response group, sample time), hence for every sample of every
  stream, those with every feature missing included): at the absorbed state of the sub-step that absorbs them,
  ``x = B X`` (:func:`node_block`, ``R S^2`` per sub-step).
* *Grid values*: the exact embedding's ring holds ``z_j`` for every step ``j`` of block ``b`` from the prediction
  into the block until the prediction ``N / C`` blocks later overwrites the slot, and every node that reads it
  is absorbed in between; ``p(z_j | Y)`` is read at the absorbed state just before that overwrite
  (:func:`read_schedule`): with ``R`` the block's ``C K`` ring rows, ``E[z_R] = m_R + P_{R,:} m̄`` and
  ``Cov[z_R] = P_{RR} + 2 P_{R,:} P̄ P_{:,R} - (P_{R,:} m̄)(P_{R,:} m̄)^T`` (:func:`grid_block`, ``C K S^2`` per
  block).
* *Accuracy*: a run whose blocks are ill-conditioned at the parameters (:func:`.filter.block_conditioning`) or
  whose nodes are precise enough for a long block's update to round (:func:`variance_rounding`) is smoothed on
  one-step blocks (:func:`one_step_run`: the same model and density); where even those cannot resolve the
  posterior to the package's tolerance, a :class:`msrm.gp.accuracy.NumericalAccuracyWarning` says so.

Cost and memory: the forward pass keeps the chunk-start states of the run's checkpointing
(:func:`.prepare.auto_chunk`) and the reverse pass recomputes one chunk at a time, as the gradient does (on a
second thread, one chunk ahead, where :class:`.host.HostFilter` finds that it pays); the results are (J, K, K) and
(nodes, K, K). Linear in the number of grid points in time and memory; nothing
(J K)^2 is formed.

**Embeddings.** With ``response_embedding="exact"`` the moments are exact. With a filter bank (``"rational"``,
``"laguerre"``) the state is that of the approximate model (Gaussian nodes read a projection of the bank), and
what is returned is the posterior of that approximate model: the grid values still live in the ring, the node
values are the bank readouts the approximate density uses. Runs prepared for the associative scan
(``parallel=True``) are smoothed on the sequential tables of the same embedding (same model, same density).
"""
from __future__ import annotations

import dataclasses
import hashlib
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import jax
import numpy as np

from ... import runtime
from ..accuracy import NumericalAccuracyWarning
from .filter import LEVEL_SHIFT, block_transition, describe_code, qy, step_tables
from .host import HostFilter, one_blas_thread
from .prepare import RunTables, SSRun, StateSpaceOptions, prepare_run_tables
from .sde import stationary_cov

__all__ = ["RunSmooth", "filter_inputs", "sequential_run", "one_step_run", "ROUNDING_LIMIT", "update_rank",
           "variance_rounding", "read_schedule", "absorbed_rows", "node_block", "grid_block",
           "smooth_run", "smooth_runs", "node_moments",
           "stream_predictions"]


@dataclass(frozen=True, eq=False)
class RunSmooth:
    """Smoothed moments of one run (NumPy).

    Fields:
        loglik: the run's log likelihood (from the same forward pass).
        node_mean: (N, K) ``E[x_u | Y]`` per node of the run's node table (None when not asked for).
        node_cov: (N, K, K) ``Cov[x_u | Y]`` (None when not asked for).
        grid_mean: (J, K) ``E[Z | Y]`` (None when not asked for).
        grid_cov: (J, K, K) ``Cov[Z_j | Y]`` per grid point (None when not asked for).
    """

    loglik: float
    node_mean: np.ndarray | None
    node_cov: np.ndarray | None
    grid_mean: np.ndarray | None
    grid_cov: np.ndarray | None


def sequential_run(run: SSRun) -> SSRun:
    """``run`` with sequential-scan tables: itself, or, for a run prepared for the associative scan, the same
    grouped preparation with the sequential tables of the same embedding (the host filter's layout)."""
    t = run.tables
    if not t.parallel:
        return run
    seq = _SEQUENTIAL.get(t)
    if seq is None:  # built once per prepared run (the jitted filter inputs then compile once for it)
        options = StateSpaceOptions(method="callback", response_embedding=t.embedding,
                                    n_states=t.n_bank if t.embedding != "exact" else None, parallel=False)
        seq = _SEQUENTIAL[t] = prepare_run_tables(run.gp, options, "callback")
    return SSRun(run.gp, seq)


#: sequential tables of runs prepared for the associative scan, by their tables (weakly: gone with them)
_SEQUENTIAL: "weakref.WeakKeyDictionary[RunTables, RunTables]" = weakref.WeakKeyDictionary()


def one_step_run(run: SSRun) -> SSRun:
    """``run`` (sequential tables) with one-step blocks (``block=1``) of the same embedding: the tables the
    smoother falls back to when the run's blocks are ill-conditioned at the parameters
    (:func:`.filter.block_conditioning`). Built once per prepared run."""
    t = run.tables
    one = _ONE_STEP.get(t)
    if one is None:
        options = StateSpaceOptions(method="callback", response_embedding=t.embedding,
                                    n_states=t.n_bank if t.embedding != "exact" else None, parallel=False, block=1)
        one = _ONE_STEP[t] = prepare_run_tables(run.gp, options, "callback")
    return SSRun(run.gp, one)


#: one-step tables of sequential runs, by their tables (weakly)
_ONE_STEP: "weakref.WeakKeyDictionary[RunTables, RunTables]" = weakref.WeakKeyDictionary()


def _filter_inputs(theta, run):
    A, Rs, ys, data_term = step_tables(theta, run)
    T, Qb, _ = block_transition(theta, run.tables)
    return A, Rs, ys, data_term, T, Qb


_filter_inputs_jit = jax.jit(_filter_inputs)


def filter_inputs(theta, run: SSRun, hf: HostFilter | None = None) -> tuple:
    """What the host filter reads, as float64 NumPy arrays: ``(A, R blocks, ỹ, data term, T, Q_b, m0, P0)`` (see
    :func:`.filter.step_tables`, :func:`.filter.block_transition`, :func:`.filter.initial_state`).

    The tables and transitions come from one jitted call; the initial state is the host filter's own prediction
    from block -1 (the stationary SDE state one block before the run, moved to block 0, as
    :func:`.filter.initial_state` does; the bank starts at zero, so its move there changes nothing).
    """
    t = run.tables
    hf = HostFilter(t) if hf is None else hf
    A, Rs, ys, data_term, T, Qb = (np.asarray(x, dtype=np.float64) for x in _filter_inputs_jit(theta, run))
    S, Kd, s0 = t.n_states, t.K * t.d, t.sde_offset
    Pinf = np.stack([stationary_cov(t.kernel, float(ell), np) for ell in np.asarray(theta["lengthscales"])])
    m0, P0 = np.zeros(S), np.zeros((S, S))
    P0[s0:s0 + Kd, s0:s0 + Kd] = np.einsum("kij,kl->ikjl", Pinf, np.eye(t.K)).reshape(Kd, Kd)
    hf.predict_step(m0, P0, -1, T, qy(Qb, np))
    return A, Rs, ys, data_term, T, Qb, m0, P0


EPS = float(np.finfo(np.float64).eps)
#: :func:`variance_rounding` above which the smoother leaves the run's blocks for one-step blocks
ROUNDING_LIMIT = 1e-6


def update_rank(t: RunTables) -> int:
    """The largest update rank of a sub-step: its occupied node slots times K."""
    occupied = np.concatenate([np.asarray(g.slot_local) != g.n_g for g in t.groups], axis=1)
    return int(max(occupied.sum(axis=1).max(initial=0), 1)) * t.K


def variance_rounding(t: RunTables, Rs: np.ndarray) -> float:
    r"""The relative rounding the covariance filter leaves in the smoothed variances:
    ``ε R λ_max`` with ``R`` the largest update rank (:func:`update_rank`) and ``λ_max`` the largest node
    information (trace of a slot's ``Λ = RᵀR``, from its factor ``R`` (T, M, K, K), in units of the latent's
    unit prior variance).

    An absorb forms a posterior variance (about ``1/λ`` where the node's samples dominate) as the prior variance
    of its ring slot (up to 1 before the block's nodes are absorbed) less an ``R``-term sum of the same size, so it
    keeps an absolute rounding near ``ε R`` and a relative one near ``ε R λ``. Measured against a 50-digit
    oracle (four kernels, lengthscales 0.5 to 10³ grid steps, noise 10⁻² to 10⁻⁶ of the signal) the sds' relative
    error stays below ``ε R λ`` (one-step blocks: 1.1e-6 to 1.7e-6 at ``λ = 10¹⁰``, 4e-5 to 2e-4 at ``10¹²``;
    30-step blocks 10 to 30 times more)."""
    lam = float(np.max(np.sum(Rs * Rs, axis=(-2, -1)), initial=0.0))
    return EPS * update_rank(t) * lam


def read_schedule(t: RunTables) -> dict[int, list[int]]:
    """Where each block's grid values are read: ``{sub-step i: [blocks]}``, i the last sub-step of block
    ``b' = min(b + n_b − 1, n_blocks − 1)`` (``n_b = N / C`` blocks of ring slots). Block b's slots are written by
    the prediction into it and overwritten by the one at the end of block ``b + n_b − 1``; every node that reads
    them ends in blocks ``b .. b + n_b − 1`` (``N ≥ C + L``), so the absorbed state of block ``b'`` holds them
    filtered by every node that reads them."""
    idx, pred = np.asarray(t.block_index), np.asarray(t.predict)
    nblk = t.n_ring // t.block
    last = {int(idx[i]): int(i) for i in np.flatnonzero(pred)}
    out: dict[int, list[int]] = {}
    for b in range(t.n_blocks):
        out.setdefault(last[min(b + nblk - 1, t.n_blocks - 1)], []).append(b)
    return out


def smooth_run(theta, run: SSRun, *, nodes: bool = True, grid: bool = True) -> RunSmooth:
    """Smoothed moments of one run: node values (``nodes``) and grid values (``grid``).

    One forward pass of :class:`.host.HostFilter` that keeps the chunk-start states, then the reverse pass, one
    chunk recomputed at a time, one sub-step at a time, the prediction's transpose apart from the absorb's, so
    that the adjoints of each absorbed state can be read (the adjoints of the weights, which nothing here needs,
    are not formed). Block b's grid values are read from the absorbed state of :func:`read_schedule`: there they
    are filtered by all their nodes, their covariance is already of the size of the posterior, and the
    correction ``P (2P̄ − m̄m̄ᵀ) P`` carries only what later blocks add. Read at the predicted state before the
    block (where the covariance is the prior's), the same formula forms the posterior's small variances as the
    difference of prior-sized terms (``|Λ|`` times the posterior with ``|Λ|`` the nodes' information): at a
    loading of 10³ on noise sd 0.5 every sd came out more than 0.1% off and one as 0.

    Args:
        theta: constrained parameter pytree (:func:`msrm.gp.model.params_to_theta`).
        run: one prepared run of the state-space backend.
        nodes: whether to return the node moments.
        grid: whether to return the grid moments.

    Returns:
        :class:`RunSmooth` (the moments not asked for are None).
    """
    run = sequential_run(run)
    t = run.tables
    hf = HostFilter(t)
    A, Rs, ys, data_term, T, Qb, m0, P0 = filter_inputs(theta, run, hf)
    rev = _reverse_buffers(t, hf, Rs, ys, T, Qb, nodes, grid)
    args = (A, Rs, ys, T, qy(Qb, np))
    with one_blas_thread():
        ll, code, sm, sP, last = hf.forward(A, Rs, ys, T, Qb, m0, P0, keep_starts=True, keep_last=True)
    rounding = variance_rounding(t, Rs)
    if t.block > 1 and (code >> LEVEL_SHIFT or rounding > ROUNDING_LIMIT):
        # smooth on one-step blocks (same model, same density), where the rounding is that of one step's nodes
        return smooth_run(theta, one_step_run(run), nodes=nodes, grid=grid)
    _warn_accuracy(t, code, rounding)
    _reverse_pass(rev, args, sm, sP, last)
    loglik = -0.5 * float(data_term) + float(ll)
    node_mean = node_cov = None
    if nodes:
        node_mean, node_cov = node_moments(t, rev.slot_mean, rev.slot_cov, run.gp.layout.n_nodes)
    J = t.n_steps
    return RunSmooth(loglik, node_mean, node_cov, None if rev.grid_mean is None else rev.grid_mean[:J],
                     None if rev.grid_cov is None else rev.grid_cov[:J])


@dataclass(eq=False)
class _Reverse:
    """What the smoother's reverse pass reads and writes (built by :func:`_reverse_buffers`).

    Fields:
        t, hf: the run's sequential tables and their host filter.
        pred, absorb: the same filter with one sub-step per chunk (its reverse over "chunk" i is the reverse over
            sub-step i): one that only predicts (run on kept entries without nodes), one that only absorbs (no
            sub-step predicts).
        T: the block transition, as the filter reads it.
        reads: :func:`read_schedule` (empty without grid values).
        grid_mean, grid_cov: (n_blocks C, K) and (n_blocks C, K, K) grid moments, written block by block (None
            without grid values).
        slot_mean, slot_cov: (T, M, K) and (T, M, K, K) node moments per sub-step and slot (None without nodes).
        adjoints: the reverse pass's accumulators ``(R̄s, ȳ, T̄, Q̄_b, m̄, P̄)``, updated in place; only ``m̄``
            (S,) and ``P̄`` (S, S) are read, the adjoints of the node inputs and transitions are unused here.
    """

    t: RunTables
    hf: HostFilter
    pred: HostFilter
    absorb: HostFilter
    T: np.ndarray
    reads: dict
    grid_mean: np.ndarray | None
    grid_cov: np.ndarray | None
    slot_mean: np.ndarray | None
    slot_cov: np.ndarray | None
    adjoints: tuple


def _reverse_buffers(t: RunTables, hf: HostFilter, Rs: np.ndarray, ys: np.ndarray, T: np.ndarray, Qb: np.ndarray,
                     nodes: bool, grid: bool) -> _Reverse:
    """The one-sub-step filters, zeroed outputs and zeroed adjoints of the reverse pass over ``t``.

    ``Rs`` (T, M, K, K) and ``ys`` (T, M K) are the node factors and data of :func:`filter_inputs`, ``T`` and
    ``Qb`` its block transition and noise; they give the shapes of the adjoints and of the node outputs.
    """
    n_sub = int(t.block_index.size)
    pred = HostFilter(dataclasses.replace(t, chunk=1, n_chunks=n_sub))
    absorb = HostFilter(dataclasses.replace(t, chunk=1, n_chunks=n_sub, predict=np.zeros_like(t.predict)))
    K, C, S = t.K, t.block, t.n_states
    reads = read_schedule(t) if grid else {}
    grid_mean = np.zeros((t.n_blocks * C, K)) if grid else None
    grid_cov = np.zeros((t.n_blocks * C, K, K)) if grid else None
    adjoints = (np.zeros_like(Rs), np.zeros_like(ys), np.zeros_like(T), np.zeros_like(Qb), np.zeros(S),
                np.zeros((S, S)))
    slot_mean = np.zeros(ys.shape[:1] + (ys.shape[1] // K, K)) if nodes else None  # (T, M, K)
    slot_cov = np.zeros(Rs.shape) if nodes else None  # (T, M, K, K)
    return _Reverse(t, hf, pred, absorb, T, reads, grid_mean, grid_cov, slot_mean, slot_cov, adjoints)


def _warn_accuracy(t: RunTables, code: int, rounding: float) -> None:
    """Warn (:class:`NumericalAccuracyWarning`) where the run's smoothed moments miss the package's tolerance:
    ``code`` the forward pass's status (:func:`.filter.describe_code`), ``rounding`` :func:`variance_rounding`.
    The warnings' ``stacklevel`` names the caller of :func:`smooth_run`'s caller."""
    if code >> LEVEL_SHIFT:
        warnings.warn(f"state_space latent posterior: {describe_code(code)}", NumericalAccuracyWarning, stacklevel=4)
    if rounding > 2.0 * ROUNDING_LIMIT:
        lam = rounding / (EPS * update_rank(t))
        warnings.warn(
            f"state_space latent posterior: a node's information is up to {lam:.1e} times its prior variance (noise "
            f"sd about {lam ** -0.5:.0e} of the signal), so the covariance filter's posterior variances keep a "
            f"relative rounding of about {rounding:.0e} (sds about half that): below the noise they resolve, but "
            "above the package's 1e-6; float64 covariances cannot do better at this precision (the dense and "
            "grouped backends have the same limit): bound the noise sds away from zero (a noise floor above about "
            "1e-5 of the signal) for tighter sds", NumericalAccuracyWarning, stacklevel=4)


def _reverse_pass(rev: _Reverse, args: tuple, sm, sP, last: list) -> None:
    """The reverse pass over every chunk, last first, filling ``rev``'s outputs.

    ``args`` is ``(A, R blocks, ỹ, T, Q_y)`` as :meth:`.host.HostFilter.recompute` reads them, ``sm``, ``sP`` the
    forward pass's chunk-start states and ``last`` its kept entries of the last chunk. As in
    :meth:`.host.HostFilter.backward`, with two cores and enough work per sub-step, chunk c - 1 is recomputed on a
    second thread while the reverse pass walks back through chunk c (BLAS and most NumPy loops release the GIL).
    """
    t, hf = rev.t, rev.hf
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="msrm-smooth") if (
        t.n_chunks > 2 and hf.pipeline_pays and runtime.physical_cores() >= 2) else None
    with one_blas_thread():
        nxt = None
        try:
            for c in reversed(range(t.n_chunks)):
                if c == t.n_chunks - 1:
                    kept = last
                elif pool is None:
                    kept = hf.recompute(c, *args, sm, sP)
                else:
                    kept = nxt.result() if nxt is not None else hf.recompute(c, *args, sm, sP, hf.buffers())
                if pool is not None and c > 0:
                    nxt = pool.submit(hf.recompute, c - 1, *args, sm, sP, hf.buffers())
                _reverse_chunk(rev, c, kept)
        finally:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)


def _reverse_chunk(rev: _Reverse, c: int, kept: list) -> None:
    """The reverse pass over chunk c, one sub-step at a time: the prediction's transpose, the grid values and
    the sub-step's nodes read there (the absorbed state), then the absorb's transpose. ``kept`` holds the
    chunk's entries of the forward pass, one per sub-step; each is dropped once passed."""
    t, hf, T = rev.t, rev.hf, rev.T
    C, K = t.block, t.K
    Rsb, yb, Tb, Qbb, mb, Pb = rev.adjoints
    for j in reversed(range(len(kept))):
        i = c * t.chunk + j
        k = kept[j]
        if t.predict[i]:
            rev.pred.reverse_chunk(i, [dict(m=k["m"], P=k["P"], R=0, FPs=k["FPs"], ms=k["ms"])], T, 1.0, Rsb, yb,
                                   Tb, Qbb, mb, Pb)
        blocks = rev.reads.get(i)
        if blocks:
            for b in blocks:
                r = hf.ring_row(b)
                mR, PR = absorbed_rows(k, r, C * K)
                grid_block(mR, PR, mb, Pb, r, C, K, rev.grid_mean[b * C:(b + 1) * C], rev.grid_cov[b * C:(b + 1) * C])
        if k["R"]:
            if rev.slot_mean is not None:
                node_block(k, mb, Pb, hf.occupied(i), rev.slot_mean[i], rev.slot_cov[i])
            rev.absorb.reverse_chunk(i, [k], T, 1.0, Rsb, yb, Tb, Qbb, mb, Pb)
        kept[j] = None


class _LastSmooth:
    """The smoothed runs of the last (prepared, theta) pair, so that ``latent_posterior`` and ``predict`` at the
    same parameters share one smoother pass. The prepared data is held by a weak reference to one of its arrays
    (the cache keeps nothing alive), theta by a digest of its values."""

    def __init__(self):
        self.ref, self.digest, self.runs = None, None, None

    @staticmethod
    def _digest(theta) -> bytes:
        h = hashlib.blake2b(digest_size=32)
        for path, leaf in jax.tree_util.tree_flatten_with_path(theta)[0]:
            a = np.asarray(leaf, dtype=np.float64)
            h.update(repr((jax.tree_util.keystr(path), a.shape)).encode())
            h.update(np.ascontiguousarray(a).tobytes())
        return h.digest()

    def get(self, theta, prepared):
        leaves = jax.tree_util.tree_leaves(prepared)
        digest = self._digest(theta)
        if self.ref is not None and leaves and self.ref() is leaves[0] and self.digest == digest:
            return self.runs, digest
        return None, digest

    def put(self, prepared, digest, runs):
        leaves = jax.tree_util.tree_leaves(prepared)
        try:
            self.ref = weakref.ref(leaves[0]) if leaves else None
        except TypeError:  # a leaf type without weak references: no caching
            self.ref = None
        self.digest, self.runs = digest, runs


_LAST = _LastSmooth()


def smooth_runs(theta, prepared) -> list[RunSmooth]:
    """:func:`smooth_run` of every run of a prepared dataset, nodes and grid, reusing the result of the previous
    call when it was made with the same prepared data and the same parameter values."""
    runs, digest = _LAST.get(theta, prepared)
    if runs is None:
        runs = [smooth_run(theta, run, nodes=True, grid=True) for run in prepared.runs]
        _LAST.put(prepared, digest, runs)
    return runs


def absorbed_rows(k: dict, r: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``r .. r + n − 1`` of the absorbed state of a sub-step from what the host filter kept before it
    (``m``, ``P``, and when it absorbed, ``U``, ``W``, ``u``): the mean (n,) and the rows (n, S) of the
    covariance, ``m + Vᵀu`` and ``P − Vᵀ V`` with ``V = W Uᵀ`` (as the filter forms them,
    :func:`.filter.absorb_state`)."""
    m, P = k["m"], k["P"]
    if not k["R"]:
        return m[r:r + n].copy(), P[r:r + n].copy()
    V = k["W"] @ k["U"].T  # (R, S)
    Vr = V[:, r:r + n]
    return m[r:r + n] + Vr.T @ k["u"], P[r:r + n] - Vr.T @ V


def node_block(k: dict, mb: np.ndarray, Pb: np.ndarray, occupied, out_mean: np.ndarray, out_cov: np.ndarray):
    """Smoothed moments of a sub-step's nodes (``x = B X``, R = M' K values) from what the host filter kept
    before the sub-step and the adjoints ``(m̄, P̄)`` of its absorbed state (before its prediction), by the
    smoothing identity of the module docstring on the rows ``B``: with ``V = W Uᵀ``,

    ``B P_a = Uᵀ − (WC)ᵀ V``, ``B m_a = μ + (WC)ᵀ u``, ``B P_a Bᵀ = C − (WC)ᵀ(WC)``, then
    ``E[x] = B m_a + B P_a m̄`` and ``Cov[x] = B P_a Bᵀ + B P_a (2P̄ − m̄m̄ᵀ) P_a Bᵀ``,

    every term of the size of the nodes' filtered posterior (the nodes were just absorbed). Writes the (M, K)
    means and (M, K, K) blocks of the occupied slots (``occupied``: their indices, None for all)."""
    U, W, C, mu, u = k["U"], k["W"], k["Cm"], k["mu"], k["u"]
    R = C.shape[0]
    K = out_mean.shape[-1]
    WC = W @ C
    BP = U.T - WC.T @ (W @ U.T)  # (R, S)
    g = BP @ mb
    mean = mu + WC.T @ u + g
    cov = C - WC.T @ WC + 2.0 * (BP @ Pb) @ BP.T - np.outer(g, g)
    M = R // K
    idx = np.arange(M)
    blocks = cov.reshape(M, K, M, K)[idx, :, idx, :]
    blocks = 0.5 * (blocks + np.swapaxes(blocks, -1, -2))
    if occupied is None:
        out_mean[:] = mean.reshape(M, K)
        out_cov[:] = blocks
    else:
        out_mean[occupied] = mean.reshape(M, K)
        out_cov[occupied] = blocks


def grid_block(mR, PR, mb, Pb, r, C, K, out_mean, out_cov):
    """Smoothed moments of the C K ring rows ``r .. r + C K - 1`` (a block's grid values) from their filtered mean
    ``mR`` (C K,) and covariance rows ``PR`` (C K, S) in a state and the adjoints ``(m̄, P̄)`` there (see the
    module docstring); writes the (C, K) means and (C, K, K) blocks."""
    g = PR @ mb
    cov = PR[:, r:r + C * K] + 2.0 * (PR @ Pb) @ PR.T - np.outer(g, g)
    out_mean[:] = (mR + g).reshape(C, K)
    c4 = cov.reshape(C, K, C, K)
    idx = np.arange(C)
    blocks = c4[idx, :, idx, :]
    out_cov[:] = 0.5 * (blocks + np.swapaxes(blocks, -1, -2))


def node_moments(t: RunTables, slot_mean: np.ndarray, slot_cov: np.ndarray,
                 n_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """Per node ``E[x_u | Y]`` (N, K) and ``Cov[x_u | Y]`` (N, K, K) from the slots' moments (T, M, K) and
    (T, M, K, K) (:func:`node_block`; each node fills one slot)."""
    glob = np.concatenate([np.asarray(g.slot_global) for g in t.groups], axis=1)  # (T, M); n_nodes = padding
    real = glob < n_nodes
    nodes = glob[real]
    if nodes.size != n_nodes or np.unique(nodes).size != n_nodes:  # pragma: no cover - prepare guarantees it
        raise ValueError(f"state-space tables: {nodes.size} node slots for {n_nodes} nodes")
    mean = np.zeros((n_nodes, t.K))
    cov = np.zeros((n_nodes, t.K, t.K))
    mean[nodes] = slot_mean[real]
    cov[nodes] = slot_cov[real]
    return mean, cov


def stream_predictions(theta, gp, run, node_mean: np.ndarray, node_cov: np.ndarray) -> dict:
    """Posterior predictive of every stream of one run at every sample from its nodes' moments.

    For stream s with loadings W (F, K), intercepts b, noise sd σ and sample i at node u:
    mean ``b + W E[x_u]``, signal variance ``diag(W Cov[x_u] W^T)`` (one (n_s, K^2) x (K^2, F) product),
    sd ``sqrt(signal variance + σ^2)``.

    Args:
        theta: constrained parameter pytree; gp: the run's grouped preparation (:class:`msrm.gp.prepare.RunPrepared`);
        run: the :class:`msrm.Run` (for the sample times); node_mean (N, K), node_cov (N, K, K).
    Returns:
        ``{stream key: msrm.Prediction}``.
    """
    from ...latent import Prediction

    K = node_mean.shape[1]
    by_key = {s.key: s for s in run.streams}
    out = {}
    for sl in gp.layout.streams:
        stream = by_key[sl.key]
        W = np.asarray(theta["loadings"][sl.key], dtype=np.float64)
        b = np.asarray(theta["intercepts"][sl.key], dtype=np.float64)
        sd = np.asarray(theta["noise_sd"][sl.key], dtype=np.float64)
        u = sl.sample_nodes
        mean = node_mean[u] @ W.T
        mean += b[None, :]
        WW = (W[:, :, None] * W[:, None, :]).reshape(W.shape[0], K * K)
        sig = node_cov[u].reshape(u.size, K * K) @ WW.T  # (n_s, F) signal variances
        np.maximum(sig, 0.0, out=sig)
        total = sig + (sd * sd)[None, :]
        np.sqrt(total, out=total)
        np.sqrt(sig, out=sig)
        out[sl.key] = Prediction(mean=mean, sd=total, signal_sd=sig, times=stream.times)
        del mean, total, sig
    return out
