"""A small, deterministic posterior archive for the ArviZ 0.23 / 1.x NetCDF compatibility tests.

:func:`fixture_inference_data` builds it with :func:`msrm.gp.idata.build_inference_data` from a stand-in model
(three parameter blocks named as ``GPMSRM`` names them: a (K,) vector, a (features, K) matrix behind a ``/`` key,
a scalar response parameter) and seeded draws, with sample stats, a pointwise log likelihood, an observed-data
summary and nested attributes. ``python tests/data/idata_fixture.py`` writes ``idata_arviz<major>.nc`` beside this
file with the installed ArviZ; ``idata_arviz0.nc`` (written under ArviZ 0.23) is checked in, and the tests load it
under whichever ArviZ is installed and compare it with a freshly built object.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
CHAINS, DRAWS, K, FEATURES = 2, 5, 2, 3
ATTRS = {"sampler": {"seed": 7, "num_warmup": 3}, "execution_info": {"backend": "cpu", "jax": "x"},
         "timings": {"sampling_s": 0.5}, "inference_library": "numpyro"}


class StandIn:
    """Parameter blocks of a model with K factors and one stream ``p0/brain`` of FEATURES features."""

    size = K + FEATURES * K + 1

    def constrained_blocks(self, u):
        u = np.asarray(u)
        return {"lengthscales": np.exp(u[:K]),
                "loadings/p0/brain": u[K : K + FEATURES * K].reshape(FEATURES, K),
                "response/rating/lag": 5.0 / (1.0 + np.exp(-u[-1]))}

    def param_dims(self):
        return {"lengthscales": (("factor",), {"factor": list(range(K))}),
                "loadings/p0/brain": (("p0_brain_feature", "factor"),
                                      {"p0_brain_feature": list(range(FEATURES)), "factor": list(range(K))}),
                "response/rating/lag": ((), {})}


def fixture_parts(seed: int = 0) -> dict:
    """The arrays of the archive (draws, sample stats, pointwise log likelihood, observed summary)."""
    rng = np.random.default_rng(seed)
    return {
        "draws_u": rng.standard_normal((CHAINS, DRAWS, StandIn.size)),
        "sample_stats": {"lp": rng.standard_normal((CHAINS, DRAWS)),
                         "diverging": rng.random((CHAINS, DRAWS)) < 0.2,
                         "tree_depth": rng.integers(1, 5, (CHAINS, DRAWS))},
        "log_likelihood": {"run0": rng.standard_normal((CHAINS, DRAWS, 4))},
        "observed": {"p0_brain_n_observed": np.array([10, 9, 10]), "p0_brain_mean": rng.standard_normal(FEATURES),
                     "p0_brain_sd": rng.random(FEATURES) + 0.5},
    }


def fixture_inference_data(seed: int = 0):
    """The fixture in the installed ArviZ's container (InferenceData under 0.23, DataTree under 1.x)."""
    from msrm.gp.idata import build_inference_data

    p = fixture_parts(seed)
    return build_inference_data(StandIn(), p["draws_u"], p["sample_stats"], log_likelihood=p["log_likelihood"],
                                observed=p["observed"], attrs=ATTRS)


def archive_path(major: int) -> Path:
    return HERE / f"idata_arviz{major}.nc"


if __name__ == "__main__":
    from msrm.gp.idata import arviz_major, save_netcdf

    print(save_netcdf(fixture_inference_data(), archive_path(arviz_major())))
