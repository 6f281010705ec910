"""NUTS posterior on the conjugate toy model: accuracy against the exact posterior, checkpoints, archives, and the
sampling arguments apart from the bookkeeping ones (``record=``)."""
from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

import msrm.runtime
from msrm.gp import idata as idata_mod
from msrm_lab.bench.measure import compile_seconds
from msrm.gp.posterior import DeviceMismatchError, Record, sample

from toy_model import ToyModel

sys.path.insert(0, str(Path(__file__).resolve().parent / "data"))
import idata_fixture  # noqa: E402  (tests/data: the archive fixture and how it was built)

pytest.importorskip("numpyro")
SETTINGS = dict(num_warmup=300, num_samples=600, num_chains=2, seed=1, max_tree_depth=6, progress=False)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One uninterrupted run (warm-up, checkpoint saved on the way, sampling), shared by the tests below."""
    msrm.runtime.enable_x64()
    folder = tmp_path_factory.mktemp("nuts")
    model = ToyModel(seed=2)
    post = sample(model, init="map", checkpoint=folder / "warm", pointwise_loglik=True,
                  record=Record(archive=folder / "post.nc"), **SETTINGS)
    return model, post, folder


def test_posterior_matches_the_exact_gaussian(run):
    model, post, _ = run
    s = post.summary
    assert int(post.sample_stats["diverging"].sum()) == 0
    assert s.attrs["divergences"]["num_divergent"] == 0
    assert (s["r_hat"] < 1.05).all()
    exact = model.posterior_mean_physical()
    want = np.concatenate([exact["beta"].ravel(), [exact["scale"]]])
    got = s["mean"].to_numpy()
    # within 4 Monte Carlo standard errors of the exact posterior mean
    assert np.all(np.abs(got - want) < 4 * s["mcse_mean"].to_numpy()), (got, want, s["mcse_mean"].to_numpy())
    # 90% central intervals of the exact marginals vs the draws' 5% / 95% quantiles: coverage of the exact mean
    # and agreement of the interval ends with the exact Gaussian quantiles (to a few MC errors)
    sd_u = np.sqrt(np.diag(model.post_cov))
    z95 = 1.6448536269514722
    lo_u, hi_u = model.post_mean - z95 * sd_u, model.post_mean + z95 * sd_u
    lo = np.concatenate([lo_u[:-1], [np.exp(lo_u[-1])]])
    hi = np.concatenate([hi_u[:-1], [np.exp(hi_u[-1])]])
    assert np.all((s["q5"].to_numpy() < want) & (want < s["q95"].to_numpy()))
    width = hi - lo
    np.testing.assert_allclose(s["q5"].to_numpy(), lo, atol=0.1 * width.max())
    np.testing.assert_allclose(s["q95"].to_numpy(), hi, atol=0.1 * width.max())
    # the unconstrained draws have the exact covariance (to sampling error)
    u = post.draws_u.reshape(-1, model.num_params)
    np.testing.assert_allclose(np.cov(u.T), model.post_cov, atol=0.25 * np.abs(model.post_cov).max())


def test_timings_leapfrogs_and_inference_data(run):
    model, post, _ = run
    for phase in ("initialisation", "warmup", "checkpoint", "sampling", "draw_conversion", "pointwise_loglik",
                  "diagnostics", "total"):
        assert post.timings[phase] >= 0, phase
    assert post.timings["total"] >= post.timings["warmup"] + post.timings["sampling"]
    # the phases that run back to back from the start of total fit inside it
    first = ("initialisation", "warmup", "checkpoint", "sampling")
    assert list(post.timings)[:4] == list(first)
    assert post.timings["total"] >= sum(post.timings[p] for p in first)
    n_steps = post.sample_stats["n_steps"]
    assert post.num_leapfrog == int(n_steps.sum()) > 0
    assert post.num_leapfrog_warmup is not None and post.num_leapfrog_warmup > 0
    warm = post.warmup_n_steps
    assert warm.shape == (2, SETTINGS["num_warmup"]) and warm.dtype == np.int64 and warm.min() >= 1
    assert int(warm.sum()) == post.num_leapfrog_warmup
    assert post.seconds_per_leapfrog == pytest.approx(post.timings["sampling"] / post.num_leapfrog)
    assert post.map_result is not None and post.map_result.converged
    idata = post.inference_data
    assert set(idata_mod.group_names(idata)) >= {"posterior", "sample_stats", "log_likelihood", "observed_data"}
    beta = idata.posterior["beta"]
    assert beta.dims == ("chain", "draw", "feature", "factor")
    assert list(beta.coords["feature"].values) == ["f0", "f1"]
    np.testing.assert_allclose(beta.values.reshape(2, 600, -1), post.draws_u[:, :, :-1])
    np.testing.assert_allclose(idata.posterior["scale"].values, np.exp(post.draws_u[:, :, -1]))
    for name in ("diverging", "tree_depth", "n_steps", "step_size", "energy"):
        assert idata.sample_stats[name].shape == (2, 600), name
    depth = idata.sample_stats["tree_depth"].values
    assert depth.max() <= SETTINGS["max_tree_depth"]
    np.testing.assert_array_equal(depth, np.floor(np.log2(n_steps)).astype(int) + 1)
    # pointwise log-likelihood equals the model's at one draw
    ll = idata.log_likelihood["y"].values
    np.testing.assert_allclose(ll[1, 7], model.pointwise_log_likelihood(post.draws_u[1, 7])["y"], rtol=1e-12)
    info = json.loads(idata.posterior.attrs["execution_info"])
    assert info["dtype"] == "float64" and info["backend"] == "cpu"


def test_checkpoint_resume_gives_the_same_draws_and_device_checks(run):
    model, post, folder = run
    ck = json.loads((folder / "warm.json").read_text())
    assert ck["device_identity"]["backend"] == "cpu" and ck["settings"]["num_warmup"] == 300
    # a checkpoint from "another device" is refused before any numerics ...
    other = folder / "other"
    shutil.copy(folder / "warm.npz", other.with_suffix(".npz"))
    ck["device_identity"]["device_kind"] = "NVIDIA Imaginary 9000"
    (other.with_suffix(".json")).write_text(json.dumps(ck))
    calls = model.num_value_and_grad
    with pytest.raises(DeviceMismatchError, match="allow_device_change=True"):
        sample(model, checkpoint=other, **SETTINGS)
    assert model.num_value_and_grad == calls
    # ... settings that differ from the saved ones too
    with pytest.raises(ValueError, match="max_tree_depth=6 was saved"):
        sample(model, checkpoint=folder / "warm", **{**SETTINGS, "max_tree_depth": 7})
    # ... and resumed when allowed: sampling continues from the saved adapted state, the same chain as the
    # uninterrupted run (which saved the checkpoint on its way)
    resumed = sample(model, checkpoint=other, record=Record(allow_device_change=True), diagnostics=False,
                     **SETTINGS)
    assert resumed.resumed and not post.resumed
    np.testing.assert_array_equal(resumed.draws_u, post.draws_u)
    np.testing.assert_array_equal(resumed.sample_stats["step_size"], post.sample_stats["step_size"])


def test_netcdf_archive_round_trip(run):
    _, post, folder = run
    back = idata_mod.load_netcdf(folder / "post.nc")
    np.testing.assert_array_equal(back.posterior["beta"].values, post.inference_data.posterior["beta"].values)
    np.testing.assert_array_equal(back.sample_stats["diverging"].values, post.sample_stats["diverging"])
    assert back.posterior.attrs["execution_info"]["dtype"] == "float64"
    assert set(back.posterior.attrs["timings"]) >= {"warmup", "sampling", "diagnostics"}
    assert not list(folder.glob(".*.tmp*")), "no temporary files left behind"


def test_safe_names_and_dims_matching():
    assert idata_mod.safe_name("loadings[p0/brain]") == "loadings[p0|brain]"
    dims = {"loadings[p0/brain]": (("p0/brain:feature", "factor"), {"factor": [0, 1]})}
    name, d, coords = idata_mod._dims_entry("loadings/p0/brain", dims)
    assert name == "loadings[p0/brain]" and d == ("p0/brain:feature", "factor")


def test_bad_arguments_raise_before_numerics():
    msrm.runtime.enable_x64()
    m = ToyModel()
    with pytest.raises(ValueError, match="chain_method must be one of"):
        sample(m, chain_method="threads", progress=False)
    with pytest.raises(ValueError, match="num_samples must be an integer >= 1"):
        sample(m, num_samples=0, progress=False)
    with pytest.raises(ValueError, match="init must be 'map', 'prior'"):
        sample(m, init="mode", progress=False)
    with pytest.raises(ValueError, match="map_options must be a dict"):
        sample(m, map_options=50, progress=False)
    with pytest.raises(ValueError, match=r"map_options: \['seed'\] are set by sample"):
        sample(m, map_options={"seed": 1}, progress=False)
    assert m.num_value_and_grad == 0


def test_bookkeeping_goes_in_a_record_and_later_arguments_are_keyword_only(tmp_path):
    msrm.runtime.enable_x64()
    m = ToyModel()
    # the old order had max_tree_depth, dense_mass, init, checkpoint, ... after seed: no silent rebinding
    with pytest.raises(TypeError):
        sample(m, 10, 10, 1, "sequential", 0, 6)
    with pytest.raises(TypeError, match="unexpected keyword argument 'archiv'"):
        sample(m, archiv=tmp_path / "x.nc", progress=False)
    with pytest.raises(ValueError, match="record must be a msrm.gp.posterior.Record"):
        sample(m, record={"archive": None}, progress=False)
    with pytest.raises(ValueError, match=r"record: pass \['archive'\] inside record=Record"):
        sample(m, record=Record(), archive=tmp_path / "x.nc", progress=False)
    with pytest.raises(ValueError, match="Record: archive must be a path"):
        Record(archive=3)
    with pytest.raises(ValueError, match="Record: allow_device_change must be True or False"):
        Record(allow_device_change="yes")
    with pytest.raises(dataclasses.FrozenInstanceError):
        Record().archive = "x.nc"
    assert m.num_value_and_grad == 0


def test_old_bookkeeping_keywords_still_work_with_a_deprecation_warning(tmp_path):
    msrm.runtime.enable_x64()
    m = ToyModel(seed=2)
    small = dict(num_warmup=5, num_samples=5, max_tree_depth=3, seed=0, init="prior", progress=False,
                 diagnostics=False)
    first = sample(m, checkpoint=tmp_path / "warm", **small)
    ck = json.loads((tmp_path / "warm.json").read_text())
    ck["device_identity"]["device_kind"] = "NVIDIA Imaginary 9000"
    other = tmp_path / "other"
    shutil.copy(tmp_path / "warm.npz", other.with_suffix(".npz"))
    other.with_suffix(".json").write_text(json.dumps(ck))
    with pytest.warns(DeprecationWarning, match=r"record=msrm.gp.posterior.Record\(allow_device_change=...\)"):
        with pytest.raises(DeviceMismatchError, match="allow_device_change=True"):
            sample(m, checkpoint=other, allow_device_change=False, **small)
    with pytest.warns(DeprecationWarning) as caught:
        resumed = sample(m, checkpoint=other, allow_device_change=True, archive=tmp_path / "old.nc", **small)
    messages = sorted(str(w.message) for w in caught if w.category is DeprecationWarning)
    assert messages == ["sample(allow_device_change=...) is deprecated: pass "
                        "record=msrm.gp.posterior.Record(allow_device_change=...)",
                        "sample(archive=...) is deprecated: pass record=msrm.gp.posterior.Record(archive=...)"]
    assert resumed.resumed
    np.testing.assert_array_equal(resumed.draws_u, first.draws_u)
    back = idata_mod.load_netcdf(tmp_path / "old.nc")
    np.testing.assert_array_equal(back.posterior["beta"].values, resumed.inference_data.posterior["beta"].values)


def test_map_options_reach_the_map_fit():
    msrm.runtime.enable_x64()
    m = ToyModel(seed=2)
    post = sample(m, init="map", map_options={"maxiter": 2}, num_warmup=5, num_samples=5, max_tree_depth=3,
                  seed=0, progress=False, diagnostics=False)
    assert post.map_result is not None and post.map_result.diagnostics["iterations"] <= 2


@pytest.mark.slow
def test_vectorized_chains_sample_the_same_posterior():
    msrm.runtime.enable_x64()
    m = ToyModel(seed=2)
    post = sample(m, chain_method="vectorized", init="prior", **SETTINGS)
    assert post.chain_method == "vectorized"
    assert (post.summary["r_hat"] < 1.05).all()
    u = post.draws_u.reshape(-1, m.num_params).mean(axis=0)
    assert np.all(np.abs(u - m.post_mean) < 5 * np.sqrt(np.diag(m.post_cov) / 300))


# ------------------------------------------------------------------------------------------ GPMSRM


def _tiny_gp(n_runs=1):
    import data_synth

    import msrm

    data, truth = data_synth.synthetic_dataset(profile="tiny", n_features=4, seed=0, n_runs=n_runs)
    return msrm.GPMSRM(data, truth.spec, method="native"), truth


def test_gp_inference_data_has_named_dims_and_physical_values():
    msrm.runtime.enable_x64()
    model, truth = _tiny_gp()
    rng = np.random.default_rng(0)
    u0 = model.unconstrain(truth.params)
    draws = u0 + 0.01 * rng.standard_normal((2, 3, model.num_params))
    idata = idata_mod.build_inference_data(model, draws, {"diverging": np.zeros((2, 3), bool)},
                                           observed=idata_mod.observed_summary(model.data))
    W = idata.posterior["loadings|p1|brain"]
    assert W.dims == ("chain", "draw", "p1_brain_feature", "factor") and W.attrs["msrm_name"] == "loadings/p1/brain"
    assert idata.posterior["lengthscales"].dims == ("chain", "draw", "factor")
    p = model.constrain(draws[1, 2])
    np.testing.assert_allclose(W.values[1, 2], p.loadings["p1/brain"], rtol=1e-12)
    np.testing.assert_allclose(idata.posterior["response|physio|width"].values[1, 2], p.response["physio"]["width"])
    n_obs = idata.observed_data["p1_brain_n_observed"].values
    assert n_obs.shape == (4,) and n_obs.sum() == np.sum(~np.isnan(model.data.runs[0].stream("p1/brain").values))


@pytest.mark.slow
def test_gp_nuts_runs_and_covers_the_truth():
    import data_synth

    msrm.runtime.enable_x64()
    # one factor: the only exact symmetry is the sign flip (W, Z) -> (-W, -Z); starting at the truth keeps both
    # chains in its mode. Two short runs leave the latent scale (and so |W|) loosely determined, so the bar is
    # "most parameters", not 90% of them.
    data, truth = data_synth.synthetic_dataset(profile="tiny", n_features=4, seed=0, n_runs=2, n_factors=1)
    model = msrm.GPMSRM(data, truth.spec, method="native")
    with compile_seconds() as compiled:  # compilation is measured by JAX's own hooks, outside the library
        post = model.sample(num_warmup=400, num_samples=400, num_chains=2, seed=3, max_tree_depth=5,
                            init=truth.params, progress=False)
    s = post.summary
    assert s.attrs["divergences"]["num_divergent"] <= 2
    assert np.nanmax(s["r_hat"].to_numpy()) < 1.2
    flat = {idata_mod.safe_name(k): np.ravel(v) for k, v in truth.params.flatten().items()}
    covered, total = 0, 0
    for name, values in flat.items():
        rows = s.loc[[ix for ix in s.index if ix == name or ix.startswith(name + "[")]]
        assert len(rows) == values.size, name
        covered += int(np.sum((rows["q5"].to_numpy() <= values) & (values <= rows["q95"].to_numpy())))
        total += values.size
    assert covered / total >= 0.6, (covered, total)
    assert compiled.seconds > 0 and post.num_leapfrog > 0


# ------------------------------------------------------------------ archives across ArviZ 0.23 and 1.x


# np.exp, which maps the unconstrained draws to physical values, is not correctly rounded, and NumPy's SIMD paths
# differ by an ulp or so between CPUs (AVX2 and AVX-512 hosts give different last bits): an archive stored on one
# machine matches the same object built on another to a few ulps, and bit for bit only on the same machine.
_CROSS_MACHINE_ULPS = 4


def _assert_same_groups(got, want, maxulp: int = 0):
    """Same groups, variables (values, dtypes, dims, coords) and decoded attributes; any group order. Floating
    values agree to ``maxulp`` units in the last place (0: bit for bit); everything else exactly."""
    assert set(idata_mod.group_names(got)) == set(idata_mod.group_names(want))
    for g in idata_mod.group_names(want):
        a, b = idata_mod.group_dataset(got, g), idata_mod.group_dataset(want, g)
        assert set(a.data_vars) == set(b.data_vars), g
        for name in b.data_vars:
            assert a[name].dims == b[name].dims, (g, name)
            assert a[name].dtype == b[name].dtype, (g, name)
            if maxulp and np.issubdtype(b[name].dtype, np.floating):
                np.testing.assert_array_max_ulp(a[name].values, b[name].values, maxulp=maxulp)
            else:
                np.testing.assert_array_equal(a[name].values, b[name].values, err_msg=f"{g}/{name}")
            assert a[name].attrs.get("msrm_name") == b[name].attrs.get("msrm_name"), (g, name)
        for d in b.coords:
            np.testing.assert_array_equal(a.coords[d].values, b.coords[d].values, err_msg=f"{g} coord {d}")
        for k, v in idata_fixture.ATTRS.items():
            assert a.attrs[k] == v, (g, k)


@pytest.mark.parametrize("major", [0, 1])
def test_archive_written_under_either_arviz_loads_under_the_installed_one(major):
    """tests/data holds the fixture written under ArviZ 0.23 (``idata_arviz0.nc``) and under ArviZ 1.x
    (``idata_arviz1.nc``); each loads, into the installed ArviZ's container, as the object built here."""
    import xarray as xr

    back = idata_mod.load_netcdf(idata_fixture.archive_path(major))
    fresh = idata_fixture.fixture_inference_data()
    assert isinstance(back, xr.DataTree) == (idata_mod.arviz_major() >= 1)
    assert type(back) is type(fresh)
    # the stored names are NetCDF-safe; the original names survive in msrm_name
    post = idata_mod.group_dataset(back, "posterior")
    assert post["loadings|p0|brain"].attrs["msrm_name"] == "loadings/p0/brain"
    assert post["loadings|p0|brain"].dims == ("chain", "draw", "p0_brain_feature", "factor")
    # the archive was written on another machine: physical values match this machine's np.exp to a few ulps
    np.testing.assert_array_max_ulp(post["lengthscales"].values,
                                    np.exp(idata_fixture.fixture_parts()["draws_u"][:, :, :idata_fixture.K]),
                                    maxulp=_CROSS_MACHINE_ULPS)
    assert idata_mod.group_dataset(back, "sample_stats")["diverging"].dtype == bool
    _assert_same_groups(back, fresh, maxulp=_CROSS_MACHINE_ULPS)
    # attribute access as users write it works on both containers
    np.testing.assert_array_max_ulp(back.posterior["lengthscales"].values, fresh.posterior["lengthscales"].values,
                                    maxulp=_CROSS_MACHINE_ULPS)
    assert back.posterior.attrs["sampler"] == idata_fixture.ATTRS["sampler"]


