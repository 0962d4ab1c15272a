from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmrun.cli import engine
from llmrun.runners import probe, system
from llmrun.runners.config import EngineConfig
from llmrun.runners.llamacpp import LlamaCppRunner
from llmrun.runners.models import default_model_path

from .fake import FakeBenchRunner, FakeRunner
from .guard import quick_guard  # noqa: F401  (an autouse fixture: registered by being here)
from .inject.sitecustomize import (
    BACKGROUND_ENV,
    BANDWIDTH_ENV,
    PROBE_ENV,
    share_probe,
    small_bandwidth_probe,
)
from .llama_tools import free_port, stop

ROOT = Path(__file__).resolve().parent.parent
LLMRUN = str(Path(sys.executable).parent / "llmrun")
# The deadline for one step of a test (a command, a reply, a server start) when the test waits
# for an event: ten minutes, far past any working step on a machine busy with other work, so
# only a hang reaches it. Tests wait for what they need (a line, a file, a count), never a time.
HANG_S = 600.0
# Other processes' load as the tests fake it (llmrun reads no variable for it): in the tests'
# process, runners/system.py's background_override; in the processes they start, BACKGROUND_ENV,
# which tests/inject/sitecustomize.py (first on their PYTHONPATH) turns into that override. The
# repacking probe's shared verdicts and the bandwidth probe's size travel the same way.
INJECT = ROOT / "tests" / "inject"
# The bandwidth probe's size in the tests (bytes, copies), where llmrun copies 256 MiB 7 times.
QUICK_BANDWIDTH = (8 << 20, 2)
REAL_BANDWIDTH_RUNS = system.memory_bandwidth_runs

# The markers follow the fixtures a test uses, directly or through another fixture, so nobody
# marks a test by hand and `pytest -m "not model and not pty"` (make test-quick) is the quick
# subset; tests/guard.py fails a quick test that loads the model or starts a process anyway.
#   model: loads the real embedded model in the test's process (or names it to a child process).
#   pty:   starts a child process: the CLI through pipes, a pseudo-terminal (pexpect) or tmux, a
#          llama-cpp-python server, mypy, make; the start-up alone takes a second or more.
#   slow:  runs llama.cpp's own llama-bench, which the first use builds (tests/llama_tools.py).
#   cores: needs every CPU of the machine: runs llama.cpp's own tools (every `slow` test), or
#          llama.cpp on more threads than one CPU, or needs two CPUs (every_core). `make test`
#          runs the rest on workers pinned to a CPU each (--one-cpu-each), then these alone.
MARKER_FIXTURES = {
    "model": {"model_path", "runner", "shared_runner", "q8_model", "server"},
    "pty": {
        "llmrun_env",
        "server",
        "q8_model",
        "serve_env",
        "llama_bench_path",
        "llama_cpp_source",
        "rpc_build",
    },
    "slow": {"llama_bench_path", "rpc_build"},
    "cores": {"every_core"},
}
ON_ONE_CPU = "needs every CPU (marked `cores`), and this worker has its share: -m 'not cores'"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--one-cpu-each",
        action="store_true",
        help="pin each pytest-xdist worker, and what its tests start, to CPUs of its own "
        "(`make test`); tests marked `cores` need every CPU and refuse to run there",
    )


def pytest_configure(config: pytest.Config) -> None:
    """With --one-cpu-each, each pytest-xdist worker keeps to its share of the CPUs, and so do
    the processes its tests start (they inherit the affinity) and llmrun's llama.cpp threads
    (llmrun counts the CPUs it may use: runners/system.py). llama.cpp's threads wait for each
    other at every graph barrier spinning, so two workers whose llama.cpp threads share two
    cores wait for a thread that is not running at each barrier: the whole suite on two
    unpinned workers took 27 minutes where one process took 17 (docs/architecture.md, "Tests")."""
    # xdist's own word that this is a worker (its PYTEST_XDIST_* variables reach the processes
    # the tests start too, a pytest among them)
    worker: dict[str, object] = getattr(config, "workerinput", None) or {}
    count = int(str(worker.get("workercount", 0)))
    if not config.getoption("one_cpu_each") or count < 2:
        return
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_setaffinity") else []
    share = len(cpus) // count
    if share:  # fewer CPUs than workers: as they are
        # a worker that replaces a crashed one is gw2, gw3, ...: the CPUs of gw0, gw1, ...
        index = int(str(worker["workerid"]).removeprefix("gw")) % count
        try:
            os.sched_setaffinity(0, cpus[index * share : (index + 1) * share])
        except OSError:  # a sandbox that refuses the call: the workers share the CPUs
            return
        config.stash[PINNED] = True


