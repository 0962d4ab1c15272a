"""The statistics of every comparison, on synthetic samples with known answers."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from llmrun.runners.base import Event, Finished, Request
from llmrun.runners.bench import measure
from llmrun.runners.bench.results import Result
from llmrun.runners.bench.run import RecordStream
from llmrun.runners.bench.sweep import Combo, Shape
from llmrun.runners.config import EngineConfig
from llmrun.runners.errors import BadRequestError
from llmrun.runners.significance import (
    LogSample,
    compare,
    needed_repetitions,
    record_fields,
    t_quantile,
)
from llmrun.runners.system import SystemInfo
from tests.fake import FakeBenchRunner


def noisy(rate: float, n: int, cv: float, seed: int) -> list[float]:
    """n repetitions around `rate` with multiplicative noise of `cv`, from a fixed seed."""
    rng = random.Random(seed)
    return [rate * math.exp(rng.gauss(0.0, cv)) for _ in range(n)]


def test_t_quantiles_match_the_tables() -> None:
    for df, want in ((1, 12.7062), (2, 4.3027), (3, 3.1824), (10, 2.2281), (30, 2.0423)):
        assert t_quantile(0.975, df) == pytest.approx(want, abs=1e-4)
    assert t_quantile(0.8, 4) == pytest.approx(0.9410, abs=1e-4)
    assert t_quantile(0.975, 2.5) == pytest.approx(3.5747, abs=1e-4)  # a real df (Welch)
    assert t_quantile(0.975, math.inf) == pytest.approx(1.95996, abs=1e-5)


def test_identical_samples_show_no_difference_and_how_many_would_resolve_2_pct() -> None:
    a = noisy(100.0, 5, 0.01, 1)
    found = compare(a, list(a))
    assert found.ratio == pytest.approx(1.0) and found.low < 1.0 < found.high  # type: ignore[operator]
    assert found.verdict == "no difference"
    assert found.needed is not None and found.needed > 2
    assert (
        found.text
        == f"no difference detectable: about {found.needed} repetitions would resolve 2 %"
    )


def test_a_known_10_pct_shift_with_small_noise_is_found_and_bracketed() -> None:
    a, b = noisy(100.0, 5, 0.01, 2), noisy(110.0, 5, 0.01, 3)
    found = compare(a, b)
    assert found.verdict == "faster" and found.text == "faster"
    assert found.low < 1.10 < found.high  # type: ignore[operator]
    assert found.ratio == pytest.approx(1.10, rel=0.02)
    back = compare(b, a)
    assert back.verdict == "slower" and back.ratio == pytest.approx(1 / found.ratio)  # type: ignore[operator]
    assert found.interval.startswith("x1.09") and "-" in found.interval


def test_one_repetition_gives_no_interval_and_says_so() -> None:
    found = compare([100.0], noisy(100.0, 5, 0.01, 4))
    assert found.low is None and found.high is None and found.verdict == "no interval"
    assert found.text.startswith("no interval: one repetition on a side")
    assert found.ratio is not None and found.needed is not None  # the other side's spread
    assert compare([], [100.0]).text == "no interval: a side has no repetition"
    assert compare([0.0, -1.0, math.inf], [100.0, 101.0]).n_a == 0  # measured nothing


def test_two_repetitions_give_a_wide_but_honest_interval() -> None:
    found = compare([100.0, 101.0], [110.0, 111.0])
    assert found.verdict == "faster" and found.df is not None and 1 <= found.df <= 2
    close = compare([100.0, 104.0], [101.0, 105.0])  # 1 % apart, 4 % scatter, one df
    assert close.verdict == "no difference"
    assert close.high - close.low > 0.2  # type: ignore[operator]


def test_zero_spread_on_both_sides() -> None:
    same = compare([100.0, 100.0, 100.0], [100.0, 100.0, 100.0])
    assert (same.ratio, same.low, same.high) == (1.0, 1.0, 1.0)
    assert same.verdict == "no difference" and same.needed == 2
    assert same.text == "no difference detectable: 3 repetitions already resolve 2 %"
    apart = compare([100.0, 100.0], [101.0, 101.0])  # what the repetitions show
    assert apart.verdict == "faster" and apart.low == apart.high == pytest.approx(1.01)


def test_one_outlier_widens_the_interval_and_invents_nothing() -> None:
    a = noisy(100.0, 6, 0.01, 5)
    b = noisy(100.0, 6, 0.01, 6)
    clean = compare(a, b)
    for outlier in (30.0, 3000.0):  # a repetition a busy core slowed, or a timer glitch
        found = compare(a, [*b[:-1], outlier])
        assert found.verdict == "no difference"
        assert found.high - found.low > clean.high - clean.low  # type: ignore[operator]


def test_huge_noise_hides_a_real_10_pct_shift_and_asks_for_many_repetitions() -> None:
    found = compare(noisy(100.0, 5, 0.5, 11), noisy(110.0, 5, 0.5, 12))
    assert found.verdict == "no difference" and found.low < 0.6 and found.high > 2  # type: ignore[operator]
    assert found.needed is not None and found.needed > 500
    assert "repetitions would resolve 2 %" in found.text


def test_the_interval_covers_the_true_ratio_about_95_times_in_100() -> None:
    covered = 0
    for seed in range(300):
        f = compare(noisy(100.0, 5, 0.03, 2 * seed), noisy(105.0, 4, 0.06, 2 * seed + 1))
        covered += f.low <= 1.05 <= f.high  # type: ignore[operator]
    assert 0.91 <= covered / 300 <= 0.99


def test_needed_repetitions_follow_the_sample_size_formula() -> None:
    # variance 1e-4 of ln(rate) (1 % scatter): 2 s² (t.975 + t.80)² / ln(1.02)² at 2n-2 df
    assert needed_repetitions(1e-4) == 6
    assert needed_repetitions(0.0) == 2
    assert needed_repetitions(math.nan) is None
    n = needed_repetitions(4e-4)
    assert n is not None
    df = 2 * n - 2
    t = t_quantile(0.975, df) + t_quantile(0.8, df)
    assert 2 * 4e-4 * t * t / math.log(1.02) ** 2 <= n


def test_a_busy_machine_marks_the_verdict_and_never_hides_it() -> None:
    found = compare(noisy(100.0, 5, 0.01, 9), noisy(80.0, 5, 0.01, 10), busy=True)
    assert found.verdict == "slower"
    assert found.text == "slower (busy machine: may be noise)"
    fields = record_fields(found, "relative")
    assert fields["relative_verdict"] == "slower" and fields["relative_busy"] is True
    assert fields["relative_low"] < fields["relative_ratio"] < fields["relative_high"]
    assert fields["relative_reps"] == [5, 5]
    assert set(record_fields(None, "x").values()) == {None}


def test_half_width_of_one_sides_mean() -> None:
    assert LogSample.of([100.0]).halfwidth() is None
    assert LogSample.of([100.0, 100.0]).halfwidth() == 0.0
    half = LogSample.of([99.0, 101.0]).halfwidth()
    assert half == pytest.approx(math.expm1(12.7062 * 0.01), rel=1e-3)


# ---- bench --until-ci --------------------------------------------------------------------


def test_until_ci_parses_a_share_and_a_budget() -> None:
    assert measure.UntilCi.parse("2%") == measure.UntilCi(2.0, 300.0)
    assert measure.UntilCi.parse(" 0.5 , 60s") == measure.UntilCi(0.5, 60.0)
    for bad in ("", "two", "0%", "80%", "2%,0s", "2%,-1"):
        with pytest.raises(BadRequestError, match="--until-ci"):
            measure.UntilCi.parse(bad)


def test_until_ci_stops_when_narrow_else_at_the_budget() -> None:
    until = measure.UntilCi(2.0, 10.0)
    assert until.stop([100.0, 100.5, 99.8], 1.0) == "reached"
    assert until.stop([100.0], 1.0) is None  # no interval yet
    assert until.stop([100.0, 130.0], 1.0) is None
    assert until.stop([100.0, 130.0], 10.0) == "time budget"
    assert measure.UntilCi(0.01, 10.0).stop([100.0, 130.0] * 500, 1.0) == "repetition cap"


class NoisyBenchRunner(FakeBenchRunner):
    """The fake bench engine, its prefill times scattered by 5 % from a fixed seed."""

    def __init__(self) -> None:
        super().__init__()
        self.rng = random.Random(1)

    def stream(self, request: Request, *, cancel: threading.Event | None = None) -> Iterator[Event]:
        for event in super().stream(request, cancel=cancel):
            if isinstance(event, Finished):
                scatter = math.exp(self.rng.gauss(0.0, 0.05))
                stats = dataclasses.replace(event.stats, prefill_s=event.stats.prefill_s * scatter)
                event = dataclasses.replace(event, stats=stats)
            yield event


def _bench(until: measure.UntilCi | None, reps: int = 2) -> tuple[list[Result], int]:
    events = list(
        measure.run_bench(
            NoisyBenchRunner(),  # type: ignore[arg-type]
            measure.BenchPlan(
                measure.every_shape([Combo(1, 64, 64, None, "off")], [Shape(16, 0)]),
                reps=reps,
                until_ci=until,
            ),
            base=EngineConfig(),
        )
    )
    totals = {e.total for e in events if isinstance(e, measure.Progress)}
    return [e for e in events if isinstance(e, Result)], max(totals)


def test_until_ci_repeats_past_r_and_records_what_it_took() -> None:
    [plain], total = _bench(None)
    assert len(plain.samples_s) == 2 and total == 3
    assert "until_ci_pct" not in plain.record(_system())
    # 5 % scatter: about (2 x 5 / 2)^2 = 25 repetitions bring the interval under ±2 %
    [result], total = _bench(measure.UntilCi(2.0, 300.0))
    record = result.record(_system())
    assert 10 < len(result.samples_s) < 60 and total == len(result.samples_s) + 1
    assert record["repetitions"] == len(result.samples_s) == len(record["samples_ts"])
    assert record["until_ci_pct"] == 2.0 and record["until_ci_stop"] == "reached"
    assert record["ci95_pct"] < 2.0
    shorter = LogSample.of(record["samples_ts"][:-1]).halfwidth()
    assert shorter is not None and shorter * 100 >= 2.0  # it stopped at the first that made it
    # a target the scatter cannot meet soon: the budget ends it
    [cut], _ = _bench(measure.UntilCi(0.01, 0.05))
    assert len(cut.samples_s) >= 2 and cut.record(_system())["until_ci_stop"] == "time budget"
    from llmrun.cli.bench.output import OutputFormat, format_records

    md = format_records([cut.record(_system()), record], OutputFormat.md).splitlines()
    assert "|  reps |  95 % CI |" in md[0]
    assert "(time budget) |" in md[2] and f"| {record['repetitions']:>5} |" in md[3]
    # a wide target is met at -r's repetitions: -r is the least
    [easy], _ = _bench(measure.UntilCi(50.0, 30.0), reps=3)
    assert len(easy.samples_s) == 3 and easy.record(_system())["until_ci_stop"] == "reached"


def _system() -> SystemInfo:
    return SystemInfo(
        cpu="test",
        physical_cores=2,
        logical_cpus=2,
        ram_bytes=None,
        build="",
        features="",
        gpu="",
        mem_bw_bytes_s=None,
    )


# ---- the relative column of several models --------------------------------------------------


def test_a_later_models_rows_carry_the_ratios_interval_and_verdict() -> None:
    from llmrun.cli.bench.output import OutputFormat, format_records, results_table
    from llmrun.runners.bench.run import RecordStream

    [first], _ = _bench(None, reps=5)
    slower = dataclasses.replace(
        first,
        model=dataclasses.replace(first.model, name="other"),
        samples_s=tuple(s * 1.25 for s in first.samples_s),  # 0.8 of the rate, same scatter
    )
    stream = RecordStream(_system(), several_models=True)
    [a] = stream.add(first)
    [b] = stream.add(slower)
    assert a.record["relative_ts"] == 1.0 and a.record["relative_verdict"] is None
    rb = b.record
    assert rb["relative_ts"] == pytest.approx(0.8, abs=1e-3)
    assert rb["relative_verdict"] == "slower" and rb["relative_reps"] == [5, 5]
    assert rb["relative_low"] < 0.8 < rb["relative_high"]
    md = format_records([a.record, rb], OutputFormat.md)
    head, _, first_row, second_row = md.splitlines()[:4]
    assert "vs first, 95 % CI" in head and "verdict" in head
    assert "| slower " in second_row and "| -  " in first_row
    console = Console(file=io.StringIO(), width=200, color_system=None)
    console.print(results_table([a.row, b.row]))
    shown = console.file.getvalue()  # type: ignore[attr-defined]
    assert f"x0.80 ({rb['relative_low']:.3f}-{rb['relative_high']:.3f})" in shown
    assert "slower" in shown


def _setting(result: Result, field: str, value: Any) -> Result:
    """The result as if it ran with this one setting changed, where its record reads it."""
    st = result.settings
    if field in ("n_ctx", "n_threads_batch"):
        return dataclasses.replace(result, settings=dataclasses.replace(st, **{field: value}))
    if field in ("draft", "fit_target", "fit_min_ctx"):
        return dataclasses.replace(
            result, combo=dataclasses.replace(result.combo, **{field: value})
        )
    return dataclasses.replace(result, settings=dataclasses.replace(st, params={field: value}))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("no_kv_offload", True),
        ("split_mode", "row"),
        ("main_gpu", 1),
        ("tensor_split", "3/1"),
        ("tensor_buft_overrides", "exps=CPU"),
        ("n_cpu_moe", 4),
        ("devices", "CUDA1"),
        ("n_ctx", 8192),
        ("n_threads_batch", 7),
        ("fit_target", 512),
    ],
)
def test_a_later_models_row_is_compared_with_the_first_models_same_settings(
    field: str, value: object
) -> None:
    """Two models over two values of one setting (`-m a -m b -nkvo 0,1`): each row of the
    second model against the first model's row of the same setting, never another's (the
    pairing key left out -nkvo, -sm, -mg, -ts, -ot, -ncmoe, -dev, -c: b's -nkvo 1 row was
    divided by a's -nkvo 0 row)."""
    [plain], _ = _bench(None, reps=2)
    if field == "fit_target":  # a combination's own: where the record reads it
        plain = dataclasses.replace(plain, combo=dataclasses.replace(plain.combo, fit_target=0))
    a0, a1 = plain, _setting(plain, field, value)
    a1 = dataclasses.replace(a1, samples_s=tuple(s * 2 for s in plain.samples_s))  # half a0's
    other = dataclasses.replace(plain.model, name="other")
    b0, b1 = (
        dataclasses.replace(r, model=other, samples_s=tuple(s * 1.25 for s in r.samples_s))
        for r in (a0, a1)
    )  # 0.8 of a's rate at each setting
    assert a1.record(_system())[field] == value != a0.record(_system())[field]
    stream = RecordStream(_system(), several_models=True)
    rows = [rec for r in (a0, a1, b0, b1) for rec in stream.add(r)]
    assert [r.record["relative_ts"] for r in rows] == pytest.approx([1.0, 1.0, 0.8, 0.8], abs=1e-3)


def test_bench_until_ci_end_to_end_and_a_bad_value_in_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from typer.testing import CliRunner

    from llmrun.cli.app import app

    from .test_trust_bench import _fake_models

    monkeypatch.setenv("LLMRUN_HOME", str(tmp_path))
    _fake_models(monkeypatch)
    base = ["bench", "-r", "2", "-p", "8", "-n", "0", "--no-history"]
    done = CliRunner().invoke(app, [*base, "--until-ci", "50%,30", "-o", "json"])
    assert done.exit_code == 0, done.stderr
    [row] = json.loads(done.stdout)
    assert (row["until_ci_pct"], row["repetitions"], row["until_ci_stop"]) == (50.0, 2, "reached")
    bad = CliRunner().invoke(app, [*base, "--until-ci", "two"])
    assert bad.exit_code == 2
    assert bad.stderr.strip().splitlines() == [
        "llmrun: error: --until-ci: give a share such as 2% or 2%,60s (with a time budget a"
        " test), not 'two'"
    ]


def test_rates_far_apart_give_an_interval_not_an_overflow() -> None:
    """A stored 1e-300 tok/s against 1 tok/s: math.exp of the log ratio overflowed, and
    `history` ended in an internal error (OverflowError: math range error)."""
    found = compare([1e-300, 2e-300], [1e10, 2e10])
    assert found.ratio == found.high == math.inf and found.verdict == "faster"
    assert compare([1.0, 90.0], [1e-300, 2e-300]).verdict == "slower"
    assert LogSample.of([1e-300, 1e300]).halfwidth() == math.inf
