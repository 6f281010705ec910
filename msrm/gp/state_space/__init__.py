"""The state-space backend of GP-MSRM: an exact, linear-time Kalman filter over the latent grid.

``prepare(data, spec, response_embedding=..., n_states=..., parallel=..., checkpoint_every=..., block=...,
method=...)`` (NumPy, once) and ``loglik(theta, prepared) -> (value, events)`` (pure JAX, jit/grad-able) compute
the density; :data:`STATE_SPACE` is the backend that ``msrm.GPMSRM(..., linear_algebra="state_space")`` finds in
:data:`msrm.gp.backends.BACKENDS`, its options :class:`~.prepare.StateSpaceOptions`. ``events`` is (n_runs,)
int32, 0 in a healthy run (:func:`.filter.event_code`): the number of steps of each run whose update matrix lost
positive definiteness, plus an accuracy level when the scan's blocks are ill-conditioned at the parameters
(:func:`.filter.block_conditioning`); the model warns once per code with :meth:`StateSpaceBackend.describe_event`
(:class:`msrm.gp.accuracy.NumericalAccuracyWarning`).

Modules: :mod:`.sde` (Matérn SDEs), :mod:`.embedding` (delay line and banks), :mod:`.prepare`,
:mod:`.filter` (sequential block scan, checkpointed), :mod:`.adjoint` (its hand-written reverse mode, used by
:func:`loglik`), :mod:`.host` (the same filter and reverse mode in NumPy/BLAS, ``method="callback"``),
:mod:`.parallel` (associative scan).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ..backends import Backend, register_backend
from .prepare import StateSpaceOptions, StateSpacePrepared, prepare, prepare_options

__all__ = ["prepare", "loglik", "run_logliks", "run_sizes", "StateSpaceOptions", "StateSpacePrepared",
           "StateSpaceBackend", "STATE_SPACE"]


def _per_run(theta, prepared: StateSpacePrepared) -> tuple[list, list]:
    """Each run's (value, bad-step count): the associative scan (:func:`.parallel.run_loglik_parallel`) for a run
    prepared with ``parallel=True``, else the checkpointed sequential scan with its hand-written reverse mode
    (:func:`.adjoint.run_loglik_adjoint`)."""
    from .adjoint import run_loglik_adjoint
    from .parallel import run_loglik_parallel

    values, events = [], []
    for run in prepared.runs:
        fn = run_loglik_parallel if run.tables.parallel else run_loglik_adjoint
        value, bad = fn(theta, run)
        values.append(value)
        events.append(bad)
    return values, events


def run_logliks(theta, prepared: StateSpacePrepared):
    """Per-run log likelihoods ``(n_runs,)`` and per-run event counts ``(n_runs,)`` int32."""
    values, events = _per_run(theta, prepared)
    return jnp.stack(values), jnp.stack(events).astype(jnp.int32)


def loglik(theta, prepared: StateSpacePrepared):
    """Log likelihood summed over runs and per-run event counts.

    Args:
        theta: constrained parameter pytree (see :mod:`msrm.gp.backends`).
        prepared: from :func:`prepare`.
    Returns:
        (value, events): float64 scalar, (n_runs,) int32.
    """
    values, events = _per_run(theta, prepared)
    total = 0.0
    for value in values:
        total = total + value
    return total, jnp.stack(events).astype(jnp.int32)


class StateSpaceBackend(Backend):
    """The Kalman-filter backend (one device).

    ``peak_bytes`` is :func:`msrm.gp.memory.state_space_peak_bytes` of the prepared tables (the step tables, node
    arrays and the scan's kept states), checked by the model's memory guard before anything is placed on a device.
    """

    name = "state_space"
    options_type = StateSpaceOptions

    def prepare(self, data, spec, options: StateSpaceOptions) -> StateSpacePrepared:
        return prepare_options(data, spec, options)

    def peak_bytes(self, prepared: StateSpacePrepared, options: StateSpaceOptions):
        """The predicted peak of one value+gradient (:func:`msrm.gp.memory.state_space_peak_bytes`), with the
        sizes it comes from and what to do instead for the guard's message (no dense factorization: ``dim``
        None)."""
        from .. import memory

        sizes = [run_sizes(run) for run in prepared.runs]
        need, _ = memory.state_space_peak_bytes(sizes)
        r = max(range(len(sizes)), key=lambda i: memory.state_space_peak_bytes([sizes[i]])[0])
        z, t = sizes[r], prepared.runs[r].tables
        what = (f"the state_space GP likelihood ({len(sizes)} run(s); the largest, run {r}: J = {t.n_steps} grid "
                f"points, T = {z.sub_steps} sub-steps x M = {z.slots} node slots, S = {z.n_states} states "
                f"(K = {z.n_factors}), block {t.block}, {z.n_chunks} chunk(s) of {z.chunk})")
        suggestion = ("the step tables grow with nodes x states, so pass a smaller block= (the ring, and with it "
                      "S, shrinks with the block), use a coarser latent_dt, drop parallel=True (its elements are "
                      "S x S per grid step), or run where more memory is free")
        return memory.PeakBytes(need, what, dim=None, suggestion=suggestion)

    def pointwise_prepare(self, data, spec, options: StateSpaceOptions):
        """The pointwise terms factorize the grouped node table (:func:`msrm.gp.pointwise.pointwise_prepare`):
        the same conditional densities as ``"grouped"``."""
        from ..pointwise import pointwise_prepare

        return pointwise_prepare(data, spec, grouped=True)

    def pointwise_peak_bytes(self, prepared, options: StateSpaceOptions):
        """:func:`msrm.gp.memory.likelihood_peak_bytes` of each run's grouped node count: the pointwise terms hold
        a dense node-space factorization, which a long run may not fit although its filter does."""
        from .. import memory

        counts = [int(r.layout.n_nodes) for r in prepared.runs]
        need, largest = memory.likelihood_peak_bytes(counts, prepared.runs[0].layout.n_factors)
        return memory.PeakBytes(
            need, f"the state_space pointwise log likelihood on the grouped node table (largest factorization "
                  f"N*K = {largest})", dim=largest,
            suggestion="compare models with by='run' (per-run terms from the filter), or run where more memory "
                       "is free")

    def pointwise(self, theta, prepared):
        from ..pointwise import pointwise_logliks

        return pointwise_logliks(theta, prepared)

    def loglik(self, theta, prepared):
        return loglik(theta, prepared)

    def run_logliks(self, theta, prepared):
        return run_logliks(theta, prepared)

    def describe_event(self, code: int) -> str | None:
        """A run's event code (:func:`.filter.event_code`): the steps whose covariance lost definiteness, and the
        accuracy level of the scan's blocks at these parameters (:func:`.filter.describe_code`)."""
        from .filter import describe_code

        return describe_code(code)

    def compile_level(self, prepared) -> int | None:
        """0 when every run filters on the host (``method="callback"``): the compiled program then only forms the
        node information and the parameter transforms around the callback, LLVM's optimisation passes over that
        code cost several times the compile time of the rest and buy no measurable run time. None (XLA's
        default) when some run's scan is compiled (``method="native"`` or the associative scan)."""
        return 0 if all(r.tables.method == "callback" for r in prepared.runs) else None

    def latent_posterior(self, theta, prepared, data, spec, cov: bool = False):
        """Per run the exact ``p(Z | Y, theta)`` on its grid by the RTS smoother of :mod:`.smoother` (the
        approximate model's posterior under a filter-bank embedding). One smoother pass serves this and
        :meth:`predict` at the same parameters (:func:`.smoother.smooth_runs`)."""
        from ...latent import LatentPosterior
        from .smoother import smooth_runs

        out = []
        for r, (run, sm) in enumerate(zip(prepared.runs, smooth_runs(theta, prepared))):
            var = np.diagonal(sm.grid_cov, axis1=1, axis2=2)
            bad = var < 0.0
            if bad.any():  # rounding larger than the variance itself: no sd to report (0 would be a wrong one)
                import warnings

                from ..accuracy import NumericalAccuracyWarning

                warnings.warn(f"state_space latent posterior, run {r}: {int(bad.sum())} posterior variance(s) came out "
                              f"negative (down to {float(var.min()):.2e}): the covariance filter's rounding exceeds "
                              "them, so their sds are NaN; bound the noise sds away from zero or use a coarser "
                              "latent_dt", NumericalAccuracyWarning, stacklevel=2)
            sd = np.sqrt(np.where(bad, np.nan, var))
            out.append(LatentPosterior(grid=run.gp.layout.grid, mean=sm.grid_mean, sd=sd,
                                       cov=sm.grid_cov if cov else None))
        return out

    def predict(self, theta, prepared, data, spec):
        """Per run, per stream key, the posterior predictive of every sample (missing ones included) from the
        smoothed node values of :mod:`.smoother`."""
        from .smoother import smooth_runs, stream_predictions

        out = []
        for run, data_run, sm in zip(prepared.runs, data.runs, smooth_runs(theta, prepared)):
            out.append(stream_predictions(theta, run.gp, data_run, sm.node_mean, sm.node_cov))
        return out


def run_sizes(run):
    """The :class:`msrm.gp.memory.StateSpaceSizes` of one prepared run (its step tables' shapes)."""
    from ... import runtime
    from .. import memory

    t = run.tables
    return memory.StateSpaceSizes(
        sub_steps=int(t.block_index.size), slots=int(t.n_slots), n_states=int(t.n_states), n_factors=int(t.K),
        sde_states=int(t.d), n_nodes=int(run.gp.layout.n_nodes) + 1, chunk=int(t.chunk), n_chunks=int(t.n_chunks),
        # the host reverse pass may recompute the previous chunk on a second thread (a third chunk held): counted
        # whenever it could (callback, several chunks, two cores), an upper bound
        pipelined=bool(t.method == "callback" and t.n_chunks > 1 and runtime.physical_cores() >= 2),
        parallel=bool(t.parallel))


STATE_SPACE = register_backend(StateSpaceBackend())
