"""Hand-written reverse rules of the node-covariance assembly against plain autodiff of the same formulas."""
import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from msrm.gp import likelihood as L  # noqa: E402


def _plain_cov(A, Kk):
    return jnp.einsum("kui,vi->kuv", jnp.einsum("uj,kji->kui", A, Kk), A)


def _plain_woodbury(R, C):
    out = 0.0
    for k in range(R.shape[-1]):
        r = R[:, :, k]
        out = out + r[:, :, None, None] * C[k][:, None, :, None] * r[None, None, :, :]
    return out


def _case(seed=0, N=23, K=3, J=17):
    rng = np.random.default_rng(seed)
    R = jnp.asarray(rng.standard_normal((N, K, K)))
    A = jnp.asarray(rng.standard_normal((N, J)) * (rng.random((N, J)) < 0.4))
    X = rng.standard_normal((K, J, J))
    Kk = jnp.asarray(X + X.transpose(0, 2, 1))
    G = rng.standard_normal((N * K, N * K))
    return R, A, Kk, jnp.asarray(G + G.T), jnp.asarray(rng.standard_normal((N * K, N * K)))


def _rel(a, b):
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


@pytest.mark.parametrize("K", [1, 2, 3])
def test_assembly_vjp_equals_autodiff(K):
    R, A, Kk, G, _ = _case(K=K)
    N = R.shape[0]

    def pipeline(cov, wood):
        def f(R, A, Kk):
            C = cov(A, Kk)
            C = 0.5 * (C + jnp.swapaxes(C, 1, 2))
            return jnp.sum(wood(R, C).reshape(N * K, N * K) * G)
        return f

    fast = pipeline(L.covariance_from_response, L.node_woodbury_matrix)
    slow = pipeline(_plain_cov, _plain_woodbury)
    assert abs(float(fast(R, A, Kk)) - float(slow(R, A, Kk))) <= 1e-12 * abs(float(slow(R, A, Kk)))
    gf = jax.grad(fast, argnums=(0, 1, 2))(R, A, Kk)
    gs = jax.grad(slow, argnums=(0, 1, 2))(R, A, Kk)
    assert _rel(gf[0], gs[0]) < 1e-12
    assert _rel(gf[1], gs[1]) < 1e-12
    # the covariance rule returns the symmetric part of the kernel cotangent (K_k is symmetric by construction)
    assert _rel(gf[2], 0.5 * (gs[2] + jnp.swapaxes(gs[2], 1, 2))) < 1e-12


def test_likelihood_cotangent_is_symmetric():
    """The Woodbury rule needs a symmetric cotangent: the one quad_logdet hands back is."""
    from msrm.gp import linalg

    R, A, Kk, _, Gn = _case(seed=3)
    M = Gn @ Gn.T + Gn.shape[0] * jnp.eye(Gn.shape[0])
    v = jnp.arange(M.shape[0], dtype=jnp.float64)
    for method in ("native", "callback"):
        G = jax.grad(lambda M: sum(linalg.quad_logdet(M, v, method=method)[:2]))(M)
        assert float(jnp.max(jnp.abs(G - G.T))) == 0.0


def test_assembly_rules_match_finite_differences():
    R, A, Kk, G, _ = _case(seed=5, N=9, K=2, J=7)
    N, K = R.shape[:2]

    def f(R, A, s):
        C = L.covariance_from_response(A, s * Kk)
        C = 0.5 * (C + jnp.swapaxes(C, 1, 2))
        return jnp.sum(L.node_woodbury_matrix(R, C).reshape(N * K, N * K) * G)

    from jax.test_util import check_grads

    check_grads(f, (R, A, 1.3), order=1, modes=("rev",), eps=1e-6, atol=1e-7, rtol=1e-7)


def test_woodbury_matrix_is_bitwise_symmetric_for_symmetric_C():
    """The likelihood factorises M without symmetrising it: M must be exactly symmetric (no rounding asymmetry)."""
    R, A, Kk, _, _ = _case(seed=11, N=31, K=3, J=19)
    N, K = R.shape[:2]
    C = L.covariance_from_response(A, Kk)
    C = 0.5 * (C + jnp.swapaxes(C, 1, 2))
    M = np.asarray(jax.jit(lambda R, C: jnp.eye(N * K) + L.node_woodbury_matrix(R, C).reshape(N * K, N * K))(R, C))
    assert np.array_equal(M, M.T)


@pytest.mark.parametrize("method", ["native", "callback"])
def test_symmetric_flag_equals_default_path(method):
    from msrm.gp import linalg

    rng = np.random.default_rng(2)
    X = rng.standard_normal((40, 40))
    M = jnp.asarray(X @ X.T + 40 * np.eye(40))
    M = 0.5 * (M + M.T)
    v = jnp.asarray(rng.standard_normal(40))

    def f(sym):
        return lambda M, v: sum(linalg.quad_logdet(M, v, method=method, symmetric=sym)[:2])

    a = jax.value_and_grad(f(False), argnums=(0, 1))(M, v)
    b = jax.value_and_grad(f(True), argnums=(0, 1))(M, v)
    assert float(a[0]) == pytest.approx(float(b[0]), rel=1e-14)
    for x, y in zip(a[1], b[1]):
        assert _rel(y, x) < 1e-12


# ------------------------------------------------------------------ chunked (banded) covariance products

def _windows_case(seed, J=97, groups=((45, 2), (70, 11), (33, 25), (5, 4))):
    rng = np.random.default_rng(seed)
    starts, weights = [], []
    for n, w in groups:
        st = np.sort(rng.integers(0, J - w + 1, size=n))
        st[-2:] = J - w  # windows cut by the grid's end
        starts.append(st)
        weights.append(jnp.asarray(rng.standard_normal((n, w))))
    X = rng.standard_normal((3, J, J))
    return J, groups, starts, weights, jnp.asarray(X + X.transpose(0, 2, 1))


