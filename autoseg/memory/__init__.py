"""The memory model: bytes of a training step, of inference and of the host-side stages, before running them.

Training and inference are *simulated*: the model package's own ``TrainStep`` and sliding window run under
torch's ``FakeTensorMode`` (tensors with shapes and dtypes but no storage) while a ``StorageTracker`` counts
every new tensor storage until torch frees it. The running maximum is the peak of live tensor bytes, and the
same tracker on real CPU tensors measures the same step (``measure_training_step``), so predictions are
testable without a GPU. A device's own overheads (allocator rounding and fragmentation, convolution
workspace, CUDA context) are added by ``device.predict_device_peak``. ``fit.TrainingMemoryModel`` turns 2-3
simulations into exact predictions for any batch and patch in microseconds, for the planner's search.

Owns: ``tracker`` (the counting dispatch mode), ``step_record`` (a step's configuration, record and memory, as
data), ``training`` (the step's memory, simulated or measured, and the simulations kept between runs),
``training_simulation`` (running the step in the tracker, and its FLOPs), ``autocast_policy`` (CUDA autocast's
op dtypes where CPU autocast's differ, for simulating a CUDA step on CPU tensors), ``fit`` (the linear timeline model),
``device`` (device overheads), ``glibc_heap`` (what glibc's malloc keeps of a CPU step's freed tensors, replayed
over its trace), ``inference`` (sliding window), ``inference_plan`` (its tile batch and accumulator chosen within a
budget) and ``inference_simulation`` (running its tile batch in the tracker), ``host`` (host RAM formulas of
preprocessing, prediction's reading and export), ``loader_worker`` (host RAM of a training loader worker: its batch
in flight, kept heap, batch slots and caches). Only the ``*_simulation`` modules, ``autocast_policy`` and
``tracker`` import torch: a plan whose simulations are all kept between runs imports none of them.
Imports: ``autoseg.model``, ``autoseg.dataset``, ``autoseg.core``; never a stage.
"""
