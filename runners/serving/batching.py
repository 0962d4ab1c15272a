"""Several sequences in one llama.cpp context: continuous batching under a scheduling policy.

Each step builds one `llama_decode` batch from one decode token of every running sequence and
prefill chunks of waiting ones, as the policy allows (policy.py).

Its users drive it through one small interface: `submit` a request (a handle back), `step`
(one batch; the tokens and endings it produced), `cancel` a handle; `run` serves a timed load
through them (the benchmarks, interference.py, `run --parallel` through parallel.py), and
`llmrun serve`'s engine thread calls them as requests come and go (api_engine.py).

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
import itertools
import math
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from llmrun.runners.base import SamplingParams
from llmrun.runners.contexts import abort_on, kv_unified_of
from llmrun.runners.errors import BadRequestError, EngineError, LlmrunError, PromptTooLongError
from llmrun.runners.grammar import Grammars, add_grammar
from llmrun.runners.handles import Batch, Context, Sampler
from llmrun.runners.library import llama_lib
from llmrun.runners.llamacpp import LlamaCppRunner
from llmrun.runners.progress import Tally
from llmrun.runners.stats import FINISH_LENGTH, FINISH_STOP
from llmrun.runners.text import TextStream

from . import figures
from .logprobs import TokenLogprob, rows_logprobs, token_logprob
from .policy import Policy, schedule

FINISH_CANCELLED = "cancelled"  # ended by `cancel` (a client gone, an interrupted run)
FINISH_ERROR = "error"  # llama_decode failed: every request in flight ended


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
    grammar: str | None = None  # GBNF the answer must follow (with `sampling` only)
    logprobs: int | None = None  # each output token's log probability, with this many top ones
    # the prompt's tokens' log probabilities too (each but the first; its whole prompt is
    # evaluated, no cached prefix), with `logprobs` top ones
    prompt_logprobs: bool = False


@dataclass
class SeqResult:
    """One request's tokens and time stamps, on the engine's clock (seconds)."""

    arrival_s: float
    prompt_tokens: int
    output: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # each output token's time stamp
    admitted_s: float | None = None  # when the sequence it got was free (its queue ends)
    started_s: float | None = None  # the first step that carried its prompt
    prefilled_s: float | None = None  # the end of the step that carried its prompt's last token
    chunks: list[tuple[int, float]] = field(default_factory=list)  # (prompt tokens, step s)
    pieces: list[str] = field(default_factory=list)  # each token's text (stop strings applied)
    tail: str = ""
    finish: str = FINISH_LENGTH
    error: str = ""  # why it ended with finish 'error' (llama.cpp refused its sampler, ...)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output token, if asked
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # prompt tokens 1.., if asked

    # Its figures, as figures.py defines them, from admission (the arrival where it has none).

    @property
    def ttft_s(self) -> float | None:
        start = self.arrival_s if self.admitted_s is None else self.admitted_s
        return figures.ttft_s(start, self.times)

    @property
    def gaps_s(self) -> list[float]:
        return figures.itl_s(self.times)


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
    grammar: str | None = None
    logprobs: int | None = None
    prompt_logprobs: bool = False
    done: bool = False  # ended: finished, cancelled or failed (result.finish says which)
    id: int = field(default_factory=lambda: next(_ids))
    chain: Sampler | None = None  # its own sampler chain, from admission to its end
    text_stream: TextStream | None = None
    prefilled: int = 0  # prompt tokens scheduled so far (their KV entries, once decoded)
    pending: int | None = None  # sampled, not yet decoded


Chunk = tuple[Handle, int, int]  # a prompt's chunk in a step: (sequence, first position, length)


@dataclass(frozen=True)
class StepEvents:
    """What one `step` did: the llama_decode step it ran (None: nothing was ready), the
    requests that got a token (`result.output[-1]`; with sampling, its text is
    `result.pieces[-1]`), and those that ended (their sequences free again)."""

    step: Step | None
    tokens: Sequence[Handle]
    finished: Sequence[Handle]


_NOTHING = StepEvents(None, (), ())


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
        # each request's grammar parsed once, when it is checked; its sequence gets a copy
        self.grammars = Grammars(lib, lib.llama_model_get_vocab(lib.llama_get_model(self.ctx.ptr)))
        self._np = np
        self._held = 0  # decode-only steps since the last prefill (decode-first:K)
        self._queue: collections.deque[Handle] = collections.deque()  # no sequence yet
        self._waiting: list[Handle] = []  # prefilling
        self._running: list[Handle] = []  # decoding
        self._free = list(range(n_seq))
        self._cached: list[list[int]] = [[] for _ in range(n_seq)]  # keep_prefix: KV's tokens
        self._used_s = [0.0] * n_seq
        self._freed_s = [-math.inf] * n_seq  # when each sequence was last released (now())
        # the step's hot calls, looked up once
        self._llama_decode = lib.llama_decode
        self._synchronize = lib.llama_synchronize
        self._get_logits = lib.llama_get_logits
        self._is_eog = runner.is_eog
        self._view_key: tuple[int, int] = (0, 0)
        self._view: Any = None
        self._cancel: threading.Event | None = None  # `run`'s, while it runs
        self._outs: list[Handle] = []  # the sequences sampled after this step, in batch order
        self._refused: list[Handle] = []  # ended at admission (no sampler): the step reports them
        self._out_rows: list[int] = []  # and their entries in the batch
        self._out_ids: list[int] = []  # and their rows among the step's logits
        self._n_out = 0  # rows of logits the step has
        # (request, first position, tokens, first row) of the chunks whose every position has
        # logits (prompt log probabilities)
        self._prompt_outs: list[tuple[Handle, int, int, int]] = []

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
        self.grammars.close()
        if self._owns_ctx:
            self.ctx.close()

    def __enter__(self) -> BatchedEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def new_chain(self, sp: SamplingParams, seed: int, *, prompt: Sequence[int] = ()) -> Sampler:
        """A sequence's own sampler chain for these settings (closed when it finishes)."""
        return self.runner.new_sampler(sp, seed, prompt=prompt)

    def _chain(self, seq: Handle) -> Sampler:
        """The request's chain; with a grammar, held to it as llama.cpp's common_sampler does
        (the chain samples, the grammar checks the chosen token: `GrammarSampler`), after the
        chain has seen the prompt."""
        assert seq.sampling is not None and seq.seed is not None
        chain = self.new_chain(seq.sampling, seq.seed, prompt=seq.tokens)
        if seq.grammar is None:
            return chain
        return add_grammar(chain, self.grammars.vocab, seq.grammar, parsed=self.grammars)

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
        seed = None if sp is None else random.randrange(2**31) if sp.seed is None else sp.seed
        handle = Handle(
            SeqResult(arrival.at_s, len(tokens)),
            tokens,
            min(arrival.max_tokens, self.n_ctx_per_seq - len(tokens)),
            arrival.ignore_eos,
            sp,
            seed,
            grammar=arrival.grammar if sp is not None else None,
            logprobs=arrival.logprobs,
            prompt_logprobs=arrival.prompt_logprobs,
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
            (self._waiting if handle in self._waiting else self._running).remove(handle)
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
        del self._waiting[:], self._running[:]
        self._free = list(range(self.n_seq))
        self._freed_s = [-math.inf] * self.n_seq
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
        refused, self._refused = self._refused, []  # reported with this step (or alone)
        waiting, running = self._waiting, self._running
        decodes, chunks, self._held = schedule(
            policy or self.policy, waiting, running, n_batch=self.n_batch, held=self._held
        )
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
        try:  # waited for: decode is asynchronous on GPUs
            rc = self._llama_decode(self.ctx.ptr, self.batch.struct)
            if rc != 0:
                raise EngineError(f"llama_decode failed in a batched step (code {rc})")
            self._synchronize(self.ctx.ptr)
        except EngineError:
            self.clear(FINISH_CANCELLED if self._cancel and self._cancel.is_set() else FINISH_ERROR)
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
        ended = [s for s in running if s.done]  # the refused ones were released as they came
        for seq in ended:
            running.remove(seq)
            self._release(seq, keep_kv=self.keep_prefix)
        step = Step(start_s, end - start, len(decodes), n_prefill)
        return StepEvents(step, tokens, refused + ended)

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
        self._cancel = cancel
        try:
            with abort_on(self.ctx, cancel):  # a long prefill step stops within its graph
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
                    try:
                        events = self.step(policy)
                    except EngineError:
                        if cancel is not None and cancel.is_set():
                            break  # the step was aborted: its requests end 'cancelled'
                        raise
                    if events.step is None:
                        time.sleep(0.001)
                        continue
                    steps.append(events.step)
                    if progress is not None:
                        progress.add(len(events.finished), len(events.tokens))
        finally:
            self._cancel = None
            self.clear()  # interrupted: the rest end 'cancelled', their samplers freed
        results = [h.result for h in handles]
        results += [SeqResult(a.at_s, len(a.tokens)) for a in queue[nxt:]]
        return results, steps

    # ---- inside a step ------------------------------------------------------------------

    def _admit(self) -> None:
        """Queued requests into free sequences, in order; with keep_prefix, each into the free
        sequence whose cached tokens share its prompt's longest prefix."""
        queue, free = self._queue, self._free
        # when each free sequence became free, earliest first: the k-th request admitted now
        # could have had the k-th of them (which one it gets is the cache's or the lowest id's)
        free_since = sorted(self._freed_s[i] for i in free) if queue else []
        while queue and free:
            seq = queue.popleft()
            reused = 0
            if self.keep_prefix:
                cached = self._cached
                sid = max(free, key=lambda i: (_common(cached[i], seq.tokens), -self._used_s[i]))
                reused = 0 if seq.prompt_logprobs else _common(cached[sid], seq.tokens)
                if not self.ctx.remove(sid, reused, -1):  # e.g. recurrent: all or nothing
                    self.ctx.remove(sid)
                    reused = 0
                del cached[sid][reused:]
                self._used_s[sid] = time.perf_counter()
                free.remove(sid)
            else:
                sid = free.pop(0)
            seq.sid, seq.reused, seq.prefilled = sid, reused, reused
            # its queue ends when a sequence was free for it: a wait for the step in progress
            # is not a wait for a sequence (a server's client would see it in its TTFT)
            seq.result.admitted_s = max(seq.result.arrival_s, free_since.pop(0))
            if seq.sampling is not None:
                try:
                    seq.chain = self._chain(seq)
                except LlmrunError as e:  # this request ends alone; its sequence is free again
                    self._release(seq, keep_kv=self.keep_prefix)
                    free_since.append(self.now())  # for the next one: free from now
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
        self._freed_s[seq.sid] = self.now()
        self._free.sort()  # the lowest ids first, so the running ones stay consecutive
        seq.sid = -1

    def _fill(self, decodes: list[Handle], chunks: list[Chunk]) -> int:
        """The batch: one entry per decoding sequence, then the prompt chunks; returns the
        prompt tokens in it. Notes which rows are sampled after the step."""
        b = self.batch
        token, pos, logits, set_seq = b.token, b.pos, b.logits, b.set_seq
        outs, rows, out_ids = self._outs, self._out_rows, self._out_ids
        i = n_out = len(decodes)  # each decoding sequence's one entry is sampled
        outs[:], rows[:], out_ids[:] = decodes, range(i), range(i)
        self._prompt_outs.clear()
        for k, s in enumerate(decodes):
            token[k] = s.pending
            pos[k] = s.prefilled + len(s.result.output) - 1
            logits[k] = 1
            set_seq(k, 1, s.sid)
        for s, first, n in chunks:
            j = i + n
            token[i:j] = s.tokens[first : first + n]
            pos[i:j] = range(first, first + n)
            ctypes.memset(b.logits_addr + i, s.prompt_logprobs, n)
            if s.prompt_logprobs:  # every position's logits: each next prompt token's
                self._prompt_outs.append((s, first, n, n_out))
                n_out += n - 1
            set_seq(i, n, s.sid)
            if first + n == len(s.tokens):  # the prompt's last token: its logits are sampled
                logits[j - 1] = 1
                outs.append(s)
                rows.append(j - 1)
                out_ids.append(n_out)
                n_out += 1
            elif s.prompt_logprobs:
                n_out += 1
            i = j
        b.struct.n_tokens = i
        self._n_out = n_out
        return sum(n for _, _, n in chunks)

    def _sample_and_emit(self, stamp: float) -> list[Handle]:
        """Each sampled sequence's next token: argmax over all greedy rows in one numpy call,
        a sequence's own chain in C otherwise. Returns the sequences that got a token."""
        outs, rows = self._outs, self._out_rows
        best: list[int] = []
        extra = self._n_out != len(outs)  # prompt positions' rows among the step's outputs
        if extra:
            self._prompt_logprobs()
        if any(s.chain is None for s in outs):
            view = self._logits(self._n_out)
            best = (view[self._out_ids] if extra else view).argmax(axis=1).tolist()
        ctx = self.ctx
        got: list[Handle] = []
        for k, seq in enumerate(outs):
            token = best[k] if seq.chain is None else seq.chain.sample(ctx, rows[k])
            if self._emit(seq, token, stamp):
                got.append(seq)
                if seq.logprobs is not None:  # the model's own
                    row = self._logits(self._n_out)[self._out_ids[k]]  # the samplers read copies
                    seq.result.logprobs.append(token_logprob(row, token, seq.logprobs))
        return got

    def _prompt_logprobs(self) -> None:
        """The log probabilities of the prompt tokens this step evaluated, for the requests
        that asked: the logits at each position give the next prompt token's."""
        view = self._logits(self._n_out)
        for seq, first, n, start in self._prompt_outs:
            last = min(first + n, len(seq.tokens) - 1)  # the prompt's last row samples
            if last > first:
                block = view[start : start + last - first]
                following = seq.tokens[first + 1 : last + 1]
                seq.result.prompt_logprobs += rows_logprobs(block, following, seq.logprobs or 0)

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
    return next((n for n in range(limit) if cached[n] != tokens[n]), limit)
