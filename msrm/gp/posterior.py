"""The GP posterior by NumPyro NUTS on the unconstrained vector, with phase wall times and warm-up checkpoints.

NUTS runs on ``potential_fn(u) = -model.log_density(u)`` (NumPyro traces it once into its own jitted kernel), with a
diagonal mass matrix by default. The run is split into ``mcmc.warmup(...)`` and ``mcmc.run(post_warmup_state.rng_key,
...)`` so that the adapted state between the two can be checkpointed: resuming from the checkpoint executes exactly
the same sampling call as an uninterrupted run and gives the same draws.

:func:`sample` takes the sampling arguments; what is bookkeeping rather than sampling (the NetCDF archive of the
result, resuming a checkpoint made on another device) goes in one :class:`Record`.

Wall seconds per phase (``Posterior.timings``): ``initialisation`` (start points, MAP if asked), ``warmup``,
``checkpoint`` (saving or loading the warm-up checkpoint; only when there is one), ``sampling``,
``draw_conversion`` (unconstrained draws to physical InferenceData), ``pointwise_loglik``, ``diagnostics``
(:func:`msrm.diagnostics.summarize`) and ``total``. ``total`` runs from just after the argument checks to the end
of the diagnostics, and its first phases follow one another without a gap: ``initialisation``, ``warmup``,
``checkpoint``, ``sampling``. Warm-up and sampling include what JAX compiles inside them (NumPyro traces and
compiles its kernel and sampling loop for every call, whose potential is a new function); a caller that wants
compilation apart listens to JAX's ``jax.monitoring`` events around the call and places them in these windows.

Latents and predictions per draw (:meth:`Posterior.latent_posterior`, :meth:`Posterior.predict`): the model's
conditional posterior ``p(Z | Y, theta)`` (or predictive) at every ``thin``-th draw ``theta_s`` of every chain,
and the pooled posterior ``p(Z | Y) ~ (1/S) sum_s p(Z | Y, theta_s)`` summarised by the law of total variance
over the S kept draws: ``mean = (1/S) sum_s m_s`` and ``sd^2 = (1/S) sum_s v_s + (1/S) sum_s (m_s - mean)^2``
(the mixture's exact first two moments, so the variance of the means is taken with divisor S).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from .. import atomic
from ..runtime import execution_info
from .idata import build_inference_data, group_names, observed_summary, physical_draws, save_netcdf
from .map import fit_map

__all__ = ["sample", "Record", "Posterior", "save_checkpoint", "load_checkpoint", "device_identity",
           "DeviceMismatchError", "as_vector", "timed_phase", "observed_group", "diagnostics_summary"]

CHAIN_METHODS = ("sequential", "vectorized", "parallel")
# NumPyro extra fields collected in the sampling phase (the sample stats of the InferenceData)
SAMPLE_FIELDS = ("num_steps", "energy", "adapt_state.step_size", "accept_prob", "potential_energy")


class DeviceMismatchError(ValueError):
    """A warm-up checkpoint made on one device identity is resumed on another without
    ``Record(allow_device_change=True)``."""


@dataclass(frozen=True)
class Record:
    """What :func:`sample` keeps or accepts besides the draws: bookkeeping, not sampling.

    Fields:
        archive: write the InferenceData to this NetCDF path (atomic), or None.
        allow_device_change: resume a warm-up checkpoint made on another device identity (backend, device kind,
            device list, float width); without it such a checkpoint is refused with :class:`DeviceMismatchError`.
    """

    archive: str | os.PathLike | None = None
    allow_device_change: bool = False

    def __post_init__(self):
        if self.archive is not None and not isinstance(self.archive, (str, os.PathLike)):
            raise ValueError(f"Record: archive must be a path (str or os.PathLike) or None, "
                             f"got {type(self.archive).__name__}")
        if not isinstance(self.allow_device_change, (bool, np.bool_)):
            raise ValueError(f"Record: allow_device_change must be True or False, got {self.allow_device_change!r}")


@dataclass
class Posterior:
    """Result of :func:`sample`.

    Fields:
        inference_data: ArviZ InferenceData (posterior in physical units, sample_stats, observed_data, and
            log_likelihood when asked); ``attrs`` carry execution_info, timings and sampler settings.
        timings: wall seconds per phase (see module docstring) and ``total``.
        execution_info: where it ran.
        num_leapfrog: leapfrog steps in the sampling phase (all chains).
        num_leapfrog_warmup: leapfrog steps in warm-up (None when warm-up draws were not collected).
        seconds_per_leapfrog: sampling wall seconds / num_leapfrog (chains run one after another) or per
            lock-step leapfrog of all chains (vectorized); what JAX compiled inside the sampling call is included.
        draws_u: (chains, draws, num_params) unconstrained draws.
        summary: the diagnostics table (pandas DataFrame) or None.
        chain_method: the method NumPyro actually used.
        resumed: sampling started from a warm-up checkpoint.
        map_result: the MAP fit used as start (init="map").
        sample_stats: per-draw sample stats (chains, draws) by name.
        warmup_n_steps: (chains, num_warmup) leapfrog steps of every warm-up iteration (NumPyro's ``num_steps``),
            or None when warm-up draws were not collected.
        model: the model the draws belong to (needed by :meth:`latent_posterior` and :meth:`predict`).
        progress: the progress setting of :func:`sample`, the default of those two methods.
    """

    inference_data: Any
    timings: dict
    execution_info: dict
    num_leapfrog: int
    num_leapfrog_warmup: int | None
    seconds_per_leapfrog: float | None
    draws_u: np.ndarray
    summary: Any = None
    chain_method: str = "sequential"
    resumed: bool = False
    map_result: Any = None
    sample_stats: dict = field(default_factory=dict)
    warmup_n_steps: np.ndarray | None = None
    model: Any = field(default=None, repr=False, compare=False)
    progress: bool = False

    def latent_posterior(self, thin: int = 10, cov: bool = False, *, progress: bool | None = None) -> list:
        """The latent factors' posterior per kept draw and pooled over draws, per run (see the module docstring).

        Every ``thin``-th draw of every chain (draw indices ``0, thin, 2 thin, ...``) is constrained
        (``model.constrain``) and passed to ``model.latent_posterior``. The pooled ``mean`` and ``sd`` average over
        chains as well, which is meaningful only when the chains agree on the factors' sign and order (GP-MSRM
        leaves both free): they assume aligned chains, i.e. draws that were aligned before this Posterior was built.

        Args:
            thin: keep every ``thin``-th draw (a positive int, at most the number of draws per chain).
            cov: also return the per-draw (J, K, K) covariance of the factors at each grid point (``draw_cov``)
                and the pooled one (``cov``: mean of covariances plus covariance of the means).
            progress: a tqdm bar over the kept draws; default the ``progress`` setting of :func:`sample`.
        Returns:
            list over runs of ``xarray.Dataset`` with data variables ``draws`` and ``draw_sd`` (chain, draw, time,
            factor): per-draw conditional means and sds; ``mean`` and ``sd`` (time, factor): pooled;
            with ``cov``, ``draw_cov`` (chain, draw, time, factor, factor2) and ``cov`` (time, factor, factor2).
            Coords ``chain``, ``draw`` (the kept draw indices), ``time`` (grid seconds), ``factor`` (0..K-1),
            ``factor2``; attrs ``thin``, ``run``, ``num_pooled`` (S).
        Raises:
            ValueError: bad ``thin``; a Posterior that holds no model.
        """
        import xarray as xr

        chains, kept, thetas = self._kept_draws(thin)
        per_draw = [self.model.latent_posterior(p, cov=bool(cov))
                    for p in _progress(thetas, self._progress(progress), "latent posterior")]
        C, S = len(chains), len(kept)
        out = []
        for r, first in enumerate(per_draw[0]):
            means = np.stack([d[r].mean for d in per_draw]).reshape((C, S) + first.mean.shape)
            sds = np.stack([d[r].sd for d in per_draw]).reshape(means.shape)
            mean, sd = _pooled(means, sds)
            K = first.mean.shape[1]
            dims = ("chain", "draw", "time", "factor")
            variables = {"draws": (dims, means), "draw_sd": (dims, sds), "mean": (dims[2:], mean),
                         "sd": (dims[2:], sd)}
            coords = {"chain": chains, "draw": kept, "time": np.asarray(first.grid), "factor": np.arange(K)}
            if cov:
                covs = np.stack([d[r].cov for d in per_draw]).reshape(means.shape + (K,))
                variables["draw_cov"] = (dims + ("factor2",), covs)
                variables["cov"] = (("time", "factor", "factor2"), _pooled_cov(means, covs))
                coords["factor2"] = np.arange(K)
            attrs = {"thin": int(thin), "run": r, "num_pooled": C * S}
            out.append(xr.Dataset(variables, coords=coords, attrs=attrs))
        return out

    def predict(self, thin: int = 10, *, progress: bool | None = None) -> list:
        """Posterior predictions of every stream per kept draw and pooled over draws, per run.

        Draws are kept and constrained as in :meth:`latent_posterior` and passed to ``model.predict``; pooled values
        assume aligned chains in the same way (predictions themselves do not depend on the factors' sign or order,
        so for them pooling across chains is always meaningful).

        Args:
            thin: keep every ``thin``-th draw (a positive int, at most the number of draws per chain).
            progress: a tqdm bar over the kept draws; default the ``progress`` setting of :func:`sample`.
        Returns:
            list over runs of ``{"participant/modality": xarray.Dataset}`` (streams differ in samples and features,
            so each has its own Dataset) with data variables ``draws`` (chain, draw, sample, feature): per-draw
            predictive means, ``draw_sd``: per-draw predictive sds of a new observation (noise included),
            ``draw_signal_sd`` when the model gives it; pooled ``mean`` and ``sd`` (sample, feature) by the law of
            total variance (``sd`` includes the noise variance) and ``signal_sd`` (the same without noise).
            Coords ``chain``, ``draw`` (kept indices), ``sample`` (0..n-1) with ``time`` (seconds) as a coordinate
            along ``sample``, ``feature`` (0..F-1); attrs ``thin``, ``run``, ``key``, ``num_pooled``. Missing
            samples are predicted like observed ones (a NaN in the data is a held-out value). The per-draw arrays
            hold chains x kept draws x samples x features floats per stream: ``thin`` bounds their size for
            streams with thousands of features.
        Raises:
            ValueError: bad ``thin``; a Posterior that holds no model.
        """
        import xarray as xr

        chains, kept, thetas = self._kept_draws(thin)
        per_draw = [self.model.predict(p) for p in _progress(thetas, self._progress(progress), "predict")]
        C, S = len(chains), len(kept)
        runs = getattr(getattr(self.model, "data", None), "runs", None)
        out = []
        for r, first_run in enumerate(per_draw[0]):
            streams = {}
            for key, first in first_run.items():
                means = np.stack([d[r][key].mean for d in per_draw]).reshape((C, S) + first.mean.shape)
                sds = np.stack([d[r][key].sd for d in per_draw]).reshape(means.shape)
                mean, sd = _pooled(means, sds)
                dims = ("chain", "draw", "sample", "feature")
                variables = {"draws": (dims, means), "draw_sd": (dims, sds), "mean": (dims[2:], mean),
                             "sd": (dims[2:], sd)}
                if first.signal_sd is not None:
                    sig = np.stack([d[r][key].signal_sd for d in per_draw]).reshape(means.shape)
                    variables["draw_signal_sd"] = (dims, sig)
                    variables["signal_sd"] = (dims[2:], _pooled(means, sig)[1])
                n, F = first.mean.shape
                if first.times is not None:
                    times = np.asarray(first.times)
                elif runs is not None:
                    times = runs[r].stream(key).times
                else:
                    times = np.full(n, np.nan)
                coords = {"chain": chains, "draw": kept, "sample": np.arange(n), "time": ("sample", times),
                          "feature": np.arange(F)}
                attrs = {"thin": int(thin), "run": r, "key": key, "num_pooled": C * S}
                streams[key] = xr.Dataset(variables, coords=coords, attrs=attrs)
            out.append(streams)
        return out

    def _progress(self, progress: bool | None) -> bool:
        return self.progress if progress is None else bool(progress)

    def _kept_draws(self, thin) -> tuple[np.ndarray, np.ndarray, list]:
        """(chain labels (C,), kept draw indices (S,), Params of every kept draw in chain-major order)."""
        if self.model is None:
            raise ValueError("this Posterior holds no model (model=None): latents and predictions need the model "
                             "the draws belong to")
        C, num_draws, _ = self.draws_u.shape
        if isinstance(thin, (bool, np.bool_)) or not isinstance(thin, (int, np.integer)):
            raise ValueError(f"thin must be a positive int, got {thin!r}")
        if thin <= 0:
            raise ValueError(f"thin must be a positive int, got {thin}")
        if thin > num_draws:
            raise ValueError(f"thin={thin} is more than the {num_draws} draws per chain")
        kept = np.arange(0, num_draws, int(thin))
        chains = np.arange(C)
        posterior = getattr(self.inference_data, "posterior", None)
        if posterior is not None and "chain" in posterior.coords and posterior.sizes.get("chain") == C:
            chains = np.asarray(posterior.coords["chain"].values)
        thetas = [self.model.constrain(self.draws_u[c, s]) for c in range(C) for s in kept]
        return chains, kept, thetas


def _pooled(means: np.ndarray, sds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and sd of the equal-weight mixture of Gaussians N(means[c, s], sds[c, s]^2) over the leading two axes.

    Law of total variance: ``Var = E[Var | theta] + Var[E | theta]``, the second term with divisor S (the
    mixture's own variance, not an estimate of a larger population's).
    """
    mean = means.mean(axis=(0, 1))
    var = np.mean(sds**2, axis=(0, 1)) + np.mean((means - mean) ** 2, axis=(0, 1))
    return mean, np.sqrt(var)


