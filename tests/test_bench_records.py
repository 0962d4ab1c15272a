"""llmrun's llama-bench records beside llama-bench's own: told apart by compare-llama-bench.py
with no hand step, its columns filled as llama-bench fills them, read back by `llmrun history`
as a baseline; the header and the record agree; the peak memory is the model's."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from llmrun.cli.app import app
from llmrun.runners import devices as dv
from llmrun.runners.bench.results import (
    LLAMA_BENCH_BOOL,
    LLAMA_BENCH_FIELDS,
    LLAMA_BENCH_INT,
    LLAMA_BENCH_REAL,
    llmrun_build,
)

from . import llama_tools
from .conftest import HANG_S, which_llmrun
from .inject.sitecustomize import BANDWIDTH_ENV
from .test_trust_bench import _fake_models

BENCH = ["bench", "-r", "2", "-p", "8", "-n", "2", "--no-history"]


def _sql_type(field: str) -> str:
    if field in LLAMA_BENCH_REAL:
        return "REAL"
    return "INTEGER" if field in LLAMA_BENCH_INT | LLAMA_BENCH_BOOL else "TEXT"


def llama_bench_sql(rows: list[dict[str, Any]]) -> str:
    """llama-bench's own `-o sql`, as its sql_printer writes it: its table, then every value of
    a row quoted as text (`'1'` for true, `'24.170000'`), SQLite's column types converting."""
    fields = ",\n".join(f"  {f} {_sql_type(f)}" for f in LLAMA_BENCH_FIELDS)
    text = f"CREATE TABLE IF NOT EXISTS llama_bench (\n{fields}\n);\n\n"
    for r in rows:
        values = []
        for f in LLAMA_BENCH_FIELDS:
            v = r[f]
            v = int(v) if isinstance(v, bool) else v
            values.append(f"'{v:f}'" if isinstance(v, float) else f"'{v}'")
        text += f"INSERT INTO llama_bench ({', '.join(LLAMA_BENCH_FIELDS)}) "
        text += f"VALUES ({', '.join(values)});\n"
    return text


def as_llama_bench(record: dict[str, Any], avg_ts: float) -> dict[str, Any]:
    """The row llama-bench writes for the same test of the same build: its key fields agree
    with llmrun's (tests/test_llama_bench_defaults.py runs both tools), the commit is bare."""
    return {
        **{f: record[f] for f in LLAMA_BENCH_FIELDS},
        "build_commit": dv.build_commit(dv.query().commit()),
        "avg_ts": avg_ts,
        "stddev_ts": 0.5,
    }


def test_llmrun_build_keeps_the_commit_and_its_length() -> None:
    assert llmrun_build("0c1e570") == "0C1E570"
    assert llmrun_build("1234567") == "123456N"  # no letter to capitalise: the last digit
    assert llmrun_build("unknown") == "UNKNOWN"
    for commit in ("0c1e570", "1234567", "unknown", "b1a2c3d4"):
        marked = llmrun_build(commit)
        assert len(marked) == len(commit) and marked != commit
        assert llmrun_build(marked) == marked  # an older record marked again stays itself


def _script(db: Path, *args: str) -> dict[str, tuple[float, float]]:
    """compare-llama-bench.py's table: each test's baseline and compare t/s."""
    done = subprocess.run(
        [sys.executable, str(llama_tools.compare_script()), "-i", str(db), *args],
        capture_output=True,
        text=True,
        timeout=HANG_S,
        cwd=db.parent,
    )
    assert done.returncode == 0, done.stderr
    found = {}
    for line in done.stdout.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) >= 4 and cells[-4].startswith(("pp", "tg")):
            found[cells[-4]] = (float(cells[-3]), float(cells[-2]))
    return found


