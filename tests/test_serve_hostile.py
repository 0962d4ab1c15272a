"""`llmrun serve` against hostile HTTP: every request as a careless or malicious client might send
it, by OpenAI's request bodies and HTTP/1.1. Each gets its own status and an error in OpenAI's
shape (never a 500, a hang or a crash), and the server keeps answering everyone else.

One real server on 127.0.0.1 for the module; waits are bounded and driven by what the server
sends (its answers, /health, /metrics), never by sleeping a fixed time.
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx2 as httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from llmrun.cli.serve import DEFAULT_MAX_CONNECTIONS
from llmrun.runners.serving.api_http import MIN_BODY_LIMIT, validation_message
from llmrun.runners.serving.api_models import MAX_STOP_CHARS, MAX_STOPS, ChatBody, CompletionBody
from llmrun.runners.serving.uvicorn_patch import HEADERS_TIMEOUT_S

from .conftest import HANG_S
from .inject.sitecustomize import SERVE_TIMEOUT_ENV
from .test_serve import Server, chat, llmrun_serve, serve_env  # noqa: F401  (fixture)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
WAIT_S = 4 * HEADERS_TIMEOUT_S  # generous: the server's own deadlines are what end these waits
SHORT_DEADLINE_S = 2.0  # the deadlines of a server whose test waits for them to fire


@pytest.fixture(scope="module")
def server(serve_env: dict[str, str]) -> Iterator[Server]:  # noqa: F811
    with llmrun_serve(serve_env, "-np", "2", "--no-dashboard") as s:
        yield s


def connect(server: Server, timeout_s: float = WAIT_S) -> socket.socket:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=timeout_s)


def exchange(
    server: Server, data: bytes, *, half_close: bool = False
) -> tuple[int, dict[str, str], bytes]:
    """Send raw bytes, read until the server closes; the status, headers and body."""
    with connect(server) as sock:
        sock.sendall(data)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict((k.lower(), v.strip()) for k, _, v in (h.partition(":") for h in lines[1:]))
    return int(lines[0].split()[1]), headers, body


def post_raw(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return (
        b"POST " + path.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n"
        + extra
        + b"\r\n"
        + body
    )


def send(server: Server, path: str, payload: bytes | dict[str, Any]) -> httpx.Response:
    content = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return httpx.post(
        server.url + path,
        content=content,
        timeout=WAIT_S,
        headers={"Content-Type": "application/json"},
    )


def openai_error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert error["code"] == status and "type" in error and "param" in error
    return dict(error)


def still_serving(server: Server) -> None:
    r = send(server, CHAT, chat("Hi", max_tokens=2))
    assert r.status_code == 200, r.text
    assert server.get("/health")["status"] == "ok"


def small(**kw: Any) -> dict[str, Any]:
    return chat("Hi", **{"max_tokens": 2, **kw})


@pytest.mark.parametrize(
    ("payload", "words"),
    [
        (b"[]", "the body must be a JSON object, not an array"),
        (b"5", "the body must be a JSON object, not a number"),
        (b"null", "the body must be a JSON object, not null"),
        (b'"hi"', "the body must be a JSON object, not a string"),
        (b"", "malformed JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "malformed JSON"),
        (b'{"messages":[{"role":"user","content":"\xff\xfe"}]}', "malformed JSON"),
        (
            b'{"messages":[{"role":"user","content":"Hi \\ud800 there"}]}',
            "(an escape from \\ud800 to \\udfff is half of a UTF-16 surrogate pair: alone, it is",
        ),
        (b'{"messages":[{"role":"user","content":"\\udc00"}]}', "surrogate pair: alone"),
        (json.dumps(small()).encode() + b"garbage", "malformed JSON"),
        (
            b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":' + b"9" * 5000 + b"}",
            # valid JSON (RFC 8259 sets no limit): it was "malformed JSON: number out of range"
            "the body holds a number of more than 4,300 digits, past what llmrun reads (at line 1",
        ),
        (
            b'{"messages":[{"role":"user","content":"hi"}],"x":-1' + b"0" * 5000 + b".5}",
            "the body holds a number of more than 4,300 digits",
        ),
    ],
)
def test_bodies_that_are_not_a_json_object_get_400(
    server: Server, payload: bytes, words: str
) -> None:
    for path in (CHAT, COMPLETIONS):
        assert words in openai_error(send(server, path, payload), 400)["message"]


def test_a_bom_and_duplicate_keys_are_read_as_json_parsers_read_them(server: Server) -> None:
    bom = b"\xef\xbb\xbf" + json.dumps(small()).encode()
    assert send(server, CHAT, bom).status_code == 200
    last_wins = b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":2,"max_tokens":0}'
    assert (
        "max_tokens 0 is out of range"
        in openai_error(send(server, CHAT, last_wins), 400)["message"]
    )


@pytest.mark.parametrize(
    ("path", "payload", "words", "param"),
    [
        (CHAT, small(max_tokens=0), "max_tokens 0 is out of range", "max_tokens"),
        (CHAT, small(max_tokens=-1), "max_tokens -1 is out of range", "max_tokens"),
        (CHAT, small(max_tokens=10**30), "out of range", "max_tokens"),
        (CHAT, small(max_tokens=2.5), "max_tokens: Input should be a valid integer", "max_tokens"),
        (CHAT, small(max_tokens=True), "max_tokens: Input should be a valid integer", "max_tokens"),
        (CHAT, small(max_tokens="5"), "max_tokens: Input should be a valid integer", "max_tokens"),
        (CHAT, small(temperature=-1), "temperature -1.0 is out of range", "temperature"),
        (CHAT, small(top_p=1.5), "top_p 1.5 is out of range", "top_p"),
        (CHAT, small(seed=-5), "seed -5 is out of range", "seed"),
        (CHAT, small(seed=2**64), "out of range", "seed"),
        (CHAT, small(n=2), "n: only one choice per request", None),
        (CHAT, small(stream="yes"), "stream: Input should be a valid boolean", "stream"),
        (
            CHAT,
            small(stream_options="yes"),
            "stream_options: Input should be an object",
            "stream_options",
        ),
        (
            CHAT,
            small(stream_options={"include_usage": 1}, stream=True),
            "stream_options.include_usage",
            "stream_options.include_usage",
        ),
        (
            CHAT,
            small(stream_options={"include_obfuscation": "no"}, stream=True),
            "stream_options.include_obfuscation: Input should be a valid boolean",
            "stream_options.include_obfuscation",
        ),
        (
            CHAT,
            small(stream_options={"include_obfuscation": True}, stream=True),
            "stream_options.include_obfuscation: true is not served here (only false)",
            "stream_options.include_obfuscation",
        ),
        (CHAT, small(stop=""), "stop must be a string or a list of non-empty strings", None),
        (
            CHAT,
            small(stop=[1]),
            "stop: must be a string or an array of strings, not an array holding a number",
            "stop",
        ),
        (
            CHAT,
            {"messages": [{"role": "user", "content": 5}]},
            "messages.0.content: must be a string or an array of objects, not a number",
            "messages.0.content",
        ),
        (
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
            "messages.0.content.0.text: must be a string, not a number",
            "messages.0.content.0.text",
        ),
        (CHAT, {"messages": "hi"}, "messages: Input should be a valid array", "messages"),
        (
            CHAT,
            {"messages": [{"content": "hi"}]},
            "messages.0.role: Field required",
            "messages.0.role",
        ),
        (
            COMPLETIONS,
            {"prompt": [["a"]]},
            "prompt: must be a string or an array of arrays of whole numbers or an array of strings or an array of whole numbers, not an array holding an array",
            "prompt",
        ),
        (
            COMPLETIONS,
            {"prompt": 5},
            "prompt: must be a string or an array of arrays of whole numbers or an array of strings or an array of whole numbers, not a number",
            "prompt",
        ),
        (COMPLETIONS, {"prompt": [-1]}, "token -1 is not in the vocabulary", None),
    ],
)
def test_wrong_types_and_values_name_their_field(
    server: Server, path: str, payload: dict[str, Any], words: str, param: str | None
) -> None:
    error = openai_error(send(server, path, payload), 400)
    assert words in error["message"]
    assert error["param"] == param


@pytest.mark.parametrize(
    ("prompt", "held"),
    [
        ([[1, "a"]], "an array holding an array holding a number and a string"),
        ([[True]], "an array holding an array holding a boolean"),
        ([[None]], "an array holding an array holding null"),
        ([[[1]]], "an array holding an array holding an array holding a number"),
        (["a", [1]], "an array holding a string and an array holding a number"),
    ],
)
def test_a_wrong_prompt_array_says_what_its_arrays_held(prompt: Any, held: str) -> None:
    """[[1, "a"]] is refused for the string inside, not for being an array of arrays (which
    is served): the message names what the inner arrays held."""
    with pytest.raises(ValidationError) as e:
        CompletionBody.model_validate_json(json.dumps({"prompt": prompt}))
    message, param = validation_message(e.value)
    assert message.endswith(f", not {held}") and param == "prompt"


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (
            [{"type": "text", "text": 5}],
            "messages.0.content.0.text: must be a string, not a number",
        ),
        ([{"type": 5}], "messages.0.content.0.type: must be a string, not a number"),
        ([{"type": "text", "text": [1]}], "messages.0.content.0.text: must be a string, not an"),
        (
            [{"type": "text", "text": "a"}, {"text": "b"}],
            "messages.0.content.1.type: Field required",
        ),
        ([{"type": "text", "text": "a"}, 5], "messages.0.content: must be a string or an array"),
        (5, "messages.0.content: must be a string or an array of objects, not a number"),
    ],
)
def test_a_wrong_content_part_names_the_field_inside_it(content: Any, said: str) -> None:
    """An array of objects is the content's array branch: a part whose field has the wrong type
    is named by that field, not refused as if it were no array of objects."""
    with pytest.raises(ValidationError) as e:
        ChatBody.model_validate_json(
            json.dumps({"messages": [{"role": "user", "content": content}]})
        )
    message, param = validation_message(e.value)
    assert message.startswith(said) and message.startswith(f"{param}: ")


def test_null_means_the_default_as_in_openais_schema(server: Server) -> None:
    body = small(
        stream=None,
        n=None,
        stream_options=None,
        logprobs=None,
        seed=None,
        stop=None,
        ignore_eos=None,
        temperature=None,
        model=None,
    )
    assert send(server, CHAT, body).status_code == 200
    # OpenAI's other stream option, at the value served (no event padded); null: the default
    options = {"include_usage": None, "include_obfuscation": False}
    streamed = send(server, CHAT, small(stream=True, stream_options=options))
    assert streamed.status_code == 200 and '"usage"' not in streamed.text, streamed.text
    assert "obfuscation" not in streamed.text
    # LangChain's advice, model_kwargs={"stream_options": {"include_usage": True}}, sends it
    # on calls that do not stream too: served, as llama-server serves it (OpenAI and vLLM
    # refuse it), the usage in the answer as always; its keys are checked all the same
    for payload in (small(stream_options={"include_usage": True}), small(stream_options={})):
        answer = send(server, CHAT, payload)
        assert answer.status_code == 200 and answer.json()["usage"]["total_tokens"] > 0
    unknown = send(server, CHAT, small(stream=False, stream_options={"x": 1}))
    assert openai_error(unknown, 400)["param"] == "stream_options.x"


@pytest.mark.parametrize(
    ("payload", "words"),
    [
        (small(logprobs=True, top_logprobs=21), "top_logprobs: 21 is not between 0 and 20"),
        (small(top_logprobs=3), "top_logprobs: needs logprobs: true"),
        (small(tool_choice="required"), "tool_choice: 'required' needs tools"),
        (small(function_call={"name": "f"}), "function_call"),
        (small(tools=[{"type": "retrieval"}]), 'only tools of type "function"'),
        (small(modalities=["text", "audio"]), "modalities"),
        (small(audio={"voice": "alloy", "format": "wav"}), "audio: audio output"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image_url",
                                "image_url": {"url": "data:image/png;base64,AA=="},
                            }
                        ],
                    }
                ]
            },
            "messages.0.content.0: content of type 'image_url' is not served here",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "messages.0.content.0: a text part needs its text",
        ),
        (
            {"messages": [{"role": "wizard", "content": "hi"}]},
            "messages.0.role: 'wizard' is not one of system, developer, user, assistant",
        ),
        (
            {"messages": [{"role": "tool", "content": "42"}]},
            "messages.0.tool_call_id: the id of the call this answers",
        ),
        (small(reasoning_effort="high"), "reasoning_effort: a reasoning effort is not served"),
        (small(stop=["x"] * (MAX_STOPS + 1)), f"at most {MAX_STOPS} strings"),
        (small(stop="x" * (MAX_STOP_CHARS + 1)), f"of at most {MAX_STOP_CHARS} characters"),
    ],
)
def test_what_is_not_served_is_refused_never_ignored(
    server: Server, payload: dict[str, Any], words: str
) -> None:
    assert words in openai_error(send(server, CHAT, payload), 400)["message"]


@pytest.mark.parametrize(
    ("path", "payload"),
    [
        (
            CHAT,
            small(
                tools=[],
                tool_choice="none",
                parallel_tool_calls=True,
                logprobs=False,
                top_logprobs=0,
                modalities=["text"],
                response_format={"type": "text"},
                logit_bias={},
                user="u",
                store=False,
                metadata={"k": "v"},
                service_tier="auto",
                prompt_cache_key="k",
                safety_identifier="s",
            ),
        ),
        (
            CHAT,
            {
                "messages": [
                    {"role": "developer", "content": "Be brief."},
                    {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                ],
                "max_tokens": 2,
            },
        ),
        (
            COMPLETIONS,
            {"prompt": "Hi", "max_tokens": 2, "echo": False, "best_of": 1, "logprobs": 0},
        ),
    ],
)
def test_neutral_values_of_fields_llmrun_lacks_are_accepted(
    server: Server, path: str, payload: dict[str, Any]
) -> None:
    assert send(server, path, payload).status_code == 200


@pytest.mark.parametrize(
    ("path", "payload", "words"),
    [
        (CHAT, small(max_token=5), "Unrecognized request argument supplied: max_token"),
        (CHAT, small(foo=1, bar=None), "Unrecognized request arguments supplied: bar, foo"),
        (CHAT, small(prompt="Hi"), "Unrecognized request argument supplied: prompt"),
        (
            COMPLETIONS,
            {"prompt": "Hi", "max_tokens": 2, "messages": []},
            "Unrecognized request argument supplied: messages",
        ),
        (
            COMPLETIONS,
            {"prompt": "Hi", "max_completion_tokens": 2},
            "Unrecognized request argument supplied: max_completion_tokens",
        ),
    ],
)
def test_unknown_fields_get_400_as_openai_answers_them(
    server: Server, path: str, payload: dict[str, Any], words: str
) -> None:
    assert openai_error(send(server, path, payload), 400)["message"] == words


@pytest.mark.parametrize(
    ("path", "options", "param"),
    [
        (CHAT, {"include_usage": True, "include_usag": False}, "stream_options.include_usag"),
        (COMPLETIONS, {"continuous_usage": 1, "x": 1}, "stream_options.continuous_usage"),
    ],
)
def test_an_unknown_key_inside_an_object_is_named_by_its_path_as_openai_does(
    server: Server, path: str, options: dict[str, Any], param: str
) -> None:
    """OpenAI names a nested unknown key `Unknown parameter: 'stream_options.x'.` with that
    path as `param` (and the first of several); llmrun said `Unrecognized request argument
    supplied`, its words for a top-level field, with `param` only `stream_options`."""
    payload = {"prompt": "Hi", "max_tokens": 2} if path == COMPLETIONS else small()
    error = openai_error(
        send(server, path, {**payload, "stream": True, "stream_options": options}), 400
    )
    assert (error["message"], error["param"]) == (f"Unknown parameter: '{param}'.", param)


def data_events(r: httpx.Response) -> list[dict[str, Any]]:
    """A stream's JSON events, [DONE] and the rest left out."""
    return [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]


