"""llama.cpp's RPC backend (issue 31 item 4): `make rpc-server`'s build, `llmrun rpc-server`,
`--rpc` on run, chat, serve and bench, and a server that stops answering mid-run.

The quick tests parse and refuse; the others build the backend once (`rpc_build`: slow, about
20 s) and start real `rpc-server`s on free loopback ports, with the embedded model split across
them and this machine's CPU."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

import pytest
from typer.testing import CliRunner

from llmrun.cli.app import app
from llmrun.cli.report import memory_text, summary_rows
from llmrun.runners import rpc
from llmrun.runners.errors import BadRequestError, EngineAbortError, LlmrunError
from llmrun.runners.limits import engine_bounds
from llmrun.runners.load_record import layers_by_device, memory_report
from llmrun.runners.stats import GenerationStats

from .conftest import (
    HANG_S,
    ROOT,
    free_port,
    llmrun_code_runs,
    popen_then_ctrl_c,
    which_llmrun,
)
from .fake import FAKE_SETTINGS

PROMPT = "Write a haiku about rivers."


# ---- quick: no model, no process ----------------------------------------------------------


def test_endpoints_are_host_port_lists() -> None:
    got = rpc.parse_endpoints("127.0.0.1:50052, box:1")
    assert [str(e) for e in got] == ["127.0.0.1:50052", "box:1"]


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "empty item"),
        ("a:1,,b:2", "empty item"),
        ("a:1,", "empty item"),
        ("localhost", "not host:port"),
        (":50052", "not host:port"),
        ("a:0", "1 to 65535"),
        ("a:65536", "1 to 65535"),
        ("a:port", "1 to 65535"),
        ("a b:1", "no host"),
        ("a:1,a:1", "named twice"),
        # ggml-rpc splits at the first ':' and connects over IPv4: its parser would abort
        ("[::1]:50052", "IPv6 address: llama.cpp's RPC connects over IPv4 only"),
        ("::1:50052", "IPv6"),
        # a URL and a second port were called IPv6 addresses
        ("http://127.0.0.1:1", "'http://127.0.0.1:1' is not host:port"),
        ("host:1:2", "'host:1:2' is not host:port"),
        ("box:50052/x", "not host:port"),
        # the `[` of an escape sequence was taken for IPv6's brackets
        ("\x1b[31m:5", "'\\\\x1b\\[31m:5' is not host:port"),
        ("a\tb:5", "is not host:port"),
    ],
)
def test_bad_endpoints_are_refused_by_what_is_wrong(text: str, says: str) -> None:
    with pytest.raises(rpc.RpcEndpointError, match=says):
        rpc.parse_endpoints(text)


@pytest.mark.parametrize(
    "args",
    [
        ["run", "--rpc", "a:1,,b:2", "hi"],
        ["run", "-rpc", "host", "hi"],
        ["chat", "--rpc", "a:99999"],
        ["serve", "--rpc", "a:1,a:1"],
        ["bench", "-rpc", "a:0"],
        ["bench", "--rpc", "a:1,"],
    ],
)
def test_rpc_parsing_errors_are_usage_errors(args: list[str]) -> None:
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 2, done.output
    assert "rpc" in done.stderr


def test_rpc_is_a_local_engine_option(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLMRUN_ENDPOINT", raising=False)
    done = CliRunner().invoke(app, ["run", "--endpoint", "http://127.0.0.1:9", "--rpc", "a:1", "x"])
    assert done.exit_code == 2
    assert "-rpc/--rpc" in done.stderr and "--endpoint" in done.stderr


def test_unbuilt_backend_names_make_rpc_server(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("LLMRUN_RPC_DIR", str(tmp_path))
    done = CliRunner().invoke(app, ["rpc-server", "-p", str(free_port())])
    assert done.exit_code == 1
    (line,) = done.stderr.strip().splitlines()
    assert "make rpc-server" in line and line.startswith("llmrun: error:")


def test_unreachable_server_is_one_line_before_any_load(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The connection is tried before ggml-rpc's, which aborts the process when it fails."""
    monkeypatch.setenv("LLMRUN_RPC_DIR", str(tmp_path))
    (tmp_path / rpc.version()).mkdir()
    (tmp_path / rpc.version() / rpc.LIBRARY).write_bytes(b"")  # never opened: the check is first
    with pytest.raises(rpc.RpcUnreachableError, match=r"127\.0\.0\.1:\d+ cannot be reached"):
        rpc.attach(rpc.parse_endpoints(f"127.0.0.1:{free_port()}"))


