r"""Simulation-based calibration (Talts et al. 2018) of GP-MSRM's posteriors on a tiny design.

**Procedure.** For replication ``r`` (seeded by ``seed + r``; every draw below is deterministic given it):

1. ``u_r = model.prior_draw(seed_r)`` (the package's priors, :mod:`msrm.gp.transforms`), ``theta_r =
   model.constrain(u_r)``;
2. data ``y_r ~ p(y | theta_r)`` with latents ``Z_r`` from the GP prior on the grid
   (:func:`data_synth.simulate_params.simulate_from_params`);
3. a posterior from ``y_r``: ``"nuts"`` (:meth:`msrm.GPMSRM.sample`, one short chain of ``L * thin`` draws, thinned
   to ``L``) and/or ``"laplace"`` (:meth:`msrm.GPMSRM.approximate_posterior`, ``L`` independent draws);
4. for every scalar test quantity ``f``, the rank ``rank_r = #{l : f(theta_l) < f(theta_r)}`` in ``{0, ..., L}``
   (ties broken uniformly at random, :func:`ranks_of`).

If the posterior is exact, ``theta_r`` and the ``L`` draws are exchangeable draws from ``p(theta | y_r)``, so
``rank_r`` is uniform on ``{0, ..., L}`` whatever ``f`` is.

**Fixed priors.** The model's default priors are set from the data scale; SBC needs one prior for every
replication, fixed before any data are drawn. :func:`sbc_priors` gives the defaults of
:data:`msrm.gp.transforms.PRIOR_DEFAULTS` at unit data scale (``mean_f = 0``, ``sd_f = 1`` for every feature:
``W ~ N(0, 1)``, ``b ~ N(0, 2^2)``, ``log sigma ~ N(0, 1)``, ``log l ~ N(log(10 latent_dt), 1.5^2)``, lags uniform
on their bounds); the same :class:`~msrm.gp.transforms.Priors` object draws ``theta_r`` and enters every fit.

**Test quantities.** GP-MSRM leaves the sign of each factor free (``W -> -W``, ``Z -> -Z`` leaves the density
unchanged) and a sampler stays near one sign, so sign-carrying quantities are made invariant with the reference
sign ``s = sign(W_ref)``, ``W_ref`` the loading of the first feature of the first brain stream on factor 0:
``|W_ref|``, ``s * W_{key, f, 0}`` for a few other loadings and ``s * Z_{j, 0}`` for a few grid points; lags,
widths, lengthscales and one noise sd are ranked as they are. The design uses K = 1 (with K > 1 the factors may also
rotate and swap, and only the sign- and order-free quantities would be valid). A latent value's posterior draw is
``s_l * z`` with ``z ~ N(m_l, sd_l)``, the exact conditional posterior of ``Z_j`` given ``theta_l``
(:meth:`msrm.gp.posterior.Posterior.latent_posterior`).

**Uniformity.** Ranks are counted in ``B`` bins of equal width over ``{0, ..., L}`` (``L + 1`` divisible by
``B``); the histogram is tested with Pearson's chi-square against ``n / B`` per bin (``B - 1`` degrees of
freedom, :func:`chi_square_uniform`), and the randomised normalised ranks ``(rank + U) / (L + 1)``, ``U ~ U(0, 1)``
(exactly U(0, 1) under calibration), with a one-sample Kolmogorov-Smirnov test (:func:`ks_uniform`). The row's
``value`` is the chi-square p-value; the statistic, the KS statistic and p-value and the counts are extra fields.

**Time budget.** Without a notebook deadline (:mod:`msrm_lab.budget`; the ``note`` profile) every replication of
every method runs, all in one pool of worker processes. With one (the ``quick`` profile) a method's replications run
in rounds of ``n_jobs``; a round starts only while the median wall time of the method's finished replications still
fits before the deadline (with no wall time known yet, from this sitting or this machine's store, the first round
runs), and the replications never started are recorded.

**Replication store.** SBC at note size takes hours of NUTS, longer than one sitting, so replications can be kept:
with ``store`` every successful replication is written, as soon as it finishes, to
``<store>/<key>/<method>-<r>.json`` (its ranks, wall time, seed, and where it ran), ``key`` naming the recipe and
the code (:func:`store_key`). A later sitting of the same code and settings reads them back and runs only the
replications still missing; stores of other machines (``reuse``) contribute the same way, because replication
``r`` is the same computation wherever it runs: the same truth and data, the same sampler and seeds. Its ranks
agree across machines only up to MCMC's sensitivity to rounding (another JAX build or CPU takes other trajectories,
which move a rank by a few places), and each is a valid draw of the experiment; a replication held by several
stores counts once, the first store read (this machine's) giving its ranks. Any change to the library, the
simulator or the functions here that compute a replication changes the key, so a result never mixes replications
of different code. The rows say where their replications came from
(``replications_by_origin``); wall times are those of this machine only.

**Rows** (notebook ``"calibration"``, experiment ``"sbc"``): per (method, quantity) a ``chi_square_p`` row with
``n_replications`` (successful), ``n_planned``, ``n_failed``, ``chi_square``, ``chi_square_df``, ``ks_statistic``, ``ks_p``,
``num_bins``, ``num_draws`` (L), ``rank_counts`` (list of B ints, like other rows carry arrays: a JSON list in the
row's params); per method a ``wall_s_per_replication`` row (median, with every replication's wall as a list); per
failed replication an ``error`` row with the traceback's last line; per method cut short by the budget a
``not_yet_measured`` ``chi_square_p`` row with ``replications_skipped`` and the reason.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

from ..budget import deadline, skip_reason, skipped_rows
from .rows import make_row

__all__ = ["SIZES", "MIN_EXPECTED_PER_BIN", "ranks_of", "rank_histogram", "chi_square_uniform", "ks_uniform",
           "uniform_band", "rank_shape", "sbc_design", "sbc_priors", "quantities_of", "replication", "store_key",
           "stored_replications", "sbc_rows", "sbc_histograms"]

NOTEBOOK = "calibration"
EXPERIMENT = "sbc"

# linear_algebra: the state space factorises no dense covariance, whose conditioning worsens with the long
# lengthscales that the prior's tail draws; a replication that fails for its parameters would bias the ranks
_DESIGN = dict(duration=90.0, participants=2, n_brain_features=3, brain_dt=2.0, rating_dt=1.0, latent_dt=1.0,
               n_factors=1, kernel="matern32", lag_bounds=(0.0, 5.0), rating_width=1.5,
               linear_algebra="state_space")
SIZES: dict[str, dict[str, Any]] = {
    # a few replications end to end in seconds per replication
    "smoke": dict(_DESIGN, duration=60.0, n_replications=2, methods=("laplace",), num_draws=19, num_bins=4,
                  thin=1, num_warmup=30, map_maxiter=60, n_jobs=1),
    # the Laplace approximation only (a NUTS replication takes minutes), in rounds until the budget is spent
    "quick": dict(_DESIGN, n_replications=25, methods=("laplace",), num_draws=49, num_bins=5, thin=2,
                  num_warmup=150, map_maxiter=200, n_jobs=2),
    # n_jobs None: one worker process per physical core
    "note": dict(_DESIGN, duration=120.0, participants=3, n_replications=200, methods=("laplace", "nuts"),
                 num_draws=99, num_bins=20, thin=4, num_warmup=300, map_maxiter=300, n_jobs=None),
}


# ------------------------------------------------------------------------------------------ ranks and tests


def ranks_of(truth, draws, rng: np.random.Generator) -> np.ndarray:
    """SBC ranks of the true values among posterior draws.

    ``rank_q = #{l : draws[l, q] < truth[q]} + U_q``, ``U_q`` uniform on ``{0, ..., #{l : draws[l, q] ==
    truth[q]}}`` (ties broken at random so a discrete tie cannot bias the rank).

    Args:
        truth: (Q,) true values.
        draws: (L, Q) posterior draws.
        rng: NumPy generator for the tie-breaks.
    Returns:
        (Q,) integer ranks in ``{0, ..., L}``.
    """
    truth = np.atleast_1d(np.asarray(truth, dtype=np.float64))
    draws = np.asarray(draws, dtype=np.float64)
    if draws.ndim == 1:
        draws = draws[:, None]
    if draws.shape[1:] != truth.shape:
        raise ValueError(f"draws must be (L, {truth.shape[0]}), got {draws.shape}")
    below = np.sum(draws < truth, axis=0)
    ties = np.sum(draws == truth, axis=0)
    return (below + rng.integers(0, ties + 1)).astype(np.int64)


def rank_histogram(ranks, num_draws: int, num_bins: int) -> np.ndarray:
    """Counts of ranks in ``num_bins`` equal bins over ``{0, ..., num_draws}``.

    Bin ``b`` holds ranks ``b * w, ..., (b + 1) * w - 1`` with ``w = (num_draws + 1) / num_bins`` (must be whole).

    Returns:
        (num_bins,) int counts.
    """
    if (num_draws + 1) % num_bins:
        raise ValueError(f"num_draws + 1 = {num_draws + 1} must be divisible by num_bins = {num_bins}")
    ranks = np.asarray(ranks, dtype=np.int64).ravel()
    if ranks.size and (ranks.min() < 0 or ranks.max() > num_draws):
        raise ValueError(f"ranks must lie in [0, {num_draws}]")
    width = (num_draws + 1) // num_bins
    return np.bincount(ranks // width, minlength=num_bins).astype(np.int64)


def chi_square_uniform(counts) -> tuple[float, float]:
    """Pearson's chi-square of bin counts against equal expected counts: ``sum (c_b - n/B)^2 / (n/B)``,
    ``B - 1`` degrees of freedom. Returns (statistic, p-value)."""
    from scipy import stats

    counts = np.asarray(counts, dtype=np.float64)
    res = stats.chisquare(counts)
    return float(res.statistic), float(res.pvalue)


def ks_uniform(ranks, num_draws: int, rng: np.random.Generator) -> tuple[float, float]:
    """Kolmogorov-Smirnov test of the randomised normalised ranks ``(rank + U) / (num_draws + 1)`` against U(0, 1).

    Under calibration ``rank`` is uniform on ``{0, ..., L}`` and ``U ~ U(0, 1)`` independent, so the normalised rank
    is exactly U(0, 1) and the KS test has its nominal size (the plain ``rank / L`` is discrete). Returns
    (statistic, p-value)."""
    from scipy import stats

    ranks = np.asarray(ranks, dtype=np.float64).ravel()
    u = (ranks + rng.random(ranks.size)) / (num_draws + 1)
    res = stats.kstest(u, "uniform")
    return float(res.statistic), float(res.pvalue)


def uniform_band(n: int, num_bins: int, level: float = 0.99) -> tuple[float, float]:
    """The central ``level`` interval of one bin's count when ``n`` ranks are uniform: Binomial(n, 1/B) quantiles."""
    from scipy import stats

    a = (1.0 - level) / 2.0
    return float(stats.binom.ppf(a, n, 1.0 / num_bins)), float(stats.binom.ppf(1.0 - a, n, 1.0 / num_bins))


