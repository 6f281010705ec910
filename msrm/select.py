r"""Model choice: the GP kernel by the marginal likelihood, the number of factors K by co-smoothing.

::

    sel = msrm.select(data, spec, kernels=("matern12", "matern32", "matern52", "matern72"), n_factors=(1, 2, 3, 4))
    sel.table          # one row per candidate: scores, the rule's verdict, seconds
    sel.spec           # the chosen ModelSpec (kernel and n_factors filled in)

**Kernel** (``stage == "kernel"`` rows). One R-MSRM fit of the full data (``fit_rmsrm``, seeded, by default
two restarts) gives ONE shared start for every candidate: loadings W, intercepts b, noise sd sigma, response
parameters theta and, per kernel, the lengthscales at which the kernel's correlation falls to one half at the
distance ``r_half`` where the fitted latents' autocorrelation does (``l_nu = r_half / c_nu``,
``k_nu(c_nu; 1) = 1/2``; R-MSRM's own lengthscale estimate). Each candidate kernel nu
is then fitted from that start and scored by the GP marginal likelihood, the latents integrated out:

.. math::

    L(\nu) = \log p(Y \mid \hat\phi_\nu, \hat\ell_\nu, \nu) = \sum_{\text{runs}} \log N(y;\ b,\ C_\nu),
    \qquad
    C_\nu[(s,f,i), (s',f',i')] = \sum_k W_{s,f,k} W_{s',f',k}\, a_{s,i}^\top K_{\nu}(\hat\ell_{\nu,k})\, a_{s',i'}
                                  + \delta\, \sigma^2_{s,f}

(the GP-MSRM density of DESIGN.md section 1, missing values dropped), with ``phi = (W, b, sigma, theta)`` and

* ``method="rmsrm"``: ``phi`` fixed at the shared R-MSRM start and ``l`` maximising L (a profile likelihood in
  the K lengthscales: L-BFGS-B in ``log l``);
* ``method="map"``: ``(phi, l)`` the GP-MAP fit (``GPMSRM.fit_map``) started from the shared start (the
  mode of the log density; its weak priors move it little from the maximum of L).

The kernel with the largest L is kept. **Why L compares kernels like with like.** Every candidate is a
probability density over the same observed values Y (same data, same missing values, same grid), and every
candidate has the same free parameters (the same W, b, sigma, theta and one lengthscale per factor), so the
difference of two maximised log likelihoods is the log likelihood ratio, and AIC and BIC differences equal it (the
penalties cancel). R-MSRM's objective cannot choose: the kernel does not enter it (it only sets the lengthscale
read off the latents). The MAP log density is reported (``log_density``) but not used: it adds the parameter
priors and the Jacobian of ``u -> theta``, and the lengthscale prior is one log-normal on ``l`` for every
kernel while ``l`` means a different correlation distance for each (the half-correlation distance is
``c_nu l``), so that term would favour kernels by their parametrisation, not by the data.

**Number of factors** (``stage == "n_factors"`` rows): co-smoothing cross-validation, the Neural Latents
Benchmark's scheme with a Gaussian score. :func:`msrm.cross_validate` with ``mask="features"``: for each fold f
the features of every stream with at least ``folds`` features are split at random (seeded) into ``folds``
groups; group f is held out inside time window f of every run (outside that window the held-out features are
observed, so their loadings and intercepts are learned there), the latents inside the window are fitted from
the remaining features and streams, and the held-out values are predicted. Per fold f and held-out modality m,
with ``mu_j`` the in-fold mean of feature j (its values that fold f does not hold out, :mod:`msrm.validation`):

.. math::

    R^2_{f,m} = 1 - \frac{\sum (y - \hat y)^2}{\sum (y - \mu_j)^2},\qquad
    s^{R^2}_f = \frac{1}{|M_f|} \sum_{m \in M_f} R^2_{f,m},\qquad
    s^{lpd}_f = \frac{1}{n_f} \sum \log N(y; \hat y, v^2)

(sums over the fold's held-out values of modality m, resp. of every modality; n_f their number; v the
predictive sd). The modalities' R^2 are averaged, not pooled, so that no modality's units weigh on another. The
score of a candidate is the mean over folds, ``r2 = mean_f s^{R2}_f`` (``lpd_per_value = mean_f s^{lpd}_f``),
and ``score`` chooses which of the two the rule reads.

**One-standard-error rule** (:func:`one_standard_error_rule`). More factors rarely predict much worse (they fit
noise a little), so the best mean score often sits at a K past the true one by less than the folds' noise. Let
``b`` be the candidate with the best mean score; for each candidate c, ``d_{c,f} = s_{c,f} - s_{b,f}`` (paired:
every candidate is scored on the same folds, so the folds' shared difficulty cancels) and
``se_c = sd_f(d_{c,f}) / sqrt(n_folds)`` (sd with divisor ``n_folds - 1``). The chosen K is the smallest
candidate with ``mean_f d_{c,f} >= -se_c`` (the best itself qualifies, ``d = 0``).

**Order.** ``method="rmsrm"``: K first (R-MSRM's fits and predictions do not use the kernel), then the kernel
at the chosen K. ``method="map"``: the K stage fits GP-MAP with the spec's kernel; when that is ``"auto"`` the
kernel stage runs first at ``spec.n_factors`` and the K stage uses its kernel; the kernel is then chosen (again)
at the chosen K. A stage with a single candidate is not run (that candidate is taken as given and no rows are
written).
"""
from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from .data import Dataset
from .gp.kernel_choice import (DEFAULT_KERNELS, METHODS, SCORES, TABLE_COLUMNS, Selection, kernel_candidates,
                               select_kernel)
