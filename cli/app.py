"""Wires the commands together; each command lives in its own module."""

from __future__ import annotations

import typer
import typer.core

from . import chat, doctor, history, models, run, serve
from .bench import interference, sweep, tune
from .bench import serve as bench_serve

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
bench = typer.Typer(
    invoke_without_command=True,
    no_args_is_help=False,
    help="Measure this machine: llama-bench's tests and sweeps, serving load, interference.",
    # llama-bench reads --n_prompt as --n-prompt (every "--" option's _ as -)
    context_settings={"token_normalize_func": lambda name: name.replace("_", "-")},
)
bench.callback(invoke_without_command=True)(sweep.bench)
bench.command("serve")(bench_serve.serve)
bench.command("interference")(interference.interference)
app.add_typer(bench, name="bench")
app.command("tune")(tune.tune)
app.command("history")(history.history)
app.command("pull")(models.pull)
app.command("models")(models.models)
app.command("serve")(serve.serve)
app.command("doctor")(doctor.doctor)


@app.callback(invoke_without_command=True)
def main(
    version: bool = typer.Option(False, "--version", help="Print the version and exit."),
) -> None:
    """Run local GGUF language models and see where the time goes: load, prefill, decode."""
    if version:
        print(doctor.version_line())
        print("(llmrun doctor: the build, devices, CPU features and the choices it makes)")
        raise typer.Exit(0)


_display_type_rich = typer.core.TyperOption.display_type_rich


def _no_type_for_flags(self: typer.core.TyperOption, ctx: typer.core._click.Context) -> str | None:
    """A flag takes no value: its help row shows none (typer shows `<bool>`, which reads as if
    `--raw true` were expected)."""
    return None if self.is_flag else _display_type_rich(self, ctx)


typer.core.TyperOption.display_type_rich = _no_type_for_flags  # type: ignore[method-assign]
