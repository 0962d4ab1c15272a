"""The in-process engine: llama.cpp through llama-cpp-python's low-level API.

Why low level: the high-level `Llama` streaming path re-detokenizes the whole completion per
token, buffers text, mixes the consumer's time into generation time, and redirects the process's
file descriptors while loading. Here every phase is timed at its boundary:

- prefill: one `llama_decode` per chunk of `n_batch` tokens, each followed by
  `llama_synchronize`; a progress event after every chunk;
- first token: sampled with a C sampler chain (perf counters on);
- decode: one `llama_decode` of one token, then one sample, per step.

Time spent by the consumer of the events (printing, drawing) is measured and left out of every
phase figure; `e2e_s` is the wall time including it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import math
import random
import re
import secrets
import threading
import time
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import devices as dv
from .base import (
    Event,
    Finished,
    LoadStarted,
    LocalLoaded,
    PrefillProgress,
    Request,
    SamplingParams,
    Token,
)
from .config import (
    DEFAULT_N_BATCH,
    DEFAULT_N_CTX,
    LAZY_MODES,
    LOAD_MODES,
    SPLIT_MODES,
    EngineConfig,
)
from .errors import (
    BadRequestError,
    ChatTemplateError,
    EmptyPromptError,
    EngineError,
    LoadCancelledError,
    ModelLoadError,
    PromptTooLongError,
)
from .gguf import GGUFInfo, read_gguf
from .handles import Batch, Context, Model, Sampler
from .library import LOG_LINES, last_log_error, llama_lib
from .limits import (
    MAX_CTX,
    MemoryNeed,
    SettingError,
    check_engine,
    check_memory,
    estimate_memory,
    plan_offload,
)
from .probe import repack_verdict
from .reasoning import TokenTagger, opens_thinking
from .stats import (
    FINISH_CONTEXT,
    FINISH_INTERRUPTED,
    FINISH_LENGTH,
    FINISH_STOP,
    EngineSettings,
    GenerationStats,
    MemoryReport,
    ModelInfo,
    PausedClock,
    peak_rss_bytes,
)
from .system import (
    cpu_sample,
    default_threads,
    evict_from_page_cache,
    measured_background,
    resident_fraction,
)
from .text import TextStream
from .threadpool import Threadpool
from .threadpool import attach as attach_threadpool

_BUFFER = re.compile(r"(\S+)\s+(model|KV|compute|output) buffer size =\s+([\d.]+) MiB")


def memory_report(log: list[str], n_ctx: int) -> MemoryReport:
    """llama.cpp's own account of its buffers (`CPU_Mapped model buffer size = 92.10 MiB`,
    `CPU KV buffer size`, `CPU compute buffer size`), read from its log of this load."""
    weights: dict[str, int] = {}
    sizes = {"KV": 0, "compute": 0, "output": 0}
    for line in log:
        for name, kind, mib in _BUFFER.findall(line):
            size = round(float(mib) * 2**20)
            if kind == "model":
                weights[name] = weights.get(name, 0) + size
            else:
                sizes[kind] += size
    return MemoryReport(
        weights, sizes["KV"], sizes["compute"], sizes["output"], n_ctx, peak_rss_bytes()
    )


@dataclass
class _Placement:
    overrides: Any = None  # a NULL-terminated array of BuftOverride
    devices: Any = None  # a NULL-terminated array of ggml_backend_dev_t
    record: dict[str, Any] = field(default_factory=dict)
    keep: list[Any] = field(default_factory=list)


def _placement(cfg: EngineConfig) -> _Placement:
    """llama-bench's -ot, -ncmoe and -dev as the structs llama_model_params points to."""
    out = _Placement()
    pairs: list[tuple[str, str]] = []  # -ot's, recorded as given; -ncmoe's count on its own
    for part in (cfg.tensor_overrides or "").split(";"):
        if part.strip():
            pattern, sep, buffer = part.strip().rpartition("=")
            if not sep or not pattern or not buffer:
                raise BadRequestError(f"-ot: '{part}' is not PATTERN=BUFFER (e.g. ffn_.*=CPU)")
            dv.check_tensor_pattern(pattern)
            pairs.append((pattern, buffer))
    given = ";".join(f"{p}={b}" for p, b in pairs)
    pairs += [(p, "CPU") for p in dv.moe_cpu_patterns(cfg.n_cpu_moe)]
    if pairs:
        arr = (dv.BuftOverride * (len(pairs) + 1))()
        for i, (pattern, buffer) in enumerate(pairs):
            buft = dv.buffer_type(buffer)
            if buft is None:
                raise BadRequestError(f"-ot: no buffer type '{buffer}' in this llama.cpp build")
            encoded = pattern.encode()
            out.keep.append(encoded)
            arr[i].pattern, arr[i].buft = encoded, buft
        out.overrides = arr
        out.record["tensor_buft_overrides"] = given or "none"
    out.record["n_cpu_moe"] = cfg.n_cpu_moe
    if cfg.devices is not None and cfg.devices.strip().lower() != "auto":  # llama-bench's default
        names = (
            []
            if cfg.devices.strip().lower() == "none"
            else [n for n in cfg.devices.split("/") if n.strip()]
        )
        devs = (ctypes.c_void_p * (len(names) + 1))()
        for i, name in enumerate(names):
            dev = dv.device_by_name(name.strip())
            if dev is None:
                raise BadRequestError(f"-dev: no device '{name}' (llmrun bench --list-devices)")
            devs[i] = dev
        out.devices = devs
        out.record["devices"] = cfg.devices
    return out


def gpu_layers_asked(cfg: EngineConfig, can_offload: bool) -> int:
    """-ngl as given, or by default all layers where the build can offload (llama-bench's -1)."""
    if cfg.n_gpu_layers is not None:
        return cfg.n_gpu_layers
    return -1 if can_offload else 0


def offloaded_layers(asked: int, n_layer: int) -> int:
    """The layers llama.cpp puts on the GPU: -1, or any count above the model's (99, as
    llama.cpp's users write it), means all of them and the output layer."""
    return n_layer + 1 if asked < 0 else min(asked, n_layer + 1)


def model_params(p: Any) -> dict[str, Any]:
    """llama-bench's model-side fields, read back from the llama_model_params handed over."""
    load_mode = {v: k for k, v in LOAD_MODES.items()}.get(int(p.load_mode), str(p.load_mode))
    return {
        "split_mode": SPLIT_MODES.get(int(p.split_mode), str(p.split_mode)),
        "main_gpu": int(p.main_gpu),
        "devices": "auto" if not p.devices else "custom",
        "tensor_split": "0.00" if not p.tensor_split else "custom",
        "tensor_buft_overrides": "none" if not p.tensor_buft_overrides else "custom",
        "load_mode": load_mode,
        "lazy_mode": LAZY_MODES.get(int(p.lazy_mode), str(p.lazy_mode)),
        "no_host": bool(p.no_host),
    }


