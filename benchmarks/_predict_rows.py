"""The autoseg rows of benchmarks/predict.py: which runtime and precision each runs, the quality of its label maps
(Dice against the ground truth, voxel agreement with torch fp32's) and issue 27's checks over them.

A row is ``auto`` (``--runtime auto --precision auto``: what autoseg chooses by timing on this machine) or one
runtime in one precision (``--runtime R --precision P``). By default ``auto`` and every candidate it chooses from: each
installed runtime in each precision it computes on this CPU (bf16 only with native bf16).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from autoseg.core.extras import RUNTIMES, installed
from autoseg.core.units import MiB

REFERENCE = "torch fp32"  # what predict runs without a choice; every other row is measured against it
# issue 27: auto's wall time per typical case after the process's start-up (``seconds_per_case``), at most this x
# torch fp32's; the whole run's ratio, start-up included, is printed beside it
AUTO_WALL_TARGET = 0.3
FP32_WALL_TARGET = 0.6  # the best fp32-only runtime's, at most this x torch fp32's
DICE_TOLERANCE = 0.002  # every class's Dice within this of torch fp32's
AGREEMENT_TARGET = 0.999  # fp32 rows: voxels agreeing with torch fp32's label maps
RSS_RATIO_TARGET = 0.25  # large case: every row's peak RSS at most this x nnU-Net's
PREDICTION_TOLERANCE = 0.15  # predicted host peak within this of the measured peak RSS


@dataclass(frozen=True)
class Row:
    """One autoseg configuration of the runtime flags."""

    runtime: str  # "auto" or a key of autoseg.core.extras.RUNTIMES
    precision: str  # "auto", "fp32" or "bf16"

    @property
    def name(self) -> str:
        return "auto" if self.runtime == "auto" else f"{self.runtime} {self.precision}"

    @property
    def tool(self) -> str:
        return f"autoseg {self.name}"

    def predict_args(self) -> list[str]:
        return ["--runtime", self.runtime, "--precision", self.precision]


def parse_row(text: str) -> Row:
    """``auto`` or ``RUNTIME:PRECISION`` (e.g. ``openvino:bf16``) from ``--runtimes``."""
    from autoseg.predict.runtime_choice import runtime_precisions

    if text == "auto":
        return Row("auto", "auto")
    runtime, _, precision = text.partition(":")
    if runtime not in RUNTIMES or precision not in runtime_precisions(runtime):
        known = ", ".join(f"{r}:{p}" for r in RUNTIMES for p in runtime_precisions(r))
        raise SystemExit(f"--runtimes {text!r}: give auto or one of {known}")
    return Row(runtime, precision)


def default_rows() -> tuple[list[Row], list[str]]:
    """``auto`` and every candidate ``auto`` chooses from on this CPU, whatever the model's bf16 agreement check
    says (autoseg.predict.runtime_choice.candidates: each installed runtime in each precision it computes, bf16
    only with native bf16); and notes on what is left out, and why."""
    from autoseg.core.precision import native_bf16_flag
    from autoseg.predict.runtime_choice import candidates
    from autoseg.predict.window import AUTO, WindowOptions

    bf16 = native_bf16_flag() is not None
    found = candidates(WindowOptions(device="cpu", runtime=AUTO, precision=AUTO), native_bf16=bf16)
    notes = [] if bf16 else ["bf16: the CPU has no native bf16 (AVX-512 BF16 or AMX); its rows are left out"]
    notes += [
        f'{runtime}: not installed (pip install "autoseg[{extra}]"); its rows are left out'
        for runtime, (module, extra) in RUNTIMES.items()
        if not installed(module)
    ]
    return [Row("auto", "auto"), *(Row(c.runtime, c.precision) for c in found)], notes


_CHOICE = re.compile(r"\S+: runtime (\S+), precision (\S+) \(auto: (.*)")


def parse_choice(log_text: str) -> str | None:
    """What ``--runtime auto`` chose, from its choice line ("3d_fullres: runtime openvino, precision fp32 (auto:
    ..."): "openvino fp32 (auto: ...)"; None when the log has none."""
    found = _CHOICE.search(log_text)
    return None if found is None else f"{found.group(1)} {found.group(2)} (auto: {found.group(3)}"


def label_pairs(out: Path, references: dict[str, Path]) -> list[tuple[Path, Path]]:
    """(prediction, ground truth) per case: each of ``references`` (case id -> label map) with ``out/{id}.nii.gz``."""
    return [(out / f"{case_id}.nii.gz", label) for case_id, label in sorted(references.items())]


def dice_per_class(pairs: list[tuple[Path, Path]], labels: dict[str, int]) -> dict[str, float]:
    """Each foreground class's mean Dice over the cases (autoseg.evaluate: NaN where absent from both)."""
    from autoseg.evaluate.metrics import evaluate_pairs

    summary = evaluate_pairs(pairs, labels, nsd_tolerance_mm=None)
    return {name: m.dice for name, m in summary.mean.items()}


def voxel_agreement(predictions: list[Path], references: list[Path]) -> float:
    """The fraction of voxels, over all the cases, where two tools' label maps hold the same label."""
    from autoseg.evaluate.files import read_label_map

    same = total = 0
    for a, b in zip(predictions, references, strict=True):
        left, right = read_label_map(a, "prediction")[0], read_label_map(b, "reference")[0]
        same += int(np.count_nonzero(left == right))
        total += left.size
    return same / total


def add_quality(rows: list[dict], references: dict[str, dict[str, Path]], labels: dict[str, int]) -> None:
    """Set each row's ``dice`` (per class, against ``references[case]``) and, for autoseg's rows, ``agreement``
    with torch fp32's label maps of the same case."""
    by = {(r["case"], r["tool"]): r for r in rows}
    for r in rows:
        pairs = label_pairs(r["out"], references[r["case"]])
        r["dice"] = dice_per_class(pairs, labels)
        reference = by.get((r["case"], Row("torch", "fp32").tool))
        if reference is not None and r["tool"].startswith("autoseg"):
            theirs = label_pairs(reference["out"], references[r["case"]])
            r["agreement"] = voxel_agreement([p for p, _ in pairs], [p for p, _ in theirs])


def dice_delta(row: dict, reference: dict) -> float:
    """The largest |Dice difference| over the classes; a class absent from both prediction and truth (NaN) scores 1
    here, so NaN against NaN is no difference and NaN against a false positive's 0 is the largest."""
    return max(
        (
            abs(float(np.nan_to_num(row["dice"][k], nan=1.0) - np.nan_to_num(d, nan=1.0)))
            for k, d in reference["dice"].items()
        ),
        default=0.0,
    )


def format_quality(rows: list[dict], class_names: list[str]) -> str:
    """One line per (case, tool): Dice per class, the largest difference from torch fp32, agreement, auto's choice."""
    lines = [
        "| case | tool | mean Dice | Dice per class (" + ", ".join(class_names) + ") | max abs Dice difference "
        f"from {REFERENCE} (target <= {DICE_TOLERANCE}) | voxels agreeing with {REFERENCE} | auto chose |",
        "|---|---|---|---|---|---|---|",
    ]
    by = {(r["case"], r["tool"]): r for r in rows}
    for r in rows:
        reference = by.get((r["case"], Row("torch", "fp32").tool))
        delta = (
            "-" if reference is None or r is reference or "agreement" not in r else f"{dice_delta(r, reference):.4f}"
        )
        agreement = f"{r['agreement']:.4%}" if "agreement" in r and r is not reference else "-"
        dice = " ".join("n/a" if math.isnan(r["dice"][k]) else f"{r['dice'][k]:.3f}" for k in class_names)
        mean = np.nanmean(list(r["dice"].values())) if any(not math.isnan(v) for v in r["dice"].values()) else math.nan
        lines.append(
            f"| {r['case']} | {r['tool']} | {mean:.3f} | {dice} | {delta} | {agreement} | {r.get('choice') or '-'} |"
        )
    return "\n".join(lines)


def runtime_checks(rows: list[dict]) -> list[str]:
    """Issue 27's targets over the summarized rows, one line each ending in pass or FAIL."""
    by = {(r["case"], r["tool"]): r for r in rows}
    lines = []
    for case in dict.fromkeys(r["case"] for r in rows):
        reference = by.get((case, Row("torch", "fp32").tool))
        ours = [r for r in rows if r["case"] == case and r["tool"].startswith("autoseg")]
        if reference is not None:
            lines += _speed_checks(case, ours, reference) + _quality_checks(case, ours, reference)
        lines += _memory_checks(case, ours, by.get((case, "nnU-Net v2")))
    return lines


def _verdict(ok: bool) -> str:
    return "pass" if ok else "FAIL"


def startup_seconds(r: dict) -> float:
    """Wall seconds of ``r``'s run before its first tile call on a case: the interpreter, the imports, the model's
    loading, the runtime's build (``auto``'s timing of its candidates when not kept) and the first case's reading.
    Paid once per process whatever the number of cases."""
    return r["seconds"] - (r["in_process_s"] - (r["first_forward_s"] or 0.0))


def seconds_per_case(r: dict) -> float:
    """Wall seconds per case after the start-up (``startup_seconds``): what each further case of a cohort costs."""
    return (r["seconds"] - startup_seconds(r)) / r["cases"]


def _whole_per_case(r: dict) -> float:
    return r["seconds"] / r["cases"]


def _speed_checks(case: str, ours: list[dict], reference: dict) -> list[str]:
    if case != "typical":
        return []
    lines = []
    auto = next((r for r in ours if r["tool"] == Row("auto", "auto").tool), None)
    if auto is not None:
        chose = (auto.get("choice") or "?").split(" (")[0]
        lines.append(_speed_line(f"auto ({chose})", auto, reference, AUTO_WALL_TARGET))
    fp32 = [r for r in ours if r["tool"].endswith(" fp32") and r is not reference]
    if fp32:
        best = min(fp32, key=seconds_per_case)
        lines.append(_speed_line(f"best fp32-only runtime ({best['tool']})", best, reference, FP32_WALL_TARGET))
    return lines


def _speed_line(what: str, r: dict, reference: dict, target: float) -> str:
    """``r``'s seconds per typical case after start-up against ``reference``'s (the target's measure), and the
    whole run's ratio, start-up included."""
    q = seconds_per_case(r) / seconds_per_case(reference)
    whole = _whole_per_case(r) / _whole_per_case(reference)
    return (
        f"typical: {what} {seconds_per_case(r):.2f} s per case after a start-up of {startup_seconds(r):.1f} s = "
        f"{q:.2f}x {REFERENCE}'s {seconds_per_case(reference):.2f} s (start-up {startup_seconds(reference):.1f} s; "
        f"whole run {whole:.2f}x) (target <= {target}): {_verdict(q <= target)}"
    )


def _quality_checks(case: str, ours: list[dict], reference: dict) -> list[str]:
    lines = []
    for r in ours:
        if r is reference:
            continue
        delta = dice_delta(r, reference)
        lines.append(
            f"{case}: {r['tool']}: every class's Dice within {DICE_TOLERANCE} of {REFERENCE} (largest difference "
            f"{delta:.4f}): {_verdict(delta <= DICE_TOLERANCE)}"
        )
        if r["tool"].endswith(" fp32"):
            lines.append(
                f"{case}: {r['tool']}: voxels agreeing with {REFERENCE} {r['agreement']:.4%} (target >= "
                f"{AGREEMENT_TARGET:.1%}): {_verdict(r['agreement'] >= AGREEMENT_TARGET)}"
            )
    return lines


def _memory_checks(case: str, ours: list[dict], nnunet: dict | None) -> list[str]:
    lines = []
    for r in ours:
        if case == "large" and nnunet is not None:
            q = r["peak_rss_bytes"] / nnunet["peak_rss_bytes"]
            lines.append(
                f"large: {r['tool']} peak RSS {r['peak_rss_bytes'] / MiB:.0f} MiB = {q:.3f}x nnU-Net's "
                f"{nnunet['peak_rss_bytes'] / MiB:.0f} MiB (target <= {RSS_RATIO_TARGET}): "
                f"{_verdict(q <= RSS_RATIO_TARGET)}"
            )
        if r.get("predicted_bytes"):
            q = r["predicted_bytes"] / r["peak_rss_bytes"]
            lines.append(
                f"{case}: {r['tool']} predicted host peak {r['predicted_bytes'] / MiB:.0f} MiB / measured peak RSS "
                f"{r['peak_rss_bytes'] / MiB:.0f} MiB = {q:.2f} (target within {PREDICTION_TOLERANCE:.0%}): "
                f"{_verdict(abs(q - 1) <= PREDICTION_TOLERANCE)}"
            )
    return lines
