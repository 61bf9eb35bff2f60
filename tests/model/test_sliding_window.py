from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from autoseg.core.errors import InputError
from autoseg.model import sliding_window as inference
from autoseg.model.sliding_window import sliding_window_predict
from autoseg.model.tile_buffers import inference_buffer_bytes
from autoseg.model.tiles import TileLayout, gaussian_importance_map, tile_layout
from autoseg.model.torch_runner import TorchTileRunner
from autoseg.model.tta import mirror_variants, parse_tta
from autoseg.model.window import SlidingWindow


def _predict(networks, data, tile, num_outputs, precision="fp32", device="cpu", on_slab=None, **settings):
    """``sliding_window_predict`` with ``networks`` (one or a list) as torch runners on ``device`` and the
    ``SlidingWindow`` of ``tile``, ``num_outputs`` and ``settings``."""
    networks = networks if isinstance(networks, (list, tuple)) else [networks]
    runners = [TorchTileRunner(n, torch.device(device), precision) for n in networks]
    return sliding_window_predict(runners, data, SlidingWindow(tuple(tile), num_outputs, **settings), on_slab)


def _pointwise_net(dim: int, in_channels: int, num_outputs: int, seed: int = 0) -> nn.Module:
    """A 1x1 convolution with fixed random weights: its output at a voxel depends only on that voxel."""
    gen = torch.Generator().manual_seed(seed)
    conv = (nn.Conv3d if dim == 3 else nn.Conv2d)(in_channels, num_outputs, kernel_size=1)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=gen))
        conv.bias.copy_(torch.randn(conv.bias.shape, generator=gen))
    return conv


def _pointwise_reference(data: np.ndarray, net: nn.Module) -> torch.Tensor:
    """Softmax of the 1x1 conv applied to the whole (C, Z, Y, X) image at once: (K, Z, Y, X)."""
    weight = net.weight.detach().reshape(net.weight.shape[0], -1)  # (K, C)
    logits = torch.einsum("kc,czyx->kzyx", weight, torch.from_numpy(data))
    logits += net.bias.detach()[:, None, None, None]
    return torch.softmax(logits, dim=0)


class _ConstantLogits(nn.Module):
    """Returns the same logit vector at every voxel, as a deep-supervision list."""

    def __init__(self, logits: list[float]) -> None:
        super().__init__()
        self.logits = torch.tensor(logits)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        shape = (x.shape[0], len(self.logits), *x.shape[2:])
        full = self.logits.reshape(1, -1, *([1] * (x.ndim - 2))).expand(shape).clone()
        return [full, full[:, :, ::2]]  # second element: a lower-resolution deep-supervision output


class _PositionLogits(nn.Module):
    """Logits (sum_i coeffs[i] * index along spatial axis i within the tile, 0), whatever the input."""

    def __init__(self, coeffs: tuple[float, ...]) -> None:
        super().__init__()
        self.coeffs = coeffs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grids = torch.meshgrid(*[torch.arange(n, dtype=x.dtype) for n in x.shape[2:]], indexing="ij")
        ramp = sum(c * g for c, g in zip(self.coeffs, grids, strict=True)).expand(x.shape[0], 1, *x.shape[2:])
        return torch.cat([ramp, torch.zeros_like(ramp)], dim=1)


