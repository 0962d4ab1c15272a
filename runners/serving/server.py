"""`llmrun serve`: an OpenAI-compatible HTTP server on the multi-sequence engine.

FastAPI answers on the asyncio loop; the engine runs on its own thread (`EngineThread`) and
hands each request's tokens back through `loop.call_soon_threadsafe`, so neither waits for the
other. Routes: /v1/chat/completions and /v1/completions (streaming or not), /v1/models,
/health, /metrics, and llama-server's /tokenize and /props for clients that count tokens.

Every answer carries `timings` in llmrun's names (`RequestTimings.to_dict`): the final stream
chunk and, with `stream_options.include_usage`, the usage chunk too.

Faults end one request only: a client that disconnects frees its sequence at the next engine
step; a prompt longer than a sequence's context, malformed JSON or a wrong type gets a 400 with
the reason; a full queue a 503 with Retry-After; a body over `body_limit` a 413, one that stops
arriving a 408, a model not served a 404, each in OpenAI's error shape. A connection whose
request headers do not arrive within `HEADERS_TIMEOUT_S` is closed (slowloris); one past
`max_connections` gets a 503 with Retry-After. Before any route, `api_access` refuses foreign
origins and Host names (403) and adds the CORS headers. SIGTERM stops
accepting connections and lets the requests in flight finish (for at most `drain_s`); Ctrl-C
stops at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from types import FrameType
from typing import Any

import anyio
import h11
import uvicorn
from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from llmrun.runners.base import SamplingParams
from llmrun.runners.errors import BadRequestError, LlmrunError, PromptTooLongError
from llmrun.runners.llamacpp import LlamaCppRunner

from .api_access import Access, AccessGuard
from .api_engine import (
    FINISH_CANCELLED,
    Answered,
    Done,
    EngineThread,
    Failed,
    Job,
    Piece,
    QueueFullError,
    RequestTimings,
)
from .api_metrics import CONTENT_TYPE, ServerMetrics
from .api_models import ChatBody, CompletionBody

RETRY_AFTER_S = 1
HEADERS_TIMEOUT_S = 30.0  # from a request's first byte to the end of its headers
BODY_IDLE_S = 30.0  # the longest wait for the next piece of a request's body
MIN_BODY_LIMIT = 1 << 20
BODY_BYTES_PER_TOKEN = 64  # JSON of one context token, generously: escapes, token id lists
BOM = b"\xef\xbb\xbf"
DRAIN_BYTES = MIN_BODY_LIMIT  # read of a refused request's body, so the client reads the answer
DRAIN_IDLE_S = 5.0
OPEN_FILES_SPARE = 128  # files beside the connections: the model, libraries, the listener


def body_limit(n_ctx: int) -> int:
    """The largest request body served: what a prompt filling the context could need."""
    return max(MIN_BODY_LIMIT, BODY_BYTES_PER_TOKEN * n_ctx)


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
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyError(413, f"the body is {int(declared)} bytes; at most {limit} are served")
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


@dataclass
class Served:
    """What the routes share: the model, the engine, the defaults and the measurements."""

    runner: LlamaCppRunner
    engine: EngineThread
    model_id: str
    defaults: SamplingParams
    metrics: ServerMetrics
    created: int = field(default_factory=lambda: int(time.time()))
    log: deque[Answered] = field(default_factory=lambda: deque(maxlen=10000))

    def answered(
        self,
        route: str,
        status: int,
        outcome: str,
        timings: RequestTimings | None = None,
        note: str = "",
    ) -> None:
        self.metrics.answered(route, outcome)
        self.log.append(Answered(route, status, timings, printable(note)))


MAX_NOTE_CHARS = 300  # of a client's words in one log line


def printable(text: str) -> str:
    """A client's words as the log may print them: control characters escaped, so a path or
    a model name cannot move the terminal's cursor, and cut short, so a 60 kB path or Host
    header is not a 60 kB log line."""
    if len(text) > MAX_NOTE_CHARS:
        text = f"{text[:MAX_NOTE_CHARS]}... ({len(text):,} characters)"
    return (
        text
        if text.isprintable()
        else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    )


def error_response(
    status: int,
    message: str,
    kind: str = "invalid_request_error",
    headers: dict[str, str] | None = None,
    param: str | None = None,
) -> JSONResponse:
    """OpenAI's error shape (with llama-server's numeric `code`); `param` names the field."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


