"""The workspace folder: every artifact of one dataset's pipeline, so commands need no dataset id.

::

    workspace.json  fingerprint.json  plans.json  splits.json
    preprocessed/<config>/   results/<config>/fold_<k>/
    inference.json  find_best.json  find_best.md      (autoseg find-best)
    .locks/                  the lock of each part being written (``autoseg.core.lock``)

``workspace.json`` (``WorkspaceInfo``) records which dataset the workspace was made from: its folder and
its ``DatasetSource``, the content of dataset.json and, per file of imagesTr/ and labelsTr/, its name, size
and a hash of its first and last 64 KiB (``dataset_source``). Content, not paths or mtimes: a copy of the
dataset (``cp -r``) is the same dataset, a file replaced or truncated in place is not.
"""

from __future__ import annotations

import glob
import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from autoseg.core.artifacts import Artifact, ArtifactError
from autoseg.core.errors import InputError
from autoseg.core.units import KiB

SOURCE_FOLDERS = ("imagesTr", "labelsTr")  # the dataset's training files, the ones a workspace is made from
HEAD_TAIL_BYTES = 64 * KiB  # hashed at each end of a file: catches truncation and replacement, reads little


@dataclass(frozen=True)
class SourceFile:
    """One file of a dataset, as ``dataset_source`` saw it."""

    name: str  # relative to the dataset root, e.g. "imagesTr/case_000_0000.nii.gz"
    size_bytes: int
    head_tail_hash: str  # blake2b-128 of the first and last HEAD_TAIL_BYTES (the whole file when smaller)


@dataclass(frozen=True)
class DatasetSource:
    """What a workspace was made from: dataset.json's content hash and the training files."""

    dataset_json_hash: str
    files: tuple[SourceFile, ...]  # sorted by name

    def digest_of(self, names: list[str]) -> str:
        """A hash of the entries of ``names`` (e.g. one case's image and label files); a name not in the
        dataset counts as missing."""
        entries = {f.name: f for f in self.files}
        h = hashlib.blake2b(digest_size=16)
        for name in sorted(names):
            f = entries.get(name)
            h.update(f"{name}\0{f.size_bytes if f else -1}\0{f.head_tail_hash if f else ''}\n".encode())
        return h.hexdigest()

    def changes_since(self, old: DatasetSource) -> list[str]:
        """What differs from ``old``, one line each ("imagesTr/a.nii.gz: added"); empty when nothing does."""
        before, now = {f.name: f for f in old.files}, {f.name: f for f in self.files}
        lines = [] if self.dataset_json_hash == old.dataset_json_hash else ["dataset.json: edited"]
        for name in sorted(before.keys() | now.keys()):
            a, b = before.get(name), now.get(name)
            if a is None:
                lines.append(f"{name}: added")
            elif b is None:
                lines.append(f"{name}: removed")
            elif a.size_bytes != b.size_bytes:
                lines.append(f"{name}: replaced or truncated ({a.size_bytes} -> {b.size_bytes} bytes)")
            elif a.head_tail_hash != b.head_tail_hash:
                lines.append(f"{name}: replaced (same size, other content)")
        return lines


def _head_tail_hash(path: Path, size: int) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        h.update(f.read(HEAD_TAIL_BYTES))
        if size > HEAD_TAIL_BYTES:
            f.seek(max(HEAD_TAIL_BYTES, size - HEAD_TAIL_BYTES))
            h.update(f.read(HEAD_TAIL_BYTES))
    return h.hexdigest()


def dataset_source(root: str | Path) -> DatasetSource:
    """The ``DatasetSource`` of the dataset folder ``root`` (reads dataset.json and at most 128 KiB per
    training file). Hidden files (``.DS_Store``, editors' temporaries) are left out."""
    root = Path(root)
    files = []
    for folder in SOURCE_FOLDERS:
        for path in sorted((root / folder).glob("*")):
            if path.is_file() and not path.name.startswith("."):
                size = path.stat().st_size
                files.append(SourceFile(f"{folder}/{path.name}", size, _head_tail_hash(path, size)))
    dataset_json = hashlib.blake2b((root / "dataset.json").read_bytes(), digest_size=16).hexdigest()
    return DatasetSource(dataset_json, tuple(sorted(files, key=lambda f: f.name)))


