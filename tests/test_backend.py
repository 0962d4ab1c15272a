"""Which llama.cpp backend `make` builds: the choice for each kind of machine, with fakes."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from .conftest import HANG_S, ROOT

if TYPE_CHECKING:  # for the types alone: the module is loaded from its path, as make runs it
    from tools.backend import Choice, Run, Which

spec = importlib.util.spec_from_file_location("backend", ROOT / "tools" / "backend.py")
assert spec is not None and spec.loader is not None
backend = importlib.util.module_from_spec(spec)
sys.modules["backend"] = backend
spec.loader.exec_module(backend)

H200 = "GPU 0: NVIDIA H200 (UUID: GPU-1234)\n"


def machine(
    tools: dict[str, str] | None = None, outputs: dict[str, str] | None = None
) -> tuple[Which, Run]:
    """which() and run() of a machine with these tools and these command outputs."""
    tools, outputs = tools or {}, outputs or {}

    def which(name: str) -> str | None:
        return tools.get(name)

    def run(command: list[str]) -> str | None:
        return outputs.get(" ".join(command))

    return which, run


def nvidia(compute_cap: str = "9.0") -> dict[str, str]:
    return {
        "nvidia-smi -L": H200,
        "nvidia-smi --query-gpu=compute_cap --format=csv,noheader": compute_cap + "\n",
    }


def choose(
    requested: str = "auto",
    *,
    system: str = "Linux",
    machine_: str = "x86_64",
    env: dict[str, str] | None = None,
    **kw: dict[str, str],
) -> Choice:
    which, run = machine(kw.get("tools"), kw.get("outputs"))
    return backend.choose(
        requested,
        which=which,
        run=run,
        system=system,
        machine=machine_,
        env=env or {},
        executable=lambda path: False,
    )


def test_a_plain_machine_builds_for_the_cpu() -> None:
    c = choose()
    assert (c.name, c.cmake_args) == ("cpu", "")


def test_nvcc_and_an_nvidia_gpu_build_cuda_for_that_gpu() -> None:
    c = choose(
        tools={"nvcc": "/usr/local/cuda/bin/nvcc", "nvidia-smi": "/usr/bin/nvidia-smi"},
        outputs=nvidia("9.0"),
    )
    assert c.name == "cuda"
    assert c.cmake_args == "-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90"
    assert "NVIDIA H200" in c.why


def test_nvcc_without_a_gpu_stays_on_the_cpu_and_says_how_to_force_it() -> None:
    c = choose(tools={"nvcc": "/usr/local/bin/nvcc"})
    assert c.name == "cpu" and "make GPU=cuda" in c.why


def test_a_gpu_without_the_toolkit_says_what_to_install() -> None:
    c = choose(tools={"nvidia-smi": "/usr/bin/nvidia-smi"}, outputs=nvidia())
    assert c.name == "cpu" and "no CUDA toolkit" in c.why and "NVIDIA H200" in c.why


def test_apple_silicon_builds_metal() -> None:
    c = choose(system="Darwin", machine_="arm64")
    assert (c.name, c.cmake_args) == ("metal", "-DGGML_METAL=on")
    assert choose(system="Darwin", machine_="x86_64").name == "cpu"  # an Intel Mac


def test_rocm_builds_hip_for_the_gpus_it_lists() -> None:
    c = choose(
        tools={"hipcc": "/opt/rocm/bin/hipcc"},
        outputs={"rocminfo": "Agent 2\n  Name:  gfx90a\n  Name: gfx90a\n"},
    )
    assert (c.name, c.cmake_args) == ("hip", "-DGGML_HIP=on -DAMDGPU_TARGETS=gfx90a")


def test_an_explicit_choice_wins_and_extra_flags_are_added() -> None:
    c = choose("cuda")  # no GPU to ask: the common architectures
    assert (
        c.cmake_args == f"-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES={backend.CUDA_FALLBACK_ARCHS}"
    )
    assert choose("vulkan").cmake_args == "-DGGML_VULKAN=on"
    forced_cpu = choose("cpu", tools={"nvcc": "/x/nvcc"}, outputs=nvidia())
    assert (forced_cpu.name, forced_cpu.cmake_args) == ("cpu", "")
    blas = choose("cpu", env={"LLMRUN_CMAKE_ARGS": "-DGGML_BLAS=ON"})
    assert blas.cmake_args == "-DGGML_BLAS=ON"
    with pytest.raises(ValueError):
        choose("tpu")


def test_every_build_has_its_own_cache_key() -> None:
    keys = {
        choose("cpu").key,
        choose("cuda").key,
        choose("vulkan").key,
        choose("cpu", env={"LLMRUN_CMAKE_ARGS": "-DGGML_BLAS=ON"}).key,
        choose("cuda", outputs=nvidia("8.6")).key,
    }
    assert len(keys) == 5  # a CPU wheel never satisfies a GPU build, nor one GPU's another's


def fake_tools(folder: Path, scripts: dict[str, str]) -> dict[str, str]:
    folder.mkdir()
    for name, body in scripts.items():
        path = folder / name
        path.write_text("#!/bin/sh\n" + body)
        path.chmod(0o755)
    # nothing else from /usr/local/bin (this machine has a real nvcc there)
    return {**os.environ, "PATH": f"{folder}:/usr/bin:/bin"}


def make_n(env: dict[str, str], tmp_path: Path, *args: str) -> str:
    done = subprocess.run(
        ["make", "-n", "setup", f"VENV={tmp_path / 'venv'}", f"PYTHON={sys.executable}", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize(
    ("scripts", "args", "expected"),
    [
        ({}, (), 'CMAKE_ARGS=""'),
        (
            {
                "nvcc": "exit 0\n",
                "nvidia-smi": 'case "$1" in -L) echo "GPU 0: NVIDIA H200 (UUID: x)";;'
                " *) echo 9.0;; esac\n",
            },
            (),
            'CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90"',
        ),
        ({"nvcc": "exit 0\n"}, (), 'CMAKE_ARGS=""'),
        ({"nvcc": "exit 0\n"}, ("GPU=cuda",), "-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=75;"),
        (
            {"hipcc": "exit 0\n", "rocminfo": "echo '  Name: gfx1100'\n"},
            (),
            'CMAKE_ARGS="-DGGML_HIP=on -DAMDGPU_TARGETS=gfx1100"',
        ),
        ({}, ("GPU=vulkan",), 'CMAKE_ARGS="-DGGML_VULKAN=on"'),
    ],
)
def test_make_n_shows_the_cmake_args_of_each_case(
    tmp_path: Path,
    scripts: dict[str, str],
    args: tuple[str, ...],
    expected: str,
    llmrun_env: dict[str, str],
) -> None:
    env = fake_tools(tmp_path / "bin", scripts)
    assert expected in make_n(env, tmp_path, *args)


def test_llmrun_cmake_args_reach_the_build(tmp_path: Path, llmrun_env: dict[str, str]) -> None:
    env = fake_tools(tmp_path / "bin", {})
    env["LLMRUN_CMAKE_ARGS"] = "-DGGML_BLAS=ON -DGGML_BLAS_VENDOR=OpenBLAS"
    assert 'CMAKE_ARGS="-DGGML_BLAS=ON -DGGML_BLAS_VENDOR=OpenBLAS"' in make_n(env, tmp_path)
