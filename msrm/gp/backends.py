r"""The backend interface of GP-MSRM and the registry that maps ``linear_algebra`` names to backends.

A backend computes the GP-MSRM marginal likelihood of a dataset (latent factors integrated out) in its own way:
``"dense"`` and ``"grouped"`` (:mod:`msrm.gp.likelihood`, node-space Woodbury identity), ``"state_space"``
(:mod:`msrm.gp.state_space`, a Kalman filter over the latent grid). :class:`msrm.GPMSRM` finds it by name in
:data:`BACKENDS` and talks to it only through :class:`Backend`:

* ``name``: the ``linear_algebra`` string.
* ``options_type``: a frozen dataclass of the backend's own keyword options with their defaults, validated in its
  ``__post_init__`` (``ValueError`` naming the option). ``GPMSRM(data, spec, NAME, **kwargs)`` collects the
  keywords that are fields of this type into one instance (:func:`make_options`); a keyword that belongs to another
  backend, or to none, is refused with a ``ValueError`` naming the keyword and the backend. ``method`` (one of
  :data:`msrm.gp.linalg.METHODS`) is checked there, once, and passed in when the options type has a ``method``
  field; the options type and everything below it take it as valid.
* ``prepare(data, spec, options) -> prepared``: everything that does not depend on the parameters, on the host
  (NumPy), once per model. ``prepared`` is a JAX pytree whose leaves are the arrays the likelihood reads.
* ``peak_bytes(prepared, options) -> msrm.gp.memory.PeakBytes | None``: the predicted peak memory of one
  likelihood value+gradient, with what would run and what to do instead, checked by the model's memory guard
  (:func:`msrm.gp.memory.check_peak`) before anything is placed on a device; None when there is no estimate (the
  guard is skipped).
* ``devices(options, devices, commit) -> list``: the devices it will run on, out of ``devices`` (what the caller
  asked for: every local device by default; ``commit`` is True when the caller named them). Called before
  ``prepare``; raises ``ValueError`` starting with ``"devices:"`` for a choice the backend cannot run (several
  named devices for a backend that runs on one).
* ``place(prepared, options, devices, commit) -> (prepared, devices)``: put the prepared data on those devices
  (committed there when ``commit``, else JAX's default placement), after the memory guard.
* ``batch_runs(options) -> bool``: whether runs are stacked and evaluated together (False by default).
* ``stacks(prepared) -> list[dict]``: for the placed ``prepared``, one dict per stack of runs evaluated together
  (``runs``, ``n_nodes``, ``n_grid``, ``slots``, ``method``; :attr:`msrm.GPMSRM.run_stacks`); empty by default.
* ``loglik(theta, prepared) -> (value, events)``: pure JAX, jit- and grad-able. ``theta`` is the constrained
  parameter pytree of :func:`msrm.gp.model.params_to_theta` (``loadings``, ``intercepts``, ``noise_sd``
  per stream key, ``lengthscales`` (K,), ``response`` per parameter key). ``value`` is the float64 log
  likelihood summed over runs; ``events`` an int32 array of guard codes the model counts
  (:meth:`msrm.GPMSRM.guard_events`).
* ``run_logliks(theta, prepared) -> (values, events)``: the per-run log likelihoods ``(n_runs,)`` (their sum is
  ``loglik``'s value) and events.
* ``describe_event(code) -> str | None``: what a guard code of ``events`` means, None for a healthy evaluation;
  the model warns (:class:`msrm.gp.accuracy.NumericalAccuracyWarning`) with that sentence the first time each
  code is seen.
* ``node_counts(prepared) -> list[int]``: nodes per run of the node-space factorization (an empty list when the
  backend has none).
* ``pointwise_prepare(data, spec, options) -> prepared``, ``pointwise_peak_bytes(prepared, options) ->
  PeakBytes | None`` and ``pointwise(theta, prepared) -> (values, events)``: the pointwise log likelihood
  (:meth:`msrm.GPMSRM.pointwise_log_likelihood`, ``by="node"``): a host preparation of its own, made on first
  use, its memory check, and pure JAX ``{stream key: (total samples of the stream,)}`` float64 conditional log
  densities, run order then sample order, with int32 guard codes as ``loglik``'s.
* ``latent_posterior(theta, prepared, data, spec, cov=False) -> list[msrm.LatentPosterior]``: the exact
  Gaussian ``p(Z | Y, theta)`` of each run's factors on its grid (mean, marginal sd; the (J, K, K) covariance at
  each grid point when ``cov``). ``data`` and ``spec`` are the model's own (the host-side description of every
  sample, which ``prepared`` need not keep). Host NumPy results.
* ``predict(theta, prepared, data, spec) -> list[dict[str, msrm.Prediction]]``: per run, per stream key, the
  posterior predictive mean and sd of every (sample, feature), the missing ones included.

:class:`Backend` is a base class with those defaults (``peak_bytes`` None, one device, no stacks,
``node_counts`` empty); ``prepare``, ``loglik``, ``run_logliks``, the pointwise terms, ``latent_posterior`` and
``predict`` raise ``NotImplementedError`` naming the backend and what it does not compute. A backend is one
module that defines a subclass and ends with one :func:`register_backend` call. The built-in modules are listed in
:data:`BUILTIN_MODULES` and imported the first time the registry is read, so :data:`BACKENDS` always holds
``"dense"``, ``"grouped"`` and ``"state_space"`` while this module imports none of them (they import it for
:class:`Backend`).
"""
from __future__ import annotations

