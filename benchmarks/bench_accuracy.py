"""Do `llmrun bench`'s tok/s agree with llama.cpp's own performance counters?

Runs llama-bench's default tests (pp512, tg128, and pp512+tg128) through the same code as
`llmrun bench`, and prints, per test, the rate llmrun reports beside the rate llama.cpp's
counters give for the same repetitions (prompt eval time for prefill; eval plus sampling time
for decode). Target: within 2 %, so llmrun's numbers can stand beside llama-bench's.

    .venv/bin/python benchmarks/bench_accuracy.py [--model PATH] [--reps 5] [-p 512] [-n 128]
"""

from __future__ import annotations

import argparse

from llmrun.runners.bench import measure as b
from llmrun.runners.bench import results as res
from llmrun.runners.bench import sweep as sw
from llmrun.runners.config import EngineConfig
from llmrun.runners.llamacpp import LlamaCppRunner
from llmrun.runners.models import resolve_model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("-p", type=int, default=512)
    parser.add_argument("-n", type=int, default=128)
    args = parser.parse_args()

    runner = LlamaCppRunner(resolve_model(args.model).path)
    shapes = [sw.Shape(args.p, 0), sw.Shape(0, args.n), sw.Shape(args.p, args.n)]
    worst = 0.0
    print(f"{'test':<14} {'llmrun t/s':>12} {'llama.cpp t/s':>14} {'difference':>11}")
    plan = b.BenchPlan(b.every_shape([sw.Combo()], shapes), reps=args.reps)
    for event in b.run_bench(runner, plan, base=EngineConfig()):
        if isinstance(event, res.Result):
            ours, theirs = event.avg_ts, event.engine_avg_ts or 0.0
            diff = ours / theirs - 1 if theirs else float("inf")
            worst = max(worst, abs(diff))
            print(f"{event.shape.name:<14} {ours:>12.2f} {theirs:>14.2f} {diff:>+11.2%}")
    runner.close()
    print(f"largest difference {worst:.2%} (target: within 2 %)")
    return 0 if worst <= 0.02 else 1


if __name__ == "__main__":
    import script  # benchmarks/script.py: Ctrl-C is exit 130

    script.run(main)
