r"""The sequential scan's block length C: a deterministic rule of the problem's sizes and the machine's core count.

The host filter's sub-step (:mod:`.host`) costs a fixed amount (tens of NumPy and ctypes calls, one small LU) plus
passes over the S x S covariance plus its dense products of S x S by the update rank R. A longer block absorbs
more nodes per sub-step (fewer sub-steps, so less fixed cost) but lengthens the ring, so every product and pass
is over a larger state. The rule picks the C in ``1 .. min(MAX_BLOCK, J)`` that minimises the modelled cost of
one value+gradient of the run,

.. math::

    t(C) = n_\mathrm{sub}(C)\,\big(o + p\,S(C)^2\,\mu\big)
         + \sum_{\text{occupied}} S(C)^2\, \big(c\, g(\bar R) + c_n\, g(\bar R / K)\big) / h
         + \sum_{\text{occupied}} \phi(\bar R)\,\big(c_s\, 2 \bar R^2 S(C) + c_r \bar R^3\big),

read off the schedule the run would have at C (:func:`msrm.gp.state_space.prepare.schedule_shape`): ``n_sub``
sub-steps, of which the occupied ones absorb nodes, ``S = K (d + n_ring + n_bank)`` states (the ring grows with
C), mean update rank ``R̄ = K x nodes / occupied sub-steps``. ``o`` is the fixed cost of a sub-step
(:data:`OPS_PER_SUB_STEP` small calls), ``μ`` the cost per element of a pass over a covariance (``p`` passes),
``g(R)`` the cost per covariance element of one ``S x S x R`` product (``c`` of them, ``c_n`` narrow ones at rank
``R / K``; one more of each where the reverse pass recomputes checkpointed chunks), ``φ(R)`` the cost of a flop
at rank R for the rank-sized work (``R x R x S`` products and the ``R x R`` factorizations). ``p``, ``c``,
``c_n``, ``c_s``, ``c_r`` count the operations the code performs.

**The coefficients are fixed** (:data:`COEFFICIENTS`): about 1.5 µs a small call, 1 ns an element of a pass,
and a rank-R product at 10 GFLOP/s with its S x S result written once (``g(R) = 2 R / 10^10 + 2 10^{-9}`` s), an
order-of-magnitude single core of a current x86 or ARM server. The rule only compares C against C on one run,
so what matters is the ratio of the fixed cost to the per-element costs, which varies far less between machines
than either does, and the modelled cost is shallow around its minimum (tens of percent over a factor of two in C
on the synthetic profiles), so a C near another machine's own optimum costs it little. A rule also gives every
machine, process and test the same block length for the same sizes and cores, so the same schedule and the same
rounding, and it takes no time and writes nothing.

**Cores** (:math:`h`): the host filter runs its dense products on one BLAS thread unless the largest one reaches
:data:`msrm.runtime.DENSE_THREAD_MIN_FLOPS` (:func:`msrm.runtime.filter_thread_count`), and then on the idle
cores. The rule counts ``h`` = the machine's physical cores (:func:`msrm.runtime.physical_cores`, or ``cores=``)
for products that large (``2 S^2 R̄ >= DENSE_THREAD_MIN_FLOPS``) and 1 below: the block lengths whose products
are threaded then cost that much less in their dense part (which way that moves the choice depends on the run;
a run whose products all stay below the threshold gets the same C on any core count). The fixed and rank-sized
costs stay on one core.

**Not in the rule**: the number of features and streams. Every feature of a node is reduced to the node's K x K
information factor and K-vector before the scan (:func:`msrm.gp.likelihood.node_information`), so the scan's cost,
which is all that C changes, does not depend on them.

``block=`` (the backend option) bypasses the rule. The block length never changes the density (tested); only
the cost does. The choice and its modelled cost are kept in the run's tables (``RunTables.block_source`` is
``"default"`` for a choice of this rule, ``RunTables.block_predicted_s`` the modelled seconds).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["Coefficients", "COEFFICIENTS", "DEFAULT_COEFFICIENTS", "MAX_BLOCK", "RANKS", "OPS_PER_SUB_STEP",
           "PASSES_PER_SUB_STEP", "PRODUCTS_PER_SUB_STEP", "NARROW_PRODUCTS_PER_SUB_STEP", "machine_coefficients",
           "product_threads", "predicted_seconds", "BlockChoice", "choose_block"]

# The largest block length searched (a bound of the search: past it the ring alone makes S grow faster than the
# sub-step count falls).
MAX_BLOCK = 64

# The update ranks g(R) is tabulated at (interpolated in log R between them, held flat outside).
RANKS = (4, 8, 16, 32, 64, 128)

# What a value+gradient sub-step does, counted from :mod:`.host` (forward step, its reverse, the weight adjoints):
# NumPy/ctypes calls, passes over an S x S array (the kept copy, the adjoint's half-sum and its two additions,
# the prediction's row and column writes) and S x S x R products (the forward update, the reverse pass's P̄ U).
OPS_PER_SUB_STEP = 160
PASSES_PER_SUB_STEP = 6.0
PRODUCTS_PER_SUB_STEP = 2.0
# B P, Bᵀ Ūᵀ and Ā against P: three S x S x (R / K) products, counted at rank R / K
NARROW_PRODUCTS_PER_SUB_STEP = 3.0
# R x R x S products (forward: G⁻¹Λ Uᵀ; reverse: P̄ U W, Uᵀ P̄ U) and flops / R^3 of the R x R work (forward:
# Λ C, LU and inverse, G⁻¹ Λ: 6; reverse of the small part: six products, 12), the forward again when recomputed
RRS_PRODUCTS_PER_SUB_STEP = 3.0
RRR_FLOPS_PER_SUB_STEP = 18.0
RRR_FLOPS_RECOMPUTED = 6.0


@dataclass(frozen=True)
class Coefficients:
    """Costs of the block-length model (seconds).

    Fields:
        call_s: one small NumPy/ctypes call (the fixed cost of a sub-step is ``OPS_PER_SUB_STEP`` of them).
        pass_s: one element of a pass over an S x S float64 array.
        gemm_s: per covariance element of one S x S x R product, at each rank of ``ranks``.
        ranks: the ranks ``gemm_s`` is given at.
        source: a label recorded with a choice (``"default"`` for :data:`COEFFICIENTS`).
    """

    call_s: float
    pass_s: float
    gemm_s: tuple
    ranks: tuple = RANKS
    source: str = "default"

    def __post_init__(self):
        for name in ("call_s", "pass_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"Coefficients.{name} must be a positive finite number, got {v!r}")
        if len(self.gemm_s) != len(self.ranks) or len(self.ranks) < 1:
            raise ValueError(f"Coefficients.gemm_s needs one value per rank of {self.ranks}, got {self.gemm_s!r}")
        if any(not (math.isfinite(g) and g > 0) for g in self.gemm_s):
            raise ValueError(f"Coefficients.gemm_s must be positive finite numbers, got {self.gemm_s!r}")
        if list(self.ranks) != sorted(self.ranks) or self.ranks[0] < 1:
            raise ValueError(f"Coefficients.ranks must be increasing positive integers, got {self.ranks!r}")

    def gemm(self, rank: float) -> float:
        """Seconds per covariance element of one S x S x ``rank`` product (log-log interpolation)."""
        r = np.log(np.clip(float(rank), self.ranks[0], self.ranks[-1]))
        return float(np.exp(np.interp(r, np.log(self.ranks), np.log(self.gemm_s))))

    def as_dict(self) -> dict:
        return dict(call_s=self.call_s, pass_s=self.pass_s, gemm_s=list(self.gemm_s), ranks=list(self.ranks),
                    source=self.source)


#: The rule's fixed coefficients (module docstring): about 1.5 µs a call, 1 ns an element pass, 10 GFLOP/s on a
#: rank-R product with its S x S result written once.
COEFFICIENTS = Coefficients(
    call_s=1.5e-6, pass_s=1.0e-9,
    gemm_s=tuple(2.0 * r / 10e9 + 2.0e-9 for r in RANKS), ranks=RANKS, source="default")
DEFAULT_COEFFICIENTS = COEFFICIENTS


def machine_coefficients() -> Coefficients:
    """The coefficients of the cost model: :data:`COEFFICIENTS`, the same on every machine (the host filter's
    pipeline rule, :func:`msrm.gp.state_space.host.pipeline_pays`, reads them here)."""
    return COEFFICIENTS


def product_threads(n_states: int, rank: float, cores: int) -> int:
    """BLAS threads the rule counts for the S x S x R products: ``cores`` when ``2 S^2 R`` reaches
    :data:`msrm.runtime.DENSE_THREAD_MIN_FLOPS` (the size from which the host filter threads them), else 1."""
    from ... import runtime

    return max(1, int(cores)) if 2.0 * float(n_states) ** 2 * float(rank) >= runtime.DENSE_THREAD_MIN_FLOPS else 1


def predicted_seconds(n_sub: int, n_occupied: int, n_states: int, rank: float, K: int, recompute: bool,
                      coefficients: Coefficients = COEFFICIENTS, cores: int = 1) -> float:
    """The model's seconds for one value+gradient of ``n_sub`` sub-steps (``n_occupied`` absorbing nodes, at mean
    update rank ``rank``) of an ``n_states``-dimensional state; ``recompute``: the reverse pass recomputes the
    checkpointed chunks (one more forward product per sub-step); ``cores``: physical cores (the dense products
    are shared among them when large enough, :func:`product_threads`)."""
    c = coefficients
    S2 = float(n_states) ** 2
    fixed = n_sub * (OPS_PER_SUB_STEP * c.call_s + PASSES_PER_SUB_STEP * S2 * c.pass_s)
    products = PRODUCTS_PER_SUB_STEP + (1.0 if recompute else 0.0)
    narrow = NARROW_PRODUCTS_PER_SUB_STEP + (1.0 if recompute else 0.0)
    threads = product_threads(n_states, rank, cores)
    dense = n_occupied * S2 * (products * c.gemm(rank) + narrow * c.gemm(max(rank / max(K, 1), 1.0))) / threads
    # the rank-sized work: R x R x S products (G⁻¹Λ Uᵀ, and P̄ U against W in the reverse pass) and R x R x R
    # ones (G, its LU and inverse, the small part's reverse), at the flop rate of a rank-R product
    R = float(rank)
    flop_s = c.gemm(R) / (2.0 * max(R, 1.0))
    rrs = (RRS_PRODUCTS_PER_SUB_STEP + (1.0 if recompute else 0.0)) * 2.0 * R * R * n_states
    rrr = (RRR_FLOPS_PER_SUB_STEP + (RRR_FLOPS_RECOMPUTED if recompute else 0.0)) * R ** 3
    return float(fixed + dense + n_occupied * flop_s * (rrs + rrr))


@dataclass(frozen=True)
class BlockChoice:
    """The chosen block length, the label of its coefficients, and the model's seconds for every candidate."""

    block: int
    source: str
    predicted_s: float
    candidates: dict


