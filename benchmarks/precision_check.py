"""What the bf16 agreement check costs beside the final validation it follows (issue 27; run by hand).

On a trained workspace (e.g. ``autoseg demo -w WS``'s), predicts one fold's validation cases as the final validation
does (``autoseg.train.validation.validate_fold``: from the raw images, ``--tta``, probabilities written, evaluated)
and times it, then makes the fold's check (``autoseg.train.precision_check.run_precision_check``: the same cases in
fp32 torch and in bf16 with every installed runtime) and times that; prints both, the check's per-run seconds (its
log line) and its figures, and the load average before and after.

    autoseg demo -w /tmp/demo
    python benchmarks/precision_check.py /tmp/demo --threads 2
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workspace", type=Path, help="a workspace with the fold trained (checkpoint_final.pt)")
    parser.add_argument("-c", "--config", default="3d_fullres")
    parser.add_argument("-f", "--fold", default="0")
    parser.add_argument("--tta", default="4", help="the final validation's --tta (the CPU's default: 4)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()

    import torch

    from autoseg.core.workspace import Workspace
    from autoseg.plan.plans import Plans
    from autoseg.predict.networks import load_networks
    from autoseg.train.fold_data import fold_cases
    from autoseg.train.precision_check import run_precision_check
    from autoseg.train.run_record import FinalValidation
    from autoseg.train.validation import validate_fold

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    fold = int(args.fold) if args.fold.isdigit() else args.fold
    ws = Workspace.at(args.workspace)
    plans = Plans.from_json(ws.plans_path)
    config = plans.configuration(args.config)
    val_ids = fold_cases(ws, config.data_configuration, fold)[1]
    network = load_networks(ws, plans, config, (fold,), "final", "cpu")[0]
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="autoseg-check-bench-") as out:
        t0 = time.perf_counter()
        final = FinalValidation(tuple(val_ids), args.tta)
        validate_fold(ws, plans, args.config, network, final, Path(out), "cpu", progress=False)
        validation_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    check = run_precision_check(ws, plans, args.config, fold, tta=args.tta)
    check_s = time.perf_counter() - t0
    print(
        f"final validation: {len(val_ids)} case(s), --tta {args.tta}, {torch.get_num_threads()} thread(s): "
        f"{validation_s:.1f} s"
    )
    print(f"bf16 agreement check: {check_s:.1f} s ({check_s / validation_s:.2f}x the final validation)")
    for runtime in check.bf16_dice if check else ():
        print(check.describe(runtime))
    print(f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")


if __name__ == "__main__":
    main()
