"""Compiled (Numba) kernels behind :mod:`msrm.diagnostics`: one pass per parameter, scratch allocated once per
block.

Everything a parameter needs except the rare long autocovariances is computed in one compiled loop over the
parameters of a block: the exact order of its split draws (a bucket sort finished by exact comparisons), the
normal scores of the draws and of the folded draws (a linear merge of the two sorted halves around the median),
the type-7 quantiles (q05, q95 and, when they differ, the tail indicators' own), the R-hat moments, the five ESS
variables centred per split chain, and Geyer's initial monotone sequence on autocovariances computed lag by lag
(direct sums) for as long as the sequence runs. A variable whose sequence runs past :data:`MAX_DIRECT_LAG` lags,
or is foreseen to from its first lags, is handed back with its centred rows for the FFT path of
:mod:`msrm.diagnostics` (:func:`pair_power` and :func:`geyer_rows` finish it), so every result is exact whatever
the autocorrelation. A tail indicator whose rows hold few runs of ones gets every lag sum exactly from its runs,
before any direct sum (:func:`_indicator_lag_sums`).

It needs Numba (the ``bayes`` extra); :mod:`msrm.diagnostics` imports it on its first call. The kernels release
the GIL, so blocks run concurrently on a thread pool.
"""
from __future__ import annotations

import numba as nb
import numpy as np

__all__ = ["MAX_DIRECT_LAG", "LONG_RHO", "gather_block", "diagnose_block", "pair_power", "geyer_rows"]

#: Direct autocovariance sums stop here: past it, one FFT per row costs less than further lags.
MAX_DIRECT_LAG = 48
#: Indicator series with at most this many pairs of runs of ones per row get every lag sum from their runs
#: instead of the FFT.
MAX_RUN_PAIRS = 256
#: A variable whose lag-1 and lag-3 autocorrelations (or, failing that, those of lags SECOND_LOOK / 2 - 1 and
#: SECOND_LOOK - 1), extrapolated, exceed this at MAX_DIRECT_LAG goes to the FFT without further direct sums (a
#: guess that decides only the speed).
LONG_RHO = 0.1
#: The direct sums look ahead a second time once this many lags are summed (a multiple of 4).
SECOND_LOOK = 8
_INSERTION_MAX = 24  # buckets up to this size are finished by insertion sort, larger ones by np.argsort
_RESOLUTION = np.finfo(np.float64).resolution

# indices of the per-parameter results (rows of ``stats``)
MEAN, VAR, Q05, Q95, RHAT, EVAR, M4 = range(7)
N_STATS = 7
N_VARS = 5  # ESS variables: bulk scores, the lower and upper tail indicators, split draws, split squared deviations

_opts = dict(nogil=True, cache=True, error_model="numpy")  # x / 0 gives inf or NaN, as in NumPy
#: Sums may be reassociated (vectorised): only the order of float additions changes, by a few ulps; no other
#: fast-math licence (the inputs are finite, but NaN and infinity checks must keep their meaning).
_SUMS = {"reassoc", "contract"}


@nb.njit(**_opts)
def gather_block(draws, p0, out):
    """``out[p, c, d] = draws[c, d, p0 + p]`` for a C-contiguous float64 ``draws`` (C, D, P), tile by tile."""
    C, D, _ = draws.shape
    Pb = out.shape[0]
    tile = 16
    for c in range(C):
        for d0 in range(0, D, tile):
            d1 = min(D, d0 + tile)
            for p in range(Pb):
                for d in range(d0, d1):
                    out[p, c, d] = draws[c, d, p0 + p]


