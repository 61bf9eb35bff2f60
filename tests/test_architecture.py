"""The package layout's rules, enforced: imports point one way, one training step, each package says what it owns."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "autoseg"


def test_packages_import_only_the_layers_below_them() -> None:
    """pyproject.toml's [tool.importlinter] layers contract (cli > demo > explain > train > predict | evaluate >
    data > preprocess > plan > memory > model > dataset > core), checked on the installed sources."""
    # in a process of its own: import-linter reconfigures logging, which would silence autoseg's log in later tests
    config = str(ROOT / "pyproject.toml")
    code = f"import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports({config!r}, no_cache=True))"
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}  # its report draws boxes; the locale may be plain C
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, encoding="utf-8", errors="replace", cwd=ROOT, env=env
    )
    assert result.returncode == 0, f"an import breaks the layers:\n{result.stdout[-3000:]}"


def _calls_backward(path: Path) -> bool:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "backward"
        for n in ast.walk(tree)
    )


def test_only_the_training_step_runs_a_backward_pass() -> None:
    """THE training step (autoseg.model.step.TrainStep) is the one code path that trains; the memory model and
    the throughput calibration run it instead of a copy."""
    callers = sorted(str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py") if _calls_backward(p))
    assert callers == ["autoseg/model/step.py"]


@pytest.mark.parametrize("package", sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py")))
def test_every_package_says_what_it_owns_and_may_import(package: str) -> None:
    """The __init__ docstring names every module of the package under "Owns:" and says what it may import; the
    __init__ itself imports nothing (a worker importing one module must not load the package's others)."""
    source = (PACKAGE / package / "__init__.py").read_text(encoding="utf-8")
    doc = ast.get_docstring(ast.parse(source)) or ""
    owns, _, imports = doc.partition("Owns:")[2].partition("Imports:")
    modules = sorted(p.stem for p in (PACKAGE / package).glob("*.py") if p.stem != "__init__")
    assert imports.strip(), f"autoseg/{package}/__init__.py: say what the package may import"
    assert [m for m in modules if f"``{m}``" not in owns] == [], f"autoseg/{package}/__init__.py: name its modules"
    assert not any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in ast.parse(source).body)


@pytest.mark.parametrize("check", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_the_tree_is_lint_clean_and_formatted(check: list[str]) -> None:
    """``ruff check`` and ``ruff format --check`` over the whole tree (pyproject.toml's [tool.ruff]), so a
    hand-wrapped signature or an unused import fails the suite instead of a review."""
    result = subprocess.run([sys.executable, "-m", "ruff", *check, "."], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, f"ruff {' '.join(check)} .:\n{result.stdout[-3000:]}{result.stderr[-1000:]}"
