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

with no inverse (the identities hold for singular ``P`` by continuity). The same argument at the node level, where
the density holds ``exp(-x_u^T Λ_u x_u / 2 + η_u^T x_u)`` for node ``u``, gives its posterior moments from the
adjoints of its sufficient statistics: ``E[x_u | Y] = η̄_u`` and ``E[x_u x_u^T | Y] = -2 Λ̄_u``.

**What is read where.**

* *Nodes* (``x_u = a_u^T Z`` for every distinct (response group, sample time), hence for every sample of every
  stream, those with every feature missing included: their ``Λ_u = 0`` and ``η_u = 0``, but the derivative of the
  density with respect to them is still their posterior moment): from ``η̄`` and ``Λ̄``, which the reverse pass
  writes per slot. Nothing beyond the reverse pass itself.
* *Grid values*: the exact embedding's ring holds ``z_j`` for every step ``j`` of block ``b`` while the block is
  absorbed (slot ``j mod N``), so ``p(z_j | Y)`` is read from the smoothed state before the block's first
  sub-step: with ``R`` the block's ``C K`` ring rows, ``E[z_R] = m_R + P_{R,:} m̄`` and
  ``Cov[z_R] = P_{RR} + 2 P_{R,:} P̄ P_{:,R} - (P_{R,:} m̄)(P_{R,:} m̄)^T`` (``C K S^2`` per block).

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
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import jax
import numpy as np

from ... import runtime
from .filter import block_transition, qy, step_tables
from .host import HostFilter, one_blas_thread
from .prepare import RunTables, SSRun, StateSpaceOptions, prepare_run_tables
from .sde import stationary_cov

__all__ = ["RunSmooth", "filter_inputs", "sequential_run", "smooth_run", "smooth_runs", "node_moments",
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


def _filter_inputs(theta, run):
    A, Ls, e, const = step_tables(theta, run)
    T, Qb, _ = block_transition(theta, run.tables)
    return A, Ls, e, const, T, Qb


_filter_inputs_jit = jax.jit(_filter_inputs)


def filter_inputs(theta, run: SSRun, hf: HostFilter | None = None) -> tuple:
    """What the host filter reads, as float64 NumPy arrays: ``(A, Λ blocks, η, const, T, Q_b, m0, P0)`` (see
    :func:`.filter.step_tables`, :func:`.filter.block_transition`, :func:`.filter.initial_state`).

    The tables and transitions come from one jitted call; the initial state is the host filter's own prediction
    from block -1 (the stationary SDE state one block before the run, moved to block 0, as
    :func:`.filter.initial_state` does; the bank starts at zero, so its move there changes nothing).
    """
    t = run.tables
    hf = HostFilter(t) if hf is None else hf
    A, Ls, e, const, T, Qb = (np.asarray(x, dtype=np.float64) for x in _filter_inputs_jit(theta, run))
    S, Kd, s0 = t.n_states, t.K * t.d, t.sde_offset
    Pinf = np.stack([stationary_cov(t.kernel, float(ell), np) for ell in np.asarray(theta["lengthscales"])])
    m0, P0 = np.zeros(S), np.zeros((S, S))
    P0[s0:s0 + Kd, s0:s0 + Kd] = np.einsum("kij,kl->ikjl", Pinf, np.eye(t.K)).reshape(Kd, Kd)
    hf.predict_step(m0, P0, -1, T, qy(Qb, np))
    return A, Ls, e, const, T, Qb, m0, P0


def _first_sub_steps(t: RunTables) -> np.ndarray:
    """(n_blocks,) index of each block's first sub-step (every block has at least one)."""
    idx = np.asarray(t.block_index)
    first = np.full(t.n_blocks, -1, dtype=np.int64)
    real = np.flatnonzero(np.r_[True, idx[1:] != idx[:-1]])
    first[idx[real]] = real
    return first


def smooth_run(theta, run: SSRun, *, nodes: bool = True, grid: bool = True) -> RunSmooth:
    """Smoothed moments of one run: node values (``nodes``) and grid values (``grid``).

    One forward pass of :class:`.host.HostFilter` that keeps the chunk-start states, then the reverse pass, one
    chunk recomputed at a time, one sub-step at a time so that the adjoints before each block's first sub-step
    can be read (the adjoints of the weights, which nothing here needs, are not formed).

    Args:
        theta: constrained parameter pytree (:func:`msrm.gp.model.params_to_theta`).
        run: one prepared run of the state-space backend.
    """
    run = sequential_run(run)
    t = run.tables
    hf = HostFilter(t)
    A, Ls, e, const, T, Qb, m0, P0 = filter_inputs(theta, run, hf)
    # the same filter with one sub-step per chunk: its reverse over "chunk" i is the reverse over sub-step i alone
    step = HostFilter(dataclasses.replace(t, chunk=1, n_chunks=int(t.block_index.size)))
    K, C, S = t.K, t.block, t.n_states
    Qy = qy(Qb, np)
    first = _first_sub_steps(t) if grid else np.zeros(0, np.int64)
    block_of_first = {int(i): b for b, i in enumerate(first)}
    grid_mean = np.zeros((t.n_blocks * C, K)) if grid else None
    grid_cov = np.zeros((t.n_blocks * C, K, K)) if grid else None
    Lsb, eb = np.zeros_like(Ls), np.zeros_like(e)
    Tb, Qbb = np.zeros_like(T), np.zeros_like(Qb)
    mb, Pb = np.zeros(S), np.zeros((S, S))

    def reverse_chunk(c, kept):
        """The reverse pass over chunk c, one sub-step at a time; block b's grid values are read before its
        first sub-step."""
        for j in reversed(range(len(kept))):
            i = c * t.chunk + j
            k = kept[j]
            step.reverse_chunk(i, [k], T, 1.0, Lsb, eb, Tb, Qbb, mb, Pb)
            b = block_of_first.get(i)
            if b is not None:
                _grid_block(k["m"], k["P"], mb, Pb, hf.ring_row(b), C, K, grid_mean[b * C:(b + 1) * C],
                            grid_cov[b * C:(b + 1) * C])
            kept[j] = None

    args = (A, Ls, e, T, Qy)
    # as in HostFilter.backward: with two cores and enough work per sub-step, chunk c - 1 is recomputed on a second
    # thread while the reverse pass walks back through chunk c (BLAS and most NumPy loops release the GIL)
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="msrm-smooth") if (
        t.n_chunks > 2 and hf.pipeline_pays and runtime.physical_cores() >= 2) else None
    with one_blas_thread():
        ll, _, sm, sP, last = hf.forward(A, Ls, e, T, Qb, m0, P0, keep_starts=True, keep_last=True)
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
                reverse_chunk(c, kept)
        finally:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
    loglik = -0.5 * float(const) + float(ll)
    node_mean = node_cov = None
    if nodes:
        node_mean, node_cov = node_moments(t, Lsb, eb, run.gp.layout.n_nodes)
    J = t.n_steps
    return RunSmooth(loglik, node_mean, node_cov, None if grid_mean is None else grid_mean[:J],
                     None if grid_cov is None else grid_cov[:J])


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


