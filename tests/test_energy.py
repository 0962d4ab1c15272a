"""Energy per phase on fake counters: a powercap tree in a temporary directory and a fake NVML
module, both advancing on a fake clock, so every figure has a known answer."""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import subprocess
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from llmrun.cli.app import app
from llmrun.cli.report import summary_lines
from llmrun.cli.session import energy_meter
from llmrun.runners.base import (
    Finished,
    LoadStarted,
    ModelLoaded,
    PrefillProgress,
    Request,
    SamplingParams,
    Token,
)
from llmrun.runners.energy import PhaseMeter, Unavailable, open_meter
from llmrun.runners.energy.nvml import open_nvml
from llmrun.runners.energy.powercap import ROOT_ENV, ROOT_ONLY, open_powercap
from llmrun.runners.llamacpp import LlamaCppRunner
from llmrun.runners.remote import OpenAIRunner
from llmrun.runners.stats import EnergyReport, GenerationStats, PhaseEnergy

from .conftest import HANG_S
from .fake import FAKE_MODEL, FAKE_SETTINGS, FakeRunner

GPU_SETTINGS = dataclasses.replace(
    FAKE_SETTINGS, n_gpu_layers=31, n_layer_total=31, device="CUDA0 NVIDIA H200"
)


class Meter:
    """One hardware counter: it draws `watts` and shows its energy only every `update_us`."""

    def __init__(self, watts: float, update_us: int, start_uj: int = 0) -> None:
        self.watts = watts
        self.update_us = update_us
        self.shown_uj = start_uj
        self.pending_us = 0
        self.frozen = False
        self.on_change: Callable[[], None] = lambda: None

    def run(self, dt_us: int) -> None:
        self.pending_us += dt_us
        steps, self.pending_us = divmod(self.pending_us, self.update_us)
        if steps and not self.frozen:
            self.shown_uj += round(self.watts * self.update_us * steps)
            self.on_change()


class Machine:
    """A fake clock; its counters advance only when the clock does."""

    def __init__(self) -> None:
        self.t_us = 0
        self.meters: list[Meter] = []

    def clock(self) -> float:
        return self.t_us / 1e6

    def sleep(self, seconds: float) -> None:
        dt = round(seconds * 1e6)
        for meter in self.meters:
            meter.run(dt)
        self.t_us += dt

    def add(self, meter: Meter) -> Meter:
        self.meters.append(meter)
        return meter


def zone(
    machine: Machine,
    root: Path,
    directory: str,
    name: str,
    watts: float,
    *,
    range_uj: int = 262_143_328_850,
    start_uj: int = 0,
    update_us: int = 1000,
) -> Meter:
    """A powercap zone whose energy_uj follows a counter, wrapping at its range."""
    path = root / directory
    path.mkdir(parents=True)
    (path / "name").write_text(name + "\n")
    (path / "max_energy_range_uj").write_text(f"{range_uj}\n")
    meter = machine.add(Meter(watts, update_us, start_uj))

    def write() -> None:
        (path / "energy_uj").write_text(f"{meter.shown_uj % range_uj}\n")

    meter.on_change = write
    write()
    return meter


def stats(*, prompt: int = 100, output: int = 11, settings: Any = FAKE_SETTINGS) -> GenerationStats:
    return GenerationStats(
        finish_reason="length",
        prompt_tokens=prompt,
        reused_tokens=0,
        output_tokens=output,
        template_tokenize_s=0.001,
        prefill_s=0.5,
        first_sample_s=0.001,
        itl_s=tuple(0.1 for _ in range(output - 1)),
        e2e_s=1.5,
        load_s=2.0,
        model=FAKE_MODEL,
        settings=settings,
    )


