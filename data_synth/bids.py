"""A small synthetic BIDS dataset with known latents, for :mod:`msrm.bids`.

``write_bids_dataset(root)`` writes, for each subject and run of one task (``movie``):

* ``sub-<s>/func/sub-<s>_task-movie_run-<r>_bold.nii.gz``: a tiny NIfTI BOLD series (``shape`` voxels,
  ``n_volumes`` volumes); its ``RepetitionTime`` and ``SliceTiming`` are inherited from ``task-movie_bold.json`` at
  the dataset root. Voxel ``v`` in slice ``z`` at volume ``i`` holds ``100 + W_v . Z(i * TR + SliceTiming[z])``
  plus the effect of two confounds (``trans_x``, ``csf``) plus noise, inside the mask; small noise outside.
* ``sub-<s>/func/sub-<s>_task-movie_run-<r>_physio.tsv.gz`` + ``.json``: headerless columns ``cardiac``,
  ``respiratory``, ``trigger`` at ``physio_rate`` Hz, starting before the first volume (negative ``StartTime``,
  a different one per subject) and ending ``physio_tail`` seconds after the last volume's end.
* ``sub-<s>/func/sub-<s>_task-movie_run-<r>_recording-dial_physio.tsv.gz`` + ``.json``: a continuous rating
  (column ``rating``) at ``rating_rate`` Hz (positive ``StartTime``, ending before the run does). Its sidecar is
  complete: by the BIDS inheritance rule the plain physio sidecar of the same run applies to it too, and its own,
  having more entities, must override every field.
* ``derivatives/fmriprep/sub-<s>/func/..._desc-confounds_timeseries.tsv``: fMRIPrep-style confounds (six motion
  parameters, ``framewise_displacement`` with ``n/a`` in its first row, ``csf``, ``white_matter``,
  ``global_signal``, two ``motion_outlier`` spike columns).
* ``derivatives/fmriprep/sub-<s>/func/..._desc-parcels_timeseries.tsv`` + ``.json``: the mean BOLD of each atlas
  parcel (header ``parcel1``...), ``RepetitionTime`` and ``StartTime`` (the median slice time) in its sidecar.
* ``derivatives/synth/``: the brain mask (``desc-brain_mask``) and the atlas (``dseg``) images.

Latents ``Z`` (K factors, Matern-3/2 prior) are drawn on a 0.5 s grid covering every sample written and linearly
interpolated to sample times; every recording is a linear function of them plus noise. The truth returned holds
the latents, every file's clock and the values as written (rounded to the six decimals of the text files).
"""
from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .study import matern_kernel

__all__ = ["write_bids_dataset", "BidsTruth"]

TASK = "movie"


@dataclass(frozen=True)
class BidsTruth:
    """What ``write_bids_dataset`` wrote.

    Attributes:
        root: dataset root.
        task: task label.
        subjects: subject labels (without ``sub-``).
        runs: run labels.
        session: session label, or None when files carry no session entity.
        tr: RepetitionTime in seconds.
        n_volumes: volumes per BOLD series.
        slice_timing: SliceTiming (one entry per slice along k).
        mask: path of the brain mask image; atlas: path of the labels image (parcels 1..n_parcels).
        n_parcels: parcels in the atlas.
        latent_times: run label -> (J,) grid the latents were drawn on (seconds on the run's axis).
        latents: run label -> (J, K) latent values on that grid.
        clocks: (subject, run, name) -> {"sampling_frequency", "start_time", "n_samples"} for
            name "physio" and "dial" as written in the sidecars.
        files: (subject, run, name) -> path, name in "bold", "physio", "dial", "confounds", "parcels".
        values: (subject, run, name) -> (n_samples, n_columns) values as written, name in "physio", "dial"
            (columns in the sidecar's order).
        columns: name -> column names, for "physio" and "dial".
        outliers: (subject, run) -> indices of the volumes flagged by the motion_outlier columns.
    """

    root: Path
    task: str
    subjects: tuple[str, ...]
    runs: tuple[str, ...]
    session: str | None
    tr: float
    n_volumes: int
    slice_timing: tuple[float, ...]
    mask: Path
    atlas: Path
    n_parcels: int
    latent_times: dict
    latents: dict
    clocks: dict
    files: dict
    values: dict
    columns: dict
    outliers: dict


