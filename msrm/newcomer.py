r"""New participants: their loadings, intercepts, noise and responses with the shared latents held fixed.

A fit (an R-MSRM fit, or a GP-MSRM model with its parameters) has estimated the latent factors Z_r of each run r
from the participants it saw. A new participant who took part in the same runs (the same stimulus, so the same
latent time course) has streams y_s of their own: their own clocks, feature counts and missing values. Their
parameters are estimated by regressing each stream on the fit's latents, as seen through the stream's response,
while the latents stay what the fit made of them (BrainIAK's ``SRM.transform_subject`` does the same for the
shared response model).

**What is held fixed, and why.** The latents' posterior from the fit (R-MSRM: the point estimate Z_r; GP-MSRM:
the Gaussian ``p(Z_r | Y, params)`` of ``model.latent_posterior(params)``), the fit's parameters of every other
stream, the lengthscales, and with ``pooling="shared"`` the fitted response parameters of each modality. The new
participant does not update the latents: a projection must not change the fit it is made against (every earlier
participant's results stay as they were), and one participant adds little to what several already pin down. The
price is that the new participant's information about Z is not used (a full refit would use it).

**The estimate** is the M-step of EM for a factor-analysis loading given the latents' posterior. For stream s
of modality m with response parameters theta, the factors at its sample times are ``x_i = A_s(theta) Z``
(``A_s`` the response rows of :mod:`msrm.operators`, (n, J), on each response's fixed window); with
``x~_i = [x_i; 1]`` (K + 1) and the expected sufficient statistics

    E[x~_i] = [m_i; 1],        m_i = A_s[i] E[Z]                                   (n, K)
    E[x~_i x~_i^T] = [[m_i m_i^T + V_i, m_i], [m_i^T, 1]],   V_i = Cov[x_i]        (n, K, K)

each feature f with observed samples O_f (NaN skipped) gets ``beta_f = [w_f; b_f]`` (K + 1) from

    (sum_{i in O_f} E[x~_i x~_i^T]) beta_f = sum_{i in O_f} y_{if} E[x~_i]

(loadings jointly with the intercept) and the noise variance from the expected residual,

    sigma_f^2 = (1/|O_f|) sum_{i in O_f} [ (y_{if} - b_f - w_f^T m_i)^2 + w_f^T V_i w_f ],

which together maximise the expected complete-data log likelihood
``L = sum_f sum_{i in O_f} E[log N(y_{if}; b_f + w_f^T x_i, sigma_f^2)]``, at the maximum
``-1/2 sum_f |O_f| (log(2 pi sigma_f^2) + 1)``. With an R-MSRM fit V = 0 and this is ordinary least squares of
each feature on ``[m_i, 1]``.

**V from the GP posterior.** ``V_i = sum_{j,j'} a_ij a_ij' Cov[z_j, z_j' | Y]`` needs the posterior covariance
between the grid points a response window spans, not only the K x K block at each point that
``model.latent_posterior(params, cov=True)`` reports. It comes from the node-space solve of
:mod:`msrm.gp.conditional`: with ``G = L^-1 R A K`` (N K, J, K),
``Cov[z_jk, z_il | Y] = delta_kl K_k[j, i] - sum_x G[x, j, k] G[x, i, l]``, kept for grid points less than a
window apart (:func:`banded_covariance`, (J, 2h - 1, K, K)). V is then exact, the same Cov[x_i] with which the
model predicts its own streams (``model.predict``'s ``signal_sd``). The solve is that of the grouped backend's
latent posterior (memory of order (N K)^2 per run, N the run's nodes), done once per projection.

**Response parameters.** With ``pooling="shared"`` the fit's values of the modality are reused. With
``pooling="individual"`` theta is estimated per stream by maximising the profiled expected log likelihood
``L(theta)`` above (W, b, sigma at their closed-form optimum for each theta) over the response's bounds: a grid
with steps of at most half the latent step in each parameter, then a bounded local search from its best point
(``scipy.optimize.minimize_scalar`` for one parameter, L-BFGS-B for more).

**Shapes.** A stream with F features (its own F: a new participant's brain stream need not have the fit's
feature count) gets loadings (F, K), intercepts (F,) and noise sd (F,). Its predictions, at every sample (missing
ones included), are ``b + W m_i`` with sd ``sqrt(diag(W V_i W^T) + sigma^2)`` (GP; ``signal_sd`` the same
without sigma) or sd sigma and no ``signal_sd`` (R-MSRM, a point estimate, as in
:func:`msrm.rmsrm.predict.predict`).
"""
from __future__ import annotations

