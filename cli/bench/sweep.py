"""`llmrun bench`: llama-bench's tests and sweeps, with TTFT, ITL, load time and efficiency.

Also `llmrun history`. The measuring is in runners/bench/measure.py; this module parses the sweep,
shows progress, prints the results in the format asked for, and stores them.
"""

from __future__ import annotations

import contextlib
import io
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import typer
from rich.console import Console
from rich.status import Status

import llmrun.cli
from llmrun.cli import options as co
from llmrun.cli.engine import make_bench_runner
from llmrun.cli.errors import (
    EXIT_INTERRUPTED,
    DisplayThatMayFail,
    handled,
    usage_error,
)
from llmrun.cli.progress import ProgressLine, Shown
from llmrun.cli.records import takes_records
from llmrun.cli.session import ctrl_c_cancels
from llmrun.cli.terminal import set_verbose, terminal_line
from llmrun.runners import devices as dv
from llmrun.runners import rpc
from llmrun.runners.bench import measure as b
from llmrun.runners.bench import results as res
from llmrun.runners.bench import run
from llmrun.runners.errors import LlmrunError
from llmrun.runners.progress import RepClock
from llmrun.runners.system import SystemInfo

from . import flags as lb
from . import output as out
from . import plot as bench_plot
from . import sweep_options as o
from .machine import load_and_report
from .serving import Screen


class _Nowhere(io.StringIO):
    """Where the display goes while stderr carries -oe's records: nowhere."""

    def write(self, text: str) -> int:
        return len(text)


@takes_records
def bench(
    context: typer.Context,
    models: o.Models = None,
    *,
    lists: o.SweepLists,
    measured: o.Measured,
    controls: o.Controls,
    hub: o.Hub,
    version: o.Version = False,
    list_devices: o.ListDevices = False,
    delivery: o.Delivery,
    seed: co.PromptSeed = 1234,
) -> None:
    """Measure this machine: llama-bench's tests, sweeps, TTFT, ITL, efficiency and history.

    llmrun bench                          # pp512 and tg128, 5 repetitions

    llmrun bench -t 1,2 -b 64-512*2 -o csv

    llmrun bench -p 0 -n 64 -d 0,512,1024 # decode rate against context depth

    llmrun bench -m a.gguf -m b.gguf      # two models side by side

    Serving load: `llmrun bench serve`; prefill-decode interference: `llmrun bench
    interference`; tuning: `llmrun tune`.
    """
    DisplayThatMayFail.install()  # bench, serve and interference write only their display there
    if context.invoked_subcommand is not None:
        _refuse_own_options(context, context.invoked_subcommand)
        return
    # -oe: stderr holds its records alone, as `2>x.csv` needs; the report, progress, warnings
    # and charts meant for it go nowhere. A failed run's one line reaches it, after the display
    # is put back.
    real_stderr = sys.stderr
    records_on_stderr = controls.output_err not in (None, out.OutputFormat.none)
    nowhere = contextlib.redirect_stderr(_Nowhere()) if records_on_stderr else None
    with handled(), nowhere or contextlib.nullcontext():
        screen = Screen.open(delivery.output)  # as bench serve's and interference's
        err, show, cancel = screen.err, screen.show, screen.cancel
        if list_devices:
            raise typer.Exit(_list_devices())
        set_verbose(controls.verbose)
        plot = bench_plot.plot_file(delivery.plot)
        with ctrl_c_cancels(cancel):
            chosen = hub.models(models)
            if measured.kld and (measured.ppl is None or len(chosen) < 2):
                usage_error(
                    "--kld compares each later model with the first on --ppl's text:"
                    " give --ppl FILE and two or more -m"
                )
            lists.refuse_unusable()
            lb.apply_process_settings(numa=controls.numa, prio=controls.prio)
            sweep = lists.sweep(  # every Measured field is a Sweep field of the same name
                **{**vars(measured), "energy": measured.energy.value},
                prio=controls.prio,
                seed=seed,
                warmup=not controls.no_warmup,
                delay_s=controls.delay,
            )
            to = Output(
                format=delivery.output,
                plot=plot,
                compare=delivery.compare,
                store=not delivery.no_history and measured.reps > 0,  # -r 0 measured nothing
                format_err=controls.output_err,
                progress_lines=controls.progress_lines,
                errors=real_stderr,
            )
            code = _sweep(chosen, sweep, cancel, err, show, to)
        raise typer.Exit(code)


