"""Distributed training on CPU: 2 gloo processes (torch.multiprocessing, or torchrun through ``--gpus``)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from factories import set_configuration, tiny_plans
from train_faults import killed_after_epochs, out_of_memory_at_step

from autoseg.core.workspace import Workspace
from autoseg.model.distributed import (
    SINGLE_PROCESS,
    DistributedContext,
    Ranks,
    end_rank_process,
    process_group,
    rank_batch,
    torchrun_command,
)
from autoseg.model.step import build_step, distribute
from autoseg.model.topology import NetworkTopology
from autoseg.train.checkpoint import load_checkpoint
from autoseg.train.run_config import RunConfig
from autoseg.train.trainer import train

# 4 stages: 3 deep-supervision outputs, weights (2/3, 1/3, 0): two Dice terms and an unused head
DS_TOPOLOGY = NetworkTopology(
    dim=3,
    in_channels=1,
    num_outputs=3,
    features_per_stage=(2, 4, 4, 4),
    kernel_sizes=((3, 3, 3),) * 4,
    strides=((1, 1, 1), (2, 2, 2), (2, 2, 2), (1, 2, 2)),
)
GLOBAL_BATCH = 4
TINY = dict(epochs=2, iterations_per_epoch=2, val_iterations=1, validate=False, cpu_threads=1, loader_workers=0)

CONFIG = "3d_fullres"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo(rank: int, world: int, port: int) -> DistributedContext:
    return DistributedContext(
        rank=rank,
        world_size=world,
        local_rank=rank,
        local_world_size=world,
        backend="gloo",
        init_method=f"tcp://127.0.0.1:{port}",
    )


def _run_ranks(fn, world: int, *args, timeout_s: float = 120.0) -> None:
    """``fn(rank, world, port, *args)`` in ``world`` spawned processes, each ended as a torchrun rank of
    ``autoseg train`` ends (``end_rank_process``); fails (not hangs) on a deadlock."""
    context = mp.start_processes(
        _rank_then_end, args=(fn, world, _free_port(), *args), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"{world} ranks still running after {timeout_s:.0f} s: a collective is waiting forever")


def _rank_then_end(rank: int, fn, *args) -> None:
    fn(rank, *args)  # an exception or a failed assertion propagates as usual
    end_rank_process(0)


# ---------------------------------------------------------------- one step: 2 ranks == 1 process on the batch


def _global_batch(ignore: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(4, 1, 8, 16, 16) float32 images and int8 labels: samples 0-1 random -1..2 (outside-mask -1,
    background, two classes), samples 2-3 background with a small cube of class 1: the two ranks' halves
    have very different Dice statistics. ``ignore``: also the ignore label 3, on a fifth of samples 0-1 and
    on three quarters of samples 2-3 (the ranks' labelled voxels differ 2.5-fold)."""
    g = torch.Generator().manual_seed(7)
    data = torch.randn(GLOBAL_BATCH, 1, 8, 16, 16, generator=g)
    target = torch.zeros(GLOBAL_BATCH, 1, 8, 16, 16, dtype=torch.int8)
    target[:2] = torch.randint(-1, 4 if ignore else 3, (2, 1, 8, 16, 16), generator=g, dtype=torch.int8)
    target[2:, :, 2:5, 4:8, 4:8] = 1
    if ignore:
        target[2:, :, :, :12] = 3
    return data, target


def _one_step(distributed: DistributedContext, reduce_dice: bool = True, ignore: bool = False) -> dict:
    """One optimizer step of the trainer's ``TrainStep`` on this rank's share of the global batch."""
    world, rank = distributed.world_size, distributed.rank
    plans = tiny_plans()
    if ignore:
        plans = dataclasses.replace(plans, labels={**plans.labels, "ignore": 3})
    config = plans.configuration(CONFIG).with_(
        network=DS_TOPOLOGY, batch_size=GLOBAL_BATCH // world, accumulation_steps=1, checkpointing=False
    )
    torch.manual_seed(0)
    step = build_step(config.network, plans.label_scheme, accumulation_steps=config.accumulation_steps)
    distribute(step, distributed)
    if not reduce_dice:  # the control: per-rank Dice, as if ranks averaged their own losses
        step.loss_fn.base_loss.reduce_sums = None
    data, target = _global_batch(ignore)
    share = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    named = dict(step.network.named_parameters())
    before = {n: p.detach().clone() for n, p in named.items()}
    loss, _ = step(iter([{"data": data[share], "target": target[share]}]))
    return {
        "loss": loss.item(),
        "grads": {n: p.grad.clone() for n, p in named.items() if p.grad is not None},
        "updates": {n: p.detach() - before[n] for n, p in named.items()},
    }


