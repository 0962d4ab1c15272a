"""mypy must see llmrun.runners from cli/ and from the tests: deliberate type errors in a
scratch copy fail it, and nothing else does."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from .conftest import ROOT

BROKEN = """

def _deliberate(runner: Runner, finished: GenerationStats) -> None:
    runner.closee()
    print(finished.statz)
"""
BROKEN_TEST = """

def _deliberate(config: EngineConfig) -> int:
    return config.n_ctxx
"""


def test_mypy_sees_llmrun_runners_from_cli(tmp_path: Path, llmrun_env: dict[str, str]) -> None:
    copy = tmp_path / "repo"
    for name in ("cli", "runners", "typecheck", "tests", "benchmarks", "tools"):
        shutil.copytree(ROOT / name, copy / name, symlinks=True)
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    run_py = copy / "cli" / "run.py"
    run_py.write_text(run_py.read_text(encoding="utf-8") + BROKEN, encoding="utf-8")
    fake_py = copy / "tests" / "fake.py"
    fake_py.write_text(fake_py.read_text(encoding="utf-8") + BROKEN_TEST, encoding="utf-8")
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache")],
        cwd=copy,
        env=llmrun_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert '"Runner" has no attribute "closee"' in out, out
    assert '"GenerationStats" has no attribute "statz"' in out, out
    assert '"EngineConfig" has no attribute "n_ctxx"' in out, out
    assert "Found 3 errors in 2 files" in out, out  # nothing else: the real tree is clean


def test_renaming_an_option_of_chat_is_a_mypy_error(
    tmp_path: Path, llmrun_env: dict[str, str]
) -> None:
    """run and chat hand their options over in a typed record, never by name from locals():
    renaming chat's --top-k parameter must fail the type check, not the first chat."""
    copy = tmp_path / "repo"
    for name in ("cli", "runners", "typecheck", "tests", "benchmarks", "tools"):
        shutil.copytree(ROOT / name, copy / name, symlinks=True)
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    chat_py = copy / "cli" / "chat.py"
    source = chat_py.read_text(encoding="utf-8")
    assert source.count("    top_k: o.TopK") == 1
    chat_py.write_text(source.replace("    top_k: o.TopK", "    top_kay: o.TopK"), encoding="utf-8")
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache")],
        cwd=copy,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert "chat.py" in out and 'Name "top_k" is not defined' in out, out
