"""mypy must see llmrun.runners from cli/ and from the tests: deliberate type errors in a
scratch copy fail it, and nothing else does.

Both tests check one copy of the tree with one mypy cache (a module's fixture), seeded with
`make lint`'s where it ran (`make test` runs it first): mypy then checks only what an edit
touches and what depends on it, as `make lint` does after an edit; without it, the first run
checks everything. mypy trusts a cached module where its file's mtime and size match (and
hashes the content where only the mtime differs); the copy keeps the mtimes, and each edit
changes its file's size, so no stale entry is trusted."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest

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

# Edits (a file of the copy and what its text becomes), the environment -> mypy's exit code
# and output.
Mypy = Callable[[dict[str, Callable[[str], str]], dict[str, str]], tuple[int, str]]


@pytest.fixture(scope="module")
def mypy_on_copy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mypy]:
    """mypy over a copy of the tree with the edits made, then the files put back."""
    work = tmp_path_factory.mktemp("typecheck")
    copy = work / "repo"
    for name in ("cli", "runners", "typecheck", "tests", "benchmarks", "tools"):
        shutil.copytree(ROOT / name, copy / name, symlinks=True)
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    if (ROOT / ".mypy_cache").is_dir():  # make lint's, when it ran
        try:
            shutil.copytree(ROOT / ".mypy_cache", work / "cache", symlinks=True)
        except OSError:  # a mypy writing it meanwhile (shutil.Error too): start from nothing
            shutil.rmtree(work / "cache", ignore_errors=True)

    def run(edits: dict[str, Callable[[str], str]], env: dict[str, str]) -> tuple[int, str]:
        originals = {name: (copy / name).read_text(encoding="utf-8") for name in edits}
        try:
            for name, edit in edits.items():
                (copy / name).write_text(edit(originals[name]), encoding="utf-8")
            result = subprocess.run(
                [sys.executable, "-m", "mypy", "--cache-dir", str(work / "cache")],
                cwd=copy,
                env=env,
                capture_output=True,
                text=True,
                timeout=HANG_S,
            )
        finally:
            for name, text in originals.items():
                (copy / name).write_text(text, encoding="utf-8")
        return result.returncode, result.stdout + result.stderr

    yield run


def test_mypy_sees_llmrun_runners_from_cli(mypy_on_copy: Mypy, llmrun_env: dict[str, str]) -> None:
    code, out = mypy_on_copy(
        {
            "cli/run.py": lambda text: text + BROKEN,
            "tests/fake.py": lambda text: text + BROKEN_TEST,
        },
        llmrun_env,
    )
    assert code == 1, out
    assert '"Runner" has no attribute "closee"' in out, out
    assert '"GenerationStats" has no attribute "statz"' in out, out
    assert '"EngineConfig" has no attribute "n_ctxx"' in out, out
    assert "Found 3 errors in 2 files" in out, out  # nothing else: the real tree is clean


def test_renaming_an_option_is_a_mypy_error(mypy_on_copy: Mypy, llmrun_env: dict[str, str]) -> None:
    """Commands take their options as typed records whose fields are the declarations, never
    by name from locals(): renaming the --top-k field must fail the type check where the record
    is read, not the first chat."""

    def rename(source: str) -> str:
        assert source.count("    top_k: TopK") == 1
        return source.replace("    top_k: TopK", "    top_kay: TopK")

    code, out = mypy_on_copy({"cli/options.py": rename}, llmrun_env)
    assert code == 1, out
    assert "options.py" in out and '"SamplingOptions" has no attribute "top_k"' in out, out
