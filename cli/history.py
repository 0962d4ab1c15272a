"""`llmrun history`: the stored bench runs, each against the run before it; two sets of them
compared as llama.cpp's compare-llama-bench.py does; the runs exported as llama-bench's table."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.text import Text

from llmrun.runners.errors import BadRequestError, OptionError
from llmrun.runners.history import (
    SQLITE_MAX_INT,
    Comparison,
    History,
    Pair,
    compare_sets,
    parse_selector,
    write_database,
)

from .bench import output as out
from .errors import StdoutConsole, handled, usage_error
from .records import OptionRecord, takes_records
from .report import Fitted, fitted_table
from .terminal import for_stream, terminal_line, terminal_text


class CompareFormat(str, Enum):
    md = "md"
    csv = "csv"
    json = "json"


SELECTOR_HELP = (
    "a build commit, or KEY=VALUE terms joined by commas that all hold: build=, run=3 or"
    " run=3-5, date=2026-11-30 (or a month, a year), since=DAY, until=DAY, model=NAME,"
    " tool=llama-bench (its own rows in this database) or tool=llmrun, or a setting by"
    " llama-bench's flag: t=4, b=2048, ub=512, ngl=99, fa=on, ctk=q8_0, d=512"
)

# compare-llama-bench.py's column heads
HEADS = {
    "cpu_info": "CPU",
    "gpu_info": "GPU",
    "backends": "Backends",
    "n_gpu_layers": "GPU layers",
    "tensor_buft_overrides": "Tensor overrides",
    "model_filename": "File",
    "model_type": "Model",
    "n_batch": "Batch size",
    "n_ubatch": "Microbatch size",
    "embeddings": "Embeddings",
    "cpu_mask": "CPU mask",
    "cpu_strict": "CPU strict",
    "poll": "Poll",
    "n_threads": "Threads",
    "type_k": "K type",
    "type_v": "V type",
    "load_mode": "Load mode",
    "no_kv_offload": "NKVO",
    "split_mode": "Split mode",
    "main_gpu": "Main GPU",
    "tensor_split": "Tensor split",
    "flash_attn": "FlashAttention",
    "n_cpu_moe": "CPU MoE",
    "fit_target": "Fit target",
    "fit_min_ctx": "Fit min ctx",
    "repack": "Repack",
    "draft": "Draft",
    "tool": "Tool",
}


@dataclass(frozen=True, kw_only=True)
class CompareOptions(OptionRecord):
    """Two sets of the stored results compared, as compare-llama-bench.py does."""

    baseline: Annotated[
        str | None,
        typer.Option(
            "-b",
            "--baseline",
            help=f"Compare two sets of results; this one is the baseline: {SELECTOR_HELP}.",
        ),
    ] = None
    compare: Annotated[
        str | None,
        typer.Option(
            "-c",
            "--compare",
            help="The set compared with the baseline, chosen the same way (default: the"
            " newest run outside the baseline).",
        ),
    ] = None
    show: Annotated[
        str | None,
        typer.Option(
            "-s",
            "--show",
            help="The comparison's columns, comma-separated key fields (n_threads,"
            " n_batch, flash_attn...); results differing only in others are"
            " averaged together, as compare-llama-bench.py's --show.",
        ),
    ] = None
    output: Annotated[
        CompareFormat | None,
        typer.Option("-o", "--output", help="Print the comparison on stdout as md, csv or json."),
    ] = None


@takes_records
def history(
    *,
    limit: Annotated[
        int, typer.Option("-n", "--limit", min=1, max=SQLITE_MAX_INT, help="How many runs.")
    ] = 10,
    model: Annotated[
        str | None,
        typer.Option("-m", "--model", help="Only runs of models whose name contains this."),
    ] = None,
    comparing: CompareOptions,
    export_sql: Annotated[
        str | None,
        typer.Option(
            "--export-sql",
            metavar="FILE",
            help="Write the stored bench results into a new SQLite file as"
            " llama-bench's table (compare-llama-bench.py -i FILE reads it); '-'"
            " prints the SQL, for `| sqlite3` into an existing one.",
        ),
    ] = None,
) -> None:
    """The stored bench runs, newest first, each against the run before it; or two sets of
    them compared (-b, -c); or the runs exported for llama.cpp's compare-llama-bench.py."""
    c = comparing
    refined = c.compare or c.show or c.output
    if export_sql is not None and (c.baseline or refined):
        usage_error("--export-sql writes every stored result: give it without -b, -c, -s or -o")
    if c.baseline is None and refined:
        usage_error("-c, -s and -o belong to a comparison: give the baseline with -b too")
    with handled(), History() as h:
        console = StdoutConsole(highlight=False)
        if export_sql is not None:
            _export(h, export_sql, model)
        elif c.baseline is not None:
            base = parse_selector(c.baseline, option="-b")
            other = None if c.compare is None else parse_selector(c.compare, option="-c")
            fields = None if c.show is None else [f.strip() for f in c.show.split(",") if f.strip()]
            results = h.bench_results(model=model)
            if not results:
                raise BadRequestError(f"no bench results stored{_of(model)} (in {h.path})")
            _print_comparison(compare_sets(results, base, other, show=fields), c.output, console)
        else:
            _list(h, limit, model, console)


