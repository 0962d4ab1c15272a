"""The serving benchmark and the interference lab on this machine's engine, in-process: fresh
random prompts (prompts.py) or a dataset's, one batched context per concurrency level, every
scheduling policy in turn. They yield what they are doing (`Stage`) and typed results; the
terminal is the caller's."""

from __future__ import annotations

import dataclasses
import functools
import math
import random
import threading
from collections.abc import Callable, Iterator, Sequence

from llmrun.runners.base import Request
from llmrun.runners.llamacpp import LlamaCppRunner
from llmrun.runners.progress import Tally
from llmrun.runners.system import cpu_sample, measured_background

from .batching import FINISH_CANCELLED, FINISH_ERROR, Arrival, BatchedEngine, SeqResult
from .figures import RequestResult, metrics
from .interference import LONG_TOKENS, InterferenceReport, interference
from .load import ServingLevel, cached_total
from .options import InterferenceOptions, ServeOptions, Stage
from .policy import Policy
from .prompts import FreshPrompts

TokenPrompt = tuple[tuple[int, ...], int]  # a request's prompt tokens and output budget

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
        error=(r.error or "llama.cpp could not serve it") if r.finish == FINISH_ERROR else None,
        cancelled=r.finish == FINISH_CANCELLED,  # one that ended without a token failed
        cached_tokens=0,  # the benchmark's engines keep no prefix (keep_prefix off)
    )


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


def round_prompts(
    runner: LlamaCppRunner, options: ServeOptions
) -> tuple[Callable[[], tuple[list[TokenPrompt], list[TokenPrompt]]], int]:
    """What makes each round's (level and policy's) warm-up and measured prompts, and the tokens
    a sequence needs. Random ones are fresh every round, their lengths the same; a dataset's
    are the same every round (the engine starts each round with its KV cache empty, so there
    is no cache to answer from)."""
    if options.dataset is not None:

        def counted(text: str) -> int:
            return len(runner.tokenize(text, add_special=True))

        w = options.warmup
        sampled = options.dataset.sample(
            counted,
            count=options.num_prompts + w,
            seed=options.seed,
            output_len=options.output_len,
            fixed=options.output_len_given,
        )
        tokens = [(tuple(runner.tokenize(p.text, add_special=True)), p.max_tokens) for p in sampled]
        warm = [(t, min(n, 16)) for t, n in tokens[:w]]
        per_seq = max(len(t) + n for t, n in tokens) + 8
        return lambda: (warm, tokens[w:]), per_seq
    n_vocab = runner.vocab_size()
    fresh = FreshPrompts(options.seed, "serve", options.shared_prefix)
    warm_lengths, lengths = options.lengths()

    def made() -> tuple[list[TokenPrompt], list[TokenPrompt]]:
        warm = [(fresh.tokens(i, n_vocab), o) for i, o in warm_lengths]
        return warm, [(fresh.tokens(i, n_vocab), o) for i, o in lengths]

    per_seq = options.shared_prefix + max(i + o for i, o in [*lengths, *warm_lengths]) + 8
    return made, per_seq


def serve_local(
    runner: LlamaCppRunner, options: ServeOptions, *, cancel: threading.Event
) -> Iterator[Stage | ServingLevel]:
    """Every concurrency level under every policy: vLLM's metrics from the engine's own
    time stamps. Warm-up requests (untimed) precede each level's measured ones."""
    model = runner.load().model
    made, per_seq = round_prompts(runner, options)
    input_len, output_len = options.input_len, options.output_len
    if options.dataset is not None:  # the data's lengths: the mean of what was sampled
        sample = made()[1]
        input_len = round(sum(len(t) for t, _ in sample) / len(sample))
        output_len = round(sum(n for _, n in sample) / len(sample))
    for level in options.concurrency:
        engine = BatchedEngine(runner, n_seq=level, n_ctx_per_seq=per_seq)
        threads = engine.threads
        try:
            for policy in options.policies:
                if cancel.is_set():
                    return
                warm, prompts = made()
                served = functools.partial(serve, engine, policy, seed=options.seed, cancel=cancel)
                if warm:
                    tally = Tally(len(warm), sum(n for _, n in warm))
                    yield Stage(f"{policy} slots={level} warm-up", tally)
                    served(warm, request_rate=float("inf"), progress=tally)
                tally = Tally(len(prompts), sum(n for _, n in prompts))
                yield Stage(f"{policy} slots={level}", tally)
                cpu0 = cpu_sample()
                results, duration = served(
                    prompts, request_rate=options.request_rate, progress=tally
                )
                background = measured_background(cpu0, cpu_sample())
                measured = [request_result(r) for r in results]
                yield ServingLevel(
                    endpoint=LOCAL,
                    model=model.name if model else "",
                    concurrency=level,
                    request_rate=options.request_rate,
                    num_prompts=options.num_prompts,
                    input_len=input_len,
                    output_len=output_len,
                    metrics=metrics(
                        measured, duration, percentiles=options.percentiles, slo=dict(options.slo)
                    ),
                    interrupted=cancel.is_set(),
                    policy=str(policy),
                    n_threads=threads[0],
                    n_threads_batch=threads[1],
                    background_cpus=background,
                    kv_unified=engine.kv_unified,
                    cached_tokens=cached_total(measured),
                    shared_prefix=options.shared_prefix,
                    dataset=options.dataset.record() if options.dataset is not None else {},
                )
        finally:
            engine.close()


def stream_prompt(runner: LlamaCppRunner) -> list[int]:
    """The decoding stream's prompt through the model's own chat template: the same in every
    round, so that alone and under each policy the same stream is measured. The engine starts
    every round with its KV cache empty (no prefix kept), so no round prefills it from cache."""
    return runner.request_tokens(Request.chat(STREAM_PROMPT))


def interfere_local(
    runner: LlamaCppRunner, options: InterferenceOptions, *, cancel: threading.Event
) -> Iterator[Stage | InterferenceReport]:
    """The stream alone, then under each policy while the long prompts arrive."""
    runner.load()
    n_vocab = runner.vocab_size()
    count = min(options.num_prompts, MAX_LONG_PROMPTS)
    fresh = FreshPrompts(options.seed, "interference")
    stream = stream_prompt(runner)
    per_seq = max(options.prompt_len, len(stream) + options.output_len) + 16
    engine = BatchedEngine(runner, n_seq=count + 1, n_ctx_per_seq=per_seq)
    every_s = 1 / options.rate

    def measured(policy: Policy | None, tally: Tally) -> InterferenceReport:
        """One run of the lab, with the engine's threads and the machine's load; each policy's
        long prompts its own."""
        n_longs = 0 if policy is None else count
        longs = [fresh.tokens(options.prompt_len, n_vocab) for _ in range(n_longs)]
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
