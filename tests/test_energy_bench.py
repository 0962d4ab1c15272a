"""Energy in bench: a fake powercap tree on a fake clock that a fake bench runner advances, so
each test's joules per repetition, per token and in watts have a known answer; and the
--energy switch of run and bench, with nothing readable (as on this machine)."""

from __future__ import annotations

import io
import json
import statistics
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmrun.cli import engine, session
from llmrun.cli.app import app
from llmrun.runners.base import Event, Finished, PrefillProgress, Request, Token
from llmrun.runners.bench import measure
from llmrun.runners.bench.results import Result
from llmrun.runners.bench.sweep import Combo, Shape
from llmrun.runners.config import EngineConfig
from llmrun.runners.energy import PhaseMeter, open_meter
from llmrun.runners.energy.bench import ENERGY_FIELDS
from llmrun.runners.energy.powercap import ROOT_ENV
from llmrun.runners.llamacpp import LlamaCppRunner

from .fake import FakeBenchRunner, FakeRunner
from .test_energy import CpuTimeCounter, Machine, Meter, zone
from .test_significance import _system

IDLE_W, BUSY_W = 10.0, 30.0
PREFILL_S_PER_TOKEN, ITL_S = 0.001, 0.010

SYSTEM = _system()


class TimedFake(FakeBenchRunner):
    """The fake bench runner on the fake machine's clock: 1 ms a prompt token, 10 ms between
    output tokens, drawing BUSY_W while it runs."""

    def __init__(self, machine: Machine, counter: Meter) -> None:
        super().__init__()
        self.machine, self.counter = machine, counter

    def stream(self, request: Request, *, cancel: threading.Event | None = None) -> Iterator[Event]:
        self.counter.watts = BUSY_W
        done = None
        for event in super().stream(request, cancel=cancel):
            if isinstance(event, PrefillProgress):
                if done is not None:
                    self.machine.sleep((event.done_tokens - done) * PREFILL_S_PER_TOKEN)
                done = event.done_tokens
            elif isinstance(event, Token) and event.index:
                self.machine.sleep(ITL_S)
            elif isinstance(event, Finished):
                self.counter.watts = IDLE_W
            yield event


@pytest.fixture
def machine() -> Machine:
    return Machine()


def _bench(
    machine: Machine, tree: Path, shapes: list[Shape], reps: int = 2
) -> tuple[list[Result], PhaseMeter]:
    counter = zone(machine, tree, "intel-rapl:0", "package-0", IDLE_W)
    meter = open_meter(gpu=False, powercap_root=tree, clock=machine.clock, sleep=machine.sleep)
    fake = TimedFake(machine, counter)
    events = measure.run_bench(
        fake,  # type: ignore[arg-type]
        measure.BenchPlan(
            measure.every_shape([Combo(1, 64, 64, None, "off")], shapes), reps=reps, meter=meter
        ),
        base=EngineConfig(),
    )
    return [e for e in events if isinstance(e, Result)], meter


def test_each_test_s_phase_is_metered_per_repetition(machine: Machine, tree: Path) -> None:
    [pp, tg, pg], _ = _bench(machine, tree, [Shape(8, 0), Shape(0, 4), Shape(8, 4)])
    above = BUSY_W - IDLE_W
    # pp8: 8 prompt tokens at 1 ms each
    assert pp.energy is not None and pp.energy.reps == 2
    assert pp.energy.energy_j == pytest.approx(above * 0.008, rel=1e-6)
    assert pp.energy.j_per_token == pytest.approx(above * 0.001, rel=1e-6)
    assert pp.energy.power_w == pytest.approx(above, rel=1e-6)
    # tg4: 4 decode gaps of 10 ms (the prompt's one token is not the test)
    assert tg.energy is not None and tg.energy.tokens == 4
    assert tg.energy.energy_j == pytest.approx(above * 0.040, rel=1e-6)
    assert tg.energy.j_per_token == pytest.approx(above * 0.010, rel=1e-6)
    # pg: both phases
    assert pg.energy is not None and pg.energy.tokens == 12
    assert pg.energy.energy_j == pytest.approx(above * 0.048, rel=1e-6)
    record = tg.record(SYSTEM)
    assert [k for k in record if k.startswith("energy_")] == list(ENERGY_FIELDS)
    assert record["energy_source"] == "RAPL package-0" and record["energy_idle_w"] == IDLE_W
    assert record["energy_j"] == pytest.approx(0.8) and record["energy_w"] == pytest.approx(20.0)
    assert record["energy_note"] is None  # 80 updates of 1 ms over the two repetitions


