from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmrun.cli import engine
from llmrun.runners.llamacpp import EngineConfig, LlamaCppRunner
from llmrun.runners.models import default_model_path

from .fake import FakeRunner

ROOT = Path(__file__).resolve().parent.parent
LLMRUN = str(Path(sys.executable).parent / "llmrun")


@pytest.fixture(scope="session")
def model_path() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def runner(model_path: str) -> Iterator[LlamaCppRunner]:
    """One loaded real model shared by the engine tests (each test resets what it needs)."""
    r = LlamaCppRunner(model_path, EngineConfig(n_ctx=2048))
    r.load()
    yield r
    r.close()


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeRunner:
    """Route the CLI's runner factory to one FakeRunner and return it."""
    runner = FakeRunner()
    monkeypatch.setattr(engine, "RUNNER_FACTORY", lambda model, config: runner)
    return runner


@pytest.fixture
def cli() -> CliRunner:
    return CliRunner()


@pytest.fixture
def llmrun_env(tmp_path: Path) -> dict[str, str]:
    """Environment for subprocess runs: isolated HF cache, offline, no debug."""
    env = dict(os.environ)
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", NO_COLOR="1")
    env.pop("LLMRUN_DEBUG", None)
    env.pop("LLMRUN_MODEL", None)
    return env


def which_llmrun() -> str:
    return LLMRUN if os.path.exists(LLMRUN) else shutil.which("llmrun") or "llmrun"
