"""The routes of `llmrun serve`, at module level: each reads what the server shares (`Served`)
from `request.app.state.served` and answers with a typed model (api_responses).

/v1/chat/completions and /v1/completions (streaming or not), /v1/models, /health, /metrics, and
llama-server's /tokenize and /props. Every answer of a completion carries `timings` in llmrun's
names and llama-server's (`RequestTimings.to_dict`): the final stream chunk and, with
`stream_options.include_usage`, the usage chunk too. A stream that ends otherwise (the engine
failed, or the server is shutting down) ends with an error event in OpenAI's shape, a last chunk
with the finish reason `error`, and `[DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmrun.runners.base import Request, SamplingParams
from llmrun.runners.errors import BadRequestError, LlmrunError, PromptTooLongError
from llmrun.runners.llamacpp import LlamaCppRunner

from .api_engine import (
    FINISH_CANCELLED,
    Answered,
    Done,
    EngineThread,
    Failed,
    Job,
    Outcome,
    Piece,
    QueueFullError,
)
from .api_http import (
    GENERATING,
    RETRY_AFTER_S,
    SSE_DONE,
    EventStream,
    Report,
    body_limit,
    error_response,
    outcome_of,
    parse_body,
    printable,
    report,
    sse,
)
from .api_metrics import CONTENT_TYPE, ServerMetrics
from .api_models import ChatBody, CompletionBody, TokenizeBody
from .api_responses import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    Chunk,
    ChunkChoice,
    GenerationSettings,
    Head,
    Health,
    LastChunk,
    ModelCard,
    ModelList,
    ModelMeta,
    Props,
    TextChoice,
    TextCompletion,
    Tokens,
    ToolCallsMessage,
    Usage,
    UsageChunk,
    error_body,
)
from .batching import FINISH_ERROR
from .logprobs import Described, chat_content, legacy
from .tools import ToolPlan, ToolReader, merged, template_family

SHUTTING_DOWN = "the server is shutting down"


@dataclass
class Served:
    """What the routes share: the model, the engine, the defaults, the measurements and the log,
    and the requests waiting on the engine (cut at shutdown)."""

    runner: LlamaCppRunner
    engine: EngineThread
    model_id: str
    defaults: SamplingParams
    metrics: ServerMetrics
    created: int = field(default_factory=lambda: int(time.time()))
    log: deque[Answered] = field(default_factory=lambda: deque(maxlen=10000))
    stopping: bool = False
    waiting: set[asyncio.Queue[Outcome]] = field(default_factory=set)

    @functools.cached_property
    def tool_format(self) -> str:
        """The call format of the model's chat template (tools.py), read once."""
        return template_family(self.runner.chat_template())

    @property
    def n_ctx(self) -> int:
        return self.engine.n_ctx_per_seq

    @property
    def names(self) -> set[str | None]:
        """The model names a request may give: none, the id /v1/models lists, or its file."""
        return {None, "", self.model_id, self.model_id + ".gguf"}

    def record(self, route: str, status: int, seen: Report) -> None:
        """One answer, counted under its route; logged when it generates or fails."""
        self.metrics.answered(route, seen.outcome or outcome_of(status))
        shown = seen.status or status
        if route in GENERATING or shown >= 400:
            self.log.append(Answered(route, shown, seen.timings, printable(seen.note)))

    def note(self, text: str) -> None:
        """A log line only: no request was answered."""
        self.log.append(Answered("other", 503, None, text))

    def cut(self) -> None:
        """The server stops with requests in flight: each ends now with an error of its own."""
        self.stopping = True
        for queue in self.waiting:
            queue.put_nowait(Failed(SHUTTING_DOWN))


def served(request: HttpRequest) -> Served:
    return request.app.state.served


router = APIRouter()


@router.post("/v1/chat/completions", response_model=None)
@router.post("/chat/completions", response_model=None)
async def chat_completions(request: HttpRequest) -> Response:
    return await complete(request, chat=True)


