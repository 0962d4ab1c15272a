"""A llama-bench run: every model, every context size and combination of settings, and the
perplexity on a text when asked. It yields what happens (a model ready, progress, results,
skips, perplexity) as typed events; the terminal is the caller's."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmrun.runners import devices as dv
from llmrun.runners import history as hist
from llmrun.runners import perplexity as ppl
from llmrun.runners.base import BenchRunner
from llmrun.runners.config import LAZY_MODES, LOAD_MODES, EngineConfig
from llmrun.runners.errors import BadRequestError, CancelledError, OptionError
from llmrun.runners.files import read_option_file
from llmrun.runners.kld import KldBase, KldStats
from llmrun.runners.limits import CACHE_TYPES, FLASH_ATTN
from llmrun.runners.lists import share
from llmrun.runners.probe import repack_verdict
from llmrun.runners.significance import record_fields
from llmrun.runners.system import SystemInfo
from llmrun.runners.threadpool import DEFAULT_POLL, ThreadpoolSettings

from . import localscore as ls
from . import sweep as sw
from .measure import BenchPlan, Progress, Skipped, UntilCi, run_bench
from .results import OPTIONAL_FIELDS, RELATIVE_FIELDS, Perplexity, Result, Row

if TYPE_CHECKING:
    from llmrun.runners.energy import PhaseMeter

PPL_CTX = 512  # llama-perplexity's windows when -c is not given
_ONE_OF_CACHE_TYPES = f"one of {', '.join(CACHE_TYPES)}"  # a name llama.cpp has no type for


def parse_shapes(
    n_prompt: str, n_gen: str, pg: Sequence[str], depth: str, scenarios: bool, scale: float
) -> list[sw.Shape]:
    depths = sw.parse_values(depth, name="-d/--n-depth")
    if scenarios:
        return ls.scenario_shapes(scale)
    prompts = [p for p in sw.parse_values(n_prompt, name="-p") if p]
    gens = [n for n in sw.parse_values(n_gen, name="-n") if n]
    pairs = []
    for pair in pg:
        values = sw.parse_values(pair, name="--pg")
        if len(values) != 2:
            raise OptionError(f"--pg: give PROMPT,GEN such as 512,128, not '{pair}'")
        pairs.append(values)
    # as llama-bench: at each depth, the pp tests, then tg, then pg
    shapes = [
        shape
        for slot, d in enumerate(depths)
        for shape in [
            *(sw.Shape(p, 0, d, slot) for p in prompts),
            *(sw.Shape(0, n, d, slot) for n in gens),
            *(sw.Shape(p, n, d, slot) for p, n in pairs if p or n),
        ]
    ]
    if not shapes:
        raise BadRequestError("no test to run: -p, -n and --pg are all 0 or empty")
    return shapes


def optional_ints(text: str | None, name: str, default: int | None) -> list[int | None]:
    return [default] if text is None else list(sw.parse_values(text, name=name))


def _given(
    text: str | None, default: Any, parse: Callable[..., list[Any]], **how: Any
) -> list[Any]:
    """An option's list (`parse`d, as `how` says), else the default alone."""
    return parse(text, **how) if text else [default]


def _split(text: str) -> list[str]:
    return [part.strip() for part in text.split(",")]


