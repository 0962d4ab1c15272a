"""The batched engine's public interface (submit, step, cancel) on the real model, and the
server's engine thread on it: one context, a cancel that frees its sequence's KV at once."""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Iterator, Sequence

import pytest

from llmrun.runners import library
from llmrun.runners.base import SamplingParams
from llmrun.runners.config import EngineConfig
from llmrun.runners.errors import EngineError, PromptTooLongError
from llmrun.runners.handles import Sampler
from llmrun.runners.library import LOG_LINES, AbortFlag, llama_lib
from llmrun.runners.llamacpp import LlamaCppRunner
from llmrun.runners.serving.api_engine import Done, EngineThread, Failed, Job, Outcome, Piece
from llmrun.runners.serving.batching import FINISH_CANCELLED, Arrival, BatchedEngine, Handle
from llmrun.runners.serving.policy import Policy

from .conftest import HANG_S
from .greedy import NEAR_TIE, margin_at_divergence

MAX_STEPS = 2000  # bounds every loop below: a step always makes progress


@pytest.fixture(scope="module")
def engine(model_path: str) -> Iterator[BatchedEngine]:
    runner = LlamaCppRunner(model_path, EngineConfig(n_ctx=256, n_threads=1))
    with BatchedEngine(runner, n_seq=2, n_ctx_per_seq=128, n_batch=64) as e:
        yield e
    runner.close()


def prompt(seed: int, n: int = 40) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(1000, 40000) for _ in range(n))


def kv_end(engine: BatchedEngine, sid: int) -> int:
    """The last position sequence sid holds in the KV cache (-1: none)."""
    lib = llama_lib()
    return int(lib.llama_memory_seq_pos_max(lib.llama_get_memory(engine.ctx.ptr), sid))


def step_until(engine: BatchedEngine, *, handle: Handle | None = None, tokens: int = 0) -> None:
    """Step until the handle ended or has `tokens` tokens (without a handle: until idle)."""
    for _ in range(MAX_STEPS):
        if handle is not None and (handle.done or 0 < tokens <= len(handle.result.output)):
            return
        if handle is None and engine.idle:
            return
        engine.step()
    raise AssertionError("the engine made no progress")


def test_a_cancel_frees_the_sequences_kv_at_once_and_the_next_request_runs(
    engine: BatchedEngine,
) -> None:
    engine.clear()
    assert engine.step().step is None  # idle: nothing to run
    first = engine.submit(Arrival(engine.now(), prompt(1), 60, ignore_eos=True))
    step_until(engine, handle=first, tokens=3)
    sid = first.sid
    assert sid >= 0 and kv_end(engine, sid) >= len(first.tokens)  # its prompt's KV is there
    assert engine.cancel(first)
    assert kv_end(engine, sid) == -1  # gone before any further step
    assert first.done and first.sid == -1 and first.result.finish == FINISH_CANCELLED
    assert len(first.result.output) < 60 and engine.idle
    assert not engine.cancel(first)  # already ended
    after = engine.submit(Arrival(engine.now(), prompt(2), 8, ignore_eos=True))
    step_until(engine, handle=after)
    assert after.done and len(after.result.output) == 8
    solo, _ = engine.run([Arrival(0.0, prompt(2), 8, ignore_eos=True)], Policy("chunked", 64))
    assert (
        margin_at_divergence(engine.runner, list(prompt(2)), solo[0].output, after.result.output)
        < NEAR_TIE
    )


def test_a_queued_request_cancelled_never_runs_and_the_others_carry_on(
    engine: BatchedEngine,
) -> None:
    engine.clear()
    running = [engine.submit(Arrival(engine.now(), prompt(i), 6, ignore_eos=True)) for i in (3, 4)]
    waiting = engine.submit(Arrival(engine.now(), prompt(5), 6, ignore_eos=True))
    engine.step()
    assert engine.queued == 1 and engine.prefilling + engine.decoding == 2
    assert engine.cancel(waiting)
    assert engine.queued == 0 and waiting.done and waiting.result.started_s is None
    step_until(engine)
    assert [len(h.result.output) for h in running] == [6, 6]
    assert waiting.result.output == []


