"""``cpu_conv_scratch_bytes`` against the peak RSS of real CPU convolutions (oneDNN's hidden copies).

Each convolution runs in a fresh process whose allocator returns every large block to the system at once
(``MALLOC_MMAP_THRESHOLD_``), once to warm up, then again after the peak RSS is reset (``reset_peak_rss``):
the peak above the RSS before the call, less the output, is what the convolution held beyond its tensors.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CASES = [  # name, input shape, weight shape, transposed, stride, measured backward too (training)
    (
        "3D 32 -> 32 (max of input and output; backward: the sum)",
        (1, 32, 16, 64, 64),
        (32, 32, 3, 3, 3),
        False,
        1,
        True,
    ),
    ("3D 64 -> 32 (its input)", (1, 64, 16, 48, 48), (32, 64, 3, 3, 3), False, 1, True),
    ("3D 4 -> 32 (im2col)", (1, 4, 16, 48, 48), (32, 4, 3, 3, 3), False, 1, True),
    ("3D 8 -> 16, 1x3x3 kernel (im2col)", (1, 8, 16, 48, 48), (16, 8, 1, 3, 3), False, 1, False),
    ("3D 32 -> 3 head (output channels in blocks of 16)", (1, 32, 16, 64, 64), (3, 32, 1, 1, 1), False, 1, True),
    ("3D transposed 64 -> 32 (twice its output)", (1, 64, 8, 48, 48), (64, 32, 2, 2, 2), True, 2, True),
    ("2D 1 -> 32 (no im2col in 2D)", (1, 1, 384, 384), (32, 1, 3, 3), False, 1, False),
    ("2D 32 -> 5 head", (1, 32, 384, 384), (5, 32, 1, 1), False, 1, True),
]
# inference on the CPU calls oneDNN directly (autoseg.model.cpu_conv): no im2col at a batch of 1, any channels
ONEDNN_CASES = [
    ("oneDNN 3D 1 -> 8 (output channels in blocks of 16)", (1, 1, 16, 64, 64), (8, 1, 3, 3, 3), False, 1, False),
    ("oneDNN 3D 4 -> 32 (its output)", (1, 4, 16, 48, 48), (32, 4, 3, 3, 3), False, 1, False),
    ("oneDNN 3D 16 -> 16, a small tile (its output)", (1, 16, 8, 64, 64), (16, 16, 3, 3, 3), False, 1, False),
    ("oneDNN 3D 2 -> 32 (its output)", (1, 2, 32, 112, 112), (32, 2, 3, 3, 3), False, 1, False),
]

_MEASURE = r"""
import json, sys
import torch
from torch.nn import functional as F
from autoseg.core.resources import peak_rss_bytes, process_rss_bytes, reset_peak_rss
from autoseg.memory.tracker import cpu_conv_scratch_bytes
from autoseg.model.cpu_conv import conv3d_onednn

torch.set_num_threads(2)
results = []
backward, onednn = sys.argv[2] == "backward", sys.argv[2] == "onednn"
for name, x_shape, w_shape, transposed, stride, _ in json.loads(sys.argv[1]):
    x, w = torch.randn(x_shape, requires_grad=backward), (torch.randn(w_shape) * 0.01).requires_grad_(backward)
    dim = len(x_shape) - 2
    if transposed:
        conv = [F.conv_transpose2d, F.conv_transpose3d][dim - 2]
        run = lambda: conv(x, w, stride=stride)
    elif onednn:
        run = lambda: conv3d_onednn(x, w, None, [1, 1, 1], [k // 2 for k in w_shape[2:]], [1, 1, 1], 1)
    else:
        conv = [F.conv2d, F.conv3d][dim - 2]
        run = lambda: conv(x, w, padding=tuple(k // 2 for k in w_shape[2:]))
    if backward:  # what the backward adds beyond the input's and the weight's gradients
        for _ in range(2):  # the first to warm up
            out = run()
            grad = torch.ones_like(out)
            x.grad = w.grad = None
            before = process_rss_bytes()
            reset_peak_rss()
            out.backward(grad)
            measured = peak_rss_bytes() - before - (x.numel() + w.numel()) * 4
    else:
        with torch.no_grad():
            run()  # warm up: oneDNN's primitives and caches
            before = process_rss_bytes()
            reset_peak_rss()
            out = run()
            measured = peak_rss_bytes() - before - out.numel() * out.element_size()
    results.append([name, measured, cpu_conv_scratch_bytes(x, w, out, transposed, backward, onednn)])
    del x, w, out
print(json.dumps(results))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc peak-RSS reset")
@pytest.mark.parametrize("direction", ["forward", "backward", "onednn"])
def test_the_modelled_cpu_convolution_scratch_matches_the_measured_peak_rss(direction):
    """``onednn``: the forward as inference runs it on the CPU (``conv3d_onednn``)."""
    cases = {"forward": CASES, "backward": [case for case in CASES if case[-1]], "onednn": ONEDNN_CASES}[direction]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "2"}
    done = subprocess.run(
        [sys.executable, "-c", _MEASURE, json.dumps(cases), direction],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    )
    results = json.loads(done.stdout.strip().splitlines()[-1])
    off = {
        name: (measured, modelled)
        for name, measured, modelled in results
        if abs(measured - modelled) > 0.05 * modelled + 256 * 1024
    }
    assert not off, off  # bytes measured vs modelled, per convolution
