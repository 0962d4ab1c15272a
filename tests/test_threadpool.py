"""llama-bench's threadpool flags: -C/--cpu-mask, --cpu-strict, --poll (and --prio) make a ggml
threadpool for the context; its mask pins the compute threads, and freeing it gives the process
back its CPUs."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmrun.cli import engine
from llmrun.cli.app import app
from llmrun.runners import threadpool as tp
from llmrun.runners.base import Request, SamplingParams, generate
from llmrun.runners.config import EngineConfig
from llmrun.runners.errors import BadRequestError
from llmrun.runners.llamacpp import LlamaCppRunner
from llmrun.runners.system import parse_cpu_list

from .conftest import HANG_S, which_llmrun
from .fake import FakeRunner

CPUS = sorted(tp.available_cpus())
FIRST = hex(1 << CPUS[0])  # a mask naming one CPU this process may use
BEYOND = hex(1 << (max(CPUS) + 1)) if max(CPUS) + 1 < tp.MAX_N_THREADS else None


def _allowed() -> dict[int, frozenset[int]]:
    """Each thread of this process and the CPUs it may run on, as the kernel reports them."""
    found = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            status = Path(f"/proc/self/task/{tid}/status").read_text()
        except OSError:  # the thread ended
            continue
        line = next(ln for ln in status.splitlines() if ln.startswith("Cpus_allowed_list:"))
        found[int(tid)] = frozenset(parse_cpu_list(line.partition(":")[2]))
    return found


@pytest.mark.parametrize(
    ("mask", "cpus"),
    [
        ("0x0", set()),
        ("0", set()),
        ("0x1", {0}),
        ("0x3", {0, 1}),
        ("ff", set(range(8))),
        ("0xA", {1, 3}),
        ("0x8000000000000000", {63}),
        ("0x" + "f" * 128, set(range(512))),
    ],
)
def test_masks_read_as_llama_cpp_reads_them(mask: str, cpus: set[int]) -> None:
    assert tp.parse_cpu_mask(mask) == cpus


@pytest.mark.parametrize(
    ("mask", "says"),
    [
        ("0x", "give a hex mask"),
        ("", "give a hex mask"),
        ("0xg1", "'g' is not a hex digit"),
        ("0X1", "'X' is not a hex digit"),
        ("0-3", "'-' is not a hex digit"),
        ("1" * 129, "at most 128 hex digits"),
    ],
)
def test_what_is_not_a_mask_is_refused(mask: str, says: str) -> None:
    with pytest.raises(BadRequestError, match=says):
        tp.ThreadpoolSettings(cpu_mask=mask)


def test_poll_and_priority_are_checked() -> None:
    for poll in (0, 100):
        assert tp.ThreadpoolSettings(poll=poll).poll == poll
    with pytest.raises(BadRequestError, match=r"0\.\.100"):
        tp.ThreadpoolSettings(poll=101)
    with pytest.raises(BadRequestError, match=r"0\.\.100"):
        tp.ThreadpoolSettings(poll=-1)
    with pytest.raises(BadRequestError, match="give -1, 0, 1, 2 or 3"):
        tp.ThreadpoolSettings(prio=4)
    assert tp.ThreadpoolSettings().is_default and tp.ThreadpoolSettings(poll=50).is_default
    assert not tp.ThreadpoolSettings(poll=0).is_default
    assert not tp.ThreadpoolSettings(prio=-1).is_default


@pytest.mark.usefixtures("every_core")  # strict placement needs two CPUs
def test_placement_deals_cpus_as_ggml_does() -> None:
    both = tp.ThreadpoolSettings(cpu_mask=hex(0b11 << CPUS[0]))
    usable = frozenset(CPUS)
    assert both.placement(3) == [frozenset({CPUS[0], CPUS[0] + 1}) & usable] * 3
    strict = tp.ThreadpoolSettings(cpu_mask="0x" + "f" * 128, strict=True)
    if len(CPUS) >= 2 and CPUS[:2] == [0, 1]:
        assert strict.placement(2) == [frozenset({0}), frozenset({1})]
    assert tp.ThreadpoolSettings().placement(2) == [usable, usable]


@pytest.mark.skipif(BEYOND is None, reason="this machine has every CPU a mask can name")
def test_a_mask_of_no_cpu_here_is_refused() -> None:
    assert BEYOND is not None
    with pytest.raises(BadRequestError, match="no CPU it names"):
        tp.ThreadpoolSettings(cpu_mask=BEYOND).placement(1)
    # strict: a thread dealt a CPU this process may not use
    strict = tp.ThreadpoolSettings(cpu_mask=hex(int(FIRST, 16) | int(BEYOND, 16)), strict=True)
    assert strict.placement(1) == [frozenset({CPUS[0]})]
    with pytest.raises(BadRequestError, match="may not run on"):
        strict.placement(2)


def test_pools_are_made_and_freed_once_each() -> None:
    """The struct's layout is checked against the loaded library, and 20 pools come and go."""
    settings = tp.ThreadpoolSettings(cpu_mask=FIRST, strict=True, poll=0)
    for i in range(20):
        pool = tp.Threadpool(settings, 1 + i % 3)
        assert pool.ptr and pool.applied == {"cpu_mask": FIRST, "cpu_strict": True, "poll": 0}
        pool.close()
        pool.close()  # a second close frees nothing
        assert pool.ptr is None
    assert tp._live_pools == 0


