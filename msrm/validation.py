r"""Cross-validation of R-MSRM and GP-MSRM (MAP): held-out log predictive density and R^2 per fold and stream.

Each fold sets a set of observed values to NaN, fits the model to what is left, predicts the held-out values
(every model predicts missing samples: ``RFit.predict``, ``GPMSRM.predict``) and scores them. Nothing held out
enters the fit, so the scores measure prediction of unseen data.

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

**Scores** of fold f and stream s, over the held-out values y (pooled over runs), with the predictive mean m and
sd v of each value:

- ``lpd = sum log N(y; m, v^2)``, the held-out log predictive density. GP-MSRM (MAP): m and v are the
  posterior predictive mean and sd at the MAP parameters (latent uncertainty and noise). R-MSRM is a point
  estimate: v is its fitted noise sd, which ignores the uncertainty of the fitted latents and loadings, so its
  lpd is optimistic about v (compare R-MSRM lpd values with each other, e.g. across K, rather than with GP-MSRM).
- ``r2 = 1 - SSE / SST``, SSE the squared prediction errors and SST the squared deviations of the held-out
  values from their own per-feature mean (a feature's intercept is not credited as prediction).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from .data import Dataset, Run, Stream
from .spec import ModelSpec

__all__ = ["cross_validate", "CVResult", "fold_masks", "METHODS", "MASKS"]

METHODS = ("rmsrm", "map")
MASKS = ("time_blocks", "features")
# every window must hold this many samples of each stream it holds out (R^2 needs a spread of held-out values)
MIN_BLOCK_SAMPLES = 2


@dataclass(frozen=True, eq=False)
class CVResult:
    """The result of :func:`cross_validate`.

    Fields:
        folds: pandas DataFrame, one row per (fold, stream): ``fold``, ``stream``, ``modality``, ``n_heldout``,
            ``lpd`` (summed), ``lpd_per_value``, ``sse``, ``sst``, ``r2``.
        summary: pandas DataFrame indexed by stream: ``modality``, ``n_heldout``, ``lpd``, ``lpd_per_value``,
            ``r2`` (pooled: 1 - sum SSE / sum SST over folds), ``r2_fold_mean``.
        method, mask, n_folds, n_factors, seed: the settings.
        fit_seconds: (n_folds,) wall seconds of each fold's fit and prediction.
        execution_info: ``msrm.runtime.execution_info()``.
    """

    folds: object
    summary: object
    method: str
    mask: str
    n_folds: int
    n_factors: int
    seed: int
    fit_seconds: np.ndarray
    execution_info: dict = field(default_factory=dict)

    @property
    def lpd(self) -> float:
        """Held-out log predictive density summed over every fold and stream."""
        return float(self.folds["lpd"].sum())

    @property
    def r2(self) -> float:
        """R^2 pooled over every fold and stream (1 - total SSE / total SST)."""
        return float(1.0 - self.folds["sse"].sum() / self.folds["sst"].sum())

    def __repr__(self) -> str:
        return (f"CVResult(method={self.method!r}, mask={self.mask!r}, folds={self.n_folds}, K={self.n_factors}, "
                f"lpd={self.lpd:.6g}, r2={self.r2:.4f})")


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


def _masked(data: Dataset, held: list[dict]) -> Dataset:
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


def _fit_predict(masked: Dataset, spec: ModelSpec, method: str, seed: int, model_kwargs: dict, init,
                 fit_kwargs: dict) -> list[dict]:
    """Fit one fold's masked data; return its predictions (per run, stream key -> Prediction)."""
    from .rmsrm import fit_rmsrm

    if method == "rmsrm":
        fit = fit_rmsrm(masked, spec, **{"progress": False, "seed": seed, **fit_kwargs})
        return fit.predict(masked)
    from .gp.model import GPMSRM

    model = GPMSRM(masked, spec, **model_kwargs)
    start = None
    if init == "rmsrm":
        rf = fit_rmsrm(masked, spec, restarts=1, max_iter=50, n_jobs=1, progress=False, seed=seed)
        p = rf.params
        response = {k: _inside(v, spec.response(k.split("/")[-1])) for k, v in p.response.items()}
        start = p.replace(response=response)
    elif init is not None:
        start = init
    result = model.fit_map(**{"init": start, "seed": seed, "progress": False, **fit_kwargs})
    return model.predict(result.params)


