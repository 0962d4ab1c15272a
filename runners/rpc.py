"""llama.cpp's RPC backend: layers on other machines' `rpc-server`s, as `--rpc host:port,...`.

llama-cpp-python's wheel is built without RPC, but its libggml loads backends at run time; so
`make rpc-server` (tools/rpc_build.py) compiles the installed version's own ggml-rpc as a
loadable backend, `libggml-rpc.so`, and `rpc-server`, into `rpc_dir()`. Before a model loads,
`attach` does what llama.cpp's common/arg.cpp `add_rpc_devices` does: load the backend into
the libggml that libllama uses, ask it for `ggml_backend_rpc_add_server` and register each
server's devices. llama.cpp then puts them first in its device list (src/llama.cpp: RPC
servers at the front) and -ngl's layers are split over them by their free memory (or -ts).

ggml-rpc aborts the process when a server cannot be reached or stops answering (GGML_ABORT on
a failed connect, send or receive), and waits forever for an answer that never comes. Each
server is first sent ggml-rpc's HELLO and then the device queries llama.cpp makes next, here,
under a timeout, so an unreachable one, a port that is something else, a server of another
protocol, one that freezes after the handshake and one whose answers no rpc-server gives are
one line before anything is loaded; while llama.cpp's own connections are open (the load,
then the run), each send and receive has a deadline (`bound_waits`), and an abort is reported
as the server that stopped answering (the one whose connection closed).

What a run learns of the servers: the bytes over their connections (`traffic`, the kernel's
count) and each decode step's time waiting on them (`ServerWait`, the decoding thread's sleep).

llama.cpp's RPC is unauthenticated and unencrypted: a server must never face an untrusted
network (`WARNING` below, printed where one starts).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import importlib.metadata
import ipaddress
import os
import re
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from .devices import Device, registered
from .errors import BadRequestError, EngineAbortError, LlmrunError, OptionError, visible
from .lists import real, whole

BINARY = "rpc-server"
LIBRARY = "libggml-rpc.so"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 50052
CONNECT_TIMEOUT_S = 5.0
WARNING = (
    "llama.cpp's RPC server is unauthenticated and unencrypted: anyone who can reach its port "
    "can run computations and read or write its memory. Never expose it to an untrusted "
    "network."
)


class RpcEndpointError(OptionError):
    """An --rpc value that is not a list of host:port."""


class RpcNotBuiltError(LlmrunError):
    def __init__(self, what: str) -> None:
        super().__init__(
            f"llama.cpp's RPC backend is not built ({what} not found in {rpc_dir()}): "
            "run `make rpc-server`"
        )


class RpcUnreachableError(LlmrunError):
    def __init__(self, endpoint: str, why: str, *, reached: bool = False) -> None:
        told = (  # reached: it took the connection; its handshake is what failed
            f"cannot be used: {why}"
            if reached
            else f"cannot be reached: {why} (start one there with `llmrun rpc-server`)"
        )
        super().__init__(f"--rpc: RPC server {endpoint} {told}")


class RpcSilentError(LlmrunError):
    """A server that took the handshake and then left llama.cpp's next question unanswered."""

    def __init__(self, endpoint: str, wait_s: float) -> None:
        super().__init__(
            f"RPC server {endpoint} stopped answering after the handshake (no reply in"
            f" {wait_s:g} s; {TIMEOUT_ENV})"
        )


class RpcServerLostError(EngineAbortError):
    """ggml-rpc aborted: a server stopped answering mid-run (or refused the handshake), and
    this is what llmrun says."""

    def __init__(self, endpoint: str, reason: str, what: str = "stopped answering") -> None:
        LlmrunError.__init__(self, f"RPC server {endpoint} {what}: {reason}")
        self.reason = reason


def version() -> str:
    return importlib.metadata.version("llama-cpp-python")


def rpc_dir() -> Path:
    """Where `make rpc-server` puts libggml-rpc.so and rpc-server: $LLMRUN_RPC_DIR, else the
    environment's own llama-rpc/ (.venv/llama-rpc), per llama-cpp-python version."""
    base = os.environ.get("LLMRUN_RPC_DIR") or str(Path(sys.prefix) / "llama-rpc")
    return Path(base) / version()


