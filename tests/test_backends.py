"""The backend interface: a toy backend registered from outside the package runs through GPMSRM and gets every
feature of the model (log likelihood, gradient, per-run and pointwise terms, the memory guard, run stacks, the
execution record); a backend that leaves an optional method out gets the default of :class:`Backend` or a
``NotImplementedError`` naming it; unknown names and options that belong to another backend, or to none, are
refused with the name in the message."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

import msrm

msrm.runtime.enable_x64()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from msrm.gp import backends, memory  # noqa: E402
from msrm.gp.kernels import grid_distances, kernel_matrices  # noqa: E402
from msrm.gp.model import GPMSRM  # noqa: E402
from msrm.gp.reference import brute_force_loglik  # noqa: E402
from msrm.operators import response_weights  # noqa: E402


@dataclass(frozen=True)
class ToyOptions:
    jitter: float = 0.0

    def __post_init__(self):
        if not (isinstance(self.jitter, float) and self.jitter >= 0):
            raise ValueError(f"jitter must be a float >= 0, got {self.jitter!r}")


class ToyPrepared:
    """Arrays per run (grid distances, response rows of every observed value, the values) as pytree leaves; the
    static part (per run and stream: the stream key, the observed features and their samples in value order, the
    sample count; kernel; jitter) as aux data."""

    def __init__(self, arrays, static):
        self.arrays, self.static = arrays, static


jax.tree_util.register_pytree_node(ToyPrepared, lambda p: ((p.arrays,), p.static),
                                   lambda static, ch: ToyPrepared(ch[0], static))


class ToyBackend(backends.Backend):
    """The observation covariance of every run as one dense matrix (responses without parameters only):
    ``Cov = sum_k (g_k g_k^T) * (A K_k A^T) + diag(sigma^2)``, one row per observed value."""

    name = "toy"
    options_type = ToyOptions

    def prepare(self, data, spec, options):
        arrays, static = [], []
        for run in data.runs:
            grid = msrm.latent_grid(run.duration, spec)
            rows, ys, order = [], [], []
            for s in run.streams:
                A = response_weights(s.times, spec.responses[s.modality], None, grid)
                i, f = np.nonzero(s.mask)
                rows.append(A[i])
                ys.append(s.values[i, f])
                order.append((s.key, tuple(int(x) for x in f), tuple(int(x) for x in i), s.values.shape[0]))
            arrays.append((grid_distances(grid), np.concatenate(rows), np.concatenate(ys)))
            static.append(tuple(order))
        return ToyPrepared(tuple(arrays), (tuple(static), spec.kernel, options.jitter))

    @staticmethod
    def _covariances(theta, prepared):
        """Per run: the observed values less their means (n_obs,) and their covariance (n_obs, n_obs)."""
        runs, kernel, jitter = prepared.static
        for (dist, A, y), order in zip(prepared.arrays, runs):
            def per_value(field):
                return jnp.concatenate([theta[field][key][np.asarray(f, dtype=int)] for key, f, _, _ in order])

            W, b, sd = per_value("loadings"), per_value("intercepts"), per_value("noise_sd")
            Kk = kernel_matrices(dist, theta["lengthscales"], kernel)
            cov = jnp.einsum("ok,pk,kop->op", W, W, jnp.einsum("oj,kji,pi->kop", A, Kk, A))
            yield y - b, cov + jnp.diag(sd * sd + jitter), order

    def run_logliks(self, theta, prepared):
        values = []
        for r, cov, _ in self._covariances(theta, prepared):
            L = jnp.linalg.cholesky(cov)
            z = jax.scipy.linalg.solve_triangular(L, r, lower=True)
            values.append(-0.5 * (z.size * np.log(2 * np.pi) + 2 * jnp.sum(jnp.log(jnp.diag(L))) + z @ z))
        return jnp.stack(values), jnp.zeros(len(values), jnp.int32)

    def peak_bytes(self, prepared, options):
        """Four (n_obs, n_obs) matrices of the largest run (covariance, factor and their adjoints)."""
        n = max(int(y.shape[0]) for _, _, y in prepared.arrays)
        return memory.PeakBytes(4 * memory.dense_bytes(n, n), f"the toy likelihood (n_obs = {n})", dim=n,
                                suggestion="use a smaller toy")

    def pointwise_prepare(self, data, spec, options):
        return self.prepare(data, spec, options)

    def pointwise(self, theta, prepared):
        """The conditional density of each (stream, sample) block B of observed values given the rest of its run,
        from the precision P of the dense covariance: ``-1/2 [|B| log 2 pi - log|P_BB| + g_B^T P_BB^-1 g_B]``
        with ``g = P (y - mean)``; a sample with nothing observed gives 0."""
        parts: dict[str, list] = {}
        for r, cov, order in self._covariances(theta, prepared):
            P = jnp.linalg.inv(cov)
            g = P @ r
            start = 0
            for key, f, samples, n_samples in order:
                samples = np.asarray(samples, dtype=int)
                terms = []
                for i in range(n_samples):
                    B = start + np.flatnonzero(samples == i)
                    if B.size == 0:
                        terms.append(jnp.zeros(()))
                        continue
                    PBB = P[np.ix_(B, B)]
                    terms.append(-0.5 * (B.size * np.log(2 * np.pi) - jnp.linalg.slogdet(PBB)[1]
                                         + g[B] @ jnp.linalg.solve(PBB, g[B])))
                start += samples.size
                parts.setdefault(key, []).append(jnp.stack(terms))
        return {k: jnp.concatenate(v) for k, v in parts.items()}, jnp.zeros(len(prepared.arrays), jnp.int32)

    def loglik(self, theta, prepared):
        values, events = self.run_logliks(theta, prepared)
        return jnp.sum(values), events


class ToyPlain(ToyBackend):
    """The toy likelihood alone: every optional method (memory estimate, pointwise terms) is Backend's."""

    name = "toy_plain"
    peak_bytes = backends.Backend.peak_bytes
    pointwise_prepare = backends.Backend.pointwise_prepare
    pointwise = backends.Backend.pointwise


