"""Several sequences in one llama.cpp context: continuous batching with a scheduling policy.

Each step builds one `llama_decode` batch from one decode token of every running sequence and
prefill chunks of waiting ones, as the policy allows:

- `prefill-first`: a waiting prompt is prefilled whole (up to n_batch tokens a step) before the
  running sequences decode again; those steps carry no decode tokens.
- `chunked:B` (Sarathi-Serve): every step carries all running decodes and at most B tokens in
  all, topped up with prefill chunks.
- `decode-first`: prompts are prefilled only when no sequence is decoding; `decode-first:K`
  also lets a prefill in after K decode-only steps.

Its users drive it through one small interface: `submit` a request (a handle back), `step`
(one batch; the tokens and endings it produced), `cancel` a handle; `run` serves a timed load
through them (the benchmarks, `run --parallel`), and `llmrun serve`'s engine thread calls them
as requests come and go (api_engine.py).

Sequences share one context's KV cache (one stream per sequence by default, one unified buffer
with `kv_unified`) under their own sequence ids, so they never see each other's entries; a
finished sequence's entries are removed (or kept for a later prompt's prefix, `keep_prefix`).
Sampling is greedy (one argmax over all sequences' logits in numpy) or a sequence's own
llama.cpp sampler chain. A step costs O(1) Python per decoding sequence: the batch is filled
through ctypes views of its arrays, and the hot llama.cpp functions are looked up once.
Every step is timed; every token is time-stamped, so each request gets vLLM's figures (queue
wait, TTFT, TPOT, inter-token gaps, E2E) and each step its batch composition.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import itertools
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
from llmrun.runners.handles import Batch, Context, Sampler
from llmrun.runners.library import llama_lib
from llmrun.runners.llamacpp import LlamaCppRunner, kv_unified_of
from llmrun.runners.progress import Tally
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
FINISH_CANCELLED = "cancelled"  # ended by `cancel` (a client gone, an interrupted run)
FINISH_ERROR = "error"  # llama_decode failed: every request in flight ended


@dataclass(frozen=True)
class Policy:
    name: str  # prefill-first, decode-first, chunked
    budget: int = 0  # chunked: tokens per step in all

    @classmethod
    def parse(cls, text: str) -> Policy:
        name, _, value = text.strip().lower().partition(":")
        if name not in POLICIES:
            raise BadRequestError(
                f"--policy: '{text}' is not prefill-first, decode-first or chunked:B"
            )
        if name == "chunked":
            if not value.isdigit() or not 1 <= int(value) <= 65536:
                raise BadRequestError(
                    f"--policy: chunked needs a token budget, chunked:64, not '{text}'"
                )
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
    """One request for the engine: a prompt's tokens and how much to generate. `at_s` is when
    it arrives on the engine's clock (`BatchedEngine.now`): `run` submits it then, `submit`
    takes it as the request's arrival (its queue wait and TTFT start there)."""

    at_s: float
    tokens: tuple[int, ...]
    max_tokens: int
    ignore_eos: bool = False  # benchmarks generate exactly max_tokens
    sampling: SamplingParams | None = None  # None: greedy, no stop strings


@dataclass
class SeqResult:
    """One request's tokens and time stamps, on the engine's clock (seconds)."""

    arrival_s: float
    prompt_tokens: int
    output: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # each output token's time stamp
    started_s: float | None = None  # the first step that carried its prompt
    prefilled_s: float | None = None  # the end of the step that carried its prompt's last token
    chunks: list[tuple[int, float]] = field(default_factory=list)  # (prompt tokens, step s)
    pieces: list[str] = field(default_factory=list)  # each token's text (stop strings applied)
    tail: str = ""
    finish: str = FINISH_LENGTH
    error: str = ""  # why it ended with finish 'error' (llama.cpp refused its sampler, ...)

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


_ids = itertools.count()


