"""The HTTP plumbing of `llmrun serve` below its routes: reading a body within its limits, the one
gate every JSON body passes (pydantic, with one line per error), OpenAI's error shape, server-sent
events that end when the client goes, and `Metering`, which counts and logs every response of
every route once, under its route.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import anyio
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmrun.runners.errors import json_kind, long_integer
from llmrun.runners.lists import whole

from .api_access import absolute_form
from .api_engine import RequestTimings
from .api_responses import Wire, error_body
from .tools import LONE_SURROGATE

RETRY_AFTER_S = 1
BODY_IDLE_S = 30.0  # the longest wait for the next piece of a request's body
MIN_BODY_LIMIT = 1 << 20
BODY_BYTES_PER_TOKEN = 64  # JSON of one context token, generously: escapes, token id lists
BOM = b"\xef\xbb\xbf"
DRAIN_BYTES = MIN_BODY_LIMIT  # read of a refused request's body, so the client reads the answer
DRAIN_IDLE_S = 5.0
MAX_NOTE_CHARS = 300  # of a client's words in one log line

# The routes /metrics and the log name, by path (without a trailing slash); any other: `other`.
ROUTES = {
    "/v1/chat/completions": "chat",
    "/chat/completions": "chat",
    "/v1/completions": "completions",
    "/completions": "completions",
    "/v1/models": "models",
    "/models": "models",
    "/health": "health",
    "/metrics": "metrics",
    "/props": "props",
    "/tokenize": "tokenize",
}
MODEL_PATHS = ("/v1/models/", "/models/")
GENERATING = ("chat", "completions")  # every answer logged; other routes only their errors
HTTP_OUTCOMES = {
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    408: "timeout",
    413: "too_large",
    415: "bad_request",
    431: "too_large",
    499: "cancelled",
    503: "too_many_connections",
    505: "bad_request",  # a client's HTTP/2.0 request line: its fault, not the server's
}


def route_of(path: str) -> str:
    """The route a path belongs to, for /metrics' `route` label and the log."""
    absolute = absolute_form(path)  # `http://host/v1/models`: its path names the route
    if absolute is not None:
        path = absolute[2]
    path = path.rstrip("/") or "/"
    return ROUTES.get(path, "models" if path.startswith(MODEL_PATHS) else "other")


def outcome_of(status: int) -> str:
    if status < 400:
        return "ok"
    return HTTP_OUTCOMES.get(status, "error" if status >= 500 else "bad_request")


def body_limit(n_ctx: int) -> int:
    """The largest request body served: what a prompt filling the context could need."""
    return max(MIN_BODY_LIMIT, BODY_BYTES_PER_TOKEN * n_ctx)


def printable(text: str) -> str:
    """A client's words as the log may print them: control characters escaped, so a path or
    a model name cannot move the terminal's cursor, and cut short, so a 60 kB path or Host
    header is not a 60 kB log line."""
    if len(text) > MAX_NOTE_CHARS:
        text = f"{text[:MAX_NOTE_CHARS]}... ({len(text):,} characters)"
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


# ---- what each response counts as --------------------------------------------------------------


@dataclass
class Report:
    """What a route says of its answer beyond the HTTP status, for /metrics and the log: a
    finer outcome (`busy`, `cancelled`), the status the log shows where the stream's 200
    ended otherwise (499, 500, 503), the request's timings, and a note."""

    outcome: str | None = None
    status: int | None = None
    timings: RequestTimings | None = None
    note: str = ""

    def set(
        self,
        outcome: str,
        note: str = "",
        *,
        status: int | None = None,
        timings: RequestTimings | None = None,
    ) -> None:
        self.outcome, self.note, self.status, self.timings = outcome, note, status, timings


REPORT = "llmrun.report"


def report(request: HttpRequest) -> Report:
    """The report of this request's answer (Metering put it in the request's scope)."""
    found = request.scope.get(REPORT)
    return found if isinstance(found, Report) else Report()


Record = Callable[[str, int, Report], None]


