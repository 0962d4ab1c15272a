"""Build the runner a command uses: the one place runners are made. Tests swap the factories
for fakes."""

from __future__ import annotations

from collections.abc import Callable

from llmrun.runners.base import BenchRunner, Runner
from llmrun.runners.llamacpp import EngineConfig, LlamaCppRunner
from llmrun.runners.models import resolve_model
from llmrun.runners.tuning import apply_tuning


def _llamacpp(model: str | None, config: EngineConfig) -> Runner:
    resolved = resolve_model(model)
    return LlamaCppRunner(resolved.path, apply_tuning(config, resolved.path))


def _llamacpp_bench(model: str | None, config: EngineConfig, tuned: bool) -> BenchRunner:
    """bench's runner: tuned settings (unless --no-tuned) fill only what the sweep does not set."""
    resolved = resolve_model(model)
    return LlamaCppRunner(resolved.path, apply_tuning(config, resolved.path) if tuned else config)


RUNNER_FACTORY: Callable[[str | None, EngineConfig], Runner] = _llamacpp
BENCH_RUNNER_FACTORY: Callable[[str | None, EngineConfig, bool], BenchRunner] = _llamacpp_bench


def make_bench_runner(
    model: str | None, config: EngineConfig, *, tuned: bool = True
) -> BenchRunner:
    """A local runner whose settings a sweep can change between tests."""
    return BENCH_RUNNER_FACTORY(model, config, tuned)


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
