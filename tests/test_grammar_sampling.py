"""A grammar sampled as llama.cpp's `common_sampler` does it: the chain samples first, the
grammar checks the chosen token alone, and masks the whole vocabulary only when it refuses it.

Greedy answers are the same tokens as with the grammar's sampler first in the chain (the old
way, rebuilt here as the reference), repeat penalty included (a refused first try must not be
learned by it); at a temperature the resampling draws again, so there only validity is checked.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from llmrun.runners.base import Finished, Request, SamplingParams
from llmrun.runners.errors import EngineError
from llmrun.runners.grammar import response_grammar, schema_grammar
from llmrun.runners.handles import GrammarSampler, Sampler
from llmrun.runners.llamacpp import LlamaCppRunner

from .conftest import HANG_S
from .test_run_grammar import CITY


def _benchmark(name: str) -> Any:
    """A script of benchmarks/ as a module (loaded by its path, as tests/test_gpu.py does)."""
    path = Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


ORDER: dict[str, Any] = _benchmark("grammar").ORDER  # the schema the benchmark times
GRAMMARS = {
    "city": schema_grammar(CITY, "schema"),
    "order": schema_grammar(ORDER, "schema"),
    "json_object": response_grammar({"type": "json_object"}) or "",
}
PROMPTS = {
    "city": "Name a European city and say whether it is a capital, as JSON.",
    "order": "Write a small hardware shop order as JSON.",
    "json_object": "Describe a cat as a JSON object.",
}


def grammar_first(runner: LlamaCppRunner, sp: SamplingParams, seed: int, prompt: list[int]) -> Any:
    """The old way: the grammar's sampler first in an outer chain, masking every candidate."""
    chain = runner.new_sampler(dataclasses.replace(sp, grammar=None), seed, prompt=prompt)
    lib = chain.lib
    outer = Sampler(lib)
    outer.add(lib.llama_sampler_init_grammar(runner.vocab(), (sp.grammar or "").encode(), b"root"))
    outer.add(chain.ptr)
    chain.ptr = None
    return outer


def answer(
    runner: LlamaCppRunner,
    name: str,
    sp: SamplingParams,
    make: Callable[[LlamaCppRunner, SamplingParams, int, list[int]], Any],
) -> tuple[list[int], Any]:
    """The answer's tokens, decoded one at a time with the chain `make` gives (and the chain)."""
    prompt = runner.request_tokens(Request.chat(PROMPTS[name]))
    runner.reset()
    runner.eval_tokens(prompt)
    chain = make(runner, sp, 7, prompt)
    out: list[int] = []
    try:
        for _ in range(sp.max_tokens):
            token = chain.sample(runner.kv.ptr)
            if runner.is_eog(token):
                break
            out.append(token)
            runner.eval_tokens([token])
    finally:
        chain.close()
    return out, chain


def checked(runner: LlamaCppRunner, sp: SamplingParams, seed: int, prompt: list[int]) -> Any:
    return runner.new_sampler(sp, seed, prompt=prompt)


@pytest.mark.parametrize(
    ("name", "penalty"), [("city", 1.0), ("city", 1.3), ("json_object", 1.3), ("order", 1.3)]
)
def test_greedy_answers_are_those_of_the_grammar_first_chain(
    runner: LlamaCppRunner, name: str, penalty: float
) -> None:
    sp = SamplingParams(
        max_tokens=48, temperature=0, repeat_penalty=penalty, grammar=GRAMMARS[name]
    )
    before, _ = answer(runner, name, sp, grammar_first)
    after, chain = answer(runner, name, sp, checked)
    assert after == before
    assert isinstance(chain, GrammarSampler)
    # the point: most tokens pass the one-token check, some are refused and sampled again
    assert 0 < chain.resampled < len(after)
    assert chain.perf()[1] == len(after) + (len(after) < sp.max_tokens)


@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_a_greedy_refusal_is_resampled_without_masking_the_whole_vocabulary(
    runner: LlamaCppRunner, penalty: float
) -> None:
    """The grammar checks the best candidates of a greedy chain after a refusal, in order, and
    masks the whole vocabulary (tens of milliseconds with a schema) only when it refuses all of
    them: fewer whole-vocabulary passes than refusals, the same tokens as grammar first."""
    sp = SamplingParams(
        max_tokens=64, temperature=0, repeat_penalty=penalty, grammar=GRAMMARS["order"]
    )
    before, _ = answer(runner, "order", sp, grammar_first)
    after, chain = answer(runner, "order", sp, checked)
    assert after == before
    assert chain.resampled > 1
    assert chain.masked_all < chain.resampled


