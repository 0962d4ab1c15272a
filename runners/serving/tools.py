"""OpenAI's `tools` and `tool_choice` in `llmrun serve`, as llama-server serves them for a model
whose chat template has no tool syntax of its own (its "generic" format).

The tools are written into the system message (appended to the first one, or a new first one):
what they are, as JSON, and the one way to call one, an answer that is only the JSON object
`{"name": NAME, "arguments": {...}}`. Then:

- `tool_choice` "none" (the default without tools): no tools in the prompt, nothing parsed;
- "auto" (the default with tools): the answer is free; it is a call when the whole answer,
  stripped of whitespace, is one JSON object with exactly the keys `name` (a listed tool's) and
  `arguments` (an object). Anything else is the answer's text;
- "required", or `{"type": "function", "function": {"name": NAME}}`: the answer is constrained by
  a llama.cpp grammar to that object, `arguments` following the tool's `parameters` schema (the
  grammar of grammar.py's converter, whose unsupported keywords are refused by name).

One answer makes at most one call in this format (`parallel_tool_calls` is accepted).
A call is answered as `message.tool_calls` with finish_reason `tool_calls`; streamed, as one
`delta.tool_calls` with the id and the name, then the arguments in pieces as they are written.

A conversation may carry the calls back: an assistant message's `tool_calls` are written as the
same JSON object in its content, and a `tool` message becomes a user message whose content is
`{"tool_response": {"tool_call_id": ID, "name": NAME, "content": TEXT}}` (llama-server's
polyfill for templates without a tool role).

A chat template with tool syntax of its own is used instead where llmrun knows its call format:
the Hermes format (Qwen2.5, Hermes 2/3, SmolLM3, ...), a template that renders `tools` and writes
calls as JSON in `<tool_call>` blocks (a `"name"` key inside one). Other `<tool_call>` syntaxes
(Qwen3-Coder's `<function=NAME>` with XML parameters, GLM-4.5's `NAME` with `<arg_key>` pairs)
get the generic format. In the Hermes format the tools go to the template (`tools`, as OpenAI
defines them), and for "auto" every `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
block of the answer is a call, in order, the text around them the answer's content (streamed as
it comes until a block starts; the whitespace next to a block is dropped); an answer with a
block that is not such a call (or unclosed) is all content. `parallel_tool_calls` false keeps
the first call only, as OpenAI promises at most one. A forced call is one block, written by the
grammar. A past call is written as that block and a `tool` message keeps its role (the template
renders its `<tool_response>`).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from llmrun.runners.base import ChatMessage
from llmrun.runners.errors import BadRequestError, json_kind
from llmrun.runners.grammar import check_schema, each_schema, schema_grammar

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
GENERIC, HERMES = "generic", "hermes"  # the call formats: llmrun's system message, or <tool_call>
OPEN, CLOSE = "<tool_call>", "</tool_call>"
CHOICES = ("none", "auto", "required")
# Why a JSON escape of half a UTF-16 surrogate pair is refused, in the body or in JSON it holds.
LONE_SURROGATE = (
    "an escape from \\ud800 to \\udfff is half of a UTF-16 surrogate pair: alone, it is no"
    " character"
)
# The text before the arguments in an answer the grammar wrote: `{"name": "f", "arguments": `.
FORCED_HEAD = re.compile(r'^\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]+)"\s*,\s*"arguments"\s*:\s*(?=\S)')
# The end of an answer the grammar wrote: the object's closing brace (held back until the end),
# and in the Hermes format the closing tag, or as much of it as was written yet.
FORCED_TAIL = re.compile(r"\s*\}?\s*$")
_CLOSE_PREFIXES = "|".join(re.escape(CLOSE[:n]) for n in range(len(CLOSE), 0, -1))
HERMES_TAIL = re.compile(rf"\s*\}}?\s*(?:{_CLOSE_PREFIXES})?\s*$")


# A `<tool_call>` ... `</tool_call>` stretch (of a template, or an answer's block), and a JSON
# `name` key written in a template's (`{"name": `, `{\"name\": ` in a string literal, or
# `{'name': ...} | tojson`).
BLOCK = re.compile(re.escape(OPEN) + "(.*?)" + re.escape(CLOSE), re.S)
NAME_KEY = re.compile(r"""\\?["']name\\?["']\s*:""")


def template_family(template: str | None) -> str:
    """The call format a chat template writes: HERMES when it renders `tools` and writes JSON
    calls in `<tool_call>` blocks (a `"name"` key between a `<tool_call>` and its
    `</tool_call>`); GENERIC (llmrun's system message) for any other, such as Qwen3-Coder's and
    GLM-4.5's `<tool_call>` blocks of XML arguments."""
    if not template or not re.search(r"\btools\b", template):
        return GENERIC
    if any(NAME_KEY.search(m.group(1)) for m in BLOCK.finditer(template)):
        return HERMES
    return GENERIC


INSTRUCTIONS = (
    "You can call tools. To call one, answer with only a JSON object"
    ' {"name": <the tool\'s name>, "arguments": <an object of its arguments>}'
    " and nothing else."
)
AUTO = " Otherwise answer as usual."


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict[str, Any]

    def described(self) -> dict[str, Any]:
        about = {"description": self.description} if self.description else {}
        return {"name": self.name, **about, "parameters": self.parameters}


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools ask: the tools offered, and whether a call is forced."""

    tools: tuple[Tool, ...]
    forced: bool  # "required" or a named function: the grammar writes the call
    family: str = GENERIC  # the call format (template_family)
    parallel: bool = True  # `parallel_tool_calls`: false keeps an answer's first call only

    @property
    def names(self) -> set[str]:
        return {t.name for t in self.tools}

    def template_tools(self) -> tuple[dict[str, Any], ...]:
        """The tools for a template that renders them (none: they are in the system message)."""
        if self.family == GENERIC:
            return ()
        return tuple({"type": "function", "function": t.described()} for t in self.tools)

    def with_tools(self, messages: tuple[ChatMessage, ...]) -> tuple[ChatMessage, ...]:
        """The conversation with the tools written into its system message (a template with
        tool syntax renders them itself)."""
        if self.family != GENERIC:
            return messages
        listed = json.dumps([t.described() for t in self.tools], ensure_ascii=False)
        text = INSTRUCTIONS + ("" if self.forced else AUTO) + "\n\nTools: " + listed
        if messages and messages[0].role == "system":
            first = ChatMessage("system", (messages[0].content + "\n\n" + text).lstrip())
            return (first, *messages[1:])
        return (ChatMessage("system", text), *messages)

    def grammar(self) -> str | None:
        """The grammar of a forced call: one of the tools' objects (None: the answer is free)."""
        if not self.forced:
            return None
        options, defs = [], {}
        for i, tool in enumerate(self.tools):
            check_schema(tool.parameters, f"tools.{i}.function.parameters")
            key = f"tool-{i}-arguments"  # the tools' schemas sit in $defs, their refs moved
            defs[key] = _moved_refs(tool.parameters, f"#/$defs/{key}")
            options.append(
                {
                    "type": "object",
                    "properties": {
                        "name": {"const": tool.name},
                        "arguments": {"$ref": f"#/$defs/{key}"},
                    },
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
            )
        _distinct_defs(self.tools)
        schema = {**(options[0] if len(options) == 1 else {"anyOf": options}), "$defs": defs}
        grammar = schema_grammar(schema, "tools")
        if self.family == GENERIC:
            return grammar
        # the object inside the template's block: its root renamed, a new root around it
        # (by \n alone: splitlines() also split at a U+2028 inside a pattern's literal, which
        # made the JSON string the grammar writes hold a raw newline)
        rules = re.sub(r"^root ::=", "tool-call-object ::=", grammar, flags=re.M)
        return f'root ::= "{OPEN}\\n" tool-call-object "\\n{CLOSE}"\n{rules}'

    def reader(self) -> ToolReader:
        return ToolReader(self)


def _moved_refs(schema: Any, prefix: str) -> Any:
    """A copy of the schema with its `#/...` references pointing where it now sits in the
    call's schema (an `enum` or `const` value that looks like one stays as written)."""

    def moved(sub: dict[str, Any]) -> dict[str, Any]:
        ref = sub.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/"):
            sub["$ref"] = prefix + ref[1:]
        return sub

    return each_schema(schema, moved)


def _distinct_defs(tools: tuple[Tool, ...]) -> None:
    """The converter names a referenced rule after the reference's last part: two tools'
    definitions of one name would share a rule."""
    seen: dict[str, str] = {}
    for tool in tools:
        for key in ("$defs", "definitions"):
            for name in tool.parameters.get(key, {}) or {}:
                other = seen.setdefault(name, tool.name)
                if other != tool.name:
                    raise BadRequestError(
                        f"tools: {other} and {tool.name} both define {name!r}; a forced call's"
                        " grammar needs distinct definition names"
                    )


PLANS = 0  # tool plans made in this process (the tests count them: one per request)


def tool_plan(
    tools: Any, choice: Any, family: str = GENERIC, parallel: bool = True
) -> ToolPlan | None:
    """The plan a request's `tools` and `tool_choice` ask for; None when no tool is offered
    (no tools, or "none"). BadRequestError naming what is wrong or not served."""
    global PLANS
    PLANS += 1
    offered = _tools(tools)
    if choice is None:
        choice = "auto" if offered else "none"
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise BadRequestError(
                f"tool_choice: {choice!r} is not one of {', '.join(CHOICES)} or a function"
            )
        if choice == "none":
            return None
        if not offered:
            raise BadRequestError(f"tool_choice: {choice!r} needs tools")
        return ToolPlan(offered, forced=choice == "required", family=family, parallel=parallel)
    if (
        not isinstance(choice, dict)
        or choice.get("type") != "function"
        or not isinstance(choice.get("function"), dict)
        or not isinstance(choice["function"].get("name"), str)
    ):
        raise BadRequestError(
            'tool_choice: "none", "auto", "required" or'
            ' {"type": "function", "function": {"name": ...}}'
        )
    name = choice["function"]["name"]
    chosen = tuple(t for t in offered if t.name == name)
    if not chosen:
        raise BadRequestError(f"tool_choice.function.name: {name!r} is not among the tools")
    return ToolPlan(chosen, forced=True, family=family, parallel=parallel)


def _tools(tools: Any) -> tuple[Tool, ...]:
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise BadRequestError("tools: a list of tools")
    found: list[Tool] = []
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise BadRequestError(f'{where}: only tools of type "function" are served here')
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise BadRequestError(f"{where}.function: an object with a name")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise BadRequestError(f"{where}.function.name: 1 to 64 of a-z, A-Z, 0-9, _ and -")
        if any(t.name == name for t in found):
            raise BadRequestError(f"{where}.function.name: {name!r} is listed twice")
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise BadRequestError(f"{where}.function.description: a string")
        parameters = fn.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise BadRequestError(f"{where}.function.parameters: a JSON schema object")
        strict = fn.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise BadRequestError(f"{where}.function.strict: true or false")
        if strict:  # the arguments are promised to follow the schema: the grammar must keep it
            check_schema(parameters, f"{where}.function.parameters")
        found.append(Tool(name, description, parameters))
    return tuple(found)


# ---- the conversation's calls and results ----------------------------------------------------


def call_text(name: str, arguments: str, family: str = GENERIC) -> str:
    """A call as the model is asked to write it (an assistant message's `tool_calls`)."""
    try:
        value: Any = json.loads(arguments)
    except (ValueError, RecursionError):  # nested past the parser's limit too
        value = arguments
    text = json.dumps({"name": name, "arguments": value}, ensure_ascii=False)
    return text if family == GENERIC else f"{OPEN}\n{text}\n{CLOSE}"


def assistant_calls(calls: Any, where: str) -> list[tuple[str, str, str]]:
    """An assistant message's `tool_calls`: (id, name, arguments) each."""
    if not isinstance(calls, list):
        raise BadRequestError(f"{where}.tool_calls: a list of calls")
    found = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls.{j}"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(call, dict) or not isinstance(fn, dict):
            raise BadRequestError(f"{at}: an object with a function's name and arguments")
        # OpenAI's types, strictly: an id of 5 is no id (null or left out: none given)
        call_id = string_field(call.get("id"), f"{at}.id")
        kind = string_field(call.get("type"), f"{at}.type")
        if kind not in (None, "function"):
            raise refused(f"{at}.type", f'only calls of type "function" are served, not {kind!r}')
        name = string_field(fn.get("name"), f"{at}.function.name")
        if name is None:
            raise refused(f"{at}.function.name", "the name of the function called")
        arguments = fn.get("arguments", "{}")
        if not isinstance(arguments, str):
            raise refused(f"{at}.function.arguments", "a JSON string")
        if not _writable(_json(arguments)):  # the body's gate saw `\\ud800`, a backslash
            raise refused(f"{at}.function.arguments", f"a lone surrogate ({LONE_SURROGATE})")
        found.append((call_id or "", name, arguments))
    return found


def string_field(value: Any, param: str) -> str | None:
    """A field OpenAI types as a string: the string, None when null or left out, else a 400."""
    if value is None or isinstance(value, str):
        return value
    raise refused(param, f"must be a string, not {json_kind(value)}")


def refused(param: str, why: str) -> BadRequestError:
    """A 400 naming the request's field at fault (OpenAI's `param`)."""
    error = BadRequestError(f"{param}: {why}")
    error.param = param
    return error


def _writable(value: Any) -> bool:
    """Whether JSON a string held decodes to text UTF-8 can carry (no lone surrogate)."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    except (ValueError, RecursionError):  # not what call_text writes: it keeps the raw text
        return True
    return True


def tool_result(
    call_id: Any, name: str | None, content: str, where: str, family: str = GENERIC
) -> ChatMessage:
    """A `tool` message, as the user message the template can render (a template with tool
    syntax renders the `tool` role itself)."""
    call_id = string_field(call_id, f"{where}.tool_call_id")
    if not call_id:
        raise refused(f"{where}.tool_call_id", "the id of the call this answers")
    if family != GENERIC:
        return ChatMessage("tool", content)
    answer = {"tool_call_id": call_id, "name": name, "content": content}
    return ChatMessage("user", json.dumps({"tool_response": answer}, ensure_ascii=False))


# ---- the answer ------------------------------------------------------------------------------


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolReader:
    """Reads an answer's text as it arrives: `feed` gives the deltas to send now (each a
    chat delta: `{"content": ...}` or `{"tool_calls": [...]}`), `finish` the rest and the
    finish reason. A whole answer is the same deltas merged (`message`)."""

    plan: ToolPlan
    held: str = ""  # text not sent yet
    free: bool = False  # auto: the answer is text, sent as it comes
    blocks: bool = False  # Hermes auto: a block has begun, the rest is held to the end
    sent_content: bool = False  # Hermes auto: text before the blocks has been sent
    name: str | None = None  # forced: the call's head has been sent
    sent_arguments: int = 0
    call_id: str = field(default_factory=new_call_id)

    def _head(self, name: str, index: int = 0) -> dict[str, Any]:
        self.name = name
        call_id = self.call_id if index == 0 else new_call_id()
        call = {"index": index, "id": call_id, "type": "function"}
        return {"tool_calls": [{**call, "function": {"name": name, "arguments": ""}}]}

    def _arguments(self, text: str, index: int = 0) -> dict[str, Any]:
        self.sent_arguments += len(text)
        return {"tool_calls": [{"index": index, "function": {"arguments": text}}]}

    def _text_until_block(self) -> list[dict[str, Any]]:
        """Hermes "auto": the text before a block is content, sent now; from a block's start
        (or what may be one, and the whitespace before it) the answer is held."""
        if self.blocks:
            return []
        at = self.held.find(OPEN)
        if at >= 0:
            self.blocks = True
        else:  # the longest end of the text that may begin `<tool_call>`
            at = len(self.held) - next(
                (n for n in range(len(OPEN) - 1, 0, -1) if self.held.endswith(OPEN[:n])), 0
            )
        cut = len(self.held[:at].rstrip())
        if cut == 0:
            return []
        text, self.held = self.held[:cut], self.held[cut:]
        self.sent_content = True
        return [{"content": text}]

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self.free:
            return [{"content": text}] if text else []
        self.held += text
        if not self.plan.forced and self.plan.family != GENERIC:
            return self._text_until_block()
        if not self.plan.forced:  # the generic format's "auto": a call is one JSON object
            if self.held.lstrip()[:1] in ("", "{"):
                return []  # maybe a call: held until the end
            self.free, held, self.held = True, self.held, ""
            return [{"content": held}]
        if self.name is not None:
            return self._unsent_arguments()
        head = FORCED_HEAD.match(self._unwrapped(self.held) or "")
        if head is None:
            return []
        self.held = head.string[head.end() :]
        return [self._head(head.group(1)), *self._unsent_arguments()]

    def _unsent_arguments(self) -> list[dict[str, Any]]:
        """A forced call's arguments written since the last delta (none: nothing new)."""
        new = self._body(self.held)[self.sent_arguments :]
        return [self._arguments(new)] if new else []

    def _unwrapped(self, text: str) -> str | None:
        """A forced call's text after the template's opening tag (None: not all of it yet)."""
        if self.plan.family == GENERIC:
            return text
        stripped = text.lstrip()
        return stripped[len(OPEN) :] if stripped.startswith(OPEN) else None

    def _body(self, text: str) -> str:
        """The arguments written so far: the text without the object's closing brace (and the
        template's closing tag)."""
        tail = (FORCED_TAIL if self.plan.family == GENERIC else HERMES_TAIL).search(text)
        return text[: tail.start()] if tail else text

    def finish(self, finish_reason: str) -> tuple[list[dict[str, Any]], str]:
        if self.free:
            return [], finish_reason
        if self.name is not None:  # forced: the call's head and part of it are sent
            deltas = self._unsent_arguments()
            complete = finish_reason == "stop" and isinstance(_json(self._body(self.held)), dict)
            return deltas, "tool_calls" if complete else finish_reason
        if self.plan.family != GENERIC:
            found = _blocks(self.held, self.plan.names) if finish_reason == "stop" else None
            if found is not None:
                after, calls = found
                if not self.plan.parallel:
                    calls = calls[:1]
                deltas = []
                if after:  # text between or after the blocks, after the text already sent
                    deltas.append({"content": ("\n\n" if self.sent_content else "") + after})
                for i, (name, arguments) in enumerate(calls):
                    deltas += [self._head(name, i), self._arguments(arguments, i)]
                return deltas, "tool_calls"
        elif finish_reason == "stop" and (call := _parse_call(self.held, self.plan.names)):
            name, arguments = call
            return [self._head(name), self._arguments(arguments)], "tool_calls"
        return ([{"content": self.held}] if self.held else []), finish_reason  # no call after all


def _blocks(text: str, names: set[str]) -> tuple[str, list[tuple[str, str]]] | None:
    """The calls of the `<tool_call>` blocks in an answer, in order, and the text outside them
    (each stretch stripped, joined by blank lines). None: no block, a block that is not a call
    (`_parse_call` of its inside), or a `<tool_call>` left open."""
    calls, outside, at = [], [], 0
    for block in BLOCK.finditer(text):
        call = _parse_call(block.group(1), names)
        if call is None:
            return None
        calls.append(call)
        outside.append(text[at : block.start()])
        at = block.end()
    outside.append(text[at:])
    if not calls or any(OPEN in piece for piece in outside):
        return None
    return "\n\n".join(p.strip() for p in outside if p.strip()), calls


def _json(text: str) -> Any:
    """The JSON value of a text; None when it is not JSON (or nested past the parser's limit)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _parse_call(text: str, names: set[str]) -> tuple[str, str] | None:
    """The rule for "auto": the whole answer is one JSON object with exactly `name` (a listed
    tool's) and `arguments` (an object)."""
    value = _json(text)
    if (
        isinstance(value, dict)
        and set(value) == {"name", "arguments"}
        and value["name"] in names
        and isinstance(value["arguments"], dict)
    ):
        return value["name"], json.dumps(value["arguments"], ensure_ascii=False)
    return None


def merged(deltas: list[dict[str, Any]]) -> tuple[str | None, list[dict[str, Any]] | None]:
    """A whole answer's content and tool calls, from the deltas a stream would have sent."""
    content: list[str] = []
    calls: list[dict[str, Any]] = []
    for delta in deltas:
        if "content" in delta:
            content.append(delta["content"])
        for piece in delta.get("tool_calls", []):
            fn = piece["function"]
            if "id" in piece:
                calls.append(
                    {"id": piece["id"], "type": "function", "function": {**fn, "arguments": ""}}
                )
            calls[piece["index"]]["function"]["arguments"] += fn.get("arguments", "")
    if calls:
        return ("".join(content) or None), calls
    return "".join(content), None