def test_vllms_continuous_usage_stats_asks_nothing_without_include_usage(server: Server) -> None:
    """vLLM's `stream_options.continuous_usage_stats` (SGLang's too; proxies and benchmarks
    send it) was a 400 for an unknown key. False, or true without `include_usage` (vLLM
    ignores it then), changes nothing: no chunk but the usage chunk has a `usage` key."""
    for options, usage in (
        ({"include_usage": True, "continuous_usage_stats": False}, True),
        ({"continuous_usage_stats": True}, False),
        ({"include_usage": False, "continuous_usage_stats": True}, False),
        ({"include_usage": None, "continuous_usage_stats": None}, False),
        (None, False),
    ):
        for path in (CHAT, COMPLETIONS):
            payload = small() if path == CHAT else {"prompt": "Hi", "max_tokens": 2}
            r = send(server, path, {**payload, "stream": True, "stream_options": options})
            assert r.status_code == 200, (options, r.text)
            events = data_events(r)
            assert [e for e in events if "usage" in e] == ([events[-1]] if usage else []), options
            assert events[-1]["choices"] == ([] if usage else events[-1]["choices"])


@pytest.mark.parametrize(
    ("path", "payload"),
    [
        (CHAT, chat("Write one sentence about the sea.", max_tokens=40, temperature=0)),
        (COMPLETIONS, {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}),
    ],
)
def test_vllms_continuous_usage_stats_puts_the_usage_so_far_on_every_chunk(
    server: Server, path: str, payload: dict[str, Any]
) -> None:
    """With `include_usage` and `continuous_usage_stats` true (vLLM's benchmark, SGLang's
    clients and gateways send both) every chunk carries the usage so far, as vLLM's does: the
    tokens sampled never decrease, the last chunk's equal the usage chunk's, and the prompt's
    cached tokens are known from the first chunk on (it was a 400). Twice: the second request
    finds its prompt cached."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    for _ in range(2):
        r = send(server, path, {**payload, "stream": True, "stream_options": options})
        assert r.status_code == 200, r.text
        assert r.text.endswith("data: [DONE]\n\n")
        events = data_events(r)
        final = events[-1]
        assert final["choices"] == [] and "timings" in final
        usage = [e["usage"] for e in events]
        done = final["usage"]
        counts = [u["completion_tokens"] for u in usage]
        assert counts == sorted(counts) and counts[-2] == done["completion_tokens"] > 0, counts
        assert events[-2]["choices"][0]["finish_reason"] in ("stop", "length")
        assert usage[-2] == done
        for u in usage:
            assert set(u) == set(done)
            assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
            assert u["prompt_tokens"] == done["prompt_tokens"]
            assert u["prompt_tokens_details"] == done["prompt_tokens_details"]
        if path == CHAT:
            assert events[0]["choices"][0]["delta"]["role"] == "assistant"
            assert usage[0]["completion_tokens"] == 0
    assert done["prompt_tokens_details"]["cached_tokens"] > 0


@pytest.mark.parametrize(
    "payload",
    [
        b'{"content":"\\ud800"}',
        b'{"content":"\xff\xfe"}',
        b'{"content":5}',
        b'{"content":"hi","add_special":"yes"}',
        b"[",
        b"[]",
    ],
)
def test_tokenize_refuses_what_the_chat_routes_refuse_with_400(
    server: Server, payload: bytes
) -> None:
    """/tokenize reads its body through the same gate as the chat routes: a lone surrogate or
    bad UTF-8 is a 400 (not a 500 and a traceback), and it is counted."""
    before = count(server, "tokenize", "bad_request")
    openai_error(send(server, "/tokenize", payload), 400)
    assert count(server, "tokenize", "bad_request") == before + 1
    assert not any("Traceback" in line for line in server.lines), "".join(server.lines)


def test_json_held_in_a_string_gets_the_gates_400_for_a_lone_surrogate(server: Server) -> None:
    """A call's arguments are a JSON string holding JSON: its `\\ud800` passes the body's gate
    as a backslash and is decoded when the call is written into the prompt (it was a 500)."""
    payload = (
        b'{"messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"a","type":'
        b'"function","function":{"name":"f","arguments":"{\\"a\\":\\"\\\\ud800\\"}"}}]}],'
        b'"max_tokens":3}'
    )
    error = openai_error(send(server, CHAT, payload), 400)
    assert error["param"] == "messages.0.tool_calls.0.function.arguments"
    assert error["message"].startswith(f"{error['param']}: a lone surrogate (an escape from")
    still_serving(server)


def test_every_response_is_counted_once_under_its_route(server: Server) -> None:
    """/metrics counts each response once, under the route of its path, whichever layer gave
    it: routing (405), the access checks (403), a route's own refusal or answer."""
    before = outcomes(server)  # this scrape itself: one metrics ok
    httpx.get(server.url + CHAT, timeout=HANG_S)
    httpx.post(
        server.url + CHAT, json=small(), headers={"Origin": "https://evil.example"}, timeout=HANG_S
    )
    httpx.get(server.url + "/health", headers={"Host": "evil.example"}, timeout=HANG_S)
    send(server, "/tokenize", b"[")
    httpx.get(server.url + "/health", timeout=HANG_S)
    send(server, COMPLETIONS, {"prompt": "Hi", "max_tokens": 1})
    httpx.get(server.url + "/v1/models/nope", timeout=HANG_S)
    after = outcomes(server)
    counted = {k: after.get(k, 0) - before.get(k, 0) for k in {*after, *before}}
    assert {k: v for k, v in counted.items() if v} == {
        ("metrics", "ok"): 1,
        ("chat", "method_not_allowed"): 1,
        ("chat", "forbidden"): 1,
        ("health", "forbidden"): 1,
        ("tokenize", "bad_request"): 1,
        ("health", "ok"): 1,
        ("completions", "ok"): 1,
        ("models", "not_found"): 1,
    }


