"""nnU-Net's ``transpose_forward``: the axis order its networks see, and the same network in autoseg's axis order.

nnU-Net transposes every image by ``transpose_forward`` before it preprocesses it (so that the thick axis comes
first) and back after predicting; its plans state spacings, patches, kernels and strides in the transposed order.
A convolutional network with its kernels' spatial axes permuted computes on an untransposed image what the original
computes on the transposed one (instance norm, the nonlinearity and 1x1 heads do not depend on the axis order, and
the sliding window tiles each axis alone), so autoseg predicts without transposing: the plan's sizes and the weights
are permuted once at import. ``network_axes`` gives the permutation: autoseg's spatial axis ``j`` is nnU-Net's network
axis ``axes[j]``. A 2D network sees slices along nnU-Net's first transposed axis; autoseg slices along z, so a 2D
configuration is imported only where ``transpose_forward`` keeps z first.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from autoseg.core.errors import InputError


def network_axes(transpose_forward: Sequence[int], dim: int, where: str) -> tuple[int, ...]:
    """For each of autoseg's spatial axes (z, y, x; a 2D network's y, x), the axis of nnU-Net's network it is."""
    forward = [int(a) for a in transpose_forward]
    if sorted(forward) != [0, 1, 2]:
        raise InputError(f"{where}: transpose_forward {forward} is not a permutation of [0, 1, 2]")
    backward = [forward.index(a) for a in range(3)]  # transposed axis of each original axis
    if dim == 3:
        return tuple(backward)
    if forward[0] != 0:
        raise InputError(
            f"{where}: transpose_forward {forward} slices the 2D configuration along image axis {forward[0]}; autoseg "
            "predicts 2D configurations slice by slice along z (axis 0): not supported"
        )
    return tuple(backward[a] - 1 for a in (1, 2))


def in_autoseg_order(values: Sequence, axes: Sequence[int]) -> tuple:
    """Per-axis ``values`` stated in nnU-Net's network order (a patch, spacing, kernel or stride), in autoseg's."""
    return tuple(values[a] for a in axes)


def permuted_weights(weights: dict[str, torch.Tensor], axes: Sequence[int]) -> dict[str, torch.Tensor]:
    """``weights`` with every (transposed) convolution's kernel ``(out, in, *k)`` in autoseg's axis order."""
    dims = (0, 1, *(2 + a for a in axes))
    if list(axes) == sorted(axes):
        return weights
    return {k: v.permute(dims).contiguous() if v.ndim == len(dims) else v for k, v in weights.items()}


def inverse(axes: Sequence[int]) -> tuple[int, ...]:
    """The permutation that undoes ``axes`` (nnU-Net's network axis ``i`` is autoseg's ``inverse(axes)[i]``)."""
    return tuple(list(axes).index(i) for i in range(len(axes)))
