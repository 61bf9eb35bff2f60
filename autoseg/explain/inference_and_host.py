"""The rows of `autoseg explain` beside the training step: sliding-window inference on the median image
(``inference_terms``: the phase holding the peak and its terms, as ``autoseg.predict.predictor`` runs it) and
the host RAM of a preprocessing worker and of the export for the median and the largest case (``host_cases``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from autoseg.memory.device import DEVICE_TERMS, predict_device_peak
from autoseg.memory.host import preprocess_worker_bytes, slab_export_bytes
from autoseg.memory.inference import InferenceMemory, InferenceSetting, inference_memory
from autoseg.model.tile_buffers import PREDICTION_ACCUMULATOR, finish_chunk_slices
from autoseg.model.tiles import accumulator_depth, overlap_step_fractions, tile_layout
from autoseg.model.topology import NetworkTopology
from autoseg.plan.fingerprint import Fingerprint
from autoseg.plan.inference_tile import tile_for_image
from autoseg.plan.plans import ConfigurationPlan, Plans


@dataclass(frozen=True)
class HostCase:
    """Host RAM of one case: a preprocessing worker on it and the export of its prediction (bytes by term)."""

    label: str
    shape_zyx_before: tuple[int, int, int]
    shape_zyx_after: tuple[int, int, int]
    preprocess_worker: dict[str, int]
    export: dict[str, int]


def inference_terms(plans: Plans, config: ConfigurationPlan, device: str, precision: str) -> tuple[str, dict[str, int]]:
    """Sliding-window prediction of the median image as ``autoseg.predict.predictor`` runs it (its planned tile,
    ``tile_for_image``, overlapping by half a patch; tile batch 1, mirroring on every axis): the terms of the
    phase holding the peak, then the device's terms."""
    median = tuple(config.median_shape_zyx)
    tile = tile_for_image(config, median)
    mem = _inference_cached(
        config.network,
        tile,
        overlap_step_fractions(tile, config.patch_size),
        median,
        plans.label_scheme.num_outputs,
        precision,
        device,
    )
    held = {
        "parameters": mem.parameter_bytes,
        "padded_input": mem.padded_input_bytes,
        "accumulator": mem.accumulator_bytes,
        "weight_map": mem.weight_map_bytes,
        "gaussian": mem.gaussian_bytes,
        "output": mem.output_bytes,
    }
    tiles = {**held, "tile_prediction": mem.tile_bytes}
    finishing = {**held, "softmax_temp": mem.softmax_temp_bytes}
    phase, terms = ("tiles", tiles) if sum(tiles.values()) >= sum(finishing.values()) else ("finishing", finishing)
    device_terms = predict_device_peak(mem, device)
    return phase, {**terms, **{k: v for k, v in device_terms.items() if k in DEVICE_TERMS}}


@functools.lru_cache(maxsize=16)
def _inference_cached(
    topology: NetworkTopology,
    tile_size: tuple[int, ...],
    step_fraction: tuple[float, ...],
    image_shape_zyx: tuple[int, ...],
    num_outputs: int,
    precision: str,
    device: str,
) -> InferenceMemory:
    setting = InferenceSetting(
        topology,
        tile_size,
        image_shape_zyx,
        num_outputs,
        device=device,
        precision=precision,
        mirror_axes=tuple(range(topology.dim)),
        step_fraction=step_fraction,
        output_dtype=None,  # predict exports each slab as it is finished (SlabExport)
        accumulator_dtype=PREDICTION_ACCUMULATOR,
    )
    return inference_memory(setting, 1)


def host_cases(plans: Plans, config: ConfigurationPlan, fp: Fingerprint | None) -> tuple[HostCase, ...]:
    channels = len(plans.channel_names)
    if fp is None or not fp.cases:
        shape = tuple(config.median_shape_zyx)
        picks = [("median shape (plan; no fingerprint)", shape, shape)]
    else:
        shapes = [
            (c.case_id, tuple(c.shape_zyx), config.resampled_shape(c.cropped_shape_zyx, c.spacing_mm)) for c in fp.cases
        ]
        by_size = sorted(shapes, key=lambda s: math.prod(s[2]))
        median, largest = by_size[(len(by_size) - 1) // 2], by_size[-1]
        picks = [(f"median case ({median[0]})", median[1], median[2])]
        if largest is not median:
            picks.append((f"largest case ({largest[0]})", largest[1], largest[2]))
    return tuple(
        HostCase(
            label,
            before,
            after,
            preprocess_worker_bytes(before, after, channels),
            slab_export_bytes(before, after, plans.label_scheme, _slab_depth(config, after)),
        )
        for label, before, after in picks
    )


def _slab_depth(config: ConfigurationPlan, image_shape_zyx: tuple[int, ...]) -> int:
    """The deepest slab the sliding window hands the export on this image (its planned tile, every mirror variant,
    tile batch 1, the prediction's accumulator dtype, as ``inference_terms``)."""
    tile = tile_for_image(config, image_shape_zyx)
    layout = tile_layout(image_shape_zyx, tile, overlap_step_fractions(tile, config.patch_size))
    return finish_chunk_slices(
        accumulator_depth(layout, 2**config.dim, 1), config.network.num_outputs, PREDICTION_ACCUMULATOR
    )
