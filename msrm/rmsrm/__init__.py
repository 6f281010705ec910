"""R-MSRM: the penalised alternating fit (NumPy/SciPy only; never imports JAX).

    fit = msrm.fit_rmsrm(data, spec, restarts=8)
    fit.save("fit.npz"); fit2 = msrm.load_rfit("fit.npz")

Modules: ``prepare`` (static inputs), ``objective`` (J: sufficient statistics and explicit residual),
``latent`` (block-banded normal equations), ``loadings`` (loadings, intercepts, noise), ``response``
(L-BFGS-B over theta), ``convention`` (initialisation, scale/rotation convention), ``fit`` (driver), ``archive``
(the :class:`RFit` result and its ``.npz`` archive), ``predict`` (``RFit.predict`` and :func:`project`, the
latents of new runs with the fitted parameters fixed).
"""
from .archive import RFit, load_rfit
from .fit import fit_restart, fit_rmsrm
from .predict import project
from .prepare import default_roughness, prepare_rmsrm

__all__ = ["fit_rmsrm", "RFit", "load_rfit", "prepare_rmsrm", "default_roughness", "fit_restart", "project"]
