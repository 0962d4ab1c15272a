"""The bench history over time: llmrun's SQL into any llama-bench table, run after run; two sets
of stored results compared as llama.cpp's compare-llama-bench.py does; and the history exported
so that script reads it."""

from __future__ import annotations

import ast
import csv
import io
import json
import math
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from llmrun.cli.app import app
from llmrun.cli.bench.output import OutputFormat, format_records
from llmrun.runners.bench.results import LLAMA_DEFAULTS, llmrun_build
from llmrun.runners.errors import BadRequestError
from llmrun.runners.history import (
    LLMRUN_PAIR_FIELDS,
    PAIR_FIELDS,
    History,
    Selector,
    Stored,
    compare_sets,
    parse_selector,
)

from . import llama_tools
from .conftest import HANG_S, python_child
from .test_trust_bench import _fake_models, _llama_bench_fields


def rec(**over: Any) -> dict[str, Any]:
    """A whole llama-bench record as `llmrun bench` stores it (every column the script reads)."""
    r: dict[str, Any] = {
        "build_commit": "aaaaaaa",
        "build_number": 1,
        "cpu_info": "CPU X",
        "gpu_info": "",
        "backends": "CPU",
        "model_filename": "m.gguf",
        "model_type": "llama 1B Q4_0",
        "model_size": 1000,
        "model_n_params": 1000,
        "n_batch": 2048,
        "n_ubatch": 512,
        "n_threads": 2,
        "type_k": "f16",
        "type_v": "f16",
        "n_gpu_layers": -1,
        "flash_attn": -1,
        **LLAMA_DEFAULTS,
        "repack": True,
        "n_prompt": 8,
        "n_gen": 0,
        "n_depth": 0,
        "test_time": "2026-11-30T00:00:00Z",
        "avg_ns": 1000,
        "stddev_ns": 0,
        "avg_ts": 100.0,
        "stddev_ts": 1.0,
        "samples_ns": [1000],
        "test": "pp8",
        "model_name": "m",
        "background_cpus": 0.0,
    }
    r.update(over)
    r.setdefault("samples_ts", repetitions(r["avg_ts"], r["stddev_ts"]))
    return r


# Five repetitions' deviations with a mean of 0 and a sample standard deviation of 1
SPREAD = (-1.2649110640673518, -0.6324555320336759, 0.0, 0.6324555320336759, 1.2649110640673518)


def repetitions(avg_ts: float, stddev_ts: float) -> list[float]:
    """Five repetitions' rates with this mean and standard deviation, as a record keeps them."""
    return [avg_ts + stddev_ts * k for k in SPREAD]


def store(*records: dict[str, Any], path: Path | None = None) -> int:
    with History(path) as h:
        return h.store(list(records), kind="local", model="m", system={})


def stored(
    run_id: int, *records: dict[str, Any], time: str = "2026-11-30T00:00:00+00:00"
) -> list[Stored]:
    return [Stored(run_id, time, r) for r in records]


def sel(text: str, option: str = "-b") -> Selector:
    return parse_selector(text, option=option)


# ---- the SQL of later runs, with other figures, into one database ---------------------------


def test_sql_of_runs_with_other_figures_goes_into_a_llama_bench_table_run_after_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, llmrun_env: dict[str, str]
) -> None:
    """(llmrun_env: the script is fetched on first use.) A table llama-bench made, then
    llmrun's SQL of a pp run, of pp/tg/pg rows in one output (pp first), of two models
    (relative_ts) and of a draft sweep: every INSERT goes in and
    every figure is kept (`no column named relative_ts`/`pp_ts`, and a dropped pp_ts, before)."""
    monkeypatch.setenv("LLMRUN_HOME", str(tmp_path))
    _fake_models(monkeypatch)
    db = sqlite3.connect(tmp_path / "llama-bench.sqlite")
    schema = _llama_bench_fields()  # as llama-bench creates it (llmrun fills every column)
    db.execute(f"CREATE TABLE llama_bench ({', '.join(f'{f} {t}' for f, t in schema.items())})")
    shapes = (
        ["-p", "8", "-n", "0"],
        ["-p", "8", "-n", "2", "-pg", "8,2"],
        None,
        ["-p", "0", "-n", "4", "--draft", "0,2"],
    )
    printed = []
    for shape in shapes:
        if shape is None:  # two models: each row's speed against the first's (relative_ts)
            sql = format_records(
                [rec(relative_ts=1.0), rec(model_filename="b.gguf", relative_ts=1.25)],
                OutputFormat.sql,
            )
        else:
            done = CliRunner().invoke(
                app, ["bench", "-r", "1", "--no-history", *shape, "-o", "sql"]
            )
            assert done.exit_code == 0, done.stderr
            sql = done.stdout
        db.executescript(sql)
        printed += [r for r in sql.splitlines() if r.startswith("INSERT INTO llama_bench ")]
    rows = db.execute(
        "SELECT llama_bench.rowid, n_prompt, n_gen, figures FROM llama_bench"
        " LEFT JOIN llama_bench_llmrun ON bench_rowid = llama_bench.rowid"
        " ORDER BY llama_bench.rowid"
    ).fetchall()
    assert len(rows) == len(printed) == 1 + 3 + 2 + 2
    figures = [json.loads(f) for *_, f in rows]
    assert [f["test"] for f in figures] == [
        "pp8",
        "pp8",
        "tg2",
        "pp8+tg2",
        "pp8",
        "pp8",
        "tg4",
        "tg4",
    ]
    assert figures[0]["ttft_ms"] > 0 and figures[2]["itl_p50_ms"] > 0
    pg = figures[3]
    assert pg["test"] == "pp8+tg2" and pg["pp_ts"] > 0 and pg["tg_ts"] > 0
    assert [f.get("relative_ts") for f in figures[4:6]] == [1.0, 1.25]
    assert [f.get("draft") for f in figures[6:]] == [None, 2]  # a row without drafting: none
    assert "acceptance_rate" in figures[7] and "tokens_per_step" in figures[7]


