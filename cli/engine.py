"""Build the runner a command uses: the one place runners are made. Tests swap the factories
for fakes."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import llmrun.cli
from llmrun.runners.base import BenchRunner, Runner
from llmrun.runners.bench.tuned import apply_tuning
from llmrun.runners.config import EngineConfig
from llmrun.runners.llamacpp import LlamaCppRunner
from llmrun.runners.models import resolve_model

if TYPE_CHECKING:
    from llmrun.runners.remote import OpenAIRunner


def _llamacpp(model: str | None, config: EngineConfig) -> Runner:
    return _llamacpp_bench(model, config, tuned=True)


def _llamacpp_bench(model: str | None, config: EngineConfig, tuned: bool) -> BenchRunner:
    """bench's runner: tuned settings (unless --no-tuned) fill only what the sweep does not set."""
    resolved = resolve_model(model)
    return LlamaCppRunner(resolved.path, apply_tuning(config, resolved.path) if tuned else config)


RUNNER_FACTORY: Callable[[str | None, EngineConfig], Runner] = _llamacpp
BENCH_RUNNER_FACTORY: Callable[[str | None, EngineConfig, bool], BenchRunner] = _llamacpp_bench


_noted = False


def note_unused_gpu() -> None:
    """Once per process: a GPU this CPU-only build cannot use is named, with the rebuild."""
    global _noted
    if _noted:
        return
    _noted = True
    from llmrun.runners import devices
    from llmrun.runners.library import llama_c_library  # not the bindings: run starts at once

    note = devices.unused_gpu_note(
        devices.host_gpus(), bool(llama_c_library().llama_supports_gpu_offload())
    )
    if note:
        print(f"llmrun: note: {note}", file=sys.stderr, flush=True)


def make_bench_runner(
    model: str | None, config: EngineConfig, *, tuned: bool = True
) -> BenchRunner:
    """A local runner whose settings a sweep can change between tests."""
    note_unused_gpu()
    return BENCH_RUNNER_FACTORY(model, config, tuned)


def make_runner(
    model: str | None,
    config: EngineConfig,
    *,
    endpoint: str | None = None,
    api_key: str | None = None,
    timeout_s: float = 60.0,
    prepare: Callable[[EngineConfig], EngineConfig] | None = None,
) -> Runner:
    """The local engine, or with an endpoint the OpenAI-compatible server there.

    `prepare` adjusts the settings once the model is found (run and chat's thread choice, which
    probes the machine and says so): a missing model is the first and only thing said."""
    if endpoint:
        config = prepare(config) if prepare else config
        return remote_runner(
            endpoint, model=model, api_key=api_key, timeout_s=timeout_s, n_ctx=config.n_ctx
        )
    if model:
        model = resolve_model(model).path  # the factory's own resolution is then a path's
    config = prepare(config) if prepare else config
    note_unused_gpu()
    return RUNNER_FACTORY(model, config)


def _local_model_from_environment(model: str | None) -> bool:
    """LLMRUN_MODEL naming a GGUF file here is the local engine's model: against a server it
    was sent as the server's model name (`HTTP 404 ... model '/x.gguf' is not served here`).
    A name (`llama3`) from the variable still names the server's model; typed, -m always does."""
    if model is None or not {"-m", "--model"} & llmrun.cli.from_environment:
        return False
    return model.lower().endswith(".gguf") or os.path.isfile(os.path.expanduser(model))


def remote_runner(
    endpoint: str,
    *,
    model: str | None,
    api_key: str | None,
    timeout_s: float,
    n_ctx: int | None = None,
    max_connections: int = 100,
) -> OpenAIRunner:
    """The runner of an OpenAI-compatible server, for run and chat and the serving jobs alike
    (httpx is imported only when a server is used)."""
    from llmrun.runners.remote import OpenAIRunner

    return OpenAIRunner(
        endpoint,
        model=None if _local_model_from_environment(model) else model,
        api_key=api_key,
        timeout_s=timeout_s,
        n_ctx=n_ctx,
        max_connections=max_connections,
    )
