"""Every bench run, kept in SQLite in the user's data directory, and comparisons between runs.

A result is compared with the newest earlier result of the same key: the same model file (name
and size), the same settings and the same test shape. The two runs' repetitions give the ratio
with its 95 % interval and a verdict (`significance.compare`: faster, slower, or no difference
detectable and how many repetitions would resolve 2 %). A record without its repetitions (one
written by hand or by another tool) is judged by the older rule: a regression or an improvement
only when the two runs' spreads (mean ± stddev) do not overlap.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import functools
import json
import math
import os
import re
import sqlite3
import statistics
import tempfile
import time as clock
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard, TypeVar

from .bench.results import (
    FLASH_ATTN_CODES,
    LLAMA_BENCH_BOOL,
    LLAMA_BENCH_FIELDS,
    LLAMA_BENCH_INT,
    LLAMA_BENCH_REAL,
    LLAMA_DEFAULTS,
    llmrun_build,
)
from .errors import BadRequestError, OptionError
from .paths import data_dir
from .significance import Difference, record_fields
from .significance import compare as compare_rates
from .system import busy_machine

SQLITE_MAX_INT = 2**63 - 1  # SQLite's largest INTEGER; a LIMIT past it is an OverflowError

KEY_FIELDS = (
    "model_filename",
    "model_size",
    "backends",
    "n_threads",
    "n_batch",
    "n_ubatch",
    "type_k",
    "type_v",
    "n_gpu_layers",
    "flash_attn",
    "n_prompt",
    "n_gen",
    "n_depth",
    "endpoint",
    "concurrency",
    "request_rate",
    "repack",
    "no_kv_offload",
    "load_mode",
)

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    time TEXT NOT NULL,
    kind TEXT NOT NULL,
    model TEXT NOT NULL,
    system TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS results (
    run_id INTEGER NOT NULL REFERENCES runs(id),
    key TEXT NOT NULL,
    test TEXT NOT NULL,
    avg_ts REAL,
    stddev_ts REAL,
    record TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS results_key ON results(key, run_id);
"""


def history_path() -> Path:
    return data_dir() / "history.sqlite"


def result_key(record: dict[str, Any]) -> str:
    path = str(record.get("model_filename") or "")
    named = {**record, "model_filename": path.rsplit("/", 1)[-1]}
    return json.dumps([named.get(k) for k in KEY_FIELDS])


@dataclass(frozen=True)
class Change:
    test: str
    record: dict[str, Any]
    previous: dict[str, Any] | None
    previous_run: int | None

    @property
    def change(self) -> float | None:
        if not self.previous or not self.previous.get("avg_ts"):
            return None
        return float(self.record["avg_ts"]) / float(self.previous["avg_ts"]) - 1

    @property
    def difference(self) -> Difference | None:
        """The two runs' repetitions compared (None: new, or a side kept no repetitions)."""
        return None if self.previous is None else difference(self.previous, self.record)

    @property
    def verdict(self) -> str:
        return "new" if self.previous is None else verdict(self.previous, self.record)


def rates(record: Mapping[str, Any]) -> tuple[float, ...]:
    """A record's rate in each repetition (llama-bench's `samples_ts`), () where it has none."""
    samples = record.get("samples_ts")
    if not isinstance(samples, list) or not all(_is_number(x) for x in samples):
        return ()
    return tuple(float(x) for x in samples)


def busy_pair(new: Mapping[str, Any], old: Mapping[str, Any]) -> bool:
    """Other processes took the CPU during either, or the two ran under different loads: those
    are not comparable (llama.cpp's threads spin-wait, so a fraction of a CPU taken by others
    changes the figures)."""
    return _busy(new) or _busy(old) or abs(_background(new) - _background(old)) > 0.25


def difference(old: Mapping[str, Any], new: Mapping[str, Any]) -> Difference | None:
    """`new`'s repetitions against `old`'s, busy machine marked; None where either kept none."""
    a, b = rates(old), rates(new)
    if not (a and b):
        return None
    return compare_rates(a, b, busy=busy_pair(new, old))


def verdict(old: Mapping[str, Any], new: Mapping[str, Any]) -> str:
    """faster / slower with the interval, else no difference detectable with the repetitions
    that would resolve 2 %; the spread rule (`spread_verdict`) without repetitions."""
    found = difference(old, new)
    return found.text if found is not None else spread_verdict(new, old)


def spread_verdict(new: Mapping[str, Any], old: Mapping[str, Any]) -> str:
    """regression / improvement when the two mean ± stddev ranges do not overlap, else 'within
    spread'; 'noise (busy machine)' when other processes took the CPU during either."""
    if new.get("avg_ts") is None or old.get("avg_ts") is None:
        return "no rate"
    (new_low, new_high), (old_low, old_high) = (
        (r["avg_ts"] - (r.get("stddev_ts") or 0), r["avg_ts"] + (r.get("stddev_ts") or 0))
        for r in (new, old)
    )
    if new_high < old_low or new_low > old_high:
        if busy_pair(new, old):
            return "noise (busy machine)"
        return "regression" if new_high < old_low else "improvement"
    return "within spread"


