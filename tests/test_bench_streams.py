"""bench's records stream as each test finishes, as llama-bench's printers do, in every format,
on stdout (-o) and on stderr (-oe), and each stream holds its records alone."""

from __future__ import annotations

import csv
import io
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO

import pytest
from rich.console import Console
from typer.testing import CliRunner

from llmrun.cli import engine
from llmrun.cli.app import app
from llmrun.cli.bench import sweep
from llmrun.cli.bench.output import OutputFormat
from llmrun.cli.errors import EXIT_INTERRUPTED
from llmrun.runners.bench import run
from llmrun.runners.bench.run import RECORD_OPTIONAL_FIELDS
from llmrun.runners.bench.sweep import Shape

from .conftest import HANG_S, bench_pp8, which_llmrun
from .fake import FakeBenchRunner
from .fake_bench import fake_bench_argv
from .test_bench import parse
from .test_trust_bench import _fake_models

REPO = Path(__file__).resolve().parent.parent
FORMATS = ["md", "csv", "json", "jsonl", "sql"]
TEXT = "The quick brown fox jumps over the lazy dog, again and again. " * 100

# Every kind of row: pp, tg, pg, depth, speculative drafting, perplexity, two models
KINDS = ["-p", "8", "-n", "2", "-pg", "8,2", "-d", "0,4", "--draft", "0,2", "-m", "a", "-m", "b"]


@pytest.fixture
def text(tmp_path: Path) -> Path:
    path = tmp_path / "text.txt"
    path.write_text(TEXT)
    return path


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kinds", ["tests", "scenarios"])
def test_every_format_carries_every_kind_of_row_and_figure(
    fmt: str, kinds: str, text: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """-o FMT and -oe jsonl in one run: the same rows, every figure of every record in FMT (csv's
    header names each; sql's go into a fresh database, the rest as llmrun's figures)."""
    monkeypatch.setenv("LLMRUN_HOME", str(tmp_path))
    _fake_models(monkeypatch)
    which = [*KINDS, "--ppl", str(text)] if kinds == "tests" else ["--scenarios"]
    done = CliRunner().invoke(
        app, ["bench", "-r", "1", "--no-history", *which, "-o", fmt, "-oe", "jsonl"]
    )
    assert done.exit_code == 0, done.stderr
    every = [json.loads(line) for line in done.stderr.splitlines()]  # -oe: its records alone
    rows = parse(fmt, done.stdout)
    assert [str(r["test"]) for r in rows] == [r["test"] for r in every]
    if kinds == "tests":
        assert len(every) == 2 * 2 * 2 * 3  # models x drafts x depths x (pp, tg, pg)
        assert {"pp_ts", "draft", "ppl", "relative_ts"} <= set().union(*every)
    else:
        assert all(r["localscore"] for r in every)  # the run's score, in each row
    if fmt == "md":
        assert "ppl" in done.stdout.splitlines()[0] or kinds == "scenarios"
        return
    for found, record in zip(rows, every, strict=True):
        assert set(record) <= set(found), set(record) - set(found)
        for key, value in record.items():
            if value is not None and not isinstance(value, (list, bool)):
                assert str(found[key]) == str(value), key
    if fmt == "csv":
        head = next(csv.reader(io.StringIO(done.stdout)))
        assert set(RECORD_OPTIONAL_FIELDS) <= set(head)  # whichever row comes first


def _run_bench(args: list[str], env: dict[str, str], **kwargs: object) -> subprocess.Popen[str]:
    """llmrun with fake models, as a process (tests/fake_bench.py: "block" waits for a signal)."""
    return subprocess.Popen(
        [sys.executable, "-m", "tests.fake_bench", "bench", "-r", "1", *args],
        cwd=REPO,
        env=env,
        text=True,
        **kwargs,
    )  # type: ignore[call-overload]


def _rows_so_far(fmt: str, text: str) -> int:
    """How many whole records this much of FMT holds (a header alone holds none). json's last
    object ends without a newline until the next comes, as llama-bench's."""
    if fmt == "json":
        return text.count("\n  }")
    lines = text.splitlines(keepends=True)
    whole = [line for line in lines if line.endswith("\n")]
    if fmt == "csv":
        return max(len(whole) - 1, 0)
    if fmt == "sql":
        return sum(line.startswith("INSERT OR REPLACE") for line in whole)
    if fmt == "md":
        return max(sum(line.startswith("|") for line in whole) - 2, 0)
    return len(whole)


def _read_rows(fmt: str, stream: IO[str], n: int) -> str:
    """Read the stream as it comes until it holds n records."""
    text = b""
    while _rows_so_far(fmt, text.decode()) < n:
        chunk = os.read(stream.fileno(), 65536)
        assert chunk, f"the stream ended after {text!r}"
        text += chunk
    return text.decode()


PP8 = ["-p", "8", "-n", "0"]
STREAMS = [("-o", fmt, 1, PP8) for fmt in FORMATS] + [
    ("-o", "jsonl", 4, ["-p", "0", "-n", "2", "--draft", "0,2", "-d", "0,4"]),
    ("-o", "csv", 3, ["-p", "8", "-n", "2", "-pg", "8,2"]),
    ("-o", "jsonl", 1, [*PP8, "--ppl", "TEXT"]),  # after its perplexity, before block's test
    ("-oe", "csv", 1, PP8),
    ("-oe", "json", 1, PP8),
    ("-oe", "sql", 1, PP8),
]


@pytest.mark.parametrize(("option", "fmt", "n", "more"), STREAMS)
def test_rows_stream_before_the_run_ends_and_an_interrupted_stream_stays_whole(
    option: str, fmt: str, n: int, more: list[str], llmrun_env: dict[str, str], text: Path
) -> None:
    """-m a -m block: a's rows are printed while the process still runs (block's test waits for
    the signal), then SIGTERM: 143, and what was printed parses whole (json's array closed)."""
    shape = [str(text) if m == "TEXT" else m for m in more]
    args = [*shape, "-m", "a", "-m", "block", option, fmt]
    if option == "-oe":
        args += ["-o", "none"]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    proc = _run_bench(args, llmrun_env, **pipes)
    stream = proc.stdout if option == "-o" else proc.stderr
    assert stream is not None
    watchdog = threading.Timer(HANG_S, proc.kill)  # a stream that never comes fails the test
    watchdog.start()
    try:
        seen = _read_rows(fmt, stream, n)
        assert proc.poll() is None  # "block" waits for the signal: the run is not over
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=HANG_S)
    finally:
        watchdog.cancel()
        proc.kill()
    assert proc.returncode == 143, err
    full = seen + (out if option == "-o" else err)
    rows = parse(fmt, full)
    assert len(rows) == n  # a's; block's test never finished
    if fmt == "json":
        assert full.rstrip().endswith("]")
    if fmt == "md":
        assert full.rstrip().splitlines()[-1].startswith("build: ")