def _refuse_own_options(context: typer.Context, subcommand: str) -> None:
    """bench's own options belong to the sweep, not to a subcommand given after them."""
    unset: tuple[object, ...] = (None, False, (), [])
    given = [
        p.opts[0]
        for p in context.command.params
        if context.params.get(p.name or "") not in (*unset, p.default)
        # a value from LLMRUN_MODEL and the like is the user's setting, not a typed option
        and not set(p.opts) & llmrun.cli.from_environment
    ]
    if given:
        usage_error(
            f"{', '.join(given)}: bench's own options; give them after no"
            f" subcommand, not before `{subcommand}`"
        )


def _list_devices() -> int:
    """llama-bench's --list-devices (common_print_available_devices in llama.cpp's
    common/arg.cpp), line for line: the devices -dev can name, which are all but the CPU ones,
    with their memory in whole MiB; `  (none)` where there is none, as on a CPU-only build."""

    print("Available devices:")
    devices = [d for d in dv.query().devices() if d.kind != "CPU"]
    if not devices:
        print("  (none)")
    for d in devices:
        total, free = (d.total_bytes or 0) // 2**20, (d.free_bytes or 0) // 2**20
        print(f"  {d.name}: {d.description} ({total} MiB, {free} MiB free)")
    return 0


@dataclass(frozen=True)
class Output:
    """Where a run's results go: stdout's format, a chart file, the history, a comparison."""

    format: out.OutputFormat | None
    plot: Path | None
    compare: bool
    store: bool
    format_err: out.OutputFormat | None = None  # llama-bench's -oe: also on stderr
    progress_lines: bool = False  # llama-bench's --progress: a line per test on stderr
    errors: TextIO = field(default_factory=lambda: sys.stderr, repr=False, compare=False)
    """Where -oe's records and a failed run's one line go: stderr, while the display may not."""

    @property
    def format_stdout(self) -> out.OutputFormat | None:
        """The records' format on stdout: md where it is no terminal and -o is not given; None:
        a terminal's table, after the run."""
        if self.format is None and not sys.stdout.isatty():
            return out.OutputFormat.md
        return self.format

    def writers(self, *, several_models: bool) -> list[out.RecordWriter]:
        """stdout's writer first (when its records go there), then -oe's; made before anything
        runs, so a run cut before its first model is ready still ends each format (json's
        `[]`). The fields the run varies are theirs (`shown`) once a model is ready."""
        return [
            out.RecordWriter(
                fmt, stream, several_models=several_models, optional=run.RECORD_OPTIONAL_FIELDS
            )
            for fmt, stream in ((self.format_stdout, sys.stdout), (self.format_err, self.errors))
            if fmt is not None
        ]


class _Bar:
    """The tests' progress on a terminal: the repetition under way (`tg128 rep 2/5`), runs done
    of total, the time taken and an estimate of the time left from each kind of test's last
    repetition; with --progress elsewhere, a line per run. It stops while a model loads or its
    perplexity is computed, and starts again for the next model or context size."""

    def __init__(self, err: Console, lines: bool) -> None:
        self.err, self.lines = err, lines
        self.line = ProgressLine(err)
        self.clock = RepClock()
        self.last: b.Progress | None = None
        self.started_s = 0.0

    def update(self, event: b.Progress) -> None:
        now = time.monotonic()
        if self.last is None or event.done < self.last.done:  # a new model or context size
            self.clock, self.started_s = RepClock(), now
        self.last = event
        if event.moment == "started":
            self.clock.started(event.test, now)
        elif event.moment == "ended":
            self.clock.finished(now)
            if self.lines:  # the label names -ot patterns and devices: text from outside
                self.err.print(
                    f"llmrun: {event.done}/{event.total} {terminal_line(event.label)}", markup=False
                )
        if self.line.view is None:
            self.line.follow(event.label, self._view)

    def _view(self, now: float) -> Shown:
        e = self.last
        assert e is not None
        fraction = e.fraction if e.moment == "working" else 0.0
        return Shown(
            e.label,
            e.done,
            e.total,
            "runs",
            now - self.started_s,
            self.clock.eta_s(now, dict(e.left), fraction),
        )

    def stop(self) -> None:
        self.line.stop()
        self.last = None


