"""The nnU-Net raw dataset layout, read unchanged, and its integrity check.

Layout::

    Dataset001_Name/
      dataset.json            channel_names, labels, numTraining, file_ending (regions_class_order for
                              region-based labels; see ``autoseg.dataset.labels``; "dataset": the training
                              cases listed, see ``autoseg.dataset.case_list``)
      imagesTr/{case}_{0000..}.{ending}
      labelsTr/{case}.{ending}
      imagesTs/ (optional)
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from autoseg.core.errors import InputError
from autoseg.core.spacing import spacing_ratio_problem
from autoseg.dataset.case_list import listed_cases, warn_unlisted
from autoseg.dataset.imageio import (
    SUPPORTED_ENDINGS,
    Geometry,
    geometry_problem,
    read_dicom_series,
    read_geometry,
    read_image,
)
from autoseg.dataset.labels import LabelError, LabelScheme, LabelValue

log = logging.getLogger("autoseg")


class DatasetError(InputError):
    """The raw dataset does not follow the expected layout or its data is inconsistent."""


@dataclass(frozen=True)
class Case:
    case_id: str
    image_paths: tuple[Path, ...]  # one per channel, in channel order
    label_path: Path | None
    series_uid: str | None = None  # a DICOM series to predict: image_paths holds its folder


@dataclass(frozen=True)
class RawDataset:
    root: Path
    name: str
    channel_names: tuple[str, ...]  # in channel order, e.g. ("CT",) or ("T2", "ADC")
    labels: dict[str, LabelValue]  # name -> value (a tuple for a region), "background": 0 included
    file_ending: str
    cases: tuple[Case, ...]
    regions_class_order: tuple[int, ...] = ()  # region-based labels only

    @property
    def num_channels(self) -> int:
        return len(self.channel_names)

    @property
    def label_scheme(self) -> LabelScheme:
        return LabelScheme.from_labels(self.labels, self.regions_class_order, where=str(self.root / "dataset.json"))

    @property
    def num_label_values(self) -> int:
        """Highest label value + 1, ignore included (network outputs: ``label_scheme.num_outputs``)."""
        return self.label_scheme.num_label_values

    @property
    def label_values(self) -> tuple[int, ...]:
        """Every value a label file may hold (background, classes or region values, ignore)."""
        return self.label_scheme.label_values


def image_files_for(folder: Path, case_id: str, num_channels: int, file_ending: str) -> tuple[Path, ...]:
    return tuple(folder / f"{case_id}_{c:04d}{file_ending}" for c in range(num_channels))


def load_dataset(root: str | Path) -> RawDataset:
    """Read dataset.json and list the training cases (files are not opened here)."""
    root = Path(root).expanduser().resolve()
    meta_path = root / "dataset.json"
    if not meta_path.is_file():
        raise DatasetError(
            f"{root}: no dataset.json found; expected the nnU-Net raw dataset layout "
            "(dataset.json, imagesTr/, labelsTr/)"
        )
    meta = _read_meta(meta_path)
    channel_names = _channel_names(meta["channel_names"], meta_path)
    try:
        scheme = LabelScheme.from_labels(meta["labels"], meta.get("regions_class_order"), where=str(meta_path))
    except LabelError as e:
        raise DatasetError(str(e)) from e
    labels = {k: tuple(v) if isinstance(v, list) else v for k, v in meta["labels"].items()}
    ending = meta["file_ending"]
    if ending not in SUPPORTED_ENDINGS:
        hint = f"; did you mean '.{ending}'?" if isinstance(ending, str) and f".{ending}" in SUPPORTED_ENDINGS else ""
        raise DatasetError(f"{meta_path}: file_ending {ending!r} is not one of {SUPPORTED_ENDINGS}{hint}")
    cases = _training_cases(meta, meta_path, len(channel_names), ending)
    _check_num_training(meta, meta_path, len(cases))
    return RawDataset(
        root=root,
        name=root.name,
        channel_names=channel_names,
        labels=labels,
        file_ending=ending,
        cases=tuple(cases),
        regions_class_order=scheme.regions_class_order,
    )


def _training_cases(meta: dict, meta_path: Path, num_channels: int, ending: str) -> list[Case]:
    """The cases dataset.json's ``"dataset"`` entry names (``autoseg.dataset.case_list``: inside imagesTr/ and
    labelsTr/ only), else one per label in labelsTr."""
    root = meta_path.parent
    if "dataset" not in meta:
        cases = _list_cases(root, num_channels, ending)
        if not cases:
            raise DatasetError(f"{root / 'labelsTr'}: no label files ending in {ending}")
        return cases
    cases = [Case(*listed) for listed in listed_cases(meta["dataset"], meta_path, num_channels, ending)]
    warn_unlisted(meta_path, {p for c in cases for p in (*c.image_paths, c.label_path)}, ending)
    return cases


def _check_num_training(meta: dict, meta_path: Path, num_cases: int) -> None:
    """numTraining, when given, is an integer equal to the cases found; without it a warning says what was counted
    (nothing checks that every case the user meant is there)."""
    counted = "cases its 'dataset' entry names" if "dataset" in meta else "labels in labelsTr"
    num_training = meta.get("numTraining")
    if num_training is None:
        log.warning(
            '%s has no numTraining: training on the %d %s (write "numTraining": %d to have the count checked)',
            meta_path,
            num_cases,
            counted,
            num_cases,
        )
        return
    if not isinstance(num_training, int) or isinstance(num_training, bool):
        raise DatasetError(
            f"{meta_path}: numTraining must be an integer (the number of training cases); found "
            f"{num_training!r}; write {num_cases} or remove the key"
        )
    if num_training != num_cases:
        raise DatasetError(
            f"{meta_path}: numTraining is {num_training} but there are {num_cases} {counted}; "
            "fix numTraining or add the missing cases"
        )


def _read_meta(meta_path: Path) -> dict:
    """dataset.json as a dict holding the required keys; DatasetError naming the file and key otherwise."""
    try:
        meta = json.loads(meta_path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise DatasetError(f"{meta_path}: not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8") from e
    except json.JSONDecodeError as e:
        raise DatasetError(f"{meta_path}: not valid JSON ({e})") from e
    if not isinstance(meta, dict):
        raise DatasetError(
            f"{meta_path}: must hold a JSON object with channel_names, labels and file_ending; "
            f"found {type(meta).__name__} {str(meta)[:40]}"
        )
    for key in ("channel_names", "labels", "file_ending"):
        if key not in meta:
            raise DatasetError(f"{meta_path}: missing key {key!r} (see the nnU-Net dataset format)")
    return meta


def _channel_names(channels: object, meta_path: Path) -> tuple[str, ...]:
    """The channel names in channel order from dataset.json's ``{"0": "CT", "1": ...}``."""
    example = 'e.g. {"0": "CT"} or {"0": "T2", "1": "ADC"}'
    if not isinstance(channels, dict) or not channels:
        raise DatasetError(
            f"{meta_path}: channel_names must be a non-empty object mapping '0', '1', ... to channel "
            f"names, {example}; found {channels!r}"
        )
    try:
        order = sorted(channels, key=lambda k: int(k))
    except ValueError as e:
        raise DatasetError(f"{meta_path}: channel_names keys must be '0', '1', ...; found {list(channels)}") from e
    if [int(k) for k in order] != list(range(len(channels))):
        raise DatasetError(f"{meta_path}: channel_names keys must be consecutive from '0'; found {list(channels)}")
    bad = {k: v for k, v in channels.items() if not isinstance(v, str) or not v.strip()}
    if bad:
        raise DatasetError(
            f"{meta_path}: channel_names values must be non-empty names (the normalization is chosen "
            f"by name: 'CT' or anything else); found {bad}"
        )
    return tuple(channels[k] for k in order)


