"""llama.cpp's own tools, from the sources of the llama-cpp-python that is installed.

PyPI ships llama-cpp-python as a source distribution whose `vendor/llama.cpp/` holds the very
llama.cpp that llmrun loads, with llama-bench and `scripts/compare-llama-bench.py` (MIT, as is
llama.cpp). They serve as references in tests and benchmarks and are never vendored: the sdist
is fetched from the package registry into `.venv/llama-tools/` on first use (tools/llama_src.py,
which `make rpc-server` shares).

    python -m tests.llama_tools scripts      # fetch and unpack (seconds once cached by pip)
    python -m tests.llama_tools llama-bench  # also build (or copy) llama-bench and llama-batched-bench
    python -m tests.llama_tools llama-server # also build (or copy) all four tools the suite runs
    python -m tests.llama_tools llama-perplexity  # the same

The tools are built against the installed wheel's own libllama, libggml* and libmtmd, with the
sdist's headers (tests/llama-tools/CMakeLists.txt): only common/, the vendored HTTP and JSON
helpers and the tools' own sources compile (430-500 s of CPU for all four, about half of what
compiling llama.cpp whole took), and the tools run on the very libraries llmrun loads. llama-server
is built without curl, OpenSSL or the web UI (no download at build or run time).

The test suite's first use of any tool copies all four from the machine's cache (below), or
else builds all four in one CMake build (`make -j` keeps both
cores busy across them, where one tool at a time left a core idle through llama-server's long
last files), behind a file lock in the tools' folder: pytest's workers (`-n 2`) and other
checkouts sharing LLMRUN_TOOLS_DIR wait for the one build instead of racing it.

The four binaries are built once per machine, not once per checkout, as pip builds the wheel
once: a build is copied into `${XDG_CACHE_HOME:-~/.cache}/llmrun/llama-tools/<version>-<key>/`,
where the key hashes what the binaries depend on (the wheel's libllama, libggml* and libmtmd,
tests/llama-tools/CMakeLists.txt and the options it is configured with, the compilers' and
CMake's `--version` lines and the flags in the environment), and another checkout's first use copies them from there in a second
or two. Their RUNPATH is `$ORIGIN/lib`, and each checkout's `build/bin/lib` links to its own
wheel's libraries. LLMRUN_TOOL_CACHE=0 (or `off`, or empty) turns the cache off; removing
the folder clears it. An unwritable, partial or corrupt cache costs a build, never a run.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import importlib.util
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from llmrun.runners import devices as dv
from tools.llama_src import (
    CACHE_ENV,  # noqa: F401  (the tests turn the cache off through this module)
    STALE_S,  # noqa: F401  (the tests age staging folders past it)
    entry_record,
    entry_whole,
    fetch_sources,
    link_to,
    llama_cpp_dir,
    locked,
    machine_cache,
    sha256_of,
    sweep_stale,
    tools_dir,
    version,
)

ROOT = Path(__file__).resolve().parent.parent


def compare_script() -> Path:
    return llama_cpp_dir() / "scripts" / "compare-llama-bench.py"


BENCH_TOOLS = ("llama-bench", "llama-batched-bench")
TOOLS = (*BENCH_TOOLS, "llama-server", "llama-perplexity")
CMAKELISTS = ROOT / "tests" / "llama-tools" / "CMakeLists.txt"
COMPLETE = "complete.json"  # an entry's last file: each tool's SHA-256
RUNPATH = b"$ORIGIN/lib\0"  # in a binary's string table: it runs wherever `lib` beside it leads
# The configure options besides the two folders; the cache key hashes them.
CONFIGURE = ("-DCMAKE_BUILD_TYPE=Release",)


def wheel_libraries() -> Path:
    """The shared libraries of the installed llama-cpp-python (libllama, libggml*, libmtmd):
    the very files llmrun loads, which llama.cpp's tools link against here."""
    spec = importlib.util.find_spec("llama_cpp")  # found, not imported: no library loads
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llama-cpp-python is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "lib"


def wheel_commit() -> str:
    """The llama.cpp commit of the installed wheel, as llmrun records it (`0c1e570`: ggml_commit
    of its libggml-base, without the "-dirty" of a pip build's patched tree): what llama-bench's
    build_commit says once built with it, where the sdist's missing .git made it `unknown`."""
    base = ctypes.CDLL(str(wheel_libraries() / "libggml-base.so"))
    base.ggml_commit.restype = ctypes.c_char_p
    return dv.build_commit((base.ggml_commit() or b"").decode(errors="replace"))


