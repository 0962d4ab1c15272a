"""Trust, round two (issue 22), for what is written and read: whole files or none, whole lines,
every input read by its specification (JSON RFC 8259 and JSON Lines, UTF-8), signals.

A full disk is made with RLIMIT_FSIZE in a child process (writes past the limit fail with EFBIG,
as they fail with ENOSPC on a full file system); the child runs the CLI on the fake runner.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
from typer.testing import CliRunner

from llmrun.cli.app import app
from llmrun.runners.base import Request, SamplingParams
from llmrun.runners.errors import CancelledError
from llmrun.runners.files import FileTooLargeError, append_line, atomic_write, read_capped
from llmrun.runners.history import History

from .conftest import HANG_S, ROOT, python_child
from .fake import FakeBenchRunner, FakeRunner

T = TypeVar("T")

# The child writes no bytecode: importlib writes a .pyc with one raw write, which the file limit
# cuts short without an error, and the cut .pyc then broke every later test that imported that
# module ("marshal data too short") where this child was the first to compile it.
CHILD = textwrap.dedent("""
    import resource, signal, sys
    sys.dont_write_bytecode = True
    from llmrun.cli import engine
    from tests.fake import FakeRunner
    engine.RUNNER_FACTORY = lambda model, config: FakeRunner()
    limit = int(sys.argv[1])
    if limit:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    from llmrun.cli.main import main
    sys.argv = ["llmrun", *sys.argv[2:]]
    main()
