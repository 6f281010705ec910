r"""The dense and grouped GP-MSRM log likelihoods (pure JAX, float64).

Per run, nodes ``u = 1..N`` (one per distinct (response group, sample time); ``dense`` makes every
(stream, sample) its own node), grid ``tau_1..tau_J`` and factors ``k = 1..K``. Node ``u`` sees
``x_u = (a_u^T z_k)_k`` with ``a_u`` its response row, and the prior ``z_k ~ N(0, K_k)`` gives
``x_k = A z_k ~ N(0, C_k)``, ``C_k = A K_k A^T`` (N x N, rank <= J: singular whenever N > J, so it is never
inverted). Observations are ``y = b + W x_u + eps``, ``eps ~ N(0, sigma^2)``.

**Sufficient statistics** (:func:`node_information`), per stream ``s`` with ``P_s = diag(1 / sigma_s^2)``,
data centred per feature on its observed mean ``c`` (``Y^0 = m (y - c)``, :mod:`msrm.gp.prepare`) and
``d = b - c``:

.. math::

    E_s = Y^0_s (P_s W_s) - M_s (P_s\, d_s \odot W_s)  \quad (n_s, K), \qquad
    \eta_u = \sum_{(s,i) \to u} E_{s,i}, \qquad
    \Lambda_u = \sum_{(s,i) \to u} W_s^\top \mathrm{diag}(m_{si}) P_s W_s,

matrix products over features then a sum of *samples* into nodes (never a scatter per observation). Without
missing values every sample of a stream adds the same ``W^T P W``, so ``Lambda = sum_s counts_s ⊗ W_s^T P_s W_s``.
``log|D| = sum_f n_f log sigma_f^2``.

**Woodbury in node space, whitened.** With ``Lambda_u = R_u^T R_u`` (see :mod:`msrm.gp.prepare` for the static
choice of ``R_u``), ``R = blockdiag(R_u)``, ``C = blockdiag_k(C_k)`` in (u, k) order, the whitened node data
``y~`` (``R_u^T y~_u = eta_u``) and each node's least-squares fit ``x_u`` (``R_u x_u = y~_u``)
(:func:`node_least_squares`):

.. math::

    M = I + R C R^\top, \qquad
    \log p(y) = -\tfrac12\big[n_{obs}\log 2\pi + \log|D| + \rho + \tilde y^\top M^{-1} \tilde y + \log|M|\big],
    \qquad \rho = \sum m\, (y - b - W x_u)^2 / \sigma^2,

from ``eta^T (C^{-1} + Lambda)^{-1} eta = y~^T (I - M^{-1}) y~`` (substitute ``eta = R^T y~`` in
``C - C R^T M^{-1} R C``), ``rho = r^T D^-1 r - y~^T y~`` and ``|D + H C H^T| = |D| |M|``; ``M`` has eigenvalues
``>= 1``. ``(R C R^T)[(u,a),(v,b)] = sum_k R_u[a,k] C_k[u,v] R_v[b,k]``. ``y~^T M^{-1} y~`` and ``log|M|`` come
from :func:`msrm.gp.linalg.quad_logdet` (guarded Cholesky, custom reverse rule), whose event code is returned.

**Why this form.** Every term above is non-negative and of the size of the answer, so nothing cancels. The
textbook arrangement ``r^T D^-1 r - eta^T C eta + v^T M^-1 v`` (``v = R C eta``) subtracts terms that grow with
the square of the signal-to-noise ratio (``eta^T C eta`` is about ``n (w / sigma)^4``) to leave one of order
``n``: an absolute error of about ``eps n (w / sigma)^4`` nats, past a nat once ``w / sigma`` reaches ``1e4``. ``rho`` is summed value by
value (:func:`residual_sum_of_squares`, one pass over the data like ``E``) rather than as the difference
``r^T D^-1 r - y~^T y~``, so its derivative in ``sigma`` is exact too; and centring keeps ``y - b`` exact when the
data sit on a large offset (raw scanner units). ``r^T D^-1 r`` itself, from the centred sums, is still returned
by :func:`node_information` for the state-space filter.

**One evaluator for one run or a stack of runs.** A run is evaluated from two parts: a static **shape
signature** (:class:`Signature`: factor count, kernel, factorization method, grid length ``J``, node count ``N``,
per response group its node range, window width and chunking, per stream its feature count, sample count,
missing-value flag and low-count-row count, and whether any node needs a Cholesky factor) and **per-run arrays**
(:class:`RunArrays`: window offsets and starts, sample-to-node maps, per-node sample counts, the rows and features
that fill low-count factors, the Cholesky-node mask, the centred data ``Y0``, mask, ``S1``, ``S2``, ``n_f``, the
centres and ``n_obs``). :func:`run_loglik_arrays` is the density of one run in this form. Runs of equal signature are stacked
along a leading axis and evaluated by one ``jax.vmap`` of it (:class:`MultiRunPrepared`, built by
:func:`msrm.gp.multirun.stack_runs`, which also pads runs of nearly equal size to one signature and places the
stacks on devices). A per-run :class:`~msrm.gp.prepare.Prepared` is evaluated as one stack of one run per run:
the signature is that run's own (nothing padded) and its static arrays stay NumPy constants of the trace, so each
run's layout is baked into the graph. :func:`node_information`, :func:`response_matrix`, :func:`node_covariance`
and :func:`run_loglik` are that one-run form of a prepared run.

The ``"dense"`` and ``"grouped"`` backends (:mod:`msrm.gp.grouped`) call
``loglik(theta, prepared) -> (value, events)`` with ``theta`` the constrained pytree
``{"loadings": {key: (F, K)}, "intercepts": {key: (F,)}, "noise_sd": {key: (F,)}, "lengthscales": (K,),
"response": {param_key: {"lag": ..., "width": ...}}}`` and ``events`` (n_runs,) int32; ``run_logliks(theta,
prepared)`` gives the per-run values.

**Devices.** When a :class:`MultiRunPrepared` holds a mesh, each stack's run axis is sharded over a one-axis
``Mesh(devices, ("runs",))`` and evaluated inside ``jax.shard_map`` (``check_vma=False``: values coming out of
custom-derivative rules carry no per-device type annotation); the per-run values are gathered and summed by XLA.
On XLA:CPU the stacked runs go through :func:`msrm.gp.linalg.per_item_on_cpu` (``lax.map``, one run at a time)
and the per-node factors through :func:`msrm.gp.linalg.small_cholesky`, so no batched LAPACK kernel is called
(see :mod:`msrm.gp.multirun` for why).
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..operators import WindowLayout, jax_window_weights
from ..responses import Response
from . import banded, linalg
from .kernels import kernel_matrices
from .prepare import RunLayout, RunPrepared, prepare

__all__ = [
    "AXIS",
    "group_theta",
    "GroupShape",
    "StreamShape",
    "Signature",
    "GroupArrays",
    "StreamArrays",
    "RunArrays",
    "Bucket",
    "MultiRunPrepared",
    "signature",
    "run_arrays",
    "accumulate_node_statistics",
    "node_information_arrays",
    "group_weights",
    "response_matrix_arrays",
    "node_covariance_arrays",
    "covariance_from_response",
    "node_woodbury_matrix",
    "node_least_squares",
    "residual_sum_of_squares",
    "node_data_arrays",
    "node_data",
    "woodbury_system",
    "woodbury_loglik",
    "run_loglik_arrays",
    "node_information",
    "response_matrix",
    "node_covariance",
    "run_loglik",
    "run_logliks",
    "grouped_loglik",
    "prepare",
    "loglik",
]

AXIS = "runs"

_LOG_2PI = math.log(2.0 * math.pi)


def group_theta(theta, group) -> dict:
    """The response parameters of one group (``{}`` for a parameter-free response)."""
    if group.param_key is None:
        return {}
    return theta["response"][group.param_key]


# ------------------------------------------------------------------------------------------ the stack form


class GroupShape(NamedTuple):
    """Static shape of one response group: nodes ``node_start .. node_start + n_nodes - 1``."""

    key: str
    response: Response
    param_key: str | None
    node_start: int
    n_nodes: int
    width: int
    chunks: Any = None  # msrm.gp.banded.ChunkShape for the chunked covariance products, or None


class StreamShape(NamedTuple):
    """Static shape of one stream (sample and low-row counts: the largest of the runs that share it)."""

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


class StreamArrays(NamedTuple):
    """The arrays of one stream that the node statistics read (one run; leading run axis when stacked).

    Fields: ``Y0`` (n_s, F) values centred on ``centre`` with NaN -> 0 (:mod:`msrm.gp.prepare`); ``mask``
    (n_s, F) or None; ``S1``, ``S2``, ``n_f``, ``centre`` (F,) centred data sums and the centre; ``sample_nodes`` (n_s,) node of each sample (``N`` for padding: dropped); ``node_counts`` (N,) samples
    per node; ``low_rows`` (e,) rows of the flattened (N K, K) factor filled by low-count values (past the end for
    padding: dropped); ``low_feats`` (e,) their features.
    """

    Y0: Any
    mask: Any
    S1: Any
    S2: Any
    n_f: Any
    centre: Any
    sample_nodes: Any
    node_counts: Any
    low_rows: Any
    low_feats: Any


class RunArrays(NamedTuple):
    """The arrays of one run: n_obs (); chol_mask (N,); groups, streams (tuples in signature order)."""

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
    """A dataset prepared for the stacked likelihood (built by :func:`msrm.gp.multirun.stack_runs`).

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


