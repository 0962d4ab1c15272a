"""Ranges for every setting, checked before llama.cpp sees it, whatever its source.

Options on the command line, `LLMRUN_*` variables, `tuned.json` and JSONL lines all end up in an
`EngineConfig` or `SamplingParams`; llama.cpp wraps, segfaults or aborts on values outside what
it handles (a context of 99,999,999,999 tokens, 100,000 threads), so both are checked here, and
the memory a context needs is estimated before it is created.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .config import LAZY_MODES, LOAD_MODES, SPLIT_MODES
from .errors import BadRequestError, LlmrunError, shown_short
from .system import available_memory_bytes, logical_cpus

if TYPE_CHECKING:
    from .base import SamplingParams
    from .gguf import GGUFInfo

MAX_CTX = 1 << 24  # llama.cpp keeps positions in 32-bit fields; no model is trained beyond this
MAX_BATCH = 1 << 20
# A chat template, --chat-template-file's or the GGUF's: they are a few KiB, the largest known
# ~30 KiB; Jinja parses one of 14 MB for a minute, outside the render budget and deaf to SIGTERM.
MAX_TEMPLATE_BYTES = 2**20
MAX_TOKENS = 1 << 24
MAX_SEED = 2**32 - 1
GGML_MAX_THREADS = 512

FLASH_ATTN = ("auto", "on", "off")
# The KV cache types llmrun accepts, by llama.cpp's names: ggml's type id (enum ggml_type in
# ggml.h) and the bytes per element. The ids are ggml's own, not looked up in the bindings:
# llama-cpp-python lacks GGML_TYPE_BF16, so `-ctk bf16` passed the option check and then
# failed as an "unknown KV cache type" of the model file.
CACHE_TYPE_TABLE: dict[str, tuple[int, float]] = {
    "f32": (0, 4.0),
    "f16": (1, 2.0),
    "bf16": (30, 2.0),
    "q8_0": (8, 34 / 32),
    "q4_0": (2, 18 / 32),
    "q4_1": (3, 20 / 32),
    "iq4_nl": (20, 18 / 32),
    "q5_0": (6, 22 / 32),
    "q5_1": (7, 24 / 32),
}
CACHE_TYPE_IDS = {name: ggml_type for name, (ggml_type, _) in CACHE_TYPE_TABLE.items()}
CACHE_TYPE_BYTES = {name: size for name, (_, size) in CACHE_TYPE_TABLE.items()}
CACHE_TYPES = tuple(CACHE_TYPE_BYTES)


class SettingError(BadRequestError):
    """A setting outside the range llama.cpp handles; `where` names its source."""

    def __init__(self, where: str, problem: str, setting: str | None = None) -> None:
        super().__init__(f"{where}: {problem}" if where else problem)
        self.where = where
        self.problem = problem
        self.setting = setting  # the setting's name (None: not one setting's range)


class MemoryNeedError(LlmrunError):
    """A context that would not fit in the memory available now."""

    def __init__(self, n_ctx: int, need: int, kv: int, available: int) -> None:
        super().__init__(
            f"a context of {n_ctx} tokens needs about {gib(need)} (KV cache {gib(kv)}), "
            f"but {gib(available)} of memory is available"
        )
        self.n_ctx = n_ctx
        self.need = need
        self.available = available


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.0f} MiB"


def max_threads() -> int:
    """More threads than 4 per logical CPU only spin (llama.cpp's workers busy-wait)."""
    return min(GGML_MAX_THREADS, 4 * logical_cpus())


def _shown(value: Any) -> str:
    """A setting's value in a message: as written, cut when long (a 400-digit integer from a
    --jsonl line), and a float past the largest (JSON's 1e999, read as inf) as what it is."""
    if isinstance(value, float) and math.isinf(value):
        return "a number past the largest float"
    return shown_short(repr(value))


def _int_in(where: str, name: str, value: Any, low: int, high: int, why: str = "") -> None:
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool):
        raise SettingError(where, f"{name} must be a whole number, not {_shown(value)}", name)
    if not low <= value <= high:
        extra = f" ({why})" if why else ""
        raise SettingError(
            where, f"{name} {_shown(value)} is out of range {low}..{high}{extra}", name
        )


