"""Several sequences in one llama.cpp context: continuous batching with a scheduling policy.

Each step builds one `llama_decode` batch from one decode token of every running sequence and
prefill chunks of waiting ones, as the policy allows:

- `prefill-first`: a waiting prompt is prefilled whole (up to n_batch tokens a step) before the
  running sequences decode again; those steps carry no decode tokens.
- `chunked:B` (Sarathi-Serve): every step carries all running decodes and at most B tokens in
  all, topped up with prefill chunks.
- `decode-first`: prompts are prefilled only when no sequence is decoding; `decode-first:K`
  also lets a prefill in after K decode-only steps.

Sequences share the KV cache (unified) under their own sequence ids, so they never see each
other's entries; a finished sequence's entries are removed. Sampling is greedy, per sequence.
Every step is timed; every token is time-stamped, so each request gets vLLM's figures (queue
wait, TTFT, TPOT, inter-token gaps, E2E) and each step its batch composition.
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from .base import Event, Finished, ModelLoaded, Request, SamplingParams, Token
from .errors import BadRequestError, EngineError, LlmrunError, PromptTooLongError
from .library import llama_lib
from .llamacpp import LlamaCppRunner
from .stats import (
    FINISH_CONTEXT,
    FINISH_INTERRUPTED,
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationStats,
    percentile,
)
from .text import TextStream

POLICIES = ("prefill-first", "decode-first", "chunked")


@dataclass(frozen=True)
class Policy:
    name: str  # prefill-first, decode-first, chunked
    budget: int = 0  # chunked: tokens per step in all

    @classmethod
    def parse(cls, text: str) -> Policy:
        name, _, value = text.strip().lower().partition(":")
        if name not in POLICIES:
            raise BadRequestError(f"--policy: '{text}' is not prefill-first, decode-first or"
                                  " chunked:B")  # fmt: skip
        if name == "chunked":
            if not value.isdigit() or not 1 <= int(value) <= 65536:
                raise BadRequestError(f"--policy: chunked needs a token budget, chunked:64, not"
                                      f" '{text}'")  # fmt: skip
            return cls(name, int(value))
        if name == "decode-first" and value:  # decode-first:K: prefill at least every K steps
            if not value.isdigit() or not 1 <= int(value) <= 65536:
                raise BadRequestError(f"--policy: decode-first:K needs a step count, not '{text}'")
            return cls(name, int(value))
        if value:
            raise BadRequestError(f"--policy: '{name}' takes no value")
        return cls(name)

    def __str__(self) -> str:
        return f"{self.name}:{self.budget}" if self.budget else self.name


@dataclass(frozen=True)
class Arrival:
    at_s: float  # seconds after the start
    tokens: tuple[int, ...]
    max_tokens: int
    ignore_eos: bool = False  # benchmarks generate exactly max_tokens
    sampling: SamplingParams | None = None  # None: greedy, no stop strings


@dataclass
class SeqResult:
    arrival_s: float
    prompt_tokens: int
    output: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # each output token's time stamp
    started_s: float | None = None  # the first step that carried its prompt
    pieces: list[str] = field(default_factory=list)  # each token's text (stop strings applied)
    tail: str = ""
    finish: str = FINISH_LENGTH

    @property
    def queue_s(self) -> float | None:
        return None if self.started_s is None else self.started_s - self.arrival_s

    @property
    def ttft_s(self) -> float | None:
        return self.times[0] - self.arrival_s if self.times else None

    @property
    def gaps_s(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:], strict=False)]

    @property
    def tpot_s(self) -> float | None:
        gaps = self.gaps_s
        return statistics.fmean(gaps) if gaps else None

    @property
    def e2e_s(self) -> float | None:
        return self.times[-1] - self.arrival_s if self.times else None


@dataclass(frozen=True)
class Step:
    start_s: float
    duration_s: float
    n_decode: int
    n_prefill: int


@dataclass
class _Seq:
    sid: int
    result: SeqResult
    tokens: tuple[int, ...]
    max_tokens: int
    ignore_eos: bool = False
    chain: Any = None  # its own sampler chain (None: the engine's greedy one)
    text: TextStream | None = None
    prefilled: int = 0
    pending: int | None = None  # sampled, not yet decoded
    done: bool = False


class BatchedEngine:
    """A context of its own with `n_seq` sequences, over the runner's loaded weights."""

    def __init__(self, runner: LlamaCppRunner, *, n_seq: int, n_ctx_per_seq: int, n_batch: int
                 = 512) -> None:  # fmt: skip
        lib = llama_lib()
        loaded = runner.load()
        assert runner._model is not None
        self.lib, self.runner, self.n_seq, self.n_batch = lib, runner, n_seq, n_batch
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = n_seq * n_ctx_per_seq
        cparams.n_batch = n_batch
        cparams.n_ubatch = n_batch
        cparams.n_seq_max = n_seq
        cparams.kv_unified = True
        cparams.n_threads = loaded.settings.n_threads
        cparams.n_threads_batch = loaded.settings.n_threads_batch
        cparams.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cparams.no_perf = True
        self.ctx = lib.llama_init_from_model(runner._model.ptr, cparams)
        if not self.ctx:
            raise EngineError("llama.cpp could not create a context for several sequences")
        self.vocab = runner._model.vocab
        self.batch = lib.llama_batch_init(n_batch, 0, 1)
        self.chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        lib.llama_sampler_chain_add(self.chain, lib.llama_sampler_init_greedy())
        self._held = 0  # decode-only steps since the last prefill (decode-first:K)

    def close(self) -> None:
        if self.ctx:
            self.lib.llama_sampler_free(self.chain)
            self.lib.llama_batch_free(self.batch)
            self.lib.llama_free(self.ctx)
            self.ctx = None

    def run(
        self,
        arrivals: Sequence[Arrival],
        policy: Policy,
        *,
        cancel: threading.Event | None = None,
    ) -> tuple[list[SeqResult], list[Step]]:
        """Serve the arrivals (at most n_seq at once; later ones queue) under the policy."""
        lib = self.lib
        lib.llama_memory_clear(lib.llama_get_memory(self.ctx), True)
        queue = sorted(arrivals, key=lambda a: a.at_s)
        results = [SeqResult(a.at_s, len(a.tokens)) for a in queue]
        waiting: list[_Seq] = []
        running: list[_Seq] = []
        free = list(range(self.n_seq))
        steps: list[Step] = []
        t0 = time.perf_counter()
        nxt = 0
        while nxt < len(queue) or waiting or running:
            if cancel is not None and cancel.is_set():
                break
            now = time.perf_counter() - t0
            while nxt < len(queue) and queue[nxt].at_s <= now and free:
                a = queue[nxt]
                seq = _Seq(free.pop(0), results[nxt], a.tokens, a.max_tokens, a.ignore_eos)
                if a.sampling is not None:
                    sp = a.sampling
                    seed = sp.seed if sp.seed is not None else random.randrange(2**31)
                    seq.chain = self.runner._sampler(sp, seed, prompt=a.tokens)
                    seq.text = TextStream(sp.stop)
                waiting.append(seq)
                nxt += 1
            if not waiting and not running:
                time.sleep(max(0.0, min(queue[nxt].at_s - now, 0.05)))
                continue
            entries, prefilling = self._plan(waiting, running, policy)
            if not entries:
                time.sleep(0.001)
                continue
            start = time.perf_counter()
            self._decode(entries)
            end = time.perf_counter()
            steps.append(Step(start - t0, end - start, sum(1 for e in entries if e[3] == "d"),
                              sum(1 for e in entries if e[3] == "p")))  # fmt: skip
            stamp = end - t0
            for index, (seq, _, _, kind, last) in enumerate(entries):
                if seq.result.started_s is None:
                    seq.result.started_s = start - t0
                if kind == "d" or last:
                    chain = seq.chain if seq.chain is not None else self.chain
                    token = lib.llama_sampler_sample(chain, self.ctx, index)
                    self._emit(seq, token, stamp)
            for seq in prefilling:
                if seq.prefilled == len(seq.tokens) and seq in waiting:
                    waiting.remove(seq)
                    running.append(seq)  # a sequence done at once leaves with the others
            for seq in [s for s in running if s.done]:
                self._finish(seq)
                running.remove(seq)
                lib.llama_memory_seq_rm(lib.llama_get_memory(self.ctx), seq.sid, -1, -1)
                free.append(seq.sid)
        return results, steps

    def _plan(
        self, waiting: list[_Seq], running: list[_Seq], policy: Policy
    ) -> tuple[list[tuple[_Seq, int, int, str, bool]], list[_Seq]]:
        """(seq, token, position, 'd' or 'p', logits wanted) for each batch entry."""
        decodes = [(s, s.pending, s.prefilled + len(s.result.output) - 1, "d", True)
                   for s in running if s.pending is not None]  # fmt: skip
        room = self.n_batch
        if policy.name == "chunked":
            room = max(0, min(self.n_batch, policy.budget) - len(decodes))
        elif policy.name == "prefill-first" and waiting:
            decodes, room = [], self.n_batch  # the prompt first, whole
        elif policy.name == "decode-first" and decodes:
            self._held += 1  # decode-first:K lets a prefill in after K decode-only steps
            room = 0 if not policy.budget or self._held < policy.budget else self.n_batch
            if room:
                self._held = 0
            room = max(0, room - len(decodes))
        else:
            room = self.n_batch - len(decodes)
        entries: list[tuple[_Seq, int, int, str, bool]] = [
            (s, int(t), p, k, w) for s, t, p, k, w in decodes if t is not None
        ]
        prefilling: list[_Seq] = []
        for seq in waiting:
            if room <= 0:
                break
            take = min(room, len(seq.tokens) - seq.prefilled)
            for i in range(take):
                pos = seq.prefilled + i
                entries.append((seq, seq.tokens[pos], pos, "p", pos == len(seq.tokens) - 1))
            seq.prefilled += take
            room -= take
            prefilling.append(seq)
        return entries, prefilling

    def _decode(self, entries: list[tuple[_Seq, int, int, str, bool]]) -> None:
        b = self.batch
        for i, (seq, token, pos, _, logits) in enumerate(entries):
            b.token[i] = token
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq.sid
            b.logits[i] = logits
        b.n_tokens = len(entries)
        rc = self.lib.llama_decode(self.ctx, b)
        if rc != 0:
            raise EngineError(f"llama_decode failed in a batched step (code {rc})")

    def _emit(self, seq: _Seq, token: int, stamp: float) -> None:
        if not seq.ignore_eos and self.lib.llama_vocab_is_eog(self.vocab, token):
            seq.done, seq.pending, seq.result.finish = True, None, FINISH_STOP
            return
        seq.result.output.append(token)
        seq.result.times.append(stamp)
        seq.pending = token
        if seq.text is not None:
            seq.result.pieces.append(seq.text.feed(self.runner.piece(token)))
            if seq.text.stopped:
                seq.done, seq.pending, seq.result.finish = True, None, FINISH_STOP
                return
        if len(seq.result.output) >= seq.max_tokens:
            seq.done, seq.pending = True, None

    def _finish(self, seq: _Seq) -> None:
        if seq.text is not None:
            seq.result.tail = seq.text.flush()
        if seq.chain is not None:
            self.lib.llama_sampler_free(seq.chain)
            seq.chain = None


