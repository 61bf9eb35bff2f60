"""Sizing of the host-side processes a plan runs: preprocessing processes and training-data loader workers, from
the host RAM budget, the CPU count and the per-process bytes of ``autoseg.memory.host`` (through
``autoseg.core.resources.processes_for``, the one sizing rule)."""

from __future__ import annotations

import math

from autoseg.core.resources import cpu_count, processes_for
from autoseg.memory.host import TRAINER_HOST_BYTES, preprocess_worker_bytes
from autoseg.memory.loader_worker import worker_bytes
from autoseg.plan.budget import Budget
from autoseg.plan.fingerprint import Fingerprint
from autoseg.plan.plans import ConfigurationPlan
from autoseg.plan.training_data import loader_config

HOST_RAM_FRACTION = 0.8  # of the host RAM budget for preprocessing processes or loader workers


LOADER_QUEUE_DEPTH = 2  # finished batches per loader worker, unless 1 leaves room for more workers


def host_workers(
    fp: Fingerprint, configs: dict[str, ConfigurationPlan], budget: Budget
) -> tuple[int, dict[str, float]]:
    """(preprocessing processes, the figures behind the count): HOST_RAM_FRACTION of the RAM over one
    worker's peak on the largest case (the finest configuration's resampled shape), between 1 and the CPU
    count."""
    cpus = budget.cpu_count or cpu_count()
    usable = budget.host_ram_bytes * HOST_RAM_FRACTION
    largest = max(fp.cases, key=lambda c: math.prod(c.shape_zyx))
    channels = len(fp.channel_names)
    per_process = 0
    for cfg in configs.values():
        after = cfg.resampled_shape(largest.cropped_shape_zyx, largest.spacing_mm)
        per_process = max(per_process, preprocess_worker_bytes(largest.shape_zyx, after, channels)["total"])
    processes = processes_for(usable, per_process, cpus)
    return processes, {
        "preprocess_worker_bytes": float(per_process),
        "usable_host_ram_bytes": float(usable),
        "cpu_count": float(cpus),
    }


def loader_workers(config: ConfigurationPlan, num_channels: int, budget: Budget) -> dict[str, float]:
    """``config``'s training-data workers, from the host RAM budget: HOST_RAM_FRACTION of the RAM minus the
    training process (TRAINER_HOST_BYTES) over one worker's bytes (``autoseg.memory.loader_worker.worker_bytes``,
    on-the-fly augmentation), between 0 and CPU count - 1 (one core feeds the GPU); none on CPU, where the
    training step takes the cores. Each queues LOADER_QUEUE_DEPTH batches, or 1 where that fits more
    workers."""
    loader = loader_config(config, augment=True)
    cpus = budget.cpu_count or cpu_count()
    room = budget.host_ram_bytes * HOST_RAM_FRACTION - TRAINER_HOST_BYTES

    def per_worker(depth: int) -> int:
        return worker_bytes(
            loader.patch_size,
            loader.enlarged_patch_size,
            loader.batch_size,
            num_channels,
            depth,
            dummy_2d=loader.dummy_2d,
        )["total"]

    def workers(depth: int) -> int:
        return 0 if budget.device == "cpu" else processes_for(room, per_worker(depth), cpus - 1, minimum=0)

    depth = LOADER_QUEUE_DEPTH if workers(LOADER_QUEUE_DEPTH) >= workers(1) else 1
    return {
        "loader_workers": workers(depth),
        "loader_queue_depth": depth,
        "loader_worker_bytes": float(per_worker(depth)),
    }