@dataclass(frozen=True)
class Sweep:
    """What a llama-bench-style run measures, as the options gave it."""

    shapes: list[sw.Shape]
    threads: str | None
    batch: str | None
    ubatch: str | None
    gpu_layers: str | None
    flash_attn: str | None
    cache_type_k: str
    cache_type_v: str
    reps: int
    ctx: str | None  # context sizes, a list
    seed: int
    scenarios: bool
    repack: str | None = None
    mmap: str | None = None
    direct_io: str | None = None  # older llama-bench's -dio: -lm dio
    load_mode: str | None = None
    no_kv_offload: str | None = None
    warmup: bool = True
    delay_s: float = 0.0
    tuned: bool = False  # llmrun's settings (`llmrun tune`'s, else its own) for llama-bench's
    ppl: Path | None = None  # a text to measure each model's perplexity on
    kld: bool = False  # with ppl: each later model's KL divergence from the first's (runners/kld)
    cold: bool = False  # evict the model file from the page cache before each load
    split_mode: str | None = None  # GPU builds: llama-bench's -sm, -mg, -ts lists
    main_gpu: str | None = None
    tensor_split: str | None = None
    tensor_overrides: str | None = None  # -ot sets, ","-separated; ";" within a set
    n_cpu_moe: str | None = None
    devices: str | None = None
    draft: str | None = None  # speculative decoding in the tg tests: a list of draft lengths
    cpu_mask: str | None = None  # llama-bench's threadpool lists: -C, --cpu-strict, --poll
    cpu_strict: str | None = None
    poll: str | None = None
    prio: int = 0  # the compute threads' priority (--prio), in every test
    fit_target: str | None = None  # llama-bench's -fitt/-fitc lists: recorded, not applied
    fit_ctx: str | None = None
    lazy_mode: str | None = None  # llama-bench's -lzm, --no-host, -embd and -nopo lists
    no_host: str | None = None
    embeddings: str | None = None
    no_op_offload: str | None = None
    until_ci: str | None = None  # --until-ci PCT[,SECONDS]: repeat until the interval is narrow
    energy: str = "auto"  # --energy: on (a counter must be readable), auto, off
    rpc: tuple[str, ...] = ()  # llama-bench's -rpc: RPC servers for every test (runners/rpc.py)

    def until(self) -> UntilCi | None:
        return None if self.until_ci is None else UntilCi.parse(self.until_ci)

    def _gpu_lists(self) -> dict[str, list[Any]]:
        """The -sm, -mg, -ts, -ot, -ncmoe, -dev, --draft, -fitt and -fitc values given."""
        modes = _given(
            self.split_mode,
            None,
            sw.parse_words,
            name="-sm",
            allowed=("none", "layer", "row", "tensor"),
            refuse="none, layer, row or tensor",
        )
        gpus = _given(self.main_gpu, None, sw.parse_values, name="-mg")
        splits: list[str | None] = [None]
        if self.tensor_split:
            splits = []
            for part in self.tensor_split.split(","):
                values = part.strip().split("/")
                if not all(share(v) is not None for v in values):
                    raise OptionError(f"-ts: '{part}' is not shares such as 3/1")
                splits.append(part.strip())
        overrides = _given(self.tensor_overrides, None, _split)
        for group in overrides:  # refused before any model loads, not once per test
            dv.tensor_overrides(group)
        return {
            "split_mode": modes,
            "main_gpu": gpus,
            "tensor_split": splits,
            "tensor_overrides": overrides,
            "n_cpu_moe": _given(
                self.n_cpu_moe, 0, sw.parse_values, name="-ncmoe", maximum=dv.MAX_LAYERS
            ),
            "devices": _given(self.devices, None, _split),
            "draft": _given(self.draft, 0, sw.parse_values, name="--draft", maximum=64),
            "fit_target": sw.parse_values(self.fit_target or "0", name="-fitt/--fit-target"),
            "fit_min_ctx": sw.parse_values(self.fit_ctx or "0", name="-fitc/--fit-ctx"),
        }

    def _threadpool_lists(self) -> dict[str, list[Any]]:
        """The -C, --cpu-strict and --poll values given; a mask that is not hex or names no CPU
        of this process is refused here."""
        masks = _given(self.cpu_mask, "0x0", _split)
        for mask in masks:
            ThreadpoolSettings(cpu_mask=mask).placement(1)
        return {
            "cpu_mask": masks,
            "cpu_strict": _given(self.cpu_strict, False, sw.parse_bools, name="--cpu-strict"),
            "poll": _given(self.poll, DEFAULT_POLL, sw.parse_values, name="--poll", maximum=100),
        }

    def _llama_params(self) -> dict[str, Any]:
        """-lzm, --no-host, -embd and -nopo: each value given, else llama.cpp's default."""
        lazy = _given(
            self.lazy_mode,
            "auto",
            sw.parse_words,
            name="-lzm/--lazy-mode",
            allowed=tuple(LAZY_MODES.values()),
            refuse="on, auto or off",
        )
        flags = {
            "no_host": (self.no_host, "--no-host"),
            "embeddings": (self.embeddings, "-embd/--embeddings"),
            "no_op_offload": (self.no_op_offload, "-nopo/--no-op-offload"),
        }
        return {"lazy_mode": lazy} | {
            key: _given(text, False, sw.parse_bools, name=name)
            for key, (text, name) in flags.items()
        }

    def inside_depth(self) -> int:
        """How many settings llama-bench loops inside the depth: --poll's values."""
        return len(_given(self.poll, None, sw.parse_values, name="--poll"))

    def contexts(self) -> list[int | None]:
        return _given(self.ctx, None, sw.parse_values, name="-c/--ctx", minimum=1)

    def combos(self, base: EngineConfig) -> list[sw.Combo]:
        """Every engine setting to test; unset options take the base's (llama-bench's defaults,
        or with --tuned llmrun's). A tuned ubatch never costs a requested batch size: it is
        capped at each batch."""
        flash = _given(
            self.flash_attn,
            base.flash_attn,
            sw.parse_words,
            name="-fa/--flash-attn",
            allowed=FLASH_ATTN,
            aliases=sw.FLASH_ATTN_ALIASES,
            refuse="on, off or auto (or 1, 0, -1)",
        )
        modes: list[str | None] = []  # none of -mmp, -dio, -lm: [None] (a list has a value)
        if self.mmap:
            modes += [("mmap" if on else "none") for on in sw.parse_bools(self.mmap, name="-mmp")]
        if self.direct_io:
            dio = sw.parse_bools(self.direct_io, name="-dio/--direct-io")
            modes += [("dio" if on else "auto") for on in dio]
        if self.load_mode:
            modes += sw.parse_words(
                self.load_mode,
                name="-lm",
                allowed=tuple(LOAD_MODES),
                refuse=", ".join(LOAD_MODES),
            )
        combos = sw.sweep(
            n_threads=optional_ints(self.threads, "-t", base.n_threads),
            n_batch=optional_ints(self.batch, "-b", base.n_batch),
            n_ubatch=optional_ints(self.ubatch, "--ubatch", base.n_ubatch),
            n_gpu_layers=_given(
                self.gpu_layers, base.n_gpu_layers, sw.parse_values, name="-ngl", minimum=-1
            ),
            flash_attn=flash,
            type_k=sw.parse_words(
                self.cache_type_k, name="-ctk", allowed=CACHE_TYPES, refuse=_ONE_OF_CACHE_TYPES
            ),
            type_v=sw.parse_words(
                self.cache_type_v, name="-ctv", allowed=CACHE_TYPES, refuse=_ONE_OF_CACHE_TYPES
            ),
            repack=_given(self.repack, None, sw.parse_bools, name="--repack"),
            no_kv_offload=_given(self.no_kv_offload, False, sw.parse_bools, name="-nkvo"),
            load_mode=modes or [None],
            **self._llama_params(),
            **self._gpu_lists(),
            **self._threadpool_lists(),
        )
        # llama.cpp clamps n_ubatch to n_batch; llama-bench records its 512 as given, and so
        # does llmrun, except for a tuned ubatch, which is capped at each batch asked for
        if self.ubatch is None and base.tuned and base.n_ubatch is not None:
            combos = [
                replace(c, n_ubatch=min(c.n_ubatch, c.n_batch)) if c.n_ubatch and c.n_batch else c
                for c in combos
            ]
        return combos