# ------------------------------------------------------------------------------------------ the design


MIN_EXPECTED_PER_BIN = 5
"""Fewest replications per bin a uniform histogram must expect before its chi-square test is read (the usual rule
for Pearson's approximation); with fewer, :func:`rank_shape` says so instead of reading the test."""


def rank_shape(counts, p_value: float, level: float = 0.01) -> str:
    """A plain reading of one rank histogram: ``"too few replications"`` when a uniform histogram would expect
    fewer than :data:`MIN_EXPECTED_PER_BIN` per bin; ``"uniform"`` when the chi-square test does not reject at
    ``level``; otherwise how it departs.

    With ``m`` the mean rank bin scaled to [0, 1] (0.5 for a uniform histogram) and ``e`` the two outer bins' count
    over what a uniform histogram puts there: ``|m - 0.5| >= 0.1`` is a shift (``m > 0.5``: the truth ranks high,
    so the posterior's draws sit below it: ``"draws below the truth"``; else ``"draws above the truth"``); else
    ``e > 1.5`` is a U (the truth falls outside the draws too often: ``"too narrow"``), ``e < 0.5`` a hump (it falls
    in the middle too often: ``"too wide"``); anything else ``"non-uniform"``.
    """
    c = np.asarray(counts, dtype=float)
    if c.ndim != 1 or c.size < 2 or c.sum() <= 0:
        raise ValueError(f"counts must be a histogram of at least two bins with a positive total, got {counts!r}")
    if c.sum() / c.size < MIN_EXPECTED_PER_BIN:
        return "too few replications"
    if p_value >= level:
        return "uniform"
    m = float(np.dot(np.arange(c.size), c) / c.sum() / (c.size - 1))
    if abs(m - 0.5) >= 0.1:
        return "draws below the truth" if m > 0.5 else "draws above the truth"
    e = float((c[0] + c[-1]) / (2.0 * c.sum() / c.size))
    return "too narrow" if e > 1.5 else "too wide" if e < 0.5 else "non-uniform"


