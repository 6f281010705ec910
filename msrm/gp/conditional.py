r"""The exact Gaussian conditional of the latent factors in node space (dense and grouped layouts).

Notation of :mod:`msrm.gp.likelihood`, for one run: nodes ``u = 1..N`` with response rows ``A`` (N, J), node
information ``Lambda_u = R_u^T R_u`` and statistics ``eta`` (N, K) (:func:`~msrm.gp.likelihood.node_information`),
prior correlations ``K_k`` (J, J) on the grid, node covariances ``C_k = A K_k A^T`` and, in (u, k) order,

.. math::

    M = I + R C R^\top = L L^\top, \qquad R_u^\top \tilde y_u = \eta_u, \qquad w = L^{-1} \tilde y,

with ``y~`` the whitened node data (:func:`~msrm.gp.likelihood.node_least_squares`).

**Query points.** Any set of points ``q`` whose latent values are linear in Z, ``x_q = (b_q^T z_k)_k`` (grid points:
``b_q`` a unit vector; samples: their response rows), has prior covariance ``(B K_k B^T)`` per factor and cross
covariance with the node values ``X_k = A K_k B^T`` (N, n_q). With ``(R X)[(u,a),(q,k)] = R_u[a,k] X_k[u,q]`` and
``G = L^{-1} R X`` (N K, n_q K), the posterior given the data is

.. math::

    E[x_q] = G^\top w, \qquad
    \mathrm{Cov}[x_{qk}, x_{ql}] = \delta_{kl} (B K_k B^\top)_{qq} - \textstyle\sum_x G[x,(q,k)]\, G[x,(q,l)],

from ``Cov[z | y] = K - K A^T R^T M^{-1} R A K`` (Woodbury with ``(C^{-1} + Lambda)^{-1} = C - C R^T M^{-1} R
C``, never inverting the singular ``C``) and ``E[z | y] = K A^T alpha`` with ``alpha = (I + Lambda C)^{-1} eta =
R^T M^{-1} y~`` (since ``(I + R^T R C) R^T M^{-1} = R^T``). The mean is formed from ``alpha`` alone: the textbook
``K A^T (eta - R^T M^{-1} R C eta)`` subtracts two terms of the size of the data's signal-to-noise ratio to
leave one of the size of the latent, and loses that many digits; ``G^T w`` has no such cancellation. Only the K x K block of each
query point is formed (the column inner products of ``G`` within one point); a variance is clipped at 0 before
its square root (cancellation can leave a tiny negative where the data pin a value down).

Two query sets share :func:`moments`:

* every node (:func:`node_posterior`, for :mod:`msrm.gp.pointwise`): ``X_k = C_k``, prior variances
  ``diag C_k``;
* the grid (:func:`posterior_arrays`): ``X_k = A K_k`` (N, J), prior variance ``diag K_k = 1``, so ``G`` (N K, J K)
  is the solve with ``J K`` right-hand sides and the marginal sds are ``sqrt(1 - column norms^2)`` of ``G``.

**Predictions** of every sample, observed or not, come from the same grid solve. The prediction points are the
distinct (response group, sample time) pairs of *all* the run's samples (:func:`predict_query`; their rows ``B``
are built from the response's own windows, :func:`msrm.operators.window_layout`, so a sample with every feature
missing is predicted whether or not the likelihood's layout made it a node). Since ``x_q = B z``, their ``G`` is
``H = G B^T`` (contracting the grid axis) and :func:`moments` gives ``E[x_q]`` and ``Cov[x_q]``; a sample's
predictive is ``b + W E[x_q]`` with variance ``diag(W Cov[x_q] W^T) + sigma^2`` (the signal variance without
``sigma^2``).

**Cost** per run, with ``n = N K``: the guarded factorization of ``M`` (``n^3 / 3``), the products ``A K_k``
(``K N J^2``), the triangular solve with ``J K`` right-hand sides (``n^2 J K``, the largest term when ``J K`` is
comparable with ``n``), the contraction ``G B^T`` (``n J K n_q``, ``n_q`` about the grouped node count) and the
K x K blocks (``n (J + n_q) K^2``). Memory: ``M``, ``G`` and ``H``, (n, n), (n, J K) and (n, n_q K) float64.

**Compilation and reuse.** :func:`posterior_arrays` computes the grid posterior and the predictions of one run
in one graph. Its arguments are a per-run :class:`~msrm.gp.prepare.RunPrepared` and a :class:`PredictQuery`, both
carrying their static layout in the pytree structure (leafless nodes compared by identity), so a jitted copy
called with the same run objects and a parameter pytree of the same structure reuses the compiled graph: calling
once per posterior draw traces once per run. :func:`run_tables` builds,
and caches weakly keyed on the model's prepared object, what a model's calls reuse: the per-run prepared runs,
the prediction points, the model's jitted copy of :func:`posterior_arrays` and the result of the last evaluation
keyed on the bytes of the parameter values (``latent_posterior(params)`` followed by ``predict(params)``
evaluates once).

**Guard.** ``M`` has eigenvalues ``>= 1``; it is factorised by :func:`msrm.gp.linalg.native_factor` (Cholesky,
then the jitter ladder, then the eigenvalue fallback) and the event code of each run is returned with the result
(:func:`msrm.gp.linalg.describe_event` says what it means).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.linalg import solve_triangular

from ..nodes import prepare_nodes, response_groups
from ..operators import WindowLayout, jax_window_weights, window_layout
from . import linalg
from .kernels import kernel_matrices
from .likelihood import (group_theta, node_covariance, node_information, node_least_squares, response_matrix,
                         woodbury_system)
from .prepare import Prepared, RunPrepared, prepare

__all__ = [
    "TABLES",
    "NodeSystem",
    "node_system",
    "query_moments",
    "node_posterior",
    "QueryGroup",
    "PredictQuery",
    "predict_query",
    "solve_cross",
    "moments",
    "posterior_arrays",
    "RunTables",
    "run_tables",
    "evaluate",
    "check_theta",
]


class NodeSystem(NamedTuple):
    """The factorised node-space system of one run.

    Fields: eta (N, K); R (N, K, K) factors of ``Lambda_u``; C (K, N, N) node covariances (exactly symmetric);
    L (N K, N K) lower factor of ``M``; w (N K,) ``L^-1 y~``; event () int32 guard code.
    """

    eta: jax.Array
    R: jax.Array
    C: jax.Array
    L: jax.Array
    w: jax.Array
    event: jax.Array


def node_system(theta, run: RunPrepared) -> NodeSystem:
    """Node statistics, node covariances and the guarded factor of ``M`` for one prepared run."""
    _, eta, R, _ = node_information(theta, run)
    y, _ = node_least_squares(eta, R)
    C, M = woodbury_system(R, node_covariance(theta, run.layout))
    L, event = linalg.native_factor(M)  # M is bitwise symmetric (woodbury_system)
    w = solve_triangular(L, y.reshape(-1), lower=True)
    return NodeSystem(eta, R, C, L, w, event)


def solve_cross(system: NodeSystem, X):
    """``G = L^{-1} R X`` (N K, n_q, K) for prior cross covariances ``X`` (K, N, n_q) between nodes and query
    points: the triangular solve with ``n_q K`` right-hand sides."""
    N, K = system.eta.shape
    n_q = X.shape[2]
    # (R X)[(u, a), (q, k)] = R_u[a, k] X_k[u, q]
    RX = system.R[:, :, None, :] * jnp.transpose(X, (1, 2, 0))[:, None, :, :]
    return solve_triangular(system.L, RX.reshape(N * K, n_q * K), lower=True).reshape(N * K, n_q, K)


def moments(G, prior_var, w):
    """Posterior mean (n_q, K) and K x K blocks (n_q, K, K) at query points from ``G`` (N K, n_q, K), the prior
    variances (n_q, K) and ``w = L^-1 y~`` (N K,)."""
    K = G.shape[2]
    mean = jnp.einsum("xqk,x->qk", G, w)
    return mean, prior_var[:, :, None] * jnp.eye(K) - jnp.einsum("xqk,xql->qkl", G, G)


def query_moments(system: NodeSystem, X, prior_var):
    """Posterior mean (n_q, K) and K x K blocks (n_q, K, K) of the latent values at query points (module
    docstring), from their prior cross covariances ``X`` (K, N, n_q) with the nodes and prior variances
    (n_q, K)."""
    G = solve_cross(system, X)
    return moments(G, prior_var, system.w)


def node_posterior(theta, run: RunPrepared):
    """Posterior mean ``m`` (N, K) and K x K blocks ``Q_uu`` (N, K, K) of the node values, and the guard event.

    The query points are the nodes themselves: ``X_k = C_k``, prior variances ``diag C_k``.
    """
    system = node_system(theta, run)
    m, Q = query_moments(system, system.C, jnp.diagonal(system.C, axis1=1, axis2=2).T)
    return m, Q, system.event


# ------------------------------------------------------------------------------------------ query tables


@dataclass(frozen=True, eq=False)
class QueryGroup:
    """Query points of one response group: rows ``start .. start + n - 1`` of the run's query table.

    Fields: response; param_key (key into ``theta["response"]`` or None); start; window (WindowLayout at the
    points' times on the run's grid).
    """

    response: object
    param_key: str | None
    start: int
    window: WindowLayout


@dataclass(frozen=True, eq=False)
class PredictQuery:
    """The prediction points of one run (a leafless pytree node compared by identity, like a RunLayout).

    Fields:
        n_query: number of distinct (response group, sample time) points of the run's samples.
        groups: tuple of :class:`QueryGroup`.
        sample_points: stream key -> (n_s,) query point of each sample.
        times: stream key -> (n_s,) sample times in seconds.
    """

    n_query: int
    groups: tuple
    sample_points: dict
    times: dict


jax.tree_util.register_pytree_node(PredictQuery, lambda q: ((), q), lambda q, _: q)


def predict_query(run, spec, groups, grid: np.ndarray) -> PredictQuery:
    """The prediction points of one run of the data (NumPy, once): the grouped node table of *every* sample
    (:func:`msrm.nodes.prepare_nodes`), whatever the likelihood's layout is, and the response windows there."""
    nodes = prepare_nodes(run, spec, groups, grouped=True)
    if not np.array_equal(nodes.grid, grid):
        raise ValueError(f"run of duration {run.duration}: its grid ({nodes.grid.size} points) is not the grid of "
                         f"the prepared run ({np.size(grid)} points); the data and spec are not the model's")
    qgroups = []
    for g_i, g in enumerate(groups):
        idx = nodes.group_nodes(g_i)
        if idx.size == 0:
            continue
        start, stop = int(idx[0]), int(idx[-1]) + 1
        qgroups.append(QueryGroup(g.response, g.param_key, start,
                                  window_layout(nodes.node_time[start:stop], g.response, grid)))
    return PredictQuery(n_query=nodes.n_nodes, groups=tuple(qgroups),
                        sample_points={k: np.asarray(v) for k, v in nodes.stream_nodes.items()},
                        times={s.key: s.times for s in run.streams})


