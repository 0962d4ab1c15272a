"""Trust at the edges: no crash, no lost result, no false figure, no leaked secret.

Each test stands for a class of hostile input (damaged model files, odd settings from every
source, signals, broken state files, misbehaving servers, secrets, odd bytes and locales).
Behaviour that depends on llama.cpp or on the process runs the real model in real processes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import sqlite3
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from llmrun.cli.app import app
from llmrun.runners import probe
from llmrun.runners.base import PrefillProgress, Request, SamplingParams
from llmrun.runners.bench.tuned import apply_tuning, tuned_file
from llmrun.runners.config import EngineConfig
from llmrun.runners.errors import LlmrunError, LoadCancelledError
from llmrun.runners.gguf import read_gguf
from llmrun.runners.history import History
from llmrun.runners.limits import SettingError, check_engine, engine_ranges
from llmrun.runners.llamacpp import LlamaCppRunner
from llmrun.runners.stats import GenerationStats
from llmrun.runners.system import CpuSample, background_cpus

from . import fuzz_gguf
from .conftest import BACKGROUND_ENV, HANG_S, ROOT, free_port, llmrun_code_runs, which_llmrun
from .stub_server import WORDS, stub_server


def llmrun(
    args: list[str],
    env: dict[str, str],
    *,
    stdin: bytes | None = None,
    timeout: float = 120,
    shell_suffix: str = "",
) -> subprocess.CompletedProcess[bytes]:
    """The installed command in its own process (bytes in, bytes out)."""
    if shell_suffix:
        quoted = " ".join(_quote(a) for a in [which_llmrun(), *args])
        return subprocess.run(
            ["bash", "-c", quoted + " " + shell_suffix],
            env=env,
            input=stdin,
            capture_output=True,
            timeout=timeout,
        )
    return subprocess.run(
        [which_llmrun(), *args],
        env=env,
        input=stdin if stdin is not None else b"",
        capture_output=True,
        timeout=timeout,
    )


def _quote(arg: str) -> str:
    return "'" + arg.replace("'", "'\\''") + "'"


def error_lines(stderr: bytes) -> list[str]:
    text = stderr.decode("utf-8", "replace")
    assert "Traceback" not in text and "internal error" not in text, text
    return [ln for ln in text.splitlines() if ln.strip()]


def one_error(result: subprocess.CompletedProcess[bytes], code: int = 1) -> str:
    assert result.returncode == code, result.stderr
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and lines[0].startswith("llmrun: error:"), lines
    return lines[0]


def patched_model(model_path: str, tmp: Path, edits: list[tuple[bytes, bytes]]) -> str:
    """A copy of the real model with same-length byte replacements in its header."""
    dst = tmp / "patched.gguf"
    shutil.copyfile(model_path, dst)
    head = dst.read_bytes()[: 8 << 20]
    with open(dst, "r+b") as f:
        for old, new in edits:
            assert len(old) == len(new)
            f.seek(head.index(old))
            f.write(new)
    return str(dst)


# ---- 1. the process never dies under the user ----------------------------------------------


def test_fuzzed_headers_end_in_exit_0_or_1_with_one_line(llmrun_env: dict[str, str]) -> None:
    # Its own process: the campaign forks a child per case, which is only safe in a process
    # that has not run llama.cpp yet (OpenMP's threads do not survive a fork).
    # The cases that cover every kind once (each field, each boundary value, flips in both parts
    # of the header); `make fuzz` runs 2,000.
    cases = str(fuzz_gguf.COVERING)
    result = subprocess.run(
        [sys.executable, "-m", "tests.fuzz_gguf", "--cases", cases, "--seed", "2026"],
        cwd=ROOT,
        env=llmrun_env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    covered, summary = result.stdout.strip().splitlines()[-2:]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert covered == "covered every kind of case", covered
    assert summary.startswith(f"{cases} cases, exit codes {{0: ") and ", 1: " in summary, summary
    assert summary.endswith(", 0 failed"), summary


def duplicate_token_model(model_path: str, tmp: Path) -> str:
    """Two identical vocabulary entries: passes every header check, then GGML_ASSERT fails."""
    data = Path(model_path).read_bytes()[: 8 << 20]
    a = data.index(struct.pack("<Q", 5) + b"hello")  # a 5-byte token
    b = data.index(struct.pack("<Q", 5) + b"world")
    dst = tmp / "dup.gguf"
    shutil.copyfile(model_path, dst)
    with open(dst, "r+b") as f:
        f.seek(b)
        f.write(data[a : a + 13])
    return str(dst)


def test_a_llama_cpp_abort_is_one_line_and_exit_1(
    model_path: str, tmp_path: Path, llmrun_env: dict[str, str]
) -> None:
    bad = duplicate_token_model(model_path, tmp_path)
    for args in (
        ["run", "-m", bad, "hi"],
        ["run", "-m", bad, "--json", "hi"],
        ["bench", "-m", bad, "-p", "8", "-n", "0", "-r", "1", "-o", "json"],
    ):
        result = llmrun(args, llmrun_env)
        assert result.returncode == 1, result.stderr
        lines = error_lines(result.stderr)
        assert lines[-1].startswith("llmrun: error: llama.cpp aborted: GGML_ASSERT("), lines
        assert "gdb" not in result.stderr.decode() and result.stdout == b"", args


@pytest.mark.parametrize(
    ("args", "env", "name"),
    [
        (["-t", "100000"], {}, "n_threads"),
        (["-t", "2000000000"], {}, "n_threads"),
        ([], {"LLMRUN_THREADS": "5000"}, "n_threads"),
        (["--ctx", "99999999999"], {}, "n_ctx"),
        (["-b", "99999999"], {}, "n_batch"),
    ],
)
def test_out_of_range_settings_never_reach_llama_cpp(
    args: list[str], env: dict[str, str], name: str, llmrun_env: dict[str, str]
) -> None:
    """An engine setting's range is its option's (limits.engine_ranges): Typer refuses it
    before anything loads, with exit 2, naming the bound."""
    result = llmrun(["run", "-n", "2", *args, "hi"], {**llmrun_env, **env})
    assert result.returncode == 2, result.stderr
    high = engine_ranges()[name][1]
    said = "".join(result.stderr.decode().replace("│", "").split())  # unwrapped from its box
    assert "isnotintherange" in said and f"<=x<={high}." in said
    assert b"Traceback" not in result.stderr


def test_a_context_past_the_memory_never_reaches_llama_cpp(llmrun_env: dict[str, str]) -> None:
    result = llmrun(["run", "-n", "2", "--ctx", "16000000", "hi"], llmrun_env)
    assert "of memory is available" in one_error(result)


def test_an_out_of_range_seed_is_a_usage_error(llmrun_env: dict[str, str]) -> None:
    """A sampling setting's range is its option's (limits.SAMPLING_SETTINGS): Typer refuses it
    before anything loads, with exit 2."""
    result = llmrun(["run", "-n", "2", "--seed", "99999999999", "hi"], llmrun_env)
    assert result.returncode == 2, result.stderr
    assert b"4294967295" in result.stderr and b"Traceback" not in result.stderr


def test_a_bad_tuned_file_names_itself(model_path: str, llmrun_env: dict[str, str]) -> None:
    home = Path(llmrun_env["LLMRUN_HOME"])
    key = f"{os.path.abspath(model_path)}:{os.path.getsize(model_path)}"
    tuned = home / "config" / "tuned.json"
    tuned.parent.mkdir(parents=True)
    for entry in ({"n_threads": 100000}, {"n_batch": "big"}, {"flash_attn": 3}):
        tuned.write_text(json.dumps({key: entry}))
        line = one_error(llmrun(["run", "-n", "2", "hi"], llmrun_env))
        assert str(tuned) in line, line


def test_a_bad_tuned_value_is_refused_where_it_is_not_used_this_time(model_path: str) -> None:
    """On a busy machine run sets the thread count before the tuned file is read: its
    n_threads, out of range, passed there and was refused on a quiet machine."""
    key = f"{os.path.abspath(model_path)}:{os.path.getsize(model_path)}"
    tuned = tuned_file()
    tuned.parent.mkdir(parents=True)
    tuned.write_text(json.dumps({key: {"n_threads": 100000, "n_batch": 256}}))
    with pytest.raises(SettingError, match="n_threads 100000 is out of range"):
        apply_tuning(EngineConfig(n_threads=1), model_path)


def _probe_ended_by(sig: int) -> probe.Verdict:
    code = f"import os, signal; signal.signal({sig}, signal.SIG_DFL); os.kill(os.getpid(), {sig})"
    if sig == signal.SIGKILL:  # it has no handler to reset
        code = f"import os; os.kill(os.getpid(), {sig})"
    return probe.run_probe("unused.gguf", command=[sys.executable, "-c", code])


def test_a_probe_the_oom_killer_ended_is_a_verdict_and_a_signal_sent_is_not(
    llmrun_env: dict[str, str],
) -> None:
    """SIGKILL comes from the out-of-memory killer: a verdict (cached, so not probed again at
    every load); SIGINT, SIGHUP and SIGTERM come from a user stopping the command: none."""
    killed = _probe_ended_by(signal.SIGKILL)
    assert not killed.safe and not killed.interrupted and "SIGKILL" in killed.why
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        assert _probe_ended_by(sig).interrupted, sig


def test_a_probe_crash_turns_repacking_off(model_path: str) -> None:
    crash = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGILL)"]
    verdict = probe.run_probe(model_path, command=crash)
    assert not verdict.safe and "SIGILL" in verdict.why
    info = read_gguf(model_path)
    probe._write_cache(probe.probe_key(info.quantization), verdict)
    runner = LlamaCppRunner(model_path, EngineConfig(n_ctx=256, repack=True))
    try:
        settings = runner.load().settings
    finally:
        runner.close()
    assert settings.repack is False and "SIGILL" in settings.repack_note
    # This CPU's real verdict: safe exactly when the probe ran through (its own command line:
    # the tests' processes otherwise share one verdict a session, tests/inject/sitecustomize.py)
    real = probe.run_probe(model_path, command=[sys.executable, "-c", probe.PROBE_CODE, model_path])
    assert real.safe == (real.why == "probed"), real


def test_sigterm_behaves_like_ctrl_c_and_exits_143(llmrun_env: dict[str, str]) -> None:
    proc = subprocess.Popen(
        [
            which_llmrun(),
            "run",
            "--raw",
            "-n",
            "2000",
            "--temp",
            "0",
            "--no-dashboard",
            "Count from one to a thousand:",
        ],
        env=llmrun_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )
    assert proc.stdout is not None
    first = proc.stdout.read(8)  # text is flowing
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 143, err
    assert len(first + out) > 8 and b"[interrupted]" in err and b"Traceback" not in err


@pytest.mark.parametrize("delay", [0.0, 0.01, 0.05, 0.1, 0.2, 0.4])
def test_ctrl_c_during_startup_is_quiet(delay: float, llmrun_env: dict[str, str]) -> None:
    proc = subprocess.Popen(
        [which_llmrun(), "run", "-n", "2", "hi"],
        env=llmrun_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )
    llmrun_code_runs(proc)
    time.sleep(delay)  # the moment of the Ctrl-C is the input here: any moment must be quiet
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=HANG_S)
    assert b"Traceback" not in err, err
    assert proc.returncode in (0, 130), err  # 0 only if it had already finished


def test_ctrl_c_stops_a_long_depth_fill_within_a_second(llmrun_env: dict[str, str]) -> None:
    proc = subprocess.Popen(
        [
            which_llmrun(),
            "bench",
            "-d",
            "30000",
            "-c",
            "31000",
            "-p",
            "1",
            "-n",
            "0",
            "-r",
            "1",
            "--no-history",
            "-o",
            "json",
        ],
        env=llmrun_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )
    assert proc.stderr is not None
    for line in proc.stderr:  # loaded, bandwidth probed, settings shown: the depth fill is next
        if line.lstrip().startswith(b"settings"):
            break
    assert proc.poll() is None
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=HANG_S)
    # Filling 30,000 tokens of depth takes 30 s or more on 2 CPU cores (longer on a busy
    # machine), so a Ctrl-C that waited for it would take well past 15 s; stopping at the next
    # batch takes a second or two even on a busy machine.
    assert time.monotonic() - sent < 15, "Ctrl-C waited for the depth fill"
    assert proc.returncode == 130 and b"Traceback" not in err, err


def test_ctrl_c_stops_a_model_load_at_the_next_tensor(model_path: str) -> None:
    runner = LlamaCppRunner(model_path, EngineConfig(n_ctx=256))
    cancel = threading.Event()
    cancel.set()  # as if Ctrl-C came while the weights were loading
    try:
        with pytest.raises(LoadCancelledError):
            list(runner.stream(Request(prompt="hi"), cancel=cancel))
        assert runner.loaded is None
        finished = list(runner.stream(Request(prompt="hi", sampling=SamplingParams(max_tokens=2))))
        assert finished[-1].stats.output_tokens == 2  # type: ignore[union-attr]
    finally:
        runner.close()


# ---- 2. no result is ever lost ---------------------------------------------------------------


def _damage(kind: str, home: Path) -> None:
    data = home / "data"
    db = data / "history.sqlite"
    data.mkdir(parents=True, exist_ok=True)
    if kind == "garbage":
        db.write_bytes(b"this is not a database" * 100)
    elif kind == "truncated":
        with History(db) as h:
            h.store([{"test": "pp8", "avg_ts": 1.0}], kind="bench", model="m", system={})
        db.write_bytes(db.read_bytes()[:1500])
    elif kind == "other schema":
        con = sqlite3.connect(db)
        con.executescript(
            "CREATE TABLE runs (id INTEGER PRIMARY KEY, time TEXT);"
            "CREATE TABLE results (run_id INTEGER, record TEXT);"
        )
        con.commit()
        con.close()


@pytest.mark.parametrize("kind", ["garbage", "truncated", "other schema", "read-only"])
def test_bench_results_reach_stdout_whatever_the_history(
    kind: str, llmrun_env: dict[str, str]
) -> None:
    home = Path(llmrun_env["LLMRUN_HOME"])
    home.mkdir(parents=True, exist_ok=True)
    env = dict(llmrun_env)
    if kind == "read-only":  # a place nobody, root included, can create folders in
        env["LLMRUN_HOME"] = "/proc/llmrun-home"
    else:
        _damage(kind, home)
    result = llmrun(["bench", "-p", "8", "-n", "0", "-r", "1", "-o", "json"], env)
    assert result.returncode == 0, result.stderr
    records = json.loads(result.stdout)
    assert records and records[0]["n_prompt"] == 8
    # (a busy machine may add its own warning: only the history's is counted)
    warning = [ln for ln in result.stderr.decode().splitlines() if "llmrun: warning: bench" in ln]
    assert len(warning) == 1 and "not stored" in warning[0], result.stderr


def test_history_lists_runs_around_a_damaged_row(tmp_path: Path, cli: CliRunner) -> None:
    with History() as h:
        for rate in (10.0, 12.0, 11.0):
            h.store(
                [{"test": "pp8", "avg_ts": rate, "stddev_ts": 0.1}],
                kind="bench",
                model="m",
                system={},
            )
        h.db.execute("UPDATE results SET record = '{broken' WHERE run_id = 2")
        h.db.execute("UPDATE results SET record = '[1, 2]' WHERE run_id = 1")
        h.db.commit()
    result = cli.invoke(app, ["history"])
    assert result.exit_code == 0, result.stderr
    assert "run 3" in result.stdout and "run 2" in result.stdout


def test_concurrent_writers_wait_for_the_lock(tmp_path: Path) -> None:
    db = tmp_path / "h.sqlite"
    History(db).close()
    holder = sqlite3.connect(db, check_same_thread=False)
    holder.execute("BEGIN EXCLUSIVE")
    asked = threading.Event()

    def release() -> None:  # a while after the writer has started: it has to wait for the lock
        asked.wait(HANG_S)
        time.sleep(0.2)
        holder.commit()

    releaser = threading.Thread(target=release)
    releaser.start()
    asked.set()
    with History(db) as h:
        run_id = h.store([{"test": "tg8", "avg_ts": 5.0}], kind="bench", model="m", system={})
    releaser.join()
    assert run_id == 1
    holder.close()


def test_bad_jsonl_lines_are_named_and_the_good_ones_answered(
    fake: object, cli: CliRunner, tmp_path: Path
) -> None:
    lines = [
        '{"prompt": "one two"}',
        '{"prompt": "x", "stop": 5}',
        '{"prompt": "x", "stop": [1, 2]}',
        '{"prompt": "x", "system": 5}',
        '{"prompt": "x", "temperature": -1}',
        '{"prompt": "x", "max_tokens": -3}',
        '{"prompt": "x", "top_p": 7}',
        '{"prompt": "x", "seed": 1e30}',
        '{"prompt": "three four"}',
    ]
    path = tmp_path / "batch.jsonl"
    path.write_text("\n".join(lines) + "\n")
    result = cli.invoke(app, ["run", "--jsonl", str(path), "-q"])
    assert result.exit_code == 1
    assert "two" in result.stdout and "four" in result.stdout
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("llmrun: error:")]
    assert [e.split(":")[3] for e in errors] == [str(n) for n in range(2, 9)], errors


@pytest.mark.parametrize("model", ["badnumbers", "listusage", "nousage"])
def test_a_server_with_garbage_figures_keeps_text_and_stats(
    model: str, cli: CliRunner, home: Path
) -> None:
    with stub_server() as url:
        result = cli.invoke(app, ["run", "hi", "--endpoint", url, "-m", model, "--stats", "json"])
        bench = cli.invoke(
            app,
            [
                "bench",
                "serve",
                "--endpoint",
                url,
                "-m",
                model,
                "--num-prompts",
                "2",
                "--concurrency",
                "1",
                "-o",
                "json",
            ],
        )
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "".join(WORDS) + "\n"
    stats = json.loads(result.stderr.strip().splitlines()[-1])
    assert stats["output_tokens"] == len(WORDS)
    assert stats["output_counted_as"] == "chunks"  # no trustworthy usage: chunks, said so
    assert stats["prompt_tps"] is None  # no trustworthy server prefill time, so no rate
    assert bench.exit_code == 0, bench.stderr
    level = json.loads(bench.stdout)[0]
    assert level["completed"] == 2 and level["failed"] == 0


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path


# ---- 3. no figure is false ---------------------------------------------------------------


def test_an_interrupted_prefill_rates_only_what_it_evaluated(model_path: str) -> None:
    runner = LlamaCppRunner(model_path, EngineConfig(n_ctx=2048, n_batch=64, n_ubatch=64))
    cancel = threading.Event()
    prompt = " ".join(f"word{i}" for i in range(400))
    finished = None
    try:
        for event in runner.stream(
            Request(prompt=prompt, sampling=SamplingParams(max_tokens=4)), cancel=cancel
        ):
            if isinstance(event, PrefillProgress) and event.done_tokens >= 64:
                cancel.set()
            finished = event
    finally:
        runner.close()
    s: GenerationStats = finished.stats  # type: ignore[union-attr]
    assert s.interrupted and s.new_prompt_tokens > 500
    assert s.prefilled_tokens == 64
    assert s.prompt_tps == pytest.approx(64 / s.prefill_s)
    assert s.ttft_s is None and s.output_tokens == 0
    assert s.decode_s is None and s.output_tps is None  # no token: no decode to time


def test_bench_refuses_negative_and_endless_sizes(cli: CliRunner) -> None:
    for args in (["-p", "-5"], ["-n", "-1"], ["-d", "-3"], ["-p", "1-100000000+1"]):
        result = cli.invoke(app, ["bench", *args, "-r", "1"])
        assert result.exit_code == 2, args  # a list that cannot be read: a usage error
        assert "out of range" in result.stderr or "more than" in result.stderr


def test_bench_refuses_an_unknown_load_mode_before_a_load(cli: CliRunner) -> None:
    """-lm bogus reached llama.cpp's table after the load's header: a KeyError."""
    result = cli.invoke(app, ["bench", "-lm", "mmap,bogus", "-r", "1", "-p", "8", "-n", "0"])
    assert result.exit_code == 2, result.stderr  # a name the option does not take: usage
    assert result.stderr.strip().splitlines()[-1] == (
        "llmrun: error: -lm: 'bogus' is not auto, none, mmap, mlock, mmap+mlock, dio"
    )
    config: Any = EngineConfig()  # a tuned.json or JSONL line can hold any name
    for name in ("load_mode", "lazy_mode", "split_mode"):
        with pytest.raises(SettingError, match=f"{name} must be one of .*, not 'bogus'"):
            check_engine(dataclasses.replace(config, **{name: "bogus"}), "tuned.json")


@pytest.mark.parametrize(
    ("name", "says", "code"),
    [  # a name that is none is a usage error; a place that cannot be written, exit 1
        ("charts.txt", "name the picture's format by its ending, one of avif, eps, ", 2),
        ("charts", "name the picture's format by its ending", 2),
        ("", "give a file name such as charts.png", 2),
        ("{tmp}", "a folder; give a file name such as charts.png", 1),
        ("{tmp}/no/x.png", "there is no folder {tmp}/no", 1),
        ("/proc/x.png", "cannot write it: ", 1),
        ("{tmp}/fifo.png", "not a regular file (a FIFO, a device or a socket); give a file", 1),
    ],
)
@pytest.mark.parametrize(
    "command",
    [["bench", "-r", "1", "-p", "8", "-n", "0", "--no-history"], ["bench", "interference"]],
    ids=" ".join,
)
def test_a_plot_that_cannot_be_written_is_refused_before_the_run(
    name: str, says: str, code: int, command: list[str], cli: CliRunner, tmp_path: Path
) -> None:
    """--plot y.txt failed with matplotlib's ValueError after the whole run, and --plot DIR said
    `charts written to DIR`."""
    given = name.format(tmp=tmp_path)
    if given.endswith("fifo.png"):  # its check opened it for writing and waited for a reader
        os.mkfifo(given)
    result = cli.invoke(app, [*command, "--plot", given])
    assert result.exit_code == code, result.stderr
    [line] = result.stderr.splitlines()  # one line, and no load's header before it
    assert line.startswith(
        f"llmrun: error: --plot{' ' + given if given else ''}: {says}".format(tmp=tmp_path)
    ), line
    left = [p for p in tmp_path.iterdir() if p.name != "fifo.png"]
    assert left == [], "the check leaves no file behind"


def test_remote_prefill_is_the_servers_and_ttft_the_clients(cli: CliRunner) -> None:
    with stub_server() as url:
        result = cli.invoke(app, ["run", "hi", "--endpoint", url, "--stats", "json"])
        plain = cli.invoke(app, ["run", "hi", "--endpoint", url, "-m", "nousage", "--no-dashboard"])
    stats = json.loads(result.stderr.strip().splitlines()[-1])
    assert stats["prefill_s"] == pytest.approx(0.004)
    assert stats["prompt_tps"] == pytest.approx(8 / 0.004)
    assert stats["ttft_s"] == stats["first_token_s"] > stats["prefill_s"]
    assert "output   6 chunks" in plain.stderr


def test_other_processes_load_is_measured_and_warned(llmrun_env: dict[str, str]) -> None:
    """The one test of a really busy machine: the faked quiet (conftest) is taken away."""
    env = {k: v for k, v in llmrun_env.items() if k != BACKGROUND_ENV}
    spinners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(os.cpu_count() or 2)
    ]
    try:
        time.sleep(0.3)
        result = llmrun(
            ["run", "--raw", "-n", "60", "--temp", "0", "-t", "1", "--no-dashboard", "Count:"], env
        )
    finally:
        for p in spinners:
            p.kill()
    err = result.stderr.decode()
    assert result.returncode == 0, err
    assert "warning  other processes kept" in err and "unreliable" in err


def test_background_cpus_and_the_busy_verdict() -> None:
    a, b = CpuSample(0.0, 100.0, 10.0), CpuSample(1.0, 102.5, 11.0)
    assert background_cpus(a, b) == pytest.approx(1.5)
    assert background_cpus(a, CpuSample(0.1, 100.0, 10.0)) is None  # too short to tell
    from llmrun.runners.history import Change

    quiet = {
        "test": "pp8",
        "avg_ts": 100.0,
        "stddev_ts": 1.0,
        "n_threads": 2,
        "background_cpus": 0.0,
    }
    busy = {**quiet, "avg_ts": 24.0, "background_cpus": 1.5}
    assert Change("pp8", busy, quiet, 1).verdict == "noise (busy machine)"
    assert Change("pp8", {**quiet, "avg_ts": 24.0}, quiet, 1).verdict == "regression"


# ---- 4. no secret leaks ------------------------------------------------------------------


def test_a_url_password_is_never_written(tmp_path: Path, llmrun_env: dict[str, str]) -> None:
    secret = "s3cret-PW"
    with stub_server(basic=f"alice:{secret}") as url:
        endpoint = url.replace("http://", f"http://alice:{secret}@")
        stats_file = tmp_path / "stats.jsonl"
        outputs = [
            llmrun(
                [
                    "run",
                    "hi",
                    "--endpoint",
                    endpoint,
                    "--stats",
                    "json",
                    "--stats-file",
                    str(stats_file),
                ],
                llmrun_env,
            ),
            llmrun(["run", "hi", "--endpoint", endpoint, "--json"], llmrun_env),
            llmrun(["run", "hi", "--endpoint", endpoint, "--no-dashboard"], llmrun_env),
            llmrun(
                ["chat", "--endpoint", endpoint],
                llmrun_env,
                stdin=f"hi\n/save {tmp_path / 't.md'}\n/save {tmp_path / 't.json'}\n".encode(),
            ),
            llmrun(
                ["bench", "serve", "--endpoint", endpoint, "--num-prompts", "2", "-o", "json"],
                llmrun_env,
            ),
            llmrun(
                [
                    "bench",
                    "interference",
                    "--endpoint",
                    endpoint,
                    "--input-len",
                    "8",
                    "--output-len",
                    "4",
                ],
                llmrun_env,
            ),
        ]
        wrong = llmrun(
            ["run", "hi", "--endpoint", url.replace("http://", "http://alice:nope@")], llmrun_env
        )
    closed = f"http://alice:{secret}@127.0.0.1:{free_port()}"
    outputs.append(llmrun(["run", "hi", "--endpoint", closed], llmrun_env))
    assert outputs[0].returncode == 0 and b"Hello from" in outputs[2].stdout, outputs[0].stderr
    assert wrong.returncode == 1 and b"401" in wrong.stderr
    for result in [*outputs, wrong]:
        assert secret.encode() not in result.stdout + result.stderr
    home = Path(llmrun_env["LLMRUN_HOME"])
    for path in [stats_file, tmp_path / "t.md", tmp_path / "t.json", *home.rglob("*")]:
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path
    assert b"***@" in outputs[-1].stderr


def test_api_key_wins_over_url_credentials(cli: CliRunner) -> None:
    with stub_server(api_key="the-key") as url:
        endpoint = url.replace("http://", "http://alice:pw@")
        result = cli.invoke(app, ["run", "hi", "--endpoint", endpoint, "--api-key", "the-key"])
    assert result.exit_code == 0, result.stderr


# ---- 5. every error is the one-line kind -------------------------------------------------


def _gguf(tmp: Path, kvs: bytes, n_kv: int) -> str:
    path = tmp / "crafted.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, n_kv) + kvs + b"\0" * 64)
    return str(path)


def _key(name: str) -> bytes:
    return struct.pack("<Q", len(name)) + name.encode()


def test_crafted_headers_are_one_line_errors(tmp_path: Path, llmrun_env: dict[str, str]) -> None:
    string_alignment = _gguf(
        tmp_path, _key("general.alignment") + struct.pack("<I", 8) + _key("thirty-two"), 1
    )
    nested = _key("deep") + struct.pack("<I", 9) + (struct.pack("<IQ", 9, 1)) * 2000
    deep = str(tmp_path / "deep.gguf")
    Path(deep).write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + nested + b"\0" * 64)
    for path, needle in ((string_alignment, "general.alignment"), (deep, "nested too deep")):
        assert needle in one_error(llmrun(["run", "-m", path, "hi"], llmrun_env))


def test_llama_cpp_gives_its_own_reason(
    model_path: str, tmp_path: Path, llmrun_env: dict[str, str]
) -> None:
    bad = patched_model(
        model_path,
        tmp_path,
        [(b"\x04\x00\x00\x00\x00\x00\x00\x00gpt2", b"\x04\x00\x00\x00\x00\x00\x00\x00gpt3")],
    )
    line = one_error(llmrun(["run", "-m", bad, "hi"], llmrun_env))
    assert "unknown tokenizer: 'gpt3'" in line, line


@pytest.mark.parametrize(
    ("args", "says", "code"),
    [
        (["run", "-m", "", "hi"], "-m/--model: an empty name names no model", 2),
        (["bench", "-m", "a,,b"], "-m/--model: an empty name names no model", 2),
        (["serve", "-m", " "], "-m/--model: an empty name names no model", 2),
        (["pull", ""], "pull: '' is no Hub reference; give owner/repo", 2),
        (["pull", "/etc/passwd"], "pull: '/etc/passwd' is no Hub reference", 2),
        (["run", "-m", "/tmp", "hi"], "/tmp: is a directory, not a GGUF file (give the .gguf", 1),
        (
            ["run", "-m", "/dev/zero", "hi"],
            "/dev/zero: is a device, a FIFO or a socket, not a GGUF file (llama.cpp maps",
            1,
        ),
        (["bench", "-m", "/dev/null"], "/dev/null: is a device, a FIFO or a socket", 1),
    ],
)
def test_a_model_that_names_none_is_refused(
    args: list[str], says: str, code: int, cli: CliRunner
) -> None:
    """`-m ''` ran the embedded model while every empty path was refused; `pull ''` printed
    the embedded model's path and `pull /etc/passwd` echoed it, both exit 0; a folder given as
    the model was told to download the file again, and /dev/zero that it was too short."""
    result = cli.invoke(app, args)
    assert result.exit_code == code, result.stderr
    [line] = result.stderr.splitlines()
    assert line.startswith("llmrun: error: ") and says in line, line


@pytest.mark.parametrize(
    "args", [["history"], ["bench", "-r", "1", "-p", "8", "-n", "0"], ["doctor"]], ids=" ".join
)
def test_a_home_that_is_a_file_is_refused_before_the_work(
    args: list[str], cli: CliRunner, tmp_path: Path
) -> None:
    """LLMRUN_HOME naming a file: bench ran whole and then said it could not store the run,
    and history showed `[Errno 20] Not a directory: '…/data'`. A setting no command can use
    is refused before the work (a history that is damaged, locked or read-only still only
    costs the run its place in it: test_bench_results_reach_stdout_whatever_the_history)."""
    home = tmp_path / "afile"
    home.write_text("x")
    result = cli.invoke(app, args, env={"LLMRUN_HOME": str(home)})
    assert result.exit_code == 1, result.stderr
    assert result.stderr.splitlines() == [
        f"llmrun: error: LLMRUN_HOME={str(home)!r} is a file: it names the folder that holds"
        " llmrun's files"
    ]
    done = cli.invoke(app, ["history", "--export-sql", ""], env={"LLMRUN_HOME": str(tmp_path)})
    assert done.exit_code == 2 and "--export-sql: give a new file's name" in done.stderr
    done = cli.invoke(
        app, ["history", "--export-sql", str(tmp_path)], env={"LLMRUN_HOME": str(tmp_path)}
    )
    assert done.exit_code == 1 and "a folder; give a new file's name" in done.stderr


def test_a_blank_home_and_a_spaced_host_are_refused(cli: CliRunner) -> None:
    """LLMRUN_HOME=' ' made a folder named ' ' in the working directory, and `serve --host
    ' 127.0.0.1'` was `cannot listen on 127.0.0.1:0: Name or service not known`."""
    from llmrun.cli.serve import listen_host

    blank = cli.invoke(app, ["history"], env={"LLMRUN_HOME": " "})
    assert blank.exit_code == 1
    assert blank.stderr == "llmrun: error: LLMRUN_HOME=' ' is blank: give a folder, or unset it\n"
    spaced = cli.invoke(app, ["serve", "--host", " 127.0.0.1", "--port", "0"])
    assert spaced.exit_code == 2
    assert spaced.stderr.startswith(
        "llmrun: error: --host ' 127.0.0.1': give an address or a name, without spaces"
    )
    # an IPv6 address as URLs write it, and as the server prints its own
    assert listen_host("[::1]") == listen_host("::1") == "::1"
    for bracketed in ("[]", "[ ]", "[ ::1]"):  # were the resolver's "Name or service not known"
        empty = cli.invoke(app, ["serve", "--host", bracketed, "--port", "0"])
        assert empty.exit_code == 2, empty.output
        assert f"--host {bracketed!r}: give an address or a name, without spaces" in empty.stderr


def test_a_refused_context_blames_the_setting_not_the_file(
    model_path: str, llmrun_env: dict[str, str]
) -> None:
    """-ctv q4_0 -fa off loads the weights, and llama.cpp refuses the context: that said `the
    file may be for a newer llama.cpp, or damaged`."""
    line = one_error(llmrun(["run", "-ctv", "q4_0", "-fa", "off", "-n", "1", "hi"], llmrun_env))
    assert line.startswith("llmrun: error: llama.cpp could not create a context on "), line
    assert line.endswith(": quantized V cache requires flash_attn to be enabled"), line


def test_a_broken_chat_template_is_one_line(
    model_path: str, tmp_path: Path, llmrun_env: dict[str, str]
) -> None:
    bad = patched_model(
        model_path, tmp_path, [(b"{% for message in messages %}", b"{{ for message in messages %}")]
    )
    for args, stdin in ((["run", "-m", bad, "hi"], b""), (["chat", "-m", bad], b"hi\n")):
        line = one_error(llmrun(args, llmrun_env, stdin=stdin))
        assert "llmrun: error: the model's chat template fails: " in line and "--raw" in line
    raw = llmrun(["run", "-m", bad, "--raw", "-n", "2", "hi"], llmrun_env)
    assert raw.returncode == 0
    # a template given by file is named as such: the model's own is not to blame
    given = tmp_path / "bad.jinja"
    given.write_text("{% for m in messages %}{{ m.content }")
    line = one_error(llmrun(["run", "--chat-template-file", str(given), "hi"], llmrun_env))
    assert line.startswith("llmrun: error: --chat-template-file's template fails: Template"), line
    # and a prompt past what any template may write is named as the prompt's size
    line = one_error(llmrun(["run", "-n", "1"], llmrun_env, stdin=b"a" * (64 * 2**20 + 1)))
    assert line.startswith("llmrun: error: the messages hold 67,108,865 characters: "), line


@pytest.mark.parametrize(
    ("args", "code"),
    [
        # a value --endpoint cannot read is a usage error, as --rpc's and --timeout's are
        (["--endpoint", "http://[::1"], 2),
        (["--endpoint", "http://h:1 x"], 2),
        (["--endpoint", "ftp://host"], 2),
        (["--endpoint", "nan"], 2),
        (["--endpoint", "http://127.0.0.1:1", "--timeout", "inf"], 2),
        (["--endpoint", "http://127.0.0.1:1", "--timeout", "nan"], 2),
    ],
)
def test_odd_endpoints_and_timeouts(args: list[str], code: int, cli: CliRunner) -> None:
    result = cli.invoke(app, ["run", "hi", *args])
    assert result.exit_code == code, result.stderr
    assert "internal error" not in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["serve", "--max-connections", "²"],
        ["serve", "--policy", "chunked:²"],
        ["bench", "serve", "--policy", "decode-first:٣²"],
        ["run", "--rpc", "h:²", "hi"],
        ["bench", "--rpc", "h:²"],
        ["run", "--draft", "lookup:²", "--temp", "0", "hi"],
        ["serve", "--max-connections", "²" + "9" * 5000],
        ["bench", "-p", "²" + "9" * 5000],
        ["bench", "-p", "8-64*\u0662"],
        ["bench", "--until-ci", "\u0665"],
        ["bench", "serve", "--request-rate", "\u0663"],
        ["bench", "serve", "--percentiles", "\u0665\u0660"],
        ["bench", "serve", "--slo", "ttft:\u0665\u0660\u0660"],
        ["tune", "--budget", "\u0663s"],
    ],
    ids=" ".join,
)
def test_digits_that_are_not_ascii_are_refused_in_one_line(args: list[str], cli: CliRunner) -> None:
    """`²` passes str.isdigit() and then fails int(): a traceback where a number was checked;
    `٣` (Arabic-Indic) was read as 3 by int() and float() in some options and refused in
    others. Numbers are ASCII digits everywhere, as on llama.cpp's command lines."""
    result = cli.invoke(app, args)
    assert result.exit_code == 2, result.stderr
    assert "internal error" not in result.stderr and "Traceback" not in result.stderr
    [line] = result.stderr.splitlines()
    assert any(not c.isascii() for c in line), line  # it names the value


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["run", "-n", "2.5", "hi"], "'2.5' is not a whole number. ('llmrun run -h' lists the"),
        (["run", "--bogus"], "No such option: --bogus ('llmrun run -h' lists the options)"),
        (["bogus"], "No such command 'bogus'. ('llmrun -h' lists the commands)"),
        (["bench", "serve", "--num-prompts", "0"], "0 is not in the range 1<=x<=100000."),
        (["run", "-n", "\x1b[31m9", "hi"], "'\\x1b[31m9' is not a whole number."),
        (["run", "-f", "", "hi"], "'-f' / '--file': an empty path names no file"),
        (["bench", "serve", "-m"], "requires an argument. ('llmrun bench serve -h' lists the"),
    ],
)
def test_a_usage_error_is_one_line_and_exit_2(args: list[str], says: str, cli: CliRunner) -> None:
    """Not typer's box of usage, hint and message; an escape sequence in a value is not sent to
    the terminal."""
    result = cli.invoke(app, args)
    assert result.exit_code == 2, result.stderr
    [line] = result.stderr.splitlines()
    assert line.startswith("llmrun: error: ") and says in line, line
    assert "\x1b" not in line


