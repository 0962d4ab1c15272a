"""Log probabilities in `llmrun serve`: chat's `logprobs`/`top_logprobs` and legacy completions'
`logprobs`, in OpenAI's shapes, whole and streamed, from the model's own logits (before any
sampler); and beside a real llama-server's from the same llama.cpp (`slow`: it builds one).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import httpx2 as httpx
import numpy as np
import pytest

from llmrun.runners.base import SamplingParams
from llmrun.runners.config import EngineConfig
from llmrun.runners.llamacpp import LlamaCppRunner
from llmrun.runners.serving.batching import Arrival, BatchedEngine
from llmrun.runners.serving.logprobs import described, legacy, token_logprob, token_text
from llmrun.runners.serving.policy import Policy

from .conftest import HANG_S
from .test_serve import Server, chat, llmrun_serve, serve_env, sse_events  # noqa: F401  (fixture)

CHAT = "/v1/chat/completions"
ASK = "Write one sentence about the sea."


# ---- the arithmetic (no model) ----------------------------------------------------------------


def test_the_log_softmax_and_the_top_tokens_match_a_plain_computation() -> None:
    rng = np.random.default_rng(7)
    row = (rng.standard_normal(50_000) * 4).astype(np.float32)
    lp = token_logprob(row, 123, 20)
    x = row.astype(np.float64)
    reference = x - (x.max() + math.log(np.exp(x - x.max()).sum()))
    assert lp.logprob == pytest.approx(reference[123], abs=1e-5)
    order = np.argsort(-reference)[:20]
    assert [t for t, _ in lp.top] == order.tolist()
    assert [p for _, p in lp.top] == pytest.approx(reference[order].tolist(), abs=1e-5)
    assert sum(math.exp(p) for _, p in lp.top) <= 1.0
    assert token_logprob(row, 5, 0).top == ()


def test_a_token_that_is_not_whole_utf8_is_written_as_openai_writes_it() -> None:
    assert token_text("é".encode()) == "é"
    assert token_text(b"\xe2\x80") == "bytes:\\xe2\\x80"


def test_legacy_offsets_count_the_answers_characters() -> None:
    pieces = {1: b"Hi", 2: b" th", 3: b"ere"}
    row = np.zeros(4, np.float32)
    tokens = tuple(described(token_logprob(row, t, 1), pieces.__getitem__) for t in (1, 2, 3))
    lp = legacy(tokens, 10)
    assert lp["tokens"] == ["Hi", " th", "ere"]
    assert lp["text_offset"] == [10, 12, 15]
    assert lp["token_logprobs"] == pytest.approx([math.log(0.25)] * 3)


def test_legacy_top_logprobs_always_hold_the_sampled_token() -> None:
    """OpenAI's legacy completions (and vLLM) always list the sampled token among a position's
    top_logprobs, beside the top `logprobs` ones: up to logprobs+1 entries."""
    pieces = {0: b"a", 1: b"b", 2: b"c", 3: b"d"}
    row = np.array([0.0, 1.0, 3.0, 2.0], np.float32)  # token 2 is the likeliest
    sampled = described(token_logprob(row, 0, 1), pieces.__getitem__)  # the least likely one
    lp = legacy((sampled,), 0)
    assert lp["tokens"] == ["a"]
    assert "a" in lp["top_logprobs"][0]  # the sampled token, beside the likeliest one
    assert "c" in lp["top_logprobs"][0]
    assert len(lp["top_logprobs"][0]) == 2
    top = described(token_logprob(row, 2, 2), pieces.__getitem__)  # among the top: no extra
    assert list(legacy((top,), 0)["top_logprobs"][0]) == ["c", "d"]


def test_a_character_split_over_two_tokens_moves_the_offsets_once() -> None:
    pieces = {1: b"a", 2: "é".encode()[:1], 3: "é".encode()[1:] + b"b", 4: b"c"}
    row = np.zeros(5, np.float32)
    tokens = tuple(described(token_logprob(row, t, 1), pieces.__getitem__) for t in (1, 2, 3, 4))
    assert legacy(tokens, 0)["text_offset"] == [0, 1, 1, 3]  # "aébc": c is the 4th character


# ---- on the engine ------------------------------------------------------------------------------


def engine_logprobs(
    model_path: str, n_batch: int, text: str, *, beside: bool
) -> tuple[tuple[int, ...], list[Any], list[Any]]:
    """The prompt's and the answer's log probabilities from a BatchedEngine prefilling in chunks
    of n_batch; `beside`: another sequence decodes in the same steps."""
    runner = LlamaCppRunner(model_path, EngineConfig(n_ctx=512, n_threads=1))
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    try:
        tokens = tuple(runner.tokenize(text, add_special=True))
        with BatchedEngine(
            runner, n_seq=2, n_ctx_per_seq=256, n_batch=n_batch, policy=Policy("chunked", n_batch)
        ) as engine:
            if beside:
                engine.submit(Arrival(engine.now(), tokens[:5], 64, True, sp))
                engine.step()
            asked = engine.submit(
                Arrival(engine.now(), tokens, 4, True, sp, logprobs=2, prompt_logprobs=True)
            )
            while not asked.done:
                engine.step()
            return tokens, asked.result.prompt_logprobs, asked.result.logprobs
    finally:
        runner.close()


def test_prompt_logprobs_are_the_same_in_one_chunk_or_many_beside_other_rows(
    model_path: str,
) -> None:
    """Each prompt position's row lands on the right token whether the prompt comes whole or
    in chunks, and with another sequence's decode rows in the same step."""
    text = "The sea is calm today, and the boats rest in the harbour while gulls circle above."
    tokens, whole, answer = engine_logprobs(model_path, 256, text, beside=False)
    assert len(tokens) > 16
    assert [lp.token for lp in whole] == list(tokens[1:])
    assert len(answer) == 4
    for n_batch, beside in ((8, False), (8, True)):
        _, chunked, again = engine_logprobs(model_path, n_batch, text, beside=beside)
        assert [lp.token for lp in chunked] == list(tokens[1:])
        assert [lp.logprob for lp in chunked] == pytest.approx(
            [lp.logprob for lp in whole], abs=0.02
        )
        assert [lp.token for lp in again] == [lp.token for lp in answer]


