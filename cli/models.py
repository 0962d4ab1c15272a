"""`llmrun pull` and `llmrun models`: get GGUF files and see what is here."""

from __future__ import annotations

import os
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from llmrun.runners.models import list_models, resolve_model

from .errors import handled


def human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{size:,.0f} {unit}" if unit == "B" else f"{size:,.1f} {unit}"
        size /= 1000
    return f"{n} B"


def human_count(n: int) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return str(n)


def pull(
    ref: Annotated[
        str, typer.Argument(help="owner/repo, owner/repo:QUANT or owner/repo/file.gguf")
    ],
) -> None:
    """Download a GGUF model from the Hugging Face Hub into its cache, without running it."""
    with handled():
        resolved = resolve_model(ref)
        typer.echo(resolved.path)


def models() -> None:
    """List the embedded default model and the GGUF files in the Hugging Face cache."""
    with handled():
        table = Table()
        for name in ("model", "quant", "params", "size", "arch", "path"):
            table.add_column(name, justify="right" if name in ("params", "size") else "left")
        for m in list_models():
            if m.info is None:
                table.add_row(m.ref, "?", "?", human_bytes(m.size_bytes), m.problem or "", m.path)
                continue
            table.add_row(
                m.ref,
                m.info.quantization,
                human_count(m.info.n_params),
                human_bytes(m.size_bytes),
                m.info.architecture,
                os.path.relpath(m.path) if m.source == "default" else m.path,
            )
        Console(width=None if os.isatty(1) else 200).print(table)
