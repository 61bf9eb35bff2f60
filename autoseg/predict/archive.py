"""Model archives: a trained model as one zip file that predicts on another machine without its workspace.

::

    autoseg_model.json                              the manifest (``ModelManifest``)
    plans.json  fingerprint.json                    the plan (label scheme included) and the image dim
    inference.json                                  when exported from ``autoseg find-best``'s choice
    results/<config>/fold_<k>/checkpoint_<which>.pt one per chosen fold (of each configuration, and of the
                                                    previous stage of a cascade stage: 3d_cascade_fullres packs
                                                    3d_lowres's same folds, which predict runs first)
    results/<config>/fold_<k>/network.onnx          with the onnx extra: the checkpoint's network as an ONNX
                                                    graph, checked against torch (``autoseg.predict.graphs``)
    results/<config>/fold_<k>/precision_check.json  where the fold has one: its checkpoint's bf16 agreement check
                                                    (``autoseg.predict.precision_check``), what lets
                                                    ``--precision auto`` take bf16

The members keep their workspace paths, so an archive unpacked into a folder *is* a minimal workspace that
``autoseg.predict.predictor.predict`` reads. ``export_model`` writes it (temporary name, then rename);
``autoseg.predict.archive_reader.open_model_archive`` checks and unpacks it.

``export-model`` without ``-c`` in a workspace with ``inference.json`` exports that choice: its configuration or
ensemble of two, its folds (or ``-f``'s, written into the archived inference.json) and its postprocessing; ``predict
-m`` then follows it as ``predict -w`` does (``autoseg.predict.chosen``). With ``-c``, or without inference.json,
one configuration without postprocessing. Archives of format 1 (one configuration, no inference.json) are read.
Graphs and checks are members like any other (listed with size and sha256), so archives with and without them share
format 2; an archive without graphs predicts with torch, one without checks in fp32 on the CPU.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import autoseg
from autoseg.core.artifacts import Artifact, atomic_path, remove_stale_temporaries, to_dict
from autoseg.core.errors import InputError
from autoseg.core.extras import installed
from autoseg.core.lock import refuse_while_held
from autoseg.core.workspace import Workspace
from autoseg.model.onnx_graph import available_runtime
from autoseg.plan.plans import Plans
from autoseg.predict.choice import InferenceChoice
from autoseg.predict.class_weights import CLASS_WEIGHTS_FILE, class_weights_path, stored_weights
from autoseg.predict.graphs import GRAPH_FILE, check_tiles, checked_graph, graph_member
from autoseg.predict.networks import load_trained_network
from autoseg.predict.precision_check import PRECISION_CHECK_FILE, PrecisionCheck, stored_check

MANIFEST = "autoseg_model.json"
# (workspace, plans, configuration, fold, checkpoint) -> the bf16 agreement check packed beside that fold's
# checkpoint, or None
PrecisionChecks = Callable[[Workspace, Plans, str, "int | str", str], "PrecisionCheck | None"]
CHUNK_BYTES = 1 << 20  # members are hashed and copied in 1 MiB pieces: memory does not grow with the model


@dataclass(frozen=True)
class ArchiveMember:
    name: str  # a relative POSIX path inside the archive, e.g. "results/3d_fullres/fold_0/checkpoint_final.pt"
    size_bytes: int
    sha256: str


@dataclass(frozen=True)
class ModelManifest(Artifact):
    """``autoseg_model.json``: what the archive holds. ``schema_version`` is the archive format version."""

    SCHEMA_VERSION = 2
    KIND = "model archive manifest"

    autoseg_version: str
    configurations: tuple[str, ...]  # one, or two: an ensemble (then inference.json is a member)
    folds: tuple[int | str, ...]  # numbered folds and/or "all", of each configuration
    checkpoint: str  # "final" or "best": the members are checkpoint_<checkpoint>.pt
    members: tuple[ArchiveMember, ...]  # every member but the manifest itself
    postprocessing: str = "none"  # what predict -m does to each label map (inference.json's, described)

    @property
    def graphs(self) -> tuple[str, ...]:
        """The members that are ONNX graphs (``results/<config>/fold_<k>/network.onnx``): none without the extra."""
        return tuple(m.name for m in self.members if m.name.endswith("/" + GRAPH_FILE))

    @property
    def precision_checks(self) -> tuple[str, ...]:
        """The members that are bf16 agreement checks (``results/<config>/fold_<k>/precision_check.json``)."""
        return tuple(m.name for m in self.members if m.name.endswith("/" + PRECISION_CHECK_FILE))

    @property
    def follows_choice(self) -> bool:
        """inference.json is a member: ``predict -m`` without ``-c`` follows it."""
        return any(m.name == "inference.json" for m in self.members)


def export_model(
    workspace: Workspace,
    out: str | Path,
    *,
    config_name: str | None = None,
    folds: list[int | str] | None = None,
    checkpoint: str | None = None,
    precision_checks: PrecisionChecks = stored_check,
) -> ModelManifest:
    """Write the zip ``out`` holding what prediction needs: with ``config_name`` None and an inference.json in the
    workspace, that choice (its configurations, folds and checkpoint unless given, postprocessing); else
    ``config_name`` (default: the plan's default) without postprocessing, ``folds`` (default: every fold trained
    with ``checkpoint_<checkpoint>.pt``, final by default). Returns its manifest. Refuses (``InputError``) an
    unplanned workspace, a fold not trained, a checkpoint that does not load, and a workspace whose plan and folds
    `plan_and_preprocess --overwrite` is replacing. ``precision_checks`` gives each fold's bf16 agreement check to
    pack beside its checkpoint (default: the stored one where it belongs to that checkpoint)."""
    refuse_while_held(
        workspace.plan_lock, workspace.root, "`autoseg export-model` reads the plan and the trained folds", True
    )
    plans = Plans.from_json(workspace.require(workspace.plans_path, "plan_and_preprocess"))
    workspace.require(workspace.fingerprint_path, "plan_and_preprocess")
    choice = (
        InferenceChoice.from_json(workspace.inference_path)
        if config_name is None and workspace.inference_path.is_file()
        else None
    )
    configurations = choice.configurations if choice else (config_name or plans.default_configuration(),)
    checkpoint = checkpoint or (choice.checkpoint if choice else "final")
    folds = folds if folds is not None or choice is None else list(choice.folds)
    chosen = _chosen_folds(workspace, configurations[0], folds, checkpoint)
    files: dict[str, Path | bytes] = {
        "plans.json": workspace.plans_path,
        "fingerprint.json": workspace.fingerprint_path,
    }
    names = with_previous_stages(plans, configurations)
    files |= _network_files(workspace, plans, names, chosen, checkpoint)
    files |= _check_files(workspace, plans, names, chosen, checkpoint, precision_checks)
    if choice is not None:  # as predict -m will follow it: the archived folds and checkpoint
        archived = dataclasses.replace(choice, folds=chosen, checkpoint=checkpoint)
        files["inference.json"] = (
            json.dumps({"schema_version": InferenceChoice.SCHEMA_VERSION, **to_dict(archived)}, indent=2) + "\n"
        ).encode()
    out = Path(out)
    remove_stale_temporaries(out.parent, [out.name])  # a killed export's .OUT.zip.*.tmp.zip
    with atomic_path(out, suffix=".zip") as tmp, zipfile.ZipFile(tmp, "w") as zf:
        members = tuple(_pack(zf, name, source) for name, source in files.items())
        manifest = ModelManifest(
            autoseg_version=autoseg.__version__,
            configurations=configurations,
            folds=chosen,
            checkpoint=checkpoint,
            members=members,
            postprocessing=choice.postprocessing.describe() if choice else "none",
        )
        payload = {"schema_version": ModelManifest.SCHEMA_VERSION, **to_dict(manifest)}
        zf.writestr(_member_info(MANIFEST), json.dumps(payload, indent=2) + "\n")
    return manifest


def with_graphs() -> bool:
    """Whether ``export_model`` puts ONNX graphs in the archive: the onnx extra (onnx, and ONNX Runtime or OpenVINO
    to check them with) is installed."""
    return installed("onnx") and available_runtime() is not None


def _network_files(
    workspace: Workspace, plans: Plans, names: list[str], folds: tuple[int | str, ...], checkpoint: str
) -> dict[str, Path | bytes]:
    """The members of the folds' networks of configurations ``names``: each checkpoint (refused unless it loads),
    its class decision weights where it has them, and, with the onnx extra (``with_graphs``), its checked ONNX graph
    beside it."""
    files: dict[str, Path | bytes] = {}
    for name in names:
        config = plans.configuration(name)
        tiles = check_tiles(workspace, config) if with_graphs() else None
        for fold in _chosen_folds(workspace, name, list(folds), checkpoint):
            path = workspace.checkpoint(name, fold, checkpoint)
            member = path.relative_to(workspace.root).as_posix()
            files[member] = path
            if stored_weights(path) is not None:  # the fold's class decision weights, where they are this checkpoint's
                files[member.rsplit("/", 1)[0] + "/" + CLASS_WEIGHTS_FILE] = class_weights_path(path)
            if tiles is None:
                load_trained_network(path, plans, config, "cpu")  # refuse to pack a checkpoint that does not load
            else:  # loads it too, then exports and checks its graph
                files[graph_member(member)] = checked_graph(path, plans, config, tiles, f"fold {fold} of {name}")
    return files


def _check_files(
    workspace: Workspace,
    plans: Plans,
    names: list[str],
    folds: tuple[int | str, ...],
    checkpoint: str,
    precision_checks: PrecisionChecks,
) -> dict[str, Path | bytes]:
    """The bf16 agreement check of each fold of configurations ``names`` that ``precision_checks`` gives."""
    files: dict[str, Path | bytes] = {}
    for name in names:
        for fold in _chosen_folds(workspace, name, list(folds), checkpoint):
            check = precision_checks(workspace, plans, name, fold, checkpoint)
            if check is not None:
                member = workspace.results(name, fold).relative_to(workspace.root).as_posix()
                payload = {"schema_version": PrecisionCheck.SCHEMA_VERSION, **to_dict(check)}
                files[f"{member}/{PRECISION_CHECK_FILE}"] = (json.dumps(payload, indent=2) + "\n").encode()
    return files


def with_previous_stages(plans: Plans, configurations: tuple[str, ...]) -> list[str]:
    """``configurations`` and, after each cascade stage, its previous stage: every configuration whose networks a
    prediction with them runs, each once."""
    names = [n for c in configurations for n in (c, plans.configuration(c).previous_stage) if n]
    return list(dict.fromkeys(names))


def _chosen_folds(
    workspace: Workspace, config_name: str, folds: list[int | str] | None, checkpoint: str
) -> tuple[int | str, ...]:
    results = workspace.root / "results" / config_name
    if folds is None:
        chosen: tuple[int | str, ...] = workspace.trained_folds(config_name, checkpoint)
        if not chosen:
            raise InputError(
                f"{results}: no trained fold with checkpoint_{checkpoint}.pt to export; train one "
                f"first (`{workspace.advice(f'train fold 0 -c {config_name}')}`) or choose --checkpoint"
            )
        return chosen
    chosen = tuple(dict.fromkeys(int(f) if str(f).isdigit() else str(f) for f in folds))
    untrained = [f for f in chosen if not workspace.checkpoint(config_name, f, checkpoint).is_file()]
    if untrained:
        raise InputError(
            f"fold(s) {' '.join(map(str, untrained))} of {config_name}: no "
            f"checkpoint_{checkpoint}.pt under {results}; train them first "
            f"(`{workspace.advice(f'train fold {untrained[0]} -c {config_name}')}`), or leave them out of --folds "
            f"(trained: {' '.join(map(str, workspace.trained_folds(config_name, checkpoint))) or 'none'})"
        )
    return chosen


def _pack(zf: zipfile.ZipFile, name: str, source: Path | bytes) -> ArchiveMember:
    """Copy ``source`` (a file, or the bytes themselves) into ``zf`` as ``name``, hashing what is written."""
    digest, size = hashlib.sha256(), 0
    with (
        io.BytesIO(source) if isinstance(source, bytes) else open(source, "rb") as src,
        zf.open(_member_info(name), "w", force_zip64=True) as dst,
    ):
        while chunk := src.read(CHUNK_BYTES):
            digest.update(chunk)
            dst.write(chunk)
            size += len(chunk)
    return ArchiveMember(name, size, digest.hexdigest())


def _member_info(name: str) -> zipfile.ZipInfo:
    """A fixed date and mode (the same model gives the same bytes); checkpoints are stored (their floats do
    not compress), JSON deflated."""
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_STORED if name.endswith(".pt") else zipfile.ZIP_DEFLATED
    info.external_attr = 0o644 << 16
    return info
