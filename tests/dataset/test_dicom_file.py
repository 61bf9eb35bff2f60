"""The DICOM walk that finds a truncated slice file: every cut inside an element is found, in each layout it
reads (explicit and implicit VR, big endian, sequences and items of undefined length, UN of undefined length,
encapsulated pixel data); a complete file, a file with no image in it and a non-DICOM file are not refused."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from dicom_series import write_dicom_series

from autoseg.dataset.dicom_file import (
    EXPLICIT_BIG,
    EXPLICIT_LITTLE,
    IMPLICIT_LITTLE,
    DicomCheck,
    check_dicom_file,
    incomplete_dicom_files,
)

SERIES = "1.2.826.0.1.99.5"
JPEG = "1.2.840.10008.1.2.4.70"


def _element(
    order: str, explicit: bool, group: int, element: int, vr: bytes, value: bytes, undefined: bool = False
) -> bytes:
    length = 0xFFFFFFFF if undefined else len(value)
    tag = struct.pack(order + "2H", group, element)
    if group == 0xFFFE or not explicit:
        return tag + struct.pack(order + "I", length) + value
    if vr in (b"OB", b"OW", b"SQ", b"UN", b"UT"):
        return tag + vr + struct.pack(order + "2xI", length) + value
    return tag + vr + struct.pack(order + "H", length) + value


def _dicom(syntax: str, rows: bool = True, pixels: bool = True) -> tuple[bytes, list[int]]:
    """A small DICOM file of ``syntax`` with nested sequences; its bytes and the offsets where its top-level
    elements start (a cut there leaves whole elements: not a truncation this walk can see)."""
    uid = syntax.encode() + (b"\0" if len(syntax) % 2 else b"")
    meta = _element("<", True, 2, 0x10, b"UI", uid)
    head = b"\0" * 128 + b"DICM" + _element("<", True, 2, 0, b"UL", struct.pack("<I", len(meta))) + meta
    order, explicit = (">" if syntax == EXPLICIT_BIG else "<"), syntax != IMPLICIT_LITTLE
    el = lambda g, e, vr, value, undefined=False: _element(order, explicit, g, e, vr, value, undefined)  # noqa: E731
    item = lambda value, undefined=False: _element(order, explicit, 0xFFFE, 0xE000, b"", value, undefined)  # noqa: E731
    end_item, end_sequence = (_element(order, explicit, 0xFFFE, e, b"", b"") for e in (0xE00D, 0xE0DD))
    inner = el(0x0008, 0x0100, b"SH", b"T-1234") + el(0x0008, 0x0104, b"LO", b"a code")
    un = [
        _element("<", False, g, e, b"", v, undefined=u)  # a UN of undefined length: implicit VR little endian
        for g, e, v, u in (
            (0xFFFE, 0xE000, b"", True),
            (0x0009, 0x1001, b"private!", False),
            (0xFFFE, 0xE00D, b"", False),
            (0xFFFE, 0xE0DD, b"", False),
        )
    ]
    body = [
        el(0x0008, 0x0060, b"CS", b"CT"),
        el(0x0008, 0x1140, b"SQ", item(inner, undefined=True) + end_item + item(inner) + end_sequence, True),
        el(0x0009, 0x1010, b"UN", b"".join(un), True) if explicit else b"",
        el(0x0020, 0x000E, b"UI", SERIES.encode()),
    ]
    if rows:
        body.append(el(0x0028, 0x0010, b"US", struct.pack(order + "H", 4)))
    if pixels and syntax == JPEG:  # encapsulated: an empty offset table, two fragments, the delimiter
        body.append(
            el(0x7FE0, 0x0010, b"OB", item(b"") + item(b"\xff\xd8" + b"j" * 30) + item(b"pe" * 9) + end_sequence, True)
        )
    elif pixels:
        body.append(el(0x7FE0, 0x0010, b"OW", np.arange(16, dtype=order + "i2").tobytes()))
    starts = list(np.cumsum([len(head)] + [len(b) for b in body]))
    return head + b"".join(body), starts


@pytest.mark.parametrize("syntax", [EXPLICIT_LITTLE, IMPLICIT_LITTLE, EXPLICIT_BIG, JPEG])
def test_every_cut_inside_an_element_is_found(syntax: str, tmp_path: Path) -> None:
    data, starts = _dicom(syntax)
    path = tmp_path / "slice.dcm"
    path.write_bytes(data)
    assert check_dicom_file(path) == DicomCheck(SERIES, None)
    missed = []
    for size in range(starts[0] + 1, len(data)):
        path.write_bytes(data[:size])
        found = check_dicom_file(path)
        if found.problem is None and size not in starts[:-2]:  # cut after Rows, before the pixel data: found too
            missed.append(size)
        elif found.problem is not None:
            assert (
                found.problem.startswith(f"{path}: truncated: ")
                and f"holds {size} bytes" in found.problem
                or "before the pixel data" in found.problem
            )
    assert missed == []


def test_a_file_without_an_image_is_not_refused_but_an_image_header_without_pixels_is(tmp_path: Path) -> None:
    (tmp_path / "DICOMDIR").write_bytes(_dicom(EXPLICIT_LITTLE, rows=False, pixels=False)[0])
    (tmp_path / "notes.txt").write_text("not DICOM at all")
    assert check_dicom_file(tmp_path / "DICOMDIR").problem is None
    assert check_dicom_file(tmp_path / "notes.txt") is None
    (tmp_path / "header_only.dcm").write_bytes(_dicom(EXPLICIT_LITTLE, pixels=False)[0])
    assert incomplete_dicom_files(tmp_path) == [
        f"{tmp_path / 'header_only.dcm'}: truncated: it ends after its image "
        f"header, before the pixel data (7FE0,0010), at byte "
        f"{(tmp_path / 'header_only.dcm').stat().st_size}"
    ]


def test_a_truncated_slice_counts_against_its_own_series_or_any_when_its_series_is_cut_off(tmp_path: Path) -> None:
    voxels = np.arange(3 * 6 * 5, dtype=np.int16).reshape(3, 6, 5)
    write_dicom_series(tmp_path, voxels, "1.2.3.1")
    write_dicom_series(tmp_path, voxels, "1.2.3.2")
    assert incomplete_dicom_files(tmp_path) == []
    cut = tmp_path / "1.2.3.2-001.dcm"
    size = cut.stat().st_size
    cut.write_bytes(cut.read_bytes()[:-1])  # a byte of its pixel data (6 x 5 int16: 60 bytes)
    assert incomplete_dicom_files(tmp_path) == [
        f"{cut}: truncated: element (7FE0,0010) (pixel data) announces 60 "
        f"bytes, up to byte {size}, but the file holds {size - 1} bytes"
    ]
    assert incomplete_dicom_files(tmp_path, "1.2.3.2") == incomplete_dicom_files(tmp_path)
    assert incomplete_dicom_files(tmp_path, "1.2.3.1") == []
    cut.write_bytes(cut.read_bytes()[:300])  # before its series UID: it could be either series'
    assert [p.split(":")[0] for p in incomplete_dicom_files(tmp_path, "1.2.3.1")] == [str(cut)]
