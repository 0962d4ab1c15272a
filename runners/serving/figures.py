"""The serving figures, one definition each, as vLLM's benchmark computes them
(benchmarks/serve.py `calculate_metrics`, benchmarks/lib/endpoint_request_func.py); every
command that reports one computes it here: `bench serve` local and remote, `bench
interference`, `serve`'s `timings` and `/metrics`, and `run`'s stats (its ITL, and a remote
run's TTFT; a local run's TTFT is its phases' sum, template + prefill + first sample, for a
request admitted at once). docs/measurement.md ("Serving figures") holds the same list.

A request's clock starts when it is *admitted*: sent, once the client's limit on requests in
flight lets it go (vLLM's `--max-concurrency` semaphore), or, on this machine's engine, given a
sequence (a slot). The wait before that is its own figure, `queue`.

- queue: arrival -> admission: the wait for a sequence, or for the client's limit (vLLM's
  `client_queue_time`); a server's own queue is inside its TTFT.
- TTFT: admission -> the first token (a content chunk).
- ITL: every gap between consecutive tokens (chunks), the first token excluded.
- E2EL: admission -> the last token.
- TPOT: (E2EL - TTFT) / (output tokens - 1), per request with at least two tokens.
- goodput: the requests that met every SLO, per second of the run.

A request *fails* when it ends with an error (a broken stream, an error event, a refused
request) or without a single token; one that Ctrl-C cut is neither done nor failed.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from llmrun.runners.stats import percentile

CANCELLED = "cancelled"  # a request's error when Ctrl-C cut it: not counted as failed
NO_OUTPUT = "no output"
MAX_NOTES = 5  # a level keeps its first distinct errors and notes, not one per request


def ttft_s(admitted_s: float, token_times_s: Sequence[float]) -> float | None:
    """Admission to the first token (None: no token)."""
    return token_times_s[0] - admitted_s if token_times_s else None


def e2el_s(admitted_s: float, token_times_s: Sequence[float]) -> float | None:
    """Admission to the last token (None: no token)."""
    return token_times_s[-1] - admitted_s if token_times_s else None


def itl_s(token_times_s: Sequence[float]) -> list[float]:
    """Every gap between consecutive tokens."""
    return [b - a for a, b in itertools.pairwise(token_times_s)]


def tpot_s(e2el: float | None, ttft: float | None, output_tokens: int) -> float | None:
    """(E2EL - TTFT) / (output tokens - 1); None below two tokens."""
    if e2el is None or ttft is None or output_tokens < 2:
        return None
    return (e2el - ttft) / (output_tokens - 1)


def queue_s(arrival_s: float, admitted_s: float | None) -> float | None:
    """Arrival to admission (None: never admitted)."""
    return None if admitted_s is None else max(0.0, admitted_s - arrival_s)


def failure(*, error: str | None, cancelled: bool, got_token: bool) -> str | None:
    """Why a request counts as failed, or None when it is done (`CANCELLED`: cut by Ctrl-C,
    neither done nor failed). One definition for `bench serve` and `bench interference`."""
    if error:
        return error
    if cancelled:
        return CANCELLED
    return None if got_token else NO_OUTPUT


@dataclass
class RequestResult:
    """One request's figures (seconds), from its admission; `error`: why it failed."""

    input_tokens: int
    output_tokens: int = 0
    ttft_s: float | None = None
    latency_s: float = 0.0  # E2EL
    itl_s: list[float] = field(default_factory=list)
    error: str | None = None
    queue_s: float | None = None  # arrival to admission (None: not measured)
    cached_tokens: int | None = None  # prompt tokens the server took from its cache (None: unsaid)
    # the server's figures that could not be true, dropped (its output then counted in chunks)
    implausible: tuple[str, ...] = ()

    @classmethod
    def timed(
        cls,
        *,
        input_tokens: int,
        arrival_s: float,
        admitted_s: float | None,
        token_times_s: Sequence[float],
        error: str | None = None,
        cancelled: bool = False,
        cached_tokens: int | None = None,
    ) -> RequestResult:
        """A request from its time stamps on one clock: arrival, admission, each token."""
        start = arrival_s if admitted_s is None else admitted_s
        return cls(
            input_tokens=input_tokens,
            output_tokens=len(token_times_s),
            ttft_s=ttft_s(start, token_times_s),
            latency_s=e2el_s(start, token_times_s) or 0.0,
            itl_s=itl_s(token_times_s),
            error=failure(error=error, cancelled=cancelled, got_token=bool(token_times_s)),
            queue_s=queue_s(arrival_s, admitted_s),
            cached_tokens=cached_tokens,
        )

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def failed(self) -> bool:
        return self.error is not None and self.error != CANCELLED

    @property
    def tpot_s(self) -> float | None:
        return tpot_s(self.latency_s, self.ttft_s, self.output_tokens)


