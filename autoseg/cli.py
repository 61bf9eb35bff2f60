"""Command line: turns flags into explicit arguments, prints the resolved values, calls one stage."""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from autoseg.core.errors import InputError
from autoseg.core.units import GiB


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
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_device(requested: str | None) -> str:
    """The device to train or predict on: ``requested`` if this machine has it, else the default."""
    import torch

    if requested == "cuda" and not torch.cuda.is_available():
        raise InputError(f"--device cuda: torch sees no CUDA device (torch {torch.__version__}, "
                         "torch.cuda.is_available() is False); use --device cpu, or install a CUDA build of torch")
    return requested or default_device()


def _add_workspace(p: argparse.ArgumentParser) -> None:
    p.add_argument("-w", "--workspace", default=".", help="workspace folder (default: current directory)")


def _add_budget(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpu-memory", type=parse_bytes, default=None,
                   help="GPU memory to plan for (e.g. 8GiB, 24GiB, 80GB); default: the CUDA device's, else 8 GiB")
    p.add_argument("--ram", type=parse_bytes, default=None, help="host RAM budget; default: available memory")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None,
                   help="device training will run on (default: cuda if present, else cpu)")
    p.add_argument("--cpu-flops", type=positive_float, default=None,
                   help="CPU training throughput in FLOP/s for --device cpu (default: measured once, then cached)")


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
        p.add_argument("--overwrite", action="store_true",
                       help="when the workspace was made from another dataset, this one changed, or plans.json "
                            "differs from what the preprocessed data was made with: plan again and redo the stale "
                            "preprocessed cases (a plans.json edited by hand is kept; delete it to plan anew); "
                            "trained folds of a changed plan or dataset are moved to results/<config>.stale-<n>, "
                            "never deleted. Without it such a workspace is refused")
        if name == "plan_and_preprocess":
            p.add_argument("-c", "--configs", nargs="+", default=None, help="configurations (default: all planned)")
            p.add_argument("--processes", type=int_at_least(1), default=None,
                           help="preprocessing processes (default: as many as the RAM budget fits, at most the CPUs)")
            p.add_argument("--precompute-augmentations", type=int_at_least(0), default=0, metavar="K",
                           help="write K spatially augmented copies per case (rotation, scaling, elastic), so "
                                "training can skip the spatial transform (default: 0)")


def _add_train_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train one fold: `autoseg train fold 0` (or `fold all`)")
    p.add_argument("fold", nargs="+", help="'fold 0', '0' or 'all'")
    _add_workspace(p)
    p.add_argument("-c", "--config", default=None,
                   help="configuration (default: 3d_fullres if planned, else the first)")
    p.add_argument("--epochs", type=int_at_least(1), default=None, help="default: 1000")
    p.add_argument("--iterations-per-epoch", type=int_at_least(1), default=None, help="default: 250")
    p.add_argument("--val-iterations", type=int_at_least(1), default=None,
                   help="validation patches per epoch for the pseudo-Dice (default: 50)")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None)
    p.add_argument("--seed", type=SEED, default=0)
    p.add_argument("--no-validation", action="store_true", help="skip predicting the validation cases at the end")
    p.add_argument("--resume", action="store_true",
                   help="continue from the fold's checkpoint_latest.pt (the plan must be unchanged)")
    p.add_argument("--time-budget", type=_duration, default=None, metavar="DURATION",
                   help="end training (and the final validation) within this time, e.g. 2h, 30m, 90s: the number "
                        "of epochs is chosen from the measured speed")
    p.add_argument("--loader-workers", type=int_at_least(0), default=None, metavar="N",
                   help="processes building training batches (default: the plan's, sized by its host RAM budget)")
    pre = p.add_mutually_exclusive_group()
    pre.add_argument("--use-precomputed", dest="use_precomputed", action="store_true", default=None,
                     help="sample the precomputed augmented copies (default: when every case has them)")
    pre.add_argument("--no-precomputed", dest="use_precomputed", action="store_false",
                     help="rotate and scale on the fly even if precomputed copies exist")
    p.add_argument("--gpus", type=int_at_least(1), default=None, metavar="N",
                   help="train on N GPUs of this node: runs this command under torchrun, one process per GPU "
                        "(with --device cpu: N CPU processes). Several nodes: start `torchrun ... -m autoseg train "
                        "...` on each yourself")


