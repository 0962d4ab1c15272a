"""Wires the commands together; each command lives in its own module, imported when it runs.

`llmrun --help` lists the commands from SUMMARIES without importing any of them (a test keeps
each line equal to its command's own help), and `--version` needs none either: a command's
module, and whatever heavy library it imports, loads only when that command is resolved.
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import math
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import typer
import typer.core
import typer.main

import llmrun.cli
from llmrun.runners.errors import shown_short
from llmrun.runners.lists import MAX_DIGITS, integer, real

BENCH_HELP = "Measure this machine: llama-bench's tests and sweeps, serving load, interference."

# Each command: the module and function that implement it, in the order `--help` lists them.
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("llmrun.cli.run", "run"),
    "chat": ("llmrun.cli.chat", "chat"),
    "tune": ("llmrun.cli.bench.tune", "tune"),
    "history": ("llmrun.cli.history", "history"),
    "pull": ("llmrun.cli.models", "pull"),
    "models": ("llmrun.cli.models", "models"),
    "serve": ("llmrun.cli.serve", "serve"),
    "rpc-server": ("llmrun.cli.rpc_server", "rpc_server"),
    "doctor": ("llmrun.cli.doctor", "doctor"),
    "bench": ("llmrun.cli.bench.sweep", "bench"),
}

# The first paragraph of each command's help, line breaks included, as `llmrun --help` lists it
# (tests/test_startup.py checks each against the command itself).
SUMMARIES: dict[str, str] = {
    "run": "Generate text for a prompt and report load, prefill and decode separately.",
    "chat": "Chat with a model; each turn prefills only what is new since the last one.",
    "tune": (
        "Search threads, flash attention, repacking, batch/ubatch and prefill threads for this "
        "model; save the fastest for each --workload as the defaults of run, chat and bench."
    ),
    "history": (
        "The stored bench runs, newest first, each against the run before it; or two sets of "
        "them compared (-b, -c); or the runs exported for llama.cpp's compare-llama-bench.py."
    ),
    "pull": "Download a GGUF model from the Hugging Face Hub into its cache, without running it.",
    "models": "List the embedded default model and the GGUF files in the Hugging Face cache.",
    "serve": "Serve the model over an OpenAI-compatible HTTP API, -np sequences at a time.",
    "rpc-server": "Start llama.cpp's RPC server, for --rpc HOST:PORT on run, chat, serve, bench.",
    "doctor": (
        "Print the build, backend, devices, CPU features, the thread and repacking choices with "
        "their reasons, and whether the machine is busy: paste it into a bug report."
    ),
    "bench": BENCH_HELP,
}


class _FlagsShowNoType:
    """A flag takes no value: its help row shows none (typer shows `<bool>`, which reads as if
    `--raw true` were expected). A set metavar is what an option's row shows in place of its
    type, and a flag's metavar is used nowhere else; so each flag gets an empty one."""

    def get_params(self, ctx: Any) -> Any:
        params: list[Any] = super().get_params(ctx)  # type: ignore[misc]
        for param in params:
            flag = isinstance(param, typer.core.TyperOption) and param.is_flag
            if flag and param.metavar is None:
                param.metavar = ""
        return params


def _refuse_split_flags(command: Any, ctx: Any, args: list[str], names: Any = ()) -> None:
    """A llama.cpp flag of several letters that the command lacks is refused by name before
    Click reads it as short options run together (`-hf` as -h, `-ctk q8_0` as `-c tk`)."""
    from .options import split_flag, split_flag_message

    declared: set[str] = set()
    take_values: set[str] = set()
    for param in command.get_params(ctx):
        if isinstance(param, typer.core.TyperOption):
            declared |= {*param.opts, *param.secondary_opts}
            if not param.is_flag and not param.count:
                take_values |= set(param.opts)
    flag = split_flag(args, declared=declared, take_values=take_values, names=names)
    if flag is not None:
        # ctx.fail: the usage error of the click that typer runs on (its own copy since 0.2x)
        ctx.fail(split_flag_message(flag, ctx.command_path.partition(" ")[2]))