def sbc_design(cfg: dict):
    """The template dataset and spec of the design (values are placeholders; only the layout is used).

    Per participant ``p{i}``: a ``brain`` stream of ``n_brain_features`` features every ``brain_dt`` seconds
    (``Identity``) and a one-feature ``rating`` stream every ``rating_dt`` seconds (``GaussianLag`` of width
    ``rating_width``, lag in ``lag_bounds``), one run of ``duration`` seconds, K = ``n_factors``, shared pooling.
    """
    import msrm

    T = float(cfg["duration"])
    streams = []
    for i in range(int(cfg["participants"])):
        for mod, dt, F in (("brain", cfg["brain_dt"], cfg["n_brain_features"]), ("rating", cfg["rating_dt"], 1)):
            n = int(math.floor(T / dt + 1e-9)) + 1
            streams.append(msrm.Stream(participant=f"p{i}", modality=mod, dt=float(dt), values=np.zeros((n, F))))
    data = msrm.Dataset([msrm.Run(duration=T, streams=streams)])
    spec = msrm.ModelSpec(n_factors=int(cfg["n_factors"]), latent_dt=float(cfg["latent_dt"]), kernel=cfg["kernel"],
                          pooling="shared",
                          responses={"brain": msrm.Identity(),
                                     "rating": msrm.GaussianLag(width=float(cfg["rating_width"]),
                                                                lag_bounds=tuple(cfg["lag_bounds"]))})
    return data, spec