# ---- on a real `llmrun serve` ------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(serve_env: dict[str, str]) -> Iterator[Server]:  # noqa: F811
    with llmrun_serve(serve_env, "-np", "2", "--no-dashboard") as s:
        yield s


def check_content(content: list[dict[str, Any]], top: int) -> None:
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["logprob"] <= 0
        assert len(entry["top_logprobs"]) == top
        assert sum(math.exp(t["logprob"]) for t in entry["top_logprobs"]) <= 1 + 1e-6
        ranked = [t["logprob"] for t in entry["top_logprobs"]]
        assert ranked == sorted(ranked, reverse=True)
        if not entry["token"].startswith("bytes:"):
            assert bytes(entry["bytes"]) == entry["token"].encode()


def test_chat_gives_each_tokens_logprob_and_the_likeliest_ones(server: Server) -> None:
    body = chat(ASK, max_tokens=8, temperature=0, logprobs=True, top_logprobs=5)
    answer = server.post(CHAT, body).json()
    choice = answer["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == answer["usage"]["completion_tokens"] == 8
    check_content(content, 5)
    # greedy: every token is the likeliest, with its own log probability
    for entry in content:
        assert entry["token"] == entry["top_logprobs"][0]["token"]
        assert entry["logprob"] == entry["top_logprobs"][0]["logprob"]
    assert "".join(e["token"] for e in content) == choice["message"]["content"]


def test_a_stream_carries_the_same_logprobs_with_its_tokens(server: Server) -> None:
    body = chat(ASK, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    whole = server.post(CHAT, body).json()["choices"][0]["logprobs"]["content"]
    with httpx.stream(
        "POST", server.url + CHAT, json={**body, "stream": True}, timeout=HANG_S
    ) as r:
        events = [e for e in sse_events(r) if e != "[DONE]"]
    streamed = []
    for e in events:
        choice = e["choices"][0]
        if choice["delta"].get("content"):
            assert choice["logprobs"] is not None
            streamed += choice["logprobs"]["content"]
    assert [e["token"] for e in streamed] == [e["token"] for e in whole]
    assert [e["logprob"] for e in streamed] == pytest.approx(
        [e["logprob"] for e in whole], abs=1e-3
    )


def test_sampled_tokens_get_the_models_own_logprob(server: Server) -> None:
    """Sampled at a high temperature, a token is often not the likeliest: its logprob is its
    own, from the raw logits (below the top one's), not the sampler's."""
    body = chat(ASK, max_tokens=16, temperature=1.5, seed=3, logprobs=True, top_logprobs=1)
    content = server.post(CHAT, body).json()["choices"][0]["logprobs"]["content"]
    check_content(content, 1)
    assert all(e["logprob"] <= e["top_logprobs"][0]["logprob"] for e in content)


def test_no_logprobs_unless_asked(server: Server) -> None:
    answer = server.post(CHAT, chat(ASK, max_tokens=2, logprobs=False)).json()
    assert answer["choices"][0]["logprobs"] is None


def test_legacy_completions_give_openais_legacy_shape(server: Server) -> None:
    body = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
    choice = server.post("/v1/completions", {**body, "logprobs": 3}).json()["choices"][0]
    lp = choice["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 6
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    for chosen, top in zip(lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert len(top) <= 3 and chosen == max(top.values())
        assert sum(math.exp(p) for p in top.values()) <= 1 + 1e-6
    with httpx.stream(
        "POST", server.url + "/v1/completions", json={**body, "logprobs": 3, "stream": True}
    ) as r:
        events = [e for e in sse_events(r) if e != "[DONE]"]
    offsets = [
        o
        for e in events
        if e["choices"] and e["choices"][0]["logprobs"]
        for o in e["choices"][0]["logprobs"]["text_offset"]
    ]
    assert offsets == lp["text_offset"]


def test_echo_gives_the_prompt_first_and_its_tokens_logprobs(server: Server) -> None:
    """lm-evaluation-harness's loglikelihood request (echo, logprobs 1, one token): every
    prompt token but the first gets the log probability the model gave it after the ones
    before; the same tokens generated greedily got the same ones."""
    prompt = "The capital of France is"
    base = {"max_tokens": 6, "temperature": 0, "logprobs": 1}
    made = server.post("/v1/completions", {**base, "prompt": prompt}).json()["choices"][0]
    plain = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 2, "echo": True})
    assert plain.json()["choices"][0]["text"].startswith(prompt)
    whole = prompt + made["text"]
    body = {**base, "prompt": whole, "max_tokens": 1, "echo": True}
    choice = server.post("/v1/completions", body).json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"].startswith(whole)
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    n = len(made["logprobs"]["tokens"])
    assert lp["tokens"][-1 - n : -1] == made["logprobs"]["tokens"]
    assert lp["token_logprobs"][-1 - n : -1] == pytest.approx(
        made["logprobs"]["token_logprobs"], abs=0.02
    )
    assert all(p <= 0 for p in lp["token_logprobs"][1:])
    assert lp["text_offset"][-1] == len(whole)
    with httpx.stream(
        "POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=HANG_S
    ) as r:
        events = [e for e in sse_events(r) if e != "[DONE]"]
    chunks = [e["choices"][0] for e in events if e["choices"]]
    assert "".join(c["text"] for c in chunks) == choice["text"]
    streamed = [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]]
    assert streamed == lp["tokens"]


def test_one_token_array_in_a_list_is_one_prompt_as_lm_eval_sends_it(server: Server) -> None:
    """lm-evaluation-harness's local-completions sends token ids as a batch (OpenAI's array of
    token arrays), so one prompt is [[ids]]: served as the bare [ids] is."""
    body = {"prompt": [[504, 3575, 282]], "max_tokens": 1, "temperature": 0}
    r = server.post("/v1/completions", {**body, "logprobs": 1, "echo": True})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["logprobs"]["tokens"]) == 4  # 3 of the prompt, 1 answer
    nested = server.post("/v1/completions", body).json()["choices"][0]
    flat = server.post("/v1/completions", {**body, "prompt": [504, 3575, 282]}).json()
    assert nested["index"] == 0 and nested["text"] == flat["choices"][0]["text"]
    two = server.post("/v1/completions", {**body, "prompt": [[504], [3575]]})
    assert two.status_code == 400
    assert "prompt: one prompt per request is served, not a list of 2" in two.text


