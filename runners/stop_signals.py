"""The signals that end a command the way Ctrl-C does (its results so far kept), and the exit
status each gives: 128 + the signal's number, as a shell reports a process it killed. The one
table for the command line (`cli/__init__.py`, `cli/main.py`, `cli/serve.py`) and for the
children that such a signal must not strand (`children.py`). Imported before anything else a
command needs, so it imports nothing but `signal`."""

from __future__ import annotations

import signal

EXIT_INTERRUPTED = 130  # 128 + SIGINT: Ctrl-C
EXIT_TERMINATED = 143  # 128 + SIGTERM
EXIT_HANGUP = 129  # 128 + SIGHUP: the terminal or SSH session closed

STOP_SIGNALS: dict[signal.Signals, int] = {
    signal.SIGTERM: EXIT_TERMINATED,
    signal.SIGINT: EXIT_INTERRUPTED,
}
if hasattr(signal, "SIGHUP"):
    STOP_SIGNALS[signal.SIGHUP] = EXIT_HANGUP
