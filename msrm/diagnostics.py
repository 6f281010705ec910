"""MCMC convergence diagnostics for many parameters at once (pure NumPy + SciPy, no JAX, no ArviZ).

The numbers are ArviZ 0.23's definitions (``arviz.rhat``, ``arviz.ess``, ``arviz.mcse``; Vehtari et al. 2021,
arXiv:1903.08008), computed for a whole block of parameters per NumPy call instead of one parameter at a time.
For draws ``x`` of one parameter, shape (C chains, D draws), with ``h = D // 2``:

* split: ``x_s`` (2C, h) stacks the first ``h`` and the last ``h`` draws of every chain (the middle draw of an odd
  ``D`` is dropped);
* rank normalisation: ``z = Phi^{-1}((r - 3/8) / (N - 3/4 + 1))`` with ``r`` the average-tie rank of a value among
  all ``N = 2C h`` values of ``x_s``;
* ``r_hat = max(R(z(x_s)), R(z(|x_s - median(x_s)|)))`` with the classic
  ``R(y) = sqrt(((n - 1)/n W + B/n) / W)``, ``W`` the mean within-chain variance and ``B/n`` the variance of chain
  means; NaN with fewer than 2 chains or 4 draws (as ArviZ);
* ``ess(y)`` (R rows, n draws): ``N / tau`` with ``tau = -1 + 2 sum_t rho_t`` over Geyer's initial monotone
  sequence of the autocorrelations ``rho_t = 1 - (W - mean_c acov_c(t)) / var_plus``;
* ``ess_bulk = ess(z(x_s))``; ``ess_tail = min(ess(split(x <= q05)), ess(split(x <= q95)))`` with type-7
  quantiles of all ``C D`` draws; ``mcse_mean = sd(x) / sqrt(ess(x_s))``;
  ``mcse_sd = sqrt((mean(c^4) - mean(c^2)^2) / ess(split(c^2)) / mean(c^2) / 4)`` with ``c = x - mean(x)``.

Vectorisation: ranks come from one ``argsort`` per parameter block (the folded ranks from a merge of the two
already sorted halves), the autocovariances of every (parameter, chain) row from one real FFT per row with the
chain average taken in the frequency domain, so one inverse FFT per parameter. The FFT is first taken at a short
padded length that gives the leading lags exactly (zero padding to ``m`` makes lags ``0..m-n`` exact); parameters
whose Geyer sequence needs more lags are recomputed at the full length, so every result is exact.
"""
from __future__ import annotations

import concurrent.futures as _futures
from typing import Any, Iterable, Sequence

import numpy as np
import pandas as pd
from scipy import fft as _fft
from scipy import special as _special

__all__ = ["summarize", "diagnose_draws", "divergence_counts", "COLUMNS"]

#: Columns of :func:`summarize`, in order.
COLUMNS = ("mean", "sd", "q5", "q95", "mcse_mean", "mcse_sd", "ess_bulk", "ess_tail", "r_hat")

_RESOLUTION = np.finfo(float).resolution  # ArviZ's "constant draws" threshold on max - min
_TAIL_PROBS = np.array([0.05, 0.95])


# --------------------------------------------------------------------------------------------- ranks


def _z_table(n: int) -> np.ndarray:
    """``Phi^{-1}((r - 3/8) / (n - 3/4 + 1))`` for the ranks r = 1, 1.5, 2, ..., n (index ``2 r - 2``)."""
    ranks = np.arange(2, 2 * n + 1) / 2.0
    c = 3 / 8
    return _special.ndtri((ranks - c) / (n - 2 * c + 1))


