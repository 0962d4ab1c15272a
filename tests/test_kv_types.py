"""The KV cache types llmrun accepts (-ctk/-ctv): each one handed to llama.cpp as ggml's own
type id, bf16 among them, which the bindings do not name."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from llmrun.cli.app import app
from llmrun.runners.config import EngineConfig
from llmrun.runners.contexts import own_context_params
from llmrun.runners.limits import CACHE_TYPE_IDS, CACHE_TYPES
from llmrun.runners.llama_cpp_adapter import package_dir


def test_every_accepted_type_has_ggmls_id() -> None:
    """The table is the only source: the bindings lack GGML_TYPE_BF16, so `-ctk bf16` passed
    the option check, then failed as 'could not load …gguf: unknown KV cache type'. Where the
    bindings or the installed ggml.h name a type, they agree with the table."""
    import llama_cpp

    assert tuple(CACHE_TYPE_IDS) == CACHE_TYPES
    for name, ggml_type in CACHE_TYPE_IDS.items():
        bound = getattr(llama_cpp, f"GGML_TYPE_{name.upper()}", None)
        assert bound in (None, ggml_type), name
    folder = package_dir()
    header = folder.parent / "include" / "ggml.h" if folder else None
    if header is None or not header.is_file():
        pytest.skip("no ggml.h installed with llama_cpp")
    enum = dict(re.findall(r"GGML_TYPE_(\w+)\s*=\s*(\d+),", header.read_text()))
    for name, ggml_type in CACHE_TYPE_IDS.items():
        assert int(enum[name.upper()]) == ggml_type, name


@pytest.mark.parametrize("name", CACHE_TYPES)
def test_each_type_reaches_the_context_params(name: str) -> None:
    cfg = EngineConfig(cache_type_k=name, cache_type_v=name, flash_attn="on")
    cparams = own_context_params("m.gguf", cfg, n_ctx=64, n_seq=1, asked=64)
    assert (cparams.type_k, cparams.type_v) == (CACHE_TYPE_IDS[name],) * 2


def test_a_bf16_kv_cache_runs(cli: CliRunner, model_path: str) -> None:
    """llama.cpp's CPU backend keeps a bf16 cache; the run said the model file was at fault."""
    result = cli.invoke(
        app, ["run", "-ctk", "bf16", "-ctv", "bf16", "-fa", "on", "-n", "2", "-c", "64", "hi"]
    )
    assert result.exit_code == 0, result.stderr
    assert "bf16/bf16" in result.stderr