from .spec import AUTO_KERNEL, ModelSpec

__all__ = ["select", "Selection", "select_kernel", "one_standard_error_rule",
           "cosmoothing_scores", "METHODS", "SCORES", "TABLE_COLUMNS", "DEFAULT_KERNELS"]

# ---------------------------------------------------------------------------------------------- checks
def _is_int(v, lo: int) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, np.integer)) and v >= lo


def _factor_candidates(n_factors, spec: ModelSpec) -> tuple[int, ...]:
    """The candidate K values (``None``: the spec's K alone), sorted increasing."""
    if n_factors is None:
        return (spec.n_factors,)
    if _is_int(n_factors, 1):
        n_factors = (n_factors,)
    try:
        values = tuple(n_factors)
    except TypeError:
        raise ValueError(f"n_factors must be a sequence of integers >= 1, got {n_factors!r}") from None
    if not values:
        raise ValueError("n_factors must hold at least one candidate K (integers >= 1)")
    for k in values:
        if not _is_int(k, 1):
            raise ValueError(f"n_factors: every candidate must be an integer >= 1, got {k!r}")
    if len(set(int(k) for k in values)) != len(values):
        raise ValueError(f"n_factors: candidates must be distinct, got {values}")
    return tuple(sorted(int(k) for k in values))


# ---------------------------------------------------------------------------------------------- the rule
def one_standard_error_rule(fold_scores) -> tuple[int, np.ndarray, np.ndarray]:
    """The smallest candidate whose mean score is within one standard error of the best (module docstring).

    Args:
        fold_scores: (n_candidates, n_folds) scores (larger is better), candidates in increasing complexity
            (the rule returns the first row that qualifies).
    Returns:
        (index of the chosen row, (n_candidates,) mean paired difference from the best row, (n_candidates,) its
        standard error ``sd(d) / sqrt(n_folds)``).
    Raises:
        ValueError: not a 2-D array with at least one row and two folds, or non-finite scores.
    """
    s = np.asarray(fold_scores, dtype=np.float64)
    if s.ndim != 2 or s.shape[0] < 1 or s.shape[1] < 2:
        raise ValueError(f"fold_scores must have shape (n_candidates >= 1, n_folds >= 2), got {s.shape}")
    if not np.isfinite(s).all():
        bad = sorted(set(np.nonzero(~np.isfinite(s))[0].tolist()))
        raise ValueError(f"fold_scores: candidate row(s) {bad} have non-finite scores; the rule cannot rank them")
    best = int(np.argmax(s.mean(axis=1)))
    d = s - s[best]
    mean = d.mean(axis=1)
    se = d.std(axis=1, ddof=1) / math.sqrt(s.shape[1])
    chosen = int(np.flatnonzero(mean >= -se)[0])
    return chosen, mean, se


