"""GP-MSRM grouped likelihood benchmarks (notebook ``03_gp_grouped``, stem ``gp_grouped``).

All in one process, float64, warm medians after compilation with outputs synchronised:

==================  ==================================================================================
experiment          what is measured
==================  ==================================================================================
value_and_grad      ``GPMSRM.value_and_grad`` (grouped) per K, beside the floor: POTRF+POTRI of an SPD matrix
                    of the same dimension N K, the two called alternately (SciPy LAPACK at msrm's BLAS threads on the CPU platform; JAX
                    Cholesky + triangular inverse on an accelerator); ``ratio_to_floor`` (target <= 2) and
                    peak memory of the call.
parts               the stages of one evaluation at the smallest K: sufficient statistics, covariance assembly
                    (C_k = A K_k A^T and M = I + R C R^T), factorization (quad_logdet value), inverse (its
                    reverse rule: value+gradient minus value), the whole log density, and the backward pass
                    (value_and_grad minus the log density).
feature_sweep       value_and_grad against the brain feature count (the models' calls alternate);
                    ``added_fraction`` relative to the smallest count (target <= 0.10 from 360 to 3600 features).
threads             value_and_grad with the LAPACK callback at 1..physical-core BLAS threads (CPU only).
host_memory         value_and_grad and the floor with the host allocator in glibc's own mode (``system``: every
                    block over 32 MiB freshly mapped and page-faulted) and in msrm's ``reuse`` mode, side by side;
                    the process's configured mode is restored afterwards.
fingerprint         the log density to 17 significant digits and named gradient entries at a seeded parameter
                    vector (the synthetic truth of seed 0): CPU/GPU agreement rows.
==================  ==================================================================================

Profiles: ``smoke`` (tiny design, seconds), ``quick`` (one-eighth design at half length and 360 features,
minutes on 2 cores), ``note`` (the note's one-eighth case: 3600 features, K = 3 and 5).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from msrm.runtime import physical_cores

from msrm_lab.budget import skip_reason, skipped_rows
from msrm_lab.provenance import execution_info
from .measure import PeakMemory, side_by_side, warm_median
from .rows import make_row, write_rows

__all__ = ["NOTEBOOK", "PROFILES", "build_case", "floor_function", "value_and_grad_rows",
           "parts_rows", "feature_sweep_rows", "threads_rows", "host_memory_rows", "fingerprint_rows", "run"]

NOTEBOOK = "gp_grouped"

PROFILES: dict[str, dict[str, Any]] = {
    "smoke": {"profile": "tiny", "duration_scale": 1.0, "n_features": 4, "factors": (3,), "sweep": (4, 40),
              "repeats": 2, "threads": False},
    "quick": {"profile": "one-eighth", "duration_scale": 0.5, "n_features": 360, "factors": (3, 5),
              "sweep": (36, 360), "repeats": 3, "threads": True},
    "note": {"profile": "one-eighth", "duration_scale": 1.0, "n_features": 3600, "factors": (3, 5),
             "sweep": (360, 1200, 3600), "repeats": 5, "threads": True},
}
PROFILES["full"] = PROFILES["note"]
# the device run (msrm_lab.device) on one GPU: the note's one-eighth case, K = 3 and 5; no CPU thread sweep
PROFILES["device"] = {"profile": "one-eighth", "duration_scale": 1.0, "n_features": 3600, "factors": (3, 5),
                      "sweep": (360, 1200, 3600), "repeats": 3, "threads": False}

FINGERPRINT_ENTRIES = ("lengthscales[0]", "response/rating/lag", "response/physio/width", "noise_sd/p1/brain[0]",
                       "loadings/p1/brain[0,0]", "intercepts/p5/rating[0]")


_CASES: dict = {}  # models built during one run() (experiments share them; cleared when run() returns)


def build_case(cfg: dict, n_factors: int, n_features: int | None = None, seed: int = 0):
    """(model, u, truth) for a profile: the synthetic study, a grouped GPMSRM and u at the true parameters."""
    key = (id(cfg), n_factors, n_features or cfg["n_features"], seed)
    if key not in _CASES:
        _CASES[key] = _build_case(cfg, n_factors, n_features, seed)
    return _CASES[key]


def _build_case(cfg: dict, n_factors: int, n_features: int | None, seed: int):
    import data_synth
    from msrm.gp.model import GPMSRM

    data, truth = data_synth.synthetic_dataset(cfg["profile"], n_features=n_features or cfg["n_features"],
                                               duration_scale=cfg["duration_scale"], n_factors=n_factors, seed=seed)
    model = GPMSRM(data, truth.spec, "grouped")
    return model, model.unconstrain(truth.params), truth


def floor_function(n: int, seed: int = 0) -> tuple[Any, str]:
    """``(fn, method)``: one call of ``fn()`` is POTRF+POTRI at dimension ``n``, the floor of a value+gradient.

    On the CPU platform: SciPy LAPACK at msrm's BLAS threads on a Fortran-ordered SPD matrix (so that no
    transposing copy is timed; POTRF copies its input once, as the likelihood's own callback does). Elsewhere:
    JAX Cholesky and a triangular inverse, outputs synchronised by the caller.
    """
    import jax

    from msrm import runtime
    from .linalg import spd_matrix

    M = np.asfortranarray(spd_matrix(n, seed))
    if jax.default_backend() == "cpu":
        from scipy.linalg import lapack
        from threadpoolctl import threadpool_limits

        def fn():
            with threadpool_limits(limits=runtime.blas_threads(), user_api="blas"):
                U, _ = lapack.dpotrf(M, lower=0, clean=1, overwrite_a=0)
                lapack.dpotri(U, lower=0, overwrite_c=1)

        return fn, f"scipy dpotrf+dpotri, {runtime.blas_threads()} BLAS threads"
    import jax.numpy as jnp
    import jax.scipy.linalg as jsl

    Mj = jnp.asarray(M)

    @jax.jit
    def chol_inv(A):
        L = jnp.linalg.cholesky(A)
        Li = jsl.solve_triangular(L, jnp.eye(A.shape[0], dtype=A.dtype), lower=True)
        return Li.T @ Li

    return (lambda: chol_inv(Mj)), "jax cholesky + triangular inverse"


def _sizes(model) -> dict:
    return dict(n_nodes=sum(model.node_counts), NK=max(model.factorization_dims), num_params=model.num_params,
                n_observed=model.data.n_observed)


def value_and_grad_rows(cfg, profile, info, repeats) -> list[dict]:
    rows = []
    for K in cfg["factors"]:
        model, u, _ = build_case(cfg, K)
        t0 = time.perf_counter()
        model.value_and_grad(u)
        first = time.perf_counter() - t0
        with PeakMemory() as pm:
            model.value_and_grad(u)
        sz = dict(K=K, n_features=cfg["n_features"], profile=profile, **_sizes(model))
        floor_fn, method = floor_function(sz["NK"])
        # the two sides alternate, so that both see the same machine state (load, caches, allocator)
        t = side_by_side({"value_and_grad": lambda: model.value_and_grad(u), "floor": floor_fn}, repeats)
        med, floor = float(np.median(t["value_and_grad"])), float(np.median(t["floor"]))
        rows += [
            make_row(NOTEBOOK, "value_and_grad", "median_s", med, "s", info=info, samples=t["value_and_grad"], **sz),
            make_row(NOTEBOOK, "value_and_grad", "first_call_s", first, "s", info=info, **sz),
            make_row(NOTEBOOK, "value_and_grad", "floor_median_s", floor, "s", info=info, samples=t["floor"],
                     floor=method, **sz),
            make_row(NOTEBOOK, "value_and_grad", "ratio_to_floor", med / floor, "x", info=info, target=2.0,
                     measured="alternating calls", **sz),
        ]
        if pm.delta_bytes is not None:
            rows.append(make_row(NOTEBOOK, "value_and_grad", "peak_rss_delta_bytes", pm.delta_bytes, "bytes",
                                 info=info, method=pm.method, **sz))
        if pm.device_peak_bytes is not None:
            rows.append(make_row(NOTEBOOK, "value_and_grad", "device_peak_bytes", pm.device_peak_bytes, "bytes",
                                 info=info, **sz))
    return rows


def parts_rows(cfg, profile, info, repeats) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from msrm.gp import likelihood as L
    from msrm.gp import linalg
    from msrm.gp.model import params_to_theta
    from msrm.gp.prepare import prepare

    K = cfg["factors"][0]
    model, u, truth = build_case(cfg, K)
    theta = params_to_theta(truth.params)
    # the parts are timed on one run prepared on its own (the model itself may batch runs by shape)
    run = prepare(model.data, model.spec, grouped=True, method=model.method).runs[0]
    lay = run.layout
    N = lay.n_nodes

    stats = jax.jit(lambda th, r: L.node_information(th, r))
    _, eta, R, _ = stats(theta, run)

    def assemble(th, R):
        C = L.node_covariance(th, lay)
        return jnp.eye(N * K) + L.node_woodbury_matrix(R, C).reshape(N * K, N * K)

    assemble = jax.jit(assemble)
    M = assemble(theta, R)
    v = jnp.ones(N * K)
    factor = jax.jit(lambda M, v: linalg.quad_logdet(M, v)[:2])
    factor_vg = jax.jit(jax.value_and_grad(lambda M, v: sum(linalg.quad_logdet(M, v)[:2])))
    density = jax.jit(model.log_density)
    uj = jnp.asarray(u)
    fns = {
        "sufficient_statistics": lambda: stats(theta, run),
        "covariance_assembly": lambda: assemble(theta, R),
        "factorization": lambda: factor(M, v),
        "factorization_value_and_grad": lambda: factor_vg(M, v),
        "log_density": lambda: density(uj),
        "value_and_grad": lambda: model.value_and_grad(u),
    }
    med = {name: warm_median(fn, repeats=repeats)[0] for name, fn in fns.items()}
    med["inverse"] = max(med["factorization_value_and_grad"] - med["factorization"], 0.0)
    med["backward_pass"] = max(med["value_and_grad"] - med["log_density"], 0.0)
    sz = dict(K=K, n_features=cfg["n_features"], profile=profile, **_sizes(model))
    derived = {"inverse": "factorization_value_and_grad - factorization",
               "backward_pass": "value_and_grad - log_density"}
    order = ("sufficient_statistics", "covariance_assembly", "factorization", "inverse", "log_density",
             "backward_pass", "value_and_grad")
    return [make_row(NOTEBOOK, "parts", "median_s", med[p], "s", info=info, part=p,
                     derived_from=derived.get(p), **sz) for p in order]


def feature_sweep_rows(cfg, profile, info, repeats) -> list[dict]:
    K = cfg["factors"][0]
    cases = {F: build_case(cfg, K, n_features=F)[:2] for F in cfg["sweep"]}
    # every feature count's model is called in turn, so that a drift of the machine reaches them all alike
    calls = {F: (lambda m=m, u=u: m.value_and_grad(u)) for F, (m, u) in cases.items()}
    times = side_by_side(calls, repeats)
    rows, base = [], float(np.median(times[cfg["sweep"][0]]))
    for F, (model, _) in cases.items():
        med = float(np.median(times[F]))
        sz = dict(K=K, n_features=F, profile=profile, **_sizes(model))
        rows.append(make_row(NOTEBOOK, "feature_sweep", "median_s", med, "s", info=info, samples=times[F], **sz))
        rows.append(make_row(NOTEBOOK, "feature_sweep", "added_fraction", med / base - 1.0, "fraction", info=info,
                             baseline_features=cfg["sweep"][0], target=0.10, measured="alternating calls", **sz))
    return rows


def threads_rows(cfg, profile, info, repeats) -> list[dict]:
    import jax

    from msrm.gp import linalg

    if jax.default_backend() != "cpu":
        return [make_row(NOTEBOOK, "threads", "median_s", None, "s", status="not_yet_measured", info=info,
                         reason="the LAPACK callback runs on the CPU platform only", profile=profile)]
    K = cfg["factors"][0]
    model, u, _ = build_case(cfg, K)
    rows = []
    for t in range(1, physical_cores() + 1):
        with linalg.callback_threads(t):
            med, times = warm_median(lambda: model.value_and_grad(u), repeats=repeats)
        rows.append(make_row(NOTEBOOK, "threads", "median_s", med, "s", info=info, samples=times, threads=t, K=K,
                             n_features=cfg["n_features"], profile=profile, **_sizes(model)))
    return rows


def host_memory_rows(cfg, profile, info, repeats) -> list[dict]:
    from msrm import runtime

    before = runtime.host_memory()
    if not runtime.set_host_memory("system"):
        return [make_row(NOTEBOOK, "host_memory", "median_s", None, "s", status="not_yet_measured", info=info,
                         reason="the C library is not glibc (mallopt unavailable)", profile=profile)]
    K = cfg["factors"][0]
    model, u, _ = build_case(cfg, K)
    sz = dict(K=K, n_features=cfg["n_features"], profile=profile, **_sizes(model))
    rows, med = [], {}
    try:
        for mode in ("system", "reuse"):
            runtime.set_host_memory(mode)
            runtime.release_host_memory()
            floor_fn, method = floor_function(sz["NK"])
            t = side_by_side({"value_and_grad": lambda: model.value_and_grad(u), "floor": floor_fn}, repeats)
            times, med[mode], floor = t["value_and_grad"], float(np.median(t["value_and_grad"])), float(
                np.median(t["floor"]))
            rows += [make_row(NOTEBOOK, "host_memory", "median_s", med[mode], "s", info=info, samples=times,
                              host_memory=mode, **sz),
                     make_row(NOTEBOOK, "host_memory", "ratio_to_floor", med[mode] / floor, "x", info=info,
                              host_memory=mode, floor=method, floor_median_s=floor, **sz)]
    finally:
        runtime.set_host_memory(before if before in runtime.HOST_MEMORY_MODES else "system")
    rows.append(make_row(NOTEBOOK, "host_memory", "speedup", med["system"] / med["reuse"], "x", info=info,
                         host_memory="system/reuse", **sz))
    return rows


def fingerprint_rows(cfg, profile, info) -> list[dict]:
    rows = []
    for K in cfg["factors"]:
        model, u, _ = build_case(cfg, K)
        value, grad = model.value_and_grad(u)
        names = model.param_names
        sz = dict(K=K, n_features=cfg["n_features"], profile=profile, seed=0, **_sizes(model))
        rows.append(make_row(NOTEBOOK, "fingerprint", "log_density", value, "nat", info=info,
                             repr=f"{value:.17g}", guard_events=model.guard_events(), **sz))
        for name in FINGERPRINT_ENTRIES:
            if name in names:
                g = float(grad[names.index(name)])
                rows.append(make_row(NOTEBOOK, "fingerprint", "gradient", g, "nat/unit", info=info, entry=name,
                                     repr=f"{g:.17g}", **sz))
    return rows


def run(profile: str = "quick", out_dir: str | Path | None = None, *, repeats: int | None = None,
        experiments: tuple[str, ...] | None = None) -> list[dict]:
    """All rows of the ``gp_grouped`` notebook for one profile (written to ``out_dir/rows.jsonl`` if given)."""
    if profile not in PROFILES:
        raise ValueError(f"profile must be one of {sorted(PROFILES)}, got {profile!r}")
    known = ("value_and_grad", "parts", "feature_sweep", "threads", "host_memory", "fingerprint")
    experiments = known if experiments is None else tuple(experiments)
    unknown = sorted(set(experiments) - set(known))
    if unknown:
        raise ValueError(f"unknown experiment(s) {unknown}; known are {list(known)}")
    cfg = PROFILES[profile]
    reps = cfg["repeats"] if repeats is None else int(repeats)
    info = execution_info(include_jax=True)
    rows: list[dict] = []
    try:
        rows = _run(cfg, profile, info, reps, experiments)
    finally:
        _CASES.clear()
    if out_dir is not None:
        write_rows(Path(out_dir) / "rows.jsonl", rows, append=False)
    return rows


def _run(cfg, profile, info, reps, experiments) -> list[dict]:
    rows: list[dict] = []
    parts = (("value_and_grad", value_and_grad_rows), ("parts", parts_rows), ("feature_sweep", feature_sweep_rows),
             ("threads", threads_rows), ("host_memory", host_memory_rows), ("fingerprint", fingerprint_rows))
    for name, rows_fn in parts:
        if name not in experiments:
            continue
        reason = skip_reason()
        if reason is not None:
            rows += skipped_rows(NOTEBOOK, name, reason, info=info, profile=profile)
        elif name == "threads" and not cfg["threads"]:
            rows.append(make_row(NOTEBOOK, "threads", "median_s", None, "s", status="not_yet_measured", info=info,
                                 reason=f"not part of the {profile} profile", profile=profile))
        else:
            rows += rows_fn(cfg, profile, info) if name == "fingerprint" else rows_fn(cfg, profile, info, reps)
    return rows
