"""A runner that implements the runner interface without a model, for CLI-shape tests."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from llmrun.runners.base import (
    Event,
    Finished,
    LoadStarted,
    ModelLoaded,
    PrefillProgress,
    Request,
    Token,
)
from llmrun.runners.config import EngineConfig
from llmrun.runners.errors import BadRequestError, EmptyPromptError, PromptTooLongError
from llmrun.runners.gguf import GGUFInfo
from llmrun.runners.stats import (
    FINISH_INTERRUPTED,
    FINISH_LENGTH,
    FINISH_STOP,
    EngineSettings,
    GenerationStats,
    ModelInfo,
)

FAKE_MODEL = ModelInfo(
    path="/fake/model.gguf",
    name="fake-model",
    architecture="fake",
    quantization="Q4_0",
    n_params=1000,
    size_bytes=500,
    n_ctx_train=256,
    has_chat_template=True,
)
FAKE_SETTINGS = EngineSettings(
    backend="CPU",
    n_ctx=256,
    n_batch=4,
    n_ubatch=4,
    n_threads=1,
    n_threads_batch=1,
    n_gpu_layers=0,
    gpu_offload=False,
    flash_attn="off",
)


class FakeRunner:
    """Replies with the words of the last user message; one word is one token.

    Each prefill token "takes" 1 ms and each decode step 10 ms (reported, not slept).
    """

    def __init__(self, reply: str | None = None, n_ctx: int = 256) -> None:
        self.reply = reply
        self._n_ctx = n_ctx
        self._loaded: ModelLoaded | None = None
        self.requests: list[Request] = []
        self.closed = False
        self._cache: list[str] = []

    @property
    def loaded(self) -> ModelLoaded | None:
        return self._loaded

    def load(self, *, cancel: threading.Event | None = None) -> ModelLoaded:
        if self._loaded is None:
            settings = dataclasses.replace(FAKE_SETTINGS, n_ctx=self._n_ctx)
            self._loaded = ModelLoaded(FAKE_MODEL, settings, 0.5)
        return self._loaded

    def _words(self, request: Request) -> list[str]:
        text = (
            request.prompt
            if request.prompt is not None
            else " ".join(f"<{m.role}> {m.content}" for m in request.messages)
        )
        return text.split()

    def count_tokens(self, request: Request) -> int:
        return len(self._words(request))

    def reset(self) -> None:
        self._cache = []

    def close(self) -> None:
        self.closed = True

    def stream(self, request: Request, *, cancel: threading.Event | None = None) -> Iterator[Event]:
        cancel = cancel or threading.Event()
        self.requests.append(request)
        if self._loaded is None:
            yield LoadStarted("/fake/model.gguf")
            yield self.load()
        words = self._words(request)
        if not words:
            raise EmptyPromptError()
        if len(words) + 1 > self._n_ctx:
            raise PromptTooLongError(len(words), self._n_ctx)
        reused = 0
        while (
            reused < min(len(words) - 1, len(self._cache)) and self._cache[reused] == words[reused]
        ):
            reused += 1
        self._cache = list(words)
        yield PrefillProgress(reused, len(words), reused, 0.0)
        for done in range(reused + 4, len(words) + 4, 4):
            done = min(done, len(words))
            yield PrefillProgress(done, len(words), reused, (done - reused) * 0.001)
        prefill_s = (len(words) - reused) * 0.001
        reply = (
            self.reply
            if self.reply is not None
            else " ".join(m.content for m in request.messages if m.role == "user")[-200:]
            or (request.prompt or "")
        ).split()
        out, finish = [], FINISH_STOP
        for i, word in enumerate(reply):
            if i >= request.sampling.max_tokens:
                finish = FINISH_LENGTH
                break
            if cancel.is_set():
                finish = FINISH_INTERRUPTED
                break
            text = word if i == 0 else " " + word
            out.append(text)
            yield Token(i, text, 0.002 + prefill_s + 0.01 * i, i)
        stats = GenerationStats(
            finish_reason=finish,
            prompt_tokens=len(words),
            reused_tokens=reused,
            output_tokens=len(out),
            template_tokenize_s=0.001,
            prefill_s=prefill_s,
            first_sample_s=0.001,
            itl_s=tuple(0.01 for _ in out[1:]),
            e2e_s=0.002 + prefill_s + 0.01 * len(out),
            load_s=0.5,
            seed=request.sampling.seed,
            model=FAKE_MODEL,
            settings=FAKE_SETTINGS,
        )
        yield Finished(stats, "".join(out))


class FakeBenchRunner(FakeRunner):
    """A FakeRunner with what `bench` needs: settings that change, token-id prompts, a header."""

    model_path = "/fake/model.gguf"

    def __init__(self) -> None:
        super().__init__(reply="w " * 4096, n_ctx=4096)
        self.config = EngineConfig()
        self.configs: list[EngineConfig] = []

    def reconfigure(self, config: EngineConfig) -> ModelLoaded:
        self.config = config
        self.configs.append(config)
        self._loaded = None
        self._cache = []
        return self.load()

    def eval_tokens(self, tokens: list[int], *, cancel: threading.Event | None = None) -> None:
        self._cache = [str(t) for t in tokens]

    def header(self) -> GGUFInfo:
        return GGUFInfo(
            path=self.model_path,
            version=3,
            file_size_bytes=500,
            metadata={"general.architecture": "fake"},
            n_tensors=0,
            n_params=1000,
            data_size_bytes=500,
        )

    def vocab_size(self) -> int:
        return 100

    def tokenize(self, text: str, *, add_special: bool) -> list[int]:
        return [len(word) % 100 for word in text.split()]

    def perplexity(
        self,
        tokens: list[int],
        *,
        n_ctx: int,
        cancel: threading.Event | None = None,
        each: Callable[[Any, Sequence[int]], None] | None = None,
    ) -> tuple[float, int]:
        """A figure of the tokens (their variety), over whole windows as llama-perplexity."""
        if len(tokens) < n_ctx:
            raise BadRequestError(f"perplexity needs at least one window of {n_ctx} tokens")
        if each is not None:  # logits that favour the next token, bent by the model's name
            import numpy as np

            bend = sum(self.model_path.encode()) % 5 * 0.5
            for start in range(0, len(tokens) - n_ctx + 1, n_ctx):
                targets = tokens[start + n_ctx // 2 + 1 : start + n_ctx]
                rows = np.zeros((len(targets), 100), np.float32)
                rows[np.arange(len(targets)), targets] = 3.0
                each(rows + bend * np.cos(np.arange(100, dtype=np.float32)), targets)
        return 1.0 + len(set(tokens)), len(tokens) // n_ctx * n_ctx // 2

    def _words(self, request: Request) -> list[str]:
        if request.token_ids is not None:
            return [str(t) for t in request.token_ids]
        return super()._words(request)