def test_a_model_not_served_gets_404(server: Server) -> None:
    served = server.get("/v1/models")["data"][0]["id"]
    error = openai_error(send(server, CHAT, small(model="gpt-4o")), 404)
    assert error["type"] == "model_not_found" and error["param"] == "model"
    assert "'gpt-4o' is not served here" in error["message"] and served in error["message"]
    for name in (served, served + ".gguf", ""):
        assert send(server, CHAT, small(model=name)).status_code == 200
    assert httpx.get(f"{server.url}/v1/models/{served}", timeout=HANG_S).json()["id"] == served
    openai_error(httpx.get(f"{server.url}/v1/models/gpt-4o", timeout=HANG_S), 404)


def test_unknown_paths_and_methods_get_openai_errors(server: Server) -> None:
    r = httpx.get(server.url + CHAT, timeout=HANG_S)
    assert "GET is not allowed" in openai_error(r, 405)["message"]
    assert "POST" in r.headers["allow"]
    for method, path in (("POST", "/metrics"), ("DELETE", "/v1/models"), ("PUT", "/health")):
        openai_error(httpx.request(method, server.url + path, timeout=HANG_S), 405)
    assert (
        "no route /nope"
        in openai_error(httpx.get(server.url + "/nope", timeout=HANG_S), 404)["message"]
    )
    for path in ("/metrics", "/v1/models", "/health"):
        head = httpx.head(server.url + path, timeout=HANG_S)
        assert head.status_code == 200 and head.content == b""
    for garbage in (
        b"HELLO\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHo st: x\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: -5\r\n\r\n",
    ):
        status, headers, body = exchange(server, garbage)
        assert status == 400 and headers["content-type"] == "application/json", body
        assert json.loads(body)["error"]["message"].startswith("malformed HTTP request")
    options = httpx.options(server.url + CHAT, timeout=HANG_S)
    assert options.status_code == 204 and "POST" in options.headers["allow"]


