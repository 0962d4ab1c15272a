"""llama.cpp contexts on loaded weights: the runner's own and the batched engine's, their
thread pools (-C, --cpu-strict, --poll, --prio) and the warm-up decode.

Each function does one step of making a context: its parameters from the config, the memory
and thread checks before llama.cpp sees them, its creation with its pools, and its first
decode. The record of what a context runs with is load_record.py's.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

from .config import DEFAULT_N_BATCH, EngineConfig
from .errors import ContextError, EngineError
from .handles import Context, Model
from .library import LOG_LINES, last_log_error, llama_lib
from .limits import CACHE_TYPE_IDS, MAX_CTX, SettingError, check_memory, estimate_memory
from .stats import EngineSettings
from .system import default_threads
from .threadpool import Threadpool, ThreadpoolSettings
from .threadpool import attach as attach_threadpool


def flash_attn_type(lib: Any, name: str) -> int:
    """llama.cpp's code for flash attention auto, on or off."""
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


def own_context_params(path: str, cfg: EngineConfig, *, n_ctx: int, n_seq: int, asked: int) -> Any:
    """The runner's own context's llama_context_params: n_seq sequences of n_ctx tokens each,
    batches of at most -c (`asked`) tokens, the config's threads, attention and KV types."""
    if not 1 <= n_ctx <= MAX_CTX:
        raise SettingError(path, f"n_ctx {n_ctx} is out of range 1..{MAX_CTX}")
    lib = llama_lib()
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
    # llama.cpp decides for this model and device
    cparams.flash_attn_type = flash_attn_type(lib, cfg.flash_attn or "auto")
    _set_kv_types(cparams, cfg)
    cparams.no_perf = False
    cparams.offload_kqv = not cfg.no_kv_offload
    cparams.embeddings = cfg.embeddings  # llama.cpp outputs the logits too (output_all)
    cparams.op_offload = not cfg.no_op_offload
    return cparams


def _set_kv_types(cparams: Any, cfg: EngineConfig) -> None:
    """The KV cache types as ggml's type ids, from llmrun's table (the bindings lack some,
    bf16 among them); a name outside it is the option's error, not the model file's."""
    for name, flag, value in (
        ("type_k", "-ctk/--cache-type-k", cfg.cache_type_k),
        ("type_v", "-ctv/--cache-type-v", cfg.cache_type_v),
    ):
        ggml_type = CACHE_TYPE_IDS.get(value.lower())
        if ggml_type is None:  # check_engine refuses it first; kept for a caller that did not
            raise SettingError(flag, f"{value!r} is not one of {', '.join(CACHE_TYPE_IDS)}")
        setattr(cparams, name, ggml_type)


def check_context(cfg: EngineConfig, model: Model, info: Any, cparams: Any) -> None:
    """Refuse a context that would not fit in memory, or threads a bad mask would pin, before
    llama.cpp allocates anything."""
    check_memory(
        estimate_memory(
            info,
            n_ctx=cparams.n_ctx,
            n_ubatch=cparams.n_ubatch,
            type_k=cfg.cache_type_k,
            type_v=cfg.cache_type_v,
            n_vocab=model.n_vocab,
        ),
        cparams.n_ctx,
    )
    for n in {cparams.n_threads, cparams.n_threads_batch}:  # a bad mask before any work
        cfg.threadpool.placement(n)


def create_context(path: str, model: Model, cparams: Any, pools: ThreadpoolSettings) -> Context:
    """The context on the weights of the file at `path`, with its own thread pools where the
    settings ask for them; llama.cpp's log of its creation is in LOG_LINES afterwards."""
    lib = llama_lib()
    LOG_LINES.clear()
    ptr = lib.llama_init_from_model(model.ptr, cparams)
    if not ptr:
        raise ContextError(path, last_log_error())
    return Context(lib, ptr, _attach_pools(ptr, cparams, pools))


