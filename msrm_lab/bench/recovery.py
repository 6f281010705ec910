r"""Recovery benchmark (notebook stem ``recovery``): do the models recover latents and responses of data NOT drawn
from the model, against the methods users pick today?

``recovery_rows(profile)`` builds, for every design and seed of ``SIZES[profile]``, the data of
``data_synth.designs.make_design(design, seed)`` (continuous-time latent paths seen through continuous-time
responses, on each stream's own clock), fits every method of the profile and scores it against the truth with
:mod:`msrm_lab.recovery.metrics`. Methods:

- the peers of :mod:`msrm_lab.peers` (``pca_spline``, ``fa_spline``, ``srm``, ``mefisto``, ``gpfa``), through
  ``run_peer``; latents only (no responses, no predictive distribution);
- ``rmsrm``: ``msrm.fit_rmsrm`` (restarts and iterations per profile, one process); latents ``rfit.latents``,
  responses ``rfit.params.response``;
- ``gp_map``: the documented default path, ``msrm.GPMSRM(data, spec, linear_algebra="state_space")`` with
  ``spec.kernel="auto"`` (the kernel chosen by its marginal likelihood at a shared R-MSRM start,
  :func:`msrm.gp.kernel_choice.resolve_auto_kernel`; a profile's ``gp_kernel`` names a fixed kernel instead),
  fitted by ``fit_map`` from that start with the chosen kernel's fitted lengthscales (with a fixed kernel: from
  the R-MSRM fit of the same data and seed), its lags and widths moved just inside their bounds, where a start
  must lie, to convergence: the profiles leave ``maxiter`` at the library's default (``fit_map``'s, 500 iterations; the fit of
  the small design, seed 0, takes about 200); latents the posterior mean of
  ``model.latent_posterior(map.params, cov=True)``;
- ``nuts`` (designs listed in ``nuts_designs`` only): ``model.sample`` started from that MAP fit; latents the
  pooled posterior mean over the kept draws of ``post.latent_posterior(thin, cov=True)``.

**Sizes.** ``SIZES[profile]`` names the designs, seeds and methods, the fit settings, the seeds a costly method
is restricted to (``method_seeds``), where the cross-validations run, and ``n_jobs``: (design, seed) pairs are
independent, so :func:`recovery_rows` can hand them to worker processes (:func:`design_seed_rows` is one pair).

**The comparison window.** Every latent metric uses the grid points inside the run's observed span less
``drop`` seconds at each end (``metrics.edge_mask``), where a peer's latents are also defined; near the ends every
method extrapolates.

**Rows** (``msrm_lab.bench.rows.make_row``, notebook ``recovery``, experiment ``recovery``), each with params
``profile, design, seed, method, K, n_runs, duration, drop``:

- ``ok`` (1 or 0; param ``error`` holds the reason of a failure or an unavailable peer: the rest still runs) and
  ``wall_s`` (the fit, s);
- ``kernel_chosen`` (GP-MAP: value 1, param ``kernel`` the kernel the automatic choice picked; where the profile
  fixes ``gp_kernel`` it is a ``not_yet_measured`` row naming that kernel, since nothing was chosen);
- ``converged`` (R-MSRM, GP-MAP: 1 or 0, with params ``iterations``, ``iteration_limit`` and ``stop``, how the fit
  stopped). The metrics of a fit that did not converge describe its iteration limit rather than the method, so
  they are rows with ``status="refused"``, no value and that ``reason`` (a GP-MAP fit that did not converge still
  starts NUTS, which needs only a start);
- ``subspace_error`` (:func:`~msrm_lab.recovery.metrics.subspace_error`, forgives any invertible map),
  ``aligned_r2_min`` and ``aligned_r2_mean`` over the true factors (affine least-squares map);
- ``abs_error_<modality>_<param>`` for each fitted response parameter with a true value (MSRM methods);
- per ``mask`` (``"time_blocks"``, ``"features"``) and per held-out ``modality`` (param; each modality has its
  own units, so none is pooled with another), from ``msrm.cross_validate(method="rmsrm"|"map")`` on the seeds
  listed in ``cv_seeds`` (msrm.validation): ``heldout_r2`` (about each feature's in-fold mean),
  ``heldout_lpd`` and, beside it, the naive baseline ``heldout_lpd_naive`` (nats, summed; param ``n_heldout``),
  ``heldout_coverage_50`` and ``heldout_coverage_90`` (fractions of held-out values inside the central
  predictive intervals); and ``cv_wall_s``. A cross-validation with a fold whose fit did not converge is refused
  (``msrm.validation.NotConvergedError``): its rows have ``status="refused"`` and the reason. Peers get these rows
  as ``not_yet_measured`` with a ``reason`` (they estimate latents, not a predictive distribution of held-out
  values);
- ``band_coverage_90`` (GP-MAP, NUTS): the fraction of true (grid point, factor) values inside the 90% band of the
  posterior after an orthogonal Procrustes map of the posterior mean onto the truth
  (:func:`~msrm_lab.recovery.metrics.aligned_band`, exact sd from the per-point K x K covariance), and
  ``band_coverage_90_affine`` after the affine least-squares map instead (which also corrects the scale: the
  difference between the two is the part of the miss that is a scale error); ``posterior_wall_s``;
- ``band_coverage_90_frame`` (GP-MAP): the same band with nothing fitted to the true latents, in the model's own
  frame: the truth carried there through the true and fitted loadings and intercepts
  (:func:`~msrm_lab.recovery.metrics.truth_in_fitted_frame`), the band mean -+ Z90 sd as the model reports it;
- NUTS: per response parameter (lags, and the physiology width) ``interval_hit_90`` (1 if the true value lies
  in the central 90% interval of its draws, bounds in params ``lower``, ``upper``, ``true``),
  ``interval_width_90`` (s), ``r_hat_max`` (several chains) and ``ess_bulk_min``; the response errors use the
  posterior medians; and per (design, parameter) one ``interval_coverage_90`` row over the seeds
  (:func:`~msrm_lab.recovery.metrics.interval_coverage`, with the binomial sd of a 90% coverage over that many
  seeds).

Band of NUTS: at each kept draw d the conditional posterior of the latents is Gaussian (mean m_d, covariance C_d
per point); the same Procrustes (or affine) map A, fitted once to the pooled mean, is applied to every draw
(``m_d A``, ``A^T C_d A``), the draws are pooled by the law of total variance, and the band is the pooled mean
+- 1.645 pooled sd (the normal approximation of the mixture over draws).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from msrm.spec import AUTO_KERNEL

from ..recovery import metrics as rm
from msrm_lab.budget import skip_reason, skipped_rows
from .rows import make_row

__all__ = ["NOTEBOOK", "SIZES", "MSRM_METHODS", "BRAIN_ONLY", "brain_only", "recovery_rows", "design_seed_rows", "fit_methods", "map_start"]

NOTEBOOK = "recovery"
EXPERIMENT = "recovery"
MSRM_METHODS = ("rmsrm", "gp_map", "nuts", "rmsrm_brain", "gp_map_brain")
# the fusion check: the same MSRM fit on the brain streams alone (the modality every design has)
FUSION_BASE = "brain"
BRAIN_ONLY = {"rmsrm_brain": "rmsrm", "gp_map_brain": "gp_map"}
# the peers of msrm_lab.peers.PEERS (named here so that this module imports before that one exists)
_ALL_PEERS = ("pca_spline", "fa_spline", "srm", "mefisto", "gpfa")

# Per profile: designs, seeds, methods; fit settings of R-MSRM (``rmsrm``), GP-MAP (``map``: empty, so that
# fit_map runs to convergence within its default iteration limit) and NUTS (``nuts``, on ``nuts_designs`` only);
# ``method_seeds`` restricts a method to some seeds (the costly MEFISTO); the cross-validation (``cv``: folds,
# masks, which MSRM fits, their settings, ``map_designs`` where the GP-MAP one runs) on ``cv_seeds``; the edge
# margin ``drop`` (s); the (design, seed) the notebook's figure shows; ``n_jobs`` worker processes over
# (design, seed) pairs. R-MSRM's ``max_iter`` is fit_rmsrm's default (100 per phase). A fit that stops at its
# limit anyway is reported, not scored (module docstring, ``converged``).
SIZES: dict[str, dict[str, Any]] = {
    # tests: one small design, one seed, the cheapest peer and both MSRM fits (each converges in a few seconds)
    "smoke": dict(designs=("small",), seeds=(0,), methods=("pca_spline", "rmsrm", "gp_map", "rmsrm_brain"),
                  rmsrm=dict(restarts=1, max_iter=100), map=dict(), nuts=None, nuts_designs=(),
                  method_seeds={},
                  cv=dict(folds=2, masks=("features",), methods=("rmsrm",), rmsrm=dict(restarts=1, max_iter=100),
                          map=dict(), map_designs=()),
                  cv_seeds=(0,), drop=8.0, figure=dict(design="small", seed=0), n_jobs=1),
    # make book: two designs, one seed each (one worker per design), every method but NUTS and MEFISTO (one
    # MEFISTO fit of a 300 s design alone takes most of the quick profile's notebook time limit); GP-MAP fits
    # Matern-7/2, the kernel the note profile's automatic choice picks on these two designs, because the choice (a
    # fit of each candidate's lengthscales) costs twice the MAP fit itself on a 300 s design
    "quick": dict(designs=("baseline", "few_brain"), seeds=(0,),
                  methods=_ALL_PEERS + ("rmsrm", "gp_map", "rmsrm_brain"), gp_kernel="matern72",
                  rmsrm=dict(restarts=2, max_iter=100), map=dict(), nuts=None, nuts_designs=(),
                  method_seeds={"mefisto": ()},
                  cv=dict(folds=3, masks=("features",), methods=("rmsrm",), rmsrm=dict(restarts=1, max_iter=100),
                          map=dict(), map_designs=()),
                  cv_seeds=(0,), drop=8.0, figure=dict(design="baseline", seed=0), n_jobs=2),
    # the note: every design, five seeds; NUTS (300 + 300, one chain) on two seeds of the small design; MEFISTO
    # and the cross-validations on the first seed, GP-MAP's cross-validation on the small design
    "note": dict(designs=("baseline", "few_brain", "fast_dynamics", "missing_brain", "ou_latents", "bumps_hrf",
                          "small"),
                 seeds=(0, 1, 2, 3, 4),
                 methods=_ALL_PEERS + ("rmsrm", "gp_map", "nuts", "rmsrm_brain", "gp_map_brain"),
                 rmsrm=dict(restarts=2, max_iter=100), map=dict(),
                 nuts=dict(num_warmup=300, num_samples=300, num_chains=1, thin=10), nuts_designs=("small",),
                 method_seeds={"mefisto": (0,), "nuts": (0, 1)},
                 cv=dict(folds=3, masks=("time_blocks", "features"), methods=("rmsrm", "map"),
                         rmsrm=dict(restarts=1, max_iter=100), map=dict(), map_designs=("small",)),
                 cv_seeds=(0,), drop=8.0, figure=dict(design="baseline", seed=0), n_jobs=2),
}
SIZES["full"] = SIZES["note"]


# ----------------------------------------------------------------------------------------------------- helpers
def map_start(params, spec):
    """R-MSRM parameters as a MAP start: each lag and width moved just inside its bounds (``1e-6`` of the range,
    :func:`msrm.gp.map.start_inside_bounds`), because a bounded parameter on its bound has no finite
    unconstrained value."""
    from msrm.gp.map import start_inside_bounds

    return start_inside_bounds(params, spec, 1e-6)


def brain_only(data, spec):
    """(data, spec) with the :data:`FUSION_BASE` streams only: every other stream dropped, its responses too, and
    the grid padding fixed at the full spec's (so the latent grid, and the truth on it, stay the same)."""
    import msrm

    runs = []
    for r, run in enumerate(data.runs):
        kept = [s for s in run.streams if s.modality == FUSION_BASE]
        if not kept:
            raise ValueError(f"run {r} has no {FUSION_BASE!r} stream: the fusion check needs one in every run")
        runs.append(msrm.Run(duration=run.duration, streams=kept))
    sub = dataclasses.replace(spec, responses={FUSION_BASE: spec.responses[FUSION_BASE]}, latent_pad=spec.pad)
    return msrm.Dataset(runs), sub