def _random_image(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# ---------------------------------------------------------------- gaussian / tile starts


def test_gaussian_is_centred_normalized_symmetric_and_cached() -> None:
    g = gaussian_importance_map((5, 9, 8))
    assert g.shape == (5, 9, 8) and g.dtype == torch.float32
    assert g.max().item() == pytest.approx(1.0)
    assert g[2, 4].argmax().item() in (3, 4)  # even axis: the two central voxels tie
    for dim in range(3):
        torch.testing.assert_close(g, torch.flip(g, [dim]))
    # odd axis of 9 voxels: sigma = 9/8, so one voxel off the centre the value is exp(-(1 / sigma)**2 / 2)
    one_axis = gaussian_importance_map((9,), sigma_scale=1 / 8)
    assert one_axis[4].item() == pytest.approx(1.0)
    assert one_axis[4 + 1].item() == pytest.approx(math.exp(-0.5 * (8 / 9) ** 2), rel=1e-6)
    assert gaussian_importance_map((5, 9, 8)) is g


def test_a_floor_centred_gaussian_is_nnunets_importance_map() -> None:
    """nnU-Net v2's map (compute_gaussian): a delta at size // 2, scipy's gaussian_filter with sigma = size / 8,
    over its maximum; on an even axis it is not autoseg's symmetric one."""
    from scipy.ndimage import gaussian_filter

    patch = (6, 16, 15)
    delta = np.zeros(patch)
    delta[tuple(n // 2 for n in patch)] = 1
    theirs = gaussian_filter(delta, [n / 8 for n in patch], mode="constant", cval=0)
    theirs /= theirs.max()
    ours = gaussian_importance_map(patch, dtype=torch.float64, centre="floor")
    np.testing.assert_allclose(ours.numpy(), theirs, rtol=1e-6, atol=1e-12)
    assert (
        ours[3, 8, 7].item() == 1.0 and ours[3, 0, 7] < ours[3, 15, 7]
    )  # peaks at size // 2: 8 voxels before, 7 after
    assert not torch.equal(gaussian_importance_map(patch, dtype=torch.float64), ours)


def test_gaussian_has_no_zeros_when_the_dtype_underflows() -> None:
    g = gaussian_importance_map((64, 64, 64), dtype=torch.float16)
    assert g.dtype == torch.float16
    assert (g > 0).all()
    # the corners (exp(-23.25) ~ 8e-11) underflow in fp16 (smallest subnormal 6e-8)...
    assert (gaussian_importance_map((64, 64, 64), dtype=torch.float32).half() == 0).any()
    # ...and get the smallest nonzero value instead
    assert g[0, 0, 0].item() == g.min().item() > 0


def test_tile_layout_starts_example() -> None:
    # per axis: ceil((10 - 4) / 2) + 1 = 4 starts from 0 to 6; (4, 4): one start; (7, 4): ceil(3/2)+1 = 3
    layout = tile_layout((10, 4, 7), (4, 4, 4), step_fraction=0.5)
    assert layout.axis_starts == ((0, 2, 4, 6), (0,), (0, 2, 3))  # linspace(0, 3, 3) = 0, 1.5, 3: half to even
    assert layout.num_tiles == 4 * 1 * 3


def test_tile_layout_example_pads_and_counts_tiles() -> None:
    # image (3, 5, 20), patch (4, 8, 8): padded to (4, 8, 20); along x ceil(12 / 4) + 1 = 4 starts
    layout = tile_layout((3, 5, 20), (4, 8, 8), step_fraction=0.5)
    assert isinstance(layout, TileLayout)
    assert layout.padded_shape_zyx == (4, 8, 20)
    assert layout.axis_starts == ((0,), (0,), (0, 4, 8, 12))
    assert layout.num_tiles == 4 == len(layout.regions())
    assert layout.image_region == (slice(0, 3), slice(1, 6), slice(0, 20))  # odd padding voxel after
    assert layout.regions()[1] == (slice(0, 4), slice(0, 8), slice(4, 12))


def test_tile_layout_2d_tiles_every_slice_and_never_pads_z() -> None:
    layout = tile_layout((5, 9, 6), (4, 8), step_fraction=0.5)
    assert layout.padded_shape_zyx == (5, 9, 8)
    # y: ceil((9 - 4) / 2) + 1 = 4 starts, linspace(0, 5, 4) = 0, 1.67, 3.33, 5 rounded
    assert layout.axis_starts == ((0, 1, 2, 3, 4), (0, 2, 3, 5), (0,))
    assert layout.num_tiles == 5 * 4 == len(layout.regions())
    assert layout.regions()[:2] == [(0, slice(0, 4), slice(0, 8)), (0, slice(2, 6), slice(0, 8))]


@pytest.mark.parametrize("step_fraction", [0.25, 0.5, 1.0])
def test_tiles_cover_every_padded_voxel_and_end_on_the_border(step_fraction: float) -> None:
    rng = np.random.default_rng(1)
    for _ in range(20):
        patch = tuple(int(p) for p in rng.integers(1, 9, size=3))
        image = tuple(int(n) for n in rng.integers(1, 25, size=3))
        layout = tile_layout(image, patch, step_fraction)
        padded = layout.padded_shape_zyx
        assert padded == tuple(max(n, p) for n, p in zip(image, patch))
        covered = np.zeros(padded, dtype=bool)
        for region in layout.regions():
            covered[region] = True
        assert covered.all() and layout.num_tiles == len(layout.regions())
        for starts, size, p in zip(layout.axis_starts, padded, patch, strict=True):
            assert starts[0] == 0 and starts[-1] == size - p
            assert np.diff(starts).max(initial=0) <= math.ceil(p * step_fraction)


def test_tile_layout_errors() -> None:
    with pytest.raises(ValueError, match="step_fraction"):
        tile_layout((4, 4, 4), (4, 4, 4), step_fraction=0)
    with pytest.raises(ValueError, match=r"\(Z, Y, X\)"):
        tile_layout((4, 4), (4, 4))
    with pytest.raises(ValueError, match="3 values .* or 2 values"):
        tile_layout((4, 4, 4), (4,))


# ---------------------------------------------------------------- sliding window: 3D


def test_constant_logits_give_exact_softmax_everywhere() -> None:
    data = _random_image((1, 7, 9, 10))
    probs = _predict(_ConstantLogits([1.0, -2.0, 0.5]), data, (4, 4, 4), num_outputs=3)
    assert probs.shape == (3, 7, 9, 10) and probs.dtype == torch.float32 and probs.device.type == "cpu"
    expected = torch.softmax(torch.tensor([1.0, -2.0, 0.5]), dim=0)
    torch.testing.assert_close(probs, expected[:, None, None, None].expand(3, 7, 9, 10), atol=1e-6, rtol=0)


def test_pointwise_network_equals_whole_image_prediction() -> None:
    data = _random_image((2, 9, 11, 10))
    net = _pointwise_net(3, in_channels=2, num_outputs=3)
    probs = _predict(net, data, (4, 6, 4), num_outputs=3)
    torch.testing.assert_close(probs, _pointwise_reference(data, net), atol=1e-5, rtol=1e-5)
    assert not probs.is_inference()  # the caller may edit it in place
    probs[0] *= 0


def test_image_smaller_than_patch_is_padded_and_cropped_back() -> None:
    data = _random_image((1, 3, 5, 12))  # smaller than the patch along z and y, larger along x
    net = _pointwise_net(3, in_channels=1, num_outputs=2)
    probs = _predict(net, data, (4, 8, 8), num_outputs=2)
    assert probs.shape == (2, 3, 5, 12)
    torch.testing.assert_close(probs, _pointwise_reference(data, net), atol=1e-5, rtol=1e-5)


def test_padding_is_symmetric_and_zero() -> None:
    # (2, 3, 4) in a (4, 6, 4) patch: one tile, padded by 1 before along z (2 = 1 + 1) and y (3 = 1 + 2).
    data = np.ones((1, 2, 3, 4), dtype=np.float32)
    probs = _predict(_PositionLogits((1.0, 0.1, 0.01)), data, (4, 6, 4), num_outputs=2)
    z, y, x = torch.meshgrid(torch.arange(2.0), torch.arange(3.0), torch.arange(4.0), indexing="ij")
    logit = (z + 1) + 0.1 * (y + 1) + 0.01 * x
    torch.testing.assert_close(probs[0], torch.sigmoid(logit))  # softmax([l, 0])[0] = sigmoid(l)
    # a 3x3x3 box sum sees the zero padding: voxels on the image border count fewer ones
    box = nn.Conv3d(1, 1, kernel_size=3, padding=1, bias=False)
    nn.init.ones_(box.weight)
    net = nn.Sequential(box, nn.Conv3d(1, 2, kernel_size=1))
    with torch.no_grad():
        net[1].weight.copy_(torch.tensor([1.0, 0.0]).reshape(2, 1, 1, 1, 1))
        net[1].bias.zero_()
    probs = _predict(net, data, (4, 6, 4), num_outputs=2)
    counts = nn.functional.conv3d(torch.from_numpy(data)[None], torch.ones(1, 1, 3, 3, 3), padding=1)[0, 0]
    assert counts[0, 0, 0] == 8 and counts[1, 1, 1] == 18
    torch.testing.assert_close(probs[0], torch.sigmoid(counts))


def test_mirroring_a_pointwise_network_changes_nothing_and_runs_every_flip() -> None:
    data = _random_image((1, 6, 7, 8))
    net = _pointwise_net(3, in_channels=1, num_outputs=2)
    calls = []
    net.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0]))
    plain = _predict(net, data, (4, 4, 4), num_outputs=2)
    tiles = len(calls)
    mirrored = _predict(net, data, (4, 4, 4), num_outputs=2, mirror_axes=(0, 1, 2))
    assert len(calls) - tiles == 8 * tiles
    torch.testing.assert_close(mirrored, plain, atol=1e-5, rtol=1e-5)


