r"""Predictions of a fitted R-MSRM, and the latents of new runs with the fitted parameters held fixed.

**Prediction.** For stream s of run r with sample times t_i the fitted model's mean is

    E[y_{s,f}(t_i)] = b_{s,f} + sum_k W_{s,f,k} x_k(t_i),   x(t_i) = A_s(theta) Z_r     (A: msrm.operators)

at every sample, observed or missing (a value held out as NaN is predicted from the rest of the fit).
R-MSRM is a penalised point estimate with no posterior: the returned ``sd`` is the fitted noise sd sigma_{s,f}
(the spread of a new observation around the fitted mean if Z, W, b and theta were exact) and ``signal_sd`` is
None (the model gives no uncertainty for its mean; zeros would claim a certainty it does not have).

**Projection.** :func:`project` solves the latent step of the fit (msrm/rmsrm/latent.py: the block-banded normal
equations of the noise-weighted least squares with the roughness penalty ``lambda/2 tr(Z^T D2^T D2 Z S)``) on
new runs with W, b, sigma and theta fixed at the fitted values and lambda the fit's. The penalty metric S is the
fit's, ``(1/F_tot) sum_s W_s^T Sigma_s^-1 W_s`` over every stream of the fit, so the projected latents of a run
with fewer streams are penalised exactly as in the fit.

The scale convention (msrm/rmsrm/convention.py: centred, whitened and rotated latents) is **not** re-applied:
it is a reparametrisation ``Z -> (Z - m) T`` paired with ``W -> W T^-T, b -> b + W m``, and with W and b fixed
there is nothing to pair it with. The objective is invariant under the paired map, so the fit's latents are the
latent-step solution in the fit's own frame; the projected latents are the latent-step solution in that same
frame (the fitted W and b fix their location, scale and rotation). Projecting the training data therefore gives
the fitted latents back, up to how far the fit was from its fixed point (one latent step).
"""
from __future__ import annotations

import numpy as np

from ..data import Dataset
from ..latent import Prediction
from ..operators import response_weights_csr
from ..spec import latent_grid

__all__ = ["predict", "project", "stream_theta", "check_data"]


def stream_theta(spec, params, stream) -> dict:
    """The response parameters that apply to ``stream``: {} for a response without parameters, else the entry of
    its modality (shared pooling) or of its key (individual pooling)."""
    resp = spec.response(stream.modality)
    if not resp.param_names:
        return {}
    key = stream.modality if spec.pooling == "shared" else stream.key
    if key not in params.response:
        raise KeyError(f"stream {stream.key}: the fit has no response parameters {key!r}; it has "
                       f"{sorted(params.response)}")
    return params.response[key]


def check_data(rfit, data, where: str) -> None:
    """Raise unless every stream of ``data`` is a stream of the fit with the fit's feature count and modality
    response (KeyError for an unknown stream or modality, ValueError for a feature-count mismatch)."""
    if not isinstance(data, Dataset):
        raise ValueError(f"{where}: data must be an msrm.Dataset, got {type(data).__name__}")
    fitted = rfit.params.loadings
    K = rfit.spec.n_factors
    for r, run in enumerate(data.runs):
        for s in run.streams:
            if s.key not in fitted:
                raise KeyError(f"{where}: run {r} stream {s.key!r} is not a stream of the fit; the fit has "
                               f"{sorted(fitted)}")
            if fitted[s.key].shape != (s.n_features, K):
                raise ValueError(f"{where}: run {r} stream {s.key!r} has {s.n_features} features, the fit's "
                                 f"loadings are {fitted[s.key].shape} (n_features, K)")
            rfit.spec.response(s.modality)  # KeyError for a modality without a response


def _check_latents(rfit, data, latents, where: str) -> list:
    """The latents as a list of (J_r, K) float64 arrays, one per run of ``data`` on its grid."""
    K = rfit.spec.n_factors
    latents = [np.asarray(z, dtype=np.float64) for z in latents]
    if len(latents) != len(data.runs):
        raise ValueError(f"{where}: data has {len(data.runs)} runs but there are latents for {len(latents)} runs "
                         f"(predict new runs with latents=msrm.rmsrm.project(rfit, data))")
    for r, (run, z) in enumerate(zip(data.runs, latents)):
        J = latent_grid(run.duration, rfit.spec).size
        if z.ndim != 2 or z.shape != (J, K):
            raise ValueError(f"{where}: run {r} (duration {run.duration:g} s) has a grid of {J} points, its latents "
                             f"have shape {z.shape}, expected ({J}, {K}); is this the data the fit was made on?")
        if not np.isfinite(z).all():
            raise ValueError(f"{where}: the latents of run {r} contain non-finite values")
    return latents


