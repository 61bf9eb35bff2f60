"""``autoseg import-nnunet``: an nnU-Net v2 trained-model folder written as an autoseg model archive.

The folder's plan and fingerprint become autoseg's (``autoseg.nnunet.folder``), each fold's checkpoint_final.pth
(read with ``weights_only``) an autoseg checkpoint of the mapped weights (``autoseg.nnunet.checkpoint``), in a
temporary workspace that ``autoseg.predict.archive.export_model`` packs as it packs any trained workspace (each
checkpoint loaded into the planned network before it is packed). ``predict -m`` then runs it as any archive.
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path

from autoseg.core.errors import InputError
from autoseg.core.workspace import Workspace
from autoseg.model.checkpoint_file import write_checkpoint_file
from autoseg.model.network import build_network
from autoseg.nnunet.axes import inverse, permuted_weights
from autoseg.nnunet.checkpoint import map_state_dict, read_nnunet_checkpoint
from autoseg.nnunet.folder import NnunetModel, read_model_folder
from autoseg.nnunet.network import NNUNET_CLASS_OF
from autoseg.predict.archive import ModelManifest, export_model
from autoseg.preprocess.plan_fields import MODEL_INPUT_KEY, model_input_fields

log = logging.getLogger("autoseg")
CHECKPOINT = "final"  # nnU-Net's checkpoint_final.pth becomes the archive's checkpoint_final.pt


def import_nnunet(
    folder: str | Path, out: str | Path, folds: list[str] | None = None, previous_stage: str | Path | None = None
) -> ModelManifest:
    """Write the autoseg model archive ``out`` holding the nnU-Net v2 model of ``folder`` (``folds``: a subset of
    its folds, default every fold with a checkpoint_final.pth); a cascade stage (3d_cascade_fullres) with its
    previous stage's model folder ``previous_stage`` (3d_lowres), whose same folds the archive holds too. Returns the
    archive's manifest. Refused (``InputError``, naming the file): a missing file, a network or preprocessing autoseg
    cannot reproduce, weights that do not fit the network plans.json describes, a checkpoint that pickles anything
    but tensors, numbers and numpy scalars, a cascade stage without its previous stage."""
    folder, previous = (_folder(f) if f is not None else None for f in (folder, previous_stage))
    model = read_model_folder(folder, previous)
    chosen = _chosen_folds(model, folds)
    with tempfile.TemporaryDirectory(prefix="autoseg-import-") as tmp:
        workspace = Workspace.at(tmp)
        model.plans.to_json(workspace.plans_path)
        model.fingerprint.to_json(workspace.fingerprint_path)
        for fold in chosen:
            _write_fold(model, fold, workspace)
            if model.previous is not None:
                _write_fold(model.previous, fold, workspace)
        return export_model(workspace, out, config_name=model.config_name, folds=list(chosen), checkpoint=CHECKPOINT)


def _folder(path: str | Path) -> Path:
    folder = Path(path).expanduser().resolve()
    if not folder.is_dir():
        raise InputError(f"{folder}: no such folder; give an nnU-Net v2 trained-model folder")
    return folder


def _stage_folds(model: NnunetModel, folds: list[str] | None) -> tuple[int | str, ...]:
    if folds is None:
        if not model.folds:
            raise InputError(
                f"{model.folder}: no fold_N/checkpoint_final.pth; train a fold to the end with nnU-Net first"
            )
        return model.folds
    chosen = tuple(dict.fromkeys(int(f) if str(f).isdigit() else str(f) for f in folds))
    for fold in chosen:  # a missing one is refused naming its file
        read_nnunet_checkpoint(model.folder / f"fold_{fold}" / "checkpoint_final.pth")
    return chosen


def _chosen_folds(model: NnunetModel, folds: list[str] | None) -> tuple[int | str, ...]:
    """The folds imported: ``folds`` or every fold with a checkpoint; a cascade's previous stage must hold them."""
    chosen = _stage_folds(model, folds)
    if model.previous is not None:
        missing = [f for f in chosen if f not in model.previous.folds]
        if missing:
            raise InputError(
                f"{model.previous.folder}: no fold_{missing[0]}/checkpoint_final.pth; a cascade predicts each fold "
                f"with the previous stage's same fold (folds {list(chosen)}): train it, or give --folds naming "
                f"folds both stages have ({[f for f in chosen if f in model.previous.folds]})"
            )
    return chosen


def _write_fold(model: NnunetModel, fold: int | str, workspace: Workspace) -> None:
    """Fold ``fold``'s weights mapped onto the planned network, as an autoseg checkpoint that records the plan it
    stands for (``model_input``), so that predict checks plans.json against it as for a fold autoseg trained."""
    path = model.folder / f"fold_{fold}" / "checkpoint_final.pth"
    state = read_nnunet_checkpoint(path)
    config = model.plans.configuration(model.config_name)
    network = build_network(config.network)
    expected = permuted_weights(network.state_dict(), inverse(model.network_axes))  # its shapes in nnU-Net's order
    nnunet_class = NNUNET_CLASS_OF[config.network.architecture]
    weights = map_state_dict(state["network_weights"], expected, config.network.num_stages, path, nnunet_class)
    weights = permuted_weights(weights, model.network_axes)
    _note_mirroring(state.get("inference_allowed_mirroring_axes"), config.dim, path)
    write_checkpoint_file(
        workspace.checkpoint(model.config_name, fold, CHECKPOINT),
        {
            "network": weights,
            "config_name": model.config_name,
            MODEL_INPUT_KEY: json.dumps(model_input_fields(model.plans, model.config_name)),
            "imported_from": f"{model.folder.name}/fold_{fold}/checkpoint_final.pth",  # no local path in an archive
            "nnunet_trainer": str(state.get("trainer_name", "")),
        },
    )


def _note_mirroring(axes: object, dim: int, path: Path) -> None:
    """autoseg mirrors every spatial axis (or none, ``--no-mirror``); say so when nnU-Net's trainer allowed fewer."""
    if axes is None:
        log.warning("%s: nnU-Net's trainer allows no mirroring at inference: predict with --no-mirror", path)
    elif tuple(axes) != tuple(range(dim)):
        log.warning(
            "%s: nnU-Net's trainer mirrors axes %s only at inference; autoseg mirrors all %d (or none, --no-mirror)",
            path,
            tuple(axes),
            dim,
        )
