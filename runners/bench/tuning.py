"""`llmrun tune`'s search for the settings fastest for a model on this machine.

What it finds is kept in the user's config directory, keyed by the model file (path and size),
and fills in every engine option the user did not give (tuned.py), so `run`, `chat` and
`bench` start from them.
"""

from __future__ import annotations

import dataclasses
import re
import statistics
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from llmrun.runners.base import BenchRunner
from llmrun.runners.config import DEFAULT_N_BATCH, EngineConfig
from llmrun.runners.errors import OptionError
from llmrun.runners.system import (
    ThreadChoice,
    background_now,
    busy_machine,
    choose_threads,
    default_threads,
    logical_cpus,
)

from .measure import BenchPlan, Progress, every_shape, run_bench
from .results import Result
from .sweep import Combo, Shape
from .tuned import TUNED_FIELDS, WORKLOADS

MAX_BUDGET_S = 7 * 86400.0
_DURATION = re.compile(
    r"(?:([0-9]+(?:\.[0-9]+)?)h)?(?:([0-9]+(?:\.[0-9]+)?)m)?(?:([0-9]+(?:\.[0-9]+)?)s)?"
)


def parse_budget(text: str, *, name: str = "--budget") -> float:
    """A time budget in seconds from `90`, `90s`, `5m`, `1.5h` or `1h30m`: above 0, at most a
    week; anything else (spaces, signs, other units, nothing) is refused."""
    if re.fullmatch(r"[0-9]+(?:\.[0-9]+)?", text):
        seconds = float(text)
    elif text and (m := _DURATION.fullmatch(text)):
        h, mins, secs = (float(g) if g else 0.0 for g in m.groups())
        seconds = h * 3600 + mins * 60 + secs
    else:
        raise OptionError(f"{name}: '{text}' is not a duration such as 90s, 5m or 1h30m")
    if not 0 < seconds <= MAX_BUDGET_S:
        raise OptionError(f"{name}: '{text}' must be above 0 and at most a week")
    return seconds


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
    samples: tuple[tuple[float, float], ...] = ()  # (pp, tg) tok/s of each repetition
    stage: str = ""
    note: str = ""  # per workload: "chat: chosen ...; document: not chosen ..."
    background_cpus: float | None = None  # other processes' load, the most of its tests
    busy: bool = False  # that load left llama.cpp's threads short: its figures may be noise

    def scores(self, workload: str) -> tuple[float, ...]:
        """Per repetition: the tokens of the workload's request per second of its time."""
        prompt, output = WORKLOADS[workload]
        return tuple(
            (prompt + output) / (prompt / pp + output / tg)
            for pp, tg in self.samples
            if pp > 0 and tg > 0
        )

    def score(self, workload: str = "chat") -> float:
        values = self.scores(workload)
        return statistics.median(values) if values else 0.0

    def spread(self, workload: str = "chat") -> float:
        """(max - min) / median of the repetitions' scores: the noise this setting showed."""
        values = self.scores(workload)
        if len(values) < 2:
            return 0.0
        mid = statistics.median(values)
        return (max(values) - min(values)) / mid if mid else 0.0


def beats(challenger: Sequence[float], incumbent: Sequence[float]) -> bool:
    """Whether the challenger is faster beyond the noise: its typical (median) score is above
    every score the incumbent reached. Anything closer is a tie, and a tie keeps the incumbent."""
    if not challenger or not incumbent:
        return False
    return statistics.median(challenger) > max(incumbent)


@dataclass(frozen=True)
class TuneProgress:
    """Where the search is: its stage, the settings measured (a close call measured again
    counts again) of those it expects to measure, and the share done of the one under way."""

    stage: str
    trials: int
    planned: int  # grows when a later stage or workload needs settings not foreseen
    share: float = 0.0

    @property
    def fraction(self) -> float:
        return min(1.0, (self.trials + self.share) / self.planned) if self.planned else 0.0


@dataclass(frozen=True)
class Found:
    """The search's outcome: the settings chosen per workload (TUNED_FIELDS), every setting
    tried, each once, and whether it was stopped (Ctrl-C, SIGTERM or its time budget) before
    the end, in which case the choice is made from what was measured."""

    chosen: dict[str, dict[str, Any]]
    tried: list[Tried]
    trials: int  # settings measured (a close call measured again counts again)
    stopped: bool = False
    cut: tuple[Tried, ...] = ()  # settings a stop cut short: the shapes they finished

    @property
    def busy(self) -> list[Tried]:
        """The settings measured while other processes left llama.cpp's threads short."""
        return [t for t in (*self.tried, *self.cut) if t.busy]