def _query_rows(theta, query: PredictQuery, n_grid: int):
    """Dense response rows (n_query, J) of the prediction points."""
    B = jnp.zeros((query.n_query, n_grid))
    for qg in query.groups:
        a = jax_window_weights(group_theta(theta, qg), qg.response, qg.window)  # (n_g, w)
        n_g, w = a.shape
        rows = np.repeat(np.arange(qg.start, qg.start + n_g), w)
        cols = (qg.window.start[:, None] + np.arange(w)[None, :]).reshape(-1)
        B = B.at[rows, cols].set(a.reshape(-1), unique_indices=True)
    return B


# ------------------------------------------------------------------------------------------ per-run results


def posterior_arrays(theta, run: RunPrepared, query: PredictQuery) -> dict:
    """The latent posterior on the grid and the predictive of every sample of one run, from one solve.

    The grid solve ``G = L^{-1} R A K`` (N K, J, K) gives the grid posterior directly (query points = the grid,
    ``X_k = A K_k``); the prediction points ``x_q = B z`` reuse it: their ``L^{-1} R X`` with ``X_k = A K_k B^T``
    is ``G`` contracted with ``B`` over the grid (``N K J K n_q`` flops, against ``(N K)^2 J K`` for the solve).

    Returns:
        ``{"mean": (J, K), "sd": (J, K), "cov": (J, K, K), "streams": {key: (mean, sd, signal_sd)} each (n_s, F),
        "event": ()}``.
    """
    layout = run.layout
    system = node_system(theta, run)
    Kk = kernel_matrices(layout.dist, theta["lengthscales"], layout.kernel)  # (K, J, J)
    X = jnp.einsum("uj,kji->kui", response_matrix(theta, layout), Kk)  # A K_k: (K, N, J)
    G = solve_cross(system, X)  # (N K, J, K)
    mean, cov = moments(G, jnp.diagonal(Kk, axis1=1, axis2=2).T, system.w)
    cov = 0.5 * (cov + jnp.swapaxes(cov, 1, 2))
    out = {"mean": mean, "sd": jnp.sqrt(jnp.maximum(jnp.diagonal(cov, axis1=1, axis2=2), 0.0)), "cov": cov,
           "event": system.event}

    B = _query_rows(theta, query, layout.n_grid)  # (n_q, J)
    H = jnp.einsum("xjk,qj->xqk", G, B)  # L^-1 R (A K_k B^T)
    m, Q = moments(H, jnp.einsum("qj,kji,qi->qk", B, Kk, B), system.w)
    streams = {}
    for key, points in query.sample_points.items():
        W = theta["loadings"][key]
        sd = theta["noise_sd"][key]
        mu = m[points] @ W.T + theta["intercepts"][key][None, :]
        signal_var = jnp.maximum(jnp.einsum("fk,ikl,fl->if", W, Q[points], W), 0.0)
        streams[key] = (mu, jnp.sqrt(signal_var + sd * sd), jnp.sqrt(signal_var))
    out["streams"] = streams
    return out


