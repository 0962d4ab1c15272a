"""Long work shows its progress: what runs, done of total, the time taken and an estimate of
the time left (issue 21, item 10), and `llmrun tune` keeps what it measured when stopped."""

from __future__ import annotations

import io
import json
import re
import signal
import sys
import threading
from pathlib import Path

import pexpect
import pyte
import pytest
from rich.console import Console
from typer.testing import CliRunner

from llmrun.cli.app import app
from llmrun.cli.bench import tune
from llmrun.cli.progress import ProgressLine, Shown, progress_text
from llmrun.runners.bench import measure, tuned, tuning
from llmrun.runners.bench.sweep import Combo, Shape
from llmrun.runners.config import EngineConfig
from llmrun.runners.errors import BadRequestError
from llmrun.runners.llamacpp import LlamaCppRunner
from llmrun.runners.progress import RepClock, Tally, eta_s
from llmrun.runners.serving.local import interfere_local, serve_local
from llmrun.runners.serving.options import InterferenceOptions, ServeOptions, Stage
from llmrun.runners.serving.policy import Policy

from .conftest import HANG_S, which_llmrun
from .fake import FakeBenchRunner


def test_tally_counts_from_any_thread_and_estimates_from_its_fine_units() -> None:
    tally = Tally(4, work_total=40)
    assert tally.eta_s(tally.started_s + 5) is None  # nothing done: no pace yet

    def count() -> None:
        for _ in range(5):
            tally.add(work=1)

    workers = [threading.Thread(target=count) for _ in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert (tally.done, tally.work, tally.fraction) == (0, 10, 0.25)
    # four requests side by side finish together: their tokens give the estimate meanwhile
    assert tally.eta_s(tally.started_s + 5) == pytest.approx(15)
    tally.add(done=4, work=30)
    assert tally.eta_s(tally.started_s + 20) == 0.0
    assert Tally(8).fraction == 0.0 and eta_s(10, 0.5) == 10


def test_rep_clock_estimates_each_kind_of_test_at_the_recent_pace() -> None:
    clock = RepClock()
    left = {"pp512": 5, "tg128": 6}
    clock.started("pp512", 0.0)
    assert clock.eta_s(1.0, left) is None  # the first repetition, nothing to go by
    clock.finished(2.0)  # pp512: 2 s
    clock.started("pp512", 2.0)
    assert clock.eta_s(2.5, left) == pytest.approx(1.5 + 5 * 2 + 6 * 2)  # tg unseen: the mean
    clock.finished(4.0)
    clock.started("tg128", 4.0)
    # a tg repetition a quarter done after 3 s: 9 s to go, and the same for each one left
    assert clock.eta_s(7.0, {"tg128": 5}, fraction=0.25) == pytest.approx(9 + 5 * 12)
    clock.finished(16.0)  # tg128: 12 s
    clock.started("tg128", 16.0)
    assert clock.eta_s(17.0, {"tg128": 4, "pp512": 1}) == pytest.approx(11 + 4 * 12 + 2)
    assert clock.eta_s(40.0, {"tg128": 0}) == 0.0  # slower than the last: never negative
    clock.finished(40.0)  # twice tg128's first: the machine got busier, or the settings slower
    # the pace of the last three (1, 1, 2) scales every kind: pp512 4/3 x 2 s, tg128 4/3 x 12 s
    assert clock.eta_s(40.0, {"pp512": 3, "tg128": 1}) == pytest.approx(4 / 3 * (3 * 2 + 12))


@pytest.mark.parametrize("width", [40, 60, 80, 120])
def test_the_line_keeps_every_figure_and_cuts_only_the_label(width: int) -> None:
    shown = Shown(
        "tg128 rep 2/5 t=2 b=512 ub=512 fa=off ctk=q8_0 ctv=q8_0", 37, 120, "runs", 754.0, 3725.0
    )
    text = progress_text(shown, width).plain
    assert len(text) <= width and "\n" not in text
    assert "37/120" in text and "12:34" in text and "ETA 1:02:05" in text
    assert text.startswith("tg128") or width < 50
    waiting = progress_text(Shown("c=4 rate=inf", 0, 16, "requests", 3.0, None), width).plain
    assert "ETA" not in waiting and "0/16" in waiting  # no estimate yet: none shown


@pytest.mark.parametrize("width", [30, 40, 60])
def test_a_label_of_wide_characters_is_cut_in_cells(width: int) -> None:
    """The label was cut in characters: a CJK model name made the line 56 cells at width 40,
    and rich cropped the figures at its end."""
    from rich.cells import cell_len

    text = progress_text(Shown("模型" * 20, 37, 120, "runs", 754.0, 3725.0), width).plain
    assert cell_len(text) <= width and text.endswith("ETA 1:02:05")


def test_the_line_is_erased_on_a_terminal_and_one_line_per_stage_elsewhere() -> None:
    tty = Console(file=io.StringIO(), force_terminal=True, width=60, color_system=None)
    line = ProgressLine(tty, plain_lines=True)
    line.follow("chunked:64 c=4", lambda now: Shown("chunked:64 c=4", 3, 16, "requests", 9, 30))
    line.stop()
    drawn = tty.file.getvalue()  # type: ignore[attr-defined]
    assert "3/16 requests" in drawn and "\x1b[2K" in drawn  # drawn, then erased
    pipe = Console(file=io.StringIO(), width=60, color_system=None)
    line = ProgressLine(pipe, plain_lines=True)
    line.follow("chunked:64 c=4", lambda now: Shown("chunked:64 c=4", 0, 16, "requests", 0, None))
    line.stop()
    assert pipe.file.getvalue() == "llmrun: chunked:64 c=4: 16 requests\n"  # type: ignore[attr-defined]


def test_bench_says_which_repetition_runs_and_estimates_after_the_first() -> None:
    fake = FakeBenchRunner()
    combos = [Combo(1, 64, 64, None, "off"), Combo(2, 64, 64, None, "off")]
    shapes = [Shape(16, 0), Shape(0, 64)]
    run = measure.run_bench(
        fake,  # type: ignore[arg-type]
        measure.BenchPlan(measure.every_shape(combos, shapes), reps=2),
        base=EngineConfig(),
    )
    events = [e for e in run if isinstance(e, measure.Progress)]
    total = 2 * 2 * 3
    assert {e.total for e in events} == {total}
    preparing = [e for e in events if e.moment == "preparing"]
    assert [(e.done, e.label) for e in preparing] == [
        (0, "setting up t=1 b=64 ub=64 fa=off"),
        (6, "setting up t=2 b=64 ub=64 fa=off"),
    ]
    assert [sum(n for _, n in e.left) for e in preparing] == [total, total - 6]
    started = [e for e in events if e.moment == "started"]
    assert [e.done for e in started] == list(range(total))
    assert [e.label.split(" t=")[0] for e in started[:6]] == [
        "pp16 warm-up",
        "pp16 rep 1/2",
        "pp16 rep 2/2",
        "tg64 warm-up",
        "tg64 rep 1/2",
        "tg64 rep 2/2",
    ]
    for e in started:  # what is left after each repetition, by kind
        assert sum(n for _, n in e.left) == total - e.done - 1
    assert [e.done for e in events if e.moment == "ended"] == list(range(1, total + 1))
    working = [e for e in events if e.moment == "working"]
    assert working and all(0 < e.fraction < 1 for e in working)  # tg: its tokens
    # Replayed on a clock of one second per event: an estimate from the first finished run on
    clock, estimates = RepClock(), []
    for t, e in enumerate(events):
        if e.moment == "started":
            clock.started(e.test, t)
        elif e.moment == "ended":
            clock.finished(t)
        estimates.append(clock.eta_s(t, dict(e.left), e.fraction if e.moment == "working" else 0))
    first_end = next(i for i, e in enumerate(events) if e.moment == "ended")
    assert all(x is not None for x in estimates[first_end:])
    assert estimates[-1] == 0


def test_bench_progress_lines_name_the_test(
    cli: CliRunner, home: Path, fake_bench: FakeBenchRunner
) -> None:
    result = cli.invoke(
        app, ["bench", "-p", "8", "-n", "4", "-r", "2", "--progress", "--no-history", "-o", "json"]
    )
    assert result.exit_code == 0, result.stderr
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("llmrun: ")]
    assert [ln.split(" t=")[0] for ln in lines] == [
        "llmrun: 1/6 pp8 warm-up",
        "llmrun: 2/6 pp8 rep 1/2",
        "llmrun: 3/6 pp8 rep 2/2",
        "llmrun: 4/6 tg4 warm-up",
        "llmrun: 5/6 tg4 rep 1/2",
        "llmrun: 6/6 tg4 rep 2/2",
    ]
    assert "bench 0/1" not in result.stderr