""")


def fake_llmrun(
    args: list[str], *, file_limit: int = 0, stdin: bytes = b"", env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[bytes]:
    """The CLI on the fake runner in its own process, writes capped at `file_limit` bytes."""
    return subprocess.run(
        [sys.executable, "-c", CHILD, str(file_limit), *args],
        cwd=ROOT,
        input=stdin,
        capture_output=True,
        timeout=HANG_S,
        env=env or dict(os.environ),
    )


def test_save_on_a_full_disk_keeps_the_old_transcript(
    tmp_path: Path, llmrun_env: dict[str, str]
) -> None:
    transcript = tmp_path / "t.json"
    old = json.dumps({"turns": ["an earlier, complete transcript"]}) + "\n"
    transcript.write_text(old)
    script = f"{'many words in a long question ' * 20}\n/save {transcript}\n".encode()
    result = fake_llmrun(["chat"], file_limit=len(old) + 10, stdin=script)
    assert transcript.read_text() == old  # whole, and still the old one
    assert b"cannot write" in result.stderr, result.stderr
    assert not [p for p in tmp_path.iterdir() if p.name != "t.json"]  # no temporary left over
    ok = fake_llmrun(["chat"], stdin=script)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(transcript.read_text())["turns"]


def test_a_stats_file_on_a_full_disk_keeps_whole_lines(
    tmp_path: Path, llmrun_env: dict[str, str]
) -> None:
    stats = tmp_path / "stats.jsonl"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(6)))
    one = fake_llmrun(["run", "-q", "--jsonl", str(prompts), "--stats-file", str(stats)])
    assert one.returncode == 0, one.stderr
    line = len(stats.read_bytes()) // 6
    stats.unlink()
    result = fake_llmrun(
        ["run", "-q", "--jsonl", str(prompts), "--stats-file", str(stats)],
        file_limit=int(line * 2.5),
    )
    assert result.returncode == 1
    assert b"cannot write the stats file" in result.stderr
    text = stats.read_text()
    assert text.endswith("\n") and len(text.splitlines()) == 2
    assert all(json.loads(x)["id"] for x in text.splitlines())


def test_atomic_write_and_append_line_leave_nothing_half_done(tmp_path: Path) -> None:
    path = tmp_path / "f.json"
    atomic_write(path, "one\n")
    os.chmod(path, 0o600)
    atomic_write(path, "two\n")
    assert path.read_text() == "two\n" and (path.stat().st_mode & 0o777) == 0o600
    append_line(tmp_path / "l.jsonl", "a")
    append_line(tmp_path / "l.jsonl", "b\n")
    assert (tmp_path / "l.jsonl").read_text() == "a\nb\n"
    with pytest.raises(FileTooLargeError):
        read_capped("/dev/zero", max_bytes=1000)
    with pytest.raises(IsADirectoryError):
        read_capped(tmp_path, max_bytes=1000)


FIFO_WAIT_S = 10.0  # what a write that does not wait takes, many times over


def _within(fifo: Path, work: Callable[[], T]) -> T:
    """`work()`'s result, or a failure if it is still waiting after FIFO_WAIT_S; a reader then
    opens `fifo`, so a writer stuck in its open is let go."""
    done: list[T] = []
    thread = threading.Thread(target=lambda: done.append(work()), daemon=True)
    thread.start()
    thread.join(FIFO_WAIT_S)
    if thread.is_alive():
        reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        thread.join(FIFO_WAIT_S)
        os.close(reader)
        pytest.fail(f"waited for a reader of {fifo}")
    return done[0]


def test_no_write_waits_for_a_fifos_reader(tmp_path: Path) -> None:
    """append_line (--stats-file) and atomic_write (/save) opened a FIFO with no reader and
    waited there for ever, deaf to the first SIGTERM."""
    fifo = tmp_path / "f"
    os.mkfifo(fifo)

    def refused(write: Callable[[Path, str], None]) -> bool:
        try:
            write(fifo, "a")
        except OSError:
            return True
        return False

    assert _within(fifo, lambda: refused(append_line))
    assert _within(fifo, lambda: refused(atomic_write))


def test_one_reader_reads_fifos_and_pipes_without_blocking_and_stops_on_cancel(
    tmp_path: Path,
) -> None:
    """files.read_capped (a blocking open), files.read_regular (regular files only) and
    perplexity.read_text (FIFOs polled, a cancel) were three readers of the same bytes; one
    reader has their switches now, and a named FIFO, a pipe whose writer is gone, a cancel
    and a regular-files-only read each behave as the one they came from did."""
    fifo = tmp_path / "f"
    os.mkfifo(fifo)
    cancel = threading.Event()

    def cancelled() -> bool:
        threading.Timer(0.3, cancel.set).start()
        try:
            read_capped(fifo, max_bytes=10, cancel=cancel)
        except CancelledError:
            return True
        return False

    assert _within(fifo, cancelled)  # no writer ever: the wait ends on the cancel
    threading.Thread(target=lambda: fifo.write_bytes(b"abc"), daemon=True).start()
    assert _within(fifo, lambda: read_capped(fifo, max_bytes=10)) == b"abc"
    with pytest.raises(OSError, match="not a regular file"):
        read_capped(fifo, max_bytes=10, regular=True)
    for data in (b"hi\n", b""):  # `<(echo hi)`, `<(true)`: the writer left before the open
        reader, writer = os.pipe()
        os.write(writer, data)
        os.close(writer)
        try:
            assert read_capped(f"/proc/self/fd/{reader}", max_bytes=10) == data
        finally:
            os.close(reader)


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ("{tmp}", "a folder; give a file name such as stats.jsonl"),
        ("{tmp}/f", "not a regular file (a FIFO, a device or a socket); give a file name such as"),
        ("/dev/null", "not a regular file"),
        ("/proc/version", "cannot write it: /proc/version is the kernel's"),
        ("/sys/x.jsonl", "cannot write it: /sys/x.jsonl is the kernel's"),
        ("{tmp}/no/x.jsonl", "there is no folder {tmp}/no"),
    ],
)
def test_a_stats_file_that_cannot_be_written_is_refused_before_the_run(
    given: str, says: str, tmp_path: Path, cli: CliRunner, fake: FakeRunner
) -> None:
    """--stats-file DIR, /proc/version or /nonexist/x ran the whole generation and then said
    `cannot write the stats file`, the stats lost; a FIFO with no reader hung after the text."""
    os.mkfifo(tmp_path / "f")
    path = given.format(tmp=tmp_path)
    result = _within(tmp_path / "f", lambda: cli.invoke(app, ["run", "--stats-file", path, "hi"]))
    assert result.exit_code == 1, result.stderr
    [line] = result.stderr.splitlines()
    assert line.startswith(f"llmrun: error: --stats-file {path}: {says.format(tmp=tmp_path)}")
    assert not fake.requests and fake.loaded is None  # refused before the load
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


@pytest.mark.parametrize("text", ['{"/m.gguf:1": {"chat": {}},}', "[1, 2]", "{'a': 1}"])
def test_a_tuned_file_that_is_not_json_is_named_and_never_replaced(
    text: str, tmp_path: Path, cli: CliRunner, fake: FakeRunner
) -> None:
    from llmrun.runners.bench.tuned import load_tuned, save_tuned, tuned_file
    from llmrun.runners.limits import SettingError

    path = tuned_file()
    path.parent.mkdir(parents=True)
    path.write_text(text)
    with pytest.raises(SettingError, match=r"tuned\.json"):
        load_tuned("/m.gguf")
    with pytest.raises(SettingError, match="fix or delete it"):
        save_tuned("/m.gguf", {"chat": {"n_threads": 1}})
    assert path.read_text() == text


@pytest.mark.parametrize(
    ("kind", "says"),
    [
        ("deep", "nested too deep to be tuned settings; fix or delete it"),
        ("fifo", "not a regular file (a FIFO, a device?); delete it"),
        ("latin1", "not UTF-8 text (byte 13 is 0xe9); fix or delete it"),
        (
            "digits",
            "holds a number of more than 4,300 digits, past what llmrun reads, no setting; fix or delete it",
        ),
        # read as inf and nan, they were "n_threads must be a whole number, not inf"
        ("1e999", "holds 1e999, a number past the largest float (1.797e308); fix or delete it"),
        ("NaN", "not valid JSON: NaN is not a JSON number (RFC 8259); fix or delete it"),
    ],
)
def test_a_tuned_file_too_deep_or_a_fifo_is_named(kind: str, says: str, tmp_path: Path) -> None:
    """100,000 brackets were an internal RecursionError; a FIFO blocked the open for ever; a
    byte past UTF-8 was named in Python's codec words; a number of 5,000 digits was an
    internal ValueError."""
    from llmrun.runners.bench.tuned import load_tuned, tuned_file
    from llmrun.runners.limits import SettingError

    path = tuned_file()
    path.parent.mkdir(parents=True)
    if kind == "deep":
        path.write_text("[" * 100_000)
    elif kind == "latin1":
        path.write_bytes(b'{"/m.gguf": "\xe9"}')
    elif kind == "digits":  # valid JSON (RFC 8259 has no limit); Python's int reads 4,300
        path.write_text('{"/m.gguf": {"chat": {"n_threads": ' + "9" * 5000 + "}}}")
    elif kind in ("1e999", "NaN"):
        path.write_text(f'{{"/m.gguf": {{"chat": {{"n_threads": {kind}}}}}}}')
    else:
        os.mkfifo(path)
    with pytest.raises(SettingError) as e:
        load_tuned("/m.gguf")
    assert str(e.value) == f"{path}: {says}"


def test_tune_refuses_a_tuned_file_it_could_not_save_before_it_measures(
    cli: CliRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole search ran, and its winner was lost at the save."""
    import llmrun.cli.bench.tune as tune
    from llmrun.runners.bench.tuned import tuned_file

    def no_search(*args: object, **kwargs: object) -> None:
        raise AssertionError("the search started")

    monkeypatch.setattr(tune, "make_bench_runner", no_search)
    path = tuned_file()
    path.parent.mkdir(parents=True)
    path.write_text('{"a": 1,}')
    result = cli.invoke(app, ["tune", "--workload", "chat"])
    assert result.exit_code == 1
    assert result.stderr.startswith(f"llmrun: error: {path}: not valid JSON (")