@dataclass(frozen=True)
class InterferenceReport:
    """One decoding stream's gaps, alone and under each policy, while long prompts arrive."""

    policy: str
    stream_itl_ms: tuple[float, ...]
    long_ttft_ms: tuple[float, ...]
    steps: tuple[Step, ...]
    throughput_tps: float
    stream_times_s: tuple[float, ...] = ()  # when each of the stream's tokens landed

    def itl(self, q: float) -> float | None:
        return percentile(list(self.stream_itl_ms), q)

    @property
    def prefill_in_gaps_ms(self) -> float:
        """Time of the steps that carried prefill while the stream was between two tokens."""
        if len(self.stream_times_s) < 2:
            return 0.0
        first, last = self.stream_times_s[0], self.stream_times_s[-1]
        return 1000 * sum(s.duration_s for s in self.steps
                          if s.n_prefill and first <= s.start_s < last)  # fmt: skip

    @property
    def prefill_ms(self) -> float:
        return 1000 * sum(s.duration_s for s in self.steps if s.n_prefill)


def serve(
    engine: BatchedEngine,
    policy: Policy,
    prompts: Sequence[tuple[tuple[int, ...], int]],
    *,
    request_rate: float,
    seed: int,
    cancel: threading.Event | None = None,
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
    results, _ = engine.run(arrivals, policy, cancel=cancel)
    end = max((r.times[-1] for r in results if r.times), default=0.0)
    return results, end


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
) -> InterferenceReport:
    """The stream decodes while the long prompts arrive every `every_s` from `start_s`; with
    policy None the stream runs alone (the baseline). `cancel` stops the engine's loop."""
    arrivals = [Arrival(0.0, tuple(stream), stream_tokens)]
    if policy is not None:
        arrivals += [
            Arrival(start_s + i * every_s, tuple(p), 4) for i, p in enumerate(long_prompts)
        ]
    results, steps = engine.run(arrivals, policy or Policy("chunked", engine.n_batch),
                                cancel=cancel)  # fmt: skip
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


