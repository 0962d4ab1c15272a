"""GPU code paths, checked without a GPU: fakes stand in for the device queries."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import io
import json
import math
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from llmrun.cli import engine
from llmrun.cli.app import app
from llmrun.cli.bench.machine import system_rows
from llmrun.cli.bench.output import efficiency_lines
from llmrun.cli.report import engine_text
from llmrun.runners import devices as dv
from llmrun.runners import system as system_module
from llmrun.runners.base import Request, SamplingParams, generate
from llmrun.runners.bench.results import Result, Row
from llmrun.runners.bench.sweep import Combo, Shape
from llmrun.runners.config import EngineConfig
from llmrun.runners.gguf import read_gguf
from llmrun.runners.limits import MemoryNeed, fit_gpu_layers, plan_offload
from llmrun.runners.llamacpp import LlamaCppRunner
from llmrun.runners.serving import load as sv
from llmrun.runners.serving.figures import RequestResult, metrics
from llmrun.runners.stats import ModelInfo
from llmrun.runners.system import SystemInfo, decode_bandwidth, weights_memories

from .conftest import HANG_S, ROOT
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

    def bandwidth(self, device: dv.Device) -> dv.DeviceBandwidth | None:
        return dv.driver_figures(device.name, 3201, 6144) if device.is_gpu else None


def test_all_layers_go_to_a_gpu_with_room() -> None:
    layers, note = plan_offload(
        -1, can_offload=True, n_layer=32, need=NEED, gpus=[("CUDA0", 80 * GIB)]
    )
    assert layers == -1 and note == "all 33 layers on CUDA0"


def test_a_small_gpu_gets_the_layers_that_fit_and_says_so() -> None:
    layers, note = plan_offload(
        -1, can_offload=True, n_layer=32, need=NEED, gpus=[("CUDA0", 3 * GIB)]
    )
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
    assert plan_offload(10, can_offload=True, n_layer=32, need=NEED, gpus=[("CUDA0", GIB)]) == (
        10,
        "10 of 33 layers on CUDA0, as asked",
    )
    assert plan_offload(-1, can_offload=False, n_layer=32, need=NEED, gpus=[]) == (
        0,
        "CPU-only build",
    )
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


@pytest.mark.parametrize(
    ("devices", "lines"),
    [  # llama.cpp's common_print_available_devices: CPU devices are not listed, as -dev cannot
        # name them; memory in whole MiB, total first
        ([CPU], ["Available devices:", "  (none)"]),
        (
            [CPU, H200, dv.Device("BLAS", "OpenBLAS", "ACCEL", "BLAS")],
            [
                "Available devices:",
                "  CUDA0: NVIDIA H200 (144384 MiB, 143360 MiB free)",
                "  BLAS: OpenBLAS (0 MiB, 0 MiB free)",
            ],
        ),
    ],
)
def test_list_devices_prints_what_llama_bench_prints(
    monkeypatch: pytest.MonkeyPatch, devices: list[dv.Device], lines: list[str]
) -> None:
    monkeypatch.setattr(dv, "QUERY", FakeQuery(devices))
    result = CliRunner().invoke(app, ["bench", "--list-devices"])
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == lines


def test_system_report_uses_the_device_query(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dv, "QUERY", FakeQuery([CPU, H200]))
    system = SystemInfo.collect(bandwidth=False)
    assert (system.gpu_info, system.backends, system.build_commit) == (
        "NVIDIA H200",
        "CUDA",
        "abc1234",
    )
    assert system.gpu.startswith("CUDA0 NVIDIA H200")


def nvidia_files(path: str) -> str | None:
    files = {
        "/proc/driver/nvidia/gpus/0000:01:00.0/information": "Model: \t\t NVIDIA H200\nIRQ: 42\n"
    }
    return files.get(path)


def test_gpus_on_the_machine_are_found_from_driver_files() -> None:
    found = dv.host_gpus(
        read=nvidia_files,
        exists=lambda p: False,
        system="Linux",
        listdir=lambda p: ["0000:01:00.0"] if "nvidia" in p else [],
    )
    assert found == [("NVIDIA H200", "cuda")]
    amd = dv.host_gpus(
        read=lambda p: "0x1002\n" if p.endswith("vendor") else None,
        exists=lambda p: p == "/dev/kfd",
        system="Linux",
        listdir=lambda p: ["card0", "card0-DP-1"] if "drm" in p else [],
    )
    assert amd == [("AMD GPU", "hip")]
    assert dv.host_gpus(
        read=lambda p: None,
        listdir=lambda p: [],
        exists=lambda p: False,
        system="Darwin",
        machine="arm64",
    ) == [("Apple Silicon GPU", "metal")]
    assert (
        dv.host_gpus(
            read=lambda p: None,
            listdir=lambda p: [],
            exists=lambda p: False,
            system="Linux",
            machine="x86_64",
        )
        == []
    )


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
    assert notes == [
        "llmrun: note: this machine has NVIDIA H200, but this llama.cpp build is"
        " CPU-only, so every figure is the CPU's; rebuild with it: make clean &&"
        " make GPU=cuda"
    ]
    assert "none (CPU-only build): this machine has NVIDIA H200" in dv.describe_gpus(
        [CPU], False, [("NVIDIA H200", "cuda")]
    )


def test_the_summary_names_the_device_and_the_layers_on_it() -> None:
    st = dataclasses.replace(
        FAKE_SETTINGS,
        backend="CUDA0",
        device="CUDA0 NVIDIA H200",
        n_gpu_layers=31,
        n_layer_total=31,
        device_memory_bytes=GIB,
        n_threads=2,
        n_batch=512,
    )
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
    result = CliRunner().invoke(
        app,
        [
            "bench",
            "-p",
            "8",
            "-n",
            "0",
            "-r",
            "1",
            "--no-history",
            "-sm",
            "row,layer",
            "-mg",
            "0",
            "-ts",
            "3/1",
            "-o",
            "json",
        ],
    )
    assert result.exit_code == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [(r["split_mode"], r["main_gpu"], r["tensor_split"]) for r in rows] == [
        ("row", 0, "3.00/1.00"),
        ("layer", 0, "3.00/1.00"),
    ]
    assert all(r["n_gpu_layers_offloaded"] == 0 for r in rows)  # no device to put them on
    missing = CliRunner().invoke(
        app,
        ["bench", "-p", "8", "-n", "0", "-r", "1", "--no-history", "-dev", "CUDA1", "-o", "json"],
    )
    assert missing.exit_code == 1 and "no device 'CUDA1'" in missing.stderr


def test_tensor_overrides_and_cpu_moe_reach_llama_cpp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model_path: str
) -> None:
    monkeypatch.setenv("LLMRUN_HOME", str(tmp_path))
    result = CliRunner().invoke(
        app,
        [
            "bench",
            "-p",
            "8",
            "-n",
            "0",
            "-r",
            "1",
            "--no-history",
            "-ot",
            "ffn_.*=CPU",
            "-ncmoe",
            "0,2",
            "-o",
            "json",
        ],
    )
    assert result.exit_code == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [(r["tensor_buft_overrides"], r["n_cpu_moe"]) for r in rows] == [
        ("ffn_.*=CPU", 0),
        ("ffn_.*=CPU", 2),
    ]
    for bad, says, code in (
        (["-ot", "ffn_.*"], "is not PATTERN=BUFFER", 2),  # a usage error, before any load
        (["-ot", "a=CPU;ffn_.*"], "'ffn_.*' is not PATTERN=BUFFER", 2),
        (["-ot", "x=NOPE"], "no buffer type 'NOPE'", 1),  # this build's: each test skipped
        (["-dev", "CUDA0"], "no GPU backend", 1),
    ):
        refused = CliRunner().invoke(
            app, ["bench", "-p", "8", "-n", "0", "-r", "1", "--no-history", *bad, "-o", "json"]
        )
        said = " ".join(refused.stderr.split())  # the skip line wraps at the console's width
        assert refused.exit_code == code and says in said, refused.stderr


# ---- bandwidth: the memory the weights are in (issue 20: a false 2,100 %) ------------------

HOST_BW = 66e9  # the H200 host's RAM, as the issue measured it
H200_BW = dv.driver_figures("CUDA0", 3201, 6144)
MACHINE = SystemInfo(
    cpu="Xeon",
    physical_cores=16,
    logical_cpus=32,
    ram_bytes=None,
    build="",
    features="",
    gpu="",
    mem_bw_bytes_s=HOST_BW,
    device_bandwidths=(H200_BW,),
)
BYTES_PER_TOKEN = 4.0e9  # an 8B Q4_0's weights and KV cache


def test_the_driver_figure_is_clock_times_bus_width_times_two() -> None:
    assert dv.driver_bandwidth(3201, 6144) == 3201e6 * 2 * 768 == H200_BW.bytes_s
    assert H200_BW.source == "driver: 3,201 MHz x 6,144-bit bus x 2"


def test_all_layers_on_the_gpu_measure_decode_against_its_memory() -> None:
    """The issue's case: decode moved 1,393 GB/s; against the host's 66 GB/s that read 21.03."""
    where = weights_memories(MACHINE, devices="CUDA0", n_offloaded=33, n_layers=33)
    assert [(m.name, m.share) for m in where] == [("CUDA0", 1.0)]
    fields = decode_bandwidth(where, BYTES_PER_TOKEN, 1393e9 / BYTES_PER_TOKEN)
    assert fields == {
        "bw_util": round(1393e9 / H200_BW.bytes_s, 4),  # 0.2833, not 21.03
        "weights_bw_gbs": round(H200_BW.bytes_s / 1e9, 3),
        "decode_roofline_ts": round(H200_BW.bytes_s / BYTES_PER_TOKEN, 3),
        "mem_bw_source": "CUDA0 100% of the weights, 4,916.7 GB/s (driver: 3,201 MHz x 6,144-bit"
        " bus x 2)",
    }


def test_weights_on_the_cpu_keep_the_host_figure_and_a_split_names_both() -> None:
    cpu = weights_memories(MACHINE, devices="CPU", n_offloaded=0, n_layers=33)
    assert [(m.name, m.share, m.bytes_s) for m in cpu] == [("RAM", 1.0, HOST_BW)]
    assert decode_bandwidth(cpu, BYTES_PER_TOKEN, 10.0)["bw_util"] == round(
        10 * BYTES_PER_TOKEN / HOST_BW, 4
    )
    split = weights_memories(MACHINE, devices="CUDA0", n_offloaded=11, n_layers=33)
    assert [(m.name, round(m.share, 4)) for m in split] == [("RAM", 0.6667), ("CUDA0", 0.3333)]
    fields = decode_bandwidth(split, BYTES_PER_TOKEN, 20.0)
    per_token_s = (2 / 3) * BYTES_PER_TOKEN / HOST_BW + (1 / 3) * BYTES_PER_TOKEN / H200_BW.bytes_s
    assert fields["bw_util"] == round(20 * per_token_s, 4)
    assert fields["decode_roofline_ts"] == round(1 / per_token_s, 3)
    assert HOST_BW / 1e9 < fields["weights_bw_gbs"] < 1.5 * HOST_BW / 1e9  # the RAM dominates
    assert fields["mem_bw_source"] == (
        "RAM 67% of the weights, 66.0 GB/s (streaming copy on the CPU, read + write); CUDA0 33% of"
        " the weights, 4,916.7 GB/s (driver: 3,201 MHz x 6,144-bit bus x 2)"
    )
    two = weights_memories(MACHINE, devices="CUDA0, CUDA1", n_offloaded=33, n_layers=33)
    assert [(m.name, m.share) for m in two] == [("CUDA0", 0.5), ("CUDA1", 0.5)]


def test_an_unmeasured_device_gives_no_share_rather_than_the_hosts() -> None:
    bare = dataclasses.replace(MACHINE, device_bandwidths=())
    where = weights_memories(bare, devices="CUDA0", n_offloaded=33, n_layers=33)
    fields = decode_bandwidth(where, BYTES_PER_TOKEN, 348.0)
    assert fields["bw_util"] is None and fields["decode_roofline_ts"] is None
    assert fields["mem_bw_source"] == "CUDA0 100% of the weights, not measured"


def test_the_report_probes_each_gpu_and_the_record_uses_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dv, "QUERY", FakeQuery([CPU, H200]))
    monkeypatch.setattr(system_module, "memory_bandwidth_runs", lambda: [HOST_BW] * 3)
    system = SystemInfo.collect(bandwidth=True)
    assert system.device_bandwidths == (H200_BW,) and system.mem_bw_bytes_s == HOST_BW
    assert SystemInfo.collect(bandwidth=False).device_bandwidths == ()
    st = dataclasses.replace(
        FAKE_SETTINGS,
        backend="CUDA0",
        device="CUDA0 NVIDIA H200",
        n_gpu_layers=33,
        n_layer_total=33,
    )
    model = ModelInfo(
        path="8b.gguf",
        name="8b",
        architecture="llama",
        quantization="Q4_0",
        n_params=8_030_261_248,
        size_bytes=int(BYTES_PER_TOKEN),
        n_ctx_train=None,
        has_chat_template=True,
    )
    tg = Result(
        shape=Shape(0, 128),
        combo=Combo(),
        model=model,
        settings=st,
        load_s=1.0,
        samples_s=(128 / 348.0,),
        engine_samples_s=(),
    )
    rec = tg.record(system)
    assert rec["bw_util"] == round(rec["decode_bw_gbs"] * 1e9 / H200_BW.bytes_s, 4) < 1
    assert rec["mem_bw_source"].startswith("CUDA0 100% of the weights, 4,916.7 GB/s (driver:")
    line = efficiency_lines([Row.of(tg, rec)])[0]
    assert line.startswith(f"tg128: decode moves {rec['decode_bw_gbs']:.1f} GB/s")
    assert f"= {rec['bw_util']:.0%} of 4,916.7 GB/s, the memory the weights are in (CUDA0" in line
    rows = dict(system_rows(system, "8b"))
    assert rows["memory"].endswith(
        "(streaming copy) · CUDA0 4,916.7 GB/s (driver: 3,201 MHz x 6,144-bit bus x 2)"
    )
    pp = dataclasses.replace(tg, shape=Shape(512, 0)).record(system)
    assert pp["bw_util"] is None and "mem_bw_source" in pp  # the same columns in every record


def test_a_timed_copy_through_ggml_runs_on_a_real_device() -> None:
    """The probe's ctypes path, on the CPU device here (on a GPU: a device-to-device copy)."""
    runs = dv.copy_bandwidth_runs("CPU", size_bytes=8 << 20, reps=2)
    assert len(runs) == 2 and all(r > 0 for r in runs)
    assert dv.copy_bandwidth_runs("CUDA7", size_bytes=1 << 20) == []
    cpu = next(d for d in dv.query().devices() if d.kind == "CPU")
    assert dv.query().bandwidth(cpu) is None  # the host's RAM has its own probe


