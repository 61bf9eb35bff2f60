"""Per-case uncertainty of ``autoseg predict`` from its ensemble's disagreement: which cases a person looks at first.

With two or more folds (else two or more mirror variants of one fold: ``--tta``), the sliding window counts how much
the members' label maps agree (``autoseg.model.agreement``: the mean pairwise Dice per structure, running sums of
label tiles), and the export how spread the averaged probabilities are (``EntropyMap``: each voxel's entropy,
normalized to [0, 1] by its largest value, from the same resampled maps that make the label map, in the input's
grid). A case's ``score`` is that entropy's mean inside the predicted foreground (``SCORE``: it ranked cases by their
real Dice better than the disagreement did, docs/prediction.md, Uncertainty); where nothing is predicted, the
disagreement (``1 - the mean pairwise Dice`` over the structures some member predicts; 0 where none does).

Each case's row is ``uncertainty/{case}.json`` (``CaseUncertainty``, written atomically beside its label map, so
``--continue`` and ``--part`` see it as one of the case's outputs); ``uncertainty.csv`` is assembled from every row
in the folder at the end of the run (``assemble_uncertainty``), so parts writing into one folder write what one run
writes, and the cases above ``UncertaintyOptions.threshold`` are logged worst first to review first.
``--save-uncertainty`` writes ``{case}_uncertainty.nii.gz``: the entropy map, uint8 (255: the largest entropy), in
the input's geometry.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from scipy.special import entr

from autoseg.core.artifacts import Artifact, atomic_write_text, remove_stale_temporaries
from autoseg.core.errors import InputError
from autoseg.dataset.imageio import Geometry, write_image
from autoseg.dataset.labels import LabelScheme
from autoseg.model.agreement import Agreement, AgreementCounter
from autoseg.preprocess.store import CaseProperties

if TYPE_CHECKING:
    from autoseg.predict.case_review import CaseReview
    from autoseg.predict.networks import Predictor

log = logging.getLogger("autoseg")

ROWS = "uncertainty"  # the folder of the per-case rows, in the output folder
CSV_NAME = "uncertainty.csv"
MAP_SUFFIX = "_uncertainty.nii.gz"
SCORE = "mean normalized entropy in the predicted foreground"  # what ``CaseUncertainty.score`` is
# A case whose score is above this is listed to review first: its average foreground voxel is as unsure as a
# two-class voxel at p = 0.92 or less (in benchmarks/uncertainty.py it lists the 5 of 12 cases of lowest Dice)
# 0.9 (docs/prediction.md, Uncertainty)
REVIEW_THRESHOLD = 0.4
_ENTROPY_LEVELS = 255  # the saved map's uint8 steps
_SMALL_OBJECTS_BYTES = 4096  # the maps' headers, the list of sums: what tracemalloc counts beside the arrays
ASSEMBLY_TRIES = 20  # assemblies while other parts keep adding rows


@dataclass(frozen=True)
class UncertaintyOptions:
    """``predict``'s uncertainty: computed wherever the ensemble has two or more members (``enabled``), the cases
    above ``threshold`` logged to review first (``--review-threshold``), the voxel map written (``save_map``,
    ``--save-uncertainty``)."""

    enabled: bool = True
    threshold: float = REVIEW_THRESHOLD
    save_map: bool = False


@dataclass(frozen=True)
class CaseUncertainty(Artifact):
    """One case's row: the members compared (``members`` ``of`` folds or variants), ``score`` (``SCORE``; without
    foreground: ``disagreement``), per structure the members' mean pairwise Dice (None: no member predicts it), and
    ``entropy``: the mean normalized entropy of the averaged probabilities inside the predicted foreground (None: no
    foreground)."""

    SCHEMA_VERSION = 1
    KIND = "case uncertainty"

    case_id: str
    of: str
    members: int
    score: float
    disagreement: float  # 1 - the members' mean pairwise Dice over the structures some member predicts
    dice: dict[str, float | None]
    entropy: float | None
    foreground_voxels: int


def case_agreement(
    num_folds: int, num_variants: int, scheme: LabelScheme, options: UncertaintyOptions
) -> Agreement | None:
    """What a case's uncertainty compares: the folds (two or more), else one fold's mirror variants (two or more);
    None without two members (said in the log by ``announce``) or when not ``options.enabled``."""
    if not options.enabled:
        return None
    if num_folds >= 2:
        return Agreement("folds", num_folds, scheme.has_regions)
    if num_variants >= 2:
        return Agreement("variants", num_variants, scheme.has_regions)
    return None


def announce(agreement: Agreement | None, options: UncertaintyOptions) -> None:
    """Say once what the run's uncertainty compares; refuse ``--save-uncertainty`` with one member or with
    ``--no-uncertainty``."""
    if options.save_map and not options.enabled:
        raise InputError("--save-uncertainty does not go with --no-uncertainty; drop one of them")
    if agreement is not None:
        log.info("uncertainty: the %d %s' disagreement per case (%s)", agreement.members, agreement.of, CSV_NAME)
    elif options.save_map:
        raise InputError(
            "--save-uncertainty needs two or more folds (or mirror variants) to compare; this model predicts with "
            "one fold and no mirror variant: train more folds (`autoseg train fold 0 1 2 3 4`), pass --folds with "
            "two or more, or drop --save-uncertainty"
        )
    elif options.enabled:
        log.info("uncertainty: one fold and no mirror variant, nothing to compare; no %s", CSV_NAME)


class EntropyMap:
    """The normalized entropy of a case's averaged probabilities in the input's grid, built from the export's
    resampled maps as they pass (``add``: ``SlabExport``'s ``on_output``, each output's map of a block of slices in
    turn): uint8 over the uncropped image (255: the largest entropy; 0 outside the crop), and three float32 maps of
    the block being exported. ``logits``: the maps are the averaged logits (``LabelScheme.resample_logits``): the
    entropy of their softmax is kept as a running log-sum-exp; regions' entropy is their binary entropies' mean."""

    def __init__(self, props: CaseProperties, scheme: LabelScheme, logits: bool = False) -> None:
        self.full = np.zeros(props.shape_before_crop, dtype=np.uint8)
        self.cropped = self.full[tuple(slice(a, b) for a, b in props.crop_bbox)]
        self.scheme, self.logits, self.done = scheme, logits, 0
        self.sums: list[np.ndarray] = []
        k = scheme.num_outputs
        self.largest = math.log(2) * k if scheme.has_regions else math.log(max(k, 2))

    def add(self, k: int, resampled: np.ndarray) -> None:
        """Output ``k``'s map (n, Y, X) float32 of the next block of slices; the block is finished at the last."""
        if self.logits and not self.scheme.has_regions:
            self._add_logit(k, resampled)
        else:
            p = _sigmoid(resampled) if self.logits else resampled
            term = entr(p)
            if self.scheme.has_regions:  # a region's binary entropy: its absence's term too
                absent = np.subtract(1, p, dtype=np.float32)
                term += entr(absent, out=absent)
                del absent
            if k == 0:
                self.sums = [term]
            else:
                self.sums[0] += term
        if k == self.scheme.num_outputs - 1:
            entropy = self._entropy()  # the block's own map: scaled in place
            n = entropy.shape[0]
            entropy *= _ENTROPY_LEVELS / self.largest
            np.clip(entropy, 0, _ENTROPY_LEVELS, out=entropy)
            self.cropped[self.done : self.done + n] = np.rint(entropy, out=entropy)
            self.done += n
            self.sums = []

    def _add_logit(self, k: int, logit: np.ndarray) -> None:
        """Running softmax entropy: maximum m, s = sum exp(l - m), t = sum exp(l - m) l; H = m + log s - t / s. In
        place: four maps of the block at most."""
        if k == 0:
            self.sums = [logit.copy(), np.ones_like(logit), logit.copy()]
            return
        m, s, t = self.sums
        higher = np.maximum(m, logit)
        np.subtract(m, higher, out=m)
        rescale = np.exp(m, out=m)  # the sums so far, rescaled to the new maximum
        s *= rescale
        t *= rescale
        new = np.exp(np.subtract(logit, higher, out=m), out=m)
        s += new
        new *= logit
        t += new
        self.sums = [higher, s, t]

    def _entropy(self) -> np.ndarray:
        if self.logits and not self.scheme.has_regions:
            m, s, t = self.sums
            t /= s
            np.log(s, out=s)
            s += m
            s -= t
            return np.maximum(s, 0, out=s)
        return self.sums[0]

    def mean_inside(self, labels: np.ndarray) -> float | None:
        """The mean normalized entropy where ``labels`` (the case's label map, uncropped) is foreground; None where
        it has none. One slice at a time."""
        total, count = 0.0, 0
        for z in range(labels.shape[0]):
            inside = labels[z] > 0
            count += int(inside.sum())
            total += float(self.full[z][inside].sum(dtype=np.int64))
        return total / count / _ENTROPY_LEVELS if count else None


