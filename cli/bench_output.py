"""Bench results as llama-bench writes them (md, csv, json, jsonl, sql) and as rich tables.

Records carry llama-bench's field names first, then llmrun's own, so a script that reads
llama-bench output reads ours.
"""

from __future__ import annotations

import csv
import io
import json
import sys
from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from llmrun.runners.history import Change, History, HistoryError
from llmrun.runners.stats import human_count

from .dashboard import bars


class OutputFormat(str, Enum):
    md = "md"
    csv = "csv"
    json = "json"
    jsonl = "jsonl"
    sql = "sql"


SWEPT_COLUMNS = (
    ("n_batch", "n_batch"), ("n_ubatch", "n_ubatch"), ("n_gpu_layers", "ngl"),
    ("flash_attn", "fa"), ("type_k", "type_k"), ("type_v", "type_v"),
)  # fmt: skip


def _flat(value: Any) -> Any:
    if isinstance(value, list):
        return " ".join(str(v) for v in value)
    return value


def is_pp(record: dict[str, Any]) -> bool:
    """A prompt-processing test alone (no generation)."""
    return bool(record["n_prompt"]) and not record["n_gen"]


def is_tg(record: dict[str, Any]) -> bool:
    """A generation test alone (no prompt)."""
    return bool(record["n_gen"]) and not record["n_prompt"]


def _varying(records: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(k, h) for k, h in SWEPT_COLUMNS if len({str(r.get(k)) for r in records}) > 1]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.2f}"


def to_markdown(records: Sequence[dict[str, Any]]) -> str:
    """llama-bench's table (model | size | params | backend | threads | test | t/s), plus TTFT
    and ITL columns."""
    varying = _varying(records)
    head = ["model", "size", "params", "backend", "threads", *(h for _, h in varying), "test",
            "t/s", "TTFT ms", "ITL p50 ms", "ITL p99 ms"]  # fmt: skip
    rows = []
    for r in records:
        rows.append([
            r["model_type"], human_count(r["model_size"], "B"), human_count(r["model_n_params"]),
            r["backends"], str(r["n_threads"]), *(str(r.get(k)) for k, _ in varying), r["test"],
            f"{r['avg_ts']:.2f} ± {r['stddev_ts']:.2f}", _ms(r.get("ttft_ms")),
            _ms(r.get("itl_p50_ms")), _ms(r.get("itl_p99_ms")),
        ])  # fmt: skip
    numeric = {"threads", "t/s", "TTFT ms", "ITL p50 ms", "ITL p99 ms", "size", "params"}
    lines = ["| " + " | ".join(head) + " |",
             "| " + " | ".join("---:" if h in numeric else "---" for h in head) + " |"]  # fmt: skip
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def to_csv(records: Sequence[dict[str, Any]]) -> str:
    if not records:
        return ""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(records[0]), lineterminator="\n")
    writer.writeheader()
    for r in records:
        writer.writerow({k: _flat(v) for k, v in r.items()})
    return buf.getvalue()


def _sql_value(value: Any) -> str:
    value = _flat(value)
    if value is None:
        return "NULL"
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, (int, float)):
        return repr(value)
    return "'" + str(value).replace("'", "''") + "'"


def _sql_type(value: Any) -> str:
    if isinstance(value, (bool, int)):
        return "INTEGER"
    if isinstance(value, float):
        return "REAL"
    return "TEXT"


def to_sql(records: Sequence[dict[str, Any]]) -> str:
    """CREATE TABLE test (...) and one INSERT per result: pipes into sqlite3, as llama-bench's."""
    if not records:
        return ""
    fields = list(records[0])
    types = {f: next((_sql_type(r[f]) for r in records if r.get(f) is not None), "TEXT")
             for f in fields}  # fmt: skip
    lines = ["CREATE TABLE IF NOT EXISTS test ("]
    lines += [f"  {f} {types[f]}{',' if i < len(fields) - 1 else ''}" for i, f in enumerate(fields)]
    lines.append(");")
    for r in records:
        values = ", ".join(_sql_value(r.get(f)) for f in fields)
        lines.append(f"INSERT INTO test ({', '.join(fields)}) VALUES ({values});")
    return "\n".join(lines) + "\n"