def predict(rfit, data, latents=None) -> list[dict]:
    """Fitted means of every stream at every sample (module docstring).

    Args:
        rfit: an :class:`~msrm.rmsrm.RFit`.
        data: the Dataset to predict: the fit's own data (any values, NaN included: only the clocks and shapes are
            used) or new runs together with their ``latents``.
        latents: list over runs of (J, K) latents; None takes ``rfit.latents`` (then ``data`` must have the fit's
            runs: their number and grid lengths are checked, and every stream must be a fitted stream with its
            feature count).
    Returns:
        list over runs of ``{"participant/modality": msrm.Prediction}``: mean (n_samples, n_features), sd the
        fitted noise sd broadcast to that shape, signal_sd None, times (n_samples,).
    """
    check_data(rfit, data, "predict")
    Z = _check_latents(rfit, data, rfit.latents if latents is None else latents, "predict")
    spec, params = rfit.spec, rfit.params
    out = []
    for run, z in zip(data.runs, Z):
        grid = latent_grid(run.duration, spec)
        preds = {}
        for s in run.streams:
            A = response_weights_csr(s.times, spec.response(s.modality), stream_theta(spec, params, s), grid)
            x = A @ z  # (n, K)
            mean = params.intercepts[s.key][None, :] + x @ params.loadings[s.key].T
            sd = np.broadcast_to(params.noise_sd[s.key][None, :], mean.shape)
            preds[s.key] = Prediction(mean=mean, sd=sd, signal_sd=None, times=s.times)
        out.append(preds)
    return out


def project(rfit, new_data) -> list[np.ndarray]:
    """Latents of new runs with the fitted loadings, intercepts, noise and responses held fixed (module docstring).

    Args:
        rfit: an :class:`~msrm.rmsrm.RFit`.
        new_data: a Dataset whose streams are streams of the fit (same keys and feature counts; a run may hold a
            subset of them; missing values are allowed).
    Returns:
        list over runs of (J_r, K) latents on each run's grid, in the fit's frame; ``rfit.predict(new_data,
        latents=project(rfit, new_data))`` gives the predictions for the new runs.
    Raises:
        KeyError: a stream or modality the fit does not have. ValueError: feature counts that do not match.
    """
    from .latent import solve_latents
    from .objective import RState, compute_stats
    from .prepare import prepare_rmsrm

    check_data(rfit, new_data, "project")
    params, spec, K = rfit.params, rfit.spec, rfit.spec.n_factors
    prep = prepare_rmsrm(new_data, spec, rfit.roughness)
    var = {k: np.asarray(v, dtype=np.float64) ** 2 for k, v in params.noise_sd.items()}
    keys = prep.keys
    grids = [run.grid.size for run in prep.runs]
    state = RState(Z=tuple(np.zeros((J, K)) for J in grids), W={k: params.loadings[k] for k in keys},
                   b={k: params.intercepts[k] for k in keys}, var={k: var[k] for k in keys},
                   theta={k: dict(v) for k, v in params.response.items()})
    stats = compute_stats(prep, state)
    # the fit's penalty metric: every fitted stream, normalised by the fit's total feature count
    F_tot = sum(W.shape[0] for W in params.loadings.values())
    S = sum(params.loadings[k].T @ (params.loadings[k] / var[k][:, None]) for k in params.loadings) / F_tot
    stats = stats._replace(S=S)
    diagnostics: list = []
    Z = solve_latents(prep, state, stats, "banded", diagnostics)
    if diagnostics:
        raise FloatingPointError(f"project: the latent normal equations are singular ({diagnostics[0]}); a run "
                                 f"has factors that no observed stream informs")
    return [np.array(z) for z in Z]