@dataclass(eq=False)
class Handle:
    """A submitted request, as `submit` returns it: read its `result` (the engine writes it as
    the request runs) and `done`; hand it to `cancel` to end it early. Compared by identity."""

    result: SeqResult
    tokens: tuple[int, ...]
    max_tokens: int  # within the sequence's context
    ignore_eos: bool = False
    sampling: SamplingParams | None = None  # None: one greedy argmax in numpy
    seed: int | None = None  # its sampler chain's seed (None: greedy)
    sid: int = -1  # its sequence id while it holds one (-1: queued or ended)
    reused: int = 0  # prompt tokens whose KV entries were kept from the sequence's last request
    done: bool = False  # ended: finished, cancelled or failed (result.finish says which)
    id: int = field(default_factory=lambda: next(_ids))
    chain: Sampler | None = None  # its own sampler chain, from admission to its end
    text_stream: TextStream | None = None
    prefilled: int = 0  # prompt tokens scheduled so far (their KV entries, once decoded)
    pending: int | None = None  # sampled, not yet decoded


@dataclass(frozen=True)
class StepEvents:
    """What one `step` did: the llama_decode step it ran (None: nothing was ready), the
    requests that got a token (`result.output[-1]`; with sampling, its text is
    `result.pieces[-1]`), and those that ended (their sequences free again)."""

    step: Step | None
    tokens: Sequence[Handle]
    finished: Sequence[Handle]


_NOTHING = StepEvents(None, (), ())