def server_binary(name: str = BINARY) -> Path:
    """rpc-server's path, or another file `make rpc-server` builds (RpcNotBuiltError without)."""
    path = rpc_dir() / name
    if not path.is_file():
        raise RpcNotBuiltError(name)
    return path


def check_host(host: str) -> None:
    """That rpc-server can listen on `host`: an IPv4 address (it takes nothing else:
    inet_addr); a usage error (exit 2) naming the value, its control characters escaped."""
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        raise OptionError(
            f"-H/--host '{visible(host)}': llama.cpp's rpc-server listens on an IPv4 address"
            " only (e.g. 127.0.0.1, 0.0.0.0 or this machine's 192.168.1.2)"
        ) from None


def check_listen(host: str, port: int) -> None:
    """That rpc-server will be able to listen on host:port (it returns quietly when not): an
    IPv4 address (it takes nothing else: inet_addr), and a port free to bind."""
    check_host(host)
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as e:
        raise LlmrunError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def parse_endpoint(text: str) -> Endpoint:
    """'host:port', an IPv4 address or a host name, as ggml-rpc takes it: it splits at the first
    ':' and connects over IPv4 (AF_INET, gethostbyname), so an IPv6 address is refused here
    by name instead of ending the process in ggml's "Failed to parse endpoint" abort."""
    host, sep, port = text.strip().rpartition(":")
    # [::1] or ::1; a `[` of an escape sequence (ESC [ 31 m) is none, host:1:2 is none either
    ipv6 = host.startswith("[") or host.count(":") > 1
    # a URL, host:1:2, or a host with a control character is no host:port
    if (
        not sep
        or not host
        or "://" in text
        or "/" in port
        or (":" in host and not ipv6)
        or not host.isprintable()
    ):
        raise RpcEndpointError(
            f"--rpc: '{visible(text)}' is not host:port (e.g. 192.168.1.2:50052)"
        )
    if ipv6:
        raise RpcEndpointError(
            f"--rpc: '{visible(text)}' is an IPv6 address: llama.cpp's RPC connects over IPv4 only"
            " (an IPv4 address, or a host name that has one)"
        )
    if not host or any(c.isspace() for c in host) or ("," in host):
        raise RpcEndpointError(f"--rpc: '{visible(text)}' has no host")
    number = whole(port)
    if number is None or not 1 <= number <= 65535:
        raise RpcEndpointError(
            f"--rpc: '{visible(text)}': the port must be a number from 1 to 65535"
        )
    return Endpoint(host, number)


def parse_endpoints(text: str) -> tuple[Endpoint, ...]:
    """'host:port[,host:port...]' as llama.cpp's --rpc takes it; no empty item, no repeat."""
    items = text.split(",")
    if any(not item.strip() for item in items):
        raise RpcEndpointError(f"--rpc: '{visible(text)}' has an empty item (host:port,host:port)")
    if len(items) > 16:  # GGML_RPC_MAX_SERVERS; before the pairs are compared
        raise RpcEndpointError("--rpc: at most 16 servers")
    endpoints = tuple(parse_endpoint(item) for item in items)
    for i, e in enumerate(endpoints):
        if e in endpoints[:i]:
            raise RpcEndpointError(f"--rpc: {e} is named twice")
    return endpoints