def _sigmoid(logit: np.ndarray) -> np.ndarray:
    """float32 sigmoid of ``logit`` as a new map."""
    out = np.negative(logit)
    np.exp(out, out=out)
    out += 1.0
    return np.reciprocal(out, out=out)


@dataclass
class UncertaintyParts:
    """What one case's uncertainty is made of while it is predicted: the agreement's counter (the sliding window's)
    and the entropy map (the export's)."""

    counter: AgreementCounter
    entropy: EntropyMap
    save_map: bool = False  # --save-uncertainty: the entropy map is written too


def case_row(case_id: str, parts: UncertaintyParts, labels: np.ndarray, scheme: LabelScheme) -> CaseUncertainty:
    """``case_id``'s row from its finished ``parts`` and its label map as written."""
    agreement = parts.counter.agreement
    dice = parts.counter.pairwise_dice()
    names = {c: scheme.names[c if agreement.regions else c - 1] for c in dice}
    predicted = [d for d in dice.values() if not math.isnan(d)]
    disagreement = 1 - sum(predicted) / len(predicted) if predicted else 0.0
    entropy = parts.entropy.mean_inside(labels)
    return CaseUncertainty(
        case_id=case_id,
        of=agreement.of,
        members=agreement.members,
        score=float(disagreement if entropy is None else entropy),
        disagreement=float(disagreement),
        dice={names[c]: (None if math.isnan(d) else d) for c, d in dice.items()},
        entropy=entropy,
        foreground_voxels=int(np.count_nonzero(labels)),
    )


