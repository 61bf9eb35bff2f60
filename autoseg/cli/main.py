"""Command line: turns the parsed flags into explicit arguments, prints the resolved values, calls one stage,
and is the one place where an error becomes a message and an exit status (``report_error``)."""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from autoseg.cli.flag_values import default_device, resolve_device
from autoseg.cli.model_commands import export_trained_model, import_nnunet_model, predict_cases
from autoseg.cli.parser import parse_args, without_gpus
from autoseg.core.errors import InputError
from autoseg.core.machine import bounded_onednn_primitive_cache, keep_simulations_in, passive_openmp_waiting


def _budget(args: argparse.Namespace):
    """The plan's budget from the flags, what they leave open measured (``measure_budget``); printed."""
    from autoseg.cli.budget import BudgetFlags, describe_budget, measure_budget

    flags = BudgetFlags(
        gpu_memory_bytes=args.gpu_memory,
        ram_bytes=args.ram,
        device=args.device or default_device(),
        architecture=args.architecture,
        cpu_flops=args.cpu_flops,
        time_budget_seconds=args.time_budget,
        seconds_per_iteration=args.seconds_per_iteration,
    )
    measured = measure_budget(flags, cache_dir(os.environ))
    print("\n".join(describe_budget(measured)))
    return measured.budget


def cache_dir(environ: Mapping[str, str]) -> Path:
    """Where per-machine measurements are kept: ``$AUTOSEG_CACHE_DIR``, else ``$XDG_CACHE_HOME/autoseg``, else
    ``~/.cache/autoseg``."""
    if environ.get("AUTOSEG_CACHE_DIR"):
        return Path(environ["AUTOSEG_CACHE_DIR"]).expanduser()
    return Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "autoseg"


def _default_config(workspace) -> str:
    from autoseg.plan.plans import Plans

    return Plans.from_json(workspace.require(workspace.plans_path, "plan_and_preprocess")).default_configuration()


def _launch_processes(args: argparse.Namespace, argv: Sequence[str]) -> int | None:
    """``train --gpus N``: check N against the visible CUDA devices, then run the same command (without
    ``--gpus``) under torchrun, N processes on this node; its exit code. None for N = 1: this process trains."""
    import torch

    from autoseg.core.workspace import Workspace
    from autoseg.model.distributed import run_torchrun
    from autoseg.train.folds import fold_locks

    n = args.gpus
    if "WORLD_SIZE" in os.environ:
        raise InputError("--gpus starts torchrun itself; when launching with torchrun leave --gpus out")
    if args.device != "cpu":
        visible = torch.cuda.device_count()
        if visible == 0:
            raise InputError(f"--gpus {n}: no CUDA device is visible; add --device cpu to train in {n} CPU processes")
        if n > visible:
            raise InputError(
                f"--gpus {n} but only {visible} CUDA device(s) are visible (CUDA_VISIBLE_DEVICES, "
                f"nvidia-smi); use --gpus {visible} or fewer"
            )
    if n == 1:
        return None
    ws = Workspace.at(args.workspace)
    with fold_locks(ws, args.config or _default_config(ws), args.folds, args.command_line):
        pass  # refused here, at once, while another command holds them; rank 0 takes them for every rank
    return run_torchrun(n, without_gpus(argv))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    passive_openmp_waiting(os.environ)  # before torch is imported: idle OpenMP threads sleep instead of spinning
    bounded_onednn_primitive_cache(os.environ)  # and oneDNN keeps a bounded number of compiled convolutions
    args = parse_args(argv)
    args.command_line = shlex.join(["autoseg", *argv])  # what a lock this command holds names (autoseg.core.lock)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    progress = not args.quiet and sys.stderr.isatty()
    try:
        if args.command == "train" and args.gpus is not None:
            code = _launch_processes(args, argv)
            if code is not None:
                return code
        if args.command in SIMULATING:
            keep_simulations_in(cache_dir(os.environ))
        return COMMANDS[args.command](args, progress)  # one stage per command
    except Exception as e:  # the one place an error becomes a message and an exit status
        if args.debug:
            raise
        return report_error(f"autoseg {args.command}", e)
    except KeyboardInterrupt:
        print(
            f"autoseg {args.command}: interrupted; finished artifacts are kept, unfinished ones are not "
            "(rerun the command to go on)",
            file=sys.stderr,
        )
        return 130
    finally:
        keep_simulations_in(None)