def test_a_body_over_the_limit_gets_413_before_it_is_read(server: Server) -> None:
    with connect(server) as sock:  # only the headers: the answer cannot wait for the body
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Length: 99999999999\r\n\r\n{"
        )
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    assert received.startswith(b"HTTP/1.1 413 ")
    assert b"connection: close" in received.lower()
    assert b'"code":413' in received
    over = b"[" + b" " * MIN_BODY_LIMIT + b"]"
    chunked = (
        b"".join(
            b"%x\r\n%s\r\n" % (len(over[i : i + 65536]), over[i : i + 65536])
            for i in range(0, len(over), 65536)
        )
        + b"0\r\n\r\n"
    )
    status, _, body = exchange(
        server,
        post_raw(CHAT, b"", b"Transfer-Encoding: chunked\r\n").replace(
            b"Content-Length: 0\r\n", b""
        )
        + chunked,
    )
    assert status == 413 and b"at most" in body, body
    still_serving(server)


def test_a_chunked_body_is_read(server: Server) -> None:
    payload = json.dumps(small()).encode()
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(payload), payload)
    status, _, body = exchange(
        server,
        post_raw(CHAT, b"", b"Transfer-Encoding: chunked\r\n").replace(
            b"Content-Length: 0\r\n", b""
        )
        + chunked,
    )
    assert status == 200, body


@pytest.fixture
def short_deadlines(serve_env: dict[str, str]) -> Iterator[Server]:  # noqa: F811
    """A server of its own whose deadlines on headers and on a body's next piece are
    SHORT_DEADLINE_S (tests/inject/sitecustomize.py), not the 30 s a test would wait out."""
    env = dict(serve_env, **{SERVE_TIMEOUT_ENV: f"{SHORT_DEADLINE_S:g}"})
    with llmrun_serve(env, "-np", "1", "--no-dashboard") as s:
        yield s


def test_a_body_shorter_than_its_length_and_slow_headers_time_out(
    short_deadlines: Server,
) -> None:
    """A Content-Length lie and a slowloris client: each connection is ended by the server's
    own deadline (408), while other requests are answered meanwhile."""
    server = short_deadlines
    results: dict[str, bytes] = {}
    timeouts = {route: count(server, route, "timeout") for route in ("chat", "other")}

    def lie() -> None:
        payload = json.dumps(small()).encode()
        status, _, body = exchange(
            server,
            post_raw(CHAT, payload).replace(
                b"Content-Length: %d" % len(payload), b"Content-Length: 9999"
            ),
        )
        results["lie"] = b"%d %s" % (status, body)

    def slowloris() -> None:
        with connect(server) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: a")
            received = b""
            while chunk := sock.recv(65536):
                received += chunk
        results["slow"] = received

    threads = [threading.Thread(target=f) for f in (lie, slowloris)]
    for t in threads:
        t.start()
    still_serving(server)
    for t in threads:
        t.join(WAIT_S + 10)
    deadline = b"%g s" % SHORT_DEADLINE_S  # the deadline the server was given, in its answers
    assert results["lie"].startswith(b"408 ") and b"the body stopped arriving" in results["lie"]
    assert b"none for " + deadline in results["lie"], results["lie"]
    assert results["slow"].startswith(b"HTTP/1.1 408 ")
    assert b"did not arrive in " + deadline in results["slow"], results["slow"]
    assert count(server, "chat", "timeout") == timeouts["chat"] + 1
    assert count(server, "other", "timeout") == timeouts["other"] + 1
    still_serving(server)


def test_clients_that_leave_before_the_answer_free_their_sequences(server: Server) -> None:
    cancelled = server.metric('llmrun_requests_total{outcome="cancelled"')
    long = json.dumps(chat("Tell me a story.", max_tokens=400, ignore_eos=True)).encode()
    for linger in (False, True):  # a FIN, then a RST
        sock = connect(server)
        if linger:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.sendall(post_raw(CHAT, long))
        server.wait_for(lambda: server.get("/health")["slots_processing"] > 0, "a busy slot")
        sock.close()
    with connect(server) as sock:  # gone halfway through its body
        sock.sendall(post_raw(CHAT, long).replace(b"Content-Length: ", b"Content-Length: 9")[:-9])
    server.wait_for(
        lambda: server.metric('llmrun_requests_total{outcome="cancelled"') >= cancelled + 3,
        "all three counted as cancelled",
    )
    server.wait_for(lambda: server.get("/health")["slots_processing"] == 0, "the slots freed")
    still_serving(server)


def test_many_connections_at_once(server: Server) -> None:
    """Under the default --max-connections, 200 idle connections and 16 requests all pass."""
    assert server.metric("llmrun_connections_max ") == DEFAULT_MAX_CONNECTIONS > 216
    idle = [connect(server) for _ in range(200)]
    try:
        statuses: list[int] = []

        def ask(i: int) -> None:
            statuses.append(send(server, CHAT, chat(f"Hi {i}", max_tokens=2)).status_code)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT_S * 4)
        assert sorted(statuses) == [200] * 16
    finally:
        for sock in idle:
            sock.close()
    still_serving(server)


