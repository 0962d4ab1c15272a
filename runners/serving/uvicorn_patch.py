"""Every use of uvicorn's internals by `llmrun serve`, in one place (uvicorn pinned in pyproject's
`server` extra to `UVICORN_VERSIONS`; tests/test_serve_uvicorn.py fails when a name used here
goes or changes its signature).

- `GuardedH11` (h11's protocol): a deadline on each request's headers (slowloris), one limit
  on a request's head however its bytes arrive, malformed HTTP answered in OpenAI's error
  shape, and a connection past `max_connections` served by an app that refuses it. It reads the
  protocol's `cycle`, `conn`, `transport`, `loop`, `app` and `connections`, h11's
  `their_state` and `trailing_data`, and overrides `connection_made`, `data_received`,
  `handle_events`, `connection_lost` and `send_400_response`.
- `HttpServer` (`uvicorn.Server`): llmrun's signals (`capture_signals`), a handler for accept()
  failures installed at `startup`, and a `shutdown` that drains the requests in flight and,
  past the drain or at once on Ctrl-C, a second signal or SIGHUP, has them end with an error
  (`on_cut`) before uvicorn closes their connections. It reads `should_exit`, `force_exit`,
  `started`, `servers` and `server_state.connections`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from http import HTTPStatus
from types import FrameType
from typing import Any

import h11
import uvicorn
from starlette.types import ASGIApp
from uvicorn.protocols.http.h11_impl import H11Protocol

UVICORN_VERSIONS = (">=0.54", "<0.55")  # the versions these overrides were checked against
HEADERS_TIMEOUT_S = 30.0  # from a request's first byte to the end of its headers
CUT_S = 2.0  # the longest wait for cut requests to write their last event
POLL_S = 0.05
# A request's line and headers, at most (h11's default; passed to uvicorn for h11 to use too).
MAX_HEAD_BYTES = 16 * 1024
HEAD_END = re.compile(rb"\n\r?\n")  # the blank line that ends a head, as h11 finds it
# Ctrl-C and SIGHUP stop at once; SIGTERM drains, and a second signal stops at once.
STOP_NOW = (signal.SIGINT, *((signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ()))
SIGNALS = (signal.SIGTERM, *STOP_NOW)


def error_bytes(status: int, message: str) -> bytes:
    """OpenAI's error shape as bytes, for answers written below the ASGI app."""
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": status}
    return json.dumps({"error": error}).encode()


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

    def handle_events(self) -> None:
        """h11 refuses a head over its limit only while the head is incomplete, so whether a
        40 kB path got 404 or 400 depended on how TCP cut it. Measured here on the bytes
        themselves, before h11 parses them, a head over `MAX_HEAD_BYTES` is always a 431."""
        if self.conn.their_state is h11.IDLE and self._head_too_long():
            self._refuse(431, f"the request's line and headers are over {MAX_HEAD_BYTES:,} bytes")
            return
        super().handle_events()

    def _head_too_long(self) -> bool:
        buffered, _ = self.conn.trailing_data
        if len(buffered) <= MAX_HEAD_BYTES:
            return False
        return HEAD_END.search(buffered, 0, MAX_HEAD_BYTES) is None

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
        """Malformed HTTP (a bad request line, header or length): the error in OpenAI's shape
        rather than uvicorn's plain text."""
        self._refuse(400, f"malformed HTTP request ({msg.rstrip('.').lower()})")

    def _refuse(self, status: int, message: str) -> None:
        """Answer `status` below the app, counted and logged, and close the connection."""
        self.on_refused(status, message)
        body = error_bytes(status, message)
        headers = [
            (b"content-type", b"application/json"),
            (b"connection", b"close"),
            (b"content-length", b"%d" % len(body)),
        ]
        with contextlib.suppress(h11.LocalProtocolError):
            for event in (
                h11.Response(status_code=status, headers=headers, reason=_phrase(status)),
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
            # the deadline this connection was given, whatever it is
            slow = error_bytes(
                408, f"the request's headers did not arrive in {self.headers_timeout_s:g} s"
            )
            with contextlib.suppress(Exception):
                self.transport.write(
                    b"HTTP/1.1 408 %s\r\ncontent-type: application/json\r\n"
                    b"connection: close\r\ncontent-length: %d\r\n\r\n%s"
                    % (_phrase(408), len(slow), slow)
                )
            self.transport.close()


def _phrase(status: int) -> bytes:
    return HTTPStatus(status).phrase.encode()


def guarded_protocol(
    on_refused: Callable[[int, str], None], max_connections: int, over_capacity: ASGIApp
) -> type[GuardedH11]:
    """`GuardedH11` for one server: uvicorn makes the protocol from its class alone."""
    return type(
        "ServedH11",
        (GuardedH11,),
        {
            "on_refused": staticmethod(on_refused),
            "max_connections": max_connections,
            "over_capacity": staticmethod(over_capacity),
        },
    )


class HttpServer(uvicorn.Server):
    """uvicorn's server with llmrun's signals: SIGTERM drains the requests in flight (for at most
    `drain_s`); SIGINT, SIGHUP or a second signal stops at once. Requests still in flight then
    are cut (`on_cut`: they end with an error of their own) before uvicorn closes their
    connections. `stopped_by` says which signal ended it."""

    def __init__(
        self,
        config: uvicorn.Config,
        *,
        drain_s: float,
        in_flight: Callable[[], int],
        on_cut: Callable[[], None],
        on_ready: Callable[[], None],
        on_note: Callable[[str], None],
    ) -> None:
        super().__init__(config)
        self.drain_s = drain_s
        self.in_flight, self.on_cut = in_flight, on_cut
        self.on_ready = on_ready
        self.on_note = on_note  # a line for the log, not a request
        self.stopped_by: int | None = None

    @property
    def connections(self) -> int:
        return len(self.server_state.connections)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handle(sig: int, frame: FrameType | None) -> None:
            if self.stopped_by is None:
                self.stopped_by = sig
            if sig in STOP_NOW or self.should_exit:
                self.force_exit = True
            self.should_exit = True

        before = {sig: signal.signal(sig, handle) for sig in SIGNALS}
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

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """Stop accepting, let the requests in flight finish (at most `drain_s`, not at all once
        forced), cut the rest and give them `CUT_S` to write their end; then uvicorn's own
        shutdown closes what is left."""
        if self.in_flight():
            loop = asyncio.get_running_loop()
            for server in self.servers:
                server.close()
            for connection in list(self.server_state.connections):
                connection.shutdown()  # idle ones close; busy ones close after their answer
            deadline = loop.time() + self.drain_s
            while self.in_flight() and not self.force_exit and loop.time() < deadline:
                await asyncio.sleep(POLL_S)
            if self.in_flight():
                self.on_cut()
                deadline = loop.time() + CUT_S
                while self.in_flight() and loop.time() < deadline:
                    await asyncio.sleep(POLL_S)
        await super().shutdown(sockets)

    def _loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """Out of open files (or socket memory), asyncio stops accepting for a second and
        tries again; its default handler would print a traceback each time. One log line
        instead (no request was answered: not counted); anything else goes to the default."""
        error = context.get("exception")
        if context.get("message", "").startswith("socket.accept()") and isinstance(error, OSError):
            self.on_note(
                f"a connection waits to be accepted: {error.strerror or error}"
                f" ({self.connections} open)"
            )
            return
        loop.default_exception_handler(context)