def test_history_model_patterns_match_literally(tmp_path: Path) -> None:
    with History(tmp_path / "h.db") as h:
        for name in ("a_\\b", "ax\\b", "axb", "100%"):
            h.store([{"test": "pp8", "avg_ts": 1.0}], kind="bench", model=name, system={})
        assert [r["model"] for r in h.runs(model="_\\")] == ["a_\\b"]
        assert [r["model"] for r in h.runs(model="a_")] == ["a_\\b"]
        assert [r["model"] for r in h.runs(model="%")] == ["100%"]
        assert len(h.runs(model="b")) == 3


def test_a_history_row_nested_past_pythons_depth_is_skipped(tmp_path: Path) -> None:
    """One row of 100,000 brackets made `history`, `-b/-c` and `--export-sql` internal errors;
    damaged rows are skipped, and the others shown."""
    import sqlite3

    path = tmp_path / "h.db"
    with History(path) as h:
        for avg in (1.0, 2.0):
            h.store([{"test": "pp8", "avg_ts": avg}], kind="bench", model="m", system={})
    with sqlite3.connect(path) as db:
        db.execute("UPDATE results SET record = ? WHERE rowid = 1", ("[" * 100_000,))
    with History(path) as h:
        runs = h.runs()
    assert [len(r["records"]) for r in runs] == [1, 0]
    assert [r["unreadable"] for r in runs] == [0, 1]


def test_jsonl_ids_come_back_as_given(tmp_path: Path, cli: CliRunner, fake: FakeRunner) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "q1", "prompt": "hi"}\n{"id": 7, "prompt": "yo"}\n{"prompt": "x"}\n')
    stats = tmp_path / "s.jsonl"
    result = cli.invoke(
        app, ["run", "-q", "--json", "--jsonl", str(prompts), "--stats-file", str(stats)]
    )
    assert result.exit_code == 0, result.output
    ids = [json.loads(x)["id"] for x in result.stdout.splitlines()]
    assert ids == ["q1", 7, f"{prompts}:3"]
    assert [json.loads(x)["id"] for x in stats.read_text().splitlines()] == ids


def test_a_lone_surrogate_in_jsonl_fails_its_line_only(
    tmp_path: Path, cli: CliRunner, fake: FakeRunner
) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        '{"prompt": "bad \\ud800 half"}\n{"prompt": "good \\ud83d\\ude00"}\n'
        + "[" * 100000
        + '\n{"prompt": "x", "temp": NaN}\n'
    )
    result = cli.invoke(app, ["run", "-q", "--jsonl", str(prompts)])
    assert result.exit_code == 1
    assert "good 😀" in result.stdout
    errors = [x for x in result.stderr.splitlines() if x.startswith("llmrun: error")]
    assert len(errors) == 3 and "surrogate" in errors[0] and "nested" in errors[1], result.stderr
    assert "NaN is not a JSON number" in errors[2]
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr


def test_a_number_past_the_floats_in_jsonl_is_named_as_written(
    tmp_path: Path, cli: CliRunner, fake: FakeRunner
) -> None:
    """`"temperature": 1e999` said `temperature inf is out of range`: Python reads it as inf,
    and a 401-digit integer ended the whole run with an internal error. Each line fails alone,
    naming the number as the user wrote it (a long one cut)."""
    prompts = tmp_path / "p.jsonl"
    long = "-1" + "0" * 400 + ".5"
    lines = [
        '"temperature": 1e999',
        f'"top_p": {long}',
        '"temperature": 1e-999',
        # a 401-digit integer: math.isfinite raised OverflowError, an internal error (run over)
        f'"temperature": 1{"0" * 400}',
        f'"max_tokens": 1{"0" * 400}',
    ]
    prompts.write_text("".join(f'{{"prompt": "a", {line}}}\n' for line in lines))
    result = cli.invoke(app, ["run", "-q", "--jsonl", str(prompts)])
    assert result.exit_code == 1
    errors = [x for x in result.stderr.splitlines() if x.startswith("llmrun: error")]
    assert len(errors) == 4, result.stderr
    assert "holds 1e999, a number past the largest float (1.797e308)" in errors[0], errors
    assert "holds -10000000000…(404 characters), a number past" in errors[1], errors
    assert "temperature 100000000000…(401 characters) is out of range 0..100" in errors[2]
    assert "max_tokens 100000000000…(401 characters) is out of range 1..16777216" in errors[3]
    assert "inf" not in result.stderr
    assert len(fake.requests) == 1  # 1e-999 is 0.0, a temperature like any other


