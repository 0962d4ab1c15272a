"""llama-perplexity's figure on the runner's own context: a text scored in windows; the text
tokenized in steps that Ctrl-C and SIGTERM stop (files.read_capped reads it so too)."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

from .errors import BadRequestError, EngineError
from .handles import Batch, Model
from .library import llama_lib
from .prefix_cache import PrefixCache

MIN_WINDOW = 4  # tokens of a window: its second half is scored, each position after the first

TOKENIZE_PIECE = 2**16  # characters tokenized between two looks at `cancel` (~0.1 s on 2 cores)
SEAM = 256  # characters each side of a cut that are tokenized whole to check it
CUT_TRIES = 16  # line breaks tried for a cut before the rest is tokenized whole


def tokenize_interruptibly(
    tokenize: Callable[[str], list[int]], text: str, cancel: threading.Event
) -> list[int] | None:
    """`tokenize(text)`, in pieces that each end with a look at `cancel` (None once it is
    set): llama.cpp tokenizes 5 MB in about 8 s here, and no signal reaches Python meanwhile.
    The pieces are cut at a line break, before or after it, where the two sides tokenized
    apart give the tokens of the characters around the cut tokenized whole (the tokenizers of
    BPE models split text there). A tokenizer that joins across every cut tried
    (SentencePiece's leading space, say) gets the rest whole, as llama-perplexity does."""
    tokens: list[int] = []
    start = 0
    while True:
        if cancel.is_set():
            return None
        cut = _cut(tokenize, text, start + TOKENIZE_PIECE)
        tokens += tokenize(text[start:cut])
        if cut is None:
            return tokens
        start = cut


def _cut(tokenize: Callable[[str], list[int]], text: str, at: int) -> int | None:
    """Where to cut, at or after `at`, with the same tokens either way; None: nowhere (the
    end of the text, or a tokenizer that joins across line breaks)."""
    found = text.find("\n", at)
    for _ in range(CUT_TRIES):
        if found == -1:
            return None
        for cut in (found, found + 1):
            left, right = text[max(0, cut - SEAM) : cut], text[cut : cut + SEAM]
            if left and right and tokenize(left) + tokenize(right) == tokenize(left + right):
                return cut
        found = text.find("\n", found + 1)
    return None


def perplexity(
    kv: PrefixCache,
    model: Model,
    tokens: list[int],
    *,
    n_ctx: int,
    n_ctx_loaded: int,
    n_batch: int,
    cancel: threading.Event | None = None,
    each: Callable[[Any, Sequence[int]], None] | None = None,
) -> tuple[float, int]:
    """llama-perplexity's method: the text in non-overlapping windows of n_ctx tokens, each
    evaluated from an empty cache, and in each window the second half's predictions of
    their next token scored (the first half only gives them context). Returns the
    perplexity, exp(mean negative log-likelihood), and the number of tokens scored.
    `n_ctx_loaded` is the context's size, `n_batch` its batch. `each`, when given, sees every
    batch's scored positions as they are decoded: their logits (rows of float32, valid during
    the call) and the text's next token at each (a KL divergence's base or comparison)."""
    import numpy as np

    if n_ctx_loaded < n_ctx:
        raise BadRequestError(
            f"perplexity windows of {n_ctx} tokens need a context that"
            f" large; this one holds {n_ctx_loaded}"
        )
    if n_ctx < MIN_WINDOW:
        raise BadRequestError(f"perplexity's windows need {MIN_WINDOW} tokens or more, not {n_ctx}")
    if len(tokens) < n_ctx:
        raise BadRequestError(
            f"perplexity needs at least one window of {n_ctx} tokens; the text has {len(tokens)}"
        )
    lib = llama_lib()
    n_vocab = model.n_vocab
    first = n_ctx // 2
    nll, scored = 0.0, 0
    batch = Batch(lib, n_batch)
    if cancel is not None:  # a window's batch stops within its graph: 512 tokens take seconds
        kv.abortable(cancel)
    try:
        for start in range(0, len(tokens) - n_ctx + 1, n_ctx):
            window = tokens[start : start + n_ctx]
            kv.truncate(0)
            for off in range(0, n_ctx, n_batch):
                if cancel is not None and cancel.is_set():
                    raise BadRequestError("perplexity interrupted")
                n = min(n_batch, n_ctx - off)
                for pos in range(off, off + n):
                    batch.set(pos - off, window[pos], pos, 0, first <= pos < n_ctx - 1)
                batch.n_tokens = n
                if lib.llama_decode(kv.ptr, batch.struct) != 0:
                    if cancel is not None and cancel.is_set():
                        raise BadRequestError("perplexity interrupted")
                    raise EngineError("llama_decode failed while scoring perplexity")
                scored_here = range(max(off, first), min(off + n, n_ctx - 1))
                if each is not None and scored_here:
                    rows = np.ctypeslib.as_array(
                        lib.llama_get_logits(kv.ptr), shape=(len(scored_here), n_vocab)
                    )
                    each(rows, [window[pos + 1] for pos in scored_here])
                for pos in scored_here:
                    ptr = lib.llama_get_logits_ith(kv.ptr, pos - off)
                    logits = np.ctypeslib.as_array(ptr, shape=(n_vocab,)).astype(np.float64)
                    top = logits.max()
                    log_z = top + math.log(float(np.exp(logits - top).sum()))
                    nll += log_z - logits[window[pos + 1]]
                    scored += 1
    finally:
        if cancel is not None:
            kv.unabortable()
        batch.close()
        kv.truncate(0)
    return math.exp(nll / scored), scored
