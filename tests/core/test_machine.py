from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

import autoseg.core.machine
from autoseg.core.artifacts import WriteError
from autoseg.core.machine import (
    ONEDNN_PRIMITIVES_KEPT,
    MachineCache,
    Measurement,
    bounded_onednn_primitive_cache,
    machine_key,
    passive_openmp_waiting,
    use_cpu_threads,
)

KEY = {"cpu_model": "Test CPU", "cpus": 2, "torch": "2.13.0"}


class _Measure:
    """An injected measurement: hands out ``values`` in turn and counts its calls."""

    def __init__(self, *measurements: Measurement) -> None:
        self.measurements, self.calls = list(measurements), 0

    def __call__(self) -> Measurement:
        self.calls += 1
        return self.measurements.pop(0)


def test_a_figure_is_measured_once_then_read_from_the_cache_with_its_date(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """However different a second measurement would be (a busy machine), the cached figure is used, and the source
    says when it was measured."""
    monkeypatch.setattr(autoseg.core.machine, "utc_now_text", lambda: "2026-11-27 09:30 UTC")
    cache, measure = MachineCache(tmp_path), _Measure(Measurement(5e9, details={"s": 0.5}), Measurement(1e9))
    path = tmp_path / "cpu_throughput.json"
    assert cache.measured("cpu_throughput", KEY, measure) == (5e9, f"measured now, cached in {path}")
    cached = (5e9, f"cached in {path}, measured 2026-11-27 09:30 UTC")
    assert cache.measured("cpu_throughput", dict(reversed(KEY.items())), measure) == cached
    assert measure.calls == 1
    stored = json.loads(path.read_text())
    assert stored["entries"] == [
        {"key": KEY, "value": 5e9, "details": {"s": 0.5}, "measured_at": "2026-11-27 09:30 UTC"}
    ]


def test_an_entry_written_before_dates_were_recorded_is_read_without_one(tmp_path: Path) -> None:
    path = tmp_path / "cpu_throughput.json"
    path.write_text(json.dumps({"schema_version": 1, "entries": [{"key": KEY, "value": 5e9, "details": {}}]}))
    assert MachineCache(tmp_path).measured("cpu_throughput", KEY, _Measure()) == (5e9, f"cached in {path}")


def test_another_machine_key_measures_again_and_both_are_kept(tmp_path: Path) -> None:
    cache, measure = MachineCache(tmp_path), _Measure(Measurement(5e9), Measurement(7e9))
    other = {**KEY, "torch": "2.14.0"}
    assert cache.measured("cpu_throughput", KEY, measure)[0] == 5e9
    assert cache.measured("cpu_throughput", other, measure)[0] == 7e9
    assert cache.measured("cpu_throughput", KEY, measure)[0] == 5e9
    assert cache.measured("cpu_throughput", other, measure)[0] == 7e9
    assert measure.calls == 2


def test_a_figure_measured_on_busy_cores_is_not_cached(tmp_path: Path) -> None:
    cache = MachineCache(tmp_path)
    measure = _Measure(Measurement(1e9, keep=False, why_not_kept="the cores were busy"), Measurement(5e9))
    assert cache.measured("cpu_throughput", KEY, measure) == (1e9, "measured now, not cached: the cores were busy")
    assert not (tmp_path / "cpu_throughput.json").exists()
    assert cache.measured("cpu_throughput", KEY, measure)[0] == 5e9 and measure.calls == 2


@pytest.mark.parametrize(
    "text",
    [
        "{not json",
        "[]",
        json.dumps({"schema_version": 99, "entries": []}),
        json.dumps({"schema_version": 1, "entries": [{"key": KEY}]}),
    ],
    ids=["truncated", "not_an_object", "unknown_version", "entry_without_value"],
)
def test_an_unreadable_cache_file_is_ignored_with_a_warning_and_rewritten(
    tmp_path: Path, text: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "cpu_throughput.json"
    path.write_text(text)
    with caplog.at_level(logging.WARNING, logger="autoseg"):
        assert MachineCache(tmp_path).measured("cpu_throughput", KEY, _Measure(Measurement(5e9)))[0] == 5e9
    assert f"{path}: not a readable autoseg measurement cache" in caplog.text and "rewriting it" in caplog.text
    assert MachineCache(tmp_path).measured("cpu_throughput", KEY, _Measure())[1].startswith(f"cached in {path}, ")


def test_no_folder_or_an_unwritable_one_still_gives_the_figure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert MachineCache(None).measured("x", KEY, _Measure(Measurement(3.0))) == (3.0, "measured now (no cache folder)")

    def refuse(path, text):
        raise WriteError(path, "Read-only file system")

    monkeypatch.setattr(autoseg.core.machine, "atomic_write_text", refuse)
    value, source = MachineCache(tmp_path).measured("x", KEY, _Measure(Measurement(3.0)))
    assert value == 3.0 and source.startswith(f"measured now (could not cache it in {tmp_path / 'x.json'}")


def test_the_machine_key_names_what_changes_a_cpu_measurement() -> None:
    key = machine_key({"OMP_WAIT_POLICY": "passive"})
    assert {"arch", "cpu_model", "cpus", "affinity", "torch"} <= set(key)
    assert key["torch"] == torch.__version__ and key["omp_wait_policy"] == "PASSIVE"
    assert machine_key({})["omp_wait_policy"] == ""


def test_openmp_waits_passively_unless_the_user_chose_a_policy() -> None:
    environ: dict[str, str] = {}
    assert passive_openmp_waiting(environ, modules={}) and environ == {"OMP_WAIT_POLICY": "PASSIVE"}
    chosen = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert not passive_openmp_waiting(chosen, modules={}) and chosen == {"OMP_WAIT_POLICY": "ACTIVE"}
    late: dict[str, str] = {}  # torch imported already: libgomp has read its environment
    assert not passive_openmp_waiting(late, modules={"torch": torch}) and late == {}


def test_onednn_keeps_a_bounded_number_of_primitives_unless_the_user_chose_one() -> None:
    environ: dict[str, str] = {}
    assert bounded_onednn_primitive_cache(environ, modules={}) == str(ONEDNN_PRIMITIVES_KEPT)
    assert environ == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(ONEDNN_PRIMITIVES_KEPT)}
    chosen = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "4096"}
    assert bounded_onednn_primitive_cache(chosen, modules={}) == "4096" and len(chosen) == 1
    late: dict[str, str] = {}  # torch imported already: oneDNN may have read its environment
    assert bounded_onednn_primitive_cache(late, modules={"torch": torch}) is None and late == {}


