from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from factories import set_configuration, tiny_topology

from autoseg.core.units import GiB
from autoseg.core.workspace import Workspace
from autoseg.demo.data import make_demo_dataset
from autoseg.plan.budget import Budget
from autoseg.plan.run import plan_dataset
from autoseg.preprocess.run import preprocess_workspace


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory) -> Path:
    """A 5 + 1 case synthetic 3D dataset in the nnU-Net layout, small enough for unit tests. Read-only."""
    return make_demo_dataset(
        tmp_path_factory.mktemp("raw") / "Dataset001_Tiny", num_train=5, num_test=2, shape_zyx=(12, 28, 28), seed=3
    )


@pytest.fixture()
def dataset_copy(tiny_dataset, tmp_path) -> Path:
    """A writable copy of the tiny dataset, for tests that break it."""
    import shutil

    dst = tmp_path / tiny_dataset.name
    shutil.copytree(tiny_dataset, dst)
    return dst


@pytest.fixture(autouse=True, scope="session")
def _machine_cache(tmp_path_factory):
    """The CLI keeps per-machine measurements (the CPU throughput) in $AUTOSEG_CACHE_DIR: a folder of this
    session's, not the user's ~/.cache/autoseg."""
    import os

    previous = os.environ.get("AUTOSEG_CACHE_DIR")
    os.environ["AUTOSEG_CACHE_DIR"] = str(tmp_path_factory.mktemp("machine_cache"))
    yield
    if previous is None:
        os.environ.pop("AUTOSEG_CACHE_DIR", None)
    else:
        os.environ["AUTOSEG_CACHE_DIR"] = previous


@pytest.fixture(autouse=True, scope="session")
def _one_calibration_attempt():
    """A CLI plan on CPU in a test calibrates for real when no rates are given: once, not ``MAX_ATTEMPTS`` times (the
    tests' machine is seldom quiet, and the fallback plans as well for them); the retries have their own tests."""
    import autoseg.plan.calibration

    previous = autoseg.plan.calibration.MAX_ATTEMPTS
    autoseg.plan.calibration.MAX_ATTEMPTS = 1
    yield
    autoseg.plan.calibration.MAX_ATTEMPTS = previous


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """Unit tests run tiny tensors: one thread is as fast, and OpenMP threads spinning against another busy
    process on a 2-core machine made small networks 10-17x slower (measured)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(autouse=True, scope="session")
def _no_bf16_check_by_default():
    """Tests train and export as on a CPU without native bf16: no bf16 agreement check after a final validation or
    at export (on this CPU it would predict every validation case twice more). The check's own tests (tests/train/
    test_precision_check.py) give the CPU back its bf16 with the ``native_bf16`` fixture."""
    import autoseg.train.precision_check

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(autoseg.train.precision_check, "native_bf16_flag", lambda: None)
        yield


@pytest.fixture()
def native_bf16(monkeypatch):
    """The bf16 agreement check runs as on a CPU with native bf16 (``_no_bf16_check_by_default`` undone)."""
    import autoseg.train.precision_check

    monkeypatch.setattr(autoseg.train.precision_check, "native_bf16_flag", lambda: "amx_bf16")


@pytest.fixture(scope="session")
def prepared(tiny_dataset: Path, tmp_path_factory) -> Path:
    """A preprocessed workspace whose 3d_fullres plan is a 2-stage U-Net (4, 8 features) on (8, 16, 16)
    patches, micro-batch 2, checkpointing on. Tests copy it."""
    root = tmp_path_factory.mktemp("train")
    workspace = Workspace.at(root / "ws")
    plans = plan_dataset(tiny_dataset, workspace, Budget(gpu_memory_bytes=8 * GiB, device="cpu"), progress=False)
    preprocess_workspace(workspace, ["3d_fullres"], processes=1, progress=False)
    set_configuration(
        workspace,
        "3d_fullres",
        network=tiny_topology(plans.num_label_values),
        patch_size=(8, 16, 16),
        batch_size=2,
        accumulation_steps=1,
        checkpointing=True,
    )
    return workspace.root


@pytest.fixture(scope="session")
def trained(prepared: Path, tmp_path_factory) -> Path:
    """The prepared workspace with fold 0 trained for one iteration (~5 s, once per session). Read-only: tests
    that write copy it."""
    from autoseg.train.run_config import RunConfig
    from autoseg.train.trainer import train

    root = Path(shutil.copytree(prepared, tmp_path_factory.mktemp("trained") / "ws"))
    train(
        Workspace.at(root),
        "3d_fullres",
        0,
        RunConfig(epochs=1, iterations_per_epoch=1, val_iterations=1, validate=False, cpu_threads=1),
        progress=False,
    )
    return root


@pytest.fixture(scope="session")
def cascade_ws(prepared: Path, tmp_path_factory) -> Path:
    """The prepared workspace with the cascade planned, two folds (splits.json written by hand), 3d_lowres fold 0
    trained and validated (``cascade_workspace``). Read-only: tests that write copy it."""
    from cascade_workspace import make_cascade_workspace

    return make_cascade_workspace(prepared, tmp_path_factory.mktemp("cascade") / "ws")


@pytest.fixture()
def inputs(tiny_dataset: Path, tmp_path: Path) -> Path:
    """A writable folder of the tiny dataset's test images (demo_005, demo_006) in the inference layout."""
    folder = tmp_path / "in"
    folder.mkdir()
    for image in sorted((tiny_dataset / "imagesTs").glob("*_0000.nii.gz")):
        shutil.copy(image, folder / image.name)
    return folder


def pytest_collection_modifyitems(session, config, items) -> None:
    """The tests of the runtime extras (modules that call ``extras.require_extra``, and tests on a native-bf16 CPU)
    run last: after ONNX Runtime, OpenVINO or bf16 (AMX) ran in this process, a later test that trains with worker
    processes died of SIGSEGV now and then (about 1 suite in 2 here, not understood yet: docs/reliability.md), which
    ends the whole session."""
    items.sort(
        key=lambda item: getattr(item.module, "require_extra", None) is not None or "native_bf16" in item.fixturenames
    )
