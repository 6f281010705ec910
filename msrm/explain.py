r"""What each factor explains, and fitted results as labelled xarray objects.

**Variance explained** (:func:`variance_explained`) is the coefficient of determination MOFA reports
(Argelaguet et al. 2018, ``calculate_variance_explained``), with each (participant, modality) stream as one
MOFA view of one group. For stream s with loadings W (F, K), intercepts b (F,) and the factors seen through the
stream's response, ``x(t_i) = A_s(theta) Z`` (``A_s`` the response rows of :mod:`msrm.operators`, Z the latents
of the run on its grid):

    R2_{s,k} = 1 - sum (y_{s,f}(t_i) - b_f - W_{f,k} x_k(t_i))^2 / sum (y_{s,f}(t_i) - b_f)^2
    R2_s     = 1 - sum (y_{s,f}(t_i) - b_f - sum_k W_{f,k} x_k(t_i))^2 / sum (y_{s,f}(t_i) - b_f)^2

each sum over the observed values (NaN skipped) of every feature f, every sample i and every run holding the
stream. The per-feature variant keeps f fixed. ``b`` is the model's intercept (MOFA centres each feature; the
fitted intercept is this model's centre), and the total uses the same mean ``b + W x`` that the model predicts.

The factor contribution is computed once per run and stream, the latent mean pushed through the stream's response
with the fitted response parameters: the R-MSRM latents of the fit, or the posterior mean ``E[Z | Y, params]``
of a GP-MSRM model (``model.latent_posterior(params)``, the exact Gaussian of the factors given the data, so the
total R2 is that of ``model.predict(params)``'s mean), or latents the caller gives (``latents=``: the latents of
new runs from ``msrm.rmsrm.project``, or the true latents of a synthetic study). As in MOFA the factors are not
orthogonal in general, so the per-factor values need not add up to the total, and a factor's R2 is negative when
its contribution alone moves the prediction away from the data.

**Labelled outputs** (:func:`to_xarray`): latent posteriors, predictions and loadings as xarray objects with
named dimensions, times in seconds, factor names ``"factor_0"``, ``"factor_1"``, ... and feature names from the
data (``Stream.feature_names`` when the data model carries them, else ``"f0"``, ``"f1"``, ...).

xarray (installed with ArviZ, the ``bayes`` extra) is imported inside the functions.
"""
from __future__ import annotations

import sys
from typing import Mapping, Sequence

import numpy as np

from .data import Dataset
from .latent import LatentPosterior, Prediction
from .operators import response_weights_csr
from .params import Params
from .spec import latent_grid

__all__ = [
    "variance_explained",
    "variance_explained_per_feature",
    "to_xarray",
    "latents_to_xarray",
    "predictions_to_xarray",
    "loadings_to_xarray",
    "factor_names",
    "feature_names",
]

DEFINITION = ("R2_{s,k} = 1 - SS(y - b - W_k x_k) / SS(y - b) over the observed values of stream s (all its "
              "features, samples and runs); total: 1 - SS(y - b - W x) / SS(y - b); x = the stream's response "
              "rows applied to the latent mean")


# ------------------------------------------------------------------------------------------ names


def factor_names(n_factors: int) -> list[str]:
    """``["factor_0", ..., "factor_{K-1}"]``."""
    return [f"factor_{k}" for k in range(int(n_factors))]


def feature_names(data: Dataset | None, key: str, n_features: int) -> list[str]:
    """The names of a stream's features: ``feature_names`` of the first stream ``key`` of ``data`` when the stream
    carries them, else ``"f0"``, ``"f1"``, ...

    Raises:
        ValueError: the stream's names do not number ``n_features``.
    """
    if data is not None:
        for run in data.runs:
            if key in run.keys:
                names = getattr(run.stream(key), "feature_names", None)
                if names is not None:
                    names = [str(n) for n in names]
                    if len(names) != n_features:
                        raise ValueError(f"stream {key}: {len(names)} feature names for {n_features} features")
                    return names
                break
    return [f"f{f}" for f in range(int(n_features))]


