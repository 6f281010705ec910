"""Figures for the book, drawn from results rows when the book is built.

Every function takes the DataFrame of :func:`msrm_lab.book.load_results` (or, for :func:`recovered_latents`, a
small fit made on the spot) and returns a :class:`matplotlib.figure.Figure` built without ``pyplot``: nothing is
shown, no global figure state is touched, and any backend (Agg included) can render it. A chapter cell ends with
the figure (or ``glue("name", fig, display=False)``); inside an IPython kernel the first figure registers a PNG
formatter for :class:`~matplotlib.figure.Figure` when none is registered (pyplot registers one when imported).
Chapters call:

    df = mb.load_results()
    cost_curves(df)                      # state-space notebook, ladder and targets: cost against recording length
    feature_sweep(df)                    # gp_grouped notebook, feature_sweep: cost against the number of features
    nuts_phases(df)                      # gradient_nuts notebook: the wall of every NUTS phase, stacked
    recovered_latents()                  # a small R-MSRM fit on synthetic data against its true latents

Conventions shared by all of them: each device is drawn in its preferred profile (note > full > quick > smoke, as
the tables do), labels in the legend name the device and profile; a point gets an error bar from the ``min_s``/``max_s``
params of its row when present, else from the min and max of its ``samples``; when no device label starts with
``cuda-`` the legend carries the entry :data:`GPU_NOT_MEASURED`.
"""
from __future__ import annotations

import math
import re
from typing import Any, Sequence

import numpy as np
import pandas as pd

from . import book as mb

__all__ = ["GPU_NOT_MEASURED", "NUTS_PHASES", "accuracy_sweep", "cost_curves", "feature_sweep", "nuts_phases",
           "recovery_fit", "recovered_latents"]

GPU_NOT_MEASURED = "GPU: not measured in this build"
# the phases of msrm.gp.posterior.sample in the order they run (msrm_lab.bench.nuts.PHASES less "total")
NUTS_PHASES = ("initialisation", "compilation", "warmup", "sampling", "draw_conversion", "pointwise_loglik",
               "diagnostics")
_NUTS_EXPERIMENTS = ("nuts", "nuts_vectorized", "nuts_chain")
_REFUSED = ("not_yet_measured", "refused")
_PREDICTED = re.compile(r"predicted\s+([0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)\s*s\b")


# ------------------------------------------------------------------------------------------------------ helpers
def _show_in_ipython(figure_type) -> None:
    """In an IPython kernel, render Figures as PNG (pyplot does this when imported; these figures bypass it)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is None:
        return
    png = shell.display_formatter.formatters["image/png"]
    try:
        png.lookup_by_type(figure_type)
    except KeyError:
        from IPython.core.pylabtools import print_figure

        png.for_type(figure_type, lambda fig: print_figure(fig, "png", bbox_inches="tight"))


def _figure(ncols: int = 1, nrows: int = 1, figsize=(7.0, 4.5), **kw):
    from matplotlib.figure import Figure

    _show_in_ipython(Figure)
    fig = Figure(figsize=figsize, layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False, **kw)
    return fig, axes


def _check_frame(df) -> pd.DataFrame:
    if not isinstance(df, pd.DataFrame):
        raise TypeError(f"df must be a pandas DataFrame from msrm_lab.book.load_results(), got {type(df).__name__}")
    missing = [c for c in ("device", "profile", "notebook", "experiment", "metric", "value", "status")
               if c not in df.columns]
    if missing:
        raise ValueError(f"df lacks the results columns {missing}; pass msrm_lab.book.load_results()")
    return df


def _rows(df: pd.DataFrame, notebook: str, experiment=None, metric=None) -> pd.DataFrame:
    """Rows of one notebook (and experiment, metric), each device in its preferred profile."""
    sub = df[df["notebook"] == notebook]
    for col, want in (("experiment", experiment), ("metric", metric)):
        if want is not None:
            sub = sub[sub[col].isin([want] if isinstance(want, str) else list(want))]
    if sub.empty:
        return sub
    rank = {p: i for i, p in enumerate(mb.PROFILE_ORDER)}
    r = sub["profile"].map(lambda p: rank.get(p, len(rank)))
    best = r.groupby(sub["device"]).transform("min")
    return sub[r == best]


def _num(v) -> float:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return math.nan
    return f


def _col(row: pd.Series, name: str):
    return row[name] if name in row.index else None


def _spread(row: pd.Series) -> tuple[float, float]:
    """(low, high) of a row's repeats: params min_s/max_s (or min/max), else its samples; NaN when none."""
    for lo, hi in (("min_s", "max_s"), ("min", "max")):
        a, b = _num(_col(row, lo)), _num(_col(row, hi))
        if math.isfinite(a) and math.isfinite(b):
            return a, b
    samples = _col(row, "samples")
    if isinstance(samples, (list, tuple, np.ndarray)) and len(samples):
        s = np.asarray([_num(x) for x in samples], dtype=np.float64)
        s = s[np.isfinite(s)]
        if s.size:
            return float(s.min()), float(s.max())
    return math.nan, math.nan