def request(
    meter: PhaseMeter,
    machine: Machine,
    *,
    active: dict[Meter, float],
    load_s: float | None = 2.0,
    prefill_s: float = 0.5,
    itl_s: float = 0.1,
    output: int = 11,
    settings: Any = FAKE_SETTINGS,
    during_decode: Callable[[], None] = lambda: None,
) -> EnergyReport:
    """A request's events with the counters drawing `active` watts while it runs."""
    idle = {m: m.watts for m in active}
    meter.begin()
    for m, watts in active.items():
        m.watts = watts
    if load_s is not None:
        meter.see(LoadStarted("/fake/model.gguf"))
        machine.sleep(load_s)
        meter.see(ModelLoaded(FAKE_MODEL, settings, load_s))
    meter.see(PrefillProgress(0, 100, 0, 0.0))
    machine.sleep(prefill_s / 2)
    meter.see(PrefillProgress(50, 100, 0, prefill_s / 2))
    machine.sleep(prefill_s / 2)
    meter.see(PrefillProgress(100, 100, 0, prefill_s))
    machine.sleep(0.001)  # the first sample
    during_decode()
    for i in range(output):
        if i:
            machine.sleep(itl_s)
        meter.see(Token(i, " x", 0.0, i))
    finished = meter.attach(Finished(stats(output=output, settings=settings), "x" * output))
    for m, watts in idle.items():
        m.watts = watts
    assert finished.stats.energy is not None
    return finished.stats.energy


@pytest.fixture
def machine() -> Machine:
    return Machine()


def meter_on(machine: Machine, root: Path, **kw: Any) -> PhaseMeter:
    return open_meter(powercap_root=root, clock=machine.clock, sleep=machine.sleep, **kw)


def test_packages_and_their_dram_are_summed_once(machine: Machine, tree: Path) -> None:
    pkg0 = zone(machine, tree, "intel-rapl:0", "package-0", 10.0)
    zone(machine, tree, "intel-rapl:0:0", "core", 6.0)  # inside package-0
    zone(machine, tree, "intel-rapl:0:1", "uncore", 1.0)  # inside package-0
    dram0 = zone(machine, tree, "intel-rapl:0:2", "dram", 2.0)
    pkg1 = zone(machine, tree, "intel-rapl:1", "package-1", 8.0)
    dram1 = zone(machine, tree, "intel-rapl:1:0", "dram", 1.0)
    zone(machine, tree, "intel-rapl:2", "psys", 30.0)  # the whole platform
    zone(machine, tree, "intel-rapl-mmio:0", "package-0", 10.0)  # package-0 again
    meter = meter_on(machine, tree, gpu=False)
    report = request(meter, machine, active={pkg0: 50.0, dram0: 4.0, pkg1: 8.0, dram1: 1.0})
    assert report.source == "RAPL package-0, package-0/dram, package-1, package-1/dram"
    assert report.idle_w == pytest.approx(21.0)
    assert report.update_interval_s == pytest.approx(0.001)
    assert report.idle_window_s == 0.5
    # above idle: package-0 +40 W, its dram +2 W; package-1 and its dram as idle
    assert report.load is not None and report.load.energy_j == pytest.approx(84.0, rel=1e-3)
    assert report.load.power_w == pytest.approx(42.0, rel=1e-3)
    assert report.prefill is not None and report.prefill.energy_j == pytest.approx(21.0, rel=1e-2)
    assert report.prefill.tokens == 100
    assert report.prefill.j_per_token == pytest.approx(0.21, rel=1e-2)
    assert report.decode is not None and report.decode.tokens == 10
    assert report.decode.energy_j == pytest.approx(42.0, rel=1e-2)
    assert report.decode.j_per_token == pytest.approx(4.2, rel=1e-2)
    assert report.decode.note == "" and report.reason == ""


def test_without_dram_the_packages_alone(machine: Machine, tree: Path) -> None:
    zone(machine, tree, "intel-rapl:0", "package-0", 12.0)
    zone(machine, tree, "intel-rapl:0:0", "core", 5.0)
    counter = open_powercap(tree)
    assert counter.name == "RAPL package-0"
    report = request(meter_on(machine, tree, gpu=False), machine, active={})
    assert report.idle_w == pytest.approx(12.0)
    assert report.decode is not None and report.decode.energy_j == pytest.approx(0.0, abs=0.05)


def test_amd_rapl_zones_count_too(machine: Machine, tree: Path) -> None:
    zone(machine, tree, "amd-rapl:0", "package-0", 12.0)
    zone(machine, tree, "amd-rapl:0:0", "core", 5.0)
    assert open_powercap(tree).name == "RAPL package-0"