import math
import sys
import weakref
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple, Sequence

import numpy as np

from .data import Dataset, Run
from .latent import LatentPosterior, Prediction
from .operators import window_layout, window_weights
from .params import Params
from .spec import ModelSpec, latent_grid

__all__ = ["project_participant", "ParticipantProjection", "m_step", "StreamEstimate", "window_moments",
           "posterior_bands", "banded_covariance"]

# Noise variances are floored at this fraction of the feature's mean square (as in the R-MSRM noise step).
VAR_FLOOR = 1e-12
# Largest condition number of a feature's normal matrix before the loadings count as not identified.
MAX_CONDITION = 1e12
# The grid of the response-parameter search: at most half a latent step between points, 5 to 33 per parameter.
_PROBE_MIN, _PROBE_MAX = 5, 33


# ------------------------------------------------------------------------------------------ results


class StreamEstimate(NamedTuple):
    """The M-step of one stream (module docstring).

    Fields:
        loadings: (F, K) W.
        intercepts: (F,) b.
        noise_var: (F,) sigma^2.
        n_observed: (F,) |O_f|, the observed samples of each feature.
        expected_loglik: L at the estimate (float).
    """

    loadings: np.ndarray
    intercepts: np.ndarray
    noise_var: np.ndarray
    n_observed: np.ndarray
    expected_loglik: float


@dataclass(frozen=True, eq=False)
class ParticipantProjection:
    """A new participant projected onto a fit (:func:`project_participant`).

    Fields:
        participant: the new participant's label.
        params: :class:`msrm.Params` holding only the new participant's streams: loadings (F, K), intercepts and
            noise sd (F,) per stream key ``"participant/modality"``, the fit's lengthscales, and the response
            parameters its streams use (the fit's modality values with shared pooling; the estimated
            ``"participant/modality"`` values with individual pooling).
        predictions: list over ``data``'s runs of ``{"participant/modality": msrm.Prediction}``, mean and sd
            (n_samples, n_features) at every sample, missing ones included.
        latents: list over ``data``'s runs of what was held fixed: the R-MSRM latents (J, K), or the GP
            :class:`msrm.LatentPosterior` (with its K x K covariance per grid point).
        runs: the fit's run index of each run of ``data``.
        data: the new participant's streams as used, one run per entry of ``runs``.
        expected_loglik: stream key -> the expected log likelihood L at the estimate (module docstring).
        response_search: stream key -> what the response-parameter search did (individual pooling and a
            parametrised response only): ``theta``, ``expected_loglik``, ``n_evaluations``, ``grid_best``,
            ``converged``, ``message``.
        fit: a label of the fit (``"R-MSRM"`` or ``"GP-MSRM"``).
        spec: the fit's ModelSpec.
    """

    participant: str
    params: Params
    predictions: list
    latents: list
    runs: tuple
    data: Dataset
    expected_loglik: dict
    response_search: dict = field(default_factory=dict)
    fit: str = ""
    spec: ModelSpec | None = field(default=None, repr=False)

    @cached_property
    def variance_explained(self):
        """Variance explained (R2) in each of the new participant's streams by each factor and by all together:
        :func:`msrm.explain.variance_explained` of these parameters with the fixed latent means (``xarray``
        imported on first access). ``xarray.DataArray``, dims (factor, participant, modality), coordinate
        ``total``."""
        from .explain import variance_explained
        from .rmsrm.archive import RFit

        means = [z.mean if isinstance(z, LatentPosterior) else z for z in self.latents]
        # msrm.explain evaluates fixed latents with parameters through an R-MSRM fit; this one carries the new
        # participant's parameters and the latent means (the posterior mean for a GP fit, as explain uses there).
        carrier = RFit(latents=means, params=self.params, objective_history=np.zeros(1),
                       step_objectives=np.zeros((0, 4)), converged=True, n_iter=0, timings={}, restarts=np.zeros(1),
                       restart_errors=[None], restart_seeds=[{}], execution_info={}, spec=self.spec, roughness=0.0)
        out = variance_explained(carrier, data=self.data, latents=means)
        out.attrs["fit"] = f"{self.fit}, new participant {self.participant!r} with the fit's latents held fixed"
        return out

    def __repr__(self) -> str:
        return (f"ParticipantProjection(participant={self.participant!r}, streams={list(self.params.loadings)}, "
                f"runs={list(self.runs)}, fit={self.fit!r})")