def _group_sizes(layout: RunLayout) -> list[int]:
    return [g.node_stop - g.node_start for g in layout.groups]


def signature(layouts: Sequence[RunLayout]) -> Signature:
    """The common signature of runs of one structure (NumPy): every group and stream padded to the largest.

    Args:
        layouts: the runs' :class:`~msrm.gp.prepare.RunLayout` (equal structure: same groups, window widths and
            streams; sizes may differ).
    """
    first = layouts[0]
    n_g = [max(s) for s in zip(*(_group_sizes(lay) for lay in layouts))]
    starts = np.concatenate([[0], np.cumsum(n_g)[:-1]]).astype(int)
    n_grid = max(lay.n_grid for lay in layouts)
    chunks = [banded.chunk_shape([lay.groups[i].window.start for lay in layouts], g.window.width, n_grid, int(n))
              for i, (g, n) in enumerate(zip(first.groups, n_g))]
    if not banded.worthwhile(chunks, n_grid):
        chunks = [None] * len(chunks)
    groups = tuple(GroupShape(g.key, g.response, g.param_key, int(s), int(n), g.window.width, c)
                   for g, s, n, c in zip(first.groups, starts, n_g, chunks))
    streams = []
    for key, F in sorted((sl.key, sl.n_features) for sl in first.streams):
        per = [next(sl for sl in lay.streams if sl.key == key) for lay in layouts]
        streams.append(StreamShape(key, F, max(sl.sample_nodes.size for sl in per),
                                   any(sl.has_missing for sl in per), max(sl.low_rows.size for sl in per)))
    return Signature(
        n_factors=first.n_factors, kernel=first.kernel, method=first.method, grouped=first.grouped,
        n_grid=n_grid, n_nodes=int(sum(n_g)),
        grid_step=float(first.groups[0].window.grid_step) if first.groups else 0.0,
        has_chol=any(lay.chol_nodes.size for lay in layouts), groups=groups, streams=tuple(streams),
    )


