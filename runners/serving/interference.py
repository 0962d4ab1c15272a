"""The interference lab's measurement: one decoding stream's inter-token gaps, alone and under
a scheduling policy while long prompts arrive on the same batched engine."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from llmrun.runners.progress import Tally
from llmrun.runners.stats import percentile
from llmrun.runners.system import busy_machine

from .batching import Arrival, BatchedEngine, Step
from .policy import Policy


@dataclass(frozen=True)
class InterferenceReport:
    """One decoding stream's gaps, alone and under each policy, while long prompts arrive."""

    policy: str
    stream_itl_ms: tuple[float, ...]
    long_ttft_ms: tuple[float, ...]
    steps: tuple[Step, ...]
    throughput_tps: float
    stream_times_s: tuple[float, ...] = ()  # when each of the stream's tokens landed
    n_threads: int | None = None  # the engine context's threads (read back from llama.cpp)
    n_threads_batch: int | None = None
    background_cpus: float | None = None  # other processes' load while it ran

    @property
    def busy(self) -> bool:
        """Measured while other processes took CPU time the engine's threads needed."""
        threads = max(self.n_threads or 1, self.n_threads_batch or 1)
        return busy_machine(self.background_cpus, threads)

    def itl(self, q: float) -> float | None:
        return percentile(list(self.stream_itl_ms), q)

    @property
    def prefill_in_gaps_ms(self) -> float:
        """Time of the steps that carried prefill while the stream was between two tokens."""
        if len(self.stream_times_s) < 2:
            return 0.0
        first, last = self.stream_times_s[0], self.stream_times_s[-1]
        return 1000 * sum(
            s.duration_s for s in self.steps if s.n_prefill and first <= s.start_s < last
        )

    @property
    def prefill_ms(self) -> float:
        return 1000 * sum(s.duration_s for s in self.steps if s.n_prefill)


LONG_TOKENS = 4  # what each long prompt of the interference lab decodes


def interference(
    engine: BatchedEngine,
    policy: Policy | None,
    *,
    stream: Sequence[int],
    stream_tokens: int,
    long_prompts: Sequence[Sequence[int]],
    every_s: float,
    start_s: float = 0.2,
    cancel: threading.Event | None = None,
    progress: Tally | None = None,
) -> InterferenceReport:
    """The stream decodes while the long prompts arrive every `every_s` from `start_s`; with
    policy None the stream runs alone (the baseline). `cancel` stops the engine's loop."""
    arrivals = [Arrival(0.0, tuple(stream), stream_tokens)]
    if policy is not None:
        arrivals += [
            Arrival(start_s + i * every_s, tuple(p), LONG_TOKENS)
            for i, p in enumerate(long_prompts)
        ]
    results, steps = engine.run(
        arrivals, policy or Policy("chunked", engine.n_batch), cancel=cancel, progress=progress
    )
    first, *others = results
    tokens = sum(len(r.output) for r in results)
    span = max((r.times[-1] for r in results if r.times), default=0.0)
    return InterferenceReport(
        policy=str(policy) if policy else "alone",
        stream_itl_ms=tuple(g * 1000 for g in first.gaps_s),
        long_ttft_ms=tuple((r.ttft_s or 0) * 1000 for r in others),
        steps=tuple(steps),
        throughput_tps=tokens / span if span else 0.0,
        stream_times_s=tuple(first.times),
    )