# ------------------------------------------------------------------------------------------ model tables


@dataclass(eq=False)
class RunTables:
    """What a model's latent-posterior and prediction calls reuse.

    Fields:
        own_runs: per-run :class:`~msrm.gp.prepare.RunPrepared` prepared here, or None when the model's prepared
            object is itself per run (then its runs are used, passed in at each call).
        queries: the :class:`PredictQuery` of each run.
        data, spec: what they were built from.
        fn: this model's jitted :func:`posterior_arrays` (compiled once per run, released with the entry).
        anchor: weak reference to the object the entry is filed under (see :data:`TABLES`).
        last: ``(key, results)`` of the last :func:`evaluate`, or None.
    """

    own_runs: tuple | None
    queries: tuple
    data: object
    spec: object
    fn: object
    anchor: object
    last: tuple | None = None

    def runs(self, prepared) -> tuple:
        return prepared.runs if self.own_runs is None else self.own_runs


# The model tables (RunTables) by id of an anchor that lives exactly as long as the model's prepared object: a
# MultiRunPrepared itself; for a per-run Prepared (a tuple, which cannot be weakly referenced) the first data array
# of its first run. A weakref.finalize on the anchor removes the entry when the anchor dies (arrays are not
# hashable, so a WeakKeyDictionary cannot hold them). No entry refers to its anchor (a per-run Prepared's runs are
# not kept: the compiled graphs hold their layouts, not their data arrays), so an entry goes with its model.
TABLES: dict = {}


