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

No terminal code: `run_bench` runs a `BenchPlan`, yielding results and progress; the CLI
draws them.
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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from llmrun.runners import rpc
from llmrun.runners.base import (
    BenchRunner,
    Finished,
    LocalLoaded,
    PrefillProgress,
    Request,
    SamplingParams,
    Token,
)
from llmrun.runners.config import EngineConfig
from llmrun.runners.errors import LlmrunError, ModelLoadError, OptionError
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
    UNTIL_CI_RE = re.compile(
        r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*%?\s*(?:,\s*([0-9]+(?:\.[0-9]*)?)\s*s?\s*)?"
    )

    @classmethod
    def parse(cls, text: str) -> UntilCi:
        """`2`, `2%`, or with a time budget a test, `2%,60s` (default 300 s)."""
        m = cls.UNTIL_CI_RE.fullmatch(text)
        if not m:
            raise OptionError(
                f"--until-ci: give a share such as 2% or 2%,60s (with a time budget a test),"
                f" not {text!r}"
            )
        pct = float(m[1])
        budget = float(m[2]) if m[2] else cls.budget_s
        if not 0.01 <= pct <= 50:
            raise OptionError(f"--until-ci: {pct:g}% is outside 0.01% to 50%")
        if not 1 <= budget <= 86_400:
            raise OptionError(f"--until-ci: a budget of {budget:g} s is outside 1 s to 1 day")
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

    names = ("block_count", "embedding_length", "attention.head_count")
    n_layer, n_embd, n_head = (get(name) for name in names)
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
        return sum(s.itl_s), len(s.itl_s) * (per_eval + per_sample)
    ours = s.prefill_s + s.first_sample_s + sum(s.itl_s)
    return ours, p_eval + len(s.itl_s) * per_eval + (s.engine_sample_ms or 0.0) / 1000


@dataclass(frozen=True)
class BenchPlan:
    """What a bench run measures: each configuration with its own shapes, in the order they
    run (llama-bench's: sweep.tests), and how. `n_ctx` None: the context the tests need, at
    least 256 (llama-bench's; llama.cpp caps n_batch at it, the record keeps the batch asked
    for). With `until_ci`, a test repeats past `reps` until its interval is narrow enough
    (`UntilCi`); with `meter`, each test's phases are metered over its timed repetitions."""

    tests: tuple[tuple[Combo, tuple[Shape, ...]], ...]
    reps: int
    n_ctx: int | None = None
    seed: int = 1234
    warmup: bool = True
    delay_s: float = 0.0  # llama-bench's --delay, before each test
    until_ci: UntilCi | None = None
    meter: PhaseMeter | None = None

    @property
    def per_test(self) -> int:
        """A test's runs before --until-ci adds any: its repetitions and its warm-up."""
        return self.reps + (1 if self.warmup else 0)

    @property
    def context(self) -> int:
        needed = (s.n_ctx_needed for _, shapes in self.tests for s in shapes)
        return self.n_ctx or max(256, max(needed, default=0))


def every_shape(
    combos: Sequence[Combo], shapes: Sequence[Shape]
) -> tuple[tuple[Combo, tuple[Shape, ...]], ...]:
    """A plan's tests: every shape on every configuration, configuration by configuration."""
    return tuple((c, tuple(shapes)) for c in combos)


class _Count:
    """A run's progress: runs done, runs planned (--until-ci adds to them), and what is left."""

    def __init__(self, plan: BenchPlan) -> None:
        self.plan = plan
        self.done = 0
        self.total = sum(len(s) for _, s in plan.tests) * plan.per_test

    def left(self, i_combo: int, i_shape: int, rep: int) -> tuple[tuple[str, int], ...]:
        """Repetitions of each kind not yet started, after this one."""
        tests, per_test = self.plan.tests, self.plan.per_test
        counts = {s.name: 0 for _, here in tests for s in here}
        for i, (_, here) in enumerate(tests[i_combo:], i_combo):
            for k, s in enumerate(here):
                n = per_test if i > i_combo or k > i_shape else 0
                n += per_test - rep - 1 if i == i_combo and k == i_shape else 0
                counts[s.name] += n
        return tuple(counts.items())

    def skip(self, runs: int, label: str, left: tuple[tuple[str, int], ...]) -> Progress:
        self.done += runs
        return Progress(self.done, self.total, label, left=left)


