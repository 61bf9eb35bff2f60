"""Where a CPU training step's time goes: two source trees side by side, and OpenMP's thread settings (issue 28; run by
hand).

``trainer``: trains fold 0 of each ``--workspace`` with its ``--tree``'s own trainer (today's ``autoseg.train.trainer``
or, for a tree from before the package restructure such as 22e3cc4, ``autoseg.train``), one epoch of ``--iterations``
steps and ``--val-iterations`` patches, in a fresh process per run, the trees alternating run by run for ``--rounds``
rounds so that both see the same load. Timers are wrapped around the phases from outside (the product has no hook for
them): the step, its batch, the network's forward, the loss, ``Tensor.backward``, the gradient clipping (the optimizer
is the rest), and the epoch's patch validation, log line with progress.png, and checkpoints. Prints per tree and
thread setting the medians of wall and CPU seconds (the first 3 steps of a run left out). Pin the patch and batch by
editing each workspace's plans.json, so that the trees run the same network on the same batches.

``threads``: the step alone (``autoseg.model.step.build_step`` on ``synthetic_batches``: 2 channels, 4 outputs, the
5-stage 16-256 features U-Net of the small-structures plan) at each ``--patch``, batch 2, in a fresh process per
OpenMP setting (``--env``, e.g. ``OMP_WAIT_POLICY=PASSIVE``, ``GOMP_SPINCOUNT=10000``, ``-`` for libgomp's defaults),
alternating for ``--rounds`` rounds.

    python benchmarks/step_phases.py trainer --tree /work/wt-old --workspace ws_old --tree . --workspace ws_new
    python benchmarks/step_phases.py threads --env OMP_WAIT_POLICY=PASSIVE --env GOMP_SPINCOUNT=10000 --env -
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
SKIP = 3  # steps left out of a run's medians: the first calls' kernels and allocations
STEP_PHASES = ("step", "next_batch", "forward", "loss", "backward", "clip")
EPOCH_PHASES = ("val_patches", "record_epoch", "checkpoint")


def _timed(timers: dict[str, list[float]], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with its wall and CPU seconds appended to ``timers[name]`` and ``timers[name + '_cpu']`` per call."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            timers.setdefault(name, []).append(time.perf_counter() - wall)
            timers.setdefault(name + "_cpu", []).append(time.process_time() - cpu)

    return wrapper


def _instrument(timers: dict[str, list[float]], new_layout: bool) -> tuple[Any, Any, Any]:
    """Wrap the phases of the tree on ``sys.path``; returns (train, RunConfig, Workspace)."""
    import torch

    if new_layout:
        import autoseg.data.loader as loader
        import autoseg.model.blocks as network
        import autoseg.model.step as step
        import autoseg.train.epochs as epochs
        import autoseg.train.run_state as run_state
        from autoseg.core.workspace import Workspace
        from autoseg.train.run_config import RunConfig
        from autoseg.train.trainer import train

        network.UNet.forward = _timed(timers, "forward", network.UNet.forward)
        for name in ("validate_patches", "record_epoch"):
            setattr(epochs, name, _timed(timers, name.replace("validate", "val"), getattr(epochs, name)))
        run_state.TrainingRun.save = _timed(timers, "checkpoint", run_state.TrainingRun.save)
    else:
        import autoseg.batch_loader as loader
        import autoseg.network as network
        import autoseg.train_step as step
        from autoseg.workspace import Workspace

        import autoseg.train as trainer
        from autoseg.train import RunConfig, train

        network.PlainConvUNet.forward = _timed(timers, "forward", network.PlainConvUNet.forward)
        for name, key in (
            ("validate_patches", "val_patches"),
            ("_log_epoch", "record_epoch"),
            ("save_checkpoint", "checkpoint"),
        ):
            setattr(trainer, name, _timed(timers, key, getattr(trainer, name)))
    step.compute_loss = _timed(timers, "loss", step.compute_loss)
    step.TrainStep.__call__ = _timed(timers, "step", step.TrainStep.__call__)
    loader.BatchLoader.__next__ = _timed(timers, "next_batch", loader.BatchLoader.__next__)
    torch.Tensor.backward = _timed(timers, "backward", torch.Tensor.backward)
    torch.nn.utils.clip_grad_norm_ = _timed(timers, "clip", torch.nn.utils.clip_grad_norm_)
    return train, RunConfig, Workspace


def child_trainer(args: argparse.Namespace) -> None:
    """One run of one tree's trainer (in this fresh process; OpenMP's settings come from the environment)."""
    import shutil

    tree, workspace = Path(args.tree[0]).resolve(), Path(args.workspace[0]).resolve()
    sys.path.insert(0, str(tree))
    timers: dict[str, list[float]] = {}
    train, run_config, workspace_type = _instrument(timers, (tree / "autoseg" / "train").is_dir())
    import torch

    shutil.rmtree(workspace / "results", ignore_errors=True)
    run = run_config(
        epochs=1,
        iterations_per_epoch=args.iterations,
        val_iterations=args.val_iterations,
        validate=False,
        cpu_threads=args.threads,
    )
    load, t0 = os.getloadavg()[0], time.perf_counter()
    train(workspace_type(workspace), "3d_fullres", 0, run, progress=False)
    record = {"threads": torch.get_num_threads(), "wall": time.perf_counter() - t0, "load": load, "timers": timers}
    Path(args.out).write_text(json.dumps(record))


def child_threads(args: argparse.Namespace) -> None:
    """The synthetic step at each patch (in this fresh process; OpenMP's settings come from the environment)."""
    import torch

    from autoseg.dataset.labels import LabelScheme
    from autoseg.model.step import build_step, synthetic_batches
    from autoseg.model.topology import NetworkTopology

    torch.set_num_threads(args.threads)
    kernels = ((1, 3, 3), (1, 3, 3), (3, 3, 3), (3, 3, 3), (3, 3, 3))
    strides = ((1, 1, 1), (1, 2, 2), (1, 2, 2), (2, 2, 2), (2, 2, 2))
    topology = NetworkTopology(3, 2, 4, (16, 32, 64, 128, 256), kernels, strides)
    scheme = LabelScheme.from_labels({"background": 0, "organ": 1, "tubes": 2, "lesions": 3})
    record = {}
    for patch in args.patch:
        step = build_step(topology, scheme)
        batches = synthetic_batches(topology, scheme, 2, _patch(patch), torch.Generator().manual_seed(0))
        timers: dict[str, list[float]] = {}
        timed_step = _timed(timers, "step", _step_to_item)
        for _ in range(args.steps):
            timed_step(step, batches)
        record[patch] = timers
    Path(args.out).write_text(json.dumps({"load": os.getloadavg()[0], "patches": record}))


def _step_to_item(step: Any, batches: Any) -> float:
    """One step, ended as the trainer ends it: ``.item()`` on its loss."""
    return step(batches)[0].item()


def _patch(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.lower().split("x"))


def _median(values: list[float], steps: int | None = None) -> float:
    """The median after the first ``SKIP`` calls (of the first ``steps``: a phase the patch validation calls too)."""
    steady = values[SKIP:steps] or values
    return statistics.median(steady) if steady else float("nan")


def _child(args: argparse.Namespace, extra: list[str], env: dict[str, str], out: Path) -> dict:
    """Run this script's child mode in a fresh process with ``env``; its record."""
    command = [sys.executable, str(HERE), "--child", args.mode, "--out", str(out), "--threads", str(args.threads)]
    result = subprocess.run(command + extra, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"{' '.join(command + extra)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return json.loads(out.read_text())


def run_trainer(args: argparse.Namespace, folder: Path) -> None:
    if len(args.tree) != len(args.workspace):
        sys.exit("give one --workspace per --tree")
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}  # as the autoseg command sets it
    rows: dict[str, list[dict]] = {tree: [] for tree in args.tree}
    for r in range(args.rounds):
        for i, (tree, workspace) in enumerate(zip(args.tree, args.workspace, strict=True)):
            extra = ["--tree", tree, "--workspace", workspace, "--iterations", str(args.iterations)]
            extra += ["--val-iterations", str(args.val_iterations)]
            rows[tree].append(_child(args, extra, env, folder / f"{r}_{i}.json"))
    print(f"| tree | runs | load | {' | '.join(f'{p} wall / CPU' for p in STEP_PHASES + EPOCH_PHASES)} |")
    print("|---|---|---|" + "---|" * len(STEP_PHASES + EPOCH_PHASES))
    for tree, runs in rows.items():
        cells = [_phase_cell([run["timers"] for run in runs], phase) for phase in STEP_PHASES + EPOCH_PHASES]
        load = statistics.median(run["load"] for run in runs)
        print(f"| {tree} | {len(runs)} | {load:.1f} | {' | '.join(cells)} |")


def _phase_cell(runs: list[dict[str, list[float]]], phase: str) -> str:
    """The table cell of a phase, wall / CPU seconds: over runs, the median of a step phase's per-step median, or of
    an epoch phase's sum."""
    figures = []
    for suffix in ("", "_cpu"):
        if phase in STEP_PHASES:
            figures.append(statistics.median(_median(t[phase + suffix], len(t["step"])) for t in runs))
        else:
            figures.append(statistics.median(sum(t.get(phase + suffix, [0.0])) for t in runs))
    return f"{figures[0]:.3f} / {figures[1]:.3f}"


def run_threads(args: argparse.Namespace, folder: Path) -> None:
    rows: dict[str, list[dict]] = {setting: [] for setting in args.env}
    for r in range(args.rounds):
        for i, setting in enumerate(args.env):
            env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
            env.update(dict(kv.split("=", 1) for kv in setting.split(",") if "=" in kv))
            extra = ["--steps", str(args.steps), *(x for p in args.patch for x in ("--patch", p))]
            rows[setting].append(_child(args, extra, env, folder / f"{r}_{i}.json"))
    print(f"| OpenMP setting | threads | runs | load | {' | '.join(f'{p} wall / CPU (s)' for p in args.patch)} |")
    print("|---|---|---|---|" + "---|" * len(args.patch))
    for setting, runs in rows.items():
        cells = []
        for patch in args.patch:
            wall = statistics.median(_median(run["patches"][patch]["step"]) for run in runs)
            cpu = statistics.median(_median(run["patches"][patch]["step_cpu"]) for run in runs)
            cells.append(f"{wall:.3f} / {cpu:.3f}")
        load = statistics.median(run["load"] for run in runs)
        print(f"| {setting} | {args.threads} | {len(runs)} | {load:.1f} | {' | '.join(cells)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("trainer", "threads"))
    parser.add_argument("--tree", action="append", default=[], help="a source tree (trainer; repeat)")
    parser.add_argument("--workspace", action="append", default=[], help="its planned workspace (trainer; repeat)")
    parser.add_argument("--env", action="append", default=[], help="OpenMP setting, e.g. OMP_WAIT_POLICY=PASSIVE or -")
    parser.add_argument("--patch", action="append", default=[], help="ZxYxX (threads; repeat; default 20x80x80)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (default: 3)")
    parser.add_argument("--iterations", type=int, default=20, help="trainer: steps of the one epoch (default: 20)")
    parser.add_argument("--val-iterations", type=int, default=5, help="trainer: validation patches (default: 5)")
    parser.add_argument("--steps", type=int, default=8, help="threads: steps per patch and run (default: 8)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.patch = args.patch or ["20x80x80"]
    if args.child:
        child_trainer(args) if args.mode == "trainer" else child_threads(args)
        return
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} before")
    with tempfile.TemporaryDirectory(prefix="step-phases-") as folder:
        (run_trainer if args.mode == "trainer" else run_threads)(args, Path(folder))
    print(f"load average {os.getloadavg()[0]:.1f} after")


if __name__ == "__main__":
    main()
