"""autoseg predict following inference.json (autoseg.predict.chosen): an ensemble of two configurations is the mean
of their probabilities, the chosen postprocessing is applied, -c predicts without it, --continue skips written
cases."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from factories import inference_choice, set_configuration

from autoseg.cli.main import main
from autoseg.core.workspace import Workspace
from autoseg.dataset.imageio import read_image
from autoseg.model.topology import NetworkTopology
from autoseg.plan.plans import Plans
from autoseg.predict.choice import InferenceChoice
from autoseg.predict.chosen import SCRATCH, predict_chosen, scratch_name
from autoseg.predict.postprocessing import Postprocessing, apply_postprocessing
from autoseg.predict.predictor import PredictOptions, predict
from autoseg.predict.probabilities import labels_from_probabilities, mean_probabilities, read_probabilities
from autoseg.predict.window import WindowOptions
from autoseg.preprocess.run import preprocess_workspace

pytestmark = pytest.mark.slow  # two configurations trained once per module (~10 s)

WINDOW = WindowOptions(device="cpu", mirror=False)
QUIET = PredictOptions(progress=False)


@pytest.fixture(scope="module")
def two_configs(prepared: Path, tmp_path_factory) -> Path:
    """The prepared workspace with fold 0 of its tiny 3d_fullres and of a tiny 2d configuration trained (one
    iteration each) and validated: each fold's final validation wrote what find-best reads."""
    from autoseg.train.run_config import RunConfig
    from autoseg.train.trainer import train

    root = Path(shutil.copytree(prepared, tmp_path_factory.mktemp("chosen") / "ws"))
    ws = Workspace.at(root)
    plans = Plans.from_json(ws.plans_path)
    set_configuration(
        ws,
        "2d",
        network=NetworkTopology(
            dim=2,
            in_channels=1,
            num_outputs=plans.label_scheme.num_outputs,
            features_per_stage=(4, 8),
            kernel_sizes=((3, 3), (3, 3)),
            strides=((1, 1), (2, 2)),
        ),
        patch_size=(16, 16),
        batch_size=2,
        accumulation_steps=1,
        checkpointing=False,
    )
    preprocess_workspace(ws, ["2d"], processes=1, progress=False)
    for config in ("3d_fullres", "2d"):
        train(
            ws, config, 0, RunConfig(epochs=1, iterations_per_epoch=1, val_iterations=1, cpu_threads=1), progress=False
        )
    return root


def test_find_best_chooses_from_real_validation_outputs_and_predict_follows(
    two_configs: Path, inputs: Path, tmp_path: Path
) -> None:
    """The loop from training to prediction: the folds' own final validation outputs feed find-best, whose
    inference.json predict follows (the chosen candidate's label maps, postprocessed as chosen)."""
    from autoseg.selection.run import find_best

    ws = Workspace.at(Path(shutil.copytree(two_configs, tmp_path / "ws")))
    result = find_best(ws, folds=(0,))
    assert set(result.choice.candidates) == {"2d", "3d_fullres", "3d_fullres+2d"}  # pairs in plans.json order
    assert InferenceChoice.from_json(ws.inference_path) == result.choice and result.choice.num_cases == 1
    written = predict_chosen(ws, result.choice, inputs, tmp_path / "out", window=WINDOW, options=QUIET)
    assert len(written) == 2 and all(p.is_file() for p in written)


def test_an_ensemble_is_the_mean_of_its_configurations_probabilities(
    two_configs: Path, inputs: Path, tmp_path: Path
) -> None:
    ws = Workspace.at(two_configs)
    scheme = Plans.from_json(ws.plans_path).label_scheme
    for config in ("2d", "3d_fullres"):  # each alone, with its probabilities
        predict(
            ws,
            inputs,
            tmp_path / config,
            config_name=config,
            folds=(0,),
            window=WINDOW,
            options=PredictOptions(save_probabilities=True, progress=False),
        )
    out = tmp_path / "ensemble"
    written = predict_chosen(
        ws,
        inference_choice(("2d", "3d_fullres")),
        inputs,
        out,
        window=WINDOW,
        options=PredictOptions(save_probabilities=True, progress=False),
    )
    assert sorted(p.name for p in written) == sorted(p.name for p in (tmp_path / "3d_fullres").glob("*.nii.gz"))
    assert not (out / SCRATCH).exists()  # the configurations' own outputs are removed
    for path in written:
        case = path.name.removesuffix(".nii.gz")
        alone = [read_probabilities(tmp_path / c / f"{case}.npz", scheme) for c in ("2d", "3d_fullres")]
        assert not np.array_equal(*alone)  # the two models differ: a mean of one alone would fail below
        mean = mean_probabilities([tmp_path / c / f"{case}.npz" for c in ("2d", "3d_fullres")], scheme)
        np.testing.assert_array_equal(read_image(path, None)[0], labels_from_probabilities(mean, scheme))
        np.testing.assert_array_equal(read_probabilities(out / f"{case}.npz", scheme), mean.astype(np.float16))
        assert read_image(tmp_path / "3d_fullres" / path.name)[1] == read_image(path)[1]  # the image's geometry