@nb.njit(**_opts)
def _argsort_exact(v, order, s, counts, bucket):
    """Ascending order of ``v`` (n,) into ``order`` (int64) and the sorted values into ``s``.

    A counting sort on the monotone bucket ``floor((v - min) (2n - 1) / (max - min))`` (about two buckets per
    value) leaves only values that share a bucket out of order; one insertion pass over the whole array then
    orders them by exact comparisons. Crowded buckets (heavy tails put most draws in a few) are first ordered by
    ``np.argsort``, so the insertion pass never moves a value further than a small bucket's size and the cost
    stays O(n log n) whatever the distribution. The bucket decides only the speed,
    never the result. Scratch: ``counts`` (2n + 1,) int64, ``bucket`` (n,) int64.
    """
    n = v.size
    lo = v[0]
    hi = v[0]
    for i in range(1, n):
        x = v[i]
        lo = min(lo, x)
        hi = max(hi, x)
    nbk = 2 * n
    width = hi - lo
    scale = (nbk - 1) / width if width > 0 else 0.0
    if not (np.isfinite(scale) and np.isfinite(width)):  # max - min overflows, or a subnormal range
        idx = np.argsort(v, kind="mergesort")
        for i in range(n):
            order[i] = idx[i]
            s[i] = v[idx[i]]
        return
    for i in range(n):
        bucket[i] = min(int((v[i] - lo) * scale), nbk - 1)
    for k in range(nbk + 1):
        counts[k] = 0
    crowded = 0
    for i in range(n):
        counts[bucket[i] + 1] += 1
    for k in range(nbk):
        crowded = max(crowded, counts[k + 1])
        counts[k + 1] += counts[k]
    for i in range(n):  # counts[b]: next free slot of bucket b
        b = bucket[i]
        j = counts[b]
        order[j] = i
        s[j] = v[i]
        counts[b] = j + 1
    if crowded > _INSERTION_MAX:  # counts[b] is now the end of bucket b
        start = 0
        for b in range(nbk):
            end = counts[b]
            if end - start > _INSERTION_MAX:
                seg = s[start:end].copy()
                segi = order[start:end].copy()
                idx = np.argsort(seg, kind="mergesort")
                for k in range(end - start):
                    s[start + k] = seg[idx[k]]
                    order[start + k] = segi[idx[k]]
            start = max(start, end)
    for k in range(1, n):
        x = s[k]
        if x < s[k - 1]:
            o = order[k]
            m = k - 1
            while m >= 0 and s[m] > x:
                s[m + 1] = s[m]
                order[m + 1] = order[m]
                m -= 1
            s[m + 1] = x
            order[m + 1] = o


@nb.njit(**_opts)
def _scores_to(sorted_vals, pos, table, out):
    """``out[pos[i]]`` = normal score of the i-th smallest value; a tie group at ``a..b`` gets ``table[a + b]``
    (its average rank ``(a + b)/2 + 1``, as ``scipy.stats.rankdata(method="average")``)."""
    n = sorted_vals.size
    a = 0
    while a < n:
        b = a
        while b + 1 < n and sorted_vals[b + 1] == sorted_vals[a]:
            b += 1
        z = table[a + b]
        for k in range(a, b + 1):
            out[pos[k]] = z
        a = b + 1


@nb.njit(**_opts)
def _fold(s, order, med, fv, fpos):
    """Merge the ascending runs ``med - s[half-1], ..., med - s[0]`` and ``s[half] - med, ..., s[n-1] - med`` into
    the sorted folded values ``fv`` and their draw positions ``fpos`` (n even). ``fl(med - x) = -fl(x - med)``,
    so the merged values equal ``|x - med|`` bit for bit.

    The merge runs from both ends at once (the smallest from the middle of ``s``, the largest from its ends),
    half the outputs each, without branches: two independent chains of loads and compares, which the CPU overlaps
    where a plain merge waits on one mispredicted branch after another. Ties go to the lower run from the front
    and to the upper run from the back, one consistent order, so the two halves never take the same draw.
    """
    n = s.size
    half = n // 2
    i = half - 1  # front: lower run read backwards, upper run forwards
    j = half
    ib = 0  # back: lower run forwards from s[0], upper run backwards from s[n - 1]
    jb = n - 1
    for k in range(half):
        ii = max(i, 0)
        jj = min(j, n - 1)
        a = med - s[ii] if i >= 0 else np.inf
        b = s[jj] - med if j < n else np.inf
        ta = np.int64(a <= b)
        fv[k] = min(a, b)
        fpos[k] = order[ii] * ta + order[jj] * (1 - ta)
        i -= ta
        j += 1 - ta
        iib = min(ib, half - 1)
        jjb = max(jb, half)
        a2 = med - s[iib] if ib <= half - 1 else -np.inf
        b2 = s[jjb] - med if jb >= half else -np.inf
        tb = np.int64(b2 >= a2)
        fv[n - 1 - k] = max(a2, b2)
        fpos[n - 1 - k] = order[jjb] * tb + order[iib] * (1 - tb)
        jb -= tb
        ib += 1 - tb