def _pooled_cov(means: np.ndarray, covs: np.ndarray) -> np.ndarray:
    """The mixture's (J, K, K) covariance: the mean of the (C, S, J, K, K) covariances plus the covariance (divisor
    S) of the (C, S, J, K) means."""
    dev = means - means.mean(axis=(0, 1))
    return covs.mean(axis=(0, 1)) + np.einsum("csjk,csjl->jkl", dev, dev) / (dev.shape[0] * dev.shape[1])


def _progress(items: list, show: bool, desc: str):
    """``items`` wrapped in a tqdm bar when ``show``."""
    if not show:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, desc=desc, unit="draw")


# ------------------------------------------------------------------------------------------ device identity


def device_identity() -> dict:
    """What a warm-up checkpoint binds to: backend, device kind, device list and float width."""
    info = execution_info(include_jax=True)
    return {k: info.get(k) for k in ("backend", "device_kind", "devices", "dtype")}


# ------------------------------------------------------------------------------------------ checkpoints


def _ckpt_paths(path: str | Path) -> tuple[Path, Path]:
    """(``<stem>.npz``, ``<stem>.json``) of a checkpoint path given with or without either suffix."""
    p = Path(path)
    stem = p.with_suffix("") if p.suffix in (".npz", ".json") else p
    return stem.with_suffix(".npz"), stem.with_suffix(".json")


