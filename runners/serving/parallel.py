"""`run --parallel`: requests served together on the batched engine, each keeping its own
sampling, stop strings and stats; per request, in order, its events or the error that
stopped it alone."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from llmrun.runners.base import Event, Finished, LocalLoaded, Request, Token
from llmrun.runners.errors import EngineError, LlmrunError, PromptTooLongError
from llmrun.runners.llamacpp import LlamaCppRunner
from llmrun.runners.stats import (
    FINISH_CONTEXT,
    FINISH_INTERRUPTED,
    FINISH_LENGTH,
    FINISH_STOP,
    EngineSettings,
    GenerationStats,
)
from llmrun.runners.system import cpu_sample, measured_background

from .batching import FINISH_CANCELLED, FINISH_ERROR, Arrival, BatchedEngine, SeqResult
from .policy import Policy

Outcome = Finished | LlmrunError  # a request's: its result, or the error that stopped it alone


class NotStartedError(LlmrunError):
    """A request still waiting for a free sequence when the run was interrupted."""

    def __init__(self) -> None:
        super().__init__("not started: the run was interrupted before this request's turn")


@dataclass(frozen=True)
class ParallelRun:
    """Requests served batched: per request, in order, its outcome; the run's seconds, and
    whether an interrupt cut it short (the requests finished before it keep their results)."""

    outcomes: tuple[Outcome, ...]
    seconds: float
    interrupted: bool

    def events(self) -> Iterator[Iterator[Event]]:
        """Per request, in order, its events: its text (one Token at the time its first token
        came) and its Finished; a request that failed alone raises its error when its events
        are read, so a caller reports it in its turn."""
        return (request_events(o) for o in self.outcomes)


def request_events(outcome: Outcome) -> Iterator[Event]:
    """A served request's events, or its error raised as they are read."""
    if isinstance(outcome, LlmrunError):
        raise outcome
    body = outcome.text[: len(outcome.text) - len(outcome.tail)] if outcome.tail else outcome.text
    if body:
        yield Token(0, body, outcome.stats.first_token_s or 0.0)
    yield outcome


@dataclass
class _Prompts:
    """The requests that can be served: each one's tokens and output budget, by index."""

    tokens: dict[int, list[int]]
    limits: dict[int, int]  # each request's output budget within its context


def _prompts(
    runner: LlamaCppRunner,
    requests: Sequence[Request],
    n_ctx: int | None,
    outcome: list[Outcome | None],
) -> _Prompts:
    """Each request tokenized; a request that cannot be served gets its error in `outcome`."""
    out = _Prompts({}, {})
    for i, request in enumerate(requests):
        try:
            prompt = runner.request_tokens(request)
        except LlmrunError as e:
            outcome[i] = e
            continue
        if n_ctx is not None and len(prompt) + 1 > n_ctx:
            outcome[i] = PromptTooLongError(len(prompt), n_ctx)
            continue
        out.tokens[i] = prompt
        room = n_ctx - len(prompt) if n_ctx is not None else request.sampling.max_tokens
        out.limits[i] = min(request.sampling.max_tokens, room)
    return out


