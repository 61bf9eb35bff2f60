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


# Functions allowed more than 8 parameters, each with its reason (qualified name: reason).
MANY_PARAMETERS: dict[str, str] = {}


def _parameter_counts() -> dict[str, int]:
    counts = {}
    for path in sorted([*PACKAGE.rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                child.parent = node  # type: ignore[attr-defined]
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args
                names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
                names += [a.arg for a in (args.vararg, args.kwarg) if a is not None]
                if isinstance(getattr(node, "parent", None), ast.ClassDef) and names[:1] in (["self"], ["cls"]):
                    names = names[1:]
                owner = getattr(node, "parent", None)
                qualified = (
                    f"{module}.{owner.name}.{node.name}" if isinstance(owner, ast.ClassDef) else f"{module}.{node.name}"
                )
                counts[qualified] = len(names)
    return counts


def test_no_function_takes_more_than_8_parameters() -> None:
    """At most 8 parameters in autoseg/ and benchmarks/ (``*args`` and ``**kwargs`` count, ``self``/``cls`` do not;
    dataclass constructors are generated, so they are not counted): settings that travel together are one typed
    options object. The exceptions are named in MANY_PARAMETERS with their reason, and an exception that no longer
    needs it is removed from the list."""
    counts = _parameter_counts()
    over = {name: n for name, n in counts.items() if n > 8 and name not in MANY_PARAMETERS}
    assert over == {}, f"more than 8 parameters (split along a seam, e.g. an options object): {over}"
    stale = [name for name in MANY_PARAMETERS if counts.get(name, 0) <= 8]
    assert stale == [], f"MANY_PARAMETERS names functions that no longer need it: {stale}"
