"""Options shared by every command that runs a model, defined once, with their defaults.

Names follow llama.cpp's (`-n`, `--temp`, `-c`, `-b`, `-t`, `-ngl`, ...) so users' habits carry
over. Each option is an `Annotated` declaration (flags, type, range, help, environment variable,
panel); the records below group them by what they set, and each record turns itself into the
runner's type (`SamplingOptions.params`, `EngineOptions.config`) in one place.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import tempfile
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer

import llmrun.cli
from llmrun.runners.base import DEFAULT_TIMEOUT_S, Runner, SamplingParams
from llmrun.runners.config import EngineConfig
from llmrun.runners.errors import STRICT_JSON, BadRequestError, OptionError, long_integer, not_utf8
from llmrun.runners.files import read_option_file
from llmrun.runners.limits import (
    CACHE_TYPES,
    MAX_TEMPLATE_BYTES,
    bounds,
    check_sampling,
    engine_bounds,
)
from llmrun.runners.lists import whole
from llmrun.runners.threadpool import DEFAULT_POLL, ThreadpoolSettings

from .errors import usage_error
from .records import OptionRecord
from .terminal import say

# The defaults every command shows and uses: the runner's own (SamplingParams), never literals.
DEFAULTS = SamplingParams()
ENGINE_DEFAULTS = EngineConfig()
TIMEOUT_S = DEFAULT_TIMEOUT_S

MODEL_PANEL = "Model and engine"
SAMPLING_PANEL = "Sampling"
# Each panel's options. typer shows no default of None: no option here needs show_default=False
_model = functools.partial(typer.Option, rich_help_panel=MODEL_PANEL)
_sampling = functools.partial(typer.Option, rich_help_panel=SAMPLING_PANEL)


class AutoOnOff(str, Enum):
    """-fa's and --energy's values."""

    auto = "auto"
    on = "on"
    off = "off"


Energy = Annotated[
    AutoOnOff,
    _model(
        "--energy",
        envvar="LLMRUN_ENERGY",
        help="Joules per phase from the machine's counters (RAPL, NVML), above an idle"
        " baseline measured first: auto where a counter is readable (else the reason), on to"
        " require one, off to read none.",
    ),
]


Model = Annotated[
    str | None,
    _model(
        "-m",
        "--model",
        "-hf",
        "--hf-repo",
        envvar="LLMRUN_MODEL",
        help="A .gguf path, a Hub reference (owner/repo:QUANT or owner/repo/file.gguf; also"
        " as llama.cpp's -hf); default: the embedded SmolLM2-135M.",
    ),
]


def ctx_option(help_text: str, *, least: int) -> Any:
    """-c/--ctx: `run` and `chat` size one context; `serve` each sequence's."""
    return _model(
        "-c",
        "--ctx",
        "--ctx-size",
        envvar="LLMRUN_CTX",
        **engine_bounds("n_ctx", least=least),
        help=help_text,
    )


def threads_option(
    help_text: str, *, panel: str = MODEL_PANEL, envvar: str | None = "LLMRUN_THREADS"
) -> Any:
    """-t/--threads: the engine's CPU threads; each command says its own default (and
    `rpc-server`, whose ggml threads are bound the same, its own panel and no variable)."""
    return typer.Option(
        "-t",
        "--threads",
        envvar=envvar,
        **engine_bounds("n_threads"),
        help=help_text,
        rich_help_panel=panel,
    )


