"""msrm.diagnostics against ArviZ itself (the slow, obviously correct reference), parameter by parameter, and
against the independent NumPy implementation in ``diag_oracle``.

ArviZ 0.23 and 1.x are both references. Their definitions agree except for the tail ESS: ArviZ 1.x's
``ess(method="tail")`` takes the quantiles ``prob`` explicitly (and its ``summary`` uses other defaults), so
the references here pass ``prob=(0.05, 0.95)``, the definition of Vehtari et al. (2021) and of ArviZ 0.23."""
from __future__ import annotations

import contextlib
import sys
import warnings

import diag_oracle as oracle
import numpy as np
import pytest

pytest.importorskip("numba")
from msrm import diagnostics as diag  # noqa: E402  (needs Numba)

az = pytest.importorskip("arviz")
ARVIZ_1 = int(az.__version__.split(".")[0]) >= 1
#: the tail ESS as defined by Vehtari et al. (2021): the 5% and 95% quantiles (ArviZ 0.23's fixed choice)
TAIL = {"prob": (0.05, 0.95)} if ARVIZ_1 else {}


def _ar1(rng, C, D, P, phi):
    e = rng.standard_normal((C, D, P))
    x = np.empty_like(e)
    x[:, 0] = e[:, 0]
    for t in range(1, D):
        x[:, t] = phi * x[:, t - 1] + e[:, t]
    return x


def _scalar(v):
    return float(np.asarray(getattr(v, "x", v)).reshape(-1)[0])  # ArviZ's Numba paths return shape (1,)


@contextlib.contextmanager
def _arviz_without_numba():
    """ArviZ's plain NumPy definitions. With Numba installed ArviZ switches to its Numba helpers, and ArviZ 0.23's
    ``mcse(method="sd")`` on a bare (chains, draws) array then calls ``float`` on a shape-(1,) array, which
    NumPy 2.4 refuses. ArviZ 1.x has no Numba switch (its array functions are NumPy)."""
    if ARVIZ_1:
        yield
        return
    was = az.Numba.numba_flag
    az.Numba.disable_numba()
    try:
        yield
    finally:
        if was:
            az.Numba.enable_numba()


def _arviz_columns(x):
    """ArviZ's own functions, one parameter at a time."""
    P = x.shape[2]
    with warnings.catch_warnings(), _arviz_without_numba():
        warnings.simplefilter("ignore")
        return {
            "r_hat": np.array([_scalar(az.rhat(x[:, :, p])) for p in range(P)]),
            "ess_bulk": np.array([_scalar(az.ess(x[:, :, p], method="bulk")) for p in range(P)]),
            "ess_tail": np.array([_scalar(az.ess(x[:, :, p], method="tail", **TAIL)) for p in range(P)]),
            "mcse_mean": np.array([_scalar(az.mcse(x[:, :, p], method="mean")) for p in range(P)]),
            "mcse_sd": np.array([_scalar(az.mcse(x[:, :, p], method="sd")) for p in range(P)]),
        }


def _assert_same(ours, ref, rtol=1e-8):
    for name, want in ref.items():
        got = ours[name]
        assert np.array_equal(np.isnan(got), np.isnan(want)), f"{name}: NaN pattern differs: {got} vs {want}"
        ok = ~np.isnan(want)
        np.testing.assert_allclose(got[ok], want[ok], rtol=rtol, atol=0, err_msg=name)


# (chains, draws, params, AR(1) coefficient): iid, strongly autocorrelated (forces the full-length FFT
# fallback), anti-correlated, odd draw counts, one chain, the 4-draw minimum
CASES = [
    (4, 100, 12, 0.0),
    (2, 51, 12, 0.9),
    (4, 400, 8, 0.99),
    (3, 200, 8, -0.6),
    (1, 40, 6, 0.5),
    (3, 7, 6, 0.3),
    (2, 4, 5, 0.0),
    (3, 5, 5, 0.0),
    (2, 9, 5, 0.95),
]