def _sid(seq: Handle) -> int:
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
    """A context with `n_seq` sequences over the runner's loaded weights, stepped by its user.

    The public interface, driven from one thread (the engine is not thread-safe):

    - `submit(arrival) -> Handle` queues a request; `step()` admits queued requests into free
      sequences, runs one llama_decode under the policy and returns its `StepEvents`;
      `cancel(handle)` ends a request at once (its KV entries removed, its sequence free);
    - `queued`, `prefilling`, `decoding` and `idle` say what is in flight; `now()` is the clock
      every stamp is on (perf_counter seconds since `origin_s`);
    - `run(arrivals, policy)` serves a whole timed load through these (the benchmarks).

    `keep_prefix` keeps a finished request's KV entries in its sequence, so a later prompt
    sharing its prefix goes to that sequence and prefills only the rest (llama-server's prompt
    cache); otherwise they are removed as the request ends.

    Every C object is owned (runners/handles.py): the context, made by the runner, is closed
    before the weights it was made from, even when the runner closes first; the batch and each
    sequence's sampler chain are freed once. `context` lends the engine an existing context
    with n_seq sequences (the runner's own, `runner.load(n_seq=...)`), which it uses and never
    closes. `close` may be called any number of times."""

    def __init__(
        self,
        runner: LlamaCppRunner,
        *,
        n_seq: int,
        n_ctx_per_seq: int,
        n_batch: int = 512,
        kv_unified: bool | None = None,
        policy: Policy | None = None,
        keep_prefix: bool = False,
        context: Context | None = None,
    ) -> None:
        import numpy as np

        lib = llama_lib()
        self.lib, self.runner, self.n_seq, self.n_batch = lib, runner, n_seq, n_batch
        self.n_ctx_per_seq, self.keep_prefix = n_ctx_per_seq, keep_prefix
        self.policy = policy or Policy("chunked", n_batch)
        self.origin_s = 0.0  # stamps are perf_counter() - origin_s; `run` restarts the clock
        self._owns_ctx = context is None
        if context is not None:
            have = int(lib.llama_n_seq_max(context.ptr)), int(lib.llama_n_ctx(context.ptr))
            if have[0] < n_seq or have[1] < n_seq * n_ctx_per_seq:
                raise EngineError(
                    f"the context given holds {have[0]} sequences of {have[1]}"
                    f" tokens in all, not {n_seq} x {n_ctx_per_seq}"
                )
            self.ctx = context
        else:  # the runner's threads and flash attention, so one sequence decodes as `run` does
            self.ctx = runner.make_context(
                n_seq=n_seq, n_ctx=n_seq * n_ctx_per_seq, n_batch=n_batch, kv_unified=kv_unified
            )
        self.batch = _StepBatch(lib, n_batch)
        self.n_vocab = runner.vocab_size()
        self._np = np
        self._held = 0  # decode-only steps since the last prefill (decode-first:K)
        self._queue: collections.deque[Handle] = collections.deque()  # no sequence yet
        self._waiting: list[Handle] = []  # prefilling
        self._running: list[Handle] = []  # decoding
        self._free = list(range(n_seq))
        self._cached: list[list[int]] = [[] for _ in range(n_seq)]  # keep_prefix: KV's tokens
        self._used_s = [0.0] * n_seq
        # the step's hot calls, looked up once
        self._llama_decode = lib.llama_decode
        self._synchronize = lib.llama_synchronize
        self._get_logits = lib.llama_get_logits
        self._is_eog = runner.is_eog
        self._view_key: tuple[int, int] = (0, 0)
        self._view: Any = None
        self._outs: list[Handle] = []  # the sequences sampled after this step, in batch order
        self._refused: list[Handle] = []  # ended at admission (no sampler): the step reports them
        self._out_rows: list[int] = []  # and their entries in the batch

    @property
    def kv_unified(self) -> bool:
        """Whether the sequences share one KV buffer (llama.cpp's -kvu), read back from the
        context: False when each sequence has its own stream."""
        return kv_unified_of(self.lib, self.ctx.ptr)

    @property
    def threads(self) -> tuple[int, int]:
        """The threads llama.cpp was given for this context: one token a step, and batches."""
        ptr = self.ctx.ptr
        return int(self.lib.llama_n_threads(ptr)), int(self.lib.llama_n_threads_batch(ptr))

    def close(self) -> None:
        """End every request, free the batch, then the context if the engine made it (each
        once); the runner's weights stay loaded."""
        self.clear()
        self.batch.close()
        if self._owns_ctx:
            self.ctx.close()

    def __enter__(self) -> BatchedEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def new_chain(self, sp: SamplingParams, seed: int, *, prompt: Sequence[int] = ()) -> Sampler:
        """A sequence's own sampler chain for these settings (closed when it finishes)."""
        return self.runner.new_sampler(sp, seed, prompt=prompt)

    # ---- the public interface -------------------------------------------------------------

    def now(self) -> float:
        """The engine's clock: every time stamp it writes is on it."""
        return time.perf_counter() - self.origin_s

    @property
    def queued(self) -> int:
        """Requests submitted and waiting for a free sequence."""
        return len(self._queue)

    @property
    def prefilling(self) -> int:
        """Requests holding a sequence whose prompt is not all prefilled yet."""
        return len(self._waiting)

    @property
    def decoding(self) -> int:
        """Requests generating tokens."""
        return len(self._running)

    @property
    def idle(self) -> bool:
        """Nothing queued or in flight: `step` would do nothing."""
        return not (self._queue or self._waiting or self._running)

    def submit(self, arrival: Arrival) -> Handle:
        """Queue a request (it gets a sequence at the next `step` with one free, in order of
        submission) and return its handle. PromptTooLongError when its prompt leaves no room
        in one sequence's context; its output is cut to what the context holds."""
        tokens = tuple(arrival.tokens)
        if not tokens:
            raise BadRequestError("an empty prompt: the engine needs at least one token")
        if len(tokens) + 1 > self.n_ctx_per_seq:
            raise PromptTooLongError(len(tokens), self.n_ctx_per_seq)
        sp = arrival.sampling
        seed = None
        if sp is not None:
            seed = sp.seed if sp.seed is not None else random.randrange(2**31)
        handle = Handle(
            SeqResult(arrival.at_s, len(tokens)),
            tokens,
            min(arrival.max_tokens, self.n_ctx_per_seq - len(tokens)),
            arrival.ignore_eos,
            sp,
            seed,
        )
        self._queue.append(handle)
        return handle

    def cancel(self, handle: Handle) -> bool:
        """End a request now, queued or running: its sampler is freed, its KV entries are
        removed and its sequence is free for the next request; `result.finish` is
        'cancelled'. False when it had already ended."""
        if handle.done:
            return False
        if handle.sid < 0:
            self._queue.remove(handle)
        else:
            if handle in self._waiting:
                self._waiting.remove(handle)
            else:
                self._running.remove(handle)
            self._release(handle, keep_kv=False)
        handle.done, handle.pending, handle.result.finish = True, None, FINISH_CANCELLED
        return True

    def clear(self, finish: str = FINISH_CANCELLED) -> list[Handle]:
        """End every request (queued or in flight) with `finish` and empty the KV cache of
        every sequence; returns the requests it ended."""
        ended = [*self._queue, *self._waiting, *self._running]
        for h in ended:
            self._finish(h)
            h.done, h.pending, h.sid, h.result.finish = True, None, -1, finish
        self._queue.clear()
        self._waiting.clear()
        self._running.clear()
        self._free = list(range(self.n_seq))
        for cached in self._cached:
            cached.clear()
        if self.ctx.ptr is not None:  # None: the runner closed it already
            self.ctx.clear()
        return ended

    def step(self, policy: Policy | None = None) -> StepEvents:
        """Admit queued requests into free sequences, then one llama_decode of the batch the
        policy (default: the engine's) builds from the decoding sequences' next tokens and
        the prompts' chunks, and each sampled sequence's next token. A failed llama_decode
        ends every request (finish 'error'), empties the KV cache and raises EngineError; a
        request whose sampler llama.cpp refuses ends alone as it is admitted (finish 'error',
        `result.error` says why) and comes among `finished`."""
        self._admit()
        refused = self._refused
        if refused:  # reported with this step (or alone), never lost
            self._refused = []
        waiting, running = self._waiting, self._running
        if not waiting and not running:
            return StepEvents(None, (), refused) if refused else _NOTHING
        decodes, chunks = self._schedule(waiting, running, policy or self.policy)
        if not decodes and not chunks:
            return StepEvents(None, (), refused) if refused else _NOTHING
        clock, origin = time.perf_counter, self.origin_s
        start = clock()
        n_prefill = self._fill(decodes, chunks)
        if self.keep_prefix:
            cached = self._cached
            for s in decodes:
                cached[s.sid].append(s.pending)  # type: ignore[arg-type]
            for s, first, n in chunks:
                cached[s.sid].extend(s.tokens[first : first + n])
        try:
            self._step()
        except EngineError:
            self.clear(FINISH_ERROR)
            raise
        end = clock()
        start_s, end_s = start - origin, end - origin
        for seq, _, n in chunks:
            r = seq.result
            if r.started_s is None:
                r.started_s = start_s
            r.chunks.append((n, end - start))
        tokens = self._sample_and_emit(end_s)
        for seq, _, _ in chunks:
            if seq.prefilled == len(seq.tokens) and seq in waiting:
                seq.result.prefilled_s = end_s
                waiting.remove(seq)
                running.append(seq)  # a sequence done at once leaves with the others
        finished: list[Handle] = refused
        if any(s.done for s in running):
            finished = refused + [s for s in running if s.done]
            for seq in finished:
                running.remove(seq)
                self._release(seq, keep_kv=self.keep_prefix)
        return StepEvents(Step(start_s, end - start, len(decodes), n_prefill), tokens, finished)

    def run(
        self,
        arrivals: Sequence[Arrival],
        policy: Policy,
        *,
        cancel: threading.Event | None = None,
        progress: Tally | None = None,
    ) -> tuple[list[SeqResult], list[Step]]:
        """Serve the arrivals (each submitted at its `at_s` after the start; at most n_seq at
        once, later ones queue) under the policy, through `submit` and `step`. Returns each
        arrival's result, in order of `at_s`, and every step. The KV cache starts empty.
        `progress` counts the requests finished and the tokens sampled as they go."""
        self.clear()
        queue = sorted(arrivals, key=lambda a: a.at_s)
        handles: list[Handle] = []
        steps: list[Step] = []
        self.origin_s = time.perf_counter()
        now = self.now
        nxt = 0
        try:
            while nxt < len(queue) or not self.idle:
                if cancel is not None and cancel.is_set():
                    break
                t = now()
                while nxt < len(queue) and queue[nxt].at_s <= t:
                    handles.append(self.submit(queue[nxt]))
                    nxt += 1
                if self.idle:
                    time.sleep(max(0.0, min(queue[nxt].at_s - t, 0.05)))
                    continue
                events = self.step(policy)
                if events.step is None:
                    time.sleep(0.001)
                    continue
                steps.append(events.step)
                if progress is not None:
                    progress.add(len(events.finished), len(events.tokens))
        finally:
            self.clear()  # interrupted: the rest end 'cancelled', their samplers freed
        results = [h.result for h in handles]
        results += [SeqResult(a.at_s, len(a.tokens)) for a in queue[nxt:]]
        return results, steps

    # ---- inside a step ------------------------------------------------------------------

    def _admit(self) -> None:
        """Queued requests into free sequences, in order; with keep_prefix, each into the free
        sequence whose cached tokens share its prompt's longest prefix."""
        queue, free = self._queue, self._free
        while queue and free:
            seq = queue.popleft()
            reused = 0
            if self.keep_prefix:
                cached = self._cached
                sid = max(free, key=lambda i: (_common(cached[i], seq.tokens), -self._used_s[i]))
                reused = _common(cached[sid], seq.tokens)
                if not self.ctx.remove(sid, reused, -1):  # e.g. recurrent: all or nothing
                    self.ctx.remove(sid)
                    reused = 0
                del cached[sid][reused:]
                self._used_s[sid] = time.perf_counter()
                free.remove(sid)
            else:
                sid = free.pop(0)
            seq.sid, seq.reused, seq.prefilled = sid, reused, reused
            if seq.sampling is not None:
                assert seq.seed is not None
                try:
                    seq.chain = self.new_chain(seq.sampling, seq.seed, prompt=seq.tokens)
                except LlmrunError as e:  # this request ends alone; its sequence is free again
                    self._release(seq, keep_kv=self.keep_prefix)
                    seq.done, seq.pending = True, None
                    seq.result.finish, seq.result.error = FINISH_ERROR, str(e)
                    self._refused.append(seq)
                    continue
                seq.text_stream = TextStream(seq.sampling.stop)
            self._waiting.append(seq)

    def _release(self, seq: Handle, *, keep_kv: bool) -> None:
        """A request leaves its sequence: its text flushed, its sampler freed, its KV entries
        kept for a later prompt's prefix or removed."""
        self._finish(seq)
        if not keep_kv:
            self.ctx.remove(seq.sid)
            self._cached[seq.sid].clear()
        self._free.append(seq.sid)
        self._free.sort()  # the lowest ids first, so the running ones stay consecutive
        seq.sid = -1

    def _schedule(
        self, waiting: list[Handle], running: list[Handle], policy: Policy
    ) -> tuple[list[Handle], list[tuple[Handle, int, int]]]:
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
        chunks: list[tuple[Handle, int, int]] = []
        for seq in waiting:
            if room <= 0:
                break
            take = min(room, len(seq.tokens) - seq.prefilled)
            chunks.append((seq, seq.prefilled, take))
            seq.prefilled += take
            room -= take
        return decodes, chunks

    def _fill(self, decodes: list[Handle], chunks: list[tuple[Handle, int, int]]) -> int:
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

    def _sample_and_emit(self, stamp: float) -> list[Handle]:
        """Each sampled sequence's next token: argmax over all greedy rows in one numpy call,
        a sequence's own chain in C otherwise. Returns the sequences that got a token."""
        outs, rows = self._outs, self._out_rows
        best: list[int] = []
        if any(s.chain is None for s in outs):
            best = self._logits(len(outs)).argmax(axis=1).tolist()
        ctx = self.ctx
        got: list[Handle] = []
        for k, seq in enumerate(outs):
            token = best[k] if seq.chain is None else seq.chain.sample(ctx, rows[k])
            if self._emit(seq, token, stamp):
                got.append(seq)
        return got

    def _logits(self, n: int) -> Any:
        """The step's n rows of logits as an (n, n_vocab) array over llama.cpp's own buffer."""
        ptr = self._get_logits(self.ctx.ptr)
        key = (ctypes.cast(ptr, ctypes.c_void_p).value or 0, n)
        if key != self._view_key:
            self._view = self._np.ctypeslib.as_array(ptr, shape=(n, self.n_vocab))
            self._view_key = key
        return self._view

    def _emit(self, seq: Handle, token: int, stamp: float) -> bool:
        """The sampled token into the request's result; False for an end-of-generation token
        (not part of the output)."""
        if not seq.ignore_eos and self._is_eog(token):
            seq.done, seq.pending, seq.result.finish = True, None, FINISH_STOP
            return False
        seq.result.output.append(token)
        seq.result.times.append(stamp)
        seq.pending = token
        if seq.text_stream is not None:
            seq.result.pieces.append(seq.text_stream.feed(self.runner.piece(token)))
            if seq.text_stream.stopped:
                seq.done, seq.pending, seq.result.finish = True, None, FINISH_STOP
                return True
        if len(seq.result.output) >= seq.max_tokens:
            seq.done, seq.pending = True, None
        return True

    def _finish(self, seq: Handle) -> None:
        """The held-back text, and the sequence's sampler chain freed."""
        if seq.text_stream is not None:
            seq.result.tail = seq.text_stream.flush()
            seq.text_stream = None
        chain, seq.chain = seq.chain, None
        if chain is not None:
            chain.close()


