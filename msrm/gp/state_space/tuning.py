r"""Per-machine choice of the sequential scan's block length C: a cost model with coefficients measured on this CPU.

The host filter's sub-step (:mod:`.host`) costs a fixed amount (tens of NumPy and ctypes calls, one small LU) plus
passes over the S x S covariance plus its dense products of S x S by the update rank R. Which of these dominates,
and so which C is fastest, depends on the CPU and its BLAS kernel: a block length tuned on one machine does not
carry to another. The model of one value+gradient of a run with block length C is

.. math::

    t(C) = n_\mathrm{sub}(C)\,\big(o + p\,S(C)^2\,\mu\big) + \sum_{\text{occupied}} S(C)^2\, c\, g(\bar R(C)),

with ``n_sub`` sub-steps, ``S = K (d + n_ring + n_bank)`` states (the ring grows with C), ``o`` the fixed cost of
a sub-step, ``μ`` the cost per element of a pass over a covariance (``p`` passes per sub-step), ``g(R)`` the
cost per covariance element of one ``S x S x R`` product (:func:`msrm.gp.state_space.host.gemm_acc`) at the
mean update rank ``R̄`` and ``c`` such products per sub-step (one more where the reverse pass recomputes
checkpointed chunks). ``p`` and ``c`` count the operations the code performs; ``o``, ``μ`` and ``g`` are this
machine's (:class:`Coefficients`).

Where the coefficients come from (:func:`machine_coefficients`), in order:

1. :func:`set_coefficients` (an explicit override for this process), or the ``block=`` option of the backend,
   which bypasses the model altogether;
2. a JSON file in the cache folder (:func:`cache_dir`: ``$MSRM_CACHE_DIR``, else ``$XDG_CACHE_HOME/msrm``,
   else ``~/.cache/msrm``), keyed by CPU model, physical cores, BLAS kernel (threadpoolctl's ``internal_api``,
   ``version``, ``architecture``) and the msrm and NumPy versions (:func:`machine_key`);
3. measured now (:func:`measure`: a fraction of a second of micro-benchmarks on one BLAS thread, as the host
   filter runs, each the fastest of a few repeats so that other work on the machine disturbs it little) and
   written to that file, unless ``MSRM_TUNING=off``; delete the file to measure again;
4. with ``MSRM_TUNING=off`` (or an unwritable cache and no measurement), :data:`DEFAULT_COEFFICIENTS`, the cost
   model's fallback.

The block length never changes the density (tested); only the cost does. The choice, its source and its
predicted cost are kept in the run's tables (``RunTables.block_source``, ``block_predicted_s``), which the
benchmark rows report.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["Coefficients", "DEFAULT_COEFFICIENTS", "MAX_BLOCK", "RANKS", "OPS_PER_SUB_STEP", "PASSES_PER_SUB_STEP",
           "PRODUCTS_PER_SUB_STEP", "cache_dir", "machine_key", "cache_path", "measure", "machine_coefficients",
           "set_coefficients", "predicted_seconds", "BlockChoice", "choose_block"]

# The largest block length searched (a bound of the search, not a tuned value: past it the ring alone makes S
# grow faster than the sub-step count falls).
MAX_BLOCK = 64

# The update ranks g(R) is measured at (interpolated in log R between them, held flat outside).
RANKS = (4, 8, 16, 32, 64, 128)
_SIZE = 256  # the covariance side the products and passes are measured at

# What a value+gradient sub-step does, counted from :mod:`.host` (forward step, its reverse, the weight adjoints):
# NumPy/ctypes calls (each costs about the measured call overhead), passes over an S x S array (the kept copy,
# the adjoint's half-sum and its two additions, the prediction's row and column writes) and S x S x R products
# (the forward update, the reverse pass's P̄ U).
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
    """A machine's costs for the block-length model (seconds).

    Fields:
        call_s: one small NumPy/ctypes call (the fixed cost of a sub-step is ``OPS_PER_SUB_STEP`` of them).
        pass_s: one element of a pass over an S x S float64 array.
        gemm_s: per covariance element of one S x S x R product, at each rank of ``ranks``.
        ranks: the ranks ``gemm_s`` was measured at.
        source: ``"measured"``, ``"measured_busy"`` (measured while other work kept every core busy, so used in
            this process only and not cached), ``"cached"``, ``"default"`` or ``"override"``.
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


