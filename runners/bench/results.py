"""One bench test's measurements, and the record llama-bench's tools read (its fields first)."""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

from llmrun.runners.config import DEFAULT_N_BATCH
from llmrun.runners.energy.bench import ENERGY_FIELDS, BenchEnergy
from llmrun.runners.kld import RECORD_FIELDS as KLD_FIELDS
from llmrun.runners.kld import KldStats
from llmrun.runners.rpc import Traffic, rpc_backends, rpc_gpu_info
from llmrun.runners.significance import LogSample
from llmrun.runners.stats import (
    EngineSettings,
    ModelInfo,
    bytes_per_token,
    human_count,
    peak_rss_bytes,
    percentile,
    wait_ms_per_token,
    wait_share,
)
from llmrun.runners.system import SystemInfo, busy_machine, decode_bandwidth, weights_memories

from .sweep import Combo, Shape

# llama-bench's record: its fields in its order, and the SQL type of each (llama-bench.cpp,
# test::get_fields and get_field_type; BOOL is an INTEGER in SQL and true/false in JSON).
LLAMA_BENCH_FIELDS = (
    "build_commit",
    "build_number",
    "cpu_info",
    "gpu_info",
    "backends",
    "model_filename",
    "model_type",
    "model_size",
    "model_n_params",
    "n_batch",
    "n_ubatch",
    "n_threads",
    "cpu_mask",
    "cpu_strict",
    "poll",
    "type_k",
    "type_v",
    "n_gpu_layers",
    "n_cpu_moe",
    "split_mode",
    "main_gpu",
    "no_kv_offload",
    "flash_attn",
    "devices",
    "tensor_split",
    "tensor_buft_overrides",
    "load_mode",
    "lazy_mode",
    "embeddings",
    "no_op_offload",
    "no_host",
    "repack",
    "fit_target",
    "fit_min_ctx",
    "n_prompt",
    "n_gen",
    "n_depth",
    "test_time",
    "avg_ns",
    "stddev_ns",
    "avg_ts",
    "stddev_ts",
)
LLAMA_BENCH_INT = frozenset(
    (
        "build_number",
        "n_batch",
        "n_ubatch",
        "n_threads",
        "poll",
        "model_size",
        "model_n_params",
        "n_gpu_layers",
        "main_gpu",
        "n_prompt",
        "n_gen",
        "n_depth",
        "avg_ns",
        "stddev_ns",
        "no_op_offload",
        "n_cpu_moe",
        "fit_target",
        "fit_min_ctx",
        "flash_attn",
    )
)
LLAMA_BENCH_BOOL = frozenset(("no_kv_offload", "cpu_strict", "embeddings", "no_host", "repack"))
LLAMA_BENCH_REAL = frozenset(("avg_ts", "stddev_ts"))

# llama-bench's flash_attn encoding (llama_flash_attn_type): -1 auto, 0 off, 1 on
FLASH_ATTN_CODES = {"auto": -1, "off": 0, "on": 1}

# What llmrun never changes, so llama.cpp's defaults ran: no CPU mask or strict placement, the
# threadpool's default polling, no MoE experts kept on the CPU, no -fitt/-fitc given (an older
# record lacking a field reads as these).
LLAMA_DEFAULTS: dict[str, Any] = {
    "cpu_mask": "0x0",
    "cpu_strict": False,
    "poll": 50,
    "n_cpu_moe": 0,
    "fit_target": 0,
    "fit_min_ctx": 0,
    "split_mode": "layer",
    "main_gpu": 0,
    "no_kv_offload": False,
    "devices": "auto",
    "tensor_split": "0.00",
    "tensor_buft_overrides": "none",
    "load_mode": "auto",
    "lazy_mode": "auto",
    "embeddings": False,
    "no_op_offload": 0,
    "no_host": False,
}

# How close a test ran to the machine's limits, in the record's order (None where not measured)
EFFICIENCY_FIELDS = (
    "decode_bw_gbs",
    "bw_util",
    "weights_bw_gbs",
    "decode_roofline_ts",
    "mem_bw_source",
    "prefill_gflops",
)


def llmrun_build(commit: str) -> str:
    """llmrun's `build_commit`: the llama.cpp commit, in capitals (`0c1e570` is `0C1E570`).

    compare-llama-bench.py pairs rows on the exact `build_commit` (its -b and -c choose one
    each) and cuts every commit to the shortest stored, so a longer label would merge the two
    tools' rows again; a hash in capitals keeps the length and the commit, and git never writes
    one. A hash without a letter ends instead in G to P for its last digit 0 to 9."""
    if commit and not any(c.isalpha() for c in commit) and commit[-1] in "0123456789":
        return commit[:-1] + "GHIJKLMNOP"[int(commit[-1])]
    return commit.upper()


