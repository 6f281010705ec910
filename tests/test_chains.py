"""Chains in separate workers: each with its own seed and archive, merged into one InferenceData.

The merged object must hold every draw of every chain (equal, chain by chain, to a chain sampled on its own with
the same seed), every seed and execution_info, the sample stats, and must survive a NetCDF round trip; a chain
that fails is reported with its seed and does not stop the others. The conjugate toy model keeps this fast;
loky workers receive it by value (cloudpickle), since tests/ is not importable there.
"""
from __future__ import annotations

import functools
import sys
from pathlib import Path

import cloudpickle
import numpy as np
import pytest

import msrm.runtime
from msrm.gp import idata as idata_mod
from msrm.gp.chains import chain_records, merge_chains, sample_chains
from msrm.gp.posterior import sample

import toy_model
from toy_model import ToyModel

msrm.runtime.enable_x64()
cloudpickle.register_pickle_by_value(toy_model)
sys.path.insert(0, str(Path(__file__).resolve().parent / "data"))
import idata_fixture  # noqa: E402  (tests/data: a small InferenceData built without sampling)

SETTINGS = dict(num_warmup=60, num_samples=40, max_tree_depth=4, init="prior", diagnostics=False)


def _draws(idata, name="beta"):
    return np.asarray(idata.posterior[name])


def test_merge_keeps_every_draw_seed_and_archive(tmp_path):
    build = functools.partial(ToyModel, seed=2)
    out = sample_chains(build, 2, seeds=[11, 5], backend="sequential", archive_dir=tmp_path, **SETTINGS)
    assert out.ok and out.seeds == [11, 5]
    merged = out.inference_data
    assert merged.posterior.sizes["chain"] == 2 and merged.posterior.sizes["draw"] == 40
    for c, seed in enumerate([11, 5]):
        alone = sample(ToyModel(seed=2), num_chains=1, seed=seed, progress=False, **SETTINGS).inference_data
        np.testing.assert_array_equal(_draws(merged)[c], _draws(alone)[0])
        np.testing.assert_array_equal(np.asarray(merged.sample_stats["lp"])[c], np.asarray(alone.sample_stats["lp"])[0])
        np.testing.assert_array_equal(np.asarray(merged.unconstrained_posterior["u"])[c],
                                      np.asarray(alone.unconstrained_posterior["u"])[0])
        # the chain's own archive holds the same draws, its seed and where it ran
        archived = idata_mod.load_netcdf(tmp_path / f"chain{c}_seed{seed}.nc")
        np.testing.assert_array_equal(_draws(archived)[0], _draws(alone)[0])
        assert archived.posterior.attrs["chain_seed"] == seed
        assert archived.posterior.attrs["sampler"]["seed"] == seed
        assert "backend" in archived.posterior.attrs["execution_info"]
    rec = chain_records(merged)
    assert rec["chain_seeds"] == [11, 5] and rec["failed_chains"] == []
    assert [c["seed"] for c in rec["chains"]] == [11, 5]
    assert all("backend" in c["execution_info"] for c in rec["chains"])
    assert set(merged.sample_stats.data_vars) >= {"diverging", "lp", "step_size", "tree_depth"}
    # the merged object round-trips through NetCDF with its records
    idata_mod.save_netcdf(merged, tmp_path / "merged.nc")
    back = idata_mod.load_netcdf(tmp_path / "merged.nc")
    np.testing.assert_array_equal(_draws(back), _draws(merged))
    assert chain_records(back)["chain_seeds"] == [11, 5]


@pytest.mark.slow
def test_loky_workers_give_the_sequential_draws_and_report_a_failed_chain():
    """Chain seeds whose prior start lies where the density is NaN fail in their worker; the others finish."""
    tau, beyond = 2.0, 2.5
    model = ToyModel(seed=2, tau=tau, nonfinite_beyond=beyond)
    good = [s for s in range(50) if np.abs(model.prior_draw(s)).max() < 0.6 * beyond][:2]
    bad = next(s for s in range(50) if np.abs(model.prior_draw(s)).max() > beyond)
    build = functools.partial(ToyModel, seed=2, tau=tau, nonfinite_beyond=beyond)
    seeds = [good[0], bad, good[1]]
    out = sample_chains(build, 3, seeds=seeds, backend="loky", n_jobs=2, **SETTINGS)
    assert not out.ok
    assert [f["seed"] for f in out.failures] == [bad] and out.failures[0]["chain"] == 1
    assert "not finite" in out.failures[0]["error"]
    assert [r["seed"] for r in out.records] == [good[0], good[1]]
    assert chain_records(out.inference_data)["failed_chains"][0]["seed"] == bad
    ref = sample_chains(build, 2, seeds=good, backend="sequential", **SETTINGS).inference_data
    np.testing.assert_allclose(_draws(out.inference_data), _draws(ref), rtol=1e-12, atol=1e-12)
    # every chain failing is an error that names each seed
    with pytest.raises(RuntimeError, match=f"seed {bad}"):
        sample_chains(build, 1, seeds=[bad], backend="sequential", **SETTINGS)


