"""llama-bench's method on the runner, plus what llama-bench leaves out.

Tests are llama-bench's shapes: `pp` (prompt processing: n_prompt random tokens), `tg` (text
generation: n_gen tokens one at a time) and `pg` (both), each optionally at a depth (n_depth
tokens already in the KV cache, evaluated untimed before every repetition). Every repetition
starts from a cleared cache with tokens drawn from a fixed seed, ignores end-of-sequence, and is
timed at the phase boundaries the runner already measures; one warm-up run precedes them.
What is added: time to first token for prompt tests, the inter-token latency distribution for
generation tests, llama.cpp's own counters for the same runs, the model load time, and
efficiency against the machine (memory bandwidth share for decode, FLOP/s for prefill); with
`--until-ci`, as many repetitions as the mean rate's 95 % interval needs to be narrow enough.

No terminal code: `run_bench` yields results and progress; the CLI draws them.
"""

from __future__ import annotations

import datetime as dt
import itertools
import random
import re
import statistics
import threading
import time
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from llmrun.runners import rpc
from llmrun.runners.base import (
    BenchRunner,
    Finished,
    PrefillProgress,
    Request,
    SamplingParams,
    Token,
)
from llmrun.runners.config import EngineConfig
from llmrun.runners.errors import BadRequestError, LlmrunError, ModelLoadError
from llmrun.runners.limits import CACHE_TYPE_BYTES, CACHE_TYPES, FLASH_ATTN
from llmrun.runners.significance import LogSample
from llmrun.runners.system import cpu_sample, measured_background

from .results import Phases, Result, Speculation
from .sweep import Combo, Shape

if TYPE_CHECKING:
    from llmrun.runners.energy import PhaseMeter
    from llmrun.runners.energy.bench import BenchEnergy
    from llmrun.runners.energy.meter import Spans


@dataclass(frozen=True)
class Skipped:
    combo: Combo
    shape: Shape | None  # None: the whole configuration could not run
    reason: str


@dataclass(frozen=True)
class Progress:
    """Where a run of tests is: at each repetition's start and end, and a few times within it
    (the clock of the runner is paused meanwhile, so showing it costs no measured time)."""

    done: int  # timed or warm-up runs finished
    total: int
    label: str  # the repetition under way, "tg128 rep 2/5 t=2", or the test just ended
    test: str = ""  # its kind (the shape's name): repetitions of a kind take about as long
    moment: Literal["preparing", "started", "working", "ended"] = "ended"  # preparing: settings
    fraction: float = 0.0  # of the repetition under way: its tokens done
    left: tuple[tuple[str, int], ...] = ()  # repetitions of each kind not yet started


@dataclass(frozen=True)
class UntilCi:
    """--until-ci: repeat each test past -r until its mean rate's 95 % interval (the geometric
    mean's, Welch's t on log rates as every comparison) is within ±`pct` %, or until the test
    has taken `budget_s` (a repetition under way finishes) or MAX_REPS repetitions."""

    pct: float
    budget_s: float = 300.0

    MAX_REPS = 1000
    UNTIL_CI_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*%?\s*(?:,\s*(\d+(?:\.\d*)?)\s*s?\s*)?")

    @classmethod
    def parse(cls, text: str) -> UntilCi:
        """`2`, `2%`, or with a time budget a test, `2%,60s` (default 300 s)."""
        m = cls.UNTIL_CI_RE.fullmatch(text)
        if not m:
            raise BadRequestError(
                f"--until-ci: give a share such as 2% or 2%,60s (with a time budget a test),"
                f" not {text!r}"
            )
        pct = float(m[1])
        budget = float(m[2]) if m[2] else cls.budget_s
        if not 0.01 <= pct <= 50:
            raise BadRequestError(f"--until-ci: {pct:g}% is outside 0.01% to 50%")
        if not 1 <= budget <= 86_400:
            raise BadRequestError(f"--until-ci: a budget of {budget:g} s is outside 1 s to 1 day")
        return cls(pct, budget)

    def stop(self, rates: Sequence[float], elapsed_s: float) -> str | None:
        """Why to stop repeating now, or None to repeat again."""
        half = LogSample.of(rates).halfwidth()
        if half is not None and half * 100 < self.pct:
            return "reached"
        if elapsed_s >= self.budget_s:
            return "time budget"
        if len(rates) >= self.MAX_REPS:
            return "repetition cap"
        return None


class Interrupted(Exception):
    """The user stopped the benchmark; the results so far stand."""