def test_invalid_utf8_in_arguments_is_replaced_with_a_warning(
    tmp_path: Path, llmrun_env: dict[str, str]
) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            CHILD,
            "0",
            "run",
            "-s",
            b"sys\xff".decode("utf-8", "surrogateescape"),
            b"hi \xc3\x28 there".decode("utf-8", "surrogateescape"),
        ],
        cwd=ROOT,
        capture_output=True,
        timeout=HANG_S,
    )
    assert result.returncode == 0, result.stderr
    assert "hi \ufffd( there" in result.stdout.decode()
    assert b"not valid UTF-8" in result.stderr and b"internal error" not in result.stderr
    chat = subprocess.run(
        [
            sys.executable,
            "-c",
            CHILD,
            "0",
            "chat",
            "-s",
            b"sys\xff".decode("utf-8", "surrogateescape"),
        ],
        input=b"hi\n",
        cwd=ROOT,
        capture_output=True,
        timeout=HANG_S,
    )
    assert chat.returncode == 0, chat.stderr
    assert b"-s/--system is not valid UTF-8" in chat.stderr


def test_an_ascii_locale_reads_and_writes_utf8_as_it_is(llmrun_env: dict[str, str]) -> None:
    """LC_ALL=C with PYTHONUTF8=0: a valid UTF-8 argument drew "not valid UTF-8" (the locale
    had decoded its bytes as escapes), and the answer and --json in a pipe had `?` for every
    character past ASCII."""
    env = {**llmrun_env, "LC_ALL": "C", "PYTHONUTF8": "0"}
    env.pop("PYTHONIOENCODING", None)
    args = [sys.executable, "-c", CHILD, "0", "run", "héllo wörld ☃"]
    result = subprocess.run(args, cwd=ROOT, capture_output=True, timeout=HANG_S, env=env)
    assert result.returncode == 0, result.stderr
    assert b"not valid UTF-8" not in result.stderr, result.stderr
    assert "héllo wörld ☃" in result.stdout.decode("utf-8"), result.stdout
    result = subprocess.run(
        [*args, "--json"], cwd=ROOT, capture_output=True, timeout=HANG_S, env=env
    )
    assert result.returncode == 0, result.stderr
    assert "héllo wörld ☃" in json.loads(result.stdout)["text"], result.stdout


