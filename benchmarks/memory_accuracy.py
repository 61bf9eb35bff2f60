"""How well the memory model predicts a training step, on realistic network sizes (run by hand, ~4 min).

For each configuration: the simulated peak of live tensor bytes (FakeTensorMode), the same step run for
real on CPU and measured with the same storage tracker, the error; the fitted model's prediction
(``TrainingMemoryModel``, from 2-3 simulations) against the direct simulation; and the predicted CUDA total
(``predict_device_peak``), which needs a GPU to check.

    python benchmarks/memory_accuracy.py [--threads N] [--quick] [--architecture unet|resenc]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch

from autoseg.core.units import MiB
from autoseg.memory.device import predict_device_peak
from autoseg.memory.fit import TrainingMemoryModel
from autoseg.memory.step_record import StepConfig
from autoseg.memory.training import measure_training_step, simulate_training_step
from autoseg.model.topology import ARCHITECTURES, NetworkTopology, preset_fields


def unet(
    dim: int,
    stages: int,
    strides: list[tuple[int, ...]] | None = None,
    kernels: list[tuple[int, ...]] | None = None,
    base: int = 32,
    cap: int = 320,
    in_channels: int = 1,
    num_outputs: int = 3,
) -> NetworkTopology:
    strides = strides or [(1,) * dim] + [(2,) * dim] * (stages - 1)
    kernels = kernels or [(3,) * dim] * stages
    return NetworkTopology(
        dim=dim,
        in_channels=in_channels,
        num_outputs=num_outputs,
        features_per_stage=tuple(min(base * 2**s, cap) for s in range(stages)),
        kernel_sizes=tuple(kernels),
        strides=tuple(strides),
    )


ANISO = unet(
    3,
    6,
    strides=[(1, 1, 1), (1, 2, 2), (2, 2, 2), (2, 2, 2), (2, 2, 2), (1, 2, 2)],
    kernels=[(1, 3, 3)] + [(3, 3, 3)] * 5,
    in_channels=2,
    num_outputs=4,
)
CONFIGS = [  # name, topology, batch, patch, keyword arguments
    ("3d 5 stages 64^3 b2 fp32", unet(3, 5), 2, (64, 64, 64), {}),
    ("3d 5 stages 64^3 b2 checkpointing", unet(3, 5), 2, (64, 64, 64), {"checkpointing": True}),
    # bf16 on a CPU without native bf16 runs at ~1 GFLOP/s: a small network and patch keep the run short
    ("3d 4 stages 32^3 b2 bf16", unet(3, 4), 2, (32, 32, 32), {"precision": "bf16"}),
    ("3d 6 stages 96^3 b1 fp32", unet(3, 6), 1, (96, 96, 96), {}),
    ("3d aniso 6 stages 32x128x128 b1 2ch", ANISO, 1, (32, 128, 128), {}),
    ("2d 7 stages 512^2 b2 fp32 (cap 512)", unet(2, 7, cap=512), 2, (512, 512), {}),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--quick", action="store_true", help="only the first two configurations")
    parser.add_argument(
        "--architecture",
        choices=sorted(ARCHITECTURES),
        default="unet",
        help="the same shapes as a residual encoder U-Net (resenc) instead of a plain one",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"{'configuration':40s} {'predicted':>10s} {'measured':>10s} {'error':>9s} {'diff B':>7s} {'fitted':>10s} "
        f"{'fit err':>8s} {'CUDA':>9s}  {'sim s':>5s} {'fit s':>5s} {'query':>7s} {'real s':>6s}  peak in"
    )
    for name, topology, batch, patch, kwargs in CONFIGS[:2] if args.quick else CONFIGS:
        architecture = ARCHITECTURES[args.architecture]
        topology = replace(topology, **preset_fields(architecture, topology.num_stages))
        name += "" if args.architecture == "unet" else f" {args.architecture}"
        t0 = time.perf_counter()
        predicted = simulate_training_step(StepConfig(topology, batch, patch, **kwargs))
        t1 = time.perf_counter()
        model = TrainingMemoryModel(topology, **kwargs)
        model.peak_bytes(batch, patch)  # fits (2-3 simulations)
        t2 = time.perf_counter()
        fitted = model.peak_bytes(batch, patch)
        t3 = time.perf_counter()
        measured = measure_training_step(StepConfig(topology, batch, patch, **kwargs))
        t4 = time.perf_counter()
        cuda = predict_device_peak(predicted, "cuda")["total"]
        error = 100 * (predicted.peak_bytes - measured) / measured
        fit_error = 100 * (fitted - predicted.peak_bytes) / predicted.peak_bytes
        print(
            f"{name:40s} {predicted.peak_bytes / MiB:10.1f} {measured / MiB:10.1f} {error:+8.4f}% "
            f"{predicted.peak_bytes - measured:+7d} "
            f"{fitted / MiB:10.1f} {fit_error:+7.4f}% {cuda / MiB:9.0f}  {t1 - t0:5.2f} {t2 - t1:5.2f} "
            f"{(t3 - t2) * 1e6:5.0f}us {t4 - t3:6.1f}  {predicted.peak_phase}",
            flush=True,
        )
    print(
        "sizes in MiB; error = (predicted - measured) / measured; fit err = fitted vs direct simulation;"
        " CUDA = predicted device total (tensors + allocator + workspace + context)"
    )


if __name__ == "__main__":
    main()
