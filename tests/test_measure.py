"""What people compare: memory by llama.cpp's own account, perplexity, several quantizations."""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import pytest

from llmrun.cli.chat import context_meter
from llmrun.runners.config import EngineConfig
from llmrun.runners.errors import BadRequestError
from llmrun.runners.llamacpp import LlamaCppRunner
from llmrun.runners.load_record import memory_report
from llmrun.runners.system import (
    evict_from_page_cache,
    format_cpu_list,
    parse_cpu_list,
    performance_cores,
    resident_fraction,
)

from .conftest import HANG_S, ROOT, which_llmrun

TEXT = ROOT / "examples" / "declaration_of_independence.txt"


def test_llama_cpp_buffer_reports_become_memory_figures() -> None:
    log = [
        "load_tensors:   CPU_Mapped model buffer size =    92.10 MiB\n",
        "load_tensors:        CUDA0 model buffer size =  4096.00 MiB\n",
        "llama_kv_cache:      CUDA0 KV buffer size =   512.00 MiB\n",
        "llama_context:  CUDA_Host  output buffer size =     0.19 MiB\n",
        "sched_reserve:      CUDA0 compute buffer size =   300.00 MiB\n",
        "sched_reserve:  CUDA_Host compute buffer size =    12.00 MiB\n",
    ]
    m = memory_report(log, 4096)
    assert m.weights == {"CPU_Mapped": round(92.10 * 2**20), "CUDA0": 4096 * 2**20}
    assert (m.kv_bytes, m.compute_bytes) == (512 * 2**20, 312 * 2**20)
    assert m.kv_bytes_per_token == 512 * 2**20 / 4096


def test_a_load_reports_its_memory(model_path: str) -> None:
    runner = LlamaCppRunner(model_path, EngineConfig(n_ctx=1024))
    try:
        st = runner.load().settings
    finally:
        runner.close()
    m = st.memory
    assert m is not None
    assert abs(m.weights_bytes - runner.load().model.size_bytes) / m.weights_bytes < 0.01
    # 30 layers x 3 KV heads x 64 dims x (K + V) x 2 bytes (f16) per token, as the GGUF says
    assert m.kv_bytes_per_token == 30 * 3 * 64 * 2 * 2
    assert m.kv_bytes == 1024 * 30 * 3 * 64 * 2 * 2
    assert m.compute_bytes > 0 and (m.peak_rss_bytes or 0) > m.weights_bytes


@pytest.fixture(scope="module")
def ppl_runner(model_path: str) -> LlamaCppRunner:
    return LlamaCppRunner(model_path, EngineConfig(n_ctx=256))


