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


def make_runner(
    model: str | None,
    config: EngineConfig,
    *,
    endpoint: str | None = None,
    api_key: str | None = None,
    timeout_s: float = 60.0,
) -> Runner:
    """The local engine, or with an endpoint the OpenAI-compatible server there."""
    if endpoint:
        from llmrun.runners.remote import OpenAIRunner

        return OpenAIRunner(endpoint, model=model, api_key=api_key, timeout_s=timeout_s,
                            n_ctx=config.n_ctx)  # fmt: skip
    return RUNNER_FACTORY(model, config)