PINNED = pytest.StashKey[bool]()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        for marker, fixtures in MARKER_FIXTURES.items():
            if used & fixtures:
                item.add_marker(marker)
        if item.get_closest_marker("slow"):  # llama.cpp's tools take the machine's threads
            item.add_marker("cores")


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("cores") and item.config.stash.get(PINNED, False):
        pytest.fail(f"{item.nodeid} {ON_ONE_CPU}", pytrace=False)


@pytest.fixture(scope="session", autouse=True)
def interruptible() -> None:
    """Ctrl-C as a terminal delivers it, however the suite was started: a command run in the
    background of a non-interactive shell (`cmd &`, a supervisor's script) inherits SIGINT
    ignored, and Python then installs no KeyboardInterrupt handler, so a test that sends itself
    a Ctrl-C (popen_then_ctrl_c) waited out its child (600 s) instead. The processes the tests
    start get SIGINT's default at exec, as from a shell."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session", autouse=True)
def quiet_machine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A quiet machine, whatever the load on this one, in the tests and in every process they
    start (module-scoped fixtures copy the environment too, so it is set for the session): a
    test that wants a busy one says so (tests/test_busy.py), and no output depends on what else
    runs here.

    Two costs are cut the same way (tests/inject/sitecustomize.py says how): llmrun's
    repacking probe of a model file runs once a session, not in each test's fresh LLMRUN_HOME;
    and bench's bandwidth probe copies 8 MiB twice (ram_bandwidth: llmrun's own size)."""
    memo = tmp_path_factory.mktemp("repack-probe") / "verdicts.json"
    with pytest.MonkeyPatch.context() as mp:
        path = os.environ.get("PYTHONPATH")
        mp.setenv("PYTHONPATH", os.pathsep.join([str(INJECT), *([path] if path else [])]))
        mp.setenv(BACKGROUND_ENV, "0")
        mp.setattr(system, "background_override", 0.0)
        mp.setenv(PROBE_ENV, str(memo))
        mp.setattr(probe, "run_probe", probe.run_probe)  # put back at the session's end
        share_probe(probe, memo)
        mp.setenv(BANDWIDTH_ENV, ",".join(map(str, QUICK_BANDWIDTH)))
        mp.setattr(system, "memory_bandwidth_runs", REAL_BANDWIDTH_RUNS)
        small_bandwidth_probe(system, *QUICK_BANDWIDTH)
        yield


