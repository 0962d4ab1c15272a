"""tools/rpc_build.py's machine-level cache, with stand-in compiler calls: a new checkout copies
a stored build instead of compiling; a corrupt entry or LLMRUN_TOOL_CACHE=0 costs a build."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from llmrun.runners.rpc import BINARY, LIBRARY
from tools import rpc_build


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
