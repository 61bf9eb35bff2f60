"""Flags: the parser of every command, with each flag's range and form checked when it is parsed (before any
work is done or any file written), and the values it turns them into (bytes, durations, folds, devices)."""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Sequence

from autoseg.core.errors import InputError
from autoseg.core.resources import cuda_available
from autoseg.model.topology import ARCHITECTURES


def parse_bytes(text: str) -> int:
    """'8GiB', '24 GiB', '80GB', '512MiB', or a plain number of GiB -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B|[KMGT])?\s*", text, flags=re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"cannot read {text!r} as a memory size; use e.g. 8GiB, 24GiB, 80GB or 8")
    value, unit = float(m.group(1)), (m.group(2) or "GiB").upper()
    powers = {"K": 1, "M": 2, "G": 3, "T": 4}
    base = 1000 if unit.endswith("B") and "I" not in unit else 1024
    nbytes = int(value * base ** powers[unit[0]])
    if nbytes < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is no memory at all; give a positive size, e.g. 8GiB")
    return nbytes


def int_at_least(low: int, high: int | None = None):
    """An argparse type: a whole number in [low, high] (high: no limit when None)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low or (high is not None and value > high):
            limits = f"at least {low}" if high is None else f"from {low} to {high}"
            raise argparse.ArgumentTypeError(f"{value} is out of range; give a whole number {limits}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0 (refuses nan and inf)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a finite number above 0")
    return value


SEED = int_at_least(0, 2**32 - 1)  # numpy's and torch's seeds are non-negative


def default_device() -> str:
    return "cuda" if cuda_available() else "cpu"


def resolve_device(requested: str | None) -> str:
    """The device to train or predict on: ``requested`` if this machine has it, else the default."""
    import torch

    if requested == "cuda" and not torch.cuda.is_available():
        raise InputError(
            f"--device cuda: torch sees no CUDA device (torch {torch.__version__}, "
            "torch.cuda.is_available() is False); use --device cpu, or install a CUDA build of torch"
        )
    return requested or default_device()


def _add_workspace(p: argparse.ArgumentParser) -> None:
    p.add_argument("-w", "--workspace", default=".", help="workspace folder (default: current directory)")


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


def _tta(text: str) -> str:
    """``--tta``: all, none or a whole number (checked against the network's mirror variants at prediction)."""
    if text.strip().lower() in ("all", "none") or text.strip().isdigit():
        return text.strip().lower()
    raise argparse.ArgumentTypeError(f"{text!r}: use all, none or a number of mirror variants, e.g. 4")


def _tile_batch(text: str) -> int | None:
    """``--tile-batch-size``: auto (None: chosen from the memory model) or a whole number >= 1."""
    return None if text.strip().lower() == "auto" else int_at_least(1)(text)


def _workers(text: str) -> int | None:
    """``--preprocess-workers`` / ``--export-workers``: auto (None: sized from the host RAM) or a whole number >= 0."""
    return None if text.strip().lower() == "auto" else int_at_least(0)(text)


def _duration(text: str) -> float:
    from autoseg.train.schedule import parse_duration

    try:
        return parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_plan_commands(sub: argparse._SubParsersAction) -> None:
    for name in ("plan", "plan_and_preprocess"):
        p = sub.add_parser(name, help="fingerprint and plan" + (" and preprocess" if "pre" in name else ""))
        p.add_argument("dataset", help="raw dataset folder (nnU-Net layout: dataset.json, imagesTr/, labelsTr/)")
        _add_workspace(p)
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


def _add_train_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train", help="train folds: `autoseg train fold 0`, `fold 0 1 2 3 4` (one after the other) or `fold all`"
    )
    p.add_argument("fold", nargs="+", help="'fold 0', '0', 'fold 0 1 2 3 4' or 'all'")
    _add_workspace(p)
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
    p.add_argument("--no-validation", action="store_true", help="skip predicting the validation cases at the end")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue each fold from its checkpoint_latest.pt (the plan must be unchanged); a fold that "
        "finished is skipped, one without a checkpoint starts from its first epoch",
    )
    p.add_argument(
        "--time-budget",
        type=_duration,
        default=None,
        metavar="DURATION",
        help="end training (and the final validation) within this time, e.g. 2h, 30m, 90s: epochs, "
        "iterations per epoch and the final validation's mirroring and cases are chosen from the "
        "measured speed and re-estimated as it runs (train.log, run.json)",
    )
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


