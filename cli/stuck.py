"""A second Ctrl-C, SIGTERM or SIGHUP ends a process that one long C call holds.

Python runs a signal's handler in the main thread between two bytecodes: while that thread is
inside one call into llama.cpp (a grammar whose sampler follows millions of ways, a prefill
chunk of a large model on a few cores), every stop signal waits for the call to return. The
first keeps its meaning: results so far are kept once the call returns. A second one, a second
or more after the first while the main thread has still run no Python since, ends the process
at once with the signal's exit code (130, 143, 129) and one line on stderr, as `kill` without
-9 could not.

How it knows: the signal module writes each signal's number to a wakeup descriptor from C, at
once; a thread of its own reads it, and asks the main thread for a sign of life through
Python's pending calls (`Py_AddPendingCall`, the queue signal handlers go through), which run
at the main thread's next bytecode.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time

from . import STOP_SIGNALS

_PENDING = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
# A second signal counts this long after the first with no sign of life between: two that come
# together (one stop sent two ways), or a sign of life still on its way, end nothing.
STUCK_S = 1.0


class _Watch:
    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.alive = threading.Event()  # the main thread ran Python since the first signal
        self.pending = _PENDING(self._answered)  # kept: C holds its address

    def _answered(self, _: object) -> int:
        self.alive.set()
        return 0

    def run(self) -> None:
        add = ctypes.pythonapi.Py_AddPendingCall
        add.argtypes, add.restype = [_PENDING, ctypes.c_void_p], ctypes.c_int
        first_s: float | None = None  # when the signal that waits for a sign of life came
        while data := _read(self.fd):
            for signum in data:
                code = STOP_SIGNALS.get(signal.Signals(signum)) if signum in _NUMBERS else None
                if code is None:
                    continue
                now = time.monotonic()
                if first_s is not None and not self.alive.is_set():
                    if now - first_s >= STUCK_S:
                        os.write(
                            2, b"llmrun: stopped inside a call into llama.cpp (a second signal)\n"
                        )
                        os._exit(code)
                    continue  # the same stop (systemd's SIGTERM and SIGHUP come together)
                first_s = now
                self.alive.clear()
                add(self.pending, None)


_NUMBERS = frozenset(int(s) for s in STOP_SIGNALS)


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, 64)
    except OSError:
        return b""


def watch() -> None:
    """From the main thread, as the command's handlers are armed: a second stop signal that
    finds the main thread still in one C call ends the process."""
    read, write = os.pipe()
    os.set_blocking(write, False)  # a full pipe drops a number, never blocks the handler
    try:
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    except (ValueError, OSError):  # not the main thread, or no such descriptor
        os.close(read)
        os.close(write)
        return
    threading.Thread(target=_Watch(read).run, name="llmrun-stop-watch", daemon=True).start()
