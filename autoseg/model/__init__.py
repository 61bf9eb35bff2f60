"""The network and THE training step: the topology a plan names, the network registry
(``build_network`` builds ``topology.architecture``), the loss, ``TrainStep`` (the only code that runs a
backward pass: training, the memory model and the throughput calibration all run it), the sliding-window
forward (tile layout, tile batches), the collectives of a multi-process run and the checkpoint file format
(written by training, read by resume and prediction).

Owns: ``topology`` (the architectures a plan may name, ``validate_topology``), ``network`` (the registry),
``blocks`` (the conv block, decoder stage and U-Net skeleton every architecture shares), ``residual`` (the
residual encoder U-Net), ``flops`` (its convolutions' FLOPs from the topology), ``loss``, ``optimizer`` (the
optimizers by name), ``step``, ``sliding_window``, ``window`` (one sliding window's settings, ``SlidingWindow``),
``tile_runner`` (``TileRunner``: what runs a tile batch, and its working bytes), ``torch_runner`` (a torch module as
one), ``tiles`` (tile layout, Gaussian, the accumulator window), ``tile_buffers`` (one sliding window's buffers and
their bytes), ``tta`` (mirror variants, ``--tta``),
``slabs`` (large convolutions in slabs at inference on the CPU), ``cpu_conv`` (which kernel a 3D convolution runs on
the CPU at inference: oneDNN's at any tile batch), ``distributed``, ``checkpoint_file``, ``onnx_graph``
(the network as an ONNX graph, its inputs checked, run with ONNX Runtime or OpenVINO, its agreement with torch),
``graph_runners`` (such a graph as a ``TileRunner``: ONNX Runtime's and OpenVINO's), ``agreement`` (how much an
ensemble's members agree on an image, counted as the window runs, and its bytes).
Imports: ``autoseg.core``, ``autoseg.dataset``. ``topology``, ``flops``, ``optimizer``, ``tiles``, ``tile_buffers``,
``tile_runner``, ``window``, ``tta`` and ``agreement`` import torch only inside the functions that make tensors: the
planner sizes a plan without it. ``onnx_graph`` (which ``graph_runners`` calls) imports the optional extras (onnx,
onnxruntime, openvino) inside its functions.
"""