def test_mirroring_flips_the_prediction_back() -> None:
    # One tile. Without mirroring the z-ramp logit shows through; mirrored along z it averages
    # (z + (3 - z)) / 2 = 1.5 at every voxel, which only holds if each output is flipped back.
    data = np.zeros((1, 4, 4, 4), dtype=np.float32)
    z_ramp = _PositionLogits((1.0, 0.0, 0.0))
    plain = _predict(z_ramp, data, (4, 4, 4), num_outputs=2)
    assert not torch.allclose(plain[:, 0], plain[:, 3])
    mirrored = _predict(z_ramp, data, (4, 4, 4), num_outputs=2, mirror_axes=(0,))
    expected = torch.softmax(torch.tensor([1.5, 0.0]), dim=0)
    torch.testing.assert_close(mirrored, expected[:, None, None, None].expand(2, 4, 4, 4))


def test_tile_batching_equals_unbatched_with_a_spatial_network() -> None:
    # A 3x3x3 conv with zero padding sees tile borders, so the Gaussian overlap weighting matters.
    torch.manual_seed(0)
    net = nn.Conv3d(1, 3, kernel_size=3, padding=1)
    data = _random_image((1, 7, 9, 9))
    one = _predict(net, data, (4, 4, 4), num_outputs=3, mirror_axes=(1,))
    three = _predict(net, data, (4, 4, 4), num_outputs=3, mirror_axes=(1,), tile_batch_size=3)
    torch.testing.assert_close(three, one, atol=1e-5, rtol=1e-5)
    flat = _predict(net, data, (4, 4, 4), num_outputs=3, mirror_axes=(1,), use_gaussian=False)
    assert not torch.allclose(flat, one, atol=1e-4)  # the weighting does change a border-sensitive net