def _info_1_to_2(payload: dict) -> dict:
    """A workspace.json written before fingerprints (schema 1): its dataset is unknown (``dataset`` None)."""
    return {**payload, "dataset": None, "plans_hash": ""}


@dataclass(frozen=True)
class WorkspaceInfo(Artifact):
    """``workspace.json``: the dataset the workspace was made from. ``dataset`` None: unknown (a workspace
    written by autoseg before schema 2; see ``autoseg.plan.run.check_dataset`` for how that is treated).
    ``plans_hash``: of plans.json as the planner wrote it ("" unknown): another hash means it was edited by
    hand since."""

    SCHEMA_VERSION = 2
    KIND = "workspace"
    UPGRADES = {1: _info_1_to_2}

    dataset_root: str
    dataset: DatasetSource | None = None
    plans_hash: str = ""


@dataclass(frozen=True)
class FoldSplit:
    train: tuple[str, ...]
    val: tuple[str, ...]


@dataclass(frozen=True)
class Splits(Artifact):
    SCHEMA_VERSION = 1
    KIND = "splits"

    seed: int
    folds: tuple[FoldSplit, ...]


@dataclass(frozen=True)
class Workspace:
    root: Path

    @classmethod
    def at(cls, root: str | Path) -> Workspace:
        return cls(Path(root).expanduser().resolve())

    @property
    def info_path(self) -> Path:
        return self.root / "workspace.json"

    @property
    def fingerprint_path(self) -> Path:
        return self.root / "fingerprint.json"

    @property
    def plans_path(self) -> Path:
        return self.root / "plans.json"

    @property
    def splits_path(self) -> Path:
        return self.root / "splits.json"

    @property
    def inference_path(self) -> Path:
        """``inference.json`` (``autoseg.predict.choice``): the configuration(s) and postprocessing to predict with."""
        return self.root / "inference.json"

    @property
    def find_best_path(self) -> Path:
        """``find_best.json``: every candidate's cross-validation figures (``find_best.md``: the same as a table)."""
        return self.root / "find_best.json"

    def preprocessed(self, config: str) -> Path:
        return self.root / "preprocessed" / config

    def results(self, config: str, fold: int | str) -> Path:
        return self.root / "results" / config / f"fold_{fold}"

    def checkpoint(self, config: str, fold: int | str, which: str) -> Path:
        """A fold's ``checkpoint_{which}.pt``: ``latest`` (each epoch), ``best`` (pseudo-Dice EMA), ``final``."""
        return self.results(config, fold) / f"checkpoint_{which}.pt"

    @property
    def locks_dir(self) -> Path:
        """``.locks/``: one lock file per part a command is writing (``autoseg.core.lock``); empty at rest."""
        return self.root / ".locks"

    @property
    def plan_lock(self) -> Path:
        """Held by `plan` / `plan_and_preprocess`: workspace.json, fingerprint.json, plans.json, splits.json and
        preprocessed/."""
        return self.locks_dir / "plan.lock"

    def fold_lock(self, config: str, fold: int | str) -> Path:
        """Held by `train` while it writes ``results/<config>/fold_<fold>/``."""
        return self.locks_dir / f"results.{config}.fold_{fold}.lock"

    def fold_locks(self, config: str) -> list[Path]:
        """The lock files of ``config``'s folds there are now (held, or left by a process that is gone)."""
        return sorted(self.locks_dir.glob(f"results.{glob.escape(config)}.fold_*.lock"))

    @property
    def inference_lock(self) -> Path:
        """Held by `find-best` while it writes inference.json, find_best.json and find_best.md."""
        return self.locks_dir / "inference.lock"

    def trained_folds(self, config: str, which: str = "final") -> tuple[int, ...]:
        """The numbered folds of ``config`` that have ``checkpoint_{which}.pt``, in order."""
        found = (self.root / "results" / config).glob(f"fold_*/checkpoint_{which}.pt")
        return tuple(sorted(int(p.parent.name[5:]) for p in found if p.parent.name[5:].isdigit()))

    def info(self) -> WorkspaceInfo:
        if not self.info_path.is_file():
            raise ArtifactError(
                f"{self.root}: not an autoseg workspace (no workspace.json); run "
                f"`{self.advice('plan_and_preprocess')}` first"
            )
        return WorkspaceInfo.from_json(self.info_path)

    def dataset_root(self) -> Path:
        return Path(self.info().dataset_root)

    def set_aside(self, path: Path) -> Path | None:
        """Rename ``path`` (a results folder, splits.json) to the first free ``<name>.stale-<n>`` (before a
        file's suffix: ``splits.stale-1.json``) and return the new path; None when there is nothing there (an
        empty folder is removed). What a change made stale is kept for the user, never deleted."""
        if path.is_dir() and not any(path.iterdir()):
            path.rmdir()
        if not path.exists():
            return None
        n = 1
        while (target := path.with_name(f"{path.stem}.stale-{n}{path.suffix}")).exists():
            n += 1
        path.rename(target)
        return target

    def require(self, path: Path, produced_by: str) -> Path:
        """``path``, or an ``ArtifactError`` advising the command that writes it (``advice(produced_by)``)."""
        if not path.exists():
            raise ArtifactError(f"{path} not found; run `{self.advice(produced_by)}` first")
        return path

    def advice(self, command: str) -> str:
        """``autoseg COMMAND`` as a user runs it on this workspace: a planning command (``plan``,
        ``plan_and_preprocess``) takes the dataset this workspace was made from (``DATASET`` before there is
        one) as its first argument; ``-w`` comes last."""
        name, *rest = command.split()
        if name in ("plan", "plan_and_preprocess"):
            rest.insert(0, str(self.dataset_root()) if self.info_path.is_file() else "DATASET")
        return " ".join(["autoseg", name, *rest, "-w", str(self.root)])


