"""Image files with the headers SimpleITK refuses to write (a negative or zero spacing, an axis of size 0), for
tests of what autoseg does with them: a MetaImage header is text, so it is written as SimpleITK wrote it, then
one line changed."""

from __future__ import annotations

from pathlib import Path

import SimpleITK as sitk


def as_mha(path: Path) -> Path:
    """``path`` (any format SimpleITK reads) rewritten beside it as an uncompressed .mha; the original removed."""
    ending = ".nii.gz" if path.name.endswith(".nii.gz") else path.suffix
    mha = path.with_name(path.name[: -len(ending)] + ".mha")
    sitk.WriteImage(sitk.ReadImage(str(path)), str(mha))
    path.unlink()
    return mha


def set_mha_header(mha: Path, key: str, value: str) -> None:
    """The header line ``key = ...`` of the uncompressed .mha file ``mha`` replaced by ``key = value``."""
    head, sep, body = mha.read_bytes().partition(b"ElementDataFile = LOCAL\n")
    lines = [f"{key} = {value}".encode() if ln.startswith(key.encode()) else ln for ln in head.split(b"\n")]
    mha.write_bytes(b"\n".join(lines) + sep + body)
