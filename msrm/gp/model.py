r"""GPMSRM: the user-facing GP-MSRM model (a thin layer over a backend's prepared data and jitted pure functions).

::

    msrm.runtime.enable_x64()
    model = msrm.GPMSRM(data, spec, linear_algebra="grouped")   # "dense" | "grouped" | "state_space"
    model.log_likelihood(params)                                # log p(Y | params), latents integrated out
    u = model.unconstrain(params); value, grad = model.value_and_grad(u)

``linear_algebra`` names a backend of :data:`msrm.gp.backends.BACKENDS` (the interface is documented there).
Construction validates data against spec, collects the backend's keyword options into its options type, prepares
the backend once (NumPy), checks the predicted memory, places the prepared data on the devices and builds the
jitted functions (log likelihood of a constrained pytree; per-run log likelihoods; log density of ``u``; its
value and gradient through one ``jax.value_and_grad``). Each is traced once per model. The log density is
``log p(y | theta(u)) + log p(theta(u)) + log|d theta/d u|`` with the priors and transforms of
:mod:`msrm.gp.transforms`. Guard events of the factorization are counted on the host after every call
(:meth:`GPMSRM.guard_events`).

**Several runs and devices** (dense/grouped, :mod:`msrm.gp.grouped`). By default runs of one shape signature are
stacked and evaluated by one ``jax.vmap`` (one trace however many runs), and with several JAX devices
(``devices=None`` takes every local device when there is more than one) the run axis is sharded over them.
``batch_runs=False`` evaluates each run as a stack of its own; both give the same values to rounding.
"""
from __future__ import annotations

import collections
import functools

import numpy as np

from .. import runtime
from ..data import Dataset
from ..nodes import response_groups
from ..params import Params
from ..spec import ModelSpec
from . import transforms as tf
from .backends import DEFAULT_BACKEND, get_backend, make_options

__all__ = ["GPMSRM", "params_to_theta"]


def _require_x64() -> None:
    import jax

    if not jax.config.jax_enable_x64:
        raise RuntimeError(
            "GPMSRM needs float64 but JAX is running in float32; call msrm.runtime.enable_x64() "
            "(or msrm.runtime.configure(...)) before building the model"
        )


def params_to_theta(params: Params):
    """The constrained pytree of the backend interface from a Params object (JAX float64 arrays)."""
    import jax.numpy as jnp

    return {
        "loadings": {k: jnp.asarray(v) for k, v in params.loadings.items()},
        "intercepts": {k: jnp.asarray(v) for k, v in params.intercepts.items()},
        "noise_sd": {k: jnp.asarray(v) for k, v in params.noise_sd.items()},
        "lengthscales": jnp.asarray(params.lengthscales),
        "response": {k: {n: jnp.asarray(x, dtype=jnp.float64) for n, x in d.items()} for k, d in params.response.items()},
    }