def _grid_block(m, P, mb, Pb, r, C, K, out_mean, out_cov):
    """Smoothed moments of the C K ring rows ``r .. r + C K - 1`` (block b's grid values) from the filtered state
    ``(m, P)`` before the block's first sub-step and the adjoints ``(m̄, P̄)`` there (see the module docstring);
    writes the (C, K) means and (C, K, K) blocks."""
    Pr = P[r:r + C * K]  # (C K, S)
    g = Pr @ mb
    cov = P[r:r + C * K, r:r + C * K] + 2.0 * (Pr @ Pb) @ Pr.T - np.outer(g, g)
    out_mean[:] = (m[r:r + C * K] + g).reshape(C, K)
    c4 = cov.reshape(C, K, C, K)
    idx = np.arange(C)
    blocks = c4[idx, :, idx, :]
    out_cov[:] = 0.5 * (blocks + np.swapaxes(blocks, -1, -2))


def node_moments(t: RunTables, Lsb: np.ndarray, eb: np.ndarray, n_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """Per node ``E[x_u | Y] = η̄_u`` (N, K) and ``Cov[x_u | Y] = -2 Λ̄_u - η̄_u η̄_u^T`` (N, K, K) from the
    adjoints of the slots' ``η`` (T, M K) and ``Λ`` blocks (T, M, K, K) (each node fills one slot)."""
    K = t.K
    glob = np.concatenate([np.asarray(g.slot_global) for g in t.groups], axis=1)  # (T, M); n_nodes = padding
    real = glob < n_nodes
    nodes = glob[real]
    if nodes.size != n_nodes or np.unique(nodes).size != n_nodes:  # pragma: no cover - prepare guarantees it
        raise ValueError(f"state-space tables: {nodes.size} node slots for {n_nodes} nodes")
    mean = np.zeros((n_nodes, K))
    second = np.zeros((n_nodes, K, K))
    mean[nodes] = eb.reshape(glob.shape + (K,))[real]
    L = Lsb[real]
    second[nodes] = -(L + np.swapaxes(L, -1, -2))
    cov = second - mean[:, :, None] * mean[:, None, :]
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