def _tiny():
    rng = np.random.default_rng(3)
    spec = msrm.ModelSpec(n_factors=2, latent_dt=1.0, kernel="matern32", responses={"brain": msrm.Identity()})
    runs = []
    for T in (12.0, 9.0):
        streams = []
        for p, dt in (("a", 1.5), ("b", 2.0)):
            n = int(T // dt) + 1
            Y = rng.normal(size=(n, 3))
            Y[1, 2] = np.nan
            streams.append(msrm.Stream(p, "brain", dt, Y))
        runs.append(msrm.Run(T, streams))
    data = msrm.Dataset(runs)
    params = msrm.Params(
        loadings={k: rng.normal(size=(3, 2)) for k in data.stream_keys},
        intercepts={k: rng.normal(size=3) for k in data.stream_keys},
        noise_sd={k: 0.5 + rng.random(3) for k in data.stream_keys},
        lengthscales=np.array([2.0, 4.0]))
    return data, spec, params


@pytest.fixture
def toy():
    backend = backends.register_backend(ToyBackend())
    try:
        yield backend
    finally:
        backends.unregister_backend("toy")
    assert "toy" not in backends.BACKENDS


def test_toy_backend_runs_through_gpmsrm(toy):
    data, spec, params = _tiny()
    model = GPMSRM(data, spec, linear_algebra="toy")
    assert model.backend is toy and model.node_counts == [] and len(model.devices) == 1
    ref = brute_force_loglik(data, spec, params)
    assert model.log_likelihood(params) == pytest.approx(ref, rel=1e-10)
    grouped = GPMSRM(data, spec, linear_algebra="grouped")
    u = model.unconstrain(params)
    v, g = model.value_and_grad(u)
    v0, g0 = grouped.value_and_grad(u)
    assert v == pytest.approx(v0, rel=1e-10)
    np.testing.assert_allclose(g, g0, rtol=0, atol=1e-8 * np.abs(g0).max())
    runs = model.pointwise_log_likelihood(u, by="run")["run"]
    np.testing.assert_allclose(runs, grouped.pointwise_log_likelihood(u, by="run")["run"], rtol=1e-10)
    assert model.guard_events() == {0: 6}
    assert GPMSRM(data, spec, "toy", jitter=1e-3).log_likelihood(params) != model.log_likelihood(params)
    with pytest.raises(NotImplementedError, match="latent posterior"):
        toy.latent_posterior(None, model.prepared, model.data, model.spec)
    with pytest.raises(NotImplementedError, match="predictions"):
        toy.predict(None, model.prepared, model.data, model.spec)


def test_unknown_backend_and_wrong_options_raise(toy):
    data, spec, _ = _tiny()
    with pytest.raises(ValueError, match="linear_algebra.*'nope'"):
        GPMSRM(data, spec, linear_algebra="nope")
    with pytest.raises(ValueError, match="jitter"):
        GPMSRM(data, spec, "toy", jitter=-1.0)
    with pytest.raises(ValueError, match="'batch_runs'.*'toy'.*'dense' or 'grouped'"):
        GPMSRM(data, spec, "toy", batch_runs=False)
    with pytest.raises(ValueError, match="'jittr'.*'toy'"):
        GPMSRM(data, spec, "toy", jittr=0.1)
    with pytest.raises(ValueError, match="method"):
        GPMSRM(data, spec, "toy", method="native")
    with pytest.raises(ValueError, match="'jitter'.*'grouped'.*'toy'"):
        GPMSRM(data, spec, "grouped", jitter=0.1)
    with pytest.raises(ValueError, match="'block'.*'grouped'.*'state_space'"):
        GPMSRM(data, spec, "grouped", block=3)
    with pytest.raises(ValueError, match="already registered"):
        backends.register_backend(ToyBackend())


def test_builtin_backends_are_registered():
    assert {"dense", "grouped", "state_space"} <= set(backends.BACKENDS)
    for name, b in backends.BACKENDS.items():
        assert b.name == name
    assert "pad_tolerance" in backends.option_names(backends.BACKENDS["grouped"])
    assert "n_states" in backends.option_names(backends.BACKENDS["state_space"])


def test_toy_backend_gets_every_feature(toy, monkeypatch):
    data, spec, params = _tiny()
    model = GPMSRM(data, spec, linear_algebra="toy")
    grouped = GPMSRM(data, spec, linear_algebra="grouped")
    u = model.unconstrain(params)
    got, ref = model.pointwise_log_likelihood(u), grouped.pointwise_log_likelihood(u)
    assert sorted(got) == sorted(ref)
    for key in ref:
        np.testing.assert_allclose(got[key], ref[key], rtol=1e-9, atol=1e-9, err_msg=key)
    assert model.run_stacks == [] and model.batch_runs is False and model.factorization_dims == []
    info = model.execution_info()
    assert info["linear_algebra"] == "toy" and info["run_stacks"] == [] and info["batch_runs"] is False
    monkeypatch.setenv(memory.ENV_LIMIT, "1000")
    with pytest.raises(memory.MemoryGuardError, match=r"toy likelihood \(n_obs = \d+\).*smaller toy"):
        GPMSRM(data, spec, linear_algebra="toy")


def test_backend_defaults_and_missing_features():
    backend = backends.register_backend(ToyPlain())
    try:
        data, spec, params = _tiny()
        model = GPMSRM(data, spec, linear_algebra="toy_plain")
        u = model.unconstrain(params)
        assert backend.peak_bytes(model.prepared, model.options) is None  # no estimate: the guard is skipped
        assert model.run_stacks == [] and model.batch_runs is False
        assert model.pointwise_log_likelihood(u, by="run")["run"].shape == (2,)
        with pytest.raises(NotImplementedError, match="'toy_plain'.*pointwise log likelihood"):
            model.pointwise_log_likelihood(u)
        backend.peak_bytes = lambda prepared, options: (10, 3)  # not the documented shape
        with pytest.raises(TypeError, match="'toy_plain'.*peak_bytes.*PeakBytes"):
            GPMSRM(data, spec, linear_algebra="toy_plain")
    finally:
        backends.unregister_backend("toy_plain")


def test_builtin_backends_report_stacks_and_peaks():
    data, spec, _ = _tiny()
    for name in ("grouped", "dense"):
        batched = GPMSRM(data, spec, name)
        assert batched.batch_runs is True and sorted(r for s in batched.run_stacks for r in s["runs"]) == [0, 1]
        single = GPMSRM(data, spec, name, batch_runs=False)
        assert single.batch_runs is False and single.run_stacks == []
        peak = batched.backend.peak_bytes(batched.backend.prepare(data, spec, batched.options), batched.options)
        assert isinstance(peak, memory.PeakBytes) and peak.dim == max(batched.factorization_dims)
    ss = GPMSRM(data, spec, "state_space")
    assert ss.batch_runs is False and ss.run_stacks == []
    peak = ss.backend.peak_bytes(ss.backend.prepare(data, spec, ss.options), ss.options)
    assert isinstance(peak, memory.PeakBytes) and peak.dim is None and "state_space" in peak.what


def test_method_is_checked_once_where_options_are_made():
    from msrm.gp.linalg import METHODS

    data, spec, _ = _tiny()
    for name in ("grouped", "state_space"):
        with pytest.raises(ValueError, match=r"method must be one of \('auto', 'callback', 'native'\), got 'gpu'"):
            backends.make_options(backends.get_backend(name), method="gpu")
        assert backends.make_options(backends.get_backend(name), method="native").method == "native"
    with pytest.raises(ValueError, match="method must be one of"):
        GPMSRM(data, spec, "grouped", method="gpu")
    assert METHODS == ("auto", "callback", "native")
