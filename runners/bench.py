"""llama-bench's method on the runner, plus what llama-bench leaves out.

Tests are llama-bench's shapes: `pp` (prompt processing: n_prompt random tokens), `tg` (text
generation: n_gen tokens one at a time) and `pg` (both), each optionally at a depth (n_depth
tokens already in the KV cache, evaluated untimed before every repetition). Every repetition
starts from a cleared cache with tokens drawn from a fixed seed, ignores end-of-sequence, and is
timed at the phase boundaries the runner already measures; one warm-up run precedes them.
What is added: time to first token for prompt tests, the inter-token latency distribution for
generation tests, llama.cpp's own counters for the same runs, the model load time, and
efficiency against the machine (memory bandwidth share for decode, FLOP/s for prefill).

No terminal code: `run_bench` yields results and progress; the CLI draws them.
"""

from __future__ import annotations

import datetime as dt
import itertools
import random
import re
import statistics
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from .base import BenchRunner, Finished, Request, SamplingParams, Token
from .errors import BadRequestError, LlmrunError, ModelLoadError
from .llamacpp import CACHE_TYPES, FLASH_ATTN, EngineConfig, llama_lib
from .stats import EngineSettings, ModelInfo, human_count, percentile
from .system import background_cpus, busy_machine, cpu_sample

# Bytes per element of each KV cache type (blocks of 32 for the quantized ones).
CACHE_TYPE_BYTES = {
    "f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32, "q4_1": 20 / 32,
    "iq4_nl": 18 / 32, "q5_0": 22 / 32, "q5_1": 24 / 32,
}  # fmt: skip

# LocalScore's scenario matrix (prompt tokens, generated tokens).
LOCALSCORE_SCENARIOS = (
    (1024, 16), (4096, 256), (2048, 256), (2048, 768), (1024, 1024), (1280, 3072),
    (384, 1152), (64, 1024), (16, 1536),
)  # fmt: skip
DEFAULT_SCENARIO_SCALE = 1 / 16


MAX_SWEEP_VALUES = 1000


def parse_values(text: str, *, name: str, minimum: int = 0, maximum: int = 1 << 24) -> list[int]:
    """llama-bench's list syntax: `1,2,4`, ranges `8-512*4` (times) and `0-24+8` (plus).

    Every value must lie in minimum..maximum (sizes are never negative; -ngl allows -1)."""
    values: list[int] = []
    for part in text.split(","):
        part = part.strip()
        m = re.fullmatch(r"(-?\d+)(?:-(\d+)(?:([*+])(\d+))?)?", part)
        if not m:
            raise BadRequestError(f"{name}: '{part}' is not a number, list or range like 8-512*4")
        first = int(m.group(1))
        if m.group(2) is None:
            values.append(first)
            continue
        last, op, step = int(m.group(2)), m.group(3) or "+", int(m.group(4) or 1)
        if (op == "*" and (step < 2 or first < 1)) or (op == "+" and step < 1) or last < first:
            raise BadRequestError(f"{name}: the range '{part}' never ends or is empty")
        value = first
        while value <= last and len(values) <= MAX_SWEEP_VALUES:
            values.append(value)
            value = value * step if op == "*" else value + step
        if len(values) > MAX_SWEEP_VALUES:
            raise BadRequestError(f"{name}: '{part}' gives more than {MAX_SWEEP_VALUES} values")
    for value in values:
        if not minimum <= value <= maximum:
            raise BadRequestError(f"{name}: {value} is out of range {minimum}..{maximum}")
    return list(dict.fromkeys(values))


def parse_words(text: str, *, name: str, allowed: Sequence[str]) -> list[str]:
    """A comma list of names. Unknown names are kept: the run reports them as skipped."""
    words = [w.strip().lower() for w in text.split(",") if w.strip()]
    if not words:
        raise BadRequestError(f"{name}: give one or more of {', '.join(allowed)}")
    return list(dict.fromkeys(words))