# ------------------------------------------------------------------------------------------ expected statistics, M-step


def banded_covariance(G: np.ndarray, prior: np.ndarray, half_width: int) -> np.ndarray:
    """The posterior covariances ``Cov[z_j, z_{j+d}]`` (K x K) of grid points up to ``half_width - 1`` apart.

    With ``G = L^-1 R A K`` (N K, J, K) of the node-space solve (:mod:`msrm.gp.conditional`) and the prior
    correlations ``K_k`` (K, J, J), ``Cov[z_jk, z_il | y] = delta_kl K_k[j, i] - sum_x G[x, j, k] G[x, i, l]``.

    Returns:
        (J, 2 h - 1, K, K) with entry ``[j, d + h - 1] = Cov[z_j, z_{j+d}]`` for ``|d| < h`` (zero past the grid).
    """
    _, J, K = G.shape
    h = int(half_width)
    Gt = np.ascontiguousarray(np.transpose(G, (1, 2, 0)))  # (J, K, N K)
    band = np.zeros((J, 2 * h - 1, K, K))
    diag = np.arange(K)
    for d in range(-(h - 1), h):
        j = np.arange(max(0, -d), min(J, J - d))
        if j.size == 0:
            continue
        block = -np.matmul(Gt[j], np.swapaxes(Gt[j + d], 1, 2))  # (n_j, K, K)
        block[:, diag, diag] += prior[:, j, j + d].T
        band[j, d + h - 1] = block
    return band


def window_moments(times, response, theta, grid, mean: np.ndarray, band: np.ndarray | None):
    """E[x_i] (n, K) and, with the banded posterior covariance, ``V_i = Cov[x_i] = sum_{p,q} a_ip a_iq
    Cov[z_{s_i+p}, z_{s_i+q}]`` (n, K, K) over each sample's response window (``msrm.operators.window_layout``:
    the same rows as :func:`msrm.operators.response_weights_csr`).

    Args:
        times: (n,) sample times; response, theta: the stream's response and its parameters; grid: (J,).
        mean: (J, K) posterior mean on the grid.
        band: (J, 2 h - 1, K, K) from :func:`banded_covariance` with h at least the window length, or None
            (latents known exactly: V = 0).
    Returns:
        m (n, K), and V (n, K, K) or None.
    """
    layout = window_layout(times, response, grid)
    a = window_weights(response, theta, layout)  # (n, w)
    n, w = a.shape
    idx = layout.start[:, None] + np.arange(w)[None, :]  # (n, w) grid index of each weight
    m = np.einsum("nw,nwk->nk", a, mean[idx])
    if band is None:
        return m, None
    h = (band.shape[1] + 1) // 2
    if w > h:
        raise ValueError(f"window of {w} grid points is longer than the banded covariance's half width {h}")
    K = mean.shape[1]
    V = np.zeros((n, K, K))
    for p in range(w):
        # Cov[z_{s+p}, z_{s+q}] for q = 0..w-1: offsets q - p, columns h - 1 - p .. h - 2 - p + w of the band
        rows = band[idx[:, p], h - 1 - p:h - 1 - p + w]  # (n, w, K, K)
        V += a[:, p, None, None] * np.einsum("nq,nqkl->nkl", a, rows)
    return m, 0.5 * (V + np.swapaxes(V, 1, 2))