def _refuse_nan_in_ranges(command: Any, ctx: Any) -> None:
    """A number with a range is a number in it: click's range check compares, and NaN compares
    false both ways, so `--temp nan` passed it and failed later, outside the usage error."""
    for param in command.get_params(ctx):
        kind: Any = getattr(param, "type", None)  # (typer 0.29's parameters convert otherwise)
        if getattr(kind, "name", "") != "float range" or param.name not in ctx.params:
            continue
        value = ctx.params[param.name]
        values = value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(v, float) and math.isnan(v) for v in values):
            # click's words for a range: 0.0<=x<=100.0, 0<x
            low = "" if kind.min is None else f"{kind.min}{'<' if kind.min_open else '<='}"
            high = "" if kind.max is None else f"{'<' if kind.max_open else '<='}{kind.max}"
            raise typer.BadParameter(f"nan is not in the range {low}x{high}.", ctx=ctx, param=param)


# click's Path names itself by what it takes: a file, a directory, or either
PATH_KINDS = ("path", "file", "directory")

# What a number of each kind (or a range of it) must be, in words (typer's click said "'2.5' is
# not a valid int range"), and its reader, None where it is none: ASCII digits only, as click's
# int() and float() also read `٣` (Arabic-Indic), fullwidth digits and `1_0`.
_KINDS: dict[str, tuple[str, Callable[[str], object]]] = {
    "int": ("a whole number", integer),  # typer's own click names int so, not "integer"
    "float": ("a number", real),
}


def _plain_conversions(command: Any) -> None:
    """Each option's value is refused in plain words before click converts it:
    - a path given '' names no file: click's Path read it as '.', the working folder, and the
      error came later and named '.' (`run -f ''`: cannot read prompt file .: Is a directory;
      `--stats-file ''`: after the whole run);
    - a number that is none says so: `'2.5' is not a whole number`; one of 400 digits is past
      any value (it was "not a whole number", with every digit echoed);
    - a choice is read in any case, as llmrun's other words are (`-fa ON`, `--policy CHUNKED:8`
      passed; `--energy OFF` and `-o CSV` were refused)."""
    for param in command.params:
        kind: Any = param.type
        name = getattr(kind, "name", "")
        if name == "choice":
            kind.case_sensitive = False
        if name not in PATH_KINDS and name.removesuffix(" range") not in _KINDS:
            continue

        def checked(value: Any, param: Any, ctx: Any, convert: Any = kind.convert) -> Any:
            if isinstance(value, str):
                kind_name = getattr(param.type, "name", "")
                if kind_name in PATH_KINDS and not value.strip():
                    raise typer.BadParameter("an empty path names no file", ctx=ctx, param=param)
                words, read = _KINDS.get(kind_name.removesuffix(" range"), ("", str))
                if read(value) is None:
                    shown = shown_short(value)
                    digits = value.strip().lstrip("+-")
                    if digits.isascii() and digits.isdigit():  # a number, of too many digits
                        raise typer.BadParameter(
                            f"{shown} is past any value it takes ({MAX_DIGITS} digits at most).",
                            ctx=ctx,
                            param=param,
                        )
                    raise typer.BadParameter(f"{shown!r} is not {words}.", ctx=ctx, param=param)
            return convert(value, param, ctx)

        kind.convert = checked


def _begin(command: Any, ctx: Any) -> None:
    """The command's own code begins: note which values came from the environment, have the
    wait for a FIFO's writer said on stderr, and arm the signals (its modules are imported and
    its options parsed)."""
    llmrun.cli.from_environment = frozenset(
        flag
        for param in command.get_params(ctx)
        if getattr(ctx.get_parameter_source(param.name), "name", "") == "ENVIRONMENT"
        for flag in param.opts
    )
    from llmrun.runners import files

    files.on_writer_wait = _say_writer_wait
    llmrun.cli.command_started()


