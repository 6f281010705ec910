"""msrm.bids: a BIDS dataset read into an msrm.Dataset.

Two datasets: the synthetic one of ``data_synth.bids`` (NIfTI BOLD, mask and atlas, physiology starting before the
first volume, a rating dial, fMRIPrep-style confounds and parcel time series, with the values it wrote), and a tiny
folder written by hand here, file by file, as the BIDS specification lays it out. Every stream's clock is checked
to 1e-9 s against the module's rules, values against what was written (BOLD through a nilearn masker built here),
downsampling against NumPy, confound regression against ``nilearn.signal.clean`` called directly, and every kind of
bad input against the file and field its message must name.
"""
from __future__ import annotations

import gzip
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

nib = pytest.importorskip("nibabel", reason="msrm.bids needs nibabel (pip install 'msrm[bids]')")
pytest.importorskip("nilearn", reason="msrm.bids needs nilearn (pip install 'msrm[bids]')")

import pandas as pd  # noqa: E402
from nilearn.maskers import NiftiLabelsMasker, NiftiMasker  # noqa: E402
from nilearn.signal import clean  # noqa: E402

import msrm  # noqa: E402
import msrm.bids  # noqa: E402
from data_synth.bids import write_bids_dataset  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TOL = 1e-9

# nilearn's own deprecation notices about its maskers' defaults are not this module's concern
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    return write_bids_dataset(tmp_path_factory.mktemp("synth"), seed=3)


def masker_of(truth):
    return NiftiMasker(mask_img=str(truth.mask))


def kept_rule(start: float, fs: float, n_rows: int, duration: float) -> tuple[int, float, int]:
    """(first kept row, offset, samples kept) by the documented rule, computed independently."""
    t = start + np.arange(n_rows) / fs
    inside = np.flatnonzero((t >= -1e-12) & (t <= duration + 1e-9))
    return int(inside[0]), float(t[inside[0]]), int(inside.size)


def stream(data, run: int, key: str):
    return data.runs[run].stream(key)


def clean_confounds(path, names):
    df = pd.read_csv(path, sep="\t", na_values=["n/a"])
    c = df[names].to_numpy(dtype=float)
    first = np.isnan(c[0])
    c[0, first] = c[1, first]
    return c


# --------------------------------------------------------------------------------------------------------------
# importing


