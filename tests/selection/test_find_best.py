"""autoseg find-best on a fake cross-validation whose answers are known by construction (cv_workspace)."""

from __future__ import annotations

import json
import math
import shutil
import tracemalloc

import numpy as np
import pytest
from cv_workspace import EXPECTED, FOLDS, SHAPE, make_workspace

from autoseg.cli.main import main
from autoseg.core.errors import InputError
from autoseg.predict.choice import InferenceChoice
from autoseg.predict.postprocessing import Postprocessing
from autoseg.predict.probabilities import ensemble_case_bytes
from autoseg.selection.run import find_best
from autoseg.selection.scoring import Candidate, candidate_labels
from autoseg.selection.sources import collect


def _mean(pair: tuple[float, float]) -> float:
    return (pair[0] + pair[1]) / 2


def test_each_candidate_scores_its_known_cross_validation_dice(tmp_path) -> None:
    result = find_best(make_workspace(tmp_path))
    figures = {c.name: c for c in result.report.candidates}
    assert list(figures) == ["A", "B", "A+B"]
    for name, (organ, lesion) in EXPECTED.items():
        assert figures[name].class_dice == pytest.approx({"organ": organ, "lesion": lesion}), name
        assert figures[name].mean_dice == pytest.approx(_mean(EXPECTED[name])), name
    assert figures["B"].mean_dice > figures["A"].mean_dice
    assert result.report.num_cases == 4


def test_the_ensemble_wins_and_largest_component_helps_the_organ_only(tmp_path) -> None:
    choice = find_best(make_workspace(tmp_path)).choice
    assert choice.configurations == ("A", "B")
    assert choice.folds == (0, 1)
    assert choice.postprocessing == Postprocessing(largest_foreground_component=False, largest_component_of=("organ",))
    steps = {s.target: s for s in choice.steps}
    assert not steps["foreground"].applied and steps["foreground"].dice_after < steps["foreground"].dice_before
    assert steps["organ"].applied and steps["organ"].dice_after == pytest.approx(1.0)
    assert not steps["lesion"].applied and steps["lesion"].dice_after == pytest.approx(16 / 17)
    assert choice.cv_dice == pytest.approx(_mean(EXPECTED["A+B"]))
    assert choice.cv_dice_postprocessed == pytest.approx(1.0)
    assert choice.class_dice_postprocessed == pytest.approx({"organ": 1.0, "lesion": 1.0})


def test_inference_json_round_trips_and_the_reports_are_written(tmp_path) -> None:
    ws = make_workspace(tmp_path)
    result = find_best(ws)
    assert InferenceChoice.from_json(ws.inference_path) == result.choice
    assert json.loads(ws.inference_path.read_text())["schema_version"] == 1
    report = json.loads(ws.find_best_path.read_text())
    assert report["best"] == "A+B" and report["best_postprocessed"]["mean_dice"] == pytest.approx(1.0)
    markdown = ws.find_best_path.with_suffix(".md").read_text()
    assert "| A+B **(chosen)** |" in markdown and f"autoseg predict -w {ws.root}" in markdown


def test_a_single_configuration_is_chosen_alone(tmp_path) -> None:
    choice = find_best(make_workspace(tmp_path), configs=["B"]).choice
    assert choice.configurations == ("B",) and list(choice.candidates) == ["B"]


def test_a_missing_fold_is_named_with_the_command_that_trains_it(tmp_path) -> None:
    ws = make_workspace(tmp_path)
    shutil.rmtree(ws.results("B", 1))
    with pytest.raises(InputError, match=r"B fold 1: not trained .* run `autoseg train fold 1 -c B -w "):
        find_best(ws)
    assert not ws.inference_path.exists()
    assert find_best(ws, folds=(0,)).choice.folds == (0,)  # the user chooses fewer folds


