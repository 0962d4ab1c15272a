"""The llmrun command line: everything that touches the terminal.

When the program itself is `llmrun`, Ctrl-C (or SIGTERM) while Python is still importing the
command's libraries ends it quietly; this is the first llmrun code that runs, so the handler
goes here. `main.main` replaces it once the app is ready.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType

EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143


def interrupted_at_startup(signum: int, frame: FrameType | None) -> None:
    os.write(2, b"llmrun: interrupted\n")
    os._exit(EXIT_TERMINATED if signum == signal.SIGTERM else EXIT_INTERRUPTED)


if os.path.basename(sys.argv[0] if sys.argv else "") == "llmrun":
    signal.signal(signal.SIGINT, interrupted_at_startup)
    signal.signal(signal.SIGTERM, interrupted_at_startup)
