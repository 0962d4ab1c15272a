"""`llmrun serve`: an OpenAI-compatible HTTP server on the multi-sequence engine.

FastAPI answers on the asyncio loop; the engine runs on its own thread (`EngineThread`) and
hands each request's tokens back through `loop.call_soon_threadsafe`, so neither waits for the
other. Routes: /v1/chat/completions and /v1/completions (streaming or not), /v1/models,
/health, /metrics, and llama-server's /tokenize and /props for clients that count tokens.

Every answer carries `timings` in llmrun's names (`RequestTimings.to_dict`): the final stream
chunk and, with `stream_options.include_usage`, the usage chunk too.

Faults end one request only: a client that disconnects frees its sequence at the next engine
step; a prompt longer than a sequence's context, malformed JSON or a wrong type gets a 400 with
the reason; a full queue a 503 with Retry-After. SIGTERM stops accepting connections and lets
the requests in flight finish (for at most `drain_s`); Ctrl-C stops at once.
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
import uvicorn
from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.types import Receive, Scope, Send

from llmrun.runners.base import SamplingParams
from llmrun.runners.errors import BadRequestError, LlmrunError, PromptTooLongError
from llmrun.runners.llamacpp import LlamaCppRunner

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

    def answered(self, route: str, status: int, outcome: str, timings: RequestTimings | None =
                 None, note: str = "") -> None:  # fmt: skip
        self.metrics.answered(route, outcome)
        self.log.append(Answered(route, status, timings, note))


def error_response(status: int, message: str, kind: str = "invalid_request_error",
                   headers: dict[str, str] | None = None) -> JSONResponse:  # fmt: skip
    """OpenAI's error shape."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


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
    return {"prompt_tokens": t.prompt_tokens, "completion_tokens": t.output_tokens,
            "total_tokens": t.prompt_tokens + t.output_tokens,
            "prompt_tokens_details": {"cached_tokens": t.reused_tokens}}  # fmt: skip


