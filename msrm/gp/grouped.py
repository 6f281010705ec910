"""The ``"dense"`` and ``"grouped"`` backends: the node-space Woodbury likelihood of :mod:`msrm.gp.likelihood`.

``"grouped"`` works on the node table (one node per distinct (response group, sample time)), ``"dense"`` on the
ungrouped table (every (stream, sample) its own node, the reference); both are prepared by
:func:`msrm.gp.prepare.prepare`. With ``batch_runs=True`` (default) the runs are stacked by shape signature
(:func:`msrm.gp.multirun.stack_runs`: one ``jax.vmap`` per stack, padded within ``pad_tolerance``, sharded over
several devices); ``batch_runs=False`` evaluates each run as a stack of its own (one device). Both give the same
values to rounding.

The latent posterior and the predictions (:mod:`msrm.gp.conditional`) are computed per run on a per-run layout of
the same kind (the model's own when it is per run, else prepared again once and cached with the model's prepared
object), with native JAX linear algebra, and returned as host NumPy :class:`msrm.LatentPosterior` and
:class:`msrm.Prediction` objects. A guard event other than a plain Cholesky factorization is reported as a
``RuntimeWarning`` naming the run and what the guard did.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import jax
import numpy as np

from ..latent import LatentPosterior, Prediction
from . import conditional, likelihood, linalg, memory, multirun, pointwise
from .backends import Backend, register_backend
from .prepare import Prepared, prepare

__all__ = ["GroupedOptions", "GroupedBackend", "DENSE", "GROUPED"]


@dataclass(frozen=True)
class GroupedOptions:
    """Options of the dense and grouped backends.

    Fields:
        method: the factorization (:func:`msrm.gp.linalg.quad_logdet`): ``"auto"``, ``"callback"`` (LAPACK on the
            host) or ``"native"`` (JAX); checked by :func:`msrm.gp.backends.make_options`.
        batch_runs: stack runs by shape signature and vmap them (True); False evaluates each run on its own, on one
            device.
        pad_tolerance: runs of one structure share a stack when padding grows their node count and grid by at most
            this fraction (exact: dummy nodes and grid points add nothing); 0 stacks only equal sizes.
    """

    method: str = "auto"
    batch_runs: bool = True
    pad_tolerance: float = 0.1

    def __post_init__(self):
        if not isinstance(self.batch_runs, (bool, np.bool_)):
            raise ValueError(f"batch_runs must be True or False, got {self.batch_runs!r}")
        tol = self.pad_tolerance
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not (np.isfinite(tol) and tol >= 0):
            raise ValueError(f"pad_tolerance must be a finite number >= 0, got {tol!r}")


class GroupedBackend(Backend):
    """The node-space likelihood on the grouped (``grouped=True``) or the ungrouped dense node table."""

    options_type = GroupedOptions

    def __init__(self, name: str, grouped: bool):
        self.name = name
        self.grouped = grouped

    def prepare(self, data, spec, options: GroupedOptions) -> Prepared:
        return prepare(data, spec, grouped=self.grouped, method=options.method)

    def node_counts(self, prepared: Prepared) -> list[int]:
        return [int(r.layout.n_nodes) for r in prepared.runs]

    def peak_bytes(self, prepared: Prepared, options: GroupedOptions) -> memory.PeakBytes:
        """:func:`msrm.gp.memory.likelihood_peak_bytes` of the node counts each run is factorized with (after
        padding to its stack when ``batch_runs``)."""
        counts = (multirun.padded_node_counts(prepared.runs, options.pad_tolerance) if options.batch_runs
                  else self.node_counts(prepared))
        return _peak(prepared, counts, f"the {self.name} GP likelihood")

    def batch_runs(self, options: GroupedOptions) -> bool:
        return bool(options.batch_runs)

    def stacks(self, prepared) -> list[dict]:
        """One dict per stack of a :class:`~msrm.gp.likelihood.MultiRunPrepared` (``batch_runs=True``): the run
        indices, the padded node count and grid length, the device slots it fills (runs plus dummy copies) and
        the factorization method it is traced with; none for a per-run :class:`~msrm.gp.prepare.Prepared`."""
        if not isinstance(prepared, likelihood.MultiRunPrepared):
            return []
        return [{"runs": list(b.run_index), "n_nodes": b.signature.n_nodes, "n_grid": b.signature.n_grid,
                 "slots": b.n_stacked, "method": b.signature.method} for b in prepared.buckets]

    def devices(self, options: GroupedOptions, devices: list, commit: bool) -> list:
        """Several devices shard stacked runs (native factorization there); the per-run evaluation takes one."""
        if len(devices) > 1 and commit and not options.batch_runs:
            raise ValueError(
                f"devices: sharding runs over {len(devices)} devices needs batch_runs=True (got "
                f"linear_algebra={self.name!r}, batch_runs=False); pass one device")
        devices = list(devices if options.batch_runs else devices[:1])
        multirun.mesh_method(options.method, len(devices))  # refuses method='callback' on several devices
        return devices

    def place(self, prepared: Prepared, options: GroupedOptions, devices: list, commit: bool):
        if options.batch_runs:
            return multirun.stack_runs(prepared, devices=devices if commit else None,
                                       pad_tolerance=options.pad_tolerance), devices
        return jax.device_put(prepared, devices[0] if commit else None), devices

    def loglik(self, theta, prepared):
        return likelihood.grouped_loglik(theta, prepared)

    def run_logliks(self, theta, prepared):
        return likelihood.run_logliks(theta, prepared)

    def pointwise_prepare(self, data, spec, options: GroupedOptions) -> Prepared:
        """The per-run layout of this backend's node table (:func:`msrm.gp.pointwise.pointwise_prepare`)."""
        return pointwise.pointwise_prepare(data, spec, grouped=self.grouped)

    def pointwise_peak_bytes(self, prepared: Prepared, options: GroupedOptions) -> memory.PeakBytes:
        """:func:`msrm.gp.memory.likelihood_peak_bytes` of each run's own node count."""
        return _peak(prepared, self.node_counts(prepared), f"the {self.name} pointwise log likelihood")

    def pointwise(self, theta, prepared: Prepared):
        return pointwise.pointwise_logliks(theta, prepared)

    def latent_posterior(self, theta, prepared, data, spec, cov: bool = False) -> list[LatentPosterior]:
        """Per run, the exact ``p(Z | Y, theta)`` on its grid (:func:`msrm.gp.conditional.posterior_arrays`)."""
        tables = conditional.run_tables(prepared, data, spec, grouped=self.grouped)
        out = []
        results = conditional.evaluate(tables, prepared, theta)
        for r, (run, res) in enumerate(zip(tables.runs(prepared), results)):
            _warn_event(res["event"], r, "latent posterior")
            _warn_sd_rounding(res["sd"], r)
            out.append(LatentPosterior(grid=run.layout.grid, mean=res["mean"], sd=res["sd"],
                                       cov=res["cov"] if cov else None))
        return out

    def predict(self, theta, prepared, data, spec) -> list[dict[str, Prediction]]:
        """Per run, per stream key, the predictive of every sample (:func:`msrm.gp.conditional.posterior_arrays`)."""
        tables = conditional.run_tables(prepared, data, spec, grouped=self.grouped)
        out = []
        results = conditional.evaluate(tables, prepared, theta)
        for r, (query, res) in enumerate(zip(tables.queries, results)):
            _warn_event(res["event"], r, "predictions")
            out.append({key: Prediction(mean=m, sd=sd, signal_sd=ssd, times=query.times[key])
                        for key, (m, sd, ssd) in sorted(res["streams"].items())})
        return out