def _split_key(key: str) -> tuple[str, str]:
    participant, _, modality = str(key).partition("/")
    return participant, modality


# ------------------------------------------------------------------------------------------ the fit's pieces


def _fit_kind(obj) -> str:
    """``"rmsrm"`` for an RFit, ``"gp"`` for a GPMSRM model; ValueError naming any other type. A GPMSRM instance
    exists only once ``msrm.gp.model`` is imported, so the check never imports JAX."""
    from .rmsrm.archive import RFit

    if isinstance(obj, RFit):
        return "rmsrm"
    gp_model = sys.modules.get("msrm.gp.model")
    if gp_model is not None and isinstance(obj, gp_model.GPMSRM):
        return "gp"
    raise ValueError(f"fit_or_model must be an R-MSRM fit (msrm.RFit, from msrm.fit_rmsrm) or a GP-MSRM model "
                     f"(msrm.GPMSRM, with params); got an object of type {type(obj).__name__}")


def _checked_params(params, data: Dataset, spec, *, require_lengthscales: bool) -> Params:
    """``params`` (a Params, or a result holding one in ``.params`` such as a MAP fit) validated against the data
    and spec; every mismatch is a ValueError that says so."""
    if not isinstance(params, Params) and isinstance(getattr(params, "params", None), Params):
        params = params.params
    if not isinstance(params, Params):
        raise ValueError(f"params must be an msrm.Params or a MAP result holding one (model.fit_map()); got "
                         f"{type(params).__name__}")
    try:
        params.validate(data, spec, require_lengthscales=require_lengthscales)
    except (KeyError, ValueError) as err:
        msg = err.args[0] if err.args else str(err)
        raise ValueError(f"params do not match the data: {msg}") from None
    return params


def _checked_latents(latents, data: Dataset, spec, where: str) -> list[np.ndarray]:
    """The latents as (J_r, K) float64 arrays, one per run of ``data`` on its grid (a LatentPosterior gives its
    mean)."""
    latents = list(latents)
    if len(latents) != len(data.runs):
        raise ValueError(f"latents: data has {len(data.runs)} runs but there are latents for {len(latents)} "
                         f"({where})")
    out = []
    for r, (run, z) in enumerate(zip(data.runs, latents)):
        z = np.asarray(z.mean if isinstance(z, LatentPosterior) else z, dtype=np.float64)
        J = latent_grid(run.duration, spec).size
        if z.shape != (J, spec.n_factors):
            raise ValueError(f"latents: run {r} (duration {run.duration:g} s) has a grid of {J} points and "
                             f"{spec.n_factors} factors, its latents have shape {z.shape} ({where})")
        if not np.isfinite(z).all():
            raise ValueError(f"latents: the latents of run {r} contain non-finite values")
        out.append(z)
    return out


def _fit_pieces(fit_or_model, params, data, latents):
    """(data, spec, params, latents per run, fit label) of an RFit or of a GPMSRM model with params."""
    kind = _fit_kind(fit_or_model)
    if kind == "rmsrm":
        from .rmsrm.predict import check_data

        rfit = fit_or_model
        if params is not None:
            raise ValueError("params: an R-MSRM fit holds its own parameters (rfit.params); pass params=None")
        if data is None:
            raise ValueError("data: an R-MSRM fit does not hold its data; pass the Dataset it was fitted on (or "
                             "new runs with latents=msrm.rmsrm.project(rfit, data))")
        try:
            check_data(rfit, data, "variance_explained")
        except (KeyError, ValueError) as err:
            msg = err.args[0] if err.args else str(err)
            raise ValueError(f"the fit's params do not match the data: {msg}") from None
        if latents is None:
            Z = _checked_latents(rfit.latents, data, rfit.spec, "the fit's latents; is this the data it was "
                                 "fitted on?")
        else:
            Z = _checked_latents(latents, data, rfit.spec, "the latents given")
        return data, rfit.spec, rfit.params, Z, "R-MSRM"
    model = fit_or_model
    if params is None:
        raise ValueError("params: a GP-MSRM model needs parameters, e.g. model.fit_map().params")
    if data is not None and data is not model.data:
        raise ValueError("data: a GP-MSRM model explains the data it was built on (model.data); pass data=None")
    data, spec = model.data, model.spec
    params = _checked_params(params, data, spec, require_lengthscales=True)
    if latents is None:
        Z = _checked_latents(model.latent_posterior(params), data, spec, "the latent posterior")
        return data, spec, params, Z, "GP-MSRM (posterior mean of the latents)"
    return data, spec, params, _checked_latents(latents, data, spec, "the latents given"), "GP-MSRM"


