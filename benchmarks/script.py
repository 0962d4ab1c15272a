"""How every script in benchmarks/ ends, as llmrun's own commands end: Ctrl-C is one line and
exit 130, after the script's `finally` blocks have stopped the servers and tools it started
(it was a KeyboardInterrupt traceback); what `main` returns is the exit status."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn


def run(main: Callable[[], int | None]) -> NoReturn:
    try:
        code = main()
    except KeyboardInterrupt:
        print(f"{Path(sys.argv[0]).name}: interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(code)
