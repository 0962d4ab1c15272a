"""A GGUF model's weights loaded and placed: GPU layers, repacking, tensor overrides, devices.

llama-bench's model-side settings (-ngl, -sm, -mg, -ts, -ot, -ncmoe, -dev, --repack, load and
lazy modes) become the `llama_model_params` handed to llama.cpp; what was asked, planned and
found while loading is kept beside the weights for the load's record (load_record.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import time
from dataclasses import dataclass
from typing import Any

from . import devices as dv
from . import rpc as rpc_backend
from .config import (
    DEFAULT_N_BATCH,
    DEFAULT_N_CTX,
    LAZY_MODES,
    LOAD_MODES,
    SPLIT_MODES,
    EngineConfig,
)
from .errors import BadRequestError, LoadCancelledError, ModelLoadError
from .gguf import GGUFInfo, read_gguf
from .handles import Model
from .library import LOG_LINES, last_log_error, llama_lib
from .limits import MemoryNeed, SettingError, estimate_memory, plan_offload
from .probe import repack_verdict
from .system import evict_from_page_cache, resident_fraction


@dataclass
class Weights:
    """Loaded weights and the facts of their load that the context's record reports."""

    path: str
    model: Model
    info: GGUFInfo
    load_s: float  # reading the header and loading the weights (not the repack probe)
    repack: bool
    repack_note: str
    params: dict[str, Any]  # llama-bench's model-side fields, as handed to llama.cpp
    offload_note: str
    log: list[str]  # llama.cpp's log of the load: the weights' buffer sizes are there
    resident: float | None  # the file's share in the page cache before the load
    gpus: list[dv.Device]
    planned_layers: int  # the layers planned for the GPUs (-1: all)
    gpu_free_before: int  # the GPUs' free bytes before the load
    probe_s: float | None = None  # the repack probe, when it ran for this load (its own figure)


def _place(lib: Any, mparams: Any, cfg: EngineConfig) -> tuple[dict[str, Any], list[Any]]:
    """-ts, -ot, -ncmoe and -dev into the params; returns the record of model-side fields and
    the C arrays the params point to, to be kept alive until the load returns."""
    kept: list[Any] = []
    placed: dict[str, Any] = {}  # the record's fields that say more than the params' pointers
    shares = [float(x) for x in (cfg.tensor_split or "").split("/") if x]
    if shares:
        split = (ctypes.c_float * max(len(shares), int(lib.llama_max_devices())))(*shares)
        mparams.tensor_split = split
        kept.append(split)
    pairs = dv.tensor_overrides(cfg.tensor_overrides)  # recorded as given; -ncmoe's on its own
    given = ";".join(f"{p}={b}" for p, b in pairs)
    pairs += [(p, "CPU") for p in dv.moe_cpu_patterns(cfg.n_cpu_moe)]
    if pairs:  # a NULL-terminated array of BuftOverride
        arr = (dv.BuftOverride * (len(pairs) + 1))()
        for i, (pattern, buffer) in enumerate(pairs):
            buft = dv.buffer_type(buffer)
            if buft is None:
                raise BadRequestError(f"-ot: no buffer type '{buffer}' in this llama.cpp build")
            encoded = pattern.encode()
            kept.append(encoded)
            arr[i].pattern, arr[i].buft = encoded, buft
        mparams.tensor_buft_overrides = ctypes.cast(arr, ctypes.c_void_p)
        kept.append(arr)
        placed["tensor_buft_overrides"] = given or "none"
    placed["n_cpu_moe"] = cfg.n_cpu_moe
    if cfg.devices is not None and cfg.devices.strip().lower() != "auto":  # llama-bench's default
        none = cfg.devices.strip().lower() == "none"
        names = [] if none else [n for n in cfg.devices.split("/") if n.strip()]
        devs = (ctypes.c_void_p * (len(names) + 1))()  # NULL-terminated ggml_backend_dev_t
        for i, name in enumerate(names):
            dev = dv.device_by_name(name.strip())
            if dev is None:
                raise BadRequestError(f"-dev: no device '{name}' (llmrun bench --list-devices)")
            devs[i] = dev
        mparams.devices = ctypes.cast(devs, ctypes.c_void_p)
        kept.append(devs)
        placed["devices"] = cfg.devices
    record = {**model_params(mparams), **placed}
    if cfg.rpc:  # llama-bench's -rpc servers, as given
        record["rpc"] = cfg.rpc
    if shares:  # as llama-bench writes it: 3.00/1.00
        record["tensor_split"] = "/".join(f"{x:.2f}" for x in shares)
    return record, kept


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


def context_size(cfg: EngineConfig, n_ctx_train: int | None) -> int:
    """-c as given; None: min(4096, the training context); 0: the training context."""
    if cfg.n_ctx is None:
        return min(DEFAULT_N_CTX, n_ctx_train) if n_ctx_train else DEFAULT_N_CTX
    if cfg.n_ctx == 0:
        return n_ctx_train or DEFAULT_N_CTX
    return cfg.n_ctx


