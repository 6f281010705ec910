"""Read recordings from a BIDS dataset into an :class:`msrm.Dataset`.

``load(root, task, modalities, masker=None, confounds=None, subjects=None, **options)`` finds every file of one
task, reads each modality's source for every (subject, session, run), puts each stream on its own clock on the
run's time axis and returns the dataset. Nothing is returned until every file has been read and every stream and
run has been validated; bad input raises ``ValueError`` (or ``FileNotFoundError`` for a missing file) whose
message names the file and the field or column. (The one lasting effect of a call that raises is on ``masker``: a
masker that was not fitted may have been fitted by then.)

Reader
------
A small reader of its own over :mod:`pathlib` rather than pybids: it only needs the files of one task, the BIDS
file-name grammar (``key-label`` entities joined by ``_``, a suffix, an extension) and the inheritance rule of
sidecars. pybids indexes the whole dataset into an SQL database first (slow on large datasets and derivatives
folders), brings a heavy dependency tree, and still leaves the timing rules below to the caller. The files looked
at are ``sub-*/<datatype>/*`` and ``sub-*/ses-*/<datatype>/*`` whose name carries ``task-<task>``, under
``root`` and under each derivatives dataset (``derivatives=``; by default every ``root/derivatives/<name>/``
holding a ``dataset_description.json``, e.g. fMRIPrep's output).

Runs and participants
---------------------
Participants are the subject labels without ``sub-``. A BIDS run of data is one (subject, session, task, run)
entity set; the returned dataset has one :class:`msrm.Run` per (session, run) pair found for the task (sorted,
numbers numerically, a missing entity first), holding the streams of every subject that has that run: subjects
watching the same stimulus share the run's time axis and therefore its latent factors. Within a subject, every
modality must have a file for every run of that subject (else ``ValueError``); a subject may lack a whole run.

Time axis: ``t = 0`` is the acquisition onset of the first volume of the run (the reference of BIDS ``StartTime``).

Sources (the values of ``modalities``)
--------------------------------------
``modalities`` maps a modality name to one source string or a list of them; the sources of one list become the
features of one stream, in order, and must end up on the same clock (``dt``, offset, sample count).
A source is ``[<filters>_]<kind>[:<argument>]``; ``<filters>`` are ``key-label`` entities the file must carry
(e.g. ``space-MNI152NLin2009cAsym_desc-preproc_bold`` when a dataset holds raw and preprocessed series; ``sub``,
``ses``, ``task`` and ``run`` are not filters). When one source matches several files of one run the call
raises, listing them, so that a filter can pick one.

* ``"bold"``: the BOLD series ``*_bold.nii[.gz]`` through ``masker`` (a nilearn ``NiftiMasker``,
  ``NiftiLabelsMasker`` or any masker with ``fit``/``transform``). A masker that is not fitted yet is fitted once
  (without images when it was given a mask, labels or maps image; otherwise on the first image read, subjects and
  runs in sorted order), then every image goes through ``transform``.
* ``"timeseries:<desc>"``: a precomputed table ``*_desc-<desc>_timeseries.tsv`` (header row; every column is a
  feature, e.g. parcels), one row per volume; its clock follows the BOLD clock rule below from its own
  sidecar (``RepetitionTime`` required).
* ``"physio:<column>"``: a column of the headerless ``*_physio.tsv.gz`` that has no ``recording`` entity;
  sidecar ``SamplingFrequency``, ``StartTime`` and ``Columns`` (whose length must equal the file's columns).
* ``"recording-<label>:<column>"`` (short for ``"recording-<label>_physio:<column>"``): the same from
  ``*_recording-<label>_physio.tsv.gz``, e.g. a continuous rating dial.
* ``"beh:<column>"``: a column of ``*_beh.tsv`` (header row). With ``SamplingFrequency`` and ``StartTime`` in its
  sidecar the rows are regular samples, read like physiology. A table with ``onset`` and ``duration`` columns is
  event-style instead (below); it needs no sidecar.
* ``"events:<column>"``: a column of ``*_events.tsv``, always event-style.

Sidecars follow the BIDS inheritance rule: a JSON file applies to a data file when it sits in the data file's
folder or a parent folder up to the dataset root, has the same suffix, and all its entities are entities of the
data file with the same labels. Values from deeper folders override those above; within one folder, a file with
more entities overrides one with fewer; two applicable files with as many entities in one folder raise. So the
sidecar of a run's plain physiology (``sub-01_task-x_run-1_physio.json``) also applies to that run's
``recording-<label>`` files: give those a sidecar of their own holding every field they need.
A data file with no applicable sidecar raises ``FileNotFoundError`` naming the sidecar expected beside it.

Rules
-----
* **BOLD clock.** ``dt = RepetitionTime``. The offset is the time a volume's sample stands for: the sidecar's
  ``StartTime`` when present (BIDS derivatives: fMRIPrep sets it to the reference time of its slice-timing
  correction; ``SliceTimingCorrected: true`` without ``StartTime`` raises); otherwise the median of
  ``SliceTiming`` (half of the slices have been acquired by then; the mask mixes slices, so no single slice time is
  right); otherwise 0 (volume onset). ``SliceTiming`` must have one entry per slice along
  ``SliceEncodingDirection`` (default ``k``) and entries in ``[0, RepetitionTime)``.
* **Run duration.** With a BOLD-derived source (``bold``, ``timeseries``): ``n_volumes * RepetitionTime``, the
  largest over the run's subjects and BOLD sources. Without: the end of the longest stream, ``offset + n * dt``
  after the start rule below (``n * dt`` is also what a BOLD series of ``n`` volumes spans). Every stream is then
  cut to ``[0, duration]``.
* **Samples before the first volume** (negative ``StartTime``) are dropped: with ``k`` the first sample index whose
  time ``StartTime + k / SamplingFrequency`` is ``>= 0``, the stream starts at row ``k`` and its offset is that
  time. A positive ``StartTime`` is the offset as is. **Samples after the run's end** (time ``> duration``) are
  dropped. A source with no sample inside the run raises.
* **Downsampling** (``physio_rate=``): block means. The block size ``m = SamplingFrequency / rate`` must be an
  integer (to 1e-9 relative). Blocks of ``m`` consecutive kept samples start at the first kept sample; a trailing
  partial block is dropped; a block's value is the mean of its non-missing samples (NaN when all are missing) and
  its time is the mean of its samples' times, so ``dt = m / SamplingFrequency`` and the offset moves by
  ``(m - 1) / (2 * SamplingFrequency)``. A number applies to every ``physio``/``recording`` source sampled faster
  than it; a dict ``{modality: rate}`` applies to the named modalities' sampled sources (physio, recording,
  sampled beh).
* **Confounds** (``confounds=``, names or ``fnmatch`` patterns of columns of fMRIPrep's
  ``*_desc-confounds_timeseries.tsv``, or the older ``*_desc-confounds_regressors.tsv``): regressed out of the
  BOLD-derived sources by nilearn: for ``bold`` through ``masker.transform(img, confounds=..., sample_mask=...)``
  (so the masker's own cleaning settings apply in the same nilearn call), for ``timeseries`` through
  ``nilearn.signal.clean(values, confounds=..., sample_mask=..., detrend=False, standardize=None,
  standardize_confounds=True, filter=False)``. Confounds are standardised (nilearn's default), so the series'
  mean is kept. A missing value in the first row (fMRIPrep's derivative columns and ``framewise_displacement``)
  takes the second row's value, as nilearn's fMRIPrep loader does; any other missing value raises. An exact name
  that is not a column raises; a pattern may match nothing.
* **Scrubbing.** Selected columns named ``motion_outlier*`` or ``non_steady_state_outlier*`` (fMRIPrep's one-hot
  spike regressors) are not regressed: the volumes they flag become NaN rows and are left out of the regression
  (nilearn's ``sample_mask``; this is what regressing the spikes would do to the other volumes). ``scrub=`` (a
  number, millimetres) also flags every volume whose ``framewise_displacement`` exceeds it (the first volume's
  missing value counts as 0). Scrubbing every volume raises.
* **Event-style tables** (``events``, ``beh`` with ``onset``/``duration``): put on the regular clock
  ``t_i = i / event_rate`` (``event_rate=`` in Hz, required for such sources) for every ``t_i`` in
  ``[0, duration]``; a sample's value is the mean of ``<column>`` over the events with
  ``onset <= t_i < onset + duration`` (a zero-duration event covers no sample), NaN when none does. The end of the
  last event counts as the source's end for the run-duration rule.

nibabel and nilearn are imported inside the functions that need them (``pip install 'msrm[bids]'``); importing
:mod:`msrm` or this module imports neither.
"""
from __future__ import annotations

