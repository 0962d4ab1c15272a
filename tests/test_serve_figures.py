"""The serving figures, one definition each (runners/serving/figures.py), on synthetic time
stamps; the wait before admission as its own figure; a broken stream counted failed by
`bench interference` as `bench serve` counts it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmrun.cli.app import app
from llmrun.runners.library import max_sequences
from llmrun.runners.llamacpp import LlamaCppRunner
from llmrun.runners.serving import figures as f
from llmrun.runners.serving.load import ServingLevel

from .stub_server import WORDS, RawJSON, bench_against_stub, stub_server

# ---- each definition on synthetic time stamps --------------------------------------------


def test_each_figure_starts_at_admission_and_the_wait_before_is_queue() -> None:
    # arrives at 1.0, admitted at 3.0 (a slot freed), tokens at 3.5, 3.7, 4.0
    r = f.RequestResult.timed(
        input_tokens=10, arrival_s=1.0, admitted_s=3.0, token_times_s=[3.5, 3.7, 4.0]
    )
    assert r.ok and r.output_tokens == 3
    assert r.queue_s == pytest.approx(2.0)
    assert r.ttft_s == pytest.approx(0.5)  # not 2.5: the wait for a slot is not TTFT
    assert r.latency_s == pytest.approx(1.0)  # E2EL from admission
    assert r.itl_s == pytest.approx([0.2, 0.3])
    assert r.tpot_s == pytest.approx((1.0 - 0.5) / 2)  # (E2EL - TTFT) / (output - 1)


def test_the_definitions_alone() -> None:
    assert f.ttft_s(2.0, [2.25, 3.0]) == pytest.approx(0.25)
    assert f.ttft_s(2.0, []) is None
    assert f.e2el_s(2.0, [2.25, 3.0]) == pytest.approx(1.0)
    assert f.itl_s([1.0, 1.5, 1.75]) == pytest.approx([0.5, 0.25])
    assert f.tpot_s(1.0, 0.25, 4) == pytest.approx(0.25)
    assert f.tpot_s(1.0, 0.25, 1) is None  # one token: no time per output token
    assert f.queue_s(1.0, 0.5) == 0.0 and f.queue_s(1.0, None) is None


def test_one_definition_of_a_failed_request() -> None:
    assert f.failure(error="stream cut", cancelled=False, got_token=True) == "stream cut"
    assert f.failure(error=None, cancelled=True, got_token=True) == f.CANCELLED
    assert f.failure(error=None, cancelled=False, got_token=False) == f.NO_OUTPUT
    assert f.failure(error=None, cancelled=False, got_token=True) is None
    cut = f.RequestResult(8, error=f.CANCELLED)
    assert not cut.ok and not cut.failed  # Ctrl-C: neither done nor failed


def test_goodput_counts_the_requests_meeting_every_slo_per_second() -> None:
    fast = f.RequestResult.timed(
        input_tokens=4, arrival_s=0, admitted_s=0, token_times_s=[0.1, 0.2]
    )
    slow = f.RequestResult.timed(
        input_tokens=4, arrival_s=0, admitted_s=0, token_times_s=[0.9, 1.0]
    )
    broken = f.RequestResult(4, error="boom")
    m = f.metrics([fast, slow, broken], 2.0, percentiles=[50], slo={"ttft": 0.5})
    assert (m.completed, m.failed, m.errors) == (2, 1, ("boom",))
    assert m.goodput == pytest.approx(0.5)  # one request met ttft <= 500 ms in 2 s
    assert f.metrics([fast], 2.0, percentiles=[50], slo={}).goodput is None
    one = f.RequestResult.timed(input_tokens=4, arrival_s=0, admitted_s=0, token_times_s=[0.1])
    assert f.meets(one, {"tpot": 0.001})  # one token: a TPOT of 0, as vLLM's goodput has it


def test_queue_is_reported_where_measured_only() -> None:
    waited = f.RequestResult.timed(input_tokens=4, arrival_s=0, admitted_s=2, token_times_s=[2.5])
    local = f.metrics([waited], 3.0, percentiles=[99], slo={})
    assert local.queue is not None and local.queue.mean_ms == pytest.approx(2000)
    assert local.record()["p99_queue_ms"] == pytest.approx(2000)
    assert local.record()["mean_ttft_ms"] == pytest.approx(500)
    sent = f.RequestResult(4, 1, 0.5, 0.5)  # a server's client: sent as admitted
    remote = f.metrics([sent], 1.0, percentiles=[99], slo={})
    assert remote.queue is None and "mean_queue_ms" not in remote.record()


def test_the_two_meanings_of_concurrency_are_named_apart() -> None:
    m = f.metrics([f.RequestResult(4, 1, 0.5, 0.5)], 1.0, percentiles=[50], slo={})
    local = ServingLevel("local", "m", 2, math.inf, 1, 4, 1, m, policy="chunked:64")
    remote = ServingLevel("http://x", "m", 2, math.inf, 1, 4, 1, m)
    assert local.level_text == "slots=2" and local.record()["n_slots"] == 2
    assert remote.level_text == "max-conc=2" and remote.record()["max_concurrency"] == 2
    assert "max_concurrency" not in local.record() and "n_slots" not in remote.record()
    assert local.record()["concurrency"] == remote.record()["concurrency"] == 2


# ---- the options ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message", "code"),
    [
        (["--max-concurrency", "2"], "--max-concurrency: the client's limit against a server", 2),
        (["--slots", "0"], "--slots: 0 is out of range 1..", 2),
        # llama.cpp's LLAMA_MAX_SEQ, before the model loads (it loaded, then the context failed)
        (["--slots", "100000"], f"--slots: 100000 is out of range 1..{max_sequences()}", 2),
        (["--slots", "2", "--concurrency", "2"], "--concurrency and --slots say the same", 2),
    ],
)
def test_each_target_takes_its_own_name_of_concurrency(
    cli: CliRunner, home: Path, args: list[str], message: str, code: int
) -> None:
    result = cli.invoke(app, ["bench", "serve", *args])
    assert result.exit_code == code, result.output  # options that clash: a usage error
    assert message in result.stderr


def test_slots_against_a_server_is_refused(cli: CliRunner, home: Path) -> None:
    result = cli.invoke(app, ["bench", "serve", "--endpoint", "http://127.0.0.1:9", "--slots", "2"])
    assert result.exit_code == 2
    assert "--slots: the local engine's sequences" in result.stderr


def test_max_concurrency_and_its_alias_measure_a_server(cli: CliRunner, home: Path) -> None:
    records = []
    for option in ("--max-concurrency", "--concurrency"):
        result = bench_against_stub(
            cli, option, "2", "--num-prompts", "2", "--warmup", "0", "--no-history"
        )
        assert result.exit_code == 0, result.output
        records.append(json.loads(result.stdout)[0])
    for rec in records:
        assert rec["max_concurrency"] == rec["concurrency"] == 2 and rec["completed"] == 2


def test_the_wait_for_the_clients_limit_is_queue_not_ttft(cli: CliRunner, home: Path) -> None:
    """Two requests at once, one in flight: the second waits for the first (its queue, vLLM's
    client_queue_time), and its TTFT starts when it is sent."""
    result = bench_against_stub(
        cli,
        "--max-concurrency",
        "1",
        "--num-prompts",
        "2",
        "--warmup",
        "0",
        "--no-history",
        "--percentiles",
        "100",
    )
    assert result.exit_code == 0, result.output
    rec = json.loads(result.stdout)[0]
    assert rec["p100_queue_ms"] >= 0.8 * rec["median_e2el_ms"]  # the first one's whole E2EL
    assert rec["p100_ttft_ms"] < rec["p100_queue_ms"]


# ---- bench interference: a broken stream is a failed request ------------------------------------


def test_interference_counts_a_broken_stream_failed_as_bench_serve_does(
    cli: CliRunner, home: Path
) -> None:
    result = bench_against_stub(
        cli,
        "--rate",
        "1",
        "--prompt-len",
        "8",
        "--input-len",
        "8",
        command="interference",
        model="cut",
    )
    assert result.exit_code == 1, result.output
    rec = json.loads(result.stdout)[0]
    assert rec["failed"] == 2 and rec["itl_p50_ratio"] is None
    assert rec["itl_p50_alone_ms"] is None and rec["ttft_loaded_ms"] is None
    errors = [line for line in result.stderr.splitlines() if line.startswith("llmrun: error:")]
    assert len(errors) == 1, result.stderr  # one line, not one per failed request
    assert "the steady client's request alone and under load failed: " in errors[0], errors
    assert "Traceback" not in result.stderr


# ---- this machine's engine: TTFT from the slot, the wait for it as queue ----------------------


def test_local_ttft_starts_when_a_slot_is_granted(runner: LlamaCppRunner) -> None:
    """Three prompts at once on one slot: the later ones wait for it (queue), and their TTFT
    starts when they get it (before: TTFT held the whole wait, 7-18 s at c=1)."""
    from llmrun.runners.serving.batching import BatchedEngine
    from llmrun.runners.serving.local import request_result, serve
    from llmrun.runners.serving.policy import Policy

    prompts = [(tuple(range(100 + i, 164 + i)), 3) for i in range(3)]
    with BatchedEngine(runner, n_seq=1, n_ctx_per_seq=96) as engine:
        results, _ = serve(engine, Policy("chunked", 512), prompts, request_rate=math.inf, seed=1)
    measured = [request_result(r) for r in results]
    assert all(r.ok for r in measured)
    for before, raw, r in zip(results, results[1:], measured[1:], strict=False):
        assert raw.arrival_s == 0.0 and raw.admitted_s is not None
        assert raw.admitted_s >= before.times[-1]  # the slot's turn came after the last token
        assert r.queue_s == pytest.approx(raw.admitted_s)
        assert r.ttft_s == pytest.approx(raw.times[0] - raw.admitted_s)
        assert r.latency_s == pytest.approx(raw.times[-1] - raw.admitted_s)
        assert r.ttft_s is not None and r.tpot_s == pytest.approx((r.latency_s - r.ttft_s) / 2)
    assert measured[0].queue_s is not None and measured[0].queue_s < measured[1].queue_s  # type: ignore[operator]


# ---- the estimate of the time left ------------------------------------------------------------


def test_the_estimate_paces_tokens_from_the_first_one() -> None:
    """bench interference's stage: 148 tokens, the first after a 1.1 s prefill, then one every
    50 ms. Paced from the stage's start, the first tokens said 2:43 left of a 14 s run."""
    from llmrun.runners.progress import Tally

    tally = Tally(19, 148)
    t0 = tally.started_s
    tally.add(work=1, now_s=t0 + 1.1)
    assert tally.eta_s(t0 + 1.1) is None  # one token: no pace yet
    for i in range(1, 4):
        tally.add(work=1, now_s=t0 + 1.1 + 0.05 * i)
    eta = tally.eta_s(t0 + 1.25)
    assert eta is not None and eta < 10  # 144 tokens at 50 ms: about 7 s
    assert 1.25 * (148 - 4) / 4 > 40  # what the pace from the start said


