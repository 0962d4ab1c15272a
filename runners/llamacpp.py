"""The in-process engine: llama.cpp through llama-cpp-python's low-level API.

Why low level: the high-level `Llama` streaming path re-detokenizes the whole completion per
token, buffers text, mixes the consumer's time into generation time, and redirects the process's
file descriptors while loading. `LlamaCppRunner` is the face that composes the parts, each in a
module of its own: loading and placing the weights (loading.py), the contexts, their thread
pools and the warm-up (contexts.py), the load's record (load_record.py), prompts and templates
(prompts.py), the prefix cache (prefix_cache.py), prefill and decode (generation.py),
speculative decoding (speculation.py) and perplexity (perplexity.py).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .base import Event, LoadStarted, LocalLoaded, Request, SamplingParams
from .config import EngineConfig
from .contexts import (
    abort_on,
    batched_context,
    check_context,
    create_context,
    own_context_params,
    warm_up_decode,
)
from .errors import ChatTemplateTooLargeError, EngineError, LoadCancelledError
from .generation import generate, new_sampler
from .gguf import GGUFInfo, read_gguf
from .handles import Context, Model, Sampler
from .library import llama_lib
from .limits import MAX_CTX, MAX_TEMPLATE_BYTES, MemoryNeed, check_engine
from .load_record import load_record
from .loading import Weights, context_size, load_weights, memory_need
from .perplexity import perplexity
from .prefix_cache import PrefixCache
from .prompts import Prompts, formatter_for
from .speculation import Drafter, ModelDrafter, draft_config, open_draft


class LlamaCppRunner:
    """Runs requests on one loaded GGUF model, keeping its KV cache between requests."""

    def __init__(self, model_path: str, config: EngineConfig | None = None) -> None:
        self.model_path = model_path
        self.config = config or EngineConfig()
        check_engine(self.config)
        self.kv = PrefixCache()  # the runner's own context and the tokens cached in it
        self._weights: Weights | None = None
        self._n_seq = 1  # sequences of the runner's own context
        self._n_ctx_seq = 0  # and the tokens asked for each
        self._info: GGUFInfo | None = None
        self._loaded: LocalLoaded | None = None
        self.warmed_on: str | None = None  # the thread the context's warm-up decode ran on
        given = self.config.chat_template is not None  # --chat-template-file's text
        whose = "--chat-template-file's template" if given else "the model's chat template"
        self._prompts = Prompts(self._new_formatter, self._tokenize, whose)
        self._draft: LlamaCppRunner | None = None
        self._contexts: list[Context] = []  # make_context's, closed before the model
        self.contexts_made = 0  # llama.cpp contexts created on these weights, all told

    # ---- loading ----------------------------------------------------------------------

    @property
    def loaded(self) -> LocalLoaded | None:
        return self._loaded

    def load(
        self,
        *,
        n_seq: int | None = None,
        n_ctx: int | None = None,
        warm_up: bool = True,
        cancel: threading.Event | None = None,
    ) -> LocalLoaded:
        """Check the file, load the weights and create the context (once). With `n_seq` > 1
        the context holds that many sequences of `n_ctx` tokens each (default: -c), in one KV
        buffer or one stream per sequence (the config's `kv_unified`), for a batched engine
        to use as its own (`context`), so a server or a parallel run makes one context, not
        two. Tokenizing needs only the weights (`load_weights`).

        `warm_up=False` leaves the warm-up decode (--warmup) to `warm_up()` on the thread that
        will decode: llama.cpp's CPU backend (OpenMP) keeps a pool of worker threads for each
        thread that computes, and once a second thread computes, every decode of this 135M
        model on 2 cores took 10.9-14.8 ms instead of 7.8-8.6 ms.

        Setting `cancel` (a command's Ctrl-C or SIGTERM) ends the repacking probe's child, the
        tensors' load and the warm-up decode (LoadCancelledError); without it, the runner's own
        (`stream` sets the request's)."""
        if cancel is not None and self._loaded is None:
            self.kv.cancel = cancel  # a load stops at the next tensor when it is set
        if self._loaded is not None:
            if n_seq is not None and n_seq != self._n_seq:
                raise EngineError(f"the context was made for {self._n_seq} sequences, not {n_seq}")
            if n_ctx is not None and n_ctx != self._n_ctx_seq:
                raise EngineError(
                    f"the context was made for {self._n_ctx_seq} tokens per sequence, not {n_ctx}"
                )
            return self._loaded
        self.load_weights(n_seq=n_seq or 1, n_ctx=n_ctx)
        self._loaded = self._new_context(n_seq or 1, n_ctx)
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

    def _warm_up(self) -> float:
        """llama-cli's warm-up decode on the runner's own context; returns its seconds."""
        assert self._loaded is not None
        cancel = self.kv.cancel
        try:
            with abort_on(self.kv.ptr, cancel):  # a slow first decode (a GPU's set-up) too
                return warm_up_decode(
                    self._model_checked, self.kv.ptr, self._loaded.settings.n_batch
                )
        except EngineError:
            if cancel.is_set():
                raise LoadCancelledError(self.model_path) from None
            raise

    def load_weights(self, *, n_seq: int = 1, n_ctx: int | None = None) -> None:
        """Check the file and load the weights (once), without a context: enough to tokenize,
        render the chat template and read the vocabulary, so a caller that sizes its context
        from the prompts makes only that one. On a GPU, the layers offloaded are those that
        fit beside the KV cache of `n_seq` sequences of `n_ctx` tokens (default: -c)."""
        if self._weights is None:
            self._weights = load_weights(
                self.model_path, self.config, n_seq=n_seq, n_ctx=n_ctx, cancel=self.kv.cancel
            )
            self._info = self._weights.info

    def _new_context(self, n_seq: int, n_ctx_seq: int | None) -> LocalLoaded:
        """Create the context (n_seq sequences of n_ctx_seq tokens each, default -c); load
        time is the weights' load plus this context's creation."""
        t0 = time.perf_counter()
        weights, cfg = self._weights, self.config
        assert weights is not None
        n_ctx_train = weights.info.n_ctx_train or llama_lib().llama_model_n_ctx_train(
            weights.model.ptr
        )
        asked = context_size(cfg, n_ctx_train)
        n_ctx = asked if n_ctx_seq is None else n_ctx_seq
        cparams = own_context_params(self.model_path, cfg, n_ctx=n_ctx, n_seq=n_seq, asked=asked)
        check_context(cfg, weights.model, weights.info, cparams)
        context = create_context(self.model_path, weights.model, cparams, cfg.threadpool)
        self.kv.attach(context)
        self.contexts_made += 1
        load_s = weights.load_s + time.perf_counter() - t0
        self._n_seq, self._n_ctx_seq = n_seq, n_ctx
        return load_record(
            weights, cfg, context, cparams, n_seq=n_seq, n_ctx_train=n_ctx_train, load_s=load_s
        )

    def reconfigure(self, config: EngineConfig) -> LocalLoaded:
        """Switch to other settings, reloading the weights only if they need it.

        A failure leaves the runner unloaded (the error says why); the next call starts afresh.
        """
        check_engine(config)
        if self._weights is not None and config.same_model(self.config):
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
        return memory_need(self.config, info, n_seq=n_seq, n_ctx=n_ctx)

    def vocab_size(self) -> int:
        """Tokens in the model's vocabulary (loads the weights if they are not loaded)."""
        self.load_weights()
        return self._model_checked.n_vocab

    def vocab(self) -> Any:
        """llama.cpp's vocabulary handle, which a grammar is parsed against (loads the weights)."""
        self.load_weights()
        return self._model_checked.vocab

    def chat_template(self) -> str | None:
        """The chat template requests are rendered with: --chat-template-file's, or the GGUF's."""
        if self.config.chat_template:
            return self.config.chat_template
        template = self.header().chat_template
        if template is not None and len(template.encode()) > MAX_TEMPLATE_BYTES:
            raise ChatTemplateTooLargeError(len(template.encode()), MAX_TEMPLATE_BYTES)
        return template

    def header(self) -> GGUFInfo:
        """The model file's GGUF header (read once; the weights need not be loaded)."""
        if self._info is None:
            self._info = read_gguf(self.model_path)
        return self._info

    @property
    def _model(self) -> Model | None:
        return self._weights.model if self._weights is not None else None

    @property
    def _model_checked(self) -> Model:
        assert self._weights is not None
        return self._weights.model

    # ---- tokens and text ---------------------------------------------------------------

    def tokenize(self, text: str, *, add_special: bool) -> list[int]:
        self.load_weights()
        return self._model_checked.to_tokens(text, add_special=add_special)

    def _tokenize(self, text: str, add_special: bool) -> list[int]:
        return self.tokenize(text, add_special=add_special)

    def piece(self, token: int, *, special: bool = False) -> bytes:
        return self._model_checked.to_piece(token, special=special)

    def is_eog(self, token: int) -> bool:
        """Whether the token ends a generation (end of sequence or of turn)."""
        return self._model_checked.is_eog(token)

    def render(self, request: Request) -> str:
        """The prompt text a request stands for: raw, or its messages through the chat template."""
        return self._prompts.render(request)

    def _new_formatter(self) -> Any:
        return formatter_for(self._model_checked, self.chat_template())

    def request_tokens(self, request: Request) -> list[int]:
        self.load_weights()
        return self._prompts.text_and_tokens(request)[1]

    def count_tokens(self, request: Request) -> int:
        return len(self.request_tokens(request))

    # ---- cache -------------------------------------------------------------------------

    @property
    def cached_tokens(self) -> int:
        return len(self.kv.tokens)

    def reset(self) -> None:
        if self.kv.context is not None:
            self.kv.truncate(0)

    # ---- generation --------------------------------------------------------------------

    def stream(self, request: Request, *, cancel: threading.Event | None = None) -> Iterator[Event]:
        cancel = cancel or threading.Event()
        if self._loaded is None:
            self.kv.cancel = cancel  # a load stops at the next tensor when it is set
            yield LoadStarted(self.model_path)
            yield self.load()
        loaded = self.load()
        if self.config.draft_model and request.sampling.draft:
            self._draft_runner()  # loaded before the clock starts: not a decode cost
        yield from generate(
            request,
            cancel,
            loaded=loaded,
            model=self._model_checked,
            kv=self.kv,
            prompts=self._prompts,
            drafter=self._drafter,
        )

    def new_sampler(self, sp: SamplingParams, seed: int, *, prompt: Sequence[int] = ()) -> Sampler:
        """A C sampler chain for these settings (perf counters on); the repeat penalty sees the
        prompt, as in llama-cli; its -1 window is a sequence's context (before one is made,
        any length). The caller closes it."""
        n_ctx = self._n_ctx_seq or MAX_CTX
        return new_sampler(self._model, sp, seed, prompt=prompt, n_ctx=n_ctx)

    def _drafter(self, sp: SamplingParams) -> Drafter | None:
        """Speculative decoding's drafter for these settings: from the draft model when there
        is one, else prompt lookup; None without --draft."""
        if not sp.draft:
            return None
        if self.config.draft_model:
            return ModelDrafter(llama_lib(), sp.draft, self.kv.tokens, self._draft_runner())
        return Drafter(llama_lib(), sp.draft, self.kv.tokens)

    def _draft_runner(self) -> LlamaCppRunner:
        """The draft model (--draft-model), loaded once, checked to share the vocabulary."""
        if self._draft is None:
            assert self.config.draft_model is not None
            settings = self.load().settings
            draft = LlamaCppRunner(self.config.draft_model, draft_config(self.config, settings))
            open_draft(draft, self._model_checked.n_vocab)
            self._draft = draft
        return self._draft

    # ---- direct access for checks and benchmarks ---------------------------------------

    def perplexity(
        self,
        tokens: list[int],
        *,
        n_ctx: int,
        cancel: threading.Event | None = None,
        each: Callable[[Any, Sequence[int]], None] | None = None,
    ) -> tuple[float, int]:
        """llama-perplexity's figure for these tokens: (perplexity, tokens scored)."""
        settings = self.load().settings
        return perplexity(
            self.kv,
            self._model_checked,
            tokens,
            n_ctx=n_ctx,
            n_ctx_loaded=settings.n_ctx,
            n_batch=settings.n_batch,
            cancel=cancel,
            each=each,
        )

    def eval_tokens(self, tokens: list[int], *, cancel: threading.Event | None = None) -> None:
        """Append tokens to the cache in chunks of n_batch (no sampling, no timing).

        Setting `cancel` stops within the running chunk; the cache then holds what completed."""
        n_batch = self.load().settings.n_batch
        self.kv.eval_tokens(tokens, n_batch, cancel or threading.Event())

    def make_context(
        self,
        *,
        n_seq: int,
        n_ctx: int,
        n_batch: int,
        kv_unified: bool | None = None,
    ) -> Context:
        """Another context on the loaded weights, e.g. the batched engine's for `n_seq`
        sequences, with this runner's threads, flash attention and KV layout (`kv_unified`;
        None: the config's). The runner closes it, if its user has not, before it frees the
        model."""
        loaded = self.load()
        context = batched_context(
            self._model_checked,
            loaded.settings,
            self.config.threadpool,
            n_seq=n_seq,
            n_ctx=n_ctx,
            n_batch=n_batch,
            kv_unified=self.config.kv_unified if kv_unified is None else kv_unified,
        )
        self.contexts_made += 1
        self._contexts = [c for c in self._contexts if c.ptr is not None] + [context]
        return context

    @property
    def context(self) -> Context:
        """The runner's own context (load() first): a batched engine may use it when it was
        made for its sequences (`load(n_seq=...)`); the runner still closes it."""
        assert self.kv.context is not None, "no context: load() first"
        return self.kv.context

    def _free_context(self) -> None:
        self.kv.detach()
        self._n_seq, self._n_ctx_seq = 1, 0
        self._loaded = None
        self.warmed_on = None

    def close(self) -> None:
        for context in self._contexts:  # contexts go before the model they were made from
            context.close()
        self._contexts.clear()
        self._free_context()
        if self._weights is not None:
            self._weights.model.close()
            self._weights = None
        if self._draft is not None:
            self._draft.close()
            self._draft = None

    def __enter__(self) -> LlamaCppRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
