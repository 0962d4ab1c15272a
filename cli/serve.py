"""`llmrun serve`: an OpenAI-compatible server on the local engine, with a live view.

On a terminal, a panel shows what the engine does (sequences decoding, prompts queued or
prefilling, tokens per step split into prefill and decode, throughput, the decoding sequences'
inter-token gaps) with one line per answered request scrolling above it; without one, the
same lines are printed plain. SIGTERM drains the requests in flight then exits 143; Ctrl-C 130,
SIGHUP 129. The server itself is `runners.serving.server.start`; this module turns the options
into its `ServerSettings` and draws.
"""

from __future__ import annotations

import dataclasses
import functools
import signal
import sys
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from llmrun.runners.errors import BadRequestError
from llmrun.runners.lists import whole
from llmrun.runners.serving.api_access import parse_origins
from llmrun.runners.serving.api_engine import Answered, Snapshot
from llmrun.runners.serving.server_settings import ServerSettings
from llmrun.runners.stats import percentile
from llmrun.runners.system import BackgroundMeter, busy_advice, logical_cpus

from . import EXIT_INTERRUPTED, STOP_SIGNALS
from . import options as o
from .dashboard import TerminalConsole, _TextLive, sparkline
from .engine import make_runner
from .errors import handled, usage_error
from .records import OptionRecord, takes_records
from .terminal import say, terminal_line

if TYPE_CHECKING:
    from llmrun.runners.config import EngineConfig
    from llmrun.runners.serving.api_routes import Served
    from llmrun.runners.serving.server import Ready

SERVER_PANEL = "Server"
_server_option = functools.partial(typer.Option, rich_help_panel=SERVER_PANEL)


@dataclass(frozen=True, kw_only=True)
class ServerOptions(OptionRecord):
    """Where and how the server listens, queues and drains."""

    host: Annotated[str, _server_option("--host", help="Address to listen on.")] = "127.0.0.1"
    port: Annotated[
        int,
        _server_option(
            "--port", min=0, max=65535, help="Port to listen on; 0 = any free port (printed)."
        ),
    ] = 8080
    parallel: Annotated[
        int,
        _server_option(
            "-np",
            "--parallel",
            min=1,
            max=256,
            help="Sequences decoded together (llama-server's"
            " slots); more requests wait in the queue.",
        ),
    ] = 4
    policy: Annotated[
        str | None,
        _server_option(
            "--policy",
            metavar="POLICY",
            help="How prefill and decode share each step: prefill-first, chunked:B (every step"
            " carries all decodes and at most B tokens), decode-first[:K]. (default: chunked:"
            "<batch>, as llama-server)",
        ),
    ] = None
    max_queue: Annotated[
        int,
        _server_option(
            "--max-queue",
            min=0,
            max=1_000_000,
            help="Requests that may wait for a sequence; more get 503 with Retry-After.",
        ),
    ] = 64
    max_connections: Annotated[
        str | None,
        _server_option(
            "--max-connections",
            metavar="N",
            help="Open connections served at once; a connection past them gets 503 with"
            " Retry-After. (default: 512, or 2 x (-np + --max-queue) where that is more: room"
            " for every request the engine can hold, an idle kept-alive connection beside each,"
            " and monitoring)",
        ),
    ] = None
    allow_origin: Annotated[
        list[str] | None,
        _server_option(
            "--allow-origin",
            metavar="ORIGIN",
            help="A web page's origin (scheme://host[:port]) whose requests are served, as"
            " OLLAMA_ORIGINS; repeatable; one * in it stands for any text"
            " (https://*.example.com, chrome-extension://*); * alone allows every origin."
            " Pages on localhost, 127.0.0.1 and [::1] are always allowed; other origins get"
            " 403. On a loopback --host, a Host header other than localhost, 127.x or [::1]"
            " gets 403 too (DNS rebinding).",
        ),
    ] = None
    drain: Annotated[
        float,
        _server_option(
            "--drain-timeout",
            min=1.0,
            max=3600.0,
            help="Seconds SIGTERM waits for the requests in flight before closing them.",
        ),
    ] = 30.0
    alias: Annotated[
        str | None,
        _server_option(
            "--alias", help="The model's name in /v1/models. (default: the file's name)"
        ),
    ] = None


