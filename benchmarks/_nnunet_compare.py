"""How closely autoseg's predictions of an imported nnU-Net v2 model follow nnU-Net's own, per case
(benchmarks/nnunet_import.py): voxels agreeing on the union of both outputs' foreground, the Dice between the two
outputs per class (autoseg.evaluate with nnU-Net's output as the reference), each tool's Dice against the ground
truth, and issue 29's verdicts over them."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

UNION_AGREEMENT_TARGET = 0.99  # voxels agreeing on the union of both outputs' foreground, per case
PAIR_DICE_TARGET = 0.99  # Dice between the two outputs, per case and class
TRUTH_DICE_TARGET = 0.9  # nnU-Net's Dice against the ground truth on the largest structure
RSS_RATIO_TARGET = 0.3  # autoseg torch fp32's peak RSS at most this x nnU-Net's
WALL_RATIO_TARGET = 0.7  # autoseg torch fp32's wall time at most this x nnU-Net's


def union_agreement(a: np.ndarray, b: np.ndarray) -> tuple[int, int]:
    """(voxels holding the same label, voxels in the union of both label maps' foreground); both (Z, Y, X) ints."""
    if a.shape != b.shape:
        raise ValueError(f"label maps of shapes {a.shape} and {b.shape}: the outputs of one case differ in size")
    union = (a != 0) | (b != 0)
    return int(np.count_nonzero(union & (a == b))), int(np.count_nonzero(union))


def class_dice(prediction: Path, reference: Path, labels: dict[str, int]) -> dict[str, float]:
    """Dice per foreground class of one case (autoseg.evaluate; NaN where the class is absent from both)."""
    from autoseg.evaluate.metrics import evaluate_pairs

    summary = evaluate_pairs([(prediction, reference)], labels, nsd_tolerance_mm=None)
    return {name: m.dice for name, m in summary.cases[0].classes.items()}


def compare_case(autoseg_out: Path, nnunet_out: Path, truth: Path, labels: dict[str, int]) -> dict:
    """One case's two label maps against each other and against ``truth``: ``agree``/``union`` voxels,
    ``pair_dice`` (autoseg vs nnU-Net per class), ``autoseg_dice`` and ``nnunet_dice`` (against the truth)."""
    from autoseg.evaluate.files import read_label_map

    agree, union = union_agreement(read_label_map(autoseg_out, "autoseg")[0], read_label_map(nnunet_out, "nnU-Net")[0])
    return {
        "agree": agree,
        "union": union,
        "pair_dice": class_dice(autoseg_out, nnunet_out, labels),
        "autoseg_dice": class_dice(autoseg_out, truth, labels),
        "nnunet_dice": class_dice(nnunet_out, truth, labels),
    }


def lowest(dice: dict[str, float]) -> tuple[str, float] | None:
    """The class with the lowest Dice, leaving out those absent from both label maps (NaN); None if all are."""
    found = [(name, d) for name, d in dice.items() if not math.isnan(d)]
    return min(found, key=lambda kv: kv[1]) if found else None


def verdict(passed: bool) -> str:
    return "pass" if passed else "FAIL"


def quality_row(case: str, tool: str, q: dict, largest: str) -> str:
    """A markdown row of the quality table: agreement, the lowest pair Dice, both tools' Dice against the truth
    (``largest``'s and the mean over the classes either finds)."""
    share = q["agree"] / q["union"] if q["union"] else 1.0
    low = lowest(q["pair_dice"])
    low_text = "-" if low is None else f"{low[1]:.4f} ({low[0]}) {verdict(low[1] >= PAIR_DICE_TARGET)}"
    truth = " | ".join(
        f"{q[key][largest]:.3f} / {np.nanmean(list(q[key].values())):.3f}" for key in ("nnunet_dice", "autoseg_dice")
    )
    return (
        f"| {case} | {tool} | {share:.2%} of {q['union']} {verdict(share >= UNION_AGREEMENT_TARGET)} | {low_text} "
        f"| {truth} |"
    )


QUALITY_HEADER = (
    f"| case | autoseg | voxels agreeing on the union of foregrounds (>= {UNION_AGREEMENT_TARGET:.0%}) "
    f"| lowest Dice between the outputs, class (>= {PAIR_DICE_TARGET}) | nnU-Net Dice vs truth: largest / mean "
    "| autoseg Dice vs truth: largest / mean |\n|---|---|---|---|---|---|"
)


def ratio_text(value: float, reference: float, target: float | None) -> str:
    """``value / reference`` with a verdict against ``target`` (none when ``target`` is None)."""
    ratio = value / reference
    return f"{ratio:.2f}" + ("" if target is None else f" (<= {target}) {verdict(ratio <= target)}")
