"""The two tools' trained models for benchmarks/predict.py, prepared once under ``--work`` and reused.

autoseg: a workspace planned (for an 8 GiB GPU or the CPU) and preprocessed once, fold 0 trained on the CPU either
briefly (epochs x iterations: the timings need the planned network, not a good one) or for a time budget
(``autoseg train --time-budget``: a model whose Dice means something), then given the bf16 agreement check a fold
carries when ``autoseg train`` ends with its final validation on a native-bf16 CPU (``--no-validation`` here keeps
the training's budget for training; without the check ``--runtime auto`` may not take bf16). nnU-Net v2: 3d_fullres
preprocessed once in its own folders, fold 0 trained briefly (its rows are for time and memory). A marker file names
the training each holds; a different one trains again.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from _common import nnunet_env, run_measured, run_nnunet

HERE = Path(__file__).resolve().parent
CONFIG = "3d_fullres"


@dataclass(frozen=True)
class Training:
    """How long fold 0 trains: ``budget`` (e.g. "20m", autoseg's ``--time-budget``) or ``epochs`` x ``iterations``."""

    epochs: int
    iterations: int
    budget: str | None = None

    @property
    def tag(self) -> str:
        return f"budget_{self.budget}" if self.budget else f"{self.epochs}x{self.iterations}"

    def autoseg_args(self) -> list[str]:
        if self.budget:
            return ["--time-budget", self.budget]
        return ["--epochs", str(self.epochs), "--iterations-per-epoch", str(self.iterations), "--val-iterations", "1"]


def prepare_autoseg(dataset: Path, work: Path, plan_device: str, training: Training) -> Path:
    """A workspace planned (for ``plan_device``) and preprocessed once, fold 0 trained as ``training`` says
    (trained again when that changes)."""
    ws = work / f"autoseg_{plan_device}"
    if not (ws / ".preprocessed").is_file():
        target = ["--device", "cuda", "--gpu-memory", "8GiB"] if plan_device == "gpu8" else ["--device", "cpu"]
        r = run_measured(
            [sys.executable, "-m", "autoseg", "plan_and_preprocess", str(dataset), "-w", str(ws), "-c", CONFIG]
            + ["--processes", "2", "--overwrite", *target],
            log_path=work / f"autoseg_{plan_device}_plan.log",
        )
        print(f"autoseg plan_and_preprocess ({plan_device}): {r['seconds']:.0f} s")
        (ws / ".preprocessed").write_text("")
    marker = ws / f".trained_{training.tag}"
    if not marker.is_file():
        for old in ws.glob(".trained_*"):
            old.unlink()
        shutil.rmtree(ws / "results", ignore_errors=True)
        r = run_measured(
            [sys.executable, "-m", "autoseg", "train", "0", "-w", str(ws), "-c", CONFIG, "--device", "cpu"]
            + [*training.autoseg_args(), "--no-validation"],
            log_path=work / f"autoseg_{plan_device}_train.log",
        )
        print(f"autoseg train fold 0 ({training.tag}) on the CPU: {r['seconds']:.0f} s")
        marker.write_text("")
    if not (ws / "results" / CONFIG / "fold_0" / "precision_check.json").is_file():
        check_bf16(ws, work / f"autoseg_{plan_device}_check.log")
    return ws


# The fold's bf16 agreement check, as the end of `autoseg train` makes it (its validation cases, the CPU's --tta)
_CHECK = (
    "import sys; from autoseg.core.workspace import Workspace; from autoseg.plan.plans import Plans; "
    "from autoseg.train.precision_check import run_precision_check; ws = Workspace.at(sys.argv[1]); "
    "check = run_precision_check(ws, Plans.from_json(ws.plans_path), sys.argv[2], 0); "
    "print(*(check.describe(r) for r in check.bf16_dice) if check else ['not made: no native bf16'], sep='\\n')"
)


def check_bf16(ws: Path, log_path: Path) -> None:
    """Make fold 0's bf16 agreement check (``autoseg.train.precision_check``) and print its verdicts."""
    r = run_measured([sys.executable, "-c", _CHECK, str(ws), CONFIG], log_path=log_path)
    verdicts = log_path.read_text().strip().replace("\n", "; ")
    print(f"autoseg fold 0's bf16 agreement check: {r['seconds']:.0f} s: {verdicts}")


def prepare_nnunet(python: str, dataset: Path, work: Path, epochs: int, iterations: int) -> tuple[Path, dict]:
    """nnU-Net's folders under ``work/nnunet``, 3d_fullres preprocessed once and fold 0 trained for ``epochs``
    x ``iterations`` (benchmarks/_nnunet_train.py); the trained model folder and the environment to run in."""
    root = work / "nnunet"
    env = {**os.environ, **nnunet_env(root), "nnUNet_compile": "false", "nnUNet_n_proc_DA": "2"}
    if not (root / ".preprocessed").is_file():
        root.mkdir(parents=True, exist_ok=True)
        r = run_nnunet(python, dataset, root, 2, [CONFIG])
        print(f"nnUNetv2_plan_and_preprocess: {r['seconds']:.0f} s")
        (root / ".preprocessed").write_text("")
    results = Path(env["nnUNet_results"])
    marker = root / f".trained_{epochs}x{iterations}"
    if not marker.is_file():
        for old in root.glob(".trained_*"):
            old.unlink()
        shutil.rmtree(results, ignore_errors=True)
        results.mkdir(parents=True)
        r = run_measured(
            [python, str(HERE / "_nnunet_train.py"), str(epochs), str(iterations)],
            env=env,
            log_path=work / "nnunet_train.log",
        )
        print(f"nnU-Net train fold 0, {epochs} x {iterations} iterations on the CPU: {r['seconds']:.0f} s")
        marker.write_text("")
    return next(results.glob(f"Dataset*/nnUNetTrainer__nnUNetPlans__{CONFIG}")), env
