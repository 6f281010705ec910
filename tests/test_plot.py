"""msrm.plot on the Agg backend: each function returns a Figure with the expected axes, lines and collections;
bands are exactly mean +- z sd with z = norm.ppf((1 + band) / 2); the truth is aligned by msrm.align; bad input
is refused naming the argument."""
from __future__ import annotations

import numpy as np
import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import xarray as xr  # noqa: E402
from scipy.stats import norm  # noqa: E402

import data_synth  # noqa: E402
import msrm  # noqa: E402
from msrm import plot  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _renders(fig):
    """The figure draws to PNG without error."""
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    assert buf.getvalue()[:4] == b"\x89PNG"


def _latent(seed=0, J=12, K=3):
    rng = np.random.default_rng(seed)
    grid = -2.0 + 0.5 * np.arange(J)
    return msrm.LatentPosterior(grid, rng.normal(size=(J, K)), 0.1 + rng.random((J, K)))


def _band_of(ax):
    """The (x, y) vertices of the axes' one fill_between polygon."""
    (coll,) = ax.collections
    (path,) = coll.get_paths()
    return path.vertices


def _assert_band(ax, x, lo, hi):
    """The polygon's vertices at each x are exactly the band's two ends (closing vertices repeat them)."""
    verts = _band_of(ax)
    for xi, a, b in zip(x, lo, hi):
        ys = verts[verts[:, 0] == xi, 1]
        np.testing.assert_allclose(np.unique(ys), np.unique([a, b]), rtol=1e-14, atol=1e-14)
    assert set(np.unique(verts[:, 0])) == set(x)


def _posterior_dataset(lp: msrm.LatentPosterior):
    """A Dataset shaped like Posterior.latent_posterior's (two chains, three kept draws)."""
    J, K = lp.mean.shape
    draws = lp.mean + np.zeros((2, 3, J, K))
    dims = ("chain", "draw", "time", "factor")
    return xr.Dataset({"draws": (dims, draws), "draw_sd": (dims, lp.sd + 0 * draws),
                       "mean": (dims[2:], lp.mean), "sd": (dims[2:], lp.sd)},
                      coords={"chain": [0, 1], "draw": [0, 4, 8], "time": lp.grid, "factor": np.arange(K)})


# ------------------------------------------------------------------------------------------ latents


@pytest.mark.parametrize("band", [0.9, 0.5])
def test_latents_panels_lines_and_band_limits(band):
    lp = _latent()
    fig = plot.latents(lp, band=band)
    assert isinstance(fig, matplotlib.figure.Figure)
    assert len(fig.axes) == 3
    _renders(fig)
    z = norm.ppf(0.5 + band / 2)
    for k, ax in enumerate(fig.axes):
        assert len(ax.lines) == 1 and len(ax.collections) == 1
        np.testing.assert_array_equal(ax.lines[0].get_xdata(), lp.grid)
        np.testing.assert_array_equal(ax.lines[0].get_ydata(), lp.mean[:, k])
        _assert_band(ax, lp.grid, lp.mean[:, k] - z * lp.sd[:, k], lp.mean[:, k] + z * lp.sd[:, k])
    assert plot.band_z(0.9) == pytest.approx(1.6448536269514722, rel=1e-15)


def test_latents_from_a_list_a_dataset_and_chosen_factors():
    runs = [_latent(0), _latent(1, J=9)]
    fig = plot.latents(runs, run=1, factors=[2, 0])
    assert len(fig.axes) == 2
    np.testing.assert_array_equal(fig.axes[0].lines[0].get_ydata(), runs[1].mean[:, 2])
    np.testing.assert_array_equal(fig.axes[1].lines[0].get_ydata(), runs[1].mean[:, 0])
    ds = _posterior_dataset(runs[0])
    fig = plot.latents([ds, _posterior_dataset(runs[1])], factors=[1])
    (ax,) = fig.axes
    z = norm.ppf(0.95)
    _assert_band(ax, runs[0].grid, runs[0].mean[:, 1] - z * runs[0].sd[:, 1], runs[0].mean[:, 1] + z * runs[0].sd[:, 1])
    # into given axes
    _, axes = plt.subplots(3, 1)
    assert plot.latents(ds, axes=axes) is axes[0].figure


