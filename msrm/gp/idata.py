"""ArviZ InferenceData for GP posteriors: physical parameters with named dims, NetCDF archives.

Variables of the ``posterior`` group are the model's physical parameters (``model.constrain(u).flatten()``), one
variable per entry, with the dims and coords that ``model.param_dims()`` gives (participant/modality key, feature,
factor, response parameter). NetCDF (HDF5) reserves ``/`` in names, so every variable and dim name has ``/``
replaced by ``|`` (:func:`safe_name`): ``loadings[p0/brain]`` is stored as ``loadings[p0|brain]``; the original
name is kept in the variable's ``msrm_name`` attribute. Nested attributes (execution_info, timings) are stored as
JSON strings and decoded by :func:`load_netcdf`.

**ArviZ 0.23 and 1.x.** ArviZ 0.23 holds the groups in an ``arviz.InferenceData`` (``idata.groups()`` is a
method, ``idata[name]`` an ``xarray.Dataset``); ArviZ 1.x holds them in an ``xarray.DataTree`` (one child node per
group, ``DataTree.groups`` is a property of paths, ``tree[name]`` a node, ``tree[name].to_dataset()`` its
Dataset). :func:`from_groups`, :func:`group_names` and :func:`group_dataset` give one spelling for both, so what
a user gets is the container of the installed ArviZ. Both versions write one NetCDF (HDF5) group per ArviZ group,
so an archive written under one version loads under the other (``tests/data`` holds one written under 0.23).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from .. import atomic

__all__ = ["safe_name", "physical_draws", "observed_summary", "build_inference_data", "save_netcdf", "load_netcdf",
           "json_attrs", "arviz_major", "from_groups", "group_names", "group_dataset"]

_JSON_ATTRS = ("execution_info", "timings", "sampler", "checkpoint", "map")


def arviz_major() -> int:
    """Major version of the installed ArviZ (0 for 0.23, 1 for 1.x); imports ArviZ."""
    import arviz as az

    return int(str(az.__version__).split(".")[0])


def _is_tree(idata) -> bool:
    """Whether ``idata`` is an ``xarray.DataTree`` (ArviZ 1.x) rather than an ``arviz.InferenceData`` (0.23)."""
    import xarray as xr

    return isinstance(idata, xr.DataTree)


def from_groups(groups: Mapping[str, Any]):
    """The installed ArviZ's container of ``groups`` (name -> ``xarray.Dataset``, attributes kept).

    ArviZ 0.23: ``arviz.InferenceData(**groups)``; ArviZ 1.x: ``xarray.DataTree`` with one child per group.
    """
    import xarray as xr

    for name, ds in groups.items():
        if not isinstance(ds, xr.Dataset):
            raise ValueError(f"from_groups: group {name!r} must be an xarray.Dataset, got {type(ds).__name__}")
        if not name or "/" in name:
            raise ValueError(f"from_groups: group name {name!r} must be non-empty and contain no '/'")
    if arviz_major() >= 1:
        return xr.DataTree.from_dict({f"/{name}": ds for name, ds in groups.items()})
    import arviz as az

    return az.InferenceData(**groups)


def group_names(idata) -> list[str]:
    """Names of the groups of an InferenceData (0.23) or DataTree (1.x), in their stored order."""
    if _is_tree(idata):
        return list(idata.children)
    groups = getattr(idata, "groups", None)
    if not callable(groups):
        raise ValueError(f"group_names needs an arviz.InferenceData or an xarray.DataTree, got {type(idata).__name__}")
    return list(groups())


def group_dataset(idata, name: str):
    """Group ``name`` as an ``xarray.Dataset`` (a DataTree node is converted with ``to_dataset()``).

    Raises:
        KeyError: no such group.
    """
    if name not in group_names(idata):
        raise KeyError(f"no group {name!r} (have {group_names(idata)})")
    part = idata[name]
    return part.to_dataset() if _is_tree(idata) else part


def safe_name(name: str) -> str:
    """A NetCDF-safe variable/dim name: ``/`` -> ``|``."""
    return str(name).replace("/", "|")


def _dims_entry(name: str, param_dims: Mapping[str, Any]) -> tuple[str, tuple | None, dict | None]:
    """(display name, dims, coords) for a flattened parameter name, matched against ``param_dims`` keys.

    Accepted spellings of the same entry: ``"loadings/p0/brain"`` (Params.flatten) and ``"loadings[p0/brain]"``.
    """
    head, sep, rest = name.partition("/")
    for cand in (name, f"{head}[{rest}]" if sep else name):
        if cand in param_dims:
            dims, coords = param_dims[cand]
            return cand, tuple(dims), dict(coords or {})
    return name, None, None


def physical_draws(model, draws_u: np.ndarray) -> dict[str, np.ndarray]:
    """Map unconstrained draws (C, S, d) to physical arrays name -> (C, S, *shape).

    Uses ``model.constrained_blocks(u)`` (name -> array) when the model has it, else
    ``model.constrain(u).flatten()``.
    """
    C, S, _ = draws_u.shape
    blocks = getattr(model, "constrained_blocks", None)
    out: dict[str, np.ndarray] = {}
    for c in range(C):
        for s in range(S):
            u = np.asarray(draws_u[c, s])
            flat = blocks(u) if blocks is not None else model.constrain(u).flatten()
            if not out:
                out = {k: np.empty((C, S) + np.shape(v)) for k, v in flat.items()}
            for k, v in flat.items():
                out[k][c, s] = v
    return out


def _dataset_parts(arrays: Mapping[str, np.ndarray], param_dims: Mapping[str, Any], lead: int):
    """(variables dict name -> (dims, values, attrs), coords) with dims named and made NetCDF-safe."""
    variables, coords = {}, {}
    for name, values in arrays.items():
        shown, dims, dcoords = _dims_entry(name, param_dims)
        shape = np.shape(values)[lead:]
        if dims is None or len(dims) != len(shape):
            dims = tuple(f"{shown}_dim_{i}" for i in range(len(shape)))
            dcoords = {}
        dims = tuple(safe_name(d) for d in dims)
        for d, size in zip(dims, shape):
            vals = dcoords.get(d) if d in dcoords else None
            if vals is None:
                # coords keyed by the unsanitised dim name
                for k, v in dcoords.items():
                    if safe_name(k) == d:
                        vals = v
            vals = np.arange(size) if vals is None else np.asarray(list(vals))
            if len(vals) != size:
                raise ValueError(f"param_dims[{shown!r}]: dim {d!r} has {len(vals)} coords but the array has {size}")
            if d in coords and not np.array_equal(coords[d], vals):
                raise ValueError(f"param_dims: dim {d!r} has different coords in two variables")
            coords[d] = vals
        variables[safe_name(shown)] = (dims, np.asarray(values), {"msrm_name": shown})
    return variables, coords


def observed_summary(data) -> dict[str, np.ndarray]:
    """Per stream of an ``msrm.Dataset``: observed count, mean and sd of every feature over all runs.

    Names ``"<participant>_<modality>_n_observed"``, ``..._mean``, ``..._sd`` (each (n_features,)).
    """
    out: dict[str, np.ndarray] = {}
    for key in data.stream_keys:
        Y = np.concatenate([r.stream(key).values for r in data.runs if key in r.keys], axis=0)
        n = np.sum(~np.isnan(Y), axis=0)
        stem = key.replace("/", "_")
        out[f"{stem}_n_observed"] = n.astype(np.int64)
        with np.errstate(invalid="ignore", divide="ignore"):
            out[f"{stem}_mean"] = np.nanmean(Y, axis=0) if Y.size else np.zeros(Y.shape[1])
            out[f"{stem}_sd"] = np.nanstd(Y, axis=0) if Y.size else np.zeros(Y.shape[1])
    return out


def _observed_dims(name: str, ndim: int) -> tuple[str, ...]:
    """Dims of an observed-summary entry: ``<stream>_feature`` for the per-feature vectors, else generic names."""
    for suffix in ("_n_observed", "_mean", "_sd"):
        if ndim == 1 and name.endswith(suffix):
            return (name[: -len(suffix)] + "_feature",)
    return tuple(f"{name}|dim_{i}" for i in range(ndim))


def json_attrs(attrs: Mapping[str, Any]) -> dict[str, Any]:
    """Attributes NetCDF can hold: nested values become JSON strings."""
    out = {}
    for k, v in attrs.items():
        if isinstance(v, (dict, list, tuple)) or v is None:
            out[k] = json.dumps(v, default=atomic.json_default, allow_nan=True, sort_keys=True)
        elif isinstance(v, (bool, np.bool_)):
            out[k] = int(v)
        else:
            out[k] = v
    return out


def build_inference_data(
    model,
    draws_u: np.ndarray,
    sample_stats: Mapping[str, np.ndarray] | None = None,
    *,
    log_likelihood: Mapping[str, np.ndarray] | None = None,
    observed: Mapping[str, np.ndarray] | None = None,
    attrs: Mapping[str, Any] | None = None,
    physical: Mapping[str, np.ndarray] | None = None,
):
    """An ``arviz.InferenceData`` (ArviZ 0.23) or ``xarray.DataTree`` (ArviZ 1.x) from unconstrained draws.

    Args:
        model: supplies ``constrain`` and ``param_dims()``.
        draws_u: (chains, draws, num_params) unconstrained draws (also stored, as ``unconstrained`` group).
        sample_stats: name -> (chains, draws) arrays (diverging, tree_depth, n_steps, step_size, energy, ...).
        log_likelihood: name -> (chains, draws, n) pointwise log-likelihood (dims ``<name>|node``).
        observed: name -> array summary of the observed data (``observed_data`` group).
        attrs: attributes for every group (nested values are JSON-encoded).
        physical: precomputed physical draws (default :func:`physical_draws`).
    """
    import xarray as xr

    draws_u = np.asarray(draws_u, dtype=np.float64)
    if draws_u.ndim != 3:
        raise ValueError(f"draws_u must have shape (chains, draws, num_params), got {draws_u.shape}")
    C, S, d = draws_u.shape
    param_dims = model.param_dims() if hasattr(model, "param_dims") else {}
    physical = physical_draws(model, draws_u) if physical is None else physical
    chain_draw = {"chain": np.arange(C), "draw": np.arange(S)}
    a = json_attrs(attrs or {})

    def dataset(arrays, dims_map, lead=2):
        variables, coords = _dataset_parts(arrays, dims_map, lead)
        data_vars = {k: (("chain", "draw") + dims if lead == 2 else dims, v, at)
                     for k, (dims, v, at) in variables.items()}
        return xr.Dataset(data_vars, coords={**(chain_draw if lead == 2 else {}), **coords}, attrs=a)

    groups = {"posterior": dataset(physical, param_dims)}
    groups["unconstrained_posterior"] = xr.Dataset(
        {"u": (("chain", "draw", "u_dim"), draws_u)}, coords={**chain_draw, "u_dim": np.arange(d)}, attrs=a
    )
    if sample_stats:
        groups["sample_stats"] = xr.Dataset(
            {k: (("chain", "draw"), np.asarray(v)) for k, v in sample_stats.items()}, coords=chain_draw, attrs=a
        )
    if log_likelihood:
        ll_dims = {k: ((f"{k}|node",), {}) for k in log_likelihood}
        groups["log_likelihood"] = dataset(log_likelihood, ll_dims)
    if observed:
        obs_dims = {k: (_observed_dims(k, np.ndim(v)), {}) for k, v in observed.items()}
        groups["observed_data"] = dataset(observed, obs_dims, lead=0)
    return from_groups(groups)


def save_netcdf(idata, path: str | Path) -> Path:
    """Write ``idata`` to NetCDF (h5netcdf) atomically: a temporary file in the same folder, then rename."""
    path = Path(path)
    with atomic.atomic_path(path, suffix=".nc") as tmp:
        idata.to_netcdf(str(tmp), engine="h5netcdf")
    return path


def _read_netcdf(path: Path):
    """The archive's groups, loaded into memory and the file closed, in the installed ArviZ's container.

    ArviZ 0.23's ``from_netcdf`` loads every group eagerly. Under ArviZ 1.x ``arviz.from_netcdf`` is
    ``xarray.open_datatree``, which reads lazily and keeps the file open; the tree is loaded and the file closed
    here, so the archive can be replaced (atomic writes) while the result is in use. Only the child groups are
    read: :func:`save_netcdf` leaves the root group empty under both versions.
    """
    import xarray as xr

    if arviz_major() >= 1:
        with xr.open_datatree(str(path), engine="h5netcdf") as tree:
            groups = {name: node.to_dataset().load() for name, node in tree.children.items()}
        return from_groups(groups)
    import arviz as az

    return az.from_netcdf(str(path), engine="h5netcdf")


def load_netcdf(path: str | Path):
    """Load an archive written by :func:`save_netcdf` (under ArviZ 0.23 or 1.x) into the installed ArviZ's
    container; JSON-encoded attributes are decoded back to dicts."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"posterior archive {path} not found")
    try:
        idata = _read_netcdf(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"posterior archive {path} is not a readable NetCDF/HDF5 file ({exc})") from exc
    for group in group_names(idata):
        ds = idata[group]
        for k in _JSON_ATTRS:
            if isinstance(ds.attrs.get(k), str):
                try:
                    ds.attrs[k] = json.loads(ds.attrs[k])
                except json.JSONDecodeError:
                    pass
    return idata