def test_import_msrm_imports_no_bids_dependency():
    code = ("import sys, msrm\n"
            "assert 'msrm.bids' not in sys.modules\n"
            "load = msrm.bids.load\n"  # the lazy table resolves the submodule
            "import msrm.bids\n"
            "bad = [m for m in ('nibabel', 'nilearn', 'bids') if m in sys.modules]\n"
            "assert not bad, bad\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


# --------------------------------------------------------------------------------------------------------------
# the synthetic dataset


def test_synthetic_clocks_and_values(synth):
    data = msrm.bids.load(synth.root, synth.task, {"brain": "bold", "physio": ["physio:cardiac", "physio:respiratory"],
                                                   "rating": "recording-dial:rating"}, masker=masker_of(synth))
    assert isinstance(data, msrm.Dataset)
    assert len(data.runs) == len(synth.runs)
    assert data.participants == synth.subjects
    assert data.modalities == ("brain", "physio", "rating")
    duration = synth.n_volumes * synth.tr
    reference = masker_of(synth)
    for r_i, run in enumerate(synth.runs):
        assert data.runs[r_i].duration == pytest.approx(duration, abs=TOL)
        for sub in synth.subjects:
            brain = stream(data, r_i, f"{sub}/brain")
            assert brain.dt == pytest.approx(synth.tr, abs=TOL)
            assert brain.offset == pytest.approx(float(np.median(synth.slice_timing)), abs=TOL)
            assert brain.n_samples == synth.n_volumes
            expected = reference.fit_transform(str(synth.files[(sub, run, "bold")]))
            np.testing.assert_array_equal(brain.values, np.asarray(expected, dtype=np.float64))

            for key, name, cols in ((f"{sub}/physio", "physio", [0, 1]), (f"{sub}/rating", "dial", [0])):
                clock = synth.clocks[(sub, run, name)]
                fs, start, n_rows = clock["sampling_frequency"], clock["start_time"], clock["n_samples"]
                k0, offset, n = kept_rule(start, fs, n_rows, duration)
                s = stream(data, r_i, key)
                assert s.dt == pytest.approx(1 / fs, abs=TOL)
                assert s.offset == pytest.approx(offset, abs=TOL)
                assert s.n_samples == n
                np.testing.assert_allclose(s.values, synth.values[(sub, run, name)][k0:k0 + n, cols], atol=1e-9,
                                           rtol=0)


def test_negative_start_time_and_end_of_run(synth):
    data = msrm.bids.load(synth.root, synth.task, {"physio": "physio:cardiac", "brain": "bold"},
                          masker=masker_of(synth), subjects=["01"], derivatives=[])
    clock = synth.clocks[("01", "1", "physio")]
    fs, start = clock["sampling_frequency"], clock["start_time"]
    assert start < 0
    s = stream(data, 0, "01/physio")
    duration = data.runs[0].duration
    # the first kept row is the first at or after the first volume's onset; the one before it is before
    k0 = math.ceil(-start * fs - 1e-9)
    assert start + (k0 - 1) / fs < 0 <= start + k0 / fs + 1e-12
    assert s.offset == pytest.approx(start + k0 / fs, abs=TOL)
    assert s.values[0, 0] == pytest.approx(synth.values[("01", "1", "physio")][k0, 0], abs=1e-9)
    # the physiology was recorded past the run's end: the last kept sample is the last at or before it
    last = s.offset + (s.n_samples - 1) * s.dt
    assert last <= duration + TOL and last + s.dt > duration
    assert clock["n_samples"] > k0 + s.n_samples


def test_downsampling_by_block_means(synth):
    duration = synth.n_volumes * synth.tr
    data = msrm.bids.load(synth.root, synth.task, {"physio": ["physio:cardiac", "physio:respiratory"],
                                                   "rating": "recording-dial:rating", "brain": "bold"},
                          masker=masker_of(synth), physio_rate=10.0)
    for r_i, run in enumerate(synth.runs):
        for sub in synth.subjects:
            clock = synth.clocks[(sub, run, "physio")]
            fs = clock["sampling_frequency"]
            k0, offset, n = kept_rule(clock["start_time"], fs, clock["n_samples"], duration)
            m = int(round(fs / 10.0))
            kept = synth.values[(sub, run, "physio")][k0:k0 + n, :2]
            nb = n // m
            expected = kept[: nb * m].reshape(nb, m, 2).mean(axis=1)
            s = stream(data, r_i, f"{sub}/physio")
            assert s.dt == pytest.approx(m / fs, abs=TOL)
            assert s.offset == pytest.approx(offset + (m - 1) / (2 * fs), abs=TOL)
            np.testing.assert_allclose(s.values, expected, atol=1e-9, rtol=0)
            # a number applies only to physiology faster than it: the 10 Hz dial is untouched
            dial = stream(data, r_i, f"{sub}/rating")
            assert dial.dt == pytest.approx(0.1, abs=TOL)
            assert dial.n_samples == synth.clocks[(sub, run, "dial")]["n_samples"]

    # a dict names modalities; the 10 Hz dial to 5 Hz is two-sample means
    data = msrm.bids.load(synth.root, synth.task, {"rating": "recording-dial:rating"}, physio_rate={"rating": 5.0},
                          subjects=["01"])
    s = stream(data, 0, "01/rating")
    raw = synth.values[("01", "1", "dial")][:, 0]
    nb = raw.size // 2
    np.testing.assert_allclose(s.values[:, 0], raw[: 2 * nb].reshape(nb, 2).mean(axis=1), atol=1e-9, rtol=0)
    assert s.dt == pytest.approx(0.2, abs=TOL)
    assert s.offset == pytest.approx(synth.clocks[("01", "1", "dial")]["start_time"] + 0.05, abs=TOL)

    with pytest.raises(ValueError, match=r"physio\.tsv\.gz.*SamplingFrequency 50 Hz is not an integer multiple"):
        msrm.bids.load(synth.root, synth.task, {"physio": "physio:cardiac"}, physio_rate=7.0)


def test_confound_regression_matches_nilearn(synth):
    names = ["trans_x", "csf", "framewise_displacement"]
    data = msrm.bids.load(synth.root, synth.task, {"brain": "bold", "parc": "timeseries:parcels"},
                          masker=masker_of(synth), confounds=names + ["motion_outlier*"])
    for r_i, run in enumerate(synth.runs):
        for sub in synth.subjects:
            conf = clean_confounds(synth.files[(sub, run, "confounds")], names)
            flagged = np.zeros(synth.n_volumes, dtype=bool)
            flagged[synth.outliers[(sub, run)]] = True
            keep = np.flatnonzero(~flagged)

            raw = masker_of(synth).fit_transform(str(synth.files[(sub, run, "bold")]))
            expected = clean(raw, confounds=conf, sample_mask=keep, detrend=False, standardize=None,
                             standardize_confounds=True, filter=False)
            s = stream(data, r_i, f"{sub}/brain")
            assert np.isnan(s.values[flagged]).all() and not np.isnan(s.values[keep]).any()
            np.testing.assert_allclose(s.values[keep], expected, rtol=1e-5, atol=1e-4)
            # the regression did something: trans_x and csf were mixed into every voxel
            assert np.abs(s.values[keep] - raw[keep]).max() > 0.1

            table = pd.read_csv(synth.files[(sub, run, "parcels")], sep="\t").to_numpy(dtype=float)
            expected = clean(table, confounds=conf, sample_mask=keep, detrend=False, standardize=None,
                             standardize_confounds=True, filter=False)
            p = stream(data, r_i, f"{sub}/parc")
            assert p.offset == pytest.approx(float(np.median(synth.slice_timing)), abs=TOL)  # its StartTime
            np.testing.assert_allclose(p.values[keep], expected, rtol=0, atol=1e-9)
            assert np.isnan(p.values[flagged]).all()


def test_scrub_by_framewise_displacement(synth):
    fd = pd.read_csv(synth.files[("01", "1", "confounds")], sep="\t", na_values=["n/a"])["framewise_displacement"]
    threshold = float(np.nanquantile(fd, 0.8))
    data = msrm.bids.load(synth.root, synth.task, {"parc": "timeseries:parcels"}, scrub=threshold, subjects=["01"])
    s = stream(data, 0, "01/parc")
    flagged = np.nan_to_num(fd.to_numpy(), nan=0.0) > threshold
    assert flagged.sum() >= 5
    np.testing.assert_array_equal(np.isnan(s.values).all(axis=1), flagged)
    table = pd.read_csv(synth.files[("01", "1", "parcels")], sep="\t").to_numpy(dtype=float)
    np.testing.assert_allclose(s.values[~flagged], table[~flagged], rtol=0, atol=0)  # no regressors: kept as is


def test_labels_masker_and_parcel_table(synth):
    data = msrm.bids.load(synth.root, synth.task, {"brain": "bold", "parc": "timeseries:parcels"},
                          masker=NiftiLabelsMasker(labels_img=str(synth.atlas)), subjects=["sub-02"])
    assert data.participants == ("02",)
    brain = stream(data, 1, "02/brain")
    expected = NiftiLabelsMasker(labels_img=str(synth.atlas)).fit_transform(str(synth.files[("02", "2", "bold")]))
    np.testing.assert_allclose(brain.values, expected, rtol=0, atol=0)
    parc = stream(data, 1, "02/parc")
    assert parc.n_features == synth.n_parcels == brain.n_features
    np.testing.assert_allclose(parc.values, brain.values, atol=1e-4)  # the table holds the same parcel means


def test_unfitted_masker_is_fitted_once(synth):
    masker = NiftiMasker()  # computes its mask from the first image read
    data = msrm.bids.load(synth.root, synth.task, {"brain": "bold"}, masker=masker)
    assert masker.__sklearn_is_fitted__()
    counts = {s.n_features for run in data.runs for s in run.streams}
    assert len(counts) == 1


def test_sessions_and_subject_selection(tmp_path):
    truth = write_bids_dataset(tmp_path, seed=1, n_subjects=2, n_runs=1, n_volumes=20, session="a")
    data = msrm.bids.load(tmp_path, "movie", {"brain": "bold", "physio": "physio:trigger"}, masker=masker_of(truth),
                          subjects=["02"])
    assert len(data.runs) == 1 and data.participants == ("02",)
    assert stream(data, 0, "02/brain").n_samples == 20
    with pytest.raises(ValueError, match="subject '07' has no files for task 'movie'"):
        msrm.bids.load(tmp_path, "movie", {"brain": "bold"}, masker=masker_of(truth), subjects=["07"])


# --------------------------------------------------------------------------------------------------------------
# a tiny dataset written by hand, exactly as the BIDS specification lays it out


def write_json(path: Path, content) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(content))


