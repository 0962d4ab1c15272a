"""Build the runner a command uses. Tests swap `RUNNER_FACTORY` for a fake runner."""

from __future__ import annotations

from collections.abc import Callable

from llmrun.runners.base import Runner
from llmrun.runners.llamacpp import EngineConfig, LlamaCppRunner
from llmrun.runners.models import resolve_model
from llmrun.runners.tuning import apply_tuning


def _llamacpp(model: str | None, config: EngineConfig) -> Runner:
    resolved = resolve_model(model)
    return LlamaCppRunner(resolved.path, apply_tuning(config, resolved.path))


RUNNER_FACTORY: Callable[[str | None, EngineConfig], Runner] = _llamacpp


def make_runner(model: str | None, config: EngineConfig) -> Runner:
    return RUNNER_FACTORY(model, config)
