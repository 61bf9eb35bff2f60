"""Class decision weights: fitted on a fold's validation probabilities where a class is under-calibrated (and only
there), bound to their checkpoint, combined over folds, and carried in a model archive."""

from __future__ import annotations

import numpy as np
import pytest

from autoseg.core.errors import InputError
from autoseg.dataset.imageio import Geometry, write_image
from autoseg.dataset.labels import LabelScheme
from autoseg.predict.class_weights import ClassWeights, class_weights_path, fold_weights, stored_weights
from autoseg.predict.graphs import file_digest
from autoseg.predict.probabilities import write_probabilities
from autoseg.train.class_weights import MIN_GAIN, WEIGHT_GRID, fit_weights

SCHEME = LabelScheme.from_labels({"background": 0, "organ": 1, "lesion": 2}, where="x")
SHAPE = (6, 20, 20)


def _case(folder, i: int, lesion_probability: float):
    """A reference with an organ block and two small lesions inside it, and probabilities that get the organ right
    but give the lesions only ``lesion_probability`` (0.0001 elsewhere): a network separating them, uncalibrated."""
    reference = np.zeros(SHAPE, np.uint8)
    reference[1:5, 3:17, 3:17] = 1
    reference[2:4, 5:7, 5:7] = 2
    reference[2:4, 12:14, 11:13] = 2
    probabilities = np.zeros((3, *SHAPE), np.float32)
    probabilities[2] = 0.0001
    probabilities[1] = np.where(reference > 0, 0.9, 0.05)
    probabilities[2][reference == 2] = lesion_probability
    probabilities[0] = 1 - probabilities[1] - probabilities[2]
    geometry = Geometry(3, tuple(reversed(SHAPE)), (1.0, 1.0, 1.0), (0.0, 0.0, 0.0), (1, 0, 0, 0, 1, 0, 0, 0, 1))
    npz, label = folder / f"c{i}.npz", folder / f"c{i}.nii.gz"
    write_probabilities(npz, probabilities, SCHEME)
    write_image(label, reference, geometry)
    return npz, label


def test_an_uncalibrated_class_gets_the_least_factor_that_makes_the_argmax_find_it(tmp_path):
    cases = [_case(tmp_path, i, 0.02) for i in range(3)]
    weights, before, after = fit_weights(cases, SCHEME)
    # 0.02 x 50 = 1.0 beats the organ's 0.9 inside the lesions, and 0.0001 x 50 never wins elsewhere
    assert weights == {"organ": 1.0, "lesion": 50.0}
    assert before["lesion"] == 0.0 and after["lesion"] == pytest.approx(1.0)
    assert after["organ"] == pytest.approx(1.0)


def test_a_calibrated_model_keeps_every_factor_at_one(tmp_path):
    cases = [_case(tmp_path, i, 0.95) for i in range(2)]
    weights, before, after = fit_weights(cases, SCHEME)
    assert weights == {"organ": 1.0, "lesion": 1.0}
    assert before == after
    assert 1.0 in WEIGHT_GRID and MIN_GAIN > 0


def _stored(folder, sha256: str, lesion: float) -> ClassWeights:
    weights = ClassWeights("3d_fullres", 0, "final", sha256, ("c0",), {"organ": 1.0, "lesion": lesion}, {}, {})
    checkpoint = folder / "checkpoint_final.pt"
    weights.to_json(class_weights_path(checkpoint))
    return weights


def test_weights_belong_to_their_checkpoint_and_folds_combine_geometrically(tmp_path):
    folds = []
    for fold, lesion in ((0, 100.0), (1, 4.0), (2, None)):
        folder = tmp_path / f"fold_{fold}"
        folder.mkdir()
        checkpoint = folder / "checkpoint_final.pt"
        checkpoint.write_bytes(f"weights of fold {fold}".encode())
        if lesion is not None:
            _stored(folder, file_digest(checkpoint), lesion)
        folds.append(checkpoint)
    assert stored_weights(folds[0]).weights["lesion"] == 100.0
    assert stored_weights(folds[2]) is None
    # (100 x 4 x 1) ** (1/3): a fold without weights counts as 1
    assert fold_weights(folds, SCHEME) == pytest.approx([1.0, 1.0, 400 ** (1 / 3)])
    folds[1].write_bytes(b"trained again")  # its weights were fitted for the old checkpoint: not applied
    assert stored_weights(folds[1]) is None
    assert fold_weights(folds[1:], SCHEME) is None
    regions = LabelScheme.from_labels({"background": 0, "organ": [1, 2], "lesion": [2]}, [1, 2], where="x")
    assert fold_weights(folds[:1], regions) is None


@pytest.mark.parametrize("factor", [0.0, -2.0, float("inf")])
def test_a_hand_edited_weight_that_is_not_a_positive_factor_is_refused_naming_the_file(tmp_path, factor):
    checkpoint = tmp_path / "checkpoint_final.pt"
    checkpoint.write_bytes(b"weights")
    _stored(tmp_path, file_digest(checkpoint), factor)
    with pytest.raises(InputError, match=r"class_weights.json: class weights must be positive finite"):
        fold_weights([checkpoint], SCHEME)
