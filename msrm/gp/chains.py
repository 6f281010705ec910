r"""Independent NUTS chains in separate processes (or on separate devices), merged into one InferenceData.

Chains of one posterior are independent given their seeds, so they need no communication: each runs
:func:`msrm.gp.posterior.sample` with ``num_chains=1`` and its own seed in its own worker, through
:func:`msrm.parallel.run_tasks` (joblib ``loky`` processes here, ``dask`` workers on a cluster, or
``sequential`` in this process). Jitted functions do not pickle, so the model is rebuilt inside the worker from
``build_model``: a picklable zero-argument callable (a module-level function or ``functools.partial``) or a
tuple ``(data, spec)`` / ``(data, spec, kwargs)`` for :class:`msrm.GPMSRM`. Each chain may write its own
NetCDF archive (``archive_dir/chain<i>_seed<seed>.nc``) carrying its seed and execution_info; the chains that
finished are merged by :func:`merge_chains` (concatenated along ``chain``). A chain that raises is reported with
its seed and traceback in :attr:`Chains.failures`; it does not stop the others.

On several accelerators, ``devices=[0, 1, ...]`` gives chain ``i`` the device ``devices[i % len(devices)]``: the
model is built and sampled under ``jax.default_device`` of that device (for the tuple form the model's data are
also committed there with ``GPMSRM(..., devices=[d])``). Processes that share GPUs should not preallocate device
memory (``msrm.runtime.configure(preallocate=False)`` or ``XLA_PYTHON_CLIENT_PREALLOCATE=false``); one process per
device with ``CUDA_VISIBLE_DEVICES`` set before JAX starts is the alternative (book chapter "Scaling").

Each worker switches float64 on with :func:`msrm.runtime.enable_x64` (an explicit call, as everywhere) and gives
the LAPACK callback the same BLAS thread budget that ``run_tasks`` gives the worker, so chains in parallel do
not oversubscribe the cores.
"""
from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

__all__ = ["Chains", "sample_chains", "merge_chains", "chain_records", "align_merged", "ChainAlignmentError"]


@dataclass
class Chains:
    """Result of :func:`sample_chains`.

    Fields:
        inference_data: the merged InferenceData of the chains that finished (None when none did).
        seeds: the seed of every chain asked for, in chain order.
        records: per finished chain: ``chain``, ``seed``, ``device``, ``archive``, ``execution_info``, ``timings``.
        failures: per failed chain: ``chain``, ``seed``, ``error`` (traceback text).
        wall_s: seconds for the whole call.
    """

    inference_data: Any
    seeds: list
    records: list = field(default_factory=list)
    failures: list = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failures


def _build(build_model, device):
    if callable(build_model):
        return build_model()
    from .model import GPMSRM

    data, spec, *rest = build_model
    kwargs = dict(rest[0]) if rest else {}
    if device is not None and "devices" not in kwargs:
        kwargs["devices"] = [device]
    return GPMSRM(data, spec, **kwargs)


def _chain_task(task: dict) -> dict:
    """One chain in a worker: build the model, sample one chain, archive it; return what the parent merges."""
    from .. import runtime

    runtime.enable_x64()
    import jax

    from . import linalg
    from .idata import group_names, save_netcdf
    from .posterior import sample

    device = task["device"]
    place = jax.default_device(jax.devices()[device]) if device is not None else contextlib.nullcontext()
    threads = linalg.callback_threads(task["blas_threads"]) if task["blas_threads"] else contextlib.nullcontext()
    with place, threads:
        model = _build(task["build_model"], device)
        post = sample(model, num_chains=1, seed=task["seed"], **task["sample_kwargs"])
    idata = post.inference_data
    stamp = {"chain_index": task["chain"], "chain_seed": task["seed"]}
    for group in group_names(idata):
        idata[group].attrs.update(stamp)
    archive = None
    if task["archive"] is not None:
        archive = str(save_netcdf(idata, task["archive"]))
    return {"chain": task["chain"], "seed": task["seed"], "device": device, "archive": archive,
            "execution_info": post.execution_info, "timings": post.timings, "inference_data": idata}


