"""The flags of ``autoseg plan``, ``plan_and_preprocess`` and ``train``."""

from __future__ import annotations

import argparse

from autoseg.cli.flag_values import SEED, add_workspace, duration_value, int_at_least, parse_bytes, positive_float
from autoseg.model.topology import ARCHITECTURES
from autoseg.train.tracking import TRACKERS


def _add_budget(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--gpu-memory",
        type=parse_bytes,
        default=None,
        help="GPU memory to plan for (e.g. 8GiB, 24GiB, 80GB); default: the CUDA device's, else 8 GiB",
    )
    p.add_argument("--ram", type=parse_bytes, default=None, help="host RAM budget; default: available memory")
    p.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default=None,
        help="device training will run on (default: cuda if present, else cpu)",
    )
    p.add_argument(
        "--cpu-flops",
        type=positive_float,
        default=None,
        help="CPU training throughput in convolution FLOP/s for --device cpu, the step's seconds counted "
        "from its convolutions alone (default: measured once, then cached: a FLOP rate and a "
        "feature-map element rate, see docs/benchmarks.md)",
    )
    target = p.add_mutually_exclusive_group()
    target.add_argument(
        "--time-budget",
        type=duration_value,
        default=None,
        metavar="DURATION",
        help="the time `autoseg train --time-budget` will have, e.g. 30m, 2h: on CPU each iteration is sized so that "
        "a run of this length gets enough of them (docs/architecture.md, 'Seconds per iteration from the time "
        "budget'); planning again for another budget keeps the 3d_fullres and 2d preprocessed data (default: 1 s per "
        "iteration; CUDA plans are sized by memory)",
    )
    target.add_argument(
        "--seconds-per-iteration",
        type=positive_float,
        default=None,
        metavar="S",
        help="on CPU, size each training iteration to take S seconds instead (default: from --time-budget)",
    )


def add_plan_commands(sub: argparse._SubParsersAction) -> None:
    for name in ("plan", "plan_and_preprocess"):
        p = sub.add_parser(name, help="fingerprint and plan" + (" and preprocess" if "pre" in name else ""))
        p.add_argument("dataset", help="raw dataset folder (nnU-Net layout: dataset.json, imagesTr/, labelsTr/)")
        add_workspace(p)
        _add_budget(p)
        p.add_argument(
            "--overwrite",
            action="store_true",
            help="when the workspace was made from another dataset, this one changed, or plans.json "
            "differs from what the preprocessed data was made with: plan again and redo the stale "
            "preprocessed cases (a plans.json edited by hand is kept; delete it to plan anew); "
            "trained folds of a changed plan or dataset are moved to results/<config>.stale-<n>, "
            "never deleted. Without it such a workspace is refused",
        )
        p.add_argument(
            "--architecture",
            choices=sorted(ARCHITECTURES),
            default="unet",
            help="the network every configuration is planned with: unet (plain conv U-Net, nnU-Net's "
            "default) or resenc (residual encoder U-Net, nnU-Net's ResEnc: residual blocks "
            "1, 3, 4, 6, 6, 6 per encoder stage); default: unet",
        )
        p.add_argument(
            "--like",
            default=None,
            metavar="MODEL",
            help="plan with this trained model's network (a model archive, a checkpoint file or a workspace): its "
            "architecture, depth, features, kernels and strides, its target spacing and patch; batch, accumulation "
            "and checkpointing fit the budget. Its weights then fit: `autoseg train fold 0 --init-from MODEL`",
        )
        if name == "plan_and_preprocess":
            p.add_argument("-c", "--configs", nargs="+", default=None, help="configurations (default: all planned)")
            p.add_argument(
                "--processes",
                type=int_at_least(1),
                default=None,
                help="preprocessing processes (default: as many as the RAM budget fits, at most the CPUs)",
            )
            p.add_argument(
                "--precompute-augmentations",
                type=int_at_least(0),
                default=0,
                metavar="K",
                help="write K spatially augmented copies per case (rotation, scaling, elastic), so "
                "training can skip the spatial transform (default: 0)",
            )


