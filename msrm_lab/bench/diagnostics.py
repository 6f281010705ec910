"""Posterior diagnostics at the note's scale: msrm.diagnostics beside ArviZ on the same draws, in one process.

The note's diagnostics phase ran ArviZ on 15 draws of 57,757 parameters. Here the implementations see identical
seeded draws (AR(1) chains whose autocorrelation varies by parameter, so ESS and
R-hat are not trivial): ``msrm.diagnostics.summarize`` on every parameter, ``arviz.summary`` on every parameter or,
where that would take too long for the profile, on a leading subset, reported per parameter. The subset also yields
the largest relative difference between the two (an agreement fingerprint, expected <= 1e-8). The first call of
``msrm.diagnostics``, which compiles its Numba kernels or loads them from Numba's cache, is recorded on its own
(``msrm_first_call_seconds``).

ArviZ 0.23 and 1.x both work. ArviZ 1.x's ``summary`` computes its tail ESS at other quantiles than the usual
5%/95% (Vehtari et al. 2021, ArviZ 0.23, ``msrm.diagnostics``); under 1.x the agreement fingerprint therefore
compares the tail ESS with ``arviz.ess(method="tail", prob=(0.05, 0.95))``, computed after the timed summary.
"""
from __future__ import annotations

import time
import warnings
from typing import Any

import numpy as np

from .measure import PeakMemory
from .rows import make_row

__all__ = ["SIZES", "ar1_draws", "diagnostics_rows"]

NOTEBOOK = "gradient_nuts"

#: cases: (label, chains, draws); n_params parameters each; ArviZ on ``arviz_params`` of them (None: all)
SIZES: dict[str, dict[str, Any]] = {
    "smoke": dict(n_params=2_000, cases=[("target", 4, 100), ("note_case", 1, 15)], arviz_params=20),
    "quick": dict(n_params=57_757, cases=[("target", 4, 1000), ("note_case", 1, 15)], arviz_params=100),
    "note": dict(n_params=57_757, cases=[("target", 4, 1000), ("note_case", 1, 15)], arviz_params=1000),
    "full": dict(n_params=57_757, cases=[("target", 4, 1000), ("note_case", 1, 15)], arviz_params=None),
}
TARGET_S = 5.0  # the target: 57,757 parameters x 4 chains x 1000 draws in <= 5 s on the 2-core machine


def ar1_draws(chains: int, draws: int, n_params: int, seed: int = 0) -> np.ndarray:
    """(chains, draws, n_params) AR(1) draws, coefficient phi_p uniform in [0, 0.9] per parameter, unit variance."""
    rng = np.random.default_rng(seed)
    phi = rng.uniform(0.0, 0.9, n_params)
    scale = np.sqrt(1.0 - phi**2)
    x = np.empty((chains, draws, n_params))
    x[:, 0] = rng.standard_normal((chains, n_params))
    for t in range(1, draws):
        x[:, t] = phi * x[:, t - 1] + scale * rng.standard_normal((chains, n_params))
    return x


def _arviz_1() -> bool:
    import arviz as az

    return int(az.__version__.split(".")[0]) >= 1


def _arviz_summary(x: np.ndarray):
    import logging

    import arviz as az

    idata = az.from_dict({"posterior": {"x": x}}) if _arviz_1() else az.from_dict(posterior={"x": x})
    log = logging.getLogger("arviz")
    level = log.level
    log.setLevel(logging.ERROR)  # one chain: ArviZ logs a shape warning per parameter (R-hat is NaN)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return az.summary(idata, round_to="none")
    finally:
        log.setLevel(level)


def _arviz_tail_ess(x: np.ndarray) -> np.ndarray:
    """ArviZ 1.x's tail ESS of every parameter at the 5% and 95% quantiles (the definition of the other columns)."""
    import arviz as az

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return np.asarray(az.ess(x, method="tail", prob=(0.05, 0.95)), dtype=float).reshape(-1)


