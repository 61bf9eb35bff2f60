"""Reading a model archive (``autoseg.predict.archive``): ``open_model_archive`` checks it before anything is used:
member names (no absolute path, no ``..``), the manifest's format version, every member's size and sha256, the plan,
each checkpoint loaded with ``torch.load(weights_only=True)`` into the planned network (or, for ``predict -m``,
where predict loads it anyway), each ONNX graph's input and output (names, channels; with the onnx extra: without
it no runtime runs them) and each bf16 agreement check (it reads, and belongs to the checkpoint beside it); then
unpacks it into a temporary folder that is removed afterwards (``OpenedModel``).
A damaged or altered archive raises ``InputError`` naming the archive and the member.

The temporary folder is ``autoseg-model-<pid>-<random>`` in the system's temporary folder (``TMPDIR``). A killed
process (SIGKILL, the OOM killer) cannot remove its own, so each ``open_model_archive`` first removes those of
processes no longer running (``remove_abandoned_model_folders``).

The sha256 sums catch damage (a truncated copy, a flipped byte), not a forger who rewrites the manifest too;
``weights_only=True`` is what keeps a crafted checkpoint from running code.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import zipfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import autoseg
from autoseg.core.errors import InputError
from autoseg.core.extras import installed
from autoseg.core.workspace import Workspace
from autoseg.model.checkpoint_file import read_checkpoint_file
from autoseg.model.network import build_network
from autoseg.model.onnx_graph import check_io
from autoseg.plan.fingerprint import Fingerprint
from autoseg.plan.plans import Plans
from autoseg.predict.archive import CHUNK_BYTES, MANIFEST, ArchiveMember, ModelManifest, with_previous_stages
from autoseg.predict.choice import InferenceChoice
from autoseg.predict.graphs import graph_member
from autoseg.predict.precision_check import PrecisionCheck

MODEL_FOLDER_PREFIX = "autoseg-model-"  # + "<pid>-<random>": the unpacked archive in the temporary folder


@dataclass(frozen=True)
class OpenedModel:
    """A checked archive unpacked as a workspace (valid inside ``open_model_archive``'s block)."""

    archive: Path
    workspace: Workspace
    manifest: ModelManifest

    def select(self, config: str | None, folds: list[str] | None) -> tuple[str | None, list[str] | None]:
        """The configuration and folds to predict with: the archive's, or the requested ones if it holds them;
        (None, folds or None) when the archive holds inference.json and no configuration is requested: predict
        follows it."""
        manifest = self.manifest
        if config is not None and config not in manifest.configurations:
            raise InputError(
                f"-c {config}: the model archive {self.archive} holds configuration "
                f"{' and '.join(map(repr, manifest.configurations))} only; leave -c out or export that "
                "configuration"
            )
        held = [str(f) for f in manifest.folds]
        missing = [f for f in folds or [] if f not in held]
        if missing:
            raise InputError(
                f"--folds {' '.join(missing)}: not in the model archive {self.archive}, which holds "
                f"fold(s) {' '.join(held)}; leave --folds out to use them all"
            )
        if config is None and manifest.follows_choice:  # predict follows the archived inference.json
            return None, list(folds) if folds else None
        return config or manifest.configurations[0], list(folds) if folds else held


@contextmanager
def open_model_archive(archive: str | Path, *, load_checkpoints: bool = True) -> Iterator[OpenedModel]:
    """Check the model archive and unpack it into a temporary workspace, removed when the block ends.

    ``load_checkpoints=False``: the block loads them itself, as ``predict`` does with the same reader
    (``load_trained_network``: ``read_checkpoint_file``, ``weights_only=True``), so each is read once (what it
    saves: docs/prediction.md, ``-m``). Either way an ``InputError``
    raised in the block that names a file of the unpacked folder is re-raised naming the archive and the member."""
    archive = Path(archive).expanduser().resolve()
    if not archive.is_file():
        raise InputError(f"-m/--model {archive}: no such file; give a .zip written by `autoseg export-model`")
    try:
        zf = zipfile.ZipFile(archive)
    except (zipfile.BadZipFile, zlib.error, EOFError, ValueError) as e:
        raise InputError(
            f"{archive}: not a readable zip file ({e}); it is probably truncated or damaged: copy it "
            "again or export the model again"
        ) from e
    with zf, _model_folder() as root:
        manifest = _read_manifest(zf, archive)
        for member in manifest.members:
            _unpack(zf, archive, member, root)
        (root / MANIFEST).write_bytes(_read_member(zf, archive, MANIFEST))  # what predict reads graphs by
        opened = OpenedModel(archive, Workspace.at(root), manifest)
        _check_contents(opened, load_checkpoints)
        try:
            yield opened
        except InputError as e:
            if str(opened.workspace.root) not in str(e):
                raise
            raise _in_archive(opened, e) from e


@contextmanager
def _model_folder() -> Iterator[Path]:
    """A new folder named with this process's id in the temporary folder, removed when the block ends; the ones
    killed processes left are removed first."""
    parent = Path(tempfile.gettempdir())
    remove_abandoned_model_folders(parent)
    root = Path(tempfile.mkdtemp(prefix=f"{MODEL_FOLDER_PREFIX}{os.getpid()}-", dir=parent))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def remove_abandoned_model_folders(parent: Path) -> list[Path]:
    """Remove the ``autoseg-model-<pid>-*`` folders in ``parent`` whose process is no longer running; those
    removed. Kept: a running process's (a reused pid keeps a dead one's until that process ends too), another
    user's (not ours to remove), and anything not named so."""
    removed = []
    for folder in sorted(parent.glob(f"{MODEL_FOLDER_PREFIX}*-*")):
        pid = folder.name[len(MODEL_FOLDER_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and folder.is_dir() and not folder.is_symlink() and not _running(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _running(pid: int) -> bool:
    if sys.platform == "win32":  # os.kill(pid, 0) would send CTRL_C_EVENT there: never remove
        return True
    try:
        os.kill(pid, 0)  # signal 0: nothing is sent, only whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _read_manifest(zf: zipfile.ZipFile, archive: Path) -> ModelManifest:
    names = zf.namelist()
    for name in names:
        _check_name(archive, name)
    if len(set(names)) != len(names):
        raise InputError(
            f"{archive}: a member name occurs twice; this is not an archive `autoseg export-model` "
            "wrote: export the model again"
        )
    if MANIFEST not in names:
        raise InputError(
            f"{archive}: member {MANIFEST} is missing: the file is truncated or damaged (copy it "
            "again), or it is not a model archive written by `autoseg export-model`"
        )
    try:
        payload = json.loads(_read_member(zf, archive, MANIFEST))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{archive}: member {MANIFEST} is not valid JSON ({e}); export the model again") from e
    version = payload.get("schema_version") if isinstance(payload, dict) else None
    if version == 1 and isinstance(payload, dict):  # format 1: one configuration, no postprocessing
        payload = {k: v for k, v in payload.items() if k not in ("configuration", "notes", "postprocessing")} | {
            "schema_version": ModelManifest.SCHEMA_VERSION,
            "configurations": [payload.get("configuration")],
        }
        version = ModelManifest.SCHEMA_VERSION
    if version != ModelManifest.SCHEMA_VERSION:
        written_by = payload.get("autoseg_version", "unknown") if isinstance(payload, dict) else "unknown"
        raise InputError(
            f"{archive}: member {MANIFEST}: archive format version {version!r} is not the one this "
            f"autoseg ({autoseg.__version__}) reads ({ModelManifest.SCHEMA_VERSION}); it was written by "
            f"autoseg {written_by}: predict with that version, or export the model again with this one"
        )
    manifest = ModelManifest.from_payload(payload, f"{archive}: member {MANIFEST}")
    for member in manifest.members:
        _check_name(archive, member.name)
    listed = {m.name for m in manifest.members} | {MANIFEST}
    unlisted, absent = sorted(set(names) - listed), sorted(listed - set(names))
    if unlisted or absent:
        which = (
            f"member(s) {', '.join(unlisted)} not in the manifest"
            if unlisted
            else f"member(s) {', '.join(absent)} of the manifest missing"
        )
        raise InputError(f"{archive}: {which}; the archive was altered after `autoseg export-model`: export it again")
    return manifest


def _check_name(archive: Path, name: str) -> None:
    """Refuse a member name that would land outside the folder it is unpacked into (zip-slip)."""
    path = PurePosixPath(name)
    if (
        not name
        or "\\" in name
        or path.is_absolute()
        or ".." in path.parts
        or ":" in name
        or any(part in ("", ".") for part in name.split("/"))
    ):
        raise InputError(
            f"{archive}: member {name!r} has an unsafe path (absolute, '..', or not a plain relative "
            "path); refusing to unpack this archive: it was not written by `autoseg export-model`"
        )


def _read_member(zf: zipfile.ZipFile, archive: Path, name: str) -> bytes:
    try:
        return zf.read(name)
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError) as e:
        raise InputError(
            f"{archive}: member {name} cannot be read ({e}); the archive is damaged: copy it again "
            "or export the model again"
        ) from e


def _unpack(zf: zipfile.ZipFile, archive: Path, member: ArchiveMember, root: Path) -> None:
    """Copy ``member`` to ``root / member.name``, checking its size and sha256 as it is read."""
    damaged = f"{archive}: member {member.name}"
    if zf.getinfo(member.name).file_size != member.size_bytes:
        raise InputError(
            f"{damaged} is {zf.getinfo(member.name).file_size} bytes, its manifest says "
            f"{member.size_bytes}; the archive was altered or damaged: export the model again"
        )
    target = root / member.name
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    try:
        with zf.open(member.name) as src, open(target, "wb") as dst:
            while chunk := src.read(CHUNK_BYTES):
                digest.update(chunk)
                dst.write(chunk)
    except (zipfile.BadZipFile, zlib.error, EOFError) as e:
        raise InputError(
            f"{damaged} cannot be read ({e}); the archive is damaged: copy it again or export the model again"
        ) from e
    if digest.hexdigest() != member.sha256:
        raise InputError(
            f"{damaged}: sha256 {digest.hexdigest()} differs from the manifest's {member.sha256}; the "
            "archive was altered or damaged: copy it again or export the model again"
        )


def _check_contents(model: OpenedModel, load_checkpoints: bool) -> None:
    """The plan and fingerprint read, every fold's checkpoint is there and (``load_checkpoints``) loads
    (``weights_only=True``) into the planned network; an error names the archive and the member, on one line."""
    ws, manifest = model.workspace, model.manifest
    name = "plans.json"
    try:
        plans = Plans.from_json(ws.plans_path)
        name = "fingerprint.json"
        Fingerprint.from_json(ws.fingerprint_path)
        if manifest.follows_choice:
            name = "inference.json"
            InferenceChoice.from_json(ws.inference_path)
        for name in manifest.precision_checks:
            _check_precision_check(model, name)
        for config_name in with_previous_stages(plans, manifest.configurations):
            name = "plans.json"
            config = plans.configuration(config_name)
            for fold in manifest.folds:
                path = ws.checkpoint(config_name, fold, manifest.checkpoint)
                name = path.relative_to(ws.root).as_posix()
                if not path.is_file():
                    raise InputError(f"is missing, though the manifest lists fold {fold}")
                graph = graph_member(name)
                if graph in manifest.graphs and installed("onnx"):  # without onnx no runtime can run it
                    name = graph
                    net = config.network
                    check_io(
                        (ws.root / graph).read_bytes(), net.in_channels, net.num_outputs, net.dim, str(ws.root / graph)
                    )
                    name = path.relative_to(ws.root).as_posix()
                if not load_checkpoints:
                    continue
                state = read_checkpoint_file(path, "export the model again", mmap=True)
                if not isinstance(state.get("network"), dict):
                    raise InputError("holds no network weights")
                try:
                    build_network(config.network).load_state_dict(state["network"])
                except RuntimeError as e:
                    raise InputError(f"its weights do not fit the planned {config_name} network ({e})") from e
    except InputError as e:
        raise _in_archive(model, e, name) from e


def _check_precision_check(model: OpenedModel, name: str) -> None:
    """The check member ``name`` reads as a ``PrecisionCheck`` and belongs to the checkpoint beside it: the sha256 it
    names is that member's in the manifest (a check of another checkpoint would let bf16 through unchecked)."""
    manifest = model.manifest
    check = PrecisionCheck.from_json(model.workspace.root / name)
    beside = f"{name.rsplit('/', 1)[0]}/checkpoint_{manifest.checkpoint}.pt"
    sha256 = next((m.sha256 for m in manifest.members if m.name == beside), None)
    if sha256 is None:
        raise InputError(f"has no checkpoint beside it ({beside} is not a member)")
    if check.checkpoint_sha256 != sha256:
        raise InputError(
            f"was made for another checkpoint (sha256 {check.checkpoint_sha256[:12]}) than the archive's {beside} "
            f"(sha256 {sha256[:12]})"
        )


def _in_archive(model: OpenedModel, error: InputError, name: str | None = None) -> InputError:
    """``error``, which names a file of the unpacked folder (``name``, else the member it names), as the
    archive's: '<archive>: member <name>: <what is wrong>; export the model again'. The advice of a message
    written for a workspace (another --checkpoint, train again) does not apply to an archive: it is dropped."""
    root, text = model.workspace.root, str(error)
    name = name or next((m.name for m in model.manifest.members if str(root / m.name) in text), None)
    what = text.removeprefix(f"{root / name}: ").replace(str(root / name), "it") if name else text
    what = " ".join(what.replace(str(root), "the archive").split()).split("; ")[0]
    return InputError(f"{model.archive}: {f'member {name}: ' if name else ''}{what[:400]}; export the model again")
