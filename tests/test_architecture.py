"""docs/architecture.md stays true: each claim it makes that code can check is checked here.

- The module map names every module, and every module it names exists.
- Each name a row quotes in backticks (a class, a function, a private attribute) is in that
  module's source, so a rename or a move shows up as a stale row.
- The paths, `module.py:Name` references and commands in the prose exist.
- `runners/` never imports typer or rich; `cli/engine.py` is the one place in `cli/` runners
  are made; `typecheck/llmrun/` links the installed names to the two folders.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from llmrun.cli import app as app_module

ROOT = Path(__file__).resolve().parent.parent
PAGE = (ROOT / "docs" / "architecture.md").read_text()
ROWS = re.findall(r"^\| `((?:cli|runners)/[^`]+\.py)` \| (.*) \|$", PAGE, re.M)
IDENTIFIER = re.compile(r"^[A-Za-z_][\w.]*(\(.*\))?$")


def _modules() -> list[str]:
    return sorted(
        str(p.relative_to(ROOT))
        for folder in ("cli", "runners")
        for p in (ROOT / folder).rglob("*.py")
        if p.name != "__init__.py" or p.parent.name not in ("cli", "runners")
    )


def test_every_module_is_on_the_map() -> None:
    missing = [m for m in _modules() if f"`{m}`" not in PAGE]
    assert not missing, f"docs/architecture.md does not name {missing}"


def test_every_row_is_a_module() -> None:
    assert len(ROWS) >= 90
    gone = [m for m, _ in ROWS if not (ROOT / m).is_file()]
    assert not gone, f"docs/architecture.md maps modules that are gone: {gone}"
    names = [m for m, _ in ROWS]
    assert len(names) == len(set(names)), "a module has two rows"


@pytest.mark.parametrize(("module", "text"), ROWS, ids=[m for m, _ in ROWS])
def test_each_name_a_row_quotes_is_in_its_module(module: str, text: str) -> None:
    source = (ROOT / module).read_text()
    for quoted in re.findall(r"`([^`]+)`", text):
        if quoted in app_module.COMMANDS:
            continue  # a command of its own, checked by test_the_commands_it_names_exist
        if quoted.startswith("-") or not IDENTIFIER.match(quoted) or quoted.endswith(".py"):
            continue  # an option, a command line or a list syntax, not a name in the code
        name = quoted.split("(")[0].rsplit(".", 1)[-1]
        assert re.search(rf"\b{re.escape(name)}\b", source), f"{module}: `{quoted}` not in it"


def test_the_prose_names_files_and_names_that_exist() -> None:
    prose = PAGE.split("## Module map")[0]
    for quoted in re.findall(r"`([^`\s]+)`", prose):
        path, _, name = quoted.partition(":")
        if not path.endswith(".py") and not path.endswith("/"):
            continue
        found = [
            p for p in (ROOT / path, ROOT / "cli" / path, ROOT / "runners" / path) if p.exists()
        ]
        found += list(ROOT.glob(f"*/*/{path}")) + list(ROOT.glob(f"*/{path}"))
        assert found, f"docs/architecture.md names {path}, which is not there"
        if name:
            assert any(re.search(rf"\b(class|def) {name}\b", p.read_text()) for p in found), (
                f"{quoted}: no {name} in {path}"
            )


def test_the_commands_it_names_exist() -> None:
    for command in re.findall(r"`llmrun (\w+)", PAGE):
        assert command in app_module.COMMANDS, f"`llmrun {command}` is not a command"


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module.split(".")[0])
    return out


def test_runners_never_touch_the_terminal() -> None:
    """No terminal library, no print() and no sys.stdout/sys.stderr in runners/: what a person
    is told goes through a hook the CLI sets (files.on_writer_wait, library.on_abort)."""
    for path in (ROOT / "runners").rglob("*.py"):
        assert not _imports(path) & {"typer", "rich", "click"}, path
        for node in ast.walk(ast.parse(path.read_text())):
            name = path.relative_to(ROOT)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id != "print", f"{name}:{node.lineno} prints"
            if (  # os.write(2, …): llama.cpp's log under bench -v went to stderr that way
                isinstance(node, ast.Call)
                and ast.unparse(node.func) == "os.write"
                and ast.unparse(node.args[0]) in ("1", "2")
                and str(name) != "runners/library.py"  # its default for an abort, before exit
            ):
                raise AssertionError(f"{name}:{node.lineno} writes to a standard stream")
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                named = f"{node.value.id}.{node.attr}"
                if str(name) == "runners/library.py":
                    continue  # it flushes what the CLI wrote before llama.cpp's abort ends all
                assert named not in ("sys.stdout", "sys.stderr"), f"{name}:{node.lineno} {named}"


def test_cli_engine_is_the_one_place_runners_are_made() -> None:
    made = ("LlamaCppRunner", "OpenAIRunner")
    for path in (ROOT / "cli").rglob("*.py"):
        if path.name == "engine.py" and path.parent.name == "cli":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in made, f"{path.relative_to(ROOT)} makes {node.func.id}"


def test_typecheck_links_name_the_two_folders() -> None:
    for name in ("cli", "runners"):
        link = ROOT / "typecheck" / "llmrun" / name
        assert link.is_symlink() and link.resolve() == (ROOT / name).resolve()