def _z_sorted(s: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Normal scores of row-sorted values ``s`` (P, n), ties given their average rank (scipy's ``rankdata``).

    Without ties the score at sorted position i is ``table[2 i]``. A tie group spanning positions ``a..b`` has
    average rank ``(a + b) / 2 + 1``, i.e. ``table[a + b]``. Ties are sparse in practice (the two values next to
    the median of the folded draws are the usual one), so groups are found from the tied pairs only.
    """
    P, n = s.shape
    out = np.broadcast_to(table[::2], (P, n)).copy()
    rows, k = np.nonzero(s[:, 1:] == s[:, :-1])  # pair (k, k+1) of row ``rows`` is tied
    if rows.size:
        flat = rows * n + k  # flat position of each tied pair's first element
        new = np.ones(flat.size, bool)
        new[1:] = flat[1:] != flat[:-1] + 1  # consecutive pairs in one row chain into one group
        first = np.flatnonzero(new)
        a = k[first]
        b = np.append(k[first[1:] - 1], k[-1]) + 1
        score = table[a + b][np.cumsum(new) - 1]
        out.flat[flat] = score
        out.flat[flat + 1] = score
    return out


def _scatter(order: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Inverse permutation per row: ``out[p, order[p, i]] = values[p, i]``."""
    out = np.empty_like(values)
    np.put_along_axis(out, order, values, axis=1)
    return out


# --------------------------------------------------------------------------------------------- ESS


def _mean_acov(y: np.ndarray, m: int) -> np.ndarray:
    """Chain-averaged autocovariance ``mean_c acov_c(t)`` of ``y`` (P, R, n) from an FFT of length ``m``.

    Returns (P, min(n, m - n + 1)): lags ``0..m-n`` are exact (the zero padding keeps wrapped terms out).
    ``acov_c(t) = (1/n) sum_i (y_ci - ybar_c)(y_c,i+t - ybar_c)`` as ``arviz.stats.stats_utils.autocov``.
    """
    P, R, n = y.shape
    buf = np.zeros((P, R, m))  # centred rows written straight into the zero-padded FFT input
    np.subtract(y, y.mean(axis=-1, keepdims=True), out=buf[:, :, :n])
    f = _fft.rfft(buf, axis=-1, overwrite_x=True)
    fv = f.view(np.float64)  # (re, im) pairs: |F|^2 = re^2 + im^2, squared in place
    np.square(fv, out=fv)
    power = fv[..., 0::2].sum(axis=1)
    power += fv[..., 1::2].sum(axis=1)
    power /= R
    lags = min(n, m - n + 1)
    return _fft.irfft(power, n=m, axis=-1)[:, :lags] / n


def _ess(y: np.ndarray, short_m: bool = True) -> np.ndarray:
    """ArviZ's ``_ess`` for every parameter of ``y`` (P, R rows, n draws) at once -> (P,).

    ``rho_t = 1 - (W - mean_c acov_c(t)) / var_plus`` with ``W = mean_c acov_c(0) n/(n-1)`` and
    ``var_plus = W (n-1)/n + var(chain means, ddof=1)`` (the last term only for R > 1). With pair sums
    ``S_j = rho_2j + rho_2j+1``, Geyer's initial positive sequence stops at the first ``J`` with ``S_J <= 0`` (or
    when ``2J + 1 >= n - 3``); the monotone sequence replaces ``S_j`` by ``min(S_0..S_j)``;
    ``tau = -1 + 2 sum_{j<J} min(S_0..S_j) + rho_2J [if S_J >= 0 or rho_2J > 0]`` and
    ``ess = R n / max(tau, 1 / log10(R n))``. Constant rows (max - min < 1e-15) give ``R n``; NaN gives NaN.
    """
    y = np.asarray(y, dtype=float)
    P, R, n = y.shape
    total = R * n
    out = np.full(P, np.nan)
    if P == 0:
        return out
    finite = np.isfinite(y).all(axis=(1, 2))
    const = finite & ((y.max(axis=(1, 2)) - y.min(axis=(1, 2))) < _RESOLUTION)
    out[const] = total
    work = np.flatnonzero(finite & ~const)
    if work.size == 0:
        return out
    # powers of two: pocketfft is several times faster there than at other "fast" lengths
    m_full = 1 << int(np.ceil(np.log2(2 * n - 1)))
    m = min(1 << int(np.ceil(np.log2(n + 8))), m_full) if short_m else m_full
    todo = work
    while todo.size:
        yy = y[todo]
        acov = _mean_acov(yy, m)
        ess, resolved = _geyer(acov, yy, n, total, complete=(m == m_full))
        out[todo[resolved]] = ess[resolved]
        todo = todo[~resolved]
        m = m_full
    return out


def _geyer(acov: np.ndarray, y: np.ndarray, n: int, total: int, complete: bool) -> tuple[np.ndarray, np.ndarray]:
    """Geyer's initial monotone sequence on chain-averaged autocovariances ``acov`` (P, L) for lags ``0..L-1``.

    Returns (ess (P,), resolved (P,) bool): a row is resolved when its stopping pair lies within the lags given.
    """
    P, L = acov.shape
    R = y.shape[1]
    mean_var = acov[:, 0] * n / (n - 1.0)
    var_plus = mean_var * (n - 1.0) / n
    if R > 1:
        var_plus = var_plus + np.var(y.mean(axis=2), axis=1, ddof=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        rho = 1.0 - (mean_var[:, None] - acov) / var_plus[:, None]
    rho[:, 0] = 1.0
    jm = max(0, (n - 3) // 2)  # the loop over pairs runs while 2 j + 1 < n - 3
    npair = min(jm + 1, L // 2)  # pairs whose both lags are available
    S = rho[:, 0 : 2 * npair : 2] + rho[:, 1 : 2 * npair : 2]
    stop = ~(S[:, : min(npair, jm)] > 0)
    stop = np.concatenate([stop, np.ones((P, 1), bool)], axis=1)
    J = np.argmax(stop, axis=1)
    J = np.minimum(J, jm)
    # resolved when the stop was seen inside the available pairs, or the forced stop pair jm is available
    resolved = complete | (J < npair)
    J = np.minimum(J, npair - 1) if npair > 0 else np.zeros(P, int)
    cm = np.minimum.accumulate(S, axis=1) if npair > 0 else np.zeros((P, 0))
    j_idx = np.arange(cm.shape[1])
    head = np.where(j_idx[None, :] < J[:, None], cm, 0.0).sum(axis=1)
    rho_even = np.take_along_axis(rho, (2 * J)[:, None], axis=1)[:, 0]
    s_last = np.take_along_axis(S, J[:, None], axis=1)[:, 0] if npair > 0 else np.ones(P)
    last = np.where(J == 0, 1.0, np.where((s_last >= 0) | (rho_even > 0), rho_even, 0.0))
    tau = -1.0 + 2.0 * head + last
    tau = np.maximum(tau, 1.0 / np.log10(total))
    ess = total / tau
    ess[~np.isfinite(rho[:, 1])] = np.nan
    return ess, resolved


# --------------------------------------------------------------------------------------------- R-hat


def _rhat(z: np.ndarray) -> np.ndarray:
    """Classic R-hat of ``z`` (P, R, n): ``sqrt((B/W + n - 1) / n)``, ``B = n var(chain means)``."""
    n = z.shape[-1]
    chain_mean = z.mean(axis=2)
    chain_var = z.var(axis=2, ddof=1)
    between = n * np.var(chain_mean, axis=1, ddof=1)
    within = chain_var.mean(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.sqrt((between / within + n - 1) / n)


def _max_like_python(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Python's ``max(a, b)`` elementwise (``b`` only if ``b > a``; so a NaN ``a`` wins, as in ArviZ)."""
    return np.where(b > a, b, a)


def _min_like_python(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.where(b < a, b, a)


# --------------------------------------------------------------------------------------------- one block


def _type7_quantiles(s_full: np.ndarray, probs: np.ndarray) -> np.ndarray:
    """``scipy.stats.mstats.mquantiles(alphap=1, betap=1)`` (R type 7, ArviZ's) from row-sorted ``s_full``."""
    n = s_full.shape[1]
    if n == 1:
        return np.repeat(s_full, probs.size, axis=1)
    m = 1.0 + probs * (1.0 - 1.0 - 1.0)
    aleph = n * probs + m
    k = np.floor(aleph.clip(1, n - 1)).astype(int)
    gamma = (aleph - k).clip(0, 1)
    return (1.0 - gamma) * s_full[:, k - 1] + gamma * s_full[:, k]


def _diagnose_block(x: np.ndarray) -> dict[str, np.ndarray]:
    """All columns for a parameter-major block ``x`` (P, C, D)."""
    P, C, D = x.shape
    out = {name: np.full(P, np.nan) for name in COLUMNS}
    with np.errstate(invalid="ignore", divide="ignore"):
        out["mean"] = x.mean(axis=(1, 2))
        out["sd"] = x.reshape(P, -1).std(axis=1, ddof=1) if C * D > 1 else np.full(P, np.nan)
    finite = np.isfinite(x).all(axis=(1, 2))
    if D < 4 or not finite.any():
        return out
    rows = np.flatnonzero(finite)
    x = x[rows] if rows.size < P else x
    Pf = x.shape[0]
    h = D // 2
    if D % 2 == 0:
        xs = x.reshape(Pf, 2 * C, h)
    else:
        xs = np.concatenate([x[:, :, :h], x[:, :, D - h :]], axis=1)
    N = 2 * C * h
    flat = xs.reshape(Pf, N)
    table = _z_table(N)

    # bulk ranks: one sort of the split draws
    order = np.argsort(flat, axis=1)  # ties are averaged below, so stability is not needed
    s = np.take_along_axis(flat, order, axis=1)
    z_bulk = _scatter(order, _z_sorted(s, table)).reshape(Pf, 2 * C, h)

    # folded ranks: |x - median| is a merge of the two sorted halves around the median
    half = N // 2
    med = (s[:, half - 1] + s[:, half]) / 2.0
    runs = np.concatenate([med[:, None] - s[:, half - 1 :: -1], s[:, half:] - med[:, None]], axis=1)
    runs_index = np.concatenate([order[:, half - 1 :: -1], order[:, half:]], axis=1)  # where each came from
    order_f = np.argsort(runs, axis=1, kind="stable")  # a merge of two ascending runs
    s_f = np.take_along_axis(runs, order_f, axis=1)
    index_f = np.take_along_axis(runs_index, order_f, axis=1)
    z_fold = _scatter(index_f, _z_sorted(s_f, table)).reshape(Pf, 2 * C, h)

    # tail quantiles over all C D draws (the split drops the middle draw when D is odd)
    if D % 2 == 0:
        s_full = s
    else:
        s_full = np.sort(x.reshape(Pf, C * D), axis=1)
    q = _type7_quantiles(s_full, _TAIL_PROBS)

    def split(a: np.ndarray) -> np.ndarray:
        if D % 2 == 0:
            return a.reshape(Pf, 2 * C, h)
        return np.concatenate([a[:, :, :h], a[:, :, D - h :]], axis=1)

    ess_bulk = _ess(z_bulk)
    ess_q05 = _ess(split((x <= q[:, 0, None, None]).astype(float)))
    ess_q95 = _ess(split((x <= q[:, 1, None, None]).astype(float)))
    ess_mean = _ess(xs)
    mean = x.mean(axis=(1, 2))
    c2 = (x - mean[:, None, None]) ** 2
    ess_c2 = _ess(split(c2))
    with np.errstate(invalid="ignore", divide="ignore"):
        var = c2.sum(axis=(1, 2)) / (C * D - 1)
        mcse_mean = np.sqrt(var / ess_mean)
        evar = c2.mean(axis=(1, 2))
        varvar = ((c2**2).mean(axis=(1, 2)) - evar**2) / ess_c2
        mcse_sd = np.sqrt(varvar / evar / 4)
        if C >= 2:
            r_hat = _max_like_python(_rhat(z_bulk), _rhat(z_fold))
        else:
            r_hat = np.full(Pf, np.nan)

    out["q5"][rows] = q[:, 0]
    out["q95"][rows] = q[:, 1]
    out["mcse_mean"][rows] = mcse_mean
    out["mcse_sd"][rows] = mcse_sd
    out["ess_bulk"][rows] = ess_bulk
    out["ess_tail"][rows] = _min_like_python(ess_q05, ess_q95)
    out["r_hat"][rows] = r_hat
    return out


# --------------------------------------------------------------------------------------------- drivers


def _default_threads() -> int:
    from .runtime import blas_threads

    return blas_threads()


def diagnose_draws(
    draws: np.ndarray, *, block_size: int = 256, num_threads: int | None = None
) -> dict[str, np.ndarray]:
    """Diagnostics of every parameter of ``draws`` (chains, draws, params) -> dict column -> (params,).

    Args:
        draws: (C, D, P) float array (a (C, D) array is one parameter).
        block_size: parameters per vectorised block (bounds the temporary memory: about 40 P C D bytes).
        num_threads: blocks diagnosed concurrently (NumPy and SciPy release the GIL in sorts, FFTs and
            elementwise kernels); default :func:`msrm.runtime.blas_threads`.
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
    C, D, P = draws.shape
    threads = _default_threads() if num_threads is None else int(num_threads)
    if threads < 1:
        raise ValueError(f"num_threads must be a positive integer, got {num_threads!r}")
    out = {name: np.empty(P) for name in COLUMNS}
    starts = list(range(0, P, block_size))

    def one(p0: int) -> None:
        p1 = min(P, p0 + block_size)
        block = np.ascontiguousarray(np.moveaxis(draws[:, :, p0:p1], 2, 0), dtype=float)
        res = _diagnose_block(block)
        for name in COLUMNS:
            out[name][p0:p1] = res[name]

    if threads == 1 or len(starts) == 1:
        for p0 in starts:
            one(p0)
    else:
        with _futures.ThreadPoolExecutor(max_workers=threads) as pool:
            list(pool.map(one, starts))
    return out


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
) -> pd.DataFrame:
    """One row per scalar parameter: mean, sd, q5, q95, mcse_mean, mcse_sd, ess_bulk, ess_tail, r_hat.

    Args:
        data: an ArviZ ``InferenceData`` (its ``posterior`` group), a dict name -> (chains, draws, ...) array, or
            one array (chains, draws) / (chains, draws, params...).
        var_names: posterior variables to include (default: all).
        block_size, num_threads: see :func:`diagnose_draws`.

    Returns:
        DataFrame indexed by parameter label (``name[coord, ...]`` as ArviZ labels rows). The numbers equal
        ``arviz.rhat``, ``arviz.ess(method="bulk"|"tail")`` and ``arviz.mcse(method="mean"|"sd")``; q5/q95 are
        type-7 quantiles over all draws. When ``sample_stats.diverging`` exists, ``df.attrs["divergences"]``
        holds :func:`divergence_counts`.
    """
    if var_names is not None:
        var_names = [var_names] if isinstance(var_names, str) else list(var_names)
    blocks = _posterior_blocks(data, var_names)
    frames = []
    for _name, arr, labels in blocks:
        cols = diagnose_draws(arr, block_size=block_size, num_threads=num_threads)
        frames.append(pd.DataFrame({c: cols[c] for c in COLUMNS}, index=pd.Index(labels)))
    df = pd.concat(frames) if frames else pd.DataFrame(columns=list(COLUMNS))
    div = divergence_counts(data)
    if div is not None:
        df.attrs["divergences"] = div
    return df
