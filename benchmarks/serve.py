"""`llmrun serve -np 4` against llama-cpp-python's own server, under llmrun's serving benchmark.

Both servers run on loopback with the same model, threads, batch size and context per sequence;
llmrun's serving benchmark (`llmrun bench serve --endpoint`, or `llmrun bench --endpoint` where
that command is not there yet) loads each at concurrency 1, 4 and 8, alternating which server
goes first at every level and round. Printed: each level's output throughput, TTFT and ITL
p50/p99 for both, and llmrun's ratios to the reference (median over the rounds).

    .venv/bin/python benchmarks/serve.py [--rounds 2] [--concurrency 1,4,8] [--threads 2]

llama-cpp-python's server answers one request at a time (it has no slots), so above
concurrency 1 the ratios show what continuous batching adds; at concurrency 1 they compare the
two engines request for request. With --interference, each server also gets llmrun's
interference test (one client decoding while long prompts arrive); try --policy chunked:64.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LLMRUN = str(Path(sys.executable).parent / "llmrun")
START_S = 300.0


def model_path() -> str:
    sys.path.insert(0, str(ROOT))
    from llmrun.runners.models import default_model_path

    return default_model_path()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def llmrun_serve(args: argparse.Namespace, policy: str) -> Iterator[str]:
    """`llmrun serve` on a port of its choosing; yields its URL once its readiness line came."""
    proc = subprocess.Popen(
        [LLMRUN, "serve", "--port", "0", "-np", str(args.parallel), "-c", str(args.ctx), "-t",
         str(args.threads), "-b", str(args.batch), "--policy", policy, "--no-dashboard",
         "--max-queue", "1024"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    ready: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            if "listening on" in line:
                ready.put(line.split("listening on ", 1)[1].split()[0])
        ready.put(None)

    threading.Thread(target=read, daemon=True).start()
    try:
        url = ready.get(timeout=START_S)
        if url is None:
            sys.exit("llmrun serve did not start")
        yield url
    finally:
        proc.terminate()
        proc.wait(60)


@contextlib.contextmanager
def reference_server(args: argparse.Namespace) -> Iterator[str]:
    """llama-cpp-python's server (through tests/llama_server.py, which only turns weight
    repacking off where llmrun's probe finds it unsafe on this CPU)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "llama_server.py"), "--model", model_path(),
         "--host", "127.0.0.1", "--port", str(port), "--n_ctx", str(args.ctx), "--n_batch",
         str(args.batch), "--n_threads", str(args.threads), "--n_threads_batch",
         str(args.threads), "--verbose", "False", "--interrupt_requests", "False"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_S
        while True:
            try:
                with urllib.request.urlopen(url + "/v1/models", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    sys.exit("the llama-cpp-python server did not start")
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(60)


def bench_command() -> list[str]:
    """`llmrun bench serve` where it exists, else the older `llmrun bench` with --endpoint."""
    probe = subprocess.run([LLMRUN, "bench", "--help"], capture_output=True, text=True,
                           check=False, env={**os.environ, "COLUMNS": "200"})  # fmt: skip
    group = "Commands" in probe.stdout and " serve " in probe.stdout
    return [LLMRUN, "bench", "serve"] if group else [LLMRUN, "bench"]


def measure(cmd: list[str], url: str, args: argparse.Namespace, level: int,
            seed: int) -> dict[str, float]:  # fmt: skip
    done = subprocess.run(
        [*cmd, "--endpoint", url, "--concurrency", str(level), "--num-prompts",
         str(args.prompts), "--input-len", str(args.input_len), "--output-len",
         str(args.output_len), "--seed", str(seed), "-o", "json"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        sys.exit(f"the serving benchmark failed against {url}: {done.stderr.strip()[-400:]}")
    record = json.loads(done.stdout)[0]
    if record.get("failed"):
        sys.exit(f"{record['failed']} requests failed against {url}: {record.get('errors')}")
    return {"tps": record["output_throughput"], "ttft": record["median_ttft_ms"],
            "itl50": record["p50_itl_ms"], "itl99": record["p99_itl_ms"]}  # fmt: skip


def interference(cmd: list[str], url: str, args: argparse.Namespace) -> dict[str, float]:
    """llmrun's interference test: `bench interference` where bench is a group of commands."""
    test = [LLMRUN, "bench", "interference"] if cmd[-1] == "serve" else [*cmd, "--interference"]
    done = subprocess.run(
        [*test, "--endpoint", url, "--prompt-len", str(args.long_prompt), "--output-len",
         str(args.output_len), "-o", "json"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        sys.exit(f"the interference test failed against {url}: {done.stderr.strip()[-400:]}")
    record: dict[str, float] = json.loads(done.stdout)[0]
    return record


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", default="1,4,8")
    ap.add_argument("--parallel", type=int, default=4, help="llmrun serve -np")
    ap.add_argument("--policy", default="chunked:512", help="llmrun serve's scheduling")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--ctx", type=int, default=1024, help="context per sequence")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--interference", action="store_true")
    ap.add_argument("--long-prompt", type=int, default=512)
    args = ap.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    cmd = bench_command()
    print(f"serving benchmark: {' '.join(Path(c).name for c in cmd)}; llmrun serve -np"
          f" {args.parallel} --policy {args.policy}; {args.threads} threads, {args.prompts}"
          f" prompts of {args.input_len} tokens -> {args.output_len}", flush=True)  # fmt: skip
    results: dict[tuple[str, int], list[dict[str, float]]] = {}
    with llmrun_serve(args, args.policy) as ours, reference_server(args) as ref:
        servers = {"llmrun": ours, "llama-cpp-python": ref}
        for rnd in range(args.rounds):
            for i, level in enumerate(levels):
                order = list(servers) if (rnd + i) % 2 == 0 else list(reversed(servers))
                for name in order:
                    m = measure(cmd, servers[name], args, level, seed=1000 + rnd)
                    results.setdefault((name, level), []).append(m)
                    print(f"round {rnd + 1} c{level} {name:<17} {m['tps']:7.1f} tok/s  TTFT"
                          f" {m['ttft']:8.1f} ms  ITL p50 {m['itl50']:7.1f} p99"
                          f" {m['itl99']:7.1f} ms", flush=True)  # fmt: skip
        if args.interference:
            for name, url in servers.items():
                rec = interference(cmd, url, args)
                print(f"interference {name}: stream ITL p99 {rec['itl_p99_loaded_ms']} ms"
                      f" under long prompts (alone {rec['itl_p99_alone_ms']} ms)")  # fmt: skip
    print()
    for level in levels:
        mine, theirs = results[("llmrun", level)], results[("llama-cpp-python", level)]

        def ratio(key: str, a: list[dict[str, float]] = mine,
                  b: list[dict[str, float]] = theirs) -> float:  # fmt: skip
            return statistics.median(x[key] / y[key] for x, y in zip(a, b, strict=True))

        print(f"c{level}: llmrun / llama-cpp-python: throughput x{ratio('tps'):.2f}, TTFT"
              f" x{ratio('ttft'):.2f}, ITL p50 x{ratio('itl50'):.2f}, ITL p99"
              f" x{ratio('itl99'):.2f} (median of {args.rounds} rounds)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