def test_history_keeps_every_figure_whatever_ran_before(tmp_path: Path) -> None:
    """The history stores each record whole: a pg row after pp rows keeps pp_ts and tg_ts, a
    later row's new figure (relative_ts) goes in beside older ones without one."""
    store(rec())
    store(rec(n_gen=2, test="pp8+tg2", pp_ts=900.0, tg_ts=90.0), rec(relative_ts=1.0))
    with History() as h:
        records = [s.record for s in h.bench_results()]
    assert (records[1]["pp_ts"], records[1]["tg_ts"]) == (900.0, 90.0)
    assert records[2]["relative_ts"] == 1.0 and "relative_ts" not in records[0]


# ---- choosing the sets ------------------------------------------------------------------------


def test_selectors_read_builds_runs_dates_and_llama_bench_flags() -> None:
    s = sel("abc1234")
    assert s.builds == ("abc1234",) and s.fields == frozenset()
    s = sel("build=abc,t=4,fa=on,ctk=q8_0,nkvo=1,ngl=99,run=3-5,since=2026-11-01,model=Q4")
    assert s.fields == {
        "n_threads",
        "flash_attn",
        "type_k",
        "no_kv_offload",
        "n_gpu_layers",
        "model_filename",
        "model_type",
    }
    r = rec(
        build_commit="abc1234",
        n_threads=4,
        flash_attn=1,
        type_k="q8_0",
        no_kv_offload=True,
        n_gpu_layers=99,
        model_name="smol-Q4_K_M",
    )
    assert s.matches(Stored(4, "2026-11-30T01:00:00+00:00", r))
    assert not s.matches(Stored(6, "2026-11-30T01:00:00+00:00", r))  # run 6 is outside 3-5
    assert not s.matches(Stored(4, "2026-10-30T01:00:00+00:00", r))  # before since
    assert not s.matches(Stored(4, "2026-11-30T01:00:00+00:00", {**r, "flash_attn": 0}))
    assert sel("fa=auto").terms[0].value == -1 and sel("fa=0").terms[0].value == 0
    assert sel("date=2026-11").matches(Stored(1, "2026-11-30T01:00:00+00:00", r))
    assert not sel("date=2026-12").matches(Stored(1, "2026-11-30T01:00:00+00:00", r))


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("t=x", "-b 't=x': t= takes a whole number, not 'x'"),
        ("foo=1", "unknown key 'foo'"),
        ("run=5-3", "the range runs backwards"),
        ("run=a", "takes a run id or a range"),
        ("date=2026-13", "takes a day, month or year"),
        ("since=yesterday", "takes a day such as 2026-11-30"),
        ("nkvo=maybe", "takes 1 or 0"),
        ("abc,,t=1", "an empty term"),
        ("t=", "t= needs a value"),
    ],
)
def test_a_bad_selector_is_one_clear_line(text: str, says: str) -> None:
    with pytest.raises(BadRequestError, match=None) as e:
        sel(text)
    assert says in str(e.value) and "\n" not in str(e.value)


# ---- pairing and averaging --------------------------------------------------------------------