def _list(h: History, limit: int, model: str | None, console: StdoutConsole) -> None:
    runs = h.runs(limit=limit, model=model)
    if not runs:
        if model and h.runs(limit=1):
            empty = f"no stored run's model name contains {model!r}"
        else:
            empty = "no bench runs stored yet"
        # LLMRUN_HOME's name may hold escape sequences
        console.print(terminal_line(f"{empty} (in {h.path})"), markup=False)
        return
    for run in runs:
        title = terminal_line(f"run {run['id']} · {run['time']} · {run['kind']} · {run['model']}")
        if run["records"]:
            changes = h.compare(run["records"], before_run=run["id"])
            console.print(out.compare_table(changes, title))
        else:  # not an empty table: the rows were there, and damaged
            console.print(title, markup=False)
        skipped = run["unreadable"]
        if skipped:
            console.print(
                f"  {skipped} damaged result{'s' if skipped > 1 else ''} of run {run['id']}"
                " skipped (not a JSON record, or a rate, load or setting that is no value"
                " a measurement has)",
                markup=False,
            )


def _export(h: History, target: str, model: str | None) -> None:
    if not target.strip():  # Path('') is '.': it said `. exists: ... | sqlite3 .`
        raise OptionError("--export-sql: give a new file's name, or - for the SQL on stdout")
    try:  # a name over 255 bytes (ENAMETOOLONG) or in a folder not to be read (EACCES)
        folder = Path(target).is_dir()
    except OSError as e:  # said "File name too long: <the path>", naming no option
        why = e.strerror or e
        raise BadRequestError(f"--export-sql {target}: cannot write it: {why}") from None
    if folder:
        raise BadRequestError(f"--export-sql {target}: a folder; give a new file's name")
    # llmrun's own results: llama-bench's rows in the history are in a llama_bench table already
    records = [s.record for s in h.bench_results(model=model) if s.tool == "llmrun"]
    if not records:
        raise BadRequestError(f"no bench results stored{_of(model)} (in {h.path})")
    sql = out.format_records(records, out.OutputFormat.sql)
    if target == "-":
        sys.stdout.write(for_stream(sql, sys.stdout))
        sys.stdout.flush()
        return
    write_database(Path(target), sql)
    print(  # the file's name as given may hold escape sequences: never raw on a terminal
        terminal_line(
            f"{len(records)} results written to {target} (llama-bench's table llama_bench)"
        ),
        file=sys.stderr,
    )


def _of(model: str | None) -> str:
    return f" of a model whose name contains {model!r}" if model else ""


def _cell(value: object) -> str:
    return "-" if value is None else str(value)


def to_markdown(c: Comparison) -> str:
    """compare-llama-bench.py's table, with each side's spread and runs, the ratio's 95 %
    interval and the verdict."""
    figures = [f"t/s {c.baseline}", f"t/s {c.compare}", "Speedup", CI_HEAD, "Runs"]
    heads = [*(HEADS.get(f, f) for f in c.shown), "Test", *figures, "Verdict"]
    rows = [[*(_cell(v) for _, v in p.shown), p.test, *_figures(p), p.verdict] for p in c.pairs]
    right = {i for i, h in enumerate(heads) if h in figures}
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(heads)]

    def line(cells: list[str]) -> str:
        fitted = [
            text.rjust(w) if i in right else text.ljust(w)
            for i, (text, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "| " + " | ".join(fitted) + " |"

    rule = [("-" * (w + 1) + ":") if i in right else "-" * (w + 2) for i, w in enumerate(widths)]
    return "\n".join([line(heads), "|" + "|".join(rule) + "|", *(line(r) for r in rows)]) + "\n"


# The ratio of the two sides' geometric means with its 95 % interval (Welch on log rates)
CI_HEAD = "ratio (95 % CI)"


def _figures(p: Pair) -> list[str]:
    """A pair's cells between its test and its verdict, in the table and in md alike: each
    side's t/s, the speedup, the ratio's interval, the runs a side."""
    found = p.difference
    return [
        *(f"{side.avg_ts:.2f} ± {side.stddev_ts:.2f}" for side in (p.baseline, p.compare)),
        out.num(p.speedup, ".2f"),
        "-" if found is None else found.interval,
        f"{p.baseline.runs}/{p.compare.runs}",
    ]


def _print_comparison(c: Comparison, fmt: CompareFormat | None, console: StdoutConsole) -> None:
    notes = []
    if c.ignored:
        notes.append(f"paired across {', '.join(c.ignored)}, which the sets fix")
    if c.unpaired_baseline or c.unpaired_compare:
        notes.append(
            f"left out, no partner with the same test and settings: {c.unpaired_baseline}"
            f" in the baseline, {c.unpaired_compare} in the compare set"
        )
    for note in notes:
        print(terminal_line(f"llmrun: {note}"), file=sys.stderr, flush=True)
    if fmt is CompareFormat.md:  # stored text: a terminal gets no escape sequence
        sys.stdout.write(for_stream(to_markdown(c), sys.stdout))
    elif fmt is not None:  # csv, json: the flat records
        records = out.format_records(c.records(), out.OutputFormat(fmt.value))
        sys.stdout.write(for_stream(records, sys.stdout))
    else:
        console.print(_table(c))
        return
    sys.stdout.flush()


def _table(c: Comparison) -> Fitted:
    title = f"compare {c.compare!r} against baseline {c.baseline!r}"
    texts = [*(HEADS.get(f, f) for f in c.shown), "test"]
    figures = ["t/s baseline", "t/s compare", "speedup", CI_HEAD, "runs"]
    heads, left = [*texts, *figures, "verdict"], [*texts, "verdict"]
    table = fitted_table(Text(terminal_line(title)), heads, left, wrap=("verdict",))
    for p in c.pairs:
        table.add_row(  # stored text: never read as markup
            *(Text(terminal_text(_cell(v))) for _, v in p.shown),
            Text(terminal_line(p.test)),
            *_figures(p),
            Text(p.verdict, style=out.verdict_style(p.verdict)),
        )
    return table
