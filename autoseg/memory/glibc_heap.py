"""What glibc's malloc holds while a CPU training step (or a tile's prediction) runs: its heap and mapped blocks,
replayed over the step's trace.

torch allocates a CPU tensor with ``posix_memalign(64, n)``. glibc (2.36, 64-bit, the main arena) serves it

- from its heap when the block (``n`` + its 8-byte header, in 16-byte units) is under the *mmap threshold*: the
  smallest free chunk that fits (best fit; freed neighbours coalesce), else the top of the heap, which grows (``brk``)
  by the shortfall + ``TOP_PAD_BYTES``. A freed block stays in the heap for reuse; only a free top of at least the
  *trim threshold* is given back. To align, glibc asks for ``n + 96`` bytes and gives the unaligned ends back as
  chunks of 32-96 bytes (*fragments*);
- else from a fresh ``mmap``, returned to the system when freed. Freeing one raises the mmap threshold to its size
  (if that is at most ``GLIBC_MMAP_THRESHOLD_MAX``) and the trim threshold to twice that: after the first step's
  largest freed feature map under 32 MiB, every smaller one is kept in the heap.

Most fragments go back into a free neighbour at the next large ``malloc`` (fastbin consolidation), but the C++
runtime's small objects (``operator new``, far more calls than tensors) take some and hold them. A held fragment
leaves the hole of its freed neighbour 96 bytes too small for a block of the same size, so the next such block goes
elsewhere and the heap grows beyond what the step's tensors add; best fit over the tensors alone, without held
fragments, reuses nearly every hole. The model holds every ``HELD_FRAGMENT_EVERY``-th fragment for one step's events
and gives the others back at once: the share a replay of glibc (tcache and fastbins included) over a real step's
``malloc`` trace holds (docs/memory.md section 8, "Why the heap grows").

At inference (``inference_mode``: no autograd nodes, the long-lived small objects of a training step) fewer
fragments are held: one in ``INFERENCE_HELD_FRAGMENT_EVERY``, fitted to the peak RSS of real CPU tiles
(docs/memory.md section 4).

``heap_footprint`` replays a step's allocation trace ``HEAP_STEPS`` times (the thresholds and the held fragments
carry over, as in training) and returns the peak of heap extent + mapped bytes above the step's start. It does not
see the interpreter's and the C++ runtime's own allocations (in the measured RSS before the step) nor kernels'
hidden buffers other than those the tracker models (``cpu_conv_scratch_bytes``). Pure Python, a few microseconds
per event.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass

import numpy as np

from autoseg.core.units import KiB, MiB

GLIBC_MMAP_THRESHOLD_MAX = 32 * MiB  # the largest dynamic mmap threshold on 64-bit Linux (DEFAULT_MMAP_THRESHOLD_MAX)
GLIBC_MMAP_THRESHOLD_START = 128 * KiB  # M_MMAP_THRESHOLD and M_TRIM_THRESHOLD before any mapped block is freed
TOP_PAD_BYTES = 128 * KiB  # M_TOP_PAD: what the heap grows by beyond a request
TORCH_CPU_ALIGNMENT = 64  # c10's posix_memalign alignment for CPU tensors
HELD_FRAGMENT_EVERY = 5  # one fragment in 5 is held by a small object for a step (the replayed trace's share, above)
INFERENCE_HELD_FRAGMENT_EVERY = 20  # under inference_mode (no autograd nodes): fitted to measured tiles, above
HEAP_STEPS = 3  # steps replayed: the first raises the threshold, the next ones reach the steady state
_MIN_CHUNK, _HEADER, _PAGE = 32, 8, 4096
_CONSOLIDATION_BYTES = 64 * KiB  # a free of at least this (coalesced) size may trim the top


def _chunk_bytes(nbytes: int) -> int:
    """glibc's chunk for a request of ``nbytes``: + the 8-byte header, in 16-byte units, at least 32."""
    return max(_MIN_CHUNK, (nbytes + _HEADER + 15) & ~15)