class Metering:
    """ASGI middleware around everything else: each response is counted and logged once, under
    the route of its path (`record(route, status, report)`), whichever layer answered it
    (access checks, routing, a route, the error handlers). A fault that escapes the app is
    recorded as a 500 without uvicorn's traceback. `in_flight` counts the requests not yet
    answered, for the drain at shutdown."""

    def __init__(self, app: ASGIApp, record: Record) -> None:
        self.app, self.record = app, record
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        seen = Report()
        scope = {**scope, REPORT: seen}
        status = 0

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        self.in_flight += 1
        try:
            await self.app(scope, receive, sending)
        except Exception as e:  # answered already (the 500 handler) or never: one line either way
            if not status:
                status = 500
                error = error_body(500, f"internal error: {type(e).__name__}", "server_error")
                await JSONResponse(error.wire(), status_code=500)(scope, receive, sending)
            if seen.outcome is None:
                seen.set("error", f"{type(e).__name__}: {e}")
        finally:
            self.in_flight -= 1
            self.record(route_of(scope["path"]), status or 499, seen)


# ---- errors and bodies ----------------------------------------------------------------------


def error_response(
    status: int,
    message: str,
    kind: str = "invalid_request_error",
    headers: dict[str, str] | None = None,
    param: str | None = None,
) -> JSONResponse:
    """OpenAI's error shape (with llama-server's numeric `code`); `param` names the field."""
    body = error_body(status, message, kind, param).wire()
    return JSONResponse(body, status_code=status, headers=headers)