import fnmatch
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from .data import Dataset, Run, Stream

__all__ = ["load", "parse_filename", "sidecar"]

# Sample times may overshoot a boundary by this much (floating error of offset + i * dt), relative to max(1, |t|).
_TOL = 1e-9

_KINDS = {
    # kind: (suffix, extensions, argument required)
    "bold": ("bold", (".nii.gz", ".nii"), False),
    "timeseries": ("timeseries", (".tsv",), True),
    "physio": ("physio", (".tsv.gz",), True),
    "beh": ("beh", (".tsv",), True),
    "events": ("events", (".tsv",), True),
}
_RUN_ENTITIES = ("sub", "ses", "task", "run")
_SCRUB_PREFIXES = ("motion_outlier", "non_steady_state_outlier")
_ENTITY = re.compile(r"^([a-zA-Z0-9]+)-([a-zA-Z0-9]+)$")
_NAME = re.compile(r"^(?P<stem>[^.]+)(?P<ext>\..+)?$")


# ---------------------------------------------------------------------------------------------------------------
# file names and sidecars


def parse_filename(name: str) -> tuple[dict[str, str], str, str] | None:
    """``(entities, suffix, extension)`` of a BIDS file name, or None when the name does not follow the grammar.

    ``"sub-01_task-x_run-1_bold.nii.gz"`` -> ``({"sub": "01", "task": "x", "run": "1"}, "bold", ".nii.gz")``.
    """
    m = _NAME.match(name)
    if m is None:
        return None
    parts = m.group("stem").split("_")
    suffix = parts[-1]
    if not suffix or not suffix.isalnum():
        return None
    entities: dict[str, str] = {}
    for part in parts[:-1]:
        e = _ENTITY.match(part)
        if e is None or e.group(1) in entities:
            return None
        entities[e.group(1)] = e.group(2)
    return entities, suffix, m.group("ext") or ""


def sidecar(path: str | Path, dataset_root: str | Path) -> tuple[dict[str, Any], list[Path]]:
    """Merged JSON metadata of a data file by the BIDS inheritance rule, and the sidecars read (top first).

    Raises:
        FileNotFoundError: no sidecar applies (names the sidecar expected beside the data file).
        ValueError: two sidecars with as many entities apply in one folder, or a sidecar is not a JSON object.
    """
    return _sidecar(Path(path), Path(dataset_root), {})


def _sidecar(path: Path, dataset_root: Path, cache: dict) -> tuple[dict[str, Any], list[Path]]:
    parsed = parse_filename(path.name)
    if parsed is None:
        raise ValueError(f"{path}: not a BIDS file name")
    entities, suffix, _ = parsed
    dirs = [dataset_root]
    try:
        rel = path.parent.relative_to(dataset_root)
    except ValueError:
        rel = Path()
    for part in rel.parts:
        dirs.append(dirs[-1] / part)
    chain: list[Path] = []
    for d in dirs:
        level = []
        for j in _json_files(d, cache):
            p = parse_filename(j.name)
            if p is None or p[1] != suffix or p[2] != ".json":
                continue
            if all(entities.get(k) == v for k, v in p[0].items()):
                level.append((len(p[0]), j))
        level.sort(key=lambda x: x[0])
        for (n1, a), (n2, b) in zip(level, level[1:]):
            if n1 == n2:
                raise ValueError(f"{path}: two sidecars apply at one level of the hierarchy, {a} and {b}; "
                                 f"BIDS allows one per folder for each entity count")
        chain.extend(j for _, j in level)
    if not chain:
        expected = path.with_name(path.name[: len(path.name) - len(parsed[2])] + ".json")
        inherited = dataset_root / f"task-{entities.get('task', '<task>')}_{suffix}.json"
        raise FileNotFoundError(f"{path}: no JSON sidecar applies to it (expected {expected} or an inherited "
                                f"one such as {inherited})")
    meta: dict[str, Any] = {}
    for j in chain:
        try:
            with open(j) as fh:
                content = json.load(fh)
        except json.JSONDecodeError as e:
            raise ValueError(f"{j}: not valid JSON ({e})") from None
        if not isinstance(content, dict):
            raise ValueError(f"{j}: a sidecar must hold a JSON object")
        meta.update(content)
    return meta, chain


