"""llama-perplexity's figure on the runner's own context: a text scored in windows."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

from .errors import BadRequestError, EngineError
from .handles import Batch, Model
from .library import llama_lib
from .prefix_cache import PrefixCache


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
    if n_ctx < 4 or len(tokens) < n_ctx:
        raise BadRequestError(
            f"perplexity needs at least one window of {n_ctx} tokens; the text has {len(tokens)}"
        )
    lib = llama_lib()
    n_vocab = model.n_vocab
    first = n_ctx // 2
    nll, scored = 0.0, 0
    batch = Batch(lib, n_batch)
    try:
        for start in range(0, len(tokens) - n_ctx + 1, n_ctx):
            window = tokens[start : start + n_ctx]
            kv.truncate(0)
            for off in range(0, n_ctx, n_batch):
                if cancel is not None and cancel.is_set():
                    raise BadRequestError("perplexity interrupted")
                n = min(n_batch, n_ctx - off)
                for i in range(n):
                    pos = off + i
                    batch.set(i, window[pos], pos, 0, first <= pos < n_ctx - 1)
                batch.n_tokens = n
                if lib.llama_decode(kv.ptr, batch.struct) != 0:
                    raise EngineError("llama_decode failed while scoring perplexity")
                scored_here = range(max(off, first), min(off + n, n_ctx - 1))
                if each is not None and scored_here:
                    rows = np.ctypeslib.as_array(
                        lib.llama_get_logits(kv.ptr), shape=(len(scored_here), n_vocab)
                    )
                    each(rows, [window[pos + 1] for pos in scored_here])
                for i in range(n):
                    pos = off + i
                    if not first <= pos < n_ctx - 1:
                        continue
                    ptr = lib.llama_get_logits_ith(kv.ptr, i)
                    logits = np.ctypeslib.as_array(ptr, shape=(n_vocab,)).astype(np.float64)
                    top = logits.max()
                    log_z = top + math.log(float(np.exp(logits - top).sum()))
                    nll += log_z - logits[window[pos + 1]]
                    scored += 1
    finally:
        batch.close()
        kv.truncate(0)
    return math.exp(nll / scored), scored
