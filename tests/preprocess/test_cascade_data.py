"""What is preprocessed around the cascade: 3d_lowres only when planned, never a folder for 3d_cascade_fullres
(it reads 3d_fullres's cases)."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

from autoseg.core.workspace import Workspace
from autoseg.plan.plans import Plans
from autoseg.preprocess.run import preprocess_workspace, preprocessed_configurations


def test_without_lowres_nothing_of_it_is_preprocessed(prepared: Path, tmp_path: Path) -> None:
    ws = Workspace.at(Path(shutil.copytree(prepared, tmp_path / "ws")))
    plans = Plans.from_json(ws.plans_path)
    assert "3d_lowres" not in plans.configurations and "3d_cascade_fullres" not in plans.configurations
    preprocess_workspace(ws, processes=1, progress=False)  # every planned configuration
    folders = sorted(p.name for p in (ws.root / "preprocessed").iterdir())
    assert folders == sorted(
        ["2d", "2d_report.json", "2d_source.json", "3d_fullres", "3d_fullres_report.json", "3d_fullres_source.json"]
    )


def test_the_cascade_names_3d_fullres_folder() -> None:
    from factories import tiny_plans

    plans = tiny_plans()
    full = plans.configuration("3d_fullres")
    configs = {
        "3d_fullres": full,
        "3d_lowres": full.with_(name="3d_lowres", spacing_mm=(5.5, 1.8, 1.8)),
        "3d_cascade_fullres": full.with_(
            name="3d_cascade_fullres", previous_stage="3d_lowres", preprocessed_as="3d_fullres"
        ),
    }
    plans = dataclasses.replace(plans, configurations=configs)
    assert preprocessed_configurations(plans) == ["3d_fullres", "3d_lowres"]
    assert preprocessed_configurations(plans, ["3d_cascade_fullres"]) == ["3d_fullres"]
