"""Text from outside (a model, a server, a file name) made safe to write on a terminal.

A server's reply, a model's output or a file's name can hold escape sequences that clear the
screen, set the window title, recolour everything after them or rewrite a line already shown
(carriage return, backspace). Everything bound for a terminal passes through `terminal_text`:
whole ESC sequences (CSI, OSC, DCS and the rest) are removed, then every remaining control
character except tab and newline, C1 controls included (U+009B is CSI on some terminals).
No ESC survives, so a sequence split across two tokens cannot form either. Text for a pipe or a
file is data and stays as it came.
"""

from __future__ import annotations

import re

_SEQUENCE = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]"  # CSI: colours, cursor moves, clear screen
    r"|\x1b[\]PX^_][^\x07\x1b]*(?:\x07|\x1b\\)?"  # OSC (window title, links), DCS, SOS, PM, APC
    r"|\x1b[ -/]*[0-~]"  # two-character escapes (charset switches, reset)
)
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def terminal_text(text: str) -> str:
    """`text` with escape sequences and control characters taken out (tab and newline kept;
    CRLF becomes LF)."""
    if text.isprintable():
        return text
    return _CONTROL.sub("", _SEQUENCE.sub("", text.replace("\r\n", "\n")))


def terminal_line(text: str) -> str:
    """One line for a message: `terminal_text` with newlines and tabs as spaces."""
    return " ".join(terminal_text(text).split())