class HistoryError(BadRequestError):
    """The history database cannot be opened, read or written (corrupt, locked, read-only)."""

    def __init__(self, path: Path, problem: object) -> None:
        super().__init__(f"bench history {path}: {problem}")


# Another llmrun storing a run at the same moment holds the lock briefly: wait for it, in
# tries of ATTEMPT_S each. SQLite sleeps inside C, where Python's signal handlers cannot run: a
# single 10 s timeout held Ctrl-C and SIGTERM off until it ran out; between tries they end it.
BUSY_TIMEOUT_S = 10.0
ATTEMPT_S = 0.1

T = TypeVar("T")


def _locked(e: sqlite3.Error) -> bool:
    """Another connection holds the lock this one needs (SQLITE_BUSY, SQLITE_LOCKED)."""
    code = getattr(e, "sqlite_errorcode", None)
    if code is None:
        return "locked" in str(e)
    return code & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)


class History:
    def __init__(self, path: Path | None = None) -> None:
        self.path = path or history_path()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.db = sqlite3.connect(self.path, timeout=ATTEMPT_S)
        except (OSError, sqlite3.Error) as e:
            raise HistoryError(self.path, e) from None
        # TEXT that is not UTF-8 (written by hand or by another program) is read with U+FFFD,
        # as a BLOB is: sqlite3's default decoding failed every query that met such a row
        # (`history`, -b/-c, --export-sql all refused the whole database for one bad time).
        self.db.text_factory = _text
        try:
            self._patiently(self._open)
        except BaseException:  # HistoryError, or Ctrl-C while another process holds the lock
            with contextlib.suppress(sqlite3.Error):
                self.db.close()
            raise

    def _open(self) -> None:
        """A database from another program or an older llmrun is refused, not half-used."""
        self.db.executescript(SCHEMA)
        for table, needed in (
            ("runs", {"id", "time", "kind", "model", "system"}),
            ("results", {"run_id", "key", "test", "avg_ts", "stddev_ts", "record"}),
        ):
            columns = {row[1] for row in self.db.execute(f"PRAGMA table_info({table})")}
            missing = needed - columns
            if missing:
                raise sqlite3.DatabaseError(
                    f"table {table} lacks {', '.join(sorted(missing))} (another schema)"
                )

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> History:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _patiently(self, work: Callable[[], T]) -> T:
        """work(), tried again while another process holds the lock, for up to BUSY_TIMEOUT_S;
        a database that fails otherwise is a HistoryError, as one that cannot open. Each try
        waits at most ATTEMPT_S inside SQLite, so a signal ends the wait within it; `work` is
        a whole transaction or reads alone (a failed one is rolled back before the next try)."""
        deadline = clock.monotonic() + BUSY_TIMEOUT_S
        while True:
            try:
                return work()
            except sqlite3.Error as e:
                if not _locked(e) or clock.monotonic() >= deadline:
                    raise HistoryError(self.path, e) from None
            except OSError as e:
                raise HistoryError(self.path, e) from None

    def store(
        self, records: Sequence[dict[str, Any]], *, kind: str, model: str, system: dict[str, Any]
    ) -> int:
        """Store one run's records; returns the run's id."""
        now = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")

        def insert() -> int:
            with self.db:  # one transaction: rolled back whole where it fails
                cur = self.db.execute(
                    "INSERT INTO runs (time, kind, model, system) VALUES (?, ?, ?, ?)",
                    (now, kind, model, json.dumps(system)),
                )
                run_id = int(cur.lastrowid or 0)
                self.db.executemany(
                    "INSERT INTO results (run_id, key, test, avg_ts, stddev_ts, record)"
                    " VALUES (?, ?, ?, ?, ?, ?)",
                    [
                        (
                            run_id,
                            result_key(r),
                            str(r.get("test", "")),
                            r.get("avg_ts"),
                            r.get("stddev_ts"),
                            json.dumps(r),
                        )
                        for r in records
                    ],
                )
            return run_id

        return self._patiently(insert)

    def compare(self, records: Sequence[dict[str, Any]], *, before_run: int | None) -> list[Change]:
        """Each record against the newest earlier readable result with the same key."""
        changes = []
        for r in records:
            key = (result_key(r), before_run if before_run is not None else 2**62)
            rows = self._patiently(functools.partial(self._earlier, key))
            readable = ((int(i), rec) for i, text in rows if (rec := _record(text)) is not None)
            previous_run, previous = next(readable, (None, None))
            changes.append(Change(str(r.get("test", "")), r, previous, previous_run))
        return changes

    def _earlier(self, key: tuple[str, int]) -> list[Any]:
        """The newest 20 results of a key (its text, and the run it must precede)."""
        return self.db.execute(
            "SELECT run_id, record FROM results WHERE key = ? AND run_id < ?"
            " ORDER BY run_id DESC LIMIT 20",
            key,
        ).fetchall()

    def runs(self, *, limit: int = 20, model: str | None = None) -> list[dict[str, Any]]:
        """The newest runs first, each with its records."""
        query = "SELECT id, time, kind, model FROM runs"
        args: list[Any] = []
        if model:
            query += " WHERE model LIKE ? ESCAPE '\\'"  # a name's % _ \ match themselves
            args.append(_like(model))
        query += " ORDER BY id DESC LIMIT ?"
        args.append(limit)
        return self._patiently(lambda: self._runs(query, args))

    def _runs(self, query: str, args: list[Any]) -> list[dict[str, Any]]:
        out = []
        for run_id, time, kind, name in self.db.execute(query, args).fetchall():
            stored = self.db.execute(
                "SELECT record FROM results WHERE run_id = ? ORDER BY rowid", (run_id,)
            ).fetchall()
            records = [rec for (text,) in stored if (rec := _record(text)) is not None]
            out.append(
                {
                    "id": run_id,
                    "time": stored_text(time),
                    "kind": stored_text(kind),
                    "model": stored_text(name),
                    "records": records,
                    "unreadable": len(stored) - len(records),
                }
            )
        return out

    def bench_results(self, *, model: str | None = None) -> list[Stored]:
        """Every readable result of `llmrun bench` runs, oldest first, after llama-bench's own
        rows in this database; a llama.cpp setting an older record lacks is filled with the
        default llmrun never changed then either."""
        query = (
            "SELECT runs.id, runs.time, results.record FROM results JOIN runs ON"
            " runs.id = results.run_id WHERE runs.kind = ?"
        )
        args: list[Any] = [BENCH_KIND]
        if model:
            query += " AND runs.model LIKE ? ESCAPE '\\'"
            args.append(_like(model))
        rows = self._patiently(
            lambda: self.db.execute(query + " ORDER BY runs.id, results.rowid", args).fetchall()
        )
        found = self._patiently(lambda: self._llama_bench_rows(model))
        for run_id, time, text in rows:
            record = _record(text)
            if record is not None:
                if record.get("build_commit"):  # an older llmrun's, marked as llmrun's now are
                    record["build_commit"] = llmrun_build(str(record["build_commit"]))
                found.append(Stored(int(run_id), stored_text(time), {**LLAMA_DEFAULTS, **record}))
        return found

    def _llama_bench_rows(self, model: str | None) -> list[Stored]:
        """llama-bench's own rows in this database (`llama-bench -o sql | sqlite3` into it),
        as results of no llmrun run (run 0) at their test time, marked `tool` llama-bench; rows
        llmrun's SQL put there (those with figures in llama_bench_llmrun) are its runs already;
        none without a table of llama-bench's with the columns llmrun reads."""
        tables = {n for (n,) in self.db.execute("SELECT name FROM sqlite_master")}
        if "llama_bench" not in tables:
            return []
        have = {row[1] for row in self.db.execute("PRAGMA table_info(llama_bench)")}
        columns = [f for f in LLAMA_BENCH_FIELDS if f in have]
        if not {"avg_ts", "n_prompt", "n_gen"} <= set(columns):
            return []
        query = f"SELECT {', '.join(columns)} FROM llama_bench"
        if "llama_bench_llmrun" in tables:
            query += " WHERE rowid NOT IN (SELECT bench_rowid FROM llama_bench_llmrun)"
        found = []
        for row in self.db.execute(query + " ORDER BY rowid").fetchall():
            record = _llama_bench_record(dict(zip(columns, row, strict=True)))
            if record is None:
                continue
            names = (str(record.get("model_filename")), str(record.get("model_type")))
            if model and not any(model.lower() in n.lower() for n in names):
                continue
            found.append(Stored(0, str(record.get("test_time") or ""), record))
        return found


