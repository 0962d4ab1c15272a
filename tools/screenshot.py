"""Draw the README's picture: a real run on the embedded model, shown by the dashboard's own
renderers (the live panel mid-decode, then the closing summary) into rich's recording console,
saved as SVG. `make screenshot` runs it; nothing in the picture is typed in by hand."""

from __future__ import annotations

import argparse
import io
from pathlib import Path

from rich.console import Console
from rich.rule import Rule

from llmrun.cli.dashboard import LiveState, render, render_live
from llmrun.cli.engine import make_runner
from llmrun.runners.base import Finished, Request, SamplingParams, Token
from llmrun.runners.config import EngineConfig

PROMPT = (Path(__file__).resolve().parent.parent / "examples" / "long_prompt.txt").read_text()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("docs/dashboard.svg"))
    parser.add_argument("--width", type=int, default=80)
    parser.add_argument("-n", "--max-tokens", type=int, default=120)
    args = parser.parse_args()

    runner = make_runner(None, EngineConfig())
    request = Request.chat(
        PROMPT, sampling=SamplingParams(max_tokens=args.max_tokens, temperature=0.7, seed=42)
    )
    state, frame, stats = LiveState(), None, None
    for event in runner.stream(request):
        state.apply(event)
        if isinstance(event, Token) and event.index == args.max_tokens // 2:
            frame = render_live(state)  # the live panel as it stood halfway through decode
        if isinstance(event, Finished):
            stats = event.stats
    if frame is None or stats is None:
        raise SystemExit("screenshot: the run ended before its halfway token")

    console = Console(
        record=True,
        width=args.width,
        force_terminal=True,
        color_system="truecolor",
        file=io.StringIO(),
    )
    console.print(Rule("llmrun run -f examples/long_prompt.txt: during decode", style="dim"))
    console.print(frame)
    console.print(Rule("after the request: the closing summary", style="dim"))
    console.print(render(stats))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    console.save_svg(str(args.out), title="llmrun")
    print(args.out)


if __name__ == "__main__":
    main()