def serve_requests(
    runner: LlamaCppRunner,
    requests: Sequence[Request],
    *,
    n_seq: int,
    n_ctx: int | None = None,
    policy: Policy | None = None,
    cancel: threading.Event | None = None,
) -> tuple[list[Outcome], float]:
    """Requests served concurrently (at most n_seq at once), each with its own sampling and
    stop strings: per request, in order, its Finished or the error that stopped it alone (a
    chat template that fails, a prompt longer than `n_ctx`, not started before an interrupt);
    and the run's seconds. `n_ctx` is each request's context (prompt and output), as -c is for
    one request; without it, each gets what the longest request needs.

    A runner not loaded yet makes one context, for the n_seq sequences: its weights are
    loaded to tokenize, then its own context is created for them (`load(n_seq=, n_ctx=)`)
    and lent to the engine, so the load time and settings each request reports are that
    context's. A runner already loaded for one sequence keeps its context; the engine then
    makes its own."""
    fresh = runner.loaded is None
    runner.load_weights(n_seq=n_seq, n_ctx=n_ctx)  # on a GPU, the layers that fit beside N KVs
    outcome: list[Outcome | None] = [None] * len(requests)
    prompts = _prompts(runner, requests, n_ctx, outcome)
    if not prompts.tokens:
        runner.load()  # as loaded as a run that served none: `run` says each one's error
        return [o for o in outcome if o is not None], 0.0
    limits = prompts.limits
    per_seq = n_ctx or max(len(p) + limits[i] for i, p in prompts.tokens.items()) + 8
    loaded = runner.load(n_seq=n_seq, n_ctx=per_seq) if fresh else runner.load()
    engine = BatchedEngine(
        runner,
        n_seq=n_seq,
        n_ctx_per_seq=per_seq,
        n_batch=loaded.settings.n_batch,
        context=runner.context if fresh else None,  # fresh: made for the n_seq sequences
    )
    n_threads, n_threads_batch = engine.threads
    params = {**loaded.settings.params, "n_seq_max": n_seq, "kv_unified": engine.kv_unified}
    settings = dataclasses.replace(
        loaded.settings,
        n_ctx=per_seq,
        n_threads=n_threads,
        n_threads_batch=n_threads_batch,
        params=params,
    )
    order = sorted(prompts.tokens)
    try:
        arrivals = [
            Arrival(
                0.0,
                tuple(prompts.tokens[i]),
                limits[i],
                requests[i].sampling.ignore_eos,
                requests[i].sampling,
            )
            for i in order
        ]
        cpu0 = cpu_sample()
        results, _ = engine.run(
            arrivals, policy or Policy("chunked", engine.n_batch), cancel=cancel
        )
        background = measured_background(cpu0, cpu_sample())
    finally:
        engine.close()
    interrupted = cancel is not None and cancel.is_set()
    for i, r in zip(order, results, strict=True):
        if interrupted and r.started_s is None:
            outcome[i] = NotStartedError()
        elif r.finish == FINISH_ERROR and r.error:  # refused alone as it was admitted
            outcome[i] = EngineError(r.error)
        else:
            stats = _stats(
                r,
                requests[i],
                len(prompts.tokens[i]),
                limits[i],
                loaded=loaded,
                settings=settings,
                background_cpus=background,
            )
            outcome[i] = Finished(stats, "".join(r.pieces) + r.tail, r.tail)
    end = max((r.times[-1] for r in results if r.times), default=0.0)
    return [o for o in outcome if o is not None], end


def _stats(
    r: SeqResult,
    request: Request,
    prompt_tokens: int,
    limit: int,
    *,
    loaded: LocalLoaded,
    settings: EngineSettings,
    background_cpus: float | None,
) -> GenerationStats:
    """One served request's record, its times on the engine's clock (the run's start)."""
    finish = r.finish
    if finish in (FINISH_LENGTH, FINISH_CANCELLED) and len(r.output) < limit:
        finish = FINISH_INTERRUPTED  # cut by Ctrl-C, not by -n
    elif finish == FINISH_LENGTH and limit < request.sampling.max_tokens:
        finish = FINISH_CONTEXT  # -c, not -n, ended it
    first = r.times[0] if r.times else None
    return GenerationStats(
        finish_reason=finish if r.times or finish == FINISH_STOP else FINISH_INTERRUPTED,
        prompt_tokens=prompt_tokens,
        reused_tokens=0,
        output_tokens=len(r.output),
        template_tokenize_s=0.0,
        prefill_s=(first - r.started_s) if first is not None and r.started_s is not None else 0.0,
        first_sample_s=0.0,
        itl_s=tuple(r.gaps_s),
        e2e_s=r.times[-1] if r.times else 0.0,
        load_s=loaded.load_s,
        seed=request.sampling.seed,
        model=loaded.model,
        settings=settings,
        first_token_s=first,
        background_cpus=background_cpus,
    )