@router.post("/v1/completions", response_model=None)
@router.post("/completions", response_model=None)
async def completions(request: HttpRequest) -> Response:
    return await complete(request, chat=False)


def prepared(
    s: Served, body: ChatBody | CompletionBody
) -> tuple[Request, str | None, int | None, ToolPlan | None, list[int]]:
    """What the engine needs of a request, checked: its Request, its grammar (parsed once, by
    the engine's `Grammars`), how many log probabilities, its tool plan (made once) and its
    prompt's tokens. LlmrunError when the request cannot be served. Runs in a worker thread:
    a schema's grammar and a long prompt's template take time the event loop has not."""
    if isinstance(body, ChatBody):
        body.use_tool_format(s.tool_format)
    req = body.request(s.defaults)
    grammar, logprobs = body.grammar(), body.logprob_count()
    plan = body.tool_plan() if isinstance(body, ChatBody) else None
    if grammar is not None and body.stop:  # it would cut the JSON the grammar keeps whole
        raise BadRequestError(
            f"stop: not served together with {body.grammar_field()} (a stop string would"
            " cut the grammar's JSON and pass it off as finished); leave stop out"
        )
    if grammar is not None and req.sampling.stop:  # serve --stop's: not inside the JSON
        req = dataclasses.replace(req, sampling=dataclasses.replace(req.sampling, stop=()))
    if grammar is not None:  # refused here, not by the engine once admitted (a 500)
        s.engine.engine.grammars.check(grammar, body.grammar_field())
    tokens = s.runner.request_tokens(req)
    if req.token_ids is not None:
        n_vocab = s.runner.vocab_size()
        bad = next((t for t in tokens if not 0 <= t < n_vocab), None)
        if bad is not None:
            raise BadRequestError(
                f"prompt: token {bad} is not in the vocabulary (0..{n_vocab - 1})"
            )
    if len(tokens) + 1 > s.n_ctx:
        raise PromptTooLongError(len(tokens), s.n_ctx)
    return req, grammar, logprobs, plan, tokens


