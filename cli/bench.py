"""`llmrun bench`: llama-bench's tests and sweeps, with TTFT, ITL, load time and efficiency.

Also `llmrun history`. The measuring is in runners/bench.py; this module parses the sweep,
shows progress, prints the results in the format asked for, and stores them.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from llmrun.runners import bench as b
from llmrun.runners import localscore as ls
from llmrun.runners import results as res
from llmrun.runners import sweep as sw
from llmrun.runners.base import BenchRunner
from llmrun.runners.errors import BadRequestError
from llmrun.runners.limits import CACHE_TYPES, FLASH_ATTN
from llmrun.runners.llamacpp import EngineConfig
from llmrun.runners.stats import human_count
from llmrun.runners.system import SystemInfo, physical_cores
from llmrun.runners.tuning import save_tuned, search

from . import bench_output as out
from . import bench_plot
from . import options as o
from .bench_serving import run_serving
from .dashboard import model_facts
from .engine import make_bench_runner
from .errors import EXIT_INTERRUPTED, StdoutConsole, handled
from .report import ms
from .session import ctrl_c_cancels

PANEL = "Tests (llama-bench's)"
SWEEP = "Sweep: each takes a comma list or a range such as 8-512*4"
SERVING = "Serving benchmark (with --endpoint)"


def _list(help_text: str, *names: str, panel: str = SWEEP) -> Any:
    return typer.Option(*names, help=help_text, rich_help_panel=panel, show_default=False)


def system_rows(system: SystemInfo, model: str) -> list[tuple[str, str]]:
    ram = human_count(system.ram_bytes, "B") if system.ram_bytes else "?"
    bw = f"{system.mem_bw_bytes_s / 1e9:.1f} GB/s" if system.mem_bw_bytes_s else "not measured"
    return [
        ("cpu", f"{system.cpu} · {system.physical_cores} cores ({system.logical_cpus} logical)"
                f" · RAM {ram}"),
        ("memory", f"{bw} (streaming copy)"),
        ("gpu", system.gpu),
        ("build", f"{system.build} · {system.features}"),
        ("model", model),
    ]  # fmt: skip


def label_grid(rows: Sequence[tuple[str, str]]) -> Table:
    """Label and value in two columns: a narrow terminal wraps the value under itself."""
    grid = Table.grid(padding=(0, 1))
    grid.add_column(width=8, no_wrap=True)
    grid.add_column()
    for label, value in rows:
        grid.add_row(label, Text(value))
    return grid


def _shapes(
    n_prompt: str, n_gen: str, pg: Sequence[str], depth: str, scenarios: bool, scale: float
) -> list[sw.Shape]:
    depths = sw.parse_values(depth, name="-d/--n-depth")
    if scenarios:
        return ls.scenario_shapes(scale)
    shapes = [sw.Shape(p, 0, d) for d in depths for p in sw.parse_values(n_prompt, name="-p") if p]
    shapes += [sw.Shape(0, n, d) for d in depths for n in sw.parse_values(n_gen, name="-n") if n]
    for pair in pg:
        values = sw.parse_values(pair, name="--pg")
        if len(values) != 2:
            raise BadRequestError(f"--pg: give PROMPT,GEN such as 512,128, not '{pair}'")
        shapes += [sw.Shape(values[0], values[1], d) for d in depths]
    if not shapes:
        raise BadRequestError("no test to run: -p, -n and --pg are all 0 or empty")
    return shapes


def _optional_ints(text: str | None, name: str, default: int | None) -> list[int | None]:
    return [default] if text is None else list(sw.parse_values(text, name=name))


def tune(
    runner: BenchRunner, base: EngineConfig, err: Console, cancel: threading.Event
) -> dict[str, Any] | None:
    """Run the tuning search and show every setting it tried."""
    found = search(runner, base, cancel=cancel,
                   on_stage=lambda name: err.print(f"tuning {name} ..."))  # fmt: skip
    if found is None:
        return None
    best, tried = found
    table = Table(title="tuning: every setting tried", title_justify="left")
    for col in ("settings", "pp t/s", "tg t/s", "score"):
        table.add_column(col, justify="left" if col == "settings" else "right")
    for t in tried:
        table.add_row(t.combo.describe(), f"{t.pp_ts:,.1f}" if t.pp_ts else "-",
                      f"{t.tg_ts:,.1f}" if t.tg_ts else "-", f"{t.score:,.1f}")  # fmt: skip
    err.print(table)
    phys = physical_cores()
    default = next((t for t in tried if t.combo == sw.Combo(phys, 512, 512, 0, "off")), None)
    if default is not None:
        err.print(f"score = sqrt(pp t/s x tg t/s); llama.cpp's default threads ({phys}), batch"
                  f" 512 and no flash attention scored {default.score:,.1f}")  # fmt: skip
    return best


def bench(
    model: o.Model = None,
    n_prompt: Annotated[
        str,
        _list(
            "Prompt sizes of pp tests (0: none). (default: 512)", "-p", "--n-prompt", panel=PANEL
        ),
    ] = "512",
    n_gen: Annotated[
        str,
        _list(
            "Generation lengths of tg tests (0: none). (default: 128)", "-n", "--n-gen", panel=PANEL
        ),
    ] = "128",
    pg: Annotated[
        list[str] | None,
        _list("A pp+tg test PROMPT,GEN such as 512,128 (repeatable).", "--pg", panel=PANEL),
    ] = None,
    depth: Annotated[
        str,
        _list(
            "Run each test after N tokens already in the KV cache. (default: 0)",
            "-d",
            "--n-depth",
            panel=PANEL,
        ),
    ] = "0",
    reps: Annotated[
        int,
        typer.Option(
            "-r",
            "--repetitions",
            min=1,
            rich_help_panel=PANEL,
            help="Timed repetitions per test, after one warm-up.",
        ),
    ] = 5,
    threads: Annotated[
        str | None, _list("CPU threads. (default: physical cores, or tuned)", "-t", "--threads")
    ] = None,
    batch: Annotated[
        str | None,
        _list("Prefill chunk sizes (n_batch). (default: 512, or tuned)", "-b", "--batch"),
    ] = None,
    ubatch: Annotated[
        str | None,
        _list("Micro-batch sizes (n_ubatch). (default: 512, or tuned)", "-ub", "--ubatch"),
    ] = None,
    gpu_layers: Annotated[str, _list("GPU layers. (default: 0)", "-ngl", "--gpu-layers")] = "0",
    flash_attn: Annotated[
        str | None,
        _list("on, off, auto. (default: off on the CPU, or tuned)", "-fa", "--flash-attn"),
    ] = None,
    cache_type_k: Annotated[
        str,
        _list(
            f"KV cache K types: {', '.join(CACHE_TYPES)}. (default: f16)", "-ctk", "--cache-type-k"
        ),
    ] = "f16",
    cache_type_v: Annotated[
        str,
        _list(
            "KV cache V types (quantized V needs flash attention). (default: f16)",
            "-ctv",
            "--cache-type-v",
        ),
    ] = "f16",
    ctx: Annotated[
        int | None,
        typer.Option(
            "-c",
            "--ctx",
            min=1,
            show_default=False,
            help="Context size. (default: what the tests need)",
            rich_help_panel=SWEEP,
        ),
    ] = None,
    scenarios: Annotated[
        bool,
        typer.Option(
            "--scenarios",
            rich_help_panel=PANEL,
            help="LocalScore's prompt/output matrix, scaled, with its overall score.",
        ),
    ] = False,
    scenario_scale: Annotated[
        float,
        typer.Option(
            "--scenario-scale",
            min=0.001,
            max=1.0,
            rich_help_panel=PANEL,
            help="Token counts of --scenarios relative to LocalScore's (1 = as LocalScore).",
        ),
    ] = ls.DEFAULT_SCENARIO_SCALE,
    tune_: Annotated[
        bool,
        typer.Option(
            "--tune",
            help="Search threads, batch/ubatch and flash"
            " attention for this model; save the fastest as the"
            " defaults of run, chat and bench.",
        ),
    ] = False,
    output: Annotated[
        out.OutputFormat | None,
        typer.Option(
            "-o",
            "--output",
            show_default=False,
            help="Print the results on stdout as"
            " md, csv, json, jsonl or sql. (default:"
            " a table on a terminal, else md)",
        ),
    ] = None,
    plot: Annotated[
        Path | None,
        typer.Option(
            "--plot",
            metavar="FILE.png",
            show_default=False,
            help="Also draw the charts into a PNG file.",
        ),
    ] = None,
    compare: Annotated[
        bool,
        typer.Option(
            "--compare", help="Show the change against the last run of the same model and settings."
        ),
    ] = False,
    no_history: Annotated[
        bool, typer.Option("--no-history", help="Do not store this run in the history.")
    ] = False,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the random prompt tokens.")] = 1234,
    endpoint: o.Endpoint = None,
    api_key: o.ApiKey = None,
    timeout: o.Timeout = o.TIMEOUT_S,
    concurrency: Annotated[
        str,
        _list(
            "Requests in flight (serving): a list such as 1,4,16. (default: 1,4)",
            "--concurrency",
            panel=SERVING,
        ),
    ] = "1,4",
    request_rate: Annotated[
        str,
        _list(
            "Poisson arrival rate in requests/s; inf sends all at once. (default: inf)",
            "--request-rate",
            panel=SERVING,
        ),
    ] = "inf",
    num_prompts: Annotated[
        int,
        typer.Option(
            "--num-prompts", min=1, rich_help_panel=SERVING, help="Requests per concurrency level."
        ),
    ] = 16,
    input_len: Annotated[
        int,
        typer.Option(
            "--input-len", min=1, rich_help_panel=SERVING, help="Mean prompt length in tokens."
        ),
    ] = 128,
    output_len: Annotated[
        int,
        typer.Option(
            "--output-len", min=1, rich_help_panel=SERVING, help="Mean output length in tokens."
        ),
    ] = 64,
    range_ratio: Annotated[
        float,
        typer.Option(
            "--range-ratio",
            min=0.0,
            max=0.99,
            rich_help_panel=SERVING,
            help="Lengths uniform within ±this share of the mean (vLLM's random-range-ratio).",
        ),
    ] = 0.0,
    warmup: Annotated[
        int,
        typer.Option(
            "--warmup", min=0, rich_help_panel=SERVING, help="Warm-up requests before each level."
        ),
    ] = 1,
    percentiles: Annotated[
        str,
        _list(
            "Percentiles of each latency metric. (default: 50,90,99)",
            "--percentiles",
            panel=SERVING,
        ),
    ] = "50,90,99",
    slo: Annotated[
        str | None,
        _list(
            "Goodput counts requests meeting these, in ms: ttft:500,tpot:50 (e2el too).",
            "--slo",
            panel=SERVING,
        ),
    ] = None,
    interference: Annotated[
        bool,
        typer.Option(
            "--interference",
            rich_help_panel=SERVING,
            help="One client decodes while others send long prompts: its ITL alone vs under load.",
        ),
    ] = False,
    interference_rate: Annotated[
        float,
        typer.Option(
            "--interference-rate",
            min=0.01,
            rich_help_panel=SERVING,
            help="Long prompts per second.",
        ),
    ] = 2.0,
    interference_prompt_len: Annotated[
        int,
        typer.Option(
            "--interference-prompt-len",
            min=1,
            rich_help_panel=SERVING,
            help="Tokens per long prompt.",
        ),
    ] = 512,
) -> None:
    """Measure this machine: llama-bench's tests, sweeps, TTFT, ITL, efficiency and history.

    llmrun bench                          # pp512 and tg128, 5 repetitions

    llmrun bench -t 1,2 -b 64-512*2 -o csv

    llmrun bench -p 0 -n 64 -d 0,512,1024 # decode rate against context depth

    llmrun bench --endpoint http://127.0.0.1:8080 --concurrency 1,4,16
    """
    with handled():
        err = Console(stderr=True, highlight=False)
        show = StdoutConsole(highlight=False) if output is None and sys.stdout.isatty() else err
        cancel = threading.Event()
        with ctrl_c_cancels(cancel):
            if endpoint:
                local = {
                    "-t": threads,
                    "-b": batch,
                    "-ub": ubatch,
                    "-fa": flash_attn,
                    "--tune": tune_,
                    "--scenarios": scenarios,
                    "-ngl": gpu_layers,
                }
                o.refuse_for_endpoint(endpoint, local)
                code = run_serving(
                    endpoint=endpoint, api_key=api_key, timeout_s=timeout, model=model,
                    concurrency=concurrency, request_rate=request_rate, num_prompts=num_prompts,
                    input_len=input_len, output_len=output_len, range_ratio=range_ratio,
                    warmup=warmup, percentiles=percentiles, slo=slo, interference=interference,
                    interference_rate=interference_rate,
                    interference_prompt_len=interference_prompt_len, seed=seed, output=output,
                    compare=compare, store=not no_history, cancel=cancel, err=err, show=show,
                )  # fmt: skip
            elif tune_:
                o.refuse_given({"-t": threads, "-b": batch, "-ub": ubatch, "-fa": flash_attn},
                               "--tune searches these itself")  # fmt: skip
                code = _tune(model, cancel, err)
            else:
                sweep = Sweep(
                    shapes=_shapes(n_prompt, n_gen, pg or [], depth, scenarios, scenario_scale),
                    threads=threads, batch=batch, ubatch=ubatch, gpu_layers=gpu_layers,
                    flash_attn=flash_attn, cache_type_k=cache_type_k, cache_type_v=cache_type_v,
                    reps=reps, ctx=ctx, seed=seed, scenarios=scenarios,
                )  # fmt: skip
                to = Output(format=output, plot=plot, compare=compare, store=not no_history)
                code = _sweep(model, sweep, cancel, err, show, to)
        raise typer.Exit(code)


@dataclass(frozen=True)
class Sweep:
    """What a llama-bench-style run measures, as the options gave it."""

    shapes: list[sw.Shape]
    threads: str | None
    batch: str | None
    ubatch: str | None
    gpu_layers: str
    flash_attn: str | None
    cache_type_k: str
    cache_type_v: str
    reps: int
    ctx: int | None
    seed: int
    scenarios: bool

    def combos(self, base: EngineConfig) -> list[sw.Combo]:
        """Every engine setting to test; unset options take the (tuned) defaults."""
        flash = (sw.parse_words(self.flash_attn, name="--flash-attn", allowed=FLASH_ATTN)
                 if self.flash_attn else [base.flash_attn])  # fmt: skip
        return sw.sweep(
            threads=_optional_ints(self.threads, "-t", base.n_threads),
            batch=_optional_ints(self.batch, "-b", base.n_batch),
            ubatch=_optional_ints(self.ubatch, "--ubatch", base.n_ubatch),
            gpu_layers=sw.parse_values(self.gpu_layers, name="-ngl", minimum=-1),
            flash_attn=flash,
            type_k=sw.parse_words(self.cache_type_k, name="-ctk", allowed=CACHE_TYPES),
            type_v=sw.parse_words(self.cache_type_v, name="-ctv", allowed=CACHE_TYPES),
        )


def _load_and_report(runner: BenchRunner, err: Console, *, bandwidth: bool) -> SystemInfo:
    """Load the model and print the machine's report (with the bandwidth probe if asked)."""
    with err.status("loading the model and measuring memory bandwidth ..."):
        loaded = runner.load()
        system = SystemInfo.collect(bandwidth=bandwidth)
    m = loaded.model
    facts = f"{m.name} · {model_facts(loaded)} · load {ms(loaded.load_s)}"
    err.print(label_grid(system_rows(system, facts)))
    return system


