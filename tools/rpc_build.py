"""Build llama.cpp's RPC backend beside the installed llama-cpp-python, without rebuilding it.

The wheel ships ggml as shared libraries (llama_cpp/lib: libggml.so, libggml-base.so, ...) and
its libggml can load a backend at run time (`ggml_backend_load`). So the RPC backend is compiled
from the installed version's own sources (the sdist's vendor/llama.cpp, which
`tools/llama_src.py` unpacks) as a loadable backend, `libggml-rpc.so`, linked
against the wheel's very libraries, and `rpc-server` beside it: the ABI is exactly the one
llmrun loads. Both go into `runners.rpc.rpc_dir()` (.venv/llama-rpc/<version>/, or
$LLMRUN_RPC_DIR). About 30 s on 2 cores.

    python tools/rpc_build.py          # build (once; again when the sources change)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from llmrun.runners.rpc import BINARY, LIBRARY, rpc_dir  # noqa: E402
from tools.llama_src import llama_cpp_dir  # noqa: E402


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
    link = [f"-L{lib}", f"-Wl,-rpath,{lib}"]
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


def build() -> Path:
    out = rpc_dir()
    if (out / LIBRARY).exists() and (out / BINARY).exists():
        return out
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise SystemExit("no C++ compiler found (g++ or $CXX): it builds the RPC backend")
    src = llama_cpp_dir()
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for call in commands(src, wheel_lib_dir(), staging, cxx):
        subprocess.run(call, check=True)
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return out


if __name__ == "__main__":
    print(build())
