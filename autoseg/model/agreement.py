"""How much an ensemble's members (the folds, or one fold's mirror variants) disagree on an image, counted while the
sliding window runs (``autoseg.model.sliding_window``, ``SlidingWindow.agreement``) in running sums: no member's
logits or label map of the image are held, only the label tiles of the batch being run.

Each member's label map of a tile (the argmax of its logits over the classes; regions: each output's logit > 0,
i.e. probability > 0.5) is compared with the other members' on the same tile, each voxel weighted by the Gaussian
the window blends that tile with (0 over the padding), and added per class into a members x members matrix ``G``:
``G[a, b]`` is the weighted number of voxels that members a and b both give the class, its diagonal each member's
own. The Dice of members a and b for a class is ``2 G[a, b] / (G[a, a] + G[b, b])`` (``pairwise_dice``). A tile's
centre weighs most, as in the blended prediction, so the figure is that of the members' blended label maps up to the
few voxels where overlapping tiles of one member disagree with each other.

Members are the folds (each tile and mirror variant is compared across the folds that ran it) or, with one fold,
its mirror variants (each tile compared across its variants, flipped back). No torch is imported at module level:
the memory model counts ``agreement_bytes`` without it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

AGREEMENT_OF = ("folds", "variants")
_LABEL_BYTES = 1  # a member's label tile: uint8 class per voxel, or one bool per region and voxel
_SUMS_BYTES = 1024  # a tile's members x members products (float32, then float64) and their scalars: small tensors


@dataclass(frozen=True)
class Agreement:
    """What ``sliding_window_predict`` compares: ``members`` folds or mirror variants (``of``); ``regions``: the
    outputs are regions (sigmoid, thresholded at 0.5 each), else classes (softmax: the argmax, class 0 background)."""

    of: str
    members: int
    regions: bool = False

    def classes(self, num_outputs: int) -> list[int]:
        """The outputs compared: every region, or the foreground classes 1 .. K-1."""
        return list(range(num_outputs)) if self.regions else list(range(1, num_outputs))

    def check(self, num_runners: int, num_variants: int) -> None:
        if self.of not in AGREEMENT_OF:
            raise ValueError(f"agreement of {self.of!r}; expected one of {AGREEMENT_OF}")
        expected = num_runners if self.of == "folds" else num_variants
        if self.members != expected or self.members < 2:
            raise ValueError(
                f"agreement of {self.members} {self.of}, but the window runs {num_runners} network(s) and "
                f"{num_variants} mirror variant(s); compare two or more"
            )


def agreement_bytes(agreement: Agreement | None, tile_batch_size: int, tile: tuple[int, ...], num_outputs: int) -> int:
    """Peak bytes ``AgreementCounter`` holds beside a tile batch, on the accumulator's device: the label tiles waiting
    for their other members (one byte per voxel, per region for regions: with folds, every other fold's tiles of the
    batch and one more; with variants, one tile's variants) and, while a tile is counted, its weights (fp32, where
    it lies over the padding) and one class's members' masks and their weighted copy (fp32 each). A tile's argmax
    (int64) is made and gone before that; a tile's products and the sums are ``_SUMS_BYTES`` at most."""
    if agreement is None:
        return 0
    voxels, members = math.prod(tile), agreement.members
    per_label = _LABEL_BYTES * (num_outputs if agreement.regions else 1)
    waiting = (members - 1) * tile_batch_size + 1 if agreement.of == "folds" else members
    return waiting * voxels * per_label + voxels * 4 + 2 * members * voxels * 4 + _SUMS_BYTES


