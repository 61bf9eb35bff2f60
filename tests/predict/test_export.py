"""SlabExport: the label map built slab by slab as the sliding window finishes them equals the export of the
whole probabilities at once, and holds what slab_export_bytes says."""

from __future__ import annotations

import tracemalloc
from dataclasses import replace

import numpy as np
import pytest
import torch

from autoseg.dataset.imageio import Geometry
from autoseg.dataset.labels import LabelScheme
from autoseg.memory.host import export_bytes, slab_export_bytes
from autoseg.predict.export import SlabExport, export_segmentation
from autoseg.preprocess.store import CaseProperties


def _case(
    original: tuple[int, int, int],
    resampled: tuple[int, int, int],
    spacing: tuple[float, float, float],
    crop: tuple[tuple[int, int], ...] | None = None,
) -> CaseProperties:
    """A case whose cropped original grid ``original`` was resampled to ``resampled`` (spacing of ``original``:
    ``spacing``); ``crop``: where the crop sits in a larger uncropped image (None: the crop is the image)."""
    crop = crop or tuple((0, n) for n in original)
    full = tuple(b + 3 if a else b for a, b in crop) if any(a for a, _ in crop) else original
    target = tuple(s * o / r for s, o, r in zip(spacing, original, resampled))
    geometry = Geometry(
        ndim=3,
        size_xyz=tuple(reversed(full)),
        spacing_xyz=tuple(reversed(spacing)),
        origin_xyz=(0.0, 0.0, 0.0),
        direction=(1.0, 0, 0, 0, 1.0, 0, 0, 0, 1.0),
    )
    return CaseProperties(
        case_id="x",
        geometry=geometry,
        spacing_mm=spacing,
        target_spacing_mm=target,
        shape_before_crop=full,
        crop_bbox=crop,
        shape_after_crop=original,
        shape_after_resample=resampled,
    )


