from __future__ import annotations

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from autoseg.core.units import GiB
from autoseg.model.topology import NetworkTopology
from autoseg.plan.calibration import training_step_closure
from autoseg.plan.throughput import GPUS, conv_flops, cuda_flops_per_second, gpu_spec, mapped_bytes, step_elements


def test_gpu_names_match_the_table() -> None:
    assert gpu_spec("NVIDIA A100-SXM4-80GB", 80 * GiB) == (gpu_spec("A100", 0)[0], True)
    assert gpu_spec("NVIDIA A100-PCIE-40GB", 40 * GiB)[0].memory_gib == 40
    assert gpu_spec("Tesla T4", 15 * GiB)[0].tensor_tflops == 65.0
    assert gpu_spec("NVIDIA GeForce RTX 4090", 24 * GiB)[0].fp32_tflops == 82.6
    assert gpu_spec("NVIDIA H100 80GB HBM3", 80 * GiB)[0].name == "NVIDIA H100"


def test_unknown_gpu_is_the_smallest_listed_one_with_that_memory() -> None:
    spec, matched = gpu_spec(None, 24 * GiB)
    assert not matched and spec.memory_gib == 24
    assert gpu_spec("Some Future GPU", 8 * 10**9)[0].name == "NVIDIA GeForce RTX 3070"  # "8 GB" is 7.45 GiB
    assert gpu_spec(None, 1024 * GiB)[0] == GPUS[-1]
    amp, fp32 = cuda_flops_per_second(spec, "fp16"), cuda_flops_per_second(spec, "fp32")
    assert amp == pytest.approx(spec.tensor_tflops * 1e12 * 0.15) and fp32 == pytest.approx(spec.fp32_tflops * 0.5e12)


def _topologies() -> dict[str, tuple[NetworkTopology, tuple[int, ...], int]]:
    return {
        "3d": (
            NetworkTopology(
                dim=3,
                in_channels=1,
                num_outputs=3,
                features_per_stage=(4, 8),
                kernel_sizes=((3, 3, 3), (3, 3, 3)),
                strides=((1, 1, 1), (2, 2, 2)),
            ),
            (8, 16, 16),
            2,
        ),
        "3d_anisotropic": (
            NetworkTopology(
                dim=3,
                in_channels=2,
                num_outputs=4,
                features_per_stage=(4, 8, 16),
                kernel_sizes=((1, 3, 3), (3, 3, 3), (3, 3, 3)),
                strides=((1, 1, 1), (1, 2, 2), (2, 2, 2)),
            ),
            (8, 16, 16),
            1,
        ),
        "2d": (
            NetworkTopology(
                dim=2,
                in_channels=1,
                num_outputs=2,
                features_per_stage=(4, 8, 16),
                kernel_sizes=((3, 3), (3, 3), (3, 3)),
                strides=((1, 1), (2, 2), (2, 2)),
            ),
            (32, 32),
            2,
        ),
    }


@pytest.mark.parametrize("name", list(_topologies()))
def test_conv_flops_counts_the_convolutions_torch_runs(name: str) -> None:
    """Forward: exactly torch's count of the convolution FLOPs (deep-supervision heads included); the whole
    step (x3 for backward) within 2% of it."""
    topology, patch_size, batch_size = _topologies()[name]
    step = training_step_closure(topology, patch_size, batch_size)
    with FlopCounterMode(display=False) as counter:
        step()
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    predicted = conv_flops(topology, patch_size, batch_size)
    assert counts["aten.convolution"] == pytest.approx(predicted / 3, rel=1e-9)
    assert counter.get_total_flops() == pytest.approx(predicted, rel=0.02)


@pytest.mark.parametrize("name", list(_topologies()))
def test_feature_map_elements_are_the_outputs_of_the_convolutions_torch_runs(name: str) -> None:
    """The elements of ``StepRates``' second term: the outputs of every convolution of the forward pass (transposed
    ones included), the 1x1 segmentation heads not counted."""
    from autoseg.model.network import build_network

    topology, patch_size, batch_size = _topologies()[name]
    network = build_network(topology)
    outputs = []
    for module in network.modules():
        if isinstance(module, torch.nn.modules.conv._ConvNd) and set(module.kernel_size) != {1}:
            module.register_forward_hook(lambda _m, _i, out: outputs.append(out.numel()))
    network(torch.zeros(batch_size, topology.in_channels, *patch_size))
    assert step_elements(topology, patch_size, batch_size) == sum(outputs)


@pytest.mark.parametrize(
    "dim, threshold_of_stage_0",
    [(3, 0.75), (3, 1.5), (2, 0.75), (2, 1.5), (3, 2.5)],
    ids=["3d_stage_0_mapped", "3d_concat_only", "2d_stage_0_mapped", "2d_concat_only", "3d_none"],
)
def test_mapped_bytes_are_the_step_s_blocks_over_the_mmap_threshold(dim: int, threshold_of_stage_0: float) -> None:
    """The bytes a real training step allocates in blocks of at least the mmap threshold (counted by StorageTracker;
    glibc maps those afresh on every step), within 5%: the threshold set relative to stage 0's feature map (here
    tiny, so the step is small) to cover the three cases: stage 0's maps over it, only its concatenation with the
    skip, nothing."""
    from autoseg.memory.tracker import StorageTracker

    kernel, stride = (3,) * dim, (2,) * dim
    topology = NetworkTopology(
        dim=dim,
        in_channels=1,
        num_outputs=3,
        features_per_stage=(16, 32, 64),
        kernel_sizes=(kernel,) * 3,
        strides=((1,) * dim, stride, stride),
    )
    patch, batch = ((8, 32, 32) if dim == 3 else (64, 64)), 2
    threshold = int(threshold_of_stage_0 * 16 * math.prod(patch) * batch * 4)
    step = training_step_closure(topology, patch, batch)
    step()  # the first step creates the optimizer state
    tracker = StorageTracker()
    with tracker:
        step()
    tracked = sum(d for d, kind in zip(tracker.event_delta, tracker.event_kind) if kind == 1 and d >= threshold)
    predicted = mapped_bytes(topology, patch, batch, threshold=threshold)
    assert predicted == pytest.approx(tracked, rel=0.05)
    assert (predicted > 0) == (threshold_of_stage_0 < 2)
