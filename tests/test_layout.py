"""Commands are leaves: a command module imports shared modules, never another command, so that
what two commands share has a home of its own (and one command's change cannot break another's
start-up). Imports inside functions count too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from .conftest import ROOT

COMMANDS = (
    "cli/run.py",
    "cli/chat.py",
    "cli/serve.py",
    "cli/history.py",
    "cli/models.py",
    "cli/doctor.py",
    "cli/bench/sweep.py",
    "cli/bench/serve.py",
    "cli/bench/interference.py",
    "cli/bench/tune.py",
)


def _module(path: str) -> str:
    """`cli/bench/serve.py` -> `llmrun.cli.bench.serve`."""
    return "llmrun." + path.removesuffix(".py").replace("/", ".")


def imported(path: Path, name: str) -> set[str]:
    """Every module `path` (module `name`) imports, by its absolute name: for `from x import y`
    both `x` and `x.y` (y may be a module)."""
    package = name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def command_imports(path: str) -> list[str]:
    """The other command modules that the command module `path` imports."""
    name = _module(path)
    others = {_module(p) for p in COMMANDS} - {name}
    return sorted(imported(ROOT / path, name) & others)


@pytest.mark.parametrize("path", COMMANDS)
def test_no_command_module_imports_another(path: str) -> None:
    assert command_imports(path) == [], f"{path} imports another command module"


def test_the_check_sees_relative_absolute_and_late_imports(tmp_path: Path) -> None:
    """The check must fail on each way a command could import another one."""
    for source in (
        "from .serve import connect\n",
        "from . import serve\n",
        "from llmrun.cli.bench.serve import Server\n",
        "import llmrun.cli.bench.serve\n",
        "def f():\n    from ..doctor import version_line\n",
    ):
        module = tmp_path / "interference.py"
        module.write_text(source, encoding="utf-8")
        found = imported(module, "llmrun.cli.bench.interference")
        assert found & {"llmrun.cli.bench.serve", "llmrun.cli.doctor"}, source


def test_runners_serving_options_does_not_reach_into_bench() -> None:
    """The serving options parse lists with the shared list syntax, not bench's sweep module."""
    path = "runners/serving/options.py"
    found = imported(ROOT / path, _module(path))
    assert not any(m.startswith("llmrun.runners.bench") for m in found), found
