"""Which training cases dataset.json's optional ``"dataset"`` entry names, held to the dataset's own folders.

nnU-Net v2 lets dataset.json list the training cases explicitly instead of taking every label in labelsTr::

    "dataset": {"case_a": {"images": ["imagesTr/case_a_0000.nii.gz"], "label": "labelsTr/case_a.nii.gz"}, ...}

with paths relative to the dataset folder (or absolute). autoseg takes the list, but only inside the dataset: a case
id is a plain name (it becomes a file name in the workspace: ``preprocessed/<config>/<id>_data.npy``, a validation
output), and each image and label is a file directly in imagesTr/ or labelsTr/ (the files a workspace records and
checks for changes, ``autoseg.core.workspace.dataset_source``). A path that leads anywhere else is refused naming
dataset.json and the id, never read from where it points: the workspace could not tell when it changed.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from autoseg.core.errors import InputError

log = logging.getLogger("autoseg")
SHOWN_FILES = 5


def case_id_problem(case_id: object) -> str | None:
    """Why ``case_id`` is not a plain case name (one that stays a file name wherever it is joined to a folder), or
    None: empty, not a string, a path separator, '.' or '..', a leading dot (hidden), a NUL."""
    if not isinstance(case_id, str) or not case_id:
        return "is not a non-empty name"
    if "/" in case_id or "\\" in case_id or "\0" in case_id:
        return "holds a path separator; a case id is a plain name such as 'case_001'"
    if case_id.startswith("."):
        return "starts with '.' (a hidden file, or a path that climbs out of its folder); a case id is a plain name"
    return None


def listed_cases(
    entry: object, meta_path: Path, num_channels: int, ending: str
) -> list[tuple[str, tuple[Path, ...], Path]]:
    """(case id, image files in channel order, label file) for each case of dataset.json's ``"dataset"`` ``entry``
    (``meta_path``: that dataset.json; relative paths are of its folder). Raises ``InputError`` naming dataset.json
    and the case id for an id that is not a plain name, an entry that is not ``{"images": [...], "label": ...}`` with
    one image per channel, or a file outside imagesTr/ (images) and labelsTr/ (labels) or not ending in ``ending``."""
    root = meta_path.parent
    if not isinstance(entry, dict) or not entry:
        raise InputError(
            f"{meta_path}: 'dataset' must map each training case id to "
            '{"images": [...], "label": ...}; found ' + repr(entry)[:60] + "; or remove the key to train on every "
            "label in labelsTr/"
        )
    cases = []
    for case_id, files in entry.items():
        where = f"{meta_path}: 'dataset' entry {case_id!r}"
        if problem := case_id_problem(case_id):
            raise InputError(f"{where}: the case id {problem}")
        images = files.get("images") if isinstance(files, dict) else None
        label = files.get("label") if isinstance(files, dict) else None
        if not isinstance(images, list) or len(images) != num_channels or not isinstance(label, str):
            raise InputError(
                f'{where}: must be {{"images": [{num_channels} file(s), one per channel_names entry], '
                f'"label": file}}; found {files!r}'[:400]
            )
        image_paths = tuple(_inside(root, "imagesTr", p, ending, where) for p in images)
        cases.append((case_id, image_paths, _inside(root, "labelsTr", label, ending, where)))
    return cases


def _inside(root: Path, folder: str, name: object, ending: str, where: str) -> Path:
    """``name`` (relative to ``root``, or absolute) as a path directly in ``root / folder``, ending in ``ending``;
    ``InputError`` naming ``where`` and the path otherwise. Paths are compared as written, without following links: a
    link placed in imagesTr/ is a file of the dataset."""
    if not isinstance(name, str) or not name:
        raise InputError(f"{where}: {name!r} is not a file name")
    path = Path(os.path.normpath(root / name))
    if path.parent != root / folder or path.name.startswith(".") or not path.name.endswith(ending):
        raise InputError(
            f"{where}: {name!r} is not a {ending} file in {root / folder}; autoseg reads training files from the "
            f"dataset's own imagesTr/ and labelsTr/ (the files a workspace checks for changes): move or link the "
            f"file there and name it as {folder}/<file>"
        )
    return path


def warn_unlisted(meta_path: Path, listed: set[Path], ending: str) -> None:
    """A warning naming the files of imagesTr/ and labelsTr/ that the ``"dataset"`` entry (``listed``: the files it
    names) leaves out: they are in the folder but not trained on."""
    root = meta_path.parent
    unlisted = [
        p
        for folder in ("imagesTr", "labelsTr")
        for p in sorted((root / folder).glob(f"*{ending}"))
        if not p.name.startswith(".") and p not in listed
    ]
    if unlisted:
        names = ", ".join(f"{p.parent.name}/{p.name}" for p in unlisted[:SHOWN_FILES])
        more = f" and {len(unlisted) - SHOWN_FILES} more" if len(unlisted) > SHOWN_FILES else ""
        log.warning(
            "%s: its 'dataset' entry does not name %d file(s) of imagesTr/ and labelsTr/ (%s%s): they are not "
            "trained on; add them to the entry, or remove the entry to train on every label in labelsTr/",
            meta_path,
            len(unlisted),
            names,
            more,
        )
