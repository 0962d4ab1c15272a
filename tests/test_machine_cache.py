"""What a machine keeps across checkouts besides llama.cpp's tools (tests/test_shared_setup.py):
tools/rpc_build.py's build, with stand-in compiler calls (a new checkout copies a stored build
instead of compiling; a corrupt entry or LLMRUN_TOOL_CACHE=0 costs a build), and
tools/llama_src.py's sdist, with a stand-in registry (fetched once per machine)."""

from __future__ import annotations

import json
import os
import shutil
import tarfile
import time
from pathlib import Path

import pytest

from llmrun.runners.rpc import BINARY, LIBRARY
from tools import llama_src, rpc_build


@pytest.fixture
def stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, llmrun_env: dict[str, str]) -> Path:
    """Where a build would go, the wheel's libraries, and the compiler: calls that write each
    file's name, and log it (the log's lines: the compiler calls made). (llmrun_env: the
    calls are processes.)"""
    lib = tmp_path / "wheel" / "lib"
    lib.mkdir(parents=True)
    (lib / "libggml.so").write_bytes(b"ggml")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(rpc_build.CACHE_ENV, raising=False)
    monkeypatch.setattr(rpc_build, "rpc_dir", lambda: tmp_path / "checkout" / "0.3.36")
    monkeypatch.setattr(rpc_build, "wheel_lib_dir", lambda: lib)
    monkeypatch.setattr(rpc_build, "llama_cpp_dir", lambda: tmp_path / "src")
    log = tmp_path / "compiled"
    log.touch()

    def commands(src: Path, lib: Path, out: Path, cxx: str) -> list[list[str]]:
        return [
            ["sh", "-c", f"echo {name} > '{out / name}'; echo {name} >> '{log}'"]
            for name in (LIBRARY, BINARY)
        ]

    monkeypatch.setattr(rpc_build, "commands", commands)
    return log


def calls(log: Path) -> int:
    return len(log.read_text().splitlines())


def entries(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "cache" / "llmrun" / "llama-rpc").glob("0.3.36-*"))


def test_a_second_checkout_copies_the_stored_build(tmp_path: Path, stand_in: Path) -> None:
    out = rpc_build.build()
    assert calls(stand_in) == 2  # compiled once
    (entry,) = entries(tmp_path)
    assert sorted(json.loads((entry / rpc_build.COMPLETE).read_text())) == sorted([LIBRARY, BINARY])
    assert os.readlink(out / "lib") == str(tmp_path / "wheel" / "lib")  # RUNPATH $ORIGIN/lib
    built = {name: (out / name).read_bytes() for name in (LIBRARY, BINARY)}
    rpc_build.shutil.rmtree(out)  # a new checkout
    assert rpc_build.build() == out
    assert calls(stand_in) == 2  # nothing compiled again
    assert {name: (out / name).read_bytes() for name in (LIBRARY, BINARY)} == built
    assert os.access(out / BINARY, os.X_OK)
    assert os.readlink(out / "lib") == str(tmp_path / "wheel" / "lib")


def test_a_store_sweeps_the_staging_folders_of_stores_that_died(
    tmp_path: Path, stand_in: Path
) -> None:
    """A store killed before its rename leaves `.ENTRY.PID` behind: the next store removes
    those an hour old whose process is gone, and leaves a live one's and a fresh one's (maybe
    another PID namespace's), as the tools' cache does."""
    root = tmp_path / "cache" / "llmrun" / "llama-rpc"
    root.mkdir(parents=True)
    no_pid = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # names no process
    dead = root / f".0.3.36-old.{no_pid}"
    live = root / f".0.3.36-other.{os.getpid()}"
    fresh = root / f".0.3.36-fresh.{no_pid}"
    hour_ago = time.time() - llama_src.STALE_S - 1
    for folder in (dead, live, fresh):
        folder.mkdir()
        (folder / BINARY).write_bytes(b"half a copy")
        if folder is not fresh:
            os.utime(folder, (hour_ago, hour_ago))
    rpc_build.build()
    (entry,) = entries(tmp_path)
    assert rpc_build.whole(entry)
    assert not dead.exists() and live.exists() and fresh.exists()


