"""`autoseg plan` into a workspace: the dataset is checked against the one the workspace was made from,
and plans.json, once written, is the workspace's plan (kept unless --overwrite; kept when edited by hand)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from cli_checks import snapshot

import autoseg
from autoseg.core.artifacts import to_dict
from autoseg.core.errors import InputError
from autoseg.core.units import GiB
from autoseg.core.workspace import Workspace, dataset_source
from autoseg.dataset.raw import load_dataset
from autoseg.plan import run
from autoseg.plan.budget import Budget
from autoseg.plan.fingerprint import Fingerprint
from autoseg.plan.iteration_target import DEFAULT_TARGET, iteration_target
from autoseg.plan.planner import plan
from autoseg.plan.plans import Plans
from autoseg.plan.run import check_dataset, make_plan, plan_dataset, plan_differences, write_plan


def _budget(ram_gib: float) -> Budget:
    return Budget(gpu_memory_bytes=8 * GiB, host_ram_bytes=int(ram_gib * GiB), device="cpu", cpu_flops_per_second=1e10)


@pytest.fixture(scope="module")
def planned(tiny_dataset: Path, tmp_path_factory) -> Path:
    ws = Workspace.at(tmp_path_factory.mktemp("plan_run") / "ws")
    plan_dataset(tiny_dataset, ws, _budget(8), progress=False)
    return ws.root


@pytest.fixture()
def ws(planned: Path, tmp_path: Path) -> Workspace:
    return Workspace.at(shutil.copytree(planned, tmp_path / "ws"))


def test_workspace_json_records_the_dataset_and_the_plan_as_written(ws: Workspace, tiny_dataset: Path) -> None:
    info = ws.info()
    assert info.dataset == dataset_source(tiny_dataset) and Path(info.dataset_root) == tiny_dataset.resolve()
    assert info.plans_hash  # plans.json as the planner wrote it


def test_a_plan_that_would_differ_keeps_plans_json_unless_overwrite(ws: Workspace, tiny_dataset: Path) -> None:
    before = Plans.from_json(ws.plans_path)
    kept = make_plan(tiny_dataset, ws, _budget(4), progress=False)
    assert not kept.write_plans and kept.plans == before
    replaced = make_plan(tiny_dataset, ws, _budget(4), progress=False, overwrite=True)
    assert replaced.write_plans and replaced.plans.host_ram_bytes == 4 * GiB
    write_plan(ws, replaced)
    assert Plans.from_json(ws.plans_path).host_ram_bytes == 4 * GiB


def test_a_replan_whose_rates_come_from_the_cache_plans_the_same(ws: Workspace, tiny_dataset: Path) -> None:
    """Where the CPU rates came from (measured now, then the machine cache) is recorded, not planned with: a re-plan
    with the same rates from elsewhere is the same plan (no "would plan differently"), and keeps its record of where
    they first came from."""
    cached = replace(_budget(8), cpu_rates_source="cached in /cache/cpu_throughput.json, measured 2026-11-27 09:30 UTC")
    planned = make_plan(tiny_dataset, ws, cached, progress=False)
    assert planned.write_plans and planned.plans == Plans.from_json(ws.plans_path)


def test_a_schema_6_plan_reads_with_no_rates_source(ws: Workspace) -> None:
    payload = json.loads(ws.plans_path.read_text())
    del payload["cpu_rates_source"]
    ws.plans_path.write_text(json.dumps({**payload, "schema_version": 6}))
    plans = Plans.from_json(ws.plans_path)
    assert plans.cpu_rates_source == "" and plans.cpu_flops_per_second == payload["cpu_flops_per_second"]


def test_a_schema_9_cpu_plan_reads_as_sized_to_the_default(ws: Workspace) -> None:
    """A CPU plan from before the target was recorded was sized to the default 1 s: read so, a re-plan without a
    time budget is the same plan (no "would plan differently"); a re-plan for a 2-minute budget is not, and the
    target and the budget are provenance, not differences (the same target from another budget plans the same)."""
    payload = json.loads(ws.plans_path.read_text())
    for key in ("cpu_seconds_per_iteration", "time_budget_seconds", "iteration_reason"):
        del payload[key]
    for schema in (6, 8):  # every older upgrade ends with 9 -> 10
        ws.plans_path.write_text(json.dumps({**payload, "schema_version": schema}))
        assert Plans.from_json(ws.plans_path).iteration == DEFAULT_TARGET
    ws.plans_path.write_text(json.dumps({**payload, "schema_version": 9}))
    old, fp = Plans.from_json(ws.plans_path), Fingerprint.from_json(ws.fingerprint_path)
    assert old.iteration == DEFAULT_TARGET
    assert plan_differences(old, plan(fp, _budget(8))) == []
    short = plan(fp, replace(_budget(8), iteration=iteration_target(120.0)))
    assert f"cpu_seconds_per_iteration: 1.0 -> {short.cpu_seconds_per_iteration!r}" in plan_differences(old, short)
    assert short.cpu_seconds_per_iteration == iteration_target(120.0).seconds < 1.0
    two, three = (plan(fp, replace(_budget(8), iteration=iteration_target(t))) for t in (7200.0, 10800.0))
    assert two.time_budget_seconds == 7200.0 and plan_differences(two, three) == []


@pytest.mark.parametrize(
    ("schema", "key", "default", "unknown"),
    [
        (7, "image_resampling", "sitk", "bicubic"),  # schema 7: autoseg's own image resampling
        (8, "gaussian_centre", "middle", "ceil"),  # schema 8: the symmetric Gaussian
    ],
)
def test_an_older_plan_reads_the_key_it_lacks_as_autosegs_default(
    ws: Workspace, schema: int, key: str, default: str, unknown: str
) -> None:
    payload = json.loads(ws.plans_path.read_text())
    assert payload[key] == default
    del payload[key]
    ws.plans_path.write_text(json.dumps({**payload, "schema_version": schema}))
    assert getattr(Plans.from_json(ws.plans_path), key) == default
    ws.plans_path.write_text(json.dumps({**payload, key: unknown}))
    with pytest.raises(InputError, match=f"{key} '{unknown}' is not one of"):
        Plans.from_json(ws.plans_path)


def test_a_plans_json_edited_by_hand_is_kept_even_with_overwrite(ws: Workspace, tiny_dataset: Path) -> None:
    payload = json.loads(ws.plans_path.read_text())
    payload["configurations"]["3d_fullres"]["batch_size"] = 1
    ws.plans_path.write_text(json.dumps(payload, indent=2))
    planned = make_plan(tiny_dataset, ws, _budget(8), progress=False, overwrite=True)
    assert not planned.write_plans and planned.plans.configurations["3d_fullres"].batch_size == 1
    before = ws.plans_path.read_bytes()
    write_plan(ws, planned)
    assert ws.plans_path.read_bytes() == before
    assert make_plan(tiny_dataset, ws, _budget(8), progress=False).plans == planned.plans  # still seen as edited


def test_check_dataset_refuses_a_changed_dataset_and_lists_the_changes(
    ws: Workspace, tiny_dataset: Path, tmp_path: Path
) -> None:
    assert check_dataset(Workspace.at(tmp_path / "new"), tiny_dataset, dataset_source(tiny_dataset)) == []
    copy = shutil.copytree(tiny_dataset, tmp_path / "copy", copy_function=shutil.copyfile)
    assert check_dataset(ws, copy, dataset_source(copy)) == []  # the same files elsewhere: the same dataset
    (copy / "labelsTr/demo_003.nii.gz").unlink()
    (copy / "imagesTr/demo_003_0000.nii.gz").unlink()
    before = snapshot(ws.root)
    with pytest.raises(InputError, match="is a different one.*demo_003.*removed.*--overwrite") as info:
        check_dataset(ws, copy, dataset_source(copy))
    assert str(ws.root) in str(info.value) and str(tiny_dataset.resolve()) in str(info.value)
    assert snapshot(ws.root) == before
    changes = check_dataset(ws, copy, dataset_source(copy), overwrite=True)
    assert changes == ["imagesTr/demo_003_0000.nii.gz: removed", "labelsTr/demo_003.nii.gz: removed"]


def test_replanning_an_unchanged_dataset_reuses_its_fingerprint(
    ws: Workspace, tiny_dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another budget on the same dataset reads fingerprint.json instead of fingerprinting again; a changed dataset
    (a copy with one label file edited) is fingerprinted again, and so is a workspace whose fingerprint.json
    cannot be read."""
    import autoseg.plan.run as run_module

    computed: list[str] = []
    real = run_module.fingerprint

    def counting_fingerprint(dataset, **kwargs):
        computed.append(dataset.name)
        return real(dataset, **kwargs)

    monkeypatch.setattr(run_module, "fingerprint", counting_fingerprint)
    before = ws.fingerprint_path.read_text()
    replanned = make_plan(tiny_dataset, ws, _budget(4), progress=False, overwrite=True)
    assert computed == [] and to_dict(replanned.fingerprint) == to_dict(Fingerprint.from_json(ws.fingerprint_path))
    assert ws.fingerprint_path.read_text() == before
    changed = Path(shutil.copytree(tiny_dataset, tmp_path / "changed"))
    label = sorted((changed / "labelsTr").glob("*"))[0]
    label.write_bytes(label.read_bytes() + b"\0")  # another size: another file
    make_plan(changed, ws, _budget(4), progress=False, overwrite=True)
    assert len(computed) == 1
    ws.fingerprint_path.write_text("{not json")
    make_plan(tiny_dataset, ws, _budget(4), progress=False, overwrite=True)
    assert len(computed) == 2