def test_counter_wraparound_is_undone(machine: Machine, tree: Path) -> None:
    # a 100 J range, starting 10 J before the top: the decode's 120 J wraps it, and the reads
    # at least once a second between tokens see every wrap
    pkg = zone(
        machine,
        tree,
        "intel-rapl:0",
        "package-0",
        10.0,
        range_uj=100_000_000,
        start_uj=90_000_000,
    )
    meter = meter_on(machine, tree, gpu=False)
    report = request(meter, machine, active={pkg: 40.0}, load_s=None, output=31, itl_s=0.1)
    assert report.decode is not None
    assert report.decode.energy_j == pytest.approx(30.0 * 3.0, rel=1e-2)
    assert report.load is not None and report.load.energy_j is None
    assert report.load.note == "the model was loaded before this request"


def test_a_counter_standing_still_is_a_reason_never_a_zero(machine: Machine, tree: Path) -> None:
    zone(machine, tree, "intel-rapl:0", "package-0", 0.0)  # a VM's counter that never moves
    report = request(meter_on(machine, tree, gpu=False), machine, active={})
    assert report.reason.startswith("the RAPL package-0 counter stood still over 500.0 ms of idle")
    assert report.load is None and report.decode is None


def test_a_counter_past_any_machines_power_is_no_counter(machine: Machine, tree: Path) -> None:
    """A tree counting 10 MW (10^11 µJ every 10 ms) printed `energy load -399,115.7 J
    (-1,008,621.2 W) ... above an idle 9,600,896.9 W`, exit 0."""
    pkg = zone(machine, tree, "intel-rapl:0", "package-0", 10e6, range_uj=10**15)
    report = request(meter_on(machine, tree, gpu=False), machine, active={pkg: 9e6})
    assert report.reason.startswith("the RAPL package-0 counter read 10,000,000 W over 500.0 ms")
    assert "past the 10,000 W no machine's counter shows" in report.reason
    assert report.load is None and report.decode is None and report.idle_w is None


@pytest.mark.parametrize(
    ("active_w", "why"),
    [
        (50_000.0, "the RAPL package-0 counter read 50,000 W over the load (2,000.0 ms), past"),
        (10.0, "the load read 10.0 W, below the idle baseline of 100.0 W: the counters'"),
    ],
)
def test_a_phase_no_counter_can_read_gives_no_figure(
    machine: Machine, tree: Path, active_w: float, why: str
) -> None:
    """Energy above idle below zero, or a phase past any machine's power: no figure at all
    (the same counters and baseline make every phase's), the reason instead."""
    pkg = zone(machine, tree, "intel-rapl:0", "package-0", 100.0)
    report = request(meter_on(machine, tree, gpu=False), machine, active={pkg: active_w})
    assert report.reason.startswith(why), report.reason
    assert report.load is None and report.prefill is None and report.decode is None


def test_a_phase_a_step_below_idle_is_still_measured(machine: Machine, tree: Path) -> None:
    """A short phase may read a counter step less than idle: within the counter's error."""
    pkg = zone(machine, tree, "intel-rapl:0", "package-0", 100.0, update_us=20_000)
    report = request(meter_on(machine, tree, gpu=False), machine, active={pkg: 99.0}, prefill_s=0.2)
    assert report.measured, report.reason
    assert report.prefill is not None and report.prefill.energy_j is not None


def test_a_long_phase_a_little_below_idle_is_still_measured(machine: Machine, tree: Path) -> None:
    """I/O waits can draw a little less than the baseline, which was taken while polling:
    3 % below idle over 2 s is 6 J, far more than two of RAPL's 1 ms steps."""
    pkg = zone(machine, tree, "intel-rapl:0", "package-0", 100.0)
    report = request(meter_on(machine, tree, gpu=False), machine, active={pkg: 97.0}, prefill_s=2.0)
    assert report.measured, report.reason
    assert report.prefill is not None and report.prefill.energy_j is not None


def test_a_counter_that_stops_during_a_phase_gives_no_figure_for_it(
    machine: Machine, tree: Path
) -> None:
    pkg = zone(machine, tree, "intel-rapl:0", "package-0", 10.0)

    def stop() -> None:
        pkg.frozen = True

    meter = meter_on(machine, tree, gpu=False)
    report = request(meter, machine, active={pkg: 30.0}, during_decode=stop)
    assert report.prefill is not None and report.prefill.energy_j == pytest.approx(10.0, rel=1e-2)
    assert report.decode is not None and report.decode.energy_j is None
    assert report.decode.note == "the RAPL package-0 counter stood still for 1,000.0 ms"