def test_builds_pair_on_the_scripts_key_fields_and_repeated_runs_are_averaged() -> None:
    old = [
        *stored(1, rec(avg_ts=100.0, stddev_ts=1.0), rec(n_prompt=0, n_gen=4, avg_ts=10.0)),
        *stored(2, rec(avg_ts=110.0, stddev_ts=1.0), rec(n_batch=512, avg_ts=50.0)),
    ]
    new = stored(
        3,
        *(
            rec(build_commit="bbbbbbb", avg_ts=200.0, stddev_ts=2.0),
            rec(build_commit="bbbbbbb", n_prompt=0, n_gen=4, avg_ts=30.0),
        ),
    )
    found = compare_sets([*old, *new], sel("aaaaaaa"), sel("bbbbbbb", "-c"))
    assert [p.test for p in found.pairs] == ["pp8", "tg4"]
    pp, tg = found.pairs
    assert (pp.baseline.runs, pp.compare.runs) == (2, 1)
    assert pp.baseline.avg_ts == pytest.approx(105.0)  # the mean of the runs' avg_ts
    assert pp.baseline.stddev_ts == pytest.approx(math.sqrt(1.0 + 25.0))  # within + between
    assert pp.speedup == pytest.approx(200.0 / 105.0) and tg.speedup == pytest.approx(3.0)
    assert pp.verdict == "faster"
    d = pp.difference  # the runs' repetitions pooled: 10 against 5, Welch on log rates
    assert d is not None and (d.n_a, d.n_b) == (10, 5) and d.low < 200 / 105 < d.high  # type: ignore[operator]
    assert (found.unpaired_baseline, found.unpaired_compare) == (1, 0)  # -b 512: no partner
    assert found.shown == ("model_type",)
    records = found.records()
    assert records[0]["baseline_runs"] == 2 and records[0]["speedup"] == pytest.approx(1.9048)
    assert records[0]["speedup_verdict"] == "faster" and records[0]["speedup_reps"] == [10, 5]
    assert records[0]["speedup_low"] < records[0]["speedup_ratio"] < records[0]["speedup_high"]


def test_a_setting_named_by_both_sets_is_compared_across_and_others_must_match() -> None:
    """-b t=1 -c t=2 pairs across n_threads; a key field neither names (n_batch) still splits."""
    results = stored(
        1,
        rec(n_threads=1, avg_ts=50.0),
        rec(n_threads=2, avg_ts=90.0),
        rec(n_threads=2, n_batch=512, avg_ts=80.0),
    )
    found = compare_sets(results, sel("t=1"), sel("t=2", "-c"))
    assert [(p.test, p.compare.avg_ts) for p in found.pairs] == [("pp8", 90.0)]
    assert found.ignored == ("n_threads",) and found.unpaired_compare == 1
    shown = compare_sets(results, sel("t=1"), sel("t=2", "-c"), show=["n_batch"])
    assert [p.shown for p in shown.pairs] == [(("n_batch", 2048),)]


def test_a_setting_fixed_on_one_side_only_still_pairs_and_is_not_averaged_away() -> None:
    """-b aaaaaaa,t=1 -c bbbbbbb: the compare build's t=1 and t=2 rows are not one average."""
    results = [
        *stored(1, rec(n_threads=1, avg_ts=50.0)),
        *stored(
            2,
            rec(n_threads=1, avg_ts=60.0, build_commit="bbbbbbb"),
            rec(n_threads=2, avg_ts=200.0, build_commit="bbbbbbb"),
        ),
    ]
    found = compare_sets(results, sel("aaaaaaa,t=1"), sel("bbbbbbb", "-c"))
    assert [(p.baseline.avg_ts, p.compare.avg_ts) for p in found.pairs] == [(50.0, 60.0)]
    assert found.ignored == () and found.unpaired_compare == 1


def test_the_default_compare_set_leaves_out_what_the_baseline_holds() -> None:
    """After `bench -t 1,2`, `history -b t=1` takes the newest run less its t=1 rows, which are
    in the baseline: no "sets overlap" refusal for a set the user never chose. Its t=2 rows do
    not pair with t=1 (the baseline alone fixes -t), and that is what it says."""
    results = [
        *stored(1, rec(n_threads=1, avg_ts=50.0)),
        *stored(2, rec(n_threads=1, avg_ts=55.0), rec(n_threads=2, avg_ts=90.0)),
    ]
    with pytest.raises(BadRequestError, match="no comparable results") as refused:
        compare_sets(results, sel("t=1"), None)
    assert "share" not in str(refused.value)
    both = compare_sets(results, sel("t=1"), sel("run=2,t=2", "-c"))
    assert [(p.baseline.avg_ts, p.compare.avg_ts) for p in both.pairs] == [(52.5, 90.0)]
    assert both.ignored == ("n_threads",)


def test_sets_of_other_test_shapes_pair_and_say_so() -> None:
    """-b p=512 -c p=1024 compares prompt lengths: the test names each side's."""
    results = stored(1, rec(n_prompt=512, avg_ts=100.0), rec(n_prompt=1024, avg_ts=80.0))
    (p,) = compare_sets(results, sel("p=512"), sel("p=1024", "-c")).pairs
    assert p.test == "pp512 vs pp1024" and p.speedup == pytest.approx(0.8)