def _json_files(d: Path, cache: dict) -> list[Path]:
    if d not in cache:
        cache[d] = sorted(p for p in d.glob("*.json") if p.is_file()) if d.is_dir() else []
    return cache[d]


def _field(meta: dict, name: str, path: Path, chain: list[Path], *, positive: bool = False) -> float:
    """A finite number from the sidecar (``> 0`` when ``positive``), or ValueError naming the file and field."""
    where = ", ".join(str(c) for c in chain)
    if name not in meta:
        raise ValueError(f"{path}: sidecar field {name!r} is missing (sidecars read: {where})")
    v = meta[name]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (positive and v <= 0):
        need = "a finite number > 0" if positive else "a finite number"
        raise ValueError(f"{path}: sidecar field {name!r} must be {need}, got {v!r} (sidecars read: {where})")
    return float(v)


# ---------------------------------------------------------------------------------------------------------------
# sources


@dataclass(frozen=True)
class _Source:
    text: str
    modality: str
    kind: str
    filters: tuple[tuple[str, str], ...]
    arg: str | None

    @property
    def suffix(self) -> str:
        return _KINDS[self.kind][0]

    def matches(self, entities: dict, suffix: str, ext: str) -> bool:
        if suffix != self.suffix or ext not in _KINDS[self.kind][1]:
            return False
        if any(entities.get(k) != v for k, v in self.filters):
            return False
        if self.kind == "physio" and "recording" in entities and "recording" not in dict(self.filters):
            return False
        if self.kind == "timeseries" and entities.get("desc") != self.arg:
            return False
        return True


def _parse_source(text: Any, modality: str) -> _Source:
    if not isinstance(text, str) or not text:
        raise ValueError(f"modality {modality!r}: a source must be a non-empty string, got {text!r}")
    head, sep, arg = text.partition(":")
    tokens = head.split("_")
    if _ENTITY.match(tokens[-1]):  # only entities, e.g. "recording-dial": short for "<entities>_physio"
        kind, entity_tokens = "physio", tokens
        if not any(t.startswith("recording-") for t in tokens):
            raise ValueError(f"modality {modality!r}: source {text!r} names no kind; write e.g. 'bold', "
                             f"'physio:<column>' or 'recording-<label>:<column>'")
    else:
        kind, entity_tokens = tokens[-1], tokens[:-1]
    filters = []
    for tok in entity_tokens:
        e = _ENTITY.match(tok)
        if e is None:
            raise ValueError(f"modality {modality!r}: source {text!r}: {tok!r} is not a key-label entity")
        filters.append((e.group(1), e.group(2)))
    if kind not in _KINDS:
        raise ValueError(f"modality {modality!r}: source {text!r}: unknown kind {kind!r}; known kinds are "
                         f"{sorted(_KINDS)} (and 'recording-<label>:<column>')")
    keys = [k for k, _ in filters]
    bad = [k for k in keys if k in _RUN_ENTITIES] + [k for k in set(keys) if keys.count(k) > 1]
    if bad:
        raise ValueError(f"modality {modality!r}: source {text!r}: entity {bad[0]!r} cannot be a filter "
                         f"(sub, ses, task and run identify the run; each entity at most once)")
    needs_arg = _KINDS[kind][2]
    if needs_arg and not arg:
        what = "<desc>" if kind == "timeseries" else "<column>"
        raise ValueError(f"modality {modality!r}: source {text!r} needs ':{what}' ({kind}:{what})")
    if not needs_arg and sep:
        raise ValueError(f"modality {modality!r}: source {text!r}: {kind!r} takes no ':' argument")
    return _Source(text, modality, kind, tuple(filters), arg or None)


# ---------------------------------------------------------------------------------------------------------------
# pieces: what one source gives for one subject and run, before the run's duration is known


