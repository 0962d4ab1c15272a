"""The real CLI in real processes: pipes, a pseudo-terminal, Ctrl-C, import cost."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pexpect
import pytest

from .conftest import HANG_S, which_llmrun


def sh(cmd: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-o", "pipefail", "-c", cmd],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def test_help_imports_nothing_heavy(llmrun_env: dict[str, str]) -> None:
    code = (
        "import sys, llmrun.cli.app as a\n"
        "from typer.testing import CliRunner\n"
        "for c in ('run', 'chat', 'bench', 'history', 'models', 'pull'):\n"
        "    r = CliRunner().invoke(a.app, [c, '--help'])\n"
        "    assert r.exit_code == 0, r.output\n"
        "heavy = ('llama_cpp', 'numpy', 'huggingface_hub', 'httpx2', 'matplotlib')\n"
        "heavy = [m for m in heavy if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=llmrun_env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == ""


def test_runners_never_import_the_terminal(llmrun_env: dict[str, str]) -> None:
    code = (
        "import sys, pkgutil, importlib, llmrun.runners as r\n"
        "for m in pkgutil.iter_modules(r.__path__): importlib.import_module(f'{r.__name__}.{m.name}')\n"
        "print([m for m in ('rich', 'typer') if m in sys.modules])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=llmrun_env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


def test_closed_stdout_ends_quietly(llmrun_env: dict[str, str]) -> None:
    cmd = f"{which_llmrun()} run 'Count from 1 to 100.' -n 200 --temp 0 -q | head -c 20"
    result = sh(cmd, llmrun_env)
    assert len(result.stdout) == 20
    assert result.stderr == ""
    check = sh(
        f"{which_llmrun()} run 'Count to 100' -n 200 --temp 0 | head -c 5; "
        'echo "status=${PIPESTATUS[0]}"',
        llmrun_env,
    )
    assert "status=141" in check.stdout
    assert "Traceback" not in check.stderr and "[stdout closed]" in check.stderr


def test_piped_text_in_any_language_and_no_escape_codes(llmrun_env: dict[str, str]) -> None:
    cmd = (
        f"printf 'Grüße 🎉 日本' | {which_llmrun()} run --raw -n 12 --temp 0.7 --seed 3"
        " --top-k 20 --top-p 0.9 --min-p 0.1 --repeat-penalty 1.2 --stop QQQ -c 512 -b 64"
        " --ubatch 32 -t 1 -ngl 0 --flash-attn on --no-repack --stats json"
    )
    result = sh(cmd, llmrun_env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() and "\x1b" not in result.stdout and "\x1b" not in result.stderr
    record = json.loads(result.stderr.strip().splitlines()[-1])
    settings = record["settings"]
    assert (settings["n_ctx"], settings["n_batch"], settings["n_ubatch"]) == (512, 64, 32)
    assert (settings["n_threads"], settings["flash_attn"], settings["repack"]) == (1, "on", False)
    assert record["seed"] == 3 and record["output_tokens"] > 0


@pytest.mark.parametrize(
    ("setup", "expected"),
    [
        ("", "llmrun: error: model file not found: {p}"),
        (
            "echo 'not a model at all, just text padding it out' > {p}",
            "llmrun: error: {p}: not a GGUF file (bad magic bytes)",
        ),
        ("head -c 3000000 {m} > {p}", "llmrun: error: {p}: truncated GGUF file"),
    ],
)
def test_bad_model_files(
    llmrun_env: dict[str, str], tmp_path: Path, model_path: str, setup: str, expected: str
) -> None:
    p = tmp_path / "m.gguf"
    if setup:
        sh(setup.format(p=p, m=model_path), llmrun_env)
    result = sh(f"{which_llmrun()} run hi -m {p}", llmrun_env)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected.format(p=p))


def test_ctrl_c_keeps_text_prints_interrupted_stats_exits_130(
    llmrun_env: dict[str, str], tmp_path: Path
) -> None:
    out = tmp_path / "out.txt"
    stats = tmp_path / "stats.jsonl"
    # stdout to a file, stderr on the terminal: what a user sees while redirecting output
    cmd = f"{which_llmrun()} run 'Write a very long story.' -n 2000 --temp 0 --stats-file {stats}"
    child = pexpect.spawn(
        "bash",
        ["-c", f"{cmd} > {out}"],
        env=llmrun_env,
        encoding="utf-8",
        timeout=HANG_S,
        dimensions=(40, 100),
    )
    deadline_text = ""
    deadline = time.monotonic() + HANG_S
    while len(deadline_text) <= 40:  # wait for the text, draining the terminal meanwhile
        assert child.isalive() and time.monotonic() < deadline, "no text was generated"
        child.expect([pexpect.TIMEOUT], timeout=0.1)
        deadline_text = out.read_text() if out.exists() else ""
    child.sendintr()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 130
    assert "[interrupted]" in child.before
    assert "prefill" in child.before and "tokens" in child.before  # the live status was drawn
    assert "Traceback" not in child.before
    kept = out.read_text()
    assert kept.startswith(deadline_text)
    assert '"finish_reason": "interrupted"' in stats.read_text()


@pytest.mark.parametrize("flag", ["", "--no-dashboard"])
def test_run_on_a_terminal_dashboard_or_plain_lines(llmrun_env: dict[str, str], flag: str) -> None:
    cmd = f"{which_llmrun()} run 'Name three colors.' -n 30 --temp 0 {flag}"
    child = pexpect.spawn(
        "bash", ["-c", cmd], env=llmrun_env, encoding="utf-8", timeout=HANG_S, dimensions=(40, 80)
    )
    child.expect(pexpect.EOF)
    child.close()
    out = child.before
    assert child.exitstatus == 0 and "Traceback" not in out
    assert "ttft" in out and ("output tok/s" in out or "vs output" in out)
    if flag:
        assert "rates    prompt" in out and "█" not in out and "━" not in out
    else:
        assert "prompt tok/s  █" in out and "prompt is" in out
        assert "━" in out  # the prefill progress bar was drawn live
    assert not re.search(r"\x1b\[(3[0-8]|9[0-7])[;m]", out)  # NO_COLOR is set: no colors