@dataclass
class _Samples:
    """A test's timed repetitions as they come."""

    planned: int  # its runs: grows with each repetition --until-ci adds
    samples: list[float] = field(default_factory=list)
    engine: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    phase_tps: list[tuple[float | None, float | None]] = field(default_factory=list)  # pg's
    next_token: int | None = None
    drafted: int = 0  # speculative decoding (bench --draft)
    accepted: int = 0
    steps: int = 0
    spans: Spans | None = None
    traffic: rpc.Traffic | None = None  # bytes to and from --rpc servers (timed reps)
    waited_s: float | None = None  # --rpc: the decodes' wait on the servers (timed reps)
    stopped: str | None = None  # why --until-ci stopped

    def add(self, shape: Shape, finished: Finished, first: int | None) -> None:
        ours, theirs = _timed(shape, finished)
        self.samples.append(ours)
        self.engine.append(theirs)
        st = finished.stats
        if shape.n_prompt:
            if st.ttft_s is not None:
                self.ttft.append(st.ttft_s)
            self.next_token = first
        if shape.n_gen:
            self.gaps.extend(st.itl_s)
            self.drafted += st.draft_tokens
            self.accepted += st.accepted_tokens
            self.steps += st.decode_steps
            if st.rpc_decode_wait_s is not None:
                self.waited_s = (self.waited_s or 0.0) + st.rpc_decode_wait_s
        if shape.n_prompt and shape.n_gen:
            self.phase_tps.append((st.prompt_tps, st.output_tps))

    def speculation(self, draft: int) -> Speculation | None:
        if not draft:
            return None
        drafted, steps = self.drafted, self.steps
        return Speculation(
            draft=draft,
            acceptance_rate=round(self.accepted / drafted, 4) if drafted else None,
            tokens_per_step=round(len(self.gaps) / steps, 4) if steps else None,
        )

    def phases(self) -> Phases | None:
        """pg blends two phases: each one's own rate as well."""
        if not self.phase_tps:
            return None
        pp = [p for p, _ in self.phase_tps if p]
        tg = [g for _, g in self.phase_tps if g]
        return Phases(
            pp_ts=round(statistics.fmean(pp), 6) if pp else None,
            tg_ts=round(statistics.fmean(tg), 6) if tg else None,
        )


