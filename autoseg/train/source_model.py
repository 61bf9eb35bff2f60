"""The trained model a run starts from (``autoseg train --init-from``) or a plan copies (``autoseg plan --like``): a
model archive (``autoseg export-model``'s zip, and ``autoseg import-nnunet``'s: an imported nnU-Net model is one), a
fold's checkpoint file, or a workspace.

Each is read by the code that owns its format: an archive is checked and unpacked by
``autoseg.predict.archive_reader.open_model_archive``, a checkpoint read by
``autoseg.model.checkpoint_file.read_checkpoint_file`` (``weights_only=True``), a plan by ``Plans.from_json``. A
checkpoint file inside a workspace (``results/<config>/fold_<k>/checkpoint_*.pt``) takes its label set from that
workspace's plans.json; one outside any workspace has only the configuration it records (``plan_configuration``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from autoseg.core.artifacts import from_dict
from autoseg.core.errors import InputError
from autoseg.core.workspace import Workspace
from autoseg.model.checkpoint_file import read_checkpoint_file
from autoseg.plan.like import PlanTemplate
from autoseg.plan.plans import ConfigurationPlan, Plans, upgrade_network_payload
from autoseg.predict.archive import MANIFEST, ModelManifest
from autoseg.predict.graphs import file_digest

ARCHIVE, CHECKPOINT, WORKSPACE = "archive", "checkpoint", "workspace"
WORKSPACE_CHECKPOINT = "final"  # a workspace's fold starts a run from its checkpoint_final.pt


@dataclass(frozen=True)
class SourceModel:
    """One fold of a trained model, as read: where from, which configuration and fold, the checkpoint's sha256, the
    model's plan (None: a checkpoint file outside its workspace) and the configuration its weights were trained
    with."""

    given: Path  # the model as named (--init-from, --like), resolved
    kind: str  # ARCHIVE, CHECKPOINT or WORKSPACE
    config_name: str
    fold: str  # "" for a checkpoint file named directly
    checkpoint: str  # the file read: its path in the archive or workspace, or the file's name
    sha256: str
    plans: Plans | None
    config: ConfigurationPlan

    def describe(self) -> str:
        fold = f" fold {self.fold}" if self.fold else ""
        return f"{self.given} ({self.kind}, {self.config_name}{fold}, {self.checkpoint}, sha256 {self.sha256[:12]})"


def kind_of(path: Path) -> str:
    """ARCHIVE (a zip file), CHECKPOINT (any other file) or WORKSPACE (a folder with plans.json); else an error."""
    if path.is_dir():
        if not Workspace.at(path).plans_path.is_file():
            raise InputError(
                f"{path}: a folder without plans.json is no autoseg workspace; give a model archive (autoseg "
                "export-model, autoseg import-nnunet), a checkpoint file or a trained workspace"
            )
        return WORKSPACE
    if not path.is_file():
        raise InputError(f"{path}: no such file or folder; give a model archive, a checkpoint file or a workspace")
    return ARCHIVE if path.suffix == ".zip" else CHECKPOINT


def read_model_plan(model: str | Path) -> PlanTemplate:
    """What ``plan --like`` copies: the configurations of ``model``'s plan (a checkpoint file outside a workspace:
    the one it was trained with)."""
    path = Path(model).expanduser().resolve()
    kind = kind_of(path)
    if kind == CHECKPOINT and _workspace_of(path) is None:
        state = read_checkpoint_file(path, "give another checkpoint, an archive or a workspace")
        config = _recorded_configuration(state, path)
        return PlanTemplate(str(path), {config.name: config})
    with _model_workspace(path, kind) as workspace:
        plans = Plans.from_json(workspace.require(workspace.plans_path, "plan"))
    return PlanTemplate(str(path), dict(plans.configurations))


def open_source_model(
    model: str | Path, config_name: str, fold: str | None
) -> tuple[SourceModel, dict[str, torch.Tensor]]:
    """One fold of ``model`` and its network's weights (on the CPU): configuration ``config_name`` where the model has
    it, else the model's own (an archive's first, a workspace's default); ``fold`` (None: the model's first)."""
    path = Path(model).expanduser().resolve()
    kind = kind_of(path)
    if kind == CHECKPOINT:
        if fold is not None:
            raise InputError(f"--init-fold {fold}: {path} is one fold's checkpoint file; leave --init-fold out")
        return _read_fold(path, kind, path, "", None)
    with _model_workspace(path, kind) as workspace:
        plans = Plans.from_json(workspace.require(workspace.plans_path, "plan"))
        name, folds, which = _held(path, kind, workspace, plans, config_name)
        chosen = _chosen_fold(path, name, folds, fold)
        file = workspace.checkpoint(name, chosen, which)
        return _read_fold(path, kind, file, chosen, (workspace, plans))


def _read_fold(
    given: Path, kind: str, file: Path, fold: str, where: tuple[Workspace, Plans] | None
) -> tuple[SourceModel, dict[str, torch.Tensor]]:
    """The checkpoint ``file`` read (``weights_only``) as a ``SourceModel`` and its network weights."""
    state = read_checkpoint_file(file, "give another fold (--init-fold) or another model to --init-from")
    weights = state.get("network")
    if not isinstance(weights, dict) or not weights:
        raise InputError(f"{file}: holds no network weights; give another model to --init-from")
    if where is None:
        where = _workspace_of(file)
    if where is None:
        plans, config, digest = None, _recorded_configuration(state, file), file_digest(file)
        return SourceModel(given, kind, config.name, fold, file.name, digest, plans, config), weights
    workspace, plans = where
    config_name = str(state.get("config") or state.get("config_name") or file.parent.parent.name)
    member = file.relative_to(workspace.root).as_posix()
    digest = _archive_digest(workspace, member) if kind == ARCHIVE else file_digest(file)
    # what the weights were trained with: the checkpoint's record where it has one (an imported model's has none)
    config = _recorded_configuration(state, file) if "plan_configuration" in state else plans.configuration(config_name)
    return SourceModel(given, kind, config_name, fold, member, digest, plans, config), weights


def _archive_digest(workspace: Workspace, member: str) -> str:
    """The sha256 the archive's manifest lists for ``member`` (checked when it was unpacked)."""
    manifest = ModelManifest.from_json(workspace.root / MANIFEST)
    return next(m.sha256 for m in manifest.members if m.name == member)