@pytest.mark.parametrize(
    ("args", "env", "names_env"),
    [
        (["run", "-c", "-5", "hi"], {}, False),
        (["run", "hi"], {"LLMRUN_CTX": "-5"}, True),
        (["run", "--ctx-size", "abc", "hi"], {"LLMRUN_CTX": "512"}, False),
        (["run", "hi"], {"LLMRUN_CTX": "abc"}, True),
    ],
)
def test_a_bad_value_names_the_environment_variable_only_when_it_came_from_there(
    args: list[str], env: dict[str, str], names_env: bool, cli: CliRunner
) -> None:
    """typer's hint named LLMRUN_CTX beside a typed `-c -5`, as if the environment were wrong."""
    result = cli.invoke(app, args, env=env)
    assert result.exit_code == 2, result.stderr
    [line] = result.stderr.splitlines()
    assert line.startswith("llmrun: error: Invalid value for '-c' / '--ctx' / '--ctx-size'"), line
    assert ("(env var: 'LLMRUN_CTX')" in line) == names_env, line


def test_whole_numbers_are_ascii_digits() -> None:
    from llmrun.runners.lists import integer, real, share, whole
    from llmrun.runners.rpc import parse_endpoints
    from llmrun.runners.serving.api_access import loopback_host

    assert [whole(t) for t in ("0", "42", "²", "٣", "", "-1", "1_0", " 1", "+1")] == [
        0,
        42,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
    ]
    assert [share(t) for t in ("3", "0.5", "1.", "²", "1.²", "..1", "", "1e3")] == [
        3.0,
        0.5,
        1.0,
        None,
        None,
        None,
        None,
        None,
    ]
    long = "9" * 5000  # int() refuses more than 4,300 digits with a ValueError
    assert whole(long) is None and integer(long) is None and real(long) is None
    assert not loopback_host("localhost:²") and not loopback_host("[::1]:²")
    assert not loopback_host(f"localhost:{long}")
    assert loopback_host("localhost:8080") and loopback_host("[::1]:80")
    with pytest.raises(LlmrunError, match="port must be a number"):
        parse_endpoints("host:²")