def _sweep(
    models: list[str | None],
    sweep: run.Sweep,
    cancel: threading.Event,
    err: Console,
    show: Console,
    output: Output,
) -> int:
    """llama-bench's tests over every combination of settings, for each model in turn; each
    row printed as its test finishes (on stdout, and on stderr with -oe), the run stored."""
    shown = _SweepView(len(models), sweep, err, output)
    events = run.run_sweep(
        models, sweep, cancel=cancel, open_runner=lambda m, c, t: make_bench_runner(m, c, tuned=t)
    )
    failure: LlmrunError | None = None  # a later model or the perplexity failed
    complete = False
    rpc.SALVAGE.append(shown.salvage)
    try:
        for event in events:
            shown.on(event)
        complete = not cancel.is_set()
    except LlmrunError as e:
        failure = e  # the finished rows are printed and stored first, then the one line
    finally:
        with contextlib.suppress(ValueError):
            rpc.SALVAGE.remove(shown.salvage)
        shown.end(complete=complete, empty=failure is None and cancel.is_set())
    stream, writers = shown.stream, shown.writers
    if failure is not None and (stream is None or not stream.done):
        raise failure
    if stream is None:  # cancelled before a model was ready: nothing ran
        print("llmrun: interrupted", file=sys.stderr, flush=True)  # as every command says it
        return EXIT_INTERRUPTED
    lost = writers[0].failed if writers and output.format_stdout is not None else None
    code = _report(stream, shown.skipped, sweep, cancel.is_set(), err, show, output, shown.scores)
    if lost is not None and code == 0:
        raise lost  # all stored; a closed pipe ends quietly (141), a full disk with one line
    if failure is not None and not cancel.is_set():  # Ctrl-C/SIGTERM: 130/143, rows kept
        raise failure
    return code


class _SweepView:
    """A sweep's events as they come: the progress bar, the machine's report at each model,
    each row written as its test finishes, perplexity's status; what was skipped and scored
    kept for the report."""

    def __init__(self, n_models: int, sweep: run.Sweep, err: Console, output: Output) -> None:
        self.n_models, self.sweep, self.err, self.output = n_models, sweep, err, output
        self.skipped: list[b.Skipped] = []
        self.scores: list[run.Scored] = []
        self.system: SystemInfo | None = None
        self.bar = _Bar(err, output.progress_lines and not err.is_terminal)
        self.scoring: Status | None = None
        self.stream: run.RecordStream | None = None
        self.writers = output.writers(several_models=n_models > 1)
        self.rows_on_terminal = output.format_stdout is not None and sys.stdout.isatty()

    def on(self, event: run.SweepEvent) -> None:
        if isinstance(event, run.ModelReady):
            self._ready(event)
        elif isinstance(event, b.Progress):
            self.bar.update(event)
        elif isinstance(event, res.Result):
            assert self.stream is not None
            self.emit(self.stream.add(event))
        elif isinstance(event, b.Skipped):
            self.skipped.append(event)
        elif isinstance(event, run.Scoring):
            self.bar.stop()
            self.scoring = self.err.status(f"perplexity on {event.text.name} ...")
            self.scoring.start()
        else:
            self.scores.append(event)
            if self.scoring is not None:
                self.scoring.stop()
            assert self.stream is not None
            self.emit(self.stream.scored(event))

    def _ready(self, event: run.ModelReady) -> None:
        """A model loaded: the machine's report, and the first model opens the records."""
        sweep = self.sweep
        self.bar.stop()
        self.system = load_and_report(
            event.runner,
            self.err,
            bandwidth=sweep.reps > 0 or bool(sweep.until_ci),  # -r 0: no rate to set it by
            system=self.system,
            combos=event.combos,
            llama_bench_defaults=not sweep.tuned,
        )
        if self.stream is None:
            self.stream = run.RecordStream(
                self.system,
                several_models=self.n_models > 1,
                scenarios=sweep.scenarios,
                ppl_ctx=(sweep.contexts()[0] or run.PPL_CTX) if sweep.ppl else None,
            )
            for w in self.writers:  # llama-bench's md shows the columns the run varies
                w.shown = run.varied_fields(sweep, event.combos)

    def emit(self, recorded: list[run.Recorded]) -> None:
        if recorded and self.rows_on_terminal:
            self.bar.line.stop()  # erased first, or a row would follow the progress on its line
        for r in recorded:
            for w in self.writers:
                w.row(r.record)  # a stream that failed takes no more; the run goes on

    def salvage(self) -> None:
        """An RPC server lost mid-test ends the process: the rows are kept first."""
        if self.stream is not None:
            self.emit(self.stream.end(complete=False))
            for w in self.writers:
                w.close(empty=False)
            _store(self.stream, self.output)

    def end(self, *, complete: bool, empty: bool) -> None:
        """The display stopped and the records ended (`empty`: all skipped, an error, no [])."""
        self.bar.stop()
        if self.scoring is not None:
            self.scoring.stop()
        if self.stream is not None:
            self.emit(self.stream.end(complete=complete))
        for w in self.writers:
            w.close(empty=empty)