# A test's kind: prompt processing alone, generation alone, or a prompt then generation (--pg)
Kind = Literal["pp", "tg", "pg"]


@dataclass(frozen=True)
class Speculation:
    """Prompt-lookup drafting in a generation test: how much of it the model accepted."""

    draft: int  # at most this many drafted tokens a step
    acceptance_rate: float | None
    tokens_per_step: float | None


@dataclass(frozen=True)
class Phases:
    """A pp+tg test's two phases, each at its own rate (the test's t/s blends them)."""

    pp_ts: float | None
    tg_ts: float | None


@dataclass(frozen=True)
class Perplexity:
    """The model's perplexity on --ppl's text (llama-perplexity's method)."""

    ppl: float
    tokens: int  # tokens scored
    ctx: int  # window size
    change: float | None  # relative to the first model's
    kld: KldStats | None = None  # with --kld: against the first model's distributions


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
    model_filename: str = ""  # the model as given (llama-bench's record), else its path
    background_cpus: float | None = None  # other processes' load over the test's repetitions
    speculation: Speculation | None = None  # tg tests with --draft
    phases: Phases | None = None  # pp+tg tests
    perplexity: Perplexity | None = None  # with --ppl
    until_ci_pct: float | None = None  # with --until-ci: the interval's target half-width, %
    until_ci_stop: str | None = None  # why the repetitions stopped: reached, time budget, cap
    energy: BenchEnergy | None = None  # --energy on or auto: measured, or absent with why
    rpc_traffic: Traffic | None = None  # -rpc: over the servers' sockets, the timed repetitions
    rpc_wait_s: float | None = None  # -rpc: the timed decodes' wait on the servers (rpc.py)

    @property
    def kind(self) -> Kind:
        s = self.shape
        return "tg" if not s.n_prompt else "pp" if not s.n_gen else "pg"

    @property
    def n_batch(self) -> int:
        """As asked, as llama-bench records it (llama.cpp caps it at the context a test needs:
        2048 at pp512), else the engine's default."""
        asked = self.combo.n_batch
        return asked if asked is not None else max(self.settings.n_batch, DEFAULT_N_BATCH)

    @property
    def n_ubatch(self) -> int:
        """As asked, as llama-bench records it (llama.cpp clamps it to n_batch to run), else
        llama.cpp's default."""
        asked = self.combo.n_ubatch
        return asked if asked is not None else max(self.settings.n_ubatch, 512)

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
    def ci95_pct(self) -> float | None:
        """The half-width of the mean rate's 95 % interval in % (the geometric mean's, Welch's
        t on log rates as every comparison); None under 2 repetitions."""
        half = LogSample.of(self.samples_ts).halfwidth()
        return None if half is None else half * 100

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
        """llama-bench's fields in its order and terms, then llmrun's own."""
        return {
            **self._llama_bench_fields(system),
            **self._llmrun_fields(system),
            **self._own_fields(),
        }

    def _llama_bench_fields(self, system: SystemInfo) -> dict[str, Any]:
        """llama-bench's record, field for field: its names, order and terms."""
        m, st, s = self.model, self.settings, self.shape
        samples_ns = [round(x * 1e9) for x in self.samples_s]
        avg_ns = statistics.fmean(samples_ns) if samples_ns else 0.0
        std_ns = statistics.stdev(samples_ns) if len(samples_ns) > 1 else 0.0
        p = {**LLAMA_DEFAULTS, **st.params}
        own: dict[str, Any] = {  # the rest: LLAMA_DEFAULTS under the load's own params
            "build_commit": llmrun_build(system.build_commit),
            "build_number": system.build_number,
            "cpu_info": system.cpu,
            "gpu_info": rpc_gpu_info(system.gpu_info, p.get("rpc")),
            "backends": rpc_backends(system.backends, p.get("rpc")),
            "model_filename": self.model_filename or m.path,
            "model_type": m.desc or f"{m.architecture} {human_count(m.n_params)} {m.quantization}",
            "model_size": m.size_bytes,
            "model_n_params": m.n_params,
            "n_batch": self.n_batch,
            "n_ubatch": self.n_ubatch,
            "n_threads": st.n_threads,
            "type_k": st.type_k,
            "type_v": st.type_v,
            "n_gpu_layers": st.n_gpu_layers_asked,
            "flash_attn": FLASH_ATTN_CODES.get(st.flash_attn, -1),
            "repack": st.repack,
            "fit_target": self.combo.fit_target,
            "fit_min_ctx": self.combo.fit_min_ctx,
            "n_prompt": s.n_prompt,
            "n_gen": s.n_gen,
            "n_depth": s.n_depth,
            "test_time": self.test_time,
            "avg_ns": round(avg_ns),
            "stddev_ns": round(std_ns),
            "avg_ts": round(self.avg_ts, 6),
            "stddev_ts": round(self.stddev_ts, 6),
        }
        return {k: own[k] if k in own else p[k] for k in LLAMA_BENCH_FIELDS} | {
            "samples_ns": samples_ns,
            "samples_ts": [round(x, 6) for x in self.samples_ts],
            "rpc": p.get("rpc", ""),  # llama-bench's -rpc servers, as given
        }

    def _llmrun_fields(self, system: SystemInfo) -> dict[str, Any]:
        """llmrun's own fields, after llama-bench's."""
        m, st = self.model, self.settings
        return {
            "test": self.shape.name,
            "model_name": m.name,
            "n_gpu_layers_offloaded": st.n_gpu_layers,
            "device": st.device,
            "device_memory_bytes": st.device_memory_bytes,
            "n_threads_batch": st.n_threads_batch,
            "flash_attn_mode": st.flash_attn,
            "repack_note": st.repack_note,
            "tuned": st.tuned,
            "llama_cpp_python": system.build,
            "load_ms": round(self.load_s * 1000, 3),
            "n_ctx": st.n_ctx,
            **_memory_fields(st),
            "ttft_ms": round(statistics.fmean(self.ttft_s) * 1000, 3) if self.ttft_s else None,
            "itl_p50_ms": _ms(percentile(self.itl_s, 50)),
            "itl_p99_ms": _ms(percentile(self.itl_s, 99)),
            "engine_avg_ts": round(self.engine_avg_ts, 6) if self.engine_avg_ts else None,
            "next_token": self.next_token,
            "mem_bw_gbs": round(system.mem_bw_bytes_s / 1e9, 3) if system.mem_bw_bytes_s else None,
            "mem_bw_spread": _round(system.mem_bw_spread, 3),
            **self._efficiency_fields(system),
            "background_cpus": _round(self.background_cpus, 3),
            "busy": busy_machine(self.background_cpus, st.n_threads),
        }

    def _efficiency_fields(self, system: SystemInfo) -> dict[str, Any]:
        """How close the test ran to the machine's limits: decode against the bandwidth of the
        memories the weights are in (tg), prefill's arithmetic rate (pp)."""
        st = self.settings
        fields: dict[str, Any] = dict.fromkeys(EFFICIENCY_FIELDS)
        if self.kind == "tg" and self.avg_ts:
            fields["decode_bw_gbs"] = round(self.bytes_per_token() * self.avg_ts / 1e9, 3)
            where = weights_memories(
                system, devices=st.backend, n_offloaded=st.n_gpu_layers, n_layers=st.n_layer_total
            )
            fields.update(decode_bandwidth(where, self.bytes_per_token(), self.avg_ts))
        if self.kind == "pp" and self.avg_ts:
            fields["prefill_gflops"] = round(2 * self.model.n_params * self.avg_ts / 1e9, 3)
        return fields

    def _own_fields(self) -> dict[str, Any]:
        """The optional measurements, after the rest, only where they were made."""
        rec: dict[str, Any] = {}
        if self.speculation is not None:
            rec.update(asdict(self.speculation))  # draft, acceptance_rate, tokens_per_step
        if self.phases is not None:
            rec.update(asdict(self.phases))  # pp_ts, tg_ts
        if self.until_ci_pct is not None:
            rec.update(
                until_ci_pct=self.until_ci_pct,
                ci95_pct=_round(self.ci95_pct, 3),
                repetitions=len(self.samples_s),
                until_ci_stop=self.until_ci_stop,
            )
        if self.energy is not None:
            rec.update(self.energy.fields())
        if self.rpc_traffic is not None:  # the network's part (docs/hardware.md)
            tokens = self.n_tokens * len(self.samples_s)
            rec["rpc_bytes_per_token"] = bytes_per_token(self.rpc_traffic.bytes, tokens)
        if self.rpc_wait_s is not None:  # tests that decode: the share of it on the servers
            rec["rpc_wait_share"] = wait_share(self.rpc_wait_s, sum(self.itl_s))
            rec["rpc_wait_ms_per_token"] = wait_ms_per_token(self.rpc_wait_s, len(self.itl_s))
        if self.perplexity is not None:
            p = self.perplexity
            rec.update(
                ppl=round(p.ppl, 4),
                ppl_tokens=p.tokens,
                ppl_ctx=p.ctx,
                ppl_change=_round(p.change, 4),
            )
            if p.kld is not None:
                rec.update(p.kld.record())
        return rec