@pytest.mark.parametrize("C,D,P,phi", CASES)
def test_equals_arviz_per_parameter(C, D, P, phi):
    rng = np.random.default_rng([C, D, P, int(1000 * phi) % 1000])
    x = _ar1(rng, C, D, P, phi)
    x[:, :, 0] = 1.5  # constant parameter: ESS = size, R-hat NaN, mcse_sd NaN (ArviZ's handling)
    x[:, :, 1] = np.round(x[:, :, 1])  # heavy ties: average ranks
    x[:, :, 2] = np.where(x[:, :, 2] > 0, 1.0, 0.0)  # two values only
    ours = diag.diagnose_draws(x, block_size=4, num_threads=2)
    _assert_same(ours, _arviz_columns(x))
    np.testing.assert_allclose(ours["mean"], x.mean(axis=(0, 1)), rtol=1e-12)


def test_nan_draws_give_nan_like_arviz():
    rng = np.random.default_rng(3)
    x = _ar1(rng, 2, 30, 4, 0.2)
    x[1, 5, 1] = np.nan
    ours = diag.diagnose_draws(x)
    ref = _arviz_columns(x[:, :, :3])
    _assert_same({k: v[:3] for k, v in ours.items()}, ref)
    assert np.isnan(ours["ess_bulk"][1]) and np.isfinite(ours["ess_bulk"][0])
    # an infinite draw: documented NaN for every diagnostic (ArviZ ranks it and reports finite R-hat and ESS)
    x[0, 2, 3] = np.inf
    inf = diag.diagnose_draws(x)
    assert inf["mean"][3] == np.inf and all(np.isnan(inf[c][3]) for c in diag.COLUMNS if c != "mean")


def test_summary_columns_equal_arviz_summary_on_inference_data():
    rng = np.random.default_rng(7)
    beta = _ar1(rng, 4, 60, 6, 0.4).reshape(4, 60, 2, 3)
    scale = np.exp(_ar1(rng, 4, 60, 1, 0.7)[:, :, 0])
    diverging = np.zeros((4, 60), bool)
    diverging[1, [3, 9]] = True
    diverging[3, 0] = True
    groups = {"posterior": {"beta": beta, "scale": scale}, "sample_stats": {"diverging": diverging}}
    named = dict(coords={"feature": ["a", "b"], "factor": [0, 1, 2]}, dims={"beta": ["feature", "factor"]})
    # ArviZ 1.x takes the groups as one mapping and gives a DataTree; 0.23 takes one keyword per group
    idata = az.from_dict(groups, **named) if ARVIZ_1 else az.from_dict(**groups, **named)
    ours = diag.summarize(idata)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = az.summary(idata, round_to="none")
        if ARVIZ_1:  # its summary's tail ESS uses other quantiles: the reference column with the usual ones
            tail = az.ess(idata, method="tail", **TAIL)
            ref["ess_tail"] = np.concatenate([np.asarray(tail[v]).reshape(-1) for v in ("beta", "scale")])
    assert list(ours.index) == list(ref.index)  # labels as ArviZ: beta[a, 0], ..., scale
    for col in ("mean", "sd", "mcse_mean", "mcse_sd", "ess_bulk", "ess_tail", "r_hat"):
        np.testing.assert_allclose(ours[col].to_numpy(dtype=float), ref[col].to_numpy(dtype=float), rtol=1e-8,
                                   err_msg=col)
    assert ours.attrs["divergences"] == {"num_divergent": 3, "divergent_per_chain": [0, 2, 0, 1], "num_draws": 240}
    # type-7 quantiles over all draws
    np.testing.assert_allclose(ours.loc["scale", "q5"], np.quantile(scale, 0.05), rtol=1e-13)
    np.testing.assert_allclose(ours.loc["scale", "q95"], np.quantile(scale, 0.95), rtol=1e-13)
    sub = diag.summarize(idata, var_names=["scale"])
    assert list(sub.index) == ["scale"]


def test_oracle_short_fft_equals_full_length_fft():
    rng = np.random.default_rng(11)
    for phi in (0.0, 0.5, 0.97):
        y = _ar1(rng, 6, 300, 40, phi).transpose(2, 0, 1).copy()
        np.testing.assert_allclose(oracle.ess_rows(y, short_m=True), oracle.ess_rows(y, short_m=False), rtol=1e-10)


