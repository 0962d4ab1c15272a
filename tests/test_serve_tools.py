"""`tools` and `tool_choice` in `llmrun serve` (runners/serving/tools.py).

Without a model: which request shapes are refused, by name, and which are accepted; how an
answer is read into a call. With the real model: "required" and a named function always give a
call whose arguments follow the schema (the grammar writes it), a conversation that carries a
call and its result back is accepted, a streamed call reassembles to the whole one, and OpenAI's
own client reads the call.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx2 as httpx
import pytest

from llmrun.runners.base import SamplingParams
from llmrun.runners.errors import BadRequestError
from llmrun.runners.serving.api_models import ChatBody
from llmrun.runners.serving.tools import HERMES, Tool, ToolPlan, merged, tool_plan

from .conftest import HANG_S
from .test_serve import Server, chat, llmrun_serve, serve_env, sse_events  # noqa: F401  (fixture)

CHAT = "/v1/chat/completions"
WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather now in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time now in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"$ref": "#/$defs/Zone"}},
            "required": ["zone"],
            "additionalProperties": False,
            "$defs": {"Zone": {"type": "string", "maxLength": 12}},
        },
    },
}
TOOLS = [WEATHER, TIME]


def check_weather(arguments: Any) -> None:
    assert isinstance(arguments, dict) and set(arguments) == {"city", "unit"}, arguments
    assert isinstance(arguments["city"], str) and len(arguments["city"]) <= 16
    assert arguments["unit"] in ("celsius", "fahrenheit")


def check_call(call: dict[str, Any]) -> None:
    """A call in OpenAI's shape whose arguments follow its tool's schema."""
    assert call["id"].startswith("call_") and call["type"] == "function"
    arguments = json.loads(call["function"]["arguments"])
    if call["function"]["name"] == "get_weather":
        check_weather(arguments)
    else:
        assert call["function"]["name"] == "get_time"
        assert set(arguments) == {"zone"} and isinstance(arguments["zone"], str)
        assert len(arguments["zone"]) <= 12


def body(**kw: Any) -> ChatBody:
    return ChatBody.model_validate({"messages": [{"role": "user", "content": "hi"}], **kw})


# ---- request shapes (no model) -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"tool_choice": "required"}, "tool_choice: 'required' needs tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice: 'sometimes' is not one of"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name: 'nope' is not among the tools",
        ),
        ({"tools": TOOLS, "tool_choice": {"name": "get_time"}}, "tool_choice: "),
        ({"tools": [{"type": "code_interpreter"}]}, 'tools.0: only tools of type "function"'),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name"),
        ({"tools": [WEATHER, WEATHER]}, "'get_weather' is listed twice"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "strict": True,
                            "parameters": {
                                "type": "object",
                                "properties": {"n": {"type": "integer", "minimum": 1}},
                            },
                        },
                    }
                ]
            },
            "tools.0.function.parameters.properties.n.minimum: not supported",
        ),
        (
            {"tools": TOOLS, "response_format": {"type": "json_object"}},
            "response_format: not served together with tools",
        ),
        ({"tools": TOOLS, "logprobs": True}, "logprobs: not served together with tools"),
    ],
)
def test_what_tools_cannot_serve_is_refused_by_name(fields: dict[str, Any], words: str) -> None:
    with pytest.raises(BadRequestError) as e:
        b = body(**fields)
        b.request(SamplingParams())
        b.grammar()
    assert words in str(e.value)


def test_a_forced_call_of_a_schema_the_grammar_cannot_keep_is_refused() -> None:
    loose = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {"type": "object", "properties": {"n": {"type": "number", "maximum": 3}}},
        },
    }
    body(tools=[loose]).request(SamplingParams())  # auto: the schema is only shown
    with pytest.raises(BadRequestError) as e:
        body(tools=[loose], tool_choice="required").grammar()
    assert "tools.0.function.parameters.properties.n.maximum" in str(e.value)


def test_none_offers_nothing_and_auto_writes_the_tools_into_the_system_message() -> None:
    plain = body().request(SamplingParams())
    assert body(tools=TOOLS, tool_choice="none").request(SamplingParams()) == plain
    assert body(tools=TOOLS, tool_choice="none").grammar() is None
    req = body(tools=TOOLS).request(SamplingParams())
    assert req.messages[0].role == "system" and '"get_time"' in req.messages[0].content
    assert req.messages[1:] == plain.messages
    assert body(tools=TOOLS).grammar() is None  # auto: the answer is free
    given = ChatBody.model_validate(
        {"messages": [{"role": "system", "content": "Be brief."}], "tools": TOOLS}
    ).request(SamplingParams())
    assert len(given.messages) == 1 and given.messages[0].content.startswith("Be brief.\n\n")


def test_forced_choices_have_a_grammar_of_the_tools_offered() -> None:
    grammar = body(tools=TOOLS, tool_choice="required").grammar() or ""
    assert '"\\"get_weather\\""' in grammar and '"\\"get_time\\""' in grammar
    named = {"type": "function", "function": {"name": "get_time"}}
    grammar = body(tools=TOOLS, tool_choice=named).grammar() or ""
    assert "get_time" in grammar and "get_weather" not in grammar


def test_a_forced_calls_schema_keeps_its_values_and_its_lines() -> None:
    """A tool's schema moves under the call's $defs: its refs follow, a value that looks like a
    ref (in an enum or a const) stays as written. The template's block around the call split the
    grammar at a U+2028 in a pattern, so the JSON string held a raw line break."""
    from llmrun.runners.serving.tools import _moved_refs

    params = {
        "type": "object",
        "properties": {"kind": {"enum": [{"$ref": "#/a"}]}, "node": {"$ref": "#/$defs/Node"}},
        "$defs": {"Node": {"const": {"$ref": "#/b"}}},
    }
    moved = _moved_refs(params, "#/$defs/t")
    assert moved["properties"] == {
        "kind": {"enum": [{"$ref": "#/a"}]},
        "node": {"$ref": "#/$defs/t/$defs/Node"},
    }
    assert moved["$defs"] == params["$defs"]
    line = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^x\u2028y$"}}}
    for family in ("generic", HERMES):
        grammar = ToolPlan((Tool("f", None, line),), forced=True, family=family).grammar() or ""
        assert all(" ::= " in rule for rule in grammar.split("\n")), grammar
        assert "\u2028" in grammar, grammar


def test_a_request_makes_its_plan_and_its_grammar_once() -> None:
    """What the route asks of a forced call's body (its request, grammar, field, plan) makes
    the tool plan once and converts the tools' schemas once (it was 4 plans and 2 grammars)."""
    from llmrun.runners.serving import tools

    b = body(tools=TOOLS, tool_choice="required")
    plans = tools.PLANS
    b.request(SamplingParams())
    grammar = b.grammar()
    assert b.grammar_field() == "tools" and b.tool_plan() is not None
    assert b.grammar() is grammar and b.logprob_count() is None
    assert tools.PLANS - plans == 1
    b.request(SamplingParams())
    assert tools.PLANS - plans == 1


