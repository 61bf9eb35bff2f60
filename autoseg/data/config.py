"""Which training data pipeline the trainer builds from the plan: patch, dummy 2D, precomputed copies, workers.

- Dummy 2D: a 3D patch much thinner along z than in-plane (``max(patch) / patch[0] > DUMMY_2D_ANISOTROPY``,
  nnU-Net's rule and threshold) is rotated and scaled in-plane only, slice by slice; rotating such a patch
  out of plane would mix slices several millimetres apart.
- Precomputed copies: with ``autoseg plan_and_preprocess --precompute-augmentations K`` every case has K
  spatially augmented copies; the trainer samples them (no rotation/scaling on the fly) when every training
  case has at least one.
- Workers: the configuration's planned ``loader_workers``, each holding up to ``loader_queue_depth``
  finished batches (both sized by the plan's host RAM budget and CPU count); ``RunConfig`` may override the
  worker count.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

__all__ = ["precomputed_copies"]


def precomputed_copies(folder: Path, case_ids: Sequence[str]) -> int:
    """The fewest precomputed augmented copies any of ``case_ids`` has in ``folder`` (0: some case has none)."""
    fewest = None
    for case_id in case_ids:
        path = folder / f"{case_id}.json"
        try:
            copies = len(json.loads(path.read_text()).get("augmentations") or ())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: cannot read the case properties ({e}); re-run plan_and_preprocess") from e
        fewest = copies if fewest is None else min(fewest, copies)
    return fewest or 0
