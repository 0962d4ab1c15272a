"""What the tests share or fake so the suite stays quick and runs on every CPU: llmrun's
repacking probe once a session (tests/inject/sitecustomize.py), a small bandwidth probe, and
llama.cpp's own tools run with the flags this CPU needs (tests/llama_tools.py)."""

from __future__ import annotations

import fcntl
import json
import os
import re
import subprocess
import sys
import threading
import types
from pathlib import Path

import pytest

from llmrun.runners import probe, system

from . import llama_tools
from .conftest import HANG_S, QUICK_BANDWIDTH, REAL_BANDWIDTH_RUNS
from .inject.sitecustomize import BANDWIDTH_ENV, PROBE_ENV, share_probe

TOOLS = ("llama-bench", "llama-batched-bench", "llama-server", "llama-perplexity")


@pytest.mark.parametrize("safe", [True, False])
def test_the_tools_get_repacking_off_where_the_probe_finds_it_unsafe(
    model_file: str, safe: bool
) -> None:
    """Both answers of llmrun's probe, whatever this CPU is: on an Intel Xeon with AMX (safe
    False) each tool gets its spelling of repacking off, elsewhere nothing."""
    llama_tools.answer_probe(model_file, safe=safe)
    assert llama_tools.repack_safe(model_file) is safe
    for tool in TOOLS:
        flags = llama_tools.cpu_flags(tool, model_file)
        assert flags == ([] if safe else list(llama_tools.REPACK_OFF[tool])), tool
    assert llama_tools.cpu_flags("llama-bench", model_file) in ([], ["--repack", "0"])


def test_the_repacking_flags_are_the_tools_own(llama_cpp_source: Path) -> None:
    """llama-bench parses --repack 0|1 itself; the others take common/arg.cpp's --no-repack."""
    bench = (llama_cpp_source / "tools" / "llama-bench" / "llama-bench.cpp").read_text()
    assert 'arg == "--repack"' in bench
    common = (llama_cpp_source / "common" / "arg.cpp").read_text()
    declared = re.search(r'\{"--repack"\},\s*\{"-nr", "--no-repack"\},(.*?)\)\);', common, re.S)
    assert declared and ".set_examples(" not in declared.group(1)  # offered to every tool
    for tool, source in (
        ("llama-batched-bench", "batched-bench/batched-bench.cpp"),
        ("llama-server", "server/server.cpp"),
        ("llama-perplexity", "perplexity/perplexity.cpp"),
    ):
        assert llama_tools.REPACK_OFF[tool] == ("--no-repack",)
        assert "common_params_parse(" in (llama_cpp_source / "tools" / source).read_text()


def _fake_probe(calls: list[object]) -> types.ModuleType:
    module = types.ModuleType("fake_probe")

    def run_probe(
        model_path: str, command: list[str] | None = None, cancel: object = None
    ) -> probe.Verdict:
        calls.append(command)
        return probe.Verdict(False, "crashed")

    module.Verdict = probe.Verdict  # type: ignore[attr-defined]
    module.run_probe = run_probe  # type: ignore[attr-defined]
    return module


def test_the_probe_runs_once_a_session_for_each_model_file(tmp_path: Path) -> None:
    calls: list[object] = []
    fake = _fake_probe(calls)
    share_probe(fake, tmp_path / "verdicts.json")
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF one")
    for _ in range(3):
        assert fake.run_probe(str(model)) == probe.Verdict(False, "crashed")
    assert calls == [None]
    assert fake.run_probe(str(model), ["a", "fake", "crash"]).why == "crashed"
    assert calls == [None, ["a", "fake", "crash"]]  # a probe with its own command always runs
    model.write_bytes(b"GGUF another")  # another model in the same place: probed again
    fake.run_probe(str(model))
    assert calls == [None, ["a", "fake", "crash"], None]


def test_a_child_answers_the_probe_from_the_sessions_verdicts(
    llmrun_env: dict[str, str], model_file: str, tmp_path: Path
) -> None:
    """A process a test starts reads the verdicts the session found (here a made-up one) and
    does not probe again; its bandwidth probe is the tests' small one."""
    memo = tmp_path / "verdicts.json"
    st = os.stat(model_file)
    key = f"{os.path.realpath(model_file)}:{st.st_size}:{st.st_mtime_ns}"
    memo.write_text(json.dumps({key: {"safe": False, "why": "from the session"}}))
    code = (
        "import sys\n"
        "from llmrun.runners import probe, system\n"
        "print(probe.run_probe(sys.argv[1]).why)\n"
        "print(system.memory_bandwidth_runs.keywords)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, model_file],
        env={**llmrun_env, PROBE_ENV: str(memo)},
        capture_output=True,
        text=True,
        timeout=HANG_S,
        check=True,
    )
    size, reps = QUICK_BANDWIDTH
    assert done.stdout.splitlines() == ["from the session", str({"size_bytes": size, "reps": reps})]


