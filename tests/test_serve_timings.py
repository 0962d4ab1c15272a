"""llama-server's `timings` fields in `llmrun serve`'s answers, with llama-server's meanings
(llama.cpp's tools/server, `server_slot_stats`): the field set, how the counts add up, what a
reused prefix changes, and the per-token figures and rates, on answers streamed and whole; and
the field set beside a real llama-server's answer from the same llama.cpp (`slow`: it builds
llama-server on first use).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest

from llmrun.runners.serving.api_engine import RequestTimings

from .conftest import HANG_S
from .llama_tools import llama_cpp_server
from .test_serve import Server, chat, llmrun_serve, serve_env, sse_events  # noqa: F401  (fixture)

# llama-server as these comparisons start it: one slot of 512 tokens, one thread
ONE_SLOT = ("-c", "512", "-np", "1", "-t", "1")

# llama-server's fields, in its order; draft_n and draft_n_accepted only when speculating.
LLAMA_SERVER_FIELDS = (
    "cache_n",
    "prompt_n",
    "prompt_ms",
    "prompt_per_token_ms",
    "prompt_per_second",
    "predicted_n",
    "predicted_ms",
    "predicted_per_token_ms",
    "predicted_per_second",
)
DRAFT_FIELDS = ("draft_n", "draft_n_accepted")
# Each figure is rounded on the wire (ms to the µs, rates to 0.01): the relations hold within.
REL = 1e-3


def timings(**kw: Any) -> RequestTimings:
    fields: dict[str, Any] = dict(
        prompt_tokens=40,
        reused_tokens=8,
        output_tokens=5,
        template_tokenize_ms=1.0,
        queue_ms=2.0,
        prefill_ms=64.0,
        prefill_chunks=((16, 32.0), (16, 32.0)),
        ttft_ms=67.0,
        decode_ms=40.0,
        itl_ms=(10.0, 10.0, 10.0, 10.0),
        finish_reason="length",
    )
    return RequestTimings(**{**fields, **kw})


def check_meanings(t: dict[str, Any], prompt_tokens: int) -> None:
    """llama-server's relations between its fields, on one `timings` object."""
    assert set(LLAMA_SERVER_FIELDS) <= set(t)
    assert t["prompt_n"] + t["cache_n"] == prompt_tokens
    assert t["prompt_n"] >= 1  # at least the prompt's last token is evaluated (its logits)
    assert t["prompt_ms"] > 0 and t["predicted_ms"] > 0
    assert t["prompt_per_token_ms"] == pytest.approx(t["prompt_ms"] / t["prompt_n"], rel=REL)
    assert t["prompt_per_second"] == pytest.approx(t["prompt_n"] / t["prompt_ms"] * 1000, rel=REL)
    steps = t["predicted_n"] - 1  # the first token comes with the prompt's last step
    assert steps >= 1
    assert t["predicted_per_token_ms"] == pytest.approx(t["predicted_ms"] / steps, rel=REL)
    assert t["predicted_per_second"] == pytest.approx(steps / t["predicted_ms"] * 1000, rel=REL)


# ---- the figures from RequestTimings (no model) ------------------------------------------------


def test_llama_server_fields_follow_llmruns_own_figures() -> None:
    t = timings().to_dict()
    assert t["prefill_ms"] == 64.0 and t["decode_tps"] == 100.0  # llmrun's own, unchanged
    check_meanings(t, 40)
    assert tuple(k for k in t if k in LLAMA_SERVER_FIELDS) == LLAMA_SERVER_FIELDS  # its order
    assert (t["cache_n"], t["prompt_n"], t["prompt_ms"]) == (8, 32, 64.0)
    assert (t["prompt_per_token_ms"], t["prompt_per_second"]) == (2.0, 500.0)
    assert (t["predicted_n"], t["predicted_ms"]) == (5, 40.0)
    assert (t["predicted_per_token_ms"], t["predicted_per_second"]) == (10.0, 100.0)
    assert not set(DRAFT_FIELDS) & set(t)  # no draft model: absent, as llama-server has them
    assert json.loads(json.dumps(t)) == t