def test_no_source_at_all_gives_the_reason(
    machine: Machine, tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # nvidia-ml-py not installed
    meter = meter_on(machine, tree / "missing")
    report = request(meter, machine, active={})
    assert report.reason == (
        f"no RAPL counters: {tree / 'missing'} is missing here, as in most VMs and containers"
    )
    gpu = request(meter, machine, active={}, settings=GPU_SETTINGS, load_s=None)
    assert gpu.reason.endswith(
        "; GPU: nvidia-ml-py is not installed (pip install 'llmrun[nvidia]')"
    )
    assert gpu.to_dict()["prefill_j"] is None and gpu.to_dict()["reason"] == gpu.reason


def test_no_package_zone_is_a_reason(tmp_path: Path) -> None:
    (tmp_path / "intel-rapl:0").mkdir()
    (tmp_path / "intel-rapl:0" / "name").write_text("psys\n")
    with pytest.raises(Unavailable, match="no readable RAPL package zone"):
        open_powercap(tmp_path)


@pytest.mark.parametrize(
    ("range_uj", "energy_uj"), [("0", "5"), ("100", "101"), ("٣٠٠", "1"), ("300", "²"), ("-1", "0")]
)
def test_a_zone_no_kernel_writes_is_no_counter(
    tmp_path: Path, range_uj: str, energy_uj: str
) -> None:
    """A range of 0 gave `above an idle -375.8 W`; Unicode digits were read by int()."""
    zone_dir = tmp_path / "intel-rapl:0"
    zone_dir.mkdir()
    (zone_dir / "name").write_text("package-0\n")
    (zone_dir / "max_energy_range_uj").write_text(range_uj + "\n")
    (zone_dir / "energy_uj").write_text(energy_uj + "\n")
    with pytest.raises(Unavailable, match="no readable RAPL package zone"):
        open_powercap(tmp_path)


def test_a_counter_past_its_range_is_no_counter(tmp_path: Path) -> None:
    """A counter stepping by 10**30 µJ gave `energy load -2,314,868,195,363,210,812,981,248.0 J`."""
    zone_dir = tmp_path / "intel-rapl:0"
    zone_dir.mkdir()
    (zone_dir / "name").write_text("package-0\n")
    (zone_dir / "max_energy_range_uj").write_text("1000\n")
    (zone_dir / "energy_uj").write_text("10\n")
    counter = open_powercap(tmp_path)
    (zone_dir / "energy_uj").write_text(f"{10**30}\n")
    with pytest.raises(Unavailable, match="past its range of 1000 µJ: not a RAPL counter"):
        counter.read_j()


def _package_zone(root: Path) -> Path:
    zone_dir = root / "intel-rapl:0"
    zone_dir.mkdir()
    (zone_dir / "name").write_text("package-0\n")
    (zone_dir / "max_energy_range_uj").write_text("1000000\n")
    (zone_dir / "energy_uj").write_text("10\n")
    return zone_dir


def _open_apart(
    root: Path, env: dict[str, str], then: str = ""
) -> subprocess.CompletedProcess[str]:
    """open_powercap(root) (and `then`) in a child, so a read that waits is a timeout here."""
    code = (
        "import sys\n"
        "from llmrun.runners.energy.powercap import open_powercap, Unavailable\n"
        "try:\n"
        f"    counter = open_powercap({str(root)!r})\n"
        f"    {then or 'pass'}\n"
        "    print('opened', counter.labels, counter.read_j())\n"
        "except Unavailable as e:\n"
        "    print('unavailable:', e)\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    ("file", "says"),
    [
        ("name", "intel-rapl:0/name: not a regular file (a FIFO, a device or a socket)"),
        ("energy_uj", "intel-rapl:0/energy_uj: not a regular file (a FIFO, a device or a socket)"),
        ("max_energy_range_uj", "max_energy_range_uj: not a regular file"),
    ],
)
def test_a_zone_file_that_is_a_fifo_is_a_reason_never_a_hang(
    tmp_path: Path, file: str, says: str, llmrun_env: dict[str, str]
) -> None:
    """LLMRUN_POWERCAP_ROOT with a FIFO for `name` or `energy_uj`: `run --energy on` waited
    for a writer for ever, deaf to the first SIGTERM."""
    zone_dir = _package_zone(tmp_path)
    (zone_dir / file).unlink()
    os.mkfifo(zone_dir / file)
    done = _open_apart(tmp_path, llmrun_env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"unavailable: no readable RAPL package zone under {tmp_path}")
    assert says in done.stdout, done.stdout


def test_a_counter_that_becomes_a_fifo_is_a_reason_never_a_hang(
    tmp_path: Path, llmrun_env: dict[str, str]
) -> None:
    zone_dir = _package_zone(tmp_path)
    swap = f"import os; os.unlink({str(zone_dir / 'energy_uj')!r}); os.mkfifo({str(zone_dir / 'energy_uj')!r})"
    done = _open_apart(tmp_path, llmrun_env, swap)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"unavailable: reading {zone_dir / 'energy_uj'}: not a regular")