class _Measured:
    """Every combo's (pp, tg) samples so far; a combo is measured once unless asked again.
    Once a run is stopped, nothing more is measured: the search decides from what is here."""

    def __init__(
        self,
        runner: BenchRunner,
        base: EngineConfig,
        shapes: Sequence[Shape],
        cancel: threading.Event | None,
        on_progress: Callable[[TuneProgress], None],
    ) -> None:
        self.runner, self.base, self.shapes, self.cancel = runner, base, shapes, cancel
        self.on_progress = on_progress
        self.samples: dict[Combo, list[tuple[float, float]]] = {}
        self.cut: dict[Combo, tuple[list[float], list[float]]] = {}  # a stopped trial's pp, tg
        self.background: dict[Combo, float] = {}  # other processes' load, the most per combo
        self.busy: set[Combo] = set()
        self.stage: dict[Combo, str] = {}
        self.trials = 0
        self.planned = 0
        self.stopped = False

    def plan(self, stage: str, todo: int) -> None:
        """A stage starts and expects `todo` more trials after it."""
        self.planned = self.trials + todo
        self.on_progress(TuneProgress(stage, self.trials, self.planned))

    def run(self, combos: Sequence[Combo], stage: str, *, again: bool = False) -> bool:
        """Measure the combos not measured yet (all of them `again`); False once stopped."""
        todo = [c for c in combos if again or c not in self.samples]
        if self.stopped:
            return False
        if not todo:
            return True
        if again:  # a close call measured again: trials no stage foresaw
            self.planned += len(todo)
        self.planned = max(self.planned, self.trials + len(todo))
        runs = len(self.shapes) * (REPS + 1)  # a trial's runs, its warm-ups included
        found: dict[Combo, dict[int, list[float]]] = {}
        plan = BenchPlan(every_shape(todo, self.shapes), reps=REPS)
        for event in run_bench(self.runner, plan, base=self.base, cancel=self.cancel):
            if isinstance(event, Result):
                found.setdefault(event.combo, {}).setdefault(event.shape.n_gen, []).extend(
                    event.samples_ts
                )
                self._note_load(event)
            elif isinstance(event, Progress):
                done = event.done + (event.fraction if event.moment == "working" else 0.0)
                whole, part = divmod(done / runs, 1.0)
                self.on_progress(TuneProgress(stage, self.trials + int(whole), self.planned, part))
        self.stopped = self.cancel is not None and self.cancel.is_set()
        for combo, by_shape in found.items():
            pp = by_shape.get(0, [])
            tg = next((v for k, v in by_shape.items() if k), [])
            if len(by_shape) < len(self.shapes):
                self.cut.setdefault(combo, (pp, tg))  # cut short by a stop: not a whole trial
                continue
            self.samples.setdefault(combo, []).extend(zip(pp, tg, strict=False))
            self.stage.setdefault(combo, stage)
            self.trials += todo.count(combo)
        self.on_progress(TuneProgress(stage, self.trials, self.planned))
        return not self.stopped

    def _note_load(self, result: Result) -> None:
        load = result.background_cpus
        if load is None:
            return
        combo = result.combo
        self.background[combo] = max(load, self.background.get(combo, 0.0))
        threads = max(combo.n_threads or 1, combo.n_threads_batch or 1)
        if busy_machine(load, threads):
            self.busy.add(combo)

    def tried(self, combo: Combo, note: str = "", *, cut: bool = False) -> Tried:
        """A combo's mean rates and samples; `cut`: those of the shapes a stop cut short."""
        pairs = tuple(self.samples.get(combo, ()))  # none when cut: no trial of it was whole
        pp, tg = [p for p, _ in pairs], [t for _, t in pairs]
        if cut:
            pp, tg = self.cut[combo]
        return Tried(
            combo,
            statistics.fmean(pp) if pp else None,
            statistics.fmean(tg) if tg else None,
            pairs,
            self.stage.get(combo, ""),
            note,
            self.background.get(combo),
            combo in self.busy,
        )

    def cut_short(self) -> tuple[Tried, ...]:
        """The trials a stop cut short, with the rates of the shapes they finished."""
        cut = [c for c in self.cut if c not in self.samples]
        return tuple(self.tried(c, "cut short by the stop", cut=True) for c in cut)


def start_threads() -> ThreadChoice:
    """The thread count the search starts from: run's choice, the cores that other processes
    leave free (on a busy machine, 1 of 2 where a quiet one gets 2)."""
    return choose_threads(default_threads(), background_now(), logical_cpus())


@dataclass(frozen=True, kw_only=True)
class TunePlan:
    """What a search tunes, built by its caller: the workloads, the shapes each trial measures
    (None: SHAPES) and the thread count it starts from (None: the physical cores)."""

    workloads: Sequence[str] = tuple(WORKLOADS)
    shapes: Sequence[Shape] | None = None
    threads: int | None = None


Stages = list[tuple[str, Callable[[Combo], list[Combo]]]]