def test_metrics_stay_valid_prometheus_and_count_the_refusals(server: Server) -> None:
    """After faults of every kind /metrics still parses, and counted each where it belongs;
    the server never printed a traceback."""
    before = outcomes(server)
    send(server, CHAT, b"[]")
    send(server, CHAT, small(model="nope"))
    httpx.get(server.url + "/nope", timeout=HANG_S)
    exchange(server, b"HELLO\r\n\r\n")
    exchange(
        server,
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Length: 99999999999\r\n\r\n",
        half_close=True,
    )
    with connect(server) as sock:  # gone halfway through its body
        sock.sendall(post_raw(CHAT, b"{}").replace(b"Content-Length: 2", b"Content-Length: 9"))
    server.wait_for(
        lambda: count(server, "chat", "cancelled") > before.get(("chat", "cancelled"), 0),
        "the request gone mid-body counted",
    )
    after = outcomes(server)
    for key in (
        ("chat", "bad_request"),
        ("chat", "not_found"),
        ("other", "not_found"),
        ("other", "bad_request"),
        ("chat", "too_large"),
    ):
        assert after[key] == before.get(key, 0) + 1, key
    assert server.proc.poll() is None
    assert not any("Traceback" in line for line in server.lines), "".join(server.lines)


def outcomes(server: Server) -> dict[tuple[str, str], float]:
    """llmrun_requests_total by (route, outcome), read with Prometheus' own parser."""
    text = httpx.get(server.url + "/metrics", timeout=HANG_S).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    return {
        (s.labels["route"], s.labels["outcome"]): s.value
        for s in families["llmrun_requests"].samples
        if s.name.endswith("_total")
    }


def count(server: Server, route: str, outcome: str) -> float:
    return outcomes(server).get((route, outcome), 0.0)


# ---- browsers: origins, Host names (DNS rebinding), and the connection cap --------------------


@pytest.mark.parametrize(
    "origin",
    [
        "http://localhost:3000",
        "https://localhost",
        "http://127.0.0.1:5173",
        "http://[::1]:8080",
        "HTTP://LOCALHOST:3000",
    ],
)
def test_pages_on_this_machine_get_cors_headers_on_every_answer(
    server: Server, origin: str
) -> None:
    """Ollama's default: a page on localhost, 127.0.0.1 or [::1] (any port, http or https) may
    call the server, and every answer to it (errors and event streams too) says so."""
    headers = {"Origin": origin}
    answers = [
        httpx.get(server.url + "/v1/models", headers=headers, timeout=HANG_S),
        httpx.post(server.url + CHAT, json=small(), headers=headers, timeout=WAIT_S),
        httpx.post(server.url + CHAT, content=b"[]", headers=headers, timeout=HANG_S),
        httpx.get(server.url + "/nope", headers=headers, timeout=HANG_S),
    ]
    with httpx.stream(
        "POST", server.url + CHAT, json=small(stream=True), headers=headers, timeout=WAIT_S
    ) as streamed:
        assert streamed.headers["content-type"].startswith("text/event-stream")
        assert b"[DONE]" in streamed.read()
    answers.append(streamed)
    assert [r.status_code for r in answers] == [200, 200, 400, 404, 200]
    for r in answers:
        assert r.headers["access-control-allow-origin"] == origin, r.headers
        assert "Origin" in r.headers["vary"]
    assert (
        "access-control-allow-origin"
        not in httpx.get(server.url + "/health", timeout=HANG_S).headers
    )


def test_a_preflight_is_answered_for_an_allowed_origin(server: Server) -> None:
    origin = "http://localhost:5173"
    r = httpx.options(
        server.url + CHAT,
        timeout=HANG_S,
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os",
        },
    )
    assert r.status_code == 204, r.text
    assert r.headers["access-control-allow-origin"] == origin
    assert "POST" in r.headers["access-control-allow-methods"]
    allowed = {h.strip().lower() for h in r.headers["access-control-allow-headers"].split(",")}
    assert {"authorization", "content-type", "x-stainless-os"} <= allowed
    assert int(r.headers["access-control-max-age"]) > 0
    assert "Origin" in r.headers["vary"]
    private = httpx.options(
        server.url + CHAT,
        timeout=HANG_S,
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Private-Network": "true",
        },
    )
    assert private.headers["access-control-allow-private-network"] == "true"
    assert "access-control-allow-private-network" not in r.headers
    refused = httpx.options(
        server.url + CHAT,
        timeout=HANG_S,
        headers={"Origin": "https://preflight.example", "Access-Control-Request-Method": "POST"},
    )
    openai_error(refused, 403)
    assert "access-control-allow-origin" not in refused.headers


@pytest.mark.parametrize(
    "origin",
    [
        "https://evil.example",
        "null",
        "http://localhost.evil.example",
        "http://127.0.0.1.nip.io:8080",
        "file://",
        "chrome-extension://abc",
    ],
)
def test_other_origins_get_403_before_any_work(server: Server, origin: str) -> None:
    """A page elsewhere must not run completions here: even a simple POST (no preflight) is
    refused before the engine sees it; counted in /metrics under its route, one log line."""
    before = (count(server, "chat", "forbidden"), server.metric("llmrun_prompt_tokens_total"))

    def lines() -> int:
        return sum(f"chat 403 Origin {origin!r}" in line for line in list(server.lines))

    logged = lines()
    r = httpx.post(
        server.url + CHAT,
        content=json.dumps(small()).encode(),
        timeout=HANG_S,
        headers={"Origin": origin, "Content-Type": "text/plain"},
    )
    error = openai_error(r, 403)
    assert f"--allow-origin {origin}" in error["message"]
    assert "access-control-allow-origin" not in r.headers
    assert count(server, "chat", "forbidden") == before[0] + 1
    assert server.metric("llmrun_prompt_tokens_total") == before[1]
    server.wait_for(lambda: lines() == logged + 1, "its log line")
    still_serving(server)


@pytest.mark.parametrize(
    ("host", "status"),
    [
        ("evil.example", 403),
        ("evil.example:8080", 403),
        ("localhost.evil.example", 403),
        ("127.0.0.1.nip.io", 403),
        ("10.0.0.1", 403),
        ("localhost", 200),
        ("localhost:", 200),  # RFC 3986: an empty port is no port (it was a 403)
        ("[::1]:", 200),
        ("LOCALHOST.:8080", 200),
        ("app.localhost", 200),
        ("127.0.0.1", 200),
        ("127.4.5.6:80", 200),
        ("[::1]", 200),
        ("[::1]:8080", 200),
    ],
)
def test_on_loopback_only_loopback_host_names_are_answered(
    server: Server, host: str, status: int
) -> None:
    """DNS rebinding: a page whose own name now resolves to 127.0.0.1 is same-origin to the
    browser, but its Host header still names it. As Ollama: 403 on a loopback listener."""
    r = httpx.post(server.url + CHAT, json=small(), headers={"Host": host}, timeout=WAIT_S)
    assert r.status_code == status, r.text
    if status == 403:
        assert "DNS rebinding" in openai_error(r, 403)["message"]


