"""Build llama.cpp's RPC backend beside the installed llama-cpp-python, without rebuilding it.

The wheel ships ggml as shared libraries (llama_cpp/lib: libggml.so, libggml-base.so, ...) and
its libggml can load a backend at run time (`ggml_backend_load`). So the RPC backend is compiled
from the installed version's own sources (the sdist's vendor/llama.cpp, which
`tools/llama_src.py` unpacks) as a loadable backend, `libggml-rpc.so`, linked
against the wheel's very libraries, and `rpc-server` beside it: the ABI is exactly the one
llmrun loads. Both go into `runners.rpc.rpc_dir()` (.venv/llama-rpc/<version>/, or
$LLMRUN_RPC_DIR). About 30 s on 2 cores.

A build is kept in the machine's cache, `${XDG_CACHE_HOME:-~/.cache}/llmrun/llama-rpc/
<version>-<key>/`, as llama.cpp's tools are (tests/llama_tools.py): the key hashes the wheel's
libraries, the compiler and the compiler calls, so a new checkout (a clean clone's
`make test`) copies the two files in a moment instead of compiling them. Their RUNPATH is
`$ORIGIN/lib` (`@loader_path/lib` on macOS), a link beside them to this environment's wheel
libraries. LLMRUN_TOOL_CACHE=0 (or `off`, or empty) turns the cache off; an unwritable, partial
or corrupt entry costs a build.

    python tools/rpc_build.py          # build (once; again when the sources change)
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from llmrun.runners.rpc import BINARY, LIBRARY, rpc_dir  # noqa: E402
from tools.llama_src import (  # noqa: E402
    CACHE_ENV,
    entry_record,
    entry_whole,
    link_to,
    llama_cpp_dir,
    machine_cache,
    sha256_of,
    sweep_stale,
)

__all__ = ["CACHE_ENV", "build"]


def wheel_lib_dir() -> Path:
    from llmrun.runners.llama_cpp_adapter import package_dir

    folder = package_dir()
    if folder is None or not (folder / "lib").is_dir():
        raise SystemExit("llama-cpp-python is not installed here: run `make setup` first")
    return folder / "lib"


def commands(src: Path, lib: Path, out: Path, cxx: str) -> list[list[str]]:
    """The two compiler calls: the backend as ggml's CMake builds a GGML_BACKEND_DL module
    (ggml_add_backend_library: GGML_BACKEND_DL, _BUILD, _SHARED; it then exports
    ggml_backend_init), and rpc-server linked to the wheel's libggml, which finds the backend
    in its own folder (ggml_backend_load_all searches the executable's folder)."""
    rpc = src / "ggml" / "src" / "ggml-rpc"
    common = ["-O2", "-std=c++17", "-fPIC", "-pthread", f"-I{src / 'ggml' / 'include'}"]
    link = [f"-L{lib}", f"-Wl,-rpath,{RUNPATH}"]  # `lib` beside them: link_libraries
    library = [
        cxx,
        *common,
        "-shared",
        f"-I{src / 'ggml' / 'src'}",
        "-DGGML_BACKEND_DL",
        "-DGGML_BACKEND_BUILD",
        "-DGGML_BACKEND_SHARED",
        "-DGGML_SHARED",
        str(rpc / "ggml-rpc.cpp"),
        str(rpc / "transport.cpp"),
        *link,
        "-lggml-base",
        "-o",
        str(out / LIBRARY),
    ]
    server = [
        cxx,
        *common,
        "-DGGML_BACKEND_SHARED",
        "-DGGML_SHARED",
        str(src / "tools" / "rpc" / "rpc-server.cpp"),
        *link,
        "-lggml",
        "-lggml-base",
        "-o",
        str(out / BINARY),
    ]
    return [library, server]


# Where the two files look for the wheel's libraries: `lib` beside them (link_libraries).
RUNPATH = "@loader_path/lib" if sys.platform == "darwin" else "$ORIGIN/lib"
COMPLETE = "COMPLETE.json"  # an entry's last file: each binary's SHA-256
FILES = (LIBRARY, BINARY)


def link_libraries(out: Path, lib: Path) -> None:
    """`out/lib`: a link to this environment's wheel libraries, where RUNPATH looks (linked
    again where an $LLMRUN_RPC_DIR that another environment built leads elsewhere)."""
    link_to(out / "lib", lib)


def cache_root() -> Path | None:
    return machine_cache("llama-rpc")


def cache_key(lib: Path, cxx: str) -> str:
    """What makes the two files what they are: the wheel's ggml libraries they link (their
    bytes), the compiler calls (with placeholders for the folders) and the compiler's version.
    The sources are the version's own (the sdist), which the entry's name carries."""
    digest = hashlib.sha256()
    for path in sorted(lib.iterdir()):
        if path.name.startswith("libggml") and (".so" in path.name or ".dylib" in path.name):
            digest.update(f"{path.name}\0".encode() + path.read_bytes())
    for call in commands(Path("SRC"), Path("LIB"), Path("OUT"), cxx):
        digest.update("\0".join(call).encode())
    try:
        done = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False)
        digest.update(done.stdout.encode())
    except OSError:
        digest.update(b"absent")
    return digest.hexdigest()[:16]