def test_step_events_carry_each_token_and_each_ending(engine: BatchedEngine) -> None:
    engine.clear()
    sampling = SamplingParams(max_tokens=12, temperature=0.8, seed=11, ignore_eos=True)
    h = engine.submit(Arrival(engine.now(), prompt(6), 12, ignore_eos=True, sampling=sampling))
    got, ended, prefill = 0, [], 0
    for _ in range(MAX_STEPS):
        if engine.idle:
            break
        events = engine.step(Policy("chunked", 16))  # the prompt in chunks of 16
        assert events.step is not None
        prefill += events.step.n_prefill
        got += sum(1 for t in events.tokens if t is h)
        ended += list(events.finished)
    assert got == len(h.result.output) == 12 and ended == [h]
    assert prefill == len(h.tokens) and [n for n, _ in h.result.chunks] == [16, 16, 8]
    assert h.seed == 11 and len(h.result.pieces) == 12
    assert h.result.started_s is not None and h.result.prefilled_s == h.result.times[0]
    text = b"".join(engine.runner.piece(t) for t in h.result.output).decode(errors="replace")
    assert "".join(h.result.pieces) + h.result.tail == text


def test_keep_prefix_reuses_a_shared_prefix_and_changes_nothing(model_path: str) -> None:
    runner = LlamaCppRunner(model_path, EngineConfig(n_ctx=256, n_threads=1))
    try:
        with BatchedEngine(
            runner, n_seq=2, n_ctx_per_seq=128, n_batch=64, keep_prefix=True
        ) as keep:
            first = keep.submit(Arrival(keep.now(), prompt(7), 4, ignore_eos=True))
            step_until(keep)
            longer = keep.submit(Arrival(keep.now(), prompt(7) + prompt(8, 10), 8, ignore_eos=True))
            step_until(keep)
            assert first.reused == 0 and longer.reused == len(prompt(7))
            assert sum(n for n, _ in longer.result.chunks) == 10  # only the new tokens
            plain, _ = keep.run(
                [Arrival(0.0, longer.tokens, 8, ignore_eos=True)], Policy("chunked", 64)
            )
            assert (
                margin_at_divergence(
                    runner, list(longer.tokens), plain[0].output, longer.result.output
                )
                < NEAR_TIE
            )
    finally:
        runner.close()


def test_a_prompt_longer_than_a_sequence_is_refused_at_submit(engine: BatchedEngine) -> None:
    engine.clear()
    with pytest.raises(PromptTooLongError):
        engine.submit(Arrival(0.0, prompt(9, 128), 4))
    assert engine.idle


def test_the_servers_engine_is_the_runners_one_context(model_path: str) -> None:
    """`llmrun serve`'s engine thread loads the model once and makes one context, holding its
    sequences: llama.cpp logs one context's construction, and its KV buffer is what one
    context of n_seq x n_ctx tokens takes, no more."""
    runner = LlamaCppRunner(model_path, EngineConfig(n_ctx=256, n_threads=1))
    thread = EngineThread(
        runner, n_seq=2, n_ctx_per_seq=256, policy=Policy("chunked", 64), max_queue=1
    )
    try:
        constructed = sum("constructing llama_context" in line for line in LOG_LINES)
        assert constructed == 1
        assert thread.engine.ctx is runner.context and not runner._contexts
        loaded = runner.load()
        memory = loaded.settings.memory
        assert memory is not None and loaded.settings.n_ctx == 256 and memory.n_ctx >= 512
        single = LlamaCppRunner(model_path, EngineConfig(n_ctx=512, n_threads=1))
        try:
            alone = single.load().settings.memory
            assert alone is not None and memory.kv_bytes == alone.kv_bytes > 0
        finally:
            single.close()
        with pytest.raises(EngineError, match="2 sequences"):
            runner.load(n_seq=1)  # a second, single-sequence context is refused
        thread.start()
        out: queue.Queue[Outcome] = queue.Queue()
        job = Job(
            prompt(10),
            SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
            out.put,
            received_s=time.perf_counter(),
        )
        thread.submit(job)
        events = [out.get(timeout=HANG_S)]
        while not isinstance(events[-1], Done):
            events.append(out.get(timeout=HANG_S))
        done = events[-1]
        assert isinstance(done, Done) and done.timings.output_tokens == 5
        assert all(isinstance(e, Piece) for e in events[:-1])
    finally:
        thread.stop()
        runner.close()


