"""The OpenAI request bodies `llmrun serve` accepts, and their translation into llmrun's types.

pydantic checks the shapes and types (strictly: "5" is not a number, true is not a count);
the ranges are checked by `limits.check_sampling`, the gate every other source of sampling
values goes through, so a value `llmrun run` refuses is refused here with the same words.
Fields other servers take and llmrun does not have are accepted only at their neutral value;
`null` means the default for every optional field, as in OpenAI's schema. A field OpenAI's API
does not define (or one llmrun does not list as accepted) is refused with OpenAI's own words,
`Unrecognized request argument supplied: NAME`.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from llmrun.runners.base import ChatMessage, Request, SamplingParams
from llmrun.runners.errors import BadRequestError
from llmrun.runners.grammar import response_grammar
from llmrun.runners.limits import SAMPLING_SETTINGS, SettingError, check_sampling

from .logprobs import MAX_TOP_CHAT, MAX_TOP_LEGACY
from .tools import (
    GENERIC,
    ToolPlan,
    assistant_calls,
    call_text,
    refused,
    string_field,
    tool_plan,
    tool_result,
)

WHERE = "request"
# Fields whose effect llmrun cannot give: refused when set, never silently dropped.
UNSERVED = {
    "logit_bias": "a logit bias",
    "tools": "function calling (chat completions only)",
    "functions": "legacy function calling (use tools)",
    "grammar": "a grammar",
    "json_schema": "a JSON schema",
    "audio": "audio output",
    "suffix": "a suffix (fill-in-the-middle)",
    "reasoning_effort": "a reasoning effort",
    "verbosity": "a verbosity",
    "prediction": "a predicted output",
    "web_search_options": "web search",
}
# Values of fields llmrun does not have that ask for nothing: accepted, since clients send them.
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "tool_choice": (None, "none", "auto"),
    "function_call": (None, "none", "auto"),
    "parallel_tool_calls": (None, True, False),
    "modalities": (None, ["text"]),
    "echo": (None, False),
    "best_of": (None, 1),
    "store": (None, False),  # nothing is stored here
    "service_tier": (None, "auto", "default"),
}
# Fields of OpenAI's request bodies that ask nothing of the answer (identifiers, bookkeeping):
# accepted at any value.
ACCEPTED = frozenset({"user", "metadata", "prompt_cache_key", "safety_identifier"})
# Stop strings are checked against the text after every token on the engine's thread, which all
# sequences share: their number and length are bounded so one request cannot slow the others.
MAX_STOPS = 16
MAX_STOP_CHARS = 256
# Roles a chat template knows; OpenAI's `developer` is its newer name for `system`.
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


# Every request object: strict JSON types, fields beyond these kept (each route refuses or
# passes them by name), and a float field refuses NaN and a number past the floats (1e999,
# which Python reads as inf): "temperature: Input should be a finite number", not "temperature
# inf is out of range"
REQUEST_JSON = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class StreamOptions(BaseModel):
    """OpenAI's `stream_options`, and vLLM's (and SGLang's) `continuous_usage_stats`.
    `include_obfuscation` pads each event with random characters against length side channels
    on an encrypted link; llmrun serves plain HTTP, whose events anyone on the link reads
    whole, and pads none: false is served, true refused. `continuous_usage_stats` with
    `include_usage` puts the usage so far on every chunk, as vLLM does (without
    `include_usage` vLLM ignores it, and so does llmrun)."""

    model_config = REQUEST_JSON
    include_usage: bool | None = None
    include_obfuscation: bool | None = None
    continuous_usage_stats: bool | None = None

    def check(self) -> None:
        """BadRequestError for a key no server defines, in OpenAI's words for a nested one
        (`Unknown parameter: 'stream_options.x'.`, `param` its whole path; OpenAI names the
        first), or a value not served."""
        unknown = list(self.model_extra or {})
        if unknown:
            param = f"stream_options.{unknown[0]}"
            error = BadRequestError(f"Unknown parameter: '{param}'.")
            error.param = param
            raise error
        if self.include_obfuscation:
            raise refused(
                "stream_options.include_obfuscation",
                "true is not served here (only false): no event is padded, as none could hide"
                " its length on plain HTTP",
            )


class _Body(BaseModel):
    model_config = REQUEST_JSON

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None  # llama.cpp's name
    repetition_penalty: float | None = None  # vLLM's
    repeat_last_n: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    logprobs: bool | int | None = None
    ignore_eos: bool | None = False
    response_format: dict[str, Any] | None = None
    _grammar: tuple[str | None] | None = PrivateAttr(default=None)  # made once per request

    def grammar(self) -> str | None:
        """The GBNF grammar `response_format` asks for (None: free text), made once;
        BadRequestError naming a schema keyword the grammar could not keep."""
        if self._grammar is None:
            self._grammar = (self._made_grammar(),)
        return self._grammar[0]

    def _made_grammar(self) -> str | None:
        return response_grammar(self.response_format)

    def grammar_field(self) -> str:
        """The field the grammar was made from, named when llama.cpp refuses it."""
        return "response_format"

    def echoes(self) -> bool:
        """Legacy completions' `echo`: the prompt's text before the answer's."""
        return False

    def logprob_count(self) -> int | None:
        """None: no log probabilities; else each token's, with this many of the likeliest.
        Legacy completions: `logprobs` is that count, 0..5, as OpenAI has it."""
        n = self.logprobs
        if n is None:
            return None
        if isinstance(n, bool) or not 0 <= n <= MAX_TOP_LEGACY:
            raise BadRequestError(
                f"logprobs: a count of the likeliest tokens to list, 0..{MAX_TOP_LEGACY}"
                f" (not {json.dumps(n)})"
            )
        return n

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's `continuous_usage_stats`: the usage so far on every chunk; only with
        `include_usage`, as vLLM serves it."""
        o = self.stream_options
        return o is not None and bool(o.include_usage) and bool(o.continuous_usage_stats)

    def _limit_field(self) -> str:
        """The field that holds the request's output budget."""
        return "max_tokens"

    def sampling(self, defaults: SamplingParams, think: bool | None = None) -> SamplingParams:
        """The request's sampling: its own values over the server's defaults, checked."""
        if self.n not in (None, 1):
            raise BadRequestError(f"n: only one choice per request is served, not {self.n}")
        self.logprob_count()  # its values are checked with the sampling's
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise BadRequestError(f"{name}: not available here; use repeat_penalty")
        extra = self.model_extra or {}
        unknown = sorted(set(extra) - set(UNSERVED) - set(NEUTRAL) - ACCEPTED)
        if unknown:  # OpenAI's words
            arguments = "argument" if len(unknown) == 1 else "arguments"
            raise BadRequestError(
                f"Unrecognized request {arguments} supplied: {', '.join(unknown)}"
            )
        if self.stream_options is not None:  # checked, and used only when streaming (below)
            self.stream_options.check()
        for name, what in UNSERVED.items():
            value = extra.get(name)
            if value and value != {"type": "text"}:
                raise BadRequestError(f"{name}: {what} is not served here")
        for name, neutral in NEUTRAL.items():
            if name in extra and extra[name] not in neutral:
                raise BadRequestError(
                    f"{name}: {extra[name]!r} is not served here (only"
                    f" {', '.join(map(json.dumps, neutral))})"
                )
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
            raise BadRequestError(
                f"stop: at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters each"
            )
        fields = {  # each setting's field in the request: the first of its HTTP names given
            s.name: next((n for n in s.http if getattr(self, n) is not None), s.http[0])
            for s in SAMPLING_SETTINGS.values()
        }
        fields["max_tokens"] = self._limit_field()
        given: dict[str, Any] = {name: getattr(self, field) for name, field in fields.items()}
        given |= {
            "seed": None if self.seed == -1 else self.seed,  # -1: random, as llama-server
            "stop": None if self.stop is None else tuple(stops),
            "think": think,
        }
        sp = dataclasses.replace(
            defaults,
            ignore_eos=bool(self.ignore_eos),
            **{k: v for k, v in given.items() if v is not None},
        )
        try:
            check_sampling(sp, WHERE)
        except SettingError as e:  # OpenAI names the field in `param`
            e.param = fields.get(e.setting or "")
            raise
        return sp


class ContentPart(BaseModel):
    model_config = REQUEST_JSON
    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = REQUEST_JSON
    role: str
    content: str | list[ContentPart] | None = None

    def chat_message(
        self, i: int, names: dict[str, str] | None = None, family: str = GENERIC
    ) -> ChatMessage:
        """The message for the chat template; what it cannot carry is refused. `names`: the
        tool calls made earlier in the conversation, by id (a `tool` message's name); `family`:
        the template's tool-call format (tools.py)."""
        where = f"messages.{i}"
        extra = self.model_extra or {}
        string_field(extra.get("name"), f"{where}.name")  # the speaker's name: not rendered
        if self.role == "function" or extra.get("function_call"):
            raise BadRequestError(
                f"{where}: legacy function calling is not served here (use tools)"
            )
        if self.role == "tool":
            call_id = extra.get("tool_call_id")
            name = (names or {}).get(call_id) if isinstance(call_id, str) else None
            return tool_result(call_id, name, self._text(where), where, family)
        role = ROLES.get(self.role)
        if role is None:
            raise BadRequestError(
                f"{where}.role: {self.role!r} is not one of {', '.join([*ROLES, 'tool'])}"
            )
        calls = extra.get("tool_calls")
        if calls is not None and role == "assistant":
            found = assistant_calls(calls, where)
            for call_id, name, _ in found:
                if names is not None and call_id:
                    names[call_id] = name
            text = [self._text(where)] if self.content else []
            made = [call_text(n, a, family) for _, n, a in found]
            return ChatMessage(role, "\n".join(text + made))
        if calls is not None:
            raise BadRequestError(f"{where}.tool_calls: only an assistant message makes calls")
        return ChatMessage(role, self._text(where))

    def _text(self, where: str) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for j, part in enumerate(self.content):
            if part.type != "text":
                raise BadRequestError(
                    f"{where}.content.{j}: content of type {part.type!r} is"
                    " not served here (text only)"
                )
            if part.text is None:
                raise BadRequestError(f"{where}.content.{j}: a text part needs its text")
            parts.append(part.text)
        return "".join(parts)


class ChatBody(_Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    _family: str = PrivateAttr(default=GENERIC)
    _plan: tuple[ToolPlan | None] | None = PrivateAttr(default=None)  # made once per request

    def use_tool_format(self, family: str) -> None:
        """The chat template's tool-call format (tools.template_family), which the tools, the
        calls and the grammar of a forced call follow."""
        self._family = family
        self._plan = self._grammar = None

    def tool_plan(self) -> ToolPlan | None:
        """What `tools` and `tool_choice` ask (None: no tool is offered); checked, made once."""
        if self._plan is None:
            self._plan = (self._made_plan(),)
        return self._plan[0]

    def _made_plan(self) -> ToolPlan | None:
        plan = tool_plan(
            self.tools, self.tool_choice, self._family, self.parallel_tool_calls is not False
        )
        if plan is not None:
            if self.response_format not in (None, {"type": "text"}):
                raise BadRequestError("response_format: not served together with tools")
            if self.logprobs:
                raise BadRequestError("logprobs: not served together with tools")
        return plan

    def _made_grammar(self) -> str | None:
        plan = self.tool_plan()
        return super()._made_grammar() if plan is None else plan.grammar()

    def grammar_field(self) -> str:
        return "response_format" if self.tool_plan() is None else "tools"

    def logprob_count(self) -> int | None:
        """OpenAI's chat: `logprobs` true or false, `top_logprobs` 0..20 beside a true one."""
        if self.logprobs is not None and not isinstance(self.logprobs, bool):
            raise BadRequestError(
                "logprobs: true or false in chat completions (top_logprobs gives the count)"
            )
        top = self.top_logprobs
        if top is not None and not 0 <= top <= MAX_TOP_CHAT:
            raise BadRequestError(f"top_logprobs: {top} is not between 0 and {MAX_TOP_CHAT}")
        if not self.logprobs:
            if top:
                raise BadRequestError("top_logprobs: needs logprobs: true")
            return None
        return top or 0

    def _limit_field(self) -> str:
        return "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"

    def request(self, defaults: SamplingParams) -> Request:
        think = (self.chat_template_kwargs or {}).get("enable_thinking")
        if think is not None and not isinstance(think, bool):
            raise BadRequestError("chat_template_kwargs.enable_thinking must be true or false")
        names: dict[str, str] = {}
        family = self._family
        messages = tuple(m.chat_message(i, names, family) for i, m in enumerate(self.messages))
        plan = self.tool_plan()
        tools: tuple[Any, ...] = ()
        if plan is not None:
            messages, tools = plan.with_tools(messages), plan.template_tools()
        return Request(messages=messages, sampling=self.sampling(defaults, think), tools=tools)


class CompletionBody(_Body):
    # OpenAI's four shapes: a string, an array of strings, an array of token ids, or an array of
    # token-id arrays (a batch; lm-evaluation-harness's local-completions sends [[ids]])
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = None

    def echoes(self) -> bool:
        return bool(self.echo)

    def request(self, defaults: SamplingParams) -> Request:
        sampling = self.sampling(defaults)
        prompt: Any = self.prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            if len(prompt) != 1:
                raise BadRequestError(
                    f"prompt: one prompt per request is served, not a list of {len(prompt)}"
                )
            prompt = prompt[0]
        if isinstance(prompt, str):
            return Request(prompt=prompt, sampling=sampling)
        if not prompt:
            raise BadRequestError("prompt is empty")
        return Request(token_ids=tuple(int(t) for t in prompt), sampling=sampling)


class TokenizeBody(BaseModel):
    """llama-server's /tokenize: the text, and whether to add the model's special tokens."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False)
    content: str
    add_special: bool = False
