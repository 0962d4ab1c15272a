"""GPU code paths, checked without a GPU: fakes stand in for the device queries."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmrun.cli import engine
from llmrun.cli.app import app
from llmrun.cli.report import engine_text
from llmrun.runners import devices as dv
from llmrun.runners.limits import MemoryNeed, fit_gpu_layers, plan_offload
from llmrun.runners.system import SystemInfo

from .fake import FAKE_SETTINGS, FakeRunner

GIB = 2**30
H200 = dv.Device("CUDA0", "NVIDIA H200", "GPU", "CUDA", 140 * GIB, 141 * GIB)
CPU = dv.Device("CPU", "AMD EPYC", "CPU", "CPU", 20 * GIB, 24 * GIB)
# a 7B-like model: 4 GiB of weights, a 1 GiB KV cache for the context, 0.5 GiB compute
NEED = MemoryNeed(kv_bytes=1 * GIB, compute_bytes=GIB // 2, weights_bytes=4 * GIB)


class FakeQuery:
    def __init__(self, devices: list[dv.Device]) -> None:
        self._devices = devices

    def devices(self) -> list[dv.Device]:
        return self._devices

    def commit(self) -> str:
        return "abc1234-dirty"

    def version(self) -> str:
        return "0.0.1"


def test_all_layers_go_to_a_gpu_with_room() -> None:
    layers, note = plan_offload(-1, can_offload=True, n_layer=32, need=NEED,
                                gpus=[("CUDA0", 80 * GIB)])  # fmt: skip
    assert layers == -1 and note == "all 33 layers on CUDA0"


def test_a_small_gpu_gets_the_layers_that_fit_and_says_so() -> None:
    layers, note = plan_offload(-1, can_offload=True, n_layer=32, need=NEED,
                                gpus=[("CUDA0", 3 * GIB)])  # fmt: skip
    assert layers == fit_gpu_layers(NEED, 32, 3 * GIB)
    assert 0 < layers < 33
    assert note.startswith(f"{layers} of 33 layers fit in the 3.00 GiB free on CUDA0")
    # per layer: 4 GiB / 33 + 1 GiB / 32; room: 0.9 x 3 GiB - 0.5 GiB
    per_layer = 4 * GIB / 33 + GIB / 32
    assert layers == int((0.9 * 3 * GIB - GIB / 2) // per_layer)
    assert (
        plan_offload(99, can_offload=True, n_layer=32, need=NEED, gpus=[("CUDA0", 3 * GIB)])[0]
        == layers
    )  # 99 means all: fitted too


def test_an_explicit_count_is_kept_and_cpu_builds_offload_nothing() -> None:
    assert plan_offload(10, can_offload=True, n_layer=32, need=NEED,
                        gpus=[("CUDA0", GIB)]) == (10, "10 of 33 layers on CUDA0, as asked")  # fmt: skip
    assert plan_offload(-1, can_offload=False, n_layer=32, need=NEED, gpus=[]) == (
        0, "CPU-only build")  # fmt: skip
    assert plan_offload(0, can_offload=True, n_layer=32, need=NEED, gpus=[("CUDA0", GIB)])[0] == 0
    assert fit_gpu_layers(NEED, 32, GIB // 4) == 0  # not even the compute buffer fits


def test_devices_name_the_backend_gpu_and_build_as_llama_bench() -> None:
    devices = [CPU, H200]
    assert dv.gpu_info(devices) == "NVIDIA H200"
    assert dv.backends(devices) == "CUDA"
    assert dv.cpu_info(devices) == "AMD EPYC"
    assert dv.gpu_info([CPU]) == "" and dv.backends([CPU]) == "CPU"
    assert dv.build_commit("abc1234-dirty") == "abc1234"
    assert dv.describe_gpus(devices, True) == "CUDA0 NVIDIA H200 (140.0 of 141.0 GiB free)"


def test_system_report_uses_the_device_query(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dv, "QUERY", FakeQuery([CPU, H200]))
    system = SystemInfo.collect(bandwidth=False)
    assert (system.gpu_info, system.backends, system.build_commit) == (
        "NVIDIA H200", "CUDA", "abc1234")  # fmt: skip
    assert system.gpu.startswith("CUDA0 NVIDIA H200")


def nvidia_files(path: str) -> str | None:
    files = {"/proc/driver/nvidia/gpus/0000:01:00.0/information":
             "Model: \t\t NVIDIA H200\nIRQ: 42\n"}  # fmt: skip
    return files.get(path)


def test_gpus_on_the_machine_are_found_from_driver_files() -> None:
    found = dv.host_gpus(read=nvidia_files, exists=lambda p: False, system="Linux",
                         listdir=lambda p: ["0000:01:00.0"] if "nvidia" in p else [])  # fmt: skip
    assert found == [("NVIDIA H200", "cuda")]
    amd = dv.host_gpus(read=lambda p: "0x1002\n" if p.endswith("vendor") else None,
                       exists=lambda p: p == "/dev/kfd", system="Linux",
                       listdir=lambda p: ["card0", "card0-DP-1"] if "drm" in p else [])  # fmt: skip
    assert amd == [("AMD GPU", "hip")]
    assert dv.host_gpus(read=lambda p: None, listdir=lambda p: [], exists=lambda p: False,
                        system="Darwin", machine="arm64") == [("Apple Silicon GPU", "metal")]  # fmt: skip
    assert dv.host_gpus(read=lambda p: None, listdir=lambda p: [], exists=lambda p: False,
                        system="Linux", machine="x86_64") == []  # fmt: skip


def test_a_gpu_with_a_cpu_only_build_gets_one_line_on_every_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(dv, "host_gpus", lambda: [("NVIDIA H200", "cuda")])
    monkeypatch.setattr(engine, "_noted", False)
    runner = FakeRunner()
    monkeypatch.setattr(engine, "RUNNER_FACTORY", lambda model, config: runner)
    result = CliRunner().invoke(app, ["run", "hello there", "--no-dashboard"])
    assert result.exit_code == 0, result.stderr
    notes = [ln for ln in result.stderr.splitlines() if ln.startswith("llmrun: note:")]
    assert notes == ["llmrun: note: this machine has NVIDIA H200, but this llama.cpp build is"
                     " CPU-only, so every figure is the CPU's; rebuild with it: make clean &&"
                     " make GPU=cuda"]  # fmt: skip
    assert "none (CPU-only build): this machine has NVIDIA H200" in dv.describe_gpus(
        [CPU], False, [("NVIDIA H200", "cuda")]
    )


def test_the_summary_names_the_device_and_the_layers_on_it() -> None:
    st = dataclasses.replace(FAKE_SETTINGS, backend="CUDA0", device="CUDA0 NVIDIA H200",
                             n_gpu_layers=31, n_layer_total=31, device_memory_bytes=GIB,
                             n_threads=2, n_batch=512)  # fmt: skip
    assert (
        engine_text(st)
        == "CUDA0 NVIDIA H200 · ngl 31/31 · 1.00 GiB on the device · CPU 2t · batch 512"
    )
    assert engine_text(FAKE_SETTINGS) == "CPU 1t · batch 4 · ngl 0"


def test_gpu_split_options_reach_llama_cpp_on_a_gpu_build(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, model_path: str
) -> None:
    """A build that says it can offload (faked) takes -sm, -mg and -ts into the model
    parameters, read back into the records as llama-bench writes them."""
    import llama_cpp

    monkeypatch.setenv("LLMRUN_HOME", str(tmp_path))
    monkeypatch.setattr(llama_cpp, "llama_supports_gpu_offload", lambda: True)
    result = CliRunner().invoke(app, ["bench", "-p", "8", "-n", "0", "-r", "1", "--no-history",
                                      "-sm", "row,layer", "-mg", "0", "-ts", "3/1", "-o", "json"])  # fmt: skip
    assert result.exit_code == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [(r["split_mode"], r["main_gpu"], r["tensor_split"]) for r in rows] == [
        ("row", 0, "3.00/1.00"), ("layer", 0, "3.00/1.00")]  # fmt: skip
    assert all(r["n_gpu_layers_offloaded"] == 0 for r in rows)  # no device to put them on
    missing = CliRunner().invoke(app, ["bench", "-p", "8", "-n", "0", "-r", "1", "--no-history",
                                       "-dev", "CUDA1", "-o", "json"])  # fmt: skip
    assert missing.exit_code == 1 and "no device 'CUDA1'" in missing.stderr


def test_tensor_overrides_and_cpu_moe_reach_llama_cpp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model_path: str
) -> None:
    monkeypatch.setenv("LLMRUN_HOME", str(tmp_path))
    result = CliRunner().invoke(app, ["bench", "-p", "8", "-n", "0", "-r", "1", "--no-history",
                                      "-ot", "ffn_.*=CPU", "-ncmoe", "0,2", "-o", "json"])  # fmt: skip
    assert result.exit_code == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [(r["tensor_buft_overrides"], r["n_cpu_moe"]) for r in rows] == [
        ("ffn_.*=CPU", 0), ("ffn_.*=CPU", 2)]  # fmt: skip
    for bad, says in ((["-ot", "ffn_.*"], "is not PATTERN=BUFFER"), (["-ot", "x=NOPE"],
                      "no buffer type 'NOPE'"), (["-dev", "CUDA0"], "no GPU backend")):  # fmt: skip
        refused = CliRunner().invoke(app, ["bench", "-p", "8", "-n", "0", "-r", "1",
                                           "--no-history", *bad, "-o", "json"])  # fmt: skip
        assert refused.exit_code == 1 and says in refused.stderr, refused.stderr
