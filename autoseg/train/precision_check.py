"""Making the bf16 agreement check a fold carries (``autoseg.predict.precision_check.PrecisionCheck``): its
validation cases predicted from their preprocessed data in fp32 (torch) and in bf16 (torch autocast; OpenVINO when
the openvino extra is installed), each scored against the ground truth by ``autoseg evaluate``'s Dice.

Made at the end of ``autoseg train`` (``check_after_validation``: on the final validation's cases and ``--tta``,
within what is left of a time budget; ``--no-precision-check`` skips it) and by ``autoseg export-model`` for a fold
whose check is missing or stale (``ExportChecks``). Only on a CPU with native bf16 (``native_bf16_flag``): elsewhere
bf16 cannot be measured, the fold carries no check, and ``--precision auto`` never takes bf16 for it. Cascade stages
are left out (their input needs the previous stage's label maps), with a log line.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from autoseg.core.errors import InputError
from autoseg.core.extras import RUNTIMES, installed
from autoseg.core.precision import native_bf16_flag
from autoseg.core.workspace import Workspace
from autoseg.dataset.labels import IGNORE, LabelValue, foreground_entries
from autoseg.dataset.raw import load_dataset
from autoseg.evaluate.files import read_label_map
from autoseg.evaluate.metrics import case_dice, mean_dice
from autoseg.plan.plans import Plans
from autoseg.predict.case import predict_labels
from autoseg.predict.graphs import file_digest
from autoseg.predict.networks import Predictor
from autoseg.predict.precision_check import (
    CheckedCheckpoint,
    PrecisionCheck,
    precision_check_path,
    stored_check,
)
from autoseg.predict.runners import load_predictor
from autoseg.predict.runtime_choice import runtime_precisions
from autoseg.predict.window import WindowOptions, default_tta
from autoseg.preprocess.store import open_case
from autoseg.train.fold_data import fold_cases
from autoseg.train.run_record import FinalValidation

log = logging.getLogger("autoseg")
FP32 = ("torch", "fp32")  # the reference every bf16 runtime is compared with


def bf16_runtimes() -> tuple[str, ...]:
    """The runtimes whose bf16 a check measures: torch (autocast) always, OpenVINO with its extra installed."""
    return tuple(
        runtime
        for runtime, (module, _) in RUNTIMES.items()
        if "bf16" in runtime_precisions(runtime) and installed(module) and (runtime == "torch" or installed("onnx"))
    )


def why_not_checkable(plans: Plans, config_name: str) -> str | None:
    """Why ``config_name``'s folds cannot be checked here (no native bf16, a cascade stage), or None."""
    if native_bf16_flag() is None:
        return "this CPU has no native bf16 (avx512_bf16 or amx_bf16), so bf16 cannot be checked here"
    if plans.configuration(config_name).previous_stage:
        return "a cascade stage is not checked (its input needs the previous stage's label maps)"
    return None


def run_precision_check(
    workspace: Workspace,
    plans: Plans,
    config_name: str,
    fold: int | str,
    checkpoint: str = "final",
    cases: tuple[str, ...] | None = None,
    tta: str | None = None,
) -> PrecisionCheck | None:
    """Predict ``cases`` (default: the fold's validation cases) with the fold's ``checkpoint_<checkpoint>.pt`` in
    fp32 and in bf16 with every ``bf16_runtimes``, mirrored as ``tta`` (default: the CPU's ``--tta``), and write the
    check to ``results/<config>/fold_<k>/precision_check.json`` (atomically); returns it. None, with a log line
    saying why, where ``why_not_checkable`` finds a reason."""
    if (reason := why_not_checkable(plans, config_name)) is not None:
        log.info("bf16 agreement check of fold %s of %s: not made: %s", fold, config_name, reason)
        return None
    t0 = time.perf_counter()
    config = plans.configuration(config_name)
    case_ids = cases if cases is not None else tuple(fold_cases(workspace, config.data_configuration, fold)[1])
    if not case_ids:  # a check of no case would pass without a figure
        log.info("bf16 agreement check of fold %s of %s: not made: no validation case", fold, config_name)
        return None
    tta = tta or default_tta("cpu")
    runs = [FP32, *((runtime, "bf16") for runtime in bf16_runtimes())]
    predictors = {
        (runtime, precision): load_predictor(
            workspace,
            plans,
            config,
            (fold,),
            checkpoint,
            WindowOptions(device="cpu", tta=tta, runtime=runtime, precision=precision),
        )
        for runtime, precision in runs
    }
    foreground, per_case = _case_dice(workspace, config.data_configuration, case_ids, predictors)
    identity = CheckedCheckpoint(
        config_name,
        fold,
        checkpoint,
        file_digest(workspace.checkpoint(config_name, fold, checkpoint)),
        tuple(case_ids),
        tuple(foreground),
        tta,
    )
    bf16 = {run[0]: mean_dice(per_case[run])[0] for run in runs if run != FP32}
    check = PrecisionCheck.of(identity, mean_dice(per_case[FP32])[0], bf16)
    check.to_json(precision_check_path(workspace, config_name, fold))
    for runtime in bf16:
        log.info("bf16 agreement check of fold %s of %s: %s", fold, config_name, check.describe(runtime))
    log.info("bf16 agreement check: %d run(s) built and run in %.1f s", len(runs), time.perf_counter() - t0)
    return check


