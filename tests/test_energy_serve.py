"""Energy in serve's /metrics: the engine steps' joules by phase from a fake counter, read as
Prometheus reads them (prometheus_client's parser); absent, with the reason, without one."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import httpx2 as httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from llmrun.runners.energy.steps import StepEnergy, open_steps, step_phase
from llmrun.runners.errors import BadRequestError
from llmrun.runners.serving.api_engine import StepRecord
from llmrun.runners.serving.api_metrics import ServerMetrics

from .conftest import BACKGROUND_ENV, HANG_S
from .fake import FAKE_SETTINGS
from .test_serve import llmrun_serve


class Clock:
    """A fake clock and a counter drawing `watts` on it."""

    def __init__(self) -> None:
        self.t = 0.0
        self.watts = 10.0
        self.joules = 0.0

    def __call__(self) -> float:
        return self.t

    def run(self, seconds: float, watts: float) -> None:
        self.t += seconds
        self.joules += seconds * watts


class ClockCounter:
    name = "RAPL package-0"
    kind = "cpu"

    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def read_j(self) -> float:
        return self.clock.joules

    def close(self) -> None:
        pass


def samples(metrics: ServerMetrics) -> dict[str, list[Sample]]:
    text = metrics.text().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def step(metrics: ServerMetrics, clock: Clock, n_prefill: int, n_decode: int, s: float) -> None:
    metrics.before_step()
    clock.run(s, 40.0)
    metrics.on_step(StepRecord(clock.t, s, n_decode, n_prefill))
    clock.run(0.5, 10.0)  # between steps: not counted


def test_steps_joules_by_what_they_carried() -> None:
    clock = Clock()
    energy = StepEnergy([ClockCounter(clock)], idle_w=10.0, clock=clock)
    metrics = ServerMetrics(energy=energy)
    step(metrics, clock, 64, 0, 0.25)
    step(metrics, clock, 0, 4, 0.05)
    step(metrics, clock, 0, 4, 0.05)
    step(metrics, clock, 32, 2, 0.1)
    found = samples(metrics)
    joules = {s.labels["phase"]: s.value for s in found["llmrun_energy_joules"]}
    assert joules == pytest.approx({"prefill": 10.0, "decode": 4.0, "mixed": 4.0})
    seconds = {s.labels["phase"]: s.value for s in found["llmrun_energy_seconds"]}
    assert seconds == pytest.approx({"prefill": 0.25, "decode": 0.1, "mixed": 0.1})
    assert [s.value for s in found["llmrun_energy_idle_watts"]] == [10.0]
    [info] = found["llmrun_energy_info"]
    assert info.name == "llmrun_energy_info" and info.value == 1.0
    assert info.labels == {"source": "RAPL package-0", "reason": ""}
    # above idle, as the help says: joules - idle * seconds
    assert joules["decode"] - 10.0 * seconds["decode"] == pytest.approx(3.0)


def test_no_source_is_absent_never_zero() -> None:
    energy = StepEnergy([], reason="powercap is root-only here")
    metrics = ServerMetrics(energy=energy)
    metrics.before_step()
    metrics.on_step(StepRecord(1.0, 0.1, 4, 0))
    found = samples(metrics)
    assert found["llmrun_energy_joules"] == []  # declared, no sample
    assert found["llmrun_energy_seconds"] == []
    assert "llmrun_energy_idle_watts" not in found
    [info] = found["llmrun_energy_info"]
    assert info.labels == {"source": "", "reason": "powercap is root-only here"}


def test_a_counter_that_fails_later_stops_counting_and_says_why() -> None:
    clock = Clock()

    class Failing(ClockCounter):
        def read_j(self) -> float:
            from llmrun.runners.energy import Unavailable

            if clock.t > 1.0:
                raise Unavailable("reading energy_uj failed")
            return clock.joules

    energy = StepEnergy([Failing(clock)], idle_w=10.0, clock=clock)
    metrics = ServerMetrics(energy=energy)
    step(metrics, clock, 0, 4, 0.1)
    step(metrics, clock, 0, 4, 0.1)
    step(metrics, clock, 0, 4, 0.1)
    joules = {s.labels["phase"]: s.value for s in samples(metrics)["llmrun_energy_joules"]}
    assert joules == pytest.approx({"decode": 8.0})  # the two steps before it failed
    assert energy.reason == "reading energy_uj failed" and not energy.measured
    [info] = samples(metrics)["llmrun_energy_info"]  # /metrics says it as it stands now
    assert info.labels == {"source": "", "reason": "reading energy_uj failed"}


def test_energy_off_declares_nothing() -> None:
    assert open_steps("off", FAKE_SETTINGS) is None
    assert not any(name.startswith("llmrun_energy") for name in samples(ServerMetrics()))


def test_the_switch_on_a_machine_with_nothing_readable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    monkeypatch.setenv("LLMRUN_POWERCAP_ROOT", str(tmp_path / "none"))
    monkeypatch.setitem(sys.modules, "pynvml", None)
    auto = open_steps("auto", FAKE_SETTINGS)
    assert auto is not None and not auto.measured
    assert auto.reason.startswith("no RAPL counters:")
    with pytest.raises(
        BadRequestError, match="--energy on: no energy counter can be read here"
    ) as e:
        open_steps("on", FAKE_SETTINGS)
    assert "GPU: nvidia-ml-py is not installed (pip install 'llmrun[nvidia]')" in str(e.value)


def test_step_phases() -> None:
    assert [step_phase(*c) for c in ((8, 0), (0, 3), (8, 3))] == ["prefill", "decode", "mixed"]


def test_a_server_on_a_fake_powercap_tree_counts_its_steps(
    llmrun_env: dict[str, str], tmp_path: Path
) -> None:
    """`llmrun serve` reading a powercap tree whose counter this test advances at 20 W."""
    zone = tmp_path / "intel-rapl:0"
    zone.mkdir()
    (zone / "name").write_text("package-0\n")
    (zone / "max_energy_range_uj").write_text("262143328850\n")
    (zone / "energy_uj").write_text("0\n")
    stop = threading.Event()

    def advance() -> None:
        t0 = time.perf_counter()
        while not stop.wait(0.001):  # whole files only: the server never reads one half written
            (zone / "next").write_text(f"{int((time.perf_counter() - t0) * 20e6)}\n")
            os.replace(zone / "next", zone / "energy_uj")

    writer = threading.Thread(target=advance, daemon=True)
    writer.start()
    try:
        env = {**llmrun_env, "LLMRUN_POWERCAP_ROOT": str(tmp_path), BACKGROUND_ENV: "0"}
        with llmrun_serve(env, "-np", "1", "--no-dashboard", "--energy", "on") as s:
            # A prompt of some 300 tokens: prefill lasts about as long as the 8 decode steps, so
            # a writer thread starved on busy cores misses neither (4 tokens took a few ms).
            prompt = "The sky is blue because " * 60
            s.post("/v1/completions", {"prompt": prompt, "max_tokens": 8, "temperature": 0})
            text = httpx.get(s.url + "/metrics", timeout=HANG_S).text
    finally:
        stop.set()
        writer.join()
    found = {f.name: f.samples for f in text_string_to_metric_families(text)}
    [info] = found["llmrun_energy_info"]
    assert info.labels == {"source": "RAPL package-0", "reason": ""}
    joules = {x.labels["phase"]: x.value for x in found["llmrun_energy_joules"]}
    assert joules.get("prefill", 0) + joules.get("mixed", 0) > 0 and joules["decode"] > 0
    [idle] = found["llmrun_energy_idle_watts"]
    assert idle.value == pytest.approx(20.0, rel=0.5)  # the writer thread lags on busy cores