import dataclasses
import importlib
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    from .memory import PeakBytes

__all__ = ["Backend", "NoOptions", "BACKENDS", "DEFAULT_BACKEND", "register_backend", "unregister_backend",
           "get_backend", "make_options", "option_names"]


@dataclass(frozen=True)
class NoOptions:
    """The options type of a backend without keyword options."""


class Backend:
    """Base class of GP-MSRM backends (see the module docstring for the contract of every method)."""

    name: str = ""
    options_type: type = NoOptions

    def prepare(self, data, spec, options) -> Any:
        raise NotImplementedError(f"backend {self.name!r} defines no prepare")

    def peak_bytes(self, prepared, options) -> PeakBytes | None:
        """No estimate: the model's memory guard is skipped."""
        return None

    def devices(self, options, devices: list, commit: bool) -> list:
        """One device: the first of ``devices``; several named ones are refused."""
        if commit and len(devices) > 1:
            raise ValueError(f"devices: linear_algebra={self.name!r} runs on one device, got {len(devices)}; "
                             f"sharding runs over several needs 'dense' or 'grouped' with batch_runs=True")
        return list(devices[:1])

    def place(self, prepared, options, devices: list, commit: bool):
        """``prepared`` on ``devices[0]`` when ``commit``, else in JAX's default (uncommitted) placement."""
        import jax

        return jax.device_put(prepared, devices[0] if commit else None), devices

    def batch_runs(self, options) -> bool:
        """Runs are evaluated one by one."""
        return False

    def stacks(self, prepared) -> list[dict]:
        """No stacks of runs."""
        return []

    def loglik(self, theta, prepared):
        raise NotImplementedError(f"backend {self.name!r} defines no loglik")

    def run_logliks(self, theta, prepared):
        raise NotImplementedError(f"linear_algebra={self.name!r} gives no per-run log likelihood")

    def node_counts(self, prepared) -> list[int]:
        return []

    def describe_event(self, code: int) -> str | None:
        """What one guard code of ``loglik``'s ``events`` means, or None for a healthy evaluation. The default
        reads the codes of the guarded factorization (:func:`msrm.gp.linalg.describe_event`): 0 is a plain
        Cholesky; a jitter rung or the eigenvalue fallback changed the matrix, so the density is that of a
        regularised model."""
        from .linalg.ladder import EVENT_PLAIN, describe_event

        code = int(code)
        if code == EVENT_PLAIN:
            return None
        return (f"the node-space factorization used {describe_event(code)}: the value is the density of a "
                f"regularised matrix; check for duplicated streams, loadings far outside the data's scale or a "
                f"lengthscale far longer than the run")

    def compile_level(self, prepared) -> int | None:
        """XLA's backend optimisation level (``xla_backend_optimization_level``, 0 to 3) this backend's programs
        should be compiled with on a CPU under ``msrm.runtime.configure(xla_cpu_optimization="auto")``, or None
        for XLA's default."""
        return None

    def pointwise_prepare(self, data, spec, options):
        """The host preparation of the pointwise log likelihood."""
        raise NotImplementedError(self._no_pointwise())

    def pointwise_peak_bytes(self, prepared, options) -> PeakBytes | None:
        """No estimate for the pointwise terms: the guard is skipped."""
        return None

    def pointwise(self, theta, prepared):
        """``({stream key: (total samples of the stream,)}, events)``: the conditional log density of each stream
        sample given every other observed value of its run."""
        raise NotImplementedError(self._no_pointwise())

    def _no_pointwise(self) -> str:
        return (f"linear_algebra={self.name!r} does not compute the pointwise log likelihood "
                f"(pointwise_log_likelihood(u, by='node')); by='run' gives the per-run terms")

    def latent_posterior(self, theta, prepared, data, spec, cov: bool = False):
        """Posterior of the latent factors on each run's grid (``list[msrm.LatentPosterior]``)."""
        raise NotImplementedError(f"linear_algebra={self.name!r} does not compute the latent posterior")

    def predict(self, theta, prepared, data, spec):
        """Posterior predictive of every stream at every sample (``list[dict[str, msrm.Prediction]]``)."""
        raise NotImplementedError(f"linear_algebra={self.name!r} does not compute predictions")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