def test_set_parameter_speaks_for_itself(cli: CliRunner, fake: FakeRunner) -> None:
    result = cli.invoke(app, ["chat"], input="/set parameter temperature abc\n")
    assert "'abc' is not a number" in result.stderr
    assert "could not convert" not in result.output


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGHUP, 129), (signal.SIGTERM, 143)])
def test_sighup_keeps_the_results_like_sigterm(
    signum: int, code: int, tmp_path: Path, llmrun_env: dict[str, str]
) -> None:
    """A closed terminal or SSH session: the finished requests' stats are kept, exit 129."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": "w " * 50}) + "\n" for _ in range(400)))
    stats = tmp_path / "s.jsonl"
    slow = CHILD.replace("FakeRunner()", "Slow()").replace(
        "from tests.fake import FakeRunner",
        textwrap.dedent("""
        import time
        from tests.fake import FakeRunner
        class Slow(FakeRunner):
            def stream(self, request, *, cancel=None):
                for event in super().stream(request, cancel=cancel):
                    time.sleep(0.002)
                    yield event
        """),
    )
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            slow,
            "0",
            "run",
            "-q",
            "--jsonl",
            str(prompts),
            "--stats-file",
            str(stats),
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 60
    while not (stats.exists() and stats.read_text().count("\n") >= 2):
        assert time.monotonic() < deadline and child.poll() is None
        time.sleep(0.05)
    child.send_signal(signum)
    _, err = child.communicate(timeout=HANG_S)
    assert child.returncode == code, err
    lines = stats.read_text().splitlines()
    assert 2 <= len(lines) < 400 and all(json.loads(x) for x in lines)
    assert b"Traceback" not in err


def test_a_history_pattern_from_the_command_line(cli: CliRunner) -> None:
    with History() as h:
        h.store([{"test": "pp8", "avg_ts": 1.0}], kind="bench", model="m_\\", system={})
        h.store([{"test": "pp8", "avg_ts": 1.0}], kind="bench", model="mx\\", system={})
    result = cli.invoke(app, ["history", "-m", "_\\"])
    assert result.exit_code == 0, result.output
    assert "m_\\" in result.output and "mx" not in result.output
    result = cli.invoke(app, ["history", "-m", "[nothing]"])
    assert "no stored run's model name contains '[nothing]'" in result.output


def test_a_broken_model_link_is_an_error_about_the_path(
    tmp_path: Path, cli: CliRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "loop.gguf").symlink_to(tmp_path / "loop.gguf")
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "model").symlink_to(tmp_path / "gone.gguf")
    cases = {"loop.gguf": "a loop of symbolic links", "org/model": "gone.gguf, which does not"}
    monkeypatch.chdir(tmp_path)  # "org/model" reads as a Hub repository unless it is on disk
    for ref, why in cases.items():
        result = cli.invoke(app, ["run", "-m", ref, "hi"], env={"HF_HUB_OFFLINE": "1"})
        assert result.exit_code == 1
        assert f"model file not found: {ref}" in result.stderr and why in result.stderr
        assert result.stderr.count("\n") == 1 and "huggingface" not in result.stderr.lower()


BOMBS = [
    "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
    "{{ 'a' * 999999999 }}",
    "{% set x = 'ab' * 9999 %}{% for i in range(99999) %}{{ x }}{% endfor %}",
    "{% set n = namespace(x='ab') %}{% for i in range(60) %}{% set n.x = n.x ~ n.x %}{% endfor %}",
    "{{ 9 ** 99999999 }}",
]


@pytest.mark.model
def test_a_chat_template_runs_on_a_budget(
    model_path: str, tmp_path: Path, llmrun_env: dict[str, str]
) -> None:
    """A template is code that can come inside a GGUF: loops, sizes and output are bounded,
    each ending in one line (the real model; the bombs through --chat-template-file)."""
    from .test_trust import llmrun, one_error

    for n, bomb in enumerate(BOMBS):
        path = tmp_path / f"bomb{n}.jinja"
        path.write_text(bomb)
        line = one_error(
            llmrun(
                ["run", "-m", model_path, "--chat-template-file", str(path), "-n", "2", "hi"],
                llmrun_env,
                timeout=HANG_S,
            )
        )
        assert "--chat-template-file's template fails: " in line and (
            "steps" in line or "larger" in line or "more than" in line or "raises" in line
        ), line
    line = one_error(
        llmrun(
            ["run", "-m", model_path, "--chat-template-file", "/dev/zero", "hi"],
            llmrun_env,
            timeout=HANG_S,
        )
    )
    assert "larger than 1 MiB, or does not end" in line


@pytest.mark.model
def test_the_models_own_chat_template_has_the_template_files_cap(
    model_path: str, tmp_path: Path, llmrun_env: dict[str, str]
) -> None:
    """A GGUF's template of 14 MB was parsed by Jinja for a minute (680 MB, outside the render
    budget, deaf to SIGTERM), where --chat-template-file's is capped at 1 MiB: the model's own
    is refused past the same cap, in one line that names the way round; a template given with
    --chat-template-file still runs that model."""
    from llmrun.runners.limits import MAX_TEMPLATE_BYTES

    from .test_serve_tools_template import with_chat_template
    from .test_trust import llmrun, one_error

    big = tmp_path / "big_template.gguf"
    template = "{{ 1 }}" * (MAX_TEMPLATE_BYTES // 7 + 1)
    with_chat_template(Path(model_path), big, template)
    line = one_error(llmrun(["run", "-m", str(big), "-n", "2", "hi"], llmrun_env, timeout=HANG_S))
    assert f"the model's chat template is too large ({len(template):,} bytes" in line, line
    assert "--chat-template-file" in line, line
    own = tmp_path / "own.jinja"
    own.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    args = ["run", "-m", str(big), "--chat-template-file", str(own), "-n", "2", "-q", "hi"]
    result = llmrun(args, llmrun_env, timeout=HANG_S)
    assert result.returncode == 0, result.stderr


def test_the_bounded_template_renders_as_the_librarys() -> None:
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    from llmrun.runners.prompts import CHATML_TEMPLATE
    from llmrun.runners.template import TemplateBudgetError, bounded_formatter

    messages = [{"role": r, "content": f"{r} text"} for r in ("system", "user", "assistant")]
    ours = bounded_formatter(CHATML_TEMPLATE, eos_token="</s>", bos_token="<s>")
    theirs = Jinja2ChatFormatter(template=CHATML_TEMPLATE, eos_token="</s>", bos_token="<s>")
    assert ours(messages=messages).prompt == theirs(messages=messages).prompt  # type: ignore[arg-type]
    for bomb in BOMBS:
        with pytest.raises(TemplateBudgetError):
            bounded_formatter(bomb, eos_token="", bos_token="")(messages=messages)


@pytest.mark.parametrize(("option", "what"), [("-f", "prompt file"), ("--jsonl", "JSONL file")])
def test_endless_input_files_are_one_line(
    option: str, what: str, cli: CliRunner, fake: FakeRunner
) -> None:
    words = [] if option == "--jsonl" else ["hi"]  # each JSONL line holds its own prompt
    result = cli.invoke(app, ["run", option, "/dev/zero", *words])
    assert result.exit_code == 1
    assert f"/dev/zero: the {what} is larger than 256 MiB, or does not end" in result.stderr


FIFO_FILES = [  # each option that names a file, as its messages name it, and a text it reads
    ("-f", "-f/--file", "hi from a fifo"),
    ("--jsonl", "--jsonl", '{"prompt": "hi from a fifo"}\n'),
    ("--chat-template-file", "--chat-template-file", "{{ messages[-1].content }}"),
    ("--grammar", "--grammar", 'root ::= "yes" | "no"\n'),
    ("--json-schema", "--json-schema", '{"type": "string"}'),
]


SAID_S = 30.0  # the word of a wait comes after a second: this long on a loaded machine


def _waiting(fifo: Path, flag: str) -> str:
    return f"llmrun: waiting for a writer on FIFO {fifo} ({flag}); Ctrl-C to stop"


def _open_files() -> set[str]:
    """What this process's descriptors name. Each is read alone: the listing's own descriptor
    is closed by the time it is read, and an error there hid every later one (the FIFO's,
    whenever its number was higher: each such test waited out SAID_S)."""
    names = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            names.add(os.readlink(f"/proc/self/fd/{fd}"))
    return names


def _write_once_opened(fifo: Path, text: str, after_s: float) -> None:
    """Write `text` into `fifo` `after_s` after this process has opened it to read (or has
    waited SAID_S in the open)."""
    deadline = time.monotonic() + SAID_S
    while time.monotonic() < deadline and str(fifo) not in _open_files():
        time.sleep(0.01)
    time.sleep(after_s)
    fifo.write_text(text)


@pytest.mark.parametrize(("option", "flag", "text"), FIFO_FILES)
def test_a_fifo_without_a_writer_says_it_waits_once(
    option: str,
    flag: str,
    text: str,
    tmp_path: Path,
    cli: CliRunner,
    fake: FakeRunner,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A FIFO given to -f, --grammar and the others with no writer waited for ever without a
    word; after a second (here less) it says so once on stderr, and reads the writer's text."""
    import llmrun.runners.files as files

    monkeypatch.setattr(files, "WRITER_WAIT_S", 0.05)
    fifo = tmp_path / "in.fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=_write_once_opened, args=(fifo, text, 0.5), daemon=True)
    writer.start()
    args = ["run", option, str(fifo)] + ([] if option in ("-f", "--jsonl") else ["hi"])
    result = cli.invoke(app, args)
    writer.join()
    assert result.exit_code == 0, result.stderr
    assert result.stderr.splitlines().count(_waiting(fifo, flag)) == 1, result.stderr
    assert len(fake.requests) == 1


