"""Peer methods of the recovery benchmark: the latent-factor methods users pick today, run on an ``msrm.Dataset``
and reported on MSRM's latent grid so the same recovery metrics apply.

    res = run_peer(name, data, spec, seed=0) -> PeerResult

``PEERS`` lists the names in order:

- ``pca_spline``: PCA (scikit-learn) of the stacked brain streams, K components.
- ``fa_spline``: factor analysis (``sklearn.decomposition.FactorAnalysis``) of the same matrix, K factors.
- ``srm``: BrainIAK's probabilistic shared response model on the per-participant brain arrays; the shared
  response ``s_`` (K x time).
- ``mefisto``: mofapy2's MEFISTO (MOFA with Gaussian-process factors over time), every modality a view.
- ``gpfa``: elephant's Gaussian-process factor analysis EM core on the stacked brain streams, orthonormalised
  latents.

Each method yields K scores per sample time of its own clock; a cubic spline
(``scipy.interpolate.CubicSpline``, per factor) carries them to the grid points
``msrm.spec.latent_grid(run.duration, spec)`` that lie inside the sampled span ``[t_first, t_last]``; grid
points outside it are NaN (no method extrapolates). ``PeerResult.latents[r]`` is then a (J_r, K) array like
``RFit.latents[r]``. The latents are identified only up to an invertible K x K transform (a rotation and scale
for PCA/SRM/GPFA-orth, any for FA/MEFISTO), so compare them through subspaces or an alignment.

Shared preprocessing of the brain streams (modality ``"brain"``):

- **One clock per run.** The reference clock of a run is that of its first brain stream (in the dataset's
  stream order). Another brain stream on a different clock is linearly interpolated onto it, feature by
  feature from its observed values; reference times outside that stream's sampled span become missing.
- **Stacking.** All brain participants' features side by side: X_r has shape (n_r, F), F = sum of the brain
  streams' feature counts, in the dataset's stream order. A participant absent from a run is missing there.
- **Z-scoring.** Each feature is centred and scaled by its mean and standard deviation over all runs'
  observed values (a constant feature is only centred).
- **Missing values.** A missing value (NaN) is replaced by its feature's mean, i.e. 0 after z-scoring
  (mean imputation), before PCA, FA, SRM and GPFA; MEFISTO takes the NaN as missing directly.
- **Runs.** PCA, FA and SRM fit once on all runs concatenated in time (rows stacked) and split the scores
  back per run; GPFA treats each run as a separate trial; MEFISTO treats each run as a separate group (its
  own samples, the covariate being the time within the run).

A peer whose package cannot be imported, or whose fit raises, returns ``ok=False`` with the reason; it never
raises. Bad arguments (unknown name, wrong types) raise ``ValueError`` naming them.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import io
import math
import time
import warnings
from dataclasses import dataclass, field

import numpy as np
import scipy
from scipy.interpolate import CubicSpline

import msrm
from msrm.spec import latent_grid

__all__ = ["PEERS", "PeerResult", "run_peer"]

PEERS: tuple[str, ...] = ("pca_spline", "fa_spline", "srm", "mefisto", "gpfa")

INSTALL_HINT = "pip install -e '.[peers]'"

# (module imported, distribution that provides it) per peer
_REQUIRES: dict[str, tuple[tuple[str, str], ...]] = {
    "pca_spline": (("sklearn.decomposition", "scikit-learn"),),
    "fa_spline": (("sklearn.decomposition", "scikit-learn"),),
    "srm": (("brainiak.funcalign.srm", "brainiak"),),
    "mefisto": (("mofapy2.run.entry_point", "mofapy2"),),
    "gpfa": (
        ("elephant.gpfa.gpfa_core", "elephant"),
        ("elephant.gpfa.gpfa_util", "elephant"),
        ("sklearn.decomposition", "scikit-learn"),
    ),
}

# further distributions whose versions a peer's info records (BrainIAK's MPI layer)
_ALSO_RECORD: dict[str, tuple[str, ...]] = {"srm": ("mpi4py", "mpich")}

# settings of the iterative peers (modest, seeded)
SRM_ITERATIONS = 50
MEFISTO_ITERATIONS = 300
# above this many samples (all groups) MEFISTO uses its sparse GP with this many inducing points in all: the
# dense GP costs O(N^3) per factor and lengthscale grid point
MEFISTO_MAX_DENSE_SAMPLES = 300
GPFA_EM_ITERATIONS = 200
GPFA_SEGMENT_BINS = 50  # EM trains on segments of this many bins (elephant's practice), inference on whole runs
GPFA_TAU_INIT_BINS = 5.0  # initial GP timescale in bins (elephant's default 100 ms at 20 ms bins)

_SPAN_TOL = 1e-9


@dataclass(frozen=True)
class PeerResult:
    """Outcome of one peer method.

    Attributes:
        method: the peer's name (one of ``PEERS``).
        ok: True when the method ran and ``latents`` holds its estimate.
        error: None when ok; else why it failed or is unavailable (``"not installed: brainiak (pip install
            -e '.[peers]')"``, or the exception's type and message).
        latents: one (J_r, K) float64 array per run on ``latent_grid(run.duration, spec)``; NaN outside the
            span the method's samples cover. Empty when not ok.
        wall_s: seconds spent (imports and fit).
        info: versions of the packages used, settings, iteration counts.
    """

    method: str
    ok: bool
    error: str | None
    latents: list = field(default_factory=list)
    wall_s: float = 0.0
    info: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------- arguments


def _check_args(name, data, spec, seed) -> None:
    if not isinstance(name, str) or name not in PEERS:
        raise ValueError(f"name must be one of {list(PEERS)}, got {name!r}")
    if not isinstance(data, msrm.Dataset):
        raise ValueError(f"data must be an msrm.Dataset, got {type(data).__name__}")
    if not isinstance(spec, msrm.ModelSpec):
        raise ValueError(f"spec must be an msrm.ModelSpec, got {type(spec).__name__}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= int(seed) < 2**32:
        raise ValueError(f"seed must be an integer in [0, 2**32), got {seed!r}")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _import_requirements(name: str):
    """Import the peer's modules: (modules by name, versions by distribution, error or None)."""
    modules, versions = {}, {"numpy": np.__version__, "scipy": scipy.__version__}
    for module, dist in _REQUIRES[name]:
        try:
            modules[module] = importlib.import_module(module)
        except ImportError as exc:
            if _version(dist) is None:
                return modules, versions, f"not installed: {dist} ({INSTALL_HINT})"
            reason = f"{type(exc).__name__}: {exc}"
            return modules, versions, f"import failed: {module} ({dist} {_version(dist)}): {reason}"
        except Exception as exc:  # e.g. a missing shared library raising at import
            return modules, versions, f"import failed: {module} ({dist}): {type(exc).__name__}: {exc}"
        versions[dist] = _version(dist)
    for dist in _ALSO_RECORD.get(name, ()):
        versions[dist] = _version(dist)
    return modules, versions, None


