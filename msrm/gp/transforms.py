r"""Unconstrained parametrisation of GP-MSRM, its Jacobians, and the weakly informative priors.

**Flat vector.** ``u`` concatenates blocks in a fixed order (:func:`param_blocks`): for each stream key (the
dataset's order) ``loadings/<key>`` (F, K), ``intercepts/<key>`` (F,), ``noise_sd/<key>`` (F,); then
``lengthscales`` (K,); then ``response/<param_key>/<name>`` scalars (the response groups' order).

**Transforms** (``x`` physical, ``u`` unconstrained), each with its log-Jacobian ``log|dx/du|``:

=================== ======================================== ==========================================
parameter           transform                                log-Jacobian
=================== ======================================== ==========================================
loadings, intercepts ``x = u``                               0
noise_sd, lengthscales ``x = exp(u)``                        ``u``
lag, width in [lo, hi] ``x = lo + (hi - lo) sigmoid(u)``     ``log(hi - lo) + log sigmoid(u) + log sigmoid(-u)``
=================== ======================================== ==========================================

:func:`constrain` returns ``(theta, log_det_jacobian)``; :func:`unconstrain` is its inverse (NumPy).

**Priors** (weakly informative, set from the data scale once per model; ``mean_f`` and ``sd_f`` are the observed
mean and standard deviation of feature ``f`` over all runs; an ``sd_f`` that is zero or undefined is replaced by
the stream's median positive ``sd``, or 1):

* loadings ``W_{s,f,k} ~ N(0, (loading_scale * sd_f)^2)``, ``loading_scale = 1``: unit-variance factors make
  ``|w_f|^2`` the feature's signal variance, which cannot exceed its total variance ``sd_f^2``;
* intercepts ``b_{s,f} ~ N(mean_f, (intercept_scale * sd_f)^2)``, ``intercept_scale = 2``;
* noise ``log sigma_{s,f} ~ N(log sd_f, noise_log_sd^2)``, ``noise_log_sd = 1`` (a log-normal on sigma);
* lengthscales ``log l_k ~ N(log(lengthscale_steps * latent_dt), lengthscale_log_sd^2)`` with
  ``lengthscale_steps = 10`` and ``lengthscale_log_sd = 1.5``;
* lags and widths uniform on their bounds (in ``u`` this is the standard logistic density).

:func:`log_prior` is the log prior density of the physical parameters; the model's log density adds the
log-Jacobian, so ``log_density(u) = log p(y | theta(u)) + log p(theta(u)) + log|d theta / d u|``.

**What the lengthscale prior does.** In ``u = log l`` the log-normal prior plus its Jacobian is the normal
density ``N(u; log(lengthscale_steps * latent_dt), lengthscale_log_sd^2)``, whose gradient is
``-(u - loc) / lengthscale_log_sd^2``: under one nat per unit of ``log l`` anywhere within a factor of e^2 of
the centre. It keeps ``l`` finite where the data say nothing (a factor seen by few samples) and is otherwise
dominated by the marginal likelihood, which changes by tens to thousands of nats over the same range on
recordings of a few hundred samples. It is no device to move a fitted lengthscale: when the latents are
smoother than the kernel (a few sinusoids under a Matérn-3/2 prior) the likelihood itself prefers the short
lengthscale that gives the kernel's spectrum ``S(w) ~ (2 nu / l^2 + w^2)^-(nu + 1/2)`` enough power at the
highest frequency present (about a third of the shortest period for Matérn-3/2), although a longer one would
give a more accurate posterior mean. Compare kernels (``matern52``, ``matern72``) by their log density instead
of tightening this prior; :func:`msrm.gp.map.lengthscale_profile` shows where the density peaks.
"""
from __future__ import annotations

import math
from typing import Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..data import Dataset
from ..nodes import response_groups
from ..params import Params
from ..spec import ModelSpec