@dataclass
class _Piece:
    source: _Source
    path: Path
    values: np.ndarray | None = None     # (n, f) rows; None for event tables until sampled
    dt: float = 0.0
    start: float = 0.0                   # time of row 0 on the run's axis
    volumes: bool = False                # BOLD-derived: fixes the run's duration
    block: int = 1                       # downsampling block size
    events: tuple | None = None          # (onset, duration, value) arrays of an event table

    def first_kept(self) -> int:
        """Index of the first row at time >= 0."""
        if self.volumes or self.start >= 0:
            return 0
        k = math.ceil(-self.start / self.dt - _TOL)
        return max(k, 0)

    def end(self) -> float:
        """Where the piece ends for the run-duration rule."""
        if self.events is not None:
            onset, dur, _ = self.events
            return float(np.max(onset + dur)) if onset.size else 0.0
        if self.volumes:
            return self.values.shape[0] * self.dt
        k = self.first_kept()
        return self.start + k * self.dt + (self.values.shape[0] - k) * self.dt

    def finish(self, duration: float, event_rate: float | None) -> tuple[float, float, np.ndarray]:
        """(dt, offset, values) inside [0, duration] by the module's rules."""
        tol = _TOL * max(1.0, duration)
        if self.events is not None:
            dt = 1.0 / event_rate
            n = int(math.floor(duration / dt + _TOL)) + 1
            t = dt * np.arange(n)
            onset, dur, value = self.events
            total = np.zeros(n)
            count = np.zeros(n)
            for o, d, v in zip(onset, dur, value):
                if not (d > 0) or np.isnan(v):
                    continue
                i0 = np.searchsorted(t, o, side="left")
                i1 = np.searchsorted(t, o + d, side="left")
                total[i0:i1] += v
                count[i0:i1] += 1
            with np.errstate(invalid="ignore", divide="ignore"):
                vals = np.where(count > 0, total / np.maximum(count, 1), np.nan)
            return dt, 0.0, vals[:, None]
        if self.volumes:
            last = self.start + (self.values.shape[0] - 1) * self.dt
            if last > duration + tol:  # cannot happen with the duration rule; kept as a guard
                raise ValueError(f"{self.path}: last volume at {last:.6g} s is after the run's end {duration:.6g} s")
            return self.dt, self.start, self.values
        k = self.first_kept()
        offset = self.start + k * self.dt
        if offset < 0:  # k was chosen so that offset >= -_TOL * dt: floating error of StartTime + k * dt
            offset = 0.0
        n_rows = self.values.shape[0] - k
        n_in = int(math.floor((duration + tol - offset) / self.dt)) + 1 if offset <= duration + tol else 0
        n = min(n_rows, n_in)
        if n <= 0:
            raise ValueError(f"{self.path}: no sample inside the run [0, {duration:.6g}] s (StartTime "
                             f"{self.start:.6g} s, {self.values.shape[0]} samples at {1 / self.dt:.6g} Hz)")
        vals = self.values[k:k + n]
        dt = self.dt
        if self.block > 1:
            m = self.block
            nb = n // m
            if nb == 0:
                raise ValueError(f"{self.path}: {n} samples inside the run, fewer than one block of {m} for the "
                                 f"requested downsampling")
            blocks = vals[: nb * m].reshape(nb, m, vals.shape[1])
            obs = ~np.isnan(blocks)
            cnt = obs.sum(axis=1)
            sums = np.where(obs, blocks, 0.0).sum(axis=1)
            with np.errstate(invalid="ignore", divide="ignore"):
                vals = np.where(cnt > 0, sums / np.maximum(cnt, 1), np.nan)
            offset = offset + (m - 1) * dt / 2.0
            dt = m * dt
        return dt, offset, vals


# ---------------------------------------------------------------------------------------------------------------
# the entry point