@pytest.mark.parametrize("value", ["²", "0", "99999999999", "x", "9" * 5000])
def test_a_terminal_size_from_the_environment_that_is_none_is_dropped(
    value: str, llmrun_env: dict[str, str]
) -> None:
    """rich read COLUMNS=² with int() (a traceback) and laid out 99,999,999,999 columns until
    memory ran out; GNU ls warns and uses the terminal's size."""
    for name in ("COLUMNS", "LINES"):
        done = subprocess.run(
            [which_llmrun(), "models"],
            env={**llmrun_env, name: value},
            capture_output=True,
            text=True,
            timeout=HANG_S,
        )
        assert done.returncode == 0, done.stderr
        assert done.stderr.splitlines() == [
            f"llmrun: warning: {name}={value!r} is not a size from 1 to 65535; the terminal's own"
            " is used"
        ]
        assert "SmolLM2" in done.stdout


def test_a_full_disk_on_stdout_is_one_line(llmrun_env: dict[str, str]) -> None:
    for args in (
        ["run", "--raw", "-n", "3", "hi"],
        ["run", "--json", "-n", "3", "hi"],
        ["bench", "-p", "8", "-n", "0", "-r", "1", "-o", "json"],
    ):
        result = llmrun(args, llmrun_env, shell_suffix="> /dev/full")
        assert result.returncode == 1, result.stderr
        last = error_lines(result.stderr)[-1]
        assert last == "llmrun: error: No space left on device (writing the output)"


