"""Every bench run, kept in SQLite in the user's data directory, and comparisons between runs.

A result is compared with the newest earlier result of the same key: the same model file (name
and size), the same settings and the same test shape. A change counts as a regression or an
improvement only when the two runs' spreads (mean ± stddev) do not overlap.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import re
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import BadRequestError
from .paths import data_dir
from .system import busy_machine

KEY_FIELDS = (
    "model_filename", "model_size", "backends", "n_threads", "n_batch", "n_ubatch", "type_k",
    "type_v", "n_gpu_layers", "flash_attn", "n_prompt", "n_gen", "n_depth", "endpoint",
    "concurrency", "request_rate", "repack", "no_kv_offload", "load_mode",
)  # fmt: skip

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
    def verdict(self) -> str:
        """regression / improvement beyond both runs' spread, else 'within spread' or 'new'."""
        if self.previous is None:
            return "new"
        if self.record.get("avg_ts") is None or self.previous.get("avg_ts") is None:
            return "no rate"
        new_low = self.record["avg_ts"] - (self.record.get("stddev_ts") or 0)
        new_high = self.record["avg_ts"] + (self.record.get("stddev_ts") or 0)
        old_low = self.previous["avg_ts"] - (self.previous.get("stddev_ts") or 0)
        old_high = self.previous["avg_ts"] + (self.previous.get("stddev_ts") or 0)
        if new_high < old_low or new_low > old_high:
            if (
                _busy(self.record)
                or _busy(self.previous)
                or _load_differs(self.record, self.previous)
            ):
                return "noise (busy machine)"
            return "regression" if new_high < old_low else "improvement"
        return "within spread"


class HistoryError(BadRequestError):
    """The history database cannot be opened, read or written (corrupt, locked, read-only)."""

    def __init__(self, path: Path, problem: object) -> None:
        super().__init__(f"bench history {path}: {problem}")
        self.path = path


# Another llmrun storing a run at the same moment holds the lock briefly: wait for it.
BUSY_TIMEOUT_S = 10.0


class History:
    def __init__(self, path: Path | None = None) -> None:
        self.path = path or history_path()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S)
            self.db.executescript(SCHEMA)
            self._check_schema()
        except (OSError, sqlite3.Error) as e:
            with contextlib.suppress(AttributeError, sqlite3.Error):
                self.db.close()
            raise HistoryError(self.path, e) from None

    def _check_schema(self) -> None:
        """A database from another program or an older llmrun is refused, not half-used."""
        for table, needed in (("runs", {"id", "time", "kind", "model", "system"}),
                              ("results", {"run_id", "key", "test", "avg_ts", "stddev_ts",
                                           "record"})):  # fmt: skip
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

    def store(
        self, records: Sequence[dict[str, Any]], *, kind: str, model: str, system: dict[str, Any]
    ) -> int:
        """Store one run's records; returns the run's id."""
        try:
            return self._store(records, kind=kind, model=model, system=system)
        except (sqlite3.Error, OSError) as e:
            raise HistoryError(self.path, e) from None

    def _store(
        self, records: Sequence[dict[str, Any]], *, kind: str, model: str, system: dict[str, Any]
    ) -> int:
        with self.db:
            cur = self.db.execute(
                "INSERT INTO runs (time, kind, model, system) VALUES (?, ?, ?, ?)",
                (dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), kind, model,
                 json.dumps(system)),
            )  # fmt: skip
            run_id = int(cur.lastrowid or 0)
            self.db.executemany(
                "INSERT INTO results (run_id, key, test, avg_ts, stddev_ts, record)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                [(run_id, result_key(r), str(r.get("test", "")), r.get("avg_ts"),
                  r.get("stddev_ts"), json.dumps(r)) for r in records],
            )  # fmt: skip
        return run_id

    def compare(self, records: Sequence[dict[str, Any]], *, before_run: int | None) -> list[Change]:
        """Each record against the newest earlier readable result with the same key."""
        changes = []
        for r in records:
            try:
                rows = self.db.execute(
                    "SELECT run_id, record FROM results WHERE key = ? AND run_id < ?"
                    " ORDER BY run_id DESC LIMIT 20",
                    (result_key(r), before_run if before_run is not None else 2**62),
                ).fetchall()
            except sqlite3.Error as e:
                raise HistoryError(self.path, e) from None
            previous: dict[str, Any] | None = None
            previous_run: int | None = None
            for run_id, text in rows:
                previous = _record(text)
                if previous is not None:
                    previous_run = int(run_id)
                    break
            changes.append(Change(str(r.get("test", "")), r, previous, previous_run))
        return changes

    def runs(self, *, limit: int = 20, model: str | None = None) -> list[dict[str, Any]]:
        """The newest runs first, each with its records."""
        query = "SELECT id, time, kind, model FROM runs"
        args: list[Any] = []
        if model:
            query += " WHERE model LIKE ? ESCAPE '\\'"  # a name's % _ \ match themselves
            args.append("%" + re.sub(r"([%_\\])", r"\\\1", model) + "%")
        query += " ORDER BY id DESC LIMIT ?"
        args.append(limit)
        out = []
        try:
            for run_id, time, kind, name in self.db.execute(query, args).fetchall():
                stored = self.db.execute(
                    "SELECT record FROM results WHERE run_id = ? ORDER BY rowid", (run_id,)
                ).fetchall()
                records = [rec for (text,) in stored if (rec := _record(text)) is not None]
                out.append({"id": run_id, "time": str(time), "kind": str(kind),
                            "model": str(name), "records": records,
                            "unreadable": len(stored) - len(records)})  # fmt: skip
        except sqlite3.Error as e:
            raise HistoryError(self.path, e) from None
        return out


def _background(record: dict[str, Any]) -> float:
    value = record.get("background_cpus")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def _busy(record: dict[str, Any]) -> bool:
    threads = record.get("n_threads")
    return busy_machine(_background(record), threads if isinstance(threads, int) else 1)


def _load_differs(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Runs measured under different background load are not comparable (llama.cpp's threads
    spin-wait, so a fraction of a CPU taken by others changes the figures)."""
    return abs(_background(a) - _background(b)) > 0.25


def _record(text: object) -> dict[str, Any] | None:
    """A stored result, or None for a row that is not one (damaged by hand or by a crash)."""
    try:
        record = json.loads(text) if isinstance(text, (str, bytes)) else None
    except ValueError:
        return None
    if not isinstance(record, dict):
        return None
    for name in ("avg_ts", "stddev_ts"):
        value = record.get(name)
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            return None
    return record
