"""Every command line in the README and in docs/ parses as shown, and every link points at a
file (the architecture page's claims: tests/test_architecture.py)."""

from __future__ import annotations

import functools
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import typer

from llmrun.cli.app import app

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# `llmrun …` up to a shell operator or a comment, at a line's start, after a pipe or `&&`, or
# after `NAME=value` assignments.
INLINE = "\0"  # marks a command named in prose: its options must exist, values may be left out
_LINE = re.compile(r"(?:^|[|&;]\s*|^(?:[A-Z_]+=\S+\s+)+)(?:\.venv/bin/)?llmrun\s+(.*)")


def _strip_shell(rest: str) -> str:
    """The arguments alone: no trailing comment, pipe, redirection or `&&`."""
    out, quote = [], ""
    for i, ch in enumerate(rest):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif (
            (ch == "#" and (i == 0 or rest[i - 1].isspace()))
            or ch in "|;<>"
            or rest[i : i + 2] in ("&&", "2>")
        ):
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
            found.append(INLINE + _strip_shell(span.split("llmrun ", 1)[1]))
    return [f for f in found if f]


def _all_lines() -> list[tuple[str, str]]:
    return [(p.name, line) for p in PAGES for line in command_lines(p.read_text())]


class ParseError(Exception):
    """The arguments do not parse (Typer vendors its own Click, whose errors are caught here by
    their shape: a `format_message`)."""


def _check_no_hidden(ctx: Any) -> None:
    """A hidden option is an old spelling that only names its new command: not for the docs."""
    for param in ctx.command.params:
        source = ctx.get_parameter_source(param.name or "")
        if getattr(param, "hidden", False) and getattr(source, "name", "") == "COMMANDLINE":
            raise ParseError(f"{param.opts[0]} is an old spelling")


@functools.cache
def _command() -> Any:
    """llmrun's Click command tree, built once: Typer builds it anew on each call (50 ms)."""
    return typer.main.get_command(app)


def _parse(args: list[str]) -> None:
    """Parse (and convert) the arguments as the real command would, without running it."""
    try:
        command: Any = _command()
        ctx = command.make_context("llmrun", list(args), resilient_parsing=False)
        while True:
            _check_no_hidden(ctx)
            rest = [*getattr(ctx, "_protected_args", []), *ctx.args]
            if not hasattr(command, "get_command") or not rest:
                return
            sub = command.get_command(ctx, rest[0])
            if sub is None:
                raise ParseError(f"no command {rest[0]!r}")
            command = sub
            ctx = sub.make_context(rest[0], rest[1:], parent=ctx)
    except ParseError:
        raise
    except typer.Exit as e:  # an option's own callback: an old spelling says where it went
        if e.exit_code:
            raise ParseError(f"exit {e.exit_code}") from e
    except Exception as e:
        if not hasattr(e, "format_message"):
            raise
        message = e.format_message()
        # Files the example names (`-f notes.txt`) need not exist here; every other value must
        # convert as the command converts it.
        if type(e).__name__ == "BadParameter" and "does not exist" in message:
            return
        raise ParseError(message) from e


def test_the_pages_have_command_lines() -> None:
    lines = _all_lines()
    assert len(lines) >= 40
    commands = {
        line.lstrip(INLINE).split()[0] for _, line in lines if line.lstrip(INLINE)[:1] != "-"
    }
    assert {"run", "chat", "bench", "tune", "serve", "history", "pull", "models"} <= commands


@pytest.mark.parametrize(("page", "line"), _all_lines())
def test_every_command_line_parses(page: str, line: str) -> None:
    inline = line.startswith(INLINE)
    args = shlex.split(line.lstrip(INLINE))
    if args in (["--help"], ["-h"]) or args[-1:] == ["--help"]:
        return
    try:
        _parse(args)
    except ParseError as e:
        message = str(e)
        if inline and ("requires an argument" in message or "Missing argument" in message):
            return  # `llmrun pull` or `llmrun run --endpoint` in a sentence names, not runs
        raise AssertionError(f"{page}: llmrun {line}: {e}") from e


def test_the_parser_check_can_fail() -> None:
    """A misspelt flag and a flag of another command are caught (the check above is real)."""
    for bad in (
        ["run", "--no-such-flag"],
        ["bench", "--policy", "chunked:64"],
        ["tune", "-p", "8"],
    ):
        with pytest.raises(ParseError):
            _parse(bad)


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