def test_latents_truth_is_aligned_onto_the_posterior_factors():
    lp = _latent(2, J=30)
    # the truth is the posterior mean with factors reordered and one sign flipped
    truth = np.column_stack([lp.mean[:, 2], -lp.mean[:, 0], lp.mean[:, 1]])
    fig = plot.latents(lp, truth=truth)
    _renders(fig)
    for k, ax in enumerate(fig.axes):
        assert len(ax.lines) == 2
        np.testing.assert_allclose(ax.lines[1].get_ydata(), lp.mean[:, k], rtol=0, atol=1e-12)
    fig = plot.latents(lp, truth=truth, align=False)
    for k, ax in enumerate(fig.axes):
        np.testing.assert_array_equal(ax.lines[1].get_ydata(), truth[:, k])
    # Procrustes also undoes a rotation
    Q, _ = np.linalg.qr(np.random.default_rng(5).normal(size=(3, 3)))
    fig = plot.latents(lp, truth=lp.mean @ Q, align="procrustes")
    for k, ax in enumerate(fig.axes):
        np.testing.assert_allclose(ax.lines[1].get_ydata(), lp.mean[:, k], rtol=0, atol=1e-10)


@pytest.mark.parametrize("kwargs, match", [
    (dict(band=0.0), "band must be a number in \\(0, 1\\)"), (dict(band=1.0), "band"), (dict(band=1.5), "band"),
    (dict(band="0.9"), "band"), (dict(run=1), "run=1 is out of range"), (dict(factors=[3]), "factors=3"),
    (dict(factors=[-1]), "factors=-1"), (dict(truth=np.zeros((11, 3))), "truth: shape \\(11, 3\\)"),
    (dict(axes=[None]), "axes: 1 axes given for 3 panels"),
])
def test_latents_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plot.latents(_latent(), **kwargs)


def test_latents_bad_run_of_a_list_and_bad_object():
    with pytest.raises(ValueError, match="run=2 is out of range: there are 2 runs"):
        plot.latents([_latent(0), _latent(1)], run=2)
    with pytest.raises(ValueError, match="posterior must be an msrm.LatentPosterior"):
        plot.latents(np.zeros((4, 2)))


# ------------------------------------------------------------------------------------------ prediction


def _stream_data():
    rng = np.random.default_rng(1)
    Y = rng.normal(size=(10, 2))
    Y[3:5, 0] = np.nan  # a gap
    runs = [msrm.Run(20.0, [msrm.Stream("p0", "brain", 2.0, Y), msrm.Stream("p0", "rating", 4.0,
                                                                          rng.normal(size=(5, 1)))])]
    data = msrm.Dataset(runs)
    mean = rng.normal(size=(10, 2))
    pred = {"p0/brain": msrm.Prediction(mean, 0.5 + rng.random((10, 2)), 0.2 + 0.1 * rng.random((10, 2))),
            "p0/rating": msrm.Prediction(rng.normal(size=(5, 1)), np.ones((5, 1)))}
    return data, [pred]


def test_prediction_points_gaps_mean_and_band():
    data, pred = _stream_data()
    stream = data.runs[0].stream("p0/brain")
    p = pred[0]["p0/brain"]
    fig = plot.prediction(data, pred, "p0/brain", band=0.8)
    (ax,) = fig.axes
    assert len(ax.lines) == 2 and len(ax.collections) == 1
    observed, mean = ax.lines
    np.testing.assert_array_equal(observed.get_xdata(), stream.times)
    np.testing.assert_array_equal(np.isnan(observed.get_ydata()), np.isnan(stream.values[:, 0]))  # the gap shows
    np.testing.assert_array_equal(mean.get_ydata(), p.mean[:, 0])
    z = norm.ppf(0.9)
    _assert_band(ax, stream.times, p.mean[:, 0] - z * p.sd[:, 0], p.mean[:, 0] + z * p.sd[:, 0])
    # the signal band, feature 1
    ax = plot.prediction(data, pred[0], "p0/brain", feature=1, signal=True).axes[0]
    _assert_band(ax, stream.times, p.mean[:, 1] - 1.6448536269514722 * p.signal_sd[:, 1],
                 p.mean[:, 1] + 1.6448536269514722 * p.signal_sd[:, 1])