def _masks(data, spec, truth, drop: float) -> list[np.ndarray]:
    from msrm.spec import latent_grid

    return [rm.edge_mask(latent_grid(run.duration, spec), span, drop)
            for run, span in zip(data.runs, truth.observed_span)]


def _bands(truth_latents, means, covs, masks) -> dict[str, Any]:
    """Procrustes and affine 90% bands from per-run means and (J, K, K) covariances."""
    out = {}
    for kind in ("procrustes", "affine"):
        out[kind] = rm.aligned_band(truth_latents, means, masks, cov=covs, map=kind)
    return out


def _frame_band(truth, params, means, covs) -> dict[str, Any]:
    """The 90% band as the model reports it (mean -+ Z90 sd, sd from the diagonal of each point's K x K
    covariance) beside the truth carried into the model's frame through the loadings and intercepts of both
    (:func:`~msrm_lab.recovery.metrics.truth_in_fitted_frame`: nothing fitted to the true latents)."""
    mapped = rm.truth_in_fitted_frame(truth.latents, truth, params)["latents"]
    sds = [np.sqrt(np.maximum(np.einsum("jkk->jk", np.asarray(C, dtype=np.float64)), 0.0)) for C in covs]
    return {"truth": mapped, "lower": [m - rm.Z90 * s for m, s in zip(means, sds)],
            "upper": [m + rm.Z90 * s for m, s in zip(means, sds)]}


