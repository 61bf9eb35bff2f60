from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from autoseg.cli.flag_values import parse_bytes
from autoseg.cli.main import main
from autoseg.cli.parser import build_parser, parse_args, parse_fold
from autoseg.core.units import GiB
from autoseg.dataset.imageio import Geometry, write_image
from autoseg.preprocess.store import list_complete_cases


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("8GiB", 8 * GiB),
        ("8 GiB", 8 * GiB),
        ("8gib", 8 * GiB),
        ("80GB", 80 * 10**9),
        ("24", 24 * GiB),
        ("1.5", int(1.5 * GiB)),
        ("512MiB", 512 * 2**20),
        ("500MB", 500 * 10**6),
        ("2T", 2 * 2**40),
        ("64KiB", 64 * 1024),
    ],
)
def test_parse_bytes(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "eight", "8 PB", "-8GiB", "8GiB extra", "GiB"])
def test_parse_bytes_rejects_bad_sizes(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="use e.g. 8GiB"):
        parse_bytes(text)


def test_bad_gpu_memory_flag_exits_with_usage_error(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["plan", "data", "--gpu-memory", "lots"])
    assert info.value.code == 2
    assert "cannot read 'lots' as a memory size" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["plan", "plan_and_preprocess"])
def test_architecture_flag_names_a_preset_default_unet(command: str, capsys) -> None:
    assert build_parser().parse_args([command, "data"]).architecture == "unet"
    assert build_parser().parse_args([command, "data", "--architecture", "resenc"]).architecture == "resenc"
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args([command, "data", "--architecture", "resunet"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--architecture: invalid choice: 'resunet'" in err and "resenc" in err and "unet" in err


@pytest.mark.slow
def test_resenc_plan_trains_and_predicts_unchanged(tiny_dataset: Path, tmp_path: Path, capsys) -> None:
    """`--architecture resenc`: plans.json names the residual encoder U-Net and its blocks; the same train and
    predict commands run it (1 epoch x 2 iterations on CPU, one case predicted; about 20 s on 2 busy cores)."""
    ws, out = tmp_path / "ws", tmp_path / "pred"
    assert (
        main(
            [
                "-q",
                "plan_and_preprocess",
                str(tiny_dataset),
                "-w",
                str(ws),
                "--device",
                "cpu",
                "-c",
                "3d_fullres",
                "--ram",
                "4GiB",
                "--cpu-flops",
                "2e10",
                "--architecture",
                "resenc",
                "--processes",
                "1",
            ]
        )
        == 0
    )
    assert "network residual_encoder_unet" in capsys.readouterr().out
    network = json.loads((ws / "plans.json").read_text())["configurations"]["3d_fullres"]["network"]
    assert network["architecture"] == "residual_encoder_unet" and network["conv_per_stage"] == 1
    assert network["blocks_per_stage"] == [1, 3, 4, 6, 6, 6][: len(network["features_per_stage"])]
    assert (
        main(
            [
                "-q",
                "train",
                "fold",
                "0",
                "-w",
                str(ws),
                "--device",
                "cpu",
                "--epochs",
                "1",
                "--iterations-per-epoch",
                "2",
                "--val-iterations",
                "1",
                "--no-validation",
            ]
        )
        == 0
    )
    assert (ws / "results" / "3d_fullres" / "fold_0" / "checkpoint_final.pt").is_file()
    image = sorted((tiny_dataset / "imagesTs").glob("*_0000.nii.gz"))[0]
    assert (
        main(["-q", "predict", "-i", str(image), "-o", str(out), "-w", str(ws), "--no-mirror", "--device", "cpu"]) == 0
    )
    assert "wrote 1 segmentation(s)" in capsys.readouterr().out
    assert [p.name for p in out.iterdir()] == [image.name.replace("_0000", "")]


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        (["fold", "0"], [0]),
        (["3"], [3]),
        (["fold", "all"], ["all"]),
        (["all"], ["all"]),
        (["fold", "12"], [12]),
        (["fold", "0", "1", "2", "3", "4"], [0, 1, 2, 3, 4]),
        (["2", "0"], [2, 0]),
    ],
)
def test_fold_parsing(values: list[str], expected: list[int | str]) -> None:
    assert parse_fold(values) == expected