Ctx = Annotated[
    int | None,
    ctx_option(
        "Context size in tokens; 0 = the model's training context. (default: 4096 or less)", least=0
    ),
]
Batch = Annotated[
    int | None,
    _model(
        "-b",
        "--batch",
        **engine_bounds("n_batch"),
        help="Prefill chunk size (n_batch): prompt tokens per llama_decode call."
        " (default: 512, or the value `llmrun tune` found)",
    ),
]
Ubatch = Annotated[
    int | None,
    _model(
        "-ub",
        "--ubatch",
        "--ubatch-size",
        **engine_bounds("n_ubatch"),
        help="Physical micro-batch size (n_ubatch), at most --batch."
        " (default: 512, or the tuned value)",
    ),
]
Threads = Annotated[
    int | None, threads_option("CPU threads. (default: physical cores, or the tuned value)")
]
ThreadsBatch = Annotated[
    int | None,
    _model(
        "-tb",
        "--threads-batch",
        **engine_bounds("n_threads_batch"),
        help="CPU threads for prefill (llama.cpp's n_threads_batch). (default: --threads)",
    ),
]
GpuLayers = Annotated[
    int | None,
    _model(
        "-ngl",
        "--gpu-layers",
        "--n-gpu-layers",
        envvar="LLMRUN_GPU_LAYERS",
        **engine_bounds("n_gpu_layers"),
        help="Layers to offload to the GPU; -1, or more than the model has, is all. (default: all"
        " that fit where this build can offload, else 0)",
    ),
]
FlashAttnOpt = Annotated[
    AutoOnOff | None,
    _model(
        "-fa",
        "--flash-attn",
        help="Flash attention. (default: the tuned value, else llama.cpp's auto, which"
        " checks that the model's device supports it)",
    ),
]
CacheTypeK = Annotated[
    str,
    _model(
        "-ctk",
        "--cache-type-k",
        metavar="TYPE",
        help=f"KV cache element type of K: {', '.join(CACHE_TYPES)} (as llama.cpp's -ctk).",
    ),
]
CacheTypeV = Annotated[
    str,
    _model(
        "-ctv",
        "--cache-type-v",
        metavar="TYPE",
        help="KV cache element type of V, as -ctk (a quantized V needs flash attention).",
    ),
]
Repack = Annotated[
    bool | None,
    _model(
        "--repack/--no-repack",
        help="Repack weights for faster CPU kernels. (default: on where a probe finds it safe:"
        " not on AMX CPUs, whose kernels crash on it)",
    ),
]


def check_rpc(value: str | list[str] | None) -> str | None:
    """--rpc's servers checked while the line is parsed (a usage error, exit 2), normalised to
    host:port,host:port; bench's list option may be repeated, each joined by commas."""
    if not value:
        return None
    text = ",".join(value) if isinstance(value, list) else value
    from llmrun.runners.rpc import RpcEndpointError, parse_endpoints

    try:
        return ",".join(str(e) for e in parse_endpoints(text))
    except RpcEndpointError as e:
        raise typer.BadParameter(str(e).removeprefix("--rpc: ")) from None


RPC_FLAGS = ("-rpc", "--rpc")
RPC_HELP = (
    "llama.cpp's RPC servers (`llmrun rpc-server` on each machine), host:port,...: -ngl's"
    " layers are split over them by their free memory (bench: -ts), the rest stay here."
    " Unauthenticated: only on a network you trust (docs/hardware.md)."
)
Rpc = Annotated[
    str | None,
    _model(
        *RPC_FLAGS, envvar="LLMRUN_RPC", metavar="HOST:PORT,...", callback=check_rpc, help=RPC_HELP
    ),
]

CpuMask = Annotated[
    str | None,
    _model(
        "-C",
        "--cpu-mask",
        metavar="HEX",
        help="The compute threads' CPUs, a hex mask such as 0x3 for CPUs 0-1 (llama.cpp's"
        " -C). (default: none)",
    ),
]
CpuStrict = Annotated[
    int,
    _model(
        "--cpu-strict",
        min=0,
        max=1,
        metavar="0|1",
        help="1: one CPU of --cpu-mask per compute thread, in turn.",
    ),
]
Poll = Annotated[
    int,
    _model(
        "--poll",
        min=0,
        max=100,
        metavar="0..100",
        help="How long idle compute threads spin before they sleep (llama.cpp's --poll).",
    ),
]

