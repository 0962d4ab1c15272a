"""`llmrun` with fake bench models, as a process: `python -m tests.fake_bench bench -m a ...`.

Model "block" waits in its first test until the run is cancelled (SIGTERM, Ctrl-C), so a test
can read the rows printed before it while the process provably still runs; "/nonexistent.gguf"
is not found. Any other name is a FakeBenchRunner.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator

from llmrun.cli import engine
from llmrun.cli.main import main
from llmrun.runners.base import Event, Request
from llmrun.runners.config import EngineConfig
from llmrun.runners.errors import ModelNotFoundError

from .fake import FakeBenchRunner


class BlockingFake(FakeBenchRunner):
    def stream(self, request: Request, *, cancel: threading.Event | None = None) -> Iterator[Event]:
        if cancel is not None:
            cancel.wait()
        yield from super().stream(request, cancel=cancel)


def make(model: str | None, config: EngineConfig, tuned: bool) -> FakeBenchRunner:
    if model == "/nonexistent.gguf":
        raise ModelNotFoundError(model)
    fake = BlockingFake() if model == "block" else FakeBenchRunner()
    fake.model_path = f"/fake/{model or 'a'}.gguf"
    return fake


def fake_bench_argv(*args: str) -> list[str]:
    """`llmrun bench -r 1 -p 8 -n 2` with these fakes, as a process, and `args` after it."""
    return [
        sys.executable,
        "-m",
        "tests.fake_bench",
        "bench",
        "-r",
        "1",
        "-p",
        "8",
        "-n",
        "2",
        *args,
    ]


if __name__ == "__main__":
    engine.BENCH_RUNNER_FACTORY = make  # type: ignore[assignment]  # a fake, as monkeypatch sets it
    main()