@pytest.mark.parametrize(
    ("path", "extra", "words"),
    [
        (CHAT, {"logprobs": 3}, "logprobs: true or false in chat"),
        (CHAT, {"logprobs": True, "top_logprobs": 21}, "top_logprobs: 21 is not between 0 and 20"),
        (CHAT, {"top_logprobs": 2}, "top_logprobs: needs logprobs: true"),
        ("/v1/completions", {"logprobs": 6}, "logprobs: a count of the likeliest tokens"),
    ],
)
def test_out_of_range_requests_get_400(
    server: Server, path: str, extra: dict[str, Any], words: str
) -> None:
    base = chat(ASK) if path == CHAT else {"prompt": ASK}
    r = server.post(path, {**base, "max_tokens": 2, **extra})
    assert r.status_code == 400
    assert words in r.json()["error"]["message"]


# ---- beside llama.cpp's own llama-server -------------------------------------------------------


@pytest.mark.slow
def test_the_chosen_tokens_logprob_matches_llama_servers(
    serve_env: dict[str, str],  # noqa: F811
    model_path: str,
) -> None:
    """Greedy, the same prompt: the same tokens, each with llama-server's log probability
    (its default: the model's probabilities before the samplers) within rounding."""
    from .llama_tools import llama_cpp_server
    from .test_serve_timings import ONE_SLOT

    body = chat(ASK, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)

    def content(url: str) -> list[dict[str, Any]]:
        answer = httpx.post(url + CHAT, json=body, timeout=HANG_S).json()
        entries: list[dict[str, Any]] = answer["choices"][0]["logprobs"]["content"]
        return entries

    with llama_cpp_server(model_path, *ONE_SLOT, ready_s=HANG_S) as url:
        theirs = content(url)
    with llmrun_serve(serve_env, "-np", "1", "--no-dashboard") as s:
        ours = content(s.url)
    assert [e["token"] for e in ours] == [e["token"] for e in theirs]
    for mine, real in zip(ours, theirs, strict=True):
        assert mine["logprob"] == pytest.approx(real["logprob"], abs=2e-3)
        assert [t["token"] for t in mine["top_logprobs"]] == [
            t["token"] for t in real["top_logprobs"]
        ]
