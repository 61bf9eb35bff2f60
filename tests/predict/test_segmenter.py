"""``from autoseg import Segmenter``: a model loaded once, images in memory segmented in this process, voxel for voxel
as ``autoseg predict`` writes them, numpy input with its geometry in array order as SimpleITK input, bad input
refused saying what was expected, and ``import autoseg`` without torch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import SimpleITK as sitk
from cli_checks import run_cli
from factories import inference_choice

import autoseg
from autoseg.cli.main import main
from autoseg.core.errors import InputError
from autoseg.dataset.imageio import image_geometry
from autoseg.plan.plans import Plans
from autoseg.predict import segmenter as segmenter_module
from autoseg.predict.image_input import image_input
from autoseg.predict.postprocessing import Postprocessing
from autoseg.predict.probabilities import read_probabilities
from autoseg.predict.window import WindowOptions

pytestmark = pytest.mark.slow  # the trained fixture: one fold trained once per session (~5 s); a test then < 1 s

NO_MIRROR = WindowOptions(mirror=False)
CASE = "demo_005"


@pytest.fixture(scope="module")
def cli_output(trained: Path, tiny_dataset: Path, tmp_path_factory) -> Path:
    """``autoseg predict --no-mirror --save-probabilities`` of the tiny dataset's test cases."""
    out = tmp_path_factory.mktemp("cli_out")
    argv = ["-i", tiny_dataset / "imagesTs", "-o", out, "-w", trained, "--no-mirror", "--save-probabilities"]
    assert main(["-q", "predict", *map(str, argv)]) == 0
    return out


@pytest.fixture(scope="module")
def segmenter(trained: Path):
    with autoseg.Segmenter.load(trained, window=NO_MIRROR) as loaded:
        yield loaded


def _image(tiny_dataset: Path) -> sitk.Image:
    return sitk.ReadImage(str(tiny_dataset / "imagesTs" / f"{CASE}_0000.nii.gz"))


def test_segmenter_labels_equal_the_cli_output_voxel_for_voxel(segmenter, cli_output: Path, tiny_dataset: Path) -> None:
    written = sitk.ReadImage(str(cli_output / f"{CASE}.nii.gz"))
    labels = segmenter.predict(_image(tiny_dataset))
    assert isinstance(labels, sitk.Image)
    expected = sitk.GetArrayFromImage(written)
    assert len(np.unique(expected)) > 1  # a label map with structures, not all background
    np.testing.assert_array_equal(sitk.GetArrayFromImage(labels), expected)
    assert labels.GetSize() == written.GetSize() and labels.GetOrigin() == written.GetOrigin()
    assert labels.GetSpacing() == written.GetSpacing() and labels.GetDirection() == written.GetDirection()


def test_segmenter_probabilities_equal_the_cli_probability_file(
    segmenter, trained: Path, cli_output: Path, tiny_dataset: Path
) -> None:
    labels, maps = segmenter.predict(_image(tiny_dataset), probabilities=True)
    saved = read_probabilities(cli_output / f"{CASE}.npz", segmenter.plans.label_scheme)
    assert maps.dtype == saved.dtype and maps.shape == saved.shape
    np.testing.assert_array_equal(maps, saved)
    np.testing.assert_array_equal(
        sitk.GetArrayFromImage(labels), sitk.GetArrayFromImage(sitk.ReadImage(str(cli_output / f"{CASE}.nii.gz")))
    )


def test_a_model_archive_segments_as_its_workspace_and_its_folder_goes_with_close(
    trained: Path, tiny_dataset: Path, segmenter, tmp_path: Path, capsys
) -> None:
    archive = tmp_path / "model.zip"
    assert run_cli(capsys, "export-model", archive, "-w", trained, "--no-precision-check").status == 0
    image = _image(tiny_dataset)
    with autoseg.Segmenter.load(archive, window=NO_MIRROR) as from_archive:
        folders = list(Path(tempfile.gettempdir()).glob(f"autoseg-model-{os.getpid()}-*"))
        assert folders  # the unpacked archive, while the segmenter is open
        labels = from_archive.predict(image)
    assert not any(f.exists() for f in folders)
    np.testing.assert_array_equal(sitk.GetArrayFromImage(labels), sitk.GetArrayFromImage(segmenter.predict(image)))
    np.testing.assert_array_equal(  # still usable after close: the networks are in memory
        sitk.GetArrayFromImage(from_archive.predict(image)), sitk.GetArrayFromImage(labels)
    )