def meets(result: RequestResult, slo: Mapping[str, float]) -> bool:
    """Whether a request met every SLO (seconds by figure: ttft, tpot, e2el), as vLLM's
    goodput counts it: a request of one token has a TPOT of 0 there."""
    tpot = result.tpot_s if result.output_tokens > 1 else 0.0
    checks = {"ttft": result.ttft_s, "tpot": tpot, "e2el": result.latency_s}
    return all((v := checks[k]) is not None and v <= limit for k, limit in slo.items())


@dataclass(frozen=True)
class Latency:
    """One latency metric over a level's requests, in milliseconds (None: nothing measured)."""

    mean_ms: float | None
    median_ms: float | None
    std_ms: float
    percentiles_ms: tuple[tuple[float, float | None], ...]  # (percentile, value)

    @classmethod
    def of(cls, values_s: Sequence[float], percentiles: Sequence[float]) -> Latency:
        values = [v * 1000 for v in values_s]
        return cls(
            mean_ms=round(statistics.fmean(values), 3) if values else None,
            median_ms=round(statistics.median(values), 3) if values else None,
            std_ms=round(statistics.pstdev(values), 3) if len(values) > 1 else 0.0,
            percentiles_ms=tuple(
                (p, None if (v := percentile(values, p)) is None else round(v, 3))
                for p in percentiles
            ),
        )

    def fields(self, name: str) -> dict[str, float | None]:
        """vLLM's names: mean_ttft_ms, median_ttft_ms, std_ttft_ms, p99_ttft_ms, ..."""
        out = {
            f"mean_{name}_ms": self.mean_ms,
            f"median_{name}_ms": self.median_ms,
            f"std_{name}_ms": self.std_ms,
        }
        out.update((f"p{p:g}_{name}_ms", v) for p, v in self.percentiles_ms)
        return out


LATENCIES = ("queue", "ttft", "tpot", "itl", "e2el")  # ServingMetrics' latency figures


@dataclass(frozen=True)
class ServingMetrics:
    """A level's figures as vLLM's benchmark defines them, with the wait before admission."""

    completed: int
    failed: int
    errors: tuple[str, ...]  # the first distinct error messages
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float | None  # requests per second
    output_throughput: float | None  # output tokens per second
    total_token_throughput: float | None
    goodput: float | None  # requests per second that met every --slo (None: no --slo)
    ttft: Latency
    tpot: Latency
    itl: Latency
    e2el: Latency
    queue: Latency | None = None  # None: not measured
    # The server's figures that could not be true, left out of these (the first distinct ones)
    implausible: tuple[str, ...] = ()

    def record(self) -> dict[str, Any]:
        """Every count and rate as its field, then each latency's vLLM fields; the server's
        figures left out as `server_implausible`, as `run --stats json` names them."""
        rec = {k: v for k, v in vars(self).items() if k not in (*LATENCIES, "implausible")}
        rec["errors"] = list(self.errors)
        if self.implausible:
            rec["server_implausible"] = list(self.implausible)
        for name in LATENCIES:
            if (latency := getattr(self, name)) is not None:
                rec.update(latency.fields(name))
        return rec


def metrics(
    results: Sequence[RequestResult],
    duration_s: float,
    *,
    percentiles: Sequence[float],
    slo: Mapping[str, float],
) -> ServingMetrics:
    """A level's figures over its requests: the done ones' latencies, the failed ones counted
    (a cancelled one is neither)."""
    done = [r for r in results if r.ok]
    failed = [r for r in results if r.failed]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.input_tokens for r in done)

    def per_s(count: int) -> float | None:
        return round(count / duration_s, 4) if duration_s > 0 else None

    queued = [r.queue_s for r in done if r.queue_s is not None]
    return ServingMetrics(
        completed=len(done),
        failed=len(failed),
        errors=tuple(sorted({r.error for r in failed if r.error})[:MAX_NOTES]),
        duration_s=round(duration_s, 4),
        total_input_tokens=in_tokens,
        total_output_tokens=out_tokens,
        request_throughput=per_s(len(done)),
        output_throughput=per_s(out_tokens),
        total_token_throughput=per_s(in_tokens + out_tokens),
        goodput=per_s(sum(meets(r, slo) for r in done)) if slo else None,
        ttft=Latency.of([r.ttft_s for r in done if r.ttft_s is not None], percentiles),
        tpot=Latency.of([t for r in done if (t := r.tpot_s) is not None], percentiles),
        itl=Latency.of([g for r in done for g in r.itl_s], percentiles),
        e2el=Latency.of([r.latency_s for r in done], percentiles),
        queue=Latency.of(queued, percentiles) if queued else None,
        implausible=tuple(sorted({n for r in done for n in r.implausible})[:MAX_NOTES]),
    )
