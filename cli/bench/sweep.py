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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, TextIO

import typer
from rich.console import Console
from rich.status import Status

from llmrun.cli.engine import make_bench_runner
from llmrun.cli.errors import EXIT_INTERRUPTED, StdoutConsole, handled, usage_error
from llmrun.cli.progress import ProgressLine, Shown
from llmrun.cli.session import ctrl_c_cancels
from llmrun.cli.terminal import terminal_line
from llmrun.runners import devices as dv
from llmrun.runners.bench import localscore as ls
from llmrun.runners.bench import measure as b
from llmrun.runners.bench import results as res
from llmrun.runners.bench import run
from llmrun.runners.config import LOAD_MODES
from llmrun.runners.errors import LlmrunError
from llmrun.runners.library import set_verbose
from llmrun.runners.limits import CACHE_TYPES
from llmrun.runners.progress import RepClock
from llmrun.runners.system import SystemInfo

from . import flags as lb
from . import output as out
from . import plot as bench_plot
from .machine import load_and_report

PANEL = "Tests (llama-bench's)"


class _DisplayThatMayFail:
    """stderr carries bench's display only: a write that fails there (2>/dev/full, a closed
    terminal) is dropped, so the records still reach stdout and the history."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        with contextlib.suppress(OSError, ValueError):
            self._stream.write(text)
        return len(text)

    def flush(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._stream.flush()

    def isatty(self) -> bool:
        return self._stream.isatty()

    def fileno(self) -> int:
        return self._stream.fileno()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class _Nowhere(io.StringIO):
    """Where the display goes while stderr carries -oe's records: nowhere."""

    def write(self, text: str) -> int:
        return len(text)


@contextlib.contextmanager
def _display_nowhere(on: bool) -> Iterator[TextIO]:
    """-oe: stderr holds its records alone, as `2>x.csv` needs; the report, progress, warnings
    and charts meant for it go nowhere. Yields the stream for the records and, after the
    display is put back, a failed run's one line reaches it too."""
    real = sys.stderr
    if not on:
        yield real
        return
    sys.stderr = _Nowhere()
    try:
        yield real
    finally:
        sys.stderr = real


SWEEP = "Sweep: each takes a comma list or a range such as 8-512*4"
LB = "llama-bench's other options"


def _lists(help_text: str, *names: str, panel: str = SWEEP, metavar: str = "LIST") -> Any:
    """A sweep option that, as in llama-bench, takes a comma list and may be repeated."""
    return typer.Option(
        *names, help=help_text, rich_help_panel=panel, show_default=False, metavar=metavar
    )


def _joined(values: list[str] | None) -> str | None:
    return ",".join(values) if values else None


def _print_version(given: bool) -> None:
    """llama-bench's --version: the versions (llama.cpp's build with them), then exit."""
    if given:
        from llmrun.cli.version import version_line

        print(version_line())
        raise typer.Exit(0)