def test_a_followed_inference_json_postprocesses_as_the_cli_and_an_ensemble_is_refused(
    trained: Path, tiny_dataset: Path, tmp_path: Path, capsys
) -> None:
    ws = Path(shutil.copytree(trained, tmp_path / "ws"))
    inference_choice(("3d_fullres",), Postprocessing(largest_foreground_component=True)).to_json(ws / "inference.json")
    out = tmp_path / "out"
    assert run_cli(capsys, "predict", "-i", tiny_dataset / "imagesTs", "-o", out, "-w", ws, "--no-mirror").status == 0
    with autoseg.Segmenter.load(ws, window=NO_MIRROR) as following:
        labels = sitk.GetArrayFromImage(following.predict(_image(tiny_dataset)))
    np.testing.assert_array_equal(labels, sitk.GetArrayFromImage(sitk.ReadImage(str(out / f"{CASE}.nii.gz"))))
    with autoseg.Segmenter.load(ws, config="3d_fullres", window=NO_MIRROR) as unfollowed:  # -c: no postprocessing
        assert unfollowed.postprocessing.is_identity
        plain = sitk.GetArrayFromImage(unfollowed.predict(_image(tiny_dataset)))
    assert (plain != labels).any()  # the postprocessing changes this label map: the comparison above can fail
    inference_choice(("3d_fullres", "2d"), Postprocessing()).to_json(ws / "inference.json")
    with pytest.raises(InputError, match="an ensemble of 3d_fullres and 2d, which Segmenter does not predict"):
        autoseg.Segmenter.load(ws, window=NO_MIRROR)


def _rotated(image: sitk.Image) -> sitk.Image:
    """``image`` with a far origin and a direction that is not the identity (a rotation about each axis)."""
    out = sitk.Image(image)
    angles = np.radians([10.0, -20.0, 30.0])
    c, s = np.cos(angles), np.sin(angles)
    rx = np.array([[1, 0, 0], [0, c[0], -s[0]], [0, s[0], c[0]]])
    ry = np.array([[c[1], 0, s[1]], [0, 1, 0], [-s[1], 0, c[1]]])
    rz = np.array([[c[2], -s[2], 0], [s[2], c[2], 0], [0, 0, 1]])
    out.SetDirection(tuple(float(v) for v in (rz @ ry @ rx).ravel()))
    out.SetOrigin((12.5, -40.25, 310.0))
    return out


def test_numpy_input_with_its_geometry_in_array_order_gives_the_labels_of_the_simpleitk_input(
    segmenter, tiny_dataset: Path
) -> None:
    image = _rotated(_image(tiny_dataset))
    expected = segmenter.predict(image)
    array = sitk.GetArrayFromImage(image).astype(np.float32)  # (Z, Y, X), taken without a copy
    before = array.copy()
    geometry = {
        "spacing_mm": image.GetSpacing()[::-1],
        "origin_mm": image.GetOrigin()[::-1],
        "direction": np.array(image.GetDirection()).reshape(3, 3)[::-1, ::-1],  # rows and columns in (z, y, x) order
    }
    labels = segmenter.predict(array, **geometry)
    assert isinstance(labels, np.ndarray) and labels.shape == array.shape
    np.testing.assert_array_equal(labels, sitk.GetArrayFromImage(expected))
    np.testing.assert_array_equal(segmenter.predict(array[None], **geometry), labels)  # (C, Z, Y, X), C = 1
    np.testing.assert_array_equal(segmenter.predict([array], **geometry), labels)  # a list of one channel
    np.testing.assert_array_equal(array, before)  # the caller's array is left as it was
    _, read = image_input(array, segmenter.model_input, **geometry)
    assert read.geometry.matches(image_geometry(image), rtol=1e-9, atol_mm=1e-9) is None  # what export writes in


