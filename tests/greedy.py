"""Greedy outputs compared up to kernel rounding (llama.cpp's batch and single-token CPU
kernels give logits up to about 0.9 apart, so a near-tie of the top two tokens may flip)."""

from __future__ import annotations

import numpy as np

from llmrun.runners.library import llama_lib
from llmrun.runners.llamacpp import LlamaCppRunner

NEAR_TIE = 0.5


def margin_at_divergence(
    runner: LlamaCppRunner, prompt: list[int], a: list[int], b: list[int]
) -> float:
    """Where two greedy outputs first differ: how far apart the two chosen tokens' logits are
    when the common prefix is decoded a token at a time. 0.0 when they never differ."""
    k = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if k is None:
        return 0.0
    lib = llama_lib()
    runner.reset()
    runner.eval_tokens(prompt)
    for t in a[:k]:
        runner.eval_tokens([t])
    assert runner._model is not None
    logits = np.ctypeslib.as_array(
        lib.llama_get_logits_ith(runner.kv.ptr, -1), shape=(runner._model.n_vocab,)
    )
    margin = abs(float(logits[a[k]] - logits[b[k]]))
    runner.reset()
    return margin
