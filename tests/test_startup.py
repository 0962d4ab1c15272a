"""A CLI that answers at once: `--help`, `--version` and the commands that run no model import
none of the heavy libraries, and `--help` lists the commands without importing them."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

from llmrun.cli import app as app_module

from .conftest import HANG_S

HEAVY = ("llama_cpp", "numpy", "fastapi", "starlette", "uvicorn", "matplotlib", "huggingface_hub")

# What each command line may import of HEAVY, and why.
ALLOWED: dict[str, set[str]] = {
    "--help": set(),
    "--version": set(),
    "history": set(),
    "doctor": set(),
    # `models` reads the Hugging Face cache's layout itself (runners/hub_cache.py).
    "models": set(),
}


def imported(args: list[str], env: dict[str, str]) -> tuple[set[str], set[str]]:
    """The packages (top-level names) and the llmrun modules a command line imported, as
    `python -X importtime` lists them."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "llmrun.cli.main", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    names = [
        line.rsplit("|", 1)[1].strip()
        for line in done.stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    ]
    return {n.split(".", 1)[0] for n in names}, {n for n in names if n.startswith("llmrun.")}


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["models"], ["history"], ["doctor"]])
def test_no_heavy_library_at_start_up(args: list[str], llmrun_env: dict[str, str]) -> None:
    packages, _ = imported(args, llmrun_env)
    heavy = (packages & set(HEAVY)) - ALLOWED[args[0]]
    assert not heavy, f"llmrun {' '.join(args)} imported {sorted(heavy)}"


def test_help_imports_no_command(llmrun_env: dict[str, str]) -> None:
    _, modules = imported(["--help"], llmrun_env)
    commands = {module for module, _ in app_module.COMMANDS.values()}
    assert not modules & commands, sorted(modules & commands)


def test_every_command_has_its_summary() -> None:
    assert list(app_module.SUMMARIES) == list(app_module.COMMANDS)


@pytest.mark.parametrize("name", list(app_module.COMMANDS))
def test_each_summary_is_its_commands_own_help(name: str) -> None:
    """`llmrun --help` lists SUMMARIES without importing the commands: each line is the first
    paragraph of the help that the command itself shows, on one line (a docstring's line break
    kept there broke the listing mid-sentence: "threads for this" / "model; save ...")."""
    command = app_module.build_command(name)
    first = inspect.cleandoc(command.help or "").split("\n\n")[0]
    assert app_module.SUMMARIES[name] == " ".join(first.split())


def test_run_measures_the_load_over_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """run and chat choose threads by other processes' load; its sample starts when llmrun
    does (main), so after a start-up of a quarter second or more they wait no longer."""
    import time

    import llmrun.cli
    from llmrun.cli import session
    from llmrun.runners import system

    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    monkeypatch.setattr(system, "background_override", None)
    now = system.cpu_sample()
    if now is None:
        pytest.skip("no /proc/stat here")
    long_ago = system.CpuSample(now.wall_s - 0.5, now.busy_s - 1.0, now.own_s)
    monkeypatch.setattr(llmrun.cli, "cpu_at_start", long_ago)
    background = session._background_since_start()
    assert slept == [] and background is not None and background >= 0.0
    just_now = system.CpuSample(time.perf_counter() - 0.1, now.busy_s, now.own_s)
    monkeypatch.setattr(llmrun.cli, "cpu_at_start", just_now)
    session._background_since_start()
    assert len(slept) == 1 and 0.1 <= slept[0] <= 0.15  # the rest of the quarter second