def _say_writer_wait(path: str, flag: str) -> None:
    from .terminal import say, terminal_line

    say(terminal_line(f"llmrun: waiting for a writer on FIFO {path} ({flag}); Ctrl-C to stop"))


@contextlib.contextmanager
def _named(ctx: Any) -> Iterator[None]:
    """A usage error raised while `ctx`'s command line is read knows its command: the parser's
    own (`-n` with no value) came without one, and so without the line's `-h` hint."""
    try:
        yield
    except typer.TyperException as e:
        if getattr(e, "ctx", "") is None:
            e.ctx = ctx  # type: ignore[attr-defined]
        raise


class _HelpOutput:
    """Help on a pipe that closed (`llmrun run -h | head -c1`) ends as a command's output
    does there: quietly, 141 (cli/main.py). rich's answer, inside the help's printing, was to
    exit with 1 in silence (Console.on_broken_pipe, its only SystemExit): it becomes the broken
    pipe it was."""

    def format_help(self, ctx: Any, formatter: Any) -> None:
        try:
            super().format_help(ctx, formatter)  # type: ignore[misc]
        except SystemExit as e:
            if e.code != 1:
                raise
            raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE)) from None


class _Parsed(_HelpOutput, _FlagsShowNoType):
    """A command or group whose line is checked around click's parsing (`_refuse_split_flags`,
    `_named`, `_refuse_nan_in_ranges`) and whose invocation begins the command's own code."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        _refuse_split_flags(self, ctx, args, names=getattr(self, "commands", ()))
        with _named(ctx):
            rest: list[str] = super().parse_args(ctx, args)  # type: ignore[misc]
        _refuse_nan_in_ranges(self, ctx)
        return rest

    def invoke(self, ctx: Any) -> Any:
        _begin(self, ctx)
        return super().invoke(ctx)  # type: ignore[misc]


class _Command(_Parsed, typer.core.TyperCommand):
    pass


class _Group(_Parsed, typer.core.TyperGroup):
    pass


def _bench_group() -> typer.core.TyperGroup:
    """`bench` runs the sweep itself; `bench serve` and `bench interference` are its
    subcommands."""
    from .bench import interference, sweep
    from .bench import serve as bench_serve

    bench = typer.Typer(
        name="bench",
        cls=_Group,
        invoke_without_command=True,
        no_args_is_help=False,
        help=BENCH_HELP,
        add_completion=False,
        # llama-bench reads --n_prompt as --n-prompt (every "--" option's _ as -)
        context_settings={"token_normalize_func": lambda name: name.replace("_", "-")},
    )
    bench.callback(invoke_without_command=True)(sweep.bench)
    bench.command("serve", cls=_Command)(bench_serve.serve)
    bench.command("interference", cls=_Command)(interference.interference)
    group = typer.main.get_command(bench)
    assert isinstance(group, typer.core.TyperGroup)
    for command in (group, *group.commands.values()):
        _plain_conversions(command)
    return group


def build_command(name: str) -> typer.core.TyperCommand | typer.core.TyperGroup:
    """The click command of one of COMMANDS, its module imported now (KeyError: no such one)."""
    module, attribute = COMMANDS[name]
    if name == "bench":
        return _bench_group()
    one = typer.Typer(add_completion=False)
    one.command(name, cls=_Command)(getattr(importlib.import_module(module), attribute))
    command = typer.main.get_command(one)
    assert isinstance(command, typer.core.TyperCommand)
    _plain_conversions(command)
    return command


class _Commands(Mapping[str, Any]):
    """COMMANDS as click's `Group.commands`: each built on first use."""

    def __init__(self) -> None:
        self._built: dict[str, Any] = {}

    def __getitem__(self, name: str) -> Any:
        if name not in self._built:
            self._built[name] = build_command(name)
        return self._built[name]

    def __iter__(self) -> Iterator[str]:
        return iter(COMMANDS)

    def __len__(self) -> int:
        return len(COMMANDS)