def tool(name: str, together: tuple[str, ...] = TOOLS) -> Path:
    """One of llama.cpp's tools, built from the same sources against the installed wheel's own
    libllama and libggml (tests/llama-tools/CMakeLists.txt): only common/ and the tools' sources
    compile. The first use copies all four from the machine's cache, or builds `name` and the
    tools `together` with it in one build (all four, unless told fewer) and stores all four in
    the cache, under the lock. Outside the lock only a stamp written after the build or the
    copy counts: the linker writes a binary in place, so its mere presence could be a
    half-written file another worker is still linking."""
    bin_dir = tools_dir() / "build" / "bin"
    binary = bin_dir / name
    if built(binary).exists():
        # A folder shared through LLMRUN_TOOLS_DIR keeps the link the first checkout made while
        # it leads somewhere: only a dangling one (its checkout gone) is pointed at this wheel,
        # so no tool another process starts flips between wheels midway.
        if (bin_dir / "lib").is_symlink() and not (bin_dir / "lib").exists():
            with contextlib.suppress(OSError):  # a read-only shared folder: as it is
                link_libraries(bin_dir)
        return binary
    with locked():
        if binary.exists():  # built while this process waited for the lock (or before stamps)
            built(binary).touch()
            return binary
        link_libraries(bin_dir)
        entry = cache_entry()
        restored = restore(entry, bin_dir) if entry is not None else []
        if name in restored:
            for t in restored:
                built(bin_dir / t).touch()
            return binary
        build(name, together)
        if entry is not None:
            store(bin_dir, entry)
    return binary


