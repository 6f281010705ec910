r"""Figures of fitted MSRM models: latent factors with their bands, stream predictions, loadings, and the posterior
of the response parameters (lags, widths, delays).

matplotlib is imported inside each function (the ``plot`` extra), never by ``import msrm``. Every function returns
the matplotlib Figure it drew on and takes optional axes to draw into (``ax`` for one panel, ``axes`` for several).

Bands are central normal intervals: ``mean +- z sd`` with ``z = scipy.stats.norm.ppf((1 + band) / 2)``
(z = 1.645 for the default 90% band). For a single conditional posterior (``model.latent_posterior(params)``)
that interval is exact; for the pooled posterior over draws (``post.latent_posterior(thin)``) it is the normal
interval with the mixture's mean and sd.
"""
from __future__ import annotations

from numbers import Integral, Real
from typing import Sequence

import numpy as np

from .latent import LatentPosterior, Prediction

__all__ = ["latents", "prediction", "loadings", "response_posterior", "band_z", "variance_explained"]


# ------------------------------------------------------------------------------------------ checks


def band_z(band) -> float:
    """``z`` of the central normal interval holding ``band`` of the mass, ``norm.ppf((1 + band) / 2)``.

    Raises:
        ValueError: ``band`` not a number in (0, 1).
    """
    from scipy.stats import norm

    if isinstance(band, bool) or not isinstance(band, Real) or not 0.0 < float(band) < 1.0:
        raise ValueError(f"band must be a number in (0, 1), got {band!r}")
    return float(norm.ppf(0.5 + 0.5 * float(band)))


def _index(value, size: int, name: str, what: str) -> int:
    """``value`` as an index into ``size`` items, or ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, Integral) or not 0 <= int(value) < size:
        raise ValueError(f"{name}={value!r} is out of range: there {'is' if size == 1 else 'are'} {size} {what}")
    return int(value)


def _pick_run(obj, run, what: str):
    """``obj[run]`` when ``obj`` is a list or tuple over runs (``run`` checked), else ``obj`` itself (then ``run``
    must be 0)."""
    if isinstance(obj, (list, tuple)):
        if not obj:
            raise ValueError(f"{what}: an empty list of runs")
        return obj[_index(run, len(obj), "run", "runs")]
    _index(run, 1, "run", f"runs in this {what} (pass the list over runs to choose one)")
    return obj


def _axes_list(axes, n: int, name: str):
    """(figure, list of n axes): the given ones (checked) or a new figure with n panels stacked vertically."""
    import matplotlib.pyplot as plt

    if axes is None:
        fig, made = plt.subplots(n, 1, sharex=True, squeeze=False, figsize=(8, 1.0 + 2.0 * n))
        return fig, list(made[:, 0])
    given = list(np.ravel(np.asarray(axes, dtype=object)))
    if len(given) != n:
        raise ValueError(f"{name}: {len(given)} axes given for {n} panels")
    return given[0].figure, given


# ------------------------------------------------------------------------------------------ latents


def _latent_arrays(obj) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(grid (J,), mean (J, K), sd (J, K)) of a LatentPosterior or a Dataset of ``Posterior.latent_posterior``."""
    if isinstance(obj, LatentPosterior):
        return obj.grid, obj.mean, obj.sd
    if all(hasattr(obj, a) for a in ("data_vars", "coords")) and {"mean", "sd"} <= set(obj.data_vars):
        mean = obj["mean"].transpose("time", "factor")
        sd = obj["sd"].transpose("time", "factor")
        return np.asarray(obj["time"].values, dtype=np.float64), np.asarray(mean.values), np.asarray(sd.values)
    raise ValueError(f"posterior must be an msrm.LatentPosterior, an xarray.Dataset of Posterior.latent_posterior "
                     f"(variables mean, sd) or a list of them over runs; got {type(obj).__name__}")


def _aligned_truth(truth: np.ndarray, mean: np.ndarray, align) -> np.ndarray:
    """The truth mapped onto the posterior's factors by :func:`msrm.align.align` (truth as the latents, the
    posterior mean as the reference), so the posterior's own mean and band are drawn untransformed."""
    from .align import align as align_latents

    method = "signed_permutation" if align is True else align
    return np.asarray(align_latents(truth, mean, method=method).latents)