def _scores(data: Dataset, held: list[dict], preds: list[dict], fold: int) -> list[dict]:
    """One row per held-out stream of a fold: lpd, SSE and SST pooled over runs."""
    from scipy.stats import norm

    acc: dict[str, dict] = {}
    for run, h, pred in zip(data.runs, held, preds):
        for key, m in h.items():
            if not m.any():
                continue
            y, p = run.stream(key).values, pred[key]
            a = acc.setdefault(key, {"lpd": 0.0, "sse": 0.0, "n": 0, "sum": 0.0, "sum2": 0.0, "nf": 0.0})
            a["lpd"] += float(np.sum(norm.logpdf(y[m], p.mean[m], p.sd[m])))
            a["sse"] += float(np.sum((y[m] - p.mean[m]) ** 2))
            a["n"] += int(m.sum())
            yv = np.where(m, y, 0.0)  # per-feature sums of the held-out values, for SST
            a["sum"] = a["sum"] + yv.sum(axis=0)
            a["sum2"] = a["sum2"] + (yv * yv).sum(axis=0)
            a["nf"] = a["nf"] + m.sum(axis=0)
    rows = []
    for key, a in acc.items():
        nf = np.asarray(a["nf"], dtype=np.float64)
        has = nf > 0
        sst = float(np.sum(a["sum2"][has] - a["sum"][has] ** 2 / nf[has]))
        rows.append({"fold": fold, "stream": key, "modality": key.split("/", 1)[1], "n_heldout": a["n"],
                     "lpd": a["lpd"], "lpd_per_value": a["lpd"] / a["n"], "sse": a["sse"], "sst": sst,
                     "r2": 1.0 - a["sse"] / sst if sst > 0 else float("nan")})
    return rows


def cross_validate(data: Dataset, spec: ModelSpec, method: str = "rmsrm", folds: int = 5, mask: str = "time_blocks",
                   seed: int = 0, *, model_kwargs: dict | None = None, init="rmsrm", **fit_kwargs) -> CVResult:
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
        **fit_kwargs: passed to ``fit_rmsrm`` (e.g. ``restarts``, ``max_iter``, ``n_jobs``) or to ``fit_map``
            (e.g. ``maxiter``).
    Returns:
        :class:`CVResult`.
    """
    import pandas as pd

    from .runtime import execution_info

    _check(data, spec, method, folds, mask, seed)
    masks = fold_masks(data, int(folds), mask, int(seed))  # every refusal before any fit
    model_kwargs = dict(model_kwargs or {})
    rows, seconds = [], []
    for f, held in enumerate(masks):
        t0 = time.perf_counter()
        preds = _fit_predict(_masked(data, held), spec, method, int(seed), model_kwargs, init, fit_kwargs)
        seconds.append(time.perf_counter() - t0)
        rows.extend(_scores(data, held, preds, f))
    table = pd.DataFrame(rows, columns=["fold", "stream", "modality", "n_heldout", "lpd", "lpd_per_value", "sse",
                                        "sst", "r2"])
    g = table.groupby("stream", sort=False)
    summary = pd.DataFrame({
        "modality": g["modality"].first(),
        "n_heldout": g["n_heldout"].sum(),
        "lpd": g["lpd"].sum(),
        "lpd_per_value": g["lpd"].sum() / g["n_heldout"].sum(),
        "r2": 1.0 - g["sse"].sum() / g["sst"].sum(),
        "r2_fold_mean": g["r2"].mean(),
    })
    return CVResult(folds=table, summary=summary, method=method, mask=mask, n_folds=int(folds),
                    n_factors=spec.n_factors, seed=int(seed), fit_seconds=np.array(seconds),
                    execution_info=execution_info())
