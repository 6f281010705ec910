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
