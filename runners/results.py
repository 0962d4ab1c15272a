"""One bench test's measurements, and the record llama-bench's tools read (its fields first)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from .stats import EngineSettings, ModelInfo, human_count, percentile
from .sweep import Combo, Shape
from .system import SystemInfo, busy_machine


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
