"""Contract tests every registered architecture passes (shapes, backward, deep supervision, checkpointing, the
sliding window in eval mode, input checks), and the plain U-Net's own layout and init. The residual encoder's own
tests are in test_residual.py."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from torch import nn

from autoseg.model.network import NETWORKS, build_network
from autoseg.model.sliding_window import sliding_window_predict
from autoseg.model.topology import PLAIN_UNET, RESIDUAL_ENCODER_UNET, NetworkTopology, resenc_blocks_per_stage
from autoseg.model.torch_runner import TorchTileRunner
from autoseg.model.window import SlidingWindow


def topology(
    dim: int = 3,
    features: tuple[int, ...] = (4, 8, 16),
    deep_supervision: bool = True,
    strides: tuple[tuple[int, ...], ...] | None = None,
    kernel_sizes: tuple[tuple[int, ...], ...] | None = None,
    conv_per_stage: int = 2,
    in_channels: int = 2,
    num_outputs: int = 3,
    architecture: str = PLAIN_UNET,
) -> NetworkTopology:
    """A small topology of ``architecture`` (a residual encoder gets nnU-Net's block counts and ``conv_per_stage``
    decoder convs)."""
    n = len(features)
    blocks = resenc_blocks_per_stage(n) if architecture == RESIDUAL_ENCODER_UNET else ()
    return NetworkTopology(
        dim=dim,
        in_channels=in_channels,
        num_outputs=num_outputs,
        features_per_stage=features,
        kernel_sizes=kernel_sizes or ((3,) * dim,) * n,
        strides=strides or ((1,) * dim,) + ((2,) * dim,) * (n - 1),
        conv_per_stage=conv_per_stage,
        deep_supervision=deep_supervision,
        architecture=architecture,
        blocks_per_stage=blocks,
    )


# (dim, patch) pairs; 3 stages of stride 2 need multiples of 4
CASES = [(2, (32, 32)), (3, (16, 16, 16))]
ARCHITECTURES = sorted(NETWORKS)  # every registered architecture passes the contract tests


def test_every_architecture_a_plan_can_name_is_registered() -> None:
    from autoseg.model.topology import ARCHITECTURES as NAMED

    assert sorted(NAMED.values()) == ARCHITECTURES == [PLAIN_UNET, RESIDUAL_ENCODER_UNET]


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("dim,patch", CASES)
def test_forward_backward_with_deep_supervision(dim: int, patch: tuple[int, ...], architecture: str) -> None:
    torch.manual_seed(0)
    net = build_network(topology(dim, architecture=architecture))
    assert type(net) is NETWORKS[architecture]
    x = torch.randn(2, 2, *patch)
    out = net(x)
    assert isinstance(out, list) and len(out) == 2  # num_stages - 1
    assert out[0].shape == (2, 3, *patch)
    assert out[1].shape == (2, 3, *(p // 2 for p in patch))
    sum(o.sum() for o in out).backward()
    for name, p in net.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
    assert all(torch.isfinite(p.grad).all() for p in net.parameters())


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("dim,patch", CASES)
def test_forward_without_deep_supervision_returns_one_tensor(
    dim: int, patch: tuple[int, ...], architecture: str
) -> None:
    net = build_network(topology(dim, deep_supervision=False, architecture=architecture))
    out = net(torch.randn(1, 2, *patch))
    assert isinstance(out, torch.Tensor)
    assert out.shape == (1, 3, *patch)
    conv_type = nn.Conv2d if dim == 2 else nn.Conv3d
    assert any(isinstance(m, conv_type) for m in net.modules())


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_deep_supervision_can_be_toggled_after_construction(architecture: str) -> None:
    torch.manual_seed(0)
    net = build_network(topology(2, features=(4, 8, 16, 16), architecture=architecture)).eval()
    x = torch.randn(1, 2, 32, 32)
    with torch.no_grad():
        outputs = net(x)
        net.deep_supervision = False
        single = net(x)
    assert [tuple(o.shape[2:]) for o in outputs] == [(32, 32), (16, 16), (8, 8)]
    assert isinstance(single, torch.Tensor)
    assert torch.equal(single, outputs[0])  # the full-resolution output does not depend on the flag


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_anisotropic_strides_and_kernels_give_every_stage_its_resolution(architecture: str) -> None:
    topo = topology(
        3,
        strides=((1, 1, 1), (1, 2, 2), (2, 2, 2)),
        kernel_sizes=((1, 3, 3), (3, 3, 3), (3, 3, 3)),
        architecture=architecture,
    )
    net = build_network(topo)
    sizes = []
    handles = [
        stage.register_forward_hook(lambda m, i, o: sizes.append((o.shape[1], tuple(o.shape[2:]))))
        for stage in net.encoder
    ]
    out = net(torch.randn(1, 2, 6, 16, 12))
    for h in handles:
        h.remove()
    assert sizes == [(4, (6, 16, 12)), (8, (6, 8, 6)), (16, (3, 4, 3))]
    assert [tuple(o.shape) for o in out] == [(1, 3, 6, 16, 12), (1, 3, 6, 8, 6)]


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("dim,shape,patch", [(3, (2, 9, 13, 18), (8, 8, 8)), (2, (2, 3, 13, 18), (8, 8))])
def test_sliding_window_runs_the_network_in_eval_mode(
    dim: int, shape: tuple[int, ...], patch: tuple[int, ...], architecture: str
) -> None:
    """Eval mode, no grad: a volume not a multiple of the patch is predicted tile by tile into probabilities that
    sum to one, and a tile equals the network's own full-resolution output there."""
    torch.manual_seed(0)
    net = build_network(topology(dim, features=(4, 8), architecture=architecture)).eval()
    data = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    runners = [TorchTileRunner(net, torch.device("cpu"))]
    window = SlidingWindow(tuple(patch), 3, mirror_axes=tuple(range(dim)), tile_batch_size=2)
    probs = sliding_window_predict(runners, data, window)
    assert probs.shape == (3, *shape[1:]) and torch.isfinite(probs).all()
    assert torch.allclose(probs.sum(0), torch.ones(shape[1:]), atol=1e-5)
    whole = sliding_window_predict(
        runners, data[:, :, :8, :8] if dim == 2 else data[:, :8, :8, :8], SlidingWindow(tuple(patch), 3)
    )
    tile = torch.from_numpy(data[:, :, :8, :8] if dim == 2 else data[None, :, :8, :8, :8])
    with torch.no_grad():
        logits = net(tile.permute(1, 0, 2, 3) if dim == 2 else tile)[0]
    expected = torch.softmax(logits, dim=1)
    expected = expected.permute(1, 0, 2, 3) if dim == 2 else expected[0]
    assert torch.allclose(whole, expected, atol=1e-5)