def choose_block(shape_of, n_grid: int, K: int, coefficients: Coefficients | None = None,
                 cores: int | None = None) -> BlockChoice:
    """The block length C in ``1 .. min(MAX_BLOCK, n_grid)`` the cost model predicts fastest.

    Args:
        shape_of: ``C -> (n_sub, n_occupied, n_states, n_nodes, recompute)`` of the run's schedule at block
            length C (:func:`msrm.gp.state_space.prepare.schedule_shape`).
        n_grid: J. K: factors.
        coefficients: the model's costs (default :data:`COEFFICIENTS`).
        cores: physical cores (default :func:`msrm.runtime.physical_cores`).
    Returns:
        the :class:`BlockChoice`; the smallest C wins a tie.
    """
    from ... import runtime

    coefficients = COEFFICIENTS if coefficients is None else coefficients
    cores = runtime.physical_cores() if cores is None else int(cores)
    if cores < 1:
        raise ValueError(f"cores must be a positive integer, got {cores!r}")
    cands = {}
    for C in range(1, max(1, min(MAX_BLOCK, int(n_grid))) + 1):
        n_sub, n_occ, S, n_nodes, recompute = shape_of(C)
        rank = K * n_nodes / max(n_occ, 1)
        cands[C] = predicted_seconds(n_sub, n_occ, S, rank, K, recompute, coefficients, cores)
    best = min(cands, key=lambda c: (cands[c], c))
    return BlockChoice(block=int(best), source=coefficients.source, predicted_s=cands[best], candidates=cands)
