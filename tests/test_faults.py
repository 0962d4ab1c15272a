"""Faults (issue 29): every long phase stops on Ctrl-C and SIGTERM with what it finished kept,
and a stderr that fails never costs stdout or the history."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmrun.cli.app import app
from llmrun.cli.bench import tune
from llmrun.runners import perplexity as ppl
from llmrun.runners import probe, system
from llmrun.runners.base import Finished, Request, SamplingParams, Token
from llmrun.runners.bench import tuning
from llmrun.runners.config import EngineConfig
from llmrun.runners.errors import LoadCancelledError
from llmrun.runners.llamacpp import LlamaCppRunner
from llmrun.runners.serving.batching import FINISH_CANCELLED, Arrival, BatchedEngine
from llmrun.runners.serving.policy import Policy

from .conftest import HANG_S, ROOT, SetAfter, popen_then_ctrl_c, python_child, which_llmrun
from .fake import FakeBenchRunner
from .hostile_files import plant
from .stub_server import bench_against_stub, stub_server

# A signal is answered within this long, on a machine busy with other tests (a few hundred ms
# of work at most: a tokenized piece, a batch of a perplexity window, a look at a pipe).
ANSWERED_S = 10.0
# tune's set-up and interference's long prefill: 37.8 s and 58.7 s before
SET_UP_ANSWERED_S = 15.0
DECLARATION = (ROOT / "examples" / "declaration_of_independence.txt").read_text()


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _alive(proc: subprocess.Popen[str], deadline: float) -> None:
    """Fails the test (and ends the process) when the process ended or the deadline passed."""
    if proc.poll() is None and time.monotonic() < deadline:
        return
    proc.kill()
    _, err = proc.communicate()
    pytest.fail(f"exit {proc.returncode} or past the deadline: {err[-2000:]}")


def _started(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [which_llmrun(), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )


def _stopped(proc: subprocess.Popen[str], signum: int) -> tuple[str, str, float]:
    """Send the signal; (stdout, stderr, seconds until the process ended)."""
    sent = time.monotonic()
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=HANG_S)
    return out, err, time.monotonic() - sent


def _wait_for_cpu(proc: subprocess.Popen[str], seconds: float) -> None:
    """Until the process has worked this long (CPU time: a busy machine cannot cut it short)."""
    deadline = time.monotonic() + HANG_S
    start = _cpu_s(proc.pid)
    while _cpu_s(proc.pid) - start < seconds:
        _alive(proc, deadline)
        time.sleep(0.1)


def _children(pid: int) -> list[int]:
    return [
        int(c)
        for task in Path(f"/proc/{pid}/task").iterdir()
        for c in (task / "children").read_text().split()
    ]


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def _wait_for_open(proc: subprocess.Popen[str], path: Path) -> None:
    """Until the process has the file open."""
    deadline = time.monotonic() + HANG_S
    while True:
        _alive(proc, deadline)
        for fd in Path(f"/proc/{proc.pid}/fd").iterdir():
            try:
                if os.readlink(fd) == str(path):
                    return
            except OSError:
                continue
        time.sleep(0.1)


def _history(env: dict[str, str]) -> str:
    return subprocess.run(
        [which_llmrun(), "history"], env=env, capture_output=True, text=True, timeout=HANG_S
    ).stdout


# ---- perplexity ----------------------------------------------------------------------------


def test_tokenizing_in_pieces_gives_the_whole_texts_tokens(
    runner: LlamaCppRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ppl, "TOKENIZE_PIECE", 500)
    text = DECLARATION * 2

    def tokenize(piece: str) -> list[int]:
        return runner.tokenize(piece, add_special=False)

    calls: list[str] = []

    def counted(piece: str) -> list[int]:
        calls.append(piece)
        return tokenize(piece)

    assert ppl.tokenize_interruptibly(counted, text, threading.Event()) == tokenize(text)
    assert sum(len(c) > 2 * ppl.SEAM for c in calls) > 10  # in pieces
    stop = threading.Event()
    stop.set()
    assert ppl.tokenize_interruptibly(tokenize, text, stop) is None


def test_a_cut_that_a_tokenizer_joins_across_falls_back_to_the_whole_text(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A tokenizer that adds something at each text's start (SentencePiece's space) fails the
    check at the first cut: the text is then tokenized whole."""
    monkeypatch.setattr(ppl, "TOKENIZE_PIECE", 10)
    calls: list[str] = []

    def tokenize(piece: str) -> list[int]:
        calls.append(piece)
        return [0, *(ord(c) for c in piece)]

    text = "first line\nsecond line\nthird line\n"
    assert ppl.tokenize_interruptibly(tokenize, text, threading.Event()) == tokenize(text)
    assert calls[-2] == text