def save_checkpoint(path: str | Path, state, settings: dict) -> Path:
    """Save NumPyro's post-warm-up ``HMCState`` (step size, inverse mass matrix, position, RNG key, adaptation
    state) as ``<stem>.npz`` + ``<stem>.json`` (settings, device identity, execution_info, npz SHA-256).

    Leaves are stored by their pytree path, so loading checks the structure leaf by leaf.
    """
    import jax

    npz, meta_path = _ckpt_paths(path)
    leaves, _ = jax.tree_util.tree_flatten_with_path(state)
    arrays = {jax.tree_util.keystr(k): np.asarray(v) for k, v in leaves}
    atomic.write_npz(npz, arrays)
    meta = {
        "format": "msrm.nuts_warmup/1",
        "settings": settings,
        "device_identity": device_identity(),
        "execution_info": execution_info(include_jax=True),
        "leaves": list(arrays),
        "npz": npz.name,
        "npz_sha256": hashlib.sha256(npz.read_bytes()).hexdigest(),
    }
    atomic.write_json(meta_path, meta)
    return meta_path


def load_checkpoint(path: str | Path, template) -> tuple[Any, dict]:
    """Rebuild the HMCState saved by :func:`save_checkpoint` on the structure of ``template`` (same sampler)."""
    import jax
    import jax.numpy as jnp

    npz, meta_path = _ckpt_paths(path)
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != "msrm.nuts_warmup/1":
        raise ValueError(f"checkpoint {meta_path}: not an msrm NUTS warm-up checkpoint")
    if hashlib.sha256(npz.read_bytes()).hexdigest() != meta["npz_sha256"]:
        raise ValueError(f"checkpoint {npz}: checksum does not match {meta_path.name}")
    arrays = atomic.read_npz(npz)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
    new = []
    for keypath, tmpl in leaves:
        name = jax.tree_util.keystr(keypath)
        if name not in arrays:
            raise ValueError(f"checkpoint {npz}: missing state leaf {name}")
        a = arrays[name]
        if a.shape != tuple(tmpl.shape) or a.dtype != np.dtype(tmpl.dtype):
            raise ValueError(
                f"checkpoint {npz}: leaf {name} has shape {a.shape} {a.dtype}, the sampler expects "
                f"{tuple(tmpl.shape)} {np.dtype(tmpl.dtype)}"
            )
        new.append(jnp.asarray(a))
    return jax.tree_util.tree_unflatten(treedef, new), meta


