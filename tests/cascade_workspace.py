"""A workspace with the cascade planned by hand (the tiny images are too small for the planner to want it):
3d_lowres at twice 3d_fullres's spacing and 3d_cascade_fullres on 3d_fullres's data with the one-hot channels."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

from factories import tiny_topology

from autoseg.core.workspace import FoldSplit, Splits, Workspace
from autoseg.plan.plans import Plans
from autoseg.preprocess.run import preprocess_workspace
from autoseg.preprocess.store import list_cases
from autoseg.train.run_config import RunConfig
from autoseg.train.trainer import train

CASCADE = "3d_cascade_fullres"
RUN = RunConfig(epochs=1, iterations_per_epoch=1, val_iterations=1, cpu_threads=1)


def with_cascade(root: Path) -> Plans:
    """Add a tiny 3d_lowres (twice 3d_fullres's spacing) and 3d_cascade_fullres (3d_fullres's, with the one-hot
    channels) to the workspace's plans.json, as the planner does for large images; preprocess 3d_lowres."""
    ws = Workspace.at(root)
    plans = Plans.from_json(ws.plans_path)
    full = plans.configuration("3d_fullres")
    low_spacing = tuple(2 * s for s in full.spacing_mm)
    low = full.with_(
        name="3d_lowres",
        spacing_mm=low_spacing,
        patch_size=(4, 8, 8),
        inference_patch_size=(4, 8, 8),
        median_shape_zyx=tuple(max(1, m // 2) for m in full.median_shape_zyx),
    )
    extra = len(plans.label_scheme.predicted_values)
    cascade = full.with_(
        name=CASCADE,
        previous_stage="3d_lowres",
        preprocessed_as="3d_fullres",
        network=dataclasses.replace(tiny_topology(plans.num_label_values), in_channels=1 + extra),
    )
    plans = dataclasses.replace(plans, configurations={**plans.configurations, "3d_lowres": low, CASCADE: cascade})
    plans.to_json(ws.plans_path)
    preprocess_workspace(ws, ["3d_lowres", CASCADE], processes=1, progress=False)
    return plans


def make_cascade_workspace(prepared: Path, root: Path) -> Path:
    """The prepared workspace with the cascade planned, two folds (splits.json written by hand), lowres fold 0
    trained and validated."""
    root = Path(shutil.copytree(prepared, root))
    with_cascade(root)
    ws = Workspace.at(root)
    cases = list_cases(ws.preprocessed("3d_fullres"))
    halves = (tuple(cases[::2]), tuple(cases[1::2]))
    Splits(
        seed=0, folds=(FoldSplit(train=halves[1], val=halves[0]), FoldSplit(train=halves[0], val=halves[1]))
    ).to_json(ws.splits_path)
    train(ws, "3d_lowres", 0, RUN, progress=False)
    return root