def _check_seeds(num_chains, seeds) -> list[int]:
    if isinstance(num_chains, bool) or not isinstance(num_chains, (int, np.integer)) or num_chains < 1:
        raise ValueError(f"num_chains must be a positive integer, got {num_chains!r}")
    if seeds is None:
        return list(range(int(num_chains)))
    seeds = list(seeds)
    if len(seeds) != num_chains:
        raise ValueError(f"seeds: {len(seeds)} given for num_chains={num_chains}")
    for s in seeds:
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0:
            raise ValueError(f"seeds: every seed must be a non-negative integer, got {s!r}")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds: chains need distinct seeds, got {seeds}")
    return [int(s) for s in seeds]


def sample_chains(
    build_model: Callable[[], Any] | tuple,
    num_chains: int,
    *,
    seeds: Sequence[int] | None = None,
    backend: str = "loky",
    client=None,
    n_jobs: int | None = None,
    archive_dir: str | Path | None = None,
    devices: Sequence[int] | None = None,
    progress: bool = False,
    align_factors: bool = True,
    **sample_kwargs,
) -> Chains:
    """Run ``num_chains`` independent NUTS chains, one per task, and merge them.

    Args:
        build_model: picklable zero-argument callable returning the model, or ``(data, spec[, kwargs])`` for
            :class:`msrm.GPMSRM`.
        num_chains: chains (>= 1).
        seeds: one distinct seed per chain (default ``0 .. num_chains - 1``); chain ``i`` calls
            ``sample(model, num_chains=1, seed=seeds[i], ...)``.
        backend, client, n_jobs: as :func:`msrm.parallel.run_tasks` (``"loky"``, ``"dask"`` with a
            ``dask.distributed.Client``, ``"sequential"``).
        archive_dir: folder for one NetCDF archive per chain (``chain<i>_seed<seed>.nc``), written atomically
            by the worker (on a cluster the folder must be shared).
        devices: indices into ``jax.devices()``; chain ``i`` runs on ``devices[i % len(devices)]``.
        progress: a bar over chains (NumPyro's own bars stay off unless ``sample_kwargs`` asks for them).
        align_factors: map every chain's factors onto chain 0's (sign and order, :func:`align_merged`) before
            the merged draws are returned (for models with loadings blocks: GP-MSRM); the transform is recorded in
            the groups' ``factor_alignment`` attribute. A chain that cannot be matched unambiguously raises
            :class:`ChainAlignmentError`, which carries the unmerged chains.
        **sample_kwargs: passed to :func:`msrm.gp.posterior.sample` (``num_warmup``, ``num_samples``, ``init``,
            ``max_tree_depth``, ...); ``num_chains``, ``seed``, ``record`` (each chain's archive comes from
            ``archive_dir``), ``archive``, ``checkpoint`` and ``chain_method`` are set per chain and may not be
            given.
    Returns:
        :class:`Chains`.
    Raises:
        ValueError: bad arguments (named), before any chain starts.
        RuntimeError: every chain failed (the message lists each seed and the last line of its error).
        ChainAlignmentError: the chains' factors could not be matched (``align_factors``).
    """
    from ..parallel import run_tasks

    seeds, devices = _checked_arguments(num_chains, seeds, build_model, sample_kwargs, backend, devices)
    tasks, threads = _chain_tasks(build_model, seeds, devices, archive_dir, backend, n_jobs, sample_kwargs)
    t0 = time.perf_counter()
    results = run_tasks(_chain_task, tasks, n_jobs=n_jobs, backend=backend, client=client, progress=progress,
                        desc="chains", blas_threads=threads)
    wall = time.perf_counter() - t0
    done, failures = _finished_chains(results)
    records, merged = _merged(done, failures, build_model, align_factors)
    return Chains(inference_data=merged, seeds=seeds, records=records, failures=failures, wall_s=wall)