def _step_worker(rank: int, world: int, port: int, out: Path) -> None:
    torch.set_num_threads(1)
    distributed = _gloo(rank, world, port)
    with process_group(distributed):
        torch.save(
            {
                "summed": _one_step(distributed),
                "local": _one_step(distributed, reduce_dice=False),
                "ignore": _one_step(distributed, ignore=True),
            },
            out / f"rank{rank}.pt",
        )


def _max_relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest difference of any element relative to the largest element of ``b`` (conv biases before an
    InstanceNorm get gradients of ~1e-10, rounding noise: an element-wise relative error means nothing there)."""
    assert a.keys() == b.keys()
    scale = max(float(t.abs().max()) for t in b.values())
    return max(float((a[n] - b[n]).abs().max()) for n in a) / scale


def test_two_ranks_step_like_one_process_on_the_global_batch(tmp_path: Path) -> None:
    _run_ranks(_step_worker, 2, tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    reference = _one_step(SINGLE_PROCESS)

    assert "seg_heads.2.weight" not in reference["grads"]  # the weight-0 output: no gradient anywhere
    for rank in ranks:
        got = rank["summed"]
        assert _max_relative_difference(got["grads"], reference["grads"]) < 1e-6  # measured 5e-8
        assert _max_relative_difference(got["updates"], reference["updates"]) < 1e-5  # 1e-6: float32 weights' ulp
    mean_loss = sum(r["summed"]["loss"] for r in ranks) / 2  # each rank: its CE + the global Dice term
    assert mean_loss == pytest.approx(reference["loss"], rel=1e-6)
    assert ranks[0]["summed"]["loss"] != pytest.approx(ranks[1]["summed"]["loss"], rel=1e-6)
    # Averaging per-rank batch Dice is a different loss: its gradients miss the reference by far more.
    assert _max_relative_difference(ranks[0]["local"]["grads"], reference["grads"]) > 1e-3  # measured 5e-3
    # With an ignore label falling unevenly on the ranks, CE is still the mean over the global batch's
    # labelled voxels (labelled_mean_scale), not a mean of the ranks' means.
    with_ignore = _one_step(SINGLE_PROCESS, ignore=True)
    for rank in ranks:
        assert _max_relative_difference(rank["ignore"]["grads"], with_ignore["grads"]) < 1e-6
    assert sum(r["ignore"]["loss"] for r in ranks) / 2 == pytest.approx(with_ignore["loss"], rel=1e-6)


# ---------------------------------------------------------------- whole runs on 2 ranks


@pytest.fixture()
def workspace(prepared: Path, tmp_path: Path) -> Workspace:  # noqa: F811
    shutil.copytree(prepared, tmp_path / "ws")
    return Workspace.at(tmp_path / "ws")


def _oom_worker(rank: int, world: int, port: int, root: Path) -> None:
    """Train with an out-of-memory error injected on rank 0 only; record this rank's warnings."""
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("autoseg.train.trainer").addHandler(handler)
    distributed = _gloo(rank, world, port)
    fault = out_of_memory_at_step(1) if rank == 0 else contextlib.nullcontext()  # rank 1 learns it from rank 0
    with process_group(distributed), fault:
        train(Workspace.at(root), CONFIG, 0, RunConfig(**TINY), progress=False, distributed=distributed)
    (root / f"warnings_rank{rank}.json").write_text(json.dumps(warnings))


