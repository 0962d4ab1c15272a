"""Bench results as llama-bench writes them (md, csv, json, jsonl, sql) and as rich tables.

Records carry llama-bench's field names first, then llmrun's own, so a script that reads
llama-bench output reads ours.
"""

from __future__ import annotations

import csv
import io
import json
import sys
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, TextIO

from rich.console import Console, Group, RenderableType
from rich.text import Text

from llmrun.cli.dashboard import bars
from llmrun.cli.report import Fitted, busy_warning, fitted_table, joules
from llmrun.cli.terminal import for_stream, terminal_line
from llmrun.runners.bench.results import (
    LLAMA_BENCH_BOOL,
    LLAMA_BENCH_FIELDS,
    LLAMA_BENCH_INT,
    LLAMA_BENCH_REAL,
    SWEPT_FIELDS,
    Row,
)
from llmrun.runners.history import Change, History, HistoryError
from llmrun.runners.kld import KldStats
from llmrun.runners.significance import describe


class OutputFormat(str, Enum):
    md = "md"
    csv = "csv"
    json = "json"
    jsonl = "jsonl"
    sql = "sql"
    none = "none"  # llama-bench's: no records on this stream


# The settings a sweep can vary (their record fields) and their column heads
SWEPT_COLUMNS = tuple(
    zip(
        SWEPT_FIELDS,
        (
            "n_batch",
            "n_ubatch",
            "ngl",
            "fa",
            "type_k",
            "type_v",
            "repack",
            "nkvo",
            "lm",
            "ctx",
            "KV bytes",
            "draft",
            "cpu_mask",
            "strict",
            "poll",
            "lzm",
            "noh",
            "embd",
            "nopo",
        ),
        strict=True,
    )
)


def _flat(value: Any) -> Any:
    if isinstance(value, list):
        return " ".join(str(v) for v in value)
    if isinstance(value, bool):  # as llama-bench writes them outside JSON
        return int(value)
    return value