class NotStartedError(LlmrunError):
    """A request still waiting for a free sequence when the run was interrupted."""

    def __init__(self) -> None:
        super().__init__("not started: the run was interrupted before this request's turn")


def serve_requests(
    runner: LlamaCppRunner,
    requests: Sequence[Request],
    *,
    n_seq: int,
    n_ctx: int | None = None,
    policy: Policy | None = None,
    cancel: threading.Event | None = None,
) -> tuple[list[Finished | LlmrunError], float]:
    """Requests served concurrently (at most n_seq at once), each with its own sampling and
    stop strings: per request, in order, its Finished or the error that stopped it alone (a
    chat template that fails, a prompt longer than `n_ctx`, not started before an interrupt);
    and the run's seconds. `n_ctx` is each request's context (prompt and output), as -c is for
    one request; without it, each gets what the longest request needs."""
    loaded = runner.load()
    outcome: list[Finished | LlmrunError | None] = [None] * len(requests)
    prompts: dict[int, list[int]] = {}
    limits: dict[int, int] = {}  # each request's output budget within its context
    for i, request in enumerate(requests):
        try:
            prompt = runner.request_tokens(request)
        except LlmrunError as e:
            outcome[i] = e
            continue
        if n_ctx is not None and len(prompt) + 1 > n_ctx:
            outcome[i] = PromptTooLongError(len(prompt), n_ctx)
            continue
        prompts[i] = prompt
        room = n_ctx - len(prompt) if n_ctx is not None else request.sampling.max_tokens
        limits[i] = min(request.sampling.max_tokens, room)
    if not prompts:
        return [o for o in outcome if o is not None], 0.0
    per_seq = n_ctx or max(len(p) + limits[i] for i, p in prompts.items()) + 8
    settings = dataclasses.replace(loaded.settings, n_ctx=per_seq)
    engine = BatchedEngine(runner, n_seq=n_seq, n_ctx_per_seq=per_seq,
                           n_batch=loaded.settings.n_batch)  # fmt: skip
    order = sorted(prompts)
    try:
        arrivals = [Arrival(0.0, tuple(prompts[i]), limits[i], requests[i].sampling.ignore_eos,
                            requests[i].sampling) for i in order]  # fmt: skip
        results, _ = engine.run(arrivals, policy or Policy("chunked", engine.n_batch),
                                cancel=cancel)  # fmt: skip
    finally:
        engine.close()
    interrupted = cancel is not None and cancel.is_set()
    for i, r in zip(order, results, strict=True):
        request, prompt = requests[i], prompts[i]
        if interrupted and r.started_s is None:
            outcome[i] = NotStartedError()
            continue
        finish = r.finish
        if finish == FINISH_LENGTH and len(r.output) < limits[i]:
            finish = FINISH_INTERRUPTED  # cut by Ctrl-C, not by -n
        elif finish == FINISH_LENGTH and limits[i] < request.sampling.max_tokens:
            finish = FINISH_CONTEXT  # -c, not -n, ended it
        first = r.times[0] if r.times else None
        stats = GenerationStats(
            finish_reason=finish if r.times or finish == FINISH_STOP else FINISH_INTERRUPTED,
            prompt_tokens=len(prompt), reused_tokens=0, output_tokens=len(r.output),
            template_tokenize_s=0.0,
            prefill_s=(first - r.started_s) if first is not None and r.started_s is not None
            else 0.0,
            first_sample_s=0.0, itl_s=tuple(r.gaps_s),
            e2e_s=r.times[-1] if r.times else 0.0, load_s=loaded.load_s,
            seed=request.sampling.seed, model=loaded.model, settings=settings,
            first_token_s=first,
        )  # fmt: skip
        outcome[i] = Finished(stats, "".join(r.pieces) + r.tail, r.tail)
    end = max((r.times[-1] for r in results if r.times), default=0.0)
    return [o for o in outcome if o is not None], end


class Replay:
    """A Runner that replays requests already served (by `serve_requests`): their tokens as
    events with the times they had, then their stats, so `run` prints them as it does any;
    a request that failed alone raises its error when its turn comes."""

    replays = True  # every request was already served: an interrupted one does not stop the rest

    def __init__(self, runner: LlamaCppRunner, finished: Sequence[Finished | LlmrunError]) -> None:
        self.runner, self._finished = runner, list(finished)

    @property
    def loaded(self) -> ModelLoaded | None:
        return self.runner.loaded

    def load(self) -> ModelLoaded:
        return self.runner.load()

    def stream(self, request: Request, *, cancel: threading.Event | None = None) -> Iterator[Event]:
        done = self._finished.pop(0)
        if isinstance(done, LlmrunError):
            raise done
        body = done.text[: len(done.text) - len(done.tail)] if done.tail else done.text
        if body:
            yield Token(0, body, done.stats.first_token_s or 0.0)
        yield done

    def count_tokens(self, request: Request) -> int:
        return self.runner.count_tokens(request)

    def reset(self) -> None:
        self.runner.reset()

    def close(self) -> None:
        self.runner.close()
