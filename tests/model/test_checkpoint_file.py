"""The checkpoint file: a round trip, and an empty, truncated or foreign file refused by name with the fold's
other checkpoints listed (train's resume and predict both read through it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autoseg.core.errors import InputError
from autoseg.model.checkpoint_file import read_checkpoint_file, write_checkpoint_file


def _fold(tmp_path: Path) -> Path:
    for which in ("latest", "best"):
        write_checkpoint_file(tmp_path / f"checkpoint_{which}.pt", {"network": {"w": torch.arange(3.0)}, "epoch": 4})
    return tmp_path / "checkpoint_latest.pt"


def test_round_trip(tmp_path: Path) -> None:
    state = read_checkpoint_file(_fold(tmp_path), "fix")
    assert state["epoch"] == 4 and torch.equal(state["network"]["w"], torch.arange(3.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_best.pt", "checkpoint_latest.pt"]


@pytest.mark.parametrize("mmap", [False, True])  # resume reads the file, predict maps it
@pytest.mark.parametrize(
    "damage, found",
    [
        (lambda b: b"", "is empty"),
        (lambda b: b[: len(b) // 2], "truncated or corrupt"),
        (lambda b: b"not a checkpoint" * 10, "truncated or corrupt"),
    ],
)
def test_a_damaged_checkpoint_is_refused_naming_it_and_the_others(
    tmp_path: Path, damage, found: str, mmap: bool
) -> None:
    path = _fold(tmp_path)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(InputError, match=found) as info:
        read_checkpoint_file(path, "DO THIS", mmap=mmap)
    message = str(info.value)
    assert str(path) in message and "also has checkpoint_best.pt" in message and message.endswith("DO THIS")


def test_a_file_that_cannot_be_mapped_is_read_instead(tmp_path: Path, monkeypatch) -> None:
    read = torch.load

    def load(*args, **kwargs):
        if kwargs.get("mmap"):
            raise RuntimeError("mmap: operation not supported")  # e.g. a network file system
        return read(*args, **kwargs)

    monkeypatch.setattr(torch, "load", load)
    assert read_checkpoint_file(_fold(tmp_path), "fix", mmap=True)["epoch"] == 4


def test_a_checkpoint_of_another_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint_final.pt"
    torch.save({"version": 1, "network": {}}, path)
    with pytest.raises(InputError, match="checkpoint version 1, expected 2"):
        read_checkpoint_file(path, "train again")


_LOAD_IN_A_FRESH_PROCESS = """
import sys
from pathlib import Path
from autoseg.core.resources import peak_rss_bytes, process_rss_bytes, reset_peak_rss
from autoseg.plan.plans import Plans
from autoseg.predict.networks import load_trained_network
plans = Plans.from_json(sys.argv[1])
config = plans.configuration("3d_fullres")
reset_peak_rss()
start = process_rss_bytes()
network = load_trained_network(Path(sys.argv[2]), plans, config, "cpu")
print(peak_rss_bytes() - start)
"""


@pytest.mark.slow  # ~4 s: a fresh process imports torch and loads a 64 MiB network
def test_prediction_reads_a_checkpoint_s_weights_and_not_its_optimizer_state(tmp_path: Path) -> None:
    """A checkpoint holding a 64 MiB network and 256 MiB of optimizer state: loading it for prediction raises the
    peak RSS of a fresh process by about the network twice (its parameters and the mapped weights they are copied
    from), not by the whole file as a read would (the network twice and the optimizer state)."""
    from dataclasses import replace

    from factories import tiny_plans

    from autoseg.core.resources import peak_rss_bytes
    from autoseg.core.units import MiB
    from autoseg.model.network import build_network
    from autoseg.model.topology import NetworkTopology

    if peak_rss_bytes() is None:
        pytest.skip("no peak RSS on this system")
    topology = NetworkTopology(
        dim=3,
        in_channels=1,
        num_outputs=3,
        features_per_stage=(32, 320, 320),
        kernel_sizes=((3, 3, 3),) * 3,
        strides=((1, 1, 1), (2, 2, 2), (2, 2, 2)),
    )
    plans = tiny_plans()
    config = replace(plans.configuration("3d_fullres"), network=topology)
    plans = replace(plans, configurations={"3d_fullres": config})
    plans.to_json(tmp_path / "plans.json")
    weights = build_network(topology).state_dict()
    network_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    optimizer = {f"{k}.{i}": torch.ones_like(t) for k, t in weights.items() for i in range(4)}
    write_checkpoint_file(tmp_path / "checkpoint_final.pt", {"network": weights, "optimizer": optimizer})
    rise = int(
        subprocess.run(
            [
                sys.executable,
                "-c",
                _LOAD_IN_A_FRESH_PROCESS,
                str(tmp_path / "plans.json"),
                str(tmp_path / "checkpoint_final.pt"),
            ],
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        ).stdout.split()[-1]
    )
    assert network_bytes > 50 * MiB
    assert rise < 2.5 * network_bytes, (rise / MiB, network_bytes / MiB)  # a read: 6x (network twice + 4x state)