@contextmanager
def _model_workspace(path: Path, kind: str) -> Iterator[Workspace]:
    """The model as a workspace: the folder itself, the archive checked and unpacked (for the block's length), or the
    workspace a checkpoint file lies in."""
    if kind == WORKSPACE:
        yield Workspace.at(path)
    elif kind == ARCHIVE:
        from autoseg.predict.archive_reader import open_model_archive

        with open_model_archive(path, load_checkpoints=False) as opened:
            yield opened.workspace
    else:
        found = _workspace_of(path)
        assert found is not None  # read_model_plan reads a checkpoint outside a workspace itself
        yield found[0]


def _workspace_of(checkpoint: Path) -> tuple[Workspace, Plans] | None:
    """The workspace and plan of a checkpoint at ``<root>/results/<config>/fold_<k>/``; None elsewhere."""
    if len(checkpoint.parents) < 4 or checkpoint.parents[2].name != "results":
        return None
    workspace = Workspace.at(checkpoint.parents[3])
    if not workspace.plans_path.is_file():
        return None
    return workspace, Plans.from_json(workspace.plans_path)


def _recorded_configuration(state: dict, path: Path) -> ConfigurationPlan:
    """The configuration a checkpoint records it was trained with (``plan_configuration``)."""
    text = state.get("plan_configuration")
    if not isinstance(text, str):
        raise InputError(
            f"{path}: records no plan configuration, and lies in no workspace with a plans.json; give the workspace "
            "or the model archive it belongs to"
        )
    payload = json.loads(text)
    upgrade_network_payload(payload.get("network", {}))
    return from_dict(ConfigurationPlan, payload, f"{path} (plan_configuration)")


def _held(
    path: Path, kind: str, workspace: Workspace, plans: Plans, config_name: str
) -> tuple[str, tuple[str, ...], str]:
    """(configuration, its folds with weights, which checkpoint) of the model: ``config_name`` where it holds it, else
    its own."""
    if kind == ARCHIVE:
        manifest = ModelManifest.from_json(workspace.root / MANIFEST)
        held = manifest.configurations
        name = config_name if config_name in held else held[0]
        return name, tuple(str(f) for f in manifest.folds), manifest.checkpoint
    trained = [c for c in plans.configurations if _workspace_folds(workspace, c)]
    if not trained:
        raise InputError(f"{path}: no fold of any configuration is trained (no checkpoint_final.pt); train one first")
    default = plans.default_configuration()
    name = config_name if config_name in trained else default if default in trained else trained[0]
    return name, _workspace_folds(workspace, name), WORKSPACE_CHECKPOINT


def _workspace_folds(workspace: Workspace, config_name: str) -> tuple[str, ...]:
    numbered = tuple(str(f) for f in workspace.trained_folds(config_name, WORKSPACE_CHECKPOINT))
    every = workspace.checkpoint(config_name, "all", WORKSPACE_CHECKPOINT).is_file()
    return numbered + (("all",) if every else ())


def _chosen_fold(path: Path, config_name: str, folds: tuple[str, ...], fold: str | None) -> str:
    if fold is None:
        return folds[0]
    if fold not in folds:
        raise InputError(
            f"--init-fold {fold}: {path} holds fold(s) {' '.join(folds)} of {config_name}; give one of them, or "
            "leave --init-fold out for the first"
        )
    return fold
