"""The engine thread behind `llmrun serve`: requests arrive at any time, each gets its events.

One thread owns the multi-sequence llama.cpp context (`BatchedEngine`) and runs its scheduling
policy step after step; the HTTP side only calls `submit` and `cancel` (both non-blocking) and
receives each request's events through the `sink` it handed over (the server wraps it in
`loop.call_soon_threadsafe`). So the engine never waits for a client, and a slow or vanished
client costs the others nothing.

Each sequence slot keeps the KV entries of its last request: a new prompt goes to the free slot
sharing its longest prefix and prefills only the rest (llama-server's prompt cache).
Every request's phases are measured on the engine's clock (`RequestTimings`).
"""

from __future__ import annotations

import itertools
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from llmrun.runners.base import SamplingParams
from llmrun.runners.errors import LlmrunError
from llmrun.runners.llamacpp import LlamaCppRunner
from llmrun.runners.stats import FINISH_LENGTH, FINISH_STOP, percentile
from llmrun.runners.text import TextStream

from .engine import BatchedEngine, Policy, SeqResult, _Seq

FINISH_CANCELLED = "cancelled"  # the client went away; nobody reads the answer


class QueueFullError(LlmrunError):
    """Every sequence is busy and the queue holds --max-queue requests already."""

    def __init__(self, queued: int) -> None:
        super().__init__(f"the server is busy: {queued} requests are already waiting")
        self.queued = queued


@dataclass(frozen=True)
class RequestTimings:
    """One request's phases on the server, in llmrun's names (each response's `timings`).

    TTFT = template_tokenize + queue + prefill (+ the first sample); the prefill of a chunked
    policy spans several engine steps, listed in `prefill_chunks` (tokens, ms)."""

    prompt_tokens: int
    reused_tokens: int  # KV entries kept from the slot's previous request (a shared prefix)
    output_tokens: int
    template_tokenize_ms: float
    queue_ms: float
    prefill_ms: float
    prefill_chunks: tuple[tuple[int, float], ...]
    ttft_ms: float | None
    decode_ms: float
    itl_ms: tuple[float, ...]
    finish_reason: str
    seed: int | None = None  # the sampling seed (None: greedy)

    @property
    def prefill_tokens(self) -> int:
        return self.prompt_tokens - self.reused_tokens

    def itl_p(self, q: float) -> float | None:
        return percentile(self.itl_ms, q)

    def to_dict(self) -> dict[str, Any]:
        """The JSON `timings` object: figures in ms, rounded to the microsecond."""

        def r(x: float | None) -> float | None:
            return None if x is None else round(x, 3)

        prefill_s, decode_s = self.prefill_ms / 1000, self.decode_ms / 1000
        gaps = max(self.output_tokens - 1, 0)
        return {
            "prompt_tokens": self.prompt_tokens,
            "reused_tokens": self.reused_tokens,
            "prefill_tokens": self.prefill_tokens,
            "output_tokens": self.output_tokens,
            "template_tokenize_ms": r(self.template_tokenize_ms),
            "queue_ms": r(self.queue_ms),
            "prefill_ms": r(self.prefill_ms),
            "prefill_chunks": [{"tokens": n, "ms": r(t)} for n, t in self.prefill_chunks],
            "prefill_tps": round(self.prefill_tokens / prefill_s, 2) if prefill_s > 0 else None,
            "ttft_ms": r(self.ttft_ms),
            "decode_ms": r(self.decode_ms),
            "decode_tps": round(gaps / decode_s, 2) if decode_s > 0 and gaps else None,
            "itl_p50_ms": r(self.itl_p(50)),
            "itl_p99_ms": r(self.itl_p(99)),
            "seed": self.seed,
        }


# ---- what a request's sink receives -------------------------------------------------------


@dataclass(frozen=True)
class Piece:
    text: str  # one token's text (stop strings applied; never half a character)


@dataclass(frozen=True)
class Done:
    finish_reason: str  # stop, length (or cancelled: no one listens)
    tail: str  # text held back until the end
    timings: RequestTimings


