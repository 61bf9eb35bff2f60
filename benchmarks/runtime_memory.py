"""A graph runtime's working bytes: the memory plan's rule (``autoseg.predict.runtime_memory``: batches 1 and 2 each
measured in a fresh process, a larger batch extended linearly from them) against a fresh process per batch, and the
torch simulation's figure (tile + heap: what graph runners reported before they were measured) beside them.

For every installed runtime and precision (OpenVINO bf16 where the CPU has native bf16) and each ``--tile``, on a
plain U-Net of ``--features`` (random weights; the figures do not depend on them), ``--threads`` threads, every
mirror variant, a float16 accumulator. Prints MiB per batch: rule, direct, their error, and the simulation's tile +
heap terms.

    python benchmarks/runtime_memory.py [--features 16 32 64 128] [--tile 16 40 40] [--tile 32 96 96]
        [--batches 4] [--threads 1]
"""

from __future__ import annotations

import argparse

import torch

from autoseg.core.extras import installed
from autoseg.core.precision import native_bf16_flag
from autoseg.core.units import MiB
from autoseg.memory.inference import TileSimulation
from autoseg.model.graph_runners import GRAPH_RUNNERS
from autoseg.model.network import build_network
from autoseg.model.onnx_graph import export_graph
from autoseg.model.topology import NetworkTopology
from autoseg.predict.runtime_memory import RuntimeWorkingBytes, batch_bytes, measure_in_child


def _topology(features: list[int]) -> NetworkTopology:
    n = len(features)
    return NetworkTopology(
        dim=3,
        in_channels=1,
        num_outputs=3,
        features_per_stage=tuple(features),
        kernel_sizes=((3, 3, 3),) * n,
        strides=((1, 1, 1),) + ((2, 2, 2),) * (n - 1),
    )


def _rows(graph: bytes, topology: NetworkTopology, tile: tuple[int, ...], args: argparse.Namespace) -> None:
    """One table row per runtime, precision and batch for ``tile`` (batches 1 and 2: the rule is the measurement)."""
    precisions = {"onnxruntime": ("fp32",), "openvino": ("fp32", "bf16") if native_bf16_flag() else ("fp32",)}
    for runtime in (r for r in sorted(GRAPH_RUNNERS) if installed(r)):
        for precision in precisions[runtime]:
            simulation = TileSimulation(topology, precision, (0, 1, 2), None, "float16", "cpu")
            source = RuntimeWorkingBytes(graph, runtime, args.threads, simulation)
            direct = {b: measure_in_child(graph, source.request(tile, b)) for b in range(1, args.batches + 1)}
            for batch, figures in direct.items():
                ruled = (batch_bytes(direct[1], direct[2], batch) if batch > 2 else batch_bytes(figures)).tile_bytes
                measured, simulated = figures["tile_bytes"], simulation.working_bytes(batch, tile)
                print(
                    f"| {runtime} {precision} | {'x'.join(map(str, tile))} | {batch} | {ruled / MiB:.0f} | "
                    f"{measured / MiB:.0f} | {100 * (ruled / measured - 1):+.0f}% | "
                    f"{(simulated.tile_bytes + simulated.heap_retained_bytes) / MiB:.0f} |",
                    flush=True,
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--features", type=int, nargs="+", default=[16, 32, 64, 128])
    parser.add_argument("--tile", type=int, nargs=3, action="append")
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    topology = _topology(args.features)
    torch.manual_seed(0)
    side = 2 ** len(args.features)
    graph = export_graph(build_network(topology), torch.randn(1, 1, side, side, side))
    print(f"plain U-Net {args.features}, {args.threads} thread(s), 8 mirror variants, MiB above the call's start")
    print("| runtime | tile | batch | rule | fresh process | error | torch simulation |")
    print("|---|---|---|---|---|---|---|")
    for tile in args.tile or [[16, 40, 40], [32, 96, 96]]:
        _rows(graph, topology, tuple(tile), args)


if __name__ == "__main__":
    main()