def _llama_bench_record(row: dict[str, Any]) -> dict[str, Any] | None:
    """A row of llama-bench's table as the record llmrun keeps: its values in its JSON types
    (SQL keeps booleans as 0/1, and takes any text), llama.cpp's defaults in a column an older
    llama-bench lacked, its test's name; None for a row whose figures are not numbers."""
    record: dict[str, Any] = {**LLAMA_DEFAULTS, "repack": True}
    for name, value in row.items():
        if value is None:
            continue
        if name in LLAMA_BENCH_BOOL:
            value = str(value).strip().lower() in _TRUE
        elif name in LLAMA_BENCH_INT or name in LLAMA_BENCH_REAL:
            try:
                value = float(value) if name in LLAMA_BENCH_REAL else int(value)
            except (TypeError, ValueError, OverflowError):  # int() of 1e400, stored as inf
                return None
        record[name] = value
    if not isinstance(record.get("avg_ts"), float) or _damaged(record):
        return None  # inf, a negative rate, a test of 10^400 tokens: no measurement
    record["test"] = test_name(record)
    record["tool"] = LLAMA_BENCH_TOOL
    return record


def _like(text: str) -> str:
    """A LIKE pattern for `text` anywhere: its own % _ \\ match themselves."""
    return "%" + re.sub(r"([%_\\])", r"\\\1", text) + "%"


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _background(record: Mapping[str, Any]) -> float:
    value = record.get("background_cpus")
    return float(value) if _is_number(value) else 0.0