@dataclass(frozen=True)
class Failed:
    message: str


Outcome = Piece | Done | Failed


@dataclass
class Job:
    """One request handed to the engine; `sink` is called on the engine thread."""

    tokens: tuple[int, ...]
    sampling: SamplingParams
    sink: Callable[[Outcome], object]
    received_s: float  # perf_counter when the request arrived (before the template)
    submitted_s: float = 0.0  # after the template and tokenization
    cancelled: bool = False
    id: int = field(default_factory=itertools.count().__next__)


@dataclass(frozen=True)
class Answered:
    """One request's outcome, for the server's log."""

    route: str
    status: int
    timings: RequestTimings | None = None
    note: str = ""


@dataclass(frozen=True)
class StepRecord:
    """One llama_decode step: when, how long, and what it carried."""

    end_s: float
    duration_s: float
    n_decode: int
    n_prefill: int


@dataclass(frozen=True)
class Snapshot:
    """What the engine is doing now (for the live view and /metrics' gauges)."""

    decoding: int
    prefilling: int
    queued: int  # waiting for a free sequence
    n_seq: int
    policy: str
    steps: tuple[StepRecord, ...]  # the last few seconds' steps
    recent_itl_ms: tuple[float, ...]  # the last few seconds' gaps between tokens, latest last
    served: int
    output_tokens: int


class Observer(Protocol):
    """Receives the engine's measurements on its thread (metrics); must not block."""

    def on_step(self, step: StepRecord) -> None: ...

    def on_done(self, timings: RequestTimings) -> None: ...


@dataclass
class _Slot:
    sid: int
    cached: list[int] = field(default_factory=list)  # tokens whose KV entries it holds
    used_s: float = 0.0


@dataclass
class _Active:
    job: Job
    seq: _Seq
    slot: _Slot
    reused: int
    seed: int | None
    chunks: list[tuple[int, float]] = field(default_factory=list)
    prefill_end_s: float | None = None