def _dense_rows(J, groups, starts, weights):
    rows = []
    for a, st, (n, w) in zip(weights, starts, groups):
        A = jnp.zeros((n, J)).at[np.repeat(np.arange(n), w), (st[:, None] + np.arange(w)).ravel()].set(a.reshape(-1))
        rows.append(A)
    return jnp.concatenate(rows)


def test_chunked_covariance_equals_dense_products():
    from msrm.gp import banded as B

    J, groups, starts, weights, Kk = _windows_case(4)
    shapes = tuple(B.chunk_shape([st], w, J) for st, (n, w) in zip(starts, groups))
    assert all(sh is not None for sh in shapes) and any(sh.n_chunks * B.CHUNK > sh.n_nodes for sh in shapes)

    def band(ws, Kk):
        wins = tuple(B.chunk_windows(a, st, sh, J) for a, st, sh in zip(ws, starts, shapes))
        return B.chunked_covariance(shapes, wins, Kk)

    def dense(ws, Kk):
        return _plain_cov(_dense_rows(J, groups, starts, ws), Kk)

    assert _rel(jax.jit(band)(weights, Kk), dense(weights, Kk)) < 1e-13
    N = sum(n for n, _ in groups)
    G = jnp.asarray(np.random.default_rng(1).standard_normal((3, N, N)))
    gb = jax.grad(lambda ws, K: jnp.sum(band(ws, K) * G), argnums=(0, 1))(weights, Kk)
    gd = jax.grad(lambda ws, K: jnp.sum(dense(ws, K) * G), argnums=(0, 1))(weights, Kk)
    for x, y in zip(gb[0], gd[0]):
        assert _rel(x, y) < 1e-12
    assert _rel(gb[1], 0.5 * (gd[1] + jnp.swapaxes(gd[1], 1, 2))) < 1e-12


def test_chunked_covariance_under_vmap():
    """Stacked runs (traced window starts, batched under vmap on accelerators): each run equals its dense products."""
    from msrm.gp import banded as B

    J, groups, starts, weights, Kk = _windows_case(6)
    _, _, starts2, weights2, _ = _windows_case(7)
    shapes = tuple(B.chunk_shape([s1, s2], w, J) for s1, s2, (n, w) in zip(starts, starts2, groups))
    N = sum(n for n, _ in groups)
    G = jnp.asarray(np.random.default_rng(2).standard_normal((3, N, N)))

    def band(ws, sts, Kk):
        wins = tuple(B.chunk_windows(a, st, sh, J) for a, st, sh in zip(ws, sts, shapes))
        return jnp.sum(B.chunked_covariance(shapes, wins, Kk) * G)

    ws = tuple(jnp.stack([a, b]) for a, b in zip(weights, weights2))
    sts = tuple(jnp.asarray(np.stack([a, b]), dtype=jnp.int32) for a, b in zip(starts, starts2))
    val, grad = jax.vmap(jax.value_and_grad(band, argnums=(0, 2)), in_axes=(0, 0, None))(ws, sts, Kk)
    for i, (st, w) in enumerate(((starts, weights), (starts2, weights2))):
        dense = jax.value_and_grad(lambda ws, K: jnp.sum(_plain_cov(_dense_rows(J, groups, st, ws), K) * G),
                                   argnums=(0, 1))
        v, (gw, gk) = dense(w, Kk)
        assert float(val[i]) == pytest.approx(float(v), rel=1e-12)
        for x, y in zip(grad[0], gw):
            assert _rel(x[i], y) < 1e-12
        assert _rel(grad[1][i], 0.5 * (gk + jnp.swapaxes(gk, 1, 2))) < 1e-12


def test_chunk_shape_refuses_unordered_starts():
    from msrm.gp import banded as B

    assert B.chunk_shape([np.array([3, 1, 2])], 2, 50) is None
    assert not B.worthwhile([None], 50)
    assert not B.worthwhile([B.ChunkShape(10, 1, 30)], 50)  # a span over half the grid: dense is as good


@pytest.mark.parametrize("batch_runs", [False, True])
def test_model_with_chunked_products_equals_dense_products(monkeypatch, batch_runs):
    """Whole likelihood (value and gradient) through the chunked products == through the dense ones, on runs
    cut from one recording (unequal sizes: padded nodes in the stacked path)."""
    import msrm
    import data_synth
    from msrm.data import split_run
    from msrm.gp import banded as B
    from msrm.gp.model import GPMSRM

    data, truth = data_synth.synthetic_dataset("tiny", n_features=3, seed=2, duration_scale=3.0,
                                               missing_fraction=0.1)
    data = msrm.Dataset(split_run(data.runs[0], 2))
    out = {}
    for forced in (False, True):
        monkeypatch.setattr(B, "worthwhile", lambda shapes, n_grid, f=forced: f and all(s is not None for s in shapes))
        model = GPMSRM(data, truth.spec, "grouped", batch_runs=batch_runs)
        if batch_runs:
            used = [all(g.chunks is not None for g in b.signature.groups) for b in model.prepared.buckets]
        else:
            from msrm.gp.likelihood import _own_stack

            used = [all(g.chunks is not None for g in _own_stack(r.layout)[0].groups) for r in model.prepared.runs]
        assert used == [forced] * len(used)
        u = model.unconstrain(truth.params)
        out[forced] = model.value_and_grad(u)
    assert out[True][0] == pytest.approx(out[False][0], rel=1e-12)
    g0, g1 = out[False][1], out[True][1]
    np.testing.assert_allclose(g1, g0, rtol=0, atol=1e-9 * np.abs(g0).max())