def sbc_priors(data, spec):
    """The fixed priors of every replication: the defaults at unit data scale (module docstring)."""
    from msrm.gp.transforms import PRIOR_DEFAULTS, Priors

    h = PRIOR_DEFAULTS
    one = {k: np.ones(data.n_features[k]) for k in data.stream_keys}
    return Priors(
        loading_sd={k: h["loading_scale"] * v for k, v in one.items()},
        intercept_loc={k: 0.0 * v for k, v in one.items()},
        intercept_sd={k: h["intercept_scale"] * v for k, v in one.items()},
        log_noise_loc={k: 0.0 * v for k, v in one.items()},
        log_noise_sd=h["noise_log_sd"],
        log_lengthscale_loc=math.log(h["lengthscale_steps"] * spec.latent_dt),
        log_lengthscale_sd=h["lengthscale_log_sd"],
    )


def _latent_indices(grid: np.ndarray, duration: float) -> np.ndarray:
    """Grid indices nearest to 25 %, 50 % and 75 % of the run."""
    return np.array([int(np.argmin(np.abs(grid - q * duration))) for q in (0.25, 0.5, 0.75)])


def quantities_of(params, latent_values: np.ndarray | None, data, spec) -> dict[str, float]:
    """The scalar test quantities of one parameter set (module docstring: sign-invariant for loadings and latents).

    Args:
        params: msrm.Params.
        latent_values: (3,) factor-0 values at :func:`_latent_indices` (same sign convention as ``params``), or None.
    Returns:
        ``{name: value}`` in a fixed order.
    """
    keys = data.stream_keys
    ref = keys[0]
    w_ref = float(params.loadings[ref][0, 0])
    s = 1.0 if w_ref >= 0 else -1.0
    out = {f"abs_loading/{ref}[0]": abs(w_ref)}
    brain = [k for k in keys if k.endswith("/brain")]
    rating = [k for k in keys if k.endswith("/rating")]
    if data.n_features[ref] > 1:
        out[f"signed_loading/{ref}[1]"] = s * float(params.loadings[ref][1, 0])
    if len(brain) > 1:
        out[f"signed_loading/{brain[1]}[0]"] = s * float(params.loadings[brain[1]][0, 0])
    if rating:
        out[f"signed_loading/{rating[0]}[0]"] = s * float(params.loadings[rating[0]][0, 0])
        out[f"noise_sd/{rating[0]}[0]"] = float(params.noise_sd[rating[0]][0])
    for k, ell in enumerate(np.atleast_1d(params.lengthscales)):
        out[f"lengthscale[{k}]"] = float(ell)
    for pk, d in params.response.items():
        for name, v in d.items():
            out[f"{name}/{pk}"] = float(v)
    if latent_values is not None:
        for i, z in enumerate(latent_values):
            out[f"signed_latent[q{i + 1}]"] = s * float(z)
    return out


# ------------------------------------------------------------------------------------------ one replication


def _posterior(model, method: str, cfg: dict, seed: int):
    L = int(cfg["num_draws"])
    map_options = {"maxiter": int(cfg["map_maxiter"])}
    if method == "laplace":
        return model.approximate_posterior(num_samples=L, seed=seed, map_options=map_options, diagnostics=False,
                                           log_density_draws=False), 1
    if method == "nuts":
        thin = int(cfg["thin"])
        return model.sample(num_warmup=int(cfg["num_warmup"]), num_samples=L * thin, num_chains=1, seed=seed,
                            max_tree_depth=int(cfg.get("max_tree_depth", 8)), progress=False, diagnostics=False,
                            map_options=map_options), thin
    raise ValueError(f"method must be 'laplace' or 'nuts', got {method!r}")