def diagnostics_rows(profile: str = "quick", *, info: dict | None = None, seed: int = 0) -> list[dict]:
    """Rows of experiment ``diagnostics`` for every case of the profile."""
    from msrm import diagnostics as diag
    from msrm.runtime import blas_threads, execution_info

    if profile not in SIZES:
        raise ValueError(f"profile must be one of {sorted(SIZES)}, got {profile!r}")
    cfg = SIZES[profile]
    info = info if info is not None else execution_info()
    P = cfg["n_params"]
    rows: list[dict] = []
    for case, chains, draws in cfg["cases"]:
        x = ar1_draws(chains, draws, P, seed=seed)
        common = dict(case=case, n_params=P, chains=chains, draws=draws, profile=profile,
                      num_threads=blas_threads())

        def row(metric, value, unit, **extra):
            rows.append(make_row(NOTEBOOK, "diagnostics", metric, value, unit, info=info, **common, **extra))

        def agreement(metric, got, want, **extra):
            """Largest relative difference of the ESS, MCSE and R-hat columns, or an error row when the two
            disagree on which entries are finite."""
            worst = 0.0
            for col in ("mcse_mean", "mcse_sd", "ess_bulk", "ess_tail", "r_hat"):
                a, b = got[col].to_numpy(dtype=float), want[col].to_numpy(dtype=float)
                ok = np.isfinite(a) & np.isfinite(b)
                if not np.array_equal(np.isfinite(a), np.isfinite(b)):
                    worst = np.inf
                elif ok.any():
                    worst = max(worst, float(np.max(np.abs(a[ok] - b[ok]) / np.abs(b[ok]))))
            if np.isfinite(worst):
                row(metric, worst, "", **extra)
            else:
                rows.append(make_row(NOTEBOOK, "diagnostics", metric, None, "", status="error", info=info,
                                     **common, **extra, error="NaN patterns differ"))

        impl = "msrm.diagnostics"
        t0 = time.perf_counter()
        diag.summarize(x[:, :, : min(P, 256)])  # warm the code paths (kernel compilation or cache, FFT plans)
        row("msrm_first_call_seconds", time.perf_counter() - t0, "s", implementation=impl, warm_params=min(P, 256))
        with PeakMemory() as mem:
            t0 = time.perf_counter()
            ours = diag.summarize(x)
            ours_s = time.perf_counter() - t0
        row("msrm_seconds", ours_s, "s", implementation=impl)
        row("msrm_seconds_per_param", ours_s / P, "s", implementation=impl)
        if mem.delta_bytes is not None:
            row("msrm_peak_memory_delta", mem.delta_bytes, "bytes", implementation=impl, memory_method=mem.method)
        if case == "target":
            row("msrm_seconds_over_target", ours_s / TARGET_S, "x", target_s=TARGET_S)

        n_az = P if cfg["arviz_params"] is None else min(P, cfg["arviz_params"])
        _arviz_summary(x[:, :, :2])  # warm ArviZ too (lazy imports, ufunc set-up)
        t0 = time.perf_counter()
        ref = _arviz_summary(x[:, :, :n_az])
        az_s = time.perf_counter() - t0
        if _arviz_1():
            ref["ess_tail"] = _arviz_tail_ess(x[:, :, :n_az])
        row("arviz_seconds", az_s, "s", implementation="arviz.summary", arviz_params=n_az)
        row("arviz_seconds_per_param", az_s / n_az, "s", implementation="arviz.summary", arviz_params=n_az)
        row("arviz_projected_seconds_all_params", az_s / n_az * P, "s", implementation="arviz.summary",
            arviz_params=n_az, projected=n_az < P)
        row("speedup_per_param", (az_s / n_az) / (ours_s / P), "x", arviz_params=n_az)
        agreement("max_rel_diff_vs_arviz", ours.iloc[:n_az], ref, arviz_params=n_az)
        del x
    return rows