@dataclass(frozen=True, kw_only=True)
class ServeEngineOptions(OptionRecord):
    """The engine's settings under the server: each sequence's context, and threads that
    leave a core to the HTTP side."""

    chat_template_file: o.ChatTemplateFile = None
    ctx: Annotated[
        int | None,
        o.ctx_option(
            "Context size of each sequence in tokens. (default: 4096 or the model's"
            " training context, if smaller)",
            least=1,
        ),
    ] = None
    batch: o.Batch = None
    threads: Annotated[
        int | None,
        o.threads_option(
            "CPU threads of the engine. (default: the physical cores less one, left to the"
            " HTTP side)"
        ),
    ] = None
    threads_batch: o.ThreadsBatch = None
    gpu_layers: o.GpuLayers = None
    flash_attn: o.FlashAttnOpt = None
    cache_type_k: o.CacheTypeK = o.ENGINE_DEFAULTS.cache_type_k
    cache_type_v: o.CacheTypeV = o.ENGINE_DEFAULTS.cache_type_v
    repack: o.Repack = None
    rpc: o.Rpc = None
    no_warmup: o.NoWarmup = False

    def config(self) -> EngineConfig:
        threads = self.threads
        if threads is None:  # llama.cpp's threads wait for each other at every layer: one that
            from llmrun.runners.system import default_threads  # loses its core stalls the step

            threads = max(1, default_threads() - 1)
        # the same fields as run's, the micro-batch as the batch
        return o.EngineOptions(**{**vars(self), "threads": threads, "ubatch": self.batch}).config()


