"""The engine thread behind `llmrun serve`: requests arrive at any time, each gets its events.

One thread owns the multi-sequence llama.cpp context (`BatchedEngine`) and drives it through its
public interface only (submit, step, cancel), step after step; the HTTP side only calls this
thread's `submit` and `cancel` (both non-blocking) and receives each request's events through
the `sink` it handed over (the server wraps it in `loop.call_soon_threadsafe`). So the engine
never waits for a client, and a slow or vanished client costs the others nothing.

Each sequence keeps the KV entries of its last request (`keep_prefix`): a new prompt goes to the
free sequence sharing its longest prefix and prefills only the rest (llama-server's prompt
cache); a cancelled request's entries go at once.
Every request's phases are measured on the engine's clock (`RequestTimings`).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from llmrun.runners.base import SamplingParams
from llmrun.runners.errors import EngineError, LlmrunError
from llmrun.runners.library import AbortFlag
from llmrun.runners.llamacpp import LlamaCppRunner
from llmrun.runners.stats import FINISH_LENGTH, FINISH_STOP, percentile

from .batching import FINISH_CANCELLED, FINISH_ERROR, Arrival, BatchedEngine, Handle
from .figures import ttft_s
from .logprobs import Described, TokenLogprob, described
from .policy import Policy


class QueueFullError(LlmrunError):
    """Every sequence is busy and the queue holds --max-queue requests already."""

    def __init__(self, queued: int) -> None:
        super().__init__(f"the server is busy: {queued} requests are already waiting")
        self.queued = queued


@dataclass(frozen=True, kw_only=True)
class RequestTimings:
    """One request's phases on the server, in llmrun's names (each response's `timings`).

    TTFT (figures.py's, its clock starting as the request arrives: the server admits every
    request it accepts) = template_tokenize + queue + step_wait + prefill (+ the first
    sample). `queue` is figures.py's: the wait for a free sequence, and nothing else;
    `step_wait` the wait after it for the engine's step in progress to end and for room in a
    step under --policy. The prefill of a chunked policy spans several engine steps, listed in
    `prefill_chunks`."""

    prompt_tokens: int
    reused_tokens: int = 0  # KV entries kept from the slot's previous request (a shared prefix)
    output_tokens: int = 0
    template_tokenize_ms: float
    queue_ms: float
    prefill_ms: float = 0.0
    prefill_chunks: tuple[tuple[int, float], ...] = ()
    ttft_ms: float | None = None
    decode_ms: float = 0.0
    itl_ms: tuple[float, ...] = ()
    finish_reason: str
    seed: int | None = None  # the sampling seed (None: greedy)
    # The end-of-generation token that ended the answer (not part of the output) was sampled
    # this long after the last output token (0.0: it was the first token sampled); None when
    # none ended it (length, a stop string, a cancel).
    end_token_ms: float | None = None
    draft_tokens: int = 0  # tokens a draft model proposed (serve has none yet: 0)
    draft_accepted: int = 0  # of those, the ones the model accepted
    step_wait_ms: float = 0.0  # after the queue: the step in progress, room in a step

    @property
    def prefill_tokens(self) -> int:
        return self.prompt_tokens - self.reused_tokens

    @property
    def completion_tokens(self) -> int:
        """Every token generated, the end-of-generation token that ended the answer included
        (OpenAI's `usage.completion_tokens`, llama-server's `predicted_n`; docs/measurement.md)."""
        return self.output_tokens + (self.end_token_ms is not None)

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
            "step_wait_ms": r(self.step_wait_ms),
            "prefill_ms": r(self.prefill_ms),
            "prefill_chunks": [{"tokens": n, "ms": r(t)} for n, t in self.prefill_chunks],
            "prefill_tps": round(self.prefill_tokens / prefill_s, 2) if prefill_s > 0 else None,
            "ttft_ms": r(self.ttft_ms),
            "decode_ms": r(self.decode_ms),
            "decode_tps": round(gaps / decode_s, 2) if decode_s > 0 and gaps else None,
            "itl_p50_ms": r(self.itl_p(50)),
            "itl_p99_ms": r(self.itl_p(99)),
            "seed": self.seed,
            **self.llama_server_timings(),
        }

    def llama_server_timings(self) -> dict[str, Any]:
        """llama-server's `timings` fields (tools/server: `server_slot_stats::to_json`), with
        its meanings, on this request's clock.

        - `cache_n`: prompt tokens whose KV entries were kept (at least one is evaluated);
          `prompt_n`: the ones evaluated, so `prompt_n + cache_n` is the prompt.
        - `prompt_ms`: from the start of the first step that carried the prompt to its first
          sampled token: llmrun's `prefill_ms` (llama-server stops that clock after sampling
          the token, llmrun as the step's decode returns, just before it samples).
        - `predicted_n`: every token sampled, the end-of-generation token that ended the
          answer included; `predicted_ms`: from the first sampled token to the last, at
          least 1 µs once a token is sampled (the first token comes with the prompt's last
          step, so it is `prompt_ms`'s, not `predicted_ms`'s).
        - The per-token figures and rates divide by `prompt_n`, and for the prediction by
          its decode steps, `predicted_n - 1`; 0 where the divisor is 0, as llama-server.
        - `draft_n`, `draft_n_accepted` only when a draft model proposed tokens."""
        prompt_n, prompt_ms = self.prefill_tokens, self.prefill_ms
        predicted_n = self.completion_tokens
        predicted_ms = self.decode_ms + (self.end_token_ms or 0.0)
        if predicted_n:
            predicted_ms = max(predicted_ms, 0.001)
        steps = max(predicted_n - 1, 0)
        timings: dict[str, Any] = {
            "cache_n": self.reused_tokens,
            "prompt_n": prompt_n,
            "prompt_ms": round(prompt_ms, 3),
            "prompt_per_token_ms": round(prompt_ms / prompt_n, 3) if prompt_n else 0.0,
            "prompt_per_second": round(prompt_n / prompt_ms * 1000, 2) if prompt_ms > 0 else 0.0,
            "predicted_n": predicted_n,
            "predicted_ms": round(predicted_ms, 3),
            "predicted_per_token_ms": round(predicted_ms / steps, 3) if steps else 0.0,
            "predicted_per_second": (
                round(steps / predicted_ms * 1000, 2) if predicted_ms > 0 else 0.0
            ),
        }
        if self.draft_tokens:
            timings["draft_n"] = self.draft_tokens
            timings["draft_n_accepted"] = self.draft_accepted
        return timings


# ---- what a request's sink receives -------------------------------------------------------


@dataclass(frozen=True)
class Piece:
    text: str  # one token's text (stop strings applied; never half a character)
    # with logprobs: the tokens this text completes (those whose text was held back, then it)
    logprobs: tuple[Described, ...] = ()
    # the request's output tokens sampled so far, those whose text is held back included (the
    # usage so far of vLLM's `continuous_usage_stats`), and its prompt tokens found cached
    sampled: int = 0
    cached: int = 0


@dataclass(frozen=True)
class Done:
    finish_reason: str  # stop, length (or cancelled: no one listens)
    tail: str  # text held back until the end
    timings: RequestTimings
    logprobs: tuple[Described, ...] = ()  # the tokens not sent with a Piece yet


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
    grammar: str | None = None  # GBNF the answer follows (response_format)
    logprobs: int | None = None  # log probabilities of each token, with this many top ones
    logprobs_sent: int = 0  # the tokens whose log probabilities went with a Piece
    echo: bool = False  # legacy completions' echo: the prompt's text (and logprobs) first
    echoed: bool = False  # the prompt's text and log probabilities were sent
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

    def before_step(self) -> None:
        """A step is about to run (the energy counters are read around it)."""
        ...

    def on_step(self, step: StepRecord) -> None: ...

    def on_done(self, timings: RequestTimings) -> None: ...


class EngineThread:
    """The multi-sequence engine on a thread of its own, fed by `submit`. It runs in the
    runner's own context, loaded for its n_seq sequences (`runner.load(n_seq=...)`): the
    weights and one context, nothing unused (a runner already loaded otherwise is refused).

    Only the engine thread touches the `BatchedEngine`, through its public interface: it hands
    each job over (`BatchedEngine.submit`) while a sequence is free, steps, passes each new
    token to the job's sink, and cancels a job whose client went away."""

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
        # its own context holds the sequences (the only one); the warm-up decode runs on the
        # engine's thread, as every later decode (see LlamaCppRunner.load)
        loaded = runner.load(n_seq=n_seq, warm_up=False)
        if runner.warmed_on is not None:  # its decodes would be 1.3-1.8x slower, unseen
            raise EngineError(
                f"the context was warmed up on thread {runner.warmed_on}, before"
                " this engine's own thread: load it with warm_up=False"
            )
        self.runner, self.policy, self.n_seq = runner, policy, n_seq
        self.n_ctx_per_seq, self.max_queue = n_ctx_per_seq, max_queue
        self.engine = BatchedEngine(
            runner,
            n_seq=n_seq,
            n_ctx_per_seq=n_ctx_per_seq,
            n_batch=n_batch or loaded.settings.n_batch,
            policy=policy,
            keep_prefix=True,
            context=runner.context,
        )
        self.observer = observer
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._abort = AbortFlag()  # read by llama.cpp inside a step: stop() ends it there
        self._warmed = threading.Event()
        self._warm_error: BaseException | None = None
        self._pending: deque[Job] = deque()  # not yet handed to the engine
        self._jobs: dict[int, tuple[Job, Handle]] = {}  # handed over, by handle id
        self._counts = (0, 0)  # (decoding, prefilling), after the last step
        self._steps: deque[StepRecord] = deque(maxlen=512)
        self._itl: deque[tuple[float, float]] = deque(maxlen=64)  # (when, gap ms)
        self.served = 0
        self.output_tokens = 0
        self._thread = threading.Thread(target=self._loop, name="llmrun-engine", daemon=True)

    # ---- the HTTP side's calls (any thread, never blocking) ---------------------------------

    def start(self) -> None:
        """The engine's thread: the runner's warm-up decode on it, then requests. Returns once
        the warm-up is done (its error, if it failed: the thread has ended)."""
        self._thread.start()
        self._warmed.wait()
        if self._warm_error is not None:
            raise self._warm_error

    def submit(self, job: Job) -> None:
        """Queue a request; QueueFullError when --max-queue requests already wait."""
        with self._lock:
            if len(self._pending) + len(self._jobs) >= self.n_seq + self.max_queue:
                raise QueueFullError(len(self._pending))
            job.submitted_s = time.perf_counter()
            self._pending.append(job)
        self._wake.set()

    def cancel(self, job: Job) -> None:
        """The client is gone: the engine thread ends its request (and frees its sequence) as
        soon as the step in progress returns."""
        job.cancelled = True
        self._wake.set()

    def stop(self, timeout_s: float = 10.0) -> bool:
        """End the engine thread: the step in progress is aborted (llama.cpp's abort callback,
        which the CPU backend checks between graph nodes), every request still in flight
        ends with an error, then the engine's batch goes. True when the thread has ended,
        so its context may be freed; False when a step still runs after `timeout_s` (a
        backend that ignores the abort): then nothing is freed under it."""
        self._stop.set()
        self._abort.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)
        if self._thread.is_alive():
            return False
        self.engine.close()
        return True

    @property
    def stopped(self) -> bool:
        """The engine thread is not running (never started, or ended)."""
        return not self._thread.is_alive()

    @property
    def queued(self) -> int:
        return len(self._pending)

    @property
    def busy(self) -> int:
        return len(self._jobs)

    def snapshot(self, *, window_s: float = 5.0) -> Snapshot:
        now = time.perf_counter()
        with self._lock:
            steps = tuple(s for s in self._steps if now - s.end_s <= window_s)
            queued = len(self._pending)
            running, waiting = self._counts
            itl = tuple(gap for when, gap in self._itl if now - when <= window_s)
        return Snapshot(
            decoding=running,
            prefilling=waiting,
            queued=queued,
            n_seq=self.n_seq,
            policy=str(self.policy),
            steps=steps,
            recent_itl_ms=itl,
            served=self.served,
            output_tokens=self.output_tokens,
        )

    # ---- the engine thread ----------------------------------------------------------------

    def _loop(self) -> None:
        try:
            self.runner.warm_up()
        except BaseException as e:  # start() raises it: no server without its engine thread
            self._warm_error = e
            return
        finally:
            self._warmed.set()
        ptr = self.engine.ctx.ptr
        self._abort.install(ptr)
        try:
            self._serve()
        finally:
            self._abort.uninstall(ptr)

    def _serve(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            self._hand_over()
            self._drop_cancelled()
            if eng.idle:
                self._wake.wait(0.1)
                self._wake.clear()
                continue
            if self.observer is not None:
                self.observer.before_step()
            try:
                events = eng.step()
            except LlmrunError as e:  # aborted by stop(), or llama.cpp failed
                self._fail_all("the server is shutting down" if self._stop.is_set() else str(e))
                continue
            step = events.step
            if step is None:
                for handle in events.finished:  # refused as they were admitted
                    self._finish(handle)
                self._wake.wait(0.001)
                self._wake.clear()
                continue
            end = step.start_s + step.duration_s
            gaps: list[tuple[float, float]] = []
            jobs = self._jobs
            for handle in events.tokens:
                r = handle.result
                if len(r.times) > 1:
                    gaps.append((end, (r.times[-1] - r.times[-2]) * 1000))
                if r.pieces and r.pieces[-1]:
                    job = jobs[handle.id][0]
                    logprobs = self._logprobs(job, handle)
                    text = self._echo(job, handle) + r.pieces[-1]
                    job.sink(Piece(text, logprobs, len(r.output), handle.reused))
            record = StepRecord(end, step.duration_s, step.n_decode, step.n_prefill)
            with self._lock:
                self._steps.append(record)
                self._itl.extend(gaps)
                self._counts = (eng.decoding, eng.prefilling)
            if self.observer is not None:
                self.observer.on_step(record)
            sampled = {h.id for h in events.tokens}
            for handle in events.finished:
                # one that got no token yet ended in this step sampled its end-of-generation
                # token now (llama-server's predicted_n and predicted_ms count it)
                self._finish(handle, None if handle.id in sampled else end)
        self._fail_all("the server is shutting down")

    def _hand_over(self) -> None:
        """Pending jobs to the engine while a sequence is free (the rest wait here, where the
        HTTP side counts them); a job cancelled while it waited ends without a sequence."""
        eng = self.engine
        while True:
            with self._lock:
                if not self._pending or len(self._jobs) >= self.n_seq:
                    return
                job = self._pending.popleft()
                if not job.cancelled:
                    handle = eng.submit(
                        Arrival(
                            job.received_s,
                            job.tokens,
                            job.sampling.max_tokens,
                            job.sampling.ignore_eos,
                            job.sampling,
                            job.grammar,
                            job.logprobs,
                            job.echo and job.logprobs is not None,
                        )
                    )
                    self._jobs[handle.id] = (job, handle)
            if job.cancelled:  # it never had a sequence: nothing else to time
                timings = RequestTimings(
                    prompt_tokens=len(job.tokens),
                    template_tokenize_ms=(job.submitted_s - job.received_s) * 1000,
                    queue_ms=(time.perf_counter() - job.submitted_s) * 1000,
                    finish_reason=FINISH_CANCELLED,
                )
                job.sink(Done(FINISH_CANCELLED, "", timings))

    def _drop_cancelled(self) -> None:
        for _, handle in [v for v in self._jobs.values() if v[0].cancelled]:
            self.engine.cancel(handle)  # its KV entries go now
            self._finish(handle)

    def _finish(self, handle: Handle, step_end_s: float | None = None) -> None:
        """The request's outcome to its sink; `step_end_s`: it ended in a step that sampled a
        token that is not in its output (the end-of-generation token, when it stopped)."""
        r = handle.result
        with self._lock:
            job, _ = self._jobs.pop(handle.id)
            self._counts = (self.engine.decoding, self.engine.prefilling)
            failed = r.finish == FINISH_ERROR  # llama.cpp refused it alone; the others go on
            if not failed:
                self.served += 1
                self.output_tokens += len(r.output)
        if failed:
            job.sink(Failed(r.error or "llama.cpp could not serve this request"))
            self._wake.set()
            return
        started = r.started_s if r.started_s is not None else time.perf_counter()
        # a free sequence ends the queue (figures.py); not before the tokens were submitted
        admitted = min(max(r.admitted_s or started, job.submitted_s), started)
        prefill_end = r.prefilled_s if r.prefilled_s is not None else started
        times, finish, end_token_ms = r.times, r.finish, None
        if finish == FINISH_STOP and step_end_s is not None:
            end_token_ms = (step_end_s - times[-1]) * 1000 if times else 0.0
        timings = RequestTimings(
            prompt_tokens=len(handle.tokens),
            reused_tokens=handle.reused,
            output_tokens=len(r.output),
            template_tokenize_ms=(job.submitted_s - job.received_s) * 1000,
            queue_ms=(admitted - job.submitted_s) * 1000,
            step_wait_ms=(started - admitted) * 1000,
            prefill_ms=(prefill_end - started) * 1000,
            prefill_chunks=tuple((n, s * 1000) for n, s in r.chunks),
            ttft_ms=None if (ttft := ttft_s(job.received_s, times)) is None else ttft * 1000,
            decode_ms=(times[-1] - times[0]) * 1000 if times else 0.0,
            itl_ms=tuple(g * 1000 for g in r.gaps_s),
            finish_reason=finish if finish in (FINISH_CANCELLED, FINISH_STOP) else FINISH_LENGTH,
            seed=handle.seed if job.sampling.temperature > 0 else None,
            end_token_ms=end_token_ms,
        )
        if self.observer is not None:
            self.observer.on_done(timings)
        logprobs = self._logprobs(job, handle)
        tail = self._echo(job, handle) + r.tail
        job.sink(Done(timings.finish_reason, tail, timings, logprobs))
        self._wake.set()  # a free sequence: hand the next one over

    def _logprobs(self, job: Job, handle: Handle) -> tuple[Described, ...]:
        """The log probabilities of the tokens not yet sent, with their texts."""
        if job.logprobs is None:
            return ()
        new: list[TokenLogprob | int] = []
        if job.echo and not job.echoed:  # the prompt's first: its text comes with these
            new += [handle.tokens[0], *handle.result.prompt_logprobs]
        new += handle.result.logprobs[job.logprobs_sent :]
        job.logprobs_sent = len(handle.result.logprobs)
        return tuple(described(lp, self.runner.piece) for lp in new)

    def _echo(self, job: Job, handle: Handle) -> str:
        """The prompt's text, once, before the answer's first text (legacy `echo`)."""
        if not job.echo or job.echoed:
            return ""
        job.echoed = True
        data = b"".join(self.runner.piece(t) for t in handle.tokens)
        return data.decode("utf-8", errors="replace")

    def _fail_all(self, message: str) -> None:
        """llama.cpp failed mid-step (the engine has ended every request and emptied its KV
        cache), or the server stops: every request in flight or waiting ends with the error."""
        self.engine.clear(FINISH_ERROR)
        with self._lock:
            jobs = [job for job, _ in self._jobs.values()] + list(self._pending)
            self._jobs.clear()
            self._pending.clear()
            self._counts = (0, 0)
        for job in jobs:
            job.sink(Failed(message))
