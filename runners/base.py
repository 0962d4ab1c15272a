"""The runner interface: one generator of events per request, and what is built on it.

Every engine (llama.cpp in-process today, an OpenAI-compatible server later) implements
`Runner.stream`. `run`, `chat` and `bench` consume the same events, so a dashboard, a plain
status line or a benchmark loop are all just different consumers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from .stats import EngineSettings, GenerationStats, ModelInfo, ServerSettings

if TYPE_CHECKING:
    from .config import EngineConfig
    from .gguf import GGUFInfo

DEFAULT_TIMEOUT_S = 60.0  # a remote server's read timeout


@dataclass(frozen=True)
class ChatMessage:
    role: str  # "system" | "user" | "assistant"
    content: str


@dataclass(frozen=True)
class SamplingParams:
    """Sampling options, named after llama.cpp's. temperature <= 0 means greedy."""

    max_tokens: int = 512
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None  # None: a random seed, reported in the stats
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # benchmarks generate exactly max_tokens
    think: bool | None = None  # the template's thinking switch (enable_thinking); None: default
    draft: int = 0  # prompt-lookup speculative decoding: at most this many drafts (greedy only)
    grammar: str | None = None  # GBNF the answer follows (run --json-schema / --grammar)


@dataclass(frozen=True)
class Request:
    """One generation: chat messages rendered with the model's template, or a raw prompt.

    `token_ids`, when given, are fed to the engine as is (benchmarks use random tokens).
    """

    messages: tuple[ChatMessage, ...] = ()
    prompt: str | None = None
    token_ids: tuple[int, ...] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    tools: tuple[Any, ...] = ()  # OpenAI tool definitions, for a chat template that renders them
    keep_cache: bool = True  # reuse the KV cache of a shared prefix with the previous request
    # llama-bench's tg: after each decode step a random token is fed, nothing is sampled
    # (engines that cannot do this sample as usual)
    decode_only: bool = False

    @classmethod
    def chat(cls, user: str, *, system: str | None = None, **kw: object) -> Request:
        messages = ((ChatMessage("system", system),) if system else ()) + (
            ChatMessage("user", user),
        )
        return cls(messages=messages, **kw)  # type: ignore[arg-type]


# ---- events -------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadStarted:
    path: str


@dataclass(frozen=True)
class ModelLoaded:
    """The engine is ready: a local model's facts and settings, or a server's."""

    model: ModelInfo | None  # None for a server: nothing is known about its weights
    settings: EngineSettings | ServerSettings
    load_s: float

    @property
    def name(self) -> str:
        if isinstance(self.settings, ServerSettings):
            return self.settings.model
        return self.model.name if self.model is not None else ""

    @property
    def n_ctx(self) -> int:
        return self.settings.n_ctx


@dataclass(frozen=True)
class LocalLoaded(ModelLoaded):
    """A model loaded in this process: its facts and the engine settings that run."""

    model: ModelInfo
    settings: EngineSettings
    warmup_s: float | None = None  # the warm-up decode after the load (None: skipped)
    probe_s: float | None = None  # the repack probe before it, when one ran (not in load_s)


@dataclass(frozen=True)
class PrefillProgress:
    """Emitted once before the first chunk (done == reused) and after every chunk."""

    done_tokens: int  # includes reused tokens
    total_tokens: int
    reused_tokens: int
    elapsed_s: float  # prefill time so far


@dataclass(slots=True)  # not frozen: one is made per output token, and frozen costs 4x
class Token:
    index: int  # 0 for the first output token
    text: str  # text released with this token (may be "" while a character or stop is pending)
    t_s: float  # seconds since the request was handed to the runner
    token_id: int = -1
    thinking: bool = False  # part of the model's thinking, not of its answer


@dataclass(frozen=True)
class Finished:
    stats: GenerationStats
    text: str  # the whole output text
    tail: str = ""  # text held back until the end (not yet sent in a Token event)


Event = LoadStarted | ModelLoaded | LocalLoaded | PrefillProgress | Token | Finished


class Runner(Protocol):
    """An engine. `stream` loads the model on first use (yielding the load events)."""

    def stream(self, request: Request, *, cancel: threading.Event | None = None) -> Iterator[Event]:
        """Run one request, yielding events; the last one is always `Finished`.

        Setting `cancel` stops the request at the next chunk or token: it still ends with
        `Finished`, its stats marked interrupted.
        """

    def count_tokens(self, request: Request) -> int:
        """How many prompt tokens the request renders to."""

    @property
    def loaded(self) -> ModelLoaded | None:
        """The load event once the model is loaded, else None."""

    def load(self) -> ModelLoaded:
        """Load the model now (`stream` does it on first use); loading twice is a no-op."""

    def reset(self) -> None:
        """Forget the KV cache, so the next request prefills from scratch."""

    def close(self) -> None: ...


class BenchRunner(Runner, Protocol):
    """What `bench` and `tune` need beyond `Runner`: a local model whose settings can change
    between tests, raw token evaluation for the depth fill, and the model's facts."""

    model_path: str
    config: EngineConfig  # the settings it runs with (tuned values filled in)

    def load(self, *, cancel: threading.Event | None = None) -> LocalLoaded:
        """Load (once); setting `cancel` ends the load (the repack probe, the tensors, the
        warm-up) with LoadCancelledError."""

    def reconfigure(self, config: EngineConfig) -> LocalLoaded:
        """Switch to other engine settings, reloading the weights only where they change."""

    def eval_tokens(self, tokens: list[int], *, cancel: threading.Event | None = None) -> None:
        """Append tokens to the KV cache, untimed (a test's depth)."""

    def header(self) -> GGUFInfo:
        """The model file's GGUF header."""

    def vocab_size(self) -> int: ...

    def tokenize(self, text: str, *, add_special: bool) -> list[int]: ...

    def perplexity(
        self,
        tokens: list[int],
        *,
        n_ctx: int,
        cancel: threading.Event | None = None,
        each: Callable[[Any, Sequence[int]], None] | None = None,
    ) -> tuple[float, int]:
        """llama-perplexity's figure for these tokens: (perplexity, tokens scored)."""


def generate(
    runner: Runner, request: Request, *, cancel: threading.Event | None = None
) -> Finished:
    """Run a request to the end and return its text and stats."""
    for event in runner.stream(request, cancel=cancel):
        if isinstance(event, Finished):
            return event
    raise RuntimeError("runner ended without a Finished event")
