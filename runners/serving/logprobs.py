"""Log probabilities of the sampled tokens, from the logits llama.cpp already has.

A step's logits row (llama_get_logits' output row, a numpy view over llama.cpp's buffer) gives
the log-softmax in three vectorised passes (max, sum of exponentials, subtraction only for the
tokens asked), and the most likely tokens with one `argpartition`: no Python loop over the
vocabulary. They are the model's own probabilities, before any sampler (temperature, top-k,
top-p, min-p, the repeat penalty, a grammar): llama-server's default (`post_sampling_probs`
false), what OpenAI's API reports too.

`TokenLogprob` holds token ids (made on the engine's thread); `described` gives each token's
text and bytes (on the engine's thread too: the vocabulary's piece buffer is not shared).
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

MAX_TOP_CHAT = 20  # OpenAI's bounds: top_logprobs in chat, logprobs in legacy completions
MAX_TOP_LEGACY = 5


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the most likely tokens, most likely first


def token_logprob(row: Any, token: int, top_n: int) -> TokenLogprob:
    """The sampled token's log probability under the row's softmax, and the top_n tokens'."""
    import numpy as np  # only when log probabilities are asked for (`bench --help` imports us)

    peak = float(row.max())
    lse = peak + float(np.log(np.exp(row - peak, dtype=np.float64).sum()))
    top: tuple[tuple[int, float], ...] = ()
    if top_n > 0:
        n = min(top_n, row.shape[0])
        best = np.argpartition(row, -n)[-n:]
        best = best[np.argsort(-row[best], kind="stable")]
        top = tuple((int(t), float(row[t]) - lse) for t in best)
    return TokenLogprob(token, float(row[token]) - lse, top)


def rows_logprobs(block: Any, tokens: Sequence[int], top_n: int) -> list[TokenLogprob]:
    """`token_logprob` for each row of a block of logits (a prompt's positions: row k gives
    the log probability of tokens[k]), in whole-block numpy passes."""
    import numpy as np

    peak = block.max(axis=1, keepdims=True)
    lse = peak[:, 0] + np.log(np.exp(block - peak, dtype=np.float64).sum(axis=1))
    ids = np.asarray(tokens)
    chosen = block[np.arange(len(ids)), ids] - lse
    tops: list[tuple[tuple[int, float], ...]] = [()] * len(ids)
    if top_n > 0:
        n = min(top_n, block.shape[1])
        best = np.argpartition(block, -n, axis=1)[:, -n:]
        values = np.take_along_axis(block, best, axis=1)
        order = np.argsort(-values, axis=1, kind="stable")
        best = np.take_along_axis(best, order, axis=1)
        values = np.take_along_axis(values, order, axis=1) - lse[:, None]
        tops = [
            tuple(zip(b.tolist(), v.tolist(), strict=True))
            for b, v in zip(best, values, strict=True)
        ]
    return [
        TokenLogprob(t, p, top)
        for t, p, top in zip(ids.tolist(), chosen.tolist(), tops, strict=True)
    ]


@dataclass(frozen=True)
class Choice:
    """One token as an answer names it: its text, its bytes and its log probability."""

    text: str
    data: bytes
    logprob: float | None  # None: a prompt's first token (nothing before it to predict it)


@dataclass(frozen=True)
class Described:
    chosen: Choice
    top: tuple[Choice, ...]


def token_text(data: bytes) -> str:
    """The token's text; a piece that is not whole UTF-8 as OpenAI writes it (`bytes:\\xe2`)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def described(lp: TokenLogprob | int, piece: Callable[[int], bytes]) -> Described:
    """The token's text, bytes and log probability, and its top ones'; a bare token id is a
    prompt's first token, which has none."""

    def choice(token: int, logprob: float | None) -> Choice:
        data = piece(token)
        return Choice(token_text(data), data, logprob)

    if isinstance(lp, int):
        return Described(choice(lp, None), ())
    return Described(choice(lp.token, lp.logprob), tuple(choice(t, p) for t, p in lp.top))


def chat_content(tokens: tuple[Described, ...]) -> dict[str, Any]:
    """OpenAI's chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}]}."""

    def one(c: Choice) -> dict[str, Any]:
        return {"token": c.text, "logprob": c.logprob, "bytes": list(c.data)}

    return {"content": [{**one(d.chosen), "top_logprobs": [one(c) for c in d.top]} for d in tokens]}


def legacy(tokens: tuple[Described, ...], offset: int) -> dict[str, Any]:
    """Legacy completions' `logprobs`: tokens, token_logprobs, top_logprobs (a token -> logprob
    object each) and text_offset (each token's place in the answer's text, from `offset`)."""
    offsets = []
    text = codecs.getincrementaldecoder("utf-8")(errors="ignore")  # a character split over
    for d in tokens:  # two tokens counts once, when it is whole
        offsets.append(offset)
        offset += len(text.decode(d.chosen.data))
    return {
        "tokens": [d.chosen.text for d in tokens],
        "token_logprobs": [d.chosen.logprob for d in tokens],
        "top_logprobs": [None if d.chosen.logprob is None else _top(d) for d in tokens],
        "text_offset": offsets,
    }


def _top(d: Described) -> dict[str, float | None]:
    """A token's legacy `top_logprobs`: the top ones, and the sampled token beside them when it
    is not among them (OpenAI's API and vLLM: up to logprobs+1 entries)."""
    top: dict[str, float | None] = {c.text: c.logprob for c in d.top}
    top.setdefault(d.chosen.text, d.chosen.logprob)
    return top