def _busy(record: Mapping[str, Any]) -> bool:
    threads = record.get("n_threads")
    return busy_machine(_background(record), threads if isinstance(threads, int) else 1)


# No benchmark measures a billion tokens a second: a stored rate past it is a damaged row; nor
# one token in eleven days: a rate above 0 below MIN_RATE is one too (1e-300's logarithm made the
# ratio of two runs' rates overflow).
MAX_RATE = 1e9
MIN_RATE = 1e-6
# More CPUs than any machine has: a background load past it is a damaged row's.
MAX_CPUS = 1e6
# The fields a stored record is read by besides its rates: paired on, averaged, named as a test,
# written into llama-bench's table; each is one JSON scalar there, never a list or an object.
_SCALAR_FIELDS = frozenset(LLAMA_BENCH_FIELDS) | {"draft", "tool", "n_ctx"}


def _record(text: object) -> dict[str, Any] | None:
    """A stored result, or None for a row that is not one (damaged by hand or by a crash):
    not a JSON object, or a field it is read by that `_damaged` refuses."""
    try:
        record = json.loads(text) if isinstance(text, (str, bytes)) else None
    except (ValueError, RecursionError):  # a damaged row, or 100,000 brackets
        return None
    if not isinstance(record, dict) or _damaged(record):
        return None
    return record


def _damaged(record: Mapping[str, Any]) -> bool:
    """Whether a record holds a value no later reading can take: a rate (avg_ts, stddev_ts,
    samples_ts) that is no finite number from 0 to MAX_RATE, or one above 0 below MIN_RATE; a
    background load that is no number from 0 to MAX_CPUS; a test's size (n_prompt, n_gen,
    n_depth) that is no whole number from 0 to SQLite's largest; any other llama-bench field
    that is a list, an object, NaN, an infinity or a whole number past SQLite's."""
    samples = record.get("samples_ts")
    figures = [record.get("avg_ts"), *(samples if isinstance(samples, list) else [])]
    if not all(v is None or (_is_rate(v) and not 0 < v < MIN_RATE) for v in figures):
        return True
    stddev = record.get("stddev_ts")
    if not (stddev is None or _is_rate(stddev)):
        return True
    load = record.get("background_cpus")
    if not (load is None or (_is_number(load) and 0 <= load <= MAX_CPUS)):
        return True
    for field in TEST_FIELDS:
        value = record.get(field)
        if not (value is None or (isinstance(value, int) and 0 <= value <= SQLITE_MAX_INT)):
            return True
    return not all(_scalar(record.get(field)) for field in _SCALAR_FIELDS)