def _probabilities(k: int, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    logits = torch.randn((k, *shape), generator=torch.Generator().manual_seed(seed)) * 3
    return torch.softmax(logits, dim=0)


def _in_slabs(export: SlabExport, probabilities: torch.Tensor, depths: list[int]) -> np.ndarray:
    z = 0
    for i in range(10**6):
        if z >= probabilities.shape[1]:
            break
        d = depths[i % len(depths)]
        export.add(z, min(z + d, probabilities.shape[1]), probabilities[:, z : z + d].clone())
        z += d
    return export.labels()


@pytest.mark.parametrize(
    ("original", "resampled", "spacing"),
    [
        ((13, 20, 18), (31, 16, 22), (3.0, 1.0, 1.0)),  # anisotropic: nearest along z, upsampled along z
        ((31, 20, 18), (13, 24, 20), (3.0, 1.0, 1.0)),  # anisotropic, downsampled along z
        ((17, 20, 18), (23, 16, 22), (1.2, 1.0, 1.0)),  # isotropic: linear along z, across slab borders
        ((23, 20, 18), (9, 20, 18), (1.2, 1.0, 1.0)),  # isotropic, z only
        ((12, 20, 18), (12, 20, 18), (1.0, 1.0, 1.0)),  # unchanged
    ],
)
@pytest.mark.parametrize("regions", [False, True])
def test_slabs_give_the_labels_of_the_whole_export(original, resampled, spacing, regions) -> None:
    """Any slab sizes (1 slice, odd sizes, the whole image at once) give exactly the labels of exporting the
    whole probabilities (the same taps), uncropped into the original image."""
    props = _case(original, resampled, spacing, crop=((2, 2 + original[0]), (1, 1 + original[1]), (0, original[2])))
    scheme = (
        LabelScheme.from_labels({"background": 0, "a": [1, 2], "b": 2}, (1, 2)) if regions else LabelScheme.plain(4)
    )
    probabilities = _probabilities(scheme.num_outputs, resampled)
    whole = export_segmentation(probabilities, props, scheme)
    assert whole.shape == props.shape_before_crop and np.count_nonzero(whole[:2]) == 0  # zeros outside the crop
    assert len(np.unique(whole)) >= 3 if not regions else len(np.unique(whole)) == 3
    for depths in ([1], [5, 2, 7], [resampled[0]]):
        slabs = _in_slabs(SlabExport(props, scheme, resampled), probabilities, depths)
        np.testing.assert_array_equal(slabs, whole, err_msg=str(depths))


def test_slab_export_refuses_slabs_out_of_order_and_labels_before_the_end() -> None:
    props = _case((10, 8, 8), (10, 8, 8), (1.0, 1.0, 1.0))
    export = SlabExport(props, LabelScheme.plain(2), (10, 8, 8))
    probabilities = _probabilities(2, (10, 8, 8))
    export.add(0, 4, probabilities[:, :4])
    with pytest.raises(ValueError, match="slabs come in order"):
        export.add(5, 10, probabilities[:, 5:])
    with pytest.raises(ValueError, match="of 10 output slices exported"):
        export.labels()


@pytest.mark.parametrize(
    ("original", "resampled", "spacing", "depth"),
    [
        ((60, 120, 100), (30, 100, 90), (3.0, 1.0, 1.0), 8),  # up in every axis
        ((40, 80, 80), (40, 160, 160), (1.0, 1.0, 1.0), 12),  # down in-plane
        ((50, 64, 64), (50, 64, 64), (1.0, 1.0, 1.0), 10),  # unchanged
    ],
)
@pytest.mark.parametrize("regions", [False, True])
def test_slab_export_bytes_bounds_the_measured_slab_export(original, resampled, spacing, depth, regions) -> None:
    """slab_export_bytes against tracemalloc's peak of a real SlabExport fed slabs of ``depth`` slices (the slabs
    themselves, held by the sliding window, left out): an upper bound, and within 25%; well below exporting the
    whole float16 probabilities."""
    props = _case(original, resampled, spacing)
    scheme = (
        LabelScheme.from_labels({"background": 0, "a": [1, 2], "b": 2}, (1, 2)) if regions else LabelScheme.plain(5)
    )
    probabilities = _probabilities(scheme.num_outputs, resampled)
    slabs = [probabilities[:, z : z + depth].clone() for z in range(0, resampled[0], depth)]
    tracemalloc.start()
    export = SlabExport(props, scheme, resampled)
    for i, slab in enumerate(slabs):
        export.add(i * depth, i * depth + slab.shape[1], slab)
    labels = export.labels()
    measured = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    del labels
    estimate = slab_export_bytes(original, resampled, scheme, depth)["total"]
    assert 0.75 * estimate <= measured <= estimate, (measured, estimate)
    assert estimate < 0.6 * export_bytes(original, resampled, scheme, 2)["total"]  # the whole export, float16


def _resampled_maps(maps: torch.Tensor, props: CaseProperties, scheme: LabelScheme) -> np.ndarray:
    """Every output's map in the original (cropped) grid, as the export interpolates it: (K, *original) float32."""
    held: dict[int, np.ndarray] = {}
    export_segmentation(maps, props, scheme, on_output=lambda k, m: held.__setitem__(k, m.copy()))
    return np.stack([held[k] for k in sorted(held)])


@pytest.mark.parametrize("regions", [False, True])
def test_logits_are_resampled_then_activated(regions: bool) -> None:
    """A scheme that resamples logits (an imported nnU-Net model): the label map is the argmax (regions: logit > 0) of
    the resampled logits, and the probabilities written are the softmax over the resampled classes (sigmoid per
    region), as nnU-Net computes them; not the resampled softmax."""
    from dataclasses import replace

    from autoseg.predict.export import export_with_probabilities

    props = _case((20, 30, 26), (10, 24, 20), (3.0, 1.0, 1.0))
    plain = LabelScheme.from_labels({"background": 0, "a": [1, 2], "b": 2}, (1, 2)) if regions else LabelScheme.plain(4)
    scheme = replace(plain, resample_logits=True)
    logits = torch.randn((scheme.num_outputs, 10, 24, 20), generator=torch.Generator().manual_seed(3)) * 4
    resampled = torch.from_numpy(_resampled_maps(logits, props, scheme))
    written: dict[int, np.ndarray] = {}
    labels = export_with_probabilities(logits, props, scheme, lambda k, m: written.__setitem__(k, m.copy()))
    probabilities = torch.sigmoid(resampled) if regions else torch.softmax(resampled, dim=0)
    got = np.stack([written[k] for k in sorted(written)])
    np.testing.assert_allclose(got, probabilities.numpy(), atol=1e-6)
    if regions:
        expected = np.zeros(labels.shape, labels.dtype)
        for region, value in enumerate(scheme.regions_class_order):
            expected[resampled[region].numpy() > 0] = value
    else:
        expected = resampled.argmax(dim=0).numpy()
    np.testing.assert_array_equal(labels, expected)
    # resampling the softmax instead gives other probabilities: the order is what is tested
    other = _resampled_maps(torch.sigmoid(logits) if regions else torch.softmax(logits, dim=0), props, plain)
    assert np.abs(other - got).max() > 1e-3


@pytest.mark.parametrize("regions", [False, True])
def test_export_bytes_bound_the_measured_export_of_logits(regions: bool) -> None:
    """export_bytes of a scheme that resamples logits against tracemalloc's peak of export_with_probabilities (the
    probabilities held whole, float16, left out: they are the caller's): an upper bound, within 25%."""
    from dataclasses import replace

    from autoseg.predict.export import export_with_probabilities

    original, resampled = (40, 90, 80), (20, 60, 60)
    props = _case(original, resampled, (3.0, 1.0, 1.0))
    plain = LabelScheme.from_labels({"background": 0, "a": [1, 2], "b": 2}, (1, 2)) if regions else LabelScheme.plain(5)
    scheme = replace(plain, resample_logits=True)
    logits = (torch.randn((scheme.num_outputs, *resampled), generator=torch.Generator().manual_seed(1)) * 3).half()
    tracemalloc.start()
    labels = export_with_probabilities(logits, props, scheme, lambda k, m: None)
    measured = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    del labels
    terms = export_bytes(original, resampled, scheme, 2)
    estimate = terms["total"] - terms["probabilities"]
    assert 0.75 * estimate <= measured <= estimate, (measured, estimate, terms)


@pytest.mark.parametrize(
    ("original", "resampled", "spacing"),
    [((13, 20, 18), (31, 16, 22), (3.0, 1.0, 1.0)), ((12, 20, 18), (12, 20, 18), (1.0, 1.0, 1.0))],
)
@pytest.mark.parametrize("logits", [False, True])
def test_class_weights_take_the_argmax_of_the_weighted_maps_and_leave_the_maps_alone(
    original, resampled, spacing, logits
) -> None:
    """With a factor per class (``autoseg.predict.class_weights``) the label map is the argmax of each class's map
    times its factor (plus its logarithm, where the maps are logits), in any slab sizes; the slabs handed over are not
    changed (an unchanged grid hands views of them to the argmax)."""
    props = _case(original, resampled, spacing)
    scheme = LabelScheme.from_labels({"background": 0, "a": 1, "b": 2, "c": 3}, where="x")
    if logits:
        scheme = replace(scheme, resample_logits=True)
    maps = _probabilities(4, resampled, seed=3)
    maps[3] *= 0.02  # a class the argmax seldom picks unweighted
    if logits:
        maps = torch.log(maps)
    weights = np.array([1.0, 0.5, 1.0, 80.0])
    before = maps.clone()
    plain = export_segmentation(maps, props, scheme)
    weighted = _in_slabs(SlabExport(props, scheme, resampled, weights), maps, [3, 1, 5])
    assert torch.equal(maps, before)
    shifted = maps + torch.log(torch.tensor(weights, dtype=torch.float32)).view(-1, 1, 1, 1) if logits else None
    scaled = shifted if logits else maps * torch.tensor(weights, dtype=torch.float32).view(-1, 1, 1, 1)
    expected = export_segmentation(scaled, props, scheme)
    assert (weighted == 3).sum() > 2 * (plain == 3).sum()  # the weighted class gains, others (b: x0.5) lose
    assert np.mean(weighted == expected) > 0.999  # float rounding of the weighted comparison at exact ties only


def test_class_weights_are_refused_for_regions_and_the_wrong_length() -> None:
    props = _case((12, 20, 18), (12, 20, 18), (1.0, 1.0, 1.0))
    plain = LabelScheme.from_labels({"background": 0, "a": 1, "b": 2}, where="x")
    with pytest.raises(ValueError, match="3 outputs"):
        SlabExport(props, plain, (12, 20, 18), np.ones(4))
    regions = LabelScheme.from_labels({"background": 0, "a": [1, 2], "b": [2]}, [1, 2], where="x")
    with pytest.raises(ValueError, match="plain only"):
        SlabExport(props, regions, (12, 20, 18), np.ones(2))
