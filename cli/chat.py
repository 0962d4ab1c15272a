"""`llmrun chat`: a conversation in which each turn prefills only what is new.

On a terminal: a `>>> ` prompt with line editing and history, replies streamed under the live
dashboard, and after each reply one stats line and a context meter. With stdin not a terminal,
every line is one user turn and only the replies are printed, so a conversation can be scripted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import stat
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import typer
from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

import llmrun.cli
from llmrun.runners import lists
from llmrun.runners.base import ModelLoaded
from llmrun.runners.conversation import Conversation, Turn
from llmrun.runners.errors import BadRequestError, LlmrunError
from llmrun.runners.limits import SAMPLING_SETTINGS, check_sampling
from llmrun.runners.paths import state_dir
from llmrun.runners.stats import FINISH_INCOMPLETE, FINISH_INTERRUPTED, GenerationStats

from . import options as o
from .dashboard import Dashboard, Hanging, TerminalConsole, model_facts, render
from .errors import (
    EXIT_BROKEN_PIPE,
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    handled,
    incomplete_message,
    message,
    quiet_broken_pipe,
)
from .inputs import read_stdin_line, repair_utf8
from .progress import PlainPhases
from .records import takes_records
from .report import Fitted, busy_mark, context_note, fitted, mib, ms, ran_busy, summary_lines
from .session import (
    KeysHeld,
    TextOut,
    TextSink,
    ctrl_c_cancels,
    drive,
    dumb_terminal,
    live_terminal,
    redrawn_after_fg,
    terminal_modes,
    thinking_route,
)
from .terminal import terminal_echo, terminal_line, terminal_text

PROMPT = ">>> "
CONTINUATION = "... "
BLOCK = '"""'
METER_CELLS = 24
LEAVE_HINT = "(to leave, press Ctrl-D or type /exit)"
# Ollama's parameter names -> llmrun's sampling fields.
OLLAMA_PARAMETERS = {
    "temperature": "temperature",
    "num_predict": "max_tokens",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "repeat_penalty": "repeat_penalty",
    "repeat_last_n": "repeat_last_n",
    "seed": "seed",
    "stop": "stop",
}
HELP = (
    ("/? or /help", "this list; /? shortcuts: the keys"),
    ("/show info", "the model and the engine settings"),
    ("/show parameters", "the sampling settings of the next turns"),
    ("/show system", "the system prompt; also /show template, license, modelfile"),
    (
        "/set parameter NAME VALUE",
        "a sampling setting for the next turns, with Ollama's names:"
        " " + ", ".join(OLLAMA_PARAMETERS),
    ),
    ("/set system TEXT", "the system prompt (also /system [TEXT])"),
    ("/set verbose", "the full summary after each reply; /set quiet: no stats at all"),
    ("/set think", "let a thinking model think; /set nothink: ask it not to"),
    ("/set history", "keep the lines typed here across sessions; /set nohistory: stop"),
    ("/stats", "the full summary of the last reply; /stats all: every turn"),
    ("/clear", "forget the conversation, the system prompt stays (also /reset)"),
    ("/save FILE", "the transcript with per-turn stats (FILE.json or FILE.md)"),
    ("/bye", "leave (also /exit or Ctrl-D; Ctrl-C only clears the line)"),
    (BLOCK, "start and end a message of several lines"),
    ("Ctrl-C", "during a reply: stop it; what was said stays in the conversation"),
)
SHORTCUTS = (
    ("Ctrl-D", "leave (at an empty prompt)"),
    ("Ctrl-C", "stop the reply, or clear the line"),
    ("Ctrl-Z", "suspend; `fg` comes back to the same line"),
    ("Ctrl-A / Ctrl-E", "start / end of the line"),
    ("Ctrl-U / Ctrl-K", "delete to the start / end of the line"),
    ("Ctrl-W", "delete the word before the cursor"),
    ("Ctrl-L", "clear the screen"),
    ("Up / Down", "earlier lines (kept across sessions unless /set nohistory)"),
)
# Ollama's /set words that mean nothing here, with what to do instead.
NOT_HERE = {
    "format": "replies are plain text here; ask for JSON in the message",
    "noformat": "replies are plain text already",
}