def _tune(model: str | None, cancel: threading.Event, err: Console) -> int:
    """`bench --tune`: the staged search, saved as the model's defaults."""
    runner = make_bench_runner(model, EngineConfig())
    try:
        _load_and_report(runner, err, bandwidth=False)  # tuning reports no efficiency
        best = tune(runner, runner.config, err, cancel)
    finally:
        runner.close()
    if best is None:
        err.print("tuning interrupted; nothing saved")
        return EXIT_INTERRUPTED
    path = save_tuned(runner.model_path, best)
    err.print(f"fastest: {best['n_threads']} threads, batch {best['n_batch']}, ubatch"
              f" {best['n_ubatch']}, flash attention {best['flash_attn']}; saved to {path}."
              " run, chat and bench now start from these (shown as 'tuned').")  # fmt: skip
    return 0


@dataclass(frozen=True)
class Output:
    """Where a run's results go: stdout's format, a chart file, the history, a comparison."""

    format: out.OutputFormat | None
    plot: Path | None
    compare: bool
    store: bool


def _sweep(
    model: str | None,
    sweep: Sweep,
    cancel: threading.Event,
    err: Console,
    show: Console,
    output: Output,
) -> int:
    """llama-bench's tests over every combination of settings; results printed and stored."""
    runner = make_bench_runner(model, EngineConfig())
    try:
        base = runner.config
        combos = sweep.combos(base)
        system = _load_and_report(runner, err, bandwidth=True)
        results, skipped = _measure(runner, base, combos, sweep, cancel, err)
    finally:
        runner.close()
    return _report(results, skipped, system, sweep, cancel, err, show, output)