def test_local_queue_is_the_wait_for_a_sequence_not_for_the_step_in_progress(
    runner: LlamaCppRunner,
) -> None:
    """A short prompt arrives while a long one's prefill step runs, a sequence free all along:
    its queue is 0 and the wait for the step is in its TTFT, as a server's client sees it."""
    from llmrun.runners.serving.batching import Arrival, BatchedEngine
    from llmrun.runners.serving.local import request_result
    from llmrun.runners.serving.policy import Policy

    long = Arrival(0.0, tuple(range(1000, 1400)), 1)
    short = Arrival(0.05, tuple(range(200, 208)), 1)
    with BatchedEngine(runner, n_seq=2, n_ctx_per_seq=420) as engine:
        (_, second), steps = engine.run([long, short], Policy("prefill-first", 512))
    assert steps[0].n_prefill == 400 and steps[0].duration_s > 0.05  # it arrived mid-step
    assert second.started_s is not None and second.started_s >= steps[0].duration_s
    r = request_result(second)
    assert r.queue_s == 0.0
    assert r.ttft_s is not None and r.ttft_s >= second.started_s - short.at_s


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf", "1e308", "86400001"])
def test_an_slo_from_nothing_to_past_a_day_is_refused(value: str) -> None:
    """`--slo ttft:1e308` was taken: every request met it, and the record held 1e305 s."""
    from llmrun.runners.errors import OptionError
    from llmrun.runners.serving.options import parse_slo

    with pytest.raises(OptionError, match="from 0 to a day"):
        parse_slo(f"ttft:{value}")
    assert parse_slo("ttft:86400000,tpot:0.5") == {"ttft": 86_400.0, "tpot": 0.0005}


