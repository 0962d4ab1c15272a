"""The live dashboard on a terminal's stderr: load, prefill and decode as they happen.

Two pure functions draw it: `render_live(state)` while a request runs and `render(stats)` for the
closing summary. `Dashboard` only feeds events into a `LiveState` and lets rich's `Live` redraw
from its own thread at a bounded rate, so the token loop never waits for drawing.

When stdout is the same terminal, the generated text goes through the dashboard too: finished
lines scroll above the live panel and the line being written is shown at its top, so text and
figures never overwrite each other.
"""

from __future__ import annotations

import contextlib
import functools
import io
import itertools
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rich.cells import cell_len, chop_cells
from rich.console import (
    Console,
    ConsoleDimensions,
    ConsoleOptions,
    Group,
    RenderableType,
    RenderResult,
)
from rich.control import Control
from rich.live import Live
from rich.live_render import LiveRender
from rich.segment import ControlType, Segment
from rich.spinner import Spinner
from rich.table import Table
from rich.text import Text

from llmrun.runners.base import (
    Event,
    Finished,
    LoadStarted,
    LocalLoaded,
    ModelLoaded,
    PrefillProgress,
    Token,
)
from llmrun.runners.stats import EngineSettings, GenerationStats, ServerSettings, human_count, rate

from .errors import LineConsole
from .report import (
    engine_text,
    memory_text,
    ms,
    phase_sentence,
    ratio_text,
    summary_rows,
    tps,
    tuned_text,
    warmup_text,
)
from .rich_adapter import drawn_shape, forget_drawn, live_lock, live_render, set_live_render
from .terminal import terminal_line

REFRESH_PER_SECOND = 4
CHART_POINTS = 24  # inter-token gaps in the live chart
LINE_ROWS = 3  # rows of the line being written that the live panel shows
BAR_CELLS = 34
SPARK = "▁▂▃▄▅▆▇█"


def model_facts(loaded: ModelLoaded) -> str:
    model = loaded.model
    if isinstance(loaded.settings, ServerSettings) or model is None:
        return terminal_line(f"served at {getattr(loaded.settings, 'endpoint', '?')}")
    return terminal_line(  # the architecture is the model file's own string
        f"{model.architecture} {model.quantization} · {human_count(model.n_params)} params"
        f" · {human_count(model.size_bytes, 'B')} of weights"
    )


@dataclass
class LiveState:
    """What the events of the running request have shown so far (written by one thread)."""

    path: str = ""
    loading: bool = False
    load_seen: bool = False  # this request loaded the model
    loaded: ModelLoaded | None = None
    prefill: PrefillProgress | None = None
    tokens: int = 0
    first_token_s: float | None = None
    last_token_s: float = 0.0
    gaps_s: deque[float] = field(default_factory=lambda: deque(maxlen=CHART_POINTS))
    started_s: float | None = None  # perf_counter() when the request was handed over
    prefill_started_s: float | None = None  # perf_counter() at the first prefill event
    prefill_at_s: float | None = None  # ... and at the latest one
    prefill_rate: float | None = None  # prompt tok/s measured last (here or in an earlier request)
    thinking: int = 0  # output tokens of the model's thinking so far
    drafted: int = 0  # tokens that landed in a run with the one before (speculative decoding)
    run: int = 1  # the length of the latest such run
    pending: list[str] = field(default_factory=list)  # finished lines not yet scrolled out
    line: str = ""  # the text line being written (when the text goes through the dashboard)

    def apply(self, event: Event) -> None:
        if isinstance(event, Token):  # by far the most frequent: checked first
            if self.first_token_s is None:
                self.first_token_s = event.t_s
            elif event.t_s == self.last_token_s:  # landed with the one before: a drafted run
                self.drafted += 1
                self.run += 1
            else:
                self.gaps_s.append(event.t_s - self.last_token_s)
                self.run = 1
            self.last_token_s = event.t_s
            self.tokens = event.index + 1
            self.thinking += event.thinking
        elif isinstance(event, PrefillProgress):  # once per chunk: a clock read is cheap here
            now = time.perf_counter()
            if self.prefill is None:
                self.prefill_started_s = now
            self.prefill, self.prefill_at_s = event, now
            if event.elapsed_s > 0 and event.done_tokens > event.reused_tokens:
                self.prefill_rate = (event.done_tokens - event.reused_tokens) / event.elapsed_s
        elif isinstance(event, LoadStarted):
            self.path, self.loading, self.load_seen = event.path, True, True
        elif isinstance(event, ModelLoaded):
            self.loaded, self.loading = event, False

    @property
    def output_tps(self) -> float | None:
        if self.first_token_s is None:
            return None
        return rate(self.tokens - 1, self.last_token_s - self.first_token_s)


