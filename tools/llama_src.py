"""llama.cpp's sources, as the installed llama-cpp-python's sdist carries them.

PyPI ships llama-cpp-python as a source distribution whose `vendor/llama.cpp/` holds the very
llama.cpp that llmrun loads. It is fetched from the package registry into `.venv/llama-tools/`
(or $LLMRUN_TOOLS_DIR) on first use and unpacked there, and the archive is kept in
~/.cache/llmrun/sdist for the next checkout on this machine; `make rpc-server` (tools/rpc_build.py)
compiles from it, and so do the tests' llama.cpp tools (tests/llama_tools.py), unless the
machine's cache of those tools (~/.cache/llmrun/llama-tools) already holds them: then nothing is
fetched.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tarfile
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "llama-cpp-python"


CACHE_ENV = "LLMRUN_TOOL_CACHE"  # 0, off or empty: no machine-level cache


def machine_cache(kind: str) -> Path | None:
    """`${XDG_CACHE_HOME:-~/.cache}/llmrun/<kind>`: what this machine keeps across checkouts
    (llama.cpp's tools, the RPC build, the sdist), or None where LLMRUN_TOOL_CACHE turns it
    off."""
    if os.environ.get(CACHE_ENV, "1").strip().lower() in ("", "0", "off"):
        return None
    base = os.environ.get("XDG_CACHE_HOME", "")
    try:
        root = Path(base) if os.path.isabs(base) else Path.home() / ".cache"
    except RuntimeError:  # no home folder: no cache, as when it is turned off
        return None
    return root / "llmrun" / kind


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
    kept = machine_cache("sdist")
    name = f"{PACKAGE.replace('-', '_')}-{version()}.tar.gz"
    if kept is not None and (kept / name).is_file():
        try:
            if sha256_of(kept / name) != (kept / f"{name}.sha256").read_text().strip():
                raise ValueError("not the archive that was kept")
            return unpack(kept / name, target)
        except (OSError, ValueError, tarfile.TarError, EOFError, zlib.error) as e:
            print(f"the kept {kept / name} is not used ({e}): fetching it", file=sys.stderr)
            (kept / name).unlink(missing_ok=True)
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
    unpacked = unpack(archive, target)
    if kept is not None:  # kept for the next checkout: pip's download took 10 s of 14 here
        keep(archive, kept / name)
    return unpacked


def keep(archive: Path, kept: Path) -> None:
    """The archive pip fetched (and checked against the registry's hash) as `kept`, with its
    SHA-256 beside it, which the next use checks first; each file lands by one rename."""
    staging = kept.with_name(f".{kept.name}.{os.getpid()}")
    digest = kept.with_name(f"{kept.name}.sha256")
    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        staging.write_text(sha256_of(archive) + "\n")
        os.replace(staging, digest)
        shutil.copyfile(archive, staging)
        os.replace(staging, kept)
    except OSError:
        staging.unlink(missing_ok=True)


def sha256_of(path: Path) -> str:
    """A file's SHA-256, read a MiB at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def unpack(archive: Path, target: Path) -> Path:
    """The archive's vendor/llama.cpp/ as `target`, made whole by one rename."""
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


def link_to(link: Path, target: Path) -> None:
    """`link` leading to `target`, swapped in one rename where it leads elsewhere (a folder
    shared between environments, whose link another one made)."""
    with contextlib.suppress(OSError):
        if os.readlink(link) == str(target):
            return
    link.parent.mkdir(parents=True, exist_ok=True)
    fresh = link.with_name(f".{link.name}-{os.getpid()}-{threading.get_ident()}")
    fresh.unlink(missing_ok=True)
    fresh.symlink_to(target, target_is_directory=True)
    os.replace(fresh, link)


def entry_record(entry: Path, marker: str, names: tuple[str, ...]) -> dict[str, str]:
    """A cache entry's completion marker (its last file, JSON): each of `names`' SHA-256
    (ValueError where it is anything else)."""
    recorded = json.loads((entry / marker).read_text())
    if not isinstance(recorded, dict) or sorted(recorded) != sorted(names):
        raise ValueError(f"not the files {', '.join(names)}")
    if not all(isinstance(v, str) for v in recorded.values()):
        raise ValueError("not a SHA-256 each")
    return recorded


STALE_S = 3600.0  # a staging folder untouched this long, its process gone, was a store's that died


def sweep_stale(root: Path) -> None:
    """Remove the staging folders (`.ENTRY.PID`) of stores that died before their rename (a
    SIGKILL or a lost machine skips a store's clean-up): those untouched for `STALE_S` whose
    process is gone. A live store's folder, one of a process that reused its PID, or a fresh
    one (its store may be in another PID namespace sharing the cache) is left."""
    for folder in root.glob(".*.*"):
        pid = folder.name.rpartition(".")[2]
        try:
            if not pid.isdigit() or time.time() - folder.stat().st_mtime < STALE_S:
                continue
            os.kill(int(pid), 0)
        except (ProcessLookupError, OverflowError):  # no such process here
            shutil.rmtree(folder, ignore_errors=True)
        except OSError:  # alive, another user's; or gone already
            continue


def entry_whole(entry: Path, marker: str, names: tuple[str, ...]) -> bool:
    """Whether a cache entry holds `names` as its completion marker records them."""
    try:
        recorded = entry_record(entry, marker, names)
        return all(sha256_of(entry / name) == recorded[name] for name in names)
    except (OSError, ValueError):
        return False