def test_a_conversation_carries_calls_and_their_results() -> None:
    req = ChatBody.model_validate(
        {
            "messages": [
                {"role": "user", "content": "Weather in Oslo?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"},
            ],
            "tools": TOOLS,
        }
    ).request(SamplingParams())
    _, user, assistant, result = req.messages
    assert user.role == "user" and assistant.role == "assistant"
    assert json.loads(assistant.content) == {"name": "get_weather", "arguments": {"city": "Oslo"}}
    assert result.role == "user"
    assert json.loads(result.content) == {
        "tool_response": {"tool_call_id": "call_1", "name": "get_weather", "content": "-3 C"}
    }


@pytest.mark.parametrize(
    "arguments",
    [r'{"a":"\ud800"}', r'["x", {"b": "\udfff"}]', r'"\ud83d"', r'{"\udc00": 1}'],
)
def test_call_arguments_whose_json_holds_a_lone_surrogate_are_refused_by_name(
    arguments: str,
) -> None:
    """The body's gate refuses `\\ud800` alone, but arguments are a JSON string holding JSON:
    the escape is decoded only when the call is written into the prompt, where UTF-8 cannot
    carry it (it was a 500, UnicodeEncodeError)."""
    call = {"id": "a", "type": "function", "function": {"name": "f", "arguments": arguments}}
    wire = json.dumps({"messages": [{"role": "assistant", "content": None, "tool_calls": [call]}]})
    with pytest.raises(BadRequestError) as e:
        ChatBody.model_validate_json(wire).request(SamplingParams())
    where = "messages.0.tool_calls.0.function.arguments"
    assert str(e.value).startswith(f"{where}: a lone surrogate (an escape from \\ud800")
    assert e.value.param == where
    paired = {**call, "function": {"name": "f", "arguments": r'{"a":"\ud83d\ude00 \u00e9"}'}}
    message = body(messages=[{"role": "assistant", "tool_calls": [paired]}]).request(
        SamplingParams()
    )
    assert json.loads(message.messages[0].content)["arguments"] == {"a": "\U0001f600 \u00e9"}


CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize(
    ("messages", "param", "says"),
    [
        ([{"role": "assistant", "tool_calls": [{**CALL, "id": 5}]}], "tool_calls.0.id", "a number"),
        (
            [{"role": "assistant", "tool_calls": [{**CALL, "id": ["a"]}]}],
            "tool_calls.0.id",
            "array",
        ),
        (
            [{"role": "assistant", "tool_calls": [{**CALL, "type": 1}]}],
            "tool_calls.0.type",
            "number",
        ),
        (
            [{"role": "assistant", "tool_calls": [{**CALL, "type": "custom"}]}],
            "tool_calls.0.type",
            "only calls of type \"function\" are served, not 'custom'",
        ),
        (
            [{"role": "assistant", "tool_calls": [{**CALL, "function": {"name": 7}}]}],
            "tool_calls.0.function.name",
            "must be a string, not a number",
        ),
        (
            [{"role": "assistant", "tool_calls": [{**CALL, "function": {"arguments": "{}"}}]}],
            "tool_calls.0.function.name",
            "the name of the function called",
        ),
        ([{"role": "tool", "tool_call_id": 5, "content": "x"}], "tool_call_id", "not a number"),
        ([{"role": "tool", "tool_call_id": True, "content": "x"}], "tool_call_id", "a boolean"),
        ([{"role": "tool", "content": "x"}], "tool_call_id", "the id of the call this answers"),
        ([{"role": "user", "name": 5, "content": "x"}], "name", "must be a string, not a number"),
    ],
)
def test_a_calls_fields_are_typed_as_openai_types_them(
    messages: list[dict[str, Any]], param: str, says: str
) -> None:
    """A call's id of 5 was taken (as "5"); OpenAI types the id, the type, the function's
    name and a tool message's tool_call_id as strings (null or left out: none given): any other
    JSON kind is a 400 naming the field."""
    with pytest.raises(BadRequestError) as e:
        body(messages=messages).request(SamplingParams())
    assert e.value.param == f"messages.0.{param}", str(e.value)
    assert str(e.value).startswith(f"messages.0.{param}: ") and says in str(e.value)
    fine = {**CALL, "id": None, "type": None}  # null: not given, as OpenAI's schema has it
    message = body(messages=[{"role": "assistant", "name": "bot", "tool_calls": [fine]}])
    assert message.request(SamplingParams()).messages[0].content


def read(plan_tools: Any, choice: Any, text: str, finish: str = "stop", step: int = 3) -> Any:
    plan = tool_plan(plan_tools, choice)
    assert plan is not None
    reader = plan.reader()
    deltas = [d for i in range(0, len(text), step) for d in reader.feed(text[i : i + step])]
    more, reason = reader.finish(finish)
    return merged(deltas + more), reason, deltas + more


def test_auto_reads_a_call_only_from_an_answer_that_is_one() -> None:
    call = '\n{"name": "get_weather", "arguments": {"city": "Lima", "unit": "celsius"}}\n'
    (content, calls), reason, _ = read(TOOLS, "auto", call)
    assert reason == "tool_calls" and content is None
    assert calls[0]["function"]["name"] == "get_weather"
    check_weather(json.loads(calls[0]["function"]["arguments"]))
    for text in (
        "It is sunny.",
        '{"name": "get_weather"}',  # no arguments
        '{"name": "get_fire", "arguments": {}}',  # no such tool
        '{"name": "get_time", "arguments": {}, "why": 1}',  # a key more
        'Call {"name": "get_time", "arguments": {}}',  # not the whole answer
    ):
        (content, calls), reason, _ = read(TOOLS, "auto", text)
        assert (content, calls, reason) == (text, None, "stop")
    (content, calls), reason, _ = read(TOOLS, "auto", call, finish="length")
    assert (content, calls, reason) == (call, None, "length")


