"""The preprocessed case format: the one module that knows a case's files in ``preprocessed/<config>/``.

Per case ``<case>``:

- ``<case>_data.npy``: float32 (C, Z, Y, X), memory-mappable (``open_npy_for_patches``);
- ``<case>_seg.npy``: int8 (int16 beyond 127 label values) (1, Z, Y, X), -1 outside the body;
- ``<case>_locations.npy``: int32 (N, 4) rows (class, z, y, x): sampled foreground voxels per class or
  region (the network output channel; ``preprocessor.class_locations``);
- ``<case>_aug{k}_data.npy`` / ``_seg.npy`` / ``_locations.npy``: the same for precomputed augmented copy k;
- ``<case>.json``: ``CaseProperties``, written last: a case without it is incomplete.

A cascade stage (``ConfigurationPlan.previous_stage``) reads another configuration's cases; its own folder holds per
case ``<case>_previous.npy``: int8 (int16 past 127 values) (1, Z, Y, X), the previous stage's label map on its grid
(``write_previous_stage``, ``open_previous_stage``), and ``<case>_previous.json`` (``PreviousStageSource``,
written second): the label file it was made from.

Beside the folder, ``preprocessed/<config>_source.json`` (``PreprocessedSource``) records what its cases are
made from: the plan's preprocessing fields and, per case, a digest of its raw files (``DatasetSource.digest_of``).

Writing: ``CaseWriter`` (or ``write_case`` for a case without copies); every file under a temporary name,
renamed when complete. Reading: ``open_case`` -> ``StoredCase`` (memory maps, ``autoseg.preprocess.mapped_npy``;
locations, properties), ``read_properties``, ``list_complete_cases``, ``is_complete``, ``precomputed_copies``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from autoseg.core.artifacts import Artifact, ArtifactError, atomic_save_npy
from autoseg.core.errors import InputError
from autoseg.dataset.imageio import Geometry
from autoseg.dataset.labels import label_map_dtype
from autoseg.preprocess.mapped_npy import open_npy_for_patches
from autoseg.preprocess.precompute import SpatialParams

AUGMENTED = re.compile(r"_aug\d+_data\.npy$")  # an augmented copy's data file, not a case's
ClassLocations = Mapping[str, Sequence[Sequence[int]]]  # output channel -> (z, y, x) voxels

__all__ = [
    "AugmentedCopy",
    "CaseFiles",
    "CaseProperties",
    "CaseWriter",
    "PreprocessedSource",
    "StoredCase",
    "PreviousStageSource",
    "case_files",
    "delete_case",
    "is_complete",
    "list_complete_cases",
    "locations_array",
    "missing_files",
    "open_case",
    "open_previous_stage",
    "precomputed_copies",
    "properties_path",
    "read_previous_stage_source",
    "read_properties",
    "read_source",
    "source_path",
    "stored_case_ids",
    "write_case",
    "write_previous_stage",
]


@dataclass(frozen=True)
class AugmentedCopy:
    """One precomputed copy ``<case>_aug{index}_*.npy``: its parameters and voxel count per label value.

    Its foreground locations are in ``<case>_aug{index}_locations.npy``, not here: they are read only when a
    sample is drawn from that copy, and K more sets of up to 10,000 voxels per class in the JSON would make
    every read of the case's properties K + 1 times slower."""

    index: int
    params: SpatialParams
    class_voxels: tuple[int, ...]


@dataclass(frozen=True)
class CaseProperties(Artifact):
    """A preprocessed case's ``<case>.json``. Its foreground voxel samples are in ``<case>_locations.npy``
    (int32 (N, 4) rows: class, z, y, x; ``locations_array``), not here: as JSON they are large, slow to write
    and slow to parse at every training start (docs/benchmarks.md, "Training data pipeline")."""

    SCHEMA_VERSION = 2  # 2: class locations moved to <case>_locations.npy
    KIND = "case properties"

    case_id: str
    geometry: Geometry  # of the original image (written back exactly at prediction)
    spacing_mm: tuple[float, float, float]  # original (z, y, x)
    target_spacing_mm: tuple[float, float, float]
    shape_before_crop: tuple[int, int, int]
    crop_bbox: tuple[tuple[int, int], ...]  # (start, stop) per axis (z, y, x)
    shape_after_crop: tuple[int, int, int]
    shape_after_resample: tuple[int, int, int]
    class_voxels: tuple[int, ...] = ()  # per label value after resampling (training cases only)
    augmentations: tuple[AugmentedCopy, ...] = ()  # precomputed spatially augmented copies