def test_the_bandwidth_probe_is_small_unless_a_test_asks_for_llmruns() -> None:
    small = system.memory_bandwidth_runs
    assert getattr(small, "keywords", None) == {
        "size_bytes": QUICK_BANDWIDTH[0],
        "reps": QUICK_BANDWIDTH[1],
    }
    assert os.environ[BANDWIDTH_ENV] == ",".join(map(str, QUICK_BANDWIDTH))
    assert len(small()) == QUICK_BANDWIDTH[1]


def test_ram_bandwidth_is_llmruns_own_probe(ram_bandwidth: None) -> None:
    assert system.memory_bandwidth_runs is REAL_BANDWIDTH_RUNS
    assert BANDWIDTH_ENV not in os.environ  # in the processes the test starts too


def test_the_tools_run_on_the_wheels_own_libraries(llama_bench_path: Path) -> None:
    """llama.cpp's tools are built against the installed wheel's libllama and libggml (only
    common/ and the tools' sources compile): at run time they load the wheel's files (or, with
    LLMRUN_TOOLS_DIR shared between checkouts, the same bytes in another one's), none of their
    own."""
    wheel = llama_tools.wheel_libraries()
    for tool in TOOLS:
        binary = llama_tools.tool(tool)
        linked = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=True)
        found = dict(re.findall(r"^\s*(lib(?:llama|ggml)\S*) => (\S+)", linked.stdout, re.M))
        assert {"libllama.so.0", "libggml.so.0", "libggml-base.so.0"} <= found.keys(), tool
        for name, path in found.items():
            assert Path(path).resolve().parent.name == "lib", (tool, path)  # llama_cpp/lib
            assert Path(path).read_bytes() == (wheel / name).read_bytes(), (tool, path)
    assert not list(llama_tools.tools_dir().glob("build/**/libllama.so*"))


def faked_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A tools' folder of its own whose sources count as fetched: the build's folder."""
    monkeypatch.setenv("LLMRUN_TOOLS_DIR", str(tmp_path))
    scripts = llama_tools.tools_dir() / "llama.cpp" / "scripts"
    scripts.mkdir(parents=True)
    (scripts / "compare-llama-bench.py").touch()
    return llama_tools.tools_dir() / "build"


def test_the_first_tool_asked_for_builds_all_four_in_one_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One CMake build of every tool the suite runs: common/ compiles once, and `-j` keeps both
    cores busy across the tools (one tool at a time left one idle on llama-server's last files).
    The commands are recorded, not run."""
    build = faked_sources(tmp_path, monkeypatch)
    ran: list[list[str]] = []

    def record(argv: list[str], **_: object) -> None:
        ran.append(argv)
        if "--build" in argv:
            (build / "bin").mkdir(parents=True, exist_ok=True)
            for name in argv[argv.index("--target") + 1 :]:
                (build / "bin" / name).touch()

    monkeypatch.setattr(llama_tools.subprocess, "run", record)
    assert llama_tools.tool("llama-server") == build / "bin" / "llama-server"
    assert [argv[1] for argv in ran] == ["-S", "--build"]
    targets = ran[1][ran[1].index("--target") + 1 :]
    assert targets[0] == "llama-server" and sorted(targets) == sorted(TOOLS)
    for tool in TOOLS:  # built: no other command
        assert llama_tools.tool(tool) == build / "bin" / tool
    assert len(ran) == 2


def test_a_tool_built_while_waiting_for_the_lock_is_not_built_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pytest's workers and checkouts sharing LLMRUN_TOOLS_DIR build the tools once: the lock
    is held while another build runs, and the one that waited finds the tools built (in the
    quick subset, tests/guard.py would fail this test if it started cmake)."""
    build = faked_sources(tmp_path, monkeypatch)
    got: list[Path] = []
    with llama_tools.locked():  # another builder, holding the lock
        waiter = threading.Thread(target=lambda: got.append(llama_tools.tool("llama-bench")))
        waiter.start()
        with open(llama_tools.tools_dir() / ".lock") as other, pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        waiter.join(0.2)
        assert waiter.is_alive() and not got  # waiting for the lock
        (build / "bin").mkdir(parents=True)
        for tool in TOOLS:
            (build / "bin" / tool).touch()
    waiter.join(HANG_S)
    assert got == [build / "bin" / "llama-bench"]


def test_a_binary_being_linked_is_not_used_before_its_build_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The linker writes a tool in place: a worker that found the file while another worker's
    build still held the lock could run it half-written. Only the stamp written after the
    build (or the file, seen under the lock) counts."""
    build = faked_sources(tmp_path, monkeypatch)
    got: list[Path] = []
    with llama_tools.locked():  # another builder, linking
        (build / "bin").mkdir(parents=True)
        (build / "bin" / "llama-bench").touch()  # half-written, as far as anyone knows
        waiter = threading.Thread(target=lambda: got.append(llama_tools.tool("llama-bench")))
        waiter.start()
        waiter.join(0.2)
        assert waiter.is_alive() and not got  # it waits for the build to end
    waiter.join(HANG_S)
    assert got == [build / "bin" / "llama-bench"]
    assert llama_tools.built(build / "bin" / "llama-bench").exists()
