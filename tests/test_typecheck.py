"""mypy must see llmrun.runners from cli/ and from the tests: deliberate type errors in a
scratch copy fail it, and nothing else does."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from .conftest import HANG_S, ROOT

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
        timeout=HANG_S,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert '"Runner" has no attribute "closee"' in out, out
    assert '"GenerationStats" has no attribute "statz"' in out, out
    assert '"EngineConfig" has no attribute "n_ctxx"' in out, out
    assert "Found 3 errors in 2 files" in out, out  # nothing else: the real tree is clean


def test_renaming_an_option_is_a_mypy_error(tmp_path: Path, llmrun_env: dict[str, str]) -> None:
    """Commands take their options as typed records whose fields are the declarations, never
    by name from locals(): renaming the --top-k field must fail the type check where the record
    is read, not the first chat."""
    copy = tmp_path / "repo"
    for name in ("cli", "runners", "typecheck", "tests", "benchmarks", "tools"):
        shutil.copytree(ROOT / name, copy / name, symlinks=True)
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    options_py = copy / "cli" / "options.py"
    source = options_py.read_text(encoding="utf-8")
    assert source.count("    top_k: TopK") == 1
    options_py.write_text(source.replace("    top_k: TopK", "    top_kay: TopK"), encoding="utf-8")
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache")],
        cwd=copy,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert "options.py" in out and '"SamplingOptions" has no attribute "top_k"' in out, out
