"""Flags: the parser of every command, with each flag's range and form checked when it is parsed (before any
work is done or any file written): the values they turn into (``flag_values``), the training commands' flags
(``training_flags``), prediction's (``predict_flags``) and the others' here."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from autoseg.cli.flag_values import SEED, add_workspace, int_at_least, positive_float, resolve_device
from autoseg.cli.predict_flags import add_export_model_command, add_import_nnunet_command, add_predict_command
from autoseg.cli.training_flags import add_plan_commands, add_precision_check_flag, add_train_command
from autoseg.core.errors import InputError


def _add_evaluate_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("evaluate", help="Dice, IoU, HD95, surface Dice per class: autoseg evaluate PRED_DIR GT_DIR")
    p.add_argument("pred_dir")
    p.add_argument("gt_dir")
    p.add_argument("-o", "--output", default=None, help="summary.json path (default: PRED_DIR/summary.json)")
    p.add_argument(
        "--file-ending",
        default=None,
        metavar="ENDING",
        help="the segmentations' file ending: .nii.gz, .nii, .nrrd, .mha or .mhd (default: the one format of the "
        "files in GT_DIR)",
    )
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
    p.add_argument(
        "--images",
        default=None,
        metavar="IMAGES_DIR",
        help="the cases' images ({case}_0000.ext): draw one picture per case through its largest error and an "
        "index.html listing the cases worst first (docs/evaluation.md, Pictures)",
    )
    p.add_argument(
        "--pictures-dir",
        default=None,
        metavar="DIR",
        help="where --images writes the pictures and index.html (default: PRED_DIR/pictures)",
    )


def _add_statistics_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "statistics",
        help="per case and structure: voxels, volume, connected components and image intensities; "
        "writes statistics.csv and statistics.json",
    )
    p.add_argument("seg_dir", metavar="SEG_DIR", help="a folder of segmentations ({case}.ext)")
    p.add_argument(
        "--images",
        default=None,
        metavar="IMAGES_DIR",
        help="their images ({case}_0000.ext, {case}_0001.ext, ...): each channel's mean, std, 5th and 95th "
        "percentile inside each structure",
    )
    p.add_argument("-o", "--output", default=None, metavar="DIR", help="where to write (default: SEG_DIR)")


def _add_find_best_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "find-best",
        help="choose the configuration or ensemble of two, and the postprocessing, from "
        "the folds' cross-validation; writes inference.json",
    )
    add_workspace(p)
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
    add_workspace(p)
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
    add_plan_commands(sub)
    add_train_command(sub)
    add_predict_command(sub)
    add_export_model_command(sub)
    add_precision_check_flag(sub.choices["export-model"], "of a fold that has none (or a stale one)")
    add_import_nnunet_command(sub)
    _add_evaluate_command(sub)
    _add_statistics_command(sub)
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
