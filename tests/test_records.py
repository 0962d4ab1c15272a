"""Option records: a command parameter typed with a record becomes the record's options in
Typer's eyes, and comes back to the command as the record, nested records included."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Annotated

import pytest
import typer
from typer.testing import CliRunner

from llmrun.cli.records import OptionRecord, takes_records


@dataclass(frozen=True, kw_only=True)
class Inner(OptionRecord):
    count: Annotated[int, typer.Option("-n", "--count", min=1)] = 1


@dataclass(frozen=True, kw_only=True)
class Outer(OptionRecord):
    name: Annotated[str, typer.Option("--name")] = "x"
    inner: Inner


@dataclass(frozen=True, kw_only=True)
class Clashing(OptionRecord):
    count: Annotated[int, typer.Option("--other-count")] = 2


def test_a_record_parameter_becomes_its_options_and_comes_back_built() -> None:
    seen: list[tuple[bool, Outer]] = []

    @takes_records
    def command(flag: Annotated[bool, typer.Option("--flag")] = False, *, outer: Outer) -> None:
        seen.append((flag, outer))

    assert list(inspect.signature(command).parameters) == ["flag", "name", "count"]
    app = typer.Typer()
    app.command()(command)
    result = CliRunner().invoke(app, ["--name", "y", "-n", "3"])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(app, ["--flag"])
    assert result.exit_code == 0, result.output
    assert seen == [(False, Outer(name="y", inner=Inner(count=3))), (True, Outer(inner=Inner()))]
    refused = CliRunner().invoke(app, ["-n", "0"])  # the field's declared range holds
    assert refused.exit_code == 2


def test_an_option_declared_twice_in_one_command_is_refused() -> None:
    def command(*, outer: Outer, clashing: Clashing) -> None:
        del outer, clashing

    with pytest.raises(TypeError, match="declared twice: count"):
        takes_records(command)
