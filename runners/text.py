"""Turn token bytes into text incrementally: O(1) per token, never half a character.

Each token's bytes go through an incremental UTF-8 decoder, which holds back an incomplete
multi-byte sequence until the next token completes it. Stop strings are matched on the decoded
text; a tail that could still become a stop string is held back until it cannot.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence


class TextStream:
    def __init__(self, stop: Sequence[str] = ()) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = tuple(s for s in stop if s)
        self._longest_stop = max((len(s) for s in self._stop), default=0)
        self._pending = ""
        self.stopped = False

    def feed(self, piece: bytes) -> str:
        """Add one token's bytes; return the text that is now safe to show."""
        if self.stopped:
            return ""
        text = self._decoder.decode(piece)
        if not self._stop:
            return text
        self._pending += text
        # A stop string can only start inside the last (pending + longest) characters.
        cut = min((i for s in self._stop if (i := self._pending.find(s)) >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            out, self._pending = self._pending[:cut], ""
            return out
        hold = self._held_tail()
        out = self._pending[: len(self._pending) - hold]
        self._pending = self._pending[len(self._pending) - hold :]
        return out

    def _held_tail(self) -> int:
        """Length of the longest suffix of the pending text that begins some stop string."""
        tail = self._pending[-self._longest_stop :]
        for n in range(min(len(tail), self._longest_stop), 0, -1):
            suffix = tail[-n:]
            if any(s.startswith(suffix) for s in self._stop):
                return n
        return 0

    def flush(self) -> str:
        """The held-back rest at the end of generation (not after a stop string)."""
        if self.stopped:
            return ""
        out = self._pending + self._decoder.decode(b"", final=True)
        self._pending = ""
        return out