# ------------------------------------------------------------------------------------------ starts


def as_vector(model, value) -> np.ndarray:
    """The (num_params,) unconstrained vector of a MAPResult, a vector, or Params (``model.unconstrain``)."""
    if hasattr(value, "u") and not hasattr(value, "flatten"):  # a MAPResult
        value = value.u
    if isinstance(value, (np.ndarray, list, tuple)):
        u = np.asarray(value, dtype=np.float64)
    else:
        u = np.asarray(model.unconstrain(value), dtype=np.float64)
    if u.shape != (model.num_params,):
        raise ValueError(f"init: unconstrained vector has shape {u.shape}, expected ({model.num_params},)")
    return u


def _starts(model, init, num_chains: int, seed: int, init_jitter: float, progress: bool,
            map_options: dict | None = None):
    """(num_chains, d) start points and the MAP result (if computed)."""
    map_result = None
    rng = np.random.default_rng([seed, 7])
    if isinstance(init, str):
        if init == "map":
            map_result = fit_map(model, seed=seed, progress=progress, **(map_options or {}))
            base = map_result.u
        elif init == "prior":
            draws = [np.asarray(model.prior_draw(seed + c), dtype=np.float64) for c in range(num_chains)]
            return np.stack(draws), None
        else:
            raise ValueError(f"init must be 'map', 'prior', Params, a MAPResult or a vector; got {init!r}")
    else:
        base = as_vector(model, init)
    starts = [base] + [base + init_jitter * rng.standard_normal(base.shape) for _ in range(num_chains - 1)]
    return np.stack(starts), map_result


# ------------------------------------------------------------------------------------------ sample


