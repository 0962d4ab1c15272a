"""`llmrun serve -np 4` against llama.cpp's own `llama-server`, under llmrun's serving benchmark.

Both servers run on loopback with the same model, slots, threads, batch size and context per
sequence (llama-server: -np N, one KV stream per slot, as llmrun's); llmrun's
serving benchmark (`llmrun bench serve --endpoint`) loads each at concurrency 1, 4 and 8,
alternating which server goes first at every level and round. Printed: each level's output
throughput, TTFT and ITL p50/p99 for both, and llmrun's ratios to the reference (median over
the rounds). With --interference, every round also runs llmrun's interference test against
each (one client decoding while --long-prompt-token prompts arrive) and prints the stream's ITL
p99 ratio: what `--policy chunked:64` is for.

    .venv/bin/python benchmarks/serve.py --policy chunked:64 --interference [--rounds 2]

llama-server comes from the installed llama-cpp-python's own sources (tests/llama_tools.py
builds it once: `python -m tests.llama_tools llama-server`; LLAMA_SERVER names another build).
`--reference llama-cpp-python` uses llama-cpp-python's server instead, which answers one request
at a time (no slots): above concurrency 1 its ratios show what continuous batching adds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
LLMRUN = str(Path(sys.executable).parent / "llmrun")
START_S = 300.0


def model_path() -> str:
    sys.path.insert(0, str(ROOT))
    from llmrun.runners.models import default_model_path

    return default_model_path()


@contextlib.contextmanager
def llmrun_serve(args: argparse.Namespace, policy: str) -> Iterator[str]:
    """`llmrun serve` on a port of its choosing; yields its URL once its readiness line came."""
    proc = subprocess.Popen(
        [
            LLMRUN,
            "serve",
            "--port",
            "0",
            "-np",
            str(args.parallel),
            "-c",
            str(args.ctx),
            "-t",
            str(args.threads),
            "-b",
            str(args.batch),
            "--policy",
            policy,
            "--no-dashboard",
            "--max-queue",
            "1024",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
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
def serving(cmd: list[str], url: str, what: str) -> Iterator[str]:
    """A server process; yields its URL once /v1/models answers."""
    proc = subprocess.Popen(
        cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + START_S
        while True:
            try:
                with urllib.request.urlopen(url + "/v1/models", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    sys.exit(f"{what} did not start")
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(60)


@contextlib.contextmanager
def reference_server(args: argparse.Namespace) -> Iterator[str]:
    sys.path.insert(0, str(ROOT))
    from tests import llama_tools

    if args.reference == "llama-server":
        flags = (
            *("-np", str(args.parallel), "-c", str(args.ctx * args.parallel)),
            *("-t", str(args.threads), "-tb", str(args.threads)),
            *("-b", str(args.batch), "-ub", str(args.batch), "--no-webui"),
        )
        log = Path(args.log_dir) / "llama-server.log"
        try:
            with llama_tools.llama_cpp_server(model_path(), *flags, ready_s=START_S, log=log) as u:
                yield u
        except llama_tools.NotStarted as e:
            sys.exit(str(e))
        return
    port = llama_tools.free_port()
    url = f"http://127.0.0.1:{port}"
    # llama-cpp-python's server, through tests/llama_server.py, which only turns weight
    # repacking off where llmrun's probe finds it unsafe on this CPU
    cmd = [
        sys.executable,
        str(ROOT / "tests" / "llama_server.py"),
        "--model",
        model_path(),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_ctx",
        str(args.ctx),
        "--n_batch",
        str(args.batch),
        "--n_threads",
        str(args.threads),
        "--n_threads_batch",
        str(args.threads),
        "--verbose",
        "False",
        "--interrupt_requests",
        "False",
    ]
    with serving(cmd, url, "the llama-cpp-python server") as u:
        yield u


def bench_command() -> list[str]:
    """`llmrun bench serve` where it exists, else the older `llmrun bench` with --endpoint."""
    probe = subprocess.run(
        [LLMRUN, "bench", "--help"],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "COLUMNS": "200"},
    )
    group = "Commands" in probe.stdout and " serve " in probe.stdout
    return [LLMRUN, "bench", "serve"] if group else [LLMRUN, "bench"]


def json_records(argv: list[str], failed: str) -> list[dict[str, Any]]:
    """The records an llmrun command prints with `-o json`; where it fails, exit saying
    `failed` and the tail of its stderr (policies.py's runs too)."""
    done = subprocess.run([*argv, "-o", "json"], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"{failed}: {done.stderr.strip()[-400:]}")
    records: list[dict[str, Any]] = json.loads(done.stdout)
    return records


def measure(
    cmd: list[str], url: str, args: argparse.Namespace, level: int, seed: int
) -> dict[str, float]:
    [record, *_] = json_records(
        [
            *cmd,
            "--endpoint",
            url,
            "--concurrency",
            str(level),
            "--num-prompts",
            str(args.prompts),
            "--input-len",
            str(args.input_len),
            "--output-len",
            str(args.output_len),
            "--seed",
            str(seed),
        ],
        f"the serving benchmark failed against {url}",
    )
    if record.get("failed"):
        sys.exit(f"{record['failed']} requests failed against {url}: {record.get('errors')}")
    return {
        "tps": record["output_throughput"],
        "ttft": record["median_ttft_ms"],
        "itl50": record["p50_itl_ms"],
        "itl99": record["p99_itl_ms"],
    }


def interference(cmd: list[str], url: str, args: argparse.Namespace, seed: int) -> dict[str, float]:
    """llmrun's interference test: `bench interference` where bench is a group of commands."""
    test = [LLMRUN, "bench", "interference"] if cmd[-1] == "serve" else [*cmd, "--interference"]
    argv = [*test, "--endpoint", url, "--prompt-len", str(args.long_prompt)]
    argv += ["--output-len", str(args.output_len), "--seed", str(seed)]
    [record, *_] = json_records(argv, f"the interference test failed against {url}")
    return record


def load_average() -> str:
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", default="1,4,8")
    ap.add_argument("--parallel", type=int, default=4, help="slots of both servers (-np)")
    ap.add_argument("--policy", default="chunked:512", help="llmrun serve's scheduling")
    ap.add_argument(
        "--reference", choices=("llama-server", "llama-cpp-python"), default="llama-server"
    )
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--ctx", type=int, default=1024, help="context per sequence")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--interference", action="store_true")
    ap.add_argument("--long-prompt", type=int, default=512)
    ap.add_argument("--log-dir", default=os.environ.get("TMPDIR", "/tmp"))
    args = ap.parse_args()
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)  # llama-server's log goes there
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the servers stop with it
    levels = [int(x) for x in args.concurrency.split(",")]
    cmd = bench_command()
    ref_name = args.reference
    print(
        f"serving benchmark: {' '.join(Path(c).name for c in cmd)}; llmrun serve -np"
        f" {args.parallel} --policy {args.policy} vs {ref_name} -np {args.parallel};"
        f" {args.threads} threads, {args.prompts} prompts of {args.input_len} tokens ->"
        f" {args.output_len}; {load_average()}",
        flush=True,
    )
    results: dict[tuple[str, int], list[dict[str, float]]] = {}
    itl99: dict[str, list[float]] = {}
    with llmrun_serve(args, args.policy) as ours, reference_server(args) as ref:
        servers = {"llmrun": ours, ref_name: ref}
        for rnd in range(args.rounds):
            for i, level in enumerate(levels):
                order = list(servers) if (rnd + i) % 2 == 0 else list(reversed(servers))
                for name in order:
                    # fresh prompts at every level and round (the same for both servers), so
                    # neither server's prompt cache serves one it has seen before
                    m = measure(cmd, servers[name], args, level, seed=1000 + 100 * rnd + 10 * i)
                    results.setdefault((name, level), []).append(m)
                    print(
                        f"round {rnd + 1} c{level} {name:<17} {m['tps']:7.1f} tok/s  TTFT"
                        f" {m['ttft']:8.1f} ms  ITL p50 {m['itl50']:7.1f} p99"
                        f" {m['itl99']:7.1f} ms",
                        flush=True,
                    )
            if args.interference:
                order = list(servers) if rnd % 2 == 0 else list(reversed(servers))
                for name in order:
                    rec = interference(cmd, servers[name], args, seed=5000 + 100 * rnd)
                    if rec.get("itl_p99_loaded_ms") is None:  # the stream gave no gaps
                        print(
                            f"round {rnd + 1} interference {name}: no stream ITL: {rec}", flush=True
                        )
                        continue
                    itl99.setdefault(name, []).append(float(rec["itl_p99_loaded_ms"]))
                    print(
                        f"round {rnd + 1} interference {name:<17} stream ITL p99"
                        f" {rec['itl_p99_loaded_ms']} ms while {args.long_prompt}-token"
                        f" prompts arrive (alone {rec['itl_p99_alone_ms']} ms)",
                        flush=True,
                    )
    print()
    for level in levels:
        mine, theirs = results[("llmrun", level)], results[(ref_name, level)]

        def ratio(
            key: str, a: list[dict[str, float]] = mine, b: list[dict[str, float]] = theirs
        ) -> float:
            return statistics.median(x[key] / y[key] for x, y in zip(a, b, strict=True))

        print(
            f"c{level}: llmrun / {ref_name}: throughput x{ratio('tps'):.2f}, TTFT"
            f" x{ratio('ttft'):.2f}, ITL p50 x{ratio('itl50'):.2f}, ITL p99"
            f" x{ratio('itl99'):.2f} (median of {args.rounds} rounds)"
        )
    if itl99.get("llmrun") and itl99.get(ref_name):
        ours_ms, theirs_ms = statistics.median(itl99["llmrun"]), statistics.median(itl99[ref_name])
        print(
            f"interference: stream ITL p99 llmrun / {ref_name} under {args.long_prompt}-token"
            f" prompts: x{ours_ms / theirs_ms:.2f} ({ours_ms:.1f} / {theirs_ms:.1f} ms, medians"
            f" of {len(itl99['llmrun'])} and {len(itl99[ref_name])} rounds)"
        )
    print(load_average())
    return 0


if __name__ == "__main__":
    import script  # benchmarks/script.py: Ctrl-C is exit 130

    script.run(main)
