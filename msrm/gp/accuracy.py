"""Numerical accuracy of the GP-MSRM backends: the warning they give where an answer cannot be trusted to the
package's tolerance.

:class:`NumericalAccuracyWarning` is raised (as a warning, not an error) when a computation would otherwise
return a number whose rounding error exceeds what the package promises, with a message that names the cause
(which quantity is ill-conditioned, and by how much) and the remedy (an option, a coarser grid, a rougher
kernel, another backend). Filter it like any warning::

    import warnings
    from msrm.gp.accuracy import NumericalAccuracyWarning
    warnings.simplefilter("error", NumericalAccuracyWarning)  # make every such case an error
"""
from __future__ import annotations

__all__ = ["NumericalAccuracyWarning"]


class NumericalAccuracyWarning(UserWarning):
    """A result may be less accurate than the package's tolerance; the message names the cause and the remedy."""