def m_step(Y: np.ndarray, m: np.ndarray, V: np.ndarray | None = None, *, key: str = "stream") -> StreamEstimate:
    """Loadings, intercepts and noise variances of one stream given the expected statistics of its factors
    (module docstring): per feature, ``(sum_O E[x~ x~^T]) [w; b] = sum_O y E[x~]`` and the expected residual.

    Args:
        Y: (n, F) values, NaN missing (every feature needs K + 2 observed samples).
        m: (n, K) E[x_i].
        V: (n, K, K) Cov[x_i], or None for known factors (then this is ordinary least squares).
        key: the stream's name for error messages.
    Raises:
        ValueError: normal equations that do not identify the loadings (the factors are collinear over the
            feature's observed samples).
    """
    Y = np.asarray(Y, dtype=np.float64)
    n, F = Y.shape
    K = m.shape[1]
    mask = ~np.isnan(Y)
    Y0 = np.where(mask, Y, 0.0)
    Xt = np.concatenate([m, np.ones((n, 1))], axis=1)  # E[x~_i]: (n, K + 1)
    S = Xt[:, :, None] * Xt[:, None, :]  # E[x~ x~^T] without V: (n, K + 1, K + 1)
    if V is not None:
        S[:, :K, :K] += V
    rhs = Xt.T @ Y0  # (K + 1, F)
    if mask.all():
        C = np.broadcast_to(S.sum(axis=0), (F, K + 1, K + 1))
    else:
        C = (mask.T.astype(np.float64) @ S.reshape(n, -1)).reshape(F, K + 1, K + 1)
    cond = np.linalg.cond(C[:1] if mask.all() else C)
    if not np.all(cond < MAX_CONDITION):
        bad = np.flatnonzero(~(cond < MAX_CONDITION))[:10].tolist() if not mask.all() else list(range(min(F, 10)))
        raise ValueError(f"stream {key}: the fixed latents do not identify the loadings of feature(s) {bad} (normal "
                         f"equations with condition number {float(np.max(cond)):.3g}); the factors are collinear "
                         f"over the observed samples")
    beta = np.linalg.solve(C, rhs.T[:, :, None])[:, :, 0]  # (F, K + 1)
    W, b = beta[:, :K], beta[:, K]
    resid = np.where(mask, Y0 - b[None, :] - m @ W.T, 0.0)
    q = np.sum(resid * resid, axis=0)
    if V is not None:
        q = q + np.einsum("if,fk,ikl,fl->f", mask.astype(np.float64), W, V, W)
    count = mask.sum(axis=0)
    floor = np.maximum(VAR_FLOOR * np.sum(Y0 * Y0, axis=0) / count, 1e-300)
    var = np.maximum(q / count, floor)
    ell = -0.5 * float(np.sum(count * np.log(2.0 * math.pi * var) + q / var))
    return StreamEstimate(np.ascontiguousarray(W), b.copy(), var, count, ell)


# ------------------------------------------------------------------------------------------ the fit


class _FitView(NamedTuple):
    """What the projection needs of a fit: kind, spec, the fit's Params, its stream keys and run grids."""

    kind: str
    label: str
    spec: ModelSpec
    params: Params
    keys: tuple
    grids: list