def kv_bytes_per_position(runner: BenchRunner, type_k: str, type_v: str) -> float:
    """Bytes of K and V one context position takes, over all layers (from the GGUF header)."""
    header = runner.header()
    meta, arch = header.metadata, header.architecture

    def get(key: str, default: int = 0) -> int:
        value = meta.get(f"{arch}.{key}", default)
        if isinstance(value, list):  # per-layer values
            value = max(value) if value else default
        return int(value)

    n_layer, n_embd, n_head = (
        get("block_count"),
        get("embedding_length"),
        get("attention.head_count"),
    )
    n_head_kv = get("attention.head_count_kv", n_head)
    if not (n_layer and n_embd and n_head):
        return 0.0
    k_len = get("attention.key_length", n_embd // n_head)
    v_len = get("attention.value_length", n_embd // n_head)
    bk, bv = CACHE_TYPE_BYTES.get(type_k, 2.0), CACHE_TYPE_BYTES.get(type_v, 2.0)
    return float(n_layer * n_head_kv * (k_len * bk + v_len * bv))


def _check_combo(combo: Combo, n_ctx: int | None) -> str | None:
    """Why the engine cannot use this configuration, or None (a batch above a context the
    tests size, as llama-bench's, is capped by llama.cpp; only above a -c given is it refused)."""
    for name, value in (("cache-type-k", combo.type_k), ("cache-type-v", combo.type_v)):
        if value not in CACHE_TYPES:
            return f"unknown {name} '{value}' (known: {', '.join(CACHE_TYPES)})"
    if combo.flash_attn is not None and combo.flash_attn not in FLASH_ATTN:
        return f"unknown flash-attn '{combo.flash_attn}' (known: {', '.join(FLASH_ATTN)})"
    if n_ctx is not None and combo.n_batch is not None and combo.n_batch > n_ctx:
        return f"batch {combo.n_batch} is larger than the context ({n_ctx} tokens)"
    if combo.n_threads is not None and combo.n_threads < 1:
        return "threads must be at least 1"
    return None


def _one_run(
    runner: BenchRunner, shape: Shape, rng: random.Random, cancel: threading.Event, draft: int = 0
) -> tuple[Finished, int | None]:
    """One repetition from a cleared cache; returns the result and the first output token."""
    steps = _repetition(runner, shape, rng, cancel, draft)
    while True:
        try:
            next(steps)
        except StopIteration as end:
            return end.value


def _repetition(
    runner: BenchRunner,
    shape: Shape,
    rng: random.Random,
    cancel: threading.Event,
    draft: int = 0,
    meter: PhaseMeter | None = None,
) -> Generator[float, None, tuple[Finished, int | None]]:
    """One repetition from a cleared cache, yielding its share done now and then (about 32
    times: prefill chunks for pp, tokens otherwise); returns the result and the first output
    token. `meter` sees its events (its phases: `meter.spans`), paused while it yields."""
    n_vocab = runner.vocab_size()
    runner.reset()
    depth = [rng.randrange(n_vocab) for _ in range(shape.n_depth)]
    if depth:
        runner.eval_tokens(depth, cancel=cancel)  # untimed; the request below shares this prefix
        if cancel.is_set():
            raise Interrupted
    prompt = [rng.randrange(n_vocab) for _ in range(max(shape.n_prompt, 1))]
    # pp: the first sample gives TTFT and the next token; tg and pg: n_gen decode steps after
    # the first token, as llama-bench's test_gen after its prompt
    max_tokens = 1 if shape.n_gen == 0 else shape.n_gen + 1
    request = Request(
        token_ids=tuple(depth + prompt),
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, draft=draft),
        keep_cache=True,
        decode_only=shape.n_gen > 0 and not draft,  # llama-bench's tg samples nothing
    )
    finished: Finished | None = None
    first: int | None = None
    every = max(1, shape.n_gen // 32)
    if meter is not None:
        meter.begin()
    for event in runner.stream(request, cancel=cancel):
        share: float | None = None
        if isinstance(event, Token):
            if first is None:
                first = event.token_id
            if shape.n_gen and event.index and event.index % every == 0:
                share = event.index / (shape.n_gen + 1)
        elif isinstance(event, PrefillProgress):
            new = event.total_tokens - event.reused_tokens
            if not shape.n_gen and event.reused_tokens < event.done_tokens < event.total_tokens:
                share = (event.done_tokens - event.reused_tokens) / new  # the last: see Finished
        elif isinstance(event, Finished):
            finished = event
            if meter is not None:
                meter.finish()
            continue
        if meter is not None:
            meter.see(event)
        if share is not None:
            if meter is not None:
                meter.pause()
            yield share
            if meter is not None:
                meter.resume()
    assert finished is not None
    if finished.stats.interrupted or cancel.is_set():
        raise Interrupted
    return finished, first


def _timed(shape: Shape, finished: Finished) -> tuple[float, float]:
    """(our seconds, llama.cpp's seconds) for the tokens the test counts."""
    s = finished.stats
    p_eval = (s.engine_prompt_eval_ms or 0.0) / 1000
    per_eval = (s.engine_eval_ms or 0.0) / 1000 / max(s.engine_n_eval or 1, 1)
    per_sample = (s.engine_sample_ms or 0.0) / 1000 / max(s.engine_n_sample or 1, 1)
    if shape.n_gen == 0:
        return s.prefill_s, p_eval
    if shape.n_prompt == 0:  # n_gen decode steps, each an eval and a sample
        return s.decode_s, len(s.itl_s) * (per_eval + per_sample)
    ours = s.prefill_s + s.first_sample_s + s.decode_s
    return ours, p_eval + len(s.itl_s) * per_eval + (s.engine_sample_ms or 0.0) / 1000


def run_bench(
    runner: BenchRunner,
    *,
    combos: Sequence[Combo],
    shapes: Sequence[Shape],
    reps: int,
    base: EngineConfig,
    n_ctx: int | None = None,
    seed: int = 1234,
    warmup: bool = True,
    delay_s: float = 0.0,
    cancel: threading.Event | None = None,
    until_ci: UntilCi | None = None,
    meter: PhaseMeter | None = None,
    tests: Sequence[tuple[Combo, Sequence[Shape]]] | None = None,
) -> Iterator[Result | Skipped | Progress]:
    """Run every shape on every configuration (or each configuration's own shapes, in the
    order `tests` gives: llama-bench's); yields results as they finish.

    Stops at the next token when `cancel` is set (raising nothing: the iterator just ends after
    the results so far). Configurations the engine cannot use are yielded as `Skipped`. With
    `until_ci`, a test repeats past `reps` until its interval is narrow enough (`UntilCi`); the
    progress total grows by each repetition added. With `meter`, each test's phases are
    metered over its timed repetitions (`BenchEnergy`).
    """
    cancel = cancel or threading.Event()
    # As llama-bench: the context the tests need (llama.cpp caps n_batch at it; the record
    # keeps the batch asked for, as llama-bench's does)
    ctx = n_ctx or max(256, max(s.n_ctx_needed for s in shapes))
    per_test = reps + (1 if warmup else 0)
    plan: list[tuple[Combo, Sequence[Shape]]] = (
        list(tests) if tests is not None else [(c, shapes) for c in combos]
    )
    total = sum(len(s) for _, s in plan) * per_test

    def left(i_combo: int, i_shape: int, rep: int) -> tuple[tuple[str, int], ...]:
        """Repetitions of each kind not yet started, after this one."""
        counts = {s.name: 0 for _, here in plan for s in here}
        for i, (_, here) in enumerate(plan[i_combo:], i_combo):
            for k, s in enumerate(here):
                n = per_test if i > i_combo or k > i_shape else 0
                n += per_test - rep - 1 if i == i_combo and k == i_shape else 0
                counts[s.name] += n
        return tuple(counts.items())

    done = 0
    for i_combo, (combo, shapes) in enumerate(plan):
        problem = _check_combo(combo, n_ctx if combo.n_batch != base.n_batch else None)
        if problem is None:
            yield Progress(
                done,
                total,
                f"setting up {combo.describe()}".strip(),
                moment="preparing",
                left=left(i_combo, -1, 0),
            )
            try:
                loaded = runner.reconfigure(combo.config(base, ctx))
            except ModelLoadError as e:
                problem = f"llama.cpp refused it: {e.detail}"
            except LlmrunError as e:
                problem = str(e)
        if problem is not None:
            done += len(shapes) * per_test
            yield Skipped(combo, None, problem)
            yield Progress(done, total, combo.describe(), left=left(i_combo, len(shapes), 0))
            continue
        kv = kv_bytes_per_position(runner, combo.type_k, combo.type_v)
        for i_shape, shape in enumerate(shapes):
            if shape.n_ctx_needed > loaded.settings.n_ctx:
                done += per_test
                need, have = shape.n_ctx_needed, loaded.settings.n_ctx
                yield Skipped(combo, shape, f"needs {need} tokens of context, it holds {have}")
                yield Progress(done, total, shape.name, left=left(i_combo, i_shape, per_test - 1))
                continue
            if delay_s and (cancel or threading.Event()).wait(delay_s):  # llama-bench's --delay
                return
            rng = random.Random(seed)
            samples: list[float] = []
            engine: list[float] = []
            ttft: list[float] = []
            gaps: list[float] = []
            phase_tps: list[tuple[float | None, float | None]] = []  # pg: (prompt, gen)
            next_token: int | None = None
            drafted = accepted = steps = 0  # speculative decoding (bench --draft)
            start = done
            planned = per_test  # grows with each repetition --until-ci adds
            stopped: str | None = None
            began = time.monotonic()
            when = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            cpu0 = cpu_sample()
            spans: Spans | None = None
            traffic: rpc.Traffic | None = None
            try:
                for rep in itertools.count():
                    if rep >= per_test:
                        if until_ci is None:
                            break
                        rates = [(shape.n_prompt + shape.n_gen) / x for x in samples if x > 0]
                        stopped = until_ci.stop(rates, time.monotonic() - began)
                        if stopped is not None:
                            break
                        planned += 1
                        total += 1
                    timed = rep + 1 - (per_test - reps)
                    which = f"rep {timed}/{reps}" if timed > 0 else "warm-up"
                    if timed > reps:
                        which = f"rep {timed} (until ±{until_ci.pct:g} %)" if until_ci else which
                    label = f"{shape.name} {which} {combo.describe()}".strip()
                    still = left(i_combo, i_shape, rep)
                    yield Progress(done, total, label, shape.name, "started", 0.0, still)
                    before = rpc.traffic()
                    run = _repetition(runner, shape, rng, cancel, combo.draft, meter)
                    while True:
                        try:
                            share = next(run)
                        except StopIteration as end:
                            finished, first = end.value
                            break
                        yield Progress(done, total, label, shape.name, "working", share, still)
                    done += 1
                    yield Progress(done, total, label, shape.name, "ended", 1.0, still)
                    if warmup and rep == 0:
                        continue
                    after = rpc.traffic()
                    if before is not None and after is not None and not shape.n_depth:
                        moved = after.since(before)  # a depth's fill would count too: none
                        traffic = moved if traffic is None else moved.plus(traffic)
                    if meter is not None:
                        one = meter.spans(finished.stats)
                        spans = one if spans is None else spans.plus(one)
                    ours, theirs = _timed(shape, finished)
                    samples.append(ours)
                    engine.append(theirs)
                    if shape.n_prompt:
                        if finished.stats.ttft_s is not None:
                            ttft.append(finished.stats.ttft_s)
                        next_token = first
                    if shape.n_gen:
                        gaps.extend(finished.stats.itl_s)
                        drafted += finished.stats.draft_tokens
                        accepted += finished.stats.accepted_tokens
                        steps += finished.stats.decode_steps
                    if shape.n_prompt and shape.n_gen:
                        st = finished.stats
                        phase_tps.append((st.prompt_tps, st.output_tps))
            except Interrupted:
                return
            except LlmrunError as e:
                done = start + planned
                yield Skipped(combo, shape, str(e))
                yield Progress(done, total, shape.name, left=left(i_combo, i_shape, per_test - 1))
                continue
            speculation = None
            if combo.draft:
                speculation = Speculation(
                    draft=combo.draft,
                    acceptance_rate=round(accepted / drafted, 4) if drafted else None,
                    tokens_per_step=round(len(gaps) / steps, 4) if steps else None,
                )
            phases = None
            if phase_tps:  # pg blends two phases; keep each one's own rate as well
                pp = [p for p, _ in phase_tps if p]
                tg = [g for _, g in phase_tps if g]
                phases = Phases(
                    pp_ts=round(statistics.fmean(pp), 6) if pp else None,
                    tg_ts=round(statistics.fmean(tg), 6) if tg else None,
                )
            yield Result(
                shape=shape,
                combo=combo,
                model=loaded.model,
                settings=loaded.settings,
                load_s=loaded.load_s,
                samples_s=tuple(samples),
                engine_samples_s=tuple(engine),
                ttft_s=tuple(ttft),
                itl_s=tuple(gaps),
                next_token=next_token if shape.n_gen == 0 else None,
                test_time=when,
                kv_bytes_per_pos=kv,
                background_cpus=measured_background(cpu0, cpu_sample()),
                speculation=speculation,
                phases=phases,
                until_ci_pct=None if until_ci is None else until_ci.pct,
                until_ci_stop=stopped,
                energy=None if meter is None else _energy(meter, shape, spans),
                rpc_traffic=traffic,
            )


def _energy(meter: PhaseMeter, shape: Shape, spans: Spans | None) -> BenchEnergy:
    """The test's counted phases over its timed repetitions."""
    from llmrun.runners.energy.bench import BenchEnergy

    if spans is None:
        reason = meter.reasons.get("all") or "no timed repetition (-r 0)"
        return BenchEnergy(None, 0.0, 0, note=reason)
    report = meter.report_of(spans)
    return BenchEnergy.of(
        report, prefill=shape.n_prompt > 0, decode=shape.n_gen > 0, reps=spans.count
    )