# The fallback when measuring is off: an order-of-magnitude machine (about 1 µs a call, 1 ns an element pass,
# 10 GFLOP/s on a rank-R product with its C written once).
DEFAULT_COEFFICIENTS = Coefficients(
    call_s=1.5e-6, pass_s=1.0e-9,
    gemm_s=tuple(2.0 * r / 10e9 + 2.0e-9 for r in RANKS), ranks=RANKS, source="default")

_OVERRIDE: list = [None]


def set_coefficients(coefficients: Coefficients | None) -> None:
    """Use ``coefficients`` for every later block choice in this process (None: back to the cache/measurement)."""
    if coefficients is not None and not isinstance(coefficients, Coefficients):
        raise ValueError(f"coefficients must be a Coefficients or None, got {type(coefficients).__name__}")
    _OVERRIDE[0] = None if coefficients is None else dataclasses.replace(coefficients, source="override")


def cache_dir() -> Path:
    """The folder of msrm's per-machine cache: ``$MSRM_CACHE_DIR``, else ``$XDG_CACHE_HOME/msrm``, else
    ``~/.cache/msrm``."""
    if os.environ.get("MSRM_CACHE_DIR"):
        return Path(os.environ["MSRM_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "msrm"


@functools.lru_cache(maxsize=1)
def machine_key() -> dict:
    """What the measured coefficients depend on: CPU model and vector extension, physical cores, BLAS kernel, msrm
    and NumPy versions."""
    from ... import __version__, runtime

    blas = []
    try:
        blas = sorted({(d.get("internal_api"), d.get("version"), d.get("architecture"))
                       for d in runtime.blas_info() if d.get("user_api") == "blas"}, key=str)
    except Exception:  # pragma: no cover - threadpoolctl failure leaves the kernel unnamed
        pass
    return dict(cpu_model=runtime.cpu_model(), cpu_vector_level=runtime.cpu_vector_level(),
                physical_cores=runtime.physical_cores(),
                blas=[list(b) for b in blas], msrm=__version__, numpy=np.__version__)


def cache_path() -> Path:
    """This machine's coefficient file in :func:`cache_dir`."""
    digest = hashlib.sha256(json.dumps(machine_key(), sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / f"state_space_block-{digest}.json"


def _best(fn, repeats: int, inner: int = 1) -> float:
    """The fastest of ``repeats`` timings of ``inner`` calls of fn, per call (the minimum: least disturbed by
    other work on the machine)."""
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, time.perf_counter() - t0)
    return best / inner


def measure(repeats: int = 5) -> Coefficients:
    """Measure this machine's :class:`Coefficients` (one BLAS thread, as the host filter runs; well under a second)."""
    from .blas import gemm_acc, one_blas_thread

    rng = np.random.default_rng(0)
    S = _SIZE
    P = np.asfortranarray(rng.standard_normal((S, S)))
    Z = rng.standard_normal((S, S))
    buf = np.empty((S, S))
    x, y = rng.standard_normal((4, 4)), rng.standard_normal((4, 4))
    with one_blas_thread():
        call = _best(lambda: (x @ y).reshape(16), repeats, inner=200)

        def passes():
            np.copyto(buf, Z)
            np.add(buf, Z.T, out=buf)

        pass_s = _best(passes, repeats, inner=4) / (3 * S * S)  # three element passes (a copy, a transposed add)
        gemm = []
        for r in RANKS:
            a, b = np.asfortranarray(rng.standard_normal((S, r))), np.asfortranarray(rng.standard_normal((r, S)))
            gemm.append(_best(lambda: gemm_acc(-1e-3, a, b, P), repeats, inner=2) / (S * S))
    return Coefficients(call_s=call, pass_s=pass_s, gemm_s=tuple(gemm), ranks=RANKS, source="measured")


def _read(path: Path) -> Coefficients | None:
    try:
        obj = json.loads(path.read_text())
        if obj.get("key") != json.loads(json.dumps(machine_key())):
            return None
        c = obj["coefficients"]
        return Coefficients(call_s=float(c["call_s"]), pass_s=float(c["pass_s"]), gemm_s=tuple(map(float, c["gemm_s"])),
                            ranks=tuple(int(r) for r in c["ranks"]), source="cached")
    except (OSError, ValueError, KeyError, TypeError):
        return None


_MEMO: dict = {}


def _machine_busy() -> bool:
    """True when the 1-minute load average exceeds the physical cores: other work then competes with the
    single-threaded measurement, and its costs would describe the load rather than the machine."""
    from ... import runtime

    try:
        return os.getloadavg()[0] > runtime.physical_cores()
    except OSError:  # pragma: no cover - no load average on this platform
        return False


def machine_coefficients() -> Coefficients:
    """This machine's coefficients: the override, else the cache file, else measured now and cached, else (with
    ``MSRM_TUNING=off``) :data:`DEFAULT_COEFFICIENTS`. Read or measured once per process and cache folder.

    A measurement taken while the machine is busy (:func:`_machine_busy`) is used in this process only
    (``source="measured_busy"``) and not written, so a later process on a quieter machine measures again."""
    if _OVERRIDE[0] is not None:
        return _OVERRIDE[0]
    mode = os.environ.get("MSRM_TUNING", "measure").strip().lower()
    if mode not in ("measure", "off"):
        raise ValueError(f"MSRM_TUNING must be 'measure' or 'off', got {mode!r}")
    if mode == "off":
        return DEFAULT_COEFFICIENTS
    path = cache_path()
    memo = _MEMO.get(str(path))
    if memo is not None:
        return memo
    coeffs = _read(path)
    if coeffs is None and _machine_busy():
        coeffs = dataclasses.replace(measure(), source="measured_busy")
    elif coeffs is None:
        coeffs = measure()
        try:
            from ... import atomic

            atomic.write_json(path, dict(key=machine_key(), coefficients=coeffs.as_dict(),
                                         measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())))
        except OSError:  # an unwritable cache: use the measurement in this process only
            pass
    _MEMO[str(path)] = coeffs
    return coeffs


def predicted_seconds(n_sub: int, n_occupied: int, n_states: int, rank: float, K: int, recompute: bool,
                      coefficients: Coefficients) -> float:
    """The model's seconds for one value+gradient of ``n_sub`` sub-steps (``n_occupied`` absorbing nodes, at mean
    update rank ``rank``) of an ``n_states``-dimensional state; ``recompute``: the reverse pass recomputes the
    checkpointed chunks (one more forward product per sub-step)."""
    c = coefficients
    S2 = float(n_states) ** 2
    fixed = n_sub * (OPS_PER_SUB_STEP * c.call_s + PASSES_PER_SUB_STEP * S2 * c.pass_s)
    products = PRODUCTS_PER_SUB_STEP + (1.0 if recompute else 0.0)
    narrow = NARROW_PRODUCTS_PER_SUB_STEP + (1.0 if recompute else 0.0)
    dense = n_occupied * S2 * (products * c.gemm(rank) + narrow * c.gemm(max(rank / max(K, 1), 1.0)))
    # the rank-sized work: R x R x S products (G⁻¹Λ Uᵀ, and P̄ U against W in the reverse pass) and R x R x R
    # ones (G, its LU and inverse, the small part's reverse), at the flop rate of a rank-R product
    R = float(rank)
    flop_s = c.gemm(R) / (2.0 * max(R, 1.0))
    rrs = (RRS_PRODUCTS_PER_SUB_STEP + (1.0 if recompute else 0.0)) * 2.0 * R * R * n_states
    rrr = (RRR_FLOPS_PER_SUB_STEP + (RRR_FLOPS_RECOMPUTED if recompute else 0.0)) * R ** 3
    return float(fixed + dense + n_occupied * flop_s * (rrs + rrr))


@dataclass(frozen=True)
class BlockChoice:
    """The chosen block length, where its coefficients came from, and the model's seconds for every candidate."""

    block: int
    source: str
    predicted_s: float
    candidates: dict


def choose_block(shape_of, n_grid: int, K: int, coefficients: Coefficients | None = None) -> BlockChoice:
    """The block length C in ``1 .. min(MAX_BLOCK, n_grid)`` the cost model predicts fastest.

    ``shape_of(C)`` returns ``(n_sub, n_occupied, n_states, n_nodes, recompute)`` of the run's schedule at block
    length C (:func:`msrm.gp.state_space.prepare.schedule_shape`); the smallest C wins a tie."""
    coefficients = machine_coefficients() if coefficients is None else coefficients
    cands = {}
    for C in range(1, max(1, min(MAX_BLOCK, int(n_grid))) + 1):
        n_sub, n_occ, S, n_nodes, recompute = shape_of(C)
        rank = K * n_nodes / max(n_occ, 1)
        cands[C] = predicted_seconds(n_sub, n_occ, S, rank, K, recompute, coefficients)
    best = min(cands, key=lambda c: (cands[c], c))
    return BlockChoice(block=int(best), source=coefficients.source, predicted_s=cands[best], candidates=cands)