__all__ = [
    "ParamBlock",
    "param_blocks",
    "constrain",
    "unconstrain",
    "theta_to_params",
    "Priors",
    "PRIOR_DEFAULTS",
    "default_priors",
    "log_prior",
    "prior_draw",
    "data_scale",
]

_LOG_2PI = math.log(2.0 * math.pi)


class ParamBlock(NamedTuple):
    """One block of the flat vector.

    Fields:
        name: ``"loadings/<key>"``, ``"intercepts/<key>"``, ``"noise_sd/<key>"``, ``"lengthscales"`` or
            ``"response/<param_key>/<name>"``.
        field: the Params field (``"loadings"``, ..., ``"response"``).
        key: stream key or response param_key (``None`` for lengthscales).
        pname: response parameter name (``"lag"``/``"width"``), else None.
        shape: block shape. start: offset in ``u``. size: number of entries.
        transform: ``"identity"``, ``"log"`` or ``"logit"``.
        bounds: (lo, hi) for ``"logit"``, else None.
    """

    name: str
    field: str
    key: str | None
    pname: str | None
    shape: tuple
    start: int
    size: int
    transform: str
    bounds: tuple | None


def param_blocks(data: Dataset, spec: ModelSpec) -> tuple[ParamBlock, ...]:
    """The blocks of the flat vector for a dataset and spec (see the module docstring for the order)."""
    K = spec.n_factors
    blocks: list[ParamBlock] = []
    start = 0

    def add(name, field, key, pname, shape, transform, bounds=None):
        nonlocal start
        size = int(np.prod(shape)) if shape else 1
        blocks.append(ParamBlock(name, field, key, pname, tuple(shape), start, size, transform, bounds))
        start += size

    for key in data.stream_keys:
        F = data.n_features[key]
        add(f"loadings/{key}", "loadings", key, None, (F, K), "identity")
        add(f"intercepts/{key}", "intercepts", key, None, (F,), "identity")
        add(f"noise_sd/{key}", "noise_sd", key, None, (F,), "log")
    add("lengthscales", "lengthscales", None, None, (K,), "log")
    for g in response_groups(data, spec):
        if g.param_key is None:
            continue
        for pname in g.response.param_names:
            add(f"response/{g.param_key}/{pname}", "response", g.param_key, pname, (), "logit",
                tuple(g.response.bounds[pname]))
    return tuple(blocks)


def _log_sigmoid(x):
    return -jnp.logaddexp(0.0, -x)


def constrain(u, blocks: tuple[ParamBlock, ...]):
    """Physical parameters from the flat vector, with the log-Jacobian of the map.

    Args:
        u: (num_params,) float64 (JAX or NumPy).
        blocks: from :func:`param_blocks`.
    Returns:
        theta: the constrained pytree of the backend interface.
        log_det_jacobian: scalar ``sum log|dx/du|``.
    """
    u = jnp.asarray(u)
    theta: dict = {"loadings": {}, "intercepts": {}, "noise_sd": {}, "response": {}}
    logdet = jnp.zeros((), dtype=u.dtype)
    # one split rather than a slice per block: the gradient is then assembled by one concatenation, where a
    # slice per block transposes to a zero-padded copy of u per block, summed (XLA fused those into one loop that
    # grew with the parameter count and took LLVM most of the compile time)
    order = sorted(blocks, key=lambda b: b.start)
    ends = [0] + [b.start + b.size for b in order]
    if any(b.start != end for b, end in zip(order, ends)):
        raise ValueError("constrain: the parameter blocks must tile the vector without gaps or overlaps")
    if u.shape != (ends[-1],):
        raise ValueError(f"constrain: u must have shape ({ends[-1]},) for these blocks, got {u.shape}")
    pieces = dict(zip((b.start for b in order), jnp.split(u, [b.start for b in order[1:]])))
    for b in blocks:
        x = pieces[b.start].reshape(b.shape)
        if b.transform == "log":
            logdet = logdet + jnp.sum(x)
            x = jnp.exp(x)
        elif b.transform == "logit":
            lo, hi = b.bounds
            logdet = logdet + math.log(hi - lo) + _log_sigmoid(x) + _log_sigmoid(-x)
            x = lo + (hi - lo) * jax.nn.sigmoid(x)
        if b.field == "lengthscales":
            theta["lengthscales"] = x
        elif b.field == "response":
            theta["response"].setdefault(b.key, {})[b.pname] = x
        else:
            theta[b.field][b.key] = x
    return theta, logdet