# The fields only some records carry (_own_fields): a csv header names them all
OPTIONAL_FIELDS = (
    "draft",
    "acceptance_rate",
    "tokens_per_step",
    "pp_ts",
    "tg_ts",
    "ppl",
    "ppl_tokens",
    "ppl_ctx",
    "ppl_change",
    *KLD_FIELDS,
    "until_ci_pct",
    "ci95_pct",
    "repetitions",
    "until_ci_stop",
    *ENERGY_FIELDS,
)

# With several models, each row against the first model's same test: the ratio of geometric
# means with its 95 % interval and verdict (significance.record_fields), beside relative_ts
RELATIVE_FIELDS = (
    "relative_ratio",
    "relative_low",
    "relative_high",
    "relative_verdict",
    "relative_busy",
    "relative_reps",
    "relative_needed_reps",
)

# The engine settings a sweep can vary, by their record fields: the terminal's columns
SWEPT_FIELDS = (
    "n_batch",
    "n_ubatch",
    "n_gpu_layers",
    "flash_attn_mode",
    "type_k",
    "type_v",
    "repack",
    "no_kv_offload",
    "load_mode",
    "n_ctx",
    "kv_bytes",
    "draft",
    "cpu_mask",
    "cpu_strict",
    "poll",
    "lazy_mode",
    "no_host",
    "embeddings",
    "no_op_offload",
)