def test_zone_files_not_utf8_or_too_long_are_read_safely(
    tmp_path: Path, cli: CliRunner, fake: FakeRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `name` that is not UTF-8 (`package-\\xff\\xfe`) was `internal error: UnicodeDecodeError`;
    its bytes are replaced, as the kernel's names never need."""
    zone_dir = _package_zone(tmp_path)
    (zone_dir / "name").write_bytes(b"package-\xff\xfe\n")
    assert open_powercap(tmp_path).labels == ("package-\ufffd\ufffd",)
    monkeypatch.setenv(ROOT_ENV, str(tmp_path))
    monkeypatch.setitem(sys.modules, "pynvml", None)
    result = cli.invoke(app, ["run", "--energy", "on", "-n", "2", "hi"])
    assert result.exit_code == 1, result.stderr  # the fake's counter stands still
    [line] = result.stderr.splitlines()
    assert line.startswith("llmrun: error: --energy on: no energy counter can be read here")
    assert "RAPL package-\ufffd\ufffd counter" in line
    (zone_dir / "energy_uj").write_text("1" * 5000)  # no counter is a page long
    with pytest.raises(Unavailable, match="counter file is larger than 4096 bytes"):
        open_powercap(tmp_path)


@pytest.fixture
def unreadable_tree(tmp_path: Path) -> Path:
    """A powercap tree whose energy_uj this process may not read (mode 0: the kernel's 0400
    root-only file, seen by anyone else)."""
    zone_dir = tmp_path / "intel-rapl:0"
    zone_dir.mkdir()
    (zone_dir / "name").write_text("package-0\n")
    (zone_dir / "max_energy_range_uj").write_text("262143328850\n")
    (zone_dir / "energy_uj").write_text("123456\n")
    (zone_dir / "energy_uj").chmod(0)
    return tmp_path


def _as_anyone() -> None:
    """In the child, before it runs Python: a root without the capabilities that read any file
    (CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH leave the bounding set, so the exec drops them),
    for whom a file's mode counts as for everyone else."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def test_root_only_energy_uj_says_how_to_read_it(
    unreadable_tree: Path, llmrun_env: dict[str, str]
) -> None:
    code = (
        "from llmrun.runners.energy import open_meter\n"
        "print(open_meter(gpu=False, idle_window_s=0.01).reasons['cpu'])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**llmrun_env, ROOT_ENV: str(unreadable_tree)},
        preexec_fn=_as_anyone if os.geteuid() == 0 else None,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ROOT_ONLY


class FakeNvml(types.ModuleType):
    """pynvml's functions that llmrun calls, on counters of the fake machine (mJ)."""

    NVML_ERROR_NOT_SUPPORTED = 3

    class NVMLError(Exception):
        def __init__(self, value: int) -> None:
            super().__init__(f"NVML error {value}")
            self.value = value

    def __init__(self, gpus: list[Meter], *, supported: bool = True) -> None:
        super().__init__("pynvml")
        self.gpus = gpus
        self.supported = supported
        self.started = 0

    def nvmlInit(self) -> None:
        self.started += 1

    def nvmlShutdown(self) -> None:
        self.started -= 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> Meter:
        return self.gpus[i]

    def nvmlDeviceGetName(self, handle: Meter) -> str:
        return "NVIDIA H200"

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: Meter) -> int:
        if not self.supported:
            raise self.NVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        return handle.shown_uj // 1000