def test_array_and_dict_inputs_and_errors():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 20, 3))
    df = diag.summarize(x)
    assert list(df.index) == ["x[0]", "x[1]", "x[2]"]
    assert list(df.columns) == list(diag.COLUMNS)
    df2 = diag.summarize({"w": x})
    np.testing.assert_array_equal(df2["ess_bulk"].to_numpy(), df["ess_bulk"].to_numpy())
    with pytest.raises(KeyError, match="var_names: no variable 'nope'"):
        diag.summarize({"w": x}, var_names=["nope"])
    with pytest.raises(ValueError, match="draws must have shape"):
        diag.diagnose_draws(np.zeros((2, 3, 4, 5)))
    with pytest.raises(ValueError, match="block_size"):
        diag.diagnose_draws(x, block_size=0)
    with pytest.raises(ValueError, match="summarize needs"):
        diag.summarize("not draws")
    with pytest.raises(TypeError, match="engine"):  # one implementation: there is no engine to choose
        diag.diagnose_draws(x, engine="numpy")
    with pytest.raises(TypeError, match="engine"):
        diag.summarize(x, engine="numba")


def test_does_not_import_jax_or_numba():
    assert "jax" not in diag.__dict__
    import subprocess

    code = "import msrm.diagnostics, sys; print('jax' in sys.modules, 'numba' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False False"  # Numba is imported on the first call only


def test_import_without_numba_names_the_bayes_extra():
    import subprocess

    code = "import sys; sys.modules['numba'] = None; import msrm.diagnostics"  # None: Numba cannot be imported
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode != 0
    assert "ImportError" in out.stderr and "msrm[bayes]" in out.stderr, out.stderr


def test_oracle_normal_scores_with_ties_equal_scipy_rankdata():
    from scipy import special, stats

    rng = np.random.default_rng(9)
    x = rng.integers(0, 4, size=(7, 12)).astype(float)  # many ties, groups touching row ends
    x[2] = 5.0  # a constant row
    x[3] = np.arange(12.0)  # no ties
    n = x.shape[1]
    s = np.sort(x, axis=1)
    got = oracle.z_sorted(s, oracle.z_table(n))
    want = special.ndtri((stats.rankdata(s, method="average", axis=1) - 3 / 8) / (n - 3 / 4 + 1))
    np.testing.assert_array_equal(got, want)


def _awkward_rows(rng, n):
    """Rows that stress exact ordering: ties, signed zeros, values a few ulps apart, huge and tiny ranges."""
    rows = [
        rng.standard_normal(n),
        np.round(rng.standard_normal(n), 1),  # many ties
        np.full(n, 2.5),  # constant
        np.where(rng.random(n) < 0.5, 0.0, -0.0),  # +0 and -0 are equal
        1.0 + rng.integers(-6, 7, n) * np.finfo(float).eps,  # differences only in the last bits
        rng.standard_normal(n) * 1e300,  # max - min overflows
        rng.standard_normal(n) * 1e-310,  # subnormal range
        np.exp(rng.standard_normal(n) * 5),  # heavy right tail: crowded buckets
    ]
    return np.array(rows)


def test_oracle_two_pass_sort_is_exact():
    rng = np.random.default_rng(21)
    for n in (8, 1000, 4000):
        x = _awkward_rows(rng, n)
        order, s = oracle.sort_rows(x)
        np.testing.assert_array_equal(s, np.sort(x, axis=1))
        np.testing.assert_array_equal(x.ravel()[order], s)  # order: flat indices
        local = order - (np.arange(x.shape[0]) * n)[:, None]
        np.testing.assert_array_equal(np.sort(local, axis=1), np.broadcast_to(np.arange(n), x.shape))


@pytest.mark.parametrize("n", [8, 9, 1000, 4000])
def test_oracle_folded_scores_equal_scipy_rankdata(n):
    from scipy import special, stats

    rng = np.random.default_rng(n)
    x = _awkward_rows(rng, n)
    # the two middle values a few ulps either side of 1: |x - median| of the middle pair differ in the low bits
    x = np.vstack([x, 1.0 + np.concatenate([[-3, 5], rng.standard_normal(n - 2)]) * np.finfo(float).eps])
    # plain rows: the folded middle pair often differs only in the bits the packed sort keys give up (a
    # reversed pair the code swaps back), about one row in four
    x = np.vstack([x, rng.standard_normal((40, n))])
    order, s = oracle.sort_rows(x)
    got = oracle.fold_scores(x, order, s, oracle.z_table(n))
    folded = np.abs(x - np.median(x, axis=1, keepdims=True))
    want = special.ndtri((stats.rankdata(folded, method="average", axis=1) - 3 / 8) / (n - 3 / 4 + 1))
    np.testing.assert_array_equal(got, want)


