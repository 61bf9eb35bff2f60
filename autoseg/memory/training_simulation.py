"""Running THE training step inside a ``StorageTracker``: the simulation (``FakeTensorMode``) and the measurement
(real CPU tensors) that ``autoseg.memory.training`` describes, and the FLOPs of a step.

This is the module that imports torch and its fake-tensor machinery (~2-4 s on the first simulation):
``autoseg.memory.training`` imports it only when a step must run, so a plan whose steps are all kept between
runs does not.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

import numpy as np
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from autoseg.memory.autocast_policy import cuda_autocast_policy
from autoseg.memory.glibc_heap import heap_footprint
from autoseg.memory.step_record import CATEGORIES, StepConfig, StepRecord
from autoseg.memory.tracker import StorageTracker
from autoseg.model.optimizer import OPTIMIZERS
from autoseg.model.step import build_step, synthetic_batches
from autoseg.model.topology import NetworkTopology


def stage_modules(network: nn.Module) -> dict[str, nn.Module]:
    """Top-level submodules by name; the items of a ``ModuleList`` as ``name.i`` (``encoder.0``, ...)."""
    out: dict[str, nn.Module] = {}
    for name, child in network.named_children():
        if isinstance(child, nn.ModuleList):
            out.update({f"{name}.{i}": sub for i, sub in enumerate(child)})
        else:
            out[name] = child
    return out


def _run_step(
    cfg: StepConfig, tracker: StorageTracker, generator: torch.Generator | None
) -> tuple[dict[str, set[int]], dict[str, int]]:
    """Build the trainer's step and run it once inside ``tracker``; returns the storage numbers per category and
    the bytes per stage alive at the end of the (last) forward."""
    step = build_step(
        cfg.topology,
        cfg.scheme,
        precision=cfg.precision,
        checkpointing=cfg.checkpointing,
        accumulation_steps=1 if cfg.accumulation_steps == 1 else 2,
        optimizer=OPTIMIZERS[cfg.optimizer],
    )
    step.network.train()
    params = list(step.network.parameters())
    for p in params:
        p.grad = torch.zeros_like(p)
    step.optimizer.step()  # the previous step: allocates momentum / moments
    handles = tracker.tag_modules(stage_modules(step.network))
    batch_numbers: set[int] = set()
    stage_bytes: dict[str, int] = {}

    def batches() -> Iterator[dict[str, torch.Tensor]]:
        for batch in synthetic_batches(cfg.topology, cfg.scheme, cfg.batch_size, cfg.patch_size, generator):
            batch_numbers.update(tracker.storage_numbers(batch.values()))
            yield batch

    def trace(phase: str) -> None:
        if phase == "loss":  # the forward is done: what its stages leave alive for backward
            tracker.tagging = False
            stage_bytes.update(tracker.live_bytes_by_tag())
        tracker.mark(phase)
        tracker.tagging = phase == "forward"

    step.trace = trace
    with cuda_autocast_policy(cfg.device):  # a CUDA step: CUDA autocast's dtypes on these CPU tensors
        step(batches())
    for h in handles:
        h.remove()
    state = [v for s in step.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    numbers = {
        "parameters": tracker.storage_numbers(params),
        "gradients": tracker.storage_numbers(p.grad for p in params),
        "optimizer_state": tracker.storage_numbers(state),
        "batch": batch_numbers,
    }
    return numbers, stage_bytes


def record_step(cfg: StepConfig, fake: bool) -> StepRecord:
    """Run the step once, under ``FakeTensorMode`` (``fake``: no memory is used) or on real CPU tensors (seeded),
    inside a ``StorageTracker``; its timeline, and for a CPU step glibc's footprint over it. Leaves the caller's RNG
    alone."""
    tracker = StorageTracker(cpu_conv_scratch=cfg.device == "cpu")
    gc_was_enabled = gc.isenabled()
    gc.disable()  # frees happen by reference counting only: the same order in every run
    try:
        with torch.random.fork_rng(devices=[]):
            mode = FakeTensorMode() if fake else contextlib.nullcontext()
            generator = None if fake else torch.Generator().manual_seed(0)
            with mode, tracker:
                numbers, stage_bytes = _run_step(cfg, tracker, generator)
                return _to_record(tracker, numbers, stage_bytes, cpu_heap=cfg.device == "cpu")
    finally:
        if gc_was_enabled:
            gc.enable()


def _to_record(
    tracker: StorageTracker, numbers: dict[str, set[int]], stage_bytes: dict[str, int], cpu_heap: bool
) -> StepRecord:
    start, stop = tracker.index_of("step"), tracker.index_of("end")
    category_of = np.full(len(tracker.sizes), CATEGORIES.index("activations"), dtype=np.int64)
    for name, members in numbers.items():
        category_of[sorted(members)] = CATEGORIES.index(name)
    timeline = tracker.timeline(category_of, len(CATEGORIES), stop)[start:]
    live_count = tracker.live_count(stop)[start:]
    storage = np.asarray(tracker.event_storage[start:stop], dtype=np.int64)
    first_number = int(storage.min()) if len(storage) else 0
    signature = np.stack([storage - first_number, np.asarray(tracker.event_kind[start:stop])], axis=1)
    phases = tuple(
        (name, index - start) for name, index in tracker.mark_list if start <= index and name not in ("step", "end")
    )
    heap = heap_footprint(storage, np.diff(timeline.sum(axis=1))) if cpu_heap else None
    return StepRecord(
        timeline=timeline,
        live_count=live_count,
        phases=phases,
        signature=signature,
        stage_bytes=stage_bytes,
        largest_conv_output_bytes=tracker.largest_conv_output_bytes,
        heap=heap,
    )


def training_step_flops(topology: NetworkTopology, batch_size: int, patch_size: tuple[int, ...]) -> int:
    """Floating-point operations of one training step's forward + backward (convolutions and matrix products, as
    torch's ``FlopCounterMode`` counts them; a multiply-add is 2), counted under FakeTensorMode."""
    from torch.utils.flop_counter import FlopCounterMode

    cfg = StepConfig(topology, batch_size, tuple(patch_size))
    with torch.random.fork_rng(devices=[]), FakeTensorMode():
        step = build_step(topology, cfg.scheme)
        counter = FlopCounterMode(display=False)
        with counter:
            step(synthetic_batches(topology, cfg.scheme, batch_size, cfg.patch_size))
    return int(counter.get_total_flops())