def _add_predict_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("predict", help="segment new scans with the trained folds")
    p.add_argument("-i", "--input", required=True, help="folder of {case}_0000.ext files, or one image file")
    p.add_argument("-o", "--output", required=True, help="output folder")
    _add_workspace(p)
    p.add_argument("-c", "--config", default=None)
    p.add_argument("-f", "--folds", nargs="+", default=None, help="folds to ensemble (default: all trained)")
    p.add_argument("--checkpoint", default="final", choices=["final", "best", "latest"])
    p.add_argument("--no-mirror", action="store_true", help="disable mirror test-time augmentation")
    p.add_argument("--tile-batch-size", type=int_at_least(1), default=1, help="tiles per forward pass (default: 1)")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None)


def _add_evaluate_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("evaluate", help="Dice and IoU per class: autoseg evaluate PRED_DIR GT_DIR")
    p.add_argument("pred_dir")
    p.add_argument("gt_dir")
    p.add_argument("-o", "--output", default=None, help="summary.json path (default: PRED_DIR/summary.json)")


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
    p.add_argument("-c", "--config", default=None,
                   help="configuration (default: 3d_fullres if planned, else the first)")
    p.add_argument("--json", action="store_true", help="print the same figures as JSON (bytes)")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None,
                   help="device whose overheads to add (default: the one the configuration was planned for)")


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
    _add_evaluate_command(sub)
    _add_demo_command(sub)
    _add_explain_command(sub)
    _add_make_demo_dataset_command(sub)
    for command in sub.choices.values():  # also after the command: `autoseg train ... --debug`
        command.set_defaults(command_parser=command)
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                             help="print the traceback of an error")
    return parser


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse and check ``argv``: every flag's range and form is checked here, before any work or file
    is written; a bad one exits with status 2 and a message naming it."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "train":
        try:
            args.fold = _fold(args.fold)
        except ValueError as e:
            args.command_parser.error(str(e))
    if args.command in ("train", "predict") and args.device == "cuda":
        try:
            resolve_device(args.device)
        except InputError as e:
            args.command_parser.error(str(e))
    return args


def _fold(values: list[str]) -> int | str:
    if values[:1] == ["fold"]:
        values = values[1:]
    if len(values) != 1 or not (values[0] == "all" or values[0].isdigit()):
        raise ValueError(f"fold {' '.join(values)!r}: give the fold as `fold 0` .. `fold 4` or `fold all`")
    return "all" if values[0] == "all" else int(values[0])


def _budget(args: argparse.Namespace):
    from autoseg.core.resources import available_ram_bytes, cuda_total_memory
    from autoseg.plan.budget import Budget

    device = args.device or default_device()
    gpu = args.gpu_memory
    if gpu is None:
        gpu = cuda_total_memory()
        if gpu is None:
            gpu = 8 * GiB
            print("note: no CUDA device found; planning for 8 GiB of GPU memory (set --gpu-memory to change)")
    ram = args.ram or available_ram_bytes()
    budget = Budget(gpu_memory_bytes=gpu, host_ram_bytes=ram, device=device)
    print(f"budget: GPU memory {gpu / GiB:.1f} GiB, host RAM {ram / GiB:.1f} GiB, training device {device}")
    if device == "cpu":
        from autoseg.plan.throughput import cached_cpu_throughput

        flops, source = (args.cpu_flops, "--cpu-flops") if args.cpu_flops else \
            cached_cpu_throughput(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "autoseg")
        budget = replace(budget, cpu_flops_per_second=flops)
        print(f"CPU throughput {flops / 1e9:.1f} GFLOP/s ({source}); planning for "
              f"{budget.cpu_seconds_per_iteration:g} s per iteration")
    else:
        from autoseg.plan.throughput import cuda_device_name

        budget = replace(budget, gpu_name=cuda_device_name())
    return budget


def _default_config(workspace) -> str:
    from autoseg.plan.plans import Plans

    return Plans.from_json(workspace.require(workspace.plans_path, "plan_and_preprocess")).default_configuration()


def _without_gpus(argv: Sequence[str]) -> list[str]:
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


def _launch_processes(args: argparse.Namespace, argv: Sequence[str]) -> int | None:
    """``train --gpus N``: check N against the visible CUDA devices, then run the same command (without
    ``--gpus``) under torchrun, N processes on this node; its exit code. None for N = 1: this process trains."""
    import functools
    import signal
    import subprocess

    import torch

    from autoseg.core.workers import die_with_parent
    from autoseg.model.distributed import torchrun_command

    n = args.gpus
    if "WORLD_SIZE" in os.environ:
        raise InputError("--gpus starts torchrun itself; when launching with torchrun leave --gpus out")
    if args.device != "cpu":
        visible = torch.cuda.device_count()
        if visible == 0:
            raise InputError(f"--gpus {n}: no CUDA device is visible; add --device cpu to train in {n} CPU processes")
        if n > visible:
            raise InputError(f"--gpus {n} but only {visible} CUDA device(s) are visible (CUDA_VISIBLE_DEVICES, "
                             f"nvidia-smi); use --gpus {visible} or fewer")
    if n == 1:
        return None
    command = torchrun_command(n, _without_gpus(argv))
    print(f"launching {n} processes: {shlex.join(command)}", flush=True)
    # torchrun stops its ranks on SIGTERM: sent to it if this process is killed
    stop_with_us = functools.partial(die_with_parent, os.getpid(), signal.SIGTERM)
    return subprocess.run(command, preexec_fn=stop_with_us).returncode