def _checked_arguments(num_chains, seeds, build_model, sample_kwargs: dict, backend: str,
                       devices) -> tuple[list[int], list | None]:
    """(the seed of every chain, ``devices`` as a list or None); ValueError naming the first bad argument of
    :func:`sample_chains`, so that nothing starts on bad input."""
    from ..parallel import BACKENDS

    seeds = _check_seeds(num_chains, seeds)
    if not (callable(build_model) or (isinstance(build_model, tuple) and len(build_model) in (2, 3))):
        raise ValueError("build_model must be a picklable zero-argument callable or a tuple (data, spec[, kwargs])")
    if isinstance(build_model, tuple) and len(build_model) == 3 and not isinstance(build_model[2], dict):
        raise ValueError(f"build_model: the third item must be a dict of GPMSRM keyword arguments, got "
                         f"{type(build_model[2]).__name__}")
    for name in ("num_chains", "seed", "record", "archive", "checkpoint", "chain_method"):
        if name in sample_kwargs:
            raise ValueError(f"{name}: set per chain by sample_chains; do not pass it")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if devices is not None:
        devices = list(devices)
        if not devices or any(isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 0 for d in devices):
            raise ValueError(f"devices must be a non-empty list of device indices, got {devices!r}")
    return seeds, devices


def _chain_tasks(build_model, seeds: list[int], devices: list | None, archive_dir, backend: str, n_jobs,
                 sample_kwargs: dict) -> tuple[list[dict], int | None]:
    """(one task dict of :func:`_chain_task` per seed, the BLAS thread budget of each worker or None).

    Creates ``archive_dir`` and sets ``sample_kwargs["progress"]`` to False unless given (NumPyro's bars stay off
    in workers). The thread budget is the one ``run_tasks`` gives each worker (the physical cores shared among
    the loky workers, one per dask worker; None for ``"sequential"``, which leaves this process's BLAS threads as
    they are), handed to the LAPACK callback too so that chains in parallel do not oversubscribe the cores.
    """
    from ..parallel import resolve_n_jobs
    from ..runtime import physical_cores

    folder = None
    if archive_dir is not None:
        folder = Path(archive_dir)
        folder.mkdir(parents=True, exist_ok=True)
    sample_kwargs.setdefault("progress", False)
    if backend == "loky":
        threads = max(1, physical_cores() // resolve_n_jobs(n_jobs, len(seeds)))
    elif backend == "dask":
        threads = 1
    else:
        threads = None
    tasks = [{
        "chain": i, "seed": s, "build_model": build_model, "sample_kwargs": dict(sample_kwargs),
        "device": None if devices is None else int(devices[i % len(devices)]),
        "archive": None if folder is None else str(folder / f"chain{i}_seed{s}.nc"), "blas_threads": threads,
    } for i, s in enumerate(seeds)]
    return tasks, threads


def _finished_chains(results) -> tuple[list[dict], list[dict]]:
    """(the values of :func:`_chain_task` of the chains that finished, ``chain``/``seed``/``error`` of those that
    failed), both in chain order; RuntimeError listing every seed and its error's last line when none finished."""
    done = [r.value for r in results if r.ok]
    failures = [{"chain": r.task["chain"], "seed": r.task["seed"], "error": r.error} for r in results if not r.ok]
    if not done:
        lines = "; ".join(f"chain {f['chain']} (seed {f['seed']}): {f['error'].strip().splitlines()[-1]}"
                          for f in failures)
        raise RuntimeError(f"sample_chains: every chain failed: {lines}")
    return done, failures


def _merged(done: list[dict], failures: list[dict], build_model, align_factors: bool):
    """(the per-chain records, without their InferenceData; the finished chains merged by :func:`merge_chains`).

    With ``align_factors`` and more than one chain, the model is built once more in this process, only to tell
    whether it has loadings blocks (factors identified up to sign and order) and, if so, to map every chain's
    factors onto chain 0's by :func:`align_merged`; an ambiguous match raises :class:`ChainAlignmentError`
    carrying the unmerged chains.
    """
    records = [{k: v for k, v in d.items() if k != "inference_data"} for d in done]
    idatas = [d["inference_data"] for d in done]
    merged = merge_chains(idatas, seeds=[d["seed"] for d in done], records=records, failures=failures)
    if align_factors and len(done) > 1:
        model = _build(build_model, None)
        if any(getattr(b, "field", None) == "loadings" for b in getattr(model, "blocks", ())):
            try:
                merged = align_merged(model, merged)
            except ValueError as exc:
                raise ChainAlignmentError(str(exc), idatas) from exc
    return records, merged


class ChainAlignmentError(ValueError):
    """The chains' factors could not be matched unambiguously; nothing was merged.

    ``inference_data`` holds each finished chain's own InferenceData, unmerged, so no draw is lost.
    """

    def __init__(self, message: str, inference_data: list):
        super().__init__(f"sample_chains: not merging chains whose factors differ in sign or order ambiguously "
                         f"({message}); the chains are in this error's inference_data")
        self.inference_data = inference_data


def align_merged(model, merged):
    """Merged chains with every chain's factors mapped onto chain 0's by a signed permutation.

    GP-MSRM identifies factors only up to sign and order, so independent chains can sit in different but
    equivalent modes; pooling them unaligned would average flipped factors. The matching and the transform are
    :func:`msrm.gp.align_chains.align_chain_draws` (loadings columns permuted and sign-flipped, lengthscales
    permuted). The ``posterior`` group is recomputed from the aligned unconstrained draws; ``sample_stats``,
    ``log_likelihood`` (invariant to the transform) and ``observed_data`` are kept. Every group's attributes gain
    ``factor_alignment`` (JSON: reference chain, per chain the permutation, signs and matching margin).

    Raises:
        ValueError: a chain's match is ambiguous (from ``align_chain_draws``).
    """
    from .align_chains import align_chain_draws
    from .idata import build_inference_data, from_groups, group_dataset, group_names, json_attrs

    groups = {g: group_dataset(merged, g) for g in group_names(merged)}
    u = groups["unconstrained_posterior"]["u"].values
    result = align_chain_draws(model, u)
    record = json_attrs({"factor_alignment": {
        "reference": result.reference, "permutations": result.permutations.tolist(),
        "signs": result.signs.astype(int).tolist(),
        "margins": [None if not np.isfinite(m) else float(m) for m in result.margins]}})
    identity = all((p == np.arange(p.size)).all() for p in result.permutations) and (result.signs > 0).all()
    if not identity:
        groups["unconstrained_posterior"] = groups["unconstrained_posterior"].copy(
            data={"u": result.draws})
        post = group_dataset(build_inference_data(model, result.draws), "posterior")
        post.attrs = dict(groups["posterior"].attrs)
        groups["posterior"] = post
    out = {}
    for g, ds in groups.items():
        ds = ds.copy()
        ds.attrs = {**ds.attrs, **record}
        out[g] = ds
    return from_groups(out)


def _decoded(value):
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def merge_chains(idatas: Sequence[Any], *, seeds: Sequence[int] | None = None, records: Sequence[dict] | None = None,
                 failures: Sequence[dict] | None = None):
    """Concatenate InferenceData objects (ArviZ 0.23) or DataTrees (ArviZ 1.x) along ``chain`` (renumbered 0, 1,
    ...), keeping what each chain was; the result is the installed ArviZ's container (:func:`.idata.from_groups`).

    Every group with a ``chain`` dimension (posterior, unconstrained_posterior, sample_stats, log_likelihood) is
    concatenated; groups without one (observed_data) must be identical and are kept once. The merged groups'
    attributes are the first chain's, plus ``chain_seeds`` (one per merged chain), ``chains`` (per chain:
    seed, sampler settings, execution_info, timings, archive) and ``failed_chains``, JSON-encoded so the merged
    object can itself be written to NetCDF (:func:`chain_records` decodes them).

    Args:
        idatas: the chains' InferenceData (each may hold one or more chains; all with the same draws and
            variables).
        seeds: seed of each input (default: read from its ``sampler`` attribute).
        records: extra per-input facts (archive path, device) to keep.
        failures: failed chains to record (``chain``, ``seed``, ``error``).
    Raises:
        ValueError: nothing to merge, different groups, variables or draw counts, or different observed data.
    """
    import xarray as xr

    from .idata import from_groups, group_dataset, group_names, json_attrs

    idatas = list(idatas)
    if not idatas:
        raise ValueError("merge_chains: no InferenceData to merge")
    groups = group_names(idatas[0])
    for i, d in enumerate(idatas[1:], start=1):
        if set(group_names(d)) != set(groups):  # the order differs between ArviZ versions and archives
            raise ValueError(f"merge_chains: input {i} has groups {group_names(d)}, input 0 has {groups}")
    if seeds is not None and len(seeds) != len(idatas):
        raise ValueError(f"merge_chains: {len(seeds)} seeds for {len(idatas)} inputs")
    per_chain, chain_seeds = [], []
    for i, d in enumerate(idatas):
        attrs = group_dataset(d, groups[0]).attrs
        sampler = _decoded(attrs.get("sampler")) or {}
        seed = seeds[i] if seeds is not None else (sampler.get("seed") if isinstance(sampler, dict) else None)
        n_chains = group_dataset(d, groups[0]).sizes.get("chain", 1)
        entry = {"input": i, "seed": seed, "sampler": sampler,
                 "execution_info": _decoded(attrs.get("execution_info")), "timings": _decoded(attrs.get("timings"))}
        if records is not None:
            entry.update({k: v for k, v in records[i].items() if k not in ("execution_info", "timings")})
        per_chain.extend([entry] * n_chains)
        chain_seeds.extend([seed] * n_chains)
    extra = json_attrs({"chain_seeds": chain_seeds, "chains": per_chain, "failed_chains": list(failures or [])})
    out = {}
    for g in groups:
        parts = [group_dataset(d, g) for d in idatas]
        if "chain" not in parts[0].dims:
            for i, p in enumerate(parts[1:], start=1):
                if not p.equals(parts[0]):
                    raise ValueError(f"merge_chains: group {g!r} of input {i} differs from input 0 (different data?)")
            ds = parts[0].copy()
        else:
            for i, p in enumerate(parts[1:], start=1):
                if set(p.data_vars) != set(parts[0].data_vars):
                    raise ValueError(f"merge_chains: group {g!r} of input {i} has other variables than input 0")
                if p.sizes.get("draw") != parts[0].sizes.get("draw"):
                    raise ValueError(f"merge_chains: group {g!r}: input {i} has {p.sizes.get('draw')} draws, "
                                     f"input 0 has {parts[0].sizes.get('draw')}")
            start, renumbered = 0, []
            for p in parts:
                n = p.sizes["chain"]
                renumbered.append(p.assign_coords(chain=np.arange(start, start + n)))
                start += n
            ds = xr.concat(renumbered, dim="chain", join="exact", combine_attrs="override")
        ds.attrs = {k: v for k, v in parts[0].attrs.items() if k not in ("chain_index", "chain_seed")}
        ds.attrs.update(extra)
        out[g] = ds
    return from_groups(out)


def chain_records(idata) -> dict:
    """The per-chain facts :func:`merge_chains` stored: ``{"chain_seeds": [...], "chains": [...],
    "failed_chains": [...]}`` (decoded from JSON, as after a NetCDF round trip)."""
    from .idata import group_dataset, group_names

    attrs = group_dataset(idata, group_names(idata)[0]).attrs
    return {k: _decoded(attrs.get(k)) for k in ("chain_seeds", "chains", "failed_chains")}
