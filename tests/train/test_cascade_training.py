"""The cascade end to end on the tiny dataset: 3d_lowres and 3d_cascade_fullres planned by hand (the tiny images are
too small for the planner to want them), two folds; the cascade refuses to train until every lowres fold that
validated one of its cases is trained, then trains on their out-of-fold label maps, and predicts new scans with
both stages; export-model packs both."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from cascade_workspace import CASCADE, RUN
from extras import require_extra
from train_faults import simulated_passes, simulated_steps

from autoseg.core.errors import InputError
from autoseg.core.workspace import Splits, Workspace
from autoseg.dataset.imageio import read_geometry, read_image
from autoseg.plan.plans import Plans
from autoseg.predict.archive import export_model
from autoseg.predict.predictor import PredictOptions, predict
from autoseg.predict.window import WindowOptions
from autoseg.preprocess.preprocessor import labels_on_grid
from autoseg.preprocess.store import list_cases, open_previous_stage, read_properties
from autoseg.train.fold_data import previous_stage_label_file
from autoseg.train.trainer import train


def test_the_cascade_reads_3d_fullres_data_and_nothing_is_preprocessed_for_it(cascade_ws: Path) -> None:
    ws = Workspace.at(cascade_ws)
    assert sorted(p.name for p in (ws.root / "preprocessed").iterdir() if p.is_dir()) == ["3d_fullres", "3d_lowres"]
    assert Plans.from_json(ws.plans_path).input_channels(Plans.from_json(ws.plans_path).configuration(CASCADE)) == 3


def test_the_cascade_refuses_to_train_until_every_lowres_fold_of_its_cases_is_trained(
    cascade_ws: Path, tmp_path: Path
) -> None:
    ws = Workspace.at(Path(shutil.copytree(cascade_ws, tmp_path / "ws")))
    with pytest.raises(
        InputError,
        match=r"3d_lowres fold\(s\) 1 not trained: run `autoseg train fold 1 -c "
        r"3d_lowres -w .*`",
    ) as e:
        train(ws, CASCADE, 0, RUN, progress=False)
    assert "fold 0" not in str(e.value).split("missing:")[1]  # trained: not named
    assert not (ws.root / "results" / CASCADE).exists()  # refused before anything was written


def test_cascade_trains_on_out_of_fold_lowres_maps_and_predicts_with_both_stages(
    cascade_ws: Path, inputs: Path, tmp_path: Path
) -> None:
    ws = Workspace.at(Path(shutil.copytree(cascade_ws, tmp_path / "ws")))
    plans = Plans.from_json(ws.plans_path)
    train(ws, "3d_lowres", 1, RUN, progress=False)
    out = train(ws, CASCADE, 0, RUN, progress=False)
    assert (out / "checkpoint_final.pt").is_file() and (out / "validation" / "summary.json").is_file()
    # each case's previous-stage map: its own lowres fold's validation label map on the 3d_fullres grid
    data = ws.preprocessed("3d_fullres")
    for case_id in list_cases(data):
        source = previous_stage_label_file(ws, plans, CASCADE, case_id)
        fold = 0 if case_id in Splits.from_json(ws.splits_path).folds[0].val else 1
        assert source == ws.results("3d_lowres", fold) / "validation" / f"{case_id}.nii.gz"
        expected = labels_on_grid(read_image(source, dtype=None)[0], read_properties(data, case_id))
        assert np.array_equal(open_previous_stage(ws.preprocessed(CASCADE), case_id), expected)
    written = predict(
        ws,
        inputs,
        tmp_path / "pred",
        config_name=CASCADE,
        folds=(0,),
        window=WindowOptions(device="cpu", mirror=False),
        options=PredictOptions(progress=False),
    )
    for path in written:
        image = inputs / path.name.replace(".nii.gz", "_0000.nii.gz")
        assert read_geometry(path) == read_geometry(image)
        labels, _ = read_image(path, dtype=None)
        assert set(np.unique(labels)) <= set(range(plans.num_label_values))
    require_extra("openvino")  # both stages' folds as ONNX graphs: the same labels
    window = WindowOptions(device="cpu", mirror=False, runtime="openvino")
    options = PredictOptions(progress=False)
    graphs = predict(ws, inputs, tmp_path / "graphs", config_name=CASCADE, folds=(0,), window=window, options=options)
    assert [p.name for p in graphs] == [p.name for p in written]
    for path, graph_path in zip(written, graphs):
        assert np.mean(read_image(path, dtype=None)[0] == read_image(graph_path, dtype=None)[0]) >= 0.999
    manifest = export_model(ws, tmp_path / "model.zip", config_name=CASCADE)
    names = {m.name for m in manifest.members}
    assert {f"results/{c}/fold_0/checkpoint_final.pt" for c in (CASCADE, "3d_lowres")} <= names
    assert manifest.configurations == (CASCADE,)


def test_a_cascade_stage_times_its_final_validation_with_its_previous_stage_channels(
    cascade_ws: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a time budget the cascade stage's timing runs its network on the image and the one-hot previous-stage
    channels (zero in the timed tile) and times a case with its previous-stage label map read, as its final
    validation does."""
    ws = Workspace.at(Path(shutil.copytree(cascade_ws, tmp_path / "ws")))
    train(ws, "3d_lowres", 1, RUN, progress=False)
    clock = simulated_steps(monkeypatch, [1.0])
    passes = simulated_passes(monkeypatch, clock, 0.5)
    run = dataclasses.replace(RUN, epochs=1000, iterations_per_epoch=10, validate=True, time_budget_s=40.0)
    out = train(ws, CASCADE, 0, run, progress=False, clock=lambda: clock.now)
    channels = Plans.from_json(ws.plans_path).input_channels(Plans.from_json(ws.plans_path).configuration(CASCADE))
    assert passes[1][0][:2] == (4, channels)  # one tile's 4 mirror variants, every input channel
    decision = json.loads((out / "run.json").read_text())["time_budget"][0]
    assert decision["window_seconds_per_voxel"] > 0 and len(decision["validation_cases"]) >= 1
    assert (out / "validation" / "summary.json").is_file()
