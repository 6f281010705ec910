"""The accuracy contract swept: every backend's log density, gradient and latent posterior in the numerical corners
against the 50-digit reference of :mod:`msrm_lab.precision`.

Each case is the one-factor, one-stream model of :func:`msrm_lab.precision.corner_case` with the parameters that
drew its data. The sweep moves one quantity at a time away from a well-scaled baseline (loading 1, offset 0,
noise sd 0.5, lengthscale 4 grid steps):

* ``snr``: loading / noise from 1e-2 to 1e5 (noise 0.5);
* ``offset``: intercept / noise up to 1e9;
* ``lengthscale``: lengthscale / grid step from 0.5 to 1e3, with the noise at 1e-3 of the signal (a smooth,
  nearly noise-free latent is where the prior's conditioning matters);
* ``noise``: noise down to 1e-6 of the signal (lengthscale 4 steps).

The contract (DESIGN.md): log density within ``max(1e-6 |ref|, 1e-3)`` nats, each gradient component within
``1e-5`` of central differences of the reference relative to the largest component, latent posterior mean within
``1e-6`` posterior sd and sd within ``1e-6`` relative. A case's **outcome** is ``within`` (every checked quantity
meets it), ``warned`` (a :class:`msrm.gp.accuracy.NumericalAccuracyWarning` or another warning naming the cause
was issued), ``raised`` (a ``ValueError`` or ``FloatingPointError`` naming the cause) or ``silent``: outside the
contract with nothing said. The target is zero ``silent`` cases for every backend.
"""
from __future__ import annotations

import dataclasses
import time
import warnings

import numpy as np

from msrm_lab.budget import skip_reason, skipped_rows

from .rows import make_row

__all__ = ["SIZES", "AXES", "sweep_cases", "check_case", "accuracy_rows", "DENSITY_RTOL", "DENSITY_ATOL",
           "GRAD_RTOL", "LATENT_RTOL"]

NOTEBOOK = "reliability"
DENSITY_RTOL, DENSITY_ATOL, GRAD_RTOL, LATENT_RTOL = 1e-6, 1e-3, 1e-5, 1e-6

BASE = dict(loading=1.0, offset=0.0, noise_sd=0.5, lengthscale=4.0)
AXES = {
    "snr": [1e-2, 1.0, 1e2, 1e3, 1e4, 1e5],
    "offset": [1e3, 1e6, 1e9],
    "lengthscale": [0.5, 5.0, 50.0, 1e3],
    "noise": [1e-2, 1e-4, 1e-6],
}

SIZES = {
    "smoke": dict(kernels=("matern32",), axes={"snr": [1.0, 1e4], "offset": [1e9]}, backends=("grouped",),
                  gradient=False, latent=False),
    "quick": dict(kernels=("matern52",), axes=AXES, backends=("dense", "grouped", "state_space"),
                  gradient=False, latent=False),
    "note": dict(kernels=("matern12", "matern32", "matern52", "matern72"), axes=AXES,
                 backends=("dense", "grouped", "state_space"), gradient=True, latent=True),
}
SIZES["full"] = SIZES["note"]


def sweep_cases(axes: dict, kernels) -> list[dict]:
    """The cases of a sweep: one dict of :func:`~msrm_lab.precision.corner_case` arguments per (axis, value,
    kernel), plus ``axis`` and ``ratio`` (the swept quantity's value)."""
    out = []
    for kernel in kernels:
        for axis, values in axes.items():
            for ratio in values:
                kw = dict(BASE, kernel=kernel)
                if axis == "snr":
                    kw["loading"] = ratio * kw["noise_sd"]
                elif axis == "offset":
                    kw["offset"] = ratio * kw["noise_sd"]
                elif axis == "lengthscale":
                    kw.update(lengthscale=ratio, noise_sd=1e-3)
                elif axis == "noise":
                    kw["noise_sd"] = ratio * kw["loading"]
                else:
                    raise ValueError(f"unknown sweep axis {axis!r}")
                out.append(dict(kw, axis=axis, ratio=float(ratio)))
    return out


def _perturbed(params, leaf: str, h: float):
    if leaf == "lengthscales":
        return dataclasses.replace(params, lengthscales=params.lengthscales + h)
    return dataclasses.replace(params, **{leaf: {k: v + h for k, v in getattr(params, leaf).items()}})


_LEAVES = ("loadings", "intercepts", "noise_sd", "lengthscales")


def reference(case: dict, *, gradient: bool, latent: bool) -> dict:
    """The 50-digit density (and, if asked, its central-difference gradient and the latent posterior) of a case."""
    from msrm_lab.precision import corner_case, mp_latent_posterior, mp_loglik

    kw = {k: v for k, v in case.items() if k not in ("axis", "ratio")}
    data, spec, params = corner_case(**kw)
    out = {"data": data, "spec": spec, "params": params, "loglik": float(mp_loglik(data, spec, params))}
    if gradient:
        grad = []
        for leaf in _LEAVES:
            value = float(np.ravel(params.lengthscales if leaf == "lengthscales" else getattr(params, leaf)["p0/brain"])[0])
            h = float((value + 1e-7 * max(abs(value), 1e-3)) - value)  # exactly representable step
            fp = mp_loglik(data, spec, _perturbed(params, leaf, h))
            fm = mp_loglik(data, spec, _perturbed(params, leaf, -h))
            grad.append(float((fp - fm) / (2 * h)))
        out["grad"] = np.array(grad)
    if latent:
        (_, mean, sd), = mp_latent_posterior(data, spec, params)
        out["latent_mean"], out["latent_sd"] = mean, sd
    return out


