"""Every bench run, kept in SQLite in the user's data directory, and comparisons between runs.

A result is compared with the newest earlier result of the same key: the same model file (name
and size), the same settings and the same test shape. A change counts as a regression or an
improvement only when the two runs' spreads (mean ± stddev) do not overlap.
"""

from __future__ import annotations

import datetime as dt
import json
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import BadRequestError
from .paths import data_dir

KEY_FIELDS = (
    "model_filename", "model_size", "backends", "n_threads", "n_batch", "n_ubatch", "type_k",
    "type_v", "n_gpu_layers", "flash_attn", "n_prompt", "n_gen", "n_depth", "endpoint",
    "concurrency", "request_rate",
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
        if new_high < old_low:
            return "regression"
        if new_low > old_high:
            return "improvement"
        return "within spread"


class History:
    def __init__(self, path: Path | None = None) -> None:
        self.path = path or history_path()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.db = sqlite3.connect(self.path)
            self.db.executescript(SCHEMA)
        except (OSError, sqlite3.Error) as e:
            raise BadRequestError(f"cannot open the bench history {self.path}: {e}") from None

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
        """Each record against the newest earlier result with the same key."""
        changes = []
        for r in records:
            row = self.db.execute(
                "SELECT run_id, record FROM results WHERE key = ? AND run_id < ?"
                " ORDER BY run_id DESC LIMIT 1",
                (result_key(r), before_run if before_run is not None else 2**62),
            ).fetchone()
            previous = json.loads(row[1]) if row else None
            changes.append(Change(str(r.get("test", "")), r, previous, row[0] if row else None))
        return changes

    def runs(self, *, limit: int = 20, model: str | None = None) -> list[dict[str, Any]]:
        """The newest runs first, each with its records."""
        query = "SELECT id, time, kind, model FROM runs"
        args: list[Any] = []
        if model:
            query += " WHERE model LIKE ?"
            args.append(f"%{model}%")
        query += " ORDER BY id DESC LIMIT ?"
        args.append(limit)
        out = []
        for run_id, time, kind, name in self.db.execute(query, args).fetchall():
            records = [json.loads(rec) for (rec,) in self.db.execute(
                "SELECT record FROM results WHERE run_id = ? ORDER BY rowid", (run_id,)
            )]  # fmt: skip
            out.append({"id": run_id, "time": time, "kind": kind, "model": name,
                        "records": records})  # fmt: skip
        return out
