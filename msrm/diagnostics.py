"""MCMC convergence diagnostics for many parameters at once (Numba-compiled kernels, NumPy, SciPy and, when
installed, ducc0's FFTs; no JAX, no ArviZ).

The numbers are the definitions of Vehtari et al. (2021, arXiv:1903.08008) as ArviZ 0.23 computes them
(``arviz.rhat``, ``arviz.ess``, ``arviz.mcse``), computed for blocks of parameters instead of one parameter at a
time through ArviZ. ArviZ 1.x computes the same numbers except the tail ESS, whose default quantiles differ (see
``tail_prob`` below and in :func:`summarize`). For draws ``x`` of one parameter, shape (C chains, D draws), with
``h = D // 2``:

* split: ``x_s`` (2C, h) stacks the first ``h`` and the last ``h`` draws of every chain (the middle draw of an odd
  ``D`` is dropped);
* rank normalisation: ``z = Phi^{-1}((r - 3/8) / (N - 3/4 + 1))`` with ``r`` the average-tie rank of a value among
  all ``N = 2C h`` values of ``x_s``;
* ``r_hat = max(R(z(x_s)), R(z(|x_s - median(x_s)|)))`` with the classic
  ``R(y) = sqrt(((n - 1)/n W + B/n) / W)``, ``W`` the mean within-chain variance and ``B/n`` the variance of chain
  means; NaN with fewer than 2 chains or 4 draws (as ArviZ);
* ``ess(y)`` (R rows, n draws): ``N / tau`` with ``tau = -1 + 2 sum_t rho_t`` over Geyer's initial monotone
  sequence of the autocorrelations ``rho_t = 1 - (W - mean_c acov_c(t)) / var_plus``;
* ``ess_bulk = ess(z(x_s))``; ``ess_tail = min(ess(split(x <= q_p)), ess(split(x <= q_{1-p})))`` with
  ``p = tail_prob`` (default 0.05: the 5% and 95% quantiles, as R ``posterior``'s ``ess_tail`` and ArviZ 0.23)
  and ``q`` the type-7 quantiles of all ``C D`` draws; ``mcse_mean = sd(x) / sqrt(ess(x_s))``;
  ``mcse_sd = sqrt((mean(c^4) - mean(c^2)^2) / ess(split(c^2)) / mean(c^2) / 4)`` with ``c = x - mean(x)``;
* a parameter with a non-finite draw gets NaN for every column but ``mean`` (NumPy's mean: NaN, or an infinity).
  ArviZ agrees for a NaN draw; for an infinite one it still ranks the draws and reports finite quantiles, R-hat
  and ESS, which this module does not: such a chain has no finite mean or variance, so the ESS and R-hat that
  rest on them are undefined, and reporting the rank-based ones alone would make an infinite draw look benign.

The numbers are exact (float64 throughout) and tested against ArviZ itself. They are computed by
:mod:`msrm.diagnostics_kernels` in one compiled pass per parameter: a bucket sort of the split draws finished by
exact comparisons, a linear merge for the folded ranks, and autocovariances summed lag by lag only as far as
Geyer's sequence runs. A variable whose sequence runs past a few dozen lags (slowly mixing chains), or whose first
first lags show that it will, is handed back with its centred rows, two real rows to one zero-padded complex row;
its lag sums at every lag come from one complex FFT per pair of rows and one inverse real FFT per variable
(:func:`_long_ess`; ducc0 runs them when installed, else ``scipy.fft``), so its cost does not grow with the length
of the sequence. Blocks of at most 64 parameters
run on a thread pool (the kernels and the FFTs release the GIL), each thread re-using its buffers from block to
block.

Numba is required (the ``bayes`` extra); it is imported, and the kernels compiled or loaded from Numba's cache, on
the first call rather than on import. Compiling them takes far longer than loading them: an install step that runs
:func:`compile_kernels` once (``python -c "import msrm.diagnostics as d; d.compile_kernels()"``) fills Numba's cache
(``__pycache__`` beside the kernels' module, or ``NUMBA_CACHE_DIR``), so that a user's first call only loads them.
"""
from __future__ import annotations

import concurrent.futures as _futures
import functools
import importlib.util
import numbers
import threading as _threading
from typing import Any, Iterable, Sequence

import numpy as np
import pandas as pd
from scipy import fft as _fft
from scipy import special as _special

