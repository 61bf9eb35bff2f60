"""The bf16 agreement check a model carries: for one fold's checkpoint, the mean Dice per class of its validation
cases predicted in fp32 (torch) and in bf16 (per runtime: torch autocast, OpenVINO), each against the ground truth.

``PrecisionCheck`` is the artifact (``results/<config>/fold_<k>/precision_check.json``, and the archive's member of
that name beside the checkpoint); ``bf16_verdict`` is what the ``--precision auto`` chooser asks: bf16 is allowed
for a runtime only when the check belongs to this very checkpoint (its sha256) and no class's mean Dice differs
from fp32's by more than ``BF16_DICE_TOLERANCE``. The check is made by ``autoseg.train.precision_check`` (it needs
``autoseg.evaluate``'s Dice, which this package does not import) at the end of training and by ``export-model``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from autoseg.core.artifacts import Artifact
from autoseg.core.workspace import Workspace
from autoseg.plan.plans import Plans
from autoseg.predict.graphs import file_digest

PRECISION_CHECK_FILE = "precision_check.json"  # beside checkpoint_<which>.pt: results/<config>/fold_<k>/
# The most a class's mean validation Dice may differ between fp32 and bf16 for `--precision auto` to take bf16: below
# the spread of retraining a fold, above the few voxels bf16 rounding flips on a boundary (docs/prediction.md).
BF16_DICE_TOLERANCE = 0.002
UNDEFINED_IN_ONE = math.inf  # the difference of a class whose Dice is defined in one precision only


@dataclass(frozen=True)
class PrecisionCheck(Artifact):
    """One fold's checkpoint predicted in fp32 and bf16 on its validation cases. Mean Dice per class (the mean over
    the cases where the class is in the prediction or the reference, as ``autoseg evaluate`` averages; None where it
    is in neither for every case)."""

    SCHEMA_VERSION = 1
    KIND = "bf16 precision check"

    configuration: str
    fold: int | str
    checkpoint: str  # "final" or "best": the checkpoint_<checkpoint>.pt checked
    checkpoint_sha256: str  # the check belongs to this file: a fold trained again has none
    case_ids: tuple[str, ...]  # the validation cases predicted
    class_names: tuple[str, ...]  # foreground classes or regions, as evaluation names them
    tta: str  # the --tta both precisions ran with (the final validation's)
    fp32_dice: dict[str, float | None]  # torch fp32: class -> mean Dice
    bf16_dice: dict[str, dict[str, float | None]]  # runtime ("torch", "openvino") -> class -> mean Dice
    passed: dict[str, bool]  # runtime -> no class's mean Dice differs by more than ``tolerance``
    tolerance: float = BF16_DICE_TOLERANCE

    @classmethod
    def of(
        cls, identity: CheckedCheckpoint, fp32_dice: dict[str, float], bf16_dice: dict[str, dict[str, float]]
    ) -> PrecisionCheck:
        """The check of ``identity``'s checkpoint from its figures (NaN: undefined), ``passed`` decided here."""
        fp32 = {name: _defined(d) for name, d in fp32_dice.items()}
        bf16 = {runtime: {name: _defined(d) for name, d in dice.items()} for runtime, dice in bf16_dice.items()}
        passed = {
            runtime: max(_differences(fp32, dice, identity.class_names).values(), default=0.0) <= BF16_DICE_TOLERANCE
            for runtime, dice in bf16.items()
        }
        return cls(
            configuration=identity.configuration,
            fold=identity.fold,
            checkpoint=identity.checkpoint,
            checkpoint_sha256=identity.sha256,
            case_ids=identity.case_ids,
            class_names=identity.class_names,
            tta=identity.tta,
            fp32_dice=fp32,
            bf16_dice=bf16,
            passed=passed,
        )

    def differences(self, runtime: str) -> dict[str, float]:
        """|bf16 - fp32| mean Dice per class for ``runtime``: 0 where undefined in both, ``UNDEFINED_IN_ONE`` where
        undefined in one only (bf16 predicted a class fp32 never did, or the reverse)."""
        return _differences(self.fp32_dice, self.bf16_dice[runtime], self.class_names)

    def worst(self, runtime: str) -> tuple[str, float]:
        """The class whose mean Dice differs most between fp32 and ``runtime``'s bf16, and by how much."""
        differences = self.differences(runtime)
        name = max(differences, key=lambda n: differences[n], default="")
        return name, differences.get(name, 0.0)

    def describe(self, runtime: str) -> str:
        """One line: fp32 and bf16 mean Dice per class and whether it passed, e.g. "bf16 (torch) vs fp32 mean Dice
        over 5 cases: organ 0.9412 / 0.9410, lesion 0.8123 / 0.8150: passed (largest difference 0.0027, lesion)"."""
        bf16 = self.bf16_dice[runtime]
        figures = ", ".join(f"{n} {_fmt(self.fp32_dice[n])} / {_fmt(bf16.get(n))}" for n in self.class_names)
        name, difference = self.worst(runtime)
        verdict = "passed" if difference <= BF16_DICE_TOLERANCE else f"failed (more than {BF16_DICE_TOLERANCE})"
        return (
            f"fp32 / bf16 ({runtime}) mean Dice over {len(self.case_ids)} validation case(s): {figures}: {verdict}"
            f" (largest difference {_fmt(difference)}{f', {name}' if name else ''})"
        )


