"""The quick subset's guard (tests/guard.py) catches a test that starts a process or loads a
model without the fixture that marks it, even when the test swallows the error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from .conftest import HANG_S, ROOT

SCRATCH = """
import subprocess, sys
import pytest

def test_plain():
    assert sum([1, 2]) == 3

def test_starts_a_process():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

def test_swallows_the_refusal():
    try:
        subprocess.run(["true"])
    except Exception:
        pass

def test_loads_a_model_after_importing_llama_cpp():
    import llama_cpp
    llama_cpp.llama_model_load_from_file(b"missing.gguf", llama_cpp.llama_model_default_params())

def test_loads_a_model_with_llama_cpp_already_imported():
    import llama_cpp
    llama_cpp.llama_model_load_from_file(b"missing.gguf", llama_cpp.llama_model_default_params())

def test_loads_a_model_through_llama_cpp_python():
    import llama_cpp
    from llmrun.runners.models import default_model_path
    llama_cpp.Llama(model_path=default_model_path(), n_ctx=64, verbose=False).close()

def test_asks_llama_cpp_about_the_build():
    import llama_cpp
    assert isinstance(llama_cpp.llama_supports_gpu_offload(), bool)

@pytest.mark.pty
def test_marked_may_start_a_process():
    subprocess.run([sys.executable, "-c", "pass"], check=True)
"""


def test_the_guard_fails_unmarked_processes_and_model_loads(
    tmp_path: Path, llmrun_env: dict[str, str]
) -> None:
    scratch = tmp_path / "test_scratch.py"
    scratch.write_text(SCRATCH)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "tests.guard",
            "-p",
            "no:cacheprovider",
            "-q",
            "-rA",
            "-W",
            "ignore::pytest.PytestUnknownMarkWarning",
            str(scratch),
        ],
        cwd=ROOT,
        env=llmrun_env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    outcomes: dict[str, set[str]] = {"PASSED": set(), "FAILED": set(), "ERROR": set()}
    for line in out.splitlines():
        word = line.split(" ", 1)[0]
        if word in outcomes and "::" in line:
            outcomes[word].add(line.split("::")[1].split()[0])
    failed = outcomes["FAILED"] | outcomes["ERROR"]
    assert failed == {
        "test_starts_a_process",
        "test_swallows_the_refusal",
        "test_loads_a_model_after_importing_llama_cpp",
        "test_loads_a_model_with_llama_cpp_already_imported",
        "test_loads_a_model_through_llama_cpp_python",
    }, out
    assert "calls subprocess.Popen" in out and "calls llama_cpp.llama_model_load_from_file" in out
    assert outcomes["PASSED"] - failed == {
        "test_plain",
        "test_asks_llama_cpp_about_the_build",
        "test_marked_may_start_a_process",
    }, out
