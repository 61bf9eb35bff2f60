from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from extras import require_extra
from factories import inference_choice

import autoseg
from autoseg.core.errors import InputError
from autoseg.core.workspace import Workspace
from autoseg.model.checkpoint_file import write_checkpoint_file
from autoseg.model.network import build_network
from autoseg.model.onnx_graph import available_runtime, export_graph, run_graph
from autoseg.plan.plans import Plans
from autoseg.predict.archive import MANIFEST, export_model, with_graphs
from autoseg.predict.archive_reader import open_model_archive
from autoseg.predict.class_weights import CLASS_WEIGHTS_FILE, ClassWeights, class_weights_path, fold_weights
from autoseg.predict.graphs import file_digest
from autoseg.predict.precision_check import (
    CheckedCheckpoint,
    PrecisionCheck,
    bf16_verdict,
    precision_check_path,
    read_precision_check,
)

CONFIG = "3d_fullres"


@pytest.fixture(scope="module")
def workspace(prepared: Path, tmp_path_factory) -> Workspace:
    """A copy of the prepared workspace with untrained checkpoints: final for folds 0 and 1, best for fold 0."""
    ws = Workspace.at(tmp_path_factory.mktemp("archive") / "ws")
    shutil.copytree(prepared, ws.root)
    config = Plans.from_json(ws.plans_path).configuration(CONFIG)
    torch.manual_seed(0)
    for fold, which in ((0, "final"), (1, "final"), (0, "best")):
        state = {"network": build_network(config.network).state_dict()}
        write_checkpoint_file(ws.checkpoint(CONFIG, fold, which), state)
    return ws