def _list_cases(root: Path, num_channels: int, ending: str) -> list[Case]:
    """One case per label in labelsTr; images in imagesTr without a label, or with a channel number the
    dataset does not declare, are refused (listed)."""
    labels_dir, images_dir = root / "labelsTr", root / "imagesTr"
    if not labels_dir.is_dir() or not images_dir.is_dir():
        raise DatasetError(f"{root}: expected folders imagesTr/ and labelsTr/")
    cases = []
    for label in sorted(labels_dir.iterdir()):
        if not label.name.endswith(ending) or label.name.startswith("."):
            continue
        case_id = label.name[: -len(ending)]
        cases.append(Case(case_id, image_files_for(images_dir, case_id, num_channels, ending), label))
    expected = {p.name for c in cases for p in c.image_paths}
    unexpected = [
        f
        for f in sorted(images_dir.iterdir())
        if f.name.endswith(ending) and not f.name.startswith(".") and f.name not in expected
    ]
    if unexpected:
        labelled = {c.case_id for c in cases}
        why = [
            f"{f.name} (channel {stem[-4:]}, but dataset.json declares {num_channels} channel(s))"
            if stem[:-5] in labelled
            else f"{f.name} (no label {stem[:-5] or stem}{ending} in labelsTr)"
            for f in unexpected
            for stem in [f.name[: -len(ending)]]
        ]
        raise DatasetError(
            f"{images_dir}: {len(unexpected)} image(s) belong to no training case; add their labels "
            "(or channel_names in dataset.json) or move them out:\n  "
            + "\n  ".join(why[:20])
            + (f"\n  and {len(why) - 20} more" if len(why) > 20 else "")
        )
    return cases


