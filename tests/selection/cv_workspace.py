"""A fake workspace with two configurations' cross-validation outputs whose right answers are known by construction
(no training): 4 cases of (4, 8, 8) voxels, 2 folds of 2 validation cases, labels organ (1) and lesion (2).

Reference of every case: organ a cube [1:3, 1:4, 1:4] (18 voxels); lesion a cube [1:3, 5:7, 5:7] (8) and one
voxel (0, 0, 7) (9 in all: two components). Both configurations predict a spurious organ voxel at (3, 7, 0).

- A misses the lesion's [1:3, 5:7, 6:7] (4 voxels; background 0.55, lesion 0.45): organ 36/37, lesion 10/14.
- B misses the organ's [1, 1, 1:4] (3 voxels; background 0.6, organ 0.4): organ 30/34, lesion 1.
- A+B (probabilities averaged) is right everywhere but the spurious voxel: organ 36/37, lesion 1: the best.
- Postprocessing of A+B: the largest organ component drops the spurious voxel (organ 1: applied); the largest
  lesion component drops its true single voxel (lesion 16/17: not applied); the largest foreground component drops
  the whole lesion (not applied).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
from factories import tiny_plans

from autoseg.core.workspace import FoldSplit, Splits, Workspace, WorkspaceInfo
from autoseg.dataset.imageio import Geometry, write_image

SHAPE = (4, 8, 8)
CASES = ("case_0", "case_1", "case_2", "case_3")
FOLDS = (("case_0", "case_1"), ("case_2", "case_3"))  # validation cases of fold 0 and fold 1
ORGAN = (slice(1, 3), slice(1, 4), slice(1, 4))
LESION = (slice(1, 3), slice(5, 7), slice(5, 7))
LESION_DOT = (0, 0, 7)
SPURIOUS_ORGAN = (3, 7, 0)
A_MISSES = (slice(1, 3), slice(5, 7), slice(6, 7))  # lesion voxels A calls background
B_MISSES = (1, 1, slice(1, 4))  # organ voxels B calls background

EXPECTED = {  # (organ, lesion) Dice by construction
    "A": (36 / 37, 10 / 14),
    "B": (30 / 34, 1.0),
    "A+B": (36 / 37, 1.0),
}


def geometry() -> Geometry:
    z, y, x = SHAPE
    return Geometry(
        ndim=3,
        size_xyz=(x, y, z),
        spacing_xyz=(1.0, 1.0, 1.0),
        origin_xyz=(0.0, 0.0, 0.0),
        direction=(1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0),
    )


def reference() -> np.ndarray:
    labels = np.zeros(SHAPE, dtype=np.uint8)
    labels[ORGAN], labels[LESION], labels[LESION_DOT] = 1, 2, 2
    return labels


def probabilities(config: str) -> np.ndarray:
    """(3, Z, Y, X): confident (0.9) on the reference plus the spurious organ voxel, except where ``config`` errs."""
    truth = reference()
    truth[SPURIOUS_ORGAN] = 1
    p = np.full((3, *SHAPE), 0.05, dtype=np.float32)
    for k in range(3):
        p[k][truth == k] = 0.9
    if config == "A":
        p[(slice(None), *A_MISSES)] = np.array([0.55, 0.0, 0.45])[:, None, None, None]
    if config == "B":
        p[(slice(None), *B_MISSES)] = np.array([0.6, 0.4, 0.0])[:, None]
    return p


def write_dataset(root: Path) -> Path:
    (root / "imagesTr").mkdir(parents=True)
    (root / "labelsTr").mkdir()
    for case in CASES:
        write_image(root / "imagesTr" / f"{case}_0000.nii.gz", np.ones(SHAPE, dtype=np.float32), geometry())
        write_image(root / "labelsTr" / f"{case}.nii.gz", reference(), geometry())
    meta = {
        "channel_names": {"0": "MRI"},
        "labels": {"background": 0, "organ": 1, "lesion": 2},
        "numTraining": len(CASES),
        "file_ending": ".nii.gz",
    }
    (root / "dataset.json").write_text(json.dumps(meta))
    return root


def write_fold(ws: Workspace, config: str, fold: int) -> None:
    """A trained and validated fold: checkpoint_final.pt (empty), and per validation case its label map (the
    argmax) and {case}.npz, then summary.json (empty: find-best checks it is there)."""
    out = ws.results(config, fold)
    (out / "validation").mkdir(parents=True)
    ws.checkpoint(config, fold, "final").write_bytes(b"")
    p = probabilities(config)
    for case in FOLDS[fold]:
        write_image(out / "validation" / f"{case}.nii.gz", np.argmax(p, axis=0).astype(np.uint8), geometry())
        np.savez(
            out / "validation" / f"{case}.npz",
            probabilities=p.astype(np.float16),
            names=np.array(["background", "organ", "lesion"]),
            activation=np.array("softmax"),
        )
    (out / "validation" / "summary.json").write_text("{}")


def make_workspace(tmp_path: Path, configs: tuple[str, ...] = ("A", "B"), folds: tuple[int, ...] = (0, 1)) -> Workspace:
    dataset = write_dataset(tmp_path / "Dataset001_Fake")
    ws = Workspace.at(tmp_path / "ws")
    ws.root.mkdir()
    WorkspaceInfo(dataset_root=str(dataset)).to_json(ws.info_path)
    plans = tiny_plans()
    config = plans.configurations["3d_fullres"]
    dataclasses.replace(plans, configurations={c: config.with_(name=c) for c in configs}).to_json(ws.plans_path)
    Splits(
        seed=0, folds=tuple(FoldSplit(train=tuple(c for c in CASES if c not in val), val=val) for val in FOLDS)
    ).to_json(ws.splits_path)
    for c in configs:
        for f in folds:
            write_fold(ws, c, f)
    return ws
