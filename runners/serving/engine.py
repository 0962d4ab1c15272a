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
other's entries; a finished sequence's entries are removed. Sampling is greedy (one argmax over
all sequences' logits in numpy) or a sequence's own llama.cpp sampler chain. A step costs O(1)
Python per decoding sequence: the batch is filled through ctypes views of its arrays, and the
hot llama.cpp functions are looked up once.
Every step is timed; every token is time-stamped, so each request gets vLLM's figures (queue
wait, TTFT, TPOT, inter-token gaps, E2E) and each step its batch composition.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import random
import statistics
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from llmrun.runners.base import Event, Finished, ModelLoaded, Request, SamplingParams, Token
from llmrun.runners.errors import BadRequestError, EngineError, LlmrunError, PromptTooLongError
from llmrun.runners.handles import Batch, Sampler
from llmrun.runners.library import llama_lib
from llmrun.runners.llamacpp import LlamaCppRunner
from llmrun.runners.stats import (
    FINISH_CONTEXT,
    FINISH_INTERRUPTED,
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationStats,
    percentile,
)
from llmrun.runners.system import busy_machine, cpu_sample, measured_background
from llmrun.runners.text import TextStream

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
    chain: Sampler | None = None  # its own sampler chain (None: greedy, one argmax in numpy)
    text: TextStream | None = None
    prefilled: int = 0
    pending: int | None = None  # sampled, not yet decoded
    done: bool = False


def _sid(seq: _Seq) -> int:
    return seq.sid


class _StepBatch(Batch):
    """The engine's llama_batch (one sequence per entry), with typed views of its arrays, so a
    step fills it by index and slice without building objects per token."""

    def __init__(self, lib: Any, capacity: int) -> None:
        super().__init__(lib, capacity, 1)
        s = self.struct

        def view(ptr: Any, ctype: Any) -> Any:
            return (ctype * capacity).from_address(ctypes.addressof(ptr.contents))

        self.token = view(s.token, ctypes.c_int32)
        self.pos = view(s.pos, ctypes.c_int32)
        self.logits = view(s.logits, ctypes.c_int8)
        self.logits_addr = ctypes.addressof(s.logits.contents)
        self.seq_rows = [s.seq_id[i] for i in range(capacity)]  # each entry's one sequence id
        self.row_sid = [-1] * capacity  # what each entry holds now: written only on a change
        view(s.n_seq_id, ctypes.c_int32)[:] = [1] * capacity

    def set_seq(self, i: int, n: int, sid: int) -> None:
        """Entries i .. i + n - 1 belong to sequence sid."""
        row_sid, rows = self.row_sid, self.seq_rows
        for k in range(i, i + n):
            if row_sid[k] != sid:
                rows[k][0] = sid
                row_sid[k] = sid


