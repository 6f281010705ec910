r"""Node covariances ``C_k = A K_k A^T`` from the response windows, without the dense response matrix.

Each node's response row ``a_u`` is non-zero only on a window of ``w`` consecutive grid points (``w`` is 2..60 at
the one-eighth scale, against ``J ~ 530`` grid points), and within a response group the nodes are ordered in
time, so their windows start at non-decreasing grid points. Cut a group's nodes into **chunks** of
:data:`CHUNK` consecutive nodes: every window of a chunk lies inside one span of ``S`` grid points starting at
``lo_c`` (``S`` fixed per group: the widest chunk of every run that shares the layout). With ``A_c`` the chunk's
(CHUNK, S) window matrix,

.. math::

    (A K_k)[c] = A_c\, K_k[lo_c : lo_c + S, :], \qquad
    C_k[:, c] = (A K_k)[:, lo_c : lo_c + S]\, A_c^\top ,

batched matrix products over chunks that cost ``S / J`` of the dense ones. The reverse rule
(``jax.custom_vjp``) uses the symmetry of ``K_k`` and of the cotangent's symmetric part ``S_k`` the same way
as :func:`msrm.gp.likelihood.covariance_from_response` does for dense rows: with ``Y_k = A^T S_k`` (so
``U_k = Y_k^T = S_k A``),

.. math::

    Y_k[lo_c : lo_c + S, :] \mathrel{+}= A_c^\top S_k[c, :], \qquad
    \bar K_k[lo_c : lo_c + S, :] \mathrel{+}= A_c^\top U_k[c, :], \qquad
    \bar A_c = 2 \sum_k U_k[c, :]\, K_k[lo_c : lo_c + S, :]^\top,

the last only on the chunk windows (the entries the response weights can reach), never as a dense (N, J)
matrix. Every product reads and writes whole rows: the arrays keep the factor axis inside the row index
((J, K, N) rather than (K, J, N)), so that no (K, ...) operand is transposed for the batched products, and the
overlapping row blocks are added chunk after chunk with ``dynamic_update_slice`` (in place; XLA:CPU scatters
are several times slower). The result equals the dense products up to rounding (tested against them, value
and gradients, including padded runs and chunks cut by the grid's end).

Chunk offsets ``lo_c`` may be traced (stacked runs carry their window starts as arrays); ``S`` and the chunk
counts are static.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["CHUNK", "ChunkShape", "chunk_shape", "worthwhile", "chunk_windows", "chunked_covariance"]

CHUNK = 32


class ChunkShape(NamedTuple):
    """Static chunking of one response group: ``n_nodes`` rows (padded ones included), ``n_chunks`` chunks of
    :data:`CHUNK` rows and a span of ``span`` grid points per chunk."""

    n_nodes: int
    n_chunks: int
    span: int


def chunk_shape(starts: Sequence[np.ndarray], width: int, n_grid: int, n_nodes: int | None = None) -> ChunkShape | None:
    """The static chunking of a group from the window starts of its real nodes in every run that shares it.

    Args:
        starts: per run, the (n_real,) window starts of the group's nodes, in node order.
        width: window width w. n_grid: grid length J of the (padded) layout.
        n_nodes: rows of the group in the layout (>= every n_real; default the largest n_real).
    Returns:
        A :class:`ChunkShape`, or None when the starts are not non-decreasing (then the dense path is used).
    """
    n_nodes = max(len(s) for s in starts) if n_nodes is None else int(n_nodes)
    span = 0
    for s in starts:
        s = np.asarray(s, dtype=np.int64)
        if s.size and np.any(np.diff(s) < 0):
            return None
        for j0 in range(0, s.size, CHUNK):
            block = s[j0:j0 + CHUNK]
            span = max(span, int(block[-1] - block[0]) + int(width))
    span = min(max(span, int(width)), int(n_grid))
    return ChunkShape(n_nodes=n_nodes, n_chunks=-(-n_nodes // CHUNK), span=span)


def worthwhile(shapes, n_grid: int) -> bool:
    """Use the chunked products: every group has a chunking and every span is at most half the grid."""
    return bool(shapes) and all(sh is not None and 2 * sh.span <= n_grid for sh in shapes)


def chunk_windows(a, start, shape: ChunkShape, n_grid: int):
    """The chunk window matrices of one group.

    Args:
        a: (n_nodes, w) window weights (zero rows for padded nodes). start: (n_nodes,) window starts (int,
            static or traced). shape: the group's :class:`ChunkShape`. n_grid: J.
    Returns:
        Ac (n_chunks, CHUNK, span) and lo (n_chunks,) int: row ``r`` of chunk ``c`` is node ``c CHUNK + r`` and
        column ``s`` is grid point ``lo_c + s``.
    """
    n, w = a.shape
    rows = shape.n_chunks * CHUNK
    start = jnp.asarray(start, dtype=jnp.int32)
    if rows > n:  # padded rows repeat the last start (their weights are zero)
        start = jnp.concatenate([start, jnp.broadcast_to(start[-1], (rows - n,))])
    start = start.reshape(shape.n_chunks, CHUNK)
    lo = jnp.minimum(start[:, 0], n_grid - shape.span)
    # real nodes fall inside [0, span) by construction of the span; padded rows (zero weights) are clipped
    cols = jnp.clip(start[:, :, None] - lo[:, None, None] + jnp.arange(w), 0, shape.span - 1)
    c_idx = jnp.arange(shape.n_chunks)[:, None, None]
    r_idx = jnp.arange(CHUNK)[None, :, None]
    Ac = jnp.zeros((shape.n_chunks, CHUNK, shape.span), a.dtype).at[c_idx, r_idx, cols].add(
        _pad_chunks(a, shape, axis=0))
    return Ac, lo


def _span_index(lo, span):
    return lo[:, None] + jnp.arange(span)[None, :]  # (n_chunks, span)


def _rows(T_blocks, n):
    """(K, n_chunks, CHUNK, X) -> (K, n, X): the group's rows in node order."""
    Kf, nc, ch, X = T_blocks.shape
    return T_blocks.reshape(Kf, nc * ch, X)[:, :n]