def _scalar(value: object) -> bool:
    """One JSON scalar a computation can take: no list or object, no NaN or infinity, no whole
    number past SQLite's (float() of a 400-digit one overflows)."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, int):
        return abs(value) <= SQLITE_MAX_INT
    return value is None or isinstance(value, (str, bytes))  # bytes: a BLOB in llama_bench


def _is_rate(value: object) -> bool:
    """Whether a stored figure is a rate: a finite number from 0 to MAX_RATE."""
    return _is_number(value) and 0 <= value <= MAX_RATE  # False for NaN; a huge int: no float


def _text(data: bytes) -> str:
    """A TEXT value as str, invalid UTF-8 replaced."""
    return data.decode("utf-8", errors="replace")


def stored_text(value: object) -> str:
    """A runs column as text: a BLOB written by hand read as UTF-8 with errors replaced (it
    showed as Python's b'\\xff...'), NULL as empty."""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return "" if value is None else str(value)


# ---- two sets of stored results, compared as llama.cpp's compare-llama-bench.py does --------

# The kind of run `llmrun bench` stores: llama-bench's records
BENCH_KIND = "local"

# compare-llama-bench.py's LLAMA_BENCH_KEY_PROPERTIES: two results pair when all are equal
PAIR_FIELDS = (
    "cpu_info",
    "gpu_info",
    "backends",
    "n_gpu_layers",
    "n_cpu_moe",
    "tensor_buft_overrides",
    "model_filename",
    "model_type",
    "n_batch",
    "n_ubatch",
    "embeddings",
    "cpu_mask",
    "cpu_strict",
    "poll",
    "n_threads",
    "type_k",
    "type_v",
    "load_mode",
    "no_kv_offload",
    "split_mode",
    "main_gpu",
    "tensor_split",
    "flash_attn",
    "n_prompt",
    "n_gen",
    "n_depth",
    "fit_target",
    "fit_min_ctx",
)
# ... and llmrun's settings that change a test's figures where llama-bench has none, and the
# tool that measured (llmrun's rows are never averaged with llama-bench's)
LLMRUN_PAIR_FIELDS = ("repack", "draft", "tool")
LLAMA_BENCH_TOOL = "llama-bench"
TOOLS = ("llmrun", LLAMA_BENCH_TOOL)
TEST_FIELDS = ("n_prompt", "n_gen", "n_depth")

# llama-bench's option names for the record fields a selector can name (any field name works)
SETTING_ALIASES = {
    "t": "n_threads",
    "b": "n_batch",
    "ub": "n_ubatch",
    "ngl": "n_gpu_layers",
    "fa": "flash_attn",
    "ctk": "type_k",
    "ctv": "type_v",
    "nkvo": "no_kv_offload",
    "ncmoe": "n_cpu_moe",
    "sm": "split_mode",
    "mg": "main_gpu",
    "ts": "tensor_split",
    "ot": "tensor_buft_overrides",
    "embd": "embeddings",
    "poll": "poll",
    "cpu-mask": "cpu_mask",
    "p": "n_prompt",
    "n": "n_gen",
    "d": "n_depth",
    "c": "n_ctx",
    "fitt": "fit_target",
    "fitc": "fit_min_ctx",
}
RUN_KEYS = ("build", "run", "date", "since", "until", "model")
_INT_FIELDS = LLAMA_BENCH_INT | {"draft", "n_ctx"}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True)
class Stored:
    """One stored bench result and the run it came from."""

    run_id: int  # 0: a row of llama-bench's own
    time: str  # the run's start, ISO 8601 UTC (llama-bench's rows: their test_time)
    record: dict[str, Any]

    @property
    def tool(self) -> str:
        """What measured it: llmrun, or llama-bench (its own rows in the history's database)."""
        return str(_pair_value("tool", self.record))


@dataclass(frozen=True)
class Term:
    key: str  # one of RUN_KEYS, or a record field
    value: Any

    def matches(self, s: Stored) -> bool:
        r = s.record
        if self.key == "build":  # llmrun's commits are in capitals (llmrun_build)
            commit = str(r.get("build_commit") or "").lower()
            return bool(commit) and _same_build(commit, self.value)
        if self.key == "run":
            return bool(self.value[0] <= s.run_id <= self.value[1])
        if self.key == "date":
            return s.time.startswith(self.value)
        if self.key == "since":
            return s.time[:10] >= self.value
        if self.key == "until":
            return s.time[:10] <= self.value
        if self.key == "model":
            names = (str(r.get("model_name") or ""), str(r.get("model_filename") or ""))
            return any(self.value in name.lower() for name in names)
        return bool(_pair_value(self.key, r) == self.value)


@dataclass(frozen=True)
class Selector:
    """A set of stored results: every term holds (`-b abc1234`, `-c build=def5678,t=4`)."""

    text: str
    terms: tuple[Term, ...]

    def matches(self, s: Stored) -> bool:
        return all(t.matches(s) for t in self.terms)

    @property
    def fields(self) -> frozenset[str]:
        """The record fields the selector fixes: results pair across their values."""
        named = {t.key for t in self.terms if t.key not in RUN_KEYS}
        if any(t.key == "model" for t in self.terms):
            named |= {"model_filename", "model_type"}
        return frozenset(named)

    @property
    def builds(self) -> tuple[str, ...]:
        return tuple(t.value for t in self.terms if t.key == "build")


def parse_selector(text: str, *, option: str) -> Selector:
    """`-b`/`-c`'s value: a build commit, or KEY=VALUE terms joined by commas."""
    terms = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            raise OptionError(f"{option} {text!r}: an empty term")
        key, sep, value = part.partition("=")
        if not sep:
            key, value = "build", part
        key, value = key.strip(), value.strip()
        if not value:
            raise OptionError(f"{option} {text!r}: {key}= needs a value")
        terms.append(Term(SETTING_ALIASES.get(key, key), _term_value(key, value, option, text)))
    return Selector(text, tuple(terms))