def _yerr(values: Sequence[float], spreads: Sequence[tuple[float, float]]):
    """Asymmetric error bars (2, n) from the spreads, or None when no point has one."""
    lo = np.array([v - s[0] if math.isfinite(s[0]) else 0.0 for v, s in zip(values, spreads)])
    hi = np.array([s[1] - v if math.isfinite(s[1]) else 0.0 for v, s in zip(values, spreads)])
    if not (np.any(lo > 0) or np.any(hi > 0)):
        return None
    return np.vstack([np.maximum(lo, 0.0), np.maximum(hi, 0.0)])


def _has_gpu(df: pd.DataFrame) -> bool:
    return any(str(d).startswith("cuda-") for d in mb.devices_in(df)) if len(df) else False


def _legend(ax, df: pd.DataFrame, *, extra: Sequence[str] = (), order: Sequence[str] = (), **kw) -> None:
    """The legend of the drawn series (those named in ``order`` first, in that order), plus text-only entries
    and the GPU entry when no cuda-* rows exist."""
    from matplotlib.lines import Line2D

    handles, labels = ax.get_legend_handles_labels()
    if order:
        rank = {name: i for i, name in enumerate(order)}
        pairs = sorted(zip(handles, labels), key=lambda hl: rank.get(hl[1], len(rank)))
        handles, labels = [h for h, _ in pairs], [lab for _, lab in pairs]
    notes = list(extra) + ([] if _has_gpu(df) else [GPU_NOT_MEASURED])
    for note in notes:
        handles.append(Line2D([], [], linestyle="none", marker="none"))
        labels.append(note)
    ax.legend(handles, labels, fontsize=8, **kw)


def _plain_log_ticks(axis, ticks: Sequence[float]) -> None:
    """Major ticks at the measured values, written plainly, and no minor labels (a log axis over one decade)."""
    from matplotlib.ticker import FixedLocator, NullFormatter, ScalarFormatter

    ticks = [t for t in ticks if math.isfinite(t) and t > 0]
    if not ticks:
        return
    axis.set_major_locator(FixedLocator(ticks))
    axis.set_major_formatter(ScalarFormatter())
    axis.set_minor_formatter(NullFormatter())


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", fontsize=9, color="0.4")


def _label(v) -> str:
    if v is None or (np.ndim(v) == 0 and pd.isna(v)):
        return ""
    return str(v)


