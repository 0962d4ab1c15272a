"""Serving load against an OpenAI-compatible server, with vLLM's benchmark definitions.

- TTFT: request sent -> first content chunk.
- TPOT: (latency - TTFT) / (output tokens - 1), per request.
- ITL: every gap between content chunks, the first token excluded.
- E2EL: request sent -> last byte.
- Throughput: completed requests and output tokens per second of the whole run; goodput counts
  only the requests that met every `--slo`.

Arrivals are a Poisson process at `request_rate` (inf: all at once), with at most
`concurrency` requests in flight. A failed request is counted and reported, never fatal.
`interference` measures one steady decoding client's inter-token latency alone, then while
other clients send long prompts: the prefill-decode interference chunked prefill exists for.
"""

from __future__ import annotations

import math
import random
import statistics
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from llmrun.runners.base import Finished, Request, SamplingParams, Token, generate
from llmrun.runners.errors import LlmrunError
from llmrun.runners.progress import Tally
from llmrun.runners.remote import OpenAIRunner
from llmrun.runners.stats import FINISH_INCOMPLETE, percentile
from llmrun.runners.system import busy_machine, cpu_sample, measured_background

from .options import InterferenceOptions, ServeOptions, Stage

WORDS = (
    "time",
    "person",
    "year",
    "way",
    "day",
    "thing",
    "man",
    "world",
    "life",
    "hand",
    "part",
    "child",
    "eye",
    "woman",
    "place",
    "work",
    "week",
    "case",
    "point",
    "government",
    "company",
    "number",
    "group",
    "problem",
    "fact",
    "water",
    "room",
    "mother",
    "area",
    "money",
    "story",
    "month",
    "lot",
    "right",
    "study",
    "book",
    "word",
    "business",
    "issue",
    "side",
    "kind",
    "head",
    "house",
    "service",
    "friend",
    "father",
    "power",
    "hour",
    "game",
    "line",
    "end",
    "member",
    "law",
    "car",
    "city",
    "community",
    "name",
    "president",
    "team",
    "minute",
    "idea",
    "kid",
    "body",
    "information",
    "back",
    "parent",
    "face",
    "others",
    "level",
    "office",
    "door",
    "health",
    "art",
    "war",
    "history",
    "party",
    "result",
    "change",
    "morning",
    "reason",
    "research",
    "girl",
    "guy",
    "moment",
    "air",
    "teacher",
    "force",
    "education",
)


@dataclass(frozen=True)
class PromptSpec:
    text: str
    input_tokens: int
    max_tokens: int


@dataclass
class RequestResult:
    input_tokens: int
    output_tokens: int = 0
    ttft_s: float | None = None
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


def make_prompts(
    runner: OpenAIRunner,
    *,
    count: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
    progress: Tally | None = None,
) -> list[PromptSpec]:
    """Random-word prompts of about `input_len` tokens (counted by the server's tokenizer where
    it has one), lengths uniform within ±range_ratio, as vLLM's random dataset."""
    rng = random.Random(seed)

    def length(mean: int) -> int:
        low, high = max(1, round(mean * (1 - range_ratio))), max(1, round(mean * (1 + range_ratio)))
        return rng.randint(low, high)

    prompts = []
    for _ in range(count):
        n_in = length(input_len)
        text = " ".join(rng.choice(WORDS) for _ in range(n_in))
        n_tokens = runner.count_tokens(Request(prompt=text))
        prompts.append(PromptSpec(text, n_tokens, length(output_len)))
        if progress is not None:
            progress.add(1)
    return prompts


def _streamed(
    runner: OpenAIRunner, request: Request, cancel: threading.Event, progress: Tally | None
) -> Finished:
    """The request run to its end, its tokens counted in `progress` as they arrive."""
    if progress is None:
        return generate(runner, request, cancel=cancel)
    for event in runner.stream(request, cancel=cancel):
        if isinstance(event, Token):
            progress.add(work=1)
        elif isinstance(event, Finished):
            return event
    raise RuntimeError("runner ended without a Finished event")