def test_plain_anisotropic_layout() -> None:
    topo = topology(3, strides=((1, 1, 1), (1, 2, 2), (2, 2, 2)), kernel_sizes=((1, 3, 3), (3, 3, 3), (3, 3, 3)))
    assert topo.patch_divisor() == (2, 4, 4)
    net = build_network(topo)
    out = net(torch.randn(1, 2, 6, 16, 12))
    assert [tuple(o.shape) for o in out] == [(1, 3, 6, 16, 12), (1, 3, 6, 8, 6)]
    first_conv = net.encoder[1][0][0]
    assert first_conv.stride == (1, 2, 2)
    assert net.encoder[0][0][0].kernel_size == (1, 3, 3) and net.encoder[0][0][0].padding == (0, 1, 1)
    assert net.decoder[0].upsample.stride == (1, 2, 2)  # back from stage 1 to stage 0
    assert net.decoder[1].upsample.kernel_size == (2, 2, 2)


def test_stride_one_stage_is_upsampled_by_a_size_preserving_transposed_conv() -> None:
    net = build_network(topology(2, strides=((1, 1), (2, 2), (1, 1)), deep_supervision=False))
    assert net(torch.randn(1, 2, 8, 8)).shape == (1, 3, 8, 8)


def _grads(net: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in net.named_parameters()}