# ---------------------------------------------------------------------------------------------- cost_curves
def cost_curves(df: pd.DataFrame, *, notebook: str = "state_space", experiment: str = "ladder",
                metric: str = "median_s", targets: str | None = "targets", ylabel: str | None = None) -> Any:
    """Cost against recording length per backend and device, log-log, with the targets drawn in.

    Args:
        df: from :func:`msrm_lab.book.load_results`.
        notebook, experiment, metric: the rows drawn (default: the state-space notebook's ``ladder``, the warm
            median of one value and gradient, against the param ``scale``, one series per device and ``backend``,
            split by ``layout`` where rows have one, e.g. ``cost_curves(df, notebook="scaling",
            experiment="value_and_grad")``).
        targets: the experiment holding rows with a ``target`` param in seconds at a ``scale`` (drawn as a
            dashed bar at the target and the measured value with its spread); None draws none.
        ylabel: the y-axis label (default: the metric, in seconds per call).
    Returns:
        the Figure (one axes, log-log). Points a profile refused (status ``not_yet_measured`` or ``refused``)
        are hollow markers at the time their ``reason`` predicts ("predicted 96 s ..."), or at the top edge
        when it predicts none.
    """
    _check_frame(df)
    fig, axes = _figure(figsize=(7.5, 6.0))
    ax = axes[0, 0]
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("recording length (scale: multiples of the profile's design)")
    ax.set_ylabel(ylabel or ("warm median per call (s)" if metric == "median_s" else f"{metric} per call (s)"))
    rows = _rows(df, notebook, experiment, metric)
    rows = rows[rows["scale"].notna()] if "scale" in rows else rows.iloc[0:0]
    keys = [c for c in ("backend", "layout") if c in rows.columns]
    drawn = 0
    if not rows.empty:
        rows = rows.assign(**{c: rows[c].map(_label) for c in keys})
        for i, (key, g) in enumerate(rows.groupby(["device"] + keys, sort=True)):
            key = key if isinstance(key, tuple) else (key,)
            name = " / ".join(k for k in key[1:] if k) or metric
            label = f"{name} ({key[0]}, {g['profile'].iloc[0]} profile)"
            color = f"C{i % 10}"
            ok = g[g["status"] == "measured"].copy()
            ok["x"] = ok["scale"].map(_num)
            ok["y"] = ok["value"].map(_num)
            ok = ok[np.isfinite(ok["x"]) & np.isfinite(ok["y"])].sort_values("x")
            if len(ok):
                spreads = [_spread(r) for _, r in ok.iterrows()]
                ax.errorbar(ok["x"], ok["y"], yerr=_yerr(ok["y"].tolist(), spreads), marker="o", color=color,
                            capsize=3, label=label)
                drawn += 1
            refused = g[g["status"].isin(_REFUSED)]
            if len(refused):
                xs, ys, edge = [], [], []
                for _, r in refused.iterrows():
                    m = _PREDICTED.search(str(_col(r, "reason") or ""))
                    (xs if m else edge).append(_num(r["scale"]))
                    if m:
                        ys.append(float(m.group(1)))
                if xs:
                    ax.plot(xs, ys, linestyle="none", marker="o", markerfacecolor="none", markeredgecolor=color,
                            markersize=8, label=f"{label}: refused, predicted")
                if edge:
                    ax.plot(edge, [1.0] * len(edge), linestyle="none", marker="^", markerfacecolor="none",
                            markeredgecolor=color, transform=ax.get_xaxis_transform(), clip_on=False,
                            label=f"{label}: refused")
    if targets is not None:
        drawn += _draw_targets(ax, _rows(df, notebook, targets))
    if not drawn:
        _empty(ax, f"no {notebook}/{experiment} rows measured in this build")
    scales = sorted({_num(v) for v in rows["scale"]} - {math.nan}) if len(rows) else []
    _plain_log_ticks(ax.xaxis, scales)
    ax.set_title(f"{notebook}: {experiment}", fontsize=10)
    _legend(ax, df, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    return fig


def _draw_targets(ax, rows: pd.DataFrame) -> int:
    """Target rows in seconds at a scale: the target as a dashed bar, the measured value with its spread."""
    if rows.empty or "target" not in rows or "scale" not in rows:
        return 0
    rows = rows[rows["target"].notna() & rows["scale"].notna() & (rows["unit"] == "s")
                & (rows["status"] == "measured")]
    drawn = 0
    for i, (key, g) in enumerate(rows.groupby(["device", "metric"], sort=True)):
        device, metric = key
        x = g["scale"].map(_num).to_numpy()
        y = g["value"].map(_num).to_numpy()
        spreads = [_spread(r) for _, r in g.iterrows()]
        ax.errorbar(x, y, yerr=_yerr(list(y), spreads), linestyle="none", marker="D", color="black",
                    markerfacecolor=f"C{(i + 5) % 10}", capsize=3,
                    label=f"targets/{metric} ({device}, {g['profile'].iloc[0]} profile)")
        kinds = g["target_kind"].dropna().unique().tolist() if "target_kind" in g else []
        for xt, t in sorted(set(zip(x, g["target"].map(_num)))):
            ax.hlines(t, xt / 1.3, xt * 1.3, colors="crimson", linestyles="--", lw=1.5)
        ax.plot([], [], color="crimson", linestyle="--",
                label=f"target of {metric}" + (f" ({', '.join(map(str, kinds))})" if kinds else ""))
        drawn += 1
    return drawn


# -------------------------------------------------------------------------------------------- feature_sweep
def feature_sweep(df: pd.DataFrame, *, notebook: str = "gp_grouped", experiment: str = "feature_sweep") -> Any:
    """The feature-count sweep: the grouped backend's value and gradient against the number of features.

    Args:
        df: from :func:`msrm_lab.book.load_results`.
        notebook, experiment: where the sweep's rows are (``median_s`` and ``added_fraction``, param
            ``n_features``; the ``added_fraction`` rows hold their ``target``).
    Returns:
        the Figure: left, the warm median (s) against features on log-log axes, one series per device, error
        bars from the repeats; right, the time added over the smallest feature count as a fraction of it, with
        the target as a dashed line.
    """
    _check_frame(df)
    fig, axes = _figure(ncols=2, figsize=(9.0, 4.0))
    ax, ax2 = axes[0]
    for a in (ax, ax2):
        a.set_xscale("log")
        a.set_xlabel("features per participant (n_features)")
    ax.set_ylabel("value and gradient, warm median (s)")
    ax2.set_ylabel("added time over the fewest features (fraction)")
    rows = _rows(df, notebook, experiment)
    rows = rows[(rows["status"] == "measured")] if len(rows) else rows
    if len(rows) and "n_features" in rows:
        rows = rows[rows["n_features"].notna()]
    drawn = 0
    target_drawn = False
    for i, (device, g) in enumerate(rows.groupby("device", sort=True) if len(rows) else []):
        color = f"C{i % 10}"
        keys = [c for c in ("K",) if c in g.columns and g[c].notna().any()]
        for metric, a in (("median_s", ax), ("added_fraction", ax2)):
            m = g[g["metric"] == metric]
            for kval, h in (m.groupby(keys) if keys else [((None,), m)]):
                h = h.assign(x=h["n_features"].map(_num), y=h["value"].map(_num)).sort_values("x")
                h = h[np.isfinite(h["x"]) & np.isfinite(h["y"])]
                if h.empty:
                    continue
                kv = kval[0] if isinstance(kval, tuple) else kval
                label = (f"{device}, {h['profile'].iloc[0]} profile"
                         + (f", K = {int(kv)}" if kv is not None and math.isfinite(_num(kv)) else ""))
                spreads = [_spread(r) for _, r in h.iterrows()]
                a.errorbar(h["x"], h["y"], yerr=_yerr(h["y"].tolist(), spreads), marker="o", color=color,
                           capsize=3, label=label)
                drawn += 1
                if metric == "added_fraction" and "target" in h and h["target"].notna().any():
                    for t in sorted(h["target"].dropna().map(_num).unique()):
                        a.axhline(t, color="crimson", linestyle="--", lw=1.2,
                                  label=None if target_drawn else "target (at most)")
                        target_drawn = True
    if not drawn:
        _empty(ax, f"no {notebook}/{experiment} rows measured in this build")
    ticks = sorted({_num(v) for v in rows["n_features"]} - {math.nan}) if len(rows) and "n_features" in rows else []
    for a in (ax, ax2):
        _plain_log_ticks(a.xaxis, ticks)
    ax.set_ylim(bottom=0)
    ax.set_title("cost against features", fontsize=10)
    ax2.set_title("added fraction against features", fontsize=10)
    _legend(ax, df, loc="upper left")
    if ax2.get_legend_handles_labels()[0]:
        ax2.legend(fontsize=8, loc="upper left")
    return fig


# ---------------------------------------------------------------------------------------------- accuracy_sweep
_SWEEP_AXES = (("snr", "loading / noise sd"), ("offset", "intercept / noise sd"),
               ("lengthscale", "lengthscale / grid step (noise 1e-3)"), ("noise", "noise sd / loading"))


def accuracy_sweep(df: pd.DataFrame, *, notebook: str = "reliability", experiment: str = "accuracy",
                   kernel: str = "matern52") -> Any:
    """The accuracy sweep: each backend's log-density error against the 50-digit reference, one panel per swept
    quantity (:mod:`msrm_lab.bench.accuracy`), for one kernel on the first device that has the rows.

    Returns:
        the Figure: absolute error in nats (log scale, exact agreement drawn at 1e-16) against the swept ratio, one
        series per backend; the contract's 1e-3 nats as a dashed line; a case that warned or raised drawn hollow.
    """
    _check_frame(df)
    fig, axes = _figure(ncols=4, figsize=(11.0, 3.4), sharey=True)
    rows = _rows(df, notebook, experiment, "density_error_nats")
    rows = rows[rows["status"] == "measured"] if len(rows) else rows
    if len(rows) and "kernel" in rows:
        rows = rows[rows["kernel"] == kernel]
    device = sorted(rows["device"].unique())[0] if len(rows) else None
    if device is not None:
        rows = rows[rows["device"] == device]
    for ax, (axis, xlabel) in zip(axes[0], _SWEEP_AXES):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.axhline(1e-3, color="crimson", linestyle="--", lw=1.0, label="contract (1e-3 nats)")
        sub = rows[rows["axis"] == axis] if len(rows) else rows
        for i, (backend, g) in enumerate(sub.groupby("backend", sort=True) if len(sub) else []):
            g = g.assign(x=g["ratio"].map(_num), y=g["value"].map(lambda v: max(abs(_num(v)), 1e-16))).sort_values("x")
            ax.plot(g["x"], g["y"], marker="o", lw=1.2, color=f"C{i}", label=backend, alpha=0.85)
            loud = g[g["outcome"].isin(["warned", "raised"])]
            if len(loud):
                ax.scatter(loud["x"], loud["y"], s=90, facecolors="none", edgecolors=f"C{i}")
        if sub is None or not len(sub):
            _empty(ax, "no rows")
    axes[0][0].set_ylabel("|log density error| (nats)")
    axes[0][0].set_ylim(1e-17, 1e4)
    title = f"{kernel}, {device}" if device else kernel
    fig.suptitle(f"Log density against the 50-digit reference ({title}); hollow: warned or refused", fontsize=10)
    axes[0][-1].legend(fontsize=8, loc="upper right")
    return fig


# ---------------------------------------------------------------------------------------------- nuts_phases
def nuts_phases(df: pd.DataFrame, *, notebook: str = "gradient_nuts",
                experiments: Sequence[str] = _NUTS_EXPERIMENTS) -> Any:
    """The wall of every NUTS phase as one stacked horizontal bar per device, profile, experiment and backend.

    Args:
        df: from :func:`msrm_lab.book.load_results`.
        notebook, experiments: the rows (metric ``phase_seconds``, param ``phase``) of these experiments; the
            phase ``total`` is drawn as a black tick at the end of its bar (it includes time outside the named
            phases). Every profile of every device is drawn (each is its own run).
    Returns:
        the Figure. A bar's label names the device, profile, experiment, backend (``linear_algebra``),
        factorization ``method`` and number of chains; phases a row marks not measured are left out and named
        in the label.
    """
    _check_frame(df)
    sub = df[(df["notebook"] == notebook) & df["experiment"].isin(list(experiments))
             & (df["metric"] == "phase_seconds")]
    if "phase" not in sub:
        sub = sub.iloc[0:0]
    keys = [c for c in ("device", "profile", "experiment", "linear_algebra", "method", "chains") if c in sub]
    groups = list(sub.assign(**{c: sub[c].map(_label) for c in keys}).groupby(keys, sort=True)) if len(sub) else []
    fig, axes = _figure(figsize=(9.0, 1.6 + 0.55 * max(len(groups), 1)))
    ax = axes[0, 0]
    ax.set_xlabel("wall time (s)")
    labels: list[str] = []
    labelled: set[str] = set()
    for i, (key, g) in enumerate(groups):
        meta = dict(zip(keys, key))
        left = 0.0
        missing = []
        for j, phase in enumerate(NUTS_PHASES):
            r = g[g["phase"] == phase]
            if r.empty:
                continue
            if not (r["status"] == "measured").any():
                missing.append(phase)
                continue
            v = _num(r[r["status"] == "measured"]["value"].iloc[-1])
            if not math.isfinite(v):
                continue
            name = phase.replace("_", " ")
            ax.barh(i, v, left=left, color=f"C{j}", edgecolor="white", lw=0.5,
                    label=None if name in labelled else name)
            labelled.add(name)
            left += v
        tot = g[(g["phase"] == "total") & (g["status"] == "measured")]
        if len(tot):
            t = _num(tot["value"].iloc[-1])
            ax.plot([t, t], [i - 0.45, i + 0.45], color="black", lw=2,
                    label=None if "total wall" in labelled else "total wall")
            labelled.add("total wall")
        chains = meta.get("chains", "")
        text = (f"{meta.get('device', '')} ({meta.get('profile', '')})\n{meta.get('experiment', '')}: "
                f"{meta.get('linear_algebra', '')}, {meta.get('method', '')}"
                + (f", chains {int(float(chains))}" if chains not in ("", None) else ""))
        if missing:
            text += f"\nnot measured: {', '.join(missing)}"
        labels.append(text)
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.invert_yaxis()
    if not groups:
        _empty(ax, f"no {notebook} phase rows measured in this build")
    ax.set_title("NUTS: wall time of each phase", fontsize=10)
    _legend(ax, df, loc="upper left", bbox_to_anchor=(1.01, 1.0),
            order=[p.replace("_", " ") for p in NUTS_PHASES] + ["total wall"])
    return fig


# ----------------------------------------------------------------------------------------- recovered_latents
def recovery_fit(design: str = "baseline", seed: int = 0, *, restarts: int = 1, max_iter: int = 100,
                 drop: float = 8.0) -> dict[str, Any]:
    """A small R-MSRM fit on one synthetic design, aligned onto its true latents (cheap enough for a book build).

    Args:
        design: a name of :data:`data_synth.designs.DESIGNS`.
        seed: the design's seed (also the fit's).
        restarts, max_iter: R-MSRM settings (:func:`msrm.fit_rmsrm`, in this process).
        drop: the margin (s) left out at each end of the run when comparing (the recovery benchmark's window).
    Returns:
        dict with ``design, seed, grid`` (first run's grid, s), ``truth``, ``aligned`` ((J, K) of the first run;
        ``aligned`` is the fit's latents after :func:`msrm.align` onto the truth, one transform for all runs),
        ``mask`` (the comparison window), ``correlation`` ((K,) Pearson correlation of aligned and true factors
        inside the window), ``restarts``, ``max_iter``.
    """
    from data_synth.designs import design_names, make_design

    if design not in design_names():
        raise ValueError(f"design must be one of {design_names()}, got {design!r}")
    for name, v in (("restarts", restarts), ("max_iter", max_iter)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if not (isinstance(drop, (int, float)) and math.isfinite(drop) and drop >= 0):
        raise ValueError(f"drop must be a finite number of seconds >= 0, got {drop!r}")
    import msrm
    from msrm.spec import latent_grid

    from .recovery.metrics import edge_mask

    data, spec, truth = make_design(design, int(seed))
    rfit = msrm.fit_rmsrm(data, spec, seed=int(seed), restarts=int(restarts), max_iter=int(max_iter), n_jobs=1,
                          progress=False)
    aligned = msrm.align(list(rfit.latents), list(truth.latents), method="procrustes").latents
    grid = np.asarray(latent_grid(data.runs[0].duration, spec))
    mask = edge_mask(grid, truth.observed_span[0], drop)
    z, t = np.asarray(aligned[0]), np.asarray(truth.latents[0])
    corr = np.array([np.corrcoef(z[mask, k], t[mask, k])[0, 1] for k in range(t.shape[1])])
    return dict(design=design, seed=int(seed), grid=grid, truth=t, aligned=z, mask=mask, correlation=corr,
                restarts=int(restarts), max_iter=int(max_iter))


def recovered_latents(fit: dict[str, Any] | None = None, **fit_options) -> Any:
    """Recovered latents against the truth: one panel per factor, the correlation in the legend.

    Args:
        fit: a :func:`recovery_fit` result (so a chapter can glue its correlations); None fits one now with
            ``fit_options`` (passed to :func:`recovery_fit`).
    Returns:
        the Figure: the true factor (black), the R-MSRM latents after the Procrustes map onto the truth, grey
        outside the compared window.
    """
    if fit is None:
        fit = recovery_fit(**fit_options)
    elif fit_options:
        raise ValueError(f"pass either fit or fit options, not both (got {sorted(fit_options)})")
    for k in ("grid", "truth", "aligned", "mask", "correlation"):
        if k not in fit:
            raise ValueError(f"fit lacks {k!r}: pass the result of msrm_lab.figures.recovery_fit")
    grid, truth, est, mask = fit["grid"], fit["truth"], fit["aligned"], fit["mask"]
    K = truth.shape[1]
    fig, axes = _figure(nrows=K, figsize=(8.0, 1.2 + 1.9 * K), sharex=True)
    for k in range(K):
        ax = axes[k, 0]
        if mask.any():
            ax.axvspan(grid[0], grid[mask][0], color="0.92", lw=0)
            ax.axvspan(grid[mask][-1], grid[-1], color="0.92", lw=0)
        ax.plot(grid, truth[:, k], color="black", lw=1.3, label="truth")
        ax.plot(grid, est[:, k], color="C0", lw=1.0,
                label=f"R-MSRM, aligned (r = {fit['correlation'][k]:.3f})")
        ax.set_ylabel(f"factor {k + 1}")
        ax.legend(fontsize=8, loc="upper right")
    axes[-1, 0].set_xlabel("time (s)")
    fig.suptitle(f"design {fit.get('design', '')}, seed {fit.get('seed', '')}: true and recovered latents "
                 "(grey: outside the compared window)", fontsize=10)
    return fig