@dataclass(frozen=True)
class Shape:
    n_prompt: int
    n_gen: int
    n_depth: int = 0

    @property
    def name(self) -> str:
        parts = ([f"pp{self.n_prompt}"] if self.n_prompt else []) + (
            [f"tg{self.n_gen}"] if self.n_gen else []
        )
        return "+".join(parts) + (f" @ d{self.n_depth}" if self.n_depth else "")

    @property
    def n_ctx_needed(self) -> int:
        return self.n_depth + max(self.n_prompt, 1) + self.n_gen + 1


@dataclass(frozen=True)
class Combo:
    """One engine configuration of a sweep (None: the engine's default for this machine)."""

    n_threads: int | None = None
    n_batch: int | None = None
    n_ubatch: int | None = None
    n_gpu_layers: int = 0
    flash_attn: str | None = None
    type_k: str = "f16"
    type_v: str = "f16"

    def config(self, base: EngineConfig, n_ctx: int) -> EngineConfig:
        return replace(
            base, n_ctx=n_ctx, n_threads=self.n_threads, n_batch=self.n_batch,
            n_ubatch=self.n_ubatch, n_gpu_layers=self.n_gpu_layers, flash_attn=self.flash_attn,
            cache_type_k=self.type_k, cache_type_v=self.type_v,
        )  # fmt: skip

    def describe(self) -> str:
        """Compact, in llama-bench's short option names: t=2 b=512 ub=512 ngl=0 fa=off."""
        names = {"n_threads": "t", "n_batch": "b", "n_ubatch": "ub", "n_gpu_layers": "ngl",
                 "flash_attn": "fa", "type_k": "ctk", "type_v": "ctv"}  # fmt: skip
        return " ".join(f"{names[k]}={v}" for k, v in vars(self).items() if v is not None)


def sweep(
    *,
    threads: Sequence[int | None],
    batch: Sequence[int | None],
    ubatch: Sequence[int | None],
    gpu_layers: Sequence[int],
    flash_attn: Sequence[str | None],
    type_k: Sequence[str],
    type_v: Sequence[str],
) -> list[Combo]:
    """Every combination, ordered so those sharing loaded weights (GPU layers) run together."""
    return [
        Combo(t, b, u, g, f, k, v)
        for g, t, b, u, f, k, v in itertools.product(
            gpu_layers, threads, batch, ubatch, flash_attn, type_k, type_v
        )
    ]


@dataclass(frozen=True)
class SystemInfo:
    cpu: str
    physical_cores: int
    logical_cpus: int
    ram_bytes: int | None
    build: str  # llama-cpp-python version
    features: str  # llama.cpp's system info line (backends and CPU features)
    gpu: str
    mem_bw_bytes_s: float | None

    @classmethod
    def collect(cls, *, bandwidth: bool = True) -> SystemInfo:
        from . import system

        lib = llama_lib()
        info = lib.llama_print_system_info()
        features = info.decode(errors="replace") if isinstance(info, bytes) else str(info)
        gpu = "offload supported" if lib.llama_supports_gpu_offload() else "none (CPU-only build)"
        return cls(
            cpu=system.cpu_model(),
            physical_cores=system.physical_cores(),
            logical_cpus=system.logical_cpus(),
            ram_bytes=system.ram_bytes(),
            build=f"llama-cpp-python {getattr(lib, '__version__', '?')}",
            features=_features(features),
            gpu=gpu,
            mem_bw_bytes_s=system.memory_bandwidth() if bandwidth else None,
        )


def _features(info: str) -> str:
    """llama.cpp's 'CPU : SSE3 = 1 | AVX = 1 | ...' as 'CPU: SSE3 AVX ...' (the ones it has)."""
    out: list[str] = []
    for part in info.split("|"):
        backend, sep, rest = part.partition(" : ")
        if sep:
            out.append(f"{backend.strip()}:")
            part = rest
        name, eq, value = part.partition("=")
        if eq and value.strip() not in ("0", ""):
            out.append(name.strip())
        elif not eq and part.strip():
            out.append(part.strip())
    return " ".join(out)