def _attach_pools(ctx: Any, cparams: Any, pools: ThreadpoolSettings) -> tuple[Threadpool, ...]:
    """The context's own threadpools where -C/--cpu-strict/--poll/--prio ask for one; a
    failure frees the context just made."""
    try:
        return attach_threadpool(
            ctx, pools, n_threads=cparams.n_threads, n_threads_batch=cparams.n_threads_batch
        )
    except BaseException:
        llama_lib().llama_free(ctx)
        raise


def pools_record(context: Context | None) -> dict[str, Any]:
    """llama-bench's cpu_mask, cpu_strict and poll, as handed to the pool that runs."""
    pools = context.pools if context is not None else ()
    return dict(pools[0].applied) if pools else {}


def batched_context(
    model: Model,
    settings: EngineSettings,
    pools: ThreadpoolSettings,
    *,
    n_seq: int,
    n_ctx: int,
    n_batch: int,
    kv_unified: bool,
) -> Context:
    """Another context on the weights for `n_seq` sequences (a batched engine's), with the
    loaded context's threads, flash attention and KV types, one ubatch a batch, perf counters
    off."""
    lib = llama_lib()
    cparams = lib.llama_context_default_params()
    cparams.n_ctx = n_ctx
    cparams.n_batch = cparams.n_ubatch = n_batch
    cparams.n_seq_max = n_seq
    cparams.kv_unified = kv_unified
    cparams.n_threads = settings.n_threads
    cparams.n_threads_batch = settings.n_threads_batch
    cparams.flash_attn_type = flash_attn_type(lib, settings.flash_attn)
    # the loaded context's KV types too: these contexts were f16 whatever -ctk/-ctv said
    cparams.type_k = CACHE_TYPE_IDS[settings.type_k.lower()]
    cparams.type_v = CACHE_TYPE_IDS[settings.type_v.lower()]
    cparams.no_perf = True
    ptr = lib.llama_init_from_model(model.ptr, cparams)
    if not ptr:
        raise EngineError(
            f"llama.cpp could not create a context for {n_seq} sequences ({last_log_error()})"
        )
    return Context(lib, ptr, _attach_pools(ptr, cparams, pools))


@contextlib.contextmanager
def abort_on(ctx: Any, cancel: threading.Event | None) -> Iterator[None]:
    """Inside the block, setting `cancel` stops the context's decodes within a graph, as the
    runner's own context does (prefix_cache.py): llama.cpp asks the hook between the graph's
    nodes, and llama_decode then returns 2. The signal handler that sets it runs in the hook,
    on the thread that decodes. Without `cancel`, nothing changes."""
    if cancel is None:
        yield
        return
    lib = llama_lib()
    hook = lib.ggml_abort_callback(lambda _data: cancel.is_set())  # referenced until reset
    lib.llama_set_abort_callback(ctx, hook, None)
    try:
        yield
    finally:
        lib.llama_set_abort_callback(ctx, lib.ggml_abort_callback(), None)


def warm_up_decode(model: Model, ctx: Any, n_batch: int) -> float:
    """llama-cli's warm-up: one decode of BOS and EOS (a GPU backend sets itself up on its
    first decode), then the cache and llama.cpp's counters cleared, so that the first
    request's prefill is the steady-state figure. Returns its seconds."""
    lib = llama_lib()
    t0 = time.perf_counter()
    vocab = model.vocab
    tokens = [t for t in (lib.llama_vocab_bos(vocab), lib.llama_vocab_eos(vocab)) if t >= 0]
    arr = (lib.llama_token * max(1, len(tokens)))(*(tokens or [0]))
    n = max(1, min(len(tokens), n_batch))
    rc = lib.llama_decode(ctx, lib.llama_batch_get_one(arr, n))
    lib.llama_synchronize(ctx)
    lib.llama_memory_clear(lib.llama_get_memory(ctx), True)
    lib.llama_perf_context_reset(ctx)
    if rc != 0:
        raise EngineError(f"llama_decode failed during the warm-up (code {rc})")
    return time.perf_counter() - t0