def run_bench(
    runner: BenchRunner,
    plan: BenchPlan,
    *,
    base: EngineConfig,
    cancel: threading.Event | None = None,
) -> Iterator[Result | Skipped | Progress]:
    """Run the plan's tests on `runner`, each configuration over `base`; yields results as
    they finish.

    Stops at the next token when `cancel` is set (raising nothing: the iterator just ends after
    the results so far). Configurations the engine cannot use are yielded as `Skipped`. With
    --until-ci, the progress total grows by each repetition added.
    """
    cancel = cancel or threading.Event()
    ctx = plan.context
    count = _Count(plan)
    for i_combo, (combo, shapes) in enumerate(plan.tests):
        asked = plan.n_ctx if combo.n_batch != base.n_batch else None
        loaded: LocalLoaded | str | None = _check_combo(combo, asked)  # None: it may run
        if loaded is None:
            yield Progress(
                count.done,
                count.total,
                f"setting up {combo.describe()}".strip(),
                moment="preparing",
                left=count.left(i_combo, -1, 0),
            )
            loaded = _reconfigure(runner, combo.config(base, ctx))
        if isinstance(loaded, str):
            yield Skipped(combo, None, loaded)
            left = count.left(i_combo, len(shapes), 0)
            yield count.skip(len(shapes) * plan.per_test, combo.describe(), left)
            continue
        kv = kv_bytes_per_position(runner, combo.type_k, combo.type_v)
        for i_shape, shape in enumerate(shapes):
            left = count.left(i_combo, i_shape, plan.per_test - 1)
            if shape.n_ctx_needed > loaded.settings.n_ctx:
                need, have = shape.n_ctx_needed, loaded.settings.n_ctx
                yield Skipped(combo, shape, f"needs {need} tokens of context, it holds {have}")
                yield count.skip(plan.per_test, shape.name, left)
                continue
            if plan.delay_s and cancel.wait(plan.delay_s):  # llama-bench's --delay
                return
            start = count.done
            got = _Samples(plan.per_test)
            when = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            cpu0 = cpu_sample()
            try:
                yield from _repeat(
                    runner, plan, combo, shape, cancel, count, got, (i_combo, i_shape)
                )
            except Interrupted:
                return
            except LlmrunError as e:
                yield Skipped(combo, shape, str(e))
                yield count.skip(start + got.planned - count.done, shape.name, left)
                continue
            yield Result(
                shape=shape,
                combo=combo,
                model=loaded.model,
                settings=loaded.settings,
                load_s=loaded.load_s,
                samples_s=tuple(got.samples),
                engine_samples_s=tuple(got.engine),
                ttft_s=tuple(got.ttft),
                itl_s=tuple(got.gaps),
                next_token=got.next_token if shape.n_gen == 0 else None,
                test_time=when,
                kv_bytes_per_pos=kv,
                background_cpus=measured_background(cpu0, cpu_sample()),
                speculation=got.speculation(combo.draft),
                phases=got.phases(),
                until_ci_pct=None if plan.until_ci is None else plan.until_ci.pct,
                until_ci_stop=got.stopped,
                energy=None if plan.meter is None else _energy(plan.meter, shape, got.spans),
                rpc_traffic=got.traffic,
                rpc_wait_s=got.waited_s,
            )


def _reconfigure(runner: BenchRunner, config: EngineConfig) -> LocalLoaded | str:
    """The runner on a configuration, or why llama.cpp refused it."""
    try:
        return runner.reconfigure(config)
    except ModelLoadError as e:
        return f"llama.cpp refused it: {e.detail}"
    except LlmrunError as e:
        return str(e)


def _repeat(
    runner: BenchRunner,
    plan: BenchPlan,
    combo: Combo,
    shape: Shape,
    cancel: threading.Event,
    count: _Count,
    got: _Samples,
    at: tuple[int, int],
) -> Iterator[Progress]:
    """One test's repetitions (its warm-up first) into `got`, with their progress."""
    rng = random.Random(plan.seed)
    until_ci, reps, per_test, meter = plan.until_ci, plan.reps, plan.per_test, plan.meter
    began = time.monotonic()
    for rep in itertools.count():
        if rep >= per_test:
            if until_ci is None:
                break
            rates = [(shape.n_prompt + shape.n_gen) / x for x in got.samples if x > 0]
            got.stopped = until_ci.stop(rates, time.monotonic() - began)
            if got.stopped is not None:
                break
            got.planned += 1
            count.total += 1
        timed = rep + 1 - (per_test - reps)
        which = f"rep {timed}/{reps}" if timed > 0 else "warm-up"
        if timed > reps:
            which = f"rep {timed} (until ±{until_ci.pct:g} %)" if until_ci else which
        label = f"{shape.name} {which} {combo.describe()}".strip()
        still = count.left(*at, rep)
        yield Progress(count.done, count.total, label, shape.name, "started", 0.0, still)
        before = rpc.traffic()
        run = _repetition(runner, shape, rng, cancel, combo.draft, meter)
        while True:
            try:
                share = next(run)
            except StopIteration as end:
                finished, first = end.value
                break
            yield Progress(count.done, count.total, label, shape.name, "working", share, still)
        count.done += 1
        yield Progress(count.done, count.total, label, shape.name, "ended", 1.0, still)
        if plan.warmup and rep == 0:
            continue
        after = rpc.traffic()
        if before is not None and after is not None and not shape.n_depth:
            moved = after.since(before)  # a depth's fill would count too: none
            got.traffic = moved if got.traffic is None else moved.plus(got.traffic)
        if meter is not None:
            one = meter.spans(finished.stats)
            got.spans = one if got.spans is None else got.spans.plus(one)
        got.add(shape, finished, first)


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
