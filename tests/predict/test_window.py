"""WindowOptions: the sliding window's settings made once per command, resolved per configuration and checked before
any work; and the folds' torch runners, whose working bytes are the memory model's simulation of their tile batch."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest
import torch
from factories import tiny_plans

from autoseg.core import precision
from autoseg.core.errors import InputError
from autoseg.memory.inference import TileSimulation, simulate_tile_prediction
from autoseg.model.network import build_network
from autoseg.predict.networks import Predictor, torch_runners
from autoseg.predict.window import WindowOptions


def test_tta_follows_the_device_and_mirroring() -> None:
    assert WindowOptions(device="cpu").tta_flag == "4" and WindowOptions(device="cuda").tta_flag == "all"
    assert WindowOptions(tta="2").tta_flag == "2"
    assert WindowOptions(tta="2", mirror=False).tta_flag == "none"  # --no-mirror is --tta none


def test_options_resolve_against_each_configuration() -> None:
    config = tiny_plans().configuration("3d_fullres")  # 3D, planned in fp32
    network_2d = replace(config.network, dim=2, kernel_sizes=((3, 3), (3, 3)), strides=((1, 1), (2, 2)))
    config_2d = config.with_(patch_size=(16, 16), network=network_2d)
    options = WindowOptions(device="cpu", tta="all")
    assert options.mirror_axes(config) == (0, 1, 2) and options.num_variants(config) == 8
    assert options.mirror_axes(config_2d) == (0, 1) and options.num_variants(config_2d) == 4
    assert (
        WindowOptions(mirror=False).mirror_axes(config) == () and WindowOptions(mirror=False).num_variants(config) == 1
    )
    assert options.compute_precision(config.with_(precision="bf16")) == "fp32"  # CPU prediction runs fp32
    assert WindowOptions(device="cuda").compute_precision(config.with_(precision="bf16")) == "bf16"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (WindowOptions(tta="9"), "--tta '9'"),
        (WindowOptions(tile="huge"), "tile 'huge'"),
        (WindowOptions(accumulator="float8"), "--accumulator 'float8'"),
        (WindowOptions(runtime="tensorrt"), "--runtime 'tensorrt': use one of auto, torch, onnxruntime, openvino"),
        (WindowOptions(device="cuda", runtime="openvino"), "--runtime openvino runs on the CPU"),
        (WindowOptions(precision="fp8"), "precision 'fp8' is not known"),
        (WindowOptions(precision="fp16"), "--precision fp16 runs on CUDA only"),
    ],
)
def test_bad_options_are_refused_before_any_work(options: WindowOptions, message: str) -> None:
    with pytest.raises(InputError, match=message):
        options.check(tiny_plans().configuration("3d_fullres"))


def test_torch_runners_report_the_simulation_of_their_tile_batch() -> None:
    """Each fold's runner runs on the options' device in the plan's precision, and the memory plan asking it for a
    tile batch's working bytes gets the simulation of that batch as the window runs it (its mirror variants and
    accumulator)."""
    plans = tiny_plans()
    config = plans.configuration("3d_fullres")
    options = WindowOptions(device="cpu", tta="2", accumulator="float32")
    networks = [build_network(config.network), build_network(config.network)]
    predictor = Predictor.of(networks, plans, config, options)
    assert [r.module for r in predictor.runners] == networks
    assert all(r.device == torch.device("cpu") and r.precision == "fp32" for r in predictor.runners)
    expected = simulate_tile_prediction(
        TileSimulation(config.network, "fp32", (0, 1, 2), 2, "float32", "cpu"), config.patch_size, 2
    )
    assert all(r.working_bytes(2, config.patch_size) == expected for r in torch_runners(networks, config, options))


@pytest.mark.parametrize(
    ("flags", "refused"), [("fpu avx512f avx512_bf16", False), ("fpu amx_bf16", False), ("fpu avx512f", True)]
)
def test_bf16_on_the_cpu_needs_its_native_flags(tmp_path, monkeypatch, flags: str, refused: bool) -> None:
    """--precision bf16 on the CPU is taken where /proc/cpuinfo lists AVX-512 BF16 or AMX, refused naming them
    elsewhere; the runners then compute in it."""
    (tmp_path / "cpuinfo").write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    monkeypatch.setattr(precision, "CPUINFO", tmp_path / "cpuinfo")
    config = tiny_plans().configuration("3d_fullres")
    options = WindowOptions(precision="bf16")
    if refused:
        with pytest.raises(
            InputError, match="needs a CPU with native bf16 \\(avx512_bf16 or amx_bf16.*--precision fp32"
        ):
            options.check(config)
        return
    options.check(config)
    assert options.compute_precision(config) == "bf16"


@pytest.mark.parametrize(("runtime", "extra"), [("onnxruntime", "onnx"), ("openvino", "openvino")])
def test_a_graph_runtime_without_its_extra_names_the_extra(monkeypatch, runtime: str, extra: str) -> None:
    monkeypatch.setitem(sys.modules, runtime, None)  # the import fails, as on a plain install
    with pytest.raises(InputError, match=rf"--runtime {runtime} needs .*pip install \"autoseg\[{extra}\]\""):
        WindowOptions(runtime=runtime).check(tiny_plans().configuration("3d_fullres"))
