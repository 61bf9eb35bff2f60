"""End of a fold: predict its validation cases from the raw images and evaluate them. A cascade stage's input takes
each case's previous-stage label map from that stage's final validation (``fold_data.previous_stage_label_file``),
as its training did."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from tqdm import tqdm

from autoseg.core.workspace import Workspace
from autoseg.dataset.imageio import read_image, write_image
from autoseg.dataset.raw import Case, load_dataset
from autoseg.evaluate.metrics import EvaluationSummary, evaluate_pairs, format_table
from autoseg.plan.plans import Plans
from autoseg.predict.case import predict_case
from autoseg.predict.networks import Predictor
from autoseg.predict.window import WindowOptions, default_tta
from autoseg.train.fold_data import previous_stage_label_file
from autoseg.train.run_record import FinalValidation
from autoseg.train.schedule import TimeBudget

log = logging.getLogger("autoseg.train.trainer")


def final_validation(val_ids: list[str], device: str, budget: TimeBudget | None) -> FinalValidation:
    """The cases and ``--tta`` the final validation predicts (all cases, the device's default ``--tta``), or under a
    time budget the budget's choice, its estimate and whether it was reduced."""
    tta = default_tta(device)
    if budget is None:
        return FinalValidation(tuple(val_ids), tta)
    choice = budget.validation
    reduced = len(choice.case_ids) < len(val_ids) or choice.tta != tta
    return FinalValidation(choice.case_ids, choice.tta, choice.seconds, reduced)


def validate_fold(
    workspace: Workspace,
    plans: Plans,
    config_name: str,
    network: torch.nn.Module,
    final: FinalValidation,
    out_dir: Path,
    device: str,
    progress: bool = True,
) -> EvaluationSummary:
    """Sliding-window prediction of ``final``'s cases (mirror variants: its ``tta``, the ``--tta`` value) into
    ``out_dir``: each case's label map and its
    probabilities (``{case}.npz``, ``autoseg.predict.probabilities.ProbabilityFile``: what choosing between
    configurations, ensembles and postprocessing reads, with no second inference pass), then
    ``out_dir/summary.json`` against the raw labels."""
    val_ids, tta = final.cases, final.tta
    dataset = load_dataset(workspace.dataset_root())
    config = plans.configuration(config_name)
    cases = [c for c in dataset.cases if c.case_id in set(val_ids)]
    network.eval()
    predictor = Predictor.of([network], plans, config, WindowOptions(device=device, tta=tta))
    pairs = []
    for case in tqdm(cases, desc="validation", unit="case", disable=not progress):
        out = predict_validation_case(workspace, config_name, case, predictor, out_dir, dataset.file_ending)
        pairs.append((out, case.label_path))
    summary = evaluate_pairs(
        pairs,
        dataset.labels,
        dataset.file_ending,
        out_dir / "summary.json",
        pred_dir=str(out_dir),
        gt_dir=str(dataset.root / "labelsTr"),
    )
    log.info("validation of %d case(s):\n%s", len(cases), format_table(summary))
    return summary


def predict_validation_case(
    workspace: Workspace, config_name: str, case: Case, predictor: Predictor, out_dir: Path, file_ending: str
) -> Path:
    """``case``'s label map (``out_dir/{case}{file_ending}``, returned) and probabilities (``{case}.npz``); a cascade
    stage's input takes the previous stage's label map of the case."""
    plans = predictor.plans
    previous = (
        read_image(previous_stage_label_file(workspace, plans, config_name, case.case_id), dtype=None)[0]
        if predictor.config.previous_stage
        else None
    )
    labels, props = predict_case(case, predictor, probabilities_path=out_dir / f"{case.case_id}.npz", previous=previous)
    out = out_dir / f"{case.case_id}{file_ending}"
    write_image(out, labels, props.geometry)
    return out