def test_a_phase_too_short_alone_is_measured_over_the_repetitions(
    machine: Machine, tree: Path
) -> None:
    # pp1's prefill: 1 ms, shorter than two counter updates; ten repetitions: 10 ms
    [one], _ = _bench(machine, tree / "one", [Shape(1, 0)], reps=1)
    assert one.energy is not None and one.energy.energy_j is None
    assert one.energy.note == "too short for the counter: 1.0 ms against an update every 1.0 ms"
    [ten], _ = _bench(Machine(), tree / "ten", [Shape(1, 0)], reps=10)
    assert ten.energy is not None and ten.energy.reps == 10
    assert ten.energy.energy_j == pytest.approx(0.02, rel=1e-6)  # 20 W for 1 ms, each
    assert ten.energy.note == ""  # 10 updates in all: no longer coarse


def test_drawing_the_progress_is_left_out_of_the_phases(machine: Machine, tree: Path) -> None:
    counter = zone(machine, tree, "intel-rapl:0", "package-0", IDLE_W)
    meter = open_meter(gpu=False, powercap_root=tree, clock=machine.clock, sleep=machine.sleep)
    events = measure.run_bench(
        TimedFake(machine, counter),  # type: ignore[arg-type]
        measure.BenchPlan(
            measure.every_shape([Combo(1, 64, 64, None, "off")], [Shape(0, 64)]),
            reps=1,
            meter=meter,
        ),
        base=EngineConfig(),
    )
    results = []
    for event in events:
        if isinstance(event, measure.Progress) and event.moment == "working":
            counter.watts = 500.0  # the terminal's drawing, at a power of its own
            machine.sleep(0.05)
            counter.watts = BUSY_W
        elif isinstance(event, Result):
            results.append(event)
    [tg] = results
    assert tg.energy is not None and tg.energy.energy_j == pytest.approx(20.0 * 0.64, rel=1e-6)


def test_no_source_leaves_the_fields_absent_with_the_reason(tmp_path: Path) -> None:
    meter = open_meter(gpu=False, powercap_root=tmp_path / "none")
    fake = FakeBenchRunner()
    [result] = [
        e
        for e in measure.run_bench(
            fake,  # type: ignore[arg-type]
            measure.BenchPlan(
                measure.every_shape([Combo(1, 64, 64, None, "off")], [Shape(8, 0)]),
                reps=1,
                meter=meter,
            ),
            base=EngineConfig(),
        )
        if isinstance(e, Result)
    ]
    record = result.record(SYSTEM)
    assert record["energy_j"] is None and record["energy_w"] is None
    assert record["energy_note"].startswith("no RAPL counters:")
    without = measure.run_bench(
        fake,  # type: ignore[arg-type]
        measure.BenchPlan(
            measure.every_shape([Combo(1, 64, 64, None, "off")], [Shape(8, 0)]), reps=1
        ),
        base=EngineConfig(),
    )
    [plain] = [e for e in without if isinstance(e, Result)]
    assert not any(k.startswith("energy") for k in plain.record(SYSTEM))


@pytest.fixture
def nothing_readable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(ROOT_ENV, str(tmp_path / "no-powercap"))
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.delenv("LLMRUN_ENERGY", raising=False)
    monkeypatch.setattr(session, "_ENERGY", ["auto"])  # the last command's --energy, put back
    return tmp_path / "no-powercap"