def test_a_corrupt_entry_is_built_again(
    tmp_path: Path, stand_in: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = rpc_build.build()
    (entry,) = entries(tmp_path)
    (entry / BINARY).write_text("something else\n")
    rpc_build.shutil.rmtree(out)
    rpc_build.build()
    assert calls(stand_in) == 4  # compiled twice
    assert "is not used" in capsys.readouterr().err
    assert (out / BINARY).read_text() == f"{BINARY}\n"
    assert rpc_build.whole(entry) and (entry / BINARY).read_text() == f"{BINARY}\n"  # mended
    rpc_build.shutil.rmtree(out)
    rpc_build.build()
    assert calls(stand_in) == 4 and "is not used" not in capsys.readouterr().err


def test_a_shared_folder_links_to_this_environment_s_libraries(
    tmp_path: Path, stand_in: Path
) -> None:
    """An $LLMRUN_RPC_DIR that another environment built and linked: kept, linked anew."""
    out = rpc_build.build()
    (out / "lib").unlink()
    (out / "lib").symlink_to(tmp_path / "another-environment" / "lib")
    assert rpc_build.build() == out and calls(stand_in) == 2
    assert os.readlink(out / "lib") == str(tmp_path / "wheel" / "lib")


def test_other_libraries_are_another_entry(tmp_path: Path, stand_in: Path) -> None:
    out = rpc_build.build()
    (tmp_path / "wheel" / "lib" / "libggml.so").write_bytes(b"another build of ggml")
    rpc_build.shutil.rmtree(out)
    rpc_build.build()
    assert calls(stand_in) == 4 and len(entries(tmp_path)) == 2


@pytest.mark.parametrize("value", ["0", "off", ""])
def test_the_cache_turned_off_keeps_nothing(
    tmp_path: Path, stand_in: Path, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(rpc_build.CACHE_ENV, value)
    rpc_build.build()
    assert calls(stand_in) == 2 and not entries(tmp_path)


# ---- the sdist that llama.cpp's sources come from ------------------------------------------


def fake_sdist(folder: Path, text: str) -> Path:
    """An archive shaped like llama-cpp-python's sdist: vendor/llama.cpp/ with the file that
    llama_src looks for."""
    top = f"llama_cpp_python-{llama_src.version()}"
    source = folder / "tree" / top / "vendor" / "llama.cpp" / "scripts"
    source.mkdir(parents=True)
    (source / "compare-llama-bench.py").write_text(text)
    archive = folder / f"{top}.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(folder / "tree" / top, arcname=top)
    return archive


@pytest.fixture
def registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """pip's download replaced by a copy of a fake sdist (each call recorded), a tools folder
    and a machine cache of the test's own."""
    archive = fake_sdist(tmp_path / "registry", "# from the registry\n")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(llama_src.CACHE_ENV, raising=False)
    monkeypatch.setenv("LLMRUN_TOOLS_DIR", str(tmp_path / "checkout-1"))
    calls: list[list[str]] = []

    def download(call: list[str], check: bool) -> None:
        calls.append(call)
        shutil.copy(archive, call[call.index("-d") + 1])

    monkeypatch.setattr(llama_src.subprocess, "run", download)
    return calls


def test_the_sdist_is_fetched_once_per_machine(
    tmp_path: Path, registry: list[list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    first = llama_src.llama_cpp_dir()
    assert (first / "scripts" / "compare-llama-bench.py").read_text() == "# from the registry\n"
    assert len(registry) == 1
    monkeypatch.setenv("LLMRUN_TOOLS_DIR", str(tmp_path / "checkout-2"))  # another checkout
    second = llama_src.llama_cpp_dir()
    assert second != first and len(registry) == 1  # unpacked from the kept archive
    assert (second / "scripts" / "compare-llama-bench.py").read_text() == "# from the registry\n"


@pytest.mark.parametrize("damage", ["truncated", "a flipped byte", "no digest"])
def test_a_damaged_kept_sdist_is_fetched_again(
    tmp_path: Path,
    registry: list[list[str]],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    damage: str,
) -> None:
    """A flipped byte often unpacks without an error (tarfile stops before gzip's CRC): the
    SHA-256 kept beside the archive catches it, as it catches a cut one."""
    kept = tmp_path / "cache" / "llmrun" / "sdist"
    archive = kept / f"llama_cpp_python-{llama_src.version()}.tar.gz"
    llama_src.keep(fake_sdist(tmp_path / "other", "# kept\n"), archive)
    data = archive.read_bytes()
    if damage == "truncated":
        archive.write_bytes(data[: len(data) // 2])
    elif damage == "a flipped byte":
        archive.write_bytes(data[:100] + bytes([data[100] ^ 0x40]) + data[101:])
    else:
        archive.with_name(archive.name + ".sha256").unlink()
    found = llama_src.llama_cpp_dir()
    assert (found / "scripts" / "compare-llama-bench.py").read_text() == "# from the registry\n"
    assert len(registry) == 1 and "is not used" in capsys.readouterr().err
    assert archive.read_bytes() != data  # the registry's, kept in its place
    monkeypatch.setenv("LLMRUN_TOOLS_DIR", str(tmp_path / "checkout-2"))
    llama_src.llama_cpp_dir()
    assert len(registry) == 1 and "is not used" not in capsys.readouterr().err  # kept whole


def test_the_cache_turned_off_keeps_no_sdist(
    tmp_path: Path, registry: list[list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(llama_src.CACHE_ENV, "off")
    llama_src.llama_cpp_dir()
    assert len(registry) == 1 and not (tmp_path / "cache").exists()
