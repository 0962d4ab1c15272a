"""Child processes that a stop signal cannot strand.

A Ctrl-C, SIGTERM or SIGHUP whose handler runs inside `subprocess.Popen`, after the fork and
before Popen returns, raises there: the child runs on, and nobody holds its `Popen` to stop it.
`popen` holds those signals back until the child is the caller's, and says which one came, so
the caller delivers it (`signal.raise_signal`) once it can stop the child. Used by
`llmrun rpc-server` (`cli/rpc_server.py`) and the repacking probe (`probe.py`).
"""

from __future__ import annotations

import signal
import subprocess
import threading
from typing import Any

from .stop_signals import STOP_SIGNALS


def popen(argv: list[str], **kwargs: Any) -> tuple[subprocess.Popen[bytes], int | None]:
    """`subprocess.Popen(argv, **kwargs)` with the stop signals held back until it returns,
    and the first that came meanwhile (None if none). Signal handlers belong to the main
    thread, so elsewhere (where no handler runs anyway) it is plain Popen. The child starts
    with its own default handlers (exec resets them); the signal mask is not touched."""
    if threading.current_thread() is not threading.main_thread():
        return subprocess.Popen(argv, **kwargs), None
    came: list[int] = []

    def hold(signum: int, frame: object) -> None:
        came.append(signum)

    handlers = {signum: signal.signal(signum, hold) for signum in STOP_SIGNALS}
    try:
        child: subprocess.Popen[bytes] = subprocess.Popen(argv, **kwargs)
    except BaseException:
        _restore(handlers)
        if came:  # no child to stop: the signal goes on as it came, before Popen's error
            signal.raise_signal(came[0])
        raise
    _restore(handlers)
    return child, (came[0] if came else None)


def _restore(handlers: dict[signal.Signals, Any]) -> None:
    for signum, handler in handlers.items():
        signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
