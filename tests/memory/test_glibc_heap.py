"""``GlibcHeap`` and ``heap_footprint`` on hand-written traces whose glibc behaviour is known (see the module docstring
of ``autoseg.memory.glibc_heap``), and the heap term's way into a CPU step's prediction."""

from __future__ import annotations

import numpy as np
from factories import tiny_topology

from autoseg.core.units import KiB, MiB
from autoseg.memory.device import predict_device_peak
from autoseg.memory.glibc_heap import (
    GLIBC_MMAP_THRESHOLD_MAX,
    GLIBC_MMAP_THRESHOLD_START,
    HELD_FRAGMENT_EVERY,
    TOP_PAD_BYTES,
    GlibcHeap,
    HeapFootprint,
    heap_footprint,
)
from autoseg.memory.step_record import StepConfig, StepRecord
from autoseg.memory.training import record_training_step

NEVER = 10**9  # hold_events: a held fragment stays held


def _raised(threshold_bytes: int, hold_events: int = 0) -> GlibcHeap:
    """A heap whose mmap threshold a freed mapped block of about ``threshold_bytes`` has raised."""
    heap = GlibcHeap(hold_events)
    heap.malloc("warm-up", threshold_bytes)
    heap.free("warm-up")
    return heap


def test_a_block_over_the_threshold_is_mapped_and_freeing_it_raises_the_thresholds() -> None:
    heap = GlibcHeap(hold_events=0)
    heap.malloc("a", MiB)  # over the starting 128 KiB: a fresh mapping, the heap does not grow
    assert heap.mmap_threshold == GLIBC_MMAP_THRESHOLD_START
    assert heap.mapped_bytes == MiB + 4 * KiB and heap.end < 4 * KiB  # 1 MiB + header and alignment, in pages
    heap.free("a")
    assert heap.mapped_bytes == 0
    assert heap.mmap_threshold == MiB + 4 * KiB and heap.trim_threshold == 2 * heap.mmap_threshold
    heap.malloc("b", MiB)  # the same size now comes from the heap, which grows by it and the top pad
    assert heap.mapped_bytes == 0 and MiB + TOP_PAD_BYTES <= heap.end <= MiB + TOP_PAD_BYTES + 8 * KiB
    assert heap.peak_bytes == heap.footprint_bytes == heap.end  # the heap with its pad outgrew the mapping


def test_a_freed_mapping_over_32_mib_leaves_the_threshold() -> None:
    heap = GlibcHeap(hold_events=0)
    heap.malloc("big", GLIBC_MMAP_THRESHOLD_MAX + MiB)
    heap.free("big")
    assert heap.mmap_threshold == GLIBC_MMAP_THRESHOLD_START  # glibc raises it only to blocks up to 32 MiB
    heap.malloc("next", MiB)
    assert heap.mapped_bytes > MiB  # still mapped


def test_a_freed_block_serves_a_smaller_one_without_growing_the_heap() -> None:
    heap = _raised(4 * MiB)
    heap.malloc("a", 2 * MiB)
    heap.malloc("b", MiB)  # keeps "a" from being the top
    end, a_at = heap.end, heap.blocks["a"][0]
    heap.free("a")
    heap.malloc("c", MiB)  # best fit: the hole "a" left
    assert heap.end == end and heap.blocks["c"][0] <= a_at + 128
    heap.malloc("d", 900 * KiB)  # the rest of that hole
    assert heap.end == end


def test_freed_neighbours_coalesce_into_a_hole_for_a_larger_block() -> None:
    heap = _raised(4 * MiB)
    for name in ("a", "b", "guard"):
        heap.malloc(name, MiB)
    end = heap.end
    heap.free("a")
    heap.free("b")
    heap.malloc("c", 2 * MiB - 4 * KiB)  # fits only in a and b together
    assert heap.end == end and heap.mapped_bytes == 0