def cell(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:,.2f}" if isinstance(value, float) else str(value)


def format_records(
    records: Sequence[dict[str, Any]],
    fmt: OutputFormat,
    markdown: Callable[[], str] | None = None,
) -> str:
    """The records in a machine format; md is llama-bench's table unless the caller, which
    knows what it measured, gives its own (the serving benchmark does)."""
    if fmt is OutputFormat.md:
        return markdown() if markdown is not None else to_markdown(records)
    if fmt is OutputFormat.csv:
        return to_csv(records)
    if fmt is OutputFormat.json:
        return json.dumps(list(records), indent=2, ensure_ascii=False) + "\n"
    if fmt is OutputFormat.jsonl:
        return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    return to_sql(records)


# ---- on a terminal --------------------------------------------------------------------------


def results_table(records: Sequence[dict[str, Any]], title: str = "results") -> Table:
    varying = _varying(records)
    table = Table(title=title, title_justify="left")
    for name in ("test", "threads", *(h for _, h in varying), "t/s", "TTFT ms", "ITL p50/p99 ms"):
        table.add_column(name, justify="left" if name == "test" else "right")
    for r in records:
        itl = "-" if r.get("itl_p50_ms") is None else f"{r['itl_p50_ms']:.1f}/{r['itl_p99_ms']:.1f}"
        table.add_row(
            r["test"], str(r["n_threads"]), *(str(r.get(k)) for k, _ in varying),
            f"{r['avg_ts']:,.1f} ± {r['stddev_ts']:,.1f}", _ms(r.get("ttft_ms")), itl,
        )  # fmt: skip
    return table


def efficiency_lines(records: Sequence[dict[str, Any]]) -> list[str]:
    lines = []
    for r in records:
        if r.get("bw_util") is not None:
            lines.append(
                f"{r['test']}: decode moves {r['decode_bw_gbs']:.1f} GB/s (weights + KV cache per"
                f" token) = {r['bw_util']:.0%} of the measured {r['mem_bw_gbs']:.1f} GB/s"
            )
        if r.get("prefill_gflops") is not None:
            lines.append(f"{r['test']}: prefill runs at {r['prefill_gflops']:,.1f} GFLOP/s"
                         " (2 x parameters x tok/s)")  # fmt: skip
    return lines


def sweep_chart(records: Sequence[dict[str, Any]]) -> RenderableType | None:
    """Prompt tok/s against output tok/s for every configuration of the sweep."""
    varying = _varying(records)
    by_config: dict[str, dict[str, float]] = {}
    for r in records:
        if r["n_depth"]:
            continue
        label = " ".join(f"{h}={r.get(k)}" for k, h in [("n_threads", "t"), *varying]) or "default"
        kind = "pp" if is_pp(r) else "tg" if is_tg(r) else None
        if kind:
            by_config.setdefault(label, {})[kind] = r["avg_ts"]
    rows = []
    for label, v in by_config.items():
        if "pp" in v:
            rows.append((f"{label} prompt", v["pp"], "cyan"))
        if "tg" in v:
            rows.append((f"{label} output", v["tg"], "magenta"))
    if not rows:
        return None
    return Group(Text("prompt tok/s vs output tok/s", style="bold"), bars(rows))


def depth_chart(records: Sequence[dict[str, Any]]) -> RenderableType | None:
    """Decode rate against context depth, when several depths ran."""
    points = [(r["n_depth"], r["avg_ts"]) for r in records if is_tg(r)]
    if len({d for d, _ in points}) < 2:
        return None
    rows = [(f"d{d}", v, "magenta") for d, v in sorted(points)]
    return Group(Text("output tok/s by context depth", style="bold"), bars(rows))


