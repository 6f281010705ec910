"""Latent posterior and posterior predictions: their cost beside the gradient of the same model.

:func:`latent_rows` times ``GPMSRM.latent_posterior`` + ``GPMSRM.predict`` (one "posterior" call is both) and
``GPMSRM.value_and_grad`` of the same model, side by side in one process (the calls alternate, after one compiling
call each; :func:`msrm_lab.bench.measure.side_by_side`), and the peak memory each adds to the process
(:class:`msrm_lab.bench.measure.PeakMemory`, measured around one warm call). For ``state_space`` the posterior is
the RTS smoother of :mod:`msrm.gp.state_space.smoother`; ``grouped`` is measured beside it where asked (the
one-eighth case), with the agreement of the two posteriors. Rows belong to notebook ``"latent"``, experiment
``"posterior"``:

* ``posterior_median_s``, ``value_and_grad_median_s``: warm medians (s), with the samples (the posterior calls
  alternate between two parameter sets so that no call is served from the backend's cache of its last result);
* ``posterior_over_value_and_grad``: the ratio of those medians (x);
* ``posterior_added_bytes``, ``value_and_grad_added_bytes``: the peak resident memory each call adds (bytes);
* ``prediction_bytes``: the bytes of the returned prediction arrays (mean, sd, signal sd: the size of the output
  itself, part of what the posterior call adds);
* ``max_abs_difference_to_grouped``: the largest difference of latent means, latent sds and predictive means
  between the backends (where grouped runs);
* a backend whose posterior is not built is recorded as ``not_yet_measured``; one that fails as ``error``.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

from .measure import PeakMemory, side_by_side
from msrm_lab.budget import skip_reason, skipped_rows
from .rows import make_row

__all__ = ["NOTEBOOK", "SIZES", "latent_rows"]

NOTEBOOK = "latent"

SIZES: dict[str, dict[str, Any]] = {
    "smoke": dict(profile="tiny", n_features=3, repeats=1,
                  cases=[dict(K=2, duration_scale=1.0, backends=("state_space", "grouped"))]),
    "quick": dict(profile="one-eighth", n_features=36, repeats=3,
                  cases=[dict(K=3, duration_scale=1.0, backends=("state_space", "grouped")),
                         dict(K=5, duration_scale=8.0, backends=("state_space",))]),
    # the note's shape: one-eighth K = 3 beside grouped, and the 8x recording at K = 5 (grouped does not fit)
    "note": dict(profile="one-eighth", n_features=3600, repeats=5,
                 cases=[dict(K=3, duration_scale=1.0, backends=("state_space", "grouped")),
                        dict(K=5, duration_scale=8.0, backends=("state_space",))]),
}


def _posterior(model, params):
    return model.latent_posterior(params), model.predict(params)


def _prediction_bytes(preds) -> int:
    return int(sum(a.nbytes for per_run in preds for p in per_run.values()
                   for a in (p.mean, p.sd, p.signal_sd) if a is not None))


def _difference(a, b) -> float:
    """Largest difference of latent means and sds and of predictive means between two posterior results."""
    import numpy as np

    (za, pa), (zb, pb) = a, b
    worst = 0.0
    for x, y in zip(za, zb):
        worst = max(worst, float(np.max(np.abs(x.mean - y.mean))), float(np.max(np.abs(x.sd - y.sd))))
    for x, y in zip(pa, pb):
        for key in x:
            worst = max(worst, float(np.max(np.abs(x[key].mean - y[key].mean))))
    return worst


def _case_rows(sz: dict, case: dict, info) -> list[dict]:
    import data_synth
    import msrm

    data, truth = data_synth.synthetic_dataset(sz["profile"], n_features=sz["n_features"],
                                               duration_scale=case["duration_scale"], n_factors=case["K"], seed=0)
    params = truth.params
    base = dict(K=case["K"], duration_scale=case["duration_scale"], n_features=sz["n_features"],
                profile=sz["profile"])
    rows, results = [], {}
    for backend in case["backends"]:
        tag = dict(base, backend=backend)
        model = msrm.GPMSRM(data, truth.spec, linear_algebra=backend)
        u = model.unconstrain(params)
        t0 = time.perf_counter()
        try:
            result = _posterior(model, params)
        except NotImplementedError as exc:
            rows.append(make_row(NOTEBOOK, "posterior", "posterior_median_s", None, "s", status="not_yet_measured",
                                 info=info, reason=str(exc), **tag))
            continue
        except Exception as exc:  # recorded, not raised: the other backend's rows still count
            rows.append(make_row(NOTEBOOK, "posterior", "posterior_median_s", None, "s", status="error",
                                 info=info, reason=f"{type(exc).__name__}: {exc}", **tag))
            continue
        first = time.perf_counter() - t0
        results[backend] = result
        # Both backends keep their last posterior (latent_posterior then predict at the same parameters share one
        # pass), so the timed calls alternate between two parameter sets: every timed call computes afresh.
        pair = [params, dataclasses.replace(params, lengthscales=params.lengthscales * 1.01)]
        turn = iter(range(10**9))
        times = side_by_side({"posterior": lambda: _posterior(model, pair[next(turn) % 2]),
                              "value_and_grad": lambda: model.value_and_grad(u)}, repeats=sz["repeats"])
        med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
        with PeakMemory() as pm_post:
            out = _posterior(model, pair[next(turn) % 2])
        n_bytes = _prediction_bytes(out[1])
        del out
        with PeakMemory() as pm_vg:
            model.value_and_grad(u)
        rows += [
            make_row(NOTEBOOK, "posterior", "posterior_median_s", med["posterior"], "s", info=info,
                     samples=times["posterior"], first_call_s=first, **tag),
            make_row(NOTEBOOK, "posterior", "value_and_grad_median_s", med["value_and_grad"], "s", info=info,
                     samples=times["value_and_grad"], **tag),
            make_row(NOTEBOOK, "posterior", "posterior_over_value_and_grad", med["posterior"] / med["value_and_grad"],
                     "x", info=info, **tag),
            make_row(NOTEBOOK, "posterior", "posterior_added_bytes", pm_post.delta_bytes, "bytes", info=info,
                     method=pm_post.method, **tag),
            make_row(NOTEBOOK, "posterior", "value_and_grad_added_bytes", pm_vg.delta_bytes, "bytes", info=info,
                     method=pm_vg.method, **tag),
            make_row(NOTEBOOK, "posterior", "prediction_bytes", n_bytes, "bytes", info=info, **tag),
        ]
        del model
    if "state_space" in results and "grouped" in results:
        rows.append(make_row(NOTEBOOK, "posterior", "max_abs_difference_to_grouped",
                             _difference(results["state_space"], results["grouped"]), "", info=info, **base))
    return rows


def latent_rows(size: str, *, info=None, progress=None) -> list[dict]:
    """Every case of ``SIZES[size]``: posterior (latent_posterior + predict) and value+grad timings, their ratio,
    the peak memory each adds and the output size, per backend; the state-space / grouped agreement.

    Args:
        size: a key of :data:`SIZES`.
        info: ``execution_info()`` for the rows (computed per row if None).
        progress: optional callable given a short message before each case.
    """
    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    sz = SIZES[size]
    rows: list[dict] = []
    for i, case in enumerate(sz["cases"]):
        reason = skip_reason() if i else None  # the first case always runs: the chapter's figure reads it
        if reason is not None:
            rows += skipped_rows(NOTEBOOK, "posterior", reason, info=info, metrics=(("posterior_median_s", "s"),),
                                 K=case["K"], duration_scale=case["duration_scale"], profile=size)
            continue
        if progress is not None:
            progress(f"latent posterior: K={case['K']}, duration x{case['duration_scale']:g}")
        rows += _case_rows(sz, case, info)
    return rows