@dataclass(frozen=True)
class PreprocessedSource(Artifact):
    """``preprocessed/<config>_source.json``: what the folder's cases are made from. Written before the cases
    it lists are made, after the cases it no longer matches were deleted, so every case in the folder is
    made from these: ``plan_fields`` (the plan's fields that preprocessing reads, as JSON values) and, per
    case id, the digest of its raw files."""

    SCHEMA_VERSION = 1
    KIND = "preprocessed source"

    plan_fields: dict[str, Any]
    cases: dict[str, str]


def source_path(folder: str | Path) -> Path:
    """``<config>_source.json`` beside the configuration's folder (not in it: a JSON there is a case)."""
    folder = Path(folder)
    return folder.with_name(f"{folder.name}_source.json")


def read_source(folder: str | Path) -> PreprocessedSource | None:
    """The folder's ``PreprocessedSource``; None when there is none (written by an older autoseg)."""
    path = source_path(folder)
    return PreprocessedSource.from_json(path) if path.is_file() else None


@dataclass(frozen=True)
class PreviousStageSource(Artifact):
    """``<case>_previous.json``: what the case's previous-stage label map was made from: ``label_file`` (the previous
    stage's predicted label map in the image's grid), the blake2b of its bytes, and the case's grid it was
    resampled to (its crop box and resampled shape)."""

    SCHEMA_VERSION = 1
    KIND = "previous stage source"

    label_file: str
    label_digest: str
    crop_bbox: tuple[tuple[int, int], ...]
    shape_zyx: tuple[int, int, int]


def _previous_stage_files(folder: str | Path, case_id: str) -> tuple[Path, Path]:
    return Path(folder) / f"{case_id}_previous.npy", Path(folder) / f"{case_id}_previous.json"


def write_previous_stage(folder: str | Path, case_id: str, labels: np.ndarray, source: PreviousStageSource) -> None:
    """The case's previous-stage label map (1, Z, Y, X) (``label_map_dtype``), then its source (each atomically)."""
    if labels.ndim != 4 or labels.shape[0] != 1 or tuple(labels.shape[1:]) != tuple(source.shape_zyx):
        raise ValueError(f"case {case_id!r}: previous-stage labels {labels.shape}, expected (1, *{source.shape_zyx})")
    array, record = _previous_stage_files(folder, case_id)
    Path(folder).mkdir(parents=True, exist_ok=True)
    record.unlink(missing_ok=True)  # from here on the map is unaccounted for until its source is written
    atomic_save_npy(array, labels.astype(label_map_dtype(int(labels.max(initial=0)) + 1)))
    source.to_json(record)


def read_previous_stage_source(folder: str | Path, case_id: str) -> PreviousStageSource | None:
    """The case's ``PreviousStageSource``; None when it has no complete previous-stage map."""
    array, record = _previous_stage_files(folder, case_id)
    return PreviousStageSource.from_json(record) if record.is_file() and array.is_file() else None


def open_previous_stage(folder: str | Path, case_id: str) -> np.ndarray:
    """A read-only memory map (``open_npy_for_patches``) of the case's previous-stage label map (1, Z, Y, X)."""
    if read_previous_stage_source(folder, case_id) is None:
        raise InputError(
            f"{folder}: no previous-stage label map of case {case_id!r}; train the cascade stage again "
            "(its start writes them)"
        )
    return open_npy_for_patches(_previous_stage_files(folder, case_id)[0])


@dataclass(frozen=True)
class CaseFiles:
    """The array files of a case or of one of its augmented copies."""

    data: Path
    seg: Path
    locations: Path

    def __iter__(self) -> Iterator[Path]:
        return iter((self.data, self.seg, self.locations))


def case_files(folder: str | Path, case_id: str, copy: int = -1) -> CaseFiles:
    """The arrays of case ``case_id`` (``copy`` -1) or of its augmented copy ``copy`` in ``folder``."""
    stem = Path(folder) / (case_id if copy < 0 else f"{case_id}_aug{copy}")
    return CaseFiles(Path(f"{stem}_data.npy"), Path(f"{stem}_seg.npy"), Path(f"{stem}_locations.npy"))