def _page_up(nbytes: int) -> int:
    return -(-nbytes // _PAGE) * _PAGE


@dataclass(frozen=True)
class HeapFootprint:
    """``peak_bytes``: the largest heap extent + mapped bytes over the replayed steps, above the step's start.
    ``mapped_bytes_per_step``: bytes the last replayed step allocated in mapped blocks (each one mapped, page-faulted
    and unmapped again every step)."""

    peak_bytes: int
    mapped_bytes_per_step: int

    def retained_bytes(self, tensor_rise_bytes: int) -> int:
        """What glibc holds beyond the live tensors at their peak, ``tensor_rise_bytes`` above the step's start: the
        footprint's rise less the tensors'."""
        return max(0, self.peak_bytes - tensor_rise_bytes)

    def to_json(self) -> dict:
        return {"peak_bytes": self.peak_bytes, "mapped_bytes_per_step": self.mapped_bytes_per_step}

    @classmethod
    def from_json(cls, value: dict) -> HeapFootprint:
        return cls(int(value["peak_bytes"]), int(value["mapped_bytes_per_step"]))


class GlibcHeap:
    """glibc's main arena as seen through tensor allocations (see the module docstring). Blocks are named by ``key``;
    ``footprint_bytes`` is the heap extent + mapped bytes now, ``peak_bytes`` its largest value so far.
    ``hold_events``: how many ``tick``s a held fragment stays held (0: none is held); ``held_every``: every how
    many-th fragment is held."""

    def __init__(self, hold_events: int, held_every: int = HELD_FRAGMENT_EVERY) -> None:
        self.hold_events = hold_events
        self.held_every = held_every
        self.mmap_threshold = self.trim_threshold = GLIBC_MMAP_THRESHOLD_START
        self.top = self.end = 16  # the heap's first chunk (the extent is counted from 0)
        self.free_at: dict[int, int] = {}  # free chunks: address -> size, and by end address, and (size, address)
        self.free_ending: dict[int, int] = {}
        self.by_size: list[tuple[int, int]] = []
        self.blocks: dict[object, tuple[int | None, int]] = {}  # key -> (address, or None if mapped; size)
        self.held: deque[tuple[int, int, int]] = deque()  # (release tick, address, size)
        self.fragments = 0
        self.clock = 0
        self.mapped_bytes = self.mapped_total_bytes = 0
        self.peak_bytes = self.footprint_bytes

    @property
    def footprint_bytes(self) -> int:
        return self.end + self.mapped_bytes

    def malloc(self, key: object, nbytes: int) -> None:
        """``posix_memalign(64, nbytes)``: an aligned block from the heap, or a mapped one."""
        size = _chunk_bytes(nbytes)
        request = size + TORCH_CPU_ALIGNMENT + _MIN_CHUNK
        chunk = self._take(request)
        if chunk is None:  # a mapped block
            mapped = _page_up(request + _HEADER)
            self.blocks[key] = (None, mapped)
            self.mapped_bytes += mapped
            self.mapped_total_bytes += mapped
        else:
            address, got = chunk
            lead = -(address + 16) % TORCH_CPU_ALIGNMENT  # user pointers sit 16 bytes into the chunk
            if lead:
                lead += TORCH_CPU_ALIGNMENT if lead < _MIN_CHUNK else 0
                self._fragment(address, lead)
            address, got = address + lead, got - lead
            if got > size + _MIN_CHUNK:
                self._fragment(address + size, got - size)
                got = size
            self.blocks[key] = (address, got)
        self.peak_bytes = max(self.peak_bytes, self.footprint_bytes)

    def free(self, key: object) -> None:
        address, size = self.blocks.pop(key)
        if address is None:
            self.mapped_bytes -= size
            if self.mmap_threshold < size <= GLIBC_MMAP_THRESHOLD_MAX:
                self.mmap_threshold, self.trim_threshold = size, 2 * size
        else:
            self._give_back(address, size)

    def tick(self) -> None:
        """One tensor event has passed: give back the held fragments whose time is up."""
        self.clock += 1
        while self.held and self.held[0][0] <= self.clock:
            _, address, size = self.held.popleft()
            self._give_back(address, size)

    def _fragment(self, address: int, size: int) -> None:
        self.fragments += 1
        if self.hold_events and self.fragments % self.held_every == 0:
            self.held.append((self.clock + self.hold_events, address, size))
        else:
            self._give_back(address, size)

    def _take(self, request: int) -> tuple[int, int] | None:
        """A chunk of at least ``request`` bytes: the smallest free one (its rest stays free), else from the top
        (grown if need be); None where glibc maps it instead."""
        i = bisect.bisect_left(self.by_size, (request, -1))
        if i < len(self.by_size):
            size, address = self.by_size[i]
            self._unlink(address)
            if size - request >= _MIN_CHUNK:
                self._link(address + request, size - request)
                size = request
            return address, size
        if self.end - self.top < request + _MIN_CHUNK:
            if request >= self.mmap_threshold:
                return None
            self.end += _page_up(request + TOP_PAD_BYTES + _MIN_CHUNK - (self.end - self.top))
        address, self.top = self.top, self.top + request
        return address, request

    def _give_back(self, address: int, size: int) -> None:
        """A chunk is free: coalesce it with free neighbours, or with the top (trimmed above the trim threshold)."""
        if address in self.free_ending:
            before = self.free_ending[address]
            size += self._unlink(before)
            address = before
        if address + size in self.free_at:
            size += self._unlink(address + size)
        if address + size != self.top:
            self._link(address, size)
            return
        self.top = address
        if size >= _CONSOLIDATION_BYTES and self.end - self.top >= self.trim_threshold:
            self.end = self.top + _page_up(TOP_PAD_BYTES + _MIN_CHUNK)

    def _link(self, address: int, size: int) -> None:
        self.free_at[address] = size
        self.free_ending[address + size] = address
        bisect.insort(self.by_size, (size, address))

    def _unlink(self, address: int) -> int:
        size = self.free_at.pop(address)
        del self.free_ending[address + size]
        del self.by_size[bisect.bisect_left(self.by_size, (size, address))]
        return size


def heap_footprint(
    storage: np.ndarray, delta: np.ndarray, steps: int = HEAP_STEPS, held_every: int = HELD_FRAGMENT_EVERY
) -> HeapFootprint:
    """Replay one step's allocation trace ``steps`` times in a ``GlibcHeap``.

    ``storage[i]``, ``delta[i]``: event ``i`` changes storage ``storage[i]`` by ``delta[i]`` bytes (> 0: allocated or
    grown, < 0: freed), as ``StorageTracker`` records them. A storage whose first event frees it was alive when the
    step began (last step's gradients): it is allocated before the first replay, and in each later one it is the
    storage of that size the previous replay left alive (in order). Storages the step never touches (parameters,
    optimizer state) are not modelled: they are part of the start, in the heap and in the measured process alike.
    """
    events = list(zip(storage.tolist(), delta.tolist()))
    first: dict[int, int] = {}
    for number, change in events:
        first.setdefault(number, change)
    carried = [(number, -change) for number, change in first.items() if change < 0]
    heap = GlibcHeap(hold_events=len(events), held_every=held_every)
    sizes: dict[object, int] = {(-1, number): nbytes for number, nbytes in carried}  # block (step, storage): bytes
    for key, nbytes in sizes.items():
        heap.malloc(key, nbytes)
    start = heap.peak_bytes = heap.footprint_bytes
    keys: dict[int, object] = {number: (-1, number) for number, _ in carried}  # storage: its block now
    mapped_before = 0
    for step in range(steps):
        mapped_before = heap.mapped_total_bytes
        for number, change in events:
            if change > 0:  # a new storage, or one grown in place (torch reallocates it)
                key = (step, number)
                if key in heap.blocks:
                    heap.free(key)
                sizes[key] = sizes.get(key, 0) + change
                heap.malloc(key, sizes[key])
                keys[number] = key
            elif keys.get(number) in heap.blocks:
                heap.free(keys[number])
            heap.tick()
        keys = _carry(carried, {key: sizes[key] for key in heap.blocks if key[0] == step})
    return HeapFootprint(
        peak_bytes=heap.peak_bytes - start, mapped_bytes_per_step=heap.mapped_total_bytes - mapped_before
    )


def _carry(carried: list[tuple[int, int]], left: dict[object, int]) -> dict[int, object]:
    """The key of each storage the next step frees first: a storage of its size this step left alive, in order."""
    by_size: dict[int, list[object]] = {}
    for key, nbytes in left.items():
        by_size.setdefault(nbytes, []).append(key)
    return {number: by_size[nbytes].pop(0) for number, nbytes in carried if by_size.get(nbytes)}