def _term_value(key: str, value: str, option: str, text: str) -> Any:
    field = SETTING_ALIASES.get(key, key)
    where = f"{option} {text!r}: {key}="
    if key == "run":
        m = re.fullmatch(r"([0-9]{1,18})(?:-([0-9]{1,18}))?", value)  # SQLite's integers
        if not m:
            raise OptionError(f"{where} takes a run id or a range such as 3-5, not {value!r}")
        low, high = int(m[1]), int(m[2] or m[1])
        if high < low:
            raise OptionError(f"{where}{value}: the range runs backwards")
        return (low, high)
    if key == "date":
        if not re.fullmatch(r"[0-9]{4}(-[0-9]{2}(-[0-9]{2})?)?", value) or not _is_date(value):
            raise OptionError(f"{where} takes a day, month or year: 2026-11-30, 2026-11, 2026")
        return value
    if key in ("since", "until"):
        if not re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", value) or not _is_date(value):
            raise OptionError(f"{where} takes a day such as 2026-11-30, not {value!r}")
        return value
    if key in ("build", "model"):
        return value.lower()
    if key == "tool":
        if value.lower() not in TOOLS:
            raise OptionError(f"{where} takes llmrun or llama-bench, not {value!r}")
        return value.lower()
    if field not in LLAMA_BENCH_FIELDS and field not in LLMRUN_PAIR_FIELDS and field != "n_ctx":
        raise OptionError(
            f"{option} {text!r}: unknown key {key!r}; use build=, run=, date=, since=, until=,"
            " model=, tool= or a setting: t=, b=, ub=, ngl=, fa=, ctk=, ctv=, p=, n=, d= (or a"
            " record field such as n_threads=)"
        )
    if field == "flash_attn" and value.lower() in FLASH_ATTN_CODES:
        return FLASH_ATTN_CODES[value.lower()]
    if field in LLAMA_BENCH_BOOL or field == "repack":
        if value.lower() not in _TRUE + _FALSE:
            raise OptionError(f"{where} takes 1 or 0, not {value!r}")
        return value.lower() in _TRUE
    if field in _INT_FIELDS:
        try:
            return int(value)
        except ValueError:
            raise OptionError(f"{where} takes a whole number, not {value!r}") from None
    return value


def _is_date(value: str) -> bool:
    try:
        dt.date.fromisoformat((value + "-01-01")[:10])  # a year or a month: its first day
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class Tally:
    """One set's results for one test and settings: its runs averaged, as the script does."""

    records: tuple[dict[str, Any], ...]

    @property
    def runs(self) -> int:
        return len(self.records)

    @property
    def avg_ts(self) -> float:
        return statistics.fmean(float(r["avg_ts"]) for r in self.records)

    @property
    def stddev_ts(self) -> float:
        """The spread of all the runs' repetitions together: each run's variance, averaged, plus
        the variance between the runs' means (the law of total variance)."""
        within = statistics.fmean(float(r.get("stddev_ts") or 0.0) ** 2 for r in self.records)
        between = statistics.pvariance([float(r["avg_ts"]) for r in self.records])
        return math.sqrt(within + between)

    @property
    def rates(self) -> tuple[float, ...]:
        """Every repetition of every run, pooled; () when a run kept none."""
        each = [rates(r) for r in self.records]
        return () if not all(each) else tuple(x for run in each for x in run)

    @property
    def summary(self) -> dict[str, Any]:
        """What difference and spread_verdict read: the mean, the spread, the pooled
        repetitions, the most background load seen."""
        loads = [_background(r) for r in self.records if r.get("background_cpus") is not None]
        threads = [r["n_threads"] for r in self.records if isinstance(r.get("n_threads"), int)]
        return {
            "avg_ts": self.avg_ts,
            "stddev_ts": self.stddev_ts,
            "samples_ts": list(self.rates),
            "background_cpus": max(loads, default=None),
            "n_threads": max(threads, default=1),
        }


@dataclass(frozen=True)
class Pair:
    """One test with the same settings in both sets."""

    shown: tuple[tuple[str, Any], ...]  # the key fields shown as columns, with their values
    test: str
    baseline: Tally
    compare: Tally

    @property
    def speedup(self) -> float | None:
        """compare t/s over baseline t/s, the script's Speedup column."""
        return self.compare.avg_ts / self.baseline.avg_ts if self.baseline.avg_ts else None

    @property
    def difference(self) -> Difference | None:
        """compare against baseline from their pooled repetitions (None: a run kept none)."""
        return difference(self.baseline.summary, self.compare.summary)

    @property
    def verdict(self) -> str:
        return verdict(self.baseline.summary, self.compare.summary)