# `llmrun run` whose model load is one long C call that checks no signal, as a call into
# llama.cpp is (PBKDF2's rounds in OpenSSL: 2**31 - 1 of them take minutes)
STUCK = textwrap.dedent("""
    import hashlib, os, sys
    from llmrun.cli import engine
    from tests.fake import FakeRunner
    rounds = int(sys.argv[1])

    class Stuck(FakeRunner):
        def load(self, *, cancel=None):
            os.write(2, b"in C\\n")
            hashlib.pbkdf2_hmac("sha256", b"x", b"y", rounds)
            return super().load(cancel=cancel)

    engine.RUNNER_FACTORY = lambda model, config: Stuck()
    from llmrun.cli.main import main
    sys.argv = ["llmrun", "run", "-q", "hi"]
    main()
""")
STOPPED: dict[int, int] = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}


@pytest.mark.parametrize("signum", list(STOPPED))
def test_a_second_signal_ends_a_process_that_one_long_c_call_holds(
    llmrun_env: dict[str, str], signum: int
) -> None:
    """Python runs a handler only between bytecodes: a grammar's sampler inside llama.cpp ran
    for 700 s and heeded neither SIGTERM nor Ctrl-C. The first signal still waits for the call
    (what was done is kept once it returns); a second ends the process at once."""
    proc = python_child(STUCK, str(2**31 - 1), env=llmrun_env)
    assert proc.stderr is not None and proc.stderr.readline() == "in C\n"
    try:
        time.sleep(1)  # inside the call
        proc.send_signal(signum)
        time.sleep(1.5)  # a second counts a second (stuck.STUCK_S) after the first
        assert proc.poll() is None  # the first waits for the call to return
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=HANG_S)
    finally:
        proc.kill()
    assert proc.returncode == STOPPED[signum], err
    assert err == "llmrun: stopped inside a call into llama.cpp (a second signal)\n"


BUSY = STUCK.replace(  # the load is Python that runs for `rounds` seconds instead
    'hashlib.pbkdf2_hmac("sha256", b"x", b"y", rounds)',
    "end = time.monotonic() + rounds\n        while time.monotonic() < end: pass",
).replace("import hashlib, os, sys", "import hashlib, os, sys, time")


def test_two_signals_together_end_a_process_that_runs_python_as_one(
    llmrun_env: dict[str, str],
) -> None:
    """systemd sends SIGTERM and SIGHUP together: read in one go, the second found no sign of
    life yet and ended a healthy process at once, its results lost (the review's race)."""
    proc = python_child(BUSY, "3", env=llmrun_env)  # 3 s of Python: signals are heard
    assert proc.stderr is not None and proc.stderr.readline() == "in C\n"
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGHUP)
    _, err = proc.communicate(timeout=HANG_S)
    assert proc.returncode in (143, 129), err
    assert "stopped inside" not in err and "Traceback" not in err


def test_one_signal_waits_for_the_call_and_ends_as_ever(llmrun_env: dict[str, str]) -> None:
    proc = python_child(STUCK, str(3_000_000), env=llmrun_env)  # a second or so
    assert proc.stderr is not None and proc.stderr.readline() == "in C\n"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 143, err
    assert "stopped inside" not in err and "Traceback" not in err


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_fifo_without_a_writer_ends_on_a_signal(
    llmrun_env: dict[str, str], model_path: str, tmp_path: Path, signum: int
) -> None:
    fifo = tmp_path / "text.fifo"
    os.mkfifo(fifo)
    proc = _started(
        ["bench", "-r", "1", "-m", model_path, "-p", "8", "-n", "0", "--ppl", str(fifo)],
        llmrun_env,
    )
    _wait_for_open(proc, fifo)  # started, options parsed, waiting on the pipe
    _, err, took = _stopped(proc, signum)
    assert proc.returncode == (130 if signum == signal.SIGINT else 143), err
    assert took < ANSWERED_S and "Traceback" not in err
    assert err.splitlines()[-1] == "llmrun: interrupted"  # as every command says it (it said none)