def properties_path(folder: str | Path, case_id: str) -> Path:
    """``<case>.json``: the case's ``CaseProperties``, written last."""
    return Path(folder) / f"{case_id}.json"


def locations_array(locations: ClassLocations) -> np.ndarray:
    """Foreground voxels per class (``preprocessor.class_locations``) as the int32 (N, 4) rows
    (class, z, y, x) that ``<case>_locations.npy`` and ``<case>_aug<k>_locations.npy`` store."""
    rows = [(int(c), *v) for c in sorted(locations, key=int) for v in locations[c]]
    return np.array(rows, dtype=np.int32).reshape(-1, 4)


def _check_arrays(where: str, data: np.ndarray, seg: np.ndarray) -> None:
    if data.ndim != 4 or seg.ndim != 4 or seg.shape[0] != 1 or seg.shape[1:] != data.shape[1:]:
        raise ValueError(
            f"{where}: expected data (C, Z, Y, X) and seg (1, Z, Y, X), got {data.shape} and "
            f"{seg.shape}; re-run preprocessing"
        )


class CaseWriter:
    """Writes one case in the format's order: its arrays, its copies' arrays, and ``commit``: the JSON.

    Each file is written under a temporary name and renamed when complete; ``commit`` refuses to write the
    JSON (which marks the case complete) before the case's arrays and those of every copy it lists.
    ``case_bytes`` / ``copy_bytes``: bytes on disk written so far (the JSON counts to ``case_bytes``)."""

    def __init__(self, folder: str | Path, case_id: str) -> None:
        self.folder, self.case_id = Path(folder), case_id
        self.case_bytes = self.copy_bytes = 0
        self._written: set[int] = set()

    def write_arrays(self, data: np.ndarray, seg: np.ndarray, locations: ClassLocations, copy: int = -1) -> None:
        """The case's (``copy`` -1) or copy ``copy``'s data float32 (C, Z, Y, X), seg signed int
        (1, Z, Y, X) and foreground voxels per class (stored as ``locations_array``)."""
        _check_arrays(f"case {self.case_id!r} copy {copy}", data, seg)
        if data.dtype != np.float32 or not np.issubdtype(seg.dtype, np.signedinteger):
            raise ValueError(
                f"case {self.case_id!r}: expected float32 data and a signed integer seg, got "
                f"{data.dtype} and {seg.dtype}"
            )
        files = case_files(self.folder, self.case_id, copy)
        written = 0
        for path, array in zip(files, (data, seg, locations_array(locations)), strict=True):
            atomic_save_npy(path, array)
            written += path.stat().st_size
        if copy < 0:
            self.case_bytes += written
        else:
            self.copy_bytes += written
        self._written.add(copy)

    def commit(self, props: CaseProperties) -> None:
        """Write ``<case>.json`` last: from now on the case is complete."""
        expected = {-1, *(c.index for c in props.augmentations)}
        if props.case_id != self.case_id or not expected <= self._written:
            raise ValueError(
                f"case {self.case_id!r}: properties of {props.case_id!r} with copies "
                f"{sorted(expected - {-1})}, but arrays written for {sorted(self._written)}"
            )
        path = properties_path(self.folder, self.case_id)
        props.to_json(path)
        self.case_bytes += path.stat().st_size


def write_case(
    folder: str | Path, props: CaseProperties, data: np.ndarray, seg: np.ndarray, locations: ClassLocations
) -> None:
    """A case without augmented copies: its arrays, then its JSON (``CaseWriter``)."""
    writer = CaseWriter(folder, props.case_id)
    writer.write_arrays(data, seg, locations)
    writer.commit(props)


def stored_case_ids(folder: str | Path) -> list[str]:
    """The ids of every case with a file in ``folder``, complete or not (its JSON or its ``_data.npy``)."""
    folder = Path(folder)
    ids = {p.name[: -len(".json")] for p in folder.glob("*.json")}
    ids |= {p.name[: -len("_data.npy")] for p in folder.glob("*_data.npy") if not AUGMENTED.search(p.name)}
    return sorted(ids)


