"""The engine's load-time settings and their defaults: a plain record that the CLI, bench,
tuning and the engine share without importing the engine itself."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .threadpool import ThreadpoolSettings

DEFAULT_N_CTX = 4096
DEFAULT_N_BATCH = 512

# What `llmrun bench` runs unless --tuned: llama-bench's own defaults (llama-bench.cpp,
# cmd_params_defaults: -b 2048 -ub 512 -fa auto -ngl -1; its -t is the physical or performance
# cores, as llmrun's), so that compare-llama-bench.py pairs the two tools' records.
LLAMA_BENCH_N_BATCH, LLAMA_BENCH_N_UBATCH, LLAMA_BENCH_NGL = 2048, 512, -1

# llama.cpp's load modes by the names llama-bench's -lm takes (-mmp 0/1 are none/mmap)
LOAD_MODES = {"auto": -1, "none": 0, "mmap": 1, "mlock": 2, "mmap+mlock": 3, "dio": 4}
SPLIT_MODES = {0: "none", 1: "layer", 2: "row", 3: "tensor"}
LAZY_MODES = {0: "off", 1: "auto", 2: "on"}


@dataclass(frozen=True)
class EngineConfig:
    """Load-time settings, named as llama.cpp names them. None means: choose for this machine."""

    n_ctx: int | None = None  # None: min(4096, training context); 0: the training context
    n_batch: int | None = None  # prefill chunk size; None: 512
    n_ubatch: int | None = None  # None: 512 (at most n_batch)
    n_threads: int | None = None  # None: physical cores
    n_threads_batch: int | None = None
    n_gpu_layers: int | None = None  # -1 or more than the model has: all; None: all where
    # this llama.cpp build can offload (as llama-bench and Ollama), else 0
    flash_attn: str | None = None  # None: llama.cpp's own "auto" (it probes the device)
    repack: bool | None = None  # weight repacking for faster CPU kernels; None: where safe
    cache_type_k: str = "f16"  # KV cache element types (llama.cpp's -ctk/-ctv)
    cache_type_v: str = "f16"
    tuned: bool = False
    workload: str = "chat"  # which tuned settings apply: chat (short prompt) or document
    load_mode: str | None = None  # llama.cpp's load mode (LOAD_MODES); None: its default
    cold: bool = False  # drop the file from the page cache before loading (bench --cold)
    chat_template: str | None = None  # a Jinja chat template in place of the model's own
    draft_model: str | None = None  # a small model with the same vocabulary that drafts
    split_mode: str | None = None  # across GPUs: none, layer, row, tensor (GPU builds)
    main_gpu: int | None = None
    tensor_split: str | None = None  # shares per GPU, "3/1"
    tensor_overrides: str | None = None  # llama-bench's -ot: "pattern=BUFFER;pattern=BUFFER"
    n_cpu_moe: int = 0  # the expert tensors of the first N layers stay on the CPU
    devices: str | None = None  # llama-bench's -dev: "CUDA0/CUDA1", or "none"
    rpc: str | None = None  # llama.cpp's --rpc: "host:port,host:port" (runners/rpc.py)
    no_kv_offload: bool = False  # keep the KV cache in host memory (GPU builds)
    warmup: bool = True  # one decode while loading, as llama-cli does (--no-warmup: none)
    threadpool: ThreadpoolSettings = field(default_factory=ThreadpoolSettings)  # -C, --poll
    lazy_mode: str = "auto"  # llama-bench's -lzm: tensors read on demand (LAZY_MODES' names)
    no_host: bool = False  # llama-bench's --no-host: no host buffer, so extra buffers may serve
    embeddings: bool = False  # llama-bench's -embd: every output's embedding beside its logits
    no_op_offload: bool = False  # llama-bench's -nopo: ops on host weights stay on the host
    kv_unified: bool = False  # several sequences: one KV stream each, as llama_context's own
    # default and llama-batched-bench's (each attends to its own cells only: at 32 sequences on
    # 2 CPU cores a decode step took 139 ms against 175 ms unified); True: one buffer for all
    # (llama.cpp's -kvu, llama-server's when its slots are auto)

    def same_model(self, other: EngineConfig) -> bool:
        """Whether `other` can reuse the loaded weights (only the context differs)."""
        fields = (
            "n_gpu_layers",
            "repack",
            "load_mode",
            "split_mode",
            "main_gpu",
            "tensor_split",
            "tensor_overrides",
            "n_cpu_moe",
            "devices",
            "rpc",
            "lazy_mode",
            "no_host",
        )
        return all(getattr(self, f) == getattr(other, f) for f in fields)

    def with_llama_bench_defaults(self) -> EngineConfig:
        """This config with llama-bench's defaults where it leaves a setting to llmrun."""
        n_batch, n_ubatch, ngl = self.n_batch, self.n_ubatch, self.n_gpu_layers
        return replace(
            self,
            n_batch=LLAMA_BENCH_N_BATCH if n_batch is None else n_batch,
            n_ubatch=LLAMA_BENCH_N_UBATCH if n_ubatch is None else n_ubatch,
            n_gpu_layers=LLAMA_BENCH_NGL if ngl is None else ngl,
            flash_attn=self.flash_attn or "auto",
        )
