from __future__ import annotations

import sys

import pytest

from autoseg.core.errors import InputError
from autoseg.core.extras import installed, require


def test_a_missing_extra_is_an_error_naming_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnx", None)  # as if not installed: import raises ImportError
    with pytest.raises(InputError, match=r'ONNX graphs.*\'onnx\'.*pip install "autoseg\[onnx\]"'):
        require("onnx", "onnx", "ONNX graphs")
    assert not installed("onnx")


def test_an_installed_module_is_returned():
    assert require("json", "none", "reading JSON").dumps(1) == "1"
    assert installed("json")
    assert not installed("autoseg_no_such_module")