def delete_case(folder: str | Path, case_id: str) -> None:
    """Remove case ``case_id``'s files from ``folder``: its JSON first (from then on it is incomplete), then
    its arrays and those of its copies."""
    properties_path(folder, case_id).unlink(missing_ok=True)
    for path in case_files(folder, case_id):
        path.unlink(missing_ok=True)
    copy = 0
    while any(p.exists() for p in case_files(folder, case_id, copy)):
        for path in case_files(folder, case_id, copy):
            path.unlink(missing_ok=True)
        copy += 1


def missing_files(folder: str | Path, case_id: str, num_copies: int = 0) -> list[Path]:
    """The files of the case (and of its first ``num_copies`` copies) that are not in ``folder``."""
    paths = [*case_files(folder, case_id), properties_path(folder, case_id)]
    paths += [p for k in range(num_copies) for p in case_files(folder, case_id, k)]
    return [p for p in paths if not p.is_file()]


def is_complete(folder: str | Path, case_id: str, num_copies: int = 0) -> bool:
    """The case's JSON (written last) and arrays exist, with at least ``num_copies`` copies."""
    return not missing_files(folder, case_id, num_copies)


def list_cases(folder: str | Path) -> list[str]:
    """The sorted ids of the cases in ``folder`` that have their JSON (written last), complete or not."""
    return sorted(p.name[: -len(".json")] for p in Path(folder).glob("*.json"))


def list_complete_cases(folder: str | Path) -> list[str]:
    """The sorted ids of the complete cases in ``folder`` (incomplete ones, without JSON, left out)."""
    return [c for c in list_cases(folder) if is_complete(folder, c)]


def read_properties(folder: str | Path, case_id: str) -> CaseProperties:
    """``<case>.json``; a missing file, bad JSON or another schema version raises ``ArtifactError`` naming it."""
    path = properties_path(folder, case_id)
    if not path.is_file():
        raise ArtifactError(
            f"{path}: file not found; case {case_id!r} is incomplete or was never preprocessed, "
            "run plan_and_preprocess again"
        )
    return CaseProperties.from_json(path)


def precomputed_copies(folder: str | Path, case_ids: Sequence[str]) -> int:
    """The fewest precomputed augmented copies any of ``case_ids`` has in ``folder`` (0: some case has none)."""
    return min((len(read_properties(folder, c).augmentations) for c in case_ids), default=0)


@dataclass(frozen=True)
class StoredCase:
    """A complete preprocessed case (``open_case``); its files are read when asked for, the JSON once."""

    folder: Path
    case_id: str

    @cached_property
    def properties(self) -> CaseProperties:
        return read_properties(self.folder, self.case_id)

    @property
    def copies(self) -> tuple[int, ...]:
        """The indices of the case's precomputed augmented copies (from its JSON)."""
        return tuple(c.index for c in self.properties.augmentations)

    def files(self, copy: int = -1) -> CaseFiles:
        return case_files(self.folder, self.case_id, copy)

    def arrays(self, copy: int = -1) -> tuple[np.ndarray, np.ndarray]:
        """Read-only memory maps (``open_npy_for_patches``) of data (C, Z, Y, X) and seg (1, Z, Y, X) of
        the case (``copy`` -1) or of its augmented copy; nothing is read until sliced."""
        files = self.files(copy)
        data, seg = open_npy_for_patches(files.data), open_npy_for_patches(files.seg)
        _check_arrays(f"case {self.case_id!r} in {self.folder}", data, seg)
        return data, seg

    def class_locations(self, copy: int = -1) -> dict[str, np.ndarray]:
        """Foreground voxels of the case or copy: class -> (N, 3) int32 (z, y, x), from its (N, 4) file."""
        path = self.files(copy).locations
        rows = np.load(path)
        if rows.ndim != 2 or rows.shape[1] != 4:
            raise InputError(f"{path}: expected (N, 4) rows (class, z, y, x), got {rows.shape}; re-run preprocessing")
        return {str(c): rows[rows[:, 0] == c, 1:] for c in np.unique(rows[:, 0])}


def open_case(folder: str | Path, case_id: str) -> StoredCase:
    """The case ``case_id`` in ``folder``; ``FileNotFoundError`` naming its missing files if incomplete."""
    missing = missing_files(folder, case_id)
    if missing:
        raise InputError(
            f"preprocessed case {case_id!r} in {folder} is incomplete, missing {[str(p) for p in missing]}; "
            "run preprocessing again (a case without <case>.json is incomplete)"
        )
    return StoredCase(Path(folder), case_id)