def _add_predict_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("predict", help="segment new scans with the trained folds")
    p.add_argument(
        "-i",
        "--input",
        required=True,
        help="a folder of {case}_0000.ext files (nnU-Net's layout), one image file, or a folder holding "
        "one DICOM series (its output is named after the folder, .nii.gz, in the series' geometry)",
    )
    p.add_argument("-o", "--output", required=True, help="output folder")
    model = p.add_mutually_exclusive_group()  # default None: `-m A.zip -w .` is refused too
    model.add_argument("-w", "--workspace", default=None, help="workspace folder (default: current directory)")
    model.add_argument(
        "-m",
        "--model",
        default=None,
        metavar="ARCHIVE.zip",
        help="a model archive from `autoseg export-model`, instead of a workspace: checked, unpacked "
        "to a temporary folder removed afterwards; its configuration, folds and checkpoint",
    )
    p.add_argument("-c", "--config", default=None)
    p.add_argument("-f", "--folds", nargs="+", default=None, help="folds to ensemble (default: all trained)")
    p.add_argument(
        "--checkpoint",
        default=None,
        choices=["final", "best", "latest"],
        help="which checkpoint of each fold (default: final; not with -m: the archive holds one)",
    )
    p.add_argument(
        "--tta",
        type=_tta,
        default=None,
        metavar="all|none|N",
        help="mirror test-time augmentation: every mirror variant (all: 8 in 3D, 4 in 2D), none, or the "
        "first N (identity, each axis, then pairs). Default: all on CUDA, 4 on CPU (there all 8 took "
        "2.2x the time of 4 for +0.0003 Dice on the demo: docs/prediction.md)",
    )
    p.add_argument("--no-mirror", action="store_true", help="the same as --tta none")
    p.add_argument(
        "--tile-batch-size",
        type=_tile_batch,
        default=None,
        metavar="auto|N",
        help="(tile, mirror variant) inputs per forward pass: auto (the default) takes the largest the "
        "memory model predicts to fit, at most 4 on CPU; N caps it at N",
    )
    p.add_argument(
        "--accumulator",
        default=None,
        metavar="float16|float32",
        help="the dtype of the sliding window's running mean of logits (its largest buffer: classes x "
        "a tile's depth x the image's plane): float16 (the default: half the bytes; labels within "
        "0.1%% of float32's, docs/prediction.md) or float32",
    )
    p.add_argument(
        "--tile",
        choices=["planned", "patch"],
        default="planned",
        help="the sliding window's tile: planned (the default: plans.json's inference_patch_size, up to "
        "the median image and twice the training patch per axis where memory allows; consecutive "
        "tiles overlap by half a training patch) or patch (the training patch, at half-patch steps)",
    )
    p.add_argument(
        "--preprocess-workers",
        type=_workers,
        default=None,
        metavar="auto|N",
        help="cases read and preprocessed ahead on background threads while one is predicted (nnU-Net's "
        "-npp); auto (the default): as many as the host RAM holds beside the prediction, at most 4 "
        "and the CPU count; 0: each case is read when its turn comes",
    )
    p.add_argument(
        "--export-workers",
        type=_workers,
        default=None,
        metavar="auto|N",
        help="cases exported (resampled back, written) behind on background threads (nnU-Net's -nps); "
        "auto (the default) sized like --preprocess-workers; 0: each case is written before the next",
    )
    p.add_argument(
        "--verbose",
        action="store_true",
        help="print the pipeline (workers, each stage's bytes, predicted host peak, and the measured one at "
        "the end) and each case's inference plan: tile batch, accumulator device and dtype, peak",
    )
    p.add_argument("--device", choices=["cuda", "cpu"], default=None)
    p.add_argument(
        "--series",
        default=None,
        metavar="UID",
        help="the DICOM series to predict (its SeriesInstanceUID) when the -i folder holds several; the "
        "output is then named {UID}.nii.gz",
    )
    p.add_argument(
        "--save-probabilities",
        action="store_true",
        help="also write {case}.npz beside each label map: 'probabilities' float16 (K, Z, Y, X) in the "
        "input's own grid (softmax of each class, or sigmoid of each region), 'names' (the K "
        "outputs) and 'activation', what averaging models or folds needs (np.load reads it). "
        "float16: half the size of float32, precise to 1e-3",
    )
    p.add_argument(
        "--continue",
        dest="skip_existing",
        action="store_true",
        help="skip cases whose outputs already exist (with --save-probabilities: both files). Every "
        "output is written under a temporary name and renamed when complete, so an existing one is "
        "complete: rerun a killed or failed run with --continue to finish it",
    )
    p.add_argument(
        "--fail-fast",
        action="store_true",
        help="stop at the first case with bad input (default: skip it, predict the others, list the "
        "failed cases at the end and exit with status 2)",
    )