def check_integrity(dataset: RawDataset, read_voxels: bool = True) -> None:
    """Check every training case before anything is written; raise DatasetError listing all problems.

    Checks: all channel files and the label exist and are complete (``read_geometry``); channels and label
    agree in size, spacing, origin and direction (within tolerance); every case has the dimension (2D or 3D)
    of the majority; with ``read_voxels``, also what ``voxel_problems`` checks (the pipeline leaves that to
    the fingerprint, which reads every case anyway).
    """
    problems: list[str] = []
    geometries: dict[str, Geometry] = {}  # case id -> its label's, when that header is usable
    for case in dataset.cases:
        missing = [str(p) for p in (*case.image_paths, case.label_path) if p is None or not p.is_file()]
        if missing:
            problems.append(f"case {case.case_id}: missing file(s) {missing}")
            continue
        try:
            label_geo, found = _header_problems(case)
            if not found and read_voxels:
                found = load_training_case(case, dataset.label_values)[3]
        except ValueError as e:
            label_geo, found = None, [f"case {case.case_id}: {e}"]
        problems += found
        if label_geo is not None and not geometry_problem(label_geo):
            geometries[case.case_id] = label_geo
    dimensions = _dimension_problems(dataset, {k: g.ndim for k, g in geometries.items()})
    problems += dimensions or _spacing_outliers(dataset, geometries)  # a 2D case's z (999 mm) is no outlier of its own
    raise_problems(dataset, problems)


def _header_problems(case: Case) -> tuple[Geometry, list[str]]:
    """The label's geometry and what the headers of a case's files show (``read_geometry``, each read once): a
    geometry no stage can use (``geometry_problem``), channels and label on different grids."""
    label_geo = read_geometry(case.label_path)
    found = [f"case {case.case_id}: {case.label_path}: {p}" for p in [geometry_problem(label_geo)] if p]
    for path in case.image_paths:
        geo = read_geometry(path)
        if problem := geometry_problem(geo):
            found.append(f"case {case.case_id}: {path}: {problem}")
        elif diff := geo.matches(label_geo):
            found.append(f"case {case.case_id}: {path.name} and label {case.label_path.name} differ in {diff}")
    return label_geo, found


def _spacing_outliers(dataset: RawDataset, geometries: dict[str, Geometry]) -> list[str]:
    """Cases whose spacing is more than SPACING_RATIO_LIMIT x finer or coarser than the dataset's median on an
    axis (``spacing_ratio_problem``), named by their label file."""
    if not geometries:
        return []
    median = tuple(float(v) for v in np.median([g.spacing_zyx for g in geometries.values()], axis=0))
    by_id = {c.case_id: c for c in dataset.cases}
    return [
        f"case {case_id}: {by_id[case_id].label_path} and its images: {problem}"
        for case_id, geo in geometries.items()
        if (problem := spacing_ratio_problem(geo.spacing_zyx, median, "the dataset's median"))
    ]


