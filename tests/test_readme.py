"""The README's commands and flags exist as shown."""

from __future__ import annotations

import re
from pathlib import Path

from typer.testing import CliRunner

from llmrun.cli.app import app

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


COMMANDS = ("run", "chat", "bench", "tune", "history", "pull", "models")
SUBCOMMANDS = (["bench", "serve"], ["bench", "interference"])


def llmrun_text() -> str:
    """The README's llmrun command lines and the first cells of its option tables."""
    lines = [ln for ln in README.splitlines() if ln.startswith("llmrun ")]
    lines += [ln.split("|")[1] for ln in README.splitlines() if ln.startswith("| `")]
    return "\n".join(lines)


def test_every_flag_in_the_readme_is_accepted_by_a_command() -> None:
    help_text = "".join(
        CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "300"}).stdout
        for command in [[c] for c in COMMANDS] + list(SUBCOMMANDS)
    )
    flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z-]+|-[a-z]{1,3})\b", llmrun_text()))
    assert {"--endpoint", "--concurrency", "--prompt-len", "--no-dashboard", "--jsonl"} <= flags
    for flag in sorted(flags):
        if not flag.startswith("--"):
            assert re.search(rf"[\s,]{flag}[\s,]", help_text), flag  # aliases: -hf,-hfr
        else:
            assert flag in help_text, flag


def test_every_command_in_the_readme_exists() -> None:
    commands = set(re.findall(r"^llmrun (\w+)", README, flags=re.MULTILINE))
    assert commands >= set(COMMANDS)
    for command in commands:
        assert CliRunner().invoke(app, [command, "--help"]).exit_code == 0, command