NUM_FOLDS = 5  # the cross-validation's folds (fewer when there are fewer cases)


def make_splits(case_ids: list[str], num_folds: int = NUM_FOLDS, seed: int = 12345) -> Splits:
    """Seeded k-fold split of the sorted case ids (each case in exactly one validation fold)."""
    ids = sorted(case_ids)
    if len(ids) < 2:
        raise InputError(f"need at least 2 training cases for a train/validation split, found {len(ids)}")
    k = min(num_folds, len(ids))
    order = np.random.default_rng(seed).permutation(len(ids))
    chunks = np.array_split(order, k)
    folds = []
    for i in range(k):
        val = sorted(ids[j] for j in chunks[i])
        folds.append(FoldSplit(train=tuple(sorted(set(ids) - set(val))), val=tuple(val)))
    return Splits(seed=seed, folds=tuple(folds))


def load_or_create_splits(workspace: Workspace, case_ids: list[str], seed: int = 12345) -> Splits:
    """Reuse splits.json when it exists (and covers these cases), else create and save it."""
    if workspace.splits_path.is_file():
        splits = Splits.from_json(workspace.splits_path)
        known = {c for f in splits.folds for c in f.val}
        if known == set(case_ids):
            _check_split_cases(workspace.splits_path, splits, known)
            return splits
        raise ArtifactError(
            f"{workspace.splits_path}: its cases differ from the preprocessed ones "
            f"({len(known)} vs {len(case_ids)}); delete it to make new splits"
        )
    splits = make_splits(case_ids, seed=seed)
    splits.to_json(workspace.splits_path)
    return splits


def _check_split_cases(path: Path, splits: Splits, case_ids: set[str]) -> None:
    """Every id of every fold (training and validation) is one of ``case_ids``, the preprocessed cases: an id is
    used as a file name, so one that is not a case (a path that climbs out of the workspace, a typo) is refused
    naming the file, the fold and the id, never read from wherever it points."""
    for k, fold in enumerate(splits.folds):
        for role, ids in (("train", fold.train), ("val", fold.val)):
            strangers = [c for c in ids if c not in case_ids]
            if strangers:
                raise ArtifactError(
                    f"{path}: fold {k}'s {role} holds {strangers[0]!r}, which is not a preprocessed case of this "
                    f"workspace{f' ({len(strangers)} such ids)' if len(strangers) > 1 else ''}; fix the id, or delete "
                    "the file to make new splits"
                )