@nb.njit(fastmath=_SUMS, **_opts)
def _row_means(y, R, h, out):
    """``out[r]`` = mean of row r of ``y`` (R h,) laid out as R rows of h."""
    for r in range(R):
        row = y[r * h:(r + 1) * h]
        acc = 0.0
        for i in range(h):
            acc += row[i]
        out[r] = acc / h


@nb.njit(fastmath=_SUMS, **_opts)
def _centre_rows(y, R, h, means):
    """Subtract each row's mean (``means``) from the rows of ``y`` (R h,) in place; returns the sum of squares."""
    ss = 0.0
    for r in range(R):
        row = y[r * h:(r + 1) * h]
        m = means[r]
        for i in range(h):
            d = row[i] - m
            row[i] = d
            ss += d * d
    return ss


@nb.njit(fastmath=_SUMS, **_opts)
def _moments(xp):
    """``(sum x, all finite)`` of one parameter's draws ``xp`` (C, D)."""
    acc = 0.0
    bad = 0.0
    for c in range(xp.shape[0]):
        row = xp[c]
        for d in range(row.size):
            acc += row[d]
            bad += row[d] * 0.0  # 0 for a finite draw, NaN for an infinite or NaN one
    return acc, bad == 0.0


@nb.njit(fastmath=_SUMS, **_opts)
def _deviation_moments(xp, mean):
    """``(sum (x - mean)^2, sum (x - mean)^4)`` over one parameter's draws ``xp`` (C, D)."""
    s2 = 0.0
    s4 = 0.0
    for c in range(xp.shape[0]):
        row = xp[c]
        for d in range(row.size):
            dv = row[d] - mean
            d2 = dv * dv
            s2 += d2
            s4 += d2 * d2
    return s2, s4


@nb.njit(**_opts)
def _var_ddof1(a):
    m = 0.0
    for x in a:
        m += x
    m /= a.size
    ss = 0.0
    for x in a:
        ss += (x - m) * (x - m)
    return ss / (a.size - 1)


@nb.njit(**_opts)
def _rhat(means, ss, R, h):
    """Classic R-hat from row means and the total within-row sum of squares: ``sqrt((B/W + h - 1)/h)`` with
    ``W = ss / (R (h - 1))`` (the mean within-row variance) and ``B = h var(means, ddof=1)``."""
    within = ss / (R * (h - 1.0))
    between = h * _var_ddof1(means)
    return np.sqrt((between / within + h - 1) / h)


@nb.njit(fastmath=_SUMS, **_opts)
def _lag_sums4(c, R, h, t, out):
    """``out[t + j] = sum_r sum_i c[r, i] c[r, i + t + j]`` for ``j = 0..3`` (lags past ``h - 1`` give 0), for
    centred rows ``c`` (R h,): four lags in one pass over the rows, which keeps the products in vector registers.

    Shifted views are indexed by the loop counter only: an index such as ``i + t`` with a run-time ``t`` makes
    Numba check for negative (wrap-around) indices on every access, which stops LLVM vectorising the loop.
    """
    a0 = 0.0
    a1 = 0.0
    a2 = 0.0
    a3 = 0.0
    for r in range(R):
        a = c[r * h:(r + 1) * h]
        m = max(h - t - 3, 0)
        b0 = a[t:]
        b1 = a[t + 1:]
        b2 = a[t + 2:]
        b3 = a[t + 3:]
        for i in range(m):
            ci = a[i]
            a0 += ci * b0[i]
            a1 += ci * b1[i]
            a2 += ci * b2[i]
            a3 += ci * b3[i]
        for i in range(m, max(h - t, 0)):  # the last three products of the shorter lags
            ci = a[i]
            a0 += ci * a[i + t]
            if i + t + 1 < h:
                a1 += ci * a[i + t + 1]
            if i + t + 2 < h:
                a2 += ci * a[i + t + 2]
    out[t] = a0
    out[t + 1] = a1
    out[t + 2] = a2
    out[t + 3] = a3