# ---- benchmarks/gpu.py and benchmarks/synth_gguf.py: the check for a GPU machine -----------


def _load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


synth = _load("synth_gguf")
gpu = _load("gpu")


def test_the_shapes_have_the_real_models_parameter_counts() -> None:
    """SmolLM2-135M, Llama-3.2-1B and Llama-3.1-8B as published (their vocabularies)."""
    for shape, n_vocab, n_params in (
        ("135m", 49152, 134_515_008),
        ("1b", 128256, 1_235_814_400),
        ("8b", 128256, 8_030_261_248),
    ):
        plan = synth.tensors(synth.SHAPES[shape], n_vocab)
        assert sum(math.prod(t.dims) for t in plan) == n_params, shape
    # tied embeddings: no output.weight; an 8B has one
    assert "output.weight" not in {t.name for t in synth.tensors(synth.SHAPES["1b"], 10)}
    assert "output.weight" in {t.name for t in synth.tensors(synth.SHAPES["8b"], 10)}


def test_strip_keeps_the_tokenizer_and_template_and_drops_the_tensors(
    model_path: str, tmp_path: Path
) -> None:
    tok = tmp_path / "tok.gguf"
    size = synth.strip(Path(model_path), tok)
    assert size == tok.stat().st_size < 4 << 20  # the 93 MB model's header alone
    assert synth.read_metadata(tok) == synth.read_metadata(Path(model_path))
    info = read_gguf(tok)
    assert info.n_tensors == 0 and info.chat_template == read_gguf(model_path).chat_template
    with pytest.raises(ValueError, match="not a GGUF file"):
        synth.read_metadata(ROOT / "README.md")
    with pytest.raises(ValueError, match="unknown shape"):
        synth.write_model(tok, "3b", tmp_path / "x.gguf")