@dataclass(frozen=True)
class Efficiency:
    """How close a test ran to the machine's limits: decode against the memory bandwidth of
    where the weights are (tg tests), prefill's arithmetic rate (pp tests)."""

    decode_bw_gbs: float | None = None
    bw_util: float | None = None
    weights_bw_gbs: float | None = None
    mem_bw_source: str | None = None
    prefill_gflops: float | None = None


@dataclass(frozen=True)
class Row:
    """One result as the terminal and the charts show it: the typed result, and the figures
    its record carries, as recorded (so the table and the record agree to the digit), with the
    run-wide ones (the speed against the first model's same test)."""

    result: Result
    avg_ts: float
    stddev_ts: float
    ttft_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    efficiency: Efficiency
    swept: Mapping[str, Any]  # SWEPT_FIELDS' values, as recorded (None where a row has none)
    relative_ts: float | None = None
    relative: Mapping[str, Any] = field(default_factory=dict)  # RELATIVE_FIELDS, as recorded

    @classmethod
    def of(cls, result: Result, record: Mapping[str, Any]) -> Row:
        """The row of a result and the record made of it (Result.record, BenchRun.records)."""
        return cls(
            result=result,
            avg_ts=record["avg_ts"],
            stddev_ts=record["stddev_ts"],
            ttft_ms=record["ttft_ms"],
            itl_p50_ms=record["itl_p50_ms"],
            itl_p99_ms=record["itl_p99_ms"],
            efficiency=Efficiency(**{f.name: record[f.name] for f in fields(Efficiency)}),
            swept={k: record.get(k) for k in SWEPT_FIELDS},
            relative_ts=record.get("relative_ts"),
            relative={k: record[k] for k in RELATIVE_FIELDS if k in record},
        )

    @property
    def kind(self) -> Kind:
        return self.result.kind

    @property
    def test(self) -> str:
        return self.result.shape.name

    @property
    def model_name(self) -> str:
        return self.result.model.name

    @property
    def n_depth(self) -> int:
        return self.result.shape.n_depth

    @property
    def n_threads(self) -> int:
        return self.result.settings.n_threads

    @property
    def n_batch(self) -> int:
        return self.result.n_batch


def _memory_fields(st: EngineSettings) -> dict[str, Any]:
    """llama.cpp's own account of the load's buffers, and the process's peak resident memory
    when this test ended (process-wide: with several models, the largest so far)."""
    m = st.memory
    return {
        "weights_bytes": m.weights_bytes if m else None,
        "weights_buffers": " ".join(m.weights) if m else None,
        "kv_bytes": m.kv_bytes if m else None,
        "kv_bytes_per_token": round(m.kv_bytes_per_token, 1) if m else None,
        "compute_bytes": m.compute_bytes if m else None,
        "peak_rss_bytes": peak_rss_bytes(),
        "file_resident_before": _round(m.file_resident_before, 4) if m else None,
    }


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 4)
