"""End of a fold: predict its validation cases from the raw images and evaluate them."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from tqdm import tqdm

from autoseg.core.workspace import Workspace
from autoseg.dataset.imageio import write_image
from autoseg.dataset.raw import load_dataset
from autoseg.evaluate.metrics import EvaluationSummary, evaluate_pairs, format_table
from autoseg.plan.plans import Plans
from autoseg.predict.predictor import predict_case

log = logging.getLogger("autoseg.train.trainer")


def validate_fold(workspace: Workspace, plans: Plans, config_name: str, network: torch.nn.Module,
                  val_ids: list[str], out_dir: Path, device: str, progress: bool = True) -> EvaluationSummary:
    """Sliding-window prediction (with mirroring) of each validation case into ``out_dir``: its label map and its
    probabilities (``{case}.npz``, ``autoseg.predict.probabilities.ProbabilityFile``: what choosing between
    configurations, ensembles and postprocessing reads, with no second inference pass), then
    ``out_dir/summary.json`` against the raw labels."""
    dataset = load_dataset(workspace.dataset_root())
    config = plans.configuration(config_name)
    cases = [c for c in dataset.cases if c.case_id in set(val_ids)]
    network.eval()
    pairs = []
    for case in tqdm(cases, desc="validation", unit="case", disable=not progress):
        labels, props = predict_case(case, [network], plans, config, mirror=True, tile_batch_size=None, device=device,
                                     probabilities_path=out_dir / f"{case.case_id}.npz")
        out = out_dir / f"{case.case_id}{dataset.file_ending}"
        write_image(out, labels, props.geometry)
        pairs.append((out, case.label_path))
    summary = evaluate_pairs(pairs, dataset.labels, dataset.file_ending, out_dir / "summary.json",
                             pred_dir=str(out_dir), gt_dir=str(dataset.root / "labelsTr"))
    log.info("validation of %d case(s):\n%s", len(cases), format_table(summary))
    return summary
