"""The memory model: bytes of a training step, of inference and of the host-side stages, before running them.

Training and inference are *simulated*: the model package's own ``TrainStep`` and sliding window run under
torch's ``FakeTensorMode`` (tensors with shapes and dtypes but no storage) while a ``StorageTracker`` counts
every new tensor storage until torch frees it. The running maximum is the peak of live tensor bytes, and the
same tracker on real CPU tensors measures the same step (``measure_training_step``), so predictions are
testable without a GPU. A device's own overheads (allocator rounding and fragmentation, convolution
workspace, CUDA context) are added by ``device.predict_device_peak``. ``fit.TrainingMemoryModel`` turns 2-3
simulations into exact predictions for any batch and patch in microseconds, for the planner's search.

Owns: ``tracker`` (the counting dispatch mode), ``training`` (the step, simulated or measured, and its
FLOPs), ``fit`` (the linear timeline model), ``device`` (device overheads), ``inference`` (sliding
window), ``host`` (host RAM formulas of preprocessing, loader workers and export).
Imports: ``autoseg.model``, ``autoseg.dataset``, ``autoseg.core``; never a stage.
"""
