"""The serving benchmark and the interference lab on this machine's engine, in-process: random
prompts, one batched context per concurrency level, every scheduling policy in turn. They yield
what they are doing (`Stage`) and typed results; the terminal is the caller's."""

from __future__ import annotations

import dataclasses
import math
import random
import threading
from collections.abc import Iterator, Sequence

from llmrun.runners.base import Request
from llmrun.runners.llamacpp import LlamaCppRunner
from llmrun.runners.progress import Tally
from llmrun.runners.system import cpu_sample, measured_background

from .engine import FINISH_CANCELLED, Arrival, BatchedEngine, SeqResult
from .figures import RequestResult, metrics
from .interference import LONG_TOKENS, InterferenceReport, interference
from .load import ServingLevel
from .options import InterferenceOptions, ServeOptions, Stage
from .policy import Policy

STREAM_PROMPT = "Tell me a long story about a lighthouse keeper."
MAX_LONG_PROMPTS = 8
LOCAL = "local"  # a local level's endpoint


def request_result(r: SeqResult) -> RequestResult:
    """One request of a local level as the serving figures count it (figures.py): its clock
    starts when it gets a sequence (`--slots` admits it), the wait before is its queue; a
    request the interrupt cut is "cancelled", not a finished one with a short output and E2E."""
    return RequestResult.timed(
        input_tokens=r.prompt_tokens,
        arrival_s=r.arrival_s,
        admitted_s=r.admitted_s,
        token_times_s=r.times,
        cancelled=r.finish == FINISH_CANCELLED or not r.times,
    )


def _model_name(runner: LlamaCppRunner) -> str:
    loaded = runner.load()
    return loaded.model.name if loaded.model else ""


def serve(
    engine: BatchedEngine,
    policy: Policy,
    prompts: Sequence[tuple[tuple[int, ...], int]],
    *,
    request_rate: float,
    seed: int,
    cancel: threading.Event | None = None,
    progress: Tally | None = None,
) -> tuple[list[SeqResult], float]:
    """The serving benchmark's load on the local engine: the prompts arrive as a Poisson process
    at `request_rate` (inf: all at once), at most engine.n_seq in flight (the rest queue).
    Returns each request's result and the run's duration."""
    rng = random.Random(seed)
    at, arrivals = 0.0, []
    for i, (tokens, max_tokens) in enumerate(prompts):
        if i and math.isfinite(request_rate):
            at += rng.expovariate(request_rate)
        arrivals.append(Arrival(at, tokens, max_tokens, ignore_eos=True))
    results, _ = engine.run(arrivals, policy, cancel=cancel, progress=progress)
    end = max((r.times[-1] for r in results if r.times), default=0.0)
    return results, end


def serve_local(
    runner: LlamaCppRunner, options: ServeOptions, *, cancel: threading.Event
) -> Iterator[Stage | ServingLevel]:
    """Every concurrency level under every policy: vLLM's metrics from the engine's own
    time stamps. Warm-up requests (untimed) precede each level's measured ones."""
    name = _model_name(runner)
    rng = random.Random(options.seed)
    n_vocab = runner.vocab_size()

    def length(mean: int) -> int:
        low = max(1, round(mean * (1 - options.range_ratio)))
        return rng.randint(low, max(low, round(mean * (1 + options.range_ratio))))

    prompts = [
        (
            tuple(rng.randrange(n_vocab) for _ in range(length(options.input_len))),
            length(options.output_len),
        )
        for _ in range(options.num_prompts)
    ]
    warm = [(p, min(n, 16)) for p, n in prompts[: options.warmup]]
    per_seq = max(len(p) + n for p, n in prompts) + 8
    for level in options.concurrency:
        engine = BatchedEngine(runner, n_seq=level, n_ctx_per_seq=per_seq)
        threads = engine.threads
        try:
            for policy in options.policies:
                if cancel.is_set():
                    return
                if warm:
                    tally = Tally(len(warm), sum(n for _, n in warm))
                    yield Stage(f"{policy} c={level} warm-up", tally)
                    serve(
                        engine,
                        policy,
                        warm,
                        request_rate=float("inf"),
                        seed=options.seed,
                        cancel=cancel,
                        progress=tally,
                    )
                tally = Tally(len(prompts), sum(n for _, n in prompts))
                yield Stage(f"{policy} c={level}", tally)
                cpu0 = cpu_sample()
                results, duration = serve(
                    engine,
                    policy,
                    prompts,
                    request_rate=options.request_rate,
                    seed=options.seed,
                    cancel=cancel,
                    progress=tally,
                )
                background = measured_background(cpu0, cpu_sample())
                measured = [request_result(r) for r in results]
                yield ServingLevel(
                    endpoint=LOCAL,
                    model=name,
                    concurrency=level,
                    request_rate=options.request_rate,
                    num_prompts=options.num_prompts,
                    input_len=options.input_len,
                    output_len=options.output_len,
                    metrics=metrics(
                        measured, duration, percentiles=options.percentiles, slo=dict(options.slo)
                    ),
                    interrupted=cancel.is_set(),
                    policy=str(policy),
                    n_threads=threads[0],
                    n_threads_batch=threads[1],
                    background_cpus=background,
                    kv_unified=engine.kv_unified,
                )
        finally:
            engine.close()


def stream_prompt(runner: LlamaCppRunner) -> list[int]:
    """The decoding stream's prompt through the model's own chat template."""
    return runner.request_tokens(Request.chat(STREAM_PROMPT))


def interfere_local(
    runner: LlamaCppRunner, options: InterferenceOptions, *, cancel: threading.Event
) -> Iterator[Stage | InterferenceReport]:
    """The stream alone, then under each policy while the long prompts arrive."""
    runner.load()
    rng = random.Random(options.seed)
    n_vocab = runner.vocab_size()
    count = min(options.num_prompts, MAX_LONG_PROMPTS)
    longs = [[rng.randrange(n_vocab) for _ in range(options.prompt_len)] for _ in range(count)]
    stream = stream_prompt(runner)
    per_seq = max(options.prompt_len, len(stream) + options.output_len) + 16
    engine = BatchedEngine(runner, n_seq=count + 1, n_ctx_per_seq=per_seq)
    every_s = 1 / options.rate

    def measured(policy: Policy | None, tally: Tally) -> InterferenceReport:
        """One run of the lab, with the engine's threads and the machine's load."""
        cpu0 = cpu_sample()
        report = interference(
            engine,
            policy,
            stream=stream,
            stream_tokens=options.output_len,
            long_prompts=longs,
            every_s=every_s,
            cancel=cancel,
            progress=tally,
        )
        background = measured_background(cpu0, cpu_sample())
        n_threads, n_threads_batch = engine.threads
        return dataclasses.replace(
            report, n_threads=n_threads, n_threads_batch=n_threads_batch, background_cpus=background
        )

    try:
        tally = Tally(1, options.output_len)
        yield Stage("the stream alone", tally)
        alone = measured(None, tally)
        if cancel.is_set():
            return  # a cut measurement is not a baseline
        yield alone
        for policy in options.policies:
            if cancel.is_set():
                return
            tally = Tally(1 + count, options.output_len + LONG_TOKENS * count)
            yield Stage(
                f"{policy}: the stream while {count} prompts of {options.prompt_len}"
                f" tokens arrive, {options.rate:g}/s",
                tally,
            )
            report = measured(policy, tally)
            if cancel.is_set():
                return
            yield report
    finally:
        engine.close()