def _measure(
    runner: BenchRunner,
    base: EngineConfig,
    combos: list[sw.Combo],
    sweep: Sweep,
    cancel: threading.Event,
    err: Console,
) -> tuple[list[res.Result], list[b.Skipped]]:
    results: list[res.Result] = []
    skipped: list[b.Skipped] = []
    progress = Progress(
        TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
        console=err, transient=True, disable=not err.is_terminal,
    )  # fmt: skip
    with progress:
        task = progress.add_task("bench", total=1)
        for event in b.run_bench(runner, combos=combos, shapes=sweep.shapes, reps=sweep.reps,
                                 base=base, n_ctx=sweep.ctx, seed=sweep.seed,
                                 cancel=cancel):  # fmt: skip
            if isinstance(event, b.Progress):
                progress.update(task, completed=event.done, total=event.total,
                                description=event.label[:40])  # fmt: skip
            elif isinstance(event, res.Result):
                results.append(event)
            else:
                skipped.append(event)
    return results, skipped


def _report(
    results: list[res.Result],
    skipped: list[b.Skipped],
    system: SystemInfo,
    sweep: Sweep,
    cancel: threading.Event,
    err: Console,
    show: Console,
    output: Output,
) -> int:
    """Skips, results (stored before printing), extras, chart file and comparison."""
    for s in skipped:
        what = f"{s.shape.name} " if s.shape else ""
        err.print(f"skipped: {what}{s.combo.describe()}: {s.reason}", markup=False, style="yellow")
    records = [r.record(system) for r in results]
    interrupted = cancel.is_set()
    if interrupted:
        err.print(f"interrupted: keeping the {len(records)} finished results", style="yellow")
    model = results[0].model.name if results else ""
    changes = out.store_and_print(
        records, kind="local", model=model, system=vars(system), output=output.format,
        show=show, table=out.results_table(records), store=output.store, compare=output.compare,
    )  # fmt: skip
    _extras(records, results, show, scenarios=sweep.scenarios)
    if output.plot is not None and records:
        bench_plot.plot(records, output.plot)
        err.print(f"charts written to {output.plot}")
    if changes is not None:
        show.print(out.compare_table(changes))
    return EXIT_INTERRUPTED if interrupted else 0


def _extras(
    records: list[dict[str, Any]], results: list[res.Result], show: Console, *, scenarios: bool
) -> None:
    for line in out.efficiency_lines(records):
        show.print(line, markup=False)
    for chart in (out.sweep_chart(records), out.depth_chart(records)):
        if chart is not None:
            show.print(chart)
    chunks = out.chunk_report(records)
    if chunks is not None:
        table, notes = chunks
        show.print(table)
        for note in notes:
            show.print(note, markup=False)
    if scenarios:
        score = ls.localscore(results)
        if score is not None:
            show.print(
                f"score    {score:,.1f}  (LocalScore's formula: 10 · cbrt(mean prompt tok/s"
                " · mean output tok/s · 1000 / mean TTFT ms), scenarios scaled)"
            )