def memory_need(
    cfg: EngineConfig, info: GGUFInfo, *, n_seq: int = 1, n_ctx: int | None = None
) -> MemoryNeed:
    """The weights, the KV cache of n_seq sequences of n_ctx tokens each (default: -c) and
    the compute buffer: what decides how many layers fit on a GPU."""
    per_seq = n_ctx or context_size(cfg, info.n_ctx_train)
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


def choose_repack(
    path: str, cfg: EngineConfig, info: GGUFInfo, cancel: threading.Event | None = None
) -> tuple[bool, str, float | None]:
    """Repacking as asked, or by default, but never where a probe saw it crash; and the
    probe's time when it ran now (None: the kept verdict, or none asked). `cancel` ends a
    probe under way."""
    if cfg.repack is False:
        return False, "off (asked)", None
    verdict = repack_verdict(path, info.quantization, cancel)
    if not verdict.safe:
        return False, f"off: {verdict.why}", verdict.probe_s
    return True, "on (asked)" if cfg.repack else "on (probed safe)", verdict.probe_s


def _set_modes(mparams: Any, cfg: EngineConfig, path: str) -> None:
    """Load and lazy modes, pinned host memory, split mode and main GPU, as asked."""
    if cfg.load_mode is not None:
        mparams.load_mode = LOAD_MODES[cfg.load_mode]
    lazy = {name: code for code, name in LAZY_MODES.items()}.get(cfg.lazy_mode)
    if lazy is None:
        raise SettingError(path, f"lazy_mode {cfg.lazy_mode!r} is not on, auto or off")
    mparams.lazy_mode = lazy
    mparams.no_host = cfg.no_host
    if cfg.split_mode is not None:
        mparams.split_mode = {v: k for k, v in SPLIT_MODES.items()}[cfg.split_mode]
    if cfg.main_gpu is not None:
        mparams.main_gpu = cfg.main_gpu


def load_weights(
    path: str,
    cfg: EngineConfig,
    *,
    n_seq: int = 1,
    n_ctx: int | None = None,
    cancel: threading.Event,
) -> Weights:
    """Check the file and load its weights with the config's placement. On a GPU, the layers
    offloaded are those that fit beside the KV cache of `n_seq` sequences of `n_ctx` tokens
    (default: -c). Setting `cancel` stops the repacking probe's child at once and the load at
    the next tensor (LoadCancelledError)."""
    lib = llama_lib()  # the bindings' import (a first load's) is not the model's load time
    if cfg.rpc:  # the servers' devices join llama.cpp's list before it plans the offload
        limit = rpc_backend.wait_limit()
        rpc_backend.attach(rpc_backend.parse_endpoints(cfg.rpc))
    t0 = time.perf_counter()
    info = read_gguf(path)
    mparams = lib.llama_model_default_params()
    can_offload = bool(lib.llama_supports_gpu_offload())
    gpus = [d for d in dv.query().devices() if d.is_gpu] if can_offload else []
    gpu_free_before = sum(d.free_bytes or 0 for d in gpus)  # this machine's GPUs
    if can_offload and cfg.rpc:  # the servers' devices first, as llama.cpp lists them
        gpus = [*rpc_backend.devices(), *gpus]
    n_layer = int(info.metadata.get(f"{info.architecture}.block_count", 0) or 0)
    # the estimate that decides how many layers fit: every sequence's KV
    need = memory_need(cfg, info, n_seq=n_seq, n_ctx=n_ctx) if gpus else None
    layers, offload_note = plan_offload(
        gpu_layers_asked(cfg, can_offload),
        can_offload=can_offload,
        n_layer=n_layer,
        need=need,
        gpus=[(d.name, d.free_bytes) for d in gpus],
    )
    mparams.n_gpu_layers = 0x7FFFFFFF if layers < 0 else layers
    repack, repack_note, probe_s = choose_repack(path, cfg, info, cancel)
    if cancel.is_set():  # in the probe, or before it: no load begins
        raise LoadCancelledError(path)
    mparams.use_extra_bufts = repack
    _set_modes(mparams, cfg, path)
    params, kept = _place(lib, mparams, cfg)  # `kept` alive until the load returns
    # Called as the tensors load: returning False stops a long load at Ctrl-C.
    progress = lib.llama_progress_callback(lambda _p, _data: not cancel.is_set())
    mparams.progress_callback = progress
    if cfg.cold:
        evict_from_page_cache(path)
    resident = resident_fraction(path)
    LOG_LINES.clear()
    # ggml-rpc's connections, opened by the load, have a deadline from their start: none may
    # wait forever (then the run's, for good)
    with rpc_backend.bounding(limit) if cfg.rpc else contextlib.nullcontext():
        model = lib.llama_model_load_from_file(path.encode(), mparams)
    del kept
    if not model:
        if cancel.is_set():
            raise LoadCancelledError(path)
        raise ModelLoadError(path, last_log_error())
    return Weights(
        path=path,
        model=Model(lib, model),
        info=info,
        load_s=time.perf_counter() - t0 - (probe_s or 0.0),
        repack=repack,
        repack_note=repack_note,
        params=params,
        offload_note=offload_note,
        log=list(LOG_LINES),
        resident=resident,
        gpus=gpus,
        planned_layers=layers,
        gpu_free_before=gpu_free_before,
        probe_s=probe_s,
    )
