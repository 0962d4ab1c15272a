"""Settings `llmrun bench --tune` found fastest for a model on this machine, and their use.

They are kept in the user's config directory, keyed by the model file (path and size), and fill
in every engine option the user did not give, so `run`, `chat` and `bench` start from them.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from .llamacpp import EngineConfig
from .paths import config_dir

TUNED_FIELDS = ("n_threads", "n_batch", "n_ubatch", "flash_attn")


def tuned_file() -> Path:
    return config_dir() / "tuned.json"


def model_key(model_path: str) -> str:
    path = os.path.abspath(model_path)
    try:
        size = os.path.getsize(path)
    except OSError:
        size = -1
    return f"{path}:{size}"


def _read_all() -> dict[str, Any]:
    try:
        data = json.loads(tuned_file().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def load_tuned(model_path: str) -> dict[str, Any] | None:
    entry = _read_all().get(model_key(model_path))
    return entry if isinstance(entry, dict) else None


def save_tuned(model_path: str, settings: dict[str, Any]) -> Path:
    """Store the tuned settings (plus what they measured) for this model file."""
    data = _read_all()
    data[model_key(model_path)] = settings
    path = tuned_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def apply_tuning(config: EngineConfig, model_path: str) -> EngineConfig:
    """Fill the options left unset with the tuned values; marks the config tuned if any were."""
    tuned = load_tuned(model_path)
    if not tuned:
        return config
    changes = {
        name: tuned[name]
        for name in TUNED_FIELDS
        if getattr(config, name) is None and tuned.get(name) is not None
    }
    if not changes:
        return config
    return dataclasses.replace(config, **changes, tuned=True)