def replication(r: int, cfg: dict, method: str, seed: int = 0) -> dict:
    """One SBC replication (module docstring, steps 1-4).

    Returns:
        ``{"r", "method", "seed", "ranks": {quantity: int}, "wall_s", "error"}``; on failure ``ranks`` is None and
        ``error`` holds the traceback text.
    """
    t0 = time.perf_counter()
    seed_r = int(seed) * 1_000_003 + int(r)
    out: dict[str, Any] = {"r": int(r), "method": method, "seed": seed_r, "ranks": None, "error": None}
    try:
        from data_synth.simulate_params import simulate_from_params
        from msrm.gp.model import GPMSRM
        from msrm.spec import latent_grid

        template, spec = sbc_design(cfg)
        priors = sbc_priors(template, spec)
        prior_model = GPMSRM(template, spec, linear_algebra=cfg["linear_algebra"], priors=priors)
        truth = prior_model.constrain(prior_model.prior_draw(seed_r))
        data, latents = simulate_from_params(template, spec, truth, seed=seed_r + 7_919)
        model = GPMSRM(data, spec, linear_algebra=cfg["linear_algebra"], priors=priors)
        grid = latent_grid(data.runs[0].duration, spec)
        idx = _latent_indices(grid, data.runs[0].duration)
        q_true = quantities_of(truth, latents[0][idx, 0], data, spec)

        post, thin = _posterior(model, method, cfg, seed_r)
        rng = np.random.default_rng([seed_r, 1])
        lat = post.latent_posterior(thin=thin, progress=False)[0]
        m = np.asarray(lat["draws"].values)[0][:, idx, 0]  # (L, 3)
        sd = np.asarray(lat["draw_sd"].values)[0][:, idx, 0]
        z = m + sd * rng.standard_normal(m.shape)
        kept = np.arange(0, post.draws_u.shape[1], thin)
        L = int(cfg["num_draws"])
        if kept.size != L:
            raise RuntimeError(f"expected {L} kept draws, got {kept.size}")
        q_draws = [quantities_of(model.constrain(post.draws_u[0, d]), z[i], data, spec)
                   for i, d in enumerate(kept)]
        names = list(q_true)
        D = np.array([[q[n] for n in names] for q in q_draws])
        ranks = ranks_of(np.array([q_true[n] for n in names]), D, rng)
        out["ranks"] = dict(zip(names, ranks.tolist()))
    except Exception:  # recorded, never dropped
        out["error"] = traceback.format_exc()
    out["wall_s"] = time.perf_counter() - t0
    return out


def _worker(task: tuple, cfg: dict, seed: int, one_thread: bool, store: dict | None = None) -> dict:
    """One replication: float64 JAX; in a worker process (``one_thread``) also one BLAS thread for the libraries
    and for msrm's own thread choices (:func:`msrm.runtime.configure`), so parallel replications do not
    oversubscribe the cores. With ``store`` (``{method: folder}``, :func:`sbc_rows`) a successful replication is
    also written there at once, so a sitting cut short keeps every replication it finished."""
    import msrm

    if one_thread:
        msrm.runtime.configure(blas_threads=1)
    msrm.runtime.enable_x64()
    r, method = task
    out = replication(r, cfg, method, seed)
    if store is not None and out["ranks"] is not None:
        _store_one(Path(store["folders"][method]), out, store["origin"])
    return out


# ------------------------------------------------------------------------------------------ the replication store


#: settings that do not change what one replication computes (how many run, where, and how ranks are binned)
_NOT_RECIPE = ("n_replications", "n_jobs", "methods", "num_bins")


def store_key(cfg: dict, method: str, seed: int) -> str:
    """The identity of one method's replications: the design and sampler settings of ``cfg`` (not
    :data:`_NOT_RECIPE`), the method, the base seed, and the code that runs them: the digest of the library and
    the simulator (:func:`msrm_lab.provenance.code_digest`) and the source of this module's functions that one
    replication calls (:data:`_REPLICATION_CODE`; the rows, figures and command line around them may change
    freely). Replication ``r`` of a key is the same computation wherever it runs, so replications stored under one
    key by several sittings, or by several machines, are draws of one SBC experiment. 16 hex digits."""
    import inspect

    from msrm_lab.provenance import code_digest

    recipe = {k: v for k, v in sorted(cfg.items()) if k not in _NOT_RECIPE}
    sources = [inspect.getsource(f) for f in _REPLICATION_CODE]
    text = json.dumps({"recipe": recipe, "method": method, "seed": int(seed), "code": code_digest(),
                       "replication": sources}, sort_keys=True, default=list)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


#: the functions of this module that compute one replication (their source enters :func:`store_key`)
_REPLICATION_CODE = (sbc_design, sbc_priors, _latent_indices, quantities_of, ranks_of, _posterior, replication,
                     _worker)


def _store_one(folder: Path, out: dict, origin: dict) -> None:
    from msrm import atomic

    atomic.write_json(folder / f"{out['method']}-{out['r']:05d}.json",
                      {**{k: out[k] for k in ("r", "method", "seed", "ranks", "wall_s")}, "origin": origin})