def sparkline(values: list[float]) -> str:
    """One block character per value, on a scale from zero to the largest: ordinary 14-28 ms
    gaps are bars of half height, not spikes, and a real stall stands out."""
    if not values:
        return ""
    high = max(values)
    top = len(SPARK) - 1
    return "".join(SPARK[round(max(v, 0.0) / high * top) if high > 0 else 0] for v in values)


MIN_BAR_CELLS = 4  # narrower than this, a bar chart puts each label on a line of its own
LABEL_CELLS = 8  # the label column of the live rows and the closing summary


@dataclass(frozen=True)
class Hanging:
    """A labelled row whose wrapped lines start under its value, never at column 0 (the live
    panel's rows, like the closing summary's grid; cheap enough for every redraw)."""

    label: str
    value: Text
    label_cells: int = LABEL_CELLS
    label_style: str = "bold"

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        indent = self.label_cells + 1
        width = options.max_width
        first = Segment(f"{self.label:<{self.label_cells}} ", console.get_style(self.label_style))
        if width <= indent + 16 or cell_len(self.label) > self.label_cells:
            # too narrow for a column (or a long label): the label on a line of its own
            yield Text(self.label, style=self.label_style)
            indent, first = 2, Segment("  ")
        for i, line in enumerate(self.value.wrap(console, max(1, width - indent), overflow="fold")):
            yield first if i == 0 else Segment(" " * indent)
            yield from line.render(console)
            yield Segment.line()


def _row(label: str, *content: str | tuple[str, str] | Text) -> Hanging:
    return Hanging(label, Text.assemble(*content))


def folded(line: str, width: int, rows: int) -> list[Text]:
    """The line being written as the terminal will show it once it is printed: cut every
    `width` cells, not at words; only its last `rows` rows (a long paragraph stays whole
    in the text and scrolls out whole when it ends)."""
    text = Text.from_ansi(line)
    if cell_len(text.plain) <= width:
        return [text]
    offsets = list(itertools.accumulate(map(len, chop_cells(text.plain, max(1, width)))))
    return list(text.divide(offsets[:-1]))[-rows:]


def _bar(done: int, total: int, cells: int = 20) -> Text:
    """Done and to do differ by glyph, not by colour alone (NO_COLOR keeps them apart)."""
    filled = min(cells, round(done / total * cells)) if total > 0 else 0
    return Text.assemble(("━" * filled, "bar.complete"), ("╌" * (cells - filled), "bar.back"))


def _prefill_estimate(state: LiveState, p: PrefillProgress, now_s: float | None) -> tuple[int, str]:
    """Between chunks (seconds each on a slow machine) the counts stand still: show the time
    so far and, from the last measured prefill rate, an estimate of the tokens done."""
    if p.done_tokens >= p.total_tokens or now_s is None or state.prefill_started_s is None:
        return p.done_tokens, ""
    text = f" · {ms(max(0.0, now_s - state.prefill_started_s))}"
    if not state.prefill_rate or state.prefill_at_s is None:
        return p.done_tokens, text
    since = max(0.0, now_s - state.prefill_at_s)
    estimate = min(p.total_tokens - 1, p.done_tokens + int(state.prefill_rate * since))
    return estimate, text + f" · ~{estimate} est."