def test_a_host_that_does_not_resolve_is_one_line_before_any_load(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("LLMRUN_RPC_DIR", str(tmp_path))
    (tmp_path / rpc.version()).mkdir()
    (tmp_path / rpc.version() / rpc.LIBRARY).write_bytes(b"")
    with pytest.raises(rpc.RpcUnreachableError, match=r"cannot resolve 'no-such-host\.invalid'"):
        rpc.attach(rpc.parse_endpoints("no-such-host.invalid:50052"))


class _Junk:
    """A port that accepts TCP and then does what no rpc-server does: `answer` is written to
    each connection (b"": it is closed at once; None: nothing is ever said)."""

    def __init__(self, answer: bytes | None) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = int(self.sock.getsockname()[1])
        self.answer = answer
        self.held: list[socket.socket] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self._handle(conn)

    def _handle(self, conn: socket.socket) -> None:
        if self.answer is None:
            self.held.append(conn)  # silent, open
            return
        with conn:
            conn.sendall(self.answer)

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


@pytest.mark.parametrize(
    ("answer", "says"),
    [
        (b"", "closed the connection at llama.cpp's RPC handshake"),
        (b"HTTP/1.1 400 Bad Request\r\n\r\n" * 4, "is not an rpc-server's"),
        (struct.pack("<Q", 28) + bytes([3, 0, 0, 0]) + bytes(24), "RPC protocol is 3.0.0"),
        (None, "no answer to llama.cpp's RPC handshake in 0.5 s"),
    ],
)
def test_a_port_that_is_not_an_rpc_server_is_one_line_not_an_abort_or_a_hang(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, answer: bytes | None, says: str
) -> None:
    """ggml-rpc's own handshake would abort the process on these answers, or wait forever."""
    monkeypatch.setenv("LLMRUN_RPC_DIR", str(tmp_path))
    monkeypatch.setattr(rpc, "CONNECT_TIMEOUT_S", 0.5)
    (tmp_path / rpc.version()).mkdir()
    (tmp_path / rpc.version() / rpc.LIBRARY).write_bytes(b"")
    junk = _Junk(answer)
    try:
        with pytest.raises(rpc.RpcUnreachableError, match=re.escape(says)) as told:
            rpc.attach(rpc.parse_endpoints(f"127.0.0.1:{junk.port}"))
        assert str(told.value).startswith(f"--rpc: RPC server 127.0.0.1:{junk.port} cannot be used")
    finally:
        junk.close()
    assert rpc.attached() == ()


class _AfterHello(_Junk):
    """A server that answers ggml-rpc's HELLO as an rpc-server of this protocol does, then
    answers the next request (the device count llama.cpp asks for) with `answer` (None:
    nothing, the connection held open; b"": the connection closed)."""

    def _handle(self, conn: socket.socket) -> None:
        threading.Thread(target=self._talk, args=(conn,), daemon=True).start()

    def _talk(self, conn: socket.socket) -> None:
        def request() -> None:
            _, size = struct.unpack("<BQ", rpc._recv_exactly(conn, 9))
            rpc._recv_exactly(conn, size)

        try:
            request()  # HELLO
            conn.sendall(
                struct.pack("<Q", 4 + rpc.RPC_CONN_CAPS_SIZE)
                + bytes([rpc.RPC_PROTO_MAJOR_VERSION, 0, 0, 0])
                + bytes(rpc.RPC_CONN_CAPS_SIZE)
            )
            request()
        except (OSError, EOFError):
            conn.close()
            return
        if self.answer is None:
            self.held.append(conn)  # silent, open
            return
        with conn, contextlib.suppress(OSError):
            conn.sendall(self.answer)


def _fake_backend(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """An RPC build that is a name only: the servers are checked before it is ever opened."""
    monkeypatch.setenv("LLMRUN_RPC_DIR", str(tmp_path))
    (tmp_path / rpc.version()).mkdir()
    (tmp_path / rpc.version() / rpc.LIBRARY).write_bytes(b"")


def test_a_server_silent_after_the_handshake_is_one_line_after_the_wait_limit(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """ggml-rpc asks for the device count right after HELLO and waits for it forever, before
    any deadline of llmrun's could be put on its socket (the run hung, SIGTERM ignored): the
    question is asked here first, under LLMRUN_RPC_TIMEOUT_S."""
    _fake_backend(monkeypatch, tmp_path)
    monkeypatch.setenv(rpc.TIMEOUT_ENV, "1")
    server = _AfterHello(None)
    started = time.monotonic()
    try:
        with pytest.raises(rpc.RpcSilentError) as told:
            rpc.attach(rpc.parse_endpoints(f"127.0.0.1:{server.port}"))
    finally:
        server.close()
    assert time.monotonic() - started < 10
    assert str(told.value) == (
        f"RPC server 127.0.0.1:{server.port} stopped answering after the handshake"
        " (no reply in 1 s; LLMRUN_RPC_TIMEOUT_S)"
    )
    assert rpc.attached() == ()


@pytest.mark.parametrize(
    ("answer", "says"),
    [
        (struct.pack("<QI", 4, 0xFFFFFFFF), "it says it has 4294967295 devices (at most 256)"),
        (struct.pack("<QI", 4, 0), "it offers no device"),
        (struct.pack("<Q", 2**40), "its answer to llama.cpp's device query is not"),
        (b"", "it closed the connection after llama.cpp's RPC handshake"),
    ],
)
def test_a_device_count_no_rpc_server_gives_is_refused_before_llama_cpp_takes_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, answer: bytes, says: str
) -> None:
    """ggml-rpc takes any count (a device object each: 4294967295 of them) and aborts on a
    reply of another size: the answer is checked here first."""
    _fake_backend(monkeypatch, tmp_path)
    monkeypatch.setenv(rpc.TIMEOUT_ENV, "5")
    server = _AfterHello(answer)
    try:
        with pytest.raises(rpc.RpcUnreachableError, match=re.escape(says)) as told:
            rpc.attach(rpc.parse_endpoints(f"127.0.0.1:{server.port}"))
    finally:
        server.close()
    assert str(told.value).startswith(f"--rpc: RPC server 127.0.0.1:{server.port} cannot be used")
    assert rpc.attached() == ()


def test_connections_opened_during_the_load_get_the_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The load opens ggml-rpc's connections as it goes (the handshake's own is closed by
    then): each one gets LLMRUN_RPC_TIMEOUT_S's deadline as it opens, not after the load."""
    server = _Junk(None)
    monkeypatch.setitem(rpc._peers, ("127.0.0.1", server.port), rpc.Endpoint("127.0.0.1", 1))
    try:
        with rpc.bounding(1.0, every_s=0.05):
            conn = socket.create_connection(("127.0.0.1", server.port))  # as ggml-rpc's
            time.sleep(0.3)
            started = time.monotonic()
            with conn, pytest.raises(OSError):  # EAGAIN: SO_RCVTIMEO's end, not a hang
                conn.recv(1)
    finally:
        server.close()
    assert 0.5 < time.monotonic() - started < 5


def test_run_with_a_server_silent_after_the_handshake_ends_in_one_line(
    tmp_path: Path, llmrun_env: dict[str, str]
) -> None:
    """The tester's case end to end: `run --rpc` against a server that greets and then says
    nothing ends in one line and exit 1 soon after LLMRUN_RPC_TIMEOUT_S, not never."""
    (tmp_path / "rpc" / rpc.version()).mkdir(parents=True)
    (tmp_path / "rpc" / rpc.version() / rpc.LIBRARY).write_bytes(b"")
    server = _AfterHello(None)
    env = {**llmrun_env, "LLMRUN_RPC_DIR": str(tmp_path / "rpc"), rpc.TIMEOUT_ENV: "2"}
    args = ["run", "--rpc", f"127.0.0.1:{server.port}", "-ngl", "99", "-n", "2", "hi"]
    started = time.monotonic()
    try:
        done = subprocess.run(
            [which_llmrun(), *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
        )
    finally:
        server.close()
    assert time.monotonic() - started < 60
    assert done.returncode == 1, done.stderr
    errors = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert errors == [
        f"llmrun: error: RPC server 127.0.0.1:{server.port} stopped answering after the"
        " handshake (no reply in 2 s; LLMRUN_RPC_TIMEOUT_S)"
    ], done.stderr


@pytest.mark.parametrize("host", ["localhost", "::1", "box.local"])
def test_rpc_server_listens_on_ipv4_addresses_only(host: str) -> None:
    """rpc-server takes its host through inet_addr: a name or an IPv6 address would end it
    at once with a line of its own."""
    with pytest.raises(LlmrunError, match=f"-H/--host '{re.escape(host)}': .* IPv4 address only"):
        rpc.check_listen(host, free_port())


def test_a_host_that_is_no_address_is_a_usage_error_named_visibly(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`rpc-server -H $'\\e[31m'` named the value as empty (`-H :`: the message's escapes are
    taken out on a terminal) and exited 1, after looking for the binary; `--rpc` the same."""
    monkeypatch.setenv("LLMRUN_RPC_DIR", str(tmp_path))  # not built: the host is checked first
    done = CliRunner().invoke(app, ["rpc-server", "-H", "\x1b[31m\u202e"])
    assert done.exit_code == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("llmrun: error: -H/--host '\\x1b[31m\\u202e': llama.cpp's"), line
    with pytest.raises(rpc.RpcEndpointError, match=re.escape("--rpc: '\\x1b[31m' is not")):
        rpc.parse_endpoint("\x1b[31m")


def test_rpc_server_on_a_port_in_use_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    # the binary is looked for first: a stand-in, so that the port's check is reached whether
    # or not `make rpc-server` has run here (the port is refused before anything starts)
    monkeypatch.setattr(rpc, "server_binary", lambda: Path("/nonexistent/rpc-server"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = int(busy.getsockname()[1])
        done = CliRunner().invoke(app, ["rpc-server", "-p", str(port)])
    assert done.exit_code == 1
    (line,) = done.stderr.strip().splitlines()
    assert line == f"llmrun: error: cannot listen on 127.0.0.1:{port}: Address already in use"


def test_a_ctrl_c_inside_popen_stops_the_server_it_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, llmrun_env: dict[str, str]
) -> None:
    """A Ctrl-C that lands after the fork, before Popen returns (a window a loaded machine
    widens): held back until the child is llmrun's, then it stops the server and exits 130.
    Raised inside Popen, it left the server running with llmrun's stderr open, and a supervisor
    reading that to the end waited forever. (llmrun_env: a process starts.)"""
    stand_in = tmp_path / "rpc-server"
    stand_in.write_text("#!/bin/sh\nexec sleep 600\n")
    stand_in.chmod(0o755)
    monkeypatch.setattr(rpc, "server_binary", lambda: stand_in)
    started = popen_then_ctrl_c(monkeypatch)
    try:
        done = CliRunner().invoke(app, ["rpc-server", "-p", str(free_port())])
        assert done.exit_code == 130, done.stderr
        assert started[0].poll() is not None  # stopped, and waited for
    finally:
        for child in started:
            if child.poll() is None:
                child.kill()
                child.wait()


@pytest.mark.parametrize("port", ["0", "65536"])
def test_rpc_server_ports_outside_1_65535_are_usage_errors(port: str) -> None:
    done = CliRunner().invoke(app, ["rpc-server", "-p", port])
    assert done.exit_code == 2 and "--port" in done.stderr


def test_rpc_server_threads_are_bound_as_the_engine_s() -> None:
    """-t is the engine's thread option, bound by this machine (not rpc-server's own 1..1024):
    one more than the engine takes is a usage error before any server starts."""
    too_many = engine_bounds("n_threads")["max"] + 1
    done = CliRunner().invoke(app, ["rpc-server", "-t", str(too_many)])
    assert done.exit_code == 2 and "--threads" in done.stderr


# one run's stats without servers: 10 prompt tokens, 2 reused, 5 out (4 steps of 20 ms)
_LOCAL_RUN = GenerationStats(
    finish_reason="length",
    prompt_tokens=10,
    reused_tokens=2,
    output_tokens=5,
    template_tokenize_s=0.001,
    prefill_s=0.01,
    first_sample_s=0.001,
    itl_s=(0.02, 0.02, 0.02, 0.02),
    e2e_s=0.1,
    load_s=1.0,
)


def test_the_network_figure_is_in_the_records_and_the_summary_only_with_rpc() -> None:
    """run's and chat's summaries and records name bytes per token as bench's records do."""
    plain = _LOCAL_RUN
    record = plain.to_dict()
    assert not [k for k in record if k.startswith("rpc")]
    assert not [row for row in summary_rows(plain) if row[0] == "network"]
    split = dataclasses.replace(plain, rpc_prefill_bytes=8000, rpc_decode_bytes=900_000)
    record = split.to_dict()
    assert record["rpc_bytes_per_prompt_token"] == 1000  # 8 new prompt tokens
    assert record["rpc_bytes_per_token"] == 225_000  # 4 tokens after the first
    (row,) = [value for label, value in summary_rows(split) if label == "network"]
    assert row.startswith("225 kB/token decode · 1.0 kB/token prefill")


def test_the_wait_on_the_servers_is_in_the_records_and_the_summary_only_with_rpc() -> None:
    """run's and chat's summaries (chat's /stats is the same summary) and records give the
    decode's share waiting on the servers beside the bytes; nothing of it without --rpc."""
    plain = _LOCAL_RUN
    assert not [k for k in plain.to_dict() if "wait" in k]
    split = dataclasses.replace(
        plain, rpc_prefill_bytes=8000, rpc_decode_bytes=900_000, rpc_decode_wait_s=0.02
    )
    record = split.to_dict()
    assert record["rpc_wait_share"] == 0.25  # 20 ms of the decode's 80
    assert record["rpc_wait_ms_per_token"] == 5.0  # over the 4 tokens after the first
    assert "rpc_decode_wait_s" in record
    (row,) = [value for label, value in summary_rows(split) if label == "network"]
    assert row.startswith("225 kB/token decode · 1.0 kB/token prefill")
    assert row.endswith("25% of the decode waiting on the servers (5.00 ms/token)")
    # the share is a share: a wait over the decode's time (clocks' rounding) is all of it
    over = dataclasses.replace(split, rpc_decode_wait_s=0.0801)
    assert over.rpc_wait_share == 1.0


class _FakeThread:
    """A thread's clocks as the kernel keeps them, in ns: wall, on a CPU, runnable waiting."""

    def __init__(self) -> None:
        self.wall = self.cpu = self.runnable = 0

    def run(self, ns: int) -> None:
        self.wall += ns
        self.cpu += ns

    def preempted(self, ns: int) -> None:
        self.wall += ns
        self.runnable += ns

    def sleep(self, ns: int) -> None:
        self.wall += ns


def test_the_wait_is_wall_time_less_cpu_time_less_run_queue_time() -> None:
    """Computing and being preempted by other load are not waiting on the servers; sleeping
    in the call is. A step whose token ends the decode (after its last token) is left out."""
    assert rpc.run_delay_ns("202883 1500 7\n") == 1500
    assert rpc.blocked_ns(wall_ns=10, on_cpu_ns=4, runnable_ns=3) == 3
    t = _FakeThread()
    wait = rpc.ServerWait(runnable=lambda: t.runnable, on_cpu=lambda: t.cpu, clock=lambda: t.wall)
    wait.count()  # the first token: no step before it
    wait.start()
    t.run(2_000_000)  # the local layers
    t.sleep(3_000_000)  # the servers' layers and the network
    t.preempted(5_000_000)  # another process had the CPU
    wait.stop()
    wait.count()  # its token is an output token
    assert wait.seconds == 0.003
    wait.start()
    t.run(1_000_000)
    t.preempted(1_000_000)
    wait.stop()
    wait.count()
    assert wait.seconds == 0.003  # all-local: nothing waited
    wait.start()
    t.sleep(7_000_000)
    wait.stop()  # its token was the end of the generation: never counted
    assert wait.seconds == 0.003
    # the counters' rounding nets out over the steps, never below zero in all
    wait = rpc.ServerWait(runnable=lambda: 0, on_cpu=lambda: t.cpu, clock=lambda: t.wall)
    wait.start()
    t.cpu += 5
    wait.stop()
    wait.count()
    assert wait.total_ns == -5 and wait.seconds == 0.0


def _busy_wait_s(seconds: float) -> float:
    """ServerWait's figure for a busy loop of `seconds` in this thread."""
    busy = rpc.ServerWait()
    try:
        busy.start()
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass
        busy.stop()
        busy.count()
        return busy.seconds
    finally:
        busy.close()


def test_this_kernel_tells_sleeping_from_computing() -> None:
    """The real counters of this thread: a sleep is waiting, a busy loop is not."""
    if not Path(rpc.SCHEDSTAT).exists():
        pytest.skip("no /proc/thread-self/schedstat here")
    wait = rpc.ServerWait()
    try:
        wait.start()
        time.sleep(0.05)
        wait.stop()
        wait.count()
        assert 0.045 <= wait.seconds < 0.5
    finally:
        wait.close()
    # A busy loop waits on nothing, but other threads of this test process can take the GIL
    # from it now and then (a real sleep): the bound leaves room for that, not for a sleep.
    assert _busy_wait_s(0.05) < 0.02


def test_preemption_by_other_load_is_not_waiting(llmrun_env: dict[str, str]) -> None:
    """With more runnable processes than CPUs the busy loop is preempted: schedstat's
    run-queue time takes that out, where on-CPU time alone would call it a wait."""
    if not Path(rpc.SCHEDSTAT).exists():
        pytest.skip("no /proc/thread-self/schedstat here")
    # Three runnable processes a CPU: the loop is on a CPU about a quarter of its 0.2 s, so
    # on-CPU time alone would call about 0.15 s a wait.
    load = [
        subprocess.Popen(["yes"], stdout=subprocess.DEVNULL, env=llmrun_env)
        for _ in range(3 * (os.cpu_count() or 1))
    ]
    try:
        assert _busy_wait_s(0.2) < 0.05
    finally:
        for p in load:
            p.kill()
            p.wait()


@pytest.mark.parametrize("content", [None, "", "garbage", "12", "1 x 3"])
def test_a_schedstat_that_cannot_be_read_leaves_the_run_delay_out(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, content: str | None
) -> None:
    """No file (a sandbox's /proc), an empty or malformed one: the run delay counts as 0, as
    off Linux, instead of a traceback in the middle of a decode."""
    path = tmp_path / "schedstat"
    if content is not None:
        path.write_text(content)
    monkeypatch.setattr(rpc, "SCHEDSTAT", str(path))
    delay = rpc._RunDelay()
    try:
        assert delay() == 0 and delay() == 0
        assert not delay.available
    finally:
        delay.close()


def test_a_schedstat_read_that_fails_midway_adds_no_wait(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A read refused after the first (seccomp, a closed descriptor): the step's run delay
    is taken as unchanged, not as the whole delay so far turned into a wait."""
    path = tmp_path / "schedstat"
    path.write_text("100 5000000000 7\n")
    monkeypatch.setattr(rpc, "SCHEDSTAT", str(path))
    delay = rpc._RunDelay()
    try:
        assert delay() == 5_000_000_000

        def refused(*_: object) -> bytes:
            raise PermissionError(1, "Operation not permitted")

        monkeypatch.setattr(rpc.os, "pread", refused)
        wait = rpc.ServerWait(runnable=delay, on_cpu=lambda: 0, clock=lambda: 0)
        wait.start()
        wait.stop()
        wait.count()
        assert wait.total_ns == 0 and not delay.available
    finally:
        delay.close()


def test_no_wait_is_measured_without_servers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rpc, "_attached", [])
    assert rpc.server_wait() is None
    monkeypatch.setattr(rpc, "_attached", [rpc.Endpoint("127.0.0.1", 1)])
    wait = rpc.server_wait()
    assert isinstance(wait, rpc.ServerWait)
    wait.close()


def test_an_abort_with_a_server_gone_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    gone = rpc.Endpoint("127.0.0.1", free_port())
    monkeypatch.setattr(rpc, "_attached", [gone])
    told = rpc.explain_abort(EngineAbortError("Remote RPC server crashed (ggml-rpc.cpp:566)"))
    assert isinstance(told, rpc.RpcServerLostError)
    assert str(told).startswith(f"RPC server {gone} stopped answering: Remote RPC")
    shook = rpc.explain_abort(
        EngineAbortError(f"RPC handshake failed for {gone} (ggml-rpc.cpp:550)")
    )
    assert str(shook).startswith(f"RPC server {gone} refused the handshake: its RPC protocol")
    monkeypatch.setattr(rpc, "_attached", [])
    plain = EngineAbortError("GGML_ASSERT(x) failed")
    assert rpc.explain_abort(plain) is plain


def test_a_reset_connection_names_its_server_while_the_dying_one_still_listens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A killed server's connection can reset before its listening socket closes: both still
    take a connection then, and the one whose connection is gone is the lost one."""
    alive, dying = rpc.Endpoint("127.0.0.1", 50001), rpc.Endpoint("127.0.0.1", 50002)
    monkeypatch.setattr(rpc, "_attached", [alive, dying])
    established = bytes([rpc.TCP_ESTABLISHED]) + bytes(231)
    monkeypatch.setattr(rpc, "_connections", lambda: iter([(alive, established)]))
    monkeypatch.setattr(rpc, "_connects", lambda e, timeout_s=1.0: None)
    assert rpc.lost_server() == str(dying)
    monkeypatch.setattr(rpc, "_connections", lambda: iter([]))  # no sockets seen: ask each
    assert rpc.lost_server() is None


def test_records_say_rpc_as_llama_bench() -> None:
    """llama-bench's get_backend: the other non-CPU registries, then RPC; its gpu_info lists
    each RPC device, described by the server's host:port."""
    assert rpc.rpc_backends("CPU", None) == "CPU"
    assert rpc.rpc_backends("CPU", "a:1,b:2") == "RPC"
    assert rpc.rpc_backends("CUDA", "a:1") == "CUDA,RPC"
    assert rpc.rpc_gpu_info("", "a:1,b:2") == "a:1, b:2"
    assert rpc.rpc_gpu_info("NVIDIA H200", "a:1") == "NVIDIA H200, a:1"


def test_layers_are_counted_per_device_from_the_load_log() -> None:
    log = [
        "load_tensors: layer   0 assigned to device CPU, is_swa = 0\n",
        "load_tensors: layer   1 assigned to device RPC0, is_swa = 0\n",
        "load_tensors: layer   2 assigned to device RPC1, is_swa = 0\n",
        "load_tensors: layer   3 assigned to device RPC1, is_swa = 0\n",
    ]
    assert layers_by_device(log) == {"CPU": 1, "RPC0": 1, "RPC1": 2}


def test_the_kv_cache_and_compute_buffers_are_given_per_device() -> None:
    """llama.cpp puts each layer's KV on that layer's device and says so, buffer by buffer:
    the memory line gives each part beside the total, as it gives the weights."""
    server = "RPC0[127.0.0.1:50052]"
    log = [
        "load_tensors:   CPU_Mapped model buffer size =    60.00 MiB\n",
        f"load_tensors: {server} model buffer size =    40.00 MiB\n",
        "llama_kv_cache:        CPU KV buffer size =     2.06 MiB\n",
        f"llama_kv_cache: {server} KV buffer size =     3.56 MiB\n",
        "sched_reserve:        CPU compute buffer size =     8.00 MiB\n",
        f"sched_reserve: {server} compute buffer size =     2.00 MiB\n",
    ]
    m = memory_report(log, 256)
    assert m.kv == {"CPU": round(2.06 * 2**20), server: round(3.56 * 2**20)}
    assert m.kv_bytes == sum(m.kv.values()) and m.compute_bytes == 10 * 2**20
    line = memory_text(dataclasses.replace(FAKE_SETTINGS, memory=m))
    assert f"KV 5.6 MiB (2.1 MiB CPU + 3.6 MiB {server}; " in line, line
    assert f"compute 10.0 MiB (8.0 MiB CPU + 2.0 MiB {server})" in line, line
    alone = memory_report([log[2], log[4]], 256)  # one device: the line as it was
    assert "KV 2.1 MiB (8.2 KiB/token" in memory_text(
        dataclasses.replace(FAKE_SETTINGS, memory=alone)
    )


def test_a_kv_cache_all_on_one_server_names_it() -> None:
    """Every layer on the server (-ngl all, the usual --rpc load): its whole KV cache and most
    compute sit there, not in this machine's memory, and the line says where."""
    server = "RPC0[127.0.0.1:50052]"
    log = [
        "load_tensors:   CPU_Mapped model buffer size =    28.00 MiB\n",
        f"load_tensors: {server} model buffer size =    92.00 MiB\n",
        f"llama_kv_cache: {server} KV buffer size =    90.00 MiB\n",
        f"sched_reserve: {server} compute buffer size =    97.00 MiB\n",
        "sched_reserve:        CPU compute buffer size =     6.00 MiB\n",
    ]
    line = memory_text(dataclasses.replace(FAKE_SETTINGS, memory=memory_report(log, 4096)))
    assert f"KV 90.0 MiB (90.0 MiB {server}; 22.5 KiB/token" in line, line


# ---- the built backend and real servers ----------------------------------------------------


@pytest.fixture(scope="session")
def rpc_build() -> Path:
    """`make rpc-server`'s build (about 20 s once): requesting it marks the test slow and pty."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "rpc_build.py")],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return rpc.rpc_dir()


def test_the_handshake_is_the_installed_llama_cpp_s(llama_cpp_source: Path) -> None:
    """rpc.py's HELLO speaks the protocol of the ggml-rpc that `make rpc-server` builds."""
    rpc_h = (llama_cpp_source / "ggml" / "include" / "ggml-rpc.h").read_text()
    assert re.search(rf"#define RPC_PROTO_MAJOR_VERSION\s+{rpc.RPC_PROTO_MAJOR_VERSION}\b", rpc_h)
    transport = llama_cpp_source / "ggml" / "src" / "ggml-rpc" / "transport.h"
    caps = rf"RPC_CONN_CAPS_SIZE = {rpc.RPC_CONN_CAPS_SIZE};"
    assert caps in transport.read_text()
    source = (llama_cpp_source / "ggml" / "src" / "ggml-rpc" / "ggml-rpc.cpp").read_text()
    assert f"RPC_CMD_HELLO == {rpc.RPC_CMD_HELLO}" in source
    commands = re.search(r"enum rpc_cmd \{(.*?)\}", source, re.S)
    assert commands is not None
    names = re.findall(r"^\s*(RPC_CMD_\w+)", commands.group(1), re.M)
    assert names.index("RPC_CMD_DEVICE_COUNT") == rpc.RPC_CMD_DEVICE_COUNT
    assert names.index("RPC_CMD_GET_DEVICE_MEMORY") == rpc.RPC_CMD_GET_DEVICE_MEMORY


def _wait_listening(port: int, proc: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "rpc-server ended at start"
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"rpc-server did not listen on {port}")


def _start(build: Path, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    proc = subprocess.Popen(
        [str(build / rpc.BINARY), "--port", str(port), "--threads", "1"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    _wait_listening(port, proc)
    return proc, port


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


@pytest.fixture
def two_servers(
    rpc_build: Path, llmrun_env: dict[str, str], model_path: str
) -> Iterator[tuple[list[subprocess.Popen[bytes]], str]]:
    """Two rpc-servers on free loopback ports, and their --rpc value."""
    started = [_start(rpc_build, llmrun_env) for _ in range(2)]
    try:
        yield [p for p, _ in started], ",".join(f"127.0.0.1:{port}" for _, port in started)
    finally:
        for p, _ in started:
            _stop(p)


def _llmrun(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [which_llmrun(), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
        stdin=subprocess.DEVNULL,
    )


def test_greedy_output_split_over_two_servers_is_the_local_output(
    two_servers: tuple[list[subprocess.Popen[bytes]], str], llmrun_env: dict[str, str]
) -> None:
    """31 layers: 10 on each server, 11 (the output layer's) here; the same text, byte for
    byte, as all of them here."""
    _, servers = two_servers
    same = ["run", "--temp", "0", "--seed", "7", "-n", "32", "-c", "256", PROMPT]
    home = Path(llmrun_env["LLMRUN_HOME"]).parent
    local_file, stats_file = home / "local.jsonl", home / "stats.jsonl"
    local = _llmrun([*same, "--stats-file", str(local_file)], llmrun_env)
    split = _llmrun(
        [*same, "-ngl", "20", "--rpc", servers, "--stats-file", str(stats_file)], llmrun_env
    )
    assert local.returncode == 0, local.stderr
    assert split.returncode == 0, split.stderr
    assert split.stdout == local.stdout and local.stdout.strip()
    # the network's part, as bench counts it: each decoded token's logits come back
    assert "network" not in local.stderr
    assert re.search(r"network +\d+ kB/token decode · [\d.]+ kB/token prefill", split.stderr)
    (record,) = [json.loads(line) for line in stats_file.read_text().splitlines()]
    assert record["rpc_bytes_per_token"] > 49152 * 4
    assert 0 < record["rpc_bytes_per_prompt_token"] < record["rpc_bytes_per_token"]
    # and the decode's time waiting on them: 20 of the 31 layers are theirs
    assert 0 < record["rpc_wait_share"] <= 1 and record["rpc_wait_ms_per_token"] > 0
    assert re.search(r"network .* · \d+% of the decode waiting on the servers", split.stderr)
    (plain,) = [json.loads(line) for line in local_file.read_text().splitlines()]
    assert not [k for k in plain if k.startswith("rpc")]
    first, second = servers.split(",")
    assert f"RPC0 {first} (10 layers), RPC1 {second} (10 layers)" in split.stderr
    assert "ngl 20/31" in split.stderr
    assert f"RPC0[{first}]" in split.stderr and f"[{second}]" in split.stderr  # memory line


def test_the_memory_line_names_each_devices_kv_with_rpc(
    two_servers: tuple[list[subprocess.Popen[bytes]], str], llmrun_env: dict[str, str]
) -> None:
    """With -ngl 20, llama.cpp puts 20 of the 31 layers' KV on the servers (its log:
    'llama_kv_cache: RPC0[host:port] KV buffer size'): issue 31 asks every figure to name per
    device its layers and memory, so the KV is not one total."""
    _, servers = two_servers
    first, second = servers.split(",")
    split = _llmrun(
        ["run", "--temp", "0", "-n", "4", "-c", "256", "-ngl", "20", "--rpc", servers, PROMPT],
        llmrun_env,
    )
    assert split.returncode == 0, split.stderr
    (memory,) = [line for line in split.stderr.splitlines() if line.startswith("memory")]
    kv = memory.split(" KV ", 1)[1].split("KiB/token", 1)[0]
    assert f"RPC0[{first}]" in kv and f"[{second}]" in kv, memory  # llama.cpp's buffer names
    # llama.cpp's own log: 'CPU KV buffer size = 2.06 MiB', 11 layers x 256 x 768 bytes
    assert "2.1 MiB CPU" in kv, memory


def test_bench_records_rpc_as_llama_bench(
    two_servers: tuple[list[subprocess.Popen[bytes]], str], llmrun_env: dict[str, str]
) -> None:
    _, servers = two_servers
    args = ["bench", "-rpc", servers, "-ngl", "20", "-p", "8", "-n", "4", "-r", "1", "-o", "jsonl"]
    done = _llmrun([*args, "--no-history"], llmrun_env)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(rows) == 2
    first, second = servers.split(",")
    # the machine's report names the servers' devices as llama-bench's gpu_info does
    report = " ".join(done.stderr.split())  # a narrow stderr folds the row
    assert f"gpu RPC0 {first} (" in report and f"free), RPC1 {second} (" in report
    assert "none usable" not in report
    for row in rows:
        assert row["rpc"] == servers and row["backends"] == "RPC"
        assert row["gpu_info"] == f"{first}, {second}"
        assert row["n_gpu_layers_offloaded"] == 20
    pp, tg = rows
    # the output layer is offloaded first: every decoded token's logits come back over the
    # network (49,152 floats), besides the graph and the activations
    assert tg["rpc_bytes_per_token"] > 49152 * 4
    assert 0 < pp["rpc_bytes_per_token"] < tg["rpc_bytes_per_token"]
    # the decode's share waiting on the servers, where a decode was timed
    assert 0 < tg["rpc_wait_share"] <= 1 and tg["rpc_wait_ms_per_token"] > 0
    assert "rpc_wait_share" not in pp


def _serve_over(
    servers: str, port: int, env: dict[str, str], *args: str
) -> subprocess.Popen[bytes]:
    """`llmrun serve` on `port` with 20 layers over `servers`, one sequence; stderr piped."""
    return subprocess.Popen(
        [
            which_llmrun(),
            "serve",
            "--no-dashboard",
            "--port",
            str(port),
            "-np",
            "1",
            *args,
            "-ngl",
            "20",
            "--rpc",
            servers,
        ],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _rpc_server(port: int, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """`llmrun rpc-server` on `port` with one thread; stderr piped."""
    return subprocess.Popen(
        [which_llmrun(), "rpc-server", "-p", str(port), "-t", "1"],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _started_child(pid: int) -> bool:
    """Whether the process has started a child of its own."""
    try:
        return any(
            (task / "children").read_text().strip() for task in Path(f"/proc/{pid}/task").iterdir()
        )
    except OSError:
        return False


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_serve_names_where_the_layers_went(
    two_servers: tuple[list[subprocess.Popen[bytes]], str], llmrun_env: dict[str, str]
) -> None:
    _, servers = two_servers
    child = _serve_over(servers, free_port(), llmrun_env, "-c", "256")
    try:
        assert child.stderr is not None
        lines = [child.stderr.readline().decode() for _ in range(2)]
        child.send_signal(signal.SIGTERM)
        child.communicate(timeout=HANG_S)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    first, second = servers.split(",")
    assert "listening on" in lines[0], lines
    assert f"RPC0 {first} (10 layers), RPC1 {second} (10 layers) · ngl 20/31" in lines[1]
    assert f"RPC0[{first}]" in lines[1]


def _kill_when_begun(
    argv: list[str],
    env: dict[str, str],
    server: subprocess.Popen[bytes],
    begun: Callable[[IO[bytes]], bytes],
    sig: int = signal.SIGKILL,
) -> tuple[bytes, bytes, str]:
    """Run `llmrun argv`, kill `server` (or send it `sig`) once `begun` has read the first
    output, and return that output, the rest of stdout and stderr; the command must have
    exited 1."""
    child = subprocess.Popen(
        [which_llmrun(), *argv],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert child.stdout is not None
        first = begun(child.stdout)
        assert first, child.communicate(timeout=HANG_S)[1].decode()[-2000:]
        server.send_signal(sig)
        if sig == signal.SIGKILL:
            server.wait(timeout=30)
        out, err = child.communicate(timeout=HANG_S)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 1, err.decode()
    return first, out, err.decode()


def _assert_one_error_naming(text: str, endpoint: str) -> None:
    """No traceback or C backtrace, and one error line: the server that stopped answering."""
    assert "Traceback" not in text and "backtrace" not in text.lower()
    errors = [ln for ln in text.splitlines() if ln.startswith("llmrun: error:")]
    assert len(errors) == 1, text
    assert errors[0].startswith(f"llmrun: error: RPC server {endpoint} stopped"), text


def test_a_server_killed_mid_run_ends_in_one_line_and_keeps_finished_rows(
    two_servers: tuple[list[subprocess.Popen[bytes]], str], llmrun_env: dict[str, str]
) -> None:
    """ggml-rpc aborts the process on a failed send or receive: one line names the server,
    exit 1, and the test that finished before is on stdout and in the history."""
    procs, servers = two_servers
    args = ["bench", "-rpc", servers, "-ngl", "20", "-p", "0", "-n", "4,2048", "-r", "3"]
    first, out, text = _kill_when_begun(
        [*args, "-t", "1", "-o", "jsonl"], llmrun_env, procs[1], lambda f: f.readline()
    )  # tg4 done: tg2048 is under way
    _assert_one_error_naming(text, servers.split(",")[1])
    (row,) = [json.loads(line) for line in (first + out).decode().splitlines()]
    assert row["n_gen"] == 4 and row["rpc"] == servers
    history = _llmrun(["history"], llmrun_env)
    assert history.returncode == 0 and "tg4" in history.stdout, history.stderr


def test_rpc_server_binds_loopback_by_default_and_warns(
    rpc_build: Path, llmrun_env: dict[str, str]
) -> None:
    port = free_port()
    child = _rpc_server(port, llmrun_env)
    try:
        _wait_listening(port, child)
        listening = [
            line.split()[1]
            for line in Path("/proc/net/tcp").read_text().splitlines()[1:]
            if line.split()[3] == "0A"  # LISTEN
        ]
        assert f"0100007F:{port:04X}" in listening  # 127.0.0.1, not 0.0.0.0
        child.send_signal(signal.SIGTERM)
        _, err = child.communicate(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 143
    text = err.decode()
    assert f"RPC server on 127.0.0.1:{port}" in text
    assert "unauthenticated" in text and "Never expose it to an untrusted network" in text


def test_a_server_killed_during_run_ends_in_one_line_and_keeps_the_text(
    two_servers: tuple[list[subprocess.Popen[bytes]], str], llmrun_env: dict[str, str]
) -> None:
    procs, servers = two_servers
    args = ["run", "--temp", "0", "-n", "2000", "-c", "2048", "-ngl", "20", "--rpc", servers]
    first, out, text = _kill_when_begun(
        [*args, "-t", "1", "Count from 1 to 1000, one number per line."],
        llmrun_env,
        procs[0],
        lambda f: f.read(8),  # the text has begun: the decode is under way
    )
    errors = [ln for ln in text.splitlines() if "error" in ln]
    assert errors == [ln for ln in errors if ln.startswith("llmrun: error:")], text
    _assert_one_error_naming(text, servers.split(",")[0])
    assert (first + out).decode().startswith("1")  # what was written is kept


def test_a_server_that_freezes_ends_the_run_in_one_line_after_the_wait_limit(
    two_servers: tuple[list[subprocess.Popen[bytes]], str], llmrun_env: dict[str, str]
) -> None:
    """A stopped server keeps its connection open and never answers: ggml-rpc's sockets have
    no deadline of their own, so the run waited forever and Ctrl-C did not end it. With
    LLMRUN_RPC_TIMEOUT_S the wait fails, and the end is the one line of a lost server."""
    procs, servers = two_servers
    args = ["run", "--temp", "0", "-n", "2000", "-c", "2048", "-ngl", "20", "--rpc", servers]
    try:
        _, _, text = _kill_when_begun(
            [*args, "-t", "1", "Count from 1 to 1000, one number per line."],
            {**llmrun_env, rpc.TIMEOUT_ENV: "3"},
            procs[0],
            lambda f: f.read(8),
            signal.SIGSTOP,
        )
    finally:
        procs[0].send_signal(signal.SIGCONT)
    assert "Traceback" not in text and "backtrace" not in text.lower()
    errors = [ln for ln in text.splitlines() if ln.startswith("llmrun: error:")]
    assert len(errors) == 1 and "stopped answering" in errors[0], text


@pytest.mark.parametrize("value", ["0", "-5", "soon", "1e9", "nan"])
def test_a_wait_limit_out_of_range_is_one_line(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(rpc.TIMEOUT_ENV, value)
    with pytest.raises(BadRequestError, match=r"LLMRUN_RPC_TIMEOUT_S: .* is not 1 to 86400"):
        rpc.wait_limit()
    monkeypatch.setenv(rpc.TIMEOUT_ENV, "2.5")
    assert rpc.wait_limit() == 2.5


def test_a_server_killed_during_serve_ends_it_in_one_line(
    two_servers: tuple[list[subprocess.Popen[bytes]], str], llmrun_env: dict[str, str]
) -> None:
    """ggml-rpc aborts the process: serve cannot answer the request in flight, and exits 1
    with the line naming the server (docs/hardware.md); the client sees the connection end."""
    procs, servers = two_servers
    port = free_port()
    child = _serve_over(servers, port, llmrun_env, "-c", "2048", "-t", "1")
    try:
        assert child.stderr is not None
        started = child.stderr.readline().decode()
        assert "listening on" in started, started + child.communicate(timeout=HANG_S)[1].decode()
        body = json.dumps(
            {
                "messages": [{"role": "user", "content": "Count from 1 to 1000."}],
                "max_tokens": 2000,
                "temperature": 0,
                "stream": True,
            }
        ).encode()
        with socket.create_connection(("127.0.0.1", port), timeout=HANG_S) as c:
            c.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\n"
                + f"Host: 127.0.0.1:{port}\r\nContent-Length: {len(body)}\r\n".encode()
                + b"Content-Type: application/json\r\n\r\n"
                + body
            )
            got = c.recv(4096)  # the stream has begun
            assert b"200" in got.split(b"\r\n")[0], got
            procs[1].send_signal(signal.SIGKILL)
            procs[1].wait(timeout=30)
            while c.recv(65536):  # to the end of the connection
                pass
        _, err = child.communicate(timeout=HANG_S)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 1, err.decode()
    _assert_one_error_naming(err.decode(), servers.split(",")[1])


def test_rpc_server_interrupted_while_it_starts_leaves_nothing_behind(
    rpc_build: Path, llmrun_env: dict[str, str]
) -> None:
    """Ctrl-C (SIGINT to llmrun alone, as a supervisor sends it) as soon as llmrun's own code
    runs, once the server has started, and once it listens: 130, one line, and no rpc-server
    left listening on the port. Each moment is an event, not a delay: a Ctrl-C during
    CPython's own start-up is CPython's (tests/test_trust.py), and a busy machine stretches
    any fixed delay."""
    for moment in ("llmrun's code", "the server started", "the server listens"):
        port = free_port()
        child = _rpc_server(port, llmrun_env)
        try:
            llmrun_code_runs(child)
            deadline = time.monotonic() + HANG_S
            while moment != "llmrun's code" and child.poll() is None:
                if _started_child(child.pid) and (
                    moment == "the server started" or _listening(port)
                ):
                    break
                assert time.monotonic() < deadline, moment
                time.sleep(0.01)
            child.send_signal(signal.SIGINT)
            _, err = child.communicate(timeout=HANG_S)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        text = err.decode()
        assert child.returncode == 130, (moment, text)
        assert "Traceback" not in text, text
        with socket.socket() as s:  # free again: the server went with llmrun
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))


def test_device_memory_with_more_free_than_in_all_is_a_real_servers_answer() -> None:
    """CUDA's unified memory (free from the host) and Vulkan's budget (which usage may pass,
    and the difference wraps) report more free than in all; the pre-flight refused them."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(struct.pack("<Q", 4) + struct.pack("<I", 1))  # one device
        theirs.sendall(struct.pack("<Q", 16) + struct.pack("<QQ", 2**64 - 1, 24 * 2**30))
        assert rpc._query_devices(ours) is None