def paths(output_dir: Path, case_id: str, save_map: bool) -> list[Path]:
    """The files a case's uncertainty writes: its row and, with ``save_map``, its voxel map."""
    row = Path(output_dir) / ROWS / f"{case_id}.json"
    return [row] + ([Path(output_dir) / f"{case_id}{MAP_SUFFIX}"] if save_map else [])


def write_case_uncertainty(
    output_dir: Path, row: CaseUncertainty, entropy: EntropyMap, geometry: Geometry, save_map: bool
) -> None:
    """Write ``row`` (atomically) and, with ``save_map``, the entropy map in ``geometry`` (atomically) first."""
    row_path, *map_path = paths(output_dir, row.case_id, save_map)
    if map_path:
        write_image(map_path[0], entropy.full, geometry)
    row_path.parent.mkdir(parents=True, exist_ok=True)
    row.to_json(row_path)


def assemble_uncertainty(output_dir: Path, threshold: float) -> list[CaseUncertainty]:
    """Write ``uncertainty.csv`` from every row in ``output_dir``'s ``uncertainty/`` folder (case id order; rewritten
    while other parts add rows, as ``autoseg.review.statistics.assemble_statistics`` does) and log the cases whose
    score is above ``threshold``, worst first; the rows."""
    folder = Path(output_dir) / ROWS
    rows: list[CaseUncertainty] = []
    listed = None
    for _ in range(ASSEMBLY_TRIES):
        names = sorted(p.name for p in folder.glob("*.json") if not p.name.startswith(".")) if folder.is_dir() else []
        if names == listed:
            break
        listed = names
        rows = [CaseUncertainty.from_json(folder / n) for n in names]
        if rows:
            atomic_write_text(Path(output_dir) / CSV_NAME, uncertainty_csv(rows))
    review = sorted((r for r in rows if r.score > threshold), key=lambda r: -r.score)
    if review:
        log.warning(
            "review first: %d of %d case(s) with uncertainty above %.3g (worst first):\n  %s",
            len(review),
            len(rows),
            threshold,
            "\n  ".join(f"{r.case_id}: {r.score:.3f}" for r in review),
        )
    return rows


def uncertainty_csv(rows: list[CaseUncertainty]) -> str:
    """case, score, entropy, disagreement, of, members, foreground_voxels, then ``dice_{structure}`` of every structure
    (empty where no member predicts it)."""
    structures = sorted({s for r in rows for s in r.dice})
    header = ["case", "score", "entropy", "disagreement", "of", "members", "foreground_voxels"]
    header += [f"dice_{s}" for s in structures]
    lines = [",".join(header)]
    for r in sorted(rows, key=lambda r: r.case_id):
        dice = [r.dice.get(s) for s in structures]
        cells = [r.case_id, f"{r.score:.6f}", _cell(r.entropy), f"{r.disagreement:.6f}", r.of, str(r.members)]
        cells.append(str(r.foreground_voxels))
        lines.append(",".join(cells + [_cell(d) for d in dice]))
    return "\n".join(lines) + "\n"


def _cell(value: float | None) -> str:
    return "" if value is None else f"{value:.6f}"