def test_network_is_run_in_eval_mode_and_its_mode_is_restored() -> None:
    net = nn.Sequential(nn.Dropout3d(p=0.5), _pointwise_net(3, 1, 2))
    net.train()
    data = _random_image((1, 4, 6, 6))
    first = _predict(net, data, (4, 4, 4), num_outputs=2)
    second = _predict(net, data, (4, 4, 4), num_outputs=2)
    torch.testing.assert_close(first, second)
    assert net.training


def test_bf16_is_close_to_fp32_and_fp16_on_cpu_falls_back_to_fp32() -> None:
    data = _random_image((1, 5, 6, 7))
    net = _pointwise_net(3, 1, 3)
    fp32 = _predict(net, data, (4, 4, 4), num_outputs=3)
    bf16 = _predict(net, data, (4, 4, 4), num_outputs=3, precision="bf16")
    fp16 = _predict(net, data, (4, 4, 4), num_outputs=3, precision="fp16")
    assert bf16.dtype == torch.float32
    assert (bf16 - fp32).abs().max() < 3e-2 and not torch.equal(bf16, fp32)
    torch.testing.assert_close(fp16, fp32, atol=0, rtol=0)


def test_progress_bar_counts_tiles(capsys: pytest.CaptureFixture[str]) -> None:
    data = _random_image((1, 4, 6, 6))
    _predict(_pointwise_net(3, 1, 2), data, (4, 4, 4), num_outputs=2, progress=True)
    assert "4/4" in capsys.readouterr().err  # 1 x 2 x 2 tiles


# ---------------------------------------------------------------- sliding window: 2D


def test_2d_network_predicts_slice_by_slice() -> None:
    data = _random_image((2, 5, 9, 6))  # 5 slices; x smaller than the patch -> padded
    net = _pointwise_net(2, in_channels=2, num_outputs=3)
    batch_sizes = []
    net.register_forward_hook(lambda module, args, out: batch_sizes.append(tuple(args[0].shape)))
    probs = _predict(net, data, (4, 8), num_outputs=3, tile_batch_size=4, mirror_axes=(0, 1))
    assert probs.shape == (3, 5, 9, 6)
    torch.testing.assert_close(probs, _pointwise_reference(data, net), atol=1e-5, rtol=1e-5)
    # 5 slices x 4 tiles along y (ceil(5 / 2) + 1) x 1 along x = 20 tiles: 5 batches of 4, 4 flips each
    assert batch_sizes == [(4, 2, 4, 8)] * 20


