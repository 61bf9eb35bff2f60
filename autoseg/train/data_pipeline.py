"""How a run feeds its steps: loader worker processes and whether it samples precomputed augmented copies."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from autoseg.core.errors import InputError
from autoseg.data.loader import SHM_FOLDER, workers_for_shared_memory
from autoseg.dataset.labels import label_map_dtype
from autoseg.memory.loader_worker import output_batch_bytes
from autoseg.plan.plans import ConfigurationPlan, Plans
from autoseg.plan.training_data import loader_config
from autoseg.preprocess.store import precomputed_copies
from autoseg.train.run_config import RunConfig

log = logging.getLogger("autoseg.train.trainer")


def choose_data_pipeline(
    run: RunConfig, folder: Path, config: ConfigurationPlan, plans: Plans, train_ids: list[str], ranks_here: int
) -> tuple[int, bool]:
    """(loader workers, use precomputed copies): the run's choice, else the plan's (shared by the node's
    ``ranks_here`` processes, within /dev/shm) and what preprocessing wrote into ``folder``."""
    node_share = config.loader_workers // ranks_here  # the plan's are for one node
    workers = node_share if run.loader_workers is None else run.loader_workers
    if run.loader_workers is None and node_share > 0:  # /dev/shm may be smaller than the RAM (Docker: 64 MiB)
        batch = output_batch_bytes(
            config.patch_size,
            config.batch_size,
            plans.input_channels(config),
            np.dtype(label_map_dtype(plans.num_label_values)).itemsize,
        )
        workers = workers_for_shared_memory(node_share, config.loader_queue_depth, batch, ranks_here)
        if workers < node_share:
            log.warning(
                "data: shared memory (%s) has room for the batch slots of %d of the planned %d loader "
                "worker(s); using %d (Docker: enlarge it with --shm-size)",
                SHM_FOLDER,
                workers,
                node_share,
                workers,
            )
    copies = precomputed_copies(folder, train_ids)
    if plans.previous_stage_values(config):  # the copies have no previous-stage labels
        if run.use_precomputed:
            raise InputError(
                f"{config.name} takes {config.previous_stage}'s labels of each case as input, which the "
                "precomputed augmented copies do not have; train it without --use-precomputed"
            )
        copies = 0
    if run.use_precomputed and copies == 0:
        raise InputError(
            f"{folder}: some training cases have no precomputed augmented copies; run "
            "`autoseg plan_and_preprocess --precompute-augmentations K` or train without "
            "--use-precomputed"
        )
    use_precomputed = copies > 0 if run.use_precomputed is None else run.use_precomputed
    cfg = loader_config(config, augment=True, use_precomputed=use_precomputed)
    spatial = (
        f"precomputed copies ({copies} per case)"
        if use_precomputed
        else "in-plane (dummy 2D)"
        if cfg.dummy_2d
        else "3D on the fly"
    )
    log.info(
        "data: %d loader worker(s) x %d queued batches; spatial augmentation %s",
        workers,
        config.loader_queue_depth,
        spatial,
    )
    return workers, use_precomputed
