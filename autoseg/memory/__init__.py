"""The memory model: bytes of a training step, of inference and of the host-side stages, before running them.

Training and inference are *simulated*: the real network, loss and optimizer run under torch's
``FakeTensorMode`` (tensors with shapes and dtypes but no storage) while a ``StorageTracker`` counts every
new tensor storage until torch frees it. The running maximum is the peak of live tensor bytes, and the
same tracker on real CPU tensors measures the same quantity (``measure_training_step``), so predictions
are testable without a GPU. A device's own overheads (allocator rounding and fragmentation, convolution
workspace, CUDA context) are added by ``predict_device_peak``. ``TrainingMemoryModel`` turns 2-3
simulations into exact predictions for any batch and patch in microseconds, for the planner's search.

Modules: ``tracker`` (the counting dispatch mode), ``training`` (the step, simulated or measured, and its
FLOPs), ``fit`` (the linear timeline model), ``device`` (device overheads), ``inference`` (sliding
window), ``host`` (host RAM formulas).
"""

from __future__ import annotations

from autoseg.memory.device import predict_device_peak
from autoseg.memory.fit import TrainingMemoryModel, predicted_training_bytes, training_memory_model
from autoseg.memory.host import export_bytes, preprocess_worker_bytes
from autoseg.memory.inference import InferenceMemory, inference_memory, measure_inference_bytes
from autoseg.memory.tracker import StorageTracker
from autoseg.memory.training import (
    TrainingMemory,
    measure_training_step,
    simulate_training_step,
    training_step_flops,
)

__all__ = [
    "InferenceMemory",
    "StorageTracker",
    "TrainingMemory",
    "TrainingMemoryModel",
    "export_bytes",
    "inference_memory",
    "measure_inference_bytes",
    "measure_training_step",
    "predict_device_peak",
    "predicted_training_bytes",
    "preprocess_worker_bytes",
    "simulate_training_step",
    "training_memory_model",
    "training_step_flops",
]