def _sums(fit_or_model, params, data, latents):
    """Per stream: (SS(y - b) (F,), SS of the residual of each factor alone (F, K), SS of the full residual (F,)),
    summed over the observed values of every run; with the data, spec and a label of the fit."""
    from .rmsrm.predict import stream_theta

    data, spec, params, means, label = _fit_pieces(fit_or_model, params, data, latents)
    K = spec.n_factors
    sums: dict[str, list[np.ndarray]] = {}
    for run, z in zip(data.runs, means):
        grid = latent_grid(run.duration, spec)
        for s in run.streams:
            A = response_weights_csr(s.times, spec.response(s.modality), stream_theta(spec, params, s), grid)
            x = np.asarray(A @ z)  # (n, K): the factors as this stream sees them
            W, b = params.loadings[s.key], params.intercepts[s.key]
            observed = s.mask
            centred = np.where(observed, s.values - b[None, :], 0.0)
            total = np.sum(centred ** 2, axis=0)
            per_factor = np.empty((s.n_features, K))
            for k in range(K):
                resid = centred - np.outer(x[:, k], W[:, k])
                per_factor[:, k] = np.sum(np.where(observed, resid, 0.0) ** 2, axis=0)
            resid = np.where(observed, centred - x @ W.T, 0.0)
            full = np.sum(resid ** 2, axis=0)
            if s.key in sums:
                acc = sums[s.key]
                acc[0] += total
                acc[1] += per_factor
                acc[2] += full
            else:
                sums[s.key] = [total, per_factor, full]
    return sums, data, spec, label


def _r2(residual, total):
    """``1 - residual / total``, NaN where ``total`` is 0 (nothing to explain)."""
    residual = np.asarray(residual, dtype=np.float64)
    total = np.broadcast_to(np.asarray(total, dtype=np.float64), residual.shape)
    out = np.full(residual.shape, np.nan)
    ok = total > 0
    out[ok] = 1.0 - residual[ok] / total[ok]
    return out


# ------------------------------------------------------------------------------------------ variance explained


def variance_explained(fit_or_model, params=None, data: Dataset | None = None, *, latents=None):
    """Variance explained (R2) by each factor in each stream, and by all factors together (module docstring).

    Args:
        fit_or_model: an R-MSRM fit (:class:`msrm.RFit`) or a GP-MSRM model (:class:`msrm.GPMSRM`).
        params: for a GP-MSRM model, the parameters (an :class:`msrm.Params` or a MAP result, e.g.
            ``model.fit_map()``); the latents are their posterior mean. None for an R-MSRM fit.
        data: for an R-MSRM fit, the Dataset it was fitted on, or new runs of its streams together with their
            ``latents``; None for a GP-MSRM model (its ``model.data``).
        latents: optional, a list over runs of (J, K) latents (or LatentPosteriors, their mean) to use instead of
            the fit's latents or the posterior mean: e.g. ``msrm.rmsrm.project(rfit, new_data)``, or the true
            latents of a synthetic study.
    Returns:
        ``xarray.DataArray`` named ``"variance_explained"``, dims (factor, participant, modality), coords
        ``factor`` = ``"factor_0"``, ..., ``participant`` and ``modality`` in the data's order, and the total R2
        of all factors as the coordinate ``total`` (participant, modality); NaN for a (participant, modality)
        pair without a stream. ``attrs``: ``definition``, ``fit``.
    Raises:
        ValueError: an unknown fit type, missing or superfluous ``params``/``data``, params that do not match
            the data (stream keys, shapes, response parameters), latents that do not match the data's runs.
    """
    import xarray as xr

    sums, data, spec, label = _sums(fit_or_model, params, data, latents)
    participants, modalities = list(data.participants), list(data.modalities)
    K = spec.n_factors
    r2 = np.full((K, len(participants), len(modalities)), np.nan)
    total = np.full((len(participants), len(modalities)), np.nan)
    for key, (ss0, ss_k, ss_all) in sums.items():
        p, m = _split_key(key)
        i, j = participants.index(p), modalities.index(m)
        r2[:, i, j] = _r2(ss_k.sum(axis=0), ss0.sum())
        total[i, j] = _r2(ss_all.sum(), ss0.sum())
    return xr.DataArray(
        r2, dims=("factor", "participant", "modality"), name="variance_explained",
        coords={"factor": factor_names(K), "participant": participants, "modality": modalities,
                "total": (("participant", "modality"), total)},
        attrs={"definition": DEFINITION, "fit": label})


