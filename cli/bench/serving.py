"""What `bench serve` and `bench interference` share: their common options, the server or
this machine's engine that a job measures, and how a job shows its stages."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

from llmrun.cli import options as o
from llmrun.cli.engine import make_bench_runner, remote_runner
from llmrun.cli.errors import LineConsole, StdoutConsole
from llmrun.cli.progress import ProgressLine, Shown, tally_view
from llmrun.cli.records import OptionRecord
from llmrun.cli.terminal import terminal_line
from llmrun.runners.config import EngineConfig
from llmrun.runners.errors import BadRequestError
from llmrun.runners.limits import engine_bounds
from llmrun.runners.llamacpp import LlamaCppRunner
from llmrun.runners.serving.options import Stage

from . import output as out

if TYPE_CHECKING:
    from llmrun.runners.remote import OpenAIRunner

LOAD = "Load (vLLM's random dataset, or --dataset)"
LOCAL = "This machine's engine (without --endpoint)"


def _opt(help_text: str, *names: str, panel: str = LOAD, **kw: Any) -> Any:
    return typer.Option(*names, help=help_text, rich_help_panel=panel, **kw)


Model1 = Annotated[
    str | None,
    typer.Option(
        "-m",
        "--model",
        envvar="LLMRUN_MODEL",
        help="A .gguf path or Hub reference; with --endpoint, the server's model"
        " (default: the embedded SmolLM2-135M, or the server's first).",
    ),
]
Output = Annotated[
    out.OutputFormat | None,
    typer.Option(
        "-o",
        "--output",
        help="Print the results on stdout as md, csv, json, jsonl or sql."
        " (default: a table on a terminal, else md)",
    ),
]
Policies = Annotated[
    str,
    _opt(
        "Scheduling policies: prefill-first, chunked:B (at most B tokens a step),"
        " decode-first. (default: all three)",
        "--policy",
        panel=LOCAL,
        show_default=False,
    ),
]


@dataclass(frozen=True, kw_only=True)
class ServingEngineOptions(OptionRecord):
    """This machine's engine for a serving job: its threads and KV layout."""

    threads: Annotated[
        int | None,
        _opt(
            "CPU threads of the engine: one token a step. (default: the physical cores)",
            "-t",
            "--threads",
            panel=LOCAL,
            **engine_bounds("n_threads"),
        ),
    ] = None
    threads_batch: Annotated[
        int | None,
        _opt(
            "CPU threads for steps of more than one token (prefill). (default: --threads)",
            "-tb",
            "--threads-batch",
            panel=LOCAL,
            **engine_bounds("n_threads_batch"),
        ),
    ] = None
    kv_unified: Annotated[
        bool | None,
        _opt(
            "One KV buffer for all sequences (llama.cpp's -kvu), or each its own KV stream"
            " (--no-kv-unified), as llama.cpp's contexts and llama-batched-bench do. Recorded as"
            " kv_unified. (default: one stream per sequence)",
            "-kvu/-no-kvu",
            "--kv-unified/--no-kv-unified",
            panel=LOCAL,
        ),
    ] = None

    def refuse_for(self, endpoint: str | None) -> None:
        """With --endpoint the server's own settings decide."""
        o.refuse_for_endpoint(
            endpoint,
            {
                "-t/--threads": self.threads,
                "-tb/--threads-batch": self.threads_batch,
                "-kvu/--kv-unified": None if self.kv_unified is None else "given",
            },
        )


def refuse_remote_only(remote: o.RemoteOptions, given: Mapping[str, object]) -> None:
    """Without --endpoint: --api-key, --timeout and `given` have no server to apply to."""
    o.refuse_given(
        {"--api-key": remote.api_key, "--timeout": remote.timeout != o.TIMEOUT_S, **given},
        "only with --endpoint",
    )


def local_runner(model: str | None, job: str, engine: ServingEngineOptions) -> LlamaCppRunner:
    """This machine's engine for a serving job (512 tokens per sequence, untuned)."""
    config = EngineConfig(
        n_ctx=512,
        n_threads=engine.threads,
        n_threads_batch=engine.threads_batch,
        kv_unified=engine.kv_unified is True,
    )
    runner = make_bench_runner(model, config, tuned=False)
    if not isinstance(runner, LlamaCppRunner):
        raise BadRequestError(f"{job} needs a local model")
    return runner


def stage_view(stage: Stage) -> Callable[[float], Shown]:
    """A stage's progress line: its count where it has one, else the time it has taken."""
    if stage.tally is not None:
        return tally_view(stage.text, stage.unit, stage.tally)
    started = time.monotonic()
    return lambda now: Shown(stage.text, 0, 0, "", now - started, None)


def run_stages(events: Iterator[Any], err: Console, first: str) -> Iterator[Any]:
    """The runner's results, with the stage under way as a progress line on stderr: requests
    done of total, the time it took and an estimate of the time left (a terminal's line is
    erased before anything else is printed; elsewhere a line as each counted stage starts)."""
    with ProgressLine(err, plain_lines=True) as line:
        line.follow(first, stage_view(Stage(first)))
        for event in events:
            if isinstance(event, Stage):
                line.follow(event.text, stage_view(event))
            else:
                line.stop()
                yield event


@dataclass(frozen=True)
class Screen:
    """Where a job shows itself: progress and messages, results, and its Ctrl-C flag."""

    err: Console
    show: Console
    cancel: threading.Event

    @classmethod
    def open(cls, output: out.OutputFormat | None) -> Screen:
        """Progress on stderr; results on stdout where it is a terminal and no format is
        asked, else on stderr with the progress (stdout carries the formatted records)."""
        err = LineConsole(stderr=True, highlight=False)
        show = StdoutConsole(highlight=False) if output is None and sys.stdout.isatty() else err
        return cls(err, show, threading.Event())


@dataclass(frozen=True)
class Server:
    """The OpenAI-compatible server a job measures."""

    endpoint: str
    model: str | None
    api_key: str | None
    timeout_s: float

    def connect(self, err: Console, connections: int | None = None) -> tuple[OpenAIRunner, str]:
        """The server's runner, connected, and its model's name; its line on stderr."""
        extra = {} if connections is None else {"max_connections": connections}
        runner = remote_runner(
            self.endpoint, model=self.model, api_key=self.api_key, timeout_s=self.timeout_s, **extra
        )
        try:
            loaded = runner.load()
        except BaseException:
            runner.close()
            raise
        name = runner.model_name or loaded.name
        err.print(  # the model's name is the server's: no escape sequence shown
            f"server   {terminal_line(runner.endpoint)} · model {terminal_line(name)}"
            f" · connect {loaded.load_s * 1000:.1f} ms",
            markup=False,
        )
        return runner, name
