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

__all__ = ["NumericalAccuracyWarning", "LATENT_SD_RTOL", "VARIANCE_ROUNDING_UNITS", "latent_sd_rounding"]


class NumericalAccuracyWarning(UserWarning):
    """A result may be less accurate than the package's tolerance; the message names the cause and the remedy."""


#: the relative accuracy promised for a latent posterior sd (the package's accuracy contract)
LATENT_SD_RTOL = 1e-6
#: rounding units lost in a posterior variance formed as the prior variance less its reduction by the data (the
#: reduction's sum of squares and the subtraction each round at the size of the prior variance)
VARIANCE_ROUNDING_UNITS = 4.0


def latent_sd_rounding(sd, prior_var=1.0):
    """Bound on the relative rounding error of posterior sds ``sd`` (any shape) computed as
    ``sqrt(prior_var − Σ g²)``: the difference rounds at ``u ε prior_var`` (``u`` =
    :data:`VARIANCE_ROUNDING_UNITS`), so the variance carries relative error ``u ε prior_var / sd²`` and the sd half
    of that, doubled here for the sum's own rounding. Large where the data pin the latent far below its prior
    (``sd² ≪ prior_var``), e.g. a loading 10⁵ times the noise sd."""
    import numpy as np

    sd = np.asarray(sd, dtype=np.float64)
    var = np.maximum(sd * sd, np.finfo(np.float64).tiny)
    return VARIANCE_ROUNDING_UNITS * np.finfo(np.float64).eps * np.asarray(prior_var) / var
