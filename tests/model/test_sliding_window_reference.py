"""sliding_window_predict against a plain reference written the obvious way: one tile and one mirror
variant at a time, a float32 accumulator, loops."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from torch import nn

from autoseg.model.network import build_network
from autoseg.model.sliding_window import sliding_window_predict
from autoseg.model.topology import NetworkTopology


def _random_image(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _reference_predict(net: nn.Module, data: np.ndarray, patch: tuple[int, ...], num_outputs: int,
                       mirror_axes: tuple[int, ...], tta: int | None) -> np.ndarray:
    """The obvious way: pad with zeros (centred), every tile one at a time, every mirror variant one at a
    time, a float32 accumulator of Gaussian-weighted logits, divide by the summed weights, softmax, crop."""
    every = [()] + [(a,) for a in mirror_axes] + [c for c in itertools.combinations(mirror_axes, 2)]
    every += [tuple(mirror_axes)] if len(mirror_axes) == 3 else []
    variants = every[:max(tta, 1)] if tta is not None else every
    patch3 = patch if len(patch) == 3 else (1, *patch)
    shape = data.shape[1:]
    padded_shape = [max(s, p) for s, p in zip(shape, patch3)]
    before = [(p - s) // 2 for s, p in zip(shape, padded_shape)]
    padded = np.zeros((data.shape[0], *padded_shape), dtype=np.float32)
    padded[:, before[0]:before[0] + shape[0], before[1]:before[1] + shape[1], before[2]:before[2] + shape[2]] = data
    gauss = np.ones(patch3, dtype=np.float64)
    for axis, p in enumerate(patch3):
        g1 = np.exp(-0.5 * ((np.arange(p) - (p - 1) / 2) / (p / 8)) ** 2)
        gauss = gauss * g1.reshape([-1 if a == axis else 1 for a in range(3)])
    gauss = (gauss / gauss.max()).astype(np.float32)
    acc = np.zeros((num_outputs, *padded_shape), dtype=np.float32)
    weights = np.zeros(padded_shape, dtype=np.float32)
    starts = [list(range(padded_shape[0]))] if len(patch) == 2 else []  # 2D: every slice
    for size, p in zip(padded_shape[-len(patch):], patch):
        n = math.ceil((size - p) / (p * 0.5)) + 1
        starts.append([int(round(s)) for s in np.linspace(0, size - p, n)])
    for z in starts[0]:
        for y in starts[1]:
            for x in starts[2]:
                tile = torch.from_numpy(padded[:, z:z + patch3[0], y:y + patch3[1], x:x + patch3[2]])
                if len(patch) == 2:
                    tile = tile[:, 0]
                total = torch.zeros((num_outputs, *tile.shape[1:]))
                for flip in variants:
                    dims = [a + 1 for a in flip]
                    with torch.no_grad():
                        out = net(torch.flip(tile, dims)[None] if dims else tile[None])
                    out = out[0] if isinstance(out, (list, tuple)) else out
                    total += torch.flip(out[0], dims) if dims else out[0]
                logits = (total / len(variants)).numpy().reshape(num_outputs, *patch3)
                acc[:, z:z + patch3[0], y:y + patch3[1], x:x + patch3[2]] += logits * gauss
                weights[z:z + patch3[0], y:y + patch3[1], x:x + patch3[2]] += gauss
    probs = torch.softmax(torch.from_numpy(acc / weights), dim=0).numpy()
    return probs[:, before[0]:before[0] + shape[0], before[1]:before[1] + shape[1], before[2]:before[2] + shape[2]]


def _small_unet(dim: int) -> nn.Module:
    topology = NetworkTopology(dim=dim, in_channels=2, num_outputs=3, features_per_stage=(4, 8),
                               kernel_sizes=((3,) * dim,) * 2, strides=((1,) * dim, (2,) * dim))
    torch.manual_seed(3)
    return build_network(topology).eval()


@pytest.mark.parametrize(("dim", "shape", "patch"), [(3, (2, 9, 13, 18), (8, 8, 8)), (2, (2, 3, 13, 18), (8, 8))])
def test_agrees_with_the_plain_reference(dim: int, shape: tuple[int, ...], patch: tuple[int, ...]) -> None:
    net = _small_unet(dim)
    data = _random_image(shape, seed=dim)
    axes = tuple(range(dim))
    for tta, batches in ((None, (1, 3, 8, 64)), (1, (1, 5)), (3, (2, 7))):
        expected = _reference_predict(net, data, patch, 3, axes, tta)
        labels = expected.argmax(0)
        for batch in batches:
            probs = sliding_window_predict(net, data, patch, 3, mirror_axes=axes, tta=tta, tile_batch_size=batch)
            assert probs.shape == expected.shape
            differ = (probs.numpy().argmax(0) != labels).mean()
            assert differ <= 0.001, (tta, batch, differ)
            np.testing.assert_allclose(probs.numpy(), expected, atol=1e-4)