def test_compare_llama_bench_keeps_llmruns_rows_apart_from_llama_benchs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, llmrun_env: dict[str, str]
) -> None:
    """llama-bench's rows, then llmrun's, of one build in one database: the real script
    compares llmrun's with llama-bench's (-b COMMIT -c llmrun's mark), and llama-bench's own
    figures are llama-bench's alone, not the mean of both tools' (issue 29: 25.36 was the mean
    of 24.17 and 26.55)."""
    _fake_models(monkeypatch)
    done = CliRunner().invoke(app, [*BENCH, "-o", "json"])
    assert done.exit_code == 0, done.stderr
    ours = json.loads(done.stdout)
    commit = dv.build_commit(dv.query().commit())
    mark = ours[0]["build_commit"]
    assert mark == llmrun_build(commit) != commit and len(mark) == len(commit)
    theirs = [as_llama_bench(r, avg_ts=round(r["avg_ts"] / 2, 2)) for r in ours]
    sql = CliRunner().invoke(app, [*BENCH, "-o", "sql"])
    assert sql.exit_code == 0, sql.stderr
    db = tmp_path / "llama-bench.sqlite"
    with sqlite3.connect(db) as con:
        con.executescript(llama_bench_sql(theirs))
        con.executescript(sql.stdout)
        llmrun_ts = dict(
            con.execute("SELECT n_prompt || '/' || n_gen, avg_ts FROM llama_bench WHERE rowid > 2")
        )
    assert llmrun_ts.keys() == {"8/0", "0/2"}
    tools = _script(db, "-b", commit, "-c", mark)
    close = pytest.approx
    assert tools["pp8"] == close((theirs[0]["avg_ts"], llmrun_ts["8/0"]), abs=0.006)
    assert tools["tg2"] == close((theirs[1]["avg_ts"], llmrun_ts["0/2"]), abs=0.006)
    alone = _script(db, "-b", commit, "-c", commit)  # llama-bench's build: its rows alone
    assert alone["pp8"] == close((theirs[0]["avg_ts"],) * 2, abs=0.006)