def test_the_chosen_postprocessing_is_applied_to_each_label_map(
    two_configs: Path, inputs: Path, tmp_path: Path
) -> None:
    ws = Workspace.at(two_configs)
    scheme = Plans.from_json(ws.plans_path).label_scheme
    plain = predict(ws, inputs, tmp_path / "plain", config_name="3d_fullres", folds=(0,), window=WINDOW, options=QUIET)
    postprocessing = Postprocessing(largest_foreground_component=True)
    chosen = predict_chosen(
        ws, inference_choice(("3d_fullres",), postprocessing), inputs, tmp_path / "chosen", window=WINDOW, options=QUIET
    )
    changed = 0
    for a, b in zip(sorted(plain), sorted(chosen)):
        expected = apply_postprocessing(read_image(a, None)[0], postprocessing, scheme)
        np.testing.assert_array_equal(read_image(b, None)[0], expected)
        changed += int((expected != read_image(a, None)[0]).sum())
    assert changed > 0  # the one-iteration model's maps have stray components: the step did something


def test_cli_predict_follows_inference_json_from_the_workspace_or_a_model_archive(
    two_configs: Path, inputs: Path, tmp_path: Path, capsys
) -> None:
    """predict -w follows inference.json (an ensemble with postprocessing); export-model packs that choice and
    predict -m on the archive writes the same label maps; -c predicts one configuration without it."""
    ws = Workspace.at(Path(shutil.copytree(two_configs, tmp_path / "ws")))
    inference_choice(("2d", "3d_fullres"), Postprocessing(largest_foreground_component=True)).to_json(ws.inference_path)
    flags = ["-i", str(inputs), "--device", "cpu", "--tta", "none"]
    assert main(["predict", "-w", str(ws.root), "-o", str(tmp_path / "a"), *flags]) == 0
    assert "following" in capsys.readouterr().out
    assert main(["export-model", str(tmp_path / "model.zip"), "-w", str(ws.root)]) == 0
    assert "2d + 3d_fullres" in capsys.readouterr().out
    assert main(["predict", "-m", str(tmp_path / "model.zip"), "-o", str(tmp_path / "b"), *flags]) == 0
    assert "following" in capsys.readouterr().out
    written = sorted((tmp_path / "a").glob("*.nii.gz"))
    assert written and [p.name for p in written] == [p.name for p in sorted((tmp_path / "b").glob("*.nii.gz"))]
    for path in written:
        np.testing.assert_array_equal(read_image(path, None)[0], read_image(tmp_path / "b" / path.name, None)[0])
    assert main(["predict", "-w", str(ws.root), "-o", str(tmp_path / "c"), "-c", "3d_fullres", *flags]) == 0
    assert "following" not in capsys.readouterr().out


def test_continue_skips_cases_an_ensemble_already_wrote(two_configs: Path, inputs: Path, tmp_path: Path) -> None:
    ws = Workspace.at(two_configs)
    out = tmp_path / "out"
    first = predict_chosen(ws, inference_choice(("2d", "3d_fullres")), inputs, out, window=WINDOW, options=QUIET)
    kept = first[0]
    kept.write_bytes(kept.read_bytes())  # a marker: rewriting would change its mtime
    stamp = kept.stat().st_mtime_ns
    others = [p for p in first if p != kept]
    for p in others:
        p.unlink()
    again = predict_chosen(
        ws,
        inference_choice(("2d", "3d_fullres")),
        inputs,
        out,
        window=WINDOW,
        options=PredictOptions(skip_existing=True, progress=False),
    )
    assert sorted(again) == sorted(others) and kept.stat().st_mtime_ns == stamp


def test_parts_of_an_ensemble_write_what_one_run_writes(two_configs: Path, inputs: Path, tmp_path: Path) -> None:
    """--part 1/2 and 2/2 into one folder: the bytes of one run; each part kept its configurations' predictions in a
    scratch folder of its own (a part started afresh does not remove another's) and removed it when done."""
    from cli_checks import snapshot

    ws, choice = Workspace.at(two_configs), inference_choice(("2d", "3d_fullres"))
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    predict_chosen(ws, choice, inputs, whole, window=WINDOW, options=QUIET)
    other_part = parts / scratch_name((2, 2)) / "2d" / "kept.npz"  # part 2's scratch while part 1 starts afresh
    other_part.parent.mkdir(parents=True)
    other_part.write_bytes(b"part 2's")
    first = predict_chosen(ws, choice, inputs, parts, window=WINDOW, options=replace(QUIET, part=(1, 2)))
    assert [p.name for p in first] == ["demo_005.nii.gz"] and other_part.read_bytes() == b"part 2's"
    other_part.unlink()
    predict_chosen(ws, choice, inputs, parts, window=WINDOW, options=replace(QUIET, part=(2, 2)))
    assert snapshot(parts) == snapshot(whole) and len(snapshot(whole)) == 2


def test_an_ensemble_reviews_the_label_map_of_the_mean(two_configs: Path, inputs: Path, tmp_path: Path) -> None:
    """--preview and --statistics of an ensemble: one preview and one statistics row per case, of the label map
    written (the mean's), and none for the configurations' own predictions."""
    import json

    ws, out = Workspace.at(two_configs), tmp_path / "out"
    options = replace(QUIET, preview=True, statistics=True)
    written = predict_chosen(ws, inference_choice(("2d", "3d_fullres")), inputs, out, window=WINDOW, options=options)
    assert sorted(p.name for p in (out / "preview").iterdir()) == ["demo_005.png", "demo_006.png"]
    cases = json.loads((out / "statistics.json").read_text())["cases"]
    assert [c["case_id"] for c in cases] == ["demo_005", "demo_006"]
    labels = read_image(written[0], dtype=None)[0]
    assert [s["voxels"] for s in cases[0]["structures"]] == [int((labels == v).sum()) for v in (1, 2)]
    assert not list(out.glob(f"{SCRATCH}*"))