def send(
    runner: OpenAIRunner, prompt: PromptSpec, cancel: threading.Event, progress: Tally | None = None
) -> RequestResult:
    """One streamed completion through the remote runner; failures are returned, not raised.
    `progress` counts its tokens and, at the end, the request."""
    sampling = SamplingParams(max_tokens=prompt.max_tokens, temperature=0.0, ignore_eos=True)
    result = RequestResult(input_tokens=prompt.input_tokens)
    request = Request(prompt=prompt.text, sampling=sampling)
    try:
        finished = _streamed(runner, request, cancel, progress)
    except LlmrunError as e:
        result.error = str(e)
        return result
    finally:
        if progress is not None:
            progress.add(done=1)
    s = finished.stats
    result.latency_s, result.itl_s = s.e2e_s, list(s.itl_s)
    server = s.server
    if server is not None and server.output_chunks:
        result.ttft_s = s.ttft_s
    if server is not None and server.usage_reported and s.prompt_tokens:
        result.input_tokens = s.prompt_tokens
    result.output_tokens = s.output_tokens
    if s.finish_reason == FINISH_INCOMPLETE:
        result.error = str(server.error if server is not None else "incomplete")
    elif s.interrupted:
        result.error = "cancelled"
    elif result.ttft_s is None:
        result.error = "no output"
    return result


def run_load(
    runner: OpenAIRunner,
    prompts: Sequence[PromptSpec],
    *,
    concurrency: int,
    request_rate: float,
    seed: int,
    cancel: threading.Event,
    progress: Tally | None = None,
) -> tuple[list[RequestResult], float]:
    """Send every prompt (Poisson arrivals, bounded concurrency); returns results and duration.
    `progress` counts the requests and their tokens as they come back."""
    rng = random.Random(seed)
    slots = threading.Semaphore(concurrency)
    futures: list[Future[RequestResult]] = []

    def task(prompt: PromptSpec) -> RequestResult:
        try:
            return send(runner, prompt, cancel, progress)
        finally:
            slots.release()

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for i, prompt in enumerate(prompts):
            if cancel.is_set():
                break
            if i and math.isfinite(request_rate):
                cancel.wait(rng.expovariate(request_rate))
            while not slots.acquire(timeout=0.1):
                if cancel.is_set():
                    break
            else:
                futures.append(pool.submit(task, prompt))
                continue
            break
    duration = time.perf_counter() - t0
    return [f.result() for f in futures], duration


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


@dataclass(frozen=True)
class ServingMetrics:
    """A level's figures as vLLM's benchmark defines them."""

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

    def record(self) -> dict[str, Any]:
        rec: dict[str, Any] = {
            "completed": self.completed,
            "failed": self.failed,
            "errors": list(self.errors),
            "duration_s": self.duration_s,
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "request_throughput": self.request_throughput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
            "goodput": self.goodput,
        }
        for name in ("ttft", "tpot", "itl", "e2el"):
            rec.update(getattr(self, name).fields(name))
        return rec


def metrics(
    results: Sequence[RequestResult],
    duration_s: float,
    *,
    percentiles: Sequence[float],
    slo: dict[str, float],
) -> ServingMetrics:
    done = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok and r.error != "cancelled"]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.input_tokens for r in done)

    def meets(r: RequestResult) -> bool:
        checks = {"ttft": r.ttft_s, "tpot": r.tpot_s, "e2el": r.latency_s}
        return all(checks[k] is not None and checks[k] <= v for k, v in slo.items())  # type: ignore[operator]

    def per_s(count: int) -> float | None:
        return round(count / duration_s, 4) if duration_s > 0 else None

    good = [r for r in done if meets(r)] if slo else done
    return ServingMetrics(
        completed=len(done),
        failed=len(failed),
        errors=tuple(sorted({r.error for r in failed if r.error})[:5]),
        duration_s=round(duration_s, 4),
        total_input_tokens=in_tokens,
        total_output_tokens=out_tokens,
        request_throughput=per_s(len(done)),
        output_throughput=per_s(out_tokens),
        total_token_throughput=per_s(in_tokens + out_tokens),
        goodput=per_s(len(good)) if slo else None,
        ttft=Latency.of([r.ttft_s for r in done if r.ttft_s is not None], percentiles),
        tpot=Latency.of([t for r in done if (t := r.tpot_s) is not None], percentiles),
        itl=Latency.of([g for r in done for g in r.itl_s], percentiles),
        e2el=Latency.of([r.latency_s for r in done], percentiles),
    )