HTTP_OUTCOMES = {
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    408: "timeout",
    413: "too_large",
    415: "bad_request",
    499: "cancelled",
    503: "too_many_connections",
}


def _json_type(value: Any) -> str:
    names = {
        dict: "an object",
        list: "an array",
        str: "a string",
        bool: "a boolean",
        int: "a number",
        float: "a number",
        type(None): "null",
    }
    return names.get(type(value), type(value).__name__)


def validation_message(exc: ValidationError) -> tuple[str, str | None]:
    """One line for pydantic's first error, and the field it names: `messages.0.content: not a
    string or an array (a number)`, without pydantic's union branch tags (`.str`, `.list[int]`)."""
    errors = exc.errors()
    first: dict[str, Any] = dict(errors[0]) if errors else {}
    if first.get("type") == "json_invalid":
        return f"malformed JSON: {first.get('msg', '')}".rstrip(": "), None
    loc = [p for p in first.get("loc", ()) if isinstance(p, int) or not _is_branch_tag(str(p))]
    where = ".".join(str(p) for p in loc)
    branches = {str(p) for e in errors for p in e.get("loc", ())[len(loc) : len(loc) + 1]}
    if not where and first.get("type") == "model_type":
        return f"the body must be a JSON object, not {_json_type(first.get('input'))}", None
    if len([b for b in branches if _is_branch_tag(b)]) > 1:
        kinds = " or ".join(sorted({_tag_kind(b) for b in branches}))
        return f"{where}: must be {kinds}, not {_json_type(first.get('input'))}", where or None
    message = f"{where}: {first.get('msg', '')}" if where else str(first.get("msg", ""))
    return message, where or None


def _is_branch_tag(part: str) -> bool:
    return part in ("str", "int", "bool", "float") or "[" in part or part[:1].isupper()


def _tag_kind(tag: str) -> str:
    if tag.startswith("list["):
        return "an array"
    return {
        "str": "a string",
        "int": "a whole number",
        "bool": "a boolean",
        "float": "a number",
    }.get(tag, "an object")


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


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _usage(t: RequestTimings) -> dict[str, Any]:
    return {
        "prompt_tokens": t.prompt_tokens,
        "completion_tokens": t.output_tokens,
        "total_tokens": t.prompt_tokens + t.output_tokens,
        "prompt_tokens_details": {"cached_tokens": t.reused_tokens},
    }


