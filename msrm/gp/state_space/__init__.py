"""The state-space backend of GP-MSRM: an exact, linear-time Kalman filter over the latent grid.

``prepare(data, spec, response_embedding=..., n_states=..., parallel=..., checkpoint_every=...)`` (NumPy, once)
and ``loglik(theta, prepared) -> (value, events)`` (pure JAX, jit/grad-able) are the backend interface that
``msrm.GPMSRM(..., linear_algebra="state_space")`` calls. ``events`` is (n_runs,) int32: the number of steps
of each run whose update matrix ``G`` lost positive determinant (0 in a healthy run).

Modules: :mod:`.sde` (Matérn SDEs), :mod:`.embedding` (delay line and banks), :mod:`.prepare`,
:mod:`.filter` (sequential block scan, checkpointed), :mod:`.adjoint` (its hand-written reverse mode, used by
:func:`loglik`), :mod:`.host` (the same filter and reverse mode in NumPy/BLAS, ``method="callback"``),
:mod:`.parallel` (associative scan).
"""
from __future__ import annotations

import jax.numpy as jnp

from .prepare import StateSpacePrepared, prepare

__all__ = ["prepare", "loglik", "StateSpacePrepared", "TRACE_COUNT"]

# Incremented each time loglik is traced.
TRACE_COUNT = [0]


def loglik(theta, prepared: StateSpacePrepared):
    """Log likelihood summed over runs and per-run event counts.

    Args:
        theta: constrained parameter pytree (Params fields; see :mod:`msrm.gp.likelihood`).
        prepared: from :func:`prepare`.
    Returns:
        (value, events): float64 scalar, (n_runs,) int32.
    """
    from .adjoint import run_loglik_adjoint
    from .parallel import run_loglik_parallel

    TRACE_COUNT[0] += 1
    total, events = 0.0, []
    for run in prepared.runs:
        fn = run_loglik_parallel if run.tables.parallel else run_loglik_adjoint
        value, bad = fn(theta, run)
        total = total + value
        events.append(bad)
    return total, jnp.stack(events).astype(jnp.int32)