def test_an_image_of_the_wrong_channels_or_dimension_is_refused_saying_what_was_expected(
    segmenter, tiny_dataset: Path
) -> None:
    image = _image(tiny_dataset)
    array = sitk.GetArrayFromImage(image)
    spacing = image.GetSpacing()[::-1]
    with pytest.raises(InputError, match=r"image: 2 channel\(s\), but the model takes 1 \(.*\); give a list of 1"):
        segmenter.predict([image, image])
    with pytest.raises(InputError, match=r"image: 2 channel\(s\), but the model takes 1 .* \(C, Z, Y, X\) array"):
        segmenter.predict(np.stack([array, array]), spacing_mm=spacing)
    with pytest.raises(InputError, match="a 2D image, but the model was trained on 3D images; give a 3D one"):
        segmenter.predict(image[:, :, 3])
    with pytest.raises(InputError, match="a 2D image, but the model was trained on 3D images"):
        segmenter.predict(array[3], spacing_mm=spacing[1:])
    with pytest.raises(
        InputError, match=r"shape \(\d+, \d+\) for a spacing of 3 values; give a \(Z, Y, X\) or \(C, Z, Y, X\)"
    ):
        segmenter.predict(array[3], spacing_mm=spacing)
    with pytest.raises(InputError, match="a numpy array has no spacing; pass spacing_mm"):
        segmenter.predict(array)
    with pytest.raises(InputError, match="leave spacing_mm, origin_mm and direction out"):
        segmenter.predict(image, spacing_mm=spacing)
    with pytest.raises(InputError, match="got str; give a SimpleITK image"):
        segmenter.predict("image.nii.gz")
    nan = array.astype(np.float32)
    nan[2, 3, 4] = np.nan
    with pytest.raises(InputError, match="channel 0 holds NaN or Inf values"):
        segmenter.predict(nan, spacing_mm=spacing)


def test_load_refuses_what_is_not_a_model(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no such file or folder; give a model archive"):
        autoseg.Segmenter.load(tmp_path / "missing.zip")
    with pytest.raises(InputError, match="plans.json not found"):
        autoseg.Segmenter.load(tmp_path)


def test_predict_restores_the_process_threads(segmenter, tiny_dataset: Path, monkeypatch) -> None:
    """A segmenter sets torch's threads for its call only: the host process keeps its own count."""
    import torch

    monkeypatch.setattr(segmenter, "threads", 2)
    seen = []
    real = segmenter_module.predict_labels
    monkeypatch.setattr(
        segmenter_module, "predict_labels", lambda *a, **k: (seen.append(torch.get_num_threads()), real(*a, **k))[1]
    )
    before = torch.get_num_threads()
    segmenter.predict(_image(tiny_dataset))
    assert seen == [2] and torch.get_num_threads() == before


def _doc_example() -> str:
    """The code block under docs/api.md's "## Example"."""
    doc = (Path(autoseg.__file__).parents[1] / "docs" / "api.md").read_text(encoding="utf-8")
    section = doc.split("## Example", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_the_example_of_docs_api_md_runs(
    trained: Path, tiny_dataset: Path, tmp_path: Path, capsys, monkeypatch
) -> None:
    """docs/api.md's example, as written, on an archive of the tiny trained model and one of its test scans."""
    assert run_cli(capsys, "export-model", tmp_path / "model.zip", "-w", trained, "--no-precision-check").status == 0
    sitk.WriteImage(_image(tiny_dataset), str(tmp_path / "scan.nii.gz"))
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    exec(compile(_doc_example(), "docs/api.md", "exec"), {"__name__": "docs_api"})
    shape = sitk.GetArrayFromImage(_image(tiny_dataset)).shape
    scheme = Plans.from_json(trained / "plans.json").label_scheme
    expected = f"{shape} {np.dtype(scheme.export_dtype())} {(scheme.num_outputs, *shape)} float16"
    assert capsys.readouterr().out.strip() == expected
    assert (tmp_path / "scan_labels.nii.gz").is_file()


IMPORT_COST = """
import json, sys
import autoseg
bare = sorted(m for m in ("torch", "SimpleITK", "scipy") if m in sys.modules)
autoseg.Segmenter
print(json.dumps({"bare": bare, "segmenter": "torch" in sys.modules}))
"""


def test_import_autoseg_loads_no_torch_until_segmenter_is_asked_for() -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(autoseg.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run([sys.executable, "-c", IMPORT_COST], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"bare": [], "segmenter": True}