def test_a_forced_call_streams_its_arguments_as_they_are_written() -> None:
    text = '{"name": "get_time", "arguments": {"zone": "UTC"} }'
    (content, calls), reason, deltas = read(TOOLS, "required", text, step=2)
    assert reason == "tool_calls" and content is None
    assert calls[0]["function"] == {"name": "get_time", "arguments": '{"zone": "UTC"}'}
    head = deltas[0]["tool_calls"][0]
    assert head["index"] == 0 and head["id"].startswith("call_") and head["type"] == "function"
    assert head["function"] == {"name": "get_time", "arguments": ""}
    assert len(deltas) > 3  # the arguments came in pieces
    assert all(set(d["tool_calls"][0]) == {"index", "function"} for d in deltas[1:])
    (content, calls), reason, _ = read(TOOLS, "required", text[:45], finish="length")
    assert reason == "length" and calls[0]["function"]["arguments"] == '{"zone": "U'


# ---- on a real `llmrun serve` ------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(serve_env: dict[str, str]) -> Iterator[Server]:  # noqa: F811
    with llmrun_serve(serve_env, "-np", "2", "--no-dashboard") as s:
        yield s


ASK = "What is the weather in Paris?"


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_required_always_gives_a_call_that_follows_the_schema(server: Server, seed: int) -> None:
    payload = chat(
        ASK, tools=TOOLS, tool_choice="required", max_tokens=120, temperature=1.0, seed=seed
    )
    r = server.post(CHAT, payload)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    check_call(call)


def test_a_named_function_is_the_one_called(server: Server) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    payload = chat(ASK, tools=TOOLS, tool_choice=named, max_tokens=80, temperature=0)
    choice = server.post(CHAT, payload).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_time"
    check_call(call)


def test_auto_answers_text_or_a_call(server: Server) -> None:
    choice = server.post(CHAT, chat(ASK, tools=TOOLS, max_tokens=60, temperature=0)).json()
    choice = choice["choices"][0]
    if choice["finish_reason"] == "tool_calls":
        check_call(choice["message"]["tool_calls"][0])
    else:
        assert isinstance(choice["message"]["content"], str)
        assert "tool_calls" not in choice["message"]


def test_a_round_trip_with_the_calls_result_is_answered(server: Server) -> None:
    first = server.post(
        CHAT, chat(ASK, tools=TOOLS, tool_choice="required", max_tokens=80, temperature=0)
    ).json()["choices"][0]["message"]
    (call,) = first["tool_calls"]
    messages = [
        {"role": "user", "content": ASK},
        first,
        {"role": "tool", "tool_call_id": call["id"], "content": "18 degrees, sunny"},
    ]
    r = server.post(
        CHAT,
        {"messages": messages, "tools": TOOLS, "tool_choice": "none", "max_tokens": 30},
    )
    assert r.status_code == 200, r.text
    answer = r.json()["choices"][0]
    assert answer["finish_reason"] in ("stop", "length") and answer["message"]["content"]


def test_a_streamed_call_reassembles_to_the_whole_one(server: Server) -> None:
    """The call's pieces make the whole one; with vLLM's `continuous_usage_stats` each chunk
    the call's reader writes carries the usage so far, the last one's the usage chunk's."""
    payload = chat(ASK, tools=TOOLS, tool_choice="required", max_tokens=120, temperature=0)
    whole = server.post(CHAT, payload).json()["choices"][0]["message"]["tool_calls"][0]
    options = {"include_usage": True, "continuous_usage_stats": True}
    streamed = {**payload, "stream": True, "stream_options": options}
    with httpx.stream("POST", server.url + CHAT, json=streamed, timeout=HANG_S) as r:
        assert r.status_code == 200
        events = [e for e in sse_events(r) if e != "[DONE]"]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    pieces = [p for d in deltas for p in d.get("tool_calls", [])]
    assert (
        pieces[0]["id"].startswith("call_")
        and pieces[0]["function"]["name"] == whole["function"]["name"]
    )
    arguments = "".join(p["function"].get("arguments", "") for p in pieces)
    assert arguments == whole["function"]["arguments"]  # greedy: the same call
    assert len(pieces) > 2  # the arguments came in pieces, as they were written
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert not any(d.get("content") for d in deltas)
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert counts == sorted(counts) and events[-2]["usage"] == events[-1]["usage"]
    assert events[-1]["choices"] == [] and counts[0] == 0 < counts[-1]


def test_openais_client_reads_the_call(server: Server) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    completion = client.chat.completions.create(
        model=server.get("/v1/models")["data"][0]["id"],
        messages=[{"role": "user", "content": ASK}],
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=80,
        temperature=0,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_weather"
    check_weather(json.loads(call.function.arguments))
