"""What the tests fake or share in the processes a test starts.

tests/conftest.py puts this folder first on PYTHONPATH, so every Python child of a test (the
`llmrun` command through pipes, a pseudo-terminal or tmux, `llmrun serve`) runs this file at
start-up, before llmrun is imported. llmrun itself reads none of these variables: only a process
started with this folder on its path does.

- TESTS_BACKGROUND_CPUS (a number of CPUs; conftest sets 0, a quiet machine) becomes
  runners/system.py's `background_override`, as conftest sets it in the tests' own process;
  without it the child measures the machine.
- TESTS_REPACK_PROBE names a file of repacking-probe verdicts that the tests' processes share
  (share_probe): llmrun's probe of a model runs once in a session, not once per test.
- TESTS_BANDWIDTH (bytes,repetitions) sizes the bandwidth probe of bench's machine report.
- TESTS_PROBE_HOLD (seconds) makes the repacking probe's child a sleep that long: a set-up that
  a signal can reach while the child runs.
- TESTS_SERVE_TIMEOUT_S (seconds) replaces `llmrun serve`'s 30 s deadlines on a request's headers
  and on the next piece of its body (short_serve_timeouts): a test that waits for them to fire.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.machinery
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

BACKGROUND_ENV = "TESTS_BACKGROUND_CPUS"
PROBE_ENV = "TESTS_REPACK_PROBE"
BANDWIDTH_ENV = "TESTS_BANDWIDTH"
PROBE_HOLD_ENV = "TESTS_PROBE_HOLD"
SERVE_TIMEOUT_ENV = "TESTS_SERVE_TIMEOUT_S"


def _model_key(model_path: str) -> str:
    """One model file as the probe saw it (another file, or this one rewritten: another key)."""
    st = os.stat(model_path)
    return f"{os.path.realpath(model_path)}:{st.st_size}:{st.st_mtime_ns}"


def _read(memo: Path) -> dict[str, Any]:
    try:
        data = json.loads(memo.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def share_probe(probe: Any, memo: Path) -> None:
    """Answer runners/probe.py's run_probe from `memo` where a process of this test session has
    probed the same model file already; probe and note the verdict there otherwise.

    The verdict depends on the llama.cpp build, the CPU and the model, which a session does not
    change, and llmrun's own cache of it (repack_verdict) is in each test's LLMRUN_HOME: without
    this, every test that loads a model would start the probe's child anew (about a second of
    CPU). A probe given its own command (a test's fake crash) always runs.
    """
    real = probe.run_probe

    @functools.wraps(real)
    def run_probe(model_path: str, command: list[str] | None = None, cancel: Any = None) -> Any:
        hold = os.environ.get(PROBE_HOLD_ENV)
        if hold:
            command = command or [sys.executable, "-c", f"import time; time.sleep({float(hold)})"]
        if command is not None:
            return real(model_path, command, cancel)
        key = _model_key(model_path)
        known = _read(memo).get(key)
        if isinstance(known, dict) and isinstance(known.get("safe"), bool):
            return probe.Verdict(known["safe"], str(known.get("why", "probed")))
        verdict = real(model_path, cancel=cancel)
        if verdict.interrupted:  # a signal's, not the build's: no verdict to share
            return verdict
        data = _read(memo)
        data[key] = {"safe": verdict.safe, "why": verdict.why}
        with contextlib.suppress(OSError):  # another process's write: it probed the same
            tmp = memo.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(data), encoding="utf-8")
            tmp.replace(memo)
        return verdict

    probe.run_probe = run_probe


def small_bandwidth_probe(system: Any, size_bytes: int, reps: int) -> None:
    """Bench's machine report copies `size_bytes` `reps` times instead of llmrun's 256 MiB seven
    times (2 s of CPU each run): the same code, where no figure is checked against RAM's."""
    system.memory_bandwidth_runs = functools.partial(
        system.memory_bandwidth_runs, size_bytes=size_bytes, reps=reps
    )


def short_serve_timeouts(seconds: float) -> None:
    """`llmrun serve` ends a request whose headers (uvicorn_patch.GuardedH11) or whose body's
    next piece (api_http.read_body) has not arrived in `seconds` instead of 30 s; its 408
    names the deadline the code used: the same code, where a test waits for the deadline to fire."""
    from llmrun.runners.serving import api_http, uvicorn_patch

    uvicorn_patch.GuardedH11.headers_timeout_s = seconds
    api_http.read_body = functools.partial(api_http.read_body, idle_s=seconds)


def _install() -> None:
    background = os.environ.get(BACKGROUND_ENV)
    memo = os.environ.get(PROBE_ENV)
    bandwidth = os.environ.get(BANDWIDTH_ENV)
    serve_timeout = os.environ.get(SERVE_TIMEOUT_ENV)
    if background is None and memo is None and bandwidth is None and serve_timeout is None:
        return
    try:
        from llmrun.runners import probe, system
    except ImportError:  # a Python without llmrun (a tool a test starts): nothing to fake
        return
    if background is not None:
        # not a number: Python prints "Error in sitecustomize" on stderr
        system.background_override = float(background)
    if memo:
        share_probe(probe, Path(memo))
    if bandwidth:
        size_bytes, reps = (int(n) for n in bandwidth.split(","))
        small_bandwidth_probe(system, size_bytes, reps)
    if serve_timeout:
        short_serve_timeouts(float(serve_timeout))


def _chain() -> None:
    """Run the sitecustomize this file hides (a distribution's), as Python would have."""
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


if __name__ == "sitecustomize":  # at a child's start-up; conftest imports the helpers alone
    _install()
    _chain()