def test_the_end_of_generation_token_is_counted_and_timed_as_llama_server_does() -> None:
    t = timings(finish_reason="stop", end_token_ms=10.0).to_dict()
    assert t["output_tokens"] == 5 and t["decode_ms"] == 40.0  # llmrun's: the output only
    assert (t["predicted_n"], t["predicted_ms"]) == (6, 50.0)
    assert t["predicted_per_second"] == 100.0
    # The end token first: one token sampled, no decode step, llama-server's 1 µs floor.
    first = timings(output_tokens=0, decode_ms=0.0, itl_ms=(), end_token_ms=0.0).to_dict()
    assert (first["predicted_n"], first["predicted_ms"]) == (1, 0.001)
    assert first["predicted_per_token_ms"] == first["predicted_per_second"] == 0.0
    one = timings(output_tokens=1, decode_ms=0.0, itl_ms=()).to_dict()
    assert (one["predicted_n"], one["predicted_ms"], one["predicted_per_second"]) == (1, 0.001, 0)


def test_nothing_done_is_zero_not_a_division_by_zero() -> None:
    t = timings(
        output_tokens=0, prefill_ms=0.0, prefill_chunks=(), decode_ms=0.0, itl_ms=(), ttft_ms=None
    ).to_dict()
    assert t["predicted_n"] == 0 and t["predicted_ms"] == 0.0
    assert t["prompt_per_second"] == t["predicted_per_second"] == 0.0


def test_draft_counts_appear_when_a_draft_model_proposed_tokens() -> None:
    t = timings(draft_tokens=12, draft_accepted=9).to_dict()
    assert tuple(t)[-2:] == DRAFT_FIELDS and (t["draft_n"], t["draft_n_accepted"]) == (12, 9)


# ---- on a real `llmrun serve` ------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(serve_env: dict[str, str]) -> Iterator[Server]:  # noqa: F811
    with llmrun_serve(serve_env, "-np", "1", "--no-dashboard") as s:
        yield s


def test_whole_answers_carry_llama_servers_fields_and_a_reused_prefix_drops_prompt_n(
    server: Server,
) -> None:
    body = chat("Write one sentence about the sea.", max_tokens=8, temperature=0)
    first = server.post("/v1/chat/completions", body).json()
    second = server.post("/v1/chat/completions", body).json()
    for answer in (first, second):
        t, usage = answer["timings"], answer["usage"]
        check_meanings(t, usage["prompt_tokens"])
        assert t["cache_n"] == usage["prompt_tokens_details"]["cached_tokens"]
        assert (t["prompt_n"], t["prompt_ms"]) == (t["prefill_tokens"], t["prefill_ms"])
        # ended by max_tokens: every sampled token is in the output
        assert answer["choices"][0]["finish_reason"] == "length"
        assert t["predicted_n"] == usage["completion_tokens"] == 8
        assert t["predicted_ms"] == pytest.approx(t["decode_ms"], abs=0.002)
    # the same prompt again: all but its last token come from the sequence's cache
    assert second["timings"]["prompt_n"] == 1 < first["timings"]["prompt_n"]
    assert second["timings"]["cache_n"] == second["usage"]["prompt_tokens"] - 1


def test_a_stream_carries_them_in_the_last_chunk_and_the_usage_chunk(server: Server) -> None:
    body = {
        "prompt": "The capital of France is",
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=HANG_S) as r:
        assert r.status_code == 200
        events = sse_events(r)
    usage_chunk, final = events[-2], events[-3]
    assert final["timings"] == usage_chunk["timings"]
    t = final["timings"]
    check_meanings(t, usage_chunk["usage"]["prompt_tokens"])
    assert t["predicted_n"] == usage_chunk["usage"]["completion_tokens"] == 6