def stored_replications(stores, key: str, method: str, n_rep: int) -> dict[int, dict]:
    """Finished replications ``0 <= r < n_rep`` of ``method`` stored under ``key`` in any of ``stores`` (folders
    ``<store>/<key>/<method>-<r>.json``; the first store holding ``r`` wins), each with ``"store"`` set to the
    folder it came from. A file that cannot be read is skipped with a warning naming it (files are written
    atomically, so this means damage from outside)."""
    import warnings

    found: dict[int, dict] = {}
    for store in stores:
        for f in sorted((Path(store) / key).glob(f"{method}-*.json")):
            try:
                x = json.loads(f.read_text())
                r = int(x["r"])
                ok = x["method"] == method and isinstance(x["ranks"], dict) and 0 <= r < n_rep
            except (OSError, ValueError, KeyError, TypeError) as err:
                warnings.warn(f"SBC store: skipping unreadable replication file {f}: {err}", RuntimeWarning,
                              stacklevel=2)
                continue
            if ok and r not in found:
                found[r] = {**x, "error": None, "store": str(store)}
    return found


def _prune(store: Path, keep: set[str]) -> None:
    """Remove the folders of ``store`` whose key is not in ``keep``: replications of other code or settings,
    which no sitting of this code can use."""
    import shutil

    if store.is_dir():
        for folder in store.iterdir():
            if folder.is_dir() and folder.name not in keep and len(folder.name) == 16:
                shutil.rmtree(folder, ignore_errors=True)


# ------------------------------------------------------------------------------------------ rows


def machine_stores(results: str | Path, profile: str) -> tuple[Path, ...]:
    """Every machine's replication store of ``profile``: ``<results>/*/<profile>/calibration.replications``, sorted.

    The calibration notebook and :func:`main` both pass these as ``reuse`` to :func:`sbc_rows`, which reads its own
    ``store`` first and skips it among them, so a replication run on any machine is not run again.
    """
    return tuple(sorted(Path(results).glob(f"*/{profile}/calibration.replications")))


def sbc_rows(profile: str = "smoke", *, info: dict | None = None, seed: int = 0, n_jobs: int | None = None,
             methods: tuple[str, ...] | None = None, n_replications: int | None = None,
             keep: dict | None = None, store: str | Path | None = None,
             reuse: tuple[str | Path, ...] = ()) -> list[dict]:
    """Run ``SIZES[profile]`` and return its rows (module docstring).

    Args:
        profile: a key of :data:`SIZES`.
        info: ``execution_info()`` for every row (computed once if omitted).
        seed: base seed; replication ``r`` uses ``seed * 1000003 + r``.
        n_jobs: worker processes (loky, one BLAS thread each; 1 runs in this process); None: the profile's
            (where that is None, one per physical core).
        methods, n_replications: override the profile's.
        keep: if a dict, ``keep["replications"]`` receives every replication's raw result (stored ones included).
        store: this machine's replication store (module docstring): replications found there under the current
            :func:`store_key` are not run again, every new one is written there as it finishes, and folders of
            other keys (other code or settings; not the other method's) are removed from it.
        reuse: further stores (other machines') read for replications, never written; ``store`` is read first.
    """
    if profile not in SIZES:
        raise ValueError(f"profile must be one of {sorted(SIZES)}, got {profile!r}")
    cfg = dict(SIZES[profile])
    methods = tuple(methods if methods is not None else cfg["methods"])
    n_rep = int(n_replications if n_replications is not None else cfg["n_replications"])
    from msrm.parallel import resolve_n_jobs

    n_jobs = resolve_n_jobs(n_jobs if n_jobs is not None else cfg["n_jobs"], n_rep * len(methods))
    if info is None:
        from msrm_lab.provenance import execution_info

        info = execution_info()
    stored: dict[str, dict[int, dict]] = {m: {} for m in methods}
    spec = None
    if store is not None:
        store = Path(store)
        keys = {m: store_key(cfg, m, seed) for m in methods}
        # every method's key of this code is kept, also those of methods this call does not run: a call for one
        # method must not remove the other's replications
        _prune(store, {store_key(cfg, m, seed) for m in ("laplace", "nuts")})
        stores = [store, *(Path(p) for p in reuse if Path(p).resolve() != store.resolve())]
        stored = {m: stored_replications(stores, keys[m], m, n_rep) for m in methods}
        origin = {k: info.get(k) for k in ("cpu_model", "physical_cores", "jax", "numpyro", "python", "git_commit",
                                           "blas_kernel")}
        spec = {"folders": {m: str(store / keys[m]) for m in methods}, "origin": origin}
    fn = functools.partial(_worker, cfg=cfg, seed=int(seed), one_thread=n_jobs > 1, store=spec)
    todo = {m: [r for r in range(n_rep) if r not in stored[m]] for m in methods}
    own = {m: [x["wall_s"] for x in stored[m].values() if store is not None and Path(x["store"]) == store]
           for m in methods}
    fresh, skipped = _replications(fn, todo, n_jobs, own)
    results = [x for m in methods for x in sorted(stored[m].values(), key=lambda x: x["r"])] + fresh
    if keep is not None:
        keep["replications"] = results
    L, B = int(cfg["num_draws"]), int(cfg["num_bins"])
    common = dict(profile=profile, duration=cfg["duration"], participants=cfg["participants"],
                  n_brain_features=cfg["n_brain_features"], K=cfg["n_factors"],
                  linear_algebra=cfg["linear_algebra"], num_draws=L, num_bins=B, seed=int(seed), n_planned=n_rep)
    rows: list[dict] = []
    for method in methods:
        if method in skipped:
            count, reason = skipped[method]
            rows += skipped_rows(NOTEBOOK, EXPERIMENT, reason, info=info, metrics=(("chi_square_p", "1"),),
                                 method=method, replications_skipped=count, **common)
        mine = [x for x in results if x["method"] == method]
        ok = [x for x in mine if x["ranks"] is not None]
        failed = [x for x in mine if x["ranks"] is None]
        for x in failed:
            last = x["error"].strip().splitlines()[-1] if x["error"] else "unknown"
            rows.append(make_row(NOTEBOOK, EXPERIMENT, "replication_failed", None, "", status="error", info=info,
                                 method=method, replication=x["r"], error=last, **common))
        # walls measured on this machine only: this sitting's and those of its own store
        walls = [float(x["wall_s"]) for x in mine if math.isfinite(x["wall_s"])
                 and ("store" not in x or Path(x["store"]) == store)]
        origins = _origins(mine, store)
        if walls:
            rows.append(make_row(NOTEBOOK, EXPERIMENT, "wall_s_per_replication", float(np.median(walls)), "s",
                                 info=info, method=method, walls=walls, n_replications=len(ok),
                                 n_failed=len(failed), **common))
        if not ok:
            continue
        rng = np.random.default_rng([int(seed), 2])
        for name in ok[0]["ranks"]:
            ranks = np.array([x["ranks"][name] for x in ok])
            counts = rank_histogram(ranks, L, B)
            chi, p = chi_square_uniform(counts)
            ks, ks_p = ks_uniform(ranks, L, rng)
            rows.append(make_row(NOTEBOOK, EXPERIMENT, "chi_square_p", p, "1", info=info, method=method,
                                 quantity=name, n_replications=len(ok), n_failed=len(failed), chi_square=chi,
                                 chi_square_df=B - 1, ks_statistic=ks, ks_p=ks_p, rank_counts=counts.tolist(),
                                 test="pearson chi-square on binned ranks; KS on randomised normalised ranks",
                                 replications_by_origin=origins, **common))
    return rows


