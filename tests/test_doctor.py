"""`llmrun --version` and `llmrun doctor`: what a bug report needs, from the real library."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmrun.cli.app import app

from .conftest import HANG_S, which_llmrun


def test_version_is_one_line_and_loads_no_llama_cpp(llmrun_env: dict[str, str]) -> None:
    code = (
        "import sys\nfrom llmrun.cli.app import app\n"
        "try:\n    app(['--version'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
        "assert 'llama_cpp' not in sys.modules, 'llama_cpp imported'\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S, env=llmrun_env
    )
    assert done.returncode == 0, done.stderr
    first = done.stdout.splitlines()[0]
    assert first.startswith("llmrun ") and "llama-cpp-python " in first and "Python " in first


def _doctor(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [which_llmrun(), "doctor"],
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.model
def test_doctor_reports_build_devices_features_and_its_choices(llmrun_env: dict[str, str]) -> None:
    done = _doctor(llmrun_env)
    assert done.returncode == 0, done.stderr
    rows = {line.split(" ", 1)[0]: line for line in done.stdout.splitlines()}
    for label in (
        "version",
        "build",
        "backend",
        "device",
        "cpu",
        "features",
        "load",
        "threads",
        "repack",
        "tuned",
    ):
        assert label in rows, done.stdout
    assert rows["tuned"].endswith(
        "none saved yet (" + llmrun_env["LLMRUN_HOME"] + "/config/tuned.json)"
    )
    assert "llama.cpp " in rows["build"] and "CPU" in rows["backend"]
    assert "physical cores" in rows["threads"] or "CPUs busy" in rows["threads"]
    assert "quiet:" in rows["load"] or "busy:" in rows["load"]
    assert "Q4_1" in rows["repack"] and ("on" in rows["repack"] or "off" in rows["repack"])


@pytest.mark.model
def test_doctor_shows_a_cached_reason_as_text_not_terminal_controls(
    llmrun_env: dict[str, str],
) -> None:
    """The probe's verdicts file is outside input: a reason holding a colour, a window title,
    a bell and a line break reached the terminal whole (run cleaned the same text)."""
    import json

    from llmrun.runners import probe

    cache = Path(llmrun_env["LLMRUN_HOME"]) / "state" / "repack-probe.json"
    cache.parent.mkdir(parents=True, exist_ok=True)
    key = probe.probe_key("Q4_1")  # this build's, this CPU's: no home in it
    why = "\x1b[31mRED\x1b]0;title\x07 \r\nSECOND LINE"
    cache.write_text(json.dumps({key: {"safe": False, "why": why}}))
    done = _doctor(llmrun_env)
    assert done.returncode == 0, done.stderr
    [repack] = [line for line in done.stdout.splitlines() if line.startswith("repack")]
    assert repack.endswith("(Q4_1): off: RED SECOND LINE"), repack
    assert not any(c in done.stdout for c in "\x1b\x07\r")


@pytest.mark.parametrize("kind", ["binary", "fifo"])
def test_doctor_names_a_tuned_file_run_and_chat_cannot_read(
    kind: str, llmrun_env: dict[str, str]
) -> None:
    """A binary or FIFO tuned.json stops run and chat at their start, and doctor exited 0
    without a word of it."""
    path = Path(llmrun_env["LLMRUN_HOME"]) / "config" / "tuned.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.write_bytes(b"\xff\xfe\x00garbage")
    done = _doctor(llmrun_env)
    assert done.returncode == 0, done.stderr
    [tuned] = [line for line in done.stdout.splitlines() if line.startswith("tuned")]
    assert f"unusable, so run and chat stop at their start: {path}: " in tuned, tuned
    assert ("not a regular file" if kind == "fifo" else "not UTF-8") in tuned, tuned


def test_flags_show_no_value_in_help(cli: CliRunner) -> None:
    result = cli.invoke(app, ["run", "--help"], env={"COLUMNS": "120"})
    assert result.exit_code == 0
    assert "--raw" in result.stdout and "<bool>" not in result.stdout
    assert "<int" in result.stdout or "INTEGER" in result.stdout  # values still say their type