def _case_dice(
    workspace: Workspace, data_config: str, case_ids: tuple[str, ...], predictors: dict[tuple[str, str], Predictor]
) -> tuple[dict[str, LabelValue], dict[tuple[str, str], list[dict[str, float]]]]:
    """The foreground classes, and each run's Dice per class (``case_dice``) of each of ``case_ids``: the case's
    preprocessed data (``preprocessed/<data_config>/``) predicted by that run's predictor, against its raw label
    map."""
    dataset = load_dataset(workspace.dataset_root())
    foreground, ignore = foreground_entries(dataset.labels), dataset.labels.get(IGNORE)
    references = {c.case_id: c.label_path for c in dataset.cases}
    if missing := [c for c in case_ids if references.get(c) is None]:
        raise InputError(
            f"{dataset.root}: no reference label map of validation case(s) {', '.join(missing)}; the dataset changed "
            "since the workspace was preprocessed: run plan_and_preprocess on it again with --overwrite"
        )
    per_case: dict[tuple[str, str], list[dict[str, float]]] = {run: [] for run in predictors}
    seconds: dict[tuple[str, str], float] = {}
    folder = workspace.preprocessed(data_config)
    for case_id in case_ids:
        stored = open_case(folder, case_id)
        data = np.asarray(stored.arrays()[0], dtype=np.float32)  # (C, Z, Y, X): read once, predicted by each run
        reference = read_label_map(references[case_id], "reference")[0]
        for run, predictor in predictors.items():
            t0 = time.perf_counter()
            labels = predict_labels(data, stored.properties, case_id, predictor)
            seconds[run] = seconds.get(run, 0.0) + time.perf_counter() - t0
            per_case[run].append(case_dice(labels, reference, foreground, ignore, where=case_id))
    log.info(
        "bf16 agreement check: %d case(s) predicted in %s",
        len(case_ids),
        ", ".join(
            f"{runtime} {precision} {seconds.get((runtime, precision), 0.0):.1f} s" for runtime, precision in predictors
        ),
    )
    return foreground, per_case


def check_after_validation(
    workspace: Workspace,
    plans: Plans,
    config_name: str,
    fold: int | str,
    final: FinalValidation,
    validation_seconds: float,
    seconds_left: float | None,
) -> PrecisionCheck | None:
    """The check at the end of training, on the final validation's cases and ``--tta``; under a time budget
    (``seconds_left`` not None) only when what is left of it covers one final validation (``validation_seconds``,
    which reads and preprocesses the raw images too) per run the check makes, else a log line says it is left to
    ``export-model``."""
    needed_seconds = (1 + len(bf16_runtimes())) * validation_seconds
    if seconds_left is not None and seconds_left < needed_seconds:
        log.info(
            "bf16 agreement check of fold %s of %s: not made: the time budget leaves %.0f s, it needs about %.0f s; "
            "`%s` makes it",
            fold,
            config_name,
            max(0.0, seconds_left),
            needed_seconds,
            workspace.advice(f"export-model model.zip -c {config_name} -f {fold}"),
        )
        return None
    return run_precision_check(workspace, plans, config_name, fold, "final", final.cases, final.tta)


def fresh_check(
    workspace: Workspace, plans: Plans, config_name: str, fold: int | str, checkpoint: str
) -> tuple[PrecisionCheck | None, str]:
    """The fold's stored check if it belongs to its checkpoint_<checkpoint>.pt (``stored_check``); else None and why
    (none, another checkpoint's, damaged)."""
    try:
        stored = stored_check(workspace, plans, config_name, fold, checkpoint)
    except InputError as e:
        return None, f"its stored check is unreadable ({str(e).splitlines()[0][:200]})"
    if stored is None:
        return None, f"no stored check of its checkpoint_{checkpoint}.pt (none made, or the fold was trained again)"
    return stored, "stored"


@dataclass(frozen=True)
class CheckOutcome:
    """What ``export-model`` did about one fold's check: ``check`` (packed) or None, and ``how`` ("stored", "made
    now") or why there is none."""

    configuration: str
    fold: int | str
    check: PrecisionCheck | None
    how: str

    def describe(self) -> list[str]:
        """Lines for the command's output: the figures per bf16 runtime, or why the fold is not checked."""
        what = f"fold {self.fold} of {self.configuration}"
        if self.check is None:
            return [f"{what}: bf16 not checked: {self.how}; --precision auto predicts it in fp32"]
        return [f"{what}: bf16 checked ({self.how}): {self.check.describe(r)}" for r in sorted(self.check.bf16_dice)]


@dataclass
class ExportChecks:
    """The check ``export-model`` packs beside each fold's checkpoint (``precision_checks`` of
    ``autoseg.predict.archive.export_model``): the stored one where it is fresh (``fresh_check``), else made now
    unless ``run`` is False (``--no-precision-check``); each fold's ``CheckOutcome`` in ``outcomes``."""

    run: bool = True
    outcomes: list[CheckOutcome] = field(default_factory=list)

    def __call__(
        self, workspace: Workspace, plans: Plans, config_name: str, fold: int | str, checkpoint: str
    ) -> PrecisionCheck | None:
        check, how = fresh_check(workspace, plans, config_name, fold, checkpoint)
        if check is None and (reason := why_not_checkable(plans, config_name)) is not None:
            how = reason
        elif check is None and not self.run:
            how = f"{how}, and --no-precision-check skips making one"
        elif check is None:
            try:
                check, how = run_precision_check(workspace, plans, config_name, fold, checkpoint), "made now"
            except InputError as e:  # e.g. the raw dataset moved: the model is exported all the same, unchecked
                log.warning("bf16 agreement check of fold %s of %s: not made: %s", fold, config_name, e)
                how = f"it could not be made ({str(e).splitlines()[0][:200]})"
        self.outcomes.append(CheckOutcome(config_name, fold, check, how))
        return check
