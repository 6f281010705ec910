"""An independent NumPy implementation of :mod:`msrm.diagnostics`, the exact reference its tests compare against.

Same definitions (ArviZ 0.23's ``rhat``, ``ess``, ``mcse``; see :mod:`msrm.diagnostics`), same float64 results,
computed for whole blocks of parameters per NumPy call instead of one compiled pass per parameter:

* ranks: one exact sort per row of split draws in two cheap passes (a radix sort of a monotone 16-bit bucket,
  then a merge sort of the nearly sorted values, :func:`sort_rows`); the folded ranks merge the two halves of
  that sorted row around the median with one sort of packed integer keys (:func:`fold_scores`); ties get
  average ranks as ``scipy.stats.rankdata``;
* ESS: the five variables that need one (bulk scores, the two tail indicators, the draws, the squared
  deviations) are centred per split chain into one zero-padded buffer and transformed by one batched real FFT;
  the chain average is taken on the power spectrum (one inverse FFT per variable). The transform is first taken
  at a short fast length that gives the leading lags exactly (zero padding to ``m`` makes lags ``0..m-n``
  exact); variables whose Geyer sequence needs more lags are redone at the full length, so every result is
  exact. Geyer's truncation is whole-array arithmetic over all variables;
* blocks of at most 64 parameters (their work arrays stay near the CPU caches) run on a thread pool (NumPy's
  sorts and elementwise kernels and the FFTs release the GIL); each thread re-uses its big buffers from block to
  block instead of faulting in fresh pages. With fewer blocks than threads the spare threads go to the FFTs
  (``scipy.fft`` ``workers``).

It shares no code with :mod:`msrm.diagnostics`, so the two check each other; ArviZ checks both.
"""
from __future__ import annotations

import concurrent.futures as _futures
import functools
import threading as _threading

import numpy as np
from scipy import fft as _fft
from scipy import special as _special

__all__ = ["COLUMNS", "diagnose_draws", "ess_rows", "fold_scores", "sort_rows", "z_sorted", "z_table"]

#: Columns of :func:`diagnose_draws`, as :data:`msrm.diagnostics.COLUMNS`.
COLUMNS = ("mean", "sd", "q5", "q95", "mcse_mean", "mcse_sd", "ess_bulk", "ess_tail", "r_hat")

_CHUNK = 64  # parameters per block at most: (64, 4000) float64 work arrays are 2 MiB, the L2 size class
_RESOLUTION = np.finfo(float).resolution  # ArviZ's "constant draws" threshold on max - min
_TAIL_PROBS = np.array([0.05, 0.95])


# --------------------------------------------------------------------------------------------- scratch


def _scratch(store: dict | None, name: str, shape: tuple, dtype=np.float64) -> np.ndarray:
    """An uninitialised array of ``shape``: fresh when ``store`` is None, else a view of a buffer kept in ``store``.

    Re-using the big per-block buffers (the transposed block, the FFT input and output) avoids re-faulting fresh
    pages from the OS for every block, which otherwise costs about as much as the arithmetic on them.
    """
    size = int(np.prod(shape))
    if store is None:
        return np.empty(shape, dtype)
    buf = store.get(name)
    if buf is None or buf.size < size or buf.dtype != dtype:
        buf = store[name] = np.empty(size, dtype)
    return buf[:size].reshape(shape)


# --------------------------------------------------------------------------------------------- ranks


@functools.lru_cache(maxsize=8)
def z_table(n: int) -> np.ndarray:
    """``Phi^{-1}((r - 3/8) / (n - 3/4 + 1))`` for the ranks r = 1, 1.5, 2, ..., n (index ``2 r - 2``); read-only,
    cached per ``n``."""
    ranks = np.arange(2, 2 * n + 1) / 2.0
    c = 3 / 8
    table = _special.ndtri((ranks - c) / (n - 2 * c + 1))
    table.flags.writeable = False
    return table