@pytest.mark.slow
def test_out_of_memory_on_one_rank_degrades_every_rank(workspace: Workspace) -> None:
    set_configuration(workspace, CONFIG, batch_size=4)  # 2 per rank, halved to 1 x 2 accumulation
    _run_ranks(_oom_worker, 2, workspace.root)
    fold = workspace.results(CONFIG, 0)
    warnings = [json.loads((workspace.root / f"warnings_rank{r}.json").read_text()) for r in range(2)]
    assert len(warnings[0]) == 1 and warnings[0] == warnings[1]  # rank 1 took the same decision
    assert "epoch 0 iteration 1: halve_micro_batch -> micro-batch 1 x 2 accumulation" in warnings[1][0]
    run = json.loads((fold / "run.json").read_text())
    assert run["effective_configuration"]["batch_size"] == 1
    assert run["effective_configuration"]["accumulation_steps"] == 2
    assert run["distributed"] == {"world_size": 2, "global_batch": 4}
    (check,) = run["memory_checks"]  # rank 0's, of its share after the degradation (the OOM came in the first steps)
    assert (check["configuration"]["batch_size"], check["configuration"]["accumulation_steps"]) == (1, 2)
    tensors = check["rows"][0]  # the all-reduce averages the gradients in place: nothing the simulation lacks
    assert abs(tensors["measured_bytes"] - tensors["predicted_bytes"]) <= 64, tensors
    assert [json.loads(line)["epoch"] for line in (fold / "metrics.jsonl").read_text().splitlines()] == [0, 1]
    assert load_checkpoint(fold / "checkpoint_final.pt").progress.world_size == 2

    with pytest.raises(ValueError, match=r"trained on 2 process\(es\), this run has 1.*--gpus 2"):
        train(workspace, CONFIG, 0, RunConfig(**TINY, resume=True), progress=False)


def _resume_worker(rank: int, world: int, port: int, root: Path) -> None:
    """An uninterrupted run, then the same run stopped after epoch 0 and resumed by both ranks."""
    distributed = _gloo(rank, world, port)
    workspace = Workspace.at(root)
    fold = workspace.results(CONFIG, 0)
    with process_group(distributed):
        train(workspace, CONFIG, 0, RunConfig(**TINY), progress=False, distributed=distributed)
        dist.barrier()  # rank 0 has written everything
        if rank == 0:
            fold.rename(fold.with_name("reference"))
        dist.barrier()
        with killed_after_epochs(1):  # both ranks, after epoch 0's checkpoint
            train(workspace, CONFIG, 0, RunConfig(**TINY), progress=False, distributed=distributed)
        dist.barrier()  # the checkpoint to resume from is written
        train(workspace, CONFIG, 0, RunConfig(**TINY, resume=True), progress=False, distributed=distributed)


@pytest.mark.slow
def test_two_ranks_resume_bit_for_bit(workspace: Workspace) -> None:
    _run_ranks(_resume_worker, 2, workspace.root)
    fold = workspace.results(CONFIG, 0)
    expected, got = (load_checkpoint(p / "checkpoint_final.pt") for p in (fold.with_name("reference"), fold))
    for name, tensor in expected.network.items():
        assert torch.equal(tensor, got.network[name]), name
    assert [r["train_loss"] for r in got.progress.metrics] == [r["train_loss"] for r in expected.progress.metrics]


