"""A cost model of one GP value+gradient, fitted from the committed results rows, per device.

Two backends, two formulas (seconds per value+gradient):

* grouped: ``t = a * sum_runs (N_r K)^3 + b * observations (+ c)``, ``N_r`` the run's grouped node count
  (:func:`msrm.count_nodes`), ``K`` the factors, ``observations`` the non-missing values of the dataset;
* state space: ``t = c * sum_runs T_r S_r^2 (+ d)``, ``T_r`` the run's grid steps and ``S_r`` its state
  dimension (``RunTables.n_steps`` and ``RunTables.n_states`` of :mod:`msrm.gp.state_space.prepare`).

Fit: per fit key (the device label; where one label holds rows of several BLAS kernels, the label and the kernel,
``"<label>/<kernel>"``), non-negative least squares (:func:`scipy.optimize.nnls`) on **relative** errors: every
row of the design and the measured time are divided by the measured time, so the fit minimises
``sum_i ((t_hat_i - t_i) / t_i)^2``. The constant term is kept only where it lowers the median absolute
leave-one-out relative error. Held-back error: leave-one-out, the relative error ``t_hat / t - 1`` of each row
predicted by the fit to the other rows.

Configuration -> sizes (:func:`study_sizes`): the study layout of ``data_synth``'s ``"one-eighth"`` profile
(brain participants with ``features`` features, the other participants with a rating and a physiology stream)
built by the package's own classes with one feature per stream (node counts, grids and state dimensions do not
depend on the feature count), so nothing as large as the data is built. Observations are the streams' sample
counts times their feature counts. Memory of grouped: :func:`msrm.gp.memory.likelihood_peak_bytes`; refusal:
:func:`msrm.gp.memory.check_memory` (the guard's own functions).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

__all__ = ["Fit", "CostRow", "study_dataset", "study_sizes", "cost_rows", "fit_nnls", "leave_one_out",
           "fit_backend", "fit_all", "predict", "BACKENDS"]

BACKENDS = ("grouped", "state_space")
PROFILE = "one-eighth"
# the brain modality of the profile (the one whose feature count is the ``features`` argument)
_BRAIN = "brain"


# ---------------------------------------------------------------------------------------------- validation

def _count(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        if isinstance(value, (float, np.floating)) and math.isfinite(value) and float(value).is_integer():
            value = int(value)
        else:
            raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value}")
    return value


def _positive(name: str, value: Any) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}") from None
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return v


# ---------------------------------------------------------------------------------------------- layout

def _participants(n_participants: int, profile) -> dict[str, tuple]:
    """Participant names per modality: the profile's brain share of participants (at least one) record brain
    features, the others the profile's remaining modalities; the profile's own count gives its own layout."""
    brain = [m for m in profile.modalities if m.name == _BRAIN]
    others = [m for m in profile.modalities if m.name != _BRAIN]
    total = len({p for m in profile.modalities for p in m.participants})
    share = len(brain[0].participants) / total if brain else 0.0
    n_brain = max(1, int(round(n_participants * share))) if brain else 0
    n_brain = min(n_brain, n_participants)
    names = [f"p{i + 1}" for i in range(n_participants)]
    out = {}
    for m in brain:
        out[m.name] = tuple(names[:n_brain])
    for m in others:
        out[m.name] = tuple(names[n_brain:])
    return out


def study_dataset(N_participants: int, K: int, duration_s: float, runs: int, features: int, *,
                  split: bool = False):
    """The configuration's study as a one-feature :class:`msrm.Dataset`, its :class:`msrm.ModelSpec`, and the
    feature count of each stream key (for the observation count).

    Args:
        N_participants: participants (the ``"one-eighth"`` profile's layout has nine: four brain, five with a
            rating and a physiology stream; other counts keep its brain share, at least one brain participant).
        K: factors. duration_s: seconds per run. runs: runs. features: brain features per brain participant.
        split: False: ``runs`` independent runs of ``duration_s`` (as ``data_synth.synthetic_dataset``'s
            ``n_runs``); True: one recording of ``runs * duration_s`` cut into ``runs`` pieces by
            :func:`msrm.data.split_run` (the scaling benchmark's ``"runs"`` layout).
    """
    import msrm
    from data_synth.study import PROFILES
    from msrm.data import split_run

    n_p = _count("N_participants", N_participants)
    K = _count("K", K)
    duration = _positive("duration_s", duration_s)
    n_runs = _count("runs", runs)
    F = _count("features", features)
    prof = PROFILES[PROFILE]
    spec = msrm.ModelSpec(n_factors=K, latent_dt=prof.latent_dt, responses=dict(prof.responses))
    who = _participants(n_p, prof)

    def one_run(length: float):
        streams, feats = [], {}
        for mod in prof.modalities:
            n_feat = F if mod.n_features is None else mod.n_features
            n = int(math.floor(length / mod.dt + 1e-9)) + 1  # as data_synth samples a run
            for p in who[mod.name]:
                streams.append(msrm.Stream(participant=p, modality=mod.name, dt=mod.dt, values=np.zeros((n, 1)),
                                           offset=0.0))
                feats[f"{p}/{mod.name}"] = n_feat
        return msrm.Run(duration=length, streams=streams), feats

    if split:
        run, feats = one_run(duration * n_runs)
        pieces = split_run(run, n_runs) if n_runs > 1 else [run]
    else:
        pieces, feats = [], {}
        for _ in range(n_runs):
            run, feats = one_run(duration)
            pieces.append(run)
    return msrm.Dataset(pieces), spec, feats


@dataclass(frozen=True)
class Sizes:
    """What the cost model needs of a configuration.

    Fields: K; node_counts (grouped nodes per run); nk_cubed (sum of (N_r K)^3); observations; grid_steps (T_r
    per run); state_dims (S_r per run); ts2 (sum of T_r S_r^2); block (the scan's block length per run).
    """

    K: int
    node_counts: tuple
    nk_cubed: float
    observations: int
    grid_steps: tuple = ()
    state_dims: tuple = ()
    ts2: float = float("nan")
    block: tuple = ()


def study_sizes(N_participants: int, K: int, duration_s: float, runs: int, features: int, *, split: bool = False,
                state_space: bool = True) -> Sizes:
    """Sizes of a configuration through the package's own layout code (node counting in :mod:`msrm.nodes`,
    the state-space step tables of :mod:`msrm.gp.state_space.prepare`, block length chosen as the backend
    chooses it on this machine). ``state_space=False`` skips the state-space tables (no JAX import)."""
    import msrm

    data, spec, feats = study_dataset(N_participants, K, duration_s, runs, features, split=split)
    counts = tuple(int(n) for n in msrm.count_nodes(data, spec))
    obs = int(sum(s.n_samples * feats[s.key] for r in data.runs for s in r.streams))
    nk3 = float(sum(float(n * spec.n_factors) ** 3 for n in counts))
    if not state_space:
        return Sizes(spec.n_factors, counts, nk3, obs)
    from msrm.gp.state_space.prepare import prepare

    tables = [r.tables for r in prepare(data, spec, method="callback").runs]
    T = tuple(int(t.n_steps) for t in tables)
    S = tuple(int(t.n_states) for t in tables)
    return Sizes(spec.n_factors, counts, nk3, obs, T, S, float(sum(t * s * s for t, s in zip(T, S))),
                 tuple(int(t.block) for t in tables))


# ---------------------------------------------------------------------------------------------- rows

@dataclass(frozen=True)
class CostRow:
    """One measured value+gradient as the cost model sees it: fit key, backend, the design terms, seconds."""

    key: str
    backend: str
    terms: tuple  # grouped: (sum (NK)^3, observations); state space: (sum T S^2,)
    seconds: float
    source: str
    K: int
    scale: float


def _num(row, name, default=None):
    v = row.get(name, default) if isinstance(row, dict) else getattr(row, name, default)
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return default
    return v


_GROUPED_SOURCES = [
    # (notebook, experiment, metric, backend column or None (all grouped), extra filter)
    ("gp_grouped", "value_and_grad", "median_s"),
    ("gp_grouped", "feature_sweep", "median_s"),
    ("scaling", "value_and_grad", "median_s"),
    ("state_space", "ladder", "median_s"),
    ("state_space", "speed", "median_s"),
    ("state_space", "targets", "grouped_median_s"),
    ("gradient_nuts", "objective_gradient", "value_and_grad_median_s"),
    ("latent", "posterior", "value_and_grad_median_s"),
]
_STATE_SPACE_METRICS = ("median_s", "long_value_and_grad_s", "state_space_median_s")
_STATE_SPACE_EXPERIMENTS = ("speed", "block", "ladder", "targets", "parallel")


def _fit_keys(df: pd.DataFrame) -> pd.Series:
    """The device label, with the BLAS kernel appended where one label holds rows of several kernels."""
    kern = df.get("info_blas_kernel", pd.Series(index=df.index, dtype=object)).fillna("")
    n_kern = kern.groupby(df["device"]).transform("nunique")
    return df["device"].where(n_kern <= 1, df["device"] + "/" + kern)


def cost_rows(df: pd.DataFrame) -> list[CostRow]:
    """The value+gradient rows the model is fitted to (measured, float64, the default factorization), with their
    sizes: grouped from the rows' K, features, duration scale and layout through :func:`study_sizes`; state
    space from the rows' own ``n_steps`` and ``n_states`` (single-run rows of the sequential host scan)."""
    if df.empty or not {"status", "notebook", "experiment", "metric", "value", "device"} <= set(df.columns):
        return []
    df = df[df["status"] == "measured"].copy()
    if df.empty:
        return []
    df["fit_key"] = _fit_keys(df)
    out: list[CostRow] = []
    cache: dict = {}
    for nb, exp, metric in _GROUPED_SOURCES:
        sel = df[(df.notebook == nb) & (df.experiment == exp) & (df.metric == metric)]
        for _, r in sel.iterrows():
            backend = _num(r, "backend") or _num(r, "linear_algebra") or "grouped"
            if backend != "grouped" or _num(r, "method", "auto") not in ("auto", "callback"):
                continue
            if _num(r, "K") is None or _num(r, "n_features") is None or not _num(r, "value", 0) > 0:
                continue
            K, F = int(r["K"]), int(r["n_features"])
            scale = float(_num(r, "scale") or _num(r, "duration_scale") or 1.0)
            layout = _num(r, "layout", "one_run")
            n_runs = int(_num(r, "n_runs", 1))
            from data_synth.study import PROFILES

            length = PROFILES[PROFILE].duration * scale
            split = layout == "runs" and n_runs > 1
            args = (K, length / n_runs if split else length, n_runs, F, split)
            if args not in cache:
                cache[args] = study_sizes(9, args[0], args[1], args[2], args[3], split=split, state_space=False)
            sz = cache[args]
            out.append(CostRow(r["fit_key"], "grouped", (sz.nk_cubed, float(sz.observations)), float(r["value"]),
                               f"{nb}/{exp}", K, scale))
    sel = df[df.notebook.eq("state_space") & df.experiment.isin(_STATE_SPACE_EXPERIMENTS)
             & df.metric.isin(_STATE_SPACE_METRICS)]
    for _, r in sel.iterrows():
        T, S = _num(r, "n_steps"), _num(r, "n_states")
        if (T is None or S is None or _num(r, "K") is None or not _num(r, "value", 0) > 0
                or _num(r, "filter_method") != "callback" or bool(_num(r, "parallel", False))):
            continue
        scale = float(_num(r, "scale") or _num(r, "duration_scale") or 1.0)
        out.append(CostRow(r["fit_key"], "state_space", (float(T) * float(S) ** 2,), float(r["value"]),
                           f"state_space/{r['experiment']}", int(r["K"]), scale))
    return out


# ---------------------------------------------------------------------------------------------- fit

def fit_nnls(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative coefficients minimising the sum of squared relative errors ``((X c - y) / y)^2``."""
    from scipy.optimize import nnls

    X = np.asarray(X, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if X.ndim != 2 or y.shape != (X.shape[0],):
        raise ValueError(f"X must be (n, p) and y (n,), got {X.shape} and {y.shape}")
    if np.any(~np.isfinite(y)) or np.any(y <= 0):
        raise ValueError("y (measured seconds) must be finite and > 0")
    # scale the columns so that NNLS works on numbers near one (sizes reach 1e12), then scale back
    A = X / y[:, None]
    norm = np.linalg.norm(A, axis=0)
    norm[norm == 0] = 1.0
    coef, _ = nnls(A / norm, np.ones_like(y))
    return coef / norm


def leave_one_out(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Relative error ``t_hat_i / t_i - 1`` of each row predicted by the fit to the other rows."""
    X = np.asarray(X, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    err = np.empty(y.size)
    for i in range(y.size):
        keep = np.arange(y.size) != i
        c = fit_nnls(X[keep], y[keep])
        err[i] = float(X[i] @ c) / y[i] - 1.0
    return err


@dataclass(frozen=True)
class Fit:
    """One backend's fit on one fit key: coefficient names and values, the rows, their leave-one-out errors."""

    key: str
    backend: str
    names: tuple
    coef: tuple
    X: np.ndarray = field(repr=False)
    y: np.ndarray = field(repr=False)
    loo: np.ndarray = field(repr=False)
    sources: tuple = field(repr=False, default=())
    constant: bool = False

    def extrapolation(self, terms) -> float:
        """How far ``terms`` lie beyond the fitted rows: the largest ratio of a term to its largest fitted value."""
        top = self.X[:, : len(terms)].max(axis=0)
        return float(max(t / m for t, m in zip(terms, top) if m > 0))

    def predict_terms(self, terms) -> float:
        x = list(terms) + ([1.0] if self.constant else [])
        return float(np.dot(x, self.coef))

    @property
    def fitted(self) -> np.ndarray:
        return self.X @ np.asarray(self.coef)


_NAMES = {"grouped": ("a", "b"), "state_space": ("c",)}
_CONST = {"grouped": "c", "state_space": "d"}
_MIN_ROWS = 3


def fit_backend(rows: list[CostRow], key: str, backend: str, *, constant: bool | None = None) -> Fit | None:
    """Fit one backend on one key's rows; ``constant=None`` keeps the constant where it lowers the median
    absolute leave-one-out error. None where there are fewer than three rows or fewer distinct sizes than terms."""
    sel = [r for r in rows if r.key == key and r.backend == backend]
    if len(sel) < _MIN_ROWS:
        return None
    X0 = np.array([r.terms for r in sel], dtype=np.float64)
    y = np.array([r.seconds for r in sel], dtype=np.float64)
    if len({tuple(x) for x in X0}) < X0.shape[1] + 1:
        return None
    X1 = np.c_[X0, np.ones(len(sel))]
    if constant is None:
        e0, e1 = leave_one_out(X0, y), leave_one_out(X1, y)
        constant = bool(np.median(np.abs(e1)) < np.median(np.abs(e0)))
    X = X1 if constant else X0
    names = _NAMES[backend] + ((_CONST[backend],) if constant else ())
    return Fit(key, backend, names, tuple(float(c) for c in fit_nnls(X, y)), X, y, leave_one_out(X, y),
               tuple(r.source for r in sel), constant)


def fit_all(df: pd.DataFrame | None = None, rows: list[CostRow] | None = None) -> dict[str, dict[str, Fit]]:
    """``{fit key: {backend: Fit}}`` for every key and backend with enough rows (default: every committed row)."""
    if rows is None:
        if df is None:
            from . import book

            df = book.load_results()
        rows = cost_rows(df)
    out: dict[str, dict[str, Fit]] = {}
    for key in sorted({r.key for r in rows}):
        fits = {b: f for b in BACKENDS if (f := fit_backend(rows, key, b)) is not None}
        if fits:
            out[key] = fits
    return out


def coefficient_table(fits: dict[str, dict[str, Fit]]) -> pd.DataFrame:
    """One row per (key, backend): coefficients, rows, median and largest absolute leave-one-out error."""
    recs = []
    for key, per in fits.items():
        for b, f in per.items():
            rec = {"device": key, "backend": b, "rows": len(f.y)}
            for n, c in zip(f.names, f.coef):
                rec[n] = c
            rec["loo_median_abs"] = float(np.median(np.abs(f.loo)))
            rec["loo_max_abs"] = float(np.max(np.abs(f.loo)))
            recs.append(rec)
    return pd.DataFrame(recs)


# ---------------------------------------------------------------------------------------------- predict

def predict(N_participants: int, K: int, duration_s: float, runs: int, features: int, device: str | None = None,
            *, fits: dict | None = None, limit_bytes: int | None = None) -> pd.DataFrame:
    """Predicted seconds per value+gradient and memory, per device and backend, for a study configuration.

    Args:
        N_participants, K, duration_s, runs, features: the study (:func:`study_dataset`).
        device: one fit key (:func:`fit_all`'s keys), or None for every key with a fit.
        fits: from :func:`fit_all` (default: fitted now from the committed rows).
        limit_bytes: the memory the grouped guard may use (default: the guard's own limit on this machine,
            ``MSRM_MEMORY_LIMIT_BYTES`` or available host memory).

    Returns:
        DataFrame with columns device, backend, seconds (NaN where no fit), memory_bytes (grouped: the guard's
        prediction; state space: None, the package has no calibrated peak model), refused (grouped: whether
        the guard would refuse it), beyond_fitted (the largest ratio of a size term to its largest value among
        the fitted rows: above one is extrapolation), and ``attrs["sizes"]`` (:class:`Sizes`).
    """
    # every argument checked before any work
    _count("N_participants", N_participants)
    _count("K", K)
    _positive("duration_s", duration_s)
    _count("runs", runs)
    _count("features", features)
    if limit_bytes is not None:
        _count("limit_bytes", limit_bytes, 0)
    if fits is None:
        fits = fit_all()
    if device is not None:
        if device not in fits:
            raise ValueError(f"device {device!r} has no fit; devices with a fit: {sorted(fits)}")
        keys = [device]
    else:
        keys = sorted(fits)
    from msrm.gp import memory

    sizes = study_sizes(N_participants, K, duration_s, runs, features)
    nbytes, _ = memory.likelihood_peak_bytes(list(sizes.node_counts), sizes.K)
    try:
        memory.check_memory(nbytes, what="the grouped likelihood", limit=limit_bytes)
        refused = False
    except memory.MemoryGuardError:
        refused = True
    terms = {"grouped": (sizes.nk_cubed, float(sizes.observations)), "state_space": (sizes.ts2,)}
    recs = []
    for key in keys:
        for b in BACKENDS:
            f = fits[key].get(b)
            recs.append({"device": key, "backend": b,
                         "seconds": f.predict_terms(terms[b]) if f is not None else float("nan"),
                         "memory_bytes": nbytes if b == "grouped" else None,
                         "refused": refused if b == "grouped" else False,
                         "beyond_fitted": f.extrapolation(terms[b]) if f is not None else float("nan")})
    out = pd.DataFrame(recs)
    out.attrs["sizes"] = sizes
    return out