def entropy_map_bytes(shape_zyx_original: tuple[int, ...], block_voxels: int) -> int:
    """Host bytes of ``EntropyMap``: its uint8 map of the uncropped image, held from the export to the write, and,
    while a block is exported, its running sums and an output's temporaries (at most four float32 maps of the block:
    a softmax of logits keeps three and makes the new maximum while an output is added; regions hold the sum, an
    output's sigmoid, its entropy and its absence's)."""
    return math.prod(shape_zyx_original) + 4 * 4 * block_voxels + _SMALL_OBJECTS_BYTES


def start(predictor: Predictor, options: UncertaintyOptions | None, props: CaseProperties) -> UncertaintyParts | None:
    """The empty parts of one case's uncertainty with ``predictor`` as ``options`` say (None: none), or None (the export
    hands the entropy map logits where the scheme resamples them)."""
    agreement = None if options is None else predictor_agreement(predictor, options)
    if agreement is None:
        return None
    scheme = predictor.plans.label_scheme
    counter, entropy = (
        AgreementCounter(agreement, scheme.num_outputs),
        EntropyMap(props, scheme, scheme.resample_logits),
    )
    return UncertaintyParts(counter, entropy, options.save_map)


def predictor_agreement(predictor: Predictor, options: UncertaintyOptions) -> Agreement | None:
    """What each case's uncertainty compares with ``predictor``'s folds and mirror variants (``case_agreement``)."""
    scheme, config = predictor.plans.label_scheme, predictor.config
    return case_agreement(len(predictor.runners), predictor.window.num_variants(config), scheme, options)


def resolve(predictor: Predictor, options: UncertaintyOptions, save_probabilities: bool) -> UncertaintyOptions:
    """``options`` as they apply to ``predictor``: enabled only with two or more members to compare (said in the log
    once, ``announce``; ``--save-uncertainty`` with one is refused), and not with ``save_probabilities`` (whose export
    is the probabilities held whole, not the slab export the entropy map follows)."""
    agreement = predictor_agreement(predictor, options)
    announce(agreement, options)
    if agreement is not None and save_probabilities:
        if options.save_map:
            raise InputError("--save-uncertainty does not go with --save-probabilities; drop one of them")
        log.info("uncertainty: not computed with --save-probabilities")
        agreement = None
    return replace(options, enabled=agreement is not None)


def write_after(
    write: Callable[[], np.ndarray], case: tuple[str, UncertaintyParts | None, Geometry], output_dir: Path
) -> np.ndarray:
    """``write`` the label map, then, where the case has uncertainty parts (``start``), its row (and its map, where
    asked) from it; the label map."""
    labels = write()
    case_id, parts, geometry = case
    if parts is not None:
        row = case_row(case_id, parts, labels, parts.entropy.scheme)
        write_case_uncertainty(output_dir, row, parts.entropy, geometry, parts.save_map)
    return labels


def outputs(output_dir: Path, case_id: str, options: UncertaintyOptions) -> list[Path]:
    """What ``--continue`` needs of a case's uncertainty (``paths``; none where it is not computed)."""
    return paths(output_dir, case_id, options.save_map) if options.enabled else []


def finish(review: CaseReview, output_dir: Path, options: UncertaintyOptions) -> None:
    """At the end of a run, from every case's rows: ``review``'s statistics (``CaseReview.finish``), then
    ``uncertainty.csv`` and the cases to review first (``assemble_uncertainty``)."""
    review.finish()
    if options.enabled:
        assemble_uncertainty(output_dir, options.threshold)


def held_beside(review: CaseReview, agreement: Agreement | None, shape_zyx: tuple[int, ...]) -> int:
    """Bytes held beside a written label map of ``shape_zyx`` (``LabelWrite.reviewed``): its review's
    (``CaseReview.held_bytes``) and, with ``agreement``, the entropy map (``entropy_map_bytes``, its block's maps
    counted as one slice's)."""
    held = review.held_bytes(shape_zyx) if review.active else 0
    return held + (0 if agreement is None else entropy_map_bytes(shape_zyx, math.prod(shape_zyx[1:])))


def remove_stale(output_dir: Path, case_ids: list[str]) -> None:
    """Remove the temporaries a killed run left of the cases' maps and rows (``remove_stale_temporaries``)."""
    remove_stale_temporaries(output_dir, [p.name for c in case_ids for p in paths(output_dir, c, save_map=True)[1:]])
    remove_stale_temporaries(Path(output_dir) / ROWS)  # autoseg's own folder: every temporary there is a killed run's