def help_view(entries: tuple[tuple[str, str], ...]) -> RenderableType:
    """Commands and what they do, the descriptions hanging under each other at any width."""
    cells = max(len(name) for name, _ in entries if len(name) <= 18)
    return Group(
        *(Hanging(name, Text(what), label_cells=cells, label_style="") for name, what in entries)
    )


def banner(loaded: ModelLoaded, n_ctx: int) -> str:
    """The lines a chat on a terminal starts with: the model (its file name made safe), how
    long it took to load, the context."""
    return (
        f"{terminal_line(loaded.name)} · {model_facts(loaded)}\nload {ms(loaded.load_s)}"
        f" · context {n_ctx} tokens · /help lists the commands; Ctrl-D leaves"
    )


def turn_line(s: GenerationStats) -> str:
    busy = busy_mark(s)
    return (
        f"prompt {s.new_prompt_tokens} new + {s.reused_tokens} reused · TTFT {ms(s.ttft_s)}"
        f" · prompt {significant(s.prompt_tps)} tok/s · output {significant(s.output_tps)} tok/s"
        + (f" · {busy}" if busy else "")
    )


def significant(value: float | None) -> str:
    """A rate with three significant digits at most: 153, 24.6, 2.4, 0.42 (not 2 or 0)."""
    if value is None:
        return "-"
    if value >= 100:
        return f"{value:,.0f}"
    return f"{value:.3g}" if value >= 1 else f"{value:.2g}"


def context_meter(used: int, n_ctx: int, kv_per_token: float = 0.0) -> Text:
    """How full the context is; with a local model also the KV cache bytes those tokens hold."""
    if n_ctx <= 0:
        return Text(f"context {used} tokens (the server does not say its context size)")
    share = used / n_ctx
    cells = min(METER_CELLS, round(share * METER_CELLS))
    style = "red" if share >= 0.9 else "yellow" if share >= 0.75 else "green"
    return Text.assemble(
        "context ",
        ("█" * cells, style),
        ("░" * (METER_CELLS - cells), "dim"),
        f" {used}/{n_ctx} tokens ({share:.0%})"
        + (f" · KV {mib(used * kv_per_token)} in use" if kv_per_token else ""),
    )


def turns_view(turns: list[Turn]) -> Fitted:
    """The /stats all view, every turn's figures: a table where it fits, else a block per turn
    (report.fitted), so a figure is never cropped. No vertical rules, units in the headers and
    the context status as a mark on the turn's number, so the table fits a 40-column terminal."""
    marks = {"cleared": "c", "dropped": "d"}
    busy = any(t.stats is not None and ran_busy(t.stats) for t in turns)
    table = Table(
        title="turns",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
        caption="c: cleared by /reset, d: dropped"
        + (", b: on a busy machine (unreliable)" if busy else ""),
        caption_justify="left",
    )
    for name in ("#", "new+\nreused", "TTFT\nms", "prompt\ntok/s", "out", "output\ntok/s", "end"):
        table.add_column(
            name,
            justify="left" if name in ("#", "end") else "right",
            no_wrap=name != "end",
            overflow="fold",
        )
    for i, turn in enumerate(turns, 1):
        state = "cleared" if turn.cleared else "" if turn.in_context else "dropped"
        number = f"{i}{marks.get(state, '')}"
        s = turn.stats
        if s is None:
            table.add_row(number, "-", "-", "-", "-", "-", FINISH_INTERRUPTED)
            continue
        ttft = "-" if s.ttft_s is None else significant(s.ttft_s * 1000)
        table.add_row(
            number + ("b" if ran_busy(s) else ""),
            f"{s.new_prompt_tokens}+{s.reused_tokens}",
            ttft,
            significant(s.prompt_tps),
            str(s.output_tokens),
            significant(s.output_tps),
            s.finish_reason,
        )
    return fitted(table)


class Recorder:
    """Passes text on and keeps a copy: a reply cut short by a second Ctrl-C is not lost."""

    def __init__(self, sink: TextSink) -> None:
        self.sink = sink
        self.parts: list[str] = []

    @property
    def closed(self) -> bool:
        return self.sink.closed

    def write(self, text: str) -> None:
        self.parts.append(text)
        self.sink.write(text)

    def end_line(self) -> None:
        self.sink.end_line()


