"""Every command line in the README and in docs/ parses as shown, and the docs stay in step
with the code: every module is on the architecture page's map, every link points at a file."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest
import typer

from llmrun.cli.app import app

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# `llmrun …` up to a shell operator or a comment, at a line's start, after a pipe or `&&`, or
# after `NAME=value` assignments.
_LINE = re.compile(r"(?:^|[|&;]\s*|^(?:[A-Z_]+=\S+\s+)+)(?:\.venv/bin/)?llmrun\s+(.*)")


def _strip_shell(rest: str) -> str:
    """The arguments alone: no trailing comment, pipe, redirection or `&&`."""
    out, quote = [], ""
    for i, ch in enumerate(rest):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or rest[i - 1].isspace()):
            break
        elif ch in "|;<" or (ch == ">" and not rest[i - 1 : i] == "2") or rest[i : i + 2] == "&&":
            break
        elif rest[i : i + 2] == "2>":
            break
        out.append(ch)
    return "".join(out).strip()


def command_lines(text: str) -> list[str]:
    """The llmrun command lines of a page: in code blocks, and in inline code spans."""
    found: list[str] = []
    in_block = False
    for line in text.splitlines():
        if line.startswith("```"):
            in_block = not in_block
            continue
        if in_block:
            m = _LINE.search(line.strip())
            if m:
                found.append(_strip_shell(m.group(1)))
            continue
        for span in re.findall(r"`((?:\.venv/bin/)?llmrun [^`]+)`", line):
            found.append(_strip_shell(span.split("llmrun ", 1)[1]))
    return [f for f in found if f]


def _all_lines() -> list[tuple[str, str]]:
    return [(p.name, line) for p in PAGES for line in command_lines(p.read_text())]


def _parse(args: list[str]) -> None:
    """Parse (and convert) the arguments as the real command would, without running it."""
    group = typer.main.get_command(app)
    ctx = group.make_context("llmrun", list(args), resilient_parsing=False)
    command: click.Command = group
    while isinstance(command, click.Group):
        rest = [*ctx.protected_args, *ctx.args]
        if not rest:
            return
        sub = command.get_command(ctx, rest[0])
        if sub is None:
            raise click.UsageError(f"no command {rest[0]!r}")
        command = sub
        ctx = sub.make_context(rest[0], rest[1:], parent=ctx)


def test_the_pages_have_command_lines() -> None:
    lines = _all_lines()
    assert len(lines) >= 40
    commands = {line.split()[0] for _, line in lines if line[:1] != "-"}
    assert {"run", "chat", "bench", "tune", "serve", "history", "pull", "models"} <= commands


@pytest.mark.parametrize(("page", "line"), _all_lines())
def test_every_command_line_parses(page: str, line: str) -> None:
    args = shlex.split(line)
    if args in (["--help"], ["-h"]) or args[-1:] == ["--help"]:
        return
    try:
        _parse(args)
    except click.BadParameter as e:
        # Files the example names (`-f notes.txt`) need not exist here; every other value must
        # convert as the command converts it.
        if "does not exist" not in e.format_message():
            raise AssertionError(f"{page}: llmrun {line}: {e.format_message()}") from e
    except click.ClickException as e:
        raise AssertionError(f"{page}: llmrun {line}: {e.format_message()}") from e


def test_the_parser_check_can_fail() -> None:
    """A misspelt flag and a flag of another command are caught (the check above is real)."""
    for bad in (["run", "--no-such-flag"], ["bench", "--policy", "chunked:64"], ["tune", "-p", "8"]):
        with pytest.raises(click.ClickException):
            _parse(bad)


def test_every_module_is_on_the_architecture_map() -> None:
    page = (ROOT / "docs" / "architecture.md").read_text()
    modules = sorted(
        str(p.relative_to(ROOT))
        for folder in ("cli", "runners")
        for p in (ROOT / folder).rglob("*.py")
        if p.name != "__init__.py" or p.parent.name not in ("cli", "runners")
    )
    missing = [m for m in modules if f"`{m}`" not in page]
    assert not missing, f"docs/architecture.md does not name {missing}"


def test_every_link_points_at_a_file() -> None:
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            assert (page.parent / target).exists(), f"{page.name}: {target}"


def test_the_readme_is_a_front_door() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 160
    assert "make demo" in text and "make test" in text
    assert "docs/dashboard.svg" in text and (ROOT / "docs" / "dashboard.svg").exists()
