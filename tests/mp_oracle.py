"""The 50-digit reference of the density and latent posterior, for the tests (it lives in
:mod:`msrm_lab.precision`, where the accuracy sweep of the book uses it too)."""
from msrm_lab.precision import MATERN_P, corner_case, mp_latent_posterior, mp_loglik, mp_matern

__all__ = ["MATERN_P", "mp_matern", "mp_loglik", "mp_latent_posterior", "corner_case"]