def test_show_groups_as_the_script_does_averaging_what_it_leaves_out() -> None:
    results = [
        *stored(1, rec(n_batch=256, avg_ts=10.0), rec(n_batch=512, avg_ts=30.0)),
        *stored(
            2,
            rec(n_batch=256, avg_ts=20.0, build_commit="bbbbbbb"),
            rec(n_batch=512, avg_ts=60.0, build_commit="bbbbbbb"),
        ),
    ]
    every = compare_sets(results, sel("aaaaaaa"), sel("bbbbbbb", "-c"))
    assert every.shown == ("model_type", "n_batch") and len(every.pairs) == 2
    by_model = compare_sets(results, sel("aaaaaaa"), sel("bbbbbbb", "-c"), show=["model_type"])
    (p,) = by_model.pairs
    assert (p.baseline.avg_ts, p.compare.avg_ts, p.baseline.runs) == (20.0, 40.0, 2)
    with pytest.raises(BadRequestError, match="--show: unknown 'n_prompt'"):
        compare_sets(results, sel("aaaaaaa"), sel("bbbbbbb", "-c"), show=["n_prompt"])


def test_an_older_absolute_model_path_pairs_with_the_name_as_given() -> None:
    results = [
        *stored(1, rec(model_filename="/home/u/models/m.gguf")),
        *stored(2, rec(build_commit="bbbbbbb")),
    ]
    assert len(compare_sets(results, sel("aaaaaaa"), sel("bbbbbbb", "-c")).pairs) == 1


def test_the_default_compare_set_is_the_newest_run_outside_the_baseline() -> None:
    results = [*stored(1, rec()), *stored(2, rec(avg_ts=120.0)), *stored(3, rec(avg_ts=130.0))]
    found = compare_sets(results, sel("run=1"), None)
    assert found.compare == "run 3" and found.pairs[0].compare.avg_ts == 130.0
    with pytest.raises(BadRequestError, match="every stored bench result is in the baseline"):
        compare_sets(results, sel("aaaaaaa"), None)


def test_a_busy_machine_is_called_noise_in_a_comparison_too() -> None:
    """The verdict is the one `bench --compare` gives: a difference measured while other
    processes took the CPU is marked as maybe noise, its direction still shown."""
    quiet = stored(1, rec(avg_ts=100.0, stddev_ts=1.0))
    busy = stored(2, rec(avg_ts=50.0, stddev_ts=1.0, background_cpus=64.0))
    assert compare_sets([*quiet, *busy], sel("run=1"), None).pairs[0].verdict == (
        "slower (busy machine: may be noise)"
    )
    calm = stored(2, rec(avg_ts=50.0, stddev_ts=1.0))
    assert compare_sets([*quiet, *calm], sel("run=1"), None).pairs[0].verdict == "slower"
    close = stored(2, rec(avg_ts=101.0, stddev_ts=1.0))
    assert compare_sets([*quiet, *close], sel("run=1"), None).pairs[0].verdict == (
        "no difference detectable: about 6 repetitions would resolve 2 %"
    )


def test_records_without_repetitions_are_judged_by_their_spread() -> None:
    """A record written by hand or by another tool, without samples_ts: no interval can be
    made, so the spread rule (mean ± stddev ranges that do not overlap) decides."""
    quiet = stored(1, rec(avg_ts=100.0, stddev_ts=1.0, samples_ts=None))
    calm = stored(2, rec(avg_ts=50.0, stddev_ts=1.0, samples_ts=None))
    pair = compare_sets([*quiet, *calm], sel("run=1"), None).pairs[0]
    assert pair.difference is None and pair.verdict == "regression"
    assert compare_sets([*quiet, *calm], sel("run=1"), None).records()[0]["speedup_low"] is None


@pytest.mark.parametrize(
    ("baseline", "compare", "says"),
    [
        ("zzzzzzz", "aaaaaaa", "no stored bench result has build 'zzzzzzz' (stored: aaaaaaa,"),
        ("aaaaaaa", "build=fffffff", "has build 'fffffff'"),
        ("run=9", None, "baseline 'run=9' matches no stored bench result"),
        ("run=1", "t=7", "compare 't=7' matches no stored bench result"),
        ("run=1", "build=aaa", "share 1 results: choose sets that do not overlap"),
        ("run=1", "run=2", "no comparable results: nothing in 'run=1' has the same model"),
    ],
)
def test_bad_sets_are_one_clear_line(baseline: str, compare: str | None, says: str) -> None:
    results = [*stored(1, rec()), *stored(2, rec(build_commit="bbbbbbb", n_batch=64))]
    with pytest.raises(BadRequestError) as e:
        compare_sets(results, sel(baseline), None if compare is None else sel(compare, "-c"))
    assert says in str(e.value)