@dataclass(frozen=True)
class Interference:
    alone: RequestResult
    loaded: RequestResult
    background: list[RequestResult]

    def record(self) -> dict[str, Any]:
        def p(result: RequestResult, q: float) -> float | None:
            value = percentile(result.itl_s, q)
            return round(value * 1000, 3) if value is not None else None

        rec = {
            "itl_p50_alone_ms": p(self.alone, 50),
            "itl_p99_alone_ms": p(self.alone, 99),
            "itl_p50_loaded_ms": p(self.loaded, 50),
            "itl_p99_loaded_ms": p(self.loaded, 99),
            "ttft_alone_ms": round(self.alone.ttft_s * 1000, 3) if self.alone.ttft_s else None,
            "ttft_loaded_ms": round(self.loaded.ttft_s * 1000, 3) if self.loaded.ttft_s else None,
            "background_requests": len(self.background),
            "background_failed": sum(not r.ok for r in self.background),
        }
        for q in ("p50", "p99"):
            alone, loaded = rec[f"itl_{q}_alone_ms"], rec[f"itl_{q}_loaded_ms"]
            rec[f"itl_{q}_ratio"] = round(loaded / alone, 3) if alone and loaded else None
        return rec


def interference(
    runner: OpenAIRunner,
    *,
    steady: Sequence[PromptSpec],
    long_prompts: Sequence[PromptSpec],
    rate: float,
    seed: int,
    cancel: threading.Event,
    progress: Tally | None = None,
) -> Interference:
    """The steady client's decode alone, then again while long prompts arrive at `rate`/s.

    `steady` holds three prompts of one length that share no words' order: a warm-up (a
    server that loads its model or sets up its device on the first request pays that here,
    unmeasured), the one measured alone and the one measured under load. Two different
    prompts, because a server that caches prompts (llama-server, llmrun serve) would
    otherwise prefill the loaded one's prompt from the alone one's cache: a TTFT from nothing."""
    warm, steady_alone, steady_loaded = steady
    send(runner, warm, cancel, progress)
    alone = send(runner, steady_alone, cancel, progress)
    stop = threading.Event()
    background: list[RequestResult] = []
    rng = random.Random(seed)

    def flood() -> None:
        with ThreadPoolExecutor(max_workers=max(1, len(long_prompts))) as pool:
            pending = []
            for prompt in long_prompts:
                if stop.is_set() or cancel.is_set():
                    break
                pending.append(pool.submit(send, runner, prompt, cancel, progress))
                stop.wait(rng.expovariate(rate) if math.isfinite(rate) else 0)
            background.extend(f.result() for f in pending)

    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    loaded = send(runner, steady_loaded, cancel, progress)
    stop.set()
    flooder.join()
    return Interference(alone, loaded, background)


# ---- a whole serving run, as typed results ---------------------------------------------------