def test_perplexity_is_repeatable_and_shuffled_text_scores_worse(
    ppl_runner: LlamaCppRunner,
) -> None:
    text = TEXT.read_text()[:2100]  # three windows of 128
    tokens = ppl_runner.tokenize(text, add_special=False)
    assert len(tokens) >= 3 * 128
    first, n = ppl_runner.perplexity(tokens, n_ctx=128)
    again, _ = ppl_runner.perplexity(tokens, n_ctx=128)
    assert first == again  # the same text scored twice gives the same figure
    assert n == (len(tokens) // 128) * (128 // 2 - 1)  # second halves of whole windows
    assert 5 < first < 100
    words = text.split()
    random.Random(7).shuffle(words)
    shuffled, _ = ppl_runner.perplexity(
        ppl_runner.tokenize(" ".join(words), add_special=False), n_ctx=128
    )
    assert shuffled > 3 * first
    with pytest.raises(BadRequestError):
        ppl_runner.perplexity(tokens[:50], n_ctx=128)  # not one whole window


def test_bench_compares_quantizations_by_speed_memory_and_perplexity(
    llmrun_env: dict[str, str], model_path: str, q8_model: str, tmp_path: Path
) -> None:
    text = tmp_path / "text.txt"
    text.write_text(TEXT.read_text()[:1300])  # about 290 tokens: one window of 256
    done = subprocess.run(
        [
            which_llmrun(),
            "bench",
            "-m",
            model_path,
            "-m",
            q8_model,
            "-p",
            "16",
            "-n",
            "4",
            "-r",
            "1",
            "--no-history",
            "--ppl",
            str(text),
            "-c",
            "256",
            "-o",
            "json",
        ],
        env=llmrun_env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    q41 = [r for r in rows if r["model_type"].endswith("Q4_1")]
    q8 = [r for r in rows if r["model_type"].endswith("Q8_0")]
    assert len(q41) == len(q8) == 2
    assert q8[0]["weights_bytes"] > 1.3 * q41[0]["weights_bytes"]  # 8.5 against 5.7 bits
    assert q8[0]["kv_bytes"] == q41[0]["kv_bytes"]  # the cache is the same for both
    # llama.cpp reports MiB with two decimals: within 0.2 % of 256 tokens x 23040 bytes
    assert abs(q8[0]["kv_bytes"] / (256 * 23040) - 1) < 0.002
    assert all(r["peak_rss_bytes"] > 0 and r["compute_bytes"] > 0 for r in rows)
    assert q41[0]["ppl_change"] == 0.0 and q8[0]["ppl_ctx"] == 256
    assert abs(q8[0]["ppl"] / q41[0]["ppl"] - 1 - q8[0]["ppl_change"]) < 1e-3
    assert "perplexity SmolLM2-135M-Instruct.Q8_0:" in done.stderr


def test_cpu_lists_read_the_kernels_whole_syntax_and_refuse_anything_else() -> None:
    assert parse_cpu_list("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpu_list(" 0-1 ,\t4\n") == [0, 1, 4]  # a /sys file's newline, spaces
    assert parse_cpu_list("0-9:2/5") == [0, 1, 5, 6]  # a strided range (cpuset(7))
    assert parse_cpu_list("\n") == []  # an empty list names no CPU
    for cpus in ({0}, {0, 2, 3, 4, 5, 9}, set(range(64))):  # written as the kernel writes them
        assert parse_cpu_list(format_cpu_list(cpus)) == sorted(cpus)
    assert format_cpu_list({5, 0, 2, 3, 4}) == "0,2-5"
    for bad in (
        "0-",
        "-1",
        "x",
        "3-1",
        "0,,1",
        "0,",
        "0-7:2",
        "0-7:0/4",
        "0-7:5/4",
        "1 2",
        "\u0663",
        "0-99999999",
        "9" * 5000,
    ):
        with pytest.raises(ValueError, match="is not a CPU, a range such as 0-3"):
            parse_cpu_list(bad)


def test_hybrid_cpus_count_their_performance_cores(tmp_path: Path) -> None:
    assert performance_cores(str(tmp_path)) is None  # not hybrid
    (tmp_path / "devices" / "cpu_core").mkdir(parents=True)
    (tmp_path / "devices" / "cpu_core" / "cpus").write_text("0-7\n")  # 4 P-cores, 2 threads each
    for cpu in range(8):
        topo = tmp_path / "devices" / "system" / "cpu" / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "core_id").write_text(f"{cpu // 2}\n")
        (topo / "physical_package_id").write_text("0\n")
    assert performance_cores(str(tmp_path)) == 4
    (tmp_path / "devices" / "cpu_core" / "cpus").write_text("0-x\n")
    assert performance_cores(str(tmp_path)) is None  # not a CPU list: not a hybrid CPU we know


def test_the_chat_meter_shows_the_kv_cache_in_use() -> None:
    meter = context_meter(1000, 4096, 23040.0).plain
    assert "1000/4096 tokens (24%) · KV 22.0 MiB in use" in meter
    assert "KV" not in context_meter(1000, 4096).plain  # a server: unknown


def test_cold_loads_read_the_file_from_disk(
    llmrun_env: dict[str, str], model_path: str, tmp_path: Path
) -> None:
    copy = tmp_path / "model.gguf"  # a file of its own: no other test has it mapped
    copy.write_bytes(Path(model_path).read_bytes())
    rows = {}
    for flag in ("", "--cold"):
        done = subprocess.run(
            [
                which_llmrun(),
                "bench",
                "-m",
                str(copy),
                "-p",
                "8",
                "-n",
                "0",
                "-r",
                "1",
                "--no-history",
                "-o",
                "json",
                *([flag] if flag else []),
            ],
            env=llmrun_env,
            capture_output=True,
            text=True,
            timeout=HANG_S,
        )
        assert done.returncode == 0, done.stderr
        rows[flag] = json.loads(done.stdout)[0]
    assert rows[""]["file_resident_before"] > 0.9  # just written: in the page cache
    if evict_from_page_cache(str(copy)) and (resident_fraction(str(copy)) or 1.0) < 0.5:
        assert rows["--cold"]["file_resident_before"] < 0.05  # this filesystem drops pages
    assert rows["--cold"]["load_ms"] > 0


def test_a_context_sweep_shows_the_kv_cache_growing(llmrun_env: dict[str, str]) -> None:
    done = subprocess.run(
        [
            which_llmrun(),
            "bench",
            "-p",
            "0",
            "-n",
            "4",
            "-r",
            "1",
            "-c",
            "256,1024",
            "--no-history",
            "-o",
            "json",
        ],
        env=llmrun_env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert done.returncode == 0, done.stderr
    small, large = json.loads(done.stdout)
    assert (small["n_ctx"], large["n_ctx"]) == (256, 1024)
    assert large["kv_bytes"] == 1024 * 23040  # 22.50 MiB: exact in llama.cpp's two decimals
    assert abs(large["kv_bytes"] / small["kv_bytes"] - 4) < 0.01