def _json(path: Path, content: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(content, indent=2) + "\n")


def _tsv_gz(path: Path, values: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as fh:
        for row in values:
            fh.write("\t".join(f"{v:.6f}" for v in row) + "\n")


def _tsv(path: Path, header: list[str], values: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ["\t".join(header)]
    for row in values:
        lines.append("\t".join("n/a" if np.isnan(v) else f"{v:.6f}" for v in row))
    path.write_text("\n".join(lines) + "\n")


def write_bids_dataset(
    root: str | Path,
    seed: int = 0,
    n_subjects: int = 2,
    n_runs: int = 2,
    *,
    n_volumes: int = 60,
    tr: float = 2.0,
    shape: tuple[int, int, int] = (6, 6, 4),
    n_factors: int = 2,
    physio_rate: float = 50.0,
    physio_start: float = -2.37,
    physio_tail: float = 3.1,
    rating_rate: float = 10.0,
    rating_start: float = 0.35,
    session: str | None = None,
) -> BidsTruth:
    """Write the synthetic dataset under ``root`` (created if needed) and return its truth.

    Args:
        root: folder to write into.
        seed: everything is deterministic given the seed.
        n_subjects: subjects ``01``, ``02``, ...
        n_runs: runs ``1``, ``2``, ... per subject.
        n_volumes: volumes per BOLD series; tr: RepetitionTime (s).
        shape: voxels of the image (x, y, slices); the mask is the image without its outer rim in x and y.
        n_factors: K latent factors.
        physio_rate: physiology sampling rate (Hz); physio_start: StartTime of subject 01 (subject ``s`` starts
            ``0.41 * s`` seconds earlier still); physio_tail: seconds recorded after the last volume's end.
        rating_rate: rating dial rate (Hz); rating_start: its StartTime (>= 0).
        session: a session label to put every file in ``ses-<label>``, or None for no session entity.
    """
    import nibabel as nib

    root = Path(root)
    rng = np.random.default_rng(seed)
    nx, ny, nz = shape
    subjects = tuple(f"{i + 1:02d}" for i in range(n_subjects))
    runs = tuple(str(r + 1) for r in range(n_runs))
    duration = n_volumes * tr
    slice_timing = tuple(float(v) for v in (np.argsort(np.r_[0:nz:2, 1:nz:2]) * tr / nz))  # interleaved
    affine = np.diag([3.0, 3.0, 3.0, 1.0])

    mask = np.zeros(shape, dtype=np.uint8)
    mask[1:nx - 1, 1:ny - 1, :] = 1
    atlas = np.zeros(shape, dtype=np.int16)
    xs, ys = np.meshgrid(np.arange(nx), np.arange(ny), indexing="ij")
    quadrant = 1 + (xs >= nx // 2).astype(int) + 2 * (ys >= ny // 2).astype(int)
    atlas[...] = quadrant[:, :, None] * mask
    n_parcels = 4
    synth = root / "derivatives" / "synth"
    mask_path = synth / "space-synth_desc-brain_mask.nii.gz"
    atlas_path = synth / "space-synth_dseg.nii.gz"
    synth.mkdir(parents=True, exist_ok=True)
    nib.save(nib.Nifti1Image(mask, affine), str(mask_path))
    nib.save(nib.Nifti1Image(atlas, affine), str(atlas_path))
    _json(synth / "dataset_description.json", {"Name": "synthetic mask and atlas", "BIDSVersion": "1.9.0",
                                               "DatasetType": "derivative",
                                               "GeneratedBy": [{"Name": "data_synth.bids"}]})

    _json(root / "dataset_description.json", {"Name": "msrm synthetic BIDS", "BIDSVersion": "1.9.0",
                                               "DatasetType": "raw"})
    _json(root / f"task-{TASK}_bold.json", {"TaskName": TASK, "RepetitionTime": tr,
                                            "SliceTiming": list(slice_timing)})
    fmriprep = root / "derivatives" / "fmriprep"
    _json(fmriprep / "dataset_description.json", {"Name": "fMRIPrep-style confounds", "BIDSVersion": "1.9.0",
                                                  "DatasetType": "derivative",
                                                  "GeneratedBy": [{"Name": "data_synth.bids"}]})

    # latents on a grid covering every sample written
    t_lo = physio_start - 0.41 * n_subjects - 2.0
    t_hi = duration + physio_tail + 2.0
    grid = np.arange(t_lo, t_hi + 0.5, 0.5)
    ells = np.geomspace(4.0, 10.0, n_factors)
    latent_times, latents = {}, {}
    for run in runs:
        Z = np.empty((grid.size, n_factors))
        for k, ell in enumerate(ells):
            C = matern_kernel(grid[:, None] - grid[None, :], ell, "matern32")
            C[np.diag_indices(grid.size)] += 1e-9
            Z[:, k] = np.linalg.cholesky(C) @ rng.standard_normal(grid.size)
        latent_times[run], latents[run] = grid, Z

    def z_at(run: str, t: np.ndarray) -> np.ndarray:
        return np.column_stack([np.interp(t, latent_times[run], latents[run][:, k]) for k in range(n_factors)])

    ses_dir = f"ses-{session}/" if session else ""
    ses_ent = f"_ses-{session}" if session else ""
    clocks, files, values, outliers = {}, {}, {}, {}
    phys_cols = ["cardiac", "respiratory", "trigger"]
    n_vox = int(mask.sum())
    for s_i, sub in enumerate(subjects):
        W = rng.standard_normal((n_vox, n_factors)) * 2.0
        w_phys = rng.standard_normal((2, n_factors))
        w_dial = rng.standard_normal(n_factors)
        for run in runs:
            stem = f"sub-{sub}{ses_ent}_task-{TASK}_run-{run}"
            func = root / f"sub-{sub}" / ses_dir / "func"
            deriv = fmriprep / f"sub-{sub}" / ses_dir / "func"

            # confounds
            n = n_volumes
            motion = np.cumsum(rng.normal(0, 0.05, (n, 6)), axis=0)
            fd = np.r_[np.nan, np.abs(np.diff(motion[:, :3], axis=0)).sum(axis=1)
                       + 50 * np.abs(np.diff(motion[:, 3:], axis=0)).sum(axis=1)]
            csf = rng.normal(0, 1, n)
            wm = rng.normal(0, 1, n)
            spikes = np.sort(rng.choice(np.arange(3, n - 3), size=2, replace=False))
            outliers[(sub, run)] = spikes
            spike_cols = np.zeros((n, 2))
            spike_cols[spikes, [0, 1]] = 1.0
            motion = np.round(motion, 6)
            csf = np.round(csf, 6)

            # BOLD
            vox = np.argwhere(mask > 0)
            data = rng.normal(0, 0.01, (nx, ny, nz, n)).astype(np.float64)
            t_vol = tr * np.arange(n)
            for v, (x, y, z) in enumerate(vox):
                zt = z_at(run, t_vol + slice_timing[z])
                data[x, y, z] = (100.0 + zt @ W[v] + 0.8 * motion[:, 0] + 0.5 * csf
                                 + rng.normal(0, 0.3, n))
            data[..., spikes] += 5.0 * (mask[..., None] > 0)
            data = data.astype(np.float32)
            bold = func / f"{stem}_bold.nii.gz"
            func.mkdir(parents=True, exist_ok=True)
            img = nib.Nifti1Image(data, affine)
            img.header.set_xyzt_units("mm", "sec")
            img.header["pixdim"][4] = tr
            nib.save(img, str(bold))
            glob_sig = np.array([data[..., i][mask > 0].mean() for i in range(n)], dtype=np.float64)
            conf = np.column_stack([motion, fd, csf, wm, glob_sig, spike_cols])
            conf_path = deriv / f"{stem}_desc-confounds_timeseries.tsv"
            _tsv(conf_path, ["trans_x", "trans_y", "trans_z", "rot_x", "rot_y", "rot_z", "framewise_displacement",
                             "csf", "white_matter", "global_signal", "motion_outlier00", "motion_outlier01"], conf)
            parcels = np.column_stack([data[atlas == p].mean(axis=0) for p in range(1, n_parcels + 1)])
            parc_path = deriv / f"{stem}_desc-parcels_timeseries.tsv"
            _tsv(parc_path, [f"parcel{p}" for p in range(1, n_parcels + 1)], parcels.astype(np.float64))
            _json(parc_path.with_suffix(".json"), {"RepetitionTime": tr,
                                                   "StartTime": float(np.median(slice_timing))})

            # physiology: starts before the first volume, ends after the last
            start = physio_start - 0.41 * s_i
            n_phys = int(np.floor((duration + physio_tail - start) * physio_rate))
            t = start + np.arange(n_phys) / physio_rate
            zt = z_at(run, t)
            trigger = np.zeros(n_phys)
            trigger[np.searchsorted(t, t_vol)] = 1.0
            phys = np.column_stack([zt @ w_phys[0] + rng.normal(0, 0.2, n_phys),
                                    zt @ w_phys[1] + rng.normal(0, 0.2, n_phys), trigger])
            phys = np.round(phys, 6)
            phys_path = func / f"{stem}_physio.tsv.gz"
            _tsv_gz(phys_path, phys)
            _json(phys_path.with_name(f"{stem}_physio.json"),
                  {"SamplingFrequency": physio_rate, "StartTime": start, "Columns": phys_cols})

            # rating dial: starts after the first volume, ends before the run does
            n_dial = int(np.floor((duration - 0.95 - rating_start) * rating_rate)) + 1
            t = rating_start + np.arange(n_dial) / rating_rate
            dial = np.round((z_at(run, t) @ w_dial + rng.normal(0, 0.1, n_dial))[:, None], 6)
            dial_path = func / f"{stem}_recording-dial_physio.tsv.gz"
            _tsv_gz(dial_path, dial)
            _json(dial_path.with_name(f"{stem}_recording-dial_physio.json"),
                  {"SamplingFrequency": rating_rate, "StartTime": rating_start, "Columns": ["rating"]})

            clocks[(sub, run, "physio")] = {"sampling_frequency": physio_rate, "start_time": start,
                                            "n_samples": n_phys}
            clocks[(sub, run, "dial")] = {"sampling_frequency": rating_rate, "start_time": rating_start,
                                          "n_samples": n_dial}
            files.update({(sub, run, "bold"): bold, (sub, run, "physio"): phys_path, (sub, run, "dial"): dial_path,
                          (sub, run, "confounds"): conf_path, (sub, run, "parcels"): parc_path})
            values[(sub, run, "physio")] = phys
            values[(sub, run, "dial")] = dial

    return BidsTruth(root=root, task=TASK, subjects=subjects, runs=runs, session=session, tr=tr,
                     n_volumes=n_volumes, slice_timing=slice_timing, mask=mask_path, atlas=atlas_path,
                     n_parcels=n_parcels, latent_times=latent_times, latents=latents, clocks=clocks, files=files,
                     values=values, columns={"physio": phys_cols, "dial": ["rating"]}, outliers=outliers)
