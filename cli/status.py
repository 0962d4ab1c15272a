"""A one-line live status on a terminal's stderr: load, then prefill progress.

It draws only before the first output token, so it never mixes with the streamed text.
"""

from __future__ import annotations

import os
import sys
from typing import TextIO

from llmrun.runners.base import Event, Finished, LoadStarted, ModelLoaded, PrefillProgress, Token


class StatusLine:
    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.shown = False

    def _show(self, text: str) -> None:
        self.stream.write("\r\x1b[2K" + text)
        self.stream.flush()
        self.shown = True

    def _clear(self) -> None:
        if self.shown:
            self.stream.write("\r\x1b[2K")
            self.stream.flush()
            self.shown = False

    def update(self, event: Event) -> None:
        if isinstance(event, LoadStarted):
            self._show(f"loading {os.path.basename(event.path)} ...")
        elif isinstance(event, ModelLoaded):
            self._clear()
        elif isinstance(event, PrefillProgress):
            new_done = event.done_tokens - event.reused_tokens
            speed = f" · {new_done / event.elapsed_s:,.0f} tok/s" if event.elapsed_s > 0 else ""
            reused = f" ({event.reused_tokens} cached)" if event.reused_tokens else ""
            self._show(f"prefill {event.done_tokens}/{event.total_tokens} tokens{reused}{speed}")
        elif isinstance(event, (Token, Finished)):
            self._clear()

    def close(self) -> None:
        self._clear()
