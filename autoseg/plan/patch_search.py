"""Network, patch and batch search for one configuration (used by ``autoseg.plan.configuration``).

For fixed settings (base width, precision, activation checkpointing, micro-batch regime) the search picks
the patch that covers the most of the median image, then the largest batch, whose training step fits:
predicted device bytes <= ``Limits.memory_bytes`` and, on CPU, predicted seconds (``StepCost.seconds``) <=
``Limits.seconds``.

The patch's network (pooling per axis, kernels) depends on the patch (``topology_for``), and a new
network costs 2-3 simulations of the memory model (about 1 s each). So the search works per topology:

1. guess: walk a family of patches (a physically isotropic box, sides proportional to 1/spacing,
   capped by the median shape) from small to the whole median image, and keep the largest one that a
   cheap proxy says fits (``rough_training_peak_bytes`` scaled to the exact model at the last topology);
2. exact: for that patch's topology, every patch on its grid (multiples of the stride product, each axis
   at most the median rounded up) whose own topology it is; the peak depends only on (batch, voxels)
   and grows with both, so a bisection over volumes finds all that fit in a few model queries;
3. repeat with the proxy recalibrated, until the guess repeats a topology (at most ``MAX_FITS``);
4. if no patch found reaches ``Limits.fill_bytes`` (a coarse grid: a 16 x 32 x 32 stride product leaves
   steps of 10-30% in volume), the topologies of the larger family patches, then the network with one
   pooling fewer on one axis (a finer grid there), most promising first by the proxy.

Among all fitting patches: the largest coverage of the median image; among those within
``COVERAGE_TOLERANCE`` of it whose peak still reaches ``Limits.fill_bytes``, the one closest to the
isotropic family's shape (so the patch keeps the aspect ratio from the spacing instead of any shape of
that volume). Then the batch grows while it fits, up to the dataset cap.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

from autoseg.model.topology import NetworkTopology
from autoseg.plan.step_cost import Candidate, Limits, Setting, StepCost, rough_training_peak_bytes
from autoseg.plan.topology_rules import pools_per_axis, topology_for

COVERAGE_TOLERANCE = 0.10  # patches within 10% of the best coverage compete on shape (if they fill enough)
FAMILY_STEP = 1.03  # volume ratio between successive guesses
MAX_FITS = 3  # topologies fitted (simulated) per search at most
BAND_LOW = 0.5  # grid patches from half the largest fitting family volume are enumerated
NEIGHBOUR_RANGE = 2.0  # without a memory check, also search the topologies of family patches up to 2x larger


def family_shape(spacing_mm: tuple[float, ...], median_shape: tuple[int, ...], voxels: float) -> tuple[float, ...]:
    """A box of ``voxels`` voxels whose sides are equal in mm (proportional to 1/spacing), each side capped
    by the median shape (the capped axes' share goes to the others). The whole median image at most."""
    dim = len(spacing_mm)
    capped: set[int] = set()
    while True:
        free = [a for a in range(dim) if a not in capped]
        if not free:
            return tuple(float(m) for m in median_shape)
        rest = voxels / math.prod(median_shape[a] for a in capped)
        side_mm = (rest * math.prod(spacing_mm[a] for a in free)) ** (1.0 / len(free))
        over = [a for a in free if side_mm / spacing_mm[a] > median_shape[a]]
        if not over:
            return tuple(float(median_shape[a]) if a in capped else side_mm / spacing_mm[a] for a in range(dim))
        capped.update(over)


@dataclass(frozen=True)
class SearchSpace:
    """What one configuration's network sees: spacing and median shape of its axes (2 or 3 of them)."""

    spacing_mm: tuple[float, ...]
    median_shape: tuple[int, ...]
    in_channels: int
    num_outputs: int
    dataset_voxels: float  # all training cases at this configuration's spacing (caps the batch)

    def coverage(self, patch: tuple[int, ...]) -> float:
        """Fraction of the median image one patch covers (1.0: the whole of it)."""
        return math.prod(min(p, m) / m for p, m in zip(patch, self.median_shape))

    def max_batch(self, patch: tuple[int, ...]) -> int:
        """nnU-Net's rule: one batch covers at most 5% of the dataset's voxels (against overfitting)."""
        return max(2, int(0.05 * self.dataset_voxels / math.prod(patch)))


def search(space: SearchSpace, setting: Setting, cost: StepCost) -> Candidate | None:
    """The best (coverage, then batch) patch and batch under ``setting``, or None if nothing fits."""
    batch = 1 if setting.single else 2
    fitting: dict[NetworkTopology, list[tuple[int, ...]]] = {}

    def add(topology: NetworkTopology, caps: tuple[int, ...] | None = None) -> tuple[NetworkTopology, tuple] | None:
        fitting[topology] = _fitting_patches(space, topology, setting, cost, batch, caps)
        return _select(space, [(t, p) for t, ps in fitting.items() for p in ps], cost, batch)

    ratio, best = 1.0, None  # ratio: exact / proxy bytes at the last fitted topology
    if not cost.use_memory:  # time only: exact and cheap, so the guess's neighbours are searched too
        for topology in _guesses(space, setting, cost, ratio, batch):
            best = add(topology)
    for _ in range(MAX_FITS if cost.use_memory else 0):
        topology = _guesses(space, setting, cost, ratio, batch)[0]
        if topology in fitting:
            break
        best = add(topology)
        smallest = tuple(d * (2 if a == 0 else 1) for a, d in enumerate(topology.patch_divisor()))
        t, p = best if best is not None else (topology, smallest)
        if t.num_stages >= 2:  # else nothing can be built at this size to measure
            ratio = cost.peak(t, batch, p) / max(_proxy_bytes(t, batch, p, setting), 1)
    if cost.use_memory and best is not None:
        # no grid searched holds a patch near the limit: the topologies of larger family patches, then
        # networks pooling one axis once less (a finer grid on that axis)
        def alternatives():  # lazily: most searches stop before
            yield from ((t, None) for t in _guesses(space, setting, cost, ratio, batch)[1 : 1 + MAX_FITS])
            yield from _pool_variants(space, setting, best[0], ratio, batch, cost.limits)

        for topology, caps in alternatives():
            if not _underfilled(space, best, cost, batch):
                break
            if topology not in fitting:
                best = add(topology, caps)
    if best is None:
        return None
    topology, patch = best
    if not setting.single:
        batch = largest_batch(space, topology, patch, cost)
    return cost.candidate(topology, batch, patch, space.coverage(patch), space.max_batch(patch))


def _pool_variants(
    space: SearchSpace, setting: Setting, topology: NetworkTopology, ratio: float, batch: int, limits: Limits
) -> list[tuple[NetworkTopology, tuple[int, ...]]]:
    """``topology`` with one pooling fewer on one axis (and the pooling caps that give it), the most
    promising first by the proxy's best coverage on its grid."""
    pools = pools_per_axis(topology)
    largest = tuple(max(1, math.ceil(m / d)) * d for m, d in zip(space.median_shape, topology.patch_divisor()))

    def proxy(t: NetworkTopology, b: int, p: tuple[int, ...], *_: object) -> int:
        return int(ratio * _proxy_bytes(t, b, p, setting))

    proxy_cost = StepCost(proxy, setting, limits)
    ranked = []
    for axis in range(topology.dim):
        if pools[axis] == 0:
            continue
        caps = tuple(n - (a == axis) for a, n in enumerate(pools))
        variant = canonical(space, setting, largest, caps)[0]
        fitting = _fitting_patches(space, variant, setting, proxy_cost, batch, caps)
        if fitting:
            ranked.append((max(space.coverage(p) for p in fitting), variant, caps))
    ranked.sort(key=lambda r: -r[0])
    return [(variant, caps) for _, variant, caps in ranked]


def _underfilled(space: SearchSpace, best: tuple[NetworkTopology, tuple[int, ...]], cost: StepCost, batch: int) -> bool:
    return space.coverage(best[1]) < 1.0 and cost.peak(best[0], batch, best[1]) < cost.limits.fill_bytes


def canonical(
    space: SearchSpace, setting: Setting, patch: tuple[int, ...], max_pools: tuple[int, ...] | None = None
) -> tuple[NetworkTopology, tuple[int, ...]]:
    """The topology ``topology_for`` gives this patch under ``setting``, and the patch rounded to it."""
    return topology_for(
        tuple(int(v) for v in patch),
        tuple(space.spacing_mm),
        space.in_channels,
        space.num_outputs,
        setting.base_features,
        setting.max_features,
        max_pools,
        setting.architecture,
    )


def _proxy_bytes(topology: NetworkTopology, batch: int, patch: tuple[int, ...], setting: Setting) -> int:
    return rough_training_peak_bytes(
        topology, batch, patch, setting.precision, setting.checkpointing, setting.accumulation_steps
    )


def _guesses(space: SearchSpace, setting: Setting, cost: StepCost, ratio: float, batch: int) -> list[NetworkTopology]:
    """Topology of the largest family patch that the proxy says fits (of the smallest family patch if none),
    then those of the family patches up to NEIGHBOUR_RANGE times larger (their grids may hold patches
    of another shape that fit and cover more)."""
    median_voxels = math.prod(space.median_shape)
    voxels = float(2 ** len(space.median_shape))
    family: list[tuple[float, NetworkTopology, bool]] = []
    while True:
        shape = family_shape(space.spacing_mm, space.median_shape, min(voxels, median_voxels))
        topology, patch = canonical(space, setting, tuple(max(1, round(s)) for s in shape))
        fits_time = cost.limits.seconds is None or cost.seconds(topology, batch, patch) <= cost.limits.seconds
        fits_bytes = not cost.use_memory or (
            ratio * _proxy_bytes(topology, batch, patch, setting) <= cost.limits.memory_bytes
        )
        family.append((voxels, topology, fits_time and fits_bytes))
        if voxels >= median_voxels:
            break
        voxels *= FAMILY_STEP
    best = max((i for i, f in enumerate(family) if f[2]), default=0)
    out = [family[best][1]]
    for v, topology, _ in family[best + 1 :]:
        if v > NEIGHBOUR_RANGE * family[best][0]:
            break
        if topology not in out:
            out.append(topology)
    return out


def _fitting_patches(
    space: SearchSpace,
    topology: NetworkTopology,
    setting: Setting,
    cost: StepCost,
    batch: int,
    max_pools: tuple[int, ...] | None = None,
) -> list[tuple[int, ...]]:
    """The patches on ``topology``'s grid (multiples of its strides, each axis at most the median rounded up)
    whose own topology it is (pooling capped at ``max_pools``) and whose step fits at ``batch``.

    The step's bytes and FLOPs grow with the patch's volume and depend on the patch through it only. A
    bisection over the isotropic family (rounded to the grid) brackets the largest volume that fits; the
    grid is enumerated between BAND_LOW of that and the first family volume that does not fit, and a
    bisection over those volumes finds the ones that fit."""
    div = topology.patch_divisor()
    counts = [max(1, math.ceil(m / d)) for m, d in zip(space.median_shape, div)]
    family = sorted({math.prod(p): p for p in _family_on_grid(space, div, counts)}.items())
    fit_at = _last_fitting([p for _, p in family], lambda p: cost.fits(topology, batch, p))
    v_low = BAND_LOW * family[fit_at][0] if fit_at >= 0 else 0.0
    v_high = family[fit_at + 1][0] if fit_at + 1 < len(family) else math.inf
    grid = [
        p for p in _grid_band(div, counts, v_low, v_high) if canonical(space, setting, p, max_pools) == (topology, p)
    ]
    by_volume = sorted({math.prod(p): p for p in grid}.items())
    last = _last_fitting([p for _, p in by_volume], lambda p: cost.fits(topology, batch, p))
    return [] if last < 0 else [p for p in grid if math.prod(p) <= by_volume[last][0]]


def _family_on_grid(space: SearchSpace, div: tuple[int, ...], counts: list[int]) -> list[tuple[int, ...]]:
    """The isotropic family from 2 cells to the median image, each axis rounded to the grid, and the
    largest grid patch."""
    out, voxels = [], 2.0 * math.prod(div)
    while voxels < math.prod(space.median_shape):
        shape = family_shape(space.spacing_mm, space.median_shape, voxels)
        out.append(tuple(min(max(1, round(s / d)), n) * d for s, d, n in zip(shape, div, counts)))
        voxels *= FAMILY_STEP
    out.append(tuple(n * d for n, d in zip(counts, div)))
    return [p for p in out if math.prod(p) >= 2 * math.prod(div)]


def _last_fitting(patches: list[tuple[int, ...]], fits: Callable[[tuple[int, ...]], bool]) -> int:
    """Index of the last patch that fits, ``patches`` sorted by volume (fitting is monotone); -1 if none."""
    return _last_true(-1, len(patches) - 1, lambda i: fits(patches[i]))


def _last_true(lo: int, hi: int, holds: Callable[[int], bool]) -> int:
    """THE bisection of the search: the largest ``n`` in ``(lo, hi]`` for which ``holds(n)``, ``lo`` if none.
    ``holds`` is monotone (true up to some ``n``, false above it) and never asked at ``lo``: ``lo`` is the
    caller's answer when nothing above it holds (-1: no patch; 2: the smallest batch, already checked)."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if holds(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _grid_band(div: tuple[int, ...], counts: list[int], v_low: float, v_high: float) -> list[tuple[int, ...]]:
    """Grid patches (n_a * div_a, 1 <= n_a <= counts_a, at least 2 cells) with v_low <= volume < v_high."""
    out = []
    for head in itertools.product(*(range(1, n + 1) for n in counts[:-1])):
        part = math.prod(h * d for h, d in zip(head, div))
        last = div[-1] * part
        first = max(1, math.ceil(v_low / last), 2 if math.prod(head) == 1 else 1)
        stop = counts[-1] if math.isinf(v_high) else min(counts[-1], math.ceil(v_high / last) - 1)
        out.extend((*(h * d for h, d in zip(head, div)), n * div[-1]) for n in range(first, stop + 1))
    return out


def _select(
    space: SearchSpace, options: list[tuple[NetworkTopology, tuple[int, ...]]], cost: StepCost, batch: int
) -> tuple[NetworkTopology, tuple[int, ...]] | None:
    """Largest coverage; within COVERAGE_TOLERANCE of it the shape closest to the isotropic family that
    still reaches ``fill_bytes`` at ``batch`` (among patches covering the whole median image: the smallest)."""
    if not options:
        return None
    covers = [space.coverage(p) for _, p in options]
    best = max(covers)
    if best >= 1.0:
        return min((o for o, c in zip(options, covers) if c >= 1.0), key=lambda o: (math.prod(o[1]), o[1]))
    pool = [(o, c) for o, c in zip(options, covers) if c >= best * (1.0 - COVERAGE_TOLERANCE)]
    pool.sort(key=lambda oc: (_shape_distance(space, oc[0][1]), -oc[1], oc[0][1]))
    for (topology, patch), _ in pool:
        if not cost.use_memory or cost.peak(topology, batch, patch) >= cost.limits.fill_bytes:
            return topology, patch
    return max(pool, key=lambda oc: (oc[1], oc[0][1]))[0]


def _shape_distance(space: SearchSpace, patch: tuple[int, ...]) -> float:
    """Sum over axes of |log(patch / family shape)| at the patch's covered volume."""
    covered = math.prod(min(p, m) for p, m in zip(patch, space.median_shape))
    target = family_shape(space.spacing_mm, space.median_shape, covered)
    return sum(abs(math.log(min(p, m) / t)) for p, m, t in zip(patch, space.median_shape, target))


def largest_batch(space: SearchSpace, topology: NetworkTopology, patch: tuple[int, ...], cost: StepCost) -> int:
    """Largest batch in [2, max_batch] that fits (2 if even that does not: the caller checked it does)."""
    return _last_true(2, space.max_batch(patch), lambda batch: cost.fits(topology, batch, patch))