def test_a_free_top_over_the_trim_threshold_is_given_back_and_one_under_it_is_kept() -> None:
    heap = _raised(4 * MiB)  # trim threshold: 8 MiB
    for i in range(4):
        heap.malloc(i, 3 * MiB)
    grown = heap.end
    heap.free(3)
    heap.free(2)  # a free top of 6 MiB: kept
    assert heap.end == grown
    heap.free(1)  # 9 MiB: trimmed down to the top pad
    assert heap.end - heap.top <= TOP_PAD_BYTES + 8 * KiB and heap.end < grown - 8 * MiB
    assert heap.peak_bytes >= grown  # the peak stays


def test_held_fragments_keep_freed_blocks_from_serving_the_next_ones_of_their_size() -> None:
    """Feature maps of one size, each freed two allocations later: with every fragment given back at once the holes
    are reused and the heap holds about four maps; with every 5th fragment held, a hole beside a held one is 96 bytes
    short of an aligned block of its size and the heap keeps growing."""

    def ring(hold_events: int) -> int:
        heap = _raised(4 * MiB, hold_events)
        for i in range(40):
            heap.malloc(i, MiB)
            if i >= 2:
                heap.free(i - 2)
            heap.tick()
        assert heap.fragments >= 40 and len(heap.held) == (
            0 if hold_events == 0 else heap.fragments // HELD_FRAGMENT_EVERY
        )
        return heap.end

    assert ring(0) <= 5 * MiB
    assert ring(NEVER) >= 2.5 * ring(0)


def test_held_fragments_are_given_back_after_their_events() -> None:
    heap = _raised(4 * MiB, hold_events=3)
    for i in range(HELD_FRAGMENT_EVERY):  # each aligned block gives back a fragment before it, most one after it too
        heap.malloc(i, MiB)
    assert heap.fragments >= HELD_FRAGMENT_EVERY and len(heap.held) == heap.fragments // HELD_FRAGMENT_EVERY
    free_before = sum(heap.free_at.values())
    for _ in range(3):
        assert heap.held
        heap.tick()
    assert not heap.held and sum(heap.free_at.values()) > free_before


def test_the_replay_counts_fresh_mappings_per_step_and_maps_blocks_over_32_mib_every_step() -> None:
    # storage 0: last step's gradient, freed first; 1: a 40 MiB map; 2: this step's gradient, left alive
    big = heap_footprint(np.array([0, 1, 2, 1]), np.array([-MiB, 40 * MiB, MiB, -40 * MiB]))
    assert 40 * MiB <= big.mapped_bytes_per_step <= 40 * MiB + 8 * KiB
    assert 40 * MiB <= big.peak_bytes <= 41 * MiB + TOP_PAD_BYTES + 16 * KiB
    # a 4 MiB map is mapped in the first step only: its free raises the threshold, later steps keep it in the heap
    small = heap_footprint(np.array([0, 1, 2, 1]), np.array([-MiB, 4 * MiB, MiB, -4 * MiB]))
    assert small.mapped_bytes_per_step == 0
    assert (
        heap_footprint(np.array([0, 1, 2, 1]), np.array([-MiB, 4 * MiB, MiB, -4 * MiB]), steps=1).mapped_bytes_per_step
        > 4 * MiB
    )


def test_a_cpu_step_record_carries_its_heap_into_the_prediction_and_its_json() -> None:
    cfg = StepConfig(tiny_topology(3), 2, (16, 32, 32), device="cpu")
    record = record_training_step(cfg)
    assert isinstance(record.heap, HeapFootprint)
    assert StepRecord.from_json(record.to_json()).heap == record.heap
    memory = record.peak()
    total = record.timeline.sum(axis=1)
    assert memory.heap_retained_bytes == max(0, record.heap.peak_bytes - int(total.max() - total[0]))
    terms = predict_device_peak(memory, "cpu")
    assert terms["fragmentation"] == memory.heap_retained_bytes
    assert terms["total"] == terms["tensors"] + terms["fragmentation"] + terms["runtime"]
    cuda = record_training_step(StepConfig(tiny_topology(3), 2, (16, 32, 32), device="cuda"))
    assert cuda.heap is None and cuda.peak().heap_retained_bytes == 0  # glibc is the CPU's allocator only