def _common(cached: list[int], tokens: tuple[int, ...]) -> int:
    """The shared prefix, leaving at least the prompt's last token to evaluate (its logits)."""
    limit = min(len(cached), len(tokens) - 1)
    n = 0
    while n < limit and cached[n] == tokens[n]:
        n += 1
    return n


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
        return 1000 * sum(
            s.duration_s for s in self.steps if s.n_prefill and first <= s.start_s < last
        )

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


LONG_TOKENS = 4  # what each long prompt of the interference lab decodes


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
    progress: Tally | None = None,
) -> InterferenceReport:
    """The stream decodes while the long prompts arrive every `every_s` from `start_s`; with
    policy None the stream runs alone (the baseline). `cancel` stops the engine's loop."""
    arrivals = [Arrival(0.0, tuple(stream), stream_tokens)]
    if policy is not None:
        arrivals += [
            Arrival(start_s + i * every_s, tuple(p), LONG_TOKENS)
            for i, p in enumerate(long_prompts)
        ]
    results, steps = engine.run(
        arrivals, policy or Policy("chunked", engine.n_batch), cancel=cancel, progress=progress
    )
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
    one request; without it, each gets what the longest request needs.

    A runner not loaded yet makes one context, for the n_seq sequences: its weights are
    loaded to tokenize, then its own context is created for them (`load(n_seq=, n_ctx=)`)
    and lent to the engine, so the load time and settings each request reports are that
    context's. A runner already loaded for one sequence keeps its context; the engine then
    makes its own."""
    fresh = runner.loaded is None
    runner.load_weights(n_seq=n_seq, n_ctx=n_ctx)  # on a GPU, the layers that fit beside N KVs
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
        runner.load()  # as loaded as a run that served none: `run` says each one's error
        return [o for o in outcome if o is not None], 0.0
    per_seq = n_ctx or max(len(p) + limits[i] for i, p in prompts.items()) + 8
    if fresh:
        loaded = runner.load(n_seq=n_seq, n_ctx=per_seq)
        engine = BatchedEngine(
            runner,
            n_seq=n_seq,
            n_ctx_per_seq=per_seq,
            n_batch=loaded.settings.n_batch,
            context=runner.context,
        )
    else:
        loaded = runner.load()
        engine = BatchedEngine(
            runner, n_seq=n_seq, n_ctx_per_seq=per_seq, n_batch=loaded.settings.n_batch
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
    order = sorted(prompts)
    try:
        arrivals = [
            Arrival(
                0.0,
                tuple(prompts[i]),
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
        request, prompt = requests[i], prompts[i]
        if interrupted and r.started_s is None:
            outcome[i] = NotStartedError()
            continue
        if r.finish == FINISH_ERROR and r.error:  # refused alone as it was admitted
            outcome[i] = EngineError(r.error)
            continue
        finish = r.finish
        if finish in (FINISH_LENGTH, FINISH_CANCELLED) and len(r.output) < limits[i]:
            finish = FINISH_INTERRUPTED  # cut by Ctrl-C, not by -n
        elif finish == FINISH_LENGTH and limits[i] < request.sampling.max_tokens:
            finish = FINISH_CONTEXT  # -c, not -n, ended it
        first = r.times[0] if r.times else None
        stats = GenerationStats(
            finish_reason=finish if r.times or finish == FINISH_STOP else FINISH_INTERRUPTED,
            prompt_tokens=len(prompt),
            reused_tokens=0,
            output_tokens=len(r.output),
            template_tokenize_s=0.0,
            prefill_s=(first - r.started_s)
            if first is not None and r.started_s is not None
            else 0.0,
            first_sample_s=0.0,
            itl_s=tuple(r.gaps_s),
            e2e_s=r.times[-1] if r.times else 0.0,
            load_s=loaded.load_s,
            seed=request.sampling.seed,
            model=loaded.model,
            settings=settings,
            first_token_s=first,
            background_cpus=background,
        )
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
