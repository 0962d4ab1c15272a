"""The dashboard and chat as people use a terminal (pipes on a terminal, full contexts)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pexpect
import pyte
import pytest

from .conftest import HANG_S, ROOT, child_env, which_llmrun


def run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [which_llmrun(), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
        stdin=subprocess.DEVNULL,
    )


def test_output_cut_by_the_context_says_so(llmrun_env: dict[str, str], tmp_path: Path) -> None:
    """The summary's hint and the stats record (--stats-file: --stats json's record) of one
    run that fills the context: 256 tokens, the least llama.cpp makes."""
    prompt = "1, 2, 3, 4, 5, 6, 7, 8,"  # greedy counting does not stop by itself
    stats = tmp_path / "stats.jsonl"
    args = ["run", "--raw", "-c", "256", "--temp", "0", "-t", "1", "--no-dashboard"]
    cut = run([*args, "-n", "400", "--stats-file", str(stats), prompt], llmrun_env)
    assert cut.returncode == 0, cut.stderr
    assert "[context]: the 256-token context is full (raise -c/--ctx" in cut.stderr
    record = json.loads(stats.read_text().strip().splitlines()[-1])
    assert record["finish_reason"] == "context"
    assert record["prompt_tokens"] + record["output_tokens"] == record["settings"]["n_ctx"] + 1
    # -n reached first is still "length", with no hint
    short = run([*args, "-n", "5", prompt], llmrun_env)
    assert "5 tokens [length]" in short.stderr and "context is full" not in short.stderr


REDRAW = ("\x1b[1A", "\x1b[2K", "\x1b[A")  # cursor up / erase line: how a live panel redraws


@pytest.mark.parametrize("columns", [60, 100])
def test_piping_on_a_terminal_keeps_the_answer(
    llmrun_env: dict[str, str], tmp_path: Path, columns: int
) -> None:
    env = {**llmrun_env, "COLUMNS": str(columns), "TERM": "xterm-256color"}
    env.pop("NO_COLOR", None)
    base = f"{which_llmrun()} run --raw -n 40 --temp 0 '1, 2, 3, 4,'"

    def screen(command: str) -> str:
        child = pexpect.spawn(
            "bash",
            ["-c", command],
            env=env,
            dimensions=(40, columns),
            encoding="utf-8",
            timeout=HANG_S,
        )
        child.expect(pexpect.EOF)
        child.close()
        return str(child.before)

    piped = screen(base + " | cat")
    assert "5, 6, 7" in piped  # the answer, as cat printed it, is there ...
    assert not any(code in piped for code in REDRAW), repr(piped[-400:])  # ... and never redrawn
    assert "prefill" in piped and "tok/s" in piped  # the closing summary still comes
    # Control: into a file, the live panel runs (and the file gets the text).
    out = tmp_path / "out.txt"
    filed = screen(f"{base} > {out}")
    assert any(code in filed for code in REDRAW)
    assert "5, 6, 7" in out.read_text()


def test_prefill_counts_seconds_before_the_first_chunk_lands(llmrun_env: dict[str, str]) -> None:
    env = {**llmrun_env, "COLUMNS": "100", "TERM": "xterm-256color"}
    child = pexpect.spawn(
        which_llmrun(),
        [
            "run",
            "-f",
            str(ROOT / "examples" / "long_prompt.txt"),
            "-n",
            "2",
            "--temp",
            "0",
            "-b",
            "512",
        ],
        env=env,
        dimensions=(40, 100),
        encoding="utf-8",
        timeout=HANG_S,
    )
    # While the first 512-token chunk runs the count is 0/N, yet the clock moves ...
    child.expect(r"0/(\d+) tokens[^\n]*· ([\d,]+)\.\d ms")
    total, first = child.match.group(1), int(child.match.group(2).replace(",", ""))
    child.expect(rf"0/{total} tokens[^\n]*· ([\d,]+)\.\d ms")
    assert int(child.match.group(1).replace(",", "")) > first  # ... again, with the same count
    child.sendintr()  # seen: the rest of the prefill (12 s on one slow CPU) proves nothing more
    child.expect(pexpect.EOF)


def final_screen(args: list[str], env: dict[str, str], columns: int) -> list[str]:
    """Everything a terminal of this width shows at the end, scrollback included (pyte)."""
    screen = pyte.HistoryScreen(columns, 40, history=2000, ratio=0.5)
    stream = pyte.ByteStream(screen)
    child = pexpect.spawn(which_llmrun(), args, env=env, dimensions=(40, columns), timeout=HANG_S)
    while True:
        try:
            stream.feed(child.read_nonblocking(4096, timeout=HANG_S))
        except pexpect.EOF:
            break
    child.close()
    history = ["".join(ch.data for ch in row.values()).rstrip() for row in screen.history.top]
    return history + [line.rstrip() for line in screen.display]


@pytest.mark.parametrize("columns", [40, 60, 80, 120])
def test_the_live_panel_leaves_no_debris(llmrun_env: dict[str, str], columns: int) -> None:
    env = {**llmrun_env, "TERM": "xterm-256color"}
    env.pop("NO_COLOR", None)
    prompt = ", ".join(str(i) for i in range(1, 40)) + ","
    lines = final_screen(
        ["run", "--raw", "-n", "40", "--temp", "0", "-b", "16", prompt], env, columns
    )
    text = "\n".join(lines)
    assert not any(re.search(r"\d+/\d+ tokens", ln) for ln in lines), text  # no live prefill row
    assert sum(ln.startswith("load ") for ln in lines) == 1, text  # the summary's, once
    assert sum(ln.startswith("decode ") for ln in lines) == 1, text
    assert "40, 41, 42" in " ".join(text.split())  # the answer, whole


# A tmux server of this test run's own: another run on the machine (a second checkout's suite),
# or a session a killed run left, never holds the session name this one makes.
TMUX_SOCKET = f"llmrun-test-{os.getpid()}"


def tmux(*args: str) -> str:
    return subprocess.run(
        ["tmux", "-L", TMUX_SOCKET, *args], capture_output=True, text=True, check=True, timeout=30
    ).stdout


@pytest.mark.parametrize(("wide", "narrow"), [(120, 60), (80, 40)])
def test_resizing_mid_run_leaves_no_debris(
    llmrun_env: dict[str, str], tmp_path: Path, wide: int, narrow: int
) -> None:
    """tmux re-wraps lines when its window narrows, as most terminals do: the panel drawn at
    the old width takes more rows afterwards, and all of them must be cleared. The screen is
    full first, as a terminal in use is (on an empty one, tmux itself pushes the re-wrapped top
    rows into the scrollback, where no redraw reaches)."""
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed")
    env = {**llmrun_env, "TERM": "xterm-256color"}
    env.pop("NO_COLOR", None)
    env.pop("COLUMNS", None)
    env.pop("LINES", None)
    command = (
        f"seq 100; {which_llmrun()} run --raw -n 300 --temp 0 -t 1 '1, 2, 3, 4, 5,' > {tmp_path / 'out'}"
        f"; echo FINI''SHED"
    )
    tmux(
        "-f",
        "/dev/null",
        "new-session",
        "-d",
        "-s",
        "t",
        "-x",
        str(wide),
        "-y",
        "30",
        "env",
        *(f"{k}={v}" for k, v in env.items()),
        "bash",
        "--norc",
        "-i",
    )
    try:
        tmux("send-keys", "-t", "t", command, "Enter")
        deadline = time.monotonic() + HANG_S
        while "tok/s" not in tmux("capture-pane", "-p", "-t", "t"):  # decoding, panel up
            assert time.monotonic() < deadline, tmux("capture-pane", "-p", "-t", "t")
            time.sleep(0.1)
        tmux("resize-window", "-t", "t", "-x", str(narrow), "-y", "30")
        while "FINISHED" not in tmux("capture-pane", "-p", "-t", "t"):  # all drawn before it
            assert time.monotonic() < deadline, tmux("capture-pane", "-p", "-t", "t")
            time.sleep(0.2)
        lines = tmux("capture-pane", "-p", "-J", "-S", "-", "-t", "t").splitlines()
    finally:
        subprocess.run(["tmux", "-L", TMUX_SOCKET, "kill-server"], capture_output=True)
    text = "\n".join(lines)
    assert sum(ln.startswith("load ") for ln in lines) == 1, text  # the summary's, once
    assert sum(ln.startswith("decode ") for ln in lines) == 1, text
    assert not any(re.search(r"\d+/\d+ tokens", ln) for ln in lines), text


class Tmux:
    """A shell in a tmux window of a given width, driven as a person does: keys in, the
    screen (wrapped lines joined, as a copy from the terminal gives them) out."""

    def __init__(self, env: dict[str, str], columns: int, rows: int = 30) -> None:
        if shutil.which("tmux") is None:
            pytest.skip("tmux is not installed")
        self.socket = f"llmrun-test-{columns}-{time.monotonic_ns()}"
        env = {k: v for k, v in env.items() if k not in ("NO_COLOR", "COLUMNS", "LINES")}
        env["TERM"] = "xterm-256color"
        self(
            "-f",
            "/dev/null",
            "new-session",
            "-d",
            "-s",
            "t",
            "-x",
            str(columns),
            "-y",
            str(rows),
            "env",
            *(f"{k}={v}" for k, v in env.items()),
            "bash",
            "--norc",
            "-i",
        )
        self.keys("PS1='$ '", "Enter")

    def __call__(self, *args: str) -> str:
        return subprocess.run(
            ["tmux", "-L", self.socket, *args],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout

    def keys(self, *keys: str) -> None:
        self("send-keys", "-t", "t", *keys)

    def screen(self) -> str:
        return self("capture-pane", "-p", "-t", "t")

    def history(self) -> list[str]:
        joined = self("capture-pane", "-p", "-J", "-S", "-", "-t", "t")
        return [ln.rstrip() for ln in joined.rstrip("\n").splitlines()]

    def wait(self, seen: Callable[[str], bool], deadline_s: float = HANG_S) -> str:
        """Wait for the screen to show something; only a hang reaches the deadline."""
        end = time.monotonic() + deadline_s
        while not seen(screen := self.screen()):
            assert time.monotonic() < end, screen
            time.sleep(0.1)
        return screen

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True)


COUNT = "run --raw -n 160 --temp 0 -t 1 '1, 2, 3, 4, 5,'"


@pytest.fixture(scope="module")
def count_in_a_file(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """COUNT's answer written to a file, once for every width: greedy on one thread, it is
    the same text each time (the tests that use it request llmrun_env: marked pty)."""
    folder = tmp_path_factory.mktemp("count")
    env = child_env(folder)
    out = folder / "out.txt"
    with open(out, "w") as file:
        subprocess.run(
            [which_llmrun(), *shlex.split(COUNT), "-q"],
            env=env,
            stdout=file,
            stdin=subprocess.DEVNULL,
            timeout=HANG_S,
            check=True,
        )
    return out.read_text().rstrip("\n").splitlines()


@pytest.mark.pty
@pytest.mark.parametrize("columns", [40, 60, 80, 120])
def test_enter_during_a_reply_and_text_copied_from_the_screen(
    llmrun_env: dict[str, str], count_in_a_file: list[str], columns: int
) -> None:
    """Enter pressed while the reply streams does not move or repeat anything, and the answer
    on the screen is the answer in a file, line for line (the terminal wraps it, llmrun
    inserts no line break at the width)."""
    term = Tmux(llmrun_env, columns)
    try:
        term.keys(f"{which_llmrun()} {COUNT}; echo END''ED", "Enter")
        term.wait(lambda s: "tok/s" in s)  # the panel is up: decoding
        for _ in range(3):
            term.keys("Enter")
            time.sleep(0.2)
        term.wait(lambda s: "ENDED" in s)
        lines = term.history()
    finally:
        term.close()
    text = "\n".join(lines)
    answer = count_in_a_file
    assert answer and len(answer[0]) > columns  # a line the terminal has to wrap
    at = lines.index(answer[0])  # whole: no break inserted
    assert lines[at : at + len(answer)] == answer, text
    assert text.count(answer[0][:30]) == 1, text  # once, not twice
    assert sum(ln.startswith("decode ") for ln in lines) == 1, text
    assert not any(re.search(r"\d+/\d+ tokens", ln) for ln in lines), text  # no stale row
    assert [ln for ln in lines if ln][-1] == "$", text  # the typed Enters were drained


@pytest.mark.pty
def test_keys_and_ctrl_z_during_a_chat_reply_and_at_the_prompt(llmrun_env: dict[str, str]) -> None:
    """Enter pressed during a reply leaves no stale row or repeated line; what was typed
    meanwhile starts the next prompt; Ctrl-Z gives the shell a visible cursor, and after `fg`
    the reply goes on, and at the prompt, the prompt and its line are drawn again, each key
    echoed once."""
    term = Tmux(llmrun_env, 80)
    try:
        term.keys(f"{which_llmrun()} chat --temp 0 -n 300 -t 1 -c 2048", "Enter")
        term.wait(lambda s: s.rstrip().endswith(">>>"))
        term.keys("Write a very long story about a dragon and a knight.", "Enter")
        term.wait(lambda s: "· itl" in s)  # the reply streams under the panel
        term.keys("Enter")
        term.keys("Enter")
        term.keys("/sh")  # typed ahead, for the next prompt
        term.keys("C-z")
        screen = term.wait(lambda s: "Stopped" in s)
        assert term("display", "-p", "-t", "t", "#{cursor_flag}").strip() == "1", screen
        assert "tok/s · itl" not in screen  # the live panel left with the cursor
        term.keys("fg", "Enter")
        term.wait(lambda s: "context" in s and s.rstrip().endswith(">>> /sh"))
        term.keys("C-z")
        term.wait(lambda s: "Stopped" in s and s.rstrip().endswith("$"))
        term.keys("fg", "Enter")
        term.wait(lambda s: s.rstrip().endswith(">>> /sh"))  # the prompt is drawn again
        term.keys("ow info", "Enter")
        term.wait(lambda s: "context 2048" in s and s.rstrip().endswith(">>>"))
        term.keys("/bye", "Enter")
        term.wait(lambda s: s.rstrip().endswith("$"))
        lines = term.history()
    finally:
        term.close()
    text = "\n".join(lines)
    assert ">>> /show info" in lines, text  # typed once, echoed once
    assert "/sh/sh" not in text and "ow infoow info" not in text, text
    assert not any(ln.startswith(("prefill ", "decode ")) for ln in lines), text  # no stale row
    assert sum(ln.startswith("prompt ") and "TTFT" in ln for ln in lines) == 1, text
    assert [ln for ln in lines if ln.startswith(">>>")] == [
        ">>> Write a very long story about a dragon and a knight.",
        ">>> /sh",
        ">>> /show info",
        ">>> /bye",
    ], text  # the Enters typed during the reply sent nothing and drew no prompt


@pytest.mark.pty
def test_the_summary_survives_a_pipe_into_less(llmrun_env: dict[str, str]) -> None:
    """`| less -R`: nothing is drawn over less's screen; the stats come once it has quit."""
    env = {**llmrun_env, "TERM": "xterm-256color", "LESS": ""}
    env.pop("PAGER", None)
    if shutil.which("less") is None:
        pytest.skip("less is not installed")
    child = pexpect.spawn(
        "bash",
        ["-c", f"{which_llmrun()} {COUNT} | less -R"],
        env=env,
        dimensions=(30, 80),
        encoding="utf-8",
        timeout=HANG_S,
    )
    child.expect(r"\(END\)")  # less has all of stdout
    shown = str(child.before)
    assert "6, 7, 8" in shown and "tok/s" not in shown and "decode " not in shown
    child.send("q")
    child.expect(pexpect.EOF)
    child.close()
    after = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", str(child.before))
    assert re.search(r"decode +[\d,.]+ ms", after), after  # after less quit, on the screen
    assert child.exitstatus == 0


@pytest.mark.pty
def test_term_dumb_streams_plain_text_and_plain_stats(llmrun_env: dict[str, str]) -> None:
    """Emacs' shell and some IDE consoles: no live panel (rich would hold everything back
    until the end there), the text as it comes, the stats as plain lines."""
    env = {**llmrun_env, "TERM": "dumb"}
    args = ["run", "--raw", "-n", "160", "--temp", "0", "-t", "1", "1, 2, 3, 4, 5,"]
    child = pexpect.spawn(
        which_llmrun(), args, env=env, dimensions=(30, 80), encoding="utf-8", timeout=HANG_S
    )
    child.expect(pexpect.EOF)
    child.close()
    out = str(child.before)
    assert child.exitstatus == 0, out
    assert "\x1b" not in out, repr(out[:400])  # no cursor movement, no colour
    assert " 6, 7, 8, 9" in out
    assert re.search(r"^decode +[\d,.]+ ms", out, re.M) and "prompt is" in out