def load(
    root: str | Path,
    task: str,
    modalities: Mapping[str, str | Iterable[str]],
    masker: Any = None,
    confounds: Iterable[str] | None = None,
    subjects: Iterable[str] | None = None,
    *,
    physio_rate: float | Mapping[str, float] | None = None,
    scrub: float | None = None,
    event_rate: float | None = None,
    derivatives: Iterable[str | Path] | None = None,
) -> Dataset:
    """Read one task of a BIDS dataset into an :class:`msrm.Dataset` (rules in the module docstring).

    Args:
        root: the BIDS dataset's root folder.
        task: the task label (without ``task-``).
        modalities: modality name -> source string or list of source strings (module docstring).
        masker: a nilearn masker for ``"bold"`` sources (fitted on the first image when not fitted yet).
        confounds: confound column names or ``fnmatch`` patterns regressed out of BOLD-derived sources;
            ``motion_outlier*`` columns among them scrub volumes (NaN rows) instead.
        subjects: subject labels to read (with or without ``sub-``); default every subject with files for the task.
        physio_rate: downsample by block means to this rate in Hz (a number: every physio/recording source faster
            than it; a dict: per modality).
        scrub: flag volumes with ``framewise_displacement`` above this many millimetres as NaN rows.
        event_rate: sampling rate in Hz of the clock event-style tables are put on (required for them).
        derivatives: derivatives dataset folders searched besides ``root``; default every
            ``root/derivatives/*/`` holding a ``dataset_description.json``.

    Returns:
        the dataset: one run per (session, run), streams keyed ``"<subject>/<modality>"``.
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"BIDS root {root} is not a folder")
    if not isinstance(task, str) or not task or not task.isalnum():
        raise ValueError(f"task must be a BIDS label (letters and digits, without 'task-'), got {task!r}")
    sources = _parse_modalities(modalities)
    all_sources = [s for ss in sources.values() for s in ss]
    conf_names = _check_volume_options(all_sources, masker, confounds, scrub)
    rates = _check_rates(physio_rate, sources)
    if event_rate is not None:
        if isinstance(event_rate, bool) or not isinstance(event_rate, (int, float)) or \
                not (math.isfinite(event_rate) and event_rate > 0):
            raise ValueError(f"event_rate must be a finite number of Hz > 0, got {event_rate!r}")
    deriv = _derivative_roots(root, derivatives)
    index, found_subjects = _index_task(root, deriv, task)
    subs = _pick_subjects(subjects, found_subjects, root, task)
    located, runs_of, by_subject = _locate(index, subs, all_sources)
    run_keys = sorted({rk for s in subs for rk in runs_of[s]}, key=_run_sort)
    if not run_keys:
        wanted = ", ".join(s.text for s in all_sources)
        raise FileNotFoundError(f"{root}: task {task!r} has files, but none for the sources {wanted} "
                                f"(subjects {subs})")
    # read every piece; nothing is returned before all are read and validated
    pieces = _read_pieces(run_keys, subs, runs_of, sources, located, by_subject, masker, conf_names, scrub, rates,
                          event_rate)
    runs = []
    for rk in run_keys:
        subs_here = [s for s in subs if rk in runs_of[s]]
        plist = [p for s in subs_here for ps in pieces[(rk, s)].values() for p in ps]
        vol = [p for p in plist if p.volumes]
        duration = max(p.end() for p in (vol or plist))
        if not (duration > 0):
            raise ValueError(f"{_run_name(rk)}: no sample after the first volume's onset in any file "
                             f"({[str(p.path) for p in plist]}); the run has no duration")
        streams = [_stream(sub, rk, mod, ps, duration, event_rate)
                   for sub in subs_here for mod, ps in pieces[(rk, sub)].items()]
        try:
            runs.append(Run(duration=duration, streams=streams))
        except ValueError as e:
            raise ValueError(f"{_run_name(rk)} of task {task!r}: {e}") from None
    return Dataset(runs)


def _parse_modalities(modalities) -> dict[str, list[_Source]]:
    """Check ``modalities`` (modality name -> source string or list/tuple of them) and parse it into modality name
    -> its sources, in the given order."""
    if not isinstance(modalities, Mapping) or not modalities:
        raise ValueError("modalities must be a non-empty mapping of modality name -> source string(s)")
    sources: dict[str, list[_Source]] = {}
    for mod, spec in modalities.items():
        if not isinstance(mod, str) or not mod or "/" in mod:
            raise ValueError(f"modality name must be a non-empty string without '/', got {mod!r}")
        items = [spec] if isinstance(spec, str) else list(spec) if isinstance(spec, (list, tuple)) else None
        if not items:
            raise ValueError(f"modality {mod!r}: give a source string or a non-empty list of them, got {spec!r}")
        sources[mod] = [_parse_source(s, mod) for s in items]
    return sources


def _check_volume_options(all_sources: list[_Source], masker, confounds, scrub) -> list[str]:
    """Check ``masker`` (needed by 'bold' sources), ``confounds`` and ``scrub`` (which need a 'bold' or
    'timeseries:' source); returns the confound names or patterns (a single string becomes a list of one)."""
    has_bold = any(s.kind == "bold" for s in all_sources)
    has_volumes = any(s.kind in ("bold", "timeseries") for s in all_sources)
    if has_bold and masker is None:
        raise ValueError("a 'bold' source needs masker= (a nilearn NiftiMasker or NiftiLabelsMasker)")
    if has_bold and not (hasattr(masker, "transform") and hasattr(masker, "fit")):
        raise ValueError(f"masker must have fit() and transform() (a nilearn masker), got {type(masker).__name__}")
    conf_names: list[str] = []
    if confounds is not None:
        if isinstance(confounds, str):
            confounds = [confounds]
        conf_names = list(confounds)
        if not all(isinstance(c, str) and c for c in conf_names):
            raise ValueError(f"confounds must be a list of column names, got {confounds!r}")
    if scrub is not None:
        if isinstance(scrub, bool) or not isinstance(scrub, (int, float)) or not (math.isfinite(scrub) and scrub > 0):
            raise ValueError(f"scrub must be a framewise-displacement threshold in mm (> 0), got {scrub!r}")
    if (conf_names or scrub is not None) and not has_volumes:
        raise ValueError("confounds= and scrub= apply to 'bold' and 'timeseries:' sources; modalities has none")
    return conf_names


def _derivative_roots(root: Path, derivatives) -> list[Path]:
    """The derivatives dataset folders searched besides ``root``: the given ones (each must be a folder), or by
    default every ``root/derivatives/*/`` holding a ``dataset_description.json``, sorted."""
    if derivatives is None:
        dd = root / "derivatives"
        return sorted(p for p in dd.iterdir() if (p / "dataset_description.json").is_file()) if dd.is_dir() else []
    deriv = [Path(d) for d in ([derivatives] if isinstance(derivatives, (str, Path)) else derivatives)]
    for d in deriv:
        if not d.is_dir():
            raise FileNotFoundError(f"derivatives folder {d} is not a folder")
    return deriv


def _index_task(root: Path, deriv: list[Path], task: str) -> tuple[list[tuple], list[str]]:
    """``(index, subjects)``: a row ``(path, dataset root, entities, suffix, ext)`` for every file of the task under
    ``root`` and the derivatives folders, sorted by path, and the subject labels found (natural order)."""
    index = []
    for base in [root, *deriv]:
        for pattern in ("sub-*/*/*", "sub-*/ses-*/*/*"):
            for p in base.glob(pattern):
                if f"task-{task}_" not in p.name or not p.is_file():
                    continue
                parsed = parse_filename(p.name)
                if parsed is None or parsed[0].get("task") != task or "sub" not in parsed[0]:
                    continue
                index.append((p, base, *parsed))
    index.sort(key=lambda r: str(r[0]))
    found_subjects = sorted({e["sub"] for _, _, e, _, _ in index}, key=_natural)
    if not index:
        raise FileNotFoundError(f"{root}: no files for task {task!r} (looked for sub-*/[ses-*/]<datatype>/"
                                f"*_task-{task}_* under {', '.join(str(b) for b in [root, *deriv])})")
    return index, found_subjects


def _pick_subjects(subjects, found_subjects: list[str], root: Path, task: str) -> list[str]:
    """The subject labels to read (without ``sub-``): every one found when ``subjects`` is None, else the given
    ones, each of which must have files for the task."""
    if subjects is None:
        return found_subjects
    if isinstance(subjects, str):
        subjects = [subjects]
    subs = [s[4:] if isinstance(s, str) and s.startswith("sub-") else s for s in subjects]
    for s in subs:
        if not isinstance(s, str) or s not in found_subjects:
            raise ValueError(f"{root}: subject {s!r} has no files for task {task!r}; subjects with files: "
                             f"{found_subjects}")
    return subs


