"""A cascade stage's network input (``cascade_input``): the preprocessed image, then the one-hot of the previous
stage's label map put on the preprocessed grid as a training label is (``labels_on_grid``)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from factories import box_case, tiny_plans, tiny_topology

from autoseg.core.errors import InputError
from autoseg.dataset.imageio import Geometry
from autoseg.predict.cascade import cascade_input
from autoseg.preprocess.preprocessor import labels_on_grid, preprocess_case


def _cascade_plans():
    plans = tiny_plans(spacing_mm=(2.0, 2.0, 2.0))
    full = plans.configuration("3d_fullres")
    low = full.with_(name="3d_lowres", spacing_mm=(4.0, 4.0, 4.0))
    cascade = full.with_(
        name="3d_cascade_fullres",
        previous_stage="3d_lowres",
        preprocessed_as="3d_fullres",
        network=dataclasses.replace(tiny_topology(3), in_channels=3),
    )
    plans = dataclasses.replace(
        plans, configurations={"3d_fullres": full, "3d_lowres": low, "3d_cascade_fullres": cascade}
    )
    plans.check()
    return plans, cascade


def test_the_input_is_the_image_then_the_one_hot_of_the_previous_labels_on_its_grid() -> None:
    plans, cascade = _cascade_plans()
    image, labels = box_case()
    geometry = Geometry(
        ndim=3,
        size_xyz=image.shape[::-1],
        spacing_xyz=(1.0, 1.0, 1.0),
        origin_xyz=(0.0,) * 3,
        direction=(1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0),
    )
    data, _, props = preprocess_case(image[None].copy(), None, geometry, plans, cascade, "box")
    out = cascade_input(data, labels, props, plans, cascade)
    assert out.shape == (3, *data.shape[1:]) and out.dtype == np.float32
    assert np.array_equal(out[:1], data)
    on_grid = labels_on_grid(labels, props)[0]
    assert on_grid.shape == data.shape[1:] == props.shape_after_resample
    for k, value in enumerate((1, 2)):
        assert np.array_equal(out[1 + k], (on_grid == value).astype(np.float32))
        assert out[1 + k].sum() > 0  # both boxes survive the crop and resampling
    assert set(np.unique(out[1:])) == {0.0, 1.0} and out[1:].sum(0).max() == 1.0
    with pytest.raises(InputError, match="predicted for another image"):
        labels_on_grid(labels[:, :5], props)
    with pytest.raises(InputError, match="takes 3d_lowres's predicted label map"):
        cascade_input(data, None, props, plans, cascade)


def test_a_plan_whose_cascade_lacks_the_one_hot_channels_is_refused() -> None:
    plans, cascade = _cascade_plans()
    wrong = cascade.with_(network=dataclasses.replace(cascade.network, in_channels=1))
    with pytest.raises(InputError, match=r"in_channels 1 .* 1 channel\(s\) \+ 2 one-hot channel\(s\) of 3d_lowres"):
        dataclasses.replace(plans, configurations={**plans.configurations, "3d_cascade_fullres": wrong}).check()
    orphan = cascade.with_(previous_stage="2d")
    with pytest.raises(InputError, match="previous_stage '2d' must name another planned configuration"):
        dataclasses.replace(plans, configurations={**plans.configurations, "3d_cascade_fullres": orphan}).check()
