"""The final validation's cost, timed on this run's own prediction for the time budget (``TimeBudget``).

``PredictionProbe`` times, on the run's clock, the path the final validation (``autoseg.train.validation``) takes:

- one (tile, mirror variant) pass: the sliding window (``predict_probabilities``) over one tile of a validation case
  (the median-sized one, cropped at its centre), every mirror variant of the device's default ``--tta``, through the
  run's network as a ``TorchTileRunner`` in eval mode: the forward passes in the planned tile batch, the flips and
  the accumulation. Per voxel of the tile; a few forward passes, timed again at epoch ends (``time_prediction``).
- the rest of a case: ``predict_validation_case`` of that case from its raw images with zero logits in place of
  the network (reading, preprocessing, the inference plan, the window's bookkeeping, writing the label map and the
  probabilities) and the evaluation of its reference against itself. Per preprocessed voxel; timed once.

A tile pass that runs out of memory here would in the final validation too: both run beside the training's state.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from autoseg.dataset.raw import load_dataset
from autoseg.evaluate.metrics import evaluate_pairs
from autoseg.model.tile_runner import TileBatchBytes, TileRunner
from autoseg.model.tiles import patch_as_zyx, tile_layout
from autoseg.plan.plans import ConfigurationPlan
from autoseg.predict.case import inference_plan, predict_probabilities, window_tile
from autoseg.predict.networks import Predictor
from autoseg.predict.window import WindowOptions
from autoseg.preprocess.store import open_case
from autoseg.train.run_state import FoldJob
from autoseg.train.schedule import PredictionRates, ValidationWork
from autoseg.train.validation import predict_validation_case


def validation_work(
    config: ConfigurationPlan, device: str, shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, ValidationWork]:
    """Each validation case's work (id -> preprocessed (Z, Y, X)) as the final validation's window tiles it."""
    window, work = WindowOptions(device=device), {}
    for case_id, shape in shapes.items():
        tile, steps = window_tile(config, window, tuple(shape))
        work[case_id] = ValidationWork(tile_layout(shape, tile, steps).num_tiles, math.prod(tile), math.prod(shape))
    return work


@dataclass(frozen=True, eq=False)
class _ZeroLogits:
    """A runner in place of the network: zero logits at once, so a case's prediction times everything else."""

    runner: TileRunner
    num_outputs: int

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def precision(self) -> str:
        return self.runner.precision

    def working_bytes(self, tile_batch_size: int, tile: tuple[int, ...]) -> TileBatchBytes:
        return self.runner.working_bytes(tile_batch_size, tile)

    def __call__(self, tile_batch: torch.Tensor) -> torch.Tensor:
        shape = (tile_batch.shape[0], self.num_outputs, *tile_batch.shape[2:])
        return torch.zeros(shape, device=tile_batch.device)


class PredictionProbe:
    """Times the final validation's prediction with ``network`` (the run's, trained in place) on ``job``'s median-sized
    validation case (``shapes``: id -> preprocessed (Z, Y, X)), as ``validate_fold`` runs it on ``job.run.device``."""

    def __init__(self, job: FoldJob, network: torch.nn.Module, shapes: Mapping[str, tuple[int, ...]]) -> None:
        self.job = job
        self.case_id = sorted(shapes, key=lambda c: (math.prod(shapes[c]), c))[len(shapes) // 2]
        config, device = job.planned, job.run.device
        self.predictor = Predictor.of([network], job.plans, config, WindowOptions(device=device))
        self.variants = self.predictor.window.num_variants(config)
        self.crop = self._centre_tile(tuple(shapes[self.case_id]))
        # not timed: the memory simulation (kept for the timed runs) and a network's first pass, which pays once
        # what the final validation pays once too (oneDNN primitives, cuDNN's autotuning, the allocator growing)
        inference_plan(self.predictor, tuple(self.crop.shape[1:]))
        runner = self.predictor.runners[0]
        runner(torch.from_numpy(self.crop[None]).to(runner.device))
        self.case_seconds_per_voxel: float | None = None

    def _centre_tile(self, shape: tuple[int, ...]) -> np.ndarray:
        """(network inputs, *tile) float32: the case's tile cut from its centre, zero-padded where the case is smaller;
        a cascade stage's previous-stage channels zero."""
        tile, _ = window_tile(self.job.planned, self.predictor.window, shape)
        starts = [max(0, (s - t) // 2) for s, t in zip(shape, patch_as_zyx(tile), strict=True)]  # 2D: one slice
        region = tuple(slice(a, a + t) for a, t in zip(starts, patch_as_zyx(tile), strict=True))
        data = open_case(self.job.data_folder, self.case_id).arrays()[0]
        image = np.asarray(data[(slice(None), *region)], dtype=np.float32)
        # a case smaller than the tile is padded to it, as the window pads it: the network takes whole tiles only
        crop = np.zeros((self.job.planned.network.in_channels, *patch_as_zyx(tile)), np.float32)
        crop[(slice(0, len(image)), *(slice(0, n) for n in image.shape[1:]))] = image
        return crop

    def measure(self) -> PredictionRates:
        """The rates now: a tile's passes timed afresh, the rest of a case timed the first time only."""
        clock = self.job.clock
        t0 = clock()
        predict_probabilities(self.crop, self.case_id, self.predictor)
        timing = clock() - t0
        tile, steps = window_tile(self.job.planned, self.predictor.window, tuple(self.crop.shape[1:]))
        passes = tile_layout(self.crop.shape[1:], tile, steps).num_tiles * self.variants
        if self.case_seconds_per_voxel is None:
            self.case_seconds_per_voxel = self._time_case(clock)
        if self.predictor.runners[0].device.type == "cuda":
            torch.cuda.empty_cache()  # the training's steps (and the memory check of the first) hold no tile blocks
        return PredictionRates(timing / (passes * math.prod(tile)), self.case_seconds_per_voxel, timing)

    def _time_case(self, clock: Callable[[], float]) -> float:
        """Seconds per preprocessed voxel of the case's prediction and evaluation without the network's passes."""
        job = self.job
        dataset = load_dataset(job.workspace.dataset_root())
        case = next(c for c in dataset.cases if c.case_id == self.case_id)
        num_outputs = job.plans.label_scheme.num_outputs
        runners = tuple(_ZeroLogits(r, num_outputs) for r in self.predictor.runners)
        window = WindowOptions(device=job.run.device, tta="none")
        no_network = Predictor(runners, job.plans, job.planned, window)
        with tempfile.TemporaryDirectory(prefix="autoseg-timing-") as folder:
            t0 = clock()
            predict_validation_case(job.workspace, job.config_name, case, no_network, Path(folder), dataset.file_ending)
            evaluate_pairs([(case.label_path, case.label_path)], dataset.labels, dataset.file_ending)
            seconds = clock() - t0
        return seconds / math.prod(open_case(job.data_folder, self.case_id).arrays()[0].shape[1:])