class BodyError(Exception):
    """A request body refused before it is parsed: too large (413), too slow (408), encoded."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def read_body(request: HttpRequest, limit: int, idle_s: float = BODY_IDLE_S) -> bytes:
    """The request's body, refused past `limit` bytes (by its Content-Length before a byte is
    read, or once it is in when chunked) or when no byte arrives for `idle_s` seconds."""
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise BodyError(415, f"Content-Encoding {encoding!r} is not served; send plain JSON")
    size_declared = whole(request.headers.get("content-length") or "")
    if size_declared is not None and size_declared > limit:
        raise BodyError(413, f"the body is {size_declared} bytes; at most {limit} are served")
    chunks, size = [], 0
    stream = request.stream().__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(stream.__anext__(), idle_s)
        except StopAsyncIteration:
            break
        except ClientDisconnect:
            raise BodyError(499, f"the client went away {size} bytes into the body") from None
        except asyncio.TimeoutError:
            raise BodyError(
                408, f"the body stopped arriving ({size} bytes in, none for {idle_s:g} s)"
            ) from None
        size += len(chunk)
        if size > 2 * limit:
            break  # drained enough: the connection closes with the rest unread
        if size <= limit:
            chunks.append(chunk)
    if size > limit:  # read on (up to twice the limit) so the client reads this, not a reset
        raise BodyError(413, f"the body is over {limit} bytes; at most {limit} are served")
    body = b"".join(chunks)
    return body[len(BOM) :] if body.startswith(BOM) else body  # RFC 8259 lets a parser skip it


Body = TypeVar("Body", bound=BaseModel)


async def parse_body(request: HttpRequest, model: type[Body], limit: int) -> Body | JSONResponse:
    """The one gate of every JSON body: read within `limit`, parsed and checked by `model`
    (strict JSON: a lone surrogate, bad UTF-8 or a wrong type is a 400 naming the field); a
    refusal is the error response, reported."""
    try:
        raw = await read_body(request, limit)
    except BodyError as e:
        report(request).set(HTTP_OUTCOMES[e.status], str(e), status=e.status)
        # the rest of the body was not read: the connection cannot carry another request
        return error_response(e.status, str(e), headers={"Connection": "close"})
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        message, param = validation_message(e)
        report(request).set("bad_request", message)
        return error_response(400, message or "invalid request", param=param)


def validation_message(exc: ValidationError) -> tuple[str, str | None]:
    """One line for pydantic's first error, and the field it names: `messages.0.content: not a
    string or an array (a number)`, without pydantic's union branch tags (`.str`, `.list[int]`)."""
    errors = exc.errors()
    first: dict[str, Any] = dict(errors[0]) if errors else {}
    if first.get("type") == "json_invalid":
        said = f"malformed JSON: {first.get('msg', '')}".rstrip(": ")
        if "number out of range" in said:  # valid JSON (RFC 8259 sets no limit): say what it is
            where = said.partition("number out of range")[2].strip()
            return f"the body holds {long_integer()}" + (f" ({where})" if where else ""), None
        if "surrogate" in said or "end of hex escape" in said:  # jiter's words for \ud800 alone
            said += f" ({LONE_SURROGATE})"
        return said, None
    loc = [p for p in first.get("loc", ()) if isinstance(p, int) or not _is_branch_tag(str(p))]
    where = ".".join(str(p) for p in loc)
    branches = {str(p) for e in errors for p in e.get("loc", ())[len(loc) : len(loc) + 1]}
    if not where and first.get("type") == "model_type":
        return f"the body must be a JSON object, not {json_kind(first.get('input'))}", None
    if len([b for b in branches if _is_branch_tag(b)]) > 1:
        inner = _inside_an_object(errors, len(loc))
        if inner is not None:  # the one branch of its shape, wrong in a field inside
            return inner
        kinds = " or ".join(sorted({_tag_kind(b) for b in branches}))
        return (
            f"{where}: must be {kinds}, not {json_kind(first.get('input'), depth=8)}",
            where or None,
        )
    message = f"{where}: {first.get('msg', '')}" if where else str(first.get("msg", ""))
    return message, where or None


def _inside_an_object(errors: list[Any], at: int) -> tuple[str, str] | None:
    """The first error inside an object's field when it is one union branch's alone: the
    value has that branch's shape (`[{"type": "text", "text": 5}]` is an array of objects)
    and fails deeper, at the field the message must name (`messages.0.content.0.text`)."""
    inside = [
        e for e in errors if any(isinstance(p, str) for p in tuple(e.get("loc", ()))[at + 1 :])
    ]
    if not inside or len({e["loc"][at] for e in inside}) > 1:
        return None
    first = inside[0]
    where = ".".join(
        str(p) for p in first["loc"] if isinstance(p, int) or not _is_branch_tag(str(p))
    )
    kind = _ERROR_KINDS.get(str(first.get("type")))
    if kind is None:
        return f"{where}: {first.get('msg', '')}", where
    return f"{where}: must be {kind}, not {json_kind(first.get('input'))}", where


# pydantic's error types of a wrong JSON type, and the kind the field must be
_ERROR_KINDS = {
    "string_type": "a string",
    "int_type": "a whole number",
    "float_type": "a number",
    "bool_type": "a boolean",
    "model_type": "an object",
    "dict_type": "an object",
    "list_type": "an array",
}


def _is_branch_tag(part: str) -> bool:
    return part in ("str", "int", "bool", "float") or "[" in part or part[:1].isupper()


_PLURAL = {
    "str": "strings",
    "int": "whole numbers",
    "float": "numbers",
    "bool": "booleans",
    "list[int]": "arrays of whole numbers",
}


def _tag_kind(tag: str) -> str:
    if tag.startswith("list["):
        item = tag[len("list[") : -1]
        return f"an array of {_PLURAL.get(item, 'objects')}"
    return {
        "str": "a string",
        "int": "a whole number",
        "bool": "a boolean",
        "float": "a number",
    }.get(tag, "an object")


# ---- server-sent events -----------------------------------------------------------------------


class EventStream(StreamingResponse):
    """Server-sent events whose generator is cancelled as soon as the client disconnects (not
    at the next write), so its sequence is freed at once."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as group:

            async def until_done(work: Callable[[], Any]) -> None:
                await work()
                group.cancel_scope.cancel()

            group.start_soon(until_done, partial(self.stream_response, send))
            await until_done(partial(self.listen_for_disconnect, receive))


def sse(event: Wire) -> str:
    return f"data: {event.json_text()}\n\n"


SSE_DONE = "data: [DONE]\n\n"


# ---- refusals before any route ------------------------------------------------------------------


async def drain(receive: Receive, limit: int = DRAIN_BYTES, idle_s: float = DRAIN_IDLE_S) -> None:
    """Read (and drop) a refused request's body, up to `limit` bytes: a socket closed with
    unread bytes is reset, and the client would read the reset instead of the answer."""
    size = 0
    while size <= limit:
        try:
            message = await asyncio.wait_for(receive(), idle_s)
        except asyncio.TimeoutError:
            return
        if message["type"] != "http.request":
            return
        size += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


def refusal(
    status: int,
    message: str,
    *,
    outcome: str,
    kind: str = "invalid_request_error",
    headers: dict[str, str] | None = None,
    close: bool = False,
) -> ASGIApp:
    """An ASGI app that refuses the request before any route, in OpenAI's error shape (Metering
    counts and logs it)."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen = scope.get(REPORT)
        if isinstance(seen, Report):
            seen.set(outcome, message)
        if close:
            await drain(receive)
        extra = {**(headers or {}), **({"Connection": "close"} if close else {})}
        await error_response(status, message, kind, headers=extra or None)(scope, receive, send)

    return app