class AgreementCounter:
    """The running sums of one image (``add`` each member's logits of a tile, then ``pairwise_dice``). ``gaussian``
    and ``image_region`` are the window's (``start``), on the device where the sums are kept."""

    def __init__(self, agreement: Agreement, num_outputs: int) -> None:
        self.agreement, self.num_outputs = agreement, num_outputs
        self.classes = agreement.classes(num_outputs)
        self.gram: torch.Tensor | None = None  # (classes, M, M) float64
        self.gaussian: torch.Tensor | None = None
        self.image_region: tuple[slice, ...] = ()
        self.waiting: dict[tuple, dict[int, torch.Tensor]] = {}

    def start(self, gaussian: torch.Tensor, image_region: tuple[slice, ...]) -> None:
        """The window's Gaussian ``(*tile)`` fp32 and the image's region of the padded volume (z, y, x)."""
        import torch

        m = self.agreement.members
        self.gram = torch.zeros((len(self.classes), m, m), dtype=torch.float64, device=gaussian.device)
        self.gaussian, self.image_region, self.waiting = gaussian, tuple(image_region), {}

    def add(
        self, tile_logits: torch.Tensor, region: tuple, flip_axes: tuple[int, ...], fold: int, variant: int
    ) -> None:
        """One member's ``(K, *tile)`` logits of the tile at ``region`` (of the padded volume), flipped along the
        tile's ``flip_axes`` (its mirror variant ``variant``), predicted by ``fold``; counted once every member of
        its tile is in."""
        import torch

        assert self.gaussian is not None, "start() first"
        if self.agreement.regions:
            labels = tile_logits > 0  # (K, *tile) bool
            flip = [a + 1 for a in flip_axes]
        else:
            labels = tile_logits.argmax(dim=0).to(torch.uint8)  # (*tile)
            flip = list(flip_axes)
        if flip:
            labels = torch.flip(labels, flip)
        labels = labels.to(self.gaussian.device)
        key = _region_key(region)
        if self.agreement.of == "folds":
            key, member = (key, variant), fold
        else:
            member = variant
        group = self.waiting.setdefault(key, {})
        group[member] = labels
        if len(group) == self.agreement.members:
            del self.waiting[key]
            self._count([group[m] for m in sorted(group)], region)

    def _count(self, labels: list[torch.Tensor], region: tuple) -> None:
        """Add one tile's members' label tiles to ``gram``: per class, the weighted masks' products."""
        import torch

        assert self.gram is not None and self.gaussian is not None
        weights = _tile_weights(self.gaussian, region, self.image_region).reshape(1, -1)
        for i, c in enumerate(self.classes):
            masks = torch.stack([(lab[c] if self.agreement.regions else lab == c).reshape(-1) for lab in labels])
            masks = masks.to(torch.float32)  # (M, voxels)
            self.gram[i] += ((masks * weights) @ masks.T).double()
            del masks

    def pairwise_dice(self) -> dict[int, float]:
        """Per compared class (``Agreement.classes``): the mean Dice over the member pairs of which at least one
        labels the class somewhere; NaN where no member does. One host sync."""
        if self.waiting:
            raise ValueError(f"{len(self.waiting)} tile(s) still wait for other members: not every member ran them")
        assert self.gram is not None
        gram = self.gram.cpu().numpy()
        out = {}
        m = self.agreement.members
        for i, c in enumerate(self.classes):
            g = gram[i]
            dice = [
                2 * g[a, b] / (g[a, a] + g[b, b]) for a in range(m) for b in range(a + 1, m) if g[a, a] + g[b, b] > 0
            ]
            out[c] = float(sum(dice) / len(dice)) if dice else math.nan
        return out


def _region_key(region: tuple) -> tuple:
    return tuple((r.start, r.stop) if isinstance(r, slice) else r for r in region)


def _tile_weights(gaussian: torch.Tensor, region: tuple, image_region: tuple[slice, ...]) -> torch.Tensor:
    """The Gaussian of a tile at ``region`` (padded volume; a 2D tile's z is an index), 0 where the tile lies over
    the padding around ``image_region``."""
    import torch

    axes = [(r, i) for r, i in zip(region, image_region, strict=True) if isinstance(r, slice)]
    inside = tuple(slice(max(i.start - r.start, 0), min(i.stop, r.stop) - r.start) for r, i in axes)
    if all(s.start == 0 and s.stop == n for s, n in zip(inside, gaussian.shape, strict=True)):
        return gaussian
    weights = torch.zeros_like(gaussian)
    weights[inside] = gaussian[inside]
    return weights