def _value(params: Params, b: ParamBlock) -> np.ndarray:
    if b.field == "lengthscales":
        return np.asarray(params.lengthscales, dtype=np.float64)
    if b.field == "response":
        return np.asarray(params.response[b.key][b.pname], dtype=np.float64)
    return np.asarray(getattr(params, b.field)[b.key], dtype=np.float64)


def unconstrain(params: Params, blocks: tuple[ParamBlock, ...]) -> np.ndarray:
    """The flat unconstrained vector of validated physical parameters (NumPy).

    Raises:
        ValueError: a bounded parameter sits exactly on a bound (its unconstrained value would be infinite).
    """
    n = blocks[-1].start + blocks[-1].size if blocks else 0
    u = np.empty(n, dtype=np.float64)
    for b in blocks:
        x = _value(params, b).reshape(-1)
        if b.transform == "log":
            x = np.log(x)
        elif b.transform == "logit":
            lo, hi = b.bounds
            p = (x - lo) / (hi - lo)
            if np.any(p <= 0.0) or np.any(p >= 1.0):
                raise ValueError(
                    f"{b.name}={float(x[0])!r} lies on a bound of [{lo}, {hi}]; its unconstrained value is infinite "
                    f"(move it inside the bounds)"
                )
            x = np.log(p) - np.log1p(-p)
        u[b.start : b.start + b.size] = x
    return u


def theta_to_params(theta) -> Params:
    """A Params object (NumPy) from a constrained pytree."""
    return Params(
        loadings={k: np.asarray(v) for k, v in theta["loadings"].items()},
        intercepts={k: np.asarray(v) for k, v in theta["intercepts"].items()},
        noise_sd={k: np.asarray(v) for k, v in theta["noise_sd"].items()},
        lengthscales=np.asarray(theta["lengthscales"]),
        response={k: {n: float(x) for n, x in d.items()} for k, d in theta["response"].items()},
    )


# ---------------------------------------------------------------------------------------------------- priors

PRIOR_DEFAULTS = {
    "loading_scale": 1.0,
    "intercept_scale": 2.0,
    "noise_log_sd": 1.0,
    "lengthscale_steps": 10.0,
    "lengthscale_log_sd": 1.5,
}


class Priors(NamedTuple):
    """Prior hyperparameters (a pytree of arrays; see the module docstring).

    Fields:
        loading_sd: key -> (F,) prior sd of each feature's loadings.
        intercept_loc, intercept_sd: key -> (F,).
        log_noise_loc: key -> (F,) prior mean of ``log sigma``; log_noise_sd: scalar.
        log_lengthscale_loc, log_lengthscale_sd: scalars.
    """

    loading_sd: dict
    intercept_loc: dict
    intercept_sd: dict
    log_noise_loc: dict
    log_noise_sd: float
    log_lengthscale_loc: float
    log_lengthscale_sd: float


def data_scale(data: Dataset) -> tuple[dict, dict]:
    """Observed mean and sd of every feature over all runs: ``(mean {key: (F,)}, sd {key: (F,)})``."""
    means, sds = {}, {}
    for key in data.stream_keys:
        vals = np.concatenate([run.stream(key).values for run in data.runs if key in run.keys], axis=0)
        mean = np.nanmean(vals, axis=0)
        sd = np.nanstd(vals, axis=0)
        good = np.isfinite(sd) & (sd > 0)
        fill = float(np.median(sd[good])) if good.any() else 1.0
        means[key] = mean
        sds[key] = np.where(good, sd, fill)
    return means, sds


