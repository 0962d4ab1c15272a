"""llama-bench's test shapes and option sweeps: `8-512*4` lists, and every combination of them."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace

from llmrun.runners.config import EngineConfig
from llmrun.runners.errors import BadRequestError
from llmrun.runners.lists import parse_values as parse_values
from llmrun.runners.threadpool import DEFAULT_POLL


def parse_words(
    text: str, *, name: str, allowed: Sequence[str], aliases: dict[str, str] | None = None
) -> list[str]:
    """A comma list of names (also repeated options, joined). Unknown names are kept: the run
    reports them as skipped. `aliases` maps other spellings: llama-bench's `-fa 0,1`."""
    words = [w.strip().lower() for w in text.split(",") if w.strip()]
    if not words:
        raise BadRequestError(f"{name}: give one or more of {', '.join(allowed)}")
    words = [(aliases or {}).get(w, w) for w in words]
    return list(dict.fromkeys(words))


# llama-bench writes flash attention as 0/1 (and -1 for auto) as well as off/on/auto
FLASH_ATTN_ALIASES = {
    "0": "off",
    "1": "on",
    "-1": "auto",
    "false": "off",
    "true": "on",
    "no": "off",
    "yes": "on",
}
BOOL_ALIASES = {
    "0": "0",
    "1": "1",
    "off": "0",
    "on": "1",
    "false": "0",
    "true": "1",
    "no": "0",
    "yes": "1",
}


def parse_bools(text: str, *, name: str) -> list[bool]:
    """llama-bench's 0/1 lists (`--repack 0,1`, `-nkvo 1`)."""
    words = parse_words(text, name=name, allowed=("0", "1"), aliases=BOOL_ALIASES)
    bad = [w for w in words if w not in ("0", "1")]
    if bad:
        raise BadRequestError(f"{name}: '{bad[0]}' is not 0 or 1")
    return [w == "1" for w in words]


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
    n_gpu_layers: int | None = None
    flash_attn: str | None = None
    type_k: str = "f16"
    type_v: str = "f16"
    repack: bool | None = None
    no_kv_offload: bool = False
    load_mode: str | None = None
    n_threads_batch: int | None = None  # None: as n_threads
    split_mode: str | None = None  # GPU builds: how layers spread over GPUs
    main_gpu: int | None = None
    tensor_split: str | None = None
    tensor_overrides: str | None = None
    n_cpu_moe: int = 0
    devices: str | None = None
    draft: int = 0  # prompt-lookup speculative decoding in the generation tests
    cpu_mask: str = "0x0"  # llama-bench's threadpool: -C, --cpu-strict, --poll
    cpu_strict: bool = False
    poll: int = DEFAULT_POLL
    fit_target: int = 0  # llama-bench's -fitt (MiB) and -fitc: recorded as given, not applied
    fit_min_ctx: int = 0
    lazy_mode: str = "auto"  # llama-bench's -lzm, --no-host (model-side: a load of their own)
    no_host: bool = False
    embeddings: bool = False  # llama-bench's -embd, -nopo (context-side)
    no_op_offload: bool = False

    def config(self, base: EngineConfig, n_ctx: int) -> EngineConfig:
        return replace(
            base,
            n_ctx=n_ctx,
            n_threads=self.n_threads,
            n_batch=self.n_batch,
            n_ubatch=self.n_ubatch,
            n_gpu_layers=self.n_gpu_layers,
            flash_attn=self.flash_attn,
            cache_type_k=self.type_k,
            cache_type_v=self.type_v,
            repack=base.repack if self.repack is None else self.repack,
            no_kv_offload=self.no_kv_offload,
            load_mode=base.load_mode if self.load_mode is None else self.load_mode,
            n_threads_batch=self.n_threads_batch,
            split_mode=self.split_mode,
            main_gpu=self.main_gpu,
            tensor_split=self.tensor_split,
            tensor_overrides=self.tensor_overrides,
            n_cpu_moe=self.n_cpu_moe,
            devices=self.devices,
            threadpool=replace(
                base.threadpool, cpu_mask=self.cpu_mask, strict=self.cpu_strict, poll=self.poll
            ),
            lazy_mode=self.lazy_mode,
            no_host=self.no_host,
            embeddings=self.embeddings,
            no_op_offload=self.no_op_offload,
        )

    def describe(self) -> str:
        """Compact, in llama-bench's short option names: t=2 b=512 ub=512 ngl=0 fa=off."""
        names = {
            "n_threads": "t",
            "n_batch": "b",
            "n_ubatch": "ub",
            "n_gpu_layers": "ngl",
            "flash_attn": "fa",
            "type_k": "ctk",
            "type_v": "ctv",
            "repack": "repack",
            "no_kv_offload": "nkvo",
            "load_mode": "lm",
            "n_threads_batch": "tb",
            "split_mode": "sm",
            "main_gpu": "mg",
            "tensor_split": "ts",
            "tensor_overrides": "ot",
            "n_cpu_moe": "ncmoe",
            "devices": "dev",
            "draft": "draft",
            "cpu_mask": "C",
            "cpu_strict": "cpu-strict",
            "poll": "poll",
            "fit_target": "fitt",
            "fit_min_ctx": "fitc",
            "lazy_mode": "lzm",
            "no_host": "no-host",
            "embeddings": "embd",
            "no_op_offload": "nopo",
        }
        defaults: dict[str, object] = {
            "no_kv_offload": False,
            "type_k": "f16",
            "type_v": "f16",
            "n_cpu_moe": 0,
            "draft": 0,
            "cpu_mask": "0x0",
            "cpu_strict": False,
            "poll": DEFAULT_POLL,
            "fit_target": 0,
            "fit_min_ctx": 0,
            "lazy_mode": "auto",
            "no_host": False,
            "embeddings": False,
            "no_op_offload": False,
        }
        if self.n_threads_batch == self.n_threads:
            defaults["n_threads_batch"] = self.n_threads
        return " ".join(
            f"{names[k]}={int(v) if isinstance(v, bool) else v}"
            for k, v in vars(self).items()
            if v is not None and defaults.get(k) != v
        )


def sweep(
    *,
    threads: Sequence[int | None],
    batch: Sequence[int | None],
    ubatch: Sequence[int | None],
    gpu_layers: Sequence[int | None],
    flash_attn: Sequence[str | None],
    type_k: Sequence[str],
    type_v: Sequence[str],
    repack: Sequence[bool | None] = (None,),
    no_kv_offload: Sequence[bool] = (False,),
    load_mode: Sequence[str | None] = (None,),
    lazy_mode: Sequence[str] = ("auto",),
    no_host: Sequence[bool] = (False,),
    embeddings: Sequence[bool] = (False,),
    no_op_offload: Sequence[bool] = (False,),
) -> list[Combo]:
    """Every combination, ordered so those sharing loaded weights (GPU layers, repacking, load
    mode, lazy mode, host buffer) run together; -lzm, --no-host, -embd and -nopo nest in
    llama-bench's order, outside the context's other settings, as in its loop."""
    context = list(
        itertools.product(threads, batch, ubatch, flash_attn, type_k, type_v, no_kv_offload)
    )
    return [
        Combo(
            t,
            b,
            u,
            g,
            f,
            k,
            v,
            r,
            o,
            lm,
            lazy_mode=lz,
            no_host=nh,
            embeddings=em,
            no_op_offload=npo,
        )
        for g, r, lm, lz, nh, em, npo, (t, b, u, f, k, v, o) in itertools.product(
            gpu_layers, repack, load_mode, lazy_mode, no_host, embeddings, no_op_offload, context
        )
    ]