def _nuts_bands(truth_latents, lat, masks) -> dict[str, Any]:
    """NUTS bands (module docstring): one map fitted to the pooled mean, applied to every draw, pooled."""
    out = {}
    pooled = [np.asarray(ds["mean"].values) for ds in lat]
    for kind in ("procrustes", "affine"):
        fit = rm.align_to_truth(truth_latents, pooled, masks, map=kind)
        A, c, o = fit["transform"], fit["center"], fit["offset"]
        means, sds = [], []
        for ds in lat:
            m = np.asarray(ds["draws"].values)            # (chain, draw, J, K)
            C = np.asarray(ds["draw_cov"].values)          # (chain, draw, J, K, K)
            m = m.reshape((-1,) + m.shape[2:])
            C = C.reshape((-1,) + C.shape[2:])
            am = (m - c) @ A + o                            # each draw's aligned mean
            av = np.einsum("ki,djkl,li->dji", A, C, A)      # diag(A^T C_d A) per draw and point
            mean = am.mean(axis=0)
            var = np.maximum(av, 0.0).mean(axis=0) + am.var(axis=0)
            means.append(mean)
            sds.append(np.sqrt(var))
        out[kind] = {"mean": means, "sd": sds, "lower": [m - rm.Z90 * s for m, s in zip(means, sds)],
                     "upper": [m + rm.Z90 * s for m, s in zip(means, sds)], "transform": A}
    return out


