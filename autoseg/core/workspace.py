"""The workspace folder: every artifact of one dataset's pipeline, so commands need no dataset id.

::

    workspace.json  fingerprint.json  plans.json  splits.json
    preprocessed/<config>/   results/<config>/fold_<k>/
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from autoseg.core.artifacts import Artifact, ArtifactError
from autoseg.core.errors import InputError


@dataclass(frozen=True)
class WorkspaceInfo(Artifact):
    SCHEMA_VERSION = 1
    KIND = "workspace"

    dataset_root: str


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

    def preprocessed(self, config: str) -> Path:
        return self.root / "preprocessed" / config

    def results(self, config: str, fold: int | str) -> Path:
        return self.root / "results" / config / f"fold_{fold}"

    def checkpoint(self, config: str, fold: int | str, which: str) -> Path:
        """A fold's ``checkpoint_{which}.pt``: ``latest`` (each epoch), ``best`` (pseudo-Dice EMA), ``final``."""
        return self.results(config, fold) / f"checkpoint_{which}.pt"

    def trained_folds(self, config: str, which: str = "final") -> tuple[int, ...]:
        """The numbered folds of ``config`` that have ``checkpoint_{which}.pt``, in order."""
        found = (self.root / "results" / config).glob(f"fold_*/checkpoint_{which}.pt")
        return tuple(sorted(int(p.parent.name[5:]) for p in found if p.parent.name[5:].isdigit()))

    def dataset_root(self) -> Path:
        if not self.info_path.is_file():
            raise ArtifactError(f"{self.root}: not an autoseg workspace (no workspace.json); run "
                                f"`autoseg plan_and_preprocess DATASET -w {self.root}` first")
        return Path(WorkspaceInfo.from_json(self.info_path).dataset_root)

    def require(self, path: Path, produced_by: str) -> Path:
        if not path.exists():
            raise ArtifactError(f"{path} not found; run `autoseg {produced_by} -w {self.root}` first")
        return path


def make_splits(case_ids: list[str], num_folds: int = 5, seed: int = 12345) -> Splits:
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
            return splits
        raise ArtifactError(f"{workspace.splits_path}: its cases differ from the preprocessed ones "
                            f"({len(known)} vs {len(case_ids)}); delete it to make new splits")
    splits = make_splits(case_ids, seed=seed)
    splits.to_json(workspace.splits_path)
    return splits