@dataclass(frozen=True)
class Comparison:
    baseline: str  # each set's label: its selector as given
    compare: str
    shown: tuple[str, ...]
    pairs: tuple[Pair, ...]
    ignored: tuple[str, ...]  # key fields the selectors fix, so pairing looks past them
    unpaired_baseline: int  # tests and settings found in one set only
    unpaired_compare: int

    def records(self) -> list[dict[str, Any]]:
        """One flat record a pair, for csv and json."""
        out = []
        for p in self.pairs:
            record = {**dict(p.shown), "test": p.test}
            for side, label, tally in (
                ("baseline", self.baseline, p.baseline),
                ("compare", self.compare, p.compare),
            ):
                record[side] = label
                record[f"{side}_avg_ts"] = round(tally.avg_ts, 6)
                record[f"{side}_stddev_ts"] = round(tally.stddev_ts, 6)
                record[f"{side}_runs"] = tally.runs
            record["speedup"] = None if p.speedup is None else round(p.speedup, 4)
            record.update(record_fields(p.difference, "speedup"))
            record["verdict"] = p.verdict
            out.append(record)
        return out


def test_name(record: Mapping[str, Any]) -> str:
    """The script's name for a test: pp512, tg128, pp512+tg128, each with @dN at a depth."""
    p, g, d = (int(record.get(f) or 0) for f in TEST_FIELDS)
    name = f"pp{p}" if g == 0 else f"tg{g}" if p == 0 else f"pp{p}+tg{g}"
    return f"{name}@d{d}" if d else name


def _tests(baseline: Sequence[dict[str, Any]], compare: Sequence[dict[str, Any]]) -> str:
    """The pair's test; where the sets fix the test's shape differently (-b p=512 -c p=1024),
    each side's, baseline first."""
    names = [", ".join(dict.fromkeys(test_name(r) for r in side)) for side in (baseline, compare)]
    return names[0] if names[0] == names[1] else f"{names[0]} vs {names[1]}"


def _pair_value(field: str, record: Mapping[str, Any]) -> Any:
    value = record.get(field)
    if field == "model_filename" and isinstance(value, str):
        return value.rsplit("/", 1)[-1]  # older llmrun stored the absolute path
    if field == "draft" and value is None:
        return 0  # a test without drafting records none
    if field == "tool" and value is None:
        return "llmrun"  # llmrun's own records name no tool
    return value


SHOWABLE = tuple(f for f in PAIR_FIELDS if f not in TEST_FIELDS) + LLMRUN_PAIR_FIELDS


def compare_sets(
    results: Sequence[Stored],
    baseline: Selector,
    compare: Selector | None,
    *,
    show: Sequence[str] | None = None,
) -> Comparison:
    """Pair the baseline's results with the compare set's on compare-llama-bench.py's key
    fields (less those a selector fixes), each side's repeated runs averaged."""
    base, compare, comp = _sides(results, baseline, compare)
    if show is not None:
        unknown = [f for f in show if f not in SHOWABLE]
        if unknown:
            raise BadRequestError(
                f"--show: unknown {', '.join(map(repr, unknown))}; choose"
                f" from {', '.join(SHOWABLE)}"
            )
    # only a field both sets fix is looked past (-b t=1 -c t=2); one fixed on one side only
    # still pairs, or the other side's values would be averaged together; the tool is looked
    # past where each set holds one tool's results (llama-bench's as the baseline of llmrun's)
    ignored = baseline.fields & compare.fields
    one_tool = all(len({s.tool for s in side}) == 1 for side in (base, comp))
    keys = [
        f
        for f in PAIR_FIELDS + LLMRUN_PAIR_FIELDS
        if f not in ignored and not (f == "tool" and one_tool)
    ]
    b, c = _groups(base, keys), _groups(comp, keys)
    paired = [k for k in b if k in c]
    if not paired:
        looked_past = f", looking past {', '.join(sorted(ignored))}" if ignored else ""
        raise BadRequestError(
            f"no comparable results: nothing in {baseline.text!r} has the same model, test and"
            f" settings as in {compare.text!r} (compare-llama-bench.py's key fields{looked_past})"
        )
    if show is None:  # as the script: the model, and every key field that tells pairs apart
        varying = [
            f
            for i, f in enumerate(keys)
            if f not in TEST_FIELDS and f != "model_type" and len({k[i] for k in paired}) > 1
        ]
        show = ["model_type", *varying]
    index = {f: i for i, f in enumerate(keys)}  # the key fields, none of them ignored
    shown = [f for f in show if f in index]
    return Comparison(
        baseline=baseline.text,
        compare=compare.text,
        shown=tuple(shown),
        pairs=_pairs(paired, b, c, shown, index),
        ignored=tuple(sorted(ignored & set(PAIR_FIELDS + LLMRUN_PAIR_FIELDS))),
        unpaired_baseline=len(b) - len(paired),
        unpaired_compare=len(c) - len(paired),
    )


