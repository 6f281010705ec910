r"""Data drawn from the GP-MSRM generative model at given parameters, on a template dataset's layout.

For every run of the template (its duration, streams, sampling clocks and missing-value pattern are kept; its values
are not read):

1. the grid ``tau`` (J,) of :func:`msrm.spec.latent_grid`;
2. factors ``Z[:, k] ~ N(0, K_k)`` independently, ``K_k[j, j'] = k_nu(|tau_j - tau_j'|; l_k)`` (the spec's kernel,
   unit variance), by a Cholesky factor of ``K_k + 1e-9 I``;
3. per stream ``s`` of modality ``m`` with sample times ``t`` (n,): ``X = A_m(t; theta_m) Z`` (n, K), ``A`` the
   response weights of :func:`msrm.operators.response_weights` (the canonical definition), ``theta_m`` from
   ``params.response`` under the spec's pooling;
4. ``Y = b + X W^T + sigma * eps`` (n, F), ``eps`` standard normal; a value missing in the template stays NaN.

So ``E[y_{s,f}(t)] = b_f`` and ``Var[y_{s,f}(t)] = sum_k W_{f,k}^2 a(t)^T K_k a(t) + sigma_f^2``; for an
``Identity`` response at a grid time ``a`` is a unit vector and the variance is ``|w_f|^2 + sigma_f^2``.
"""
from __future__ import annotations

import numpy as np

import msrm
from msrm.operators import response_weights
from msrm.spec import ModelSpec, latent_grid

from .study import _draw_latents

__all__ = ["simulate_from_params"]


def _response_theta(spec: ModelSpec, params: msrm.Params, key: str, modality: str) -> dict:
    r = spec.response(modality)
    if not r.param_names:
        return {}
    return dict(params.response[modality if spec.pooling == "shared" else key])


def simulate_from_params(template: msrm.Dataset, spec: ModelSpec, params: msrm.Params,
                         seed: int) -> tuple[msrm.Dataset, list[np.ndarray]]:
    """Draw latents and observations from the model at ``params`` (module docstring).

    Args:
        template: a Dataset whose runs, streams, clocks and NaN pattern the simulated data copy.
        spec: the ModelSpec (grid, kernel, responses, pooling).
        params: physical parameter values (validated against ``template`` and ``spec``).
        seed: seeds a NumPy generator; the same seed gives the same data.
    Returns:
        (data, latents): the simulated Dataset and the factors of every run, a list of (J, K) arrays on
        ``latent_grid(run.duration, spec)``.
    """
    params.validate(template, spec)
    rng = np.random.default_rng(seed)
    ell = np.asarray(params.lengthscales, dtype=np.float64)
    runs, latents = [], []
    for run in template.runs:
        grid = latent_grid(run.duration, spec)
        Z = _draw_latents(rng, grid, ell, spec.kernel)
        latents.append(Z)
        streams = []
        for s in run.streams:
            key = s.key
            A = response_weights(s.times, spec.response(s.modality),
                                 _response_theta(spec, params, key, s.modality), grid)
            W = np.asarray(params.loadings[key], dtype=np.float64)
            n, F = s.values.shape
            Y = params.intercepts[key] + (A @ Z) @ W.T + params.noise_sd[key] * rng.standard_normal((n, F))
            Y[np.isnan(s.values)] = np.nan
            streams.append(msrm.Stream(participant=s.participant, modality=s.modality, dt=s.dt, values=Y,
                                       offset=s.offset))
        runs.append(msrm.Run(duration=run.duration, streams=streams))
    return msrm.Dataset(runs), latents
