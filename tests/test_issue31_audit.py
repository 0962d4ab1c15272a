"""Defects an audit of issue 31 found by using `serve` and `run --endpoint` as their users do.

Each test states what the issue (or OpenAI's API, or llama-server) asks for and is marked
xfail(strict=True) until the behaviour is fixed: a fix makes it pass, and strict makes the suite
say so, so the mark is then removed.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from llmrun.cli.app import app
from llmrun.runners.serving.logprobs import described, legacy, token_logprob

from .stub_server import stub_server
from .test_rpc import PROMPT, _llmrun, rpc_build, two_servers  # noqa: F401  (fixtures)
from .test_serve import Server, chat, llmrun_serve, serve_env  # noqa: F401  (fixture)


@pytest.mark.xfail(
    strict=True,
    reason="legacy completions' top_logprobs leave out the sampled token when it is not among"
    " the top `logprobs`; OpenAI's API always returns it there (up to logprobs+1 entries), as"
    " vLLM does",
)
def test_legacy_top_logprobs_always_hold_the_sampled_token() -> None:
    pieces = {0: b"a", 1: b"b", 2: b"c", 3: b"d"}
    row = np.array([0.0, 1.0, 3.0, 2.0], np.float32)  # token 2 is the likeliest
    sampled = described(token_logprob(row, 0, 1), pieces.__getitem__)  # the least likely one
    lp = legacy((sampled,), 0)
    assert lp["tokens"] == ["a"]
    assert "a" in lp["top_logprobs"][0]  # the sampled token, beside the likeliest one
    assert "c" in lp["top_logprobs"][0]


@pytest.fixture(scope="module")
def server(serve_env: dict[str, str]) -> Iterator[Server]:  # noqa: F811
    with llmrun_serve(serve_env, "--no-dashboard") as s:
        yield s


@pytest.mark.xfail(
    strict=True,
    reason="a stop string inside a grammar-constrained answer cuts the JSON and the answer ends"
    " with finish_reason 'stop', the reason a finished, valid answer gets (OpenAI's client's"
    " parse() then raises a pydantic ValidationError); issue 31 asks for valid JSON every time"
    " or a clear finish_reason",
)
def test_a_stop_string_never_passes_cut_json_off_as_finished(server: Server) -> None:
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "country": {"type": "string", "maxLength": 12},
        },
        "required": ["name", "country"],
        "additionalProperties": False,
    }
    body = chat(
        "Give a city as JSON.",
        max_tokens=60,
        temperature=0,
        stop=[","],
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
    )
    r = server.post("/v1/chat/completions", body)
    if r.status_code == 400:  # refusing `stop` beside a grammar would keep the promise too
        return
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        json.loads(choice["message"]["content"])  # a finished answer must be JSON


@pytest.mark.xfail(
    strict=True,
    reason="lm-evaluation-harness's local-completions sends its prompts as token ids by default"
    " (tokenized_requests=True): a batch, so one prompt is [[ids]]; serve refuses an array of"
    " token arrays with 400 even when it holds one, so the loglikelihood requests issue 31"
    " names never reach the logprobs (llama-server and vLLM take it)",
)
def test_one_token_array_in_a_list_is_one_prompt_as_lm_eval_sends_it(server: Server) -> None:
    body = {"prompt": [[504, 3575, 282]], "max_tokens": 1, "temperature": 0}
    r = server.post("/v1/completions", {**body, "logprobs": 1, "echo": True})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["logprobs"]["tokens"]) == 4  # 3 of the prompt, 1 answer


@pytest.mark.xfail(
    strict=True,
    reason="run --endpoint prints the server's decode rate as predicted_n / predicted_ms, while"
    " this llama.cpp's llama-server (predicted_per_second), llmrun serve's timings and run's own"
    " local decode rate divide by the decode steps, predicted_n - 1: 6 tokens in 50 ms is"
    " 100 tok/s there, 120 here",
)
def test_run_endpoint_gives_the_servers_decode_rate_over_its_steps(
    cli: CliRunner, home: Path
) -> None:
    with stub_server() as url:  # predicted_n 6, predicted_ms 50.0
        result = cli.invoke(app, ["run", "hi", "--endpoint", url, "--no-dashboard"])
    assert result.exit_code == 0, result.stderr
    assert "decode 50.0 ms for 6 tokens · 100.0 tok/s" in " ".join(result.stderr.split())


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