class BatchedEngine:
    """A context of its own with `n_seq` sequences, over the runner's loaded weights.

    Every C object is owned (runners/handles.py): the context, made by the runner, is closed
    before the weights it was made from, even when the runner closes first; the batch and each
    sequence's sampler chain are freed once. `close` may be called any number of times."""

    def __init__(self, runner: LlamaCppRunner, *, n_seq: int, n_ctx_per_seq: int, n_batch: int
                 = 512, kv_unified: bool = True) -> None:  # fmt: skip
        import numpy as np

        lib = llama_lib()
        self.lib, self.runner, self.n_seq, self.n_batch = lib, runner, n_seq, n_batch
        # the runner's threads and flash attention, so one sequence decodes as `run` does
        self.ctx = runner.make_context(n_seq=n_seq, n_ctx=n_seq * n_ctx_per_seq,
                                       n_batch=n_batch, kv_unified=kv_unified)  # fmt: skip
        self.batch = _StepBatch(lib, n_batch)
        self.n_vocab = runner.vocab_size()
        self._np = np
        self._held = 0  # decode-only steps since the last prefill (decode-first:K)
        # the step's hot calls, looked up once
        self._llama_decode = lib.llama_decode
        self._synchronize = lib.llama_synchronize
        self._get_logits = lib.llama_get_logits
        self._is_eog = runner.is_eog
        self._view_key: tuple[int, int] = (0, 0)
        self._view: Any = None
        self._outs: list[_Seq] = []  # the sequences sampled after this step, in batch order
        self._out_rows: list[int] = []  # and their entries in the batch

    @property
    def threads(self) -> tuple[int, int]:
        """The threads llama.cpp was given for this context: one token a step, and batches."""
        ptr = self.ctx.ptr
        return int(self.lib.llama_n_threads(ptr)), int(self.lib.llama_n_threads_batch(ptr))

    def close(self) -> None:
        """Free the batch, then the context (each once); the runner's weights stay loaded."""
        self.batch.close()
        self.ctx.close()

    def __enter__(self) -> BatchedEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def new_chain(self, sp: SamplingParams, seed: int, *, prompt: Sequence[int] = ()) -> Sampler:
        """A sequence's own sampler chain for these settings (closed when it finishes)."""
        return self.runner.new_sampler(sp, seed, prompt=prompt)

    def run(
        self,
        arrivals: Sequence[Arrival],
        policy: Policy,
        *,
        cancel: threading.Event | None = None,
    ) -> tuple[list[SeqResult], list[Step]]:
        """Serve the arrivals (at most n_seq at once; later ones queue) under the policy."""
        self.ctx.clear()
        queue = sorted(arrivals, key=lambda a: a.at_s)
        results = [SeqResult(a.at_s, len(a.tokens)) for a in queue]
        waiting: list[_Seq] = []
        running: list[_Seq] = []
        free = list(range(self.n_seq))
        steps: list[Step] = []
        clock = time.perf_counter
        t0 = clock()
        nxt = 0
        try:
            while nxt < len(queue) or waiting or running:
                if cancel is not None and cancel.is_set():
                    break
                now = clock() - t0
                while nxt < len(queue) and queue[nxt].at_s <= now and free:
                    a = queue[nxt]
                    seq = _Seq(free.pop(0), results[nxt], a.tokens, a.max_tokens, a.ignore_eos)
                    if a.sampling is not None:
                        sp = a.sampling
                        seed = sp.seed if sp.seed is not None else random.randrange(2**31)
                        seq.chain = self.new_chain(sp, seed, prompt=a.tokens)
                        seq.text = TextStream(sp.stop)
                    waiting.append(seq)
                    nxt += 1
                if not waiting and not running:
                    time.sleep(max(0.0, min(queue[nxt].at_s - now, 0.05)))
                    continue
                decodes, chunks = self._schedule(waiting, running, policy)
                if not decodes and not chunks:
                    time.sleep(0.001)
                    continue
                start = clock()
                n_prefill = self._fill(decodes, chunks)
                self._step()
                end = clock()
                steps.append(Step(start - t0, end - start, len(decodes), n_prefill))
                for seq, _, _ in chunks:
                    if seq.result.started_s is None:
                        seq.result.started_s = start - t0
                self._sample_and_emit(end - t0)
                for seq, _, _ in chunks:
                    if seq.prefilled == len(seq.tokens) and seq in waiting:
                        waiting.remove(seq)
                        running.append(seq)  # a sequence done at once leaves with the others
                if any(s.done for s in running):
                    for seq in [s for s in running if s.done]:
                        self._finish(seq)
                        running.remove(seq)
                        self.ctx.remove(seq.sid)
                        free.append(seq.sid)
                    free.sort()  # the lowest ids first, so the running ones stay consecutive
        finally:
            for seq in (*waiting, *running):  # interrupted: their samplers go too
                self._finish(seq)
        return results, steps

    def _schedule(
        self, waiting: list[_Seq], running: list[_Seq], policy: Policy
    ) -> tuple[list[_Seq], list[tuple[_Seq, int, int]]]:
        """The step under the policy: the sequences that decode their pending token, and the
        prompt chunks (sequence, first position, length) that go with them."""
        # in sequence order: with one KV stream per sequence (kv_unified off) llama.cpp puts only
        # consecutive sequence ids into one ubatch, so an unordered step would split in many
        decodes = sorted((s for s in running if s.pending is not None), key=_sid)
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
        chunks: list[tuple[_Seq, int, int]] = []
        for seq in waiting:
            if room <= 0:
                break
            take = min(room, len(seq.tokens) - seq.prefilled)
            chunks.append((seq, seq.prefilled, take))
            seq.prefilled += take
            room -= take
        return decodes, chunks

    def _fill(self, decodes: list[_Seq], chunks: list[tuple[_Seq, int, int]]) -> int:
        """The batch: one entry per decoding sequence, then the prompt chunks; returns the
        prompt tokens in it. Notes which rows are sampled after the step."""
        b = self.batch
        token, pos, logits, set_seq = b.token, b.pos, b.logits, b.set_seq
        outs, rows = self._outs, self._out_rows
        outs.clear()
        rows.clear()
        i = 0
        for s in decodes:
            token[i] = s.pending
            pos[i] = s.prefilled + len(s.result.output) - 1
            logits[i] = 1
            set_seq(i, 1, s.sid)
            outs.append(s)
            rows.append(i)
            i += 1
        n_prefill = 0
        for s, first, n in chunks:
            j = i + n
            token[i:j] = s.tokens[first : first + n]
            pos[i:j] = range(first, first + n)
            ctypes.memset(b.logits_addr + i, 0, n)
            set_seq(i, n, s.sid)
            if first + n == len(s.tokens):  # the prompt's last token: its logits are sampled
                logits[j - 1] = 1
                outs.append(s)
                rows.append(j - 1)
            n_prefill += n
            i = j
        b.struct.n_tokens = i
        return n_prefill

    def _step(self) -> None:
        """One llama_decode of the filled batch, waited for (decode is asynchronous on GPUs)."""
        rc = self._llama_decode(self.ctx.ptr, self.batch.struct)
        if rc != 0:
            raise EngineError(f"llama_decode failed in a batched step (code {rc})")
        self._synchronize(self.ctx.ptr)

    def _sample_and_emit(self, stamp: float) -> None:
        """Each sampled sequence's next token: argmax over all greedy rows in one numpy call,
        a sequence's own chain in C otherwise."""
        outs, rows = self._outs, self._out_rows
        best: list[int] = []
        if any(s.chain is None for s in outs):
            best = self._logits(len(outs)).argmax(axis=1).tolist()
        ctx = self.ctx
        for k, seq in enumerate(outs):
            token = best[k] if seq.chain is None else seq.chain.sample(ctx, rows[k])
            self._emit(seq, token, stamp)

    def _logits(self, n: int) -> Any:
        """The step's n rows of logits as an (n, n_vocab) array over llama.cpp's own buffer."""
        ptr = self._get_logits(self.ctx.ptr)
        key = (ctypes.cast(ptr, ctypes.c_void_p).value or 0, n)
        if key != self._view_key:
            self._view = self._np.ctypeslib.as_array(ptr, shape=(n, self.n_vocab))
            self._view_key = key
        return self._view

    # ---- entry by entry: `llmrun serve`'s loop drives the engine through these -------------

    def _plan(
        self, waiting: list[_Seq], running: list[_Seq], policy: Policy
    ) -> tuple[list[tuple[_Seq, int, int, str, bool]], list[_Seq]]:
        """(seq, token, position, 'd' or 'p', logits wanted) for each batch entry."""
        decodes, chunks = self._schedule(waiting, running, policy)
        entries: list[tuple[_Seq, int, int, str, bool]] = [
            (s, int(s.pending), s.prefilled + len(s.result.output) - 1, "d", True)
            for s in decodes
            if s.pending is not None
        ]
        for s, first, n in chunks:
            last = len(s.tokens) - 1
            entries += [(s, s.tokens[p], p, "p", p == last) for p in range(first, first + n)]
        return entries, [s for s, _, _ in chunks]

    def _decode(self, entries: list[tuple[_Seq, int, int, str, bool]]) -> None:
        b = self.batch
        for i, (seq, token, pos, _, logits) in enumerate(entries):
            b.token[i] = token
            b.pos[i] = pos
            b.set_seq(i, 1, seq.sid)
            b.logits[i] = logits
        b.n_tokens = len(entries)
        self._step()

    def _emit(self, seq: _Seq, token: int, stamp: float) -> None:
        if not seq.ignore_eos and self._is_eog(token):
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
        """The held-back text, and the sequence's sampler chain freed."""
        if seq.text is not None:
            seq.result.tail = seq.text.flush()
            seq.text = None
        chain, seq.chain = seq.chain, None
        if chain is not None:
            chain.close()


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
    engine = BatchedEngine(runner, n_seq=n_seq, n_ctx_per_seq=per_seq,
                           n_batch=loaded.settings.n_batch)  # fmt: skip
    n_threads, n_threads_batch = engine.threads
    settings = dataclasses.replace(loaded.settings, n_ctx=per_seq, n_threads=n_threads,
                                   n_threads_batch=n_threads_batch)  # fmt: skip
    order = sorted(prompts)
    try:
        arrivals = [Arrival(0.0, tuple(prompts[i]), limits[i], requests[i].sampling.ignore_eos,
                            requests[i].sampling) for i in order]  # fmt: skip
        cpu0 = cpu_sample()
        results, _ = engine.run(arrivals, policy or Policy("chunked", engine.n_batch),
                                cancel=cancel)  # fmt: skip
        background = measured_background(cpu0, cpu_sample())
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
            first_token_s=first, background_cpus=background,
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
