"""Prefill-decode interference on this machine: a decoding stream's gaps under each policy.

Runs `llmrun bench --interference` without --endpoint (in-process, llama.cpp's multi-sequence
batches) and prints, for each policy, the stream's ITL p99 and the long prompts' TTFT as ratios
to prefill-first, measured in the same run.

    .venv/bin/python benchmarks/policies.py [--rounds 2] [--prompt-len 512] [--rate 2]
"""

from __future__ import annotations

import argparse
import statistics

from serve import LLMRUN, json_records


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--rate", type=float, default=2.0)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--output-len", type=int, default=96)
    ap.add_argument("--policy", default="prefill-first,chunked:64,chunked:128,decode-first")
    args = ap.parse_args()
    ratios: dict[str, dict[str, list[float]]] = {}
    for i in range(args.rounds):
        records = json_records(
            [
                LLMRUN,
                "bench",
                "--interference",
                "--policy",
                args.policy,
                "--num-prompts",
                str(args.prompts),
                "--interference-prompt-len",
                str(args.prompt_len),
                "--interference-rate",
                str(args.rate),
                "--output-len",
                str(args.output_len),
                "--seed",
                str(1234 + i),
            ],
            "llmrun bench --interference failed",
        )
        rows = {r["policy"]: r for r in records}
        base = rows["prefill-first"]
        for name, r in rows.items():
            ttft = r["long_ttft_mean_ms"] or 0
            print(
                f"round {i + 1} {name:<14} ITL p50 {r['itl_p50_ms']:8.1f} ms  p99"
                f" {r['itl_p99_ms']:8.1f} ms  max {r['itl_max_ms']:8.1f} ms  long TTFT"
                f" {ttft:8.0f} ms  {r['throughput_tps']:6.1f} tok/s"
            )
            if name in ("alone", "prefill-first"):
                continue
            entry = ratios.setdefault(name, {"p99": [], "ttft": [], "tps": []})
            entry["p99"].append(r["itl_p99_ms"] / base["itl_p99_ms"])
            entry["ttft"].append((r["long_ttft_mean_ms"] or 0) / (base["long_ttft_mean_ms"] or 1))
            entry["tps"].append(r["throughput_tps"] / base["throughput_tps"])
    for name, entry in ratios.items():
        p99, ttft, tps = (statistics.median(entry[k]) for k in ("p99", "ttft", "tps"))
        print(
            f"{name} / prefill-first: stream ITL p99 x{p99:.2f}, long-prompt TTFT x{ttft:.2f},"
            f" throughput x{tps:.2f} (median of {args.rounds} rounds)"
        )
    return 0


if __name__ == "__main__":
    import script  # benchmarks/script.py: Ctrl-C is exit 130

    script.run(main)