@pytest.mark.parametrize(
    "name",
    [b"127.0.0.1%2eattacker%2ecom", b"127.0.0.1%00.evil.com", b"127.0.0.1%41", b"127.0.0.1%2e"],
)
def test_a_name_with_percent_after_a_loopback_address_is_a_foreign_name(
    server: Server, name: bytes
) -> None:
    """Any Host starting `127.0.0.1%` was loopback (200): the check cut a zone off every name.
    A zone belongs inside an IPv6 literal's [ ] alone (RFC 6874); such a name is a reg-name
    with %XX in it, no address, and gets the 403 of any foreign name, as a Host header and as
    the authority of a target in absolute-form."""
    port = server.url.rsplit(":", 1)[1].encode()
    for head in (
        b"GET /v1/models HTTP/1.1\r\nHost: %s\r\n" % name,
        b"GET http://%s:%s/v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n" % (name, port),
    ):
        status, _, body = exchange(server, head + b"Connection: close\r\n\r\n")
        assert status == 403, (head, body)
        assert "DNS rebinding" in json.loads(body)["error"]["message"], body
    zone = b"GET /v1/models HTTP/1.1\r\nHost: [::1%25lo]\r\nConnection: close\r\n\r\n"
    assert exchange(server, zone)[0] == 400  # a zone id in a Host stays refused
    still_serving(server)


@pytest.mark.parametrize(
    ("header", "value", "says"),
    [
        ("Host", b"127.0.0.1:99999999999999999999", "has a port that is no number up to 65535"),
        ("Host", "127.0.0.1:\u0668\u0660".encode(), "is not ASCII"),
        ("Host", b"localhost:8x", "has a port that is no number up to 65535"),
        ("Host", b"localhost:" + b"9" * 5000, "has a port that is no number up to 65535"),
        ("Origin", b"http://a:" + b"9" * 5000, "has a port past 65535"),
        ("Host", b"[::1", "opens an IPv6 address with [ and never closes it"),
        ("Host", b"[::1]x", "has more than a :port after the ] of its IP address"),
        ("Host", b"[::1 evil]", "holds more than an IP address in its [ ]"),
        ("Host", b"[127.0.0.1]", "puts what is no IPv6 address in [ ] (RFC 3986: an IPv4"),
        ("Host", b"[localhost]:8080", "puts what is no IPv6 address in [ ]"),
        # RFC 3986: a host name ends at none of these; read as *.localhost they were a 200
        ("Host", b"evil.example#.localhost", "holds '#', which is no character of a host name"),
        ("Host", b"evil.example\\.localhost", "holds '\\\\', which is no character"),
        ("Host", b"evil.example?.localhost", "holds '?', which is no character of a host name"),
        ("Host", b"evil.example/.localhost", "holds '/', which is no character of a host name"),
        ("Host", b"%zz.localhost", "holds '%', which is no character of a host name"),
        ("Origin", "http://127.0.0.1:\u0668\u0660".encode(), "is not ASCII"),
        ("Origin", b"http://127.0.0.1:99999999", "has a port past 65535"),
        ("Origin", b"http://localhost:5173 https://evil.example", "names more than one origin"),
        ("Origin", b"http://localhost:5173,https://evil.example", "names more than one origin"),
    ],
)
def test_a_malformed_host_or_origin_is_400_not_a_foreign_name(
    server: Server, header: str, value: bytes, says: str
) -> None:
    """A Host with a port of 20 digits was answered (200); one with Arabic-Indic digits was
    called a foreign name (403) in mojibake, and such an Origin was told to start the server
    with an --allow-origin that could never match."""
    r = httpx.post(
        server.url + CHAT, json=small(), headers={header.encode(): value}, timeout=WAIT_S
    )
    error = openai_error(r, 400)
    message = error["message"]
    assert message.startswith(f"{header} ") and says in message, message
    assert error["type"] == "invalid_request_error", error  # it was "forbidden", as a 403's
    assert message.isascii(), message  # the bytes escaped, never shown as latin-1
    still_serving(server)


@pytest.mark.parametrize(
    "second", [b"https://evil.example", b"http://localhost:5173", b"http://127.0.0.1:99999"]
)
def test_a_second_origin_header_is_400_as_a_second_host_is(server: Server, second: bytes) -> None:
    """The check read the first Origin and ignored the rest: an allowed page's origin then
    a foreign one was served (200). A browser sends one (RFC 6454 section 7, the Fetch
    standard), and h11 refuses a second Host with 400: so is a second Origin, whatever either
    names, before any route."""
    logged = len(server.lines)
    for origins in ((b"http://localhost:5173", second), (second, b"http://localhost:5173")):
        head = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
        head += b"".join(b"Origin: " + o + b"\r\n" for o in origins)
        status, headers, body = exchange(server, head + b"\r\n")
        assert status == 400, body
        message = json.loads(body)["error"]["message"]
        assert message.startswith("Origin sent 2 times (") and "one Origin header" in message
        assert "access-control-allow-origin" not in headers
    host = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: 127.0.0.1\r\n\r\n"
    assert exchange(server, host)[0] == 400  # h11's, below the app
    server.wait_for(
        lambda: sum("models 400 Origin sent 2" in line for line in server.lines[logged:]) >= 2,
        "its log lines",
    )
    still_serving(server)


@pytest.mark.parametrize("number", [b"1e999", b"-1e999", b"NaN", b"Infinity"])
def test_a_float_field_past_the_floats_or_nan_is_named_as_no_finite_number(
    server: Server, number: bytes
) -> None:
    """`"temperature": 1e999` said `temperature inf is out of range` (Python reads it as inf),
    and NaN `top_p nan is out of range`: each is refused by the field's name instead."""
    for field in (b"temperature", b"top_p"):
        body = b'{"messages": [{"role": "user", "content": "hi"}], "%s": %s}' % (field, number)
        status, _, answer = exchange(server, post_raw(CHAT, body))
        error = json.loads(answer)["error"]
        assert status == 400 and error["param"] == field.decode(), answer
        assert error["message"] == f"{field.decode()}: Input should be a finite number", answer


@pytest.mark.parametrize("version", [b"2.0", b"3.0", b"0.9"])
def test_a_request_line_of_another_major_http_version_is_505(
    server: Server, version: bytes
) -> None:
    """`GET /v1/models HTTP/2.0` was served as HTTP/1.1 (h11 reads any digit.digit); RFC 9110
    section 15.6.6: 505 for a major version the server does not speak. A later minor version
    of 1 is served as 1.1 (RFC 9110 section 2.5), and 1.0 as itself."""
    head = b"GET /v1/models HTTP/%s\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    status, _, body = exchange(server, head % version)
    assert status == 505, body
    message = json.loads(body)["error"]["message"]
    assert message.startswith(f"HTTP/{version.decode()} is not served here"), message
    for served in (b"1.0", b"1.1", b"1.9"):
        assert exchange(server, head % served)[0] == 200, served
    # without Connection: close, and HTTP/2's own preface: one 505, then the server closes (the
    # preface's "SM" line got a second reply, a 400, on the connection left open)
    for opening in (
        b"GET /v1/models HTTP/%s\r\nHost: 127.0.0.1\r\n\r\n" % version,
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    ):
        status, headers, body = exchange(server, opening)  # reads until the server closes
        assert status == 505 and headers.get("connection") == "close", (opening, headers)
        assert b"HTTP/1.1 400" not in body, body  # no second response
    still_serving(server)


