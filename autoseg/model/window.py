"""``SlidingWindow``: the settings of one ``autoseg.model.sliding_window.sliding_window_predict`` call, one frozen
value: the tile and its steps, the mirror variants, the tile batch, the accumulator, the activation and the output.
The buffers' bytes (``autoseg.model.tile_buffers.inference_buffer_bytes``) are counted from the same value. What
runs the tiles (device, precision) is the runners' (``autoseg.model.tile_runner``). No torch is imported here.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoseg.model.agreement import Agreement

# LabelScheme.activation: softmax over classes, sigmoid per region, none where the logits are exported (resampled
# before the activation: nnU-Net v2's order)
ACTIVATIONS = ("softmax", "sigmoid", "none")


@dataclass(frozen=True)
class SlidingWindow:
    """How ``sliding_window_predict`` tiles one image and what it returns.

    ``tile``: (z, y, x) for a 3D network, or (y, x) for a 2D network (each slice is tiled; tiles of several slices
    share a batch). ``step_fraction``: one for every axis, or one per axis (``overlap_step_fractions``).
    ``mirror_axes`` index the tile's spatial axes; ``tta`` picks the first N of their ``mirror_variants`` (None: all
    ``2 ** len(mirror_axes)``): each variant is flipped, predicted and flipped back, and the logits averaged. One
    forward pass takes ``tile_batch_size`` (tile, variant) pairs, tile by tile (2 tiles x 4 variants in a batch of
    8). ``accumulator_device``: where the accumulator, weight map and Gaussian live (None: the runners' device;
    ``autoseg.memory.inference_plan.plan_inference`` chooses it and the batch). ``accumulator_dtype``: a key of
    ``ACCUMULATOR_DTYPES`` (each tile is added in fp32, the softmax runs in fp32). ``activation``: "softmax" over
    the outputs (classes), "sigmoid" per output (regions) or "none" (the averaged logits). ``output_dtype``: the
    returned probabilities' (a key of ``OUTPUT_DTYPES``), or None: there is no output, each finished slab goes to the
    call's ``on_slab``. ``agreement``: the members (folds or mirror variants) whose disagreement the call counts into
    its ``AgreementCounter`` (``autoseg.model.agreement``), or None.
    """

    tile: tuple[int, ...]
    num_outputs: int  # K: the network's outputs (classes or regions)
    step_fraction: float | tuple[float, ...] = 0.5
    mirror_axes: tuple[int, ...] = ()
    tta: int | None = None
    tile_batch_size: int = 1
    accumulator_device: str | None = None
    accumulator_dtype: str = "float32"
    activation: str = "softmax"
    output_dtype: str | None = "float32"
    use_gaussian: bool = True  # False: every voxel of a tile weighs 1
    gaussian_centre: str = "middle"  # where the Gaussian peaks (autoseg.model.tiles.GAUSSIAN_CENTRES)
    progress: bool = False  # a progress bar over the (tile, variant) pairs
    agreement: Agreement | None = None
