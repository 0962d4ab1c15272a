"""The report of the machine and the loaded model that `bench` and `tune` print before they
measure: the system's rows, the engine's settings and whose defaults chose them, the threadpool."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from llmrun.cli.dashboard import model_facts
from llmrun.cli.report import ms
from llmrun.cli.terminal import terminal_line
from llmrun.runners.base import BenchRunner
from llmrun.runners.bench import sweep as sw
from llmrun.runners.bench.tuned import saved_tuning
from llmrun.runners.config import EngineConfig
from llmrun.runners.stats import EngineSettings, human_count
from llmrun.runners.system import SystemInfo
from llmrun.runners.threadpool import DEFAULT_POLL, PRIORITIES


def system_rows(system: SystemInfo, model: str) -> list[tuple[str, str]]:
    ram = human_count(system.ram_bytes, "B") if system.ram_bytes else "?"
    bw = f"{system.mem_bw_bytes_s / 1e9:.1f} GB/s" if system.mem_bw_bytes_s else "not measured"
    if system.mem_bw_spread is not None:
        bw += f" median, runs spread over {system.mem_bw_spread:.0%} of it"
    bw += " (streaming copy)" + "".join(
        f" · {b.device} {b.bytes_s / 1e9:,.1f} GB/s ({b.source})" for b in system.device_bandwidths
    )
    return [
        (
            "cpu",
            f"{system.cpu} · {system.physical_cores} cores ({system.logical_cpus} logical)"
            f" · RAM {ram}",
        ),
        ("memory", bw),
        ("gpu", system.gpu),
        ("build", f"{system.build} · {system.features}"),
        ("model", model),
    ]


def label_grid(rows: Sequence[tuple[str, str]]) -> Table:
    """Label and value in two columns: a narrow terminal wraps the value under itself."""
    grid = Table.grid(padding=(0, 1))
    grid.add_column(width=8, no_wrap=True)
    grid.add_column(overflow="fold")  # a long path folds; a cell is never cut
    for label, value in rows:
        grid.add_row(label, Text(terminal_line(value)))  # a model's name may hold escapes
    return grid


def load_and_report(
    runner: BenchRunner,
    err: Console,
    *,
    bandwidth: bool,
    system: SystemInfo | None = None,
    combos: Sequence[sw.Combo] = (),
    llama_bench_defaults: bool = False,
    cancel: threading.Event | None = None,
    tuning: bool = False,
) -> SystemInfo:
    """Load the model and print the machine's report (with the bandwidth probe if asked; a
    later model of the same run reuses the first one's report of the machine). Setting
    `cancel` (the command's Ctrl-C or SIGTERM) ends the load: the repacking probe's child,
    the tensors and the warm-up decode (LoadCancelledError). `tuning`: tune's load, with
    llmrun's defaults where the search starts whatever was tuned before."""
    with err.status("loading the model and measuring memory bandwidth ..."):
        loaded = runner.load(cancel=cancel)
        if system is None:
            system = SystemInfo.collect(bandwidth=bandwidth)
    facts = f"{loaded.model.name} · {model_facts(loaded)} · load {ms(loaded.load_s)}"
    err.print(label_grid(system_rows(system, facts)))
    st = loaded.settings
    if isinstance(st, EngineSettings):
        saved = "" if llama_bench_defaults or st.tuned else saved_tuning(runner.model_path)
        line = settings_line(
            st,
            combos,
            runner.config,
            llama_bench_defaults=llama_bench_defaults,
            saved=saved,
            tuning=tuning,
        )
        err.print(label_grid([("settings", line)]))
        pools = threadpool_line(combos, runner.config.threadpool.prio)
        if pools:
            err.print(label_grid([("pool", pools)]))
    return system


def threadpool_line(combos: Sequence[sw.Combo], prio: int) -> str:
    """-C, --cpu-strict, --poll and --prio where any test runs other than llama.cpp's defaults."""
    if not prio and all(
        (c.cpu_mask, c.cpu_strict, c.poll) == ("0x0", False, DEFAULT_POLL) for c in combos
    ):
        return ""
    return (
        f"CPU mask {_each('0x0', None, [c.cpu_mask for c in combos])}, strict"
        f" {_each(0, None, [int(c.cpu_strict) for c in combos])}, poll"
        f" {_each(DEFAULT_POLL, None, [c.poll for c in combos])}, priority"
        f" {PRIORITIES[prio]}: a threadpool of llmrun's on each context, as llama-bench"
        " makes one"
    )


def _each(loaded: object, base: object, swept: Sequence[object], show: Any = str) -> str:
    """The value every test runs with, or each value and that it varies: a swept value of None
    (or the base's own) is what the loaded engine has."""
    values = list(dict.fromkeys(loaded if v is None or v == base else v for v in swept))
    if len(values) <= 1:
        return show(values[0] if values else loaded)
    return "/".join(show(v) for v in values) + " (varies by test)"


def settings_line(
    st: EngineSettings,
    combos: Sequence[sw.Combo] = (),
    base: EngineConfig | None = None,
    *,
    llama_bench_defaults: bool = False,
    saved: str = "",
    tuning: bool = False,
) -> str:
    """What runs, and whose defaults filled what was not given (llama-bench's, so its tools
    pair the records, or with --tuned llmrun's): for a swept setting, the value each test runs
    with, not the loaded engine's first. `saved`: what tune saved for the model where this
    load does not use it (`saved_tuning`); `tuning`: tune's own load, which never does."""
    b = base or EngineConfig()
    if llama_bench_defaults:
        source = "llama-bench's defaults (--tuned: llmrun's own)"
    elif st.tuned:
        source = "tuned by `llmrun tune`"
    elif tuning:
        kept = f"; saved already: {saved}" if saved else " (nothing tuned for this model yet)"
        source = f"llmrun's defaults, where tune starts{kept}"
    else:
        source = "llmrun's defaults " + (
            f"(not applied here: {saved})" if saved else "(nothing tuned for this model)"
        )
    repack = st.repack_note or ("on" if st.repack else "off")
    swept_repack = [None if c.repack is None else ("on" if c.repack else "off") for c in combos]
    ngl = _each(st.n_gpu_layers_asked, b.n_gpu_layers, [c.n_gpu_layers for c in combos])
    if ngl == str(st.n_gpu_layers_asked):
        note = f": {st.offload_note}" if st.offload_note else ""
        ngl += f" ({st.n_gpu_layers} of {st.n_layer_total} offloaded{note})"
    threads = _each(st.n_threads, b.n_threads, [c.n_threads for c in combos])
    return (
        f"{threads} threads, batch {_each(st.n_batch, b.n_batch, [c.n_batch for c in combos])},"
        f" ubatch {_each(st.n_ubatch, b.n_ubatch, [c.n_ubatch for c in combos])}, flash"
        f" attention {_each(st.flash_attn, b.flash_attn, [c.flash_attn for c in combos])},"
        f" repacking {_each(repack, None, swept_repack)}, ngl {ngl}: {source}."
        + _fit_note(st, combos)
    )


def _fit_note(st: EngineSettings, combos: Sequence[sw.Combo]) -> str:
    """-fitt/-fitc are recorded, never silently: llama.cpp's fitting is in its common library,
    which llama-cpp-python does not ship."""
    if not any(c.fit_target or c.fit_min_ctx for c in combos):
        return ""
    why = (
        "llmrun fits -ngl -1 to free device memory itself"
        if st.gpu_offload
        else "on a CPU-only build llama-bench's fitting places nothing either"
    )
    return (
        " -fitt/-fitc are recorded as given, not applied: llama.cpp's fitting is in its"
        f" common library, which llmrun does not load ({why})."
    )
