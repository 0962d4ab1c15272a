"""Text from outside (a model, a server, a file name) made safe to write on a terminal.

A server's reply, a model's output or a file's name can hold escape sequences that clear the
screen, set the window title, recolour everything after them or rewrite a line already shown
(carriage return, backspace). Everything bound for a terminal passes through `terminal_text`:
whole ESC sequences (CSI, OSC, DCS and the rest) are removed, then every remaining control
character except tab and newline, C1 controls included (U+009B is CSI on some terminals), and the
bidirectional overrides that show a name other than it is.
No ESC survives, so a sequence split across two tokens cannot form either. Text for a pipe or a
file is data and stays as it came.
"""

from __future__ import annotations

import re
from typing import TextIO

from llmrun.runners.lists import whole

_SEQUENCE = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]"  # CSI: colours, cursor moves, clear screen
    r"|\x1b[\]PX^_][^\x07\x1b]*(?:\x07|\x1b\\)?"  # OSC (window title, links), DCS, SOS, PM, APC
    r"|\x1b[ -/]*[0-~]"  # two-character escapes (charset switches, reset)
)
# C0 and C1 controls but tab and newline; and Unicode's bidirectional embeddings, overrides and
# isolates (U+202A-E, U+2066-9): on a terminal that orders text by direction (VTE, Konsole,
# mlterm), a name holding U+202E shows `evil<U+202E>txt.exe` as "evilexe.txt" (Trojan Source,
# CVE-2021-42574).
# The marks (U+200E/F, U+061C) are kept: they order no text, and right-to-left text uses them.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def terminal_text(text: str) -> str:
    """`text` with escape sequences and control characters taken out (tab and newline kept;
    CRLF becomes LF)."""
    if text.isprintable():
        return text
    return _CONTROL.sub("", _SEQUENCE.sub("", text.replace("\r\n", "\n")))


def terminal_line(text: str) -> str:
    """One line for a message: `terminal_text` with newlines and tabs as spaces."""
    return " ".join(terminal_text(text).split())


def is_terminal(stream: object) -> bool:
    """Whether `stream` is a terminal (False for a stream without isatty, or a closed one)."""
    try:
        return bool(stream.isatty())  # type: ignore[attr-defined]
    except (AttributeError, ValueError, OSError):
        return False


def for_stream(text: str, stream: TextIO) -> str:
    """`text` as written to `stream`: `terminal_text` where it is a terminal (records in csv,
    json or md hold a server's words), as it came where it is a pipe or a file (data)."""
    return terminal_text(text) if is_terminal(stream) else text


ECHO_CHARS = 60  # what a message quotes of a person's input or a stored value, at most


def terminal_echo(text: str, most: int = ECHO_CHARS) -> str:
    """Input quoted back in a message (a command, a value, a path): one line, and past `most`
    characters cut, with the length, so that a paste of 200,000 characters is not said back."""
    line = terminal_line(text)
    if len(line) <= most:
        return line
    return f"{line[:most].rstrip()}... ({len(text):,} characters)"


def fold(text: str, width: int | None, *, indent: int = 2) -> str:
    """`text` folded at spaces to `width` columns, each further line indented by `indent`; as
    it is where `width` is None (a pipe or a file: data, not a screen). A terminal that folds a
    line itself cuts it mid-word (`first sam` / `ple`); a word longer than a line stays whole."""
    if width is None or len(text) < width:
        return text
    import textwrap

    return textwrap.fill(
        text,
        width=max(indent + 8, width - 1),  # the last column: some terminals wrap on it
        subsequent_indent=" " * indent,
        break_long_words=False,
        break_on_hyphens=False,
    )


def terminal_width(stream: TextIO | None = None) -> int | None:
    """The width to fold plain lines for a person at: COLUMNS or the terminal's columns; None
    when the stream (stderr by default) is not a terminal."""
    import os
    import sys

    stream = sys.stderr if stream is None else stream
    try:
        if not stream.isatty():
            return None
        fd = stream.fileno()
    except (ValueError, AttributeError, OSError):
        return None
    columns = whole(os.environ.get("COLUMNS", ""))
    if columns:
        return columns
    try:
        return os.get_terminal_size(fd).columns or None
    except OSError:
        return None


def say(line: str) -> None:
    """One line on stderr for a person (a warning, a note): folded at spaces on a terminal."""
    import sys

    print(fold(line, terminal_width()), file=sys.stderr, flush=True)


def set_verbose(on: bool) -> None:
    """bench -v: llama.cpp's log on stderr as it comes, made safe on a terminal (it names the
    model file's own strings, which could clear the screen or set the window title)."""
    from llmrun.runners import library

    library.echo_log = _echo_log if on else None


def _echo_log(line: str) -> None:
    import os

    os.write(2, (terminal_text(line) if os.isatty(2) else line).encode(errors="replace"))