def flash_attn_used(asked: str, log: list[str]) -> bool | None:
    """Whether the context runs flash attention: as asked, or as llama.cpp resolved `auto`
    (its log of the context's creation says "Flash Attention enabled" or "... not supported,
    set to disabled"); None where the log does not say."""
    if asked != "auto":
        return asked == "on"
    for line in log:
        if "Flash Attention" in line:
            return "enabled" in line and "disabled" not in line
        if "enabling flash_attn since" in line:
            return True
    return None


def _flash_attn_type(lib: Any, name: str) -> int:
    return int(
        {
            "auto": lib.LLAMA_FLASH_ATTN_TYPE_AUTO,
            "on": lib.LLAMA_FLASH_ATTN_TYPE_ENABLED,
            "off": lib.LLAMA_FLASH_ATTN_TYPE_DISABLED,
        }[name]
    )


def kv_unified_of(lib: Any, ctx: Any) -> bool:
    """Whether a context's sequences share one KV buffer, read back from llama.cpp: each
    sequence may then use the whole context (n_ctx_seq == n_ctx); with one stream per
    sequence, each has its own share."""
    return int(lib.llama_n_ctx_seq(ctx)) == int(lib.llama_n_ctx(ctx))


def context_params(p: Any) -> dict[str, Any]:
    """llama-bench's context-side fields, read back from the llama_context_params handed over."""
    return {
        "no_kv_offload": not bool(p.offload_kqv),
        "embeddings": bool(p.embeddings),
        "no_op_offload": int(not bool(p.op_offload)),
    }


@dataclass
class _Prefilled:
    seconds: float = 0.0  # completed chunks only
    evaluated: int = 0
    aborted: bool = False


@dataclass
class _Decoded:
    finish: str = FINISH_STOP
    times: list[float] = field(default_factory=list)  # each output token's time stamp
    first_sample_s: float = 0.0
    sample_s: float = 0.0  # in llama_sampler_sample after the first token
    call_s: float = 0.0  # in llama_decode + llama_synchronize after the first token
    calls: int = 0
    text: str = ""
    tail: str = ""  # text held back until the end
    thinking_tokens: int = 0
    first_answer_s: float | None = None
    drafted: int = 0  # speculative decoding: tokens proposed, accepted, verification steps
    accepted: int = 0
    steps: int = 0


