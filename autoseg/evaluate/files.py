"""What an evaluation reads: the (prediction, reference) file pairs of two folders (``match_files``), checked
to share their geometry before any voxel is read (``check_geometries``), the labels of a dataset.json beside the
references (``labels_from_dataset_json``) and each file as a label map (``read_label_map``). A pair that cannot be
compared raises ``EvaluationError`` naming the files and the fix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from autoseg.core.errors import InputError
from autoseg.dataset.imageio import SUPPORTED_ENDINGS, Geometry, read_geometry, read_image, supported_ending


class EvaluationError(InputError):
    """Predictions and references cannot be compared (missing files, different geometry, bad values)."""


def reference_ending(gt_dir: Path) -> str:
    """The one image ending (``SUPPORTED_ENDINGS``) of the reference segmentations in ``gt_dir``; refused when the
    folder holds none, or several (then ``--file-ending`` chooses)."""
    if not gt_dir.is_dir():
        raise EvaluationError(f"{gt_dir}: reference folder not found")
    found = sorted({e for p in gt_dir.iterdir() if not p.name.startswith(".") and (e := supported_ending(p.name))})
    if not found:
        raise EvaluationError(
            f"{gt_dir}: no reference segmentations in a format autoseg reads ({', '.join(SUPPORTED_ENDINGS)})"
        )
    if len(found) > 1:
        raise EvaluationError(
            f"{gt_dir}: reference segmentations in {len(found)} formats ({', '.join(found)}); choose one with "
            "--file-ending"
        )
    return found[0]


def match_files(pred_dir: Path, gt_dir: Path, file_ending: str) -> list[tuple[Path, Path]]:
    """(prediction, reference) pairs, one per reference file ``{case}{file_ending}``, in name order. A prediction
    of a reference's case in another format is refused naming both (a label map is compared with its own format's
    reference, never matched by its case name alone)."""
    for folder, what in ((gt_dir, "reference"), (pred_dir, "prediction")):
        if not folder.is_dir():
            raise EvaluationError(f"{folder}: {what} folder not found")
    refs = sorted(p for p in gt_dir.iterdir() if p.name.endswith(file_ending) and not p.name.startswith("."))
    if not refs:
        raise EvaluationError(
            f"{gt_dir}: no reference segmentations ending in {file_ending!r}; give the references' ending with "
            "--file-ending"
        )
    _refuse_other_endings(pred_dir, refs, file_ending)
    missing = [r.name for r in refs if not (pred_dir / r.name).is_file()]
    if missing:
        raise EvaluationError(
            f"{pred_dir}: no prediction for {len(missing)} of {len(refs)} reference "
            f"file(s) in {gt_dir}: {_first_names(missing)}; predict these cases (same file "
            "names) or remove their references"
        )
    # As nnU-Net (whose evaluation fails on a prediction without its reference): a mean over a subset of the
    # predictions would be reported as the folder's score, so an unmatched prediction is an error too.
    names = {r.name for r in refs}
    unmatched = sorted(
        p.name
        for p in pred_dir.iterdir()
        if p.name.endswith(file_ending) and not p.name.startswith(".") and p.name not in names
    )
    if unmatched:
        raise EvaluationError(
            f"{gt_dir}: no reference for {len(unmatched)} prediction(s) in {pred_dir}: "
            f"{_first_names(unmatched)}; add their references (same file names) or move "
            "these predictions out of the folder"
        )
    return [(pred_dir / r.name, r) for r in refs]


def _refuse_other_endings(pred_dir: Path, refs: list[Path], file_ending: str) -> None:
    """A prediction of a reference's case that ends otherwise (``case.nrrd`` beside the reference ``case.nii.gz``)."""
    cases = {r.name[: -len(file_ending)]: r for r in refs}
    for p in sorted(pred_dir.iterdir()):
        ending = supported_ending(p.name)
        if ending is None or ending == file_ending or p.name.startswith("."):
            continue
        reference = cases.get(p.name[: -len(ending)])
        if reference is not None:
            raise EvaluationError(
                f"{p}: a prediction ending in {ending!r}, but its reference {reference} ends in {file_ending!r}; "
                "evaluate predictions and references of the same format (predict writes the input images' format: "
                "convert one side, or give the predictions' ending with --file-ending if their references have it)"
            )


def _first_names(names: list[str], shown: int = 10) -> str:
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def check_geometries(pairs: list[tuple[Path, Path]]) -> None:
    """Compare headers only; list every mismatching pair in one error."""
    problems = []
    for pred_path, ref_path in pairs:
        diff = read_geometry(pred_path).matches(read_geometry(ref_path))
        if diff:
            problems.append(f"prediction {pred_path} and reference {ref_path} differ in {diff}")
    if problems:
        raise EvaluationError(
            f"{len(problems)} prediction(s) do not have their reference's geometry (write "
            "predictions on the reference image grid):\n  " + "\n  ".join(problems)
        )


def read_label_map(path: Path, what: str) -> tuple[np.ndarray, Geometry]:
    """A segmentation as int16 label values. Float files are accepted when every voxel holds an integer
    (as SimpleITK writes a label map resampled in float); a fraction or NaN is refused, never rounded or
    cast silently (a probability map or an image passed by mistake)."""
    array, geometry = read_image(path, dtype=None)
    if array.dtype.kind == "f":
        fractional = ~np.isfinite(array) | (array != np.round(array))  # one bool per voxel
        if fractional.any():
            example = array[fractional].flat[0]
            raise EvaluationError(
                f"{path}: {what} holds {int(fractional.sum())} non-integer voxel(s) (e.g. "
                f"{example:g}); a segmentation holds label values 0, 1, 2, ... (a probability "
                "map or an image?)"
            )
    elif array.dtype.kind not in "iub":
        raise EvaluationError(f"{path}: {what} has voxel type {array.dtype}; expected integer label values")
    if array.size and (array.max() > np.iinfo(np.int16).max or array.min() < np.iinfo(np.int16).min):
        raise EvaluationError(
            f"{path}: {what} holds label value {array.max()}; label values up to {np.iinfo(np.int16).max} are supported"
        )
    return array.astype(np.int16, copy=False), geometry


def labels_from_dataset_json(gt_dir: Path) -> dict[str, Any] | None:
    for folder in (gt_dir, gt_dir.parent):
        path = folder / "dataset.json"
        if path.is_file():
            try:
                meta = json.loads(path.read_bytes().decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise EvaluationError(f"{path}: not UTF-8 JSON ({e}); fix it or pass labels explicitly") from e
            labels = meta.get("labels") if isinstance(meta, dict) else None
            ok = isinstance(labels, dict) and all(
                isinstance(v, int) or (isinstance(v, list) and v and all(isinstance(x, int) for x in v))
                for v in labels.values()
            )
            if not ok:
                raise EvaluationError(
                    f"{path}: 'labels' must map class names to integer values (or lists of "
                    f"them for regions); found {labels!r}; pass labels explicitly"
                )
            return labels
    return None
