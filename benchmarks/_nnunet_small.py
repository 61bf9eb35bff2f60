"""A small nnU-Net v2 3d_fullres model trained on the CPU for benchmarks/nnunet_import.py, kept under ``--work``.

nnU-Net plans and preprocesses the dataset itself; its plans are then cut to ``FEATURES`` per stage and ``PATCH``
(benchmarks/_nnunet_fixture_run.cut_plans: the preprocessing does not depend on the network or the patch), so
that fold 0 trains on two shared CPUs in tens of minutes (benchmarks/_predict_models.prepare_nnunet, the stock
trainer with fewer epochs and iterations). Markers name what each step holds; a different network trains again.
"""

from __future__ import annotations

from pathlib import Path

from _common import run_nnunet
from _nnunet_fixture_run import cut_plans
from _predict_models import CONFIG, prepare_nnunet

FEATURES = (8, 16, 32, 64)  # per stage
PATCH_ZYX = (16, 64, 64)
BATCH = 2


def prepare_small_nnunet(python: str, dataset: Path, work: Path, epochs: int, iterations: int) -> tuple[Path, dict]:
    """nnU-Net's folders under ``work/nnunet``: the dataset planned, preprocessed and its plans shrunk once, fold 0
    trained for ``epochs`` x ``iterations``; the trained model folder and the environment to run nnU-Net in."""
    root = work / "nnunet"
    tag = f"features {FEATURES}, patch {PATCH_ZYX}, batch {BATCH}"
    marker = root / ".preprocessed"
    if not marker.is_file() or marker.read_text() != tag:
        root.mkdir(parents=True, exist_ok=True)
        for old in root.glob(".trained_*"):
            old.unlink()
        r = run_nnunet(python, dataset, root, 2, [CONFIG])
        print(f"nnUNetv2_plan_and_preprocess: {r['seconds']:.0f} s")
        plans = next((root / "nnUNet_preprocessed").glob("Dataset*")) / "nnUNetPlans.json"
        cut_plans(plans, FEATURES, {CONFIG: PATCH_ZYX}, BATCH)
        marker.write_text(tag)
    return prepare_nnunet(python, dataset, work, epochs, iterations)