MAX_HISTORY_BYTES = 16 << 20  # 1,000 lines kept: far more than any such file holds


def _readline() -> ModuleType | None:
    """Line editing and a history kept across sessions, where the platform has readline."""
    try:
        import readline
    except ImportError:
        return None
    path = state_dir() / "chat_history"
    try:  # readline opens it blocking and reads it whole: a FIFO hung the chat, even SIGTERM
        info = path.stat()
        kept = stat.S_ISREG(info.st_mode) and info.st_size <= MAX_HISTORY_BYTES
    except FileNotFoundError:
        info, kept = None, True
    except OSError:
        info, kept = None, False
    if not kept:
        print(
            f"llmrun: {terminal_line(str(path))} is not a chat history llmrun reads (a regular"
            f" file of at most {MAX_HISTORY_BYTES >> 20} MiB): lines are not recalled or kept",
            file=sys.stderr,
        )
        return readline
    with contextlib.suppress(OSError):
        if info is not None:
            readline.read_history_file(path)
    readline.set_history_length(1000)
    # A paste of several lines is one message (as in Ollama and IPython), not one per line.
    readline.parse_and_bind("set enable-bracketed-paste on")

    def save() -> None:
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            readline.write_history_file(path)

    import atexit

    atexit.register(save)
    return readline


