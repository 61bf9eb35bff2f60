"""``autoseg predict`` applies the folds' class decision weights (``autoseg.predict.class_weights``) to the label
map's argmax, streamed or with ``--save-probabilities``, and leaves the written probabilities as the network's."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import SimpleITK as sitk

from autoseg.cli.main import main
from autoseg.core.workspace import Workspace
from autoseg.plan.plans import Plans
from autoseg.predict.class_weights import ClassWeights, class_weights_path
from autoseg.predict.graphs import file_digest

CONFIG = "3d_fullres"


def _predict(workspace: Path, inputs: Path, out: Path, *flags: str) -> dict[str, np.ndarray]:
    assert main(["predict", "-w", str(workspace), "-i", str(inputs), "-o", str(out), "--tta", "1", *flags]) == 0
    return {p.name: sitk.GetArrayFromImage(sitk.ReadImage(str(p))) for p in sorted(out.glob("*.nii.gz"))}


def test_predict_weighs_the_argmax_by_the_folds_class_weights(trained: Path, inputs: Path, tmp_path: Path) -> None:
    root = Path(shutil.copytree(trained, tmp_path / "ws"))
    ws = Workspace.at(root)
    scheme = Plans.from_json(ws.plans_path).label_scheme
    favoured, value = scheme.names[-1], scheme.foreground_values[-1][0]
    plain = _predict(root, inputs, tmp_path / "plain")
    checkpoint = ws.checkpoint(CONFIG, 0, "final")
    weights = {name: (1e6 if name == favoured else 1.0) for name in scheme.names}
    ClassWeights(CONFIG, 0, "final", file_digest(checkpoint), ("x",), weights, {}, {}).to_json(
        class_weights_path(checkpoint)
    )
    streamed = _predict(root, inputs, tmp_path / "streamed")
    saved = _predict(root, inputs, tmp_path / "saved", "--save-probabilities")
    for name, labels in plain.items():
        # an untrained network's probabilities are all far above 1e-6 of another's: the favoured class takes
        # every voxel the crop box holds (outside it the label map is background)
        assert (streamed[name] == value).sum() > 2 * max((labels == value).sum(), 1)
        assert np.array_equal(streamed[name], saved[name])
    probabilities = {p.name: np.load(p)["probabilities"] for p in sorted((tmp_path / "saved").glob("*.npz"))}
    for labels_name, labels in plain.items():
        found = probabilities[labels_name.replace(".nii.gz", ".npz")].argmax(0)
        assert np.mean(found == labels) > 0.99  # unweighted: the plain argmax (float16 ties aside)