KvUnified = Annotated[
    bool | None,
    _model(
        "-kvu/-no-kvu",
        "--kv-unified/--no-kv-unified",
        help="Several sequences: one KV buffer for all (llama.cpp's -kvu), or each its own KV"
        " stream (--no-kv-unified), as llama.cpp's contexts and llama-batched-bench do."
        " (default: one stream per sequence)",
    ),
]

NoWarmup = Annotated[
    bool,
    _model(
        "--no-warmup",
        help="Skip the warm-up decode while loading (as llama-cli's --no-warmup); the first"
        " request's prefill then pays the backend's one-time set-up.",
    ),
]

REMOTE_PANEL = "Remote server (OpenAI-compatible)"
_remote = functools.partial(typer.Option, rich_help_panel=REMOTE_PANEL)
Endpoint = Annotated[
    str | None,
    _remote(
        "--endpoint",
        envvar="LLMRUN_ENDPOINT",
        metavar="URL",
        help="Use an OpenAI-compatible server (llama-server, vLLM, SGLang, Ollama's /v1) instead"
        " of a local model; -m then names the server's model (default: its first).",
    ),
]
ApiKey = Annotated[
    str | None,
    _remote("--api-key", envvar="LLMRUN_API_KEY", help="API key for --endpoint (never printed)."),
]
Timeout = Annotated[
    float,
    _remote(
        "--timeout",
        min=0.1,
        max=86400.0,
        help="Seconds to wait for the server before giving up on a read.",
    ),
]

MaxTokens = Annotated[
    int,
    _sampling(
        "-n", "--max-tokens", "--n-predict", **bounds("max_tokens"), help="Most tokens to generate."
    ),
]
Temp = Annotated[
    float, _sampling("--temp", **bounds("temperature"), help="Temperature; 0 = greedy.")
]
TopK = Annotated[int, _sampling("--top-k", **bounds("top_k"), help="Top-k; 0 = off.")]
TopP = Annotated[float, _sampling("--top-p", **bounds("top_p"), help="Top-p; 1 = off.")]
MinP = Annotated[float, _sampling("--min-p", **bounds("min_p"), help="Min-p; 0 = off.")]
RepeatPenalty = Annotated[
    float,
    _sampling(
        "--repeat-penalty",
        **bounds("repeat_penalty"),
        help="Penalty on tokens seen in the last --repeat-last-n; 1 = off.",
    ),
]
RepeatLastN = Annotated[
    int,
    _sampling(
        "--repeat-last-n",
        **bounds("repeat_last_n"),
        help="How many of the last tokens --repeat-penalty looks at; 0 = off, -1 = the context.",
    ),
]
Seed = Annotated[
    int | None,
    _sampling(
        "--seed", **bounds("seed"), help="Sampling seed. (default: random, reported in the stats)"
    ),
]
PromptSeed = Annotated[
    int,
    typer.Option(
        "--seed", **bounds("seed"), help="Seed of the random prompts (bench's: their tokens)."
    ),
]
Stop = Annotated[
    list[str] | None, _sampling("--stop", help="Stop when this text appears (repeatable).")
]
Think = Annotated[
    bool | None,
    _sampling(
        "--think/--no-think",
        help="Turn the model's thinking on or off where its chat template has the"
        " switch (enable_thinking; sent to servers as chat_template_kwargs).",
    ),
]
Draft = Annotated[
    str | None,
    _sampling(
        "--draft",
        metavar="lookup[:N]",
        help="Speculative decoding by prompt lookup: up to N tokens (default 8) that"
        " followed the last few tokens earlier in the context are checked in one batch."
        " Greedy only (--temp 0).",
    ),
]
DraftModel = Annotated[
    Path | None,
    _sampling(
        "--draft-model",
        metavar="PATH",
        help="Speculative decoding with a small model of the same vocabulary as the"
        " drafter (up to --draft model:N tokens, default 8). Greedy only (--temp 0).",
    ),
]
JsonSchemaFile = Annotated[
    Path | None,
    _sampling(
        "--json-schema",
        metavar="FILE",
        help="Answer with JSON that the JSON schema in FILE accepts, through llama.cpp's"
        " grammar sampler (the keywords `serve`'s response_format keeps; others are refused).",
    ),
]
GrammarFile = Annotated[
    Path | None,
    _sampling(
        "--grammar",
        metavar="FILE",
        help="Answer in the GBNF grammar in FILE (llama.cpp's format; its rule 'root').",
    ),
]
HideThinking = Annotated[
    bool,
    _sampling(
        "--hide-thinking", help="Print only the answer; the thinking is still counted in the stats."
    ),
]
ThinkingStdout = Annotated[
    bool,
    _sampling(
        "--thinking-stdout",
        help="When stdout is not a terminal, keep the thinking there between <think>"
        " and </think> lines (by default it goes to stderr, so stdout gets the answer"
        " alone).",
    ),
]
ChatTemplateFile = Annotated[
    Path | None,
    _model(
        "--chat-template-file",
        metavar="FILE",
        help="A Jinja chat template to use in place of the model's own.",
    ),
]
NoDashboard = Annotated[
    bool,
    typer.Option(
        "--no-dashboard",
        envvar="LLMRUN_NO_DASHBOARD",
        help="No live dashboard on a terminal: plain lines, as when stderr is not a terminal.",
    ),
]
System = Annotated[
    str | None,
    typer.Option(
        "-s", "--system", help="System prompt (in llama.cpp, -s is the seed: that is --seed here)."
    ),
]