@dataclass(frozen=True)
class ServingLevel:
    """One concurrency level of the serving benchmark, as measured (vLLM's metrics)."""

    endpoint: str
    model: str
    concurrency: int
    request_rate: float  # inf: all at once
    num_prompts: int
    input_len: int
    output_len: int
    metrics: ServingMetrics
    interrupted: bool = False  # Ctrl-C mid-level: the requests that finished stand
    policy: str = ""  # the local engine's scheduling policy ('' against a server)
    # The local engine's (None against a server): its threads as llama.cpp reports them, and
    # other processes' CPU load while the level was measured.
    n_threads: int | None = None
    n_threads_batch: int | None = None
    background_cpus: float | None = None
    kv_unified: bool | None = None  # the local engine's KV layout, read back from its context

    @property
    def layout(self) -> str:
        """The local engine's KV layout when it is one stream per sequence: levels measured
        before that became the default (unified) lack the suffix, so history keeps them apart."""
        return " kv-per-seq" if self.kv_unified is False else ""

    @property
    def busy(self) -> bool:
        """Measured while other processes took CPU time the engine's threads needed."""
        threads = max(self.n_threads or 1, self.n_threads_batch or 1)  # a client: its one
        return busy_machine(self.background_cpus, threads)

    @property
    def rate_text(self) -> str:
        return _rate(self.request_rate)

    @property
    def test(self) -> str:
        return (
            f"serve c{self.concurrency} r{self.rate_text}"
            + (f" {self.policy}" if self.policy else "")
            + self.layout
        )

    @property
    def spread(self) -> float:
        """The output throughput's spread: the standard error of the requests' mean latency,
        relative, applied to the throughput (how history tells a change from noise)."""
        throughput = self.metrics.output_throughput or 0.0
        mean, std = self.metrics.e2el.mean_ms or 0.0, self.metrics.e2el.std_ms or 0.0
        done = max(self.metrics.completed or 1, 1)
        return throughput * (std / mean) / math.sqrt(done) if mean else 0.0

    def record(self) -> dict[str, Any]:
        """The flat record for output formats and the history."""
        # The history keys results by endpoint: a local level's carries its policy and layout.
        endpoint = f"{self.endpoint} {self.policy}" if self.policy else self.endpoint
        endpoint += self.layout
        return {
            "test": self.test,
            "endpoint": endpoint,
            "model_filename": self.model,
            "concurrency": self.concurrency,
            "request_rate": self.rate_text,
            "num_prompts": self.num_prompts,
            "input_len": self.input_len,
            "output_len": self.output_len,
            "avg_ts": self.metrics.output_throughput or 0.0,
            "stddev_ts": round(self.spread, 4),
            **self.metrics.record(),
            "interrupted": self.interrupted,
            **({"policy": self.policy} if self.policy else {}),
            **(
                {"n_threads": self.n_threads, "n_threads_batch": self.n_threads_batch}
                if self.n_threads is not None
                else {}
            ),
            "background_cpus": None
            if self.background_cpus is None
            else round(self.background_cpus, 3),
            "busy": self.busy,
            **({"kv_unified": self.kv_unified} if self.kv_unified is not None else {}),
        }


@dataclass(frozen=True)
class InterferenceResult:
    """The steady client's decode alone and under a stream of long prompts."""

    endpoint: str
    model: str
    prompt_len: int
    rate: float
    measured: Interference

    @property
    def test(self) -> str:
        return f"interference pp{self.prompt_len} r{self.rate:g}"

    def record(self) -> dict[str, Any]:
        """Its own figures only: no rate or concurrency it does not have."""
        return {
            "test": self.test,
            "endpoint": self.endpoint,
            "model_filename": self.model,
            "interference_rate": self.rate,
            "interference_prompt_len": self.prompt_len,
            **self.measured.record(),
        }


def run_levels(
    runner: OpenAIRunner,
    *,
    levels: Sequence[int],
    prompts: Sequence[PromptSpec],
    warm: Sequence[PromptSpec],
    request_rate: float,
    input_len: int,
    output_len: int,
    seed: int,
    percentiles: Sequence[float],
    slo: dict[str, float],
    cancel: threading.Event,
) -> Iterator[Stage | ServingLevel]:
    """Each concurrency level after its warm-up requests, each announced with its count of
    requests; stops after the level Ctrl-C cut."""
    name = runner.model_name or ""
    for level in levels:
        if cancel.is_set():
            return
        if warm:
            tally = Tally(len(warm), sum(p.max_tokens for p in warm))
            yield Stage(f"c={level} warm-up", tally)
            for prompt in warm:
                send(runner, prompt, cancel, tally)
        tally = Tally(len(prompts), sum(p.max_tokens for p in prompts))
        yield Stage(f"c={level} rate={_rate(request_rate)}", tally)
        cpu0 = cpu_sample()  # the client's machine: a loaded one delays what it times
        results, duration = run_load(
            runner,
            prompts,
            concurrency=level,
            request_rate=request_rate,
            seed=seed,
            cancel=cancel,
            progress=tally,
        )
        yield ServingLevel(
            endpoint=runner.endpoint,
            model=name,
            concurrency=level,
            request_rate=request_rate,
            num_prompts=len(prompts),
            input_len=input_len,
            output_len=output_len,
            metrics=metrics(results, duration, percentiles=percentiles, slo=slo),
            interrupted=cancel.is_set(),
            background_cpus=measured_background(cpu0, cpu_sample()),
        )