def _locate(index: list[tuple], subs: list[str], all_sources: list[_Source]) -> tuple[dict, dict, dict]:
    """Find the one file of every (subject, run, source): returns ``located`` ((subject, run key) -> source ->
    (path, dataset root)), ``runs_of`` (subject -> its run keys) and ``by_subject`` (subject -> its index rows).
    Raises when a source matches several files of a run, or when a run of a subject lacks a file for a source
    that another source of that run has."""
    located: dict[tuple[str, tuple], dict[_Source, tuple[Path, Path]]] = {}
    runs_of: dict[str, set[tuple]] = {s: set() for s in subs}
    by_subject: dict[str, list] = {}
    for row in index:
        by_subject.setdefault(row[2]["sub"], []).append(row)
    for src in all_sources:
        for sub in subs:
            hits: dict[tuple, list[tuple[Path, Path]]] = {}
            for p, base, ents, suffix, ext in by_subject.get(sub, ()):
                if src.matches(ents, suffix, ext):
                    hits.setdefault((ents.get("ses"), ents.get("run")), []).append((p, base))
            for rk, files in hits.items():
                if len(files) > 1:
                    raise ValueError(f"modality {src.modality!r}: source {src.text!r} matches {len(files)} files "
                                     f"for sub-{sub} {_run_name(rk)}: {[str(f) for f, _ in files]}; add entity "
                                     f"filters to the source (e.g. 'desc-preproc_bold') to pick one")
                located.setdefault((sub, rk), {})[src] = files[0]
                runs_of[sub].add(rk)
    for sub in subs:
        for rk in sorted(runs_of[sub], key=_run_sort):
            have = located[(sub, rk)]
            for src in all_sources:
                if src not in have:
                    other = next(iter(have.values()))[0]
                    raise ValueError(f"sub-{sub} {_run_name(rk)}: no file for modality {src.modality!r} "
                                     f"(source {src.text!r}, a *_{src.suffix}{_KINDS[src.kind][1][0]} file) while "
                                     f"other modalities have one, e.g. {other}")
    return located, runs_of, by_subject


def _read_pieces(run_keys, subs, runs_of, sources, located, by_subject, masker, conf_names, scrub, rates,
                 event_rate) -> dict[tuple[tuple, str], dict[str, list[_Piece]]]:
    """Read every located file: (run key, subject) -> modality -> its pieces, in source order. Runs, then subjects,
    then sources are read in order, so an unfitted masker is fitted on the first image; a subject's confounds are
    found once per run, on its first 'bold' or 'timeseries:' source, and only when confounds or scrub are asked."""
    cache: dict = {}
    state = {"masker_ready": None}
    pieces: dict[tuple[tuple, str], dict[str, list[_Piece]]] = {}
    for rk in run_keys:
        for sub in subs:
            if rk not in runs_of[sub]:
                continue
            conf = None
            for mod, srcs in sources.items():
                for src in srcs:
                    path, base = located[(sub, rk)][src]
                    if src.kind in ("bold", "timeseries") and (conf_names or scrub is not None) and conf is None:
                        conf = _find_confounds(by_subject[sub], sub, rk, conf_names, scrub)
                    piece = _read(src, path, base, cache, masker, conf, state, rates.get(src, None), event_rate)
                    pieces.setdefault((rk, sub), {}).setdefault(mod, []).append(piece)
    return pieces


def _stream(sub: str, rk: tuple, mod: str, ps: list[_Piece], duration: float, event_rate) -> Stream:
    """One subject's stream of one modality in run ``rk``: its pieces put on their clocks over ``duration``
    seconds, which must agree (dt, offset, sample count), and their (T, F_i) values joined along the features."""
    clocks = [p.finish(duration, event_rate) for p in ps]
    dt0, off0, v0 = clocks[0]
    for p, (dt, off, v) in zip(ps[1:], clocks[1:]):
        if abs(dt - dt0) > 1e-12 * dt0 or abs(off - off0) > _TOL or v.shape[0] != v0.shape[0]:
            raise ValueError(
                f"sub-{sub} {_run_name(rk)} modality {mod!r}: sources on different clocks, "
                f"{ps[0].path} (dt {dt0:.9g} s, offset {off0:.9g} s, {v0.shape[0]} samples) and "
                f"{p.path} (dt {dt:.9g} s, offset {off:.9g} s, {v.shape[0]} samples); give them to "
                f"separate modalities")
    values = np.concatenate([v for _, _, v in clocks], axis=1)
    try:
        return Stream(sub, mod, dt0, values, offset=off0)
    except ValueError as e:
        raise ValueError(f"{', '.join(str(p.path) for p in ps)}: {e}") from None


def _check_rates(physio_rate, sources: dict[str, list[_Source]]) -> dict[_Source, tuple[float, bool]]:
    """source -> (rate, strict): strict rates (per modality) must not exceed the source's own rate."""
    out: dict[_Source, tuple[float, bool]] = {}
    if physio_rate is None:
        return out

    def check(v, what):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
            raise ValueError(f"physio_rate{what} must be a rate in Hz (> 0), got {v!r}")
        return float(v)

    if isinstance(physio_rate, Mapping):
        for mod, v in physio_rate.items():
            if mod not in sources:
                raise ValueError(f"physio_rate names modality {mod!r}, which is not in modalities "
                                 f"({list(sources)})")
            rate = check(v, f"[{mod!r}]")
            for s in sources[mod]:
                if s.kind not in ("physio", "beh"):
                    raise ValueError(f"physio_rate[{mod!r}]: source {s.text!r} is not a sampled recording "
                                     f"(physio, recording or beh)")
                out[s] = (rate, True)
    else:
        rate = check(physio_rate, "")
        for ss in sources.values():
            for s in ss:
                if s.kind == "physio":
                    out[s] = (rate, False)
    return out


def _natural(label):
    return (0, int(label), "") if label.isdigit() else (1, 0, label)


def _run_sort(rk):
    return tuple((-1, 0, "") if x is None else _natural(x) for x in rk)


def _run_name(rk) -> str:
    ses, run = rk
    parts = ([f"ses-{ses}"] if ses is not None else []) + ([f"run-{run}"] if run is not None else [])
    return " ".join(parts) if parts else "(no session or run entity)"


# ---------------------------------------------------------------------------------------------------------------
# readers


def _read_table(path: Path, header: bool):
    import pandas as pd

    try:
        return pd.read_csv(path, sep="\t", header=0 if header else None, na_values=["n/a"])
    except Exception as e:  # pandas' parser errors name neither file nor cause consistently
        raise ValueError(f"{path}: cannot read the table ({type(e).__name__}: {e})") from None


def _numeric_column(df, column: str, path: Path) -> np.ndarray:
    import pandas as pd

    try:
        return pd.to_numeric(df[column], errors="raise").to_numpy(dtype=np.float64)
    except (ValueError, TypeError):
        raise ValueError(f"{path}: column {column!r} holds values that are not numbers") from None