def sample(
    model,
    num_warmup: int = 1000,
    num_samples: int = 1200,
    num_chains: int = 1,
    chain_method: str = "sequential",
    seed: int = 0,
    *,
    max_tree_depth: int = 10,
    dense_mass: bool = False,
    target_accept_prob: float = 0.8,
    init: Any = "map",
    init_jitter: float = 0.1,
    checkpoint: str | Path | None = None,
    pointwise_loglik: bool = False,
    diagnostics: bool = True,
    collect_warmup_stats: bool | None = None,
    map_options: dict | None = None,
    progress: bool = True,
    record: Record | None = None,
    **deprecated,
) -> Posterior:
    """NUTS on the unconstrained vector of ``model``; see the module docstring. Arguments after ``seed`` are
    keyword-only.

    Args:
        num_warmup, num_samples, num_chains: NumPyro's. ``chain_method``: "sequential", "vectorized" or
            "parallel" (several devices; NumPyro falls back to sequential with a warning when there are too few).
        seed: the PRNG seed (``jax.random.PRNGKey(seed)``) and the seed of the start points.
        max_tree_depth, dense_mass, target_accept_prob: NUTS settings (diagonal mass by default).
        init: "map" (a MAP fit; chains after the first start at ``u_map + init_jitter * N(0, I)``), "prior"
            (``model.prior_draw(seed + chain)``), Params, a MAPResult, or an unconstrained vector.
        checkpoint: path stem of a warm-up checkpoint. Absent: warm up, save, sample. Present: check settings and
            device identity, skip warm-up, sample from the saved state.
        pointwise_loglik: add a ``log_likelihood`` group from ``model.pointwise_log_likelihood(u)``.
        diagnostics: compute :func:`msrm.diagnostics.summarize` (timed) into ``Posterior.summary``.
        collect_warmup_stats: collect warm-up tree sizes (needs warm-up draws in memory); default when they
            take under 256 MB.
        map_options: keywords of :func:`msrm.gp.map.fit_map` for ``init="map"`` (e.g. ``{"maxiter": 50}`` for a
            short MAP); ``seed`` and ``progress`` come from this call.
        progress: NumPyro's progress bars (and the MAP fit's), and the default of the Posterior's per-draw methods.
        record: a :class:`Record` (the NetCDF archive; resuming a checkpoint made on another device); None is
            ``Record()``.
        **deprecated: ``archive=`` and ``allow_device_change=`` are still accepted, with a DeprecationWarning,
            for ``record=Record(archive=..., allow_device_change=...)``.
    Raises:
        ValueError: a bad argument (named), before any numerics; DeviceMismatchError: see :class:`Record`.
    """
    import jax
    import numpyro  # noqa: F401  (a missing `bayes` extra is an ImportError before any start point is computed)

    record = _checked_record(record, deprecated)
    _check_arguments(model, num_warmup, num_samples, num_chains, chain_method, max_tree_depth, pointwise_loglik)
    map_options = _checked_map_options(map_options)
    timings: dict[str, float] = {}
    t_total = time.perf_counter()
    settings = _sampler_settings(model, num_warmup, num_chains, chain_method, max_tree_depth, dense_mass,
                                 target_accept_prob, seed)
    resume = _resumable(checkpoint, settings, record.allow_device_change)  # refuses before any numerics

    with timed_phase(timings, "initialisation"):
        starts, map_result = _initial_points(model, resume, init, num_chains, seed, init_jitter, progress,
                                             map_options)
        kernel, mcmc = _nuts(model, num_warmup, num_samples, num_chains, chain_method, max_tree_depth, dense_mass,
                             target_accept_prob, progress)
    samples, warm_n_steps = _warm_up_and_sample(kernel, mcmc, model, starts, resume, checkpoint, settings,
                                                jax.random.PRNGKey(seed), num_chains, chain_method, num_warmup,
                                                collect_warmup_stats, timings)
    draws_u, stats, physical, loglik = _converted_draws(model, mcmc, samples, timings, pointwise_loglik)
    sampler = _sampler_record(settings, num_samples, mcmc, stats, warm_n_steps, resume, timings["sampling"],
                              chain_method, num_chains)
    idata, summary, info = _finished_idata(model, draws_u, stats, loglik, physical, sampler, timings, t_total,
                                           diagnostics, record.archive)
    return Posterior(
        inference_data=idata, timings=timings, execution_info=info, num_leapfrog=sampler["num_leapfrog"],
        num_leapfrog_warmup=sampler["num_leapfrog_warmup"], seconds_per_leapfrog=sampler["seconds_per_leapfrog"],
        draws_u=draws_u, summary=summary, chain_method=str(mcmc.chain_method), resumed=bool(resume),
        map_result=map_result, sample_stats=stats, warmup_n_steps=warm_n_steps, model=model, progress=bool(progress),
    )


_DEPRECATED = ("archive", "allow_device_change")


def _checked_record(record, deprecated: dict) -> Record:
    """The :class:`Record` of a :func:`sample` call: ``record`` (None: ``Record()``) or one built from the
    deprecated ``archive=`` / ``allow_device_change=`` keywords, each with a DeprecationWarning naming the new
    spelling. TypeError for any other keyword; ValueError for a non-Record ``record`` or both spellings at once."""
    unknown = sorted(set(deprecated) - set(_DEPRECATED))
    if unknown:
        raise TypeError(f"sample() got an unexpected keyword argument {unknown[0]!r}")
    if record is not None and not isinstance(record, Record):
        raise ValueError(f"record must be a msrm.gp.posterior.Record or None, got {type(record).__name__}")
    if not deprecated:
        return record if record is not None else Record()
    if record is not None:
        raise ValueError(f"record: pass {sorted(deprecated)} inside record=Record(...), not beside it")
    for name in deprecated:
        warnings.warn(f"sample({name}=...) is deprecated: pass record=msrm.gp.posterior.Record({name}=...)",
                      DeprecationWarning, stacklevel=3)
    if "allow_device_change" in deprecated:  # the keyword was read as a truth value
        deprecated = {**deprecated, "allow_device_change": bool(deprecated["allow_device_change"])}
    return Record(**deprecated)


# ------------------------------------------------------------------------------------------ steps of sample