def test_2d_constant_logits_and_tile_batching() -> None:
    torch.manual_seed(0)
    net = nn.Conv2d(1, 2, kernel_size=3, padding=1)
    data = _random_image((1, 3, 10, 7))
    one = _predict(net, data, (4, 4), num_outputs=2)
    five = _predict(net, data, (4, 4), num_outputs=2, tile_batch_size=5)
    torch.testing.assert_close(five, one, atol=1e-5, rtol=1e-5)
    const = _predict(_ConstantLogits([0.0, 2.0]), data, (4, 4), num_outputs=2)
    expected = torch.softmax(torch.tensor([0.0, 2.0]), dim=0)
    torch.testing.assert_close(const, expected[:, None, None, None].expand(2, 3, 10, 7), atol=1e-6, rtol=0)


# ---------------------------------------------------------------- errors


def test_errors_say_what_to_change() -> None:
    net = _pointwise_net(3, 1, 2)
    data = _random_image((1, 4, 4, 4))
    with pytest.raises(ValueError, match=r"\(C, Z, Y, X\); got shape \(4, 4, 4\)"):
        _predict(net, data[0], (4, 4, 4), num_outputs=2)
    with pytest.raises(ValueError, match="mirror_axes"):
        _predict(net, data, (4, 4, 4), num_outputs=2, mirror_axes=(3,))
    with pytest.raises(ValueError, match="precision"):
        _predict(net, data, (4, 4, 4), num_outputs=2, precision="fp8")
    with pytest.raises(ValueError, match="3 values .* or 2 values"):
        _predict(net, data, (4,), num_outputs=2)
    with pytest.raises(ValueError, match=r"expected \(1, 5, 4, 4, 4\)\. Check num_outputs"):
        _predict(net, data, (4, 4, 4), num_outputs=5)


# ---------------------------------------------------------------- buffer estimate vs allocation


def test_buffer_estimate_by_hand() -> None:
    # image (3, 5, 20) padded to (4, 8, 20) by a (4, 8, 8) patch: 640 voxels; K = 3, C = 2, B = 2
    sizes = inference_buffer_bytes((3, 5, 20), SlidingWindow((4, 8, 8), 3, tile_batch_size=2), in_channels=2)
    assert sizes["accumulator"] == 3 * 640 * 4
    assert sizes["weight_map"] == 640 * 4
    assert sizes["padded_input"] == 2 * 640 * 4
    assert sizes["tile_batch"] == 2 * 2 * 256 * 4 and sizes["tile_logits"] == 2 * 3 * 256 * 4
    assert sizes["output"] == 3 * 300 * 4  # the unpadded image, float32
    assert sizes["total"] == sum(v for k, v in sizes.items() if k != "total")
    # 2D patch: z is never padded; a batch of 2 (of the 4 tiles of a slice) writes one slice
    sizes_2d = inference_buffer_bytes((3, 5, 20), SlidingWindow((8, 8), 3, tile_batch_size=2), in_channels=2)
    assert sizes_2d["weight_map"] == 1 * 8 * 20 * 4
    # a long image: the accumulator holds the z-slices of one batch (tiles at z 0, 2: 2 + 4 slices), not 40;
    # the output is float16 when asked
    long = inference_buffer_bytes((40, 8, 8), SlidingWindow((4, 8, 8), 3, tile_batch_size=2, output_dtype="float16"), 1)
    assert long["accumulator"] == 3 * 6 * 64 * 4 and long["weight_map"] == 6 * 64 * 4
    assert long["output"] == 3 * 40 * 64 * 2 and long["padded_input"] == 0  # no padding: the input itself is read
    on_cuda = inference_buffer_bytes(
        (40, 8, 8), SlidingWindow((4, 8, 8), 3, tile_batch_size=2, output_dtype=None), 1, device="cuda"
    )
    assert on_cuda["padded_input"] == 40 * 64 * 4 and on_cuda["output"] == 0  # copied to the device; slabs to a sink