def _pad_rows(x, n: int, fill):
    """``x`` with rows appended up to ``n`` rows: copies of row 0 (``fill="first"``) or the value ``fill``.
    ``x`` itself (possibly a traced array) when it already has ``n`` rows."""
    pad = n - x.shape[0]
    if pad == 0:
        return x
    extra = np.repeat(x[:1], pad, axis=0) if isinstance(fill, str) else np.full((pad,) + x.shape[1:], fill, x.dtype)
    return np.concatenate([x, extra], axis=0)


def _new_nodes(layout: RunLayout, sig: Signature) -> np.ndarray:
    """Node of the run -> node of the padded table (each group's nodes first, its dummy nodes after)."""
    new_node = np.empty(layout.n_nodes, dtype=np.int64)
    for gs, gl in zip(sig.groups, layout.groups):
        new_node[gl.node_start:gl.node_stop] = gs.node_start + np.arange(gl.node_stop - gl.node_start)
    return new_node


def _group_arrays(layout: RunLayout, sig: Signature) -> tuple:
    out = []
    for gs, gl in zip(sig.groups, layout.groups):
        w = gl.window
        out.append(GroupArrays(
            start=_pad_rows(w.start.astype(np.int64), gs.n_nodes, "first"),
            delta=_pad_rows(w.delta, gs.n_nodes, "first"),
            valid=_pad_rows(w.valid, gs.n_nodes, "first"),
            real=_pad_rows(np.ones(gl.node_stop - gl.node_start), gs.n_nodes, 0.0),
        ))
    return tuple(out)


