"""What ``autoseg predict -i`` names: the cases of a folder in nnU-Net's inference layout ({case}_{0000..}.ext), a
single image file, or a folder holding DICOM series, and what is wrong with any of them, found from file names and
headers before any voxel is read."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from autoseg.core.errors import InputError
from autoseg.core.spacing import spacing_ratio_problem
from autoseg.dataset.dicom_file import check_dicom_series, incomplete_dicom_files
from autoseg.dataset.imageio import (
    SUPPORTED_ENDINGS,
    dicom_series,
    geometry_problem,
    read_geometry,
    supported_ending,
)
from autoseg.dataset.raw import Case, DatasetError, image_files_for


@dataclass(frozen=True)
class PredictionInputs:
    """The cases ``-i`` names, and why some of them cannot be predicted (found from file names and headers,
    before any voxel is read); the others can be predicted whatever happens to these."""

    cases: tuple[Case, ...]  # every case found, in case id order
    problems: dict[str, str]  # case id -> what is wrong with its files

    @property
    def case_ids(self) -> list[str]:
        """Every case id, the cases' and the problems', sorted."""
        return sorted({c.case_id for c in self.cases} | set(self.problems))

    def part(self, index: int, count: int) -> PredictionInputs:
        """Part ``index`` (1-based) of ``count`` near-equal parts of these cases in case id order, problems included:
        consecutive case ids, the first ``len % count`` parts one case longer. ``count`` processes each taking one
        part (a SLURM array, ``predict --part I/N``) cover every case once, whichever machine runs which."""
        ids = self.case_ids
        start, stop = (len(ids) * (index - 1)) // count, (len(ids) * index) // count
        mine = set(ids[start:stop])
        return PredictionInputs(
            cases=tuple(c for c in self.cases if c.case_id in mine),
            problems={k: v for k, v in self.problems.items() if k in mine},
        )

    def raise_problems(self) -> None:
        """One DatasetError listing every problem (nothing if there is none)."""
        if self.problems:
            raise DatasetError(
                f"{len(self.problems)} problem(s) with the input images; nothing was predicted:\n  "
                + "\n  ".join(self.problems.values())
            )


def list_prediction_inputs(
    path: str | Path,
    num_channels: int,
    file_ending: str | None = None,
    image_dim: int | None = None,
    series: str | None = None,
    spacing_mm: tuple[float, float, float] | None = None,
) -> PredictionInputs:
    """Cases to predict from a folder ({case}_{0000..}.ext), a single image file (one channel) or a folder
    holding DICOM series (one channel; ``series``: the SeriesInstanceUID to take when it holds several).

    Raises DatasetError when nothing can be listed (no such path, no image, several DICOM series and no
    ``series``). What is wrong with one case is listed in ``problems`` (``prediction_problems``): a channel
    file the model does not take or that is missing, a truncated file, channels that differ in geometry, or
    (``image_dim``: the dimension of the images the model was trained on) an image of another dimension, or
    (``spacing_mm``: their median spacing, z, y, x) a spacing more than SPACING_RATIO_LIMIT x off it."""
    path = Path(path).expanduser()
    if series is not None and not (path.is_dir() and not _nnunet_images(path, file_ending)):
        raise DatasetError(f"--series {series}: {path} is not a folder of DICOM series; leave --series out")
    if path.is_file():
        if num_channels != 1:
            raise DatasetError(
                f"{path}: the model expects {num_channels} channels; pass the folder holding "
                f"{{case}}_0000 ... {{case}}_{num_channels - 1:04d} instead of one file"
            )
        ending = supported_ending(path.name)
        if ending is None:
            raise DatasetError(f"{path}: not a supported image ({', '.join(SUPPORTED_ENDINGS)})")
        case_id = path.name[: -len(ending)]
        if case_id.endswith("_0000"):
            case_id = case_id[:-5]
        cases = [Case(case_id, (path,), None)]
        return PredictionInputs(tuple(cases), prediction_problems(cases, image_dim, spacing_mm))
    if not path.is_dir():
        raise DatasetError(f"{path}: no such file or folder")
    found = _nnunet_images(path, file_ending)
    if not found:
        return _dicom_inputs(path, num_channels, series, file_ending, image_dim)
    cases, problems = _folder_cases(path, found, num_channels)
    checked = [c for c in cases if c.case_id not in problems]
    return PredictionInputs(tuple(cases), {**problems, **prediction_problems(checked, image_dim, spacing_mm)})


def _folder_cases(
    path: Path, found: dict[str, dict[str, list[int]]], num_channels: int
) -> tuple[list[Case], dict[str, str]]:
    """The cases of folder ``path`` (``_nnunet_images``' ``found``) and, by case id, what their file names show is
    wrong: a case in two formats, a channel the model does not take, a channel missing."""
    cases, problems = [], {}
    for case_id, formats in sorted(found.items()):
        ending, numbers = next(iter(formats.items()))
        files = image_files_for(path, case_id, num_channels, ending)
        cases.append(Case(case_id, files, None))
        extra = [str(image_files_for(path, case_id, n + 1, ending)[n]) for n in numbers if n >= num_channels]
        missing = [f.name for f in files if not f.is_file()]
        if len(formats) > 1:  # which one the user meant is theirs to say: both would write the one output
            named = [str(image_files_for(path, case_id, n + 1, e)[n]) for e, ns in formats.items() for n in ns]
            problems[case_id] = (
                f"{' and '.join(named)}: case {case_id!r} is there in {len(formats)} formats "
                f"({', '.join(formats)}) and has one output; move all but one format out of {path}"
            )
        elif extra:
            problems[case_id] = (
                f"{', '.join(extra)}: the model takes {num_channels} channel(s) ({{case}}_0000 .. "
                f"{{case}}_{num_channels - 1:04d}); remove the extra channel file(s) or use a "
                "model trained with them"
            )
        elif missing:
            problems[case_id] = f"{path}: case {case_id!r} lacks channel file(s) {missing}"
    return cases, problems


def _nnunet_images(folder: Path, file_ending: str | None) -> dict[str, dict[str, list[int]]]:
    """Case id -> file ending -> channel numbers found, of the {case}_{0000..}.ext files in ``folder`` (a case
    normally has one ending)."""
    endings = (file_ending,) if file_ending else SUPPORTED_ENDINGS
    found: dict[str, dict[str, list[int]]] = {}
    for f in sorted(folder.iterdir()):
        ending = next((e for e in endings if f.name.endswith(e)), None)
        if ending is None or f.name.startswith("."):
            continue
        stem = f.name[: -len(ending)]
        if len(stem) > 5 and stem[-5] == "_" and stem[-4:].isdigit():
            found.setdefault(stem[:-5], {}).setdefault(ending, []).append(int(stem[-4:]))
    return found


def _dicom_inputs(
    folder: Path, num_channels: int, series: str | None, file_ending: str | None, image_dim: int | None
) -> PredictionInputs:
    """The one case of a folder holding DICOM series: named after the folder, or after ``series`` (its
    SeriesInstanceUID) when that is given."""
    uids = dicom_series(folder)
    if not uids:  # GDCM lists no file it cannot read: a truncated one-slice series is not listed
        truncated = "; truncated: " + "; ".join(cut) if (cut := incomplete_dicom_files(folder)) else ""
        raise DatasetError(
            f"{folder}: no images named {{case}}_0000{file_ending or '.nii.gz'} and no DICOM series found{truncated}"
        )
    if num_channels != 1:
        raise DatasetError(
            f"{folder}: a DICOM series is one channel but the model takes {num_channels}; convert "
            f"each channel's series to {{case}}_0000.nii.gz .. {{case}}_{num_channels - 1:04d}.nii.gz "
            "in one folder and pass that folder"
        )
    listed = "\n  ".join(f"{uid} ({len(files)} files)" for uid, files in uids.items())
    if series is None and len(uids) > 1:
        raise DatasetError(f"{folder}: holds {len(uids)} DICOM series; choose one with --series UID:\n  {listed}")
    if series is not None and series not in uids:
        raise DatasetError(f"--series {series}: no such series in {folder}; it holds:\n  {listed}")
    uid = series or next(iter(uids))
    case = Case(series or folder.name, (folder,), None, series_uid=uid)
    problems = (
        {
            case.case_id: f"{folder}: DICOM series {uid} is a 3D image ({len(uids[uid])} slices) but the model "
            "was trained on 2D images"
        }
        if image_dim == 2 and len(uids[uid]) > 1
        else {}
    )
    try:
        check_dicom_series(folder, uid)  # a truncated slice, left out of the listed series by GDCM
    except InputError as e:
        problems[case.case_id] = str(e)
    return PredictionInputs((case,), problems)


def prediction_problems(
    cases: Sequence[Case], image_dim: int | None, spacing_mm: tuple[float, float, float] | None = None
) -> dict[str, str]:
    """Headers only: every file complete (``read_geometry``) and of a usable geometry (``geometry_problem``: voxels
    on every axis, a positive spacing), a case's channels on one grid, and the images of dimension ``image_dim``
    (None: not checked), of a spacing within SPACING_RATIO_LIMIT of ``spacing_mm`` (the images trained on; None: not
    checked). Case id -> its problems."""
    problems = {}
    for case in cases:
        try:
            geometries = [read_geometry(p) for p in case.image_paths]
        except ValueError as e:
            problems[case.case_id] = str(e)
            continue
        found = [
            f"{p}: {problem}" for p, geo in zip(case.image_paths, geometries) if (problem := geometry_problem(geo))
        ]
        found += [
            f"{p} and {case.image_paths[0].name} differ in {diff}"
            for p, geo in zip(case.image_paths[1:], geometries[1:], strict=True)
            if not found and (diff := geo.matches(geometries[0]))
        ]
        if image_dim is not None and geometries[0].ndim != image_dim:
            found.append(
                f"{case.image_paths[0]} is a {geometries[0].ndim}D image but the model was trained on "
                f"{image_dim}D images"
            )
        trained = "the median of the images the model was trained on"
        if (
            not found  # a 2D image's z (999 mm) says nothing more than its dimension
            and spacing_mm
            and (problem := spacing_ratio_problem(geometries[0].spacing_zyx, spacing_mm, trained))
        ):
            found.append(f"{case.image_paths[0]}: {problem}")
        if found:
            problems[case.case_id] = "; ".join(found)
    return problems