def test_bench_s_switch(
    cli: CliRunner,
    nothing_readable: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(
        engine, "BENCH_RUNNER_FACTORY", lambda model, config, tuned: FakeBenchRunner()
    )
    args = ["bench", "-p", "8", "-n", "4", "-r", "1", "--no-history", "-o", "json"]
    result = cli.invoke(app, args)
    assert result.exit_code == 0, result.stderr
    rows = json.loads(result.stdout)
    assert all(r["energy_j"] is None for r in rows)
    assert all(r["energy_note"].startswith("no RAPL counters") for r in rows)
    result = cli.invoke(app, [*args, "--energy", "off"])
    assert result.exit_code == 0, result.stderr
    assert not any(k.startswith("energy") for r in json.loads(result.stdout) for k in r)
    result = cli.invoke(app, [*args, "--energy", "on"])
    assert result.exit_code == 1 and result.stdout == ""
    [line] = result.stderr.strip().splitlines()
    assert "--energy on: no energy counter can be read here (no RAPL counters:" in line


def test_run_s_switch(cli: CliRunner, fake: FakeRunner, nothing_readable: Path) -> None:
    result = cli.invoke(app, ["run", "hello", "--energy", "off"])
    assert result.exit_code == 0, result.stderr
    assert "energy" not in result.stderr
    result = cli.invoke(app, ["run", "hello", "--energy", "on"])
    assert result.exit_code == 1
    assert "--energy on: no energy counter can be read here (no RAPL counters:" in result.stderr
    assert "Traceback" not in result.stderr
    result = cli.invoke(app, ["run", "hello"], env={"LLMRUN_ENERGY": "off"})
    assert result.exit_code == 0 and "energy" not in result.stderr
    result = cli.invoke(app, ["run", "hello"])
    assert "energy   not available (no RAPL counters" in result.stderr


def test_the_tables_show_energy_where_it_was_measured(machine: Machine, tree: Path) -> None:
    from rich.console import Console

    from llmrun.cli.bench.output import OutputFormat, format_records, results_table
    from llmrun.runners.bench.results import Row

    [pp, tg], _ = _bench(machine, tree, [Shape(8, 0), Shape(0, 4)])
    records = [pp.record(SYSTEM), tg.record(SYSTEM)]
    console = Console(file=io.StringIO(), width=160, color_system=None)
    console.print(results_table([Row.of(r, rec) for r, rec in zip((pp, tg), records, strict=True)]))
    shown = console.file.getvalue()  # type: ignore[attr-defined]
    assert "energy/token" in shown
    assert "20.0 mJ · 20.0 W" in shown and "200.0 mJ · 20.0 W" in shown
    md = format_records(records, OutputFormat.md)
    assert "energy/token" in md and " 200.0 mJ · 20.0 W |" in md
    absent = [{**rec, "energy_j": None, "energy_j_per_token": None} for rec in records]
    assert "energy/token" not in format_records(absent, OutputFormat.md)


def test_history_keeps_the_energy_fields(
    cli: CliRunner, nothing_readable: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sqlite3

    from llmrun.runners.history import history_path

    monkeypatch.setattr(
        engine, "BENCH_RUNNER_FACTORY", lambda model, config, tuned: FakeBenchRunner()
    )
    result = cli.invoke(app, ["bench", "-p", "8", "-n", "0", "-r", "1", "-o", "json"])
    assert result.exit_code == 0, result.stderr
    db = sqlite3.connect(history_path())
    [(text,)] = db.execute("SELECT record FROM results").fetchall()
    record = json.loads(text)
    assert record["energy_j"] is None and record["energy_note"].startswith("no RAPL counters")


def test_the_real_engine_s_bench_tests_are_metered(runner: LlamaCppRunner) -> None:
    """On the embedded model, with a counter of this process's CPU time at 10 W (test_energy's):
    each test's own phase has joules, its tokens are the test's."""
    meter = PhaseMeter([CpuTimeCounter()], idle_window_s=0.2)
    meter.measure_idle()
    results = [
        e
        for e in measure.run_bench(
            runner,
            measure.BenchPlan(
                measure.every_shape(
                    [Combo(1, None, None, None, None)], [Shape(32, 0), Shape(0, 8)]
                ),
                reps=2,
                warmup=False,
                meter=meter,
            ),
            base=runner.config,
        )
        if isinstance(e, Result)
    ]
    [pp, tg] = results
    assert pp.energy is not None and tg.energy is not None
    assert pp.energy.reps == 2 and pp.energy.tokens == 32 and tg.energy.tokens == 8
    assert pp.energy.source == "CPU time"
    assert pp.energy.window_s >= statistics.fmean(pp.samples_s) * 0.9
    assert tg.energy.window_s >= statistics.fmean(tg.samples_s) * 0.9
    assert pp.energy.energy_j is not None and pp.energy.energy_j > 0
    assert tg.energy.energy_j is not None and tg.energy.energy_j > 0
