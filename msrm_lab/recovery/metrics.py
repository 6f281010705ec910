r"""How well a fitted model recovers a known truth: latent subspaces, aligned fits, responses and coverage.

Latent-factor models identify their factors only up to a transform (R-MSRM: a rotation; GP-MSRM: sign and order;
PCA-like peers: a rotation and a scale), so every latent metric here is invariant to the freedom it must forgive,
and says which:

- :func:`subspace_error` forgives any invertible linear map (and a shift of the mean): it asks only whether the
  estimated factors span the true ones.
- :func:`aligned_r2` forgives an affine map from the estimate to the truth (least squares with an intercept) and
  scores each true factor separately.
- :func:`aligned_band` moves a posterior band onto the truth by a rotation or reflection only (orthogonal
  Procrustes after centring), which keeps the band's width, or by an affine map, which also corrects the scale;
  the band is then scored by :func:`band_coverage`.
- :func:`truth_in_fitted_frame` fits nothing to the truth: it carries the true latents into the fitted model's
  own frame through the two models' loadings and intercepts, so that the fitted posterior band is judged as it
  stands.

Latents are given per run, each a (J, K) array on the run's latent grid (``msrm.latent_grid``), or as one such
array. Several runs share their factors, so one map is fitted to the grid points of all runs together (means are
pooled over runs), as :func:`msrm.align` does. ``mask`` selects the grid points that enter a metric: one (J,) bool
array per run (:func:`edge_mask` gives the points inside the observed span less an edge margin), or None for all.
Values outside the mask may be NaN (a peer method leaves grid points beyond its samples undefined).

All arrays are float64; bad input raises ``ValueError`` naming the argument.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = [
    "edge_mask", "subspace_error", "aligned_r2", "align_to_truth", "response_errors", "flat_response_errors",
    "best_shift", "aligned_band", "truth_in_fitted_frame", "band_coverage", "interval_coverage", "central_interval", "binomial_sd", "Z90",
]

# the two-sided 90% standard normal quantile: a 90% band is mean +- Z90 sd
Z90 = 1.6448536269514722


# ----------------------------------------------------------------------------------------------- input handling
def _runs(x, name: str, finite: bool = True) -> list[np.ndarray]:
    """A (J, K) array or a list of them -> list of float64 (J_r, K) arrays with one K (finite unless
    ``finite=False``: then the caller checks the points it uses)."""
    items = list(x) if isinstance(x, (list, tuple)) else [x]
    if not items:
        raise ValueError(f"{name}: an empty list of runs")
    out = []
    for r, z in enumerate(items):
        a = np.asarray(z, dtype=np.float64)
        if a.ndim == 1:
            a = a[:, None]
        if a.ndim != 2 or a.shape[0] == 0 or a.shape[1] == 0:
            raise ValueError(f"{name}[{r}]: expected a (J, K) array, got shape {a.shape}")
        if finite and not np.isfinite(a).all():
            raise ValueError(f"{name}[{r}]: contains non-finite values (NaN or inf)")
        out.append(a)
    if len({a.shape[1] for a in out}) != 1:
        raise ValueError(f"{name}: runs have different numbers of factors {[a.shape[1] for a in out]}")
    return out


def _masks(mask, runs: list[np.ndarray], name: str = "mask") -> list[np.ndarray]:
    """None, a (J,) bool array or a list of them (one per run) -> list of (J_r,) bool arrays."""
    if mask is None:
        return [np.ones(a.shape[0], dtype=bool) for a in runs]
    items = list(mask) if isinstance(mask, (list, tuple)) else [mask]
    if len(items) != len(runs):
        raise ValueError(f"{name}: {len(items)} masks for {len(runs)} runs")
    out = []
    for r, (m, a) in enumerate(zip(items, runs)):
        m = np.asarray(m)
        if m.dtype != bool or m.shape != (a.shape[0],):
            raise ValueError(f"{name}[{r}]: expected a ({a.shape[0]},) bool array, got {m.dtype} {m.shape}")
        out.append(m)
    if not any(m.any() for m in out):
        raise ValueError(f"{name}: selects no grid point")
    return out


def _pair(true, est, mask, true_name="true", est_name="est"):
    """Stacked masked rows (n, K_true), (n, K_est) of truth and estimate over all runs (values outside the mask
    may be NaN, e.g. a peer's latents beyond its sampled span; inside it they must be finite)."""
    T = _runs(true, true_name, finite=False)
    E = _runs(est, est_name, finite=False)
    if len(T) != len(E):
        raise ValueError(f"{true_name} has {len(T)} runs but {est_name} has {len(E)}")
    for r, (t, e) in enumerate(zip(T, E)):
        if t.shape[0] != e.shape[0]:
            raise ValueError(f"run {r}: {true_name} has {t.shape[0]} grid points but {est_name} has {e.shape[0]}")
    M = _masks(mask, T)
    Zm = np.concatenate([t[m] for t, m in zip(T, M)])
    Em = np.concatenate([e[m] for e, m in zip(E, M)])
    for name, a in ((true_name, Zm), (est_name, Em)):
        if not np.isfinite(a).all():
            raise ValueError(f"{name}: non-finite values (NaN or inf) at grid points the mask selects")
    return Zm, Em


def _basis(x: np.ndarray, rtol: float = 1e-10) -> np.ndarray:
    """Orthonormal basis (n, r) of the column space of x: left singular vectors with s > rtol * s_max."""
    u, s, _ = np.linalg.svd(x, full_matrices=False)
    if s.size == 0 or s[0] == 0.0:
        return u[:, :0]
    return u[:, s > rtol * s[0]]


# ------------------------------------------------------------------------------------------------------ masks
def edge_mask(grid, span, drop: float = 8.0) -> np.ndarray:
    """Grid points inside the observed span less a margin at each end: ``start + drop <= tau <= end - drop``.

    Near the ends of a recording the latents are seen by few samples (and, with lagged responses, by none at the
    very start), so every method extrapolates there; the margin keeps that out of the comparison.

    Args:
        grid: (J,) grid times (seconds).
        span: ``(start, end)`` of the observed span of the run (seconds), start < end.
        drop: the margin in seconds (>= 0).
    Returns:
        (J,) bool.
    """
    g = np.asarray(grid, dtype=np.float64)
    if g.ndim != 1 or g.size == 0 or not np.isfinite(g).all():
        raise ValueError(f"grid: expected a finite 1-d array, got shape {g.shape}")
    try:
        start, end = (float(v) for v in span)
    except (TypeError, ValueError):
        raise ValueError(f"span: expected (start, end), got {span!r}") from None
    if not (math.isfinite(start) and math.isfinite(end) and start < end):
        raise ValueError(f"span: expected finite start < end, got {span!r}")
    drop = float(drop)
    if not (math.isfinite(drop) and drop >= 0):
        raise ValueError(f"drop: expected a finite number >= 0, got {drop!r}")
    if start + drop > end - drop:
        raise ValueError(f"drop: a margin of {drop:g} s at each end leaves nothing of the span {span!r}")
    return (g >= start + drop) & (g <= end - drop)


# ----------------------------------------------------------------------------------------------- latent metrics
def subspace_error(true, est, mask=None) -> float:
    r"""Relative part of the true latents outside the span of the estimated ones.

    With Z (n, K) the true latents and E (n, K') the estimate on the selected grid points (all runs stacked), both
    centred (column means removed), and Q an orthonormal basis of the columns of E:

    .. math:: \mathrm{err} = \lVert Z - Q Q^\top Z \rVert_F / \lVert Z \rVert_F \in [0, 1].

    0 when E = Z A + 1 c^T for an invertible A (any rotation, scaling or mixing of the factors); 1 when every
    estimated factor is orthogonal to every true one. K' may differ from K: more estimated factors can only lower
    the error, so compare methods at the same K'.
    """
    Z, E = _pair(true, est, mask)
    Z = Z - Z.mean(axis=0)
    E = E - E.mean(axis=0)
    nz = np.linalg.norm(Z)
    if nz == 0.0:
        raise ValueError("true: the selected true latents are constant, so there is no subspace to recover")
    Q = _basis(E)
    return float(np.linalg.norm(Z - Q @ (Q.T @ Z)) / nz)


def aligned_r2(true, est, mask=None) -> np.ndarray:
    r"""R^2 of each true factor predicted from the estimate by least squares with an intercept.

    Solves ``min_{A, c} ||Z - E A - 1 c^T||_F`` over the selected grid points (one map for all runs) and returns,
    per true factor k, ``1 - SSE_k / SST_k`` with SST_k the squared deviations of Z[:, k] from its mean: 1 when the
    factor is an exact affine function of the estimate, 0 when the estimate explains none of it.

    Returns:
        (K_true,) float64.
    """
    Z, E = _pair(true, est, mask)
    X = np.column_stack([np.ones(E.shape[0]), E])
    coef, *_ = np.linalg.lstsq(X, Z, rcond=None)
    resid = Z - X @ coef
    sst = ((Z - Z.mean(axis=0)) ** 2).sum(axis=0)
    if np.any(sst == 0.0):
        raise ValueError("true: a selected true factor is constant, so its R^2 is undefined")
    return 1.0 - (resid ** 2).sum(axis=0) / sst


def best_shift(true, est, grid, mask=None, *, max_shift: float = 10.0,
               step: float | None = None) -> tuple[float, float]:
    r"""The time shift s that best lines the estimate up with the truth, and the subspace error there.

    Evaluates the estimate at shifted times, ``E_s(tau) = E(tau + s)`` (linear interpolation on the grid, one
    run's grid given; the ends held constant), for s on a regular set in ``[-max_shift, max_shift]`` and returns
    the s with the smallest :func:`subspace_error` of the truth against ``E_s``. A positive s means the estimate
    runs *late* by s seconds (``E(tau + s)`` matches ``Z(tau)``): a latent recovered s seconds late is what a
    response lag that is s seconds too short produces.

    Args:
        true, est: (J, K) arrays of one run on ``grid``.
        grid: (J,) the run's grid times.
        mask: (J,) bool, the points compared (keep it away from the ends by more than ``max_shift``).
        max_shift: the largest shift tried (seconds, > 0).
        step: spacing of the shifts tried (default a tenth of the grid step).
    Returns:
        ``(shift, error)``.
    """
    Z = _runs(true, "true")
    E = _runs(est, "est")
    if len(Z) != 1 or len(E) != 1:
        raise ValueError("best_shift: give one run (a (J, K) array) of true and est")
    Z, E = Z[0], E[0]
    g = np.asarray(grid, dtype=np.float64)
    if g.shape != (Z.shape[0],) or E.shape[0] != Z.shape[0]:
        raise ValueError(f"grid: expected shape ({Z.shape[0]},) matching true and est, got {g.shape}")
    if not (np.isfinite(max_shift) and max_shift > 0):
        raise ValueError(f"max_shift: expected a positive number, got {max_shift!r}")
    dg = float(np.median(np.diff(g))) if g.size > 1 else 1.0
    step = dg / 10.0 if step is None else float(step)
    if not (math.isfinite(step) and step > 0):
        raise ValueError(f"step: expected a positive number, got {step!r}")
    n = int(math.floor(max_shift / step + 1e-9))
    shifts = step * np.arange(-n, n + 1)
    best = (0.0, math.inf)
    for s in shifts:
        Es = np.column_stack([np.interp(g + s, g, E[:, k]) for k in range(E.shape[1])])
        err = subspace_error(Z, Es, mask)
        if err < best[1] - 1e-15:
            best = (float(s), err)
    return best


# -------------------------------------------------------------------------------------------------- responses
def response_errors(fitted: dict, truth: dict) -> dict[str, dict[str, float]]:
    """Absolute error of each fitted response parameter: ``{key: {param: |fitted - true|}}``.

    Args:
        fitted: ``Params.response`` of a fit, ``{key: {param: value}}`` with key a modality (shared pooling) or
            ``"participant/modality"`` (individual pooling).
        truth: the true responses ``{modality or key: {param: value}}``.
    Returns:
        one entry per fitted key whose key (or, for ``"participant/modality"``, whose modality) has a truth, with
        the parameters both have (a fixed parameter such as GaussianLag's width is not fitted, and a true response
        of another form has other parameters: neither is scored).
    """
    if not isinstance(fitted, dict) or not isinstance(truth, dict):
        raise ValueError(f"fitted and truth must be dicts {{key: {{param: value}}}}, got "
                         f"{type(fitted).__name__} and {type(truth).__name__}")
    out: dict[str, dict[str, float]] = {}
    for key, theta in fitted.items():
        true_theta = truth.get(key, truth.get(str(key).split("/")[-1]))
        if true_theta is None:
            continue
        errs = {}
        for name, value in dict(theta).items():
            if name not in true_theta:
                continue
            v, t = float(value), float(true_theta[name])
            if not (math.isfinite(v) and math.isfinite(t)):
                raise ValueError(f"response {key!r}.{name}: non-finite value (fitted {v!r}, true {t!r})")
            errs[name] = abs(v - t)
        if errs:
            out[str(key)] = errs
    return out


def flat_response_errors(errors: dict[str, dict[str, float]]) -> dict[str, float]:
    """``{"rating": {"lag": e}}`` -> ``{"rating/lag": e}`` (one name per row of a results table)."""
    return {f"{key}/{name}": float(v) for key, theta in errors.items() for name, v in theta.items()}


# --------------------------------------------------------------------------------------------- bands, coverage
def align_to_truth(true, est, mask=None, *, map: str = "affine") -> dict[str, Any]:
    r"""Map an estimate onto the truth: ``E -> (E - m) A + t``, fitted on the selected grid points of all runs.

    m and t are the pooled means of the estimate and the truth over those points; A (K', K) is

    - ``map="affine"``: the least-squares solution of ``min_A ||(E - m) A - (Z - t)||_F`` (any matrix, so K' may
      differ from K); the map behind :func:`aligned_r2`;
    - ``map="procrustes"``: the orthogonal A minimising the same norm (rotations and reflections; K' = K).

    Values outside the mask may be NaN (they stay NaN).

    Returns:
        dict with ``latents`` (list over runs of the mapped (J, K) estimate), ``transform`` A, ``center`` m,
        ``offset`` t and ``map``.
    """
    from scipy.linalg import orthogonal_procrustes

    if map not in ("procrustes", "affine"):
        raise ValueError(f"map: expected 'procrustes' or 'affine', got {map!r}")
    Zs, Es = _pair(true, est, mask)
    E = _runs(est, "est", finite=False)
    if map == "procrustes" and Zs.shape[1] != Es.shape[1]:
        raise ValueError(f"est: {Es.shape[1]} factors but true has {Zs.shape[1]} (Procrustes needs the same K)")
    c, o = Es.mean(axis=0), Zs.mean(axis=0)
    if map == "procrustes":
        A, _ = orthogonal_procrustes(Es - c, Zs - o)
    else:
        A, *_ = np.linalg.lstsq(Es - c, Zs - o, rcond=None)
    return {"latents": [(e - c) @ A + o for e in E], "transform": A, "center": c, "offset": o, "map": map}


def aligned_band(true, mean, mask=None, *, cov=None, sd=None, z: float = Z90,
                 map: str = "procrustes") -> dict[str, Any]:
    r"""Map a posterior band onto the truth and return the mapped band.

    The map ``M -> (M - m) A + t`` is fitted on the selected grid points of all runs (M the posterior mean, Z the
    truth, m and t their pooled means over those points) and applied to every point:

    - ``map="procrustes"``: A orthogonal (rotations and reflections),
      ``A = argmin_{A^T A = I} ||(M - m) A - (Z - t)||_F``. It moves the band without changing its width or the
      scale of the estimate, so the coverage judges the band as the model reports it (up to the rotation no
      model can identify).
    - ``map="affine"``: A the least-squares solution of the same problem (any K x K matrix). It also corrects the
      estimate's scale, so the band is judged after that correction (the difference between the two coverages
      is the part of a miss that is a scale error).

    The mapped marginal sd:

    - with the per-point K x K posterior covariance C_j (``cov``, (J, K, K) per run), exactly
      ``sd'_j = sqrt(diag(A^T C_j A))``;
    - with marginal sds only (``sd``), approximately ``sd'_j^2 = sd_j^2 (A * A)``, which ignores the posterior
      correlation between factors at a point (exact when A is a signed permutation or C_j diagonal).

    Returns:
        dict with ``mean``, ``sd``, ``lower``, ``upper`` (mean -+ z sd; lists over runs of (J, K)), ``transform``
        (K, K) A, ``center`` (K,) m, ``offset`` (K,) t, ``map`` and ``exact_sd`` (True when ``cov`` was used).
    """
    T = _runs(true, "true")
    Mn = _runs(mean, "mean")
    if len(T) != len(Mn):
        raise ValueError(f"true has {len(T)} runs but mean has {len(Mn)}")
    for r, (t, m) in enumerate(zip(T, Mn)):
        if t.shape != m.shape:
            raise ValueError(f"run {r}: true {t.shape} and mean {m.shape} differ (the map needs the same K)")
    if (cov is None) == (sd is None):
        raise ValueError("aligned_band: give exactly one of cov (per-point K x K covariances) or sd")
    if not (math.isfinite(z) and z > 0):
        raise ValueError(f"z: expected a positive number, got {z!r}")
    fit = align_to_truth(T, Mn, mask, map=map)
    A, c, o, new_mean = fit["transform"], fit["center"], fit["offset"], fit["latents"]
    K = A.shape[0]
    if cov is not None:
        covs = list(cov) if isinstance(cov, (list, tuple)) else [cov]
        if len(covs) != len(Mn):
            raise ValueError(f"cov: {len(covs)} runs for {len(Mn)}")
        new_sd = []
        for r, (C, m) in enumerate(zip(covs, Mn)):
            C = np.asarray(C, dtype=np.float64)
            if C.shape != (m.shape[0], K, K):
                raise ValueError(f"cov[{r}]: expected shape {(m.shape[0], K, K)}, got {C.shape}")
            var = np.einsum("ki,jkl,li->ji", A, C, A)  # diag(A^T C_j A) at each point j
            new_sd.append(np.sqrt(np.maximum(var, 0.0)))
    else:
        sds = _runs(sd, "sd")
        if len(sds) != len(Mn) or any(s.shape != m.shape for s, m in zip(sds, Mn)):
            raise ValueError("sd: expected one (J, K) array per run, shaped like mean")
        if any((s < 0).any() for s in sds):
            raise ValueError("sd: negative standard deviations")
        new_sd = [np.sqrt((s ** 2) @ (A * A)) for s in sds]
    return {"mean": new_mean, "sd": new_sd,
            "lower": [m - z * s for m, s in zip(new_mean, new_sd)],
            "upper": [m + z * s for m, s in zip(new_mean, new_sd)],
            "transform": A, "center": c, "offset": o, "map": map, "exact_sd": cov is not None}


def truth_in_fitted_frame(true, true_params, fit_params, streams=None) -> dict[str, Any]:
    r"""The true latents carried into a fitted model's latent frame through the loadings and intercepts of both.

    Every stream s sees the latents through its response (linear, of unit gain, the same for every factor) and
    its loadings: the true signal is ``b_s + W_s (h_s * z)``. The fitted-frame latent that best reproduces the true
    signal of every stream, in the fitted model's own noise metric ``D_s = diag(1 / sigma_hat_s^2)``, is

    .. math::

        x(t) = A z(t) + a,\quad A = G^{-1} \sum_s \hat W_s^\top D_s W_s,\quad
        a = G^{-1} \sum_s \hat W_s^\top D_s (b_s - \hat b_s),\quad G = \sum_s \hat W_s^\top D_s \hat W_s,

    (a response of unit gain passes the constant ``a`` unchanged, and commutes with ``A``). Nothing is fitted to
    the true latents, so a posterior band can be judged in the frame the model reports it, with its own width,
    scale and offset: a miss is the model's, not an alignment's.

    Args:
        true: the true latents, a (J, K) array or one per run.
        true_params, fit_params: objects with ``loadings``, ``intercepts`` (and, for the fit, ``noise_sd``)
            mappings from stream key to (F,K) / (F,) arrays (:class:`msrm.Params`).
        streams: the stream keys to use (default: every key of the fit's loadings that the truth also has).

    Returns:
        dict with ``latents`` (list over runs of the (J, K_fit) mapped truth), ``transform`` A (K_fit, K),
        ``offset`` a (K_fit,).
    """
    T = _runs(true, "true")
    keys = [k for k in fit_params.loadings if k in true_params.loadings] if streams is None else list(streams)
    if not keys:
        raise ValueError("streams: no stream has loadings in both the truth and the fit")
    K = T[0].shape[1]
    Kf = None
    G = B = c = None
    for key in keys:
        for name, params in (("true_params", true_params), ("fit_params", fit_params)):
            if key not in params.loadings or key not in params.intercepts:
                raise ValueError(f"{name}: no loadings or intercepts for stream {key!r}")
        W = np.asarray(true_params.loadings[key], dtype=np.float64)
        Wh = np.asarray(fit_params.loadings[key], dtype=np.float64)
        b = np.asarray(true_params.intercepts[key], dtype=np.float64)
        bh = np.asarray(fit_params.intercepts[key], dtype=np.float64)
        sd = np.asarray(fit_params.noise_sd[key], dtype=np.float64)
        F = Wh.shape[0]
        if W.shape != (F, K) or b.shape != (F,) or bh.shape != (F,) or sd.shape != (F,) or Wh.ndim != 2:
            raise ValueError(f"stream {key!r}: loadings {W.shape} / {Wh.shape}, intercepts {b.shape} / {bh.shape}, "
                             f"noise {sd.shape} do not agree with {F} features and K = {K}")
        if not (np.all(np.isfinite(sd)) and np.all(sd > 0)):
            raise ValueError(f"fit_params: noise_sd of stream {key!r} must be finite and positive")
        Kf = Wh.shape[1] if Kf is None else Kf
        if Wh.shape[1] != Kf:
            raise ValueError(f"fit_params: stream {key!r} has {Wh.shape[1]} factors, others {Kf}")
        WD = Wh.T / sd**2
        G = WD @ Wh if G is None else G + WD @ Wh
        B = WD @ W if B is None else B + WD @ W
        c = WD @ (b - bh) if c is None else c + WD @ (b - bh)
    A = np.linalg.solve(G, B)
    a = np.linalg.solve(G, c)
    return {"latents": [t @ A.T + a for t in T], "transform": A, "offset": a}


def band_coverage(true, lower, upper, mask=None) -> float:
    """Fraction of the selected (grid point, factor) values of the truth inside ``[lower, upper]``.

    ``true``, ``lower``, ``upper``: the same structure (a (J, K) array or one per run); ``lower <= upper``.
    """
    T = _runs(true, "true")
    L = _runs(lower, "lower")
    U = _runs(upper, "upper")
    if not (len(T) == len(L) == len(U)) or any(not (t.shape == l.shape == u.shape) for t, l, u in zip(T, L, U)):
        raise ValueError("true, lower and upper must have the same runs and shapes")
    if any((l > u).any() for l, u in zip(L, U)):
        raise ValueError("lower: above upper somewhere")
    M = _masks(mask, T)
    inside = [((t >= l) & (t <= u))[m] for t, l, u, m in zip(T, L, U, M)]
    return float(np.concatenate(inside).mean())


def central_interval(draws, level: float = 0.9, axis: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Equal-tailed interval of draws: the ``(1 - level)/2`` and ``(1 + level)/2`` quantiles along ``axis``."""
    d = np.asarray(draws, dtype=np.float64)
    if d.size == 0 or not np.isfinite(d).all():
        raise ValueError("draws: expected a non-empty finite array")
    if not (0.0 < level < 1.0):
        raise ValueError(f"level: expected 0 < level < 1, got {level!r}")
    lo, hi = np.quantile(d, [(1 - level) / 2, (1 + level) / 2], axis=axis)
    return lo, hi


def interval_coverage(true, lower, upper) -> float:
    """Fraction of scalar truths inside their intervals (e.g. one true lag and its 90% interval per seed).

    ``true``, ``lower``, ``upper``: 1-d arrays of the same length (a scalar truth is broadcast).
    """
    lo = np.atleast_1d(np.asarray(lower, dtype=np.float64))
    hi = np.atleast_1d(np.asarray(upper, dtype=np.float64))
    t = np.broadcast_to(np.asarray(true, dtype=np.float64), lo.shape)
    if lo.ndim != 1 or lo.shape != hi.shape or lo.size == 0:
        raise ValueError(f"lower and upper: expected 1-d arrays of one length, got {lo.shape} and {hi.shape}")
    if not (np.isfinite(t).all() and np.isfinite(lo).all() and np.isfinite(hi).all()):
        raise ValueError("true, lower, upper: non-finite values")
    if (lo > hi).any():
        raise ValueError("lower: above upper somewhere")
    return float(np.mean((t >= lo) & (t <= hi)))


def binomial_sd(p: float, n: int) -> float:
    """Standard deviation of an observed coverage fraction: ``sqrt(p (1 - p) / n)`` for n independent values."""
    if not (0.0 <= p <= 1.0):
        raise ValueError(f"p: expected a probability, got {p!r}")
    if int(n) < 1:
        raise ValueError(f"n: expected a positive count, got {n!r}")
    return math.sqrt(p * (1.0 - p) / int(n))
