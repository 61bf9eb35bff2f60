"""Region-based labels with an ignore label, end to end: plan, preprocess, train, validate, predict, evaluate."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import SimpleITK as sitk
from factories import set_configuration, tiny_topology

from autoseg.core.units import GiB
from autoseg.core.workspace import Workspace
from autoseg.dataset.raw import load_dataset
from autoseg.evaluate.metrics import evaluate_folder
from autoseg.plan.budget import Budget
from autoseg.plan.plans import Plans
from autoseg.plan.run import plan_dataset
from autoseg.predict.predictor import PredictOptions, predict
from autoseg.preprocess.run import preprocess_workspace
from autoseg.preprocess.store import case_files, list_complete_cases
from autoseg.train.run_config import RunConfig
from autoseg.train.trainer import train

IGNORE = 3
LABELS = {"background": 0, "organ": [1, 2], "lesion": 2, "ignore": IGNORE}  # organ region = organ + lesion


def _with_regions_and_ignore(src: Path, dst: Path) -> Path:
    """The tiny demo dataset with region labels; the top 3 slices of every training label are unlabelled."""
    shutil.copytree(src, dst)
    for f in sorted((dst / "labelsTr").glob("*.nii.gz")):
        label = sitk.ReadImage(str(f))
        array = sitk.GetArrayFromImage(label)
        array[:3] = IGNORE
        out = sitk.GetImageFromArray(array)
        out.CopyInformation(label)
        sitk.WriteImage(out, str(f))
    meta = json.loads((dst / "dataset.json").read_text())
    meta.update(labels=LABELS, regions_class_order=[1, 2])
    (dst / "dataset.json").write_text(json.dumps(meta))
    return dst


def test_regions_with_ignore_end_to_end(tiny_dataset: Path, tmp_path: Path) -> None:
    raw = _with_regions_and_ignore(tiny_dataset, tmp_path / "Dataset003_Regions")
    ws = Workspace.at(tmp_path / "ws")
    dataset = load_dataset(raw)  # plan_dataset takes the loaded dataset as the CLI passes it (or its root)
    plans = plan_dataset(dataset, ws, Budget(gpu_memory_bytes=8 * GiB, device="cpu"), progress=False)
    assert plans.labels == {"background": 0, "organ": (1, 2), "lesion": 2, "ignore": IGNORE}
    assert Plans.from_json(ws.plans_path).regions_class_order == (1, 2)
    assert {c.network.num_outputs for c in plans.configurations.values()} == {2}  # two sigmoid regions
    preprocess_workspace(ws, ["3d_fullres"], processes=1, progress=False)
    folder = ws.preprocessed("3d_fullres")
    for case_id in list_complete_cases(folder):
        files = case_files(folder, case_id)
        seg, rows = np.load(files.seg), np.load(files.locations)  # rows: (class, z, y, x)
        assert set(rows[:, 0].tolist()) == {0, 1}  # keyed by region (output channel)
        for key, values in ((0, (1, 2)), (1, (2,))):
            found = seg[0][tuple(rows[rows[:, 0] == key, 1:].T)]
            assert np.isin(found, values).all()  # a region's voxels, never an ignored one

    set_configuration(
        ws,
        "3d_fullres",
        network=tiny_topology(2),
        patch_size=(8, 16, 16),
        batch_size=2,
        accumulation_steps=1,
        checkpointing=False,
    )
    run = RunConfig(epochs=1, iterations_per_epoch=2, val_iterations=1, device="cpu", cpu_threads=1, loader_workers=0)
    fold = train(ws, "3d_fullres", 0, run, progress=False)
    row = json.loads((fold / "metrics.jsonl").read_text().splitlines()[0])
    assert len(row["pseudo_dice"]) == 2 and np.isfinite(row["train_loss"])
    validation = json.loads((fold / "validation" / "summary.json").read_text())
    assert validation["labels"] == {"organ": [1, 2], "lesion": 2} and validation["ignore_value"] == IGNORE
    assert not (fold / "class_weights.json").exists()  # regions are thresholded each: no decision weights
    # every validation case's probabilities beside its label map, for choosing configurations without predicting
    # again: one sigmoid map per region, in the label map's grid
    for case in validation["cases"]:
        label_map = sitk.GetArrayFromImage(sitk.ReadImage(case["prediction"]))
        with np.load(Path(case["prediction"]).parent / f"{case['case_id']}.npz") as saved:
            assert saved["probabilities"].shape == (2, *label_map.shape) and str(saved["activation"]) == "sigmoid"

    out = tmp_path / "pred"
    quiet = PredictOptions(progress=False)
    written = predict(ws, raw / "imagesTs", out, config_name="3d_fullres", folds=(0,), options=quiet)
    assert len(written) == 2
    for path in written:
        pred = sitk.ReadImage(str(path))
        src = sitk.ReadImage(str(raw / "imagesTs" / path.name.replace(".nii.gz", "_0000.nii.gz")))
        assert pred.GetSize() == src.GetSize() and pred.GetSpacing() == src.GetSpacing()
        assert pred.GetOrigin() == src.GetOrigin() and pred.GetDirection() == src.GetDirection()
        assert set(np.unique(sitk.GetArrayFromImage(pred)).tolist()) <= {0, 1, 2}  # painted values, no ignore
    summary = evaluate_folder(out, raw / "labelsTs")  # labels and ignore from the raw dataset.json
    assert list(summary.labels) == ["organ", "lesion"] and summary.ignore_value == IGNORE
    assert all(0.0 <= m.dice <= 1.0 for c in summary.cases for m in c.classes.values() if np.isfinite(m.dice))