class GPMSRM:
    """GP-MSRM with latents integrated out.

    Args:
        data: the Dataset.
        spec: the ModelSpec. ``kernel="auto"`` chooses the kernel first (:func:`msrm.gp.kernel_choice.resolve_auto_kernel`:
            every kernel's marginal likelihood from one shared R-MSRM start); ``model.spec`` then holds the chosen
            kernel and ``model.selection`` the :class:`msrm.select.Selection` (None otherwise).
        linear_algebra: a backend name: ``"grouped"`` (node-space Woodbury, default), ``"dense"`` (ungrouped
            reference), ``"state_space"`` (Kalman filter), or any name added with
            :func:`msrm.gp.backends.register_backend`.
        method: one of :data:`msrm.gp.linalg.METHODS`: ``"auto"`` (a host callback on the CPU platform when the
            process may use two or more CPUs, native JAX otherwise), ``"callback"`` or ``"native"``. For
            dense/grouped it picks the LAPACK factorization path; for state_space, where the sequential filter runs
            (NumPy and SciPy's BLAS on the host, or an XLA scan).
        priors: ``None`` (defaults), a :class:`~msrm.gp.transforms.Priors`, or a dict overriding names of
            :data:`~msrm.gp.transforms.PRIOR_DEFAULTS`.
        devices: where runs are evaluated: ``None`` (every local device when there are several, else the one),
            ``"all"``, a ``jax.Device`` or a list of devices or device indices. More than one device shards the
            runs over them (dense/grouped with ``batch_runs=True``; the factorization is then native JAX, and
            ``method="callback"`` is refused); other backends take one device.
        **options: the backend's own options, the fields of its options type (a keyword given as None takes the
            backend's default). Dense/grouped (:class:`~msrm.gp.grouped.GroupedOptions`): ``batch_runs``
            (default True: stack runs by shape signature and vmap them; False: each run on its own, one device),
            ``pad_tolerance`` (default 0.1: runs of one structure share a stack when padding grows their node
            count and grid by at most this fraction; 0 stacks only equal sizes). State space
            (:class:`~msrm.gp.state_space.prepare.StateSpaceOptions`): ``response_embedding``, ``parallel``,
            ``checkpoint_every``, ``n_states``, ``block``.
    Raises:
        KeyError: a modality without a response in the spec; unknown prior names.
        ValueError: bad arguments (named), an unknown backend, an option of another backend.
        RuntimeError: JAX is not in float64 mode.
        MemoryGuardError: the factorization would not fit in memory (suggests ``state_space``).
    """

    def __init__(self, data: Dataset, spec: ModelSpec, linear_algebra: str = DEFAULT_BACKEND, *,
                 method: str = "auto", priors=None, devices=None, **options):
        self._check_arguments(data, spec)
        self.backend = get_backend(linear_algebra)
        self.options = make_options(self.backend, method=method, **options)  # checks method, once
        self.selection = None  # kernel="auto": the msrm.Selection that chose the kernel
        if spec.kernel == "auto":
            from .kernel_choice import resolve_auto_kernel

            spec, self.selection = resolve_auto_kernel(data, spec, type(self), linear_algebra=linear_algebra,
                                                       method=method, priors=priors, devices=devices, **options)
        self.groups = response_groups(data, spec)  # KeyError for a modality without a response
        self.data, self.spec, self.linear_algebra, self.method = data, spec, linear_algebra, method
        self.blocks = tf.param_blocks(data, spec)
        self.priors = self._resolve_priors(priors, data, spec)
        _require_x64()
        self.prepared = self._prepare(devices)
        self._build_functions()

    # ------------------------------------------------------------------------------------------ construction
    @staticmethod
    def _check_arguments(data, spec) -> None:
        if not isinstance(data, Dataset):
            raise ValueError(f"data must be an msrm.Dataset, got {type(data).__name__}")
        if not isinstance(spec, ModelSpec):
            raise ValueError(f"spec must be an msrm.ModelSpec, got {type(spec).__name__}")

    @staticmethod
    def _resolve_priors(priors, data, spec) -> tf.Priors:
        if isinstance(priors, tf.Priors):
            return priors
        if priors is None or isinstance(priors, dict):
            return tf.default_priors(data, spec, priors)
        raise ValueError(f"priors must be None, a dict of overrides or a Priors, got {type(priors).__name__}")

    def _prepare(self, devices):
        """Choose the devices, prepare the backend on the host, check the predicted memory, place the data.

        ``devices=None`` lets the backend take every local device without committing the data to one (JAX's
        default placement); named devices are committed.
        """
        from .multirun import resolve_devices

        commit = devices is not None
        self.devices = self.backend.devices(self.options, resolve_devices(devices), commit)
        host = self.backend.prepare(self.data, self.spec, self.options)
        self._node_counts: list[int] = list(self.backend.node_counts(host))
        self._check_peak(self.backend.peak_bytes(host, self.options), "peak_bytes")  # before any placement
        prepared, self.devices = self.backend.place(host, self.options, self.devices, commit)
        self.batch_runs = bool(self.backend.batch_runs(self.options))
        return prepared

    def _build_functions(self) -> None:
        """The jitted log likelihood, per-run log likelihoods, log density and its value and gradient."""
        import jax

        blocks, backend = self.blocks, self.backend
        self._priors_dev = jax.device_put(self.priors)
        self._events: collections.Counter = collections.Counter()
        self._pointwise = None  # (per-run prepared, jitted function), built on first use

        def density_and_events(u, prepared, priors):
            theta, log_jac = tf.constrain(u, blocks)
            value, events = backend.loglik(theta, prepared)
            return value + tf.log_prior(theta, priors, blocks) + log_jac, events

        self._density_and_events = density_and_events
        platform = self.devices[0].platform if self.devices else jax.default_backend()
        self.compiler_options = runtime.compiler_options(platform, backend.compile_level(self.prepared))
        jit = functools.partial(jax.jit, compiler_options=self.compiler_options)
        self._runs_jit = jit(lambda u, prepared: backend.run_logliks(tf.constrain(u, blocks)[0], prepared))
        self._loglik_jit = jit(backend.loglik)
        self._vg_jit = jit(jax.value_and_grad(density_and_events, has_aux=True))

    # ------------------------------------------------------------------------------------------ sizes
    @property
    def node_counts(self) -> list[int]:
        """Nodes per run of the backend's node-space factorization (before any padding; empty for a backend
        without one)."""
        return list(self._node_counts)

    @property
    def run_stacks(self) -> list[dict]:
        """How runs are evaluated when the backend stacks them (``batch_runs``): one dict per stack with the run
        indices (``runs``), the padded node count and grid length (``n_nodes``, ``n_grid``), how many device slots
        it fills (``slots``: runs plus dummy copies) and the factorization ``method`` it was traced with; empty
        for a backend that evaluates runs one by one."""
        return list(self.backend.stacks(self.prepared))

    @property
    def factorization_dims(self) -> list[int]:
        """N K per run: the dimension of the dense node-space factorization (empty for a backend without one)."""
        return [n * self.spec.n_factors for n in self.node_counts]

    def _check_peak(self, peak, method: str) -> None:
        """The memory guard on what a backend's ``method`` (``peak_bytes``, ``pointwise_peak_bytes``) predicts:
        a :class:`msrm.gp.memory.PeakBytes`, or None for no estimate."""
        from . import memory

        if peak is None:
            return
        if not isinstance(peak, memory.PeakBytes):
            raise TypeError(f"linear_algebra={self.backend.name!r}: {method} must return a msrm.gp.memory.PeakBytes "
                            f"or None, got {type(peak).__name__}")
        memory.check_peak(peak)

    @property
    def num_params(self) -> int:
        return int(self.blocks[-1].start + self.blocks[-1].size)

    @property
    def param_names(self) -> tuple[str, ...]:
        """Flat scalar names in ``u`` order, e.g. ``"loadings/p1/brain[12,0]"``, ``"response/rating/lag"``."""
        names: list[str] = []
        for b in self.blocks:
            if not b.shape:
                names.append(b.name)
            else:
                names.extend(f"{b.name}[{','.join(map(str, idx))}]" for idx in np.ndindex(*b.shape))
        return tuple(names)

    def param_dims(self) -> dict[str, tuple[tuple[str, ...], dict[str, list]]]:
        """Named dimensions per block for xarray/ArviZ: ``{block name: (dims, coords)}``.

        Dims are ``"<participant>_<modality>_feature"`` (one per stream, sizes differ) and ``"factor"``;
        response parameters are scalars (no dims). Names contain no ``/`` (NetCDF-safe).
        """
        out = {}
        K = self.spec.n_factors
        for b in self.blocks:
            if b.field in ("loadings", "intercepts", "noise_sd"):
                fdim = b.key.replace("/", "_") + "_feature"
                dims = (fdim, "factor") if b.field == "loadings" else (fdim,)
                coords = {fdim: list(range(b.shape[0]))}
                if b.field == "loadings":
                    coords["factor"] = list(range(K))
                out[b.name] = (dims, coords)
            elif b.field == "lengthscales":
                out[b.name] = (("factor",), {"factor": list(range(K))})
            else:
                out[b.name] = ((), {})
        return out

    # ------------------------------------------------------------------------------------------ transforms
    def unconstrain(self, params: Params) -> np.ndarray:
        """Flat unconstrained float64 vector of validated Params."""
        params.validate(self.data, self.spec)
        return tf.unconstrain(params, self.blocks)

    def constrain(self, u) -> Params:
        """Params from a flat unconstrained vector."""
        theta, _ = tf.constrain(self._check_u(u), self.blocks)
        return tf.theta_to_params(theta)

    def constrained_blocks(self, u) -> dict[str, np.ndarray]:
        """``{block name: physical values}`` (NumPy) of a flat vector, in block order."""
        theta, _ = tf.constrain(self._check_u(u), self.blocks)
        out = {}
        for b in self.blocks:
            if b.field == "lengthscales":
                out[b.name] = np.asarray(theta["lengthscales"])
            elif b.field == "response":
                out[b.name] = np.asarray(theta["response"][b.key][b.pname])
            else:
                out[b.name] = np.asarray(theta[b.field][b.key])
        return out

    def _check_u(self, u) -> np.ndarray:
        u = np.asarray(u, dtype=np.float64)
        if u.shape != (self.num_params,):
            raise ValueError(f"u must have shape ({self.num_params},), got {u.shape}")
        if not np.isfinite(u).all():
            bad = [self.param_names[i] for i in np.flatnonzero(~np.isfinite(u))[:5]]
            raise ValueError(f"u contains non-finite values (first at {bad})")
        return u

    # ------------------------------------------------------------------------------------------ densities
    def _record(self, events) -> None:
        """Count the guard codes of one evaluation; the first time a code that changed the answer is seen, warn
        with the backend's own description of it (the count stays in :meth:`guard_events`)."""
        for e in np.asarray(events).reshape(-1).tolist():
            code = int(e)
            if code not in self._events:
                said = self.backend.describe_event(code)
                if said is not None:
                    import warnings

                    from .accuracy import NumericalAccuracyWarning

                    warnings.warn(f"linear_algebra={self.backend.name!r}: {said}", NumericalAccuracyWarning,
                                  stacklevel=3)
            self._events[code] += 1

    def log_likelihood(self, params: Params) -> float:
        """``log p(Y | params)`` summed over runs (Params validated before any numerics)."""
        params.validate(self.data, self.spec)
        value, events = self._loglik_jit(params_to_theta(params), self.prepared)
        self._record(events)
        return float(value)

    def log_density(self, u):
        """Log density of ``u`` as a JAX scalar (pure; traceable by NumPyro). Guard events are not recorded."""
        return self._density_and_events(u, self.prepared, self._priors_dev)[0]

    def value_and_grad(self, u) -> tuple[float, np.ndarray]:
        """Log density and its gradient through one jitted ``jax.value_and_grad``."""
        (value, events), grad = self._vg_jit(self._check_u(u), self.prepared, self._priors_dev)
        self._record(events)
        return float(value), np.asarray(grad)

    def pointwise_log_likelihood(self, u, by: str = "node") -> dict[str, np.ndarray]:
        """Pointwise log likelihood at ``u``.

        Args:
            u: unconstrained vector.
            by: ``"node"`` (default): per stream key, the conditional density of each of its samples (one stream
                at one node) given every other observed value of its run, ``log p(y_si | y_rest)``
                (:mod:`msrm.gp.pointwise`; the terms leave-one-out tools need for a model that does not
                factorise); ``"run"``: ``{"run": (n_runs,)}`` the joint density of each run.
        Returns:
            dict of float64 arrays.
        """
        if by not in ("node", "run"):
            raise ValueError(f"by must be 'node' or 'run', got {by!r}")
        u = self._check_u(u)
        if by == "run":
            values, events = self._runs_jit(u, self.prepared)
            self._record(events)
            return {"run": np.asarray(values)}
        if self._pointwise is None:
            import jax

            backend, blocks = self.backend, self.blocks
            prepared = backend.pointwise_prepare(self.data, self.spec, self.options)
            self._check_peak(backend.pointwise_peak_bytes(prepared, self.options), "pointwise_peak_bytes")
            self._pointwise = (prepared, jax.jit(lambda u, p: backend.pointwise(tf.constrain(u, blocks)[0], p)))
        prepared, fn = self._pointwise
        values, events = fn(u, prepared)
        self._record(events)
        return {k: np.asarray(v) for k, v in values.items()}

    # ------------------------------------------------------------------------------------------ latents
    def _theta_of(self, params) -> dict:
        """The constrained pytree of ``params`` (a Params validated against this model's data and spec)."""
        if not isinstance(params, Params):
            raise ValueError(f"params must be an msrm.Params (use model.constrain(u) for a vector), "
                             f"got {type(params).__name__}")
        params.validate(self.data, self.spec)
        return params_to_theta(params)

    def latent_posterior(self, params: Params, *, cov: bool = False) -> list:
        """The exact Gaussian posterior of the latent factors given the data, per run.

        Args:
            params: physical parameter values (validated against this model's data and spec).
            cov: also return the (J, K, K) posterior covariance of the factors at each grid point.
        Returns:
            list over runs of :class:`msrm.LatentPosterior` (grid (J,), mean (J, K), sd (J, K), cov).
        """
        return list(self.backend.latent_posterior(self._theta_of(params), self.prepared, self.data, self.spec,
                                                  cov=bool(cov)))

    def predict(self, params: Params) -> list[dict]:
        """The posterior predictive of every stream at every sample, missing (held-out) ones included.

        A value is held out by setting it to NaN in the data the model was built on; its prediction then uses
        every other observed value of the run.

        Returns:
            list over runs of ``{"participant/modality": msrm.Prediction}``, mean and sd (n_samples, n_features).
        """
        return list(self.backend.predict(self._theta_of(params), self.prepared, self.data, self.spec))

    def guard_events(self) -> dict[int, int]:
        """Counts of factorization event codes seen so far (0 plain, k>0 jitter rung, -1 fallback, -2 non-finite)."""
        return dict(sorted(self._events.items()))

    # ------------------------------------------------------------------------------------------ starts
    def initial_params(self, seed: int = 0) -> Params:
        """A data-driven starting point.

        Loadings: for streams with more than K features, the leading K principal directions of the centred
        values (missing as 0) scaled by singular value / sqrt(n); for smaller streams, seeded normal draws of
        size ``0.5 sd_f / sqrt(K)``. Intercepts: observed means. Noise: ``sqrt(max(sd_f^2 - |w_f|^2,
        0.25 sd_f^2))``. Lengthscales: ``5 latent_dt`` to ``10 latent_dt`` (geometric over factors). Lags and
        widths: mid-range.
        """
        rng = np.random.default_rng(seed)
        K = self.spec.n_factors
        means, sds = tf.data_scale(self.data)
        loadings, noise = {}, {}
        for key in self.data.stream_keys:
            Y = np.concatenate([r.stream(key).values for r in self.data.runs if key in r.keys], axis=0)
            F = Y.shape[1]
            if F > K:
                Yc = np.where(np.isnan(Y), 0.0, Y - means[key])
                _, S, Vt = np.linalg.svd(Yc, full_matrices=False)
                W = (Vt[:K].T * S[:K]) / np.sqrt(Y.shape[0])
                W = W + 1e-3 * sds[key][:, None] * rng.standard_normal((F, K))
            else:
                W = rng.standard_normal((F, K)) * (0.5 * sds[key] / np.sqrt(K))[:, None]
            loadings[key] = W
            var = sds[key] ** 2
            noise[key] = np.sqrt(np.maximum(var - (W * W).sum(axis=1), 0.25 * var))
        response = {}
        for g in self.groups:
            if g.param_key is not None:
                response[g.param_key] = {n: 0.5 * sum(g.response.bounds[n]) for n in g.response.param_names}
        ell = self.spec.latent_dt * np.geomspace(5.0, 10.0, K) if K > 1 else np.array([7.0 * self.spec.latent_dt])
        return Params(loadings, means, noise, ell, response)

    def prior_draw(self, seed: int = 0) -> np.ndarray:
        """A flat unconstrained vector drawn from the prior (seeded)."""
        return tf.prior_draw(seed, self.priors, self.blocks)

    # ------------------------------------------------------------------------------------------ evidence
    def execution_info(self) -> dict:
        info = runtime.execution_info(include_jax=True)
        info.update(
            linear_algebra=self.linear_algebra,
            method=self.method,
            num_params=self.num_params,
            n_runs=len(self.data.runs),
            node_counts=self.node_counts,
            factorization_dims=self.factorization_dims,
            batch_runs=self.batch_runs,
            run_stacks=self.run_stacks,
            model_devices=[str(d) for d in self.devices],
            n_observed=self.data.n_observed,
        )
        return info

    # ------------------------------------------------------------------------------------------ inference
    def fit_map(self, **kwargs):
        """MAP fit: forwards to :func:`msrm.gp.map.fit_map`."""
        from .map import fit_map

        return fit_map(self, **kwargs)

    def sample(self, **kwargs):
        """NUTS posterior: forwards to :func:`msrm.gp.posterior.sample`."""
        from .posterior import sample

        return sample(self, **kwargs)

    def approximate_posterior(self, init=None, method: str = "laplace", num_samples: int = 1000, seed: int = 0,
                              **kwargs):
        """Laplace approximation ``N(u*, H^{-1})`` at the MAP in unconstrained space, drawn from into the same
        result type as :meth:`sample` (one chain): forwards to :func:`msrm.gp.laplace.approximate_posterior`."""
        from .laplace import approximate_posterior

        return approximate_posterior(self, init=init, method=method, num_samples=num_samples, seed=seed, **kwargs)

    def __repr__(self) -> str:
        return (f"GPMSRM(linear_algebra={self.linear_algebra!r}, runs={len(self.data.runs)}, "
                f"num_params={self.num_params}, nodes={self.node_counts})")