def _distributed_context(environ: Mapping[str, str], device: str):
    """This process's place in a torchrun launch (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE); a single
    process when WORLD_SIZE is not set."""
    from autoseg.model.distributed import SINGLE_PROCESS, DistributedContext, backend_for

    if "WORLD_SIZE" not in environ:
        return SINGLE_PROCESS
    try:
        context = DistributedContext(rank=int(environ["RANK"]), world_size=int(environ["WORLD_SIZE"]),
                                     local_rank=int(environ["LOCAL_RANK"]),
                                     local_world_size=int(environ["LOCAL_WORLD_SIZE"]), backend=backend_for(device))
    except (KeyError, ValueError) as e:
        raise InputError(f"cannot read the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE): "
                         f"{e}; launch with torchrun or `autoseg train ... --gpus N`") from e
    if context.is_distributed and context.backend == "nccl":
        import torch

        if context.local_rank >= torch.cuda.device_count():
            raise InputError(f"local rank {context.local_rank} has no CUDA device ({torch.cuda.device_count()} "
                             "visible); start at most one process per GPU (--nproc_per_node)")
    return context


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    progress = not args.quiet and sys.stderr.isatty()
    try:
        if args.command == "train" and args.gpus is not None:
            code = _launch_processes(args, argv)
            if code is not None:
                return code
        return COMMANDS[args.command](args, progress)  # one stage per command
    except Exception as e:  # the one place an error becomes a message and an exit status
        if args.debug:
            raise
        return report_error(f"autoseg {args.command}", e)
    except KeyboardInterrupt:
        print(f"autoseg {args.command}: interrupted; finished artifacts are kept, unfinished ones are not "
              "(rerun the command to go on)", file=sys.stderr)
        return 130


def report_error(prefix: str, error: Exception) -> int:
    """Print ``error`` as one message on stderr; return the exit status (2: bad input, 1: failure).

    autoseg's own errors and the operating system's (a full disk, a read-only folder, no memory) are
    anticipated: their message says what to do. Anything else is a bug: its traceback goes to a file."""
    from autoseg.core.errors import AutosegError

    if isinstance(error, AutosegError):
        print(f"{prefix}: error: {error}", file=sys.stderr)
        return error.exit_status
    if isinstance(error, OSError) and error.errno is not None:
        where = f"{error.filename}: " if error.filename else ""
        print(f"{prefix}: error: {where}{error.strerror} (errno {error.errno}); nothing unfinished was kept. Free "
              "space, fix the permissions or choose another folder, then rerun", file=sys.stderr)
        return 1
    if isinstance(error, MemoryError):
        print(f"{prefix}: error: out of host memory; give a smaller --ram budget to plan_and_preprocess or close "
              "other programs, then rerun", file=sys.stderr)
        return 1
    path = _write_traceback(prefix, error)
    print(f"{prefix}: internal error: {type(error).__name__}: {error}\nThis is a bug in autoseg, not in your input. "
          f"The traceback is in {path}; please report it with that file (--debug prints it here).", file=sys.stderr)
    return 1


def _write_traceback(prefix: str, error: Exception) -> Path | str:
    import tempfile
    import time
    import traceback

    name = f"{prefix.replace(' ', '-')}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.traceback.txt"
    path = Path(tempfile.gettempdir()) / name
    try:
        path.write_text("".join(traceback.format_exception(error)))
    except OSError:
        return "(not written: the temporary folder is not writable)"
    return path


def _plan(args: argparse.Namespace, progress: bool) -> int:
    from autoseg.core.workspace import Workspace
    from autoseg.dataset.raw import load_dataset
    from autoseg.preprocess.run import plan_and_preprocess

    ws = Workspace.at(args.workspace)
    print(f"workspace: {ws.root}")
    dataset = load_dataset(args.dataset)  # a wrong path or dataset.json fails here, before calibrating
    preprocess = args.command == "plan_and_preprocess"
    plan_and_preprocess(dataset, ws, _budget(args), preprocess_configs=preprocess, progress=progress,
                        configs=args.configs if preprocess else None,
                        processes=args.processes if preprocess else None,
                        precompute_augmentations=args.precompute_augmentations if preprocess else 0,
                        overwrite=args.overwrite)
    return 0