# ------------------------------------------------------------------------------------------------- the methods
def fit_methods(data, spec, truth, methods, sz: dict, seed: int) -> dict[str, dict]:
    """Fit every method of ``methods`` on one dataset; a method's failure is recorded, never raised.

    R-MSRM is fitted once and is the start of GP-MAP, whose fit is the start of NUTS (a failed start fails the
    methods that need it, with the reason). ``rmsrm_brain`` and ``gp_map_brain`` (:data:`BRAIN_ONLY`) are the
    same two fits on the brain streams alone (:func:`brain_only`), on the same latent grid: the fusion check.

    Returns:
        method -> dict with ``ok``, ``error``, ``wall_s`` (that method's own fit), ``latents`` (per run (J, K),
        NaN allowed outside a peer's span), ``response`` (MSRM methods), ``convergence`` (R-MSRM, GP-MAP:
        ``converged``, ``iterations``, ``iteration_limit``, ``stop``), ``bands`` ({"procrustes", "affine"} ->
        :func:`~msrm_lab.recovery.metrics.aligned_band` result, GP methods), ``posterior_wall_s``, and for NUTS
        ``draws`` ({"modality/param": response parameter draws}) and ``diagnostics`` (r_hat_max, ess_bulk_min).
    """
    import msrm

    masks = _masks(data, spec, truth, sz["drop"])
    out: dict[str, dict] = {}

    for name in methods:
        if name not in _ALL_PEERS:
            continue
        from msrm_lab.peers import run_peer

        t0 = time.perf_counter()
        try:
            res = run_peer(name, data, spec, seed)
        except Exception as exc:  # noqa: BLE001  (a broken peer must not stop the benchmark)
            out[name] = _failure(t0, exc)
            continue
        out[name] = {"ok": bool(res.ok), "error": res.error, "wall_s": float(res.wall_s),
                     "latents": list(res.latents) if res.ok else None}

    if not any(m in methods for m in MSRM_METHODS):
        return out
    rfit = model = mp = None
    if any(m in methods for m in ("rmsrm", "gp_map", "nuts")):
        out["rmsrm"], rfit = _fit_rmsrm(data, spec, sz, seed)
    if "gp_map" in methods or "nuts" in methods:
        out["gp_map"], model, mp = _fit_gp_map(data, spec, truth, masks, sz, seed, out["rmsrm"], rfit)
    if any(m in methods for m in BRAIN_ONLY):
        # the fusion check: the same fits on the brain streams alone, scored against the same truth and grid
        try:
            bdata, bspec = brain_only(data, spec)
        except ValueError as exc:
            for name in BRAIN_ONLY:
                out[name] = _failure(time.perf_counter(), exc)
        else:
            out["rmsrm_brain"], brfit = _fit_rmsrm(bdata, bspec, sz, seed)
            if "gp_map_brain" in methods:
                out["gp_map_brain"], _, _ = _fit_gp_map(bdata, bspec, truth, masks, sz, seed, out["rmsrm_brain"],
                                                        brfit)
    if "nuts" in methods:
        if mp is None:
            out["nuts"] = {**out["gp_map"], "wall_s": 0.0,
                           "error": "its MAP start failed: " + str(out["gp_map"]["error"])}
        else:
            out["nuts"] = _fit_nuts(model, mp, truth, masks, sz["nuts"], seed)
    return {m: out[m] for m in methods}


