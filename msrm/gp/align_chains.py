r"""Align the factors of independent NUTS chains of GP-MSRM (sign and order) before they are merged.

GP-MSRM's density is unchanged when factor k's loadings change sign (``W[:, k] -> -W[:, k]``, the latent
integrated out has a symmetric prior) and when factors are permuted together with their lengthscales. One chain
stays in one of these equivalent modes; independent chains may land in different ones, and merging them
unaligned would mix factors (R-hat would flag the loadings, and posterior means would shrink toward zero).

In the flat unconstrained vector (:mod:`msrm.gp.transforms`) exactly two kinds of blocks carry a factor axis:
``loadings/<key>`` (F, K), stored as-is (identity transform), and ``lengthscales`` (K,), stored as logs. Nothing
else (intercepts, noise, response lags and widths) depends on factor order or sign. A signed permutation with
``perm`` and ``signs`` (aligned factor l = ``signs[l]`` x chain factor ``perm[l]``) therefore acts on a draw as
``W'[:, l] = signs[l] W[:, perm[l]]`` for every stream and ``log l'[l] = log l[perm[l]]`` (lengthscales do not
change sign).

**Matching.** Per chain, the posterior-mean loadings of all streams are stacked, ``M_c`` (F_total, K), and
compared with the reference chain's by cosine similarity ``C[k, l] = <M_c[:, k], M_ref[:, l]> / (|.| |.|)``. The
signed permutation maximising ``score = sum_l signs[l] C[perm[l], l]`` is ``perm`` from
``scipy.optimize.linear_sum_assignment`` on ``|C|`` and ``signs[l] = sign(C[perm[l], l])``; its score is
``sum_l |C[perm[l], l]|``.

**Ambiguity criterion.** The runner-up signed permutation is the better of (a) the same permutation with the
weakest match's sign flipped (score ``best - 2 min_l |C[perm[l], l]|``) and (b) the best permutation that differs
from ``perm`` in at least one assignment, with its own best signs (found exactly by forbidding each assigned pair
in turn and re-solving, K small assignment problems). The **margin** is ``best - runner_up`` (between 0 and 2K;
2 for two factors matched perfectly with orthogonal loadings). A chain whose margin is below ``min_margin``
(default 0.5) is refused with a ValueError: its factors cannot be told apart from the reference's (e.g. two
factors with nearly equal loadings, or a factor whose loadings are near zero).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import linear_sum_assignment

__all__ = ["ChainAlignment", "align_chain_draws", "match_factors", "apply_signed_permutation", "MIN_MARGIN"]

MIN_MARGIN = 0.5


@dataclass(frozen=True, eq=False)
class ChainAlignment:
    """The result of :func:`align_chain_draws`.

    Fields:
        draws: (chains, draws, P) aligned unconstrained draws.
        permutations: (chains, K) int: aligned factor l of chain c is its factor ``permutations[c, l]``.
        signs: (chains, K) +1 / -1.
        transforms: (chains, K, K) signed permutation matrices T_c with aligned loadings ``W_c @ T_c``.
        margins: (chains,) the matching margin of each chain (module docstring; inf for the reference chain).
        reference: index of the reference chain.
    """

    draws: np.ndarray
    permutations: np.ndarray
    signs: np.ndarray
    transforms: np.ndarray
    margins: np.ndarray
    reference: int


def _assign(absC: np.ndarray) -> tuple[np.ndarray, float]:
    """(perm with perm[l] = row assigned to column l, summed |C| of the assignment)."""
    rows, cols = linear_sum_assignment(-absC)
    perm = np.empty(absC.shape[1], dtype=np.int64)
    perm[cols] = rows
    return perm, float(absC[rows, cols].sum())


def match_factors(C: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """The best signed permutation for a (K, K) cosine matrix (rows: the chain's factors, columns: the
    reference's) and its margin over the runner-up (module docstring).

    Returns:
        (perm (K,), signs (K,), margin).
    """
    C = np.asarray(C, dtype=np.float64)
    K = C.shape[0]
    absC = np.abs(C)
    perm, best = _assign(absC)
    matched = absC[perm, np.arange(K)]
    signs = np.where(C[perm, np.arange(K)] < 0, -1.0, 1.0)
    runner_up = best - 2.0 * float(matched.min())
    big = 2.0 * K + 1.0  # larger than any achievable score: forbids a pair
    for l in range(K):
        forbidden = absC.copy()
        forbidden[perm[l], l] = -big
        _, score = _assign(forbidden)
        if score > -big / 2:  # a permutation avoiding the pair exists (always, for K >= 2)
            runner_up = max(runner_up, score)
    return perm, signs, best - runner_up


def _loading_blocks(blocks) -> list:
    return [b for b in blocks if b.field == "loadings"]


def _stacked_loadings(u: np.ndarray, blocks) -> np.ndarray:
    """(F_total, K) loadings of every stream from one unconstrained vector (the identity transform)."""
    return np.concatenate([u[b.start: b.start + b.size].reshape(b.shape) for b in _loading_blocks(blocks)], axis=0)


def apply_signed_permutation(draws: np.ndarray, blocks, perm: np.ndarray, signs: np.ndarray) -> np.ndarray:
    """The draws (..., P) with factor l replaced by ``signs[l]`` x factor ``perm[l]`` in every loadings block and
    lengthscale ``perm[l]`` moved to l (module docstring); every other entry unchanged."""
    out = np.array(draws, dtype=np.float64, copy=True)
    for b in blocks:
        if b.field == "loadings":
            W = draws[..., b.start: b.start + b.size].reshape(draws.shape[:-1] + b.shape)
            out[..., b.start: b.start + b.size] = (W[..., perm] * signs).reshape(draws.shape[:-1] + (b.size,))
        elif b.field == "lengthscales":
            out[..., b.start: b.start + b.size] = draws[..., b.start: b.start + b.size][..., perm]
    return out


def align_chain_draws(model, draws, *, reference: int = 0, min_margin: float = MIN_MARGIN) -> ChainAlignment:
    """Align every chain's factors to the reference chain's (module docstring).

    Args:
        model: a :class:`~msrm.gp.model.GPMSRM` (its ``blocks`` give the vector layout).
        draws: (chains, draws, P) unconstrained draws, e.g. the ``unconstrained_posterior`` group's ``u``.
        reference: the chain the others are mapped onto.
        min_margin: refuse a chain whose matching margin is below this.
    Returns:
        :class:`ChainAlignment`.
    Raises:
        ValueError: draws of the wrong shape or non-finite; a bad reference index; a chain whose match is
            ambiguous (its margin, the criterion, and the cosine matrix are in the message).
    """
    blocks = model.blocks
    P = int(blocks[-1].start + blocks[-1].size)
    draws = np.asarray(draws, dtype=np.float64)
    if draws.ndim != 3 or draws.shape[2] != P or draws.shape[1] < 1:
        raise ValueError(f"draws must have shape (chains, draws, {P}), got {draws.shape}")
    if not np.isfinite(draws).all():
        raise ValueError("draws contain non-finite values")
    n_chains = draws.shape[0]
    if isinstance(reference, bool) or not isinstance(reference, (int, np.integer)) or not 0 <= reference < n_chains:
        raise ValueError(f"reference must be a chain index in [0, {n_chains}), got {reference!r}")
    if not _loading_blocks(blocks):
        raise ValueError("the model has no loadings blocks to match factors by")
    K = _loading_blocks(blocks)[0].shape[1]
    means = draws.mean(axis=1)
    ref = _stacked_loadings(means[reference], blocks)
    ref_norm = np.linalg.norm(ref, axis=0)
    if np.any(ref_norm == 0):
        raise ValueError(f"the reference chain {reference} has a factor with all-zero mean loadings; cannot match")
    out = np.empty_like(draws)
    perms = np.empty((n_chains, K), dtype=np.int64)
    signs = np.empty((n_chains, K))
    margins = np.empty(n_chains)
    for c in range(n_chains):
        if c == reference:
            perms[c], signs[c], margins[c] = np.arange(K), 1.0, np.inf
            out[c] = draws[c]
            continue
        M = _stacked_loadings(means[c], blocks)
        norm = np.linalg.norm(M, axis=0)
        C = (M.T @ ref) / np.outer(np.where(norm == 0, 1.0, norm), ref_norm)
        perm, sg, margin = match_factors(C)
        if margin < min_margin:
            raise ValueError(
                f"chain {c}: its factors cannot be matched to reference chain {reference} unambiguously: margin "
                f"{margin:.3g} < min_margin {min_margin:g} (best signed-permutation score minus the runner-up's, "
                f"scores summing cosine similarities of mean loadings); cosine matrix (rows chain {c}, columns "
                f"reference):\n{np.array2string(C, precision=3)}")
        perms[c], signs[c], margins[c] = perm, sg, margin
        out[c] = apply_signed_permutation(draws[c], blocks, perm, sg)
    transforms = np.zeros((n_chains, K, K))
    for c in range(n_chains):
        transforms[c][perms[c], np.arange(K)] = signs[c]
    return ChainAlignment(draws=out, permutations=perms, signs=signs, transforms=transforms, margins=margins,
                          reference=int(reference))