def latents(posterior, truth=None, *, band: float = 0.9, run: int = 0, factors: Sequence[int] | None = None,
            align: bool | str = True, axes=None):
    """The latent factors' posterior mean and band over the grid time, one panel per factor.

    Args:
        posterior: an :class:`msrm.LatentPosterior`, an ``xarray.Dataset`` from ``Posterior.latent_posterior``
            (its pooled ``mean`` and ``sd``), or a list of either over runs (``run`` picks one).
        truth: optional (J, K) true latents of that run (or a list over runs), drawn dashed.
        band: the central probability of the band, in (0, 1).
        run: which run of a list.
        factors: the factor indices to draw (default all).
        align: map the truth onto the posterior's factors first with :func:`msrm.align`: True uses a signed
            permutation (GP-MSRM identifies a factor's sign and order only); a method name
            (``"procrustes"``, ``"signed_permutation"``, ``"auto"``) uses that one; False draws the truth as given.
        axes: as many axes as factors drawn (default: a new figure).
    Returns:
        the Figure; each panel has the mean line, the band (one ``fill_between`` collection) and the truth line.
    Raises:
        ValueError: a bad ``band``, ``run``, factor index, truth shape or number of axes.
    """
    z = band_z(band)
    grid, mean, sd = _latent_arrays(_pick_run(posterior, run, "posterior"))
    K = mean.shape[1]
    chosen = list(range(K)) if factors is None else [_index(k, K, "factors", "factors") for k in factors]
    if not chosen:
        raise ValueError("factors: no factor to draw")
    if truth is not None:
        truth = np.asarray(truth[run] if isinstance(truth, (list, tuple)) else truth, dtype=np.float64)
        if truth.shape != mean.shape:
            raise ValueError(f"truth: shape {truth.shape}, expected the posterior's (J, K) = {mean.shape}")
        if align is not False:
            truth = _aligned_truth(truth, mean, align)
    fig, panels = _axes_list(axes, len(chosen), "axes")
    for ax, k in zip(panels, chosen):
        lo, hi = mean[:, k] - z * sd[:, k], mean[:, k] + z * sd[:, k]
        (line,) = ax.plot(grid, mean[:, k], lw=1.5, label="posterior mean")
        ax.fill_between(grid, lo, hi, color=line.get_color(), alpha=0.25, lw=0, label=f"{100 * band:g}% band")
        if truth is not None:
            ax.plot(grid, truth[:, k], "k--", lw=1.0, label="truth (aligned)" if align is not False else "truth")
        ax.set_ylabel(f"factor {k}")
    panels[0].legend(loc="upper right", fontsize="small")
    panels[-1].set_xlabel("time (s)")
    return fig


# ------------------------------------------------------------------------------------------ predictions


def _prediction_arrays(obj, key: str):
    """(mean, sd, signal_sd or None) of a stream, each (n_samples, n_features), from a Prediction or a Dataset of
    ``Posterior.predict``."""
    if isinstance(obj, Prediction):
        return obj.mean, obj.sd, obj.signal_sd
    if all(hasattr(obj, a) for a in ("data_vars", "coords")) and {"mean", "sd"} <= set(obj.data_vars):
        def values(name):
            return np.asarray(obj[name].transpose("sample", "feature").values)
        return values("mean"), values("sd"), values("signal_sd") if "signal_sd" in obj.data_vars else None
    raise ValueError(f"pred[{key!r}] must be an msrm.Prediction or an xarray.Dataset of Posterior.predict; "
                     f"got {type(obj).__name__}")


