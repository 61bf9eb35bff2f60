from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from png_reader import read_png

from autoseg.review.png import write_png


def test_a_picture_is_written_as_png_and_read_back_equal(tmp_path: Path) -> None:
    rgb = np.random.default_rng(0).integers(0, 256, (7, 11, 3), dtype=np.uint8)
    write_png(tmp_path / "a.png", rgb)
    assert np.array_equal(read_png(tmp_path / "a.png"), rgb)
    assert [p.name for p in tmp_path.iterdir()] == ["a.png"]  # no temporary left


def test_another_decoder_reads_the_png_alike(tmp_path: Path) -> None:
    image = pytest.importorskip("PIL.Image")  # Pillow where installed: not a dependency of autoseg
    rgb = np.arange(5 * 4 * 3, dtype=np.uint8).reshape(5, 4, 3)
    write_png(tmp_path / "a.png", rgb)
    assert np.array_equal(np.asarray(image.open(tmp_path / "a.png").convert("RGB")), rgb)


def test_an_array_that_is_not_rgb_bytes_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"\(H, W, 3\) uint8"):
        write_png(tmp_path / "a.png", np.zeros((4, 4), dtype=np.uint8))
