"""The llmrun command line: everything that touches the terminal.

When the program itself is `llmrun`, Ctrl-C (or SIGTERM, or SIGHUP) while Python is still
importing the command's libraries ends it quietly; this is the first llmrun code that runs, so
the handler goes here. `main.main` replaces it once the app is ready.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmrun.runners.system import CpuSample

from llmrun.runners.stop_signals import (  # noqa: F401  (re-exported: the CLI's exit codes)
    EXIT_HANGUP,
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    STOP_SIGNALS,
)

# The machine's CPU time when `main.main` started: run and chat
# measure other processes' load from there, over the start-up, instead of waiting a quarter
# second for it after (session.free_cores). None when the app runs without main (tests).
cpu_at_start: CpuSample | None = None


# The exit code of the SIGTERM or SIGHUP that is ending the command (143, 129), set by main's
# handler, which then does what Ctrl-C does (cancel the request, or KeyboardInterrupt): a
# command that takes Ctrl-C as "stop this and go on" (chat) asks here whether to end instead.
terminated_by: int | None = None


# The flags of the running command's options whose values came from LLMRUN_* variables
# (cli/app.py sets it as the command begins): such a value is the user's setting for every
# command, so a check of options that do not apply here (`-t` with --endpoint) passes it by.
from_environment: frozenset[str] = frozenset()


def given_as(flag: str, variable: str) -> str:
    """How the user gave a setting: `flag` typed, or `variable` in the environment."""
    return variable if flag in from_environment else flag


def interrupted_at_startup(signum: int, frame: FrameType | None) -> None:
    os.write(2, b"llmrun: interrupted\n")
    os._exit(STOP_SIGNALS.get(signal.Signals(signum), EXIT_INTERRUPTED))


if os.path.basename(sys.argv[0] if sys.argv else "") == "llmrun":
    for _signum in STOP_SIGNALS:
        signal.signal(_signum, interrupted_at_startup)


def _nothing() -> None:
    pass


# Called as a command's own code begins (cli/app.py), after its modules were imported and its
# options parsed: until then a Ctrl-C or SIGTERM is `interrupted_at_startup`'s quiet exit, as
# an import cut by KeyboardInterrupt can surface as another error (a class body's __set_name__
# wraps it in RuntimeError). The console entry point (main.py) arms its handlers here.
command_started: Callable[[], None] = _nothing