def add_train_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train", help="train folds: `autoseg train fold 0`, `fold 0 1 2 3 4` (one after the other) or `fold all`"
    )
    p.add_argument("fold", nargs="+", help="'fold 0', '0', 'fold 0 1 2 3 4' or 'all'")
    add_workspace(p)
    p.add_argument(
        "-c", "--config", default=None, help="configuration (default: 3d_fullres if planned, else the first)"
    )
    p.add_argument("--epochs", type=int_at_least(1), default=None, help="default: 1000")
    p.add_argument("--iterations-per-epoch", type=int_at_least(1), default=None, help="default: 250")
    p.add_argument(
        "--val-iterations",
        type=int_at_least(1),
        default=None,
        help="validation patches per epoch for the pseudo-Dice (default: 50)",
    )
    p.add_argument("--device", choices=["cuda", "cpu"], default=None)
    p.add_argument("--seed", type=SEED, default=0)
    _add_run_flags(p)
    _add_init_flags(p)


def _add_init_flags(p: argparse.ArgumentParser) -> None:
    """``--init-from`` and ``--init-fold``: fine-tuning (``autoseg.train.init_weights``)."""
    p.add_argument(
        "--init-from",
        default=None,
        metavar="MODEL",
        help="start each fold from this model's weights (fine-tuning): a model archive (export-model, import-nnunet), "
        "a checkpoint file or a trained workspace. Tensors whose names and shapes match are copied; the segmentation "
        "heads are re-initialised when the label set differs; refused when less than 90%% of the encoder fits (plan "
        "with `plan_and_preprocess DATASET --like MODEL` first). A resumed fold keeps its checkpoint's weights",
    )
    p.add_argument(
        "--init-fold",
        default=None,
        metavar="K",
        help="the fold of --init-from's model to start from (default: its first)",
    )


def add_precision_check_flag(p: argparse.ArgumentParser, when: str) -> None:
    """``--no-precision-check``, of ``train`` and ``export-model``: ``when`` says when the check runs."""
    p.add_argument(
        "--no-precision-check",
        action="store_true",
        help=f"do not make the bf16 agreement check {when}: on a CPU with native bf16 the validation cases are "
        "predicted in fp32 and bf16 and their Dice stored with the fold; `predict --precision auto` takes bf16 "
        "only for folds whose check passed",
    )


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    """How a training run goes beyond its length: validation, resume, time budget, workers, precomputed
    augmentations and GPUs (``autoseg.train.run_config.RunConfig``)."""
    p.add_argument("--no-validation", action="store_true", help="skip predicting the validation cases at the end")
    add_precision_check_flag(p, "after the final validation")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue each fold from its checkpoint_latest.pt (the plan must be unchanged); a fold that "
        "finished is skipped, one without a checkpoint starts from its first epoch",
    )
    p.add_argument(
        "--time-budget",
        type=duration_value,
        default=None,
        metavar="DURATION",
        help="end training (and the final validation) within this time, e.g. 2h, 30m, 90s: epochs, "
        "iterations per epoch and the final validation's mirroring and cases are chosen from the "
        "measured speed and re-estimated as it runs (train.log, run.json)",
    )
    _add_track_flag(p)
    p.add_argument(
        "--loader-workers",
        type=int_at_least(0),
        default=None,
        metavar="N",
        help="processes building training batches (default: the plan's, sized by its host RAM budget)",
    )
    pre = p.add_mutually_exclusive_group()
    pre.add_argument(
        "--use-precomputed",
        dest="use_precomputed",
        action="store_true",
        default=None,
        help="sample the precomputed augmented copies (default: when every case has them)",
    )
    pre.add_argument(
        "--no-precomputed",
        dest="use_precomputed",
        action="store_false",
        help="rotate and scale on the fly even if precomputed copies exist",
    )
    p.add_argument(
        "--gpus",
        type=int_at_least(1),
        default=None,
        metavar="N",
        help="train on N GPUs of this node: runs this command under torchrun, one process per GPU "
        "(with --device cpu: N CPU processes). Several nodes: start `torchrun ... -m autoseg train "
        "...` on each yourself",
    )


def _add_track_flag(p: argparse.ArgumentParser) -> None:
    """``--track``: the experiment trackers (``autoseg.train.tracking``)."""
    p.add_argument(
        "--track",
        nargs="+",
        choices=sorted(TRACKERS),
        default=[],
        metavar="TRACKER",
        help="also log each epoch's figures, the plan and the memory checks, and progress.png to TensorBoard (event "
        "files in the fold's folder) and/or MLflow (a local store in the workspace, or $MLFLOW_TRACKING_URI): "
        'tensorboard, mlflow; extras: pip install "autoseg[tensorboard]" / "autoseg[mlflow]". Offline: '
        "nothing is sent anywhere unless $MLFLOW_TRACKING_URI names a server",
    )