def _report(
    stream: run.RecordStream,
    skipped: list[b.Skipped],
    sweep: run.Sweep,
    interrupted: bool,
    err: Console,
    show: Console,
    output: Output,
    scores: Sequence[run.Scored] = (),
) -> int:
    """Skips, the run stored, the terminal's table, extras, chart file and comparison. Exit 1
    when every test was skipped: a run that measured nothing did not succeed."""
    for s in skipped:
        what = f"{s.shape.name} " if s.shape else ""
        err.print(f"skipped: {what}{s.combo.describe()}: {s.reason}", markup=False, style="yellow")
    records = [d.record for d in stream.done]
    rows = [d.row for d in stream.done]
    if interrupted:
        err.print(
            f"llmrun: interrupted: keeping the {len(records)} finished results", style="yellow"
        )
    elif not records and skipped:
        print(
            "llmrun: error: every test was skipped; nothing was measured",
            file=output.errors,
            flush=True,
        )
        return 1
    changes = _store(stream, output, compare=output.compare)
    out.warn_if_busy(records)
    if output.format_stdout is None:  # a terminal: the table, after the run
        show.print(out.results_table(rows))
    _extras(rows, show, score=stream.localscore)
    if output.plot is not None and records:
        bench_plot.plot(rows, output.plot)
        err.print(f"charts written to {output.plot}")
    if scores and sweep.ppl is not None:
        first = scores[0].ppl
        for sc in scores:
            ppl = sc.ppl
            change = f" ({ppl / first - 1:+.2%} against the first)" if ppl != first else ""
            show.print(
                f"perplexity {terminal_line(sc.model)}: {ppl:,.3f}{change} on"
                f" {terminal_line(sweep.ppl.name)}, {sc.tokens} tokens"
                f" scored in windows of {sweep.contexts()[0] or run.PPL_CTX}",
                markup=False,
            )
            if (kld := out.kld_line(sc.kld, sc.kld_missing)) is not None:
                show.print(f"  {kld}", markup=False)
    if changes is not None:
        show.print(out.compare_table(changes))
    return EXIT_INTERRUPTED if interrupted else 0


def _store(
    stream: run.RecordStream, output: Output, *, compare: bool = False
) -> list[out.Change] | None:
    """The finished records into the history (and their comparison, when asked)."""
    return out.store_run(
        [d.record for d in stream.done],
        kind="local",
        model=", ".join(dict.fromkeys(d.row.model_name for d in stream.done)),
        system=vars(stream.system),
        store=output.store,
        compare=compare,
    )


def _extras(rows: list[res.Row], show: Console, *, score: float | None) -> None:
    for line in out.efficiency_lines(rows):
        show.print(line, markup=False)
    for chart in (out.sweep_chart(rows), out.depth_chart(rows), out.model_chart(rows)):
        if chart is not None:
            show.print(chart)
    chunks = out.chunk_report(rows)
    if chunks is not None:
        table, notes = chunks
        show.print(table)
        for note in notes:
            show.print(note, markup=False)
    if score is not None:
        show.print(
            f"score    {round(score, 3):,.1f}  (LocalScore's formula: 10 · cbrt(mean prompt tok/s"
            " · mean output tok/s · 1000 / mean TTFT ms), scenarios scaled)"
        )
