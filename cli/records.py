"""Option records: frozen dataclasses whose fields carry their Typer declaration, so that an
option is declared once and every command that takes it reads it as a typed field.

A command parameter annotated with a record type is expanded by `@takes_records` into one
Typer parameter per field (Typer reads the signature through `inspect.signature`, which
honours `__signature__`), and the record is built from them before the command runs: the body
reads `sampling.temp`, and a renamed field is a mypy error wherever it is read. The anchor is
llama-cpp-python's server, whose command line is generated from its pydantic settings
(`add_args_from_model`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable
from typing import Any, ClassVar, ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


class OptionRecord:
    """Base of the option records: a frozen, keyword-only dataclass whose fields' types are
    `Annotated[T, typer.Option(...)]` (or other records) and whose defaults are the options'."""

    __dataclass_fields__: ClassVar[dict[str, Any]]

    @classmethod
    def parameters(cls) -> list[inspect.Parameter]:
        """The Typer parameters of the record's fields, in their order; a field that is a
        record itself gives its own fields in its place."""
        hints = typing.get_type_hints(cls, include_extras=True)
        found: list[inspect.Parameter] = []
        for f in dataclasses.fields(cls):
            inner = _record_type(hints[f.name])
            if inner is not None:
                found += inner.parameters()
                continue
            kind = inspect.Parameter.KEYWORD_ONLY
            found.append(
                inspect.Parameter(f.name, kind, default=f.default, annotation=hints[f.name])
            )
        return found

    @classmethod
    def build(cls, given: dict[str, Any]) -> OptionRecord:
        """The record of the values in `given` (Typer's, by parameter name), taken out of it."""
        hints = typing.get_type_hints(cls, include_extras=True)
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            inner = _record_type(hints[f.name])
            values[f.name] = given.pop(f.name) if inner is None else inner.build(given)
        return cls(**values)


def _record_type(annotation: object) -> type[OptionRecord] | None:
    if isinstance(annotation, type) and issubclass(annotation, OptionRecord):
        return annotation
    return None


def takes_records(command: Callable[P, R]) -> Callable[..., R]:
    """The command with each parameter typed as an `OptionRecord` replaced by the record's
    fields, for Typer; called, it builds the records from those fields and passes them on."""
    signature = inspect.signature(command, eval_str=True)
    parameters: list[inspect.Parameter] = []
    records: dict[str, type[OptionRecord]] = {}
    for p in signature.parameters.values():
        record = _record_type(p.annotation)
        if record is None:
            parameters.append(p.replace(kind=inspect.Parameter.KEYWORD_ONLY))
            continue
        records[p.name] = record
        parameters += record.parameters()
    names = [p.name for p in parameters]
    clash = sorted({n for n in names if names.count(n) > 1})
    if clash:
        raise TypeError(f"{command.__qualname__}: options declared twice: {', '.join(clash)}")

    @functools.wraps(command)
    def wrapper(**given: Any) -> R:
        for name, record in records.items():
            given[name] = record.build(given)
        return command(**given)  # type: ignore[call-arg]

    wrapper.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {
        **{p.name: p.annotation for p in parameters},
        "return": signature.return_annotation,
    }
    return wrapper
