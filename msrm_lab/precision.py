r"""A 50-digit reference of the GP-MSRM density and latent posterior (mpmath), and the corner cases it checks.

The model's inputs are float64 numbers (data, parameters, sample times, response rows); the reference takes them as
exact and evaluates everything that follows in ``dps``-digit arithmetic, so the only rounding left is its own
(about ``10^-dps``). For one run, with ``h_o`` the row of observed value ``o`` over ``vec Z`` (grid-major,
``index = j K + k``: the canonical dense response row of its sample times its loadings) and ``P`` the prior
covariance of ``vec Z``,

.. math::

    S = H P H^\top + D, \qquad \log p(y) = -\tfrac12\big[n \log 2\pi + \log|S| + (y - b)^\top S^{-1} (y - b)\big],

    E[z \mid y] = P H^\top S^{-1}(y - b), \qquad \operatorname{Var}[z_a \mid y] = P_{aa} - p_a^\top S^{-1} p_a,

with ``p_a`` column ``a`` of ``H P``. The kernel is the half-integer Matérn closed form evaluated in mpmath
(written here, not the package's code), ``k_{p+1/2}(r) = e^{-c r / l} \frac{p!}{(2p)!} \sum_{i=0}^{p}
\frac{(p+i)!}{i!(p-i)!} (2 c r / l)^{p-i}``, ``c = \sqrt{2p+1}``. Rows of ``H`` are sparse (a response reaches a
few grid points), which keeps the ``O(n^2)`` assembly cheap; the Cholesky factorization is ``O(n^3)`` in pure
Python: keep ``n`` below about 150 observed values per run.

:func:`corner_case` builds the one-factor, one-stream models of the accuracy contract (DESIGN.md): a latent drawn
from its prior on the grid, seen through the Identity response at the grid points, with a chosen loading, offset,
noise and lengthscale.
"""
from __future__ import annotations

import math

import numpy as np

from msrm.nodes import response_groups
from msrm.operators import response_weights
from msrm.spec import latent_grid

__all__ = ["DIGITS", "MATERN_P", "mp_matern", "mp_loglik", "mp_latent_posterior", "corner_case"]

#: decimal digits of the reference arithmetic (mpmath's ``dps``)
DIGITS = 50

MATERN_P = {"matern12": 0, "matern32": 1, "matern52": 2, "matern72": 3}


def _mp():
    import mpmath

    return mpmath


def mp_matern(r, ell, p: int):
    """Half-integer Matérn correlation ``k_{p+1/2}(r; l)`` in mpmath (closed form)."""
    mp = _mp()
    x = mp.sqrt(2 * p + 1) * abs(mp.mpf(r)) / mp.mpf(ell)
    total = mp.mpf(0)
    for i in range(p + 1):
        total += mp.mpf(math.factorial(p + i)) / (math.factorial(i) * math.factorial(p - i)) * (2 * x) ** (p - i)
    return mp.exp(-x) * total * math.factorial(p) / math.factorial(2 * p)


def _cholesky(S):
    """Lower Cholesky factor of a list-of-lists mpf matrix (raises when not positive definite)."""
    mp = _mp()
    n = len(S)
    L = [[mp.mpf(0)] * n for _ in range(n)]
    for j in range(n):
        d = S[j][j] - mp.fsum(L[j][k] ** 2 for k in range(j))
        if d <= 0:
            raise ValueError("the reference covariance is not positive definite at this precision")
        L[j][j] = mp.sqrt(d)
        for i in range(j + 1, n):
            L[i][j] = (S[i][j] - mp.fsum(L[i][k] * L[j][k] for k in range(j))) / L[j][j]
    return L


def _forward(L, b):
    """Solve ``L x = b`` (lower triangular)."""
    mp = _mp()
    x = []
    for i in range(len(L)):
        x.append((b[i] - mp.fsum(L[i][k] * x[k] for k in range(i))) / L[i][i])
    return x


