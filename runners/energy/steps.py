"""A server's energy by phase: its engine steps batch several requests, so the counters are
read around each step and its joules go to what the step carried (prompt tokens only:
prefill; generated tokens only: decode; both: mixed), never split by an estimate.

The joules counted are the counters' own, idle included, so that the totals only go up, as a
Prometheus counter must: the idle power and the steps' seconds are kept beside them, and the
energy above idle is `joules - idle_w * seconds`."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from llmrun.runners.errors import BadRequestError
from llmrun.runners.stats import EngineSettings

from .counter import Counter, Unavailable
from .meter import on_nvidia_gpu


@dataclass(frozen=True)
class StepReading:
    phase: str  # prefill, decode or mixed
    joules: float  # the counters' joules over the step, idle included
    seconds: float  # between the two reads


def step_phase(n_prefill: int, n_decode: int) -> str:
    if n_prefill and n_decode:
        return "mixed"
    return "prefill" if n_prefill else "decode"


class StepEnergy:
    """Reads the counters before and after each engine step (on the engine's thread)."""

    def __init__(
        self,
        counters: list[Counter],
        *,
        idle_w: float = 0.0,
        reason: str = "",
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._counters = counters
        self.idle_w = idle_w
        self.reason = reason  # why there are no counters, or why they stopped
        self._clock = clock
        self._start: tuple[float, float] | None = None

    @property
    def source(self) -> str:
        return " + ".join(c.name for c in self._counters)

    @property
    def measured(self) -> bool:
        return bool(self._counters) and not self.reason

    def _read(self) -> tuple[float, float] | None:
        if not self.measured:
            return None
        try:
            joules = sum(c.read_j() for c in self._counters)
        except Unavailable as e:
            self.reason = str(e)
            return None
        return self._clock(), joules

    def before(self) -> None:
        self._start = self._read()

    def after(self, *, n_prefill: int, n_decode: int) -> StepReading | None:
        """The step just ended: its joules, or None where nothing was read."""
        start, self._start = self._start, None
        if start is None or (end := self._read()) is None:
            return None
        joules = max(0.0, end[1] - start[1])  # the counters undo wraparound: never below 0
        return StepReading(step_phase(n_prefill, n_decode), joules, end[0] - start[0])

    def close(self) -> None:
        for counter in self._counters:
            counter.close()
        self._counters = []


def open_steps(mode: str, settings: EngineSettings | None) -> StepEnergy | None:
    """The server's step meter --energy asks for (the idle baseline measured now, while no
    request runs): None when off; with `on`, a usage error where no counter can be read."""
    if mode == "off":
        return None
    from . import open_meter

    gpu = on_nvidia_gpu(settings)
    meter = open_meter(gpu=gpu)
    counters, idle_w, reason = meter.selection(gpu=gpu)
    for counter in meter.counters:
        if counter not in counters:  # NVML where no layer runs on the GPU
            counter.close()
    if mode == "on" and not counters:
        from .nvml import install_hint

        hint = None if gpu else install_hint()  # with gpu, the reason has NVML's own
        why = "; ".join(filter(None, (reason, hint and f"GPU: {hint}")))
        raise BadRequestError(f"--energy on: no energy counter can be read here ({why})")
    return StepEnergy(counters, idle_w=idle_w, reason=reason)