@dataclass(frozen=True)
class ModelReady:
    """A model's runner, before its tests: the caller loads it and shows its header."""

    runner: BenchRunner
    combos: tuple[sw.Combo, ...]


@dataclass(frozen=True)
class Scoring:
    """The perplexity of the model just measured is being computed."""

    text: Path


@dataclass(frozen=True)
class Scored:
    """A model's perplexity on the --ppl text."""

    model: str
    ppl: float
    tokens: int  # tokens scored
    n_vocab: int = 0  # perplexities over different vocabularies are not comparable
    kld: KldStats | None = None  # with --kld, a later model's against the first
    kld_missing: str | None = None  # with --kld, why a later model has none


SweepEvent = ModelReady | Progress | Result | Skipped | Scoring | Scored


def read_text(path: Path, cancel: threading.Event) -> str | None:
    """The --ppl text, read once (a FIFO can be read only once); None when Ctrl-C or SIGTERM
    came first."""
    try:  # wikitext-2's test set is 1.3 MB; /dev/zero never ends
        data = read_option_file(path, "--ppl", 256 * 2**20, "text file", cancel)
    except CancelledError:
        return None
    return data.decode("utf-8", "replace")


def run_sweep(
    models: Sequence[str | None],
    sweep: Sweep,
    *,
    open_runner: Callable[[str | None, EngineConfig, bool], BenchRunner],
    cancel: threading.Event,
) -> Iterator[SweepEvent]:
    """llama-bench's tests over every combination of settings, for each model in turn."""
    if sweep.kld and (sweep.ppl is None or len(models) < 2):
        raise BadRequestError(
            "--kld compares each later model with the first on --ppl's text:"
            " give --ppl FILE and two or more -m"
        )
    text: str | None = None
    if sweep.ppl is not None:
        window = sweep.contexts()[0] or PPL_CTX
        if window < ppl.MIN_WINDOW:  # said after the speed tests, and of the text, before
            raise OptionError(
                f"-c/--ctx {window}: perplexity's windows need {ppl.MIN_WINDOW} tokens or more"
                " (the second half of each is scored)"
            )
        text = read_text(sweep.ppl, cancel)  # an unreadable text fails before anything runs
        if text is None:
            return
    until_ci = sweep.until()  # a bad --until-ci fails before anything loads
    meter = open_energy(sweep.energy)  # its idle baseline before the first model loads
    base = KldBase() if sweep.kld else None
    try:
        yield from _models(
            models, sweep, until_ci, meter, base, text, open_runner=open_runner, cancel=cancel
        )
    finally:
        if meter is not None:
            meter.close()
        if base is not None:
            base.close()