class _RefusingEngine(BatchedEngine):
    """llama.cpp refusing one request's sampler chain (as when it cannot make one)."""

    def new_chain(self, sp: SamplingParams, seed: int, *, prompt: Sequence[int] = ()) -> Sampler:
        if seed == 13:
            raise EngineError("llama.cpp could not make a sampler chain")
        return super().new_chain(sp, seed, prompt=prompt)


@pytest.mark.parametrize("keep_prefix", [False, True])
def test_a_request_whose_sampler_is_refused_ends_alone_and_frees_its_sequence(
    model_path: str, keep_prefix: bool
) -> None:
    runner = LlamaCppRunner(model_path, EngineConfig(n_ctx=256, n_threads=1))
    sp = {
        seed: SamplingParams(max_tokens=4, temperature=0.7, seed=seed, ignore_eos=True)
        for seed in (13, 7, 8)
    }
    try:
        with _RefusingEngine(
            runner, n_seq=1, n_ctx_per_seq=128, n_batch=64, keep_prefix=keep_prefix
        ) as engine:
            bad = engine.submit(Arrival(engine.now(), prompt(1), 4, True, sp[13]))
            good = engine.submit(Arrival(engine.now(), prompt(2), 4, True, sp[7]))
            later = engine.submit(Arrival(engine.now(), prompt(3), 4, True, sp[8]))
            ended: list[Handle] = []
            for _ in range(MAX_STEPS):
                if engine.idle:
                    break
                ended += engine.step().finished
            assert engine.idle
            assert bad.done and bad.sid == -1 and bad.result.finish == "error"
            assert "sampler chain" in bad.result.error and not bad.result.output
            assert ended == [bad, good, later]  # each reported once, in order
            for h in (good, later):  # the one sequence went on to the others
                assert h.result.finish != "error" and len(h.result.output) == 4
    finally:
        runner.close()


def test_a_refused_request_and_one_that_ends_in_the_same_step_are_both_reported(
    model_path: str,
) -> None:
    """A request refused at admission and another that ends in that step's decode: both come
    among `finished`, once (the refused one holds no place among the running ones)."""
    runner = LlamaCppRunner(model_path, EngineConfig(n_ctx=256, n_threads=1))
    good_sp = SamplingParams(max_tokens=1, temperature=0.7, seed=7, ignore_eos=True)
    bad_sp = SamplingParams(max_tokens=4, temperature=0.7, seed=13, ignore_eos=True)
    try:
        with _RefusingEngine(runner, n_seq=2, n_ctx_per_seq=64, n_batch=64) as engine:
            good = engine.submit(Arrival(engine.now(), prompt(1), 1, True, good_sp))
            bad = engine.submit(Arrival(engine.now(), prompt(2), 4, True, bad_sp))
            events = engine.step()
            assert list(events.finished) == [bad, good] and engine.idle
            assert good.result.finish != "error" and len(good.result.output) == 1
            assert bad.result.finish == "error"
    finally:
        runner.close()


