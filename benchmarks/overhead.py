"""The wall time the runner adds to llama.cpp's own accounting, and tg128 against llama-bench.

Runs greedy generations with the real engine and prints, over the same requests:
- prefill: the runner's timed prefill (decode calls + synchronize) against llama.cpp's
  prompt-eval time (target: within 2 %);
- `python_overhead_per_token_ms`, the stats field of run and chat: a decode step's wall time
  beyond the time inside llama.cpp's decode + synchronize calls and its sampling call (target:
  < 0.05 ms), and the part of those calls that llama.cpp's own eval counter leaves out;
- the floor: the same step as a bare ctypes loop (llama_decode, llama_synchronize,
  llama_sampler_sample and nothing else) after the same prompt, timed the same way, so the
  runner's own share is shown against code that does nothing else;
- tg128 side by side with llama-bench (same model, threads, -fa, repack), B A B, when
  `make llama-bench` has built it (or LLAMA_BENCH names one): llmrun's `bench` decodes
  without sampling, as llama-bench does.
Ratios come from the same runs, so a noisy machine moves both sides together.

    .venv/bin/python benchmarks/overhead.py [--model PATH] [--reps 5] [--prompt 512] [--gen 128]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vs_llama_bench import side_by_side  # the script beside this one

from llmrun.runners.base import Request, SamplingParams, generate
from llmrun.runners.config import EngineConfig
from llmrun.runners.handles import Sampler
from llmrun.runners.library import llama_lib
from llmrun.runners.llamacpp import LlamaCppRunner
from llmrun.runners.models import resolve_model
from tests import llama_tools

LLMRUN = str(Path(sys.executable).parent / "llmrun")
OVERHEAD_TARGET_MS = 0.05


def bare_step_ms(runner: LlamaCppRunner, prompt: list[int], n_gen: int) -> tuple[float, float]:
    """A loop that only decodes, synchronizes and samples (greedy), after the same prompt:
    milliseconds per step, and the part of a step outside the decode calls and the sampling
    call, timed as the runner times them (the floor of `python_overhead_per_token_ms`: what
    ctypes' entry and exit and the loop itself cost with nothing else to do)."""
    lib = llama_lib()
    runner.reset()
    runner.eval_tokens(prompt)
    ctx = runner.kv.ptr
    one = (lib.llama_token * 1)(prompt[-1])
    batch = lib.llama_batch_get_one(one, 1)
    chain = Sampler.greedy(lib)
    decode, sync, sample, chain_ptr = (
        lib.llama_decode,
        lib.llama_synchronize,
        chain._sample,
        chain.ptr,
    )
    perf = time.perf_counter
    inside = 0.0
    try:
        one[0] = sample(chain_ptr, ctx, -1)
        t0 = perf()
        for _ in range(n_gen):
            t_call = perf()
            decode(ctx, batch)
            sync(ctx)
            one[0] = sample(chain_ptr, ctx, -1)
            inside += perf() - t_call  # the decode, synchronize and sampling calls
        total = perf() - t0
        return total / n_gen * 1000, (total - inside) / n_gen * 1000
    finally:
        chain.close()
        runner.reset()


def llama_bench_binary() -> Path | None:
    """llama-bench where `make llama-bench` built it (never built from here)."""
    given = os.environ.get("LLAMA_BENCH")
    if given:
        return Path(given)
    return llama_tools.built_tool("llama-bench")


def versus_llama_bench(model: str, threads: int, flash_attn: str, rounds: int) -> None:
    binary = llama_bench_binary()
    if rounds < 1:
        print("tg128 vs llama-bench: skipped (--rounds 0)")
        return
    if binary is None:
        print("tg128 vs llama-bench: skipped (no llama-bench; `make llama-bench` builds it)")
        return
    fa = {"on": "1", "off": "0", "auto": "-1"}[flash_attn]
    side_by_side(
        [
            "-m",
            model,
            "-t",
            str(threads),
            "-fa",
            fa,
            "-ngl",
            "0",
            "-p",
            "0",
            "-n",
            "128",
            "-r",
            "3",
            *llama_tools.cpu_flags("llama-bench", model),  # as llmrun's probe decides its own
        ],
        rounds,
        str(binary),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--gen", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=3, help="B A B rounds against llama-bench")
    args = parser.parse_args()

    model = resolve_model(args.model).path
    runner = LlamaCppRunner(model, EngineConfig(n_ctx=2048, n_threads=args.threads))
    loaded = runner.load()
    st = loaded.settings
    print(
        f"model {loaded.model.name} · {st.n_threads} threads · flash attention {st.flash_attn}"
        f" ({'on' if st.flash_attn_enabled else 'off'}) · warm-up"
        f" {(loaded.warmup_s or 0) * 1000:.1f} ms",
        file=sys.stderr,
    )
    tokens = tuple(1000 + (i * 7919) % 20000 for i in range(args.prompt))
    sampling = SamplingParams(max_tokens=args.gen, temperature=0, ignore_eos=True)
    request = Request(token_ids=tokens, sampling=sampling, keep_cache=False)
    generate(runner, request)  # warm-up
    prefill, overhead, steps, floors, floor_beyond, uncounted = [], [], [], [], [], []
    for _ in range(args.reps):
        s = generate(runner, request).stats
        assert s.engine_prompt_eval_ms and s.engine_eval_ms and s.engine_n_eval
        assert s.python_overhead_per_token_ms is not None and s.sample_s is not None
        prefill.append(s.prefill_s * 1000 / s.engine_prompt_eval_ms)
        step_ms = sum(s.itl_s) * 1000 / len(s.itl_s)
        eval_ms = s.engine_eval_ms / s.engine_n_eval
        sample_ms = s.sample_s * 1000 / len(s.itl_s)
        assert s.decode_call_ms is not None and s.uncounted_decode_ms is not None
        overhead.append(s.python_overhead_per_token_ms)
        uncounted.append(s.uncounted_decode_ms)
        steps.append(step_ms)
        floor, beyond = bare_step_ms(runner, list(tokens), args.gen)
        floors.append(floor)
        floor_beyond.append(beyond)
        print(
            f"prefill {s.prompt_tps:7.1f} tok/s | decode {s.output_tps:6.1f} tok/s: step"
            f" {step_ms:6.3f} ms = calls {s.decode_call_ms:6.3f} (eval counter {eval_ms:6.3f})"
            f" + sample {sample_ms:6.3f} + llmrun {s.python_overhead_per_token_ms:6.4f}"
            f" | bare loop {floor:6.3f} ms, beyond its calls {beyond:6.4f}",
            file=sys.stderr,
        )
    runner.close()
    prefill_ratio, overhead_ms = statistics.median(prefill), statistics.median(overhead)
    print(
        f"prefill wall / llama.cpp prompt-eval      {prefill_ratio:7.4f}"
        f"  {'ok' if prefill_ratio <= 1.02 else 'OVER 1.02'}"
    )
    print(
        f"python_overhead_per_token_ms (median)     {overhead_ms:7.4f}"
        f"  {'ok' if overhead_ms < OVERHEAD_TARGET_MS else f'OVER {OVERHEAD_TARGET_MS}'}"
    )
    print(f"  of which a bare ctypes loop also spends  {statistics.median(floor_beyond):7.4f}")
    print(f"llama_decode outside its eval counter      {statistics.median(uncounted):7.4f}")
    print(
        f"decode step / bare ctypes loop (median)   "
        f"{statistics.median(steps) / statistics.median(floors):7.4f}"
    )
    versus_llama_bench(model, st.n_threads, st.flash_attn, args.rounds)
    return 0 if prefill_ratio <= 1.02 and overhead_ms < OVERHEAD_TARGET_MS else 1


if __name__ == "__main__":
    import script  # benchmarks/script.py: Ctrl-C is exit 130

    script.run(main)
