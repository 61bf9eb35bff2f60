"""A plain reference of prediction, written the obvious way, to hold the real code against: the sliding window
one tile and one mirror variant at a time into a float32 accumulator (``reference_predict``), and the export
resampling each class's whole probability map before the argmax (``reference_labels``)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch
from torch import nn

from autoseg.dataset.cropping import uncrop
from autoseg.preprocess.resampling import resample_channel
from autoseg.preprocess.store import CaseProperties


def reference_predict(
    net: nn.Module | list[nn.Module],
    data: np.ndarray,
    patch: tuple[int, ...],
    num_outputs: int,
    mirror_axes: tuple[int, ...],
    tta: int | None,
) -> np.ndarray:
    """The obvious way: pad with zeros (centred), every tile one at a time, every network (fold) and every mirror
    variant one at a time, their mean logits into a float32 accumulator Gaussian-weighted, divide by the summed
    weights, softmax, crop."""
    nets = [net] if isinstance(net, nn.Module) else net
    every = [()] + [(a,) for a in mirror_axes] + [c for c in itertools.combinations(mirror_axes, 2)]
    every += [tuple(mirror_axes)] if len(mirror_axes) == 3 else []
    variants = every[: max(tta, 1)] if tta is not None else every
    patch3 = patch if len(patch) == 3 else (1, *patch)
    shape = data.shape[1:]
    padded_shape = [max(s, p) for s, p in zip(shape, patch3)]
    before = [(p - s) // 2 for s, p in zip(shape, padded_shape)]
    padded = np.zeros((data.shape[0], *padded_shape), dtype=np.float32)
    padded[:, before[0] : before[0] + shape[0], before[1] : before[1] + shape[1], before[2] : before[2] + shape[2]] = (
        data
    )
    gauss = np.ones(patch3, dtype=np.float64)
    for axis, p in enumerate(patch3):
        g1 = np.exp(-0.5 * ((np.arange(p) - (p - 1) / 2) / (p / 8)) ** 2)
        gauss = gauss * g1.reshape([-1 if a == axis else 1 for a in range(3)])
    gauss = (gauss / gauss.max()).astype(np.float32)
    acc = np.zeros((num_outputs, *padded_shape), dtype=np.float32)
    weights = np.zeros(padded_shape, dtype=np.float32)
    starts = [list(range(padded_shape[0]))] if len(patch) == 2 else []  # 2D: every slice
    for size, p in zip(padded_shape[-len(patch) :], patch):
        n = math.ceil((size - p) / (p * 0.5)) + 1
        starts.append([int(round(s)) for s in np.linspace(0, size - p, n)])
    for z in starts[0]:
        for y in starts[1]:
            for x in starts[2]:
                tile = torch.from_numpy(padded[:, z : z + patch3[0], y : y + patch3[1], x : x + patch3[2]])
                if len(patch) == 2:
                    tile = tile[:, 0]
                total = torch.zeros((num_outputs, *tile.shape[1:]))
                for one_net, flip in itertools.product(nets, variants):
                    dims = [a + 1 for a in flip]
                    with torch.no_grad():
                        out = one_net(torch.flip(tile, dims)[None] if dims else tile[None])
                    out = out[0] if isinstance(out, (list, tuple)) else out
                    total += torch.flip(out[0], dims) if dims else out[0]
                logits = (total / (len(variants) * len(nets))).numpy().reshape(num_outputs, *patch3)
                acc[:, z : z + patch3[0], y : y + patch3[1], x : x + patch3[2]] += logits * gauss
                weights[z : z + patch3[0], y : y + patch3[1], x : x + patch3[2]] += gauss
    probs = torch.softmax(torch.from_numpy(acc / weights), dim=0).numpy()
    return probs[
        :, before[0] : before[0] + shape[0], before[1] : before[1] + shape[1], before[2] : before[2] + shape[2]
    ]


def reference_labels(probabilities: np.ndarray, props: CaseProperties) -> np.ndarray:
    """The label map in the original grid: every class's whole map resampled (linear in-plane, nearest across
    thick slices, as the export), stacked, argmax, pasted into the uncropped image."""
    maps = np.stack(
        [
            resample_channel(p.astype(np.float32), props.shape_after_crop, props.target_spacing_mm, order=1, order_z=0)
            for p in probabilities
        ]
    )
    return uncrop(maps.argmax(0).astype(np.uint8), props.crop_bbox, props.shape_before_crop, fill=0)
