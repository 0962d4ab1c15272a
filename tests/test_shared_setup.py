"""What the tests share or fake so the suite stays quick and runs on every CPU: llmrun's
repacking probe once a session (tests/inject/sitecustomize.py), a small bandwidth probe, and
llama.cpp's own tools run with the flags this CPU needs (tests/llama_tools.py)."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest

from llmrun.runners import devices as dv
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


@pytest.mark.parametrize("safe", [True, False])
def test_the_one_llama_server_launcher_passes_the_cpus_flags_and_says_how_it_ended(
    model_file: str,
    safe: bool,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    llmrun_env: dict[str, str],  # a process starts (the stand-in)
) -> None:
    """The tests' own llama-server launcher passed no --no-repack: on the AMX Xeon two
    `cores` tests died by SIGILL. The one launcher adds the probe's flags, and a server that
    ends is named with its exit status and command line (here a stand-in that exits 3)."""
    stand_in = tmp_path / "llama-server"
    stand_in.write_text("#!/bin/sh\nexit 3\n")
    stand_in.chmod(0o755)
    monkeypatch.setattr(llama_tools, "llama_server", lambda: stand_in)
    llama_tools.answer_probe(model_file, safe=safe)
    log = tmp_path / "server.log"
    with (
        pytest.raises(llama_tools.NotStarted) as e,
        llama_tools.llama_cpp_server(model_file, "-np", "1", ready_s=HANG_S, log=log),
    ):
        raise AssertionError("it never answered")
    said = str(e.value)
    assert said.startswith(f"llama-server exited 3 ({stand_in} -m {model_file} -np 1 --host")
    assert ("--no-repack" in said) is not safe and said.endswith(f"; its log: {log}")


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
    """A tools' folder of its own whose sources count as fetched, and no machine-level cache
    (the tests below fake one): the build's folder."""
    monkeypatch.setenv("LLMRUN_TOOLS_DIR", str(tmp_path))
    monkeypatch.setenv(llama_tools.CACHE_ENV, "0")
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
    # llama-bench's build_commit: the wheel's commit, as llmrun records it (`unknown` before:
    # the sdist has no .git), so compare-llama-bench.py pairs the two tools' rows by it
    commit = dv.build_commit(dv.query().commit())
    assert commit != "unknown" and f"-DLLAMA_BUILD_COMMIT={commit}" in ran[0]
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


def fake_wheel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, list[str]]:
    """A machine-level cache of its own in `tmp_path`, a fake wheel's libraries, and a build
    step that writes tiny shell scripts as the tools (each with a RUNPATH of $ORIGIN/lib in its
    bytes, as a real build's string table has) and records what it built: the libraries' folder
    and that record. No process starts: the compilers' lines are faked too."""
    libs = tmp_path / "wheel" / "llama_cpp" / "lib"
    libs.mkdir(parents=True)
    for name in ("libllama.so.0", "libggml.so.0", "libggml-base.so.0", "libggml-cpu.so.0"):
        (libs / name).write_bytes(name.encode() * 100)
    (libs / "libmtmd.so.0").write_bytes(b"mtmd")
    monkeypatch.setattr(llama_tools, "wheel_libraries", lambda: libs)
    monkeypatch.setattr(llama_tools, "toolchain", lambda: "c++: fake 1.0")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv(llama_tools.CACHE_ENV, "1")
    builds: list[str] = []

    def build(name: str, together: tuple[str, ...]) -> None:
        builds.append(name)
        bin_dir = llama_tools.tools_dir() / "build" / "bin"
        bin_dir.mkdir(parents=True, exist_ok=True)
        for tool in (name, *together):
            (bin_dir / tool).write_bytes(fake_tool(tool))
            (bin_dir / tool).chmod(0o755)
            llama_tools.built(bin_dir / tool).touch()

    monkeypatch.setattr(llama_tools, "build", build)
    return libs, builds


def fake_tool(name: str, runpath: bytes = llama_tools.RUNPATH) -> bytes:
    return f"#!/bin/sh\necho {name}\n# RUNPATH ".encode() + runpath + b"\n"


def in_checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> Path:
    """Another checkout's tools' folder, fresh: its build's bin folder."""
    monkeypatch.setenv("LLMRUN_TOOLS_DIR", str(tmp_path / name))
    return llama_tools.tools_dir() / "build" / "bin"