#: The backend ``msrm.GPMSRM`` uses when ``linear_algebra`` is not given.
DEFAULT_BACKEND = "grouped"

#: Modules whose import registers the built-in backends.
BUILTIN_MODULES = ("msrm.gp.grouped", "msrm.gp.state_space")


class Registry(MutableMapping):
    """Backends by name; the first read imports :data:`BUILTIN_MODULES`, which register themselves."""

    def __init__(self) -> None:
        self._entries: dict[str, Backend] = {}
        self._loaded = False

    def _load(self) -> None:
        if not self._loaded:
            self._loaded = True  # before the imports: their register_backend calls read the registry
            for module in BUILTIN_MODULES:
                importlib.import_module(module)

    def __getitem__(self, name: str) -> Backend:
        self._load()
        return self._entries[name]

    def __setitem__(self, name: str, backend: Backend) -> None:
        self._entries[name] = backend

    def __delitem__(self, name: str) -> None:
        self._load()
        del self._entries[name]

    def __iter__(self) -> Iterator[str]:
        self._load()
        return iter(dict(self._entries))

    def __len__(self) -> int:
        self._load()
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        self._load()
        return name in self._entries

    def __repr__(self) -> str:
        return f"Registry({sorted(self)})"


#: Backends by ``linear_algebra`` name.
BACKENDS = Registry()


def register_backend(backend: Backend, *, replace: bool = False) -> Backend:
    """Add ``backend`` to :data:`BACKENDS` under ``backend.name`` and return it.

    Raises:
        ValueError: the name is empty or already registered (unless ``replace``), or the options type is not a
            frozen dataclass.
    """
    name = getattr(backend, "name", "")
    if not isinstance(name, str) or not name:
        raise ValueError(f"a backend needs a non-empty string name, got {name!r}")
    if name in BACKENDS and not replace:
        raise ValueError(f"a backend named {name!r} is already registered")
    opt = backend.options_type
    if not (dataclasses.is_dataclass(opt) and opt.__dataclass_params__.frozen):
        raise ValueError(f"backend {name!r}: options_type must be a frozen dataclass, got {opt!r}")
    BACKENDS[name] = backend
    return backend


def unregister_backend(name: str) -> Backend:
    """Remove and return the backend registered as ``name`` (KeyError when there is none)."""
    return BACKENDS.pop(name)


def get_backend(name: str) -> Backend:
    """The backend registered as ``name``.

    Raises:
        ValueError: no backend has that name (the message lists the registered names).
    """
    if not isinstance(name, str) or name not in BACKENDS:
        raise ValueError(f"linear_algebra must be one of {tuple(BACKENDS)}, got {name!r}")
    return BACKENDS[name]


def option_names(backend: Backend) -> tuple[str, ...]:
    """The keyword options of a backend (the fields of its options type)."""
    return tuple(f.name for f in dataclasses.fields(backend.options_type))


def make_options(backend: Backend, method: str = "auto", **kwargs):
    """The backend's options from GPMSRM keywords.

    A keyword given as None takes the backend's default. ``method`` must be one of
    :data:`msrm.gp.linalg.METHODS`, checked here and nowhere below: it goes into the options when the options
    type has that field; otherwise only ``"auto"`` is accepted.

    Raises:
        ValueError: an unknown ``method``; a keyword that is not an option of this backend (named, with the
            backends it belongs to), or an invalid value (from the options type's validation).
    """
    from .linalg import METHODS

    if not isinstance(method, str) or method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    own = option_names(backend)
    given = {k: v for k, v in kwargs.items() if v is not None}
    for key in given:
        if key not in own or key == "method":
            owners = [n for n, b in BACKENDS.items() if key in option_names(b)]
            where = f"; it is an option of linear_algebra={' or '.join(map(repr, owners))}" if owners else ""
            raise ValueError(f"option {key!r} does not apply to linear_algebra={backend.name!r}{where} "
                             f"(options of {backend.name!r}: {sorted(set(own) - {'method'})})")
    if "method" in own:
        given["method"] = method
    elif method != "auto":
        raise ValueError(f"method={method!r}: linear_algebra={backend.name!r} has no method option")
    return backend.options_type(**given)
