"""A brief nnU-Net v2 training of fold 0 (3d_fullres, CPU), run in nnU-Net's venv by benchmarks/predict.py.

    python _nnunet_train.py EPOCHS ITERATIONS          # nnUNet_raw / _preprocessed / _results set by the caller

The stock nnUNetTrainer with fewer epochs and iterations set on the instance (no subclass: the checkpoint
then names nnUNetTrainer, which nnU-Net's predictor finds; a subclass would have to live inside nnunetv2's
package and repeat its constructor's signature). Without the final validation, as the benchmark only needs
``checkpoint_final.pth``. Standard library and nnU-Net only.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from _forward_timer import _stub_nnunet_primus

CONFIG = "3d_fullres"


def main() -> None:
    epochs, iterations = int(sys.argv[1]), int(sys.argv[2])
    _stub_nnunet_primus()
    import torch
    from nnunetv2.training.nnUNetTrainer.nnUNetTrainer import nnUNetTrainer

    folder = next(Path(os.environ["nnUNet_preprocessed"]).glob("Dataset*"))
    plans = json.loads((folder / "nnUNetPlans.json").read_text())
    plans["continue_training"] = False  # nnUNetTrainer.__init__ pops it (run_training.py sets it)
    dataset_json = json.loads((folder / "dataset.json").read_text())
    trainer = nnUNetTrainer(plans, CONFIG, 0, dataset_json, device=torch.device("cpu"))
    trainer.num_epochs, trainer.num_iterations_per_epoch = epochs, iterations
    trainer.num_val_iterations_per_epoch = max(1, iterations // 5)
    trainer.run_training()


if __name__ == "__main__":
    main()