class EngineThread:
    """The multi-sequence engine on a thread of its own, fed by `submit`."""

    def __init__(
        self,
        runner: LlamaCppRunner,
        *,
        n_seq: int,
        n_ctx_per_seq: int,
        policy: Policy,
        max_queue: int,
        n_batch: int | None = None,
        observer: Observer | None = None,
    ) -> None:
        loaded = runner.load()
        self.runner, self.policy, self.n_seq = runner, policy, n_seq
        self.n_ctx_per_seq, self.max_queue = n_ctx_per_seq, max_queue
        self.engine = BatchedEngine(runner, n_seq=n_seq, n_ctx_per_seq=n_ctx_per_seq,
                                    n_batch=n_batch or loaded.settings.n_batch)  # fmt: skip
        self.observer = observer
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._pending: deque[Job] = deque()
        self._slots = [_Slot(i) for i in range(n_seq)]
        self._active: dict[int, _Active] = {}  # by slot id
        self._waiting: list[_Seq] = []
        self._running: list[_Seq] = []
        self._steps: deque[StepRecord] = deque(maxlen=512)
        self._itl: deque[tuple[float, float]] = deque(maxlen=64)  # (when, gap ms)
        self.served = 0
        self.output_tokens = 0
        self._thread = threading.Thread(target=self._loop, name="llmrun-engine", daemon=True)

    # ---- the HTTP side's calls (any thread, never blocking) ---------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue a request; QueueFullError when --max-queue requests already wait."""
        with self._lock:
            if len(self._pending) + len(self._active) >= self.n_seq + self.max_queue:
                raise QueueFullError(len(self._pending))
            job.submitted_s = time.perf_counter()
            self._pending.append(job)
        self._wake.set()

    def cancel(self, job: Job) -> None:
        """The client is gone: its sequence is freed at the next step."""
        job.cancelled = True
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.engine.close()

    @property
    def queued(self) -> int:
        return len(self._pending)

    @property
    def busy(self) -> int:
        return len(self._active)

    def snapshot(self, *, window_s: float = 5.0) -> Snapshot:
        now = time.perf_counter()
        with self._lock:
            steps = tuple(s for s in self._steps if now - s.end_s <= window_s)
            queued = len(self._pending)
            waiting, running = len(self._waiting), len(self._running)
            itl = tuple(gap for when, gap in self._itl if now - when <= window_s)
        return Snapshot(decoding=running, prefilling=waiting, queued=queued, n_seq=self.n_seq,
                        policy=str(self.policy), steps=steps, recent_itl_ms=itl,
                        served=self.served, output_tokens=self.output_tokens)  # fmt: skip

    # ---- the engine thread ----------------------------------------------------------------

    def _loop(self) -> None:
        eng, lib = self.engine, self.engine.lib
        while not self._stop.is_set():
            self._admit()
            self._drop_cancelled()
            if not self._waiting and not self._running:
                self._wake.wait(0.1)
                self._wake.clear()
                continue
            entries, prefilling = eng._plan(self._waiting, self._running, self.policy)
            if not entries:
                self._wake.wait(0.001)
                self._wake.clear()
                continue
            start = time.perf_counter()
            try:
                eng._decode(entries)
            except LlmrunError as e:
                self._fail_all(str(e))
                continue
            end = time.perf_counter()
            n_prefill = 0
            chunk: dict[int, int] = {}
            gaps: list[tuple[float, float]] = []
            for index, (seq, token, _, kind, last) in enumerate(entries):
                active = self._active[seq.sid]
                active.slot.cached.append(token)
                if kind == "p":
                    n_prefill += 1
                    chunk[seq.sid] = chunk.get(seq.sid, 0) + 1
                    if seq.result.started_s is None:
                        seq.result.started_s = start
                if kind == "d" or last:
                    token = lib.llama_sampler_sample(seq.chain, eng.ctx, index)
                    pieces = len(seq.result.pieces)
                    eng._emit(seq, token, end)
                    if kind == "p":
                        active.prefill_end_s = end
                    elif len(seq.result.times) > 1:
                        gaps.append((end, (seq.result.times[-1] - seq.result.times[-2]) * 1000))
                    if len(seq.result.pieces) > pieces and seq.result.pieces[-1]:
                        active.job.sink(Piece(seq.result.pieces[-1]))
            for sid, n in chunk.items():
                self._active[sid].chunks.append((n, (end - start) * 1000))
            step = StepRecord(end, end - start, len(entries) - n_prefill, n_prefill)
            with self._lock:
                self._steps.append(step)
                self._itl.extend(gaps)
                for seq in prefilling:
                    if seq.prefilled == len(seq.tokens) and seq in self._waiting:
                        self._waiting.remove(seq)
                        self._running.append(seq)
            if self.observer is not None:
                self.observer.on_step(step)
            for seq in [s for s in self._running if s.done]:
                self._finish(seq, seq.result.finish)
        self._fail_all("the server is shutting down")

    def _admit(self) -> None:
        """Pending requests into free slots, each where its prompt's longest prefix is cached."""
        lib, mem = self.engine.lib, self.engine.lib.llama_get_memory(self.engine.ctx)
        with self._lock:
            while self._pending and len(self._active) < self.n_seq:
                job = self._pending.popleft()
                if job.cancelled:
                    self._report_cancelled(job)
                    continue
                free = [s for s in self._slots if s.sid not in self._active]
                slot = max(free, key=lambda s: (_common(s.cached, job.tokens), -s.used_s))
                reused = _common(slot.cached, job.tokens)
                if not lib.llama_memory_seq_rm(mem, slot.sid, reused, -1):
                    lib.llama_memory_seq_rm(mem, slot.sid, -1, -1)
                    reused = 0
                del slot.cached[reused:]
                slot.used_s = time.perf_counter()
                sp = job.sampling
                seed = sp.seed if sp.seed is not None else secrets.randbelow(2**31)
                room = self.n_ctx_per_seq - len(job.tokens)
                seq = _Seq(slot.sid, SeqResult(job.received_s, len(job.tokens)), job.tokens,
                           max(1, min(sp.max_tokens, room)), sp.ignore_eos,
                           chain=self.engine.new_chain(sp, seed, prompt=job.tokens),
                           text=TextStream(sp.stop), prefilled=reused)  # fmt: skip
                self._active[slot.sid] = _Active(
                    job, seq, slot, reused, seed if sp.temperature > 0 else None
                )
                self._waiting.append(seq)

    def _drop_cancelled(self) -> None:
        for seq in [s for s in (*self._waiting, *self._running)
                    if self._active[s.sid].job.cancelled]:  # fmt: skip
            self._finish(seq, FINISH_CANCELLED)

    def _finish(self, seq: _Seq, finish: str) -> None:
        active = self._active[seq.sid]
        self.engine._finish(seq)  # the held-back text, and its sampler freed
        r, job = seq.result, active.job
        started = r.started_s if r.started_s is not None else time.perf_counter()
        prefill_end = active.prefill_end_s if active.prefill_end_s is not None else started
        times = r.times
        timings = RequestTimings(
            prompt_tokens=len(seq.tokens), reused_tokens=active.reused,
            output_tokens=len(r.output),
            template_tokenize_ms=(job.submitted_s - job.received_s) * 1000,
            queue_ms=(started - job.submitted_s) * 1000,
            prefill_ms=(prefill_end - started) * 1000,
            prefill_chunks=tuple(active.chunks),
            ttft_ms=(times[0] - job.received_s) * 1000 if times else None,
            decode_ms=(times[-1] - times[0]) * 1000 if times else 0.0,
            itl_ms=tuple(g * 1000 for g in r.gaps_s),
            finish_reason=finish if finish == FINISH_CANCELLED
            else (FINISH_STOP if finish == FINISH_STOP else FINISH_LENGTH),
            seed=active.seed,
        )  # fmt: skip
        with self._lock:
            if seq in self._waiting:
                self._waiting.remove(seq)
            if seq in self._running:
                self._running.remove(seq)
            del self._active[seq.sid]
            self.served += 1
            self.output_tokens += len(r.output)
        if self.observer is not None:
            self.observer.on_done(timings)
        job.sink(Done(timings.finish_reason, r.tail, timings))
        self._wake.set()  # a free slot: admit the next one

    def _report_cancelled(self, job: Job) -> None:
        now = time.perf_counter()
        timings = RequestTimings(
            prompt_tokens=len(job.tokens), reused_tokens=0, output_tokens=0,
            template_tokenize_ms=(job.submitted_s - job.received_s) * 1000,
            queue_ms=(now - job.submitted_s) * 1000, prefill_ms=0.0, prefill_chunks=(),
            ttft_ms=None, decode_ms=0.0, itl_ms=(), finish_reason=FINISH_CANCELLED,
        )  # fmt: skip
        job.sink(Done(FINISH_CANCELLED, "", timings))

    def _fail_all(self, message: str) -> None:
        """llama.cpp failed mid-step (or the server stops): every request in flight ends with
        the error; the slots start empty."""
        lib = self.engine.lib
        if self.engine.ctx:
            lib.llama_memory_clear(lib.llama_get_memory(self.engine.ctx), True)
        with self._lock:
            actives, pending = list(self._active.values()), list(self._pending)
            self._active.clear()
            self._pending.clear()
            self._waiting.clear()
            self._running.clear()
            for slot in self._slots:
                slot.cached.clear()
        for active in actives:
            self.engine._finish(active.seq)
        for job in [a.job for a in actives] + pending:
            job.sink(Failed(message))


def _common(cached: list[int], tokens: tuple[int, ...]) -> int:
    """The shared prefix, leaving at least the prompt's last token to evaluate (its logits)."""
    limit = min(len(cached), len(tokens) - 1)
    n = 0
    while n < limit and cached[n] == tokens[n]:
        n += 1
    return n