def variance_explained_per_feature(fit_or_model, params=None, data: Dataset | None = None, *,
                                   latents=None) -> dict:
    """Variance explained by each factor in each feature of each stream (the definition of
    :func:`variance_explained` with the sums over one feature; arguments and errors as there).

    Returns:
        ``{"participant/modality": xarray.DataArray}``, dims (factor, feature), coords ``factor``, ``feature``
        (the data's feature names, else ``"f0"``, ...) and ``total`` (feature), the R2 of all factors; ``attrs``:
        ``participant``, ``modality``, ``definition``, ``fit``.
    """
    import xarray as xr

    sums, data, spec, label = _sums(fit_or_model, params, data, latents)
    out = {}
    for key, (ss0, ss_k, ss_all) in sums.items():
        p, m = _split_key(key)
        out[key] = xr.DataArray(
            _r2(ss_k.T, ss0[None, :]), dims=("factor", "feature"), name="variance_explained",
            coords={"factor": factor_names(spec.n_factors), "feature": feature_names(data, key, ss0.size),
                    "total": ("feature", _r2(ss_all, ss0))},
            attrs={"participant": p, "modality": m, "definition": DEFINITION, "fit": label})
    return out


# ------------------------------------------------------------------------------------------ labelled outputs


def latents_to_xarray(posteriors: Sequence[LatentPosterior] | LatentPosterior):
    """Latent posteriors of the runs as one ``xarray.Dataset``.

    Every run's grid is ``tau_j = -pad + j * latent_dt`` (``msrm.latent_grid``), so a shorter run's grid is the
    start of a longer one's: the ``time`` coordinate is the longest grid and a shorter run is NaN past its end.

    Args:
        posteriors: a list over runs of :class:`msrm.LatentPosterior` (``model.latent_posterior(params)``), or one.
    Returns:
        ``xarray.Dataset`` with ``mean`` and ``sd`` (run, time, factor), and ``cov`` (run, time, factor, factor2)
        when every posterior holds its covariance; coords ``run`` = 0, 1, ..., ``time`` in seconds, ``factor`` =
        ``"factor_0"``, ... (``factor2`` the same names).
    Raises:
        ValueError: not LatentPosteriors, an empty list, different factor counts or grids that do not share
            their start and step.
    """
    import xarray as xr

    if isinstance(posteriors, LatentPosterior):
        posteriors = [posteriors]
    posteriors = list(posteriors)
    if not posteriors:
        raise ValueError("posteriors: an empty list of runs")
    for r, lp in enumerate(posteriors):
        if not isinstance(lp, LatentPosterior):
            raise ValueError(f"posteriors[{r}] must be an msrm.LatentPosterior, got {type(lp).__name__}")
    K = posteriors[0].n_factors
    if any(lp.n_factors != K for lp in posteriors):
        raise ValueError(f"posteriors: different factor counts {[lp.n_factors for lp in posteriors]}")
    longest = max(posteriors, key=lambda lp: lp.grid.size).grid
    for r, lp in enumerate(posteriors):
        J = lp.grid.size
        if not np.allclose(lp.grid, longest[:J], rtol=0.0, atol=1e-9 * max(1.0, float(np.abs(longest).max()))):
            raise ValueError(f"posteriors[{r}]: its grid is not the start of the longest run's grid (a different "
                             f"latent_dt or pad)")
    R, J = len(posteriors), longest.size
    mean = np.full((R, J, K), np.nan)
    sd = np.full((R, J, K), np.nan)
    with_cov = all(lp.cov is not None for lp in posteriors)
    cov = np.full((R, J, K, K), np.nan) if with_cov else None
    for r, lp in enumerate(posteriors):
        n = lp.grid.size
        mean[r, :n], sd[r, :n] = lp.mean, lp.sd
        if with_cov:
            cov[r, :n] = lp.cov
    names = factor_names(K)
    variables = {"mean": (("run", "time", "factor"), mean), "sd": (("run", "time", "factor"), sd)}
    coords = {"run": np.arange(R), "time": np.array(longest), "factor": names}
    if with_cov:
        variables["cov"] = (("run", "time", "factor", "factor2"), cov)
        coords["factor2"] = names
    ds = xr.Dataset(variables, coords=coords)
    ds["time"].attrs["units"] = "s"
    return ds