class _Drafter:
    """Prompt-lookup speculative decoding (greedy): the last few tokens are looked up earlier in
    the context, the tokens that followed there are proposed, and the model checks them all in
    one batch; the longest agreeing prefix is kept, plus the model's own next token."""

    NGRAMS = (4, 3, 2)  # the longest match first; one token alone predicts too little

    def __init__(self, lib: Any, n_draft: int, cache: list[int]) -> None:
        self.lib, self.n_draft, self.cache = lib, n_draft, cache
        self.batch = Batch(lib, n_draft + 1)
        self.drafted = self.accepted = self.steps = 0
        self.length = n_draft  # adapts: doubled after a full acceptance, halved after a miss

    def propose(self, history: list[int], limit: int) -> list[int]:
        for n in self.NGRAMS:
            if len(history) <= n:
                continue
            tail = history[-n:]
            for start in range(len(history) - n - 1, max(-1, len(history) - 4097), -1):
                if history[start : start + n] == tail:
                    return history[start + n : start + n + min(limit, self.length)]
        return []

    def step(self, ctx: Any, chain: Sampler, token: int, room: int) -> tuple[list[int], int]:
        """Decode `token` and its drafts in one batch; returns (accepted drafts, next token)."""
        lib, batch = self.lib, self.batch
        drafts = self.propose([*self.cache, token], min(room, self.length)) if room > 0 else []
        base = len(self.cache)
        for i, t in enumerate([token, *drafts]):
            batch.set(i, t, base + i)
        batch.n_tokens = 1 + len(drafts)
        rc = lib.llama_decode(ctx, batch.struct)
        if rc != 0:
            raise EngineError(f"llama_decode failed during generation (code {rc})")
        self.steps += 1
        self.drafted += len(drafts)
        accepted: list[int] = []
        following = chain.sample(ctx, 0)
        for i, draft in enumerate(drafts):
            if following != draft:
                break
            accepted.append(draft)
            following = chain.sample(ctx, i + 1)
        self.accepted += len(accepted)
        if drafts:
            full = len(accepted) == len(drafts)
            self.length = min(self.n_draft, self.length * 2) if full else max(1, self.length // 2)
        self.cache.extend([token, *accepted])
        if len(accepted) < len(drafts):  # the rejected drafts' KV entries go
            mem = lib.llama_get_memory(ctx)
            lib.llama_memory_seq_rm(mem, 0, len(self.cache), -1)
        return accepted, following

    def close(self) -> None:
        self.batch.close()


class _ModelDrafter(_Drafter):
    """Drafts from a small model with the same vocabulary: it follows the accepted text in a
    context of its own (its rejected guesses cut off by prefix reuse) and guesses greedily."""

    def __init__(self, lib: Any, n_draft: int, cache: list[int], draft: LlamaCppRunner) -> None:
        super().__init__(lib, n_draft, cache)
        self.draft = draft
        self.greedy = Sampler.greedy(lib)

    def propose(self, history: list[int], limit: int) -> list[int]:
        d, lib = self.draft, self.lib
        kept = d._reuse_prefix(history)
        d.eval_tokens(history[kept:])  # the new accepted text, then guess on from it
        guesses: list[int] = []
        one = (lib.llama_token * 1)()
        while len(guesses) < limit:
            guess = self.greedy.sample(d._ctx_ptr)
            if d.is_eog(guess):
                break
            guesses.append(guess)
            if len(guesses) == limit:
                break
            one[0] = guess
            if lib.llama_decode(d._ctx_ptr, lib.llama_batch_get_one(one, 1)) != 0:
                break
            d._cache.append(guess)
        return guesses

    def close(self) -> None:
        super().close()
        self.greedy.close()


class LlamaCppRunner:
    """Runs requests on one loaded GGUF model, keeping its KV cache between requests."""

    def __init__(self, model_path: str, config: EngineConfig | None = None) -> None:
        self.model_path = model_path
        self.config = config or EngineConfig()
        check_engine(self.config)
        self._model: Model | None = None
        self._ctx: Context | None = None
        self._n_seq = 1  # sequences of the runner's own context
        self._n_ctx_seq = 0  # and the tokens asked for each
        self._info: GGUFInfo | None = None
        self._loaded: LocalLoaded | None = None
        self.warmed_on: str | None = None  # the thread the context's warm-up decode ran on
        self._formatter: Any = None
        self._cache: list[int] = []  # tokens whose KV entries are in the context (sequence 0)
        self._cancel = threading.Event()  # the running request's; read by the abort callback
        self._abort_cb: Any = None
        self._repack = False
        self._repack_note = ""
        self._weights_s = 0.0
        self._model_params: dict[str, Any] = {}
        self._offload_note = ""
        self._model_log: list[str] = []
        self._resident: float | None = None
        self._draft: LlamaCppRunner | None = None
        self._contexts: list[Context] = []  # make_context's, closed before the model
        self.contexts_made = 0  # llama.cpp contexts created on these weights, all told
        self._gpus: list[dv.Device] = []
        self._planned_layers = 0
        self._gpu_free_before = 0

    # ---- loading ----------------------------------------------------------------------

    @property
    def loaded(self) -> LocalLoaded | None:
        return self._loaded

    def load(
        self, *, n_seq: int | None = None, n_ctx: int | None = None, warm_up: bool = True
    ) -> LocalLoaded:
        """Check the file, load the weights and create the context (once). With `n_seq` > 1
        the context holds that many sequences of `n_ctx` tokens each (default: -c), in one KV
        buffer or one stream per sequence (the config's `kv_unified`), for a batched engine
        to use as its own (`context`), so a server or a parallel run makes one context, not
        two. Tokenizing needs only the weights (`load_weights`).

        `warm_up=False` leaves the warm-up decode (--warmup) to `warm_up()` on the thread that
        will decode: llama.cpp's CPU backend (OpenMP) keeps a pool of worker threads for each
        thread that computes, and once a second thread computes, every decode of this 135M
        model on 2 cores took 10.9-14.8 ms instead of 7.8-8.6 ms."""
        if self._loaded is not None:
            if n_seq is not None and n_seq != self._n_seq:
                raise EngineError(f"the context was made for {self._n_seq} sequences, not {n_seq}")
            if n_ctx is not None and n_ctx != self._n_ctx_seq:
                raise EngineError(
                    f"the context was made for {self._n_ctx_seq} tokens per sequence, not {n_ctx}"
                )
            return self._loaded
        self.load_weights(n_seq=n_seq or 1, n_ctx=n_ctx)
        self._new_context(n_seq or 1, n_ctx)
        assert self._loaded is not None
        if warm_up:
            self.warm_up()
        return self._loaded

    def warm_up(self) -> None:
        """The warm-up decode, once, if the config asks for it (--warmup, the default); its
        time goes into the load's `warmup_s`. Call it on the thread that will decode."""
        loaded = self.load()
        if self.config.warmup and loaded.warmup_s is None:
            self._loaded = dataclasses.replace(loaded, warmup_s=self._warm_up())
            self.warmed_on = threading.current_thread().name

    def load_weights(self, *, n_seq: int = 1, n_ctx: int | None = None) -> None:
        """Check the file and load the weights (once), without a context: enough to tokenize,
        render the chat template and read the vocabulary, so a caller that sizes its context
        from the prompts makes only that one. On a GPU, the layers offloaded are those that
        fit beside the KV cache of `n_seq` sequences of `n_ctx` tokens (default: -c)."""
        if self._model is None:
            self._load_model(n_seq=n_seq, n_ctx=n_ctx)

    def _warm_up(self) -> float:
        """llama-cli's warm-up: one decode of BOS and EOS (a GPU backend sets itself up on its
        first decode), then the cache and llama.cpp's counters cleared, so that the first
        request's prefill is the steady-state figure. Returns its seconds."""
        lib = llama_lib()
        assert self._model is not None
        t0 = time.perf_counter()
        vocab = self._model.vocab
        tokens = [t for t in (lib.llama_vocab_bos(vocab), lib.llama_vocab_eos(vocab)) if t >= 0]
        arr = (lib.llama_token * max(1, len(tokens)))(*(tokens or [0]))
        n = max(1, min(len(tokens), self._loaded.settings.n_batch if self._loaded else 1))
        rc = lib.llama_decode(self._ctx_ptr, lib.llama_batch_get_one(arr, n))
        lib.llama_synchronize(self._ctx_ptr)
        lib.llama_memory_clear(lib.llama_get_memory(self._ctx_ptr), True)
        lib.llama_perf_context_reset(self._ctx_ptr)
        if rc != 0:
            raise EngineError(f"llama_decode failed during the warm-up (code {rc})")
        return time.perf_counter() - t0

    def reconfigure(self, config: EngineConfig) -> LocalLoaded:
        """Switch to other settings, reloading the weights only if they need it.

        A failure leaves the runner unloaded (the error says why); the next call starts afresh.
        """
        check_engine(config)
        if self._model is not None and config.same_model(self.config):
            self._free_context()
        else:
            self.close()
        self.config = config
        return self.load()

    def memory_need(
        self, info: GGUFInfo, *, n_seq: int = 1, n_ctx: int | None = None
    ) -> MemoryNeed:
        """The weights, the KV cache of n_seq sequences of n_ctx tokens each (default: -c) and
        the compute buffer: what decides how many layers fit on a GPU."""
        cfg = self.config
        per_seq = n_ctx or self._context_size(cfg, info.n_ctx_train)
        ubatch = min(cfg.n_ubatch or DEFAULT_N_BATCH, cfg.n_batch or DEFAULT_N_BATCH)
        n_vocab = len(info.metadata.get("tokenizer.ggml.tokens") or ()) or 32000
        return estimate_memory(
            info,
            n_ctx=per_seq * n_seq,
            n_ubatch=ubatch,
            type_k=cfg.cache_type_k,
            type_v=cfg.cache_type_v,
            n_vocab=n_vocab,
        )

    def _load_model(self, *, n_seq: int = 1, n_ctx: int | None = None) -> None:
        t0 = time.perf_counter()
        info = read_gguf(self.model_path)
        lib = llama_lib()
        cfg = self.config
        mparams = lib.llama_model_default_params()
        can_offload = bool(lib.llama_supports_gpu_offload())
        gpus = [d for d in dv.query().devices() if d.is_gpu] if can_offload else []
        n_layer = int(info.metadata.get(f"{info.architecture}.block_count", 0) or 0)
        need = None
        if gpus:  # the estimate that decides how many layers fit: every sequence's KV
            need = self.memory_need(info, n_seq=n_seq, n_ctx=n_ctx)
        layers, self._offload_note = plan_offload(
            gpu_layers_asked(cfg, can_offload),
            can_offload=can_offload,
            n_layer=n_layer,
            need=need,
            gpus=[(d.name, d.free_bytes) for d in gpus],
        )
        self._gpus, self._planned_layers = gpus, layers
        self._gpu_free_before = sum(d.free_bytes or 0 for d in gpus)
        mparams.n_gpu_layers = 0x7FFFFFFF if layers < 0 else layers
        self._repack, self._repack_note = self._choose_repack(info)
        mparams.use_extra_bufts = self._repack
        if cfg.load_mode is not None:
            mparams.load_mode = LOAD_MODES[cfg.load_mode]
        lazy = {name: code for code, name in LAZY_MODES.items()}.get(cfg.lazy_mode)
        if lazy is None:
            raise SettingError(
                self.model_path, f"lazy_mode {cfg.lazy_mode!r} is not on, auto or off"
            )
        mparams.lazy_mode = lazy
        mparams.no_host = cfg.no_host
        if cfg.split_mode is not None:
            mparams.split_mode = {v: k for k, v in SPLIT_MODES.items()}[cfg.split_mode]
        if cfg.main_gpu is not None:
            mparams.main_gpu = cfg.main_gpu
        split, shares = None, [float(x) for x in (cfg.tensor_split or "").split("/") if x]
        if shares:
            split = (ctypes.c_float * max(len(shares), int(lib.llama_max_devices())))(*shares)
            mparams.tensor_split = split  # kept alive by `split` until the load returns
        placement = _placement(cfg)  # kept alive until the load returns
        if placement.overrides is not None:
            mparams.tensor_buft_overrides = ctypes.cast(placement.overrides, ctypes.c_void_p)
        if placement.devices is not None:
            mparams.devices = ctypes.cast(placement.devices, ctypes.c_void_p)
        self._model_params = model_params(mparams)
        self._model_params.update(placement.record)
        if shares:  # as llama-bench writes it: 3.00/1.00
            self._model_params["tensor_split"] = "/".join(f"{x:.2f}" for x in shares)
        # Called as the tensors load: returning False stops a long load at Ctrl-C.
        cancel = self._cancel
        progress = lib.llama_progress_callback(lambda _p, _data: not cancel.is_set())
        mparams.progress_callback = progress
        if cfg.cold:
            evict_from_page_cache(self.model_path)
        self._resident = resident_fraction(self.model_path)
        LOG_LINES.clear()
        model = lib.llama_model_load_from_file(self.model_path.encode(), mparams)
        if not model:
            if cancel.is_set():
                raise LoadCancelledError(self.model_path)
            raise ModelLoadError(self.model_path, last_log_error())
        self._model, self._info = Model(lib, model), info
        self._weights_s = time.perf_counter() - t0
        self._model_log = list(LOG_LINES)  # the weights' buffer sizes are reported here

    def _draft_runner(self) -> LlamaCppRunner:
        """The draft model (--draft-model), loaded once, checked to share the vocabulary."""
        if self._draft is None:
            assert self.config.draft_model is not None and self._model is not None
            settings = self.load().settings
            draft = LlamaCppRunner(
                self.config.draft_model,
                EngineConfig(
                    n_ctx=settings.n_ctx,
                    n_threads=settings.n_threads,
                    n_gpu_layers=0,
                    threadpool=self.config.threadpool,
                ),
            )
            if draft.vocab_size() != self._model.n_vocab:
                draft.close()
                raise BadRequestError(
                    f"--draft-model: its vocabulary ({draft.vocab_size()} tokens) is not this"
                    f" model's ({self._model.n_vocab})"
                )
            try:
                draft.load()  # its context: the vocabulary check needed only the weights
            except BaseException:
                draft.close()
                raise
            self._draft = draft
        return self._draft

    @staticmethod
    def _context_size(cfg: EngineConfig, n_ctx_train: int | None) -> int:
        """-c as given; None: min(4096, the training context); 0: the training context."""
        if cfg.n_ctx is None:
            return min(DEFAULT_N_CTX, n_ctx_train) if n_ctx_train else DEFAULT_N_CTX
        if cfg.n_ctx == 0:
            return n_ctx_train or DEFAULT_N_CTX
        return cfg.n_ctx

    def _choose_repack(self, info: GGUFInfo) -> tuple[bool, str]:
        """Repacking as asked, or by default, but never where a probe saw it crash."""
        if self.config.repack is False:
            return False, "off (asked)"
        verdict = repack_verdict(self.model_path, info.quantization)
        if not verdict.safe:
            return False, f"off: {verdict.why}"
        return True, "on (asked)" if self.config.repack else "on (probed safe)"

    def _new_context(self, n_seq: int = 1, n_ctx_seq: int | None = None) -> None:
        """Create the context (n_seq sequences of n_ctx_seq tokens each, default -c); load
        time is the weights' load plus this context's creation."""
        t0 = time.perf_counter()
        lib = llama_lib()
        cfg, info = self.config, self._info
        assert info is not None and self._model is not None
        model = self._model.ptr
        n_ctx_train = info.n_ctx_train or lib.llama_model_n_ctx_train(model)
        asked = self._context_size(cfg, n_ctx_train)
        n_ctx = asked if n_ctx_seq is None else n_ctx_seq
        if not 1 <= n_ctx <= MAX_CTX:
            raise SettingError(self.model_path, f"n_ctx {n_ctx} is out of range 1..{MAX_CTX}")
        n_threads = cfg.n_threads or default_threads()
        n_batch = cfg.n_batch or DEFAULT_N_BATCH
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = n_ctx * n_seq
        # at most -c a step (llama.cpp also caps it at the whole context)
        cparams.n_batch = max(1, min(n_batch, asked))
        cparams.n_ubatch = max(1, min(cfg.n_ubatch or DEFAULT_N_BATCH, cparams.n_batch))
        cparams.n_seq_max = n_seq
        if n_seq > 1:
            cparams.kv_unified = cfg.kv_unified  # as the batched engine's own context
        cparams.n_threads = n_threads
        cparams.n_threads_batch = cfg.n_threads_batch or n_threads
        flash_attn = cfg.flash_attn or "auto"  # llama.cpp decides for this model and device
        cparams.flash_attn_type = _flash_attn_type(lib, flash_attn)
        for name, value in (("type_k", cfg.cache_type_k), ("type_v", cfg.cache_type_v)):
            ggml_type = getattr(lib, f"GGML_TYPE_{value.upper()}", None)
            if ggml_type is None:  # a type check_engine accepts but this llama.cpp lacks
                raise ModelLoadError(self.model_path, f"unknown KV cache type '{value}'")
            setattr(cparams, name, ggml_type)
        cparams.no_perf = False
        cparams.offload_kqv = not cfg.no_kv_offload
        cparams.embeddings = cfg.embeddings  # llama.cpp outputs the logits too (output_all)
        cparams.op_offload = not cfg.no_op_offload
        check_memory(
            estimate_memory(
                info,
                n_ctx=n_ctx * n_seq,
                n_ubatch=cparams.n_ubatch,
                type_k=cfg.cache_type_k,
                type_v=cfg.cache_type_v,
                n_vocab=self._model.n_vocab,
            ),
            n_ctx * n_seq,
        )
        for n in {cparams.n_threads, cparams.n_threads_batch}:  # a bad mask before any work
            cfg.threadpool.placement(n)
        LOG_LINES.clear()
        ctx = lib.llama_init_from_model(model, cparams)
        if not ctx:
            raise ModelLoadError(self.model_path, last_log_error())
        self._ctx = Context(lib, ctx, self._attach_threadpool(ctx, cparams))
        self.contexts_made += 1
        load_s = self._weights_s + time.perf_counter() - t0
        self._n_seq, self._n_ctx_seq = n_seq, n_ctx
        sequences = (
            {}
            if n_seq == 1
            else {"n_seq_max": int(lib.llama_n_seq_max(ctx)), "kv_unified": kv_unified_of(lib, ctx)}
        )
        # A Python callback on purpose (not AbortFlag's C one): prefill runs on the main thread,
        # where Python's signal handlers run only while Python code does, so this is what lets
        # Ctrl-C set `cancel` in the middle of a long chunk. About 500 calls per graph: ~0.1 %
        # of a 512-token chunk. Decode steps run without it.
        self._abort_cb = lib.ggml_abort_callback(lambda _data: self._cancel.is_set())
        gpu = bool(lib.llama_supports_gpu_offload())
        n_layer_meta = int(info.metadata.get(f"{info.architecture}.block_count", 0) or 0)
        n_layer = lib.llama_model_n_layer(model) or n_layer_meta
        gpu_layers = offloaded_layers(self._planned_layers, n_layer) if self._gpus else 0
        used = None
        if gpu_layers:
            free_after = sum(d.free_bytes or 0 for d in dv.query().devices() if d.is_gpu)
            used = max(0, self._gpu_free_before - free_after) or None
        gpu_names = ", ".join(f"{d.name} {d.description}" for d in self._gpus)
        self._loaded = LocalLoaded(
            model=ModelInfo(
                path=self.model_path,
                name=info.name,
                architecture=info.architecture,
                quantization=info.quantization,
                n_params=int(lib.llama_model_n_params(model)),
                size_bytes=int(lib.llama_model_size(model)),
                n_ctx_train=n_ctx_train or None,
                has_chat_template=info.chat_template is not None,
                desc=self._model.desc(),
            ),
            settings=EngineSettings(
                backend=", ".join(d.name for d in self._gpus) if gpu_layers else "CPU",
                n_ctx=int(lib.llama_n_ctx(ctx)) // n_seq,  # each sequence's
                n_batch=int(lib.llama_n_batch(ctx)),
                n_ubatch=int(lib.llama_n_ubatch(ctx)),
                n_threads=n_threads,
                n_threads_batch=cparams.n_threads_batch,
                n_gpu_layers=gpu_layers,
                gpu_offload=gpu,
                flash_attn=flash_attn,
                flash_attn_enabled=flash_attn_used(flash_attn, list(LOG_LINES)),
                repack=self._repack,
                repack_note=self._repack_note,
                type_k=cfg.cache_type_k,
                type_v=cfg.cache_type_v,
                tuned=cfg.tuned,
                tuned_for=cfg.workload if cfg.tuned else "",
                n_gpu_layers_asked=gpu_layers_asked(cfg, gpu),
                params={
                    **self._model_params,
                    **context_params(cparams),
                    **sequences,
                    **self._threadpool_record(),
                },
                device=gpu_names if gpu_layers else "CPU",
                n_layer_total=n_layer + 1,
                offload_note=self._offload_note,
                device_memory_bytes=used,
                memory=dataclasses.replace(
                    memory_report([*self._model_log, *LOG_LINES], int(lib.llama_n_ctx(ctx))),
                    file_resident_before=self._resident,
                ),
            ),
            load_s=load_s,
        )

    def _attach_threadpool(self, ctx: Any, cparams: Any) -> tuple[Threadpool, ...]:
        """The context's own threadpools where -C/--cpu-strict/--poll/--prio ask for one; a
        failure frees the context just made."""
        try:
            return attach_threadpool(
                ctx,
                self.config.threadpool,
                n_threads=cparams.n_threads,
                n_threads_batch=cparams.n_threads_batch,
            )
        except BaseException:
            llama_lib().llama_free(ctx)
            raise

    def _threadpool_record(self) -> dict[str, Any]:
        """llama-bench's cpu_mask, cpu_strict and poll, as handed to the pool that runs."""
        pools = self._ctx.pools if self._ctx is not None else ()
        return dict(pools[0].applied) if pools else {}

    def vocab_size(self) -> int:
        """Tokens in the model's vocabulary (loads the weights if they are not loaded)."""
        self.load_weights()
        assert self._model is not None
        return self._model.n_vocab

    def header(self) -> GGUFInfo:
        """The model file's GGUF header (read once; the weights need not be loaded)."""
        if self._info is None:
            self._info = read_gguf(self.model_path)
        return self._info

    # ---- tokens and text ---------------------------------------------------------------

    def tokenize(self, text: str, *, add_special: bool) -> list[int]:
        self.load_weights()
        assert self._model is not None
        return self._model.to_tokens(text, add_special=add_special)

    def piece(self, token: int, *, special: bool = False) -> bytes:
        assert self._model is not None
        return self._model.to_piece(token, special=special)

    def is_eog(self, token: int) -> bool:
        """Whether the token ends a generation (end of sequence or of turn)."""
        assert self._model is not None
        return self._model.is_eog(token)

    def render(self, request: Request) -> str:
        """The prompt text a request stands for: raw, or its messages through the chat template."""
        if request.prompt is not None:
            return request.prompt
        messages = [{"role": m.role, "content": m.content} for m in request.messages]
        try:
            if self._formatter is None:
                self._formatter = self._make_formatter()
            switch = (
                {}
                if request.sampling.think is None
                else {"enable_thinking": request.sampling.think}
            )
            return str(self._formatter(messages=messages, **switch).prompt)
        except Exception as e:  # jinja2's TemplateError and whatever a template raises
            first = (str(e).splitlines() or [""])[0]
            raise ChatTemplateError(f"{type(e).__name__}: {first}") from None

    def _make_formatter(self) -> Any:
        from .template import bounded_formatter

        assert self._info is not None
        lib = llama_lib()
        template = self.config.chat_template or self._info.chat_template or CHATML_TEMPLATE
        assert self._model is not None
        vocab = self._model.vocab
        bos = self.piece(lib.llama_vocab_bos(vocab), special=True).decode(errors="replace")
        eos = self.piece(lib.llama_vocab_eos(vocab), special=True).decode(errors="replace")
        return bounded_formatter(template, eos_token=eos, bos_token=bos)

    def request_tokens(self, request: Request) -> list[int]:
        return self._text_and_tokens(request)[1]

    def _text_and_tokens(self, request: Request) -> tuple[str, list[int]]:
        """The rendered prompt (empty for token ids) and its tokens."""
        self.load_weights()
        if request.token_ids is not None:
            return "", list(request.token_ids)
        text = self.render(request)
        if not text.strip():
            raise EmptyPromptError()
        # A chat template writes its own BOS; a raw prompt gets the model's usual specials.
        return text, self.tokenize(text, add_special=request.prompt is not None)

    def count_tokens(self, request: Request) -> int:
        return len(self.request_tokens(request))

    # ---- cache -------------------------------------------------------------------------

    @property
    def cached_tokens(self) -> int:
        return len(self._cache)

    def _truncate_cache(self, n: int) -> int:
        """Keep the KV entries of the first n cached tokens; returns how many were kept."""
        lib = llama_lib()
        mem = lib.llama_get_memory(self._ctx_ptr)
        if not lib.llama_memory_seq_rm(mem, 0, n, -1):  # e.g. recurrent models: all or nothing
            lib.llama_memory_clear(mem, True)
            n = 0
        del self._cache[n:]
        return n

    def reset(self) -> None:
        if self._ctx is not None:
            self._truncate_cache(0)

    # ---- generation --------------------------------------------------------------------

    def stream(self, request: Request, *, cancel: threading.Event | None = None) -> Iterator[Event]:
        cancel = cancel or threading.Event()
        if self._loaded is None:
            self._cancel = cancel  # a load stops at the next tensor when it is set
            yield LoadStarted(self.model_path)
            yield self.load()
        yield from self._generate(request, cancel)

    def new_sampler(self, sp: SamplingParams, seed: int, *, prompt: Sequence[int] = ()) -> Sampler:
        """A C sampler chain for these settings (perf counters on); the repeat penalty sees the
        prompt, as in llama-cli. The caller closes it."""
        lib = llama_lib()
        chain = Sampler(lib)
        try:
            if sp.repeat_penalty != 1.0 and sp.repeat_last_n != 0:
                assert self._model is not None
                n_vocab = self._model.n_vocab
                penalties = lib.llama_sampler_init_penalties(
                    n_vocab, sp.repeat_last_n, sp.repeat_penalty, 0.0, 0.0
                )
                chain.add(penalties)
                chain.accept(prompt[-sp.repeat_last_n :] if sp.repeat_last_n > 0 else ())
            if sp.temperature <= 0:
                chain.add(lib.llama_sampler_init_greedy())
                return chain
            if sp.top_k > 0:
                chain.add(lib.llama_sampler_init_top_k(sp.top_k))
            if sp.top_p < 1.0:
                chain.add(lib.llama_sampler_init_top_p(sp.top_p, 1))
            if sp.min_p > 0.0:
                chain.add(lib.llama_sampler_init_min_p(sp.min_p, 1))
            chain.add(lib.llama_sampler_init_temp(sp.temperature))
            chain.add(lib.llama_sampler_init_dist(seed))
        except BaseException:
            chain.close()
            raise
        return chain

    def _generate(self, request: Request, cancel: threading.Event) -> Iterator[Event]:
        """Prefill, then decode, then the stats; the three steps below do the work."""
        lib = llama_lib()
        loaded = self.load()
        if self.config.draft_model and request.sampling.draft:
            self._draft_runner()  # loaded before the clock starts: not a decode cost
        clock = PausedClock()
        lib.llama_perf_context_reset(self._ctx_ptr)
        cpu0 = cpu_sample()
        prompt_text, tokens = self._text_and_tokens(request)
        if len(tokens) + 1 > loaded.settings.n_ctx:
            raise PromptTooLongError(len(tokens), loaded.settings.n_ctx)
        reused = self._reuse_prefix(tokens) if request.keep_cache else self._truncate_cache(0)
        t_tok = clock.now()
        sp = request.sampling
        seed = sp.seed if sp.seed is not None else secrets.randbelow(2**31)
        chain = self.new_sampler(sp, seed, prompt=tokens)
        try:
            prefill = yield from self._prefill(tokens, reused, cancel, clock)
            decode = _Decoded()
            if not prefill.aborted:
                tagger = None  # random benchmark tokens have no thinking to tell apart
                if request.token_ids is None:
                    tagger = TokenTagger(thinking=opens_thinking(prompt_text))
                decode = yield from self._decode(
                    chain, sp, cancel, clock, tagger, decode_only=request.decode_only
                )
            perf = lib.llama_perf_context(self._ctx_ptr)
            sample_ms, n_sample = chain.perf()
            stats = GenerationStats(
                finish_reason=FINISH_INTERRUPTED if prefill.aborted else decode.finish,
                prompt_tokens=len(tokens),
                reused_tokens=reused,
                output_tokens=len(decode.times),
                template_tokenize_s=t_tok,
                prefill_s=prefill.seconds,
                first_sample_s=decode.first_sample_s,
                sample_s=decode.sample_s,
                decode_call_ms=decode.call_s * 1000 / decode.calls if decode.calls else None,
                itl_s=tuple(b - a for a, b in itertools.pairwise(decode.times)),
                e2e_s=clock.wall(),
                load_s=loaded.load_s,
                warmup_s=loaded.warmup_s,
                engine_prompt_eval_ms=float(perf.t_p_eval_ms),
                engine_eval_ms=float(perf.t_eval_ms),
                engine_n_prompt_eval=int(perf.n_p_eval),
                engine_n_eval=int(perf.n_eval),
                engine_sample_ms=sample_ms,
                engine_n_sample=n_sample,
                seed=seed if sp.temperature > 0 else None,
                prefilled_tokens=prefill.evaluated if prefill.aborted else None,
                background_cpus=measured_background(cpu0, cpu_sample()),
                thinking_tokens=decode.thinking_tokens,
                first_answer_s=decode.first_answer_s,
                draft_tokens=decode.drafted,
                accepted_tokens=decode.accepted,
                decode_steps=decode.steps,
                model=loaded.model,
                settings=loaded.settings,
            )
            yield Finished(stats=stats, text=decode.text, tail=decode.tail)
        finally:
            chain.close()
            # KV entries beyond what we recorded (an aborted chunk) must not survive.
            self._truncate_cache(len(self._cache))

    def _reuse_prefix(self, tokens: list[int]) -> int:
        """Keep the cached KV entries of the prompt's longest cached prefix (at least one token
        is always evaluated, for the logits); returns how many were kept."""
        limit = min(len(tokens) - 1, len(self._cache))
        n = 0
        while n < limit and self._cache[n] == tokens[n]:
            n += 1
        return self._truncate_cache(n)

    def _prefill(
        self, tokens: list[int], reused: int, cancel: threading.Event, clock: PausedClock
    ) -> Generator[Event, None, _Prefilled]:
        """llama_decode per chunk of n_batch new tokens, each timed up to a synchronize."""
        lib = llama_lib()
        n_batch = self.load().settings.n_batch
        new = tokens[reused:]
        arr = (lib.llama_token * len(new))(*new)
        done = _Prefilled()
        with clock.paused():
            yield PrefillProgress(reused, len(tokens), reused, 0.0)
        self._cancel = cancel
        lib.llama_set_abort_callback(self._ctx_ptr, self._abort_cb, None)
        try:
            for off in range(0, len(new), n_batch):
                if cancel.is_set():
                    done.aborted = True
                    break
                n = min(n_batch, len(new) - off)
                t_chunk = time.perf_counter()
                rc = self._decode_slice(arr, off, n)
                lib.llama_synchronize(self._ctx_ptr)
                if rc == 2 or (rc != 0 and cancel.is_set()):
                    done.aborted = True  # this chunk's time and tokens count nowhere
                    break
                if rc != 0:
                    raise EngineError(f"llama_decode failed during prefill (code {rc})")
                done.seconds += time.perf_counter() - t_chunk
                done.evaluated += n
                self._cache.extend(new[off : off + n])
                with clock.paused():
                    yield PrefillProgress(reused + off + n, len(tokens), reused, done.seconds)
        finally:
            lib.llama_set_abort_callback(self._ctx_ptr, lib.ggml_abort_callback(), None)
        return done

    def _decode(
        self,
        chain: Sampler,
        sp: SamplingParams,
        cancel: threading.Event,
        clock: PausedClock,
        tagger: TokenTagger | None = None,
        *,
        decode_only: bool = False,
    ) -> Generator[Event, None, _Decoded]:
        """The first token from the prefill's logits, then one llama_decode per token.

        The hot path: per token one llama_decode, one llama_synchronize, one sample (timed on
        its own, so that llama.cpp's sampling is told apart from llmrun's time), one piece of
        text and the Token event; every C function and bound method is looked up once.
        `decode_only` is llama-bench's tg: random tokens are fed, nothing is sampled."""
        lib = llama_lib()
        n_ctx = self.load().settings.n_ctx
        model = self._model
        assert model is not None
        ctx = self._ctx_ptr
        out = _Decoded()
        text = TextStream(sp.stop)
        parts: list[str] = []
        perf = time.perf_counter
        decode_c, sync_c = lib.llama_decode, lib.llama_synchronize
        sample_c, chain_ptr = chain._sample, chain.ptr
        is_eog = model.is_eog
        to_piece, feed, emit = model.to_piece, text.feed, parts.append
        times, cache = out.times, self._cache
        check_eog, max_tokens = not sp.ignore_eos, sp.max_tokens
        feed_tokens: list[int] = []
        if decode_only:  # llama-bench's tg: std::rand() % n_vocab after each step, unsampled
            rng = random.Random(sp.seed or 0)
            feed_tokens = [rng.randrange(model.n_vocab) for _ in range(max_tokens + 1)]
            feed_tokens.reverse()
            token = feed_tokens.pop()
        else:
            t_sample = perf()
            token = sample_c(chain_ptr, ctx, -1)
            out.first_sample_s = perf() - t_sample
        one = (lib.llama_token * 1)()
        batch_one = lib.llama_batch_get_one(one, 1)
        drafter: _Drafter | None = None
        if sp.draft and self.config.draft_model:
            drafter = _ModelDrafter(lib, sp.draft, self._cache, self._draft_runner())
        elif sp.draft:
            drafter = _Drafter(lib, sp.draft, self._cache)
        queued: list[int] = []  # accepted draft tokens: in the KV cache, not yet emitted
        pending = token  # the next token not yet in the KV cache
        sample_s = call_s = 0.0
        calls = 0
        try:
            while True:
                in_kv = bool(queued)
                token = queued.pop(0) if in_kv else pending
                stamp = perf() - clock.start - clock.paused_s
                if check_eog and is_eog(token):
                    out.finish = FINISH_STOP
                    break
                times.append(stamp)
                piece = "" if decode_only else feed(to_piece(token))
                emit(piece)
                thinking = tagger.tag(piece) if tagger is not None else False
                t_yield = perf()
                yield Token(len(times) - 1, piece, stamp, token, thinking)
                clock.paused_s += perf() - t_yield
                if text.stopped:
                    out.finish = FINISH_STOP
                    break
                if len(times) >= max_tokens:
                    out.finish = FINISH_LENGTH
                    break
                if len(cache) >= n_ctx:  # no room for the next token's KV entry
                    out.finish = FINISH_CONTEXT
                    break
                if cancel.is_set():
                    out.finish = FINISH_INTERRUPTED
                    break
                if in_kv:
                    continue
                if drafter is not None:
                    room = min(n_ctx - len(cache) - 1, max_tokens - len(times))
                    queued, pending = drafter.step(ctx, chain, token, max(0, room))
                    continue
                one[0] = token
                t_call = perf()
                rc = decode_c(ctx, batch_one)
                if rc != 0:
                    raise EngineError(f"llama_decode failed during generation (code {rc})")
                sync_c(ctx)  # llama.cpp's eval counter stops here; the sample is timed apart
                t_sample = perf()
                call_s += t_sample - t_call
                calls += 1
                cache.append(token)
                if decode_only:
                    pending = feed_tokens.pop()
                    continue
                pending = sample_c(chain_ptr, ctx, -1)
                sample_s += perf() - t_sample
        finally:
            out.sample_s = sample_s
            out.call_s, out.calls = call_s, calls
            if drafter is not None:
                drafter.close()
                out.drafted, out.accepted, out.steps = (
                    drafter.drafted,
                    drafter.accepted,
                    drafter.steps,
                )
        out.tail = text.flush()
        out.text = "".join(parts) + out.tail
        if tagger is not None and tagger.seen_thinking:
            out.thinking_tokens = tagger.thinking_tokens
            if tagger.first_answer is not None:
                out.first_answer_s = out.times[tagger.first_answer]
        return out

    def _decode_slice(self, arr: Any, off: int, n: int) -> int:
        """llama_decode of tokens arr[off:off + n], without copying them."""
        lib = llama_lib()
        ptr = ctypes.cast(
            ctypes.addressof(arr) + off * ctypes.sizeof(lib.llama_token), lib.llama_token_p
        )
        return int(lib.llama_decode(self._ctx_ptr, lib.llama_batch_get_one(ptr, n)))

    # ---- direct access for checks and benchmarks ---------------------------------------

    def perplexity(
        self, tokens: list[int], *, n_ctx: int, cancel: threading.Event | None = None
    ) -> tuple[float, int]:
        """llama-perplexity's method: the text in non-overlapping windows of n_ctx tokens, each
        evaluated from an empty cache, and in each window the second half's predictions of
        their next token scored (the first half only gives them context). Returns the
        perplexity, exp(mean negative log-likelihood), and the number of tokens scored."""
        import numpy as np

        loaded = self.load()
        if loaded.settings.n_ctx < n_ctx:
            raise BadRequestError(
                f"perplexity windows of {n_ctx} tokens need a context that"
                f" large; this one holds {loaded.settings.n_ctx}"
            )
        if n_ctx < 4 or len(tokens) < n_ctx:
            raise BadRequestError(
                f"perplexity needs at least one window of {n_ctx} tokens;"
                f" the text has {len(tokens)}"
            )
        lib = llama_lib()
        assert self._model is not None
        n_vocab, n_batch = self._model.n_vocab, loaded.settings.n_batch
        first = n_ctx // 2
        nll, scored = 0.0, 0
        batch = Batch(lib, n_batch)
        try:
            for start in range(0, len(tokens) - n_ctx + 1, n_ctx):
                window = tokens[start : start + n_ctx]
                self.reset()
                for off in range(0, n_ctx, n_batch):
                    if cancel is not None and cancel.is_set():
                        raise BadRequestError("perplexity interrupted")
                    n = min(n_batch, n_ctx - off)
                    for i in range(n):
                        pos = off + i
                        batch.set(i, window[pos], pos, 0, first <= pos < n_ctx - 1)
                    batch.n_tokens = n
                    if lib.llama_decode(self._ctx_ptr, batch.struct) != 0:
                        raise EngineError("llama_decode failed while scoring perplexity")
                    for i in range(n):
                        pos = off + i
                        if not first <= pos < n_ctx - 1:
                            continue
                        ptr = lib.llama_get_logits_ith(self._ctx_ptr, i)
                        logits = np.ctypeslib.as_array(ptr, shape=(n_vocab,)).astype(np.float64)
                        top = logits.max()
                        log_z = top + math.log(float(np.exp(logits - top).sum()))
                        nll += log_z - logits[window[pos + 1]]
                        scored += 1
        finally:
            batch.close()
            self.reset()
        return math.exp(nll / scored), scored

    def eval_tokens(self, tokens: list[int], *, cancel: threading.Event | None = None) -> None:
        """Append tokens to the cache in chunks of n_batch (no sampling, no timing).

        Setting `cancel` stops within the running chunk; the cache then holds what completed."""
        n_batch = self.load().settings.n_batch
        lib = llama_lib()
        arr = (lib.llama_token * len(tokens))(*tokens)
        cancel = cancel or threading.Event()
        self._cancel = cancel
        lib.llama_set_abort_callback(self._ctx_ptr, self._abort_cb, None)
        try:
            for off in range(0, len(tokens), n_batch):
                if cancel.is_set():
                    break
                n = min(n_batch, len(tokens) - off)
                rc = self._decode_slice(arr, off, n)
                if rc != 0 and cancel.is_set():
                    break
                if rc != 0:
                    raise EngineError(f"llama_decode failed (code {rc})")
                self._cache.extend(tokens[off : off + n])
            lib.llama_synchronize(self._ctx_ptr)
        finally:
            lib.llama_set_abort_callback(self._ctx_ptr, lib.ggml_abort_callback(), None)
            self._truncate_cache(len(self._cache))

    def make_context(
        self,
        *,
        n_seq: int,
        n_ctx: int,
        n_batch: int,
        n_ubatch: int | None = None,
        flash_attn: str | None = None,
        kv_unified: bool | None = None,
        perf: bool = False,
    ) -> Context:
        """Another context on the loaded weights, e.g. the batched engine's for `n_seq`
        sequences, with this runner's threads, (by default) flash attention and KV layout
        (`kv_unified`; None: the config's). The runner closes it, if its user has not, before
        it frees the model."""
        lib = llama_lib()
        loaded = self.load()
        assert self._model is not None
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = n_batch
        cparams.n_ubatch = min(n_ubatch or n_batch, n_batch)
        cparams.n_seq_max = n_seq
        cparams.kv_unified = self.config.kv_unified if kv_unified is None else kv_unified
        cparams.n_threads = loaded.settings.n_threads
        cparams.n_threads_batch = loaded.settings.n_threads_batch
        cparams.flash_attn_type = _flash_attn_type(lib, flash_attn or loaded.settings.flash_attn)
        cparams.no_perf = not perf
        ptr = lib.llama_init_from_model(self._model.ptr, cparams)
        if not ptr:
            raise EngineError(
                f"llama.cpp could not create a context for {n_seq} sequences ({last_log_error()})"
            )
        context = Context(lib, ptr, self._attach_threadpool(ptr, cparams))
        self.contexts_made += 1
        self._contexts = [c for c in self._contexts if c.ptr is not None] + [context]
        return context

    @property
    def context(self) -> Context:
        """The runner's own context (load() first): a batched engine may use it when it was
        made for its sequences (`load(n_seq=...)`); the runner still closes it."""
        assert self._ctx is not None, "no context: load() first"
        return self._ctx

    @property
    def _ctx_ptr(self) -> Any:
        assert self._ctx is not None, "no context: load() first"
        return self._ctx.ptr

    def _free_context(self) -> None:
        if self._ctx is not None:
            self._ctx.close()
            self._ctx = None
        self._n_seq, self._n_ctx_seq = 1, 0
        self._loaded = None
        self.warmed_on = None
        self._cache.clear()

    def close(self) -> None:
        for context in self._contexts:  # contexts go before the model they were made from
            context.close()
        self._contexts.clear()
        self._free_context()
        if self._model is not None:
            self._model.close()
            self._model = None
        if self._draft is not None:
            self._draft.close()
            self._draft = None

    def __enter__(self) -> LlamaCppRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# Used when a model has no chat template of its own (llama.cpp falls back to ChatML too).
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