@contextlib.contextmanager
def timed_phase(timings: dict, phase: str) -> Iterator[None]:
    """Add the wall seconds of the block to ``timings[phase]`` (starting from 0)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        timings[phase] = timings.get(phase, 0.0) + (time.perf_counter() - t0)


def _check_arguments(model, num_warmup, num_samples, num_chains, chain_method, max_tree_depth,
                     pointwise_loglik) -> None:
    """Raise ValueError for a bad count or tree depth, an unknown chain method, pointwise log-likelihood asked of a
    model without ``pointwise_log_likelihood``, or JAX running without float64."""
    import jax

    for name, v, lo in (("num_warmup", num_warmup, 0), ("num_samples", num_samples, 1), ("num_chains", num_chains, 1),
                        ("max_tree_depth", max_tree_depth, 1)):
        if not isinstance(v, (int, np.integer)) or v < lo:
            raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
    if chain_method not in CHAIN_METHODS:
        raise ValueError(f"chain_method must be one of {CHAIN_METHODS}, got {chain_method!r}")
    if pointwise_loglik and not hasattr(model, "pointwise_log_likelihood"):
        raise ValueError("pointwise_loglik=True needs model.pointwise_log_likelihood(u); this model has none")
    if not jax.config.jax_enable_x64:
        raise ValueError("float64 is the numerical contract: call msrm.runtime.enable_x64() before sampling")


def _sampler_settings(model, num_warmup, num_chains, chain_method, max_tree_depth, dense_mass, target_accept_prob,
                      seed) -> dict:
    """The settings a warm-up checkpoint is bound to (and recorded in the ``sampler`` attribute)."""
    return {
        "num_params": int(model.num_params), "num_warmup": int(num_warmup), "num_chains": int(num_chains),
        "chain_method": chain_method, "max_tree_depth": int(max_tree_depth), "dense_mass": bool(dense_mass),
        "target_accept_prob": float(target_accept_prob), "seed": int(seed),
    }


def _resumable(checkpoint, settings: dict, allow_device_change: bool) -> bool:
    """True when a checkpoint exists at ``checkpoint``; then its settings must equal ``settings`` (ValueError) and
    its device identity this process's unless ``allow_device_change`` (:class:`Record`; DeviceMismatchError)."""
    ckpt_json = _ckpt_paths(checkpoint)[1] if checkpoint is not None else None
    if ckpt_json is None or not ckpt_json.exists():
        return False
    meta = json.loads(ckpt_json.read_text())
    _check_settings(meta.get("settings", {}), settings, ckpt_json)
    here = device_identity()
    if meta.get("device_identity") != here and not allow_device_change:
        raise DeviceMismatchError(
            f"checkpoint {ckpt_json} was made on {meta.get('device_identity')}, this process runs on {here}; "
            f"pass record=msrm.gp.posterior.Record(allow_device_change=True) to resume anyway"
        )
    return True


def _check_settings(saved: dict, now: dict, where: Path) -> None:
    """Raise ValueError naming the first setting whose saved value differs from this call's."""
    for k, v in now.items():
        if k in saved and saved[k] != v:
            raise ValueError(f"checkpoint {where}: {k}={saved[k]!r} was saved, this call has {k}={v!r}")


def _checked_map_options(map_options) -> dict:
    """``map_options`` as a dict, refusing a non-dict and the keywords :func:`sample` sets itself."""
    if map_options is None:
        return {}
    if not isinstance(map_options, dict):
        raise ValueError(f"map_options must be a dict of fit_map keywords or None, got {type(map_options).__name__}")
    taken = sorted({"model", "seed", "progress"} & set(map_options))
    if taken:
        raise ValueError(f"map_options: {taken} are set by sample() itself (its seed and progress arguments)")
    return dict(map_options)


def _checked_starts(model, init, num_chains: int, seed: int, init_jitter: float, progress: bool,
                    map_options: dict | None = None):
    """:func:`_starts`, refusing a chain whose start has a non-finite log density."""
    starts, map_result = _starts(model, init, num_chains, seed, init_jitter, progress, map_options)
    for c, u in enumerate(starts):
        v, _ = model.value_and_grad(u)
        if not np.isfinite(v):
            raise ValueError(f"init: chain {c} starts where the log density is not finite ({v})")
    return starts, map_result


def _nuts(model, num_warmup, num_samples, num_chains, chain_method, max_tree_depth, dense_mass, target_accept_prob,
          progress):
    """(kernel, mcmc): NumPyro NUTS on ``potential_fn(u) = -model.log_density(u)`` and its MCMC driver."""
    from numpyro.infer import MCMC, NUTS

    log_density = model.log_density

    def potential_fn(u):
        return -log_density(u)

    kernel = NUTS(potential_fn=potential_fn, max_tree_depth=max_tree_depth, dense_mass=dense_mass,
                  target_accept_prob=target_accept_prob)
    mcmc = MCMC(kernel, num_warmup=int(num_warmup),
                num_samples=int(num_samples), num_chains=int(num_chains), chain_method=chain_method,
                progress_bar=progress)
    return kernel, mcmc


def _initial_points(model, resume: bool, init, num_chains: int, seed: int, init_jitter: float, progress: bool,
                    map_options: dict):
    """(num_chains, num_params) start points and the MAP result (or None) of :func:`_checked_starts`; (None, None)
    when resuming from a checkpoint, whose saved state holds the positions.

    ArviZ is imported first so that its one-time import cost is booked in the initialisation phase of the caller
    rather than as draw conversion.
    """
    import arviz  # noqa: F401

    if resume:
        return None, None
    return _checked_starts(model, init, num_chains, seed, init_jitter, progress, map_options)