def _read(src: _Source, path: Path, base: Path, cache, masker, conf, state, rate, event_rate) -> _Piece:
    if src.kind == "bold":
        return _read_bold(src, path, base, cache, masker, conf, state)
    if src.kind == "timeseries":
        return _read_timeseries(src, path, base, cache, conf)
    if src.kind == "events":
        return _read_events(src, path, event_rate)
    if src.kind == "beh":
        df = _read_table(path, header=True)
        if src.arg not in df.columns:
            raise ValueError(f"{path}: no column {src.arg!r}; columns are {list(df.columns)}")
        if "onset" in df.columns and "duration" in df.columns:
            return _read_events(src, path, event_rate, df)
        meta, chain = _sidecar(path, base, cache)
        fs = _field(meta, "SamplingFrequency", path, chain, positive=True)
        start = _field(meta, "StartTime", path, chain)
        values = _numeric_column(df, src.arg, path)[:, None]
        return _sampled(src, path, values, fs, start, rate, "SamplingFrequency")
    # physio / recording
    meta, chain = _sidecar(path, base, cache)
    fs = _field(meta, "SamplingFrequency", path, chain, positive=True)
    start = _field(meta, "StartTime", path, chain)
    cols = meta.get("Columns")
    if cols is None:
        raise ValueError(f"{path}: sidecar field 'Columns' is missing (sidecars read: "
                         f"{', '.join(str(c) for c in chain)})")
    if not isinstance(cols, list) or not all(isinstance(c, str) for c in cols):
        raise ValueError(f"{path}: sidecar field 'Columns' must be a list of column names, got {cols!r}")
    if src.arg not in cols:
        raise ValueError(f"{path}: no column {src.arg!r} (sidecar field 'Columns' lists {cols})")
    df = _read_table(path, header=False)
    if df.shape[1] != len(cols):
        raise ValueError(f"{path}: {df.shape[1]} columns in the file but sidecar field 'Columns' lists "
                         f"{len(cols)} ({cols})")
    if df.shape[0] == 0:
        raise ValueError(f"{path}: no rows")
    values = _numeric_column(df.set_axis(cols, axis=1), src.arg, path)[:, None]
    return _sampled(src, path, values, fs, start, rate, "SamplingFrequency")


def _sampled(src, path, values, fs, start, rate, fs_field) -> _Piece:
    block = 1
    if rate is not None:
        target, strict = rate
        if target < fs * (1 - 1e-12) or strict:
            ratio = fs / target
            block = int(round(ratio))
            if block < 1 or abs(ratio - block) > 1e-9 * ratio:
                raise ValueError(f"{path}: {fs_field} {fs:g} Hz is not an integer multiple of physio_rate "
                                 f"{target:g} Hz (block means need a whole number of samples per block)")
    return _Piece(src, path, values=values, dt=1.0 / fs, start=start, block=block)


def _read_events(src: _Source, path: Path, event_rate, df=None) -> _Piece:
    if df is None:
        df = _read_table(path, header=True)
        if src.arg not in df.columns:
            raise ValueError(f"{path}: no column {src.arg!r}; columns are {list(df.columns)}")
    for c in ("onset", "duration"):
        if c not in df.columns:
            raise ValueError(f"{path}: event-style table has no column {c!r}; columns are {list(df.columns)}")
    if event_rate is None:
        raise ValueError(f"{path}: event-style table (onset, duration); pass event_rate= (Hz) to put "
                         f"column {src.arg!r} on a regular clock")
    onset = _numeric_column(df, "onset", path)
    dur = _numeric_column(df, "duration", path)
    if np.isnan(onset).any():
        raise ValueError(f"{path}: column 'onset' has missing values")
    if (np.nan_to_num(dur, nan=0.0) < 0).any():
        raise ValueError(f"{path}: column 'duration' has negative values")
    value = _numeric_column(df, src.arg, path)
    return _Piece(src, path, events=(onset, np.nan_to_num(dur, nan=0.0), value))


