"""Tests of an optional extra (ONNX, ONNX Runtime, OpenVINO): ``require_extra`` skips such a test where the extra is
not installed, except in CI (``.ci/run`` sets ``AUTOSEG_REQUIRE_EXTRAS``, and installs every extra), where a missing
extra fails the test instead of hiding it."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

REQUIRED = "AUTOSEG_REQUIRE_EXTRAS"  # set: every extra must be importable


def require_extra(module: str) -> ModuleType:
    """``module`` imported; skipped when it is not installed, unless ``REQUIRED`` is set (then the ImportError)."""
    if os.environ.get(REQUIRED):
        return importlib.import_module(module)
    return pytest.importorskip(module)
