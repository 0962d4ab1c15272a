"""llama-bench's test shapes and option sweeps: `8-512*4` lists, and every combination of them."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from llmrun.runners import lists
from llmrun.runners.config import EngineConfig
from llmrun.runners.errors import OptionError
from llmrun.runners.threadpool import DEFAULT_POLL


def parse_values(
    text: str, *, name: str, minimum: int = 0, maximum: int = lists.MAX_VALUE
) -> list[int]:
    """llama-bench's list syntax (`1,2,4`, `8-512*4`, `0-24+8`), a value given twice kept
    twice: `-p 16,16` is two tests there, and so here."""
    values = [
        v
        for part in text.split(",")
        for v in lists.parse_values(part, name=name, minimum=minimum, maximum=maximum)
    ]
    if len(values) > lists.MAX_SWEEP_VALUES:
        raise OptionError(f"{name}: '{text}' gives more than {lists.MAX_SWEEP_VALUES} values")
    return values


def parse_words(
    text: str,
    *,
    name: str,
    allowed: Sequence[str],
    aliases: dict[str, str] | None = None,
    refuse: str | None = None,
) -> list[str]:
    """A comma list of names (also repeated options, joined), a name given twice kept twice as
    llama-bench keeps it. Unknown names are kept: the run reports them as skipped; with
    `refuse` (the allowed names in words) the first is an error instead. `aliases` maps other
    spellings: llama-bench's `-fa 0,1`."""
    words = [w.strip().lower() for w in text.split(",") if w.strip()]
    if not words:
        raise OptionError(f"{name}: give one or more of {', '.join(allowed)}")
    words = [(aliases or {}).get(w, w) for w in words]
    bad = [w for w in words if w not in allowed]
    if refuse is not None and bad:
        raise OptionError(f"{name}: '{bad[0]}' is not {refuse}")
    return words


# llama-bench writes flash attention as 0/1 (and -1 for auto) as well as off/on/auto, and its
# 0/1 lists as off/on, false/true, no/yes too
_OFF, _ON = ("0", "off", "false", "no"), ("1", "on", "true", "yes")
FLASH_ATTN_ALIASES = {"-1": "auto"} | {w: "off" for w in _OFF} | {w: "on" for w in _ON}
BOOL_ALIASES = {w: "0" for w in _OFF} | {w: "1" for w in _ON}


def parse_bools(text: str, *, name: str) -> list[bool]:
    """llama-bench's 0/1 lists (`--repack 0,1`, `-nkvo 1`)."""
    words = parse_words(text, name=name, allowed=("0", "1"), aliases=BOOL_ALIASES, refuse="0 or 1")
    return [w == "1" for w in words]


@dataclass(frozen=True)
class Shape:
    n_prompt: int
    n_gen: int
    n_depth: int = 0
    # the place of its depth in -d's list: llama-bench runs each setting's tests depth by depth
    # (`-d 0,0` is two places), which `tests` orders by; not part of what the test is
    slot: int = field(default=0, compare=False, repr=False)

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
        """The base with this configuration: each setting EngineConfig has under the same name
        (repacking and the load mode unset: the base's), the cache types and the threadpool."""
        same = {f.name for f in fields(EngineConfig)}
        given = {k: v for k, v in vars(self).items() if k in same} | {
            "repack": base.repack if self.repack is None else self.repack,
            "load_mode": base.load_mode if self.load_mode is None else self.load_mode,
        }
        return replace(
            base,
            **given,
            n_ctx=n_ctx,
            cache_type_k=self.type_k,
            cache_type_v=self.type_v,
            threadpool=replace(
                base.threadpool, cpu_mask=self.cpu_mask, strict=self.cpu_strict, poll=self.poll
            ),
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
        defaults: dict[str, object] = {f.name: f.default for f in fields(Combo)}
        if self.n_threads_batch == self.n_threads:
            defaults["n_threads_batch"] = self.n_threads
        return " ".join(
            f"{names[k]}={int(v) if isinstance(v, bool) else v}"
            for k, v in vars(self).items()
            if v is not None and defaults.get(k) != v
        )


# llama-bench's loops over the settings, outermost first (llama-bench.cpp,
# get_cmd_params_instances): the order that reloads the model least, and the order of its rows.
# "n_depth" is the tests' depth, looped between --cpu-strict and --poll; --draft, llmrun's own,
# loops just outside it (it changes neither the model nor the context).
LOOPS = (
    "fit_target",
    "fit_min_ctx",
    "n_gpu_layers",
    "n_cpu_moe",
    "split_mode",
    "load_mode",
    "lazy_mode",
    "main_gpu",
    "devices",
    "tensor_split",
    "tensor_overrides",
    "no_host",
    "repack",
    "embeddings",
    "no_op_offload",
    "n_batch",
    "n_ubatch",
    "type_k",
    "type_v",
    "no_kv_offload",
    "flash_attn",
    "n_threads",
    "cpu_mask",
    "cpu_strict",
    "draft",
    "n_depth",
    "poll",
)


def sweep(**values: Sequence[Any]) -> list[Combo]:
    """Every combination of the `Combo` fields' lists (a field not given keeps its default), in
    llama-bench's order (`LOOPS`), a value given twice kept twice as there."""
    unknown = set(values) - set(LOOPS)
    if unknown:
        raise TypeError(f"not a swept setting: {', '.join(sorted(unknown))}")
    names = [n for n in LOOPS if n in values]
    return [
        Combo(**dict(zip(names, chosen, strict=True)))
        for chosen in itertools.product(*(values[n] for n in names))
    ]


def tests(
    combos: Sequence[Combo], shapes: Sequence[Shape], inside: int = 1
) -> list[tuple[Combo, tuple[Shape, ...]]]:
    """Each setting's tests in llama-bench's order: `combos` as `sweep` made them, where each
    `inside` in a row differ only in the settings looped inside the depth (--poll's values);
    for each depth (each `slot`) those settings in turn, and for each, its pp tests, then tg,
    then pg, as `shapes` lists them. A setting whose tests follow its own keeps one entry."""
    slots = list(dict.fromkeys(s.slot for s in shapes))
    if inside < 1 or len(combos) % inside:
        inside = 1  # not sweep's blocks: each combination keeps its place
    plan: list[tuple[Combo, tuple[Shape, ...]]] = []
    for start in range(0, len(combos), inside):
        for slot in slots:
            here = tuple(s for s in shapes if s.slot == slot)
            for combo in combos[start : start + inside]:
                if plan and plan[-1][0] is combo:
                    plan[-1] = (combo, plan[-1][1] + here)
                else:
                    plan.append((combo, here))
    return plan
