"""Tools through a chat template's own tool syntax: the Hermes format (Qwen2.5 and others).

A copy of the embedded model whose `tokenizer.chat_template` is Qwen2.5's (ChatML, as the
embedded model's own, plus `tools` and `<tool_call>` blocks) is served: the tools are rendered by
the template, not llmrun's system message, a call is read from its `<tool_call>` block, a
forced call is written in that block by the grammar and always parses, and a conversation's
calls and results are rendered as the template writes them.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llmrun.runners.base import SamplingParams
from llmrun.runners.config import EngineConfig
from llmrun.runners.gguf import read_gguf
from llmrun.runners.llamacpp import LlamaCppRunner
from llmrun.runners.prompts import Prompts
from llmrun.runners.serving.api_models import ChatBody
from llmrun.runners.serving.tools import GENERIC, HERMES, ToolPlan, merged, template_family
from llmrun.runners.template import bounded_formatter

from .conftest import HANG_S
from .test_serve import Server, chat, llmrun_serve, serve_env  # noqa: F401  (fixture)

QWEN_TEMPLATE = (Path(__file__).parent / "qwen_tools_template.jinja").read_text()
CHAT = "/v1/chat/completions"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}

# ---- a GGUF with another chat template --------------------------------------------------------

_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


def _skip(data: bytes, pos: int, value_type: int) -> int:
    if value_type in _SCALARS:
        return pos + _SCALARS[value_type]
    if value_type == _STRING:
        return pos + 8 + struct.unpack_from("<Q", data, pos)[0]
    assert value_type == _ARRAY
    item_type, count = struct.unpack_from("<IQ", data, pos)
    pos += 12
    if item_type in _SCALARS:
        return pos + count * _SCALARS[item_type]
    for _ in range(count):
        pos = _skip(data, pos, item_type)
    return pos


def with_chat_template(src: Path, dst: Path, template: str) -> None:
    """A copy of a GGUF file whose `tokenizer.chat_template` is `template` (tensors as they
    are: their offsets count from the data section, which is realigned after the header)."""
    data = src.read_bytes()
    assert data[:4] == b"GGUF"
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", data, 4)
    pos, entries, alignment = 24, [], 32
    for _ in range(n_kv):
        (n,) = struct.unpack_from("<Q", data, pos)
        key = data[pos + 8 : pos + 8 + n].decode()
        start = pos
        value_at = pos + 8 + n
        (value_type,) = struct.unpack_from("<I", data, value_at)
        pos = _skip(data, value_at + 4, value_type)
        if key == "general.alignment":
            (alignment,) = struct.unpack_from("<I", data, value_at + 4)
        if key != "tokenizer.chat_template":
            entries.append(data[start:pos])
    raw = template.encode()
    name = b"tokenizer.chat_template"
    entries.append(
        struct.pack("<Q", len(name)) + name + struct.pack("<IQ", _STRING, len(raw)) + raw
    )
    infos_start = pos
    for _ in range(n_tensors):
        (n,) = struct.unpack_from("<Q", data, pos)
        pos += 8 + n
        (n_dims,) = struct.unpack_from("<I", data, pos)
        pos += 4 + 8 * n_dims + 4 + 8
    data_start = pos + (-pos % alignment)
    head = struct.pack("<4sIQQ", b"GGUF", version, n_tensors, len(entries))
    head += b"".join(entries) + data[infos_start:pos]
    head += b"\0" * (-len(head) % alignment)
    with dst.open("wb") as f:
        f.write(head)
        f.write(memoryview(data)[data_start:])


@pytest.fixture(scope="module")
def qwen_model(tmp_path_factory: pytest.TempPathFactory, model_path: str) -> str:
    path = tmp_path_factory.mktemp("qwen") / "SmolLM2-qwen-template.gguf"
    with_chat_template(Path(model_path), path, QWEN_TEMPLATE)
    assert read_gguf(str(path)).chat_template == QWEN_TEMPLATE
    return str(path)


# ---- the format (no model) --------------------------------------------------------------------


def test_a_template_that_renders_tools_and_tool_call_blocks_is_hermes(model_file: str) -> None:
    assert template_family(QWEN_TEMPLATE) == HERMES
    assert template_family(read_gguf(model_file).chat_template) == GENERIC
    assert template_family(None) == GENERIC


def hermes_plan(forced: bool, parallel: bool | None = None) -> ToolPlan:
    body = ChatBody.model_validate(
        {
            "messages": [{"role": "user", "content": "x"}],
            "tools": [WEATHER],
            "tool_choice": "required" if forced else "auto",
            "parallel_tool_calls": parallel,
        }
    )
    body.use_tool_format(HERMES)
    plan = body.tool_plan()
    assert plan is not None
    return plan


ANSWER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'


@pytest.mark.parametrize("forced", [True, False])
def test_a_tool_call_block_is_read_whole_or_streamed(forced: bool) -> None:
    for size in (1, 3, 7, len(ANSWER)):
        reader = hermes_plan(forced).reader()
        deltas = [d for i in range(0, len(ANSWER), size) for d in reader.feed(ANSWER[i : i + size])]
        more, finish = reader.finish("stop")
        content, calls = merged(deltas + more)
        assert finish == "tool_calls" and content is None and calls is not None, (size, deltas)
        assert calls[0]["function"]["name"] == "get_weather"
        assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "unit": "celsius"}


def test_auto_text_is_text_and_a_forced_calls_grammar_writes_the_block() -> None:
    reader = hermes_plan(False).reader()
    deltas = reader.feed("It is sunny.")
    assert merged(deltas + reader.finish("stop")[0]) == ("It is sunny.", None)
    grammar = hermes_plan(True).grammar() or ""
    assert grammar.startswith('root ::= "<tool_call>\\n" tool-call-object "\\n</tool_call>"')
    assert "\ntool-call-object ::=" in grammar and "\nroot ::=" not in grammar


# Minimal excerpts of two templates whose `<tool_call>` blocks hold no JSON: their tool sections
# as the real templates write them (Qwen3-Coder's chat_template.jinja, GLM-4.5's).
QWEN3_CODER_TEMPLATE = """\
{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = [] %}
{%- endif %}
{%- if system_message is defined %}
    {{- "<|im_start|>system\n" + system_message }}
{%- endif %}
{%- if tools is iterable and tools | length > 0 %}
    {{- "\n\n# Tools\n\nYou have access to the following functions:\n\n<tools>" }}
    {%- for tool in tools %}
        {%- if tool.function is defined %}
            {%- set tool = tool.function %}
        {%- endif %}
        {{- "\n<function>\n<name>" ~ tool.name ~ "</name>" }}
        {%- set handled_keys = ['name', 'type', 'description'] %}
        {{- '\n</function>' }}
    {%- endfor %}
    {{- "\n</tools>" }}
    {{- '\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n</IMPORTANT>' }}
{%- endif %}
{%- if system_message is defined %}
    {{- '<|im_end|>\n' }}
{%- endif %}
{%- for message in loop_messages %}
    {%- if message.role == "assistant" and message.tool_calls is defined and message.tool_calls is iterable and message.tool_calls | length > 0 %}
        {{- '<|im_start|>' + message.role }}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n<function=' + tool_call.name + '>\n' }}
            {%- if tool_call.arguments is defined %}
                {%- for args_name, args_value in tool_call.arguments|items %}
                    {{- '<parameter=' + args_name + '>\n' }}
                    {%- set args_value = args_value | tojson | safe if args_value is mapping or (args_value is sequence and args_value is not string) else args_value | string %}
                    {{- args_value }}
                    {{- '\n</parameter>\n' }}
                {%- endfor %}
            {%- endif %}
            {{- '</function>\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "user" or message.role == "system" or message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "tool" %}
        {{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response>\n<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""
GLM45_TEMPLATE = """\
[gMASK]<sop>
{%- if tools -%}
<|system|>
# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}
{{ tool | tojson(ensure_ascii=False) }}
{% endfor %}
</tools>

For each function call, output the function name and arguments within the following XML format:
<tool_call>{function-name}
<arg_key>{arg-key-1}</arg_key>
<arg_value>{arg-value-1}</arg_value>
...
</tool_call>{%- endif -%}
{%- for m in messages %}
{%- if m.role == 'user' -%}<|user|>
{{ m.content }}
{%- elif m.role == 'assistant' -%}
<|assistant|>
{{ m.content }}
{%- if m.tool_calls -%}
{% for tc in m.tool_calls %}
{%- if tc.function %}
    {%- set tc = tc.function %}
{%- endif %}
{{ '\\n<tool_call>' + tc.name }}
{% set _args = tc.arguments %}
{% for k, v in _args.items() %}
<arg_key>{{ k }}</arg_key>
<arg_value>{{ v | tojson(ensure_ascii=False) if v is not string else v }}</arg_value>
{% endfor %}
</tool_call>{% endfor %}
{% endif %}
{%- elif m.role == 'tool' -%}
<|observation|>
<tool_response>
{{- m.content }}
</tool_response>
{%- elif m.role == 'system' -%}
<|system|>
{{ m.content }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    <|assistant|>
{%- endif -%}
"""


def round_trip(**fields: Any) -> ChatBody:
    """A conversation with one call of get_weather and its result, offering WEATHER."""
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'},
    }
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 degrees"},
    ]
    return ChatBody.model_validate({"messages": messages, "tools": [WEATHER], **fields})


@pytest.mark.parametrize(
    "template", [QWEN3_CODER_TEMPLATE, GLM45_TEMPLATE], ids=["qwen3-coder", "glm-4.5"]
)
def test_a_tool_call_block_of_xml_arguments_takes_the_generic_format(template: str) -> None:
    assert template_family(template) == GENERIC
    body = round_trip(tool_choice="required")
    body.use_tool_format(template_family(template))
    prompts = Prompts(
        lambda: bounded_formatter(template, eos_token="", bos_token=""), lambda *_: []
    )
    text = prompts.render(body.request(SamplingParams()))
    assert "You can call tools" in text and '"name": "get_weather"' in text  # llmrun's
    assert "<tool_call>" not in text and "<tools>" not in text  # not the template's
    assert '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}' in text
    assert '"tool_response": {"tool_call_id": "call_1"' in text
    grammar = body.grammar() or ""
    assert "root ::=" in grammar and "tool_call" not in grammar  # the bare JSON object


def test_a_template_writing_json_in_its_blocks_from_a_dict_is_hermes() -> None:
    template = (
        "{% for t in tools %}{{ t | tojson }}{% endfor %}{% for m in messages %}"
        "{% for c in m.tool_calls %}<tool_call>\n"
        "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n"
        "</tool_call>{% endfor %}{% endfor %}"
    )
    assert template_family(template) == HERMES


def read(plan: ToolPlan, answer: str, size: int, finish: str = "stop") -> tuple[Any, Any, str]:
    reader = plan.reader()
    deltas = [d for i in range(0, len(answer), size) for d in reader.feed(answer[i : i + size])]
    more, reason = reader.finish(finish)
    content, calls = merged(deltas + more)
    return content, calls, reason


SIZES = (1, 2, 5, 11, 1000)
LEAD = "Let me check the weather for you.\n\n"
SECOND = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima", "unit": "fahrenheit"}}\n</tool_call>'


@pytest.mark.parametrize("size", SIZES)
def test_text_before_a_block_is_content_and_the_block_a_call(size: int) -> None:
    content, calls, reason = read(hermes_plan(False), LEAD + ANSWER, size)
    assert reason == "tool_calls" and content == LEAD.strip()
    assert calls is not None and len(calls) == 1
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "unit": "celsius"}


def test_text_before_a_block_is_streamed_before_the_answer_ends() -> None:
    reader = hermes_plan(False).reader()
    assert reader.feed("Let me check <tool") == [{"content": "Let me check"}]
    assert reader.feed("_call>\n{") == []  # held: a block has begun


@pytest.mark.parametrize("size", SIZES)
def test_several_blocks_are_several_calls_in_order(size: int) -> None:
    content, calls, reason = read(hermes_plan(False), LEAD + ANSWER + "\n" + SECOND, size)
    assert reason == "tool_calls" and content == LEAD.strip()
    assert calls is not None and [c["function"]["name"] for c in calls] == ["get_weather"] * 2
    assert [json.loads(c["function"]["arguments"])["city"] for c in calls] == ["Paris", "Lima"]
    assert len({c["id"] for c in calls}) == 2


@pytest.mark.parametrize("size", SIZES)
def test_parallel_tool_calls_false_keeps_the_first_call(size: int) -> None:
    content, calls, reason = read(hermes_plan(False, parallel=False), ANSWER + SECOND, size)
    assert reason == "tool_calls" and content is None
    assert calls is not None and len(calls) == 1
    assert json.loads(calls[0]["function"]["arguments"])["city"] == "Paris"


@pytest.mark.parametrize(
    "answer",
    [
        LEAD + ANSWER.replace("get_weather", "get_time"),  # not a listed tool
        ANSWER + SECOND.replace("}}\n", "}\n"),  # a block that is not JSON
        LEAD + ANSWER[: -len("</tool_call>")],  # left open
        ANSWER + "<tool_call>",
        "Use <tool_call> tags, I was told.",
    ],
)
def test_an_answer_with_a_block_that_is_no_call_is_all_content(answer: str) -> None:
    for size in SIZES:
        assert read(hermes_plan(False), answer, size) == (answer, None, "stop")


def test_a_cut_answer_is_content_and_plain_text_is_sent_whole() -> None:
    assert read(hermes_plan(False), LEAD + ANSWER, 3, "length") == (LEAD + ANSWER, None, "length")
    text = "A < b, and <tool is a word.  "
    for size in SIZES:
        assert read(hermes_plan(False), text, size) == (text, None, "stop")


# ---- rendered by the template, and served ------------------------------------------------------


def test_the_template_renders_the_tools_and_the_conversations_calls(qwen_model: str) -> None:
    runner = LlamaCppRunner(qwen_model, EngineConfig(n_ctx=1024))
    try:
        runner.load()
        body = round_trip()
        body.use_tool_format(template_family(runner.chat_template()))
        text = runner.render(body.request(SamplingParams()))
    finally:
        runner.close()
    assert "<tools>\n" + json.dumps(WEATHER) in text
    assert "You can call tools" not in text  # not llmrun's generic system message
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"' in text
    assert "<|im_start|>user\n<tool_response>\n-3 degrees\n</tool_response><|im_end|>" in text


@pytest.fixture(scope="module")
def server(serve_env: dict[str, str], qwen_model: str) -> Iterator[Server]:  # noqa: F811
    with llmrun_serve(serve_env, "-m", qwen_model, "--no-dashboard") as s:
        yield s


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_required_always_gives_a_block_that_parses(server: Server, seed: int) -> None:
    body = chat(
        "What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        temperature=1.0,
        seed=seed,
        max_tokens=100,
    )
    r = server.post(CHAT, body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    arguments: dict[str, Any] = json.loads(call["function"]["arguments"])
    assert call["function"]["name"] == "get_weather"
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")


def test_a_streamed_forced_call_reassembles(server: Server) -> None:
    import httpx2 as httpx

    from .test_serve import sse_events

    body = chat(
        "Weather in Lima?", tools=[WEATHER], tool_choice="required", temperature=0, stream=True
    )
    with httpx.stream("POST", server.url + CHAT, json=body, timeout=HANG_S) as r:
        events = [e for e in sse_events(r) if e != "[DONE]"]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    _, calls = merged([d for d in deltas if "tool_calls" in d])
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert calls is not None and calls[0]["function"]["name"] == "get_weather"
    assert set(json.loads(calls[0]["function"]["arguments"])) == {"city", "unit"}
