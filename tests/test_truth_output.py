"""Say what happened (issue 29): a reader that closed stdout (`| head -3`) is `stdout closed`, not
`[interrupted]`; a Hub file name that would leave the repository (`-hff ../../etc/passwd.gguf`)
is refused in one line, not an internal error."""

from __future__ import annotations

import io
import threading

import pytest
from typer.testing import CliRunner

from llmrun.cli.app import app
from llmrun.cli.report import summary_lines
from llmrun.cli.session import TextOut, drive
from llmrun.runners.base import Request, SamplingParams
from llmrun.runners.errors import HubError
from llmrun.runners.models import resolve_model
from llmrun.runners.stats import FINISH_STDOUT_CLOSED

from .fake import FakeRunner


class ClosedAfter(io.StringIO):
    """A pipe whose reader leaves after `n` writes (as `head` does)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.left = n

    def write(self, text: str) -> int:
        if self.left <= 0:
            raise BrokenPipeError(32, "Broken pipe")
        self.left -= 1
        return super().write(text)


def test_a_closed_stdout_is_named_as_such() -> None:
    cancel = threading.Event()
    finished = drive(
        FakeRunner(reply="one two three four five six"),
        Request(prompt="x", sampling=SamplingParams(max_tokens=20)),
        out=TextOut(ClosedAfter(2), cancel=cancel),
        view=None,
        cancel=cancel,
    )
    stats = finished.stats
    assert stats.finish_reason == FINISH_STDOUT_CLOSED == "stdout closed"
    assert 2 <= stats.output_tokens < 6  # generation stopped soon after the reader left
    output = next(line for line in summary_lines(stats) if line.startswith("output"))
    assert output.endswith("tokens [stdout closed]"), output
    # Ctrl-C is still an interrupt
    cancel = threading.Event()
    cancel.set()
    stopped = drive(
        FakeRunner(reply="one two"),
        Request(prompt="x"),
        out=TextOut(io.StringIO(), cancel=cancel),
        view=None,
        cancel=cancel,
    )
    assert stopped.stats.finish_reason == "interrupted"


HOSTILE_FILES = {
    "../../etc/passwd.gguf": "a '..' part would leave the repository",
    "sub/../../x.gguf": "a '..' part would leave the repository",
    "/etc/passwd.gguf": "it is an absolute path",
    "C:x.gguf": "a drive letter is not a path inside the repository",
    "dir\\..\\x.gguf": "a backslash is not a path separator on the Hub",
    "a\x00b.gguf": "it holds a control character",
    "a\tb.gguf": "it holds a control character",
    "./x.gguf": "it has an empty or '.' part",
    "a//x.gguf": "it has an empty or '.' part",
}


@pytest.mark.parametrize("name", list(HOSTILE_FILES))
def test_a_hub_file_name_that_leaves_the_repository_is_refused(name: str) -> None:
    with pytest.raises(HubError) as refused:
        resolve_model(f"owner/repo/{name}")
    assert str(refused.value).startswith("owner/repo: '")
    assert str(refused.value).endswith(f"is not a file in the repository ({HOSTILE_FILES[name]})")
    assert not any(c in str(refused.value) for c in "\x00\t")


@pytest.mark.parametrize(
    "args",
    [
        ["run", "-m", "owner/repo/../../etc/passwd.gguf", "hi"],
        ["bench", "-hf", "owner/repo", "-hff", "../../etc/passwd.gguf"],
    ],
)
def test_the_refusal_is_one_line_from_every_command(args: list[str], cli: CliRunner) -> None:
    result = cli.invoke(app, args)
    assert result.exit_code == 1, result.output
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("llmrun: error:")]
    assert len(errors) == 1 and "internal error" not in result.stderr, result.stderr
    assert "'../../etc/passwd.gguf' is not a file in the repository" in errors[0]
