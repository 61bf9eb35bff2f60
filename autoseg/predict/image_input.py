"""What ``Segmenter.predict`` (``autoseg.predict.segmenter``) takes and gives back: an image in memory, checked
against the model, as the (C, Z, Y, X) float32 array and ``Geometry`` a case read from files is (``image_input``),
and a label map in that image's own form (``image_output``).

An image is a SimpleITK image (its geometry its own), a list or tuple of them (one per channel, on one grid), or a
numpy array with its geometry in array order: ``spacing_mm`` (z, y, x) required, ``origin_mm`` (z, y, x) and
``direction`` (the 3 x 3 direction cosines with rows and columns in z, y, x order) optional (0 and the identity). A
numpy array is (Z, Y, X) with one channel or (C, Z, Y, X); a 2D image is (Y, X) or (C, Y, X) with a spacing of two
values (y, x), lifted to Z = 1 as a 2D file is (``autoseg.dataset.imageio``). A list or tuple of arrays is one array
per channel.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import SimpleITK as sitk

from autoseg.core.errors import InputError
from autoseg.core.spacing import spacing_ratio_problem
from autoseg.dataset.imageio import Geometry, as_image, geometry_problem, image_geometry

IMAGE_KINDS = "a SimpleITK image, a list of them (one per channel), or a numpy array with spacing_mm"


@dataclass(frozen=True)
class ModelInput:
    """What a model takes: its channels (``Plans.channel_names``), the dimension of the images it was trained on
    (2 or 3; None: not recorded) and their median spacing (z, y, x; None: not recorded)."""

    channel_names: tuple[str, ...]
    image_dim: int | None = None
    spacing_mm: tuple[float, ...] | None = None


@dataclass(frozen=True)
class ImageInput:
    """How the caller gave an image: its ``geometry``, and whether as numpy arrays (the label map goes back as numpy,
    else as a SimpleITK image)."""

    geometry: Geometry
    numpy: bool


def image_input(
    image: object,
    model: ModelInput,
    spacing_mm: Sequence[float] | None = None,
    origin_mm: Sequence[float] | None = None,
    direction: Sequence[float] | Sequence[Sequence[float]] | None = None,
) -> tuple[np.ndarray, ImageInput]:
    """``image`` (SimpleITK, or numpy with its geometry in array order) as (C, Z, Y, X) float32 and how it was given,
    refused (``InputError`` saying what was expected) when it is not an image of ``model``'s channels and dimension,
    of a usable geometry, finite, and of a spacing near the images the model was trained on."""
    channels = list(image) if isinstance(image, (list, tuple)) else [image]
    if not channels:
        raise InputError(f"image: an empty {type(image).__name__}; give {IMAGE_KINDS}")
    if all(isinstance(c, sitk.Image) for c in channels):
        if (spacing_mm, origin_mm, direction) != (None, None, None):
            raise InputError(
                "image: a SimpleITK image carries its own spacing, origin and direction; leave spacing_mm, "
                "origin_mm and direction out (they are for numpy arrays)"
            )
        read = _from_images(channels)
    elif all(isinstance(c, np.ndarray) for c in channels):
        read = _from_arrays(channels, isinstance(image, (list, tuple)), spacing_mm, origin_mm, direction)
    else:
        kinds = sorted({type(c).__name__ for c in channels})
        raise InputError(f"image: got {' and '.join(kinds)}; give {IMAGE_KINDS}")
    _check_against(*read, model)
    return read


def image_output(labels_zyx: np.ndarray, read: ImageInput) -> np.ndarray | sitk.Image:
    """The label map (Z, Y, X) of ``read`` as the caller gave the image: a SimpleITK image of its geometry, or a
    numpy array of its shape ((Y, X) for a 2D image)."""
    if not read.numpy:
        return as_image(labels_zyx, read.geometry)
    return spatial_array(labels_zyx, read)


def spatial_array(array: np.ndarray, read: ImageInput) -> np.ndarray:
    """``array`` (..., Z, Y, X) without the Z = 1 axis a 2D image was lifted to."""
    return array[..., 0, :, :] if read.geometry.ndim == 2 else array


def _from_images(images: list[sitk.Image]) -> tuple[np.ndarray, ImageInput]:
    """SimpleITK images, one per channel, on one grid."""
    geometries = []
    for i, image in enumerate(images):
        if image.GetNumberOfComponentsPerPixel() != 1:
            raise InputError(
                f"image {i}: {image.GetNumberOfComponentsPerPixel()} components per voxel; give each channel as an "
                "image of its own, in a list"
            )
        if image.GetDimension() not in (2, 3):
            raise InputError(f"image {i}: a {image.GetDimension()}D image; give a 2D or 3D one")
        geometries.append(image_geometry(image))
    for i, geometry in enumerate(geometries[1:], start=1):
        if differs := geometry.matches(geometries[0]):
            raise InputError(f"image {i} and image 0 (the channels) differ in {differs}; resample them onto one grid")
    shape = geometries[0].shape_zyx
    data = np.stack([sitk.GetArrayViewFromImage(image).astype(np.float32).reshape(shape) for image in images])
    return data, ImageInput(geometries[0], numpy=False)


def _from_arrays(
    arrays: list[np.ndarray],
    listed: bool,
    spacing_mm: Sequence[float] | None,
    origin_mm: Sequence[float] | None,
    direction: Sequence[float] | Sequence[Sequence[float]] | None,
) -> tuple[np.ndarray, ImageInput]:
    """numpy arrays (one per channel when ``listed``, else one array, channels first or a single channel) with
    their geometry in array order."""
    if spacing_mm is None:
        raise InputError(
            "image: a numpy array has no spacing; pass spacing_mm in array order, (z, y, x) for a 3D image or "
            "(y, x) for a 2D one"
        )
    ndim = len(spacing_mm)
    if ndim not in (2, 3):
        raise InputError(f"spacing_mm {tuple(spacing_mm)}: give (z, y, x) for a 3D image or (y, x) for a 2D one")
    shapes = "(Z, Y, X) or (C, Z, Y, X)" if ndim == 3 else "(Y, X) or (C, Y, X)"
    wanted = {ndim} if listed else {ndim, ndim + 1}
    bad = [a.shape for a in arrays if a.ndim not in wanted]
    if bad:
        each = f"each channel a {shapes.split(' or ')[0]} array" if listed else f"a {shapes} array"
        raise InputError(f"image: an array of shape {bad[0]} for a spacing of {ndim} values; give {each}")
    for a in arrays:
        if not (np.issubdtype(a.dtype, np.number) or a.dtype == bool) or np.iscomplexobj(a):
            raise InputError(f"image: an array of dtype {a.dtype}; give real numbers (an image's intensities)")
    if listed and len({a.shape for a in arrays}) > 1:
        raise InputError(f"image: channels of shapes {[a.shape for a in arrays]}; give every channel on one grid")
    data = np.stack(arrays) if listed or arrays[0].ndim == ndim else arrays[0]
    geometry = _geometry(data.shape[1:], spacing_mm, origin_mm, direction)
    return data.astype(np.float32, copy=False).reshape(data.shape[0], *geometry.shape_zyx), ImageInput(geometry, True)


def _geometry(
    shape: tuple[int, ...],
    spacing_mm: Sequence[float],
    origin_mm: Sequence[float] | None,
    direction: Sequence[float] | Sequence[Sequence[float]] | None,
) -> Geometry:
    """The ``Geometry`` (SimpleITK's x, y, z vectors) of an array of spatial ``shape`` and its geometry in array
    order: each vector reversed, the direction's rows and columns both."""
    ndim = len(shape)
    origin = np.zeros(ndim) if origin_mm is None else np.asarray(origin_mm, dtype=float)
    cosines = np.eye(ndim) if direction is None else np.asarray(direction, dtype=float)
    if origin.shape != (ndim,):
        raise InputError(f"origin_mm {tuple(origin.ravel())}: give {ndim} values in array order, like spacing_mm")
    if cosines.size != ndim * ndim:
        raise InputError(
            f"direction: {cosines.size} values; give the {ndim} x {ndim} direction cosines with rows and columns in "
            "array order"
        )
    cosines = cosines.reshape(ndim, ndim)[::-1, ::-1]
    return Geometry(
        ndim=ndim,
        size_xyz=tuple(int(s) for s in reversed(shape)),
        spacing_xyz=tuple(float(s) for s in reversed(spacing_mm)),
        origin_xyz=tuple(float(v) for v in origin[::-1]),
        direction=tuple(float(v) for v in cosines.ravel()),
    )


def _check_against(data: np.ndarray, read: ImageInput, model: ModelInput) -> None:
    """Refuse an image whose channels, dimension, geometry, values or spacing the model cannot predict."""
    channels, expected = data.shape[0], len(model.channel_names)
    if channels != expected:
        form = "(C, Z, Y, X)" if read.geometry.ndim == 3 else "(C, Y, X)"
        raise InputError(
            f"image: {channels} channel(s), but the model takes {expected} ({', '.join(model.channel_names)}); give "
            f"a list of {expected} images (one per channel, in that order) or a {form} array with C = {expected}"
        )
    if model.image_dim is not None and read.geometry.ndim != model.image_dim:
        raise InputError(
            f"image: a {read.geometry.ndim}D image, but the model was trained on {model.image_dim}D images; give a "
            f"{model.image_dim}D one"
        )
    if problem := geometry_problem(read.geometry):
        raise InputError(f"image: {problem}")
    for c, channel in enumerate(data):  # one bool per voxel, a channel at a time
        if not np.isfinite(channel).all():
            raise InputError(
                f"image: channel {c} holds NaN or Inf values; replace them (e.g. with the image's minimum)"
            )
    trained = "the median of the images the model was trained on"
    if model.spacing_mm and (problem := spacing_ratio_problem(read.geometry.spacing_zyx, model.spacing_mm, trained)):
        raise InputError(f"image: {problem}")
