"""``--runtime auto`` / ``--precision auto``: the candidates are what this machine has (installed runtimes, bf16 only
on native-bf16 CPUs and where the model's agreement check allows it); the fastest by timing is chosen, said on
stdout, and the timings are kept per machine and model unless other processes were busy. Tests inject the
timings (``time_runner``) and the CPU's flags."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from extras import require_extra

from autoseg.core.errors import InputError, RunError
from autoseg.core.machine import keep_simulations_in
from autoseg.core.workspace import Workspace
from autoseg.model.graph_runners import OpenVinoTileRunner
from autoseg.model.torch_runner import TorchTileRunner
from autoseg.plan.plans import Plans
from autoseg.predict import runners, runtime_choice
from autoseg.predict.graphs import file_digest
from autoseg.predict.networks import load_trained_network
from autoseg.predict.precision_check import PRECISION_CHECK_FILE, CheckedCheckpoint, PrecisionCheck
from autoseg.predict.runtime_choice import Candidate, candidates
from autoseg.predict.window import AUTO, WindowOptions

require_extra("onnxruntime")
require_extra("openvino")
CONFIG = "3d_fullres"
EVERY = ("torch fp32", "torch bf16", "onnxruntime fp32", "openvino fp32", "openvino bf16")


def _names(found) -> tuple[str, ...]:
    return tuple(c.name for c in found)


@pytest.mark.parametrize(
    "runtime, precision, native_bf16, expected",
    [
        (AUTO, AUTO, True, EVERY),
        (AUTO, AUTO, False, ("torch fp32", "onnxruntime fp32", "openvino fp32")),
        (AUTO, None, True, ("torch fp32", "onnxruntime fp32", "openvino fp32")),  # None: the plan's, fp32 on CPU
        (AUTO, "bf16", True, ("torch bf16", "openvino bf16")),
        ("openvino", AUTO, True, ("openvino fp32", "openvino bf16")),
        ("onnxruntime", "bf16", True, ()),
    ],
)
def test_the_candidates_are_what_this_machine_computes(runtime, precision, native_bf16, expected) -> None:
    window = WindowOptions(runtime=runtime, precision=precision)
    assert _names(candidates(window, native_bf16)) == expected


def test_a_runtime_that_is_not_installed_is_no_candidate(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "openvino", None)
    assert _names(candidates(WindowOptions(runtime=AUTO, precision=AUTO), True)) == EVERY[:3]


SECONDS = {"TorchTileRunner fp32": 1.0, "TorchTileRunner bf16": 0.5, "OnnxRuntimeTileRunner fp32": 0.7}
SECONDS |= {"OpenVinoTileRunner fp32": 0.45, "OpenVinoTileRunner bf16": 0.15}


class _Timings:
    """``time_runner`` replaced: each runner's seconds by its class and precision; the calls counted."""

    def __init__(self, monkeypatch, seconds: dict[str, float] = SECONDS) -> None:
        self.calls: list[str] = []
        self.seconds = seconds
        monkeypatch.setattr(runtime_choice, "time_runner", self)

    def __call__(self, runner, tiles) -> float:
        name = f"{type(runner).__name__} {runner.precision}"
        self.calls.append(name)
        return self.seconds[name]


@pytest.fixture()
def workspace(trained: Path, tmp_path: Path, monkeypatch) -> Workspace:
    monkeypatch.setattr(runners, "native_bf16_flag", lambda: "amx_bf16")
    monkeypatch.setattr(runtime_choice, "busy_by_others", lambda others, cpus: "")  # a quiet machine
    keep_simulations_in(tmp_path / "cache")  # the command's cache folder, as the CLI sets it
    yield Workspace.at(shutil.copytree(trained, tmp_path / "ws"))
    keep_simulations_in(None)