def render_live(
    state: LiveState, now_s: float | None = None, *, width: int = 80, height: int | None = None
) -> RenderableType:
    """The panel for a running request: one row per phase reached so far.

    Plain Text rows rather than tables: `Live` redraws this several times a second from its
    own thread, which competes with the token loop for the interpreter, so it must be cheap.
    On a screen of `height` rows the panel keeps to half of it (`_fit`): what the closing
    summary repeats gives way first, so the figures of the phase under way always show.
    """
    lines: list[RenderableType] = []
    if state.line:
        lines.extend(folded(state.line, width, LINE_ROWS))
    parts: list[RenderableType] = []
    if state.loading:
        name = terminal_line(os.path.basename(state.path))
        parts.append(Spinner("dots", _row("load", f"loading {name} ...")))
    elif state.loaded is not None and state.load_seen:
        ld, st = state.loaded, state.loaded.settings
        warmup = warmup_text(ld.warmup_s, ld.probe_s) if isinstance(ld, LocalLoaded) else ""
        parts.append(_row("load", f"{ms(ld.load_s)}{warmup} · {terminal_line(ld.name)}"))
        engine = f" · {engine_text(st)}{tuned_text(st)}" if isinstance(st, EngineSettings) else ""
        parts.append(_row("", f"{model_facts(ld)}{engine}"))
        if isinstance(st, EngineSettings) and st.memory is not None:
            parts.append(_row("memory", memory_text(st)))
    p = state.prefill
    if p is not None:
        speed = rate(p.done_tokens - p.reused_tokens, p.elapsed_s)
        cached = f" ({p.reused_tokens} reused)" if p.reused_tokens else ""
        shown, moving = _prefill_estimate(state, p, now_s)
        parts.append(
            _row(
                "prefill",
                _bar(shown, p.total_tokens),
                f" {p.done_tokens}/{p.total_tokens} tokens{cached} · {tps(speed)}{moving}",
            )
        )
    # the rows whose figures are final, which the summary repeats: the load's once loaded, and
    # the prefill's once decoding
    decoding = state.first_token_s is not None
    repeated = 0 if state.loading else len(parts) - (p is not None and not decoding)
    waiting = p is None and not decoding and not state.loading
    if waiting and state.started_s is not None and now_s is not None:
        # A server shows no prefill progress: the wait itself is what there is to see.
        parts.append(_row("wait", f"{ms(now_s - state.started_s)} for the first token"))
    if decoding:
        gaps = list(state.gaps_s)
        latest = f" {ms(gaps[-1])}" if gaps else ""
        thought = f" ({state.thinking} thinking)" if state.thinking else ""
        drafted = f" · {state.drafted} landed in drafted runs (last {state.run})"
        text = f"{state.tokens} tokens{thought}{drafted if state.drafted else ''}"
        line = f"{text} · {tps(state.output_tps)} · itl "
        parts.append(_row("decode", line, (sparkline(gaps), "magenta"), latest))
    # An empty last row keeps the cursor at column 0, so a "^C" echoed by the terminal cannot
    # wrap a line and leave a stale row behind when the panel is cleared.
    parts.append(Text(""))
    if height is not None:
        lines, parts = _fit(lines, parts, repeated, width, max(3, height // 2))
    return Group(*lines, *parts)


@functools.cache
def _measuring(width: int) -> Console:
    return Console(file=io.StringIO(), width=width, color_system=None, legacy_windows=False)


def _fit(
    lines: list[RenderableType],
    parts: list[RenderableType],
    repeated: int,
    width: int,
    budget: int,
) -> tuple[list[RenderableType], list[RenderableType]]:
    """The panel in `budget` rows: rows the summary repeats (parts[:repeated]) go first, from
    the bottom, then the oldest rows of the line being written; the phase under way stays,
    which is what keeps the panel under the screen's height and its rows out of the
    scrollback (rich crops a taller one with "...", and cannot erase what scrolled away)."""
    console = _measuring(width)
    sizes = [len(console.render_lines(part, console.options, pad=False)) for part in parts]
    line_rows = len(lines)  # `folded` rows are one screen row each
    total = sum(sizes) + line_rows
    keep = list(range(len(parts)))
    for i in reversed(range(repeated)):
        if total <= budget:
            break
        keep.remove(i)
        total -= sizes[i]
    line_rows -= min(line_rows, max(0, total - budget))
    return lines[len(lines) - line_rows :], [parts[i] for i in keep]


def bars(
    rows: Sequence[tuple[str, float | None, str]],
    *,
    width: int = BAR_CELLS,
    label_cells: int | None = None,
) -> RenderableType:
    """Horizontal bars on one scale: (label, value, style); a missing value shows as "-".

    The bars get what the terminal leaves after the labels and the numbers: on a narrow one
    the decoration shrinks, never the figures."""
    return _Bars(list(rows), width, label_cells)


@dataclass(frozen=True)
class _Bars:
    rows: list[tuple[str, float | None, str]]
    width: int
    label_cells: int | None

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        numbers = ["-" if v is None else f"{v:,.1f}" for _, v, _ in self.rows]
        label = self.label_cells or max((cell_len(lb) for lb, _, _ in self.rows), default=0)
        number_cells = max((len(n) for n in numbers), default=1)
        room = options.max_width - label - number_cells - 2
        stacked = room < MIN_BAR_CELLS  # long labels: each on a line of its own, its bar under it
        if stacked:
            room = options.max_width - 2 - number_cells - 1
        width = max(1, min(self.width, room))
        top = max((v or 0.0 for _, v, _ in self.rows), default=0.0)
        grid = Table.grid(padding=(0, 1))
        grid.add_column(width=label, no_wrap=True)
        grid.add_column(width=width, no_wrap=True)
        grid.add_column(justify="right", no_wrap=True)
        for (name, value, style), number in zip(self.rows, numbers, strict=True):
            cells = max(1, round(value / top * width)) if value and top > 0 else 0
            if stacked:
                yield Text(name)
                yield Text.assemble(
                    "  ",
                    ("█" * cells, style),
                    " " * (width - cells + 1),
                    number.rjust(number_cells),
                )
            else:
                grid.add_row(name, Text("█" * cells, style=style), number)
        if not stacked:
            yield grid


def render(stats: GenerationStats) -> RenderableType:
    """The closing summary of one request, in llama.cpp's and Ollama's terms."""
    grid = Table.grid(padding=(0, 1))
    grid.add_column(width=8, style="bold")
    grid.add_column(overflow="fold")  # a word wider than the column folds; nothing is cut
    for label, value in summary_rows(stats):
        grid.add_row(label, Text(value))
    rates = [
        ("prompt tok/s", stats.prompt_tps, "cyan"),
        ("output tok/s", stats.output_tps, "magenta"),
    ]
    parts: list[RenderableType] = [grid, bars(rates, label_cells=13)]  # on one scale
    if stats.prompt_tps and stats.output_tps:  # their ratio, under the bars
        parts.append(Text(" " * 14 + ratio_text(stats), style="bold"))
    return Group(*parts, Text(phase_sentence(stats), style="italic"))


class TerminalConsole(LineConsole):
    """A console whose width is the terminal's as it is now.

    rich freezes the width when `COLUMNS` is in the environment (some shells export it), so a
    live panel would go on drawing at the old width after a resize and leave wrapped rows
    behind. A live view asks the terminal itself on every redraw.
    """

    def _size(self) -> ConsoleDimensions:
        with contextlib.suppress(AttributeError, OSError, ValueError):
            columns, lines = os.get_terminal_size(self.file.fileno())
            if columns > 0 and lines > 0:
                return ConsoleDimensions(columns, lines)
        return Console.size.fget(self)  # type: ignore[attr-defined]

    size = property(_size, Console.size.fset)  # type: ignore[attr-defined]


class _ReflowRender(LiveRender):
    """rich's live region, cleared right after the terminal narrowed.

    rich moves the cursor up as many rows as it drew. A terminal that re-wraps lines when it
    narrows (tmux, VTE, iTerm2, kitty, Windows Terminal) turns each drawn row longer than the
    new width into several, so rich's count falls short and the top of the old panel stays on
    the screen as debris, once per resize step. The rows are counted at the width of now.
    """

    def __init__(self, renderable: RenderableType, **kwargs: Any) -> None:
        super().__init__(renderable, **kwargs)
        self._cells: list[int] = []  # the cell length of each row drawn last
        self._console: Console | None = None

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        segments = [s for s in super().__rich_console__(console, options) if isinstance(s, Segment)]
        self._console = console
        self._cells = [Segment.get_line_length(line) for line in Segment.split_lines(segments)]
        yield from segments

    def _rows(self) -> int:
        shape = drawn_shape(self)
        if shape is None:
            return 0
        if self._console is None or not self._cells:
            return shape[1]
        width = max(1, self._console.width)
        return sum(max(1, -(-cells // width)) for cells in self._cells)

    def position_cursor(self) -> Control:
        rows = self._rows()
        if not rows:
            return Control()
        up = ((ControlType.CURSOR_UP, 1), (ControlType.ERASE_IN_LINE, 2)) * (rows - 1)
        return Control(ControlType.CARRIAGE_RETURN, (ControlType.ERASE_IN_LINE, 2), *up)

    def restore_cursor(self) -> Control:
        rows = self._rows()
        if not rows:
            return Control()
        up = ((ControlType.CURSOR_UP, 1), (ControlType.ERASE_IN_LINE, 2)) * rows
        return Control(ControlType.CARRIAGE_RETURN, *up)


class _TextLive(Live):
    """`Live` that, on each of its refreshes, scrolls finished text lines out above the panel.

    Printing above a live display redraws it; doing that from the token loop for every line
    measurably slowed decoding, so the refresh thread does it, a few times a second. The panel
    is erased when it stops (transient), and stdout and stderr are left alone.
    """

    def __init__(
        self,
        take_lines: Callable[[], list[str]],
        console: Console,
        get_renderable: Callable[[], RenderableType],
    ) -> None:
        super().__init__(
            console=console,
            get_renderable=get_renderable,
            refresh_per_second=REFRESH_PER_SECOND,
            transient=True,
            redirect_stdout=False,
            redirect_stderr=False,
        )
        self._take_lines = take_lines
        set_live_render(
            self,
            _ReflowRender(live_render(self).renderable, vertical_overflow=self.vertical_overflow),
        )

    def refresh(self) -> None:
        lines = self._take_lines()
        if not lines or not self.console.is_terminal:
            if lines:
                self.console.print(Text.from_ansi("\n".join(lines)), soft_wrap=True)
            super().refresh()
            return
        with live_lock(self):  # one redraw: the lines above, then the panel as it is now
            live_render(self).set_renderable(self.renderable)
            self.console.print(Text.from_ansi("\n".join(lines)), soft_wrap=True)


class Dashboard:
    """An EventView that shows `render_live` under `Live` and, if asked, the streamed text."""

    styled = True  # thinking may come dimmed (ANSI, read back by Text.from_ansi)

    def __init__(self, console: Console, *, show_text: bool = False) -> None:
        self.console = console
        self.show_text = show_text
        self.state = LiveState()
        self.live: Live | None = None
        self.closed = False  # the text sink never closes: the terminal is not a pipe
        self.ends_with_newline = True
        self._lock = threading.Lock()

    # -- EventView --

    def update(self, event: Event) -> None:
        if self.live is None and not isinstance(event, Finished):
            self._start()
        self.state.apply(event)
        if isinstance(event, Finished):
            self._stop()

    def close(self) -> None:
        self._stop()

    def suspend(self) -> None:
        """Ctrl-Z: the panel off the screen and the cursor shown, for the shell."""
        live = self.live
        if live is None:
            return
        live_lock(live).acquire()  # no redraw until resume(): the refresh thread waits
        render = live_render(live)
        if render.last_render_height:
            self.console.line()  # as Live.stop does: restore_cursor counts from the next row
        self.console.control(render.restore_cursor())
        forget_drawn(render)  # drawn afresh where the cursor is after `fg`
        self.console.show_cursor(True)

    def resume(self) -> None:
        live = self.live
        if live is None:
            return
        self.console.show_cursor(False)
        live_lock(live).release()
        live.refresh()

    def _start(self) -> None:
        old = self.state  # the model and its last prefill rate carry over to the next request
        self.state = LiveState(
            loaded=old.loaded, started_s=time.perf_counter(), prefill_rate=old.prefill_rate
        )
        self.live = _TextLive(self._take_pending, self.console, self._renderable)
        self.live.start()

    def _renderable(self) -> RenderableType:
        with self._lock:
            size = self.console.size
            return render_live(
                self.state, time.perf_counter(), width=size.width, height=size.height
            )

    def _stop(self) -> None:
        if self.live is not None:
            self.live.stop()  # its last refresh scrolls out the finished lines
            self.live = None
            if self.state.line:
                self.console.print(Text.from_ansi(self.state.line), end="", soft_wrap=True)
                self.state.line = ""

    # -- text sink (used in place of TextOut when stdout is this terminal) --

    def write(self, text: str) -> None:
        """Called once per token: the common case (no newline) stays tiny. Lines reach the
        terminal whole, as the model wrote them, and the terminal wraps them (so text copied
        from the screen is the text, and reflows on a resize)."""
        if not text:
            return
        self.ends_with_newline = text[-1] == "\n"
        if self.live is None:
            self.console.print(Text.from_ansi(text), end="", soft_wrap=True)
            return
        state = self.state
        if "\n" not in text:
            state.line += text  # one assignment: the refresh thread sees the old or new line
            return
        with self._lock:
            *done, state.line = (state.line + text).split("\n")
            state.pending.extend(done)

    def _take_pending(self) -> list[str]:
        with self._lock:
            lines, self.state.pending = self.state.pending, []
        return lines

    def end_line(self) -> None:
        if self.state.line or not self.ends_with_newline:
            self.write("\n")
