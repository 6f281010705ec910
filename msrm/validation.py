r"""Cross-validation of R-MSRM and GP-MSRM (MAP): held-out scores per fold, stream and modality.

Each fold sets a set of observed values to NaN, fits the model to what is left, predicts the held-out values
(every model predicts missing samples: ``RFit.predict``, ``GPMSRM.predict``) and scores them. Nothing held out
enters the fit, nor any score's reference point (the in-fold moments below), so the scores measure prediction of
unseen data.

**Blocks.** Every run of duration T is cut into ``folds`` equal consecutive time windows
``[f T / folds, (f + 1) T / folds)`` (the last one closed); a sample belongs to the window holding its time.
Fold f uses window f of every run.

**Masks.**

- ``"time_blocks"``: fold f holds out every value of every stream in window f (the same window for all streams of
  a run). The held-out latents are then informed only by their neighbours in time (through lagged responses
  and the temporal model: the roughness penalty of R-MSRM, the GP prior of GP-MSRM), so this measures
  prediction across a gap in time. R-MSRM's second-difference penalty is blind to linear trends, so across a
  window at either end of a run its latents continue linearly; GP-MSRM's predictions revert to the intercepts.
- ``"features"``: the classic SRM scheme in one fit. The features of each stream with at least ``folds``
  features are split at random (seeded) into ``folds`` groups; fold f holds out group f *inside window f*, in
  every run. A held-out feature is observed outside window f, so its loadings and intercept are learned there;
  the latents inside window f are learned from the other features (and from the streams with fewer features,
  which are never held out and have no rows in the table). Masking a feature at all times would leave no data
  to learn its loading from, so no prediction of it would be possible.

**In-fold moments.** For fold f, stream s and feature j, the in-fold mean ``mu_j`` and sd ``s_j`` are the mean
and the (maximum-likelihood, divisor n) sd of the feature's observed values that fold f does NOT hold out,
pooled over runs: what a fit of that fold could know about the feature's level and spread.

**Scores** of fold f and stream s, over the held-out values y (pooled over runs), with the predictive mean m and
sd v of each value:

- ``lpd = sum log N(y; m, v^2)``, the held-out log predictive density. GP-MSRM (MAP): m and v are the
  posterior predictive mean and sd at the MAP parameters (latent uncertainty and noise). R-MSRM is a point
  estimate: v is its fitted noise sd, which ignores the uncertainty of the fitted latents and loadings, so its
  lpd is optimistic about v (compare R-MSRM lpd values with each other, e.g. across K, rather than with GP-MSRM).
- ``lpd_naive = sum log N(y; mu_j, s_j^2)``, the same sum for the naive predictive that knows only each feature's
  in-fold level and spread (NaN where a feature's in-fold values are all equal). ``lpd - lpd_naive`` is what the
  model's predictions are worth over it, in nats; ``*_per_value`` divide by the number of held-out values.
- ``r2 = 1 - SSE / SST``, SSE the squared prediction errors ``sum (y - m)^2`` and SST the squared deviations
  ``sum (y - mu_j)^2`` of the held-out values from their feature's **in-fold** mean. The in-fold mean is the
  naive predictor's mean, so R^2 > 0 means that the model predicts the held-out values better than that
  predictor; a feature's intercept alone scores about 0, never credited as prediction. (Centring on the held-out
  values' own mean instead would use information no fit had: a short window's mean differs from the feature's
  level, so the true intercept would score below 0 and even the noise-free true signal far below its explained
  fraction.)
- ``coverage_50``, ``coverage_90``: the fractions of held-out values inside the central 50% and 90% predictive
  intervals ``m +- z v`` (z the 0.75 and 0.95 standard normal quantiles). A calibrated predictive covers about
  0.5 and 0.9.
- PIT (probability integral transform) of each held-out value, ``Phi((y - m) / v)``: uniform on [0, 1] under a
  calibrated Gaussian predictive (a U-shaped histogram: v too small; a hump: v too large; a slope: m biased).
  Kept per value in ``CVResult.pit``.

**Predictive** (GP-MSRM only). ``predictive="plugin"`` (default) scores the posterior predictive at each
fold's MAP parameters: it holds the latents' uncertainty and the noise but treats the fitted parameters as
known, so its sd is too small wherever they are uncertain (most visibly inside a gap, where the prediction rests on
the fitted lengthscales and loadings). ``predictive="laplace"`` integrates over the parameters too: S
(``predictive_draws``) parameter vectors are drawn from the Laplace approximation at the fold's MAP
(:func:`msrm.gp.laplace.approximate_posterior`, Gaussian in the unconstrained space), each gives a predictive
mean ``m_s`` and sd ``v_s``, and the value is scored under the Gaussian with the mixture's mean and variance,
``m = mean_s m_s`` and ``v^2 = mean_s v_s^2 + var_s m_s`` (the law of total variance). ``params=`` scores
predictions at given parameters with no fit (e.g. the true parameters of a simulation): comparing it with the
fitted predictive separates the predictive computation from the estimation of the parameters.

**Modalities.** A modality's values have their own units and noise (brain features, ratings, physiology), so
scores are pooled over streams and folds only within a modality (``CVResult.by_modality``): ``r2`` there is
``1 - sum SSE / sum SST`` and the coverages are fractions of all the modality's held-out values.
``CVResult.r2``, ``.lpd`` and ``.lpd_naive`` give the number of the one modality held out and refuse when several
were (a single number would mix units).

**Convergence.** Each fold's fit reports whether it converged (R-MSRM: the relative change of its objective fell
below ``tol`` within ``max_iter`` iterations in every phase; GP-MAP: the optimiser reported success with a finite
gradient). The scores of a fit stopped by its iteration limit describe that limit rather than the model, so by
default (``require_converged=True``) such a fold is refused with :class:`NotConvergedError`; with
``require_converged=False`` it is scored and its rows say ``converged=False``. The R-MSRM fit that starts
GP-MAP (``init="rmsrm"``) is only a start and is not checked.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from .data import Dataset, Run, Stream
from .spec import ModelSpec

__all__ = ["cross_validate", "CVResult", "NotConvergedError", "fold_masks", "masked", "METHODS", "MASKS",
           "PREDICTIVES", "FOLD_COLUMNS"]

METHODS = ("rmsrm", "map")
PREDICTIVES = ("plugin", "laplace")
MASKS = ("time_blocks", "features")
# every window must hold this many samples of each stream it holds out (R^2 needs a spread of held-out values)
MIN_BLOCK_SAMPLES = 2
# central predictive intervals whose coverage is scored (columns coverage_50, coverage_90)
COVERAGE_LEVELS = (0.5, 0.9)
FOLD_COLUMNS = ("fold", "stream", "modality", "n_heldout", "converged", "lpd", "lpd_per_value", "lpd_naive",
                "lpd_naive_per_value", "sse", "sst", "r2", "coverage_50", "coverage_90")
PIT_COLUMNS = ("fold", "run", "stream", "modality", "feature", "pit")


class NotConvergedError(RuntimeError):
    """A fold's fit stopped without converging and ``require_converged`` was True (module docstring)."""


