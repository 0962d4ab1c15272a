"""Measurements as data: one frozen record per request, units in every name.

Stored fields are what was measured; rates, totals and percentiles are properties computed from
them, so no figure is kept twice.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .system import peak_rss_bytes as peak_rss_bytes  # its home: beside the bandwidth probe

FINISH_STOP = "stop"  # end-of-generation token or a stop string
FINISH_LENGTH = "length"  # --max-tokens reached
FINISH_CONTEXT = "context"  # the context filled up before --max-tokens
FINISH_INTERRUPTED = "interrupted"  # Ctrl-C or a closed output
FINISH_INCOMPLETE = "incomplete"  # a server's stream broke off (killed, malformed, timed out)
FINISH_STDOUT_CLOSED = "stdout closed"  # the reader of the text went away (`| head -3`)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation, as numpy's default; None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def human_count(n: float, unit: str = "") -> str:
    """135M (parameters, as llama-bench and the Hub write them), or 96.6 MB with a unit."""
    prefixes = ((1e12, "T"), (1e9, "G" if unit else "B"), (1e6, "M"), (1e3, "k" if unit else "K"))
    for size, prefix in prefixes:
        if n >= size:
            value = n / size
            text = f"{value:.0f}" if value >= 100 or not unit else f"{value:.1f}"
            return f"{text} {prefix}{unit}" if unit else f"{text}{prefix}"
    return f"{n:.0f} {unit}" if unit else f"{n:.0f}"


def rate(count: int, seconds: float) -> float | None:
    return count / seconds if count > 0 and seconds > 0 else None


def bytes_per_token(moved: int | None, tokens: int) -> int | None:
    """The network's part of a phase, the same in every command (`rpc_bytes_per_token` in
    bench's records, run's and chat's): bytes sent to and received from the --rpc servers
    (runners/rpc.py `traffic()`, the kernel's count) over the tokens the phase evaluated."""
    return round(moved / tokens) if moved is not None and tokens > 0 else None


def wait_share(waited_s: float | None, decode_s: float) -> float | None:
    """--rpc: the share of the decode's time spent waiting on the servers (runners/rpc.py
    `ServerWait`: the decoding thread asleep inside llama_decode, neither computing nor
    waiting for a CPU), 0 to 1, the same in every command (`rpc_wait_share`)."""
    if waited_s is None or decode_s <= 0:
        return None
    return round(min(1.0, max(0.0, waited_s / decode_s)), 4)


def wait_ms_per_token(waited_s: float | None, tokens: int) -> float | None:
    """--rpc: that wait per token after the first, in ms (`rpc_wait_ms_per_token`)."""
    return round(waited_s * 1000 / tokens, 4) if waited_s is not None and tokens > 0 else None


@dataclass(frozen=True)
class ModelInfo:
    """Facts about the loaded model, from its GGUF header and llama.cpp."""

    path: str
    name: str
    architecture: str
    quantization: str
    n_params: int
    size_bytes: int  # bytes of weights
    n_ctx_train: int | None
    has_chat_template: bool
    desc: str = ""  # llama.cpp's own description (llama_model_desc): 'llama 256M Q4_1'


@dataclass(frozen=True)
class MemoryReport:
    """What llama.cpp allocated for a load, from its own buffer reports, and the process peak."""

    weights: dict[str, int] = field(default_factory=dict)  # bytes per buffer: CPU_Mapped, CUDA0
    kv_bytes: int = 0
    compute_bytes: int = 0
    output_bytes: int = 0
    n_ctx: int = 0
    peak_rss_bytes: int | None = None  # the process's peak resident memory after the load
    file_resident_before: float | None = None  # the model file's share in the page cache
    # kv_bytes and compute_bytes per buffer, as weights: each layer's KV sits on its layer's
    # device (CPU, CUDA0, RPC0[host:port]); {} where llama.cpp's log named none
    kv: dict[str, int] = field(default_factory=dict)
    compute: dict[str, int] = field(default_factory=dict)

    @property
    def weights_bytes(self) -> int:
        return sum(self.weights.values())

    @property
    def kv_bytes_per_token(self) -> float:
        return self.kv_bytes / self.n_ctx if self.n_ctx else 0.0


@dataclass(frozen=True)
class EngineSettings:
    """The settings that actually ran (after defaults and clamping), reported with every result."""

    backend: str
    n_ctx: int
    n_batch: int  # prefill chunk size
    n_ubatch: int
    n_threads: int
    n_threads_batch: int
    n_gpu_layers: int
    gpu_offload: bool  # whether this llama.cpp build can offload at all
    flash_attn: str  # as asked: auto (llama.cpp decides), on, off
    repack: bool = True  # llama.cpp's weight repacking into extra CPU buffer types
    repack_note: str = ""  # why repacking is on or off (asked, probed safe, crashed a probe)
    type_k: str = "f16"  # KV cache element types
    type_v: str = "f16"
    tuned: bool = False  # threads/batch/flash attention came from `llmrun tune`
    tuned_for: str = ""  # the workload whose tuned settings these are (chat, document)
    flash_attn_enabled: bool | None = None  # what the context runs (auto resolved); None: unknown
    n_gpu_layers_asked: int = 0  # as given (-1 or more than the model has: all)
    # llama-bench's other parameters, as read back from the structs handed to llama.cpp
    params: dict[str, Any] = field(default_factory=dict)
    device: str = "CPU"  # where the offloaded layers run: "CUDA0 NVIDIA H200", or the CPU
    n_layer_total: int = 0  # offloadable layers (the repeating ones and the output)
    offload_note: str = ""  # what was offloaded and why (asked, fitted, CPU-only build)
    device_memory_bytes: int | None = None  # device memory the load took (free before - after)
    memory: MemoryReport | None = None


@dataclass(frozen=True)
class ServerSettings:
    """What is known of a remote engine: where it is, which model, its context (0: unknown).
    Nothing about weights, threads or batches: the server does not say."""

    endpoint: str  # credentials redacted
    host: str
    model: str
    n_ctx: int


@dataclass(frozen=True)
class ServerTimings:
    """A llama.cpp-style server's own account of a request (`timings`); None: not sent or not
    a number."""

    prompt_n: int | None = None
    prompt_ms: float | None = None
    predicted_n: int | None = None
    predicted_ms: float | None = None
    cache_n: int | None = None

    @property
    def decode_tps(self) -> float | None:
        """The server's decode rate over its decode steps, predicted_n - 1 (the first token
        comes with the prefill): llama-server's predicted_per_second, serve's and run's own
        local decode rate, one definition."""
        if self.predicted_n is None or self.predicted_ms is None:
            return None
        return rate(self.predicted_n - 1, self.predicted_ms / 1000)


@dataclass(frozen=True)
class ServerReport:
    """A request served by a remote server: where, which model, and what it reported."""

    endpoint: str  # credentials redacted
    model: str
    host: str
    usage_reported: bool
    output_chunks: int
    output_counted_as: str  # "tokens" (usage) or "chunks" (no usage: stream chunks counted)
    timings: ServerTimings | None = None
    network_queue_ms: float | None = None  # client TTFT minus the server's prefill
    error: str | None = None  # the stream broke off; the text so far stands
    # The server's figures that contradicted what the client saw, each dropped and named here.
    implausible: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """The flat fields llmrun's stats JSON has always carried for a server."""
        data: dict[str, Any] = {
            "endpoint": self.endpoint,
            "server_model": self.model,
            "usage_reported": self.usage_reported,
            "output_chunks": self.output_chunks,
            "output_counted_as": self.output_counted_as,
        }
        if self.error:
            data["error"] = self.error
        if self.timings is not None:
            data.update({f"server_{k}": v for k, v in asdict(self.timings).items()})
        if self.network_queue_ms is not None:
            data["network_queue_ms"] = self.network_queue_ms
        if self.implausible:
            data["server_implausible"] = list(self.implausible)
        return data


@dataclass(frozen=True)
class PhaseEnergy:
    """One phase's energy above the idle baseline, between the counter reads that bound it."""

    energy_j: float | None  # None: not measured (the note says why), never an estimate
    window_s: float  # wall time between the two reads
    tokens: int = 0  # prompt tokens the prefill evaluated; output tokens after the first
    note: str = ""  # why it is absent, or how coarse the counter was for it

    @property
    def power_w(self) -> float | None:
        """Mean power above idle over the window."""
        if self.energy_j is None or self.window_s <= 0:
            return None
        return self.energy_j / self.window_s

    @property
    def j_per_token(self) -> float | None:
        return None if self.energy_j is None or self.tokens <= 0 else self.energy_j / self.tokens


ENERGY_PHASES = ("load", "prefill", "decode")


@dataclass(frozen=True)
class EnergyReport:
    """Energy per phase from the machine's own counters (RAPL, NVML), less an idle baseline
    measured just before the run; or, when nothing can be read, only the reason."""

    source: str = ""  # the counters read ("RAPL package-0, package-0/dram"); "": none
    reason: str = ""  # why there are no figures ("powercap is root-only here: ...")
    idle_w: float | None = None  # the counters' mean power over the idle window
    idle_window_s: float | None = None
    update_interval_s: float | None = None  # the slowest counter's, seen in the idle window
    load: PhaseEnergy | None = None  # None with a reason; a phase not in this request: a note
    prefill: PhaseEnergy | None = None
    decode: PhaseEnergy | None = None
    left_out: str = ""  # a device these figures do not cover, and why (a GPU without NVML)

    @property
    def measured(self) -> bool:
        return not self.reason

    def to_dict(self) -> dict[str, Any]:
        """Flat, with every key always there (null where absent), as bench columns want."""
        data: dict[str, Any] = {
            "source": self.source or None,
            "reason": self.reason or None,
            "idle_w": self.idle_w,
            "idle_window_s": self.idle_window_s,
            "update_interval_s": self.update_interval_s,
            "left_out": self.left_out or None,
        }
        for name in ENERGY_PHASES:
            phase: PhaseEnergy | None = getattr(self, name)
            data[f"{name}_j"] = phase.energy_j if phase else None
            data[f"{name}_window_s"] = phase.window_s if phase else None
            data[f"{name}_w"] = phase.power_w if phase else None
            if name != "load":
                data[f"{name}_tokens"] = phase.tokens if phase else None
                data[f"{name}_j_per_token"] = phase.j_per_token if phase else None
            data[f"{name}_note"] = (phase.note or None) if phase else None
        return data


@dataclass(frozen=True)
class GenerationStats:
    """Everything measured about one request. Times in seconds from the request's start.

    The time to first token is split into three consecutive intervals: rendering the chat
    template and tokenizing (plus the KV-cache prefix lookup), prefilling the new prompt tokens
    up to a device synchronize, and sampling the first token.
    """

    finish_reason: str
    prompt_tokens: int
    reused_tokens: int  # prompt tokens whose KV cache was kept from the previous request
    output_tokens: int
    template_tokenize_s: float
    prefill_s: float  # completed prefill chunks only (an interrupted chunk's time is not in it)
    first_sample_s: float
    itl_s: tuple[float, ...]  # each gap between consecutive output tokens
    e2e_s: float  # request handed over -> generation finished
    load_s: float  # model load time (the same for every request on one loaded model)
    engine_prompt_eval_ms: float | None = None  # llama.cpp's own counters for this request
    engine_eval_ms: float | None = None
    engine_n_prompt_eval: int | None = None
    engine_n_eval: int | None = None
    engine_sample_ms: float | None = None
    engine_n_sample: int | None = None
    # Wall time inside llama.cpp's sampling calls after the first token (its counter above
    # leaves out the copy of the logits into the candidates array); None: not measured.
    sample_s: float | None = None
    # Mean wall time of one llama_decode + llama_synchronize of one token after the first token;
    # llama.cpp's eval counter starts inside the call, after checking the batch, so it is a
    # little less. None: not measured (a server, speculative decoding, a single token).
    decode_call_ms: float | None = None
    seed: int | None = None
    # Measured directly where the first token's wait is not the sum of the phases above (a
    # server: network, queue and its tokenization are in it); None: their sum.
    first_token_s: float | None = None
    # Prompt tokens this request's prefill evaluated, where that is fewer than the new ones
    # (interrupted before the prompt was in); None: all of them.
    prefilled_tokens: int | None = None
    # CPUs' worth of work other processes did during the request (None: not measured).
    background_cpus: float | None = None
    model: ModelInfo | None = None
    settings: EngineSettings | None = None
    thinking_tokens: int = 0  # output tokens that were the model's thinking
    first_answer_s: float | None = None  # time to the first token of the answer proper
    draft_tokens: int = 0  # speculative decoding: tokens drafted, accepted, verification steps
    accepted_tokens: int = 0
    decode_steps: int = 0
    server: ServerReport | None = None  # set when a remote server ran the request
    # The warm-up decode after the load, apart from load_s (None: none ran, or not local)
    warmup_s: float | None = None
    # The repack probe of the first load of a quantization, apart from load_s (None: none ran)
    probe_s: float | None = None
    # Energy per phase (llmrun.runners.energy); None: not metered (bench, serve)
    energy: EnergyReport | None = None
    # Bytes to and from the --rpc servers during the prefill and the decode (None: no servers)
    rpc_prefill_bytes: int | None = None
    rpc_decode_bytes: int | None = None
    # Seconds the decode's steps waited on the --rpc servers (rpc.ServerWait; None: no servers)
    rpc_decode_wait_s: float | None = None

    @property
    def new_prompt_tokens(self) -> int:
        return self.prompt_tokens - self.reused_tokens

    @property
    def prompt_tps(self) -> float | None:
        """Prompt tokens per second over the prefill alone (tokens actually evaluated)."""
        done = self.new_prompt_tokens if self.prefilled_tokens is None else self.prefilled_tokens
        return rate(done, self.prefill_s)

    @property
    def ttft_s(self) -> float | None:
        """Time to the first output token; None when the request ended before one came."""
        if self.output_tokens == 0 and self.finish_reason in (
            FINISH_INTERRUPTED,
            FINISH_INCOMPLETE,
        ):
            return None
        if self.server is not None:  # measured as the tokens came: None when none arrived
            return self.first_token_s
        if self.first_token_s is not None:
            return self.first_token_s
        return self.template_tokenize_s + self.prefill_s + self.first_sample_s

    @property
    def decode_s(self) -> float | None:
        """Time from the first output token to the last; None when no token came (there was
        no decode to time, as there is no time to the first token)."""
        return None if self.ttft_s is None else sum(self.itl_s)

    @property
    def output_tps(self) -> float | None:
        """Output tokens per second over the tokens after the first (llama.cpp's eval rate)."""
        return rate(len(self.itl_s), sum(self.itl_s))

    @property
    def rpc_bytes_per_prompt_token(self) -> int | None:
        """--rpc: the prefill's network bytes per prompt token it evaluated."""
        done = self.new_prompt_tokens if self.prefilled_tokens is None else self.prefilled_tokens
        return bytes_per_token(self.rpc_prefill_bytes, done)

    @property
    def rpc_bytes_per_token(self) -> int | None:
        """--rpc: the decode's network bytes per token after the first (output tok/s's)."""
        return bytes_per_token(self.rpc_decode_bytes, len(self.itl_s))

    @property
    def rpc_wait_share(self) -> float | None:
        """--rpc: the share of the decode spent waiting on the servers, 0 to 1."""
        return wait_share(self.rpc_decode_wait_s, sum(self.itl_s))

    @property
    def rpc_wait_ms_per_token(self) -> float | None:
        """--rpc: the decode's wait on the servers per token after the first, in ms."""
        return wait_ms_per_token(self.rpc_decode_wait_s, len(self.itl_s))

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def tokens_per_step(self) -> float | None:
        """Output tokens per decode step after the first (1 without speculation)."""
        return (self.output_tokens - 1) / self.decode_steps if self.decode_steps else None

    @property
    def answer_tokens(self) -> int:
        return max(0, self.output_tokens - self.thinking_tokens)

    @property
    def thinking_s(self) -> float | None:
        """From the first token to the first answer token (or the end, if it never answered).
        The first token's time is the measured one (a server) or the phases' sum (locally)."""
        first = self.ttft_s
        if not self.thinking_tokens or first is None:
            return None
        end = self.first_answer_s if self.first_answer_s is not None else first + sum(self.itl_s)
        return max(0.0, end - first)

    @property
    def answer_tps(self) -> float | None:
        """Answer tokens per second, from the first answer token to the last token."""
        first = self.ttft_s
        if self.first_answer_s is None or first is None:
            return None
        return rate(self.answer_tokens - 1, first + sum(self.itl_s) - self.first_answer_s)

    @property
    def itl_p50_s(self) -> float | None:
        return percentile(self.itl_s, 50)

    @property
    def itl_p90_s(self) -> float | None:
        return percentile(self.itl_s, 90)

    @property
    def itl_p99_s(self) -> float | None:
        return percentile(self.itl_s, 99)

    @property
    def itl_max_s(self) -> float | None:
        return max(self.itl_s) if self.itl_s else None

    @property
    def python_overhead_per_token_ms(self) -> float | None:
        """Wall time of one decode step beyond llama.cpp's own decode and sampling calls: the
        wall time inside llama_decode + llama_synchronize where it was measured (else llama.cpp's
        eval counter), and inside the sampling call (else llama.cpp's sampling counter). What is
        left is llmrun's own per-token work and the ctypes calls' entry and exit."""
        if not self.itl_s or not self.engine_n_eval or self.engine_eval_ms is None:
            return None
        if self.sample_s is not None and not self.decode_steps:
            per_sample = self.sample_s * 1000 / len(self.itl_s)
        else:
            per_sample = (self.engine_sample_ms or 0.0) / max(self.engine_n_sample or 1, 1)
        if self.decode_call_ms is not None and not self.decode_steps:
            per_eval = self.decode_call_ms
        else:
            per_eval = self.engine_eval_ms / self.engine_n_eval
        return sum(self.itl_s) * 1000 / len(self.itl_s) - per_eval - per_sample

    @property
    def uncounted_decode_ms(self) -> float | None:
        """Per step, the part of the llama_decode + llama_synchronize calls that llama.cpp's own
        eval counter leaves out (checking the batch before its clock starts, the calls' return)."""
        if self.decode_call_ms is None or self.decode_steps:
            return None
        if self.engine_eval_ms is None or not self.engine_n_eval:
            return None
        return self.decode_call_ms - self.engine_eval_ms / self.engine_n_eval

    @property
    def interrupted(self) -> bool:
        return self.finish_reason == FINISH_INTERRUPTED

    def to_dict(self) -> dict[str, Any]:
        """A flat JSON-ready record: measured fields, computed figures, model and settings."""
        data = asdict(self)
        for name in ("itl_s", "server", "energy"):
            data.pop(name)
        data["itl_ms"] = [round(x * 1000, 4) for x in self.itl_s]
        for name in (
            "new_prompt_tokens",
            "prompt_tps",
            "ttft_s",
            "decode_s",
            "output_tps",
            "itl_p50_s",
            "itl_p90_s",
            "itl_p99_s",
            "itl_max_s",
            "python_overhead_per_token_ms",
            "uncounted_decode_ms",
            "answer_tokens",
            "thinking_s",
            "answer_tps",
            "acceptance_rate",
            "tokens_per_step",
        ):
            data[name] = getattr(self, name)
        if self.rpc_decode_bytes is not None:  # only with --rpc servers
            data["rpc_bytes_per_prompt_token"] = self.rpc_bytes_per_prompt_token
            data["rpc_bytes_per_token"] = self.rpc_bytes_per_token
        else:
            data.pop("rpc_prefill_bytes")
            data.pop("rpc_decode_bytes")
        if self.rpc_decode_wait_s is not None:  # only with --rpc servers
            data["rpc_wait_share"] = self.rpc_wait_share
            data["rpc_wait_ms_per_token"] = self.rpc_wait_ms_per_token
        else:
            data.pop("rpc_decode_wait_s")
        if self.server is not None:
            data.update(self.server.to_dict())
        if self.energy is not None:
            data["energy"] = self.energy.to_dict()
        return data


AGGREGATE_FIGURES = ("ttft_s", "prompt_tps", "output_tps")


@dataclass(frozen=True)
class Aggregate:
    """Percentiles over several requests run on one loaded model."""

    count: int
    figures: dict[str, dict[str, float | None]]  # figure -> {"p50": ..., "p90": ...}

    @classmethod
    def of(cls, stats: Sequence[GenerationStats]) -> Aggregate:
        figures: dict[str, dict[str, float | None]] = {}
        for name in AGGREGATE_FIGURES:
            values = [v for s in stats if (v := getattr(s, name)) is not None]
            figures[name] = {"p50": percentile(values, 50), "p90": percentile(values, 90)}
        return cls(count=len(stats), figures=figures)


class PausedClock:
    """Seconds since a request started, not counting the time its consumer held an event.

    A runner yields inside `with clock.paused():`; whatever the consumer does before asking for
    the next event (printing, drawing) is left out of `now()` and so out of every phase figure,
    while `wall()` keeps the whole wall time (e2e)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.paused_s = 0.0

    def now(self) -> float:
        return time.perf_counter() - self.start - self.paused_s

    def wall(self) -> float:
        return time.perf_counter() - self.start

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.paused_s += time.perf_counter() - t