def test_a_fifo_is_read_as_its_data_arrives(
    llmrun_env: dict[str, str], model_path: str, tmp_path: Path
) -> None:
    fifo = tmp_path / "text.fifo"
    os.mkfifo(fifo)
    proc = _started(
        [
            *("bench", "-r", "1", "-m", model_path, "-p", "8", "-n", "0", "--ppl", str(fifo)),
            *("-c", "64", "-o", "json"),
        ],
        llmrun_env,
    )
    with open(fifo, "w") as writer:  # opens once llmrun has
        writer.write(DECLARATION[:3000])
    out, err = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 0, err
    assert json.loads(out)[0]["ppl"] > 1


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_large_text_stops_in_its_perplexity_and_keeps_the_rows(
    llmrun_env: dict[str, str], model_path: str, tmp_path: Path, signum: int
) -> None:
    """The text is tokenized before the speed tests (one too short for a window is refused
    before them), then pp8 runs and its row is held for the perplexity. The signal comes 2 s
    of CPU time after pp8's row, in the windows: 1 MB is some 450 windows of 512 tokens,
    minutes of work, where 24 MB only added 13 s of CPU to tokenize."""
    text = tmp_path / "large.txt"
    text.write_text(DECLARATION * (2**20 // len(DECLARATION)))
    proc = _started(
        [
            *("bench", "-r", "1", "--no-warmup", "-m", model_path, "-p", "8", "-n", "0"),
            *("--ppl", str(text), "-o", "json", "--progress"),
        ],
        llmrun_env,
    )
    assert proc.stderr is not None
    while "1/1 pp8" not in proc.stderr.readline():  # the row is held for the perplexity
        _alive(proc, time.monotonic() + HANG_S)
    _wait_for_cpu(proc, 2.0)
    out, err, took = _stopped(proc, signum)
    assert proc.returncode == (130 if signum == signal.SIGINT else 143), err
    assert took < ANSWERED_S, f"the signal waited {took:.1f} s"
    assert [r["test"] for r in json.loads(out)] == ["pp8"]
    assert "pp8" in _history(llmrun_env)


# ---- a stderr that fails -------------------------------------------------------------------


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_stderr_costs_no_result(llmrun_env: dict[str, str], tmp_path: Path) -> None:
    """2>/dev/full: every write to stderr fails (progress, warnings, the stats)."""
    stats = tmp_path / "stats.jsonl"
    with stub_server() as url, open("/dev/full", "w") as full:

        def run(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [which_llmrun(), *args, "--endpoint", url, "-m", "stub"],
                env=llmrun_env,
                stdout=subprocess.PIPE,
                stderr=full,
                stdin=subprocess.DEVNULL,
                text=True,
                timeout=HANG_S,
            )

        serve = run("bench", "serve", "--num-prompts", "2", "--concurrency", "1", "-o", "json")
        interference = run("bench", "interference", "-o", "json")
        text = run("run", "hi", "--stats-file", str(stats))
    assert serve.returncode == 0 and json.loads(serve.stdout)[0]["completed"] == 2
    assert "serve c1" in _history(llmrun_env)
    assert interference.returncode == 0 and json.loads(interference.stdout)
    assert text.returncode == 0 and "stub server" in text.stdout
    assert json.loads(stats.read_text().splitlines()[-1])["output_tokens"] > 0


# ---- speculative decoding ------------------------------------------------------------------


def test_an_interrupted_speculative_run_counts_the_drafts_of_its_output(
    runner: LlamaCppRunner,
) -> None:
    """Ctrl-C between the accepted drafts of one step: those not emitted are not counted."""
    request = Request.chat(
        f"Repeat this text exactly:\n\n{DECLARATION[:1200]}",
        sampling=SamplingParams(max_tokens=40, temperature=0, draft=8),
    )
    seen: list[tuple[int, int, int]] = []
    for stop_at in range(6, 30, 3):
        cancel = threading.Event()
        finished = None
        for event in runner.stream(request, cancel=cancel):
            if isinstance(event, Token) and event.index == stop_at:
                cancel.set()
            elif isinstance(event, Finished):
                finished = event
        assert finished is not None
        s = finished.stats
        seen.append((s.output_tokens, s.accepted_tokens, s.draft_tokens))
    assert any(accepted for _, accepted, _ in seen), seen  # the text repeats: drafts accepted
    assert all(accepted < output and accepted <= drafted for output, accepted, drafted in seen), (
        seen
    )


# ---- tune ----------------------------------------------------------------------------------


def test_tune_on_a_busy_machine_starts_from_runs_threads_and_marks_its_rows(
    cli: CliRunner, home: Path, fake_bench: FakeBenchRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Other processes keep 3 of 4 CPUs busy: run would take 1 thread of 4, so tune's first
    setting is 1 thread, and every setting measured is marked with the busy warning."""
    monkeypatch.setattr(tuning, "default_threads", lambda: 4)
    monkeypatch.setattr(tuning, "logical_cpus", lambda: 4)
    monkeypatch.setattr(system, "logical_cpus", lambda: 4)
    monkeypatch.setattr(system, "background_override", 3.0)
    result = cli.invoke(app, ["tune", "--workload", "chat"])
    assert result.exit_code == 0, result.stderr
    assert fake_bench.configs[0].n_threads == 1
    said = " ".join(result.stderr.split())
    assert "llmrun: threads 1 of 4: other processes keep 3.0 of 4 CPUs busy" in said
    assert "busy machine: may be noise" in said
    assert re.search(
        r"llmrun: warning: other processes kept up to 3\.0 of \d CPUs busy during \d+ of", said
    )


def test_a_budget_too_short_for_one_setting_says_so_and_keeps_what_was_measured(
    cli: CliRunner, home: Path, fake_bench: FakeBenchRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each look at the clock is 50 ms later: half of the first setting takes longer than half
    of the 20 s budget."""
    ticks = iter(range(10**6))
    monkeypatch.setattr(tune, "clock_s", lambda: next(ticks) * 0.05)
    result = cli.invoke(app, ["tune", "--budget", "20s"])
    said = " ".join(result.stderr.split())
    assert result.exit_code == 1, said
    assert "more than the --budget of 0:20 holds: stopping with what was measured" in said
    assert "cut short by the stop" in said  # the first setting's finished shapes, in the table
    assert "the first setting was measured in part; nothing saved" in said
    assert not (home / "config" / "tuned.json").exists()


def test_tunes_first_setting_is_what_run_uses_flash_attention_auto(
    cli: CliRunner, home: Path, fake_bench: FakeBenchRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """run given no -fa leaves flash attention to llama.cpp's auto (EngineConfig's None), but
    the row labelled llmrun's defaults ran fa=off under a header saying auto."""
    monkeypatch.setattr(tuning, "default_threads", lambda: 1)
    monkeypatch.setattr(tuning, "logical_cpus", lambda: 1)
    result = cli.invoke(app, ["tune", "--workload", "chat"])
    assert result.exit_code == 0, result.stderr
    first = fake_bench.configs[0]
    run_default = EngineConfig()
    assert run_default.flash_attn is None and first.flash_attn == "auto"  # llama.cpp's None
    assert (first.n_batch, first.n_ubatch, first.repack) == (512, 512, run_default.repack)
    said = " ".join(result.stderr.split())
    assert re.search(r"t=1 b=512 ub=512 fa=auto .*llmrun's defaults", said), said
    assert "fa=off" in said and "fa=on" in said  # both measured against auto
    assert "no flash attention" not in said and "batch 512, flash attention auto" in said


def test_tunes_header_names_the_saved_entry_a_partial_one_too(
    cli: CliRunner, home: Path, fake_bench: FakeBenchRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chat entry a --budget cut short is what run and chat apply, yet tune's header said
    'nothing tuned for this model'."""
    from llmrun.runners.bench.tuned import apply_tuning, save_tuned

    monkeypatch.setattr(tuning, "default_threads", lambda: 1)
    monkeypatch.setattr(tuning, "logical_cpus", lambda: 1)
    partial = "stopped by --budget after 8 trials"
    chat = {"n_threads": 1, "n_threads_batch": 1, "n_batch": 256, "n_ubatch": 256}
    save_tuned(fake_bench.model_path, {"chat": {**chat, "flash_attn": "on", "partial": partial}})
    assert apply_tuning(EngineConfig(), fake_bench.model_path).tuned  # run's reading
    result = cli.invoke(app, ["tune", "--workload", "chat", "--budget", "1h"])
    assert result.exit_code == 0, result.stderr
    said = " ".join(result.stderr.split())
    assert "nothing tuned" not in said
    assert (
        "llmrun's defaults, where tune starts; saved already: tuned for chat (partial:"
        f" {partial}) in" in said
    ), said
    assert fake_bench.configs[0].n_batch == 512  # the search starts from the defaults still
    empty = home.parent / "elsewhere"
    monkeypatch.setenv("LLMRUN_HOME", str(empty))
    fresh = cli.invoke(app, ["tune", "--workload", "chat"])
    assert "where tune starts (nothing tuned for this model yet)" in " ".join(fresh.stderr.split())


# ---- the repacking probe -------------------------------------------------------------------


def test_a_probe_ended_by_ctrl_c_is_no_verdict(
    llmrun_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C in a first load reaches the probe's child too: its death by SIGINT was cached as
    'repacked kernels crashed a probe', and repacking stayed off for that quantization."""
    monkeypatch.setenv("LLMRUN_HOME", str(tmp_path / "home"))
    # SIGINT's default action, whatever the test runner's (a background job ignores SIGINT)
    die = "signal.signal(signal.SIGINT, signal.SIG_DFL); os.kill(os.getpid(), signal.SIGINT)"
    child = [sys.executable, "-c", f"import os, signal; {die}"]
    verdict = probe.run_probe("m.gguf", child)
    assert verdict.interrupted and not verdict.safe
    crashed = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"]
    assert not probe.run_probe("m.gguf", crashed).interrupted  # a crash stays a verdict
    monkeypatch.setattr(probe, "run_probe", lambda *args, **kw: verdict)
    probe.repack_verdict("m.gguf", "Q4_0")
    assert probe.probe_key("Q4_0") not in probe._read_cache()


@pytest.mark.parametrize("kind", ["fifo", "folder", "huge", "garbage"])
def test_a_probe_cache_that_is_no_cache_is_probed_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """The verdicts file is read as a regular file only: a FIFO there blocked every run's
    open, SIGTERM included (the wait ran in a thread here, so a regression fails, not hangs)."""
    monkeypatch.setenv("LLMRUN_HOME", str(tmp_path / "home"))
    cache = probe._cache_file()
    plant(cache, kind, cap=probe.MAX_CACHE_BYTES)
    if kind == "garbage":
        cache.write_bytes(b"\xff[" * 100_000)
    found: list[object] = []
    reader = threading.Thread(target=lambda: found.append(probe._read_cache()), daemon=True)
    reader.start()
    reader.join(30)
    assert found == [{}]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_ends_tunes_set_up_and_the_probes_child(
    llmrun_env: dict[str, str], model_path: str, signum: int
) -> None:
    """tune's load ran with the runner's own cancel: a SIGTERM (or a Ctrl-C sent to llmrun
    alone) waited for the probe's child, up to its 120 s, then for the load (37.8 s before)."""
    proc = _started(
        ["tune", "-m", model_path, "--budget", "60s"],
        {**llmrun_env, "TESTS_PROBE_HOLD": "300"},  # the probe's child: a sleep that long
    )
    deadline = time.monotonic() + HANG_S
    while not (children := _children(proc.pid)):  # in the set-up, the probe under way
        _alive(proc, deadline)
        time.sleep(0.1)
    _, err, took = _stopped(proc, signum)
    assert proc.returncode == (130 if signum == signal.SIGINT else 143), err
    assert took < SET_UP_ANSWERED_S, f"the signal waited {took:.1f} s"
    assert "Traceback" not in err and "nothing saved" not in err
    for pid in children:  # ended with the command, not left running
        assert not Path(f"/proc/{pid}").exists() or "Z" in _state(pid)


def test_a_load_given_a_set_cancel_stops_before_the_weights(model_path: str) -> None:
    stop = threading.Event()
    stop.set()
    fresh = LlamaCppRunner(model_path, EngineConfig())
    try:
        with pytest.raises(LoadCancelledError):
            fresh.load(cancel=stop)
        assert fresh.loaded is None
    finally:
        fresh.close()


def test_a_probe_stops_when_its_cancel_is_set(llmrun_env: dict[str, str]) -> None:
    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()
    t0 = time.monotonic()
    verdict = probe.run_probe("m.gguf", [sys.executable, "-c", "import time; time.sleep(60)"], stop)
    assert verdict.interrupted and not verdict.safe
    assert time.monotonic() - t0 < ANSWERED_S


def test_a_ctrl_c_inside_the_probe_s_popen_kills_the_probe(
    llmrun_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """bench and doctor probe from the main thread, with no cancel: a Ctrl-C whose handler ran
    inside Popen, after the fork, raised there and left the probe's child running unheld. Now
    it is held until the child is the probe's, then delivered: the child is killed and waited
    for, and the Ctrl-C goes on up."""
    started = popen_then_ctrl_c(monkeypatch)
    # Python's own Ctrl-C, whatever the test runner's (a background job ignores SIGINT)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            probe.run_probe("m.gguf", [sys.executable, "-c", "import time; time.sleep(600)"])
        assert started and started[0].returncode == -signal.SIGKILL  # killed, and waited for
    finally:
        signal.signal(signal.SIGINT, before)
        for child in started:
            if child.poll() is None:
                child.kill()
                child.wait()


def test_a_ctrl_c_inside_a_popen_that_fails_still_stops_the_command(
    llmrun_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C held back while Popen ran, and Popen then failed (no such program): there is
    no child to stop, and the Ctrl-C goes on up rather than being lost in 'could not start'."""
    popen = subprocess.Popen

    def ctrl_c_then_fail(*args: object, **kwargs: object) -> subprocess.Popen[bytes]:
        os.kill(os.getpid(), signal.SIGINT)  # held: its handler has not raised
        return popen(*args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(subprocess, "Popen", ctrl_c_then_fail)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            probe.run_probe("m.gguf", ["/nonexistent/probe"])
    finally:
        signal.signal(signal.SIGINT, before)
    monkeypatch.setattr(subprocess, "Popen", popen)
    assert "could not start" in probe.run_probe("m.gguf", ["/nonexistent/probe"]).why


# ---- interference --------------------------------------------------------------------------


def test_a_long_prefill_step_stops_within_its_graph(runner: LlamaCppRunner) -> None:
    """prefill-first decodes a 512-token prompt in one llama_decode: the engine looked at its
    cancel only between steps (58.7 s of bench interference after Ctrl-C)."""
    engine = BatchedEngine(runner, n_seq=1, n_ctx_per_seq=600)
    try:
        prompt = tuple((i * 7 + 1) % 1000 for i in range(512))
        cancel = SetAfter(3)  # the loop's first look, then inside the step's graph
        results, steps = engine.run(
            [Arrival(0.0, prompt, 4)], Policy.parse("prefill-first"), cancel=cancel
        )
        assert steps == []  # the step was aborted, not finished
        assert results[0].finish == FINISH_CANCELLED and not results[0].output
        # the engine serves on after an aborted step
        results, steps = engine.run([Arrival(0.0, prompt[:8], 2)], Policy.parse("prefill-first"))
        assert len(results[0].output) == 2
    finally:
        engine.close()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_in_interferences_long_prefill_keeps_the_finished_stage(
    llmrun_env: dict[str, str], model_path: str, signum: int
) -> None:
    """One llama_decode of the 512-token prompt (prefill-first) took about 14 s on 2 busy
    cores, and the engine looked at Ctrl-C only between steps."""
    proc = _started(
        [
            *("bench", "interference", "-m", model_path, "--policy", "prefill-first"),
            *("--num-prompts", "1", "--prompt-len", "512", "--rate", "100", "--output-len", "16"),
            *("-o", "json"),
        ],
        llmrun_env,
    )
    assert proc.stderr is not None
    while "prefill-first:" not in proc.stderr.readline():  # the stream alone is done
        _alive(proc, time.monotonic() + HANG_S)
    _wait_for_cpu(proc, 1.0)  # in the long prompts' prefill
    out, err, took = _stopped(proc, signum)
    assert proc.returncode == (130 if signum == signal.SIGINT else 143), err
    assert took < SET_UP_ANSWERED_S, f"the signal waited {took:.1f} s"
    assert [r["policy"] for r in json.loads(out)] == ["alone"]


# ---- busy marks ----------------------------------------------------------------------------


def test_remote_serving_rows_carry_the_clients_busy_mark(
    cli: CliRunner, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loaded client delays what it times: its machine's load marks remote rows too (they
    had no busy mark at all: `busy: None`)."""
    monkeypatch.setattr(system, "background_override", 64.0)
    result = bench_against_stub(cli, "--num-prompts", "2", "--concurrency", "1", model="stub")
    assert result.exit_code == 0, result.stderr
    (row,) = json.loads(result.stdout)
    assert row["busy"] is True and row["background_cpus"] == 64.0
    assert "llmrun: warning: other processes kept up to 64.0" in " ".join(result.stderr.split())