@pytest.fixture()
def _threads_restored():
    previous = torch.get_num_threads()
    yield
    torch.set_num_threads(previous)


@pytest.mark.usefixtures("_threads_restored")
def test_cpu_threads_are_every_cpu_without_timing_anything(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The count does not depend on the load: it is the CPUs this process may use (or the requested count)."""
    monkeypatch.setattr(autoseg.core.machine, "cpu_count", lambda: 3)
    with caplog.at_level(logging.INFO, logger="autoseg"):
        assert use_cpu_threads(None, "prediction", {"OMP_WAIT_POLICY": "PASSIVE"}) == 3
    assert torch.get_num_threads() == 3
    assert "CPU threads for prediction: 3 (every CPU this process may use; OpenMP waits passively)" in caplog.text
    assert use_cpu_threads(2, "training", {"OMP_WAIT_POLICY": "PASSIVE"}) == 2 and torch.get_num_threads() == 2


@pytest.mark.usefixtures("_threads_restored")
def test_spinning_openmp_threads_are_warned_about(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(autoseg.core.machine, "cpu_count", lambda: 2)
    with caplog.at_level(logging.WARNING, logger="autoseg"):
        use_cpu_threads(None, "training", {})
    assert "OMP_WAIT_POLICY is 'unset', not PASSIVE" in caplog.text
    assert "set OMP_WAIT_POLICY=PASSIVE before importing torch" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="autoseg"):
        use_cpu_threads(1, "training", {})  # one thread never waits for another
    assert caplog.text == ""
