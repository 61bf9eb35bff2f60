"""The nnU-Net raw dataset layout, read unchanged, and its integrity check.

Layout::

    Dataset001_Name/
      dataset.json            channel_names, labels, numTraining, file_ending (regions_class_order for
                              region-based labels; see ``autoseg.dataset.labels``)
      imagesTr/{case}_{0000..}.{ending}
      labelsTr/{case}.{ending}
      imagesTs/ (optional)
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from autoseg.core.errors import InputError
from autoseg.dataset.imageio import SUPPORTED_ENDINGS, Geometry, read_geometry, read_image, supported_ending
from autoseg.dataset.labels import LabelError, LabelScheme, LabelValue


class DatasetError(InputError):
    """The raw dataset does not follow the expected layout or its data is inconsistent."""


@dataclass(frozen=True)
class Case:
    case_id: str
    image_paths: tuple[Path, ...]  # one per channel, in channel order
    label_path: Path | None


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
        raise DatasetError(f"{root}: no dataset.json found; expected the nnU-Net raw dataset layout "
                           "(dataset.json, imagesTr/, labelsTr/)")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as e:
        raise DatasetError(f"{meta_path}: not valid JSON ({e})") from e
    for key in ("channel_names", "labels", "file_ending"):
        if key not in meta:
            raise DatasetError(f"{meta_path}: missing key {key!r} (see the nnU-Net dataset format)")
    channels = meta["channel_names"]
    try:
        channel_names = tuple(channels[k] for k in sorted(channels, key=lambda k: int(k)))
    except (ValueError, TypeError) as e:
        raise DatasetError(f"{meta_path}: channel_names keys must be '0', '1', ...; found {list(channels)}") from e
    if [int(k) for k in sorted(channels, key=int)] != list(range(len(channels))):
        raise DatasetError(f"{meta_path}: channel_names keys must be consecutive from '0'; found {list(channels)}")
    try:
        scheme = LabelScheme.from_labels(meta["labels"], meta.get("regions_class_order"), where=str(meta_path))
    except LabelError as e:
        raise DatasetError(str(e)) from e
    labels = {k: tuple(v) if isinstance(v, list) else v for k, v in meta["labels"].items()}
    ending = meta["file_ending"]
    if ending not in SUPPORTED_ENDINGS:
        raise DatasetError(f"{meta_path}: file_ending {ending!r} is not one of {SUPPORTED_ENDINGS}")
    cases = _list_cases(root, len(channel_names), ending)
    if not cases:
        raise DatasetError(f"{root / 'labelsTr'}: no label files ending in {ending}")
    num_training = meta.get("numTraining")
    if num_training is not None and num_training != len(cases):
        raise DatasetError(f"{meta_path}: numTraining is {num_training} but labelsTr holds {len(cases)} cases; "
                           "fix numTraining or add the missing cases")
    return RawDataset(root=root, name=root.name, channel_names=channel_names, labels=labels,
                      file_ending=ending, cases=tuple(cases), regions_class_order=scheme.regions_class_order)


def _list_cases(root: Path, num_channels: int, ending: str) -> list[Case]:
    labels_dir, images_dir = root / "labelsTr", root / "imagesTr"
    if not labels_dir.is_dir() or not images_dir.is_dir():
        raise DatasetError(f"{root}: expected folders imagesTr/ and labelsTr/")
    cases = []
    for label in sorted(labels_dir.iterdir()):
        if not label.name.endswith(ending) or label.name.startswith("."):
            continue
        case_id = label.name[: -len(ending)]
        cases.append(Case(case_id, image_files_for(images_dir, case_id, num_channels, ending), label))
    return cases


def list_prediction_inputs(path: str | Path, num_channels: int, file_ending: str | None = None) -> list[Case]:
    """Cases to predict from a folder ({case}_{0000..}.ext) or a single image file (one channel)."""
    path = Path(path).expanduser()
    if path.is_file():
        if num_channels != 1:
            raise DatasetError(f"{path}: the model expects {num_channels} channels; pass the folder holding "
                               f"{{case}}_0000 ... {{case}}_{num_channels - 1:04d} instead of one file")
        ending = supported_ending(path.name)
        if ending is None:
            raise DatasetError(f"{path}: not a supported image ({', '.join(SUPPORTED_ENDINGS)})")
        case_id = path.name[: -len(ending)]
        if case_id.endswith("_0000"):
            case_id = case_id[:-5]
        return [Case(case_id, (path,), None)]
    if not path.is_dir():
        raise DatasetError(f"{path}: no such file or folder")
    endings = (file_ending,) if file_ending else SUPPORTED_ENDINGS
    found: dict[str, str] = {}
    for f in sorted(path.iterdir()):
        ending = next((e for e in endings if f.name.endswith(e)), None)
        if ending is None or f.name.startswith("."):
            continue
        stem = f.name[: -len(ending)]
        if len(stem) > 5 and stem[-5] == "_" and stem[-4:].isdigit():
            found.setdefault(stem[:-5], ending)
    if not found:
        raise DatasetError(f"{path}: no images named {{case}}_0000{file_ending or '.nii.gz'} found")
    cases = []
    for case_id, ending in sorted(found.items()):
        files = image_files_for(path, case_id, num_channels, ending)
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise DatasetError(f"{path}: case {case_id!r} lacks channel file(s) {missing}")
        cases.append(Case(case_id, files, None))
    return cases


def check_integrity(dataset: RawDataset, read_voxels: bool = True) -> None:
    """Check every training case before anything is written; raise DatasetError listing all problems.

    Checks: all channel files and the label exist; channels and label agree in size, spacing, origin
    and direction (within tolerance); with ``read_voxels``, also what ``voxel_problems`` checks (the
    pipeline leaves that to the fingerprint, which reads every case anyway).
    """
    problems: list[str] = []
    for case in dataset.cases:
        missing = [str(p) for p in (*case.image_paths, case.label_path) if p is None or not p.is_file()]
        if missing:
            problems.append(f"case {case.case_id}: missing file(s) {missing}")
            continue
        try:
            label_geo = read_geometry(case.label_path)
            for p in case.image_paths:
                diff = read_geometry(p).matches(label_geo)
                if diff:
                    problems.append(f"case {case.case_id}: {p.name} and label {case.label_path.name} differ in {diff}")
            if read_voxels:
                problems += load_training_case(case, dataset.label_values)[3]
        except ValueError as e:
            problems.append(f"case {case.case_id}: {e}")
    raise_problems(dataset, problems)


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
            problems.append(f"case {case.case_id}: {case.label_path} holds label value(s) {sorted(unexpected)} "
                            f"not declared in dataset.json labels (declared: {sorted(label_values)})")
    for path, image in zip(case.image_paths, images, strict=True):
        if not np.all(np.isfinite(image)):
            problems.append(f"case {case.case_id}: {path} holds NaN or Inf values")
    return problems


def load_training_case(case: Case, label_values: Sequence[int]
                       ) -> tuple[np.ndarray, np.ndarray | None, Geometry, list[str]]:
    """``load_case`` of a training case, checked: also the ``voxel_problems`` found (when there are any,
    the label map is returned as None)."""
    data, _, geometry = load_case(replace(case, label_path=None))
    label, _ = read_image(case.label_path, dtype=None)  # as stored: float labels are checked for integers
    problems = voxel_problems(case, label_values, label, data)
    seg = None if problems else label.astype(np.int16, copy=False)[None]
    return data, seg, geometry, problems


def load_case(case: Case) -> tuple[np.ndarray, np.ndarray | None, Geometry]:
    """Read all channels (C, Z, Y, X) float32 and the label (1, Z, Y, X) int16 if the case has one."""
    channels = []
    geometry = None
    for p in case.image_paths:
        image, geometry = read_image(p)
        channels.append(image)
    data = np.stack(channels)
    del channels
    seg = None
    if case.label_path is not None:
        seg = read_image(case.label_path, dtype=np.int16)[0][None]
    assert geometry is not None
    return data, seg, geometry