def test_a_fold_without_its_probabilities_is_named(tmp_path) -> None:
    ws = make_workspace(tmp_path)
    (ws.results("A", 0) / "validation" / f"{FOLDS[0][1]}.npz").unlink()
    with pytest.raises(
        InputError,
        match=rf"A fold 0: its final validation is incomplete .*missing {FOLDS[0][1]}.npz"
        r"\); run `autoseg train fold 0 -c A -w \S+ --resume`",
    ):
        find_best(ws)


def test_a_fold_validated_on_other_splits_is_refused(tmp_path) -> None:
    ws = make_workspace(tmp_path)
    other = FOLDS[1][0]
    shutil.copy(ws.results("B", 1) / "validation" / f"{other}.npz", ws.results("B", 0) / "validation")
    with pytest.raises(InputError, match=rf"B fold 0: validated case\(s\) \['{other}'\] .* other splits"):
        find_best(ws)


def test_folds_beyond_the_splits_and_unknown_configurations_are_refused(tmp_path) -> None:
    ws = make_workspace(tmp_path)
    with pytest.raises(InputError, match=r"fold\(s\) \[2\]: .* has 2 folds"):
        find_best(ws, folds=(0, 1, 2))
    with pytest.raises(InputError, match=r"--configs: C not planned"):
        find_best(ws, configs=["A", "C"])


def test_the_cli_prints_the_table_and_the_predict_command(tmp_path, capsys) -> None:
    ws = make_workspace(tmp_path)
    assert main(["find-best", "-w", str(ws.root), "--folds", "0", "1"]) == 0
    out = capsys.readouterr().out
    assert "| A+B **(chosen)** |" in out and f"predict with: autoseg predict -w {ws.root}" in out
    shutil.rmtree(ws.results("A", 0))
    assert main(["find-best", "-w", str(ws.root)]) == 2
    assert "autoseg train fold 0 -c A" in capsys.readouterr().err


def test_an_ensembles_host_memory_is_what_its_estimate_says(tmp_path) -> None:
    """Held against a measurement (tracemalloc sees numpy's buffers) on a case big enough for the buffers to
    dominate."""
    ws = make_workspace(tmp_path)
    cv = collect(ws)
    big = (3, 48, 64, 64)
    rng = np.random.default_rng(0)
    for config in ("A", "B"):
        p = rng.random(big, dtype=np.float32)
        np.savez(
            cv.probabilities(config, cv.cases[0]),
            probabilities=(p / p.sum(0)).astype(np.float16),
            names=np.array(["background", "organ", "lesion"]),
            activation=np.array("softmax"),
        )
    tracemalloc.start()
    labels = candidate_labels(cv, Candidate(("A", "B")), cv.cases[0])
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    estimate = ensemble_case_bytes(big[0], math.prod(big[1:]))
    assert labels.shape == big[1:] and labels.shape != SHAPE
    assert 0.6 * estimate <= peak <= 1.1 * estimate, (peak, estimate)


def test_find_best_without_trained_folds_advises_the_folds_splits_json_holds(prepared, tmp_path) -> None:
    """splits.json holds four folds: the advice names folds 0 1 2 3 (not 0-4, which would fail at fold 4), and the
    advised command parses with the CLI's own parser."""
    import re
    import shlex

    from autoseg.cli.parser import parse_args
    from autoseg.core.workspace import Workspace, make_splits
    from autoseg.preprocess.store import list_cases

    workspace = Workspace.at(shutil.copytree(prepared, tmp_path / "ws"))
    cases = list_cases(workspace.preprocessed("3d_fullres"))
    make_splits(cases, num_folds=4).to_json(workspace.splits_path)
    with pytest.raises(InputError) as info:
        find_best(workspace, progress=False)
    (advice,) = re.findall(r"`autoseg ([^`]+)`", str(info.value))
    args = parse_args(shlex.split(advice))
    assert args.command == "train" and list(args.folds) == [0, 1, 2, 3] and args.config == "3d_fullres"