def _volume_offset(meta: dict, path: Path, chain: list[Path], tr: float, shape: tuple | None) -> float:
    where = ", ".join(str(c) for c in chain)
    if "StartTime" in meta:
        start = _field(meta, "StartTime", path, chain)
        if not (0 <= start < tr):
            raise ValueError(f"{path}: sidecar field 'StartTime' {start!r} must lie in [0, RepetitionTime={tr:g})")
        return start
    if meta.get("SliceTimingCorrected") is True:
        raise ValueError(f"{path}: sidecar field 'StartTime' is missing while 'SliceTimingCorrected' is true "
                         f"(BIDS requires it then; sidecars read: {where})")
    st = meta.get("SliceTiming")
    if st is None:
        return 0.0
    try:
        st = np.asarray(st, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{path}: sidecar field 'SliceTiming' must be a list of numbers") from None
    if st.ndim != 1 or st.size == 0 or not np.isfinite(st).all():
        raise ValueError(f"{path}: sidecar field 'SliceTiming' must be a non-empty list of finite numbers")
    if shape is not None:
        direction = str(meta.get("SliceEncodingDirection", "k"))
        axis = {"i": 0, "j": 1, "k": 2}.get(direction[:1])
        if axis is None:
            raise ValueError(f"{path}: sidecar field 'SliceEncodingDirection' {direction!r} is not i, j or k")
        if st.size != shape[axis]:
            raise ValueError(f"{path}: sidecar field 'SliceTiming' has {st.size} entries but the image has "
                             f"{shape[axis]} slices along {direction[:1]}")
    if (st < 0).any() or (st >= tr).any():
        raise ValueError(f"{path}: sidecar field 'SliceTiming' entries must lie in [0, RepetitionTime={tr:g})")
    return float(np.median(st))


def _find_confounds(rows, sub, rk, names, scrub):
    """(path, regressors (n, c) or None, scrubbed-volume mask (n,)) from the run's fMRIPrep confounds table."""
    hits = [p for p, _, e, suffix, ext in rows
            if (e.get("ses"), e.get("run")) == rk and e.get("desc") == "confounds"
            and suffix in ("timeseries", "regressors") and ext == ".tsv"]
    if not hits:
        raise FileNotFoundError(f"sub-{sub} {_run_name(rk)}: confounds= or scrub= given but no "
                                f"*_desc-confounds_timeseries.tsv for this run (searched root and derivatives)")
    if len(hits) > 1:
        raise ValueError(f"sub-{sub} {_run_name(rk)}: several confounds tables {[str(h) for h in hits]}")
    path = hits[0]
    df = _read_table(path, header=True)
    selected: list[str] = []
    for name in names:
        if any(ch in name for ch in "*?["):
            selected += [c for c in df.columns if fnmatch.fnmatchcase(c, name) and c not in selected]
        elif name not in df.columns:
            raise ValueError(f"{path}: no confound column {name!r}")
        elif name not in selected:
            selected.append(name)
    n = df.shape[0]
    flagged = np.zeros(n, dtype=bool)
    regress = []
    for c in selected:
        col = _numeric_column(df, c, path)
        if c.startswith(_SCRUB_PREFIXES):
            flagged |= np.nan_to_num(col, nan=0.0) != 0
        else:
            regress.append((c, col))
    if scrub is not None:
        if "framewise_displacement" not in df.columns:
            raise ValueError(f"{path}: scrub= needs column 'framewise_displacement'")
        fd = _numeric_column(df, "framewise_displacement", path)
        flagged |= np.nan_to_num(fd, nan=0.0) > scrub
    mat = None
    if regress:
        mat = np.column_stack([c for _, c in regress])
        if n > 1:
            first = np.isnan(mat[0])
            mat[0, first] = mat[1, first]
        bad = np.argwhere(np.isnan(mat))
        if bad.size:
            i, j = bad[0]
            raise ValueError(f"{path}: confound column {regress[j][0]!r} has a missing value at row {i} "
                             f"(only the first row may be n/a)")
    if flagged.all():
        raise ValueError(f"{path}: every volume is scrubbed")
    return path, mat, flagged


def _check_conf_rows(conf, n, path):
    if conf is not None and conf[2].size != n:
        raise ValueError(f"{conf[0]}: {conf[2].size} rows but {path} has {n} volumes")


def _scrubbed_rows(values_kept: np.ndarray, flagged: np.ndarray) -> np.ndarray:
    out = np.full((flagged.size, values_kept.shape[1]), np.nan)
    out[~flagged] = values_kept
    return out


def _read_bold(src, path, base, cache, masker, conf, state) -> _Piece:
    try:
        import nibabel as nib
    except ImportError:
        raise ImportError("reading BOLD needs nibabel and nilearn: pip install 'msrm[bids]'") from None
    meta, chain = _sidecar(path, base, cache)
    tr = _field(meta, "RepetitionTime", path, chain, positive=True)
    try:
        img = nib.load(str(path))
    except Exception as e:
        raise ValueError(f"{path}: cannot read the image ({type(e).__name__}: {e})") from None
    if len(img.shape) != 4 or img.shape[3] < 1:
        raise ValueError(f"{path}: a BOLD series must be a 4-D image, got shape {img.shape}")
    n = img.shape[3]
    offset = _volume_offset(meta, path, chain, tr, img.shape)
    _check_conf_rows(conf, n, path)
    if state["masker_ready"] is None:
        state["masker_ready"] = _is_fitted(masker)
        if not state["masker_ready"]:
            # a masker given its mask, labels or maps fits without images; one that computes its mask, on this one
            given = any(getattr(masker, a, None) is not None for a in ("mask_img", "labels_img", "maps_img"))
            if given:
                masker.fit()
            else:
                masker.fit(img)
            state["masker_ready"] = True
    kwargs = {}
    if conf is not None:
        _, mat, flagged = conf
        if mat is not None:
            kwargs["confounds"] = mat
        if flagged.any():
            kwargs["sample_mask"] = np.flatnonzero(~flagged)
    try:
        values = np.asarray(masker.transform(img, **kwargs), dtype=np.float64)
    except Exception as e:
        raise ValueError(f"{path}: the masker failed on this image ({type(e).__name__}: {e})") from None
    if values.ndim == 1:
        values = values[:, None]
    if conf is not None and conf[2].any():
        values = _scrubbed_rows(values, conf[2])
    return _Piece(src, path, values=values, dt=tr, start=offset, volumes=True)


def _is_fitted(masker) -> bool:
    f = getattr(masker, "__sklearn_is_fitted__", None)
    if callable(f):
        return bool(f())
    try:
        from sklearn.exceptions import NotFittedError
        from sklearn.utils.validation import check_is_fitted
    except ImportError:
        return False
    try:
        check_is_fitted(masker)
        return True
    except NotFittedError:
        return False


def _read_timeseries(src, path, base, cache, conf) -> _Piece:
    meta, chain = _sidecar(path, base, cache)
    tr = _field(meta, "RepetitionTime", path, chain, positive=True)
    offset = _volume_offset(meta, path, chain, tr, None)
    df = _read_table(path, header=True)
    if df.shape[0] == 0 or df.shape[1] == 0:
        raise ValueError(f"{path}: empty table")
    values = np.column_stack([_numeric_column(df, c, path) for c in df.columns])
    _check_conf_rows(conf, values.shape[0], path)
    if conf is not None and (conf[1] is not None or conf[2].any()):
        try:
            from nilearn.signal import clean
        except ImportError:
            raise ImportError("confound regression needs nilearn: pip install 'msrm[bids]'") from None
        _, mat, flagged = conf
        keep = np.flatnonzero(~flagged) if flagged.any() else None
        if np.isnan(values if keep is None else values[keep]).any():
            raise ValueError(f"{path}: missing values in a kept volume; confound regression needs complete rows")
        cleaned = clean(values, confounds=mat, sample_mask=keep, detrend=False, standardize=None,
                        standardize_confounds=True, filter=False, t_r=tr)
        values = _scrubbed_rows(cleaned, flagged) if flagged.any() else cleaned
    return _Piece(src, path, values=values, dt=tr, start=offset, volumes=True)
