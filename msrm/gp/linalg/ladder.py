r"""The jitter ladder of the guarded factorization and its event codes (NumPy only, no JAX).

The guard factorises the symmetrised matrix ``M_s = (M + M^T)/2``. If the plain Cholesky fails, rung
``k = 1..N_JITTER`` retries with

.. math::

    M_s + \varepsilon_k I, \qquad \varepsilon_k = 10^{-10} \cdot 10^k \cdot s, \qquad
    s = \operatorname{mean}(\operatorname{diag} M_s)

(``s = 1`` where that mean is not finite and positive). The jitter is relative to the matrix's own scale. It
starts about a hundred times above the float64 rounding of a factorization of dimension n ~ 10^3..10^4
(n * 2.2e-16 ~ 1e-12) and stops at 1e-5, beyond which it would move the likelihood by more than the noise floor
the models resolve. If every rung fails, the **fallback** is an eigendecomposition ``M_s = Q diag(w) Q^T``
with the eigenvalues clipped from below at the last rung, ``w_i <- max(w_i, 1e-5 s)``; the clipped matrix is
positive definite by construction and is factorised again, so the backward pass is the same in every case.

What ran is returned as ``event`` (int32):

====== ==========================================================================
event  meaning
====== ==========================================================================
0      plain Cholesky succeeded (:data:`EVENT_PLAIN`)
k>0    jitter rung k was needed (``eps_k`` above)
-1     fallback: eigendecomposition with eigenvalue clipping (value finite)
-2     ``M`` or ``V`` held a non-finite entry; value is NaN for that stated reason
====== ==========================================================================

Both factorization paths (:mod:`.lapack`, :mod:`.native`) take their levels from :func:`jitter_levels`; no
other copy of the ladder exists.
"""
from __future__ import annotations

import numpy as np

__all__ = [
    "N_JITTER",
    "JITTER_BASE",
    "EVENT_PLAIN",
    "EVENT_EIGH_FALLBACK",
    "EVENT_NONFINITE",
    "jitter_levels",
    "describe_event",
]

N_JITTER = 5
JITTER_BASE = 1e-10
EVENT_PLAIN = 0
EVENT_EIGH_FALLBACK = -1
EVENT_NONFINITE = -2


def jitter_levels() -> np.ndarray:
    """Relative jitter of rungs 1..N_JITTER: ``JITTER_BASE * 10^k`` (multiplied by ``mean(diag M)``). Shape (5,).

    The last level is also the fallback's eigenvalue floor.
    """
    return JITTER_BASE * 10.0 ** np.arange(1, N_JITTER + 1)


def describe_event(event: int) -> str:
    """A sentence saying what the guard did for one ``event`` code."""
    event = int(event)
    if event == EVENT_PLAIN:
        return "plain Cholesky"
    if 1 <= event <= N_JITTER:
        return f"jitter rung {event} (relative jitter {jitter_levels()[event - 1]:.0e} of mean diagonal)"
    if event == EVENT_EIGH_FALLBACK:
        return "eigendecomposition fallback with eigenvalue clipping"
    if event == EVENT_NONFINITE:
        return "non-finite input; value is NaN"
    raise ValueError(f"event must be in -2..{N_JITTER}, got {event}")
