"""Files that are not what a reader expects, planted where llmrun reads its own state."""

from __future__ import annotations

import os
from pathlib import Path


def plant(path: Path, kind: str, *, cap: int) -> None:
    """Put at `path` a FIFO with no writer, a folder, or a regular file one byte past `cap`
    ("fifo", "folder", "huge"); any other kind is left to the caller."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    elif kind == "huge":
        with path.open("wb") as f:
            f.truncate(cap + 1)