@dataclass(frozen=True, eq=False)
class CVResult:
    """The result of :func:`cross_validate` (scores: module docstring).

    Fields:
        folds: pandas DataFrame, one row per (fold, stream): the columns :data:`FOLD_COLUMNS` (``fold``,
            ``stream``, ``modality``, ``n_heldout``, ``converged`` (that fold's fit), ``lpd`` (summed),
            ``lpd_per_value``, ``lpd_naive``, ``lpd_naive_per_value``, ``sse``, ``sst`` (about the in-fold mean),
            ``r2``, ``coverage_50``, ``coverage_90``).
        summary: pandas DataFrame indexed by stream, pooled over folds: ``modality``, ``n_heldout``, ``lpd``,
            ``lpd_per_value``, ``lpd_naive``, ``lpd_naive_per_value``, ``sse``, ``sst``, ``r2`` (1 - sum SSE / sum
            SST), ``r2_fold_mean``, ``coverage_50``, ``coverage_90``, ``converged`` (every fold's fit).
        by_modality: pandas DataFrame indexed by modality, pooled over its streams and the folds: ``n_streams``
            and the columns of ``summary`` but ``modality`` and ``r2_fold_mean``.
        pit: pandas DataFrame, one row per held-out value: ``fold``, ``run``, ``stream``, ``modality``,
            ``feature`` (column of the stream), ``pit`` (``Phi((y - m) / v)``).
        converged: (n_folds,) bool, whether each fold's fit converged.
        method, mask, n_folds, n_factors, seed, require_converged, predictive: the settings (``predictive`` is
            ``"fixed"`` when ``params`` were given).
        fit_seconds: (n_folds,) wall seconds of each fold's fit and prediction.
        execution_info: ``msrm.runtime.execution_info()``.
    """

    folds: object
    summary: object
    by_modality: object
    pit: object
    converged: np.ndarray
    method: str
    mask: str
    n_folds: int
    n_factors: int
    seed: int
    require_converged: bool
    fit_seconds: np.ndarray
    predictive: str = "plugin"
    execution_info: dict = field(default_factory=dict)

    def _single(self, column: str) -> float:
        mods = list(self.by_modality.index)
        if len(mods) != 1:
            raise ValueError(f"CVResult.{column}: held-out values of {len(mods)} modalities ({', '.join(mods)}); "
                             f"one number would mix their units: read CVResult.by_modality[{column!r}]")
        return float(self.by_modality[column].iloc[0])

    @property
    def lpd(self) -> float:
        """Held-out log predictive density summed over every fold and stream of the one modality held out."""
        return self._single("lpd")

    @property
    def lpd_naive(self) -> float:
        """The naive baseline's held-out log density (module docstring) of the one modality held out."""
        return self._single("lpd_naive")

    @property
    def r2(self) -> float:
        """R^2 of the one modality held out, pooled over its folds and streams (1 - total SSE / total SST)."""
        return self._single("r2")

    def __repr__(self) -> str:
        scores = ", ".join(f"{m}: r2={row.r2:.4f}, lpd/value={row.lpd_per_value:.4g} "
                           f"(naive {row.lpd_naive_per_value:.4g})" for m, row in self.by_modality.iterrows())
        return (f"CVResult(method={self.method!r}, mask={self.mask!r}, folds={self.n_folds}, K={self.n_factors}, "
                f"converged={int(np.sum(self.converged))}/{self.n_folds}, {scores})")