def no_process(*args: object, **kwargs: object) -> None:
    raise AssertionError(f"a process was started: {args}")


def test_the_cache_key_changes_with_every_byte_of_the_wheels_libraries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another wheel (another backend, another version: other bytes) is another key, and so is
    another toolchain; files that are not the libraries the tools link do not count."""
    libs, _ = fake_wheel(tmp_path, monkeypatch)
    key = llama_tools.cache_key(libs)
    assert key == llama_tools.cache_key(libs) and len(key) == 16
    (libs / "__init__.py").write_text("# not a library")
    assert llama_tools.cache_key(libs) == key
    cpu = libs / "libggml-cpu.so.0"
    flipped = bytearray(cpu.read_bytes())
    flipped[50] ^= 1
    cpu.write_bytes(bytes(flipped))
    other = llama_tools.cache_key(libs)
    assert other != key
    (libs / "libggml-cuda.so").write_bytes(b"a backend more")
    assert llama_tools.cache_key(libs) not in (key, other)
    monkeypatch.setattr(llama_tools, "toolchain", lambda: "c++: fake 2.0")
    assert llama_tools.cache_key(libs) not in (key, other)


def test_a_second_checkout_copies_the_tools_built_by_the_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first checkout builds and stores the four tools (a folder written aside, then one
    rename); the second copies them into its own bin folder with a `lib` link to its own
    wheel, stamped, without fetching or building anything."""
    libs, builds = fake_wheel(tmp_path, monkeypatch)
    first = in_checkout(tmp_path, monkeypatch, "first")
    assert llama_tools.tool("llama-server") == first / "llama-server"
    assert builds == ["llama-server"]
    assert os.readlink(first / "lib") == str(libs)
    entry = llama_tools.cache_entry()
    assert entry is not None and entry.parent == tmp_path / "xdg" / "llmrun" / "llama-tools"
    left = sorted(p.name for p in entry.parent.iterdir())
    assert left == sorted((entry.name, ".lock"))  # no staging folder left behind
    assert sorted(p.name for p in entry.iterdir()) == sorted((*TOOLS, llama_tools.COMPLETE))

    second = in_checkout(tmp_path, monkeypatch, "second")
    monkeypatch.setattr(llama_tools.subprocess, "run", no_process)  # no pip, no cmake
    assert llama_tools.tool("llama-bench") == second / "llama-bench"
    assert builds == ["llama-server"]
    for tool in TOOLS:
        assert (second / tool).read_bytes() == fake_tool(tool)
        assert os.access(second / tool, os.X_OK)
        assert llama_tools.built(second / tool).exists()
        assert llama_tools.tool(tool) == second / tool
    assert os.readlink(second / "lib") == str(libs)
    assert sorted(p.name for p in second.iterdir() if not p.name.startswith(".")) == sorted(
        (*TOOLS, "lib")
    )


def test_a_whole_entry_is_never_replaced_by_another_checkouts_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two checkouts that built at once both store: the second finds the first's entry whole
    under the cache's lock and leaves it (a checkout copying from it meanwhile reads the files
    its marker records), where it used to delete it and rename its own in."""
    fake_wheel(tmp_path, monkeypatch)
    in_checkout(tmp_path, monkeypatch, "first")
    llama_tools.tool("llama-server")
    entry = llama_tools.cache_entry()
    assert entry is not None and llama_tools.whole(entry)
    marker = (entry / llama_tools.COMPLETE).read_text()
    second = in_checkout(tmp_path, monkeypatch, "second")
    second.mkdir(parents=True)
    for tool in TOOLS:  # its own build: other bytes (the sdist's path differs in real ones)
        (second / tool).write_bytes(fake_tool(tool) + b"# second\n")
    real, checks = llama_tools.whole, []

    def stale(e: Path) -> bool:  # its first check ran before the first checkout's rename
        checks.append(e)
        return len(checks) > 1 and real(e)

    monkeypatch.setattr(llama_tools, "whole", stale)
    llama_tools.store(second, entry)
    assert len(checks) == 2  # checked again under the lock
    assert (entry / llama_tools.COMPLETE).read_text() == marker
    assert (entry / "llama-bench").read_bytes() == fake_tool("llama-bench")


def test_a_shared_folder_keeps_its_library_link_while_it_leads_somewhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tools' folder shared through LLMRUN_TOOLS_DIR: another checkout's use does not point
    `lib` at its own wheel while the first's is there (a tool started meanwhile would load
    either), and points a dangling one (its checkout removed) at its own."""
    libs, _ = fake_wheel(tmp_path, monkeypatch)
    shared = in_checkout(tmp_path, monkeypatch, "shared")
    llama_tools.tool("llama-bench")
    other = tmp_path / "other-wheel"
    other.mkdir()
    monkeypatch.setattr(llama_tools, "wheel_libraries", lambda: other)
    llama_tools.tool("llama-bench")
    assert os.readlink(shared / "lib") == str(libs)
    shutil.rmtree(libs)
    llama_tools.tool("llama-bench")
    assert os.readlink(shared / "lib") == str(other)