if importlib.util.find_spec("numba") is None:  # installed? (checked without importing it: that waits for a call)
    raise ImportError(
        "msrm.diagnostics needs Numba, which the 'bayes' extra installs: pip install 'msrm[bayes]'"
    )

__all__ = ["summarize", "diagnose_draws", "divergence_counts", "compile_kernels", "fft_library", "COLUMNS"]

#: Columns of :func:`summarize`, in order.
COLUMNS = ("mean", "sd", "q5", "q95", "mcse_mean", "mcse_sd", "ess_bulk", "ess_tail", "r_hat")

_CHUNK = 64  # parameters per block at most: a (64, 4000) float64 block is 2 MiB, the L2 size class
#: The probabilities of the q5 and q95 columns, which with the default ``tail_prob`` also set the tail ESS.
_TAIL_PROBS = np.array([0.05, 0.95])


@functools.cache
def _kernels():
    """:mod:`msrm.diagnostics_kernels`, imported (and Numba with it) on first use."""
    from . import diagnostics_kernels

    return diagnostics_kernels


def _scratch(store: dict | None, name: str, shape: tuple, dtype=np.float64, *, zeroed: bool = False) -> np.ndarray:
    """An array of ``shape``: fresh when ``store`` is None, else a view of a buffer kept in ``store``.

    Re-using the big per-block buffers (the transposed block, the kernels' outputs and pending rows) avoids
    re-faulting fresh pages from the OS for every block. The contents are left as the last user left them, except
    that a buffer made with ``zeroed=True`` starts as zeros (a caller that never writes some of its entries, such as
    the zero padding of the pending rows, can rely on those staying 0).
    """
    size = int(np.prod(shape))
    make = np.zeros if zeroed else np.empty
    if store is None:
        return make(shape, dtype)
    buf = store.get(name)
    if buf is None or buf.size < size or buf.dtype != dtype:
        buf = store[name] = make(size, dtype)
    return buf[:size].reshape(shape)


@functools.lru_cache(maxsize=8)
def _z_table(n: int) -> np.ndarray:
    """``Phi^{-1}((r - 3/8) / (n - 3/4 + 1))`` for the ranks r = 1, 1.5, 2, ..., n (index ``2 r - 2``); read-only,
    cached per ``n``."""
    ranks = np.arange(2, 2 * n + 1) / 2.0
    c = 3 / 8
    table = _special.ndtri((ranks - c) / (n - 2 * c + 1))
    table.flags.writeable = False
    return table


# --------------------------------------------------------------------------------------------- long ESS

_FFT_BATCH = 32  # long variables per FFT call: their (32, C, m) complex rows stay near the CPU caches


@functools.cache
def _ducc_fft():
    """``ducc0.fft`` when it is installed (the ``bayes`` extra brings it), else None.

    ducc0 computes the same transforms as ``scipy.fft`` (both are pocketfft's algorithms), but vectorises each
    transform with the CPU's widest SIMD instructions, which makes the long-ESS path several times cheaper; without
    it, ``scipy.fft`` runs them and the results agree to rounding.
    """
    if importlib.util.find_spec("ducc0") is None:
        return None
    import ducc0

    return ducc0.fft


def fft_library() -> str:
    """The library that runs the long-ESS transforms: ``"ducc0 <version>"`` or ``"scipy.fft"``."""
    if _ducc_fft() is None:
        return "scipy.fft"
    import ducc0

    return f"ducc0 {ducc0.__version__}"


def _fft_len(h: int) -> int:
    """A fast complex-FFT length ``>= 2h - 1``: zero padding to it leaves no wrapped terms in any lag ``0..h-1``."""
    return _fft.next_fast_len(2 * h - 1, real=False)


