"""Peer methods of the recovery benchmark (msrm_lab.peers): latents on the grid, recovered subspace, failures."""

import sys

import numpy as np
import pytest

import msrm
from msrm_lab import peers
from msrm_lab.peers import PEERS, PeerResult, run_peer

DURATION = 80.0
BRAIN_DT = 2.0
RATING_DT = 1.0

# module whose import each peer needs (skip when absent)
NEEDS = {
    "pca_spline": "sklearn.decomposition",
    "fa_spline": "sklearn.decomposition",
    "srm": "brainiak.funcalign.srm",
    "mefisto": "mofapy2.run.entry_point",
    "gpfa": "elephant.gpfa.gpfa_core",
}


def truth(t):
    """(n, 2) smooth latents: two sinusoids of different periods."""
    t = np.asarray(t, dtype=np.float64)
    return np.column_stack([np.sin(2 * np.pi * t / 40.0), np.cos(2 * np.pi * t / 26.0 + 0.3)])


def make_data(seed=0):
    rng = np.random.default_rng(seed)
    streams = []
    tb = BRAIN_DT * np.arange(int(DURATION / BRAIN_DT))
    for p in range(3):
        W = rng.normal(size=(2, 30))
        b = rng.normal(size=30)
        Y = b + truth(tb) @ W + 0.1 * rng.normal(size=(tb.size, 30))
        streams.append(msrm.Stream(participant=f"p{p}", modality="brain", dt=BRAIN_DT, values=Y))
    tr = RATING_DT * np.arange(int(DURATION / RATING_DT))
    rating = truth(tr - 2.0) @ np.array([1.0, 0.5]) + 0.05 * rng.normal(size=tr.size)
    streams.append(msrm.Stream(participant="p0", modality="rating", dt=RATING_DT, values=rating[:, None]))
    return msrm.Dataset([msrm.Run(duration=DURATION, streams=tuple(streams))])


SPEC = msrm.ModelSpec(
    n_factors=2,
    latent_dt=1.0,
    responses={"brain": msrm.Identity(), "rating": msrm.GaussianLag(width=1.0, lag_bounds=(0.0, 4.0))},
)


def subspace_error(Z_true, Z_hat):
    """||Z - Q Q^T Z|| / ||Z||, Q an orthonormal basis of the centred recovered latents; Z centred."""
    Zt = Z_true - Z_true.mean(axis=0)
    Q, _ = np.linalg.qr(Z_hat - Z_hat.mean(axis=0))
    return float(np.linalg.norm(Zt - Q @ (Q.T @ Zt)) / np.linalg.norm(Zt))


@pytest.fixture(scope="module")
def data():
    return make_data()


@pytest.mark.parametrize("name", PEERS)
def test_peer_recovers_latent_subspace(name, data, monkeypatch):
    pytest.importorskip(NEEDS[name])
    # fewer MEFISTO iterations than the benchmark's: this easy case is recovered well before 100
    monkeypatch.setattr(peers, "MEFISTO_ITERATIONS", 100)
    res = run_peer(name, data, SPEC, seed=0)
    assert isinstance(res, PeerResult) and res.method == name
    assert res.ok, res.error
    assert res.error is None
    assert len(res.latents) == 1
    grid = msrm.latent_grid(DURATION, SPEC)
    Z = res.latents[0]
    assert Z.shape == (grid.size, 2) and Z.dtype == np.float64
    # the span the brain samples cover (MEFISTO's samples reach the run's end through the rating clock)
    inside = (grid >= 0.0) & (grid <= BRAIN_DT * (int(DURATION / BRAIN_DT) - 1))
    assert np.isfinite(Z[inside]).all()
    assert np.isnan(Z[grid < 0.0]).all()  # nothing before the first sample: no extrapolation
    err = subspace_error(truth(grid[inside]), Z[inside])
    assert err < 0.2, f"{name}: subspace error {err:.3f}"
    assert "versions" in res.info and res.info["versions"]["numpy"] == np.__version__


def test_subspace_error_detects_a_wrong_subspace():
    t = np.linspace(0, 78, 79)
    Z = truth(t)
    assert subspace_error(Z, Z @ np.array([[2.0, 1.0], [0.5, -1.0]])) < 1e-10
    wrong = np.column_stack([np.sin(2 * np.pi * t / 9.0), np.cos(2 * np.pi * t / 5.0)])
    assert subspace_error(Z, wrong) > 0.5