@dataclass(frozen=True)
class Result:
    """One test on one configuration: every repetition's time and what llama.cpp counted."""

    shape: Shape
    combo: Combo
    model: ModelInfo
    settings: EngineSettings  # what actually ran
    load_s: float
    samples_s: tuple[float, ...]  # timed seconds per repetition
    engine_samples_s: tuple[float, ...]  # llama.cpp's own time for the same work
    ttft_s: tuple[float, ...] = ()  # per repetition, tests with a prompt
    itl_s: tuple[float, ...] = ()  # every gap of every repetition, tests that generate
    next_token: int | None = None  # the greedy token after the prompt (pp tests)
    test_time: str = ""
    kv_bytes_per_pos: float = 0.0
    background_cpus: float | None = None  # other processes' load over the test's repetitions
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def n_tokens(self) -> int:
        return self.shape.n_prompt + self.shape.n_gen

    @property
    def samples_ts(self) -> list[float]:
        return [self.n_tokens / s for s in self.samples_s if s > 0]

    @property
    def avg_ts(self) -> float:
        return statistics.fmean(self.samples_ts) if self.samples_ts else 0.0

    @property
    def stddev_ts(self) -> float:
        return statistics.stdev(self.samples_ts) if len(self.samples_ts) > 1 else 0.0

    @property
    def engine_avg_ts(self) -> float | None:
        rates = [self.n_tokens / s for s in self.engine_samples_s if s > 0]
        return statistics.fmean(rates) if rates else None

    def bytes_per_token(self) -> float:
        """Decode reads every weight once per token, plus the KV cache of the context so far."""
        s = self.shape
        avg_context = s.n_depth + max(s.n_prompt, 1) + s.n_gen / 2
        return self.model.size_bytes + self.kv_bytes_per_pos * avg_context

    def record(self, system: SystemInfo) -> dict[str, Any]:
        """llama-bench's fields, then llmrun's own."""
        m, st, s = self.model, self.settings, self.shape
        samples_ns = [round(x * 1e9) for x in self.samples_s]
        avg_ns = statistics.fmean(samples_ns) if samples_ns else 0.0
        std_ns = statistics.stdev(samples_ns) if len(samples_ns) > 1 else 0.0
        rec: dict[str, Any] = {
            "build_commit": system.build,
            "build_number": 0,
            "cpu_info": system.cpu,
            "gpu_info": system.gpu,
            "backends": st.backend,
            "model_filename": m.path,
            "model_type": f"{m.architecture} {human_count(m.n_params)} {m.quantization}",
            "model_size": m.size_bytes,
            "model_n_params": m.n_params,
            "n_batch": st.n_batch,
            "n_ubatch": st.n_ubatch,
            "n_threads": st.n_threads,
            "type_k": st.type_k,
            "type_v": st.type_v,
            "n_gpu_layers": st.n_gpu_layers,
            "flash_attn": st.flash_attn,
            "n_prompt": s.n_prompt,
            "n_gen": s.n_gen,
            "n_depth": s.n_depth,
            "test_time": self.test_time,
            "avg_ns": round(avg_ns),
            "stddev_ns": round(std_ns),
            "avg_ts": round(self.avg_ts, 6),
            "stddev_ts": round(self.stddev_ts, 6),
            "samples_ns": samples_ns,
            "samples_ts": [round(x, 6) for x in self.samples_ts],
            # llmrun's own
            "test": s.name,
            "load_ms": round(self.load_s * 1000, 3),
            "ttft_ms": round(statistics.fmean(self.ttft_s) * 1000, 3) if self.ttft_s else None,
            "itl_p50_ms": _ms(percentile(self.itl_s, 50)),
            "itl_p99_ms": _ms(percentile(self.itl_s, 99)),
            "engine_avg_ts": round(self.engine_avg_ts, 6) if self.engine_avg_ts else None,
            "next_token": self.next_token,
            "mem_bw_gbs": round(system.mem_bw_bytes_s / 1e9, 3) if system.mem_bw_bytes_s else None,
            "decode_bw_gbs": None,
            "bw_util": None,
            "prefill_gflops": None,
            "background_cpus": _round(self.background_cpus, 3),
            "busy": busy_machine(self.background_cpus, st.n_threads),
        }
        if s.n_gen and not s.n_prompt and self.avg_ts:
            moved = self.bytes_per_token() * self.avg_ts
            rec["decode_bw_gbs"] = round(moved / 1e9, 3)
            if system.mem_bw_bytes_s:
                rec["bw_util"] = round(moved / system.mem_bw_bytes_s, 4)
        if s.n_prompt and not s.n_gen and self.avg_ts:
            rec["prefill_gflops"] = round(2 * m.n_params * self.avg_ts / 1e9, 3)
        rec.update(self.extra)
        return rec


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 4)


