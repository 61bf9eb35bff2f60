"""The pipeline's host plan (``case_memory``): torch's first CPU forward in a process
(``runtime_memory.torch_first_call_bytes``: the measured figure holds for another network's first forward in a fresh
process, it is kept per machine, and it is planned on top of the process's RSS where a fold runs through torch on the
CPU, and only there), and the window of the case that holds the most, which need not be the largest image's."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from factories import tiny_topology

from autoseg.core.errors import RunError
from autoseg.core.machine import MachineCache
from autoseg.core.units import MiB
from autoseg.core.workspace import Workspace
from autoseg.dataset.raw import Case
from autoseg.model.network import build_network
from autoseg.model.torch_runner import TorchTileRunner
from autoseg.plan.plans import Plans
from autoseg.predict import pipeline, runtime_memory
from autoseg.predict import predictor as predictor_module

# a fresh process with prediction's imports: what the first tile batches of a network other than the probe's add to
# its RSS, less the largest tensor bytes they hold (the logits, a few MiB)
_FIRST_FORWARD = """
import json, sys, torch
from autoseg.core.resources import process_rss_bytes, use_one_malloc_arena
from autoseg.model.network import build_network
from autoseg.model.topology import NetworkTopology
from autoseg.model.torch_runner import TorchTileRunner
from autoseg.predict import predictor
use_one_malloc_arena()
torch.set_num_threads(2)
topology = NetworkTopology(dim=3, in_channels=2, num_outputs=4, features_per_stage=(8, 16, 32),
                           kernel_sizes=((1, 3, 3), (3, 3, 3), (3, 3, 3)), strides=((1, 1, 1), (1, 2, 2), (2, 2, 2)))
runner = TorchTileRunner(build_network(topology), torch.device("cpu"))
tiles = torch.ones((1, 2, 8, 32, 32))
before = process_rss_bytes()
for _ in range(3):
    logits = runner(tiles)