def _train(args: argparse.Namespace, progress: bool) -> int:
    from autoseg.core.workspace import Workspace
    from autoseg.model.distributed import process_group
    from autoseg.train.run_config import RunConfig
    from autoseg.train.trainer import train

    ws = Workspace.at(args.workspace)
    config = args.config or _default_config(ws)
    device = resolve_device(args.device)
    distributed = _distributed_context(os.environ, device)
    given = {k: v for k in ("epochs", "iterations_per_epoch", "val_iterations") if (v := getattr(args, k)) is not None}
    run = RunConfig(
        **given, seed=args.seed, device=distributed.device(device), validate=not args.no_validation,
        loader_workers=args.loader_workers, use_precomputed=args.use_precomputed, resume=args.resume,
        time_budget_s=args.time_budget,
    )
    if distributed.is_main:
        print(f"workspace: {ws.root}\nconfiguration: {config}\nrun: {run}\nprocesses: {distributed.world_size}"
              f" ({distributed.backend if distributed.is_distributed else 'single process'})")
    else:  # rank 0 reports
        logging.getLogger().setLevel(logging.WARNING)
        progress = False
    with process_group(distributed):
        train(ws, config, args.fold, run, progress=progress, distributed=distributed)
    return 0


def _predict(args: argparse.Namespace, progress: bool) -> int:
    from autoseg.core.workspace import Workspace
    from autoseg.predict.predictor import predict

    ws = Workspace.at(args.workspace)
    config = args.config or _default_config(ws)
    folds = None if args.folds is None else tuple(int(f) if f.isdigit() else f for f in args.folds)
    written = predict(ws, args.input, args.output, config_name=config, folds=folds, checkpoint=args.checkpoint,
                      mirror=not args.no_mirror, tile_batch_size=args.tile_batch_size,
                      device=resolve_device(args.device), progress=progress)
    print(f"wrote {len(written)} segmentation(s) to {Path(args.output).resolve()}")
    return 0


def _evaluate(args: argparse.Namespace, progress: bool) -> int:
    from autoseg.evaluate.metrics import evaluate_folder, format_table

    out = args.output or os.path.join(args.pred_dir, "summary.json")
    summary = evaluate_folder(args.pred_dir, args.gt_dir, output_json=out)
    print(format_table(summary))
    print(f"summary: {out}")
    return 0


def _explain(args: argparse.Namespace, progress: bool) -> int:
    import json

    from autoseg.core.workspace import Workspace
    from autoseg.explain.explanation import explain
    from autoseg.explain.format import format_explanation
    from autoseg.plan.fingerprint import Fingerprint
    from autoseg.plan.plans import Plans

    ws = Workspace.at(args.workspace or ".")
    plans_path = Path(args.plans) if args.plans else ws.require(ws.plans_path, "plan")
    plans = Plans.from_json(plans_path)
    config = args.config or plans.default_configuration()
    fp_path = Workspace.at(plans_path.parent).fingerprint_path  # a workspace keeps it beside plans.json
    fingerprint = Fingerprint.from_json(fp_path) if fp_path.is_file() else None
    explanation = explain(plans, config, device=args.device, fingerprint=fingerprint)
    text = json.dumps(explanation.to_dict(), indent=2) if args.json else format_explanation(explanation)
    print(text.rstrip("\n"))
    return 0


def _make_demo_dataset(args: argparse.Namespace, progress: bool) -> int:
    from autoseg.demo.data import make_demo_dataset

    path = make_demo_dataset(args.output, num_train=args.num_train, num_test=args.num_test, seed=args.seed)
    print(f"demo dataset written to {path}")
    return 0


def _demo(args: argparse.Namespace, progress: bool) -> int:
    from autoseg.demo.run import run_demo

    result = run_demo(args.workspace, epochs=args.epochs, iterations_per_epoch=args.iterations_per_epoch,
                      num_train=args.num_train, progress=progress)
    return 0 if result.passed else 1


COMMANDS = {"plan": _plan, "plan_and_preprocess": _plan, "train": _train, "predict": _predict,
            "evaluate": _evaluate, "explain": _explain, "make-demo-dataset": _make_demo_dataset, "demo": _demo}


if __name__ == "__main__":
    sys.exit(main())
