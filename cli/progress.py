"""Long work's progress on stderr: what runs, how much is done of how much, the time spent and
an estimate of the time left.

On a terminal it is one line redrawn in place, cut (never wrapped) to the width, and erased when
the work ends or anything else is printed, so no stale row stays behind. Elsewhere (a pipe, a
file, TERM=dumb) a plain line per stage, when the caller wants them. The line is a pure
function of what it shows (`progress_text`); the figures come from runners/progress.py.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

from rich.cells import cell_len, set_cell_size
from rich.console import Console, ConsoleOptions, RenderResult
from rich.live import Live
from rich.spinner import Spinner
from rich.text import Text

from llmrun.cli.terminal import terminal_line
from llmrun.runners.base import LoadStarted, PrefillProgress, Token
from llmrun.runners.progress import Tally


def clock(seconds: float) -> str:
    """0:07, 12:05, 1:02:03."""
    s = max(0, round(seconds))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


@dataclass(frozen=True)
class Shown:
    """What the progress line shows at one moment."""

    label: str  # what runs: "tg128 rep 2/5 t=2", "chunked:64 c=4"
    done: int
    total: int
    unit: str  # "requests", "runs", "trials"
    elapsed_s: float
    eta_s: float | None  # None: not known yet (nothing finished that tells the pace)
    note: str = ""  # after the figures: "budget 4:10 left"


def progress_text(shown: Shown, width: int) -> Text:
    """The line at `width` columns: the figures whole, the label cut to what is left. Where the
    label would keep under 16 columns, the note and then the unit make room for it."""
    count = f"{shown.done}/{shown.total}" if shown.total > 0 else ""
    times = clock(shown.elapsed_s) + ("" if shown.eta_s is None else f" · ETA {clock(shown.eta_s)}")
    note = f" · {shown.note}" if shown.note else ""
    unit = f" {shown.unit}" if count and shown.unit else ""
    label = terminal_line(shown.label)
    choices = [f"{count}{unit} · {times}{note}", f"{count}{unit} · {times}", f"{count} · {times}"]
    if not count:
        choices = [times + note, times]
    for figures in choices:
        room = width - cell_len(figures) - 2
        if room >= min(cell_len(label), 16):
            break
    if room < 6:
        label = ""
    elif cell_len(label) > room:
        label = set_cell_size(label, max(0, room - 1)).rstrip() + "…"  # cells, not characters
    return Text(f"{label}  {figures}" if label else figures, no_wrap=True, overflow="ellipsis")


def tally_view(label: str, unit: str, tally: Tally) -> Callable[[float], Shown]:
    """A stage counted in a `Tally`: its figures at any moment."""

    def view(now_s: float) -> Shown:
        return Shown(
            label, tally.done, tally.total, unit, tally.elapsed_s(now_s), tally.eta_s(now_s)
        )

    return view


class _Rendered:
    """The live line's content, made at every refresh (the time moves on between updates)."""

    def __init__(self, line: ProgressLine) -> None:
        self.line = line
        self.spinner = Spinner("dots")

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        view = self.line.view
        if view is None:
            return
        now = time.monotonic()
        width = options.max_width
        frame = self.spinner.render(now)
        frame_text = frame if isinstance(frame, Text) else Text(str(frame))
        yield Text.assemble(frame_text, " ", progress_text(view(now), max(1, width - 2)))


class ProgressLine:
    """The progress of the stage under way on stderr (see the module's note). `follow` starts a
    stage (its view is read at every redraw, 4 times a second); `stop` erases the line. With
    `plain_lines`, a console that cannot redraw (a pipe, TERM=dumb) gets one line per stage."""

    def __init__(self, err: Console, *, plain_lines: bool = False) -> None:
        self.err = err
        self.plain_lines = plain_lines
        self.live_ok = err.is_terminal and not err.is_dumb_terminal
        self.view: Callable[[float], Shown] | None = None
        self._live: Live | None = None

    def follow(self, label: str, view: Callable[[float], Shown]) -> None:
        self.view = view
        if self.live_ok:
            if self._live is None:
                self._live = Live(
                    _Rendered(self),
                    console=self.err,
                    transient=True,
                    refresh_per_second=4,
                    redirect_stdout=False,
                    redirect_stderr=False,
                )
                self._live.start()
        elif self.plain_lines and (shown := view(time.monotonic())).total > 0:
            self.err.print(
                f"llmrun: {terminal_line(label)}: {shown.total} {shown.unit}",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )

    def stop(self) -> None:
        """Erase the line (on a terminal); a later `follow` draws it again."""
        if self._live is not None:
            self._live.stop()
            self._live = None
        self.view = None

    def __enter__(self) -> ProgressLine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class PlainPhases:
    """Load and prefill as plain lines on a terminal that cannot redraw (TERM=dumb, Emacs'
    shell), where no live view runs and nothing would show for seconds: a line when each phase
    starts, and prefill's count every `every_s` while it runs. The figures stay the summary's."""

    def __init__(self, err: TextIO, *, every_s: float = 2.0, least_tokens: int = 0) -> None:
        self.err = err
        self.every_s = every_s
        self.least_tokens = least_tokens  # a shorter prefill passes unannounced (chat's turns)
        self._next_s = 0.0
        self._prefilling = False

    def _say(self, text: str) -> None:
        print(f"llmrun: {text}", file=self.err, flush=True)

    def update(self, event: object) -> None:
        if isinstance(event, LoadStarted):
            self._say(f"loading {terminal_line(os.path.basename(event.path))}")
        elif isinstance(event, PrefillProgress):
            now = time.monotonic()
            new = event.total_tokens - event.reused_tokens
            if new < self.least_tokens:
                return
            if not self._prefilling:
                self._prefilling = True
                self._next_s = now + self.every_s
                reused = f" ({event.reused_tokens:,} reused)" if event.reused_tokens else ""
                self._say(f"prefill of {new:,} prompt tokens{reused}")
            elif now >= self._next_s and event.done_tokens < event.total_tokens:
                self._next_s = now + self.every_s
                self._say(f"prefill {event.done_tokens - event.reused_tokens:,}/{new:,} tokens")
        elif isinstance(event, Token):
            self._prefilling = False

    def close(self) -> None:
        self._prefilling = False