def _prediction_dataset(key: str, pred: Prediction, stream, data: Dataset | None, run: int):
    import xarray as xr

    if not isinstance(pred, Prediction):
        raise ValueError(f"predictions[{run}][{key!r}] must be an msrm.Prediction, got {type(pred).__name__}")
    n, F = pred.mean.shape
    if stream is not None and stream.values.shape != (n, F):
        raise ValueError(f"predictions[{run}][{key!r}]: shape {(n, F)}, stream {key!r} of run {run} has "
                         f"{stream.values.shape}")
    times = pred.times if pred.times is not None else (stream.times if stream is not None else None)
    if times is None:
        raise ValueError(f"predictions[{run}][{key!r}] has no sample times; pass the data")
    dims = ("time", "feature")
    variables = {"mean": (dims, pred.mean), "sd": (dims, pred.sd)}
    if pred.signal_sd is not None:
        variables["signal_sd"] = (dims, pred.signal_sd)
    if stream is not None:
        variables["observed"] = (dims, stream.values)
    p, m = _split_key(key)
    ds = xr.Dataset(variables, coords={"time": np.asarray(times), "feature": feature_names(data, key, F)},
                    attrs={"participant": p, "modality": m, "run": run})
    ds["time"].attrs["units"] = "s"
    return ds


def predictions_to_xarray(predictions, data: Dataset | None = None):
    """Predictions as one ``xarray.Dataset`` per stream.

    Args:
        predictions: ``model.predict(params)`` or ``rfit.predict(data)``: a list over runs of
            ``{"participant/modality": msrm.Prediction}``, or one such dict (one run).
        data: optional, the Dataset predicted: adds the observed values and the feature names, and checks shapes.
    Returns:
        the same nesting with each Prediction replaced by an ``xarray.Dataset``: ``mean``, ``sd`` (and
        ``signal_sd`` when there is one, ``observed`` with the data) with dims (time, feature), coords ``time``
        in seconds and ``feature``; ``attrs`` ``participant``, ``modality``, ``run``.
    Raises:
        ValueError: not Predictions, a run count or stream that the data does not have, shapes that differ from
            the data's, no sample times (neither in the Prediction nor from the data).
    """
    one = isinstance(predictions, Mapping)
    runs = [predictions] if one else list(predictions)
    if data is not None:
        if not isinstance(data, Dataset):
            raise ValueError(f"data must be an msrm.Dataset, got {type(data).__name__}")
        if len(runs) != len(data.runs):
            raise ValueError(f"predictions has {len(runs)} runs, data has {len(data.runs)}")
    out = []
    for r, preds in enumerate(runs):
        if not isinstance(preds, Mapping):
            raise ValueError(f"predictions[{r}] must be a dict {{'participant/modality': msrm.Prediction}}, got "
                             f"{type(preds).__name__}")
        streams = {}
        for key, pred in preds.items():
            stream = None
            if data is not None:
                if key not in data.runs[r].keys:
                    raise ValueError(f"predictions[{r}]: {key!r} is not a stream of run {r}; its streams are "
                                     f"{list(data.runs[r].keys)}")
                stream = data.runs[r].stream(key)
            streams[key] = _prediction_dataset(key, pred, stream, data, r)
        out.append(streams)
    return out[0] if one else out


