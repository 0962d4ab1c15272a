"""`llmrun bench serve`: serving load with vLLM's metrics, against a server (--endpoint) or this
machine's engine under each scheduling policy. The measuring is in runners/serving/."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from llmrun.cli import options as o
from llmrun.cli.engine import make_bench_runner
from llmrun.cli.errors import EXIT_INTERRUPTED, StdoutConsole, handled
from llmrun.cli.progress import ProgressLine, Shown, tally_view
from llmrun.cli.report import Fitted, fitted
from llmrun.cli.session import ctrl_c_cancels
from llmrun.runners.config import EngineConfig
from llmrun.runners.errors import BadRequestError
from llmrun.runners.llamacpp import LlamaCppRunner
from llmrun.runners.serving.options import (
    DEFAULT_POLICIES,
    ServeOptions,
    Stage,
    parse_concurrency,
    parse_percentiles,
    parse_policies,
    parse_rate,
    parse_slo,
)

from . import output as out

if TYPE_CHECKING:
    from llmrun.runners.remote import OpenAIRunner
    from llmrun.runners.serving import load as sv

METRICS = ("ttft", "tpot", "itl", "e2el")
LOAD = "Load (vLLM's random dataset)"
LOCAL = "This machine's engine (without --endpoint)"


def _opt(help_text: str, *names: str, panel: str = LOAD, **kw: Any) -> Any:
    return typer.Option(*names, help=help_text, rich_help_panel=panel, **kw)


Model1 = Annotated[
    str | None,
    typer.Option(
        "-m",
        "--model",
        envvar="LLMRUN_MODEL",
        show_default=False,
        help="A .gguf path or Hub reference; with --endpoint, the server's model"
        " (default: the embedded SmolLM2-135M, or the server's first).",
    ),
]
Seed = Annotated[int, typer.Option("--seed", help="Seed of the random prompts.")]
Output = Annotated[
    out.OutputFormat | None,
    typer.Option(
        "-o",
        "--output",
        show_default=False,
        help="Print the results on stdout as md, csv, json, jsonl or sql."
        " (default: a table on a terminal, else md)",
    ),
]
OutputLen = Annotated[int, _opt("Mean output length in tokens.", "--output-len", min=1)]
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

Threads = Annotated[
    int | None,
    _opt(
        "CPU threads of the engine: one token a step. (default: the physical cores)",
        "-t",
        "--threads",
        panel=LOCAL,
        min=1,
        show_default=False,
    ),
]
ThreadsBatch = Annotated[
    int | None,
    _opt(
        "CPU threads for steps of more than one token (prefill). (default: --threads)",
        "-tb",
        "--threads-batch",
        panel=LOCAL,
        min=1,
        show_default=False,
    ),
]
KvUnified = Annotated[
    bool | None,
    _opt(
        "One KV buffer for all sequences (llama.cpp's -kvu), or each its own KV stream"
        " (--no-kv-unified), as llama.cpp's contexts and llama-batched-bench do. Recorded as"
        " kv_unified. (default: one stream per sequence)",
        "-kvu/-no-kvu",
        "--kv-unified/--no-kv-unified",
        panel=LOCAL,
        show_default=False,
    ),
]


def connect(
    endpoint: str,
    *,
    model: str | None,
    api_key: str | None,
    timeout_s: float,
    err: Console,
    max_connections: int | None = None,
) -> tuple[OpenAIRunner, str]:
    """The server's runner, connected, and its model's name; its line on stderr."""
    from llmrun.runners.remote import OpenAIRunner  # httpx: only when a server is measured

    extra = {} if max_connections is None else {"max_connections": max_connections}
    runner = OpenAIRunner(endpoint, model=model, api_key=api_key, timeout_s=timeout_s, **extra)
    try:
        loaded = runner.load()
    except BaseException:
        runner.close()
        raise
    name = runner.model_name or loaded.name
    err.print(
        f"server   {runner.endpoint} · model {name} · connect {loaded.load_s * 1000:.1f} ms",
        markup=False,
    )
    return runner, name


def local_runner(
    model: str | None,
    job: str,
    *,
    threads: int | None = None,
    threads_batch: int | None = None,
    kv_unified: bool = False,
) -> LlamaCppRunner:
    """This machine's engine for a serving job (512 tokens per sequence, untuned)."""
    config = EngineConfig(
        n_ctx=512, n_threads=threads, n_threads_batch=threads_batch, kv_unified=kv_unified
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


def serve(
    model: Model1 = None,
    endpoint: o.Endpoint = None,
    api_key: o.ApiKey = None,
    timeout: o.Timeout = o.TIMEOUT_S,
    concurrency: Annotated[
        str, _opt("Requests in flight: a list such as 1,4,16.", "--concurrency")
    ] = "1,4",
    request_rate: Annotated[
        str, _opt("Poisson arrival rate in requests/s; inf sends all at once.", "--request-rate")
    ] = "inf",
    num_prompts: Annotated[
        int, _opt("Requests per concurrency level.", "--num-prompts", min=1)
    ] = 16,
    input_len: Annotated[int, _opt("Mean prompt length in tokens.", "--input-len", min=1)] = 128,
    output_len: OutputLen = 64,
    range_ratio: Annotated[
        float,
        _opt(
            "Lengths uniform within ±this share of the mean (vLLM's random-range-ratio).",
            "--range-ratio",
            min=0.0,
            max=0.99,
        ),
    ] = 0.0,
    warmup: Annotated[
        int | None,
        _opt(
            "Untimed warm-up requests before each level. (default: 1 against a"
            " server, 0 on this machine's engine)",
            "--warmup",
            min=0,
            show_default=False,
        ),
    ] = None,
    percentiles: Annotated[
        str, _opt("Percentiles of each latency metric.", "--percentiles")
    ] = "50,90,99",
    slo: Annotated[
        str | None,
        _opt(
            "Goodput counts requests meeting these, in ms: ttft:500,tpot:50 (e2el too).",
            "--slo",
            show_default=False,
        ),
    ] = None,
    policy: Policies = DEFAULT_POLICIES,
    threads: Threads = None,
    threads_batch: ThreadsBatch = None,
    kv_unified: KvUnified = None,
    seed: Seed = 1234,
    output: Output = None,
    compare: Annotated[
        bool,
        typer.Option(
            "--compare", help="Show the change against the last run of the same settings."
        ),
    ] = False,
    no_history: Annotated[
        bool, typer.Option("--no-history", help="Do not store this run in the history.")
    ] = False,
) -> None:
    """Serving load with vLLM's metrics (TTFT, TPOT, ITL, E2EL, throughput, goodput).

    llmrun bench serve --concurrency 1,4 --policy chunked:64   # this machine's engine

    llmrun bench serve --endpoint http://127.0.0.1:8080 --concurrency 1,4,16
    """
    with handled():
        err = Console(stderr=True, highlight=False)
        show = StdoutConsole(highlight=False) if output is None and sys.stdout.isatty() else err
        given_policy = policy != DEFAULT_POLICIES
        options = ServeOptions(
            concurrency=parse_concurrency(concurrency),
            request_rate=parse_rate(request_rate),
            num_prompts=num_prompts,
            input_len=input_len,
            output_len=output_len,
            range_ratio=range_ratio,
            warmup=(1 if endpoint else 0) if warmup is None else warmup,
            percentiles=parse_percentiles(percentiles),
            slo=parse_slo(slo),
            seed=seed,
            policies=() if endpoint else parse_policies(policy),
        )
        screen = Screen(err, show, threading.Event())
        delivery = Delivery(output, compare, store=not no_history)
        with ctrl_c_cancels(screen.cancel):
            if endpoint:
                if given_policy:
                    raise BadRequestError(
                        "--policy: the server schedules its own requests;"
                        " policies apply without --endpoint"
                    )
                o.refuse_for_endpoint(
                    endpoint,
                    {
                        "-t/--threads": threads,
                        "-tb/--threads-batch": threads_batch,
                        "-kvu/--kv-unified": None if kv_unified is None else "given",
                    },
                )
                code = _remote(Server(endpoint, model, api_key, timeout), options, screen, delivery)
            else:
                o.refuse_given(
                    {"--api-key": api_key, "--timeout": timeout != o.TIMEOUT_S},
                    "only with --endpoint",
                )
                code = _local(
                    model,
                    options,
                    screen,
                    delivery,
                    (threads, threads_batch),
                    kv_unified=kv_unified is True,
                )
        raise typer.Exit(code)


@dataclass(frozen=True)
class Screen:
    """Where a job shows itself: progress and messages, results, and its Ctrl-C flag."""

    err: Console
    show: Console
    cancel: threading.Event


@dataclass(frozen=True)
class Server:
    """The OpenAI-compatible server a job measures."""

    endpoint: str
    model: str | None
    api_key: str | None
    timeout_s: float

    def connect(self, err: Console, connections: int | None = None) -> tuple[OpenAIRunner, str]:
        return connect(
            self.endpoint,
            model=self.model,
            api_key=self.api_key,
            timeout_s=self.timeout_s,
            err=err,
            max_connections=connections,
        )


@dataclass(frozen=True)
class Delivery:
    """Where the results go: stdout's format, the history, a comparison with earlier runs."""

    output: out.OutputFormat | None
    compare: bool
    store: bool


def _remote(server: Server, options: ServeOptions, screen: Screen, delivery: Delivery) -> int:
    from llmrun.runners.serving import load as sv

    runner, name = server.connect(screen.err, connections=max(options.concurrency) + 8)
    done: list[sv.ServingLevel] = []
    try:
        for level in run_stages(
            sv.serve_remote(runner, options, cancel=screen.cancel),
            screen.err,
            "preparing prompts ...",
        ):
            done.append(level)
            for e in level.metrics.errors:
                screen.err.print(
                    f"c={level.concurrency}: failed requests: {e}", markup=False, style="yellow"
                )
    finally:
        runner.close()
    # the runner's endpoint: its credentials redacted
    return _report(done, options, screen, delivery, name=name, endpoint=runner.endpoint)


def _local(
    model: str | None,
    options: ServeOptions,
    screen: Screen,
    delivery: Delivery,
    threads: tuple[int | None, int | None],
    *,
    kv_unified: bool = False,
) -> int:
    from llmrun.runners.serving.local import LOCAL, serve_local

    runner = local_runner(
        model,
        "the local serving benchmark",
        threads=threads[0],
        threads_batch=threads[1],
        kv_unified=kv_unified,
    )
    try:
        done = list(
            run_stages(
                serve_local(runner, options, cancel=screen.cancel),
                screen.err,
                "loading the model ...",
            )
        )
    finally:
        runner.close()
    name = done[-1].model if done else ""
    return _report(done, options, screen, delivery, name=name, endpoint=LOCAL)


def _report(
    done: Sequence[sv.ServingLevel],
    options: ServeOptions,
    screen: Screen,
    delivery: Delivery,
    *,
    name: str,
    endpoint: str,
) -> int:
    """The levels stored, then printed; the comparison with earlier runs after them."""
    interrupted = screen.cancel.is_set()
    records = [r.record() for r in done]
    if interrupted:
        screen.err.print(
            f"interrupted: keeping the {len(records)} finished results", style="yellow"
        )
    changes = out.store_and_print(
        records,
        kind="serving",
        model=name,
        system={"endpoint": endpoint},
        output=delivery.output,
        show=screen.show,
        table=serving_table(done, options.percentiles),
        store=delivery.store,
        compare=delivery.compare,
        sql_table="llmrun_serving",
        md_columns=SERVING_COLUMNS,
    )
    if changes is not None:
        screen.show.print(out.compare_table(changes))
    return EXIT_INTERRUPTED if interrupted else 0


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _latency(name: str, key: str) -> Callable[[sv.ServingMetrics], str]:
    def cell(m: sv.ServingMetrics) -> str:
        latency: sv.Latency = getattr(m, name)
        return _num(latency.fields(name).get(key), ",.1f")

    return cell


def serving_table(levels: Sequence[sv.ServingLevel], percentiles: Sequence[float]) -> Fitted:
    """A column per level; too wide for the terminal, a block per level."""
    table = Table(title="serving benchmark (vLLM's definitions)", title_justify="left")
    table.add_column("metric")
    for level in levels:
        policy = f" {level.policy}" if level.policy else ""
        table.add_column(f"c={level.concurrency} rate={level.rate_text}{policy}", justify="right")
    rows: list[tuple[str, Callable[[sv.ServingMetrics], str]]] = [
        ("requests completed / failed", lambda m: f"{m.completed} / {m.failed}"),
        ("duration s", lambda m: f"{m.duration_s:.2f}"),
        ("request throughput req/s", lambda m: _num(m.request_throughput, ".2f")),
        ("output tokens/s", lambda m: _num(m.output_throughput, ".1f")),
        ("total tokens/s", lambda m: _num(m.total_token_throughput, ".1f")),
    ]
    if any(level.metrics.goodput is not None for level in levels):
        rows.append(("goodput req/s (met --slo)", lambda m: _num(m.goodput, ".2f")))
    for name in METRICS:
        for stat in ("mean", "median", "std", *(f"p{p:g}" for p in percentiles)):
            key = f"{stat}_{name}_ms"
            rows.append((f"{name.upper()} {stat} ms", _latency(name, key)))
    for label, cell in rows:
        table.add_row(label, *(cell(level.metrics) for level in levels))
    return fitted(table, by_column=True)


# The md table's columns (the other formats carry every figure)
SERVING_COLUMNS = (
    "test",
    "concurrency",
    "request_rate",
    "completed",
    "failed",
    "request_throughput",
    "output_throughput",
    "mean_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "mean_itl_ms",
    "p99_itl_ms",
    "mean_e2el_ms",
    "goodput",
)