@pytest.mark.parametrize(
    ("shape", "patch", "batch"),
    [((2, 5, 7, 9), (4, 4, 4), 3), ((1, 3, 10, 5), (4, 8), 4), ((3, 6, 4, 4), (4, 4, 4), 1)],
)
def test_buffer_estimate_matches_the_tensors_allocated(
    monkeypatch: pytest.MonkeyPatch, shape: tuple[int, ...], patch: tuple[int, ...], batch: int
) -> None:
    seen: dict[str, int] = {"tile_batch": 0, "tile_logits": 0, "agreement": 0}
    allocate, predict_batch = inference.allocate_buffers, inference.predict_tile_batch

    def record_allocation(*args, **kwargs):
        buffers = allocate(*args, **kwargs)
        for name in ("padded_input", "accumulator", "weight_map", "gaussian", "output"):
            seen[name] = getattr(buffers, name).untyped_storage().nbytes()
        if buffers.padded_input is args[0]:  # an image that needs no padding is read where it is: nothing new
            seen["padded_input"] = 0
        return buffers

    def record_batch(network, tile_batch, *args, **kwargs):
        logits = predict_batch(network, tile_batch, *args, **kwargs)
        seen["tile_batch"] = max(seen["tile_batch"], tile_batch.untyped_storage().nbytes())
        seen["tile_logits"] = max(seen["tile_logits"], logits.untyped_storage().nbytes())
        return logits

    monkeypatch.setattr(inference, "allocate_buffers", record_allocation)
    monkeypatch.setattr(inference, "predict_tile_batch", record_batch)
    net = _pointwise_net(len(patch), in_channels=shape[0], num_outputs=4)
    _predict(net, _random_image(shape), patch, num_outputs=4, tile_batch_size=batch)

    expected = inference_buffer_bytes(shape[1:], SlidingWindow(patch, 4, tile_batch_size=batch), in_channels=shape[0])
    assert expected.pop("total") == sum(expected.values())
    assert seen == expected


@pytest.mark.parametrize("logits", [[1.0, 0.0, -0.5], [9e4, -9e4, 0.0]])
def test_a_float16_accumulator_keeps_every_voxel_and_stays_finite(logits: list[float]) -> None:
    """A running mean, not a sum: at the image's corners, where every tile covering a voxel weighs it about
    exp(-24), a float16 sum of Gaussian x logits would underflow to 0 (uniform probabilities there), and logits
    beyond float16's range would sum to inf; the mean gives each voxel its logits' softmax."""
    data = _random_image((1, 12, 20, 20))
    expected = torch.softmax(torch.tensor(logits).clamp(-65504, 65504), 0)
    probs = _predict(
        _ConstantLogits(logits),
        data,
        (8, 8, 8),
        num_outputs=3,
        mirror_axes=(0, 1, 2),
        tta=2,
        tile_batch_size=3,
        accumulator_dtype="float16",
    )
    assert torch.isfinite(probs).all()
    torch.testing.assert_close(probs, expected[:, None, None, None].expand_as(probs), atol=2e-3, rtol=0)


def test_buffer_estimate_counts_a_float16_accumulator_at_half_the_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}
    allocate = inference.allocate_buffers

    def record_allocation(*args, **kwargs):
        buffers = allocate(*args, **kwargs)
        seen["accumulator"] = buffers.accumulator.untyped_storage().nbytes()
        return buffers

    monkeypatch.setattr(inference, "allocate_buffers", record_allocation)
    _predict(
        _pointwise_net(3, in_channels=1, num_outputs=4),
        _random_image((1, 9, 8, 8)),
        (4, 8, 8),
        num_outputs=4,
        accumulator_dtype="float16",
    )
    sizes = inference_buffer_bytes((9, 8, 8), SlidingWindow((4, 8, 8), 4, accumulator_dtype="float16"), 1)
    assert seen["accumulator"] == sizes["accumulator"] == 4 * 4 * 64 * 2  # K x 4 slices x 8 x 8, float16


def test_sigmoid_activation_for_regions() -> None:
    data = _random_image((1, 5, 6, 7))
    probs = _predict(_ConstantLogits([1.0, -2.0]), data, (4, 4, 4), num_outputs=2, activation="sigmoid")
    expected = torch.sigmoid(torch.tensor([1.0, -2.0]))  # per channel: need not sum to 1
    torch.testing.assert_close(probs, expected[:, None, None, None].expand(2, 5, 6, 7), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="activation must be one of"):
        _predict(_ConstantLogits([1.0, -2.0]), data, (4, 4, 4), num_outputs=2, activation="relu")


# ---------------------------------------------------------------- mirror variants, --tta, batched variants


