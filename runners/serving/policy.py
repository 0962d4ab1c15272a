"""The batched engine's scheduling policies: which decode tokens and prompt chunks go into
each step's llama_decode batch.

- `prefill-first`: a waiting prompt is prefilled whole (up to n_batch tokens a step) before the
  running sequences decode again; those steps carry no decode tokens.
- `chunked:B` (Sarathi-Serve): every step carries all running decodes and at most B tokens in
  all, topped up with prefill chunks.
- `decode-first`: prompts are prefilled only when no sequence is decoding; `decode-first:K`
  also lets a prefill in after K decode-only steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, TypeVar

from llmrun.runners.errors import OptionError
from llmrun.runners.lists import whole

POLICIES = ("prefill-first", "decode-first", "chunked")


@dataclass(frozen=True)
class Policy:
    name: str  # prefill-first, decode-first, chunked
    budget: int = 0  # chunked: tokens per step in all

    @classmethod
    def parse(cls, text: str) -> Policy:
        name, _, value = text.strip().lower().partition(":")
        if name not in POLICIES:
            raise OptionError(f"--policy: '{text}' is not prefill-first, decode-first or chunked:B")
        number = whole(value) or 0
        if name == "chunked":
            if not 1 <= number <= 65536:
                raise OptionError(
                    f"--policy: chunked needs a token budget, chunked:64, not '{text}'"
                )
            return cls(name, number)
        if name == "decode-first" and value:  # decode-first:K: prefill at least every K steps
            if not 1 <= number <= 65536:
                raise OptionError(f"--policy: decode-first:K needs a step count, not '{text}'")
            return cls(name, number)
        if value:
            raise OptionError(f"--policy: '{name}' takes no value")
        return cls(name)

    def __str__(self) -> str:
        return f"{self.name}:{self.budget}" if self.budget else self.name


class Scheduled(Protocol):
    """What scheduling reads of a request (the engine's Handle)."""

    sid: int  # its sequence id
    tokens: tuple[int, ...]  # its prompt
    prefilled: int  # prompt tokens scheduled so far
    pending: int | None  # sampled, not yet decoded


S = TypeVar("S", bound=Scheduled)


def schedule(
    policy: Policy, waiting: list[S], running: list[S], *, n_batch: int, held: int
) -> tuple[list[S], list[tuple[S, int, int]], int]:
    """The step under the policy: the sequences that decode their pending token, and the
    prompt chunks that go with them (each waiting sequence's `prefilled` advanced past its
    chunk). `held` counts decode-only steps since the last prefill (decode-first:K); the
    count after this step comes back third."""
    # in sequence order: with one KV stream per sequence (kv_unified off) llama.cpp puts only
    # consecutive sequence ids into one ubatch, so an unordered step would split in many
    decodes = sorted((s for s in running if s.pending is not None), key=_sid)
    room = n_batch
    if policy.name == "chunked":
        room = max(0, min(n_batch, policy.budget) - len(decodes))
    elif policy.name == "prefill-first" and waiting:
        decodes, room = [], n_batch  # the prompt first, whole
    elif policy.name == "decode-first" and decodes:
        held += 1  # decode-first:K lets a prefill in after K decode-only steps
        room = 0 if not policy.budget or held < policy.budget else n_batch
        if room:
            held = 0
        room = max(0, room - len(decodes))
    else:
        room = n_batch - len(decodes)
    chunks: list[tuple[S, int, int]] = []  # (sequence, first position, length)
    for seq in waiting:
        if room <= 0:
            break
        take = min(room, len(seq.tokens) - seq.prefilled)
        chunks.append((seq, seq.prefilled, take))
        seq.prefilled += take
        room -= take
    return decodes, chunks, held


def _sid(seq: Scheduled) -> int:
    return seq.sid