def _count_saved_tensors(net: nn.Module, x: torch.Tensor) -> int:
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = net(x)
    sum(o.sum() for o in out).backward()
    return len(saved)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("dim,patch", CASES)
def test_checkpointing_gives_same_outputs_and_gradients(dim: int, patch: tuple[int, ...], architecture: str) -> None:
    torch.manual_seed(0)
    plain = build_network(topology(dim, architecture=architecture)).train()
    ckpt = build_network(topology(dim, architecture=architecture), checkpointing=True).train()
    ckpt.load_state_dict(plain.state_dict())
    x = torch.randn(2, 2, *patch, requires_grad=True)
    x_ckpt = x.detach().clone().requires_grad_(True)
    out_plain, out_ckpt = plain(x), ckpt(x_ckpt)
    for a, b in zip(out_plain, out_ckpt, strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)
    weights = torch.randn_like(out_plain[0])
    ((out_plain[0] * weights).sum() + out_plain[1].sum()).backward()
    ((out_ckpt[0] * weights).sum() + out_ckpt[1].sum()).backward()
    grads_plain, grads_ckpt = _grads(plain), _grads(ckpt)
    for name in grads_plain:
        assert torch.allclose(grads_plain[name], grads_ckpt[name], atol=1e-6, rtol=1e-4), name
    assert torch.allclose(x.grad, x_ckpt.grad, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_checkpointing_stores_fewer_activations_and_is_off_outside_training(architecture: str) -> None:
    torch.manual_seed(0)
    plain = build_network(topology(2, architecture=architecture)).train()
    ckpt = build_network(topology(2, architecture=architecture), checkpointing=True).train()
    x = torch.randn(1, 2, 16, 16)
    n_plain, n_ckpt = _count_saved_tensors(plain, x), _count_saved_tensors(ckpt, x)
    assert n_ckpt < n_plain / 3  # only stage inputs and the seg heads' tensors stay
    ckpt.eval()  # in eval mode the same graph as without checkpointing is built
    assert _count_saved_tensors(ckpt, x) == n_plain


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("deep_supervision", [False, True])
@pytest.mark.parametrize("autocast", [False, True])
def test_inference_forward_releases_maps_early_and_gives_the_same_logits(
    architecture: str, deep_supervision: bool, autocast: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without autograd the decoder releases each map as soon as it is read (``DecoderStage.forward_releasing``):
    the logits of the autograd forward (bf16 autocast included: the concatenation takes torch.cat's dtype), with
    at least two full-resolution maps fewer alive than ``DecoderStage.forward`` holds without autograd."""
    from autoseg.memory.tracker import StorageTracker
    from autoseg.model.blocks import DecoderStage

    torch.manual_seed(0)
    net = build_network(
        topology(3, features=(8, 16, 32), deep_supervision=deep_supervision, architecture=architecture)
    ).eval()
    x = torch.randn(1, 2, 16, 24, 24)

    def run(grad: bool) -> tuple[list[torch.Tensor], int]:
        tracker = StorageTracker()
        with torch.set_grad_enabled(grad), torch.autocast("cpu", torch.bfloat16, enabled=autocast), tracker:
            out = net(x)
        return [o.detach() for o in (out if deep_supervision else [out])], tracker.peak_bytes

    reference, _ = run(grad=True)
    released, peak = run(grad=False)
    monkeypatch.setattr(
        DecoderStage, "forward_releasing", lambda self, maps, slab_bytes=None: self(maps.pop(), maps.pop())
    )
    held, held_peak = run(grad=False)
    for a, b, c in zip(reference, released, held, strict=True):
        assert a.dtype == b.dtype == c.dtype
        torch.testing.assert_close(b, a, rtol=0, atol=0)
        torch.testing.assert_close(c, a, rtol=0, atol=0)
    full_resolution_map = 8 * 16 * 24 * 24 * (2 if autocast else 4)  # 8 features
    assert peak <= held_peak - 2 * full_resolution_map


def parameter_count(net: nn.Module) -> int:
    return sum(p.numel() for p in net.parameters())


def test_parameter_count_matches_hand_count() -> None:
    topo = NetworkTopology(
        dim=2,
        in_channels=1,
        num_outputs=2,
        features_per_stage=(2, 4),
        kernel_sizes=((3, 3), (3, 3)),
        strides=((1, 1), (2, 2)),
        conv_per_stage=1,
    )
    # encoder 0: conv 1->2 (2*1*9 + 2) + norm (2 + 2) = 24;  encoder 1: conv 2->4 (4*2*9 + 4) + norm 8 = 84
    # decoder 0: transposed 4->2 k2 (4*2*4 + 2) = 34, conv 4->2 (2*4*9 + 2) = 74, norm 4;  seg head 2->2 = 6
    assert parameter_count(build_network(topo)) == 24 + 84 + (34 + 74 + 4) + 6


def test_parameter_count_is_positive_and_grows_with_width() -> None:
    narrow = parameter_count(build_network(topology(3, features=(4, 8, 16))))
    wide = parameter_count(build_network(topology(3, features=(8, 16, 32))))
    assert 0 < narrow < wide


def test_weight_init_is_kaiming_normal_with_zero_bias() -> None:
    torch.manual_seed(0)
    net = build_network(topology(3, features=(16, 32, 32)))
    conv = net.encoder[1][1][0]  # 32 -> 32, 3x3x3: fan_in = 864, 27,648 weights
    expected_std = math.sqrt(2.0 / (1 + 1e-4)) / math.sqrt(32 * 27)
    assert abs(conv.weight.std().item() / expected_std - 1) < 0.05
    for m in net.modules():
        if isinstance(m, (nn.Conv3d, nn.ConvTranspose3d)):
            assert torch.count_nonzero(m.bias) == 0
        if isinstance(m, nn.InstanceNorm3d):
            assert m.affine and m.eps == 1e-5
            assert torch.all(m.weight == 1) and torch.all(m.bias == 0)


def test_build_network_builds_the_architecture_the_plan_names(monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(build_network(topology(2)), NETWORKS["plain_unet"])
    built = []
    monkeypatch.setitem(NETWORKS, "toy", lambda t, checkpointing: built.append((t, checkpointing)) or nn.Identity())
    named = replace(topology(2), architecture="toy")
    assert isinstance(build_network(named, checkpointing=True), nn.Identity) and built == [(named, True)]


def test_unknown_architecture_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"architecture 'resunet'.*plans.json.*plain_unet.*residual_encoder_unet"):
        build_network(replace(topology(2), architecture="resunet"))


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"strides": ((2, 2), (2, 2), (2, 2))}, r"strides\[0\] is \(2, 2\).*all ones"),
        ({"strides": ((1, 1), (2, 2))}, r"3 stages but kernel_sizes has 3 and strides 2"),
        ({"kernel_sizes": ((3, 3), (3,), (3, 3))}, r"kernel_sizes\[1\] is \(3,\); expected 2"),
        ({"kernel_sizes": ((3, 3), (2, 2), (3, 3))}, r"kernel_sizes\[1\].*must be odd"),
        ({"dim": 4}, r"dim is 4"),
        ({"conv_per_stage": 0}, r"conv_per_stage is 0"),
    ],
)
def test_invalid_topology_is_rejected_with_the_field_to_fix(changes: dict, message: str) -> None:
    fields = dict(
        dim=2,
        in_channels=1,
        num_outputs=2,
        features_per_stage=(4, 8, 16),
        kernel_sizes=((3, 3),) * 3,
        strides=((1, 1), (2, 2), (2, 2)),
    )
    with pytest.raises(ValueError, match=message):
        build_network(NetworkTopology(**{**fields, **changes}))


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_bad_input_shape_says_what_to_change(architecture: str) -> None:
    net = build_network(topology(2, architecture=architecture))
    with pytest.raises(ValueError, match=r"\(18, 32\) is not a multiple of \(4, 4\)"):
        net(torch.randn(1, 2, 18, 32))
    with pytest.raises(ValueError, match=r"expected \(B, 2, \.\.\., \.\.\.\)"):
        net(torch.randn(1, 3, 32, 32))
