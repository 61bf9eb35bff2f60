"""`autoseg demo`: the whole pipeline on a synthetic dataset, on CPU, in minutes.

make dataset -> plan_and_preprocess (3d_fullres) -> train fold 0 -> predict held-out cases -> evaluate.
"""

from __future__ import annotations

import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from autoseg.core.resources import available_ram_bytes
from autoseg.core.units import GiB
from autoseg.core.workspace import Workspace
from autoseg.demo.data import make_demo_dataset
from autoseg.evaluate.metrics import evaluate_folder, format_table
from autoseg.plan.budget import Budget
from autoseg.plan.run import plan_dataset
from autoseg.predict.predictor import PredictOptions, predict
from autoseg.predict.window import WindowOptions
from autoseg.preprocess.run import preprocess_workspace
from autoseg.train.run_config import RunConfig
from autoseg.train.trainer import train

log = logging.getLogger("autoseg")

DEMO_TARGET_DICE = 0.85
DEMO_EPOCHS = 30
DEMO_ITERATIONS = 20
DEMO_SHAPE_ZYX = (24, 64, 64)


@dataclass(frozen=True)
class DemoResult:
    workspace: Path
    mean_foreground_dice: float
    seconds: float

    @property
    def passed(self) -> bool:
        return self.mean_foreground_dice >= DEMO_TARGET_DICE


def run_demo(
    workspace: str | Path | None = None,
    epochs: int | None = None,
    iterations_per_epoch: int | None = None,
    num_train: int | None = None,
    progress: bool = True,
) -> DemoResult:
    t0 = time.perf_counter()
    root = Path(workspace) if workspace else Path(tempfile.mkdtemp(prefix="autoseg_demo_"))
    ws = Workspace.at(root)
    print(f"autoseg demo in {ws.root}")
    raw = make_demo_dataset(
        ws.root / "raw" / "Dataset900_Demo", num_train=num_train or 24, num_test=6, shape_zyx=DEMO_SHAPE_ZYX
    )
    budget = Budget(gpu_memory_bytes=8 * GiB, host_ram_bytes=available_ram_bytes(), device="cpu")
    plan_dataset(raw, ws, budget, progress=progress)
    preprocess_workspace(ws, ["3d_fullres"], processes=1, progress=progress)
    run = RunConfig(
        epochs=epochs or DEMO_EPOCHS,
        iterations_per_epoch=iterations_per_epoch or DEMO_ITERATIONS,
        val_iterations=5,
        device="cpu",
        validate=False,
    )
    train(ws, "3d_fullres", 0, run, progress=progress)
    pred_dir = ws.root / "predictions"
    predict(
        ws,
        raw / "imagesTs",
        pred_dir,
        config_name="3d_fullres",
        folds=(0,),
        window=WindowOptions(device="cpu"),
        options=PredictOptions(progress=progress),
    )
    summary = evaluate_folder(pred_dir, raw / "labelsTs", output_json=pred_dir / "summary.json")
    seconds = time.perf_counter() - t0
    print(format_table(summary))
    result = DemoResult(ws.root, summary.mean_foreground_dice, seconds)
    verdict = "PASS" if result.passed else "FAIL"
    print(
        f"demo: mean foreground Dice {result.mean_foreground_dice:.4f} on {len(summary.cases)} held-out cases "
        f"(target >= {DEMO_TARGET_DICE}) {verdict}; {seconds / 60:.1f} min; workspace {ws.root}"
    )
    return result
