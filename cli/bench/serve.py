"""`llmrun bench serve`: serving load with vLLM's metrics, against a server (--endpoint) or this
machine's engine under each scheduling policy. The measuring is in runners/serving/."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from stat import S_ISDIR
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from llmrun.cli import options as o
from llmrun.cli.errors import EXIT_INTERRUPTED, handled, print_error, usage_error
from llmrun.cli.records import OptionRecord, takes_records
from llmrun.cli.report import Fitted, fitted
from llmrun.cli.session import ctrl_c_cancels
from llmrun.cli.terminal import terminal_line
from llmrun.runners.errors import BadRequestError
from llmrun.runners.library import max_sequences
from llmrun.runners.lists import MAX_VALUE
from llmrun.runners.serving.figures import LATENCIES
from llmrun.runners.serving.options import (
    DEFAULT_INPUT_LEN,
    DEFAULT_OUTPUT_LEN,
    DEFAULT_POLICIES,
    MAX_INPUT_LEN,
    MAX_OUTPUT_LEN,
    MAX_PROMPTS,
    ServeOptions,
    parse_concurrency,
    parse_percentiles,
    parse_policies,
    parse_rate,
    parse_slo,
)
from llmrun.runners.serving.prompts import read_dataset

from . import output as out
from .serving import (
    Model1,
    Output,
    Policies,
    Screen,
    Server,
    ServingEngineOptions,
    _opt,
    local_runner,
    refuse_remote_only,
    run_stages,
)

if TYPE_CHECKING:
    from llmrun.runners.serving import load as sv
    from llmrun.runners.serving.figures import Latency, ServingMetrics


def existing_file(value: str) -> Path:
    """A path to a file that is there, as Click's `exists=True, dir_okay=False` checks it,
    with one clear line where Click's are odd: an empty path ("is a directory") and a loop of
    symbolic links ("does not exist")."""
    if not value:
        raise typer.BadParameter("an empty path names no file")
    try:
        mode = os.stat(value).st_mode
    except OSError as e:
        if e.errno == errno.ENOENT:
            raise typer.BadParameter(f"file {value!r} does not exist") from None
        if e.errno == errno.ELOOP:
            raise typer.BadParameter(f"{value!r} is a loop of symbolic links") from None
        raise typer.BadParameter(f"{value!r}: {e.strerror or e}") from None
    if S_ISDIR(mode):
        raise typer.BadParameter(f"file {value!r} is a directory")
    return Path(value)


@dataclass(frozen=True, kw_only=True)
class LoadOptions(OptionRecord):
    """The load: vLLM's random dataset (or a file's prompts) at each concurrency level, and
    what is reported."""

    concurrency: Annotated[
        str | None,
        _opt(
            "Levels: --slots on this machine's engine, --max-concurrency against a server."
            " [default: 1,4]",
            "--concurrency",
        ),
    ] = None
    slots: Annotated[
        str | None,
        _opt(
            "This machine's engine: sequences served at once, a list such as 1,4 (later"
            " requests wait for one: their queue time).",
            "--slots",
        ),
    ] = None
    max_concurrency: Annotated[
        str | None,
        _opt(
            "Against a server (--endpoint): the client's requests in flight, a list such as"
            " 1,4,16 (vLLM's --max-concurrency; each request's clock starts as it is sent).",
            "--max-concurrency",
        ),
    ] = None
    request_rate: Annotated[
        str, _opt("Poisson arrival rate in requests/s; inf sends all at once.", "--request-rate")
    ] = "inf"
    num_prompts: Annotated[
        int, _opt("Requests per concurrency level.", "--num-prompts", min=1, max=MAX_PROMPTS)
    ] = 16
    input_len: Annotated[
        int | None,
        _opt(
            "Mean prompt length in tokens. (default: 128)", "--input-len", min=1, max=MAX_INPUT_LEN
        ),
    ] = None
    output_len: Annotated[
        int | None,
        _opt(
            "Mean output length in tokens; with --dataset, every request's, over the data's"
            " (vLLM's --sharegpt-output-len). (default: 64; with --dataset, the data's, or 64"
            " for a JSONL line without one)",
            "--output-len",
            min=1,
            max=MAX_OUTPUT_LEN,
        ),
    ] = None
    range_ratio: Annotated[
        float | None,
        _opt(
            "Lengths uniform within ±this share of the mean (vLLM's random-range-ratio)."
            " (default: 0)",
            "--range-ratio",
            min=0.0,
            max=0.99,
        ),
    ] = None
    shared_prefix: Annotated[
        int,
        _opt(
            "Tokens every prompt starts with, the same in all (against a server: words); beyond"
            " them no two prompts share a prefix, at any level. vLLM's --random-prefix-len.",
            "--shared-prefix",
            min=0,
            max=MAX_INPUT_LEN,
        ),
    ] = 0
    dataset: Annotated[
        Path | None,
        _opt(
            "Real prompts: ShareGPT JSON (vLLM's sharegpt loader) or JSONL ('prompt' and"
            " optionally 'output_len' a line). Lengths come from the data, filtered as vLLM"
            " does; --num-prompts are sampled with --seed. Not with --input-len,"
            " --range-ratio or --shared-prefix.",
            "--dataset",
            parser=existing_file,
            metavar="FILE",
        ),
    ] = None
    warmup: Annotated[
        int | None,
        _opt(
            "Untimed warm-up requests before each level. (default: 1 against a"
            " server, 0 on this machine's engine)",
            "--warmup",
            min=0,
            max=MAX_PROMPTS,
        ),
    ] = None
    percentiles: Annotated[str, _opt("Percentiles of each latency metric.", "--percentiles")] = (
        "50,90,99"
    )
    slo: Annotated[
        str | None,
        _opt("Goodput counts requests meeting these, in ms: ttft:500,tpot:50 (e2el too).", "--slo"),
    ] = None

    def serve_options(self, *, endpoint: str | None, seed: int, policy: str) -> ServeOptions:
        """The job's record, each list parsed and the dataset read; the local engine's policies
        without a server."""
        if self.dataset is not None:  # the data's lengths: these would be silently ignored
            given = {
                "--input-len": self.input_len,
                "--range-ratio": self.range_ratio,
                "--shared-prefix": self.shared_prefix,
            }
            for flag, value in given.items():
                if value is not None and value != 0:
                    usage_error(f"{flag}: random prompts only, not with --dataset")
        return ServeOptions(
            concurrency=parse_concurrency(
                *self.levels(endpoint),
                # this machine's engine: the sequences one llama.cpp context holds (past them,
                # the model loaded first and then llama.cpp refused the context)
                maximum=MAX_VALUE if endpoint else max_sequences(),
            ),
            request_rate=parse_rate(self.request_rate),
            num_prompts=self.num_prompts,
            input_len=DEFAULT_INPUT_LEN if self.input_len is None else self.input_len,
            output_len=DEFAULT_OUTPUT_LEN if self.output_len is None else self.output_len,
            range_ratio=self.range_ratio or 0.0,
            output_len_given=self.output_len is not None,
            warmup=(1 if endpoint else 0) if self.warmup is None else self.warmup,
            percentiles=parse_percentiles(self.percentiles),
            slo=parse_slo(self.slo),
            seed=seed,
            policies=() if endpoint else parse_policies(policy),
            shared_prefix=self.shared_prefix,
            dataset=read_dataset(self.dataset) if self.dataset is not None else None,
        )

    def levels(self, endpoint: str | None) -> tuple[str, str]:
        """The levels' list from the option named for the target (`--concurrency`: either),
        refusing the other target's option and two of them at once."""
        if endpoint is None and self.max_concurrency is not None:
            usage_error(
                "--max-concurrency: the client's limit against a server (--endpoint);"
                " this machine's engine takes --slots"
            )
        if endpoint is not None and self.slots is not None:
            usage_error(
                "--slots: the local engine's sequences; against a server give --max-concurrency"
            )
        right, flag = (
            (self.max_concurrency, "--max-concurrency") if endpoint else (self.slots, "--slots")
        )
        if right is not None and self.concurrency is not None:
            usage_error(f"--concurrency and {flag} say the same: give one")
        if right is not None:
            return right, flag
        return self.concurrency or "1,4", "--concurrency"