def write_physio(path: Path, rows: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as fh:
        fh.writelines("\t".join(repr(float(v)) for v in row) + "\n" for row in rows)


def write_tiny(root: Path) -> dict:
    """dataset_description.json, an inherited task-x_bold.json, one subject's BOLD (20 volumes, TR 1.5 s, no
    SliceTiming), physio at 40 Hz from -0.25 s, a recording-dial physio at 10 Hz from 0.5 s and a beh table at 5 Hz
    from 1.3 s; no session or run entity."""
    rng = np.random.default_rng(7)
    write_json(root / "dataset_description.json", {"Name": "tiny", "BIDSVersion": "1.9.0", "DatasetType": "raw"})
    write_json(root / "task-x_bold.json", {"TaskName": "x", "RepetitionTime": 1.5})
    func = root / "sub-01" / "func"
    func.mkdir(parents=True)
    bold = rng.normal(100, 1, (4, 4, 3, 20)).astype(np.float32)
    nib.save(nib.Nifti1Image(bold, np.eye(4)), str(func / "sub-01_task-x_bold.nii.gz"))
    mask = root / "mask.nii.gz"
    nib.save(nib.Nifti1Image(np.ones((4, 4, 3), dtype=np.uint8), np.eye(4)), str(mask))
    physio = rng.normal(size=(1240, 2))
    write_physio(func / "sub-01_task-x_physio.tsv.gz", physio)
    write_json(func / "sub-01_task-x_physio.json", {"SamplingFrequency": 40, "StartTime": -0.25,
                                                    "Columns": ["cardiac", "respiratory"]})
    dial = rng.normal(size=(250, 1))
    write_physio(func / "sub-01_task-x_recording-dial_physio.tsv.gz", dial)
    write_json(func / "sub-01_task-x_recording-dial_physio.json", {"SamplingFrequency": 10, "StartTime": 0.5,
                                                                   "Columns": ["rating"]})
    beh = rng.normal(size=(150, 2))
    (root / "sub-01" / "beh").mkdir()
    (root / "sub-01" / "beh" / "sub-01_task-x_beh.tsv").write_text(
        "valence\tarousal\n" + "".join(f"{float(a)!r}\t{float(b)!r}\n" for a, b in beh))
    write_json(root / "sub-01" / "beh" / "sub-01_task-x_beh.json", {"SamplingFrequency": 5, "StartTime": 1.3})
    return {"mask": mask, "physio": physio, "dial": dial, "beh": beh, "func": func}


TINY_MODALITIES = {"brain": "bold", "physio": ["physio:cardiac", "physio:respiratory"],
                   "rating": "recording-dial:rating", "mood": "beh:valence"}


@pytest.fixture()
def tiny(tmp_path):
    info = write_tiny(tmp_path / "ds")
    return tmp_path / "ds", info


def load_tiny(root, info, **kw):
    args = dict(modalities=TINY_MODALITIES, masker=NiftiMasker(mask_img=str(info["mask"])))
    args.update(kw)
    return msrm.bids.load(root, "x", **args)


def test_hand_written_dataset(tiny):
    root, info = tiny
    data = load_tiny(root, info)
    (run,) = data.runs
    assert run.duration == pytest.approx(30.0, abs=TOL)  # 20 volumes of 1.5 s
    brain = run.stream("01/brain")
    assert (brain.dt, brain.offset, brain.n_samples, brain.n_features) == (1.5, 0.0, 20, 48)
    expected = NiftiMasker(mask_img=str(info["mask"])).fit_transform(str(info["func"] / "sub-01_task-x_bold.nii.gz"))
    np.testing.assert_array_equal(brain.values, expected)
    physio = run.stream("01/physio")  # 40 Hz from -0.25 s: rows 0..9 are before the first volume
    assert physio.dt == pytest.approx(0.025, abs=TOL) and physio.offset == pytest.approx(0.0, abs=TOL)
    assert physio.n_samples == 1201  # t = 0, 0.025, ..., 30.0
    np.testing.assert_array_equal(physio.values, info["physio"][10:1211])
    dial = run.stream("01/rating")
    assert dial.dt == pytest.approx(0.1, abs=TOL) and dial.offset == pytest.approx(0.5, abs=TOL)
    assert dial.n_samples == 250  # ends at 25.4 s, inside the run
    np.testing.assert_array_equal(dial.values, info["dial"])
    mood = run.stream("01/mood")
    assert mood.dt == pytest.approx(0.2, abs=TOL) and mood.offset == pytest.approx(1.3, abs=TOL)
    assert mood.n_samples == 144  # 1.3 + 143 * 0.2 = 29.9 s; the next, 30.1 s, is after the run
    np.testing.assert_array_equal(mood.values[:, 0], info["beh"][:144, 0])


def test_without_bold_the_longest_stream_sets_the_duration(tiny):
    root, info = tiny
    data = msrm.bids.load(root, "x", {"physio": "physio:cardiac", "rating": "recording-dial:rating"})
    (run,) = data.runs
    assert run.duration == pytest.approx(-0.25 + 1240 / 40, abs=TOL)  # offset 0 + 1230 samples of 25 ms
    assert run.stream("01/physio").n_samples == 1230


def test_sidecar_inheritance(tiny):
    root, info = tiny
    bold = info["func"] / "sub-01_task-x_bold.nii.gz"
    meta, chain = msrm.bids.sidecar(bold, root)
    assert meta == {"TaskName": "x", "RepetitionTime": 1.5} and chain == [root / "task-x_bold.json"]
    # a deeper folder overrides the root
    write_json(root / "sub-01" / "sub-01_task-x_bold.json", {"RepetitionTime": 2.0})
    assert msrm.bids.sidecar(bold, root)[0]["RepetitionTime"] == 2.0
    # within one folder, the file with more entities overrides the one with fewer
    write_json(info["func"] / "task-x_bold.json", {"RepetitionTime": 3.0, "SliceTiming": [0.0, 0.5, 1.0]})
    write_json(info["func"] / "sub-01_task-x_bold.json", {"RepetitionTime": 2.5})
    meta, chain = msrm.bids.sidecar(bold, root)
    assert meta == {"TaskName": "x", "RepetitionTime": 2.5, "SliceTiming": [0.0, 0.5, 1.0]} and len(chain) == 4
    brain = load_tiny(root, info).runs[0].stream("01/brain")
    assert brain.dt == 2.5 and brain.offset == pytest.approx(0.5, abs=TOL)  # the median of SliceTiming
    # a sidecar of another run or task does not apply
    write_json(info["func"] / "sub-01_task-y_bold.json", {"RepetitionTime": 9.0})
    write_json(info["func"] / "sub-01_task-x_run-2_bold.json", {"RepetitionTime": 9.0})
    assert msrm.bids.sidecar(bold, root)[0]["RepetitionTime"] == 2.5
    # two with as many entities in one folder are ambiguous
    write_json(info["func"] / "sub-01_bold.json", {"RepetitionTime": 3.0})
    with pytest.raises(ValueError, match="two sidecars apply at one level"):
        msrm.bids.sidecar(bold, root)


def test_event_style_tables(tiny):
    root, info = tiny
    (info["func"] / "sub-01_task-x_events.tsv").write_text(
        "onset\tduration\tvalue\n-1.0\t2.0\t5\n3.0\t2.0\t1\n4.0\t3.0\t3\n10.0\t0\t9\n")
    with pytest.raises(ValueError, match=r"events\.tsv.*event_rate"):
        msrm.bids.load(root, "x", {"brain": "bold", "ev": "events:value"},
                       masker=NiftiMasker(mask_img=str(info["mask"])))
    data = msrm.bids.load(root, "x", {"brain": "bold", "ev": "events:value"},
                          masker=NiftiMasker(mask_img=str(info["mask"])), event_rate=2.0)
    ev = data.runs[0].stream("01/ev")
    assert ev.dt == 0.5 and ev.offset == 0.0 and ev.n_samples == 61  # t = 0, 0.5, ..., 30
    t = ev.times
    expected = np.full(t.size, np.nan)
    expected[t < 1.0] = 5.0
    expected[(t >= 3.0) & (t < 4.0)] = 1.0
    expected[(t >= 4.0) & (t < 5.0)] = 2.0  # two events cover it: their mean
    expected[(t >= 5.0) & (t < 7.0)] = 3.0
    np.testing.assert_array_equal(ev.values[:, 0], expected)


# --------------------------------------------------------------------------------------------------------------
# bad input: each raises, naming the file and the field, before anything is returned


def rewrite_json(path: Path, **changes):
    content = json.loads(path.read_text())
    for k, v in changes.items():
        if v is None:
            content.pop(k, None)
        else:
            content[k] = v
    path.write_text(json.dumps(content))


def test_bad_hand_written_input(tiny, tmp_path):
    root, info = tiny
    func = info["func"]

    def fails(exc, *needles, **kw):
        with pytest.raises(exc) as err:
            load_tiny(root, info, **kw)
        for needle in needles:
            assert needle in str(err.value), (needle, str(err.value))

    # no files for the task
    with pytest.raises(FileNotFoundError, match="no files for task 'nope'"):
        msrm.bids.load(root, "nope", TINY_MODALITIES, masker=NiftiMasker(mask_img=str(info["mask"])))
    # a source that names no known kind; bold without a masker
    fails(ValueError, "'eeg:x'", "unknown kind", modalities={"e": "eeg:x"})
    fails(ValueError, "masker", masker=None)
    # a column that does not exist
    fails(ValueError, "sub-01_task-x_physio.tsv.gz", "'pulse'", "Columns", modalities={"p": "physio:pulse"})
    fails(ValueError, "sub-01_task-x_beh.tsv", "'joy'", modalities={"m": "beh:joy"})

    def mutate(change, exc, *needles, restore=True):
        saved = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
        change()
        try:
            fails(exc, *needles)
        finally:
            for p in list(root.rglob("*")):
                if p.is_file() and p not in saved:
                    p.unlink()
            for p, b in saved.items():
                p.write_bytes(b)

    physio_json = func / "sub-01_task-x_physio.json"
    # missing sidecar, missing fields
    mutate(lambda: physio_json.unlink(), FileNotFoundError, "sub-01_task-x_physio.tsv.gz", "sub-01_task-x_physio.json")
    mutate(lambda: rewrite_json(root / "task-x_bold.json", RepetitionTime=None), ValueError,
           "sub-01_task-x_bold.nii.gz", "'RepetitionTime'", "task-x_bold.json")
    mutate(lambda: rewrite_json(physio_json, SamplingFrequency=None), ValueError, "physio.tsv.gz",
           "'SamplingFrequency'")
    mutate(lambda: rewrite_json(physio_json, StartTime="soon"), ValueError, "physio.tsv.gz", "'StartTime'")
    mutate(lambda: rewrite_json(root / "sub-01/beh/sub-01_task-x_beh.json", StartTime=None), ValueError,
           "sub-01_task-x_beh.tsv", "'StartTime'")
    mutate(lambda: rewrite_json(func / "sub-01_task-x_recording-dial_physio.json", Columns=None), ValueError,
           "recording-dial_physio.tsv.gz", "'Columns'")
    # lengths that disagree with the sidecar
    mutate(lambda: rewrite_json(physio_json, Columns=["cardiac", "respiratory", "trigger"]), ValueError,
           "sub-01_task-x_physio.tsv.gz", "'Columns' lists 3")
    mutate(lambda: rewrite_json(root / "task-x_bold.json", SliceTiming=[0.0, 0.5]), ValueError,
           "sub-01_task-x_bold.nii.gz", "'SliceTiming' has 2 entries", "3 slices")
    mutate(lambda: rewrite_json(root / "task-x_bold.json", SliceTiming=[0.0, 0.5, 1.6]), ValueError,
           "sub-01_task-x_bold.nii.gz", "'SliceTiming'", "[0, RepetitionTime")
    mutate(lambda: rewrite_json(root / "task-x_bold.json", SliceTimingCorrected=True), ValueError,
           "sub-01_task-x_bold.nii.gz", "'StartTime'", "SliceTimingCorrected")
    # a run present for one modality and not another
    mutate(lambda: (func / "sub-01_task-x_recording-dial_physio.tsv.gz").unlink(), ValueError,
           "sub-01", "'rating'", "recording-dial:rating", "sub-01_task-x_bold.nii.gz")
    # a source matching several files of one run
    mutate(lambda: shutil.copy(func / "sub-01_task-x_bold.nii.gz", func / "sub-01_task-x_acq-b_bold.nii.gz"),
           ValueError, "sub-01_task-x_acq-b_bold.nii.gz", "sub-01_task-x_bold.nii.gz", "entity filters")
    # physiology entirely after the run
    mutate(lambda: rewrite_json(physio_json, StartTime=31.0), ValueError, "sub-01_task-x_physio.tsv.gz",
           "no sample inside the run")
    # a non-numeric column
    mutate(lambda: (root / "sub-01/beh/sub-01_task-x_beh.tsv").write_text("valence\tarousal\nhigh\t1\n"),
           ValueError, "sub-01_task-x_beh.tsv", "'valence'")
    # sources of one stream on different clocks
    fails(ValueError, "different clocks", "sub-01_task-x_physio.tsv.gz", "recording-dial_physio.tsv.gz",
          modalities={"mixed": ["physio:cardiac", "recording-dial:rating"]})
    # nothing was left behind by the mutations
    assert load_tiny(root, info).runs[0].duration == pytest.approx(30.0)


def test_bad_confounds_and_runs(tmp_path):
    truth = write_bids_dataset(tmp_path, seed=2, n_subjects=1, n_runs=2, n_volumes=20)
    conf = truth.files[("01", "1", "confounds")]

    def fails(exc, *needles, **kw):
        args = dict(modalities={"brain": "bold", "physio": "physio:cardiac"}, masker=masker_of(truth))
        args.update(kw)
        with pytest.raises(exc) as err:
            msrm.bids.load(tmp_path, "movie", **args)
        for needle in needles:
            assert needle in str(err.value), (needle, str(err.value))

    fails(ValueError, conf.name, "'nope'", confounds=["trans_x", "nope"])
    fails(ValueError, "scrub", scrub=-1.0)
    fails(ValueError, "confounds= and scrub= apply", modalities={"physio": "physio:cardiac"}, confounds=["csf"])
    lines = conf.read_text().splitlines()
    conf.write_text("\n".join(lines[:-1]) + "\n")  # one volume short
    fails(ValueError, conf.name, "19 rows", "20 volumes", confounds=["csf"])
    conf.unlink()
    fails(FileNotFoundError, "sub-01 run-1", "desc-confounds_timeseries.tsv", confounds=["csf"])
    # run 2 has BOLD but no physiology
    phys = truth.files[("01", "2", "physio")]
    phys.unlink()
    fails(ValueError, "sub-01 run-2", "'physio'", "sub-01_task-movie_run-2_bold.nii.gz")
