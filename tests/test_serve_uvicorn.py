"""What runners/serving/uvicorn_patch.py takes from uvicorn's internals is still there, with the
signatures it was written against: one test per override, each failing when a name it relies on
goes or changes. A newer uvicorn outside the pinned range fails the first test: check these,
then widen the pin."""

from __future__ import annotations

import asyncio
import inspect
import re
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

import h11
import pytest
import uvicorn
from packaging.specifiers import SpecifierSet
from uvicorn.protocols.http.h11_impl import H11Protocol, RequestResponseCycle
from uvicorn.server import ServerState

from llmrun.runners.serving import uvicorn_patch
from llmrun.runners.serving.uvicorn_patch import GuardedH11, HttpServer

ROOT = Path(__file__).resolve().parent.parent


def parameters(function: Callable[..., Any]) -> list[str]:
    return list(inspect.signature(function).parameters)


def test_the_installed_uvicorn_is_in_the_pinned_range_and_pyproject_pins_it() -> None:
    pinned = SpecifierSet(",".join(uvicorn_patch.UVICORN_VERSIONS))
    assert version("uvicorn") in pinned
    # the `server` extra's line (tomllib is not in Python 3.10)
    pins = re.findall(r'"uvicorn([^"]*)"', (ROOT / "pyproject.toml").read_text())
    assert [SpecifierSet(p) for p in pins] == [pinned], pins


async def _protocol() -> H11Protocol:
    async def app(scope: Any, receive: Any, send: Any) -> None: ...

    config = uvicorn.Config(app, http=GuardedH11, lifespan="off")
    config.load()
    return GuardedH11(config, ServerState(), {}, asyncio.get_running_loop())


def test_h11_protocol_state_guarded_h11_reads() -> None:
    """GuardedH11 reads the protocol's cycle, h11 connection, transport, loop, app and the
    server's set of connections, and a cycle's `response_complete`."""
    assert parameters(H11Protocol.__init__) == [
        "self",
        "config",
        "server_state",
        "app_state",
        "_loop",
    ]
    protocol = asyncio.run(_protocol())
    for name in ("cycle", "conn", "transport", "loop", "app", "connections"):
        assert hasattr(protocol, name), name
    assert protocol.connections is protocol.server_state.connections
    assert "response_complete" in inspect.getsource(RequestResponseCycle.__init__)
    assert protocol.conn.their_state is h11.IDLE
    assert protocol.conn.trailing_data == (b"", False)  # the bytes h11 holds, not yet parsed
    assert "h11_max_incomplete_event_size" in parameters(uvicorn.Config.__init__)


@pytest.mark.parametrize(
    ("name", "arguments"),
    [
        ("connection_made", ["self", "transport"]),
        ("data_received", ["self", "data"]),
        ("handle_events", ["self"]),
        ("connection_lost", ["self", "exc"]),
        ("send_400_response", ["self", "msg"]),
        ("shutdown", ["self"]),  # HttpServer.shutdown calls it on each connection
    ],
)
def test_h11_protocol_methods_guarded_h11_overrides(name: str, arguments: list[str]) -> None:
    assert parameters(getattr(H11Protocol, name)) == arguments
    if name != "shutdown":
        assert name in vars(GuardedH11)  # still overridden here


def test_the_400_response_is_still_sent_through_send_400_response() -> None:
    """uvicorn answers malformed HTTP from `handle_events` through `send_400_response`."""
    assert "self.send_400_response(" in inspect.getsource(H11Protocol.handle_events)


def test_server_capture_signals() -> None:
    """HttpServer replaces uvicorn's signal handling: a context manager run around serving."""
    assert parameters(uvicorn.Server.capture_signals) == ["self"]
    assert "with self.capture_signals():" in inspect.getsource(
        uvicorn.Server.run
    ) + inspect.getsource(uvicorn.Server.serve)
    server = uvicorn.Server(uvicorn.Config(lambda *a: None))
    for name in ("should_exit", "force_exit", "started", "server_state"):
        assert hasattr(server, name), name


def test_server_startup() -> None:
    """HttpServer.startup installs its accept() error handler, then calls uvicorn's, which
    sets `started` and `servers`."""
    assert parameters(uvicorn.Server.startup) == ["self", "sockets"]
    source = inspect.getsource(uvicorn.Server.startup)
    assert "self.servers" in source and "self.started = True" in source


def test_server_shutdown() -> None:
    """HttpServer.shutdown drains and cuts, then calls uvicorn's; uvicorn calls it after its
    main loop, with the sockets it served."""
    assert parameters(uvicorn.Server.shutdown) == ["self", "sockets"]
    assert "await self.shutdown(sockets=sockets)" in inspect.getsource(uvicorn.Server._serve)
    assert "for server in self.servers:" in inspect.getsource(uvicorn.Server.shutdown)
    assert HttpServer.shutdown is not uvicorn.Server.shutdown