async def complete(request: HttpRequest, chat: bool) -> Response:
    received = time.perf_counter()
    s, seen = served(request), report(request)
    limit = body_limit(s.n_ctx)
    body: ChatBody | CompletionBody | Response = await (
        parse_body(request, ChatBody, limit) if chat else parse_body(request, CompletionBody, limit)
    )
    if isinstance(body, Response):
        return body
    if body.model not in s.names:
        message = f"model {body.model!r} is not served here; /v1/models lists {s.model_id!r}"
        seen.set("not_found", message)
        return error_response(404, message, "model_not_found", param="model")
    try:  # the template, the schema's grammar and its parse: off the event loop
        req, grammar, logprobs, plan, tokens = await run_in_threadpool(prepared, s, body)
    except LlmrunError as e:  # the request's own fault: bad values, template, length
        message = " ".join(str(e).split())
        if isinstance(e, PromptTooLongError):
            message += " (the context of one sequence: -c/--ctx)"
        seen.set("bad_request", message)
        param = e.param if isinstance(e, BadRequestError) else None
        return error_response(400, message, param=param)
    if s.stopping:
        seen.set("error", SHUTTING_DOWN)
        return error_response(503, SHUTTING_DOWN, "server_error")
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Outcome] = asyncio.Queue()

    def sink(event: Outcome) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: the process is ending
            loop.call_soon_threadsafe(queue.put_nowait, event)

    job = Job(
        tuple(tokens),
        req.sampling,
        received_s=received,
        sink=sink,
        grammar=grammar,
        logprobs=logprobs,
        echo=body.echoes(),
    )
    try:
        s.engine.submit(job)
    except QueueFullError as e:
        seen.set("busy", str(e))
        return error_response(
            503, f"{e}; retry later", "server_busy", headers={"Retry-After": str(RETRY_AFTER_S)}
        )
    s.waiting.add(queue)
    head = Head(
        id=("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24],
        object="chat.completion.chunk" if chat else "text_completion",
        created=int(time.time()),
        model=s.model_id,
    )
    flight = Flight(s, seen, job, queue, head, chat, plan, continuous=body.continuous_usage)
    if body.stream:
        return EventStream(
            stream(flight, body.include_usage),
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    try:
        return await whole(request, flight)
    finally:
        s.waiting.discard(queue)


@dataclass
class Flight:
    """A completion handed to the engine: its job, the queue its events arrive on, the head of
    each of its answers, and its report."""

    served: Served
    seen: Report
    job: Job
    queue: asyncio.Queue[Outcome]
    head: Head
    chat: bool
    plan: ToolPlan | None = None  # the tools offered (tools.py)
    offset: int = 0  # legacy logprobs: the characters of the answer sent so far
    # vLLM's `continuous_usage_stats`: every chunk carries the usage so far, these counts
    continuous: bool = False
    sampled: int = 0  # output tokens sampled so far (held-back text included)
    cached: int = 0  # prompt tokens found cached

    def usage(self, sampled: int | None = None) -> Usage | None:
        """The usage so far for a chunk (None: not asked, the chunk has none)."""
        if not self.continuous:
            return None
        n = self.sampled if sampled is None else sampled
        return Usage.counts(len(self.job.tokens), n, self.cached)

    def logprobs(self, text: str, tokens: tuple[Described, ...]) -> dict[str, Any] | None:
        """The `logprobs` of a choice carrying `text`, made of these tokens (None: not asked)."""
        if self.job.logprobs is None:
            return None
        if self.chat:
            return chat_content(tokens)
        lp = legacy(tokens, self.offset)
        self.offset += len(text)
        return lp

    def choice(
        self, text: str | None, finish: str | None, tokens: tuple[Described, ...] = ()
    ) -> ChunkChoice | TextChoice:
        lp = None if text is None else self.logprobs(text, tokens)
        if self.chat:
            delta = {} if text is None else {"content": text}
            return ChunkChoice(delta=delta, finish_reason=finish, logprobs=lp)
        return TextChoice(text=text or "", finish_reason=finish, logprobs=lp)

    def chunk(
        self, text: str | None, finish: str | None = None, tokens: tuple[Described, ...] = ()
    ) -> Chunk:
        choice = self.choice(text, finish, tokens)
        return Chunk(**dict(self.head), choices=[choice], usage=self.usage())

    def delta_chunk(self, delta: dict[str, Any]) -> Chunk:
        """A chunk of an answer read by tools.py: text or a piece of a tool call."""
        choice = ChunkChoice(delta=delta, finish_reason=None)
        return Chunk(**dict(self.head), choices=[choice], usage=self.usage())

    def role_chunk(self) -> Chunk:
        """A chat stream's first chunk, with the role (and, as vLLM's, no tokens sampled)."""
        first = ChunkChoice(delta={"role": "assistant", "content": ""}, finish_reason=None)
        return Chunk(**dict(self.head), choices=[first], usage=self.usage(0))

    def failed(self, event: Failed, *, streamed: bool) -> int:
        """The engine failed it, or the server is shutting down: the status it ends with."""
        status = 503 if self.served.stopping else 500
        self.seen.set("error", event.message, status=status if streamed else None)
        return status

    def cancel(self) -> None:
        """The client went away: its sequence is freed now."""
        self.served.engine.cancel(self.job)
        self.seen.set("cancelled", "client disconnected", status=499)


async def stream(flight: Flight, include_usage: bool) -> AsyncIterator[str]:
    """The answer as server-sent events; one that cannot finish ends with an error event, a
    last chunk with the finish reason `error`, and [DONE]. With continuous usage (vLLM's
    `continuous_usage_stats`) every chunk carries the usage so far, and a chat stream's role
    chunk waits for the engine's first event, as vLLM's does, to know the cached count."""
    head, ended = dict(flight.head), False
    try:
        role = flight.chat and flight.continuous  # sent with the first event (below)
        if flight.chat and not role:
            yield sse(flight.role_chunk())
        reader = flight.plan.reader() if flight.plan is not None else None
        while True:
            event = await flight.queue.get()
            if isinstance(event, Piece):
                flight.sampled, flight.cached = event.sampled, event.cached
            elif isinstance(event, Done):
                t = event.timings
                flight.sampled, flight.cached = t.completion_tokens, t.reused_tokens
            if role:
                role = False
                yield sse(flight.role_chunk())
            if isinstance(event, Piece):
                if reader is None:
                    yield sse(flight.chunk(event.text, tokens=event.logprobs))
                else:
                    for delta in reader.feed(event.text):
                        yield sse(flight.delta_chunk(delta))
                continue
            ended = True
            if isinstance(event, Failed):
                status = flight.failed(event, streamed=True)
                yield sse(error_body(status, event.message, "server_error"))
                yield sse(flight.chunk(None, FINISH_ERROR))
                yield SSE_DONE
                return
            t = event.timings
            timings = t.to_dict()
            finish = event.finish_reason
            if reader is not None:
                deltas, finish = read_to_end(reader, event.tail, finish)
                for delta in deltas:
                    yield sse(flight.delta_chunk(delta))
            elif event.tail or event.logprobs:
                yield sse(flight.chunk(event.tail, tokens=event.logprobs))
            last = flight.choice(None, finish)
            yield sse(LastChunk(**head, choices=[last], usage=flight.usage(), timings=timings))
            if include_usage:
                yield sse(UsageChunk(**head, choices=[], usage=Usage.of(t), timings=timings))
            yield SSE_DONE
            flight.seen.set("ok", timings=t)
            return
    finally:
        flight.served.waiting.discard(flight.queue)
        if not ended:
            flight.cancel()


async def _disconnected(request: HttpRequest) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def whole(request: HttpRequest, flight: Flight) -> Response:
    """The answer in one piece, once the engine has finished it (or the client has gone)."""

    tokens: list[Described] = []

    async def collect() -> tuple[str, Done | Failed]:
        parts = []
        while True:
            event = await flight.queue.get()
            if isinstance(event, Piece):
                parts.append(event.text)
                tokens.extend(event.logprobs)
            else:
                if isinstance(event, Done):
                    tokens.extend(event.logprobs)
                return "".join(parts) + (event.tail if isinstance(event, Done) else ""), event

    waiter = asyncio.ensure_future(collect())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({waiter, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not waiter.done():
            waiter.cancel()
            flight.cancel()
    if not waiter.done() or waiter.cancelled():
        return Response(status_code=499)
    text, event = waiter.result()
    if isinstance(event, Failed):
        status = flight.failed(event, streamed=False)
        return error_response(status, event.message, "server_error")
    t = event.timings
    finish = "stop" if event.finish_reason == FINISH_CANCELLED else event.finish_reason
    fields: dict[str, Any] = {
        **dict(flight.head),
        "object": "chat.completion" if flight.chat else "text_completion",
        "usage": Usage.of(t),
        "timings": t.to_dict(),
    }
    flight.seen.set("ok", timings=t)
    lp = flight.logprobs(text, tuple(tokens))
    if flight.chat:
        message: AssistantMessage | ToolCallsMessage = AssistantMessage(content=text)
        if flight.plan is not None:
            deltas, finish = read_to_end(flight.plan.reader(), text, finish)
            content, calls = merged(deltas)
            if calls is not None:
                message = ToolCallsMessage(content=content, tool_calls=calls)
        choice = ChatChoice(message=message, finish_reason=finish, logprobs=lp)
        return JSONResponse(ChatCompletion(**fields, choices=[choice]).wire())
    done = TextCompletion(
        **fields, choices=[TextChoice(text=text, finish_reason=finish, logprobs=lp)]
    )
    return JSONResponse(done.wire())


def read_to_end(reader: ToolReader, text: str, finish: str) -> tuple[list[dict[str, Any]], str]:
    """The deltas of the rest of an answer read for tool calls, and its finish reason
    (`tool_calls` when it ended, finished, as a call)."""
    deltas = reader.feed(text) if text else []
    more, finish = reader.finish(finish)
    return deltas + more, finish


def _model_card(s: Served) -> ModelCard:
    loaded = s.runner.load()
    meta = ModelMeta(
        n_ctx_per_seq=s.n_ctx,
        n_seq=s.engine.n_seq,
        policy=str(s.engine.policy),
        n_params=loaded.model.n_params,
        size=loaded.model.size_bytes,
    )
    return ModelCard(id=s.model_id, created=s.created, meta=meta)


@router.api_route("/v1/models", methods=["GET", "HEAD"], response_model=None)
@router.api_route("/models", methods=["GET", "HEAD"], response_model=None)
async def models(request: HttpRequest) -> Response:
    return JSONResponse(ModelList(data=[_model_card(served(request))]).wire())


@router.api_route("/v1/models/{name:path}", methods=["GET", "HEAD"], response_model=None)
@router.api_route("/models/{name:path}", methods=["GET", "HEAD"], response_model=None)
async def one_model(request: HttpRequest, name: str) -> Response:
    s = served(request)
    if name not in s.names:
        report(request).set("not_found", f"model {name!r}")
        return error_response(
            404,
            f"model {name!r} is not served here; /v1/models lists {s.model_id!r}",
            "model_not_found",
        )
    return JSONResponse(_model_card(s).wire())


@router.api_route("/health", methods=["GET", "HEAD"], response_model=None)
async def health(request: HttpRequest) -> Response:
    engine = served(request).engine
    busy = engine.busy
    answer = Health(slots_idle=engine.n_seq - busy, slots_processing=busy, queued=engine.queued)
    return JSONResponse(answer.wire())


@router.api_route("/metrics", methods=["GET", "HEAD"], response_model=None)
async def metrics(request: HttpRequest) -> Response:
    return Response(served(request).metrics.text(), media_type=CONTENT_TYPE)


@router.api_route("/props", methods=["GET", "HEAD"], response_model=None)
async def props(request: HttpRequest) -> Response:
    s = served(request)
    answer = Props(
        default_generation_settings=GenerationSettings(n_ctx=s.n_ctx),
        total_slots=s.engine.n_seq,
        model_alias=s.model_id,
    )
    return JSONResponse(answer.wire())


@router.post("/tokenize", response_model=None)
async def tokenize(request: HttpRequest) -> Response:
    s = served(request)
    body = await parse_body(request, TokenizeBody, body_limit(s.n_ctx))
    if isinstance(body, Response):
        return body
    tokens = await run_in_threadpool(s.runner.tokenize, body.content, add_special=body.add_special)
    return JSONResponse(Tokens(tokens=tokens).wire())


async def http_error(request: HttpRequest, exc: Exception) -> Response:
    """Unknown paths and methods in OpenAI's error shape; OPTIONS gets the allowed methods."""
    assert isinstance(exc, StarletteHTTPException)
    headers = dict(exc.headers or {})
    if exc.status_code == 405 and request.method == "OPTIONS" and "Allow" in headers:
        return Response(status_code=204, headers={"Allow": headers["Allow"] + ", OPTIONS"})
    report(request).set(outcome_of(exc.status_code), f"{request.method} {request.url.path}")
    message = {
        404: f"no route {request.url.path}",
        405: f"{request.method} is not allowed on {request.url.path}"
        + (f" (allowed: {headers['Allow']})" if "Allow" in headers else ""),
    }.get(exc.status_code, str(exc.detail))
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return error_response(exc.status_code, message, kind, headers=headers or None)


async def failed(request: HttpRequest, exc: Exception) -> Response:
    """A fault of llmrun's own: OpenAI's shape, never a traceback in the answer."""
    report(request).set("error", f"{type(exc).__name__}: {exc}")
    return error_response(500, f"internal error: {type(exc).__name__}", "server_error")


def create_app(state: Served) -> FastAPI:
    app = FastAPI(
        title="llmrun serve",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        redirect_slashes=False,  # api_access strips a trailing slash: no 307
    )
    app.state.served = state
    app.include_router(router)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, failed)
    return app