@dataclass(frozen=True)
class CheckedCheckpoint:
    """What a check belongs to: ``configuration``'s ``fold``, its checkpoint_<checkpoint>.pt of ``sha256``, the
    cases and classes predicted and the ``tta``."""

    configuration: str
    fold: int | str
    checkpoint: str
    sha256: str
    case_ids: tuple[str, ...]
    class_names: tuple[str, ...]
    tta: str


def precision_check_path(workspace: Workspace, config_name: str, fold: int | str) -> Path:
    """``results/<config>/fold_<k>/precision_check.json`` of ``workspace`` (an unpacked model archive too)."""
    return workspace.results(config_name, fold) / PRECISION_CHECK_FILE


def read_precision_check(workspace: Workspace, config_name: str, fold: int | str) -> PrecisionCheck | None:
    """The fold's stored check, None when it has none; a damaged file or an unknown schema is refused naming it."""
    path = precision_check_path(workspace, config_name, fold)
    return PrecisionCheck.from_json(path) if path.is_file() else None


def stored_check(
    workspace: Workspace, plans: Plans, config_name: str, fold: int | str, checkpoint: str
) -> PrecisionCheck | None:
    """The fold's stored check where it belongs to its checkpoint_<checkpoint>.pt (the file's sha256), else None
    (``plans``: unused, the signature ``autoseg.predict.archive.export_model`` calls its ``precision_checks`` with)."""
    check = read_precision_check(workspace, config_name, fold)
    if check is None or check.checkpoint_sha256 != file_digest(workspace.checkpoint(config_name, fold, checkpoint)):
        return None
    return check


def bf16_verdict(check: PrecisionCheck | None, runtime: str, checkpoint_sha256: str) -> tuple[bool, str]:
    """Whether ``--precision auto`` may run ``runtime`` in bf16 for the checkpoint of ``checkpoint_sha256``, and why:
    only with a check of that checkpoint that ran ``runtime`` in bf16 and found no class's mean Dice more than
    ``BF16_DICE_TOLERANCE`` from fp32's. The reason names the worst class and its difference, or why there is no
    check."""
    if check is None:
        return False, (
            "the model carries no bf16 agreement check (made at the end of `autoseg train` and by `autoseg "
            "export-model` on a CPU with native bf16): fp32"
        )
    what = f"fold {check.fold} of {check.configuration}"
    if check.checkpoint_sha256 != checkpoint_sha256:
        return False, (
            f"the bf16 agreement check of {what} was made for another checkpoint (sha256 "
            f"{check.checkpoint_sha256[:12]}, this one {checkpoint_sha256[:12]}: the fold was trained again): fp32; "
            "`autoseg export-model` checks it anew"
        )
    if runtime not in check.bf16_dice:
        checked = ", ".join(sorted(check.bf16_dice)) or "no runtime"
        return False, f"the bf16 agreement check of {what} ran bf16 with {checked}, not {runtime}: fp32"
    name, difference = check.worst(runtime)
    if difference > BF16_DICE_TOLERANCE:
        return False, (
            f"bf16 ({runtime}) changes the mean validation Dice of {name} in {what} by {_fmt(difference)} "
            f"(fp32 {_fmt(check.fp32_dice[name])}, bf16 {_fmt(check.bf16_dice[runtime].get(name))}), more than "
            f"{BF16_DICE_TOLERANCE}: fp32"
        )
    return True, (
        f"bf16 ({runtime}) agrees with fp32 on {what}: every class's mean validation Dice within "
        f"{BF16_DICE_TOLERANCE} (largest difference {_fmt(difference)}{f', {name}' if name else ''})"
    )


def checkpoint_bf16_verdict(checkpoint_path: Path, runtime: str) -> tuple[bool, str]:
    """``bf16_verdict`` of the check stored beside ``checkpoint_path`` (``results/<config>/fold_<k>/``, in a
    workspace or an unpacked model archive) for ``runtime``, against that file's sha256; a damaged check is refused
    naming it."""
    path = checkpoint_path.parent / PRECISION_CHECK_FILE
    check = PrecisionCheck.from_json(path) if path.is_file() else None
    return bf16_verdict(check, runtime, file_digest(checkpoint_path) if check is not None else "")


def _defined(dice: float | None) -> float | None:
    return None if dice is None or math.isnan(dice) else float(dice)


def _differences(
    fp32: dict[str, float | None], bf16: dict[str, float | None], names: tuple[str, ...]
) -> dict[str, float]:
    out = {}
    for name in names:
        a, b = fp32.get(name), bf16.get(name)
        out[name] = 0.0 if a is None and b is None else UNDEFINED_IN_ONE if a is None or b is None else abs(b - a)
    return out


def _fmt(value: float | None) -> str:
    return "undefined" if value is None else "inf" if math.isinf(value) else f"{value:.4f}"
