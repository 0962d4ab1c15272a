"""The console entry point: what must hold before the app and its libraries are imported.

- A standard stream that the caller closed (`2>&-`) is reopened on /dev/null, so nothing meant
  for stderr lands on stdout through a file that took its descriptor.
- Ctrl-C while the libraries load ends quietly with 130, not with an import traceback.
- SIGTERM and SIGHUP (a closed terminal or SSH session) behave like Ctrl-C: results so far are
  kept (printed, stored in the history, appended to --stats-file). The exit code says which
  signal it was, as a shell would: 143 for SIGTERM, 129 for SIGHUP.
- A second stop signal, a second or more after the first, while the main thread is still
  inside one call into llama.cpp ends the process at once (`stuck.py`): Python runs no handler
  until that call returns.
- A llama.cpp abort (GGML_ASSERT) becomes the one-line error and exit 1.
- COLUMNS and LINES that are not a terminal's size are dropped with a warning, as GNU ls does:
  rich read `²` with int() and failed, and laid out 99,999,999,999 columns until memory ran out.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import io
import os
import signal
import sys
from types import FrameType
from typing import NoReturn

import llmrun.cli
from llmrun.runners.lists import whole

from . import EXIT_INTERRUPTED, STOP_SIGNALS, interrupted_at_startup


class _ClosedStdout(io.TextIOBase):
    """stdout that the caller closed (`>&-`): the first write fails as writing to a closed
    descriptor does (one line, exit 1, as `> /dev/full`), where /dev/null lost the result
    without a word."""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        raise OSError(errno.EBADF, "stdout is closed (>&-): the output has nowhere to go")

    def isatty(self) -> bool:
        return False


def _reopen_closed_std_streams() -> None:
    """A closed descriptor is reopened on /dev/null, so that no file opened later takes it and
    receives what was meant for it; stdin reads nothing there and stderr's lines are dropped
    (there is nowhere to say so), but stdout's output is a result: its first write fails."""
    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        with contextlib.suppress(OSError):
            os.fstat(fd)
            continue
        null = os.open(os.devnull, os.O_RDWR)
        if null != fd:
            os.dup2(null, fd)
            os.close(null)
        if fd == 1:
            sys.stdout = _ClosedStdout()
        else:
            setattr(sys, name, open(fd, mode, closefd=False, errors="replace"))  # noqa: SIM115


def _same_text_in_every_locale() -> None:
    """stdin is read as UTF-8 under C, C.UTF-8 and en_US.UTF-8 alike; bytes that are not UTF-8
    survive as escapes until `inputs.repair_utf8` replaces them (with a warning). Output to a
    pipe or a file (stdout's and stderr's) is data: UTF-8 in every locale (an ASCII one,
    LC_ALL=C with PYTHONUTF8=0, wrote `?` for every other character, in --json too). On a
    terminal, text that the locale cannot show is replaced instead of ending the run."""
    from .terminal import is_terminal

    stdin, replace = {"encoding": "utf-8", "errors": "surrogateescape"}, {"errors": "replace"}
    data = {"encoding": "utf-8", "errors": "replace"}
    for stream, how in (
        (sys.stdin, stdin),
        (sys.stdout, replace if is_terminal(sys.stdout) else data),
        (sys.stderr, replace if is_terminal(sys.stderr) else data),
    ):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            with contextlib.suppress(ValueError, OSError):
                reconfigure(**how)


MAX_TERMINAL_SIDE = 65535  # the kernel's struct winsize holds each side in an unsigned short


def _terminal_size_from_environment() -> None:
    for name in ("COLUMNS", "LINES"):
        value = os.environ.get(name)
        if value is None or 1 <= (whole(value.strip()) or 0) <= MAX_TERMINAL_SIDE:
            continue
        del os.environ[name]
        if not value.strip():
            continue  # set but empty: unset
        print(
            f"llmrun: warning: {name}={value!r} is not a size from 1 to {MAX_TERMINAL_SIDE};"
            " the terminal's own is used",
            file=sys.stderr,
        )


def _terminate(signum: int, frame: FrameType | None) -> None:
    """SIGTERM, SIGHUP: do what Ctrl-C does now (cancel the request, or raise
    KeyboardInterrupt)."""
    llmrun.cli.terminated_by = STOP_SIGNALS[signal.Signals(signum)]
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler) and handler is not _terminate:
        handler(signal.SIGINT, frame)
    else:
        raise KeyboardInterrupt


