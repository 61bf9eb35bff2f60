"""sliding_window_predict against a plain reference written the obvious way: one tile and one mirror
variant at a time, a float32 accumulator, loops."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from reference_predict import reference_predict
from torch import nn

from autoseg.model.network import build_network
from autoseg.model.sliding_window import sliding_window_predict
from autoseg.model.topology import NetworkTopology
from autoseg.model.torch_runner import TorchTileRunner
from autoseg.model.window import SlidingWindow


def _predict(networks, data, tile, num_outputs, precision="fp32", device="cpu", on_slab=None, **settings):
    """``sliding_window_predict`` with ``networks`` (one or a list) as torch runners on ``device`` and the
    ``SlidingWindow`` of ``tile``, ``num_outputs`` and ``settings``."""
    networks = networks if isinstance(networks, (list, tuple)) else [networks]
    runners = [TorchTileRunner(n, torch.device(device), precision) for n in networks]
    return sliding_window_predict(runners, data, SlidingWindow(tuple(tile), num_outputs, **settings), on_slab)


def _random_image(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _small_unet(dim: int) -> nn.Module:
    topology = NetworkTopology(
        dim=dim,
        in_channels=2,
        num_outputs=3,
        features_per_stage=(4, 8),
        kernel_sizes=((3,) * dim,) * 2,
        strides=((1,) * dim, (2,) * dim),
    )
    torch.manual_seed(3)
    return build_network(topology).eval()


@pytest.mark.parametrize(("dim", "shape", "patch"), [(3, (2, 9, 13, 18), (8, 8, 8)), (2, (2, 3, 13, 18), (8, 8))])
def test_agrees_with_the_plain_reference(dim: int, shape: tuple[int, ...], patch: tuple[int, ...]) -> None:
    net = _small_unet(dim)
    data = _random_image(shape, seed=dim)
    axes = tuple(range(dim))
    for tta, batches in ((None, (1, 3, 8, 64)), (1, (1, 5)), (3, (2, 7))):
        expected = reference_predict(net, data, patch, 3, axes, tta)
        labels = expected.argmax(0)
        for batch in batches:
            probs = _predict(net, data, patch, 3, mirror_axes=axes, tta=tta, tile_batch_size=batch)
            assert probs.shape == expected.shape
            differ = (probs.numpy().argmax(0) != labels).mean()
            assert differ <= 0.001, (tta, batch, differ)
            np.testing.assert_allclose(probs.numpy(), expected, atol=1e-4)


@pytest.mark.parametrize(("dim", "shape", "patch"), [(3, (2, 17, 29, 31), (8, 16, 16)), (2, (2, 3, 40, 37), (16, 16))])
def test_a_float16_accumulator_agrees_with_the_plain_reference(
    dim: int, shape: tuple[int, ...], patch: tuple[int, ...]
) -> None:
    """The float16 accumulator (predict's default): labels of the float32 reference except at most 0.1% of voxels
    (where the top two classes nearly tie), probabilities within float16's precision."""
    net = _small_unet(dim)
    data = _random_image(shape, seed=dim + 7)
    axes = tuple(range(dim))
    expected = reference_predict(net, data, patch, 3, axes, 4)
    probs = _predict(
        net, data, patch, 3, mirror_axes=axes, tta=4, tile_batch_size=3, accumulator_dtype="float16"
    ).numpy()
    differ = probs.argmax(0) != expected.argmax(0)
    assert differ.mean() <= 0.001
    top2 = np.sort(expected, axis=0)[-2:]
    assert (top2[1] - top2[0])[differ].max(initial=0) < 0.01  # only near-ties change
    np.testing.assert_allclose(probs, expected, atol=3e-3)


def test_folds_are_one_ensemble_of_mean_logits() -> None:
    """Several networks (folds): every tile runs through each, and their logits are averaged before the softmax,
    as the plain reference does; not the mean of each network's probabilities."""
    data = _random_image((2, 9, 13, 18), seed=5)
    first, second = _small_unet(3), _small_unet(3)
    torch.manual_seed(4)
    for p in second.parameters():
        p.data.add_(0.5 * torch.randn_like(p))
    kwargs = {"mirror_axes": (0, 1, 2), "tta": 2, "tile_batch_size": 3}
    both = _predict([first, second], data, (8, 8, 8), 3, **kwargs).numpy()
    expected = reference_predict([first, second], data, (8, 8, 8), 3, (0, 1, 2), 2)
    np.testing.assert_allclose(both, expected, atol=1e-4)
    a = _predict(first, data, (8, 8, 8), 3, **kwargs).numpy()
    b = _predict(second, data, (8, 8, 8), 3, **kwargs).numpy()
    assert np.abs(both - (a + b) / 2).max() > 1e-3  # mean logits, not mean probabilities: the test tells them apart


def test_slabs_go_to_the_sink_in_order_and_equal_the_output() -> None:
    """on_slab: every image z-slice arrives once, in z order, with the probabilities the output would hold; no
    output is returned."""
    data = _random_image((2, 21, 13, 18), seed=6)
    net = _small_unet(3)
    expected = _predict(net, data, (8, 8, 8), 3, tile_batch_size=2)
    got, ranges = torch.zeros_like(expected), []

    def sink(z0: int, z1: int, probabilities: torch.Tensor) -> None:
        ranges.append((z0, z1))
        got[:, z0:z1] = probabilities

    assert _predict(net, data, (8, 8, 8), 3, tile_batch_size=2, on_slab=sink) is None
    assert ranges[0][0] == 0 and ranges[-1][1] == 21 and len(ranges) > 2
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    torch.testing.assert_close(got, expected)
