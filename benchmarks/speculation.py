"""Prompt-lookup speculative decoding against plain greedy decoding, on two tasks.

Rewriting piped text (the answer repeats the prompt, so lookup drafts are accepted) and an
open-ended answer (little to look up). Each task runs plain and speculative in alternating
order, `--rounds` times, and prints the decode tok/s ratio (speculative / plain), the
acceptance rate, the tokens per decode step, and whether the two texts were identical.

    .venv/bin/python benchmarks/speculation.py [--rounds 3] [--tokens 160] [--draft 8]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from llmrun.runners.base import Request, SamplingParams, generate
from llmrun.runners.config import EngineConfig
from llmrun.runners.llamacpp import LlamaCppRunner
from llmrun.runners.models import default_model_path

ROOT = Path(__file__).resolve().parent.parent
TEXT = (ROOT / "examples" / "declaration_of_independence.txt").read_text()[:1500]
TASKS = {
    "rewrite": f"Repeat this text exactly:\n\n{TEXT}",
    "open-ended": "Write a short story about a lighthouse keeper and a storm.",
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--draft", type=int, default=8)
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    runner = LlamaCppRunner(args.model or default_model_path(), EngineConfig(n_ctx=4096))
    for name, prompt in TASKS.items():
        ratios, rates, steps, same = [], [], [], []
        for _ in range(args.rounds):
            runs = {}
            for draft in (0, args.draft):
                sampling = SamplingParams(max_tokens=args.tokens, temperature=0, draft=draft)
                runs[draft] = generate(runner, Request.chat(prompt, sampling=sampling))
            plain, fast = runs[0].stats, runs[args.draft].stats
            ratios.append((fast.output_tps or 0) / (plain.output_tps or 1))
            rates.append(fast.acceptance_rate or 0.0)
            steps.append(fast.tokens_per_step or 1.0)
            same.append(runs[0].text == runs[args.draft].text)
        print(
            f"{name}: decode tok/s speculative/plain median x{statistics.median(ratios):.2f}"
            f" (range {min(ratios):.2f}-{max(ratios):.2f}), acceptance"
            f" {statistics.median(rates):.0%}, {statistics.median(steps):.2f} tokens per step,"
            f" identical text in {sum(same)} of {len(same)} rounds"
        )
    runner.close()
    return 0


if __name__ == "__main__":
    import script  # benchmarks/script.py: Ctrl-C is exit 130

    script.run(main)