def warn_if_seed(system: str | None) -> None:
    """`-s 42` is the seed in llama.cpp; here it is the system prompt. Keep it, but say so."""
    if system is not None and whole(system.strip().lstrip("+-")) is not None:
        say(
            f"llmrun: warning: -s {system.strip()} sets the system prompt here; llama.cpp's"
            " seed is --seed"
        )


DEFAULT_DRAFT = 8


def parse_draft(text: str | None, temp: float, *, draft_model: bool = False) -> int:
    """`lookup[:N]`, or `model[:N]` with --draft-model -> N drafted tokens at most; 0 without
    either."""
    if text is None and not draft_model:
        return 0
    if text is not None and not text.strip():
        raise OptionError("--draft: give lookup[:N], or model[:N] with --draft-model PATH")
    kind, _, count = (text or "model").strip().lower().partition(":")
    if kind not in ("lookup", "model"):
        raise OptionError(f"--draft: '{text}' is not lookup[:N] or model[:N]")
    if (kind == "model") != draft_model:
        raise OptionError("--draft model[:N] goes with --draft-model PATH, lookup without it")
    if count and not 1 <= (whole(count) or 0) <= 64:
        raise OptionError(f"--draft: '{count}' is not a count from 1 to 64")
    if temp > 0:
        raise OptionError("--draft: speculative decoding here checks drafts greedily; add --temp 0")
    return int(count) if count else DEFAULT_DRAFT


MAX_GRAMMAR_FILE_BYTES = 1 << 20  # as a grammar made from a schema (grammar.py)


def read_grammar(json_schema: Path | None, grammar: Path | None) -> str | None:
    """The grammar --json-schema FILE asks for (made as `serve` makes response_format's, with
    its refusals), or --grammar FILE's GBNF; None without either."""
    from llmrun.runners.grammar import (
        check_gbnf,
        gbnf_fault,
        schema_grammar,
        without_token_texts,
    )

    if json_schema is not None and grammar is not None:
        usage_error("--json-schema, --grammar: one grammar at a time; give one or the other")
    path = json_schema or grammar
    if path is None:
        return None
    flag = "--json-schema" if json_schema is not None else "--grammar"
    text = read_text_option(
        path, flag, MAX_GRAMMAR_FILE_BYTES, "grammar" if grammar else "JSON schema"
    )
    if grammar is None:
        try:
            schema = json.loads(text, **STRICT_JSON)
        except (json.JSONDecodeError, RecursionError) as e:
            raise BadRequestError(f"{flag} {path}: not JSON ({e})") from None
        except ValueError:
            raise BadRequestError(f"{flag} {path}: {long_integer()}") from None
        except BadRequestError as e:  # NaN, 1e999
            raise BadRequestError(f"{flag} {path}: {e}") from None
        try:
            text = schema_grammar(schema, "schema")
        except BadRequestError as e:
            raise BadRequestError(f"{flag} {path}: {e}") from None
    else:
        check_gbnf(text, f"{flag} {path}")
    # a token named by its text (<|im_end|>) needs the model's vocabulary: an id stands in
    reason = _parse_refusal(without_token_texts(text))
    if reason is not None:
        made = " made from it" if grammar is None else ""
        raise BadRequestError(
            f"{flag} {path}: llama.cpp's grammar parser refuses the grammar{made}: {reason}"
        )
    fault = gbnf_fault(text) if grammar is not None else None  # a schema's was checked
    if fault is not None:
        raise BadRequestError(f"{flag} {path}: {fault}")
    return text


