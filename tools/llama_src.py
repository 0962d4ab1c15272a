"""llama.cpp's sources, as the installed llama-cpp-python's sdist carries them.

PyPI ships llama-cpp-python as a source distribution whose `vendor/llama.cpp/` holds the very
llama.cpp that llmrun loads. It is fetched from the package registry into `.venv/llama-tools/`
(or $LLMRUN_TOOLS_DIR) on first use and unpacked there; `make rpc-server` (tools/rpc_build.py)
compiles from it, and so do the tests' llama.cpp tools (tests/llama_tools.py), unless the
machine's cache of those tools (~/.cache/llmrun/llama-tools) already holds them: then nothing is
fetched.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "llama-cpp-python"


def version() -> str:
    return importlib.metadata.version(PACKAGE)


def tools_dir() -> Path:
    """$LLMRUN_TOOLS_DIR/VERSION, else .venv/llama-tools/VERSION: an empty variable is unset (as
    the empty string it named the working directory, and the sources unpacked there)."""
    return Path(os.environ.get("LLMRUN_TOOLS_DIR") or ROOT / ".venv" / "llama-tools") / version()


@contextlib.contextmanager
def locked() -> Iterator[None]:
    """The tools' folder to this process alone (an exclusive flock, released when the process
    ends, however it ends): one fetch and one build, whoever else wants them meanwhile. Not
    re-entrant: inside it, call `fetch_sources`, not `llama_cpp_dir`."""
    tools_dir().mkdir(parents=True, exist_ok=True)
    with open(tools_dir() / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def llama_cpp_dir() -> Path:
    """The unpacked `vendor/llama.cpp` of the installed version's sdist (fetched once)."""
    target = tools_dir() / "llama.cpp"
    if (target / "scripts" / "compare-llama-bench.py").exists():
        return target
    with locked():
        return fetch_sources(target)


def fetch_sources(target: Path) -> Path:
    """llama_cpp_dir's work, with the lock held."""
    if (target / "scripts" / "compare-llama-bench.py").exists():  # another process fetched it
        return target
    downloads = tools_dir() / "download"
    downloads.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--disable-pip-version-check",
            "--no-binary",
            ":all:",
            f"{PACKAGE}=={version()}",
            "-d",
            str(downloads),
        ],
        check=True,
    )
    archive = next(downloads.glob("*.tar.gz"))
    prefix = archive.name.removesuffix(".tar.gz") + "/vendor/llama.cpp/"
    staging = tools_dir() / "staging"
    shutil.rmtree(staging, ignore_errors=True)
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        for m in members:
            m.name = m.name[len(prefix) :]
        tar.extractall(staging, members=[m for m in members if m.name], filter="data")
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target
