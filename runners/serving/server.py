"""`llmrun serve` as a library: `start(settings, make_runner, on_ready)` serves a model over an
OpenAI-compatible HTTP API until a signal stops it.

It wires the pieces: the listening socket (bound before the model loads, so a port in use is one
clear error and --port 0 names its port), the access rules (api_access), the measurements
(api_metrics), the engine thread (api_engine) and uvicorn (uvicorn_patch) serving the routes
(api_routes). FastAPI answers on the asyncio loop; the engine runs on its own thread and hands
each request's tokens back through `loop.call_soon_threadsafe`, so neither waits for the other.

Faults end one request only: a client that disconnects frees its sequence at the next engine
step; a prompt longer than a sequence's context, malformed JSON, a wrong type or an unknown
field gets a 400 with the reason; a full queue a 503 with Retry-After; a body over its limit a
413, one that stops arriving a 408, a model not served a 404, each in OpenAI's error shape. A
connection whose request headers do not arrive within 30 s is closed (slowloris); one past
`max_connections` gets a 503 with Retry-After. Before any route, `api_access` refuses foreign
origins and Host names (403) and adds the CORS headers. SIGTERM stops accepting connections and
lets the requests in flight finish (for at most `drain_s`); Ctrl-C, SIGHUP or a second signal
stops at once. Requests still in flight then end with `the server is shutting down`.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass

import uvicorn
from starlette.types import ASGIApp

from llmrun.runners.base import Request, Runner
from llmrun.runners.config import EngineConfig
from llmrun.runners.energy.steps import open_steps
from llmrun.runners.errors import BadRequestError
from llmrun.runners.llamacpp import LlamaCppRunner
from llmrun.runners.stats import EngineSettings

from .api_access import Access, AccessGuard, loopback_address
from .api_engine import EngineThread
from .api_http import RETRY_AFTER_S, Metering, Report, outcome_of, refusal
from .api_metrics import ServerMetrics
from .api_routes import Served, create_app
from .batching import Policy
from .server_settings import ServerSettings
from .uvicorn_patch import MAX_HEAD_BYTES, HttpServer, guarded_protocol

OPEN_FILES_SPARE = 128  # files beside the connections: the model, libraries, the listener
KEEP_ALIVE_S = 30
MakeRunner = Callable[[str | None, EngineConfig], Runner]


@dataclass(frozen=True)
class Ready:
    """The server listens: where, what it serves, and how (for the ready line and the view)."""

    url: str
    served: Served
    n_ctx: int  # of each sequence
    kv_unified: bool | None  # as llama.cpp made the context (None: not reported)
    policy: str
    max_connections: int  # the cap in force: lower than asked where open files do not fit it
    engine: EngineSettings | None = None  # where the layers went (the start line names it)

    @property
    def threads(self) -> tuple[int, int]:
        return self.served.metrics.threads


def start(
    settings: ServerSettings, make_runner: MakeRunner, on_ready: Callable[[Ready], None]
) -> int | None:
    """Serve until a signal; returns the signal that stopped it (None: none). BadRequestError
    for what the settings ask that cannot be (a bad policy, a model that is not local, a port
    that cannot be bound), before the model loads; `--energy on` with no counter to read, once
    it has loaded (whether NVML counts depends on where the layers went)."""
    policy = Policy.parse(settings.policy) if settings.policy is not None else None
    runner = make_runner(settings.model, settings.engine)
    if not isinstance(runner, LlamaCppRunner):
        raise BadRequestError("serve needs a local model")
    host, port = settings.host, settings.port
    try:
        sock = listen(host, port)
    except OSError as e:
        raise BadRequestError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    # on loopback, only loopback names may reach it (DNS rebinding); elsewhere any name may
    access = Access(settings.origins, check_host=loopback_address(sock.getsockname()[0]))
    # past the open-files limit accept() fails: cap below it
    max_connections = open_files_for(settings.max_connections)
    engine: EngineThread | None = None
    try:
        # one context: the engine's sequences; the warm-up runs on the engine's thread
        loaded = runner.load(n_seq=settings.n_seq, warm_up=False)
        policy = policy or Policy.parse(f"chunked:{loaded.settings.n_batch}")
        runner.request_tokens(Request.chat("hi"))  # the template compiled before any request
        metrics = ServerMetrics(energy=open_steps(settings.energy, loaded.settings))
        engine = EngineThread(
            runner,
            n_seq=settings.n_seq,
            n_ctx_per_seq=loaded.settings.n_ctx,
            policy=policy,
            max_queue=settings.max_queue,
            observer=metrics,
        )
        metrics.follow(engine)
        served = Served(
            runner,
            engine,
            settings.alias or model_id(runner.model_path),
            settings.defaults,
            metrics,
        )
        bound = sock.getsockname()
        shown_host = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
        ready = Ready(
            url=f"http://{shown_host}:{bound[1]}",
            served=served,
            n_ctx=loaded.settings.n_ctx,
            kv_unified=loaded.settings.params.get("kv_unified"),
            policy=str(policy),
            max_connections=max_connections,
            engine=loaded.settings,
        )
        return serve_http(
            served,
            sock,
            access=access,
            drain_s=settings.drain_s,
            max_connections=max_connections,
            on_ready=lambda: on_ready(ready),
        )
    finally:
        if engine is None or engine.stopped:
            runner.close()  # never under a step still running: the process exit frees it then


def serve_http(
    served: Served,
    sock: socket.socket,
    *,
    access: Access,
    drain_s: float,
    max_connections: int,
    on_ready: Callable[[], None],
) -> int | None:
    """The engine's thread and uvicorn on `sock` until a signal; returns that signal."""

    def refused(status: int, note: str) -> None:  # below the app: malformed HTTP, slow headers
        served.record("other", status, Report(outcome_of(status), note=note))

    def forbidden(status: int, message: str) -> ASGIApp:
        """The access checks' refusal: 403 for a name or origin not let in, 400 (a client's
        malformed Host, Origin or target) in the type and outcome of every other 400."""
        if status == 505:  # HTTP/2's preface ("PRI * HTTP/2.0" then "SM"): what follows is
            # no HTTP/1.1, so the connection carries nothing more (it got a second reply, a 400)
            return refusal(status, message, outcome=outcome_of(status), close=True)
        if status != 403:
            return refusal(status, message, outcome=outcome_of(status))
        return refusal(status, message, outcome="forbidden", kind="forbidden")

    def behind_access(app: ASGIApp) -> Metering:
        """`app` behind the Host and Origin checks and CORS, each response counted once."""
        return Metering(AccessGuard(app, access, forbidden=forbidden), served.record)

    too_many = refusal(
        503,
        f"the server is busy: more than {max_connections}"
        " connections are open (--max-connections); retry later",
        outcome="too_many_connections",
        kind="server_busy",
        headers={"Retry-After": str(RETRY_AFTER_S)},
        close=True,
    )
    app = behind_access(create_app(served))
    config = uvicorn.Config(
        app,
        log_config=None,
        access_log=False,
        http=guarded_protocol(refused, max_connections, behind_access(too_many)),
        log_level="error",
        lifespan="off",
        timeout_keep_alive=KEEP_ALIVE_S,
        h11_max_incomplete_event_size=MAX_HEAD_BYTES,
        interface="asgi3",
        timeout_graceful_shutdown=1,  # after the drain (HttpServer.shutdown): what is left
    )
    server = HttpServer(
        config,
        drain_s=drain_s,
        in_flight=lambda: app.in_flight,
        on_cut=served.cut,
        on_ready=on_ready,
        on_note=served.note,
    )
    served.metrics.max_connections = max_connections
    served.metrics.connections = lambda: server.connections
    served.engine.start()
    try:
        server.run(sockets=[sock])
    finally:
        served.engine.stop()  # the caller frees the weights only if this thread has ended
        with contextlib.suppress(OSError):
            sock.close()
    return server.stopped_by


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


def model_id(path: str) -> str:
    """The name /v1/models lists: the file's name without .gguf."""
    name = os.path.basename(path)
    return name[: -len(".gguf")] if name.lower().endswith(".gguf") else name
