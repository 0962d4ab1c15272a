"""Settings `llmrun bench --tune` found fastest for a model on this machine, and their use.

They are kept in the user's config directory, keyed by the model file (path and size), and fill
in every engine option the user did not give, so `run`, `chat` and `bench` start from them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
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
# KV cache holds a few hundred tokens, where chat spends its time. Every stage is scored on
# both, so the stages' winners are comparable.
SHAPES = (Shape(256, 0), Shape(0, 64, 256))
BATCH_PAIRS = ((256, 256), (512, 256), (512, 512), (1024, 512))
REPS = 3  # timed repetitions per setting and round
PAIRED_ROUNDS = 2  # a close call is re-measured in A B A B order


@dataclass(frozen=True)
class Tried:
    combo: Combo
    pp_ts: float | None
    tg_ts: float | None
    scores: tuple[float, ...] = ()  # one score per repetition (prefill and decode paired)
    stage: str = ""
    note: str = ""  # "llmrun's defaults", "kept: within the noise", "faster beyond the noise"

    @property
    def score(self) -> float:
        """The geometric mean of the rates measured (prefill and decode, or one of them)."""
        rates = [r for r in (self.pp_ts, self.tg_ts) if r]
        return math.prod(rates) ** (1 / len(rates)) if rates else 0.0

    @property
    def spread(self) -> float:
        """(max - min) / median of the repetitions' scores: the noise this setting showed."""
        if len(self.scores) < 2:
            return 0.0
        mid = statistics.median(self.scores)
        return (max(self.scores) - min(self.scores)) / mid if mid else 0.0


def beats(challenger: Sequence[float], incumbent: Sequence[float]) -> bool:
    """Whether the challenger is faster beyond the noise: its typical (median) score is above
    every score the incumbent reached. Anything closer is a tie, and a tie keeps the incumbent."""
    if not challenger or not incumbent:
        return False
    return statistics.median(challenger) > max(incumbent)


def _measure(
    runner: BenchRunner,
    base: EngineConfig,
    combos: Sequence[Combo],
    shapes: Sequence[Shape],
    cancel: threading.Event | None,
    stage: str,
) -> dict[Combo, Tried] | None:
    """Each combo's rates and per-repetition scores (combos may repeat: paired rounds)."""
    found: dict[Combo, dict[int, list[float]]] = {}
    for event in run_bench(runner, combos=combos, shapes=shapes, reps=REPS, base=base,
                           cancel=cancel):  # fmt: skip
        if isinstance(event, Result):
            found.setdefault(event.combo, {}).setdefault(event.shape.n_gen, []).extend(
                event.samples_ts
            )
    if (cancel is not None and cancel.is_set()) or not found:
        return None
    out = {}
    for combo, by_shape in found.items():
        pp, tg = by_shape.get(0, []), next((v for k, v in by_shape.items() if k), [])
        pairs = list(zip(pp, tg, strict=False)) if pp and tg else [(x,) for x in pp or tg]
        scores = tuple(math.prod(p) ** (1 / len(p)) for p in pairs)
        out[combo] = Tried(combo, statistics.fmean(pp) if pp else None,
                           statistics.fmean(tg) if tg else None, scores, stage)  # fmt: skip
    return out


def search(
    runner: BenchRunner,
    base: EngineConfig,
    *,
    shapes: Sequence[Shape] | None = None,
    cancel: threading.Event | None = None,
    on_stage: Callable[[str], None] = lambda name: None,
) -> tuple[dict[str, Any], list[Tried]] | None:
    """A short staged search from llmrun's defaults: threads, flash attention, batch/ubatch.

    Each stage measures the incumbent beside its alternatives on the same workload; the fastest
    alternative replaces it only when faster beyond the noise (`beats`), and a close call is
    measured again in paired A B A B rounds first. Returns the chosen settings (TUNED_FIELDS)
    and every setting tried, each listed once; None if cancelled.
    """
    shapes = shapes or SHAPES
    phys, logical = physical_cores(), logical_cpus()
    best = Combo(phys, 512, 512, None, "off")
    tried: dict[Combo, Tried] = {}
    stages: list[tuple[str, Callable[[Combo], list[Combo]]]] = [
        ("threads", lambda c: [dataclasses.replace(c, n_threads=t)
                               for t in sorted({phys, logical, max(1, logical // 2),
                                                max(1, phys - 1)})]),
        ("flash attention", lambda c: [dataclasses.replace(c, flash_attn=fa)
                                       for fa in ("off", "on")]),
        ("batch/ubatch", lambda c: [dataclasses.replace(c, n_batch=bb, n_ubatch=ub)
                                    for bb, ub in BATCH_PAIRS]),
    ]  # fmt: skip
    for name, candidates in stages:
        on_stage(name)
        combos = list(dict.fromkeys([best, *candidates(best)]))
        stage = _measure(runner, base, combos, shapes, cancel, name)
        if stage is None or best not in stage:
            return None
        incumbent = stage[best]
        challenger = max((t for c, t in stage.items() if c != best), key=lambda t: t.score,
                         default=None)  # fmt: skip
        if challenger is not None and challenger.score > incumbent.score:
            if not beats(challenger.scores, incumbent.scores):  # close: measure again, paired
                on_stage(f"{name}: re-measuring {challenger.combo.describe()} against"
                         f" {best.describe()} in A B order")  # fmt: skip
                again = _measure(runner, base, [best, challenger.combo] * PAIRED_ROUNDS, shapes,
                                 cancel, name)  # fmt: skip
                if again is None:
                    return None
                incumbent, challenger = again[best], again[challenger.combo]
            if beats(challenger.scores, incumbent.scores):
                stage[challenger.combo] = dataclasses.replace(
                    challenger, note="chosen: faster beyond the noise"
                )
                best = challenger.combo
            else:
                stage[challenger.combo] = dataclasses.replace(
                    challenger, note="not chosen: within the noise"
                )
        for combo, t in stage.items():
            if combo not in tried:  # the baseline and each setting are listed once
                note = t.note or ("llmrun's defaults" if not tried else "")
                tried[combo] = dataclasses.replace(t, note=note)
            elif t.note:
                tried[combo] = dataclasses.replace(tried[combo], note=t.note)
    settings = {name: getattr(best, name) for name in TUNED_FIELDS}
    return settings, list(tried.values())