def cosmoothing_scores(cv) -> dict[str, np.ndarray]:
    """The per-fold co-smoothing scores of one :class:`msrm.CVResult` (``mask="features"``; module docstring).

    Returns:
        ``{"r2": (n_folds,) mean over modalities of each fold's pooled R^2, "lpd": (n_folds,) held-out log
        predictive density per value}``.
    """
    t = cv.folds
    r2, lpd = [], []
    for f in range(cv.n_folds):
        rows = t[t["fold"] == f]
        by_mod = rows.groupby("modality", sort=False)[["sse", "sst"]].sum()
        r2.append(float(np.mean(1.0 - by_mod["sse"] / by_mod["sst"])))
        lpd.append(float(rows["lpd"].sum() / rows["n_heldout"].sum()))
    return {"r2": np.array(r2), "lpd": np.array(lpd)}


# ---------------------------------------------------------------------------------------------- K stage
def _select_factors(data, spec, candidates, method, folds, seed, score, model_kwargs, cv_kwargs):
    from .validation import cross_validate

    rows, scores = [], {}
    for K in candidates:
        t0 = time.perf_counter()
        cv = cross_validate(data, dataclasses.replace(spec, n_factors=K), method=method, folds=folds,
                            mask="features", seed=seed, model_kwargs=model_kwargs, **cv_kwargs)
        s = cosmoothing_scores(cv)
        scores[K] = s
        rows.append({"stage": "n_factors", "kernel": spec.kernel, "n_factors": K, "r2": float(s["r2"].mean()),
                     "lpd_per_value": float(s["lpd"].mean()), "converged": bool(np.all(cv.converged)),
                     "fit_seconds": time.perf_counter() - t0})
    chosen = None
    for name, col in (("lpd", "lpd_per_value"), ("r2", "r2")):
        idx, mean, se = one_standard_error_rule(np.stack([scores[K][name] for K in candidates]))
        for r, m, e in zip(rows, mean, se):
            r[f"{col}_se"] = float(e)
            if name == score:
                r["within_one_se"] = bool(m >= -e)
        if name == score:
            chosen = idx
    for i, r in enumerate(rows):
        r["chosen"] = i == chosen
    return candidates[chosen], rows, {K: scores[K][score] for K in candidates}