def test_a_failing_model_after_good_rows_prints_them_then_one_line(
    llmrun_env: dict[str, str],
) -> None:
    """-m good -m /nonexistent.gguf: good's rows, then one error line, exit 1; stored."""
    done = subprocess.run(
        fake_bench_argv("-m", "good", "-m", "/nonexistent.gguf", "-o", "json"),
        cwd=REPO,
        env=llmrun_env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert done.returncode == 1
    assert [r["test"] for r in json.loads(done.stdout)] == ["pp8", "tg2"]
    assert done.stderr.strip().splitlines()[-1].startswith("llmrun: error: model file not found")
    stored = subprocess.run(
        [which_llmrun(), "history"], env=llmrun_env, capture_output=True, text=True, timeout=HANG_S
    )
    assert "pp8" in stored.stdout and "tg2" in stored.stdout


@pytest.mark.parametrize("fmt", ["csv", "json", "jsonl", "sql"])
def test_output_err_is_a_clean_record_stream(
    fmt: str, llmrun_env: dict[str, str], tmp_path: Path
) -> None:
    """-oe FMT 2>file: the file holds FMT's records alone (no report, warning, progress or
    chart), while stdout has its own (md where it is no terminal)."""
    path = tmp_path / f"x.{fmt}"
    with path.open("w") as file:
        done = subprocess.run(
            fake_bench_argv(
                "-pg", "8,2", "-t", "1,2", "-m", "a", "-m", "b", "--progress", "-oe", fmt
            ),
            cwd=REPO,
            env=llmrun_env,
            stdout=subprocess.PIPE,
            stderr=file,
            text=True,
            timeout=HANG_S,
        )
    assert done.returncode == 0
    text = path.read_text()
    if fmt == "csv":
        table = list(csv.reader(io.StringIO(text)))
        assert len(table) == 1 + 12 and all(len(row) == len(table[0]) for row in table)
    elif fmt == "sql":
        db = sqlite3.connect(":memory:")
        db.executescript(text)
        assert db.execute("SELECT count(*) FROM llama_bench").fetchone() == (12,)
    else:
        assert len(parse(fmt, text)) == 12
    assert len(parse("md", done.stdout)) == 12


def test_output_err_csv_of_the_real_engine_is_a_csv_file(
    llmrun_env: dict[str, str], model_path: str, tmp_path: Path
) -> None:
    """llama.cpp's own output and llmrun's display stay out of -oe's stream."""
    path = tmp_path / "x.csv"
    with path.open("w") as file:
        done = subprocess.run(
            bench_pp8(model_path, "--no-warmup", "-oe", "csv"),
            env=llmrun_env,
            stdout=subprocess.PIPE,
            stderr=file,
            text=True,
            timeout=HANG_S,
        )
    assert done.returncode == 0
    (row,) = csv.DictReader(io.StringIO(path.read_text()))
    assert row["test"] == "pp8" and json.loads(done.stdout)[0]["avg_ts"] == float(row["avg_ts"])


def test_a_closed_pipe_loses_no_row(llmrun_env: dict[str, str], tmp_path: Path) -> None:
    """`| head -1` after the first row: every test still runs and is stored, then 141 (as `run`);
    the output is more than a pipe holds, so a write after the close must fail."""
    proc = _run_bench(
        ["-p", "8", "-n", "0", "-d", "0-200+1", "-m", "a", "-o", "jsonl"],
        llmrun_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None
    try:
        json.loads(proc.stdout.readline())
        proc.stdout.close()
        _, err = proc.communicate(timeout=HANG_S)
    finally:
        proc.kill()
    assert proc.returncode == 141, err
    db = sqlite3.connect(Path(llmrun_env["LLMRUN_HOME"]) / "data" / "history.sqlite")
    assert db.execute("SELECT count(*) FROM results").fetchone() == (201,)


def _cut(
    fmt: str, *, opening: bool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> tuple[int, str, str]:
    """A run cancelled before its first model is ready (Ctrl-C while a model downloads), or
    while the model is opened (ready, then no test runs): exit code, stdout and -oe's stream."""
    cancel = threading.Event()
    if not opening:
        cancel.set()

    def make(model: str | None, config: object, tuned: bool) -> FakeBenchRunner:
        cancel.set()
        return FakeBenchRunner()

    monkeypatch.setattr(engine, "BENCH_RUNNER_FACTORY", make)
    errors = io.StringIO()
    to = sweep.Output(
        format=OutputFormat(fmt),
        plot=None,
        compare=False,
        store=False,
        format_err=OutputFormat(fmt),
        errors=errors,
    )
    shown = Console(file=io.StringIO())
    plan = run.Sweep(
        shapes=[Shape(8, 0)],
        threads=None,
        batch=None,
        ubatch=None,
        gpu_layers=None,
        flash_attn=None,
        cache_type_k="f16",
        cache_type_v="f16",
        reps=1,
        ctx=None,
        seed=1,
        scenarios=False,
    )
    code = sweep._sweep([None], plan, cancel, shown, shown, to)
    return code, capsys.readouterr().out, errors.getvalue()


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_run_cut_before_its_first_model_is_ready_ends_its_format(
    fmt: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Cut before any model is ready, each format ends as a run cut with no row does (json's
    `[]`, the others' nothing), on stdout and on -oe's stream alike; 130."""
    before = _cut(fmt, opening=False, monkeypatch=monkeypatch, capsys=capsys)
    after = _cut(fmt, opening=True, monkeypatch=monkeypatch, capsys=capsys)
    assert before == after
    code, stdout, stderr = before
    assert code == EXIT_INTERRUPTED and stdout == stderr
    assert stdout == ("[]\n" if fmt == "json" else "")
