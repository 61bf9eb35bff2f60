"""From live tensor bytes to what a device shows: a small model of the runtime's own costs.

The simulation counts tensor bytes exactly. A CUDA device holds more; the terms below are a starting
model (see docs and shared/notes/memory-simulation.md), to be calibrated on a real GPU:

- ``allocator_rounding``: the caching allocator rounds every allocation up to 512 bytes; on average half a
  block per live allocation (about 0.001% of a U-Net's peak).
- ``fragmentation``: reserved / allocated of the caching allocator, ``CUDA_FRAGMENTATION = 1.15`` of the (rounded)
  tensor bytes: the middle of what a replay of this kind of allocation sequence gives (docs/memory.md section 3).
- ``conv_workspace``: cuDNN's scratch space. Placeholder: the largest convolution output of the step in
  its compute dtype (the algorithms torch picks rarely ask for more than that).
- ``cuda_context``: the CUDA context, cuBLAS/cuDNN handles and kernels, about 0.5 GiB.

On CPU: tensors + ``fragmentation``, what glibc's heap keeps of freed tensors beyond the live ones at the peak
(``autoseg.memory.glibc_heap``, replayed over the simulated step or tile) + the process's runtime (interpreter,
torch libraries) above the tensor peak, ``CPU_RUNTIME_BYTES`` (its measurement: docs/memory.md section 3).
"""

from __future__ import annotations

from typing import Protocol

from autoseg.core.errors import InputError
from autoseg.core.units import MiB

CUDA_BLOCK_BYTES = 512
CUDA_FRAGMENTATION = 1.15
CUDA_CONTEXT_BYTES = 512 * MiB
CPU_RUNTIME_BYTES = 150 * MiB
DEVICES = ("cuda", "cpu")


class PeakMemory(Protocol):
    """What ``predict_device_peak`` needs: ``TrainingMemory`` and ``InferenceMemory`` both provide it."""

    peak_bytes: int
    largest_conv_output_bytes: int
    live_allocations_at_peak: int
    heap_retained_bytes: int  # CPU: what glibc's heap holds beyond the tensors at the peak (0: not modelled)


# the terms predict_device_peak adds to the tensors, for a CUDA device or the CPU
DEVICE_TERMS = ("allocator_rounding", "fragmentation", "conv_workspace", "cuda_context", "runtime")


def predict_device_peak(memory: PeakMemory, device: str = "cuda") -> dict[str, int]:
    """Device bytes at the peak, by term, with their ``total``.

    cuda: ``tensors``, ``allocator_rounding``, ``fragmentation``, ``conv_workspace``, ``cuda_context``.
    cpu: ``tensors``, ``fragmentation`` (glibc's, ``memory.heap_retained_bytes``), ``runtime``.
    """
    if device not in DEVICES:
        raise InputError(f"device {device!r} is not modelled; use one of {list(DEVICES)}")
    tensors = int(memory.peak_bytes)
    if device == "cpu":
        terms = {"tensors": tensors, "fragmentation": int(memory.heap_retained_bytes), "runtime": CPU_RUNTIME_BYTES}
    else:
        rounding = int(memory.live_allocations_at_peak) * CUDA_BLOCK_BYTES // 2
        terms = {
            "tensors": tensors,
            "allocator_rounding": rounding,
            "fragmentation": int((CUDA_FRAGMENTATION - 1.0) * (tensors + rounding)),
            "conv_workspace": int(memory.largest_conv_output_bytes),
            "cuda_context": CUDA_CONTEXT_BYTES,
        }
    terms["total"] = sum(terms.values())
    return terms