def _run_pieces(run, spec, params, groups, dps: int):
    """``(L, Hs, P, resid, grid, K)`` of one run: ``L`` the Cholesky factor of ``S``, ``Hs`` the sparse rows
    ``[(index, value), ...]`` of ``H``, ``P(a, b)`` the prior covariance and ``resid = y - b`` (exact)."""
    mp = _mp()
    mp.mp.dps = dps
    grid = latent_grid(run.duration, spec)
    K = spec.n_factors
    p = MATERN_P[spec.kernel]
    ell = [mp.mpf(float(x)) for x in np.asarray(params.lengthscales, dtype=np.float64)]
    tau = [mp.mpf(float(t)) for t in grid]
    cache: dict = {}

    def P(a: int, b: int):
        ja, ka = divmod(a, K)
        jb, kb = divmod(b, K)
        if ka != kb:
            return mp.mpf(0)
        key = (abs(ja - jb), ka)  # a regular grid: the correlation depends on |ja - jb| only
        if key not in cache:
            cache[key] = mp_matern(tau[ja] - tau[jb], ell[ka], p)
        return cache[key]

    by_key = {g.key: g for g in groups}
    Hs, resid, noise = [], [], []
    for s in run.streams:
        g = by_key.get(s.key, by_key.get(s.modality))
        theta = {} if g.param_key is None else params.response[g.param_key]
        A = response_weights(s.times, g.response, theta, grid)  # (n_s, J)
        W = np.asarray(params.loadings[s.key], dtype=np.float64)
        b = np.asarray(params.intercepts[s.key], dtype=np.float64)
        sd = np.asarray(params.noise_sd[s.key], dtype=np.float64)
        for i, f in zip(*np.nonzero(s.mask)):
            Hs.append([(int(j) * K + k, mp.mpf(float(A[i, j])) * mp.mpf(float(W[f, k])))
                       for j in np.nonzero(A[i])[0] for k in range(K)])
            resid.append(mp.mpf(float(s.values[i, f])) - mp.mpf(float(b[f])))
            noise.append(mp.mpf(float(sd[f])) ** 2)
    n = len(Hs)
    S = [[mp.mpf(0)] * n for _ in range(n)]
    for o in range(n):
        for o2 in range(o, n):
            v = mp.fsum(ha * hb * P(a, b) for a, ha in Hs[o] for b, hb in Hs[o2])
            S[o][o2] = S[o2][o] = v
        S[o][o] += noise[o]
    return _cholesky(S), Hs, P, resid, grid, K


def mp_loglik(data, spec, params, dps: int = DIGITS):
    """``log p(Y | params)`` summed over runs, to about ``dps`` digits (an ``mpmath.mpf``)."""
    mp = _mp()
    params.validate(data, spec)
    groups = response_groups(data, spec)
    total = mp.mpf(0)
    for run in data.runs:
        L, _, _, resid, _, _ = _run_pieces(run, spec, params, groups, dps)
        u = _forward(L, resid)
        n = len(resid)
        total += -(n * mp.log(2 * mp.pi) + 2 * mp.fsum(mp.log(L[i][i]) for i in range(n))
                   + mp.fsum(x * x for x in u)) / 2
    return total


def mp_latent_posterior(data, spec, params, dps: int = DIGITS) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per run ``(grid (J,), mean (J, K), sd (J, K))`` of the latent posterior, rounded to float64 at the end."""
    mp = _mp()
    params.validate(data, spec)
    groups = response_groups(data, spec)
    out = []
    for run in data.runs:
        L, Hs, P, resid, grid, K = _run_pieces(run, spec, params, groups, dps)
        u = _forward(L, resid)
        n = len(u)
        w = [mp.mpf(0)] * n  # S^{-1} (y - b) by the back substitution L^T w = u
        for i in range(n - 1, -1, -1):
            w[i] = (u[i] - mp.fsum(L[k][i] * w[k] for k in range(i + 1, n))) / L[i][i]
        mean = np.empty((grid.size, K))
        sd = np.empty((grid.size, K))
        for a in range(grid.size * K):
            pa = [mp.fsum(h * P(c, a) for c, h in Hs[o]) for o in range(n)]  # (H P)[:, a]
            mean.flat[a] = float(mp.fsum(pa[o] * w[o] for o in range(n)))
            q = _forward(L, pa)
            var = P(a, a) - mp.fsum(x * x for x in q)
            sd.flat[a] = float(mp.sqrt(var)) if var > 0 else 0.0
        out.append((grid, mean, sd))
    return out


def corner_case(loading: float, offset: float, noise_sd: float, lengthscale: float, *, kernel: str = "matern32",
                n: int = 70, dt: float = 1.0, seed: int = 0):
    """One factor seen by one stream on its grid: ``y(t_i) = offset + loading z(t_i) + noise``, z drawn from its
    Matérn prior, samples at the grid points ``t_i = i dt`` (Identity response, no padding).

    Returns:
        (data, spec, params) with ``params`` the values that drew the data.
    """
    import msrm
    from msrm.kernels import get_kernel

    rng = np.random.default_rng(seed)
    T = (n - 1) * dt
    spec = msrm.ModelSpec(n_factors=1, latent_dt=dt, kernel=kernel, pooling="shared", latent_pad=0.0,
                          responses={"brain": msrm.Identity()})
    grid = latent_grid(T, spec)
    prior = get_kernel(kernel).correlation(np.abs(grid[:, None] - grid[None, :]), float(lengthscale), np)
    ev, evec = np.linalg.eigh(prior)
    z = evec @ (np.sqrt(np.clip(ev, 0.0, None)) * rng.standard_normal(ev.size))
    t = np.arange(n) * dt
    Y = offset + loading * np.interp(t, grid, z)[:, None] + noise_sd * rng.standard_normal((n, 1))
    data = msrm.Dataset([msrm.Run(duration=T, streams=[
        msrm.Stream(participant="p0", modality="brain", dt=dt, values=Y, offset=0.0)])])
    params = msrm.Params(loadings={"p0/brain": np.array([[float(loading)]])},
                         intercepts={"p0/brain": np.array([float(offset)])},
                         noise_sd={"p0/brain": np.array([float(noise_sd)])},
                         lengthscales=np.array([float(lengthscale)]), response={})
    return data, spec, params
