"""How much wall time the runner adds on top of llama.cpp's own accounting.

Runs greedy generations with the real engine and compares, over the same requests:
- prefill: the runner's timed prefill (decode calls + synchronize) against llama.cpp's
  prompt-eval time;
- decode: the runner's time per decode step (first token to last) against llama.cpp's eval time
  per token, with and without llama.cpp's own sampling time.
Targets: prefill within 2 %, decode step within 3 % of llama.cpp's eval + sampling.
Ratios come from the same runs, so a noisy machine moves both sides together.

    .venv/bin/python benchmarks/overhead.py [--model PATH] [--reps 5] [--prompt 512] [--gen 128]
"""

from __future__ import annotations

import argparse
import statistics
import sys

from llmrun.runners.base import Request, SamplingParams, generate
from llmrun.runners.config import EngineConfig
from llmrun.runners.llamacpp import LlamaCppRunner
from llmrun.runners.models import resolve_model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--gen", type=int, default=128)
    args = parser.parse_args()

    runner = LlamaCppRunner(resolve_model(args.model).path, EngineConfig(n_ctx=2048))
    loaded = runner.load()
    print(f"model {loaded.model.name} · {loaded.settings.n_threads} threads", file=sys.stderr)
    tokens = tuple(1000 + (i * 7919) % 20000 for i in range(args.prompt))
    sampling = SamplingParams(max_tokens=args.gen, temperature=0, ignore_eos=True)
    request = Request(token_ids=tokens, sampling=sampling, keep_cache=False)
    generate(runner, request)  # warm-up
    prefill, step_vs_eval, step_vs_eval_sample = [], [], []
    for _ in range(args.reps):
        s = generate(runner, request).stats
        assert s.engine_prompt_eval_ms and s.engine_eval_ms and s.engine_n_eval
        prefill.append(s.prefill_s * 1000 / s.engine_prompt_eval_ms)
        step_ms = s.decode_s * 1000 / len(s.itl_s)
        eval_ms = s.engine_eval_ms / s.engine_n_eval
        sample_ms = (s.engine_sample_ms or 0) / max(s.engine_n_sample or 1, 1)
        step_vs_eval.append(step_ms / eval_ms)
        step_vs_eval_sample.append(step_ms / (eval_ms + sample_ms))
        print(
            f"prefill {s.prompt_tps:7.1f} tok/s wall {s.prefill_s * 1000:8.1f} ms"
            f" llama.cpp {s.engine_prompt_eval_ms:8.1f} ms | decode {s.output_tps:6.1f} tok/s"
            f" step {step_ms:6.3f} ms eval {eval_ms:6.3f} ms sample {sample_ms:6.3f} ms",
            file=sys.stderr,
        )
    runner.close()
    results = [
        ("prefill wall / llama.cpp prompt-eval", statistics.median(prefill), 1.02),
        ("decode step / llama.cpp (eval + sample)", statistics.median(step_vs_eval_sample), 1.03),
        ("decode step / llama.cpp eval alone", statistics.median(step_vs_eval), None),
    ]
    ok = True
    for name, ratio, limit in results:
        verdict = "" if limit is None else ("  ok" if ratio <= limit else f"  OVER {limit:.2f}")
        ok &= limit is None or ratio <= limit
        print(f"{name:42s} {ratio:6.4f}{verdict}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