def _parse_refusal(grammar: str) -> str | None:
    """Why llama.cpp's parser refuses the grammar (None: it takes it), in one line: the parser
    writes its reason straight to file descriptor 2, so that is caught while it parses (the
    command has no display running yet)."""
    from llmrun.runners.grammar import parses, refusal_reason

    sys.stderr.flush()
    with tempfile.TemporaryFile() as caught:
        saved = os.dup(2)
        os.dup2(caught.fileno(), 2)
        try:
            ok = parses(None, grammar)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        caught.seek(0)
        said = caught.read().decode("utf-8", errors="replace")
    return None if ok else refusal_reason(said) or "not GBNF it reads"


@dataclass(frozen=True, kw_only=True)
class RemoteOptions(OptionRecord):
    """An OpenAI-compatible server to use in place of the local engine."""

    endpoint: Endpoint = None
    api_key: ApiKey = None
    timeout: Timeout = TIMEOUT_S


@dataclass(frozen=True, kw_only=True)
class SamplingOptions(OptionRecord):
    """How each token is chosen; the runner's `SamplingParams`, checked against its limits."""

    max_tokens: MaxTokens = DEFAULTS.max_tokens
    temp: Temp = DEFAULTS.temperature
    top_k: TopK = DEFAULTS.top_k
    top_p: TopP = DEFAULTS.top_p
    min_p: MinP = DEFAULTS.min_p
    repeat_penalty: RepeatPenalty = DEFAULTS.repeat_penalty
    repeat_last_n: RepeatLastN = DEFAULTS.repeat_last_n
    seed: Seed = None
    stop: Stop = None

    def params(self, *, think: bool | None = None, draft: int = 0) -> SamplingParams:
        if "" in (self.stop or ()):  # it would stop before the first token
            usage_error("--stop: an empty string; give the text to stop at")
        # field by field, so a renamed option is a type error here (tests/test_typecheck.py)
        sampling = SamplingParams(
            think=think,
            draft=draft,
            max_tokens=self.max_tokens,
            temperature=self.temp,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            repeat_penalty=self.repeat_penalty,
            repeat_last_n=self.repeat_last_n,
            seed=self.seed,
            stop=tuple(self.stop or ()),
        )
        check_sampling(sampling)
        return sampling


@dataclass(frozen=True, kw_only=True)
class ReplyOptions(OptionRecord):
    """`run` and `chat`: thinking, speculative decoding and where the thinking is shown."""

    think: Think = None
    draft: Draft = None
    draft_model: DraftModel = None
    hide_thinking: HideThinking = False
    thinking_stdout: ThinkingStdout = False


