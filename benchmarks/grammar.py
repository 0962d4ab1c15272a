"""Grammar sampling's cost per token: free text against `json_object` and a realistic schema.

One request at a time through the batched engine (`llmrun serve`'s path), greedy, on one
loaded model: the same prompt decoded unconstrained (exactly --tokens, end of sequence ignored),
with `{"type": "json_object"}`'s grammar and with an order schema of realistic shape (nested
objects, an array of objects, an enum, bounded strings, a nullable field), each grammar held to
the request's sampler chain as `serve` holds it. The three alternate in a rotating order,
--rounds times. Printed per mode: decode tok/s (tokens after the first over their time), the
median ms per token (inter-token latency), the tokens generated; then each grammar's ratios to
unconstrained in the same run. A grammar's answer ends when its JSON does, so it may be shorter
than --tokens: the figures are per token.

    .venv/bin/python benchmarks/grammar.py [--rounds 3] [--tokens 128] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from typing import Any

from llmrun.runners.base import Request, SamplingParams
from llmrun.runners.config import EngineConfig
from llmrun.runners.grammar import response_grammar
from llmrun.runners.llamacpp import LlamaCppRunner
from llmrun.runners.models import resolve_model
from llmrun.runners.serving.batching import Arrival, BatchedEngine
from llmrun.runners.serving.policy import Policy

PROMPT = (
    "Write the order of a customer who bought several things in a hardware shop, as JSON:"
    " the customer, the items with their SKU, quantity and price, the status and a note."
)
ORDER: dict[str, Any] = {
    "type": "object",
    "properties": {
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 40},
                "email": {"type": "string", "maxLength": 60},
                "vip": {"type": "boolean"},
            },
            "required": ["name", "email", "vip"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "maxLength": 16},
                    "quantity": {"type": "integer"},
                    "price": {"type": "number"},
                },
                "required": ["sku", "quantity", "price"],
                "additionalProperties": False,
            },
            "minItems": 1,
            "maxItems": 8,
        },
        "status": {"enum": ["pending", "paid", "shipped", "cancelled"]},
        "note": {"anyOf": [{"type": "string", "maxLength": 200}, {"type": "null"}]},
    },
    "required": ["customer", "items", "status", "note"],
    "additionalProperties": False,
}
MODES: dict[str, dict[str, Any] | None] = {
    "unconstrained": None,
    "json_object": {"type": "json_object"},
    "json_schema": {"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER}},
}


@dataclass(frozen=True)
class Decode:
    tokens: int
    decode_tps: float
    ms_per_token: float  # the median inter-token latency


def decode(engine: BatchedEngine, prompt: tuple[int, ...], n: int, grammar: str | None) -> Decode:
    sampling = SamplingParams(max_tokens=n, temperature=0, ignore_eos=grammar is None)
    arrival = Arrival(0.0, prompt, n, grammar is None, sampling, grammar)
    (result,), _ = engine.run([arrival], Policy("prefill-first"))
    if result.finish not in ("stop", "length") or len(result.times) < 8:
        sys.exit(f"{len(result.times)} tokens, finish {result.finish!r} {result.error}")
    span = result.times[-1] - result.times[0]
    return Decode(
        len(result.output),
        (len(result.times) - 1) / span,
        1000 * statistics.median(result.gaps_s),
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = ap.parse_args()
    path = resolve_model(args.model).path
    runner = LlamaCppRunner(path, EngineConfig(n_ctx=1024, n_threads=args.threads))
    runner.load()
    prompt = tuple(runner.request_tokens(Request.chat(PROMPT)))
    grammars = {name: response_grammar(value) for name, value in MODES.items()}
    runs: dict[str, list[Decode]] = {name: [] for name in MODES}
    names = list(MODES)
    with BatchedEngine(runner, n_seq=1, n_ctx_per_seq=1024) as engine:
        decode(engine, prompt, 16, None)  # warm-up
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                runs[name].append(decode(engine, prompt, args.tokens, grammars[name]))
    runner.close()

    def median(name: str, key: str) -> float:
        return statistics.median(getattr(d, key) for d in runs[name])

    base_tps, base_ms = (
        median("unconstrained", "decode_tps"),
        median("unconstrained", "ms_per_token"),
    )
    if args.json:
        ratios = {
            name: {
                "decode_tps": median(name, "decode_tps") / base_tps,
                "ms_per_token": median(name, "ms_per_token") / base_ms,
            }
            for name in names[1:]
        }
        runs_out = {name: [asdict(d) for d in ds] for name, ds in runs.items()}
        print(json.dumps({"model": path, "runs": runs_out, "ratios": ratios}))
        return 0
    for name in names:
        tps, ms = median(name, "decode_tps"), median(name, "ms_per_token")
        spread = [d.decode_tps for d in runs[name]]
        tokens = sorted({d.tokens for d in runs[name]})
        print(
            f"{name:<14} decode {tps:7.1f} tok/s (range {min(spread):.1f}-{max(spread):.1f}),"
            f" {ms:6.2f} ms/token, {'/'.join(map(str, tokens))} tokens"
        )
    for name in names[1:]:
        print(
            f"{name} / unconstrained: decode tok/s x{median(name, 'decode_tps') / base_tps:.2f},"
            f" ms/token x{median(name, 'ms_per_token') / base_ms:.2f}"
            f" (median of {args.rounds} rounds)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
