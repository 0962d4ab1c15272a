"""Driving a runner from the terminal: text to stdout, status to stderr, Ctrl-C, closed pipes."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Protocol, TextIO

from llmrun.runners.base import Event, Finished, Request, Runner, Token


class EventView(Protocol):
    """Anything that shows the event stream (a status line, the dashboard)."""

    def update(self, event: Event) -> None: ...

    def close(self) -> None: ...


class TextSink(Protocol):
    """Where generated text goes: stdout (`TextOut`) or the dashboard when it owns the terminal."""

    @property
    def closed(self) -> bool: ...

    def write(self, text: str) -> None: ...

    def end_line(self) -> None: ...


class TextOut:
    """Generated text to stdout, flushed per write; a closed pipe cancels instead of raising."""

    def __init__(self, stream: TextIO | None = None, cancel: threading.Event | None = None) -> None:
        self.stream = stream or sys.stdout
        self.cancel = cancel
        self.closed = False
        self.ends_with_newline = True
        self.styled = _isatty(self.stream)  # a terminal shows the thinking dimmed

    def write(self, text: str) -> None:
        if not text or self.closed:
            return
        try:
            self.stream.write(text)
            self.stream.flush()
            self.ends_with_newline = text.endswith("\n")
        except BrokenPipeError:
            self.closed = True
            if self.cancel is not None:
                self.cancel.set()

    def end_line(self) -> None:
        if not self.ends_with_newline:
            self.write("\n")


DIM, UNDIM = "\x1b[2m", "\x1b[22m"


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError, OSError):
        return False


def _dims(out: TextSink) -> bool:
    """Whether the sink is a terminal that takes the thinking dimmed (NO_COLOR: never)."""
    return bool(getattr(out, "styled", False)) and not os.environ.get("NO_COLOR")


@contextlib.contextmanager
def ctrl_c_cancels(cancel: threading.Event) -> Iterator[None]:
    """First Ctrl-C sets `cancel` (the runner stops at the next token); a second one raises."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        if cancel.is_set():
            raise KeyboardInterrupt
        cancel.set()

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def drive(
    runner: Runner,
    request: Request,
    *,
    out: TextSink | None,
    view: EventView | None,
    cancel: threading.Event,
    hide_thinking: bool = False,
) -> Finished:
    """Run one request, streaming its text to `out` (the thinking too, unless hidden) and
    every event to `view`."""
    finished: Finished | None = None
    for event in runner.stream(request, cancel=cancel):
        if view is not None:
            view.update(event)
        if isinstance(event, Token):
            if out is not None and not (hide_thinking and event.thinking):
                dim = event.thinking and event.text and _dims(out)
                out.write(f"{DIM}{event.text}{UNDIM}" if dim else event.text)
        elif isinstance(event, Finished):
            if out is not None:
                out.write(event.tail)
            finished = event
    if finished is None:
        raise RuntimeError("the runner ended without a result")
    return finished