def test_many_blocks_and_threads_equal_arviz():
    """Several blocks per thread (buffers re-used between blocks) with odd parameters scattered through them."""
    rng = np.random.default_rng(17)
    C, D, P = 4, 200, 150
    phi = np.linspace(-0.5, 0.97, P)
    x = _ar1(rng, C, D, P, phi)
    x[:, :, 70] = -3.0  # constant, in the second block
    x[:, :, 100] = np.round(x[:, :, 100])  # ties
    x[:, :, 140] = np.where(x[:, :, 140] > 0.3, 1.0, 0.0)
    x[2, 17, 130] = np.nan  # a non-finite parameter in the last block
    ref = _arviz_columns(x)
    for threads, block in ((2, 256), (1, 32), (3, 7)):
        ours = diag.diagnose_draws(x, block_size=block, num_threads=threads)
        _assert_same(ours, ref)
        np.testing.assert_allclose(ours["sd"], x.reshape(C * D, P).std(axis=0, ddof=1), rtol=1e-12)
        # the oracle through the same blocks and threads (buffers re-used between blocks, threaded FFTs)
        _assert_same(oracle.diagnose_draws(x, block_size=block, num_threads=threads), ref)


def test_one_block_with_spare_threads_agrees():
    rng = np.random.default_rng(23)
    x = _ar1(rng, 4, 300, 20, 0.8)
    one = diag.diagnose_draws(x, num_threads=1)
    two = diag.diagnose_draws(x, num_threads=2)  # a single block: one thread of the pool is enough
    # the oracle's single block gives its spare thread to the FFTs
    three = oracle.diagnose_draws(x, num_threads=2)
    for name in diag.COLUMNS:
        np.testing.assert_allclose(two[name], one[name], rtol=1e-12, err_msg=name)
        np.testing.assert_allclose(three[name], one[name], rtol=1e-10, err_msg=name)


def test_compiled_sort_is_exact():
    """The bucket sort against NumPy's on awkward rows, and on crowded buckets (heavy tails, one far outlier)."""
    K = diag._kernels()
    rng = np.random.default_rng(31)
    for n in (8, 1000, 4000):
        rows = list(_awkward_rows(rng, n))
        outlier = rng.standard_normal(n)
        outlier[3] = 1e6  # every other value in the first bucket or two
        rows += [outlier, rng.standard_cauchy(n), np.sort(rng.standard_normal(n))[::-1].copy()]
        for v in rows:
            order, s = np.empty(n, np.int64), np.empty(n)
            K._argsort_exact(v, order, s, np.empty(2 * n + 1, np.int64), np.empty(n, np.int64))
            np.testing.assert_array_equal(s, np.sort(v))
            np.testing.assert_array_equal(v[order], s)
            np.testing.assert_array_equal(np.sort(order), np.arange(n))


@pytest.mark.parametrize("n", [8, 10, 1000, 4000])
def test_compiled_folded_scores_equal_scipy_rankdata(n):
    """The two-ended merge gives the ranks of ``|x - median|`` exactly, ties included."""
    from scipy import special, stats

    K = diag._kernels()
    rng = np.random.default_rng(n + 1)
    rows = np.vstack([_awkward_rows(rng, n), rng.standard_normal((20, n)),
                      np.where(rng.random((4, n)) < 0.5, 0.0, 1.0)])  # two values: every folded value tied
    table = diag._z_table(n)
    for v in rows:
        order = np.argsort(v, kind="stable")
        s = v[order]
        med = np.median(v)
        fv, fpos, got = np.empty(n), np.empty(n, np.int64), np.empty(n)
        K._fold(s, order, med, fv, fpos)
        np.testing.assert_array_equal(np.sort(fpos), np.arange(n))  # every draw once
        np.testing.assert_array_equal(fv, np.abs(v[fpos] - med))
        K._scores_to(fv, fpos, table, got)
        want = special.ndtri((stats.rankdata(np.abs(v - med), method="average") - 3 / 8) / (n - 3 / 4 + 1))
        np.testing.assert_array_equal(got, want)


