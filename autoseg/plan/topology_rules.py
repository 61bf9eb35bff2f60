"""The network a patch gets: pooling per axis and kernel sizes from the spacing (nnU-Net's rule, our code), the
stages and feature widths, and the architecture's blocks. Used by the patch search (``patch_search``) and the
planner (``planner``).
"""

from __future__ import annotations

import functools
import math

from autoseg.model.topology import PLAIN_UNET, NetworkTopology, preset_fields

MIN_FEATURE_MAP = 4  # no axis is pooled below this many voxels
MAX_STAGES = {2: 7, 3: 6}
FEATURE_CAP = {2: 512, 3: 320}


@functools.lru_cache(maxsize=65536)
def topology_for(
    patch_size: tuple[int, ...],
    spacing_mm: tuple[float, ...],
    in_channels: int,
    num_outputs: int,
    base_features: int,
    max_features: int,
    max_pools: tuple[int, ...] | None = None,
    architecture: str = PLAIN_UNET,
) -> tuple[NetworkTopology, tuple[int, ...]]:
    """Pooling per axis and kernel sizes from the spacing (nnU-Net's rule, our code); ``architecture``'s blocks
    (``preset_fields``).

    An axis is pooled while its current spacing is at most twice the finest one and its feature map
    stays >= MIN_FEATURE_MAP voxels (and, with ``max_pools``, at most that many times); its kernel is 3
    once its spacing is within 2x of the finest, else 1 (in-plane only convolutions for thick slices).
    Returns the topology and the patch size rounded up to a multiple of the total stride per axis.
    """
    dim = len(patch_size)
    spacing = list(spacing_mm)
    size = list(patch_size)
    strides: list[tuple[int, ...]] = [tuple([1] * dim)]
    kernels: list[tuple[int, ...]] = []
    kernel = [3 if s <= 2 * min(spacing) else 1 for s in spacing]
    kernels.append(tuple(kernel))
    pools = [0] * dim
    while len(strides) < MAX_STAGES[dim]:
        finest = min(spacing)
        pool = [
            1
            if (
                spacing[a] > 2 * finest
                or size[a] < 2 * MIN_FEATURE_MAP
                or (max_pools is not None and pools[a] >= max_pools[a])
            )
            else 2
            for a in range(dim)
        ]
        pools = [n + (p == 2) for n, p in zip(pools, pool)]
        if all(p == 1 for p in pool):
            break
        spacing = [s * p for s, p in zip(spacing, pool)]
        size = [math.ceil(n / p) for n, p in zip(size, pool)]
        finest = min(spacing)
        kernel = [3 if (k == 3 or s <= 2 * finest) else 1 for k, s in zip(kernel, spacing)]
        strides.append(tuple(pool))
        kernels.append(tuple(kernel))
    features = tuple(min(base_features * 2**s, max_features) for s in range(len(strides)))
    topology = NetworkTopology(
        dim=dim,
        in_channels=in_channels,
        num_outputs=num_outputs,
        features_per_stage=features,
        kernel_sizes=tuple(kernels),
        strides=tuple(strides),
        **preset_fields(architecture, len(strides)),
    )
    div = topology.patch_divisor()
    patch = tuple(int(math.ceil(p / d) * d) for p, d in zip(patch_size, div))
    return topology, patch


def pools_per_axis(topology: NetworkTopology) -> tuple[int, ...]:
    return tuple(sum(s[a] > 1 for s in topology.strides) for a in range(topology.dim))