def _ipv4(endpoint: Endpoint) -> tuple[str, int] | str:
    """The address ggml-rpc connects to (IPv4: gethostbyname), else why there is none."""
    try:
        found = socket.getaddrinfo(endpoint.host, endpoint.port, socket.AF_INET, socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        return f"cannot resolve '{endpoint.host}' to an IPv4 address ({why})"
    return str(found[0][4][0]), int(found[0][4][1])


def _connects(endpoint: Endpoint, timeout_s: float = CONNECT_TIMEOUT_S) -> str | None:
    """None when a TCP connection to the server opens, else why not."""
    address = _ipv4(endpoint)
    if isinstance(address, str):
        return address
    try:
        with socket.create_connection(address, timeout=timeout_s):
            return None
    except TimeoutError:
        return f"no answer in {timeout_s:g} s"
    except OSError as e:
        return e.strerror or str(e)


# ggml-rpc's HELLO, the first message of every connection (ggml-rpc.cpp negotiate_hello), and
# the device queries ggml_backend_rpc_add_server and the offload plan make right after it (the
# numbers are the installed llama.cpp's ggml-rpc.cpp, ggml-rpc.h and transport.h, checked by
# tests/test_rpc.py)
RPC_CMD_GET_DEVICE_MEMORY = 11
RPC_CMD_HELLO = 14
RPC_CMD_DEVICE_COUNT = 15
RPC_PROTO_MAJOR_VERSION = 7
RPC_CONN_CAPS_SIZE = 24
# More devices than any machine has: a count above it is a broken or hostile server's, which
# ggml-rpc would take as is (a device object each, billions of them)
MAX_SERVER_DEVICES = 256


def _recv_exactly(s: socket.socket, size: int) -> bytes:
    """EOFError when the server closes the connection first."""
    data = b""
    while len(data) < size:
        got = s.recv(size - len(data))
        if not got:
            raise EOFError
        data += got
    return data


class _BadReply(Exception):
    """An answer of a size or value no rpc-server gives."""


def _ask(s: socket.socket, cmd: int, request: bytes, size: int) -> bytes:
    """One ggml-rpc request and its answer of `size` bytes (_BadReply for another size)."""
    s.sendall(struct.pack("<BQ", cmd, len(request)) + request)
    if struct.unpack("<Q", _recv_exactly(s, 8))[0] != size:
        raise _BadReply
    return _recv_exactly(s, size)


def _query_devices(s: socket.socket) -> str | None:
    """The device count and each device's memory, as llama.cpp asks for them right after the
    handshake: None when the answers are an rpc-server's, else what is wrong with them."""
    (count,) = struct.unpack("<I", _ask(s, RPC_CMD_DEVICE_COUNT, b"", 4))
    if count == 0:
        return "it offers no device"
    if count > MAX_SERVER_DEVICES:
        return (
            f"it says it has {count} devices (at most {MAX_SERVER_DEVICES}): not an"
            " rpc-server's answer"
        )
    for device in range(count):  # answered in time and of the right size; any figures go:
        # real servers report more free than in all (CUDA's unified memory takes free from
        # the host, Vulkan's budget minus usage wraps below zero)
        _ask(s, RPC_CMD_GET_DEVICE_MEMORY, struct.pack("<I", device), 16)
    return None


def _hello(endpoint: Endpoint, wait_s: float | None = None) -> None:
    """That the server answers ggml-rpc's handshake as an rpc-server of this protocol, and
    then the device queries llama.cpp makes next (RpcUnreachableError, else). ggml-rpc's own
    client aborts the process on a bad answer and waits forever for a missing one (an
    rpc-server serves one client at a time; a port that is something else; a server that
    freezes after the handshake), and takes any device count it is told: this one has a
    timeout, CONNECT_TIMEOUT_S for the connection and the handshake and `wait_s` (default
    LLMRUN_RPC_TIMEOUT_S) for each answer after it, and then the client's runs."""
    timeout_s = CONNECT_TIMEOUT_S  # read when called
    wait_s = wait_limit() if wait_s is None else wait_s
    why = _connects(endpoint, timeout_s)
    if why is not None:
        raise RpcUnreachableError(str(endpoint), why)
    address = _ipv4(endpoint)
    assert not isinstance(address, str)  # it just connected
    greeted = False
    try:
        with socket.create_connection(address, timeout=timeout_s) as s:
            s.sendall(
                struct.pack("<BQ", RPC_CMD_HELLO, RPC_CONN_CAPS_SIZE) + bytes(RPC_CONN_CAPS_SIZE)
            )
            head = _recv_exactly(s, 8)
            if struct.unpack("<Q", head)[0] != 4 + RPC_CONN_CAPS_SIZE:  # rpc_msg_hello_rsp
                why = "its answer to llama.cpp's RPC handshake is not an rpc-server's"
            else:
                answer = _recv_exactly(s, 4 + RPC_CONN_CAPS_SIZE)
                if answer[0] != RPC_PROTO_MAJOR_VERSION:
                    major, minor, patch = answer[:3]
                    why = (
                        f"its RPC protocol is {major}.{minor}.{patch}, this llama.cpp's"
                        f" {RPC_PROTO_MAJOR_VERSION}.x: run the same llama-cpp-python version"
                        " (and `make rpc-server`) on every machine"
                    )
                else:
                    greeted = True
                    s.settimeout(wait_s)
                    why = _query_devices(s)
    except TimeoutError:
        if greeted:
            raise RpcSilentError(str(endpoint), wait_s) from None
        why = (
            f"no answer to llama.cpp's RPC handshake in {timeout_s:g} s (an rpc-server serves"
            " one client at a time: is another one using it?)"
        )
    except _BadReply:
        why = "its answer to llama.cpp's device query is not an rpc-server's"
    except (ConnectionResetError, BrokenPipeError, EOFError):
        why = (
            "it closed the connection after llama.cpp's RPC handshake"
            if greeted
            else "it closed the connection at llama.cpp's RPC handshake: not an rpc-server?"
        )
    except OSError as e:
        why = e.strerror or str(e)
    if why is not None:
        raise RpcUnreachableError(str(endpoint), why, reached=True)


_attached: list[Endpoint] = []
_handles: list[object] = []  # the CDLLs and function types, kept referenced


def attached() -> tuple[Endpoint, ...]:
    """The servers whose devices are registered in this process, in order."""
    return tuple(_attached)


def _ggml(name: str = "libggml") -> ctypes.CDLL:
    """The libggml (or libggml-base) that libllama uses: opened by its soname, which the loader
    matches to the copy already mapped as libllama's dependency (a path would map a second
    copy, with a device registry of its own that llama.cpp never sees); elsewhere than Linux,
    the wheel's file."""
    from .library import llama_lib

    lib_dir = Path(llama_lib().__file__).parent / "lib"
    for candidate in (f"{name}.so.0", str(lib_dir / f"{name}.dylib"), str(lib_dir / f"{name}.so")):
        with contextlib.suppress(OSError):
            return ctypes.CDLL(candidate)
    raise RpcNotBuiltError(f"{name} of llama-cpp-python")


def attach(endpoints: tuple[Endpoint, ...]) -> None:
    """Register each server's devices in llama.cpp's device list (once per process and
    server), after checking that every one of them answers."""
    new = [e for e in endpoints if e not in _attached]
    if not new:
        return
    library = server_binary(LIBRARY)
    for e in new:
        _hello(e)
        with contextlib.suppress(OSError):
            for *_, address in socket.getaddrinfo(e.host, e.port, type=socket.SOCK_STREAM):
                _peers[(str(address[0]), int(address[1]))] = e
    g = _ggml()
    vp = ctypes.c_void_p
    g.ggml_backend_reg_by_name.restype, g.ggml_backend_reg_by_name.argtypes = vp, [ctypes.c_char_p]
    g.ggml_backend_load.restype, g.ggml_backend_load.argtypes = vp, [ctypes.c_char_p]
    g.ggml_backend_register.restype, g.ggml_backend_register.argtypes = None, [vp]
    base = _ggml("libggml-base")
    get_proc = base.ggml_backend_reg_get_proc_address
    get_proc.restype, get_proc.argtypes = vp, [vp, ctypes.c_char_p]
    reg = g.ggml_backend_reg_by_name(b"RPC") or g.ggml_backend_load(str(library).encode())
    if not reg:
        raise RpcNotBuiltError(f"a loadable {LIBRARY}")
    address = get_proc(reg, b"ggml_backend_rpc_add_server")
    if not address:
        raise RpcNotBuiltError(f"ggml_backend_rpc_add_server in {LIBRARY}")
    add_server = ctypes.CFUNCTYPE(vp, ctypes.c_char_p)(address)
    _handles.extend([g, base, add_server])
    _watch_aborts()
    for e in new:
        _attached.append(e)  # before the call: a server lost during it is named too
        server_reg = add_server(str(e).encode())
        if not server_reg:
            _attached.remove(e)
            raise RpcUnreachableError(str(e), "it offers no device")
        g.ggml_backend_register(server_reg)


@dataclass(frozen=True)
class Traffic:
    """What went over the process's connections to the RPC servers so far, by the kernel's
    count (TCP_INFO): bytes the servers acknowledged, and bytes received."""

    sent: int
    received: int

    @property
    def bytes(self) -> int:
        return self.sent + self.received

    def since(self, before: Traffic) -> Traffic:
        return Traffic(self.sent - before.sent, self.received - before.received)

    def plus(self, other: Traffic) -> Traffic:
        return Traffic(self.sent + other.sent, self.received + other.received)


_peers: dict[tuple[str, int], Endpoint] = {}  # the servers' addresses, resolved when attached


def _sockets() -> Iterator[tuple[Endpoint, socket.socket]]:
    """Each open TCP connection to an attached server (ggml-rpc's sockets, found in
    /proc/self/fd), as a socket object on a duplicate of its descriptor (closed after each
    step: its options are the connection's own); nothing where /proc is not there."""
    if not os.path.isdir("/proc/self/fd"):
        return
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(int(fd)))
        except (OSError, ValueError):
            continue
        with s:
            try:
                if s.type != socket.SOCK_STREAM:
                    continue
                peer = _peers.get(s.getpeername()[:2])
            except OSError:
                continue
            if peer is not None:
                yield peer, s


