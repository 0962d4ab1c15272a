"""Settings `llmrun bench --tune` found fastest for a model on this machine, and their use.

They are kept in the user's config directory, keyed by the model file (path and size), and fill
in every engine option the user did not give, so `run`, `chat` and `bench` start from them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .base import BenchRunner
from .bench import run_bench
from .limits import check_engine
from .llamacpp import EngineConfig
from .paths import config_dir
from .results import Result
from .sweep import Combo, Shape
from .system import logical_cpus, physical_cores

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
    check_engine(dataclasses.replace(EngineConfig(), **changes), where=str(tuned_file()))
    return dataclasses.replace(config, **changes, tuned=True)


# ---- the search ---------------------------------------------------------------------------

# Prefill, and decode at some depth: flash attention and threads behave differently once the
# KV cache holds a few hundred tokens, where chat spends its time.
SHAPES = (Shape(512, 0), Shape(0, 64, 512))
BATCH_PAIRS = ((256, 256), (512, 256), (512, 512), (1024, 512))


@dataclass(frozen=True)
class Tried:
    combo: Combo
    pp_ts: float | None
    tg_ts: float | None

    @property
    def score(self) -> float:
        """The geometric mean of the rates measured (prefill and decode, or one of them)."""
        rates = [r for r in (self.pp_ts, self.tg_ts) if r]
        return math.prod(rates) ** (1 / len(rates)) if rates else 0.0


def search(
    runner: BenchRunner,
    base: EngineConfig,
    *,
    shapes: Sequence[Shape] | None = None,
    cancel: threading.Event | None = None,
    on_stage: Callable[[str], None] = lambda name: None,
) -> tuple[dict[str, Any], list[Tried]] | None:
    """A short staged search: threads, then flash attention, then batch/ubatch (prefill only).

    Returns the fastest settings (the TUNED_FIELDS) and every setting tried; None if cancelled.
    """
    shapes = shapes or SHAPES
    phys, logical = physical_cores(), logical_cpus()
    tried: list[Tried] = []
    best = Combo(phys, 512, 512, 0, "off")
    stages: list[tuple[str, Callable[[Combo], list[Combo]], Sequence[Shape]]] = [
        ("threads", lambda c: [dataclasses.replace(c, n_threads=t)
                               for t in sorted({phys, logical, max(1, logical // 2),
                                                max(1, phys - 1)})], shapes),
        ("flash attention", lambda c: [dataclasses.replace(c, flash_attn=fa)
                                       for fa in ("off", "on")], shapes),
        ("batch/ubatch", lambda c: [dataclasses.replace(c, n_batch=bb, n_ubatch=ub)
                                    for bb, ub in BATCH_PAIRS], shapes[:1]),
    ]  # fmt: skip
    for name, candidates, stage_shapes in stages:
        on_stage(name)
        rates: dict[Combo, dict[int, float]] = {}
        for event in run_bench(runner, combos=candidates(best), shapes=stage_shapes, reps=2,
                               base=base, cancel=cancel):  # fmt: skip
            if isinstance(event, Result):
                rates.setdefault(event.combo, {})[event.shape.n_gen] = event.avg_ts
        if (cancel is not None and cancel.is_set()) or not rates:
            return None
        stage = [Tried(c, r.get(0), next((v for k, v in r.items() if k), None))
                 for c, r in rates.items()]  # fmt: skip
        tried += stage
        best = max(stage, key=lambda t: t.score).combo
    settings = {name: getattr(best, name) for name in TUNED_FIELDS}
    return settings, tried
