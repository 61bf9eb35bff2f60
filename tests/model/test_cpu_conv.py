"""Inference's CPU convolutions through oneDNN at a tile batch of 1 (``autoseg.model.cpu_conv``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from autoseg.model.cpu_conv import ONEDNN_CONV_OP, conv3d, onednn_convolutions
from autoseg.model.network import build_network
from autoseg.model.torch_runner import TorchTileRunner
from tests.factories import tiny_topology


class _OpNames(TorchDispatchMode):
    """The names of the operators dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _convolutions(names: list[str]) -> tuple[int, int]:
    """(oneDNN calls, torch's own convolutions) among ``names``."""
    onednn = sum(n.startswith(ONEDNN_CONV_OP) for n in names)
    return onednn, sum(n.startswith(("convolution", "conv3d")) for n in names) - onednn


@pytest.mark.parametrize(
    ("stride", "padding", "dilation", "kernel"),
    [((1, 1, 1), (1, 1, 1), (1, 1, 1), (3, 3, 3)), ((1, 2, 2), (0, 1, 1), (1, 1, 1), (1, 3, 3)), (2, 2, 2, (3, 3, 3))],
)
def test_the_onednn_call_equals_torch_s_convolution_and_its_shape_function(stride, padding, dilation, kernel):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(1, 3, 6, 10, 12, generator=g), torch.randn(5, 3, *kernel, generator=g)
    b = torch.randn(5, generator=g)
    as_list = [tuple(v) if isinstance(v, tuple) else (v,) * 3 for v in (stride, padding, dilation)]
    expected = F.conv3d(x, w, b, *as_list)
    with torch.inference_mode(), _OpNames() as ops:
        got = conv3d(x, w, b, *as_list, 1)
    assert _convolutions(ops.names) == (1, 0)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    with FakeTensorMode(), torch.no_grad():  # the inference plan's simulation runs it on fake tensors
        fake = conv3d(torch.empty(1, 3, 6, 10, 12), torch.empty(5, 3, *kernel), None, *as_list, 1)
    assert fake.shape == expected.shape and fake.dtype == torch.float32


def test_the_torch_runner_runs_every_3d_convolution_through_onednn_at_a_batch_of_1():
    network = build_network(tiny_topology(3)).eval()
    x = torch.randn(1, 1, 8, 16, 16)
    with torch.inference_mode():
        expected = network(x)[0]
    runner = TorchTileRunner(network, torch.device("cpu"))
    with _OpNames() as ops:
        got = runner(x)
    onednn, others = _convolutions(ops.names)
    assert onednn == sum(type(m) is nn.Conv3d for m in network.modules()) and others == 0
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert not any("_conv_forward" in vars(m) for m in network.modules())  # torch's own forward again afterwards


@pytest.mark.parametrize("where", ["autograd", "bf16 autocast", "cuda device"])
def test_training_autocast_and_other_devices_keep_torch_s_convolution(where):
    network = build_network(tiny_topology(3))
    x = torch.randn(2, 1, 8, 16, 16)
    device = "cuda" if where == "cuda device" else "cpu"  # the modules stay on the CPU: only the choice is tested
    grad = torch.enable_grad() if where == "autograd" else torch.no_grad()
    cast = torch.autocast("cpu", torch.bfloat16) if where == "bf16 autocast" else torch.autocast("cpu", enabled=False)
    with onednn_convolutions([network], device), grad, cast, _OpNames() as ops:
        network(x)
    onednn, others = _convolutions(ops.names)
    assert onednn == 0 and others > 0