def _origins(results: list[dict], store: Path | None) -> dict[str, int]:
    """How many successful replications came from where: ``"this sitting"``, ``"this machine's store"``, or the
    name of the machine folder (``results/<label>/...``) of another store."""
    out: dict[str, int] = {}
    for x in results:
        if x["ranks"] is None:
            continue
        if "store" not in x:
            where = "this sitting"
        elif store is not None and Path(x["store"]) == store:
            where = "this machine's store"
        else:
            where = Path(x["store"]).parents[1].name
        out[where] = out.get(where, 0) + 1
    return out


def _replications(fn, todo: dict[str, list[int]], n_jobs: int,
                  walls_before: dict[str, list[float]]) -> tuple[list[dict], dict[str, tuple[int, str]]]:
    """The result of every replication in ``todo`` (``{method: [r, ...]}``; module docstring, time budget), and
    per method cut short by the budget the number of replications not started and why. ``walls_before``: wall
    times of the method's replications finished on this machine by earlier sittings, which predict a round's
    length before this sitting has finished one."""
    from msrm.parallel import run_tasks

    def run(tasks):
        done = run_tasks(fn, tasks, n_jobs=n_jobs, backend="sequential" if n_jobs == 1 else "loky", blas_threads=1)
        # a worker that failed outside replication() (which records its own errors) is recorded the same way
        return [res.value if res.error is None else
                {"r": res.task[0], "method": res.task[1], "ranks": None, "error": res.error, "wall_s": float("nan")}
                for res in done]

    if deadline() is None:
        return run([(r, m) for m, rs in todo.items() for r in rs]), {}
    results: list[dict] = []
    skipped: dict[str, tuple[int, str]] = {}
    for method, rs in todo.items():
        walls = [w for w in walls_before.get(method, []) if math.isfinite(w)]
        for start in range(0, len(rs), n_jobs):
            reason = skip_reason(predicted_s=float(np.median(walls))) if walls else None
            if reason is not None:
                skipped[method] = (len(rs) - start, reason)
                break
            batch = run([(r, method) for r in rs[start:start + n_jobs]])
            results += batch
            walls += [x["wall_s"] for x in batch if math.isfinite(x["wall_s"])]
    return results, skipped