def _kernel_pending(x):
    """The compiled block kernel on draws ``x`` (C, D, P): its pending codes (P, N_VARS) and pending count."""
    K = diag._kernels()
    block = np.ascontiguousarray(np.moveaxis(x, 2, 0))
    P, C, D = block.shape
    R, h = 2 * C, D // 2
    pending = np.empty((P, K.N_VARS), np.int8)
    n = K.diagnose_block(block, diag._z_table(R * h), diag._TAIL_PROBS, np.empty((P, K.N_STATS)),
                         np.empty((P, K.N_VARS)), pending, np.zeros((P * K.N_VARS, C, diag._fft_len(h)), complex),
                         np.empty(P * K.N_VARS), np.empty(P, bool))
    assert n == np.count_nonzero(pending)
    return pending


def test_compiled_kernels_hand_long_autocorrelations_to_the_fft():
    """Strongly autocorrelated chains run past the direct lags: their ESS comes from the FFT path, still exact."""
    rng = np.random.default_rng(41)
    x = _ar1(rng, 4, 600, 6, np.array([0.0, 0.5, 0.95, 0.99, 0.995, -0.7]))
    pending = _kernel_pending(x)
    assert pending[3:5].any() and not pending[0].any()
    _assert_same(diag.diagnose_draws(x), _arviz_columns(x))


def _random_walk_noise(rng, C, D, P, step=0.1):
    return np.cumsum(step * rng.standard_normal((C, D, P)), axis=1) + rng.standard_normal((C, D, P))


@pytest.mark.parametrize("kind", ["ar1_0.99", "random_walk_noise", "mixture"])
def test_poorly_mixing_draws_equal_arviz(kind):
    """Slowly mixing chains (most ESS variables on the FFT path), and a mixture with well mixed parameters, a
    constant one and one with a NaN draw."""
    rng = np.random.default_rng(["ar1_0.99", "random_walk_noise", "mixture"].index(kind))
    C, D, P = 4, 1000, 50
    if kind == "ar1_0.99":
        x = _ar1(rng, C, D, P, 0.99)
    elif kind == "random_walk_noise":
        x = _random_walk_noise(rng, C, D, P)
    else:
        x = np.concatenate([_ar1(rng, C, D, 20, 0.99), _random_walk_noise(rng, C, D, 15),
                            _ar1(rng, C, D, 15, 0.3)], axis=2)[:, :, rng.permutation(P)]
        x[:, :, 7] = 0.25
        x[2, 500, 11] = np.nan
    pending = _kernel_pending(x)
    assert (pending == 2).any()  # foreseen long sequences skip the direct lags
    _assert_same(diag.diagnose_draws(x, block_size=16, num_threads=2), _arviz_columns(x))


def test_long_sequence_guess_both_sides_equal_arviz():
    """Both sides of the guess that sends a variable to the FFT after four lags: a sequence that runs past the
    direct lags without being foreseen (found after summing them, code 1), one foreseen (code 2), and short
    ones; every ESS equals ArviZ's whichever path it took."""
    K = diag._kernels()
    rng = np.random.default_rng(53)
    phi = np.array([0.0, 0.6, 0.9, 0.93, 0.95, 0.96, 0.97, 0.99])
    x = _ar1(rng, 4, 1000, 8 * 6, np.repeat(phi, 6))
    pending = _kernel_pending(x)
    assert (pending == 1).any() and (pending == 2).any() and (pending == 0).any()
    _assert_same(diag.diagnose_draws(x), _arviz_columns(x))
    # the guess: lag-1 and lag-3 autocorrelations extrapolated to MAX_DIRECT_LAG, against LONG_RHO
    acov = np.zeros(K.MAX_DIRECT_LAG + 4)
    R, h = 8, 500
    for r1, r3, want in ((0.99, 0.98, True), (0.5, 0.49, True), (0.9, 0.81, False), (0.05, 0.05, False),
                         (0.99, -0.1, False)):
        acov[:4] = R * h * np.array([1.0, r1, 0.0, r3]) * (h - 1) / h  # rho_t = acov_t / acov_0 with cmv = 0
        assert K._long_ahead(acov, R, h, 0.0, 1, 3) is want, (r1, r3)
    # the second look, after SECOND_LOOK lags: lags SECOND_LOOK / 2 - 1 and SECOND_LOOK - 1 extrapolated the same way
    a, b = K.SECOND_LOOK // 2 - 1, K.SECOND_LOOK - 1
    for ra, rb, want in ((0.6, 0.55, True), (0.6, 0.3, False), (0.05, 0.04, False)):
        acov[:] = 0.0
        acov[0] = R * h * (h - 1) / h
        acov[a] = acov[0] * ra
        acov[b] = acov[0] * rb
        assert K._long_ahead(acov, R, h, 0.0, a, b) is want, (ra, rb)


