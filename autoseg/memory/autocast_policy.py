"""CUDA autocast's op policy, emulated where a simulation runs a CUDA step on CPU tensors.

The memory model simulates a CUDA step on fake CPU tensors, so torch applies CPU autocast's policy: which ops run
in the low-precision dtype, which in fp32. The two policies agree on everything our networks and losses run but
``avg_pool3d`` (the residual encoder's 3D skip path): CPU autocast casts its input to fp32, and autograd then
keeps that fp32 copy of the block's input for the pool's backward; CUDA autocast runs the pool in its input's
dtype. Measured on an H200 (ResEnc, Task03_Liver, 8 GiB plan, 80x128x160, batch 2, fp16): the simulated
activations after the forward were 0.46 GiB (11%) above ``torch.cuda.memory_allocated``, and the step's peak 9-11%
above ``max_memory_allocated``, while the U-Net and the 2D ResEnc (``avg_pool2d`` follows the input's dtype on
both) were within 1% (docs/benchmarks.md, "GPU check"). ``cuda_autocast_policy`` runs the listed ops with autocast
off, so their inputs keep the dtype the previous op gave them, as on CUDA.

The list comes from a trace of every op the four networks (U-Net, ResEnc; 2D, 3D) and the loss run under CPU fp16
autocast, each op's input and output dtypes against CUDA autocast's lists (session 21). An op added to the
networks that the two policies treat differently would show up as a simulated/measured gap on the GPU check;
``tests/memory/test_autocast_policy.py`` holds eight plans' simulations against an H200's measurement.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

# ops CPU autocast runs in fp32 whatever their input, which CUDA autocast leaves in the input's dtype
# (names in torch.nn.functional, which the modules call)
CPU_ONLY_FP32_OPS = frozenset({"avg_pool3d"})


def _in_input_dtype(op: Callable) -> Callable:
    @functools.wraps(op)
    def run(*args, **kwargs):
        with torch.autocast("cpu", enabled=False):
            return op(*args, **kwargs)

    return run


@contextlib.contextmanager
def cuda_autocast_policy(device: str) -> Iterator[None]:
    """Inside: CPU autocast behaves as CUDA autocast for ``CPU_ONLY_FP32_OPS`` when ``device`` is a CUDA device
    ("cuda", "cuda:1"); anything else runs as it is.

    The ops are swapped in ``torch.nn.functional`` for the duration (the process's, not a thread's: the
    simulations run one at a time), not intercepted by a ``TorchFunctionMode``: activation checkpointing
    recomputes a block in backward outside such a mode, and the recomputed dtypes must match the forward's."""
    if not device.startswith("cuda"):
        yield
        return
    originals = {name: getattr(F, name) for name in CPU_ONLY_FP32_OPS}
    for name, op in originals.items():
        setattr(F, name, _in_input_dtype(op))
    try:
        yield
    finally:
        for name, op in originals.items():
            setattr(F, name, op)