@dataclass(frozen=True, kw_only=True)
class EngineOptions(OptionRecord):
    """The local engine's settings of `run` and `chat`: the runner's `EngineConfig`."""

    chat_template_file: ChatTemplateFile = None
    ctx: Ctx = None
    batch: Batch = None
    ubatch: Ubatch = None
    threads: Threads = None
    threads_batch: ThreadsBatch = None
    gpu_layers: GpuLayers = None
    flash_attn: FlashAttnOpt = None
    cache_type_k: CacheTypeK = ENGINE_DEFAULTS.cache_type_k
    cache_type_v: CacheTypeV = ENGINE_DEFAULTS.cache_type_v
    repack: Repack = None
    rpc: Rpc = None
    no_warmup: NoWarmup = False
    cpu_mask: CpuMask = None
    cpu_strict: CpuStrict = 0
    poll: Poll = DEFAULT_POLL
    energy: Energy = AutoOnOff.auto

    def config(
        self, *, endpoint: str | None = None, draft_model: Path | None = None
    ) -> EngineConfig:
        """The engine settings, refused with --endpoint where they do not apply (the context
        size does: it sizes chat's context meter and the overflow policy)."""
        refuse_for_endpoint(
            endpoint,
            {
                "-b/--batch": self.batch,
                "--ubatch": self.ubatch,
                "-t/--threads": self.threads,
                "-tb/--threads-batch": self.threads_batch,
                "-ngl/--gpu-layers": self.gpu_layers,
                "--flash-attn": self.flash_attn,
                "-ctk/--cache-type-k": self.cache_type_k.lower() != ENGINE_DEFAULTS.cache_type_k,
                "-ctv/--cache-type-v": self.cache_type_v.lower() != ENGINE_DEFAULTS.cache_type_v,
                "--repack/--no-repack": None if self.repack is None else "given",  # --no-repack
                "-rpc/--rpc": self.rpc,
                "--chat-template-file": self.chat_template_file,
                "--draft-model": draft_model,
                "--no-warmup": self.no_warmup,
                "-C/--cpu-mask": self.cpu_mask,
                "--cpu-strict": self.cpu_strict,
                "--poll": None if self.poll == DEFAULT_POLL else "given",
            },
        )
        threadpool = ThreadpoolSettings(
            cpu_mask=self.cpu_mask or "0x0", strict=bool(self.cpu_strict), poll=self.poll
        )
        threadpool.placement(1)  # a mask of no CPU here is refused before the model loads
        batch, ubatch, template = self.batch, self.ubatch, self.chat_template_file
        return EngineConfig(
            n_ctx=self.ctx,
            n_batch=batch,
            n_ubatch=min(ubatch, batch) if ubatch and batch else ubatch,
            n_threads=self.threads,
            n_threads_batch=self.threads_batch,
            n_gpu_layers=self.gpu_layers,
            flash_attn=self.flash_attn.value if self.flash_attn else None,
            cache_type_k=cache_type(self.cache_type_k, "-ctk/--cache-type-k"),
            cache_type_v=cache_type(self.cache_type_v, "-ctv/--cache-type-v"),
            repack=self.repack,
            rpc=self.rpc,
            chat_template=None
            if template is None
            else read_text_option(template, "--chat-template-file", MAX_TEMPLATE_BYTES, "template"),
            draft_model=str(draft_model) if draft_model is not None else None,
            warmup=not self.no_warmup,
            threadpool=threadpool,
        )


def cache_type(text: str, flag: str) -> str:
    """A KV cache type by llama.cpp's name, checked against the types llmrun's limits know (as
    bench's -ctk/-ctv and every other source of engine settings). A name that is none is a
    usage error, exit 2, as `-fa bogus` is (it was exit 1, without the hint)."""
    value = text.strip().lower()
    if value not in CACHE_TYPES:
        raise OptionError(f"{flag}: '{text}' is not one of {', '.join(CACHE_TYPES)}")
    return value


def read_text_option(path: Path, flag: str, max_bytes: int, what: str) -> str:
    """The text of a file an option names (a template, a grammar, a schema), within its cap:
    an empty file, or one that is not UTF-8 (a model or a picture given by mistake), is refused
    rather than read as nothing (an empty template fell back to the model's in silence) or as
    U+FFFD."""
    data = read_option_file(path, flag, max_bytes, what)
    if not data.strip():
        raise BadRequestError(f"{flag} {path}: the file is empty")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequestError(f"{flag} {path}: {not_utf8(e)}") from None


