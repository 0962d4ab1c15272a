"""Driving a runner from the terminal: text to stdout, status to stderr, Ctrl-C, closed pipes."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from types import FrameType
from typing import TYPE_CHECKING, Any, Protocol, TextIO

import llmrun.cli
from llmrun.runners.base import Event, Finished, Request, Runner, Token
from llmrun.runners.reasoning import ShownSplitter
from llmrun.runners.stats import FINISH_STDOUT_CLOSED

from .terminal import is_terminal as _isatty
from .terminal import say, terminal_text

if TYPE_CHECKING:
    from llmrun.runners.config import EngineConfig
    from llmrun.runners.energy import PhaseMeter


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
        self.styled = live_terminal(self.stream)  # a terminal shows the thinking dimmed
        self.to_terminal = _isatty(self.stream)  # a dumb one too: its text is sanitized

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


def live_terminal(stream: TextIO | None) -> bool:
    """A terminal that can redraw (move the cursor, erase): not a file or pipe, and not
    TERM=dumb (Emacs' shell, some IDE consoles), where text streams plainly instead."""
    if stream is None or not _isatty(stream):
        return False
    return os.environ.get("TERM", "").lower() not in ("dumb", "unknown")


def dumb_terminal() -> bool:
    """stderr is a terminal that cannot redraw (TERM=dumb): text streams plainly, and progress
    comes as lines."""
    return _isatty(sys.stderr) and not live_terminal(sys.stderr)


def _to_terminal(out: TextSink | None) -> bool:
    """Whether the sink (or the sink a recorder passes text on to) writes on a terminal."""
    while out is not None:
        if getattr(out, "styled", False) or getattr(out, "to_terminal", False):
            return True
        out = getattr(out, "sink", None)
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

    with handling(signal.SIGINT, handler):
        yield


@contextlib.contextmanager
def handling(signum: int, handler: Any) -> Iterator[None]:
    """`handler` takes `signum` while the block runs; the one before it takes it back after."""
    previous = signal.signal(signum, handler)
    try:
        yield
    finally:
        signal.signal(signum, previous)


class Thinking:
    """Where a thinking model's thinking goes: with the answer (a terminal shows it dimmed),
    to another sink (stderr, when stdout is a file or pipe that should get the answer alone),
    kept on stdout between `<think>` and `</think>` lines, or nowhere."""

    def __init__(
        self, *, hide: bool = False, sink: TextSink | None = None, delimit: bool = False
    ) -> None:
        self.hide = hide
        self.sink = sink
        self.delimit = delimit
        self._open = False
        self._text: list[str] = []

    def write(self, text: str, out: TextSink) -> None:
        if self.hide or not text:
            return
        if self.delimit and self.sink is None:
            if not self._open:
                out.end_line()  # thinking after answer text starts on a line of its own
                if not text.lstrip().startswith("<"):
                    out.write("<think>\n")
            self._open = True
            self._text.append(text)
            out.write(text)
            return
        sink = out if self.sink is None else self.sink
        sink.write(f"{DIM}{text}{UNDIM}" if _dims(sink) else text)
        self._open = True  # (without a sink or delimiters, closing it has nothing to end)

    def close(self, out: TextSink) -> None:
        """The answer begins (or the reply ended): the thinking's block ends here."""
        if not self._open:
            return
        self._open = False
        if self.sink is not None:
            self.sink.end_line()
        elif self.delimit:
            said = "".join(self._text)
            self._text = []
            out.end_line()  # the answer starts on a line of its own
            if "</think>" not in said and "<|end|>" not in said:
                out.write("</think>\n")


def thinking_route(*, hide: bool, on_stdout: bool, dash: TextSink | None) -> Thinking:
    """A program reading stdout gets the answer alone: when stdout is not a terminal, the
    thinking goes to the terminal's live view or stderr, or stays on stdout between <think>
    and </think> lines with --thinking-stdout. On a terminal it is shown dimmed in place."""
    if hide or sys.stdout is None or sys.stdout.isatty():
        return Thinking(hide=hide)
    if on_stdout:
        return Thinking(delimit=True)
    return Thinking(sink=dash if dash is not None else TextOut(sys.stderr))


_METERS: weakref.WeakKeyDictionary[Runner, PhaseMeter] = weakref.WeakKeyDictionary()
_ENERGY = ["auto"]  # --energy of the command running: on, auto or off


def use_energy(mode: str) -> None:
    """--energy for the requests `drive` runs next (run and chat set it from their option)."""
    _ENERGY[0] = mode


def energy_meter(runner: Runner, *, together: bool = False) -> PhaseMeter | None:
    """The runner's energy meter, made before its first request (while nothing runs yet, for
    the idle baseline) and kept for the next ones; for a server's model or requests that ran
    together (`together`: run --parallel), only the reason it reads nothing. None with
    --energy off; with --energy on, a usage error where no counter can be read."""
    from llmrun.runners.energy import PhaseMeter, open_meter
    from llmrun.runners.errors import BadRequestError

    mode = _ENERGY[0]
    if mode == "off":
        return None
    elsewhere = False  # the work is not this machine's one at a time: no counter could see it
    if together:
        meter = PhaseMeter.unmetered(
            "the requests ran together (--parallel): energy is metered per request only when"
            " they run one at a time"
        )
        elsewhere = True
    elif (found := _kept(runner)) is not None:
        return found
    else:
        remote = sys.modules.get("llmrun.runners.remote")  # not imported: not a server's runner
        if remote is not None and isinstance(runner, remote.OpenAIRunner):
            meter = PhaseMeter.unmetered(
                "the model runs on a server, whose energy is not seen here"
            )
            elsewhere = True
        else:
            config = getattr(runner, "config", None)
            meter = open_meter(gpu=getattr(config, "n_gpu_layers", None) != 0)
        with contextlib.suppress(TypeError):  # a runner that cannot be weakly referenced
            _METERS[runner] = meter
    # LLMRUN_ENERGY=on asks for every command's energy; where this one's cannot be seen by
    # design, it is the reason in the report, as with auto (typed, --energy on is refused)
    if elsewhere and "--energy" in llmrun.cli.from_environment:
        return meter
    if mode == "on" and not meter.counters:
        why = "; ".join(dict.fromkeys(meter.reasons.values())) or "no energy counter"
        raise BadRequestError(f"--energy on: no energy counter can be read here ({why})")
    return meter


def _kept(runner: Runner) -> PhaseMeter | None:
    with contextlib.suppress(TypeError):
        return _METERS.get(runner)
    return None


def drive(
    runner: Runner,
    request: Request,
    *,
    out: TextSink | None,
    view: EventView | None,
    cancel: threading.Event,
    hide_thinking: bool = False,
    thinking: Thinking | None = None,
    events: Iterator[Event] | None = None,
) -> Finished:
    """Run one request, streaming its text to `out` (the thinking as `thinking` says: by
    default with the text, unless hidden) and every event to `view`. `events`: the request's
    events where they were made already (run --parallel serves every request at once)."""
    think = thinking or Thinking(hide=hide_thinking)
    finished: Finished | None = None
    safe = _to_terminal(out)  # a model's or a server's escape sequences never reach a terminal
    safe_thinking = _to_terminal(think.sink or out)
    meter = energy_meter(runner, together=events is not None)
    if meter is not None:
        meter.begin()
    shown = ShownSplitter()  # a tag split over tokens is shown whole, with its thinking

    def show(segments: list[tuple[bool, str]], sink: TextSink) -> None:
        for thinking, text in segments:
            if thinking:
                think.write(terminal_text(text) if safe_thinking else text, sink)
            else:
                think.close(sink)
                sink.write(terminal_text(text) if safe else text)

    for event in runner.stream(request, cancel=cancel) if events is None else events:
        if meter is not None:
            meter.see(event)
            if isinstance(event, Finished):
                event = meter.attach(event)
        if view is not None:
            view.update(event)
        if isinstance(event, Token) and out is not None:
            show(shown.feed(event.text, flagged=event.thinking), out)
        elif isinstance(event, Finished):
            if out is not None:
                show(shown.feed(event.tail, flagged=shown.thinking) + shown.flush(), out)
                think.close(out)
                if out.closed and event.stats is not None and event.stats.interrupted:
                    # The runner saw a cancel; the reason is ours to give: no one reads on.
                    stats = dataclasses.replace(event.stats, finish_reason=FINISH_STDOUT_CLOSED)
                    event = dataclasses.replace(event, stats=stats)
            finished = event
    if finished is None:
        raise RuntimeError("the runner ended without a result")
    return finished


def _terminal_fd() -> int | None:
    """The terminal the person types into: stdin's, or stderr's when stdin is a pipe."""
    for stream in (sys.stdin, sys.stderr, sys.stdout):
        if stream is not None and _isatty(stream):
            with contextlib.suppress(AttributeError, ValueError, OSError):
                return stream.fileno()
    return None


SHOW_CURSOR = "\x1b[?25h"


class KeysHeld:
    """While a reply streams, keys typed are neither echoed nor edited by the terminal, so an
    Enter pressed to "wake" a slow reply cannot move the cursor under the live panel. What was
    typed is drained afterwards (`typed` holds it for the next prompt, or it is discarded).
    Ctrl-Z puts the terminal back as it was (echo, cursor) before stopping, and takes it
    again after `fg`. The terminal's modes are restored on every way out, exceptions and
    signals (Ctrl-C, SIGTERM) included, as those unwind through `__exit__`."""

    def __init__(self, view: object = None, *, keep: bool = False) -> None:
        self.view = view
        self.keep = keep
        self.typed = ""
        self._fd: int | None = None
        self._saved: list[Any] | None = None
        self._previous_tstp: Any = None

    def __enter__(self) -> KeysHeld:
        main = threading.current_thread() is threading.main_thread()
        self._saved = terminal_modes() if main else None
        if self._saved is None:
            return self
        self._fd = _terminal_fd()
        self._hold()
        self._previous_tstp = signal.signal(signal.SIGTSTP, self._stop)
        return self

    def _hold(self) -> None:
        import termios

        assert self._fd is not None and self._saved is not None
        quiet = [*self._saved]
        quiet[3] = quiet[3] & ~(termios.ECHO | termios.ICANON)  # ISIG stays: Ctrl-C, Ctrl-Z
        quiet[3] |= termios.NOFLSH  # ... and they do not throw away what was typed before them
        quiet[6] = [*quiet[6]]
        quiet[6][termios.VMIN], quiet[6][termios.VTIME] = 1, 0
        with contextlib.suppress(termios.error):
            termios.tcsetattr(self._fd, termios.TCSANOW, quiet)

    def _release(self) -> None:
        import termios

        assert self._fd is not None and self._saved is not None
        with contextlib.suppress(termios.error):
            termios.tcsetattr(self._fd, termios.TCSANOW, self._saved)

    def _stop(self, signum: int, frame: FrameType | None) -> None:
        """Ctrl-Z: the screen and the terminal as the shell expects them, then stop; on `fg`,
        take the terminal again and redraw."""
        suspend = getattr(self.view, "suspend", None)
        if suspend is not None:
            suspend()
        else:
            _write_stderr(SHOW_CURSOR)
        self._take_typed()  # keys typed so far are ours, not the shell's after the stop
        self._release()
        signal.signal(signal.SIGTSTP, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTSTP)  # stops here until SIGCONT
        signal.signal(signal.SIGTSTP, self._stop)
        self._hold()
        resume = getattr(self.view, "resume", None)
        if resume is not None:
            resume()

    def _take_typed(self) -> None:
        """Keys typed since the last look: kept (printable, newlines as spaces) or dropped."""
        import termios

        assert self._fd is not None
        if self.keep:
            self.typed += typed_text(_drain(self._fd))
        else:
            with contextlib.suppress(termios.error):
                termios.tcflush(self._fd, termios.TCIFLUSH)

    def __exit__(self, *exc: object) -> None:
        if self._fd is None:
            return

        try:
            self._take_typed()
            self.typed = self.typed.strip()
        finally:
            self._release()
            signal.signal(signal.SIGTSTP, self._previous_tstp or signal.SIG_DFL)
            self._fd = None


# What a terminal sends for keys that are not text, as ECMA-48 (5th edition, 5.3-5.6) defines
# its sequences, in the 7-bit (ESC + letter) and 8-bit (C1 character) forms: control sequences
# (CSI: arrows, Home, F5, Ctrl+arrow, bracketed paste marks), single shifts with their one
# character (SS3: arrows and F1-F4 in application mode), control strings up to their terminator
# (OSC, DCS, SOS, PM, APC: a terminal's answers to queries), and the other escape sequences
# (Alt+key). A sequence cut off at the end of what was read is dropped too.
_KEY_SEQUENCE = re.compile(
    r"(?:\x1b\[|\x9b)[0-?]*[ -/]*(?:[@-~]|$)"
    r"|(?:\x1b[NO]|[\x8e\x8f])(?:.|$)"
    r"|(?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f])(?:.*?(?:\x07|\x1b\\|\x9c)|.*$)"
    r"|\x1b[ -/]*(?:[0-~]|$)",
    re.DOTALL,
)


def typed_text(keys: str) -> str:
    """The text in keys typed during a reply: key sequences (arrows, function keys) dropped
    whole, not just their ESC (`>>> [A[D` was left before), newlines as spaces, and no other
    control characters."""
    text = _KEY_SEQUENCE.sub("", keys).replace("\r", " ").replace("\n", " ")
    return "".join(c for c in text if c.isprintable())


def _drain(fd: int) -> str:
    """Whatever was typed and not yet read, taken off the terminal's input queue."""
    import select

    chunks = []
    with contextlib.suppress(OSError, ValueError):
        while select.select([fd], [], [], 0)[0]:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            chunks.append(chunk)
    return b"".join(chunks).decode("utf-8", "replace")


def _write_stderr(text: str) -> None:
    with contextlib.suppress(OSError, ValueError, AttributeError):
        if _isatty(sys.stderr):
            sys.stderr.write(text)
            sys.stderr.flush()


@contextlib.contextmanager
def redrawn_after_fg(
    stream: TextIO, prompt: Callable[[], str], shell_modes: list[Any] | None
) -> Iterator[None]:
    """Around a line-editing prompt: Ctrl-Z gives the shell back its terminal modes (readline's
    no-echo mode left in place made the next line echo twice after `fg`), and after `fg` the
    prompt and the line typed so far are drawn again, in readline's modes."""
    fd = _terminal_fd()
    if (
        fd is None
        or shell_modes is None
        or os.name != "posix"
        or threading.current_thread() is not threading.main_thread()
    ):
        yield
        return
    import termios

    def stop(signum: int, frame: FrameType | None) -> None:
        try:
            editing = termios.tcgetattr(fd)
            termios.tcsetattr(fd, termios.TCSANOW, shell_modes)
        except termios.error:
            editing = None
        signal.signal(signal.SIGTSTP, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTSTP)  # stops here until SIGCONT
        signal.signal(signal.SIGTSTP, stop)
        if editing is not None:
            with contextlib.suppress(termios.error):
                termios.tcsetattr(fd, termios.TCSANOW, editing)
        with contextlib.suppress(OSError, ValueError):
            stream.write("\r\x1b[K" + prompt())
            stream.flush()

    with handling(signal.SIGTSTP, stop):
        yield


def terminal_modes() -> list[Any] | None:
    """The terminal's modes as the shell handed them over (None: not a terminal)."""
    fd = _terminal_fd()
    if fd is None or os.name != "posix":
        return None
    import termios

    try:
        return termios.tcgetattr(fd)
    except termios.error:
        return None


def _background_since_start(seconds: float = 0.25) -> float | None:
    """Other processes' CPU use, as `background_now` measures it, over llmrun's start-up rather
    than after it: from `cpu_at_start` until now, waiting only for what is left of `seconds`."""
    import time

    from llmrun.runners.system import background_now, cpu_sample, measured_background

    start = llmrun.cli.cpu_at_start
    if start is None:
        return background_now(seconds)
    left = seconds - (time.perf_counter() - start.wall_s)
    if left > 0:
        time.sleep(left)
    return measured_background(start, cpu_sample())


def free_cores(config: EngineConfig, *, endpoint: str | None, quiet: bool) -> EngineConfig:
    """run and chat want the answer: on a busy machine llama.cpp gets the cores other processes
    leave free (unless -t was given), and stderr says so in one line (unless -q; a program
    reads the thread count in the stats, as every run's)."""
    if endpoint or config.n_threads:
        return config
    from llmrun.runners.system import choose_threads, default_threads, logical_cpus

    choice = choose_threads(default_threads(), _background_since_start(), logical_cpus())
    if not choice.reduced:
        return config
    if not quiet:
        say(f"llmrun: threads {choice.why}")
    return dataclasses.replace(config, n_threads=choice.threads)