def test_nvml_counts_where_layers_run_on_the_gpu(machine: Machine, tree: Path) -> None:
    pkg = zone(machine, tree, "intel-rapl:0", "package-0", 10.0)
    gpu = machine.add(Meter(70.0, 20_000))  # an idle H200's 70 W, an update every 20 ms
    nvml = FakeNvml([gpu])
    meter = meter_on(machine, tree, nvml_module=nvml)
    report = request(meter, machine, active={pkg: 20.0, gpu: 370.0}, settings=GPU_SETTINGS)
    assert report.source == "RAPL package-0 + NVML GPU 0 (NVIDIA H200)"
    assert report.idle_w == pytest.approx(80.0, rel=1e-3)
    assert report.update_interval_s == pytest.approx(0.020)
    assert report.decode is not None and report.decode.energy_j == pytest.approx(310.0, rel=0.05)
    assert report.prefill is not None and report.prefill.note == ""  # 25 updates: enough
    # the same machine, the model on the CPU: the GPU's counter is left out
    cpu = request(meter, machine, active={pkg: 20.0}, load_s=None)
    assert cpu.source == "RAPL package-0" and cpu.idle_w == pytest.approx(10.0)
    meter.close()
    assert nvml.started == 0


def test_phases_shorter_than_the_counter_are_marked(machine: Machine, tree: Path) -> None:
    gpu = machine.add(Meter(70.0, 20_000))
    meter = meter_on(machine, tree / "none", nvml_module=FakeNvml([gpu]))
    report = request(
        meter, machine, active={gpu: 300.0}, settings=GPU_SETTINGS, prefill_s=0.03, itl_s=0.016
    )
    assert report.source == "NVML GPU 0 (NVIDIA H200)"
    assert report.left_out.startswith("the CPU's energy: no RAPL counters")
    assert report.prefill is not None and report.prefill.energy_j is None
    assert (
        report.prefill.note == "too short for the counter: 30.0 ms against an update every 20.0 ms"
    )
    assert report.decode is not None and report.decode.energy_j is not None
    assert report.decode.note == "coarse: 8 counter updates of 20.0 ms"
    lines = "\n".join(summary_lines(dataclasses.replace(stats(), energy=report)))
    assert "prefill - (too short for the counter: 30.0 ms against an update every 20.0 ms)" in lines


def test_a_gpu_without_an_energy_counter(machine: Machine, tree: Path) -> None:
    pkg = zone(machine, tree, "intel-rapl:0", "package-0", 10.0)
    nvml = FakeNvml([machine.add(Meter(70.0, 20_000))], supported=False)
    with pytest.raises(Unavailable, match="this GPU has no total-energy counter"):
        open_nvml(nvml)
    assert nvml.started == 0
    meter = meter_on(machine, tree, nvml_module=nvml)
    report = request(meter, machine, active={pkg: 20.0}, settings=GPU_SETTINGS)
    assert report.source == "RAPL package-0"  # measured, and says what it leaves out
    assert report.left_out == (
        "the GPU's energy: this GPU has no total-energy counter (NVML has one from Volta on)"
    )


def test_a_gpu_name_that_is_not_utf8_is_left_out(machine: Machine) -> None:
    """nvidia-ml-py decodes the driver's name strictly: its UnicodeDecodeError escaped."""

    class BadName(FakeNvml):
        def nvmlDeviceGetName(self, handle: Meter) -> str:
            return b"H200 \xff".decode()

    counter = open_nvml(BadName([machine.add(Meter(70.0, 20_000))]))
    assert counter.name == "NVML GPU 0"
    counter.close()


def test_summary_and_json_carry_the_energy(machine: Machine, tree: Path) -> None:
    pkg = zone(machine, tree, "intel-rapl:0", "package-0", 10.0)
    zone(machine, tree, "intel-rapl:0:1", "dram", 2.0)
    report = request(meter_on(machine, tree, gpu=False), machine, active={pkg: 34.0})
    s = dataclasses.replace(stats(), energy=report)
    lines = summary_lines(s)
    row = next(line for line in lines if line.startswith("energy"))
    assert row == (
        "energy   load 48.0 J (24.0 W) · prefill 12.0 J (120.0 mJ/token, 24.0 W)"
        " · decode 24.0 J (2.40 J/token, 24.0 W) · above an idle 12.0 W"
        " · RAPL package-0, package-0/dram"
    )
    record = json.loads(json.dumps(s.to_dict()))["energy"]
    assert record["source"] == "RAPL package-0, package-0/dram" and record["reason"] is None
    assert record["decode_j"] == pytest.approx(24.0, rel=1e-3)
    assert record["decode_j_per_token"] == pytest.approx(2.4, rel=1e-3)
    assert record["prefill_w"] == pytest.approx(24.0, rel=1e-3)
    assert record["idle_w"] == pytest.approx(12.0) and record["update_interval_s"] > 0
    assert set(record) >= {"load_j", "load_window_s", "load_w", "prefill_tokens", "decode_note"}
    assert "energy" not in dataclasses.replace(s, energy=None).to_dict()  # bench, serve