# ---------------------------------------------------------------------------------------------- select
def _check_settings(data, spec, method, score, folds, seed) -> None:
    """The refusals of :func:`select` that need no fit: the types of data and spec, and each setting's range."""
    if not isinstance(data, Dataset):
        raise ValueError(f"data must be an msrm.Dataset, got {type(data).__name__}")
    if not isinstance(spec, ModelSpec):
        raise ValueError(f"spec must be an msrm.ModelSpec, got {type(spec).__name__}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if score not in SCORES:
        raise ValueError(f"score must be one of {SCORES}, got {score!r}")
    if not _is_int(folds, 2):
        raise ValueError(f"folds must be an integer >= 2, got {folds!r}")
    if not _is_int(seed, 0):
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")


def select(data: Dataset, spec: ModelSpec, *, kernels=DEFAULT_KERNELS, n_factors=None, method: str = "rmsrm",
           folds: int = 5, seed: int = 0, score: str = "r2", model_kwargs: dict | None = None,
           rmsrm_kwargs: dict | None = None, map_kwargs: dict | None = None, **cv_kwargs) -> Selection:
    """Choose the kernel (marginal likelihood) and the number of factors (co-smoothing); module docstring.

    Args:
        data: the Dataset.
        spec: the ModelSpec; its other settings (grid, responses, pooling) are kept. Its kernel may be ``"auto"``.
        kernels: candidate kernel names (:data:`msrm.kernels.KERNELS`); ``None`` keeps the spec's kernel.
        n_factors: candidate K values (integers >= 1); ``None`` keeps ``spec.n_factors``.
        method: ``"rmsrm"`` (R-MSRM folds; kernels by their lengthscales' profile likelihood at the R-MSRM start)
            or ``"map"`` (GP-MAP folds and kernel fits).
        folds: co-smoothing folds (>= 2; also the number of time windows per run).
        seed: seeds the feature groups, the R-MSRM start and every fit.
        score: what the K rule reads: ``"r2"`` (held-out R^2 about the in-fold mean, averaged over modalities) or
            ``"lpd"`` (held-out Gaussian log predictive density per value).
        model_kwargs: keywords of :class:`msrm.GPMSRM` (GP fits of either stage).
        rmsrm_kwargs: keywords of :func:`msrm.fit_rmsrm` for the kernel stage's shared start.
        map_kwargs: keywords of the kernel stage's fits (see :func:`select_kernel`).
        **cv_kwargs: passed to :func:`msrm.cross_validate` for the K stage (``restarts``, ``max_iter``,
            ``n_jobs``, ``maxiter``, ``init``, ``require_converged``, ...).
    Returns:
        :class:`Selection`.
    Raises:
        ValueError: bad candidates or settings, before any fit (and the refusals of :func:`msrm.cross_validate`).
    """
    from .gp.model import GPMSRM

    import pandas as pd

    _check_settings(data, spec, method, score, folds, seed)
    names = kernel_candidates(kernels, spec)
    Ks = _factor_candidates(n_factors, spec)
    if len(Ks) > 1:
        from .validation import fold_masks

        fold_masks(data, int(folds), "features", int(seed))  # the mask's refusals before any fit
    kernel_kw = {"method": method, "seed": int(seed), "model_kwargs": model_kwargs, "rmsrm_kwargs": rmsrm_kwargs,
                 "map_kwargs": map_kwargs}
    rows: list[dict] = []
    start_seconds: dict = {}
    fold_scores: dict = {}
    params: dict = {}
    kernel_rows: dict = {}  # K -> (spec with its kernel, rows)

    def kernel_stage(s: ModelSpec) -> ModelSpec:
        if len(names) == 1:
            return dataclasses.replace(s, kernel=names[0])
        if s.n_factors not in kernel_rows:
            chosen, krows, secs, fitted = select_kernel(data, s, names, model_cls=GPMSRM, **kernel_kw)
            kernel_rows[s.n_factors] = (chosen, krows)
            start_seconds[s.n_factors] = secs
            params.update({(k, s.n_factors): p for k, p in fitted.items()})
        return dataclasses.replace(s, kernel=kernel_rows[s.n_factors][0].kernel)

    current = spec
    if len(Ks) > 1:
        if current.kernel == AUTO_KERNEL or len(names) == 1:
            # R-MSRM ignores the kernel (any name will do); GP-MAP needs the one the kernel stage picks
            current = kernel_stage(current) if method == "map" else dataclasses.replace(current, kernel=names[0])
        K, krows, fold_scores = _select_factors(data, current, Ks, method, int(folds), int(seed), score,
                                                dict(model_kwargs or {}), cv_kwargs)
        if method == "rmsrm":
            for r in krows:
                r["kernel"] = None  # R-MSRM's folds do not use a kernel
        rows.extend(krows)
        current = dataclasses.replace(current, n_factors=K)
    chosen = kernel_stage(current)
    for K in kernel_rows:
        krows = kernel_rows[K][1]
        for r in krows:
            r["chosen"] = r["chosen"] and K == chosen.n_factors
        rows.extend(krows)
    table = pd.DataFrame(rows, columns=list(TABLE_COLUMNS))
    return Selection(table=table, spec=chosen, kernel=chosen.kernel, n_factors=chosen.n_factors,
                     fold_scores=fold_scores, method=method, score=score, folds=int(folds), seed=int(seed),
                     start_seconds=start_seconds, params=params)