def bench(
    ctx: typer.Context,
    models: Annotated[
        list[str] | None,
        typer.Option(
            "-m",
            "--model",
            envvar="LLMRUN_MODEL",
            show_default=False,
            rich_help_panel=PANEL,
            help="A .gguf path or Hub reference; repeat for several models, compared side by side."
            " (default: the embedded SmolLM2-135M)",
        ),
    ] = None,
    n_prompt: Annotated[
        list[str] | None,
        _lists(
            "Prompt sizes of pp tests (0: none). (default: 512)", "-p", "--n-prompt", panel=PANEL
        ),
    ] = None,
    n_gen: Annotated[
        list[str] | None,
        _lists(
            "Generation lengths of tg tests (0: none). (default: 128)", "-n", "--n-gen", panel=PANEL
        ),
    ] = None,
    pg: Annotated[
        list[str] | None,
        _lists(
            "A pp+tg test PROMPT,GEN such as 512,128 (repeatable).",
            "-pg",
            "--pg",
            panel=PANEL,
            metavar="PP,TG",
        ),
    ] = None,
    depth: Annotated[
        list[str] | None,
        _lists(
            "Run each test after N tokens already in the KV cache. (default: 0)",
            "-d",
            "--n-depth",
            panel=PANEL,
        ),
    ] = None,
    reps: Annotated[
        int,
        typer.Option(
            "-r",
            "--repetitions",
            min=0,
            rich_help_panel=PANEL,
            help="Timed repetitions per test, after one warm-up (0: the warm-up"
            " only, rows of 0 t/s as llama-bench's, kept out of the history).",
        ),
    ] = 5,
    threads: Annotated[
        list[str] | None,
        _lists(
            "CPU threads. (default: physical cores, or performance cores"
            " of a hybrid CPU, as llama-bench)",
            "-t",
            "--threads",
        ),
    ] = None,
    batch: Annotated[
        list[str] | None,
        _lists(
            "Prefill chunk sizes (n_batch). (default: 2048, as llama-bench; --tuned: 512)",
            "-b",
            "--batch",
            "--batch-size",
        ),
    ] = None,
    ubatch: Annotated[
        list[str] | None,
        _lists("Micro-batch sizes (n_ubatch). (default: 512)", "-ub", "--ubatch", "--ubatch-size"),
    ] = None,
    gpu_layers: Annotated[
        list[str] | None,
        _lists(
            "GPU layers; -1, or more than the model has (99), is all."
            " (default: -1, as llama-bench)",
            "-ngl",
            "--gpu-layers",
            "--n-gpu-layers",
        ),
    ] = None,
    flash_attn: Annotated[
        list[str] | None,
        _lists(
            "on, off, auto (or 1, 0, -1). (default: auto, as llama-bench)", "-fa", "--flash-attn"
        ),
    ] = None,
    cache_type_k: Annotated[
        list[str] | None,
        _lists(
            f"KV cache K types: {', '.join(CACHE_TYPES)}. (default: f16)", "-ctk", "--cache-type-k"
        ),
    ] = None,
    cache_type_v: Annotated[
        list[str] | None,
        _lists(
            "KV cache V types (quantized V needs flash attention). (default: f16)",
            "-ctv",
            "--cache-type-v",
        ),
    ] = None,
    repack: Annotated[
        list[str] | None,
        _lists(
            "Weight repacking for faster CPU kernels, 0 or 1. (default: 1"
            " where a probe found it safe on this CPU)",
            "--repack",
        ),
    ] = None,
    mmap: Annotated[
        list[str] | None,
        _lists(
            "Memory-map the model file, 0 or 1 (older llama-bench's -mmp; same as -lm none/mmap).",
            "-mmp",
            "--mmap",
        ),
    ] = None,
    load_mode: Annotated[
        list[str] | None,
        _lists(f"How weights load: {', '.join(LOAD_MODES)}. (default: auto)", "-lm", "--load-mode"),
    ] = None,
    no_kv_offload: Annotated[
        list[str] | None,
        _lists(
            "Keep the KV cache in host memory, 0 or 1 (GPU builds).", "-nkvo", "--no-kv-offload"
        ),
    ] = None,
    split_mode: Annotated[
        list[str] | None,
        _lists(
            "Split across GPUs: none, layer, row, tensor. (default: layer)",
            "-sm",
            "--split-mode",
            panel=LB,
        ),
    ] = None,
    main_gpu: Annotated[
        list[str] | None,
        _lists("The GPU for -sm none. (default: 0)", "-mg", "--main-gpu", panel=LB),
    ] = None,
    tensor_split: Annotated[
        list[str] | None,
        _lists("Share of the model per GPU, such as 3/1.", "-ts", "--tensor-split", panel=LB),
    ] = None,
    device: Annotated[
        list[str] | None,
        _lists(
            "Devices to use, such as CUDA0/CUDA1. (default: auto)", "-dev", "--device", panel=LB
        ),
    ] = None,
    n_cpu_moe: Annotated[
        list[str] | None,
        _lists(
            "Keep the MoE experts of the first N layers on the CPU.",
            "-ncmoe",
            "--n-cpu-moe",
            panel=LB,
        ),
    ] = None,
    override_tensor: Annotated[
        list[str] | None,
        _lists(
            "Tensor name pattern=buffer type (llama.cpp's -ot).",
            "-ot",
            "--override-tensor",
            panel=LB,
        ),
    ] = None,
    cpu_mask: Annotated[
        list[str] | None,
        _lists(
            "The compute threads' CPUs, a hex mask such as 0x3 for CPUs"
            " 0-1. (default: 0x0, no mask)",
            "-C",
            "--cpu-mask",
            panel=LB,
        ),
    ] = None,
    cpu_strict: Annotated[
        list[str] | None,
        _lists(
            "1: one CPU of the mask per thread, in turn. (default: 0)", "--cpu-strict", panel=LB
        ),
    ] = None,
    poll: Annotated[
        list[str] | None,
        _lists(
            "How long idle compute threads spin before they sleep, 0..100. (default: 50)",
            "--poll",
            panel=LB,
        ),
    ] = None,
    numa: Annotated[
        str | None,
        typer.Option(
            "--numa",
            metavar="distribute|isolate|numactl",
            show_default=False,
            rich_help_panel=LB,
            help="NUMA placement, as llama.cpp's. (default: disabled)",
        ),
    ] = None,
    prio: Annotated[
        int,
        typer.Option(
            "--prio",
            min=-1,
            max=3,
            rich_help_panel=LB,
            help="Process and compute-thread priority: -1 low, 0 normal, 1"
            " medium, 2 high, 3 realtime (raising it may need privileges).",
        ),
    ] = 0,
    delay: Annotated[
        float,
        typer.Option(
            "--delay",
            min=0.0,
            max=3600.0,
            rich_help_panel=LB,
            help="Seconds to wait between tests (lets a hot machine cool).",
        ),
    ] = 0.0,
    no_warmup: Annotated[
        bool,
        typer.Option(
            "--no-warmup", rich_help_panel=LB, help="Skip the untimed warm-up run before each test."
        ),
    ] = False,
    progress_lines: Annotated[
        bool,
        typer.Option(
            "--progress",
            rich_help_panel=LB,
            help="One line per test on stderr (a terminal shows a bar anyway).",
        ),
    ] = False,
    verbose: Annotated[
        bool,
        typer.Option(
            "-v", "--verbose", rich_help_panel=LB, help="Show llama.cpp's own log on stderr."
        ),
    ] = False,
    output_err: Annotated[
        out.OutputFormat | None,
        typer.Option(
            "-oe",
            "--output-err",
            show_default=False,
            rich_help_panel=LB,
            help="Also print the results on stderr in this format.",
        ),
    ] = None,
    embeddings: Annotated[
        list[str] | None,
        _lists(
            "1: the context also outputs every token's embedding, as an"
            " embedding model's does. (default: 0)",
            "-embd",
            "--embeddings",
            panel=LB,
        ),
    ] = None,
    no_op_offload: Annotated[
        list[str] | None,
        _lists(
            "1: operations on weights in host memory are not offloaded to a GPU. (default: 0)",
            "-nopo",
            "--no-op-offload",
            panel=LB,
        ),
    ] = None,
    no_host: Annotated[
        list[str] | None,
        _lists(
            "1: load the weights without a host buffer, so extra buffer"
            " types may take them. (default: 0)",
            "--no-host",
            panel=LB,
        ),
    ] = None,
    lazy_mode: Annotated[
        list[str] | None,
        _lists(
            "Read the tensors a model marks on demand: on, auto (those"
            " over 4 GiB) or off. (default: auto)",
            "-lzm",
            "--lazy-mode",
            panel=LB,
        ),
    ] = None,
    fit_target: Annotated[
        list[str] | None,
        _lists(
            "MiB to leave free per device when fitting: recorded as"
            " given, not applied (llmrun fits -ngl -1 to free memory"
            " itself).",
            "-fitt",
            "--fit-target",
            panel=LB,
        ),
    ] = None,
    fit_ctx: Annotated[
        list[str] | None,
        _lists(
            "The least context fitting may choose: recorded as given, not applied.",
            "-fitc",
            "--fit-ctx",
            panel=LB,
        ),
    ] = None,
    hf_repo: Annotated[
        list[str] | None,
        _lists(
            "A Hub model, owner/repo[:QUANT] (the same as -m).",
            "-hf",
            "-hfr",
            "--hf-repo",
            panel=LB,
            metavar="REPO",
        ),
    ] = None,
    hf_file: Annotated[
        str | None,
        typer.Option(
            "-hff",
            "--hf-file",
            show_default=False,
            rich_help_panel=LB,
            help="The file in --hf-repo (owner/repo/FILE.gguf).",
        ),
    ] = None,
    hf_token: Annotated[
        str | None,
        typer.Option(
            "-hft",
            "--hf-token",
            show_default=False,
            rich_help_panel=LB,
            help="Hub token (default: HF_TOKEN; never printed).",
        ),
    ] = None,
    offline: Annotated[
        bool,
        typer.Option(
            "--offline", rich_help_panel=LB, help="Use the Hub cache only (HF_HUB_OFFLINE)."
        ),
    ] = False,
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            is_eager=True,
            callback=_print_version,
            rich_help_panel=LB,
            help="Print the version and exit.",
        ),
    ] = False,
    list_devices: Annotated[
        bool,
        typer.Option(
            "--list-devices",
            rich_help_panel=LB,
            help="List the devices this llama.cpp can use, and exit.",
        ),
    ] = False,
    ctx_sizes: Annotated[
        list[str] | None,
        _lists(
            "Context sizes: each runs every test, so the KV cache's"
            " memory shows against the context. (default: what the tests"
            " need)",
            "-c",
            "--ctx",
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
    cold: Annotated[
        bool,
        typer.Option(
            "--cold",
            help="Drop the model file from the page cache before each"
            " load (posix_fadvise, no root needed), so load time is measured"
            " from disk; every row records how much of the file was cached.",
        ),
    ] = False,
    draft: Annotated[
        list[str] | None,
        _lists(
            "Prompt-lookup speculative decoding in the generation tests:"
            " at most N drafted tokens a step, a list such as 0,8 (0: off)"
            " to measure with and without in one run.",
            "--draft",
        ),
    ] = None,
    ppl: Annotated[
        Path | None,
        typer.Option(
            "--ppl",
            metavar="FILE",
            show_default=False,
            help="Also measure each model's perplexity on this text"
            " (llama-perplexity's method; windows of -c tokens, default"
            " 512), e.g. examples/declaration_of_independence.txt.",
        ),
    ] = None,
    tuned: Annotated[
        bool,
        typer.Option(
            "--tuned/--no-tuned",
            help="Measure llmrun's own settings in place of"
            " llama-bench's defaults: those `llmrun tune` saved for the model,"
            " else llmrun's (-b 512, the prefill chunk that shows in TTFT).",
        ),
    ] = False,
    output: Annotated[
        out.OutputFormat | None,
        typer.Option(
            "-o",
            "--output",
            show_default=False,
            help="Print the results on stdout as md, csv,"
            " json, jsonl or sql (llama-bench's table)."
            " (default: a table on a terminal, else md)",
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
) -> None:
    """Measure this machine: llama-bench's tests, sweeps, TTFT, ITL, efficiency and history.

    llmrun bench                          # pp512 and tg128, 5 repetitions

    llmrun bench -t 1,2 -b 64-512*2 -o csv

    llmrun bench -p 0 -n 64 -d 0,512,1024 # decode rate against context depth

    llmrun bench -m a.gguf -m b.gguf      # two models side by side

    Serving load: `llmrun bench serve`; prefill-decode interference: `llmrun bench
    interference`; tuning: `llmrun tune`.
    """
    if ctx.invoked_subcommand is not None:
        unset: tuple[object, ...] = (None, False, (), [])
        given = [
            p.opts[0]
            for p in ctx.command.params
            if ctx.params.get(p.name or "") not in (*unset, p.default)
        ]
        if given:
            usage_error(
                f"{', '.join(given)}: bench's own options; give them after no"
                f" subcommand, not before `{ctx.invoked_subcommand}`"
            )
        return
    sys.stderr = _DisplayThatMayFail(sys.stderr)  # bench writes only its display there
    records_on_stderr = output_err not in (None, out.OutputFormat.none)
    with handled(), _display_nowhere(records_on_stderr) as real_stderr:
        err = Console(stderr=True, highlight=False)
        show = StdoutConsole(highlight=False) if output is None and sys.stdout.isatty() else err
        if list_devices:
            raise typer.Exit(_list_devices())
        set_verbose(verbose)
        cancel = threading.Event()
        with ctrl_c_cancels(cancel):
            models = lb.hub_models(models, hf_repo, hf_file, hf_token, offline)
            lb.refuse_unusable(
                split_mode=_joined(split_mode),
                main_gpu=_joined(main_gpu),
                tensor_split=_joined(tensor_split),
                device=_joined(device),
                n_cpu_moe=_joined(n_cpu_moe),
                override_tensor=_joined(override_tensor),
            )
            lb.apply_process_settings(numa=numa, prio=prio)
            sweep = run.Sweep(
                shapes=run.parse_shapes(
                    _joined(n_prompt) or "512",
                    _joined(n_gen) or "128",
                    pg or [],
                    _joined(depth) or "0",
                    scenarios,
                    scenario_scale,
                ),
                threads=_joined(threads),
                batch=_joined(batch),
                ubatch=_joined(ubatch),
                gpu_layers=_joined(gpu_layers),
                flash_attn=_joined(flash_attn),
                cache_type_k=_joined(cache_type_k) or "f16",
                cache_type_v=_joined(cache_type_v) or "f16",
                repack=_joined(repack),
                mmap=_joined(mmap),
                load_mode=_joined(load_mode),
                split_mode=_joined(split_mode),
                main_gpu=_joined(main_gpu),
                tensor_split=_joined(tensor_split),
                tensor_overrides=_joined(override_tensor),
                n_cpu_moe=_joined(n_cpu_moe),
                devices=_joined(device),
                draft=_joined(draft),
                fit_target=_joined(fit_target),
                fit_ctx=_joined(fit_ctx),
                no_kv_offload=_joined(no_kv_offload),
                cpu_mask=_joined(cpu_mask),
                cpu_strict=_joined(cpu_strict),
                poll=_joined(poll),
                lazy_mode=_joined(lazy_mode),
                no_host=_joined(no_host),
                embeddings=_joined(embeddings),
                no_op_offload=_joined(no_op_offload),
                prio=prio,
                reps=reps,
                ctx=_joined(ctx_sizes),
                seed=seed,
                scenarios=scenarios,
                warmup=not no_warmup,
                delay_s=delay,
                tuned=tuned,
                ppl=ppl,
                cold=cold,
            )
            to = Output(
                format=output,
                plot=plot,
                compare=compare,
                store=not no_history and reps > 0,  # -r 0 measured nothing
                format_err=output_err,
                progress_lines=progress_lines,
                errors=real_stderr,
            )
            chosen: list[str | None] = list(models) if models else [None]
            code = _sweep(chosen, sweep, cancel, err, show, to)
        raise typer.Exit(code)


def _list_devices() -> int:
    """llama-bench's --list-devices: what this llama.cpp can compute on."""

    print("Available devices:")
    for d in dv.query().devices():
        memory = ""
        if d.total_bytes:
            memory = f" ({d.total_bytes // 2**20} MiB, {(d.free_bytes or 0) // 2**20} MiB free)"
        print(f"  {d.name}: {d.description}{memory} [{d.kind}, {d.backend}]")
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
        made = [
            out.RecordWriter(
                fmt, stream, several_models=several_models, optional=run.RECORD_OPTIONAL_FIELDS
            )
            for fmt, stream in ((self.format_stdout, sys.stdout), (self.format_err, self.errors))
            if fmt is not None
        ]
        return made


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
    skipped: list[b.Skipped] = []
    scores: list[run.Scored] = []
    system: SystemInfo | None = None
    bar = _Bar(err, output.progress_lines and not err.is_terminal)
    scoring: Status | None = None
    stream: run.RecordStream | None = None
    writers = output.writers(several_models=len(models) > 1)
    events = run.run_sweep(
        models, sweep, cancel=cancel, open_runner=lambda m, c, t: make_bench_runner(m, c, tuned=t)
    )
    failure: LlmrunError | None = None  # a later model or the perplexity failed
    complete = False

    rows_on_terminal = output.format_stdout is not None and sys.stdout.isatty()

    def emit(recorded: list[run.Recorded]) -> None:
        if recorded and rows_on_terminal:
            bar.line.stop()  # erased first, or a row would follow the progress text on its line
        for r in recorded:
            for w in writers:
                w.row(r.record)  # a stream that failed takes no more; the run goes on

    try:
        for event in events:
            if isinstance(event, run.ModelReady):
                bar.stop()
                system = load_and_report(
                    event.runner,
                    err,
                    bandwidth=True,
                    system=system,
                    combos=event.combos,
                    llama_bench_defaults=not sweep.tuned,
                )
                if stream is None:
                    stream = run.RecordStream(
                        system,
                        several_models=len(models) > 1,
                        scenarios=sweep.scenarios,
                        ppl_ctx=(sweep.contexts()[0] or run.PPL_CTX) if sweep.ppl else None,
                    )
                    for w in writers:  # llama-bench's md shows the columns the run varies
                        w.shown = run.varied_fields(sweep, event.combos)
            elif isinstance(event, b.Progress):
                bar.update(event)
            elif isinstance(event, res.Result):
                assert stream is not None
                emit(stream.add(event))
            elif isinstance(event, b.Skipped):
                skipped.append(event)
            elif isinstance(event, run.Scoring):
                bar.stop()
                scoring = err.status(f"perplexity on {event.text.name} ...")
                scoring.start()
            else:
                scores.append(event)
                if scoring is not None:
                    scoring.stop()
                assert stream is not None
                emit(stream.scored(event))
        complete = not cancel.is_set()
    except LlmrunError as e:
        failure = e  # the finished rows are printed and stored first, then the one line
    finally:
        bar.stop()
        if scoring is not None:
            scoring.stop()
        if stream is not None:
            emit(stream.end(complete=complete))
        for w in writers:
            w.close(empty=failure is None and cancel.is_set())  # all skipped: an error, no []
    if failure is not None and (stream is None or not stream.done):
        raise failure
    if stream is None:  # cancelled before a model was ready: nothing ran
        return EXIT_INTERRUPTED
    lost = writers[0].failed if writers and output.format_stdout is not None else None
    code = _report(stream, skipped, sweep, cancel.is_set(), err, show, output, scores)
    if lost is not None and code == 0:
        raise lost  # all stored; a closed pipe ends quietly (141), a full disk with one line
    if failure is not None and not cancel.is_set():  # Ctrl-C/SIGTERM: 130/143, rows kept
        raise failure
    return code


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
        err.print(f"interrupted: keeping the {len(records)} finished results", style="yellow")
    elif not records and skipped:
        print(
            "llmrun: error: every test was skipped; nothing was measured",
            file=output.errors,
            flush=True,
        )
        return 1
    changes = out.store_run(
        records,
        kind="local",
        model=", ".join(dict.fromkeys(r.model_name for r in rows)),
        system=vars(stream.system),
        store=output.store,
        compare=output.compare,
    )
    out.warn_if_busy(records)
    if output.format_stdout is None:  # a terminal: the table, after the run
        show.print(out.results_table(rows))
    _extras(rows, show, score=stream.localscore)
    if output.plot is not None and records:
        bench_plot.plot(rows, output.plot)
        err.print(f"charts written to {output.plot}")
    if scores and sweep.ppl is not None:
        first = scores[0].ppl
        for name, ppl, n in ((sc.model, sc.ppl, sc.tokens) for sc in scores):
            change = f" ({ppl / first - 1:+.2%} against the first)" if ppl != first else ""
            show.print(
                f"perplexity {terminal_line(name)}: {ppl:,.3f}{change} on"
                f" {terminal_line(sweep.ppl.name)}, {n} tokens"
                f" scored in windows of {sweep.contexts()[0] or run.PPL_CTX}",
                markup=False,
            )
    if changes is not None:
        show.print(out.compare_table(changes))
    return EXIT_INTERRUPTED if interrupted else 0


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
