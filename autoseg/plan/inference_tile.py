"""The inference tile: the sliding window's tile at prediction, planned per configuration
(``ConfigurationPlan.inference_patch_size``) and fitted to each image (``tile_for_image``).

A fully convolutional network predicts any tile whose sizes are multiples of its strides' product, not only the
training patch. A larger tile means fewer tiles, and with the overlap kept at half a training patch in voxels
(``autoseg.model.sliding_window.overlap_step_fractions``) less of each tile is predicted twice. The planned tile
grows from the patch up to the smallest valid tile that covers the median image and at most
``MAX_TILE_MULTIPLE`` patches per axis, and shrinks until the memory model (``autoseg.memory.inference``)
predicts the sliding window on the median image, one tile per forward pass and the accumulator (prediction's
``PREDICTION_ACCUMULATOR`` dtype) on the device, to fit the device's inference budget (``inference_budget_share``);
where even the patch does not fit so, it is the patch. Per image, each axis then takes the size up to the planned
one, never larger than the image, that predicts the fewest voxels (``tile_for_image``): a tile padded beyond the
image loses Dice (docs/prediction.md).
"""

from __future__ import annotations

import math

from autoseg.core.precision import effective_precision
from autoseg.memory.device import predict_device_peak
from autoseg.memory.inference import InferenceSetting, inference_memory
from autoseg.model.tile_buffers import PREDICTION_ACCUMULATOR
from autoseg.model.tiles import overlap_step_fractions, tile_layout
from autoseg.plan.plans import ConfigurationPlan

MAX_TILE_MULTIPLE = 2  # per axis: a tile of at most 2 patches (8 patches' voxels in 3D)
TILE_SCALE_STEPS = 8  # candidate tiles: the patch scaled by 1 + (largest - 1) * i / 8
# The share of a device's memory one sliding window may use: the rest of a GPU for the CUDA context and the
# allocator, the rest of the host RAM for reading, resampling and exporting cases beside it.
INFERENCE_BUDGET_FRACTION = {"cuda": 0.9, "cpu": 0.5}


def inference_budget_share(device: str, memory_bytes: int) -> int:
    """The bytes one sliding window may use on ``device`` ("cuda..." or "cpu") of ``memory_bytes`` (the GPU's
    memory, or the host RAM available)."""
    return int(INFERENCE_BUDGET_FRACTION["cuda" if device.startswith("cuda") else "cpu"] * memory_bytes)


def tile_candidates(
    patch_size: tuple[int, ...], divisor: tuple[int, ...], median_shape: tuple[int, ...]
) -> list[tuple[int, ...]]:
    """Valid tiles from the largest down to the patch: the patch scaled by common factors, each axis rounded
    down to a multiple of ``divisor`` and held between the patch and its cap, the smallest multiple of
    ``divisor`` covering the median image (``median_shape``, one value per patch axis), at most
    ``MAX_TILE_MULTIPLE`` patches.

    Example: patch (16, 40, 40), divisor (4, 8, 8), median (17, 47, 47) -> caps (20, 48, 48): [(20, 48, 48),
    (16, 48, 48), (16, 40, 40)].
    """
    caps = tuple(
        max(p, min(MAX_TILE_MULTIPLE * p, math.ceil(m / d) * d))
        for p, d, m in zip(patch_size, divisor, median_shape, strict=True)
    )
    largest = max(c / p for c, p in zip(caps, patch_size, strict=True))
    tiles = {tuple(patch_size)}
    for i in range(TILE_SCALE_STEPS + 1):  # at most 9 tiles: the planner simulates them from the largest down
        scale = 1.0 + (largest - 1.0) * i / TILE_SCALE_STEPS
        tiles.add(
            tuple(min(c, max(p, int(scale * p) // d * d)) for p, d, c in zip(patch_size, divisor, caps, strict=True))
        )
    return sorted(tiles, key=lambda t: (math.prod(t), t), reverse=True)


def plan_inference_tile(config: ConfigurationPlan, memory_bytes: int) -> tuple[int, ...]:
    """The largest of ``tile_candidates`` for ``config`` whose sliding window over the median image, one tile per
    forward pass, every mirror variant, the accumulator on the device, is predicted to fit
    ``inference_budget_share(config.device, memory_bytes)``; the patch if none does."""
    median = tuple(config.median_shape_zyx)
    candidates = tile_candidates(tuple(config.patch_size), config.network.patch_divisor(), median[-config.dim :])
    budget = inference_budget_share(config.device, memory_bytes)
    precision = effective_precision(config.precision, config.device)
    for tile in candidates:
        setting = InferenceSetting(
            config.network,
            tile,
            median,
            config.network.num_outputs,
            device=config.device,
            precision=precision,
            mirror_axes=tuple(range(config.dim)),
            accumulator_dtype=PREDICTION_ACCUMULATOR,
        )
        mem = inference_memory(setting, 1)
        if predict_device_peak(mem, config.device)["total"] <= budget:
            return tile
    return tuple(config.patch_size)


def tile_for_image(
    config: ConfigurationPlan, image_shape_zyx: tuple[int, ...], tile: str = "planned", step_fraction: float = 0.5
) -> tuple[int, ...]:
    """The tile of the sliding window over one preprocessed image of ``image_shape_zyx`` (Z, Y, X): ``tile`` "patch"
    is the training patch; "planned" takes, per axis, a size between the patch and the planned tile
    (``config.inference_tile()``), a multiple of the strides' product and no larger than the image, that predicts
    the fewest voxels along that axis (tiles x size, consecutive tiles overlapping by ``1 - step_fraction`` of a
    patch; a tie goes to the larger tile). Never larger than the image: the zero padding beyond it shifts instance
    norm's statistics (tiles padded up to the median image lose Dice on the demo: docs/prediction.md).
    An image smaller than the patch is padded to the patch, as before.

    Example: patch 40, planned 80, divisor 8, an axis of 94: 40 -> 4 tiles (160 voxels), 64 -> 2 (128), 80 -> 2
    (160): 64.
    """
    patch = tuple(config.patch_size)
    if config.inference_tile(tile) == patch:
        return patch
    sizes = tuple(image_shape_zyx)[-len(patch) :]
    return tuple(
        min(_axis_options(p, t, d, s), key=lambda c, s=s, p=p: (_axis_voxels(s, c, p, step_fraction), -c))
        for s, p, t, d in zip(sizes, patch, config.inference_tile(tile), config.network.patch_divisor(), strict=True)
    )


def _axis_options(patch: int, largest: int, divisor: int, size: int) -> list[int]:
    """Tile sizes along one axis: the patch, and the multiples of ``divisor`` above it up to ``largest`` and
    ``size``."""
    return [patch] + list(range(patch + divisor, min(largest, size) + 1, divisor))


def _axis_voxels(size: int, tile: int, patch: int, step_fraction: float) -> int:
    """Voxels the sliding window predicts along one axis of ``size``: its tiles (``tile_layout``) x ``tile``."""
    steps = overlap_step_fractions((1, 1, tile), (1, 1, patch), step_fraction)
    return len(tile_layout((1, 1, size), (1, 1, tile), steps).axis_starts[2]) * tile