@dataclass(frozen=True)
class KeptPlan:
    """A first `autoseg plan` through the CLI: its command, its cache folder (the simulations it kept) and
    workspace, and the plans.json it wrote."""

    command: list[str]
    cache: Path
    workspace: Path
    plans_text: str


@pytest.fixture(scope="module")
def kept_plan(tiny_dataset: Path, tmp_path_factory) -> KeptPlan:
    import autoseg.memory.inference as inference
    from autoseg.cli.main import main
    from autoseg.memory.fit import training_memory_model

    root = tmp_path_factory.mktemp("kept_plan")
    command = [
        "--quiet",
        "plan",
        str(tiny_dataset),
        "-w",
        str(root / "ws"),
        "--device",
        "cpu",
        "--ram",
        "8GiB",
        "--gpu-memory",
        "8GiB",
        "--cpu-flops",
        "1e10",
    ]  # every figure given: nothing asks torch
    training_memory_model.cache_clear()  # as in a new process: earlier tests' fitted models would simulate nothing
    inference._simulate_cached.cache_clear()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AUTOSEG_CACHE_DIR", str(root / "cache"))
        assert main(command) == 0
    return KeptPlan(command, root / "cache", root / "ws", (root / "ws" / "plans.json").read_text())


def test_a_replan_through_the_cli_reads_kept_simulations_and_plans_the_same(
    kept_plan: KeptPlan, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`autoseg plan` keeps its training-step and tile simulations in the machine cache; a second plan (after the
    in-process caches are cleared, as in a new process) runs none and writes the same plans.json. Outside a
    command nothing is kept."""
    import autoseg.memory.inference as inference
    import autoseg.memory.training as training
    from autoseg.cli.main import main
    from autoseg.core.machine import kept_simulations
    from autoseg.memory.fit import training_memory_model

    assert list((kept_plan.cache / "training_steps").glob("step-*.json"))
    assert (kept_plan.cache / "inference_simulation.json").is_file()
    assert kept_simulations() is None  # the command's cache ends with it

    def no_simulation(*args, **kwargs):
        raise AssertionError("simulated again")

    training_memory_model.cache_clear()
    inference._simulate_cached.cache_clear()
    monkeypatch.setattr(training, "_record_training_step", no_simulation)
    monkeypatch.setattr(inference, "_simulate_cached", no_simulation)
    monkeypatch.setenv("AUTOSEG_CACHE_DIR", str(kept_plan.cache))
    ws = shutil.copytree(kept_plan.workspace, tmp_path / "ws")
    (ws / "plans.json").unlink()
    command = [str(ws) if a == str(kept_plan.workspace) else a for a in kept_plan.command]
    assert main(command) == 0
    assert (ws / "plans.json").read_text() == kept_plan.plans_text


REPLAN_IN_A_NEW_PROCESS = """
import json, sys
import autoseg
from autoseg.cli.main import main
code = main(sys.argv[1:])
torch = "torch" in sys.modules
autoseg.Segmenter  # the Python API, imported when first asked for: then it loads torch
print(json.dumps({"code": code, "torch": torch, "segmenter": "torch" in sys.modules}))
"""


def test_a_replan_with_every_simulation_kept_does_not_import_torch(kept_plan: KeptPlan, tmp_path: Path) -> None:
    """A re-plan in a new process (the fingerprint in the workspace, every simulation kept) reads what it needs
    without importing torch (1-2 s of a re-plan's time) and writes the same plans.json; ``import autoseg`` does not
    import torch either until ``autoseg.Segmenter`` is asked for."""
    ws = shutil.copytree(kept_plan.workspace, tmp_path / "ws")
    (ws / "plans.json").unlink()
    command = [str(ws) if a == str(kept_plan.workspace) else a for a in kept_plan.command]
    env = {
        **os.environ,
        "AUTOSEG_CACHE_DIR": str(kept_plan.cache),
        "PYTHONPATH": os.pathsep.join([str(Path(autoseg.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-c", REPLAN_IN_A_NEW_PROCESS, *command], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"code": 0, "torch": False, "segmenter": True}, done.stderr
    assert (ws / "plans.json").read_text() == kept_plan.plans_text


def test_a_small_dataset_is_fingerprinted_in_this_process_a_large_one_in_workers(
    tiny_dataset: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Worker processes take about a second to start: a dataset read in less (under IN_PROCESS_FINGERPRINT_VOXELS)
    is fingerprinted in this process; a larger one in as many workers as the RAM budget and the CPUs allow."""
    dataset = load_dataset(tiny_dataset)
    budget = replace(_budget(8), cpu_count=2)
    assert run.fingerprint_processes(dataset, budget) == 1
    monkeypatch.setattr(run, "IN_PROCESS_FINGERPRINT_VOXELS", 1)  # every dataset is a large one
    assert run.fingerprint_processes(dataset, budget) == 2
    assert run.fingerprint_processes(dataset, replace(budget, host_ram_bytes=1)) == 1  # no RAM for a second one