def test_float32_and_strided_draws_equal_the_oracle():
    """Non-float64 or non-contiguous draws take the NumPy copy into the block; the NumPy oracle agrees."""
    rng = np.random.default_rng(43)
    x = _ar1(rng, 3, 80, 10, 0.6)
    for draws in (x.astype(np.float32), x[:, :, ::2], np.asfortranarray(x)):
        a = diag.diagnose_draws(draws)
        b = oracle.diagnose_draws(draws)
        for name in diag.COLUMNS:
            np.testing.assert_allclose(a[name], b[name], rtol=1e-10, err_msg=name)


def test_non_finite_parameter_after_long_autocorrelations_in_a_reused_buffer():
    """A parameter with a NaN draw at the place where the previous block of the same thread had variables with
    long autocorrelations: the re-used flags of that block must not mark the NaN parameter's variables."""
    rng = np.random.default_rng(47)
    x = _ar1(rng, 4, 600, 8, 0.995)  # every block has variables past the direct lags
    x[1, 10, 4] = np.nan  # first parameter of the second block
    ours = diag.diagnose_draws(x, block_size=4, num_threads=1)
    _assert_same({k: v[[0, 1, 2, 3, 5, 6, 7]] for k, v in ours.items()}, _arviz_columns(x[:, :, [0, 1, 2, 3, 5, 6, 7]]))
    assert all(np.isnan(ours[c][4]) for c in diag.COLUMNS if c != "mean")


@pytest.mark.slow
def test_compile_kernels_fills_the_cache_for_every_path(tmp_path):
    """After ``compile_kernels`` in one process (the install step), a fresh process diagnosing draws of every kind
    (even and odd draw counts, short and long sequences, float32) loads each kernel from Numba's cache and
    compiles none."""
    import os
    import subprocess

    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba_cache"))
    subprocess.run([sys.executable, "-c", "import msrm.diagnostics as d; d.compile_kernels()"], env=env, check=True)
    code = """
import numpy as np
import msrm.diagnostics as d
rng = np.random.default_rng(1)
x = np.concatenate([np.cumsum(rng.standard_normal((4, 301, 20)), axis=1), rng.standard_normal((4, 301, 20))], 2)
for draws in (x, x[:, :300], x.astype(np.float32), x[:, :7], x[:, :3]):
    d.diagnose_draws(draws)
K = d._kernels()
misses = {name: dict(f.stats.cache_misses) for name, f in vars(K).items() if hasattr(f, "stats")}
print(sum(sum(v.values()) for v in misses.values()), misses)
"""
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split()[0] == "0", out.stdout