def prediction(data, pred, key: str, *, run: int = 0, feature: int = 0, band: float = 0.9, held_out=None,
               signal: bool = False, ax=None):
    """One feature of one stream: the observed values, the predictive mean and its band, over time.

    Observed values are points joined by a thin line, so a run of missing (NaN) samples shows as a gap; values
    marked in ``held_out`` are drawn as crosses instead (they are the values a model built on the data with those
    entries set to NaN predicts without seeing).

    Args:
        data: the :class:`msrm.Dataset` holding the observed values (held-out values included).
        pred: ``model.predict(params)`` or ``post.predict(thin)`` (a list over runs of ``{key: Prediction or
            Dataset}``), one run's dict, or one Prediction / Dataset.
        key: the stream, ``"participant/modality"``.
        run, feature: which run and which feature of the stream.
        band: the central probability of the band, in (0, 1).
        held_out: optional bool mask (n_samples, n_features) or (n_samples,) of the held-out values.
        signal: band from the signal sd (the model's mean response) instead of the predictive sd of a new
            observation.
        ax: the axes to draw on (default: a new figure).
    Returns:
        the Figure; lines: observed, held-out (when given), predictive mean; one band collection.
    Raises:
        ValueError: an unknown key, ``run`` or ``feature`` out of range, a bad ``band``, a prediction or mask
            whose shape does not match the stream, ``signal=True`` without a signal sd.
    """
    import matplotlib.pyplot as plt

    z = band_z(band)
    runs = getattr(data, "runs", None)
    if runs is None:
        raise ValueError(f"data must be an msrm.Dataset, got {type(data).__name__}")
    r = _index(run, len(runs), "run", "runs")
    if key not in runs[r].keys:
        raise ValueError(f"key {key!r} is not a stream of run {r}; its streams are {list(runs[r].keys)}")
    stream = runs[r].stream(key)
    f = _index(feature, stream.n_features, "feature", f"features in stream {key!r}")
    if isinstance(pred, (list, tuple)) and len(pred) != len(runs):
        raise ValueError(f"pred has {len(pred)} runs, data has {len(runs)}")
    one = pred[r] if isinstance(pred, (list, tuple)) else pred
    if isinstance(one, dict):
        if key not in one:
            raise ValueError(f"key {key!r} is not in pred; it has {list(one)}")
        one = one[key]
    mean, sd, signal_sd = _prediction_arrays(one, key)
    if mean.shape != stream.values.shape:
        raise ValueError(f"pred[{key!r}]: shape {mean.shape}, stream {key!r} of run {r} has {stream.values.shape}")
    if signal:
        if signal_sd is None:
            raise ValueError(f"signal=True: pred[{key!r}] has no signal sd")
        sd = signal_sd
    t, y = stream.times, stream.values[:, f]
    out = np.zeros(y.shape, dtype=bool)
    if held_out is not None:
        mask = np.asarray(held_out, dtype=bool)
        if mask.shape not in (stream.values.shape, y.shape):
            raise ValueError(f"held_out: shape {mask.shape}, expected {stream.values.shape} or {y.shape}")
        out = mask[:, f] if mask.ndim == 2 else mask
    if ax is None:
        fig, ax = plt.subplots(figsize=(8, 3))
    else:
        fig = ax.figure
    ax.plot(t, np.where(out, np.nan, y), marker="o", ms=3, lw=0.5, color="0.3", label="observed")
    if held_out is not None:
        ax.plot(t, np.where(out, y, np.nan), marker="x", ms=6, ls="none", color="C3", label="held out")
    (line,) = ax.plot(t, mean[:, f], color="C0", lw=1.5, label="predictive mean")
    ax.fill_between(t, mean[:, f] - z * sd[:, f], mean[:, f] + z * sd[:, f], color=line.get_color(), alpha=0.25,
                    lw=0, label=f"{100 * band:g}% band")
    ax.set_xlabel("time (s)")
    ax.set_ylabel(f"{key} [{f}]")
    ax.legend(loc="upper right", fontsize="small")
    return fig


# ------------------------------------------------------------------------------------------ loadings


def loadings(params, keys: Sequence[str] | None = None, *, axes=None, cmap: str = "RdBu_r"):
    """Heatmaps of the loadings (features x factors), one panel per stream key.

    The colour scale is shared by the panels and symmetric about 0 (``[-m, m]``, ``m`` the largest |loading|
    shown), with a diverging colormap, so white is 0 and a colour means the same value in every panel; one
    colorbar serves them all.

    Args:
        params: an :class:`msrm.Params` (its ``loadings``) or a dict ``{key: (n_features, K) array}``.
        keys: the stream keys to draw (default all, in the params' order).
        axes: as many axes as keys (default: a new figure with the panels side by side).
        cmap: a diverging matplotlib colormap.
    Returns:
        the Figure (one image per key plus the colorbar's axes).
    Raises:
        ValueError: an unknown key, no keys, a loading matrix that is not 2-D, a wrong number of axes.
    """
    import matplotlib.pyplot as plt

    table = getattr(params, "loadings", params)
    if not isinstance(table, dict):
        raise ValueError(f"params must be an msrm.Params or a dict of loadings, got {type(params).__name__}")
    chosen = list(table) if keys is None else list(keys)
    if not chosen:
        raise ValueError("keys: no stream to draw")
    for key in chosen:
        if key not in table:
            raise ValueError(f"key {key!r} has no loadings; the keys are {list(table)}")
    W = {key: np.asarray(table[key], dtype=np.float64) for key in chosen}
    for key, w in W.items():
        if w.ndim != 2:
            raise ValueError(f"loadings[{key!r}]: expected an (n_features, K) array, got shape {w.shape}")
    m = max(float(np.max(np.abs(w))) if w.size else 0.0 for w in W.values()) or 1.0
    if axes is None:
        fig, made = plt.subplots(1, len(chosen), squeeze=False, figsize=(1.5 + 2.0 * len(chosen), 4))
        panels = list(made[0])
    else:
        panels = list(np.ravel(np.asarray(axes, dtype=object)))
        if len(panels) != len(chosen):
            raise ValueError(f"axes: {len(panels)} axes given for {len(chosen)} keys")
        fig = panels[0].figure
    image = None
    for ax, key in zip(panels, chosen):
        w = W[key]
        image = ax.imshow(w, aspect="auto", interpolation="nearest", cmap=cmap, vmin=-m, vmax=m)
        ax.set_title(key, fontsize="small")
        ax.set_xticks(range(w.shape[1]))
        ax.set_xlabel("factor")
    panels[0].set_ylabel("feature")
    fig.colorbar(image, ax=panels, label="loading")
    return fig