def _resumed_state(kernel, mcmc, checkpoint, num_chains, chain_method, num_params, num_warmup, rng_key):
    """The post-warm-up state loaded from ``checkpoint``, set as ``mcmc.post_warmup_state``."""
    template = _template_state(kernel, mcmc, num_chains, chain_method, num_params, num_warmup, rng_key)
    state, _meta = load_checkpoint(checkpoint, template)
    mcmc.post_warmup_state = state
    return state


def _warm_up(mcmc, model, starts, num_chains, num_warmup, rng_key, collect_warmup_stats):
    """Run NumPyro's warm-up from ``starts``.

    Returns (post-warm-up state, init_params, (chains, num_warmup) leapfrog steps of every warm-up iteration or None
    when warm-up draws were not collected).
    """
    import jax
    import jax.numpy as jnp

    warm_steps = None
    init_params = jnp.asarray(starts[0] if num_chains == 1 else starts)
    if collect_warmup_stats is None:
        collect_warmup_stats = num_chains * num_warmup * model.num_params * 8 <= 2**28
    mcmc.warmup(rng_key, init_params=init_params, extra_fields=("num_steps",),
                collect_warmup=bool(collect_warmup_stats) and num_warmup > 0)
    jax.block_until_ready(mcmc.post_warmup_state)
    if collect_warmup_stats and num_warmup > 0:
        warm_steps = np.asarray(mcmc.get_extra_fields(group_by_chain=True)["num_steps"]).astype(np.int64)
        warm_steps = warm_steps.reshape(num_chains, -1)
    return mcmc.post_warmup_state, init_params, warm_steps


def _run_sampling(mcmc, state, init_params):
    """Sample from the post-warm-up ``state``: the draws grouped by chain, finished on the device."""
    import jax

    mcmc.run(state.rng_key, init_params=init_params, extra_fields=SAMPLE_FIELDS)
    return jax.block_until_ready(mcmc.get_samples(group_by_chain=True))


def _warm_up_and_sample(kernel, mcmc, model, starts, resume: bool, checkpoint, settings: dict, rng_key, num_chains,
                        chain_method, num_warmup, collect_warmup_stats, timings: dict):
    """Warm up from ``starts`` (saving the checkpoint when one is asked for) or load the checkpointed warm-up, then
    sample; book the wall seconds of ``warmup``, ``checkpoint`` (when there is one) and ``sampling`` in
    ``timings``, in that order and back to back.

    ``starts`` is (num_chains, num_params), or None when resuming. Returns (the draws grouped by chain, the
    (chains, num_warmup) leapfrog steps of every warm-up iteration or None when warm-up draws were not collected or
    warm-up was skipped). The sampling call is the same whether the state comes from this warm-up or from the
    checkpoint, so a resumed run gives the draws of an uninterrupted one.
    """
    if resume:
        timings["warmup"] = 0.0
        with timed_phase(timings, "checkpoint"):
            state = _resumed_state(kernel, mcmc, checkpoint, num_chains, chain_method, model.num_params, num_warmup,
                                   rng_key)
        init_params, warm_steps = state.z, None
    else:
        with timed_phase(timings, "warmup"):
            state, init_params, warm_steps = _warm_up(mcmc, model, starts, num_chains, num_warmup, rng_key,
                                                      collect_warmup_stats)
        if checkpoint is not None:
            with timed_phase(timings, "checkpoint"):
                save_checkpoint(checkpoint, state, settings)
    with timed_phase(timings, "sampling"):
        samples = _run_sampling(mcmc, state, init_params)
    return samples, warm_steps


def _draws_and_stats(samples, mcmc) -> tuple[np.ndarray, dict]:
    """(chains, draws, num_params) float64 draws and the per-draw sample stats (chains, draws): diverging, n_steps,
    tree_depth = floor(log2 n_steps) + 1, step_size, energy, acceptance_rate, lp = -potential energy."""
    draws_u = np.asarray(samples, dtype=np.float64)
    if draws_u.ndim == 2:
        draws_u = draws_u[None]
    extra = {k: np.asarray(v) for k, v in mcmc.get_extra_fields(group_by_chain=True).items()}
    n_steps = extra["num_steps"].astype(np.int64)
    stats = {
        "diverging": extra["diverging"].astype(bool),
        "n_steps": n_steps,
        "tree_depth": (np.log2(np.maximum(n_steps, 1)).astype(int) + 1),
        "step_size": extra["adapt_state.step_size"].astype(np.float64),
        "energy": extra["energy"].astype(np.float64),
        "acceptance_rate": extra["accept_prob"].astype(np.float64),
        "lp": -extra["potential_energy"].astype(np.float64),
    }
    return draws_u, stats


def _converted_draws(model, mcmc, samples, timings: dict, pointwise_loglik: bool):
    """The sampler's output in the forms the InferenceData is built from, timed as ``draw_conversion`` and
    ``pointwise_loglik``.

    Returns (draws_u (chains, draws, num_params), the per-draw sample stats (chains, draws) of
    :func:`_draws_and_stats`, the physical draws of :func:`idata.physical_draws`, the pointwise log-likelihood
    ``name -> (chains, draws, *shape)`` or None when not asked for).
    """
    with timed_phase(timings, "draw_conversion"):
        draws_u, stats = _draws_and_stats(samples, mcmc)
        physical = physical_draws(model, draws_u)
    with timed_phase(timings, "pointwise_loglik"):
        loglik = _pointwise_loglik(model, draws_u) if pointwise_loglik else None
    return draws_u, stats, physical, loglik