class ChatUI:
    def __init__(
        self,
        conv: Conversation,
        *,
        interactive: bool,
        dashboard: bool,
        hide_thinking: bool = False,
        thinking_stdout: bool = False,
    ) -> None:
        self.conv = conv
        self.hide_thinking = hide_thinking
        self.interactive = interactive
        self.err = TerminalConsole(stderr=True, highlight=False)
        self.cancel = threading.Event()
        self.stdout = TextOut(cancel=self.cancel)
        self.dash: Dashboard | None = None
        if interactive and dashboard and live_terminal(sys.stderr):
            self.dash = Dashboard(self.err, show_text=live_terminal(sys.stdout))
        self.out: TextSink = self.dash if self.dash and self.dash.show_text else self.stdout
        # TERM=dumb: no live view, so a long prefill says it started and how far it got
        long_prompt = 256  # a pasted document, not a chat line
        dumb = interactive and dumb_terminal()
        self.plain = PlainPhases(sys.stderr, least_tokens=long_prompt) if dumb else None
        self.thinking_stdout = thinking_stdout
        self.shell_modes = terminal_modes() if interactive else None
        self.readline = _readline() if interactive else None
        self.typed_ahead = ""  # keys typed during a reply: the start of the next message
        self.failed = False  # a turn failed: a scripted chat exits 1 at the end
        self.asked_ctx: int | None = None  # -c as given, to say when llama.cpp changed it
        self.verbose = False  # /set verbose: the full summary after each reply
        self.quiet = False  # /set quiet: no stats after a reply
        self.history = True  # /set nohistory: lines typed are not kept

    # ---- output ------------------------------------------------------------------------

    def show(self, renderable: RenderableType | str, style: str | None = None) -> None:
        """Messages for the person at the terminal (on stderr; silent when scripted)."""
        if self.interactive:
            text = (
                Text(renderable, style=style or "") if isinstance(renderable, str) else renderable
            )
            self.err.print(text)

    def say(self, text: str, style: str = "dim") -> None:
        """A line of text on stderr, never broken by rich (a piped stderr is 80 columns wide
        to it): a terminal wraps it, a log keeps it whole, as everywhere."""
        self.err.print(Text(terminal_text(text), style=style), soft_wrap=True)

    def warn(self, text: str) -> None:
        self.say(text, "yellow")

    def error(self, e: LlmrunError) -> None:
        self.say(message(e), "red")

    # ---- input -------------------------------------------------------------------------

    def _read_line(self, prompt: str) -> str | None:
        """One line, or None at the end of input."""
        if not self.interactive:
            return read_stdin_line()
        self._type_ahead()
        rl = self.readline
        stream = sys.stdout if sys.stdout.isatty() else sys.stderr
        try:
            with redrawn_after_fg(
                stream, lambda: prompt + (rl.get_line_buffer() if rl else ""), self.shell_modes
            ):
                if sys.stdout.isatty():
                    return repair_utf8(input(prompt))
                sys.stderr.write(prompt)  # stdout is a file or pipe: it gets the replies alone
                sys.stderr.flush()
                return repair_utf8(input())
        except EOFError:
            self._end_prompt_line()
            return None

    def _type_ahead(self) -> None:
        """What was typed during the reply starts the next line, editable, not yet sent."""
        text, self.typed_ahead = self.typed_ahead, ""
        rl = self.readline
        if not text or rl is None:
            return

        def insert() -> None:
            rl.insert_text(text)
            rl.redisplay()
            rl.set_pre_input_hook(None)

        rl.set_pre_input_hook(insert)

    def _end_prompt_line(self) -> None:
        """Finish the prompt's line where the prompt was written (never into piped replies)."""
        stream = sys.stdout if sys.stdout.isatty() else sys.stderr
        stream.write("\n")
        stream.flush()

    def read_message(self) -> str | None:
        """The next message (a line, or a block between triple quotes); None means leave."""
        while True:
            try:
                line = self._read_line(PROMPT)
                if line is None or not line.lstrip().startswith(BLOCK):
                    return line
                first = line.lstrip()[len(BLOCK) :]
                if first.rstrip().endswith(BLOCK):
                    return first.rstrip()[: -len(BLOCK)]
                lines = [first] if first else []
                while (more := self._read_line(CONTINUATION)) is not None:
                    if more.rstrip().endswith(BLOCK):
                        lines.append(more.rstrip()[: -len(BLOCK)])
                        break
                    lines.append(more)
                return "\n".join(lines).strip("\n")
            except KeyboardInterrupt:
                if not self.interactive or llmrun.cli.terminated_by is not None:
                    raise  # a script's Ctrl-C, or SIGTERM/SIGHUP: the chat ends (130, 143, 129)
                # Ctrl-C clears the line; at an empty prompt it may have been meant for a reply
                # that just ended, so it never ends the conversation: say how to leave.
                self._end_prompt_line()
                self.show(LEAVE_HINT, "dim")

    # ---- the loop ----------------------------------------------------------------------

    def loop(self) -> int:
        if not self.interactive:
            self.conv.runner.load()  # an unusable model or server ends a script at once
        else:
            live = live_terminal(sys.stderr)
            if not live:  # TERM=dumb: a spinner would only be drawn at the end
                self.show("loading the model ...", "dim")
            with self.err.status("loading the model ...") if live else contextlib.nullcontext():
                loaded = self.conv.runner.load()
            self.show(banner(loaded, self.conv.n_ctx), "dim")
        if note := context_note(self.asked_ctx, self.conv.n_ctx):
            self.warn(note)
        while True:
            text = self.read_message()
            if text is None:
                return EXIT_ERROR if self.failed and not self.interactive else 0
            if not text.strip():
                continue
            if text.startswith("/") and not text.startswith("//"):
                if self.command(text):
                    return 0
                continue
            self.turn(text[1:] if text.startswith("//") else text)
            if llmrun.cli.terminated_by is not None:  # SIGTERM/SIGHUP stopped the reply: leave
                return 0  # main ends with the signal's code
            if self.stdout.closed:
                return EXIT_BROKEN_PIPE
            if self.cancel.is_set() and not self.interactive:
                return EXIT_INTERRUPTED

    def turn(self, user: str) -> None:
        self.cancel.clear()
        keys = KeysHeld(self.dash, keep=True) if self.interactive else contextlib.nullcontext()
        with ctrl_c_cancels(self.cancel), keys:  # from here on, Ctrl-C ends this turn only
            self._turn(user)
        if isinstance(keys, KeysHeld):
            self.typed_ahead = keys.typed

    def _turn(self, user: str) -> None:
        conv = self.conv
        try:
            request, dropped = conv.begin(user)
        except LlmrunError as e:
            self.error(e)
            self.failed = True
            return
        if dropped:
            self.warn(
                f"context: dropped the {dropped} oldest turn(s) so this one fits"
                " (policy: the oldest turns go first; the system prompt stays)"
            )
        recorder = Recorder(self.out)
        cleared_cache = False
        try:
            finished = drive(
                conv.runner,
                request,
                out=recorder,
                view=self.dash or self.plain,
                cancel=self.cancel,
                thinking=thinking_route(
                    hide=self.hide_thinking, dash=self.dash, on_stdout=self.thinking_stdout
                ),
            )
            turn = conv.record(user, finished.text, finished.stats)
        except KeyboardInterrupt:  # a second Ctrl-C: the runner did not stop soon enough
            if self.dash is not None:
                self.dash.close()
            turn = conv.record(user, "".join(recorder.parts), None)
            conv.runner.reset()
            cleared_cache = True
        except LlmrunError as e:
            if self.dash is not None:
                self.dash.close()
            self.out.end_line()
            self.error(e)
            self.failed = True
            return
        self.out.end_line()
        unanswered = not turn.reply and (turn.stats is None or turn.stats.output_tokens == 0)
        if unanswered and (turn.stats is None or turn.interrupted):
            # Stopped before the first token (a long paste's prefill): the message leaves the
            # conversation, so the next turn reuses the cache as it was before this one.
            turn.in_context = False
        if turn.stats is not None and not self.quiet:
            self.show(render(turn.stats) if self.verbose else turn_line(turn.stats), "dim")
            if turn.note:
                self.show(f"note: {turn.note}", "dim")
            memory = turn.stats.settings.memory if turn.stats.settings else None
            per_token = memory.kv_bytes_per_token if memory else 0.0
            self.show(context_meter(conv.used_tokens, conv.n_ctx, per_token))
        if not turn.in_context and (turn.stats is None or turn.interrupted):
            cost = (
                " The KV cache was cleared to stop at once: the next turn prefills the"
                " whole conversation again."
                if cleared_cache
                else " The cache still holds the conversation before it."
            )
            self.show(
                "[interrupted] before the reply began: the message is not in the"
                " conversation." + cost,
                "yellow",
            )
        elif turn.interrupted or turn.stats is None:
            cost = (
                " (the KV cache was cleared to stop at once: the next turn prefills the"
                " whole conversation again)"
                if cleared_cache
                else ""
            )
            self.show("[interrupted] the reply so far stays in the conversation" + cost, "yellow")
        elif turn.stats.finish_reason == FINISH_INCOMPLETE:
            self.failed = True
            self.say(incomplete_message(turn.stats), "red")
        if conv.nearly_full:
            self.warn(
                f"context {conv.used_tokens}/{conv.n_ctx} tokens: when a turn does not fit, the"
                " oldest turns are dropped (the system prompt stays)"
            )

    # ---- slash commands ----------------------------------------------------------------

    def command(self, text: str) -> bool:
        """Run a slash command; True means leave."""
        name, _, arg = text.strip().partition(" ")
        arg = arg.strip()
        actions: dict[str, Callable[[str], bool | None]] = {
            "/help": self._help,
            "/?": self._help,
            "/stats": self._stats,
            "/reset": self._reset,
            "/clear": self._reset,
            "/load": self._load,
            "/system": self._system,
            "/save": self._save,
            "/set": self._set,
            "/show": self._show,
            "/exit": lambda a: True,
            "/quit": lambda a: True,
            "/bye": lambda a: True,
        }
        action = actions.get(name.lower())
        if action is None:
            self.say(f"unknown command {terminal_echo(name)}; /help lists them", "red")
            self.failed = True  # a script that says it wrongly exits 1
            return False
        return bool(action(arg))

    def _stats(self, arg: str) -> None:
        done = [t.stats for t in self.conv.turns if t.stats is not None]
        if not done:
            self.err.print("no reply yet")
        elif arg == "all":
            self.err.print(turns_view(self.conv.turns))
        elif live_terminal(sys.stderr):
            self.err.print(render(done[-1]))
        else:  # a file or a pipe: whole plain lines, as run's (rich cut them at 80, with bars)
            for line in summary_lines(done[-1]):
                self.err.print(line, markup=False, soft_wrap=True)

    def _help(self, arg: str) -> None:
        shortcuts = arg.strip().lower() in ("shortcuts", "shortcut")
        self.err.print(help_view(SHORTCUTS if shortcuts else HELP))

    def _load(self, arg: str) -> None:
        self._usage(
            "/load: one model per chat here; leave (/bye) and start"
            f" `llmrun chat -m {terminal_echo(arg) if arg else 'MODEL'}`"
        )

    def _set(self, arg: str) -> None:
        """Ollama's /set: parameter, system, verbose/quiet, think/nothink, history/nohistory,
        wordwrap/nowordwrap; the rest of its words are answered, not guessed."""
        word, _, rest = arg.partition(" ")
        word = word.lower()
        simple: dict[str, tuple[dict[str, bool], str]] = {
            "verbose": ({"verbose": True, "quiet": False}, "the full summary after each reply"),
            "quiet": ({"verbose": False, "quiet": True}, "no stats after each reply"),
            "history": ({"history": True}, "lines typed here are kept across sessions"),
            "nohistory": ({"history": False}, "lines typed from now on are not kept"),
        }
        if word in simple:
            changes, said = simple[word]
            vars(self).update(changes)
            if "history" in changes and self.readline is not None:
                self.readline.set_auto_history(changes["history"])
            self.say(f"/set {word}: {said}")
        elif word in ("think", "nothink"):
            self.conv.sampling = dataclasses.replace(self.conv.sampling, think=word == "think")
            self.say(
                f"/set {word}: the template's thinking switch is"
                f" {'on' if word == 'think' else 'off'} for the next turns"
                " (a model without one ignores it)",
            )
        elif word in ("wordwrap", "nowordwrap"):
            self.say(
                "/set wordwrap: the terminal wraps replies here; llmrun inserts"
                " no line breaks, so copied text stays as written",
            )
        elif word == "system":
            self._system(rest.strip())
        elif word in NOT_HERE:
            self._usage(f"/set {word}: {NOT_HERE[word]}")
        elif word == "parameter":
            self._parameter(rest)
        else:
            self._usage(
                "usage: /set parameter NAME VALUE, /set system TEXT, /set verbose|quiet,"
                " /set think|nothink, /set history|nohistory"
            )

    def _parameter(self, arg: str) -> None:
        """Ollama's `/set parameter NAME VALUE`, checked like the command-line options."""
        words = arg.split(maxsplit=1)
        if len(words) != 2:
            self._usage("usage: /set parameter NAME VALUE")
            return
        name, value = words[0].lower(), words[1]
        field = OLLAMA_PARAMETERS.get(name)
        if field is None:
            self._usage(
                f"unknown parameter {terminal_echo(name)}; known: {', '.join(OLLAMA_PARAMETERS)}"
            )
            return
        whole = field != "stop" and SAMPLING_SETTINGS[field].whole
        parsed: object = (
            tuple(v for v in value.split("|") if v)
            if field == "stop"
            else lists.integer(value)
            if whole
            else lists.real(value)
        )
        try:
            if parsed is None:  # ASCII digits, as on the command line (not `٣` or `1_0`)
                raise ValueError(value)
            changes: dict[str, Any] = {field: parsed}
            sampling = dataclasses.replace(self.conv.sampling, **changes)
            check_sampling(sampling)
        except ValueError:  # one wording, the command line's, for every number not read
            kind = "a whole number" if whole else "a number"
            self._usage(f"/set parameter {name}: {terminal_echo(repr(value))} is not {kind}")
            return
        except LlmrunError as e:
            self._usage(f"/set parameter {name}: {e}")
            return
        self.conv.sampling = sampling
        # stop: the strings kept (`|` alone keeps none); a number: Python's shortest spelling
        shown = " | ".join(map(repr, sampling.stop)) or "none" if field == "stop" else str(parsed)
        self.say(f"{name} = {terminal_echo(shown)} for the next turns")

    def _usage(self, text: str) -> None:
        self.say(text, "red")
        self.failed = True

    def _show(self, arg: str) -> None:
        what = arg.strip().lower()
        shows: dict[str, Callable[[], str]] = {
            "info": self._info_text,
            "parameters": self._parameters_text,
            "system": self._system_text,
            "template": lambda: self._gguf_text("tokenizer.chat_template", "chat template"),
            "license": lambda: self._gguf_text("general.license", "license"),
            "modelfile": self._modelfile_text,
        }
        show = shows.get(what)
        if show is None:
            self._usage(f"usage: /show {'|'.join(shows)}")
            return
        try:
            text = show()
        except LlmrunError as e:
            self.error(e)
            return
        self.say(text)

    def _system_text(self) -> str:
        """The system prompt, whole (asked for), its lines kept, its escapes taken out."""
        return f"system prompt: {terminal_text(self.conv.system or '(none)')}"

    def _info_text(self) -> str:
        loaded = self.conv.runner.load()
        return (
            f"{terminal_line(loaded.name)} · {model_facts(loaded)}"
            f"\ncontext {self.conv.n_ctx} tokens\n" + self._parameters_text()
        )

    def _numbers(self) -> list[str]:
        """`NAME VALUE` of each sampling setting that is a number, but the seed, by Ollama's
        names in its order; a real number in its shortest spelling (`g`)."""
        sp = self.conv.sampling
        return [
            f"{name} {format(getattr(sp, field), '' if SAMPLING_SETTINGS[field].whole else 'g')}"
            for name, field in OLLAMA_PARAMETERS.items()
            if name not in ("seed", "stop")
        ]

    def _parameters_text(self) -> str:
        sp = self.conv.sampling
        seed = "random each reply" if sp.seed is None else str(sp.seed)
        think = {None: "the template's default", True: "on", False: "off"}[sp.think]
        stop = " ".join(repr(s) for s in sp.stop) or "(the model's own end)"
        return " · ".join([*self._numbers(), f"seed {seed}", f"stop {stop}", f"think {think}"])

    def _gguf_text(self, key: str, what: str) -> str:
        loaded = self.conv.runner.load()
        if loaded.model is None:
            raise BadRequestError("the server does not say; /show works on a local model")
        from llmrun.runners.gguf import read_gguf

        value = read_gguf(loaded.model.path).metadata.get(key)
        return terminal_text(str(value)) if value else f"the model file has no {what}"

    def _modelfile_text(self) -> str:
        """The session as an Ollama Modelfile: the model, its parameters, the system prompt."""
        loaded = self.conv.runner.load()
        sp = self.conv.sampling
        lines = [
            f"FROM {terminal_line(loaded.model.path if loaded.model else loaded.name)}",
            *(f"PARAMETER {number}" for number in self._numbers()),
            f"PARAMETER num_ctx {self.conv.n_ctx}",
        ]
        if sp.seed is not None:
            lines.append(f"PARAMETER seed {sp.seed}")
        lines += [f'PARAMETER stop "{s}"' for s in sp.stop]
        if self.conv.system:
            lines.append(f'SYSTEM """{self.conv.system}"""')
        return terminal_text("\n".join(lines))  # a stop string or the system prompt typed

    def _reset(self, arg: str) -> None:
        self.conv.reset()
        self.say("conversation cleared (the system prompt stays)")

    def _system(self, arg: str) -> None:
        if arg:
            self.conv.system = arg
            self.say("system prompt set")
        else:
            self.say(self._system_text())

    def _save(self, arg: str) -> None:
        if not arg:
            self._usage("usage: /save FILE.json or /save FILE.md")
            return
        path = Path(arg).expanduser()
        try:
            self.conv.save(path)
        except LlmrunError as e:
            self.error(e)
            self.failed = True
            return
        self.say(terminal_line(f"saved {len(self.conv.turns)} turns to {path}"))


@takes_records
def chat(
    system: o.System = None,
    no_dashboard: o.NoDashboard = False,
    *,
    generation: o.GenerationOptions,
) -> None:
    """Chat with a model; each turn prefills only what is new since the last one.

    On a terminal, /help lists the commands. Piped, every line is a turn:

      printf 'Hi!\\nWhat did I just say?\\n' | llmrun chat
    """
    with handled():
        params, config = generation.settings(system)
        reply = generation.reply
        runner = generation.runner(config, quiet=False)
        try:
            if system is not None:  # an argument's bytes that are not UTF-8 become U+FFFD
                system = repair_utf8(system, "-s/--system")
            conv = Conversation(runner, params, system)
            ui = ChatUI(
                conv,
                interactive=sys.stdin.isatty(),
                dashboard=not no_dashboard,
                hide_thinking=reply.hide_thinking,
                thinking_stdout=reply.thinking_stdout,
            )
            ui.asked_ctx = config.n_ctx
            code = ui.loop()
        finally:
            runner.close()
        if code == EXIT_BROKEN_PIPE:
            quiet_broken_pipe()
        raise typer.Exit(code)