@pytest.fixture(scope="module")
def archive(workspace: Workspace, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("exported") / "model.zip"
    export_model(workspace, out)
    return out


def _members(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as zf:
        return {name: zf.read(name) for name in zf.namelist()}


def _write(path: Path, members: dict[str, bytes], *, resign: bool = False) -> Path:
    """A zip of ``members``; ``resign``: the manifest's sizes and sha256 sums made to match (a crafted archive)."""
    if resign:
        manifest = json.loads(members[MANIFEST])
        manifest["members"] = [
            {"name": n, "size_bytes": len(b), "sha256": hashlib.sha256(b).hexdigest()}
            for n, b in members.items()
            if n != MANIFEST
        ]
        members = {**members, MANIFEST: json.dumps(manifest).encode()}
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def test_export_holds_what_prediction_needs_and_a_manifest(workspace: Workspace, archive: Path) -> None:
    members = _members(archive)
    checkpoints = [f"results/{CONFIG}/fold_{k}/checkpoint_final.pt" for k in (0, 1)]
    graphs = [f"results/{CONFIG}/fold_{k}/network.onnx" for k in (0, 1)] if with_graphs() else []
    assert sorted(members) == sorted([MANIFEST, "plans.json", "fingerprint.json", *checkpoints, *graphs])
    manifest = json.loads(members[MANIFEST])
    assert manifest["schema_version"] == 2 and manifest["autoseg_version"] == autoseg.__version__
    assert (manifest["configurations"], manifest["folds"], manifest["checkpoint"]) == ([CONFIG], [0, 1], "final")
    assert manifest["postprocessing"] == "none"
    for m in manifest["members"]:
        data = members[m["name"]]
        assert m["name"] in graphs or data == (workspace.root / m["name"]).read_bytes()
        assert (m["size_bytes"], m["sha256"]) == (len(data), hashlib.sha256(data).hexdigest())


def test_export_is_reproducible_and_chooses_folds_and_checkpoint(
    workspace: Workspace, archive: Path, tmp_path: Path
) -> None:
    again = tmp_path / "again.zip"
    export_model(workspace, again)
    assert again.read_bytes() == archive.read_bytes()  # the same model, the same bytes: fixed member dates
    with zipfile.ZipFile(again) as zf:
        assert {info.date_time for info in zf.infolist()} == {(1980, 1, 1, 0, 0, 0)}
    best = export_model(workspace, tmp_path / "best.zip", folds=["0"], checkpoint="best")
    assert (best.folds, best.checkpoint) == ((0,), "best")
    assert f"results/{CONFIG}/fold_0/checkpoint_best.pt" in _members(tmp_path / "best.zip")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again.zip", "best.zip"]  # no temporary left


def test_export_refuses_an_untrained_fold_or_unplanned_workspace_and_writes_nothing(
    workspace: Workspace, tmp_path: Path
) -> None:
    out = tmp_path / "model.zip"
    with pytest.raises(InputError, match=r"fold\(s\) 3 of 3d_fullres: no checkpoint_final.pt.*trained: 0 1"):
        export_model(workspace, out, folds=["0", "3"])
    with pytest.raises(InputError, match="no trained fold with checkpoint_latest.pt"):
        export_model(workspace, out, checkpoint="latest")
    with pytest.raises(InputError, match="plans.json not found; run `autoseg plan_and_preprocess"):
        export_model(Workspace.at(tmp_path / "empty"), out)
    assert not out.exists() and not (tmp_path / "empty").exists()


def test_export_refuses_a_checkpoint_that_does_not_load(workspace: Workspace, tmp_path: Path) -> None:
    ws = Workspace.at(tmp_path / "ws")
    shutil.copytree(workspace.root, ws.root)
    broken = ws.checkpoint(CONFIG, 1, "final")
    broken.write_bytes(broken.read_bytes()[:1000])  # truncated
    with pytest.raises(InputError, match=f"{broken} is not a readable checkpoint"):
        export_model(ws, tmp_path / "model.zip")
    assert not (tmp_path / "model.zip").exists()


def test_open_unpacks_a_checked_workspace_and_removes_it(workspace: Workspace, archive: Path) -> None:
    with open_model_archive(archive) as model:
        root = model.workspace.root
        assert root.parent == Path(tempfile.gettempdir()).resolve()  # not the working directory
        assert model.workspace.trained_folds(CONFIG) == (0, 1)
        assert model.workspace.plans_path.read_bytes() == workspace.plans_path.read_bytes()
        assert model.select(None, None) == (CONFIG, ["0", "1"])
        assert model.select(CONFIG, ["1"]) == (CONFIG, ["1"])
        with pytest.raises(InputError, match=r"--folds 4: not in the model archive .* fold\(s\) 0 1"):
            model.select(None, ["0", "4"])
        with pytest.raises(InputError, match="-c 2d: the model archive .* holds configuration '3d_fullres' only"):
            model.select("2d", None)
    assert not root.exists()


@pytest.mark.parametrize(
    "change, named",
    [
        (lambda m: {**m, "../evil.json": b"{}"}, "'../evil.json' has an unsafe path"),
        (lambda m: {**m, "/etc/evil": b"x"}, "'/etc/evil' has an unsafe path"),
        (lambda m: {k: v for k, v in m.items() if k != MANIFEST}, f"member {MANIFEST} is missing"),
        (lambda m: {**m, "extra.txt": b"x"}, r"member\(s\) extra.txt not in the manifest"),
        (
            lambda m: {k: v for k, v in m.items() if k != "fingerprint.json"},
            r"member\(s\) fingerprint.json of the manif",
        ),
        (
            lambda m: {**m, "plans.json": m["plans.json"].replace(b"3d_fullres", b"3d_fullrez")},
            "member plans.json: sha256 [0-9a-f]+ differs from the manifest's",
        ),
        (lambda m: {**m, "plans.json": m["plans.json"] + b" "}, "member plans.json is [0-9]+ bytes, its manifest says"),
        (
            lambda m: {**m, MANIFEST: m[MANIFEST].replace(b'"schema_version": 2', b'"schema_version": 7')},
            f"member {MANIFEST}: archive format version 7 is not the one this autoseg",
        ),
        (lambda m: {**m, MANIFEST: b"{not json"}, f"member {MANIFEST} is not valid JSON"),
    ],
)
def test_open_refuses_an_altered_archive(archive: Path, tmp_path: Path, change, named: str) -> None:
    bad = _write(tmp_path / "bad.zip", change(_members(archive)))
    with pytest.raises(InputError, match=f"{bad}: .*{named}"):
        with open_model_archive(bad):
            pass


def test_open_refuses_a_crafted_checkpoint_that_needs_unpickling_code(archive: Path, tmp_path: Path) -> None:
    """Members and manifest agree (the sums catch damage, not forgery); weights_only=True refuses to run code."""
    name = f"results/{CONFIG}/fold_1/checkpoint_final.pt"
    crafted = tmp_path / "crafted.pt"
    torch.save({"version": 2, "network": {}, "payload": Path("/etc/passwd")}, crafted)  # a class to unpickle
    bad = _write(tmp_path / "bad.zip", {**_members(archive), name: crafted.read_bytes()}, resign=True)
    with pytest.raises(InputError, match=f"{bad}: member {name}: it is not a readable checkpoint"):
        with open_model_archive(bad):
            pass


def test_open_refuses_a_checkpoint_of_another_network(archive: Path, tmp_path: Path) -> None:
    name = f"results/{CONFIG}/fold_0/checkpoint_final.pt"
    other = tmp_path / "other.pt"
    write_checkpoint_file(other, {"network": torch.nn.Linear(2, 2).state_dict()})
    bad = _write(tmp_path / "bad.zip", {**_members(archive), name: other.read_bytes()}, resign=True)
    with pytest.raises(InputError, match=f"{bad}: member {name}: its weights do not fit the planned 3d_fullres"):
        with open_model_archive(bad):
            pass


def test_open_refuses_a_truncated_or_missing_archive(archive: Path, tmp_path: Path) -> None:
    cut = tmp_path / "cut.zip"
    cut.write_bytes(archive.read_bytes()[: archive.stat().st_size // 2])
    # where the cut lands decides which check sees it first (a stored checkpoint is itself a zip file)
    with pytest.raises(InputError, match=f"{cut}: .*truncated or damaged"):
        with open_model_archive(cut):
            pass
    with pytest.raises(InputError, match=f"-m/--model {tmp_path / 'none.zip'}: no such file"):
        with open_model_archive(tmp_path / "none.zip"):
            pass


def test_export_removes_what_a_killed_export_left(workspace: Workspace, tmp_path: Path) -> None:
    stale = tmp_path / ".model.zip.k1ll3d.tmp.zip"
    stale.write_bytes(b"PK\x03\x04 half an archive")
    mine = tmp_path / "notes.txt"
    mine.write_text("a user's file beside the archive")
    export_model(workspace, tmp_path / "model.zip")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.zip", "notes.txt"]


def test_a_format_1_archive_is_still_read(archive: Path, tmp_path: Path) -> None:
    members = _members(archive)
    manifest = json.loads(members[MANIFEST])
    manifest.update(schema_version=1, configuration=CONFIG, postprocessing=None, notes="no postprocessing step yet")
    del manifest["configurations"]
    old = _write(tmp_path / "old.zip", {**members, MANIFEST: json.dumps(manifest).encode()})
    with open_model_archive(old, load_checkpoints=False) as model:
        assert model.manifest.configurations == (CONFIG,) and model.select(None, None) == (CONFIG, ["0", "1"])


def test_export_of_find_best_choice_carries_inference_json(workspace: Workspace, tmp_path: Path) -> None:
    """Without -c, export-model packs inference.json's choice (with the exported folds and checkpoint) and its
    postprocessing; predict -m then follows it (select gives no configuration). With -c: one configuration."""
    from autoseg.predict.choice import InferenceChoice
    from autoseg.predict.postprocessing import Postprocessing

    ws = Workspace.at(tmp_path / "ws")
    shutil.copytree(workspace.root, ws.root)
    names = Plans.from_json(ws.plans_path).label_scheme.names
    choice = inference_choice((CONFIG,), Postprocessing(True, (names[0],)))
    dataclasses.replace(choice, folds=(0, 1)).to_json(ws.inference_path)
    manifest = export_model(ws, tmp_path / "chosen.zip", folds=["1"])
    assert manifest.follows_choice and manifest.folds == (1,)
    assert manifest.postprocessing == f"largest component of all foreground, then largest component of {names[0]}"
    with open_model_archive(tmp_path / "chosen.zip") as model:
        archived = InferenceChoice.from_json(model.workspace.inference_path)
        assert archived.folds == (1,) and archived.postprocessing == Postprocessing(True, (names[0],))
        assert model.select(None, None) == (None, None) and model.select(CONFIG, None) == (CONFIG, ["1"])
    plain = export_model(ws, tmp_path / "plain.zip", config_name=CONFIG)
    assert not plain.follows_choice and plain.postprocessing == "none" and plain.folds == (0, 1)


def test_each_folds_graph_is_a_member_that_runs_its_network(archive: Path) -> None:
    require_extra("onnx")
    with open_model_archive(archive) as model:
        assert model.manifest.graphs == tuple(f"results/{CONFIG}/fold_{k}/network.onnx" for k in (0, 1))
        config = Plans.from_json(model.workspace.plans_path).configuration(CONFIG)
        graph = (model.workspace.root / model.manifest.graphs[1]).read_bytes()
        logits = run_graph(graph, np.zeros((1, 1, *config.patch_size), np.float32), available_runtime())
        assert logits.shape == (1, config.network.num_outputs, *config.patch_size)


def test_without_the_onnx_extra_the_archive_has_no_graphs_and_opens(
    workspace: Workspace, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setitem(sys.modules, "onnx", None)  # as if the extra were not installed
    manifest = export_model(workspace, tmp_path / "model.zip", folds=["0"])
    assert manifest.graphs == () and not [n for n in _members(tmp_path / "model.zip") if n.endswith(".onnx")]
    with open_model_archive(tmp_path / "model.zip") as model:
        assert model.workspace.trained_folds(CONFIG) == (0,)


@pytest.mark.parametrize(
    "graph, named",
    [
        ("other outputs", "its outputs are .* one output 'logits' of shape"),
        ("cut", "not a readable ONNX graph"),
    ],
)
def test_open_refuses_a_damaged_or_mismatched_graph_naming_it(
    archive: Path, workspace: Workspace, tmp_path: Path, graph: str, named: str
) -> None:
    require_extra("onnx")
    name = f"results/{CONFIG}/fold_1/network.onnx"
    members = _members(archive)
    if graph == "cut":
        data = members[name][: len(members[name]) // 2]
    else:
        config = Plans.from_json(workspace.plans_path).configuration(CONFIG)
        other = dataclasses.replace(config.network, num_outputs=config.network.num_outputs + 1)
        data = export_graph(build_network(other), torch.zeros(1, 1, *config.patch_size))
    bad = _write(tmp_path / "bad.zip", {**members, name: data}, resign=True)
    with pytest.raises(InputError, match=f"{bad}: member {name}: {named}"):
        with open_model_archive(bad, load_checkpoints=False):
            pass


@pytest.fixture(scope="module")
def checked_archive(workspace: Workspace, tmp_path_factory) -> Path:
    """An export of a copy of ``workspace`` whose fold 0 carries a hand-made bf16 agreement check of its checkpoint;
    fold 1 carries one of another checkpoint (stale), which the export leaves out."""
    ws = Workspace.at(tmp_path_factory.mktemp("checked") / "ws")
    shutil.copytree(workspace.root, ws.root)
    for fold, sha256 in ((0, file_digest(ws.checkpoint(CONFIG, 0, "final"))), (1, "0" * 64)):
        identity = CheckedCheckpoint(CONFIG, fold, "final", sha256, ("demo_000",), ("organ",), "4")
        check = PrecisionCheck.of(identity, {"organ": 0.9}, {"torch": {"organ": 0.8995}})
        check.to_json(precision_check_path(ws, CONFIG, fold))
    out = tmp_path_factory.mktemp("exported") / "checked.zip"
    export_model(ws, out)
    return out


def test_a_folds_check_travels_in_the_archive_beside_its_checkpoint(checked_archive: Path, tmp_path: Path) -> None:
    with open_model_archive(checked_archive, load_checkpoints=False) as model:
        assert model.manifest.precision_checks == (f"results/{CONFIG}/fold_0/precision_check.json",)  # not fold 1's
        check = read_precision_check(model.workspace, CONFIG, 0)
        sha256 = file_digest(model.workspace.checkpoint(CONFIG, 0, "final"))
        assert bf16_verdict(check, "torch", sha256)[0]
        assert read_precision_check(model.workspace, CONFIG, 1) is None


@pytest.mark.parametrize(
    "change, named",
    [
        (lambda b: b.replace(b"0.8995", b"0.9995"), "sha256 [0-9a-f]+ differs from the manifest's"),  # damaged
        (lambda b: b.replace(b'"schema_version": 1', b'"schema_version": 9'), "schema_version 9 is not the supp"),
        (lambda b: re.sub(rb'"checkpoint_sha256": "\w+"', b'"checkpoint_sha256": "' + b"1" * 64 + b'"', b), "another"),
    ],
)
def test_open_refuses_a_damaged_check_or_one_of_another_checkpoint(
    checked_archive: Path, tmp_path: Path, change, named: str
) -> None:
    name = f"results/{CONFIG}/fold_0/precision_check.json"
    members = _members(checked_archive)
    resign = "differs" not in named  # a damaged member is caught by its sum; a forged one by its content
    bad = _write(tmp_path / "bad.zip", {**members, name: change(members[name])}, resign=resign)
    with pytest.raises(InputError, match=f"{bad}: member {name}: .*{named}"):
        with open_model_archive(bad, load_checkpoints=False):
            pass


def test_a_folds_class_weights_travel_in_the_archive_and_reach_its_predictor(
    workspace: Workspace, tmp_path: Path
) -> None:
    """Fold 0's class decision weights (of its checkpoint) are packed beside it and weigh the unpacked model's
    argmax; fold 1's, fitted for another checkpoint, are left out."""
    ws = Workspace.at(tmp_path / "ws")
    shutil.copytree(workspace.root, ws.root)
    scheme = Plans.from_json(ws.plans_path).label_scheme
    first = scheme.names[0]
    for fold, sha256 in ((0, file_digest(ws.checkpoint(CONFIG, 0, "final"))), (1, "0" * 64)):
        weights = {name: (8.0 if name == first else 1.0) for name in scheme.names}
        fitted = ClassWeights(CONFIG, fold, "final", sha256, ("demo_000",), weights, {}, {})
        fitted.to_json(class_weights_path(ws.checkpoint(CONFIG, fold, "final")))
    out = tmp_path / "weighted.zip"
    manifest = export_model(ws, out, folds=[0, 1])
    names = {m.name for m in manifest.members}
    assert f"results/{CONFIG}/fold_0/{CLASS_WEIGHTS_FILE}" in names
    assert f"results/{CONFIG}/fold_1/{CLASS_WEIGHTS_FILE}" not in names
    with open_model_archive(out, load_checkpoints=False) as model:
        paths = [model.workspace.checkpoint(CONFIG, fold, "final") for fold in (0, 1)]
        factors = fold_weights(paths, scheme)
    channel = scheme.foreground_channels[0]
    assert factors is not None and factors[channel] == pytest.approx(8.0**0.5)  # fold 1 counts as 1
