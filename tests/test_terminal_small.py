"""Small and plain terminals: TERM=dumb says what runs during load and prefill and folds its
lines at spaces; one-off lines fold the same way; the live panel keeps its figures on a small
screen and leaves no stale rows behind."""

from __future__ import annotations

import re
import subprocess
import time

import pexpect
import pyte
import pytest

from llmrun.cli.terminal import fold, set_verbose, terminal_line, terminal_text

from .conftest import HANG_S, which_llmrun


def test_fold_breaks_at_spaces_only_and_only_on_a_terminal() -> None:
    line = "ttft     1,109.8 ms = template+tokenize 40.3 ms + prefill 1,068.9 ms + first sample"
    assert fold(line, None) == line  # a pipe or a file: data, whole
    folded = fold(line, 40, indent=9).splitlines()
    assert all(len(row) < 40 for row in folded)
    assert folded[1].startswith(" " * 9) and not folded[1].startswith(" " * 10)
    assert " ".join(" ".join(folded).split()) == " ".join(line.split())
    assert fold("short", 40) == "short"
    assert fold("x" * 60, 40) == "x" * 60  # a word longer than the line stays whole


def screen_of(args: list[str], env: dict[str, str], rows: int, columns: int) -> list[str]:
    """The whole screen at the end, scrollback included (pyte)."""
    screen = pyte.HistoryScreen(columns, rows, history=4000, ratio=0.5)
    stream = pyte.ByteStream(screen)
    child = pexpect.spawn(which_llmrun(), args, env=env, dimensions=(rows, columns), timeout=HANG_S)
    while True:
        try:
            stream.feed(child.read_nonblocking(4096, timeout=HANG_S))
        except pexpect.EOF:
            break
    child.close()
    history = ["".join(ch.data for ch in row.values()).rstrip() for row in screen.history.top]
    return history + [line.rstrip() for line in screen.display]


