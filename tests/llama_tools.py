"""llama.cpp's own tools, from the sources of the llama-cpp-python that is installed.

PyPI ships llama-cpp-python as a source distribution whose `vendor/llama.cpp/` holds the very
llama.cpp that llmrun loads, with llama-bench and `scripts/compare-llama-bench.py` (MIT, as is
llama.cpp). They serve as references in tests and benchmarks and are never vendored: the sdist
is fetched from the package registry into `.venv/llama-tools/` on first use (tools/llama_src.py,
which `make rpc-server` shares).

    python -m tests.llama_tools scripts      # fetch and unpack (seconds once cached by pip)
    python -m tests.llama_tools llama-bench  # also build llama-bench and llama-batched-bench
    python -m tests.llama_tools llama-server # also build all four tools the test suite runs
    python -m tests.llama_tools llama-perplexity  # the same

The tools are built against the installed wheel's own libllama, libggml* and libmtmd, with the
sdist's headers (tests/llama-tools/CMakeLists.txt): only common/, the vendored HTTP and JSON
helpers and the tools' own sources compile (430-500 s of CPU for all four, about half of what
compiling llama.cpp whole took), and the tools run on the very libraries llmrun loads. llama-server
is built without curl, OpenSSL or the web UI (no download at build or run time).

The test suite's first use of any tool builds all four in one CMake build (`make -j` keeps both
cores busy across them, where one tool at a time left a core idle through llama-server's long
last files), behind a file lock in the tools' folder: pytest's workers (`-n 2`) and other
checkouts sharing LLMRUN_TOOLS_DIR wait for the one build instead of racing it.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from tools.llama_src import fetch_sources, llama_cpp_dir, locked, tools_dir

ROOT = Path(__file__).resolve().parent.parent


def compare_script() -> Path:
    return llama_cpp_dir() / "scripts" / "compare-llama-bench.py"


BENCH_TOOLS = ("llama-bench", "llama-batched-bench")
TOOLS = (*BENCH_TOOLS, "llama-server", "llama-perplexity")


def wheel_libraries() -> Path:
    """The shared libraries of the installed llama-cpp-python (libllama, libggml*, libmtmd):
    the very files llmrun loads, which llama.cpp's tools link against here."""
    spec = importlib.util.find_spec("llama_cpp")  # found, not imported: no library loads
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llama-cpp-python is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "lib"


def tool(name: str, together: tuple[str, ...] = TOOLS) -> Path:
    """One of llama.cpp's tools, built from the same sources against the installed wheel's own
    libllama and libggml (tests/llama-tools/CMakeLists.txt): only common/ and the tools' sources
    compile. The first use builds `name` and the tools `together` with it in one build (all
    four, unless told fewer), under the lock. Outside the lock only a stamp written after
    the build counts: the linker writes a binary in place, so its mere presence could be a
    half-written file another worker is still linking."""
    build = tools_dir() / "build"
    binary = build / "bin" / name
    if built(binary).exists():
        return binary
    with locked():
        if binary.exists():  # built while this process waited for the lock (or before stamps)
            built(binary).touch()
            return binary
        src = fetch_sources(tools_dir() / "llama.cpp")
        subprocess.run(
            [
                "cmake",
                "-S",
                str(ROOT / "tests" / "llama-tools"),
                "-B",
                str(build),
                "-DCMAKE_BUILD_TYPE=Release",
                f"-DLLAMA_SRC={src}",
                f"-DLLAMA_LIB={wheel_libraries()}",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        targets = (name, *(t for t in together if t != name and not (build / "bin" / t).exists()))
        subprocess.run(
            ["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2), "--target", *targets],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        for t in targets:
            built(build / "bin" / t).touch()
    return binary


def built(binary: Path) -> Path:
    """The stamp that says `binary` was linked whole (written under the lock, after its build)."""
    return binary.with_name(f".built-{binary.name}")


def llama_bench() -> Path:
    """llama-bench built from the same sources; LLAMA_BENCH overrides."""
    given = os.environ.get("LLAMA_BENCH")
    return Path(given) if given else tool("llama-bench")


def llama_server() -> Path:
    """llama-server built from the same sources; LLAMA_SERVER overrides."""
    given = os.environ.get("LLAMA_SERVER")
    return Path(given) if given else tool("llama-server")


def llama_batched_bench() -> Path:
    """llama-batched-bench built from the same sources; LLAMA_BATCHED_BENCH overrides."""
    given = os.environ.get("LLAMA_BATCHED_BENCH")
    return Path(given) if given else tool("llama-batched-bench")


# Weight repacking off, as each of llama.cpp's tools spells it: llama-bench has its own parser,
# the others take common/arg.cpp's options.
REPACK_OFF = {
    "llama-bench": ("--repack", "0"),
    "llama-batched-bench": ("--no-repack",),
    "llama-server": ("--no-repack",),
    "llama-perplexity": ("--no-repack",),
}


def repack_safe(model_path: str) -> bool:
    """llmrun's own verdict on weight repacking for this model on this CPU (runners/probe.py,
    kept in LLMRUN_HOME): False on an Intel Xeon with AMX under the llama.cpp of llama-cpp-python
    0.3.36, whose repacked kernels crash on the first batch of more than one token."""
    from llmrun.runners.gguf import read_gguf
    from llmrun.runners.probe import repack_verdict

    return repack_verdict(model_path, read_gguf(model_path).quantization).safe


def cpu_flags(name: str, model_path: str) -> list[str]:
    """The flags llama.cpp's tool `name` needs on this CPU to run `model_path` as llmrun runs
    it: repacking off where llmrun's probe finds it unsafe (there llama-bench and llama-server
    die with SIGSEGV or SIGILL without them), none elsewhere."""
    return [] if repack_safe(model_path) else list(REPACK_OFF[name])


def answer_probe(model_path: str, *, safe: bool) -> None:
    """Make the probe's answer for this model in this LLMRUN_HOME what a CPU of the other kind
    gives (safe=False: an AMX CPU's crash), for llmrun in this process and in the processes
    started with the same LLMRUN_HOME: both read the probe's cache before probing."""
    from llmrun.runners import probe
    from llmrun.runners.gguf import read_gguf

    why = "probed" if safe else "llama.cpp's repacked kernels crashed a probe (SIGILL)"
    key = probe.probe_key(read_gguf(model_path).quantization)
    probe._write_cache(key, probe.Verdict(safe, why))
    if probe._read_cache().get(key) != {"safe": safe, "why": why}:  # it writes what it can
        raise RuntimeError(f"the probe's cache in {probe._cache_file()} could not be written")


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "scripts"
    # `make llama-bench` builds the bench tools alone; the others build all four
    print(
        tool(what, BENCH_TOOLS if what in BENCH_TOOLS else TOOLS)
        if what in TOOLS
        else compare_script()
    )