def _float_in(where: str, name: str, value: Any, low: float, high: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise SettingError(where, f"{name} must be a number, not {_shown(value)}", name)
    # an int is finite however long (math.isfinite raised OverflowError past the floats: an
    # internal error that ended a whole --jsonl run)
    if not ((isinstance(value, int) or math.isfinite(value)) and low <= value <= high):
        raise SettingError(where, f"{name} {_shown(value)} is out of range {low:g}..{high:g}", name)


def engine_ranges() -> dict[str, tuple[int, int]]:
    """Each numeric engine setting's range (`EngineConfig`'s field), declared once: the
    command line's options take their bounds from here (`engine_bounds`), and `check_engine`
    checks every other source (tuned files, a library caller) by it. Threads: this machine's."""
    threads = max_threads()
    return {
        "n_ctx": (0, MAX_CTX),
        "n_batch": (1, MAX_BATCH),
        "n_ubatch": (1, MAX_BATCH),
        "n_threads": (1, threads),
        "n_threads_batch": (1, threads),
        "n_gpu_layers": (-1, 1 << 16),
    }


def engine_bounds(name: str, *, least: int | None = None) -> dict[str, Any]:
    """An engine setting's range as Typer's `min`/`max` for its option (`least`: a command's
    own floor within it)."""
    low, high = engine_ranges()[name]
    return {"min": low if least is None else least, "max": high}


def check_engine(config: Any, where: str = "") -> None:
    """Raise SettingError for any engine setting llama.cpp would not survive."""
    threads_why = f"this machine has {logical_cpus()} logical CPUs"
    for name, (low, high) in engine_ranges().items():
        why = threads_why if name.startswith("n_threads") else ""
        _int_in(where, name, getattr(config, name), low, high, why)
    if config.flash_attn is not None and config.flash_attn not in FLASH_ATTN:
        raise SettingError(where, f"flash_attn must be auto, on or off, not {config.flash_attn!r}")
    for name, known in (
        ("load_mode", tuple(LOAD_MODES)),
        ("lazy_mode", tuple(LAZY_MODES.values())),
        ("split_mode", tuple(SPLIT_MODES.values())),
    ):
        value = getattr(config, name, None)
        if value is not None and value not in known:
            raise SettingError(where, f"{name} must be one of {', '.join(known)}, not {value!r}")
    if config.repack is not None and not isinstance(config.repack, bool):
        raise SettingError(where, f"repack must be true or false, not {config.repack!r}")
    for name in ("cache_type_k", "cache_type_v"):
        value = getattr(config, name)
        if value not in CACHE_TYPES:
            raise SettingError(
                where, f"{name} {value!r} is not one of {', '.join(CACHE_TYPE_BYTES)}"
            )


@dataclass(frozen=True)
class Setting:
    """One sampling setting, declared once: its `SamplingParams` field, its range, and the
    names it goes by in `run --jsonl` lines and in `llmrun serve`'s HTTP bodies. The command
    line's option (cli/options.py) takes its bounds from here, JSONL's keys and the server's
    request fields are read through it, and `check_sampling` checks every source by it."""

    name: str
    low: float
    high: float
    jsonl: tuple[str, ...]
    http: tuple[str, ...]

    @property
    def whole(self) -> bool:
        return isinstance(self.low, int) and isinstance(self.high, int)

    def check(self, where: str, value: Any) -> None:
        if self.whole:
            _int_in(where, self.name, value, int(self.low), int(self.high))
        else:
            _float_in(where, self.name, value, self.low, self.high)


# llama.cpp's penalty sampler divides a seen token's positive logit by the penalty (and
# multiplies a negative one); only 1.0 is special (off). 0 made every seen token's logit
# infinite (an empty answer, finish_reason stop), a negative one flips the sign, and a
# positive one under about 1e-37 overflows float32 the same way; 0.01 already scales a seen
# token's logit a hundredfold.
MIN_REPEAT_PENALTY = 0.01

SAMPLING_SETTINGS: dict[str, Setting] = {
    s.name: s
    for s in (
        Setting("max_tokens", 1, MAX_TOKENS, ("max_tokens",), ("max_tokens",)),
        Setting("temperature", 0.0, 100.0, ("temperature", "temp"), ("temperature",)),
        Setting("top_k", 0, 1 << 24, ("top_k",), ("top_k",)),
        Setting("top_p", 0.0, 1.0, ("top_p",), ("top_p",)),
        Setting("min_p", 0.0, 1.0, ("min_p",), ("min_p",)),
        Setting(
            "repeat_penalty",  # llama.cpp's name, and vLLM's
            MIN_REPEAT_PENALTY,
            100.0,
            ("repeat_penalty",),
            ("repeat_penalty", "repetition_penalty"),
        ),
        Setting("repeat_last_n", -1, MAX_CTX, ("repeat_last_n",), ("repeat_last_n",)),
        Setting("seed", 0, MAX_SEED, ("seed",), ("seed",)),
    )
}


def bounds(name: str) -> dict[str, Any]:
    """A setting's range as Typer's `min`/`max` for its command-line option."""
    s = SAMPLING_SETTINGS[name]
    return {"min": s.low, "max": s.high}


def check_sampling(sp: SamplingParams, where: str = "") -> None:
    """Raise SettingError for sampling values that are not meaningful."""
    for setting in SAMPLING_SETTINGS.values():
        setting.check(where, getattr(sp, setting.name))
    if not isinstance(sp.stop, tuple) or not all(isinstance(s, str) and s for s in sp.stop):
        raise SettingError(where, "stop must be a string or a list of non-empty strings")


@dataclass(frozen=True)
class MemoryNeed:
    """What a context will take beside the weights, estimated from the GGUF header."""

    kv_bytes: int
    compute_bytes: int
    weights_bytes: int

    @property
    def total(self) -> int:
        return self.kv_bytes + self.compute_bytes + self.weights_bytes


def _first(value: Any) -> int:
    """A per-layer array (some models vary head counts by layer) or one value: the largest."""
    if isinstance(value, list):
        value = max((v for v in value if isinstance(v, (int, float))), default=0)
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0


def estimate_memory(
    info: GGUFInfo, *, n_ctx: int, n_ubatch: int, type_k: str, type_v: str, n_vocab: int
) -> MemoryNeed:
    meta, arch = info.metadata, info.architecture
    n_layer = _first(meta.get(f"{arch}.block_count"))
    n_embd = _first(meta.get(f"{arch}.embedding_length"))
    n_head = _first(meta.get(f"{arch}.attention.head_count")) or 1
    n_head_kv = _first(meta.get(f"{arch}.attention.head_count_kv")) or n_head
    head_k = _first(meta.get(f"{arch}.attention.key_length")) or n_embd // n_head
    head_v = _first(meta.get(f"{arch}.attention.value_length")) or n_embd // n_head
    per_token = (
        n_layer
        * n_head_kv
        * (head_k * CACHE_TYPE_BYTES[type_k] + head_v * CACHE_TYPE_BYTES[type_v])
    )
    kv = int(per_token * n_ctx)
    # The largest compute buffers: attention scores of one micro-batch against the whole
    # context (f32, per head) and the output logits.
    ubatch = min(n_ubatch, n_ctx)
    compute = 4 * ubatch * (n_ctx * n_head + n_vocab + 8 * n_embd)
    return MemoryNeed(kv, compute, info.data_size_bytes)


def check_memory(need: MemoryNeed, n_ctx: int) -> None:
    """Refuse what cannot fit in the memory available now (RAM plus free swap is not counted)."""
    available = available_memory_bytes()
    if available is not None and need.total > available:
        raise MemoryNeedError(n_ctx, need.total, need.kv_bytes, available)


# ---- offloading to a GPU ----------------------------------------------------------------------

GPU_MEMORY_SHARE = 0.9  # of the free device memory: the backend's own buffers need the rest


def fit_gpu_layers(need: MemoryNeed, n_layer: int, free_bytes: int) -> int:
    """How many of the model's n_layer + 1 offloadable layers (the repeating ones and the
    output) fit in `free_bytes`: the weights spread evenly over them, each repeating layer's
    share of the KV cache, and the compute buffer once."""
    total = n_layer + 1
    per_layer = need.weights_bytes / total + need.kv_bytes / max(n_layer, 1)
    room = free_bytes * GPU_MEMORY_SHARE - need.compute_bytes
    if room <= 0 or per_layer <= 0:
        return 0
    return max(0, min(total, int(room // per_layer)))


def plan_offload(
    asked: int,
    *,
    can_offload: bool,
    n_layer: int,
    need: MemoryNeed | None,
    gpus: list[tuple[str, int | None]],
) -> tuple[int, str]:
    """The layers to hand llama.cpp (-1: all) and a note saying what was done and why.

    `asked` is -ngl (-1 or more than the model has: all); `gpus` are (name, free bytes). An
    explicit count is kept as given; "all" becomes as many layers as fit when the model and its
    KV cache would not fit the free device memory."""
    total = n_layer + 1
    if not can_offload:
        return 0, "CPU-only build" if asked else ""
    if asked == 0:
        return 0, "no layers asked for (-ngl 0)"
    if not gpus:
        return 0, "no GPU device found"
    names = ", ".join(name for name, _ in gpus)
    if 0 < asked <= n_layer:
        return asked, f"{asked} of {total} layers on {names}, as asked"
    free = sum(f for _, f in gpus if f) if all(f for _, f in gpus) else None
    if need is None or free is None:
        return -1, f"all {total} layers on {names}"
    fit = fit_gpu_layers(need, n_layer, free)
    if fit >= total:
        return -1, f"all {total} layers on {names}"
    return fit, (
        f"{fit} of {total} layers fit in the {gib(free)} free on {names} (model"
        f" {gib(need.weights_bytes)} + KV cache {gib(need.kv_bytes)}); the rest run"
        " on the CPU"
    )