@contextlib.contextmanager
def _usage_errors_in_one_line() -> Iterator[None]:
    """A usage error is one line on stderr and exit 2, as every other refusal is one line: not
    typer's box of usage, hint and message (five lines or more, a value's escape sequences
    shown raw). `llmrun` alone still shows the help."""
    try:
        yield
    except typer.TyperException as e:
        ctx = getattr(e, "ctx", None)
        if getattr(e, "exit_code", None) != 2 or type(e).__name__ == "NoArgsIsHelpError":
            raise
        from .terminal import terminal_line

        _hint_without_envvar(e, ctx)
        text = terminal_line(e.format_message())
        listed = "commands" if type(e).__name__ == "UsageError" and "command" in text else "options"
        where = f" ('{ctx.command_path} -h' lists the {listed})" if ctx is not None else ""
        print(f"llmrun: error: {text}{where}", file=sys.stderr, flush=True)
        raise typer.Exit(2) from None


def _hint_without_envvar(e: Any, ctx: Any) -> None:
    """A bad value names the environment variable only when it came from there: typer's hint
    adds "(env var: 'LLMRUN_CTX')" to every option that has one, so a typed `-c -5` seemed to
    blame the environment."""
    param = getattr(e, "param", None)
    if param is None or ctx is None or getattr(e, "param_hint", None) is not None:
        return
    source = ctx.get_parameter_source(param.name) if param.name else None
    if getattr(source, "name", "") != "ENVIRONMENT":
        e.param_hint = " / ".join(f"'{x}'" for x in param.opts or [param.human_readable_name])


class LazyGroup(_HelpOutput, _FlagsShowNoType, typer.core.TyperGroup):
    """The top-level group: its help lists SUMMARIES, and a command's module is imported only
    when that command is resolved."""

    def make_context(self, *args: Any, **kwargs: Any) -> Any:
        llmrun.cli.from_environment = frozenset()  # a new command line: nothing from the last
        with _usage_errors_in_one_line():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx: Any) -> Any:
        with _usage_errors_in_one_line():  # the command's name, its options, its own checks
            return super().invoke(ctx)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.pop("commands", None)  # typer registers none here: they are COMMANDS
        super().__init__(*args, **kwargs)
        self.commands = _Commands()  # type: ignore[assignment]
        self._listing = False

    def list_commands(self, ctx: typer.Context) -> list[str]:  # type: ignore[override]
        return list(COMMANDS)

    def get_command(self, ctx: typer.Context, cmd_name: str) -> Any:  # type: ignore[override]
        if self._listing and cmd_name in SUMMARIES:
            return typer.core.TyperCommand(cmd_name, help=SUMMARIES[cmd_name])
        return self.commands.get(cmd_name)

    def format_help(self, ctx: typer.Context, formatter: Any) -> None:  # type: ignore[override]
        self._listing = True  # the command list from SUMMARIES, no command imported
        try:
            super().format_help(ctx, formatter)
        finally:
            self._listing = False


app = typer.Typer(
    name="llmrun",
    cls=LazyGroup,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(asked: bool) -> None:
    """`--version` is eager: it answers while the line is parsed, before typer converts any
    other value (its conversions import pydantic, a third of --version's time)."""
    if asked:
        from .version import version_line

        print(version_line())
        print("(llmrun doctor: the build, devices, CPU features and the choices it makes)")
        raise typer.Exit(0)


@app.callback(invoke_without_command=True)
def main(
    version: bool = typer.Option(
        False,
        "--version",
        is_eager=True,
        callback=_print_version,
        help="Print the version and exit.",
    ),
) -> None:
    """Run local GGUF language models and see where the time goes: load, prefill, decode."""
