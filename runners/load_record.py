"""What a load runs with, as llama-bench records it: the model's facts, the settings read
back from llama.cpp's context, the device that runs it and llama.cpp's account of memory."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from . import devices as dv
from .base import LocalLoaded
from .config import EngineConfig
from .contexts import kv_unified_of, pools_record
from .handles import Context
from .library import LOG_LINES, llama_lib
from .loading import Weights, gpu_layers_asked, offloaded_layers
from .stats import EngineSettings, MemoryReport, ModelInfo, peak_rss_bytes

_BUFFER = re.compile(r"(\S+)\s+(model|KV|compute|output) buffer size =\s+([0-9.]+) MiB")


def memory_report(log: list[str], n_ctx: int) -> MemoryReport:
    """llama.cpp's own account of its buffers (`CPU_Mapped model buffer size = 92.10 MiB`,
    `CPU KV buffer size`, `CPU compute buffer size`), read from its log of this load, per
    buffer (`RPC0[127.0.0.1:50052] KV buffer size`: the KV of the layers on that server)."""
    buffers: dict[str, dict[str, int]] = {"model": {}, "KV": {}, "compute": {}, "output": {}}
    for line in log:
        for name, kind, mib in _BUFFER.findall(line):
            per = buffers[kind]  # each kind per buffer: with --rpc, RPC0[host:port]'s own
            per[name] = per.get(name, 0) + round(float(mib) * 2**20)
    kv, compute = buffers["KV"], buffers["compute"]
    return MemoryReport(
        buffers["model"],
        sum(kv.values()),
        sum(compute.values()),
        sum(buffers["output"].values()),
        n_ctx,
        peak_rss_bytes(),
        kv=kv,
        compute=compute,
    )


_LAYER = re.compile(r"layer\s+[0-9]+ assigned to device (\S+?),")


def layers_by_device(log: list[str]) -> dict[str, int]:
    """How many layers (the output layer counted) llama.cpp put on each device, from its
    load log (`load_tensors: layer  16 assigned to device RPC0, is_swa = 0`)."""
    counts: dict[str, int] = {}
    for line in log:
        for name in _LAYER.findall(line):
            counts[name] = counts.get(name, 0) + 1
    return counts


def _device_text(weights: Weights) -> str:
    """The GPUs the layers went to; with RPC servers, each with its layers (the rest are the
    CPU's), as llama.cpp's log of the load counts them."""
    layers = layers_by_device(weights.log) if any(d.backend == "RPC" for d in weights.gpus) else {}
    return ", ".join(
        f"{d.name} {d.description}" + (f" ({layers[d.name]} layers)" if d.name in layers else "")
        for d in weights.gpus
    )


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


def context_params(p: Any) -> dict[str, Any]:
    """llama-bench's context-side fields, read back from the llama_context_params handed over."""
    return {
        "no_kv_offload": not bool(p.offload_kqv),
        "embeddings": bool(p.embeddings),
        "no_op_offload": int(not bool(p.op_offload)),
    }


def model_info(weights: Weights, n_ctx_train: int | None) -> ModelInfo:
    """The model's facts, from its header and from llama.cpp."""
    lib, info, model = llama_lib(), weights.info, weights.model
    return ModelInfo(
        path=weights.path,
        name=info.name,
        architecture=info.architecture,
        quantization=info.quantization,
        n_params=int(lib.llama_model_n_params(model.ptr)),
        size_bytes=int(lib.llama_model_size(model.ptr)),
        n_ctx_train=n_ctx_train or None,
        has_chat_template=info.chat_template is not None,
        desc=model.desc(),
    )


def _gpu_layers(weights: Weights) -> tuple[int, int]:
    """The layers on the GPUs and the model's layers, output layer left out."""
    lib, info = llama_lib(), weights.info
    n_layer_meta = int(info.metadata.get(f"{info.architecture}.block_count", 0) or 0)
    n_layer = lib.llama_model_n_layer(weights.model.ptr) or n_layer_meta
    gpu_layers = offloaded_layers(weights.planned_layers, n_layer) if weights.gpus else 0
    return gpu_layers, n_layer


def _device_memory_used(weights: Weights, gpu_layers: int) -> int | None:
    """The GPUs' memory the load took, from their free bytes before and after."""
    if not gpu_layers:
        return None
    free_after = sum(d.free_bytes or 0 for d in dv.query().devices() if d.is_gpu)
    return max(0, weights.gpu_free_before - free_after) or None


def load_record(
    weights: Weights,
    cfg: EngineConfig,
    context: Context,
    cparams: Any,
    *,
    n_seq: int,
    n_ctx_train: int | None,
    load_s: float,
) -> LocalLoaded:
    """The load as the runner reports it; read right after the context's creation, whose log
    (LOG_LINES) tells how llama.cpp resolved flash attention and sized its buffers."""
    lib, ctx = llama_lib(), context.ptr
    gpu = bool(lib.llama_supports_gpu_offload())
    gpu_layers, n_layer = _gpu_layers(weights)
    used = _device_memory_used(weights, gpu_layers)
    gpu_names = _device_text(weights)
    flash_attn = cfg.flash_attn or "auto"
    sequences = (
        {}
        if n_seq == 1
        else {"n_seq_max": int(lib.llama_n_seq_max(ctx)), "kv_unified": kv_unified_of(lib, ctx)}
    )
    settings = EngineSettings(
        backend=", ".join(d.name for d in weights.gpus) if gpu_layers else "CPU",
        n_ctx=int(lib.llama_n_ctx(ctx)) // n_seq,  # each sequence's
        n_batch=int(lib.llama_n_batch(ctx)),
        n_ubatch=int(lib.llama_n_ubatch(ctx)),
        n_threads=cparams.n_threads,
        n_threads_batch=cparams.n_threads_batch,
        n_gpu_layers=gpu_layers,
        gpu_offload=gpu,
        flash_attn=flash_attn,
        flash_attn_enabled=flash_attn_used(flash_attn, list(LOG_LINES)),
        repack=weights.repack,
        repack_note=weights.repack_note,
        type_k=cfg.cache_type_k,
        type_v=cfg.cache_type_v,
        tuned=cfg.tuned,
        tuned_for=cfg.workload if cfg.tuned else "",
        n_gpu_layers_asked=gpu_layers_asked(cfg, gpu),
        params={
            **weights.params,
            **context_params(cparams),
            **sequences,
            **pools_record(context),
        },
        device=gpu_names if gpu_layers else "CPU",
        n_layer_total=n_layer + 1,
        offload_note=weights.offload_note,
        device_memory_bytes=used,
        memory=dataclasses.replace(
            memory_report([*weights.log, *LOG_LINES], int(lib.llama_n_ctx(ctx))),
            file_resident_before=weights.resident,
        ),
    )
    return LocalLoaded(
        model=model_info(weights, n_ctx_train),
        settings=settings,
        load_s=load_s,
        probe_s=weights.probe_s,
    )