def _failure(t0, exc) -> dict:
    return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "wall_s": time.perf_counter() - t0}


def _fit_rmsrm(data, spec, sz, seed):
    """(result dict, fit or None): ``msrm.fit_rmsrm`` with the profile's settings (:func:`fit_methods`)."""
    import msrm

    t0 = time.perf_counter()
    try:
        rfit = msrm.fit_rmsrm(data, spec, seed=seed, n_jobs=1, progress=False, **sz["rmsrm"])
    except Exception as exc:  # noqa: BLE001
        return _failure(t0, exc), None
    return {"ok": True, "error": None, "wall_s": time.perf_counter() - t0,
            "latents": list(rfit.latents), "response": dict(rfit.params.response),
            "convergence": {"converged": bool(rfit.converged), "iterations": int(rfit.n_iter),
                            "iteration_limit": int(rfit.settings["max_iter"]),
                            "stop": ("relative change of the objective below tol "
                                     f"{rfit.settings['tol']:g}" if rfit.converged else
                                     f"max_iter={rfit.settings['max_iter']} reached in a phase")}}, rfit


def _fit_gp_map(data, spec, truth, masks, sz, seed, rres, rfit):
    """(result dict, model, MAP fit) of GP-MAP by the default path (module docstring), started from the R-MSRM
    fit ``rfit`` (its result ``rres`` names the failure when it has none); model and fit are None on failure."""
    import msrm

    t0 = time.perf_counter()
    if rfit is None:
        return {**rres, "error": "its R-MSRM start failed: " + str(rres["error"])}, None, None
    try:
        msrm.runtime.enable_x64()
        gspec = dataclasses.replace(spec, kernel=sz.get("gp_kernel", AUTO_KERNEL))
        model = msrm.GPMSRM(data, gspec, linear_algebra="state_space")
        start = (rfit.params if model.selection is None
                 else model.selection.params[(model.spec.kernel, spec.n_factors)])
        mp = model.fit_map(init=map_start(start, model.spec), seed=seed, progress=False, **sz["map"])
        wall = time.perf_counter() - t0
        t1 = time.perf_counter()
        post = model.latent_posterior(mp.params, cov=True)
        means, covs = [p.mean for p in post], [p.cov for p in post]
        d = mp.diagnostics
        return {"ok": True, "error": None, "wall_s": wall, "latents": means, "kernel": model.spec.kernel,
                "kernel_fixed": "gp_kernel" in sz,
                "response": dict(mp.params.response),
                "convergence": {"converged": bool(mp.converged), "iterations": int(d["iterations"]),
                                "iteration_limit": int(d["maxiter"]), "stop": str(d["message"])},
                "bands": _bands(truth.latents, means, covs, masks),
                "frame_band": _frame_band(truth, mp.params, means, covs),
                "posterior_wall_s": time.perf_counter() - t1}, model, mp
    except Exception as exc:  # noqa: BLE001
        return _failure(t0, exc), None, None


def _fit_nuts(model, mp, truth, masks, settings: dict, seed: int) -> dict:
    t0 = time.perf_counter()
    try:
        post = model.sample(num_warmup=settings["num_warmup"], num_samples=settings["num_samples"],
                            num_chains=settings.get("num_chains", 1), seed=seed, init=mp, progress=False)
        wall = time.perf_counter() - t0
        t1 = time.perf_counter()
        thin = max(1, min(int(settings.get("thin", 10)), settings["num_samples"]))
        lat = post.latent_posterior(thin=thin, cov=True, progress=False)
        bands = _nuts_bands(truth.latents, lat, masks)
        draws = np.asarray(post.draws_u)
        lags: dict[str, list[float]] = {}
        for u in draws.reshape(-1, draws.shape[-1]):
            for key, theta in model.constrain(u).response.items():
                for pname, v in theta.items():
                    lags.setdefault(f"{key}/{pname}", []).append(float(v))
        diag = {}
        for col, name, reduce in (("r_hat", "r_hat_max", np.nanmax), ("ess_bulk", "ess_bulk_min", np.nanmin)):
            if post.summary is not None and col in post.summary:
                v = np.asarray(post.summary[col], dtype=np.float64)
                if np.isfinite(v).any():  # one chain has no R-hat
                    diag[name] = float(reduce(v))
        response: dict[str, dict[str, float]] = {}
        for key, v in lags.items():
            k, pname = key.rsplit("/", 1)
            response.setdefault(k, {})[pname] = float(np.median(v))
        return {"ok": True, "error": None, "wall_s": wall, "latents": [np.asarray(ds["mean"].values) for ds in lat],
                "bands": bands, "posterior_wall_s": time.perf_counter() - t1,
                "draws": {k: np.array(v) for k, v in lags.items()}, "diagnostics": diag, "response": response}
    except Exception as exc:  # noqa: BLE001
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "wall_s": time.perf_counter() - t0}