def open_energy(mode: str) -> PhaseMeter | None:
    """The energy meter --energy asks for: None when off; with `on`, a usage error where no
    counter can be read (auto carries the reason into the records instead)."""
    if mode == "off":
        return None
    from llmrun.runners.energy import open_meter

    meter = open_meter(gpu=True)  # NVML counts only the tests whose layers ran on its GPU
    if mode == "on" and not meter.counters:
        meter.close()
        reasons = "; ".join(meter.reasons.values())
        raise BadRequestError(f"--energy on: no energy counter can be read here ({reasons})")
    return meter


def _models(
    models: Sequence[str | None],
    sweep: Sweep,
    until_ci: UntilCi | None,
    meter: PhaseMeter | None,
    kld_base: KldBase | None,
    text: str | None,
    *,
    open_runner: Callable[[str | None, EngineConfig, bool], BenchRunner],
    cancel: threading.Event,
) -> Iterator[SweepEvent]:
    for model in models:
        if cancel.is_set():
            return
        config = EngineConfig(
            cold=sweep.cold,
            threadpool=ThreadpoolSettings(prio=sweep.prio),
            rpc=",".join(sweep.rpc) or None,
        )
        runner = open_runner(
            model, config if sweep.tuned else config.with_llama_bench_defaults(), sweep.tuned
        )
        try:
            base = runner.config
            combos = without_unsafe_repack(sweep.combos(base), runner)
            yield ModelReady(runner, tuple(combos))
            tokens: list[int] | None = None
            if sweep.ppl is not None and text is not None:  # too short: said before any test
                tokens = _ppl_tokens(runner, text, sweep.contexts()[0] or PPL_CTX, cancel)
                if tokens is None:
                    return
            # llama-bench records the model's file name as given (a local path, not a Hub name)
            given = model if model and os.path.isfile(model) else ""
            for n_ctx in sweep.contexts():
                plan = BenchPlan(
                    tuple(sw.tests(combos, sweep.shapes, sweep.inside_depth())),
                    sweep.reps,
                    n_ctx=n_ctx,
                    seed=sweep.seed,
                    warmup=sweep.warmup,
                    delay_s=sweep.delay_s,
                    until_ci=until_ci,
                    meter=meter,
                )
                for event in run_bench(runner, plan, base=base, cancel=cancel):
                    yield (
                        replace(event, model_filename=given)
                        if given and isinstance(event, Result)
                        else event
                    )
            if sweep.ppl is not None and tokens is not None and not cancel.is_set():
                yield Scoring(sweep.ppl)
                n_ctx = sweep.contexts()[0] or PPL_CTX
                runner.reconfigure(replace(runner.config, n_ctx=n_ctx))
                if kld_base is None:
                    score, n = runner.perplexity(tokens, n_ctx=n_ctx, cancel=cancel)
                    yield Scored(runner.load().model.name, score, n, runner.vocab_size())
                else:
                    yield _scored_with_kld(runner, tokens, n_ctx, cancel, kld_base)
        finally:
            runner.close()