def _peak(prepared: Prepared, counts: list[int], what: str) -> memory.PeakBytes:
    """The guard's :class:`~msrm.gp.memory.PeakBytes` of factorizing runs with these node counts."""
    K = prepared.runs[0].layout.n_factors if prepared.runs else 1
    need, largest = memory.likelihood_peak_bytes(counts, K)
    return memory.PeakBytes(need, f"{what} (largest factorization N*K = {largest})", dim=largest)


def _warn_sd_rounding(sd, run: int) -> None:
    """Warn when some latent posterior sd of run ``run`` may be off by more than the contract's relative
    tolerance: the grid's prior variance is one, and the posterior variance is one less the data's reduction
    (:func:`msrm.gp.accuracy.latent_sd_rounding`)."""
    from .accuracy import LATENT_SD_RTOL, NumericalAccuracyWarning, latent_sd_rounding

    bound = latent_sd_rounding(sd)
    worst = float(np.max(bound)) if np.size(bound) else 0.0
    if worst > LATENT_SD_RTOL:
        n = int(np.sum(bound > LATENT_SD_RTOL))
        warnings.warn(f"latent posterior, run {run}: at {n} grid value(s) the data pin the latent to a posterior sd "
                      f"as small as {float(np.min(sd)):.1e} of its prior sd, and the variance, formed as the prior's "
                      f"less the data's reduction, keeps only about {worst:.0e} relative accuracy in the sd there "
                      f"(the mean is not affected); this comes from loadings far above the noise sd at those "
                      f"points and float64 cannot resolve it", NumericalAccuracyWarning, stacklevel=4)


def _warn_event(event, run: int, what: str) -> None:
    event = int(event)
    if event != 0:
        warnings.warn(f"{what}, run {run}: the guarded factorization of M used {linalg.describe_event(event)}",
                      RuntimeWarning, stacklevel=3)


DENSE = register_backend(GroupedBackend("dense", grouped=False))
GROUPED = register_backend(GroupedBackend("grouped", grouped=True))