def _long_ess(rows: np.ndarray, cmv: np.ndarray, R: int, h: int, store: dict | None) -> np.ndarray:
    """ESS of the variables whose Geyer sequence runs long, from every lag at once.

    ``rows`` (n, R/2, m): each variable's centred split rows two to a complex row, zero-padded to ``m >= 2h - 1``
    (read only); ``cmv`` (n,) the variance of its row means. One complex FFT per pair of rows; the summed power
    spectra of the real rows (:func:`msrm.diagnostics_kernels.pair_power`) give, by one inverse real FFT per
    variable, its lag sums ``sum_r sum_i c_ri c_r,i+t`` at every lag, exact for ``t <= m - h``; Geyer's sequence
    then runs on them as on the directly summed lags. The transforms write to buffers of their own, so the zero
    padding of ``rows`` is never overwritten.
    """
    K = _kernels()
    ducc = _ducc_fft()
    n, J, m = rows.shape
    out = np.empty(n)
    for k0 in range(0, n, _FFT_BATCH):
        k1 = min(n, k0 + _FFT_BATCH)
        power = _scratch(store, "fft_power", (k1 - k0, m // 2 + 1), np.complex128)
        if ducc is not None:
            spec = _scratch(store, "fft_spec", (k1 - k0, J, m), np.complex128)
            ducc.c2c(rows[k0:k1], axes=(2,), forward=True, out=spec, nthreads=1)
            K.pair_power(spec, power)
            acov = _scratch(store, "fft_acov", (k1 - k0, m))
            # inverse transform of the Hermitian half-spectrum, divided by m: the lag sums
            ducc.c2r(power, axes=(1,), lastsize=m, forward=False, inorm=2, out=acov, nthreads=1)
        else:
            K.pair_power(_fft.fft(rows[k0:k1], axis=-1, workers=1), power)
            acov = _fft.irfft(power, n=m, axis=-1, workers=1)
        K.geyer_rows(acov, cmv[k0:k1], R, h, out[k0:k1])
    return out


# --------------------------------------------------------------------------------------------- one block


def _kernel_probs(tail_prob: float) -> np.ndarray:
    """The block kernel's ``probs`` for ``tail_prob``, checked: :data:`_TAIL_PROBS` itself for the default 0.05
    (the tail indicators use q5 and q95), else q5's and q95's probabilities followed by ``tail_prob`` and
    ``1 - tail_prob``."""
    if isinstance(tail_prob, bool) or not isinstance(tail_prob, numbers.Real) or not 0.0 < tail_prob < 0.5:
        raise ValueError(f"tail_prob must be a number in (0, 0.5), got {tail_prob!r}")
    p = float(tail_prob)
    if p == _TAIL_PROBS[0]:
        return _TAIL_PROBS
    return np.array([_TAIL_PROBS[0], _TAIL_PROBS[1], p, 1.0 - p])


def _min_like_python(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Python's ``min(a, b)`` elementwise (``b`` only if ``b < a``; so a NaN ``a`` wins, as in ArviZ)."""
    return np.where(b < a, b, a)


def _fill_columns(out, rows, var, q05, q95, r_hat, evar, m4, ess) -> None:
    """Write every column but ``mean`` into ``out[...][rows]``: from the variance (ddof 1), the quantiles,
    R-hat, the mean squared deviation ``evar`` and its square's mean ``m4``, and the five ESS values (bulk, the two
    tail indicators, the split draws, the split squared deviations)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        out["sd"][rows] = np.sqrt(var)
        out["q5"][rows] = q05
        out["q95"][rows] = q95
        out["mcse_mean"][rows] = np.sqrt(var / ess[:, 3])
        out["mcse_sd"][rows] = np.sqrt((m4 - evar**2) / ess[:, 4] / evar / 4)
        out["ess_bulk"][rows] = ess[:, 0]
        out["ess_tail"][rows] = _min_like_python(ess[:, 1], ess[:, 2])
        out["r_hat"][rows] = r_hat


def _diagnose_short(x: np.ndarray) -> dict[str, np.ndarray]:
    """A block ``x`` (P, C, D) with fewer than 4 draws per chain: mean and sd (ddof 1; NaN for a single draw), the
    rest NaN (as ArviZ)."""
    P, C, D = x.shape
    out = {name: np.full(P, np.nan) for name in COLUMNS}
    out["mean"] = x.mean(axis=(1, 2))
    if C * D > 1:
        with np.errstate(invalid="ignore", divide="ignore"):
            out["sd"] = x.reshape(P, -1).std(axis=1, ddof=1)
    return out


def _diagnose_block(
    x: np.ndarray, store: dict | None = None, probs: np.ndarray = _TAIL_PROBS
) -> dict[str, np.ndarray]:
    """All columns for a parameter-major float64 block ``x`` (P, C, D) -> dict column -> (P,).

    ``store``: a dict in which big buffers are kept for the next block of the same thread (see :func:`_scratch`),
    or None; ``probs``: the kernel's quantile probabilities (:func:`_kernel_probs`). A parameter with a non-finite
    draw gets NumPy's mean and sd and NaN elsewhere.
    """
    P, C, D = x.shape
    if D < 4:  # only mean and sd are defined: nothing to compile for
        return _diagnose_short(x)
    K = _kernels()
    h = D // 2
    R = 2 * C
    stats = _scratch(store, "k_stats", (P, K.N_STATS))
    ess = _scratch(store, "k_ess", (P, K.N_VARS))
    pending = _scratch(store, "k_pending", (P, K.N_VARS), np.int8)
    finite = _scratch(store, "k_finite", (P,), np.bool_)
    # touched only for pending variables; their zero padding (entries h..m-1 of each row) is never written, by
    # the kernel or the transforms, so it stays as the buffer was made
    pending_rows = _scratch(store, "k_pending_rows", (P * K.N_VARS, C, _fft_len(h)), np.complex128, zeroed=True)
    pending_cmv = _scratch(store, "k_pending_cmv", (P * K.N_VARS,))
    n_pending = K.diagnose_block(x, _z_table(R * h), probs, stats, ess, pending, pending_rows, pending_cmv,
                                 finite)
    if n_pending:  # long autocorrelations: every lag from FFTs
        # the kernel's (parameter, variable) order is the row-major order of the mask
        ess[pending != 0] = _long_ess(pending_rows[:n_pending], pending_cmv[:n_pending], R, h, store)

    out = {name: np.full(P, np.nan) for name in COLUMNS}
    ok = finite
    st = stats[ok]
    out["mean"][ok] = st[:, K.MEAN]
    _fill_columns(out, ok, st[:, K.VAR], st[:, K.Q05], st[:, K.Q95], st[:, K.RHAT], st[:, K.EVAR], st[:, K.M4],
                  ess[ok])
    with np.errstate(invalid="ignore", divide="ignore"):
        bad = np.flatnonzero(~ok)
        if bad.size:  # a non-finite draw: mean and sd as NumPy gives them, the rest NaN (as ArviZ)
            flat = x[bad].reshape(bad.size, -1)
            out["mean"][bad] = flat.mean(axis=1)
            out["sd"][bad] = flat.std(axis=1, ddof=1)
    return out


# --------------------------------------------------------------------------------------------- drivers


def _default_threads() -> int:
    from .runtime import blas_threads

    return blas_threads()


def diagnose_draws(
    draws: np.ndarray, *, block_size: int = 256, num_threads: int | None = None, tail_prob: float = 0.05
) -> dict[str, np.ndarray]:
    """Diagnostics of every parameter of ``draws`` (chains, draws, params) -> dict column -> (params,).

    Args:
        draws: (C, D, P) float array (a (C, D) array is one parameter).
        block_size: most parameters per block; blocks are further capped at a cache-sized ``_CHUNK`` (64)
            parameters. Each thread keeps, re-used from block to block, a float64 copy of its block (8 C D bytes
            per parameter) and room for the centred rows of variables with long autocorrelations (40 C D bytes
            per parameter, written only for those variables).
        num_threads: blocks diagnosed concurrently on a thread pool (the compiled kernels release the GIL);
            default :func:`msrm.runtime.blas_threads`.
        tail_prob: ``ess_tail`` is the smaller ESS of the indicators ``x <= q`` at the ``tail_prob`` and the
            ``1 - tail_prob`` quantiles; a number in (0, 0.5). The default 0.05 is R ``posterior``'s and ArviZ
            0.23's convention; :func:`summarize` says how to match ArviZ 1.x. It changes no other column (q5 and
            q95 stay the 5% and 95% quantiles).

    The numbers are ArviZ's (module docstring).
    """
    draws = np.asarray(draws)
    if draws.ndim == 2:
        draws = draws[:, :, None]
    if draws.ndim != 3:
        raise ValueError(f"draws must have shape (chains, draws, params), got shape {draws.shape}")
    if not np.issubdtype(draws.dtype, np.number) and draws.dtype != bool:
        raise ValueError(f"draws must be numeric, got dtype {draws.dtype}")
    if block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    probs = _kernel_probs(tail_prob)
    C, D, P = draws.shape
    threads = _default_threads() if num_threads is None else int(num_threads)
    if threads < 1:
        raise ValueError(f"num_threads must be a positive integer, got {num_threads!r}")
    out = {name: np.empty(P) for name in COLUMNS}
    step = min(block_size, _CHUNK)
    starts = list(range(0, P, step))
    pool_threads = max(1, min(threads, len(starts)))
    # the compiled transpose reads float64 C-ordered draws in place; anything else is cast block by block
    gather = _kernels().gather_block if draws.dtype == np.float64 and draws.flags.c_contiguous else None

    stores: dict[int, dict] = {}  # per thread: buffers re-used from block to block, dropped on return

    def one(p0: int) -> None:
        p1 = min(P, p0 + step)
        store = stores.setdefault(_threading.get_ident(), {})
        block = _scratch(store, "block", (p1 - p0, C, D))
        if gather is not None:
            gather(draws, p0, block)
        else:
            np.copyto(block, np.moveaxis(draws[:, :, p0:p1], 2, 0), casting="unsafe")
        res = _diagnose_block(block, store=store, probs=probs)
        for name in COLUMNS:
            out[name][p0:p1] = res[name]

    if pool_threads <= 1:
        for p0 in starts:
            one(p0)
    else:
        with _futures.ThreadPoolExecutor(max_workers=pool_threads) as pool:
            list(pool.map(one, starts))
    return out


def compile_kernels() -> None:
    """Compile every kernel that :func:`diagnose_draws` can call (or load it from Numba's cache) on tiny draws that
    take each path: even and odd draw counts, short and long Geyer sequences. Run once at install time, it fills
    Numba's cache for later processes."""
    rng = np.random.default_rng(0)
    walk = np.cumsum(rng.standard_normal((2, 121, 2)), axis=1)  # long sequences: the FFT path
    draws = np.concatenate([walk, rng.standard_normal((2, 121, 2))], axis=2)
    diagnose_draws(draws, num_threads=1)  # odd D
    diagnose_draws(draws[:, :120].copy(), num_threads=1)


def _label(name: str, index: tuple) -> str:
    return f"{name}[{', '.join(str(v) for v in index)}]" if index else name


def _posterior_blocks(data: Any, var_names: Sequence[str] | None) -> list[tuple[str, np.ndarray, list[str]]]:
    """(variable, draws (C, D, P_v), labels) for each selected posterior variable."""
    if isinstance(data, np.ndarray) or isinstance(data, (list, tuple)):
        arr = np.asarray(data)
        if arr.ndim < 2:
            raise ValueError(f"draws must have shape (chains, draws, ...), got shape {arr.shape}")
        if var_names is not None:
            raise ValueError("var_names applies to InferenceData or a dict of arrays, not a bare array")
        flat = arr.reshape(arr.shape[0], arr.shape[1], -1)
        shape = arr.shape[2:]
        labels = [_label("x", idx) for idx in np.ndindex(*shape)] if shape else ["x"]
        return [("x", flat, labels)]
    posterior = getattr(data, "posterior", None)
    if posterior is None and isinstance(data, dict):
        items = {k: np.asarray(v) for k, v in data.items()}
        names = list(items) if var_names is None else list(var_names)
        out = []
        for name in names:
            if name not in items:
                raise KeyError(f"var_names: no variable {name!r} in the draws (have {sorted(items)})")
            arr = items[name]
            shape = arr.shape[2:]
            labels = [_label(name, idx) for idx in np.ndindex(*shape)] if shape else [name]
            out.append((name, arr.reshape(arr.shape[0], arr.shape[1], -1), labels))
        return out
    if posterior is None:
        raise ValueError(
            f"summarize needs an InferenceData with a posterior group, a dict of arrays, or an array "
            f"(chains, draws, params); got {type(data).__name__}"
        )
    names = list(posterior.data_vars) if var_names is None else list(var_names)
    out = []
    for name in names:
        if name not in posterior.data_vars:
            raise KeyError(f"var_names: no posterior variable {name!r} (have {sorted(posterior.data_vars)})")
        da = posterior[name].transpose("chain", "draw", ...)
        dims = da.dims[2:]
        coords = [np.asarray(da.coords[d].values) if d in da.coords else np.arange(da.sizes[d]) for d in dims]
        shape = tuple(da.sizes[d] for d in dims)
        labels = [_label(name, tuple(c[i] for c, i in zip(coords, idx))) for idx in np.ndindex(*shape)]
        values = np.asarray(da.values)
        out.append((name, values.reshape(values.shape[0], values.shape[1], -1), labels or [name]))
    return out


def divergence_counts(data: Any) -> dict[str, Any] | None:
    """Divergent transitions from ``sample_stats.diverging``: total, per chain and draws; None if absent."""
    stats = getattr(data, "sample_stats", None)
    if stats is None or "diverging" not in getattr(stats, "data_vars", {}):
        return None
    div = np.asarray(stats["diverging"].transpose("chain", "draw").values, dtype=bool)
    return {
        "num_divergent": int(div.sum()),
        "divergent_per_chain": [int(v) for v in div.sum(axis=1)],
        "num_draws": int(div.size),
    }


def summarize(
    data: Any,
    var_names: Iterable[str] | None = None,
    *,
    block_size: int = 256,
    num_threads: int | None = None,
    tail_prob: float = 0.05,
) -> pd.DataFrame:
    """One row per scalar parameter: mean, sd, q5, q95, mcse_mean, mcse_sd, ess_bulk, ess_tail, r_hat.

    Args:
        data: an ArviZ ``InferenceData`` (its ``posterior`` group), a dict name -> (chains, draws, ...) array, or
            one array (chains, draws) / (chains, draws, params...).
        var_names: posterior variables to include (default: all).
        block_size, num_threads: see :func:`diagnose_draws`.
        tail_prob: the tail ESS's quantiles are the ``tail_prob`` and the ``1 - tail_prob`` ones; a number in
            (0, 0.5), else ``ValueError``. It changes the ``ess_tail`` column only.

    Returns:
        DataFrame indexed by parameter label (``name[coord, ...]`` as ArviZ labels rows). Its columns follow these
        conventions:

        * ``mean``, ``sd`` (ddof 1): over all draws; ``q5``, ``q95``: type-7 quantiles over all draws (NumPy's
          default ``np.quantile``), whatever ``tail_prob``;
        * ``r_hat``, ``ess_bulk``, ``mcse_mean``, ``mcse_sd``: Vehtari et al. (2021), equal to ArviZ 0.23's and
          ArviZ 1.x's ``rhat``, ``ess(method="bulk")`` and ``mcse(method="mean"|"sd")``;
        * ``ess_tail``: the smaller ESS of the indicators ``x <= q`` at the ``tail_prob`` and the
          ``1 - tail_prob`` quantiles. The default ``tail_prob=0.05`` (the 5% and 95% quantiles) is R
          ``posterior``'s ``ess_tail``, ArviZ 0.23's ``ess(method="tail")`` and ArviZ 1.x's
          ``ess(method="tail", prob=(0.05, 0.95))``. ArviZ 1.x's default ``ess(method="tail")`` differs, on the
          same draws often by tens of percent: without ``prob`` it takes ``prob = rcParams["stats.ci_prob"]``
          (0.89) and the quantiles ``1 - prob`` and ``prob``, i.e. 11% and 89%, which ``tail_prob=1 - 0.89``
          reproduces (as it does the ``ess_tail`` column of ArviZ 1.x's ``summary``). ``tail_prob=(1 - 0.89) / 2``
          gives the ESS at the bounds of the 89% equal-tailed interval instead (ArviZ 1.x's
          ``prob=(0.055, 0.945)``), which is not ArviZ's default.

        A parameter with a NaN or infinite draw gets NaN in every column but ``mean`` (NumPy's mean: NaN, or the
        infinity). ArviZ agrees for NaN, but for an infinite draw it reports finite quantiles, R-hat and ESS
        from the ranks; here they are NaN, because a chain with an infinite draw has no finite mean or variance.
        When ``sample_stats.diverging`` exists, ``df.attrs["divergences"]`` holds :func:`divergence_counts`.
    """
    _kernel_probs(tail_prob)  # checked before any work (and when there is no variable to diagnose)
    if var_names is not None:
        var_names = [var_names] if isinstance(var_names, str) else list(var_names)
    blocks = _posterior_blocks(data, var_names)
    frames = []
    for _name, arr, labels in blocks:
        cols = diagnose_draws(arr, block_size=block_size, num_threads=num_threads, tail_prob=tail_prob)
        frames.append(pd.DataFrame({c: cols[c] for c in COLUMNS}, index=pd.Index(labels)))
    df = pd.concat(frames) if frames else pd.DataFrame(columns=list(COLUMNS))
    div = divergence_counts(data)
    if div is not None:
        df.attrs["divergences"] = div
    return df