def test_an_unwritable_cache_costs_a_build_not_a_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A cache folder that cannot be made (here a file stands where it goes; permissions would
    not stop root) is read as a miss, and storing into it fails in one line, no traceback."""
    _, builds = fake_wheel(tmp_path, monkeypatch)
    (tmp_path / "not-a-folder").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "not-a-folder"))
    bin_dir = in_checkout(tmp_path, monkeypatch, "checkout")
    assert llama_tools.tool("llama-bench") == bin_dir / "llama-bench"
    assert builds == ["llama-bench"]
    assert all(llama_tools.built(bin_dir / tool).exists() for tool in TOOLS)
    err = capsys.readouterr().err
    assert "Traceback" not in err and "not cached in" in err and len(err.splitlines()) <= 2


def test_a_store_that_died_leaves_no_folder_past_the_next_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store killed before its rename (SIGKILL skips its clean-up) left its staging folder
    for good; the next store under the cache's lock removes it, and never a live one's."""
    _, builds = fake_wheel(tmp_path, monkeypatch)
    entry = llama_tools.cache_entry()
    assert entry is not None
    entry.parent.mkdir(parents=True)
    no_pid = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # names no process
    dead = entry.with_name(f".{entry.name}.{no_pid}")
    huge = entry.with_name(f".{entry.name}.{'9' * 30}")  # past a C long: no process either
    live = entry.with_name(f".{entry.name}-other.{os.getpid()}")
    fresh = entry.with_name(f".{entry.name}-fresh.{no_pid}")  # maybe another PID namespace's
    hour_ago = time.time() - llama_tools.STALE_S - 1
    for folder in (dead, huge, live, fresh):
        folder.mkdir()
        (folder / "llama-bench").write_bytes(b"half a copy")
        if folder is not fresh:
            os.utime(folder, (hour_ago, hour_ago))
    in_checkout(tmp_path, monkeypatch, "first")
    llama_tools.tool("llama-bench")
    assert builds == ["llama-bench"] and llama_tools.whole(entry)
    assert not dead.exists() and not huge.exists() and live.exists() and fresh.exists()


@pytest.mark.parametrize("damage", ["no completion marker", "a tool's bytes changed", "garbage"])
def test_a_partial_or_corrupt_cache_entry_is_built_again_and_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    """An entry is used only whole: with its completion marker, written last, and with each
    tool's bytes as that marker records them. Any other is built again, and the build replaces
    it."""
    _, builds = fake_wheel(tmp_path, monkeypatch)
    in_checkout(tmp_path, monkeypatch, "first")
    llama_tools.tool("llama-bench")
    entry = llama_tools.cache_entry()
    assert entry is not None
    if damage == "no completion marker":
        (entry / llama_tools.COMPLETE).unlink()
    elif damage == "a tool's bytes changed":
        (entry / "llama-server").write_bytes(b"#!/bin/sh\nhalf-writ")
    else:
        (entry / llama_tools.COMPLETE).write_text("{not json")
    second = in_checkout(tmp_path, monkeypatch, "second")
    assert llama_tools.tool("llama-bench") == second / "llama-bench"
    assert builds == ["llama-bench", "llama-bench"]
    assert not [p for p in second.iterdir() if p.name.endswith(".cached")]
    third = in_checkout(tmp_path, monkeypatch, "third")  # the entry is whole again
    llama_tools.tool("llama-server")
    assert builds == ["llama-bench", "llama-bench"]
    assert (third / "llama-server").read_bytes() == fake_tool("llama-server")