def loadings_to_xarray(params, data: Dataset | None = None) -> dict:
    """Loadings as one ``xarray.DataArray`` per stream.

    Args:
        params: an :class:`msrm.Params` (or a fit holding one in ``.params``) or a dict ``{key: (F, K) array}``.
        data: optional, the Dataset, for feature names (and a check of the feature counts).
    Returns:
        ``{"participant/modality": xarray.DataArray}`` named ``"loadings"``, dims (feature, factor), coords
        ``feature`` and ``factor`` = ``"factor_0"``, ...; ``attrs`` ``participant``, ``modality``.
    Raises:
        ValueError: no loadings, a loading matrix that is not 2-D, a feature count that differs from the data's.
    """
    import xarray as xr

    if not isinstance(params, (Params, Mapping)) and isinstance(getattr(params, "params", None), Params):
        params = params.params
    table = params.loadings if isinstance(params, Params) else params
    if not isinstance(table, Mapping):
        raise ValueError(f"params must be an msrm.Params or a dict of loadings, got {type(params).__name__}")
    counts = data.n_features if data is not None else {}
    out = {}
    for key, W in table.items():
        W = np.asarray(W, dtype=np.float64)
        if W.ndim != 2:
            raise ValueError(f"loadings[{key!r}]: expected an (n_features, K) array, got shape {W.shape}")
        if key in counts and counts[key] != W.shape[0]:
            raise ValueError(f"loadings[{key!r}]: {W.shape[0]} features, stream {key!r} of the data has "
                             f"{counts[key]}")
        p, m = _split_key(key)
        out[key] = xr.DataArray(W, dims=("feature", "factor"), name="loadings",
                                coords={"feature": feature_names(data, key, W.shape[0]),
                                        "factor": factor_names(W.shape[1])},
                                attrs={"participant": p, "modality": m})
    return out


def to_xarray(obj, data: Dataset | None = None):
    """Any of the three results as labelled xarray objects, chosen by what ``obj`` is:

    - a list of :class:`msrm.LatentPosterior` (or one) -> :func:`latents_to_xarray` (``data`` unused);
    - predictions, a list over runs of ``{key: msrm.Prediction}`` (or one dict) -> :func:`predictions_to_xarray`;
    - an :class:`msrm.Params` (or a fit holding one) -> :func:`loadings_to_xarray`.

    Raises:
        ValueError: anything else, naming its type.
    """
    if isinstance(obj, LatentPosterior) or (
            isinstance(obj, (list, tuple)) and obj and all(isinstance(o, LatentPosterior) for o in obj)):
        return latents_to_xarray(obj)
    if isinstance(obj, Mapping) and obj and all(isinstance(v, Prediction) for v in obj.values()):
        return predictions_to_xarray(obj, data)
    if isinstance(obj, (list, tuple)) and obj and all(isinstance(o, Mapping) for o in obj):
        return predictions_to_xarray(obj, data)
    if isinstance(obj, Params) or isinstance(getattr(obj, "params", None), Params):
        return loadings_to_xarray(obj, data)
    raise ValueError(f"to_xarray: expected latent posteriors (a list of msrm.LatentPosterior), predictions (a "
                     f"list of {{key: msrm.Prediction}}) or msrm.Params; got {type(obj).__name__}")
