"""`llmrun history`: the stored bench runs, each against the run before it."""

from __future__ import annotations

from typing import Annotated

import typer

from llmrun.runners.history import History

from .bench import output as out
from .errors import StdoutConsole, handled


def history(
    limit: Annotated[int, typer.Option("-n", "--limit", min=1, help="How many runs.")] = 10,
    model: Annotated[
        str | None,
        typer.Option(
            "-m",
            "--model",
            show_default=False,
            help="Only runs of models whose name contains this.",
        ),
    ] = None,
) -> None:
    """The stored bench runs, newest first, each against the run before it."""
    with handled(), History() as h:
        console = StdoutConsole(highlight=False)
        runs = h.runs(limit=limit, model=model)
        if not runs:
            if model and h.runs(limit=1):
                console.print(f"no stored run's model name contains {model!r} (in {h.path})",
                              markup=False)  # fmt: skip
            else:
                console.print(f"no bench runs stored yet (in {h.path})", markup=False)
            return
        for run in runs:
            changes = h.compare(run["records"], before_run=run["id"])
            title = f"run {run['id']} · {run['time']} · {run['kind']} · {run['model']}"
            console.print(out.compare_table(changes, title))