def _fit_view(fit, params) -> _FitView:
    """The fit's pieces, with its type and params checked (ValueError naming what is wrong). A GPMSRM instance
    exists only once ``msrm.gp.model`` is imported, so the check never imports JAX."""
    from .rmsrm.archive import RFit

    if isinstance(fit, RFit):
        if params is not None:
            raise ValueError("params: an R-MSRM fit holds its own parameters (fit.params); pass params=None")
        spec = fit.spec
        grids = [(np.arange(np.asarray(z).shape[0]) - spec.pad_steps) * spec.latent_dt for z in fit.latents]
        return _FitView("rmsrm", "R-MSRM", spec, fit.params, tuple(fit.params.loadings), grids)
    gp_model = sys.modules.get("msrm.gp.model")
    if gp_model is None or not isinstance(fit, gp_model.GPMSRM):
        raise ValueError(f"fit must be an R-MSRM fit (msrm.RFit, from msrm.fit_rmsrm) or a GP-MSRM model "
                         f"(msrm.GPMSRM, with params=); got an object of type {type(fit).__name__}")
    if params is None:
        raise ValueError("params: a GP-MSRM model needs its parameters, e.g. params=model.fit_map().params")
    if not isinstance(params, Params) and isinstance(getattr(params, "params", None), Params):
        params = params.params  # a MAP result
    if not isinstance(params, Params):
        raise ValueError(f"params must be an msrm.Params or a MAP result holding one; got {type(params).__name__}")
    try:
        params.validate(fit.data, fit.spec)
    except (KeyError, ValueError) as err:
        msg = err.args[0] if err.args else str(err)
        raise ValueError(f"params do not match the GP model's data: {msg}") from None
    grids = [latent_grid(run.duration, fit.spec) for run in fit.data.runs]
    return _FitView("gp", "GP-MSRM", fit.spec, params, tuple(fit.data.stream_keys), grids)


# ------------------------------------------------------------------------------------------ checks


def _as_dataset(new_data) -> Dataset:
    if isinstance(new_data, Dataset):
        return new_data
    if isinstance(new_data, Run):
        return Dataset([new_data])
    raise ValueError(f"new_data must be an msrm.Dataset (runs matched to the fit's runs by index, or by runs=) or "
                     f"an msrm.Run; got {type(new_data).__name__}")


def _select(new_data, participant, runs, view: _FitView) -> tuple[str, Dataset, tuple]:
    """The new participant's streams and the fit's run index of each run holding them; every check of the
    input, each error naming the stream, participant or run."""
    data = _as_dataset(new_data)
    present = data.participants
    if participant is None:
        if len(present) != 1:
            raise ValueError(f"new_data holds the streams of participants {list(present)}; name the new one with "
                             f"participant=")
        participant = present[0]
    elif participant not in present:
        raise ValueError(f"participant {participant!r} has no stream in new_data; its participants are "
                         f"{list(present)}")
    fit_participants = sorted({k.split("/", 1)[0] for k in view.keys})
    if participant in fit_participants:
        raise ValueError(f"participant {participant!r} is already a participant of the fit {fit_participants}; a "
                         f"new participant needs a new label")
    fit_modalities = sorted({k.split("/", 1)[1] for k in view.keys})
    n_fit = len(view.grids)
    if runs is None:
        if len(data.runs) != n_fit:
            raise ValueError(f"new_data has {len(data.runs)} runs and the fit has {n_fit}; runs are matched by index, "
                             f"so give every run of the fit (a run may omit the participant) or name the fit's run "
                             f"of each with runs=")
        runs = list(range(n_fit))
    else:
        runs = [int(r) for r in np.atleast_1d(np.asarray(runs))]
        if len(runs) != len(data.runs):
            raise ValueError(f"runs= names {len(runs)} runs of the fit for the {len(data.runs)} runs of new_data")
        bad = [r for r in runs if not 0 <= r < n_fit]
        if bad:
            raise ValueError(f"runs= {bad}: the fit has runs 0 to {n_fit - 1}")
        if len(set(runs)) != len(runs):
            raise ValueError(f"runs= {runs} names a run of the fit twice")
    kept_runs, kept_index = [], []
    for r, (run, fit_r) in enumerate(zip(data.runs, runs)):
        streams = [s for s in run.streams if s.participant == participant]
        if not streams:
            continue
        for s in streams:
            if s.modality not in fit_modalities:
                raise KeyError(f"stream {s.key} (run {r} of new_data): the fit has no modality {s.modality!r}; its "
                               f"modalities are {fit_modalities}")
        grid = latent_grid(run.duration, view.spec)
        fit_grid = view.grids[fit_r]
        if grid.size != fit_grid.size:
            raise ValueError(f"run {r} of new_data (stream {streams[0].key}, duration {run.duration:g} s) has a "
                             f"latent grid of {grid.size} points, the fit's run {fit_r} has {fit_grid.size}: not "
                             f"the same run (match runs by index or name them with runs=)")
        kept_runs.append(Run(duration=run.duration, streams=streams))
        kept_index.append(fit_r)
    selected = Dataset(kept_runs)
    K = view.spec.n_factors
    for key in selected.stream_keys:
        count = sum(run.stream(key).mask.sum(axis=0) for run in selected.runs if key in run.keys)
        few = np.flatnonzero(count < K + 2)
        if few.size:
            raise ValueError(f"stream {key}: feature(s) {few[:10].tolist()} have {int(count[few[0]])} observed values "
                             f"(fewest); estimating K = {K} loadings, an intercept and a noise sd needs at least "
                             f"{K + 2} per feature")
    return participant, selected, tuple(kept_index)


