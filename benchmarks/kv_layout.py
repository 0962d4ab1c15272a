"""The batched engine's two KV layouts side by side: one buffer for all sequences (unified,
llama.cpp's -kvu) against one stream per sequence (the engine's default, as llama.cpp's contexts
and llama-batched-bench's), each next to llama-batched-bench in the same layout.

For each B in --npl, B prompts of --npp random tokens arrive at once and every sequence decodes
--ntg tokens, one llama_decode per step for all (benchmarks/batched.py's measurement). The two
layouts and the reference alternate, in a different order each round. Printed (stdout): per B
and layout, the median total tok/s and decode step, llama-batched-bench's in the same layout,
and which layout the engine runs faster; `--jsonl` prints one object per B and layout instead.
`--no-reference` skips llama-batched-bench (a CPU check of the script itself).

    .venv/bin/python benchmarks/kv_layout.py [--model M] [--npp 64] [--ntg 32] [--npl 8,32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from dataclasses import dataclass

from batched import Run, batched_bench_argv, engine_run

from llmrun.runners.config import EngineConfig
from llmrun.runners.library import max_sequences
from llmrun.runners.llamacpp import LlamaCppRunner
from llmrun.runners.models import resolve_model
from llmrun.runners.serving.batching import BatchedEngine

LAYOUTS = (True, False)  # unified, one stream per sequence


def layout_name(unified: bool) -> str:
    return "unified KV" if unified else "one KV stream per sequence"


def reference(
    path: str, args: argparse.Namespace, *, unified: bool, threads: int, fa: str
) -> dict[int, Run]:
    """llama-batched-bench's total tok/s and decode step per B, in the same layout."""
    levels = [int(x) for x in args.npl.split(",")]
    argv = [
        *batched_bench_argv(path, args, threads, fa, ctx=max(levels) * (args.npp + args.ntg + 8)),
        "--output-format",
        "jsonl",
        *(["-kvu"] if unified else []),
    ]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"llama-batched-bench failed: {done.stderr.strip()[-600:]}")
    out = {}
    for line in (done.stdout + "\n" + done.stderr).splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            out[int(r["pl"])] = Run(float(r["speed"]), 1000 * float(r["t_tg"]) / args.ntg)
    return out


@dataclass
class Measured:
    total_tps: list[float]
    step_ms: list[float]
    ref_total_tps: list[float]
    ref_step_ms: list[float]


def _levels(text: str) -> str:
    """--npl: one sequence has one KV layout (the assert that both were made always failed
    at B=1), so every B is at least 2, and at most the sequences one context holds."""
    most = max_sequences()
    try:
        ok = all(2 <= int(x) <= most for x in text.split(","))
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"{text!r}: whole numbers from 2 to {most}, as 8,32")
    return text


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--npp", type=int, default=64)
    ap.add_argument("--ntg", type=int, default=32)
    ap.add_argument("--npl", type=_levels, default="8,32", help="Bs of 2 or more, comma-separated")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--n-batch", type=int, default=512)
    ap.add_argument("--ngl", type=int, default=99)
    ap.add_argument("--no-reference", action="store_true", help="skip llama-batched-bench")
    ap.add_argument("--jsonl", action="store_true", help="one JSON object per B and layout")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    levels = [int(x) for x in args.npl.split(",")]
    path = resolve_model(args.model).path
    per_seq = args.npp + args.ntg + 8
    runner = LlamaCppRunner(path, EngineConfig(n_ctx=per_seq + 8))
    loaded = runner.load()
    threads, fa = loaded.settings.n_threads, loaded.settings.flash_attn
    print(
        f"{loaded.model.name} · {loaded.settings.device} · {threads} threads · flash"
        f" attention {fa} · npp {args.npp} ntg {args.ntg} · {args.rounds} rounds",
        file=sys.stderr,
    )
    engines = {
        (b, u): BatchedEngine(
            runner, n_seq=b, n_ctx_per_seq=per_seq, n_batch=args.n_batch, kv_unified=u
        )
        for b in levels
        for u in LAYOUTS
    }
    for (b, u), engine in engines.items():  # warm-up, as llama-batched-bench does
        assert engine.kv_unified is u, "llama.cpp made another layout than asked"
        engine_run(engine, args.npp, 2, b, seed=0)
    got = {key: Measured([], [], [], []) for key in engines}
    for i in range(args.rounds):
        order = LAYOUTS if i % 2 == 0 else LAYOUTS[::-1]
        for u in order:
            theirs = (
                None
                if args.no_reference
                else reference(path, args, unified=u, threads=threads, fa=fa)
            )
            for b in levels:
                ours = engine_run(engines[b, u], args.npp, args.ntg, b, seed=1 + i)
                m = got[b, u]
                m.total_tps.append(ours.total_tps)
                m.step_ms.append(ours.step_ms)
                line = (
                    f"round {i + 1} B={b:<3} {layout_name(u):<27} llmrun"
                    f" {ours.total_tps:8.1f} tok/s step {ours.step_ms:7.2f} ms"
                )
                if theirs is not None:
                    m.ref_total_tps.append(theirs[b].total_tps)
                    m.ref_step_ms.append(theirs[b].step_ms)
                    line += (
                        f" | llama-batched-bench {theirs[b].total_tps:8.1f} tok/s step"
                        f" {theirs[b].step_ms:7.2f} ms"
                    )
                print(line, file=sys.stderr)
    for engine in engines.values():
        engine.close()
    runner.close()

    def med(xs: list[float]) -> float | None:
        return statistics.median(xs) if xs else None

    for b in levels:
        for u in LAYOUTS:
            m = got[b, u]
            row = {
                "B": b,
                "kv_unified": u,
                "npp": args.npp,
                "ntg": args.ntg,
                "rounds": args.rounds,
                "total_tps": med(m.total_tps),
                "step_ms": med(m.step_ms),
                "ref_total_tps": med(m.ref_total_tps),
                "ref_step_ms": med(m.ref_step_ms),
            }
            if args.jsonl:
                print(json.dumps(row))
                continue
            text = (
                f"B={b} {layout_name(u)}: llmrun {row['total_tps']:,.1f} tok/s, step"
                f" {row['step_ms']:.2f} ms"
            )
            if row["ref_total_tps"]:
                text += (
                    f" | llama-batched-bench {row['ref_total_tps']:,.1f} tok/s"
                    f" (x{row['total_tps'] / row['ref_total_tps']:.3f})"
                )
            print(text)
        if not args.jsonl:
            unified, split = (statistics.median(got[b, u].total_tps) for u in LAYOUTS)
            faster = "unified" if unified > split else "one stream per sequence"
            print(
                f"B={b}: unified / per-sequence total tok/s = x{unified / split:.3f}: {faster}"
                " is faster here"
            )
    return 0


if __name__ == "__main__":
    import script  # benchmarks/script.py: Ctrl-C is exit 130

    script.run(main)