HELP_AND_VERSION = [["--version"], ["-h"], ["run", "-h"], ["bench", "serve", "-h"], []]


@pytest.mark.parametrize("args", HELP_AND_VERSION, ids=lambda a: " ".join(a) or "(none)")
def test_help_and_version_on_a_full_disk_are_one_line(
    args: list[str], llmrun_env: dict[str, str]
) -> None:
    """`llmrun --version > /dev/full` (and -h, bare llmrun) ended in a 45-72-line traceback."""
    result = llmrun(args, llmrun_env, shell_suffix="> /dev/full")
    line = one_error(result)
    assert line == "llmrun: error: No space left on device (writing the output)"


@pytest.mark.parametrize("args", HELP_AND_VERSION, ids=lambda a: " ".join(a) or "(none)")
def test_help_and_version_into_a_closed_pipe_end_as_commands_do(
    args: list[str], llmrun_env: dict[str, str]
) -> None:
    """`llmrun run -h | head -c1` exited 1 in silence (rich's and click's answer to a broken
    pipe) where `run` itself ends with 141; the pipe's reader is gone before the first write."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run(
            [which_llmrun(), *args],
            env=llmrun_env,
            stdin=subprocess.DEVNULL,
            stdout=write_end,
            stderr=subprocess.PIPE,
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert result.returncode == 141, result.stderr
    assert result.stderr == b""


@pytest.mark.parametrize("locale", ["C", "C.UTF-8", "en_US.UTF-8"])
def test_invalid_utf8_on_stdin_is_replaced_with_a_warning(
    locale: str, llmrun_env: dict[str, str]
) -> None:
    env = {**llmrun_env, "LANG": locale, "LC_ALL": locale}
    for args in (["run", "--raw", "-n", "3", "--temp", "0", "-q"], ["chat", "-n", "3"]):
        result = llmrun(args, env, stdin=b"Gr\xff\xfe \xc3 hi\n")
        assert result.returncode == 0, result.stderr
        lines = error_lines(result.stderr)
        warnings = [ln for ln in lines if "not valid UTF-8" in ln]
        assert len(warnings) == 1 and "U+FFFD" in warnings[0], lines


def test_with_stderr_closed_nothing_lands_on_stdout(llmrun_env: dict[str, str]) -> None:
    for args in (
        ["run", "-m", "/no/such/model.gguf", "hi"],
        ["run", "-t", "100000", "hi"],
        ["run", "--raw", "-n", "3", "--temp", "0", "hi"],
    ):
        result = llmrun(args, llmrun_env, shell_suffix="2>&-")
        assert b"llmrun:" not in result.stdout and b"prompt" not in result.stdout, result.stdout


@pytest.mark.parametrize(
    "args",
    [["--version"], ["--help"], ["models"], ["run", "--raw", "-n", "3", "--temp", "0", "-q", "hi"]],
    ids=" ".join,
)
def test_with_stdout_closed_the_result_is_not_lost_in_silence(
    args: list[str], llmrun_env: dict[str, str]
) -> None:
    """`llmrun run … >&-` exited 0 with its answer written to /dev/null."""
    line = one_error(llmrun(args, llmrun_env, shell_suffix=">&-"))
    assert "stdout is closed (>&-): the output has nowhere to go" in line, line


def test_a_hub_reference_without_network_fails_fast(llmrun_env: dict[str, str]) -> None:
    env = {**llmrun_env, "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"}
    env.pop("HF_HUB_OFFLINE")
    started = time.monotonic()
    one_error(llmrun(["run", "-m", "/nowhere/model.gguf", "hi"], env))
    local_s = time.monotonic() - started  # what failing takes here without any network
    for ref in ("owner/repo:Q4_K_M", "owner/repo/file.Q4_K_M.gguf"):
        started = time.monotonic()
        line = one_error(llmrun(["run", "-m", ref, "hi"], env))
        # A retry with back-off or a network timeout (10 s in huggingface_hub) would add ten
        # seconds or more; measured against the local failure, so a busy machine slows both.
        assert time.monotonic() - started < local_s + 10
        assert "Hugging Face Hub" in line or "cannot be reached" in line, line
