"""MSRM: shared latent-factor models across participants and modalities.

``import msrm`` loads only NumPy/SciPy code (``msrm.plot`` imports matplotlib when a plot is drawn). JAX is imported when a GP model is first used
(``msrm.GPMSRM``), never as a side effect of importing the package; call ``msrm.runtime.enable_x64()`` or
``msrm.runtime.configure(...)`` explicitly before building GP models.
"""
from __future__ import annotations

import importlib

from . import kernels, responses, runtime
from .align import Alignment, align  # the function shadows the submodule
from .data import Dataset, Run, Stream
from .latent import LatentPosterior, Prediction
from .newcomer import project_participant
from .nodes import count_nodes, prepare_nodes, response_groups
from .operators import response_weights, response_weights_csr
from .params import Params
from .responses import GaussianLag, GaussianWidthLag, Identity
from .spec import ModelSpec, latent_grid
from .select import select  # the function shadows the submodule (NumPy at import; JAX only inside its fits)
from .validation import CVResult, NotConvergedError, cross_validate

__version__ = "0.1.0"

__all__ = [
    "Stream", "Run", "Dataset", "ModelSpec", "Identity", "GaussianLag", "GaussianWidthLag", "latent_grid",
    "Params", "GPMSRM", "fit_rmsrm", "load_rfit", "RFit", "diagnostics", "runtime", "parallel",
    "response_weights", "response_weights_csr", "prepare_nodes", "response_groups", "count_nodes", "kernels",
    "responses", "LatentPosterior", "Prediction", "HRF", "align", "Alignment", "cross_validate", "CVResult",
    "NotConvergedError", "plot", "project_participant", "select",
]

# Resolved on first access so that `import msrm` never imports JAX (R-MSRM is NumPy/SciPy only).
_LAZY = {
    "GPMSRM": ("msrm.gp.model", "GPMSRM"),
    "fit_rmsrm": ("msrm.rmsrm", "fit_rmsrm"),
    "load_rfit": ("msrm.rmsrm", "load_rfit"),
    "RFit": ("msrm.rmsrm", "RFit"),
    "diagnostics": ("msrm.diagnostics", None),
    "parallel": ("msrm.parallel", None),
    "HRF": ("msrm.responses", "HRF"),
    "plot": ("msrm.plot", None),  # imports matplotlib only inside its functions
    "bids": ("msrm.bids", None),  # imports nibabel and nilearn only inside its functions
    "variance_explained": ("msrm.explain", "variance_explained"),  # imports xarray only inside its functions
}


def __getattr__(name: str):
    if name in _LAZY:
        module, attr = _LAZY[name]
        mod = importlib.import_module(module)
        value = mod if attr is None else getattr(mod, attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'msrm' has no attribute {name!r}")