async def _disconnected(request: HttpRequest) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(served: Served) -> FastAPI:
    app = FastAPI(
        title="llmrun serve",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        redirect_slashes=False,
    )  # api_access strips a trailing slash: no 307
    n_ctx = served.engine.n_ctx_per_seq

    limit = body_limit(n_ctx)
    names = served_names(served.model_id)

    def invalid(route: str, exc: ValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        served.answered(route, 400, "bad_request", note=message)
        return error_response(400, message or "invalid request", param=param)

    async def complete(request: HttpRequest, chat: bool) -> Any:
        received = time.perf_counter()
        route = "chat" if chat else "completions"
        try:
            raw = await read_body(request, limit)
        except BodyError as e:
            served.answered(route, e.status, HTTP_OUTCOMES[e.status], note=str(e))
            # the rest of the body was not read: the connection cannot carry another request
            return error_response(e.status, str(e), headers={"Connection": "close"})
        try:
            body: ChatBody | CompletionBody = (
                ChatBody if chat else CompletionBody
            ).model_validate_json(raw)
        except ValidationError as e:
            return invalid(route, e)
        if body.model not in names:
            message = (
                f"model {body.model!r} is not served here; /v1/models lists {served.model_id!r}"
            )
            served.answered(route, 404, "not_found", note=message)
            return error_response(404, message, "model_not_found", param="model")
        try:
            req = body.request(served.defaults)
            tokens = await run_in_threadpool(served.runner.request_tokens, req)
            if req.token_ids is not None:
                n_vocab = served.runner.vocab_size()
                bad = next((t for t in tokens if not 0 <= t < n_vocab), None)
                if bad is not None:
                    raise BadRequestError(
                        f"prompt: token {bad} is not in the vocabulary (0..{n_vocab - 1})"
                    )
            if len(tokens) + 1 > n_ctx:
                raise PromptTooLongError(len(tokens), n_ctx)
        except LlmrunError as e:  # the request's own fault: bad values, template, length
            message = " ".join(str(e).split())
            if isinstance(e, PromptTooLongError):
                message += " (the context of one sequence: -c/--ctx)"
            served.answered(route, 400, "bad_request", note=message)
            return error_response(400, message)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Piece | Done | Failed] = asyncio.Queue()

        def sink(event: Piece | Done | Failed) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed: Ctrl-C, nobody listens
                loop.call_soon_threadsafe(queue.put_nowait, event)

        job = Job(tuple(tokens), req.sampling, received_s=received, sink=sink)
        try:
            served.engine.submit(job)
        except QueueFullError as e:
            served.answered(route, 503, "busy", note=str(e))
            return error_response(
                503, f"{e}; retry later", "server_busy", headers={"Retry-After": str(RETRY_AFTER_S)}
            )
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        head = {
            "id": ident,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": served.model_id,
        }

        def choice(text: str | None, finish: str | None) -> dict[str, Any]:
            if chat:
                delta = {} if text is None else {"content": text}
                return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            return {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}

        if body.stream:
            return EventStream(
                stream(job, queue, head, choice, route, body.include_usage),
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return await whole(request, job, queue, head, route, chat)

    async def stream(
        job: Job,
        queue: asyncio.Queue[Piece | Done | Failed],
        head: dict[str, Any],
        choice: Callable[[str | None, str | None], dict[str, Any]],
        route: str,
        include_usage: bool,
    ) -> AsyncIterator[str]:
        ended = False
        try:
            if head["object"] == "chat.completion.chunk":
                first = {**choice("", None), "delta": {"role": "assistant", "content": ""}}
                yield _sse({**head, "choices": [first]})
            while True:
                event = await queue.get()
                if isinstance(event, Piece):
                    yield _sse({**head, "choices": [choice(event.text, None)]})
                    continue
                ended = True
                if isinstance(event, Failed):
                    served.answered(route, 500, "error", note=event.message)
                    yield _sse(
                        {"error": {"message": event.message, "type": "server_error", "code": 500}}
                    )
                    return
                t = event.timings
                if event.tail:
                    yield _sse({**head, "choices": [choice(event.tail, None)]})
                yield _sse(
                    {**head, "choices": [choice(None, event.finish_reason)], "timings": t.to_dict()}
                )
                if include_usage:
                    yield _sse({**head, "choices": [], "usage": _usage(t), "timings": t.to_dict()})
                yield "data: [DONE]\n\n"
                served.answered(route, 200, "ok", t)
                return
        finally:
            if not ended:  # the client went away: free its sequence now
                served.engine.cancel(job)
                served.answered(route, 499, "cancelled", note="client disconnected")

    async def whole(
        request: HttpRequest,
        job: Job,
        queue: asyncio.Queue[Piece | Done | Failed],
        head: dict[str, Any],
        route: str,
        chat: bool,
    ) -> Response:
        async def collect() -> tuple[str, Done | Failed]:
            parts = []
            while True:
                event = await queue.get()
                if isinstance(event, Piece):
                    parts.append(event.text)
                else:
                    return "".join(parts) + (event.tail if isinstance(event, Done) else ""), event

        waiter, gone = (
            asyncio.ensure_future(collect()),
            asyncio.ensure_future(_disconnected(request)),
        )
        try:
            await asyncio.wait({waiter, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not waiter.done():
                waiter.cancel()
                served.engine.cancel(job)
                served.answered(route, 499, "cancelled", note="client disconnected")
        if not waiter.done() or waiter.cancelled():
            return Response(status_code=499)
        text, event = waiter.result()
        if isinstance(event, Failed):
            served.answered(route, 500, "error", note=event.message)
            return error_response(500, event.message, "server_error")
        t = event.timings
        finish = "stop" if event.finish_reason == FINISH_CANCELLED else event.finish_reason
        result = (
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish,
                "logprobs": None,
            }
            if chat
            else {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        )
        served.answered(route, 200, "ok", t)
        return JSONResponse(
            {
                **head,
                "object": "chat.completion" if chat else "text_completion",
                "choices": [result],
                "usage": _usage(t),
                "timings": t.to_dict(),
            }
        )

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat_completions(request: HttpRequest) -> Any:
        return await complete(request, chat=True)

    @app.post("/v1/completions")
    @app.post("/completions")
    async def completions(request: HttpRequest) -> Any:
        return await complete(request, chat=False)

    def model_card() -> dict[str, Any]:
        loaded = served.runner.load()
        meta = {
            "n_ctx_per_seq": n_ctx,
            "n_seq": served.engine.n_seq,
            "policy": str(served.engine.policy),
            "n_params": loaded.model.n_params,
            "size": loaded.model.size_bytes,
        }
        return {
            "id": served.model_id,
            "object": "model",
            "created": served.created,
            "owned_by": "llmrun",
            "meta": meta,
        }

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    @app.api_route("/models", methods=["GET", "HEAD"])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.api_route("/v1/models/{name:path}", methods=["GET", "HEAD"])
    @app.api_route("/models/{name:path}", methods=["GET", "HEAD"])
    async def one_model(name: str) -> Any:
        if name not in names:
            served.answered("other", 404, "not_found", note=f"model {name!r}")
            return error_response(
                404,
                f"model {name!r} is not served here; /v1/models lists {served.model_id!r}",
                "model_not_found",
            )
        return model_card()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: HttpRequest, exc: StarletteHTTPException) -> Response:
        """Unknown paths and methods in OpenAI's error shape; OPTIONS gets the allowed methods."""
        headers = dict(exc.headers or {})
        if exc.status_code == 405 and request.method == "OPTIONS" and "Allow" in headers:
            return Response(status_code=204, headers={"Allow": headers["Allow"] + ", OPTIONS"})
        outcome = HTTP_OUTCOMES.get(exc.status_code, "bad_request")
        served.answered(
            "other", exc.status_code, outcome, note=f"{request.method} {request.url.path}"
        )
        message = {
            404: f"no route {request.url.path}",
            405: f"{request.method} is not allowed on {request.url.path}"
            + (f" (allowed: {headers['Allow']})" if "Allow" in headers else ""),
        }.get(exc.status_code, str(exc.detail))
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, message, kind, headers=headers or None)

    @app.exception_handler(Exception)
    async def failed(request: HttpRequest, exc: Exception) -> Response:
        """A fault of llmrun's own: OpenAI's shape, never a traceback in the answer."""
        served.answered("other", 500, "error", note=f"{type(exc).__name__}: {exc}")
        return error_response(500, f"internal error: {type(exc).__name__}", "server_error")

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> dict[str, Any]:
        busy = served.engine.busy
        return {
            "status": "ok",
            "slots_idle": served.engine.n_seq - busy,
            "slots_processing": busy,
            "queued": served.engine.queued,
        }

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics() -> Response:
        return Response(served.metrics.text(), media_type=CONTENT_TYPE)

    @app.api_route("/props", methods=["GET", "HEAD"])
    async def props() -> dict[str, Any]:
        return {
            "default_generation_settings": {"n_ctx": n_ctx},
            "total_slots": served.engine.n_seq,
            "model_alias": served.model_id,
        }

    @app.post("/tokenize")
    async def tokenize(request: HttpRequest) -> Any:
        try:
            data = json.loads(await read_body(request, limit))
        except BodyError as e:
            return error_response(e.status, str(e), headers={"Connection": "close"})
        except ValueError:  # UnicodeDecodeError too
            return error_response(400, "malformed JSON")
        content = data.get("content") if isinstance(data, dict) else None
        special = data.get("add_special", False) if isinstance(data, dict) else False
        if not isinstance(content, str) or not isinstance(special, bool):
            return error_response(400, "content: a string is required")
        tokens = await run_in_threadpool(served.runner.tokenize, content, add_special=special)
        return {"tokens": tokens}

    return app


# ---- running it ------------------------------------------------------------------------------


def listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the server starts (so --port 0 names its port, and a
    port in use is one clear error). OSError when it cannot be bound."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's headers: uvicorn times out
    only an idle kept-alive connection, so one that sends half a header line and then a byte
    now and then (slowloris) would hold its socket forever."""

    headers_timeout_s = HEADERS_TIMEOUT_S
    # Told of each request refused here, before the app sees it: (status, what happened).
    on_refused: Callable[[int, str], None] = staticmethod(lambda status, note: None)
    # Connections past this many (this one counted) get `over_capacity` for their requests.
    max_connections: int | None = None
    over_capacity: ASGIApp | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._headers_due: asyncio.TimerHandle | None = None
        self._partial = False  # some of a request's head arrived, not all of it

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()
        cap = self.max_connections
        if cap is not None and self.over_capacity is not None and len(self.connections) > cap:
            self.app = self.over_capacity  # decided at accept: the ones already in keep theirs

    def data_received(self, data: bytes) -> None:
        if self.cycle is None or self.cycle.response_complete:
            self._arm()  # the first bytes of a request: its headers are now due
            self._partial = True
        super().data_received(data)
        if self.cycle is not None and not self.cycle.response_complete:
            self._disarm()  # the headers arrived: the app times the body
            self._partial = False

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._headers_due is None:
            self._headers_due = self.loop.call_later(self.headers_timeout_s, self._too_slow)

    def _disarm(self) -> None:
        if self._headers_due is not None:
            self._headers_due.cancel()
            self._headers_due = None

    def send_400_response(self, msg: str) -> None:
        """Malformed HTTP (a bad request line, header or length, a header block over h11's
        limit): the error in OpenAI's shape rather than uvicorn's plain text."""
        message = f"malformed HTTP request ({msg.rstrip('.').lower()})"
        self.on_refused(400, message)
        body = _error_bytes(400, message)
        headers = [
            (b"content-type", b"application/json"),
            (b"connection", b"close"),
            (b"content-length", b"%d" % len(body)),
        ]
        with contextlib.suppress(h11.LocalProtocolError):
            for event in (
                h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                h11.Data(data=body),
                h11.EndOfMessage(),
            ):
                self.transport.write(self.conn.send(event) or b"")
        self.transport.close()

    def _too_slow(self) -> None:
        self._headers_due = None
        if self.cycle is None or self.cycle.response_complete:
            if self._partial:  # not a connection opened ahead and left idle
                self.on_refused(408, "request headers too slow")
            with contextlib.suppress(Exception):
                self.transport.write(
                    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: "
                    b"application/json\r\nconnection: close\r\n"
                    b"content-length: %d\r\n\r\n%s" % (len(TOO_SLOW), TOO_SLOW)
                )
            self.transport.close()


def _error_bytes(status: int, message: str) -> bytes:
    return json.dumps(
        {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": None,
                "code": status,
            }
        }
    ).encode()


TOO_SLOW = _error_bytes(408, f"the request's headers did not arrive in {HEADERS_TIMEOUT_S:g} s")


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
    on_refused: Callable[[int, str], None],
    status: int,
    message: str,
    *,
    kind: str = "invalid_request_error",
    headers: dict[str, str] | None = None,
    close: bool = False,
) -> ASGIApp:
    """An ASGI app that refuses the request before any route: reported to `on_refused` (the
    log and /metrics), answered in OpenAI's error shape."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        on_refused(status, message)
        if close:
            await drain(receive)
        extra = {**(headers or {}), **({"Connection": "close"} if close else {})}
        await error_response(status, message, kind, headers=extra or None)(scope, receive, send)

    return app


def guarded(app: ASGIApp, access: Access, on_refused: Callable[[int, str], None]) -> ASGIApp:
    """`app` behind the Host and Origin checks and CORS (api_access)."""
    return AccessGuard(
        app,
        access,
        forbidden=lambda status, message: refusal(on_refused, status, message, kind="forbidden"),
    )


class HttpServer(uvicorn.Server):
    """uvicorn's server with llmrun's signals: SIGTERM drains the requests in flight (uvicorn's
    graceful shutdown, bounded by timeout_graceful_shutdown); SIGINT, or a second signal, stops
    at once. `stopped_by` says which signal ended it."""

    def __init__(
        self,
        config: uvicorn.Config,
        on_ready: Callable[[], None],
        on_note: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(config)
        self.on_ready = on_ready
        self.on_note = on_note or (lambda note: None)  # a line for the log, not a request
        self.stopped_by: int | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handle(sig: int, frame: FrameType | None) -> None:
            if self.stopped_by is None:
                self.stopped_by = sig
            if sig == signal.SIGINT or self.should_exit:
                self.force_exit = True
            self.should_exit = True

        before = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in before.items():
                signal.signal(sig, handler)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        asyncio.get_running_loop().set_exception_handler(self._loop_error)
        await super().startup(sockets)
        if self.started:
            self.on_ready()

    def _loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """Out of open files (or socket memory), asyncio stops accepting for a second and
        tries again; its default handler would print a traceback each time. One log line
        instead (no request was answered: not counted); anything else goes to the default."""
        error = context.get("exception")
        if context.get("message", "").startswith("socket.accept()") and isinstance(error, OSError):
            self.on_note(
                f"a connection waits to be accepted: {error.strerror or error}"
                f" ({len(self.server_state.connections)} open)"
            )
            return
        loop.default_exception_handler(context)


def run(
    served: Served,
    sock: socket.socket,
    *,
    drain_s: float,
    max_connections: int,
    access: Access,
    on_ready: Callable[[], None],
) -> int | None:
    """Serve until a signal; returns the signal that stopped it (None: none)."""

    def refused(status: int, note: str) -> None:
        served.answered("other", status, HTTP_OUTCOMES.get(status, "bad_request"), note=note)

    too_many = refusal(
        refused,
        503,
        f"the server is busy: more than {max_connections}"
        " connections are open (--max-connections); retry later",
        kind="server_busy",
        headers={"Retry-After": str(RETRY_AFTER_S)},
        close=True,
    )
    protocol = type(
        "ServedH11",
        (GuardedH11,),
        {
            "on_refused": staticmethod(refused),
            "max_connections": max_connections,
            "over_capacity": staticmethod(guarded(too_many, access, refused)),
        },
    )
    config = uvicorn.Config(
        guarded(create_app(served), access, refused),
        log_config=None,
        access_log=False,
        http=protocol,
        log_level="error",
        lifespan="off",
        timeout_keep_alive=30,
        interface="asgi3",
        timeout_graceful_shutdown=max(1, round(drain_s)),
    )

    def note(text: str) -> None:  # a log line only: no request was answered
        served.log.append(Answered("other", 503, None, text))

    server = HttpServer(config, on_ready, note)
    served.metrics.max_connections = max_connections
    served.metrics.connections = lambda: len(server.server_state.connections)
    served.engine.start()
    try:
        server.run(sockets=[sock])
    finally:
        served.engine.stop()  # the caller frees the weights only if this thread has ended
        with contextlib.suppress(OSError):
            sock.close()
    return server.stopped_by


def open_files_for(connections: int) -> int:
    """Raise this process's soft limit on open files (up to the hard limit) so that
    `connections` sockets fit beside the model's and the runtime's own, as Go servers (Ollama)
    do at start; returns how many connections fit under it (`connections` or fewer). Past the
    limit accept() would fail, and asyncio prints a traceback for each refused connection, so
    the server must cap its connections at what fits."""
    try:
        import resource
    except ImportError:  # not on POSIX
        return connections
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = connections + OPEN_FILES_SPARE
    if soft != resource.RLIM_INFINITY and soft < wanted:
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return connections
    return max(1, min(connections, soft - min(OPEN_FILES_SPARE, soft // 2)))


def served_names(model: str) -> set[str | None]:
    """The model names a request may give: none, the id /v1/models lists, or its file name."""
    return {None, "", model, model + ".gguf"}


def model_id(path: str) -> str:
    """The name /v1/models lists: the file's name without .gguf."""
    name = os.path.basename(path)
    return name[: -len(".gguf")] if name.lower().endswith(".gguf") else name