def _sides(
    results: Sequence[Stored], baseline: Selector, compare: Selector | None
) -> tuple[list[Stored], Selector, list[Stored]]:
    """The baseline's rated results, the compare set (by default the newest run outside the
    baseline) and its results; either set empty, or the two overlapping, is an error."""
    rated = [s for s in results if s.record.get("avg_ts") is not None]
    _check_builds(rated, baseline, compare)
    base = [s for s in rated if baseline.matches(s)]
    if not base:
        raise BadRequestError(f"baseline {baseline.text!r} matches no stored bench result")
    default = compare is None
    if compare is None:
        newest = max((s.run_id for s in rated if not baseline.matches(s)), default=None)
        if newest is None:
            raise BadRequestError(
                f"every stored bench result is in the baseline"
                f" {baseline.text!r}: choose a compare set with -c"
            )
        compare = (
            Selector(f"run {newest}", (Term("run", (newest, newest)),))
            if newest
            else Selector(LLAMA_BENCH_TOOL, (Term("tool", LLAMA_BENCH_TOOL),))
        )
    # the default set is the newest run less what the baseline already holds (-b t=1 after a
    # `bench -t 1,2` compares that run's t=1 rows with the baseline's, not with themselves)
    comp = [s for s in rated if compare.matches(s) and not (default and baseline.matches(s))]
    if not comp:
        raise BadRequestError(f"compare {compare.text!r} matches no stored bench result")
    both = {id(s) for s in base} & {id(s) for s in comp}
    if both:
        raise BadRequestError(
            f"baseline {baseline.text!r} and compare {compare.text!r} share"
            f" {len(both)} results: choose sets that do not overlap"
        )
    return base, compare, comp


Groups = dict[tuple[Any, ...], list[dict[str, Any]]]  # key fields' values -> records


def _groups(side: list[Stored], keys: Sequence[str]) -> Groups:
    """A side's records by their values of the pairing's key fields."""
    out: Groups = {}
    for s in side:
        out.setdefault(tuple(_pair_value(f, s.record) for f in keys), []).append(s.record)
    return out


def _pairs(
    paired: Sequence[tuple[Any, ...]],
    b: Groups,
    c: Groups,
    shown: Sequence[str],
    index: Mapping[str, int],
) -> tuple[Pair, ...]:
    """A pair for each set of paired keys alike in the shown fields and the test: their
    results averaged together, on each side."""
    merged: dict[tuple[Any, ...], tuple[list[dict[str, Any]], list[dict[str, Any]]]] = {}
    for k in paired:  # results alike in the shown fields (and the test) are averaged together
        into = merged.setdefault(
            tuple(k[index[f]] for f in (*shown, *TEST_FIELDS) if f in index), ([], [])
        )
        into[0].extend(b[k])
        into[1].extend(c[k])
    return tuple(
        Pair(
            shown=tuple((f, _pair_value(f, bs[0]) if f == "tool" else bs[0].get(f)) for f in shown),
            test=_tests(bs, cs),
            baseline=Tally(tuple(bs)),
            compare=Tally(tuple(cs)),
        )
        for bs, cs in merged.values()
    )


def _check_builds(results: Sequence[Stored], *selectors: Selector | None) -> None:
    """A build no stored result has is named, with the builds there are."""
    stored = sorted(
        {str(s.record.get("build_commit")) for s in results if s.record.get("build_commit")}
    )
    for selector in selectors:
        for build in selector.builds if selector is not None else ():
            if not any(_same_build(c.lower(), build) for c in stored):
                listed = ", ".join(stored[:8]) + (", ..." if len(stored) > 8 else "")
                raise BadRequestError(
                    f"no stored bench result has build {build!r} (stored: {listed or 'none'})"
                )


def _same_build(commit: str, build: str) -> bool:
    """One commit written to two lengths (lower case both: llmrun's are in capitals)."""
    return commit.startswith(build) or build.startswith(commit)


def write_database(path: Path, sql: str) -> None:
    """A new SQLite file at `path` holding `sql`'s tables, whole or not at all; an existing
    file is never replaced (it may be the user's own llama-bench database)."""
    try:
        there = path.exists() or path.is_symlink()
    except OSError as e:  # a name over 255 bytes: exists() raises ENAMETOOLONG
        raise BadRequestError(f"cannot write {path}: {e.strerror or e}") from None
    if there:
        raise BadRequestError(
            f"{path} exists: name a new file, or add to it with"
            f" `llmrun history --export-sql - | sqlite3 {path}`"
        )
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise BadRequestError(f"cannot write {path}: {e.strerror or e}") from None
    os.close(fd)
    try:
        with contextlib.closing(sqlite3.connect(tmp)) as db:
            db.executescript(sql)
            db.commit()
        try:
            os.link(tmp, path)  # fails, rather than replaces, if the file appeared meanwhile
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK):
                raise
            os.replace(tmp, path)  # a file system without hard links
    except FileExistsError:
        raise BadRequestError(f"{path} exists: name a new file") from None
    except (OSError, sqlite3.Error) as e:
        raise BadRequestError(f"cannot write {path}: {getattr(e, 'strerror', None) or e}") from None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