def test_tools_that_run_only_from_their_checkout_are_not_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tools linked before their RUNPATH was $ORIGIN/lib name their checkout's wheel folder:
    still used there (a finished build is never redone), never copied to another checkout."""
    _, builds = fake_wheel(tmp_path, monkeypatch)
    old = in_checkout(tmp_path, monkeypatch, "old")
    old.mkdir(parents=True)
    (old / "llama-bench").write_bytes(fake_tool("llama-bench", b"/old/checkout/lib\0"))
    llama_tools.built(old / "llama-bench").touch()
    assert llama_tools.tool("llama-bench") == old / "llama-bench"
    assert builds == [] and not (old / "lib").exists()

    def old_build(name: str, together: tuple[str, ...]) -> None:
        builds.append(name)
        for tool in together:
            (old / tool).write_bytes(fake_tool(tool, b"/old/checkout/lib\0"))

    monkeypatch.setattr(llama_tools, "build", old_build)
    llama_tools.tool("llama-server")
    assert builds == ["llama-server"]
    entry = llama_tools.cache_entry()
    assert entry is not None and not entry.exists()


def test_the_cache_is_off_when_the_variable_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, builds = fake_wheel(tmp_path, monkeypatch)
    in_checkout(tmp_path, monkeypatch, "first")
    llama_tools.tool("llama-bench")
    for off in ("0", "off", ""):
        monkeypatch.setenv(llama_tools.CACHE_ENV, off)
        assert llama_tools.cache_entry() is None
        in_checkout(tmp_path, monkeypatch, f"off-{off}")
        llama_tools.tool("llama-bench")
    assert builds == ["llama-bench"] * 4


def test_the_cmake_project_links_the_runpath_the_cache_looks_for() -> None:
    """A build whose RUNPATH named its checkout would never be stored (test below skips then):
    the project sets $ORIGIN/lib, the bytes `store` looks for, and no absolute one."""
    project = llama_tools.CMAKELISTS.read_text()
    assert 'set(CMAKE_INSTALL_RPATH "$ORIGIN/lib")' in project
    assert "set(CMAKE_BUILD_WITH_INSTALL_RPATH ON)" in project
    assert "CMAKE_BUILD_RPATH" not in project
    assert llama_tools.RUNPATH == b"$ORIGIN/lib\0"


def test_a_cached_tool_runs_from_another_checkouts_folder(
    llama_bench_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real tools, stored in a cache of this test's own and copied into a fresh tools'
    folder: the copy of llama-bench loads the wheel's libraries through its own `lib` link and
    runs (it lists ggml's devices, which loads every backend). Tools linked before their
    RUNPATH was $ORIGIN/lib (a checkout's finished build, kept) are not cached, and there is
    nothing to check; any other tools must be stored."""
    built_bin = llama_tools.tool("llama-bench").parent
    if llama_tools.RUNPATH not in (built_bin / "llama-bench").read_bytes():
        pytest.skip(f"the tools in {built_bin} were linked with their checkout's RUNPATH")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv(llama_tools.CACHE_ENV, "1")
    entry = llama_tools.cache_entry()
    assert entry is not None
    llama_tools.store(built_bin, entry)
    assert llama_tools.whole(entry)
    monkeypatch.setenv("LLMRUN_TOOLS_DIR", str(tmp_path / "second"))
    monkeypatch.setattr(llama_tools, "build", no_process)
    bench = llama_tools.tool("llama-bench")
    assert bench.parent != built_bin and bench.parent.joinpath("lib").is_symlink()
    linked = subprocess.run(["ldd", str(bench)], capture_output=True, text=True, check=True)
    found = dict(re.findall(r"^\s*(lib(?:llama|ggml)\S*) => (\S+)", linked.stdout, re.M))
    assert found["libllama.so.0"] == str(bench.parent / "lib" / "libllama.so.0")
    ran = subprocess.run(
        [str(bench), "--list-devices"], capture_output=True, text=True, timeout=HANG_S
    )
    assert ran.returncode == 0 and "Available devices" in ran.stdout, ran.stderr[-2000:]