# ------------------------------------------------------------------------------------------ figure


def sbc_histograms(df, *, level: float = 0.99, ncols: int = 4):
    """Rank histograms of every (method, quantity) with the ``level`` band of one bin of a uniform histogram.

    Args:
        df: a pandas DataFrame of rows (or a list of rows); the ``chi_square_p`` rows are drawn, their params
            flattened or nested under ``params``.
    Returns:
        a matplotlib Figure: one panel per (method, quantity), bars = ``rank_counts``, grey band = the central
        ``level`` interval of Binomial(n, 1/B), line = n/B.
    """
    import matplotlib.pyplot as plt
    import pandas as pd

    df = pd.DataFrame(list(df)) if not isinstance(df, pd.DataFrame) else df
    if "params" in df.columns:
        flat = pd.json_normalize(df["params"].tolist())
        df = pd.concat([df.drop(columns=["params"]).reset_index(drop=True), flat], axis=1)
    df = df[df["metric"] == "chi_square_p"]
    n_panels = max(len(df), 1)
    ncols = min(ncols, n_panels)
    nrows = math.ceil(n_panels / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.0 * ncols, 2.4 * nrows), squeeze=False)
    for ax, (_, row) in zip(axes.ravel(), df.iterrows()):
        counts = np.asarray(row["rank_counts"])
        B, n = counts.size, int(counts.sum())
        lo, hi = uniform_band(n, B, level)
        ax.axhspan(lo, hi, color="0.85", zorder=0)
        ax.axhline(n / B, color="0.5", lw=0.8)
        ax.bar(np.arange(B), counts, width=0.9, color="C0", zorder=1)
        ax.set_title(f"{row['method']}: {row['quantity']}\np = {row['value']:.2g}, n = {n}", fontsize=8)
        ax.set_xticks([])
    for ax in axes.ravel()[len(df):]:
        ax.axis("off")
    fig.supxlabel("rank bin")
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------------------------------ command line


def main(argv: list[str] | None = None) -> int:
    """Advance a replication store from the shell, on any machine (``python -m msrm_lab.bench.sbc --help``).

    Runs the profile's replications that no store under ``<results>/*/<profile>/`` holds yet into
    ``<results>/<this machine's label>/<profile>/calibration.replications`` (the store the calibration notebook
    reads), in rounds that stop before ``--budget`` seconds are spent, and prints one line per method: how many
    replications all the stores now hold together. The rows themselves come from the notebook, which reads every
    machine's store the same way.
    """
    import argparse
    import os

    ap = argparse.ArgumentParser(prog="python -m msrm_lab.bench.sbc", description=main.__doc__.splitlines()[0])
    ap.add_argument("--profile", default="note", choices=sorted(SIZES))
    ap.add_argument("--methods", default=None, help="comma-separated, default: the profile's")
    ap.add_argument("--results", default="results", help="the results folder (default: results)")
    ap.add_argument("--budget", type=float, default=None, help="seconds after which no round starts")
    ap.add_argument("--n-jobs", type=int, default=None, help="worker processes (default: one per physical core)")
    args = ap.parse_args(argv)
    if args.budget is not None and not args.budget > 0:
        ap.error(f"--budget must be positive seconds, got {args.budget}")
    methods = tuple(args.methods.split(",")) if args.methods else tuple(SIZES[args.profile]["methods"])
    unknown = [m for m in methods if m not in ("laplace", "nuts")]
    if unknown:
        ap.error(f"--methods: unknown method(s) {unknown}; use laplace and/or nuts")
    import msrm
    from msrm_lab.budget import DEADLINE_ENV
    from msrm_lab.notebooks.device import device_label
    from msrm_lab.provenance import execution_info

    msrm.runtime.configure(platform="cpu")
    msrm.runtime.enable_x64()
    if args.budget is not None:
        os.environ[DEADLINE_ENV] = str(time.time() + args.budget)
    store = Path(args.results) / device_label("cpu") / args.profile / "calibration.replications"
    keep: dict = {}
    sbc_rows(args.profile, info=execution_info(), methods=methods, n_jobs=args.n_jobs, store=store,
             reuse=machine_stores(args.results, args.profile), keep=keep)
    n_rep = int(SIZES[args.profile]["n_replications"])
    for m in methods:
        done = sum(1 for x in keep["replications"] if x["method"] == m and x["ranks"] is not None)
        new = sum(1 for x in keep["replications"] if x["method"] == m and x["ranks"] is not None and "store" not in x)
        print(f"{m}: {done} of {n_rep} replications finished ({new} in this call); store {store}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
