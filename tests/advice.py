"""The commands a message advises (each backticked `autoseg ...`), checked as a user would run them: parsed by the
CLI's own parser (``autoseg.cli.parser.parse_args``) and validated against the workspace the message was printed
for: its workspace flag, its folds (splits.json's, or ``NUM_FOLDS`` before there is one) and its configuration
names (plans.json's). ``advice_templates`` finds every such command written in autoseg's source, so that a test can
hold each against a message really printed."""

from __future__ import annotations

import argparse
import ast
import re
import shlex
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from autoseg.cli.parser import build_parser, parse_args
from autoseg.core.workspace import NUM_FOLDS, Splits, Workspace
from autoseg.plan.plans import Plans

ADVICE = re.compile(r"`(autoseg [^`]*)`")
# In the source, an advice is also written as a call of ``Workspace.advice`` inside backticks.
WRITTEN_ADVICE = re.compile(r"`(autoseg [^`]*|\{[^`{}]*\badvice\([^`]*\)\})`")
# Words a message writes for what only the user knows; each is replaced by a value of the test's before parsing.
PLACEHOLDERS = ("DATASET", "INPUT", "OUTPUT", "WORKSPACE", "K", "N", "MODEL")
SOURCE = Path(__file__).resolve().parents[1] / "autoseg"


@dataclass(frozen=True)
class Template:
    """One advised command as written in the source: f-string fields as ``{...}``."""

    module: str  # path relative to the repository, e.g. autoseg/core/workspace.py
    line: int
    text: str  # e.g. "autoseg train fold {fold} -c {stage} -w {workspace.root}"

    @property
    def is_templated(self) -> bool:
        """Whether the command depends on what the message is about (a field fills it in)."""
        return "{" in self.text

    def matches(self, command: str) -> bool:
        literal = re.split(r"\{[^}]*\}", self.text)
        return re.fullmatch(".+?".join(map(re.escape, literal)), command) is not None


def advised_commands(message: str) -> list[str]:
    """Every backticked `autoseg ...` of ``message``, without the backticks."""
    return ADVICE.findall(message)


def parse_advice(command: str, values: Mapping[str, str | Path] | None = None) -> argparse.Namespace:
    """``command`` parsed as the CLI parses it, each placeholder replaced by ``values``' value for it; an
    ``AssertionError`` names the command when the parser refuses it or a placeholder has no value."""
    tokens = shlex.split(command)
    assert tokens[0] == "autoseg", command
    unknown = [t for t in tokens if re.fullmatch("[A-Z][A-Z_]*", t) and t not in (values or {})]
    assert not unknown, f"`{command}`: placeholder(s) {unknown} without a value (known: {PLACEHOLDERS})"
    argv = [str((values or {}).get(t, t)) for t in tokens[1:]]
    try:
        return parse_args(argv)
    except SystemExit as e:
        raise AssertionError(f"`{command}` does not parse (exit {e.code})") from e


def check_against_workspace(command: str, args: argparse.Namespace, workspace_root: Path) -> None:
    """``args`` (parsed ``command``) fit the workspace: its ``-w`` names it, its folds are the splits' and its
    configurations are planned."""
    ws = Workspace.at(workspace_root)
    tokens = shlex.split(command)
    # `predict -m` reads an archive, not a workspace; `-w WORKSPACE` is one on another machine
    if "workspace" in args and not getattr(args, "model", None) and "WORKSPACE" not in tokens:
        given = Path(args.workspace or ".").resolve()
        assert given == ws.root.resolve(), f"`{command}`: -w {given}, but the message was about {ws.root}"
    plans = Plans.from_json(ws.plans_path) if ws.plans_path.is_file() else None
    names = list(args.configs or []) if "configs" in args else [args.config] if "config" in args else []
    for name in filter(None, names):
        assert plans is not None and name in plans.configurations, f"`{command}`: {name!r} is not planned"
    folds = args.folds if args.command == "train" else args.folds if "folds" in args else None
    if folds:
        count = len(Splits.from_json(ws.splits_path).folds) if ws.splits_path.is_file() else NUM_FOLDS
        wrong = [f for f in folds if f != "all" and not 0 <= int(f) < count]
        assert not wrong, f"`{command}`: fold(s) {wrong} do not exist ({count} folds in {ws.root})"
    if args.command in ("plan", "plan_and_preprocess") and "DATASET" not in tokens:
        dataset = Path(args.dataset)
        assert (dataset / "dataset.json").is_file(), f"`{command}`: {dataset} is not a dataset"


def check_advice(
    message: str, workspace_root: Path, values: Mapping[str, str | Path] | None = None
) -> list[argparse.Namespace]:
    """Every command ``message`` advises, parsed and checked against ``workspace_root``; at least one."""
    commands = advised_commands(message)
    assert commands, f"no `autoseg ...` advice in:\n{message}"
    parsed = []
    for command in commands:
        args = parse_advice(command, values)
        check_against_workspace(command, args, workspace_root)
        parsed.append(args)
    return parsed


def advice_templates(source: Path = SOURCE) -> Iterator[Template]:
    """Every `autoseg ...` (or `{....advice(...)}`) written in a string of autoseg's code (docstrings left out:
    they describe, not advise), f-string fields as ``{...}``."""
    for path in sorted(source.rglob("*.py")):
        tree = ast.parse(path.read_text())
        skipped = _docstrings(tree) | {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.JoinedStr):
                text = "".join(
                    v.value if isinstance(v, ast.Constant) else "{" + ast.unparse(v.value) + "}" for v in node.values
                )
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value
            else:
                continue
            module = str(path.relative_to(source.parent))
            yield from (Template(module, node.lineno, m) for m in WRITTEN_ADVICE.findall(text))


def _docstrings(tree: ast.Module) -> set[int]:
    kinds = (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, kinds)
        and n.body
        and isinstance(n.body[0], ast.Expr)
        and isinstance(n.body[0].value, ast.Constant)
    }


def command_parsers() -> dict[str, argparse.ArgumentParser]:
    """The CLI's commands, as its parser knows them, each with its own parser (its flags)."""
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)
