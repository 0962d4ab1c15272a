"""Defects an audit of issue 31 found by using `serve` and `run --endpoint` as their users do.

Each test states what the issue (or OpenAI's API, or llama-server) asks for and is marked
xfail(strict=True) until the behaviour is fixed: a fix makes it pass, and strict makes the suite
say so, so the mark is then removed.
"""

from __future__ import annotations

import subprocess

import pytest

from .test_rpc import PROMPT, _llmrun, rpc_build, two_servers  # noqa: F401  (fixtures)
from .test_serve import Server, chat, llmrun_serve, serve_env  # noqa: F401  (fixture)


@pytest.mark.xfail(
    strict=True,
    reason="with --rpc the memory line splits the weights by device but gives the KV cache (and"
    " the compute buffers) as one total: with -ngl 20, llama.cpp puts 20 of the 31 layers' KV on"
    " the servers (its log: 'llama_kv_cache: RPC0[host:port] KV buffer size'), and issue 31 asks"
    " every figure to name per device its layers and memory",
)
def test_the_memory_line_names_each_devices_kv_with_rpc(
    two_servers: tuple[list[subprocess.Popen[bytes]], str],  # noqa: F811
    llmrun_env: dict[str, str],
) -> None:
    _, servers = two_servers
    first, _second = servers.split(",")
    split = _llmrun(
        ["run", "--temp", "0", "-n", "4", "-c", "256", "-ngl", "20", "--rpc", servers, PROMPT],
        llmrun_env,
    )
    assert split.returncode == 0, split.stderr
    (memory,) = [line for line in split.stderr.splitlines() if line.startswith("memory")]
    kv = memory.split(" KV ", 1)[1]
    assert f"RPC0[{first}]" in kv, memory
