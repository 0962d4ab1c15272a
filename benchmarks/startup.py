"""Start-up: how soon llmrun answers, beside `python -c pass` and llama-bench.

Each case runs --reps times, the cases interleaved round by round so that a busy machine slows
them alike; the table shows the median (min-max) and the median's ratio to `python -c pass`:

- `python -c pass`: the floor, the interpreter alone (llmrun's own Python);
- `llmrun --help`, `llmrun --version`: exec to exit (targets: 0.3 s on 2 quiet cores);
- `llmrun run` to load: exec until `llmrun run` starts loading the model (target: 0.4 s). The
  marker is the dashboard's: on a terminal it hides the cursor (ESC [?25l) the moment the
  stream's first event, LoadStarted, reaches it (`Dashboard.update` starts rich's Live, which
  hides the cursor at once, before any frame), so the run's terminal here is a
  pseudo-terminal, and the time is that of the escape's arrival; the run is then killed;
- `llmrun bench -r 0 -p 16 -n 4` and `llama-bench -r 0 -p 16 -n 4` on the same model, exec to
  exit (target: llmrun within 1 s of llama-bench), when llama-bench is built (`make
  llama-bench`, LLMRUN_TOOLS_DIR or LLAMA_BENCH); otherwise the table says why they are
  missing. llama-bench gets the flags this CPU needs, as llmrun's probe decides them for
  `llmrun bench` (`--repack 0` on a CPU with AMX, where it died by SIGILL without); --flags
  adds the same flags to both;
- `llmrun run` last line to exit: from the last byte `llmrun run -n 1` writes (its stats on
  stderr) to its exit, the time a shell waits after the answer is on the screen.

Each llmrun's own packages are byte-compiled first, as an installed llmrun's are (where
PYTHONDONTWRITEBYTECODE is set, an editable checkout otherwise compiles them at every start).

--llmrun may be given several times (another checkout's .venv/bin/llmrun): each gets its rows,
measured in the same rounds, so a before and an after come from one run.

    .venv/bin/python benchmarks/startup.py [--reps 5] [--bench-reps 3] [--llmrun PATH]...
"""

from __future__ import annotations

import argparse
import fcntl
import os
import pty
import select
import signal
import statistics
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llmrun.runners.models import default_model_path
from tests import llama_tools

HIDE_CURSOR = b"\x1b[?25l"
TIMEOUT_S = 300.0


def wall(argv: list[str]) -> float:
    """Seconds from exec to exit; a failure is an error, not a time."""
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)
    took = time.perf_counter() - start
    if done.returncode != 0:
        tail = done.stderr.decode(errors="replace")[-500:]
        raise SystemExit(f"{' '.join(argv)} exited {done.returncode}: {tail}")
    return took


def until_load(llmrun: str) -> float:
    """Seconds from exec until `llmrun run` on a terminal starts loading the model (the
    dashboard hides the cursor when LoadStarted reaches it)."""
    env = {**os.environ, "TERM": "xterm-256color"}
    env.pop("NO_COLOR", None)
    start = time.perf_counter()
    pid, fd = pty.fork()
    if pid == 0:  # the child: exec at once, nothing else
        os.execve(llmrun, [llmrun, "run", "-n", "1", "Hi"], env)
    try:
        fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        seen = b""
        while HIDE_CURSOR not in seen:
            ready, _, _ = select.select([fd], [], [], TIMEOUT_S)
            try:
                chunk = os.read(fd, 65536) if ready else b""
            except OSError:
                chunk = b""
            if not chunk:
                raise SystemExit(f"{llmrun} run ended before loading: {seen[-500:]!r}")
            seen = seen[-len(HIDE_CURSOR) :] + chunk
        return time.perf_counter() - start
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(fd)