def test_prediction_marks_held_out_values_and_reads_a_dataset():
    data, pred = _stream_data()
    stream = data.runs[0].stream("p0/brain")
    held = np.zeros((10, 2), dtype=bool)
    held[[1, 7], 1] = True
    p = pred[0]["p0/brain"]
    ds = xr.Dataset({"mean": (("sample", "feature"), p.mean), "sd": (("sample", "feature"), p.sd)},
                    coords={"sample": np.arange(10), "time": ("sample", stream.times), "feature": [0, 1]})
    fig = plot.prediction(data, [{"p0/brain": ds}], "p0/brain", feature=1, held_out=held)
    _renders(fig)
    (ax,) = fig.axes
    assert len(ax.lines) == 3 and len(ax.collections) == 1
    observed, held_line, mean = ax.lines
    y = stream.values[:, 1]
    np.testing.assert_array_equal(np.flatnonzero(np.isfinite(held_line.get_ydata())), [1, 7])
    np.testing.assert_array_equal(held_line.get_ydata()[[1, 7]], y[[1, 7]])
    assert np.isnan(observed.get_ydata()[[1, 7]]).all()
    np.testing.assert_array_equal(np.delete(observed.get_ydata(), [1, 7]), np.delete(y, [1, 7]))
    np.testing.assert_array_equal(mean.get_ydata(), p.mean[:, 1])
    assert held_line.get_marker() != observed.get_marker()


@pytest.mark.parametrize("key, kwargs, match", [
    ("p9/brain", {}, "key 'p9/brain' is not a stream of run 0"),
    ("p0/brain", dict(feature=2), "feature=2 is out of range"),
    ("p0/rating", dict(feature=1), "feature=1 is out of range: there is 1 features in stream 'p0/rating'"),
    ("p0/brain", dict(run=1), "run=1 is out of range"),
    ("p0/brain", dict(band=1.0), "band must be a number in \\(0, 1\\)"),
    ("p0/brain", dict(held_out=np.zeros((9, 2), bool)), "held_out: shape \\(9, 2\\)"),
    ("p0/rating", dict(signal=True), "signal=True: pred\\['p0/rating'\\] has no signal sd"),
])
def test_prediction_bad_input(key, kwargs, match):
    data, pred = _stream_data()
    with pytest.raises(ValueError, match=match):
        plot.prediction(data, pred, key, **kwargs)


def test_prediction_mismatched_pred():
    data, pred = _stream_data()
    with pytest.raises(ValueError, match="key 'p0/brain' is not in pred"):
        plot.prediction(data, {"p0/rating": pred[0]["p0/rating"]}, "p0/brain")
    with pytest.raises(ValueError, match="pred\\['p0/brain'\\]: shape \\(5, 1\\)"):
        plot.prediction(data, {"p0/brain": pred[0]["p0/rating"]}, "p0/brain")
    with pytest.raises(ValueError, match="pred has 2 runs, data has 1"):
        plot.prediction(data, pred * 2, "p0/brain")


# ------------------------------------------------------------------------------------------ loadings


def test_loadings_heatmaps_share_a_scale_centred_on_zero():
    _, truth = data_synth.synthetic_dataset("tiny", n_features=4, seed=1)
    params = truth.params
    fig = plot.loadings(params)
    _renders(fig)
    keys = list(params.loadings)
    assert len(fig.axes) == len(keys) + 1  # one colorbar
    m = max(np.abs(w).max() for w in params.loadings.values())
    images = [ax.images[0] for ax in fig.axes[:-1]]
    for ax, im, key in zip(fig.axes, images, keys):
        assert len(ax.images) == 1 and ax.get_title() == key
        np.testing.assert_array_equal(im.get_array(), params.loadings[key])
        assert im.get_clim() == (-m, m)
        assert im.get_cmap().name == "RdBu_r"
    fig = plot.loadings(params.loadings, keys=keys[:2])
    assert len(fig.axes) == 3
    m2 = max(np.abs(params.loadings[k]).max() for k in keys[:2])
    assert fig.axes[0].images[0].get_clim() == (-m2, m2)