@pytest.mark.model
def test_a_synthetic_135m_model_loads_and_generates(model_path: str, tmp_path: Path) -> None:
    """The real engine (CPU build) loads the file and samples tokens with its chat template."""
    tok, out = tmp_path / "tok.gguf", tmp_path / "135m.gguf"
    synth.strip(Path(model_path), tok)
    assert synth.main(["make", str(tok), "135m", str(out)]) == 0
    info = read_gguf(out)  # llmrun's own checks: every tensor inside the file
    assert (info.architecture, info.quantization, info.n_params) == ("llama", "Q4_0", 134_515_008)
    assert info.metadata["general.name"] == "synthetic-135m"
    assert info.chat_template == read_gguf(model_path).chat_template
    runner = LlamaCppRunner(str(out), EngineConfig(n_ctx=128))
    try:
        sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        result = generate(runner, Request.chat("Hello", sampling=sp))
    finally:
        runner.close()
    assert result.stats.output_tokens == 6 and result.stats.prompt_tokens > 5


def _fake_sdist(folder: Path) -> Path:
    """A small llama-cpp-python sdist: what the bundle keeps and what it trims."""
    top = "llama_cpp_python-9.9.9/"
    long_name = (
        "ggml/src/ggml-cuda/template-instances/" + "fattn-vec-instance-" + "f16" * 30 + ".cu"
    )
    files = {
        "vendor/llama.cpp/CMakeLists.txt": "project(llama)\n",
        "vendor/llama.cpp/tools/llama-bench/llama-bench.cpp": "int main() {}\n",
        "vendor/llama.cpp/tools/batched-bench/batched-bench.cpp": "int main() {}\n",
        "vendor/llama.cpp/" + long_name: "// over tar's 100-character names\n",
        "vendor/llama.cpp/scripts/compare-llama-bench.py": "\n",
        "vendor/llama.cpp/models/ggml-vocab-llama.gguf": "x" * 5000,
        "vendor/llama.cpp/docs/build.md": "\n",
        "vendor/llama.cpp/tests/test-backend-ops.cpp": "\n",
        "vendor/llama.cpp/examples/simple/simple.cpp": "\n",
        "vendor/llama.cpp/tools/ui/index.html": "\n",
        "vendor/llama.cpp/ggml/src/ggml-vulkan/ggml-vulkan.cpp": "\n",
        "vendor/llama.cpp/convert_hf_to_gguf.py": "\n",
        "llama_cpp/llama.py": "\n",
        "llama_cpp/server/app.py": "\n",
        "llama_cpp/lib/libllama.so": "ELF",
        "tests/test_llama.py": "\n",
        "pyproject.toml": "\n",
    }
    path = folder / "llama_cpp_python-9.9.9.tar.gz"
    with tarfile.open(path, "w:gz", format=tarfile.PAX_FORMAT) as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(top + name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _names(archive: Path) -> set[str]:
    with tarfile.open(archive) as tar:
        return set(tar.getnames())


def _bundle_sources(model_path: str, tmp_path: Path) -> Any:
    (tmp_path / "sdist").mkdir()
    sdist = _fake_sdist(tmp_path / "sdist")
    fetched: list[list[str]] = []

    def wheels(pins: list[str], folder: Path) -> None:
        fetched.append(list(pins))
        for pin in pins:
            name, version = pin.split("==")
            (folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl").write_bytes(b"PK")

    sources = gpu.Sources(
        version="9.9.9",
        tokenizer_model=Path(model_path),
        sdist=lambda version, folder: sdist,
        pins=gpu.installed_pins,
        wheels=wheels,
    )
    return sources, fetched


def test_prepare_bundles_a_trimmed_source_the_bindings_wheels_and_the_project(
    model_path: str, tmp_path: Path
) -> None:
    sources, fetched = _bundle_sources(model_path, tmp_path)
    bundle = tmp_path / "bundle"
    log = io.StringIO()
    total = gpu.prepare(bundle, sources, log=log)
    files = [p for p in bundle.rglob("*") if p.is_file()]
    assert total == sum(p.stat().st_size for p in files)
    assert f"bundle: {total / 2**20:,.1f} MiB in all" in log.getvalue()
    long_name = "llama.cpp/ggml/src/ggml-cuda/template-instances/fattn-vec-instance-" + "f16" * 30
    assert _names(bundle / "llama.cpp.tgz") == {
        "llama.cpp/CMakeLists.txt",
        "llama.cpp/tools/llama-bench/llama-bench.cpp",
        "llama.cpp/tools/batched-bench/batched-bench.cpp",
        long_name + ".cu",
        "llama.cpp/scripts/compare-llama-bench.py",
    }
    assert _names(bundle / "llama_cpp.tgz") == {"llama_cpp/llama.py", "llama_cpp/server/app.py"}
    project = _names(bundle / "project.tgz")
    assert {
        "project/benchmarks/gpu.py",
        "project/benchmarks/synth_gguf.py",
        "project/runners/system.py",
        "project/pyproject.toml",
    } <= project
    assert not any("/.venv/" in n or "/.git/" in n or n.startswith("project/.gpu") for n in project)
    # the wheels llmrun needs at run time, pinned to what runs here; not what the image has
    pins = dict(p.split("==") for p in fetched[0])
    assert pins["typer"] == importlib.metadata.version("typer")
    assert "mdurl" in pins  # rich -> markdown-it-py -> mdurl: the closure, two levels down
    assert not {"numpy", "llama-cpp-python", "huggingface-hub"} & set(pins)
    assert len(list((bundle / "wheels").glob("*.whl"))) == len(pins)
    assert synth.read_metadata(bundle / "tokenizer.gguf") == synth.read_metadata(Path(model_path))
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["llama_cpp_python"] == "9.9.9" and manifest["wheels"] == fetched[0]


def test_prepare_refuses_a_bundle_over_its_limit_and_a_wrong_archive(
    model_path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sources, _ = _bundle_sources(model_path, tmp_path)
    monkeypatch.setattr(gpu, "BUNDLE_LIMIT_BYTES", 1 << 20)  # the tokenizer alone is 1.7 MiB
    with pytest.raises(ValueError, match="over its 1 MiB limit"):
        gpu.prepare(tmp_path / "b1", sources, log=io.StringIO())
    other = tmp_path / "other.tar.gz"
    with tarfile.open(other, "w:gz") as tar:
        tar.add(ROOT / "README.md", arcname="x-1/README.md")
    with pytest.raises(ValueError, match="not a llama-cpp-python source distribution"):
        gpu.split_sdist(other, tmp_path)


def test_prepare_prints_the_bundle_folder_last(
    model_path: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    (tmp_path / "s").mkdir()
    sdist = _fake_sdist(tmp_path / "s")
    monkeypatch.setattr(gpu, "download_wheels", lambda pins, folder: None)
    bundle = tmp_path / "b"
    assert gpu.main(["--prepare", "--bundle", str(bundle), "--sdist", str(sdist)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == str(bundle)
    assert (bundle / "llama.cpp.tgz").exists()


def test_the_trimmed_tree_keeps_what_the_build_reads() -> None:
    keep = [
        "CMakeLists.txt",
        "ggml/src/ggml-cuda/fattn.cu",
        "ggml/src/ggml-cpu/ops.cpp",
        "tools/llama-bench/llama-bench.cpp",
        "tools/batched-bench/batched-bench.cpp",
        "common/arg.cpp",
        "src/llama.cpp",
        "vendor/nlohmann/json.hpp",
        "cmake/common.cmake",
        "tools/mtmd/CMakeLists.txt",
        "scripts/compare-llama-bench.py",
        "models-readme.txt",
    ]
    drop = [
        "models/ggml-vocab-llama-bpe.gguf",
        "docs/build.md",
        "tests/CMakeLists.txt",
        "examples/simple/simple.cpp",
        "tools/ui/package.json",
        "ggml/src/ggml-vulkan/x.cpp",
        "ggml/src/ggml-metal/ggml-metal.m",
        "convert_hf_to_gguf.py",
        "gguf-py/gguf/gguf.py",
    ]
    assert all(gpu.keep_llama_cpp(p) for p in keep)
    assert not any(gpu.keep_llama_cpp(p) for p in drop)
    assert gpu.keep_binding("llama_cpp/llama_cpp.py") and not gpu.keep_binding(
        "llama_cpp/lib/libllama.so"
    )


def test_wheel_pins_follow_requirements_for_linux_cpython_312() -> None:
    graph = {
        "llmrun": ["typer>=0.12", "llama-cpp-python>=0.3", "numpy"],
        "typer": [
            "pydantic>=2",
            "colorama; platform_system == 'Windows'",
            "rich>=13; python_version < '3.13'",
            "pytest; extra == 'test'",
        ],
        "pydantic": ["typing-extensions>=4"],
        "rich": [],
        "typing-extensions": None,
        "llama-cpp-python": ["diskcache"],
    }
    versions = {
        "llmrun": "0.1",
        "typer": "0.29",
        "pydantic": "2.14",
        "rich": "15",
        "typing-extensions": "4.16",
        "colorama": "0.4",
        "pytest": "9",
    }
    pins = gpu.wheel_pins(["llmrun"], graph.get, versions.get)
    assert pins == [
        "llmrun==0.1",
        "pydantic==2.14",
        "rich==15",
        "typer==0.29",
        "typing-extensions==4.16",
    ]
    with pytest.raises(ValueError, match="rich is needed on the GPU machine"):
        gpu.wheel_pins(
            ["typer"], graph.get, {"typer": "1", "pydantic": "2", "typing-extensions": "4"}.get
        )


def test_the_gpu_is_read_from_nvidia_smi() -> None:
    found = gpu.parse_gpus("NVIDIA H200, 9.0, 143771\nNVIDIA GeForce RTX 4090, 8.9, 24564\n")
    assert found == [
        gpu.Gpu("NVIDIA H200", "9.0", 143771),
        gpu.Gpu("NVIDIA GeForce RTX 4090", "8.9", 24564),
    ]
    assert [g.cuda_arch for g in found] == ["90-real", "89-real"]
    assert gpu.parse_gpus("No devices were found\n") == []


LAYOUT = gpu.Layout(Path("/b"), Path("/w"))


def test_the_plan_builds_for_the_gpu_then_measures_both_tools_with_the_same_flags() -> None:
    wheels = ["/b/wheels/typer-0.29.2-py3-none-any.whl"]
    steps = gpu.plan("90-real", LAYOUT, gpu.Options(python="py", jobs=16), wheels)
    by_label = {s.label: s for s in steps}
    configure = by_label["configure llama.cpp"].argv
    assert "-DCMAKE_CUDA_ARCHITECTURES=90-real" in configure and "-DGGML_CUDA_FA=ON" in configure
    assert "-DGGML_CUDA=ON" in configure and "-DBUILD_SHARED_LIBS=ON" in configure
    build = by_label["build llama.cpp"].argv
    assert build[-3:] == ("--target", "llama-bench", "llama-batched-bench")
    assert by_label["install the wheels"].argv[-1] == wheels[0]
    labels = [s.label for s in steps]
    # set-up before use: the libraries after the build, each model before its first run
    assert labels.index("build llama.cpp") < labels.index("put the libraries under the bindings")
    for shape in ("135m", "1b", "8b"):
        made = labels.index(f"write the {shape} model")
        runs = [i for i, s in enumerate(steps) if s.reads and f"/w/models/{shape}.gguf" in s.argv]
        assert runs and made < min(runs) and made > labels.index("link the bindings and llmrun")
        # B A B, and llmrun gets llama-bench's very flags (pp512, tg128, all layers, FA on)
        trio = [
            s
            for s in steps
            if s.key == shape and s.reads.endswith("bench") and "batched" not in s.reads
        ]
        assert [s.reads for s in trio] == ["llama-bench", "llmrun-bench", "llama-bench"]
        lb, lr = trio[0].argv, trio[1].argv
        assert lb[0] == "/w/llama.cpp/build/bin/llama-bench"
        assert lr[lr.index("bench") + 1 :] == (*lb[1:], "--no-history", "--no-tuned")
        assert (
            lb[3:7] == ("-p", "512", "-n", "128") and "-fa" in lb and lb[lb.index("-fa") + 1] == "1"
        )
    cpu = [s for s in steps if s.key == "cpu-1b"]
    assert [s.argv[s.argv.index("-ngl") + 1] for s in cpu] == ["0", "0", "0"]
    batched = next(s for s in steps if s.reads == "batched-bench").argv
    assert batched[batched.index("-npl") + 1] == "1,8,32"
    assert int(batched[batched.index("-c") + 1]) >= 32 * (256 + 64)
    serve = next(s for s in steps if s.reads == "llmrun-serve").argv
    assert serve[3:5] == ("bench", "serve")
    # the real CLI takes every option the plan gives it (--help: parsed, nothing run)
    for step in steps:
        if step.reads.startswith("llmrun"):
            args = list(step.argv[3:])
            parsed = CliRunner().invoke(app, [*args, "--help"])
            assert parsed.exit_code == 0, (args, parsed.stderr)
    refused = CliRunner().invoke(app, ["bench", "--concurrency", "1", "--help"])
    assert refused.exit_code != 0  # the check can fail: an option bench no longer has
    assert serve[serve.index("--concurrency") + 1] == "1,8,32"
    assert (
        serve[serve.index("--input-len") + 1] == "256"
        and serve[serve.index("--output-len") + 1] == "64"
    )
    off = gpu.plan(
        "90-real", LAYOUT, gpu.Options(python="py", flash_attn=False, cpu_shape=None), []
    )
    assert "-DGGML_CUDA_FA=OFF" in next(s for s in off if s.label == "configure llama.cpp").argv
    assert all(s.argv[s.argv.index("-fa") + 1] in ("0", "off") for s in off if "-fa" in s.argv)
    assert not any(s.key.startswith("cpu") for s in off)


def test_the_cpu_row_turns_repacking_off_for_both_tools_on_a_host_with_amx(
    tmp_path: Path,
) -> None:
    """The CPU row ran llama-bench with repacking on (its default): on an Intel Xeon with AMX
    it dies by SIGILL there (tests/llama_tools.cpu_flags), and llmrun's probe would have
    turned it off for llmrun alone. Both tools now get the same --repack, read from the host's
    CPU flags."""
    amx, plain = tmp_path / "amx", tmp_path / "plain"
    amx.write_text("processor\t: 0\nflags\t\t: fpu avx512f amx_bf16 amx_tile amx_int8\n")
    plain.write_text("processor\t: 0\nflags\t\t: fpu avx512f amx_tilex\nbugs\t: amx_tile\n")
    assert gpu.host_has_amx(str(amx)) and not gpu.host_has_amx(str(plain))
    assert not gpu.host_has_amx(str(tmp_path / "missing"))
    for repack, flag in ((False, "0"), (True, "1")):
        opts = gpu.Options(python="py", cpu_repack=repack)
        rows = [s for s in gpu.plan("90-real", LAYOUT, opts, []) if s.key.startswith("cpu")]
        assert len(rows) == 3  # B A B
        assert all(s.argv[s.argv.index("--repack") + 1] == flag for s in rows), rows
    assert gpu.Options().cpu_repack  # the plain default; check() reads the host's flags


def test_every_benchmark_script_ends_through_one_exit_and_ctrl_c_is_130(
    tmp_path: Path, llmrun_env: dict[str, str]
) -> None:
    """Ctrl-C on a benchmark script was a KeyboardInterrupt traceback; each script now ends
    through benchmarks/script.run: one line, exit 130, after its own clean-up."""
    scripts = sorted((ROOT / "benchmarks").glob("*.py"))
    for path in scripts:
        if path.name != "script.py":
            assert "    script.run(main)\n" in path.read_text(), path.name
    stand_in = tmp_path / "slow.py"
    stand_in.write_text(
        "import sys, time\n"
        f"sys.path.insert(0, {str(ROOT / 'benchmarks')!r})\n"
        "import script\n"
        "def main():\n"
        "    try:\n"
        "        raise KeyboardInterrupt\n"
        "    finally:\n"
        "        print('cleaned up')\n"
        "script.run(main)\n"
    )
    done = subprocess.run(
        [sys.executable, str(stand_in)], capture_output=True, text=True, timeout=HANG_S
    )
    assert (done.returncode, done.stdout, done.stderr) == (
        130,
        "cleaned up\n",
        "slow.py: interrupted\n",
    )


def _jsonl(*rows: dict[str, Any]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def test_the_ratios_come_from_the_tools_output() -> None:
    opts = gpu.Options(shapes=("8b",), cpu_shape=None)
    steps = {s.label: s for s in gpu.plan("90-real", LAYOUT, opts, [])}
    res = gpu.Results()
    lb, lr = steps["8b: llama-bench"], steps["8b: llmrun bench"]
    res.read(
        lb,
        _jsonl(
            {"n_prompt": 512, "n_gen": 0, "avg_ts": 11000.0},
            {"n_prompt": 0, "n_gen": 128, "avg_ts": 356.0},
        ),
    )
    res.read(
        lr,
        "["
        + ",".join(
            json.dumps(r)
            for r in (
                {
                    "n_prompt": 512,
                    "n_gen": 0,
                    "avg_ts": 11110.0,
                    "engine_avg_ts": 11200.0,
                    "device": "CUDA0 NVIDIA H200",
                    "n_gpu_layers_offloaded": 33,
                },
                {
                    "n_prompt": 0,
                    "n_gen": 128,
                    "avg_ts": 335.0,
                    "engine_avg_ts": 348.0,
                    "bw_util": 0.31,
                    "decode_bw_gbs": 1500.0,
                    "weights_bw_gbs": 4915.2,
                    "mem_bw_source": "driver",
                    "device": "CUDA0 NVIDIA H200",
                    "n_gpu_layers_offloaded": 33,
                },
            )
        )
        + "]",
    )
    res.read(lb, _jsonl({"n_prompt": 0, "n_gen": 128, "avg_ts": 355.0}))
    res.read(
        steps["8b: llama-batched-bench"],
        "main: n_kv_max = 20736\n"
        + _jsonl(
            {"pl": 1, "tg": 64, "t_tg": 0.19, "speed": 1390.0},
            {"pl": 32, "tg": 64, "t_tg": 0.563, "speed": 8225.0},
        ),
    )
    levels = []
    for level, total_tps, itl_s in ((1, 1139.0, 0.0039), (32, 4636.0, 0.0168)):
        requests = [RequestResult(256, 64, 0.05, 1.0, [itl_s] * 63) for _ in range(64)]
        duration_s = 64 * (256 + 64) / total_tps
        measured = metrics(requests, duration_s, percentiles=[50], slo={})
        levels.append(
            sv.ServingLevel(
                "local prefill-first", "8b", level, math.inf, 64, 256, 64, measured
            ).record()
        )
    res.read(steps["8b: llmrun's serving lab"], json.dumps(levels))  # as llmrun writes them
    lines = gpu.ratio_lines(res, opts)
    assert lines[0] == (
        "8b shape, FA on, pp512: llmrun 11,110.0 / llama-bench 11,000.0 tok/s ="
        " x1.010; llama.cpp's counter in llmrun 11,200.0 (x1.018)"
    )
    assert lines[1] == (
        "8b shape, FA on, tg128: llmrun 335.0 / llama-bench 355.0-356.0 tok/s ="
        " x0.942; llama.cpp's counter in llmrun 348.0 (x0.979); target ≥ 0.98:"
        " MISSED"
    )
    assert lines[2] == "  llmrun ran on CUDA0 NVIDIA H200, 33 layers offloaded"
    assert lines[3] == "  bandwidth share 31%: 1500.0 GB/s of 4915.2 GB/s (driver)"
    assert lines[4].startswith(
        "8b serving, 1 at a time, 256 in / 64 out: llmrun 1,139 /"
        " llama-batched-bench 1,390 total tok/s = x0.819; ITL p50 3.90 ms"
        " against a decode step of 2.97 ms"
    )
    assert (
        lines[5] == "  at 1: ITL / plain decode (llama-bench tg128) = x1.386; target ≤ 1.05: MISSED"
    )
    assert lines[6].endswith(
        "= x0.564; ITL p50 16.80 ms against a decode step of 8.80 ms; target ≥ 0.90: MISSED"
    )
    assert len(lines) == 7 and gpu.offload_failures(res) == []
    res.read(
        lr,
        _jsonl(
            {
                "n_prompt": 0,
                "n_gen": 128,
                "avg_ts": 80.0,
                "device": "CPU",
                "n_gpu_layers_offloaded": 0,
            }
        ),
    )
    assert gpu.offload_failures(res) == [
        "8b tg128: llmrun ran on the CPU, -ngl 99 offloaded nothing"
    ]


def test_without_a_gpu_the_check_says_why_and_a_dry_run_shows_the_plan(
    tmp_path: Path, llmrun_env: dict[str, str]
) -> None:
    script = str(ROOT / "benchmarks" / "gpu.py")
    env = {**llmrun_env, "PATH": str(tmp_path)}  # no nvidia-smi
    done = subprocess.run(
        [sys.executable, script], capture_output=True, text=True, env=env, check=False
    )
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr == (
        "gpu.py: no NVIDIA GPU here (nvidia-smi is not installed): this check"
        " runs on the GPU machine; `--prepare` makes its bundle here\n"
    )
    dry = subprocess.run(
        [sys.executable, script, "--dry-run", "--cuda-arch", "90", "--fa", "off"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert dry.returncode == 0, dry.stderr
    assert "-DCMAKE_CUDA_ARCHITECTURES=90-real" in dry.stdout and "-DGGML_CUDA_FA=OFF" in dry.stdout
    nobundle = subprocess.run(
        [sys.executable, script, "--cuda-arch", "90", "--bundle", str(tmp_path / "none")],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert nobundle.returncode == 1 and "no bundle at" in nobundle.stderr


def test_the_kv_layout_step_runs_the_engine_both_ways_next_to_llama_batched_bench() -> None:
    steps = gpu.plan("90-real", LAYOUT, gpu.Options(python="py"), [])
    labels = [s.label for s in steps]
    [kv] = [s for s in steps if s.reads == "kv-layout"]
    # next to llama-batched-bench, on the 8B shape only, after its model is written
    assert labels.index(kv.label) == labels.index("8b: llama-batched-bench") + 1
    assert labels.index("write the 8b model") < labels.index(kv.label)
    argv = list(kv.argv)
    assert argv[:2] == ["py", "/w/project/benchmarks/kv_layout.py"]
    given = dict(zip(argv[2::2], argv[3::2], strict=False))
    assert given["--model"] == "/w/models/8b.gguf" and given["--npl"] == "8,32"
    assert (given["--npp"], given["--ntg"], given["--rounds"]) == ("64", "32", "3")
    assert argv[-1] == "--jsonl" and kv.timeout_s <= 240
    # the script takes what the plan gives it, and finds the build's llama-batched-bench
    args = _load_kv_layout().parse(argv[2:])  # an option it lacks would exit here
    assert (args.npl, args.npp, args.ntg, args.rounds, args.jsonl) == ("8,32", 64, 32, 3, True)
    env = gpu.step_env(LAYOUT)
    assert env["LLAMA_BATCHED_BENCH"] == "/w/llama.cpp/build/bin/llama-batched-bench"


def _load_kv_layout() -> Any:
    sys.path.insert(0, str(ROOT / "benchmarks"))  # it imports batched.py beside it
    try:
        return _load("kv_layout")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_the_kv_layout_ratios_say_which_layout_is_faster() -> None:
    opts = gpu.Options(shapes=("8b",), cpu_shape=None)
    [kv] = [s for s in gpu.plan("90-real", LAYOUT, opts, []) if s.reads == "kv-layout"]
    res = gpu.Results()
    row = {"npp": 64, "ntg": 32, "rounds": 2, "step_ms": 9.0, "ref_step_ms": 8.0}
    res.read(
        kv,
        _jsonl(
            {**row, "B": 8, "kv_unified": True, "total_tps": 2400.0, "ref_total_tps": 2500.0},
            {**row, "B": 8, "kv_unified": False, "total_tps": 3000.0, "ref_total_tps": 3100.0},
            {**row, "B": 32, "kv_unified": True, "total_tps": 6000.0, "ref_total_tps": None},
        ),
    )
    lines = gpu.ratio_lines(res, opts)
    assert lines == [
        "8b KV layouts, 8 at a time, 64 in / 32 out: llmrun unified 2,400 / one stream per"
        " sequence 3,000 total tok/s = x0.800: one stream per sequence is faster;"
        " llama-batched-bench -kvu 2,500 / default 3,100 = x0.806; llmrun / llama-batched-bench"
        " in the same layout: unified x0.960, per sequence x0.968",
        "8b KV layouts at 32: not measured in both",
    ]


def test_the_kv_layout_step_runs_on_the_cpu_with_a_synthetic_135m_model(
    model_path: str, tmp_path: Path, llmrun_env: dict[str, str]
) -> None:
    """The GPU step's very command line, shrunk and without the reference, on the CPU build:
    both layouts run and its JSON lines become the ratio line."""
    tok, model = tmp_path / "tok.gguf", tmp_path / "135m.gguf"
    synth.strip(Path(model_path), tok)
    assert synth.main(["make", str(tok), "135m", str(model)]) == 0
    opts = gpu.Options(python=sys.executable, shapes=("135m",), serve_shape="135m", cpu_shape=None)
    [kv] = [s for s in gpu.plan("90-real", LAYOUT, opts, []) if s.reads == "kv-layout"]
    argv = [
        str(ROOT / "benchmarks" / "kv_layout.py")
        if a.endswith("kv_layout.py")
        else str(model)
        if a.endswith("135m.gguf")
        else a
        for a in kv.argv
    ]
    small = ["--npp", "8", "--ntg", "3", "--npl", "2", "--rounds", "1", "--no-reference"]
    done = subprocess.run(
        [*argv, *small], capture_output=True, text=True, env=llmrun_env, timeout=HANG_S, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    res = gpu.Results()
    res.read(kv, done.stdout)
    assert set(res.kv_layout) == {(2, True), (2, False)}
    assert all(r["total_tps"] > 0 and r["ref_total_tps"] is None for r in res.kv_layout.values())
    [line] = gpu.ratio_lines(res, opts)
    assert line.startswith("135m KV layouts, 2 at a time, 8 in / 3 out: llmrun unified")
    assert line.endswith(" is faster")


def test_the_layers_that_fit_leave_room_for_every_sequences_kv(model_path: str) -> None:
    """serve -np N and run --parallel N plan the GPU layers beside N sequences' KV caches,
    not one's (the weights load before the context, from the same estimate)."""
    runner = LlamaCppRunner(model_path, EngineConfig(n_ctx=512))
    info = read_gguf(model_path)
    one = runner.memory_need(info)
    four = runner.memory_need(info, n_seq=4)
    assert one.kv_bytes > 0 and four.kv_bytes == 4 * one.kv_bytes
    assert four.weights_bytes == one.weights_bytes
    assert runner.memory_need(info, n_seq=4, n_ctx=128).kv_bytes == one.kv_bytes
    fits = fit_gpu_layers(one, 30, GIB)
    assert fit_gpu_layers(four, 30, GIB) <= fits