# ------------------------------------------------------------------------------------------------------- rows
# the held-out rows of a cross-validation: metric, unit and the column of CVResult.by_modality it reads
CV_METRICS = (("heldout_r2", "1", "r2"), ("heldout_lpd", "nats", "lpd"), ("heldout_lpd_naive", "nats", "lpd_naive"),
              ("heldout_coverage_50", "1", "coverage_50"), ("heldout_coverage_90", "1", "coverage_90"))


def _cv_rows(data, spec, sz, design, seed, methods, row) -> list[dict]:
    """Held-out scores per mask and modality for the MSRM methods (module docstring); peers: not measured, with
    why; a cross-validation with a fold that did not converge: refused, with why."""
    import msrm
    from msrm.validation import NotConvergedError

    cv = sz["cv"]
    rows = []

    def unscored(method, mask, status, **why):
        for metric, unit, _ in CV_METRICS:
            rows.append(row(metric, None, unit, method=method, mask=mask, status=status, **why))

    for method in methods:
        for mask in cv["masks"]:
            if method in _ALL_PEERS or method == "nuts" or method in BRAIN_ONLY:
                unscored(method, mask, "not_yet_measured",
                         reason=("a peer estimates latents only, with no predictive distribution of held-out values"
                                 if method in _ALL_PEERS else
                                 "cross-validation refits every fold; NUTS is not refitted" if method == "nuts" else
                                 "the brain-only fit is the fusion check's reference for the latents only"))
                continue
            cv_method = "rmsrm" if method == "rmsrm" else "map"
            if cv_method not in cv["methods"] or (cv_method == "map" and design not in cv["map_designs"]):
                unscored(method, mask, "not_yet_measured",
                         reason=f"{method} is not cross-validated on this design in this profile")
                continue
            t0 = time.perf_counter()
            try:
                if cv_method == "rmsrm":
                    res = msrm.cross_validate(data, spec, method="rmsrm", folds=cv["folds"], mask=mask, seed=seed,
                                              n_jobs=1, progress=False, **cv["rmsrm"])
                else:
                    msrm.runtime.enable_x64()
                    res = msrm.cross_validate(data, spec, method="map", folds=cv["folds"], mask=mask, seed=seed,
                                              model_kwargs=dict(linear_algebra="state_space"), **cv["map"])
            except NotConvergedError as exc:
                unscored(method, mask, "refused", reason=str(exc))
                continue
            except Exception as exc:  # noqa: BLE001
                unscored(method, mask, "error", error=f"{type(exc).__name__}: {exc}")
                continue
            wall = time.perf_counter() - t0
            extra = dict(method=method, mask=mask, folds=cv["folds"])
            for modality, scores in res.by_modality.iterrows():
                for metric, unit, column in CV_METRICS:
                    rows.append(row(metric, float(scores[column]), unit, modality=modality,
                                    n_heldout=int(scores["n_heldout"]), **extra))
            rows.append(row("cv_wall_s", wall, "s", **extra))
    return rows


def _finite_masks(masks, latents):
    return [m & np.isfinite(z).all(axis=1) for m, z in zip(masks, latents)]