def default_priors(data: Dataset, spec: ModelSpec, overrides: Mapping | None = None) -> Priors:
    """Priors from the data scale; ``overrides`` may change any name in :data:`PRIOR_DEFAULTS`.

    Raises:
        KeyError: an unknown hyperparameter name.
        ValueError: a non-positive or non-finite value.
    """
    h = dict(PRIOR_DEFAULTS)
    for name, value in dict(overrides or {}).items():
        if name not in PRIOR_DEFAULTS:
            raise KeyError(f"priors: unknown hyperparameter {name!r}; known are {sorted(PRIOR_DEFAULTS)}")
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"priors: {name} must be a number, got {value!r}") from None
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"priors: {name} must be finite and > 0, got {value!r}")
        h[name] = value
    means, sds = data_scale(data)
    return Priors(
        loading_sd={k: h["loading_scale"] * sd for k, sd in sds.items()},
        intercept_loc=means,
        intercept_sd={k: h["intercept_scale"] * sd for k, sd in sds.items()},
        log_noise_loc={k: np.log(sd) for k, sd in sds.items()},
        log_noise_sd=h["noise_log_sd"],
        log_lengthscale_loc=math.log(h["lengthscale_steps"] * spec.latent_dt),
        log_lengthscale_sd=h["lengthscale_log_sd"],
    )


def _normal_logpdf(x, loc, sd):
    z = (x - loc) / sd
    return -0.5 * z * z - jnp.log(sd) - 0.5 * _LOG_2PI


def log_prior(theta, priors: Priors, blocks: tuple[ParamBlock, ...]):
    """Log prior density of the physical parameters (log-normal on scales: includes the ``-log x`` term)."""
    total = jnp.zeros(())
    for b in blocks:
        if b.field == "loadings":
            total = total + jnp.sum(_normal_logpdf(theta["loadings"][b.key], 0.0, priors.loading_sd[b.key][:, None]))
        elif b.field == "intercepts":
            total = total + jnp.sum(
                _normal_logpdf(theta["intercepts"][b.key], priors.intercept_loc[b.key], priors.intercept_sd[b.key])
            )
        elif b.field == "noise_sd":
            x = theta["noise_sd"][b.key]
            total = total + jnp.sum(_normal_logpdf(jnp.log(x), priors.log_noise_loc[b.key], priors.log_noise_sd) - jnp.log(x))
        elif b.field == "lengthscales":
            x = theta["lengthscales"]
            total = total + jnp.sum(
                _normal_logpdf(jnp.log(x), priors.log_lengthscale_loc, priors.log_lengthscale_sd) - jnp.log(x)
            )
        else:  # uniform on [lo, hi]
            lo, hi = b.bounds
            total = total - math.log(hi - lo)
    return total


def prior_draw(seed: int, priors: Priors, blocks: tuple[ParamBlock, ...]) -> np.ndarray:
    """A draw from the prior, as a flat unconstrained vector (NumPy, seeded)."""
    rng = np.random.default_rng(seed)
    n = blocks[-1].start + blocks[-1].size if blocks else 0
    u = np.empty(n)
    for b in blocks:
        if b.field == "loadings":
            x = rng.normal(0.0, 1.0, b.shape) * np.asarray(priors.loading_sd[b.key])[:, None]
        elif b.field == "intercepts":
            x = rng.normal(np.asarray(priors.intercept_loc[b.key]), np.asarray(priors.intercept_sd[b.key]))
        elif b.field == "noise_sd":
            x = rng.normal(np.asarray(priors.log_noise_loc[b.key]), priors.log_noise_sd)
        elif b.field == "lengthscales":
            x = rng.normal(priors.log_lengthscale_loc, priors.log_lengthscale_sd, b.shape)
        else:  # uniform on the bounds = standard logistic in u
            x = rng.logistic(0.0, 1.0)
        u[b.start : b.start + b.size] = np.reshape(x, -1)
    return u