@dataclass(frozen=True, kw_only=True)
class GenerationOptions(OptionRecord):
    """What `run` and `chat` generate with: the model or a server, how tokens are chosen, the
    reply's thinking and speculation, and the local engine."""

    model: Model = None
    remote: RemoteOptions
    sampling: SamplingOptions
    reply: ReplyOptions
    engine: EngineOptions

    def settings(self, system: str | None) -> tuple[SamplingParams, EngineConfig]:
        """The sampling and engine settings: checked, warned about, refused with --endpoint
        where they do not apply."""
        warn_if_seed(system)
        reply = self.reply
        refuse_for_endpoint(self.remote.endpoint, {"--draft": reply.draft})
        drafting = reply.draft_model is not None
        draft = parse_draft(reply.draft, self.sampling.temp, draft_model=drafting)
        params = self.sampling.params(think=reply.think, draft=draft)
        config = self.engine.config(endpoint=self.remote.endpoint, draft_model=reply.draft_model)
        from .session import use_energy

        use_energy(self.engine.energy.value)
        return params, config

    def runner(self, config: EngineConfig, *, quiet: bool) -> Runner:
        """The model, or the server, to generate with; on a busy machine the local engine gets
        the cores other processes leave free (`free_cores`)."""
        from .engine import make_runner
        from .session import free_cores

        remote = self.remote
        return make_runner(
            self.model,
            config,
            endpoint=remote.endpoint,
            api_key=remote.api_key,
            timeout_s=remote.timeout,
            prepare=lambda found: free_cores(found, endpoint=remote.endpoint, quiet=quiet),
        )


def refuse_given(given: Mapping[str, object], why: str) -> None:
    """A usage error naming every option in `given` (flags -> value) that was given, i.e. is
    not None, False, 0 or "0" (their defaults): options that do not apply are never ignored."""
    named = [
        flags
        for flags, value in given.items()
        if value not in (None, False, 0, "0")
        and not set(flags.split("/")) & llmrun.cli.from_environment  # LLMRUN_THREADS: a setting
    ]
    if named:
        raise OptionError(f"{', '.join(named)}: {why}")


def refuse_for_endpoint(endpoint: str | None, given: Mapping[str, object]) -> None:
    """One rule for every command: with --endpoint the server's own settings decide."""
    if endpoint:
        named = llmrun.cli.given_as("--endpoint", "LLMRUN_ENDPOINT")
        refuse_given(given, f"local-engine options; with {named} the server's own settings decide")