def test_the_wait_for_a_fifos_writer_is_said_by_the_cli_alone(
    tmp_path: Path, cli: CliRunner, fake: FakeRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """runners/ tells the wait to a hook and writes nothing itself (a library caller waits in
    silence: the hook's default); the CLI says it with the FIFO's name made safe for a terminal: a name holding a
    window-title sequence reached the terminal raw."""
    import llmrun.runners.files as files

    monkeypatch.setattr(files, "WRITER_WAIT_S", 0.05)
    monkeypatch.setattr(files, "on_writer_wait", files.on_writer_wait)
    fifo = tmp_path / "in\x1b]0;owned\x07.fifo"
    os.mkfifo(fifo)

    def writer() -> threading.Thread:
        thread = threading.Thread(target=_write_once_opened, args=(fifo, "hi", 0.5), daemon=True)
        thread.start()
        return thread

    told: list[tuple[str, str]] = []
    monkeypatch.setattr(files, "on_writer_wait", lambda *said: told.append(said))
    library = writer()
    with contextlib.redirect_stderr(io.StringIO()) as written:
        assert files.read_capped(fifo, max_bytes=9, flag="-f") == b"hi"
    library.join()
    assert (told, written.getvalue()) == ([(str(fifo), "-f")], "")
    cli_writer = writer()
    result = cli.invoke(app, ["run", "-f", str(fifo)])
    cli_writer.join()
    assert result.exit_code == 0, result.stderr
    safe = _waiting(tmp_path / "in.fifo", "-f/--file")  # the whole sequence gone
    assert result.stderr.splitlines().count(safe) == 1, result.stderr
    assert "\x1b" not in result.stderr


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
@pytest.mark.parametrize(("option", "flag", "text"), FIFO_FILES[::4])
def test_the_wait_for_a_fifos_writer_ends_on_a_signal(
    signum: int,
    code: int,
    option: str,
    flag: str,
    text: str,
    tmp_path: Path,
    llmrun_env: dict[str, str],
) -> None:
    """The real CLI (on the fake runner) says it waits, once, after about a second, and Ctrl-C
    or SIGTERM then ends it as a shell would, without a traceback."""
    fifo = tmp_path / "in.fifo"
    os.mkfifo(fifo)
    child = python_child(CHILD, "0", "run", option, str(fifo), "hi", env=llmrun_env)
    try:
        assert child.stderr is not None
        ready, _, _ = select.select([child.stderr], [], [], SAID_S)
        assert ready, "no word of the wait"
        assert child.stderr.readline().rstrip("\n") == _waiting(fifo, flag)
        child.send_signal(signum)
        _, err = child.communicate(timeout=HANG_S)
    finally:
        child.kill()
    assert child.returncode == code, err
    assert "Traceback" not in err and "waiting" not in err, err


def test_process_substitution_is_read_without_a_word_of_waiting(
    llmrun_env: dict[str, str],
) -> None:
    """`-f <(command)` is a pipe with a writer: read as its data comes, however late (here
    after 1.5 s, past the FIFO's second), never said to wait for a writer."""
    result = subprocess.run(
        [
            "bash",
            "-c",
            '"$0" -c "$1" 0 run -f <(sleep 1.5; echo hi from a pipe) --grammar <(echo \'root ::= "x"\')',
            sys.executable,
            CHILD,
        ],
        cwd=ROOT,
        env=llmrun_env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert result.returncode == 0, result.stderr
    assert "hi from a pipe" in result.stdout
    assert "waiting" not in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("option", "what"),
    [
        ("-f", "-f/--file: cannot read prompt file"),
        ("--jsonl", "--jsonl: cannot read JSONL file"),
        ("--chat-template-file", "--chat-template-file: cannot read template"),
        ("--grammar", "--grammar: cannot read grammar"),
        ("--json-schema", "--json-schema: cannot read JSON schema"),
        ("--ppl", "--ppl: cannot read text file"),
    ],
)
def test_a_missing_file_is_named_by_its_option_in_one_form(
    option: str,
    what: str,
    tmp_path: Path,
    cli: CliRunner,
    fake: FakeRunner,
    fake_bench: FakeBenchRunner,
) -> None:
    """Prompt files said `prompt file not found: PATH`, the others `FLAG: cannot read PATH`;
    then a --jsonl file was called a prompt file, and --ppl's file was called nothing."""
    missing = tmp_path / "none"
    command = {
        "--ppl": ["bench", "-r", "1", "-p", "8", "-n", "0"],
        "--jsonl": ["run"],  # each line holds its own prompt
    }.get(option, ["run", "hi"])
    result = cli.invoke(app, [*command, option, str(missing)])
    assert result.exit_code == 1
    assert result.stderr == f"llmrun: error: {what} {missing}: No such file or directory\n"


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"", "the file is empty"),
        (b" \n\t", "the file is empty"),
        (b"{{ x }}\xff", "not UTF-8 text (byte 7 is 0xff)"),
    ],
)
def test_a_template_file_that_is_empty_or_not_text_is_refused(
    data: bytes, says: str, tmp_path: Path, cli: CliRunner, fake: FakeRunner
) -> None:
    """An empty template fell back to the model's own in silence, and bytes past UTF-8 became
    U+FFFD in the prompt."""
    path = tmp_path / "t.jinja"
    path.write_bytes(data)
    result = cli.invoke(app, ["run", "--chat-template-file", str(path), "hi"])
    assert result.exit_code == 1
    assert result.stderr == f"llmrun: error: --chat-template-file {path}: {says}\n"
    assert fake.requests == []


