"""Run one tool's predictor in this process and time its network calls (benchmarks/predict.py).

    python _forward_timer.py OUT.json autoseg predict -i ... -o ...      # autoseg.cli.main.main([...])
    python _forward_timer.py OUT.json nnunet -i ... -o ... -m ...        # nnUNetv2_predict_from_modelfolder

autoseg: every tile runner's call is timed (``TILE_RUNNERS``: torch's and the graph runtimes' alike, since a graph
runtime makes no torch forward call). nnU-Net: global module hooks (``register_module_forward_pre_hook`` /
``register_module_forward_hook``) with a depth counter per thread time only the outermost module call, so a forward
pass counts once whatever it calls inside. Calls made by a probe (``PROBES``: autoseg's ``--runtime auto`` timing its
candidates on a tile batch before the first case) or on ``meta`` or fake tensors (a memory model tracing the network)
are summed apart, as "probe" seconds: they segment nothing. OUT.json gets the summed forward seconds, the number of
outermost calls, the probe seconds, the seconds from the start of this script to its first forward pass on a case and
to its end, and the exit status. Standard library and torch only: it runs in nnU-Net's venv too. The work starts only
under ``__name__ == "__main__"``, since nnU-Net's spawned worker processes import this file again.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import sys
import threading
import time

START = time.perf_counter()
PROBES = frozenset({"time_runner"})  # functions whose forward calls are not predictions
# autoseg's tile runners (module, class): every runtime's tile batches pass through these calls
TILE_RUNNERS = (("autoseg.model.torch_runner", "TorchTileRunner"), ("autoseg.model.graph_runners", "_GraphTileRunner"))


class ForwardTimer:
    """Summed wall seconds of the outermost ``nn.Module`` calls, per thread depth."""

    def __init__(self) -> None:
        self.seconds, self.calls, self.first_start = 0.0, 0, None
        self.probe_seconds, self.probe_calls = 0.0, 0
        self.first_calls: list[tuple[str, list[int], float]] = []  # (kind, input shape, seconds), the first 50
        self._local = threading.local()
        self._lock = threading.Lock()

    def install(self) -> None:
        """Time every module's outermost forward call (any torch model)."""
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        register_module_forward_pre_hook(self._pre)
        register_module_forward_hook(self._post)

    def install_on_runners(self) -> None:
        """Time every call of autoseg's tile runners (``TILE_RUNNERS``), whatever runtime is behind them."""
        for module_name, class_name in TILE_RUNNERS:
            runner = getattr(importlib.import_module(module_name), class_name)
            runner.__call__ = self._timed(runner.__call__)

    def _timed(self, call):
        @functools.wraps(call)
        def timed(runner, tile_batch):
            self._pre(runner, (tile_batch,))
            try:
                return call(runner, tile_batch)
            finally:
                self._post(runner, (tile_batch,), None)

        return timed

    def _pre(self, module, args) -> None:
        depth = getattr(self._local, "depth", 0)
        if depth == 0:
            self._local.shape = list(getattr(args[0], "shape", [])) if args else []
            self._local.probe = _called_from(PROBES) or _on_meta(args)
            _sync()
            self._local.t0 = time.perf_counter()
            if self.first_start is None and not self._local.probe:
                self.first_start = self._local.t0
        self._local.depth = depth + 1

    def _post(self, module, args, output) -> None:
        self._local.depth -= 1
        if self._local.depth == 0:
            _sync()
            seconds = time.perf_counter() - self._local.t0
            with self._lock:
                if len(self.first_calls) < 50:
                    kind = "probe" if self._local.probe else "forward"
                    self.first_calls.append((kind, self._local.shape, round(seconds, 4)))
                if self._local.probe:
                    self.probe_seconds += seconds
                    self.probe_calls += 1
                else:
                    self.seconds += seconds
                    self.calls += 1


def _on_meta(args: tuple) -> bool:
    """A call on ``meta`` tensors or torch's fake tensors (``FakeTensorMode``): a memory model tracing the
    network (autoseg's inference plan), no computation."""
    first = args[0] if args else None
    return type(first).__name__ == "FakeTensor" or getattr(getattr(first, "device", None), "type", None) == "meta"


def _called_from(names: frozenset[str], depth: int = 30) -> bool:
    """Whether a function named in ``names`` is among the caller's ``depth`` nearest frames."""
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code.co_name in names:
            return True
        frame = frame.f_back
    return False


def _sync() -> None:
    """Wait for queued CUDA work, so a forward's seconds are its own (a no-op on CPU)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _stub_nnunet_primus() -> None:
    """nnU-Net's trainer lookup imports every trainer module; primus_trainers imports timm, which fails here
    beside the CPU torch (its torchvision is a CUDA build). The 3d_fullres U-Net does not need it."""
    import types

    try:
        import timm  # noqa: F401
    except Exception:
        name = "nnunetv2.training.nnUNetTrainer.primus.primus_trainers"
        sys.modules[name] = types.ModuleType(name)


def run(tool: str, argv: list[str]) -> int:
    if tool == "autoseg":
        from autoseg.cli.main import main

        return int(main(argv) or 0)
    _stub_nnunet_primus()
    from nnunetv2.inference.predict_from_raw_data import predict_entry_point_modelfolder

    sys.argv = ["nnUNetv2_predict_from_modelfolder", *argv]
    predict_entry_point_modelfolder()
    return 0


def main() -> None:
    out, tool, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
    if tool == "autoseg":  # as the autoseg command does before torch is imported (the timer imports it first)
        from autoseg.core.machine import passive_openmp_waiting

        passive_openmp_waiting(os.environ)
    timer = ForwardTimer()
    if tool == "autoseg":
        timer.install_on_runners()
    else:
        timer.install()
    code = 1
    try:
        code = run(tool, argv)
    finally:
        end = time.perf_counter()
        first = None if timer.first_start is None else timer.first_start - START
        with open(out, "w") as f:
            json.dump(
                {
                    "forward_s": timer.seconds,
                    "forward_calls": timer.calls,
                    "probe_s": timer.probe_seconds,
                    "probe_calls": timer.probe_calls,
                    "first_calls": timer.first_calls,
                    "first_forward_s": first,
                    "in_process_s": end - START,
                    "exit_code": code,
                },
                f,
            )
    sys.exit(code)


if __name__ == "__main__":
    main()