def test_a_servers_figures_that_cannot_be_true_are_named_in_the_record(
    cli: CliRunner, home: Path
) -> None:
    """A server sending a usage count of 5,000 digits and a prefill longer than the client's
    TTFT: bench serve dropped them and counted chunks without a word (`run` names them). The
    level's record names them in `server_implausible`, as run's stats do."""
    huge = RawJSON("9" * 5000)
    figures = {
        "usage": {"prompt_tokens": huge, "completion_tokens": huge},
        "timings": {"prompt_n": 5, "prompt_ms": 1e9, "predicted_n": 2, "predicted_ms": huge},
    }
    with stub_server(figures=figures) as url:
        args = ["--endpoint", url, "-o", "json", "--num-prompts", "2", "--warmup", "0"]
        result = cli.invoke(app, ["bench", "serve", *args, "--no-history"])
    assert result.exit_code == 0, result.output
    rec = json.loads(result.stdout)[0]
    assert rec["completed"] == 2 and rec["total_output_tokens"] == 2 * len(WORDS)  # chunks
    notes = " ".join(rec["server_implausible"])
    assert "completion_tokens 999999999999... (5,000 digits) is no count" in notes, notes
    assert "prompt_ms" in notes, notes
    warnings = [ln for ln in result.stderr.splitlines() if "cannot be true" in ln]
    assert len(warnings) == len(json.loads(result.stdout))  # one a level
    for warning in warnings:
        assert warning.startswith("llmrun: warning: max-conc=")
        assert "left out (output counted in stream chunks): " in warning and "prompt_ms" in warning


def test_a_level_without_such_figures_has_no_implausible_field(cli: CliRunner, home: Path) -> None:
    result = bench_against_stub(cli, "--num-prompts", "2", "--warmup", "0", "--no-history")
    assert result.exit_code == 0, result.output
    assert "server_implausible" not in json.loads(result.stdout)[0]
    assert "cannot be true" not in result.stderr