@nb.njit(**_opts)
def _geyer(c, R, h, cmv, rho, acov, done, limit):
    """ArviZ's ``_ess`` from lag sums ``acov[t] = sum_r sum_i c[r, i] c[r, i + t]`` of centred rows ``c`` (R rows
    of h): Geyer's initial monotone sequence.

    ``acov`` holds ``done`` valid lags; while the sequence needs more and ``done < limit``, four more lags are
    summed directly from ``c`` (``acov`` must have room for ``limit + 4`` entries). Called with every lag already
    in ``acov`` (``done >= h``), ``c`` is not read. ``cmv``: variance of the R row means (ddof 1; 0 for one row);
    ``rho`` (h,) scratch. Returns the ESS, or -1.0 when the sequence needs a lag past ``limit``.
    """
    norm = 1.0 / (R * h)  # mean over rows of acov_r(t) = (1/h) sum_i c_ri c_r,i+t
    mean_var = acov[0] * norm * h / (h - 1.0)
    var_plus = mean_var * (h - 1.0) / h
    if R > 1:
        var_plus += cmv
    rho_even = 1.0
    rho[0] = rho_even
    rho_odd = 1.0 - (mean_var - acov[1] * norm) / var_plus
    rho[1] = rho_odd
    t = 1
    while t < (h - 3) and (rho_even + rho_odd) > 0.0:
        if t + 2 >= done:
            if done >= limit:
                return -1.0
            _lag_sums4(c, R, h, done, acov)
            done += 4
        rho_even = 1.0 - (mean_var - acov[t + 1] * norm) / var_plus
        rho_odd = 1.0 - (mean_var - acov[t + 2] * norm) / var_plus
        keep = (rho_even + rho_odd) >= 0
        rho[t + 1] = rho_even if keep else 0.0  # entries never kept stay 0, as in ArviZ's zero-filled array
        rho[t + 2] = rho_odd if keep else 0.0
        t += 2
    max_t = t - 2
    if rho_even > 0:
        rho[max_t + 1] = rho_even
    t = 1
    while t <= max_t - 2:
        if (rho[t + 1] + rho[t + 2]) > (rho[t - 1] + rho[t]):
            rho[t + 1] = (rho[t - 1] + rho[t]) / 2.0
            rho[t + 2] = rho[t + 1]
        t += 2
    total = R * h
    acc = 0.0
    for k in range(max_t + 1):
        acc += rho[k]
    tau = -1.0 + 2.0 * acc
    if max_t + 1 < h:
        tau += rho[max_t + 1]
    floor = 1.0 / np.log10(total)
    if tau < floor:
        tau = floor
    for k in range(max(max_t + 2, 2)):  # every entry ever written (the rest of ArviZ's array is 0)
        if np.isnan(rho[k]):
            return np.nan
    return total / tau


@nb.njit(**_opts)
def _long_ahead(acov, R, h, cmv, a, b):
    """Whether the autocorrelations at lags ``a < b`` (from the lag sums ``acov``), extrapolated geometrically,
    are still above :data:`LONG_RHO` at lag :data:`MAX_DIRECT_LAG`: Geyer's sequence will then almost surely run
    past the direct lags, and the FFT is taken at once instead of after them. Only the speed depends on this
    guess."""
    norm = 1.0 / (R * h)
    mean_var = acov[0] * norm * h / (h - 1.0)
    var_plus = mean_var * (h - 1.0) / h
    if R > 1:
        var_plus += cmv
    ra = 1.0 - (mean_var - acov[a] * norm) / var_plus
    rb = 1.0 - (mean_var - acov[b] * norm) / var_plus
    if not (ra > LONG_RHO and rb > 0.0):
        return False
    decay = min(rb / ra, 1.0)  # over b - a lags
    return rb * decay ** ((MAX_DIRECT_LAG - b) / (b - a)) > LONG_RHO


