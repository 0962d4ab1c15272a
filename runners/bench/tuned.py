"""The settings `llmrun tune` found, kept per model file in the config folder's tuned.json,
and their use: they fill in the engine options a command left unset before it loads. Apart
from the search (tuning.py, which needs the benchmark and numpy), so that a command's start
imports neither."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
from pathlib import Path
from typing import Any

from llmrun.runners.config import EngineConfig
from llmrun.runners.errors import STRICT_JSON, BadRequestError, long_integer, not_utf8
from llmrun.runners.files import FileTooLargeError, atomic_write, read_capped
from llmrun.runners.limits import SettingError, check_engine
from llmrun.runners.paths import config_dir

TUNED_FIELDS = ("n_threads", "n_threads_batch", "n_batch", "n_ubatch", "flash_attn", "repack")
# What each workload asks of the engine: (prompt tokens, output tokens) of a typical request.
WORKLOADS = {"chat": (64, 256), "document": (1024, 16)}


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
    """Every model's tuning; {} when nothing was saved yet. A file that is not a JSON object
    (RFC 8259: no trailing commas, no comments) is an error naming it, never read as empty,
    so that a later save cannot replace the other models' settings with one entry."""
    path = tuned_file()
    try:
        if not stat.S_ISREG(path.stat().st_mode):  # a FIFO would block the open for ever
            raise SettingError(str(path), "not a regular file (a FIFO, a device?); delete it")
        text = read_capped(path, max_bytes=16 * 2**20, what="tuning file").decode("utf-8")
        data = json.loads(text, **STRICT_JSON)
    except (FileNotFoundError, NotADirectoryError):  # nothing saved (a parent may be a file)
        return {}
    except OSError as e:
        raise SettingError(str(path), f"cannot read it: {e.strerror or e}") from None
    except FileTooLargeError as e:
        raise SettingError(str(path), f"{e}; fix or delete it") from None
    except UnicodeDecodeError as e:
        raise SettingError(str(path), f"{not_utf8(e)}; fix or delete it") from None
    except json.JSONDecodeError as e:
        raise SettingError(
            str(path),
            f"not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); fix or"
            " delete it (it holds llmrun tune's settings for every model)",
        ) from None
    except RecursionError:
        raise SettingError(
            str(path), "nested too deep to be tuned settings; fix or delete it"
        ) from None
    except SettingError:
        raise
    except BadRequestError as e:  # NaN, or 1e999 (STRICT_JSON): no setting is either
        raise SettingError(str(path), f"{e}; fix or delete it") from None
    except ValueError:  # valid JSON past what Python's int reads (sys.get_int_max_str_digits)
        raise SettingError(
            str(path),
            f"holds {long_integer()}, no setting; fix or delete it",
        ) from None
    if not isinstance(data, dict):
        raise SettingError(str(path), "not a JSON object of tuned settings; fix or delete it")
    return data


def check_tuned_file() -> None:
    """Refuse a tuning file that a save would refuse, before a search fills it (SettingError)."""
    _read_all()


def load_tuned(model_path: str) -> dict[str, Any] | None:
    entry = _read_all().get(model_key(model_path))
    return entry if isinstance(entry, dict) else None


def save_tuned(model_path: str, settings: dict[str, Any]) -> Path:
    """Store the tuned settings (plus what they measured) for this model file."""
    data = _read_all()
    key = model_key(model_path)
    old = data.get(key)
    if set(settings) <= set(WORKLOADS) and isinstance(old, dict) and set(old) <= set(WORKLOADS):
        settings = {**old, **settings}  # a workload tuned again; the others stay as they were
    data[key] = settings
    path = tuned_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(data, indent=2) + "\n")
    return path


def tuned_for(entry: dict[str, Any], workload: str) -> dict[str, Any] | None:
    """The settings a model's entry holds for the workload, as run, chat and bench apply them;
    an entry saved before workloads existed is one set for all."""
    tuned = entry.get(workload)
    if isinstance(tuned, dict):
        return tuned or None
    if not any(isinstance(v, dict) for v in entry.values()):
        return entry or None
    return None


def saved_tuning(model_path: str) -> str:
    """What tune saved for this model, read as `tuned_for` reads it: 'tuned for chat (partial:
    stopped by --budget after 8 trials) in PATH'; '' where nothing is."""
    entry = load_tuned(model_path)
    parts = []
    for workload in WORKLOADS:
        tuned = tuned_for(entry, workload) if entry else None
        if tuned:
            partial = tuned.get("partial")
            parts.append(f"{workload} (partial: {partial})" if partial else workload)
    return f"tuned for {' and '.join(parts)} in {tuned_file()}" if parts else ""


def apply_tuning(config: EngineConfig, model_path: str) -> EngineConfig:
    """Fill the options left unset with the values tuned for the config's workload (chat, or
    document for a long prompt); marks the config tuned if any were."""
    entry = load_tuned(model_path)
    tuned = tuned_for(entry, config.workload) if entry else None
    if not tuned:
        return config
    saved = {name: tuned[name] for name in TUNED_FIELDS if tuned.get(name) is not None}
    # the whole entry: a value the command line (or run's thread count on a busy machine) set
    # already would otherwise pass unchecked one time and be refused the next
    check_engine(dataclasses.replace(EngineConfig(), **saved), where=str(tuned_file()))
    changes = {name: value for name, value in saved.items() if getattr(config, name) is None}
    if not changes:
        return config
    return dataclasses.replace(config, **changes, tuned=True)
