"""nnU-Net v2's side of benchmarks/_nnunet_fixture.py, run in nnU-Net's venv: plan, shrink, preprocess, train and
predict a tiny model of each configuration.

    python _nnunet_fixture_run.py DATASET_ID ITERATIONS TEST_FOLDER PREDICTIONS_FOLDER [plain|resenc|cascade]
    # nnUNet_raw / _preprocessed / _results set by the caller, the dataset linked into nnUNet_raw

nnU-Net's own planner plans the dataset; its plans are then cut to ``STAGES`` stages of ``FEATURES`` and a small
patch, so that the checkpoints stay a few hundred KB, and each configuration trains with the stock nnUNetTrainer
(one epoch of ITERATIONS iterations, set on the instance) and predicts TEST_FOLDER with mirroring, keeping the
probabilities. The model sets:

- ``plain``: PlainConvUNet 2d and 3d_fullres, fold 0 (nnUNetPlans);
- ``resenc``: ResidualEncoderUNet 3d_fullres, fold 0 (nnUNetPlannerResEncM's nnUNetResEncUNetMPlans), with
  ``RESENC_BLOCKS`` residual blocks per stage;
- ``cascade``: PlainConvUNet 3d_lowres (``LOWRES_SCALE`` times 3d_fullres's in-plane spacing; the tiny dataset
  plans none itself) and 3d_cascade_fullres, as nnU-Net's planner writes them (``next_stage``, ``inherits_from``,
  ``previous_stage``), both fold ``all``: the lowres trainer's final validation then predicts every training case
  for the cascade (``predicted_next_stage``); the test cases are predicted by 3d_lowres, then by the cascade given
  those label maps (``folder_with_segs_from_prev_stage``), as nnUNetv2_predict's ``-prev_stage_predictions``.

Standard library and nnU-Net only.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from _forward_timer import _stub_nnunet_primus

# per set: the planner, the plans' name, (configuration, fold) trained in order
SETS = {
    "plain": ("ExperimentPlanner", "nnUNetPlans", (("2d", 0), ("3d_fullres", 0))),
    "resenc": ("nnUNetPlannerResEncM", "nnUNetResEncUNetMPlans", (("3d_fullres", 0),)),
    "cascade": ("ExperimentPlanner", "nnUNetPlans", (("3d_lowres", "all"), ("3d_cascade_fullres", "all"))),
}
STAGES = 3
FEATURES = (4, 8, 16)
RESENC_BLOCKS = (1, 2, 2)
LOWRES_SCALE = 2.0
PATCH = {"2d": (32, 32), "3d_fullres": (16, 32, 32), "3d_lowres": (16, 16, 16)}
CHECK_SPATIAL = {2: (16, 16), 3: (4, 16, 16)}  # the seeded input's (*spatial), a multiple of the strides


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


def shrink_plans(path: Path, models: str) -> None:
    """Keep the configurations of the set ``models`` (for the cascade, add 3d_lowres and 3d_cascade_fullres as
    nnU-Net's planner would), then cut them (``cut_plans``) to ``STAGES`` stages of ``FEATURES``, the patch
    ``PATCH``, batch 2."""
    plans = json.loads(path.read_text())
    wanted = {c for c, _ in SETS[models][2]} | ({"3d_fullres"} if models == "cascade" else set())
    configs = plans["configurations"]
    if models == "cascade":
        lowres = json.loads(json.dumps(configs["3d_fullres"]))
        lowres["spacing"] = [lowres["spacing"][0], *(s * LOWRES_SCALE for s in lowres["spacing"][1:])]
        lowres["data_identifier"] = "nnUNetPlans_3d_lowres"
        lowres["next_stage"] = "3d_cascade_fullres"
        configs["3d_lowres"] = lowres
        configs["3d_cascade_fullres"] = {"inherits_from": "3d_fullres", "previous_stage": "3d_lowres"}
    plans["configurations"] = {k: v for k, v in configs.items() if k in wanted}
    path.write_text(json.dumps(plans, indent=2))
    cut_plans(path, FEATURES[:STAGES], {k: v for k, v in PATCH.items() if k in wanted}, 2)


def cut_plans(path: Path, features: tuple[int, ...], patch: dict[str, tuple[int, ...]], batch: int) -> None:
    """Keep the configurations ``patch`` names (and those inheriting their network), each with its own network cut
    to ``len(features)`` stages of ``features`` (a residual encoder: ``RESENC_BLOCKS`` blocks per stage), its patch
    (rounded up to a multiple of the strides) and ``batch``."""
    plans = json.loads(path.read_text())
    stages = len(features)
    plans["configurations"] = {
        k: v for k, v in plans["configurations"].items() if k in patch or "architecture" not in v
    }
    for name, config in plans["configurations"].items():
        if "architecture" not in config:  # inherits it
            continue
        kwargs = config["architecture"]["arch_kwargs"]
        kwargs["n_stages"] = stages
        kwargs["features_per_stage"] = list(features)
        for key in ("kernel_sizes", "strides", "n_conv_per_stage", "n_blocks_per_stage"):
            if key in kwargs:
                kwargs[key] = kwargs[key][:stages]
        if "n_blocks_per_stage" in kwargs:
            kwargs["n_blocks_per_stage"] = list(RESENC_BLOCKS[:stages])
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
    models = sys.argv[5] if len(sys.argv) > 5 else "plain"
    planner, plans_name, trained = SETS[models]
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
    plan_experiments([dataset_id], experiment_planner_class_name=planner)
    folder = next(Path(os.environ["nnUNet_preprocessed"]).glob(f"Dataset{dataset_id:03d}_*"))
    shrink_plans(folder / f"{plans_name}.json", models)
    preprocessed = tuple(c for c, _ in trained if c != "3d_cascade_fullres") + (
        ("3d_fullres",) if models == "cascade" else ()
    )
    preprocess([dataset_id], plans_name, configurations=preprocessed, num_processes=(1,) * len(preprocessed))
    dataset_json = json.loads((folder / "dataset.json").read_text())
    os.environ["nnUNet_n_proc_DA"] = "0"  # the trainer's augmentation in-process (planning needs >= 1 thread)
    previous = None  # the cascade: 3d_lowres's predictions of the test cases
    for config, fold in trained:
        plans = json.loads((folder / f"{plans_name}.json").read_text())
        plans["continue_training"] = False  # nnUNetTrainer.__init__ pops it (run_training.py sets it)
        trainer = nnUNetTrainer(plans, config, fold, dataset_json, device=cpu)
        trainer.num_epochs, trainer.num_iterations_per_epoch = 1, iterations
        trainer.num_val_iterations_per_epoch = 1
        trainer.run_training()
        if config == "3d_lowres":  # writes predicted_next_stage, the cascade's training input
            trainer.perform_actual_validation(False)
        predictor = nnUNetPredictor(tile_step_size=0.5, use_gaussian=True, use_mirroring=True, device=cpu)
        predictor.initialize_from_trained_model_folder(trainer.output_folder_base, (fold,), "checkpoint_final.pth")
        out = predictions / config
        out.mkdir(parents=True, exist_ok=True)
        predictor.predict_from_files_sequential(
            str(test_folder), str(out), save_probabilities=True, folder_with_segs_from_prev_stage=previous
        )
        channels = trainer.num_input_channels
        save_network_check(
            predictor, (1, channels, *CHECK_SPATIAL[len(PATCH.get(config, (0,) * 3))]), out / "network_check.npz"
        )
        if config != "3d_cascade_fullres":  # its preprocessing is 3d_fullres's, plus the previous stage's one-hot
            save_preprocessed(predictor, test_folder, out)
        previous = str(out) if config == "3d_lowres" else None
        print(f"MODEL_FOLDER {config} {trainer.output_folder_base}")


if __name__ == "__main__":
    main()