def _varying(records: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """The swept settings (field, column head) whose values tell the records apart."""
    return [(k, h) for k, h in SWEPT_COLUMNS if len({str(r.get(k)) for r in records}) > 1]


def _models(names: Iterable[object]) -> list[str]:
    """The model names of a run's rows or records, each once, in order."""
    return list(dict.fromkeys(map(str, names)))


def num(value: float | None, spec: str) -> str:
    """A figure in `spec`'s format, '-' where there is none."""
    return "-" if value is None else format(value, spec)


def _ms(value: float | None) -> str:
    return num(value, ",.2f")


# llama-bench's markdown: (field, header, width; negative = left-aligned), and its defaults: a
# column shows when a value differs from llama-bench's default or varies, as in llama-bench.
_MD_OPTIONAL = (
    ("n_cpu_moe", "n_cpu_moe", 10, 0),
    ("cpu_mask", "cpu_mask", -10, "0x0"),
    ("cpu_strict", "cpu_strict", 10, False),
    ("poll", "poll", 10, 50),
    ("n_batch", "n_batch", 7, 2048),
    ("n_ubatch", "n_ubatch", 8, 512),
    ("type_k", "type_k", 6, "f16"),
    ("type_v", "type_v", 6, "f16"),
    ("main_gpu", "main_gpu", 10, 0),
    ("split_mode", "sm", 6, "layer"),
    ("no_kv_offload", "nkvo", 10, False),
    ("flash_attn", "fa", 3, -1),
    ("devices", "dev", -12, "auto"),
    ("tensor_split", "ts", -12, "0.00"),
    ("tensor_buft_overrides", "ot", -10, "none"),
    ("load_mode", "lm", 10, "auto"),
    ("lazy_mode", "lazy_mode", -10, "auto"),
    ("embeddings", "embd", 10, False),
    ("no_op_offload", "nopo", 4, 0),
    ("no_host", "noh", 4, False),
    ("repack", "rpk", 3, True),
)


def _mib(size: int) -> str:
    gib = 1024**3
    return f"{size / 1024**2:.2f} MiB" if size < gib else f"{size / gib:.2f} GiB"


def _params(n: int) -> str:
    return f"{n / 1e6:.2f} M" if n < 1e9 else f"{n / 1e9:.2f} B"


def _md_value(value: Any) -> str:
    return str(int(value)) if isinstance(value, bool) else str(value)


def _md_columns(
    sample: Sequence[dict[str, Any]], shown: Collection[str] = (), *, several_models: bool = False
) -> list[tuple[str, str, int]]:
    """llama-bench's columns, as it chooses them before its first row: a setting shows when it
    varies (`shown`: the record fields the run varies) or differs from llama-bench's default;
    llmrun's TTFT and ITL columns after t/s."""
    cpu = all(str(r.get("backends", "CPU")) in ("CPU", "BLAS") for r in sample)
    cols: list[tuple[str, str, int]] = [
        ("model", "model", -30),
        ("size", "size", 10),
        ("params", "params", 10),
        ("backend", "backend", -10),
    ]
    if not cpu:
        cols.append(("n_gpu_layers", "ngl", 3))
    cols.append(("n_threads", "threads", 7))
    for key, head, width, default in _MD_OPTIONAL:
        values = {_md_value(r.get(key)) for r in sample}
        if key in shown or len(values) > 1 or values != {_md_value(default)}:
            cols.append((key, head, width))
    cols += [("test", "test", 15), ("t/s", "t/s", 20)]
    if several_models:
        cols += [("rel", "vs first", 8), ("rel_ci", "vs first, 95 % CI", -17)]
        cols += [("rel_verdict", "verdict", -7), ("weights", "weights", 10), ("kv", "KV", 10)]
    elif "n_ctx" in shown:  # -c sweeps: memory against context
        cols += [("n_ctx", "ctx", 6), ("kv", "KV", 10)]
    if "draft" in shown or any(r.get("draft") for r in sample):  # with and without, side by side
        cols += [("draft", "draft", 5), ("accept", "accepted", 8), ("tps", "tok/step", 8)]
    if "ppl" in shown or any(r.get("ppl") is not None for r in sample):
        cols += [("ppl", "ppl", 8), ("dppl", "ppl vs first", 12)]
    if "kld_mean" in shown or any(r.get("kld_mean") is not None for r in sample):
        cols += [("kld", "KLD vs first", 17), ("kld99", "KLD p99", 8), ("top", "same top", 8)]
    if "until_ci_pct" in shown or any(r.get("until_ci_pct") is not None for r in sample):
        cols += [("reps", "reps", 5), ("ci95", "95 % CI", 8)]  # --until-ci: what it took
    cols += [("ttft", "TTFT ms", 10), ("itl50", "ITL p50 ms", 10), ("itl99", "ITL p99 ms", 10)]
    if any(r.get("energy_j") is not None for r in sample):  # measured, not merely asked for
        cols.append(("energy", "energy/token", 18))
    return cols


def energy_cell(j_per_token: float | None, watts: float | None) -> str:
    """A test's joules per token above idle and its mean power: `2.40 J · 24.0 W`."""
    if j_per_token is None or watts is None:
        return "-"
    return f"{joules(j_per_token)} · {watts:,.1f} W"


def kld_line(kld: KldStats | None, missing: str | None) -> str | None:
    """A later model's KL divergence from the first, as llama-perplexity's summary names its
    figures; the first model (the base) has none."""
    if missing is not None:
        return f"KLD against the first: not comparable ({missing})"
    if kld is None:
        return None
    return (
        f"KLD against the first: mean {kld.kld_mean:.6f} ± {kld.kld_mean_unc:.6f},"
        f" median {kld.kld_median:.6f}, 99% {kld.kld_p99:.6f}, max {kld.kld_max:.6f};"
        f" same top p {kld.same_top_p:.3%} ± {kld.same_top_p_unc:.3%};"
        f" mean Δp {kld.dp_mean:+.3%} ± {kld.dp_mean_unc:.3%}, RMS Δp {kld.dp_rms:.3%}"
        f" ± {kld.dp_rms_unc:.3%}; over {kld.positions:,} positions"
    )


def _md_value_of(r: dict[str, Any], key: str) -> str:
    special = {
        "model": lambda: str(r["model_type"]),
        "size": lambda: _mib(r["model_size"]),
        "params": lambda: _params(r["model_n_params"]),
        "backend": lambda: str(r["backends"]),
        "test": lambda: str(r["test"]),
        "t/s": lambda: f"{r['avg_ts']:.2f} ± {r['stddev_ts']:.2f}",
        "ttft": lambda: _ms(r.get("ttft_ms")),
        "itl50": lambda: _ms(r.get("itl_p50_ms")),
        "itl99": lambda: _ms(r.get("itl_p99_ms")),
        "rel": lambda: "-" if r.get("relative_ts") is None else f"x{r['relative_ts']:.2f}",
        "rel_ci": lambda: _ci(r.get("relative_low"), r.get("relative_high")),
        "rel_verdict": lambda: _rel_verdict(r),
        "weights": lambda: _mib(r["weights_bytes"]) if r.get("weights_bytes") else "-",
        "kv": lambda: _mib(r["kv_bytes"]) if r.get("kv_bytes") else "-",
        "ppl": lambda: num(r.get("ppl"), ".3f"),
        "draft": lambda: str(r.get("draft") or 0),
        "accept": lambda: num(r.get("acceptance_rate"), ".0%"),
        "tps": lambda: num(r.get("tokens_per_step"), ".2f"),
        "dppl": lambda: num(r.get("ppl_change"), "+.2%"),
        "kld": lambda: (
            "-" if r.get("kld_mean") is None else f"{r['kld_mean']:.5f} ± {r['kld_mean_unc']:.5f}"
        ),
        "kld99": lambda: num(r.get("kld_p99"), ".4f"),
        "top": lambda: num(r.get("same_top_p"), ".2%"),
        "reps": lambda: str(r.get("repetitions", "-")),
        "ci95": lambda: _half(r.get("ci95_pct"), r.get("until_ci_stop")),
        "energy": lambda: energy_cell(r.get("energy_j_per_token"), r.get("energy_w")),
    }
    return special[key]() if key in special else _md_value(r.get(key))


def _ci(low: float | None, high: float | None) -> str:
    """A ratio's 95 % interval, `0.97-1.05`; '-' where there is none."""
    return "-" if low is None or high is None else f"{low:.3f}-{high:.3f}"


def _rel_verdict(r: dict[str, Any]) -> str:
    """The relative column's verdict, in the words of every comparison; the first model's rows
    are the baseline ('-')."""
    verdict, reps = r.get("relative_verdict"), r.get("relative_reps")
    if verdict is None or not isinstance(reps, list) or len(reps) != 2:
        return "-"
    return describe(
        str(verdict),
        needed=r.get("relative_needed_reps"),
        reps=(int(reps[0]), int(reps[1])),
        busy=bool(r.get("relative_busy")),
    )


def _half(pct: float | None, stop: str | None) -> str:
    """--until-ci's half-width reached, and why it stopped short of the target if it did."""
    shown = "-" if pct is None else f"±{pct:.2f}%"
    return shown if stop in (None, "reached") else f"{shown} ({stop})"


def verdict_style(verdict: str) -> str:
    """A verdict's colour: slower (or the spread rule's regression) red, faster green."""
    if verdict.startswith(("slower", "regression")):
        return "red"
    if verdict.startswith(("faster", "improvement")):
        return "green"
    return ""


def _md_line(cols: Sequence[tuple[str, str, int]], cells: Sequence[str]) -> str:
    out = (t.ljust(-w) if w < 0 else t.rjust(w) for t, (_, _, w) in zip(cells, cols, strict=True))
    return "| " + " | ".join(out) + " |"


def _md_head(cols: Sequence[tuple[str, str, int]]) -> str:
    rule = " | ".join("-" * (abs(w) - 1) + (":" if w > 0 else "-") for _, _, w in cols)
    return _md_line(cols, [head for _, head, _ in cols]) + "\n| " + rule + " |\n"


def _md_footer(records: Sequence[dict[str, Any]]) -> str:
    builds = dict.fromkeys(f"{r.get('build_commit')} ({r.get('build_number')})" for r in records)
    return "\nbuild: " + ", ".join(builds) + "\n"


def _sql_value(value: Any) -> str:
    value = _flat(value)
    if value is None:
        return "NULL"
    if isinstance(value, (int, float)):
        return repr(value)
    return "'" + str(value).replace("'", "''") + "'"


def _sql_type(field: str, records: Sequence[dict[str, Any]]) -> str:
    if field in LLAMA_BENCH_REAL:
        return "REAL"
    if field in LLAMA_BENCH_INT or field in LLAMA_BENCH_BOOL:
        return "INTEGER"
    if field in LLAMA_BENCH_FIELDS:
        return "TEXT"
    value = next((r[field] for r in records if r.get(field) is not None), None)
    if isinstance(value, (bool, int)):
        return "INTEGER"
    return "REAL" if isinstance(value, float) else "TEXT"


def _sql_create(table: str, made: Sequence[str], records: Sequence[dict[str, Any]]) -> str:
    columns = ",\n".join(f"  {f} {_sql_type(f, records)}" for f in made)
    lines = [f"CREATE TABLE IF NOT EXISTS {table} (", columns, ");"]
    if table == "llama_bench":  # llmrun's figures beside llama-bench's columns
        lines += [
            f"CREATE TABLE IF NOT EXISTS {table}_llmrun (bench_rowid INTEGER PRIMARY KEY,"
            " figures TEXT NOT NULL);"
        ]
    return "\n".join(lines) + "\n\n"


def _sql_insert(table: str, r: dict[str, Any], core: Sequence[str]) -> str:
    """One INSERT into the table's `core` columns (llama_bench's: every column this llama.cpp's
    llama-bench fills, as it fills them, so `WHERE repack = 0` finds llmrun's rows too; the
    text goes where llama-bench's own SQL goes, `| sqlite3 file`). The row's other figures go,
    as one JSON object, into `{table}_llmrun` keyed by its rowid: no schema to evolve, no
    figure dropped, whatever ran before."""
    values = ", ".join(_sql_value(r.get(f)) for f in core)
    text = f"INSERT INTO {table} ({', '.join(core)}) VALUES ({values});\n"
    figures = {f: v for f, v in r.items() if f not in core}
    if figures:
        text += (
            f"INSERT OR REPLACE INTO {table}_llmrun (bench_rowid, figures) VALUES"
            f" (last_insert_rowid(), {_sql_value(json.dumps(figures))});\n"
        )
    return text


def cell(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:,.2f}" if isinstance(value, float) else str(value)


def format_records(
    records: Sequence[dict[str, Any]],
    fmt: OutputFormat,
    *,
    table: str = "llama_bench",
    md_columns: Sequence[str] | None = None,
) -> str:
    """A finished run's records in a format: `RecordWriter`'s text, every row then the end,
    its header chosen knowing every row (csv's and sql's columns are all the rows' fields)."""
    buf = io.StringIO()
    every = list(dict.fromkeys(k for r in records for k in r))
    shown = [k for k in every if len({str(r.get(k)) for r in records}) > 1]
    writer = RecordWriter(
        fmt,
        buf,
        shown=shown,
        several_models=len(_models(r.get("model_name", "") for r in records)) > 1,
        optional=every,
        table=table,
        md_columns=md_columns,
        sample=records,
    )
    for r in records:
        writer.row(r)
    writer.close()
    return buf.getvalue()


class RecordWriter:
    """Records on one stream in one format, each written and flushed as it comes, as
    llama-bench's printers do: csv's header then a row each, json's `[` then an object each
    (closed by `close`, on the way out of a failed or interrupted run too), jsonl's line each,
    sql's CREATE TABLEs then INSERTs each, md's header then a row each. Every format llmrun
    prints records in is written here; `format_records` writes a finished batch through it.

    The header comes with the first row, when its columns are known: `shown` names the record
    fields the run varies (llama-bench's md shows their columns, as llama-bench chooses them
    from its options); `sample`, the rows known before the first (a batch), to choose from.
    `table`: sql's table, llama-bench's `llama_bench` (its columns, llmrun's figures beside
    them) or one of llmrun's own with every field a column. `md_columns`: None for
    llama-bench's table, else a plain table of these fields (empty: each row's own, a new
    header where they change). A write that fails is kept in `failed` and nothing more is
    written."""

    def __init__(
        self,
        fmt: OutputFormat,
        stream: TextIO,
        *,
        shown: Collection[str] = (),
        several_models: bool = False,
        optional: Sequence[str] = (),
        table: str = "llama_bench",
        md_columns: Sequence[str] | None = None,
        sample: Sequence[dict[str, Any]] = (),
    ) -> None:
        self.fmt, self.stream = fmt, stream
        self.shown, self.several_models = frozenset(shown), several_models
        self.optional = optional  # fields some rows carry: csv's and sql's columns name them
        self.table, self.md_columns, self.sample = table, md_columns, sample
        self.failed: OSError | None = None
        self.records: list[dict[str, Any]] = []
        self._md: list[tuple[str, str, int]] = []
        self._plain: tuple[str, ...] = ()  # a plain md table's columns, once its header is out
        # llama_bench's columns, as this llama.cpp's llama-bench creates and fills them (an older
        # llama-bench's table, without the newer columns, takes neither tool's INSERTs)
        self._sql: Sequence[str] = LLAMA_BENCH_FIELDS
        self._csv: csv.DictWriter[str] | None = None
        self._buf = io.StringIO()
        self._closed = False

    def row(self, record: dict[str, Any]) -> None:
        if self.fmt is OutputFormat.none:
            return
        first = not self.records
        self.records.append(record)
        self._write((self._header(record) if first else "") + self._row(record, first))

    def close(self, *, empty: bool = True) -> None:
        """The format's end (json's `]`, llama-bench md's build line); `empty`: a run cut
        before its first row (Ctrl-C) still prints json's `[]`."""
        if self._closed or self.fmt is OutputFormat.none:
            return
        self._closed = True
        if self.fmt is OutputFormat.json and (self.records or empty):
            self._write("\n]\n" if self.records else "[]\n")
        elif self.fmt is OutputFormat.md and self.records and self.md_columns is None:
            self._write(_md_footer(self.records))

    def _fields(self, first: dict[str, Any]) -> list[str]:
        return [*first, *(f for f in self.optional if f not in first)]

    def _header(self, first: dict[str, Any]) -> str:
        sample = self.sample or [first]
        if self.fmt is OutputFormat.csv:
            self._csv = csv.DictWriter(
                self._buf,
                fieldnames=self._fields(first),
                lineterminator="\n",
                extrasaction="ignore",
            )
            self._csv.writeheader()
            return self._taken()
        if self.fmt is OutputFormat.json:
            return "[\n"
        if self.fmt is OutputFormat.sql:
            if self.table != "llama_bench":  # llmrun's own: every field a column
                self._sql = self._fields(first)
            return _sql_create(self.table, self._sql, sample)
        if self.fmt is OutputFormat.md and self.md_columns is None:
            self._md = _md_columns(sample, self.shown, several_models=self.several_models)
            return _md_head(self._md)
        return ""

    def _row(self, r: dict[str, Any], first: bool) -> str:
        if self.fmt is OutputFormat.csv:
            assert self._csv is not None
            self._csv.writerow({k: _flat(v) for k, v in r.items()})
            return self._taken()
        if self.fmt is OutputFormat.json:  # llama-bench's json_printer, field by field
            fields = ",\n".join(
                f"    {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}" for k, v in r.items()
            )
            return ("" if first else ",\n") + "  {\n" + fields + "\n  }"
        if self.fmt is OutputFormat.jsonl:
            return json.dumps(r, ensure_ascii=False) + "\n"
        if self.fmt is OutputFormat.sql:
            return _sql_insert(self.table, r, self._sql)
        if self.md_columns is not None:
            return self._plain_row(r)
        return _md_line(self._md, [_md_value_of(r, key) for key, _, _ in self._md]) + "\n"

    def _plain_row(self, r: dict[str, Any]) -> str:
        """A plain md table's row, after its header where the columns are new."""
        columns = tuple(self.md_columns or r)
        head = ""
        if columns != self._plain:
            self._plain = columns
            head = (
                "| " + " | ".join(columns) + " |\n| " + " | ".join("---" for _ in columns) + " |\n"
            )
        return head + "| " + " | ".join(cell(r.get(c)) for c in columns) + " |\n"

    def _taken(self) -> str:
        text = self._buf.getvalue()
        self._buf.seek(0)
        self._buf.truncate()
        return text

    def _write(self, text: str) -> None:
        if self.failed is not None:
            return
        try:
            self.stream.write(for_stream(text, self.stream))  # a terminal gets no escapes
            self.stream.flush()
        except OSError as e:  # a closed pipe, a full disk: the run stops, its rows are kept
            self.failed = e


# ---- on a terminal --------------------------------------------------------------------------


def results_table(rows: Sequence[Row], title: str = "results") -> Fitted:
    varying = _varying([r.swept for r in rows])
    several = len(_models(r.model_name for r in rows)) > 1
    if any(r.result.settings.tuned for r in rows):
        title += (
            " (tuned settings from `llmrun tune`, as --tuned asks; without it:"
            " llama-bench's defaults)"
        )
    heads = (["model"] if several else []) + ["test", "threads", *(h for _, h in varying), "t/s"]
    heads += ["vs first", "verdict"] if several else []
    until = any(r.result.until_ci_pct is not None for r in rows)
    heads += (["reps", "95 % CI"] if until else []) + ["TTFT ms", "ITL p50/p99 ms"]
    energy = any(r.result.energy is not None and r.result.energy.energy_j is not None for r in rows)
    heads += ["energy/token"] if energy else []
    table = fitted_table(title, heads, ("test", "model", "verdict"), wrap=("verdict",))
    for r in rows:
        itl = "-" if r.itl_p50_ms is None else f"{r.itl_p50_ms:.1f}/{r.itl_p99_ms:.1f}"
        rel = r.relative_ts
        ci = _ci(r.relative.get("relative_low"), r.relative.get("relative_high"))
        shown = "-" if rel is None else f"x{rel:.2f}" + ("" if ci == "-" else f" ({ci})")
        verdict = _rel_verdict(dict(r.relative))
        against: list[str | Text] = [shown, Text(verdict, style=verdict_style(verdict))]
        took = [str(len(r.result.samples_s)), _half(r.result.ci95_pct, r.result.until_ci_stop)]
        e = r.result.energy
        spent = "-" if e is None else energy_cell(e.j_per_token, e.power_w)
        table.add_row(
            *([r.model_name] if several else []),
            r.test,
            str(r.n_threads),
            *(str(r.swept.get(k)) for k, _ in varying),
            f"{r.avg_ts:,.1f} ± {r.stddev_ts:,.1f}",
            *(against if several else []),
            *(took if until else []),
            _ms(r.ttft_ms),
            itl,
            *([spent] if energy else []),
        )
    return table


# A chart's bars: prompt (pp) then output (tg), each in its colour
_PHASES = (("pp", "prompt", "cyan"), ("tg", "output", "magenta"))


def _chart(title: str, rows: Sequence[tuple[str, float | None, str]]) -> RenderableType | None:
    """Bars under a bold title; None where there is no bar to draw."""
    return Group(Text(title, style="bold"), bars(rows)) if rows else None


def model_chart(rows: Sequence[Row]) -> RenderableType | None:
    """Prompt and output tok/s of each model, on one scale."""
    models = _models(r.model_name for r in rows)
    if len(models) < 2:
        return None
    bars_: list[tuple[str, float | None, str]] = []
    for name in models:
        mine = [r for r in rows if r.model_name == name and not r.n_depth]
        for kind, label, style in _PHASES:
            rates = [r.avg_ts for r in mine if r.kind == kind]
            if rates:
                bars_.append((f"{name} {label}", max(rates), style))
    return _chart("models side by side (best tok/s of each)", bars_)


def efficiency_lines(rows: Sequence[Row]) -> list[str]:
    lines = []
    for r in rows:
        e = r.efficiency
        if e.bw_util is not None:
            lines.append(
                f"{r.test}: decode moves {e.decode_bw_gbs:.1f} GB/s (weights + KV cache per"
                f" token) = {e.bw_util:.0%} of {e.weights_bw_gbs:,.1f} GB/s, the memory the"
                f" weights are in ({e.mem_bw_source})"
            )
        if e.prefill_gflops is not None:
            lines.append(
                f"{r.test}: prefill runs at {e.prefill_gflops:,.1f} GFLOP/s"
                " (2 x parameters x tok/s)"
            )
    return lines


def sweep_chart(rows: Sequence[Row]) -> RenderableType | None:
    """Prompt tok/s against output tok/s for every configuration of the sweep."""
    varying = _varying([r.swept for r in rows])
    several = len(_models(r.model_name for r in rows)) > 1
    by_config: dict[str, dict[str, float]] = {}
    for r in rows:
        if r.n_depth or r.kind == "pg":
            continue
        settings = [("t", r.n_threads), *((h, r.swept.get(k)) for k, h in varying)]
        # a setting a row does not have (draft=None) is left out, not printed
        label = " ".join(f"{h}={v}" for h, v in settings if v is not None) or "default"
        if several:
            label = f"{r.model_name} {label}"
        by_config.setdefault(label, {})[r.kind] = r.avg_ts
    lines = [
        (f"{label} {name}", v[kind], style)
        for label, v in by_config.items()
        for kind, name, style in _PHASES
        if kind in v
    ]
    return _chart("prompt tok/s vs output tok/s", lines)


def depth_chart(rows: Sequence[Row]) -> RenderableType | None:
    """Decode rate against context depth, when several depths ran."""
    points = [(r.n_depth, r.avg_ts) for r in rows if r.kind == "tg"]
    if len({d for d, _ in points}) < 2:
        return None
    bars_ = [(f"d{d}", v, "magenta") for d, v in sorted(points)]
    return _chart("output tok/s by context depth", bars_)


def chunk_report(rows: Sequence[Row]) -> tuple[Fitted, list[str]] | None:
    """Prefill tok/s and TTFT per chunk size; whether the chunk sizes agree on the next token."""
    pp = [r for r in rows if r.kind == "pp"]
    if len({r.n_batch for r in pp}) < 2:
        return None
    heads = ("test", "n_batch", "n_ubatch", "prompt tok/s", "TTFT ms", "next token")
    table = fitted_table("chunked prefill: the chunk size trade-off", heads, ("test",))
    groups: dict[tuple[Any, ...], list[Row]] = {}
    for r in pp:
        st = r.result.settings
        key = (r.test, r.n_threads, st.flash_attn, st.type_k, st.type_v, st.n_gpu_layers_asked)
        groups.setdefault(key, []).append(r)
    notes = []
    for key, group in groups.items():
        for r in sorted(group, key=lambda r: r.n_batch):
            table.add_row(
                r.test,
                str(r.n_batch),
                str(r.result.n_ubatch),
                f"{r.avg_ts:,.1f}",
                _ms(r.ttft_ms),
                str(r.result.next_token),
            )
        tokens = {r.result.next_token for r in group}
        if len(group) > 1:
            if len(tokens) == 1:
                notes.append(
                    f"{key[0]}: all {len(group)} chunk sizes agree on the next token"
                    f" ({tokens.pop()})"
                )
            else:
                notes.append(
                    f"{key[0]}: the chunk sizes DISAGREE on the next token: "
                    + ", ".join(f"batch {r.n_batch} -> {r.result.next_token}" for r in group)
                )
    return table, notes


def _rate(r: dict[str, Any]) -> str:
    if r.get("avg_ts") is None:
        return "-"
    return f"{r['avg_ts']:,.1f} ± {r.get('stddev_ts') or 0:,.1f}"


def _shown(value: object) -> Text:
    """A record's value in a table cell: its text, never read as markup or escapes."""
    return Text(terminal_line(str(value)))


def compare_table(changes: Sequence[Change], title: str = "against the previous run") -> Fitted:
    varying = _varying([c.record for c in changes])  # every setting that tells rows apart
    several = len(_models(c.record.get("model_name", "") for c in changes)) > 1
    heads = (["model"] if several else []) + ["test", "threads", *(h for _, h in varying)]
    heads += ["t/s now", "t/s before", "change", "ratio (95 % CI)", "verdict"]
    table = fitted_table(Text(title), heads, ("test", "verdict", "model"), wrap=("verdict",))
    for c in changes:
        r, p = c.record, c.previous
        found = c.difference
        table.add_row(  # a stored record's text: no markup, no escape sequence
            *([_shown(r.get("model_name"))] if several else []),
            _shown(c.test),
            _shown(r.get("n_threads", "-")),
            *(_shown(r.get(k)) for k, _ in varying),
            _rate(r),
            "-" if p is None else _rate(p),
            "-" if c.change is None else f"{c.change:+.1%}",
            "-" if found is None else found.interval,
            Text(
                c.verdict + (f" (run {c.previous_run})" if c.previous_run else ""),
                style=verdict_style(c.verdict),
            ),
        )
    return table


def store_run(
    records: Sequence[dict[str, Any]],
    *,
    kind: str,
    model: str,
    system: dict[str, Any],
    store: bool,
    compare: bool,
) -> list[Change] | None:
    """Store the run in the history (one run per model) and, when asked, its comparison with
    earlier runs. A history that fails costs a warning, never the records."""
    if not records or not (store or compare):
        return None
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in records:  # several models: one run in the history for each
        groups.setdefault(str(r.get("model_name", model)), []).append(r)
    try:
        with History() as history:
            found: list[Change] = []
            for name, mine in groups.items():
                run_id = (
                    history.store(mine, kind=kind, model=name, system=system) if store else None
                )
                if compare:
                    found += history.compare(mine, before_run=run_id)
            return found if compare else None
    except HistoryError as e:  # the results still reach stdout
        print(f"llmrun: warning: {e}; this run was not stored", file=sys.stderr, flush=True)
        return None


def warn_if_busy(records: Sequence[dict[str, Any]]) -> None:
    busy = [r for r in records if r.get("busy")]
    if busy:
        worst = max(float(r.get("background_cpus") or 0) for r in busy)
        threads = max(
            max(int(r.get("n_threads") or 1), int(r.get("n_threads_batch") or 1)) for r in busy
        )
        spinning = any(r.get("poll") not in (None, 0, "0") for r in busy)  # bench's records
        print(
            busy_warning(worst, threads, f"{len(busy)} of {len(records)} tests", poll=spinning),
            file=sys.stderr,
            flush=True,
        )


@dataclass(frozen=True, kw_only=True)
class RunRecords:
    """A finished run's records and what they are: the history's kind, model and system, and
    how stdout prints them (`print_records`'s sql table and md columns)."""

    records: Sequence[dict[str, Any]]
    kind: str
    model: str
    system: dict[str, Any]
    sql_table: str = "llama_bench"
    md_columns: Sequence[str] | None = None


def store_and_print(
    run: RunRecords,
    *,
    output: OutputFormat | None,
    show: Console,
    table: Fitted,
    store: bool,
    compare: bool,
) -> list[Change] | None:
    """Store the run, then print the results: a closed pipe while printing loses nothing.

    Returns the comparison with earlier runs when asked for, to be shown after the results.
    """
    records = run.records
    changes = store_run(
        records, kind=run.kind, model=run.model, system=run.system, store=store, compare=compare
    )
    warn_if_busy(records)
    print_records(records, output, table=run.sql_table, md_columns=run.md_columns)
    if output is None and sys.stdout.isatty():
        show.print(table)
    return changes


def print_records(
    records: Sequence[dict[str, Any]],
    output: OutputFormat | None,
    *,
    table: str,
    md_columns: Sequence[str] | None,
) -> None:
    """The records on stdout in `output`; with none, md where stdout is no terminal (a
    terminal gets the command's own table instead)."""
    if output is None and sys.stdout.isatty():
        return
    fmt = OutputFormat.md if output is None else output
    text = format_records(records, fmt, table=table, md_columns=md_columns)
    sys.stdout.write(for_stream(text, sys.stdout))  # a terminal gets no escape sequence
    sys.stdout.flush()
