"""Live tensor bytes over time, counted at the dispatcher: every new storage once, until it is freed.

``StorageTracker`` is a ``TorchDispatchMode``. After each operator it looks at the storages of the outputs;
a storage it has not seen is counted (its ``nbytes``) and watched with a weak reference whose callback
subtracts it again when torch frees the storage. Views and in-place results share a storage and cost
nothing. The same tracker runs under ``FakeTensorMode`` (no memory is allocated, only shapes and dtypes
exist) and on real CPU tensors, so a prediction can be held against a measurement of the same code.

What it cannot see: memory that never becomes a tensor visible at the dispatcher, e.g. a CPU kernel's
private scratch buffers, cuDNN workspaces, or the caching allocator's rounding and fragmentation (those
are modelled in ``autoseg.memory.device``). The CPU convolutions' hidden buffers can be counted as a modelled
allocation alive during each convolution (``cpu_conv_scratch``: ``cpu_conv_scratch_bytes``).

The record is an event list: event ``i`` changes storage ``storage[i]`` (numbered in order of first
sight) by ``delta[i]`` bytes (> 0 allocation, < 0 free, a resize either way). ``marks`` name event
indices (phases of a training step), so the timeline of live bytes can be cut into phases afterwards.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from autoseg.model.cpu_conv import ONEDNN_CONV_OP

NETWORK_TAG = "network"  # tensors created in a forward pass outside any tagged module
# ONEDNN_CONV_OP: inference's direct call of oneDNN (autoseg.model.cpu_conv), never im2col
_CONV_NAMES = ("convolution", "_convolution", "conv1d", "conv2d", "conv3d", "conv_transpose", ONEDNN_CONV_OP)
IM2COL_MAX_CHANNELS = 8  # torch's 3D convolutions with 1 to 8 input channels run through im2col on the CPU
CHANNEL_BLOCK = 16  # oneDNN computes a convolution's output channels in blocks of this many


def cpu_conv_scratch_bytes(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    transposed: bool,
    backward: bool = False,
    onednn: bool = False,
) -> int:
    """The bytes a CPU convolution holds beyond its input and output while it runs (oneDNN's copies), as measured
    on torch 2.13's CPU wheel (peak RSS above the output, ``tests/memory/test_conv_scratch.py``; docs/memory.md
    section 4): a transposed convolution twice its output (a small output is held only once); a 3D one with at
    most ``IM2COL_MAX_CHANNELS`` input channels an im2col buffer (C_in x kernel volume x output voxels); any other
    max(input, output) plus the output's channels rounded up to ``CHANNEL_BLOCK`` (a 32-channel map into a
    2-channel head: the map + 16 channels of the head's output). ``backward`` (``out`` the forward's output, i.e.
    the gradient's shape): the same im2col buffer, else input + output + that channel padding, a transposed one's
    too (blocked copies of the input and the output's gradient). ``onednn``: oneDNN called directly
    (``autoseg.model.cpu_conv.conv3d_onednn``, inference): never im2col, whatever the channels and the batch."""
    out_bytes, in_bytes = out.numel() * out.element_size(), x.numel() * x.element_size()
    per_channel = out_bytes // out.shape[1]
    if not onednn and not transposed and x.ndim == 5 and x.shape[1] <= IM2COL_MAX_CHANNELS:
        return x.shape[1] * weight[0, 0].numel() * per_channel
    if transposed and not backward:
        return 2 * out_bytes
    padding = 0 if transposed else -out.shape[1] % CHANNEL_BLOCK * per_channel
    return (in_bytes + out_bytes if backward else max(in_bytes, out_bytes)) + padding


class StorageTracker(TorchDispatchMode):
    """Count live storage bytes while active (``with tracker:``); see the module docstring.

    Attributes: ``live_bytes`` and ``peak_bytes`` (running), ``sizes[n]`` bytes and ``tags[n]`` module tag of
    storage ``n``, the event lists ``event_storage`` / ``event_delta``, ``marks`` (name -> event index;
    a repeated name keeps every index in ``mark_list``), and ``largest_conv_output_bytes`` (the largest
    forward convolution output seen, in its own dtype). ``cpu_conv_scratch``: count ``cpu_conv_scratch_bytes``
    as alive while each convolution runs, forward and backward (beside its inputs and outputs).
    """

    def __init__(self, cpu_conv_scratch: bool = False) -> None:
        super().__init__()
        self.cpu_conv_scratch = cpu_conv_scratch
        self.live_bytes = 0
        self.peak_bytes = 0
        self.sizes: list[int] = []
        self.tags: list[str | None] = []
        self.event_storage: list[int] = []
        self.event_delta: list[int] = []
        self.event_kind: list[int] = []  # +1 allocation, -1 free, 0 resize
        self.mark_list: list[tuple[str, int]] = []
        self.largest_conv_output_bytes = 0
        self.tagging = False  # tag new storages with the module stack (forward passes only)
        self.paused = False  # while True, operators run untracked (e.g. a data loader's own work)
        self._module_stack: list[str] = []
        self._refs: dict[int, tuple[weakref.ref, int]] = {}  # id(storage) -> (weak ref, storage number)
        self._excluded: set[int] = set()

    # --- recording ---------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.paused:
            return out
        name = func.__name__
        # inference_mode dispatches aten::conv2d/conv3d (not decomposed into aten::convolution)
        is_conv = name.startswith(_CONV_NAMES) and "backward" not in name
        fp32_stats = "batch_norm" in name and "backward" not in name
        for i, t in enumerate(tree_flatten(out)[0]):
            if not isinstance(t, torch.Tensor):
                continue
            nbytes = None
            if fp32_stats and i in (1, 2) and t.dtype in (torch.bfloat16, torch.float16):
                # saved mean / inverse std: fp32 in the CPU and CUDA kernels, bf16 in the fake (meta) kernel
                nbytes = t.numel() * 4
            self._see(t, nbytes)
            if is_conv and i == 0:
                conv_bytes = t.numel() * t.element_size()
                self.largest_conv_output_bytes = max(self.largest_conv_output_bytes, conv_bytes)
                if self.cpu_conv_scratch:
                    transposed = name.startswith("conv_transpose") or (name.startswith(_CONV_NAMES[:2]) and args[6])
                    onednn = name.startswith(ONEDNN_CONV_OP)
                    self._transient(cpu_conv_scratch_bytes(args[0], args[1], t, bool(transposed), onednn=onednn))
        if self.cpu_conv_scratch and name.startswith("convolution_backward"):
            # (grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed, ...)
            self._transient(cpu_conv_scratch_bytes(args[1], args[2], args[0], bool(args[7]), backward=True))
        return out

    def _transient(self, nbytes: int) -> None:
        """A modelled allocation that is alive for an instant (counted in the peak, then freed)."""
        number = len(self.sizes)
        self.sizes.append(nbytes)
        self.tags.append(self._current_tag())
        self._event(number, nbytes, 1)
        self._event(number, -nbytes, -1)

    def _see(self, t: torch.Tensor, nbytes: int | None = None) -> None:
        storage = t.untyped_storage()
        key = id(storage)
        entry = self._refs.get(key)
        if entry is not None and entry[0]() is storage:
            number = entry[1]
            grown = storage.nbytes() - self.sizes[number]
            if grown > 0 and number not in self._excluded:  # resized in place (rare): count the difference
                self.sizes[number] += grown
                self._event(number, grown, 0)
            return
        number = len(self.sizes)
        self.sizes.append(storage.nbytes() if nbytes is None else nbytes)
        self.tags.append(self._current_tag())
        self._refs[key] = (weakref.ref(storage, functools.partial(self._freed, key, number)), number)
        self._event(number, self.sizes[number], 1)

    def _freed(self, key: int, number: int, _ref: weakref.ref) -> None:
        entry = self._refs.get(key)
        if entry is not None and entry[1] == number:
            del self._refs[key]
        self._event(number, -self.sizes[number], -1)

    def _event(self, number: int, delta: int, kind: int) -> None:
        self.event_storage.append(number)
        self.event_delta.append(delta)
        self.event_kind.append(kind)
        self.live_bytes += delta
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes

    def _current_tag(self) -> str | None:
        if not self.tagging:
            return None
        return self._module_stack[-1] if self._module_stack else NETWORK_TAG

    # --- helpers for the code being tracked ---------------------------------------------------------
    def mark(self, name: str) -> None:
        """Remember the current event index under ``name`` (the start of a phase)."""
        self.mark_list.append((name, len(self.event_delta)))

    def index_of(self, name: str) -> int:
        """Event index of the last mark called ``name``."""
        for mark, index in reversed(self.mark_list):
            if mark == name:
                return index
        raise KeyError(f"no mark {name!r}; marks: {[m for m, _ in self.mark_list]}")

    def tag_modules(self, modules: dict[str, torch.nn.Module]) -> list:
        """Tag storages created inside each module's forward with its name (while ``tagging``).

        Returns the hook handles; call ``.remove()`` on them when done.
        """
        handles = []
        for name, module in modules.items():
            handles.append(module.register_forward_pre_hook(functools.partial(self._enter, name)))
            handles.append(module.register_forward_hook(self._leave, always_call=True))
        return handles

    def _enter(self, name: str, _module, _args) -> None:
        self._module_stack.append(name)

    def _leave(self, _module, _args, _output) -> None:
        self._module_stack.pop()

    def count(self, tensors: Iterable[torch.Tensor | None]) -> None:
        """Count the storages of ``tensors`` made outside the tracker (before it, or while ``paused``) as allocated
        now, and watch them until they are freed: what a real step starts with (parameters, gradients, optimizer
        state) and the batches a loader hands it."""
        for t in tensors:
            if t is not None:
                self._see(t)

    def exclude(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count the storages of ``tensors`` (made before tracking began) as 0 bytes from now on."""
        for t in tensors:
            storage = t.untyped_storage()
            if self.storage_numbers([t]):
                continue
            number = len(self.sizes)
            self.sizes.append(0)
            self.tags.append(None)
            self._excluded.add(number)
            self._refs[id(storage)] = (weakref.ref(storage), number)

    def storage_numbers(self, tensors: Iterable[torch.Tensor | None]) -> set[int]:
        """Numbers of the (live, tracked) storages behind ``tensors``; untracked ones are skipped."""
        numbers = set()
        for t in tensors:
            if t is None:
                continue
            storage = t.untyped_storage()
            entry = self._refs.get(id(storage))
            if entry is not None and entry[0]() is storage:
                numbers.add(entry[1])
        return numbers

    def live_numbers(self) -> list[int]:
        """Numbers of the storages alive now."""
        return [number for ref, number in self._refs.values() if ref() is not None]

    def live_bytes_by_tag(self) -> dict[str, int]:
        """Bytes alive now, grouped by module tag (untagged storages left out)."""
        out: dict[str, int] = {}
        for number in self.live_numbers():
            tag = self.tags[number]
            if tag is not None:
                out[tag] = out.get(tag, 0) + self.sizes[number]
        return out

    def timeline(self, category_of: np.ndarray, num_categories: int, stop: int | None = None) -> np.ndarray:
        """Live bytes per category after each event: ``(E + 1, num_categories)`` int64, row 0 all zero.

        ``category_of[n]`` is the category of storage ``n``. Only the first ``stop`` events are used.
        """
        storage = np.asarray(self.event_storage[:stop], dtype=np.int64)
        delta = np.asarray(self.event_delta[:stop], dtype=np.int64)
        steps = np.zeros((len(delta) + 1, num_categories), dtype=np.int64)
        steps[np.arange(1, len(delta) + 1), category_of[storage]] = delta
        return np.cumsum(steps, axis=0)

    def live_count(self, stop: int | None = None) -> np.ndarray:
        """Number of live storages after each event: ``(E + 1,)`` int64 (resizes do not count)."""
        kind = np.asarray(self.event_kind[:stop], dtype=np.int64)
        return np.concatenate([[0], np.cumsum(kind)])