def test_indicator_lag_sums_from_runs_equal_direct_sums_both_sides_of_the_pair_bound():
    """Lag sums of centred 0/1 rows from their runs of ones equal the direct sums, for rows of few runs (long
    runs, single ones, rows all ones or all zeros) up to the bound on pairs of runs; past it the FFT is left to."""
    K = diag._kernels()
    rng = np.random.default_rng(59)
    R, h = 8, 300

    def rows_with_runs(n_runs):
        y = np.zeros((R, h))
        for r in range(R):
            starts = np.sort(rng.choice(h // 3, n_runs, replace=False)) * 3
            for a in starts:
                y[r, a:a + rng.integers(1, 3)] = 1.0  # runs of one or two, never touching
        return y

    def direct(c):
        return np.array([sum(c[r, : h - t] @ c[r, t:] for r in range(R)) for t in range(h)])

    bound = int(np.sqrt(K.MAX_RUN_PAIRS))  # runs per row at the bound
    cases = [rows_with_runs(1), rows_with_runs(bound), rows_with_runs(bound + 1)]
    long_runs = np.zeros((R, h))
    long_runs[:, 40:190] = 1.0
    long_runs[2] = 1.0  # a row of ones
    long_runs[3] = 0.0  # a row of zeros
    long_runs[4, 299] = 1.0  # a run at the row's end
    long_runs[5, :7] = 1.0  # a run at the row's start
    cases.append(long_runs)
    for y, ok in zip(cases, (True, True, False, True)):
        means = y.mean(axis=1)
        c = (y - means[:, None]).ravel()
        out = np.empty(h)
        assert K._indicator_lag_sums(c, R, h, means, np.empty(2 * h + 1), out, np.empty(h, np.int64),
                                     np.empty(h, np.int64)) is ok
        if ok:
            np.testing.assert_allclose(out, direct(c.reshape(R, h)), rtol=1e-12, atol=1e-10)


def test_long_ess_transforms_without_ducc0_equal_those_with_it(monkeypatch):
    """The long-ESS path gives the same numbers whether ducc0 or scipy.fft runs its transforms, over several
    blocks of one thread (whose pending rows re-use one buffer and its zero padding)."""
    pytest.importorskip("ducc0")
    rng = np.random.default_rng(61)
    x = np.concatenate([_ar1(rng, 4, 400, 12, 0.99), _random_walk_noise(rng, 4, 400, 12)], axis=2)
    with_ducc = diag.diagnose_draws(x, block_size=5, num_threads=1)
    assert diag.fft_library().startswith("ducc0")
    monkeypatch.setattr(diag, "_ducc_fft", lambda: None)
    assert diag.fft_library() == "scipy.fft"
    without = diag.diagnose_draws(x, block_size=5, num_threads=1)
    for name in diag.COLUMNS:
        np.testing.assert_allclose(with_ducc[name], without[name], rtol=1e-12, err_msg=name)
    _assert_same(with_ducc, _arviz_columns(x))


# ------------------------------------------------------------------ the tail ESS's quantiles (tail_prob)

#: the installed ArviZ's default tail ESS as a ``tail_prob``: ArviZ 1.x takes ``prob = rcParams["stats.ci_prob"]``
#: and the quantiles ``1 - prob``, ``prob``; ArviZ 0.23 the 5% and 95% quantiles
ARVIZ_DEFAULT_TAIL_PROB = 1 - az.rcParams["stats.ci_prob"] if ARVIZ_1 else 0.05

# (chains, draws, params, AR(1) coefficient): iid, odd draw counts, one chain, many short chains, and slowly mixing
# chains whose tail indicators take the FFT path
TAIL_CASES = [
    (4, 1000, 6, 0.0),
    (2, 301, 5, 0.5),
    (1, 400, 4, 0.3),
    (8, 60, 5, -0.4),
    (4, 2000, 4, 0.99),
]


def _tail_draws(C, D, P, phi):
    rng = np.random.default_rng([C, D, P, int(1000 * phi) % 1000, 71])
    return _ar1(rng, C, D, P, phi)


def _arviz_ess_tail(x, **kwargs):
    """ArviZ's ``ess(method="tail", **kwargs)`` of every parameter of ``x`` (C, D, P), through a posterior group,
    where ArviZ 1.x applies its default ``prob`` when none is given (its bare-array interface requires one)."""
    posterior = {"x": x}
    idata = az.from_dict({"posterior": posterior}) if ARVIZ_1 else az.from_dict(posterior=posterior)
    with warnings.catch_warnings(), _arviz_without_numba():
        warnings.simplefilter("ignore")
        return np.asarray(az.ess(idata, method="tail", **kwargs)["x"], dtype=float).reshape(-1)


def _tail_kwargs(p):
    """ArviZ's ``prob`` for the quantiles ``p`` and ``1 - p`` (ArviZ 0.23 and 1.x both take the pair)."""
    return {"prob": (p, 1 - p)}


@pytest.mark.parametrize("C,D,P,phi", TAIL_CASES)
def test_ess_tail_default_is_the_five_and_ninety_five_percent_convention(C, D, P, phi):
    x = _tail_draws(C, D, P, phi)
    want = _arviz_ess_tail(x, **_tail_kwargs(0.05))
    np.testing.assert_allclose(diag.summarize(x)["ess_tail"].to_numpy(), want, rtol=1e-10, atol=0)
    np.testing.assert_allclose(diag.summarize(x, tail_prob=0.05)["ess_tail"].to_numpy(), want, rtol=1e-10, atol=0)
    if not ARVIZ_1:  # ArviZ 0.23's default is this convention
        np.testing.assert_allclose(_arviz_ess_tail(x), want, rtol=1e-10, atol=0)


@pytest.mark.parametrize("C,D,P,phi", TAIL_CASES)
def test_ess_tail_with_other_quantiles_equals_arviz(C, D, P, phi):
    """``tail_prob=(1 - 0.89) / 2`` (the bounds of an 89% equal-tailed interval) against ArviZ given those
    quantiles, and the installed ArviZ's default ``ess(method="tail")``; no other column moves."""
    x = _tail_draws(C, D, P, phi)
    base = diag.diagnose_draws(x)
    p = (1 - 0.89) / 2
    eti = diag.diagnose_draws(x, tail_prob=p, block_size=3, num_threads=2)
    np.testing.assert_allclose(eti["ess_tail"], _arviz_ess_tail(x, **_tail_kwargs(p)), rtol=1e-10, atol=0)
    np.testing.assert_allclose(eti["ess_tail"], oracle.diagnose_draws(x, tail_prob=p)["ess_tail"], rtol=1e-10)
    for name in diag.COLUMNS:  # the long-ESS transforms are batched with the tail indicators: rounding only
        if name != "ess_tail":
            np.testing.assert_allclose(eti[name], base[name], rtol=1e-13, atol=0, err_msg=name)

    ours = diag.summarize(x, tail_prob=ARVIZ_DEFAULT_TAIL_PROB)["ess_tail"].to_numpy()
    np.testing.assert_allclose(ours, _arviz_ess_tail(x), rtol=1e-10, atol=0)


def test_arviz_1_default_tail_ess_differs_and_its_summary_agrees():
    """ArviZ 1.x's default tail ESS (11% and 89% quantiles) differs from the 5%/95% one on the same draws; its
    ``summary`` column equals ``tail_prob=1 - ci_prob`` too."""
    if not ARVIZ_1:
        pytest.skip("ArviZ 0.23's default tail ESS is the 5%/95% one")
    x = np.concatenate([_tail_draws(*case) for case in TAIL_CASES if case[:2] == (4, 1000)], axis=2)
    ours = diag.summarize(x, tail_prob=ARVIZ_DEFAULT_TAIL_PROB)
    default = diag.summarize(x)
    assert np.max(np.abs(ours["ess_tail"] / default["ess_tail"] - 1)) > 0.05
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = az.summary(az.from_dict({"posterior": {"x": x}}), round_to="none")
    assert list(ref.index) == list(ours.index)
    np.testing.assert_allclose(ours["ess_tail"].to_numpy(), ref["ess_tail"].to_numpy(dtype=float), rtol=1e-10)


@pytest.mark.parametrize("bad", [0, 0.0, 0.5, 0.7, -0.05, 1.0, float("nan"), float("inf"), True, "0.05", None])
def test_tail_prob_out_of_range_is_refused(bad):
    x = np.random.default_rng(2).standard_normal((2, 20, 2))
    with pytest.raises(ValueError, match="tail_prob"):
        diag.summarize(x, tail_prob=bad)
    with pytest.raises(ValueError, match="tail_prob"):
        diag.diagnose_draws(x, tail_prob=bad)
    with pytest.raises(ValueError, match="tail_prob"):
        diag.summarize({}, tail_prob=bad)  # checked even with nothing to diagnose


@pytest.mark.parametrize("tail_prob", [0.05, 0.11])
def test_infinite_draws_give_nan_diagnostics(tail_prob):
    """The documented choice: a parameter with an infinite draw keeps NumPy's mean (the infinity, or NaN when
    both signs occur) and gets NaN in every other column; the other parameters are unaffected."""
    rng = np.random.default_rng(13)
    x = _ar1(rng, 4, 200, 5, 0.5)
    clean = diag.summarize(x[:, :, [0, 4]], tail_prob=tail_prob)
    x[1, 17, 1] = np.inf
    x[3, 0, 2] = -np.inf
    x[0, 5, 3] = np.inf
    x[2, 99, 3] = -np.inf
    df = diag.summarize(x, tail_prob=tail_prob, block_size=2, num_threads=2)
    assert df["mean"].iloc[1] == np.inf and df["mean"].iloc[2] == -np.inf and np.isnan(df["mean"].iloc[3])
    others = [c for c in diag.COLUMNS if c != "mean"]
    assert df.iloc[1:4][others].isna().all().all()
    np.testing.assert_array_equal(df.iloc[[0, 4]].to_numpy(), clean.to_numpy())