@dataclass(frozen=True)
class Skipped:
    combo: Combo
    shape: Shape | None  # None: the whole configuration could not run
    reason: str


@dataclass(frozen=True)
class Progress:
    done: int  # timed or warm-up runs finished
    total: int
    label: str


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


def _check_combo(combo: Combo, n_ctx: int) -> str | None:
    """Why the engine cannot use this configuration, or None."""
    for name, value in (("cache-type-k", combo.type_k), ("cache-type-v", combo.type_v)):
        if value not in CACHE_TYPES:
            return f"unknown {name} '{value}' (known: {', '.join(CACHE_TYPES)})"
    if combo.flash_attn is not None and combo.flash_attn not in FLASH_ATTN:
        return f"unknown flash-attn '{combo.flash_attn}' (known: {', '.join(FLASH_ATTN)})"
    if combo.n_batch is not None and combo.n_batch > n_ctx:
        return f"batch {combo.n_batch} is larger than the context ({n_ctx} tokens)"
    if combo.n_ubatch is not None and combo.n_batch is not None and combo.n_ubatch > combo.n_batch:
        return f"ubatch {combo.n_ubatch} is larger than batch {combo.n_batch}"
    if combo.n_threads is not None and combo.n_threads < 1:
        return "threads must be at least 1"
    return None


def _gpu_layers_problem(runner: BenchRunner, combo: Combo) -> str | None:
    header = runner.header()
    n_layer = int(header.metadata.get(f"{header.architecture}.block_count", 0) or 0)
    if combo.n_gpu_layers > n_layer + 1:
        return (f"{combo.n_gpu_layers} GPU layers, but the model has {n_layer + 1} (layers +"
                " output; -1 offloads all)")  # fmt: skip
    return None


