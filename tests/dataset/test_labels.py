"""LabelScheme: the three dataset.json label forms (plain, ignore, regions), conversions and errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from autoseg.dataset.labels import LabelError, LabelScheme, label_map_dtype

BRATS = {"background": 0, "whole_tumor": [1, 2, 3], "tumor_core": [2, 3], "enhancing": 3}


def test_plain_labels() -> None:
    s = LabelScheme.from_labels({"background": 0, "lesion": 2, "organ": 1})
    assert (s.num_outputs, s.has_regions, s.ignore_value, s.regions) == (3, False, None, ())
    assert s.names == ("organ", "lesion")  # in value order, whatever the file's order
    assert s.foreground_values == ((1,), (2,)) and s.foreground_channels == (1, 2)
    assert s.label_values == (0, 1, 2) and s.num_label_values == 3


def test_ignore_is_not_an_output() -> None:
    s = LabelScheme.from_labels({"background": 0, "organ": 1, "lesion": 2, "ignore": 3})
    assert (s.num_outputs, s.ignore_value, s.names) == (3, 3, ("organ", "lesion"))
    assert s.label_values == (0, 1, 2, 3) and s.num_label_values == 4


def test_regions_with_ignore() -> None:
    s = LabelScheme.from_labels({**BRATS, "ignore": 4}, [1, 2, 3])
    assert (s.num_outputs, s.has_regions, s.ignore_value) == (3, True, 4)
    assert s.names == ("whole_tumor", "tumor_core", "enhancing")  # the file's order is the output order
    assert s.regions == ((1, 2, 3), (2, 3), (3,)) and s.foreground_channels == (0, 1, 2)
    assert s.regions_class_order == (1, 2, 3) and s.label_values == (0, 1, 2, 3, 4)


def test_target_to_regions_marks_each_region_and_skips_ignore_and_minus_one() -> None:
    s = LabelScheme.from_labels({**BRATS, "ignore": 4}, [1, 2, 3])
    seg = torch.tensor([0, 1, 2, 3, 4, -1]).view(1, 1, 6)
    got = s.target_to_regions(seg)
    assert got.dtype == torch.bool and got.shape == (1, 3, 6)
    assert got[0].int().tolist() == [[0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 0, 0]]
    assert s.valid_mask(seg)[0, 0].tolist() == [True, True, True, True, False, True]
    plain = LabelScheme.from_labels({"background": 0, "a": 1, "b": 2})
    assert plain.target_to_regions(seg.clamp(max=2))[0].int().tolist() == [[0, 1, 0, 0, 0, 0], [0, 0, 1, 1, 1, 0]]
    assert plain.valid_mask(seg) is None


def test_regions_paint_in_order_later_over_earlier() -> None:
    s = LabelScheme.from_labels(BRATS, [1, 2, 3])
    # voxels: nothing; whole tumor only; wt + core; all three; enhancing alone (painted though wt is low)
    p = np.array([[0.1, 0.9, 0.9, 0.9, 0.2], [0.1, 0.4, 0.6, 0.8, 0.1], [0.1, 0.1, 0.3, 0.7, 0.6]], dtype=np.float32)
    labels = np.zeros(5, dtype=s.export_dtype())
    for region in range(3):
        s.paint_region(labels, region, p[region])
    assert labels.tolist() == [0, 1, 2, 3, 3] and labels.dtype == np.uint8


def test_probabilities_are_softmax_for_classes_and_sigmoid_for_regions() -> None:
    s = LabelScheme.from_labels({"background": 0, "a": 1, "b": 2, "ignore": 3})
    logits = torch.tensor([[[2.0, 0.0, 0.0]], [[0.0, 3.0, 0.0]], [[0.0, 0.0, 1.0]]])  # (C=3, 1, 3)
    probs = s.probabilities(logits, dim=0)
    assert torch.allclose(probs.sum(0), torch.ones(1, 3))
    assert probs.argmax(0).tolist() == [[0, 1, 2]]  # never the ignore value: it has no output
    regions = LabelScheme.from_labels(BRATS, [1, 2, 3])
    assert torch.allclose(regions.probabilities(logits), torch.sigmoid(logits))


def test_region_targets_round_trip_to_the_label_map() -> None:
    s = LabelScheme.from_labels(BRATS, [1, 2, 3])
    seg = torch.tensor([[0, 1, 2], [3, 2, 1]]).view(1, 1, 2, 3)
    probabilities = s.target_to_regions(seg)[0].float().numpy()
    labels = np.zeros(seg.shape[2:], dtype=s.export_dtype())
    for region in range(s.num_outputs):
        s.paint_region(labels, region, probabilities[region])
    assert np.array_equal(labels, seg[0, 0].numpy())


@pytest.mark.parametrize(
    "labels, order, message",
    [
        (BRATS, None, r'need a top-level "regions_class_order".*e\.g\. "regions_class_order": \[1, 2, 3\]'),
        (BRATS, [1, 2], r"regions_class_order \[1, 2\] must hold one integer per region; there are 3"),
        (BRATS, [1, 1, 3], r"regions_class_order\[1\] is 1, which is not a value of region 'tumor_core' \[2, 3\]"),
        ({"background": 0, "a": [0, 1]}, [1], r"region 'a' holds 0 \(background\)"),
        ({"background": 0, "a": 1, "ignore": 1}, None, r"'ignore' is 1 but must be the highest label value.*give it 2"),
        ({**BRATS, "ignore": 2}, [1, 2, 3], r"'ignore' is 2 but must be the highest"),
        ({"background": 0, "a": 1, "ignore": 3}, None, r"consecutive integers from 0.*ignore: 3"),
        ({"background": 0, "a": 1, "b": 3}, None, r"consecutive integers from 0"),
        ({"background": 0, "a": 1, "b": 1}, None, r"consecutive integers from 0, each used once"),
        ({"background": 0, "a": 1}, [1], r"regions_class_order is only for region-based labels"),
        ({"background": 0, "a": 1, "ignore": [2]}, None, r"'ignore' must be one integer"),
        ({"background": 1, "a": 0}, None, r"must map 'background' to 0"),
        ({"organ": 1}, None, r'no label has value 0; add "background": 0'),
        ({"background": 0, "a": True}, None, r"label 'a' has value True; expected a non-negative integer"),
        ({"background": 0, "a": []}, None, r"label 'a' has value \[\]"),
        ({}, None, r"'labels' must be an object"),
    ],
)
def test_errors_name_the_file_and_the_fix(labels, order, message) -> None:
    with pytest.raises(LabelError, match=message) as info:
        LabelScheme.from_labels(labels, order, where="/data/Dataset001/dataset.json")
    assert str(info.value).startswith("/data/Dataset001/dataset.json: ")


def test_plain_helper() -> None:
    s = LabelScheme.plain(3)
    assert (s.num_outputs, s.names) == (3, ("1", "2"))


def test_stand_in_for_an_output_count() -> None:
    assert LabelScheme.for_outputs(3) == LabelScheme.plain(3)
    single = LabelScheme.for_outputs(1)  # one output can only be a sigmoid region
    assert (single.has_regions, single.num_outputs, single.regions) == (True, 1, ((1,),))
    assert single.regions_class_order == (1,)


def test_plans_carry_regions_and_old_plans_still_load(tmp_path) -> None:
    import dataclasses
    import json

    from factories import tiny_plans

    from autoseg.plan.plans import Plans

    old = tmp_path / "old.json"
    tiny_plans().to_json(old)
    payload = json.loads(old.read_text())
    del payload["regions_class_order"]  # written before region support
    old.write_text(json.dumps(payload))
    scheme = Plans.from_json(old).label_scheme
    assert (scheme.names, scheme.num_outputs, scheme.has_regions) == (("organ", "lesion"), 3, False)

    labels = {"background": 0, "organ": (1, 2), "lesion": 2, "ignore": 3}
    plans = tiny_plans()
    config = plans.configurations["3d_fullres"]
    config = config.with_(network=dataclasses.replace(config.network, num_outputs=2))  # one per region
    regions = dataclasses.replace(
        plans, labels=labels, regions_class_order=(1, 2), configurations={"3d_fullres": config}
    )
    regions.to_json(tmp_path / "plans.json")
    assert json.loads((tmp_path / "plans.json").read_text())["labels"]["organ"] == [1, 2]
    loaded = Plans.from_json(tmp_path / "plans.json")
    assert loaded.labels == labels and loaded.num_label_values == 4
    assert loaded.label_scheme.num_outputs == 2 and loaded.label_scheme.ignore_value == 3


def test_label_map_dtype_holds_minus_one_to_the_last_value() -> None:
    assert label_map_dtype(3) is np.int8 and label_map_dtype(127) is np.int8  # -1 .. 126
    assert label_map_dtype(128) is np.int16
