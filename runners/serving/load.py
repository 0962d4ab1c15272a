"""Serving load against an OpenAI-compatible server, with vLLM's benchmark definitions (each
defined once, in figures.py): a request's clock starts as it is sent, once the client's
`--max-concurrency` admits it.

Arrivals are a Poisson process at `request_rate` (inf: all at once), with at most
`concurrency` requests in flight. A failed request is counted and reported, never fatal.
`interference` measures one steady decoding client's inter-token latency alone, then while
other clients send long prompts: the prefill-decode interference chunked prefill exists for.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from llmrun.runners.base import Finished, Request, SamplingParams, Token
from llmrun.runners.errors import CancelledError, LlmrunError
from llmrun.runners.progress import Tally
from llmrun.runners.remote import OpenAIRunner
from llmrun.runners.stats import FINISH_INCOMPLETE, percentile
from llmrun.runners.system import busy_machine, cpu_sample, measured_background

from .figures import RequestResult, ServingMetrics, failure, metrics, queue_s
from .options import InterferenceOptions, ServeOptions, Stage
from .prompts import FreshPrompts, PromptSpec, text_prompts


def _streamed(
    runner: OpenAIRunner, request: Request, cancel: threading.Event, progress: Tally | None
) -> Finished:
    """The request run to its end, its tokens counted in `progress` as they arrive."""
    for event in runner.stream(request, cancel=cancel):
        if isinstance(event, Token) and progress is not None:
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
    # The remote runner's clock starts as the request is sent: TTFT, gaps and E2EL from it.
    result.latency_s, result.itl_s = s.e2e_s, list(s.itl_s)
    server = s.server
    if server is not None and server.output_chunks:
        result.ttft_s = s.ttft_s
        if result.ttft_s is not None:  # E2EL ends at the last token, not at the stream's end
            result.latency_s = result.ttft_s + sum(result.itl_s)
    if server is not None and server.usage_reported and s.prompt_tokens:
        result.input_tokens = s.prompt_tokens
    said = server is not None and server.timings is not None and server.timings.cache_n is not None
    if said or s.reused_tokens:  # llama-server's cache_n, OpenAI's cached_tokens, llmrun's
        result.cached_tokens = s.reused_tokens
    result.output_tokens = s.output_tokens
    if server is not None:  # dropped by the runner: the output is then its chunks, as run says
        result.implausible = server.implausible
    broken = s.finish_reason == FINISH_INCOMPLETE
    result.error = failure(
        error=str(server.error if server is not None else "incomplete") if broken else None,
        cancelled=s.interrupted,
        got_token=result.ttft_s is not None,
    )
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

    def task(prompt: PromptSpec, arrived_s: float) -> RequestResult:
        try:
            sent_s = time.perf_counter()  # admitted: its clock starts (figures.py)
            result = send(runner, prompt, cancel, progress)
            result.queue_s = queue_s(arrived_s, sent_s)  # vLLM's client_queue_time
            return result
        finally:
            slots.release()

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for i, prompt in enumerate(prompts):
            if cancel.is_set():
                break
            if i and math.isfinite(request_rate):
                cancel.wait(rng.expovariate(request_rate))
            arrived_s = time.perf_counter()
            while not slots.acquire(timeout=0.1):
                if cancel.is_set():
                    break
            else:
                futures.append(pool.submit(task, prompt, arrived_s))
                continue
            break
    duration = time.perf_counter() - t0
    return [f.result() for f in futures], duration


@dataclass(frozen=True)
class Interference:
    alone: RequestResult
    loaded: RequestResult
    background: list[RequestResult]

    @property
    def failed(self) -> list[tuple[str, str]]:
        """The steady client's measured requests that failed (as `bench serve` counts a failed
        request, figures.py): (which, why). Their figures are not figures."""
        runs = (("alone", self.alone), ("under load", self.loaded))
        return [(which, r.error or "") for which, r in runs if r.failed]

    def record(self) -> dict[str, Any]:
        def p(result: RequestResult, q: float) -> float | None:
            value = percentile(result.itl_s, q) if result.ok else None
            return round(value * 1000, 3) if value is not None else None

        def ttft(result: RequestResult) -> float | None:
            return round(result.ttft_s * 1000, 3) if result.ok and result.ttft_s else None

        rec: dict[str, Any] = {
            "itl_p50_alone_ms": p(self.alone, 50),
            "itl_p99_alone_ms": p(self.alone, 99),
            "itl_p50_loaded_ms": p(self.loaded, 50),
            "itl_p99_loaded_ms": p(self.loaded, 99),
            "ttft_alone_ms": ttft(self.alone),
            "ttft_loaded_ms": ttft(self.loaded),
            "background_requests": len(self.background),
            "background_failed": sum(r.failed for r in self.background),
            # what the server said it took from its cache (None: it did not say)
            "cached_tokens_alone": self.alone.cached_tokens,
            "cached_tokens_loaded": self.loaded.cached_tokens,
        }
        for q in ("p50", "p99"):
            alone, loaded = rec[f"itl_{q}_alone_ms"], rec[f"itl_{q}_loaded_ms"]
            rec[f"itl_{q}_ratio"] = round(loaded / alone, 3) if alone and loaded else None
        rec["failed"] = len(self.failed)
        rec["errors"] = [f"{which}: {why}" for which, why in self.failed]
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
    # Prompt tokens of the completed requests that the server (or engine) took from its cache;
    # None: no request's answer said.
    cached_tokens: int | None = None
    shared_prefix: int = 0  # tokens (a server's: words) every prompt shares, on purpose
    dataset: Mapping[str, str] = field(default_factory=dict)  # --dataset: its name and sha256

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
        return f"{self.request_rate:g}"  # inf: all at once

    @property
    def local(self) -> bool:
        """This machine's engine (a policy), not a server."""
        return bool(self.policy)

    @property
    def level_text(self) -> str:
        """What the level's number is: the engine's sequences, or the client's requests in
        flight (`concurrency` keeps the number under both, as history keys it)."""
        return f"slots={self.concurrency}" if self.local else f"max-conc={self.concurrency}"

    @property
    def test(self) -> str:
        return (
            f"serve c{self.concurrency} r{self.rate_text}"
            + (f" {self.policy}" if self.policy else "")
            + self.layout
            + (f" prefix{self.shared_prefix}" if self.shared_prefix else "")
            + (f" ds={self.dataset['dataset_sha256'][:8]}" if self.dataset else "")
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
            ("n_slots" if self.local else "max_concurrency"): self.concurrency,
            "request_rate": self.rate_text,
            "num_prompts": self.num_prompts,
            "input_len": self.input_len,
            "output_len": self.output_len,
            "avg_ts": self.metrics.output_throughput or 0.0,
            "stddev_ts": round(self.spread, 4),
            **self.metrics.record(),
            "total_cached_tokens": self.cached_tokens,
            **({"shared_prefix": self.shared_prefix} if self.shared_prefix else {}),
            **self.dataset,
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


LevelPrompts = tuple[list[PromptSpec], list[PromptSpec]]  # a level's warm-up, measured


def cached_total(results: Sequence[RequestResult]) -> int | None:
    """The prompt tokens the completed requests took from the server's cache (None: unsaid)."""
    said = [r.cached_tokens for r in results if r.ok and r.cached_tokens is not None]
    return sum(said) if said else None


def run_levels(
    runner: OpenAIRunner,
    options: ServeOptions,
    prompts: Sequence[LevelPrompts],
    *,
    input_len: int,
    output_len: int,
    cancel: threading.Event,
) -> Iterator[Stage | ServingLevel]:
    """Each of the options' concurrency levels after its warm-up requests, each announced with
    its count of requests; stops after the level Ctrl-C cut. Each level has its own prompts;
    the lengths are those each level records (a dataset's: the mean of what was sampled)."""
    name = runner.model_name or ""
    request_rate, seed = options.request_rate, options.seed
    dataset = options.dataset.record() if options.dataset is not None else {}
    for level, (warm, measured) in zip(options.concurrency, prompts, strict=True):
        if cancel.is_set():
            return
        if warm:
            tally = Tally(len(warm), sum(p.max_tokens for p in warm))
            yield Stage(f"max-conc={level} warm-up", tally)
            for prompt in warm:
                send(runner, prompt, cancel, tally)
        tally = Tally(len(measured), sum(p.max_tokens for p in measured))
        yield Stage(f"max-conc={level} rate={request_rate:g}", tally)
        cpu0 = cpu_sample()  # the client's machine: a loaded one delays what it times
        results, duration = run_load(
            runner,
            measured,
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
            num_prompts=len(measured),
            input_len=input_len,
            output_len=output_len,
            metrics=metrics(
                results, duration, percentiles=options.percentiles, slo=dict(options.slo)
            ),
            interrupted=cancel.is_set(),
            cached_tokens=cached_total(results),
            shared_prefix=options.shared_prefix,
            dataset=dict(dataset),
            background_cpus=measured_background(cpu0, cpu_sample()),
        )


COUNTING = "preparing prompts (counting tokens with the server's tokenizer)"
STEADY_MIN_TOKENS = 64  # the steady client decodes at least this many tokens
WARMUP_TOKENS = 4  # the unmeasured first request's output


def interfere_remote(
    runner: OpenAIRunner, options: InterferenceOptions, *, cancel: threading.Event
) -> Iterator[Stage | InterferenceResult]:
    """The server's steady client (a short prompt, at least 64 tokens out) alone, then against
    `rate` long prompts per second for about eight seconds' worth of arrivals: its prompts
    made (each its own, so a caching server prefills every one), then measured."""
    rate, prompt_len = options.rate, options.prompt_len
    count = max(2, math.ceil(rate * 8))  # about eight seconds' worth of arrivals
    making = Tally(3 + count)
    yield Stage(COUNTING, making, "prompts")
    fresh = FreshPrompts(options.seed, "interference")
    counted = _counter(runner, cancel)
    steady_len = (options.input_len, max(options.output_len, STEADY_MIN_TOKENS))
    steady = text_prompts(counted, fresh, [steady_len] * 3, lambda: making.add(1))
    steady[0] = PromptSpec(steady[0].text, steady[0].input_tokens, WARMUP_TOKENS)
    long_prompts = text_prompts(counted, fresh, [(prompt_len, 1)] * count, lambda: making.add(1))
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
        seed=options.seed,
        cancel=cancel,
        progress=tally,
    )
    yield InterferenceResult(runner.endpoint, runner.model_name or "", prompt_len, rate, measured)


