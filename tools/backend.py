"""Which llama.cpp backend `make` builds llama-cpp-python with, and how it installs it.

llama-cpp-python compiles llama.cpp from source; CMake flags in CMAKE_ARGS pick the backend.
`choose` decides from what the machine has (a pure function of its inputs, tested with fakes):

- `GPU=auto` (the default): Metal on Apple Silicon, CUDA where `nvcc` is found and
  `nvidia-smi` lists a GPU, ROCm/HIP where `hipcc` is found and `rocminfo` lists a GPU,
  otherwise the CPU. A compiler without the GPU (a build host, a container without the device)
  gets the CPU, since a GPU build there only costs build time; `GPU=cuda` builds it anyway.
  Vulkan only on request.
- `GPU=cuda|metal|hip|vulkan|cpu` forces one; `LLMRUN_CMAKE_ARGS` adds flags to any of them.

Wheels are cached per backend and flags: pip's own wheel cache is keyed by the source archive
alone, so a CPU wheel there would satisfy a CUDA build (or the reverse). Only the plain CPU build
(no flags at all) uses pip's cache; every other build goes into its own folder under
~/.cache/llmrun/wheels/KEY and is installed from there.

    python tools/backend.py name|cmake-args|why|key|check|install [GPU]

Only the standard library: it runs before the virtual environment has anything in it.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

BACKENDS = ("cuda", "metal", "hip", "vulkan", "cpu")
LLAMA_CPP = "llama-cpp-python>=0.3.36,<0.4"
# Architectures for a CUDA build on a host whose GPU cannot be asked (Turing to Hopper)
CUDA_FALLBACK_ARCHS = "75;80;86;89;90"


@dataclass(frozen=True)
class Choice:
    name: str
    cmake_args: str
    why: str

    @property
    def key(self) -> str:
        digest = hashlib.sha256(f"{self.name}|{self.cmake_args}".encode()).hexdigest()[:12]
        return f"{self.name}-{digest}"


Which = Callable[[str], str | None]
Run = Callable[[list[str]], str | None]


def _run(command: list[str]) -> str | None:
    """A command's stdout, or None when it is missing or fails."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def _executable(path: str) -> bool:
    return os.access(path, os.X_OK)


def find_tool(
    name: str, which: Which, extra_dirs: tuple[str, ...], executable: Callable[[str], bool]
) -> str | None:
    """On PATH, or in the folder its toolkit installs into by default."""
    found = which(name)
    if found:
        return found
    for folder in extra_dirs:
        candidate = os.path.join(folder, name)
        if executable(candidate):
            return candidate
    return None


def nvidia_gpus(run: Run) -> list[str]:
    """The NVIDIA GPUs the driver lists ('GPU 0: NVIDIA H200 (UUID: ...)' -> 'NVIDIA H200')."""
    out = run(["nvidia-smi", "-L"]) or ""
    return [
        line.split(":", 1)[1].split("(UUID")[0].strip()
        for line in out.splitlines()
        if line.startswith("GPU ") and ":" in line
    ]


def cuda_archs(run: Run) -> tuple[str, str]:
    """The GPUs' compute capabilities as CMake wants them ('90'), or a fallback list."""
    out = run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"])
    caps = sorted(
        {
            line.strip().replace(".", "")
            for line in (out or "").splitlines()
            if line.strip().replace(".", "").isdigit()
        }
    )
    if caps:
        return ";".join(caps), f"for this machine's GPU (compute capability {', '.join(caps)})"
    return CUDA_FALLBACK_ARCHS, "no GPU answered nvidia-smi, so for common architectures"


def hip_targets(run: Run) -> str | None:
    out = run(["rocminfo"]) or ""
    names = sorted({w for w in out.split() if w.startswith("gfx") and w[3:].isalnum()})
    return ";".join(names) or None


