"""Wires the commands together; each command lives in its own module."""

from __future__ import annotations

import typer

from . import chat, history, models, run, serve
from .bench import sweep as bench

app = typer.Typer(
    name="llmrun",
    help="Run local GGUF language models and see where the time goes: load, prefill, decode.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.command("run")(run.run)
app.command("chat")(chat.chat)
app.command("bench")(bench.bench)
app.command("history")(history.history)
app.command("pull")(models.pull)
app.command("models")(models.models)
app.command("serve")(serve.serve)