def test_loadings_bad_input():
    _, truth = data_synth.synthetic_dataset("tiny", n_features=4, seed=1)
    with pytest.raises(ValueError, match="key 'p9/brain' has no loadings"):
        plot.loadings(truth.params, keys=["p9/brain"])
    with pytest.raises(ValueError, match="loadings\\['a/b'\\]: expected an \\(n_features, K\\) array"):
        plot.loadings({"a/b": np.zeros(3)})
    with pytest.raises(ValueError, match="params must be an msrm.Params"):
        plot.loadings(np.zeros((3, 2)))


# ------------------------------------------------------------------------------------------ response posterior


@pytest.fixture(scope="module")
def response_idata():
    """InferenceData of a tiny model (one lag, one lag + width) from draws near the true parameters."""
    import msrm.runtime
    from msrm.gp.idata import build_inference_data

    msrm.runtime.enable_x64()
    data, truth = data_synth.synthetic_dataset("tiny", n_features=2, seed=3)
    model = msrm.GPMSRM(data, truth.spec, linear_algebra="dense")
    u0 = model.unconstrain(truth.params)
    draws = u0 + 0.1 * np.random.default_rng(0).normal(size=(2, 40, u0.size))
    return build_inference_data(model, draws), truth.params


def test_response_posterior_histograms_kde_and_truth(response_idata):
    idata, params = response_idata
    fig = plot.response_posterior(idata, truth=params)
    _renders(fig)
    names = ["rating/lag", "physio/lag", "physio/width"]
    assert sorted(ax.get_title() for ax in fig.axes) == sorted(names)
    for ax in fig.axes:
        key, pname = ax.get_title().split("/")
        draws = idata.posterior[f"response|{key}|{pname}"].values.ravel()
        assert len(ax.patches) == 30  # histogram bars
        heights = np.array([p.get_height() for p in ax.patches])
        widths = np.array([p.get_width() for p in ax.patches])
        assert np.sum(heights * widths) == pytest.approx(1.0)  # a density
        assert min(p.get_x() for p in ax.patches) == pytest.approx(draws.min())
        kde, true_line = ax.lines
        assert kde.get_xdata()[0] == draws.min() and kde.get_xdata()[-1] == draws.max()
        np.testing.assert_array_equal(true_line.get_xdata(), [params.response[key][pname]] * 2)
    fig = plot.response_posterior(idata, names=["response/physio/width"], truth={"physio/width": 1.0}, bins=10)
    (ax,) = fig.axes
    assert len(ax.patches) == 10 and len(ax.lines) == 2
    assert ax.lines[1].get_xdata()[0] == 1.0
    # the posterior group alone, no truth
    fig = plot.response_posterior(idata.posterior, names=["rating/lag"])
    assert len(fig.axes) == 1 and len(fig.axes[0].lines) == 1


def test_response_posterior_bad_input(response_idata):
    idata, _ = response_idata
    with pytest.raises(ValueError, match="names: 'rating/width' is not a response parameter"):
        plot.response_posterior(idata, names=["rating/width"])
    with pytest.raises(ValueError, match="axes: 1 axes given for 3 parameters"):
        plot.response_posterior(idata, axes=[plt.subplots()[1]])
    from msrm.gp.idata import group_dataset

    posterior = group_dataset(idata, "posterior")  # an xarray.Dataset under ArviZ 0.23 and 1.x
    no_response = posterior[[v for v in posterior.data_vars if not str(v).startswith("response")]]
    with pytest.raises(ValueError, match="no response parameters"):
        plot.response_posterior(no_response)
    with pytest.raises(ValueError, match="post_or_idata must be"):
        plot.response_posterior(np.zeros(3))


def test_import_msrm_does_not_import_matplotlib():
    import subprocess
    import sys

    code = "import sys, msrm, msrm.plot; assert 'matplotlib' not in sys.modules, 'matplotlib imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