def _anchor(prepared):
    if isinstance(prepared, Prepared):
        if not prepared.runs or not prepared.runs[0].streams:
            raise ValueError("prepared: a dataset with no run or no stream has no latent posterior")
        return prepared.runs[0].streams[0].Y0
    return prepared


def run_tables(prepared, data, spec, *, grouped: bool) -> RunTables:
    """The per-run prepared runs, prediction points and jitted function for a model's ``prepared``, ``data``
    and ``spec`` (cached with ``prepared``; rebuilt when called with other data or another spec).

    A per-run :class:`~msrm.gp.prepare.Prepared` is used as it is; any other form (a stack of runs,
    :class:`~msrm.gp.likelihood.MultiRunPrepared`) is prepared again per run from ``data`` and ``spec``
    (``method="native"``), once.

    Raises:
        ValueError: ``data`` does not have the runs, streams and grids ``prepared`` was built from.
    """
    anchor = _anchor(prepared)
    hit = TABLES.get(id(anchor))
    if hit is not None and hit.anchor() is anchor and hit.data is data and hit.spec is spec:
        return hit
    per_run = isinstance(prepared, Prepared)
    if per_run and len(prepared.runs) != len(data.runs):
        raise ValueError(f"data: {len(data.runs)} runs, but the model was prepared with {len(prepared.runs)}")
    if not per_run and len(data.runs) != prepared.n_runs:
        raise ValueError(f"data: {len(data.runs)} runs, but the model was prepared with {prepared.n_runs}")
    runs = prepared.runs if per_run else prepare(data, spec, grouped=grouped, method="native").runs
    for r, (run, prun) in enumerate(zip(data.runs, runs)):
        have = sorted(s.key for s in run.streams)
        want = sorted(sl.key for sl in prun.layout.streams)
        if have != want:
            raise ValueError(f"data: run {r} has streams {have}, the prepared run has {want}")
    groups = response_groups(data, spec)
    qs = tuple(predict_query(run, spec, groups, prun.layout.grid) for run, prun in zip(data.runs, runs))
    # a function object of this entry's own, so that JAX's caches keyed on it go with the entry
    fn = jax.jit(lambda theta, run, query: posterior_arrays(theta, run, query))
    hit = RunTables(None if per_run else tuple(runs), qs, data, spec, fn, weakref.ref(anchor))
    if id(anchor) not in TABLES:
        weakref.finalize(anchor, TABLES.pop, id(anchor), None)
    TABLES[id(anchor)] = hit
    return hit