def choose(
    requested: str = "auto",
    *,
    which: Which = shutil.which,
    run: Run = _run,
    system: str | None = None,
    machine: str | None = None,
    env: Mapping[str, str] | None = None,
    executable: Callable[[str], bool] = _executable,
) -> Choice:
    """The backend and CMake flags for this machine, and why."""
    env = os.environ if env is None else env
    system = system or platform.system()
    machine = machine or platform.machine()
    requested = (requested or "auto").strip().lower()
    if requested not in (*BACKENDS, "auto"):
        raise ValueError(f"GPU={requested}: choose one of auto, {', '.join(BACKENDS)}")
    nvcc = find_tool("nvcc", which, ("/usr/local/cuda/bin", "/opt/cuda/bin"), executable)
    hipcc = find_tool("hipcc", which, ("/opt/rocm/bin",), executable)
    apple_silicon = system == "Darwin" and machine in ("arm64", "aarch64")
    name, why = requested, f"GPU={requested} was asked for"
    if requested == "auto":
        nvidia = nvidia_gpus(run)
        amd = hip_targets(run)
        if apple_silicon:
            name, why = "metal", "Apple Silicon: Metal (llama-cpp-python's default there)"
        elif nvcc and nvidia:
            name, why = "cuda", f"{nvidia[0]} and the CUDA compiler ({nvcc}) were found"
        elif hipcc and amd:
            name, why = "hip", f"an AMD GPU ({amd}) and the ROCm compiler ({hipcc}) were found"
        else:
            name, why = "cpu", "no GPU with its compiler, and no Apple Silicon: the CPU"
            if nvidia:
                why += (
                    f" ({nvidia[0]} is here but no CUDA toolkit: install it, then `make GPU=cuda`)"
                )
            elif nvcc:
                why += f" (nvcc is here, {nvcc}, but no NVIDIA GPU answered; `make GPU=cuda`"
                why += " builds for CUDA anyway)"
            elif amd:
                why += f" (an AMD GPU, {amd}, is here but no hipcc: install ROCm)"
    args: list[str] = []
    if name == "cuda":
        archs, how = cuda_archs(run)
        args += ["-DGGML_CUDA=on", f"-DCMAKE_CUDA_ARCHITECTURES={archs}"]
        why += f"; built {how}"
        if nvcc and not which("nvcc"):
            args.append(f"-DCMAKE_CUDA_COMPILER={nvcc}")
    elif name == "metal":
        args.append("-DGGML_METAL=on")
    elif name == "hip":
        args.append("-DGGML_HIP=on")
        targets = hip_targets(run)
        if targets:
            args.append(f"-DAMDGPU_TARGETS={targets}")
    elif name == "vulkan":
        args.append("-DGGML_VULKAN=on")
    extra = env.get("LLMRUN_CMAKE_ARGS", "").strip()
    if extra:
        args.append(extra)
        why += f"; with LLMRUN_CMAKE_ARGS={extra}"
    return Choice(name, " ".join(args), why)


def problem(choice: Choice, which: Which = shutil.which) -> str | None:
    """Why a build for this choice cannot work here, before minutes of compiling say so."""
    if choice.name == "cuda" and not find_tool(
        "nvcc", which, ("/usr/local/cuda/bin",), _executable
    ):
        return "GPU=cuda needs the CUDA toolkit's nvcc (on PATH or in /usr/local/cuda/bin)"
    if choice.name == "hip" and not find_tool("hipcc", which, ("/opt/rocm/bin",), _executable):
        return "GPU=hip needs ROCm's hipcc (on PATH or in /opt/rocm/bin)"
    if choice.name == "vulkan" and not which("glslc"):
        return "GPU=vulkan needs the Vulkan SDK's glslc on PATH"
    if choice.name == "metal" and platform.system() != "Darwin":
        return "GPU=metal builds only on macOS"
    return None


def install(choice: Choice, python: str) -> None:
    """Install llama-cpp-python for this choice into the venv of `python` (once per key)."""
    venv = Path(python).absolute().parent.parent  # not resolved: the venv's python is a link
    marker = venv / ".llama-backend"
    previous = marker.read_text().strip() if marker.exists() else None
    if previous == choice.key:
        return
    pip = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    replace = ["--force-reinstall", "--no-deps"] if previous else []
    if not choice.cmake_args:  # the plain CPU build: pip's own wheel cache serves it
        subprocess.run(
            [*pip, *replace, LLAMA_CPP], check=True, env={**os.environ, "CMAKE_ARGS": ""}
        )
    else:
        wheels = Path.home() / ".cache" / "llmrun" / "wheels" / choice.key
        if not list(wheels.glob("llama_cpp_python-*.whl")):
            print(
                f"building llama-cpp-python for {choice.name} ({choice.cmake_args});"
                " this takes several minutes",
                flush=True,
            )
            build = [
                python,
                "-m",
                "pip",
                "wheel",
                "--quiet",
                "--no-deps",
                "--no-cache-dir",
                "--no-binary",
                "llama-cpp-python",
                "-w",
                str(wheels),
                LLAMA_CPP,
            ]
            env = {**os.environ, "CMAKE_ARGS": choice.cmake_args}
            subprocess.run(build, check=True, env=env)
        wheel = sorted(wheels.glob("llama_cpp_python-*.whl"))[-1]
        subprocess.run([*pip, "--force-reinstall", "--no-deps", str(wheel)], check=True)
        subprocess.run([*pip, str(wheel)], check=True)  # its dependencies
    marker.write_text(choice.key + "\n")


def main(argv: list[str]) -> int:
    what = argv[1] if len(argv) > 1 else "name"
    try:
        choice = choose(argv[2] if len(argv) > 2 else "auto")
    except ValueError as e:
        print(f"backend: {e}", file=sys.stderr)
        return 2
    if what == "check":
        why_not = problem(choice)
        if why_not:
            print(f"make: {why_not}", file=sys.stderr)
            return 1
        print(f"llama.cpp backend: {choice.name} ({choice.why})")
        return 0
    if what == "install":
        install(choice, argv[3] if len(argv) > 3 else sys.executable)
        return 0
    values = {
        "name": choice.name,
        "cmake-args": choice.cmake_args,
        "why": choice.why,
        "key": choice.key,
    }
    if what not in values:
        print(f"backend: unknown request '{what}'", file=sys.stderr)
        return 2
    print(values[what])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