def _method_rows(name: str, res: dict, truth, masks, row) -> list[dict]:
    rows = [row("ok", 1.0 if res["ok"] else 0.0, "1", method=name, error=res.get("error")),
            row("wall_s", res["wall_s"], "s", method=name)]
    if not res["ok"]:
        return rows
    if res.get("kernel") and res.get("kernel_fixed"):
        rows.append(row("kernel_chosen", None, "1", method=name, kernel=res["kernel"], status="not_yet_measured",
                        reason=f"this profile fits {res['kernel']} instead of choosing a kernel, for its cost"))
    elif res.get("kernel"):
        rows.append(row("kernel_chosen", 1.0, "1", method=name, kernel=res["kernel"]))
    conv = res.get("convergence")
    refused = None
    if conv is not None:
        rows.append(row("converged", 1.0 if conv["converged"] else 0.0, "1", method=name,
                        iterations=conv["iterations"], iteration_limit=conv["iteration_limit"], stop=conv["stop"]))
        if not conv["converged"]:
            refused = (f"the {name} fit did not converge ({conv['iterations']} iterations, limit "
                       f"{conv['iteration_limit']}: {conv['stop']}); its scores would describe the iteration limit")

    def score(metric, value, unit, **params):
        """A metric of the fit: measured, or refused with the reason when the fit did not converge."""
        if refused is not None:
            return row(metric, None, unit, status="refused", reason=refused, method=name, **params)
        return row(metric, value, unit, method=name, **params)

    m = _finite_masks(masks, res["latents"])
    rows.append(score("subspace_error", rm.subspace_error(truth.latents, res["latents"], m), "1"))
    r2 = rm.aligned_r2(truth.latents, res["latents"], m)
    rows.append(score("aligned_r2_min", float(r2.min()), "1"))
    rows.append(score("aligned_r2_mean", float(r2.mean()), "1"))
    if res.get("response"):
        errs = rm.flat_response_errors(rm.response_errors(res["response"], truth.response))
        for key, v in errs.items():
            modality, pname = key.rsplit("/", 1)
            rows.append(score(f"abs_error_{modality.replace('/', '_')}_{pname}", v, "s", modality=modality,
                              parameter=pname))
    if res.get("bands"):
        for kind, metric in (("procrustes", "band_coverage_90"), ("affine", "band_coverage_90_affine")):
            b = res["bands"][kind]
            rows.append(score(metric, rm.band_coverage(truth.latents, b["lower"], b["upper"], masks), "1",
                              alignment=kind, exact_sd=True))
        if res.get("frame_band"):
            fb = res["frame_band"]
            rows.append(score("band_coverage_90_frame", rm.band_coverage(fb["truth"], fb["lower"], fb["upper"], masks),
                              "1", alignment="loadings", exact_sd=True))
        rows.append(row("posterior_wall_s", res["posterior_wall_s"], "s", method=name))
    if res.get("draws"):
        for key, draws in res["draws"].items():
            modality, pname = key.rsplit("/", 1)
            true = truth.response.get(modality.split("/")[-1], {}).get(pname)
            if true is None:
                continue
            lo, hi = rm.central_interval(draws, 0.9)
            rows.append(row("interval_hit_90", rm.interval_coverage(true, [lo], [hi]), "1", method=name,
                            modality=modality, parameter=pname, lower=float(lo), upper=float(hi), true=float(true)))
            rows.append(row("interval_width_90", float(hi - lo), "s", method=name, modality=modality,
                            parameter=pname))
        for metric, v in res.get("diagnostics", {}).items():
            rows.append(row(metric, v, "1", method=name))
    return rows


def design_seed_rows(task: tuple, *, info: dict, sizes: dict | None = None) -> dict:
    """The rows of one ``(profile, design, seed, figure)`` task: every method of the profile fitted and scored.

    A module-level function of one task, so that :func:`recovery_rows` can hand (design, seed) pairs to worker
    processes; ``sizes`` is the profile's entry of :data:`SIZES` (default ``SIZES[profile]``; passed along so a
    worker uses the caller's settings). Returns ``{"rows": [...], "keep": {...} or None}`` (``keep`` as in :func:`recovery_rows`, when
    ``figure`` is true; everything in it pickles, so it comes back from a worker).
    """
    from data_synth.designs import make_design
    from msrm.spec import latent_grid

    profile, design, seed, figure = task
    sz = SIZES[profile] if sizes is None else sizes
    seed = int(seed)
    reason = None if figure else skip_reason()  # the chapter's figure pair always runs
    if reason is not None:
        return {"rows": skipped_rows(NOTEBOOK, EXPERIMENT, reason, info=info, metrics=(("design_wall_s", "s"),),
                                     profile=profile, design=design, seed=seed), "keep": None}
    t0 = time.perf_counter()
    data, spec, truth = make_design(design, seed)
    methods = [m for m in sz["methods"] if m != "nuts" or design in sz["nuts_designs"]]
    only = sz.get("method_seeds", {})
    skipped = [m for m in methods if m in only and seed not in only[m]]
    methods = [m for m in methods if m not in skipped]
    common = dict(profile=profile, design=design, seed=seed, K=int(spec.n_factors), n_runs=len(data.runs),
                  duration=float(data.runs[0].duration), drop=float(sz["drop"]))

    def row(metric, value, unit, *, status="measured", **params):
        return make_row(NOTEBOOK, EXPERIMENT, metric, value, unit, status=status, info=info, **{**common, **params})

    masks = _masks(data, spec, truth, sz["drop"])
    fits = fit_methods(data, spec, truth, methods, sz, seed)
    rows: list[dict] = []
    for name in skipped:
        seeds = tuple(only[name])
        rows.append(row("ok", None, "1", method=name, status="not_yet_measured",
                        reason=(f"{name} runs on seeds {list(seeds)} of this profile only, for its cost" if seeds
                                else f"{name} does not run in this profile, for its cost")))
    for name in methods:
        rows.extend(_method_rows(name, fits[name], truth, masks, row))
    if seed in sz["cv_seeds"]:
        rows.extend(_cv_rows(data, spec, sz, design, seed, methods, row))
    rows.append(row("design_wall_s", time.perf_counter() - t0, "s", method="all"))
    keep = None
    if figure:
        keep = dict(truth=truth, grid=[latent_grid(r.duration, spec) for r in data.runs], mask=masks, fits=fits,
                    spec=spec)
    return {"rows": rows, "keep": keep}


