"""Compare a folder of predicted segmentations with a folder of reference segmentations.

Per case and per foreground class: Dice, IoU, TP/FP/FN voxel counts, the volumes of prediction and
reference, and the surface metrics of ``surface`` (HD95 in mm and the normalized surface Dice at a tolerance in
mm, in the images' spacing; ``nsd_tolerance_mm=None`` skips them) and the reference's connected components the
prediction touches (``detection``). Then the mean per class over cases (the components summed) and the mean
foreground Dice (mean of the class means).

Labels as in dataset.json (``autoseg.dataset.labels``): a region (a list of values) is scored as the union of its
values in both prediction and reference; voxels holding the ignore label in the reference are left out of
every count (whatever the prediction says there).

Empty-vs-empty convention: when a class is absent from both the prediction and the reference of a case,
its Dice and IoU are undefined and stored as NaN in memory (``null`` in summary.json, which keeps the file
standard JSON). Such entries are left out of the class means; a class undefined in every case has a NaN
mean and is left out of the mean foreground Dice. An empty prediction against a non-empty reference (or
the reverse) scores 0 (Dice, IoU, NSD), and HD95 the image diagonal (see ``surface``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from autoseg.core.artifacts import Artifact, to_dict, write_json
from autoseg.dataset.imageio import SUPPORTED_ENDINGS
from autoseg.dataset.labels import IGNORE, LabelValue, foreground_entries
from autoseg.evaluate.detection import Detection, case_detection
from autoseg.evaluate.files import (
    EvaluationError,
    check_geometries,
    labels_from_dataset_json,
    match_files,
    read_label_map,
    reference_ending,
)
from autoseg.evaluate.surface import DEFAULT_NSD_TOLERANCE_MM, NOT_COMPUTED, SurfaceMetrics, case_surface_metrics

NOT_FOUND = Detection(0, 0)  # a class absent from a case's reference and prediction


@dataclass(frozen=True)
class ClassMetrics:
    """One foreground class in one case. Volumes are in mm^3 (mm^2 for 2D images)."""

    dice: float  # NaN when the class is absent from both prediction and reference
    iou: float  # NaN likewise
    tp: int  # voxels of the class in both
    fp: int  # voxels of the class in the prediction only
    fn: int  # voxels of the class in the reference only
    volume_pred_mm3: float
    volume_ref_mm3: float
    hd95_mm: float = math.nan  # NaN likewise, or when not computed; the image diagonal when in only one
    nsd: float = math.nan  # normalized surface Dice at the summary's nsd_tolerance_mm; NaN likewise
    components: int = -1  # the reference's 26-connected components of the class (``detection``); -1: not computed
    components_found: int = -1  # those the prediction touches; -1: not computed


@dataclass(frozen=True)
class CaseMetrics:
    case_id: str
    prediction: str  # file path
    reference: str  # file path
    classes: dict[str, ClassMetrics]  # class name -> metrics


@dataclass(frozen=True)
class MeanMetrics:
    """Mean of one class over the cases where its Dice is defined (``num_cases`` of them)."""

    dice: float
    iou: float
    num_cases: int
    hd95_mm: float = math.nan  # NaN when surface metrics were not computed
    nsd: float = math.nan
    components: int = -1  # the reference's components summed over all cases (-1: not computed)
    components_found: int = -1  # those the predictions touch, summed likewise


@dataclass(frozen=True)
class EvaluationSummary(Artifact):
    SCHEMA_VERSION = 3
    KIND = "evaluation summary"
    # version 1 had no surface metrics, versions 1-2 no detection counts: they read as not computed
    UPGRADES = {1: lambda payload: payload, 2: lambda payload: payload}

    pred_dir: str
    gt_dir: str
    labels: dict[str, LabelValue]  # foreground classes evaluated, name -> label value (a tuple for a region)
    cases: tuple[CaseMetrics, ...]
    mean: dict[str, MeanMetrics]  # class name -> mean over cases
    mean_foreground_dice: float  # mean of the defined class mean Dice values
    ignore_value: int | None = None  # reference voxels with this value were not counted
    nsd_tolerance_mm: float | None = None  # None: surface metrics (HD95, NSD) not computed

    def to_json(self, path: str | os.PathLike) -> None:
        """Write as JSON; NaN values become ``null`` so any JSON reader accepts the file."""
        write_json(path, _nan_to_none({"schema_version": self.SCHEMA_VERSION, **to_dict(self)}))

    @classmethod
    def from_payload(cls, data: Any, where: str) -> EvaluationSummary:
        if isinstance(data, dict):  # null is NaN for metrics, but "none" for ignore_value and nsd_tolerance_mm
            data = {k: v if k in ("ignore_value", "nsd_tolerance_mm") else _none_to_nan(v) for k, v in data.items()}
        return super().from_payload(data, where)


def evaluate_folder(
    pred_dir: str | Path,
    gt_dir: str | Path,
    labels: dict[str, Any] | None = None,
    file_ending: str | None = None,
    output_json: str | Path | None = None,
    nsd_tolerance_mm: float | None = DEFAULT_NSD_TOLERANCE_MM,
) -> EvaluationSummary:
    """Evaluate every reference ``gt_dir/{case}{file_ending}`` against ``pred_dir/{case}{file_ending}``
    (``file_ending`` None: the one format of the references, ``reference_ending``).

    ``labels`` maps class names to label values as in dataset.json (background, value 0, is skipped; a list
    of values is a region; ``"ignore"`` names the ignore label). When None, they come
    from a dataset.json in ``gt_dir`` or its parent, else from the values found in the images (named by
    their value). Raises EvaluationError, before reading any voxels, when predictions are missing or a
    prediction's geometry differs from its reference. Writes the summary to ``output_json`` if given.
    ``nsd_tolerance_mm``: the normalized surface Dice's tolerance; None skips the surface metrics (HD95, NSD).
    """
    pred_dir, gt_dir = Path(pred_dir), Path(gt_dir)
    if file_ending is not None and file_ending not in SUPPORTED_ENDINGS:
        raise EvaluationError(f"--file-ending {file_ending!r}: use one of {', '.join(SUPPORTED_ENDINGS)}")
    file_ending = file_ending or reference_ending(gt_dir)
    pairs = match_files(pred_dir, gt_dir, file_ending)
    if labels is None:
        labels = labels_from_dataset_json(gt_dir)
    return evaluate_pairs(
        pairs,
        labels,
        file_ending,
        output_json,
        pred_dir=str(pred_dir),
        gt_dir=str(gt_dir),
        nsd_tolerance_mm=nsd_tolerance_mm,
    )


def evaluate_pairs(
    pairs: list[tuple[Path, Path]],
    labels: dict[str, Any] | None,
    file_ending: str = ".nii.gz",
    output_json: str | Path | None = None,
    pred_dir: str = "",
    gt_dir: str = "",
    nsd_tolerance_mm: float | None = DEFAULT_NSD_TOLERANCE_MM,
) -> EvaluationSummary:
    """Evaluate explicit (prediction, reference) file pairs; see ``evaluate_folder``."""
    check_geometries(pairs)
    if nsd_tolerance_mm is not None and not (math.isfinite(nsd_tolerance_mm) and nsd_tolerance_mm > 0):
        raise EvaluationError(f"NSD tolerance {nsd_tolerance_mm} mm: give a finite number of mm above 0")
    ignore = labels.get(IGNORE) if labels is not None else None
    scored = [_score_case(pred_path, ref_path, labels, ignore, nsd_tolerance_mm) for pred_path, ref_path in pairs]
    if labels is not None:
        _refuse_undeclared_predictions(pairs, [confusion for confusion, *_ in scored], labels)
    if labels is None:  # name classes by the values found
        found = sorted({v for c, *_ in scored for v in np.flatnonzero(c.sum(0) + c.sum(1)).tolist()} - {0})
        labels = {str(v): v for v in found}
    foreground = foreground_entries(labels)
    if not any(isinstance(v, tuple) for v in foreground.values()):  # plain classes: in value order
        foreground = dict(sorted(foreground.items(), key=lambda kv: kv[1]))
    cases = []
    for (pred_path, ref_path), (confusion, voxel_mm3, surface, detection) in zip(pairs, scored, strict=True):
        classes = {
            name: _metrics(
                *_counts(confusion, v), voxel_mm3, surface.get(name, NOT_COMPUTED), detection.get(name, NOT_FOUND)
            )
            for name, v in foreground.items()
        }
        cases.append(CaseMetrics(ref_path.name[: -len(file_ending)], str(pred_path), str(ref_path), classes))
    mean = {name: _mean_over_cases([c.classes[name] for c in cases]) for name in foreground}
    summary = EvaluationSummary(
        pred_dir=pred_dir,
        gt_dir=gt_dir,
        labels=foreground,
        cases=tuple(cases),
        mean=mean,
        mean_foreground_dice=_nanmean([m.dice for m in mean.values()]),
        ignore_value=ignore,
        nsd_tolerance_mm=nsd_tolerance_mm,
    )
    if output_json is not None:
        summary.to_json(output_json)
    return summary


def format_table(summary: EvaluationSummary) -> str:
    """Plain-text table: a row per foreground class or region (mean Dice, mean IoU, when computed mean HD95 and mean
    NSD and the reference's connected components found over all cases), then the mean foreground Dice, and how
    many HD95 values are the image diagonal."""
    regions = any(isinstance(v, tuple) for v in summary.labels.values())
    values = {name: ",".join(map(str, v)) if isinstance(v, tuple) else str(v) for name, v in summary.labels.items()}
    kind = "region" if regions else "class"
    width = max([len(kind), *(len(name) for name in summary.labels)])
    value_width = max([5, *(len(v) for v in values.values())])
    tolerance = summary.nsd_tolerance_mm
    nsd_head = "" if tolerance is None else f"mean NSD@{tolerance:g}mm"
    surface_head = "" if tolerance is None else f"  mean HD95 mm  {nsd_head}"
    found = {name: f"{m.components_found}/{m.components}" for name, m in summary.mean.items() if m.components >= 0}
    found_width = max([5, *(len(f) for f in found.values())]) if len(found) == len(summary.labels) else 0
    found_head = f"  {'found':>{found_width}}" if found_width else ""
    lines = [f"{kind:<{width}}  {'value':>{value_width}}  mean Dice  mean IoU{surface_head}{found_head}  cases"]
    for name in summary.labels:
        m = summary.mean[name]
        surface = "" if tolerance is None else f"  {_fmt(m.hd95_mm, 2):>12}  {_fmt(m.nsd):>{len(nsd_head)}}"
        detected = f"  {found[name]:>{found_width}}" if found_width else ""
        lines.append(
            f"{name:<{width}}  {values[name]:>{value_width}}  {_fmt(m.dice):>9}  {_fmt(m.iou):>8}"
            f"{surface}{detected}  {m.num_cases:>5}"
        )
    ignored = "" if summary.ignore_value is None else f"; ignore label {summary.ignore_value} not counted"
    lines.append(
        f"mean foreground Dice: {_fmt(summary.mean_foreground_dice)} "
        f"({len(summary.labels)} {'regions' if regions else 'classes'}, {len(summary.cases)} cases"
        f"{ignored})"
    )
    one_sided = sum((c.tp + c.fp == 0) != (c.tp + c.fn == 0) for case in summary.cases for c in case.classes.values())
    if tolerance is not None and one_sided:
        lines.append(
            f"HD95: {one_sided} (case, {kind}) pair(s) with the {kind} in only one of prediction and "
            "reference count as the image diagonal"
        )
    return "\n".join(lines)


def _fmt(value: float, digits: int = 4) -> str:
    return "n/a" if math.isnan(value) else f"{value:.{digits}f}"


def case_dice(
    pred: np.ndarray, ref: np.ndarray, foreground: dict[str, LabelValue], ignore: int | None, where: str = ""
) -> dict[str, float]:
    """Dice per foreground class or region (``foreground_entries``) of one case held in memory, by the definition of
    ``evaluate_pairs``: reference voxels holding ``ignore`` are not counted, NaN when the class is absent from both.
    ``where`` names the case in errors. Temporary: 8 bytes a voxel (``_confusion``)."""
    confusion = _confusion(pred, ref, Path(f"{where} prediction"), Path(f"{where} reference"), ignore)
    out = {}
    for name, value in foreground.items():
        tp, n_pred, n_ref = _counts(confusion, value)
        out[name] = 2 * tp / (n_pred + n_ref) if n_pred + n_ref else math.nan
    return out


def mean_dice(cases: list[dict[str, float]]) -> tuple[dict[str, float], float]:
    """Per-case Dice (``case_dice``) -> (each class's mean over the cases where it is defined, the mean foreground
    Dice: the mean of the defined class means), as ``evaluate_pairs`` summarises a folder."""
    names = list(cases[0]) if cases else []
    means = {name: _nanmean([c[name] for c in cases]) for name in names}
    return means, _nanmean(list(means.values()))


def _confusion(pred: np.ndarray, ref: np.ndarray, pred_path: Path, ref_path: Path, ignore: int | None) -> np.ndarray:
    """int64 (V, V) voxel counts: row = reference value, column = predicted value; the row of the ignore
    value is zeroed (those reference voxels are not counted). Temporary: 8 bytes per voxel."""
    for array, path in ((pred, pred_path), (ref, ref_path)):
        if array.size and array.min() < 0:
            raise EvaluationError(f"{path}: holds negative label value {int(array.min())}; labels must be 0, 1, 2, ...")
    size = int(max(pred.max(initial=0), ref.max(initial=0))) + 1
    pair = ref.astype(np.int64).ravel()  # V int64: the only voxel-sized temporary
    pair *= size
    pair += pred.ravel()
    confusion = np.bincount(pair, minlength=size * size).reshape(size, size)
    if ignore is not None and ignore < size:
        confusion[ignore] = 0
    return confusion


def _refuse_undeclared_predictions(
    pairs: list[tuple[Path, Path]], confusions: list[np.ndarray], labels: dict[str, Any]
) -> None:
    """A prediction holding a label value that ``labels`` (dataset.json's) does not declare is an error naming the
    case and the value: scored, its voxels would count as background without a word."""
    declared = {0} | {
        int(v) for value in labels.values() for v in (value if isinstance(value, (list, tuple)) else (value,))
    }
    for (pred_path, _), confusion in zip(pairs, confusions, strict=True):
        undeclared = sorted(set(np.flatnonzero(confusion.sum(axis=0)).tolist()) - declared)
        if undeclared:
            raise EvaluationError(
                f"{pred_path}: holds label value(s) {undeclared}, which the labels do not declare (values "
                f"{sorted(declared)}); evaluate against the dataset the model was trained for, or give its labels"
            )


def _counts(confusion: np.ndarray, value: LabelValue) -> tuple[int, int, int]:
    """(tp, n_pred, n_ref) of a class value or of a region (the union of its values)."""
    values = [v for v in ((value,) if isinstance(value, int) else value) if v < len(confusion)]
    if not values:
        return 0, 0, 0
    return (
        int(confusion[np.ix_(values, values)].sum()),
        int(confusion[:, values].sum()),
        int(confusion[values, :].sum()),
    )


def _score_case(
    pred_path: Path, ref_path: Path, labels: dict[str, Any] | None, ignore: int | None, nsd_tolerance_mm: float | None
) -> tuple[np.ndarray, float, dict[str, SurfaceMetrics], dict[str, Detection]]:
    """One case read once: its confusion matrix, voxel volume (mm^3), surface metrics (none if the tolerance is
    None) and detection per class name (the classes of ``labels``, or when None each value found, named by its
    value)."""
    pred, _ = read_label_map(pred_path, "prediction")
    ref, geometry = read_label_map(ref_path, "reference")
    confusion = _confusion(pred, ref, pred_path, ref_path, ignore)
    if labels is None:
        classes = {str(v): v for v in np.flatnonzero(confusion.sum(0) + confusion.sum(1)).tolist() if v}
    else:
        classes = foreground_entries(labels)
    detection = case_detection(pred, ref, classes)
    surface: dict[str, SurfaceMetrics] = {}
    if nsd_tolerance_mm is not None:
        spacing_mm = tuple(float(s) for s in reversed(geometry.spacing_xyz))  # array axis order
        if geometry.ndim == 2:  # (1, Y, X) arrays: the surfaces are 2D contours
            pred, ref = pred[0], ref[0]
        surface = case_surface_metrics(pred, ref, classes, spacing_mm, nsd_tolerance_mm, ignore)
    return confusion, float(np.prod(geometry.spacing_xyz)), surface, detection


def _metrics(
    tp: int, n_pred: int, n_ref: int, voxel_mm3: float, surface: SurfaceMetrics, detection: Detection
) -> ClassMetrics:
    fp, fn = n_pred - tp, n_ref - tp
    defined = n_pred + n_ref > 0
    dice = 2 * tp / (n_pred + n_ref) if defined else math.nan
    iou = tp / (tp + fp + fn) if defined else math.nan
    volumes = n_pred * voxel_mm3, n_ref * voxel_mm3
    surfaces = surface.hd95_mm, surface.nsd
    return ClassMetrics(dice, iou, tp, fp, fn, *volumes, *surfaces, detection.components, detection.found)


def _mean_over_cases(metrics: list[ClassMetrics]) -> MeanMetrics:
    """Means over the cases where the class is defined; the detection counts summed over every case (a case without
    the class in its reference adds no component), -1 where a case has none computed."""
    defined = [m for m in metrics if not math.isnan(m.dice)]
    counted = all(m.components >= 0 for m in metrics)
    return MeanMetrics(
        _nanmean([m.dice for m in defined]),
        _nanmean([m.iou for m in defined]),
        len(defined),
        _nanmean([m.hd95_mm for m in defined]),
        _nanmean([m.nsd for m in defined]),
        sum(m.components for m in metrics) if counted else -1,
        sum(m.components_found for m in metrics) if counted else -1,
    )


def _nanmean(values: list[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return float(np.mean(kept)) if kept else math.nan


def _nan_to_none(obj: Any) -> Any:
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {k: _nan_to_none(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_nan_to_none(v) for v in obj]
    return obj


def _none_to_nan(obj: Any) -> Any:
    if obj is None:
        return math.nan
    if isinstance(obj, dict):
        return {k: _none_to_nan(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_none_to_nan(v) for v in obj]
    return obj