def _pad_chunks(X, shape: ChunkShape, axis: int):
    """Pad ``axis`` (the group's n rows) to n_chunks * CHUNK with zeros and split it into (n_chunks, CHUNK)."""
    n = X.shape[axis]
    rows = shape.n_chunks * CHUNK
    if rows > n:
        pad = [(0, 0)] * X.ndim
        pad[axis] = (0, rows - n)
        X = jnp.pad(X, pad)
    return X.reshape(X.shape[:axis] + (shape.n_chunks, CHUNK) + X.shape[axis + 1:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def chunked_covariance(shapes, windows, Kk):
    """``C_k = A K_k A^T`` (K, N, N) from the chunk windows of every group (groups in node order).

    Args:
        shapes: tuple of :class:`ChunkShape`, one per group (static).
        windows: tuple over groups of ``(Ac, lo)`` from :func:`chunk_windows`.
        Kk: (K, J, J) symmetric prior correlation matrices.
    """
    return _forward(shapes, windows, Kk)[0]


def _forward(shapes, windows, Kk):
    # Z = K_k A^T (K, J, N), one group's columns at a time from the rows lo_c.. of K_k (K is symmetric)
    Kt = jnp.transpose(Kk, (1, 0, 2))  # (J, K, J): row j holds K_k[j, :] of every factor
    Z_parts, blocks = [], []
    for (Ac, lo), shape in zip(windows, shapes):
        Kb = Kt[_span_index(lo, shape.span)]  # (n_chunks, span, K, J)
        blocks.append(Kb)
        Zg = jnp.einsum("cskj,crs->kjcr", Kb, Ac)
        Z_parts.append(Zg.reshape(Zg.shape[0], Zg.shape[1], -1)[:, :, :shape.n_nodes])
    Z = jnp.concatenate(Z_parts, axis=2) if len(Z_parts) > 1 else Z_parts[0]
    # C_k[c rows, :] = A_c Z[lo_c : lo_c + S, :] (contiguous row slices of Z)
    C_parts = []
    for (Ac, lo), shape in zip(windows, shapes):
        Zr = Z[:, _span_index(lo, shape.span), :]  # (K, n_chunks, span, N)
        C_parts.append(_rows(jnp.einsum("crs,kcsn->kcrn", Ac, Zr), shape.n_nodes))
    C = jnp.concatenate(C_parts, axis=1) if len(C_parts) > 1 else C_parts[0]
    return C, blocks


def _fwd(shapes, windows, Kk):
    C, blocks = _forward(shapes, windows, Kk)
    return C, (windows, blocks)


def _add_rows(X, V, lo):
    """``X[lo_c : lo_c + S] += V[c]`` for every chunk ``c`` in turn (``dynamic_update_slice``, in place).

    X: (rows, ...); V: (n_chunks, S, ...); lo: (n_chunks,) int, ``lo_c + S <= rows``.
    """
    n_chunks, span = V.shape[:2]
    zero = jnp.zeros((), lo.dtype)

    def body(c, X):
        start = (lo[c],) + (zero,) * (X.ndim - 1)
        block = lax.dynamic_slice(X, start, (span,) + X.shape[1:])
        return lax.dynamic_update_slice(X, block + V[c], start)

    return lax.fori_loop(0, n_chunks, body, X)


def _bwd(shapes, res, Cbar):
    windows, blocks = res
    Kf, N, _ = Cbar.shape
    J = blocks[0].shape[-1]
    St = 0.5 * (jnp.transpose(Cbar, (1, 0, 2)) + jnp.transpose(Cbar, (2, 0, 1)))  # (N, K, N): S_k[u, v]
    # Y = A^T S as (J, K, N): chunk c adds A_c^T S[c rows] to the rows lo_c..
    Y = jnp.zeros((J, Kf, N), Cbar.dtype)
    offset = 0
    for (Ac, lo), shape in zip(windows, shapes):
        Sg = _pad_chunks(St[offset:offset + shape.n_nodes], shape, axis=0)  # (n_chunks, CHUNK, K, N)
        Y = _add_rows(Y, jnp.einsum("crs,crkn->cskn", Ac, Sg), lo)
        offset += shape.n_nodes
    U = jnp.transpose(Y, (2, 1, 0))  # (N, K, J): U[u, k] = (S_k A)[u, :] (S_k symmetric)
    # Kbar = A^T U (symmetric) as (J, K, J), Abar_c = 2 sum_k U_k[c rows, :] K_k[span_c, :]^T
    Kbar = jnp.zeros((J, Kf, J), Cbar.dtype)
    Abar, offset = [], 0
    for (Ac, lo), shape, Kb in zip(windows, shapes, blocks):
        Ug = _pad_chunks(U[offset:offset + shape.n_nodes], shape, axis=0)  # (n_chunks, CHUNK, K, J)
        Kbar = _add_rows(Kbar, jnp.einsum("crs,crkj->cskj", Ac, Ug), lo)
        Abar.append(2.0 * jnp.einsum("crkj,cskj->crs", Ug, Kb))
        offset += shape.n_nodes
    wbar = tuple((Ab, np.zeros(lo.shape, dtype=jax.dtypes.float0)) for Ab, (_, lo) in zip(Abar, windows))
    return wbar, jnp.transpose(Kbar, (1, 0, 2))


chunked_covariance.defvjp(_fwd, _bwd)
