"""Mirror test-time augmentation: which flips, in which order, and the ``--tta`` flag that picks how many."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from autoseg.core.errors import InputError


def mirror_variants(mirror_axes: Sequence[int], tta: int | None = None) -> list[tuple[int, ...]]:
    """The mirror variants test-time augmentation uses, in their fixed order: the spatial axes flipped by each.

    The order: identity ``()``, each axis of ``mirror_axes`` alone, then every pair, every triple, ...
    (``itertools.combinations`` by size; for (0, 1, 2): (), (0,), (1,), (2,), (0, 1), (0, 2), (1, 2),
    (0, 1, 2)). ``tta``: how many of them, the first ones (None: all ``2 ** len(mirror_axes)``; 0 or 1:
    identity only). ``parse_tta`` turns the ``--tta`` flag into it.
    """
    every = [s for r in range(len(mirror_axes) + 1) for s in itertools.combinations(tuple(mirror_axes), r)]
    if tta is None:
        return every
    if not 0 <= tta <= len(every):
        raise InputError(
            f"tta {tta} is not between 0 and {len(every)}, the number of mirror variants of axes "
            f"{tuple(mirror_axes)}; use --tta all, none or a number in that range"
        )
    return every[: max(tta, 1)]


def parse_tta(value: str, num_axes: int) -> int:
    """``--tta``: "all" (every one of the ``2 ** num_axes`` mirror variants), "none" (identity only, 1) or a
    number N in 0..2 ** num_axes (the first N of ``mirror_variants``' order; 0 means none). Returns the count."""
    total = 2**num_axes
    text = value.strip().lower()
    if text == "all":
        return total
    if text == "none":
        return 1
    if text.isdigit() and int(text) <= total:
        return max(int(text), 1)
    raise InputError(
        f"--tta {value!r}: use all, none or a number of mirror variants from 0 to {total} "
        f"(this network mirrors {num_axes} axes: {total} variants, identity first)"
    )