# llama.cpp's options of two or more letters after one dash (llama-cli's and llama-server's
# common/arg.cpp, llama-bench's own), each with its long name. Click reads an undeclared one as
# short options run together (`-ctk q8_0` as `-c tk`, `-hf` as `-h`): a command that does not
# declare one refuses it by name instead (`refuse_split_flags`).
LLAMA_CPP_SHORT_FLAGS: dict[str, str] = {
    "-ag": "--agent",
    "-bf": "--binary-file",
    "-bs": "--backend-sampling",
    "-Cb": "--cpu-mask-batch",
    "-Cbd": "--cpu-mask-batch-draft",
    "-Cd": "--cpu-mask-draft",
    "-Cr": "--cpu-range",
    "-Crb": "--cpu-range-batch",
    "-Crbd": "--cpu-range-batch-draft",
    "-Crd": "--cpu-range-draft",
    "-cb": "--cont-batching",
    "-cl": "--cache-list",
    "-cmoe": "--cpu-moe",
    "-cmoed": "--cpu-moe-draft",
    "-cms": "--checkpoint-min-step",
    "-cnv": "--conversation",
    "-co": "--color",
    "-cram": "--cache-ram",
    "-ctk": "--cache-type-k",
    "-ctkd": "--cache-type-k-draft",
    "-ctv": "--cache-type-v",
    "-ctvd": "--cache-type-v-draft",
    "-ctxcp": "--ctx-checkpoints",
    "-dev": "--device",
    "-devd": "--device-draft",
    "-dio": "--direct-io",
    "-dr": "--docker-repo",
    "-dt": "--defrag-thold",
    "-embd": "--embeddings",
    "-fa": "--flash-attn",
    "-fit": "--fit",
    "-fitc": "--fit-ctx",
    "-fitp": "--fit-print",
    "-fitt": "--fit-target",
    "-gan": "--grp-attn-n",
    "-gaw": "--grp-attn-w",
    "-hf": "--hf-repo",
    "-hfd": "--hf-repo-draft",
    "-hff": "--hf-file",
    "-hfr": "--hf-repo",
    "-hfrd": "--hf-repo-draft",
    "-hft": "--hf-token",
    "-if": "--interactive-first",
    "-jf": "--json-schema-file",
    "-kvo": "--kv-offload",
    "-kvu": "--kv-unified",
    "-lcd": "--lookup-cache-dynamic",
    "-lcs": "--lookup-cache-static",
    "-lm": "--load-mode",
    "-lv": "--verbosity",
    "-lzm": "--lazy-mode",
    "-md": "--model-draft",
    "-mg": "--main-gpu",
    "-mli": "--multiline-input",
    "-mm": "--mmproj",
    "-mmdev": "--mmproj-device",
    "-mmu": "--mmproj-url",
    "-mu": "--model-url",
    "-ncffn": "--n-cpu-ffn",
    "-ncmoe": "--n-cpu-moe",
    "-ncmoed": "--n-cpu-moe-draft",
    "-ngl": "--gpu-layers",
    "-ngld": "--gpu-layers-draft",
    "-nkvo": "--no-kv-offload",
    "-no-cnv": "--no-conversation",
    "-no-kvu": "--no-kv-unified",
    "-nocb": "--no-cont-batching",
    "-nopo": "--no-op-offload",
    "-np": "--parallel",
    "-npl": "-npl",
    "-npp": "-npp",
    "-nr": "--no-repack",
    "-ns": "--sequences",
    "-ntg": "-ntg",
    "-oe": "--output-err",
    "-ot": "--override-tensor",
    "-otd": "--override-tensor-draft",
    "-pg": "-pg",
    "-pps": "-pps",
    "-ptc": "--print-token-count",
    "-rea": "--reasoning",
    "-rpc": "--rpc",
    "-sm": "--split-mode",
    "-sp": "--special",
    "-sps": "--slot-prompt-similarity",
    "-st": "--single-turn",
    "-sys": "--system-prompt",
    "-sysf": "--system-prompt-file",
    "-tb": "--threads-batch",
    "-tbd": "--threads-batch-draft",
    "-td": "--threads-draft",
    "-tgs": "-tgs",
    "-to": "--timeout",
    "-ts": "--tensor-split",
    "-ub": "--ubatch-size",
}


def split_flag(
    args: list[str], *, declared: set[str], take_values: set[str], names: Collection[str] = ()
) -> str | None:
    """The first of llama.cpp's multi-letter flags in `args` that the command does not declare
    (so Click would read it as short options run together), or None. Values of options that
    take one, everything after `--`, and from a subcommand's name on (`names`) are skipped."""
    value_next = False
    for arg in args:
        if value_next:
            value_next = False
            continue
        if arg == "--" or arg in names:
            return None
        flag = arg.split("=", 1)[0]
        if flag in declared:
            value_next = flag in take_values and "=" not in arg
        elif flag in LLAMA_CPP_SHORT_FLAGS:
            return flag
    return None


def split_flag_message(flag: str, command: str) -> str:
    """The usage error for an undeclared llama.cpp flag: what it is there, and where to look."""
    long = LLAMA_CPP_SHORT_FLAGS[flag]
    named = f"llama.cpp's {long}" if long != flag else "a llama.cpp option"
    return f"{flag} ({named}) is not an option of llmrun {command}"
