"""`/metrics` of `llmrun serve` in Prometheus' text format, through prometheus-client.

Beyond llama-server's token totals: the phases as histograms (queue wait, TTFT, prefill, every
inter-token gap) and each engine step's batch composition (prefill tokens vs decode tokens), the
figure a scheduling policy changes; with --energy, the joules of the steps by phase.
The metrics are declared in tables (COUNTERS, HISTOGRAMS, GAUGES), registered in one loop each.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.metrics_core import InfoMetricFamily
from prometheus_client.registry import Collector

from llmrun.runners.energy.steps import StepEnergy
from llmrun.runners.system import BackgroundMeter, busy_machine

from .api_engine import FINISH_CANCELLED, EngineThread, RequestTimings, StepRecord

__all__ = ["CONTENT_TYPE", "ServerMetrics"]

LATENCY_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
GAP_S = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.0)
TOKENS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)

# The counters: attribute, name, help, labels
COUNTERS: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    (
        "requests",
        "llmrun_requests",
        "Responses, each counted once, by route (chat, completions, models, health, metrics,"
        " props, tokenize, other: a path with no route) and outcome (ok, bad_request,"
        " not_found, method_not_allowed, too_large, timeout, busy, too_many_connections,"
        " forbidden, cancelled, error).",
        ("route", "outcome"),
    ),
    ("prompt_tokens", "llmrun_prompt_tokens", "Prompt tokens received.", ()),
    (
        "reused_tokens",
        "llmrun_reused_tokens",
        "Prompt tokens found in a sequence's cache (not prefilled).",
        (),
    ),
    (
        "generated",
        "llmrun_generated_tokens",
        "Tokens generated, the end token of an answer that ended on it included"
        " (usage.completion_tokens).",
        (),
    ),
)

# The histograms: attribute, name, help, buckets
HISTOGRAMS: tuple[tuple[str, str, str, tuple[float, ...]], ...] = (
    (
        "queue",
        "llmrun_queue_wait_seconds",
        "From the request's tokens until a sequence is free for it (the serving figures' queue).",
        LATENCY_S,
    ),
    (
        "step_wait",
        "llmrun_step_wait_seconds",
        "After the queue, until the first engine step carrying the prompt starts.",
        LATENCY_S,
    ),
    ("ttft", "llmrun_ttft_seconds", "From the request's arrival to its first token.", LATENCY_S),
    (
        "prefill",
        "llmrun_prefill_seconds",
        "From the first to the last step carrying the request's prompt.",
        LATENCY_S,
    ),
    ("itl", "llmrun_itl_seconds", "Every gap between two generated tokens of a request.", GAP_S),
    ("step_prefill", "llmrun_step_prefill_tokens", "Prompt tokens in each engine step.", TOKENS),
    ("step_decode", "llmrun_step_decode_tokens", "Decode tokens in each engine step.", TOKENS),
    ("step_seconds", "llmrun_step_seconds", "Each engine step's llama_decode.", LATENCY_S),
)

# The gauges, read when scraped: name, help, how to read it off the metrics
GAUGES: tuple[tuple[str, str, Callable[[ServerMetrics], float]], ...] = (
    (
        "llmrun_requests_in_flight",
        "Requests holding a sequence (prefilling or decoding).",
        lambda m: m.running(),
    ),
    ("llmrun_requests_queued", "Requests waiting for a free sequence.", lambda m: m.queued()),
    (
        "llmrun_connections",
        "Open HTTP connections (idle kept-alive ones too).",
        lambda m: m.connections(),
    ),
    (
        "llmrun_connections_max",
        "Connections served at once (--max-connections); more get 503.",
        lambda m: m.max_connections,
    ),
    (
        "llmrun_engine_threads",
        "CPU threads of the engine's one-token steps.",
        lambda m: m.threads[0],
    ),
    (
        "llmrun_engine_threads_batch",
        "CPU threads of the engine's steps of more than one token.",
        lambda m: m.threads[1],
    ),
    (
        "llmrun_background_cpus",
        "CPUs' worth of other processes' work over the last second or more (NaN where unknown).",
        lambda m: math.nan if (cpus := m.meter.read()) is None else cpus,
    ),
    (
        "llmrun_machine_busy",
        "1 while other processes take CPU time the engine's threads need (its figures are"
        " then slower than this machine can do).",
        lambda m: float(m.busy(m.meter.read())),
    ),
)


class ServerMetrics:
    """The server's counters, gauges and histograms in a registry of its own (the counters and
    histograms by their tables' attribute names)."""

    # what the gauges read (GAUGES, above the class, needs their types declared)
    running: Callable[[], float]
    queued: Callable[[], float]
    connections: Callable[[], float]
    max_connections: int
    threads: tuple[int, int]
    meter: BackgroundMeter

    def __init__(
        self,
        *,
        running: Callable[[], float] = lambda: 0,
        queued: Callable[[], float] = lambda: 0,
        energy: StepEnergy | None = None,
    ) -> None:
        disable_created_metrics()  # the *_created series say nothing a scrape needs
        r = self.registry = CollectorRegistry()
        # The engine's queue and threads (set once the engine exists: `follow`); the HTTP
        # side's open connections against --max-connections (set once it listens); other
        # processes' load, since a busy machine slows llama.cpp's spinning threads 10-30x.
        self.running, self.queued = running, queued
        self.connections = lambda: 0
        self.max_connections = 0
        self.threads = (0, 0)
        self.meter = BackgroundMeter(window_s=1.0)
        self.counters = {a: Counter(n, d, labels, registry=r) for a, n, d, labels in COUNTERS}
        self.histograms = {a: Histogram(n, d, buckets=b, registry=r) for a, n, d, b in HISTOGRAMS}
        for name, doc, read in GAUGES:
            Gauge(name, doc, registry=r).set_function(functools.partial(read, self))
        self.energy = energy
        if energy is not None:
            self._energy_metrics(energy)

    def _energy_metrics(self, energy: StepEnergy) -> None:
        """Joules and seconds of the engine's steps by phase, and the source or why there is
        none: without a source the counters have no sample at all (absent, never a zero)."""
        r = self.registry
        r.register(_EnergyInfo(energy))
        self.energy_joules = Counter(
            "llmrun_energy_joules",
            "Joules the energy counters counted during the engine's steps, idle included, by"
            " what the steps carried (prefill, decode, or mixed: both); above idle:"
            " this - llmrun_energy_idle_watts * llmrun_energy_seconds_total.",
            ["phase"],
            registry=r,
        )
        self.energy_seconds = Counter(
            "llmrun_energy_seconds",
            "Seconds between the energy counters' reads around the engine's steps, by phase.",
            ["phase"],
            registry=r,
        )
        if energy.measured:
            Gauge(
                "llmrun_energy_idle_watts",
                "The counters' mean power over the idle window measured before serving.",
                registry=r,
            ).set(energy.idle_w)

    def follow(self, engine: EngineThread) -> None:
        """Read the gauges of `engine`, which this registry observes (`on_step`, `on_done`)."""
        self.running, self.queued = lambda: engine.busy, lambda: engine.queued
        self.threads = engine.engine.threads  # as llama.cpp reports them

    def busy(self, background: float | None) -> bool:
        return busy_machine(background, max(self.threads))

    def before_step(self) -> None:
        if self.energy is not None:
            self.energy.before()

    def on_step(self, step: StepRecord) -> None:
        if self.energy is not None:
            reading = self.energy.after(n_prefill=step.n_prefill, n_decode=step.n_decode)
            if reading is not None:
                self.energy_joules.labels(reading.phase).inc(reading.joules)
                self.energy_seconds.labels(reading.phase).inc(reading.seconds)
        h = self.histograms
        h["step_prefill"].observe(step.n_prefill)
        h["step_decode"].observe(step.n_decode)
        h["step_seconds"].observe(step.duration_s)

    def on_done(self, t: RequestTimings) -> None:
        c, h = self.counters, self.histograms
        c["prompt_tokens"].inc(t.prompt_tokens)
        c["reused_tokens"].inc(t.reused_tokens)
        c["generated"].inc(t.completion_tokens)  # usage's count, one definition
        if t.finish_reason == FINISH_CANCELLED and t.ttft_ms is None and not t.prefill_chunks:
            return  # gone before its first step: no phase to count
        h["queue"].observe(t.queue_ms / 1000)
        h["step_wait"].observe(t.step_wait_ms / 1000)
        h["prefill"].observe(t.prefill_ms / 1000)
        if t.ttft_ms is not None:
            h["ttft"].observe(t.ttft_ms / 1000)
        for gap in t.itl_ms:
            h["itl"].observe(gap / 1000)

    def answered(self, route: str, outcome: str) -> None:
        self.counters["requests"].labels(route, outcome).inc()

    def text(self) -> bytes:
        return generate_latest(self.registry)


class _EnergyInfo(Collector):
    """llmrun_energy_info as the meter stands at each scrape: a counter that fails while the
    server runs says so from then on (its reason), not what it was at the start."""

    def __init__(self, energy: StepEnergy) -> None:
        self.energy = energy

    def collect(self) -> Iterator[InfoMetricFamily]:
        e = self.energy
        yield InfoMetricFamily(
            "llmrun_energy",
            "The energy counters read (source), or why there are none (reason).",
            value={"source": e.source if e.measured else "", "reason": e.reason},
        )