def _cost_rank(sz: dict, design: str, seed: int) -> int:
    """A coarse rank of a pair's cost: NUTS > cross-validation or MEFISTO > the rest."""
    only = sz.get("method_seeds", {})

    def runs(method):
        return method in sz["methods"] and (method not in only or seed in only[method])

    if runs("nuts") and design in sz["nuts_designs"]:
        return 2
    return int(seed in sz["cv_seeds"] or runs("mefisto"))


def recovery_rows(profile: str, *, info=None, keep: dict | None = None, n_jobs: int | None = None) -> list[dict]:
    """Fit and score every (design, seed, method) of ``SIZES[profile]`` (module docstring).

    Args:
        profile: a key of :data:`SIZES` (``"smoke"``, ``"quick"``, ``"note"``, ``"full"``).
        info: ``execution_info()`` to attach to every row (computed once if omitted).
        keep: if a dict, the fits of ``SIZES[profile]["figure"]`` (design, seed) are stored in it:
            ``keep["truth"]`` (DesignTruth), ``keep["grid"]`` and ``keep["mask"]`` (per run), ``keep["fits"]``
            (method -> the dict of :func:`fit_methods`), ``keep["spec"]``, for the notebook's figure.
        n_jobs: worker processes, each fitting whole (design, seed) pairs (``msrm.parallel.run_tasks``, loky);
            1 runs them one after another in this process; None takes the profile's ``n_jobs`` (default 1).
            Every fit inside a pair uses one process.
    Returns:
        the rows (list of dicts): those of every pair in (design, seed) order, then one ``interval_coverage_90`` row
        per (design, method, response parameter) over the seeds where NUTS ran.
    """
    if profile not in SIZES:
        raise ValueError(f"profile must be one of {sorted(SIZES)}, got {profile!r}")
    sz = SIZES[profile]
    n_jobs = int(sz.get("n_jobs", 1)) if n_jobs is None else n_jobs
    if isinstance(n_jobs, bool) or not isinstance(n_jobs, int) or n_jobs < 1:
        raise ValueError(f"n_jobs must be a positive integer, got {n_jobs!r}")
    import functools

    from msrm.parallel import run_tasks

    if info is None:
        from msrm_lab.provenance import execution_info

        info = execution_info()
    fig = sz.get("figure") or {}
    tasks = [(profile, d, int(s), keep is not None and (d, s) == (fig.get("design"), fig.get("seed")))
             for d in sz["designs"] for s in sz["seeds"]]
    fn = functools.partial(design_seed_rows, info=info, sizes=sz)
    # the costliest pairs first (NUTS, then the cross-validated and MEFISTO seeds), so that no worker is left
    # with a long pair at the end while the other idles; the rows come back in (design, seed) order
    order = sorted(range(len(tasks)), key=lambda i: (-_cost_rank(sz, tasks[i][1], tasks[i][2]), i))
    done = run_tasks(fn, [tasks[i] for i in order], n_jobs=n_jobs, backend="sequential" if n_jobs == 1 else "loky")
    results = sorted(zip(order, done))
    rows: list[dict] = []
    lag_hits: dict[tuple, list[float]] = {}
    for _, res in results:
        if res.error is not None:
            raise RuntimeError(f"recovery task {res.task[:3]} failed:\n{res.error}")
        if res.value["keep"] is not None:
            keep.update(res.value["keep"])
        for r in res.value["rows"]:
            rows.append(r)
            if r["metric"] == "interval_hit_90":
                p = r["params"]
                lag_hits.setdefault((p["design"], p["method"], p["modality"], p["parameter"]), []).append(r["value"])
    for (design, name, modality, pname), vals in lag_hits.items():
        rows.append(make_row(NOTEBOOK, EXPERIMENT, "interval_coverage_90", float(np.mean(vals)), "1", info=info,
                             profile=profile, design=design, method=name, modality=modality, parameter=pname,
                             n_seeds=len(vals), binomial_sd=rm.binomial_sd(0.9, len(vals))))
    return rows