@takes_records
def serve(
    model: Model1 = None,
    *,
    remote: o.RemoteOptions,
    load: LoadOptions,
    policy: Policies = DEFAULT_POLICIES,
    engine: ServingEngineOptions,
    seed: o.PromptSeed = 1234,
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

    llmrun bench serve --slots 1,4 --policy chunked:64   # this machine's engine

    llmrun bench serve --endpoint http://127.0.0.1:8080 --max-concurrency 1,4,16
    """
    with handled():
        endpoint = remote.endpoint
        options = load.serve_options(endpoint=endpoint, seed=seed, policy=policy)
        screen = Screen.open(output)
        delivery = Delivery(output, compare, store=not no_history)
        with ctrl_c_cancels(screen.cancel):
            if endpoint:
                o.refuse_given(  # a usage error, as interference's
                    {"--policy": policy != DEFAULT_POLICIES},
                    "the server schedules its own requests; policies apply without --endpoint",
                )
                engine.refuse_for(endpoint)
                server = Server(endpoint, model, remote.api_key, remote.timeout)
                code = _remote(server, options, screen, delivery)
            else:
                refuse_remote_only(remote, {})
                code = _local(model, options, screen, delivery, engine)
        raise typer.Exit(code)


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
            for e in level.metrics.errors:  # a server's words: no escape sequence shown
                screen.err.print(
                    f"{level.level_text}: failed requests: {terminal_line(e)}",
                    markup=False,
                    style="yellow",
                )
            if level.metrics.implausible:  # dropped: run --endpoint's warning, per level
                left_out = terminal_line("; ".join(level.metrics.implausible))
                screen.err.print(
                    f"llmrun: warning: {level.level_text}: the server's figures that cannot be"
                    f" true were left out (output counted in stream chunks): {left_out}",
                    markup=False,
                    style="yellow",
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
    engine: ServingEngineOptions,
) -> int:
    from llmrun.runners.serving.local import LOCAL, serve_local

    runner = local_runner(model, "the local serving benchmark", engine)
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
    """The levels stored, then printed; the comparison with earlier runs after them. A run
    whose every request failed measured nothing: printed, not stored, and exit 1 (it was 0,
    with a table of empty figures, against a server that did not know the model)."""
    interrupted = screen.cancel.is_set()
    measured = any(level.metrics.completed for level in done)
    records = [r.record() for r in done]
    if interrupted:
        screen.err.print(
            f"llmrun: interrupted: keeping the {len(records)} finished results", style="yellow"
        )
    run = out.RunRecords(
        records=records,
        kind="serving",
        model=name,
        system={"endpoint": endpoint},
        sql_table="llmrun_serving",
        md_columns=SERVING_COLUMNS,
    )
    changes = out.store_and_print(
        run,
        output=delivery.output,
        show=screen.show,
        table=serving_table(done, options.percentiles),
        store=delivery.store and (measured or not done),
        compare=delivery.compare,
    )
    if changes is not None:
        screen.show.print(out.compare_table(changes))
    if interrupted:
        return EXIT_INTERRUPTED
    if done and not measured:
        first = next((e for level in done for e in level.metrics.errors), "no token came back")
        print_error(BadRequestError(f"every request failed, nothing was measured: {first}"))
        return 1
    return 0


def _latency(name: str, key: str) -> Callable[[ServingMetrics], str]:
    def cell(m: ServingMetrics) -> str:
        latency: Latency | None = getattr(m, name)
        return "-" if latency is None else out.num(latency.fields(name).get(key), ",.1f")

    return cell


def serving_table(levels: Sequence[sv.ServingLevel], percentiles: Sequence[float]) -> Fitted:
    """A column per level; too wide for the terminal, a block per level."""
    table = Table(title="serving benchmark (vLLM's definitions)", title_justify="left")
    table.add_column("metric")
    for level in levels:
        policy = f" {level.policy}" if level.policy else ""
        table.add_column(f"{level.level_text} rate={level.rate_text}{policy}", justify="right")
    rows: list[tuple[str, Callable[[ServingMetrics], str]]] = [
        ("requests completed / failed", lambda m: f"{m.completed} / {m.failed}"),
        ("duration s", lambda m: f"{m.duration_s:.2f}"),
        ("request throughput req/s", lambda m: out.num(m.request_throughput, ".2f")),
        ("output tokens/s", lambda m: out.num(m.output_throughput, ".1f")),
        ("total tokens/s", lambda m: out.num(m.total_token_throughput, ".1f")),
    ]
    if any(level.metrics.goodput is not None for level in levels):
        rows.append(("goodput req/s (met --slo)", lambda m: out.num(m.goodput, ".2f")))
    for name in LATENCIES:
        if all(getattr(level.metrics, name) is None for level in levels):
            continue  # a figure none of the levels measured
        for stat in ("mean", "median", "std", *(f"p{p:g}" for p in percentiles)):
            key = f"{stat}_{name}_ms"
            rows.append((f"{name.upper()} {stat} ms", _latency(name, key)))
    cells = [(label, [cell(level.metrics) for level in levels]) for label, cell in rows]
    if any(level.cached_tokens is not None for level in levels):
        # what the server said it took from its cache: fresh prompts should leave it at 0
        cells.insert(1, ("prompt tokens / cached", [_cached(level) for level in levels]))
    for label, texts in cells:
        table.add_row(label, *texts)
    return fitted(table, by_column=True)


def _cached(level: sv.ServingLevel) -> str:
    return f"{level.metrics.total_input_tokens:,} / {out.num(level.cached_tokens, ',')}"


# The md table's columns (the other formats carry every figure)
SERVING_COLUMNS = (
    "test",
    "concurrency",
    "request_rate",
    "completed",
    "failed",
    "request_throughput",
    "output_throughput",
    "mean_queue_ms",
    "mean_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "mean_itl_ms",
    "p99_itl_ms",
    "mean_e2el_ms",
    "goodput",
)