def test_archive_round_trip_and_group_helpers(tmp_path):
    fresh = idata_fixture.fixture_inference_data()
    path = idata_mod.save_netcdf(fresh, tmp_path / "sub" / "post.nc")
    back = idata_mod.load_netcdf(path)
    _assert_same_groups(back, fresh)
    # the loaded object holds its data in memory: the archive can be replaced while it is in use
    idata_mod.save_netcdf(idata_fixture.fixture_inference_data(seed=1), path)
    _assert_same_groups(back, fresh)
    assert set(idata_mod.group_names(fresh)) == {"posterior", "unconstrained_posterior", "sample_stats",
                                                 "log_likelihood", "observed_data"}
    with pytest.raises(KeyError, match="no group 'prior'"):
        idata_mod.group_dataset(fresh, "prior")
    with pytest.raises(ValueError, match="group_names needs"):
        idata_mod.group_names({"posterior": None})
    import xarray as xr

    with pytest.raises(ValueError, match="group 'posterior' must be an xarray.Dataset"):
        idata_mod.from_groups({"posterior": np.zeros(3)})
    with pytest.raises(ValueError, match="contain no '/'"):
        idata_mod.from_groups({"a/b": xr.Dataset()})
    with pytest.raises(FileNotFoundError):
        idata_mod.load_netcdf(tmp_path / "missing.nc")
    (tmp_path / "junk.nc").write_bytes(b"not an archive")
    with pytest.raises(ValueError, match="not a readable NetCDF"):
        idata_mod.load_netcdf(tmp_path / "junk.nc")