def _counter(runner: OpenAIRunner, cancel: threading.Event) -> Callable[[str], int]:
    """A prompt's tokens by the server's tokenizer where it has one; Ctrl-C or SIGTERM ends the
    counting (a dataset whose entries the filters refuse is counted whole, one request each)."""

    def count(text: str) -> int:
        if cancel.is_set():
            raise CancelledError("preparing prompts was interrupted")
        return runner.count_tokens(Request(prompt=text))

    return count


def level_prompts(
    runner: OpenAIRunner,
    options: ServeOptions,
    tick: Callable[[], None],
    cancel: threading.Event,
) -> list[LevelPrompts]:
    """Each level's warm-up and measured prompts, none repeated: fresh random ones (the same
    lengths at every level), or the dataset's, sampled without repeats."""
    n, w, levels = options.num_prompts, options.warmup, len(options.concurrency)
    counted = _counter(runner, cancel)
    if options.dataset is not None:
        sampled = options.dataset.sample(
            counted,
            count=levels * (n + w),
            seed=options.seed,
            output_len=options.output_len,
            fixed=options.output_len_given,
            progress=tick,
        )
        rounds = [sampled[i * (n + w) : (i + 1) * (n + w)] for i in range(levels)]
        return [
            ([PromptSpec(p.text, p.input_tokens, min(p.max_tokens, 16)) for p in r[:w]], r[w:])
            for r in rounds
        ]
    fresh = FreshPrompts(options.seed, "serve", options.shared_prefix)
    warm_lengths, lengths = options.lengths()
    return [
        (
            text_prompts(counted, fresh, warm_lengths, tick),
            text_prompts(counted, fresh, lengths, tick),
        )
        for _ in range(levels)
    ]


def serve_remote(
    runner: OpenAIRunner, options: ServeOptions, *, cancel: threading.Event
) -> Iterator[Stage | ServingLevel]:
    """The serving benchmark against the runner's server: prompts counted with its tokenizer,
    then each concurrency level after its warm-up requests."""
    making = Tally(len(options.concurrency) * (options.num_prompts + options.warmup))
    yield Stage(COUNTING, making, "prompts")
    prompts = level_prompts(runner, options, lambda: making.add(1), cancel)
    input_len, output_len = options.input_len, options.output_len
    if options.dataset is not None:  # the data's lengths: the mean of what was sampled
        measured = [p for _, level in prompts for p in level]
        input_len = round(sum(p.input_tokens for p in measured) / len(measured))
        output_len = round(sum(p.max_tokens for p in measured) / len(measured))
    yield from run_levels(
        runner, options, prompts, input_len=input_len, output_len=output_len, cancel=cancel
    )