# ------------------------------------------------------------------------------------------ response posterior


def _posterior_group(obj):
    """The posterior group (an xarray.Dataset) of a Posterior, an InferenceData or the group itself."""
    obj = getattr(obj, "inference_data", obj)
    group = getattr(obj, "posterior", obj)
    if hasattr(group, "to_dataset") and not hasattr(group, "data_vars"):  # a DataTree node
        group = group.to_dataset()
    if not hasattr(group, "data_vars"):
        raise ValueError(f"post_or_idata must be a Posterior, an InferenceData or its posterior Dataset; got "
                         f"{type(obj).__name__}")
    return group


def _response_variables(group) -> dict[str, str]:
    """``{"response/<param_key>/<name>": variable name}`` of the response parameters of a posterior group
    (variables are stored NetCDF-safe, ``/`` as ``|``, with the original name in ``msrm_name``)."""
    found = {}
    for var in group.data_vars:
        name = str(group[var].attrs.get("msrm_name", str(var).replace("|", "/")))
        if name.startswith("response/"):
            found[name] = str(var)
    return found


def _full_name(name: str, known: dict) -> str:
    """``"response/<param_key>/<pname>"`` of a name given in full, without the ``response/`` prefix, or NetCDF-safe;
    ValueError when it is none of the known ones."""
    plain = str(name).replace("|", "/")
    for cand in (plain, f"response/{plain}"):
        if cand in known:
            return cand
    raise ValueError(f"names: {name!r} is not a response parameter of this posterior; they are {list(known)}")


def _truth_values(truth, known: dict) -> dict[str, float]:
    """``{full name: value}`` from a dict of names or from Params (``truth.response[param_key][pname]``)."""
    if truth is None:
        return {}
    response = getattr(truth, "response", None)
    if response is not None:
        return {f"response/{k}/{p}": float(v) for k, d in response.items() for p, v in d.items()
                if f"response/{k}/{p}" in known}
    if not isinstance(truth, dict):
        raise ValueError(f"truth must be an msrm.Params or a dict name -> value, got {type(truth).__name__}")
    return {_full_name(k, known): float(v) for k, v in truth.items()}


def response_posterior(post_or_idata, names: Sequence[str] | None = None, *, truth=None, bins: int = 30,
                       axes=None):
    """Posterior draws of the response parameters (lags, widths, delays): a histogram (density) and a Gaussian
    KDE (``scipy.stats.gaussian_kde``) per parameter, all chains pooled, and a vertical line at the truth.

    Args:
        post_or_idata: a :class:`~msrm.gp.posterior.Posterior`, its InferenceData or the posterior group.
        names: which parameters, as ``"response/<param_key>/<name>"`` or ``"<param_key>/<name>"`` (e.g.
            ``"rating/lag"``); default every response parameter of the posterior.
        truth: optional true values, an :class:`msrm.Params` or a dict name -> value.
        bins: histogram bins.
        axes: as many axes as parameters (default: a new figure, panels side by side).
    Returns:
        the Figure; each panel has the histogram, the KDE line (when the draws are not all equal) and the truth
        line (when given).
    Raises:
        ValueError: not a posterior; a posterior without response parameters; an unknown name; a wrong number of
            axes.
    """
    import matplotlib.pyplot as plt
    from scipy.stats import gaussian_kde

    group = _posterior_group(post_or_idata)
    known = _response_variables(group)
    if not known:
        raise ValueError("this posterior has no response parameters (every response is fixed, e.g. Identity)")
    chosen = list(known) if names is None else [_full_name(n, known) for n in names]
    if not chosen:
        raise ValueError("names: no parameter to draw")
    true = _truth_values(truth, known)
    if axes is None:
        fig, made = plt.subplots(1, len(chosen), squeeze=False, figsize=(1.0 + 3.0 * len(chosen), 3))
        panels = list(made[0])
    else:
        panels = list(np.ravel(np.asarray(axes, dtype=object)))
        if len(panels) != len(chosen):
            raise ValueError(f"axes: {len(panels)} axes given for {len(chosen)} parameters")
        fig = panels[0].figure
    for ax, name in zip(panels, chosen):
        x = np.asarray(group[known[name]].values, dtype=np.float64).ravel()
        ax.hist(x, bins=bins, density=True, color="C0", alpha=0.4)
        if np.ptp(x) > 0:
            xs = np.linspace(x.min(), x.max(), 200)
            ax.plot(xs, gaussian_kde(x)(xs), color="C0", lw=1.5)
        if name in true:
            ax.axvline(true[name], color="k", ls="--", lw=1.0)
        ax.set_title(name.removeprefix("response/"), fontsize="small")
    panels[0].set_ylabel("posterior density")
    return fig