def test_pair_fields_are_the_scripts_key_properties(llmrun_env: dict[str, str]) -> None:
    """llmrun pairs as compare-llama-bench.py does (plus llmrun's own repack and draft); the
    script is fetched on first use (llmrun_env: that may start pip)."""
    tree = ast.parse(llama_tools.compare_script().read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == (
            "LLAMA_BENCH_KEY_PROPERTIES"
        ):
            assert ast.literal_eval(node.value) == list(PAIR_FIELDS)
            break
    else:
        raise AssertionError("LLAMA_BENCH_KEY_PROPERTIES not found")
    assert set(LLMRUN_PAIR_FIELDS).isdisjoint(PAIR_FIELDS)


# ---- the command --------------------------------------------------------------------------------


def _two_builds() -> None:
    store(rec(avg_ts=100.0), rec(n_prompt=0, n_gen=4, test="tg4", avg_ts=10.0))
    store(rec(avg_ts=104.0), rec(n_prompt=0, n_gen=4, test="tg4", avg_ts=12.0))
    store(
        rec(build_commit="bbbbbbb", avg_ts=150.0),
        rec(build_commit="bbbbbbb", n_prompt=0, n_gen=4, test="tg4", avg_ts=11.0),
    )


def test_history_compares_two_builds_in_every_format() -> None:
    _two_builds()
    cli = CliRunner()
    done = cli.invoke(app, ["history", "-b", "aaaaaaa", "-c", "bbbbbbb", "-o", "md"])
    assert done.exit_code == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [c.strip() for c in lines[0].strip("|").split("|")] == [
        "Model",
        "Test",
        "t/s aaaaaaa",
        "t/s bbbbbbb",
        "Speedup",
        "ratio (95 % CI)",
        "Runs",
        "Verdict",
    ]
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells == [
        "llama 1B Q4_0",
        "pp8",
        "102.00 ± 2.24",
        "150.00 ± 1.00",
        "1.47",
        cells[5],
        "2/1",
        "faster",
    ]
    assert cells[5].startswith("x1.47") and float(cells[5].split("(")[1].split("-")[0]) > 1
    done = cli.invoke(app, ["history", "-b", "aaaaaaa", "-c", "bbbbbbb", "-o", "csv"])
    rows = list(csv.DictReader(io.StringIO(done.stdout)))
    assert [(r["test"], r["baseline_runs"], r["speedup"]) for r in rows] == [
        ("pp8", "2", "1.4706"),
        ("tg4", "2", "1.0"),
    ]
    done = cli.invoke(app, ["history", "-b", "aaaaaaa", "-o", "json"])  # -c: the newest run
    rows = json.loads(done.stdout)
    assert [r["compare"] for r in rows] == ["run 3", "run 3"]
    assert rows[1]["verdict"].startswith("no difference detectable")  # tg: 11 ± 1 against 11 ± 1
    done = cli.invoke(app, ["history", "-b", "aaaaaaa", "-c", "bbbbbbb"], env={"COLUMNS": "160"})
    assert done.exit_code == 0 and "faster" in done.stdout and "2/1" in done.stdout


@pytest.mark.parametrize(
    ("args", "code", "says"),
    [
        (["-b", "zzzzzzz"], 1, "llmrun: error: no stored bench result has build 'zzzzzzz'"),
        (["-b", "t=9"], 1, "llmrun: error: baseline 't=9' matches no stored bench result"),
        (["-b", "t=two"], 2, "llmrun: error: -b 't=two': t= takes a whole number"),
        (["-b", "aaaaaaa", "-s", "bogus"], 1, "llmrun: error: --show: unknown 'bogus'"),
        (["-c", "bbbbbbb"], 2, "give the baseline with -b too"),
        (["-o", "json"], 2, "give the baseline with -b too"),
        (["--export-sql", "x.sqlite", "-b", "aaaaaaa"], 2, "give it without -b"),
    ],
)
def test_bad_comparisons_end_in_one_line(args: list[str], code: int, says: str) -> None:
    _two_builds()
    done = CliRunner().invoke(app, ["history", *args])
    assert done.exit_code == code and done.stdout == ""
    assert done.stderr.count("\n") == 1 and says in done.stderr, done.stderr


def test_comparing_an_empty_history_says_so() -> None:
    done = CliRunner().invoke(app, ["history", "-b", "aaaaaaa"])
    assert done.exit_code == 1 and "no bench results stored" in done.stderr


# ---- the history for compare-llama-bench.py -----------------------------------------------------


def test_export_sql_writes_llama_benchs_table_once_and_never_over_a_file(tmp_path: Path) -> None:
    older = rec()
    for field in ("n_cpu_moe", "fit_target", "fit_min_ctx", "devices"):  # an older llmrun's row
        del older[field]
    store(older)
    store(rec(n_gen=2, test="pp8+tg2", pp_ts=900.0, tg_ts=90.0))
    target = tmp_path / "llama-bench.sqlite"
    done = CliRunner().invoke(app, ["history", "--export-sql", str(target)])
    assert done.exit_code == 0, done.stderr
    db = sqlite3.connect(target)
    assert db.execute("SELECT n_cpu_moe, fit_target, n_gen FROM llama_bench").fetchall() == [
        (0, 0, 0),
        (0, 0, 2),
    ]
    (figures,) = db.execute(
        "SELECT figures FROM llama_bench_llmrun WHERE bench_rowid = 2"
    ).fetchone()
    assert json.loads(figures)["pp_ts"] == 900.0
    again = CliRunner().invoke(app, ["history", "--export-sql", str(target)])
    assert again.exit_code == 1 and "exists: name a new file" in again.stderr
    assert db.execute("SELECT count(*) FROM llama_bench").fetchone() == (2,)  # untouched
    printed = CliRunner().invoke(app, ["history", "--export-sql", "-"])
    assert printed.exit_code == 0
    assert printed.stdout == format_records(
        [s.record for s in History().bench_results()], OutputFormat.sql
    )


def test_compare_llama_bench_reads_the_exported_history(
    tmp_path: Path, llmrun_env: dict[str, str]
) -> None:
    """The real script, on llmrun's history exported: the same pairs and speedups as
    `llmrun history -b -c` (an older record lacking columns still pairs)."""
    older = rec(avg_ts=100.0)
    del older["n_cpu_moe"]
    store(older, rec(n_prompt=0, n_gen=4, test="tg4", avg_ts=10.0))
    store(
        rec(build_commit="bbbbbbb", avg_ts=150.0),
        rec(build_commit="bbbbbbb", n_prompt=0, n_gen=4, test="tg4", avg_ts=12.0),
    )
    target = tmp_path / "exported.sqlite"
    assert CliRunner().invoke(app, ["history", "--export-sql", str(target)]).exit_code == 0
    done = subprocess.run(
        [
            sys.executable,
            str(llama_tools.compare_script()),
            "-i",
            str(target),
            "-b",
            llmrun_build("aaaaaaa"),  # llmrun's rows, marked as its own in the export too
            "-c",
            llmrun_build("bbbbbbb"),
        ],
        capture_output=True,
        text=True,
        timeout=HANG_S,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    theirs = {
        ln.split("|")[-5].strip(): float(ln.split("|")[-2])
        for ln in done.stdout.splitlines()
        if "llama 1B Q4_0" in ln
    }
    ours = CliRunner().invoke(app, ["history", "-b", "aaaaaaa", "-c", "bbbbbbb", "-o", "json"])
    assert theirs == {
        r["test"]: pytest.approx(r["speedup"], abs=0.01) for r in json.loads(ours.stdout)
    }
    assert theirs == {"pp8": pytest.approx(1.5), "tg4": pytest.approx(1.2)}


def test_each_run_is_judged_against_the_one_before_by_its_repetitions() -> None:
    tg = {"n_prompt": 0, "n_gen": 4, "test": "tg4"}
    store(rec(avg_ts=100.0, stddev_ts=1.0), rec(**tg, avg_ts=10.0, stddev_ts=0.1))
    second = store(rec(avg_ts=90.0, stddev_ts=1.0), rec(**tg, avg_ts=10.05, stddev_ts=0.1))
    with History() as h:
        pp_change, tg_change = h.compare(h.runs(limit=1)[0]["records"], before_run=second)
    assert pp_change.verdict == "slower" and pp_change.previous_run == 1
    d = pp_change.difference
    assert d is not None and d.low < 0.9 < d.high < 1  # type: ignore[operator]
    assert tg_change.verdict == "no difference detectable: about 6 repetitions would resolve 2 %"
    done = CliRunner().invoke(app, ["history", "-n", "1"], env={"COLUMNS": "200"})
    assert done.exit_code == 0, done.stderr
    assert "ratio (95 % CI)" in done.stdout and "slower (run 1)" in done.stdout
    assert f"x0.900 ({d.low:.3f}-{d.high:.3f})" in done.stdout


def _damage(column: str, value: object, *, rowid: int = 2, table: str = "results") -> None:
    """A stored row changed by hand, as a tester (or a crash) leaves it."""
    from llmrun.runners.history import history_path

    with sqlite3.connect(history_path()) as db:
        db.execute(f"UPDATE {table} SET {column} = ? WHERE rowid = ?", (value, rowid))


@pytest.mark.parametrize(
    "record",
    [
        '{"test": "pp8", "avg_ts": NaN, "stddev_ts": Infinity}',
        '{"test": "pp8", "avg_ts": -5, "stddev_ts": -1}',
        '{"test": "pp8", "avg_ts": 1e308, "stddev_ts": 1}',
        '{"test": "pp8", "avg_ts": 5, "stddev_ts": 1, "samples_ts": [4, NaN]}',
        "not json",
    ],
    ids=["nan", "negative", "huge", "nan-sample", "not-json"],
)
def test_a_row_whose_figures_are_no_rates_is_skipped_and_said(record: str) -> None:
    """`t/s now nan ± inf`, `-5.0 ± -1.0` and a 400-digit number over 14 lines were shown as
    measurements; a record that was not JSON left an empty table under its run's header."""
    store(rec(avg_ts=100.0, stddev_ts=1.0))
    store(rec(avg_ts=90.0, stddev_ts=1.0), rec(n_prompt=0, n_gen=4, test="tg4", avg_ts=10.0))
    _damage("record", record, rowid=3)  # the newest run's tg4
    done = CliRunner().invoke(app, ["history", "-n", "1"], env={"COLUMNS": "200"})
    assert done.exit_code == 0, done.stderr
    assert "pp8" in done.stdout and "90.0 ± 1.0" in done.stdout and "tg4" not in done.stdout
    assert "1 damaged result of run 2 skipped" in done.stdout
    _damage("record", record, rowid=2)  # and its pp8: nothing of it is left to show
    done = CliRunner().invoke(app, ["history", "-n", "1"], env={"COLUMNS": "200"})
    assert done.exit_code == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("run 2 · ") and "2 damaged results of run 2 skipped" in lines[1]
    assert len(lines) == 2 and "┃" not in done.stdout and "nan" not in done.stdout
    with History() as h:  # nor is it any run's "before"
        assert h.compare([rec(avg_ts=1.0)], before_run=None)[0].previous_run == 1


@pytest.mark.parametrize(
    "field",
    [
        {"avg_ts": 1e-300, "samples_ts": [1e-300, 2e-300]},
        {"background_cpus": 10**400},
        {"n_threads": 10**400},
        {"n_gen": math.inf},
        {"n_prompt": "8"},
        {"type_k": {"a": 1}},
        {"tensor_split": [0.5, 0.5]},
        {"model_size": math.nan},
    ],
    ids=["tiny-rate", "huge-load", "huge-threads", "inf-test", "text-test", "dict", "list", "nan"],
)
def test_a_row_whose_fields_no_reading_takes_is_skipped_everywhere(field: dict[str, Any]) -> None:
    """A rate of 1e-300 made the ratio of two runs overflow (math range error); a 400-digit
    background_cpus, n_gen Infinity and type_k {"a": 1} ended -b/-c in an internal error
    (int too large to convert to float, cannot convert float infinity to integer, unhashable
    type). Each is a damaged row, skipped and said, in the list, -b/-c and --export-sql."""
    store(rec(avg_ts=100.0), rec(n_prompt=0, n_gen=4, test="tg4", avg_ts=10.0))
    store(rec(avg_ts=90.0), rec(n_prompt=0, n_gen=4, test="tg4", avg_ts=10.0))
    _damage("record", json.dumps(rec(avg_ts=80.0) | field), rowid=3)  # run 2's pp8
    for args in (["history"], ["history", "-n", "1", "-m", "m"]):
        done = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
        assert done.exit_code == 0, done.stderr
        assert "1 damaged result of run 2 skipped" in done.stdout
    done = CliRunner().invoke(app, ["history", "-b", "run=1", "-c", "run=2"])
    assert done.exit_code == 0, done.stderr
    assert "tg4" in done.stdout and "pp8" not in done.stdout
    done = CliRunner().invoke(app, ["history", "--export-sql", "-"])
    assert done.exit_code == 0, done.stderr
    assert done.stdout.count("INSERT INTO llama_bench ") == 3


@pytest.mark.parametrize("n_prompt", ["1e400", "-1e400", "nan", "abc", "-8"])
def test_a_llama_bench_row_whose_test_is_no_size_is_skipped(n_prompt: str) -> None:
    """llama-bench's own row with n_prompt '1e400' (stored as an infinity) ended -b/-c and
    --export-sql - in an internal error (cannot convert float infinity to integer)."""
    from llmrun.runners.history import history_path

    store(rec(avg_ts=100.0))
    with sqlite3.connect(history_path()) as db:
        db.execute(
            "CREATE TABLE llama_bench (model_filename TEXT, model_type TEXT, n_prompt INTEGER,"
            " n_gen INTEGER, n_depth INTEGER, avg_ts REAL, stddev_ts REAL)"
        )
        db.execute(
            "INSERT INTO llama_bench VALUES ('m.gguf', 'llama 1B Q4_0', ?, 0, 0, 90.0, 1.0)",
            (n_prompt,),
        )
    done = CliRunner().invoke(app, ["history", "--export-sql", "-"])
    assert done.exit_code == 0, done.stderr
    assert done.stdout.count("INSERT INTO llama_bench ") == 1
    done = CliRunner().invoke(app, ["history", "-b", "tool=llama-bench", "-c", "run=1"])
    assert done.exit_code == 1
    assert done.stderr.strip().splitlines() == [
        "llmrun: error: baseline 'tool=llama-bench' matches no stored bench result"
    ]


def test_stored_text_reaches_the_terminal_as_text() -> None:
    """A record's `test` of `serve \\x1b[2J c1` cleared the screen; `[/x]` in it was read as
    rich markup (an internal error); a BLOB model name showed as Python's b'\\xff\\xfe\\x00'."""
    store(rec(avg_ts=100.0))
    store(rec(avg_ts=90.0))
    _damage("record", json.dumps({"test": "serve \x1b[2J c1 [/x]", "avg_ts": 1, "n_threads": 2}))
    _damage("model", b"\xff\xfe\x00m", table="runs")
    _damage("kind", b"\x1b]0;pwned\x07local", table="runs")
    done = CliRunner().invoke(app, ["history", "-n", "1"], env={"COLUMNS": "200"})
    assert done.exit_code == 0, done.stderr
    assert "\x1b" not in done.stdout and "\x00" not in done.stdout and "b'" not in done.stdout
    assert " · local · \ufffd\ufffdm" in done.stdout.splitlines()[0]
    assert "serve c1 [/x]" in done.stdout
    marked = "llama \x1b[2J [/x]"  # in both runs: compared, its column shown
    store(rec(avg_ts=100.0, model_type=marked))
    store(rec(avg_ts=90.0, model_type=marked))
    compared = CliRunner().invoke(
        app, ["history", "-b", "run=3", "-c", "run=4"], env={"COLUMNS": "200"}
    )
    assert compared.exit_code == 0, compared.stderr
    assert "llama  [/x]" in compared.stdout and "\x1b" not in compared.stdout


def test_text_that_is_not_utf8_is_read_with_replacement_everywhere() -> None:
    """One run whose time was TEXT holding the byte 0xff made `history`, -b/-c and
    --export-sql refuse the whole database (Could not decode to UTF-8 column 'time')."""
    from llmrun.runners.history import history_path

    store(rec(avg_ts=100.0))
    store(rec(avg_ts=90.0))
    with sqlite3.connect(history_path()) as db:
        db.execute("UPDATE runs SET time = CAST(x'323032362dff' AS TEXT) WHERE id = 2")
        db.execute("UPDATE runs SET model = CAST(x'6dfe' AS TEXT) WHERE id = 1")
    done = CliRunner().invoke(app, ["history"], env={"COLUMNS": "200"})
    assert done.exit_code == 0, done.stderr
    assert "2026-\ufffd" in done.stdout and "m\ufffd" in done.stdout
    done = CliRunner().invoke(app, ["history", "-b", "run=1", "-c", "run=2"])
    assert done.exit_code == 0, done.stderr
    assert "pp8" in done.stdout
    done = CliRunner().invoke(app, ["history", "--export-sql", "-"])
    assert done.exit_code == 0, done.stderr
    assert done.stdout.count("INSERT INTO llama_bench ") == 2


def test_names_given_by_the_user_reach_the_terminal_without_escapes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--export-sql $'/tmp/x/\\e[41mX.sqlite'` printed `2 results written to` the name with
    its escape sequence raw, colouring the terminal; so did an LLMRUN_HOME holding one."""
    monkeypatch.setenv("LLMRUN_HOME", str(tmp_path / "\x1b[41mhome"))
    done = CliRunner().invoke(app, ["history"])
    assert done.exit_code == 0, done.stderr
    assert "no bench runs stored yet (in " in done.stdout and "\x1b" not in done.stdout
    store(rec(avg_ts=100.0))
    done = CliRunner().invoke(app, ["history", "-m", "\x1b[41mzz"])
    assert done.exit_code == 0, done.stderr
    assert "model name contains" in done.stdout and "\x1b" not in done.stdout
    target = tmp_path / "\x1b[41mX.sqlite"
    done = CliRunner().invoke(app, ["history", "--export-sql", str(target)])
    assert done.exit_code == 0, done.stderr
    assert target.exists() and "\x1b" not in done.stderr
    assert done.stderr.startswith(f"1 results written to {tmp_path}/X.sqlite (llama-bench's")


def _holds(pid: int, path: Path) -> bool:
    """Whether process `pid` has `path` open (Linux's /proc; elsewhere, after 3 s)."""
    fds = Path(f"/proc/{pid}/fd")
    if not fds.is_dir():
        time.sleep(3)
        return True
    found = []
    for fd in fds.iterdir():
        try:
            found.append(os.readlink(fd))
        except OSError:
            continue
    return str(path) in found


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_the_wait_for_a_locked_history_ends_on_a_signal(
    signum: int, code: int, llmrun_env: dict[str, str]
) -> None:
    """Another process holding the history's database (BEGIN EXCLUSIVE): `history` waits for
    it, and Ctrl-C or SIGTERM ended it only when the 10 s busy timeout ran out, SQLite sleeping
    in C where Python's signal handlers cannot run."""
    from llmrun.runners.history import history_path

    store(rec())
    path = history_path()
    assert llmrun_env["LLMRUN_HOME"] in str(path)  # the child's history is this one
    holder = sqlite3.connect(path)
    holder.execute("BEGIN EXCLUSIVE")
    code_text = "import sys; from llmrun.cli.main import main; sys.argv[0] = 'llmrun'; main()"
    child = python_child(code_text, "history", env=llmrun_env)
    try:
        deadline = time.monotonic() + HANG_S
        while not _holds(child.pid, path):
            assert child.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.5)  # in the wait
        child.send_signal(signum)
        signalled = time.monotonic()
        _, err = child.communicate(timeout=HANG_S)
        took = time.monotonic() - signalled
    finally:
        child.kill()
        holder.close()
    assert child.returncode == code, err
    assert took < 3, f"ended {took:.1f} s after the signal"
    assert "Traceback" not in err and "internal error" not in err, err