def _one_run(
    runner: BenchRunner, shape: Shape, rng: random.Random, cancel: threading.Event
) -> tuple[Finished, int | None]:
    """One repetition from a cleared cache; returns the result and the first output token."""
    n_vocab = runner.vocab_size()
    runner.reset()
    depth = [rng.randrange(n_vocab) for _ in range(shape.n_depth)]
    if depth:
        runner.eval_tokens(depth, cancel=cancel)  # untimed; the request below shares this prefix
        if cancel.is_set():
            raise Interrupted
    prompt = [rng.randrange(n_vocab) for _ in range(max(shape.n_prompt, 1))]
    if shape.n_gen == 0:
        max_tokens = 1  # the first sample gives TTFT and the next token
    elif shape.n_prompt == 0:
        max_tokens = shape.n_gen + 1  # one token to start from, then n_gen timed steps
    else:
        max_tokens = shape.n_gen
    request = Request(
        token_ids=tuple(depth + prompt),
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
        keep_cache=True,
    )
    finished: Finished | None = None
    first: int | None = None
    for event in runner.stream(request, cancel=cancel):
        if isinstance(event, Token) and first is None:
            first = event.token_id
        elif isinstance(event, Finished):
            finished = event
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
    cancel: threading.Event | None = None,
) -> Iterator[Result | Skipped | Progress]:
    """Run every shape on every configuration; yields results as they finish.

    Stops at the next token when `cancel` is set (raising nothing: the iterator just ends after
    the results so far). Configurations the engine cannot use are yielded as `Skipped`.
    """
    cancel = cancel or threading.Event()
    # As llama-bench: the context the tests need; at least the largest batch, so a default run
    # reports the batch that was asked for (llama.cpp caps n_batch at n_ctx).
    batches = [c.n_batch or 0 for c in combos] + [base.n_batch or 512]
    ctx = n_ctx or max(256, max(s.n_ctx_needed for s in shapes), *batches)
    per_test = reps + (1 if warmup else 0)
    total = len(combos) * len(shapes) * per_test
    done = 0
    for combo in combos:
        problem = _check_combo(combo, ctx)
        if problem is None:
            try:
                loaded = runner.reconfigure(combo.config(base, ctx))
                problem = _gpu_layers_problem(runner, combo)
            except ModelLoadError as e:
                problem = f"llama.cpp refused it: {e.detail}"
            except LlmrunError as e:
                problem = str(e)
        if problem is not None:
            done += len(shapes) * per_test
            yield Skipped(combo, None, problem)
            yield Progress(done, total, combo.describe())
            continue
        kv = kv_bytes_per_position(runner, combo.type_k, combo.type_v)
        for shape in shapes:
            if shape.n_ctx_needed > loaded.settings.n_ctx:
                done += per_test
                need, have = shape.n_ctx_needed, loaded.settings.n_ctx
                yield Skipped(combo, shape, f"needs {need} tokens of context, it holds {have}")
                continue
            rng = random.Random(seed)
            samples: list[float] = []
            engine: list[float] = []
            ttft: list[float] = []
            gaps: list[float] = []
            phase_tps: list[tuple[float | None, float | None]] = []  # pg: (prompt, gen)
            next_token: int | None = None
            start = done
            when = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            cpu0 = cpu_sample()
            try:
                for rep in range(per_test):
                    finished, first = _one_run(runner, shape, rng, cancel)
                    done += 1
                    yield Progress(done, total, f"{shape.name} {combo.describe()}".strip())
                    if warmup and rep == 0:
                        continue
                    ours, theirs = _timed(shape, finished)
                    samples.append(ours)
                    engine.append(theirs)
                    if shape.n_prompt:
                        if finished.stats.ttft_s is not None:
                            ttft.append(finished.stats.ttft_s)
                        next_token = first
                    if shape.n_gen:
                        gaps.extend(finished.stats.itl_s)
                    if shape.n_prompt and shape.n_gen:
                        st = finished.stats
                        phase_tps.append((st.prompt_tps, st.output_tps))
            except Interrupted:
                return
            except LlmrunError as e:
                done = start + per_test
                yield Skipped(combo, shape, str(e))
                continue
            extra: dict[str, Any] = {}
            if phase_tps:  # pg blends two phases; keep each one's own rate as well
                pp = [p for p, _ in phase_tps if p]
                tg = [g for _, g in phase_tps if g]
                extra["pp_ts"] = round(statistics.fmean(pp), 6) if pp else None
                extra["tg_ts"] = round(statistics.fmean(tg), 6) if tg else None
            yield Result(
                shape=shape, combo=combo, model=loaded.model, settings=loaded.settings,
                load_s=loaded.load_s, samples_s=tuple(samples), engine_samples_s=tuple(engine),
                ttft_s=tuple(ttft), itl_s=tuple(gaps),
                next_token=next_token if shape.n_gen == 0 else None, test_time=when,
                kv_bytes_per_pos=kv, background_cpus=background_cpus(cpu0, cpu_sample()),
                extra=extra,
            )  # fmt: skip


def scenario_shapes(scale: float) -> list[Shape]:
    """LocalScore's matrix scaled down (at least 4 prompt and 4 generated tokens each)."""
    return [
        Shape(max(4, round(p * scale)), max(4, round(g * scale))) for p, g in LOCALSCORE_SCENARIOS
    ]


def localscore(results: Sequence[Result]) -> float | None:
    """LocalScore's formula: 10 · cbrt(mean prompt tok/s · mean gen tok/s · 1000 / mean TTFT ms).

    Prompt and generation rates are the phases' own (prefill alone, decode alone), from the
    scenario runs.
    """
    prompt, gen, ttft = [], [], []
    for r in results:
        prompt += [r.extra["pp_ts"]] if r.extra.get("pp_ts") else []
        gen += [r.extra["tg_ts"]] if r.extra.get("tg_ts") else []
        ttft += list(r.ttft_s)
    if not (prompt and gen and ttft):
        return None
    mean_ttft_ms = statistics.fmean(ttft) * 1000
    return 10 * (statistics.fmean(prompt) * statistics.fmean(gen) * 1000 / mean_ttft_ms) ** (1 / 3)