def _theta_key(theta) -> tuple:
    leaves, treedef = jax.tree_util.tree_flatten(theta)
    return (str(treedef),) + tuple(np.asarray(x, dtype=np.float64).tobytes() for x in leaves)


def evaluate(tables: RunTables, prepared, theta) -> list[dict]:
    """Host results (NumPy) of :func:`posterior_arrays` for every run of the model's ``prepared``, after
    :func:`check_theta`.

    The last result is kept with ``tables``, keyed on the parameter values' bytes, so asking for the latent
    posterior and then the predictions at the same parameters evaluates once.
    """
    runs = tables.runs(prepared)
    check_theta(theta, runs)
    key = _theta_key(theta)
    if tables.last is not None and tables.last[0] == key:
        return tables.last[1]
    out = [jax.device_get(tables.fn(theta, run, query)) for run, query in zip(runs, tables.queries)]
    tables.last = (key, out)
    return out


def check_theta(theta, runs) -> None:
    """Refuse a parameter pytree that does not fit the prepared runs, before any numerics.

    Raises:
        KeyError: a stream of the data without loadings, intercepts or noise sd, or a response group without
            its parameters (named).
        ValueError: an array of the wrong shape (named, with the expected shape).
    """
    if not runs:
        return
    K = runs[0].layout.n_factors
    ell = np.shape(theta["lengthscales"])
    if ell != (K,):
        raise ValueError(f"lengthscales: shape {ell}, expected ({K},) for the model's K = {K} factors")
    for run in runs:
        for sl in run.layout.streams:
            for part, shape in (("loadings", (sl.n_features, K)), ("intercepts", (sl.n_features,)),
                                ("noise_sd", (sl.n_features,))):
                if sl.key not in theta[part]:
                    raise KeyError(f"{part}: no entry for stream {sl.key!r} (given for {sorted(theta[part])})")
                got = np.shape(theta[part][sl.key])
                if got != shape:
                    raise ValueError(f"{part}[{sl.key!r}]: shape {got}, expected {shape}")
        for g in run.layout.groups:
            if g.param_key is not None:
                if g.param_key not in theta["response"]:
                    raise KeyError(f"response: no parameters for {g.param_key!r} (given for "
                                   f"{sorted(theta['response'])})")
                missing = set(g.response.param_names) - set(theta["response"][g.param_key])
                if missing:
                    raise KeyError(f"response[{g.param_key!r}]: missing {sorted(missing)}")