def test_a_target_in_absolute_form_is_served_and_its_host_is_checked(server: Server) -> None:
    """RFC 9112 section 3.2.2: a server MUST accept `GET http://host:port/path HTTP/1.1` (it
    was a 404: the route was looked up by the whole URL), and the authority in it replaces
    the Host header, so the DNS rebinding check reads that authority."""
    address = server.url.removeprefix("http://").encode()

    def ask(target: bytes, host: bytes = b"127.0.0.1", body: bytes = b"") -> tuple[int, Any]:
        head = b"%s %s HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n" % (
            b"POST" if body else b"GET",
            target,
            host,
        )
        if body:
            head += b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body)
        status, _, answer = exchange(server, head + b"\r\n" + body)
        return status, json.loads(answer)

    served = server.get("/v1/models")
    before = (count(server, "models", "ok"), count(server, "models", "forbidden"))
    for target in (b"http://" + address + b"/v1/models", b"HTTP://localhost/v1/models/?x=1"):
        assert ask(target) == (200, served), target
    # the Host header is ignored for the target's authority, both ways
    assert ask(b"http://" + address + b"/v1/models", host=b"evil.example") == (200, served)
    status, answer = ask(b"http://evil.example:8080/v1/models")
    assert status == 403 and "Host 'evil.example:8080'" in answer["error"]["message"], answer
    assert "DNS rebinding" in answer["error"]["message"]
    status, answer = ask(b"http://localhost:99999/v1/models")
    assert status == 400 and "no number up to 65535" in answer["error"]["message"], answer
    status, answer = ask(b"http://[::1]" + CHAT.encode(), body=json.dumps(small()).encode())
    assert status == 200 and answer["choices"], answer
    for target, says in (
        (b"ftp://127.0.0.1/v1/models", "is neither a path (/v1/...) nor an http:// or"),
        (b"http:///v1/models", "names no host after http://"),
        (b"http://user:pw@127.0.0.1/v1/models", "carries credentials before its host"),
        # RFC 3986 section 3.2: the authority is evil.example, never *.localhost (a 200)
        (b"http://evil.example#.localhost/v1/models", "holds a fragment (#'.localhost/v1/models')"),
        # RFC 9112 section 3.2: no fragment; the # ends the authority, so no credentials here
        (b"http://127.0.0.1#@evil/v1/models", "holds a fragment (#'@evil/v1/models'): a request"),
        (b"/v1/models#x", "holds a fragment (#'x'): a request target has none (RFC 9112"),
        (b"http://evil.example\\.localhost/v1/models", "holds '\\\\', which is no character"),
        (b"http://[::1]x/v1/models", "has more than a :port after the ]"),
    ):
        status, answer = ask(target)
        assert status == 400 and says in answer["error"]["message"], (target, answer)
        assert answer["error"]["type"] == "invalid_request_error", answer
    status, answer = ask(b"http://evil.example?.localhost/v1/models")  # the query is its own
    assert status == 403 and "Host 'evil.example'" in answer["error"]["message"], answer
    # counted under the route of the path in the target, not `other`
    assert count(server, "models", "ok") >= before[0] + 3
    assert count(server, "models", "forbidden") >= before[1] + 1
    still_serving(server)


def test_a_target_in_another_form_than_its_method_allows_is_400(server: Server) -> None:
    """RFC 9112 sections 3.2.3-3.2.4: a target of `host:port` is CONNECT's alone and `*`
    OPTIONS' alone. `GET 127.0.0.1:PORT` was a 404 (no route), `GET localhost:PORT` a 400,
    `GET *` and a CONNECT 404s; each is a 400 now, in the words of the others, and
    `OPTIONS *` gets the methods served."""
    address = server.url.removeprefix("http://").encode()
    host, port = address.rsplit(b":", 1)
    neither = "is neither a path (/v1/...) nor an http:// or https:// URL"
    before = (count(server, "other", "bad_request"), count(server, "other", "forbidden"))
    for method, target, says in (
        (b"GET", address, neither),
        (b"GET", b"localhost:" + port, neither),
        (b"POST", b"[::1]:" + port, neither),
        (b"GET", b"v1/models", neither),
        (b"GET", b"*", "the request target '*' is for OPTIONS alone"),
        (b"POST", b"*", "the request target '*' is for OPTIONS alone"),
        (b"CONNECT", address, "this server is no proxy and opens no tunnel"),
        (b"CONNECT", b"/v1/models", "this server is no proxy and opens no tunnel"),
    ):
        request = b"%s %s HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n"
        status, headers, body = exchange(server, request % (method, target, host))
        assert status == 400, (method, target, body)
        error = json.loads(body)["error"]
        assert says in error["message"] and error["type"] == "invalid_request_error", error
    request = b"OPTIONS * HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n" % host
    status, headers, body = exchange(server, request)
    assert (status, body) == (204, b"") and "POST" in headers["allow"], (status, headers)
    # a client's mistake, counted as the other 400s (they were `forbidden`, as a 403)
    assert count(server, "other", "bad_request") >= before[0] + 7
    assert count(server, "other", "forbidden") == before[1]
    still_serving(server)


@pytest.mark.parametrize(
    ("method", "path", "fields"),
    [
        ("GET", "/v1/models/", "data"),
        ("GET", "/models/", "data"),
        ("GET", "/health/", "status"),
        ("POST", "/v1/chat/completions/", "choices"),
        ("POST", "/v1/completions/", "choices"),
        ("POST", "/tokenize/", "tokens"),
    ],
)
def test_a_trailing_slash_is_the_same_route_never_a_redirect(
    server: Server, method: str, path: str, fields: str
) -> None:
    """A 307 is an error to clients that do not follow redirects (curl without -L, httpx by
    default): the route answers directly, as without the slash."""
    body = (
        {"content": "hi"}
        if path.startswith("/tokenize")
        else (small() if "chat" in path else {"prompt": "Hi", "max_tokens": 2})
    )
    r = httpx.request(
        method,
        server.url + path,
        json=body if method == "POST" else None,
        timeout=WAIT_S,
        follow_redirects=False,
    )
    assert r.status_code == 200, (r.status_code, r.headers, r.text)
    assert fields in r.json()
    served = server.get("/v1/models")["data"][0]["id"]
    assert httpx.get(f"{server.url}/v1/models/{served}/", timeout=HANG_S).json()["id"] == served