def chunk_report(records: Sequence[dict[str, Any]]) -> tuple[Table, list[str]] | None:
    """Prefill tok/s and TTFT per chunk size; whether the chunk sizes agree on the next token."""
    pp = [r for r in records if is_pp(r)]
    if len({r["n_batch"] for r in pp}) < 2:
        return None
    table = Table(title="chunked prefill: the chunk size trade-off", title_justify="left")
    for name in ("test", "n_batch", "n_ubatch", "prompt tok/s", "TTFT ms", "next token"):
        table.add_column(name, justify="left" if name == "test" else "right")
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in pp:
        key = (r["test"], r["n_threads"], r["flash_attn"], r["type_k"], r["type_v"],
               r["n_gpu_layers"])  # fmt: skip
        groups.setdefault(key, []).append(r)
    notes = []
    for key, rows in groups.items():
        for r in sorted(rows, key=lambda r: r["n_batch"]):
            table.add_row(
                r["test"], str(r["n_batch"]), str(r["n_ubatch"]), f"{r['avg_ts']:,.1f}",
                _ms(r.get("ttft_ms")), str(r.get("next_token")),
            )  # fmt: skip
        tokens = {r.get("next_token") for r in rows}
        if len(rows) > 1:
            if len(tokens) == 1:
                notes.append(f"{key[0]}: all {len(rows)} chunk sizes agree on the next token"
                             f" ({tokens.pop()})")  # fmt: skip
            else:
                notes.append(f"{key[0]}: the chunk sizes DISAGREE on the next token: "
                             + ", ".join(f"batch {r['n_batch']} -> {r.get('next_token')}"
                                         for r in rows))  # fmt: skip
    return table, notes


def _rate(r: dict[str, Any]) -> str:
    if r.get("avg_ts") is None:
        return "-"
    return f"{r['avg_ts']:,.1f} ± {r.get('stddev_ts') or 0:,.1f}"


def compare_table(changes: Sequence[Change]) -> Table:
    table = Table(title="against the previous run", title_justify="left")
    for name in ("test", "threads", "t/s now", "t/s before", "change", "verdict"):
        table.add_column(name, justify="left" if name in ("test", "verdict") else "right")
    styles = {"regression": "red", "improvement": "green"}
    for c in changes:
        r, p = c.record, c.previous
        table.add_row(
            c.test, str(r.get("n_threads", "-")), _rate(r), "-" if p is None else _rate(p),
            "-" if c.change is None else f"{c.change:+.1%}",
            Text(c.verdict + (f" (run {c.previous_run})" if c.previous_run else ""),
                 style=styles.get(c.verdict, "")),
        )  # fmt: skip
    return table


def store_and_print(
    records: Sequence[dict[str, Any]],
    *,
    kind: str,
    model: str,
    system: dict[str, Any],
    output: OutputFormat | None,
    show: Console,
    table: Table,
    store: bool,
    compare: bool,
    markdown: Callable[[], str] | None = None,
) -> list[Change] | None:
    """Store the run, then print the results: a closed pipe while printing loses nothing.

    Returns the comparison with earlier runs when asked for, to be shown after the results.
    """
    changes = None
    if records and (store or compare):
        try:
            with History() as history:
                run_id = (
                    history.store(records, kind=kind, model=model, system=system)
                    if store else None
                )  # fmt: skip
                if compare:
                    changes = history.compare(records, before_run=run_id)
        except HistoryError as e:  # the results still reach stdout
            print(f"llmrun: warning: {e}; this run was not stored", file=sys.stderr, flush=True)
    busy = [r for r in records if r.get("busy")]
    if busy:
        worst = max(float(r.get("background_cpus") or 0) for r in busy)
        print(f"llmrun: warning: other processes kept up to {worst:.1f} CPUs busy during"
              f" {len(busy)} of {len(records)} tests: their figures are unreliable",
              file=sys.stderr, flush=True)  # fmt: skip
    if output is not None:
        sys.stdout.write(format_records(records, output, markdown))
        sys.stdout.flush()
    elif sys.stdout.isatty():
        show.print(table)
    else:
        sys.stdout.write(format_records(records, OutputFormat.md, markdown))
        sys.stdout.flush()
    return changes