@pytest.fixture(autouse=True)
def isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No test reads or writes the user's own config, history or tuned settings."""
    monkeypatch.setenv("LLMRUN_HOME", str(tmp_path / "llmrun-home"))
    for name in ("LLMRUN_ENDPOINT", "LLMRUN_API_KEY", "LLMRUN_MODEL", "LLMRUN_THREADS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(system, "background_override", 0.0)  # quiet_machine's, each test anew
    monkeypatch.setenv(BACKGROUND_ENV, "0")


@pytest.fixture
def ram_bandwidth(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bench's bandwidth probe as llmrun runs it (256 MiB, seven copies), for a test that holds
    a real decode rate against it; elsewhere the tests copy 8 MiB twice (quiet_machine)."""
    monkeypatch.setattr(system, "memory_bandwidth_runs", REAL_BANDWIDTH_RUNS)
    monkeypatch.delenv(BANDWIDTH_ENV, raising=False)


@pytest.fixture(scope="session")
def model_file() -> str:
    """The embedded model's file, for tests that read its bytes or header and never load it."""
    return default_model_path()


@pytest.fixture(scope="session")
def model_path(model_file: str) -> str:
    """The embedded model, for tests that load it (in-process, or through the CLI's default
    model with CliRunner): requesting it marks the test `model`."""
    return model_file


# Flash attention off: the engine tests compare greedy outputs (a reused prefix against a fresh
# prefill, a cut at a character), and llama.cpp's flash-attention CPU kernels round a split
# prefill differently from a whole one. The default (llama.cpp's auto) is tested on its own.
RUNNER_CONFIG = EngineConfig(n_ctx=2048, flash_attn="off")


@pytest.fixture(scope="session")
def shared_runner(model_path: str) -> Iterator[LlamaCppRunner]:
    """One loaded real model for the whole session."""
    r = LlamaCppRunner(model_path, RUNNER_CONFIG)
    r.load()
    yield r
    r.close()


@pytest.fixture
def runner(shared_runner: LlamaCppRunner) -> LlamaCppRunner:
    """The shared model with the engine tests' settings: a bench test may have switched them
    (reconfigure), and each test resets what else it needs."""
    if shared_runner.config != RUNNER_CONFIG:
        shared_runner.reconfigure(RUNNER_CONFIG)
    return shared_runner


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeRunner:
    """Route the CLI's runner factory to one FakeRunner and return it."""
    runner = FakeRunner()
    monkeypatch.setattr(engine, "RUNNER_FACTORY", lambda model, config: runner)
    return runner


@pytest.fixture
def cli() -> CliRunner:
    return CliRunner()


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """LLMRUN_HOME in the test's own folder (returned, for the history and tuned files a test
    reads back), and no colour in what the CLI prints."""
    monkeypatch.setenv("LLMRUN_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("NO_COLOR", "1")
    return tmp_path / "home"


@pytest.fixture
def fake_bench(monkeypatch: pytest.MonkeyPatch) -> FakeBenchRunner:
    """Route the CLI's bench runner factory to one FakeBenchRunner and return it."""
    fake = FakeBenchRunner()
    monkeypatch.setattr(engine, "BENCH_RUNNER_FACTORY", lambda model, config, tuned: fake)
    return fake


@pytest.fixture
def llmrun_env(tmp_path: Path) -> dict[str, str]:
    """Environment for child processes (isolated HF cache, offline, no debug): every test that
    starts a process requests it, which marks the test `pty`."""
    return child_env(tmp_path)


def child_env(folder: Path) -> dict[str, str]:
    """llmrun_env's environment, its caches and home in `folder` (for a fixture of wider
    scope than a test's)."""
    env = dict(os.environ)
    env.update(
        HF_HOME=str(folder / "hf"),
        HF_HUB_OFFLINE="1",
        NO_COLOR="1",
        LLMRUN_HOME=str(folder / "llmrun-home"),
    )
    env.pop("LLMRUN_DEBUG", None)
    env.pop("LLMRUN_MODEL", None)
    # a child on a pseudo-terminal reads its size there; a test that wants another says so
    # (a COLUMNS from the shell or pytest's worker folded a 40-column run's rows at 80)
    env.pop("COLUMNS", None)
    env.pop("LINES", None)
    return env  # a quiet machine: quiet_machine's PYTHONPATH and TESTS_BACKGROUND_CPUS=0


def which_llmrun() -> str:
    return LLMRUN if os.path.exists(LLMRUN) else shutil.which("llmrun") or "llmrun"


def bench_pp8(model: str, *more: str) -> list[str]:
    """`llmrun bench` at its smallest: one pp8 repetition of `model`, rows as JSON on stdout,
    with `more` options."""
    return [
        which_llmrun(),
        "bench",
        "-r",
        "1",
        "-m",
        model,
        "-p",
        "8",
        "-n",
        "0",
        "-o",
        "json",
        *more,
    ]


def popen_then_ctrl_c(
    monkeypatch: pytest.MonkeyPatch,
) -> list[subprocess.Popen[bytes]]:
    """subprocess.Popen replaced, for one test, by one that sends this process SIGINT after
    the fork, before Popen returns (a window a loaded machine widens); the children it
    started, for the test to check and clean up."""
    started: list[subprocess.Popen[bytes]] = []
    popen = subprocess.Popen

    def popen_then_signal(*args: object, **kwargs: object) -> subprocess.Popen[bytes]:
        child: subprocess.Popen[bytes] = popen(*args, **kwargs)  # type: ignore[call-overload]
        started.append(child)
        os.kill(os.getpid(), signal.SIGINT)  # its handler runs before this returns
        return child

    monkeypatch.setattr(subprocess, "Popen", popen_then_signal)
    return started


def llmrun_code_runs(proc: subprocess.Popen[bytes]) -> None:
    """Wait until llmrun's own first code has run in `proc`: its startup handler catches SIGHUP,
    the last signal it installs, and neither CPython nor anything before llmrun does. Before that
    moment the process is still CPython starting up (exec, `site`, the editable install's finder:
    about 30 ms on a quiet machine, several times that on a busy one), where a Ctrl-C is
    CPython's to handle: it prints "Fatal Python error: init_import_site" for any program."""
    status = Path(f"/proc/{proc.pid}/status")
    deadline = time.monotonic() + HANG_S
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            caught = next(
                line for line in status.read_text().splitlines() if line.startswith("SigCgt:")
            )
        except (OSError, StopIteration):
            return
        if int(caught.split()[1], 16) & (1 << (signal.SIGHUP - 1)):
            return
        time.sleep(0.001)


class SetAfter(threading.Event):
    """Reads as set from its `n`-th look on: the engine's loop looks once a step (or chunk),
    llama.cpp's abort hook between the graph's nodes. A cancel that lands at a known point of
    the work, whatever the machine's speed or load (a timer's does not)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n, self.looks = n, 0

    def is_set(self) -> bool:
        self.looks += 1
        return self.looks >= self.n or super().is_set()


def python_child(code: str, *args: str, env: dict[str, str]) -> subprocess.Popen[str]:
    """A Python child running `code` with `args` in the checkout, its stderr read as text, for a
    test that signals it while it waits."""
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


SERVER_LOGS: dict[str, Path] = {}


def served_completions(url: str) -> int:
    """How many completion requests the llama_server at `url` has started to answer (its access
    log has a line per response), for a test that waits for work done rather than a time."""
    log = SERVER_LOGS[url].read_text(encoding="utf-8", errors="replace")
    return len(re.findall(r'"POST /v1/(?:chat/)?completions HTTP', log))


@contextlib.contextmanager
def llama_server(model_path: str) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A real llama-cpp-python OpenAI-compatible server on loopback, with the embedded model."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_fd, log_name = tempfile.mkstemp(prefix="llama-server-", suffix=".log")
    SERVER_LOGS[url] = Path(log_name)
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "tests" / "llama_server.py"),
            "--model",
            model_path,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--n_ctx",
            "2048",
            "--verbose",
            "False",
            "--interrupt_requests",
            "False",
            # llama-cpp-python's defaults (half the CPUs, all of them for a batch) counted from
            # the CPUs this process may use, as llmrun counts them: os.cpu_count() would put
            # two threads on a pinned worker's one CPU (conftest.pytest_configure)
            *("--n_threads", str(max(1, system.logical_cpus() // 2))),
            *("--n_threads_batch", str(system.logical_cpus())),
        ],
        stdout=log_fd,
        stderr=subprocess.STDOUT,
    )
    os.close(log_fd)
    try:
        deadline = time.monotonic() + HANG_S
        while True:
            try:
                with urllib.request.urlopen(url + "/v1/models", timeout=1):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the llama-cpp-python server did not start") from None
                time.sleep(0.2)
        yield url, proc
    finally:
        stop(proc, grace_s=10)
        SERVER_LOGS.pop(url).unlink(missing_ok=True)


@pytest.fixture(scope="session")
def server(model_path: str) -> Iterator[str]:
    with llama_server(model_path) as (url, _):
        yield url


@pytest.fixture(scope="session")
def q8_model(tmp_path_factory: pytest.TempPathFactory, model_path: str) -> str:
    """A Q8_0 copy of the embedded model, made with llama.cpp's own quantize API (its log goes
    to stdout from C, so it runs in a child process)."""
    path = tmp_path_factory.mktemp("quant") / "SmolLM2-135M-Instruct.Q8_0.gguf"
    code = (
        "import ctypes, llama_cpp, sys\n"
        "p = llama_cpp.llama_model_quantize_default_params()\n"
        "p.ftype = 7\n"
        "p.allow_requantize = True\n"
        "sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(),"
        " ctypes.byref(p)))\n"
    )
    subprocess.run(
        [sys.executable, "-c", code, model_path, str(path)],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=HANG_S,
    )
    return str(path)


@pytest.fixture(scope="session")
def llama_cpp_source() -> Path:
    """The llama.cpp sources of the installed llama-cpp-python, unpacked (the first use fetches
    the sdist through pip, a process: requesting it marks the test `pty`)."""
    from . import llama_tools

    return llama_tools.llama_cpp_dir()


@pytest.fixture(scope="session")
def every_core() -> None:
    """For a test that runs llama.cpp on more threads than one CPU, or needs two CPUs:
    requesting it marks the test `cores`, which `make test` runs with the whole machine after
    the rest (pytest_configure says why)."""


@pytest.fixture(scope="session")
def llama_bench_path() -> Path:
    """llama.cpp's llama-bench from the sources of the installed llama-cpp-python (LLAMA_BENCH
    overrides; the first use builds it against the wheel's libllama): requesting it marks the
    test `slow` and `pty`."""
    from . import llama_tools

    return llama_tools.llama_bench()


@pytest.fixture(name="tree")
def powercap_tree(tmp_path: Path) -> Iterator[Path]:
    """A directory for a fake powercap tree (tests/test_energy*.py): in memory where the system
    has one, since its counters are rewritten every fake millisecond (on a busy disk, 6,000
    writes took 28 s)."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        yield tmp_path
        return
    with tempfile.TemporaryDirectory(dir=shm) as top:
        yield Path(top)