def _fold(workspace: Workspace) -> runners.LoadedFold:
    plans = Plans.from_json(workspace.plans_path)
    config, path = plans.configuration(CONFIG), workspace.checkpoint(CONFIG, 0, "final")
    return runners.LoadedFold(workspace, plans, config, path, load_trained_network(path, plans, config, "cpu"))


def _resolve(workspace: Workspace, window: WindowOptions) -> WindowOptions:
    return runners.resolve_auto([_fold(workspace)], window)


def test_auto_takes_the_fastest_fp32_without_an_agreement_check_and_says_why(workspace, monkeypatch, capsys) -> None:
    timings = _Timings(monkeypatch)
    chosen = _resolve(workspace, WindowOptions(runtime=AUTO, precision=AUTO))
    assert (chosen.runtime, chosen.precision) == ("openvino", "fp32")
    assert sorted(timings.calls) == sorted(
        ["TorchTileRunner fp32", "OnnxRuntimeTileRunner fp32", "OpenVinoTileRunner fp32"]
    )
    said = capsys.readouterr().out
    assert "3d_fullres: runtime openvino, precision fp32 (auto: per tile batch (" in said
    assert "openvino fp32 0.450 s, onnxruntime fp32 0.700 s, torch fp32 1.000 s; measured now, cached in" in said
    assert "bf16: openvino refused: fold 0 of 3d_fullres: the model carries no bf16 agreement check" in said


def test_bf16_is_taken_where_every_folds_check_allows_it(workspace, monkeypatch, capsys) -> None:
    _Timings(monkeypatch)
    monkeypatch.setattr(runners, "bf16_verdict", lambda fold, runtime: (runtime == "openvino", "x"))
    chosen = _resolve(workspace, WindowOptions(runtime=AUTO, precision=AUTO))
    assert (chosen.runtime, chosen.precision) == ("openvino", "bf16")
    assert "bf16: openvino eligible: x / torch refused: x" in capsys.readouterr().out
    slow_bf16 = SECONDS | {"OpenVinoTileRunner bf16": 0.6}  # slower than openvino fp32 here: not taken
    keep_simulations_in(None)
    _Timings(monkeypatch, slow_bf16)
    assert _resolve(workspace, WindowOptions(runtime=AUTO, precision=AUTO)).precision == "fp32"


def test_a_stored_check_of_this_checkpoint_lets_auto_take_bf16_where_it_passed(workspace, monkeypatch, capsys) -> None:
    _Timings(monkeypatch)
    path = workspace.checkpoint(CONFIG, 0, "final")
    identity = CheckedCheckpoint(CONFIG, 0, "final", file_digest(path), ("a",), ("organ",), "4")
    bf16 = {"openvino": {"organ": 0.9005}, "torch": {"organ": 0.9030}}  # torch's is 0.003 off: refused
    PrecisionCheck.of(identity, {"organ": 0.9}, bf16).to_json(path.parent / PRECISION_CHECK_FILE)
    chosen = _resolve(workspace, WindowOptions(runtime=AUTO, precision=AUTO))
    assert (chosen.runtime, chosen.precision) == ("openvino", "bf16")
    said = capsys.readouterr().out
    assert "bf16: openvino eligible: " in said and "torch refused: " in said and "organ" in said
    path.write_bytes(path.read_bytes() + b"\0")  # another checkpoint: the check is not its own
    keep_simulations_in(None)
    assert _resolve(workspace, WindowOptions(runtime=AUTO, precision=AUTO)).precision == "fp32"