def build(name: str, together: tuple[str, ...]) -> None:
    """One CMake build of `name` and those of `together` not built yet, stamped, with the lock
    held."""
    build_dir = tools_dir() / "build"
    src = fetch_sources(tools_dir() / "llama.cpp")
    subprocess.run(
        [
            "cmake",
            "-S",
            str(CMAKELISTS.parent),
            "-B",
            str(build_dir),
            *CONFIGURE,
            f"-DLLAMA_SRC={src}",
            f"-DLLAMA_LIB={wheel_libraries()}",
            f"-DLLAMA_BUILD_COMMIT={wheel_commit()}",
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    bin_dir = build_dir / "bin"
    targets = (name, *(t for t in together if t != name and not (bin_dir / t).exists()))
    subprocess.run(
        ["cmake", "--build", str(build_dir), "-j", str(os.cpu_count() or 2), "--target", *targets],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    for t in targets:
        built(bin_dir / t).touch()


def built_tool(name: str) -> Path | None:
    """`name` where `tool` puts it, if it is there whole; never fetches, builds or copies."""
    binary = tools_dir() / "build" / "bin" / name
    return binary if built(binary).exists() else None


def built(binary: Path) -> Path:
    """The stamp that says `binary` was linked whole (written under the lock, after its build)."""
    return binary.with_name(f".built-{binary.name}")


def link_libraries(bin_dir: Path) -> None:
    """`bin_dir/lib`: a link to this checkout's wheel libraries, where the tools' RUNPATH
    ($ORIGIN/lib) looks. Swapped in one rename when it leads elsewhere (a folder of tools shared
    through LLMRUN_TOOLS_DIR, whose link another checkout made)."""
    link_to(bin_dir / "lib", wheel_libraries())


def cache_root() -> Path | None:
    """The machine's cache of built tools, or None where LLMRUN_TOOL_CACHE turns it off."""
    return machine_cache("llama-tools")


def cache_entry() -> Path | None:
    """This wheel's and toolchain's entry in the cache (which may not exist yet)."""
    root = cache_root()
    return None if root is None else root / f"{version()}-{cache_key(wheel_libraries())}"


def cache_key(libraries: Path) -> str:
    """A short hash of what makes the binaries what they are: the bytes of the wheel's libraries
    they link (another backend or version is another key), the CMake project, and the
    toolchain. Nothing stale is reused."""
    digest = hashlib.sha256()
    for lib in sorted(libraries.iterdir()):
        if lib.name.startswith(("libllama.", "libggml", "libmtmd.")) and ".so" in lib.name:
            digest.update(f"{lib.name}\0{lib.stat().st_size}\0".encode())
            digest.update(lib.read_bytes())
    digest.update(CMAKELISTS.read_bytes())
    digest.update("\0".join(CONFIGURE).encode())
    digest.update(toolchain().encode())
    return digest.hexdigest()[:16]


def toolchain() -> str:
    """The `--version` line of the C and C++ compilers CMake picks and of CMake, and the flags
    the environment hands them."""
    lines = []
    for command in (os.environ.get("CC") or "cc", os.environ.get("CXX") or "c++", "cmake"):
        try:
            done = subprocess.run(
                [*shlex.split(command), "--version"], capture_output=True, text=True, check=False
            )
            first = done.stdout.splitlines()[0] if done.stdout else f"exit {done.returncode}"
        except (OSError, ValueError):
            first = "absent"
        lines.append(f"{command}: {first}")
    lines += [f"{flag}={os.environ.get(flag, '')}" for flag in ("CFLAGS", "CXXFLAGS", "LDFLAGS")]
    return "\n".join(lines)


def restore(entry: Path, bin_dir: Path) -> list[str]:
    """The tools missing from `bin_dir` copied from a complete cache entry, each checked against
    the SHA-256 the entry recorded; none (and a build follows) where the entry is absent,
    partial, corrupt or unreadable."""
    missing = [t for t in TOOLS if not (bin_dir / t).exists()]
    copies: list[Path] = []
    try:
        recorded = entry_record(entry, COMPLETE, TOOLS)
        for t in missing:
            copy = bin_dir / f".{t}.cached"
            copies.append(copy)
            shutil.copyfile(entry / t, copy)
            if sha256_of(copy) != recorded[t]:
                raise ValueError(f"{t} is not the file that was stored")
            copy.chmod(0o755)
        for t, copy in zip(missing, copies, strict=True):
            os.replace(copy, bin_dir / t)
        return missing
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as e:
        print(f"the cached tools in {entry} are not used ({e}): building them", file=sys.stderr)
        return []
    finally:
        for copy in copies:
            copy.unlink(missing_ok=True)


def store(bin_dir: Path, entry: Path) -> None:
    """The four tools in `bin_dir` copied into the cache, when all four are built and run from
    any folder (RUNPATH $ORIGIN/lib: not those of a build made before it was): written in a
    folder of their own with their SHA-256 last, which one rename makes the entry. A cache
    that cannot be written costs the next checkout a build, nothing else."""
    if whole(entry):
        return
    staging = entry.with_name(f".{entry.name}.{os.getpid()}")
    try:
        binaries = [bin_dir / t for t in TOOLS]
        if not all(b.exists() and RUNPATH in b.read_bytes() for b in binaries):
            return
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        for b in binaries:
            shutil.copyfile(b, staging / b.name)
            (staging / b.name).chmod(0o755)
        recorded = {b.name: sha256_of(staging / b.name) for b in binaries}
        (staging / COMPLETE).write_text(json.dumps(recorded, indent=1))
        with _cache_locked(entry.parent):  # another checkout's whole entry is never replaced
            sweep_stale(entry.parent)
            if whole(entry):
                return
            shutil.rmtree(entry, ignore_errors=True)  # one without COMPLETE: partial or corrupt
            staging.rename(entry)
    except OSError as e:
        if not whole(entry):  # else another checkout stored them first
            print(f"llama.cpp's tools not cached in {entry.parent}: {e}", file=sys.stderr)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def whole(entry: Path) -> bool:
    """Whether a cache entry holds the four tools as its completion marker records them."""
    return entry_whole(entry, COMPLETE, TOOLS)


@contextlib.contextmanager
def _cache_locked(root: Path) -> Iterator[None]:
    """The machine's cache to this process alone while it checks and renames an entry (the
    tools' folder's lock is per checkout: two checkouts can store at once)."""
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop(proc: subprocess.Popen[bytes], *, grace_s: float) -> None:
    """SIGTERM, and SIGKILL if it is still there after `grace_s`."""
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(grace_s)


class NotStarted(RuntimeError):
    """llama-server exited, or was not ready in time (its own error, not a caller's)."""


@contextlib.contextmanager
def llama_cpp_server(
    model: str, *flags: str, ready_s: float, log: Path | None = None
) -> Iterator[str]:
    """llama.cpp's llama-server from the same sources (built on first use) with `flags`, on a
    free loopback port, with the flags this CPU needs (cpu_flags: without them it died by
    SIGILL at its first prompt on an AMX CPU); yields its URL once /health answers 200. Its
    output goes to `log` (else nowhere); NotStarted if it exits or is not ready in `ready_s`."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [
        str(llama_server()),
        *("-m", model, *flags, "--host", "127.0.0.1", "--port", str(port)),
        *cpu_flags("llama-server", model),
    ]
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(open(log, "wb")) if log else subprocess.DEVNULL
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
        try:
            deadline = time.monotonic() + ready_s
            while True:
                with (
                    contextlib.suppress(OSError),
                    urllib.request.urlopen(url + "/health", timeout=5),
                ):
                    break  # urlopen raises for anything but 2xx
                code = proc.poll()
                if code is not None or time.monotonic() > deadline:
                    why = f"exited {code}" if code is not None else f"not ready in {ready_s:.0f} s"
                    said = f"llama-server {why} ({shlex.join(argv)})"
                    raise NotStarted(said + (f"; its log: {log}" if log else ""))
                time.sleep(0.2)
            yield url
        finally:
            stop(proc, grace_s=30)


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