def z_sorted(s: np.ndarray, table: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Normal scores of row-sorted values ``s`` (P, n), ties given their average rank (scipy's ``rankdata``).

    Without ties the score at sorted position i is ``table[2 i]``. A tie group spanning positions ``a..b`` has
    average rank ``(a + b) / 2 + 1``, i.e. ``table[a + b]``. Ties are sparse in practice (the two values next to
    the median of the folded draws are the usual one), so groups are found from the tied pairs only.
    """
    P, n = s.shape
    out = np.empty((P, n)) if out is None else out
    out[...] = table[::2]
    flat = _equal_neighbours(s)  # flat position of each tied pair's first element
    if flat.size:
        k = flat % n
        new = np.ones(flat.size, bool)
        new[1:] = flat[1:] != flat[:-1] + 1  # consecutive pairs in one row chain into one group
        first = np.flatnonzero(new)
        a = k[first]
        b = np.append(k[first[1:] - 1], k[-1]) + 1
        score = table[a + b][np.cumsum(new) - 1]
        out.flat[flat] = score
        out.flat[flat + 1] = score
    return out


def _equal_neighbours(a: np.ndarray) -> np.ndarray:
    """Flat indices ``i`` (into ``a.ravel()``) with ``a[r, k] == a[r, k + 1]``, ``i = r n + k``, ascending."""
    n = a.shape[1]
    v = a.ravel()
    hit = np.flatnonzero(v[1:] == v[:-1])
    if hit.size:
        hit = hit[(hit + 1) % n != 0]  # drop pairs that straddle two rows
    return hit


def sort_rows(flat: np.ndarray, store: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Exact ascending order of every row of ``flat`` (P, n): (argsort as flat indices into ``flat.ravel()``,
    sorted values), both (P, n).

    A plain ``argsort`` of 64-bit floats is the slowest step of the diagnostics, so the order is found in two
    cheaper passes: a stable radix sort (NumPy's ``kind="stable"`` on 16-bit keys) of a monotone 16-bit bucket
    ``floor((x - min) * 65535 / (max - min))``, which leaves only values sharing a bucket out of order, then a
    stable merge sort (timsort, about linear on such nearly sorted rows) of the bucketed values. The bucket only
    decides how fast the second pass is, never the result: the second pass compares the exact values.
    """
    P, n = flat.shape
    offs = (np.arange(P, dtype=np.intp) * n)[:, None]
    lo = flat.min(axis=1, keepdims=True)
    width = flat.max(axis=1, keepdims=True) - lo
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        scale = np.where(width > 0, 65535.0 / width, 0.0)
    scale[~np.isfinite(scale)] = 0.0
    key = np.subtract(flat, lo, out=_scratch(store, "sort_key", (P, n)))
    key *= scale
    key16 = _scratch(store, "sort_key16", (P, n), np.uint16)
    np.copyto(key16, key, casting="unsafe")
    first = np.argsort(key16, axis=1, kind="stable")
    first += offs
    bucketed = np.take(flat.ravel(), first, out=key, mode="clip")
    second = np.argsort(bucketed, axis=1, kind="stable")
    second += offs
    order = np.take(first.ravel(), second, out=_scratch(store, "order", (P, n), np.intp), mode="clip")
    return order, np.take(bucketed.ravel(), second, out=_scratch(store, "sorted", (P, n)), mode="clip")


def fold_scores(
    flat: np.ndarray, order: np.ndarray, s: np.ndarray, table: np.ndarray, store: dict | None = None
) -> np.ndarray:
    """Normal scores of ``|x - median|`` for every row of ``flat`` (P, n), in ``flat``'s layout.

    ``order``, ``s``: :func:`sort_rows` of ``flat``. With ``med`` the median, ``med - s[i]`` for the lower half
    (read backwards) and ``s[i] - med`` for the upper half are two ascending runs of the folded values
    (``fl(med - x) = -fl(x - med)``, so they equal ``|x - med|`` bit for bit), and ordering the folded values is
    a merge of the two. The merge is a stable sort of 64-bit integer keys: a non-negative double's bit pattern
    orders like its value, and its lowest ``b`` bits (``2^b >= n``) are replaced by the draw's position, so one
    sort of the keys yields the positions too. Keys equal except in those bits ("suspect" neighbours) are
    settled with the exact values: an equal pair is a tie (average rank), a reversed pair is swapped; rows with a
    suspect group of three or more keys are redone with an exact stable argsort.
    """
    P, n = flat.shape
    half = n // 2
    med = (s[:, half - 1] + s[:, half]) / 2.0 if n % 2 == 0 else s[:, half].copy()  # np.median
    runs = _scratch(store, "fold_runs", (P, n))
    np.subtract(med[:, None], s[:, half - 1 :: -1], out=runs[:, :half])
    np.subtract(s[:, half:], med[:, None], out=runs[:, half:])
    offs = (np.arange(P, dtype=np.intp) * n)[:, None]
    local = np.subtract(order, offs, out=_scratch(store, "fold_local", (P, n), np.intp))  # positions in rows
    out = _scratch(store, "fold_scores", (P, n))
    bits = max(1, (n - 1).bit_length())
    exact = np.zeros(P, bool)
    if bits <= 24:
        low = np.int64((1 << bits) - 1)
        key = np.bitwise_and(runs.view(np.int64), ~low, out=_scratch(store, "fold_key", (P, n), np.int64))
        key[:, :half] |= local[:, half - 1 :: -1]
        key[:, half:] |= local[:, half:]
        key.sort(axis=1, kind="stable")
        pos = np.bitwise_and(key, low, out=local)
        key >>= bits
        flat_k = _equal_neighbours(key)
        scores = _scratch(store, "fold_sorted_scores", (P, n))
        scores[...] = table[::2]
        if flat_k.size:
            rows, k = np.divmod(flat_k, n)
            a = np.abs(flat[rows, pos[rows, k]] - med[rows])
            b = np.abs(flat[rows, pos[rows, k + 1]] - med[rows])
            chained = np.zeros(rows.size, bool)
            chained[1:] = flat_k[1:] == flat_k[:-1] + 1  # three or more keys alike
            bad = chained.copy()
            bad[:-1] |= chained[1:]
            exact[rows[bad]] = True
            swap = np.flatnonzero((a > b) & ~bad)  # a lone pair the truncated keys left reversed
            if swap.size:
                first, second = pos.flat[flat_k[swap]], pos.flat[flat_k[swap] + 1]
                pos.flat[flat_k[swap]] = second
                pos.flat[flat_k[swap] + 1] = first
            tie = (a == b) & ~bad
            tie_flat = flat_k[tie]
            scores.flat[tie_flat] = table[2 * k[tie] + 1]
            scores.flat[tie_flat + 1] = table[2 * k[tie] + 1]
        pos += offs
        out.ravel()[pos] = scores
    else:
        exact[:] = True
    redo = np.flatnonzero(exact)
    if redo.size:
        runs_index = np.empty((redo.size, n), np.intp)
        runs_index[:, :half] = order[redo, half - 1 :: -1]
        runs_index[:, half:] = order[redo, half:]
        runs_index -= offs[redo]
        sub = runs[redo]
        merge = np.argsort(sub, axis=1, kind="stable")
        scores = z_sorted(np.take_along_axis(sub, merge, axis=1), table)
        redone = np.empty((redo.size, n))
        np.put_along_axis(redone, np.take_along_axis(runs_index, merge, axis=1), scores, axis=1)
        out[redo] = redone
    return out


# --------------------------------------------------------------------------------------------- ESS


def _fft_len(n: int) -> tuple[int, int]:
    """(short, full) transform lengths for autocovariances of rows of ``n`` draws.

    A zero-padded transform of length ``m >= n`` gives lags ``0..m-n`` exactly (no wrapped terms reach them);
    ``full >= 2n - 1`` gives every lag. ``short`` leaves room for about ``max(64, n / 8)`` lags, which covers
    Geyer's truncation point for all but strongly autocorrelated parameters; both are fast FFT sizes.
    """
    full = _fft.next_fast_len(2 * n - 1, real=True)
    short = _fft.next_fast_len(n + max(64, n // 8), real=True)
    return (short if short < full else full), full


def _mean_acov(c: np.ndarray, m: int, workers: int = 1) -> np.ndarray:
    """Chain-averaged autocovariance ``mean_r acov_r(t)`` of centred rows ``c`` (..., R, n), FFT length ``m``.

    Returns (..., min(n, m - n + 1)): lags ``0..m-n`` are exact.
    ``acov_r(t) = (1/n) sum_i c_ri c_r,i+t`` (``arviz.stats.diagnostics._autocov`` after centring). The chain
    average is taken on the power spectrum, so there is one inverse transform per variable, not per row.
    """
    *lead, R, n = c.shape
    buf = np.empty((*lead, R, m))
    buf[..., :n] = c
    buf[..., n:] = 0.0
    return _acov_from_padded(buf, n, workers)


def _acov_from_padded(buf: np.ndarray, n: int, workers: int, store: dict | None = None) -> np.ndarray:
    """:func:`_mean_acov` of a zero-padded buffer (..., R, m) whose first ``n`` columns hold centred rows.

    With one worker the transforms are NumPy's (the same pocketfft), which write into buffers re-used from
    ``store``; with more, SciPy's threaded ones (``workers``).
    """
    *lead, R, m = buf.shape
    K = m // 2 + 1
    lags = min(n, m - n + 1)
    numpy_fft = workers == 1 and store is not None
    if numpy_fft:
        f = np.fft.rfft(buf, axis=-1, out=_scratch(store, "spectrum", (*lead, R, K), np.complex128))
    else:
        f = _fft.rfft(buf, axis=-1, workers=workers)
    fv = f.view(np.float64)  # (re, im) pairs: |F|^2 = re^2 + im^2, squared in place
    np.square(fv, out=fv)
    pairs = fv.sum(axis=-2, out=_scratch(store, "spectrum_pairs", (*lead, 2 * K)))  # sum over rows first
    power = np.add(pairs[..., 0::2], pairs[..., 1::2], out=_scratch(store, "power", (*lead, K)))
    power *= 1.0 / (R * n)
    if numpy_fft:
        return np.fft.irfft(power, n=m, axis=-1, out=_scratch(store, "acov", (*lead, m)))[..., :lags]
    return _fft.irfft(power, n=m, axis=-1, workers=workers)[..., :lags]


def _geyer(acov: np.ndarray, chain_mean_var: np.ndarray, n: int, total: int) -> tuple[np.ndarray, np.ndarray]:
    """Geyer's initial monotone sequence on chain-averaged autocovariances ``acov`` (K, L), lags ``0..L-1``.

    ``chain_mean_var`` (K,) is ``var(chain means, ddof=1)`` (0 for one chain). Returns (ess (K,), resolved
    (K,) bool): a row is resolved when its stopping pair lies within the lags given (always when ``L == n``).
    ``rho_t = 1 - (W - acov(t)) / var_plus`` with ``W = acov(0) n/(n-1)`` and ``var_plus = acov(0) +
    chain_mean_var``; pair sums ``S_j = rho_2j + rho_2j+1``; the positive sequence stops at the first ``J`` with
    ``S_J <= 0`` (or at ``J = (n - 3) // 2``); ``tau = -1 + 2 sum_{j<J} min(S_0..S_j) + rho_2J`` (the last term
    only when ``S_J >= 0`` or ``rho_2J > 0``, and 1 for ``J = 0``), ``ess = total / max(tau, 1 / log10(total))``.
    The stopping pair, the running minimum and the sums are whole-array operations over all rows.
    """
    K, L = acov.shape
    mean_var = acov[:, 0] * n / (n - 1.0)
    var_plus = mean_var * (n - 1.0) / n + chain_mean_var
    with np.errstate(divide="ignore", invalid="ignore"):
        rho = 1.0 - (mean_var[:, None] - acov) / var_plus[:, None]
    rho[:, 0] = 1.0
    jm = max(0, (n - 3) // 2)  # ArviZ's loop over pairs runs while 2 j + 1 < n - 3
    npair = min(jm + 1, L // 2)  # pairs whose both lags are available
    complete = L >= n
    if npair == 0:
        J = np.zeros(K, np.intp)
        resolved = np.full(K, complete or jm == 0)
        head = np.zeros(K)
        s_last = np.ones(K)
    else:
        S = rho[:, 0 : 2 * npair : 2] + rho[:, 1 : 2 * npair : 2]
        stop = ~(S[:, : min(npair, jm)] > 0)
        stop = np.concatenate([stop, np.ones((K, 1), bool)], axis=1)
        J = np.minimum(np.argmax(stop, axis=1), jm)
        resolved = complete | (J < npair)  # the stop was seen, or the forced stop pair jm is available
        J = np.minimum(J, npair - 1)
        cm = np.minimum.accumulate(S, axis=1)
        cm[np.arange(cm.shape[1])[None, :] >= J[:, None]] = 0.0
        head = cm.sum(axis=1)
        s_last = S[np.arange(K), J]
    rho_even = rho[np.arange(K), 2 * J]
    last = np.where(J == 0, 1.0, np.where((s_last >= 0) | (rho_even > 0), rho_even, 0.0))
    tau = np.maximum(-1.0 + 2.0 * head + last, 1.0 / np.log10(total))
    ess = total / tau
    ess[~np.isfinite(rho[:, 1])] = np.nan
    return ess, resolved


def _ess_centred(
    buf: np.ndarray,
    chain_mean: np.ndarray,
    const: np.ndarray,
    n: int,
    full_m: int,
    workers: int = 1,
    store: dict | None = None,
) -> np.ndarray:
    """ESS of K variables from their centred rows in a zero-padded buffer ``buf`` (K, R, m), ``m <= full_m``.

    ``chain_mean`` (K, R) are the row means removed, ``const`` (K,) marks variables ArviZ calls constant
    (``max - min`` below float resolution: ESS = draws). Variables whose Geyer sequence runs past the lags of
    the short transform are redone at ``full_m``.
    """
    K, R, _ = buf.shape
    total = R * n
    cmv = np.var(chain_mean, axis=1, ddof=1) if R > 1 else np.zeros(K)
    ess, resolved = _geyer(_acov_from_padded(buf, n, workers, store).reshape(K, -1), cmv, n, total)
    todo = np.flatnonzero(~resolved & ~const)
    if todo.size:
        redo = _mean_acov(buf[todo, :, :n], full_m, workers)
        ess[todo] = _geyer(redo, cmv[todo], n, total)[0]
    ess[const] = total
    return ess


def ess_rows(y: np.ndarray, short_m: bool = True) -> np.ndarray:
    """ArviZ's ``_ess`` for every variable of ``y`` (P, R rows, n draws) at once -> (P,).

    NaN for a variable with a non-finite draw; ``R n`` for a constant one (``max - min`` below float resolution).
    """
    y = np.asarray(y, dtype=float)
    P, R, n = y.shape
    out = np.full(P, np.nan)
    finite = np.isfinite(y).all(axis=(1, 2))
    if not finite.any():
        return out
    y = y[finite]
    short, full = _fft_len(n)
    m = short if short_m else full
    chain_mean = y.mean(axis=2)
    buf = np.empty((y.shape[0], R, m))
    np.subtract(y, chain_mean[..., None], out=buf[..., :n])
    buf[..., n:] = 0.0
    const = (y.max(axis=(1, 2)) - y.min(axis=(1, 2))) < _RESOLUTION
    out[finite] = _ess_centred(buf, chain_mean, const, n, full)
    return out


# --------------------------------------------------------------------------------------------- R-hat


def _rhat_from_moments(chain_mean: np.ndarray, chain_var: np.ndarray, n: int) -> np.ndarray:
    """Classic R-hat from per-chain means and variances (P, R): ``sqrt((B/W + n - 1) / n)``."""
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


def _diagnose_block(
    x: np.ndarray, workers: int = 1, store: dict | None = None, tail_prob: float = 0.05
) -> dict[str, np.ndarray]:
    """All columns for a parameter-major block ``x`` (P, C, D).

    ``workers``: threads inside the FFTs; ``store``: a dict in which big buffers are kept for the next block
    of the same thread (see :func:`_scratch`), or None; ``tail_prob``: the tail indicators are ``x <=`` the
    ``tail_prob`` and the ``1 - tail_prob`` quantiles (q5 and q95 stay the 5% and 95% quantiles).
    """
    P, C, D = x.shape
    out = {name: np.full(P, np.nan) for name in COLUMNS}
    out["mean"] = x.mean(axis=(1, 2))
    finite = np.isfinite(x).all(axis=(1, 2))
    direct = ~finite if D >= 4 else np.ones(P, bool)  # rows whose sd is not taken from the squared deviations
    if C * D > 1 and direct.any():
        with np.errstate(invalid="ignore", divide="ignore"):
            out["sd"][direct] = x[direct].reshape(int(direct.sum()), -1).std(axis=1, ddof=1)
    if D < 4 or not finite.any():
        return out
    rows = np.flatnonzero(finite)
    x = x[rows] if rows.size < P else x
    Pf = x.shape[0]
    h = D // 2
    R = 2 * C
    N = R * h
    if D % 2 == 0:
        xs = x.reshape(Pf, R, h)
    else:
        xs = np.concatenate([x[:, :, :h], x[:, :, D - h :]], axis=1)
    flat = xs.reshape(Pf, N)
    table = z_table(N)

    # bulk ranks: one exact sort of the split draws, scores scattered back to the draws' places
    order, s = sort_rows(flat, store)
    z_bulk = _scratch(store, "z_bulk", (Pf, R, h))
    z_bulk.ravel()[order] = z_sorted(s, table, out=_scratch(store, "z_sorted", (Pf, N)))

    # folded ranks (R-hat only)
    z_fold = fold_scores(flat, order, s, table, store).reshape(Pf, R, h)

    # q5, q95 and the tail indicators' quantiles over all C D draws (the split drops the middle draw when D is odd)
    s_full = s if D % 2 == 0 else np.sort(x.reshape(Pf, C * D), axis=1)
    q = _type7_quantiles(s_full, np.concatenate([_TAIL_PROBS, [tail_prob, 1.0 - tail_prob]]))

    # the five ESS variables, centred per split chain straight into one zero-padded FFT buffer:
    # 0 bulk normal scores, 1-2 tail indicators x <= q_lo / x <= q_hi, 3 split draws, 4 split squared deviations
    mean = x.mean(axis=(1, 2))
    c2 = np.subtract(x, mean[:, None, None], out=_scratch(store, "sq_dev", x.shape))
    np.square(c2, out=c2)
    c2s = c2.reshape(Pf, R, h) if D % 2 == 0 else np.concatenate([c2[:, :, :h], c2[:, :, D - h :]], axis=1)
    short, full = _fft_len(h)
    buf = _scratch(store, "acov_input", (Pf, 5, R, short))
    buf[..., h:] = 0.0
    cmean = np.empty((Pf, 5, R))
    const = np.empty((Pf, 5), bool)
    np.less_equal(xs, q[:, 2, None, None], out=buf[:, 1, :, :h], casting="unsafe")  # 0/1 indicator rows
    np.less_equal(xs, q[:, 3, None, None], out=buf[:, 2, :, :h], casting="unsafe")
    cmean[:, 1:3] = buf[:, 1:3, :, :h].mean(axis=3)
    buf[:, 1:3, :, :h] -= cmean[:, 1:3, :, None]
    cmean[:, 0] = z_bulk.mean(axis=2)
    np.subtract(z_bulk, cmean[:, 0, :, None], out=buf[:, 0, :, :h])
    cmean[:, 3] = xs.mean(axis=2)
    np.subtract(xs, cmean[:, 3, :, None], out=buf[:, 3, :, :h])
    cmean[:, 4] = c2s.mean(axis=2)
    np.subtract(c2s, cmean[:, 4, :, None], out=buf[:, 4, :, :h])
    const[:, 0] = s[:, 0] == s[:, -1]  # every score tied: all z equal; otherwise z spans far more than 1e-15
    ones = cmean[:, 1:3]  # fraction of ones per split chain: all 0 or all exactly 1 when constant
    const[:, 1:3] = (ones == 0).all(axis=2) | (ones == 1).all(axis=2)
    const[:, 3] = (s[:, -1] - s[:, 0]) < _RESOLUTION
    const[:, 4] = (c2s.max(axis=(1, 2)) - c2s.min(axis=(1, 2))) < _RESOLUTION
    ess = _ess_centred(
        buf.reshape(Pf * 5, R, short), cmean.reshape(Pf * 5, R), const.ravel(), h, full, workers, store
    ).reshape(Pf, 5)

    with np.errstate(invalid="ignore", divide="ignore"):
        var = c2.sum(axis=(1, 2)) / (C * D - 1)
        evar = c2.mean(axis=(1, 2))
        np.square(c2, out=c2)
        m4 = c2.mean(axis=(1, 2))
        if C >= 2:
            z_bulk -= cmean[:, 0, :, None]
            bulk_var = np.square(z_bulk, out=z_bulk).sum(axis=2) / (h - 1)
            fold_mean = z_fold.mean(axis=2)
            z_fold -= fold_mean[:, :, None]
            fold_var = np.square(z_fold, out=z_fold).sum(axis=2) / (h - 1)
            r_hat = _max_like_python(
                _rhat_from_moments(cmean[:, 0], bulk_var, h),
                _rhat_from_moments(fold_mean, fold_var, h),
            )
        else:
            r_hat = np.full(Pf, np.nan)

    _fill_columns(out, rows, var, q[:, 0], q[:, 1], r_hat, evar, m4, ess)
    return out


def _fill_columns(out, rows, var, q05, q95, r_hat, evar, m4, ess) -> None:
    """Write the columns into ``out[...][rows]``: from the variance (ddof 1), the
    quantiles, R-hat, the mean squared deviation ``evar`` and its square's mean ``m4``, and the five ESS values
    (bulk, the two tail indicators, the split draws, the split squared deviations)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        out["sd"][rows] = np.sqrt(var)
        out["q5"][rows] = q05
        out["q95"][rows] = q95
        out["mcse_mean"][rows] = np.sqrt(var / ess[:, 3])
        out["mcse_sd"][rows] = np.sqrt((m4 - evar**2) / ess[:, 4] / evar / 4)
        out["ess_bulk"][rows] = ess[:, 0]
        out["ess_tail"][rows] = _min_like_python(ess[:, 1], ess[:, 2])
        out["r_hat"][rows] = r_hat


def diagnose_draws(
    draws: np.ndarray, *, block_size: int = 256, num_threads: int = 1, tail_prob: float = 0.05
) -> dict[str, np.ndarray]:
    """Diagnostics of every parameter of ``draws`` (C, D, P), or a (C, D) array -> dict column -> (P,).

    Blocks of at most ``min(block_size, 64)`` parameters run on ``num_threads`` threads; with fewer blocks than
    threads the spare threads go to the FFTs. ``tail_prob``: the tail ESS's quantiles are the ``tail_prob`` and
    ``1 - tail_prob`` ones (0.05: q5 and q95).
    """
    draws = np.asarray(draws)
    if draws.ndim == 2:
        draws = draws[:, :, None]
    C, D, P = draws.shape
    out = {name: np.empty(P) for name in COLUMNS}
    step = min(block_size, _CHUNK)
    starts = list(range(0, P, step))
    pool_threads = max(1, min(num_threads, len(starts)))
    fft_workers = max(1, num_threads // pool_threads)
    stores: dict[int, dict] = {}  # per thread: buffers re-used from block to block

    def one(p0: int) -> None:
        p1 = min(P, p0 + step)
        store = stores.setdefault(_threading.get_ident(), {})
        block = _scratch(store, "block", (p1 - p0, C, D))
        np.copyto(block, np.moveaxis(draws[:, :, p0:p1], 2, 0), casting="unsafe")
        res = _diagnose_block(block, workers=fft_workers, store=store, tail_prob=tail_prob)
        for name in COLUMNS:
            out[name][p0:p1] = res[name]

    if pool_threads <= 1:
        for p0 in starts:
            one(p0)
    else:
        with _futures.ThreadPoolExecutor(max_workers=pool_threads) as pool:
            list(pool.map(one, starts))
    return out