def whole(entry: Path) -> bool:
    """Whether an entry holds the two files as its completion record says."""
    return entry_whole(entry, COMPLETE, FILES)


def restore(entry: Path, staging: Path) -> bool:
    """The two files copied from a complete entry into `staging`, each checked against the
    SHA-256 the entry recorded; False (and a build follows) where it is absent, partial or
    corrupt."""
    if not (entry / COMPLETE).exists():
        return False
    try:
        recorded = entry_record(entry, COMPLETE, FILES)
        for name in FILES:
            shutil.copyfile(entry / name, staging / name)
            if sha256_of(staging / name) != recorded[name]:
                raise ValueError(f"{name} is not the file that was stored")
            (staging / name).chmod(0o755)
        return True
    except (OSError, ValueError) as e:
        print(f"the cached RPC build in {entry} is not used ({e}): building it", file=sys.stderr)
        return False


def store(out: Path, entry: Path) -> None:
    """The two built files copied into the cache: written in a folder of their own with their
    SHA-256 last, which one rename makes the entry. A cache that cannot be written costs the
    next checkout a build, nothing else."""
    staging = entry.with_name(f".{entry.name}.{os.getpid()}")
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        for name in FILES:
            shutil.copyfile(out / name, staging / name)
        recorded = {name: sha256_of(staging / name) for name in FILES}
        (staging / COMPLETE).write_text(json.dumps(recorded, indent=1))
        with open(entry.parent / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another checkout's whole entry is never replaced
            sweep_stale(entry.parent)  # the staging folders of stores killed before their rename
            if whole(entry):
                return
            shutil.rmtree(entry, ignore_errors=True)  # partial or corrupt: replaced
            staging.rename(entry)
    except OSError as e:
        print(f"the RPC build is not cached in {entry.parent}: {e}", file=sys.stderr)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def build() -> Path:
    out = rpc_dir()
    if (out / LIBRARY).exists() and (out / BINARY).exists():
        if (out / "lib").is_symlink():  # built here with RUNPATH `lib`: to this wheel's
            link_libraries(out, wheel_lib_dir())
        return out
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise SystemExit("no C++ compiler found (g++ or $CXX): it builds the RPC backend")
    lib = wheel_lib_dir()
    root = cache_root()
    entry = None if root is None else root / f"{out.name}-{cache_key(lib, cxx)}"
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    restored = entry is not None and restore(entry, staging)
    if not restored:
        for call in commands(llama_cpp_dir(), lib, staging, cxx):
            subprocess.run(call, check=True)
    link_libraries(staging, lib)
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    if entry is not None and not restored:
        store(out, entry)
    return out


if __name__ == "__main__":
    print(build())