def test_sql_fills_the_columns_llama_bench_fills(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """repack, devices, lazy_mode and no_host go into llama_bench's own columns, as llama-bench
    writes them, so `WHERE repack = 1` finds llmrun's rows (they were NULL, the values only in
    llama_bench_llmrun)."""
    _fake_models(monkeypatch)
    done = CliRunner().invoke(app, [*BENCH, "-o", "sql"])
    assert done.exit_code == 0, done.stderr
    con = sqlite3.connect(":memory:")
    con.executescript(done.stdout)
    rows = con.execute(
        "SELECT repack, devices, lazy_mode, no_host FROM llama_bench WHERE repack = 1"
    ).fetchall()
    assert rows == [(1, "auto", "auto", 0)] * 2
    (figures,) = con.execute("SELECT figures FROM llama_bench_llmrun LIMIT 1").fetchone()
    assert not {"repack", "devices", "lazy_mode", "no_host"} & set(json.loads(figures))
    record = json.loads(CliRunner().invoke(app, [*BENCH, "-o", "json"]).stdout)[0]
    con.executescript(llama_bench_sql([as_llama_bench(record, 1.0)]))  # into llmrun's table
    theirs = con.execute("SELECT repack, devices, lazy_mode, no_host FROM llama_bench").fetchall()
    assert theirs == [(1, "auto", "auto", 0)] * 3  # llama-bench's row: the same values


PEAK_CODE = """
from llmrun.runners.stats import peak_rss_bytes
from llmrun.runners.system import memory_bandwidth_runs
start = peak_rss_bytes()
load = bytearray(96 << 20)  # a load's peak, gone before the bandwidth probe
del load
loaded = peak_rss_bytes()
rates = memory_bandwidth_runs()
print(len(rates), loaded - start, peak_rss_bytes() - loaded)
"""


def test_the_bandwidth_probe_leaves_the_peak_memory_as_it_found_it(
    llmrun_env: dict[str, str],
) -> None:
    """bench's peak_rss_bytes is the model's: the probe's 2 x 256 MiB arrays are taken out of
    the peak again (866 MB in bench against 319 MB in `run`, issue 29), and a peak reached
    before the probe is kept."""
    real_size = {k: v for k, v in llmrun_env.items() if k != BANDWIDTH_ENV}  # 256 MiB, 7 runs
    done = subprocess.run(
        [sys.executable, "-c", PEAK_CODE],
        env=real_size,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert done.returncode == 0, done.stderr
    runs, before, grown = (int(x) for x in done.stdout.split())
    assert runs == 7 and before >= 90 << 20
    assert grown < 32 << 20  # not 512 MiB


def test_history_takes_llama_benchs_own_rows_as_a_baseline() -> None:
    """`llama-bench -o sql | sqlite3` into the history's database: `llmrun history` reads those
    rows (tool=llama-bench) as a baseline, and never averages them with llmrun's of the same
    build; llmrun's own SQL in that table is its runs already, not llama-bench's."""
    from llmrun.cli.bench.output import OutputFormat, format_records
    from llmrun.runners.history import History

    from .test_history import rec, store

    store(rec(avg_ts=150.0), rec(n_prompt=0, n_gen=4, test="tg4", avg_ts=12.0))
    theirs = [rec(avg_ts=100.0), rec(n_prompt=0, n_gen=4, avg_ts=10.0)]
    with History() as h:
        h.db.executescript(llama_bench_sql([{f: r[f] for f in LLAMA_BENCH_FIELDS} for r in theirs]))
        h.db.executescript(format_records([rec(avg_ts=999.0)], OutputFormat.sql))
        found = h.bench_results()
    assert [(s.tool, s.run_id, s.record["test"]) for s in found[:2]] == [
        ("llama-bench", 0, "pp8"),
        ("llama-bench", 0, "tg4"),
    ]
    assert len(found) == 4 and found[0].record["repack"] is True  # SQL's 1, a bool again
    done = CliRunner().invoke(app, ["history", "-b", "tool=llama-bench", "-o", "json"])
    assert done.exit_code == 0, done.stderr
    speedups = {r["test"]: r["speedup"] for r in json.loads(done.stdout)}
    assert speedups == {"pp8": 1.5, "tg4": 1.2}  # llmrun's newest run against llama-bench's
    store(rec(build_commit="bbbbbbb", avg_ts=300.0))
    done = CliRunner().invoke(app, ["history", "-b", "aaaaaaa", "-c", "bbbbbbb", "-o", "json"])
    assert done.exit_code == 0, done.stderr
    (pair,) = json.loads(done.stdout)  # build aaaaaaa holds both tools' rows: llmrun's alone
    assert (pair["test"], pair["baseline_avg_ts"], pair["speedup"]) == ("pp8", 150.0, 2.0)
    refused = CliRunner().invoke(app, ["history", "-b", "tool=llama.cpp"])
    assert refused.exit_code == 2 and "takes llmrun or llama-bench" in refused.stderr


def test_repacking_asked_where_the_probe_forbids_it_is_off_in_header_and_record(
    llmrun_env: dict[str, str], model_path: str
) -> None:
    """--repack 1 where the probe found llama.cpp's repacked kernels unsafe: the engine does not
    repack, and the header says so with the record (it said `repacking on` over `repack
    false`)."""
    from llmrun.runners import probe

    why = "the probe did not finish in 120 s"
    probe._write_cache(probe.probe_key("Q4_1"), probe.Verdict(False, why))
    asked = ["-m", model_path, "--repack", "1", "-o", "json"]
    done = subprocess.run(
        [which_llmrun(), "bench", "-r", "1", "-p", "8", "-n", "0", "--no-history", *asked],
        env={**llmrun_env, "COLUMNS": "400"},
        capture_output=True,
        text=True,
        timeout=HANG_S,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr
    (record,) = json.loads(done.stdout)
    assert (record["repack"], record["repack_note"]) == (False, f"off: {why}")
    assert f"repacking off: {why}," in " ".join(done.stderr.split())