SPELLINGS = [("90", 90), ("90s", 90), ("5m", 300), ("1.5h", 5400), ("1h30m", 5400), ("2m30s", 150)]


@pytest.mark.parametrize(("text", "seconds"), SPELLINGS)
def test_budget_spellings(text: str, seconds: float) -> None:
    assert tuning.parse_budget(text) == seconds


@pytest.mark.parametrize(
    "text",
    [
        "",
        "abc",
        "0",
        "0s",
        "-5m",
        "5 m",
        " 5m",
        "5mm",
        "1w",
        "m",
        "inf",
        "nan",
        "1e3",
        "8d",
        "200h",
        "5m1h",
    ],
)
def test_a_bad_budget_is_a_usage_error(text: str, cli: CliRunner, home: Path) -> None:
    with pytest.raises(BadRequestError):
        tuning.parse_budget(text)
    result = cli.invoke(app, ["tune", "--budget", text])
    assert result.exit_code == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "--budget" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_spent_budget_saves_the_best_measured_and_keeps_other_entries(
    cli: CliRunner, home: Path, fake_bench: FakeBenchRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = {"/elsewhere/other.gguf:123": {"chat": {"n_threads": 3}}}
    (home / "config").mkdir(parents=True)
    (home / "config" / "tuned.json").write_text(json.dumps(other))
    # The budget's clock runs out as the third setting starts: two were measured whole
    monkeypatch.setattr(tune, "clock_s", lambda: 0.0 if len(fake_bench.configs) < 3 else 1e9)
    result = cli.invoke(app, ["tune", "--budget", "5m"])
    assert result.exit_code == 0, result.stderr
    said = " ".join(result.stderr.split())
    assert "the --budget of 5:00 was spent: saved the best of 2 trials measured" in said
    saved = json.loads((home / "config" / "tuned.json").read_text())
    assert saved["/elsewhere/other.gguf:123"] == other["/elsewhere/other.gguf:123"]
    entry = saved[tuned.model_key(fake_bench.model_path)]
    assert set(entry) == {"chat", "document"}
    for found in entry.values():
        assert found["partial"] == "stopped by --budget after 2 trials"
        assert set(found) == {*tuned.TUNED_FIELDS, "partial"}
    assert len(fake_bench.configs) == 3  # nothing measured after the budget


def test_a_budget_spent_before_anything_was_measured_saves_nothing(
    cli: CliRunner, home: Path, fake_bench: FakeBenchRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    times = iter([0.0])
    monkeypatch.setattr(tune, "clock_s", lambda: next(times, 1e9))
    result = cli.invoke(app, ["tune", "--budget", "1s"])
    assert result.exit_code == 1
    assert "the --budget of 0:01 was spent: nothing was measured; nothing saved" in " ".join(
        result.stderr.split()
    )
    assert not (home / "config" / "tuned.json").exists()


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_stopping_tune_saves_the_best_measured_so_far(
    llmrun_env: dict[str, str], model_path: str, tmp_path: Path, stop: signal.Signals
) -> None:
    """Ctrl-C (or SIGTERM) once the search is past its second stage: the settings measured by
    then are saved, and the exit code says which signal it was."""
    home = tmp_path / "home"
    env = dict(llmrun_env, LLMRUN_HOME=str(home))
    code = (
        "import sys\n"
        "from llmrun.runners.bench import sweep, tuning\n"
        "tuning.SHAPES = (sweep.Shape(8, 0), sweep.Shape(0, 4, 8))\n"
        "tuning.REPS = 2\n"
        "from llmrun.cli.main import main\n"
        "sys.argv = ['llmrun', 'tune']\n"
        "main()\n"
    )
    child = pexpect.spawn(
        sys.executable,
        ["-c", code],
        env=env,
        encoding="utf-8",
        timeout=HANG_S,
        dimensions=(40, 120),
    )
    child.expect(r"tuning repacking \(chat\)")  # two stages done: two settings or more measured
    child.kill(stop)
    child.expect(pexpect.EOF)
    child.close()
    said = " ".join(str(child.before).split())
    assert child.exitstatus == (130 if stop == signal.SIGINT else 143), said
    found = re.search(r"saved the best of (\d+) trials measured", said)
    assert found and int(found.group(1)) >= 2, said
    assert "nothing saved" not in said and "Traceback" not in said
    (entry,) = json.loads((home / "config" / "tuned.json").read_text()).values()
    assert entry["chat"]["partial"] == f"interrupted after {found.group(1)} trials"


def test_local_serving_counts_each_level_to_its_end(runner: LlamaCppRunner) -> None:
    options = ServeOptions(
        concurrency=(1, 2),
        request_rate=float("inf"),
        num_prompts=3,
        input_len=8,
        output_len=4,
        range_ratio=0.0,
        warmup=1,
        percentiles=(50.0,),
        seed=1,
        policies=(Policy.parse("chunked:32"),),
    )
    stages: list[Stage] = []
    for event in serve_local(runner, options, cancel=threading.Event()):
        if isinstance(event, Stage):
            stages.append(event)
    assert [s.text for s in stages] == [
        "chunked:32 slots=1 warm-up",
        "chunked:32 slots=1",
        "chunked:32 slots=2 warm-up",
        "chunked:32 slots=2",
    ]
    for s in stages:
        assert s.tally is not None and s.tally.done == s.tally.total
        assert s.tally.work == s.tally.work_total and s.tally.eta_s() == 0.0
    assert [s.tally.total for s in stages if s.tally] == [1, 3, 1, 3]


def test_local_interference_counts_the_stream_and_the_long_prompts(runner: LlamaCppRunner) -> None:
    options = InterferenceOptions(
        rate=20.0,
        prompt_len=16,
        output_len=6,
        seed=1,
        input_len=8,
        num_prompts=2,
        policies=(Policy.parse("chunked:8"),),
    )
    stages = [
        e
        for e in interfere_local(runner, options, cancel=threading.Event())
        if isinstance(e, Stage)
    ]
    assert [s.tally.total for s in stages if s.tally] == [1, 3]
    for s in stages:
        assert s.tally is not None and s.tally.done == s.tally.total
        assert s.tally.work == s.tally.work_total


def test_serving_against_a_server_counts_prompts_and_requests(cli: CliRunner, home: Path) -> None:
    from .stub_server import bench_against_stub

    result = bench_against_stub(
        cli,
        "--concurrency",
        "1,2",
        "--num-prompts",
        "3",
        "--warmup",
        "1",
        "--no-history",
        model="stub",
    )
    assert result.exit_code == 0, result.stderr
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("llmrun: ")]
    assert lines == [
        # each level its own prompts: 2 x (3 + 1 warm-up)
        "llmrun: preparing prompts (counting tokens with the server's tokenizer): 8 prompts",
        "llmrun: max-conc=1 warm-up: 1 requests",
        "llmrun: max-conc=1 rate=inf: 3 requests",
        "llmrun: max-conc=2 warm-up: 1 requests",
        "llmrun: max-conc=2 rate=inf: 3 requests",
    ]


def on_a_terminal(args: list[str], env: dict[str, str], columns: int) -> tuple[int, str, list[str]]:
    """The command on a terminal of this width: its exit code, all it wrote (escapes and
    redraws included), and what the screen shows at the end, scrollback included (pyte)."""
    screen = pyte.HistoryScreen(columns, 40, history=2000, ratio=0.5)
    stream = pyte.ByteStream(screen)
    child = pexpect.spawn(which_llmrun(), args, env=env, dimensions=(40, columns), timeout=HANG_S)
    written = b""
    while True:
        try:
            chunk = child.read_nonblocking(4096, timeout=HANG_S)
        except pexpect.EOF:
            break
        written += chunk
        stream.feed(chunk)
    child.close()
    history = ["".join(ch.data for ch in row.values()).rstrip() for row in screen.history.top]
    lines = history + [line.rstrip() for line in screen.display]
    return child.exitstatus, written.decode("utf-8", "replace"), lines


@pytest.mark.parametrize("columns", [40, 80])
def test_bench_on_a_terminal_shows_the_test_and_an_estimate_then_nothing_of_it(
    llmrun_env: dict[str, str], columns: int
) -> None:
    env = {**llmrun_env, "TERM": "xterm-256color"}
    code, written, lines = on_a_terminal(
        ["bench", "-p", "16", "-n", "48", "-r", "2", "--no-history"], env, columns
    )
    assert code == 0, written[-2000:]
    # the test under way and an estimate (at 40 columns the unit makes room for the label)
    assert re.search(r"tg48 rep 2/2[^\n]*?5/6(?: runs)? · \d+:\d\d · ETA \d+:\d\d", written)
    assert "-:--:--" not in written and "bench 0/1" not in written
    text = "\n".join(lines)
    assert not any(re.search(r"\d+/6", ln) for ln in lines), text  # no stale row
    assert "tg48" in text  # the results table


def test_serving_on_a_terminal_shows_requests_and_leaves_no_row(llmrun_env: dict[str, str]) -> None:
    env = {**llmrun_env, "TERM": "xterm-256color"}
    args = [
        "bench",
        "serve",
        "--concurrency",
        "2",
        "--num-prompts",
        "4",
        "--input-len",
        "8",
        "--output-len",
        "24",
        "--policy",
        "chunked:32",
        "--no-history",
    ]
    code, written, lines = on_a_terminal(args, env, 80)
    assert code == 0, written[-2000:]
    assert re.search(r"chunked:32 slots=2\s+\d/4 requests · \d+:\d\d · ETA \d+:\d\d", written)
    assert not any(re.search(r"\d/4 requests", ln) for ln in lines), "\n".join(lines)
    assert any("TTFT" in ln for ln in lines)


def test_bench_progress_lines_carry_no_escape_from_the_settings(
    cli: CliRunner, home: Path, fake_bench: FakeBenchRunner
) -> None:
    """A run's label names its settings (an -ot pattern is text from outside): the plain
    --progress lines sanitize it as the live line does."""
    result = cli.invoke(
        app,
        [
            "bench",
            "-p",
            "8",
            "-n",
            "0",
            "-r",
            "1",
            "--progress",
            "--no-history",
            "-o",
            "json",
            "-ot",
            "\x1b]0;pwned\x07blk=CPU,x=CPU",
        ],
    )
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("llmrun: ")]
    assert lines, result.stderr
    assert not any("\x1b" in ln or "\x07" in ln for ln in lines), lines


def test_rows_on_a_terminal_stdout_start_their_own_lines_under_the_progress_line(
    llmrun_env: dict[str, str],
) -> None:
    """`-o csv` on a terminal: stdout and the progress line share the screen; each row is
    written after the line is erased, so no row follows progress text. The terminal is wider
    than a row (560-670 characters): at 100 columns a row wrapped into screen lines whose
    first characters depend on the figures' lengths, and the check read a row's middle."""
    env = {**llmrun_env, "TERM": "xterm-256color"}
    code, written, lines = on_a_terminal(
        ["bench", "-p", "16", "-n", "16", "-r", "2", "-o", "csv", "--no-history"], env, 1200
    )
    assert code == 0, written[-2000:]
    rows = [ln for ln in lines if ",pp16," in ln or ",tg16," in ln or '"pp16"' in ln]
    assert len(rows) == 2, "\n".join(lines)
    assert all(ln.startswith(('"', "b")) or ln[0].isalnum() for ln in rows), "\n".join(lines)
    assert not any("ETA" in ln or "rep " in ln for ln in rows), "\n".join(rows)