@pytest.mark.parametrize("values", [["fold"], ["fold", "x"], ["fold", "0", "0"], ["fold", "All"]])
def test_bad_fold_exits_at_parse_time_with_a_hint(values: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(["train", *values, "-w", "ws"])
    assert info.value.code == 2
    assert "give the folds as `fold 0`" in capsys.readouterr().err


def test_train_parser_accepts_fold_then_flags() -> None:
    args = parse_args(["train", "fold", "0", "-w", "ws", "--epochs", "1", "--no-validation"])
    assert args.folds == [0] and args.epochs == 1 and args.no_validation and args.workspace == "ws"


def test_missing_dataset_returns_nonzero_naming_the_path(tmp_path: Path, capsys) -> None:
    missing = tmp_path / "Dataset404_Nowhere"
    code = main(["-q", "plan", str(missing), "-w", str(tmp_path / "ws"), "--device", "cpu", "--gpu-memory", "8"])
    assert code != 0
    err = capsys.readouterr().err
    assert str(missing) in err and "dataset.json" in err
    assert not (tmp_path / "ws" / "plans.json").exists()


def test_predict_without_workspace_returns_nonzero(tmp_path: Path, capsys) -> None:
    code = main(
        [
            "-q",
            "predict",
            "-i",
            str(tmp_path),
            "-o",
            str(tmp_path / "out"),
            "-w",
            str(tmp_path / "ws"),
            "-c",
            "3d_fullres",
            "--device",
            "cpu",
        ]
    )
    assert code != 0
    assert "plans.json not found" in capsys.readouterr().err


@pytest.mark.slow
def test_end_to_end_plan_train_predict_evaluate(tiny_dataset: Path, tmp_path: Path, capsys) -> None:
    raw = tmp_path / tiny_dataset.name
    shutil.copytree(tiny_dataset, raw)
    ws = tmp_path / "ws"
    out = tmp_path / "pred"

    assert (
        main(
            [
                "-q",
                "plan_and_preprocess",
                str(raw),
                "-w",
                str(ws),
                "--device",
                "cpu",
                "-c",
                "3d_fullres",
                "--gpu-memory",
                "8GiB",
                "--ram",
                "4GiB",
            ]
        )
        == 0
    )
    assert "GPU memory 8.0 GiB, host RAM 4.0 GiB, training device cpu" in capsys.readouterr().out
    for name in ("workspace.json", "fingerprint.json", "plans.json"):
        assert (ws / name).is_file()
    assert len(list_complete_cases(ws / "preprocessed" / "3d_fullres")) == 5
    assert not (ws / "preprocessed" / "2d").exists()  # -c 3d_fullres only

    assert (
        main(
            [
                "-q",
                "train",
                "fold",
                "0",
                "-w",
                str(ws),
                "--device",
                "cpu",
                "--epochs",
                "1",
                "--iterations-per-epoch",
                "2",
                "--val-iterations",
                "1",
                "--no-validation",
            ]
        )
        == 0
    )
    fold = ws / "results" / "3d_fullres" / "fold_0"
    assert (ws / "splits.json").is_file()
    for name in ("checkpoint_final.pt", "metrics.jsonl", "progress.png"):
        assert (fold / name).is_file(), name
    rows = [json.loads(line) for line in (fold / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [0]
    assert not (fold / "validation").exists()

    assert (
        main(
            [
                "-q",
                "predict",
                "-i",
                str(raw / "imagesTs"),
                "-o",
                str(out),
                "-w",
                str(ws),
                "--no-mirror",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    assert "wrote 2 segmentation(s)" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in (raw / "labelsTs").iterdir())

    assert main(["-q", "evaluate", str(out), str(raw / "labelsTs")]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["labels"] == {"organ": 1, "lesion": 2}
    assert len(summary["cases"]) == 2


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message for a machine without CUDA")
def test_train_gpus_without_cuda_asks_for_device_cpu(tmp_path: Path, capsys) -> None:
    assert main(["-q", "train", "fold", "0", "-w", str(tmp_path), "--gpus", "2"]) == 2
    err = capsys.readouterr().err
    assert "--gpus 2: no CUDA device is visible; add --device cpu to train in 2 CPU processes" in err


def test_train_gpus_rejects_zero_and_a_torchrun_launch(tmp_path: Path, capsys, monkeypatch) -> None:
    with pytest.raises(SystemExit) as info:
        main(["-q", "train", "fold", "0", "-w", str(tmp_path), "--gpus", "0", "--device", "cpu"])
    assert info.value.code == 2
    assert "argument --gpus: 0 is out of range; give a whole number at least 1" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["-q", "train", "fold", "0", "-w", str(tmp_path), "--gpus", "2", "--device", "cpu"]) == 2
    assert "when launching with torchrun leave --gpus out" in capsys.readouterr().err


@pytest.mark.parametrize("gpus", [["--gpus", "2"], ["--gpus=2"], ["--gp", "2"]])
def test_relaunched_command_drops_gpus(gpus: list[str]) -> None:
    from autoseg.cli.parser import without_gpus

    argv = ["-q", "train", "fold", "0", *gpus, "--device", "cpu", "--epochs", "2"]
    assert build_parser().parse_args(argv).gpus == 2
    assert without_gpus(argv) == ["-q", "train", "fold", "0", "--device", "cpu", "--epochs", "2"]


def test_distributed_context_from_the_torchrun_environment() -> None:
    from autoseg.model.distributed import SINGLE_PROCESS, context_from_environment

    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    context = context_from_environment(env, "cpu")
    assert (context.rank, context.world_size, context.local_rank, context.local_world_size) == (3, 4, 1, 2)
    assert context.backend == "gloo" and not context.is_main
    assert context_from_environment({}, "cpu") is SINGLE_PROCESS
    with pytest.raises(ValueError, match="cannot read the torchrun environment .*'LOCAL_WORLD_SIZE'"):
        context_from_environment({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "cpu")


@pytest.mark.slow
def test_cpu_plans_do_not_depend_on_the_load_while_planning(
    tiny_dataset: Path, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The throughput measured on idle cores is cached per machine: a later plan made while the cores are busy (its
    measurement would be 4x lower) reads it and is the same plan, which records the figure and where it came
    from."""
    import autoseg.plan.calibration
    from autoseg.core.machine import Measurement

    measurements = [
        Measurement({"flops_per_second": 40e9, "elements_per_second": 300e6, "mapped_bytes_per_second": 3e9}),
        Measurement(
            {"flops_per_second": 10e9, "elements_per_second": 75e6, "mapped_bytes_per_second": 1e9},
            keep=False,
            why_not_kept="the cores were busy",
        ),
    ]
    monkeypatch.setattr(autoseg.plan.calibration, "calibrate_cpu_throughput", lambda: measurements.pop(0))
    monkeypatch.setenv("AUTOSEG_CACHE_DIR", str(tmp_path / "cache"))
    budget = ("--device", "cpu", "--gpu-memory", "8GiB", "--ram", "4GiB")
    outputs = []
    for name in ("idle", "busy"):
        assert main(["-q", "plan", str(tiny_dataset), "-w", str(tmp_path / name), *budget]) == 0
        outputs.append(capsys.readouterr().out)
    rates = "CPU throughput 40.0 GFLOP/s, 300 M feature-map elements/s, 2.8 GiB/s of fresh pages"
    assert f"{rates} (measured now, cached in " in outputs[0]
    assert f"{rates} (cached in {tmp_path / 'cache' / 'cpu_throughput.json'}, measured 20" in outputs[1]
    assert len(measurements) == 1  # measured once
    idle, busy = (json.loads((tmp_path / name / "plans.json").read_text()) for name in ("idle", "busy"))
    assert idle.pop("cpu_rates_source").startswith("measured now, cached in ")
    assert busy.pop("cpu_rates_source").startswith(f"cached in {tmp_path / 'cache' / 'cpu_throughput.json'}, measured")
    assert idle == busy and idle["cpu_flops_per_second"] == 40e9
    recorded = idle
    assert (recorded["cpu_elements_per_second"], recorded["cpu_mapped_bytes_per_second"]) == (300e6, 3e9)


def test_the_cache_folder_comes_from_autoseg_cache_dir_or_xdg(tmp_path: Path) -> None:
    from autoseg.cli.main import cache_dir

    assert cache_dir({"AUTOSEG_CACHE_DIR": str(tmp_path), "XDG_CACHE_HOME": "/x"}) == tmp_path
    assert cache_dir({"XDG_CACHE_HOME": "/x"}) == Path("/x/autoseg")
    assert cache_dir({}) == Path.home() / ".cache" / "autoseg"


def test_evaluate_surface_flags(tmp_path: Path, capsys) -> None:
    """--nsd-tolerance reaches the summary and the table; --no-surface drops the surface columns; not both."""
    label = np.zeros((4, 6, 6), dtype=np.uint8)
    label[1:3, 1:4, 1:4] = 1
    geometry = Geometry(3, (6, 6, 4), (1.0, 1.0, 2.0), (0.0, 0.0, 0.0), (1, 0, 0, 0, 1, 0, 0, 0, 1))
    for folder in ("gt", "pred"):
        write_image(tmp_path / folder / "a.nii.gz", label, geometry)
    pred, gt = str(tmp_path / "pred"), str(tmp_path / "gt")
    assert main(["-q", "evaluate", pred, gt, "--nsd-tolerance", "1.5"]) == 0
    assert "mean HD95 mm  mean NSD@1.5mm" in capsys.readouterr().out
    assert json.loads((tmp_path / "pred" / "summary.json").read_text())["nsd_tolerance_mm"] == 1.5
    assert main(["-q", "evaluate", pred, gt, "--no-surface"]) == 0
    assert "HD95" not in capsys.readouterr().out
    assert json.loads((tmp_path / "pred" / "summary.json").read_text())["nsd_tolerance_mm"] is None
    for flags in (["--no-surface", "--nsd-tolerance", "1"], ["--nsd-tolerance", "0"]):
        with pytest.raises(SystemExit) as info:
            main(["-q", "evaluate", pred, gt, *flags])
        assert info.value.code == 2