def _ppl_tokens(
    runner: BenchRunner, text: str, n_ctx: int, cancel: threading.Event
) -> list[int] | None:
    """The --ppl text's tokens (None once Ctrl-C came), refused where they do not fill one
    window: the speed tests before the scoring would otherwise run for nothing."""
    tokens = ppl.tokenize_interruptibly(partial(runner.tokenize, add_special=False), text, cancel)
    if tokens is not None and len(tokens) < n_ctx:
        raise BadRequestError(
            f"perplexity needs at least one window of {n_ctx} tokens; the text has {len(tokens)}"
        )
    return tokens


def _scored_with_kld(
    runner: BenchRunner,
    tokens: list[int],
    n_ctx: int,
    cancel: threading.Event,
    base: KldBase,
) -> Scored:
    """The perplexity, and with it the first model's log-probs kept as the base (the first
    model) or this model's KL divergence from them (a later one, where comparable)."""
    n_vocab = runner.vocab_size()
    name = runner.load().model.name
    if not base.tokens:
        base.start(tokens, n_ctx=n_ctx, n_vocab=n_vocab)
        ppl, n = runner.perplexity(tokens, n_ctx=n_ctx, cancel=cancel, each=base.add)
        return Scored(name, ppl, n, n_vocab)
    missing = base.comparable(tokens, n_ctx=n_ctx, n_vocab=n_vocab)
    if missing is not None:
        ppl, n = runner.perplexity(tokens, n_ctx=n_ctx, cancel=cancel)
        return Scored(name, ppl, n, n_vocab, kld_missing=missing)
    comparison = base.compare()
    ppl, n = runner.perplexity(tokens, n_ctx=n_ctx, cancel=cancel, each=comparison.add)
    return Scored(name, ppl, n, n_vocab, kld=comparison.result())


def without_unsafe_repack(combos: list[sw.Combo], runner: BenchRunner) -> list[sw.Combo]:
    """A test that asks for repacking (--repack 1) where the engine will not repack, because
    its probe found llama.cpp's repacked kernels unsafe here, asks nothing: the engine's choice
    and its reason (`off: the probe ...`) are then what the header shows and the record says
    (the header said `repacking on` over a record of `repack false`). The verdict is the
    probe's, which the engine's load reads too (run once, then kept)."""
    if not any(c.repack for c in combos):
        return combos
    if repack_verdict(runner.model_path, runner.header().quantization).safe:
        return combos
    return list(dict.fromkeys(replace(c, repack=None) if c.repack else c for c in combos))


def ppl_change(found: Scored, first: Scored | None) -> float | None:
    """The change against the first model's perplexity where both scored the same tokens (the
    same vocabulary and tokenization of the text); else the two are not comparable: None."""
    if first is None or (found.n_vocab, found.tokens) != (first.n_vocab, first.tokens):
        return None
    return found.ppl / first.ppl - 1


def with_perplexity(results: Sequence[Result], scores: Sequence[Scored], ctx: int) -> list[Result]:
    """Each model's perplexity on its results, with the change against the first model's."""
    by = {s.model: s for s in scores}
    first = scores[0] if scores else None
    return [
        replace(
            r,
            perplexity=Perplexity(
                ppl=found.ppl,
                tokens=found.tokens,
                ctx=ctx,
                change=ppl_change(found, first),
                kld=found.kld,
            ),
        )
        if (found := by.get(r.model.name)) is not None
        else r
        for r in results
    ]


# Every field that only some records carry: their own and the run-wide ones
RECORD_OPTIONAL_FIELDS = (*OPTIONAL_FIELDS, "localscore", "relative_ts", *RELATIVE_FIELDS)

# A record field for each setting of a sweep's combinations (their names, but for -ot's)
COMBO_FIELDS = {
    f.name: "tensor_buft_overrides" if f.name == "tensor_overrides" else f.name
    for f in fields(sw.Combo)
    if f.name != "n_threads_batch"
}