# commands that simulate training steps or sliding windows: their simulations are kept between runs
# (keep_simulations_in)
SIMULATING = frozenset({"plan", "plan_and_preprocess", "train", "explain", "check-memory", "demo", "predict"})


def report_error(prefix: str, error: Exception) -> int:
    """Print ``error`` as one message on stderr; return the exit status (2: bad input, 1: failure or bug)."""
    from autoseg.core.errors import EXIT_FAILURE, describe, write_traceback

    described = describe(error)
    if described is not None:
        print(f"{prefix}: error: {described[0]}", file=sys.stderr)
        return described[1]
    path = write_traceback(prefix, error)
    print(
        f"{prefix}: internal error: {type(error).__name__}: {error}\nThis is a bug in autoseg, not in your input. "
        f"The traceback is in {path}; please report it with that file (--debug prints it here).",
        file=sys.stderr,
    )
    return EXIT_FAILURE


def _plan(args: argparse.Namespace, progress: bool) -> int:
    from autoseg.core.lock import refuse_while_held
    from autoseg.core.workspace import Workspace, dataset_source
    from autoseg.dataset.raw import load_dataset
    from autoseg.plan.run import check_dataset
    from autoseg.preprocess.run import PreprocessRequest, plan_and_preprocess

    ws = Workspace.at(args.workspace)
    print(f"workspace: {ws.root}")
    dataset = load_dataset(args.dataset)  # a wrong path or dataset.json fails here, before calibrating
    # another writer of the plan is refused before the budget is measured (plan_and_preprocess then holds the lock)
    refuse_while_held(ws.plan_lock, ws.root, f"autoseg {args.command} writes it too")
    if not args.overwrite:  # a changed dataset, too, is refused before calibrating (up to a minute on a fresh machine)
        check_dataset(ws, dataset.root, dataset_source(dataset.root))
    preprocessing = None
    if args.command == "plan_and_preprocess":
        configs = None if args.configs is None else tuple(args.configs)
        preprocessing = PreprocessRequest(configs, args.processes, args.precompute_augmentations)
    like = None
    if args.like is not None:  # read before the budget is measured: a wrong model fails at once
        from autoseg.train.source_model import read_model_plan

        like = read_model_plan(args.like)
        print(f"like: {like.source} (its configuration(s) {', '.join(like.configurations)})")
    plan_and_preprocess(
        dataset,
        ws,
        _budget(args),
        preprocessing=preprocessing,
        progress=progress,
        overwrite=args.overwrite,
        command=args.command_line,
        like=like,
    )
    return 0


def _train(args: argparse.Namespace, progress: bool) -> int:
    from autoseg.core.workspace import Workspace
    from autoseg.model.distributed import context_from_environment, end_rank_process, process_group
    from autoseg.train.folds import train_folds
    from autoseg.train.run_config import RunConfig

    ws = Workspace.at(args.workspace)
    config = args.config or _default_config(ws)
    device = resolve_device(args.device)
    distributed = context_from_environment(os.environ, device)
    given = {k: v for k in ("epochs", "iterations_per_epoch", "val_iterations") if (v := getattr(args, k)) is not None}
    run = RunConfig(
        **given,
        seed=args.seed,
        device=distributed.device(device),
        validate=not args.no_validation,
        precision_check=not args.no_precision_check,
        loader_workers=args.loader_workers,
        use_precomputed=args.use_precomputed,
        resume=args.resume,
        time_budget_s=args.time_budget,
        track=tuple(args.track),
        init_from=None if args.init_from is None else str(Path(args.init_from).expanduser().resolve()),
        init_fold=args.init_fold,
    )
    if distributed.is_main:
        print(
            f"workspace: {ws.root}\nconfiguration: {config}\nfold(s): {' '.join(map(str, args.folds))}\nrun: {run}\n"
            f"processes: {distributed.world_size}"
            f" ({distributed.backend if distributed.is_distributed else 'single process'})"
        )
    else:  # rank 0 reports
        logging.getLogger().setLevel(logging.WARNING)
        progress = False
    with process_group(distributed):
        train_folds(ws, config, args.folds, run, progress=progress, distributed=distributed, command=args.command_line)
    if distributed.is_distributed:
        end_rank_process(0)  # not through the interpreter's teardown, where gloo aborts now and then
    return 0


