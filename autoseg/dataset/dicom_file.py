"""Whether a DICOM file holds every byte its elements announce: a truncated slice, found before a series is read.

GDCM (SimpleITK's DICOM reader) leaves a file it cannot read out of the series it lists, and the series reader
then reads the other slices as one volume with a slice missing, with only a warning ("non uniform sampling or
missing slices"): a 5-slice series whose middle file lost its last byte reads as 4 slices. So
every DICOM file directly in the folder is walked here, element by element, before the series is read.

The walk reads the 128-byte preamble and "DICM", the file meta group (explicit VR little endian) for the
transfer syntax, then each element's tag, VR and length, seeking over the values: a value that reaches past the
end of the file, or a file that ends inside an element's header, is a truncation. Sequences and items of
undefined length are walked to their delimiters, encapsulated (compressed) pixel data fragment by fragment.
A file whose image header (Rows) is followed by no pixel data is truncated too. Cost: a few small reads per
file whatever its size (the pixel data is seeked over, never read). Not checked (left to SimpleITK): deflated
transfer syntax, files without the "DICM" preamble, layouts this walk does not know.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from autoseg.core.errors import InputError

PREAMBLE = 128  # bytes before "DICM"
EXPLICIT_LITTLE, IMPLICIT_LITTLE, EXPLICIT_BIG = "1.2.840.10008.1.2.1", "1.2.840.10008.1.2", "1.2.840.10008.1.2.2"
DEFLATED = "1.2.840.10008.1.2.1.99"
LONG_VRS = frozenset({b"OB", b"OD", b"OF", b"OL", b"OV", b"OW", b"SQ", b"SV", b"UC", b"UN", b"UR", b"UT", b"UV"})
UNDEFINED = 0xFFFFFFFF
ITEM, ITEM_END, SEQUENCE_END = 0xFFFEE000, 0xFFFEE00D, 0xFFFEE0DD  # (group << 16) | element
PIXEL_DATA, SERIES_UID, ROWS, TRANSFER_SYNTAX = 0x7FE00010, 0x0020000E, 0x00280010, 0x00020010


@dataclass(frozen=True)
class DicomCheck:
    """What the walk found: the file's SeriesInstanceUID (None when it ends before it) and why it is
    incomplete (None: complete, or not a layout this walk reads)."""

    series_uid: str | None
    problem: str | None


class _Truncated(Exception):
    pass


class _Unknown(Exception):  # a layout this walk does not read: no verdict
    pass


def check_dicom_file(path: str | Path) -> DicomCheck | None:
    """Walk the DICOM file ``path``; None when it is not one with the "DICM" preamble (not checked here)."""
    path = Path(path)
    with open(path, "rb") as f:
        if f.read(PREAMBLE + 4)[PREAMBLE:] != b"DICM":
            return None
        walk = _Walk(f, path.stat().st_size)
        try:
            walk.meta_group()
            if walk.syntax == DEFLATED:
                return DicomCheck(None, None)
            walk.elements(top=True)
        except _Truncated as e:
            return DicomCheck(walk.series_uid, f"{path}: truncated: {e}, but the file holds {walk.size} bytes")
        except (_Unknown, struct.error, UnicodeDecodeError):
            return DicomCheck(walk.series_uid, None)
    if walk.rows_seen and not walk.pixels_seen:
        return DicomCheck(
            walk.series_uid,
            f"{path}: truncated: it ends after its image header, before the pixel "
            f"data (7FE0,0010), at byte {walk.size}",
        )
    return DicomCheck(walk.series_uid, None)


def incomplete_dicom_files(folder: str | Path, series_uid: str | None = None) -> list[str]:
    """Why each truncated DICOM file directly in ``folder`` is incomplete: those of ``series_uid`` (None: of
    any series) and those that end before saying which series they belong to."""
    problems = []
    for path in sorted(p for p in Path(folder).iterdir() if p.is_file()):
        found = check_dicom_file(path)
        if (
            found is not None
            and found.problem is not None
            and (series_uid is None or found.series_uid in (None, series_uid))
        ):
            problems.append(found.problem)
    return problems


def check_dicom_series(folder: str | Path, series_uid: str) -> None:
    """Refuse (``InputError`` naming each file) the series ``series_uid`` of ``folder`` when a slice file of it,
    or one that ends before saying its series, is truncated."""
    problems = incomplete_dicom_files(folder, series_uid)
    if problems:
        raise InputError(
            f"{folder}: DICOM series {series_uid}: {'; '.join(problems)}; SimpleITK would leave "
            f"{'these files' if len(problems) > 1 else 'it'} out of the volume: copy the series again"
        )


class _Walk:
    """Element headers read from ``f`` (``size`` bytes), values seeked over; raises ``_Truncated``."""

    def __init__(self, f: BinaryIO, size: int) -> None:
        self.f, self.size = f, size
        self.order, self.explicit, self.syntax = "<", True, EXPLICIT_LITTLE
        self.series_uid: str | None = None
        self.rows_seen = self.pixels_seen = False

    def read(self, n: int, what: str) -> bytes:
        data = self.f.read(n)
        if len(data) < n:
            raise _Truncated(f"{what} needs bytes up to {self.f.tell() - len(data) + n}")
        return data

    def skip(self, n: int, tag: int) -> None:
        end = self.f.tell() + n
        if end > self.size:
            raise _Truncated(f"element {_name(tag)} announces {n} bytes, up to byte {end}")
        self.f.seek(end)

    def header(self) -> tuple[int, bytes | None, int]:
        """The next element's tag, VR (None: implicit, or an item/delimiter) and length."""
        start = self.f.tell()
        group, element = struct.unpack(self.order + "2H", self.read(4, f"the element header at byte {start}"))
        tag = (group << 16) | element
        if group == 0xFFFE or not self.explicit:
            return tag, None, struct.unpack(self.order + "I", self.read(4, f"element {_name(tag)}"))[0]
        vr = self.read(2, f"element {_name(tag)}")
        if not vr.isalpha() or not vr.isupper():
            raise _Unknown(tag)
        if vr in LONG_VRS:
            return tag, vr, struct.unpack(self.order + "2xI", self.read(6, f"element {_name(tag)}"))[0]
        return tag, vr, struct.unpack(self.order + "H", self.read(2, f"element {_name(tag)}"))[0]

    def meta_group(self) -> None:
        """The (0002,xxxx) elements (always explicit VR little endian): the transfer syntax of the rest."""
        while self.f.tell() + 4 <= self.size:
            start = self.f.tell()
            if struct.unpack("<H", self.f.read(2))[0] != 0x0002:
                self.f.seek(start)
                break
            self.f.seek(start)
            tag, _, length = self.header()
            if tag == TRANSFER_SYNTAX:
                self.syntax = self.read(length, "the transfer syntax").decode("ascii").strip("\0 ")
            else:
                self.skip(length, tag)
        self.explicit = self.syntax != IMPLICIT_LITTLE
        self.order = ">" if self.syntax == EXPLICIT_BIG else "<"

    def elements(self, top: bool = False) -> None:
        """Elements up to the end of the file (``top``) or to the item delimiter (an item of undefined length)."""
        while not (top and self.f.tell() == self.size):
            tag, vr, length = self.header()
            if tag == ITEM_END:
                return
            if length == UNDEFINED:
                self.items(tag, implicit_inside=vr == b"UN")
            elif top and tag == SERIES_UID:
                self.series_uid = self.read(length, f"element {_name(tag)}").decode("ascii").strip("\0 ")
            else:
                self.skip(length, tag)
            if top:
                self.rows_seen |= tag == ROWS
                self.pixels_seen |= tag == PIXEL_DATA

    def items(self, tag: int, implicit_inside: bool) -> None:
        """A sequence (or encapsulated pixel data) of undefined length: items up to the sequence delimiter.
        An item of known length (a pixel data fragment) is seeked over, one of undefined length walked."""
        outer = self.explicit, self.order
        if implicit_inside:  # UN of undefined length: implicit VR little endian inside, whatever the file's syntax
            self.explicit, self.order = False, "<"
        try:
            while True:
                item, _, length = self.header()
                if item == SEQUENCE_END:
                    return
                if item != ITEM:
                    raise _Unknown(item)
                if length == UNDEFINED and tag != PIXEL_DATA:
                    self.elements()
                else:
                    self.skip(length, tag if tag == PIXEL_DATA else item)
        finally:
            self.explicit, self.order = outer


def _name(tag: int) -> str:
    names = {PIXEL_DATA: " (pixel data)", ITEM: " (item)", SERIES_UID: " (series UID)"}
    return f"({tag >> 16:04X},{tag & 0xFFFF:04X}){names.get(tag, '')}"