def _add_export_model_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export-model",
        help="write a trained model (plan, fingerprint, fold checkpoints, manifest) "
        "to one zip for `autoseg predict -m` on another machine",
    )
    p.add_argument("output", metavar="OUT.zip", help="archive to write (written under a temporary name, then renamed)")
    _add_workspace(p)
    p.add_argument(
        "-c",
        "--config",
        default=None,
        help="configuration (default: the workspace's inference.json, autoseg find-best's choice with its "
        "postprocessing; without one 3d_fullres if planned, else the first)",
    )
    p.add_argument(
        "-f",
        "--folds",
        nargs="+",
        type=_fold_name,
        default=None,
        help="folds to include, e.g. 0 1 2 or all (default: inference.json's, else every fold trained "
        "with the checkpoint)",
    )
    p.add_argument(
        "--checkpoint",
        default=None,
        choices=["final", "best"],
        help="which checkpoint of each fold (default: inference.json's, else final)",
    )


def _fold_name(text: str) -> str:
    """An argparse type: a fold number or 'all' (the folder results/<config>/fold_<name>)."""
    if not (text.isdigit() or text == "all"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a fold; give fold numbers (0 1 2) or all")
    return text


def _add_evaluate_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("evaluate", help="Dice, IoU, HD95, surface Dice per class: autoseg evaluate PRED_DIR GT_DIR")
    p.add_argument("pred_dir")
    p.add_argument("gt_dir")
    p.add_argument("-o", "--output", default=None, help="summary.json path (default: PRED_DIR/summary.json)")
    surface = p.add_mutually_exclusive_group()
    surface.add_argument(
        "--nsd-tolerance",
        type=positive_float,
        default=None,
        metavar="MM",
        help="tolerance of the normalized surface Dice in mm (default: 2; docs/evaluation.md)",
    )
    surface.add_argument(
        "--no-surface",
        action="store_true",
        help="skip HD95 and the normalized surface Dice (Dice, IoU and volumes only)",
    )


def _add_find_best_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "find-best",
        help="choose the configuration or ensemble of two, and the postprocessing, from "
        "the folds' cross-validation; writes inference.json",
    )
    _add_workspace(p)
    p.add_argument(
        "-c",
        "--configs",
        nargs="+",
        default=None,
        help="configurations to compare (default: every planned configuration with trained folds)",
    )
    p.add_argument(
        "-f",
        "--folds",
        nargs="+",
        type=int_at_least(0),
        default=None,
        help="folds whose validation cases are pooled (default: every fold of splits.json, 0 1 2 3 4); "
        "every configuration needs each of them",
    )


def _add_demo_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="synthetic dataset -> plan -> train -> predict -> evaluate, on CPU")
    p.add_argument("-w", "--workspace", default=None, help="workspace (default: a temporary folder)")
    p.add_argument("--epochs", type=int_at_least(1), default=None)
    p.add_argument("--iterations-per-epoch", type=int_at_least(1), default=None)
    p.add_argument("--num-train", type=int_at_least(2), default=None, help="training cases (default: 24)")


