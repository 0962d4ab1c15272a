"""`/metrics` of `llmrun serve` in Prometheus' text format, through prometheus-client.

Beyond llama-server's token totals: the phases as histograms (queue wait, TTFT, prefill, every
inter-token gap) and each engine step's batch composition (prefill tokens vs decode tokens), the
figure a scheduling policy changes.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from llmrun.runners.system import BackgroundMeter, busy_machine

from .api_engine import FINISH_CANCELLED, EngineThread, RequestTimings, StepRecord

__all__ = ["CONTENT_TYPE", "ServerMetrics"]

LATENCY_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
GAP_S = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.0)
TOKENS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


class ServerMetrics:
    """The server's counters, gauges and histograms in a registry of its own."""

    def __init__(
        self,
        *,
        running: Callable[[], float] = lambda: 0,
        queued: Callable[[], float] = lambda: 0,
    ) -> None:
        disable_created_metrics()  # the *_created series say nothing a scrape needs
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "llmrun_requests",
            "Responses, each counted once, by route (chat, completions, models,"
            " health, metrics, props, tokenize, other: a path with no route) and"
            " outcome (ok, bad_request, not_found, method_not_allowed, too_large,"
            " timeout, busy, too_many_connections, forbidden, cancelled, error).",
            ["route", "outcome"],
            registry=r,
        )
        # The engine's queue (set once the engine exists: `follow`).
        self.running, self.queued = running, queued
        Gauge(
            "llmrun_requests_in_flight",
            "Requests holding a sequence (prefilling or decoding).",
            registry=r,
        ).set_function(lambda: self.running())
        Gauge(
            "llmrun_requests_queued", "Requests waiting for a free sequence.", registry=r
        ).set_function(lambda: self.queued())
        # The HTTP side: open connections against --max-connections (set once it listens).
        self.connections: Callable[[], float] = lambda: 0
        self.max_connections = 0
        Gauge(
            "llmrun_connections", "Open HTTP connections (idle kept-alive ones too).", registry=r
        ).set_function(lambda: self.connections())
        Gauge(
            "llmrun_connections_max",
            "Connections served at once (--max-connections); more get 503.",
            registry=r,
        ).set_function(lambda: self.max_connections)
        self.queue = Histogram(
            "llmrun_queue_wait_seconds",
            "From the request's tokens to its first engine step.",
            buckets=LATENCY_S,
            registry=r,
        )
        self.ttft = Histogram(
            "llmrun_ttft_seconds",
            "From the request's arrival to its first token.",
            buckets=LATENCY_S,
            registry=r,
        )
        self.prefill = Histogram(
            "llmrun_prefill_seconds",
            "From the first to the last step carrying the request's prompt.",
            buckets=LATENCY_S,
            registry=r,
        )
        self.itl = Histogram(
            "llmrun_itl_seconds",
            "Every gap between two generated tokens of a request.",
            buckets=GAP_S,
            registry=r,
        )
        self.prompt_tokens = Counter("llmrun_prompt_tokens", "Prompt tokens received.", registry=r)
        self.reused_tokens = Counter(
            "llmrun_reused_tokens",
            "Prompt tokens found in a sequence's cache (not prefilled).",
            registry=r,
        )
        self.generated = Counter("llmrun_generated_tokens", "Tokens generated.", registry=r)
        self.step_prefill = Histogram(
            "llmrun_step_prefill_tokens",
            "Prompt tokens in each engine step.",
            buckets=TOKENS,
            registry=r,
        )
        self.step_decode = Histogram(
            "llmrun_step_decode_tokens",
            "Decode tokens in each engine step.",
            buckets=TOKENS,
            registry=r,
        )
        self.step_seconds = Histogram(
            "llmrun_step_seconds", "Each engine step's llama_decode.", buckets=LATENCY_S, registry=r
        )
        # The machine: the engine's threads (set once the engine exists) and other processes'
        # load, since a busy machine slows llama.cpp's spinning threads 10-30x.
        self.threads = (0, 0)
        self.meter = BackgroundMeter(window_s=1.0)
        Gauge(
            "llmrun_engine_threads", "CPU threads of the engine's one-token steps.", registry=r
        ).set_function(lambda: self.threads[0])
        Gauge(
            "llmrun_engine_threads_batch",
            "CPU threads of the engine's steps of more than one token.",
            registry=r,
        ).set_function(lambda: self.threads[1])
        Gauge(
            "llmrun_background_cpus",
            "CPUs' worth of other processes' work over the last"
            " second or more (NaN where unknown).",
            registry=r,
        ).set_function(lambda: _or_nan(self.meter.read()))
        Gauge(
            "llmrun_machine_busy",
            "1 while other processes take CPU time the engine's"
            " threads need (its figures are then slower than this machine can do).",
            registry=r,
        ).set_function(lambda: float(self.busy(self.meter.read())))

    def follow(self, engine: EngineThread) -> None:
        """Read the gauges of `engine`, which this registry observes (`on_step`, `on_done`)."""
        self.running, self.queued = lambda: engine.busy, lambda: engine.queued
        self.threads = engine.engine.threads  # as llama.cpp reports them

    def busy(self, background: float | None) -> bool:
        return busy_machine(background, max(self.threads))

    def on_step(self, step: StepRecord) -> None:
        self.step_prefill.observe(step.n_prefill)
        self.step_decode.observe(step.n_decode)
        self.step_seconds.observe(step.duration_s)

    def on_done(self, t: RequestTimings) -> None:
        self.prompt_tokens.inc(t.prompt_tokens)
        self.reused_tokens.inc(t.reused_tokens)
        self.generated.inc(t.output_tokens)
        if t.finish_reason == FINISH_CANCELLED and t.ttft_ms is None and not t.prefill_chunks:
            return  # gone before its first step: no phase to count
        self.queue.observe(t.queue_ms / 1000)
        self.prefill.observe(t.prefill_ms / 1000)
        if t.ttft_ms is not None:
            self.ttft.observe(t.ttft_ms / 1000)
        for gap in t.itl_ms:
            self.itl.observe(gap / 1000)

    def answered(self, route: str, outcome: str) -> None:
        self.requests.labels(route, outcome).inc()

    def text(self) -> bytes:
        return generate_latest(self.registry)


def _or_nan(value: float | None) -> float:
    return math.nan if value is None else value