# ------------------------------------------------------------------------------------------ response parameters


def _stream_moments(key, selected: Dataset, fixed: dict, response, theta) -> tuple:
    """(Y, m, V) of stream ``key`` over every run holding it, stacked along the samples."""
    Ys, ms, Vs = [], [], []
    for r, run in enumerate(selected.runs):
        if key not in run.keys:
            continue
        s = run.stream(key)
        grid, mean, band = fixed[r]
        m, V = window_moments(s.times, response, theta, grid, mean, band)
        Ys.append(s.values)
        ms.append(m)
        Vs.append(V)
    V = None if Vs[0] is None else np.concatenate(Vs, axis=0)
    return np.concatenate(Ys, axis=0), np.concatenate(ms, axis=0), V


def _probe_axes(response, latent_dt: float) -> list[np.ndarray]:
    axes = []
    for name in response.param_names:
        lo, hi = response.bounds[name]
        num = int(np.clip(math.ceil((hi - lo) / (0.5 * latent_dt)) + 1, _PROBE_MIN, _PROBE_MAX))
        axes.append(np.linspace(lo, hi, num))
    return axes


def _search_theta(key, selected, fixed, response, spec: ModelSpec, start: dict | None) -> tuple[dict, dict]:
    """Maximise the profiled expected log likelihood over the response's bounds (module docstring)."""
    import itertools

    from scipy.optimize import minimize, minimize_scalar

    names = response.param_names
    bounds = [response.bounds[n] for n in names]
    evaluations = [0]

    def neg_ell(x) -> float:
        theta = {n: float(np.clip(v, lo, hi)) for n, v, (lo, hi) in zip(names, np.atleast_1d(x), bounds)}
        evaluations[0] += 1
        Y, m, V = _stream_moments(key, selected, fixed, response, theta)
        try:
            return -m_step(Y, m, V, key=key).expected_loglik
        except ValueError:
            return math.inf

    axes = _probe_axes(response, spec.latent_dt)
    points = [np.array(p) for p in itertools.product(*axes)]
    if start is not None:
        points.append(np.array([start[n] for n in names]))
    values = [neg_ell(p) for p in points]
    best = int(np.argmin(values))
    x0, f0 = points[best], values[best]
    if not math.isfinite(f0):
        raise ValueError(f"stream {key}: no value of the response parameters {list(names)} within their bounds "
                         f"gives identified loadings")
    if len(names) == 1:
        grid = axes[0]
        i = int(np.searchsorted(grid, x0[0]))
        lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, grid.size - 1)]
        res = minimize_scalar(lambda v: neg_ell(np.array([v])), bounds=(lo, hi), method="bounded",
                              options={"xatol": 1e-6 * (bounds[0][1] - bounds[0][0])})
        x, f, ok, message = np.array([res.x]), float(res.fun), bool(res.success), str(res.message)
    else:
        res = minimize(neg_ell, x0, method="L-BFGS-B", bounds=bounds)
        x, f, ok, message = np.asarray(res.x), float(res.fun), bool(res.success), str(res.message)
    if not f <= f0:  # the local search never returns worse than its start
        x, f = x0, f0
    theta = {n: float(np.clip(v, lo, hi)) for n, v, (lo, hi) in zip(names, x, bounds)}
    info = {"theta": dict(theta), "expected_loglik": -f, "n_evaluations": evaluations[0],
            "grid_best": {n: float(v) for n, v in zip(names, x0)}, "converged": ok, "message": message}
    return theta, info


