"""Speculative decoding (greedy): drafts proposed by prompt lookup or by a small draft model,
checked by the model in one batch per step, the longest agreeing prefix kept."""

from __future__ import annotations

import threading
from typing import Any, Protocol

from .base import LocalLoaded
from .config import EngineConfig
from .errors import BadRequestError, EngineError
from .handles import Batch, Sampler
from .prefix_cache import PrefixCache
from .stats import EngineSettings


class DraftModel(Protocol):
    """What a draft model's runner offers the drafter (LlamaCppRunner does)."""

    kv: PrefixCache

    def eval_tokens(self, tokens: list[int], *, cancel: threading.Event | None = None) -> None: ...

    def is_eog(self, token: int) -> bool: ...

    def vocab_size(self) -> int: ...

    def load(self) -> LocalLoaded: ...

    def close(self) -> None: ...


class Drafter:
    """Prompt-lookup speculative decoding (greedy): the last few tokens are looked up earlier in
    the context, the tokens that followed there are proposed, and the model checks them all in
    one batch; the longest agreeing prefix is kept, plus the model's own next token."""

    NGRAMS = (4, 3, 2)  # the longest match first; one token alone predicts too little

    def __init__(self, lib: Any, n_draft: int, cache: list[int]) -> None:
        self.lib, self.n_draft, self.cache = lib, n_draft, cache
        self.batch = Batch(lib, n_draft + 1)
        self.drafted = self.accepted = self.steps = 0
        self.length = n_draft  # adapts: doubled after a full acceptance, halved after a miss

    def propose(self, history: list[int], limit: int) -> list[int]:
        for n in self.NGRAMS:
            if len(history) <= n:
                continue
            tail = history[-n:]
            for start in range(len(history) - n - 1, max(-1, len(history) - 4097), -1):
                if history[start : start + n] == tail:
                    return history[start + n : start + n + min(limit, self.length)]
        return []

    def step(self, ctx: Any, chain: Sampler, token: int, room: int) -> tuple[list[int], int]:
        """Decode `token` and its drafts in one batch; returns (accepted drafts, next token)."""
        lib, batch = self.lib, self.batch
        drafts = self.propose([*self.cache, token], min(room, self.length)) if room > 0 else []
        base = len(self.cache)
        for i, t in enumerate([token, *drafts]):
            batch.set(i, t, base + i)
        batch.n_tokens = 1 + len(drafts)
        rc = lib.llama_decode(ctx, batch.struct)
        if rc != 0:
            raise EngineError(f"llama_decode failed during generation (code {rc})")
        self.steps += 1
        self.drafted += len(drafts)
        accepted: list[int] = []
        following = chain.sample(ctx, 0)
        for i, draft in enumerate(drafts):
            if following != draft:
                break
            accepted.append(draft)
            following = chain.sample(ctx, i + 1)
        self.accepted += len(accepted)
        if drafts:
            full = len(accepted) == len(drafts)
            self.length = min(self.n_draft, self.length * 2) if full else max(1, self.length // 2)
        self.cache.extend([token, *accepted])
        if len(accepted) < len(drafts):  # the rejected drafts' KV entries go
            mem = lib.llama_get_memory(ctx)
            lib.llama_memory_seq_rm(mem, 0, len(self.cache), -1)
        return accepted, following

    def unused(self, n: int) -> None:
        """The generation stopped (Ctrl-C, a stop string, the length) with `n` accepted drafts
        not yet emitted: they leave the counts, which then describe the output alone (an
        interrupted run reported 16 accepted drafts for 11 output tokens)."""
        self.drafted -= n
        self.accepted -= n

    def close(self) -> None:
        self.batch.close()


class ModelDrafter(Drafter):
    """Drafts from a small model with the same vocabulary: it follows the accepted text in a
    context of its own (its rejected guesses cut off by prefix reuse) and guesses greedily."""

    def __init__(self, lib: Any, n_draft: int, cache: list[int], draft: DraftModel) -> None:
        super().__init__(lib, n_draft, cache)
        self.draft = draft
        self.greedy = Sampler.greedy(lib)

    def propose(self, history: list[int], limit: int) -> list[int]:
        d, lib = self.draft, self.lib
        kept = d.kv.reuse_prefix(history)
        d.eval_tokens(history[kept:])  # the new accepted text, then guess on from it
        guesses: list[int] = []
        one = (lib.llama_token * 1)()
        while len(guesses) < limit:
            guess = self.greedy.sample(d.kv.ptr)
            if d.is_eog(guess):
                break
            guesses.append(guess)
            if len(guesses) == limit:
                break
            one[0] = guess
            if lib.llama_decode(d.kv.ptr, lib.llama_batch_get_one(one, 1)) != 0:
                break
            d.kv.tokens.append(guess)
        return guesses

    def close(self) -> None:
        super().close()
        self.greedy.close()


def draft_config(config: EngineConfig, settings: EngineSettings) -> EngineConfig:
    """The draft model's settings: the main context's size and threads, on the CPU."""
    return EngineConfig(
        n_ctx=settings.n_ctx,
        n_threads=settings.n_threads,
        n_gpu_layers=0,
        threadpool=config.threadpool,
    )


def open_draft(draft: DraftModel, n_vocab: int) -> None:
    """The draft model (--draft-model) checked to share the vocabulary, then loaded; closed
    again if either fails."""
    theirs = draft.vocab_size()
    if theirs != n_vocab:
        draft.close()
        raise BadRequestError(
            f"--draft-model: its vocabulary ({theirs} tokens) is not this model's ({n_vocab})"
        )
    try:
        draft.load()  # its context: the vocabulary check needed only the weights
    except BaseException:
        draft.close()
        raise