# ------------------------------------------------------------------------------------------ variance explained


def variance_explained(da, ax=None, *, cmap: str = "Blues", annotate: bool = True):
    """Heatmaps of the variance explained (R²) by each factor, factors x participants, one panel per modality.

    A panel shows the participants that have a stream of its modality (the others are NaN in ``da``). The colour
    scale is shared by the panels, from ``min(0, smallest R²)`` to the largest R², and one colour bar serves them
    all.

    Args:
        da: ``msrm.variance_explained(...)``, an ``xarray.DataArray`` with dims (factor, participant, modality).
        ax: one axes per modality (a single Axes when there is one modality); default: a new figure with the
            panels side by side.
        cmap: a sequential matplotlib colormap.
        annotate: write each value in its cell.
    Returns:
        the Figure (one image per modality plus the colour bar's axes).
    Raises:
        ValueError: not a DataArray with dims factor, participant and modality; a wrong number of axes.
    """
    import matplotlib.pyplot as plt

    dims = getattr(da, "dims", None)
    if dims is None or not hasattr(da, "transpose") or set(dims) != {"factor", "participant", "modality"}:
        raise ValueError(f"da must be an xarray.DataArray with dims (factor, participant, modality) from "
                         f"msrm.variance_explained; got {type(da).__name__} with dims {dims}")
    da = da.transpose("factor", "participant", "modality")
    values = np.asarray(da.values, dtype=np.float64)
    factors = [str(f) for f in da["factor"].values]
    participants = [str(p) for p in da["participant"].values]
    modalities = [str(m) for m in da["modality"].values]
    if not modalities or not factors or not participants:
        raise ValueError(f"da has no values to draw (sizes {dict(da.sizes)})")
    finite = values[np.isfinite(values)]
    vmin = min(0.0, float(finite.min())) if finite.size else 0.0
    vmax = float(finite.max()) if finite.size else 1.0
    if vmax <= vmin:
        vmax = vmin + 1.0
    if ax is None:
        width = 1.5 + 0.6 * values.shape[1] + 1.2 * len(modalities)
        fig, made = plt.subplots(1, len(modalities), squeeze=False, figsize=(width, 1.5 + 0.5 * len(factors)))
        panels = list(made[0])
    else:
        panels = list(np.ravel(np.asarray(ax, dtype=object)))
        if len(panels) != len(modalities):
            raise ValueError(f"ax: {len(panels)} axes given for {len(modalities)} modalities")
        fig = panels[0].figure
    image = None
    for j, (panel, modality) in enumerate(zip(panels, modalities)):
        block = values[:, :, j]
        shown = [i for i in range(len(participants)) if np.isfinite(block[:, i]).any()]
        shown = shown or list(range(len(participants)))
        block = block[:, shown]
        image = panel.imshow(block, aspect="auto", interpolation="nearest", cmap=cmap, vmin=vmin, vmax=vmax)
        panel.set_title(modality, fontsize="small")
        panel.set_xticks(range(len(shown)))
        panel.set_xticklabels([participants[i] for i in shown], rotation=90, fontsize="small")
        panel.set_yticks(range(len(factors)))
        panel.set_yticklabels(factors if j == 0 else [], fontsize="small")
        panel.set_xlabel("participant")
        if annotate:
            for (f, i), v in np.ndenumerate(block):
                if np.isfinite(v):
                    dark = (v - vmin) / (vmax - vmin) > 0.6
                    panel.text(i, f, f"{v:.2f}", ha="center", va="center", fontsize="x-small",
                               color="white" if dark else "black")
    panels[0].set_ylabel("factor")
    fig.colorbar(image, ax=panels, label="variance explained (R²)")
    return fig
