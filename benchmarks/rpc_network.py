"""What llama.cpp's RPC costs a decode step: the same tg test with the layers split over
rpc-servers on this machine's loopback, and with every layer here.

Two `rpc-server`s (from `make rpc-server`) start on free loopback ports, each with --threads
threads as the client has. `llmrun bench -p 0 -n N` runs A B A B: all local, then `-ngl L
-rpc A,B` (L layers over the two servers, the rest here). Repacking is off in both (the
servers' CPU backend does not repack). The servers compute on the same CPU as the local run,
one after the other as llama.cpp's layer split does, so the difference between the two
per-token times is what the RPC path adds: serialising the graph and the
activations, the loopback sockets, and each server's own graph set-up. Printed: ms per token
both ways, and the network share of a decode step, 1 - local / split. On real machines the
devices differ too, so this share is an estimate of the network's part, not a measurement of it
there (docs/hardware.md). Beside it, each split run's own measured figure, `rpc_wait_share`:
the share of its decode the decoding thread spent waiting on the servers (their compute and
the network together: the layers they hold are in it, so it is not the estimate's number).

    .venv/bin/python benchmarks/rpc_network.py [-n 64] [-r 5] [-t 1] [-ngl 20] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from llmrun.runners import rpc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(threads: int) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen(
        [str(rpc.server_binary()), "--port", str(port), "--threads", str(threads)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return proc, f"127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"rpc-server did not listen on {port}")


def tg_ms(args: argparse.Namespace, rpc_servers: str | None) -> tuple[float, float | None]:
    """One bench run's decode time per token (ms), from its tg record, and its share of the
    decode waiting on the servers (None all here)."""
    llmrun = shutil.which("llmrun", path=str(Path(sys.executable).parent)) or "llmrun"
    cmd = [llmrun, "bench", "-p", "0", "-n", str(args.n), "-r", str(args.r), "-t", str(args.t)]
    cmd += ["--repack", "0", "-o", "jsonl", "--no-history"]  # as the servers' CPU computes
    if rpc_servers:
        cmd += ["-ngl", str(args.ngl), "-rpc", rpc_servers]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(done.stderr.strip().splitlines()[-1])
    (row,) = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    return 1000.0 / float(row["avg_ts"]), row.get("rpc_wait_share")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=64, help="tokens decoded per repetition")
    ap.add_argument("-r", type=int, default=5, help="repetitions per bench run")
    ap.add_argument("-t", type=int, default=1, help="threads: the client's and each server's")
    ap.add_argument("-ngl", type=int, default=20, help="layers on the servers, split between them")
    ap.add_argument("--rounds", type=int, default=2, help="A B rounds")
    args = ap.parse_args()
    servers = [start_server(args.t) for _ in range(2)]
    try:
        endpoints = ",".join(e for _, e in servers)
        local, split, waits = [], [], []
        for _ in range(args.rounds):
            local.append(tg_ms(args, None)[0])
            ms, wait = tg_ms(args, endpoints)
            split.append(ms)
            if wait is not None:
                waits.append(wait)
    finally:
        for proc, _ in servers:
            proc.kill()
            proc.wait()
    lo, sp = statistics.median(local), statistics.median(split)
    print(f"load average at the end: {os.getloadavg()[0]:.2f} (timings are noisy above the cores)")
    print(f"decode, all layers here:        {lo:7.2f} ms/token  {[round(x, 2) for x in local]}")
    shown = [round(x, 2) for x in split]
    print(f"decode, {args.ngl} layers over 2 servers: {sp:7.2f} ms/token  {shown}")
    share = 1 - lo / sp
    print(f"network share of a decode step (estimate): {share:.0%}")
    if share <= 0:
        print("(not above zero: the machine's noise is larger than the network's cost here)")
    if waits:
        shown_waits = [f"{w:.0%}" for w in waits]
        print(
            f"waiting on the servers, measured per split run (rpc_wait_share):"
            f" {statistics.median(waits):.0%}  {shown_waits}"
            " (their compute of their layers and the network)"
        )


if __name__ == "__main__":
    import script  # benchmarks/script.py: Ctrl-C is exit 130

    script.run(main)
