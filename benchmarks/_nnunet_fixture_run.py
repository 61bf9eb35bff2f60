"""nnU-Net v2's side of benchmarks/_nnunet_fixture.py, run in nnU-Net's venv: plan, shrink, preprocess, train and
predict a tiny model of each configuration.

    python _nnunet_fixture_run.py DATASET_ID ITERATIONS TEST_FOLDER PREDICTIONS_FOLDER
    # nnUNet_raw / _preprocessed / _results set by the caller, the dataset linked into nnUNet_raw

nnU-Net's own planner plans the dataset; its plans are then cut to the stages of ``FEATURES`` and a small
patch, so that the checkpoints stay a few hundred KB, and each configuration trains fold 0 with the stock
nnUNetTrainer (one epoch of ITERATIONS iterations, set on the instance) and predicts TEST_FOLDER with mirroring,
keeping the probabilities. Standard library and nnU-Net only.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from _forward_timer import _stub_nnunet_primus

CONFIGS = ("2d", "3d_fullres")
FEATURES = (4, 8, 16)  # per stage
PATCH = {"2d": (32, 32), "3d_fullres": (16, 32, 32)}
CHECK_INPUT = {"2d": (1, 2, 16, 16), "3d_fullres": (1, 2, 4, 16, 16)}  # (B, C, *spatial), a multiple of the strides


def save_network_check(predictor, shape: tuple[int, ...], path: Path) -> None:
    """The trained network's logits (deep supervision off, eval mode) on a seeded normal input of ``shape``:
    ``input`` and ``logits`` in ``path``, to hold an imported network against without nnU-Net's preprocessing."""
    import numpy as np
    import torch

    network = predictor.network
    network.load_state_dict(predictor.list_of_parameters[0])
    network.eval()
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    with torch.no_grad():
        logits = network(torch.from_numpy(x)).numpy()
    np.savez_compressed(path, input=x, logits=logits)


def shrink_plans(
    path: Path, features: tuple[int, ...] = FEATURES, patch: dict[str, tuple[int, ...]] = PATCH, batch: int = 2
) -> None:
    """Keep the configurations ``patch`` names, each cut to ``len(features)`` stages of ``features``, its patch
    (rounded up to a multiple of the strides) and ``batch``."""
    plans = json.loads(path.read_text())
    plans["configurations"] = {k: v for k, v in plans["configurations"].items() if k in patch}
    stages = len(features)
    for name, config in plans["configurations"].items():
        kwargs = config["architecture"]["arch_kwargs"]
        kwargs["n_stages"] = stages
        kwargs["features_per_stage"] = list(features)
        for key in ("kernel_sizes", "strides", "n_conv_per_stage"):
            kwargs[key] = kwargs[key][:stages]
        kwargs["n_conv_per_stage_decoder"] = kwargs["n_conv_per_stage_decoder"][: stages - 1]
        divisor = [1] * len(patch[name])
        for stride in kwargs["strides"]:
            divisor = [d * s for d, s in zip(divisor, stride)]
        config["patch_size"] = [-(-p // d) * d for p, d in zip(patch[name], divisor)]
        config["batch_size"] = batch
    path.write_text(json.dumps(plans, indent=2))


def save_preprocessed(predictor, test_folder: Path, out: Path) -> None:
    """nnU-Net's preprocessing of each test case (``<case>_preprocessed.npy``, float32 (C, Z, Y, X)): cropped,
    normalized and resampled as the trained configuration's plan says."""
    import numpy as np
    from nnunetv2.preprocessing.preprocessors.default_preprocessor import DefaultPreprocessor

    preprocessor = DefaultPreprocessor(verbose=False)
    for first in sorted(test_folder.glob("*_0000.nii.gz")):
        case = first.name.removesuffix("_0000.nii.gz")
        files = [str(f) for f in sorted(test_folder.glob(f"{case}_*.nii.gz"))]
        data, _, _ = preprocessor.run_case(
            files, None, predictor.plans_manager, predictor.configuration_manager, predictor.dataset_json
        )
        np.save(out / f"{case}_preprocessed.npy", data.astype(np.float32))


def main() -> None:
    dataset_id, iterations = int(sys.argv[1]), int(sys.argv[2])
    test_folder, predictions = Path(sys.argv[3]), Path(sys.argv[4])
    _stub_nnunet_primus()
    import torch
    from nnunetv2.experiment_planning.plan_and_preprocess_api import (
        extract_fingerprints,
        plan_experiments,
        preprocess,
    )
    from nnunetv2.inference.predict_from_raw_data import nnUNetPredictor
    from nnunetv2.training.nnUNetTrainer.nnUNetTrainer import nnUNetTrainer

    cpu = torch.device("cpu")
    torch.manual_seed(0)
    extract_fingerprints([dataset_id], num_processes=1, check_dataset_integrity=True)
    plan_experiments([dataset_id])
    folder = next(Path(os.environ["nnUNet_preprocessed"]).glob(f"Dataset{dataset_id:03d}_*"))
    shrink_plans(folder / "nnUNetPlans.json")
    preprocess([dataset_id], configurations=CONFIGS, num_processes=(1,) * len(CONFIGS))
    dataset_json = json.loads((folder / "dataset.json").read_text())
    os.environ["nnUNet_n_proc_DA"] = "0"  # the trainer's augmentation in-process (planning needs >= 1 thread)
    for config in CONFIGS:
        plans = json.loads((folder / "nnUNetPlans.json").read_text())
        plans["continue_training"] = False  # nnUNetTrainer.__init__ pops it (run_training.py sets it)
        trainer = nnUNetTrainer(plans, config, 0, dataset_json, device=cpu)
        trainer.num_epochs, trainer.num_iterations_per_epoch = 1, iterations
        trainer.num_val_iterations_per_epoch = 1
        trainer.run_training()
        predictor = nnUNetPredictor(tile_step_size=0.5, use_gaussian=True, use_mirroring=True, device=cpu)
        predictor.initialize_from_trained_model_folder(trainer.output_folder_base, (0,), "checkpoint_final.pth")
        (predictions / config).mkdir(parents=True, exist_ok=True)
        predictor.predict_from_files_sequential(str(test_folder), str(predictions / config), save_probabilities=True)
        save_network_check(predictor, CHECK_INPUT[config], predictions / config / "network_check.npz")
        save_preprocessed(predictor, test_folder, predictions / config)
        print(f"MODEL_FOLDER {config} {trainer.output_folder_base}")


if __name__ == "__main__":
    main()