def _stages(phys: int, logical: int) -> Stages:
    """The search's stages in order: each one's name and the alternatives to an incumbent."""
    return [
        (
            "threads",
            lambda c: [
                dataclasses.replace(c, n_threads=t, n_threads_batch=t)
                for t in sorted({phys, logical, max(1, logical // 2), max(1, phys - 1)})
            ],
        ),
        (
            "flash attention",
            # auto (run's default, the first setting's) is llama.cpp's choice of one of these
            lambda c: [dataclasses.replace(c, flash_attn=fa) for fa in ("off", "on")],
        ),
        ("repacking", lambda c: [dataclasses.replace(c, repack=r) for r in (True, False)]),
        (
            "batch/ubatch",
            lambda c: [dataclasses.replace(c, n_batch=bb, n_ubatch=ub) for bb, ub in BATCH_PAIRS],
        ),
        (
            "prefill threads",
            lambda c: [
                dataclasses.replace(c, n_threads_batch=t)
                for t in sorted({c.n_threads or phys, logical})
            ],
        ),
    ]


@dataclass
class _Search:
    """One search across its stages and workloads: what is measured, the stages, and the notes
    each setting earns on the way."""

    measured: _Measured
    stages: Stages
    on_stage: Callable[[str], None]
    notes: dict[Combo, list[str]]

    def unmeasured(self, best: Combo, first: int) -> int:
        """Trials the stages from `first` on need if the incumbent stays."""
        seen = set(self.measured.samples)
        for _, candidates in self.stages[first:]:
            seen.update([best, *candidates(best)])
        return len(seen) - len(self.measured.samples)

    def settle(
        self, best: Combo, combos: list[Combo], name: str, stage: str, workload: str
    ) -> Combo:
        """The stage's setting for the workload: its fastest rival where that beats the
        incumbent beyond the noise (a close call measured again in A B order first), else the
        incumbent."""
        measured, notes = self.measured, self.notes
        rivals = [measured.tried(c) for c in combos if c != best and c in measured.samples]
        if not rivals:
            return best
        rival = max(rivals, key=lambda t: t.score(workload))
        incumbent = measured.tried(best)
        if rival.score(workload) <= incumbent.score(workload):
            return best
        if not beats(rival.scores(workload), incumbent.scores(workload)):
            if not measured.stopped:
                self.on_stage(
                    f"{stage}: re-measuring {rival.combo.describe()} against"
                    f" {best.describe()} in A B order"
                )
                measured.run([best, rival.combo] * PAIRED_ROUNDS, name, again=True)
            rival, incumbent = measured.tried(rival.combo), measured.tried(best)
        if beats(rival.scores(workload), incumbent.scores(workload)):
            notes.setdefault(rival.combo, []).append(f"{workload}: faster beyond the noise")
            return rival.combo
        notes.setdefault(rival.combo, []).append(f"{workload}: within the noise")
        return best


def search(
    runner: BenchRunner,
    base: EngineConfig,
    plan: TunePlan | None = None,
    *,
    cancel: threading.Event | None = None,
    on_stage: Callable[[str], None] = lambda name: None,
    on_progress: Callable[[TuneProgress], None] = lambda progress: None,
) -> Found | None:
    """A staged search from llmrun's defaults, for each of the plan's workloads: threads,
    flash attention, repacking, batch/ubatch, prefill threads.

    Each stage compares the incumbent with its alternatives on the same measurements; the best
    alternative for the workload replaces it only when faster beyond the noise (`beats`), and a
    close call is measured again in paired A B A B rounds first. The workloads share every
    measurement, so tuning for both costs little more than for one. When `cancel` is set (Ctrl-C,
    a time budget) nothing more is measured, and every stage decides from the settings already
    measured whole (a close call stays a tie). The plan's `threads`: where the search starts
    (`start_threads`), else the physical cores. With not even the first setting measured
    whole: None, or the shapes it finished (`cut`) when a stop cut it short.
    """
    plan = plan or TunePlan()
    shapes = plan.shapes or SHAPES
    phys, logical = default_threads(), logical_cpus()
    measured = _Measured(runner, base, shapes, cancel, on_progress)
    start = plan.threads or phys
    # run's own settings when no option is given: its thread choice, batch and ubatch 512,
    # flash attention as llama.cpp's auto decides it (EngineConfig's None), repacking where safe
    baseline = Combo(start, DEFAULT_N_BATCH, DEFAULT_N_BATCH, None, "auto", n_threads_batch=start)
    notes: dict[Combo, list[str]] = {baseline: ["llmrun's defaults"]}
    searching = _Search(measured, _stages(phys, logical), on_stage, notes)
    chosen: dict[str, dict[str, Any]] = {}
    for workload in plan.workloads:
        best = baseline
        for i, (name, candidates) in enumerate(searching.stages):
            stage = f"{name} ({workload})"
            combos = list(dict.fromkeys([best, *candidates(best)]))
            if not measured.stopped:
                on_stage(stage)
                measured.plan(stage, searching.unmeasured(best, i))
                measured.run(combos, name)
            if best not in measured.samples:
                if not measured.samples:
                    cut = measured.cut_short()
                    return Found({}, [], 0, stopped=True, cut=cut) if cut else None
                break  # the incumbent was never measured: the stages after wait on it
            best = searching.settle(best, combos, name, stage, workload)
        chosen[workload] = {field: getattr(best, field) for field in TUNED_FIELDS}
        notes.setdefault(best, []).append(f"chosen for {workload}")
    tried = [measured.tried(c, "; ".join(notes.get(c, []))) for c in measured.samples]
    return Found(chosen, tried, measured.trials, measured.stopped, measured.cut_short())