def last_line_to_exit(llmrun: str) -> float:
    """Seconds from the last byte `llmrun run -n 1` writes (stdout and stderr, pipes) to its
    exit: Python's shutdown, and whatever llmrun does after its report."""
    child = subprocess.Popen(
        [llmrun, "run", "-n", "1", "Hi"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert child.stdout is not None and child.stderr is not None
    open_fds = {child.stdout.fileno(), child.stderr.fileno()}
    last = time.perf_counter()
    try:
        while open_fds:
            ready, _, _ = select.select(list(open_fds), [], [], TIMEOUT_S)
            if not ready:
                raise SystemExit(f"{llmrun} run wrote nothing for {TIMEOUT_S:g} s")
            for fd in ready:
                if os.read(fd, 65536):
                    last = time.perf_counter()
                else:  # end of file: the child closed it, at its exit
                    open_fds.discard(fd)
        code = child.wait(timeout=TIMEOUT_S)
        ended = time.perf_counter()
    finally:  # a timeout or a Ctrl-C here leaves no llmrun running
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdout.close()
        child.stderr.close()
    if code != 0:
        raise SystemExit(f"{llmrun} run exited {code}")
    return ended - last


def llama_bench_binary() -> tuple[str | None, str]:
    """llama-bench if it is built (never built here), else why not."""
    given = os.environ.get("LLAMA_BENCH")
    path = Path(given) if given else llama_tools.built_tool("llama-bench")
    if path is not None and path.exists():
        return str(path), ""
    where = path or llama_tools.tools_dir()
    return None, f"no llama-bench in {where} (make llama-bench, or LLMRUN_TOOLS_DIR, LLAMA_BENCH)"


# Each llmrun's own packages, compiled once before the rounds: an install from a wheel has its
# bytecode written by pip, an editable checkout only where Python may write it. Where the
# environment sets PYTHONDONTWRITEBYTECODE (these machines do), every start compiled llmrun's
# modules anew: 0.18 s of `run`'s start, which no installed llmrun pays.
COMPILE = (
    "import compileall, os, llmrun.cli, llmrun.runners\n"
    "for p in (llmrun.cli, llmrun.runners):\n"
    "    compileall.compile_dir(os.path.dirname(p.__file__), quiet=1)\n"
)


def compile_installed(llmrun: str) -> None:
    python = Path(llmrun).parent / "python"
    subprocess.run([str(python), "-c", COMPILE], check=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5, help="runs of each quick case")
    ap.add_argument("--bench-reps", type=int, default=3, help="runs of each bench line")
    ap.add_argument("--llmrun", action="append", help="an llmrun to measure (repeatable)")
    ap.add_argument("--flags", default="", help="flags added to both bench lines")
    args = ap.parse_args()
    here = str(Path(sys.executable).parent / "llmrun")
    llmruns = args.llmrun or [here]
    python = sys.executable
    model = default_model_path()
    bench_line = ["-m", model, "-r", "0", "-p", "16", "-n", "4", *args.flags.split()]
    llama_bench, missing = llama_bench_binary()
    for exe in llmruns:
        compile_installed(exe)

    cases: dict[str, tuple[Callable[[], float], int]] = {
        "python -c pass": (partial(wall, [python, "-c", "pass"]), args.reps)
    }
    for exe in llmruns:
        tag = "" if len(llmruns) == 1 else f" [{exe}]"
        cases[f"llmrun --help{tag}"] = (partial(wall, [exe, "--help"]), args.reps)
        cases[f"llmrun --version{tag}"] = (partial(wall, [exe, "--version"]), args.reps)
        cases[f"llmrun run: exec to load{tag}"] = (partial(until_load, exe), args.reps)
        cases[f"llmrun run: last line to exit{tag}"] = (partial(last_line_to_exit, exe), args.reps)
        if llama_bench is not None:
            cases[f"llmrun bench -r 0 -p 16 -n 4{tag}"] = (
                partial(wall, [exe, "bench", *bench_line]),
                args.bench_reps,
            )
    if llama_bench is not None:
        cpu = llama_tools.cpu_flags("llama-bench", model)
        cases["llama-bench -r 0 -p 16 -n 4"] = (
            partial(wall, [llama_bench, *bench_line, *cpu]),
            args.bench_reps,
        )

    times: dict[str, list[float]] = {name: [] for name in cases}
    for rep in range(max(args.reps, args.bench_reps)):
        for name, (measure, reps) in cases.items():
            if rep < reps:
                times[name].append(measure())

    floor = statistics.median(times["python -c pass"])
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"start-up, {os.cpu_count()} CPUs, load average {load:.1f} at the end; seconds")
    width = max(len(name) for name in times)
    print(f"{'case':<{width}}  {'median':>7}  {'min-max':>13}  {'x python':>8}")
    for name, runs in times.items():
        median = statistics.median(runs)
        spread = f"{min(runs):.3f}-{max(runs):.3f}"
        print(f"{name:<{width}}  {median:>7.3f}  {spread:>13}  {median / floor:>8.1f}")
    if llama_bench is None:
        print(f"bench rows left out: {missing}")
    return 0


if __name__ == "__main__":
    import script  # benchmarks/script.py: Ctrl-C is exit 130

    script.run(main)
