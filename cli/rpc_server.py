"""`llmrun rpc-server`: llama.cpp's RPC server on this machine, for `--rpc` on another.

It runs the `rpc-server` that `make rpc-server` built from the installed llama.cpp's sources
(runners/rpc.py), as a child that it stops with itself (Ctrl-C: 130, SIGTERM: 143).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from typing import Annotated

import typer

from llmrun.runners import children, rpc

from . import options as o
from .errors import handled

PANEL = "Server"


def rpc_server(
    host: Annotated[
        str,
        typer.Option(
            "-H",
            "--host",
            help="Address to listen on. Anything but 127.0.0.1 lets other machines in: only on"
            " a network you trust.",
            rich_help_panel=PANEL,
        ),
    ] = rpc.DEFAULT_HOST,
    port: Annotated[
        int,
        typer.Option("-p", "--port", min=1, max=65535, help="Port.", rich_help_panel=PANEL),
    ] = rpc.DEFAULT_PORT,
    threads: Annotated[
        int | None,
        o.threads_option(
            "CPU threads of its CPU device. (default: half the logical CPUs, as llama.cpp)",
            panel=PANEL,
            envvar=None,
        ),
    ] = None,
    cache: Annotated[
        bool,
        typer.Option(
            "-c",
            "--cache",
            help="Keep the tensors clients send in a local cache (llama.cpp's, under"
            " $LLAMA_CACHE or ~/.cache/llama.cpp/rpc), so a later load sends only their hashes.",
            rich_help_panel=PANEL,
        ),
    ] = False,
) -> None:
    """Start llama.cpp's RPC server, for --rpc HOST:PORT on run, chat, serve, bench.

    It computes the layers a client puts on it, on this machine's GPU or else its CPU. It has
    no authentication and no encryption: keep it on 127.0.0.1, or on a network you trust
    (docs/hardware.md). Build it once with `make rpc-server`. Example:

      llmrun rpc-server -H 192.168.1.2 -p 50052    # on 192.168.1.2

      llmrun run --rpc 192.168.1.2:50052 -ngl 99    # elsewhere: all layers there
    """
    with handled():
        rpc.check_host(host)  # a usage error before anything else
        binary = rpc.server_binary()
        rpc.check_listen(host, port)
        argv = [str(binary), "--host", host, "--port", str(port)]
        if threads is not None:
            argv += ["--threads", str(threads)]
        if cache:
            argv.append("--cache")
        print(f"llmrun: RPC server on {host}:{port} ({binary})", file=sys.stderr)
        print(f"llmrun: warning: {rpc.WARNING}", file=sys.stderr, flush=True)
        child: subprocess.Popen[bytes] | None = None
        try:  # a Ctrl-C as early as inside Popen must not leave the server behind
            child, held = children.popen(argv, stdin=subprocess.DEVNULL)
            if held is not None:  # delivered now that the child is ours to stop
                signal.raise_signal(held)
            code = None
            while code is None:  # a blocking waitpid misses a signal that lands just before it
                with contextlib.suppress(subprocess.TimeoutExpired):
                    code = child.wait(timeout=0.5)  # (its handler ran at the next poll)
        except KeyboardInterrupt:  # Ctrl-C, SIGTERM or SIGHUP: the server stops with llmrun
            if child is not None:
                _stop(child)
            raise
        # It serves until stopped: any end of its own is a failure (it returns 0 when it
        # cannot listen, after saying why).
        print(
            f"llmrun: error: rpc-server stopped (exit code {code}); its own words are above",
            file=sys.stderr,
            flush=True,
        )
        raise typer.Exit(1)


def _stop(child: subprocess.Popen[bytes]) -> None:
    """End the server (SIGTERM, then SIGKILL after 5 s), whatever more Ctrl-Cs come. Reaped
    with os.waitpid, not Popen.wait: a KeyboardInterrupt out of Popen.wait(timeout) can leave
    its internal lock held (CPython 3.11 takes it before its try), and a Popen.wait after that
    blocked forever on a server already gone."""
    kills = iter([signal.SIGTERM])  # then SIGKILL
    deadline = 0.0
    while child.returncode is None:
        try:
            if time.monotonic() >= deadline:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.pid, next(kills, signal.SIGKILL))
                deadline = time.monotonic() + 5
            pid, status = os.waitpid(child.pid, os.WNOHANG)
            if pid == child.pid:
                child.returncode = os.waitstatus_to_exitcode(status)
            else:
                time.sleep(0.01)
        except ChildProcessError:  # reaped already (by Popen before the interrupt)
            child.returncode = 0
        except KeyboardInterrupt:
            continue