@nb.njit(**_opts)
def _geyer_direct(c, R, h, cmv, rho, acov):
    """ArviZ's ``_ess`` on centred rows ``c`` (R rows of h) with autocovariances summed directly, four lags at a
    time and only as far as Geyer's sequence runs (``acov``: :data:`MAX_DIRECT_LAG` + 4 scratch).

    Returns the ESS, -1.0 when the sequence needs a lag past :data:`MAX_DIRECT_LAG`, or -2.0 when the lags summed
    so far show that it will (:func:`_long_ahead`, after the first 4 lags and again after :data:`SECOND_LOOK`);
    either way the caller takes the FFT path.
    """
    _lag_sums4(c, R, h, 0, acov)
    if h <= MAX_DIRECT_LAG + 4:
        return _geyer(c, R, h, cmv, rho, acov, 4, MAX_DIRECT_LAG)
    if _long_ahead(acov, R, h, cmv, 1, 3):
        return -2.0
    e = _geyer(c, R, h, cmv, rho, acov, 4, SECOND_LOOK)
    if e != -1.0:
        return e
    if _long_ahead(acov, R, h, cmv, SECOND_LOOK // 2 - 1, SECOND_LOOK - 1):
        return -2.0
    return _geyer(c, R, h, cmv, rho, acov, SECOND_LOOK, MAX_DIRECT_LAG)


@nb.njit(fastmath=_SUMS, **_opts)
def pair_power(f, out):
    """``out[k, q] = sum_j (|f[k, j, q]|^2 + |f[k, j, -q]|^2) / 2`` for ``q = 0..m // 2``: the summed power
    spectra of the real rows packed two to a complex row (``a + i b``, whose transform ``f`` gives
    ``|F_a(q)|^2 + |F_b(q)|^2 = (|f(q)|^2 + |f(-q)|^2) / 2``). ``out`` is complex (imaginary parts 0): the
    Hermitian half-spectrum that an inverse real FFT takes as it is."""
    n, J, m = f.shape
    half = m // 2
    sq = np.empty(m)
    for k in range(n):
        o = out[k]
        for q in range(half + 1):
            o[q] = 0.0
        for j in range(J):
            row = f[k, j]
            for q in range(m):
                a = row[q]
                sq[q] = a.real * a.real + a.imag * a.imag
            o[0] += sq[0]
            for q in range(1, half + 1):
                o[q] += 0.5 * (sq[q] + sq[m - q])


@nb.njit(**_opts)
def geyer_rows(acov, cmv, R, h, out):
    """ESS of each variable from its complete lag sums ``acov`` (n, >= h) and row-mean variance ``cmv`` (n,)."""
    rho = np.empty(max(h, 2))
    dummy = np.empty(1)
    for k in range(acov.shape[0]):
        out[k] = _geyer(dummy, R, h, cmv[k], rho, acov[k], acov.shape[1], 0)


@nb.njit(**_opts)
def _indicator_lag_sums(c, R, h, means, slope, out, starts, ends):
    """Lag sums ``out[t] = sum_r sum_i c[r, i] c[r, i + t]`` (t = 0..h-1) of centred 0/1 rows ``c = I - means``
    (R rows of h) from the runs of ones: the overlap of two runs as a function of the lag is a trapezoid, whose four
    slope changes go into ``slope`` (2 h + 1,) scratch, summed twice. A row's ones are its positive entries (a row
    of all ones or all zeros is centred to 0 and adds nothing). The counts are exact; the cost is linear in the
    draws plus the squared number of runs. ``starts``, ``ends``: (h,) int64 scratch for one row's runs.

    Returns False, with ``out`` undefined, when the rows hold more than :data:`MAX_RUN_PAIRS` pairs of runs per row
    (direct sums or the FFT cost less then); the runs are counted first, so that answer costs one pass.
    """
    pairs = 0
    for r in range(R):
        row = c[r * h:(r + 1) * h]
        k = 0
        prev = False
        for i in range(h):
            one = row[i] > 0.0
            if one and not prev:
                k += 1
            prev = one
        pairs += k * k
    if pairs > MAX_RUN_PAIRS * R:
        return False
    for t in range(h):
        out[t] = 0.0
    for r in range(R):
        mu = means[r]
        if not (0.0 < mu < 1.0):
            continue
        row = c[r * h:(r + 1) * h]
        k = 0  # the row's runs of ones [starts[j], ends[j])
        prev = False
        for i in range(h):
            one = row[i] > 0.0
            if one and not prev:
                starts[k] = i
            elif prev and not one:
                ends[k] = i
                k += 1
            prev = one
        if prev:
            ends[k] = h
            k += 1
        for u in range(2 * h + 1):
            slope[u] = 0.0
        # every pair of runs [x0, x1), [y0, y1): |[x0, x1) & [y0 - t, y1 - t)| changes slope by +1 at t = y0 - x1,
        # -1 at y0 - x0 and at y1 - x1, +1 at y1 - x0 (stored at index t + h)
        ones = 0.0
        for a in range(k):
            x0 = starts[a]
            x1 = ends[a]
            ones += x1 - x0
            for b in range(k):
                y0 = starts[b]
                y1 = ends[b]
                slope[y0 - x1 + h] += 1.0
                slope[y0 - x0 + h] -= 1.0
                slope[y1 - x1 + h] -= 1.0
                slope[y1 - x0 + h] += 1.0
        sl = 0.0
        g = 0.0  # overlap count S(t) = sum_{s < t} slope(s)
        for u in range(h):  # lags -h .. -1
            sl += slope[u]
            g += sl
        tail = 0.0  # ones in [h - t, h)
        head = 0.0  # ones in [0, t)
        for t in range(h):
            # sum_{i < h - t} (I_i - mu)(I_{i+t} - mu) = S(t) - mu (A_t + B_t) + mu^2 (h - t), with
            # A_t = ones in [0, h - t) and B_t = ones in [t, h)
            out[t] += g - mu * ((ones - tail) + (ones - head)) + mu * mu * (h - t)
            sl += slope[t + h]
            g += sl
            if row[h - 1 - t] > 0.0:
                tail += 1.0
            if row[t] > 0.0:
                head += 1.0
    return True


@nb.njit(**_opts)
def diagnose_block(x, table, probs, stats, ess, pending, pending_rows, pending_cmv, finite):
    """Diagnose every parameter of a block ``x`` (P, C, D), D >= 4 (definitions: :mod:`msrm.diagnostics`).

    Args:
        x: (P, C, D) float64 draws.
        table: normal scores of the ranks 1, 1.5, ..., N (N = 2 C (D // 2)), index ``2 r - 2`` for rank r.
        probs: (2,) the probabilities of the quantiles q05 and q95 (``stats``), which then also set the tail
            indicators ``x <= q05`` and ``x <= q95``; or (4,) those two followed by the lower and the upper
            probability of the tail indicators' own quantiles.
    Outputs (written):
        stats: (P, N_STATS) mean, variance (ddof 1), q05, q95, R-hat (NaN for one chain), mean of the squared
            deviations and of their squares.
        ess: (P, N_VARS) ESS of the bulk scores, the two tail indicators (``x <=`` the lower, the upper tail
            quantile), the split draws and the split squared deviations; NaN where ``pending``.
        pending: (P, N_VARS) int8: 0, or the variable's Geyer sequence needs lags past :data:`MAX_DIRECT_LAG`
            (1: found by summing them, 2: foreseen from the first lags, :func:`_long_ahead`).
        pending_rows: (P N_VARS, C, m) complex, m >= 2 h - 1, zero in entries h..m-1 of every row (which are never
            written): the centred split rows of the pending variables, in (parameter, variable) order, two to a
            complex row (rows 2j + i 2j+1), in entries 0..h-1;
        pending_cmv: (P N_VARS,) the variance of their row means (ddof 1; 0 for one row).
        finite: (P,) bool: every draw of the parameter is finite; for a parameter that is not, only ``pending``
            (all 0) is written besides.
    Returns the number of pending variables.
    """
    P, C, D = x.shape
    h = D // 2
    R = 2 * C
    N = R * h
    off = D - h  # the second half of a chain starts here (the middle draw of an odd D is dropped)
    v = np.empty(N)
    s = np.empty(N)
    order = np.empty(N, np.int64)
    counts = np.empty(2 * N + 1, np.int64)
    bucket = np.empty(N, np.int64)
    fv = np.empty(N)
    fpos = np.empty(N, np.int64)
    zf = np.empty(N)
    full = np.empty(C * D)
    rows = np.empty((N_VARS, N))
    means = np.empty((N_VARS, R))
    fmeans = np.empty(R)
    ess_scratch = _ess_scratch(h)
    nq = probs.size
    qs = np.empty(nq)
    lo = nq - 2  # qs[lo], qs[lo + 1]: the tail indicators' quantiles (q05 and q95 themselves when nq == 2)
    const = np.empty(N_VARS, np.bool_)
    n_pending = 0
    for p in range(P):
        xp = x[p]
        total_sum, ok = _moments(xp)
        finite[p] = ok
        if not ok:
            pending[p, :] = 0  # the buffers are re-used: a stale flag would claim rows never written
            continue
        mean = total_sum / (C * D)
        # split draws: chain c's halves are rows 2c and 2c + 1
        for c in range(C):
            v[2 * c * h:(2 * c + 1) * h] = xp[c, :h]
            v[(2 * c + 1) * h:(2 * c + 2) * h] = xp[c, off:]
        _argsort_exact(v, order, s, counts, bucket)
        _scores_to(s, order, table, rows[0])  # bulk normal scores, in the draws' places
        _type7_quantiles(xp, s, full, probs, qs)
        # deviations from the overall mean: moments over all draws, split rows of squared deviations
        ss2, ss4 = _deviation_moments(xp, mean)
        c2lo, c2hi = _split_rows(v, qs[lo], qs[lo + 1], mean, rows)
        for var in range(N_VARS):
            _row_means(rows[var], R, h, means[var])
        _constant_flags(s, means, c2lo, c2hi, const)
        rhat = _split_rhat(s, order, table, rows[0], means[0], fv, fpos, zf, fmeans, C, h)
        stats[p, MEAN] = mean
        stats[p, VAR] = ss2 / (C * D - 1)
        stats[p, Q05] = qs[0]
        stats[p, Q95] = qs[1]
        stats[p, RHAT] = rhat
        stats[p, EVAR] = ss2 / (C * D)
        stats[p, M4] = ss4 / (C * D)
        n_pending = _ess_of_parameter(rows, means, const, C, h, ess[p], pending[p], pending_rows, pending_cmv,
                                      n_pending, ess_scratch)
    return n_pending


@nb.njit(**_opts)
def _ess_scratch(h):
    """Scratch of the ESS step of :func:`diagnose_block` for split rows of ``h`` draws, allocated once per block:
    ``(rho (max(h, 2),), acov (MAX_DIRECT_LAG + 4,), acov_all (max(h, 4),), slope (2 h + 1,), run_starts (h,) int64,
    run_ends (h,) int64)``."""
    return (np.empty(max(h, 2)), np.empty(MAX_DIRECT_LAG + 4), np.empty(max(h, 4)), np.empty(2 * h + 1),
            np.empty(h, np.int64), np.empty(h, np.int64))


@nb.njit(**_opts)
def _type7_quantiles(xp, s, full, probs, qs):
    """``qs[j]`` = type-7 quantile of probability ``probs[j]`` over all C D draws of ``xp`` (C, D). With an even D
    the sorted split draws ``s`` (C D,) are those draws; with an odd D (whose middle draw the split drops) the draws
    are copied into the scratch ``full`` (C D,) and sorted."""
    C, D = xp.shape
    if D % 2 == 0:
        srt = s
    else:
        k = 0
        for c in range(C):
            for d in range(D):
                full[k] = xp[c, d]
                k += 1
        srt = np.sort(full)
    nf = srt.size
    for j in range(probs.size):
        pr = probs[j]
        aleph = nf * pr + (1.0 - pr)
        kk = int(np.floor(min(max(aleph, 1.0), nf - 1.0)))
        gamma = min(max(aleph - kk, 0.0), 1.0)
        qs[j] = (1.0 - gamma) * srt[kk - 1] + gamma * srt[kk]


@nb.njit(**_opts)
def _split_rows(v, q_lo, q_hi, mean, rows):
    """Fill rows 1..4 of ``rows`` (N_VARS, N) from the split draws ``v`` (N,): the tail indicators ``v <= q_lo``
    and ``v <= q_hi`` (1.0 or 0.0), the draws, and their squared deviations from ``mean``; returns the smallest
    and the largest squared deviation (a constant row is detected from their spread)."""
    c2lo = np.inf
    c2hi = -np.inf
    for i in range(v.size):
        vi = v[i]
        rows[1, i] = 1.0 if vi <= q_lo else 0.0
        rows[2, i] = 1.0 if vi <= q_hi else 0.0
        rows[3, i] = vi
        dv = vi - mean
        d2 = dv * dv
        rows[4, i] = d2
        c2lo = min(c2lo, d2)
        c2hi = max(c2hi, d2)
    return c2lo, c2hi


@nb.njit(**_opts)
def _constant_flags(s, means, c2lo, c2hi, const):
    """``const[var]`` (N_VARS,) = ESS variable ``var`` is constant (its ESS is then N), from the sorted split draws
    ``s`` (N,), the row means ``means`` (N_VARS, R) and the range ``c2lo``..``c2hi`` of the squared deviations."""
    N = s.size
    R = means.shape[1]
    const[0] = s[0] == s[N - 1]  # every score tied: all z equal; otherwise they span far more than 1e-15
    const[1] = False
    const[2] = False
    for var in (1, 2):  # an indicator is constant when every row is all 0 or every row all 1
        all0 = True
        all1 = True
        for r in range(R):
            all0 = all0 and means[var, r] == 0.0
            all1 = all1 and means[var, r] == 1.0
        const[var] = all0 or all1
    const[3] = (s[N - 1] - s[0]) < _RESOLUTION
    const[4] = (c2hi - c2lo) < _RESOLUTION


@nb.njit(**_opts)
def _split_rhat(s, order, table, z, zmeans, fv, fpos, zf, fmeans, C, h):
    """R-hat of one parameter: the larger of those of the bulk scores ``z`` (2 C h,) with row means ``zmeans``
    (2 C,) and of the folded scores (NaN for one chain). Centres the rows of ``z`` in place in every case (the ESS
    of the bulk scores uses them centred); ``fv``, ``fpos``, ``zf`` (2 C h,) and ``fmeans`` (2 C,) are scratch
    for the folded draws, their places, their scores and their row means."""
    R = 2 * C
    N = R * h
    bulk_ss = _centre_rows(z, R, h, zmeans)
    rhat = np.nan
    if C >= 2:
        med = (s[N // 2 - 1] + s[N // 2]) / 2.0
        _fold(s, order, med, fv, fpos)
        _scores_to(fv, fpos, table, zf)
        _row_means(zf, R, h, fmeans)
        fold_ss = _centre_rows(zf, R, h, fmeans)
        rb = _rhat(zmeans, bulk_ss, R, h)
        rf = _rhat(fmeans, fold_ss, R, h)
        rhat = rf if rf > rb else rb  # Python's max(rb, rf): a NaN rb wins
    return rhat


@nb.njit(**_opts)
def _ess_of_parameter(rows, means, const, C, h, ess_p, pending_p, pending_rows, pending_cmv, n_pending, scratch):
    """ESS of the N_VARS variables of one parameter from its split rows ``rows`` (N_VARS, 2 C h) (row 0 already
    centred) and row means ``means`` (N_VARS, 2 C): writes ``ess_p`` and ``pending_p`` (N_VARS,), the parameter's
    rows of ``ess`` and ``pending`` (:func:`diagnose_block`). A variable whose Geyer sequence needs lags past
    :data:`MAX_DIRECT_LAG` gets NaN and its centred rows go to ``pending_rows[n_pending]`` (two split rows to a
    complex row) and its row means' variance to ``pending_cmv[n_pending]``; returns the new ``n_pending``.
    ``scratch`` is :func:`_ess_scratch`'s tuple."""
    rho, acov, acov_all, slope, run_starts, run_ends = scratch
    R = 2 * C
    N = R * h
    for var in range(N_VARS):
        pending_p[var] = 0
        if const[var]:
            ess_p[var] = N
            continue
        if var > 0:
            _centre_rows(rows[var], R, h, means[var])
        cmv = _var_ddof1(means[var]) if R > 1 else 0.0
        if (var == 1 or var == 2) and _indicator_lag_sums(rows[var], R, h, means[var], slope, acov_all,
                                                          run_starts, run_ends):
            e = _geyer(rows[var], R, h, cmv, rho, acov_all, h, 0)  # tail indicator with few runs: every lag
        else:
            e = _geyer_direct(rows[var], R, h, cmv, rho, acov)
        if e < 0.0:  # -1.0: past the direct lags; -2.0: foreseen from the first lags
            pending_p[var] = 1 if e == -1.0 else 2
            ess_p[var] = np.nan
            pending_cmv[n_pending] = cmv
            for j in range(C):  # split rows 2j and 2j + 1 as one complex row
                o = pending_rows[n_pending, j]
                a = rows[var, 2 * j * h:(2 * j + 1) * h]
                b = rows[var, (2 * j + 1) * h:(2 * j + 2) * h]
                for i in range(h):  # entries h..m-1 stay the caller's zeros
                    o[i] = complex(a[i], b[i])
            n_pending += 1
        else:
            ess_p[var] = e
    return n_pending
