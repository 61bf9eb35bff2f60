from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from autoseg.core.artifacts import Artifact, ArtifactError, atomic_path, atomic_save_npy, atomic_write_text


@dataclass(frozen=True)
class Inner:
    name: str
    spacing_mm: tuple[float, float, float]


@dataclass(frozen=True)
class Record(Artifact):
    SCHEMA_VERSION = 3
    KIND = "test record"

    case_id: str
    shape_zyx: tuple[int, int, int]
    bbox: tuple[tuple[int, int], ...]
    table: dict[str, tuple[float, ...]]
    inner: Inner
    inners: tuple[Inner, ...]
    maybe_inner: Inner | None
    maybe_number: float | None
    flags: tuple[bool, ...] = ()
    notes: dict[str, int] = field(default_factory=dict)


def _record(**changes) -> Record:
    values = dict(
        case_id="case_007",
        shape_zyx=(3, 40, 50),
        bbox=((0, 3), (5, 35), (2, 48)),
        table={"a": (1.5, -2.0), "b": ()},
        inner=Inner("x", (2.5, 0.75, 0.75)),
        inners=(Inner("p", (1.0, 1.0, 1.0)), Inner("q", (3.0, 0.5, 0.5))),
        maybe_inner=Inner("z", (1.0, 2.0, 3.0)),
        maybe_number=None,
        flags=(True, False),
        notes={"k": 4},
    )
    values.update(changes)
    return Record(**values)


def _payload(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.mark.parametrize("changes", [{}, {"maybe_inner": None, "maybe_number": 2.5}, {"maybe_number": 3}])
def test_round_trip_restores_equal_dataclass_with_tuples(tmp_path: Path, changes: dict) -> None:
    record = _record(**changes)
    path = tmp_path / "record.json"
    record.to_json(path)
    assert _payload(path)["schema_version"] == 3
    loaded = Record.from_json(path)
    assert loaded == record
    # JSON lists come back as tuples (hashable, comparable), nested dataclasses as dataclasses
    assert isinstance(loaded.bbox[1], tuple) and isinstance(loaded.table["a"], tuple)
    assert isinstance(loaded.inners[1], Inner)
    if changes.get("maybe_number") == 3:
        assert isinstance(loaded.maybe_number, float)


def test_numpy_scalars_are_written_as_plain_numbers(tmp_path: Path) -> None:
    record = _record(shape_zyx=(np.int64(3), np.int64(4), np.int64(5)), maybe_number=np.float32(0.5))
    path = tmp_path / "record.json"
    record.to_json(path)
    assert _payload(path)["shape_zyx"] == [3, 4, 5]
    assert Record.from_json(path) == _record(shape_zyx=(3, 4, 5), maybe_number=0.5)


def test_default_fields_may_be_missing(tmp_path: Path) -> None:
    path = tmp_path / "record.json"
    _record().to_json(path)
    payload = _payload(path)
    del payload["flags"], payload["notes"]
    path.write_text(json.dumps(payload))
    loaded = Record.from_json(path)
    assert loaded.flags == () and loaded.notes == {}


def _rewrite(path: Path, edit) -> None:
    payload = _payload(path)
    edit(payload)
    path.write_text(json.dumps(payload))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda p: p.update(extra=1), "unknown key(s) ['extra']"),
        (lambda p: p["inner"].update(colour="red"), "unknown key(s) ['colour'] for Inner"),
        (lambda p: p.pop("case_id"), "missing key 'case_id'"),
        (lambda p: p["inner"].pop("spacing_mm"), "missing key 'spacing_mm' for Inner"),
        (lambda p: p.update(schema_version=2), "schema_version 2 is not the supported 3"),
        (lambda p: p.pop("schema_version"), "schema_version None"),
        (lambda p: p.update(shape_zyx=[1, 2]), "expected 3 values, found 2"),
        (lambda p: p.update(shape_zyx=[1, 2, "3"]), "expected an integer"),
        (lambda p: p.update(shape_zyx=[1, 2, True]), "expected an integer"),
    ],
)
def test_bad_payload_raises_naming_the_file(tmp_path: Path, edit, message: str) -> None:
    path = tmp_path / "sub" / "record.json"
    _record().to_json(path)
    _rewrite(path, edit)
    with pytest.raises(ArtifactError) as info:
        Record.from_json(path)
    assert str(path) in str(info.value)
    assert message in str(info.value)


def test_nested_error_names_the_field_path(tmp_path: Path) -> None:
    path = tmp_path / "record.json"
    _record().to_json(path)
    _rewrite(path, lambda p: p["inners"][1].update(spacing_mm=[1.0, "a", 1.0]))
    with pytest.raises(ArtifactError, match=r"record\.json\.inners\[1\]\.spacing_mm\[1\]: expected a number"):
        Record.from_json(path)