def test_a_long_path_or_host_is_one_short_log_line(server: Server) -> None:
    """A client's words go into the log cut short: a 15 kB path or Host is not a 15 kB line."""
    for request, start in (
        (b"GET /" + b"p" * 15_000 + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n", "other 404 GET /ppp"),
        (
            b"GET /health HTTP/1.1\r\nHost: " + b"h" * 15_000 + b".example\r\n",
            "health 403 Host 'hhh",  # counted and logged under its route
        ),
    ):
        logged = len(server.lines)
        status, _, _ = exchange(server, request + b"Connection: close\r\n\r\n")
        assert status in (403, 404)

        def mine(first: int = logged, words: str = start) -> list[str]:
            return [line for line in server.lines[first:] if words in line]

        server.wait_for(lambda: bool(mine()), "its log line")
        assert len(mine()[0]) < 500 and "characters)" in mine()[0], mine()[0][:600]


def send_in_pieces(server: Server, data: bytes, piece: int) -> int:
    """`data` written `piece` bytes at a time, each its own TCP segment; the answer's status."""
    with connect(server) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with contextlib.suppress(OSError):  # the server may answer and close before the end
            for at in range(0, len(data), piece):
                sock.sendall(data[at : at + piece])
                time.sleep(0.002)
        received = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(65536):
                received += chunk
    assert received, "no answer"
    return int(received.split(b" ", 2)[1])


@pytest.mark.parametrize("where", ["path", "host"])
def test_a_head_over_16_kib_is_a_431_however_its_bytes_arrive(server: Server, where: str) -> None:
    """h11 alone refused a long head only while it was incomplete: a 40 kB path got 404 when
    it arrived in one read and 400 in pieces. Now the head's size decides, not TCP."""
    long = b"p" * 40_000
    head = (
        b"GET /" + long + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        if where == "path"
        else b"GET /health HTTP/1.1\r\nHost: " + long + b"\r\n"
    ) + b"Connection: close\r\n\r\n"
    logged = len(server.lines)
    status, headers, body = exchange(server, head)  # one sendall
    assert status == 431 and headers["content-type"] == "application/json", body
    assert "over 16,384 bytes" in json.loads(body)["error"]["message"]
    for piece in (1_000, 10_000, 17_000):
        assert send_in_pieces(server, head, piece) == 431, piece
    server.wait_for(
        lambda: sum("other 431" in line for line in server.lines[logged:]) >= 4, "4 log lines"
    )
    # one byte under the limit is served; the limit counts the whole head, line and headers
    fits = b"GET /health HTTP/1.1\r\nConnection: close\r\nHost: 127.0.0.1\r\nX-Pad: "
    fits += b"x" * (16 * 1024 - len(fits) - 4) + b"\r\n\r\n"
    assert len(fits) == 16 * 1024
    assert exchange(server, fits)[0] == 200
    assert send_in_pieces(server, fits, 1_000) == 200
    over = fits[:-4] + b"x\r\n\r\n"
    assert exchange(server, over)[0] == 431
    assert send_in_pieces(server, over, 1_000) == 431


def test_the_connection_cap_answers_503_past_it_and_any_host_off_loopback(
    serve_env: dict[str, str],  # noqa: F811
) -> None:
    """--max-connections 3: a fourth connection's request gets 503 in OpenAI's shape with
    Retry-After (CORS headers too) and is closed; counted in /metrics; once one closes, a new
    one is served. Listening on 0.0.0.0 any Host passes; an added origin is allowed."""
    with llmrun_serve(
        serve_env,
        "-np",
        "1",
        "--no-dashboard",
        "--host",
        "0.0.0.0",
        "--max-connections",
        "3",
        "--allow-origin",
        "https://app.example:443",
    ) as s:
        s.url = s.url.replace("0.0.0.0", "127.0.0.1")
        assert httpx.get(
            s.url + "/health", headers={"Host": "evil.example"}, timeout=HANG_S
        ).is_success
        app = httpx.get(
            s.url + "/v1/models", headers={"Origin": "https://app.example"}, timeout=HANG_S
        )
        assert app.headers["access-control-allow-origin"] == "https://app.example"
        openai_error(
            httpx.get(
                s.url + "/v1/models", headers={"Origin": "https://other.example"}, timeout=HANG_S
            ),
            403,
        )
        first = connect(s)
        holders = [first]
        try:
            s.wait_for(lambda: gauge(first, "llmrun_connections ") == 1, "only this connection")
            assert gauge(first, "llmrun_connections_max") == 3
            holders += [connect(s) for _ in range(2)]
            for sock in holders:
                assert ask(sock, "GET", "/health")[0] == 200
            before = gauge(first, 'llmrun_requests_total{outcome="too_many_connections"')
            with connect(s) as extra:
                status, headers, body = ask(
                    extra, "POST", CHAT, json.dumps(small()).encode(), origin="https://app.example"
                )
                assert extra.recv(65536) == b""  # closed after its answer
            assert status == 503 and headers["retry-after"].isdigit(), body
            assert headers["access-control-allow-origin"] == "https://app.example"
            error = json.loads(body)["error"]
            assert error["code"] == 503 and "--max-connections" in error["message"]
            after = gauge(first, 'llmrun_requests_total{outcome="too_many_connections"')
            assert after == before + 1
            holders.pop().close()
            s.wait_for(lambda: gauge(first, "llmrun_connections ") == 2, "the closed one gone")
            with connect(s) as again:
                assert ask(again, "GET", "/health")[0] == 200
        finally:
            for sock in holders:
                sock.close()
        assert not any("Traceback" in line for line in s.lines), "".join(s.lines)


def ask(
    sock: socket.socket, method: str, path: str, body: bytes = b"", origin: str | None = None
) -> tuple[int, dict[str, str], bytes]:
    """One request on a kept-alive connection; its status, headers and body."""
    extra = f"Origin: {origin}\r\n" if origin else ""
    sock.sendall(
        f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{extra}Content-Length:"
        f" {len(body)}\r\n\r\n".encode()
        + body
    )
    received = b""
    while b"\r\n\r\n" not in received:
        chunk = sock.recv(65536)
        assert chunk, received
        received += chunk
    head, _, rest = received.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict((k.lower(), v.strip()) for k, _, v in (h.partition(":") for h in lines[1:]))
    while len(rest) < int(headers["content-length"]):
        chunk = sock.recv(65536)
        assert chunk, rest
        rest += chunk
    return int(lines[0].split()[1]), headers, rest


def gauge(sock: socket.socket, name: str) -> float:
    """A metric's samples summed, read over `sock` (a connection already counted)."""
    text = ask(sock, "GET", "/metrics")[2].decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_a_cap_past_the_open_files_limit_is_lowered_and_running_out_is_one_line(
    serve_env: dict[str, str],  # noqa: F811
) -> None:
    """Under a hard limit of 256 open files the default cap (512) cannot hold: the server says
    so and caps lower, so a connection past the cap gets 503. Idle sockets past the files
    themselves make accept() fail: one log line each time asyncio retries, not a traceback."""
    with llmrun_serve(serve_env, "-np", "1", "--no-dashboard", open_files=256) as s:
        warned = [line for line in s.lines if "open files" in line]
        assert len(warned) == 1 and "serving at most 128" in warned[0], "".join(s.lines)
        assert s.metric("llmrun_connections_max") == 128
        refused = count(s, "health", "too_many_connections")
        idle = [connect(s) for _ in range(200)]
        try:
            status, _, body = exchange(s, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert status == 503 and "--max-connections" in json.loads(body)["error"]["message"]
            idle += [connect(s) for _ in range(100)]  # the kernel's backlog takes them
            s.wait_for(
                lambda: any("waits to be accepted" in line for line in list(s.lines)),
                "a failed accept logged",
            )
        finally:
            for sock in idle:
                sock.close()
        s.wait_for(lambda: s.metric("llmrun_connections ") == 1, "the idle ones gone")
        assert count(s, "health", "too_many_connections") == refused + 1  # the one 503 only
        assert not any("Traceback" in line for line in s.lines), "".join(s.lines)