def _dimension_problems(dataset: RawDataset, ndim: dict[str, int]) -> list[str]:
    """Cases whose dimension (2 or 3) is not the one most cases have (ties: 3D)."""
    counts = {d: list(ndim.values()).count(d) for d in set(ndim.values())}
    if len(counts) < 2:
        return []
    common = max(counts, key=lambda d: (counts[d], d))
    by_id = {c.case_id: c for c in dataset.cases}
    return [
        f"case {case_id}: {by_id[case_id].label_path.name} and its images are {d}D but {counts[common]} other "
        f"case(s) are {common}D; a dataset holds one dimension (put 2D slices in a 2D dataset)"
        for case_id, d in ndim.items()
        if d != common
    ]


def raise_problems(dataset: RawDataset, problems: list[str]) -> None:
    """Raise one DatasetError listing ``problems`` (nothing if there are none)."""
    if problems:
        head = f"{dataset.root}: {len(problems)} problem(s) found; nothing was written. Fix these files:\n  "
        raise DatasetError(head + "\n  ".join(problems))


def voxel_problems(case: Case, label_values: Sequence[int], label: np.ndarray, images: np.ndarray) -> list[str]:
    """What is wrong with a case's voxels: a label map (as stored) with non-integer values or values other
    than the declared ``label_values``; images (C, Z, Y, X) float32 holding NaN or Inf."""
    problems = []
    if label.dtype.kind == "f" and (not np.all(np.isfinite(label)) or np.any(label != np.round(label))):
        problems.append(f"case {case.case_id}: {case.label_path} holds non-integer values")
    else:
        lowest = int(label.min())
        present = np.flatnonzero(np.bincount((label.ravel() - lowest).astype(np.intp))) + lowest
        unexpected = set(present.tolist()) - set(label_values)
        if unexpected:
            problems.append(
                f"case {case.case_id}: {case.label_path} holds label value(s) {sorted(unexpected)} "
                f"not declared in dataset.json labels (declared: {sorted(label_values)})"
            )
    for path, image in zip(case.image_paths, images, strict=True):
        if not np.all(np.isfinite(image)):
            problems.append(f"case {case.case_id}: {path} holds NaN or Inf values")
    return problems


def load_training_case(
    case: Case, label_values: Sequence[int]
) -> tuple[np.ndarray, np.ndarray | None, Geometry, list[str]]:
    """``load_case`` of a training case, checked: also the ``voxel_problems`` found, or why a file cannot be
    read (then the label map is returned as None; the images too, and the geometry, if unreadable)."""
    try:
        data, geometry = _read_channels(case)
        label, _ = read_image(case.label_path, dtype=None)  # as stored: float labels are checked for integers
    except ValueError as e:  # a damaged file, NaN in a float NIfTI: listed with the other cases' problems
        return None, None, None, [f"case {case.case_id}: {e}"]  # type: ignore[return-value]
    problems = voxel_problems(case, label_values, label, data)
    seg = None if problems else label.astype(np.int16, copy=False)[None]
    return data, seg, geometry, problems


def load_case(case: Case) -> tuple[np.ndarray, np.ndarray | None, Geometry]:
    """Read all channels (C, Z, Y, X) float32 and the label (1, Z, Y, X) int16 if the case has one.
    Raises DatasetError naming the file when a channel holds NaN or Inf (a network would turn it into an
    all-background segmentation)."""
    data, geometry = _read_channels(case)
    bad = [
        f"{p} holds NaN or Inf values"
        for p, image in zip(case.image_paths, data, strict=True)
        if not np.isfinite(image).all()
    ]  # one bool per voxel, a channel at a time
    if bad:
        raise DatasetError(
            f"case {case.case_id}: " + "; ".join(bad) + "; replace them (e.g. with the image's minimum) and run again"
        )
    seg = None
    if case.label_path is not None:
        seg = read_image(case.label_path, dtype=np.int16)[0][None]
    return data, seg, geometry


def _read_channels(case: Case) -> tuple[np.ndarray, Geometry]:
    """All channels of a case, (C, Z, Y, X) float32, and the geometry of the last one."""
    if case.series_uid is not None:
        image, geometry = read_dicom_series(case.image_paths[0], case.series_uid)
        return image[None], geometry
    channels = []
    geometry = None
    for p in case.image_paths:
        image, geometry = read_image(p)
        channels.append(image)
    data = np.stack(channels)
    del channels
    assert geometry is not None
    return data, geometry
