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
from llmrun.runners.serving.api_models import ChatBody
from llmrun.runners.serving.tools import GENERIC, HERMES, ToolPlan, merged, template_family

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


def hermes_plan(forced: bool) -> ToolPlan:
    body = ChatBody.model_validate(
        {
            "messages": [{"role": "user", "content": "x"}],
            "tools": [WEATHER],
            "tool_choice": "required" if forced else "auto",
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


# ---- rendered by the template, and served ------------------------------------------------------


def test_the_template_renders_the_tools_and_the_conversations_calls(qwen_model: str) -> None:
    runner = LlamaCppRunner(qwen_model, EngineConfig(n_ctx=1024))
    try:
        runner.load()
        call = {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'},
        }
        body = ChatBody.model_validate(
            {
                "messages": [
                    {"role": "user", "content": "Weather in Oslo?"},
                    {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "-3 degrees"},
                ],
                "tools": [WEATHER],
            }
        )
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