def _start_theta(view: _FitView, modality: str) -> dict | None:
    """The mean of the fit's per-stream values of a modality (individual pooling), or None."""
    values = [v for k, v in view.params.response.items() if k.endswith("/" + modality)]
    if not values:
        return None
    return {n: float(np.mean([v[n] for v in values])) for n in values[0]}


# Per GP model: its data prepared per run (grouped nodes) and the jitted grid solve, kept as long as the model
# lives, so that projecting several participants onto one model prepares and compiles once per run.
_GRID_SOLVES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _grid_solve(theta, run):
    """G = L^-1 R A K (N K, J, K) and the prior correlations K_k (K, J, J) of one prepared run (module
    :mod:`msrm.gp.conditional`)."""
    import jax.numpy as jnp

    from .gp.conditional import node_system, solve_cross
    from .gp.kernels import kernel_matrices
    from .gp.likelihood import response_matrix

    system = node_system(theta, run)
    prior = kernel_matrices(run.layout.dist, theta["lengthscales"], run.layout.kernel)
    X = jnp.einsum("uj,kji->kui", response_matrix(theta, run.layout), prior)  # A K_k: (K, N, J)
    return solve_cross(system, X), prior


def posterior_bands(model, params: Params, fit_runs, half_width: int) -> list[np.ndarray]:
    """The banded posterior covariance of the latents on the grid of each fit run in ``fit_runs``
    (:func:`banded_covariance`), from the node-space solve of :mod:`msrm.gp.conditional` on the model's data
    prepared per run (grouped nodes), whatever the model's backend: the same posterior as
    ``model.latent_posterior(params)``, with the covariances between nearby grid points as well.

    Args:
        model: a :class:`msrm.GPMSRM`.
        params: its parameters (validated against its data).
        fit_runs: indices of the model's runs.
        half_width: h, the number of grid points the band reaches on each side (counting the point itself).
    Returns:
        list of (J_r, 2 h - 1, K, K) arrays.
    """
    import jax

    from .gp.model import params_to_theta
    from .gp.prepare import prepare

    params.validate(model.data, model.spec)
    entry = _GRID_SOLVES.get(model)
    if entry is None or entry[0] is not model.data or entry[1] is not model.spec:
        entry = (model.data, model.spec, prepare(model.data, model.spec, grouped=True, method="native"),
                 jax.jit(_grid_solve))
        _GRID_SOLVES[model] = entry
    _, _, prepared, solve = entry
    theta = params_to_theta(params)
    bands = []
    for r in fit_runs:
        G, prior = jax.device_get(solve(theta, prepared.runs[r]))
        bands.append(banded_covariance(np.asarray(G), np.asarray(prior), half_width))
    return bands


# ------------------------------------------------------------------------------------------ the projection


def _predict_run(run, spec, params: Params, fixed) -> dict:
    """``{stream key: Prediction}`` of one run's new-participant streams from the fixed latents ``fixed`` =
    (grid, mean (J, K), banded covariance or None): mean ``b + W E[x]``, sd ``sqrt(diag(W Cov[x] W^T) + sigma^2)``
    (the noise sd alone when the latents are a point estimate)."""
    grid, mean, band = fixed
    preds = {}
    for s in run.streams:
        resp = spec.response(s.modality)
        theta = {} if not resp.param_names else params.response[s.modality if spec.pooling == "shared" else s.key]
        m, V = window_moments(s.times, resp, theta, grid, mean, band)
        W, b, sd = params.loadings[s.key], params.intercepts[s.key], params.noise_sd[s.key]
        mu = b[None, :] + m @ W.T
        if V is None:
            preds[s.key] = Prediction(mean=mu, sd=np.broadcast_to(sd[None, :], mu.shape), signal_sd=None,
                                      times=s.times)
        else:
            signal_var = np.maximum(np.einsum("fk,ikl,fl->if", W, V, W), 0.0)
            preds[s.key] = Prediction(mean=mu, sd=np.sqrt(signal_var + sd[None, :] ** 2),
                                      signal_sd=np.sqrt(signal_var), times=s.times)
    return preds


