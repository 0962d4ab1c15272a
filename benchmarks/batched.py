"""llmrun's batched engine against llama.cpp's llama-batched-bench, side by side on one build.

For each number of sequences B in --npl, B prompts of --npp random tokens arrive at once and each
sequence then decodes --ntg tokens, all of them in one llama_decode per step, as
llama-batched-bench does (prompts first, then one step per token for every sequence). The engine
generates ntg + 1 tokens, since its first token comes from the prompt's logits: both then run
exactly ntg decode steps over B*(npp + ntg) tokens. Same threads, batch size and flash attention;
the two tools alternate (A B A B ...). Printed, as ratios llmrun / llama-batched-bench:
- total tok/s, B*(npp + ntg) over the wall time from the first prompt step to the last token;
- decode step time: llmrun's inter-token gaps (decode + sampling + bookkeeping) against
  llama-batched-bench's T_TG / ntg (decode alone);
- at B = 1, the engine's ITL against the runner's own plain decode (`llmrun run`'s path).
Targets (issue 20): total >= 0.9x at 8 and 32 sequences; the 1-sequence ITL within 5 %.

    .venv/bin/python benchmarks/batched.py [--npp 64] [--ntg 32] [--npl 1,8,32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from llmrun.runners.base import Request, SamplingParams, generate
from llmrun.runners.config import EngineConfig
from llmrun.runners.llamacpp import LlamaCppRunner
from llmrun.runners.models import resolve_model
from llmrun.runners.serving.batching import Arrival, BatchedEngine
from llmrun.runners.serving.policy import Policy

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.llama_tools import cpu_flags, llama_batched_bench


@dataclass(frozen=True)
class Run:
    total_tps: float
    step_ms: float  # one decode step for all sequences


def engine_run(engine: BatchedEngine, npp: int, ntg: int, n_seq: int, seed: int) -> Run:
    rng = random.Random(seed)
    arrivals = [
        Arrival(
            0.0, tuple(rng.randrange(1000, 40000) for _ in range(npp)), ntg + 1, ignore_eos=True
        )
        for _ in range(n_seq)
    ]
    results, steps = engine.run(arrivals, Policy("prefill-first"))
    assert all(len(r.output) == ntg + 1 for r in results), "a sequence stopped early"
    wall = max(r.times[-1] for r in results) - steps[0].start_s
    gaps = [g for r in results for g in r.gaps_s]
    return Run(n_seq * (npp + ntg) / wall, 1000 * statistics.median(gaps))


def batched_bench_argv(
    path: str, args: argparse.Namespace, threads: int, fa: str, *, ctx: int
) -> list[str]:
    """llama-batched-bench's command line for these settings (kv_layout.py's too), with the
    flags this CPU needs (repacking off where llmrun's probe forbids it: on an AMX CPU the tool
    died by SIGILL without them)."""
    return [
        str(llama_batched_bench()),
        "-m",
        path,
        "-c",
        str(ctx),
        "-b",
        str(args.n_batch),
        "-ub",
        str(args.n_batch),
        "-npp",
        str(args.npp),
        "-ntg",
        str(args.ntg),
        "-npl",
        args.npl,
        "-t",
        str(threads),
        "-fa",
        fa,
        "-ngl",
        str(args.ngl),
        *cpu_flags("llama-batched-bench", path),
    ]


def batched_bench(path: str, args: argparse.Namespace, threads: int, fa: str) -> dict[int, Run]:
    argv = batched_bench_argv(path, args, threads, fa, ctx=args.ctx)
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"llama-batched-bench failed: {done.stderr.strip()[-600:]}")
    rows = [line.strip("|").split("|") for line in done.stdout.splitlines() if line.startswith("|")]
    head = [h.strip() for h in rows[0]]
    out = {}
    for row in rows[2:]:
        cell = dict(zip(head, (c.strip() for c in row), strict=True))
        out[int(cell["B"])] = Run(float(cell["S t/s"]), 1000 * float(cell["T_TG s"]) / args.ntg)
    return out


def plain_itl_ms(runner: LlamaCppRunner, npp: int, ntg: int, seed: int) -> float:
    rng = random.Random(seed)
    tokens = tuple(rng.randrange(1000, 40000) for _ in range(npp))
    sampling = SamplingParams(max_tokens=ntg + 1, temperature=0, ignore_eos=True)
    stats = generate(runner, Request(token_ids=tokens, sampling=sampling, keep_cache=False)).stats
    return 1000 * statistics.median(stats.itl_s)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--npp", type=int, default=64)
    ap.add_argument("--ntg", type=int, default=32)
    ap.add_argument("--npl", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--n-batch", type=int, default=512)
    ap.add_argument("--ngl", type=int, default=99)
    ap.add_argument(
        "--kv-unified",
        type=int,
        choices=(0, 1),
        default=None,
        help="the engine's KV cache: 1 one buffer for all sequences, 0 one stream per"
        " sequence, as llama-batched-bench (default: the engine's)",
    )
    args = ap.parse_args()
    levels = [int(x) for x in args.npl.split(",")]
    args.ctx = max(levels) * (args.npp + args.ntg + 8)
    path = resolve_model(args.model).path
    runner = LlamaCppRunner(path, EngineConfig(n_ctx=args.npp + args.ntg + 16))
    loaded = runner.load()
    threads, fa = loaded.settings.n_threads, loaded.settings.flash_attn
    print(
        f"{loaded.model.name} · {threads} threads · flash attention {fa} · npp {args.npp}"
        f" ntg {args.ntg} · {args.rounds} rounds",
        file=sys.stderr,
    )
    unified = False if args.kv_unified is None else bool(args.kv_unified)  # the engine's default
    engines = {
        b: BatchedEngine(
            runner,
            n_seq=b,
            n_ctx_per_seq=args.npp + args.ntg + 8,
            n_batch=args.n_batch,
            kv_unified=unified,
        )
        for b in levels
    }
    for b, engine in engines.items():  # warm-up, as llama-batched-bench does
        engine_run(engine, args.npp, 2, b, seed=0)
    plain_itl_ms(runner, args.npp, 2, seed=0)
    total: dict[int, list[float]] = {b: [] for b in levels}
    step: dict[int, list[float]] = {b: [] for b in levels}
    itl: list[float] = []
    for i in range(args.rounds):
        ours: dict[int, Run] = {}
        plain: float | None = None
        theirs = batched_bench(path, args, threads, fa) if i % 2 else None
        for b in levels:
            ours[b] = engine_run(engines[b], args.npp, args.ntg, b, seed=1 + i)
        if 1 in levels:
            plain = plain_itl_ms(runner, args.npp, args.ntg, seed=1 + i)
        theirs = theirs or batched_bench(path, args, threads, fa)
        for b in levels:
            total[b].append(ours[b].total_tps / theirs[b].total_tps)
            step[b].append(ours[b].step_ms / theirs[b].step_ms)
            print(
                f"round {i + 1} B={b:<3} llmrun {ours[b].total_tps:8.1f} tok/s step"
                f" {ours[b].step_ms:7.2f} ms | llama-batched-bench {theirs[b].total_tps:8.1f}"
                f" tok/s step {theirs[b].step_ms:7.2f} ms",
                file=sys.stderr,
            )
        if plain is not None:
            itl.append(ours[1].step_ms / plain)
            print(
                f"round {i + 1} B=1 engine ITL {ours[1].step_ms:.2f} ms | plain decode ITL"
                f" {plain:.2f} ms",
                file=sys.stderr,
            )
    for engine in engines.values():
        engine.close()
    runner.close()
    for b in levels:
        ratio_total, ratio_step = statistics.median(total[b]), statistics.median(step[b])
        print(
            f"B={b}: total tok/s x{ratio_total:.3f} of llama-batched-bench, decode step"
            f" x{ratio_step:.3f} (median of {args.rounds})"
        )
    if itl:
        print(f"B=1: the engine's ITL x{statistics.median(itl):.3f} of plain decode")
    return 0


if __name__ == "__main__":
    import script  # benchmarks/script.py: Ctrl-C is exit 130

    script.run(main)