@pytest.mark.parametrize("command", ["run", "chat"])
def test_stdin_past_the_prompt_cap_is_one_line(
    command: str, cli: CliRunner, fake: FakeRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A piped prompt (run) or chat line is held to a prompt file's cap, not to all memory."""
    import llmrun.cli.inputs as inputs

    monkeypatch.setattr(inputs, "MAX_PROMPT_FILE_BYTES", 1000)
    whole = cli.invoke(app, [command], input="a" * 1000 + "\n")  # the cap itself fits
    assert whole.exit_code == 0, whole.output
    result = cli.invoke(app, [command], input="a" * 1001)
    assert result.exit_code == 1
    assert result.stderr.startswith("llmrun: error: stdin is larger than 256 MiB, or does not end")
    assert result.stderr.count("\n") == 1


def test_endless_stdin_is_one_line(llmrun_env: dict[str, str]) -> None:
    from .test_trust import llmrun, one_error

    line = one_error(llmrun(["run", "-n", "1"], llmrun_env, shell_suffix="< /dev/zero"))
    assert line == "llmrun: error: stdin is larger than 256 MiB, or does not end"


@pytest.mark.model
def test_ppl_from_an_endless_file_is_one_line(model_path: str, llmrun_env: dict[str, str]) -> None:
    from .test_trust import llmrun, one_error

    line = one_error(
        llmrun(
            ["bench", "-m", model_path, "-p", "8", "-n", "0", "-r", "1", "--ppl", "/dev/zero"],
            llmrun_env,
            timeout=HANG_S,
        )
    )
    assert "--ppl /dev/zero" in line and "does not end" in line


class _CountedCancel(threading.Event):
    """Ctrl-C after a known number of looks at the flag: it sets itself at the look after
    `after_looks` of them. The batched engine looks once a step, and llama.cpp's abort hook
    (contexts.abort_on) once between each two of a graph's nodes: 515 looks a step for the
    embedded model, the prompts' step included, whatever the thread count."""

    def __init__(self, after_looks: int) -> None:
        super().__init__()
        self.after_looks = after_looks
        self.looks = 0

    def is_set(self) -> bool:
        self.looks += 1
        if self.looks > self.after_looks:
            self.set()
        return super().is_set()


@pytest.mark.model
def test_an_interrupted_parallel_batch_says_what_happened_to_each(model_path: str) -> None:
    from llmrun.runners.base import Finished
    from llmrun.runners.config import EngineConfig
    from llmrun.runners.llamacpp import LlamaCppRunner
    from llmrun.runners.serving.parallel import NotStartedError, serve_requests
    from llmrun.runners.stats import FINISH_INTERRUPTED

    runner = LlamaCppRunner(model_path, EngineConfig(n_ctx=512, n_threads=1))
    try:
        sampling = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
        requests = [Request(prompt=f"Count to {i}:", sampling=sampling) for i in range(5)]
        # about the 8th of the first two requests' 64 steps: a graph of 70 nodes to 2,000
        # still stops them after their first token and before their last
        cancel = _CountedCancel(after_looks=4000)
        outcome, _ = serve_requests(runner, requests, n_seq=2, cancel=cancel)
    finally:
        runner.close()
    assert len(outcome) == 5
    cut = [o for o in outcome if isinstance(o, Finished)]
    assert len(cut) == 2 and all(f.stats.finish_reason == FINISH_INTERRUPTED for f in cut)
    assert all(0 < f.stats.output_tokens < 64 for f in cut)
    assert all(isinstance(o, NotStartedError) for o in outcome[2:])


@pytest.mark.model
def test_parallel_lines_fail_alone_and_ctx_and_draft_are_not_ignored(
    model_path: str, tmp_path: Path, llmrun_env: dict[str, str]
) -> None:
    from .test_trust import llmrun, one_error

    template = tmp_path / "t.jinja"
    template.write_text(
        "{% if 'boom' in messages[-1].content %}{{ raise_exception('no boom') }}"
        "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
    )
    prompts = tmp_path / "p.jsonl"
    lines = ["Say hi.", "boom", "Say yes.", "word " * 100, "Say no."]
    prompts.write_text(
        "".join(json.dumps({"id": f"q{i}", "prompt": p}) + "\n" for i, p in enumerate(lines))
    )
    result = llmrun(
        [
            "run",
            "-m",
            model_path,
            "--jsonl",
            str(prompts),
            "--parallel",
            "2",
            "-n",
            "4",
            "-c",
            "64",
            "--chat-template-file",
            str(template),
            "--json",
            "-q",
        ],
        llmrun_env,
    )
    assert result.returncode == 1, result.stderr
    answered = [json.loads(x) for x in result.stdout.splitlines()]
    assert [a["id"] for a in answered] == ["q0", "q2", "q4"]
    assert all(a["stats"]["settings"]["n_ctx"] == 64 for a in answered)
    errors = result.stderr.decode().splitlines()
    assert any(":2: " in e and "no boom" in e for e in errors), errors
    assert any(":4: " in e and "context holds 64" in e for e in errors), errors
    for flags in (["--draft", "lookup"], ["--draft-model", model_path]):
        line = one_error(
            llmrun(
                ["run", "-m", model_path, "--parallel", "2", "--temp", "0", *flags, "hi"],
                llmrun_env,
            ),
            code=2,  # two options that do not go together: a usage error
        )
        assert "--parallel does not speculate" in line


@pytest.mark.model
def test_escapes_in_model_and_ppl_file_names_never_reach_stderr(
    model_path: str, tmp_path: Path, llmrun_env: dict[str, str]
) -> None:
    from .test_trust import llmrun

    evil = "x\x1b]0;pwned\x07\x1b[2J\x9b\u202eexe"  # U+202E: shown as `exe` reversed
    model = tmp_path / f"{evil}.gguf"
    model.symlink_to(model_path)
    text = tmp_path / f"{evil}.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    for args in (
        ["run", "-m", str(model), "-n", "2", "hi"],
        [
            "bench",
            "-m",
            str(model),
            "-p",
            "8",
            "-n",
            "0",
            "-r",
            "1",
            "--ppl",
            str(text),
            "-c",
            "64",
        ],
    ):
        result = llmrun(args, llmrun_env)
        assert result.returncode == 0, result.stderr
        err = result.stderr.decode()
        assert not {"\x1b", "\x9b", "\x07", "\u202e"} & set(err), repr(err)