@pytest.mark.parametrize(("name", "seed"), [("city", 1), ("order", 1)])
def test_sampled_answers_follow_the_schema(runner: LlamaCppRunner, name: str, seed: int) -> None:
    # the benchmark's order may hold 8 items and a note of 200 characters: room for them
    n = 160 if name == "city" else 600
    sp = SamplingParams(max_tokens=n, temperature=0.9, seed=seed, grammar=GRAMMARS[name])
    tokens, _ = answer(runner, name, sp, lambda r, s, _, p: r.new_sampler(s, seed, prompt=p))
    text = b"".join(runner.piece(t) for t in tokens).decode()
    value = json.loads(text)  # finished (the grammar ended it before max_tokens)
    schema = CITY if name == "city" else ORDER
    assert set(value) == set(schema["required"])
    if name == "order":
        assert value["status"] in schema["properties"]["status"]["enum"]
        assert 1 <= len(value["items"]) <= schema["properties"]["items"]["maxItems"]


def test_run_with_a_grammar_goes_through_the_checked_sampler(runner: LlamaCppRunner) -> None:
    """`run`'s generation: the same greedy answer as the grammar-first loop above."""
    sp = SamplingParams(max_tokens=16, temperature=0, grammar=GRAMMARS["city"])
    before, _ = answer(runner, "city", sp, grammar_first)
    runner.reset()
    done = [e for e in runner.stream(Request.chat(PROMPTS["city"], sampling=sp))]
    assert isinstance(done[-1], Finished)
    text = done[-1].text
    assert text == b"".join(runner.piece(t) for t in before).decode()


def test_a_grammar_that_allows_no_token_is_an_engine_error_not_an_abort(
    runner: LlamaCppRunner,
) -> None:
    """With every candidate masked (a grammar this vocabulary cannot continue) or nothing
    selected, accepting a token would throw through llama.cpp's C API (std::terminate): the
    sampler says so as an EngineError first, as llama.cpp's own sampler asserts."""
    sp = SamplingParams(temperature=0.0, max_tokens=4, grammar=GRAMMARS["city"])
    prompt = runner.request_tokens(Request.chat(PROMPTS["city"]))
    chain = runner.new_sampler(sp, 7, prompt=prompt)
    try:
        assert isinstance(chain, GrammarSampler)
        chain._view["logit"] = float("-inf")
        chain._all.selected = 0
        with pytest.raises(EngineError, match="allows no token"):
            chain._chosen()
        chain._all.selected = -1
        with pytest.raises(EngineError, match="allows no token"):
            chain._chosen()
    finally:
        chain.close()


@pytest.mark.slow
def test_the_benchmark_measures_both_tools_in_one_run(model_path: str) -> None:
    """benchmarks/grammar.py, briefly: llmrun's and llama-server's figures for every mode, and
    each grammar's ratio to unconstrained for both (what they are is the machine's business)."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "grammar.py"
    args = ["--model", model_path, "--rounds", "1", "--tokens", "12", "--threads", "1", "--json"]
    done = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=HANG_S
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    modes = {"unconstrained", "json_object", "json_schema"}
    assert set(out["runs"]) == set(out["llama_server"]["runs"]) == modes
    for name in ("json_object", "json_schema"):
        assert out["ratios"][name]["ms_per_token"] > 0
        assert out["llama_server"]["ratios"][name]["ms_per_token"] > 0
    (theirs,) = out["llama_server"]["runs"]["unconstrained"]
    assert theirs["tokens"] == 12  # ignore_eos: exactly n_predict


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_grammar_that_fails_frees_the_chain_at_every_temperature(
    temperature: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At a temperature above 0 the grammar step ran after the try that frees the sampler
    chain on a failure, so a grammar that failed there left the chain allocated."""
    from llmrun.runners import generation
    from llmrun.runners.base import SamplingParams

    chains: list[Any] = []

    def failing(chain: Any, model: Any, grammar: str | None) -> Any:
        chains.append(chain)
        raise RuntimeError("the grammar failed")

    monkeypatch.setattr(generation, "_with_grammar", failing)
    sp = SamplingParams(temperature=temperature, repeat_penalty=1.0)
    with pytest.raises(RuntimeError, match="the grammar failed"):
        generation.new_sampler(None, sp, 1, prompt=[], n_ctx=64)
    assert len(chains) == 1 and chains[0].ptr is None  # freed
