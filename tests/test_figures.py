"""msrm_lab.figures: each figure builds from the committed rows, from an empty frame and from one device, with the
expected axes scales, labels and number of series; error bars follow a row's min/max; refused points are drawn."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

matplotlib = pytest.importorskip("matplotlib")
from matplotlib.figure import Figure  # noqa: E402

import msrm_lab.book as mb  # noqa: E402
from msrm_lab import figures as F  # noqa: E402


@pytest.fixture(scope="module")
def rows() -> pd.DataFrame:
    return mb.load_results()


def _legend_texts(ax) -> list[str]:
    leg = ax.get_legend()
    return [t.get_text() for t in leg.get_texts()] if leg is not None else []


def _n_groups(sub: pd.DataFrame, keys) -> int:
    if sub.empty:
        return 0
    sub = sub.assign(**{k: sub[k].map(lambda v: "" if pd.isna(v) else str(v)) for k in keys if k in sub})
    return sub.groupby([k for k in keys if k in sub]).ngroups


def _preferred(df: pd.DataFrame, notebook: str) -> pd.DataFrame:
    sub = df[df["notebook"] == notebook]
    keep = []
    for device, g in sub.groupby("device"):
        for p in mb.PROFILE_ORDER:
            if (g["profile"] == p).any():
                keep.append(g[g["profile"] == p])
                break
    return pd.concat(keep) if keep else sub


def _frames(rows):
    one = mb.devices_in(rows)[:1]
    last = mb.devices_in(rows)[-1:]
    return {"real": rows, "empty": mb.load_results(root=[]), "one_device": rows[rows["device"].isin(one)],
            "other_device": rows[rows["device"].isin(last)]}


@pytest.mark.parametrize("which", ["real", "empty", "one_device", "other_device"])
def test_cost_curves(rows, which):
    df = _frames(rows)[which]
    fig = F.cost_curves(df)
    assert isinstance(fig, Figure)
    (ax,) = fig.axes
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    assert "per call (s)" in ax.get_ylabel() and "scale" in ax.get_xlabel()
    pref = _preferred(df, "state_space") if len(df) else df
    ladder = pref[(pref["experiment"] == "ladder") & (pref["metric"] == "median_s")
                  & (pref["status"] == "measured")] if len(pref) else pref
    targets = pref[(pref["experiment"] == "targets") & pref.get("target", pd.Series(dtype=float)).notna()
                   & (pref["unit"] == "s") & pref.get("scale", pd.Series(dtype=float)).notna()
                   & (pref["status"] == "measured")] if len(pref) and "target" in pref else pref.iloc[0:0]
    expected = _n_groups(ladder, ["device", "backend", "layout"]) + _n_groups(targets, ["device", "metric"])
    assert len(ax.containers) == expected
    texts = _legend_texts(ax)
    assert (F.GPU_NOT_MEASURED in texts) == (not any(d.startswith("cuda-") for d in mb.devices_in(df)))
    for d in set(mb.devices_in(ladder)) | set(mb.devices_in(targets)):
        assert any(d in t for t in texts), (d, texts)
    fig.savefig(__import__("io").BytesIO(), format="png")  # renders on Agg


@pytest.mark.parametrize("which", ["real", "empty", "one_device", "other_device"])
def test_feature_sweep(rows, which):
    df = _frames(rows)[which]
    fig = F.feature_sweep(df)
    ax, ax2 = fig.axes
    assert ax.get_xscale() == ax2.get_xscale() == "log"
    assert "features" in ax.get_xlabel() and "(s)" in ax.get_ylabel() and "fraction" in ax2.get_ylabel()
    pref = _preferred(df, "gp_grouped") if len(df) else df
    sweep = pref[(pref["experiment"] == "feature_sweep") & (pref["status"] == "measured")] if len(pref) else pref
    assert len(ax.containers) == _n_groups(sweep[sweep["metric"] == "median_s"], ["device", "K"])
    assert len(ax2.containers) == _n_groups(sweep[sweep["metric"] == "added_fraction"], ["device", "K"])
    assert F.GPU_NOT_MEASURED in _legend_texts(ax)


@pytest.mark.parametrize("which", ["real", "empty", "one_device", "other_device"])
def test_nuts_phases(rows, which):
    df = _frames(rows)[which]
    fig = F.nuts_phases(df)
    (ax,) = fig.axes
    assert ax.get_xlabel() == "wall time (s)" and ax.get_xscale() == "linear"
    sub = df[(df["notebook"] == "gradient_nuts") & (df["metric"] == "phase_seconds")] if len(df) else df
    n_bars = _n_groups(sub, ["device", "profile", "experiment", "linear_algebra", "method", "chains"])
    assert len(ax.get_yticklabels()) == n_bars
    measured = sub[(sub["status"] == "measured") & sub["phase"].isin(F.NUTS_PHASES)] if len(sub) else sub
    assert len(ax.patches) == len(measured)
    for d in mb.devices_in(sub):
        assert any(d in t.get_text() for t in ax.get_yticklabels())
    assert F.GPU_NOT_MEASURED in _legend_texts(ax)


def _synthetic(device: str) -> pd.DataFrame:
    base = dict(device=device, profile="note", notebook="state_space", unit="s", status="measured")
    recs = [
        dict(base, experiment="ladder", metric="median_s", value=1.0, backend="state_space", scale=1,
             samples=[0.9, 1.0, 1.2]),
        dict(base, experiment="ladder", metric="median_s", value=2.0, backend="state_space", scale=2,
             min_s=1.5, max_s=3.0, samples=[1.9, 2.0, 2.1]),
        dict(base, experiment="ladder", metric="median_s", value=None, backend="grouped", scale=4,
             status="not_yet_measured", reason="predicted 96 s per call exceeds the profile's budget"),
        dict(base, experiment="ladder", metric="median_s", value=None, backend="grouped", scale=8,
             status="not_yet_measured", reason="no prediction"),
        dict(base, experiment="targets", metric="long_value_and_grad_s", value=3.0, target=1.0, scale=8,
             target_kind="at most", min_s=2.5, max_s=3.5),
    ]
    return pd.DataFrame.from_records(recs)


def test_cost_curves_error_bars_refusals_and_gpu_entry():
    fig = F.cost_curves(_synthetic("cuda-h200"))
    (ax,) = fig.axes
    assert F.GPU_NOT_MEASURED not in _legend_texts(ax)
    series, target = ax.containers
    (bars,) = series.lines[2]  # the y error segments, one per point
    segs = [np.asarray(s)[:, 1] for s in bars.get_segments()]
    assert np.allclose(sorted(segs[0]), [0.9, 1.2]) and np.allclose(sorted(segs[1]), [1.5, 3.0])  # min_s/max_s win
    refused = [ln for ln in ax.lines if "refused" in (ln.get_label() or "")]
    predicted = [ln for ln in refused if "predicted" in ln.get_label()]
    assert len(refused) == 2 and np.allclose(predicted[0].get_ydata(), [96.0])
    assert any(np.allclose(c.get_segments()[0][:, 1], 1.0) for c in ax.collections if hasattr(c, "get_segments")
               and len(c.get_segments()) and np.asarray(c.get_segments()[0]).shape == (2, 2))


def test_bad_input_is_named():
    with pytest.raises(TypeError, match="DataFrame"):
        F.cost_curves([1, 2])
    with pytest.raises(ValueError, match="columns"):
        F.nuts_phases(pd.DataFrame({"x": [1]}))
    with pytest.raises(ValueError, match="design"):
        F.recovery_fit("no-such-design")
    with pytest.raises(ValueError, match="restarts"):
        F.recovery_fit("small", restarts=0)


def test_recovered_latents_small_fit():
    fit = F.recovery_fit("small", 0, max_iter=40, drop=4.0)
    K = fit["truth"].shape[1]
    assert fit["aligned"].shape == fit["truth"].shape and fit["correlation"].shape == (K,)
    assert np.all(fit["correlation"] > 0.5)  # a recovery worth drawing: the aligned factors follow the truth
    fig = F.recovered_latents(fit)
    assert len(fig.axes) == K
    for k, ax in enumerate(fig.axes):
        texts = _legend_texts(ax)
        assert texts[0] == "truth" and f"r = {fit['correlation'][k]:.3f}" in texts[1]
    assert fig.axes[-1].get_xlabel() == "time (s)"
    with pytest.raises(ValueError, match="either"):
        F.recovered_latents(fit, design="small")
    assert not math.isnan(float(fit["correlation"].mean()))


def test_figures_render_as_png_in_an_ipython_kernel(rows):
    pytest.importorskip("IPython")
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    try:
        fig = F.feature_sweep(rows)
        data, _ = shell.display_formatter.format(fig)
        assert data["image/png"][:4] in (b"\x89PNG", "iVBO")  # raw bytes or base64 of the PNG signature
    finally:
        InteractiveShell.clear_instance()


def test_nuts_legend_lists_phases_in_order(rows):
    texts = _legend_texts(F.nuts_phases(rows).axes[0])
    phases = [t for t in texts if t.replace(" ", "_") in F.NUTS_PHASES]
    assert phases == sorted(phases, key=lambda t: F.NUTS_PHASES.index(t.replace(" ", "_")))