async def _disconnected(request: HttpRequest) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(served: Served) -> FastAPI:
    app = FastAPI(title="llmrun serve", docs_url=None, redoc_url=None, openapi_url=None)
    n_ctx = served.engine.n_ctx_per_seq

    def invalid(route: str, exc: ValidationError) -> JSONResponse:
        errors = exc.errors()
        first: dict[str, Any] = dict(errors[0]) if errors else {}
        if first.get("type") == "json_invalid":
            message = f"malformed JSON: {first.get('msg', '')}".rstrip(": ")
        else:
            where = ".".join(str(p) for p in first.get("loc", ()))
            message = f"{where}: {first.get('msg', '')}" if where else first.get("msg", "")
        served.answered(route, 400, "bad_request", note=message)
        return error_response(400, message or "invalid request")

    async def complete(request: HttpRequest, chat: bool) -> Any:
        received = time.perf_counter()
        route = "chat" if chat else "completions"
        try:
            body: ChatBody | CompletionBody = (ChatBody if chat else CompletionBody) \
                .model_validate_json(await request.body())  # fmt: skip
        except ValidationError as e:
            return invalid(route, e)
        try:
            req = body.request(served.defaults)
            tokens = await run_in_threadpool(served.runner.request_tokens, req)
            if req.token_ids is not None:
                n_vocab = served.runner.vocab_size()
                bad = next((t for t in tokens if not 0 <= t < n_vocab), None)
                if bad is not None:
                    raise BadRequestError(f"prompt: token {bad} is not in the vocabulary"
                                          f" (0..{n_vocab - 1})")  # fmt: skip
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
            return error_response(503, f"{e}; retry later", "server_busy",
                                  headers={"Retry-After": str(RETRY_AFTER_S)})  # fmt: skip
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        head = {"id": ident, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": served.model_id}  # fmt: skip

        def choice(text: str | None, finish: str | None) -> dict[str, Any]:
            if chat:
                delta = {} if text is None else {"content": text}
                return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            return {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}

        if body.stream:
            return EventStream(stream(job, queue, head, choice, route, body.include_usage),
                               headers={"Cache-Control": "no-cache",
                                        "X-Accel-Buffering": "no"})  # fmt: skip
        return await whole(request, job, queue, head, route, chat)

    async def stream(job: Job, queue: asyncio.Queue[Piece | Done | Failed], head: dict[str, Any],
                     choice: Callable[[str | None, str | None], dict[str, Any]], route: str,
                     include_usage: bool) -> AsyncIterator[str]:  # fmt: skip
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
                    yield _sse({"error": {"message": event.message, "type": "server_error",
                                          "code": 500}})  # fmt: skip
                    return
                t = event.timings
                if event.tail:
                    yield _sse({**head, "choices": [choice(event.tail, None)]})
                yield _sse({**head, "choices": [choice(None, event.finish_reason)],
                            "timings": t.to_dict()})  # fmt: skip
                if include_usage:
                    yield _sse({**head, "choices": [], "usage": _usage(t), "timings": t.to_dict()})
                yield "data: [DONE]\n\n"
                served.answered(route, 200, "ok", t)
                return
        finally:
            if not ended:  # the client went away: free its sequence now
                served.engine.cancel(job)
                served.answered(route, 499, "cancelled", note="client disconnected")

    async def whole(request: HttpRequest, job: Job, queue: asyncio.Queue[Piece | Done | Failed],
                    head: dict[str, Any], route: str, chat: bool) -> Response:  # fmt: skip
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
        result = ({"index": 0, "message": {"role": "assistant", "content": text},
                   "finish_reason": finish, "logprobs": None} if chat else
                  {"index": 0, "text": text, "finish_reason": finish,
                   "logprobs": None})  # fmt: skip
        served.answered(route, 200, "ok", t)
        return JSONResponse({**head, "object": "chat.completion" if chat else "text_completion",
                             "choices": [result], "usage": _usage(t),
                             "timings": t.to_dict()})  # fmt: skip

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat_completions(request: HttpRequest) -> Any:
        return await complete(request, chat=True)

    @app.post("/v1/completions")
    @app.post("/completions")
    async def completions(request: HttpRequest) -> Any:
        return await complete(request, chat=False)

    @app.get("/v1/models")
    @app.get("/models")
    async def models() -> dict[str, Any]:
        loaded = served.runner.load()
        meta = {"n_ctx_per_seq": n_ctx, "n_seq": served.engine.n_seq,
                "policy": str(served.engine.policy), "n_params": loaded.model.n_params,
                "size": loaded.model.size_bytes}  # fmt: skip
        return {"object": "list", "data": [{"id": served.model_id, "object": "model",
                                            "created": served.created, "owned_by": "llmrun",
                                            "meta": meta}]}  # fmt: skip

    @app.get("/health")
    async def health() -> dict[str, Any]:
        busy = served.engine.busy
        return {"status": "ok", "slots_idle": served.engine.n_seq - busy,
                "slots_processing": busy, "queued": served.engine.queued}  # fmt: skip

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(served.metrics.text(), media_type=CONTENT_TYPE)

    @app.get("/props")
    async def props() -> dict[str, Any]:
        return {"default_generation_settings": {"n_ctx": n_ctx},
                "total_slots": served.engine.n_seq, "model_alias": served.model_id}  # fmt: skip

    @app.post("/tokenize")
    async def tokenize(request: HttpRequest) -> Any:
        try:
            data = await request.json()
        except ValueError:
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


class HttpServer(uvicorn.Server):
    """uvicorn's server with llmrun's signals: SIGTERM drains the requests in flight (uvicorn's
    graceful shutdown, bounded by timeout_graceful_shutdown); SIGINT, or a second signal, stops
    at once. `stopped_by` says which signal ended it."""

    def __init__(self, config: uvicorn.Config, on_ready: Callable[[], None]) -> None:
        super().__init__(config)
        self.on_ready = on_ready
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
        await super().startup(sockets)
        if self.started:
            self.on_ready()


def run(served: Served, sock: socket.socket, *, drain_s: float,
        on_ready: Callable[[], None]) -> int | None:  # fmt: skip
    """Serve until a signal; returns the signal that stopped it (None: none)."""
    config = uvicorn.Config(create_app(served), log_config=None, access_log=False,
                            log_level="error", lifespan="off", timeout_keep_alive=30,
                            timeout_graceful_shutdown=max(1, round(drain_s)))  # fmt: skip
    server = HttpServer(config, on_ready)
    served.engine.start()
    try:
        server.run(sockets=[sock])
    finally:
        served.engine.stop()  # the caller frees the weights only if this thread has ended
        with contextlib.suppress(OSError):
            sock.close()
    return server.stopped_by


def model_id(path: str) -> str:
    """The name /v1/models lists: the file's name without .gguf."""
    name = os.path.basename(path)
    return name[: -len(".gguf")] if name.lower().endswith(".gguf") else name
