"""A fold predicts only with the plan it was trained with: its checkpoint records what its network's input depends on
(``model_input_fields``), and predict refuses a plans.json edited since, naming the fields and the fold."""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from cli_checks import assert_refused, run_cli, snapshot

from autoseg.core.errors import InputError
from autoseg.plan.plans import Plans
from autoseg.predict.networks import check_trained_with
from autoseg.preprocess.plan_fields import MODEL_INPUT_KEY, model_input_fields

CONFIG = "3d_fullres"


def _edit_plans(ws: Path, change) -> None:
    plans = json.loads((ws / "plans.json").read_text())
    change(plans)
    (ws / "plans.json").write_text(json.dumps(plans))


EDITS = {  # an edit of plans.json -> the field the refusal names
    "normalization": (lambda p: p.update(normalization=["ct"]), "normalization: ['zscore'] -> ['ct']"),
    "spacing": (
        lambda p: p["configurations"][CONFIG].update(
            spacing_mm=[2 * s for s in p["configurations"][CONFIG]["spacing_mm"]]
        ),
        "spacing_mm: [",
    ),
    "strides": (
        lambda p: p["configurations"][CONFIG]["network"].update(strides=[[1, 1, 1], [1, 2, 2]]),
        "network.strides: [[1, 1, 1], [2, 2, 2]] -> [[1, 1, 1], [1, 2, 2]]",
    ),
}


@pytest.mark.slow  # the trained fixture
@pytest.mark.parametrize("name", list(EDITS))
def test_predict_refuses_a_fold_trained_with_another_plan_naming_the_field_and_the_fold(
    name: str, trained: Path, inputs: Path, tmp_path: Path, capsys
) -> None:
    ws = Path(shutil.copytree(trained, tmp_path / "ws"))
    edit, named = EDITS[name]
    _edit_plans(ws, edit)
    before = snapshot(ws)
    result = run_cli(capsys, "predict", "-i", inputs, "-o", tmp_path / "out", "-w", ws, "--no-mirror")
    checkpoint = ws / "results" / CONFIG / "fold_0" / "checkpoint_final.pt"
    assert_refused(result, 2, checkpoint, f"fold 0 of {CONFIG} was trained with another plan", named)
    assert snapshot(tmp_path / "out") == {} and snapshot(ws) == before


@pytest.mark.slow  # the trained fixture
def test_the_trained_checkpoint_records_the_plan_as_it_was_trained(trained: Path) -> None:
    plans = Plans.from_json(trained / "plans.json")
    state = torch.load(trained / "results" / CONFIG / "fold_0" / "checkpoint_final.pt", weights_only=True)
    assert json.loads(state[MODEL_INPUT_KEY]) == model_input_fields(plans, CONFIG)


def test_a_checkpoint_without_the_record_is_predicted_with_a_warning(prepared: Path, caplog) -> None:
    plans = Plans.from_json(prepared / "plans.json")
    path = prepared / "results" / CONFIG / "fold_0" / "checkpoint_final.pt"
    with caplog.at_level(logging.WARNING, logger="autoseg"):
        check_trained_with({"network": {}}, plans, plans.configuration(CONFIG), path)
    assert f"{path} was written before autoseg recorded the plan" in caplog.text


def test_only_the_fields_the_input_depends_on_are_compared(prepared: Path) -> None:
    """The batch or the loader workers may change after training (they do not reach the network's input); the
    normalization may not."""
    plans = Plans.from_json(prepared / "plans.json")
    config = plans.configuration(CONFIG)
    state = {MODEL_INPUT_KEY: json.dumps(model_input_fields(plans, CONFIG))}
    rebatched = replace(plans, configurations={CONFIG: config.with_(batch_size=1, loader_workers=3)})
    check_trained_with(state, rebatched, config, Path("checkpoint_final.pt"))
    normalized = replace(plans, normalization=("ct",))
    with pytest.raises(InputError, match=r"normalization: \['zscore'\] -> \['ct'\]"):
        check_trained_with(state, normalized, config, Path("checkpoint_final.pt"))