def test_the_timings_are_kept_per_machine_and_model_unless_the_cpus_were_busy(workspace, monkeypatch) -> None:
    timings = _Timings(monkeypatch)
    window = WindowOptions(runtime=AUTO, precision="fp32")
    assert _resolve(workspace, window).runtime == "openvino" and len(timings.calls) == 3
    assert _resolve(workspace, window).runtime == "openvino" and len(timings.calls) == 3  # kept: not timed again
    busy = _Timings(monkeypatch, SECONDS | {"TorchTileRunner fp32": 0.1})
    monkeypatch.setattr(runtime_choice, "busy_by_others", lambda others, cpus: "other processes kept 1.50 of 2 CPUs")
    checkpoint = workspace.checkpoint(CONFIG, 0, "final")
    checkpoint.write_bytes(checkpoint.read_bytes())  # the same model: still kept
    assert _resolve(workspace, window).runtime == "openvino" and busy.calls == []
    keep_simulations_in(workspace.root.parent / "other_cache")  # another machine's cache: timed, busy, not kept
    assert _resolve(workspace, window).runtime == "torch" and len(busy.calls) == 3
    assert _resolve(workspace, window).runtime == "torch" and len(busy.calls) == 6


def test_one_candidate_is_not_timed_and_cuda_takes_torch(workspace, monkeypatch) -> None:
    timings = _Timings(monkeypatch)
    chosen = _resolve(workspace, WindowOptions(runtime="openvino", precision=AUTO))
    assert (chosen.runtime, chosen.precision) == ("openvino", "fp32") and timings.calls == []  # bf16 refused
    cuda = _resolve(workspace, WindowOptions(device="cuda", runtime=AUTO, precision=AUTO))
    assert (cuda.runtime, cuda.precision) == ("torch", None)


def test_nothing_to_run_is_refused_naming_why(workspace, monkeypatch) -> None:
    monkeypatch.setattr(runners, "native_bf16_flag", lambda: None)
    with pytest.raises(InputError, match="--runtime auto --precision bf16: nothing on this machine runs 3d_fullres"):
        _resolve(workspace, WindowOptions(runtime=AUTO, precision="bf16"))


def test_the_timed_runners_are_the_real_ones(workspace) -> None:
    """Without injected timings: every candidate is built and timed for real on the planned tile batch."""
    plans = Plans.from_json(workspace.plans_path)
    config = plans.configuration(CONFIG)
    window = WindowOptions(runtime=AUTO, precision=AUTO)
    tiles = runtime_choice.timing_tiles(config, window)
    assert tiles.shape[1:] == (1, *config.inference_tile("planned")) and 1 <= tiles.shape[0] <= 4
    built, fold = [], _fold(workspace)

    def build(candidate: Candidate):
        built.append(fold.runner(WindowOptions(runtime=candidate.runtime, precision=candidate.precision)))
        return built[-1]

    measured = runtime_choice.time_candidates(candidates(window, True), build, tiles)
    assert set(measured.value) == set(EVERY) and all(s > 0 for s in measured.value.values())
    assert isinstance(built[0], TorchTileRunner) and isinstance(built[-1], OpenVinoTileRunner)
    assert built[-1].precision == "bf16"


def test_a_candidate_that_cannot_run_is_left_out_saying_why(workspace, monkeypatch, capsys, caplog) -> None:
    _Timings(monkeypatch)

    def refused(*args):
        raise RunError("the ONNX graph of fold 0 of 3d_fullres does not compute what torch computes: argmax 99.63%")

    monkeypatch.setattr(runners, "fold_graph", refused)
    chosen = _resolve(workspace, WindowOptions(runtime=AUTO, precision="fp32"))
    assert (chosen.runtime, chosen.precision) == ("torch", "fp32")
    assert "torch fp32 1.000 s, onnxruntime fp32 could not run, openvino fp32 could not run" in capsys.readouterr().out
    assert "--runtime auto: openvino fp32 is left out: the ONNX graph of fold 0 of 3d_fullres does not" in caplog.text
    keep_simulations_in(None)
    none_ran = {"onnxruntime fp32": None, "openvino fp32": None}
    with pytest.raises(RunError, match="none of onnxruntime fp32, openvino fp32 could run this model"):
        runtime_choice.RuntimeChoice.fastest(
            none_ran, [Candidate("onnxruntime", "fp32"), Candidate("openvino", "fp32")], (1,), "", ""
        )
