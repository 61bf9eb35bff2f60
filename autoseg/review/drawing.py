"""Pictures drawn with numpy: grey slices windowed to their intensities, each structure's fixed colour, its outline
(solid, dashed) or fill, square pixels for anisotropic spacings, and a legend strip.

The legend in the picture is colour swatches, each with its structure's number (the label value for plain labels,
the region's position for regions), drawn with a 3 x 5 pixel digit font kept here, plus the key of the line styles
("R" solid: reference, "P" dashed: prediction). Names need a full font (matplotlib or Pillow, which an export
thread should not import for one picture); they are in the pages that show the pictures (the evaluation's
index.html) and in docs/evaluation.md's table of colours by number.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# structure i (0-based, in the labels' order) is drawn in COLOURS[i % 20] in every picture: 20 distinct colours
COLOURS = np.array(
    [
        (230, 25, 75), (60, 180, 75), (255, 225, 25), (0, 130, 200), (245, 130, 48),
        (145, 30, 180), (70, 240, 240), (240, 50, 230), (210, 245, 60), (250, 190, 212),
        (0, 128, 128), (220, 190, 255), (170, 110, 40), (255, 250, 200), (128, 0, 0),
        (170, 255, 195), (128, 128, 0), (255, 215, 180), (0, 0, 128), (128, 128, 128),
    ],
    dtype=np.uint8,
)  # fmt: skip
MAX_PANEL_PX = 512  # a panel's longest side at most: its pixel is the finest spacing, coarser for large images
GAP_PX = 4  # between panels
FILL_ALPHA = 0.4  # a filled structure over the image (``preview``)
TEXT_SCALE = 2  # the digit font's pixels are 2 x 2 screen pixels: 6 x 10 per glyph
GLYPHS = {  # 3 x 5 pixels, rows top to bottom
    "0": ("111", "101", "101", "101", "111"),
    "1": ("010", "110", "010", "010", "111"),
    "2": ("111", "001", "111", "100", "111"),
    "3": ("111", "001", "111", "001", "111"),
    "4": ("101", "101", "111", "001", "001"),
    "5": ("111", "100", "111", "001", "111"),
    "6": ("111", "100", "111", "101", "111"),
    "7": ("111", "001", "001", "001", "001"),
    "8": ("111", "101", "111", "101", "111"),
    "9": ("111", "101", "111", "001", "111"),
    "R": ("110", "101", "110", "101", "101"),
    "P": ("110", "101", "110", "100", "100"),
}
STYLES = ("solid", "dashed", "filled")


@dataclass(frozen=True)
class Layer:
    """One label map's slices drawn over the image: ``slices`` (one 2D label array per panel), as ``style``
    (``STYLES``: solid or dashed outline, or filled with a solid outline)."""

    slices: tuple[np.ndarray, ...]
    style: str


def colour(index: int) -> np.ndarray:
    """The fixed colour (3,) uint8 of structure ``index`` (0-based, in the labels' order)."""
    return COLOURS[index % len(COLOURS)]


def to_grey(slices: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Image slices -> uint8 grey, windowed together from their 1st to their 99th percentile (so the three slices of
    a picture share one window; a constant image is mid grey)."""
    values = np.concatenate([np.asarray(s, dtype=np.float32).ravel() for s in slices])
    low, high = (np.percentile(values, (1, 99)) if values.size else (0.0, 0.0)).tolist()
    out = []
    for s in slices:
        if high <= low:
            out.append(np.full(s.shape, 128, dtype=np.uint8))
            continue
        scaled = (np.asarray(s, dtype=np.float32) - low) * (255.0 / (high - low))
        out.append(np.clip(scaled, 0, 255).astype(np.uint8))
    return out


def pixel_mm(spacings: Sequence[tuple[float, float]], shapes: Sequence[tuple[int, int]]) -> float:
    """The side of a picture's pixel in mm: the finest spacing of its panels, coarser where a panel would be longer
    than ``MAX_PANEL_PX``."""
    finest = min(min(s) for s in spacings)
    extent = max(n * s for shape, spacing in zip(shapes, spacings) for n, s in zip(shape, spacing))
    return max(finest, extent / MAX_PANEL_PX)


def _nearest(n: int, spacing_mm: float, side_mm: float) -> np.ndarray:
    """Source indices of the pixels that cover an axis of ``n`` samples at ``spacing_mm`` with pixels of
    ``side_mm`` (nearest neighbour at the pixel centres)."""
    count = max(1, round(n * spacing_mm / side_mm))
    return np.minimum(((np.arange(count) + 0.5) * side_mm / spacing_mm).astype(np.int64), n - 1)


def outline(mask: np.ndarray) -> np.ndarray:
    """The pixels of ``mask`` (2D bool) with a 4-neighbour outside it (or on the panel's edge)."""
    inner = np.zeros_like(mask)
    inner[1:-1, 1:-1] = mask[1:-1, 1:-1] & mask[:-2, 1:-1] & mask[2:, 1:-1] & mask[1:-1, :-2] & mask[1:-1, 2:]
    return mask & ~inner


def _dashes(shape: tuple[int, int]) -> np.ndarray:
    """Where a dashed outline is drawn: 3 pixels on, 3 off along rows and columns alike."""
    rows, cols = np.indices(shape)
    return ((rows + cols) // 3) % 2 == 0


def draw_panel(
    grey: np.ndarray, layers: Sequence[tuple[np.ndarray, str]], structures: Sequence[tuple[int, ...]]
) -> np.ndarray:
    """One panel (H, W, 3) uint8: ``grey`` with each layer's structures (``structures[i]``: the label values of
    structure i) drawn in their colours, layers in order (later on top)."""
    rgb = np.repeat(grey[:, :, None], 3, axis=2)
    for labels, style in layers:
        for i, values in enumerate(structures):
            mask = np.isin(labels, values)
            if not mask.any():
                continue
            c = colour(i)
            if style == "filled":
                rgb[mask] = (rgb[mask] * (1 - FILL_ALPHA) + c * FILL_ALPHA).astype(np.uint8)
            edge = outline(mask)
            if style == "dashed":
                edge &= _dashes(mask.shape)
            rgb[edge] = c
    return rgb


def text(label: str, rgb: tuple[int, int, int] = (255, 255, 255)) -> np.ndarray:
    """``label`` (digits, R, P) as an (10, 8 * len, 3) uint8 image on black, in the 3 x 5 font at ``TEXT_SCALE``."""
    glyph_h, glyph_w = 5 * TEXT_SCALE, 4 * TEXT_SCALE  # one font pixel between glyphs
    out = np.zeros((glyph_h, glyph_w * len(label), 3), dtype=np.uint8)
    for k, ch in enumerate(label):
        bits = np.array([[c == "1" for c in row] for row in GLYPHS[ch]])
        big = np.kron(bits, np.ones((TEXT_SCALE, TEXT_SCALE), dtype=bool))
        out[:, k * glyph_w : k * glyph_w + big.shape[1]][big] = rgb
    return out


def legend(width: int, shown: Sequence[int], numbers: Sequence[int], styles: Sequence[str]) -> np.ndarray:
    """The legend strip (H, ``width``, 3): the key of ``styles`` when there are two layers (R solid, P dashed), then a
    swatch and the number of each structure of ``shown`` (indices; ``numbers[i]``: structure i's number), wrapped
    into rows."""
    entries = []
    if "dashed" in styles:
        for name, style in (("R", "solid"), ("P", "dashed")):
            line = np.zeros((10, 16, 3), dtype=np.uint8)
            line[4:6] = 255
            if style == "dashed":
                line[:, np.arange(16) % 6 >= 3] = 0
            entries.append(np.concatenate([text(name), line], axis=1))
    for i in shown:
        swatch = np.zeros((10, 12, 3), dtype=np.uint8)
        swatch[:, :10] = colour(i)
        entries.append(np.concatenate([swatch, text(str(numbers[i]))], axis=1))
    rows, row, used = [], [], 0
    for entry in entries:
        if row and used + entry.shape[1] > width:
            rows.append(row)
            row, used = [], 0
        row.append(entry)
        used += entry.shape[1] + 10
    if row:
        rows.append(row)
    strip = np.zeros((max(len(rows), 1) * 14 + 4, width, 3), dtype=np.uint8)
    for r, entries_of_row in enumerate(rows):
        x = 4
        for entry in entries_of_row:
            w = min(entry.shape[1], width - x)
            if w > 0:
                strip[4 + 14 * r : 14 + 14 * r, x : x + w] = entry[:, :w]
            x += entry.shape[1] + 10
    return strip


def compose(
    image_slices: Sequence[np.ndarray],
    layers: Sequence[Layer],
    spacings_mm: Sequence[tuple[float, float]],
    structures: Sequence[tuple[int, ...]],
    numbers: Sequence[int],
) -> np.ndarray:
    """The picture (H, W, 3) uint8: the panels side by side (image slice ``p`` at ``spacings_mm[p]``, (row, column)
    mm, resampled to square pixels), each layer's slice ``p`` drawn over it (``draw_panel``), and the legend of the
    structures that appear (``numbers``: each structure's number)."""
    side = pixel_mm(spacings_mm, [s.shape for s in image_slices])
    greys = to_grey(image_slices)
    panels, shown = [], set()
    for p, (grey, spacing) in enumerate(zip(greys, spacings_mm)):
        rows = _nearest(grey.shape[0], spacing[0], side)
        cols = _nearest(grey.shape[1], spacing[1], side)
        drawn = [(layer.slices[p][np.ix_(rows, cols)], layer.style) for layer in layers]
        shown.update(i for i, v in enumerate(structures) for labels, _ in drawn if np.isin(labels, v).any())
        panels.append(draw_panel(grey[np.ix_(rows, cols)], drawn, structures))
    height = max(p.shape[0] for p in panels)
    width = sum(p.shape[1] for p in panels) + GAP_PX * (len(panels) - 1)
    out = np.zeros((height, width, 3), dtype=np.uint8)
    x = 0
    for panel in panels:
        out[: panel.shape[0], x : x + panel.shape[1]] = panel
        x += panel.shape[1] + GAP_PX
    strip = legend(width, sorted(shown), numbers, [layer.style for layer in layers])
    return np.concatenate([out, strip], axis=0)


def structure_numbers(structures: Sequence[tuple[int, ...]], regions: bool) -> list[int]:
    """Each structure's number in a picture's legend: its label value (plain labels), its position from 1 (regions)."""
    return [i + 1 if regions else values[0] for i, values in enumerate(structures)]