@pytest.mark.usefixtures("every_core")  # llama.cpp on two threads
def test_the_mask_pins_the_compute_threads_and_freeing_unpins(model_path: str) -> None:
    before = _allowed()
    me = threading.get_native_id()
    settings = tp.ThreadpoolSettings(cpu_mask=FIRST)
    runner = LlamaCppRunner(
        model_path,
        EngineConfig(n_ctx=256, n_threads=2, flash_attn="off", warmup=False, threadpool=settings),
    )
    try:
        loaded = runner.load()
        assert {k: loaded.settings.params[k] for k in ("cpu_mask", "cpu_strict", "poll")} == {
            "cpu_mask": FIRST,
            "cpu_strict": False,
            "poll": 50,
        }
        # one graph: two threads on one CPU wait on each other at every barrier
        done = generate(runner, Request(prompt="Hi", sampling=SamplingParams(max_tokens=1)))
        assert done.stats.output_tokens == 1
        during = _allowed()
        pinned = [tid for tid, cpus in during.items() if cpus == {CPUS[0]}]
        assert me in pinned  # llama.cpp's OpenMP build computes on the calling thread too
        assert len(pinned) >= 2  # and on a worker: two threads, both on the mask's CPU
    finally:
        runner.close()
    assert tp._live_pools == 0
    after = _allowed()
    assert all(after[tid] == before.get(tid, frozenset(CPUS)) for tid in after)
    assert after[me] == frozenset(CPUS)


@pytest.mark.skipif(len(CPUS) < 2, reason="strict placement on two CPUs needs two")
@pytest.mark.usefixtures("every_core")  # llama.cpp on two threads
def test_strict_placement_gives_each_thread_one_cpu(model_path: str) -> None:
    """Also --prio -1: the compute threads run as SCHED_BATCH, and are given back after."""
    mask = hex((1 << CPUS[0]) | (1 << CPUS[1]))
    settings = tp.ThreadpoolSettings(cpu_mask=mask, strict=True, poll=0, prio=-1)
    assert os.sched_getscheduler(0) == os.SCHED_OTHER
    runner = LlamaCppRunner(
        model_path,
        EngineConfig(n_ctx=256, n_threads=2, flash_attn="off", warmup=False, threadpool=settings),
    )
    try:
        generate(runner, Request(prompt="Hello", sampling=SamplingParams(max_tokens=2)))
        during = _allowed()
        assert during[threading.get_native_id()] == {CPUS[0]}  # thread 0: the first CPU
        assert frozenset({CPUS[1]}) in during.values()  # thread 1: the next
        assert os.sched_getscheduler(0) == os.SCHED_BATCH  # ggml's GGML_SCHED_PRIO_LOW
    finally:
        runner.close()
    assert set(_allowed()[threading.get_native_id()]) == set(CPUS)
    assert os.sched_getscheduler(0) == os.SCHED_OTHER


@pytest.mark.usefixtures("every_core")  # llama.cpp on two threads
def test_contexts_with_pools_come_and_go(model_path: str) -> None:
    """Context after context with a pool (the sweep's reconfigure, the batched engine's
    make_context), each pool freed once after its context; nothing crashes or stays pinned."""
    base = EngineConfig(n_ctx=128, n_threads=2, n_threads_batch=1, flash_attn="off", warmup=False)
    runner = LlamaCppRunner(model_path, base)
    try:
        # the masks, polls and strictness that 20 contexts tried (i mod 4 and i mod 3 repeat
        # after 12; strict comes with a mask only)
        for i in range(12):
            settings = tp.ThreadpoolSettings(
                cpu_mask=FIRST if i % 2 else "0x0", poll=i % 3 * 50, strict=bool(i % 4 == 1)
            )
            loaded = runner.reconfigure(dataclasses.replace(base, threadpool=settings))
            assert loaded.settings.params.get("poll", 50) == settings.poll
            assert runner.kv.context is not None
            assert len(runner.kv.context.pools) == (0 if settings.is_default else 2)  # t 2, tb 1
            if i % 5 == 0 or i == 3:  # 3: a pinned, lax pool with poll 0 (15 was, of 20)
                generate(runner, Request(prompt="Hi", sampling=SamplingParams(max_tokens=1)))
            extra = runner.make_context(n_seq=2, n_ctx=128, n_batch=32)
            assert len(extra.pools) == (0 if settings.is_default else 2)
            extra.close()
            extra.close()
            assert all(p.ptr is None for p in extra.pools)
    finally:
        runner.close()
    assert tp._live_pools == 0