def _evaluate(args: argparse.Namespace, progress: bool) -> int:
    from autoseg.evaluate.metrics import evaluate_folder, format_table
    from autoseg.evaluate.pictures import write_pictures

    out = args.output or os.path.join(args.pred_dir, "summary.json")
    surface = {"nsd_tolerance_mm": None} if args.no_surface else {}
    if args.nsd_tolerance is not None:
        surface = {"nsd_tolerance_mm": args.nsd_tolerance}
    summary = evaluate_folder(args.pred_dir, args.gt_dir, file_ending=args.file_ending, output_json=out, **surface)
    print(format_table(summary))
    print(f"summary: {out}")
    if args.images is not None:
        print(f"pictures: {write_pictures(summary, args.images, args.pictures_dir)} (worst case first)")
    return 0


def _statistics(args: argparse.Namespace, progress: bool) -> int:
    from autoseg.evaluate.folder_statistics import folder_statistics

    print(folder_statistics(args.seg_dir, args.images, args.output).describe())
    return 0


def _find_best(args: argparse.Namespace, progress: bool) -> int:
    from autoseg.core.workspace import Workspace
    from autoseg.selection.report import predict_command
    from autoseg.selection.run import find_best

    ws = Workspace.at(args.workspace)
    print(f"workspace: {ws.root}")
    result = find_best(
        ws,
        configs=args.configs,
        folds=None if args.folds is None else tuple(args.folds),
        progress=progress,
        command=args.command_line,
    )
    print(result.markdown.split("\nPredict with it:")[0].rstrip())
    print(
        f"wrote {ws.inference_path}, {ws.find_best_path} and {ws.find_best_path.with_suffix('.md')}\n"
        f"predict with: {predict_command(str(ws.root))}"
    )
    return 0


def _explain(args: argparse.Namespace, progress: bool) -> int:
    import json

    from autoseg.core.workspace import Workspace
    from autoseg.explain.explanation import explain_plans_file
    from autoseg.explain.format import format_explanation

    ws = Workspace.at(args.workspace or ".")
    plans_path = Path(args.plans) if args.plans else ws.require(ws.plans_path, "plan")
    explanation = explain_plans_file(plans_path, args.config, args.device)
    text = json.dumps(explanation.to_dict(), indent=2) if args.json else format_explanation(explanation)
    print(text.rstrip("\n"))
    return 0


def _check_memory(args: argparse.Namespace, progress: bool) -> int:
    import json

    import torch

    from autoseg.core.machine import use_cpu_threads
    from autoseg.core.workspace import Workspace
    from autoseg.plan.plans import Plans
    from autoseg.train.memory_check import EXIT_MEMORY_MISMATCH, check_plan

    ws = Workspace.at(args.workspace)
    plans = Plans.from_json(ws.require(ws.plans_path, "plan"))
    config = args.config or plans.default_configuration()
    device = torch.device(resolve_device(args.device))
    if device.type == "cpu":
        use_cpu_threads(None, "check-memory")
    print(f"workspace: {ws.root}\nconfiguration: {config}, {args.steps} real steps on synthetic batches on {device}")
    check = check_plan(plans, config, device, steps=args.steps)
    print(json.dumps(check.to_dict(), indent=2) if args.json else check.table())
    if check.ok:
        return 0
    print(f"autoseg check-memory: {check.warning()}", file=sys.stderr)
    return EXIT_MEMORY_MISMATCH


def _make_demo_dataset(args: argparse.Namespace, progress: bool) -> int:
    from autoseg.demo.data import make_demo_dataset

    path = make_demo_dataset(args.output, num_train=args.num_train, num_test=args.num_test, seed=args.seed)
    print(f"demo dataset written to {path}")
    return 0


def _demo(args: argparse.Namespace, progress: bool) -> int:
    from autoseg.demo.run import run_demo

    result = run_demo(
        args.workspace,
        epochs=args.epochs,
        iterations_per_epoch=args.iterations_per_epoch,
        num_train=args.num_train,
        progress=progress,
    )
    return 0 if result.passed else 1


COMMANDS = {
    "plan": _plan,
    "plan_and_preprocess": _plan,
    "train": _train,
    "predict": predict_cases,
    "export-model": export_trained_model,
    "import-nnunet": import_nnunet_model,
    "evaluate": _evaluate,
    "statistics": _statistics,
    "find-best": _find_best,
    "explain": _explain,
    "check-memory": _check_memory,
    "make-demo-dataset": _make_demo_dataset,
    "demo": _demo,
}


if __name__ == "__main__":
    sys.exit(main())
