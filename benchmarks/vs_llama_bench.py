"""llmrun bench against llama-bench, side by side, in B A B order (target: ratios >= 0.98).

llama-bench is built from the sources of the llama-cpp-python that is installed (the same
llama.cpp commit llmrun loads; about 5 minutes once, on 2 cores), or taken from $LLAMA_BENCH.
Each round runs llama-bench, then `llmrun bench`, then llama-bench again with the same model,
threads, batch sizes, flash attention and repacking, and divides llmrun's pp and tg rates by
the mean of the two llama-bench runs around it, so a machine that drifts moves both sides.

Two ratios are printed for each test: of the mean rates (what each tool reports as avg_ts) and
of the best repetition on each side (the largest of samples_ts). Other work on a shared machine
only ever slows a repetition down, so the best repetitions are the figure least moved by it,
as timeit takes the fastest of its runs; the means show how much the noise moved.

    .venv/bin/python benchmarks/vs_llama_bench.py [--rounds 3] [--threads 2] [--repack 1]

--repack defaults to what llmrun's probe allows on this CPU: 1, or 0 on a CPU with AMX, where
llama-bench dies by SIGILL with repacking on (tests/llama_tools.cpu_flags).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llmrun.runners.models import default_model_path
from tests import llama_tools

LLMRUN = str(Path(sys.executable).parent / "llmrun")


def rates(command: list[str]) -> dict[str, float]:
    """{"pp": mean, "tg": mean, "pp best": largest repetition, "tg best": …} in tok/s."""
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"{command[0]} failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    out: dict[str, float] = {}
    for row in json.loads(done.stdout):
        kind = "pp" if row["n_prompt"] else "tg"
        out[kind] = float(row["avg_ts"])
        out[f"{kind} best"] = max(float(x) for x in row["samples_ts"])
    return out


def side_by_side(flags: list[str], rounds: int, binary: str | None = None) -> None:
    """`rounds` rounds of llama-bench, `llmrun bench`, llama-bench with the same `flags`
    (llama-bench's, without -o), each test's ratio printed per round and as a median."""
    llama_bench = [binary or str(llama_tools.llama_bench()), *flags, "-o", "json"]
    ours = [LLMRUN, "bench", *flags, "-o", "json", "--no-history", "--no-tuned"]
    ratios: dict[str, list[float]] = {}
    before = rates(llama_bench)
    for i in range(rounds):
        mine = rates(ours)
        after = rates(llama_bench)
        cells = []
        for kind in mine:
            reference = (before[kind] + after[kind]) / 2
            ratios.setdefault(kind, []).append(mine[kind] / reference)
            cells.append(
                f"{kind} llama-bench {before[kind]:.1f}/{after[kind]:.1f}, llmrun"
                f" {mine[kind]:.1f} -> x{ratios[kind][-1]:.3f}"
            )
        print(f"round {i + 1}: " + "; ".join(cells))
        before = after
    n_prompt, n_gen = flags[flags.index("-p") + 1], flags[flags.index("-n") + 1]
    for kind, values in ratios.items():
        test = f"pp{n_prompt}" if kind.startswith("pp") else f"tg{n_gen}"
        label = test + (", best reps" if kind.endswith("best") else "")
        spread = f"range {min(values):.3f}-{max(values):.3f}, {len(values)} rounds B A B"
        print(f"{label}: llmrun / llama-bench median x{statistics.median(values):.3f} ({spread})")


def positive(text: str) -> int:
    """A count of at least 1: llama-bench aborts on -t 0, fails on -b 0, and 0 rounds or
    repetitions compare nothing."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a whole number of at least 1")
    return value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=positive, default=3)
    ap.add_argument("--threads", type=positive, default=2)
    ap.add_argument("--batch", type=positive, default=512)
    ap.add_argument("--repack", type=int, choices=(0, 1), default=None)
    ap.add_argument("--reps", type=positive, default=5)
    args = ap.parse_args()
    model = args.model or default_model_path()
    safe = not llama_tools.cpu_flags("llama-bench", model)
    if args.repack is None:
        args.repack = int(safe)
    elif args.repack and not safe:
        ap.error("--repack 1: llmrun's probe found repacking unsafe on this CPU (llama-bench dies)")
    print(
        f"model {Path(model).name}, {args.threads} threads, batch {args.batch}, repack"
        f" {args.repack}, {args.reps} repetitions"
    )
    side_by_side(
        [
            "-m",
            model,
            "-t",
            str(args.threads),
            "-b",
            str(args.batch),
            "-ub",
            str(args.batch),
            "-fa",
            "0",
            "-ngl",
            "0",
            "--repack",
            str(args.repack),
            "-p",
            "512",
            "-n",
            "128",
            "-r",
            str(args.reps),
        ],
        args.rounds,
    )


if __name__ == "__main__":
    import script  # benchmarks/script.py: Ctrl-C is exit 130

    script.run(main)