print(json.dumps({"added": process_rss_bytes() - before - logits.numel() * 4}))
"""


def test_the_first_call_figure_holds_for_another_network_s_first_forward(tmp_path):
    measured = runtime_memory.torch_first_call_bytes(2, MachineCache(tmp_path))
    assert measured > 20 * MiB  # torch's kernels paged in: tens of MiB on any CPU
    done = subprocess.run([sys.executable, "-c", _FIRST_FORWARD], capture_output=True, text=True, check=True)
    added = json.loads(done.stdout.strip().splitlines()[-1])["added"]
    assert abs(added - measured) <= 0.2 * measured, (added / MiB, measured / MiB)


def test_the_figure_is_kept_per_machine_and_read_without_a_child(monkeypatch, tmp_path):
    calls: list[list[str]] = []

    def child(command, env, timeout_s):
        calls.append(command)
        return subprocess.CompletedProcess(command, 0, json.dumps({"first_call_bytes": 70 * MiB}), "")

    monkeypatch.setattr(runtime_memory, "run_probe", child)
    monkeypatch.setattr(runtime_memory, "_FIRST_CALLS", {})
    assert runtime_memory.torch_first_call_bytes(3, MachineCache(tmp_path)) == 70 * MiB
    monkeypatch.setattr(runtime_memory, "_FIRST_CALLS", {})  # another process: read from the cache folder
    assert runtime_memory.torch_first_call_bytes(3, MachineCache(tmp_path)) == 70 * MiB
    assert len(calls) == 1 and calls[0][-2:] == ["--torch-first-call", "3"]


def test_a_failing_first_call_probe_is_an_error_saying_how_to_see_why(monkeypatch, tmp_path):
    def child(command, env, timeout_s):
        return subprocess.CompletedProcess(command, 1, "", "RuntimeError: no oneDNN kernel for this CPU")

    monkeypatch.setattr(runtime_memory, "run_probe", child)
    monkeypatch.setattr(runtime_memory, "_FIRST_CALLS", {})
    with pytest.raises(RunError, match="torch failed measuring .* no oneDNN kernel .*--torch-first-call 2"):
        runtime_memory.torch_first_call_bytes(2, MachineCache(tmp_path))
    assert not (tmp_path / f"{runtime_memory.FIRST_CALL_CACHE_NAME}.json").exists()  # nothing kept


def test_the_pipeline_plans_the_first_call_only_where_torch_runs_on_the_cpu(monkeypatch):
    monkeypatch.setattr(predictor_module, "torch_first_call_bytes", lambda threads: 77 * MiB)
    network = build_network(tiny_topology(3))

    class Stage:  # a predictor's folds as the pipeline sees them
        def __init__(self, *runners):
            self.runners = runners

    on_cpu = TorchTileRunner(network, torch.device("cpu"))
    on_cuda = TorchTileRunner(network, torch.device("cuda"))  # never called: only its device is read
    assert predictor_module._first_call_bytes([Stage(on_cpu)]) == 77 * MiB
    assert predictor_module._first_call_bytes([Stage(on_cuda), Stage(on_cpu)]) == 77 * MiB  # a cascade: once
    assert predictor_module._first_call_bytes([Stage(on_cuda)]) == 0
    assert predictor_module._first_call_bytes([Stage(object())]) == 0  # a graph runtime: in its measured tile bytes


def test_case_memory_plans_the_first_call_on_top_of_the_process_s_rss(prepared, tiny_dataset, monkeypatch):
    plans = Plans.from_json(Workspace.at(prepared).plans_path)
    image = tiny_dataset / "imagesTs" / "demo_005_0000.nii.gz"
    plan = SimpleNamespace(
        host_accumulator_bytes=0, peak_bytes=0, parameter_bytes=0, slab_depth=1, accumulator_device="cpu"
    )
    monkeypatch.setattr(pipeline, "process_rss_bytes", lambda: 300 * MiB)
    args = ([Case("demo_005", (image,), None)], plans, plans.configuration("3d_fullres"), lambda after: plan, None)
    plain, first = pipeline.case_memory(*args), pipeline.case_memory(*args, first_call_bytes=80 * MiB)
    assert (plain["runtime"], first["runtime"]) == (300 * MiB, 380 * MiB)
    assert {k: v for k, v in plain.items() if k != "runtime"} == {k: v for k, v in first.items() if k != "runtime"}


def test_case_memory_plans_the_case_whose_window_holds_the_most_not_the_largest_image(prepared, tiny_dataset):
    """Each case's tile is fitted to its image, so a smaller image may run a larger tile: the plan's ``predict``
    term is the largest window's over every case, not the largest image's."""
    from autoseg.dataset.imageio import read_geometry

    plans = Plans.from_json(Workspace.at(prepared).plans_path)
    config = plans.configuration("3d_fullres")
    images = sorted((tiny_dataset / "imagesTs").glob("*_0000.nii.gz"))[:2]
    voxels = {
        tuple(config.resampled_shape(g.shape_zyx, g.spacing_zyx)): math.prod(g.shape_zyx)
        for g in map(read_geometry, images)
    }
    assert len(voxels) == 2
    smaller = min(voxels, key=voxels.get)

    def window(after):  # the smaller image's window holds 100 MiB more
        return SimpleNamespace(
            host_accumulator_bytes=0,
            peak_bytes=(300 if tuple(after) == smaller else 200) * MiB,
            parameter_bytes=0,
            slab_depth=1,
            accumulator_device="cpu",
        )

    cases = [Case(p.name.removesuffix("_0000.nii.gz"), (p,), None) for p in images]
    planned = pipeline.case_memory(cases, plans, config, window, None)
    alone = [pipeline.case_memory([c], plans, config, window, None)["predict"] for c in cases]
    assert planned["predict"] == max(alone) and max(alone) - min(alone) > 90 * MiB