def _bench(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            which_llmrun(),
            "bench",
            "-r",
            "1",
            "--no-history",
            "-p",
            "8",
            "-n",
            "2",
            "-o",
            "json",
            *args,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
        stdin=subprocess.DEVNULL,
    )


def test_bench_runs_and_records_the_threadpool_flags(llmrun_env: dict[str, str]) -> None:
    done = _bench(llmrun_env, "--poll", "0")
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert [(r["test"], r["poll"], r["cpu_mask"], r["cpu_strict"]) for r in rows] == [
        ("pp8", 0, "0x0", False),
        ("tg2", 0, "0x0", False),
    ]
    done = _bench(llmrun_env, "-C", FIRST, "--cpu-strict", "1", "-t", "1")
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert [(r["poll"], r["cpu_mask"], r["cpu_strict"], r["n_threads"]) for r in rows] == [
        (50, FIRST, True, 1)
    ] * 2
    assert all(r["avg_ts"] > 0 for r in rows)


@pytest.mark.skipif(BEYOND is None, reason="this machine has every CPU a mask can name")
def test_bench_refuses_a_mask_of_no_cpu_here(llmrun_env: dict[str, str]) -> None:
    assert BEYOND is not None
    done = _bench(llmrun_env, "-C", f"{FIRST},{BEYOND}")
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "no CPU it names" in done.stderr


def test_the_terminal_table_tells_swept_threadpools_apart() -> None:
    from llmrun.cli.bench.output import results_table

    from .test_tables import _row, text_of

    rows = [
        _row((8, 0), 10.0, 1.0, cpu_mask=m, cpu_strict=s, poll=p)
        for m, s, p in (("0x1", False, 0), ("0x1", True, 50))
    ]
    out = text_of(results_table(rows), 120)  # type: ignore[arg-type]
    assert "strict" in out and "poll" in out and "cpu_mask" not in out  # only what varies
    assert any("True" in ln and "50" in ln for ln in out.splitlines())


@pytest.mark.parametrize("command", ["run", "chat"])
def test_run_and_chat_hand_the_flags_to_the_engine(
    command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[EngineConfig] = []

    def make(model: str | None, config: EngineConfig) -> FakeRunner:
        seen.append(config)
        return FakeRunner()

    monkeypatch.setattr(engine, "RUNNER_FACTORY", make)
    args = [command, "hello", "--no-dashboard"] if command == "run" else [command]
    done = CliRunner().invoke(
        app, [*args, "-C", FIRST, "--cpu-strict", "1", "--poll", "0"], input="hi\n"
    )
    assert done.exit_code == 0, done.stderr
    assert seen[-1].threadpool == tp.ThreadpoolSettings(cpu_mask=FIRST, strict=True, poll=0)
    plain = CliRunner().invoke(app, args, input="hi\n")
    assert plain.exit_code == 0 and seen[-1].threadpool.is_default
    bad = CliRunner().invoke(app, [*args, "-C", "0xq"], input="hi\n")
    assert bad.exit_code == 2 and "'q' is not a hex digit" in bad.stderr
    over = CliRunner().invoke(app, [*args, "--poll", "101"], input="hi\n")
    assert over.exit_code == 2
    remote = CliRunner().invoke(app, [*args, "--endpoint", "http://127.0.0.1:9", "--poll", "0"])
    assert remote.exit_code == 2 and "--poll: local-engine options" in remote.stderr


def test_the_header_names_a_threadpool_only_where_one_runs() -> None:
    from llmrun.cli.bench.machine import threadpool_line
    from llmrun.runners.bench.sweep import Combo

    assert threadpool_line([Combo(), Combo(n_threads=2)], 0) == ""
    line = threadpool_line([Combo(cpu_mask="0x1", poll=0), Combo(cpu_mask="0x3", poll=0)], -1)
    assert line.startswith("CPU mask 0x1/0x3 (varies by test), strict 0, poll 0, priority low")
    assert threadpool_line([Combo()], 2).startswith(
        "CPU mask 0x0, strict 0, poll 50, priority high"
    )


def test_without_linuxs_affinity_calls_the_defaults_still_work_and_a_mask_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """macOS has no sched_getaffinity: every run checks its (default) placement, which must not
    fail there; a mask or a priority, which need those calls, is refused in one line."""
    monkeypatch.delattr(tp.os, "sched_getaffinity")
    assert len(tp.ThreadpoolSettings().placement(2)) == 2
    with pytest.raises(BadRequestError, match="Linux"):
        tp.ThreadpoolSettings(cpu_mask="0x1").placement(1)