def _rate(request_rate: float) -> str:
    return "inf" if math.isinf(request_rate) else f"{request_rate:g}"


STEADY_MIN_TOKENS = 64  # the steady client decodes at least this many tokens
WARMUP_TOKENS = 4  # the unmeasured first request's output


def long_prompt_count(rate: float) -> int:
    """About eight seconds' worth of arrivals at `rate`/s (at least two)."""
    return max(2, math.ceil(rate * 8))


def run_interference(
    runner: OpenAIRunner,
    *,
    input_len: int,
    output_len: int,
    rate: float,
    prompt_len: int,
    seed: int,
    cancel: threading.Event,
) -> Iterator[Stage | InterferenceResult]:
    """One steady client (a short prompt, at least 64 tokens out) against `rate` long prompts
    per second for about eight seconds' worth of arrivals: its prompts made, then measured."""
    count = long_prompt_count(rate)
    making = Tally(3 + count)
    yield Stage(
        "preparing prompts (counting tokens with the server's tokenizer)", making, "prompts"
    )
    steady = make_prompts(
        runner,
        count=3,
        input_len=input_len,
        output_len=max(output_len, STEADY_MIN_TOKENS),
        range_ratio=0.0,
        seed=seed,
        progress=making,
    )
    steady[0] = PromptSpec(steady[0].text, steady[0].input_tokens, WARMUP_TOKENS)
    long_prompts = [
        PromptSpec(p.text, p.input_tokens, 1)
        for p in make_prompts(
            runner,
            count=count,
            input_len=prompt_len,
            output_len=1,
            range_ratio=0.0,
            seed=seed + 2,
            progress=making,
        )
    ]
    tally = Tally(3 + count, sum(p.max_tokens for p in steady) + count)
    yield Stage(
        f"one client alone, then while {count} prompts of {prompt_len} tokens arrive at {rate:g}/s",
        tally,
    )
    measured = interference(
        runner,
        steady=steady,
        long_prompts=long_prompts,
        rate=rate,
        seed=seed,
        cancel=cancel,
        progress=tally,
    )
    yield InterferenceResult(runner.endpoint, runner.model_name or "", prompt_len, rate, measured)


def serve_remote(
    runner: OpenAIRunner, options: ServeOptions, *, cancel: threading.Event
) -> Iterator[Stage | ServingLevel]:
    """The serving benchmark against the runner's server: prompts counted with its tokenizer,
    then each concurrency level after its warm-up requests."""
    making = Tally(options.num_prompts + options.warmup)
    yield Stage(
        "preparing prompts (counting tokens with the server's tokenizer)", making, "prompts"
    )
    prompts = make_prompts(
        runner,
        count=options.num_prompts,
        input_len=options.input_len,
        output_len=options.output_len,
        range_ratio=options.range_ratio,
        seed=options.seed,
        progress=making,
    )
    warm = make_prompts(
        runner,
        count=options.warmup,
        input_len=options.input_len,
        output_len=min(options.output_len, 16),
        range_ratio=0.0,
        seed=options.seed + 1,
        progress=making,
    )
    yield from run_levels(
        runner,
        levels=options.concurrency,
        prompts=prompts,
        warm=warm,
        request_rate=options.request_rate,
        input_len=options.input_len,
        output_len=options.output_len,
        seed=options.seed,
        percentiles=options.percentiles,
        slo=dict(options.slo),
        cancel=cancel,
    )


def interfere_remote(
    runner: OpenAIRunner, options: InterferenceOptions, *, cancel: threading.Event
) -> Iterator[Stage | InterferenceResult]:
    """The server's steady client alone and while long prompts arrive."""
    yield from run_interference(
        runner,
        input_len=options.input_len,
        output_len=options.output_len,
        rate=options.rate,
        prompt_len=options.prompt_len,
        seed=options.seed,
        cancel=cancel,
    )
