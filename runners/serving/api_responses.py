"""The JSON `llmrun serve` answers with, as pydantic models: OpenAI's shapes (chat completions,
completions, their stream chunks, models, errors) and llama-server's (/health, /props,
/tokenize), with `timings` (RequestTimings.to_dict: llmrun's names and llama-server's) beside
them.

Each model's fields are in the order they go on the wire; `wire()` gives the JSON object
(None kept as null, as OpenAI sends it).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel

from .api_engine import RequestTimings


class Wire(BaseModel):
    def wire(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def json_text(self) -> str:
        """The JSON text, as the standard library writes it (floats included)."""
        return json.dumps(self.wire(), ensure_ascii=False, separators=(",", ":"))


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int  # the HTTP status, as llama-server has it (OpenAI's own is a string or null)


class ErrorBody(Wire):
    error: ErrorDetail


def error_body(status: int, message: str, kind: str, param: str | None = None) -> ErrorBody:
    return ErrorBody(error=ErrorDetail(message=message, type=kind, param=param, code=status))


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, t: RequestTimings) -> Usage:
        return cls.counts(t.prompt_tokens, t.completion_tokens, t.reused_tokens)

    @classmethod
    def counts(cls, prompt: int, completion: int, cached: int) -> Usage:
        return cls(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ToolCallsMessage(BaseModel):
    """An answer that calls a tool (tools.py): `content` null unless text came with the call."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[dict[str, Any]]


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage | ToolCallsMessage
    finish_reason: str
    logprobs: dict[str, Any] | None = None  # logprobs.chat_content


class TextChoice(BaseModel):
    """A completion's choice, whole or as a stream chunk's (`finish_reason` null until the end)."""

    index: int = 0
    text: str
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None  # logprobs.legacy


class ChunkChoice(BaseModel):
    """A chat stream chunk's choice: `delta` holds `role` in the first chunk, `content` in
    those that carry text (or `tool_calls`, tools.py), nothing in the last."""

    index: int = 0
    delta: dict[str, Any]
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None  # logprobs.chat_content


class Head(BaseModel):
    id: str
    object: str
    created: int
    model: str


class ChatCompletion(Head, Wire):
    choices: list[ChatChoice]
    usage: Usage
    timings: dict[str, Any]


class TextCompletion(Head, Wire):
    choices: list[TextChoice]
    usage: Usage
    timings: dict[str, Any]


class Chunk(Head, Wire):
    choices: list[ChunkChoice | TextChoice]
    # vLLM's `continuous_usage_stats`: the usage so far; left out of the JSON when not asked
    usage: Usage | None = None

    def _left_out(self) -> set[str] | None:
        return {"usage"} if self.usage is None else None

    def wire(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude=self._left_out())

    def json_text(self) -> str:
        if type(self) is Chunk and all(c.logprobs is None for c in self.choices):
            # one per token: no floats, pydantic's writer gives the same text
            return self.model_dump_json(exclude=self._left_out())
        return super().json_text()


class LastChunk(Chunk):
    """The chunk with the finish reason, and the request's timings."""

    timings: dict[str, Any]


class UsageChunk(Chunk):
    """`stream_options.include_usage`: no choices, the usage and the timings."""

    usage: Usage
    timings: dict[str, Any]


class ModelMeta(BaseModel):
    n_ctx_per_seq: int
    n_seq: int
    policy: str
    n_params: int | None
    size: int | None


class ModelCard(Wire):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: Literal["llmrun"] = "llmrun"
    meta: ModelMeta


class ModelList(Wire):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(Wire):
    status: Literal["ok"] = "ok"
    slots_idle: int
    slots_processing: int
    queued: int


class GenerationSettings(BaseModel):
    n_ctx: int


class Props(Wire):
    default_generation_settings: GenerationSettings
    total_slots: int
    model_alias: str


class Tokens(Wire):
    tokens: list[int]