def _add_explain_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("explain", help="where the memory of a planned configuration goes, and what-ifs")
    where = p.add_mutually_exclusive_group()
    where.add_argument("-w", "--workspace", default=None, help="workspace folder (default: current directory)")
    where.add_argument("--plans", default=None, help="a plans.json file instead of a workspace")
    p.add_argument(
        "-c", "--config", default=None, help="configuration (default: 3d_fullres if planned, else the first)"
    )
    p.add_argument("--json", action="store_true", help="print the same figures as JSON (bytes)")
    p.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default=None,
        help="device whose overheads to add (default: the one the configuration was planned for)",
    )


def _add_check_memory_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "check-memory",
        help="run a few real steps of a planned configuration and compare their "
        "measured memory with the memory model's prediction",
    )
    _add_workspace(p)
    p.add_argument(
        "-c", "--config", default=None, help="configuration (default: 3d_fullres if planned, else the first)"
    )
    p.add_argument(
        "--steps",
        type=int_at_least(3),
        default=3,
        help="real training steps on synthetic batches (default and least: 3; the first creates the "
        "optimizer state, the second is tracked, the peak RSS is taken over the others)",
    )
    p.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default=None,
        help="device to check on (default: cuda if available, else cpu)",
    )
    p.add_argument("--json", action="store_true", help="print the check as JSON (bytes)")


def _add_make_demo_dataset_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-demo-dataset", help="write the synthetic demo dataset (nnU-Net layout)")
    p.add_argument("output", help="dataset folder to create")
    p.add_argument("--num-train", type=int_at_least(1), default=24)
    p.add_argument("--num-test", type=int_at_least(0), default=6)
    p.add_argument("--seed", type=SEED, default=0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autoseg", description="Self-configuring medical image segmentation.")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    parser.add_argument("--debug", action="store_true", help="print the traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_plan_commands(sub)
    _add_train_command(sub)
    _add_predict_command(sub)
    _add_export_model_command(sub)
    _add_evaluate_command(sub)
    _add_find_best_command(sub)
    _add_demo_command(sub)
    _add_explain_command(sub)
    _add_check_memory_command(sub)
    _add_make_demo_dataset_command(sub)
    for command in sub.choices.values():  # also after the command: `autoseg train ... --debug`
        command.set_defaults(command_parser=command)
        command.add_argument(
            "--debug", action="store_true", default=argparse.SUPPRESS, help="print the traceback of an error"
        )
    return parser


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse and check ``argv``: every flag's range and form is checked here, before any work or file
    is written; a bad one exits with status 2 and a message naming it."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "train":
        try:
            args.folds = parse_fold(args.fold)
        except ValueError as e:
            args.command_parser.error(str(e))
    if args.command == "predict" and args.model is not None and args.checkpoint is not None:
        args.command_parser.error(
            f"argument --checkpoint: not allowed with argument -m/--model: the archive holds one "
            f"checkpoint per fold, chosen by `autoseg export-model --checkpoint`; leave "
            f"--checkpoint {args.checkpoint} out, or export the model again with it"
        )
    if args.command in ("train", "predict", "check-memory") and args.device == "cuda":
        try:
            resolve_device(args.device)
        except InputError as e:
            args.command_parser.error(str(e))
    return args


def parse_fold(values: list[str]) -> list[int | str]:
    """``fold 0``, ``0``, ``fold 0 1 2 3 4``, ``fold all`` -> the folds, in the order given (each once)."""
    if values[:1] == ["fold"]:
        values = values[1:]
    if not values or any(not (v == "all" or v.isdigit()) for v in values) or len(set(values)) != len(values):
        raise ValueError(
            f"fold {' '.join(values)!r}: give the folds as `fold 0` .. `fold 4`, several as "
            "`fold 0 1 2 3 4` (each once), or `fold all`"
        )
    return ["all" if v == "all" else int(v) for v in values]


def without_gpus(argv: Sequence[str]) -> list[str]:
    """``argv`` without ``--gpus N`` / ``--gpus=N`` (or an abbreviation argparse accepts, e.g. ``--gp 2``)."""
    kept, skip_value = [], False
    for token in argv:
        if skip_value:
            skip_value = False
            continue
        name = token.split("=", 1)[0]
        if len(name) >= 3 and "--gpus".startswith(name):
            skip_value = "=" not in token
            continue
        kept.append(token)
    return kept