@takes_records
def serve(
    model: o.Model = None,
    *,
    server: ServerOptions,
    kv_unified: o.KvUnified = None,
    no_dashboard: o.NoDashboard = False,
    energy: o.Energy = o.AutoOnOff.auto,
    sampling: o.SamplingOptions,
    engine: ServeEngineOptions,
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API, -np sequences at a time.

    Requests' own sampling values override these defaults. Each answer carries its phases
    (`timings`); /metrics has Prometheus' histograms. Every path answers the same with a
    trailing slash (no redirect). Examples:

      llmrun serve -np 4 --policy chunked:64

      curl 127.0.0.1:8080/v1/chat/completions -d '{"messages":[{"role":"user","content":"Hi"}]}'
    """
    try:
        origins = parse_origins(server.allow_origin or ())
        connections = parse_max_connections(
            server.max_connections, server.parallel, server.max_queue
        )
        if server.alias is not None and not (server.alias.strip() and server.alias.isprintable()):
            # a newline went raw into the "listening on" line and into every /v1/models
            raise BadRequestError(f"--alias {server.alias!r}: give a name of printable text")
        host = listen_host(server.host)
    except BadRequestError as e:
        usage_error(str(e))
    with handled():
        defaults = sampling.params()
        config = dataclasses.replace(engine.config(), kv_unified=kv_unified is True)
        settings = ServerSettings(
            model=model,
            engine=config,
            defaults=defaults,
            host=host,
            port=server.port,
            n_seq=server.parallel,
            policy=server.policy,
            max_queue=server.max_queue,
            max_connections=connections,
            origins=origins,
            drain_s=server.drain,
            alias=server.alias,
            energy=energy.value,
        )
        raise typer.Exit(_serve(settings, dashboard=not no_dashboard and sys.stderr.isatty()))


def _serve(settings: ServerSettings, *, dashboard: bool) -> int:
    """Serve (runners.serving.server.start) with the live view; the exit code."""
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise BadRequestError(
            f"serve needs the server extra ({e.name} is missing): pip install 'llmrun[server]'"
        ) from None
    from llmrun.runners.serving.server import start

    view = _View(TerminalConsole(stderr=True, highlight=False) if dashboard else None)

    def ready(r: Ready) -> None:
        if r.max_connections < settings.max_connections:
            _line(
                f"llmrun serve: warning: {settings.max_connections} connections do not fit under"
                " this process's limit on open files (ulimit -n); serving at most"
                f" {r.max_connections}"
            )
        threads, threads_batch = r.threads
        kv = "" if r.kv_unified is None else ", KV unified" if r.kv_unified else ", KV per sequence"
        _line(
            f"llmrun serve: listening on {r.url} ({r.served.model_id}, {settings.n_seq} sequences"
            f" x {r.n_ctx} tokens{kv}, policy {r.policy}, queue {settings.max_queue},"
            f" threads {threads}/{threads_batch})"
        )
        if r.engine is not None and r.engine.n_gpu_layers:  # where the layers went
            from .report import engine_text, memory_text

            _line(f"llmrun serve: {engine_text(r.engine)} · {memory_text(r.engine)}")
        view.start(r.served)

    try:
        stopped_by = start(settings, make_runner, ready)
    finally:
        view.stop()
    if stopped_by is None:
        return 0
    if stopped_by == signal.SIGINT:
        _line("llmrun: interrupted")
    else:
        _line(f"llmrun serve: stopped ({signal.Signals(stopped_by).name})")
    return STOP_SIGNALS.get(signal.Signals(stopped_by), EXIT_INTERRUPTED)


def _line(text: str) -> None:
    """One line on stderr, whole (a terminal folds it; `say` would fold it at spaces). It may
    name the model file (the served model's id is its name) or a client's words: made safe."""
    print(terminal_line(text), file=sys.stderr, flush=True)


DEFAULT_MAX_CONNECTIONS = 512  # under the usual 1024 open files, far over -np 4 + a queue of 64
MAX_CONNECTIONS = 1_000_000


def parse_max_connections(text: str | None, parallel: int, max_queue: int) -> int:
    """--max-connections: a whole number from 1, or the default for this -np and queue."""
    if text is None:
        return max(DEFAULT_MAX_CONNECTIONS, 2 * (parallel + max_queue))
    value = text.strip()
    if not 1 <= (whole(value) or 0) <= MAX_CONNECTIONS:
        raise BadRequestError(
            f"--max-connections: {text!r} is not a whole number from 1 to {MAX_CONNECTIONS}"
        )
    return int(value)


# ---- the live view and the log ---------------------------------------------------------------


def answered_line(a: Answered) -> str:
    """One answered request, as the log prints it."""
    t = a.timings
    if t is None:
        return f"{a.route} {a.status} {a.note}".rstrip()

    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f}"

    return (
        f"{a.route} {a.status} {t.finish_reason}: prompt {t.prompt_tokens} (reused"
        f" {t.reused_tokens}) out {t.output_tokens} | queue {f(t.queue_ms)} step wait"
        f" {f(t.step_wait_ms)} template {f(t.template_tokenize_ms)} prefill {f(t.prefill_ms)}"
        f" ({len(t.prefill_chunks)} chunks) ttft {f(t.ttft_ms)} decode {f(t.decode_ms)}"
        f" itl p50 {f(t.itl_p(50))} p99 {f(t.itl_p(99))} ms"
    )


def render_serve(snap: Snapshot, width_s: float = 5.0) -> RenderableType:
    """The live panel, a pure function of the engine's snapshot."""
    steps = snap.steps
    span = (steps[-1].end_s - steps[0].end_s + steps[0].duration_s) if steps else 0.0
    decode = sum(s.n_decode for s in steps)
    prefill = sum(s.n_prefill for s in steps)
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column(overflow="fold")  # a word wider than the column folds; nothing is cut
    grid.add_row(
        "sequences",
        f"{snap.decoding} decoding · {snap.prefilling} prefilling ·"
        f" {snap.queued} queued · {snap.n_seq} in all · policy {snap.policy}",
    )
    if steps:
        n = len(steps)
        grid.add_row(
            "per step",
            f"{prefill / n:.1f} prefill + {decode / n:.1f} decode tokens"
            f" ({n} steps in the last {width_s:g} s)",
        )
        grid.add_row(
            "throughput",
            f"{decode / span:.1f} tok/s generated · {prefill / span:.1f} tok/s prefilled"
            if span > 0
            else "-",
        )
    else:
        grid.add_row("per step", "idle")
    itl = list(snap.recent_itl_ms)
    if itl:
        p50, p99 = percentile(itl, 50), percentile(itl, 99)
        grid.add_row("ITL", Text(f"p50 {p50:.1f} ms · p99 {p99:.1f} ms  {sparkline(itl[-24:])}"))
    grid.add_row("served", f"{snap.served} requests · {snap.output_tokens} tokens generated")
    return Group(Text("llmrun serve", style="bold"), grid)


BUSY_WINDOW_S = 5.0  # the log's look at other processes' load


class _View:
    """The live panel on a terminal (log lines scrolling above it), or plain log lines; either
    way drawn by a thread of its own, never by the engine or the event loop."""

    def __init__(self, console: Console | None) -> None:
        self.served: Served | None = None
        self.console = console
        self.live: _TextLive | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.meter = BackgroundMeter(window_s=BUSY_WINDOW_S)
        self.busy = False

    def _lines(self) -> list[str]:
        if self.served is None or (self.live is not None and self._stop.is_set()):
            return []  # the panel is going: its last redraw prints nothing above it
        log = self.served.log
        lines: list[str] = []
        while log:
            lines.append(terminal_line(answered_line(log.popleft())))  # a client's words
        busy = self._busy_line()
        return [*lines, busy] if busy else lines

    def _busy_line(self) -> str | None:
        """A line when the machine turns busy (and when it is quiet again)."""
        background = self.meter.read()
        assert self.served is not None
        busy = self.served.metrics.busy(background)
        if busy == self.busy or background is None:
            return None
        self.busy = busy
        threads = max(self.served.metrics.threads)
        if busy:
            return (
                f"warning: other processes keep {background:.1f} of {logical_cpus()} CPUs"
                f" busy: the engine's {threads} threads wait on them, so requests run slower"
                f" than this machine can; {busy_advice(background, threads)}"
            )
        return f"the machine is quiet again (other processes: {background:.1f} CPUs)"

    def start(self, served: Served) -> None:
        self.served = served
        if self.console is not None:
            self.live = _TextLive(
                self._lines, self.console, lambda: render_serve(served.engine.snapshot())
            )
            self.live.start()
            return
        self._thread = threading.Thread(target=self._plain, name="llmrun-log", daemon=True)
        self._thread.start()

    def _plain(self) -> None:
        while not self._stop.wait(0.25):
            self._flush()

    def _flush(self) -> None:
        for line in self._lines():
            say(f"llmrun serve: {line}")

    def stop(self) -> None:
        self._stop.set()
        if self.live is not None:
            self.live.stop()
            self.live = None
        if self._thread is not None:
            self._thread.join(timeout=2)
        self._flush()


def listen_host(given: str) -> str:
    """--host as the socket takes it: an IPv6 address also as URLs write it (`[::1]`, as the
    server prints its address); one with spaces around it was refused by the resolver, in
    words that dropped the spaces and so blamed a good address."""
    bare = given[1:-1] if given.startswith("[") and given.endswith("]") else given
    if bare != bare.strip() or not bare or not given.isprintable():  # `[ ]` and `[]` too
        raise BadRequestError(f"--host {given!r}: give an address or a name, without spaces")
    return bare