def test_missing_and_corrupt_files_raise_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "record.json"
    with pytest.raises(ArtifactError, match="file not found") as info:
        Record.from_json(path)
    assert str(path) in str(info.value)
    path.write_text('{"schema_version": 3, "case_id": ')  # a crash mid-write by some other tool
    with pytest.raises(ArtifactError, match="not valid JSON") as info:
        Record.from_json(path)
    assert str(path) in str(info.value)
    path.write_text("[1, 2]")
    with pytest.raises(ArtifactError, match="expected a JSON object"):
        Record.from_json(path)


def _leftovers(folder: Path, keep: str) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name != keep)


def test_atomic_path_on_error_keeps_old_file_and_removes_temp(tmp_path: Path) -> None:
    target = tmp_path / "plans.json"
    target.write_text("old")
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_path(target) as tmp:
            assert tmp.parent == tmp_path and tmp != target
            tmp.write_text("half-written")
            raise RuntimeError("boom")
    assert target.read_text() == "old"
    assert _leftovers(tmp_path, "plans.json") == []


def test_atomic_path_on_error_creates_nothing_when_no_old_file(tmp_path: Path) -> None:
    target = tmp_path / "new" / "data.npy"
    with pytest.raises(KeyboardInterrupt):
        with atomic_path(target, suffix=".npy") as tmp:
            assert tmp.name.endswith(".npy")  # writers that insist on an ending (np.save, SimpleITK) work
            np.save(tmp, np.zeros(3))
            raise KeyboardInterrupt
    assert list(target.parent.iterdir()) == []


def test_atomic_path_success_replaces_and_cleans_up(tmp_path: Path) -> None:
    target = tmp_path / "a.txt"
    target.write_text("old")
    atomic_write_text(target, "new")
    assert target.read_text() == "new"
    assert _leftovers(tmp_path, "a.txt") == []


def test_written_files_get_umask_permissions_not_0600(tmp_path: Path) -> None:
    old_mask = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "a.json", "{}")
        atomic_save_npy(tmp_path / "b.npy", np.arange(6, dtype=np.float32).reshape(2, 3))
        _record().to_json(tmp_path / "c.json")
    finally:
        os.umask(old_mask)
    for name in ("a.json", "b.npy", "c.json"):
        mode = (tmp_path / name).stat().st_mode & 0o777
        assert mode == 0o644, f"{name}: {oct(mode)}"
    loaded = np.load(tmp_path / "b.npy", mmap_mode="r")
    assert loaded.dtype == np.float32 and loaded.shape == (2, 3) and float(loaded[1, 2]) == 5.0


def test_plans_of_earlier_schemas_are_read_as_the_current_one(tmp_path: Path) -> None:
    """A workspace planned before plans schema 7 (no cpu_rates_source, image_resampling, export_space nor
    gaussian_centre), 5 (also no network.blocks_per_stage), 4 (also no inference_patch_size) or 3 (also
    network.num_classes, no architecture) still loads, equal to the same plan written now: rates of no stated source,
    a plain U-Net, with the training patch as its inference tile; a version with no upgrade still fails naming the
    file."""
    from factories import tiny_plans

    from autoseg.plan.plans import Plans

    plans = tiny_plans()
    plans.to_json(tmp_path / "plans.json")
    payload = json.loads((tmp_path / "plans.json").read_text())
    payload["schema_version"] = 6
    assert payload.pop("cpu_rates_source") == "" and payload.pop("image_resampling") == "sitk"
    assert payload.pop("export_space") == "probabilities" and payload.pop("gaussian_centre") == "middle"
    (tmp_path / "v6.json").write_text(json.dumps(payload))
    assert Plans.from_json(tmp_path / "v6.json") == plans
    payload["schema_version"] = 4
    for config in payload["configurations"].values():
        assert config["network"].pop("blocks_per_stage") == []
    (tmp_path / "v4.json").write_text(json.dumps(payload))
    assert Plans.from_json(tmp_path / "v4.json") == plans
    payload["schema_version"] = 3
    for config in payload["configurations"].values():
        assert config.pop("inference_patch_size") == config["patch_size"]
    (tmp_path / "v3.json").write_text(json.dumps(payload))
    assert Plans.from_json(tmp_path / "v3.json") == plans
    payload["schema_version"] = 2
    for config in payload["configurations"].values():
        config["network"]["num_classes"] = config["network"].pop("num_outputs")
        del config["network"]["architecture"]
    (tmp_path / "old.json").write_text(json.dumps(payload))
    assert Plans.from_json(tmp_path / "old.json") == plans
    payload["schema_version"] = 1
    (tmp_path / "older.json").write_text(json.dumps(payload))
    with pytest.raises(
        ArtifactError, match=rf"older.json: plans schema_version 1 is not the supported {Plans.SCHEMA_VERSION}"
    ):
        Plans.from_json(tmp_path / "older.json")
