"""The seed's claim, on the real model: chunked prefill keeps the result of a one-shot prefill."""

from __future__ import annotations

import math
from pathlib import Path

from llmrun.runners.config import EngineConfig
from llmrun.runners.library import llama_lib
from llmrun.runners.llamacpp import LlamaCppRunner

ROOT = Path(__file__).resolve().parent.parent


def softmax(logits: list[float]) -> list[float]:
    top = max(logits)
    exps = [math.exp(x - top) for x in logits]
    total = sum(exps)
    return [e / total for e in exps]


def kl(p: list[float], q: list[float]) -> float:
    return sum(a * math.log(a / b) for a, b in zip(p, q, strict=True) if a > 0 and b > 0)


def last_logits(r: LlamaCppRunner) -> list[float]:
    """The next-token logits after the last evaluated position (llama.cpp's own buffer)."""
    ptr = llama_lib().llama_get_logits_ith(r.kv.ptr, -1)
    return list(ptr[: r.vocab_size()])


def forget_positions(r: LlamaCppRunner, p0: int, p1: int) -> bool:
    """Drop the KV entries of positions [p0, p1) while keeping later ones (the control)."""
    lib = llama_lib()
    return bool(lib.llama_memory_seq_rm(lib.llama_get_memory(r.kv.ptr), 0, p0, p1))


def logits_after(model_path: str, n_batch: int, tokens: list[int], forget: int = 0) -> list[float]:
    with LlamaCppRunner(model_path, EngineConfig(n_ctx=1024, n_batch=n_batch)) as r:
        if forget:
            r.eval_tokens(tokens[:-1])
            assert forget_positions(r, 0, forget)
            r.eval_tokens(tokens[-1:])
        else:
            r.eval_tokens(tokens)
        return last_logits(r)


def test_chunk_size_does_not_change_the_next_token(model_path: str) -> None:
    with LlamaCppRunner(model_path, EngineConfig(n_ctx=1024)) as r:
        text = (ROOT / "examples" / "long_prompt.txt").read_text()
        tokens = r.tokenize(text, add_special=True)[:300]
    one_shot = logits_after(model_path, 512, tokens)
    chunked = logits_after(model_path, 8, tokens)
    p, q = softmax(one_shot), softmax(chunked)
    assert one_shot.index(max(one_shot)) == chunked.index(max(chunked))
    assert kl(p, q) < 1e-3

    # Negative control: without the early positions' KV entries the distribution moves.
    forgotten = softmax(logits_after(model_path, 512, tokens, forget=200))
    assert kl(p, forgotten) > 100 * max(kl(p, q), 1e-6)