def project_participant(fit, new_data, *, params=None, participant: str | None = None,
                        runs: Sequence[int] | None = None) -> ParticipantProjection:
    """Estimate a new participant's loadings, intercepts, noise sd (and, with individual pooling, response
    parameters) with the fit's latents held fixed, and predict their streams (module docstring).

    Args:
        fit: an R-MSRM fit (:class:`msrm.RFit`) or a GP-MSRM model (:class:`msrm.GPMSRM`).
        new_data: an :class:`msrm.Dataset` whose runs are the fit's runs (by index, or as named by ``runs``), or
            one :class:`msrm.Run`. It holds the new participant's streams (modalities of the fit; any feature
            count, clock and missing values); streams of other participants are ignored when ``participant``
            names the new one, and a run may lack the new participant.
        params: for a GP-MSRM model, its parameters (an :class:`msrm.Params` or a MAP result, e.g.
            ``model.fit_map()``); the latents' posterior is ``model.latent_posterior(params)``. None for an
            R-MSRM fit.
        participant: the new participant's label in ``new_data``; None when ``new_data`` holds one participant.
        runs: the fit's run index of each run of ``new_data``; None matches them by index (then ``new_data``
            has as many runs as the fit).
    Returns:
        :class:`ParticipantProjection` (``params``, ``predictions``, ``variance_explained``, ``latents``, ...).
    Raises:
        ValueError: a fit of another type, missing or superfluous ``params``, a participant label the fit already
            has or that ``new_data`` lacks, runs that do not match the fit's (count or latent grid), a feature
            with fewer than K + 2 observed values, loadings the fixed latents do not identify.
        KeyError: a stream of a modality the fit does not have.
    """
    view = _fit_view(fit, params)
    participant, selected, fit_runs = _select(new_data, participant, runs, view)
    spec = view.spec

    # the fixed latents of the runs used: (grid, mean (J, K), banded covariance (J, 2h - 1, K, K) or None)
    if view.kind == "rmsrm":
        latents = [np.asarray(fit.latents[r], dtype=np.float64) for r in fit_runs]
        fixed = [(view.grids[r], z, None) for r, z in zip(fit_runs, latents)]
    else:
        posterior = fit.latent_posterior(view.params, cov=True)
        latents = [posterior[r] for r in fit_runs]
        # the band must reach across the longest response window of the new participant's streams
        half_width = max(window_layout(np.zeros(1), spec.response(key.split("/", 1)[1]), latents[0].grid).width
                         for key in selected.stream_keys)
        bands = posterior_bands(fit, view.params, fit_runs, half_width)
        fixed = [(lp.grid, lp.mean, band) for lp, band in zip(latents, bands)]

    loadings, intercepts, noise_sd, response, ell, search = {}, {}, {}, {}, {}, {}
    for key in selected.stream_keys:
        modality = key.split("/", 1)[1]
        resp = spec.response(modality)
        if not resp.param_names:
            theta = {}
        elif spec.pooling == "shared":
            theta = dict(view.params.response[modality])
            response[modality] = theta
        else:
            theta, search[key] = _search_theta(key, selected, fixed, resp, spec, _start_theta(view, modality))
            response[key] = theta
        Y, m, V = _stream_moments(key, selected, fixed, resp, theta)
        est = m_step(Y, m, V, key=key)
        loadings[key], intercepts[key] = est.loadings, est.intercepts
        noise_sd[key], ell[key] = np.sqrt(est.noise_var), est.expected_loglik
    new_params = Params(loadings, intercepts, noise_sd, np.asarray(view.params.lengthscales), response)
    new_params.validate(selected, spec, require_lengthscales=False)

    predictions = [_predict_run(run, spec, new_params, fixed[r]) for r, run in enumerate(selected.runs)]
    return ParticipantProjection(participant=participant, params=new_params, predictions=predictions,
                                 latents=latents, runs=fit_runs, data=selected, expected_loglik=ell,
                                 response_search=search, fit=view.label, spec=spec)