def check_case(ref: dict, backend: str, *, gradient: bool, latent: bool) -> dict:
    """One backend on one case: its errors against ``ref`` and the outcome (module docstring)."""
    import jax

    import msrm
    from msrm.gp.model import params_to_theta

    data, spec, params = ref["data"], ref["spec"], ref["params"]
    result = {"backend": backend, "density_error_nats": None, "gradient_error": None, "latent_mean_error": None,
              "latent_sd_error": None, "message": ""}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            model = msrm.GPMSRM(data, spec, linear_algebra=backend)
            value = model.log_likelihood(params)
            result["density_error_nats"] = float(value - ref["loglik"])
            ok = abs(value - ref["loglik"]) <= max(DENSITY_RTOL * abs(ref["loglik"]), DENSITY_ATOL)
            if gradient:
                g = jax.grad(lambda th: model.backend.loglik(th, model.prepared)[0])(params_to_theta(params))
                got = np.array([float(np.ravel(g[leaf] if leaf == "lengthscales" else g[leaf]["p0/brain"])[0])
                                for leaf in _LEAVES])
                err = float(np.max(np.abs(got - ref["grad"])) / np.max(np.abs(ref["grad"])))
                result["gradient_error"] = err
                ok = ok and err <= GRAD_RTOL
            if latent:
                post, = model.latent_posterior(params)
                sd = ref["latent_sd"]
                result["latent_mean_error"] = float(np.max(np.abs(post.mean - ref["latent_mean"]) / sd))
                result["latent_sd_error"] = float(np.max(np.abs(post.sd - sd) / sd))
                ok = ok and max(result["latent_mean_error"], result["latent_sd_error"]) <= LATENT_RTOL
            events = {k: v for k, v in model.guard_events().items() if k != 0}
        except (ValueError, FloatingPointError, np.linalg.LinAlgError) as exc:
            result.update(outcome="raised", message=f"{type(exc).__name__}: {exc}")
            return result
    said = [str(w.message) for w in caught if not issubclass(w.category, DeprecationWarning)]
    if ok:
        result["outcome"] = "within"
    elif said or events:
        result["outcome"] = "warned"
    else:
        result["outcome"] = "silent"
    result["message"] = "; ".join(said)[:300]
    return result


def accuracy_rows(size: str, *, info=None) -> tuple[list[dict], list[dict]]:
    """Run the sweep of ``size`` (:data:`SIZES`); return (rows, details).

    Rows: per (case, backend) the density error in nats (and, in profiles that check them, the gradient and latent
    errors) with the outcome in the row's parameters; per backend the count of checked cases by outcome
    (``silent_cases`` is the one the contract requires to be zero) and the sweep's wall time. Under a notebook time
    budget (:mod:`msrm_lab.budget`) a case that would start after it is not checked: it gets a ``not_yet_measured``
    row naming it, and ``cases_skipped_for_budget`` counts them; details hold the checked cases only.
    """
    sz = SIZES[size]
    cases = sweep_cases(sz["axes"], sz["kernels"])
    rows, details = [], []
    start = time.perf_counter()
    done = skipped = 0
    for case in cases:
        # a case is skipped once the notebook's budget cannot hold another of the mean duration so far
        reason = skip_reason((time.perf_counter() - start) / done if done else 0.0)
        if reason is not None:
            skipped += 1
            rows += skipped_rows(NOTEBOOK, "accuracy", reason, info=info, metrics=(("density_error_nats", "nats"),),
                                 axis=case["axis"], ratio=case["ratio"], kernel=case["kernel"], profile=size)
            continue
        done += 1
        ref = reference(case, gradient=sz["gradient"], latent=sz["latent"])
        for backend in sz["backends"]:
            res = check_case(ref, backend, gradient=sz["gradient"], latent=sz["latent"])
            detail = dict(case, reference_loglik=ref["loglik"], **res)
            details.append(detail)
            params = dict(axis=case["axis"], ratio=case["ratio"], kernel=case["kernel"], backend=backend,
                          outcome=res["outcome"])
            for metric, unit in (("density_error_nats", "nats"), ("gradient_error", "relative"),
                                 ("latent_mean_error", "posterior sd"), ("latent_sd_error", "relative")):
                if res[metric] is not None:
                    rows.append(make_row(NOTEBOOK, "accuracy", metric, res[metric], unit, info=info, **params))
            if res["outcome"] == "raised":
                rows.append(make_row(NOTEBOOK, "accuracy", "density_error_nats", None, "nats", status="refused",
                                     info=info, reason=res["message"][:300], **params))
    for backend in sz["backends"]:
        mine = [d for d in details if d["backend"] == backend]
        for outcome in ("within", "warned", "raised", "silent"):
            rows.append(make_row(NOTEBOOK, "accuracy_summary", f"{outcome}_cases",
                                 sum(d["outcome"] == outcome for d in mine), "cases", info=info, backend=backend))
    rows.append(make_row(NOTEBOOK, "accuracy_summary", "sweep_wall_s", time.perf_counter() - start, "s", info=info,
                         cases=done, backends=len(sz["backends"])))
    if skipped:
        rows.append(make_row(NOTEBOOK, "accuracy_summary", "cases_skipped_for_budget", skipped, "cases", info=info,
                             of=len(cases)))
    return rows, details