def _pointwise_loglik(model, draws_u: np.ndarray) -> dict:
    """name -> (chains, draws, *shape) from ``model.pointwise_log_likelihood(u)`` at every draw."""
    C, S, _ = draws_u.shape
    loglik = {}
    for c in range(C):
        for s in range(S):
            for k, v in model.pointwise_log_likelihood(draws_u[c, s]).items():
                loglik.setdefault(k, np.empty((C, S) + np.shape(v)))[c, s] = v
    return loglik


def _seconds_per_leapfrog(n_steps: np.ndarray, sampling_seconds: float, chain_method: str, num_chains: int):
    """Sampling seconds per leapfrog step (None when there were none).

    Vectorized chains run in lock step until the longest tree of each draw is done, so there the count is the sum
    over draws of the largest tree; otherwise it is the sum over all chains.
    """
    if chain_method == "vectorized" and num_chains > 1:
        lockstep = int(n_steps.max(axis=0).sum())
        return sampling_seconds / lockstep if lockstep else None
    num_leapfrog = int(n_steps.sum())
    return sampling_seconds / num_leapfrog if num_leapfrog else None


def _sampler_record(settings: dict, num_samples, mcmc, stats: dict, warm_n_steps, resume: bool,
                    sampling_seconds: float, chain_method: str, num_chains: int) -> dict:
    """The ``sampler`` attribute: ``settings`` plus num_samples, the chain method NumPyro used, the leapfrog steps
    of sampling (summed over the (chains, draws) ``stats["n_steps"]``) and of warm-up (summed over the (chains,
    num_warmup) ``warm_n_steps``, None without them), whether it resumed, and the seconds per leapfrog step."""
    num_leapfrog = int(stats["n_steps"].sum())
    warm_steps = None if warm_n_steps is None else int(warm_n_steps.sum())
    per_leapfrog = _seconds_per_leapfrog(stats["n_steps"], sampling_seconds, chain_method, num_chains)
    return {**settings, "num_samples": int(num_samples), "chain_method_used": str(mcmc.chain_method),
            "num_leapfrog": num_leapfrog, "num_leapfrog_warmup": warm_steps, "resumed": bool(resume),
            "seconds_per_leapfrog": per_leapfrog}


def _finished_idata(model, draws_u: np.ndarray, stats: dict, loglik, physical, sampler: dict, timings: dict,
                    t_total: float, diagnostics: bool, archive):
    """Build the InferenceData (booked as ``draw_conversion``), run the diagnostics, stamp the timings and archive.

    ``draws_u`` is (chains, draws, num_params), ``stats`` and ``loglik`` hold (chains, draws, ...) arrays. The
    ``total`` seconds are counted from ``t_total`` up to the diagnostics' end and written, with every phase, into
    each group's ``timings`` attribute before the NetCDF archive (when ``archive`` is a path) is written, so the
    archive carries them. Returns (InferenceData, diagnostics table or None, execution_info).
    """
    info = model.execution_info() if hasattr(model, "execution_info") else execution_info(include_jax=True)
    observed = observed_group(model)
    with timed_phase(timings, "draw_conversion"):
        idata = build_inference_data(model, draws_u, stats, log_likelihood=loglik, observed=observed,
                                     attrs={"execution_info": info, "sampler": sampler}, physical=physical)
    with timed_phase(timings, "diagnostics"):
        summary = diagnostics_summary(idata) if diagnostics else None
    timings["total"] = time.perf_counter() - t_total
    for group in group_names(idata):
        idata[group].attrs["timings"] = json.dumps(timings)
    if archive is not None:
        save_netcdf(idata, archive)
    return idata, summary, info


def observed_group(model):
    """The ``observed_data`` summary: ``model.observed_summary()``, else :func:`idata.observed_summary` of
    ``model.data`` when that is a Dataset, else None."""
    if hasattr(model, "observed_summary"):
        return model.observed_summary()
    if hasattr(getattr(model, "data", None), "stream_keys"):
        return observed_summary(model.data)
    return None


def diagnostics_summary(idata):
    """The diagnostics table of :func:`msrm.diagnostics.summarize`."""
    from ..diagnostics import summarize

    return summarize(idata)


def _template_state(kernel, mcmc, num_chains, chain_method, num_params, num_warmup, rng_key):
    """An HMCState with the right pytree structure, shapes and dtypes for loading a checkpoint into.

    Built with ``jax.eval_shape`` so no gradient is evaluated.
    """
    import copy

    import jax
    import jax.numpy as jnp

    k = copy.copy(kernel)
    z = jnp.zeros((num_params,))
    one = jax.eval_shape(lambda key, u: k.init(key, num_warmup, u, (), {}), rng_key, z)
    if num_chains == 1:
        return one
    return jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct((num_chains,) + s.shape, s.dtype), one)