def test_pca_runs_split_back_per_run_with_missing_values():
    pytest.importorskip("sklearn.decomposition")
    rng = np.random.default_rng(3)
    W = [rng.normal(size=(2, 20)) for _ in range(2)]  # loadings shared by the runs
    runs = []
    for r, T in enumerate((60.0, 40.0)):
        tb = BRAIN_DT * np.arange(int(T / BRAIN_DT))
        streams = []
        for p in range(2):
            Y = truth(tb + 100 * r) @ W[p] + 0.05 * rng.normal(size=(tb.size, 20))
            Y[rng.random(Y.shape) < 0.05] = np.nan
            # participant 1 on a shifted clock: interpolated onto participant 0's
            streams.append(msrm.Stream(participant=f"p{p}", modality="brain", dt=BRAIN_DT, values=Y,
                                       offset=0.0 if p == 0 else 1.0))
        runs.append(msrm.Run(duration=T, streams=tuple(streams)))
    data = msrm.Dataset(runs)
    res = run_peer("pca_spline", data, SPEC)
    assert res.ok, res.error
    for r, run in enumerate(data.runs):
        grid = msrm.latent_grid(run.duration, SPEC)
        Z = res.latents[r]
        assert Z.shape == (grid.size, 2)
        last = BRAIN_DT * (int(run.duration / BRAIN_DT) - 1)
        inside = (grid >= 0) & (grid <= last)
        assert np.isfinite(Z[inside]).all() and np.isnan(Z[~inside]).all()
        assert subspace_error(truth(grid[inside] + 100 * r), Z[inside]) < 0.2


def test_unknown_name_and_bad_arguments_raise(data):
    with pytest.raises(ValueError, match="name"):
        run_peer("ica", data, SPEC)
    with pytest.raises(ValueError, match="data"):
        run_peer("pca_spline", [1, 2], SPEC)
    with pytest.raises(ValueError, match="spec"):
        run_peer("pca_spline", data, {"n_factors": 2})
    with pytest.raises(ValueError, match="seed"):
        run_peer("pca_spline", data, SPEC, seed=1.5)


@pytest.mark.parametrize("name, module", [("srm", "brainiak.funcalign.srm"), ("pca_spline", "sklearn.decomposition")])
def test_failed_import_gives_not_ok_with_reason(name, module, data, monkeypatch):
    monkeypatch.setitem(sys.modules, module, None)  # the next import of it raises ImportError
    res = run_peer(name, data, SPEC)
    assert not res.ok and res.latents == []
    assert module.split(".")[0] in res.error or "scikit-learn" in res.error or "brainiak" in res.error


def test_not_installed_message(data, monkeypatch):
    monkeypatch.setitem(sys.modules, "brainiak.funcalign.srm", None)
    monkeypatch.setattr(peers, "_version", lambda dist: None)
    res = run_peer("srm", data, SPEC)
    assert not res.ok
    assert res.error == "not installed: brainiak (pip install -e '.[peers]')"


def test_fit_error_gives_not_ok(data):
    pytest.importorskip("sklearn.decomposition")
    spec = msrm.ModelSpec(n_factors=500, latent_dt=1.0, responses=SPEC.responses)  # more components than samples
    res = run_peer("pca_spline", data, spec)
    assert not res.ok and res.error.startswith("ValueError")
    no_brain = msrm.Dataset([msrm.Run(duration=10.0, streams=(msrm.Stream("p0", "rating", 1.0, np.ones((10, 1))),))])
    res = run_peer("fa_spline", no_brain, SPEC)
    assert not res.ok and "brain" in res.error


@pytest.mark.parametrize("name", ["fa_spline", "srm"])
def test_same_seed_same_latents(name, data):
    pytest.importorskip(NEEDS[name])
    a, b = run_peer(name, data, SPEC, seed=4), run_peer(name, data, SPEC, seed=4)
    assert a.ok and b.ok, (a.error, b.error)
    np.testing.assert_array_equal(a.latents[0], b.latents[0])
    assert a.info["seed"] == 4


def test_mefisto_without_brain_streams(monkeypatch):
    pytest.importorskip(NEEDS["mefisto"])
    monkeypatch.setattr(peers, "MEFISTO_ITERATIONS", 30)
    t = np.arange(30.0)
    streams = (msrm.Stream("p0", "rating", 1.0, truth(t)[:, :1]), msrm.Stream("p0", "physio", 0.5,
               truth(np.arange(60) * 0.5)[:, :1] + 0.01 * np.cos(np.arange(60.0))[:, None]))
    data = msrm.Dataset([msrm.Run(duration=30.0, streams=streams)])
    spec = msrm.ModelSpec(n_factors=1, latent_dt=1.0, responses=SPEC.responses)
    res = run_peer("mefisto", data, spec)
    assert res.ok, res.error
    grid = msrm.latent_grid(30.0, spec)
    inside = (grid >= 0) & (grid <= 29.5)
    assert res.latents[0].shape == (grid.size, 1) and np.isfinite(res.latents[0][inside]).all()
    assert res.info["views"] == ["rating", "physio"]
    # PCA needs brain streams: a reason, not an exception
    pca = run_peer("pca_spline", data, spec)
    assert not pca.ok and "brain" in pca.error