@pytest.mark.slow
def test_merge_refuses_mismatched_chains():
    a = sample(ToyModel(seed=2), num_chains=1, seed=1, progress=False, **SETTINGS).inference_data
    b = sample(ToyModel(seed=2), num_chains=1, seed=2, progress=False,
               **{**SETTINGS, "num_samples": 30}).inference_data
    with pytest.raises(ValueError, match="draws"):
        merge_chains([a, b])
    c = sample(ToyModel(seed=3), num_chains=1, seed=2, progress=False, **SETTINGS).inference_data
    with pytest.raises(ValueError, match="observed_data"):
        merge_chains([a, c])
    with pytest.raises(ValueError, match="no InferenceData"):
        merge_chains([])


def test_bad_arguments_raise_before_any_chain():
    build = functools.partial(ToyModel, seed=2)
    for kwargs, name in ((dict(seeds=[1]), "seeds"), (dict(seeds=[1, 1]), "seeds"), (dict(seeds=[-1, 2]), "seeds"),
                         (dict(seed=3), "seed"), (dict(backend="mpi"), "backend"),
                         (dict(devices=[]), "devices"), (dict(archive=None), "archive"),
                         (dict(record=None), "record")):
        with pytest.raises(ValueError, match=name):
            sample_chains(build, 2, **kwargs)
    with pytest.raises(ValueError, match="num_chains"):
        sample_chains(build, 0)
    with pytest.raises(ValueError, match="build_model"):
        sample_chains("not a model", 2)


def _fixture(seed, observed_seed=0):
    """The archive fixture with the draws of ``seed`` and the observed data of ``observed_seed``."""
    from msrm.gp.idata import build_inference_data

    p, obs = idata_fixture.fixture_parts(seed), idata_fixture.fixture_parts(observed_seed)["observed"]
    attrs = {**idata_fixture.ATTRS, "sampler": {"seed": 100 + seed}}
    return p, build_inference_data(idata_fixture.StandIn(), p["draws_u"], p["sample_stats"],
                                   log_likelihood=p["log_likelihood"], observed=obs, attrs=attrs)


def test_merge_of_built_inference_data_concatenates_chains_in_the_installed_container(tmp_path):
    """No sampling: two objects of two chains each, one of them loaded back from NetCDF (its groups then come in
    the archive's order), merged into four chains, against plain concatenation of the arrays."""
    (pa, a), (pb, b) = _fixture(0), _fixture(1)
    b = idata_mod.load_netcdf(idata_mod.save_netcdf(b, tmp_path / "b.nc"))
    merged = merge_chains([a, b], records=[{"archive": None}, {"archive": "b.nc"}])
    assert type(merged) is type(a)
    C = idata_fixture.CHAINS
    np.testing.assert_array_equal(np.asarray(merged.unconstrained_posterior["u"]),
                                  np.concatenate([pa["draws_u"], pb["draws_u"]]))
    np.testing.assert_array_equal(np.asarray(merged.sample_stats["lp"]),
                                  np.concatenate([pa["sample_stats"]["lp"], pb["sample_stats"]["lp"]]))
    np.testing.assert_array_equal(np.asarray(merged.posterior["chain"]), np.arange(2 * C))
    np.testing.assert_array_equal(np.asarray(merged.observed_data["p0_brain_mean"]),
                                  np.asarray(a.observed_data["p0_brain_mean"]))
    rec = chain_records(merged)
    assert rec["chain_seeds"] == [100] * C + [101] * C
    assert [c["archive"] for c in rec["chains"]] == [None] * C + ["b.nc"] * C
    back = idata_mod.load_netcdf(idata_mod.save_netcdf(merged, tmp_path / "merged.nc"))
    np.testing.assert_array_equal(np.asarray(back.posterior["lengthscales"]),
                                  np.asarray(merged.posterior["lengthscales"]))
    assert chain_records(back) == rec
    # refusals: other observed data, other draw counts, other groups
    with pytest.raises(ValueError, match="observed_data"):
        merge_chains([a, _fixture(1, observed_seed=1)[1]])
    short = idata_mod.from_groups({g: idata_mod.group_dataset(b, g).isel(draw=slice(0, 3))
                                   if "draw" in idata_mod.group_dataset(b, g).dims else idata_mod.group_dataset(b, g)
                                   for g in idata_mod.group_names(b)})
    with pytest.raises(ValueError, match="draws"):
        merge_chains([a, short])
    fewer = idata_mod.from_groups({g: idata_mod.group_dataset(b, g) for g in idata_mod.group_names(b)
                                   if g != "log_likelihood"})
    with pytest.raises(ValueError, match="groups"):
        merge_chains([a, fewer])