@pytest.mark.slow
def test_cli_gpus_2_on_cpu_trains_and_only_rank_0_writes(workspace: Workspace) -> None:
    command = [
        sys.executable,
        "-m",
        "autoseg",
        "-q",
        "train",
        "fold",
        "0",
        "-w",
        str(workspace.root),
        "--gpus",
        "2",
        "--device",
        "cpu",
        "--epochs",
        "2",
        "--iterations-per-epoch",
        "2",
        "--val-iterations",
        "1",
        "--no-validation",
        "--loader-workers",
        "0",
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]  # no rank aborted in gloo's teardown (end_rank_process)
    assert "launching 2 processes:" in done.stdout and "--nproc_per_node 2 -m autoseg -q train" in done.stdout
    assert "--gpus" not in done.stdout.split("launching 2 processes:")[1].splitlines()[0]
    assert done.stdout.count("processes: 2 (gloo)") == 1  # printed by rank 0 only

    fold = workspace.results(CONFIG, 0)
    assert sorted(p.name for p in fold.iterdir()) == [
        "checkpoint_best.pt",
        "checkpoint_final.pt",
        "checkpoint_latest.pt",
        "metrics.jsonl",
        "progress.png",
        "run.json",
        "train.log",
    ]
    rows = [json.loads(line) for line in (fold / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [0, 1]
    log_text = (fold / "train.log").read_text()
    assert log_text.count("epoch 0  train loss") == 1
    assert "x 2 process(es) = global batch 2 (planned 2)" in log_text
    run = json.loads((fold / "run.json").read_text())
    assert run["distributed"] == {"world_size": 2, "global_batch": 2}
    assert run["effective_configuration"]["batch_size"] == 1  # the planned micro-batch of 2, split over 2 ranks
    for name in ("checkpoint_latest.pt", "checkpoint_final.pt"):
        progress = load_checkpoint(fold / name).progress
        assert progress.world_size == 2 and progress.epoch == 1


# ---------------------------------------------------------------- pure helpers


@pytest.mark.parametrize(
    ("batch", "accumulation", "world", "expected"),
    [
        (2, 1, 1, (2, 1)),  # one process: the plan
        (2, 1, 2, (1, 1)),  # nnU-Net's usual plan on 2 GPUs: one sample each, global batch 2 kept
        (2, 4, 2, (2, 2)),  # accumulation split over ranks
        (3, 2, 3, (2, 1)),  # 6 samples over 3 ranks: 2 each, a micro-batch of 2 <= 3
        (2, 3, 2, (1, 3)),  # 6 over 2: 3 each; the largest micro-batch <= 2 dividing 3 is 1
        (5, 1, 2, (3, 1)),  # 5 does not split: 3 each, global batch 6
        (2, 1, 4, (1, 1)),  # more ranks than samples: one each, global batch 4
    ],
)
def test_rank_batch(batch: int, accumulation: int, world: int, expected: tuple[int, int]) -> None:
    micro, steps = rank_batch(batch, accumulation, world)
    assert (micro, steps) == expected
    assert micro <= batch  # no rank needs more memory than planned
    assert 0 <= world * micro * steps - batch * accumulation < world


def test_rank_batch_rejects_zero() -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        rank_batch(2, 1, 0)


def test_context_checks_ranks_and_names_the_device() -> None:
    context = DistributedContext(rank=1, world_size=4, local_rank=1, local_world_size=2, backend="nccl")
    assert not context.is_main and context.is_distributed
    assert context.device("cuda") == "cuda:1" and context.device("cpu") == "cpu"
    assert SINGLE_PROCESS.device("cuda") == "cuda" and SINGLE_PROCESS.is_main
    with pytest.raises(ValueError, match="rank 2 / local rank 0 outside world size 2"):
        DistributedContext(rank=2, world_size=2)
    with pytest.raises(ValueError, match="'mpi'"):
        DistributedContext(backend="mpi")


def test_single_process_ranks_do_nothing() -> None:
    ranks = Ranks(SINGLE_PROCESS, torch.device("cpu"))
    sums = torch.ones(3, 2, requires_grad=True)
    with ranks.step_collectives():
        assert ranks.reduce_sums(sums) is sums
        ranks.check()
    assert ranks.broadcast_int(7) == 7 and ranks.mean(0.25) == 0.25


def test_torchrun_command() -> None:
    command = torchrun_command(2, ["train", "fold", "0", "--device", "cpu"])
    assert command[0] == sys.executable
    assert command[1:] == [
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "autoseg",
        "train",
        "fold",
        "0",
        "--device",
        "cpu",
    ]


@pytest.mark.slow
def test_two_torchrun_nodes_on_one_host_train_like_one_launch(workspace: Workspace) -> None:
    """The multi-node path run, not assumed: two torchrun launchers (--nnodes 2, one process each, node ranks 0 and
    1, a static rendezvous on 127.0.0.1) train fold 0 of one workspace (as on a shared file system) with gloo; rank
    0 alone writes, and the run is the same world-size-2 run `--gpus 2` makes on one node."""
    port = _free_port()
    argv = ["-q", "train", "fold", "0", "-w", str(workspace.root), "--device", "cpu", "--epochs", "2"]
    argv += ["--iterations-per-epoch", "2", "--val-iterations", "1", "--no-validation", "--loader-workers", "0"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}

    logs = [workspace.root.parent / f"node{rank}.log" for rank in (0, 1)]  # files: a full pipe would block a rank

    def node(rank: int) -> subprocess.Popen:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(rank)]
        launcher += ["--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port)]
        with open(logs[rank], "w") as log:
            return subprocess.Popen([*launcher, "-m", "autoseg", *argv], stdout=log, stderr=subprocess.STDOUT, env=env)

    nodes = [node(0), node(1)]
    for n, log in zip(nodes, logs):
        assert n.wait(timeout=300) == 0, log.read_text()[-3000:]
    outputs = [log.read_text() for log in logs]
    assert "processes: 2 (gloo)" in outputs[0] and "processes: 2 (gloo)" not in outputs[1]  # rank 0 prints
    fold = workspace.results(CONFIG, 0)
    run = json.loads((fold / "run.json").read_text())
    assert run["distributed"] == {"world_size": 2, "global_batch": 2}
    assert (fold / "train.log").read_text().count("epoch 0  train loss") == 1  # one log, rank 0's
    progress = load_checkpoint(fold / "checkpoint_final.pt").progress
    assert progress.world_size == 2 and progress.epoch == 1