@pytest.mark.parametrize("strlen", [True, False], ids=["strlen", "python-callback"])
def test_an_abort_ends_a_step_and_every_request_with_an_error(
    engine: BatchedEngine, strlen: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What `EngineThread.stop` relies on: llama.cpp's abort callback reading AbortFlag (no
    Python inside the step) lets a step run while clear and stops it in llama_decode once
    set; the engine ends every request (finish 'error') and empties the KV cache."""
    engine.clear()
    if not strlen:  # a platform without a C library's strlen found
        monkeypatch.setattr(library, "_strlen_address", lambda: None)
    flag = AbortFlag()
    flag.install(engine.ctx.ptr)
    try:
        handle = engine.submit(Arrival(engine.now(), prompt(4), 3, ignore_eos=True))
        step_until(engine, handle=handle)  # not set: llama.cpp goes on
        assert len(handle.result.output) == 3 and not flag.is_set()
        handle = engine.submit(Arrival(engine.now(), prompt(4), 8, ignore_eos=True))
        flag.set()
        with pytest.raises(EngineError, match="code 2"):  # llama.cpp's "aborted"
            engine.step()
    finally:
        flag.uninstall(engine.ctx.ptr)
    assert handle.done and handle.result.finish == "error" and engine.idle
    assert kv_end(engine, 0) == -1 and kv_end(engine, 1) == -1
    after = engine.submit(Arrival(engine.now(), prompt(4), 3, ignore_eos=True))
    step_until(engine, handle=after)
    assert len(after.result.output) == 3  # the context serves on


def test_stop_ends_a_request_in_flight_then_frees_the_engine(model_path: str) -> None:
    """SIGTERM's last step: stop() aborts the step in progress (a whole long prompt in one
    llama_decode here), the request gets its error, and only then is anything freed."""
    runner = LlamaCppRunner(model_path, EngineConfig(n_ctx=2048, n_threads=1, n_batch=2048))
    thread = EngineThread(
        runner, n_seq=1, n_ctx_per_seq=2048, policy=Policy("prefill-first"), max_queue=1
    )
    try:
        thread.start()
        out: queue.Queue[Outcome] = queue.Queue()
        job = Job(
            prompt(5, 1900),
            SamplingParams(max_tokens=50, temperature=0, ignore_eos=True),
            out.put,
            received_s=time.perf_counter(),
        )
        thread.submit(job)
        for _ in range(MAX_STEPS):  # handed to the engine (its step may or may not have begun)
            if thread.busy:
                break
            time.sleep(0.005)
        assert not thread.stopped
        assert thread.stop()
        assert thread.stopped
        event = out.get(timeout=HANG_S)
        assert isinstance(event, Failed) and "shutting down" in event.message, event
    finally:
        thread.stop()
        runner.close()


def test_the_warm_up_decode_runs_on_the_engines_thread(
    model_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """llama.cpp's CPU backend keeps OpenMP workers per thread that computes: a warm-up on the
    main thread and decodes on the engine's made every decode ~1.5x slower. So the server's
    load leaves the warm-up to its engine thread, which does it before `start` returns."""
    runner = LlamaCppRunner(model_path, EngineConfig(n_ctx=256, n_threads=1))
    warm_up, threads = runner._warm_up, []

    def recorded() -> float:
        threads.append(threading.current_thread().name)
        return warm_up()

    monkeypatch.setattr(runner, "_warm_up", recorded)
    thread = EngineThread(
        runner, n_seq=2, n_ctx_per_seq=256, policy=Policy("chunked", 64), max_queue=1
    )
    try:
        loaded = runner.loaded
        assert threads == [] and loaded is not None and loaded.warmup_s is None
        thread.start()
        loaded = runner.loaded
        assert threads == ["llmrun-engine"] and loaded is not None and loaded.warmup_s
    finally:
        thread.stop()
        runner.close()


def test_a_context_warmed_up_on_another_thread_is_refused(model_path: str) -> None:
    """A runner whose warm-up decode ran on this thread would make every decode of the engine's
    thread slower without a sign of it: EngineThread refuses it, naming the thread."""
    runner = LlamaCppRunner(model_path, EngineConfig(n_ctx=256, n_threads=1))
    try:
        runner.load(n_seq=2)  # warm-up on this thread
        assert runner.warmed_on == threading.current_thread().name
        with pytest.raises(EngineError, match="warmed up on thread MainThread"):
            EngineThread(
                runner, n_seq=2, n_ctx_per_seq=256, policy=Policy("chunked", 64), max_queue=1
            )
    finally:
        runner.close()
    assert runner.warmed_on is None


def test_a_failed_warm_up_stops_the_server_before_it_listens(
    model_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The warm-up runs on the engine's thread; its failure, of any kind, is raised by `start`
    instead of leaving a server whose engine thread has ended (every request would hang)."""
    runner = LlamaCppRunner(model_path, EngineConfig(n_ctx=256, n_threads=1))

    def broken() -> float:
        raise RuntimeError("no warm-up today")

    monkeypatch.setattr(runner, "_warm_up", broken)
    thread = EngineThread(
        runner, n_seq=2, n_ctx_per_seq=256, policy=Policy("chunked", 64), max_queue=1
    )
    try:
        with pytest.raises(RuntimeError, match="no warm-up today"):
            thread.start()
        assert thread.stopped
    finally:
        thread.stop()
        runner.close()