def run_arrays(run: RunPrepared, sig: Signature) -> RunArrays:
    """One run's arrays padded to ``sig``.

    The static parts (windows, node maps, low-count rows) are NumPy; the data (``Y0``, mask, ``S1``, ``S2``,
    ``n_f``) are taken as they are when no padding is needed (they may be traced), else padded with NumPy.
    """
    lay = run.layout
    K, N = sig.n_factors, sig.n_nodes
    new_node = _new_nodes(lay, sig)
    chol_mask = np.zeros(N)
    chol_mask[new_node[lay.chol_nodes]] = 1.0
    by_key = {sl.key: (sl, st) for sl, st in zip(lay.streams, run.streams)}
    streams = []
    for ss in sig.streams:
        sl, st = by_key[ss.key]
        counts = np.zeros(N)
        counts[new_node] = sl.node_counts
        mask = None
        if ss.has_missing:  # a run without missing values stacked with one that has some: a mask of ones
            mask = _pad_rows(st.mask if st.mask is not None else np.ones_like(st.Y0), ss.n_samples, 0.0)
        e = sl.low_rows.size
        low_rows = np.concatenate([new_node[sl.low_rows // K] * K + sl.low_rows % K,
                                   N * K + np.arange(ss.n_low - e)]).astype(np.int64)
        streams.append(StreamArrays(
            Y0=_pad_rows(st.Y0, ss.n_samples, 0.0), mask=mask, S1=st.S1, S2=st.S2, n_f=st.n_f,
            centre=st.centre,
            sample_nodes=_pad_rows(new_node[sl.sample_nodes], ss.n_samples, N),
            node_counts=counts, low_rows=low_rows,
            low_feats=_pad_rows(sl.low_feats.astype(np.int64), ss.n_low, 0),
        ))
    return RunArrays(n_obs=np.float64(lay.n_obs), chol_mask=chol_mask, groups=_group_arrays(lay, sig),
                     streams=tuple(streams))


# The signature and window arrays of a run evaluated on its own, by layout (layouts are immutable and compared
# by identity; the entry goes with the layout).
_OWN: "weakref.WeakKeyDictionary[RunLayout, tuple]" = weakref.WeakKeyDictionary()


def _own_stack(layout: RunLayout) -> tuple[Signature, tuple]:
    """(signature, group arrays) of a run as a stack of one: its own sizes, nothing padded."""
    hit = _OWN.get(layout)
    if hit is None:
        sig = signature([layout])
        hit = _OWN[layout] = (sig, _group_arrays(layout, sig))
    return hit


def _own_arrays(run: RunPrepared) -> tuple[Signature, RunArrays]:
    sig, _ = _own_stack(run.layout)
    return sig, run_arrays(run, sig)


# ------------------------------------------------------------------------------------------ node statistics


def accumulate_node_statistics(theta, streams, n_nodes: int, n_factors: int, n_obs):
    """The sums behind every grouped likelihood: ``Lambda``, ``eta``, the low-count rows of ``R`` and ``const``.

    Args:
        theta: constrained parameter pytree.
        streams: iterable of ``(static, arrays)``: ``static`` a :class:`StreamShape` (``key``,
            ``has_missing``, ``n_features``), ``arrays`` a :class:`StreamArrays`.
        n_nodes, n_factors: N and K. n_obs: observed value count (int or traced).
    Returns:
        Lambda (N, K, K), eta (N, K), R_rows (N K, K) filled at low-count nodes only, ``log_terms`` ()
        ``n_obs log 2 pi + log|D|`` and ``rdr`` () ``r^T D^-1 r`` (from the centred sums).
    """
    N, K = n_nodes, n_factors
    Lam = jnp.zeros((N, K, K))
    eta = jnp.zeros((N, K))
    R_rows = jnp.zeros((N * K, K))
    log_terms = n_obs * _LOG_2PI
    rdr = 0.0
    for ss, st in streams:
        W = theta["loadings"][ss.key]
        sd = theta["noise_sd"][ss.key]
        d = theta["intercepts"][ss.key] - st.centre  # the intercept about the data's centre (see prepare)
        prec = 1.0 / (sd * sd)
        WP = W * prec[:, None]  # (F, K)
        if ss.has_missing:
            E = st.Y0 @ WP - st.mask @ (d[:, None] * WP)
            outer = (W[:, :, None] * WP[:, None, :]).reshape(ss.n_features, K * K)
            Lam = Lam + jax.ops.segment_sum(st.mask @ outer, st.sample_nodes, num_segments=N).reshape(N, K, K)
        else:
            E = st.Y0 @ WP - (d @ WP)[None, :]
            Lam = Lam + jnp.asarray(st.node_counts)[:, None, None] * (W.T @ WP)[None, :, :]
        eta = eta + jax.ops.segment_sum(E, st.sample_nodes, num_segments=N)  # samples at node >= N dropped
        rdr = rdr + jnp.sum((st.S2 - 2.0 * d * st.S1 + st.n_f * d * d) * prec)
        log_terms = log_terms + jnp.sum(st.n_f * jnp.log(sd * sd))
        if st.low_rows.size:
            R_rows = R_rows.at[st.low_rows].set(W[st.low_feats] / sd[st.low_feats, None], unique_indices=True,
                                                mode="drop")
    return Lam, eta, R_rows, log_terms, rdr


def _node_statistics(theta, sig: Signature, arrays: RunArrays):
    """(Lambda, eta, R, log_terms, rdr) of one run: :func:`accumulate_node_statistics` with the factors ``R``."""
    N, K = sig.n_nodes, sig.n_factors
    terms = zip(sig.streams, arrays.streams)
    Lam, eta, R_rows, log_terms, rdr = accumulate_node_statistics(theta, terms, N, K, arrays.n_obs)
    R = R_rows.reshape(N, K, K)
    if sig.has_chol:
        m = arrays.chol_mask[:, None, None]
        # identity where no Cholesky factor is wanted, so every factorization is finite (and its branch unused)
        L = linalg.small_cholesky(Lam + (1.0 - m) * jnp.eye(K))
        R = jnp.where(m > 0, jnp.swapaxes(L, -1, -2), R)
    return Lam, eta, R, log_terms, rdr


def node_information_arrays(theta, sig: Signature, arrays: RunArrays):
    """Per-node sufficient statistics of one run in the stack form (no run axis).

    Args:
        theta: constrained parameter pytree. sig: the run's (or its stack's) signature. arrays: its arrays.
    Returns:
        Lambda: (N, K, K) node information matrices ``sum W^T diag(m / sigma^2) W``.
        eta: (N, K) ``sum W^T diag(m / sigma^2) (y - b)``.
        R: (N, K, K) factors with ``R_u^T R_u = Lambda_u`` (rows ``w_f / sigma_f`` at low-count nodes,
            ``chol(Lambda_u)^T`` elsewhere).
        const: scalar ``n_obs log 2 pi + log|D| + r^T D^-1 r``.
        Dummy nodes of a padded run have ``Lambda = 0``, ``eta = 0``, ``R = 0``.
    """
    Lam, eta, R, log_terms, rdr = _node_statistics(theta, sig, arrays)
    return Lam, eta, R, log_terms + rdr


def residual_sum_of_squares(theta, streams, x, n_nodes: int):
    """``sum m (y - b - W x_u)^2 / sigma^2`` over every observed value, formed value by value.

    Args:
        theta: constrained parameters. streams: iterable of ``(StreamShape, StreamArrays)``. x: (N, K) one
            latent vector per node. n_nodes: N (samples mapped to node N are padding and count zero).
    Returns:
        () float64. With ``x`` the per-node least-squares fit (:func:`node_least_squares`) this is the
        within-node residual ``r^T D^-1 r - y~^T y~``, without the cancellation of that difference.
    """
    total = 0.0
    for ss, st in streams:
        W = theta["loadings"][ss.key]
        sd = theta["noise_sd"][ss.key]
        d = theta["intercepts"][ss.key] - st.centre
        X = x.at[st.sample_nodes].get(mode="fill", fill_value=0.0)  # (n_s, K)
        e = st.Y0 - d[None, :] - X @ W.T  # (y - c) - (b - c) - W x, per value
        weight = st.mask if ss.has_missing else (st.sample_nodes < n_nodes)[:, None].astype(e.dtype)
        e = e * weight
        total = total + jnp.sum((e * e) @ (1.0 / (sd * sd)))
    return total


def node_data_arrays(theta, sig: Signature, arrays: RunArrays):
    """What the node-space density reads from the data, in its accurate form (module docstring).

    Returns:
        y: (N, K) whitened node data (:func:`node_least_squares`).
        R: (N, K, K) node factors (:func:`node_information_arrays`).
        data_term: () ``n_obs log 2 pi + log|D| + sum m (y - b - W x_u)^2 / sigma^2`` with ``x_u`` each node's
            least-squares fit.
    """
    _, eta, R, log_terms, _ = _node_statistics(theta, sig, arrays)
    y, x = node_least_squares(eta, R)
    rss = residual_sum_of_squares(theta, zip(sig.streams, arrays.streams), x, sig.n_nodes)
    return y, R, log_terms + rss


# ------------------------------------------------------------------------------------------ node covariance


def group_weights(theta, sig: Signature, gs: GroupShape, ga: GroupArrays):
    """Window weights (n_g, w) of one group of a run; zero rows for dummy nodes."""
    layout = WindowLayout(start=ga.start, width=gs.width, delta=ga.delta, valid=ga.valid,
                          grid_step=sig.grid_step, n_grid=sig.n_grid)
    return jax_window_weights(group_theta(theta, gs), gs.response, layout) * ga.real[:, None]


def response_matrix_arrays(theta, sig: Signature, arrays: RunArrays):
    """Response rows ``A`` (N, J) of one run; rows of dummy nodes are zero."""
    return _response_rows(theta, sig, arrays.groups)


def _response_rows(theta, sig: Signature, groups: tuple):
    A = jnp.zeros((sig.n_nodes, sig.n_grid))
    for gs, ga in zip(sig.groups, groups):
        a = group_weights(theta, sig, gs, ga)
        rows = np.repeat(np.arange(gs.node_start, gs.node_start + gs.n_nodes), gs.width)
        cols = (ga.start[:, None] + jnp.arange(gs.width)[None, :]).reshape(-1)
        A = A.at[rows, cols].set(a.reshape(-1), unique_indices=True)
    return A


def node_covariance_arrays(theta, sig: Signature, dist, arrays: RunArrays):
    """Node covariances ``C_k = A K_k A^T``, (K, N, N), of one run from its grid distances (J, J) and arrays.

    Where the signature chunks every group (nodes ordered in time, windows narrow against the grid: the grouped
    layout of a recording), by chunked window products (:mod:`msrm.gp.banded`, a fraction of the flops, no dense
    response matrix); otherwise by dense products (``T = A K_k`` then ``T A^T``). Both agree to rounding.
    """
    return _covariance(theta, sig, dist, arrays.groups)


def _covariance(theta, sig: Signature, dist, groups: tuple):
    Kk = kernel_matrices(dist, theta["lengthscales"], sig.kernel)
    if sig.groups and all(gs.chunks is not None for gs in sig.groups):
        shapes = tuple(gs.chunks for gs in sig.groups)
        windows = tuple(banded.chunk_windows(group_weights(theta, sig, gs, ga), ga.start, gs.chunks, sig.n_grid)
                        for gs, ga in zip(sig.groups, groups))
        return banded.chunked_covariance(shapes, windows, Kk)
    return covariance_from_response(_response_rows(theta, sig, groups), Kk)


@jax.custom_vjp
def covariance_from_response(A, Kk):
    """``C_k = A K_k A^T``: (K, N, N) from response rows ``A`` (N, J) and prior correlations ``Kk`` (K, J, J).

    ``Kk`` must be symmetric (kernel matrices are). The reverse rule is that of ``A sym(K_k) A^T`` and uses the
    symmetry to need three products per factor instead of four: with ``S_k = (Cbar_k + Cbar_k^T)/2`` and
    ``U_k = S_k A``, ``Kbar_k = A^T U_k`` and ``Abar = 2 sum_k U_k K_k``.
    """
    T = jnp.einsum("uj,kji->kui", A, Kk)
    return jnp.einsum("kui,vi->kuv", T, A)


def _cov_fwd(A, Kk):
    return covariance_from_response(A, Kk), (A, Kk)


def _cov_bwd(res, Cbar):
    A, Kk = res
    S = 0.5 * (Cbar + jnp.swapaxes(Cbar, -1, -2))
    U = jnp.einsum("kuv,vj->kuj", S, A)  # (K, N, J)
    Kbar = jnp.einsum("uj,kui->kji", A, U)
    Abar = 2.0 * jnp.einsum("kui,kij->uj", U, Kk)
    return Abar, Kbar


covariance_from_response.defvjp(_cov_fwd, _cov_bwd)


@jax.custom_vjp
def node_woodbury_matrix(R, C):
    r"""``(R C R^T)[(u,a),(v,b)] = sum_k R_u[a,k] C_k[u,v] R_v[b,k]`` as (N, K, N, K), for symmetric ``C_k``.

    Forward: K fused elementwise outer products ``(r_k r_k^T) * (C_k ⊗ 1)`` (an einsum lowers to N batched
    K x K products with transposes of (NK)^2 arrays on XLA:CPU, several times slower).

    Reverse rule (hand-written: autodiff of the broadcasts reduces the (NK)^2 cotangent over strided axes once
    per factor and operand). It requires a **symmetric** cotangent ``G`` - the only one it receives: ``M``
    feeds :func:`msrm.gp.linalg.quad_logdet`, whose cotangent is symmetric by construction - which halves the
    work (the row and column contractions coincide). With ``Y[k,u,a,v] = sum_b G[u,a,v,b] R_v[b,k]`` (one pass
    over ``G`` for every factor, written with ``v`` innermost so that both reductions run along contiguous
    rows):

    .. math::

        \bar C_k[u,v] = \sum_a R_u[a,k] Y[k,u,a,v], \qquad \bar R_u[a,k] = 2 \sum_v C_k[u,v] Y[k,u,a,v].

    ``C_k`` symmetric is required for the second formula (the model's ``A K_k A^T`` is, to rounding).
    """
    out = 0.0
    for k in range(R.shape[-1]):
        r = R[:, :, k]
        # C * (r r^T): the product commutes exactly, so a bitwise-symmetric C gives a bitwise-symmetric result
        out = out + C[k][:, None, :, None] * (r[:, :, None, None] * r[None, None, :, :])
    return out


def _woodbury_fwd(R, C):
    return node_woodbury_matrix(R, C), (R, C)


def _woodbury_bwd(res, G):
    R, C = res
    Rt = jnp.transpose(R, (2, 0, 1))  # Rt[k, u, a] = R_u[a, k]
    # the sum over b as K strided slices of G (a reduction over an axis of length K is several times slower)
    Y = sum(G[None, :, :, :, b] * Rt[:, None, None, :, b] for b in range(R.shape[-1]))  # (K, N, K, N)
    Cbar = jnp.sum(Rt[:, :, :, None] * Y, axis=2)
    Rbar = 2.0 * jnp.sum(C[:, :, None, :] * Y, axis=-1)  # (K, N, K): [k, u, a]
    return jnp.transpose(Rbar, (1, 2, 0)), Cbar


node_woodbury_matrix.defvjp(_woodbury_fwd, _woodbury_bwd)


def node_least_squares(eta, R):
    """Per node, the whitened data ``y~`` (N, K) and the least-squares latent fit ``x`` (N, K).

    ``y~_u`` solves ``R_u^T y~_u = eta_u`` and ``x_u`` solves ``R_u x_u = y~_u`` (so ``Lambda_u x_u = eta_u``):
    ``x_u`` is the node's own weighted least-squares estimate of its latent vector and ``y~_u`` its data in the
    coordinates where the noise is white. Where ``R_u`` is an upper-triangular factor with a non-zero diagonal
    (``chol(Lambda_u)^T``) both are triangular solves. Otherwise (a low-count node: at most K stacked rows
    ``w_f / sigma_f``, zero rows padding; or a padding node, all zero) the minimum-norm solutions with
    ``G_u = R_u R_u^T + Z_u``, ``Z_u`` the indicator of the zero rows: ``y~_u = G_u^{-1} R_u eta_u`` (unique:
    ``eta_u`` lies in the row space of ``R_u``; on those rows ``y~_u`` is each value's ``(y - b) / sigma``) and
    ``x_u = R_u^T G_u^{-1} y~_u``, which fits those values exactly. Every solve is K x K, unrolled over the
    batch of nodes (no LAPACK call).
    """
    K = R.shape[-1]
    eye = jnp.eye(K)
    diag = jnp.diagonal(R, axis1=-2, axis2=-1)
    tri = jnp.all(jnp.tril(R, -1) == 0, axis=(-2, -1)) & jnp.all(diag != 0, axis=-1)  # (N,)
    t1, t3 = tri[:, None], tri[:, None, None]
    U = jnp.where(t3, R, eye)  # upper triangular
    y_tri = linalg.small_lower_solve(jnp.swapaxes(U, -1, -2), eta)
    x_tri = linalg.small_upper_solve(U, y_tri)
    Rg = jnp.where(t3, 0.0, R)
    zero_rows = jnp.where(t1, 1.0, jnp.all(R == 0, axis=-1).astype(R.dtype))  # (N, K)
    Lg = linalg.small_cholesky(jnp.einsum("uak,ubk->uab", Rg, Rg) + zero_rows[:, :, None] * eye)

    def gram_solve(b):
        return linalg.small_upper_solve(jnp.swapaxes(Lg, -1, -2), linalg.small_lower_solve(Lg, b))

    y_low = gram_solve(jnp.einsum("uak,uk->ua", Rg, jnp.where(t1, 0.0, eta)))
    x_low = jnp.einsum("uak,ua->uk", Rg, gram_solve(y_low))
    return jnp.where(t1, y_tri, y_low), jnp.where(t1, x_tri, x_low)


def woodbury_system(R, C):
    """The node-space matrices shared by the density and the latent conditional: ``(C, M)``.

    ``C`` (K, N, N) is returned exactly symmetric (``A K_k A^T`` is symmetric only to rounding), so that
    ``M = I + R C R^T`` (NK, NK) is bitwise symmetric and the factorization can skip its own symmetrisation.
    """
    N, K = R.shape[0], R.shape[-1]
    C = 0.5 * (C + jnp.swapaxes(C, -1, -2))
    return C, jnp.eye(N * K) + node_woodbury_matrix(R, C).reshape(N * K, N * K)


def woodbury_loglik(y, R, C, data_term, method: str):
    """The node-space Woodbury log density of one run (module docstring).

    Args:
        y: (N, K) whitened node data. R: (N, K, K) node factors. C: (K, N, N) node covariances.
        data_term: scalar ``n_obs log 2 pi + log|D| + r^T D^-1 r - y^T y`` (the within-node residual).
        method: quad_logdet method.
    Returns:
        (value, event): float64 scalar, int32 scalar.
    """
    _, M = woodbury_system(R, C)
    quad, logdet, event = linalg.quad_logdet(M, y.reshape(-1), method=method, symmetric=True)
    return -0.5 * (data_term + quad + logdet), event


def run_loglik_arrays(theta, sig: Signature, dist, arrays: RunArrays):
    """Log likelihood and guard event of one run given its signature and arrays.

    Args:
        theta: constrained parameter pytree. sig: the stack's signature. dist: (J, J) grid distances.
        arrays: one run's :class:`RunArrays` (no run axis).
    Returns:
        (value, event): float64 scalar, int32 scalar.
    """
    y, R, data_term = node_data_arrays(theta, sig, arrays)
    C = node_covariance_arrays(theta, sig, dist, arrays)
    return woodbury_loglik(y, R, C, data_term, sig.method)


# ------------------------------------------------------------------------------------------ one prepared run


def node_information(theta, run: RunPrepared):
    """:func:`node_information_arrays` of one prepared run on its own: ``(Lambda, eta, R, const)`` with N its
    node count."""
    return node_information_arrays(theta, *_own_arrays(run))


def node_data(theta, run: RunPrepared):
    """:func:`node_data_arrays` of one prepared run on its own: ``(y~, R, data_term)``."""
    return node_data_arrays(theta, *_own_arrays(run))


def response_matrix(theta, layout: RunLayout):
    """Dense response rows ``A`` (N, J) of one prepared run."""
    sig, groups = _own_stack(layout)
    return _response_rows(theta, sig, groups)


def node_covariance(theta, layout: RunLayout):
    """Node covariances ``C_k = A K_k A^T``, (K, N, N), of one prepared run (:func:`node_covariance_arrays`)."""
    sig, groups = _own_stack(layout)
    return _covariance(theta, sig, layout.dist, groups)


def run_loglik(theta, run: RunPrepared):
    """Log likelihood of one prepared run and its guard event code (float64 scalar, int32 scalar)."""
    sig, arrays = _own_arrays(run)
    return run_loglik_arrays(theta, sig, run.layout.dist, arrays)


# ------------------------------------------------------------------------------------------ datasets


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


def _stacked_logliks(theta, prepared: MultiRunPrepared):
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


def run_logliks(theta, prepared):
    """Per-run log likelihoods ``(n_runs,)`` and event codes ``(n_runs,)`` int32, in the dataset's run order.

    ``prepared`` is a :class:`~msrm.gp.prepare.Prepared` (one stack of one run per run: :func:`run_loglik`
    traced once per run) or a :class:`MultiRunPrepared` (runs stacked by signature, one vmapped trace per stack,
    sharded over devices when it holds a mesh).
    """
    if isinstance(prepared, MultiRunPrepared):
        return _stacked_logliks(theta, prepared)
    out = [run_loglik(theta, run) for run in prepared.runs]
    return jnp.stack([v for v, _ in out]), jnp.stack([e for _, e in out]).astype(jnp.int32)


def grouped_loglik(theta, prepared):
    """Log likelihood summed over runs (dense or grouped, as prepared), with guard events.

    Args:
        theta: constrained parameter pytree (see the module docstring).
        prepared: a :class:`~msrm.gp.prepare.Prepared` or a :class:`MultiRunPrepared`.
    Returns:
        (value, events): float64 scalar, (n_runs,) int32 event codes of the factorizations.
    """
    values, events = run_logliks(theta, prepared)
    return jnp.sum(values), events


loglik = grouped_loglik