def test_an_answer_ended_by_the_end_of_generation_token_counts_it(server: Server) -> None:
    """llama-server counts the end-of-generation token in predicted_n and times its step in
    predicted_ms; so does usage.completion_tokens (OpenAI's definition); llmrun's
    output_tokens and decode_ms leave it out (the text's tokens and their gaps)."""
    body = chat("What is 2+2?", max_tokens=128, temperature=0)  # 11 tokens, then the end
    answer = server.post("/v1/chat/completions", body).json()
    t = answer["timings"]
    assert answer["choices"][0]["finish_reason"] == "stop", answer
    check_meanings(t, answer["usage"]["prompt_tokens"])
    assert t["predicted_n"] == t["output_tokens"] + 1 == answer["usage"]["completion_tokens"]
    assert answer["usage"]["total_tokens"] == t["prompt_tokens"] + t["predicted_n"]
    assert t["predicted_ms"] > t["decode_ms"]


# ---- beside llama.cpp's own llama-server -------------------------------------------------------


def answers(url: str) -> list[dict[str, Any]]:
    """The `timings` and `usage` of a whole answer, a second one with the same prompt (its
    prefix cached), and a stream's, from the server at `url`."""
    body = chat("Write one sentence about the sea.", max_tokens=8, temperature=0)
    whole = [httpx.post(url + "/v1/chat/completions", json=body, timeout=HANG_S).json()]
    whole.append(httpx.post(url + "/v1/chat/completions", json=body, timeout=HANG_S).json())
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/chat/completions", json=streamed, timeout=HANG_S) as r:
        events = [e for e in sse_events(r) if e != "[DONE]"]
    last = next(e for e in reversed(events) if "timings" in e)
    usage = next(e["usage"] for e in reversed(events) if e.get("usage"))
    return [{"timings": a["timings"], "usage": a["usage"]} for a in whole] + [
        {"timings": last["timings"], "usage": usage}
    ]


@pytest.mark.slow
def test_the_fields_and_meanings_match_a_real_llama_server(
    serve_env: dict[str, str],  # noqa: F811
    model_path: str,
) -> None:
    with llama_cpp_server(model_path, *ONE_SLOT, ready_s=HANG_S) as url:
        theirs = answers(url)
    with llmrun_serve(serve_env, "-np", "1", "--no-dashboard") as s:
        ours = answers(s.url)
    for mine, real in zip(ours, theirs, strict=True):
        fields = set(real["timings"])
        assert fields == set(LLAMA_SERVER_FIELDS)  # no draft model: no draft counts
        assert fields <= set(mine["timings"])
        for answer in (mine, real):
            t = answer["timings"]
            check_meanings(t, answer["usage"]["prompt_tokens"])
            assert t["predicted_n"] == answer["usage"]["completion_tokens"] == 8
    # the same prompt again: both evaluate only its last token
    for answer in (ours[1], theirs[1]):
        assert answer["timings"]["prompt_n"] == 1
        assert answer["timings"]["cache_n"] == answer["usage"]["prompt_tokens"] - 1


def test_the_llama_server_fields_are_the_sources_own(llama_cpp_source: Path) -> None:
    """The field names above are the ones llama.cpp's server writes (server_slot_stats)."""
    text = "".join(p.read_text() for p in (llama_cpp_source / "tools" / "server").glob("*.cpp"))
    for name in (*LLAMA_SERVER_FIELDS, *DRAFT_FIELDS):
        assert f'"{name}"' in text, name


def test_docs_name_every_field_with_its_anchor() -> None:
    docs = (Path(__file__).resolve().parent.parent / "docs" / "serving.md").read_text()
    rows = [line for line in docs.splitlines() if line.startswith("| `")]
    for name in (*LLAMA_SERVER_FIELDS, *DRAFT_FIELDS):
        row = next((r for r in rows if f"`{name}`" in r.split(" | ")[0]), None)
        assert row is not None and row.count(" | ") == 2, name  # meaning, llama-server's anchor