def test_mirror_variants_order_and_tta_count() -> None:
    every = [(), (0,), (1,), (2,), (0, 1), (0, 2), (1, 2), (0, 1, 2)]  # identity first, then by size
    assert mirror_variants((0, 1, 2)) == every
    assert mirror_variants((0, 1, 2), tta=3) == every[:3]
    assert mirror_variants((0, 1, 2), tta=0) == mirror_variants((0, 1, 2), tta=1) == [()]
    assert mirror_variants((), tta=None) == [()]
    with pytest.raises(InputError, match="tta 9 is not between 0 and 8"):
        mirror_variants((0, 1, 2), tta=9)


@pytest.mark.parametrize(
    ("text", "axes", "count"),
    [("all", 3, 8), ("ALL", 2, 4), ("none", 3, 1), ("0", 3, 1), ("1", 3, 1), ("5", 3, 5), ("8", 3, 8), ("all", 0, 1)],
)
def test_parse_tta(text: str, axes: int, count: int) -> None:
    assert parse_tta(text, axes) == count


@pytest.mark.parametrize("text", ["9", "-1", "some", "", "2.5"])
def test_parse_tta_refuses_with_the_choices(text: str) -> None:
    with pytest.raises(InputError, match=r"use all, none or a number of mirror variants from 0 to 8"):
        parse_tta(text, 3)


def test_one_forward_pass_takes_tiles_and_mirror_variants_together() -> None:
    net = _pointwise_net(3, in_channels=1, num_outputs=2)
    sizes: list[int] = []
    net.register_forward_hook(lambda module, args, out: sizes.append(args[0].shape[0]))
    data = _random_image((1, 4, 4, 10))  # (4, 4, 4) patch: 4 tiles along x
    _predict(net, data, (4, 4, 4), num_outputs=2, mirror_axes=(1, 2), tile_batch_size=8)
    assert sizes == [8, 8]  # 4 tiles x 4 variants in 2 passes, not 4 x 4 passes of one tile
    sizes.clear()
    _predict(net, data, (4, 4, 4), num_outputs=2, mirror_axes=(1, 2), tta=3, tile_batch_size=5)
    assert sizes == [5, 5, 2]  # 4 tiles x 3 variants


def test_tta_uses_the_first_variants_only() -> None:
    # One tile, a z-ramp logit: identity gives z, the z-flip gives 3 - z; tta=2 on axes (1, 0) takes the
    # identity and the y-flip (no effect on a z-ramp), tta=3 adds the z-flip: mean (2z + 3 - z) / 3.
    data = np.zeros((1, 4, 4, 4), dtype=np.float32)
    z_ramp = _PositionLogits((1.0, 0.0, 0.0))
    two = _predict(z_ramp, data, (4, 4, 4), num_outputs=2, mirror_axes=(1, 0), tta=2)
    three = _predict(z_ramp, data, (4, 4, 4), num_outputs=2, mirror_axes=(1, 0), tta=3)
    z = torch.arange(4.0)[:, None, None].expand(4, 4, 4)
    torch.testing.assert_close(two[0], torch.sigmoid(z))
    torch.testing.assert_close(three[0], torch.sigmoid((z + 3) / 3))


def test_accumulator_on_the_host_gives_the_same_probabilities() -> None:
    torch.manual_seed(0)
    net = nn.Conv3d(1, 3, kernel_size=3, padding=1)
    data = _random_image((1, 7, 9, 9))
    here = _predict(net, data, (4, 4, 4), num_outputs=3, mirror_axes=(0, 1), tile_batch_size=3)
    host = _predict(
        net, data, (4, 4, 4), num_outputs=3, mirror_axes=(0, 1), tile_batch_size=3, accumulator_device="cpu"
    )
    torch.testing.assert_close(host, here, atol=0, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_tiles_on_cuda_accumulator_on_the_host() -> None:
    torch.manual_seed(0)
    net = nn.Conv3d(1, 3, kernel_size=3, padding=1)
    data = _random_image((1, 7, 9, 9))
    cpu = _predict(net, data, (4, 4, 4), num_outputs=3, mirror_axes=(0, 1), tile_batch_size=3)
    mixed = _predict(
        net.cuda(),
        data,
        (4, 4, 4),
        num_outputs=3,
        mirror_axes=(0, 1),
        tile_batch_size=3,
        device="cuda",
        accumulator_device="cpu",
    )
    torch.testing.assert_close(mixed, cpu, atol=1e-5, rtol=1e-5)
