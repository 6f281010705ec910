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
as :func:`msrm.gp.likelihood.covariance_from_response` does for dense rows: with ``U_k = S_k A``,

.. math::

    \bar K_k = A^\top U_k, \qquad \bar A_c = 2 \sum_k U_k[c, :]\, K_k[:, lo_c : lo_c + S],

the latter only on the chunk windows (the entries the response weights can reach), never as a dense (N, J)
matrix. The result equals the dense products up to rounding (tested against them, value and gradients,
including padded runs and chunks cut by the grid's end).

Chunk offsets ``lo_c`` may be traced (stacked runs carry their window starts as arrays); ``S`` and the chunk
counts are static.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

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
    Z_parts, blocks = [], []
    for (Ac, lo), shape in zip(windows, shapes):
        Kb = Kk[:, _span_index(lo, shape.span), :]  # (K, n_chunks, span, J)
        blocks.append(Kb)
        Zg = jnp.einsum("kcsj,crs->kjcr", Kb, Ac)
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
    return C, (windows, Kk, blocks)


def _bwd(shapes, res, Cbar):
    windows, Kk, blocks = res
    Kf, N, _ = Cbar.shape
    J = Kk.shape[-1]
    S = 0.5 * (Cbar + jnp.swapaxes(Cbar, -1, -2))
    # Y = A^T S (K, J, N): row-slice scatter of each chunk's A_c^T S[c rows, :]
    Y = jnp.zeros((Kf, J, N), Cbar.dtype)
    offset = 0
    for (Ac, lo), shape in zip(windows, shapes):
        Sg = _pad_chunks(S[:, offset:offset + shape.n_nodes, :], shape, axis=1)  # (K, n_chunks, CHUNK, N)
        Y = Y.at[:, _span_index(lo, shape.span), :].add(jnp.einsum("crs,kcrn->kcsn", Ac, Sg))
        offset += shape.n_nodes
    # Kbar = Y A (symmetric), Abar_c = 2 sum_k (S A K_k)[c rows, span_c] = 2 sum_k Y[:, :, c rows]^T K_k[:, span_c]
    Kbar = jnp.zeros_like(Kk)
    Abar, offset = [], 0
    for (Ac, lo), shape, Kb in zip(windows, shapes, blocks):
        Yg = _pad_chunks(Y[:, :, offset:offset + shape.n_nodes], shape, axis=2)  # (K, J, n_chunks, CHUNK)
        Kbar = Kbar.at[:, :, _span_index(lo, shape.span)].add(jnp.einsum("kjcr,crs->kjcs", Yg, Ac))
        Abar.append(2.0 * jnp.einsum("kjcr,kcsj->crs", Yg, Kb))
        offset += shape.n_nodes
    wbar = tuple((Ab, np.zeros(lo.shape, dtype=jax.dtypes.float0)) for Ab, (_, lo) in zip(Abar, windows))
    return wbar, Kbar


chunked_covariance.defvjp(_fwd, _bwd)
