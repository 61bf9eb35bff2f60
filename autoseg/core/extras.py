"""Optional extras: the one owner of "this needs a package the plain install leaves out".

autoseg's plain install carries torch and what every stage needs; a capability with heavy dependencies (ONNX
graphs, other runtimes) is an extra of pyproject.toml (``pip install "autoseg[onnx]"``). Its modules are imported
inside the functions that use them, through ``require``, so the plain install imports none of them and asking for a
missing one is one clear error naming the extra.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType

from autoseg.core.errors import InputError

# What can run a network's tiles (``autoseg predict --runtime``) -> (the module it imports, the extra installing it);
# all but torch run an ONNX graph on the CPU
RUNTIMES: dict[str, tuple[str, str]] = {
    "torch": ("torch", ""),
    "onnxruntime": ("onnxruntime", "onnx"),
    "openvino": ("openvino", "openvino"),
}


def require(module: str, extra: str, what: str) -> ModuleType:
    """The module ``module`` imported, for ``what`` (e.g. "ONNX graphs in the model archive"); if it is not
    installed, an ``InputError`` naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise InputError(
            f"{what} needs the Python package {module!r}, which is not installed ({e}); install it with "
            f'`pip install "autoseg[{extra}]"`'
        ) from e


def installed(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it (a module blocked in ``sys.modules`` is not)."""
    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