def varied_fields(sweep: Sweep, combos: Sequence[sw.Combo]) -> frozenset[str]:
    """The record fields a run varies (or, for --draft and --ppl, adds), known before its first
    row: llama-bench's markdown chooses its columns from them."""
    fields = {f for a, f in COMBO_FIELDS.items() if len({getattr(c, a) for c in combos}) > 1}
    added = {
        "n_ctx": len(sweep.contexts()) > 1,
        "draft": any(c.draft for c in combos),
        "ppl": sweep.ppl is not None,
        "kld_mean": sweep.kld,
        "until_ci_pct": sweep.until_ci is not None,
    }
    return frozenset(fields | {f for f, on in added.items() if on})


# A test is "the same" across models when these agree: its shape and every setting its record
# carries (each of a combination's, -ot's under its record name, the context and the batch
# threads), so that a row is compared with the first model's row that differs in the model alone
# (`-m a -m b -nkvo 0,1`: b's -nkvo 1 row with a's -nkvo 1 row, not a's -nkvo 0 one).
SAME_TEST = (
    "n_prompt",
    "n_gen",
    "n_depth",
    *COMBO_FIELDS.values(),
    "n_threads_batch",
    "n_ctx",
)


def same_test(record: dict[str, Any]) -> tuple[Any, ...]:
    """The key that pairs a record with the first model's record of the same test."""
    return tuple(tuple(v) if isinstance(v := record.get(k), list) else v for k in SAME_TEST)


@dataclass(frozen=True)
class Recorded:
    """A result and its record, run-wide figures included, as it leaves the run."""

    result: Result
    record: dict[str, Any]

    @property
    def row(self) -> Row:
        return Row.of(self.result, self.record)


@dataclass
class RecordStream:
    """Each result's record as soon as every figure in it is known, for output that streams as
    llama-bench's does: at once for a plain test; after the model's perplexity with --ppl
    (its rows carry it); at the end with --scenarios (every row carries the run's score).
    `end` lets out whatever is still held, without the figures a failure left unknown."""

    system: SystemInfo
    several_models: bool = False  # each row's speed against the first model's same test
    scenarios: bool = False
    ppl_ctx: int | None = None  # --ppl's window: a model's rows wait for its perplexity
    done: list[Recorded] = field(default_factory=list)
    localscore: float | None = None  # LocalScore's, once the run ended whole (--scenarios)
    _held: list[Result] = field(default_factory=list)
    _scores: list[Scored] = field(default_factory=list)
    _first_model: str | None = None
    _first_rates: dict[tuple[Any, ...], dict[str, Any]] = field(default_factory=dict)

    def add(self, result: Result) -> list[Recorded]:
        if self._first_model is None:
            self._first_model = result.model.name
        if self.scenarios or self.ppl_ctx is not None:
            self._held.append(result)
            return []
        return self._let_out([result])

    def scored(self, score: Scored) -> list[Recorded]:
        """A model's perplexity: its rows, held for it, go out with it."""
        self._scores.append(score)
        if self.scenarios:
            return []
        mine = [r for r in self._held if r.model.name == score.model]
        self._held = [r for r in self._held if r.model.name != score.model]
        return self._let_out(with_perplexity(mine, self._scores, self.ppl_ctx or PPL_CTX))

    def end(self, *, complete: bool) -> list[Recorded]:
        """What is still held: with the run's score when the run ended whole."""
        held, self._held = self._held, []
        if self.ppl_ctx is not None:
            held = with_perplexity(held, self._scores, self.ppl_ctx)
        if self.scenarios and complete:
            self.localscore = ls.localscore(held)
        return self._let_out(held, score=self.localscore)

    def _let_out(self, results: Sequence[Result], score: float | None = None) -> list[Recorded]:
        out = []
        for r in results:
            rec = r.record(self.system)
            if self.scenarios:
                rec["localscore"] = round(score, 3) if score is not None else None
            if self.several_models:
                key = same_test(rec)
                first = r.model.name == self._first_model
                if first:
                    self._first_rates.setdefault(key, rec)
                base = self._first_rates.get(key)
                rate = base["avg_ts"] if base else None
                rec["relative_ts"] = round(rec["avg_ts"] / rate, 4) if rate else None
                found = None if first or base is None else hist.difference(base, rec)
                rec.update(record_fields(found, "relative"))
            out.append(Recorded(r, rec))
        self.done += out
        return out
