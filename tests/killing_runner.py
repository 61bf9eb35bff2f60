"""A preprocessing case runner whose worker dies like one the OOM killer takes (SIGKILL) on one case.

A module of its own, light to import: spawned workers import it to unpickle the runner.
"""

from __future__ import annotations

import os
import signal

from autoseg.preprocess.preprocessor import CaseResult, CaseTask, run_case

VICTIM = "demo_001"


def die_on_victim(task: CaseTask) -> CaseResult:
    if task.case.case_id == VICTIM:
        os.kill(os.getpid(), signal.SIGKILL)
    return run_case(task)