def test_phase_record_units() -> None:
    phase = PhaseEnergy(energy_j=6.0, window_s=2.0, tokens=3)
    assert phase.power_w == 3.0 and phase.j_per_token == 2.0
    assert PhaseEnergy(None, 2.0, 3, "why").power_w is None


def test_run_says_why_energy_is_not_available(
    cli: CliRunner, fake: FakeRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ROOT_ENV, str(tmp_path / "no-powercap"))
    monkeypatch.setitem(sys.modules, "pynvml", None)
    result = cli.invoke(app, ["run", "hello", "there"])
    assert result.exit_code == 0, result.stderr
    assert f"energy   not available (no RAPL counters: {tmp_path / 'no-powercap'} is" in (
        result.stderr
    )
    result = cli.invoke(app, ["run", "hello", "--stats", "json"])
    line = next(x for x in result.stderr.splitlines() if x.startswith("{"))
    energy = json.loads(line)["energy"]
    assert energy["reason"].startswith("no RAPL counters") and energy["decode_j"] is None
    assert energy["idle_w"] is None and energy["idle_window_s"] is None


def test_requests_run_together_and_remote_requests_are_not_metered() -> None:
    meter = energy_meter(FakeRunner(), together=True)
    assert meter is not None
    assert meter.report(stats()).reason.startswith("the requests ran together (--parallel)")
    remote = OpenAIRunner("http://127.0.0.1:9")  # never connected to
    remote_meter = energy_meter(remote)
    assert remote_meter is not None
    assert remote_meter.report(stats()).reason == (
        "the model runs on a server, whose energy is not seen here"
    )


def test_energy_on_from_the_environment_reports_a_servers_run(
    cli: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LLMRUN_ENERGY=on made every `run --endpoint` fail (`--energy on: no energy counter can be
    read here`): the variable asks for each command's energy, and a server's is the reason
    in the report; typed, --energy on is still refused there."""
    from .stub_server import stub_server

    monkeypatch.setenv(ROOT_ENV, str(tmp_path / "no-powercap"))
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with stub_server() as url:
        result = cli.invoke(
            app, ["run", "--endpoint", url, "-n", "3", "hi"], env={"LLMRUN_ENERGY": "on"}
        )
        assert result.exit_code == 0, result.stderr
        assert "energy   not available (the model runs on a server" in result.stderr
        typed = cli.invoke(app, ["run", "--endpoint", url, "--energy", "on", "-n", "3", "hi"])
        assert typed.exit_code == 1 and "--energy on: no energy counter" in typed.stderr


class CpuTimeCounter:
    """A counter of this process's CPU seconds at 10 W each: the real engine's work moves it."""

    name = "CPU time"
    kind = "cpu"

    def read_j(self) -> float:
        return 10.0 * time.process_time()

    def close(self) -> None:
        pass


def test_the_real_engine_s_events_bound_the_phases(runner: LlamaCppRunner) -> None:
    meter = PhaseMeter([CpuTimeCounter()], idle_window_s=0.2)
    meter.measure_idle()
    runner.reset()
    meter.begin()
    finished = None
    sampling = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for event in runner.stream(Request(prompt="The sky is blue because " * 8, sampling=sampling)):
        if isinstance(event, Finished):
            finished = meter.attach(event)
        else:
            meter.see(event)
    assert finished is not None and finished.stats.energy is not None
    s, energy = finished.stats, finished.stats.energy
    assert energy.source == "CPU time" and energy.idle_w is not None
    assert energy.prefill is not None and energy.decode is not None
    assert energy.prefill.tokens == s.new_prompt_tokens and energy.decode.tokens == 7
    assert energy.prefill.window_s >= s.prefill_s * 0.9
    assert s.decode_s is not None and energy.decode.window_s >= s.decode_s * 0.9
    assert energy.prefill.energy_j is not None and energy.prefill.energy_j > 0
    assert energy.decode.energy_j is not None and energy.decode.energy_j > 0
    assert energy.load is not None and energy.load.energy_j is None  # loaded before
