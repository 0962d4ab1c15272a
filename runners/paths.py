"""Where llmrun keeps the user's files, following the XDG base directories.

LLMRUN_HOME, when set, holds all of them (config/, data/, state/) — handy for tests and for
keeping several set-ups apart.
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import BadRequestError


def _base(kind: str, xdg_var: str, default: str) -> Path:
    home = os.environ.get("LLMRUN_HOME")
    if home and not home.strip():  # a folder named " " in the cwd
        raise BadRequestError(f"LLMRUN_HOME={home!r} is blank: give a folder, or unset it")
    if home:
        if os.path.exists(home) and not os.path.isdir(home):
            raise BadRequestError(
                f"LLMRUN_HOME={home!r} is a file: it names the folder that holds llmrun's files"
            )
        return Path(home) / kind
    root = os.environ.get(xdg_var) or str(Path.home() / default)
    return Path(root) / "llmrun"


def config_dir() -> Path:
    """Settings the user (or `llmrun tune`) chose: ~/.config/llmrun."""
    return _base("config", "XDG_CONFIG_HOME", ".config")


def data_dir() -> Path:
    """Results worth keeping, such as the bench history: ~/.local/share/llmrun."""
    return _base("data", "XDG_DATA_HOME", ".local/share")


def state_dir() -> Path:
    """Disposable state, such as the chat's line history: ~/.local/state/llmrun."""
    return _base("state", "XDG_STATE_HOME", ".local/state")