@pytest.mark.parametrize("tty", [True, False])
def test_bench_v_echoes_llama_cpps_log_safe_on_a_terminal_and_as_it_came_elsewhere(
    tty: bool, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """runners/library.py wrote llama.cpp's log to stderr itself (bench -v): a model file's
    name with a window-title sequence in it reached the terminal raw. The CLI's echo filters it
    on a terminal; a file or pipe gets the log as it came, as data."""
    from llmrun.runners import library

    monkeypatch.setattr(library, "echo_log", None)
    monkeypatch.setattr("os.isatty", lambda fd: tty)
    line = b"print_info: general.name = m\x1b]0;owned\x07x\x1b[2J\n"
    library._log(2, line, None)  # off: LOG_LINES alone
    set_verbose(True)
    library._log(2, line, None)
    set_verbose(False)
    library._log(2, line, None)
    said = capfd.readouterr().err
    assert said == ("print_info: general.name = mx\n" if tty else line.decode())
    assert library.LOG_LINES[-1] == line.decode()


@pytest.mark.parametrize("columns", [40, 60])
def test_term_dumb_says_load_and_prefill_and_folds_at_spaces(
    llmrun_env: dict[str, str], columns: int
) -> None:
    env = {**llmrun_env, "TERM": "dumb"}
    args = ["run", "--raw", "-n", "12", "--temp", "0", "-t", "1", "1, 2, 3, 4, 5,"]
    lines = screen_of(args, env, 15, columns)
    text = "\n".join(lines)
    loading = next(i for i, ln in enumerate(lines) if ln.startswith("llmrun: loading "))
    prefill = next(i for i, ln in enumerate(lines) if ln.startswith("llmrun: prefill of "))
    answer = next(i for i, ln in enumerate(lines) if "6, 7" in ln)
    assert loading < prefill < answer, text
    summary = lines[next(i for i, ln in enumerate(lines) if ln.startswith("model ")) :]
    assert all(len(ln) < columns for ln in summary), text  # none folded by the terminal
    rows = [ln for ln in summary if ln and not ln.startswith(" ")]
    assert re.search(r"^ttft +[\d,.]+ ms", "\n".join(rows), re.M), text
    ttft = " ".join(" ".join(summary).split())
    assert "first sample" in ttft, text  # words whole: never `first sam` / `ple`


@pytest.mark.parametrize(("rows", "columns"), [(15, 40), (24, 60)])
def test_the_live_panel_keeps_decode_in_every_frame_of_a_small_screen(
    llmrun_env: dict[str, str], rows: int, columns: int
) -> None:
    env = {**llmrun_env, "TERM": "xterm-256color"}
    env.pop("NO_COLOR", None)
    prompt = ", ".join(str(i) for i in range(1, 40)) + ","
    args = ["run", "--raw", "-n", "40", "--temp", "0", "-b", "16", "-t", "1", prompt]
    screen = pyte.HistoryScreen(columns, rows, history=4000, ratio=0.5)
    stream = pyte.ByteStream(screen)
    child = pexpect.spawn(which_llmrun(), args, env=env, dimensions=(rows, columns), timeout=HANG_S)
    frames: list[list[str]] = []  # the screen each time the output settles (no redraw cut)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            stream.feed(child.read_nonblocking(1 << 16, timeout=0.1))
        except pexpect.TIMEOUT:
            frames.append([line.rstrip() for line in screen.display])
        except pexpect.EOF:
            break
    child.close()
    assert child.exitstatus == 0
    live = [
        i
        for i, f in enumerate(frames)
        if any(re.match(r"decode +\d+ tokens · ", ln) for ln in f)  # the summary's is in ms
    ]
    assert live, "\n".join(frames[-1])
    for frame in frames[live[0] : live[-1] + 1]:  # every redraw while decoding: the row, and
        assert any(ln.startswith("decode ") for ln in frame), "\n".join(frame)
        assert "..." not in frame, "\n".join(frame)  # never rich's crop mark
    history = ["".join(ch.data for ch in row.values()).rstrip() for row in screen.history.top]
    lines = history + [line.rstrip() for line in screen.display]
    text = "\n".join(lines)
    assert sum(ln.startswith("load ") for ln in lines) == 1, text  # the summary's, no stale one
    assert sum(ln.startswith("decode ") for ln in lines) == 1, text
    answer = [ln for ln in lines if re.fullmatch(r"[\d, ]+", ln) and ln.count(",") > 2]
    assert len(answer) == len(set(answer)), text  # no tail of the answer shown twice


def test_one_off_lines_fold_at_spaces_on_a_terminal_and_stay_whole_in_a_pipe(
    llmrun_env: dict[str, str],
) -> None:
    env = {**llmrun_env, "TERM": "dumb", "COLUMNS": "40"}
    lines = screen_of(["doctor"], env, 40, 40)
    found = [ln for ln in lines if ln]
    folded_by_terminal = [ln for ln in found if len(ln) >= 40 and " " in ln.strip()]
    assert found and not folded_by_terminal, "\n".join(
        lines
    )  # (not a lone word longer than a line)
    assert any(ln.startswith(" " * 10) and ln[10] != " " for ln in found)  # under the value
    piped = subprocess.run(
        [which_llmrun(), "doctor"], env=env, capture_output=True, text=True, timeout=HANG_S
    )
    assert piped.returncode == 0 and any(len(ln) > 40 for ln in piped.stdout.splitlines())


def test_bidirectional_overrides_are_taken_out_and_right_to_left_text_kept() -> None:
    """A file named `evil\u202etxt.exe` shows as "evilexe.txt" where the terminal orders text by
    direction (Trojan Source); the embeddings, overrides and isolates go, the marks stay."""
    assert terminal_text("evil\u202etxt.exe") == "eviltxt.exe"
    assert terminal_line("a\u202ab\u202bc\u202cd\u202de\u2066f\u2067g\u2068h\u2069") == "abcdefgh"
    assert terminal_text("\u05e9\u05dc\u05d5\u05dd \u200f(1)\u200e \u061c") == (
        "\u05e9\u05dc\u05d5\u05dd \u200f(1)\u200e \u061c"
    )
