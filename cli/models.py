"""`llmrun pull` and `llmrun models`: get GGUF files and see what is here."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Annotated

import typer

from llmrun.runners.errors import REF_CHARS, BadRequestError, InvalidModelFileError, OptionError
from llmrun.runners.gguf import read_gguf
from llmrun.runners.models import ListedModel, is_hub_ref, list_models, resolve_model
from llmrun.runners.stats import human_count

from .errors import StdoutConsole, handled
from .report import Fitted, fitted_table
from .terminal import terminal_echo, terminal_line


def pull(
    ref: Annotated[
        str, typer.Argument(help="owner/repo, owner/repo:QUANT or owner/repo/file.gguf")
    ],
) -> None:
    """Download a GGUF model from the Hugging Face Hub into its cache, without running it."""
    ref = ref.strip()
    with handled():
        if not is_hub_ref(ref):  # a path, or nothing: there is nothing to download
            raise OptionError(
                f"pull: '{terminal_echo(ref, REF_CHARS)}' is no Hub reference; give"
                " owner/repo, owner/repo:QUANT or owner/repo/file.gguf"
            )
        path = resolve_model(ref).path
        try:  # a cached copy that is empty or cut short is no success: -m would refuse it
            read_gguf(path)
        except InvalidModelFileError as e:
            if not e.problem.startswith(("truncated", "not a GGUF file")):
                raise  # a new download would not change it (a version, a header llmrun refuses)
            raise BadRequestError(
                f"{e}: the Hugging Face cache's copy is damaged; delete it, then pull again"
            ) from None
        # a pipe gets the name whole (typer.echo takes out colour codes alone, even there)
        print(terminal_line(path) if os.isatty(1) else path, flush=True)


def models() -> None:
    """List the embedded default model and the GGUF files in the Hugging Face cache."""
    with handled():
        StdoutConsole(width=None if os.isatty(1) else 200).print(models_table(list_models()))


def models_table(listed: Iterable[ListedModel]) -> Fitted:
    """A row per model file; its path may fold, its figures never. A file's name, a repo's and a
    model's own strings (its architecture) are made safe: any of them may hold escapes."""
    heads = ("model", "quant", "params", "file size", "arch", "path")
    table = fitted_table(None, heads, ("model", "quant", "arch", "path"), wrap=("path",))
    for m in listed:
        if m.info is None:
            cells = (m.ref, "?", "?", human_count(m.size_bytes, "B"), m.problem or "", m.path)
        else:
            cells = (
                m.ref,
                m.info.quantization,
                human_count(m.info.n_params),
                human_count(m.size_bytes, "B"),
                m.info.architecture,
                _shown(m.path) if m.source == "default" else m.path,
            )
        table.add_row(*map(terminal_line, cells))
    return table


def _shown(path: str) -> str:
    """The embedded model's path relative to here where it is below here (a checkout's .venv),
    else whole: `../../work/x` says less than `/work/x`."""
    relative = os.path.relpath(path)
    return path if relative.startswith(os.pardir) else relative