def _connections() -> Iterator[tuple[Endpoint, bytes]]:
    """Each open TCP connection to an attached server with its TCP_INFO; nothing where
    Linux's TCP_INFO is not there."""
    if not hasattr(socket, "TCP_INFO"):
        return
    for peer, s in _sockets():
        try:
            info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 232)
        except OSError:
            continue
        yield peer, info


TIMEOUT_ENV = "LLMRUN_RPC_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0  # one graph's compute on a slow server stays well under it


def wait_limit() -> float:
    """How long a server may leave a send or a receive unanswered (LLMRUN_RPC_TIMEOUT_S)."""
    text = os.environ.get(TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_TIMEOUT_S
    value = real(text)
    if value is None or not 1.0 <= value <= 86400.0:
        raise BadRequestError(f"{TIMEOUT_ENV}: '{text[:40]}' is not 1 to 86400 seconds")
    return value


def bound_waits(timeout_s: float) -> int:
    """Put a deadline on every wait of ggml-rpc's connections, which have none (a server that
    freezes, or a host that drops off the network without a reset, would hold the process
    forever, Ctrl-C included): a send or receive unanswered for `timeout_s` fails, ggml-rpc
    aborts, and that is told as the server that stopped answering. Keep-alive probes find a
    silent host while the connection is idle. Returns the connections bounded."""
    seconds, micros = int(timeout_s), int((timeout_s % 1) * 1e6)
    timeval = struct.pack("ll", seconds, micros)
    bounded = 0
    for _, s in _sockets():
        with contextlib.suppress(OSError):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            for name, value in (
                ("TCP_USER_TIMEOUT", int(timeout_s * 1000)),  # sent data left unacknowledged
                ("TCP_KEEPIDLE", 30),
                ("TCP_KEEPINTVL", 10),
                ("TCP_KEEPCNT", 3),
            ):
                if hasattr(socket, name):
                    s.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
            bounded += 1
    return bounded


@contextlib.contextmanager
def bounding(timeout_s: float, every_s: float = 0.2) -> Iterator[None]:
    """`bound_waits` on every connection ggml-rpc opens while the block runs (the load opens
    and closes them as it goes), each within `every_s` of its opening, and once more at the
    end."""
    done = threading.Event()

    def watch() -> None:
        while not done.wait(every_s):
            with contextlib.suppress(Exception):
                bound_waits(timeout_s)

    watcher = threading.Thread(target=watch, name="llmrun-rpc-deadlines", daemon=True)
    bound_waits(timeout_s)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()
        bound_waits(timeout_s)


def traffic() -> Traffic | None:
    """The bytes over every open TCP connection to an attached server; None without servers,
    or where Linux's TCP_INFO is not there."""
    if not _attached or not hasattr(socket, "TCP_INFO") or not os.path.isdir("/proc/self/fd"):
        return None
    sent = received = 0
    for _, info in _connections():
        if len(info) < 136:  # before Linux 4.2: no byte counts
            return None
        acked, got = struct.unpack_from("QQ", info, 120)  # tcpi_bytes_acked, _received
        sent, received = sent + acked, received + got
    return Traffic(sent, received)


if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_Stats = TypeVar("_Stats", bound="DataclassInstance")  # stats.py's GenerationStats


def with_traffic(
    stats: _Stats, before: Traffic, prefilled: Traffic, after: Traffic | None
) -> _Stats:
    """A request's stats with the bytes its prefill and its decode moved to and from the
    servers (traffic() read before the prefill, after it, and after the decode)."""
    if after is None:
        return stats
    return dataclasses.replace(
        stats,
        rpc_prefill_bytes=max(0, prefilled.since(before).bytes),
        rpc_decode_bytes=max(0, after.since(prefilled).bytes),
    )


SCHEDSTAT = "/proc/thread-self/schedstat"


def run_delay_ns(schedstat: str) -> int:
    """/proc/<tid>/schedstat's second field: ns the thread was runnable but waited for a CPU
    (other load's preemption). Its first, ns on a CPU, lags the truth by up to a scheduler
    tick on a running thread; `time.thread_time_ns()` is exact, and is what is used."""
    return int(schedstat.split()[1])


def blocked_ns(wall_ns: int, on_cpu_ns: int, runnable_ns: int) -> int:
    """Of a call's wall time, what the thread neither ran nor waited for a CPU: it slept.
    Negative values are left as they are (the counters' rounding): a sum of many calls nets
    them out, where clamping each call would turn that noise into a wait."""
    return wall_ns - on_cpu_ns - runnable_ns


class _RunDelay:
    """The calling thread's schedstat run delay, read through a descriptor kept open per
    thread (a generator can be resumed on another one); 0 where there is no schedstat
    (not Linux, a sandbox's /proc, a read refused or malformed): there the wait also counts
    preemption. Once a read fails, the last value read stands, so the step that saw it fail
    takes no run delay instead of all of it so far as a wait."""

    def __init__(self) -> None:
        self._fd: int | None = None
        self._thread = 0
        self._last = 0
        self.available = True

    def __call__(self) -> int:
        if not self.available:
            return self._last
        thread = threading.get_ident()
        try:
            if self._fd is None or thread != self._thread:
                self.close()
                self._fd = os.open(SCHEDSTAT, os.O_RDONLY)
                self._thread = thread
            self._last = run_delay_ns(os.pread(self._fd, 128, 0).decode())
        except (OSError, ValueError, IndexError):
            self.available = False
            self.close()
        return self._last

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class ServerWait:
    """The time "waiting on the servers": per decode step, the time the thread that calls
    llama_decode sleeps inside it. ggml-rpc does its socket I/O on a dispatcher thread of its
    own, and the calling thread (ggml-cpu's thread 0, which computes the local layers itself)
    waits on a future for the servers' answers; so, per call,

        blocked = wall - on-CPU time (thread_time) - time runnable but not running (schedstat)

    It holds the servers' compute and the network together (they cannot be told apart from
    the client), never another process's preemption. `start`/`stop` bracket a step's calls;
    `count` when the step's token is an output token of the decode phase (a step whose token
    ends the generation is left out, as its time is outside the decode phase's)."""

    def __init__(
        self,
        runnable: Callable[[], int] | None = None,
        on_cpu: Callable[[], int] = time.thread_time_ns,
        clock: Callable[[], int] = time.perf_counter_ns,
    ) -> None:
        self._runnable = runnable or _RunDelay()
        self._on_cpu, self._clock = on_cpu, clock
        self._at = (0, 0, 0)
        self._pending_ns = 0
        self.total_ns = 0

    def start(self) -> None:
        self._at = (self._clock(), self._on_cpu(), self._runnable())

    def stop(self) -> None:
        wall, cpu, runnable = self._at
        self._pending_ns += blocked_ns(
            self._clock() - wall, self._on_cpu() - cpu, self._runnable() - runnable
        )

    def count(self) -> None:
        self.total_ns += self._pending_ns
        self._pending_ns = 0

    @property
    def seconds(self) -> float:
        """The counted steps' wait (never below 0: see `blocked_ns`)."""
        return max(0, self.total_ns) / 1e9

    def close(self) -> None:
        if isinstance(self._runnable, _RunDelay):
            self._runnable.close()


def server_wait() -> ServerWait | None:
    """A decode's `ServerWait` with servers attached; None (nothing measured) without."""
    return ServerWait() if _attached else None


def devices() -> list[Device]:
    """The attached servers' devices as llama.cpp's registry lists them (RPC0, RPC1, ...; the
    description is the server's host:port), with the memory each server offers. They are read
    from libllama's libggml: llmrun's device query (devices.py) opens another copy, whose
    registry never sees them."""
    if not _attached:
        return []
    rpc = [d for d in registered(_ggml()) if d.backend.startswith("RPC")]
    return [dataclasses.replace(d, backend="RPC") for d in rpc]


def rpc_backends(backends: str, servers: str | None) -> str:
    """llama-bench's `backends` with RPC servers: the other non-CPU registries, then RPC
    (llama-bench.cpp, test::get_backend); unchanged without servers."""
    if not servers:
        return backends
    return ",".join([*(b for b in backends.split(",") if b and b != "CPU"), "RPC"])


def rpc_gpu_info(gpu_info: str, servers: str | None) -> str:
    """llama-bench's `gpu_info` with RPC servers: each server's device is a GPU there, its
    description the server's host:port (one device per server, as rpc-server offers)."""
    if not servers:
        return gpu_info
    return ", ".join([*([gpu_info] if gpu_info else []), *servers.split(",")])


TCP_ESTABLISHED = 1  # tcpi_state (linux/tcp_states.h)


def lost_server(timeout_s: float = 1.0) -> str | None:
    """The attached server that closed or reset ggml-rpc's connection (its socket's state, or
    its socket no longer connected while the others are: a reset one has no peer), else the
    one that no longer takes a connection, if one is. A server's process that is dying can
    reset its connection before its listening socket closes, so the connection's state is
    asked first."""
    open_ = dict(_connections())
    for e, info in open_.items():
        if info and info[0] != TCP_ESTABLISHED:
            return str(e)
    gone = [e for e in _attached if e not in open_]
    if open_ and len(gone) == 1:
        return str(gone[0])
    for e in _attached:
        if _connects(e, timeout_s) is not None:
            return str(e)
    return None


def explain_abort(error: EngineAbortError) -> EngineAbortError:
    """ggml's abort, told as the RPC server that stopped answering when that is what it was."""
    if not _attached:
        return error
    refused = re.search(r"handshake failed for (\S+)", error.reason)
    if refused:  # another protocol version: another llama.cpp there
        return RpcServerLostError(
            refused.group(1),
            "its RPC protocol is another llama.cpp's; run the same llama-cpp-python version"
            " (and `make rpc-server`) on every machine",
            "refused the handshake",
        )
    lost = lost_server()
    if lost is None and "RPC" not in error.reason:
        return error
    return RpcServerLostError(lost or ",".join(str(e) for e in _attached), error.reason)


_watching = False
# What to keep before the process ends on a lost server: each is called once, in the thread
# that aborts, while the main thread waits inside llama.cpp (bench stores its finished rows).
SALVAGE: list[Callable[[], None]] = []


def _watch_aborts() -> None:
    """Route ggml's aborts through `explain_abort` before llmrun reports them."""
    global _watching
    if _watching:
        return
    from . import library

    report = library.on_abort

    def on_abort(error: EngineAbortError) -> None:
        told = explain_abort(error)
        if isinstance(told, RpcServerLostError):
            while SALVAGE:
                with contextlib.suppress(Exception):
                    SALVAGE.pop()()
        report(told)

    library.on_abort = on_abort
    _watching = True