@pytest.mark.model
def test_ctrl_c_on_a_parallel_batch_exits_130_and_names_every_request(
    model_path: str, tmp_path: Path, llmrun_env: dict[str, str]
) -> None:
    from .conftest import which_llmrun

    limit = 12  # the tokens each request may write (the batch is served whole before a line)
    n = 12  # the signal lands while their lines and summaries are written: 12 make it wide
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"Count from {i} to 900."}) + "\n" for i in range(n))
    )
    child = subprocess.Popen(
        [
            which_llmrun(),
            "run",
            "-m",
            model_path,
            "--jsonl",
            str(prompts),
            "--parallel",
            "3",
            "-n",
            str(limit),
            "-t",
            "1",
            "--json",
        ],
        env=llmrun_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    # Ctrl-C once the first request is answered (its JSON line; a fixed sleep let a quiet
    # machine finish first). --parallel writes the lines once the whole batch is served, so the
    # signal lands while the rest are written; a batch stopped inside is tested in-process:
    # test_an_interrupted_parallel_batch_says_what_happened_to_each
    assert child.stdout is not None
    ready, _, _ = select.select([child.stdout], [], [], HANG_S)
    assert ready, "no request answered"
    first = child.stdout.readline()
    child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=HANG_S)
    out = first + out
    assert child.returncode == 130, err
    assert b"Traceback" not in err and b"internal error" not in err
    if b"parallel 3:" in err:  # it was serving: every request is accounted for
        answered = [json.loads(x) for x in out.splitlines()]
        errors = [x for x in err.decode().splitlines() if "not started" in x]
        assert len(answered) + len(errors) == n
        assert all(
            a["stats"]["finish_reason"] != "length" or a["stats"]["output_tokens"] == limit
            for a in answered
        )


def test_json_lines_split_only_at_newlines(
    tmp_path: Path, cli: CliRunner, fake: FakeRunner
) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(
        "\ufeff".encode()
        + '{"id": "a", "prompt": "one\u2028two\x85three"}\r\n{"id": "b", "prompt": "five"}'.encode()
    )
    result = cli.invoke(app, ["run", "-q", "--json", "--jsonl", str(prompts)])
    assert result.exit_code == 0, result.output
    assert [json.loads(x)["id"] for x in result.stdout.splitlines()] == ["a", "b"]


def test_the_output_files_trial_keeps_a_link_whose_target_is_not_there_yet(tmp_path: Path) -> None:
    """The trial open made the link's target and then removed the link itself: the run wrote
    a plain file where the user's link had been."""
    from llmrun.runners.files import output_file_problem

    link, target = tmp_path / "link.jsonl", tmp_path / "out" / "target.jsonl"
    target.parent.mkdir()
    link.symlink_to(target)
    assert output_file_problem(link) is None
    assert link.is_symlink() and not target.exists()


def test_the_problems_that_want_a_file_name_are_told_by_kind_not_by_their_words(
    tmp_path: Path,
) -> None:
    """cli/inputs.output_file compared the problem's text with "a folder" and NOT_REGULAR to
    know which want an example file name: a reworded problem would have lost it in silence."""
    from llmrun.runners.files import NOT_REGULAR, Unwritable, output_file_problem

    os.mkfifo(tmp_path / "f")
    assert output_file_problem(tmp_path) == Unwritable("a folder", no_file=True)
    assert output_file_problem(tmp_path / "f") == Unwritable(NOT_REGULAR, no_file=True)
    missing = output_file_problem(tmp_path / "no" / "x.jsonl")
    assert missing == Unwritable(f"there is no folder {tmp_path / 'no'}", no_file=False)