# --------------------------------------------------------------------------------------- data preparation


def _interp_onto(times_from: np.ndarray, values: np.ndarray, times_to: np.ndarray) -> np.ndarray:
    """Linear interpolation of each column of ``values`` (n_from, F) from ``times_from`` to ``times_to``, from
    the observed (non-NaN) values only; NaN outside each column's observed span. Returns (n_to, F)."""
    out = np.full((times_to.size, values.shape[1]), np.nan)
    for f in range(values.shape[1]):
        obs = ~np.isnan(values[:, f])
        if obs.sum() == 0:
            continue
        t, v = times_from[obs], values[obs, f]
        inside = (times_to >= t[0] - _SPAN_TOL) & (times_to <= t[-1] + _SPAN_TOL)
        out[inside, f] = np.interp(times_to[inside], t, v)
    return out


def _same_clock(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool(np.allclose(a, b, rtol=0.0, atol=1e-9 * max(1.0, float(np.abs(a).max()))))


def _brain_keys(data: msrm.Dataset) -> list[str]:
    keys = [k for k in data.stream_keys if data.modality_of(k) == "brain"]
    if not keys:
        raise ValueError("the dataset has no brain stream (modality 'brain'); this peer fits brain features")
    return keys


def _stack_brain(data: msrm.Dataset, keys: list[str]):
    """Per run: (times (n_r,), X_r (n_r, F) raw with NaN, column slices per key). Runs without a brain stream
    give (None, None)."""
    n_feat = data.n_features
    slices, start = {}, 0
    for k in keys:
        slices[k] = slice(start, start + n_feat[k])
        start += n_feat[k]
    F = start
    out = []
    for run in data.runs:
        present = [k for k in keys if k in run.keys]
        if not present:
            out.append((None, None))
            continue
        ref = run.stream(present[0])
        times = ref.times
        X = np.full((times.size, F), np.nan)
        for k in present:
            s = run.stream(k)
            if _same_clock(s.times, times):
                X[:, slices[k]] = s.values
            else:
                X[:, slices[k]] = _interp_onto(s.times, s.values, times)
        out.append((times, X))
    return out, slices


def _zscore_impute(blocks: list[np.ndarray]):
    """Z-score each column over the observed values of all blocks; NaN -> 0 (the feature mean). Returns the
    standardised blocks (float64 copies)."""
    allX = np.vstack(blocks)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        mean = np.nanmean(allX, axis=0)
        sd = np.nanstd(allX, axis=0)
    mean = np.where(np.isfinite(mean), mean, 0.0)
    sd = np.where(np.isfinite(sd) & (sd > 0), sd, 1.0)
    out = []
    for X in blocks:
        Z = (X - mean) / sd
        out.append(np.where(np.isnan(Z), 0.0, Z))
    return out


def _to_grid(times: np.ndarray | None, scores: np.ndarray | None, grid: np.ndarray, K: int) -> np.ndarray:
    """Cubic spline of ``scores`` (n, k<=K) at ``times`` to the grid points inside [times[0], times[-1]];
    (J, K) with NaN outside the span (and in columns beyond k)."""
    Z = np.full((grid.size, K), np.nan)
    if times is None or scores is None or times.size < 2:
        return Z
    tol = _SPAN_TOL * max(1.0, abs(float(times[-1])))
    inside = (grid >= times[0] - tol) & (grid <= times[-1] + tol)
    spline = CubicSpline(times, scores, axis=0)
    k = scores.shape[1]
    Z[inside, :k] = spline(np.clip(grid[inside], times[0], times[-1]))
    return Z


def _brain_design(data: msrm.Dataset):
    """Stacked, z-scored, imputed brain matrices of the runs holding brain: (per-run (times, X) with None for
    runs without brain, column slices, run indices with brain)."""
    keys = _brain_keys(data)
    per_run, slices = _stack_brain(data, keys)
    have = [r for r, (t, _) in enumerate(per_run) if t is not None]
    std = _zscore_impute([per_run[r][1] for r in have])
    design = [(None, None)] * len(per_run)
    for r, X in zip(have, std):
        design[r] = (per_run[r][0], X)
    return design, slices, have


def _split_rows(scores: np.ndarray, design, have) -> list:
    out, start = [None] * len(design), 0
    for r in have:
        n = design[r][0].size
        out[r] = scores[start:start + n]
        start += n
    return out


def _latents_from_scores(data, spec, design, scores_per_run) -> list[np.ndarray]:
    K = spec.n_factors
    return [
        _to_grid(design[r][0], scores_per_run[r], latent_grid(run.duration, spec), K)
        for r, run in enumerate(data.runs)
    ]


# ----------------------------------------------------------------------------------------------------- peers


def _fit_sklearn(kind: str, data, spec, seed, modules):
    """PCA or FA on the rows of all runs stacked: X (sum n_r, F) -> scores (sum n_r, K)."""
    dec = modules["sklearn.decomposition"]
    design, slices, have = _brain_design(data)
    X = np.vstack([design[r][1] for r in have])
    K = spec.n_factors
    if kind == "pca":
        model = dec.PCA(n_components=K, random_state=int(seed))
    else:
        model = dec.FactorAnalysis(n_components=K, random_state=int(seed))
    scores = np.asarray(model.fit_transform(X), dtype=np.float64)
    info = {"n_samples": int(X.shape[0]), "n_features": int(X.shape[1]), "brain_streams": list(slices)}
    if kind == "pca":
        info["explained_variance_ratio"] = [float(v) for v in model.explained_variance_ratio_]
    else:
        info["iterations"] = int(model.n_iter_)
    return _latents_from_scores(data, spec, design, _split_rows(scores, design, have)), info


def _fit_srm(data, spec, seed, modules):
    """Probabilistic SRM: participant i's (F_i x T) array X_i = W_i S + noise with orthonormal W_i; S (K x T)
    is the shared response, T = all runs' samples concatenated."""
    srm_mod = modules["brainiak.funcalign.srm"]
    design, slices, have = _brain_design(data)
    X = np.vstack([design[r][1] for r in have])  # (T, F)
    per_subject = [np.ascontiguousarray(X[:, sl].T) for sl in slices.values()]
    model = srm_mod.SRM(n_iter=SRM_ITERATIONS, features=spec.n_factors, rand_seed=int(seed))
    with contextlib.redirect_stdout(io.StringIO()):
        model.fit(per_subject)
    scores = np.asarray(model.s_, dtype=np.float64).T  # (T, K)
    info = {"iterations": SRM_ITERATIONS, "n_subjects": len(per_subject), "brain_streams": list(slices),
            "n_samples": int(X.shape[0])}
    return _latents_from_scores(data, spec, design, _split_rows(scores, design, have)), info


def _segments(T: int, L: int) -> list[tuple[int, int]]:
    """Start/stop of segments of L bins covering [0, T): evenly spaced starts, the last ending at T."""
    if T <= L:
        return [(0, T)]
    n = math.ceil(T / L)
    starts = np.round(np.linspace(0, T - L, n)).astype(int)
    return [(int(s), int(s) + L) for s in starts]


def _fit_gpfa(data, spec, seed, modules):
    """GPFA (Yu et al. 2009) through elephant's EM core: y_t = C x_t + d + e, e ~ N(0, R diagonal), each latent
    an RBF Gaussian process over bins (timescale learnt). Each run is a trial: ``seqs`` is a structured array
    with fields ``T`` (bins) and ``y`` ((F, T) array). Initialisation as elephant's ``gpfa_core.fit``: factor
    analysis for C, d, R and ``gamma = (1 / tau_init_bins)^2``. EM trains on segments of
    ``GPFA_SEGMENT_BINS`` bins; the posterior means of whole runs are then orthonormalised (C = U D V^T,
    x_orth = D V^T x)."""
    core = modules["elephant.gpfa.gpfa_core"]
    dec = modules["sklearn.decomposition"]
    design, slices, have = _brain_design(data)
    K = spec.n_factors
    dt = float(np.median(np.diff(design[have[0]][0]))) if design[have[0]][0].size > 1 else 1.0
    full = np.empty(len(have), dtype=[("T", int), ("y", object)])
    for i, r in enumerate(have):
        full[i] = (design[r][1].shape[0], np.ascontiguousarray(design[r][1].T))
    segs = []
    for i in range(len(have)):
        for a, b in _segments(int(full[i]["T"]), GPFA_SEGMENT_BINS):
            segs.append((b - a, full[i]["y"][:, a:b]))
    train = np.empty(len(segs), dtype=[("T", int), ("y", object)])
    for i, s in enumerate(segs):
        train[i] = s
    y_all = np.hstack(train["y"])
    fa = dec.FactorAnalysis(n_components=K, random_state=int(seed),
                            noise_variance_init=np.maximum(np.var(y_all, axis=1), 1e-6))
    fa.fit(y_all.T)
    params = {
        "covType": "rbf",
        "gamma": (1.0 / GPFA_TAU_INIT_BINS) ** 2 * np.ones(K),
        "eps": 1e-3 * np.ones(K),
        "d": y_all.mean(axis=1),
        "C": fa.components_.T.copy(),
        "R": np.diag(fa.noise_variance_),
        "notes": {"learnKernelParams": True, "learnGPNoise": False, "RforceDiagonal": True},
    }
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        params, _, lls, _ = core.em(params, train, max_iters=GPFA_EM_ITERATIONS, tol=1e-8)
        seqs, _ = core.exact_inference_with_ll(full, params, get_ll=False)
        _, seqs = core.orthonormalize(params, seqs)
    scores = [None] * len(design)
    for i, r in enumerate(have):
        scores[r] = np.asarray(seqs[i]["latent_variable_orth"], dtype=np.float64).T  # (T_r, K)
    timescales = (dt / np.sqrt(params["gamma"])).tolist()
    info = {"iterations": len(lls), "bin_width_s": dt, "gp_timescales_s": [float(v) for v in timescales],
            "segment_bins": GPFA_SEGMENT_BINS, "brain_streams": list(slices)}
    return _latents_from_scores(data, spec, design, scores), info


def _mefisto_clock(data: msrm.Dataset, spec: msrm.ModelSpec) -> float:
    """MEFISTO's common clock step: the finest stream dt rounded to a multiple of latent_dt (at least one)."""
    finest = min(s.dt for run in data.runs for s in run.streams)
    d = spec.latent_dt
    return d * max(1, round(finest / d))


def _fit_mefisto(data, spec, seed, modules):
    """MEFISTO (Velten et al. 2022): MOFA's views x groups factor model y = Z W_m^T + e with a Gaussian-process
    prior on each factor over the covariate (time, seconds within the run).

    Samples of run r: the common clock ``0, c, 2c, ... <= duration`` (``_mefisto_clock``) united with the run's
    brain sample times (its reference clock). Views are the modalities in the dataset's order: ``brain`` holds
    all brain features of all participants (z-scored, NaN kept) at the brain times and NaN at the other
    samples; every other modality holds all its participants' features side by side (one column each for a
    rating or physiology trace), linearly interpolated to every sample inside the stream's span, NaN outside,
    z-scored. Each run is a group (``model_groups=True`` learns the group-group correlation of each factor).
    The factor means at the samples are splined to the grid."""
    ep = modules["mofapy2.run.entry_point"]
    c = _mefisto_clock(data, spec)
    K = spec.n_factors
    keys_by_mod = {m: [k for k in data.stream_keys if data.modality_of(k) == m] for m in data.modalities}
    if "brain" in keys_by_mod:
        brain_stack, _ = _stack_brain(data, keys_by_mod["brain"])
    else:
        brain_stack = [(None, None)] * len(data.runs)
    n_feat = data.n_features
    sample_times, views_raw = [], {m: [] for m in keys_by_mod}
    for r, run in enumerate(data.runs):
        clock = c * np.arange(math.floor(run.duration / c + 1e-9) + 1, dtype=np.float64)
        bt = brain_stack[r][0]
        t = clock if bt is None else np.unique(np.round(np.concatenate([clock, bt]), 9))
        sample_times.append(t)
        for m, keys in keys_by_mod.items():
            F = sum(n_feat[k] for k in keys)
            V = np.full((t.size, F), np.nan)
            if m == "brain":
                if bt is not None:
                    V[np.searchsorted(t, np.round(bt, 9))] = brain_stack[r][1]
            else:
                start = 0
                for k in keys:
                    if k in run.keys:
                        s = run.stream(k)
                        V[:, start:start + n_feat[k]] = _interp_onto(s.times, s.values, t)
                    start += n_feat[k]
            views_raw[m].append(V)
    views, names = [], []
    for m, blocks in views_raw.items():
        allV = np.vstack(blocks)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            mean, sd = np.nanmean(allV, axis=0), np.nanstd(allV, axis=0)
        keep = np.isfinite(mean)
        if not keep.any():
            continue
        sd = np.where(np.isfinite(sd) & (sd > 0), sd, 1.0)
        views.append([((V - mean) / sd)[:, keep] for V in blocks])
        names.append(m)
    groups = [f"run{r}" for r in range(len(data.runs))]
    log = io.StringIO()
    with contextlib.redirect_stdout(log), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ent = ep.entry_point()
        ent.set_data_options(scale_views=False, center_groups=True)
        ent.set_data_matrix(views, likelihoods=["gaussian"] * len(views), views_names=names, groups_names=groups)
        ent.set_model_options(factors=K)
        ent.set_train_options(iter=MEFISTO_ITERATIONS, convergence_mode="fast", seed=int(seed), quiet=True,
                              verbose=False, dropR2=None)
        ent.set_covariates([t[:, None] for t in sample_times], covariates_names="time")
        n_samples = sum(t.size for t in sample_times)
        sparse = n_samples > MEFISTO_MAX_DENSE_SAMPLES
        frac = MEFISTO_MAX_DENSE_SAMPLES / n_samples if sparse else None
        ent.set_smooth_options(model_groups=True, sparseGP=sparse, frac_inducing=frac)
        ent.build()
        ent.run()
    Z = np.asarray(ent.model.nodes["Z"].getExpectation(), dtype=np.float64)
    scores, start = [], 0
    for t in sample_times:
        scores.append(Z[start:start + t.size])
        start += t.size
    if start != Z.shape[0]:
        raise RuntimeError(f"MEFISTO returned {Z.shape[0]} factor rows for {start} samples")
    latents = [
        _to_grid(sample_times[r], scores[r], latent_grid(run.duration, spec), K) for r, run in enumerate(data.runs)
    ]
    info = {"iterations_max": MEFISTO_ITERATIONS, "convergence_mode": "fast", "clock_s": c, "views": names,
            "n_samples": int(n_samples), "sparse_gp": bool(sparse), "frac_inducing": frac,
            "groups": groups, "n_factors_returned": int(Z.shape[1])}
    stats = getattr(ent.model, "train_stats", {})
    if "number_factors" in stats:
        # entry 0 is the initialisation, then one finite entry per iteration run
        info["iterations"] = int(np.isfinite(np.asarray(stats["number_factors"], dtype=np.float64)).sum() - 1)
    if "length_scales" in stats:
        info["gp_lengthscales_s"] = [float(v) for v in np.ravel(stats["length_scales"])]
    return latents, info


_FITS = {
    "pca_spline": lambda data, spec, seed, mods: _fit_sklearn("pca", data, spec, seed, mods),
    "fa_spline": lambda data, spec, seed, mods: _fit_sklearn("fa", data, spec, seed, mods),
    "srm": _fit_srm,
    "mefisto": _fit_mefisto,
    "gpfa": _fit_gpfa,
}


def run_peer(name: str, data: msrm.Dataset, spec: msrm.ModelSpec, seed: int = 0) -> PeerResult:
    """Run one peer method on ``data`` and put its latents on ``spec``'s latent grid.

    Args:
        name: one of ``PEERS``.
        data: the recordings.
        spec: supplies K (``n_factors``) and the latent grid (``latent_dt``, ``latent_pad``).
        seed: seeds the method's random initialisation.

    Returns:
        PeerResult; ``ok=False`` with ``error`` set when the method's package is missing or its fit raised.

    Raises:
        ValueError: unknown ``name``, or ``data``/``spec``/``seed`` of the wrong type.
    """
    _check_args(name, data, spec, seed)
    t0 = time.perf_counter()
    modules, versions, error = _import_requirements(name)
    settings = {"n_factors": spec.n_factors, "latent_dt": spec.latent_dt, "seed": int(seed)}
    if error is not None:
        return PeerResult(name, False, error, [], time.perf_counter() - t0, {"versions": versions, **settings})
    try:
        latents, info = _FITS[name](data, spec, int(seed), modules)
    except (Exception, SystemExit) as exc:  # mofapy2 calls sys.exit on some input errors
        msg = f"{type(exc).__name__}: {exc}"
        return PeerResult(name, False, msg, [], time.perf_counter() - t0, {"versions": versions, **settings})
    latents = [np.asarray(z, dtype=np.float64) for z in latents]
    return PeerResult(name, True, None, latents, time.perf_counter() - t0,
                      {"versions": versions, **settings, **info})