def main() -> None:
    """The `llmrun` command, start to exit.

    The process ends when this returns: its objects go into the collector's permanent
    generation first (gc.freeze), so that Python's shutdown does not trace them all again in the
    full collections it runs while it empties the modules. That tracing took about 0.2 s of every
    command that had loaded llama-cpp-python (about 54,000 objects, 527 modules) on 2 slow
    cores, after the last line was printed. atexit handlers (weakref.finalize's among them),
    the wait for threads, the standard streams' flush and the modules' teardown still run; an
    object kept alive only by a reference cycle is no longer collected, so its __del__ does
    not run. llmrun releases what it holds explicitly (with-blocks, `finally`), never through
    __del__."""
    try:
        _main()
    finally:
        gc.freeze()


def _main() -> None:
    _reopen_closed_std_streams()
    _same_text_in_every_locale()
    _terminal_size_from_environment()
    for signum in STOP_SIGNALS:
        signal.signal(signum, interrupted_at_startup)
    if sys.argv[1:2] in (["run"], ["chat"]):  # they choose threads by the load over start-up
        from llmrun.runners import system

        llmrun.cli.cpu_at_start = system.cpu_sample()
    from llmrun.runners import library
    from llmrun.runners.errors import EngineAbortError

    from .app import app

    def on_abort(error: EngineAbortError) -> None:
        # Imported here, not up front (--help needs none of it); a command that reaches
        # llama.cpp has long imported it for its own `handled()`.
        from .errors import print_error

        print_error(error)

    library.on_abort = on_abort

    def arm() -> None:
        """The command's own code begins: Ctrl-C cancels its work, SIGTERM and SIGHUP too.

        What the imports and the parsing made lives as long as the process: it goes into the
        collector's permanent generation, so that a full collection during the command (about
        40 ms where one came in a short `run`, and it can land between two decoded tokens) no
        longer traces it."""
        gc.freeze()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for signum in STOP_SIGNALS:
            if signum != signal.SIGINT:
                signal.signal(signum, _terminate)
        from .stuck import watch

        watch()  # a second signal ends a process still inside one call into llama.cpp

    llmrun.cli.command_started = arm
    try:
        app()
    except SystemExit as e:
        if e.code == 1 and type(sys.stdout).__name__ == "PacifyFlushWrapper":
            # click's answer to a broken pipe under --help or --version: exit 1, in silence
            _output_failed(OSError(errno.EPIPE, os.strerror(errno.EPIPE)))
        terminated_by = llmrun.cli.terminated_by
        if terminated_by is not None and e.code in (EXIT_INTERRUPTED, None, 0, 1):
            raise SystemExit(terminated_by) from None
        if e.code in (None, 0):
            try:  # what --help or --version left in the buffer: the write may fail here
                sys.stdout.flush()
            except OSError as failed:
                _output_failed(failed)
        raise
    except KeyboardInterrupt:
        print("llmrun: interrupted", file=sys.stderr, flush=True)
        raise SystemExit(llmrun.cli.terminated_by or EXIT_INTERRUPTED) from None
    except OSError as e:  # --help or --version into a closed, full or broken stdout (commands
        _output_failed(e)  # have handled())


def _output_failed(e: OSError) -> NoReturn:
    """Help or the version could not be written: as a command's own output that cannot be
    (cli/errors.py's handled()): a broken pipe ends quietly with 141, as if killed by SIGPIPE;
    a closed stdout, a full disk (> /dev/full) or another failure is one line and exit 1."""
    from .errors import EXIT_BROKEN_PIPE, quiet_broken_pipe

    quiet_broken_pipe()  # what is still buffered for stdout cannot be written either
    if e.errno == errno.EPIPE:
        raise SystemExit(EXIT_BROKEN_PIPE) from None
    if e.errno == errno.EBADF:
        line = f"llmrun: error: {e.strerror}"
    else:
        where = f": {e.filename}" if e.filename else " (writing the output)"
        line = f"llmrun: error: {e.strerror or e}{where}"
    with contextlib.suppress(OSError):
        print(line, file=sys.stderr, flush=True)
    raise SystemExit(1) from None


if __name__ == "__main__":  # python -m llmrun.cli.main: as the llmrun script
    main()