def _check(data, spec, method, folds, mask, seed) -> None:
    if not isinstance(data, Dataset):
        raise ValueError(f"data must be an msrm.Dataset, got {type(data).__name__}")
    if not isinstance(spec, ModelSpec):
        raise ValueError(f"spec must be an msrm.ModelSpec, got {type(spec).__name__}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if mask not in MASKS:
        raise ValueError(f"mask must be one of {MASKS}, got {mask!r}")
    if isinstance(folds, bool) or not isinstance(folds, (int, np.integer)) or folds < 2:
        raise ValueError(f"folds must be an integer >= 2, got {folds!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")


def _check_predictive(method, predictive, draws, params) -> None:
    if predictive not in PREDICTIVES:
        raise ValueError(f"predictive must be one of {PREDICTIVES}, got {predictive!r}")
    if isinstance(draws, bool) or not isinstance(draws, (int, np.integer)) or draws < 2:
        raise ValueError(f"predictive_draws must be an integer >= 2, got {draws!r}")
    if method != "map" and (predictive != "plugin" or params is not None):
        what = "params" if params is not None else f"predictive={predictive!r}"
        raise ValueError(f"{what} needs method='map' (GP-MSRM); R-MSRM is a point estimate with no posterior")
    if params is not None:
        from .params import Params

        if not isinstance(params, Params):
            raise ValueError(f"params must be msrm.Params (GP-MSRM parameters), got {type(params).__name__}")
        if predictive != "plugin":
            raise ValueError("params fixes the parameters, so there is no parameter uncertainty to integrate: "
                             "pass predictive='plugin' with params")


def _windows(stream: Stream, duration: float, folds: int) -> np.ndarray:
    """(n_samples,) window index of each sample (module docstring, Blocks)."""
    w = np.floor(stream.times / (duration / folds)).astype(np.int64)
    return np.clip(w, 0, folds - 1)


def fold_masks(data: Dataset, folds: int, mask: str = "time_blocks", seed: int = 0) -> list[list[dict]]:
    """Where each fold holds values out (module docstring).

    Returns:
        per fold, per run, ``{stream key: (n_samples, n_features) bool}``, True for a held-out value (only values
        observed in ``data`` are held out; streams a fold leaves alone are absent).
    Raises:
        ValueError: folds < 2, an unknown mask, a window with fewer than 2 samples of a stream it holds out
            (too many folds for the data), a fold that leaves a feature of a stream of a run with no observed
            value, or a ``"features"`` mask with no stream of at least ``folds`` features.
    """
    if isinstance(folds, bool) or not isinstance(folds, (int, np.integer)) or folds < 2:
        raise ValueError(f"folds must be an integer >= 2, got {folds!r}")
    if mask not in MASKS:
        raise ValueError(f"mask must be one of {MASKS}, got {mask!r}")
    rng = np.random.default_rng(seed)
    groups: dict[str, np.ndarray] = {}  # stream key -> (F,) fold of each feature
    if mask == "features":
        for key, F in data.n_features.items():
            if F >= folds:
                g = np.empty(F, dtype=np.int64)
                for f, idx in enumerate(np.array_split(rng.permutation(F), folds)):
                    g[idx] = f
                groups[key] = g
        if not groups:
            raise ValueError(f"mask='features' with folds={folds}: no stream has at least {folds} features to hold "
                             f"out (largest: {max(data.n_features.values())}); use mask='time_blocks' or fewer folds")
    out = []
    for f in range(folds):
        per_run = []
        for r, run in enumerate(data.runs):
            held = {}
            for s in run.streams:
                if mask == "features" and s.key not in groups:
                    continue
                win = _windows(s, run.duration, folds) == f
                n_win = int(win.sum())
                if n_win < MIN_BLOCK_SAMPLES:
                    raise ValueError(
                        f"folds={folds}: time window {f} of run {r} holds {n_win} sample(s) of stream {s.key} "
                        f"(dt {s.dt:g} s, run {run.duration:g} s); every window needs {MIN_BLOCK_SAMPLES}: use "
                        f"fewer folds")
                cols = np.ones(s.n_features, dtype=bool) if mask == "time_blocks" else groups[s.key] == f
                h = win[:, None] & cols[None, :] & s.mask
                left = s.mask & ~h
                empty = np.flatnonzero(~left.any(axis=0))
                if empty.size:
                    raise ValueError(
                        f"fold {f} ({mask}) leaves stream {s.key} of run {r} with nothing observed in feature(s) "
                        f"{empty[:10].tolist()} (all its observed values fall in time window {f}); use more folds "
                        f"or another mask")
                held[s.key] = h
            per_run.append(held)
        out.append(per_run)
    return out


def masked(data: Dataset, held: list[dict]) -> Dataset:
    """``data`` with the values of one fold (a list over runs of ``{stream key: (n, F) bool}``, True where held
    out: one element of :func:`fold_masks`) set to NaN; the other streams are shared, not copied."""
    runs = []
    for run, h in zip(data.runs, held):
        streams = []
        for s in run.streams:
            if s.key in h:
                values = np.array(s.values)
                values[h[s.key]] = np.nan
                s = Stream(s.participant, s.modality, s.dt, values, offset=s.offset)
            streams.append(s)
        runs.append(Run(run.duration, streams))
    return Dataset(runs)


def _inside(theta: dict, response) -> dict:
    """Response parameters moved strictly inside their bounds (a start on a bound has no unconstrained value)."""
    out = {}
    for name, v in theta.items():
        lo, hi = response.bounds[name]
        eps = 1e-6 * (hi - lo)
        out[name] = float(np.clip(v, lo + eps, hi - eps))
    return out


class _Pooled:
    """A predictive Gaussian (``mean``, ``sd``: (n_samples, n_features)) scored like a ``Prediction``."""

    def __init__(self, mean, sd):
        self.mean, self.sd = mean, sd


def _laplace_predict(model, mode, draws: int, seed: int) -> list[dict]:
    """Per run, stream key -> the predictive pooled over ``draws`` Laplace draws at ``mode`` (module docstring,
    Predictive): ``Posterior.predict`` pools the per-draw means and sds by the law of total variance."""
    from .gp.laplace import approximate_posterior

    post = approximate_posterior(model, init=mode, num_samples=draws, seed=seed, log_density_draws=False,
                                 diagnostics=False)
    return [{key: _Pooled(ds["mean"].values, ds["sd"].values) for key, ds in run.items()}
            for run in post.predict(thin=1, progress=False)]


def _fit_predict(masked_data: Dataset, spec: ModelSpec, method: str, seed: int, model_kwargs: dict, init,
                 fit_kwargs: dict, predictive: str = "plugin", draws: int = 100,
                 params=None) -> tuple[list[dict], bool, str]:
    """Fit one fold's masked data. Returns its predictions (per run, stream key -> Prediction), whether the fit
    converged, and a sentence on how it stopped (for the refusal). With ``params`` nothing is fitted."""
    from . import rmsrm

    if method == "rmsrm":
        fit = rmsrm.fit_rmsrm(masked_data, spec, **{"progress": False, "seed": seed, **fit_kwargs})
        how = (f"{fit.n_iter} iterations, max_iter={fit.settings.get('max_iter')} per phase, "
               f"tol={fit.settings.get('tol')}")
        return fit.predict(masked_data), bool(fit.converged), how
    from .gp.model import GPMSRM

    model = GPMSRM(masked_data, spec, **model_kwargs)
    if params is not None:
        return model.predict(params), True, "fixed parameters, no fit"
    start = None
    if init == "rmsrm":
        rf = rmsrm.fit_rmsrm(masked_data, spec, restarts=1, max_iter=50, n_jobs=1, progress=False, seed=seed)
        p = rf.params
        response = {k: _inside(v, spec.response(k.split("/")[-1])) for k, v in p.response.items()}
        start = p.replace(response=response)
    elif init is not None:
        start = init
    result = model.fit_map(**{"init": start, "seed": seed, "progress": False, **fit_kwargs})
    d = result.diagnostics or {}
    how = f"{d.get('iterations')} iterations, maxiter={d.get('maxiter')}: {d.get('message')}"
    if predictive == "laplace" and result.converged:
        return _laplace_predict(model, result, draws, seed), True, how
    return model.predict(result.params), bool(result.converged), how


def _in_fold_moments(data: Dataset, held: list[dict]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per held-out stream key: the (F,) in-fold mean and maximum-likelihood sd of each feature, over the observed
    values the fold does not hold out, pooled over every run that has the stream (module docstring)."""
    keys = {key for h in held for key in h}
    pairs = []  # (stream key, values, in-fold mask) per run that has the stream
    for run, h in zip(data.runs, held):
        for s in run.streams:
            if s.key in keys:
                m = h.get(s.key)
                pairs.append((s.key, s.values, ~np.isnan(s.values) & (True if m is None else ~m)))
    total: dict[str, np.ndarray] = {}
    count: dict[str, np.ndarray] = {}
    for key, y, keep in pairs:
        total[key] = total.get(key, 0.0) + np.where(keep, y, 0.0).sum(axis=0)
        count[key] = count.get(key, 0) + keep.sum(axis=0)
    mean = {key: total[key] / count[key] for key in total}  # fold_masks leaves every feature an in-fold value
    ss: dict[str, np.ndarray] = {}
    for key, y, keep in pairs:
        ss[key] = ss.get(key, 0.0) + (np.where(keep, y - mean[key], 0.0) ** 2).sum(axis=0)
    return {key: (mean[key], np.sqrt(ss[key] / count[key])) for key in total}


def _scores(data: Dataset, held: list[dict], preds: list[dict], fold: int,
            converged: bool = True) -> tuple[list[dict], list[dict]]:
    """Score one fold's predictions of its held-out values (module docstring).

    Args:
        data: the full Dataset (the held-out values are read from it).
        held: per run, stream key -> (n_samples, n_features) bool, True where held out (one fold of
            :func:`fold_masks`).
        preds: per run, stream key -> object with ``mean`` and ``sd`` (n_samples, n_features) (a ``Prediction``).
        fold: the fold index written in the rows.
        converged: whether the fold's fit converged, written in the rows.
    Returns:
        (rows, pit): one row per held-out stream (the columns :data:`FOLD_COLUMNS`, pooled over runs), and per
        (run, stream) a dict of :data:`PIT_COLUMNS` with array values, one entry per held-out value in row-major
        (sample, feature) order.
    """
    from scipy.stats import norm

    moments = _in_fold_moments(data, held)
    half = {level: float(norm.ppf(0.5 + level / 2)) for level in COVERAGE_LEVELS}
    acc: dict[str, dict] = {}
    pit = []
    for r, (run, h, pred) in enumerate(zip(data.runs, held, preds)):
        for key, m in h.items():
            if not m.any():
                continue
            mu, sd = moments[key]
            _, cols = np.nonzero(m)
            y, p = run.stream(key).values[m], pred[key]
            mean, v = np.asarray(p.mean)[m], np.asarray(p.sd)[m]
            z = (y - mean) / v
            a = acc.setdefault(key, {"n": 0, "lpd": 0.0, "lpd_naive": 0.0, "sse": 0.0, "sst": 0.0,
                                     **{level: 0 for level in COVERAGE_LEVELS}})
            a["n"] += y.size
            a["lpd"] += float(np.sum(norm.logpdf(y, mean, v)))
            with np.errstate(divide="ignore", invalid="ignore"):
                a["lpd_naive"] += float(np.sum(norm.logpdf(y, mu[cols], sd[cols])))
            a["sse"] += float(np.sum((y - mean) ** 2))
            a["sst"] += float(np.sum((y - mu[cols]) ** 2))
            for level in COVERAGE_LEVELS:
                a[level] += int(np.count_nonzero(np.abs(z) <= half[level]))
            modality = key.split("/", 1)[1]
            pit.append({"fold": fold, "run": r, "stream": key, "modality": modality, "feature": cols,
                        "pit": norm.cdf(z)})
    rows = []
    for key, a in acc.items():
        n = a["n"]
        rows.append({"fold": fold, "stream": key, "modality": key.split("/", 1)[1], "n_heldout": n,
                     "converged": bool(converged), "lpd": a["lpd"], "lpd_per_value": a["lpd"] / n,
                     "lpd_naive": a["lpd_naive"], "lpd_naive_per_value": a["lpd_naive"] / n, "sse": a["sse"],
                     "sst": a["sst"], "r2": 1.0 - a["sse"] / a["sst"] if a["sst"] > 0 else float("nan"),
                     **{f"coverage_{round(100 * level)}": a[level] / n for level in COVERAGE_LEVELS}})
    return rows, pit


def _pooled(table, by: str):
    """Scores of ``table`` (rows of :func:`_scores`) pooled over the groups of column ``by``."""
    import pandas as pd

    g = table.groupby(by, sort=False)
    n = g["n_heldout"].sum()
    sse, sst = g["sse"].sum(), g["sst"].sum()
    inside = table[["coverage_50", "coverage_90"]].mul(table["n_heldout"], axis=0).groupby(table[by], sort=False)
    return pd.DataFrame({
        "n_heldout": n,
        "lpd": g["lpd"].sum(),
        "lpd_per_value": g["lpd"].sum() / n,
        "lpd_naive": g["lpd_naive"].sum(),
        "lpd_naive_per_value": g["lpd_naive"].sum() / n,
        "sse": sse,
        "sst": sst,
        "r2": 1.0 - sse / sst,
        "coverage_50": inside["coverage_50"].sum() / n,
        "coverage_90": inside["coverage_90"].sum() / n,
        "converged": g["converged"].all(),
    })


def _pit_frame(parts: list[dict]):
    """The ``CVResult.pit`` DataFrame from the per-(run, stream) parts of :func:`_scores`."""
    import pandas as pd

    sizes = [len(p["pit"]) for p in parts]
    col = {c: np.repeat([p[c] for p in parts], sizes) if parts else np.array([], dtype=object)
           for c in ("fold", "run", "stream", "modality")}
    return pd.DataFrame({
        "fold": col["fold"].astype(np.int64),
        "run": col["run"].astype(np.int64),
        "stream": pd.Categorical(col["stream"]),
        "modality": pd.Categorical(col["modality"]),
        "feature": np.concatenate([p["feature"] for p in parts]).astype(np.int64) if parts else np.array([], int),
        "pit": np.concatenate([p["pit"] for p in parts]) if parts else np.array([], float),
    }, columns=list(PIT_COLUMNS))


def cross_validate(data: Dataset, spec: ModelSpec, method: str = "rmsrm", folds: int = 5, mask: str = "time_blocks",
                   seed: int = 0, *, model_kwargs: dict | None = None, init="rmsrm", require_converged: bool = True,
                   predictive: str = "plugin", predictive_draws: int = 100, params=None, **fit_kwargs) -> CVResult:
    """K-fold cross-validation by masking (module docstring).

    Args:
        data: the Dataset.
        spec: the ModelSpec to fit.
        method: ``"rmsrm"`` (:func:`msrm.fit_rmsrm`) or ``"map"`` (``msrm.GPMSRM(...).fit_map``).
        folds: number of folds (>= 2), which is also the number of time windows per run.
        mask: ``"time_blocks"`` or ``"features"``.
        seed: seeds the feature groups of the ``"features"`` mask and every fit.
        model_kwargs: ``"map"`` only: keywords of :class:`msrm.GPMSRM` (``linear_algebra``, ``priors``, ...).
        init: ``"map"`` only: ``"rmsrm"`` (default: start each fold's MAP fit from a one-restart R-MSRM fit of the
            same masked data, lags and widths moved inside their bounds), None (``model.initial_params``) or
            a start accepted by ``fit_map``.
        require_converged: True (default): refuse a fold whose fit did not converge (:class:`NotConvergedError`,
            raised as soon as that fold is fitted); False: score it, with ``converged=False`` in its rows.
        predictive: ``"map"`` only: ``"plugin"`` (the predictive at the MAP parameters) or ``"laplace"``
            (parameter uncertainty integrated over ``predictive_draws`` draws of the Laplace approximation at
            each fold's MAP; module docstring, Predictive). A fold that did not converge has no mode to expand
            about and is scored (when ``require_converged`` is False) with its plug-in predictive.
        predictive_draws: S, the Laplace draws per fold (an integer >= 2).
        params: ``"map"`` only: score every fold at these :class:`msrm.Params` (e.g. a simulation's true
            parameters) with no fit; ``init``, ``predictive`` and the fit keywords are then unused.
        **fit_kwargs: passed to ``fit_rmsrm`` (e.g. ``restarts``, ``max_iter``, ``n_jobs``) or to ``fit_map``
            (e.g. ``maxiter``).
    Returns:
        :class:`CVResult`.
    Raises:
        ValueError: bad input (see :func:`fold_masks`), before any fit.
        NotConvergedError: a fold's fit did not converge and ``require_converged`` is True.
        msrm.gp.laplace.NotPositiveDefiniteError: ``predictive="laplace"`` and a fold's Hessian at its MAP is
            not positive definite (a saddle or a direction the fold's data do not determine).
    """
    import pandas as pd

    from .runtime import execution_info

    _check(data, spec, method, folds, mask, seed)
    if not isinstance(require_converged, (bool, np.bool_)):
        raise ValueError(f"require_converged must be True or False, got {require_converged!r}")
    _check_predictive(method, predictive, predictive_draws, params)
    masks = fold_masks(data, int(folds), mask, int(seed))  # every refusal before any fit
    model_kwargs = dict(model_kwargs or {})
    rows, pit, seconds, converged = [], [], [], []
    for f, held in enumerate(masks):
        t0 = time.perf_counter()
        preds, ok, how = _fit_predict(masked(data, held), spec, method, int(seed), model_kwargs, init, fit_kwargs,
                                      predictive, int(predictive_draws), params)
        seconds.append(time.perf_counter() - t0)
        if not ok and require_converged:
            name = "R-MSRM (fit_rmsrm)" if method == "rmsrm" else "GP-MAP (fit_map)"
            raise NotConvergedError(
                f"cross_validate(method={method!r}, mask={mask!r}): the {name} fit of fold {f} of {folds} did not "
                f"converge ({how}); its held-out scores would describe the iteration limit, not the model. Raise "
                f"the iteration limit ({'max_iter' if method == 'rmsrm' else 'maxiter'}) or pass "
                f"require_converged=False to score it anyway (its rows then say converged=False)")
        converged.append(bool(ok))
        fold_rows, fold_pit = _scores(data, held, preds, f, converged=ok)
        rows.extend(fold_rows)
        pit.extend(fold_pit)
    table = pd.DataFrame(rows, columns=list(FOLD_COLUMNS))
    summary = _pooled(table, "stream")
    summary.insert(0, "modality", table.groupby("stream", sort=False)["modality"].first())
    summary.insert(summary.columns.get_loc("sst") + 2, "r2_fold_mean", table.groupby("stream", sort=False)["r2"].mean())
    by_modality = _pooled(table, "modality")
    by_modality.insert(0, "n_streams", table.groupby("modality", sort=False)["stream"].nunique())
    return CVResult(folds=table, summary=summary, by_modality=by_modality, pit=_pit_frame(pit),
                    converged=np.array(converged, dtype=bool), method=method, mask=mask, n_folds=int(folds),
                    n_factors=spec.n_factors, seed=int(seed), require_converged=bool(require_converged),
                    fit_seconds=np.array(seconds), execution_info=execution_info(),
                    predictive="fixed" if params is not None else predictive)
